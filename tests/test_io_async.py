"""pread_async / pwrite_async futures, and many requests from many threads.

Futures must behave like concurrent.futures ones: result() returns the byte
count (waiting as needed, from any thread, by several waiters at once),
done() turns true on its own while someone polls it, result(timeout) raises
TimeoutError while pending.  Buffers passed to an async call must stay alive
until it completes even if the caller drops its reference.
"""
from __future__ import annotations

import os
import queue
import threading
import time

import numpy as np
import pytest

import phx
from conftest import KiB, MiB, assert_same, fresh_bytes, sigint_default, write_file

FILE_SIZE = 8 * MiB + 123


@pytest.fixture
def src(data_dir, rng):
    path = os.path.join(data_dir, "src")
    data = fresh_bytes(rng, FILE_SIZE)
    write_file(path, data)
    return path, data


def test_pread_async_basic(src, rng):
    path, data = src
    with phx.open(path, "r") as f:
        buf = bytearray(fresh_bytes(rng, 1 * MiB + 7))
        fut = f.pread_async(buf, 4097)
        assert isinstance(fut, phx.Future)
        assert fut.result() == 1 * MiB + 7
        assert fut.done() is True
        assert fut.result() == 1 * MiB + 7  # idempotent
        assert fut.result(timeout=0) == 1 * MiB + 7
    assert_same(buf, data[4097:4097 + 1 * MiB + 7])


def test_pwrite_async_basic(data_dir, rng):
    path = os.path.join(data_dir, "w")
    a = fresh_bytes(rng, 300_001)
    with phx.open(path, "w+") as f:
        fut = f.pwrite_async(a, 511)
        assert fut.result(timeout=60) == 300_001
        assert fut.done()
    with open(path, "rb") as g:
        got = g.read()
    assert len(got) == 511 + 300_001
    assert_same(got[511:], a)


def test_async_past_eof(src, rng):
    path, data = src
    with phx.open(path, "r") as f:
        futs = [f.pread_async(bytearray(8192), FILE_SIZE - 100),
                f.pread_async(bytearray(10), FILE_SIZE),
                f.pread_async(bytearray(10), FILE_SIZE + 4096)]
        assert [x.result() for x in futs] == [100, 0, 0]


def test_done_becomes_true_by_polling(src, rng):
    """Nobody calls result(): polling done() alone must see completion."""
    path, data = src
    with phx.open(path, "r") as f:
        buf = phx.empty_aligned(4 * MiB)
        fut = f.pread_async(buf, 0)
        deadline = time.monotonic() + 60
        while not fut.done():
            assert time.monotonic() < deadline, "done() never became true"
            time.sleep(0.001)
        assert fut.result(timeout=0) == 4 * MiB
    assert_same(buf, data[:4 * MiB])


def test_result_timeout_while_pending(data_dir, rng):
    """result(timeout) raises TimeoutError while the request cannot finish.

    A read from an empty FIFO (opened buffered) stays pending until something
    is written into the FIFO."""
    fifo = os.path.join(data_dir, "fifo")
    os.mkfifo(fifo)
    try:
        f = phx.open(fifo, "r+", direct=False)
    except OSError as e:
        pytest.skip(f"phx cannot open a FIFO ({e}); no way to hold a request pending")
    with f:
        buf = bytearray(64)
        fut = f.pread_async(buf, 0)
        time.sleep(0.05)
        if fut.done():
            pytest.skip(f"the engine completed a FIFO read at once ({fut.result()!r}); "
                        "cannot hold a request pending this way")
        with pytest.raises(TimeoutError):
            fut.result(timeout=0.2)
        with pytest.raises(TimeoutError):
            fut.result(timeout=0)
        assert not fut.done()
        payload = fresh_bytes(rng, 64)
        wfd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
        try:
            os.write(wfd, payload)
        finally:
            os.close(wfd)
        assert fut.result(timeout=60) == 64
        assert fut.done()
    assert bytes(buf) == payload


class _Tracked(np.ndarray):
    """A uint8 array that records its bytes when it is freed (``_released``).

    The snapshot shows what the buffer held at the moment it died: a buffer
    freed while its read is in flight holds its fill pattern, not the file's
    bytes."""
    _released: dict = {}

    def __del__(self):
        tag = getattr(self, "tag", None)    # views numpy makes have none
        if tag is not None:
            _Tracked._released[tag] = bytes(self)


def _tracked(tag, nbytes: int, fill: bytes) -> np.ndarray:
    a = np.empty(nbytes, dtype=np.uint8).view(_Tracked)
    a.tag = tag
    a[:] = np.frombuffer(fill, dtype=np.uint8)
    return a


def test_buffer_kept_alive_by_future(data_dir, src, rng):
    """The caller drops its only reference to each buffer; the future keeps it
    alive until the request is done (then lets it go).  Reads: what each
    buffer held when it was finally freed must be the file's bytes; writes:
    the file must hold the dropped buffers' bytes.  Memory is churned while
    the requests are in flight so that a freed buffer gets reused."""
    import gc
    path, data = src
    released = _Tracked._released
    released.clear()
    # writes: 32 x (64 KiB + 5) at unaligned offsets, the payloads dropped
    out = os.path.join(data_dir, "o")
    wlen = 64 * KiB + 5
    expected = bytearray()
    with phx.open(out, "w+") as f:
        futs = []
        for i in range(32):
            payload = fresh_bytes(rng, wlen)
            expected += payload
            buf = _tracked(("w", i), wlen, payload)
            futs.append(f.pwrite_async(buf, i * wlen))
            del buf, payload
        junk = [np.full(wlen, 0x5A, dtype=np.uint8) for _ in range(64)]
        assert [x.result(timeout=60) for x in futs] == [wlen] * 32
        del junk, futs
    with open(out, "rb") as g:
        assert_same(g.read(), bytes(expected), "file written from dropped buffers")
    # reads: 48 requests, sizes 1 B .. 1 MiB + 3, anywhere in the file
    reqs = []
    with phx.open(path, "r") as f:
        for i in range(48):
            n = int(rng.choice([1, 4095, 4096, 4097, 65536 + 3, 1 * MiB + 3,
                                int(rng.integers(1, 300 * KiB))]))
            off = int(rng.integers(0, FILE_SIZE - n))
            buf = _tracked(("r", i), n, fresh_bytes(rng, n))
            reqs.append((i, off, n, f.pread_async(buf, off)))
            del buf
        gc.collect()
        for i, off, n, fut in reqs:
            # freed (snapshot taken) and only then seen unfinished: freed early
            early = ("r", i) in released
            assert not (early and not fut.done()), f"read {i}: buffer freed while in flight"
        junk = [np.full(n, 0x5A, dtype=np.uint8) for _, _, n, _ in reqs]
        counts = [(i, off, n, fut.result(timeout=60)) for i, off, n, fut in reqs]
        del junk, reqs, fut
    gc.collect()
    for i, off, n, got in counts:
        assert got == n, f"read {i}: {got} of {n} bytes"
        assert ("r", i) in released, f"read {i}: buffer never freed after completion (leak)"
        assert_same(released[("r", i)], data[off:off + n], f"read {i} ({n} B @ {off})")
    assert all(("w", i) in released for i in range(32)), "write buffers leaked"


def test_future_outlives_file_object(src, rng):
    """No explicit close: dropping the File while a request is in flight must
    neither crash nor lose the request."""
    path, data = src
    buf = bytearray(2 * MiB)
    f = phx.open(path, "r")
    fut = f.pread_async(buf, 100)
    del f
    assert fut.result(timeout=60) == 2 * MiB
    assert_same(buf, data[100:100 + 2 * MiB])


def test_close_with_requests_in_flight(src, rng):
    """close() while requests are in flight either waits for them or raises
    OSError(EBUSY); the futures complete with the right bytes either way."""
    path, data = src
    bufs = [phx.empty_aligned(1 * MiB) for _ in range(8)]
    f = phx.open(path, "r")
    futs = [f.pread_async(b, i * MiB) for i, b in enumerate(bufs)]
    try:
        f.close()
    except OSError as e:
        import errno
        assert e.errno == errno.EBUSY, e
        for x in futs:
            x.result(timeout=60)
        f.close()
    assert [x.result(timeout=60) for x in futs] == [1 * MiB] * 8
    for i, b in enumerate(bufs):
        assert_same(b, data[i * MiB:(i + 1) * MiB], f"buffer {i}")


def test_result_from_other_threads(src, rng):
    """Submit in one thread, resolve in others; several waiters on one future."""
    path, data = src
    q: queue.Queue = queue.Queue()
    results = {}
    errors = []
    with phx.open(path, "r") as f:
        specs = [(int(rng.integers(0, FILE_SIZE)), int(rng.integers(1, 200_000))) for _ in range(200)]

        def submitter():
            for i, (off, ln) in enumerate(specs):
                b = bytearray(ln)
                q.put((i, off, ln, b, f.pread_async(b, off)))
            for _ in range(4):
                q.put(None)

        def resolver():
            try:
                while (item := q.get()) is not None:
                    i, off, ln, b, fut = item
                    n = fut.result(timeout=120)
                    results[i] = (n, bytes(b[:n]), off, ln)
            except BaseException as e:  # noqa: BLE001
                errors.append(e)

        ts = [threading.Thread(target=resolver) for _ in range(4)]
        for t in ts:
            t.start()
        submitter()
        for t in ts:
            t.join(180)
        assert not errors, errors
        assert len(results) == 200
        for i, (n, got, off, ln) in results.items():
            exp = data[off:off + ln]
            assert n == len(exp), (i, off, ln)
            assert_same(got, exp, f"request {i}")

        # many waiters on the same future
        big = phx.empty_aligned(4 * MiB)
        fut = f.pread_async(big, 4 * MiB)
        seen = []
        ws = [threading.Thread(target=lambda: seen.append(fut.result(timeout=120))) for _ in range(6)]
        for t in ws:
            t.start()
        for t in ws:
            t.join(180)
        assert seen == [4 * MiB] * 6
        assert_same(big, data[4 * MiB:8 * MiB])


def _thread_workload(f, data, rng_seed, nreq, region, write_path_data, errors, tid):
    """nreq random async reads (anywhere) and writes (only into this thread's
    region, non-overlapping) interleaved; verify all reads."""
    try:
        r = np.random.default_rng(rng_seed)
        lo, hi, _ = region
        slot = (hi - lo) // nreq
        pending = []
        for i in range(nreq):
            if i % 2 == 0:
                off = int(r.integers(0, FILE_SIZE))
                ln = int(r.choice([1, 4095, 4096, 4097, int(r.integers(1, 128 * KiB))]))
                b = bytearray(ln)
                pending.append(("r", off, ln, b, f.pread_async(b, off)))
            else:
                ln = int(r.integers(1, slot + 1))
                off = lo + i * slot
                payload = r.bytes(ln)
                write_path_data.append((off, payload))
                pending.append(("w", off, ln, payload, f.pwrite_async(payload, off)))
            if len(pending) > 32:
                _check(pending.pop(0), data, region)
        for p in pending:
            _check(p, data, region)
    except BaseException as e:  # noqa: BLE001
        errors.append((tid, e))


def _check(p, data, region):
    kind, off, ln, b, fut = p
    n = fut.result(timeout=120)
    if kind == "w":
        assert n == ln
        return
    exp = data[off:off + ln]
    assert n == len(exp)
    # Reads that overlap any writer's region race with the writers: only
    # check reads entirely below the written area.
    if off + ln <= region[2]:
        assert_same(b[:n], exp, f"async read {ln} @ {off}")


@pytest.mark.parametrize("shared_engine", [True, False], ids=["shared-engine", "per-thread-engine"])
def test_8_threads_x_200_requests(src, rng, shared_engine):
    path, data = src
    nthreads, nreq = 8, 200
    # writes go to the upper half; reads are verified when below it
    wlo = FILE_SIZE // 2
    per = (FILE_SIZE - wlo) // nthreads
    errors: list = []
    written: list[list] = [[] for _ in range(nthreads)]
    files = []
    if shared_engine:
        eng = phx.Engine()
        shared = phx.open(path, "r+", engine=eng)
        files = [shared] * nthreads
    else:
        files = [phx.open(path, "r+", engine=phx.Engine()) for _ in range(nthreads)]
    threads = []
    for t in range(nthreads):
        region = (wlo + t * per, wlo + (t + 1) * per, wlo)
        threads.append(threading.Thread(
            target=_thread_workload,
            args=(files[t], data, int(rng.integers(1 << 62)), nreq, region, written[t], errors, t)))
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert not any(t.is_alive() for t in threads), "threads hung"
    for fobj in {id(x): x for x in files}.values():
        fobj.close()
    assert not errors, errors
    expected = bytearray(data)
    for lst in written:
        for off, payload in lst:
            expected[off:off + len(payload)] = payload
    with open(path, "rb") as g:
        assert_same(g.read(), bytes(expected), "file after concurrent writes")


def test_many_outstanding_beyond_queue_depth(src, rng):
    """2000 futures outstanding on an engine with queue_depth=4 and one small
    bounce buffer: everything queues, nothing deadlocks, all bytes right."""
    path, data = src
    eng = phx.Engine(queue_depth=4, bounce_count=1, bounce_size=4096, max_io_size=64 * KiB)
    with phx.open(path, "r", engine=eng) as f:
        reqs = []
        for _ in range(2000):
            off = int(rng.integers(0, FILE_SIZE))
            ln = int(rng.integers(1, 20_000))
            b = bytearray(ln)
            reqs.append((off, ln, b, f.pread_async(b, off)))
        for off, ln, b, fut in reversed(reqs):
            n = fut.result(timeout=300)
            exp = data[off:off + ln]
            assert n == len(exp)
            assert_same(b[:n], exp, f"{ln} @ {off}")


def test_sync_and_async_mixed_threads(src, rng):
    """Sync preads in 4 threads while 4 others use futures, one engine."""
    path, data = src
    errors = []
    with phx.open(path, "r") as f:
        def sync_worker(seed):
            try:
                r = np.random.default_rng(seed)
                for _ in range(150):
                    off = int(r.integers(0, FILE_SIZE)); ln = int(r.integers(1, 50_000))
                    b = bytearray(ln)
                    n = f.pread(b, off)
                    assert_same(b[:n], data[off:off + ln])
            except BaseException as e:  # noqa: BLE001
                errors.append(e)

        def async_worker(seed):
            try:
                r = np.random.default_rng(seed)
                items = []
                for _ in range(150):
                    off = int(r.integers(0, FILE_SIZE)); ln = int(r.integers(1, 50_000))
                    b = bytearray(ln)
                    items.append((off, ln, b, f.pread_async(b, off)))
                for off, ln, b, fut in items:
                    n = fut.result(timeout=120)
                    assert_same(b[:n], data[off:off + ln])
            except BaseException as e:  # noqa: BLE001
                errors.append(e)

        ts = [threading.Thread(target=sync_worker if i % 2 else async_worker,
                               args=(int(rng.integers(1 << 62)),)) for i in range(8)]
        for t in ts:
            t.start()
        for t in ts:
            t.join(300)
    assert not errors, errors


@pytest.mark.parametrize("extend", [False, True], ids=["in-place", "extending"])
def test_threads_writing_interleaved_records(data_dir, rng, extend):
    """8 threads write interleaved 100-byte records (record k at k*100, thread
    k % 8): every 4 KiB block is shared by all threads, so each unaligned
    write is a read-modify-write racing the others'.  Like pwrite(2), no
    record may be lost."""
    path = os.path.join(data_dir, "rec")
    nthreads, per, rec = 8, 150, 100
    total = nthreads * per * rec
    base = b"" if extend else fresh_bytes(rng, total)
    write_file(path, base)
    records = [fresh_bytes(rng, rec) for _ in range(nthreads * per)]
    errors = []
    f = phx.open(path, "r+")

    def writer(t):
        try:
            futs = []
            for i in range(per):
                k = i * nthreads + t
                if i % 2:
                    assert f.pwrite(records[k], k * rec) == rec
                else:
                    futs.append(f.pwrite_async(records[k], k * rec))
            for x in futs:
                assert x.result(timeout=120) == rec
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    ts = [threading.Thread(target=writer, args=(t,)) for t in range(nthreads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(300)
    f.close()
    assert not errors, errors
    assert os.stat(path).st_size == total
    with open(path, "rb") as g:
        got = g.read()
    lost = [k for k in range(nthreads * per) if got[k * rec:(k + 1) * rec] != records[k]]
    assert not lost, f"{len(lost)} of {nthreads * per} records lost or torn, e.g. {lost[:10]}"


_CLOSE_RACE = r"""
import os, sys, threading, phx
path = sys.argv[1]
problems = []
for rep in range(200):
    f = phx.open(path, "r")
    def worker():
        b = bytearray(1 << 20)
        while True:
            try:
                n = f.pread(b, 4097)
                if n != len(b):
                    problems.append(("short", n))
                if f.pread_async(bytearray(5000), 3).result(timeout=60) != 5000:
                    problems.append("async short")
            except phx.ClosedFileError:
                return
            except BaseException as e:
                problems.append(repr(e))
                return
    ts = [threading.Thread(target=worker) for _ in range(4)]
    for t in ts:
        t.start()
    while True:
        try:
            f.close()
            break
        except OSError as e:
            if e.errno != 16:  # EBUSY: requests in flight; try again
                problems.append(("close", repr(e)))
                break
    for t in ts:
        t.join(60)
    if any(t.is_alive() for t in ts):
        problems.append("worker hung after close")
print("PROBLEMS", problems[:5])
sys.exit(1 if problems else 0)
"""


def test_close_while_other_threads_do_io(data_dir, rng):
    """close() while 4 threads do sync and async I/O on the file: the
    threads see either a full result or ClosedFileError - no crash, no hang,
    no other error.  Run in a child process so a crash is reported, not fatal."""
    import subprocess
    import sys
    path = os.path.join(data_dir, "cr")
    write_file(path, fresh_bytes(rng, 4 * MiB))
    r = subprocess.run([sys.executable, "-c", _CLOSE_RACE, path], capture_output=True,
                       text=True, timeout=240)
    assert r.returncode == 0, f"rc {r.returncode}\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}"


def _fifo_file(data_dir):
    fifo = os.path.join(data_dir, "fifo")
    os.mkfifo(fifo)
    try:
        f = phx.open(fifo, "r+", direct=False)
    except OSError as e:
        pytest.skip(f"phx cannot open a FIFO ({e}); no way to hold a request pending")
    return fifo, f


def _feed(fifo, payload):
    wfd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
    try:
        os.write(wfd, payload)
    finally:
        os.close(wfd)


def test_buffer_export_held_while_in_flight(data_dir, rng):
    """While a request is in flight its bytearray cannot be resized (the
    future holds a buffer export); after completion it can."""
    fifo, f = _fifo_file(data_dir)
    with f:
        ba = bytearray(64)
        fut = f.pread_async(ba, 0)
        time.sleep(0.05)
        if fut.done():
            pytest.skip("the engine completed a FIFO read at once")
        with pytest.raises(BufferError):
            ba.extend(b"x" * 100_000)
        payload = fresh_bytes(rng, 64)
        _feed(fifo, payload)
        assert fut.result(timeout=60) == 64
        assert bytes(ba) == payload
        del fut
        ba.extend(b"x")  # released


_SIGINT_WAIT = r"""
import os, signal, sys, threading, time, phx
fifo, timeout = sys.argv[1], (None if sys.argv[2] == "none" else float(sys.argv[2]))
f = phx.open(fifo, "r+", direct=False)
fut = f.pread_async(bytearray(64), 0)
time.sleep(0.05)
if fut.done():
    print("SKIP"); sys.exit(0)
threading.Timer(0.5, lambda: os.kill(os.getpid(), signal.SIGINT)).start()
try:
    fut.result(timeout=timeout)
    print("RETURNED")
except KeyboardInterrupt:
    print("INTERRUPTED")
w = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK); os.write(w, b"y" * 64); os.close(w)
print("RESULT", fut.result(timeout=30))
"""


@pytest.mark.parametrize("timeout", ["none", "60"])
def test_ctrl_c_interrupts_result(data_dir, timeout):
    """Ctrl-C (SIGINT) interrupts a Future.result() that is waiting, like
    concurrent.futures: KeyboardInterrupt, and the future still completes later."""
    import subprocess
    import sys
    fifo = os.path.join(data_dir, "fifo")
    os.mkfifo(fifo)
    try:
        r = subprocess.run([sys.executable, "-c", _SIGINT_WAIT, fifo, timeout],
                           preexec_fn=sigint_default,
                           capture_output=True, text=True, timeout=10)
    except subprocess.TimeoutExpired:
        pytest.fail("Future.result() ignored SIGINT: still waiting 10 s after Ctrl-C")
    if "SKIP" in r.stdout:
        pytest.skip("the engine completed a FIFO read at once")
    assert "INTERRUPTED" in r.stdout, r.stdout + r.stderr
    assert "RESULT 64" in r.stdout, r.stdout + r.stderr


_EXIT_PENDING = r"""
import sys, phx
path = sys.argv[1]
f = phx.open(path, "r")
futs = [f.pread_async(bytearray(1 << 20), i * 4096) for i in range(200)]
g = phx.open(path, "r", engine=phx.Engine())
futs += [g.pread_async(bytearray(100000), 3) for i in range(50)]
print("exiting")
"""


def test_interpreter_exit_with_requests_in_flight(data_dir, rng):
    """Exiting without waiting for futures or closing files: exit status 0,
    no crash, no hang (a KvikIO complaint: crashes at process exit)."""
    import subprocess
    import sys
    path = os.path.join(data_dir, "f")
    write_file(path, fresh_bytes(rng, 2 * MiB))
    for _ in range(5):
        r = subprocess.run([sys.executable, "-c", _EXIT_PENDING, path], capture_output=True,
                           text=True, timeout=120)
        assert r.returncode == 0 and "exiting" in r.stdout, (r.returncode, r.stderr[-2000:])
