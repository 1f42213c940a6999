"""``phx bench kv``: FlexLLMGen's KV I/O under real memory caps, four ways side by side.

For every cap (a fraction of the KV working set, on top of the worker's own fixed
memory) and every configuration -- ``baseline`` (FlexLLMGen's per-tensor memmaps),
``cachepolicy`` (the same + ``posix_fadvise(DONTNEED)`` past the budget), ``direct``
(everything O_DIRECT through phx) and ``dual`` (phx.kv dual-path + adaptive
pipeline) -- the page cache is dropped, a memory cgroup with that cap is created and
a worker process replays prefill + decode inside it (``phx.bench._kv_worker``).

Since issue 26: ``stock-mixed`` (FlexLLMGen's own CPU + disk split sized to the
budget), ``dual-mem`` (Group 1 in memory, never written back, rebalanced between
steps) and ``dual-mem-ra`` (``dual-mem`` with the next layers' Group 2 tensors
read ahead into ``--readahead`` buffers counted in its budget) beside them; every worker warms up before it is measured; caps and
configurations rotate per repeat (5 by default); the ideal's device bandwidth is
fio's, measured once for all; stalls (steps over twice the run's median) are
counted and left in every configuration's decode time; the digests of every KV
tensor after prefill and at the end must match across configurations, and one
run with a deliberately corrupted KV read must change them (the negative
control); an OOM kill in a worker's cgroup fails its row.

Reported per row: prefill and decode time, per-step decode time, the page-cache hit
rate of the decode reads (``cachestat`` on each range just before reading it), and
the bytes the worker read from the device (``/proc/self/io``).  Per cap: the ratios
to the baseline and the physical ideal decode time (cached bytes / page-cache copy
bandwidth + the rest / device read bandwidth, both measured in the same run).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

from phx.bench import _common
from phx.bench._common import (BenchError, Parser, add_common_arguments, csv,
                               deprecated_alias, nonneg_int, positive_float, positive_int)

MiB = 1 << 20
CONFIGS = ("baseline", "stock-mixed", "cachepolicy", "direct", "dual", "dual-mem",
           "dual-mem-ra")
# beside dual on request (--configs ...,dual-nowb): dual without its write-behind
EXTRA_CONFIGS = ("dual-nowb",)
LABELS = {"baseline": "Baseline (FlexLLMGen memmap)",
          "stock-mixed": "FlexLLMGen CPU+disk split at the cap",
          "cachepolicy": "CachePolicy-only",
          "direct": "Direct-only (phx)", "dual": "phx dual-path + P·P",
          "dual-nowb": "dual-path, no write-behind",
          "dual-mem": "dual-path, Group 1 in memory (v2)",
          "dual-mem-ra": "dual-path v2, Group 2 read ahead"}


#: KV shapes of the models the bench knows (``--model``); single flags override them
MODELS = {
    # OPT-6.7B (the paper's model): 32 layers, 32 heads of 128, fp16
    "opt-6.7b": {"layers": 32, "hidden": 4096, "heads": 32, "kv_heads": 32,
                 "dtype": "float16"},
    # Llama-3-8B: 32 layers, 32 query heads but 8 KV heads of 128 (GQA), bf16:
    # a quarter of OPT's KV bytes per token
    "llama-3-8b": {"layers": 32, "hidden": 4096, "heads": 32, "kv_heads": 8,
                   "dtype": "bfloat16"},
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("workload (FlexLLMGen's KV layout; OPT-6.7B by default)")
    g.add_argument("--model", choices=sorted(MODELS), default="opt-6.7b",
                   help="KV shape: layers, heads, KV heads, dtype (default opt-6.7b)")
    g.add_argument("--layers", type=positive_int, default=None)
    g.add_argument("--hidden", type=positive_int, default=None)
    g.add_argument("--heads", type=positive_int, default=None)
    g.add_argument("--kv-heads", type=positive_int, default=None,
                   help="KV heads (GQA; default: the model's, = --heads for OPT)")
    g.add_argument("--batch", type=positive_int, default=1,
                   help="batch size (default 1: the paper's 32 scaled to this box)")
    g.add_argument("--prompt", type=positive_int, default=512)
    g.add_argument("--gen", type=_gen_steps, default=32)
    g.add_argument("--dtype", choices=("float16", "bfloat16"), default=None,
                   help="float16 | bfloat16 (default: the model's)")
    p.add_argument("--caps", type=csv(_cap), default="0.2,0.4,0.6,0.8,0.9,1.0,1.2",
                   help="caps as fractions of the KV working set (added to the worker's "
                        "fixed memory, measured first)")
    p.add_argument("--methods", dest="configs", type=csv(str, allowed=CONFIGS + EXTRA_CONFIGS),
                   default=",".join(CONFIGS),
                   help=f"configurations, comma-separated (default {','.join(CONFIGS)}; "
                        f"also {','.join(EXTRA_CONFIGS)})")
    p.add_argument("--threads", type=positive_int, default=2, help="copy threads")
    p.add_argument("--readahead", type=positive_int, default=None,
                   help="dual-mem-ra: K/V tensors read ahead at once (default "
                        "phx.bench._kv_worker.READAHEAD_TENSORS)")
    p.add_argument("--reserve", type=nonneg_int, default=None,
                   help="budgeter reserve in bytes (default 8 MiB + 2%% of the headroom)")
    p.add_argument("--no-dma", action="store_true",
                   help="skip the relay -> destination copy that stands in for H2D")
    p.add_argument("--timeout", type=positive_float, default=600, help="seconds per worker")
    p.add_argument("--no-fio", action="store_true",
                   help="take the ideal's device bandwidth from phx's calibration, not fio")
    p.add_argument("--no-negative-control", action="store_true",
                   help="skip the run with one deliberately corrupted KV read")
    add_common_arguments(
        p, dir_help="where the KV files go, made if missing (default $PHX_BENCH_DIR or "
                    "results/kv-data); each run's files are removed after it, and a "
                    "directory made for them at the end, unless --keep",
        repeat=5, repeat_help="runs per cap x configuration (caps and configurations "
                              "in a rotated order each repeat)",
        keep_help="keep each run's KV files (the last cap's of each configuration and "
                  "repeat) and the directory")
    deprecated_alias(p, "--configs", "--methods", "configs",
                     type=csv(str, allowed=CONFIGS + EXTRA_CONFIGS))
    deprecated_alias(p, "--no-progress", "--quiet", "quiet", flag=True)


def _cap(text: str) -> float:
    v = _common._float(text)
    if not v > 0 or v == float("inf"):
        raise ValueError(f"cap {text!r}: want a fraction above 0")
    return v


def _gen_steps(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if v < 2:
        raise argparse.ArgumentTypeError(f"{text!r}: want 2 or more (prefill + decode steps)")
    return v


def model_shape(args: argparse.Namespace) -> dict:
    """The workload's layers/hidden/heads/kv_heads/dtype: ``--model`` and overrides."""
    m = dict(MODELS[getattr(args, "model", None) or "opt-6.7b"])
    mha = m["kv_heads"] == m["heads"]        # no GQA: KV heads follow --heads
    for k in ("layers", "hidden", "heads", "kv_heads", "dtype"):
        v = getattr(args, k, None)
        if v is not None:
            m[k] = v
    if mha and getattr(args, "kv_heads", None) is None:
        m["kv_heads"] = m["heads"]
    if m["heads"] % m["kv_heads"] or m["hidden"] % m["heads"]:
        raise BenchError(f"{m['heads']} heads do not split into "
                         f"{m['kv_heads']} KV heads, or hidden {m['hidden']} into heads")
    return m


def _worker_argv(conf: dict, out: str) -> list[str]:
    return [sys.executable, "-m", "phx.bench._kv_worker", json.dumps(conf), out]


def _run_in_cgroup(conf: dict, limit: int | None, timeout: float, keep: bool = False) -> dict:
    from phx.bench._kv_cgroup import MemCgroup
    name = f"phx-kv-{os.getpid()}-{int(time.time() * 1000) % 10**9}"
    fd, out = tempfile.mkstemp(prefix="phx-kv-", suffix=".json")
    os.close(fd)
    cg = MemCgroup(name, limit)
    try:
        proc = cg.popen(_worker_argv(conf, out), stdout=subprocess.PIPE,
                        stderr=subprocess.PIPE, text=True, env=_child_env())
        try:
            _, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            _, err = proc.communicate()
            return {"config": conf["config"], "error": f"timeout after {timeout} s"}
        ooms = cg.oom_kills()
        if proc.returncode != 0:
            msg = (err or "").strip().splitlines()[-1:] or [""]
            return {"config": conf["config"],
                    "error": f"worker exit {proc.returncode}"
                             f"{' (OOM-killed)' if ooms else ''}: {msg[0]}"}
        with open(out) as f:
            res = json.load(f)
        res["oom_kills"] = ooms
        return res
    finally:
        cg.close()
        os.unlink(out)
        if not keep:
            shutil.rmtree(conf["dir"], ignore_errors=True)


def _child_env() -> dict:
    env = dict(os.environ)
    here = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = here + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def ideal_decode_s(shape, cached_bytes: float, copy_bw: float, dev_bw: float) -> float:
    """Decode time if ``cached_bytes`` of KV stay cached and the rest streams at ``dev_bw``."""
    t = 0.0
    for i in range(shape.gen - 1):
        b = 2 * shape.layers * (shape.prompt + i) * shape.row_bytes
        c = min(cached_bytes, b)
        t += c / copy_bw + (b - c) / dev_bw
    return t


def run(args: argparse.Namespace) -> int:
    from phx.bench._kv_cgroup import can_create
    from phx.bench._kv_worker import Shape
    ok, why = can_create()
    if not ok:
        raise BenchError(f"{why}; the benchmark needs real memory cgroups")
    m = model_shape(args)
    base_conf = {**m, "model": args.model,
                 "batch": args.batch, "prompt": args.prompt, "gen": args.gen,
                 "threads": args.threads, "reserve": args.reserve,
                 "dma": not args.no_dma}
    if args.readahead is not None:
        base_conf["readahead"] = args.readahead
    shape = Shape(base_conf)
    ws = shape.working_set
    fracs = list(args.caps)
    configs = list(dict.fromkeys(args.configs))
    default_root = os.path.join("results", "kv-data")
    made = not os.path.exists(args.dir or os.environ.get("PHX_BENCH_DIR") or default_root)
    root = _common.bench_dir(args.dir, default_root)
    try:
        return _run(args, base_conf, shape, ws, fracs, configs, root)
    finally:
        if made and not args.keep:
            shutil.rmtree(root, ignore_errors=True)


def _run(args, base_conf, shape, ws, fracs, configs, root) -> int:
    print(f"KV working set ({args.model}): {shape.layers} layers x K,V of {shape.tshape} "
          f"{shape.dtype_name} = "
          f"{ws / MiB:.1f} MiB; decode reads {_gen_read_bytes(shape) / 1e9:.2f} GB in "
          f"{args.gen - 1} steps; files under {root}")
    # the worker's fixed memory (interpreter, numpy, phx, copy and destination buffers)
    _common.drop_caches()
    probe = _run_in_cgroup({**base_conf, "config": "probe", "dir": os.path.join(root, "p")},
                           None, args.timeout)
    if "error" in probe:
        print(f"probe failed: {probe['error']}", file=sys.stderr)
        return 1
    fixed = int(probe["usage"])
    print(f"worker fixed memory (measured in its cgroup): {fixed / MiB:.1f} MiB; "
          f"cap = fixed + fraction x working set")
    # bandwidths for the ideal line
    _common.drop_caches()
    cal = _run_in_cgroup({**base_conf, "config": "calibrate", "dir": os.path.join(root, "c")},
                         None, args.timeout)
    if "error" in cal:
        print(f"calibration failed: {cal['error']}", file=sys.stderr)
        return 1
    print(f"device read {cal['dev_read_gbps']:.2f} GB/s (phx O_DIRECT, cold), page-cache "
          f"copy {cal['pagecache_read_gbps']:.2f} GB/s (warm preadv)")
    # the ideal's device bandwidth: fio, once, for every configuration (phx's own
    # calibration would grade phx against itself)
    cal["ideal_dev_source"] = "phx calibration"
    cal["ideal_dev_read_gbps"] = cal["dev_read_gbps"]
    if not getattr(args, "no_fio", False):
        try:
            cal["fio"] = fio_read_gbps(root)
            cal["ideal_dev_read_gbps"] = cal["fio"]["gbps"]
            cal["ideal_dev_source"] = "fio"
            print(f"device read {cal['fio']['gbps']:.2f} GB/s (fio, sequential 1 MiB, "
                  f"QD {cal['fio']['qd']}): the ideal's device bandwidth")
        except (RuntimeError, OSError, subprocess.SubprocessError) as e:
            cal["fio_error"] = str(e)
            print(f"fio not usable ({e}); the ideal uses phx's calibration", file=sys.stderr)

    caps = [(f, fixed + int(f * ws)) for f in fracs]
    total = len(caps) * len(configs) * args.repeat
    bar = _common.progress(total, "kv", enabled=not args.quiet)
    raw: list[dict] = []
    for rep in range(args.repeat):
        order = configs[rep % len(configs):] + configs[:rep % len(configs)]
        cap_order = caps[rep % len(caps):] + caps[:rep % len(caps)]
        for f, cap in cap_order:
            for cfg in order:
                _common.drop_caches()
                conf = {**base_conf, "config": cfg, "seed": rep + 1,
                        "dir": os.path.join(root, f"{cfg}-{rep}")}
                res = _run_in_cgroup(conf, cap, args.timeout, args.keep)
                res.update({"cap_bytes": cap, "cap_fraction": f, "repeat": rep})
                raw.append(res)
                bar.update(1)
                bar.write(_row_line(res))
    bar.close()
    digests = check_digests(raw)
    control = None
    if not getattr(args, "no_negative_control", False) and raw:
        # the negative control: one run whose reads of tensor 1 come back with a
        # byte flipped must change the digests (and fail its verification)
        f, cap = caps[0]
        cfg = "dual-mem" if "dual-mem" in configs else configs[-1]
        _common.drop_caches()
        res = _run_in_cgroup({**base_conf, "config": cfg, "seed": 1, "corrupt_read": 1,
                              "dir": os.path.join(root, "control")}, cap, args.timeout)
        ref = next((x for x in raw if x.get("repeat") == 0 and x.get("kv_digest")), None)
        control = {"config": cfg, "cap_bytes": cap,
                   "kv_digest": res.get("kv_digest"), "verified": res.get("verified"),
                   "detected": bool(ref and res.get("kv_digest")
                                    and res["kv_digest"] != ref["kv_digest"]
                                    and res.get("prefill_digest") != ref["prefill_digest"]
                                    and res.get("verified") is False),
                   "error": res.get("error")}
        print(f"negative control ({cfg}, one corrupted KV read): "
              f"{'detected' if control['detected'] else 'NOT DETECTED'}")

    rows, per_cap = _aggregate(raw, caps, configs, shape, cal, fixed, ws)
    headers = ["cap MiB", "cap/WS", "config", "prefill s", "decode s", "step ms",
               "hit %", "dev read GB", "ideal s", "dec/base", "pre/base", "spread", "stalls"]
    table = []
    for r in rows:
        table.append([f"{r['cap_bytes'] / MiB:.0f}", f"{r['cap_fraction']:.2f}", r["config"],
                      _f(r["prefill_s"]), _f(r["decode_s"]),
                      _f(r["decode_step_s"] * 1e3 if r["decode_step_s"] else None),
                      _f(r["hit_rate"] * 100 if r["hit_rate"] is not None else None),
                      _f(r["decode_device_read_bytes"] / 1e9
                         if r["decode_device_read_bytes"] is not None else None),
                      _f(r["ideal_decode_s"]), _f(r.get("ratio_decode_vs_baseline")),
                      _f(r.get("ratio_prefill_vs_baseline")),
                      f"{r['decode_s_spread'] * 100:.0f}%" if r["decode_s_spread"] is not None
                      else "-", r.get("stall_steps", 0)])
    print(_common.fmt_table(headers, table))
    choices = [x["pipeline"]["choice"] for x in raw if x.get("pipeline")]
    if choices:
        print("adaptive pipeline choices (dual):",
              {c: choices.count(c) for c in sorted(set(choices))})
    bad = [x for x in raw if _failure(x)]
    for x in bad:
        print(f"row failed: cap {x['cap_bytes'] / MiB:.0f} MiB {x['config']}: {_failure(x)}")
    print(f"KV digests after prefill and at the end: "
          f"{'identical in every configuration' if digests['identical'] else 'DIFFER'} "
          f"({digests['runs']} runs, {digests['repeats']} seeds)")
    _common.write_json(args.json, {
        "benchmark": "kv",
        "workload": {**base_conf, "tensor_shape": shape.tshape, "working_set_bytes": ws,
                     "decode_read_bytes": _gen_read_bytes(shape)},
        "worker_fixed_bytes": fixed,
        "calibration": cal,
        "rows": rows,
        "per_cap": per_cap,
        "digests": digests,
        "negative_control": control,
        "raw": raw,
    })
    if args.plot:
        plot(rows, per_cap, args.plot, shape, ws)
    failed = bad or not digests["identical"] or (control is not None and not control["detected"])
    return 1 if failed else 0


def check_digests(raw: list[dict]) -> dict:
    """Every run of one seed (repeat) must read back the same KV: the digest of
    every tensor after prefill and at the end, whatever the configuration and cap."""
    by_rep: dict[int, set] = {}
    for x in raw:
        if x.get("kv_digest"):
            by_rep.setdefault(x.get("repeat", 0), set()).add(
                (x["prefill_digest"], x["kv_digest"]))
    odd = {rep: len(v) for rep, v in by_rep.items() if len(v) != 1}
    return {"identical": not odd, "repeats": len(by_rep),
            "runs": sum(1 for x in raw if x.get("kv_digest")),
            "seeds_with_several_digests": odd}


def fio_read_gbps(root: str, size: int = 256 << 20, qd: int = 8,
                  runtime_s: float = 3.0) -> dict:
    """Sequential 1 MiB O_DIRECT reads of a 256 MiB file next to the KV files,
    measured by fio (io_uring) after the file is written and the cache dropped."""
    from phx.bench import _fio
    fio = _fio.fio_path()
    if fio is None:
        raise RuntimeError("fio is not installed")
    path = os.path.join(root, "fio-read.bin")
    os.makedirs(root, exist_ok=True)
    try:
        with open(path, "wb") as f:
            chunk = os.urandom(1 << 20)
            for _ in range(size >> 20):
                f.write(chunk)
            f.flush()
            os.fsync(f.fileno())
        _common.drop_caches()
        cmd = _fio.fio_command(fio, path, size, "read", 1 << 20, qd, runtime_s, 0)
        r = _fio.run_fio(cmd, "read", runtime_s + 60)
        return {"gbps": r.nbytes / r.seconds / 1e9, "qd": qd, "bs": 1 << 20,
                "bytes": r.nbytes, "seconds": r.seconds, "version": _fio.fio_version(fio)}
    finally:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


def _failure(res: dict) -> str | None:
    """Why a worker's run is not a result (an error, or data that did not verify)."""
    if res.get("error"):
        return res["error"]
    if res.get("oom_kills"):
        return f"{res['oom_kills']} OOM kill(s) in the worker's cgroup"
    if res.get("verified") is not True:
        bad = (res.get("verify") or {}).get("mismatched")
        return ("data did not verify" +
                (f": tensors {bad} read back with the wrong bytes" if bad else
                 " (no verification result)"))
    return None


def _gen_read_bytes(shape) -> int:
    return sum(2 * shape.layers * (shape.prompt + i) * shape.row_bytes
               for i in range(shape.gen - 1))


def _f(x):
    return "-" if x is None else float(x)


def _row_line(r: dict) -> str:
    head = f"cap {r['cap_bytes'] / MiB:7.1f} MiB ({r['cap_fraction']:.2f} WS) {r['config']:12s}"
    if r.get("error"):
        return head + "  ERROR " + r["error"]
    hr = r.get("hit_rate")
    s = (f"{head} prefill {r['prefill_s']:6.3f} s  decode {r['decode_s']:6.3f} s  "
         f"hit {hr * 100 if hr is not None else float('nan'):5.1f}%  "
         f"dev read {r['decode_device_read_bytes'] / 1e9:5.2f} GB")
    if r.get("stall_steps"):
        s += f"  stalls {len(r['stall_steps'])} (max step {r['decode_step_max_s']:.2f} s)"
    if r.get("rebalances"):
        moved = sum(len(b["promoted"]) + len(b["demoted"]) for b in r["rebalances"])
        s += f"  moved {moved} layers"
    if r.get("pipeline"):
        s += f"  P·P {r['pipeline']['choice']}"
    if r.get("plan") and r["plan"].get("layers_pagecache") is not None:
        s += f"  n1 {len(r['plan']['layers_pagecache'])}"
    if _failure(r):
        s += f"  FAILED: {_failure(r)}"
    return s


def _aggregate(raw, caps, configs, shape, cal, fixed, ws):
    rows = []
    per_cap = []
    for f, cap in caps:
        # the cap's KV share cached, the rest at fio's device bandwidth: the same
        # line for every configuration
        ideal = ideal_decode_s(shape, max(0.0, f * ws), cal["pagecache_read_gbps"] * 1e9,
                               cal.get("ideal_dev_read_gbps", cal["dev_read_gbps"]) * 1e9)
        cap_rows = {}
        for cfg in configs:
            # a run whose data did not verify is not a result: left out of the figures
            runs = [x for x in raw if x["cap_bytes"] == cap and x["config"] == cfg
                    and not _failure(x)]
            r = {"cap_bytes": cap, "cap_fraction": f, "kv_cap_bytes": cap - fixed,
                 "config": cfg, "runs": len(runs), "ideal_decode_s": ideal,
                 "errors": [_failure(x) for x in raw if x["cap_bytes"] == cap
                            and x["config"] == cfg and _failure(x)]}
            for key in ("prefill_s", "decode_s", "hit_rate", "decode_device_read_bytes",
                        "prefill_device_write_bytes", "decode_device_write_bytes",
                        "peak_usage"):
                vals = [x[key] for x in runs if x.get(key) is not None]
                if vals:
                    med, spread = _common.median_spread(vals)
                    r[key] = med
                    r[key + "_spread"] = spread
                else:
                    r[key] = None
                    r[key + "_spread"] = None
            steps = [s for x in runs for s in x["decode_step_s"][1:]]
            r["decode_step_s"] = _common.median_spread(steps)[0] if steps else None
            # stalls are reported, never discounted (decode_s keeps them)
            r["stall_steps"] = sum(len(x.get("stall_steps") or []) for x in runs)
            mx = [x["decode_step_max_s"] for x in runs if x.get("decode_step_max_s")]
            r["decode_step_max_s"] = _common.median_spread(mx)[0] if mx else None
            if r.get("decode_s") and ideal:
                r["decode_vs_ideal"] = r["decode_s"] / ideal
            if cfg.startswith("dual"):
                r["pipeline_choices"] = [x["pipeline"]["choice"] for x in runs
                                         if x.get("pipeline")]
                r["n1_layers"] = [len(x["plan"]["layers_pagecache"]) for x in runs]
                r["peak_usage_vs_cap"] = [x["peak_usage"] / x["cap_bytes"] for x in runs
                                          if x.get("peak_usage")]
            cap_rows[cfg] = r
            rows.append(r)
        base = cap_rows.get("baseline")
        pc = {"cap_bytes": cap, "cap_fraction": f, "ideal_decode_s": ideal}
        for cfg, r in cap_rows.items():
            if base and base.get("decode_s") and r.get("decode_s"):
                r["ratio_decode_vs_baseline"] = r["decode_s"] / base["decode_s"]
                r["ratio_prefill_vs_baseline"] = r["prefill_s"] / base["prefill_s"]
                pc[f"ratio_decode_vs_baseline_{cfg}"] = r["ratio_decode_vs_baseline"]
                pc[f"ratio_prefill_vs_baseline_{cfg}"] = r["ratio_prefill_vs_baseline"]
        d = cap_rows.get("dual")
        if d is not None:
            pc["ratio_decode_vs_baseline"] = d.get("ratio_decode_vs_baseline")
            pc["ratio_prefill_vs_baseline"] = d.get("ratio_prefill_vs_baseline")
            others = [cap_rows[c]["decode_s"] for c in cap_rows
                      if not c.startswith("dual") and cap_rows[c].get("decode_s")]
            if others and d.get("decode_s"):
                pc["dual_decode_vs_best_other"] = d["decode_s"] / min(others)
        per_cap.append(pc)
    return rows, per_cap


def plot(rows, per_cap, path, shape, ws) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(1, 3, figsize=(15, 4.2))
    styles = {"baseline": ("tab:red", "o"), "cachepolicy": ("tab:orange", "s"),
              "direct": ("tab:blue", "^"), "dual": ("tab:green", "D"),
              "dual-nowb": ("tab:olive", "v"), "stock-mixed": ("tab:purple", "x"),
              "dual-mem": ("tab:cyan", "P"), "dual-mem-ra": ("tab:pink", "*")}
    for cfg in CONFIGS + EXTRA_CONFIGS:
        rs = [r for r in rows if r["config"] == cfg and r.get("decode_s")]
        if not rs:
            continue
        x = [r["cap_bytes"] / MiB for r in rs]
        c, m = styles[cfg]
        ax[0].plot(x, [r["prefill_s"] for r in rs], color=c, marker=m, label=LABELS[cfg])
        ax[1].plot(x, [r["decode_s"] for r in rs], color=c, marker=m, label=LABELS[cfg])
        if rs[0].get("hit_rate") is not None:
            ax[2].plot(x, [100 * (r["hit_rate"] or 0) for r in rs], color=c, marker=m,
                       label=LABELS[cfg])
    xi = [p["cap_bytes"] / MiB for p in per_cap]
    ax[1].plot(xi, [p["ideal_decode_s"] for p in per_cap], "k--", label="physical ideal")
    fixed = rows[0]["cap_bytes"] - rows[0]["kv_cap_bytes"] if rows else 0
    for a in ax:
        a.axvline((fixed + ws) / MiB, color="grey", lw=0.8, ls=":")
        a.set_xlabel("memory cap (MiB; dotted: fixed + KV working set)")
        a.grid(alpha=0.3)
    ax[0].set_ylabel("prefill latency (s)")
    ax[1].set_ylabel(f"decode latency, {shape.gen - 1} steps (s)")
    ax[2].set_ylabel("page-cache hit rate of decode reads (%)")
    ax[0].set_title("Prefill")
    ax[1].set_title("Decode")
    ax[2].set_title("Page-cache hit rate")
    ax[1].legend(fontsize=8)
    fig.suptitle(f"phx bench kv: {shape.layers} layers, KV {shape.tshape} {shape.dtype_name} x "
                 f"{2 * shape.layers} = {ws / MiB:.0f} MiB, prompt {shape.prompt}, "
                 f"gen {shape.gen}", fontsize=10)
    fig.tight_layout()
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
    fig.savefig(path, dpi=80)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    """``python -m phx.bench.kv [--worker CONF OUT | bench options]``."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"]:
        from phx.bench._kv_worker import main as worker_main
        return worker_main(argv[1:])
    p = Parser(prog="python -m phx.bench.kv", description=__doc__.splitlines()[0])
    add_arguments(p)
    try:
        return run(p.parse_args(argv))
    except BenchError as e:
        print(f"phx bench kv: {e}", file=sys.stderr)
        return e.status


if __name__ == "__main__":
    sys.exit(main())
