"""The Dual-Blade paper's four configurations on FlexLLMGen (``flexgen==0.1.8``), side by side.

    stock        FlexLLMGen's own TorchDisk (one .npy memmap per tensor, 4 copy
                 threads with 2 GiB pinned relays)
    cachepolicy  CachePolicy-only: phx.kv page-cache path + fadvise(DONTNEED) past
                 the budget (adapters/flexllmgen/phx_disk.py)
    direct       NVMe-direct-only: every KV tensor O_DIRECT through phx
    dual         Dual-Blade: Algorithm 1 split + adaptive pipeline, Co-DMA relays
    stock-mixed  FlexLLMGen's own CPU + disk split of the KV cache sized to the cap
                 (Policy(cache_cpu_percent = the cap's KV share), its TorchMixedDevice)
    dual-mem     Dual-Blade v2: Group 1 in memory that is never written back,
                 re-planned at every decode step (issue 26)
    dual-mem-ra  dual-mem with the next layers' Group 2 K/V read ahead
                 (READAHEAD tensors at once, buffers within the cap; issue 26 part 4)

Issue 26's harness: every worker warms up with a decode (3 new tokens) before its
caps; caps rotate per repeat (5 by default); the ideal caches the cap's KV share and
reads the rest at fio's bandwidth (measured once, for every configuration); stalls
(steps over twice the run's median) are counted, never discounted; every run's KV
digest (SHA-256 over every KV tensor's prefill rows as the disk gives them back) must
equal stock's, and a negative control (one KV tensor's reads corrupted) must change
the digest or the token ids.

One worker process per configuration loads OPT with ``_DUMMY_`` weights -- drawn
at random on the GPU from a fixed seed, the same in every worker (FlexLLMGen's own
dummy weights are all ones, which makes every KV row alike and would hide a KV
mix-up) -- and synthetic input ids (no tokenizer: no network), warms up, then for
every cap: moves itself into a fresh memory cgroup (memory.max = allowance +
fraction x KV working set, swap off), runs ``generate`` with a fresh offload
directory, moves back.  Charges made before the move (the interpreter, CUDA, the
model's host memory, every configuration's pinned relays) stay outside the cap, so
the cap holds the run's page cache and new memory; phx is told to keep the
allowance free (its budgeter reserve), so its budget is the KV share of the cap.

Reported per cap and configuration: prefill and decode latency (FlexLLMGen's
``timers("generate")``), the output token ids (every configuration must produce
the stock ones), bytes read and written on the device (/proc/self/io), the hit
rate of decode reads (1 - device bytes read / KV bytes decode read), pinned bytes,
the plan (dual), the pipeline's choice, and the physical ideal decode time: per
step max(compute, cached / page-cache bandwidth + rest / device bandwidth), with
the bytes the dual run actually had cached, the compute time of a run with the
KV cache on the GPU, and bandwidths measured in the same worker.

Run (root, a GPU, cgroup v1 or v2)::

    python adapters/flexllmgen/run_four.py --batch 4 --gen 8 --caps 0.2,0.4,0.6,0.8,1.0,1.2 \\
        --dir /var/tmp/flexkv --json flex.json --plot flex.png
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
import zlib
from collections.abc import Callable
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
CONFIGS = ("stock", "stock-mixed", "cachepolicy", "direct", "dual", "dual-mem", "dual-mem-ra")
#: dual-mem-ra's read-ahead: K/V tensors at once (phx bench kv's default too)
READAHEAD = 8
# not one of the paper's four: Dual-Blade without phx's write-behind (the paper's own
# design), run beside dual (--configs stock,cachepolicy,direct,dual,dual-nowb) so the
# two are compared in one run
EXTRA_CONFIGS = ("dual-nowb",)
LABELS = {"stock": "FlexLLMGen TorchDisk (baseline)",
          "stock-mixed": "FlexLLMGen CPU+disk split at the cap",
          "dual-mem": "Dual-Blade v2 (Group 1 in memory)",
          "dual-mem-ra": "Dual-Blade v2, Group 2 read ahead",
          "cachepolicy": "CachePolicy-only",
          "direct": "NVMe-direct-only (phx)", "dual": "Dual-Blade (phx.kv)",
          "dual-nowb": "Dual-Blade, no write-behind"}
MiB = 1 << 20


# -- workload arithmetic (no torch needed: the parent and the tests use it) ----------
def kv_shape(cfg: dict[str, Any]) -> tuple[int, int, int]:
    """FlexLLMGen's cache tensor: (prompt + gen - 1, batch * heads, head_dim)."""
    return (cfg["prompt"] + cfg["gen"] - 1, cfg["batch"] * cfg["heads"],
            cfg["hidden"] // cfg["heads"])


def tensor_bytes(cfg: dict[str, Any]) -> int:
    r, c, d = kv_shape(cfg)
    return r * c * d * 2


def working_set(cfg: dict[str, Any]) -> int:
    return 2 * int(cfg["layers"]) * tensor_bytes(cfg)


def decode_read_bytes(cfg: dict[str, Any]) -> list[int]:
    """KV bytes FlexLLMGen reads in each decode step (rows [0:prompt+i], K and V)."""
    row = cfg["batch"] * cfg["hidden"] * 2
    return [2 * cfg["layers"] * (cfg["prompt"] + i) * row for i in range(1, cfg["gen"])]


def ideal_decode_s(cfg: dict[str, Any], hit_rate: float, compute_step_s: float, pc_bw: float,
                   dev_bw: float) -> float:
    """Overlap model: per step max(compute, cached/pc_bw + rest/dev_bw).  The
    runner passes the cap's KV share as ``hit_rate`` (not any configuration's own)
    and fio's device bandwidth."""
    t = 0.0
    for b in decode_read_bytes(cfg):
        c = hit_rate * b
        t += max(compute_step_s, c / pc_bw + (b - c) / dev_bw)
    return t


MODELS = {"facebook/opt-6.7b": {"layers": 32, "hidden": 4096, "heads": 32},
          "facebook/opt-1.3b": {"layers": 24, "hidden": 2048, "heads": 32},
          "facebook/opt-125m": {"layers": 12, "hidden": 768, "heads": 12}}


# -- the worker (one configuration, all caps) ----------------------------------------
def run_capped(name: str, limit: int, base: str,
               fn: Callable[[], Any]) -> tuple[Any, dict[str, Any]]:
    """Run ``fn()`` with this whole process moved into a fresh memory cgroup of
    ``limit`` bytes (swap off), then moved back to the cgroup directory ``base``.

    Memory charged before the move stays where it was: the cap holds what ``fn``
    newly charges (its page cache, new allocations).  Returns ``(fn's value or
    None, info)``; info has the device bytes, the cgroup's peak, OOM kills and an
    ``error`` when fn raised.
    """
    from phx.bench._kv_cgroup import MemCgroup
    from phx.kv import _sys
    cg = MemCgroup(name, limit)
    info: dict[str, Any] = {"cap_bytes": limit}
    val = None
    io0 = _sys.proc_io()
    try:
        cg.add(os.getpid())
        val = fn()
    except Exception as e:              # noqa: BLE001 - one cap's failure is a result
        info["error"] = f"{type(e).__name__}: {e}"
    finally:
        io1 = _sys.proc_io()
        with open(os.path.join(base, "cgroup.procs"), "w") as f:
            f.write(str(os.getpid()))
        info["peak_bytes"] = cg.peak()
        info["oom_kills"] = cg.oom_kills()
        info["swap_limited"] = cg.swap_limited
        cg.close()
    info["device_read_bytes"] = io1.get("read_bytes", 0) - io0.get("read_bytes", 0)
    info["device_write_bytes"] = io1.get("write_bytes", 0) - io0.get("write_bytes", 0)
    return val, info


def stall_steps(steps: list[float]) -> list[int]:
    """Steps over twice the run's median step (reported; decode_s keeps them)."""
    if not steps:
        return []
    m = sorted(steps)[len(steps) // 2]
    return [i for i, x in enumerate(steps) if x > 2 * m]


def mixed_cpu_percent(frac: float) -> float:
    """stock-mixed's ``cache_cpu_percent``: the cap's KV share of the working set
    (FlexLLMGen rounds it down to whole heads itself)."""
    return max(0.0, min(100.0, 100.0 * frac))


class _Digests:
    """SHA-256 of each KV cache tensor's prefill rows, by allocation order, taken
    as FlexLLMGen deletes it (stock's .npy files, the mixed device's segments
    joined along axis 1)."""

    def __init__(self) -> None:
        self.by_index: dict[int, str] = {}
        self.index: dict[str, int] = {}
        self.prompt = 0

    def note(self, tensors: Any, prompt: int) -> None:
        self.prompt = prompt
        for t in tensors:
            self.index.setdefault(t.name, len(self.index))

    def take(self, tensor: Any, arr: Any) -> None:
        import hashlib
        import numpy as np
        i = self.index.get(tensor.name)
        if i is not None:
            b = np.ascontiguousarray(arr[:self.prompt]).view(np.uint8)
            self.by_index[i] = hashlib.sha256(b).hexdigest()

    def digest(self) -> str | None:
        import hashlib
        if not self.by_index:
            return None
        h = hashlib.sha256()
        for i in sorted(self.by_index):
            h.update(self.by_index[i].encode())
        return h.hexdigest()


def _digesting_devices(dg: _Digests) -> tuple[Any, Any]:
    """stock's TorchDisk and TorchMixedDevice, digesting KV cache tensors as they
    are deleted.  A mixed tensor's ``delete()`` (flexgen 0.1.8's TorchTensor) only
    drops its references -- the device's own ``delete`` is called for disk
    tensors alone -- so each mixed KV tensor's ``delete`` is wrapped: digest, then
    FlexLLMGen's own."""
    import numpy as np
    from flexgen.pytorch_backend import TorchDisk, TorchMixedDevice

    class DigestDisk(TorchDisk):            # type: ignore[misc]  # untyped base
        def init_cache_one_gpu_batch(self, config: Any, task: Any, policy: Any) -> Any:
            kv = super().init_cache_one_gpu_batch(config, task, policy)
            dg.note(kv, task.prompt_len)
            return kv

        def delete(self, tensor: Any) -> None:
            if os.path.exists(tensor.data):
                dg.take(tensor, np.load(tensor.data, mmap_mode="r"))
            super().delete(tensor)

    def digest_mixed(t: Any) -> None:
        parts = []
        for x in t.data[0]:
            if x is None:
                continue
            d = x.data
            parts.append(np.load(d, mmap_mode="r") if isinstance(d, str) else d.cpu().numpy())
        if parts:
            dg.take(t, np.concatenate(parts, axis=1))

    class DigestMixed(TorchMixedDevice):    # type: ignore[misc]  # untyped base
        def init_cache_one_gpu_batch(self, config: Any, task: Any, policy: Any) -> Any:
            kv = super().init_cache_one_gpu_batch(config, task, policy)
            dg.note(kv, task.prompt_len)
            for t in kv:
                own = t.delete

                def delete(t: Any = t, own: Any = own) -> None:
                    digest_mixed(t)
                    own()
                t.delete = delete
            return kv
    return DigestDisk, DigestMixed


def _random_weights(seed: int) -> Any:
    """A replacement for flex_opt.init_weight_list: weights on their home device,
    seeded random (the same bytes in every process)."""
    import numpy as np
    import torch
    from flexgen import flex_opt as fo

    def init_weight_list(weight_specs: Any, policy: Any, env: Any) -> list[Any]:
        if policy.w_gpu_percent != 100:
            raise ValueError("the runner keeps the weights on the GPU (--percent 100 0 ...)")
        ret = []
        for shape, dtype, filename in weight_specs:
            w = env.gpu.allocate(shape, dtype)
            name = os.path.basename(filename)
            g = torch.Generator(device=w.data.device)
            g.manual_seed(seed ^ zlib.crc32(name.encode()))
            w.data.normal_(0.0, 0.02, generator=g)
            if "layer_norm" in name and name.endswith("weight"):
                w.data.add_(1.0)
            ret.append(w)
        return ret
    fo.init_weight_list = init_weight_list
    return np


def worker(conf: dict[str, Any], out: str | None = None) -> dict[str, Any]:
    """One configuration at every cap; ``out`` gets the results so far after each
    cap (a worker stopped by its timeout still leaves the caps it finished)."""
    import numpy as np
    import torch
    sys.path.insert(0, HERE)
    from flexgen import flex_opt as fo
    from flexgen.compression import CompressionConfig
    from flexgen.pytorch_backend import TorchDevice
    from flexgen.timer import timers
    from flexgen.utils import ExecutionEnv
    from phx.kv import _sys
    from phx_disk import PhxDisk

    _random_weights(conf["seed"])
    torch.backends.cudnn.deterministic = True
    cfg = conf["config"]
    root = conf["dir"]
    os.makedirs(root, exist_ok=True)
    allowance = conf["allowance"]
    ws = working_set(conf)
    tb = tensor_bytes(conf)

    def policy(cache_gpu: int, cache_cpu: float = 0) -> Any:
        cc = CompressionConfig(num_bits=4, group_size=64, group_dim=0, symmetric=False)
        return fo.Policy(conf["batch"], 1, 100, 0, cache_gpu, cache_cpu, 100, 0, True, True,
                         True, False, 1.0, False, cc, False,
                         CompressionConfig(num_bits=4, group_size=64, group_dim=2,
                                           symmetric=False))
    gpu, cpu = TorchDevice("cuda:0"), TorchDevice("cpu")
    dg = _Digests()
    DigestDisk, DigestMixed = _digesting_devices(dg)
    stock = cfg in ("stock", "stock-mixed")
    if stock:
        disk = DigestDisk(os.path.join(root, "warm"))
        pinned = len(disk.copy_threads) * 2 * 1024 ** 3     # 1 Gi fp16 elements each
    else:
        nowb = cfg == "dual-nowb"
        # dual-mem measures what the cap holds besides the KV (no allowance as
        # reserve) and re-plans every step; the others keep the v1 harness's reserve
        mode = "dual" if nowb else "dual-mem" if cfg == "dual-mem-ra" else cfg
        disk = PhxDisk(os.path.join(root, "warm"), mode=mode, relay_bytes=tb,
                       reserve=None if mode == "dual-mem" else allowance,
                       strategy=conf.get("strategy"),
                       write_behind=False if nowb else None,
                       corrupt_read=bool(conf.get("corrupt_read")),
                       readahead=READAHEAD if cfg == "dual-mem-ra" else 0)
        pinned = disk.relays.pinned_bytes if disk.relays else 0
    env = ExecutionEnv(gpu=gpu, cpu=cpu, disk=disk, mixed=DigestMixed([gpu, cpu, disk]))
    opt_config = fo.get_opt_config(conf["model"])
    rng = np.random.default_rng(conf["seed"])
    nprompts = conf["batch"]
    inputs = tuple(rng.integers(4, 50000, conf["prompt"]).tolist() for _ in range(nprompts))
    warm = tuple(rng.integers(4, 50000, 32).tolist() for _ in range(nprompts))
    res: dict[str, Any] = {"config": cfg, "pinned_bytes": pinned, "runs": []}
    t0 = time.perf_counter()
    model = fo.OptLM(opt_config, env, "_DUMMY_", policy(0))
    res["load_s"] = time.perf_counter() - t0
    # the warm-up: a prefill and two decode steps, in every worker
    model.generate(warm, max_new_tokens=3)

    if conf.get("calibrate"):
        # the ideal's terms: compute with the KV cache on the GPU; the bandwidths
        model_gpu = fo.OptLM(opt_config, env, "_DUMMY_", policy(100))
        model_gpu.generate(warm, max_new_tokens=1)
        timers("generate").reset()
        ids = model_gpu.generate(inputs, max_new_tokens=conf["gen"])
        c = timers("generate").costs
        res["compute"] = {"prefill_s": c[0], "decode_step_s": sorted(c[1:])[len(c[1:]) // 2],
                          "output_ids": np.asarray(ids).tolist()}
        del model_gpu
        torch.cuda.empty_cache()
        from phx.bench._kv_worker import Shape, calibrate
        shape = Shape({"layers": conf["layers"], "batch": conf["batch"],
                       "hidden": conf["hidden"], "heads": conf["heads"],
                       "prompt": conf["prompt"], "gen": conf["gen"], "dtype": "float16"})
        src = _sys.aligned_empty(conf["prompt"] * shape.row_bytes)
        src[:] = np.frombuffer(os.urandom(src.nbytes), np.uint8)
        res["calibration"] = calibrate(shape, os.path.join(root, "cal"), src, 2)

    from phx.bench._common import drop_caches
    base = conf["base_cgroup"]
    for frac in conf["caps"]:
        d = os.path.join(root, f"cap{frac}")
        if stock:
            os.makedirs(d, exist_ok=True)
            disk.path = d
        else:
            disk.set_path(d)
        limit = allowance + int(frac * ws)
        if cfg == "stock-mixed":
            # FlexLLMGen's own split for this cap: a model with that policy
            del model
            torch.cuda.empty_cache()
            model = fo.OptLM(opt_config, env, "_DUMMY_", policy(0, mixed_cpu_percent(frac)))
            model.generate(warm, max_new_tokens=3)
        dg.by_index.clear()
        dg.index.clear()

        def gen() -> tuple[Any, list[float]]:
            timers("generate").reset()
            ids = model.generate(inputs, max_new_tokens=conf["gen"])
            return ids, list(timers("generate").costs)
        # every cap starts clean: the previous cap's KV (deleted below) written back
        # and its pages gone, so no writeback or journal commit of it lands in this
        # cap's timing (same for every configuration, outside the timed part)
        clean = drop_caches()
        val, info = run_capped(f"phx-flex-{os.getpid()}-{cfg}-{int(frac * 100)}", limit, base,
                               gen)
        run = {"cap_fraction": frac, "clean_start": clean, **info}
        if val is not None:
            ids, costs = val
            run.update({
                "prefill_s": costs[0], "decode_s": sum(costs[1:]), "decode_step_s": costs[1:],
                "stall_steps": stall_steps(costs[1:]),
                "output_ids": np.asarray(ids).tolist()})
            logical = sum(decode_read_bytes(conf))
            run["hit_rate"] = max(0.0, 1.0 - run["device_read_bytes"] / logical)
        if not stock:
            run["phx"] = disk.stats()
            run["kv_digest"] = run["phx"]["kv_digest"]
        else:
            run["kv_digest"] = dg.digest()
        if cfg == "stock-mixed":
            run["cache_cpu_percent"] = mixed_cpu_percent(frac)
        res["runs"].append(run)
        shutil.rmtree(d, ignore_errors=True)
        if out:
            with open(out + ".tmp", "w") as f:
                json.dump(res, f)
            os.replace(out + ".tmp", out)
    if not stock:
        disk.close()
    else:
        disk.close_copy_threads()
    return res


# -- the parent ------------------------------------------------------------------------
def _failure(run: dict[str, Any], want_ids: Any, want_digest: str | None = None) -> str | None:
    if run.get("error"):
        return str(run["error"])
    if run.get("oom_kills"):
        return f"{run['oom_kills']} OOM kill(s) in its cgroup"
    if want_ids is not None and run.get("output_ids") != want_ids:
        return "output token ids differ from stock FlexLLMGen's"
    if want_digest is not None and run.get("kv_digest") != want_digest:
        return "KV digest differs from stock FlexLLMGen's"
    return None


def aggregate(results: list[dict[str, Any]], conf: dict[str, Any]) -> dict[str, Any]:
    """Medians per cap and configuration, the ids check, ratios and the ideal."""
    from statistics import median
    stock_ids = None
    stock_digest = None
    control = [r for r in results if r.get("control")]
    results = [r for r in results if not r.get("control")]
    for r in results:
        if r["config"] == "stock":
            for run in r["runs"]:
                if run.get("output_ids") is not None:
                    stock_ids = stock_ids or run["output_ids"]
                if run.get("kv_digest"):
                    stock_digest = stock_digest or run["kv_digest"]
    cal = next((r for r in results if r.get("calibration")), None)
    rows = []
    checks = []
    for frac in conf["caps"]:
        per = {}
        for cfg in conf["configs"]:
            runs = [run for r in results if r["config"] == cfg for run in r["runs"]
                    if run["cap_fraction"] == frac]
            bad = [_failure(x, stock_ids, stock_digest) for x in runs]
            good = [x for x, b in zip(runs, bad) if b is None]
            checks += [{"cap_fraction": frac, "config": cfg, "failure": b} for b in bad if b]
            row = {"cap_fraction": frac, "config": cfg, "runs": len(good),
                   "cap_bytes": runs[0]["cap_bytes"] if runs else None,
                   "errors": [b for b in bad if b]}
            for k in ("prefill_s", "decode_s", "hit_rate", "device_read_bytes",
                      "device_write_bytes", "peak_bytes"):
                vals = [x[k] for x in good if x.get(k) is not None]
                row[k] = median(vals) if vals else None
                row[k + "_spread"] = ((max(vals) - min(vals)) / median(vals)
                                      if vals and median(vals) else None)
            row["pinned_bytes"] = next((r["pinned_bytes"] for r in results
                                        if r["config"] == cfg), None)
            # every run's prefill and stall count: nothing discounted, either side
            row["prefill_runs"] = [x.get("prefill_s") for x in good]
            row["stall_steps"] = sum(len(x.get("stall_steps") or []) for x in good)
            if cfg.startswith("dual"):
                row["n1"] = [len((x.get("phx") or {}).get("plan", {}).get("layers_pagecache")
                                 or []) for x in good]
                row["pipeline"] = [((x.get("phx") or {}).get("pipeline") or {}).get("choice")
                                   for x in good]
            per[cfg] = row
            rows.append(row)
        base = per.get("stock")
        for cfg, row in per.items():
            if base and base.get("decode_s") and row.get("decode_s"):
                row["decode_vs_stock"] = row["decode_s"] / base["decode_s"]
                row["prefill_vs_stock"] = row["prefill_s"] / base["prefill_s"]
        if cal:
            # the cap's KV share cached, the rest at fio's bandwidth (phx's own
            # calibration only where fio did not run): one line for everyone
            c = cal["calibration"]
            dev = (conf.get("fio") or {}).get("gbps") or c["dev_read_gbps"]
            ideal = ideal_decode_s(conf, min(1.0, frac), cal["compute"]["decode_step_s"],
                                   c["pagecache_read_gbps"] * 1e9, dev * 1e9)
            for row in per.values():
                row["ideal_decode_s"] = ideal
                if row.get("decode_s"):
                    row["decode_vs_ideal"] = row["decode_s"] / ideal
    gpu_ids = (cal or {}).get("compute", {}).get("output_ids")
    return {"rows": rows, "checks": checks, "stock_ids_found": stock_ids is not None,
            # the KV cache kept on the GPU (no disk at all) gives the same tokens too
            "gpu_cache_ids_identical": None if gpu_ids is None or stock_ids is None
            else gpu_ids == stock_ids,
            "ids_identical": stock_ids is not None and not any(
                c["failure"] == "output token ids differ from stock FlexLLMGen's" for c in checks),
            "digests_identical": stock_digest is not None and not any(
                c["failure"] == "KV digest differs from stock FlexLLMGen's" for c in checks),
            "negative_control": _control(control, stock_ids, stock_digest)}


def _control(control: list[dict[str, Any]], ids: Any, digest: str | None) -> dict[str, Any] | None:
    """The negative control is detected when its digest or its token ids differ."""
    if not control:
        return None
    runs = [x for r in control for x in r["runs"] if not x.get("error")]
    return {"runs": len(runs),
            "digest_changed": any(x.get("kv_digest") != digest for x in runs),
            "ids_changed": any(x.get("output_ids") != ids for x in runs),
            "detected": bool(runs) and all(x.get("kv_digest") != digest or
                                           x.get("output_ids") != ids for x in runs)}


def table(rows: list[dict[str, Any]]) -> str:
    hdr = ["cap x WS", "config", "prefill s", "decode s", "pre/stock", "dec/stock",
           "hit %", "dev read GB", "ideal s", "pinned MiB", "errors"]
    out = [" | ".join(hdr), " | ".join("---" for _ in hdr)]

    def f(x: float | None, fmt: str = "{:.3f}") -> str:
        return "-" if x is None else fmt.format(x)
    for r in rows:
        out.append(" | ".join([
            f"{r['cap_fraction']:.2f}", r["config"], f(r.get("prefill_s")), f(r.get("decode_s")),
            f(r.get("prefill_vs_stock"), "{:.2f}"), f(r.get("decode_vs_stock"), "{:.2f}"),
            f(r["hit_rate"] * 100 if r.get("hit_rate") is not None else None, "{:.1f}"),
            f(r["device_read_bytes"] / 1e9 if r.get("device_read_bytes") is not None else None,
              "{:.2f}"),
            f(r.get("ideal_decode_s")),
            f(r["pinned_bytes"] / MiB if r.get("pinned_bytes") is not None else None, "{:.0f}"),
            "; ".join(r["errors"]) or ""]))
    return "\n".join(out)


def plot(rows: list[dict[str, Any]], path: str, conf: dict[str, Any]) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(1, 3, figsize=(15, 4.2))
    styles = {"stock": ("tab:red", "o"), "cachepolicy": ("tab:orange", "s"),
              "direct": ("tab:blue", "^"), "dual": ("tab:green", "D"),
              "dual-nowb": ("tab:olive", "v"), "stock-mixed": ("tab:purple", "x"),
              "dual-mem": ("tab:cyan", "P"), "dual-mem-ra": ("tab:pink", "*")}
    for cfg in CONFIGS + EXTRA_CONFIGS:
        rs = [r for r in rows if r["config"] == cfg and r.get("decode_s") is not None]
        if not rs:
            continue
        x = [r["cap_fraction"] for r in rs]
        c, m = styles[cfg]
        ax[0].plot(x, [r["prefill_s"] for r in rs], color=c, marker=m, label=LABELS[cfg])
        ax[1].plot(x, [r["decode_s"] for r in rs], color=c, marker=m, label=LABELS[cfg])
        ax[2].plot(x, [100 * r["hit_rate"] for r in rs], color=c, marker=m, label=LABELS[cfg])
    ideal = [r for r in rows if r["config"] == "dual" and r.get("ideal_decode_s")]
    if ideal:
        ax[1].plot([r["cap_fraction"] for r in ideal], [r["ideal_decode_s"] for r in ideal],
                   "k--", label="physical ideal")
    for a, t, y in zip(ax, ("Prefill", "Decode", "Hit rate of decode reads"),
                       ("latency (s)", f"latency, {conf['gen'] - 1} steps (s)", "%")):
        a.set_title(t)
        a.set_ylabel(y)
        a.set_xlabel("memory cap (x KV working set, + allowance)")
        a.grid(alpha=0.3)
    if ax[1].get_legend_handles_labels()[0]:
        ax[1].legend(fontsize=8)
    fig.suptitle(f"FlexLLMGen {conf['model']}, batch {conf['batch']}, prompt {conf['prompt']}, "
                 f"gen {conf['gen']}: KV {working_set(conf) / MiB:.0f} MiB", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def plan_jobs(configs: list[str], caps: list[float], repeat: int,
              control: bool) -> list[tuple[int, str, list[float], bool]]:
    """(repeat, configuration, its caps in order, is the negative control) per
    worker: configurations and caps both rotate by one per repeat; the control
    (dual-mem, else the last configuration, at the first cap) comes last."""
    jobs = []
    for rep in range(repeat):
        order = configs[rep % len(configs):] + configs[:rep % len(configs)]
        jobs += [(rep, cfg, caps[rep % len(caps):] + caps[:rep % len(caps)], False)
                 for cfg in order]
    if control:
        jobs.append((0, "dual-mem" if "dual-mem" in configs else configs[-1], caps[:1], True))
    return jobs


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"]:
        conf = json.loads(argv[1])
        try:
            res = worker(conf, argv[2])
            rc = 0
        except BaseException as e:     # noqa: BLE001 - reported, then the process ends
            import traceback
            traceback.print_exc()
            res = {"config": conf["config"], "pinned_bytes": None, "runs": []}
            if os.path.exists(argv[2]):
                with open(argv[2]) as f:
                    res = json.load(f)
            done = {x["cap_fraction"] for x in res["runs"]}
            res["runs"] += [{"cap_fraction": f, "cap_bytes": None,
                             "error": f"worker failed: {type(e).__name__}: {e}"}
                            for f in conf["caps"] if f not in done]
            rc = 1
        with open(argv[2], "w") as f:
            json.dump(res, f)
        sys.stdout.flush()
        sys.stderr.flush()
        # FlexLLMGen's copy threads are not daemons: a failed run must not hang here
        os._exit(rc)
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="facebook/opt-6.7b", choices=sorted(MODELS))
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--prompt", type=int, default=512)
    p.add_argument("--gen", type=int, default=8)
    p.add_argument("--caps", default="0.2,0.4,0.6,0.8,1.0,1.2")
    p.add_argument("--configs", default=",".join(CONFIGS))
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--no-fio", action="store_true",
                   help="the ideal's device bandwidth from phx's calibration, not fio")
    p.add_argument("--no-negative-control", action="store_true",
                   help="skip the worker whose KV reads of one tensor are corrupted")
    p.add_argument("--allowance", type=int, default=256 * MiB,
                   help="bytes of the cap beyond the KV share (the run's new non-KV memory)")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--dir", default="/var/tmp/flexkv")
    p.add_argument("--json", default=None)
    p.add_argument("--plot", default=None)
    p.add_argument("--timeout", type=float, default=900, help="seconds per worker at most")
    p.add_argument("--budget-s", type=float, default=None,
                   help="seconds for the whole sweep: each worker gets the time left / the "
                        "workers left (caps it finished are kept when it is stopped)")
    a = p.parse_args(argv)
    conf = {"model": a.model, **MODELS[a.model], "batch": a.batch, "prompt": a.prompt,
            "gen": a.gen, "caps": [float(x) for x in a.caps.split(",")],
            "configs": [c for c in a.configs.split(",") if c], "allowance": a.allowance,
            "seed": a.seed}
    bad = [c for c in conf["configs"] if c not in CONFIGS + EXTRA_CONFIGS]
    if bad:
        print(f"run_four: unknown configuration(s) {', '.join(bad)}; known: "
              f"{', '.join(CONFIGS + EXTRA_CONFIGS)}", file=sys.stderr)
        return 2
    if "stock" not in conf["configs"]:
        print("run_four: the stock configuration is the reference for the token ids",
              file=sys.stderr)
        return 2
    from phx.bench._kv_cgroup import MemCgroup, can_create
    ok, why = can_create()
    if not ok:
        print(f"run_four: {why}", file=sys.stderr)
        return 1
    print(f"KV working set {working_set(conf) / MiB:.0f} MiB ({kv_shape(conf)} fp16 x "
          f"{2 * conf['layers']}); decode reads {sum(decode_read_bytes(conf)) / 1e9:.2f} GB; "
          f"caps = {a.allowance / MiB:.0f} MiB + fraction x WS", flush=True)
    if not a.no_fio:
        from phx.bench.kv import fio_read_gbps
        try:
            conf["fio"] = fio_read_gbps(a.dir)
            print(f"device read {conf['fio']['gbps']:.2f} GB/s (fio): the ideal's", flush=True)
        except (RuntimeError, OSError, subprocess.SubprocessError) as e:
            print(f"fio not usable ({e}): the ideal uses phx's calibration", flush=True)
    results: list[dict[str, Any]] = []
    t_start = time.time()
    jobs = plan_jobs(conf["configs"], conf["caps"], a.repeat, not a.no_negative_control)
    n_workers = len(jobs)
    for rep, cfg, cap_order, is_control in jobs:
        out = os.path.join(a.dir, f"result-{cfg}-{rep}.json")
        os.makedirs(a.dir, exist_ok=True)
        base = MemCgroup(f"phx-flex-base-{os.getpid()}-{cfg}", None)
        wconf = {**conf, "config": cfg, "dir": os.path.join(a.dir, f"{cfg}-{rep}"),
                 "base_cgroup": base.path, "caps": cap_order,
                 "calibrate": cfg == "dual" and rep == 0 and not is_control,
                 "corrupt_read": is_control}
        t0 = time.time()
        timeout = a.timeout
        if a.budget_s is not None:
            left = n_workers - len(results)
            timeout = min(timeout, max(30.0, (a.budget_s - (t0 - t_start)) / left))
        if os.path.exists(out):
            os.unlink(out)
        proc = base.popen([sys.executable, os.path.abspath(__file__), "--worker",
                           json.dumps(wconf), out])
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            rc = proc.wait()
        base.close()
        if os.path.exists(out):       # all caps, or those done before a timeout
            with open(out) as f:
                r = json.load(f)
            if rc != 0:
                done = {x["cap_fraction"] for x in r["runs"]}
                r["runs"] += [{"cap_fraction": f, "cap_bytes": None,
                               "error": f"worker exit {rc} before this cap"}
                              for f in cap_order if f not in done]
            r["repeat"] = rep
            r["control"] = is_control
            results.append(r)
            os.unlink(out)
            for run in r["runs"]:
                print(f"  {cfg:12s} cap {run['cap_fraction']:.2f}: prefill "
                      f"{run.get('prefill_s', float('nan')):.3f} s decode "
                      f"{run.get('decode_s', float('nan')):.3f} s hit "
                      f"{100 * run.get('hit_rate', float('nan')):.1f}% "
                      f"{run.get('error') or ''}", flush=True)
        else:
            print(f"  {cfg}: worker exit {rc} after {time.time() - t0:.0f} s", flush=True)
            results.append({"config": cfg, "repeat": rep, "control": is_control, "runs": [
                {"cap_fraction": f, "cap_bytes": None, "error": f"worker exit {rc}"}
                for f in cap_order], "pinned_bytes": None})
        shutil.rmtree(wconf["dir"], ignore_errors=True)
    agg = aggregate(results, conf)
    print(table(agg["rows"]))
    print("output token ids identical to stock FlexLLMGen's in every run:",
          agg["ids_identical"], "| KV digests identical:", agg["digests_identical"],
          "| KV cache on the GPU gives them too:", agg["gpu_cache_ids_identical"],
          "| negative control detected:", (agg["negative_control"] or {}).get("detected"))
    doc = {"benchmark": "flexllmgen-four", "workload": conf, "working_set_bytes":
           working_set(conf), **agg, "raw": results}
    if a.json:
        with open(a.json, "w") as f:
            json.dump(doc, f, indent=1)
    if a.plot:
        plot(agg["rows"], a.plot, conf)
    nc = agg["negative_control"]
    return 0 if (agg["ids_identical"] and agg["digests_identical"] and not agg["checks"]
                 and (nc is None or nc["detected"])) else 1


if __name__ == "__main__":
    sys.exit(main())
