"""How much of a file is in the page cache (``cachestat(2)``, else
``mincore(2)``), and whether its device is memory anyway.

A checkpoint that is already in the page cache (a restart, a second
replica, a fresh download) is faster read from there than from the device
again, which is what O_DIRECT would do.  :func:`resident_fraction` answers
with one system call where the kernel has ``cachestat`` (Linux 6.5+), else
by mapping the file and asking ``mincore`` which of its pages are resident
(the mapping is never touched, so nothing is read in by asking).

The page cache only pays where the device is slower than memory.  A file on
a device that *is* memory (zram, brd's ``ram``, ``pmem``) costs one copy
from the device as from the page cache, and O_DIRECT skips the page cache's
per-page work: on the dev box fio reads 1 MiB from ext4 on zram at 4.8 GB/s
per thread O_DIRECT and 3.0 GB/s from a warm page cache, and on the H100 box
``phx bench load`` read a warm checkpoint at 8.1 GB/s through the cache
against 12.3 GB/s O_DIRECT (``docs/loader.md``, "Warm checkpoints").
:func:`memory_device` names such a device so the loader reads it direct.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import errno
import mmap
import os
import platform
import stat

#: ``cachestat``'s syscall number where it is the same for every ABI (x86-64,
#: arm64 and the other generic-table architectures all use 451)
_NR_CACHESTAT = {"x86_64": 451, "aarch64": 451}.get(platform.machine())


class _Range(ctypes.Structure):
    _fields_ = [("off", ctypes.c_uint64), ("len", ctypes.c_uint64)]


class _Stat(ctypes.Structure):
    _fields_ = [("nr_cache", ctypes.c_uint64), ("nr_dirty", ctypes.c_uint64),
                ("nr_writeback", ctypes.c_uint64), ("nr_evicted", ctypes.c_uint64),
                ("nr_recently_evicted", ctypes.c_uint64)]


_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.syscall.restype = ctypes.c_long
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                       ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]

_cachestat_ok: bool | None = None if _NR_CACHESTAT else False


def _pages(nbytes: int) -> int:
    return (nbytes + mmap.PAGESIZE - 1) // mmap.PAGESIZE


def cachestat_pages(fd: int, size: int) -> int | None:
    """Resident pages of the first ``size`` bytes of ``fd`` by ``cachestat``,
    or None where the kernel does not have it."""
    global _cachestat_ok
    if not _cachestat_ok and _cachestat_ok is not None:
        return None
    assert _NR_CACHESTAT is not None        # _cachestat_ok is False without it
    rng, st = _Range(0, size), _Stat()
    r = _libc.syscall(ctypes.c_long(_NR_CACHESTAT), ctypes.c_int(fd), ctypes.byref(rng),
                      ctypes.byref(st), ctypes.c_uint(0))
    if r != 0:
        e = ctypes.get_errno()
        if e in (errno.ENOSYS, errno.EPERM):    # old kernel, or a seccomp filter
            _cachestat_ok = False
            return None
        raise OSError(e, os.strerror(e))
    _cachestat_ok = True
    return int(st.nr_cache)


def mincore_pages(fd: int, size: int) -> int:
    """Resident pages of the first ``size`` bytes of ``fd`` by ``mincore`` on
    a read-only shared mapping (never touched)."""
    if size == 0:
        return 0
    addr = _libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
    if addr in (None, ctypes.c_void_p(-1).value):
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e))
    try:
        vec = (ctypes.c_ubyte * _pages(size))()
        if _libc.mincore(ctypes.c_void_p(addr), size, vec) != 0:
            e = ctypes.get_errno()
            raise OSError(e, os.strerror(e))
        return sum(b & 1 for b in bytes(vec))
    finally:
        _libc.munmap(ctypes.c_void_p(addr), size)


def resident_fraction(fd: int, size: int | None = None) -> float:
    """The fraction (0..1) of the file open as ``fd`` (its first ``size``
    bytes) that is in the page cache now."""
    if size is None:
        size = os.fstat(fd).st_size
    if size <= 0:
        return 0.0
    pages = cachestat_pages(fd, size)
    if pages is None:
        pages = mincore_pages(fd, size)
    return min(1.0, pages / _pages(size))


#: block device names (their prefix) whose storage is memory
MEMORY_DEVICES = ("zram", "ram", "pmem")


def _block_memory(sysdir: str, depth: int = 0) -> str | None:
    """The memory device ``sysdir`` (a /sys/class/block entry) is or is
    made of (a partition's disk, every slave of a dm/md device), or None."""
    real = os.path.realpath(sysdir)
    if os.path.exists(os.path.join(real, "partition")):
        real = os.path.dirname(real)
    name = os.path.basename(real)
    if name.startswith(MEMORY_DEVICES):
        return name
    try:
        slaves = sorted(os.listdir(os.path.join(real, "slaves")))
    except OSError:
        return None
    if not slaves or depth > 4:
        return None
    found = [_block_memory(os.path.join(real, "slaves", s), depth + 1) for s in slaves]
    return found[0] if all(found) else None


def memory_device(fd: int, sys_root: str = "/sys") -> str | None:
    """The name of the memory-backed block device (zram, ram, pmem) the file
    open as ``fd`` lives on, or None (another device, no device, or
    ``/sys`` not readable)."""
    st = os.fstat(fd)
    dev = st.st_rdev if stat.S_ISBLK(st.st_mode) else st.st_dev
    sysdir = os.path.join(sys_root, "dev", "block", f"{os.major(dev)}:{os.minor(dev)}")
    if not os.path.exists(sysdir):
        return None
    return _block_memory(sysdir)


def method() -> str:
    """Which call :func:`resident_fraction` uses here: "cachestat" or "mincore"."""
    if _cachestat_ok is None:
        fd = os.open("/proc/self/exe", os.O_RDONLY)
        try:
            cachestat_pages(fd, 4096)
        finally:
            os.close(fd)
    return "cachestat" if _cachestat_ok else "mincore"
