"""``phx bench gpu``: file <-> GPU GB/s, phx against the ways people do it now.

Rows, each on the same file in one run, page cache dropped before each:

* ``phx``          phx.gpu: O_DIRECT into pinned, io_uring-registered staging,
                   pipelined with cuMemcpyHtoDAsync (writes mirrored).
* ``raw-odirect``  O_DIRECT pread/pwrite into host memory, no GPU, N threads
                   each on its own stripe in 4 MiB requests: the device limit.
* ``naive``        the staging code of the LMCache/Phoenix post: buffered
                   ``pread`` into malloc'd (pageable) memory, then a copy to
                   the GPU, request after request (64 MiB each); writes: copy
                   out, buffered ``pwrite``, fsync.
* ``kvikio``       KvikIO ``CuFile.pread/pwrite`` in compatibility mode
                   (POSIX I/O + bounce buffers), N threads.

Reads are the headline; writes include an fsync for every method.  Each row
is repeated (``--repeat``) and the median reported with its spread.  Without
a GPU the command says so and exits 0.
"""
from __future__ import annotations

import argparse
import mmap
import os
import subprocess
import sys
import threading
import time
from typing import Any, Callable

from phx.bench._common import (drop_caches, fmt_table, median_spread, progress,
                               write_json)

MiB = 1 << 20
GiB = 1 << 30


def _size(s: str) -> int:
    s = s.strip().upper()
    mult = {"K": 1 << 10, "M": MiB, "G": GiB}
    if s and s[-1] in mult:
        return int(float(s[:-1]) * mult[s[-1]])
    return int(s)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dir", action="append", default=None,
                   help="directory to put the test file in (repeatable); default: "
                        "$PHX_BENCH_DIR or the current directory")
    p.add_argument("--zram", metavar="SIZE", default=None,
                   help="also build a zram block device of SIZE with ext4 (root) and "
                        "run there: the RAM-speed row where software decides")
    p.add_argument("--size", default="4G", help="file size (default 4G)")
    p.add_argument("--repeat", type=int, default=3, help="repeats per row (default 3)")
    p.add_argument("--methods", default="phx,raw,naive,kvikio",
                   help="comma list of phx,raw,naive,kvikio (default all)")
    p.add_argument("--ops", default="read,write", help="read,write (default both)")
    p.add_argument("--raw-threads", default="4,16,32",
                   help="thread counts for raw O_DIRECT (best is the device limit)")
    p.add_argument("--kvikio-threads", default="16,64", help="KvikIO thread counts")
    p.add_argument("--lanes", type=int, default=None, help="phx staging lanes")
    p.add_argument("--bufs", type=int, default=None, help="phx staging buffers per lane")
    p.add_argument("--buf-size", default=None, help="phx staging buffer size")
    p.add_argument("--sweep", default=None,
                   help="instead of the comparison, time phx reads for configs "
                        "'L:B:S[:M];...' (lanes:bufs:size[:max_io])")
    p.add_argument("--json", default=None, help="write results as JSON here")
    p.add_argument("--plot", default=None, help="write a PNG bar chart here")
    p.add_argument("--quiet", action="store_true", help="no progress bar")


# ---------------------------------------------------------------------------
# setup
# ---------------------------------------------------------------------------

def _zram_up(size: str) -> tuple[str, str]:
    dev = "/dev/zram0"
    if not os.path.exists(dev):
        subprocess.run(["modprobe", "zram"], capture_output=True)
    if os.path.exists("/sys/class/zram-control/hot_add"):
        try:
            with open("/sys/block/zram0/disksize") as f:
                busy = f.read().strip() != "0"
        except OSError:
            busy = True
        if busy:
            with open("/sys/class/zram-control/hot_add") as f:
                dev = "/dev/zram" + f.read().strip()
    name = os.path.basename(dev)
    with open(f"/sys/block/{name}/disksize", "w") as f:
        f.write(size)
    subprocess.run(["mkfs.ext4", "-q", "-F", dev], check=True)
    mnt = f"/mnt/phx-bench-{name}"
    os.makedirs(mnt, exist_ok=True)
    subprocess.run(["mount", dev, mnt], check=True)
    return mnt, name


def _zram_down(mnt: str, name: str) -> None:
    subprocess.run(["umount", mnt], capture_output=True)
    try:
        with open(f"/sys/block/{name}/reset", "w") as f:
            f.write("1\n")
    except OSError:
        pass


def _make_file(path: str, size: int) -> None:
    """Random bytes (never zeros), written once with O_DIRECT, then fsynced."""
    import numpy as np
    rng = np.random.default_rng(1234)
    chunk = 64 * MiB
    buf = mmap.mmap(-1, chunk)
    arr = np.frombuffer(buf, dtype=np.uint8)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644)
    try:
        off = 0
        while off < size:
            n = min(chunk, size - off)
            arr[:] = rng.integers(0, 256, size=chunk, dtype=np.uint8)
            os.pwrite(fd, memoryview(buf)[:chunk], off)
            off += n
        os.ftruncate(fd, size)
        os.fsync(fd)
    finally:
        os.close(fd)
        del arr
        buf.close()


def _fs_of(path: str) -> str:
    try:
        out = subprocess.run(["df", "-T", path], capture_output=True, text=True).stdout
        parts = out.splitlines()[1].split()
        return f"{parts[1]} on {parts[0]}"
    except Exception:
        return "?"


# ---------------------------------------------------------------------------
# methods (each returns seconds for moving `size` bytes)
# ---------------------------------------------------------------------------

def _stripes(size: int, n: int) -> list[tuple[int, int]]:
    per = -(-size // n)
    per = -(-per // (4 * MiB)) * (4 * MiB)
    return [(i * per, min(size, (i + 1) * per)) for i in range(n) if i * per < size]


def raw_odirect(path: str, size: int, threads: int, write: bool) -> float:
    fd = os.open(path, (os.O_RDWR if write else os.O_RDONLY) | os.O_DIRECT)
    bufs = [mmap.mmap(-1, 4 * MiB) for _ in range(threads)]
    for b in bufs:
        b.write(os.urandom(4096) * 1024)
    errs: list[BaseException] = []

    def work(i, lo, hi):
        mv = memoryview(bufs[i])
        try:
            off = lo
            while off < hi:
                n = min(4 * MiB, hi - off)
                n = -(-n // 4096) * 4096 if not write else n
                if write:
                    os.pwrite(fd, mv[:n], off)
                else:
                    if os.preadv(fd, [mv[:n]], off) <= 0:
                        break
                off += n
        except BaseException as e:  # noqa: BLE001
            errs.append(e)
        finally:
            mv.release()

    th = [threading.Thread(target=work, args=(i, lo, hi))
          for i, (lo, hi) in enumerate(_stripes(size, threads))]
    t0 = time.perf_counter()
    for t in th:
        t.start()
    for t in th:
        t.join()
    if write:
        os.fsync(fd)
    dt = time.perf_counter() - t0
    os.close(fd)
    for b in bufs:
        b.close()
    if errs:
        raise errs[0]
    return dt


def naive(path: str, size: int, gpu, write: bool) -> float:
    """malloc + pread (page cache) + cudaMemcpy, 64 MiB per request."""
    import numpy as np
    import torch
    chunk = 64 * MiB
    fd = os.open(path, os.O_RDWR if write else os.O_RDONLY)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    off = 0
    while off < size:
        n = min(chunk, size - off)
        if write:
            host = gpu[off:off + n].cpu()           # pageable, synchronous
            os.pwrite(fd, host.numpy().data, off)
        else:
            host = np.empty(n, dtype=np.uint8)      # buffer = malloc(len)
            os.preadv(fd, [host], off)              # pread(fd, buffer, len, off)
            gpu[off:off + n].copy_(torch.from_numpy(host))  # cudaMemcpy H2D
        off += n
    if write:
        os.fsync(fd)
    torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    os.close(fd)
    return dt


def kvikio_io(path: str, size: int, gpu, threads: int, write: bool) -> float:
    import kvikio
    import kvikio.defaults as kd
    try:
        kd.set({"compat_mode": kvikio.CompatMode.ON, "num_threads": threads})
    except Exception:  # older API
        kd.compat_mode_reset(True)
        kd.num_threads_reset(threads)
    import torch
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    f = kvikio.CuFile(path, "r+" if write else "r")
    if write:
        f.pwrite(gpu[:size], size, 0).get()
    else:
        f.pread(gpu[:size], size, 0).get()
    f.close()
    if write:
        fd = os.open(path, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)
    dt = time.perf_counter() - t0
    return dt


def phx_io(path: str, size: int, gpu, write: bool, ctx_cfg: dict) -> float:
    import phx
    import phx.gpu
    import torch
    eng = _phx_engine(ctx_cfg)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    with phx.open(path, "r+" if write else "r", engine=eng) as f:
        n = f.pwrite(gpu[:size], 0) if write else f.pread(gpu[:size], 0)
        if write:
            f.fsync()
    dt = time.perf_counter() - t0
    if n != size:
        raise RuntimeError(f"phx moved {n} of {size} bytes")
    return dt


_ENGINES: dict[tuple, Any] = {}


def _phx_engine(ctx_cfg: dict):
    """One engine (and so one staging context) per configuration."""
    import phx
    import phx.gpu
    key = tuple(sorted(ctx_cfg.items()))
    if key not in _ENGINES:
        eng = phx.Engine()
        phx.gpu.context(eng, 0, **ctx_cfg)
        _ENGINES[key] = eng
    return _ENGINES[key]


def _verify(path: str, gpu, size: int) -> None:
    """Spot-check the GPU bytes against the file (16 random 4 KiB pieces)."""
    import numpy as np
    rng = np.random.default_rng(7)
    with open(path, "rb") as f:
        for off in rng.integers(0, max(1, size - 4096), size=16):
            off = int(off)
            f.seek(off)
            want = np.frombuffer(f.read(4096), dtype=np.uint8)
            got = gpu[off:off + len(want)].cpu().numpy()
            if not np.array_equal(got, want):
                raise RuntimeError(f"phx read wrong bytes at offset {off}")


# ---------------------------------------------------------------------------
# driver
# ---------------------------------------------------------------------------

def _gpu_ok() -> tuple[bool, str]:
    try:
        import torch
    except ImportError:
        return False, "torch is not installed"
    if not torch.cuda.is_available():
        return False, "no CUDA device (torch.cuda.is_available() is False)"
    import phx.gpu
    return phx.gpu.is_available()


def _ctx_cfg(args) -> dict:
    cfg: dict[str, Any] = {}
    if args.lanes:
        cfg["lanes"] = args.lanes
    if args.bufs:
        cfg["bufs_per_lane"] = args.bufs
    if args.buf_size:
        cfg["buf_size"] = _size(args.buf_size)
    return cfg


def _rows_for(args, have_kvikio: bool) -> list[tuple[str, str, dict, Callable]]:
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    ops = [o.strip() for o in args.ops.split(",") if o.strip()]
    cfg = _ctx_cfg(args)
    rows = []
    for op in ops:
        w = op == "write"
        if "phx" in methods:
            rows.append((op, "phx", dict(cfg), lambda p, s, g, w=w: phx_io(p, s, g, w, cfg)))
        if "raw" in methods:
            for n in [int(x) for x in args.raw_threads.split(",")]:
                rows.append((op, "raw-odirect", {"threads": n},
                             lambda p, s, g, n=n, w=w: raw_odirect(p, s, n, w)))
        if "naive" in methods:
            rows.append((op, "naive", {"request": "64MiB"},
                         lambda p, s, g, w=w: naive(p, s, g, w)))
        if "kvikio" in methods and have_kvikio:
            for n in [int(x) for x in args.kvikio_threads.split(",")]:
                rows.append((op, "kvikio", {"threads": n, "compat": True},
                             lambda p, s, g, n=n, w=w: kvikio_io(p, s, g, n, w)))
    return rows


def _sweep(args, dirs, size, gpu) -> list[dict]:
    out = []
    for d, label in dirs:
        path = os.path.join(d, "phx-bench-gpu.bin")
        if not os.path.exists(path) or os.path.getsize(path) != size:
            _make_file(path, size)
        for spec in args.sweep.split(";"):
            parts = spec.split(":")
            cfg = {"lanes": int(parts[0]), "bufs_per_lane": int(parts[1]),
                   "buf_size": _size(parts[2])}
            if len(parts) > 3:
                cfg["max_io_size"] = _size(parts[3])
            runs = []
            for _ in range(args.repeat):
                drop_caches()
                runs.append(size / phx_io(path, size, gpu, False, cfg) / 1e9)
            med, spread = median_spread(runs)
            print(f"{label:>6} read phx {spec:>12}: {med:6.2f} GB/s (spread {spread:.0%})",
                  flush=True)
            out.append({"device": label, "config": cfg, "runs": runs, "median": med})
    return out


def run(args) -> int:
    ok, why = _gpu_ok()
    if not ok:
        print(f"phx bench gpu: no GPU here ({why}); nothing to measure.")
        return 0
    import torch
    if os.geteuid() != 0:
        print("phx bench gpu: not root: page cache cannot be dropped, rows are warm",
              file=sys.stderr)
    os.environ.setdefault("KVIKIO_COMPAT_MODE", "ON")
    try:
        import kvikio  # noqa: F401
        have_kvikio = True
    except Exception as e:  # noqa: BLE001
        print(f"phx bench gpu: KvikIO unavailable ({e}); its rows are skipped",
              file=sys.stderr)
        have_kvikio = False

    size = _size(args.size)
    dirs = [(d, "disk") for d in (args.dir or [os.environ.get("PHX_BENCH_DIR", ".")])]
    zram = None
    if args.zram:
        zram = _zram_up(args.zram)
        dirs.append((zram[0], "zram"))
    gpu = torch.empty(size, dtype=torch.uint8, device="cuda")
    gpu.random_(0, 256)
    torch.cuda.synchronize()
    results: list[dict] = []
    try:
        if args.sweep:
            results = _sweep(args, dirs, size, gpu)
            write_json(args.json, {"benchmark": "gpu-sweep", "size": size, "rows": results})
            return 0
        rows = _rows_for(args, have_kvikio)
        bar = progress(len(rows) * len(dirs) * args.repeat, "bench gpu", not args.quiet)
        for d, label in dirs:
            path = os.path.join(d, "phx-bench-gpu.bin")
            wpath = os.path.join(d, "phx-bench-gpu-w.bin")
            _make_file(path, size)
            _make_file(wpath, size)
            fs = _fs_of(path)
            runs: dict[int, list[float]] = {i: [] for i in range(len(rows))}
            for rep in range(args.repeat):
                for i, (op, name, cfg, fn) in enumerate(rows):
                    drop_caches()
                    dt = fn(wpath if op == "write" else path, size, gpu)
                    runs[i].append(size / dt / 1e9)
                    if rep == 0 and name == "phx" and op == "read":
                        _verify(path, gpu, size)
                    bar.update(1)
            for i, (op, name, cfg, _) in enumerate(rows):
                med, spread = median_spread(runs[i])
                results.append({"device": label, "fs": fs, "op": op, "method": name,
                                "config": cfg, "runs_gbps": runs[i], "median_gbps": med,
                                "spread": spread})
            for p in (path, wpath):
                os.unlink(p)
        bar.close()
    finally:
        if zram:
            _zram_down(*zram)

    _report(results, size, args)
    return 0


def _best(results, device, op, method) -> dict | None:
    c = [r for r in results if r["device"] == device and r["op"] == op and r["method"] == method]
    return max(c, key=lambda r: r["median_gbps"]) if c else None


def _report(results: list[dict], size: int, args) -> None:
    table = []
    for r in results:
        ph = _best(results, r["device"], r["op"], "phx")
        ratio = ph["median_gbps"] / r["median_gbps"] if ph and r["median_gbps"] else float("nan")
        cfg = ",".join(f"{k}={v}" for k, v in r["config"].items())
        table.append((r["device"], r["op"], r["method"], cfg, r["median_gbps"],
                      f"{r['spread']:.0%}", ratio))
    print(f"\nphx bench gpu: {size / GiB:.1f} GiB file <-> one GPU buffer, "
          f"{args.repeat} repeats, page cache dropped before each row (GB/s medians)")
    print(fmt_table(["device", "op", "method", "config", "GB/s", "spread", "phx/x"], table))
    goals = []
    for dev in sorted({r["device"] for r in results}):
        ph = _best(results, dev, "read", "phx")
        if not ph:
            continue
        for base, want in (("raw-odirect", 0.95 if dev == "disk" else None),
                           ("kvikio", 1.1), ("naive", 1.5 if dev == "zram" else None)):
            b = _best(results, dev, "read", base)
            if b and want:
                ratio = ph["median_gbps"] / b["median_gbps"]
                goals.append({"device": dev, "vs": base, "ratio": ratio, "goal": want,
                              "met": ratio >= want})
    for g in goals:
        print(f"goal {g['device']:>4} read: phx / best {g['vs']:<11} = {g['ratio']:.2f} "
              f"(goal >= {g['goal']}) {'met' if g['met'] else 'NOT met'}")
    try:
        import phx.gpu
        st = phx.gpu.stats()
        print("phx GPU counters: " + ", ".join(f"{k}={v}" for k, v in st.items() if v))
    except Exception:  # noqa: BLE001
        st = {}
    write_json(args.json, {"benchmark": "gpu", "size": size, "repeat": args.repeat,
                           "rows": results, "goals": goals, "phx_gpu_stats": st})
    if args.plot:
        _plot(results, args.plot, size)


def _plot(results: list[dict], path: str, size: int) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    panels = sorted({(r["device"], r["op"]) for r in results})
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 4.2), squeeze=False)
    for ax, (dev, op) in zip(axes[0], panels):
        rs = [r for r in results if r["device"] == dev and r["op"] == op]
        labels = [r["method"] + ("\n" + ",".join(f"{v}" for v in r["config"].values())
                                 if r["method"] != "phx" else "") for r in rs]
        med = [r["median_gbps"] for r in rs]
        lo = [m - min(r["runs_gbps"]) for m, r in zip(med, rs)]
        hi = [max(r["runs_gbps"]) - m for m, r in zip(med, rs)]
        colors = ["tab:red" if r["method"] == "phx" else "tab:gray" for r in rs]
        ax.bar(range(len(rs)), med, yerr=[lo, hi], color=colors, capsize=3)
        ax.set_xticks(range(len(rs)))
        ax.set_xticklabels(labels, fontsize=7, rotation=45, ha="right")
        ax.set_title(f"{dev}: {op} ({size / GiB:.0f} GiB)")
        ax.set_ylabel("GB/s (median, min-max)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
