"""Issue 29 on a real GPU: many small pieces by arrays (phx.gpu.pread_many,
pwrite_many, read_many_async, write_many_async, File.pread_many with a CUDA
tensor, phx.blocks).  Skips without torch, a CUDA device or phx's GPU module
(the same properties run everywhere on the fake libcuda: test_gpu_small.py);
run on the H100/H200 box with tools/gpu_run.sh build test.
"""
from __future__ import annotations

import os
import threading

import numpy as np
import pytest

import phx
import phx.gpu
from conftest import real_gpu_marks

torch = pytest.importorskip("torch")
pytestmark = real_gpu_marks()

KiB = 1 << 10


def _plan(rng, n: int, maxlen: int, fsize: int):
    """Random unaligned pieces, shuffled back to back in the GPU buffer with gaps."""
    lens = rng.integers(1, maxlen + 1, n)
    fo = rng.integers(0, fsize - maxlen, n)
    bo = np.empty(n, dtype=np.int64)
    at = 3
    for i in rng.permutation(n):
        bo[i] = at
        at += int(lens[i]) + int(rng.integers(0, 8))
    return fo, bo, lens, at + 8


@pytest.fixture
def kv_file(data_dir, rng):
    fsize = (16 << 20) + 4093
    data = rng.integers(1, 256, fsize, dtype=np.uint8)   # never 0
    path = os.path.join(data_dir, "kv-many.bin")
    data.tofile(path)
    return path, data


@pytest.mark.parametrize("maxlen", [8 * KiB, 64 * KiB])
def test_pread_many_exact(kv_file, rng, maxlen):
    path, data = kv_file
    fo, bo, lens, need = _plan(rng, 2000, maxlen, len(data))
    t = torch.zeros(need, dtype=torch.uint8, device="cuda")
    with phx.open(path, "r") as f:
        res = phx.gpu.pread_many(t, f, fo, lens, bo)
    assert (res == lens).all()
    h = t.cpu().numpy()
    for i in range(len(fo)):
        assert (h[bo[i]:bo[i] + lens[i]] == data[fo[i]:fo[i] + lens[i]]).all(), i
    assert int((h != 0).sum()) == int(lens.sum())


def test_file_pread_many_routes_gpu_and_checks(kv_file, rng):
    path, data = kv_file
    offs = rng.choice(len(data) // 16384 - 1, 500, replace=False) * 16384 + 5
    t = torch.zeros(500 * 16384, dtype=torch.uint8, device="cuda")
    with phx.open(path, "r") as f:
        assert (f.pread_many(t, offs, 16384) == 16384).all()
        with pytest.raises(ValueError, match="overlap"):
            f.pread_many(t, [0, 100], [200, 200], [0, 100])
        with pytest.raises(ValueError, match="run past"):
            f.pread_many(t, [0], [10], [t.numel() - 5])
    h = t.cpu().numpy()
    for i, o in enumerate(offs):
        assert (h[i * 16384:(i + 1) * 16384] == data[o:o + 16384]).all(), i


def test_pwrite_many_then_file(kv_file, rng):
    path, data = kv_file
    n = 1500
    slot = len(data) // n
    lens = rng.integers(1, min(slot, 40000) + 1, n)
    fo = np.arange(n) * slot + rng.integers(0, slot - lens + 1)
    bo = np.concatenate([[3], np.cumsum(lens[:-1] + 1) + 3])
    src = torch.randint(1, 256, (int(bo[-1] + lens[-1] + 8),), dtype=torch.uint8, device="cuda")
    with phx.open(path, "r+") as f:
        assert (phx.gpu.pwrite_many(src, f, fo, lens, bo) == lens).all()
    s = src.cpu().numpy()
    for i in range(n):
        data[fo[i]:fo[i] + lens[i]] = s[bo[i]:bo[i] + lens[i]]
    assert (np.fromfile(path, dtype=np.uint8) == data).all()


def test_stream_ordered_many_after_a_kernel(kv_file, rng):
    """Pieces written from what a kernel queued before produced, then read back
    on the same stream and consumed by a kernel queued after them."""
    path, _ = kv_file
    s = torch.cuda.Stream()
    n, bb = 256, 12 * KiB + 7
    fo = np.arange(n, dtype=np.int64) * (bb + 4096) + 11
    with torch.cuda.stream(s):
        src = torch.empty(n * bb, dtype=torch.uint8, device="cuda")
        src.fill_(0x5C)                              # queued before the write
        back = torch.zeros(n * bb, dtype=torch.uint8, device="cuda")
        with phx.open(path, "r+") as f:
            w = phx.gpu.write_many_async(src, f, fo, bb, None, stream=s)
            r = phx.gpu.read_many_async(back, f, fo, bb, None, stream=s)
            total = back.to(torch.int64).sum()       # queued after the read
            assert (w.result(timeout=60) == bb).all()
            assert (r.result(timeout=60) == bb).all()
    s.synchronize()
    assert int(total) == 0x5C * n * bb


def test_vllm_blocks_roundtrip(data_dir, rng):
    from phx.blocks import vllm_block_pieces
    L, nb, bb = 4, 64, 16 * KiB
    layer_stride, kv_stride = 2 * nb * bb, nb * bb
    cache = torch.randint(1, 256, (L * layer_stride,), dtype=torch.uint8, device="cuda")
    other = torch.zeros_like(cache)
    ids, ids2 = rng.choice(nb, 24, replace=False), rng.choice(nb, 24, replace=False)
    fo, go, ln = vllm_block_pieces(ids, L, bb, layer_stride=layer_stride, kv_stride=kv_stride)
    fo2, go2, ln2 = vllm_block_pieces(ids2, L, bb, layer_stride=layer_stride,
                                      kv_stride=kv_stride)
    path = os.path.join(data_dir, "blocks.bin")
    with phx.open(path, "w+") as f:
        assert (f.pwrite_many(cache, fo, ln, go) == bb).all()
        assert (f.pread_many(other, fo2, ln2, go2) == bb).all()
    c, o = cache.cpu().numpy(), other.cpu().numpy()
    for i in range(len(fo)):
        assert (o[go2[i]:go2[i] + bb] == c[go[i]:go[i] + bb]).all(), i


@pytest.mark.parametrize("batch_copy", [True, False])
def test_small_pieces_exact_from_threads(kv_file, rng, batch_copy):
    """Small unaligned pieces (1 B - 20 KiB) read and written from 4 threads
    that never touched CUDA, by cuMemcpyBatchAsync (one call per staging
    buffer) or by a copy call per piece (drivers before CUDA 12.8): every
    byte checked."""
    path, data = kv_file
    eng = phx.Engine()
    ctx = phx.gpu.context(eng, 0, batch_copy=batch_copy)
    plans = [_plan(np.random.default_rng(int(rng.integers(1 << 30))), 1500, 20 * KiB,
                   len(data) // 2) for _ in range(4)]
    bufs = [torch.zeros(p[3], dtype=torch.uint8, device="cuda") for p in plans]
    srcs = [torch.randint(1, 256, (p[3],), dtype=torch.uint8, device="cuda") for p in plans]
    torch.cuda.synchronize()
    st0 = ctx.stats()
    errors = []

    def work(k):
        fo, bo, lens, _ = plans[k]
        try:
            with phx.open(path, "r", engine=eng) as f:
                assert (phx.gpu.pread_many(bufs[k], f, fo, lens, bo) == lens).all()
            # the pieces back to back, unaligned, into a file of this thread's
            wfo = 5 + np.concatenate([[0], np.cumsum(lens[:-1])])
            with phx.open(f"{path}.w{k}", "w+", engine=eng) as f:
                assert (phx.gpu.pwrite_many(srcs[k], f, wfo, lens, bo) == lens).all()
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    th = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    for t in th:
        t.start()
    for t in th:
        t.join()
    assert not errors, errors
    for k, (fo, bo, lens, _) in enumerate(plans):
        h, src = bufs[k].cpu().numpy(), srcs[k].cpu().numpy()
        disk = np.fromfile(f"{path}.w{k}", dtype=np.uint8)
        at = 5
        for i in range(len(fo)):
            assert (h[bo[i]:bo[i] + lens[i]] == data[fo[i]:fo[i] + lens[i]]).all(), (k, i)
            assert (disk[at:at + lens[i]] == src[bo[i]:bo[i] + lens[i]]).all(), (k, i)
            at += int(lens[i])
        assert int((h != 0).sum()) == int(lens.sum())
    batch_calls = ctx.stats()["memcpy_batch_calls"] - st0["memcpy_batch_calls"]
    assert (batch_calls > 0) if ctx.config["batch_copy"] else (batch_calls == 0), batch_calls
    eng.close()
