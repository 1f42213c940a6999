"""Lifetimes, processes, big numbers, and filesystems that refuse O_DIRECT.

- A File keeps its Engine alive; a Future keeps its File/Engine alive.
- After fork() the child gets its own default engine and does I/O.
- Offsets beyond 4 GiB and a request larger than 2 GiB (32-bit truncation).
- More files open on one engine than it has registered-file slots.
- On ramfs (no O_DIRECT): a clear OSError(EINVAL) with the path, or with
  allow_buffered=True a buffered file (File.direct False) that works - in
  every mode, including the exclusive-create ones.
"""
from __future__ import annotations

import errno
import gc
import os
import sys
import weakref

import numpy as np
import pytest

import phx
from conftest import MiB, assert_same, fresh_bytes, write_file

GiB = 1024 * MiB


def test_file_keeps_engine_alive(data_dir, rng):
    path = os.path.join(data_dir, "f")
    data = fresh_bytes(rng, 100_000)
    write_file(path, data)
    f = phx.open(path, "r", engine=phx.Engine(queue_depth=8))
    gc.collect()
    b = bytearray(100_000)
    assert f.pread(b, 0) == 100_000
    assert_same(b, data)
    f.close()


def test_future_keeps_everything_alive(data_dir, rng):
    path = os.path.join(data_dir, "f")
    data = fresh_bytes(rng, 3 * MiB)
    write_file(path, data)
    b = phx.empty_aligned(3 * MiB)
    fut = phx.open(path, "r", engine=phx.Engine()).pread_async(b, 0)
    gc.collect()
    assert fut.result(timeout=60) == 3 * MiB
    assert_same(b, data)


def test_engine_freed_when_unused(data_dir):
    """Engines do not leak: dropping the last reference frees it."""
    eng = phx.Engine()
    try:
        ref = weakref.ref(eng)
    except TypeError:
        pytest.skip("phx.Engine does not support weak references")
    del eng
    gc.collect()
    assert ref() is None


def test_many_engines_created_and_dropped(data_dir, rng):
    """Rings and bounce buffers are released: 300 engines in a row."""
    path = os.path.join(data_dir, "f")
    data = fresh_bytes(rng, 5000)
    write_file(path, data)
    for i in range(300):
        with phx.open(path, "r", engine=phx.Engine(queue_depth=4)) as f:
            b = bytearray(10)
            assert f.pread(b, i) == 10
            assert_same(b, data[i:i + 10])
    gc.collect()


def test_fork_child_uses_own_default_engine(data_dir, rng):
    path = os.path.join(data_dir, "f")
    data = fresh_bytes(rng, 1 * MiB + 3)
    write_file(path, data)
    with phx.open(path, "r") as f:  # the parent's default engine exists and has been used
        f.pread(bytearray(10), 0)
    parent_engine = phx.default_engine()
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child
        code = 1
        try:
            os.close(r)
            ok = phx.default_engine() is not parent_engine
            with phx.open(path, "r") as f:
                b = bytearray(len(data))
                ok = ok and f.pread(b, 0) == len(data) and bytes(b) == data
                fut = f.pread_async(bytearray(100), 7)
                ok = ok and fut.result(timeout=60) == 100
            os.write(w, b"ok" if ok else b"bad")
            code = 0
        finally:
            os._exit(code)
    os.close(w)
    msg = os.read(r, 10)
    os.close(r)
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, status
    assert msg == b"ok", "the child could not do I/O through its default engine"
    # the parent still works
    with phx.open(path, "r") as f:
        b = bytearray(100)
        assert f.pread(b, 5) == 100
    assert_same(b, data[5:105])


@pytest.mark.parametrize("off", [4 * GiB - 1, 4 * GiB, 5 * GiB + 3, (1 << 40) + 4097])
def test_offsets_beyond_4gib(data_dir, rng, off):
    path = os.path.join(data_dir, "sparse")
    data = fresh_bytes(rng, 10_000)
    with phx.open(path, "w+") as f:
        assert f.pwrite(data, off) == 10_000
        assert f.size == off + 10_000
        b = bytearray(10_000)
        assert f.pread(b, off) == 10_000
    assert_same(b, data)
    fd = os.open(path, os.O_RDONLY)
    try:
        assert_same(os.pread(fd, 10_000, off), data, "via os.pread")
        assert os.pread(fd, 16, off % (1 << 32)) in (bytes(16), b"") or off % (1 << 32) >= off
    finally:
        os.close(fd)


def test_request_larger_than_2gib(data_dir, rng):
    """One read of 2 GiB + 4097 bytes at offset 1 (bounce + split) from a
    sparse file with random data at both ends: the count and the bytes are right."""
    n = 2 * GiB + 4097
    path = os.path.join(data_dir, "huge")
    head = fresh_bytes(rng, 1 * MiB)
    tail = fresh_bytes(rng, 1 * MiB)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        os.ftruncate(fd, n + 1)
        os.pwrite(fd, head, 0)
        os.pwrite(fd, tail, n + 1 - len(tail))
    finally:
        os.close(fd)
    try:
        buf = np.empty(n, dtype=np.uint8)
    except MemoryError:
        pytest.skip("not enough memory for a 2 GiB buffer")
    buf[:4096] = 1
    buf[-4096:] = 1
    with phx.open(path, "r") as f:
        assert f.pread(buf, 1) == n
    assert_same(buf[:len(head) - 1].tobytes(), head[1:], "head")
    assert_same(buf[-len(tail):].tobytes(), tail, "tail")
    mid = buf[2 * MiB: 2 * MiB + 4096]
    assert not mid.any(), "hole did not read as zeros"
    del buf


def test_more_files_than_registered_slots(data_dir, rng):
    data = fresh_bytes(rng, 300 * 64)
    path = os.path.join(data_dir, "f")
    write_file(path, data)
    eng = phx.Engine()
    files = [phx.open(path, "r", engine=eng) for _ in range(300)]
    try:
        for i, f in enumerate(files):
            b = bytearray(64)
            assert f.pread(b, i * 64) == 64
            assert_same(b, data[i * 64:(i + 1) * 64], f"file {i}")
    finally:
        for f in files:
            f.close()


# ---- filesystems without O_DIRECT ---------------------------------------------

@pytest.mark.parametrize("mode", ["r+", "w", "w+", "x", "x+"])
def test_no_odirect_filesystem_refused_clearly(ramfs_dir, mode):
    path = os.path.join(ramfs_dir, "f")
    if mode == "r+":
        write_file(path, b"abc")
    with pytest.raises(OSError) as ei:
        phx.open(path, mode)
    e = ei.value
    assert e.errno == errno.EINVAL, f"mode {mode}: expected EINVAL (no O_DIRECT), got {e!r}"
    assert e.filename == path or path in str(e)


@pytest.mark.parametrize("mode", ["r", "r+", "w", "w+", "x", "x+"])
def test_allow_buffered_on_no_odirect_filesystem(ramfs_dir, rng, mode):
    path = os.path.join(ramfs_dir, "f")
    old = fresh_bytes(rng, 9000)
    if mode in ("r", "r+"):
        write_file(path, old)
    eng = phx.Engine()
    with phx.open(path, mode, allow_buffered=True, engine=eng) as f:
        assert f.direct is False
        if mode == "r":
            b = bytearray(5000)
            assert f.pread(b, 3) == 5000
            assert_same(b, old[3:5003])
        else:
            data = fresh_bytes(rng, 5000)
            assert f.pwrite(data, 3) == 5000
            if "+" in mode:
                b = bytearray(5000)
                assert f.pread(b, 3) == 5000
                assert_same(b, data)
    st = eng.stats()
    assert st["buffered_bytes"] > 0 and st["direct_bytes"] == 0 and st["bounce_bytes"] == 0


def test_allow_buffered_still_direct_where_possible(data_dir, rng):
    path = os.path.join(data_dir, "f")
    with phx.open(path, "x+", allow_buffered=True) as f:
        assert f.direct is True


def test_info_reports_no_odirect(ramfs_dir):
    d = phx.info(ramfs_dir)["o_direct"]
    assert d["available"] is False
    assert d["reason"].strip()
    assert os.listdir(ramfs_dir) == [], "phx.info left files behind"


_WRITE_ONLY_PERMS = r"""
import os, sys, phx
path = sys.argv[1]
if os.geteuid() == 0:
    os.setgroups([]); os.setgid(65534); os.setuid(65534)
fd = os.open(path, os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o200)
os.close(fd)
os.chmod(path, 0o200)
try:
    with phx.open(path, "w") as f:
        assert f.pwrite(b"hello", 1) == 5
        assert f.pwrite(b"H", 0) == 1
        assert f.pwrite(b"x" * 5000, 3) == 5000
        assert f.pwrite(b"y" * 4096, 8192) == 4096
    print("OK")
except OSError as e:
    print("OSERROR", e.errno, repr(e), "PATH" if (e.filename == path or path in str(e)) else "NOPATH")
"""


def test_unaligned_writes_to_write_only_permission_file(data_dir):
    """A file the user may write but not read (mode 0200) opened "w": like
    os.pwrite, unaligned writes work (the engine cannot read-modify-write
    through an O_WRONLY descriptor, so it must find another way), and any
    error would carry the path.  Run as uid 65534 when root."""
    import subprocess
    import sys
    path = os.path.join(data_dir, "wo")
    os.chmod(data_dir, 0o777)
    os.chmod(os.path.dirname(data_dir), 0o711)
    r = subprocess.run([sys.executable, "-c", _WRITE_ONLY_PERMS, path], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip() == "OK", r.stdout + r.stderr
    os.chmod(path, 0o600)
    with open(path, "rb") as g:
        got = g.read()
    exp = bytearray(8192 + 4096)
    exp[1:6] = b"hello"
    exp[0:1] = b"H"
    exp[3:5003] = b"x" * 5000
    exp[8192:] = b"y" * 4096
    assert_same(got, bytes(exp), "file written through write-only permissions")


@pytest.fixture
def loop_device(disk_base, rng):
    """(device path, image bytes): a 64 MiB loop device over random data (root)."""
    import subprocess
    if os.geteuid() != 0:
        pytest.skip("loop devices need root")
    img = os.path.join(disk_base, f"blk-{os.getpid()}-{rng.integers(1 << 30)}.img")
    data = fresh_bytes(rng, 64 * MiB)
    write_file(img, data)
    try:
        dev = subprocess.run(["losetup", "--find", "--show", img], check=True,
                             capture_output=True, text=True).stdout.strip()
    except (subprocess.CalledProcessError, OSError) as e:
        os.unlink(img)
        pytest.skip(f"losetup failed: {e}")
    try:
        yield dev, data
    finally:
        subprocess.run(["losetup", "-d", dev], check=False)
        os.unlink(img)


def test_block_device(loop_device, rng):
    """A block device read and written through phx: aligned and unaligned,
    read-modify-write, a short read at the end of the device."""
    dev, data = loop_device
    model = bytearray(data)
    with phx.open(dev, "r+") as f:
        for off, n, mis in [(0, 1 * MiB, 0), (5, 100_000, 0), (4097, 3 * MiB + 1, 3)]:
            whole = phx.empty_aligned(n + 8)
            view = memoryview(whole)[mis:mis + n]
            assert f.pread(view, off) == n
            assert_same(view, model[off:off + n], f"device read {n} @ {off}")
        for off, n in [(3, 5), (4095, 4097), (1 * MiB, 4096), (64 * MiB - 10, 10)]:
            x = fresh_bytes(rng, n)
            assert f.pwrite(x, off) == n
            model[off:off + n] = x
        b = bytearray(8192)
        assert f.pread(b, 64 * MiB - 100) == 100
        assert_same(b[:100], model[-100:], "short read at the end of the device")
        assert f.pread(b, 64 * MiB) == 0
        f.fsync()
    fd = os.open(dev, os.O_RDONLY)
    try:
        got = bytearray()
        while len(got) < 64 * MiB:
            chunk = os.pread(fd, 16 * MiB, len(got))
            if not chunk:
                break
            got += chunk
    finally:
        os.close(fd)
    assert_same(bytes(got), bytes(model), "device contents")
