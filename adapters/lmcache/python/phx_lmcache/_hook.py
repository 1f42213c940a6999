"""Import hook installed by ``phx_lmcache.pth`` at interpreter start.

It only adds a finder to ``sys.meta_path`` that watches for one module name,
LMCache's ``phx`` GDS backend; when that is imported it loads libphxfile.so
by absolute path (so LMCache's ``ctypes.CDLL("libphxfile.so")`` gets it),
lets the module load as usual, then wraps its ``open_slab`` (the slab claim,
taken before LMCache truncates the file) and, once a slab is open,
LMCache's ``L1Manager.finish_write`` (stores whose slab write failed are
discarded, not admitted): see :mod:`phx_lmcache._slab`.  Then it steps
aside.  Set ``PHX_LMCACHE_HOOK=0`` to disable it (then LMCache loads
whatever ``find_library("phxfile")`` finds, and nothing is wrapped).
"""
from __future__ import annotations

import importlib.machinery
import os
import sys
import types
from collections.abc import Sequence
from typing import Any

WATCHED = "lmcache.v1.gpu_connector.gds_backends.phx"


class _Finder:
    """A meta-path finder for one module: it preloads the library, then
    returns the spec the normal finders give, its loader wrapped so that the
    module is patched right after it has run."""

    @staticmethod
    def find_spec(fullname: str, path: Sequence[str] | None = None,
                  target: types.ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        if fullname != WATCHED:
            return None
        _preload()
        spec = importlib.machinery.PathFinder.find_spec(fullname, path, target)
        if spec is None or not hasattr(spec.loader, "exec_module"):
            return None
        # duck-typed: it hands everything else to the real loader (__getattr__)
        spec.loader = _PatchingLoader(spec.loader)  # type: ignore[assignment]
        return spec

    @staticmethod
    def invalidate_caches() -> None:
        return None


class _PatchingLoader:
    """Runs the real loader, then patches the module (phx_lmcache._slab)."""

    def __init__(self, loader: Any) -> None:
        self._loader = loader

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType | None:
        mod: types.ModuleType | None = self._loader.create_module(spec)
        return mod

    def exec_module(self, module: types.ModuleType) -> None:
        module.__loader__ = self._loader
        self._loader.exec_module(module)
        _patch(module)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loader, name)


def _patch(module: types.ModuleType) -> None:
    try:
        from phx_lmcache import _slab
        _slab.patch(module)
    except Exception as e:  # noqa: BLE001 - LMCache still runs, unguarded
        sys.stderr.write(f"phx_lmcache: cannot wrap LMCache's phx backend: "
                         f"{type(e).__name__}: {e}\n")


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
        _patch(sys.modules[WATCHED])
        return
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())


def remove() -> None:
    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, _Finder)]


def installed() -> bool:
    return any(isinstance(f, _Finder) for f in sys.meta_path)
