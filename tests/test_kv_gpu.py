"""phx.kv on GPU buffers: Co-DMA relays, both paths, the pipeline's real copies.

Two layers of tests:

- against the fake libcuda of ``tests/gpu_fake`` (host memory as device memory, a
  thread per stream; see tests/test_gpu_fake.py), everywhere a C compiler is: the
  store's GPU path byte for byte (both groups, unaligned rows, writes ordered after
  the producer's stream), the relays (one per copy thread, tensor-sized, registered
  with the phx engine, pinned bytes in the plan's budget), the pipeline timing real
  H2D copies and failing cleanly on a bad copy;
- on a real GPU (torch CUDA tensors), skipped elsewhere with 'no usable GPU'.

The fake proves the logic, not CUDA: the same properties are checked on the H200.
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest





def _run_fake(fake_cuda, tmp_path, script: str, devices: int = 1) -> str:
    env = dict(os.environ, LD_LIBRARY_PATH=str(fake_cuda), FAKE_CUDA_DEVICES=str(devices))
    r = subprocess.run([sys.executable, "-c", PRELUDE + textwrap.dedent(script),
                        str(tmp_path)], env=env, capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "ok" in r.stdout.split(), r.stdout
    return r.stdout


PRELUDE = textwrap.dedent(r"""
    import ctypes, os, sys, threading
    import numpy as np
    import phx, phx.gpu
    from phx.kv import KVStore, AdaptivePipeline, PAGECACHE, DIRECT, INTRA, CROSS
    lib = ctypes.CDLL("libcuda.so.1")
    assert lib.fake_sleep_async, "not the fake"
    assert phx.gpu.is_available()[0], phx.gpu.is_available()
    d = sys.argv[1]
    rng = np.random.default_rng(int.from_bytes(os.urandom(8), "little"))

    class Dev:
        '''n bytes of fake device memory, seen through __cuda_array_interface__.'''
        def __init__(self, n, stream=None):
            p = ctypes.c_uint64()
            assert lib.cuMemAlloc_v2(ctypes.byref(p), ctypes.c_size_t(max(n, 1))) == 0
            self.ptr, self.n, self.stream = p.value, n, stream
        @property
        def __cuda_array_interface__(self):
            return {"data": (self.ptr, False), "shape": (self.n,), "typestr": "|u1",
                    "version": 3, "stream": self.stream}
        def host(self):
            return np.ctypeslib.as_array((ctypes.c_ubyte * self.n).from_address(self.ptr))
        def fill(self, data):
            ctypes.memmove(self.ptr, data.ctypes.data, self.n)
""")


def test_store_moves_gpu_tensors_both_paths(fake_cuda, tmp_path):
    """Dual store, half the layers on each path, odd row sizes (42 B): prefill from
    GPU buffers, row appends (sync and async), decode reads of rows [a:b] into GPU
    buffers; every byte as written; host arrays still work in the same store."""
    _run_fake(fake_cuda, tmp_path, r"""
        shape = (37, 3, 7)                               # float16: 42-byte rows
        row = 42
        tb = 37 * row
        st = KVStore(os.path.join(d, "s"), budget=3 * 8192, device=0, copy_threads=2)
        kv = [st.allocate(L, shape, np.float16) for L in range(6)]
        plan = st.plan()
        assert plan.n1 == 3, str(plan)
        # the relays are not made yet, but the plan counted them: 2 x one tensor
        assert plan.budget.pinned == 2 * 4096, plan.budget.as_dict()
        model = {}
        for L, (k, v) in enumerate(kv):
            for t in (k, v):
                data = rng.integers(0, 256, 30 * row, dtype=np.uint8)
                src = Dev(30 * row)
                src.fill(data)
                assert st.write(t, 0, src) == 30
                m = np.zeros(tb, np.uint8); m[:30 * row] = data
                model[t.id] = m
        for i in range(30, 37):                           # decode appends
            for L, (k, v) in enumerate(kv):
                for t, use_async in ((k, False), (v, True)):
                    data = rng.integers(0, 256, row, dtype=np.uint8)
                    src = Dev(row); src.fill(data)
                    if use_async:
                        assert st.write_async(t, i, src).result() == row
                    else:
                        st.write(t, i, src)
                    model[t.id][i * row:(i + 1) * row] = data
        groups = {t.group for t in st.tensors()}
        assert groups == {PAGECACHE, DIRECT}
        for t in st.tensors():
            for a, b in ((0, 37), (0, 31), (5, 36), (36, 37)):
                out = Dev((b - a) * row)
                out.host()[:] = 0xEE
                st.read(t, a, b, out=out)
                assert (out.host() == model[t.id][a * row:b * row]).all(), (t, a, b)
            # host destinations keep working, no relay involved
            h = st.read(t, 0, 37)
            assert (h.reshape(-1).view(np.uint8) == model[t.id]).all()
        pool = st.relay_pool
        s = pool.stats()
        assert s["relays"] == 2 and s["relay_bytes"] == 4096 and s["pinned_bytes"] == 8192
        assert all(r.pinned and r.stream for r in pool.relays)
        assert s["d2h_bytes"] == 12 * 37 * row and s["h2d_bytes"] == 12 * (37 + 31 + 31 + 1) * row
        st.destroy()
        print("ok")
    """)


def test_gpu_write_waits_for_the_producer_stream(fake_cuda, tmp_path):
    """A GPU source still being produced on its stream (a busy stream in the fake,
    then a copy that writes the data) is stored with the bytes the stream produced:
    the D2H is ordered after the producer's work."""
    _run_fake(fake_cuda, tmp_path, r"""
        s = ctypes.c_void_p()
        assert lib.cuStreamCreate(ctypes.byref(s), 1) == 0
        st = KVStore(os.path.join(d, "s"), mode="direct", device=0)
        k, v = st.allocate(0, (64, 64), np.uint8)       # 4 KiB tensors
        data = rng.integers(1, 256, 4096, dtype=np.uint8)
        staged = data.copy()
        src = Dev(4096, stream=s.value)
        src.host()[:] = 0
        lib.fake_sleep_async(s, ctypes.c_ulong(200000))  # 0.2 s of "kernels"
        lib.cuMemcpyHtoDAsync_v2(ctypes.c_uint64(src.ptr), ctypes.c_void_p(staged.ctypes.data),
                                 ctypes.c_size_t(4096), s)
        st.write(k, 0, src)
        assert (st.read(k).reshape(-1) == data).all(), "stored before the producer finished"
        st.destroy()
        print("ok")
    """)


def test_gpu_reads_take_the_read_ahead(fake_cuda, tmp_path):
    """Issue 26 part 4 on the GPU path: a read into GPU memory and a copy job
    take rows read ahead, DMA'd straight from the read-ahead's pinned buffer
    (the copy thread's relay untouched); a GPU store after the read-ahead makes
    it stale (the GPU then gets the stored bytes)."""
    _run_fake(fake_cuda, tmp_path, r"""
        st = KVStore(os.path.join(d, "s"), mode="direct", device=0, readahead=2)
        k, v = st.allocate(0, (48, 1000), np.uint8)      # 1000-byte rows: unaligned
        ref = {}
        for t in (k, v):
            ref[t.id] = rng.integers(1, 256, 48 * 1000, dtype=np.uint8)
            st.write(t, 0, ref[t.id])
        assert st.prefetch(k, 0, 48) and st.prefetch(v, 5, 40)
        out = Dev(48 * 1000)
        st.read(k, 0, 48, out=out)                         # _read_gpu: from the buffer
        assert (out.host() == ref[k.id]).all()
        dst = Dev(24 * 1000)
        with st.relays().acquire() as r:                   # a copy job, as the pipeline runs it
            r.buf[:] = 0
            job = st.copy_job(v, 7, 31, dst)
            nb = job.read(r.buf)
            job.dma(r.buf, nb)
            # one DMA from the read-ahead's pinned buffer: the relay was not used
            assert not r.buf.any()
        assert nb == 24 * 1000 and (dst.host() == ref[v.id][7000:31000]).all()
        rep = st.readahead_report()
        assert rep["served"] == 2 and rep["stale"] == 0, rep
        # a GPU store of rows 10..19 after the read-ahead: stale, never served
        assert st.prefetch(k, 0, 48)
        src = Dev(10 * 1000)
        src.host()[:] = rng.integers(1, 256, 10 * 1000, dtype=np.uint8)
        st.write(k, 10, src)
        ref[k.id][10000:20000] = src.host()
        out2 = Dev(48 * 1000)
        st.read(k, 0, 48, out=out2)
        assert (out2.host() == ref[k.id]).all()
        assert st.readahead_report()["stale"] == 1
        st.destroy()
        print("ok")
    """)


def test_relays_are_fixed_buffers_of_the_slab_engine(fake_cuda, tmp_path):
    """Direct-path reads into a relay are io_uring fixed-buffer I/O (the relay is
    registered with the slab's engine): Co-DMA, no bounce."""
    _run_fake(fake_cuda, tmp_path, r"""
        eng = phx.Engine()
        st = KVStore(os.path.join(d, "s"), mode="direct", device=0, engine=eng)
        k, v = st.allocate(0, (256, 2048), np.uint8)     # 512 KiB, block-aligned rows
        data = rng.integers(0, 256, 256 * 2048, dtype=np.uint8)
        st.write(k, 0, data)
        before = eng.stats()["fixed_buf_ios"]
        out = Dev(256 * 2048)
        st.read(k, 0, 256, out=out)
        assert (out.host() == data).all()
        assert eng.stats()["fixed_buf_ios"] > before, eng.stats()
        st.destroy()
        print("ok")
    """)


def test_pipeline_on_gpu_relays(fake_cuda, tmp_path):
    """The adaptive pipeline on the store's relays: copy jobs into GPU buffers are
    byte-exact under both strategies, its probe times real H2D copies (the relays'
    H2D byte counts match what was moved), and a copy to a bad device address fails
    the batch with the CUDA error, without hanging."""
    _run_fake(fake_cuda, tmp_path, r"""
        st = KVStore(os.path.join(d, "s"), budget=2 * 2 * 20480, device=0)
        shape = (40, 4, 128)                              # 1 KiB rows, 40 KiB tensors
        kv = [st.allocate(L, shape, np.float16) for L in range(4)]
        model = {}
        for k, v in kv:
            for t in (k, v):
                a = rng.integers(0, 256, 40 * 1024, dtype=np.uint8)
                st.write(t, 0, a)
                model[t.id] = a
        pool = st.relays(0)
        outs = {t.id: Dev(33 * 1024) for t in st.tensors()}
        with AdaptivePipeline(threads=2, relays=pool) as pipe:
            for step in range(5):
                pipe.begin_step()
                for k, v in kv:
                    pipe.run([st.copy_job(k, 0, 33, outs[k.id]), st.copy_job(v, 0, 33, outs[v.id])])
                    for t in (k, v):
                        assert (outs[t.id].host() == model[t.id][:33 * 1024]).all(), (step, t)
                        outs[t.id].host()[:] = 0
                pipe.end_step()
            rep = pipe.report()
        assert rep["choice"] in (INTRA, CROSS) and set(rep["probe"]) == {INTRA, CROSS}
        assert rep["relays"]["h2d_bytes"] == 5 * 8 * 33 * 1024, rep["relays"]
        assert rep["relays"]["h2d_s"] > 0
        # a failing DMA (an address that is not device memory) under Overlap-Cross
        bad = Dev(33 * 1024)
        good = [st.copy_job(t, 0, 33, outs[t.id]) for t in st.tensors()]
        job = st.copy_job(kv[0][0], 0, 33, bad)
        lib.cuMemFree_v2(ctypes.c_uint64(bad.ptr))        # now not device memory
        done = {}
        def go():
            with AdaptivePipeline(threads=2, relays=pool, strategy=CROSS) as p2:
                p2.begin_step()
                try:
                    p2.run([job] + good)
                except Exception as e:
                    done["err"] = e
        th = threading.Thread(target=go, daemon=True); th.start(); th.join(20)
        assert not th.is_alive(), "the pipeline hung on a failed DMA"
        assert "cuMemcpyHtoDAsync" in str(done.get("err")), done
        st.destroy()
        print("ok")
    """)


# -- libphx's pinned memory and copy streams (what the relays stand on) ----------------
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def host_test_build(fake_libcuda, tmp_path_factory):
    """tests/gpu_fake/cuda_host_test.c with every libphx source, under
    AddressSanitizer (leaks of streams, registrations and contexts included)."""
    import shutil
    cc = shutil.which("cc") or shutil.which("gcc")
    if not cc or not os.path.exists("/usr/include/liburing.h"):
        pytest.skip("needs a C compiler and liburing headers")
    d = tmp_path_factory.mktemp("cudahost")
    src = [os.path.join(ROOT, "libphx", "src", f)
           for f in sorted(os.listdir(os.path.join(ROOT, "libphx", "src"))) if f.endswith(".c")]
    subprocess.run([cc, "-O1", "-g", "-fsanitize=address", "-fno-omit-frame-pointer",
                    "-D_GNU_SOURCE", f"-I{ROOT}/libphx/include", f"-I{ROOT}/libphx/src",
                    f"-I{ROOT}/kernel/include/uapi", "-o", str(d / "cuda_host_test"),
                    os.path.join(ROOT, "tests", "gpu_fake", "cuda_host_test.c"), *src,
                    "-luring", "-ldl", "-lpthread"], check=True)
    return d / "cuda_host_test"


@pytest.mark.parametrize("devices", [1, 2])
def test_c_host_memory_and_copy_streams(fake_libcuda, host_test_build, devices):
    """The C ABI under the relays (PHX_0.7), tests/gpu_fake/cuda_host_test.c: pin
    and unpin once each with the primary context held meanwhile, byte-exact copies
    both ways, a copy after a slow producer sees its bytes, a capturing producer
    refused, errors naming the driver call, any thread (none current, another
    device's current) with what was current restored; two devices: all on device 1."""
    env = dict(os.environ, LD_LIBRARY_PATH=str(fake_libcuda), FAKE_CUDA_DEVICES=str(devices))
    r = subprocess.run([str(host_test_build)], env=env, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "all passed" in r.stdout


def test_pin_and_copy_stream(fake_cuda, tmp_path):
    """phx.gpu.pin / CopyStream: page-locked exactly while pinned (the buffer held:
    a pinned bytearray cannot be resized), copies both ways byte-exact from numpy,
    bytearray, AlignedBuffer and int addresses into __cuda_array_interface__ memory,
    ordered after a slow producer with after(), size and read-only checks, OSError
    naming the call for a bad device address; contexts and pins all given back."""
    _run_fake(fake_cuda, tmp_path, r"""
        hostreg = lib.fake_host_registered
        live = lambda: hostreg(ctypes.byref(ctypes.c_size_t()))
        refs0, live0 = lib.fake_ctx_retained(0), live()
        n = 300_001
        src = rng.integers(0, 256, n, dtype=np.uint8)
        p = phx.gpu.pin(src, 0)
        assert p.pinned and p.nbytes == n and p.address == src.ctypes.data and live() == live0 + 1
        ba = bytearray(n)
        with phx.gpu.pin(ba, 0):
            try:
                ba.extend(b"x")
                raise AssertionError("a pinned bytearray was resized")
            except BufferError:
                pass
        assert live() == live0 + 1
        g = Dev(n)
        cs = phx.gpu.CopyStream(0)
        assert cs.handle
        cs.h2d(g, src)
        cs.synchronize()
        assert (g.host() == src).all()
        cs.d2h(ba, g)
        al = phx.empty_aligned(n)
        cs.d2h(al, g.ptr, n)
        cs.synchronize()
        assert bytes(ba) == src.tobytes() == bytes(al)
        # int addresses, partial sizes
        cs.h2d(g.ptr + 10, src.ctypes.data, 1000)
        cs.synchronize()
        assert (g.host()[10:1010] == src[:1000]).all()
        # ordered after a producer that is slow, then writes the bytes
        s = ctypes.c_void_p()
        assert lib.cuStreamCreate(ctypes.byref(s), 1) == 0
        want = rng.integers(0, 256, n, dtype=np.uint8)
        lib.fake_sleep_async(s, ctypes.c_ulong(200000))
        lib.cuMemcpyHtoDAsync_v2(ctypes.c_uint64(g.ptr), ctypes.c_void_p(want.ctypes.data),
                                 ctypes.c_size_t(n), s)
        out = np.zeros(n, np.uint8)
        cs.after(s.value)
        cs.d2h(out, g)
        cs.synchronize()
        assert (out == want).all(), "copied before the producer was done"
        cs.after(None)
        # checks before any copy is queued
        for bad in (lambda: cs.h2d(g, np.zeros(n + 1, np.uint8)),
                    lambda: cs.d2h(np.zeros(n + 1, np.uint8), g),
                    lambda: cs.h2d(g, src, n + 1)):
            try:
                bad()
                raise AssertionError("too large a copy was queued")
            except ValueError:
                pass
        try:
            cs.d2h(bytes(n), g)
            raise AssertionError("a read-only destination was accepted")
        except phx.BufferReadOnlyError:
            pass
        try:
            cs.d2h(src[::2], g, 100)
            raise AssertionError("a strided destination was accepted")
        except phx.BufferNotContiguousError:
            pass
        lib.cuMemFree_v2(ctypes.c_uint64(g.ptr))
        try:
            cs.h2d(g.ptr, src.ctypes.data, 4096)
            raise AssertionError("a copy to freed memory was queued")
        except OSError as e:
            assert e.errno == 22 and "cuMemcpyHtoDAsync" in str(e), e
        cs.close(); cs.close()
        try:
            cs.synchronize()
            raise AssertionError("a closed stream was used")
        except ValueError:
            pass
        p.close(); p.close()
        assert not p.pinned and live() == live0
        assert lib.fake_ctx_retained(0) == refs0, (lib.fake_ctx_retained(0), refs0)
        print("ok")
    """)


def test_relays_pin_through_libphx_on_a_second_device(fake_cuda, tmp_path):
    """Two devices, the store on device 1, nothing current in the calling threads:
    the relays are pinned through libphx while the pool lives (one registration
    each, device 1's primary context held), their copies land on device 1
    byte-exact (both groups), a GPU buffer of device 0 is refused, and closing the
    pool gives every registration and context reference back."""
    _run_fake(fake_cuda, tmp_path, r"""
        hostreg = lib.fake_host_registered
        live = lambda: hostreg(ctypes.byref(ctypes.c_size_t()))
        live0, refs0 = live(), lib.fake_ctx_retained(1)
        ctx = [ctypes.c_void_p(), ctypes.c_void_p()]
        for i in (0, 1):
            assert lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx[i]), i) == 0
        def on(dev, n):
            assert lib.cuCtxPushCurrent_v2(ctx[dev]) == 0
            try:
                return Dev(n)
            finally:
                lib.cuCtxPopCurrent_v2(ctypes.byref(ctypes.c_void_p()))
        shape = (48, 8, 16)                               # 256-byte rows
        st = KVStore(os.path.join(d, "s"), budget=2 * 2 * 12288, device=1, copy_threads=3)
        kv = [st.allocate(L, shape, np.float16) for L in range(4)]
        st.plan()
        model = {}
        for k, v in kv:
            for t in (k, v):
                data = rng.integers(0, 256, 48 * 256, dtype=np.uint8)
                src = on(1, 48 * 256)
                src.fill(data)
                st.write(t, 0, src)
                model[t.id] = data
        pool = st.relay_pool
        assert pool.device == 1 and len(pool.relays) == 3
        assert live() == live0 + 3, (live(), live0)
        assert lib.fake_ctx_retained(1) >= refs0 + 3
        assert all(r.pinned and r.stream for r in pool.relays)
        assert {t.group for t in st.tensors()} == {PAGECACHE, DIRECT}
        for t in st.tensors():
            out = on(1, 40 * 256)
            st.read(t, 3, 43, out=out)
            assert (out.host() == model[t.id][3 * 256:43 * 256]).all(), t
        try:
            st.read(kv[0][0], 0, 48, out=on(0, 48 * 256))
            raise AssertionError("a device-0 buffer went through device-1 relays")
        except ValueError:
            pass
        st.destroy()
        assert live() == live0, (live(), live0)
        for i in (0, 1):
            lib.cuDevicePrimaryCtxRelease_v2(i)
        assert lib.fake_ctx_retained(1) == refs0, (lib.fake_ctx_retained(1), refs0)
        print("ok")
    """, devices=2)


# -- a real GPU ---------------------------------------------------------------------
def _torch_cuda():
    try:
        import torch
    except ImportError:
        pytest.skip("no usable GPU (torch is not installed)")
    if not torch.cuda.is_available():
        pytest.skip("no usable GPU")
    import phx.gpu
    ok, why = phx.gpu.is_available()
    if not ok:
        pytest.skip(f"no usable GPU: {why}")
    return torch


@pytest.fixture
def kvdir(data_dir):
    return data_dir


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_real_gpu_roundtrip(kvdir, dtype):
    """CUDA tensors written straight from the kernels that made them and read back
    into CUDA tensors, both groups, unaligned row ranges: equal bit for bit."""
    torch = _torch_cuda()
    from phx.kv import DIRECT, PAGECACHE, KVStore
    dt = getattr(torch, dtype)
    shape = (67, 5, 24)                                   # 240-byte rows
    st = KVStore(os.path.join(kvdir, "g"), budget=3 * 32768, device=0, copy_threads=2)
    kv = [st.allocate(L, shape, dt) for L in range(6)]
    st.plan()
    assert {t.group for t in st.tensors()} == {PAGECACHE, DIRECT}
    want = {}
    for k, v in kv:
        for t in (k, v):
            x = (torch.randn(shape, device="cuda") * 3).to(dt)   # queued, not synchronised
            st.write(t, 0, x[:60])
            for i in range(60, 67):
                st.write_async(t, i, x[i:i + 1]).result()
            want[t.id] = x
    for t in st.tensors():
        for a, b in ((0, 67), (3, 61), (66, 67)):
            out = torch.full((b - a,) + shape[1:], 7, dtype=dt, device="cuda")
            st.read(t, a, b, out=out)
            assert torch.equal(out.view(torch.int16), want[t.id][a:b].view(torch.int16)), (t, a, b)
    s = st.relay_pool.stats()
    assert s["pinned_bytes"] == 2 * s["relay_bytes"] and s["h2d_bytes"] > 0
    st.destroy()


def test_real_gpu_pipeline_times_h2d(kvdir):
    """The pipeline over real H2D copies: byte-exact, and its probe's bytes are the
    relays' H2D bytes."""
    torch = _torch_cuda()
    from phx.kv import AdaptivePipeline, KVStore
    shape = (544, 32, 128)                                # OPT-6.7B batch 1: 4.25 MiB
    st = KVStore(os.path.join(kvdir, "p"), budget=8 * (544 * 8192), device=0)
    kv = [st.allocate(L, shape, torch.float16) for L in range(8)]
    want = {}
    for k, v in kv:
        for t in (k, v):
            x = torch.randn(shape, device="cuda", dtype=torch.float16)
            st.write(t, 0, x)
            want[t.id] = x
    outs = {t.id: torch.empty((512,) + shape[1:], dtype=torch.float16, device="cuda")
            for t in st.tensors()}
    with AdaptivePipeline(threads=2, relays=st.relays(0)) as pipe:
        for _ in range(4):
            pipe.begin_step()
            for k, v in kv:
                pipe.run([st.copy_job(k, 0, 512, outs[k.id]), st.copy_job(v, 0, 512, outs[v.id])])
            pipe.end_step()
        rep = pipe.report()
    for t in st.tensors():
        assert torch.equal(outs[t.id], want[t.id][:512])
    assert rep["relays"]["h2d_bytes"] == 4 * 16 * 512 * 8192
    assert rep["probe"]["overlap-intra"]["bytes"] == 16 * 512 * 8192
    st.destroy()
