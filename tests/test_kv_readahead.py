"""Group 2 read-ahead (issue 26 part 4, :mod:`phx.kv.readahead`): bytes read
ahead are served only when they are what the device holds.

Every test compares with a reference made from fresh random data, on the real
disk, xfs (512 and 4096-byte sectors) and ext4 (``fs_dir``).
"""
from __future__ import annotations

import errno
import threading

import numpy as np
import pytest

from phx.kv import DIRECT, KVStore

SHAPE = (96, 4, 64)                     # 96 rows of 512 bytes (fp16): 48 KiB


def _store(d, readahead=2, **kw):
    return KVStore(str(d), mode="direct", readahead=readahead, budget=0, **kw)


def _rand(rng, shape=SHAPE):
    return rng.integers(0, 1 << 16, size=shape, dtype=np.uint16).view(np.float16)


def _filled(st, rng, layers):
    ref = {}
    ts = []
    for L in range(layers):
        for t in st.allocate(L, SHAPE, np.float16):
            a = _rand(rng)
            st.write(t, 0, a)
            ref[t.id] = a.copy()
            ts.append(t)
    return ts, ref


def test_served_from_the_buffer_and_exact(fs_dir, rng):
    with _store(fs_dir) as st:
        ts, ref = _filled(st, rng, 2)
        assert all(t.group == DIRECT for t in ts)
        assert st.prefetch(ts[0], 0, 70) and st.prefetch(ts[1], 0, 96)
        assert not st.prefetch(ts[2], 0, 96)           # two slots only
        # a read within the rows read ahead: from the buffer, exact; unaligned rows
        got = st.read(ts[0], 3, 61)
        assert (got.view(np.uint16) == ref[ts[0].id][3:61].view(np.uint16)).all()
        got = st.read(ts[1])
        assert (got.view(np.uint16) == ref[ts[1].id].view(np.uint16)).all()
        r = st.readahead_report()
        assert r["served"] == 2 and r["started"] == 2 and r["refused"] == 1
        assert r["bytes_served"] == (58 + 96) * 512
        # taken once: the next read goes to the device, and a slot is free again
        got = st.read(ts[0], 0, 96)
        assert (got.view(np.uint16) == ref[ts[0].id].view(np.uint16)).all()
        assert st.prefetch(ts[2]) and st.readahead_report()["served"] == 2


def test_a_write_after_the_read_ahead_makes_it_stale(fs_dir, rng):
    with _store(fs_dir) as st:
        ts, ref = _filled(st, rng, 1)
        t = ts[0]
        assert st.prefetch(t)
        new = _rand(rng, (5,) + SHAPE[1:])
        st.write(t, 40, new)                           # rows 40..44 change
        ref[t.id][40:45] = new
        got = st.read(t)
        assert (got.view(np.uint16) == ref[t.id].view(np.uint16)).all()
        r = st.readahead_report()
        assert r["served"] == 0 and r["stale"] == 1
        # an asynchronous write in flight: nothing is read ahead until it is done
        new2 = _rand(rng, (3,) + SHAPE[1:])
        fut = st.write_async(t, 10, new2)
        ref[t.id][10:13] = new2
        started = st.prefetch(t)
        fut.result()
        if started:
            # the write was done by the time prefetch() looked: served, exact
            pass
        got = st.read(t)
        assert (got.view(np.uint16) == ref[t.id].view(np.uint16)).all()


def test_rows_not_covered_go_to_the_device(fs_dir, rng):
    with _store(fs_dir) as st:
        ts, ref = _filled(st, rng, 1)
        t = ts[0]
        assert st.prefetch(t, 10, 50)
        got = st.read(t, 0, 60)                        # wider than read ahead
        assert (got.view(np.uint16) == ref[t.id][:60].view(np.uint16)).all()
        assert st.readahead_report()["served"] == 0


class _FailingReads:
    """The slab's read_async answering with an error or a short read."""

    def __init__(self, be, how):
        self.be, self.how = be, how

    def __call__(self, buf, off):
        fut = self.be.__class__.read_async(self.be, buf, off)
        if self.how == "short":
            fut._want += 1                  # the future now fails as a short read
        else:
            class Err:
                def done(self):
                    return True

                def result(self, timeout=None):
                    raise OSError(errno.EIO, "injected")
            fut.result()
            np.asarray(buf)[:] = 0x5A       # garbage in the buffer: never served
            return Err()
        return fut


@pytest.mark.parametrize("how", ["eio", "short"])
def test_a_failed_read_ahead_is_never_data(data_dir, rng, how):
    with _store(data_dir) as st:
        ts, ref = _filled(st, rng, 1)
        t = ts[0]
        be = st.backend_of(t)
        be.read_async = _FailingReads(be, how)
        assert st.prefetch(t)
        got = st.read(t)                    # from the device, not the buffer
        assert (got.view(np.uint16) == ref[t.id].view(np.uint16)).all()
        r = st.readahead_report()
        assert r["failed"] == 1 and r["served"] == 0


def test_group1_and_zero_slots_read_nothing_ahead(data_dir, rng):
    with KVStore(str(data_dir), mode="dual", budget=1 << 30, readahead=2) as st:
        ts, _ = _filled(st, rng, 1)
        assert ts[0].group != DIRECT and not st.prefetch(ts[0])
    with _store(data_dir, readahead=0) as st:
        ts, _ = _filled(st, rng, 1)
        assert not st.prefetch(ts[0]) and st.readahead_report() is None
    with pytest.raises(ValueError, match="readahead"):
        KVStore(str(data_dir), readahead=-1)


def test_budget_counts_the_buffers_before_they_exist(data_dir, rng):
    with KVStore(str(data_dir), mode="dual", readahead=3) as st:
        st.allocate(0, SHAPE, np.float16)
        assert st.readahead_bytes_to_alloc() == 3 * 96 * 512
    with _store(data_dir, readahead=3) as st:
        ts, _ = _filled(st, rng, 1)
        st.prefetch(ts[0])
        assert st.readahead_bytes_to_alloc() == 2 * 96 * 512


def test_moves_between_the_groups_drop_it(data_dir, rng):
    # Group 1 in memory: layer 1 in Group 2, read ahead, then promoted
    with KVStore(str(data_dir), mode="dual", group1="memory", budget=2 * 96 * 512 + 4096,
                 readahead=2, guard=0) as st:
        ts, ref = _filled(st, rng, 2)
        g2 = [t for t in ts if t.group == DIRECT]
        assert g2 and st.prefetch(g2[0])
        st.budget_override = 1 << 30
        assert st.rebalance()["promoted"]
        for t in ts:
            got = st.read(t)
            assert (got.view(np.uint16) == ref[t.id].view(np.uint16)).all()
        assert st.readahead_report()["served"] == 0


def test_concurrent_writes_reads_and_read_aheads(fs_dir, rng):
    """Threads write random rows, read ahead and read random ranges of a few
    tensors at once; each tensor's writes and reads are ordered by a lock of its
    own (as a decode step orders them), read-aheads are not: every read must be
    the reference."""
    with _store(fs_dir, readahead=3) as st:
        ts, ref = _filled(st, rng, 3)
        locks = {t.id: threading.Lock() for t in ts}
        errors: list[BaseException] = []
        seeds = rng.integers(0, 1 << 32, 4)

        def worker(seed):
            r = np.random.default_rng(seed)
            try:
                for _ in range(150):
                    t = ts[int(r.integers(len(ts)))]
                    a = int(r.integers(0, 90))
                    b = int(r.integers(a + 1, 97))
                    op = r.integers(3)
                    if op == 0:
                        st.prefetch(t, int(r.integers(0, a + 1)), 96)
                        continue
                    with locks[t.id]:
                        if op == 1:
                            new = _rand(r, (b - a,) + SHAPE[1:])
                            st.write(t, a, new)
                            ref[t.id][a:b] = new
                        else:
                            got = st.read(t, a, b)
                            want = ref[t.id][a:b]
                            assert (got.view(np.uint16) == want.view(np.uint16)).all(), \
                                (t.id, a, b)
            except BaseException as e:
                errors.append(e)

        th = [threading.Thread(target=worker, args=(int(s),)) for s in seeds]
        for x in th:
            x.start()
        for x in th:
            x.join()
        assert not errors, errors[:1]
        r = st.readahead_report()
        assert r["served"] > 0 and r["stale"] > 0, r
        for t in ts:
            got = st.read(t)
            assert (got.view(np.uint16) == ref[t.id].view(np.uint16)).all()


def test_no_buffer_means_no_read_ahead_not_an_error(data_dir, rng, monkeypatch):
    """A read-ahead buffer that cannot be made (pinning refused, memory short)
    reads nothing ahead; the read goes to the device and is exact."""
    with _store(data_dir) as st:
        ts, ref = _filled(st, rng, 1)

        def refuse(nbytes):
            raise OSError(12, "injected: no pinned memory")
        monkeypatch.setattr(st, "_ahead_relay", refuse)
        assert not st.prefetch(ts[0])
        got = st.read(ts[0])
        assert (got.view(np.uint16) == ref[ts[0].id].view(np.uint16)).all()
        assert st.readahead_report()["no_buffer"] == 1


@pytest.mark.parametrize("strategy", ["overlap-intra", "overlap-cross"])
def test_copy_jobs_take_it_into_their_destination(fs_dir, rng, strategy):
    """The adaptive pipeline's copy jobs (host destinations): rows read ahead go
    straight into the destination, the rest through the relays; every byte is
    the reference under both strategies."""
    from phx.kv import AdaptivePipeline
    with _store(fs_dir, readahead=3) as st:
        ts, ref = _filled(st, rng, 3)
        pipe = AdaptivePipeline(threads=2, strategy=strategy, relays=st.relays())
        try:
            for step in range(2):
                outs = [np.zeros((70,) + SHAPE[1:], np.float16) for _ in ts]
                for t in ts[1:4]:
                    assert st.prefetch(t, 0, 70)
                jobs = [st.copy_job(t, 0, 70, o) for t, o in zip(ts, outs)]
                assert pipe.run(jobs) == len(ts) * 70 * 512
                for t, o in zip(ts, outs):
                    assert (o.view(np.uint16) == ref[t.id][:70].view(np.uint16)).all(), t
        finally:
            pipe.close()
        assert st.readahead_report()["served"] == 6
