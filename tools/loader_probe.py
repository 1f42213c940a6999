#!/usr/bin/env python3
"""Where phx.loader's time goes on a GPU box (zram, so software decides).

    python3 tools/loader_probe.py [--size 4G] [--json out.json]

Writes a Llama-shaped checkpoint (phx.bench.load's) into a fresh zram ext4
and times, each in a fresh process: the phx.gpu context's creation alone;
read_chunks of every shard whole into one preallocated GPU buffer (no
loader); phx.loader.load_file with its defaults and with other group /
in-flight sizes; raw O_DIRECT preadv by 16 threads.  A diagnostic, not a
benchmark: `phx bench load` is the side-by-side comparison.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time


def child(kind: str, d: str, arg: str) -> dict:
    import torch

    import phx
    import phx.gpu
    from phx import loader
    from phx.bench.load import _raw, _shards
    torch.zeros(1, device="cuda")
    torch.cuda.synchronize()
    out: dict = {}
    t0 = time.perf_counter()
    if kind == "raw":
        dt, n = _raw(d, int(arg))
        return {"seconds": dt, "bytes": n}
    phx.gpu.context()
    out["ctx_s"] = time.perf_counter() - t0
    if kind == "ctx":
        return out
    if kind == "chunks":
        shards = _shards(d)
        sizes = [os.path.getsize(p) for p in shards]
        bufs = [torch.empty(s, dtype=torch.uint8, device="cuda") for s in sizes]
        torch.cuda.synchronize()
        files = [phx.open(p, "r", allow_buffered=True) for p in shards]
        step = int(arg) << 20
        t1 = time.perf_counter()
        futs = []
        for f, b, s in zip(files, bufs, sizes):
            offs = list(range(0, s, step))
            futs.append(phx.gpu.read_chunks_async(b, f, offs, offs,
                                                  [min(step, s - o) for o in offs]))
        n = sum(sum(fu.result()) for fu in futs)
        out.update(seconds=time.perf_counter() - t1, bytes=n)
        return out
    if kind == "load":
        kw = json.loads(arg) if arg else {}
        t1 = time.perf_counter()
        sd = loader.load_file(os.path.join(d, "model.safetensors.index.json"), "cuda", **kw)
        torch.cuda.synchronize()
        out.update(seconds=time.perf_counter() - t1,
                   bytes=sum(t.numel() * t.element_size() for t in sd.values()))
        return out
    raise SystemExit(f"unknown kind {kind}")


def spawn(kind: str, d: str, arg: str = "", env: dict | None = None) -> dict:
    e = dict(os.environ, **(env or {}))
    p = subprocess.run([sys.executable, __file__, "--child", kind, d, arg],
                       capture_output=True, text=True, env=e, timeout=300)
    for line in p.stdout.splitlines():
        if line.startswith("PROBE "):
            r = json.loads(line[6:])
            if "bytes" in r:
                r["GBps"] = r["bytes"] / r["seconds"] / 1e9
            return r
    return {"error": (p.stderr.strip().splitlines() or ["?"])[-1][:300]}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", default="4G")
    ap.add_argument("--json")
    ap.add_argument("--child", nargs=3)
    ap.add_argument("--quick", action="store_true", help="context and raw rows only")
    a = ap.parse_args()
    if a.child:
        print("PROBE " + json.dumps(child(*a.child)), flush=True)
        return 0
    from phx.bench._common import parse_size
    from phx.bench._zram import zram_ext4
    from phx.bench.load import write_checkpoint
    size = parse_size(a.size)
    rows = []
    for f in ("enabled", "defrag"):
        try:
            with open(f"/sys/kernel/mm/transparent_hugepage/{f}") as fh:
                print(f"THP {f}: {fh.read().strip()}")
        except OSError as e:
            print(f"THP {f}: {e}")
    with zram_ext4(int(size * 1.15) + (512 << 20)) as z:
        d = os.path.join(z.mountpoint, "ckpt")
        os.makedirs(d)
        write_checkpoint(d, size, 4, 1234, False)
        plan = [("raw 16t", "raw", "16", None), ("ctx only", "ctx", "", None),
                ("ctx only again", "ctx", "", None),
                ("ctx bufs 2", "ctx", "", {"PHX_CUDA_BUFS": "2"}),
                ("ctx lanes 8", "ctx", "", {"PHX_CUDA_LANES": "8"}),
                ("chunks 256M", "chunks", "256", None),
                ("load default", "load", "", None),
                ("load bufs 2", "load", "", {"PHX_CUDA_BUFS": "2"}),
                ("load lanes 8", "load", "", {"PHX_CUDA_LANES": "8"}),
                ("load default again", "load", "", None)]
        if a.quick:
            plan = plan[:6]
        for name, kind, arg, env in plan:
            r = spawn(kind, d, arg, env)
            r["name"] = name
            rows.append(r)
            print(f"{name:22s} " + " ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}"
                                             for k, v in r.items() if k != "name"), flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
