"""Linux calls the standard library lacks: fallocate modes, cachestat, aligned arrays.

Every function raises :class:`OSError` with the errno the kernel returned.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
import platform

import numpy as np

PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096

FALLOC_FL_KEEP_SIZE = 0x01
FALLOC_FL_PUNCH_HOLE = 0x02

#: cachestat(2) syscall numbers (kernel >= 6.5); the same on every arch that has it
#: through the generic table, 451 on x86-64.
_NR_CACHESTAT = {"x86_64": 451, "aarch64": 451, "riscv64": 451, "ppc64le": 451,
                 "s390x": 451}.get(platform.machine())

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
_libc.fallocate.restype = ctypes.c_int
_libc.syscall.restype = ctypes.c_long
_libc.sync_file_range.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
_libc.sync_file_range.restype = ctypes.c_int
SYNC_FILE_RANGE_WRITE = 2


def _raise(what: str, path: str | None = None) -> None:
    e = ctypes.get_errno()
    raise OSError(e, f"{what}: {os.strerror(e)}", path)


def fallocate(fd: int, offset: int, length: int, mode: int = 0, path: str | None = None) -> None:
    """``fallocate(2)``; ``mode`` 0 allocates (and extends the size)."""
    if length <= 0:
        return
    if _libc.fallocate(fd, mode, offset, length) != 0:
        _raise("fallocate", path)


def start_writeback(fd: int, offset: int, length: int, path: str | None = None) -> None:
    """Start writing back the dirty pages of ``[offset, offset+length)`` now,
    without waiting for it (``sync_file_range(SYNC_FILE_RANGE_WRITE)``); the
    pages stay cached.  Not a durability barrier: no metadata, no flush."""
    if length > 0 and _libc.sync_file_range(fd, offset, length, SYNC_FILE_RANGE_WRITE):
        _raise("sync_file_range", path)


def dirty_pages(fd: int, offset: int, length: int) -> int:
    """Pages of ``[offset, offset+length)`` dirty in the page cache now (cachestat)."""
    st = _cachestat_raw(fd, offset, length)
    if st is None:
        raise OSError(errno.ENOSYS, "cachestat(2) is not available")
    return int(st.nr_dirty)


def punch_hole(fd: int, offset: int, length: int, path: str | None = None) -> None:
    """Release the blocks of ``[offset, offset+length)`` (the file size is kept).

    The page cache of the range goes with them.
    """
    fallocate(fd, offset, length, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, path)


class _Range(ctypes.Structure):
    _fields_ = [("off", ctypes.c_uint64), ("len", ctypes.c_uint64)]


class _Stat(ctypes.Structure):
    _fields_ = [("nr_cache", ctypes.c_uint64), ("nr_dirty", ctypes.c_uint64),
                ("nr_writeback", ctypes.c_uint64), ("nr_evicted", ctypes.c_uint64),
                ("nr_recently_evicted", ctypes.c_uint64)]


_cachestat_ok: bool | None = None


def cachestat_available() -> bool:
    """Whether ``cachestat(2)`` works here (kernel >= 6.5)."""
    global _cachestat_ok
    if _cachestat_ok is None:
        _cachestat_ok = False
        if _NR_CACHESTAT is not None:
            fd = os.open("/proc/self/exe", os.O_RDONLY)
            try:
                _cachestat_ok = _cachestat_raw(fd, 0, PAGE) is not None
            finally:
                os.close(fd)
    return _cachestat_ok


def _cachestat_raw(fd: int, offset: int, length: int) -> _Stat | None:
    if _NR_CACHESTAT is None:       # no syscall number on this arch: as ENOSYS
        return None
    r = _Range(offset, length)
    st = _Stat()
    rc = _libc.syscall(ctypes.c_long(_NR_CACHESTAT), ctypes.c_int(fd), ctypes.byref(r),
                       ctypes.byref(st), ctypes.c_uint(0))
    if rc != 0:
        e = ctypes.get_errno()
        if e in (errno.ENOSYS, errno.EOPNOTSUPP):
            return None
        raise OSError(e, f"cachestat: {os.strerror(e)}")
    return st


def cached_pages(fd: int, offset: int, length: int) -> tuple[int, int]:
    """(pages of ``[offset, offset+length)`` in the page cache, pages in the range).

    Uses ``cachestat(2)``; raises :class:`OSError` (ENOSYS) where it is missing.
    """
    if length <= 0:
        return 0, 0
    first = offset // PAGE
    last = (offset + length + PAGE - 1) // PAGE
    if _NR_CACHESTAT is None:
        raise OSError(errno.ENOSYS, "cachestat: unknown syscall number on this arch")
    st = _cachestat_raw(fd, first * PAGE, (last - first) * PAGE)
    if st is None:
        raise OSError(errno.ENOSYS, "cachestat: not supported by this kernel")
    return int(st.nr_cache), last - first


def aligned_empty(nbytes: int, alignment: int = 4096) -> np.ndarray:
    """A writable uint8 array of ``nbytes`` whose data starts on ``alignment``:
    :func:`phx.empty_aligned` (phx's one aligned allocator) seen by numpy.

    Stands in for the pinned copy buffers of the paper: O_DIRECT reads land in it
    without a bounce.
    """
    import phx
    return np.frombuffer(phx.empty_aligned(nbytes, alignment), dtype=np.uint8)


def proc_io() -> dict[str, int]:
    """This process's ``/proc/self/io`` counters (all threads, io_uring workers included)."""
    out: dict[str, int] = {}
    try:
        with open("/proc/self/io") as f:
            for line in f:
                k, _, v = line.partition(":")
                out[k.strip()] = int(v)
    except OSError:
        pass
    return out
