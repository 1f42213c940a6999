"""Import hook installed by ``phx_lmcache.pth`` at interpreter start.

It only adds a finder to ``sys.meta_path`` that watches for one module name,
LMCache's ``phx`` GDS backend; when that is imported it loads libphxfile.so
by absolute path (so LMCache's ``ctypes.CDLL("libphxfile.so")`` gets it)
and steps aside.  Set ``PHX_LMCACHE_HOOK=0`` to disable it (then LMCache
loads whatever ``find_library("phxfile")`` finds).
"""
from __future__ import annotations

import os
import sys

WATCHED = "lmcache.v1.gpu_connector.gds_backends.phx"


class _Finder:
    """A meta-path finder that never finds anything: it preloads, then
    lets the normal finders import the module."""

    @staticmethod
    def find_spec(fullname, path=None, target=None):
        if fullname == WATCHED:
            _preload()
        return None

    @staticmethod
    def invalidate_caches():
        return None


def _preload() -> None:
    try:
        import phx_lmcache
        phx_lmcache.load()
    except OSError as e:  # LMCache will report the load failure itself
        sys.stderr.write(f"phx_lmcache: cannot preload libphxfile.so: {e}\n")
    finally:
        remove()


def install() -> None:
    """Add the finder (idempotent; a no-op with PHX_LMCACHE_HOOK=0)."""
    if os.environ.get("PHX_LMCACHE_HOOK", "1") == "0":
        return
    if WATCHED in sys.modules:
        _preload()
        return
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())


def remove() -> None:
    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, _Finder)]


def installed() -> bool:
    return any(isinstance(f, _Finder) for f in sys.meta_path)
