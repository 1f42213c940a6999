"""The thread-pool backend and the fall-back to it (issue 24).

- Choosing: ``Engine(backend=...)``, ``PHX_ENGINE`` (a value naming no backend
  is refused), what ``stats()``, ``phx info`` and the backend table say.
- The fall-back: a child process under a seccomp filter that refuses io_uring
  (``tests/seccomp/no-io-uring``, built with libseccomp; EPERM as containers'
  default profiles return, and ENOSYS) gets the threads backend, says why,
  logs it once, and moves the right bytes; ``backend="uring"`` fails there.
- The threads backend byte for byte against plain ``os.pread``/a model on
  fresh random data: unaligned sizes, offsets and memory, short reads at EOF,
  writes that grow the file, on ext4 and xfs (512-byte and 4 KiB sectors);
  several threads submitting at once, also with fewer workers than requests;
  ENOSPC on an 8 MiB tmpfs; and the same counters (paths, bounce, RMW) as
  io_uring for the same requests.
- ``PHX_EXPECT_BACKEND`` (set by ``make test-seccomp``): the default engine
  must be that backend, so that the seccomp job cannot pass on io_uring.
"""
from __future__ import annotations

import errno
import os
import shutil
import subprocess
import sys
import threading

import pytest

import phx
from phx._lib.engine import backends

from conftest import KiB, MiB, assert_same, fresh_bytes, read_file, write_file

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAUNCHER_SRC = os.path.join(ROOT, "tests", "seccomp", "no-io-uring.c")


# ---------------------------------------------------------------------------
# Choosing the backend
# ---------------------------------------------------------------------------

def test_backend_table():
    t = {b["name"]: b for b in backends()}
    assert set(t) == {"uring", "threads"}, t
    assert t["threads"]["available"] is True
    for b in t.values():
        assert b["description"] and b["reason"], b
    if not t["uring"]["available"]:
        assert "io_uring_setup" in t["uring"]["reason"], t


def test_backend_argument_and_stats():
    eng = phx.Engine(backend="threads", queue_depth=8)
    assert eng.backend == "threads"
    assert "asked for" in eng.backend_reason
    st = eng.stats()
    assert st["backend"] == "threads" and st["backend_reason"] == eng.backend_reason
    f = eng.features
    assert not f["fixed_files"] and not f["fixed_bounce_buffers"] and f["buffer_registration"]
    eng.close()
    with pytest.raises(ValueError, match="backend"):
        phx.Engine(backend="io_uring")
    with pytest.raises(ValueError):
        phx.Engine(backend="threads", io_threads=5000)


def _child(code: str, env: dict | None = None, argv0: list[str] | None = None):
    e = dict(os.environ)
    e.pop("PHX_ENGINE", None)
    e.pop("PHX_EXPECT_BACKEND", None)
    e.update(env or {})
    return subprocess.run((argv0 or []) + [sys.executable, "-c", code], capture_output=True,
                          text=True, timeout=300, env=e, cwd=ROOT)


def test_phx_engine_setting():
    r = _child("import phx; print(phx.stats()['backend'])", {"PHX_ENGINE": "threads"})
    assert r.returncode == 0 and r.stdout.strip() == "threads", r.stderr
    r = _child("import phx\ntry:\n phx.Engine()\nexcept (OSError, ValueError) as e: print(e)",
               {"PHX_ENGINE": "thread"})
    assert r.returncode == 0 and "PHX_ENGINE" in r.stdout and "threads" in r.stdout, r


def test_info_says_which_engine():
    d = phx.info()
    e = d["engine"]
    assert e["available"] and e["backend"] in ("uring", "threads") and e["reason"], e
    assert {b["name"] for b in e["backends"]} == {"uring", "threads"}
    assert ("thread pool" in d["host_path"]) == (e["backend"] == "threads"), d["host_path"]


def test_expected_backend():
    """In ``make test-seccomp``: the filter took, and phx fell back."""
    want = os.environ.get("PHX_EXPECT_BACKEND")
    if not want:
        pytest.skip("runs in make test-seccomp (PHX_EXPECT_BACKEND is not set here)")
    eng = phx.default_engine()
    assert eng.backend == want, eng.backend_reason
    if want == "threads":
        assert "io_uring unavailable" in eng.backend_reason, eng.backend_reason


# ---------------------------------------------------------------------------
# The fall-back under seccomp
# ---------------------------------------------------------------------------

@pytest.fixture(scope="session")
def no_io_uring(tmp_path_factory) -> str:
    """The launcher: make test-seccomp's build, else built here (skip without
    libseccomp's header)."""
    built = os.path.join(ROOT, "build", "seccomp", "no-io-uring")
    if os.access(built, os.X_OK) and os.path.getmtime(built) >= os.path.getmtime(LAUNCHER_SRC):
        return built
    cc = shutil.which("cc") or shutil.which("gcc")
    if not cc or not os.path.exists("/usr/include/seccomp.h"):
        pytest.skip("needs a C compiler and libseccomp-dev (make deps) for the seccomp launcher")
    out = str(tmp_path_factory.mktemp("seccomp") / "no-io-uring")
    subprocess.run([cc, "-O2", "-o", out, LAUNCHER_SRC, "-lseccomp"], check=True)
    return out


_FALLBACK = r"""
import errno, os, sys, phx
import numpy as np
path = sys.argv[1]
engs = [phx.Engine(queue_depth=q) for q in (4, 16, 128)]
for e in engs:
    assert e.backend == "threads", (e.backend, e.backend_reason)
    assert "io_uring unavailable" in e.backend_reason, e.backend_reason
print("REASON", engs[0].backend_reason)
try:
    phx.Engine(backend="uring")
    print("URING", "created")
except OSError as e:
    print("URING", errno.errorcode[e.errno])
data = open(path, "rb").read()
with phx.open(path, "r+", engine=engs[1]) as f:
    buf = bytearray(len(data) + 5000)
    assert f.pread(memoryview(buf)[3:], 0) == len(data)        # unaligned memory, EOF
    assert bytes(buf[3:3 + len(data)]) == data
    new = np.random.default_rng(int(sys.argv[2])).bytes(70001)
    assert f.pwrite(new, 4097) == len(new)
    data = data[:4097] + new + data[4097 + len(new):]
    assert f.pread(buf, 0) == len(data) and bytes(buf[:len(data)]) == data
print("STATS", phx.stats()["backend"])
"""


@pytest.mark.parametrize("err", ["EPERM", "ENOSYS"])
def test_fallback_under_seccomp(no_io_uring, make_file, err, rng):
    path, data = make_file(1 * MiB + 777)
    r = _child(_FALLBACK.replace("sys.argv[1]", repr(path)).replace(
        "int(sys.argv[2])", str(int(rng.integers(1 << 30)))),
        argv0=[no_io_uring, "--errno", err])
    assert r.returncode == 0, r.stderr[-3000:]
    lines = dict(line.split(" ", 1) for line in r.stdout.splitlines() if " " in line)
    assert lines["URING"] == err, r.stdout
    assert os.strerror(getattr(errno, err)) in lines["REASON"], r.stdout
    assert lines["STATS"] == "threads", r.stdout
    # three engines, one line on stderr: logged once per process
    logged = [x for x in r.stderr.splitlines() if "thread-pool engine" in x]
    assert len(logged) == 1, r.stderr
    assert "io_uring unavailable" in logged[0] and "PHX_ENGINE" in logged[0]
    assert len(read_file(path)) == len(data)


# ---------------------------------------------------------------------------
# The threads backend, byte for byte
# ---------------------------------------------------------------------------

def _random_ops(rng, size: int, n: int):
    """(op, offset, length, memory offset): unaligned, some past the end."""
    ops = []
    for _ in range(n):
        ln = int(rng.choice([1, 511, 4096, 4097, 65536 + 3, 300 * KiB + 5, 1 * MiB + 1]))
        off = int(rng.integers(0, size + 8192))
        ops.append(("w" if rng.random() < 0.4 else "r", off, ln, int(rng.integers(0, 64))))
    return ops


def _replay(eng, path, model: bytearray, ops, rng):
    with phx.open(path, "r+", engine=eng) as f:
        for op, off, ln, moff in ops:
            buf = bytearray(ln + moff)
            mv = memoryview(buf)[moff:]
            if op == "w":
                new = fresh_bytes(rng, ln)
                mv[:] = new
                assert f.pwrite(mv, off) == ln
                if off > len(model):
                    model.extend(b"\0" * (off - len(model)))
                model[off:off + ln] = new
            else:
                n = f.pread(mv, off)
                want = bytes(model[off:off + ln])
                assert n == len(want), (off, ln, n, len(want))     # short at EOF
                assert_same(bytes(mv[:n]), want, f"read {ln} at {off}")


def test_threads_bytes(fs_dir, make_file, rng):
    path, data = make_file(3 * MiB + 1234, dir=fs_dir)
    model = bytearray(data)
    eng = phx.Engine(backend="threads")
    _replay(eng, path, model, _random_ops(rng, len(data), 120), rng)
    eng.close()
    assert_same(read_file(path), bytes(model), "file against the model")


@pytest.mark.parametrize("io_threads", [0, 2])
def test_threads_concurrent(fs_dir, make_file, rng, io_threads):
    """Six threads on one engine, each reading and writing its own region
    (async, batches and sync), unaligned; then the file against the model."""
    region = 512 * KiB + 77
    path, data = make_file(6 * region, dir=fs_dir)
    model = bytearray(data)
    eng = phx.Engine(backend="threads", queue_depth=32, io_threads=io_threads)
    seeds = [int(x) for x in rng.integers(0, 1 << 31, 6)]
    errors: list[BaseException] = []
    f = phx.open(path, "r+", engine=eng)

    def work(i: int) -> None:
        import numpy as np
        r = np.random.default_rng(seeds[i])
        base = i * region
        try:
            for _ in range(40):
                ln = int(r.integers(1, 64 * KiB))
                off = base + int(r.integers(0, region - ln))
                if r.random() < 0.5:
                    new = fresh_bytes(r, ln)
                    assert f.pwrite_async(new, off).result() == ln
                    model[off:off + ln] = new
                else:
                    bufs = [bytearray(ln) for _ in range(3)]
                    got = f.pread_batch([(b, off) for b in bufs])
                    assert got == [ln] * 3
                    for b in bufs:
                        assert bytes(b) == bytes(model[off:off + ln])
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    ts = [threading.Thread(target=work, args=(i,)) for i in range(6)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    f.close()
    eng.close()
    assert not errors, errors
    assert_same(read_file(path), bytes(model), "file against the model")


def test_threads_enospc(small_tmpfs, rng):
    path = os.path.join(small_tmpfs, "full")
    eng = phx.Engine(backend="threads")
    big = fresh_bytes(rng, 16 * MiB)
    with phx.open(path, "w+", engine=eng) as f:
        with pytest.raises(OSError) as ei:
            f.pwrite(big, 0)
        assert ei.value.errno == errno.ENOSPC and ei.value.filename == path
    os.unlink(path)
    with phx.open(path, "w+", engine=eng) as f:
        small = fresh_bytes(rng, 100 * KiB + 3)
        assert f.pwrite(small, 5) == len(small)
        out = bytearray(len(small))
        assert f.pread(out, 5) == len(small)
        assert_same(out, small)
    eng.close()


def test_threads_counts_like_uring(make_file, rng):
    """The same requests give the same paths, bounces, RMWs and results on
    both backends (io.c decides them; the backend only runs the ops)."""
    if not {b["name"]: b for b in backends()}["uring"]["available"]:
        if os.environ.get("PHX_EXPECT_BACKEND") == "threads":
            pytest.skip("io_uring refused by make test-seccomp's filter "
                        "(this comparison runs in make test-py)")
        pytest.skip("io_uring unavailable here")
    path, data = make_file(2 * MiB + 100)
    ops = _random_ops(rng, len(data), 60)
    keys = ("reads", "writes", "bytes_read", "bytes_written", "direct_bytes",
            "bounce_bytes", "buffered_bytes", "bounce_ios", "rmw_ios", "errors")
    seen = {}
    for backend in ("uring", "threads"):
        write_file(path, data)
        eng = phx.Engine(backend=backend)
        _replay(eng, path, bytearray(data), ops, rng)
        st = eng.stats()
        seen[backend] = {k: st[k] for k in keys}
        eng.close()
    assert seen["uring"] == seen["threads"], seen
