"""libphxfile.so as LMCache's own ``gds_backends.phx`` module loads it, on a
machine without a GPU: found with no environment set, every symbol there,
every call a clear -errno, nothing crashes.

Each check runs in a child interpreter (so the .pth import hook runs as it
does for an LMCache server).  Needs lmcache 0.5.6 importable, or in the
folder made by ``adapters/lmcache/tools/lmcache-deps.sh install
.lmcache-site``; skipped otherwise, and skipped where a real CUDA GPU is
present (tests/test_lmcache_gpu.py covers that machine).
"""
from __future__ import annotations

import errno
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "adapters", "lmcache", "tests"))
import support  # noqa: E402

SITE = support.lmcache_site()
pytestmark = [
    pytest.mark.skipif(not support.phx_lmcache_installed(),
                       reason="phx_lmcache/libphxfile.so not installed (pip install .)"),
    pytest.mark.skipif(SITE is None, reason=f"lmcache not installed: {support.INSTALL_HINT}"),
]

SYMBOLS = ["phxFileDriverOpen", "phxFileDriverClose", "phxFileBufRegister",
           "phxFileBufDeregister", "phxFileHandleRegister", "phxFileHandleDeregister",
           "phxFileStreamRegister", "phxFileStreamDeregister", "phxFileReadAsync",
           "phxFileWriteAsync"]

LOAD = r"""
import ctypes, ctypes.util, json, os, sys
from lmcache.v1.gpu_connector.gds_backends import phx as m
lib = m.Backend().library()
maps = [l.split()[-1] for l in open("/proc/self/maps") if l.rstrip().endswith("libphxfile.so")]
print(json.dumps({"name": lib._name, "mapped": sorted(set(os.path.realpath(p) for p in maps)),
                  "symbols": [s for s in %r if hasattr(lib, s)],
                  "argtypes_set": lib.phxFileReadAsync.argtypes is not None,
                  "find_library": ctypes.util.find_library("phxfile")}))
""" % (SYMBOLS,)


def _json(r):
    import json
    assert r.returncode == 0, r.stdout + r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_lmcache_loads_this_library_with_no_environment():
    """LMCache's Backend.library() (find_library, else CDLL("libphxfile.so"))
    gets the libphxfile.so of this installation, every ABI symbol present."""
    import phx_lmcache
    env = support.child_env(SITE)
    for k in ("LD_LIBRARY_PATH", "LD_PRELOAD", "PHX_LMCACHE_HOOK"):
        env.pop(k, None)
    out = _json(support.run_py(LOAD, [], env))
    assert out["mapped"] == [os.path.realpath(phx_lmcache.library_path())], out
    assert out["symbols"] == SYMBOLS
    assert out["argtypes_set"], "LMCache's _declare_signatures did not run"


def test_without_the_hook_lmcache_does_not_find_it():
    """The import hook is what makes it work: disabled, LMCache's load fails
    (where no other libphxfile.so is on the loader's path)."""
    env = support.child_env(SITE, PHX_LMCACHE_HOOK="0")
    env.pop("LD_LIBRARY_PATH", None)
    r = support.run_py(LOAD, [], env)
    if r.returncode == 0 and _json(r)["find_library"]:
        pytest.skip(f"another libphxfile.so is installed: {_json(r)['find_library']}")
    assert r.returncode != 0
    assert "libphxfile.so" in r.stderr and "OSError" in r.stderr


def test_status_command():
    """``python -m phx_lmcache`` reports the library LMCache loads (exit 0)."""
    import subprocess
    r = subprocess.run([sys.executable, "-W", "ignore", "-m", "phx_lmcache"],
                       env=support.child_env(SITE), capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert '"ok": true' in r.stdout


NO_GPU = r"""
import ctypes, errno, json, os, sys
from lmcache.v1.gpu_connector.gds_backends import phx as m
from lmcache.v1.gpu_connector.gds_backends.base import Submission
import phx_lmcache
b = m.Backend()
L = b.library()
d = sys.argv[1]
res = {}
res["open"] = L.phxFileDriverOpen()
res["close"] = L.phxFileDriverClose()
res["buf"] = L.phxFileBufRegister(ctypes.c_void_p(0x7f0000000000), 1 << 20)
res["buf_null"] = L.phxFileBufRegister(None, 4096)
res["buf_dereg"] = L.phxFileBufDeregister(ctypes.c_void_p(0x7f0000000000))
res["stream"] = L.phxFileStreamRegister(None)
res["stream_dereg"] = L.phxFileStreamDeregister(None)
fh = ctypes.c_void_p()
fd = os.open(os.path.join(d, "f.bin"), os.O_CREAT | os.O_RDWR, 0o644)
res["handle"] = L.phxFileHandleRegister(ctypes.byref(fh), fd)
res["handle_null"] = L.phxFileHandleRegister(None, fd)
res["handle_badfd"] = L.phxFileHandleRegister(ctypes.byref(fh), 12345)
res["handle_dereg_bogus"] = L.phxFileHandleDeregister(ctypes.c_void_p(0x1234))
sub = Submission(4096, 0, 0)
args = (ctypes.byref(sub.size), ctypes.byref(sub.file_offset), ctypes.byref(sub.buf_offset),
        ctypes.byref(sub.result), None)
res["read_bogus"] = L.phxFileReadAsync(ctypes.c_void_p(0x1234), ctypes.c_void_p(0x7f0000000000), *args)
res["write_null"] = L.phxFileWriteAsync(None, None, None, None, None, None, None)
try:
    b.open_slab(os.path.join(d, "slab"), 1 << 20, True)
    res["open_slab"] = "no error"
except RuntimeError as e:
    res["open_slab"] = str(e)
os.close(fd)
res["stats"] = phx_lmcache.stats()
print(json.dumps(res))
"""


def test_calls_without_a_gpu_fail_with_clear_errno(tmp_path):
    if support.real_cuda():
        pytest.skip("a CUDA GPU is present: see tests/test_lmcache_gpu.py")
    r = support.run_py(NO_GPU, [str(tmp_path)], support.child_env(SITE))
    out = _json(r)
    ENODEV, EINVAL, EBADF, ENOENT = (-errno.ENODEV, -errno.EINVAL, -errno.EBADF,
                                     -errno.ENOENT)
    assert out["open"] == ENODEV
    assert out["close"] == 0                      # closing a closed driver: no-op
    assert out["buf"] == ENODEV
    assert out["buf_null"] == EINVAL
    assert out["buf_dereg"] == ENOENT
    assert out["stream"] == ENODEV
    assert out["stream_dereg"] == 0
    assert out["handle"] == ENODEV
    assert out["handle_null"] == EINVAL
    assert out["handle_badfd"] == EBADF
    assert out["handle_dereg_bogus"] == EBADF
    assert out["read_bogus"] == EBADF
    assert out["write_null"] == EINVAL
    assert f"rc={ENODEV}" in out["open_slab"], out["open_slab"]
    st = out["stats"]
    assert st["path"] == "none" and st["handles"] == 0 and st["buffers"] == 0
    assert st["submit_errors"] >= 10, st
    # one "no usable CUDA GPU" line however many calls needed the driver
    assert r.stderr.count("no usable CUDA GPU") == 1, r.stderr
