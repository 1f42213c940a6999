"""What the import hook adds to LMCache's ``phx`` backend (applied by
:mod:`phx_lmcache._hook` when ``lmcache.v1.gpu_connector.gds_backends.phx``
is imported).

**The slab claim.**  LMCache 0.5.6's ``FileGDSBackend.open_slab`` opens
``DIR/lmcache_gds_slab.bin`` with ``O_TRUNC`` and ``posix_fallocate``s it
before the backend ever sees the file: a second server given the same
``path`` used to wipe the first server's live slab that way, and only then
fail.  ``open_slab`` is wrapped: it first opens the file itself (no
truncation) and takes an open-file-description lock on byte 1 (``F_OFD_SETLK``;
byte 0 is libphxfile's own registration lock, a POSIX lock that names its
process), held until the slab handle is closed.  If another process holds
it, :class:`SlabInUse` is raised and the file is not touched: LMCache's
``GDSContext.initialize`` fails and the server does not start.  An OFD lock
stays while its descriptor is open, whatever else the process closes (a
POSIX lock lapses when any descriptor of the file is closed, and
``open_slab`` closes one).

**Failed stores are not admitted.**  LMCache never reads ``bytes_done``: a
store whose slab write failed (ENOSPC, EIO) used to become a resident key
whose loads libphxfile refuses, for as long as the key stays (every lookup
a hit, every retrieve a failure, its slab space held).  ``L1Manager.finish_write``
(the stream callback that admits a store once the stream has passed its
writes) is wrapped: a GDS object of a phx slab whose range libphxfile
reports bad (``phxFileCheckRange``: the range's last write failed) is
discarded with LMCache's own ``finish_write_and_delete`` instead, so its
space is freed and the key stays absent (a miss: vLLM recomputes and may
store it again).  A load of a bad range that is still attempted (the key
admitted some other way) is refused by libphxfile at submission: LMCache's
retrieve fails.
"""
from __future__ import annotations

import ctypes
import errno
import fcntl
import os
import struct
import sys
import threading
import types
from collections.abc import Callable, Sequence
from typing import Any

#: LMCache 0.5.6's FileGDSBackend.open_slab: location/lmcache_gds_slab.bin
SLAB_NAME = "lmcache_gds_slab.bin"
#: the claim's byte (byte 0 is libphxfile's POSIX registration lock)
CLAIM_BYTE = 1

_FLOCK = "hhqqi"        # struct flock: l_type, l_whence, l_start, l_len, l_pid


class SlabInUse(OSError):
    """Another process holds the slab: nothing was truncated or written."""


def _warn(msg: str) -> None:
    sys.stderr.write(f"phx_lmcache: {msg}\n")
    sys.stderr.flush()


def _posix_holder(fd: int) -> int | None:
    """The process holding libphxfile's registration lock (byte 0), if any."""
    try:
        r = fcntl.fcntl(fd, fcntl.F_GETLK, struct.pack(_FLOCK, fcntl.F_WRLCK, 0, 0, 1, 0))
    except OSError:
        return None
    typ, _, _, _, pid = struct.unpack(_FLOCK, r)
    return pid if typ != fcntl.F_UNLCK and pid > 0 else None


def _ofd_holder(st: os.stat_result) -> int | None:
    """The process with a descriptor holding an OFD write lock on the claim
    byte of this file (/proc/PID/fdinfo lists a descriptor's locks; the
    kernel reports OFD locks' pid as -1 elsewhere).  Only on the failure
    path."""
    dev = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    me = os.getpid()
    for pid in (p for p in os.listdir("/proc") if p.isdigit()):
        if int(pid) == me:
            continue
        try:
            fds = os.listdir(f"/proc/{pid}/fdinfo")
        except OSError:
            continue
        for fd in fds:
            try:
                with open(f"/proc/{pid}/fdinfo/{fd}") as f:
                    for line in f:
                        w = line.split()
                        if (line.startswith("lock:") and "OFDLCK" in w and "WRITE" in w
                                and dev in w and w[-2:] == [str(CLAIM_BYTE)] * 2):
                            return int(pid)
            except (OSError, ValueError):
                continue
    return None


_mine: dict[tuple[int, int], "Claim"] = {}     # this process's claims, by (dev, ino)
_mine_lock = threading.Lock()


class Claim:
    """The claim on one slab file: a descriptor holding the OFD lock."""

    def __init__(self, path: str, fd: int) -> None:
        self.path, self._fd = path, fd
        st = os.fstat(fd)
        self._key = (st.st_dev, st.st_ino)
        with _mine_lock:
            _mine[self._key] = self

    def release(self) -> None:
        with _mine_lock:
            if self._fd >= 0:
                os.close(self._fd)      # the OFD lock goes with its last descriptor
                self._fd = -1
                if _mine.get(self._key) is self:
                    del _mine[self._key]

    @property
    def held(self) -> bool:
        return self._fd >= 0


def claim(path: str) -> Claim | None:
    """Claim @path for this process before anything truncates it.

    Returns the claim, or None where it cannot be taken for reasons other
    than another holder (the file cannot be opened read-write, a filesystem
    without OFD locks): then LMCache's own open reports what is wrong, and
    libphxfile's registration lock is the only guard.  Raises
    :class:`SlabInUse` when another process holds it.
    """
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    except OSError:
        return None
    try:
        fcntl.fcntl(fd, fcntl.F_OFD_SETLK,
                    struct.pack(_FLOCK, fcntl.F_WRLCK, 0, CLAIM_BYTE, 1, 0))
    except OSError as e:
        if e.errno not in (errno.EAGAIN, errno.EACCES):
            os.close(fd)
            _warn(f"{path}: cannot lock the slab ({e.strerror}): two servers given this "
                  "path would overwrite each other's KV")
            return None
        st = os.fstat(fd)
        with _mine_lock:
            own = (st.st_dev, st.st_ino) in _mine
        holder = None if own else _posix_holder(fd) or _ofd_holder(st)
        os.close(fd)
        who = ("this process (a slab handle still open: LMCache allows one slab per process)"
               if own else f"process {holder}" if holder else "another process")
        hint = "" if own else " (another LMCache server given the same GDS path?)"
        raise SlabInUse(errno.EBUSY,
                        f"the GDS slab {path} is in use by {who}{hint}; it was left "
                        "untouched. Give each server its own path", path) from None
    # a non-hook server that registered first holds byte 0 (POSIX) only
    holder = _posix_holder(fd)
    if holder is not None and holder != os.getpid():
        os.close(fd)
        raise SlabInUse(errno.EBUSY,
                        f"the GDS slab {path} is in use by process {holder} (another "
                        "LMCache server given the same GDS path?); it was left untouched. "
                        "Give each server its own path", path)
    return Claim(path, fd)


# ---------------------------------------------------------------------------
# failed stores

_check_fn: Callable[[ctypes.c_void_p, int, int], int] | None = None


def _check_range() -> Callable[[ctypes.c_void_p, int, int], int]:
    """libphxfile's phxFileCheckRange(fh, off, len): 0, or -EIO for a range
    whose last write failed."""
    global _check_fn
    if _check_fn is None:
        import phx_lmcache
        fn = phx_lmcache.load().phxFileCheckRange
        fn.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_uint64]
        fn.restype = ctypes.c_int
        _check_fn = fn
        return fn
    return _check_fn


def _bad_keys(manager: Any, keys: Sequence[Any], tag: Any) -> list[Any]:
    """The keys among @keys whose staged GDS object lies on a phx slab range
    that libphxfile reports bad."""
    from lmcache.v1.gpu_connector import gds_context
    from lmcache.v1.memory_management import GDSMemoryObject

    with manager._lock:         # the writer's staging entries, as finish_write sees them
        staged = [(k, getattr(manager._get_staging(k, tag), "memory_obj", None)) for k in keys]
    bad = []
    for key, obj in staged:
        if not isinstance(obj, GDSMemoryObject):
            continue
        try:
            handle = gds_context.get_l1_gds_context(obj.get_l1_manager())._slab_handle
        except ValueError:
            continue
        if _is_phx(handle) and _check_range()(ctypes.c_void_p(handle._handle),
                                              obj.slab_offset, obj.get_size()) == -errno.EIO:
            bad.append(key)
    return bad


def _is_phx(handle: object) -> bool:
    mod = sys.modules.get("lmcache.v1.gpu_connector.gds_backends.phx")
    return mod is not None and isinstance(handle, mod.AsyncHandle)


_counts = {"discarded": 0}


def discarded_stores() -> int:
    """Stores this process discarded because their slab write failed."""
    return _counts["discarded"]


def _patch_l1_manager() -> None:
    from lmcache.v1.distributed import l1_manager

    cls = l1_manager.L1Manager
    if getattr(cls.finish_write, "_phx_wrapped", False):
        return
    orig = cls.finish_write

    def finish_write(self: Any, keys: Sequence[Any], tag: Any = "") -> Any:
        try:
            bad = set(_bad_keys(self, keys, tag))
        except Exception as e:  # noqa: BLE001 - never break LMCache's own path
            _warn(f"cannot check the stores' slab ranges ({type(e).__name__}: {e}); "
                  "admitting them unchecked")
            bad = set()
        if not bad:
            return orig(self, keys, tag)
        good = [k for k in keys if k not in bad]
        ret = orig(self, good, tag) if good else {}
        ret = dict(ret)
        ret.update(self.finish_write_and_delete(list(bad), tag))
        _counts["discarded"] += len(bad)
        _warn(f"{len(bad)} store(s) not admitted: their slab write failed "
              f"(discarded so far: {_counts['discarded']}; see phxfile's failure log)")
        return ret

    finish_write._phx_wrapped = True  # type: ignore[attr-defined]  # the mark patching looks for
    finish_write.__doc__ = orig.__doc__
    cls.finish_write = finish_write


# ---------------------------------------------------------------------------

def patch(module: types.ModuleType) -> None:
    """Wrap the phx backend module's open_slab and its handles' close."""
    backend, handle = module.Backend, module.AsyncHandle
    if getattr(backend.open_slab, "_phx_wrapped", False):
        return
    orig_open, orig_close = backend.open_slab, handle.close

    def open_slab(self: Any, location: str, size: int, direct_io: bool) -> Any:
        os.makedirs(location, exist_ok=True)
        c = claim(os.path.join(location, SLAB_NAME))
        try:
            h = orig_open(self, location, size, direct_io)
        except BaseException:
            if c is not None:
                c.release()
            raise
        if c is not None:
            if os.path.realpath(h.path) != os.path.realpath(c.path):
                _warn(f"LMCache opened {h.path}, not {c.path}: the claim guards nothing")
            h._phx_claim = c
        try:
            _patch_l1_manager()
        except Exception as e:  # noqa: BLE001
            _warn(f"failed stores cannot be kept out of the cache: {type(e).__name__}: {e}")
        return h

    def close(self: Any) -> None:
        try:
            orig_close(self)
        finally:
            c = self.__dict__.pop("_phx_claim", None)
            if c is not None:
                c.release()

    open_slab._phx_wrapped = True  # type: ignore[attr-defined]  # the mark patching looks for
    open_slab.__doc__ = orig_open.__doc__
    close.__doc__ = orig_close.__doc__
    backend.open_slab = open_slab
    handle.close = close
