# cython: language_level=3, boundscheck=False, wraparound=False
"""Thin bindings of phx_nvme.h: NVMe namespaces through io_uring passthrough.

Each method converts its arguments, calls libphx with the GIL released and
turns a negative errno into an exception; :mod:`phx.nvme` is the public face.
"""
from cpython.buffer cimport (PyBUF_ANY_CONTIGUOUS, PyBUF_WRITABLE, PyBuffer_Release,
                             PyObject_GetBuffer)
from libc.stdint cimport int64_t, uint32_t, uint64_t, uintptr_t
from libc.stdlib cimport calloc, free

from phx._lib.libphx_nvme cimport *

cimport cython

import os as _os


class NvmeError(OSError):
    """A failed NVMe operation.  ``status`` is the NVMe status (SCT << 8 | SC)
    when the controller rejected a command, else 0; ``errno`` as for OSError."""

    def __init__(self, err, msg, path=None, status=0):
        if path is None:
            super().__init__(err, msg)
        else:
            super().__init__(err, msg, path)
        self.status = status


cdef object _error(int rc, object path, uint32_t status=0):
    detail = phx_strerror_last().decode(errors="replace")
    return NvmeError(-rc, detail or _os.strerror(-rc), path, status)


def status_str(uint32_t status) -> str:
    """What an NVMe status (SCT << 8 | SC) means."""
    return phx_nvme_status_str(status).decode()


_FEATURES = ((PHX_NVME_FEAT_DSM, "dsm"), (PHX_NVME_FEAT_WRITE_ZEROES, "write_zeroes"),
             (PHX_NVME_FEAT_WZ_DEALLOC, "write_zeroes_deallocate"),
             (PHX_NVME_FEAT_FIXED_BUFS, "fixed_buffers"),
             (PHX_NVME_FEAT_EXCLUSIVE, "exclusive"))
_DEALLOC_READS = {0: "not reported", 1: "zeroes", 2: "ones"}


cdef dict _info_dict(phx_nvme_info *i):
    return {
        "nsid": i.nsid, "lba_size": i.lba_size, "metadata_size": i.metadata_size,
        "nr_lbas": i.nr_lbas, "capacity": i.capacity, "mdts": i.mdts,
        "max_transfer": i.max_transfer, "max_segments": i.max_segments,
        "dlfeat": i.dlfeat, "deallocated_reads": _DEALLOC_READS.get(i.dlfeat & 7, "reserved"),
        "oncs": i.oncs,
        "features": {name: bool(i.features & bit) for bit, name in _FEATURES},
        "first_lba": i.first_lba, "claimed_lbas": i.claimed_lbas,
        "queue_depth": i.queue_depth, "nr_queues": i.nr_queues,
        "model": i.model.decode(errors="replace"), "serial": i.serial.decode(errors="replace"),
        "firmware": i.firmware.decode(errors="replace"),
        "block_device": i.block_device.decode(errors="replace"),
    }


def identify(path) -> dict:
    """Identify the namespace behind ``path`` (/dev/ngXnY or its block device) without claiming it."""
    cdef phx_nvme_info info
    cdef bytes b = _os.fsencode(path)
    cdef const char *p = b
    cdef int rc
    with nogil:
        rc = phx_nvme_identify(p, &info)
    if rc < 0:
        raise _error(rc, _os.fspath(path))
    return _info_dict(&info)


def check(path) -> None:
    """Raise :class:`NvmeError` (EBUSY/EEXIST/...) if ``path`` (/dev/ngXnY or its block device) may not be claimed."""
    cdef bytes b = _os.fsencode(path)
    cdef const char *p = b
    cdef int rc
    with nogil:
        rc = phx_nvme_check(p)
    if rc < 0:
        raise _error(rc, _os.fspath(path))


cdef class _View:
    """A contiguous buffer held for one call."""
    cdef Py_buffer view
    cdef bint held

    def __dealloc__(self):
        if self.held:
            PyBuffer_Release(&self.view)

    cdef release(self):
        if self.held:
            PyBuffer_Release(&self.view)
            self.held = False


cdef _View _view(object obj, bint writable):
    cdef _View v = _View.__new__(_View)
    cdef int flags = PyBUF_ANY_CONTIGUOUS | (PyBUF_WRITABLE if writable else 0)
    if hasattr(obj, "data_ptr") and not hasattr(obj, "__buffer__") and type(obj).__module__.startswith("torch"):
        obj = obj.numpy()
    PyObject_GetBuffer(obj, &v.view, flags)
    v.held = True
    return v


_STATS = ("reads", "writes", "bytes_read", "bytes_written", "commands", "fixed_commands",
          "submits", "max_inflight", "dsm_commands", "write_zeroes_commands",
          "deallocated_bytes", "errors")


@cython.no_gc_clear
cdef class Namespace:
    """A claimed LBA range of an NVMe namespace, driven by passthrough commands.

    See :func:`phx.nvme.open` for the arguments.
    """
    cdef phx_nvme *nv
    cdef readonly object path
    cdef readonly uint32_t lba_size
    cdef readonly uint64_t first_lba
    cdef readonly uint64_t nr_lbas
    cdef dict _registered
    cdef object __weakref__

    def __cinit__(self, path, *, uint64_t first_lba=0, uint64_t nr_lbas=0,
                  queue_depth=None, nr_queues=None, max_transfer=None,
                  bint force=False, bint fixed_buffers=True, bint dsm=True,
                  bint readonly=False, bint _no_capacity_check=False):
        cdef phx_nvme_config cfg
        cdef phx_nvme_info info
        cdef bytes b = _os.fsencode(path)
        cdef const char *p = b
        cdef int rc
        phx_nvme_config_init(&cfg)
        for name, v in (("queue_depth", queue_depth), ("nr_queues", nr_queues),
                        ("max_transfer", max_transfer)):
            if v is not None and not (0 < v < 2**32):
                raise ValueError(f"{name} must be a positive integer, not {v!r}")
        if queue_depth is not None:
            cfg.queue_depth = queue_depth
        if nr_queues is not None:
            cfg.nr_queues = nr_queues
        if max_transfer is not None:
            cfg.max_transfer = max_transfer
        cfg.first_lba = first_lba
        cfg.nr_lbas = nr_lbas
        if force:
            cfg.flags |= PHX_NVME_FORCE
        if not fixed_buffers:
            cfg.flags |= PHX_NVME_NO_FIXED_BUFS
        if not dsm:
            cfg.flags |= PHX_NVME_NO_DSM
        if readonly:
            cfg.flags |= PHX_NVME_READONLY
        if _no_capacity_check:
            cfg.flags |= PHX_NVME_TEST_NO_CAPACITY_CHECK
        self.path = _os.fspath(path)
        with nogil:
            rc = phx_nvme_open(p, &cfg, &self.nv)
        if rc < 0:
            raise _error(rc, self.path)
        phx_nvme_get_info(self.nv, &info)
        self.lba_size = info.lba_size
        self.first_lba = info.first_lba
        self.nr_lbas = info.claimed_lbas
        self._registered = {}

    def __dealloc__(self):
        if self.nv != NULL:
            phx_nvme_close(self.nv)
            self.nv = NULL

    cdef phx_nvme *_get(self) except NULL:
        if self.nv == NULL:
            raise ValueError(f"namespace {self.path} is closed")
        return self.nv

    @property
    def closed(self) -> bool:
        return self.nv == NULL

    @property
    def info(self) -> dict:
        """Identify data, the limits in force and the claimed range."""
        cdef phx_nvme_info info
        phx_nvme_get_info(self._get(), &info)
        return _info_dict(&info)

    @property
    def start(self) -> int:
        """Byte offset of the claimed range's first LBA."""
        return self.first_lba * self.lba_size

    @property
    def end(self) -> int:
        """Byte offset just past the claimed range."""
        return (self.first_lba + self.nr_lbas) * self.lba_size

    def stats(self) -> dict:
        cdef phx_nvme_stats st
        phx_nvme_stats_get(self._get(), &st)
        vals = (st.reads, st.writes, st.bytes_read, st.bytes_written, st.commands,
                st.fixed_commands, st.submits, st.max_inflight, st.dsm_commands,
                st.write_zeroes_commands, st.deallocated_bytes, st.errors)
        return dict(zip(_STATS, vals))

    def reset_stats(self) -> None:
        phx_nvme_stats_reset(self._get())

    def register_buffer(self, buf) -> None:
        """Register host memory so commands on it use IORING_URING_CMD_FIXED."""
        cdef _View v = _view(buf, False)
        cdef phx_nvme *nv = self._get()
        cdef int rc
        with nogil:
            rc = phx_nvme_buf_register(nv, v.view.buf, v.view.len)
        if rc < 0:
            v.release()
            raise _error(rc, self.path)
        self._registered[<uintptr_t>v.view.buf] = v

    def unregister_buffer(self, buf) -> None:
        cdef _View v = _view(buf, False)
        cdef uintptr_t addr = <uintptr_t>v.view.buf
        cdef phx_nvme *nv = self._get()
        cdef int rc
        v.release()
        with nogil:
            rc = phx_nvme_buf_deregister(nv, <void *>addr)
        if rc < 0:
            raise _error(rc, self.path)
        held = self._registered.pop(addr, None)
        if held is not None:
            (<_View>held).release()

    cdef list _batch(self, list items):
        """items: (op, buf, offset); returns byte counts; raises the first failure."""
        cdef Py_ssize_t n = len(items), i
        cdef phx_nvme_io *ios
        cdef list views = []
        cdef _View v
        cdef int rc
        cdef phx_nvme *nv = self._get()
        if n == 0:
            return []
        ios = <phx_nvme_io *>calloc(n, sizeof(phx_nvme_io))
        if ios == NULL:
            raise MemoryError()
        try:
            for i in range(n):
                op, buf, off = items[i]
                if off < 0:
                    raise NvmeError(22, f"negative offset {off}", self.path)
                v = _view(buf, op == PHX_NVME_READ)
                views.append(v)
                ios[i].op = op
                ios[i].buf = v.view.buf
                ios[i].len = <uint64_t>v.view.len
                ios[i].offset = <uint64_t>off
            with nogil:
                rc = phx_nvme_submit_wait(nv, ios, n)
            if rc < 0:
                raise _error(rc, self.path)
            out = [ios[i].result for i in range(n)]
            for i in range(n):
                if ios[i].result < 0:
                    raise _error(<int>ios[i].result, self.path, ios[i].status)
        finally:
            for v in views:
                v.release()
            free(ios)
        return out

    def read(self, buf, offset: int) -> int:
        """Fill ``buf`` from byte ``offset`` (both multiples of the LBA size)."""
        return self._batch([(PHX_NVME_READ, buf, offset)])[0]

    def write(self, buf, offset: int) -> int:
        """Write all of ``buf`` at byte ``offset``."""
        return self._batch([(PHX_NVME_WRITE, buf, offset)])[0]

    def read_batch(self, reqs) -> list:
        """``[(buf, offset), ...]`` all in flight together (up to the queue depth)."""
        return self._batch([(PHX_NVME_READ, b, o) for b, o in reqs])

    def write_batch(self, reqs) -> list:
        return self._batch([(PHX_NVME_WRITE, b, o) for b, o in reqs])

    def deallocate(self, uint64_t offset, uint64_t length) -> None:
        """TRIM: Dataset Management (AD), or Write Zeroes where DSM is missing."""
        cdef phx_nvme *nv = self._get()
        cdef int rc
        with nogil:
            rc = phx_nvme_deallocate(nv, offset, length)
        if rc < 0:
            raise _error(rc, self.path)

    def write_zeroes(self, uint64_t offset, uint64_t length) -> None:
        cdef phx_nvme *nv = self._get()
        cdef int rc
        with nogil:
            rc = phx_nvme_write_zeroes(nv, offset, length)
        if rc < 0:
            raise _error(rc, self.path)

    def flush(self) -> None:
        cdef phx_nvme *nv = self._get()
        cdef int rc
        with nogil:
            rc = phx_nvme_flush(nv)
        if rc < 0:
            raise _error(rc, self.path)

    def close(self) -> None:
        cdef phx_nvme *nv = self.nv
        cdef int rc
        if nv == NULL:
            return
        self.nv = NULL
        with nogil:
            rc = phx_nvme_close(nv)
        if rc < 0:
            self.nv = nv
            raise _error(rc, self.path)
        for v in self._registered.values():
            (<_View>v).release()
        self._registered.clear()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self):
        if self.nv == NULL:
            return f"<phx.nvme.Namespace {self.path!r} closed>"
        return (f"<phx.nvme.Namespace {self.path!r} lba {self.lba_size} "
                f"LBAs [{self.first_lba}, {self.first_lba + self.nr_lbas})>")
