"""The live replay's scheduler (``phx.bench._lmcache_live.serve``) with fake
I/O and compute that sleep (so they release the GIL as the real ones do):
sessions really run at once, one prefill at a time, never more KV buffers in
use than there are, every request's TTFT covers its waits, load and
prefill, stores follow the chunks each request completed, a failed load is a
miss that prefills the whole context and never reaches a byte check.  No GPU
needed; the GPU run is ``phx bench lmcache --mode live`` on the H200."""
from __future__ import annotations

import threading
import time

import pytest

from phx.bench._lmcache_live import served, serve, summarise
from phx.bench._lmcache_replay import TOKENS_PER_CHUNK, make_trace


class FakeOps:
    chunk_bytes = 1 << 20

    def __init__(self, fail_session: int | None = None, buffers: int = 2) -> None:
        self.lock = threading.Lock()
        self.fail_session = fail_session
        self.buffers = buffers
        self.in_buffer: dict[int, tuple[int, int]] = {}   # buf -> (session, chunks)
        self.busy_buffers: set[int] = set()
        self.max_buffers = 0
        self.loading = self.max_loading = 0
        self.prefilling = self.max_prefilling = 0
        self.load_during_prefill = 0
        self.prefills: list[tuple[int, int, int]] = []
        self.stores: list[tuple[int, int, int]] = []
        self.checks: list[tuple[int, int, bool]] = []

    def load(self, buf: int, session: int, n: int) -> None:
        with self.lock:
            assert buf not in self.busy_buffers, "a buffer given to two requests"
            self.busy_buffers.add(buf)
            self.max_buffers = max(self.max_buffers, len(self.busy_buffers))
            self.loading += 1
            self.max_loading = max(self.max_loading, self.loading)
            if self.prefilling:
                self.load_during_prefill += 1
        try:
            time.sleep(0.002 * n)
            if session == self.fail_session:
                self.in_buffer[buf] = (-1, n)       # garbage: must never be checked as good
                raise OSError(5, "injected EIO")
            self.in_buffer[buf] = (session, n)
        finally:
            with self.lock:
                self.loading -= 1
                self.busy_buffers.discard(buf)

    def store(self, session: int, first: int, n: int) -> None:
        time.sleep(0.001 * n)
        with self.lock:
            self.stores.append((session, first, n))

    def prefill(self, buf: int, n: int, new_tokens: int) -> None:
        with self.lock:
            self.prefilling += 1
            self.max_prefilling = max(self.max_prefilling, self.prefilling)
            self.prefills.append((buf, n, new_tokens))
        time.sleep(0.01)
        with self.lock:
            self.prefilling -= 1

    def check(self, buf: int, session: int, n: int) -> bool:
        ok = self.in_buffer.get(buf) == (session, n)
        with self.lock:
            self.checks.append((session, n, ok))
        return ok


def _trace():
    # think times shrunk: many requests per session inside a short window
    trace = make_trace(6, 30, 0.125, 3)
    for s in trace:
        for r in s:
            r["think_s"] *= 0.02
    return trace


def test_sessions_run_at_once_one_prefill_at_a_time():
    trace = _trace()
    ops = FakeOps(buffers=2)
    recs = serve(trace, 4, 1.5, 1, ops, buffers=2, stagger=0.1)
    assert len(recs) >= 20 and {r["session"] for r in recs} == {0, 1, 2, 3}
    # concurrency is real: loads overlap each other and the engine's prefills
    assert ops.max_loading == 2 and ops.load_during_prefill > 0
    assert ops.max_prefilling == 1 and ops.max_buffers <= 2
    for r in recs:
        parts = r["buffer_wait_s"] + r["load_s"] + r["engine_wait_s"] + r["prefill_s"]
        assert r["ttft_s"] >= parts - 1e-6 and r["ttft_s"] >= r["prefill_s"] >= 0.009
        req = trace[r["session"]][r["round"]]
        assert r["chunks"] == req["prefix"] // TOKENS_PER_CHUNK and r["miss"] is None
        assert r["stored"] == (req["prefix"] + req["new"]) // TOKENS_PER_CHUNK - r["chunks"]
    # each prefill got the request's KV and its remaining tokens
    assert sum(n for _, n, _ in ops.prefills) == sum(r["chunks"] for r in recs)
    assert sum(n for _, _, n in ops.stores) == sum(r["stored"] for r in recs)
    # every 5th request of a session with KV is checked, and passes
    assert ops.checks and all(ok for _, _, ok in ops.checks)
    s = summarise(recs, 4, ops.chunk_bytes, 5.0, 1.5)
    assert s["requests"] == len(recs) and s["sessions_seen"] == 4
    assert s["ttft_p50_s"] <= s["ttft_p99_s"] <= s["ttft_max_s"]
    assert s["bad_requests"] == 0 and s["misses"] == 0 and s["within_limit"] == 1.0
    assert s["loaded_gb"] == pytest.approx(sum(r["chunks"] for r in recs) * (1 << 20) / 1e9)


def test_fewer_buffers_than_sessions_queue_for_one():
    ops = FakeOps(buffers=1)
    recs = serve(_trace(), 3, 1.0, 2, ops, buffers=1, stagger=0.0)
    assert ops.max_loading == 1 and ops.max_buffers == 1
    assert max(r["buffer_wait_s"] for r in recs) > 0.005


def test_a_failed_load_is_a_miss_that_recomputes():
    trace = _trace()
    ops = FakeOps(fail_session=1, buffers=2)
    recs = serve(trace, 3, 1.0, 4, ops, buffers=2, stagger=0.0)
    failed = [r for r in recs if r["session"] == 1 and r["miss"]]
    assert failed and all("injected EIO" in r["miss"] for r in failed)
    for r in failed:
        req = trace[1][r["round"]]
        assert r["chunks"] == 0 and r["checked"] is None
    # the whole context was prefilled for them, and nothing failed was checked
    whole = {req["prefix"] + req["new"] for req in trace[1]}
    assert any(n == 0 and t in whole for _, n, t in ops.prefills)
    assert all(sess != 1 for sess, _, _ in ops.checks)
    s = summarise(recs, 3, ops.chunk_bytes, 5.0, 1.0)
    assert s["misses"] == len(failed) and s["bad_requests"] == 0
    assert s["miss_reasons"] and "injected EIO" in s["miss_reasons"][0]


def test_a_failing_prefill_is_raised_not_hidden():
    class Broken(FakeOps):
        def prefill(self, buf, n, new_tokens):
            raise RuntimeError("CUDA error: an illegal memory access")
    with pytest.raises(RuntimeError, match="illegal memory access"):
        serve(_trace(), 2, 0.3, 5, Broken(), buffers=2, stagger=0.0)


def test_a_failing_check_gives_its_buffer_back():
    # one buffer, three sessions: a session that dies holding the buffer
    # must not leave the other two waiting for it (serve would never return)
    class BadCheck(FakeOps):
        def check(self, buf, session, n):
            if session == 0:
                raise RuntimeError("CUDA error: device-side assert")
            return super().check(buf, session, n)
    ops = BadCheck(buffers=1)
    t = threading.Thread(target=lambda: pytest.raises(
        RuntimeError, serve, _trace(), 3, 0.8, 6, ops, buffers=1, stagger=0.0), daemon=True)
    t.start()
    t.join(30)
    assert not t.is_alive(), "serve hung after a session failed holding a KV buffer"
    assert len(ops.prefills) > 1      # the others went on after it failed


def test_served_is_the_largest_concurrency_within_the_limit():
    lv = [{"concurrency": 1, "requests": 9, "ttft_p99_s": 0.5},
          {"concurrency": 4, "requests": 9, "ttft_p99_s": 4.9},
          {"concurrency": 8, "requests": 9, "ttft_p99_s": 7.0},
          {"concurrency": 16, "requests": 0, "ttft_p99_s": 0.0}]
    assert served(lv, 5.0) == 4 and served(lv, 0.1) == 0


def test_a_method_named_twice_keeps_both_runs() -> None:
    """``--replay-methods host-odirect,phx,host-odirect`` (the same baseline
    before and after, for drift): both of its runs are kept, under distinct
    names, and a failing run is recorded under its own name."""
    from phx.bench._lmcache_replay import each_method
    calls: list[str] = []

    def run(name: str) -> dict:
        calls.append(name)
        if name == "bad":
            raise RuntimeError("no such backend")
        return {"method": name, "n": len(calls)}

    notes: dict[str, str] = {}
    res = each_method("host-odirect,phx,host-odirect,bad,bad", "zram", "live", notes, run)
    assert calls == ["host-odirect", "phx", "host-odirect", "bad", "bad"]
    assert [(r["method"], r["n"]) for r in res] == [("host-odirect", 1), ("phx", 2),
                                                    ("host-odirect#2", 3)]
    assert sorted(notes) == ["live-zram-bad", "live-zram-bad#2"]


def test_every_method_warms_up_on_kv_at_the_traces_sizes() -> None:
    """Before timing, each method's ``GpuOps`` prefills on top of KV from its
    own buffer 0, at the trace's smallest, middle and largest loads (never
    more chunks than a buffer holds) and at its largest prompt."""
    from phx.bench._lmcache_live import GpuOps
    from phx.bench._lmcache_replay import slab_layout
    trace = make_trace(4, 5, 0.125, 7)
    _, _, maxload = slab_layout(trace)
    ops = GpuOps.__new__(GpuOps)
    calls: list[tuple[int, int, int]] = []
    ops.prefill = lambda buf, n, t: calls.append((buf, n, t))   # type: ignore[method-assign]
    ops.warm_up(trace)
    loads = sorted({r["prefix"] // TOKENS_PER_CHUNK for s in trace for r in s} - {0})
    biggest = max(r["prefix"] + r["new"] - r["prefix"] // TOKENS_PER_CHUNK * TOKENS_PER_CHUNK
                  for s in trace for r in s)
    assert {b for b, _, _ in calls} == {0}
    assert {n for _, n, _ in calls} == {loads[0], loads[len(loads) // 2], maxload}
    assert {t for _, _, t in calls} == {16, biggest}
    assert all(n <= maxload for _, n, _ in calls)
