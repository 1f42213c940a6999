"""One async protocol (issue 27): every phx operation that runs in the
background returns a :class:`phx.PhxFuture` - ``result(timeout)``, ``done()``,
``exception()``, ``add_done_callback``, ``bytes_by_path()`` with one set of
path names, and ``await`` - and every call takes ``(buffer, file, offset)``.

Host requests run on both engine backends; GPU requests on the fake libcuda
(``tests/gpu_fake``) in a child process.
"""
from __future__ import annotations

import asyncio
import errno
import os
import subprocess
import sys
import textwrap
import threading

import numpy as np
import pytest

import phx
from phx import futures

PATHS = set(futures.PATHS)


@pytest.fixture(params=["uring", "threads"])
def eng(request, monkeypatch):
    if request.param == "threads":
        monkeypatch.setenv("PHX_ENGINE", "threads")
    e = phx.Engine()
    yield e
    e.close()


@pytest.fixture
def data(tmp_path):
    rng = np.random.default_rng(int.from_bytes(os.urandom(8), "little"))
    b = rng.integers(1, 256, (8 << 20) + 4093, dtype=np.uint8)   # never zero
    p = tmp_path / "data.bin"
    b.tofile(p)
    return str(p), b


def test_host_future_is_the_one_protocol(eng, data):
    path, want = data
    buf = phx.empty_aligned(4 << 20)
    with phx.open(path, "r", engine=eng) as f:
        fut = f.pread_async(buf, 0)
        assert isinstance(fut, phx.PhxFuture)
        assert fut.result(timeout=30) == 4 << 20
        assert fut.done() and fut.exception() is None
        assert np.array_equal(np.frombuffer(buf, np.uint8), want[:4 << 20])
        assert fut.bytes_by_path() == {"direct": 4 << 20, "bounce": 0, "page_cache": 0}
        # unaligned offset and size: all through the bounce buffers
        mv = memoryview(buf)[:12345]
        fut = f.pread_async(mv, 4097)
        assert fut.result() == 12345
        assert fut.bytes_by_path() == {"direct": 0, "bounce": 12345, "page_cache": 0}
        assert bytes(mv) == want[4097:4097 + 12345].tobytes()
        # past the end: a short count, by path too
        fut = f.pread_async(memoryview(buf)[:8192], (8 << 20))
        assert fut.result() == 4093 and sum(fut.bytes_by_path().values()) == 4093
    with phx.open(path, "r", direct=False, engine=eng) as f:
        fut = f.pread_async(memoryview(buf)[:65536], 100)
        assert fut.result() == 65536
        assert fut.bytes_by_path() == {"direct": 0, "bounce": 0, "page_cache": 65536}


def test_callbacks_fire_once_from_the_completion_thread(eng, data):
    path, want = data
    bufs = [phx.empty_aligned(1 << 20) for _ in range(16)]
    seen: list[tuple[int, str, int]] = []
    all_done = threading.Event()
    lock = threading.Lock()

    def cb(i):
        def fn(fut):
            with lock:
                seen.append((i, threading.current_thread().name, fut.result()))
                if len(seen) == 32:
                    all_done.set()
        return fn

    with phx.open(path, "r", engine=eng) as f:
        futs = [f.pread_async(b, i << 18) for i, b in enumerate(bufs)]
        for i, fut in enumerate(futs):
            fut.add_done_callback(cb(i))
            fut.add_done_callback(cb(100 + i))
        assert all_done.wait(30), f"{len(seen)} of 32 callbacks"
        for i, b in enumerate(bufs):
            assert np.array_equal(np.frombuffer(b, np.uint8), want[i << 18:(i << 18) + (1 << 20)])
        # on a finished future a callback runs at once, in this thread
        here = []
        futs[0].add_done_callback(lambda fut: here.append(threading.current_thread()))
        assert here == [threading.current_thread()]
    assert sorted(i for i, _, _ in seen) == sorted(list(range(16)) + list(range(100, 116)))
    assert all(n == 1 << 20 for _, _, n in seen)
    # the ones added before completion ran on phx's thread (or here, if already done)
    assert {t for _, t, _ in seen} <= {"phx-completions", threading.current_thread().name}


def test_a_raising_callback_does_not_stop_the_others(eng, data, caplog):
    path, _ = data
    buf = phx.empty_aligned(1 << 20)
    got = threading.Event()
    with phx.open(path, "r", engine=eng) as f:
        fut = f.pread_async(buf, 0)
        fut.add_done_callback(lambda _: 1 / 0)
        fut.add_done_callback(lambda _: got.set())
        assert got.wait(30)
    fut2 = futures.DoneFuture(7)
    fut2.add_done_callback(lambda _: 1 / 0)       # logged, not raised
    assert "raised" in caplog.text


def test_await_many_requests_at_once(eng, data):
    path, want = data
    bufs = [phx.empty_aligned(1 << 20) for _ in range(8)]

    async def main(f):
        return await asyncio.gather(*(f.pread_async(b, i << 20) for i, b in enumerate(bufs)))

    with phx.open(path, "r", engine=eng) as f:
        assert asyncio.run(main(f)) == [1 << 20] * 8
    for i, b in enumerate(bufs):
        assert np.array_equal(np.frombuffer(b, np.uint8), want[i << 20:(i + 1) << 20])


def test_errors_through_every_door(eng, tmp_path):
    """A failed request: result() raises, exception() returns it, a callback
    sees it, await raises it."""
    small = tmp_path / "small"
    small.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1M", "tmpfs",
                                             str(small)], capture_output=True).returncode:
        pytest.skip("needs root to mount a 1 MiB tmpfs (ENOSPC)")
    try:
        buf = phx.empty_aligned(4 << 20)
        np.frombuffer(buf, np.uint8)[:] = 7
        with phx.open(str(small / "f"), "w", engine=eng) as f:
            fut = f.pwrite_async(buf, 0)
            err = fut.exception(timeout=30)
            assert isinstance(err, OSError) and err.errno == errno.ENOSPC, err
            with pytest.raises(OSError):
                fut.result()
            seen = []
            fut.add_done_callback(lambda x: seen.append(x.exception()))
            assert seen and seen[0].errno == errno.ENOSPC

            async def main():
                return await f.pwrite_async(buf, 0)
            with pytest.raises(OSError) as ei:
                asyncio.run(main())
            assert ei.value.errno == errno.ENOSPC
    finally:
        subprocess.run(["umount", str(small)], capture_output=True)


def test_timeout_is_timeout_error():
    import concurrent.futures
    cf: concurrent.futures.Future = concurrent.futures.Future()
    fut = futures.PoolFuture(cf)
    assert not fut.done() and fut.bytes_by_path() == dict.fromkeys(futures.PATHS, 0)
    with pytest.raises(TimeoutError):
        fut.result(timeout=0.01)
    with pytest.raises(TimeoutError):
        fut.exception(timeout=0.01)
    got = []
    fut.add_done_callback(lambda x: got.append(x.result()))
    cf.set_result(4096)
    assert got == [4096] and fut.bytes_by_path()["direct"] == 4096


def test_kv_writes_return_phx_futures(tmp_path):
    from phx.kv.slab import PageCacheBackend, SlabBackend
    buf = phx.empty_aligned(1 << 20)
    np.frombuffer(buf, np.uint8)[:] = 3
    s = SlabBackend(str(tmp_path / "slab"), 8 << 20)
    try:
        fut = s.write_async(buf, 0)
        assert isinstance(fut, phx.PhxFuture)
        assert fut.result() == 1 << 20
        assert fut.bytes_by_path()["direct"] == 1 << 20
    finally:
        s.close()
    p = PageCacheBackend(str(tmp_path / "pc"), 8 << 20)
    try:
        fut = p.write_async(buf, 0)
        assert isinstance(fut, phx.PhxFuture) and fut.done()
        assert fut.bytes_by_path() == {"direct": 0, "bounce": 0, "page_cache": 1 << 20}
    finally:
        p.close()


GPU = textwrap.dedent(r"""
    import asyncio, ctypes, os, sys, threading, warnings
    import numpy as np
    import phx, phx.gpu
    lib = ctypes.CDLL("libcuda.so.1")
    assert lib.fake_ctx_retained, "not the fake"
    path = sys.argv[1]
    want = np.fromfile(path, np.uint8)

    class DevView:
        def __init__(self, ptr, n):
            self.ptr, self.n = ptr, n
            self.__cuda_array_interface__ = {"data": (ptr, False), "shape": (n,),
                                             "typestr": "|u1", "version": 3, "stream": None}
        def host(self):
            return np.ctypeslib.as_array((ctypes.c_ubyte * self.n).from_address(self.ptr))

    def alloc(n):
        c, p = ctypes.c_void_p(), ctypes.c_uint64()
        assert lib.cuDevicePrimaryCtxRetain(ctypes.byref(c), 0) == 0
        assert lib.cuCtxSetCurrent(c) == 0
        assert lib.cuMemAlloc_v2(ctypes.byref(p), ctypes.c_size_t(n)) == 0
        return DevView(p.value, n)

    eng = phx.Engine()
    phx.gpu.context(eng, 0, lanes=2, bufs_per_lane=2, buf_size=256 << 10)
    g = alloc(3 << 20)
    f = phx.open(path, "r", engine=eng)
    # the one order: buffer, file, offset
    fut = phx.gpu.pread_async(g, f, 4097)
    assert isinstance(fut, phx.PhxFuture)
    assert fut.result() == 3 << 20
    assert np.array_equal(g.host(), want[4097:4097 + (3 << 20)])
    bp = fut.bytes_by_path()
    assert set(bp) == {"direct", "bounce", "page_cache"} and sum(bp.values()) == 3 << 20, bp
    # the old order still works, with a warning
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        assert phx.gpu.pread(f, g, 0) == 3 << 20
        assert phx.gpu.read_chunks(f, g, [0], [0], [4096]) == [4096]
    assert [x.category for x in w] == [DeprecationWarning] * 2, [str(x.message) for x in w]
    assert "pread(buf, file" in str(w[0].message)
    # the context's completion eventfd is written when a request ends
    import select
    fd = fut._wake_fd()
    while select.select([fd], [], [], 0)[0]:
        os.read(fd, 8)
    f2 = phx.gpu.pread_async(DevView(g.ptr, 65536), f, 0)
    assert f2.result() == 65536
    assert select.select([fd], [], [], 5)[0], "no completion on the context's eventfd"
    os.read(fd, 8)
    # callbacks from the completion thread, on that eventfd
    done = threading.Event()
    seen = []
    views = [DevView(g.ptr + (i << 18), 1 << 18) for i in range(12)]
    fs = [f.pread_async(v, i * 70001) for i, v in enumerate(views)]
    for fu in fs:
        assert isinstance(fu, phx.PhxFuture)
        fu.add_done_callback(lambda x: (seen.append(x.result()), len(seen) == 12 and done.set()))
    assert done.wait(30), len(seen)
    assert seen == [1 << 18] * 12
    for i, v in enumerate(views):
        assert np.array_equal(v.host(), want[i * 70001:i * 70001 + (1 << 18)]), i
    # a batch, awaited
    async def main():
        b = phx.gpu.read_chunks_async(g, f, [1, 2, 3], [0, 1 << 20, 2 << 20], [100, 200, 300])
        assert isinstance(b, phx.PhxFuture)
        r = await b
        return r, b.bytes_by_path()
    r, bp = asyncio.run(main())
    assert r == [100, 200, 300] and sum(bp.values()) == 600, bp
    assert np.array_equal(g.host()[1 << 20:(1 << 20) + 200], want[2:202])
    # a stream op: the same protocol
    op = phx.gpu.read_async(DevView(g.ptr, 8192), f, 8)
    assert isinstance(op, phx.PhxFuture)
    got = []
    ev = threading.Event()
    op.add_done_callback(lambda x: (got.append(x.result()), ev.set()))
    assert ev.wait(30) and got == [8192] and op.bytes_done == 8192
    assert np.array_equal(g.host()[:8192], want[8:8200])
    f.close()
    print("ok gpu futures")
""")


def test_gpu_futures_on_the_fake(fake_cuda, data):
    path, _ = data
    env = dict(os.environ, LD_LIBRARY_PATH=str(fake_cuda))
    r = subprocess.run([sys.executable, "-c", GPU, path], env=env, capture_output=True,
                       text=True, timeout=300)
    assert "ok gpu futures" in r.stdout, r.stdout + r.stderr
