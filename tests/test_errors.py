"""Every error of the table in docs/design.md, plus bad arguments.

Where the contract leaves a detail open, the tests expect what os.pread /
os.pwrite / open() do (an OSError carrying errno and the path).
"""
from __future__ import annotations

import errno
import os
import re

import numpy as np
import pytest

import phx
from conftest import KiB, MiB, assert_same, fresh_bytes, torch_or_skip, write_file


@pytest.fixture
def src(data_dir, rng):
    path = os.path.join(data_dir, "src")
    data = fresh_bytes(rng, 1 * MiB + 3)
    write_file(path, data)
    return path, data


def has_path(exc: OSError, path: str) -> bool:
    return exc.filename == path or path in str(exc)


# ---- missing file ----------------------------------------------------------------

@pytest.mark.parametrize("mode", ["r", "r+"])
def test_missing_file(data_dir, mode):
    path = os.path.join(data_dir, "does-not-exist")
    with pytest.raises(FileNotFoundError) as ei:
        phx.open(path, mode)
    e = ei.value
    assert e.errno == errno.ENOENT
    assert e.filename == path
    assert path in str(e)
    assert not os.path.exists(path), "opening for read must not create the file"


def test_missing_directory_on_create(data_dir):
    path = os.path.join(data_dir, "no-such-dir", "f")
    with pytest.raises(FileNotFoundError) as ei:
        phx.open(path, "w")
    assert ei.value.errno == errno.ENOENT and ei.value.filename == path


@pytest.mark.parametrize("mode", ["x", "x+"])
def test_exclusive_create_existing(src, mode):
    path, data = src
    with pytest.raises(FileExistsError) as ei:
        phx.open(path, mode)
    assert ei.value.errno == errno.EEXIST and ei.value.filename == path
    with open(path, "rb") as g:
        assert_same(g.read(), data, "x on an existing file must leave it alone")


@pytest.mark.parametrize("mode", ["r", "r+", "w"])
def test_open_a_directory(data_dir, mode):
    """Like open(): IsADirectoryError (EISDIR) with the path - not an EINVAL
    that blames the filesystem for refusing O_DIRECT."""
    with pytest.raises(IsADirectoryError) as ei:
        phx.open(data_dir, mode)
    assert ei.value.errno == errno.EISDIR and has_path(ei.value, data_dir)


def test_permission_denied(data_dir, rng):
    """EACCES as a PermissionError with the path; as root, checked in a
    child process that drops to uid/gid 65534."""
    path = os.path.join(data_dir, "ro")
    write_file(path, b"abc")
    os.chmod(path, 0o400)
    if os.geteuid() != 0:
        with pytest.raises(PermissionError) as ei:
            phx.open(path, "r+")
        assert ei.value.errno == errno.EACCES and ei.value.filename == path
        return
    for d in (data_dir, os.path.dirname(data_dir)):
        os.chmod(d, 0o711)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        msg = b"?"
        try:
            os.close(r)
            os.setgroups([])
            os.setgid(65534)
            os.setuid(65534)
            try:
                phx.open(path, "r+")
                msg = b"opened"
            except PermissionError as e:
                msg = b"ok" if (e.errno == errno.EACCES and e.filename == path) else \
                    repr(e).encode()[:200]
            except BaseException as e:  # noqa: BLE001
                msg = repr(e).encode()[:200]
        finally:
            os.write(w, msg)
            os._exit(0)
    os.close(w)
    msg = os.read(r, 256)
    os.close(r)
    os.waitpid(pid, 0)
    assert msg == b"ok", f"as uid 65534, phx.open(r+) of a 0400 root file: {msg.decode(errors='replace')}"


# ---- read past EOF: not an error ---------------------------------------------------------

def test_read_past_eof_no_exception(src):
    path, data = src
    with phx.open(path, "r") as f:
        assert f.pread(bytearray(4096), len(data) - 10) == 10
        assert f.pread(bytearray(4096), len(data)) == 0
        assert f.pread(bytearray(4096), len(data) + 1) == 0
        assert f.pread(bytearray(4096), 1 << 40) == 0
        assert f.pread_async(bytearray(4096), 1 << 40).result() == 0
        assert f.pread_batch([(bytearray(4096), 1 << 40), (bytearray(20), len(data) - 5)]) == [0, 5]


# ---- writing a read-only file ------------------------------------------------------------

def test_write_to_read_only_file(src, rng):
    path, data = src
    with phx.open(path, "r") as f:
        with pytest.raises(OSError) as ei:
            f.pwrite(fresh_bytes(rng, 4096), 0)
        assert ei.value.errno == errno.EBADF
        assert has_path(ei.value, path), str(ei.value)
        with pytest.raises(OSError) as ei:
            f.pwrite(fresh_bytes(rng, 10), 3)  # unaligned (bounce path) too
        assert ei.value.errno == errno.EBADF
        with pytest.raises(OSError) as ei:
            f.pwrite_batch([(fresh_bytes(rng, 10), 3)])
        assert ei.value.errno == errno.EBADF
        # the async form: raised at submission or from result()
        with pytest.raises(OSError) as ei:
            f.pwrite_async(fresh_bytes(rng, 4096), 0).result(timeout=60)
        assert ei.value.errno == errno.EBADF
        assert has_path(ei.value, path)
        # the file still reads fine afterwards
        b = bytearray(100)
        assert f.pread(b, 0) == 100
    with open(path, "rb") as g:
        assert_same(g.read(), data, "file after refused writes")


def test_read_from_write_only_file(data_dir, rng):
    path = os.path.join(data_dir, "wo")
    with phx.open(path, "w") as f:
        f.pwrite(fresh_bytes(rng, 8192), 0)
        with pytest.raises(OSError) as ei:
            f.pread(bytearray(4096), 0)
        assert ei.value.errno == errno.EBADF and has_path(ei.value, path)


def test_truncate_read_only_file(src):
    path, data = src
    with phx.open(path, "r") as f:
        with pytest.raises(OSError) as ei:
            f.truncate(10)
        assert ei.value.errno in (errno.EBADF, errno.EINVAL)
    assert os.stat(path).st_size == len(data)


# ---- closed file ------------------------------------------------------------------

def test_closed_file(src, rng):
    path, data = src
    f = phx.open(path, "r+")
    f.close()
    f.close()  # idempotent, like Python file objects
    calls = {
        "pread": lambda: f.pread(bytearray(10), 0),
        "pwrite": lambda: f.pwrite(b"abc", 0),
        "pread_async": lambda: f.pread_async(bytearray(10), 0).result(),
        "pwrite_async": lambda: f.pwrite_async(b"abc", 0).result(),
        "pread_batch": lambda: f.pread_batch([(bytearray(10), 0)]),
        "pwrite_batch": lambda: f.pwrite_batch([(b"abc", 0)]),
        "truncate": lambda: f.truncate(0),
        "fsync": lambda: f.fsync(),
        "fileno": lambda: f.fileno(),
    }
    for name, call in calls.items():
        with pytest.raises(phx.ClosedFileError) as ei:
            call()
        e = ei.value
        assert isinstance(e, OSError) and isinstance(e, ValueError), name
        assert e.errno == errno.EBADF, name
    with open(path, "rb") as g:
        assert_same(g.read(), data, "closed file untouched")


def test_closed_by_context_manager(src):
    path, _ = src
    with phx.open(path, "r") as f:
        pass
    with pytest.raises(phx.ClosedFileError):
        f.pread(bytearray(1), 0)
    with pytest.raises(ValueError):  # what `except ValueError` code (io-style) catches
        f.pread(bytearray(1), 0)


def test_exception_classes():
    for cls in (phx.ClosedFileError, phx.BufferNotContiguousError, phx.BufferReadOnlyError):
        assert issubclass(cls, OSError) and issubclass(cls, ValueError), cls


# ---- buffers -----------------------------------------------------------------------

def _noncontig_numpy():
    a = np.zeros(100_000, dtype=np.uint8)
    b = np.zeros((300, 500), dtype=np.float32)
    return {
        "step slice": a[::2],
        "step slice 2d": b[:, ::3],
        "transposed": b.T,
        "column": b[:, 5],
        "negative stride": a[::-1],
    }


@pytest.mark.parametrize("kind", list(_noncontig_numpy()))
def test_non_contiguous_buffer(src, kind):
    path, data = src
    arr = _noncontig_numpy()[kind]
    with phx.open(path, "r+") as f:
        for op in (lambda: f.pread(arr, 0), lambda: f.pwrite(arr, 0),
                   lambda: f.pread_async(arr, 0).result(), lambda: f.pread_batch([(arr, 0)])):
            with pytest.raises(phx.BufferNotContiguousError) as ei:
                op()
            e = ei.value
            assert isinstance(e, OSError) and isinstance(e, ValueError)
            assert e.errno == errno.EINVAL
    with open(path, "rb") as g:
        assert_same(g.read(), data, "nothing written from a refused buffer")


def test_non_contiguous_memoryview(src):
    path, _ = src
    mv = memoryview(bytearray(10_000))[::3]
    with phx.open(path, "r") as f:
        with pytest.raises(phx.BufferNotContiguousError):
            f.pread(mv, 0)


def test_non_contiguous_torch(src):
    torch = torch_or_skip()
    path, _ = src
    t = torch.zeros(64, 64, dtype=torch.float32)
    with phx.open(path, "r") as f:
        for bad in (t[:, ::2], t.t(), t[::2]):
            assert not bad.is_contiguous()
            with pytest.raises(phx.BufferNotContiguousError) as ei:
                f.pread(bad, 0)
            assert ei.value.errno == errno.EINVAL


def test_torch_on_other_device_refused(src):
    torch = torch_or_skip()
    path, _ = src
    t = torch.zeros(16, device="meta")
    with phx.open(path, "r") as f:
        with pytest.raises((ValueError, TypeError, OSError)):
            f.pread(t, 0)


@pytest.mark.parametrize("kind", ["bytes", "memoryview(bytes)", "readonly numpy"])
def test_read_into_read_only_buffer(src, kind):
    path, data = src
    if kind == "bytes":
        buf = bytes(4096)
    elif kind == "memoryview(bytes)":
        buf = memoryview(bytes(4096))
    else:
        buf = np.zeros(4096, dtype=np.uint8)
        buf.flags.writeable = False
    with phx.open(path, "r") as f:
        for op in (lambda: f.pread(buf, 0), lambda: f.pread_async(buf, 0).result(),
                   lambda: f.pread_batch([(buf, 0)])):
            with pytest.raises(phx.BufferReadOnlyError) as ei:
                op()
            e = ei.value
            assert isinstance(e, OSError) and isinstance(e, ValueError)
            assert e.errno == errno.EINVAL
    if kind != "readonly numpy":
        assert bytes(buf) == bytes(4096), "a read-only buffer was modified"


@pytest.mark.parametrize("obj", [None, 123, "a string", [1, 2, 3], object()], ids=repr)
def test_not_a_buffer(src, obj):
    path, _ = src
    with phx.open(path, "r+") as f:
        with pytest.raises(TypeError):
            f.pread(obj, 0)
        with pytest.raises(TypeError):
            f.pwrite(obj, 0)


def test_refused_batch_entry_submits_nothing(src, rng):
    """A batch with one bad buffer is refused before anything is written."""
    path, data = src
    good = fresh_bytes(rng, 4096)
    with phx.open(path, "r+") as f:
        with pytest.raises(phx.BufferNotContiguousError):
            f.pwrite_batch([(good, 0), (np.zeros(100, np.uint8)[::2], 8192)])
    with open(path, "rb") as g:
        assert_same(g.read(), data, "file after a refused batch")


# ---- disk full ---------------------------------------------------------------------

def test_enospc(small_fs, rng):
    """Fill a small filesystem with 1 MiB writes (aligned and unaligned):
    the write that cannot fit raises OSError(ENOSPC) with the path, and every
    byte acknowledged before it reads back intact."""
    path = os.path.join(small_fs, "fill")
    acked = 0
    chunk = 1 * MiB + 13  # unaligned lengths: bounce + read-modify-write at the tail
    written = bytearray()
    with phx.open(path, "w+") as f:
        with pytest.raises(OSError) as ei:
            for _ in range(64):  # 64 MiB > the 8-16 MiB filesystem
                data = fresh_bytes(rng, chunk)
                n = f.pwrite(data, acked)
                assert 0 <= n <= chunk
                written += data[:n]
                acked += n
                if n < chunk:
                    # os.pwrite semantics: a short count, then ENOSPC on the next
                    continue
            pytest.fail(f"64 MiB written to a small filesystem without ENOSPC (acked {acked})")
        e = ei.value
        assert e.errno == errno.ENOSPC, e
        assert has_path(e, path), str(e)
    assert acked > 0
    assert os.stat(path).st_size >= acked
    with open(path, "rb") as g:
        got = g.read(acked)
    assert_same(got, bytes(written), "data written before ENOSPC")


def test_enospc_single_large_write(small_fs, rng):
    """One 32 MiB write onto a small filesystem: either OSError(ENOSPC) with
    the path or (os.pwrite-style) a short count; never the full count, and
    the prefix it acknowledges is intact."""
    path = os.path.join(small_fs, "big")
    data = fresh_bytes(rng, 32 * MiB)
    with phx.open(path, "w+") as f:
        try:
            n = f.pwrite(data, 0)
        except OSError as e:
            assert e.errno == errno.ENOSPC and has_path(e, path), e
            n = None
    if n is not None:
        assert n < len(data), "32 MiB reported written to a small filesystem"
        with open(path, "rb") as g:
            assert_same(g.read(n), data[:n], "acknowledged prefix")


def test_enospc_async_and_batch(small_fs, rng):
    path = os.path.join(small_fs, "ab")
    with phx.open(path, "w+") as f:
        futs = [f.pwrite_async(fresh_bytes(rng, 1 * MiB), i * MiB) for i in range(32)]
        errs = []
        for x in futs:
            try:
                x.result(timeout=120)
            except OSError as e:
                errs.append(e)
        assert errs, "32 MiB of async writes on a small filesystem all succeeded"
        assert all(e.errno == errno.ENOSPC and has_path(e, path) for e in errs), errs
    os.unlink(path)
    with phx.open(path, "w+") as f:
        try:
            res = f.pwrite_batch([(fresh_bytes(rng, 1 * MiB), i * MiB) for i in range(32)])
        except OSError as e:
            assert e.errno == errno.ENOSPC and has_path(e, path), e
        else:
            pytest.fail(f"pwrite_batch of 32 MiB on a small filesystem returned {res}")


def test_enospc_leaves_earlier_file_intact(small_fs, rng):
    """Another file written before the disk filled up is not corrupted."""
    keep = os.path.join(small_fs, "keep")
    kdata = fresh_bytes(rng, 1 * MiB + 5)
    with phx.open(keep, "w") as f:
        assert f.pwrite(kdata, 0) == len(kdata)
    fill = os.path.join(small_fs, "fill")
    with phx.open(fill, "w") as f:
        with pytest.raises(OSError) as ei:
            for i in range(64):
                f.pwrite(fresh_bytes(rng, 1 * MiB), i * MiB)
        assert ei.value.errno == errno.ENOSPC
    with open(keep, "rb") as g:
        assert_same(g.read(), kdata, "earlier file")


# ---- bad arguments -------------------------------------------------------------------------

@pytest.mark.parametrize("mode", ["a", "a+", "", "z", "rw", "r+w", "wx", "rr", "R", "+"])
def test_bad_mode(data_dir, mode):
    path = os.path.join(data_dir, "m")
    with pytest.raises(ValueError):
        phx.open(path, mode)
    assert not os.path.exists(path), f"mode {mode!r} created the file"


@pytest.mark.parametrize("mode", [None, 3, b"r"])
def test_mode_wrong_type(data_dir, mode):
    with pytest.raises((TypeError, ValueError)):
        phx.open(os.path.join(data_dir, "m"), mode)


@pytest.mark.parametrize("off", [-1, -4096, -(1 << 62)])
def test_negative_offset(src, rng, off):
    """os.pread/os.pwrite raise OSError(EINVAL) for a negative offset; phx
    must refuse it too, as ValueError or OSError(EINVAL) (not OverflowError,
    not a silent huge unsigned offset)."""
    path, data = src
    with phx.open(path, "r+") as f:
        for name, op in [("pread", lambda: f.pread(bytearray(10), off)),
                         ("pwrite", lambda: f.pwrite(b"abcdefghij", off)),
                         ("pread_async", lambda: f.pread_async(bytearray(10), off).result()),
                         ("pwrite_async", lambda: f.pwrite_async(b"abcdefghij", off).result()),
                         ("pread_batch", lambda: f.pread_batch([(bytearray(10), off)])),
                         ("pwrite_batch", lambda: f.pwrite_batch([(b"abcdefghij", off)]))]:
            with pytest.raises((ValueError, OSError)) as ei:
                op()
            e = ei.value
            if isinstance(e, OSError):
                assert e.errno == errno.EINVAL, (name, e)
    with open(path, "rb") as g:
        assert_same(g.read(), data, "file after refused negative-offset writes")


def test_negative_truncate(src):
    path, data = src
    with phx.open(path, "r+") as f:
        with pytest.raises((ValueError, OSError)):
            f.truncate(-1)
    assert os.stat(path).st_size == len(data)


# Engine settings: the Python layer refuses what is not a positive 32-bit
# integer, libphx's config check (engine.c) refuses what is out of range, both
# as ValueError (no errno: nothing was asked of the kernel) with a message that
# names the setting, the value and what is allowed.
_BAD_ENGINE = [
    (dict(queue_depth=0), ValueError, r"^queue_depth must be a positive integer, not 0$"),
    (dict(queue_depth=-1), ValueError, r"^queue_depth must be a positive integer, not -1$"),
    (dict(queue_depth=2**32), ValueError, r"^queue_depth must be a positive integer, not 4294967296$"),
    (dict(queue_depth=4097), ValueError, r"^queue_depth 4097 is outside 1\.\.4096"),
    (dict(max_io_size=0), ValueError, r"^max_io_size must be a positive integer, not 0$"),
    (dict(max_io_size=100), ValueError, r"^max_io_size 100 must be a multiple of 4096 in 4 KiB\.\.1 GiB"),
    (dict(max_io_size=4097), ValueError, r"^max_io_size 4097 must be a multiple of 4096"),
    (dict(max_io_size=(1 << 30) + 4096), ValueError, r"^max_io_size 1073745920 must be a multiple of 4096 in 4 KiB\.\.1 GiB"),
    (dict(bounce_size=0), ValueError, r"^bounce_size must be a positive integer, not 0$"),
    (dict(bounce_size=2048), ValueError, r"^bounce_size 2048 must be a multiple of 4096 in 4 KiB\.\.1 GiB"),
    (dict(bounce_size=(1 << 30) + 4096), ValueError, r"^bounce_size 1073745920 must be a multiple of 4096"),
    (dict(bounce_count=0), ValueError, r"^bounce_count must be a positive integer, not 0$"),
    (dict(bounce_count=1025), ValueError, r"^bounce_count 1025 is outside 1\.\.1024"),
    (dict(submit_batch=-1), ValueError, r"^submit_batch must be >= 0, not -1$"),
    (dict(submit_batch=2**32), ValueError, r"^submit_batch must be >= 0, not 4294967296$"),
    (dict(nonsense=1), TypeError, r"unexpected keyword argument 'nonsense'"),
    # wrong type: refused, naming the setting (a float would be truncated)
    (dict(queue_depth="8"), TypeError, r"^queue_depth must be an integer, not str '8'$"),
    (dict(queue_depth=1.5), TypeError, r"^queue_depth must be an integer, not float 1\.5$"),
    (dict(submit_batch=2.0), TypeError, r"^submit_batch must be an integer, not float 2\.0$"),
]


@pytest.mark.parametrize("kw,exc,msg", [
    pytest.param(*c, id=repr(c[0])) if type(c) is tuple else c for c in _BAD_ENGINE])
def test_bad_engine_config(kw, exc, msg):
    """Each nonsense configuration is refused with its own exception and a
    message naming the setting, the value and the allowed range."""
    with pytest.raises(exc) as ei:
        phx.Engine(**kw)
    e = ei.value
    # not an OSError from the kernel: a bad setting is caught before io_uring_setup
    assert not isinstance(e, OSError), repr(e)
    if msg is not None:
        assert re.search(msg, str(e)), f"{kw}: message {str(e)!r} does not match {msg!r}"


# The limits themselves are allowed: the engine is made with exactly those
# settings and moves fresh random bytes correctly with them.
_GOOD_ENGINE = [
    dict(queue_depth=1), dict(queue_depth=4096),
    dict(max_io_size=4096), dict(max_io_size=1 << 30),
    dict(bounce_size=4096, bounce_count=1), dict(bounce_size=4096, bounce_count=1024),
    dict(submit_batch=0), dict(submit_batch=1),
    dict(queue_depth=2, max_io_size=8192, bounce_size=8192, bounce_count=2, submit_batch=3),
]


@pytest.mark.parametrize("kw", _GOOD_ENGINE, ids=str)
def test_good_engine_config(data_dir, rng, kw):
    eng = phx.Engine(**kw)
    try:
        cfg = eng.config
        for k, v in kw.items():
            assert cfg[k] == v, f"{k}: asked for {v}, engine has {cfg[k]} ({cfg})"
        path = os.path.join(data_dir, "cfg")
        data = fresh_bytes(rng, 300 * KiB + 7)
        write_file(path, data)
        with eng.open(path, "r+") as f:
            # aligned (chunked by max_io_size), unaligned (bounce buffers), async
            b = phx.empty_aligned(256 * KiB)
            assert f.pread(b, 0) == 256 * KiB
            assert_same(b, data[:256 * KiB], f"{kw}: aligned read")
            u = bytearray(100 * KiB + 3)
            assert f.pread(u, 4097) == len(u)
            assert_same(u, data[4097:4097 + len(u)], f"{kw}: unaligned read")
            bufs = {o: bytearray(5000) for o in (1, 8191, 200 * KiB)}
            futs = {o: f.pread_async(bb, o) for o, bb in bufs.items()}
            for o, fut in futs.items():
                bb = bufs[o]
                assert fut.result(timeout=60) == 5000
                assert_same(bb, data[o:o + 5000], f"{kw}: async read @ {o}")
            new = fresh_bytes(rng, 12289)
            assert f.pwrite(new, 3) == len(new)
        with open(path, "rb") as g:
            assert_same(g.read(), data[:3] + new + data[3 + len(new):], f"{kw}: after write")
    finally:
        eng.close()


def test_bad_alignment_for_empty_aligned():
    for bad in (0, 3, 4097):
        with pytest.raises(ValueError):
            phx.empty_aligned(4096, alignment=bad)
    with pytest.raises((ValueError, OverflowError)):
        phx.empty_aligned(4096, alignment=-4096)
    with pytest.raises((ValueError, OverflowError)):
        phx.empty_aligned(-1)


def test_wrong_engine_type(src):
    path, _ = src
    with pytest.raises(TypeError):
        phx.open(path, "r", engine="not an engine")


def test_offset_types(src):
    """Offsets are integers: anything with __index__ (numpy integers) works;
    a float is a TypeError, as for os.pread (never silently truncated)."""
    path, data = src
    with phx.open(path, "r+") as f:
        for good in (np.int64(4097), np.uint32(4097), 4097):
            b = bytearray(10)
            assert f.pread(b, good) == 10
            assert_same(b, data[4097:4107], f"offset {type(good).__name__}")
        for bad in (4096.9, 1.0, "1", None):
            for name, op in [("pread", lambda: f.pread(bytearray(10), bad)),
                             ("pwrite", lambda: f.pwrite(b"abcdefghij", bad)),
                             ("pread_async", lambda: f.pread_async(bytearray(10), bad).result()),
                             ("pread_batch", lambda: f.pread_batch([(bytearray(10), bad)])),
                             ("truncate", lambda: f.truncate(bad))]:
                with pytest.raises(TypeError):
                    op()
    with open(path, "rb") as g:
        assert_same(g.read(), data, "file after refused calls")


_OBJECT_ARRAY = r"""
import sys, numpy as np, phx
path = sys.argv[1]
arr = np.array([object() for _ in range(64)], dtype=object)
with phx.open(path, "r+") as f:
    for name, op in (("pread", lambda: f.pread(arr, 0)), ("pwrite", lambda: f.pwrite(arr, 0)),
                     ("pread_async", lambda: f.pread_async(arr, 0).result()),
                     ("pread_batch", lambda: f.pread_batch([(arr, 0)]))):
        try:
            op()
            print("ACCEPTED", name)
        except (TypeError, ValueError) as e:
            print("REFUSED", name, type(e).__name__)
print(repr(arr[:2]))  # touches the pointers: crashes if they were overwritten
print("END")
"""


def test_object_array_refused(src):
    """A numpy array of Python objects exports a buffer of PyObject pointers:
    reading file bytes into it would corrupt the interpreter, writing it
    would store addresses.  phx must refuse it (TypeError/ValueError).
    Run in a child process: the failure mode is a crash."""
    import subprocess
    import sys
    path, data = src
    r = subprocess.run([sys.executable, "-c", _OBJECT_ARRAY, path], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0 and "END" in r.stdout, \
        f"child died (rc {r.returncode}): {r.stdout[-1000:]} {r.stderr[-1000:]}"
    assert "ACCEPTED" not in r.stdout, r.stdout
    with open(path, "rb") as g:
        assert_same(g.read(), data, "file after refused object-array writes")
