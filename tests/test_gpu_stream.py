"""Stream-ordered GPU I/O under what serving stacks do (issue 22), on a real GPU.

Every test skips cleanly without torch or a CUDA device; on the H200 box they
all run.  Data is fresh random bytes; references are plain reads of the file.
The same properties run everywhere against the fake libcuda
(tests/gpu_fake/cuda_fake_test.c, through tests/test_gpu_fake.py).
"""
from __future__ import annotations

import errno
import os
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest

import phx
import phx.gpu
from conftest import real_gpu_marks

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30

torch = pytest.importorskip("torch")
pytestmark = real_gpu_marks()


def rand(rng, n: int) -> np.ndarray:
    return rng.integers(0, 256, size=n, dtype=np.uint8)


def make(data_dir, rng, size: int, name="s.bin"):
    path = os.path.join(data_dir, name)
    data = rand(rng, size)
    data.tofile(path)
    return path, data


def host(t) -> np.ndarray:
    torch.cuda.synchronize()
    return t.cpu().numpy()


def args(size, foff, boff):
    """The four int64 a deferred stream op reads: size, file off, buf off, bytes_done."""
    return np.array([size, foff, boff, -999], dtype=np.int64)


def sleep_stream(ms: float):
    torch.cuda._sleep(int(ms * 2e6))  # ~2 GHz cycles


def test_copy_kernels_load_and_stream_ops_are_on():
    """The PTX (ISA 7.0) loads on this driver; stream ops are available and
    phx info says so."""
    ok, why = phx.gpu.stream_ops_status(0)
    assert ok, why
    ctx = phx.gpu.context(_new=True)
    assert ctx.config["memops"] and ctx.config["stream_ops_why"] == ""
    ctx.close()


def test_thread_that_never_touched_cuda(data_dir, rng):
    """LMCache's and vLLM's workers: a Python thread that made no CUDA call has
    no current context; stream reads and writes and File.pread work there."""
    n = 5 * MiB + 7
    path, data = make(data_dir, rng, 3 * n)
    dst = torch.zeros(n, dtype=torch.uint8, device="cuda")
    src = torch.from_numpy(rand(rng, n)).cuda()
    s = torch.cuda.Stream()
    torch.cuda.synchronize()
    out: dict = {}

    def worker():
        try:
            with phx.open(path, "r+") as f:
                r = phx.gpu.read_async(dst, f, 4097, stream=s)
                w = phx.gpu.write_async(src, f, 2 * n, stream=s)
                s.synchronize()
                out["r"], out["w"] = r.result(), w.result()
                out["p"] = f.pread(dst[:4096], 11)
        except Exception as e:  # noqa: BLE001
            out["e"] = e

    t = threading.Thread(target=worker)
    t.start()
    t.join(60)
    assert "e" not in out, out.get("e")
    assert out["r"] == n and out["w"] == n and out["p"] == 4096, out
    got = host(dst)
    assert (got[:4096] == data[11:11 + 4096]).all()
    assert (got[4096:] == data[4097 + 4096:4097 + n]).all()
    with open(path, "rb") as f:
        f.seek(2 * n)
        assert np.frombuffer(f.read(n), dtype=np.uint8).tobytes() == host(src).tobytes()


def test_20000_ops_on_one_stream(data_dir, rng):
    """Five times the in-flight slots on one stream, queued while the stream is
    held: the calls wait for room (backpressure) instead of failing; every op
    is byte-exact."""
    N = 20000
    path, data = make(data_dir, rng, 8 * MiB + 3)
    ctx = phx.gpu.context(_new=True)
    buf = torch.zeros(N * 64, dtype=torch.uint8, device="cuda")
    s = torch.cuda.Stream()
    a = np.zeros((N, 4), dtype=np.int64)
    a[:, 0] = 1 + np.arange(N) % 61
    a[:, 1] = (np.arange(N, dtype=np.int64) * 7919) % (8 * MiB - 64)
    a[:, 2] = np.arange(N) * 64
    a[:, 3] = -999
    # the stream is held (it waits for a pinned host word) until a timer
    # thread lets it go, so the queue fills and the calls must wait
    import ctypes
    lib = ctypes.CDLL("libcuda.so.1")
    gate = torch.zeros(1, dtype=torch.int32, pin_memory=True)
    torch.cuda.synchronize()
    assert lib.cuStreamWaitValue32_v2(ctypes.c_void_p(s.cuda_stream),
                                      ctypes.c_uint64(gate.data_ptr()), 1, 0) == 0
    timer = threading.Timer(1.0, lambda: gate.fill_(1))
    with phx.open(path, "r") as f:
        timer.start()
        for i in range(N):
            ctx.stream_deferred(f._c_file, buf.data_ptr(), a[i].ctypes.data, False, s.cuda_stream)
        s.synchronize()
    timer.join()
    got = host(buf)
    bad = [i for i in range(N) if a[i, 3] != a[i, 0] or
           not (got[a[i, 2]:a[i, 2] + a[i, 0]] == data[a[i, 1]:a[i, 1] + a[i, 0]]).all()]
    assert not bad, f"{len(bad)} of {N} ops wrong, first {bad[0]}: {a[bad[0]]}"
    # Which queue fills first is the driver's business: on the H200 CUDA's own
    # command queue blocked the caller before phx's 4,096 slots were taken
    # (queue_waits 0); on the fake libcuda phx's slots fill (cuda_fake_test.c
    # asserts the wait there).  Either way nothing failed and nothing was lost.
    ctx.close()


def test_capture_is_refused(data_dir, rng):
    """A stream op inside a CUDA graph capture is refused (EBUSY) with a clear
    message; outside it works."""
    path, data = make(data_dir, rng, MiB)
    t = torch.zeros(4096, dtype=torch.uint8, device="cuda")
    with phx.open(path, "r") as f:
        g = torch.cuda.CUDAGraph()
        s = torch.cuda.Stream()
        with torch.cuda.stream(s):
            y = t + 1                       # warm-up outside the capture
        s.synchronize()
        err = None
        with torch.cuda.graph(g, stream=s):
            y = t + 1
            try:
                phx.gpu.read_async(t, f, 0, stream=s)
            except OSError as e:
                err = e
        assert err is not None and err.errno == errno.EBUSY, err
        assert "graph" in str(err)
        op = phx.gpu.read_async(t, f, 7, stream=s)
        s.synchronize()
        assert op.result() == 4096 and (host(t) == data[7:7 + 4096]).all()
    del y


def test_host_async_after_stream_op_on_one_stream(data_dir, rng):
    """File.pread of GPU tensors (ordered after the tensor's stream) behind a
    stream op on that same stream, with 4 staging buffers: neither waits for
    the other forever."""
    path, data = make(data_dir, rng, 16 * MiB)
    ctx = phx.gpu.context(_new=True, lanes=2, bufs_per_lane=2, buf_size=64 << 10)
    dst = torch.zeros(MiB, dtype=torch.uint8, device="cuda")
    many = torch.zeros(64 * 60000, dtype=torch.uint8, device="cuda")
    s = torch.cuda.Stream()
    a = args(MiB, 77, 0)
    with phx.open(path, "r") as f:
        with torch.cuda.stream(s):
            sleep_stream(50)
            ctx.stream_deferred(f._c_file, dst.data_ptr(), a.ctypes.data, False, s.cuda_stream)
            b = ctx.submit_batch(f._c_file, many.data_ptr(),
                                 [i * 100000 + 3 for i in range(64)],
                                 [i * 60000 for i in range(64)], [60000] * 64, False,
                                 after_stream=s.cuda_stream)
        res = b.wait(30)
        s.synchronize()
    assert a[3] == MiB and res == [60000] * 64
    got = host(many)
    for i in range(64):
        assert (got[i * 60000:(i + 1) * 60000] == data[i * 100000 + 3:i * 100000 + 3 + 60000]).all()
    assert (host(dst) == data[77:77 + MiB]).all()
    ctx.close()


def test_device_synchronising_calls_in_another_thread(data_dir, rng):
    """Another thread frees, allocates and synchronises the device over and
    over (cudaFree, a growing caching allocator) while stream ops and
    host-async reads run: everything completes, byte-exact."""
    path, data = make(data_dir, rng, 64 * MiB)
    ctx = phx.gpu.context(_new=True)
    stop = threading.Event()

    def churn():
        while not stop.is_set():
            x = torch.empty(int(rng.integers(1, 64)) * MiB, dtype=torch.uint8, device="cuda")
            del x
            torch.cuda.empty_cache()
            torch.cuda.synchronize()

    t = threading.Thread(target=churn, daemon=True)
    t.start()
    try:
        s = torch.cuda.Stream()
        buf = torch.zeros(64 * MiB, dtype=torch.uint8, device="cuda")
        with phx.open(path, "r") as f:
            for rnd in range(8):
                aa = [args(MiB, i * MiB + rnd, i * MiB) for i in range(32)]
                for a in aa:
                    ctx.stream_deferred(f._c_file, buf.data_ptr(), a.ctypes.data, False,
                                        s.cuda_stream)
                b = ctx.submit_batch(f._c_file, buf.data_ptr() + 32 * MiB,
                                     [i * MiB for i in range(32)],
                                     [i * MiB for i in range(32)], [MiB] * 32, False)
                assert b.wait(60) == [MiB] * 32
                s.synchronize()
                assert all(a[3] == MiB for a in aa)
                got = host(buf)
                for i in range(32):
                    assert (got[i * MiB:(i + 1) * MiB] == data[i * MiB + rnd:(i + 1) * MiB + rnd]).all()
                assert (got[32 * MiB:] == data[:32 * MiB]).all()
    finally:
        stop.set()
        t.join(30)
    ctx.close()


_SEGMENTS = textwrap.dedent(r"""
    import ctypes, os, sys
    import numpy as np, torch, phx, phx.gpu
    path, n = sys.argv[1], int(sys.argv[2])
    big = torch.zeros(3 << 30, dtype=torch.uint8, device="cuda")
    lib = ctypes.CDLL("libcuda.so.1")
    base, size = ctypes.c_uint64(), ctypes.c_size_t()
    p = big.data_ptr() + (1 << 30)
    assert lib.cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(size), ctypes.c_uint64(p)) == 0
    segs = (big.data_ptr() + big.numel() - base.value + size.value - 1) // size.value
    data = np.fromfile(path, dtype=np.uint8)
    view = big[(1 << 30) - 12345:(1 << 30) - 12345 + n]
    s = torch.cuda.Stream()
    with phx.open(path, "r") as f:
        op = phx.gpu.read_async(view, f, 3, stream=s)
        s.synchronize()
        r1 = op.result()
        ok1 = bool((view.cpu().numpy() == data[3:3 + n]).all())
        view.zero_()
        r2 = f.pread(view, 5)
        ok2 = bool((view.cpu().numpy() == data[5:5 + n]).all())
    print("segment", size.value, "segments-after", segs, "results", r1, r2, "ok", ok1, ok2)
""")


def test_expandable_segments(data_dir, rng):
    """PyTorch's expandable segments map a big tensor as many VMM chunks;
    cuMemGetAddressRange reports one.  Reads into a view that spans chunks
    work, stream-ordered and host-async."""
    n = 200 * MiB + 3
    path, _ = make(data_dir, rng, n + 8)
    env = dict(os.environ, PYTORCH_CUDA_ALLOC_CONF="expandable_segments:True")
    r = subprocess.run([sys.executable, "-c", _SEGMENTS, path, str(n)], env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    line = [l for l in r.stdout.splitlines() if l.startswith("segment")][0]
    parts = line.split()
    seg = int(parts[1])
    assert seg < n, f"the chunk is {seg} bytes: the view does not span chunks ({line})"
    assert parts[5:7] == [str(n), str(n)] and parts[8:10] == ["True", "True"], line


_BROKEN = textwrap.dedent(r"""
    import sys, time
    import numpy as np, torch, cupy, phx, phx.gpu
    path = sys.argv[1]
    ctx = phx.gpu.context(_new=True)
    t = torch.zeros(1 << 20, dtype=torch.uint8, device="cuda")
    s = torch.cuda.Stream()
    bad = cupy.RawKernel(r'extern "C" __global__ void f(int *p) { *p = 1; }', "f")
    aa = [np.array([4096, 0, 0, -999], dtype=np.int64) for _ in range(4)]
    with phx.open(path, "r") as f:
        with torch.cuda.stream(s):
            torch.cuda._sleep(int(100e6))
        with cupy.cuda.ExternalStream(s.cuda_stream):
            bad((1,), (1,), (np.uint64(16),))      # faults when the stream gets there
        for a in aa:
            ctx.stream_deferred(f._c_file, t.data_ptr(), a.ctypes.data, False, s.cuda_stream)
        t0 = time.monotonic()
        ctx.close()                                # must not wait forever
        print("closed-after", round(time.monotonic() - t0, 2), "results", [int(a[3]) for a in aa])
""")


def test_fault_on_the_stream_does_not_hang(data_dir, rng):
    """A kernel that faults (an illegal address: a sticky error) queued before
    stream ops: the ops end with an error and the context closes."""
    pytest.importorskip("cupy")
    path, _ = make(data_dir, rng, MiB)
    r = subprocess.run([sys.executable, "-c", _BROKEN, path], capture_output=True, text=True,
                       timeout=120)
    line = [l for l in r.stdout.splitlines() if l.startswith("closed-after")]
    assert line, r.stdout + r.stderr
    parts = line[0].split()
    assert float(parts[1]) < 30, line
    res = [int(x.strip("[],")) for x in parts[3:]]
    assert res and all(x < 0 for x in res), line


def test_early_reads_against_a_writer_through_another_handle(data_dir, rng):
    """Early reads on: a 1 GiB write through a host handle of the same file is
    in flight when a stream read of its tail is queued (the stream held until
    the write is done): the read returns the new bytes."""
    n = GiB
    path, _ = make(data_dir, rng, n)
    new = rand(rng, n)
    ctx = phx.gpu.context(_new=True, early_reads=True)
    size = 3 * MiB + 11
    foff = n - size - 5
    dst = torch.zeros(size, dtype=torch.uint8, device="cuda")
    s = torch.cuda.Stream()
    a = args(size, foff, 0)
    gate = threading.Event()
    with phx.open(path, "r+") as w, phx.open(path, "r") as f:
        buf = phx.empty_aligned(n)
        memoryview(buf)[:] = new.tobytes()
        th = threading.Thread(target=lambda: (w.pwrite(buf, 0), gate.set()))
        th.start()
        time.sleep(0.005)
        with torch.cuda.stream(s):
            sleep_stream(2000)                 # well past the write (~1 s on the disk)
        ctx.stream_deferred(f._c_file, dst.data_ptr(), a.ctypes.data, False, s.cuda_stream)
        th.join()
        s.synchronize()
    assert gate.is_set()
    assert a[3] == size
    assert (host(dst) == new[foff:foff + size]).all(), "an early read served bytes from before the write"
    ctx.close()


def test_failed_write_is_never_served(tmp_path, rng):
    """ENOSPC on a small filesystem (tmpfs, root): the failed stream write's
    range is refused to every later read (-EIO, the destination untouched)
    until it is written again successfully."""
    if os.geteuid() != 0:
        pytest.skip("needs root to mount a small tmpfs")
    mnt = tmp_path / "small"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16M", "tmpfs", str(mnt)]).returncode:
        pytest.skip("cannot mount tmpfs")
    try:
        ctx = phx.gpu.context(_new=True)
        src = torch.from_numpy(rand(rng, 4 * MiB)).cuda()
        dst = torch.full((4 * MiB,), 0x5A, dtype=torch.uint8, device="cuda")
        s = torch.cuda.Stream()
        with phx.open(str(mnt / "slab.bin"), "w+") as f:
            assert f.pwrite(src[:MiB], 0) == MiB
            with open(mnt / "filler", "wb") as fill:
                try:
                    while True:
                        fill.write(b"\0" * MiB)
                        fill.flush()
                except OSError:
                    pass
            w = args(4 * MiB, 8 * MiB, 0)
            ctx.stream_deferred(f._c_file, src.data_ptr(), w.ctypes.data, True, s.cuda_stream)
            s.synchronize()
            assert w[3] == -errno.ENOSPC, w[3]
            r = args(MiB, 9 * MiB, 0)
            ctx.stream_deferred(f._c_file, dst.data_ptr(), r.ctypes.data, False, s.cuda_stream)
            s.synchronize()
            assert r[3] == -errno.EIO, r[3]
            with pytest.raises(OSError) as ei:
                f.pread(dst[:4096], 8 * MiB + 100)
            assert ei.value.errno == errno.EIO
            assert (host(dst) == 0x5A).all(), "a refused read wrote the destination"
            assert ctx.stats()["bad_marks"] >= 1 and ctx.stats()["bad_refusals"] >= 1
            os.unlink(mnt / "filler")
            ctx.stream_deferred(f._c_file, src.data_ptr(), w.ctypes.data, True, s.cuda_stream)
            s.synchronize()
            assert w[3] == 4 * MiB
            r[3] = -999
            ctx.stream_deferred(f._c_file, dst.data_ptr(), r.ctypes.data, False, s.cuda_stream)
            s.synchronize()
            assert r[3] == MiB and (host(dst)[:MiB] == host(src)[MiB:2 * MiB]).all()
        ctx.close()
    finally:
        subprocess.run(["umount", str(mnt)])
