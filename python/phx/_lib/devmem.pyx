# cython: language_level=3
"""Thin bindings of libphx's /dev/phx mappings (see phx.devmem)."""
from cpython.buffer cimport PyBuffer_FillInfo
from libc.stdint cimport uint64_t, uintptr_t

from phx._lib.libphx cimport *

import os as _os


cdef object _raise(int rc):
    detail = phx_strerror_last().decode(errors="replace")
    raise OSError(-rc, f"{_os.strerror(-rc)} ({detail})" if detail else _os.strerror(-rc))


def probe() -> tuple:
    """(True, reason) when /dev/phx is usable, else (False, why not)."""
    cdef int rc
    with nogil:
        rc = phx_devmem_probe()
    if rc < 0:
        return False, phx_strerror_last().decode(errors="replace")
    return True, "/dev/phx answers (ABI matches)"


cdef class DeviceMemory:
    """Device memory mapped into this process through /dev/phx.

    Supports the buffer protocol: pass it (or a memoryview slice of it) to
    :meth:`phx.File.pread`/``pwrite`` on an O_DIRECT file and the device DMAs
    between the SSD and the device memory with no host copy.
    """
    cdef phx_devmem *m
    cdef phx_devmem_info info
    cdef int exports

    cdef _adopt(self, phx_devmem *m):
        self.m = m
        phx_devmem_get_info(m, &self.info)

    def __dealloc__(self):
        if self.m != NULL:
            phx_devmem_unmap(self.m)
            self.m = NULL

    @property
    def address(self) -> int:
        """Host address of the mapping."""
        return <uintptr_t>self.info.addr

    def __len__(self):
        return self.info.length if self.m != NULL else 0

    @property
    def mode(self) -> str:
        """Kind of struct pages behind it: 'p2pdma' or 'generic'."""
        return "p2pdma" if self.info.mode == PHX_DEVMEM_P2PDMA else "generic"

    def __getbuffer__(self, Py_buffer *view, int flags):
        if self.m == NULL:
            raise ValueError("device memory is unmapped")
        PyBuffer_FillInfo(view, self, self.info.addr, self.info.length, 0, flags)
        self.exports += 1

    def __releasebuffer__(self, Py_buffer *view):
        self.exports -= 1

    def close(self) -> None:
        """Unmap and unregister (no buffer views may remain)."""
        cdef int rc
        if self.m == NULL:
            return
        if self.exports:
            raise BufferError(f"{self.exports} buffer views of the mapping are still alive")
        rc = phx_devmem_unmap(self.m)
        self.m = NULL
        if rc < 0:
            _raise(rc)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def map_pci_bar(int domain, int bus, int devfn, int bar, uint64_t offset,
                uint64_t length) -> DeviceMemory:
    """Map ``length`` bytes at ``offset`` of a PCI BAR (root only)."""
    cdef phx_devmem *m = NULL
    cdef int rc
    with nogil:
        rc = phx_devmem_map_pci_bar(domain, bus, devfn, bar, offset, length, &m)
    if rc < 0:
        _raise(rc)
    d = DeviceMemory.__new__(DeviceMemory)
    (<DeviceMemory>d)._adopt(m)
    return d


def map_gpu(uint64_t ptr, uint64_t length) -> DeviceMemory:
    """Map the caller's GPU memory [ptr, ptr + length) (NVIDIA driver)."""
    cdef phx_devmem *m = NULL
    cdef int rc
    with nogil:
        rc = phx_devmem_map_gpu(ptr, length, &m)
    if rc < 0:
        _raise(rc)
    d = DeviceMemory.__new__(DeviceMemory)
    (<DeviceMemory>d)._adopt(m)
    return d
