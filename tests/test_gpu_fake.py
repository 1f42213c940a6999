"""libphx's GPU path on a machine without a GPU, against a fake libcuda.

``tests/gpu_fake/fake_cuda.c`` is a test double of the CUDA driver: host
memory as "device" memory, a thread per stream, one shared callback thread
(as CUDA has).  It lets the request life cycle run everywhere: byte checks
of batches and stream-ordered calls with deferred arguments, end of file
judged at arrival, EBUSY on close, destroy with queued work, no blocking
host function.  It proves the logic, not CUDA itself: the same properties
are tested on a real GPU by tests/test_gpu.py.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FAKE = os.path.join(ROOT, "tests", "gpu_fake")


def _liburing_flags() -> list[str] | None:
    root = os.environ.get("PHX_LIBURING_ROOT")
    if root:
        return [f"-I{root}/usr/include", f"{root}/usr/lib/x86_64-linux-gnu/liburing.a"]
    if os.path.exists("/usr/include/liburing.h"):
        return ["-luring"]
    return None


@pytest.fixture(scope="module")
def fake_build(tmp_path_factory):
    cc = shutil.which("cc") or shutil.which("gcc")
    uring = _liburing_flags()
    if not cc or uring is None:
        pytest.skip("needs a C compiler and liburing headers")
    d = tmp_path_factory.mktemp("fakecuda")
    subprocess.run([cc, "-shared", "-fPIC", "-O1", "-o", str(d / "libcuda.so.1"),
                    os.path.join(FAKE, "fake_cuda.c"), "-lpthread"], check=True)
    src = [os.path.join(ROOT, "libphx", "src", f)
           for f in sorted(os.listdir(os.path.join(ROOT, "libphx", "src"))) if f.endswith(".c")]
    for name, extra in (("cuda_fake_test", []),
                        # AddressSanitizer: use-after-free, double free and leaks of
                        # the request life cycle (gcc's libasan, with gcc on Debian)
                        ("cuda_fake_test_asan", ["-fsanitize=address",
                                                 "-fno-omit-frame-pointer"])):
        subprocess.run([cc, "-O1", "-g", *extra, "-D_GNU_SOURCE", f"-I{ROOT}/libphx/include",
                        f"-I{ROOT}/libphx/src", f"-I{ROOT}/kernel/include/uapi",
                        "-o", str(d / name), os.path.join(FAKE, "cuda_fake_test.c"),
                        *src, *uring, "-ldl", "-lpthread"], check=True)
    return d


@pytest.fixture
def small_fs(tmp_path):
    """An 8 MiB tmpfs (root): the ENOSPC test's full filesystem, or None."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    if os.geteuid() != 0 or subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=8M", "tmpfs", str(mnt)],
            capture_output=True).returncode != 0:
        yield None
        return
    try:
        yield str(mnt)
    finally:
        subprocess.run(["umount", str(mnt)], capture_output=True)


@pytest.mark.parametrize("mode", ["batch-copy", "no-batch-copy", "devices-2", "devices-3", "asan",
                                  "early", "asan-early", "broken", "asan-broken",
                                  "asan-partly"])
def test_c_api_against_fake_cuda(fake_build, tmp_path, small_fs, mode):
    """cuda_fake_test.c; with devices-N it runs its one-process, N-device tests
    (a context per device, a thread feeding each, EXDEV across devices, staging
    on the device's NUMA node through a fake sysfs) instead of the others; asan
    runs the single-device tests built with AddressSanitizer (leaks included);
    early with every context's early reads on (PHX_CUDA_EARLY_READS=1); broken
    only the faulting-kernel test (it kills the fake's context); partly the
    partly-queued-op test 200 times (its kill raced lanes about once in a
    hundred rounds before the fix: two use-after-frees).  batch-copy
    runs the early-reads-against-a-writer test with the issue's 1 GiB write
    (64 MiB elsewhere), and every single-device mode the ENOSPC test on an
    8 MiB tmpfs (root)."""
    env = dict(os.environ, LD_LIBRARY_PATH=str(fake_build))
    env.pop("PHX_TEST_SYSFS_ROOT", None)
    if mode == "no-batch-copy":
        env["FAKE_CUDA_NO_BATCH"] = "1"
    if mode.startswith("devices-"):
        env["FAKE_CUDA_DEVICES"] = mode.split("-")[1]
    if mode.endswith("early"):
        env["PHX_CUDA_EARLY_READS"] = "1"
    if mode.endswith("broken"):
        env["PHX_FAKE_TEST"] = "broken"
    if mode.endswith("partly"):
        env["PHX_FAKE_TEST"] = "partly"
    if mode == "batch-copy":
        env["PHX_TEST_BIG_WRITE"] = str(1 << 30)
    if small_fs:
        env["PHX_TEST_SMALLFS"] = small_fs
    elif os.geteuid() == 0 and not mode.startswith("devices-"):
        pytest.fail("cannot mount the 8 MiB tmpfs the ENOSPC test needs")
    exe = "cuda_fake_test_asan" if mode.startswith("asan") else "cuda_fake_test"
    r = subprocess.run([str(fake_build / exe), str(tmp_path)], env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "all passed" in r.stdout
    if small_fs and not mode.startswith("devices-") and not mode.endswith(("broken", "partly")):
        assert "skip failed_write_is_never_data" not in r.stdout


def run_script(script: str, fake_build, tmp_path) -> str:
    """Run ``script`` (argv[1]: ``tmp_path``) in a Python whose libcuda.so.1
    is the fake; its stdout, once it exited 0."""
    try:
        import phx._lib.cuda  # noqa: F401
    except ImportError as e:
        pytest.skip(f"phx built without its GPU module: {e}")
    env = dict(os.environ, LD_LIBRARY_PATH=str(fake_build))
    r = subprocess.run([sys.executable, "-c", script, str(tmp_path)], env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout


PY_CHECK = textwrap.dedent(r"""
    import ctypes, os, sys, time
    import numpy as np
    import phx
    from phx._lib import cuda
    lib = ctypes.CDLL("libcuda.so.1")
    assert lib.fake_sleep_async, "not the fake"
    ok, why = cuda.available()
    assert ok, why
    def alloc(n):
        p = ctypes.c_uint64()
        assert lib.cuMemAlloc_v2(ctypes.byref(p), ctypes.c_size_t(n)) == 0
        return p.value
    def view(p, n):
        return np.ctypeslib.as_array((ctypes.c_ubyte * n).from_address(p))
    d = sys.argv[1]
    rng = np.random.default_rng(int.from_bytes(os.urandom(8), "little"))
    data = rng.integers(0, 256, 5 << 20, dtype=np.uint8)
    path = os.path.join(d, "f.bin")
    data.tofile(path)
    eng = phx.Engine()
    ctx = cuda.Context(eng, 0, lanes=2, bufs_per_lane=2, buf_size=256 << 10)
    n = 400
    sizes = rng.integers(1, 70000, n)
    foffs = rng.integers(0, len(data) - 70000, n)
    boffs = np.cumsum(np.concatenate([[3], sizes[:-1] + 1]))
    buf = alloc(int(boffs[-1] + sizes[-1] + 8))
    with phx.open(path, "r+", engine=eng) as f:
        b = ctx.submit_batch(f._c_file, buf, foffs, boffs, sizes, False)
        res = b.wait()
        assert res == [int(s) for s in sizes], res[:5]
        v = view(buf, int(boffs[-1] + sizes[-1]))
        for i in range(n):
            o, s, fo = int(boffs[i]), int(sizes[i]), int(foffs[i])
            assert (v[o:o + s] == data[fo:fo + s]).all(), i
        # deferred arguments through the Cython wrapper
        s = ctypes.c_void_p()
        assert lib.cuStreamCreate(ctypes.byref(s), 1) == 0
        args = np.array([10, 0, 0, -1], dtype=np.int64)
        # the stream held on a host word, not a timed sleep: a stalled CI host
        # must not let it reach the op before the arguments are written
        gate = ctypes.c_uint32(0)
        assert lib.cuStreamWaitValue32_v2(s, ctypes.c_uint64(ctypes.addressof(gate)),
                                          ctypes.c_uint32(1), 0) == 0
        try:
            ctx.stream_deferred(f._c_file, buf, args.ctypes.data, False, s.value)
            args[:3] = [123457, 4099, 17]
        finally:
            gate.value = 1
        lib.cuStreamSynchronize(s)
        assert args[3] == 123457, args
        v = view(buf, 17 + 123457)
        assert (v[17:] == data[4099:4099 + 123457]).all()
        st = ctx.stats()
        assert st["memcpy_calls"] < n // 4, st
        assert st["early_reads"] == 0, st          # off unless asked for
        # early reads asked for through the Python layer: reads behind a busy stream
        ectx = cuda.Context(eng, 0, lanes=2, bufs_per_lane=2, buf_size=256 << 10,
                            early_reads=True)
        assert ectx.config["early_reads"] is True
        eargs = [np.array([5000 + i, 77 * i, 6000 * i, -1], dtype=np.int64) for i in range(8)]
        gate = ctypes.c_uint32(0)
        assert lib.cuStreamWaitValue32_v2(s, ctypes.c_uint64(ctypes.addressof(gate)),
                                          ctypes.c_uint32(1), 0) == 0
        fills0 = ectx.stats()["staging_fills"]
        try:
            for a in eargs:
                ectx.stream_deferred(f._c_file, buf, a.ctypes.data, False, s.value)
            # with the stream held, wait for the lanes to take reads early
            # (counted as early_reads when the stream gets there)
            t_end = time.monotonic() + 10
            while (ectx.stats()["staging_fills"] - fills0 < 4
                   and time.monotonic() < t_end):
                time.sleep(0.001)
        finally:
            gate.value = 1
        lib.cuStreamSynchronize(s)
        v = view(buf, 6000 * 8)
        for i, a in enumerate(eargs):
            assert a[3] == 5000 + i, a
            assert (v[6000 * i:6000 * i + 5000 + i] == data[77 * i:77 * i + 5000 + i]).all(), i
        assert ectx.stats()["early_reads"] >= 4, ectx.stats()
        ectx.close()
    ctx.close()
    print("python ok")
""")


def test_python_layer_against_fake_cuda(fake_build, tmp_path):
    assert "python ok" in run_script(PY_CHECK, fake_build, tmp_path)


SHARED_BLOCKS = textwrap.dedent(r"""
    import ctypes, os, sys, threading
    import numpy as np
    import phx
    from phx._lib import cuda
    lib = ctypes.CDLL("libcuda.so.1")
    d = sys.argv[1]
    rng = np.random.default_rng(int.from_bytes(os.urandom(8), "little"))
    nblocks = 256
    path = os.path.join(d, "shared.bin")
    p = ctypes.c_uint64()
    assert lib.cuMemAlloc_v2(ctypes.byref(p), ctypes.c_size_t(nblocks * 4096)) == 0
    engines = [phx.Engine(), phx.Engine()]
    ctx = cuda.Context(phx.Engine(), 0, lanes=4, bufs_per_lane=2, buf_size=256 << 10)
    errors = []
    def host(k):
        global cuts, payload
        try:
            with phx.open(path, "r+", engine=engines[k]) as f:
                for b in range(nblocks):
                    lo = b * 4096 + (0 if k == 0 else int(cuts[b, 0]))
                    hi = b * 4096 + int(cuts[b, 0] if k == 0 else cuts[b, 1])
                    assert f.pwrite(payload[lo:hi], lo) == hi - lo
        except Exception as e:
            errors.append(e)
    def gpu():
        try:
            with phx.open(path, "r+") as f:
                lo = np.array([b * 4096 + int(cuts[b, 1]) for b in range(nblocks)])
                sz = 4096 - cuts[:, 1]
                b = ctx.submit_batch(f._c_file, p.value, lo, lo, sz, True)
                assert b.wait() == [int(x) for x in sz]
        except Exception as e:
            errors.append(e)
    for attempt in range(5):
        # fresh bytes every time, or a lost update would restore equal bytes
        want = rng.integers(0, 256, nblocks * 4096 + 100, dtype=np.uint8)
        want.tofile(path)
        cuts = np.sort(rng.integers(1, 4095, (nblocks, 2)), axis=1)
        cuts[:, 1] = np.maximum(cuts[:, 1], cuts[:, 0] + 1)
        payload = rng.integers(0, 256, nblocks * 4096, dtype=np.uint8)
        ctypes.memmove(p.value, payload.ctypes.data, payload.size)
        th = [threading.Thread(target=host, args=(0,)), threading.Thread(target=host, args=(1,)),
              threading.Thread(target=gpu)]
        for t in th: t.start()
        for t in th: t.join()
        assert not errors, errors
        want[:nblocks * 4096] = payload
        got = np.fromfile(path, dtype=np.uint8)
        bad = int((got != want).sum())
        if bad:
            break
    ctx.close()
    print("bad bytes", bad)
    sys.exit(1 if bad else 0)
""")


def test_host_handles_and_gpu_lanes_share_partial_block_claims(fake_build, tmp_path):
    """Issue 9 on the fake: two host handles on their own engines and the GPU
    lanes write disjoint, unaligned bytes of the same 4 KiB blocks at once."""
    run_script(SHARED_BLOCKS, fake_build, tmp_path)


STREAM_LOOP = textwrap.dedent(r"""
    import ctypes, os, sys, threading
    import numpy as np
    import phx
    from phx._lib import cuda
    lib = ctypes.CDLL("libcuda.so.1")
    assert lib.fake_sleep_async, "not the fake"
    d2h = ctypes.cast(lib.cuMemcpyDtoHAsync_v2, ctypes.c_void_p).value
    d = sys.argv[1]
    rng = np.random.default_rng(int.from_bytes(os.urandom(8), "little"))
    data = rng.integers(1, 256, 6 << 20, dtype=np.uint8)     # never zeros
    path = os.path.join(d, "loop.bin")
    data.tofile(path)
    eng = phx.Engine()
    ctx = cuda.Context(eng, 0, lanes=3, bufs_per_lane=2, buf_size=256 << 10, early_reads=True)
    nthreads, per, probe = 4, 50, 512
    n = nthreads * per
    sizes = rng.integers(probe, 90000, n)                     # unaligned sizes and places
    foffs = rng.integers(0, len(data) - 90000, n)
    boffs = np.cumsum(np.concatenate([[5], sizes[:-1] + 3]))
    total = int(boffs[-1] + sizes[-1] + 8)
    buf = ctypes.c_uint64()
    assert lib.cuMemAlloc_v2(ctypes.byref(buf), ctypes.c_size_t(total)) == 0
    gpu = np.ctypeslib.as_array((ctypes.c_ubyte * total).from_address(buf.value))
    gpu[:] = 0
    args = np.stack([sizes, foffs, boffs, np.full(n, -1)], axis=1).astype(np.int64)
    probes = np.zeros((n, probe), dtype=np.uint8)
    errors = []
    def loop(i, f, write, sleep_us):
        try:
            s = ctypes.c_void_p()
            assert lib.cuStreamCreate(ctypes.byref(s), 1) == 0
            lib.fake_sleep_async(s, ctypes.c_ulong(sleep_us))   # ops queue behind a busy stream
            lo = i * per
            got = ctx.stream_loop(f._c_file, buf.value, args.ctypes.data + lo * 32, per, write,
                                  s.value, 0 if write else d2h,
                                  probes.ctypes.data + lo * probe, probe)
            assert got == per
            assert lib.cuStreamSynchronize(s) == 0
        except Exception as e:
            errors.append(e)
    def run(f, write):
        th = [threading.Thread(target=loop, args=(i, f, write, 20000 * (i % 2)))
              for i in range(nthreads)]
        for t in th: t.start()
        for t in th: t.join()
        assert not errors, errors
    with phx.open(path, "r+", engine=eng) as f:
        run(f, False)
        assert (args[:, 3] == sizes).all(), args[args[:, 3] != sizes][:3]
        for k in range(n):
            o, sz, fo = int(boffs[k]), int(sizes[k]), int(foffs[k])
            assert (gpu[o:o + sz] == data[fo:fo + sz]).all(), k
            # the copy queued behind read k saw read k's bytes
            assert (probes[k] == data[fo:fo + probe]).all(), k
        # stores from the same loop: fresh bytes to distinct, non-overlapping places
        wsz = np.minimum(20000 + rng.integers(0, 4096, n), sizes)   # inside the allocation
        wfo = np.cumsum(np.concatenate([[11], wsz[:-1] + 500]))
        assert wfo[-1] + wsz[-1] < len(data)
        args[:] = np.stack([wsz, wfo, boffs, np.full(n, -1)], axis=1)
        gpu[:] = rng.integers(1, 256, total, dtype=np.uint8)
        src = gpu.copy()
        run(f, True)
        assert (args[:, 3] == wsz).all(), (args[args[:, 3] != wsz][:3], wsz[args[:, 3] != wsz][:3])
        f.fsync()
    back = np.fromfile(path, dtype=np.uint8)
    for k in range(n):
        assert (back[wfo[k]:wfo[k] + wsz[k]] == src[boffs[k]:boffs[k] + wsz[k]]).all(), k
    # arguments are read when the stream gets there: a bad size is that op's
    # error result, the others' bytes arrive; memory phx cannot map raises
    with phx.open(path, "r", engine=eng) as f:
        bad = np.array([[4096, 0, 0, -1], [4096, 4096, 8192, -1], [-5, 0, 0, -1]], np.int64)
        s = ctypes.c_void_p()
        assert lib.cuStreamCreate(ctypes.byref(s), 1) == 0
        assert ctx.stream_loop(f._c_file, buf.value, bad.ctypes.data, 3, False, s.value) == 3
        assert lib.cuStreamSynchronize(s) == 0
        assert list(bad[:2, 3]) == [4096, 4096] and bad[2, 3] < 0, bad
        try:
            ctx.stream_loop(f._c_file, 4096, bad.ctypes.data, 1, False, s.value)
            raise SystemExit("memory that is not the GPU's was queued")
        except OSError as e:
            assert "stream op 0 of 1" in str(e), e
        lib.cuStreamSynchronize(s)
    ctx.close()
    print("stream loop ok")
""")


def test_stream_loop_against_fake_cuda(fake_build, tmp_path):
    """Context.stream_loop (the stream bench's GIL-free rows): four threads,
    a stream each (two of them busy when their ops are queued), 200 reads of
    unaligned sizes and places with a device-to-host copy of each chunk's
    head queued behind it, then 200 stores; every byte and every copy
    checked, a bad op raised with its index."""
    assert "stream loop ok" in run_script(STREAM_LOOP, fake_build, tmp_path)
