"""I/O errors from a real block device never become data (issue 22), in the QEMU guest.

device-mapper gives the errors: a linear target over a loop device, reloaded
as ``flakey`` with ``error_writes`` (every write fails, reads return what is
on disk) or with an ``error`` segment (reads of it fail).  GPU memory is the
fake libcuda's (tests/gpu_fake/fake_cuda.c), so the whole stream path runs:
the poller, the lanes, the copy kernels' descriptors.

* A stream write that fails leaves its range bad: a later stream read, a
  host-engine read and libphxfile refuse it with -EIO, though the device
  would return the old bytes; the good range reads right; once the device is
  healthy and the range rewritten it reads back right.
* A stream read over a failing segment ends with -EIO and puts nothing in
  the destination but bytes of its own range that were read.
* The same failed store through LMCache's own GDS backend (phx, libphxfile):
  the chunk's load is refused, the other chunk loads right.

Skips outside the guest (needs dmsetup, device-mapper and root).
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
MB = 1 << 20
DEV_MB = 64

pytestmark = pytest.mark.skipif(
    not (os.environ.get("PHX_IVSHMEM_BDF") and shutil.which("dmsetup") and os.geteuid() == 0
         and os.path.exists("/dev/mapper/control")),
    reason="runs in the QEMU guest (needs device-mapper, dmsetup, root)")


# no udev in the guest: libdevmapper makes the /dev/mapper nodes itself
DM_ENV = dict(os.environ, DM_DISABLE_UDEV="1")


def sh(*cmd: str, **kw) -> str:
    if cmd[0] == "dmsetup":
        cmd = ("dmsetup", "--noudevsync") + cmd[1:]
        kw.setdefault("env", DM_ENV)
    return subprocess.run(cmd, check=True, capture_output=True, text=True, **kw).stdout.strip()


@pytest.fixture(scope="module")
def fake_libcuda(tmp_path_factory):
    d = tmp_path_factory.mktemp("fakecuda")
    subprocess.run(["gcc", "-shared", "-fPIC", "-O1", "-o", str(d / "libcuda.so.1"),
                    os.path.join(ROOT, "tests", "gpu_fake", "fake_cuda.c"), "-lpthread"],
                   check=True)
    return str(d)


class Dm:
    """A device-mapper device over a loop device whose table can be swapped."""

    def __init__(self, name: str, img: str, mb: int):
        with open(img, "wb") as f:
            f.truncate(mb * MB)
        self.loop = sh("losetup", "-f", "--show", img)
        self.name = name
        self.sectors = mb * MB // 512
        self.path = f"/dev/mapper/{name}"
        sh("dmsetup", "create", name, "--table", self.linear())

    def linear(self) -> str:
        return f"0 {self.sectors} linear {self.loop} 0"

    def flakey(self) -> str:
        # up 0 s, down 3600 s: always down; error_writes: writes fail, reads work
        return f"0 {self.sectors} flakey {self.loop} 0 0 3600 1 error_writes"

    def error_at(self, mb0: int, mb1: int) -> str:
        s0, s1 = mb0 * MB // 512, mb1 * MB // 512
        return "\n".join([f"0 {s0} linear {self.loop} 0",
                          f"{s0} {s1 - s0} error",
                          f"{s1} {self.sectors - s1} linear {self.loop} {s1}"])

    def load(self, table: str) -> None:
        sh("dmsetup", "suspend", self.name)
        sh("dmsetup", "reload", self.name, input=table + "\n")
        sh("dmsetup", "resume", self.name)

    def close(self) -> None:
        subprocess.run(["dmsetup", "--noudevsync", "remove", "--retry", self.name],
                       capture_output=True, env=DM_ENV)
        subprocess.run(["losetup", "-d", self.loop], capture_output=True)


@pytest.fixture
def dm(tmp_path):
    d = Dm("phxdm", str(tmp_path / "dm.img"), DEV_MB)
    yield d
    d.close()


def run_child(code: str, env: dict, *args: str) -> str:
    r = subprocess.run([sys.executable, "-c", code, *args], env=env, capture_output=True,
                       text=True, timeout=900)
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout


# The stream path on the raw dm device: a helper module for the children.
_COMMON = textwrap.dedent(r"""
    import ctypes, errno, os, subprocess, sys
    import numpy as np
    import phx
    from phx._lib import cuda as _c
    lib = ctypes.CDLL("libcuda.so.1")
    assert hasattr(lib, "fake_sleep_async"), "not the fake libcuda"
    MB = 1 << 20
    rng = np.random.default_rng(int.from_bytes(os.urandom(8), "little"))

    def alloc(n):
        p = ctypes.c_uint64()
        assert lib.cuMemAlloc_v2(ctypes.byref(p), ctypes.c_size_t(n)) == 0
        return p.value

    def view(p, n):
        return np.ctypeslib.as_array((ctypes.c_uint8 * n).from_address(p))

    def stream():
        s = ctypes.c_void_p()
        assert lib.cuStreamCreate(ctypes.byref(s), 1) == 0
        return s.value

    def sync(s):
        assert lib.cuStreamSynchronize(ctypes.c_void_p(s)) == 0

    def op(ctx, f, base, size, foff, boff, write, s):
        a = np.array([size, foff, boff, -999], dtype=np.int64)
        ctx.stream_deferred(f._c_file, base, a.ctypes.data, write, s)
        sync(s)
        return int(a[3])

    def load(table):
        name, env = os.environ["PHX_TEST_DM"], dict(os.environ, DM_DISABLE_UDEV="1")
        for cmd in ("suspend", "reload", "resume"):
            subprocess.run(["dmsetup", "--noudevsync", cmd, name], env=env, check=True,
                           input=table + "\n" if cmd == "reload" else None, text=True)
""")

_FAILED_WRITE = _COMMON + textwrap.dedent(r"""
    path, linear, flakey = sys.argv[1:4]
    eng = phx.Engine()
    ctx = _c.Context(eng, 0, lanes=2, bufs_per_lane=2, buf_size=MB)
    s = stream()
    n = 4 * MB + 4097
    src, dst = alloc(n), alloc(n)
    good, old, new = rng.integers(0, 256, (3, n), dtype=np.uint8)
    with phx.open(path, "r+", engine=eng) as f:
        view(src, n)[:] = good
        assert op(ctx, f, src, n, 0, 0, True, s) == n
        view(src, n)[:] = old
        assert op(ctx, f, src, n, 16 * MB, 0, True, s) == n
        load(flakey)                                # writes fail from now on
        view(src, n)[:] = new
        w = op(ctx, f, src, n, 16 * MB, 0, True, s)
        assert w == -errno.EIO, f"write on a failing device: {w}"
        # the device itself still returns the old bytes there ...
        fd = os.open(path, os.O_RDONLY)
        assert os.pread(fd, 4096, 17 * MB) == old[MB:MB + 4096].tobytes()
        os.close(fd)
        # ... which phx never serves: stream read, host engine read
        view(dst, n)[:] = 0x5A
        r = op(ctx, f, dst, MB, 17 * MB, 0, False, s)
        assert r == -errno.EIO, f"stream read of the failed range: {r}"
        assert (view(dst, n) == 0x5A).all(), "a refused read wrote the destination"
        buf = phx.empty_aligned(MB)
        try:
            f.pread(buf, 16 * MB + 5)
        except OSError as e:
            assert e.errno == errno.EIO, e
        else:
            raise AssertionError("a host read of the failed range was served")
        assert op(ctx, f, dst, n, 0, 0, False, s) == n
        assert (view(dst, n) == good).all(), "the good range"
        st = ctx.stats()
        assert st["bad_marks"] >= 1 and st["bad_refusals"] >= 1, st
        load(linear)                                # healthy again
        assert op(ctx, f, src, n, 16 * MB, 0, True, s) == n
        assert op(ctx, f, dst, n, 16 * MB, 0, False, s) == n
        assert (view(dst, n) == new).all(), "rewritten range"
    ctx.close()
    print("ok failed-write", st["bad_marks"], st["bad_refusals"])
""")

_FAILED_READ = _COMMON + textwrap.dedent(r"""
    path, linear, erroring = sys.argv[1:4]
    eng = phx.Engine()
    ctx = _c.Context(eng, 0, lanes=2, bufs_per_lane=2, buf_size=MB)
    s = stream()
    n = 8 * MB
    src, dst = alloc(n), alloc(n)
    data = rng.integers(0, 256, n, dtype=np.uint8)
    with phx.open(path, "r+", engine=eng) as f:
        view(src, n)[:] = data
        assert op(ctx, f, src, n, 20 * MB, 0, True, s) == n
        load(erroring)                              # reads of [24, 25) MiB fail
        view(dst, n)[:] = 0x5A
        size = 6 * MB + 123
        r = op(ctx, f, dst, size, 20 * MB + 123, 0, False, s)
        assert r == -errno.EIO, f"stream read over a failing segment: {r}"
        got, want = view(dst, n), data[123:123 + n - 123]
        ok = (got[:size] == 0x5A) | (got[:size] == want[:size])
        assert ok.all(), f"{(~ok).sum()} bytes of the destination are neither untouched nor its own"
        assert (got[size:] == 0x5A).all(), "bytes past the request were written"
        assert op(ctx, f, dst, MB, 26 * MB, 0, False, s) == MB
        assert (view(dst, MB) == data[6 * MB:7 * MB]).all(), "a good read after the error"
        load(linear)
    ctx.close()
    print("ok failed-read")
""")


def child_env(fake: str, dm: Dm, **extra: str) -> dict:
    env = dict(os.environ, LD_LIBRARY_PATH=fake, PHX_TEST_DM=dm.name, PHX_CUDA_LANES="2")
    env.update(extra)
    return env


def test_failed_stream_write_is_never_served(fake_libcuda, dm):
    out = run_child(_FAILED_WRITE, child_env(fake_libcuda, dm), dm.path, dm.linear(),
                    dm.flakey())
    assert "ok failed-write" in out, out


def test_failed_stream_read_puts_nothing_foreign(fake_libcuda, dm):
    out = run_child(_FAILED_READ, child_env(fake_libcuda, dm), dm.path, dm.linear(),
                    dm.error_at(24, 25))
    assert "ok failed-read" in out, out


def test_failed_store_through_lmcache(fake_libcuda, dm, tmp_path):
    """LMCache's GDS backend (phx) with its slab on ext4 over the dm device."""
    site = os.environ.get("PHX_LMCACHE_SITE") or os.path.join(ROOT, ".lmcache-site")
    if not os.path.isdir(site):
        pytest.fail(f"no LMCache site folder at {site} (make .lmcache-site)")
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    sh("mkfs.ext4", "-q", "-F", dm.path)
    # lazytime: no timestamp is journalled while writes fail (ext4 would abort)
    sh("mount", "-o", "lazytime", dm.path, str(mnt))
    try:
        env = child_env(fake_libcuda, dm, PHX_TEST_DM_LINEAR=dm.linear(),
                        PHX_TEST_DM_FLAKEY=dm.flakey())
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [site, env.get("PYTHONPATH")]))
        # LMCache's import compiles numba kernels with cache=True: numba writes its
        # cache beside the source, and the guest sees the tree read-only (without a
        # writable cache folder LMCache's import fails: "no locator available")
        env["NUMBA_CACHE_DIR"] = str(tmp_path / "numba-cache")
        r = subprocess.run([sys.executable, "-W", "ignore",
                            os.path.join(ROOT, "adapters", "lmcache", "tests", "fake_checks.py"),
                            str(mnt), "-", "dm_failed_store"], env=env, capture_output=True,
                           text=True, timeout=1200)
        assert "ok dm_failed_store" in r.stdout, r.stdout + r.stderr
    finally:
        subprocess.run(["umount", str(mnt)], capture_output=True)
