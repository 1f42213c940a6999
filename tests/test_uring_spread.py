"""io_uring engines that spread large batches over io-wq workers (be_uring.c,
"Spreading"; ``PHX_URING_SPREAD``), through the Python API.

On ext4 on zram (root; a private device, removed afterwards) a read
completes inside the call that submits it, so one engine is one CPU unless
the batch goes to io-wq.  With spreading forced (1), automatic and off (0):

* ``File.pread_many`` of random distinct pieces - 4-64 KiB, aligned and not,
  some across the end of the file (short) or past it (0) - byte for byte
  against the file's contents, nothing written between the pieces;
* ``pwrite_many`` of pieces, read back by phx and by ``os.pread``;
* four threads reading through one engine;
* forced spreading runs on io-wq workers of the calling thread;
* on a full filesystem (8 MiB tmpfs, 16 MiB ext4) the writes that failed
  with ENOSPC leave ranges that read EIO, never data.

The same reads on the real disk and through the page cache, where the
automatic mode must change nothing a caller sees.  libphx/tests/uring-spread.c
checks the detection itself, -EFAULT pieces and zram's -EIO.
"""
from __future__ import annotations

import errno
import os
import threading

import numpy as np
import pytest

import phx
from conftest import KiB, MiB, assert_same, fresh_bytes, write_file

MODES = ["1", "auto", "0"]
FILE_SIZE = 48 * MiB + 1234     # not a multiple of a block: short reads at the end


@pytest.fixture(scope="module")
def zram_dir():
    """ext4 on a new 192 MiB zram device, mounted; removed afterwards."""
    from phx.bench import _zram
    why = _zram.unavailable(192 * MiB)
    if why:
        pytest.skip(f"no zram here: {why}")
    with _zram.zram_ext4(192 * MiB) as z:
        yield z.mountpoint


@pytest.fixture(params=["zram", "disk", "page-cache"])
def target(request, data_dir, rng):
    """(path, contents, direct): a file of fresh random data on ext4 on zram,
    on the real disk, or on the disk read through the page cache."""
    d = request.getfixturevalue("zram_dir") if request.param == "zram" else data_dir
    path = os.path.join(d, f"spread-{os.getpid()}-{request.param}.bin")
    data = fresh_bytes(rng, FILE_SIZE)
    write_file(path, data)
    yield path, data, request.param != "page-cache"
    os.unlink(path)


def _engine(monkeypatch, mode: str, **kw) -> phx.Engine:
    # read at engine creation (be_uring.c's set-up)
    monkeypatch.setenv("PHX_URING_SPREAD", mode)
    return phx.Engine(backend="uring", **kw)


def _pieces(rng, n: int, size: int, past_end: bool = True, blocks_every: int = 4):
    """n distinct random pieces: (file offsets, lengths, buffer offsets, the
    buffer size).  Every ``blocks_every``-th piece whole 4 KiB blocks, the
    others any length at any offset.  A piece's memory is congruent with its file offset
    modulo 4096, or off by a non-multiple of 512: never 512-aligned but not
    page-aligned, which Linux 6.18's O_DIRECT on ext4 on zram reads wrongly
    into (data from 512 bytes on; a plain os.preadv does the same) - not what
    this file tests."""
    slot = 68 * KiB
    blocks = rng.choice(size // (64 * KiB) - 1, n, replace=False)
    offs = np.empty(n, np.int64)
    lens = np.empty(n, np.int64)
    for i, b in enumerate(blocks):
        if i % blocks_every == 0:
            lens[i] = int(rng.integers(1, 17)) * 4 * KiB
            offs[i] = int(b) * 64 * KiB + int(rng.integers(0, (64 * KiB - lens[i]) // 4096 + 1)) * 4096
        else:
            lens[i] = int(rng.integers(1, 64 * KiB + 1))
            offs[i] = int(b) * 64 * KiB + int(rng.integers(0, 64 * KiB - lens[i] + 1))
    if past_end:     # one across the end of the file, one past it
        offs[0], lens[0] = size - 3000, 8192
        offs[1], lens[1] = size + 4096, 4096
    boffs = np.arange(n, dtype=np.int64) * slot + offs % 4096
    odd = rng.integers(0, 2, n).astype(bool)
    boffs[odd] += rng.integers(1, 512, int(odd.sum()))
    return offs, lens, boffs, n * slot


def _check_read(buf, data: bytes, offs, lens, boffs, res, what: str) -> None:
    got = np.frombuffer(buf, np.uint8)
    mask = np.zeros(got.size, bool)
    for o, ln, bo, r in zip(offs.tolist(), lens.tolist(), boffs.tolist(), res.tolist()):
        want = max(0, min(ln, len(data) - o))
        assert r == want, f"{what}: {ln} bytes at {o} read {r}, expected {want}"
        assert_same(bytes(got[bo:bo + want]), data[o:o + want], f"{what}: piece at {o}")
        mask[bo:bo + want] = True
    # the buffer was zeroed: nothing written beside the pieces
    stray = np.flatnonzero(got[~mask])
    assert stray.size == 0, f"{what}: {stray.size} bytes written outside the pieces"


@pytest.mark.parametrize("mode", MODES)
def test_pread_many_exact(monkeypatch, rng, target, mode):
    path, data, direct = target
    eng = _engine(monkeypatch, mode)
    offs, lens, boffs, bsize = _pieces(rng, 600, len(data))
    buf = phx.empty_aligned(bsize)
    with phx.open(path, "r", direct=direct, engine=eng) as f:
        for rep in range(3):
            np.frombuffer(buf, np.uint8)[:] = 0
            res = f.pread_many(buf, offs, lens, boffs)
            _check_read(buf, data, offs, lens, boffs, res, f"PHX_URING_SPREAD={mode} rep {rep}")
            offs, lens, boffs, _ = _pieces(rng, 600, len(data))


@pytest.mark.parametrize("mode", MODES)
def test_pwrite_many_then_read(monkeypatch, rng, zram_dir, mode):
    path = os.path.join(zram_dir, f"spread-w-{os.getpid()}.bin")
    data = bytearray(fresh_bytes(rng, FILE_SIZE))
    write_file(path, bytes(data))
    try:
        eng = _engine(monkeypatch, mode)
        offs, lens, boffs, bsize = _pieces(rng, 500, len(data), past_end=False)
        src = phx.empty_aligned(bsize)
        np.frombuffer(src, np.uint8)[:] = np.frombuffer(fresh_bytes(rng, bsize), np.uint8)
        with phx.open(path, "r+", engine=eng) as f:
            res = f.pwrite_many(src, offs, lens, boffs)
            assert (res == lens).all(), res
            f.fsync()
            mv = memoryview(src)
            for o, ln, bo in zip(offs.tolist(), lens.tolist(), boffs.tolist()):
                data[o:o + ln] = mv[bo:bo + ln]
            dst = phx.empty_aligned(bsize)
            np.frombuffer(dst, np.uint8)[:] = 0
            res = f.pread_many(dst, offs, lens, boffs)
            _check_read(dst, bytes(data), offs, lens, boffs, res, f"written, mode {mode}")
        with open(path, "rb") as g:
            for o, ln in zip(offs.tolist()[:100], lens.tolist()[:100]):
                assert_same(os.pread(g.fileno(), ln, o), bytes(data[o:o + ln]), f"pread at {o}")
    finally:
        os.unlink(path)


@pytest.mark.parametrize("mode", ["1", "auto"])
def test_threads_one_engine(monkeypatch, rng, zram_dir, mode):
    """Six threads, one engine, 2 to 12 pread_many calls each: a thread also
    submits the others' queued ops, and io-wq drops the ops it holds when
    the thread exits - here while the others still read (-ECANCELED, which
    libphx runs again; libphx/tests/uring-spread.c meets it more often)."""
    path = os.path.join(zram_dir, f"spread-t-{os.getpid()}.bin")
    data = fresh_bytes(rng, FILE_SIZE)
    write_file(path, data)
    eng = _engine(monkeypatch, mode)
    errors: list[str] = []
    seeds = rng.integers(0, 2**63, 6)
    try:
        with phx.open(path, "r", engine=eng) as f:
            def worker(seed: int, calls: int) -> None:
                r = np.random.default_rng(seed)
                try:
                    for k in range(calls):
                        # whole blocks now and then: no bounce buffer holds
                        # them back, so whole batches go to io-wq at once
                        offs, lens, boffs, bsize = _pieces(r, 256, len(data),
                                                           blocks_every=1 + k % 2 * 3)
                        buf = phx.empty_aligned(bsize)
                        np.frombuffer(buf, np.uint8)[:] = 0
                        res = f.pread_many(buf, offs, lens, boffs)
                        _check_read(buf, data, offs, lens, boffs, res, "thread")
                except Exception as e:  # noqa: BLE001 - reported below
                    errors.append(f"{type(e).__name__}: {e}")
            ts = [threading.Thread(target=worker, args=(int(s), 2 + 2 * i))
                  for i, s in enumerate(seeds)]
            for t in ts:
                t.start()
            for t in ts:
                t.join()
    finally:
        os.unlink(path)
    assert not errors, errors


def _workers_of(tid: int) -> int:
    """io-wq workers are threads named iou-wrk-<tid of the submitting thread>."""
    n = 0
    for t in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{t}/comm") as fh:
                n += fh.read().strip() == f"iou-wrk-{tid}"
        except OSError:
            pass
    return n


def test_forced_spreading_uses_workers(monkeypatch, rng, zram_dir):
    """PHX_URING_SPREAD=1: a large batch's reads run on io-wq workers of the
    calling thread (a fresh one, so that no earlier worker is counted; on
    one CPU, forced, one worker)."""
    path = os.path.join(zram_dir, f"spread-k-{os.getpid()}.bin")
    data = fresh_bytes(rng, 16 * MiB)
    write_file(path, data)
    eng = _engine(monkeypatch, "1")
    seen: list[int] = []
    try:
        with phx.open(path, "r", engine=eng) as f:
            def reader() -> None:
                offs = rng.choice(len(data) // (64 * KiB), 200, replace=False) * 64 * KiB
                buf = phx.empty_aligned(200 * 64 * KiB)
                f.pread_many(buf, offs, 64 * KiB)
                seen.append(_workers_of(threading.get_native_id()))
            t = threading.Thread(target=reader)
            t.start()
            t.join()
    finally:
        os.unlink(path)
    assert seen and seen[0] > 0, f"no io-wq worker ran the forced batch ({seen})"


@pytest.fixture(params=["tmpfs", "ext4"])
def full_fs(request):
    """A small filesystem to fill: an 8 MiB tmpfs or a 16 MiB loop ext4."""
    return request.getfixturevalue(f"small_{request.param}")


@pytest.mark.parametrize("mode", ["1", "auto"])
def test_enospc_never_reads_as_data(monkeypatch, rng, full_fs, mode):
    """Pieces written to a filesystem too small for them: those that failed
    (ENOSPC, with spreading in io-wq) read EIO afterwards - their ranges are
    bad - and put nothing in the buffer; the others read what was written."""
    eng = _engine(monkeypatch, mode)
    path = os.path.join(full_fs, "full.bin")
    n, bb = 800, 32 * KiB                # 25 MiB of pieces
    src = phx.empty_aligned(n * bb)
    np.frombuffer(src, np.uint8)[:] = np.frombuffer(fresh_bytes(rng, n * bb), np.uint8)
    offs = np.arange(n, dtype=np.int64) * bb
    with phx.open(path, "w+", engine=eng) as f:
        with pytest.raises(OSError) as ei:
            f.pwrite_many(src, offs, bb)
        assert ei.value.errno == errno.ENOSPC, ei.value
        bad = good = 0
        dst = phx.empty_aligned(bb)
        for i, o in enumerate(offs.tolist()):
            np.frombuffer(dst, np.uint8)[:] = 0
            try:
                r = f.pread(dst, o)
            except OSError as e:
                assert e.errno == errno.EIO, e
                assert not np.frombuffer(dst, np.uint8).any(), f"piece {i}: EIO, yet bytes arrived"
                bad += 1
                continue
            assert r == bb, (i, r)
            assert_same(bytes(dst), bytes(memoryview(src)[i * bb:(i + 1) * bb]), f"piece {i}")
            good += 1
    assert bad > 0 and good > 0, (bad, good)
