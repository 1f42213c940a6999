"""Stream-ordered GPU I/O, timed op by op (diagnosis of issue 11's slow path).

python3 tools/stream_probe.py FILE [--ops N] [--chunk BYTES] [--configs a,b]
Each config is a private staging context; each op's stream time comes from
CUDA events around it; host-async read_chunks of the same bytes for reference.
"""
import argparse
import json
import os
import time

import numpy as np
import torch

import phx
import phx.gpu as pg


def drop(path):
    fd = os.open(path, os.O_RDONLY)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    os.close(fd)


def one(path, cfg, n, chunk, write, boff_mod):
    eng = phx.Engine()
    ctx = pg.context(eng, 0, _new=True, **cfg)
    buf = torch.empty(n * chunk + 4096, dtype=torch.uint8, device="cuda")
    s = torch.cuda.Stream()
    evs = [torch.cuda.Event(enable_timing=True) for _ in range(n + 1)]
    res = {}
    with phx.open(path, "r+", engine=eng) as f:
        from phx._lib import cuda as _c
        args = [np.array([chunk, i * chunk, i * chunk + boff_mod, -1], dtype=np.int64)
                for i in range(n)]
        drop(path)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.cuda.stream(s):
            evs[0].record(s)
            for i, a in enumerate(args):
                ctx.stream_deferred(f._c_file, buf.data_ptr(), a.ctypes.data, write, s.cuda_stream)
                evs[i + 1].record(s)
        tq = time.perf_counter() - t0
        s.synchronize()
        tt = time.perf_counter() - t0
        per = [evs[i].elapsed_time(evs[i + 1]) for i in range(n)]
        bad = [int(a[3]) for a in args if a[3] != chunk]
        res.update(queue_s=tq, total_s=tt, gbps=n * chunk / tt / 1e9,
                   op_ms_p50=float(np.median(per)), op_ms_max=float(max(per)),
                   op_ms_first=per[:4], bad=bad[:4])
        # host-async reference, same bytes
        if not write:
            drop(path)
            fo = np.arange(n, dtype=np.int64) * chunk
            t0 = time.perf_counter()
            b = ctx.submit_batch(f._c_file, buf.data_ptr(), fo, fo + boff_mod,
                                 np.full(n, chunk, dtype=np.int64), False)
            b.wait()
            res["batch_gbps"] = n * chunk / (time.perf_counter() - t0) / 1e9
        res["stats"] = {k: v for k, v in ctx.stats().items()
                        if k in ("stream_ops", "memcpy_calls", "staging_fills", "chunks")}
    ctx.close()
    return res


def latency(path, cfg, sizes):
    """One op at a time, synchronised after each: fixed cost vs size; then
    48 ops queued behind a sleeping kernel (does queueing itself block?)."""
    eng = phx.Engine()
    ctx = pg.context(eng, 0, _new=True, **cfg)
    buf = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")
    s = torch.cuda.Stream()
    out = {}
    with phx.open(path, "r+", engine=eng) as f:
        for sz in sizes:
            ts, tq = [], []
            for i in range(6):
                a = np.array([sz, i * sz, 0, -1], dtype=np.int64)
                t0 = time.perf_counter()
                ctx.stream_deferred(f._c_file, buf.data_ptr(), a.ctypes.data, False, s.cuda_stream)
                t1 = time.perf_counter()
                s.synchronize()
                ts.append(time.perf_counter() - t0)
                tq.append(t1 - t0)
            out[f"single_{sz}"] = {"wall_ms": [round(x * 1e3, 3) for x in ts],
                                   "queue_ms": [round(x * 1e3, 3) for x in tq]}
        args = [np.array([1 << 20, i << 20, i << 20, -1], dtype=np.int64) for i in range(48)]
        with torch.cuda.stream(s):
            torch.cuda._sleep(int(2e9))
        per = []
        t0 = time.perf_counter()
        for a in args:
            t = time.perf_counter()
            ctx.stream_deferred(f._c_file, buf.data_ptr(), a.ctypes.data, False, s.cuda_stream)
            per.append(time.perf_counter() - t)
        tq = time.perf_counter() - t0
        s.synchronize()
        out["blocked_queue"] = {"total_ms": tq * 1e3, "per_call_ms": [round(x * 1e3, 3) for x in per[:8]],
                                "max_ms": max(per) * 1e3, "wall_ms": (time.perf_counter() - t0) * 1e3}
        # host-async single ops for the same sizes
        for sz in sizes:
            ts = []
            for i in range(6):
                t0 = time.perf_counter()
                ctx.submit_batch(f._c_file, buf.data_ptr(), [i * sz], [0], [sz], False).wait()
                ts.append(time.perf_counter() - t0)
            out[f"host_single_{sz}"] = [round(x * 1e3, 3) for x in ts]
    ctx.close()
    return out


def main():
    p = argparse.ArgumentParser()
    p.add_argument("file")
    p.add_argument("--ops", type=int, default=48)
    p.add_argument("--chunk", type=int, default=16 << 20)
    p.add_argument("--json")
    a = p.parse_args()
    need = a.ops * a.chunk
    if not os.path.exists(a.file) or os.path.getsize(a.file) < need:
        with open(a.file, "wb") as f:
            rng = np.random.default_rng(7)
            for _ in range(0, need, 64 << 20):
                f.write(rng.integers(0, 256, 64 << 20, dtype=np.uint8).tobytes())
    configs = {
        "default": {},
        "buf16M": {"buf_size": 16 << 20, "bufs_per_lane": 2},
        "buf1M": {"buf_size": 1 << 20, "bufs_per_lane": 8},
        "lanes4": {"lanes": 4},
    }
    out = []
    r = latency(a.file, {}, [4096, 1 << 20, 16 << 20])
    print(json.dumps(r), flush=True)
    out.append(r)
    if os.environ.get("PROBE_LATENCY_ONLY"):
        configs = {}
    if os.environ.get("PROBE_CONFIGS"):
        configs = {k: v for k, v in configs.items() if k in os.environ["PROBE_CONFIGS"].split(",")}
    for name, cfg in configs.items():
        for write in (False, True):
            for boff in (0, 16, 4):
                if write and boff:
                    continue
                if name != "default" and boff:
                    continue
                r = one(a.file, cfg, a.ops, a.chunk, write, boff)
                r.update(config=name, write=write, boff_mod=boff, chunk=a.chunk)
                print(json.dumps(r), flush=True)
                out.append(r)
    if a.json:
        json.dump(out, open(a.json, "w"), indent=1)


if __name__ == "__main__":
    main()
