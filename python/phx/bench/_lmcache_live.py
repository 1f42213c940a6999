"""Measured concurrency for the agentic replay: ``phx bench lmcache --mode live``.

``--mode replay`` times every request alone and then *computes* what C
concurrent sessions would see from a FIFO queue model.  This mode runs them:
C sessions at once on one GPU, through real LMCache, for ``--live-seconds``
per concurrency, on the same trace and model as the replay.

* **Sessions** (one thread each) start at a random round of their trace (a
  service in its steady state, not every session at its first prompt),
  staggered over the first 2 s.  A request: take a KV buffer (the GPU's KV
  memory: ``--live-kv-buffers`` buffers, each as large as the trace's largest
  prefix; a request waits for one as vLLM's scheduler waits for free blocks),
  load the prefix chunks from the slab through the method on the session's
  own CUDA stream (LMCache's connector loads asynchronously, beside other
  requests' compute), hand the prefill to the engine and wait for it.  TTFT =
  prefill done - arrival.  Then the session stores the chunks its new tokens
  completed (real writes beside the other sessions' loads; the same bytes the
  slab already holds, so that the byte checks stay valid), thinks for the
  trace's think time and sends its next request.  A session at the end of
  its trace starts it again.
* **The engine** (one thread) runs the prefills one at a time, first come
  first served, on its own stream: one GPU running one forward at a time.
  vLLM would batch prefills of several requests; that is not modelled.
* **A load that fails is a miss**: the request prefills its whole context
  (what vLLM does when LMCache's retrieve fails) and is counted; it never
  reads what the failed load left in the buffer.
* Every 5th request of a session has its loaded chunks compared byte for
  byte with the pattern they were stored from, after its prefill.

Every request that arrived inside the window runs to completion; its TTFT is
counted.  Reported per method and concurrency: TTFT p50/p90/p99, the share
within ``--ttft-limit``, requests, mean KV load and waits (for a buffer, for
the engine), GB loaded and stored, misses, byte checks; and per method the
largest concurrency whose p99 TTFT is within the limit ("sessions served").
Methods run one after another (each with the GPU to itself).

The scheduler (``serve``) takes its I/O and compute as callables
(``LiveOps``), so that it is tested on the CPU with fake ones
(tests/test_lmcache_live.py); ``run_live`` gives it the real ones.
"""
from __future__ import annotations

import argparse
import os
import queue
import random
import sys
import threading
import time
from typing import Any, Protocol

from phx.bench._lmcache_replay import TOKENS_PER_CHUNK

CHECK_EVERY = 5


def add_arguments(p: argparse.ArgumentParser) -> None:
    from phx.bench._common import checked, csv, positive_float, positive_int
    g = p.add_argument_group("live (measured concurrency; with the replay's trace options)")
    g.add_argument("--live-concurrency", type=checked(csv(positive_int)), default="1,2,4,8,16",
                   help="concurrent sessions, each run for --live-seconds (default 1,2,4,8,16)")
    g.add_argument("--live-seconds", type=positive_float, default=20.0,
                   help="seconds of arrivals per concurrency (default 20)")
    g.add_argument("--live-kv-buffers", type=positive_int, default=8,
                   help="KV buffers on the GPU, each the largest prefix (default 8)")


class LiveOps(Protocol):
    """What a session and the engine do; ``session`` is a trace index."""

    chunk_bytes: int

    def load(self, buf: int, session: int, n: int) -> None:
        """Chunks 0..n-1 of the session's slab range into buffer ``buf``; raises on failure."""

    def store(self, session: int, first: int, n: int) -> None:
        """The session's chunks first..first+n-1 into the slab."""

    def prefill(self, buf: int, n: int, new_tokens: int) -> None:
        """Prefill ``new_tokens`` on the first ``n`` chunks of buffer ``buf``."""

    def check(self, buf: int, session: int, n: int) -> bool:
        """Whether buffer ``buf`` holds the session's chunks 0..n-1 exactly."""


def _engine(jobs: queue.Queue, ops: LiveOps) -> None:
    """Prefills one at a time, in arrival order, until a None job."""
    while True:
        job = jobs.get()
        if job is None:
            return
        job["start"] = time.perf_counter()
        try:
            ops.prefill(job["buf"], job["n"], job["new"])
        except BaseException as e:  # noqa: BLE001 - reported by the session
            job["error"] = f"{type(e).__name__}: {e}"
        job["end"] = time.perf_counter()
        job["done"].set()


def serve(trace: list[list[dict]], conc: int, seconds: float, seed: int, ops: LiveOps,
          buffers: int, stagger: float = 2.0) -> list[dict]:
    """Run ``conc`` sessions (session k plays trace[k % len(trace)]) for
    ``seconds`` of arrivals; returns one record per request (see the module
    docstring).  Raises if a session or the engine failed other than by a
    load (a load failure is a miss)."""
    free: queue.Queue = queue.Queue()
    for b in range(buffers):
        free.put(b)
    jobs: queue.Queue = queue.Queue()
    records: list[dict] = []
    failures: list[str] = []
    lock = threading.Lock()
    t0 = time.perf_counter()
    end = t0 + seconds

    def request(k: int, si: int, r: int, nreq: int) -> dict:
        req = trace[si][r]
        n = req["prefix"] // TOKENS_PER_CHUNK
        arrival = time.perf_counter()
        buf = free.get()
        # the buffer goes back whatever happens: a session that failed holding
        # it would leave the others waiting for it for ever
        try:
            got = time.perf_counter()
            miss = None
            try:
                if n:
                    ops.load(buf, si, n)
            except Exception as e:  # noqa: BLE001 - a failed retrieve: recompute
                miss = f"{type(e).__name__}: {e}"
            loaded = time.perf_counter()
            kv = 0 if miss else n
            job = {"buf": buf, "n": kv,
                   "new": req["prefix"] + req["new"] - kv * TOKENS_PER_CHUNK,
                   "done": threading.Event()}
            jobs.put(job)
            job["done"].wait()
            checked = None
            if kv and nreq % CHECK_EVERY == 0 and "error" not in job:
                checked = ops.check(buf, si, kv)
        finally:
            free.put(buf)
        if "error" in job:
            raise RuntimeError(f"prefill failed: {job['error']}")
        done_chunks = (req["prefix"] + req["new"]) // TOKENS_PER_CHUNK
        ts = time.perf_counter()
        if done_chunks > n:
            ops.store(si, n, done_chunks - n)
        return {"session": k, "round": r, "arrival_s": arrival - t0,
                "ttft_s": job["end"] - arrival, "buffer_wait_s": got - arrival,
                "load_s": loaded - got, "engine_wait_s": job["start"] - loaded,
                "prefill_s": job["end"] - job["start"], "chunks": kv,
                "stored": max(0, done_chunks - n), "store_s": time.perf_counter() - ts,
                "miss": miss, "checked": checked}

    def session(k: int) -> None:
        rng = random.Random(seed * 1_000_003 + k)
        si = k % len(trace)
        r = rng.randrange(len(trace[si]))
        nreq = 0
        time.sleep(max(0.0, t0 + rng.uniform(0.0, stagger) - time.perf_counter()))
        try:
            while time.perf_counter() < end:
                rec = request(k, si, r, nreq)
                with lock:
                    records.append(rec)
                nreq += 1
                r = (r + 1) % len(trace[si])
                # the think time runs from the answer (the prefill), the store inside it
                wake = t0 + rec["arrival_s"] + rec["ttft_s"] + trace[si][r]["think_s"]
                time.sleep(max(0.0, min(wake, end) - time.perf_counter()))
        except BaseException as e:  # noqa: BLE001 - raised below, in the caller
            with lock:
                failures.append(f"session {k}: {type(e).__name__}: {e}")

    eng = threading.Thread(target=_engine, args=(jobs, ops), name="live-engine", daemon=True)
    eng.start()
    threads = [threading.Thread(target=session, args=(k,), name=f"live-session-{k}",
                                daemon=True) for k in range(conc)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    jobs.put(None)
    eng.join()
    if failures:
        raise RuntimeError("; ".join(failures))
    return sorted(records, key=lambda x: x["arrival_s"])


def _pct(xs: list[float], q: float) -> float:
    return xs[min(len(xs) - 1, int(q * (len(xs) - 1) + 0.5))] if xs else 0.0


def summarise(records: list[dict], conc: int, chunk_bytes: int, limit: float,
              seconds: float) -> dict[str, Any]:
    """One concurrency's figures from its request records."""
    tt = sorted(r["ttft_s"] for r in records)
    n = max(1, len(records))

    def mean(f: str) -> float:
        return sum(r[f] for r in records) / n
    checked = [r for r in records if r["checked"] is not None]
    return {"concurrency": conc, "requests": len(records),
            "sessions_seen": len({r["session"] for r in records}),
            "ttft_p50_s": _pct(tt, 0.5), "ttft_p90_s": _pct(tt, 0.9),
            "ttft_p99_s": _pct(tt, 0.99), "ttft_max_s": tt[-1] if tt else 0.0,
            "within_limit": sum(x <= limit for x in tt) / n,
            "load_s_mean": mean("load_s"), "prefill_s_mean": mean("prefill_s"),
            "engine_wait_s_mean": mean("engine_wait_s"),
            "buffer_wait_s_mean": mean("buffer_wait_s"),
            "loaded_gb": sum(r["chunks"] for r in records) * chunk_bytes / 1e9,
            "stored_gb": sum(r["stored"] for r in records) * chunk_bytes / 1e9,
            "load_gbps": sum(r["chunks"] for r in records) * chunk_bytes / 1e9 /
            max(1e-9, sum(r["load_s"] for r in records)),
            "misses": sum(1 for r in records if r["miss"]),
            "miss_reasons": sorted({r["miss"] for r in records if r["miss"]})[:3],
            "checked_requests": len(checked),
            "bad_requests": sum(1 for r in checked if not r["checked"]),
            "window_s": seconds}


def served(levels: list[dict], limit: float) -> int:
    """The largest concurrency whose p99 TTFT is within the limit (0: none)."""
    return max((s["concurrency"] for s in levels if s["requests"] and s["ttft_p99_s"] <= limit),
               default=0)


# ---------------------------------------------------------------------------
# The real ones: LMCache's transfer paths on the GPU, the replay's model
# ---------------------------------------------------------------------------

class GpuOps:
    """``LiveOps`` on a method of ``_lmcache_methods``: KV buffers are ranges of
    one GPU pool, each session thread has its own CUDA stream, the engine
    another."""

    def __init__(self, m, pattern, kv, maxload: int, bases: list[int], prefill) -> None:
        import torch
        self.m, self.pattern, self.kv = m, pattern, kv
        self.maxload, self.bases, self.prefill_fn = maxload, bases, prefill
        self.chunk_bytes = pattern.chunk
        self._local = threading.local()
        self._engine_stream = torch.cuda.Stream()

    def _stream(self):
        s = getattr(self._local, "stream", None)
        if s is None:
            import torch
            s = self._local.stream = torch.cuda.Stream()
        return s

    def load(self, buf: int, session: int, n: int) -> None:
        base = self.bases[session]
        self.m.transfer(self.kv, [(buf * self.maxload + c, base + c) for c in range(n)],
                        False, self._stream())

    def store(self, session: int, first: int, n: int) -> None:
        base = self.bases[session]
        self.m.transfer(self.pattern, [((base + c) % 97, base + c)
                                       for c in range(first, first + n)], True, self._stream())

    def prefill(self, buf: int, n: int, new_tokens: int) -> None:
        import torch
        with torch.cuda.stream(self._engine_stream):
            self.prefill_fn(self.kv.t[buf * self.maxload * self.chunk_bytes:], n, new_tokens)

    def warm_up(self, trace) -> None:
        """Prefills on top of KV, from the engine's stream, at the trace's
        smallest, middle and largest loads and at its largest prompt, before
        any request is timed: the first prefills on loaded KV meet new shapes
        and grow the caching allocator (which synchronises the device), and
        without this the first method of a run paid that in its TTFT (on the
        H100: p50 0.68 s at C = 1 first, 0.10 s second).  Every method gets the
        same warm-up, on its own KV buffers (their bytes do not matter here)."""
        reqs = [r for s in trace for r in s]
        loads = sorted({r["prefix"] // TOKENS_PER_CHUNK for r in reqs} - {0}) or [0]
        biggest = max(r["prefix"] + r["new"] - (r["prefix"] // TOKENS_PER_CHUNK)
                      * TOKENS_PER_CHUNK for r in reqs)
        for n in sorted({loads[0], loads[len(loads) // 2], loads[-1]}):
            for t in sorted({16, biggest}):
                self.prefill(0, n, t)

    def check(self, buf: int, session: int, n: int) -> bool:
        import torch
        base = self.bases[session]
        with torch.cuda.stream(self._stream()):
            return all(torch.equal(self.kv.slot(buf * self.maxload + c),
                                   self.pattern.slot((base + c) % 97)) for c in range(n))


def measure_live(args, name: str, directory: str, trace, shape, prefill,
                 notes: dict) -> dict | None:
    """One method through every concurrency; None (reason in notes) if it cannot start."""
    import shutil

    import torch
    from phx.bench._lmcache_methods import GPUPool
    from phx.bench._lmcache_replay import open_replay_method, prestore, slab_layout
    bases, total, maxload = slab_layout(trace)
    pattern = GPUPool(97, shape)
    pattern.fill_random(12345)
    kv = GPUPool(args.live_kv_buffers * maxload, shape)
    m = open_replay_method(name, directory, total * pattern.chunk, shape, [pattern, kv],
                           notes, "live")
    if m is None:
        return None
    try:
        prestore(m, pattern, total)
        ops = GpuOps(m, pattern, kv, maxload, bases, prefill)
        ops.warm_up(trace)
        levels = []
        for c in [int(x) for x in args.live_concurrency.split(",") if x]:
            recs = serve(trace, c, args.live_seconds, args.seed + c, ops, args.live_kv_buffers)
            s = summarise(recs, c, pattern.chunk, args.ttft_limit, args.live_seconds)
            levels.append(s)
            print(f"live {name} C={c}: {s['requests']} requests, TTFT p50 "
                  f"{s['ttft_p50_s']:.2f} p99 {s['ttft_p99_s']:.2f} s, load "
                  f"{s['load_s_mean']:.3f} s, engine wait {s['engine_wait_s_mean']:.3f} s, "
                  f"misses {s['misses']}, bad {s['bad_requests']}/{s['checked_requests']}",
                  file=sys.stderr)
        return {"method": m.name, "levels": levels,
                "sessions_served": served(levels, args.ttft_limit)}
    finally:
        m.close()
        del pattern, kv
        torch.cuda.empty_cache()
        shutil.rmtree(directory, ignore_errors=True)   # the next method needs the room


def run_live(args, device: str, directory: str, notes: dict) -> dict[str, Any]:
    """Every ``--replay-methods`` method at every ``--live-concurrency``."""
    from phx.bench._lmcache_methods import llama3_8b_chunk_shape
    from phx.bench._lmcache_replay import (Prefill, each_method, make_trace, trace_stats,
                                           warm_up)
    concs = [int(x) for x in args.live_concurrency.split(",") if x]
    shape = llama3_8b_chunk_shape(TOKENS_PER_CHUNK)
    # a profile of its own for every concurrent session
    trace = make_trace(max(args.sessions, max(concs)), args.rounds, args.token_scale, args.seed)
    out: dict[str, Any] = {"trace": trace_stats(trace), "token_scale": args.token_scale,
                           "ttft_limit_s": args.ttft_limit, "seconds": args.live_seconds,
                           "kv_buffers": args.live_kv_buffers, "methods": {}}
    try:
        prefill = Prefill(shape)
        out["model"] = prefill.kind
    except Exception as e:  # noqa: BLE001
        notes["live-model"] = f"{type(e).__name__}: {e}"
        return out
    warm_up(prefill, trace)
    for res in each_method(args.replay_methods, device, "live", notes, lambda name: measure_live(
            args, name, os.path.join(directory, "lmcache-live"), trace, shape, prefill, notes)):
        out["methods"][res["method"]] = res
    return out


def print_summary(device: str, rep: dict[str, Any]) -> None:
    from phx.bench._common import fmt_table
    ms = rep.get("methods", {})
    if not ms:
        print(f"live {device}: no method ran")
        return
    print(f"\nlive (measured) on {device}: {rep['seconds']:.0f} s of arrivals per "
          f"concurrency, {rep['kv_buffers']} KV buffers, one prefill at a time, token scale "
          f"{rep['token_scale']}")
    rows = []
    for name, m in ms.items():
        for s in m["levels"]:
            rows.append([name, s["concurrency"], s["requests"], f"{s['ttft_p50_s']:.2f}",
                         f"{s['ttft_p99_s']:.2f}", f"{s['within_limit']:.0%}",
                         f"{s['load_s_mean']:.3f}", f"{s['load_gbps']:.1f}",
                         f"{s['engine_wait_s_mean']:.3f}", f"{s['buffer_wait_s_mean']:.3f}",
                         f"{s['stored_gb']:.1f}", s["misses"],
                         f"{s['bad_requests']}/{s['checked_requests']}"])
    print(fmt_table(["method", "C", "requests", "TTFT p50 s", "TTFT p99 s",
                     f"<= {rep['ttft_limit_s']} s", "load s", "load GB/s", "engine wait s",
                     "buffer wait s", "stored GB", "misses", "bad/checked"], rows))
    for name, m in ms.items():
        print(f"live {device} {name}: sessions served with p99 TTFT <= {rep['ttft_limit_s']} s: "
              f"{m['sessions_served']}")


def plot(ax, rep: dict[str, Any]) -> None:
    """Measured p99 TTFT against concurrent sessions."""
    for name, m in rep.get("methods", {}).items():
        lv = m["levels"]
        ax.plot([s["concurrency"] for s in lv], [s["ttft_p99_s"] for s in lv], marker="o",
                label=f"{name} ({m['sessions_served']} served)")
    ax.axhline(rep.get("ttft_limit_s", 5.0), color="grey", ls="--")
    ax.set_xlabel("concurrent sessions (measured)")
    ax.set_ylabel("TTFT p99 (s)")
    ax.set_yscale("log")
    ax.legend()
