"""``phx bench lmcache``: LMCache's KV tiers side by side on one GPU.

Chunk rows (``--mode chunks``): a Llama-3-8B KV chunk (32 layers, 8 KV heads
x 128, bf16, 256 tokens = 32 MiB in LMCache's [2, L, T, H] layout), ``--chunks``
distinct random chunks stored from GPU memory and loaded back, through

* ``phx``            LMCache's GDSContext with its ``phx`` backend (libphxfile.so),
* ``cufile``         the same GDSContext with LMCache's ``cufile`` backend; where
                     it cannot start, ``kvikio`` (KvikIO compat mode through the
                     same GDSContext) instead, and the reason is recorded,
* ``kvikio16`` / ``kvikio64`` (named only) KvikIO compat with 16 / 64 threads,
* ``host-buffered``  LMCache's LocalDiskBackend file I/O, ``use_odirect`` off,
* ``host-odirect``   the same with ``use_odirect`` on,

on the disk (``--dir``) and, with ``--zram SIZE``, on a RAM-speed zram ext4
(where software decides).  Store and load GB/s (all chunks queued, then one
wait), per-chunk p50/p99 (one chunk at a time, waited for), CPU seconds per
GB (user + system of the process: libphx's lanes and LMCache's threads are
in it).  Every load is checked byte-exact against the stored chunks; the page
cache is dropped before every load row; methods are interleaved in a new
order each repeat.

The agentic replay (``--mode replay``, ``phx.bench._lmcache_replay``): TTFT
per round = prefix KV load from the slab + prefill of the new tokens on a
randomly initialised Llama-3-8B-shaped model, and the sessions served
within a 5 s TTFT computed from those times by a queue model (a projection).
``--mode live`` (``phx.bench._lmcache_live``) runs the same trace with C
sessions at once for real: loads, stores and prefills concurrently, TTFT
p50/p99 measured.

Needs torch with CUDA and lmcache 0.5.6 (``adapters/lmcache/tools/
lmcache-deps.sh``); without them it says why on one line and exits 2.
"""
from __future__ import annotations

import argparse
import os
import random
import resource
import sys
import time
from typing import Any

from phx.bench._common import (BenchError, add_common_arguments, bench_dir, checked, csv,
                               drop_caches, fmt_table, median_spread, parse_size,
                               positive_int, positive_size, write_json)

MiB, GiB = 1 << 20, 1 << 30
METHODS = ("phx", "cufile", "host-buffered", "host-odirect")
#: chunk-mode methods that run only when named (KvikIO with 16 and 64 threads)
EXTRA_METHODS = ("kvikio16", "kvikio64")


def add_arguments(p: argparse.ArgumentParser) -> None:
    # checked here, kept as text: the run parses them
    p.add_argument("--mode", type=checked(csv(str, allowed=("chunks", "replay", "live", "l2"))),
                   default="chunks,replay",
                   help="chunks, replay (default: both), live (the replay's sessions run "
                        "concurrently, measured), l2 (the persistent disk tier: "
                        "phx's storage plugin vs LocalDiskBackend vs rust_raw_block, CPU only)")
    p.add_argument("--zram", metavar="SIZE", type=checked(positive_size), default=None,
                   help="also run on a zram ext4 of SIZE (root)")
    p.add_argument("--no-disk", action="store_true", help="zram rows only")
    p.add_argument("--methods", type=checked(csv(str, allowed=METHODS + EXTRA_METHODS)),
                   default=",".join(METHODS),
                   help="subset of " + ",".join(METHODS + EXTRA_METHODS) + " (default "
                   + ",".join(METHODS) + ")")
    p.add_argument("--chunks", type=positive_int, default=128,
                   help="chunks per store/load row (default 128 = 4 GiB)")
    p.add_argument("--latency-chunks", type=positive_int, default=32,
                   help="chunks timed one by one (default 32)")
    p.add_argument("--tokens", type=positive_int, default=256,
                   help="tokens per chunk (default 256)")
    # no --keep: each method's files go as soon as it is done (the next needs the room)
    add_common_arguments(
        p, dir_help="directory on the disk (default $PHX_BENCH_DIR or /var/tmp/phxbench)",
        repeat=3, quiet_help="no per-row lines on stderr")
    from phx.bench import _lmcache_l2, _lmcache_live, _lmcache_replay
    _lmcache_replay.add_arguments(p)
    _lmcache_live.add_arguments(p)
    _lmcache_l2.add_arguments(p)


def _why_not() -> str | None:
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return "no CUDA GPU (torch.cuda.is_available() is False)"
    try:
        import lmcache.v1.gpu_connector.gds_context  # noqa: F401
    except Exception as e:  # noqa: BLE001
        return (f"lmcache 0.5.6 cannot be imported ({type(e).__name__}: {e}); "
                "see adapters/lmcache/tools/lmcache-deps.sh")
    return None


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def _open(name: str, directory: str, slab: int, shape, pools, notes: dict):
    from phx.bench._lmcache_methods import open_with_standin
    m, why, sub = open_with_standin(name, directory, slab, shape, pools)
    if sub:
        notes["cufile"] = sub
        print(f"lmcache bench: {sub}", file=sys.stderr)
    elif m is None:
        notes[name] = why
        print(f"lmcache bench: {name} skipped: {why}", file=sys.stderr)
    return m


def _row(m, src, dst, n: int, nlat: int, order: list[int]) -> dict[str, Any]:
    """Store n chunks, drop caches, load them back (checked), then time
    nlat single-chunk loads."""
    import torch
    chunk = src.chunk
    t0, c0 = time.perf_counter(), _cpu()
    for i in range(n):
        m.store(src, i, order[i])
    m.sync()
    torch.cuda.synchronize()
    st, sc = time.perf_counter() - t0, _cpu() - c0
    dropped = drop_caches()
    dst.t.zero_()
    torch.cuda.synchronize()
    t0, c0 = time.perf_counter(), _cpu()
    for i in range(n):
        m.load(dst, i, order[i])
    m.sync()
    torch.cuda.synchronize()
    lt, lc = time.perf_counter() - t0, _cpu() - c0
    exact = bool(torch.equal(src.t[:n * chunk], dst.t[:n * chunk]))
    drop_caches()
    lat = []
    for i in range(min(nlat, n)):
        t1 = time.perf_counter()
        m.load(dst, i, order[i])
        m.sync()
        torch.cuda.synchronize()
        lat.append(time.perf_counter() - t1)
    gb = n * chunk / 1e9
    return {"method": m.name, "store_gbps": gb / st, "load_gbps": gb / lt,
            "store_cpu_s_per_gb": sc / gb, "load_cpu_s_per_gb": lc / gb,
            "load_p50_ms": 1e3 * _pct(lat, 0.5), "load_p99_ms": 1e3 * _pct(lat, 0.99),
            "byte_exact": exact, "cache_dropped": dropped}


def _chunk_room(args) -> int:
    """Bytes the chunk rows need on one filesystem: all methods' chunks at
    once (they are measured interleaved), plus a quarter for ext4 and slack."""
    from phx.bench._lmcache_methods import llama3_8b_chunk_shape
    t, layers, tok, width = llama3_8b_chunk_shape(args.tokens)
    chunk = t * layers * tok * width * 2
    methods = len([x for x in args.methods.split(",") if x])
    return int(methods * args.chunks * chunk * 1.25) + (256 << 20)


def chunk_rows(args, device: str, directory: str, results: list, notes: dict) -> None:
    import torch
    from phx.bench._lmcache_methods import GPUPool, llama3_8b_chunk_shape
    shape = llama3_8b_chunk_shape(args.tokens)
    n = args.chunks
    src, dst = GPUPool(n, shape), GPUPool(n, shape)
    src.fill_random(random.randrange(1 << 30))
    slab = n * src.chunk
    names = [x for x in args.methods.split(",") if x]
    opened = {}
    for name in names:
        m = _open(name, os.path.join(directory, "lmcache-bench"), slab, shape, [src, dst], notes)
        if m is not None:
            opened[name] = m
    try:
        for rep in range(args.repeat):
            order = list(range(n))
            random.shuffle(order)       # chunks land at scattered slab offsets
            names_now = list(opened)
            random.shuffle(names_now)
            for name in names_now:
                try:
                    r = _row(opened[name], src, dst, n, args.latency_chunks, order)
                except Exception as e:  # noqa: BLE001 - one broken method must not end the run
                    notes[f"{device}-{name}"] = f"{type(e).__name__}: {e}"
                    print(f"lmcache bench: {device} {name} failed: {e}", file=sys.stderr)
                    try:
                        opened.pop(name).close()
                    except Exception:  # noqa: BLE001
                        pass
                    continue
                r.update(device=device, repeat=rep, chunk_bytes=src.chunk, chunks=n)
                results.append(r)
                if not args.quiet:
                    print(f"{device:5} {r['method']:14} store {r['store_gbps']:6.2f} GB/s  "
                          f"load {r['load_gbps']:6.2f} GB/s  p50 {r['load_p50_ms']:7.2f} ms  "
                          f"p99 {r['load_p99_ms']:7.2f} ms  exact={r['byte_exact']}",
                          file=sys.stderr)
    finally:
        for m in opened.values():
            m.close()
        del src, dst
        torch.cuda.empty_cache()
        import shutil
        shutil.rmtree(os.path.join(directory, "lmcache-bench"), ignore_errors=True)


def summarise(results: list[dict]) -> list[dict]:
    keys = ("store_gbps", "load_gbps", "store_cpu_s_per_gb", "load_cpu_s_per_gb",
            "load_p50_ms", "load_p99_ms")
    out = []
    groups: dict[tuple, list[dict]] = {}
    for r in results:
        groups.setdefault((r["device"], r["method"]), []).append(r)
    for (dev, meth), rs in groups.items():
        row = {"device": dev, "method": meth, "repeats": len(rs),
               "byte_exact": all(r["byte_exact"] for r in rs)}
        for k in keys:
            med, spread = median_spread([r[k] for r in rs])
            row[k], row[k + "_spread"] = med, spread
        out.append(row)
    for row in out:
        ref = next((r for r in out if r["device"] == row["device"] and r["method"] == "phx"), None)
        row["phx_load_x"] = ref["load_gbps"] / row["load_gbps"] if ref and row["load_gbps"] else None
    return out


def _print(summary: list[dict]) -> None:
    rows = [[s["device"], s["method"], f"{s['store_gbps']:.2f}", f"{s['load_gbps']:.2f}",
             f"{s['load_gbps_spread']:.0%}",
             f"{s['load_p50_ms']:.1f}", f"{s['load_p99_ms']:.1f}",
             f"{s['load_cpu_s_per_gb']:.3f}", f"{s['store_cpu_s_per_gb']:.3f}",
             "yes" if s["byte_exact"] else "NO",
             f"{s['phx_load_x']:.2f}" if s["phx_load_x"] else "-"] for s in summary]
    print(fmt_table(["device", "method", "store GB/s", "load GB/s", "spread", "p50 ms",
                     "p99 ms", "load CPU s/GB", "store CPU s/GB", "exact", "phx/x load"], rows))


def _plot(summary: list[dict], replay: dict | None, path: str,
          live: dict | None = None) -> None:
    """Chunk load GB/s (when chunks ran); for a replay, each method's TTFT
    distribution alone and its modelled p90 TTFT against concurrent sessions;
    for a live run, its measured p99 TTFT against concurrent sessions."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    n = (1 if summary else 0) + (2 if replay else 0) + (1 if live else 0)
    if not n:
        return
    fig, axes = plt.subplots(1, n, figsize=(7 * n, 4.5))
    axes = list(axes) if n > 1 else [axes]
    if summary:
        ax = axes.pop(0)
        devs = sorted({s["device"] for s in summary})
        meths = sorted({s["method"] for s in summary})
        w = 0.8 / max(1, len(meths))
        for j, m in enumerate(meths):
            ys = [next((s["load_gbps"] for s in summary
                        if s["device"] == d and s["method"] == m), 0) for d in devs]
            ax.bar([i + j * w for i in range(len(devs))], ys, w, label=m)
        ax.set_xticks([i + 0.4 - w / 2 for i in range(len(devs))], devs)
        ax.set_ylabel("KV chunk load GB/s")
        ax.legend()
    if replay:
        from phx.bench._lmcache_replay import plot_ttft, plot_ttft_alone
        plot_ttft_alone(axes.pop(0), replay)
        plot_ttft(axes.pop(0), replay)
    if live:
        from phx.bench._lmcache_live import plot as plot_live
        plot_live(axes.pop(0), live)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def _why_not_l2() -> str | None:
    try:
        import lmcache.v1.storage_backend.storage_manager  # noqa: F401
        import phx_lmcache.l2.backend  # noqa: F401
    except Exception as e:
        return (f"lmcache 0.5.6 or phx_lmcache.l2 cannot be imported ({type(e).__name__}: "
                f"{e}); put lmcache on PYTHONPATH (adapters/lmcache/tools/lmcache-deps.sh)")
    return None


def run(args) -> int:
    modes = set(args.mode.split(","))
    why = _why_not_l2() if modes == {"l2"} else _why_not()
    if why:
        raise BenchError(f"not run: {why}; nothing measured")
    directory = bench_dir(args.dir, "/var/tmp/phxbench")
    results: list[dict] = []
    notes: dict[str, str] = {}
    replay: dict[str, Any] = {}
    live: dict[str, Any] = {}
    places = [] if args.no_disk else [("disk", directory)]
    from phx.bench import _lmcache_live, _lmcache_replay, _zram
    zram_cm = None
    if args.zram:
        size = parse_size(args.zram)
        if "chunks" in modes:
            # every method keeps its chunks side by side for the whole run
            size = max(size, _chunk_room(args))
        bad = _zram.unavailable(size)
        if bad:
            notes["zram"] = bad
            print(f"lmcache bench: zram rows skipped: {bad}", file=sys.stderr)
        else:
            zram_cm = _zram.zram_ext4(size)
            places.append(("zram", zram_cm.__enter__().mountpoint))
    l2: dict[str, Any] = {}
    try:
        for device, d in places:
            if "chunks" in modes:
                chunk_rows(args, device, d, results, notes)
            if "replay" in modes:
                replay[device] = _lmcache_replay.run_replay(args, device, d, notes)
            if "live" in modes:
                live[device] = _lmcache_live.run_live(args, device, d, notes)
        if "l2" in modes:
            from phx.bench import _lmcache_l2
            l2 = _lmcache_l2.run_l2(args, places, notes)
    finally:
        if zram_cm is not None:
            zram_cm.__exit__(None, None, None)
    summary = summarise(results) if results else []
    if summary:
        _print(summary)
    for device, rep in replay.items():
        _lmcache_replay.print_summary(device, rep)
    for device, rep in live.items():
        _lmcache_live.print_summary(device, rep)
    if l2:
        from phx.bench import _lmcache_l2
        _lmcache_l2.print_summary(l2)
    import phx_lmcache
    payload = {"benchmark": "lmcache",
               "args": {k: v for k, v in vars(args).items() if not k.startswith("_")},
               "notes": notes, "rows": results, "summary": summary, "replay": replay,
               "live": live, "l2": l2,
               "libphxfile": phx_lmcache.stats() if modes != {"l2"} else None}
    write_json(args.json, payload)
    if args.plot and (summary or replay or live):
        _plot(summary, next(iter(replay.values()), None), args.plot,
              next(iter(live.values()), None))
    bad = [s for s in summary + (l2.get("summary") or []) if not s["byte_exact"]]
    for s in bad:
        print(f"phx bench lmcache: {s['device']} {s['method']}: loaded bytes differ!",
              file=sys.stderr)
    bad_live = [(dev, name) for dev, rep in live.items()
                for name, m in rep.get("methods", {}).items()
                if any(s["bad_requests"] for s in m["levels"])]
    for dev, name in bad_live:
        print(f"phx bench lmcache: live {dev} {name}: loaded bytes differ!", file=sys.stderr)
    if not summary and not any(r.get("methods") for r in replay.values()) and \
            not any(r.get("methods") for r in live.values()) and not (l2.get("summary")):
        print("phx bench lmcache: nothing was measured", file=sys.stderr)
        return 1
    return 1 if bad or bad_live else 0
