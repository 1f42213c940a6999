"""Engine counters (engine.stats(), phx.stats()): the caller can see which
path moved the bytes -- direct, bounce or buffered -- as the contract says."""
from __future__ import annotations

import os

import pytest

import phx
from conftest import KiB, MiB, assert_same, fresh_bytes, write_file

KEYS = {"reads", "writes", "bytes_read", "bytes_written", "direct_bytes", "bounce_bytes",
        "buffered_bytes", "bounce_ios", "rmw_ios", "short_ios", "fixed_buf_ios", "sqes",
        "submits", "errors"}


@pytest.fixture
def src(data_dir, rng):
    path = os.path.join(data_dir, "src")
    data = fresh_bytes(rng, 4 * MiB + 4096)
    write_file(path, data)
    return path, data


def delta(eng, fn):
    before = eng.stats()
    fn()
    after = eng.stats()
    return {k: after[k] - before[k] for k in KEYS}


def test_stats_keys_and_types(engine):
    st = engine.stats()
    assert isinstance(st, dict)
    missing = KEYS - set(st)
    assert not missing, f"missing counters: {sorted(missing)}"
    for k in KEYS:
        assert isinstance(st[k], int) and st[k] >= 0, (k, st[k])
    assert "reserved" not in st


def test_fresh_engine_counters_zero(engine):
    st = engine.stats()
    assert all(st[k] == 0 for k in KEYS), st


def test_aligned_read_is_direct(engine, src):
    path, data = src
    buf = phx.empty_aligned(1 * MiB)
    with phx.open(path, "r", engine=engine) as f:
        d = delta(engine, lambda: f.pread(buf, 4096))
    assert_same(buf, data[4096:4096 + 1 * MiB])
    assert d["reads"] == 1
    assert d["bytes_read"] == 1 * MiB
    assert d["direct_bytes"] == 1 * MiB
    assert d["bounce_bytes"] == 0 and d["bounce_ios"] == 0
    assert d["buffered_bytes"] == 0
    assert d["sqes"] >= 1 and d["submits"] >= 1
    assert d["errors"] == 0


def test_aligned_write_is_direct(engine, data_dir, rng):
    path = os.path.join(data_dir, "w")
    buf = phx.empty_aligned(256 * KiB)
    memoryview(buf)[:] = fresh_bytes(rng, 256 * KiB)
    with phx.open(path, "w", engine=engine) as f:
        d = delta(engine, lambda: f.pwrite(buf, 8192))
    assert d["writes"] == 1 and d["bytes_written"] == 256 * KiB
    assert d["direct_bytes"] == 256 * KiB
    assert d["bounce_bytes"] == 0 and d["bounce_ios"] == 0 and d["rmw_ios"] == 0


@pytest.mark.parametrize("mis,off", [(1, 0), (0, 1), (7, 4097), (0, 4096 + 100)])
def test_unaligned_read_uses_bounce(engine, src, mis, off):
    """Unaligned memory, offset or length: bytes go through the bounce buffers
    (never the page cache) and bounce_ios/bounce_bytes say so."""
    path, data = src
    n = 100_000
    whole = phx.empty_aligned(n + 4096)
    view = memoryview(whole)[mis:mis + n]
    with phx.open(path, "r", engine=engine) as f:
        d = delta(engine, lambda: f.pread(view, off))
    assert_same(view, data[off:off + n])
    assert d["reads"] == 1 and d["bytes_read"] == n
    assert d["bounce_ios"] >= 1
    assert d["bounce_bytes"] > 0
    assert d["buffered_bytes"] == 0
    # every byte was moved by exactly one path (bounce may round up to blocks)
    assert d["direct_bytes"] + d["bounce_bytes"] >= n
    assert d["direct_bytes"] <= n


def test_misaligned_memory_whole_request_bounced(engine, src):
    """Memory address not congruent with the file offset: the whole request
    goes through bounce buffers."""
    path, data = src
    n = 64 * KiB
    whole = phx.empty_aligned(n + 4096)
    view = memoryview(whole)[3:3 + n]
    with phx.open(path, "r", engine=engine) as f:
        d = delta(engine, lambda: f.pread(view, 8192))
    assert_same(view, data[8192:8192 + n])
    assert d["direct_bytes"] == 0
    assert d["bounce_bytes"] >= n


def test_partial_block_write_counts_rmw(engine, src, rng):
    path, data = src
    new = fresh_bytes(rng, 100)
    with phx.open(path, "r+", engine=engine) as f:
        d = delta(engine, lambda: f.pwrite(new, 5000))
    assert d["writes"] == 1 and d["bytes_written"] == 100
    assert d["rmw_ios"] >= 1
    assert d["bounce_ios"] >= 1
    with open(path, "rb") as g:
        got = g.read()
    assert_same(got, data[:5000] + new + data[5100:])


def test_buffered_file_counts_buffered(engine, src, data_dir, rng):
    path, data = src
    buf = bytearray(123_457)
    with phx.open(path, "r+", direct=False, engine=engine) as f:
        d = delta(engine, lambda: f.pread(buf, 11))
        new = fresh_bytes(rng, 5000)
        d2 = delta(engine, lambda: f.pwrite(new, 3))
    assert_same(buf, data[11:11 + 123_457])
    assert d["buffered_bytes"] == 123_457
    assert d["direct_bytes"] == 0 and d["bounce_bytes"] == 0 and d["bounce_ios"] == 0
    assert d["reads"] == 1 and d["bytes_read"] == 123_457
    assert d2["buffered_bytes"] == 5000 and d2["writes"] == 1 and d2["bytes_written"] == 5000
    assert d2["bounce_bytes"] == 0 and d2["rmw_ios"] == 0


def test_large_request_split_into_chunks(src):
    path, data = src
    eng = phx.Engine(max_io_size=64 * KiB, queue_depth=8)
    buf = phx.empty_aligned(4 * MiB)
    with phx.open(path, "r", engine=eng) as f:
        d = delta(eng, lambda: f.pread(buf, 0))
    assert_same(buf, data[:4 * MiB])
    assert d["reads"] == 1
    assert d["sqes"] >= 4 * MiB // (64 * KiB)
    assert d["direct_bytes"] == 4 * MiB


def test_short_read_at_eof_counts(engine, src):
    path, data = src
    with phx.open(path, "r", engine=engine) as f:
        d = delta(engine, lambda: f.pread(phx.empty_aligned(1 * MiB), len(data) - 4096))
    assert d["reads"] == 1
    assert d["bytes_read"] == 4096


def test_batch_submits_together(engine, src):
    path, data = src
    reqs = [(phx.empty_aligned(4096), i * 4096) for i in range(100)]
    with phx.open(path, "r", engine=engine) as f:
        d = delta(engine, lambda: f.pread_batch(reqs))
    assert d["reads"] == 100 and d["bytes_read"] == 100 * 4096
    assert d["submits"] <= 10, f"100 requests at QD 128 took {d['submits']} io_uring submits"


def test_register_buffer_uses_fixed(engine, src):
    path, data = src
    buf = phx.empty_aligned(1 * MiB)
    try:
        engine.register_buffer(buf)
    except OSError as e:
        pytest.skip(f"cannot register a fixed buffer here: {e}")
    try:
        with phx.open(path, "r", engine=engine) as f:
            d = delta(engine, lambda: f.pread(buf, 0))
            sub = memoryview(buf)[4096:4096 + 64 * KiB]
            d2 = delta(engine, lambda: f.pread(sub, 64 * KiB))
        assert_same(memoryview(buf)[:4096], data[:4096])
        assert_same(sub, data[64 * KiB:128 * KiB])
        if engine.backend == "threads":   # registration kept, nothing fixed (be_threads.c)
            assert d["fixed_buf_ios"] == 0 and d2["fixed_buf_ios"] == 0
        else:
            assert d["fixed_buf_ios"] >= 1 and d2["fixed_buf_ios"] >= 1
        assert d["direct_bytes"] == 1 * MiB
    finally:
        engine.unregister_buffer(buf)
    with phx.open(path, "r", engine=engine) as f:
        d3 = delta(engine, lambda: f.pread(buf, 0))
    assert d3["fixed_buf_ios"] == 0
    assert_same(buf, data[:1 * MiB])


def test_default_engine_and_phx_stats(src):
    path, data = src
    e1 = phx.default_engine()
    assert isinstance(e1, phx.Engine)
    assert phx.default_engine() is e1
    before = phx.stats()
    assert KEYS <= set(before)
    with phx.open(path, "r") as f:  # no engine= : the default engine
        f.pread(bytearray(10), 1)
    after = phx.stats()
    assert after["reads"] == before["reads"] + 1
    assert after["bytes_read"] == before["bytes_read"] + 10


def test_engine_config_kwargs(src):
    path, data = src
    for kw in [dict(queue_depth=1), dict(queue_depth=1024), dict(max_io_size=4096),
               dict(bounce_size=4096, bounce_count=1), dict(bounce_size=8 * MiB, bounce_count=2)]:
        eng = phx.Engine(**kw)
        with phx.open(path, "r", engine=eng) as f:
            b = bytearray(300_001)
            assert f.pread(b, 4095) == 300_001, kw
        assert_same(b, data[4095:4095 + 300_001], str(kw))
