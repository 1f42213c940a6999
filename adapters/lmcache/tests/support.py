"""Shared by tests/test_lmcache_*.py: where lmcache is, how to run a Python
child that sees it, and whether a real GPU is there."""
from __future__ import annotations

import ctypes
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
HERE = os.path.dirname(os.path.abspath(__file__))
INSTALL_HINT = ("adapters/lmcache/tools/lmcache-deps.sh install .lmcache-site "
                "(or set PHX_LMCACHE_SITE to such a folder)")


def lmcache_site() -> str | None:
    """'' when lmcache imports as installed, a folder that has it, or None."""
    code = "import lmcache.v1.gpu_connector.gds_backends.phx"
    if subprocess.run([sys.executable, "-W", "ignore", "-c", code],
                      capture_output=True).returncode == 0:
        return ""
    for d in (os.environ.get("PHX_LMCACHE_SITE"), os.path.join(ROOT, ".lmcache-site")):
        if d and os.path.isdir(os.path.join(d, "lmcache")):
            return d
    return None


def child_env(site: str, **extra: str) -> dict[str, str]:
    env = dict(os.environ, **extra)
    if site:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [site, env.get("PYTHONPATH")]))
    return env


def run_py(code_or_path: str, args: list[str], env: dict[str, str], timeout: int = 300,
           cwd: str | None = None) -> subprocess.CompletedProcess:
    argv = [sys.executable, "-W", "ignore"]
    argv += [code_or_path] if code_or_path.endswith(".py") else ["-c", code_or_path]
    return subprocess.run(argv + args, env=env, capture_output=True, text=True,
                          timeout=timeout, cwd=cwd)


def real_cuda() -> bool:
    """A real libcuda with a device (not tests/gpu_fake's)."""
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    if hasattr(lib, "fake_sleep_async"):
        return False
    n = ctypes.c_int(0)
    return lib.cuInit(0) == 0 and lib.cuDeviceGetCount(ctypes.byref(n)) == 0 and n.value > 0


def phx_lmcache_installed() -> bool:
    try:
        import phx_lmcache
    except ImportError:
        return False
    return os.path.exists(phx_lmcache.library_path())
