"""Issue 29: many small pieces (8-64 KiB KV blocks) into and out of the GPU by
arrays, against the fake libcuda (``tests/gpu_fake/fake_cuda.c``: "device"
memory is host memory, so every byte is compared with the file).

* the C calls (``phx_cuda_many*``, PHX_0.8): ``tests/gpu_fake/cuda_many_test.c``,
  plain and under AddressSanitizer: argument checks that queue nothing,
  thousands of random unaligned pieces (exact bytes, packed buffers, every
  phase counter seen), writes, stream-ordered pieces behind a busy stream,
  an injected bad range (-EIO, no GPU byte of a failed piece written) and
  injected copy errors (the fake refusing copies to some GPU places), with
  and without cuMemcpyBatchAsync;
* the Python layer (``phx.gpu.pread_many`` / ``pwrite_many`` /
  ``read_many_async`` / ``write_many_async``, ``File.pread_many`` with a GPU
  buffer, :mod:`phx.blocks`): the same properties, threads that never touched
  CUDA, ValueErrors for bad arrays, and a write that failed (ENOSPC on an
  8 MiB tmpfs, root only) whose pieces must never read back as data.

It proves the logic, not CUDA: unverified on a real GPU.
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
def many_build(tmp_path_factory, fake_libcuda):
    """cuda_many_test.c against libphx's sources, plain and with ASan."""
    cc = shutil.which("cc") or shutil.which("gcc")
    uring = _liburing_flags()
    if not cc or uring is None:
        pytest.skip("needs a C compiler and liburing headers")
    d = tmp_path_factory.mktemp("manytest")
    src = [os.path.join(ROOT, "libphx", "src", f)
           for f in sorted(os.listdir(os.path.join(ROOT, "libphx", "src"))) if f.endswith(".c")]
    for name, extra in (("many", []), ("many_asan", ["-fsanitize=address",
                                                      "-fno-omit-frame-pointer"])):
        subprocess.run([cc, "-O1", "-g", *extra, "-D_GNU_SOURCE", f"-I{ROOT}/libphx/include",
                        f"-I{ROOT}/libphx/src", f"-I{ROOT}/kernel/include/uapi",
                        "-o", str(d / name), os.path.join(FAKE, "cuda_many_test.c"),
                        *src, *uring, "-ldl", "-lpthread"], check=True)
    return d


@pytest.mark.parametrize("exe,batch", [("many", True), ("many", False), ("many_asan", True)])
def test_c_many_against_fake_cuda(many_build, fake_libcuda, tmp_path, exe, batch):
    """cuda_many_test.c; without cuMemcpyBatchAsync (FAKE_CUDA_NO_BATCH) the
    copies go one per piece, and an injected copy error hits single calls."""
    env = dict(os.environ, LD_LIBRARY_PATH=str(fake_libcuda))
    if not batch:
        env["FAKE_CUDA_NO_BATCH"] = "1"
    r = subprocess.run([str(many_build / exe), str(tmp_path)], env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "all passed" in r.stdout


# The fake device memory both scripts use: what CuPy or Numba hand phx.gpu (an
# address, a size, no stream), and the host view the fake gives of it.
_DEV = textwrap.dedent(r"""
    class Dev:
        def __init__(self, n):
            p = ctypes.c_uint64()
            assert lib.cuMemAlloc_v2(ctypes.byref(p), ctypes.c_size_t(n)) == 0
            self.ptr, self.n = p.value, n
            self.__cuda_array_interface__ = {"data": (p.value, False), "shape": (n,),
                                             "typestr": "|u1", "version": 3, "stream": None}
        def host(self):
            return np.ctypeslib.as_array((ctypes.c_ubyte * self.n).from_address(self.ptr))
""").lstrip("\n")


PY_MANY = textwrap.dedent(r"""
    import ctypes, errno, os, sys, threading
    import numpy as np
    import phx, phx.gpu
    from phx.blocks import vllm_block_pieces

    lib = ctypes.CDLL("libcuda.so.1")
    assert lib.fake_sleep_async, "not the fake"
    d = sys.argv[1]
    rng = np.random.default_rng(int.from_bytes(os.urandom(8), "little"))

    __DEV__

    def plan(n, maxlen, fsize):
        # random unaligned pieces, shuffled back to back in the GPU buffer with gaps
        lens = rng.integers(1, maxlen + 1, n)
        fo = rng.integers(0, fsize - maxlen, n)
        order = rng.permutation(n)
        bo = np.empty(n, dtype=np.int64)
        at = 5
        for i in order:
            bo[i] = at
            at += int(lens[i]) + int(rng.integers(0, 8))
        return fo, bo, lens, at + 8

    eng = phx.Engine()
    ctx = phx.gpu.context(eng, 0, lanes=3, bufs_per_lane=2, buf_size=256 << 10)
    fsize = (12 << 20) + 4093
    data = rng.integers(1, 256, fsize, dtype=np.uint8)   # never 0
    path = os.path.join(d, "kv.bin")
    data.tofile(path)

    with phx.open(path, "r+", engine=eng) as f:
        # --- reads: 8-64 KiB-ish pieces, exact bytes, gaps untouched
        for maxlen in (8 << 10, 64 << 10):
            fo, bo, lens, need = plan(1500, maxlen, fsize)
            buf = Dev(need)
            buf.host()[:] = 0
            st0 = ctx.stats()
            res = phx.gpu.pread_many(buf, f, fo, lens, bo)
            st1 = ctx.stats()
            assert res.dtype == np.int64 and (res == lens).all()
            h = buf.host()
            for i in range(len(fo)):
                assert (h[bo[i]:bo[i] + lens[i]] == data[fo[i]:fo[i] + lens[i]]).all(), i
            assert (h[:5] == 0).all()
            assert int((h != 0).sum()) == int(lens.sum())   # nothing but the pieces
            assert st1["many_pieces"] - st0["many_pieces"] == len(fo)
            assert st1["staging_fills"] - st0["staging_fills"] < len(fo) // 4, (st0, st1)
            for k in ("ph_call_ns", "ph_pack_ns", "ph_submit_ns", "ph_io_ns", "ph_copy_ns",
                      "ph_done_ns"):
                assert st1[k] > st0[k], k
        # File.pread_many routes GPU memory here (one nbytes for all, packed back to back)
        buf = Dev(300 * 8192)
        offs = rng.choice(fsize // 8192 - 1, 300, replace=False) * 8192 + 17
        res = f.pread_many(buf, offs, 8192)
        assert (res == 8192).all()
        h = buf.host()
        for i, o in enumerate(offs):
            assert (h[i * 8192:(i + 1) * 8192] == data[o:o + 8192]).all(), i
        # --- bad arrays: ValueError, nothing queued
        st0 = ctx.stats()
        small = Dev(1000)
        for args, what in (
                (([0, 10], [0, 100], [10]), "offsets but"),
                (([0], [995], [10]), "run past"),
                (([-1], [0], [10]), "negative"),
                (([0, 100], [0, 50], [100, 10]), "overlap"),
        ):
            fo_, bo_, ln_ = args
            try:
                phx.gpu.pread_many(small, f, fo_, ln_, bo_)
            except ValueError as e:
                assert what in str(e), (what, e)
            else:
                raise AssertionError(f"accepted: {what}")
        try:  # two writes to one file byte
            phx.gpu.pwrite_many(small, f, [0, 5], [10, 10], [0, 100])
        except ValueError as e:
            assert "overlap" in str(e)
        else:
            raise AssertionError("overlapping writes accepted")
        phx.gpu.pwrite_many(small, f, [0, 100], [10, 10], [0, 5])  # GPU overlap is fine
        data[0:10] = small.host()[0:10]
        data[100:110] = small.host()[5:15]
        assert ctx.stats()["many_pieces"] - st0["many_pieces"] == 2

        # --- writes: distinct file slots, read back from the file
        n = 1200
        slot = fsize // n
        lens = rng.integers(1, min(slot, 40000) + 1, n)
        fo = np.arange(n) * slot + rng.integers(0, slot - lens + 1)
        bo = np.concatenate([[3], np.cumsum(lens[:-1] + 1) + 3])
        src = Dev(int(bo[-1] + lens[-1] + 8))
        src.host()[:] = rng.integers(1, 256, src.n, dtype=np.uint8)
        res = phx.gpu.pwrite_many(src, f, fo, lens, bo)
        assert (res == lens).all()
        for i in range(n):
            data[fo[i]:fo[i] + lens[i]] = src.host()[bo[i]:bo[i] + lens[i]]
        assert (np.fromfile(path, dtype=np.uint8) == data).all()

        # --- threads that never touched CUDA, each its own buffer, at once
        errors = []
        def worker(k):
            try:
                fo_, bo_, ln_, need_ = plan(400, 32 << 10, fsize)
                b = Dev(need_)
                for _ in range(3):
                    r = phx.gpu.pread_many(b, f, fo_, ln_, bo_)
                    assert (r == ln_).all()
                    hh = b.host()
                    for i in range(len(fo_)):
                        assert (hh[bo_[i]:bo_[i] + ln_[i]] == data[fo_[i]:fo_[i] + ln_[i]]).all()
            except BaseException as e:
                errors.append(e)
        th = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
        for t in th: t.start()
        for t in th: t.join()
        assert not errors, errors

        # --- stream-ordered: behind a held stream, arrays copied at the call.
        # The stream waits on a host word (not a timed sleep: a CI host that
        # stalls the process for 100 ms must not make the check fail).
        s = ctypes.c_void_p()
        assert lib.cuStreamCreate(ctypes.byref(s), 1) == 0
        fo, bo, lens, need = plan(600, 16 << 10, fsize)
        buf = Dev(need)
        buf.host()[:] = 0
        gate = ctypes.c_uint32(0)
        assert lib.cuStreamWaitValue32_v2(s, ctypes.c_uint64(ctypes.addressof(gate)),
                                          ctypes.c_uint32(1), 0) == 0
        fo_ref = fo.copy()
        try:
            op = phx.gpu.read_many_async(buf, f, fo, lens, bo, stream=s.value)
            pending = int((op.results == -errno.EINPROGRESS).sum())
            fo[:] = 0                               # no effect: copied at the call
            early = int((buf.host() != 0).sum())    # bytes before the stream got there
        finally:
            gate.value = 1                          # never leave the stream held
        res = op.result(timeout=60)
        assert pending == len(fo) and early == 0, (pending, early)
        assert (res == lens).all()
        h = buf.host()
        for i in range(len(fo_ref)):
            assert (h[bo[i]:bo[i] + lens[i]] == data[fo_ref[i]:fo_ref[i] + lens[i]]).all(), i
        assert int((h != 0).sum()) == int(lens.sum())
        # a write queued on the stream, then a read on it, sees the write
        lib.fake_sleep_async(s, ctypes.c_ulong(50000))
        wfo = np.arange(100, dtype=np.int64) * 20000 + 3
        w = phx.gpu.write_many_async(buf, f, wfo, 9000, None, stream=s.value)
        back = Dev(100 * 9000)
        r = phx.gpu.read_many_async(back, f, wfo, 9000, None, stream=s.value)
        assert (w.result(timeout=60) == 9000).all() and (r.result(timeout=60) == 9000).all()
        assert (back.host() == buf.host()[:100 * 9000]).all()
        for i, o in enumerate(wfo):
            data[o:o + 9000] = buf.host()[i * 9000:(i + 1) * 9000]
        lib.cuStreamSynchronize(s)

        # --- vLLM blocks: layers x K/V, saved from one cache, loaded into another
        L, nb, bb = 4, 64, 16 << 10
        layer_stride, kv_stride = 2 * nb * bb + 4096, nb * bb
        cache = Dev(L * layer_stride)
        cache.host()[:] = rng.integers(1, 256, cache.n, dtype=np.uint8)
        ids = rng.choice(nb, 20, replace=False)
        fo, go, ln = vllm_block_pieces(ids, L, bb, layer_stride=layer_stride,
                                       kv_stride=kv_stride, file_base=4096)
        assert len(fo) == 20 * L * 2 and (np.diff(fo) == bb).all()
        assert (phx.gpu.pwrite_many(cache, f, fo, ln, go) == bb).all()
        other = Dev(cache.n)
        other.host()[:] = 0
        ids2 = rng.choice(nb, 20, replace=False)     # loaded into other block ids
        fo2, go2, ln2 = vllm_block_pieces(ids2, L, bb, layer_stride=layer_stride,
                                          kv_stride=kv_stride, file_base=4096)
        assert (f.pread_many(other, fo2, ln2, go2) == bb).all()
        ch, oh = cache.host(), other.host()
        for i in range(len(fo)):
            assert (oh[go2[i]:go2[i] + bb] == ch[go[i]:go[i] + bb]).all(), i
    ctx.close()
    print("python ok")
""").replace("__DEV__\n", _DEV)


def test_python_many_against_fake_cuda(fake_cuda, tmp_path):
    env = dict(os.environ, LD_LIBRARY_PATH=str(fake_cuda))
    r = subprocess.run([sys.executable, "-c", PY_MANY, str(tmp_path)], env=env,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "python ok" in r.stdout


PY_ENOSPC = textwrap.dedent(r"""
    import ctypes, errno, os, sys
    import numpy as np
    import phx, phx.gpu

    lib = ctypes.CDLL("libcuda.so.1")
    d = sys.argv[1]                     # an 8 MiB tmpfs
    rng = np.random.default_rng(int.from_bytes(os.urandom(8), "little"))

    __DEV__

    eng = phx.Engine()
    phx.gpu.context(eng, 0, lanes=2, bufs_per_lane=2, buf_size=256 << 10)
    path = os.path.join(d, "full.bin")
    n, bb = 400, 32 << 10               # 12.5 MiB of pieces into 8 MiB
    src = Dev(n * bb)
    src.host()[:] = rng.integers(1, 256, src.n, dtype=np.uint8)
    fo = np.arange(n, dtype=np.int64) * bb + 7
    with phx.open(path, "w+", engine=eng) as f:
        try:
            phx.gpu.pwrite_many(src, f, fo, bb, None)
        except OSError as e:
            assert e.errno == errno.ENOSPC, e
        else:
            raise AssertionError("12.5 MiB fitted an 8 MiB tmpfs")
        # which pieces failed: read them all back, each into a zeroed place
        dst = Dev(n * bb)
        dst.host()[:] = 0
        try:
            res = phx.gpu.pread_many(dst, f, fo, bb, None)
        except OSError as e:
            assert e.errno == errno.EIO, e
        else:
            raise AssertionError("no piece of the failed write was refused")
        ctx = phx.gpu.context(eng, 0)
        assert ctx.stats()["bad_refusals"] > 0
        # per piece: the raw results through the context
        _t, res = ctx.many(f._c_file, dst.ptr, dst.n, fo, np.arange(n) * bb,
                           np.full(n, bb), False)
        failed = np.flatnonzero(res < 0)
        ok = np.flatnonzero(res >= 0)
        assert failed.size > 0 and (res[failed] == -errno.EIO).all(), res
        h = dst.host()
        for i in failed:                # never data: the place stays as it was
            assert not h[i * bb:(i + 1) * bb].any(), i
        for i in ok:                    # good pieces are the bytes written
            r = int(res[i])
            assert (h[i * bb:i * bb + r] == src.host()[i * bb:i * bb + r]).all(), i
    print("enospc ok", failed.size, ok.size)
""").replace("__DEV__\n", _DEV)


PY_DONE_MEANS_DATA = textwrap.dedent(r"""
    import ctypes, os, sys
    import numpy as np
    import phx, phx.gpu

    lib = ctypes.CDLL("libcuda.so.1")
    d = sys.argv[1]
    rng = np.random.default_rng(int.from_bytes(os.urandom(8), "little"))

    __DEV__

    data = rng.integers(1, 256, 4 << 20, dtype=np.uint8)
    path = os.path.join(d, "done.bin")
    data.tofile(path)
    s = ctypes.c_void_p()
    assert lib.cuStreamCreate(ctypes.byref(s), 1) == 0
    n, bb = 24, 9000
    fo = rng.choice((len(data) - bb) // bb, n, replace=False).astype(np.int64) * bb + 3
    with phx.open(path, "r") as f:
        for _ in range(3):
            buf = Dev(n * bb)
            buf.host()[:] = 0
            op = phx.gpu.read_many_async(buf, f, fo, bb, None, stream=s.value)
            assert (op.result(timeout=60) == bb).all()
            h = buf.host().copy()       # at once: no stream synchronisation
            for i, o in enumerate(fo.tolist()):
                assert (h[i * bb:(i + 1) * bb] == data[o:o + bb]).all(), i
    lib.cuStreamSynchronize(s)
    print("done ok")
""").replace("__DEV__\n", _DEV)


def test_stream_batch_result_means_the_data_is_there(fake_cuda, tmp_path):
    """read_many_async(...).result() returns once every piece's copy ran, not
    when its result is final (results come before the stream's copy kernel):
    the fake's kernels run 20 ms late (FAKE_CUDA_KERNEL_DELAY_US), and the
    buffer is read at once on the host."""
    env = dict(os.environ, LD_LIBRARY_PATH=str(fake_cuda), FAKE_CUDA_KERNEL_DELAY_US="20000")
    r = subprocess.run([sys.executable, "-c", PY_DONE_MEANS_DATA, str(tmp_path)], env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "done ok" in r.stdout


def test_failed_write_pieces_never_read_as_data(fake_cuda, tmp_path):
    """ENOSPC mid-batch (8 MiB tmpfs; root): the failed pieces' ranges are bad,
    reading them fails with EIO and writes no GPU byte."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    if os.geteuid() != 0 or subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=8M", "tmpfs", str(mnt)],
            capture_output=True).returncode != 0:
        pytest.skip("needs root to mount an 8 MiB tmpfs")
    try:
        env = dict(os.environ, LD_LIBRARY_PATH=str(fake_cuda))
        r = subprocess.run([sys.executable, "-c", PY_ENOSPC, str(mnt)], env=env,
                           capture_output=True, text=True, timeout=300)
    finally:
        subprocess.run(["umount", str(mnt)], capture_output=True)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "enospc ok" in r.stdout


def test_vllm_block_pieces_layout():
    """phx.blocks alone (no GPU): offsets by hand for two blocks, two layers."""
    np = pytest.importorskip("numpy")
    from phx.blocks import vllm_block_pieces
    fo, go, ln = vllm_block_pieces([5, 2], 2, 100, layer_stride=10000, kv_stride=1000,
                                   file_slots=[1, 0], file_base=7)
    # block 5 -> slot 1: (layer 0 K, layer 0 V, layer 1 K, layer 1 V)
    assert fo.tolist() == [407, 507, 607, 707, 7, 107, 207, 307]
    assert go.tolist() == [500, 1500, 10500, 11500, 200, 1200, 10200, 11200]
    assert (ln == 100).all() and ln.dtype == np.int64
    fo1, go1, _ = vllm_block_pieces([3], 1, 64, layer_stride=0, kv=1, block_stride=128)
    assert fo1.tolist() == [0] and go1.tolist() == [384]
    for bad in (dict(block_ids=[1, 1]), dict(block_ids=[-1]), dict(kv_stride=None),
                dict(file_slots=[0, 0], block_ids=[1, 2])):
        args = dict(block_ids=[1], num_layers=2, block_bytes=100, layer_stride=1000,
                    kv_stride=500)
        args.update(bad)
        with pytest.raises(ValueError):
            vllm_block_pieces(**args)


PY_HOST_ROW = textwrap.dedent(r"""
    import os, sys
    import numpy as np
    from phx.bench import gpu as bench
    d = sys.argv[1]
    path = os.path.join(d, "host.bin")
    size = 8 << 20
    data = np.random.default_rng(5).integers(0, 256, size, dtype=np.uint8)
    data.tofile(path)
    for chunk in (4096, 16384, 65536):
        pat = bench.chunk_pattern(size, chunk, 2 << 20, seed=chunk)
        dt = bench.phx_host_io(path, pat, False, {})
        assert dt > 0
        buf = np.frombuffer(bench._pinned_host(int((pat.boffs + pat.sizes).max())),
                            dtype=np.uint8)
        for fo, bo in zip(pat.foffs.tolist(), pat.boffs.tolist()):
            assert (buf[bo:bo + chunk] == data[fo:fo + chunk]).all(), (chunk, fo)
        bench.phx_host_io(path, pat, True, {})      # the same bytes back: file unchanged
        assert (np.fromfile(path, dtype=np.uint8) == data).all()
    print("host row ok")
""")


def test_bench_host_row_against_fake_cuda(fake_cuda, tmp_path):
    """The bench's host row (issue 29): pinned host memory through phx's
    engine, the same pieces as the GPU row; bytes checked."""
    env = dict(os.environ, LD_LIBRARY_PATH=str(fake_cuda))
    r = subprocess.run([sys.executable, "-c", PY_HOST_ROW, str(tmp_path)], env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "host row ok" in r.stdout
