"""The write path's guarantees under concurrency (issue 9).

* A partial block past the end of the file is written with the caller's bytes
  and no others (through the page cache), never padded and cut back later:
  another process growing or appending to the file meanwhile keeps its bytes,
  and a writer killed with SIGKILL never leaves the file longer than what it
  asked for.
* Partial-block writes are serialised per inode across every handle and
  engine of the process: writers of disjoint bytes of the same blocks never
  undo each other.
* Single-thread engines refuse other threads and use the ring features they
  were set up with.

Every check compares the file with a model built from fresh random data, on
each filesystem of ``fs_dir`` (the disk, xfs, 4k-sector xfs, ext4 images).
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

import phx
from conftest import assert_same, fresh_bytes, read_file as read_all, write_file

KiB = 1024


def _model_write(model: bytearray, off: int, data: bytes) -> None:
    if off > len(model):
        model.extend(bytes(off - len(model)))
    model[off:off + len(data)] = data


# ---------------------------------------------------------------------------
# Several handles and engines, disjoint bytes of the same blocks
# ---------------------------------------------------------------------------

def _interleaved_ranges(rng, start: int, end: int, writers: int):
    """Cut [start, end) into small random pieces dealt round-robin to writers,
    so that every block holds pieces of several writers."""
    cuts = sorted(set(int(x) for x in rng.integers(start + 1, end, size=(end - start) // 150)))
    edges = [start, *cuts, end]
    pieces = [(a, b - a) for a, b in zip(edges, edges[1:]) if b > a]
    return [pieces[w::writers] for w in range(writers)]


@pytest.mark.parametrize("shared_engine", [False, True], ids=["engine-each", "one-engine"])
def test_handles_write_disjoint_bytes_of_same_blocks(fs_dir, rng, shared_engine):
    """Four handles (each on its own engine, or all on one) write disjoint,
    unaligned pieces of the same blocks at once, inside the file and past its
    end.  Each piece is a read-modify-write or a page-cache write of a shared
    block; without per-inode serialisation, one handle's merge writes back
    bytes another handle just replaced."""
    path = os.path.join(fs_dir, "shared-blocks")
    size0 = 37 * KiB + 123
    model = bytearray(fresh_bytes(rng, size0))
    write_file(path, bytes(model))
    writers = 4
    engines = [phx.Engine(queue_depth=16) for _ in range(1 if shared_engine else writers)]
    files = [phx.open(path, "r+", engine=engines[w % len(engines)]) for w in range(writers)]
    try:
        for rnd in range(10):
            # inside the file, and across its end into fresh blocks
            end = len(model) + 9 * KiB + int(rng.integers(1, 4096))
            plan = _interleaved_ranges(rng, 0, end, writers)
            work = [[(fresh_bytes(rng, n), off) for off, n in pieces] for pieces in plan]
            errors: list[BaseException] = []
            start = threading.Barrier(writers)

            def run(w):
                try:
                    start.wait()
                    got = files[w].pwrite_batch(work[w])  # all in flight together
                    assert got == [len(d) for d, _ in work[w]]
                except BaseException as e:  # noqa: BLE001 - re-raised below
                    errors.append(e)

            threads = [threading.Thread(target=run, args=(w,)) for w in range(writers)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            assert not errors, errors[0]
            for pieces in work:
                for data, off in pieces:
                    _model_write(model, off, data)
            assert os.path.getsize(path) == len(model), f"round {rnd}: size"
            assert_same(read_all(path), bytes(model), f"round {rnd}")
    finally:
        for f in files:
            f.close()
        for e in engines:
            e.close()


# ---------------------------------------------------------------------------
# A second process grows the file while phx writes a partial tail
# ---------------------------------------------------------------------------

_APPENDER = r"""
import json, os, sys, time
path, n, rec = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
fd = os.open(path, os.O_WRONLY | os.O_APPEND)
out = []
print("ready", flush=True)
for i in range(n):
    data = os.urandom(rec)
    os.write(fd, data)
    end = os.lseek(fd, 0, os.SEEK_CUR)
    out.append((end - rec, data.hex()))
    time.sleep(0.0001)
os.close(fd)
print(json.dumps(out), flush=True)
"""


def test_tail_past_eof_while_another_process_appends(fs_dir, rng):
    """Another process appends 40-byte records (O_APPEND) while phx writes a
    sub-block tail at the end of the file.  A tail written as a zero-padded
    block (cut back later) either leaves zeros that nobody wrote between
    phx's bytes and the records appended after them, or cuts those records
    off.  Every byte from the old end on must be phx's or a record's, every
    record that does not overlap phx's bytes must be intact, and the file must
    end exactly at the furthest write."""
    nrec, rec = 30, 40
    for rnd in range(12):
        path = os.path.join(fs_dir, f"append-{rnd}")
        size0 = 8 * KiB + int(rng.integers(1, 4096))
        base = fresh_bytes(rng, size0)
        write_file(path, base)
        child = subprocess.Popen([sys.executable, "-c", _APPENDER, path, str(nrec), str(rec)],
                                 stdout=subprocess.PIPE, text=True)
        try:
            assert child.stdout.readline().strip() == "ready"
            with phx.open(path, "r+") as f:
                time.sleep(float(rng.uniform(0, 0.002)))
                at = f.size
                n = int(rng.integers(1, 400))
                ours = fresh_bytes(rng, n)
                assert f.pwrite(ours, at) == n
            # not communicate(): with a timeout it reads the pipe's fd and
            # loses what readline() above already buffered (the JSON line,
            # when the machine is slow to come back to us)
            out = child.stdout.read()
            child.wait(timeout=60)
        finally:
            if child.poll() is None:
                child.kill()
        assert child.returncode == 0
        records = [(o, bytes.fromhex(h)) for o, h in json.loads(out.strip().splitlines()[-1])]
        got = read_all(path)
        furthest = max(at + n, max(o + len(d) for o, d in records))
        assert len(got) == furthest, (f"round {rnd}: file size {len(got)}, furthest write "
                                      f"ends at {furthest}")
        assert_same(got[:size0], base, f"round {rnd}: original bytes")
        covered = np.zeros(len(got), dtype=bool)
        covered[:size0] = True
        covered[at:at + n] = True
        for o, d in records:
            covered[o:o + len(d)] = True
            if o < at + n and at < o + len(d):
                continue  # landed on phx's bytes: overlapping writes are unordered
            assert_same(got[o:o + len(d)], d, f"round {rnd}: appended record at {o}")
        assert covered.all(), (f"round {rnd}: bytes {np.flatnonzero(~covered)[:8].tolist()}... "
                               f"were written by nobody (phx wrote [{at}, {at + n}))")
        if not any(o < at + n and at < o + len(d) for o, d in records):
            assert_same(got[at:at + n], ours, f"round {rnd}: phx's tail")


# ---------------------------------------------------------------------------
# SIGKILL during unaligned writes past the end
# ---------------------------------------------------------------------------

_KILLED_WRITER = r"""
import collections, sys
import numpy as np
import phx
path, size0, seed, L, G, B = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), 1500, 5000, 32
rng = np.random.default_rng(seed)
inflight = collections.deque()
with phx.open(path, "r+") as f:
    for k in range(100000):
        # batch k goes out while batch k - 1 is still being written
        # one write(2) per line: with PYTHONUNBUFFERED (set here) print() writes
        # each piece on its own and the SIGKILL could leave "start" alone
        sys.stdout.write(f"start {k}\n"); sys.stdout.flush()
        futs = [f.pwrite_async(rng.bytes(L), size0 + (k * B + i) * (L + G)) for i in range(B)]
        inflight.append((k, futs))
        if len(inflight) > 1:
            j, old = inflight.popleft()
            for x in old:
                assert x.result() == L
            sys.stdout.write(f"done {j}\n"); sys.stdout.flush()
"""


def test_sigkill_during_unaligned_writes_never_pads(fs_dir, rng):
    """A phx writer writes records of 1500 bytes past the end, each followed
    by a 5000-byte hole (so never block-aligned), in batches of 32 with the
    next batch always in flight, and is killed with SIGKILL at a random
    moment.  Whatever completed, the file can only end where a write ended:
    inside a record, never inside a hole (where a zero-padded block would
    leave it).  Holes stay zero, records of finished batches are there byte
    for byte, records in flight hold only their own bytes or zeros."""
    L, G, B = 1500, 5000, 32
    for rnd in range(8):
        path = os.path.join(fs_dir, f"killed-{rnd}")
        size0 = 4 * KiB + int(rng.integers(1, 4096))
        base = fresh_bytes(rng, size0)
        write_file(path, base)
        seed = int(rng.integers(0, 2**63))
        child = subprocess.Popen([sys.executable, "-c", _KILLED_WRITER, path, str(size0),
                                  str(seed)], stdout=subprocess.PIPE, text=True)
        started = done = -1
        stop_after = int(rng.integers(2, 12))
        try:
            for line in child.stdout:
                what, k = line.split()
                if what == "start":
                    started = int(k)
                else:
                    done = int(k)
                if started >= stop_after:
                    time.sleep(float(rng.uniform(0, 0.003)))
                    break
        finally:
            child.send_signal(signal.SIGKILL)
            child.wait()
            for line in child.stdout.read().split("\n"):  # printed before it died
                if line.strip():
                    what, k = line.split()
                    if what == "start":
                        started = max(started, int(k))
                    else:
                        done = max(done, int(k))
        assert started >= 0
        expect = np.random.default_rng(seed)
        recs = [expect.bytes(L) for _ in range((started + 1) * B)]
        starts = [size0 + i * (L + G) for i in range(len(recs))]
        got = read_all(path)
        size = len(got)
        assert size == size0 or any(o < size <= o + L for o in starts), (
            f"round {rnd}: the file ends at {size}, inside a hole no write reached "
            f"(records end at {[o + L for o in starts if o + L < size][-1:]}): padded")
        assert size >= starts[(done + 1) * B - 1] + L if done >= 0 else True, \
            f"round {rnd}: finished records missing"
        assert_same(got[:size0], base, f"round {rnd}: original bytes")
        buf = np.frombuffer(got, dtype=np.uint8)
        for i, (o, r) in enumerate(zip(starts, recs)):
            if o >= size:
                break
            if i < (done + 1) * B:
                assert_same(got[o:o + L], r, f"round {rnd}: record {i}")
            else:
                part = buf[o:o + L]
                want = np.frombuffer(r[:len(part)], dtype=np.uint8)
                assert np.all((part == want) | (part == 0)), f"round {rnd}: record {i} in flight"
            hole = buf[o + L:o + L + G]
            assert not hole.any(), f"round {rnd}: bytes in the hole after record {i}"


# ---------------------------------------------------------------------------
# Single-thread engines
# ---------------------------------------------------------------------------

def test_single_thread_engine(fs_dir, rng):
    """A single-thread engine works from its own thread (byte-checked), is
    refused from another one, and reports its ring setup."""
    path = os.path.join(fs_dir, "single")
    data = fresh_bytes(rng, 300 * KiB + 77)
    write_file(path, data)
    eng = phx.Engine(queue_depth=32, single_thread=True)
    feats = eng.features
    release = tuple(int(x) for x in os.uname().release.split(".")[:2])
    if release >= (6, 1) and eng.backend == "uring":   # ring flags: io_uring only
        assert feats["single_issuer"] and feats["defer_taskrun"] and feats["registered_ring"], feats
    with phx.open(path, "r+", engine=eng) as f:
        bufs = [bytearray(4096 + 13) for _ in range(40)]
        offs = [int(x) for x in rng.integers(0, len(data) - 5000, size=40)]
        assert f.pread_batch(list(zip(bufs, offs))) == [len(b) for b in bufs]
        for b, o in zip(bufs, offs):
            assert_same(bytes(b), data[o:o + len(b)], f"read at {o}")
        new = fresh_bytes(rng, 9999)
        assert f.pwrite(new, 5000) == len(new)
        seen: list[BaseException] = []

        def other():
            try:
                f.pread(bytearray(4096), 0)
            except BaseException as e:  # noqa: BLE001 - checked below
                seen.append(e)
        t = threading.Thread(target=other)
        t.start()
        t.join()
        assert seen and isinstance(seen[0], PermissionError), seen
        assert "single-thread" in str(seen[0])
        got = bytearray(len(new))
        assert f.pread(got, 5000) == len(new)
        assert_same(bytes(got), new, "written then read back")
    eng.close()
