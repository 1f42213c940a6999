"""The agentic multi-round replay of ``phx bench lmcache --mode replay``.

A synthetic trace with the statistics the Phoenix/LMCache report gives for
Codex on SWE-bench Pro: a session starts with a 4-12K-token prompt, each
round adds hundreds to thousands of tokens (log-normal, median 1.8K times a
per-session factor, 200 to 8K: about 80K tokens by round 30 on average,
the largest near 180K), sessions end at 180K, a few
seconds (log-normal, median 3 s) pass between a round's answer and the next
request.  Every round but the first reuses the session's whole previous
context: LMCache holds it as 256-token chunks in the slab, so the prefix hit
rate comes out near the reported 94 % (printed).  ``--token-scale``
shrinks every token count (default 1/8) so that a run fits one GPU call;
the scale is in the results.

Per method, every session's KV chunks are stored once (random bytes, not
timed), the page cache is dropped, then every request runs alone on the
GPU, sessions interleaved round by round: its prefix chunks are loaded from
the slab through the method (timed: the KV load), then the model prefills
the new tokens plus the prefix's partial last chunk on top of the loaded
KV (timed: the prefill) — a randomly initialised Llama-3-8B-shaped model
(transformers, no download; 32 layers, 4096 hidden, 8 KV heads of 128,
bf16).  Loaded chunks are checked byte-exact against what was stored for a
sample of requests.

Serving many sessions at once is then computed, not run: one GPU serves
requests first come first served, a request's service time is what it
took alone (KV load + prefill), so its TTFT is its wait in the queue plus
that.  For C concurrent sessions (``--concurrency``), session k replays the
measured rounds of measured session k mod ``--sessions`` with its own start
time and think times; C is "served within the limit" when at least 90 % of
its requests have TTFT <= ``--ttft-limit`` (5 s).  Decode time is not
modelled (output is ~1/131 of the input in the trace).
"""
from __future__ import annotations

import argparse
import math
import os
import random
import sys
import time
from typing import Any

TOKENS_PER_CHUNK = 256
#: what _lmcache_methods.open_method opens
REPLAY_METHODS = ("phx", "cufile", "kvikio", "kvikio16", "kvikio64", "host-odirect",
                  "host-buffered")


def add_arguments(p: argparse.ArgumentParser) -> None:
    from phx.bench._common import any_int, checked, csv, positive_float, positive_int
    g = p.add_argument_group("replay")
    g.add_argument("--sessions", type=positive_int, default=6,
                   help="sessions measured (default 6)")
    g.add_argument("--rounds", type=positive_int, default=30,
                   help="rounds per session (default 30)")
    g.add_argument("--token-scale", type=positive_float, default=0.125,
                   help="multiply every token count (default 0.125)")
    g.add_argument("--concurrency", type=checked(csv(positive_int)),
                   default="1,2,4,8,12,16,24,32,48,64",
                   help="concurrent sessions to compute TTFT for")
    g.add_argument("--ttft-limit", type=positive_float, default=5.0,
                   help="seconds (default 5)")
    g.add_argument("--replay-methods", type=checked(csv(str, allowed=REPLAY_METHODS)),
                   default="phx,cufile,host-odirect,host-buffered",
                   help="of " + ",".join(REPLAY_METHODS))
    g.add_argument("--seed", type=any_int, default=1, help="trace seed (default 1)")


# ---------------------------------------------------------------------------
# Trace
# ---------------------------------------------------------------------------

def make_trace(sessions: int, rounds: int, scale: float, seed: int) -> list[list[dict]]:
    """Per session, per round: prefix tokens reused and new tokens."""
    rng = random.Random(seed)
    out = []
    for _ in range(sessions):
        ctx = int(rng.uniform(4000, 12000))
        # sessions differ in how fast they grow (a few reach the 180K end)
        median = 1800 * rng.lognormvariate(0.0, 0.4)
        rs = [{"prefix": 0, "new": ctx, "think_s": 0.0}]
        for _r in range(1, rounds):
            new = int(min(8000, max(200, rng.lognormvariate(math.log(median), 0.8))))
            if ctx + new > 180000:
                break
            rs.append({"prefix": ctx, "new": new,
                       "think_s": rng.lognormvariate(math.log(3.0), 0.5)})
            ctx += new
        for r in rs:
            r["prefix"] = int(r["prefix"] * scale)
            r["new"] = max(1, int(r["new"] * scale))
        out.append(rs)
    return out


def trace_stats(trace: list[list[dict]]) -> dict[str, Any]:
    ctx30 = [s[29]["prefix"] + s[29]["new"] for s in trace if len(s) >= 30]
    cached = sum((r["prefix"] // TOKENS_PER_CHUNK) * TOKENS_PER_CHUNK for s in trace for r in s)
    total = sum(r["prefix"] + r["new"] for s in trace for r in s)
    return {"sessions": len(trace), "requests": sum(len(s) for s in trace),
            "context_at_round_30_mean": sum(ctx30) / len(ctx30) if ctx30 else None,
            "context_max": max(r["prefix"] + r["new"] for s in trace for r in s),
            "new_tokens_mean": sum(r["new"] for s in trace for r in s[1:]) /
            max(1, sum(len(s) - 1 for s in trace)),
            "prefix_hit_rate": cached / total if total else 0.0}


# ---------------------------------------------------------------------------
# Model
# ---------------------------------------------------------------------------

class Prefill:
    """A random-weight Llama-3-8B-shaped model that prefills new tokens on
    top of KV loaded in LMCache's chunk layout."""

    def __init__(self, shape, device: str = "cuda", hidden: int = 4096,
                 intermediate: int = 14336) -> None:
        import torch
        from transformers import LlamaConfig, LlamaForCausalLM
        _, layers, _, hd = shape
        cfg = LlamaConfig(hidden_size=hidden, intermediate_size=intermediate,
                          num_hidden_layers=layers, num_attention_heads=hidden // 128,
                          num_key_value_heads=hd // 128, head_dim=128, vocab_size=128256,
                          max_position_embeddings=262144,
                          rope_parameters={"rope_type": "default", "rope_theta": 500000.0})
        self.device = device
        old = torch.get_default_dtype()
        torch.set_default_dtype(torch.bfloat16)
        try:
            with torch.device(device):
                self.model = LlamaForCausalLM._from_config(cfg, attn_implementation="sdpa")
        finally:
            torch.set_default_dtype(old)
        self.model.eval()
        self.layers, self.heads = layers, hd // 128
        self.kind = f"transformers LlamaForCausalLM (random init, {layers} layers, sdpa)"

    def __call__(self, kv, nchunks: int, new_tokens: int) -> None:
        """kv: uint8 GPU tensor holding nchunks chunks [2, L, T, H*D] bf16."""
        import torch
        from transformers import DynamicCache
        with torch.no_grad():
            data = []
            if nchunks:
                x = kv[:nchunks * _chunk_bytes(self)].view(torch.bfloat16).view(
                    nchunks, 2, self.layers, TOKENS_PER_CHUNK, self.heads, 128)
                for layer in range(self.layers):
                    k = x[:, 0, layer].reshape(-1, self.heads, 128).transpose(0, 1).unsqueeze(0)
                    v = x[:, 1, layer].reshape(-1, self.heads, 128).transpose(0, 1).unsqueeze(0)
                    data.append((k.contiguous(), v.contiguous()))
            cache = DynamicCache(ddp_cache_data=data) if data else DynamicCache()
            ids = torch.randint(0, 128000, (1, new_tokens), device=self.device)
            out = self.model(input_ids=ids, past_key_values=cache, use_cache=True,
                             logits_to_keep=1)
        if self.device != "cpu":
            # this thread's stream only: in the live replay other sessions'
            # loads run on their own streams and must not be waited for here
            torch.cuda.current_stream().synchronize()
        return out


def _chunk_bytes(p: Prefill) -> int:
    return 2 * p.layers * TOKENS_PER_CHUNK * p.heads * 128 * 2


# ---------------------------------------------------------------------------
# Measurement
# ---------------------------------------------------------------------------

def open_replay_method(name: str, directory: str, slab_bytes: int, shape, pools, notes: dict,
                       tag: str):
    """The method (``_lmcache_methods.open_method``), or None with the reason in
    ``notes[f"{tag}-{name}"]``; ``cufile`` falls back to KvikIO compat where
    LMCache's cufile backend cannot start, and says so."""
    from phx.bench._lmcache_methods import open_with_standin
    m, why, sub = open_with_standin(name, directory, slab_bytes, shape, pools)
    if sub:
        notes[f"{tag}-cufile"] = sub
    elif m is None:
        notes[f"{tag}-{name}"] = why
    return m


def slab_layout(trace) -> tuple[list[int], int, int]:
    """(first slab chunk of each session, chunks in all, the most chunks one
    request loads): each session owns the chunks of its longest context."""
    counts = [max((r["prefix"] + r["new"]) // TOKENS_PER_CHUNK for r in s) + 1 for s in trace]
    bases = [sum(counts[:i]) for i in range(len(counts))]
    maxload = max(r["prefix"] // TOKENS_PER_CHUNK for s in trace for r in s) or 1
    return bases, sum(counts), maxload


def prestore(m, pattern, total: int) -> None:
    """Slab chunk j := pattern slot j % 97, for j < total (untimed); then the
    page cache is dropped, so that loads come from the device."""
    from phx.bench._common import drop_caches
    for j in range(total):
        m.store(pattern, j % 97, j)
    m.sync()
    drop_caches()


def measure(method_name: str, directory: str, trace, shape, prefill, notes) -> dict | None:
    """Service times (load, prefill) of every request, run alone."""
    import torch
    from phx.bench._lmcache_methods import GPUPool
    bases, total, maxload = slab_layout(trace)
    pattern = GPUPool(97, shape)          # chunk j holds pattern slot j % 97
    pattern.fill_random(12345)
    kv = GPUPool(maxload, shape)
    m = open_replay_method(method_name, directory, total * pattern.chunk, shape,
                           [pattern, kv], notes, "replay")
    if m is None:
        return None
    try:
        prestore(m, pattern, total)
        service: list[list[dict]] = [[] for _ in trace]
        checked = bad = 0
        rounds = max(len(s) for s in trace)
        for r in range(rounds):
            for si, s in enumerate(trace):
                if r >= len(s):
                    continue
                req = s[r]
                n = req["prefix"] // TOKENS_PER_CHUNK
                t0 = time.perf_counter()
                for c in range(n):
                    m.load(kv, c, bases[si] + c)
                m.sync()
                torch.cuda.synchronize()
                t1 = time.perf_counter()
                if n and (r % 5 == 4 or r == len(s) - 1):
                    checked += 1
                    for c in range(n):
                        j = bases[si] + c
                        if not torch.equal(kv.slot(c), pattern.slot(j % 97)):
                            bad += 1
                            break
                t2 = time.perf_counter()
                prefill(kv.t, n, req["new"] + req["prefix"] - n * TOKENS_PER_CHUNK)
                t3 = time.perf_counter()
                service[si].append({"load_s": t1 - t0, "prefill_s": t3 - t2,
                                    "chunks": n, "think_s": req["think_s"]})
        return {"method": m.name, "service": service, "checked_requests": checked,
                "bad_requests": bad}
    finally:
        m.close()
        del pattern, kv
        torch.cuda.empty_cache()
        import shutil
        shutil.rmtree(directory, ignore_errors=True)   # the next method needs the room


def simulate(service: list[list[dict]], conc: int, seed: int) -> list[float]:
    """TTFTs of ``conc`` sessions served FIFO by one GPU (see the docstring)."""
    import heapq
    rng = random.Random(seed)
    events = []      # (arrival time, session, round)
    for k in range(conc):
        heapq.heappush(events, (rng.uniform(0, 10.0), k, 0))
    free_at, ttfts = 0.0, []
    while events:
        t, k, r = heapq.heappop(events)
        prof = service[k % len(service)]
        req = prof[r]
        s = req["load_s"] + req["prefill_s"]
        start = max(t, free_at)
        free_at = start + s
        ttfts.append(free_at - t)
        if r + 1 < len(prof):
            heapq.heappush(events, (free_at + prof[r + 1]["think_s"], k, r + 1))
    return ttfts


def _common_prefill(results: list[dict]) -> None:
    """Give every method the same prefill time per request: the median of what
    the methods measured for it.  Prefill is the same compute on the same
    shapes whichever method loaded the KV, but the method measured first also
    paid for warming the model up (seen on the H200: 0.13 s mean vs 0.03 s),
    which would be charged to its TTFT.  The raw times stay in
    ``prefill_s_measured``."""
    if not results:
        return
    for si, sess in enumerate(results[0]["service"]):
        for ri in range(len(sess)):
            xs = sorted(r["service"][si][ri]["prefill_s"] for r in results)
            med = xs[len(xs) // 2]
            for r in results:
                q = r["service"][si][ri]
                q["prefill_s_measured"] = q["prefill_s"]
                q["prefill_s"] = med


def each_method(methods: str, device: str, tag: str, notes: dict, run) -> list[dict]:
    """``run(name)`` for each name of the comma list ``methods``, in order: the
    results that are not None; a method that raises is recorded in
    ``notes[f"{tag}-{device}-{name}"]`` and the others still run.  A method
    named again (run before and after the others, for drift) keeps every run:
    its later results' ``method`` is ``name#2``, ``name#3``..."""
    out = []
    seen: dict[str, int] = {}
    for name in [x for x in methods.split(",") if x]:
        seen[name] = seen.get(name, 0) + 1
        label = name if seen[name] == 1 else f"{name}#{seen[name]}"
        try:
            res = run(name)
        except Exception as e:  # noqa: BLE001 - recorded; the other methods still run
            notes[f"{tag}-{device}-{label}"] = f"{type(e).__name__}: {e}"
            print(f"{tag} {device} {label} failed: {e}", file=sys.stderr)
            continue
        if res is not None:
            res["method"] = label
            out.append(res)
    return out


def warm_up(prefill: Prefill, trace) -> None:
    """Prefills at the trace's sizes: kernels, cuBLAS heuristics and the caching
    allocator settle here, not in the first method's first requests (a
    16-token warm-up left ~0.2 s per request of it in the first method)."""
    biggest = max(r["new"] + r["prefix"] % TOKENS_PER_CHUNK for s in trace for r in s)
    for _ in range(2):
        for t in sorted({16, 256, min(biggest, 1024), biggest}):
            prefill(None, 0, t)


def run_replay(args, device: str, directory: str, notes: dict) -> dict[str, Any]:
    from phx.bench._lmcache_methods import llama3_8b_chunk_shape
    shape = llama3_8b_chunk_shape(TOKENS_PER_CHUNK)
    trace = make_trace(args.sessions, args.rounds, args.token_scale, args.seed)
    out: dict[str, Any] = {"trace": trace_stats(trace), "token_scale": args.token_scale,
                           "ttft_limit_s": args.ttft_limit, "methods": {}}
    print(f"replay {device}: trace {out['trace']}", file=sys.stderr)
    try:
        prefill = Prefill(shape)
        out["model"] = prefill.kind
    except Exception as e:  # noqa: BLE001
        notes["replay-model"] = f"{type(e).__name__}: {e}"
        print(f"replay: no model: {notes['replay-model']}", file=sys.stderr)
        return out
    warm_up(prefill, trace)
    concs = [int(x) for x in args.concurrency.split(",") if x]
    results = each_method(args.replay_methods, device, "replay", notes, lambda name: measure(
        name, os.path.join(directory, "lmcache-replay"), trace, shape, prefill, notes))
    _common_prefill(results)
    for res in results:
        flat = [q for s in res["service"] for q in s]
        by_c = {}
        for c in concs:
            tt = sorted(simulate(res["service"], c, args.seed + c))
            by_c[c] = {"mean_s": sum(tt) / len(tt), "p50_s": tt[len(tt) // 2],
                       "p90_s": tt[int(0.9 * (len(tt) - 1))],
                       "within_limit": sum(x <= args.ttft_limit for x in tt) / len(tt)}
        served = max([c for c in concs if by_c[c]["within_limit"] >= 0.9], default=0)
        out["methods"][res["method"]] = {
            "load_s_mean": sum(q["load_s"] for q in flat) / len(flat),
            "prefill_s_mean": sum(q["prefill_s"] for q in flat) / len(flat),
            "alone_ttft_s": sorted(q["load_s"] + q["prefill_s"] for q in flat),
            "by_concurrency": by_c, "sessions_within_limit": served,
            "checked_requests": res["checked_requests"], "bad_requests": res["bad_requests"],
            "service": res["service"]}
        if getattr(args, "quiet", False):
            continue
        print(f"replay {device} {res['method']}: load {out['methods'][res['method']]['load_s_mean']:.3f} s "
              f"prefill {out['methods'][res['method']]['prefill_s_mean']:.3f} s "
              f"sessions within {args.ttft_limit} s: {served} "
              f"(bad {res['bad_requests']}/{res['checked_requests']})", file=sys.stderr)
    return out


def print_summary(device: str, rep: dict[str, Any]) -> None:
    from phx.bench._common import fmt_table
    ms = rep.get("methods", {})
    if not ms:
        print(f"replay {device}: no method ran")
        return
    t = rep["trace"]
    print(f"\nreplay on {device}: {t['sessions']} sessions, {t['requests']} requests, token scale "
          f"{rep['token_scale']}, prefix hit rate {t['prefix_hit_rate']:.1%}, "
          f"context at round 30 {t['context_at_round_30_mean']}, max {t['context_max']}")
    ref = ms.get("phx")
    rows = []
    for name, m in ms.items():
        alone = m["alone_ttft_s"]
        rows.append([name, f"{m['load_s_mean']:.3f}", f"{m['prefill_s_mean']:.3f}",
                     f"{alone[len(alone) // 2]:.3f}", f"{alone[int(0.99 * (len(alone) - 1))]:.3f}",
                     m["sessions_within_limit"],
                     f"{ref['load_s_mean'] and m['load_s_mean'] / ref['load_s_mean']:.2f}" if ref else "-",
                     f"{m['bad_requests']}/{m['checked_requests']}"])
    print(fmt_table(["method", "KV load s", "prefill s", "TTFT p50 alone", "TTFT p99 alone",
                     f"sessions <= {rep['ttft_limit_s']} s", "load x/phx", "bad/checked"], rows))


def plot_ttft_alone(ax, rep: dict[str, Any]) -> None:
    """The distribution (CDF) of each method's TTFT per request run alone."""
    for name, m in rep.get("methods", {}).items():
        xs = sorted(m["alone_ttft_s"])
        ax.step(xs, [(i + 1) / len(xs) for i in range(len(xs))], where="post",
                label=f"{name} (p50 {xs[len(xs) // 2]:.2f} s)")
    ax.set_xlabel("TTFT of a request alone: KV load + prefill (s)")
    ax.set_ylabel("fraction of requests")
    ax.legend()


def plot_ttft(ax, rep: dict[str, Any]) -> None:
    for name, m in rep.get("methods", {}).items():
        cs = sorted(int(c) for c in m["by_concurrency"])
        ax.plot(cs, [m["by_concurrency"][c]["p90_s"] if c in m["by_concurrency"]
                     else m["by_concurrency"][str(c)]["p90_s"] for c in cs], marker="o",
                label=f"{name} ({m['sessions_within_limit']} within)")
    ax.axhline(rep.get("ttft_limit_s", 5.0), color="grey", ls="--")
    ax.set_xlabel("concurrent sessions (queue model: a projection)")
    ax.set_ylabel("TTFT p90 (s)")
    ax.set_yscale("log")
    ax.legend()
