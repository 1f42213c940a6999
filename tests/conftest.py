"""Shared fixtures for the phx pytest suites.

Everything here produces *fresh random* data (never zeros: a read that did
nothing must not look like a read that worked), places files on a real
block-device filesystem (not tmpfs, where O_DIRECT means something else), and
cleans up after itself even when a test fails.

Fixtures
--------
``rng``            numpy Generator; the seed is printed (``PHX_TEST_SEED`` replays it)
``rand_bytes``     ``rand_bytes(n) -> bytes`` of fresh random data
``data_dir``       a fresh directory on the real disk (ext4 here)
``make_file``      ``make_file(size, dir=None, name=None) -> (path, data)``
``fs_dir``         parametrised over ``disk`` / ``xfs`` / ``xfs4k`` / ``ext4img`` (loop images, root)
``xfs_dir``, ``ext4img_dir``  directories on session-wide loop-mounted images
``small_tmpfs``    an 8 MiB tmpfs (root), for ENOSPC
``small_ext4``     a ~16 MiB loop-mounted ext4 (root), for ENOSPC
``ramfs_dir``      a ramfs mount (root): refuses O_DIRECT
``engine``         a fresh ``phx.Engine()`` for counter tests
``real_gpu_marks()``  ``pytestmark`` of the suites that need a real CUDA GPU
"""
from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import tempfile
import uuid
import zlib

import numpy as np
import pytest

KiB = 1024
MiB = 1024 * KiB

# ---------------------------------------------------------------------------
# Random data
# ---------------------------------------------------------------------------

_SEED = int(os.environ.get("PHX_TEST_SEED") or int.from_bytes(os.urandom(8), "little"))


def pytest_report_header(config):
    return f"phx tests: random seed {_SEED} (replay with PHX_TEST_SEED={_SEED})"


@pytest.fixture
def rng(request):
    """A numpy Generator seeded per test from the session seed and the test id."""
    seed = (_SEED ^ zlib.crc32(request.node.nodeid.encode())) & 0xFFFFFFFFFFFFFFFF
    return np.random.default_rng(seed)


def fresh_bytes(rng: np.random.Generator, n: int) -> bytes:
    """n random bytes that are certainly not all zeros (and not all one value)."""
    if n == 0:
        return b""
    b = bytearray(rng.bytes(n))
    # Guarantee no all-zero (or constant) pattern even for tiny n.
    if n == 1:
        if b[0] == 0:
            b[0] = 0xA5
    elif len(set(b[: min(n, 64)])) < 2:
        b[0] ^= 0x5A
        b[-1] ^= 0xC3
    return bytes(b)


@pytest.fixture
def rand_bytes(rng):
    return lambda n: fresh_bytes(rng, n)


def assert_same(actual, expected, what: str = "data") -> None:
    """Byte equality with a short message (first difference), fast for 64 MiB."""
    a = memoryview(actual).cast("B") if not isinstance(actual, (bytes, bytearray)) else actual
    e = memoryview(expected).cast("B") if not isinstance(expected, (bytes, bytearray)) else expected
    if len(a) != len(e):
        raise AssertionError(f"{what}: length {len(a)} != expected {len(e)}")
    if bytes(a) == bytes(e):
        return
    an = np.frombuffer(a, dtype=np.uint8)
    en = np.frombuffer(e, dtype=np.uint8)
    bad = np.flatnonzero(an != en)
    i = int(bad[0])
    raise AssertionError(
        f"{what}: {bad.size} of {len(e)} bytes differ; first at {i} (last at {int(bad[-1])}): "
        f"got {bytes(a[i:i + 8]).hex()} expected {bytes(e[i:i + 8]).hex()}"
        + ("; got zeros there" if not any(bytes(a[i:i + 8])) else ""))


def buf_address(obj) -> int:
    """Memory address of a writable or read-only buffer."""
    return np.frombuffer(obj, dtype=np.uint8).ctypes.data if len(memoryview(obj)) else 0


# ---------------------------------------------------------------------------
# Where files go
# ---------------------------------------------------------------------------

def sigint_default() -> None:
    """preexec_fn for a child that a test interrupts with SIGINT: a shell's
    background job (``.ci/run &``) hands its children SIGINT ignored, and an
    ignored SIGINT stays ignored across exec, so Python would never raise
    KeyboardInterrupt there.  Seen: two such tests failed in a CI run
    started with ``&`` and passed in the foreground."""
    import signal
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def fs_type(path: str) -> str:
    """Filesystem type of the mount holding @path (longest /proc/mounts prefix)."""
    path = os.path.realpath(path)
    best, best_type = "", "unknown"
    with open("/proc/mounts") as f:
        for line in f:
            parts = line.split()
            if len(parts) < 3:
                continue
            mnt = parts[1].replace("\\040", " ")
            if (path == mnt or path.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best):
                best, best_type = mnt, parts[2]
    return best_type


def _disk_base() -> str:
    """A directory on a real block-device filesystem: $PHX_TEST_DIR, the system
    temp dir unless it is tmpfs, else /var/tmp, else the repository's build/."""
    cands = [os.environ.get("PHX_TEST_DIR"), tempfile.gettempdir(), "/var/tmp",
             os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "build")]
    for c in cands:
        if c and os.path.isdir(c) and os.access(c, os.W_OK) and fs_type(c) not in ("tmpfs", "ramfs", "overlay"):
            return c
    for c in cands:
        if c:
            os.makedirs(c, exist_ok=True)
            return c
    raise RuntimeError("no writable directory for test files")


@pytest.fixture(scope="session")
def disk_base():
    d = tempfile.mkdtemp(prefix="phx-tests-", dir=_disk_base())
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def data_dir(disk_base):
    d = tempfile.mkdtemp(dir=disk_base)
    yield d
    shutil.rmtree(d, ignore_errors=True)


def write_file(path: str, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        mv = memoryview(data)
        off = 0
        while off < len(data):
            off += os.pwrite(fd, mv[off:off + 16 * MiB], off)
    finally:
        os.close(fd)


def read_file(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


@pytest.fixture
def make_file(data_dir, rng):
    """make_file(size, dir=None, name=None) -> (path, data): a file of fresh random data."""
    def _make(size: int, dir: str | None = None, name: str | None = None):
        d = dir or data_dir
        path = os.path.join(d, name or f"f-{uuid.uuid4().hex[:8]}")
        data = fresh_bytes(rng, size)
        write_file(path, data)
        return path, data
    return _make


@pytest.fixture
def new_path(data_dir):
    """new_path(dir=None) -> a path that does not exist yet."""
    def _new(dir: str | None = None):
        return os.path.join(dir or data_dir, f"n-{uuid.uuid4().hex[:8]}")
    return _new


# ---------------------------------------------------------------------------
# Loop-mounted images and small filesystems (root only)
# ---------------------------------------------------------------------------

def is_root() -> bool:
    return os.geteuid() == 0


def _run(cmd: list[str]) -> None:
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def _need_root(what: str) -> None:
    if not is_root():
        pytest.skip(f"{what} needs root (loop devices / mount)")


@contextlib.contextmanager
def loop_mounted(base: str, fstype: str, size: int, mkfs_args: tuple[str, ...] = ()):
    """Create an image of @size bytes in @base, mkfs it and mount it with -o loop."""
    mkfs = shutil.which(f"mkfs.{fstype}") or (f"/usr/sbin/mkfs.{fstype}"
                                              if os.path.exists(f"/usr/sbin/mkfs.{fstype}") else None)
    if mkfs is None:
        pytest.skip(f"mkfs.{fstype} not installed (apt-get install "
                    f"{'xfsprogs' if fstype == 'xfs' else 'e2fsprogs'})")
    img = os.path.join(base, f"{fstype}-{uuid.uuid4().hex[:8]}.img")
    mnt = img[:-4] + ".mnt"
    os.makedirs(mnt)
    mounted = False
    try:
        with open(img, "wb") as f:
            f.truncate(size)
        try:
            _run([mkfs, *mkfs_args, img])
            _run(["mount", "-o", "loop", img, mnt])
        except (subprocess.CalledProcessError, OSError) as e:
            err = getattr(e, "stderr", b"") or b""
            pytest.skip(f"cannot make/mount a loop {fstype} image: {e} {err.decode(errors='replace').strip()}")
        mounted = True
        yield mnt
    finally:
        if mounted:
            subprocess.run(["umount", mnt], check=False, stderr=subprocess.DEVNULL)
            if os.path.ismount(mnt):
                subprocess.run(["umount", "-l", mnt], check=False, stderr=subprocess.DEVNULL)
        with contextlib.suppress(OSError):
            os.rmdir(mnt)
        with contextlib.suppress(OSError):
            os.unlink(img)


@pytest.fixture(scope="session")
def xfs_mount(disk_base):
    _need_root("the xfs loop image")
    with loop_mounted(disk_base, "xfs", 512 * MiB, ("-q", "-f")) as mnt:
        yield mnt


@pytest.fixture(scope="session")
def xfs4k_mount(disk_base):
    """xfs on a loop device with 4096-byte logical sectors (so O_DIRECT needs 4 KiB)."""
    _need_root("the 4k-sector xfs loop image")
    mkfs = shutil.which("mkfs.xfs") or "/usr/sbin/mkfs.xfs"
    if not os.path.exists(mkfs):
        pytest.skip("mkfs.xfs not installed (apt-get install xfsprogs)")
    img = os.path.join(disk_base, f"xfs4k-{uuid.uuid4().hex[:8]}.img")
    mnt = img[:-4] + ".mnt"
    os.makedirs(mnt)
    loopdev = None
    mounted = False
    try:
        with open(img, "wb") as f:
            f.truncate(320 * MiB)
        try:
            loopdev = subprocess.run(["losetup", "--find", "--show", "--sector-size", "4096", img],
                                     check=True, capture_output=True, text=True).stdout.strip()
            _run([mkfs, "-q", "-f", loopdev])
            _run(["mount", loopdev, mnt])
        except (subprocess.CalledProcessError, OSError) as e:
            pytest.skip(f"cannot set up a 4k-sector loop xfs: {e}")
        mounted = True
        yield mnt
    finally:
        if mounted:
            subprocess.run(["umount", mnt], check=False, stderr=subprocess.DEVNULL)
        if loopdev:
            subprocess.run(["losetup", "-d", loopdev], check=False, stderr=subprocess.DEVNULL)
        with contextlib.suppress(OSError):
            os.rmdir(mnt)
        with contextlib.suppress(OSError):
            os.unlink(img)


@pytest.fixture(scope="session")
def ext4img_mount(disk_base):
    _need_root("the ext4 loop image")
    with loop_mounted(disk_base, "ext4", 256 * MiB, ("-q", "-F")) as mnt:
        yield mnt


def _subdir(mnt: str) -> str:
    d = os.path.join(mnt, f"t-{uuid.uuid4().hex[:8]}")
    os.makedirs(d)
    return d


@pytest.fixture
def xfs_dir(xfs_mount):
    d = _subdir(xfs_mount)
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def xfs4k_dir(xfs4k_mount):
    d = _subdir(xfs4k_mount)
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def ext4img_dir(ext4img_mount):
    d = _subdir(ext4img_mount)
    yield d
    shutil.rmtree(d, ignore_errors=True)


FILESYSTEMS = ["disk", "xfs", "xfs4k", "ext4img"]


@pytest.fixture(params=FILESYSTEMS)
def fs_dir(request, data_dir):
    """A fresh directory on each filesystem kind: the real disk, a loop xfs
    (512-byte sectors), a loop xfs on 4096-byte sectors, a loop ext4."""
    if request.param == "disk":
        return data_dir
    return request.getfixturevalue(f"{request.param}_dir")


@pytest.fixture
def small_tmpfs(disk_base):
    """An 8 MiB tmpfs; yields its mount point."""
    _need_root("the size-limited tmpfs")
    mnt = tempfile.mkdtemp(prefix="tmpfs-", dir=disk_base)
    try:
        try:
            _run(["mount", "-t", "tmpfs", "-o", "size=8M", "phx-test", mnt])
        except (subprocess.CalledProcessError, OSError) as e:
            pytest.skip(f"cannot mount a size-limited tmpfs: {e}")
        try:
            yield mnt
        finally:
            subprocess.run(["umount", mnt], check=False, stderr=subprocess.DEVNULL)
    finally:
        with contextlib.suppress(OSError):
            os.rmdir(mnt)


@pytest.fixture
def small_ext4(disk_base):
    """A ~16 MiB loop-mounted ext4 (no reserved blocks); yields its mount point."""
    _need_root("the small ext4 loop image")
    with loop_mounted(disk_base, "ext4", 16 * MiB, ("-q", "-F", "-m", "0")) as mnt:
        yield mnt


@pytest.fixture
def ramfs_dir(disk_base):
    """A ramfs mount: a filesystem that refuses O_DIRECT opens (EINVAL)."""
    _need_root("the ramfs mount")
    mnt = tempfile.mkdtemp(prefix="ramfs-", dir=disk_base)
    try:
        try:
            _run(["mount", "-t", "ramfs", "phx-test", mnt])
        except (subprocess.CalledProcessError, OSError) as e:
            pytest.skip(f"cannot mount ramfs: {e}")
        try:
            yield mnt
        finally:
            subprocess.run(["umount", mnt], check=False, stderr=subprocess.DEVNULL)
    finally:
        with contextlib.suppress(OSError):
            os.rmdir(mnt)


@pytest.fixture(params=["tmpfs", "ext4"])
def small_fs(request):
    """A small filesystem to fill up: an 8 MiB tmpfs or a 16 MiB loop ext4."""
    return request.getfixturevalue(f"small_{request.param}")


# ---------------------------------------------------------------------------
# phx
# ---------------------------------------------------------------------------

@pytest.fixture
def engine():
    import phx
    return phx.Engine()


@pytest.fixture(scope="session")
def fake_libcuda(tmp_path_factory):
    """``tests/gpu_fake/fake_cuda.c`` built once as ``libcuda.so.1``: the folder
    to put on ``LD_LIBRARY_PATH`` of a child that should see it as CUDA."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if not cc:
        pytest.skip("needs a C compiler for the fake libcuda (tests/gpu_fake)")
    d = tmp_path_factory.mktemp("fakecuda")
    src = os.path.join(os.path.dirname(os.path.abspath(__file__)), "gpu_fake", "fake_cuda.c")
    subprocess.run([cc, "-shared", "-fPIC", "-O1", "-o", str(d / "libcuda.so.1"), src,
                    "-lpthread"], check=True)
    return d


@pytest.fixture(scope="session")
def fake_cuda(fake_libcuda):
    """The fake libcuda, for tests that drive phx's GPU module against it."""
    try:
        import phx._lib.cuda  # noqa: F401
    except ImportError as e:
        pytest.skip(f"phx built without its GPU module: {e}")
    return fake_libcuda


def real_gpu_marks() -> list:
    """``pytestmark = real_gpu_marks()`` for a suite that needs a real CUDA GPU:
    marks it ``gpu`` and skips it unless phx.gpu can work (its module built, a
    CUDA driver and device) and torch sees a CUDA device; the reason says
    which was missing.  The caller imports torch first (``importorskip``): a
    suite without torch skips as "torch not installed", not here."""
    import phx.gpu
    import torch
    ok, why = phx.gpu.is_available()
    if ok and not torch.cuda.is_available():
        why = "torch sees no CUDA device"
    return [pytest.mark.gpu,
            pytest.mark.skipif(not (ok and torch.cuda.is_available()),
                               reason=f"no usable GPU: {why}")]


def torch_or_skip():
    try:
        import torch  # noqa: F401
    except Exception as e:  # ImportError, or a broken install
        pytest.skip(f"torch not importable: {e!r}")
    return torch
