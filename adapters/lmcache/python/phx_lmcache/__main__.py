"""``python -m phx_lmcache``: which libphxfile.so LMCache's ``phx`` backend
loads in this interpreter, and why.  Exit 0 when it is this package's."""
from __future__ import annotations

import ctypes.util
import json
import os
import sys


def _loaded_path(name: str) -> str | None:
    """The file of the mapped object whose name ends with @name (Linux)."""
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                p = line.split()[-1]
                if p.endswith("/" + name):
                    return os.path.realpath(p)
    except OSError:
        pass
    return None


def main() -> int:
    import phx_lmcache
    from phx_lmcache import _hook

    out = {"installed": phx_lmcache.library_path(),
           "hook_active": _hook.installed(),
           "find_library": ctypes.util.find_library("phxfile")}
    try:
        from lmcache.v1.gpu_connector.gds_backends import phx as backend
        lib = backend.Backend().library()
        out["lmcache_loaded"] = _loaded_path("libphxfile.so")
        out["lmcache_lib_name"] = lib._name
    except Exception as e:  # noqa: BLE001 - reported, not raised
        out["lmcache_error"] = f"{type(e).__name__}: {e}"
    ok = out.get("lmcache_loaded") == os.path.realpath(phx_lmcache.library_path())
    out["ok"] = ok
    if ok:
        out["stats"] = phx_lmcache.stats()
    print(json.dumps(out, indent=2))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
