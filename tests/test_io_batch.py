"""pread_batch / pwrite_batch: many (buffer, offset) pairs, one result each."""
from __future__ import annotations

import os

import numpy as np
import pytest

import phx
from conftest import KiB, MiB, assert_same, fresh_bytes, write_file

FILE_SIZE = 16 * MiB + 5


@pytest.fixture
def src(fs_dir, rng):
    path = os.path.join(fs_dir, "src")
    data = fresh_bytes(rng, FILE_SIZE)
    write_file(path, data)
    return path, data


def random_len(rng):
    return int(rng.choice([1, 2, 511, 512, 4095, 4096, 4097, 8192, int(rng.integers(1, 16 * KiB))]))


def random_off(rng, hi):
    kind = rng.integers(0, 3)
    if kind == 0:
        return int(rng.integers(0, hi // 4096)) * 4096  # aligned
    if kind == 1:
        return int(rng.integers(0, hi // 512)) * 512 + 1
    return int(rng.integers(0, hi))


def test_pread_batch_1000(src, rng):
    path, data = src
    reqs = []
    for i in range(1000):
        ln = random_len(rng)
        off = random_off(rng, FILE_SIZE + 8192)  # some entries cross or pass EOF
        reqs.append((bytearray(fresh_bytes(rng, ln)), off))
    with phx.open(path, "r") as f:
        res = f.pread_batch(reqs)
    assert isinstance(res, list) and len(res) == 1000
    for i, ((b, off), n) in enumerate(zip(reqs, res)):
        exp = data[off:off + len(b)]
        assert n == len(exp), f"entry {i}: {len(b)} @ {off} -> {n}"
        assert_same(b[:n], exp, f"entry {i}: {len(b)} @ {off}")


def test_pwrite_batch_1000(fs_dir, rng):
    path = os.path.join(fs_dir, "w")
    base = fresh_bytes(rng, FILE_SIZE)
    write_file(path, base)
    # 1000 non-overlapping random extents over the file, shuffled, some
    # extending it past its end.
    slot = (FILE_SIZE + 2 * MiB) // 1000
    reqs = []
    for i in range(1000):
        ln = int(rng.integers(1, min(slot, 16 * KiB) + 1))
        off = i * slot + int(rng.integers(0, slot - ln + 1))
        reqs.append((fresh_bytes(rng, ln), off))
    order = rng.permutation(1000)
    reqs = [reqs[i] for i in order]
    with phx.open(path, "r+") as f:
        res = f.pwrite_batch(reqs)
    assert res == [len(b) for b, _ in reqs]
    expected = bytearray(base)
    for b, off in reqs:
        if off + len(b) > len(expected):
            expected.extend(bytes(off + len(b) - len(expected)))
        expected[off:off + len(b)] = b
    with open(path, "rb") as g:
        assert_same(g.read(), bytes(expected), "file after pwrite_batch")


def test_batch_mixed_buffer_kinds(data_dir, rng):
    path = os.path.join(data_dir, "m")
    data = fresh_bytes(rng, 4 * MiB)
    write_file(path, data)
    al = phx.empty_aligned(64 * KiB)
    backing = bytearray(100_000)
    reqs = [
        (bytearray(100), 3),
        (memoryview(backing)[7:50_007], 4096),
        (np.empty((100, 33), dtype=np.float32), 1 * MiB + 1),
        (al, 8192),
        (np.empty(5, dtype=np.int64), 4 * MiB - 8),  # short: crosses EOF
    ]
    with phx.open(path, "r") as f:
        res = f.pread_batch(reqs)
    exp_lens = [100, 50_000, 100 * 33 * 4, 64 * KiB, 8]
    assert res == exp_lens
    got = [bytes(memoryview(b))[:n] for (b, _), n in zip(reqs, res)]
    offs = [o for _, o in reqs]
    for g, o, n in zip(got, offs, res):
        assert_same(g, data[o:o + n], f"@ {o}")


def test_batch_empty(data_dir):
    path = os.path.join(data_dir, "e")
    write_file(path, b"x" * 10)
    with phx.open(path, "r+") as f:
        assert f.pread_batch([]) == []
        assert f.pwrite_batch([]) == []


def test_batch_more_than_queue_depth(data_dir, rng):
    path = os.path.join(data_dir, "q")
    data = fresh_bytes(rng, 2 * MiB)
    write_file(path, data)
    eng = phx.Engine(queue_depth=2, max_io_size=8 * KiB, bounce_count=1, bounce_size=4096)
    reqs = [(bytearray(int(rng.integers(1, 40_000))), int(rng.integers(0, 2 * MiB))) for _ in range(300)]
    with phx.open(path, "r", engine=eng) as f:
        res = f.pread_batch(reqs)
    for (b, off), n in zip(reqs, res):
        assert n == len(data[off:off + len(b)])
        assert_same(b[:n], data[off:off + n])


def test_batch_then_os_view_consistent(data_dir, rng):
    """Write batch then read batch of the same extents returns what was written."""
    path = os.path.join(data_dir, "rt")
    exts = [(i * 10_007 + (i % 7), int(rng.integers(1, 9000))) for i in range(200)]
    payloads = [fresh_bytes(rng, ln) for _, ln in exts]
    with phx.open(path, "w+") as f:
        assert f.pwrite_batch([(p, off) for p, (off, _) in zip(payloads, exts)]) == [len(p) for p in payloads]
        bufs = [bytearray(ln) for _, ln in exts]
        assert f.pread_batch([(b, off) for b, (off, _) in zip(bufs, exts)]) == [len(p) for p in payloads]
    for b, p in zip(bufs, payloads):
        assert_same(b, p)


@pytest.mark.parametrize("stride", [300, 700, 1500, 4100, 10_007])
def test_pwrite_batch_extending_adjacent(fs_dir, rng, stride):
    """200 non-overlapping unaligned writes past the end of an empty file,
    neighbours sharing blocks, in one batch: like 200 pwrite(2)s, the file is
    exactly as long as the furthest write, every write is there, gaps are
    zeros.  (Repeated: what this catches is a race.)"""
    path = os.path.join(fs_dir, "ext")
    for rep in range(3):
        reqs = []
        for i in range(200):
            ln = int(rng.integers(1, stride - 7))
            off = i * stride + int(rng.integers(0, stride - ln + 1))
            reqs.append((fresh_bytes(rng, ln), off))
        order = rng.permutation(200)
        with phx.open(path, "w+") as f:
            res = f.pwrite_batch([reqs[i] for i in order])
        assert res == [len(reqs[i][0]) for i in order]
        end = max(off + len(b) for b, off in reqs)
        expected = bytearray(end)
        for b, off in reqs:
            expected[off:off + len(b)] = b
        assert os.stat(path).st_size == end, f"rep {rep}: size {os.stat(path).st_size} != {end}"
        with open(path, "rb") as g:
            assert_same(g.read(), bytes(expected), f"rep {rep}: file after extending batch")
