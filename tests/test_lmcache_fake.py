"""libphxfile.so through LMCache's own ``gds_backends.phx`` code on the fake
libcuda of tests/gpu_fake (no GPU needed).

``adapters/lmcache/tests/fake_checks.py`` runs in a child with the fake
first on LD_LIBRARY_PATH: LMCache's ``open_slab`` and ``AsyncHandle``
``read_async``/``write_async`` with ctypes ``Submission``s, on random data,
unaligned sizes and offsets, cut at region edges as ``GDSContext`` cuts
them; deferred arguments; a copy queued after a read sees its data; eight
threads on eight streams; unregistered buffers; ENOSPC on a full small
filesystem (logged once); closed and reused fds; registration rules; handle
deregistration with transfers queued; driver references.  Both paths: Co-DMA
staging (libphx) and the direct path's code with the test hook that uses the
fake's "device" memory as its own mapping (the real /dev/phx mapping needs
phx.ko on a GPU machine: not available here).  Slabs on the box's ext4 and
on an xfs loop mount (root).  This proves the adapter's logic, not CUDA:
tests/test_lmcache_gpu.py checks the same on a real GPU.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "adapters", "lmcache", "tests"))
import support  # noqa: E402

SITE = support.lmcache_site()
CHECKS = ["driver_refcount", "loaded_is_ours", "roundtrip_chunks", "deferred_arguments",
          "early_reads", "work_after_read_sees_data", "threads_and_streams", "unregistered_buffer",
          "enospc", "closed_fd", "registration_rules", "close_with_io_in_flight"]
pytestmark = [
    pytest.mark.skipif(not support.phx_lmcache_installed(),
                       reason="phx_lmcache/libphxfile.so not installed (pip install .)"),
    pytest.mark.skipif(SITE is None, reason=f"lmcache not installed: {support.INSTALL_HINT}"),
]




def _mount(kind: str, where: str, image: str | None = None) -> bool:
    if os.geteuid() != 0:
        return False
    os.makedirs(where, exist_ok=True)
    if kind == "tmpfs":
        cmd = ["mount", "-t", "tmpfs", "-o", "size=8M", "tmpfs", where]
    else:
        subprocess.run(["truncate", "-s", "512M", image], check=True)
        if subprocess.run(["mkfs.xfs", "-q", "-f", image], capture_output=True).returncode:
            return False
        cmd = ["mount", "-o", "loop", image, where]
    return subprocess.run(cmd, capture_output=True).returncode == 0


def _umount(where: str) -> None:
    """Unmount, retrying while a just-exited child may still hold it; lazily
    as the last resort so that no mount outlives the test."""
    import time
    for _ in range(50):
        if subprocess.run(["umount", where], capture_output=True).returncode == 0:
            return
        time.sleep(0.1)
    subprocess.run(["umount", "-l", where], capture_output=True)


def _run(fake, workdir: str, smallfs: str, mode: str) -> tuple[dict[str, str], str]:
    extra = {"LD_LIBRARY_PATH": str(fake), "PHX_CUDA_LANES": "2"}
    if mode == "direct":
        extra["PHXFILE_TEST_DIRECT"] = "identity"
    r = support.run_py(os.path.join(support.HERE, "fake_checks.py"),
                       [workdir, smallfs, "all"], support.child_env(SITE, **extra))
    results = {}
    for line in r.stdout.splitlines():
        word, _, rest = line.partition(" ")
        if word in ("ok", "FAIL", "skip"):
            name, _, why = rest.partition(":")
            results[name] = f"{word}{':' + why if why else ''}"
    assert r.returncode == 0, f"the checks crashed (rc {r.returncode}):\n{r.stdout}\n{r.stderr}"
    return results, r.stderr


@pytest.fixture(scope="module", params=["staging", "direct"])
def results(request, fake_libcuda, tmp_path_factory):
    base = tmp_path_factory.mktemp(f"phxfile-{request.param}")
    small = str(base / "small")
    mounted = _mount("tmpfs", small)
    try:
        out, err = _run(fake_libcuda, str(base), small if mounted else "-", request.param)
    finally:
        if mounted:
            _umount(small)
    return request.param, out, err


@pytest.mark.parametrize("check", CHECKS)
def test_fake(results, check):
    mode, out, _ = results
    got = out.get(check, "missing (the child died before it)")
    if got.startswith("skip"):
        pytest.skip(got)
    assert got == "ok", f"{mode}: {got}"


def test_path_logged_once_at_open(results):
    """The driver says which path ran, at every open, and nothing else."""
    mode, _, err = results
    opens = [l for l in err.splitlines() if "driver open (libphx" in l]
    assert opens and all(f"path={mode}" in l for l in opens), opens


def test_failure_logged_once_then_with_totals(results):
    """Two ENOSPC failures on one slab: one first line with errno and file;
    any later line of that kind carries running totals."""
    mode, out, err = results
    if not out.get("enospc", "").startswith("ok"):
        pytest.skip("the ENOSPC check did not run")
    lines = [l for l in err.splitlines()
             if "No space left on device" in l and "lmcache_gds_slab.bin" in l]
    first = [l for l in lines if "further failures of this kind are counted" in l]
    assert len(first) == 1 and "errno 28" in first[0], lines
    assert all("times so far" in l for l in lines if l not in first), lines


def test_failures_logged_with_running_totals(fake_libcuda, tmp_path):
    """Failures keep being logged, with running totals (PHXFILE_LOG_INTERVAL_S=1):
    four ENOSPC writes, three at once and one two seconds later, give the
    first line, then lines "N times so far, M since the last line" (from the
    next failure once the interval has passed, from the periodic flush, or at
    driver close) whose counts add up to all four."""
    import re
    small = str(tmp_path / "small")
    if not _mount("tmpfs", small):
        pytest.skip("needs root for a small tmpfs")
    try:
        r = support.run_py(os.path.join(support.HERE, "fake_checks.py"),
                           [str(tmp_path), small, "failure_totals"],
                           _server_env(fake_libcuda, PHXFILE_LOG_INTERVAL_S="1"))
    finally:
        _umount(small)
    assert "ok failure_totals" in r.stdout, r.stdout + r.stderr
    lines = [l for l in r.stderr.splitlines()
             if "phxFileWriteAsync failed" in l and "No space left on device" in l]
    assert "further failures of this kind are counted" in lines[0], lines
    totals = [tuple(map(int, m.groups())) for l in lines[1:]
              for m in [re.search(r"(\d+) times so far, (\d+) since the last line", l)] if m]
    assert len(totals) >= 1 and len(totals) == len(lines) - 1, lines
    assert totals[-1][0] == 4 and 1 + sum(t[1] for t in totals) == 4, lines
    assert [t[0] for t in totals] == sorted(set(t[0] for t in totals)), lines


@pytest.mark.parametrize("what", ["no_memops", "pinning"])
def test_startup_refuses_a_device_it_cannot_serve(fake_libcuda, tmp_path, what):
    """What each GPU needs is checked when its first buffer is registered
    (LMCache registers its staging buffers when a GPU attaches), not at the
    first transfer: without stream memory operations (FAKE_CUDA_NO_MEMOPS=1)
    or without pinned staging (the fake's cuMemHostRegister failing) the
    registration fails, one line says why, and the refusal is kept."""
    extra = {"FAKE_CUDA_NO_MEMOPS": "1"} if what == "no_memops" else {}
    r = support.run_py(os.path.join(support.HERE, "fake_checks.py"),
                       [str(tmp_path), "-", f"startup_{what}"],
                       _server_env(fake_libcuda, **extra))
    assert f"ok startup_{what}" in r.stdout, r.stdout + r.stderr
    lines = [l for l in r.stderr.splitlines() if "device 0: cannot start" in l]
    assert len(lines) == 1, r.stderr
    assert ("stream memory operations" if what == "no_memops" else "pinned host memory") \
        in lines[0], lines


@pytest.mark.parametrize("early", [True, False], ids=["", "no-early-reads"])
def test_slab_on_xfs(fake_libcuda, tmp_path, early):
    """The write-then-read checks with the slab on xfs (loop mount, root), with
    libphx's early reads (libphxfile's default; their first version crashed here
    about one run in five, when a read finished before its early start looked at
    it) and without (PHX_CUDA_EARLY_READS=0)."""
    mnt = str(tmp_path / "xfs")
    if not shutil.which("mkfs.xfs") or not _mount("xfs", mnt, str(tmp_path / "xfs.img")):
        pytest.skip("needs root and mkfs.xfs for an xfs loop mount")
    try:
        extra = {"LD_LIBRARY_PATH": str(fake_libcuda), "PHX_CUDA_LANES": "2"}
        if not early:
            extra["PHX_CUDA_EARLY_READS"] = "0"
        r = support.run_py(os.path.join(support.HERE, "fake_checks.py"),
                           [mnt, "-", "roundtrip_chunks", "deferred_arguments",
                            "threads_and_streams", "closed_fd", "early_reads"],
                           support.child_env(SITE, **extra))
    finally:
        _umount(mnt)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.count("\nok ") + r.stdout.startswith("ok ") == 5, r.stdout


def test_second_device_writes_void_early_reads(fake_libcuda, tmp_path):
    """Early reads stay on with two devices in one process (two fake devices),
    and stay sound: a write through the second device's context voids the first
    device's early pieces of that range, and a write the second device has
    queued but not yet issued keeps the first device's reads of that range from
    starting early at all (libphx's per-inode write log and pending list are
    process-wide; the second check fails with the pending check taken out of
    inode.c).  The reads return the new bytes; nothing is turned off or
    logged as off."""
    checks = ["second_device_writes_void_early_reads",
              "second_device_pending_write_blocks_early_reads"]
    r = support.run_py(os.path.join(support.HERE, "fake_checks.py"),
                       [str(tmp_path), "-", *checks],
                       support.child_env(SITE, LD_LIBRARY_PATH=str(fake_libcuda),
                                         PHX_CUDA_LANES="2", FAKE_CUDA_DEVICES="2"))
    assert r.returncode == 0, r.stdout + r.stderr
    for c in checks:
        assert f"ok {c}" in r.stdout, r.stdout + r.stderr
    assert "early reads off" not in r.stderr, r.stderr
    assert r.stderr.count("early reads on") == 2, r.stderr      # one line per device


_CLAIM_CHILD = r"""
import ctypes, os, sys
import phx_lmcache
lib = ctypes.CDLL(phx_lmcache.library_path())
assert lib.phxFileDriverOpen() == 0
path = sys.argv[1]
fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o644)
os.ftruncate(fd, 1 << 20)
fh, fh2 = ctypes.c_void_p(), ctypes.c_void_p()
rc = lib.phxFileHandleRegister(ctypes.byref(fh), fd)
print("rc", rc, flush=True)
if rc == 0:
    # the same process may register its slab twice
    print("again", lib.phxFileHandleRegister(ctypes.byref(fh2), fd), flush=True)
    sys.stdin.readline()                # held until the parent says so
    lib.phxFileHandleDeregister(fh2)
    lib.phxFileHandleDeregister(fh)
os.close(fd)
lib.phxFileDriverClose()
"""


def test_slab_claimed_by_one_process(fake_libcuda, tmp_path):
    """Two GPU processes given one slab path (LMCache opens it with O_TRUNC, so they
    would wipe each other's KV): the second process's registration is -EBUSY, naming
    the holder, and works once the first has let go; one process may register twice."""
    import errno
    import subprocess
    env = support.child_env(SITE, LD_LIBRARY_PATH=str(fake_libcuda), PHX_CUDA_LANES="2")
    slab = str(tmp_path / "lmcache_gds_slab.bin")
    argv = [sys.executable, "-W", "ignore", "-c", _CLAIM_CHILD, slab]
    a = subprocess.Popen(argv, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    try:
        assert a.stdout.readline().split() == ["rc", "0"]
        assert a.stdout.readline().split() == ["again", "0"]
        b = subprocess.run(argv, env=env, input="", capture_output=True, text=True, timeout=120)
        assert b.stdout.split()[:2] == ["rc", str(-errno.EBUSY)], b.stdout + b.stderr
        assert f"in use by process {a.pid}" in b.stderr, b.stderr
    finally:
        a.communicate("go\n", timeout=120)
    assert a.returncode == 0
    c = subprocess.run(argv, env=env, input="\n", capture_output=True, text=True, timeout=120)
    assert c.stdout.split()[:2] == ["rc", "0"], c.stdout + c.stderr


# ---------------------------------------------------------------------------
# issue 23: LMCache's own server path (adapters/lmcache/tests/server_checks.py)

SERVER = os.path.join(support.HERE, "server_checks.py")


def _server_env(fake, **extra):
    return support.child_env(SITE, LD_LIBRARY_PATH=str(fake), PHX_CUDA_LANES="2", **extra)


def _fs_dir(kind: str, tmp_path):
    """A folder on the box's filesystem (ext4 here) or on an xfs / ext4 loop
    mount (root); yields it, unmounts after."""
    import contextlib

    @contextlib.contextmanager
    def cm():
        if kind == "box":
            yield str(tmp_path / "box")
            return
        mnt = str(tmp_path / kind)
        mkfs = "mkfs.xfs" if kind == "xfs" else "mkfs.ext4"
        if os.geteuid() != 0 or not shutil.which(mkfs):
            pytest.skip(f"needs root and {mkfs} for a loop mount")
        img = str(tmp_path / f"{kind}.img")
        if kind == "xfs":
            ok = _mount("xfs", mnt, img)
        else:
            subprocess.run(["truncate", "-s", "256M", img], check=True)
            os.makedirs(mnt, exist_ok=True)
            ok = (subprocess.run([mkfs, "-q", "-F", img], capture_output=True).returncode == 0
                  and subprocess.run(["mount", "-o", "loop", img, mnt],
                                     capture_output=True).returncode == 0)
        if not ok:
            pytest.skip(f"could not mount {kind}")
        try:
            yield mnt
        finally:
            _umount(mnt)
    return cm()


@pytest.mark.parametrize("first_hook", ["hook", "nohook"])
@pytest.mark.parametrize("fs", ["box", "xfs"])
def test_second_server_leaves_the_first_slab_alone(fake_libcuda, tmp_path, fs, first_hook):
    """Two LMCache GDS L1 servers (LMCache's L1Manager with backend phx, as the
    cache server starts it) given one path: the first stores random KV chunks;
    the second's start fails with a message naming the first's process, before
    LMCache's open_slab truncates anything; the first's chunks then load
    byte-exact and the slab file holds them.  The first server runs with the
    import hook (the OFD claim) or without it (PHX_LMCACHE_HOOK=0: only
    libphxfile's registration lock, which the second's hook checks too)."""
    with _fs_dir(fs, tmp_path) as where:
        loc = os.path.join(where, "gds")
        env_a = _server_env(fake_libcuda)
        if first_hook == "nohook":      # LMCache finds the library on the loader path
            import phx_lmcache
            env_a.update(PHX_LMCACHE_HOOK="0", LD_LIBRARY_PATH=os.pathsep.join(
                [str(fake_libcuda), os.path.dirname(phx_lmcache.library_path())]))
        a = subprocess.Popen([sys.executable, "-W", "ignore", SERVER, "hold", loc, "6"],
                             env=env_a, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
        try:
            line = a.stdout.readline()
            assert line.startswith("ready"), line + a.stdout.read() + a.stderr.read()
            size = os.path.getsize(os.path.join(loc, "lmcache_gds_slab.bin"))
            b = support.run_py(SERVER, ["start", loc], _server_env(fake_libcuda), timeout=120)
            size_after = os.path.getsize(os.path.join(loc, "lmcache_gds_slab.bin"))
        finally:
            out, err = a.communicate("go\n", timeout=120)
        assert a.returncode == 0 and "ok hold" in out, out + err
        assert "refused SlabInUse" in b.stdout, b.stdout + b.stderr
        assert f"in use by process {a.pid}" in b.stdout, b.stdout
        assert "left untouched" in b.stdout, b.stdout
        assert size_after == size
        # the first one gone, a server starts on the path again
        c = support.run_py(SERVER, ["start", loc], _server_env(fake_libcuda), timeout=120)
        assert "ok started" in c.stdout, c.stdout + c.stderr


def _filling_fs(kind: str, tmp_path):
    """A filesystem on a loop device whose backing file is sparse on a small
    tmpfs: once the test fills the tmpfs, writes to blocks never written
    before fail (the loop device cannot allocate them: ENOSPC/EIO) while
    blocks already written stay readable and writable.  Yields (mount,
    backing folder)."""
    import contextlib

    @contextlib.contextmanager
    def cm():
        mkfs = {"ext4": ["mkfs.ext4", "-q", "-E", "lazy_itable_init=0,lazy_journal_init=0"],
                "xfs": ["mkfs.xfs", "-q", "-f"]}[kind]
        if os.geteuid() != 0 or not shutil.which(mkfs[0]) or not shutil.which("losetup"):
            pytest.skip(f"needs root, losetup and {mkfs[0]}")
        back, mnt = str(tmp_path / "back"), str(tmp_path / "mnt")
        os.makedirs(back)
        os.makedirs(mnt)
        tmpfs, img = ("48M", "256M") if kind == "ext4" else ("160M", "400M")
        if subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={tmpfs}", "tmpfs", back],
                          capture_output=True).returncode:
            pytest.skip("cannot mount a tmpfs")
        loop = None
        try:
            subprocess.run(["truncate", "-s", img, os.path.join(back, "img")], check=True)
            r = subprocess.run(["losetup", "-f", "--show", os.path.join(back, "img")],
                               capture_output=True, text=True)
            if r.returncode:
                pytest.skip(f"losetup: {r.stderr.strip()}")
            loop = r.stdout.strip()
            subprocess.run(mkfs + [loop], check=True, capture_output=True)
            if subprocess.run(["mount", loop, mnt], capture_output=True).returncode:
                pytest.skip(f"cannot mount {kind} on {loop}")
            try:
                yield mnt, back
            finally:
                _umount(mnt)
        finally:
            if loop:
                subprocess.run(["losetup", "-d", loop], capture_output=True)
            _umount(back)
    return cm()


@pytest.mark.parametrize("hook", ["hook", "nohook"])
@pytest.mark.parametrize("fs", ["ext4", "xfs"])
def test_failed_store_is_not_admitted(fake_libcuda, tmp_path, fs, hook):
    """LMCache's store and retrieve steps on a slab whose device starts failing
    writes (the loop device's backing filesystem filled): the stores' slab
    writes fail (ENOSPC or EIO in bytes_done, which LMCache never reads); the
    import hook's finish_write check keeps them out of the cache (a miss, so
    vLLM recomputes), their slab space is freed, a load of their range is
    refused (a failed retrieve, the destination untouched), the earlier good
    chunks load byte-exact, and once the device has room the same keys store
    and load byte-exact.  Without the hook (PHX_LMCACHE_HOOK=0) LMCache admits
    the failed stores, and its own retrieve of them fails (libphxfile refuses
    the loads at submission) instead of serving old or zero bytes."""
    env = _server_env(fake_libcuda)
    if hook == "nohook":
        import phx_lmcache
        env.update(PHX_LMCACHE_HOOK="0", LD_LIBRARY_PATH=os.pathsep.join(
            [str(fake_libcuda), os.path.dirname(phx_lmcache.library_path())]))
    with _filling_fs(fs, tmp_path) as (mnt, back):
        r = support.run_py(SERVER, ["failed_store", os.path.join(mnt, "gds"), back],
                           env, timeout=240)
    assert "ok failed_store" in r.stdout, r.stdout + r.stderr
    if hook == "hook":
        assert "store(s) not admitted: their slab write failed" in r.stderr, r.stderr
