"""File.pread_many / pwrite_many: many pieces of one host buffer in one
submission, described by integer arrays (no Python object per piece).

Checked byte for byte against the file (fresh random data), with unaligned
sizes, file offsets and buffer offsets, pieces past the end of the file,
packed and explicit buffer layouts, several threads at once, and clear
errors for pieces that do not fit.
"""
from __future__ import annotations

import os
import threading

import numpy as np
import pytest

import phx
from conftest import assert_same, fresh_bytes, read_file, write_file

KiB = 1024


def test_pread_many_matches_the_file(fs_dir, rng):
    path = os.path.join(fs_dir, "many-r")
    data = fresh_bytes(rng, 3 * 1024 * KiB + 517)
    write_file(path, data)
    n = 700
    sizes = rng.integers(1, 20 * KiB, size=n)
    offs = rng.integers(0, len(data) + 4 * KiB, size=n)   # some past the end
    buf = bytearray(int(sizes.sum()) + 8 * KiB)
    with phx.open(path, "r") as f:
        got = f.pread_many(buf, offs, sizes)                 # packed
    assert got.dtype == np.int64 and got.shape == (n,)
    pos = 0
    for o, s, g in zip(offs.tolist(), sizes.tolist(), got.tolist()):
        want = data[o:o + s]
        assert g == len(want), f"piece at {o}: {g} bytes, expected {len(want)}"
        assert_same(bytes(buf[pos:pos + g]), want, f"piece {s} @ {o}")
        pos += s


def test_pread_many_explicit_layout_and_scalar_size(fs_dir, rng):
    path = os.path.join(fs_dir, "many-layout")
    data = fresh_bytes(rng, 2 * 1024 * KiB)
    write_file(path, data)
    bs, n = 4096, 300
    buf = phx.empty_aligned(64 * bs)
    offs = rng.integers(0, len(data) // bs, size=n) * bs
    slots = rng.permutation(64)[np.arange(n) % 64] * bs    # every slot reused, out of order
    with phx.open(path, "r") as f:
        got = f.pread_many(buf, offs, bs, slots)
    assert (got == bs).all()
    mv = memoryview(buf)
    # pieces sharing a slot land in an unknown order: the slot holds one of them
    for s in set(slots.tolist()):
        piece = bytes(mv[s:s + bs])
        candidates = [o for o, t in zip(offs.tolist(), slots.tolist()) if t == s]
        assert any(piece == data[o:o + bs] for o in candidates), f"slot {s}"


def test_pwrite_many_then_read_back(fs_dir, rng):
    path = os.path.join(fs_dir, "many-w")
    base = fresh_bytes(rng, 1024 * KiB + 3)
    write_file(path, base)
    model = bytearray(base)
    n = 400
    # non-overlapping pieces: random cuts of [0, 1.5 MiB)
    cuts = np.unique(rng.integers(0, 1536 * KiB, size=2 * n))
    offs, ends = cuts[0:-1:2], cuts[1::2]
    sizes = ends - offs[:len(ends)]
    offs = offs[:len(sizes)]
    src = fresh_bytes(rng, int(sizes.sum()) + 99)
    boffs = np.concatenate(([0], np.cumsum(sizes)[:-1])) + 99   # odd buffer offsets
    with phx.open(path, "r+") as f:
        got = f.pwrite_many(src, offs, sizes, boffs)
    assert (got == sizes).all()
    for o, s, b in zip(offs.tolist(), sizes.tolist(), boffs.tolist()):
        if o > len(model):
            model.extend(bytes(o - len(model)))
        model[o:o + s] = src[b:b + s]
    assert_same(read_file(path), bytes(model), "file after pwrite_many")


def test_many_from_threads(fs_dir, rng):
    path = os.path.join(fs_dir, "many-threads")
    data = fresh_bytes(rng, 4 * 1024 * KiB)
    write_file(path, data)
    eng = phx.Engine(queue_depth=64)
    errors: list[BaseException] = []

    def run(seed):
        try:
            r = np.random.default_rng(seed)
            sizes = r.integers(1, 9000, size=200)
            offs = r.integers(0, len(data) - 9000, size=200)
            buf = bytearray(int(sizes.sum()))
            with phx.open(path, "r", engine=eng) as f:
                got = f.pread_many(buf, offs, sizes)
            pos = 0
            for o, s, g in zip(offs.tolist(), sizes.tolist(), got.tolist()):
                assert g == s
                assert bytes(buf[pos:pos + s]) == data[o:o + s], f"piece {s} @ {o}"
                pos += s
        except BaseException as e:  # noqa: BLE001 - re-raised below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(int(s),))
               for s in rng.integers(0, 2**32, size=6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    eng.close()
    assert not errors, errors[0]


def test_many_bad_arguments(tmp_path, rng):
    path = tmp_path / "many-bad"
    path.write_bytes(fresh_bytes(rng, 64 * KiB))
    buf = bytearray(8 * KiB)
    with phx.open(path, "r+") as f:
        with pytest.raises(ValueError, match="piece 1: .* does not fit a 8192-byte buffer"):
            f.pread_many(buf, [0, 4096], 4096, [0, 4097])
        with pytest.raises(ValueError, match="2 offsets but 3 sizes"):
            f.pread_many(buf, [0, 1], [1, 2, 3])
        with pytest.raises(ValueError, match="2 offsets but 1 buffer offsets"):
            f.pread_many(buf, [0, 1], 10, [0])
        with pytest.raises(ValueError, match="negative"):
            f.pread_many(buf, [-4096], 10)
        with pytest.raises(phx.BufferReadOnlyError):
            f.pread_many(bytes(8 * KiB), [0], 10)
        assert f.pread_many(buf, [], 10).shape == (0,)
    with phx.open(path, "r") as f:
        with pytest.raises(OSError, match="not open for writing"):
            f.pwrite_many(buf, [0], 10)
