"""libphxfile.so for LMCache's GDS L1 ``phx`` backend, and how LMCache finds it.

LMCache 0.5.6 loads ``ctypes.util.find_library("phxfile") or
"libphxfile.so"``.  The wheel puts the library here, next to this module,
and a ``.pth`` file installs a tiny import hook (:mod:`phx_lmcache._hook`)
at interpreter start: when ``lmcache.v1.gpu_connector.gds_backends.phx`` is
first imported, the hook loads this library by its absolute path.  The
dynamic loader then returns that already-loaded object for LMCache's
``ctypes.CDLL("libphxfile.so")`` (it matches loaded objects by soname), so
no environment variable, ldconfig entry or root step is needed.  Nothing
native is loaded in interpreters that never import that module.

``python -m phx_lmcache`` says which library LMCache would load and why.
"""
from __future__ import annotations

import ctypes
import os

__all__ = ["library_path", "load", "stats", "STATS_FIELDS", "PATHS"]

#: phxfile_stats fields after ``size`` and ``path`` (adapters/lmcache/include/phxfile.h)
STATS_FIELDS = (
    "driver_opens", "reads", "writes", "bytes_read", "bytes_written", "failures",
    "submit_errors", "unregistered_ops", "direct_ops", "staging_ops", "direct_fallbacks",
    "buffers", "handles", "inflight", "last_error", "staging_errors", "staging_chunks",
    "h2d_bytes", "d2h_bytes", "pinned_bytes", "early_reads", "early_misses",
    "bad_refusals", "bad_marks",
)
#: enum phxfile_path
PATHS = {0: "none", 1: "staging", 2: "direct"}


class _Stats(ctypes.Structure):
    _fields_ = ([("size", ctypes.c_uint32), ("path", ctypes.c_uint32)]
                + [(n, ctypes.c_int64 if n == "last_error" else ctypes.c_uint64)
                   for n in STATS_FIELDS]
                + [("reserved", ctypes.c_uint64 * 4)])


def library_path() -> str:
    """Absolute path of the libphxfile.so installed with this package."""
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), "libphxfile.so")


_lib: ctypes.CDLL | None = None


def load() -> ctypes.CDLL:
    """Load (once) the installed libphxfile.so by absolute path."""
    global _lib
    if _lib is None:
        path = library_path()
        if not os.path.exists(path):
            raise OSError(2, "libphxfile.so is not installed next to phx_lmcache "
                             "(reinstall phx with pip)", path)
        _lib = ctypes.CDLL(path)
        _lib.phxFileGetStats.argtypes = [ctypes.POINTER(_Stats)]
        _lib.phxFileGetStats.restype = ctypes.c_int
    return _lib


def stats() -> dict[str, int | str]:
    """The library's counters in this process (phxFileGetStats): transfers,
    bytes, failures (LMCache never reads bytes_done, so look here), the path
    that ran (``staging`` or ``direct``) and libphx's staging counters."""
    st = _Stats()
    st.size = ctypes.sizeof(_Stats)
    rc = load().phxFileGetStats(ctypes.byref(st))
    if rc < 0:
        raise OSError(-rc, os.strerror(-rc))
    out: dict[str, int | str] = {"path": PATHS.get(st.path, str(st.path))}
    out.update({n: getattr(st, n) for n in STATS_FIELDS})
    return out
