"""``phx bench nvme``: NVMe passthrough vs O_DIRECT on the block device vs buffered.

One namespace, one region of it, the same data for all three paths:

  passthrough  :mod:`phx.nvme`: NVMe Read/Write commands on ``/dev/ngXnY`` through
               io_uring ``IORING_OP_URING_CMD`` (split at MDTS, fixed buffers);
  O_DIRECT     the namespace's block device ``/dev/nvmeXnY`` opened with O_DIRECT on a
               phx engine (io_uring READ/WRITE_FIXED through the block layer);
  buffered     the same block device through the page cache (phx engine,
               ``direct=False``); the cache is dropped before every read figure, and
               the write figures include the ``fsync`` that makes them durable,
               except the 256 KiB latency, which is the copy into the cache
               (what a decode step waits for on that path).

Figures (each for ``--seconds``):

  4 KiB random read IOPS at QD 1 (one request per call) and QD 32 (batches of 32
  requests in flight together); 1 MiB sequential read and write GB/s (batches of
  4 requests); 256 KiB sequential write latency p50/p99 (one request per call,
  the paper's decode-step row write).  Ratios: passthrough / O_DIRECT and
  passthrough / buffered.

Under QEMU's TCG these describe the emulator (an emulated controller writing a
file on the host), not a drive: the table says so when it finds itself in a VM.
"""
from __future__ import annotations

import argparse
import os
import random
import stat
import statistics
import sys
import time
from typing import Any

from phx.bench._common import (BenchError, add_common_arguments, any_int, drop_caches,
                               fmt_size, fmt_table, nonneg_int, parse_size, positive_float,
                               positive_size, write_json)

KiB, MiB = 1 << 10, 1 << 20
PATHS = ("passthrough", "odirect", "buffered")
METRICS = (
    ("randread_4k_qd1", "4 KiB rand read QD1", "IOPS"),
    ("randread_4k_qd32", "4 KiB rand read QD32", "IOPS"),
    ("seqread_1m", "1 MiB seq read", "GB/s"),
    ("seqwrite_1m", "1 MiB seq write", "GB/s"),
    ("write_256k_p50", "256 KiB write p50", "ms"),
    ("write_256k_p99", "256 KiB write p99", "ms"),
)


def _char_device(text: str) -> str:
    try:
        st = os.stat(text)
    except OSError as e:
        raise argparse.ArgumentTypeError(f"{text}: {e.strerror}") from None
    if not stat.S_ISCHR(st.st_mode):
        raise argparse.ArgumentTypeError(
            f"{text} is not a character device (want a namespace's /dev/ngXnY; "
            f"/dev/nvmeXnY is its block device)")
    return text


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", type=_char_device, default=None,
                   help="namespace char device /dev/ngXnY (default: the first usable one "
                        "that phx.nvme.probe() finds)")
    p.add_argument("--first-lba", type=nonneg_int, default=0, help="start of the region (LBA)")
    p.add_argument("--size", type=positive_size, default=parse_size("256m"),
                   help="bytes of the region used (default 256m)")
    p.add_argument("--seconds", type=positive_float, default=1.0,
                   help="seconds per figure (1.0)")
    p.add_argument("--force", action="store_true",
                   help="use the namespace even if it holds a filesystem or signature "
                        "(its data in the region are overwritten)")
    p.add_argument("--seed", type=any_int, default=None)
    # a device, not a directory: no --dir, and it leaves no files (--keep)
    add_common_arguments(p, dir_help=None, repeat=1,
                         repeat_help="runs of every figure; the median is reported",
                         quiet_help="no per-path progress lines")


def _in_vm() -> str:
    """'TCG'/'KVM'/... when this looks like a virtual machine, else ''."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read()
        vendor = open("/sys/class/dmi/id/sys_vendor").read().strip() \
            if os.path.exists("/sys/class/dmi/id/sys_vendor") else ""
    except OSError:
        return ""
    if "QEMU" in vendor or "hypervisor" in flags:
        return f"VM ({vendor or 'hypervisor flag'})"
    return ""


class _Path:
    """read_batch/write_batch/read/write over one of the three paths."""

    def __init__(self, kind: str, ns, blk: str):
        import phx
        self.kind = kind
        self.ns = ns
        self.f = None
        if kind != "passthrough":
            self.eng = phx.Engine(queue_depth=64)
            self.f = self.eng.open(blk, "r+", direct=(kind == "odirect"))

    def batch(self, write: bool, reqs) -> None:
        if self.f is None:
            (self.ns.write_batch if write else self.ns.read_batch)(reqs)
        else:
            (self.f.pwrite_batch if write else self.f.pread_batch)(reqs)

    def sync(self) -> None:
        if self.f is not None and self.kind == "buffered":
            self.f.fsync()

    def close(self) -> None:
        if self.f is not None:
            self.f.close()
            self.eng.close()


def _timed(seconds: float, step) -> tuple[int, float]:
    """Run step() -> units until ``seconds`` pass; (units, elapsed)."""
    n, t0 = 0, time.perf_counter()
    while True:
        n += step()
        el = time.perf_counter() - t0
        if el >= seconds:
            return n, el


def _measure(p: _Path, base: int, size: int, seconds: float, rng: random.Random,
             bufs: dict[str, Any]) -> dict[str, float]:
    out: dict[str, float] = {}
    nblk = size // (4 * KiB)
    b4 = bufs["4k"]

    def rand_offs(k):
        return [base + rng.randrange(nblk) * 4 * KiB for _ in range(k)]

    cold = drop_caches()
    n, el = _timed(seconds, lambda: (p.batch(False, [(b4[0], rand_offs(1)[0])]), 1)[1])
    out["randread_4k_qd1"] = n / el
    drop_caches()
    n, el = _timed(seconds, lambda: (p.batch(False, list(zip(b4, rand_offs(32)))), 32)[1])
    out["randread_4k_qd32"] = n / el

    m = bufs["1m"]
    nmb = size // MiB
    pos = [0]

    def seq(write):
        reqs = []
        for b in m:
            reqs.append((b, base + pos[0] * MiB))
            pos[0] = (pos[0] + 1) % nmb
        p.batch(write, reqs)
        return len(reqs) * MiB

    drop_caches()
    pos[0] = 0
    n, el = _timed(seconds, lambda: seq(False))
    out["seqread_1m"] = n / el / 1e9
    pos[0] = 0
    t0 = time.perf_counter()
    n, _ = _timed(seconds, lambda: seq(True))
    p.sync()
    out["seqwrite_1m"] = n / (time.perf_counter() - t0) / 1e9

    lat = []
    w = bufs["256k"]
    off = 0
    end = time.perf_counter() + seconds
    while time.perf_counter() < end or len(lat) < 20:
        t = time.perf_counter()
        p.batch(True, [(w, base + off)])
        lat.append((time.perf_counter() - t) * 1e3)
        off = (off + 256 * KiB) % (size - 256 * KiB + 1) // (256 * KiB) * (256 * KiB)
    p.sync()
    lat.sort()
    out["write_256k_p50"] = statistics.median(lat)
    out["write_256k_p99"] = lat[min(len(lat) - 1, int(len(lat) * 0.99))]
    out["write_256k_samples"] = len(lat)
    out["cold_cache"] = cold
    return out


def run(args) -> int:
    import numpy as np
    import phx
    import phx.nvme as nvme

    dev = args.device
    if dev is None:
        usable = [p for p in nvme.probe() if p["usable"]]
        if not usable:
            raise BenchError("no usable NVMe namespace (phx info lists why); "
                             "pass --device /dev/ngXnY [--force]")
        dev = usable[0]["name"]
    try:
        ns = nvme.open(dev, first_lba=args.first_lba, force=args.force)
    except OSError as e:
        raise BenchError(f"--device {dev}: {e.strerror or e}") from None
    info = ns.info
    blk = "/dev/" + info["block_device"] if info["block_device"] else ""
    if not blk or not os.path.exists(blk):
        ns.close()
        raise BenchError(f"no block device for {dev}")
    base = ns.start
    size = min(args.size, ns.end - base) // MiB * MiB
    if size < 2 * MiB:
        ns.close()
        raise BenchError("region smaller than 2 MiB (--first-lba, --size)")
    seed = args.seed if args.seed is not None else int.from_bytes(os.urandom(4), "little")
    rng = random.Random(seed)
    nrng = np.random.default_rng(seed)

    def aligned(n):
        b = phx.empty_aligned(n)
        np.frombuffer(b, np.uint8)[:] = nrng.integers(0, 256, n, dtype=np.uint8)
        return b
    bufs = {"4k": [aligned(4 * KiB) for _ in range(32)], "1m": [aligned(MiB) for _ in range(4)],
            "256k": aligned(256 * KiB)}
    for b in bufs["4k"] + bufs["1m"] + [bufs["256k"]]:
        try:
            ns.register_buffer(b)
        except OSError:
            break
    # the same data for everyone: fill the region once through passthrough
    chunk = aligned(4 * MiB)
    for off in range(0, size, 4 * MiB):
        n = min(4 * MiB, size - off)
        ns.write(memoryview(chunk)[:n], base + off)

    vm = _in_vm()
    results: dict[str, dict[str, float]] = {}
    for kind in PATHS:
        p = _Path(kind, ns, blk)
        try:
            if p.f is not None:
                for b in bufs["4k"] + bufs["1m"] + [bufs["256k"]]:
                    try:
                        p.eng.register_buffer(b)
                    except OSError:
                        break
            runs = [_measure(p, base, size, args.seconds, rng, bufs)
                    for _ in range(args.repeat)]
        finally:
            p.close()
        results[kind] = _median_run(runs)
        if not args.quiet:
            print(f"  {kind}: done", file=sys.stderr)
    nst = ns.stats()
    ns.deallocate(base, size)
    ns.close()

    rows = []
    for key, label, unit in METRICS:
        pt, od, bu = (results[k][key] for k in PATHS)
        if unit == "ms":      # lower is better: ratio = how many times faster
            r1, r2 = od / pt if pt else 0.0, bu / pt if pt else 0.0
        else:
            r1, r2 = pt / od if od else 0.0, pt / bu if bu else 0.0
        rows.append([label, unit, _fmt(pt, unit), _fmt(od, unit), _fmt(bu, unit),
                     f"{r1:.2f}x", f"{r2:.2f}x"])
    note = (f"NOTE: this ran in a {vm}: under QEMU TCG these figures describe the "
            "emulator (an emulated controller writing an image file), not a drive."
            if vm else "NOTE: bare metal: figures describe this drive.")
    print(f"phx bench nvme: {dev} ({blk}), {info['model']}, LBA {info['lba_size']}, "
          f"max transfer {fmt_size(info['max_transfer'])}, region {fmt_size(size)} at "
          f"LBA {ns.first_lba}, {args.seconds:g} s per figure, seed {seed}")
    print(note)
    print(fmt_table(["figure", "unit", "passthrough", "O_DIRECT blk", "buffered",
                     "pt/O_DIRECT", "pt/buffered"], rows))
    print("ratios: higher = passthrough better (for latencies: O_DIRECT or buffered time "
          "divided by passthrough time); buffered reads start from a dropped cache "
          f"({'yes' if results['buffered']['cold_cache'] else 'NOT dropped: not root'}), "
          "buffered 256 KiB latency is the copy into the page cache.")
    write_json(args.json, {
        "benchmark": "nvme", "device": dev, "block_device": blk, "identify": info,
        "region": {"first_lba": ns.first_lba, "bytes": size}, "seconds": args.seconds,
        "repeat": args.repeat, "seed": seed, "virtual_machine": vm, "note": note, "results": results,
        "passthrough_stats": nst,
        "ratios": {key: {"vs_odirect": float(r[5][:-1]), "vs_buffered": float(r[6][:-1])}
                   for (key, _, _), r in zip(METRICS, rows)},
    })
    if args.plot:
        plot(results, args.plot, f"{dev} ({info['model']}){', ' + vm if vm else ''}")
    return 0


def _median_run(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Each figure's median over ``--repeat`` runs (and every run's, under ``runs``)."""
    out: dict[str, Any] = {k: statistics.median([r[k] for r in runs])
                           for k, _, _ in METRICS}
    out["write_256k_samples"] = sum(r["write_256k_samples"] for r in runs)
    out["cold_cache"] = all(r["cold_cache"] for r in runs)
    if len(runs) > 1:
        out["runs"] = runs
    return out


def plot(results: dict[str, dict[str, Any]], path: str, title: str) -> None:
    """One panel per figure, a bar per path."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(2, 3, figsize=(12, 6.5), squeeze=False)
    colours = {"passthrough": "tab:red", "odirect": "tab:blue", "buffered": "tab:gray"}
    for ax, (key, label, unit) in zip(axes.flat, METRICS):
        ys = [results[k][key] * (1e-3 if unit == "IOPS" else 1) for k in PATHS]
        ax.bar(range(len(PATHS)), ys, color=[colours[k] for k in PATHS])
        ax.set_xticks(range(len(PATHS)), ["passthrough", "O_DIRECT", "buffered"], fontsize=8)
        ax.set_title(label, fontsize=10)
        ax.set_ylabel("kIOPS" if unit == "IOPS" else unit)
        ax.grid(axis="y", alpha=0.3)
    fig.suptitle(f"phx bench nvme: {title}", fontsize=10)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _fmt(v: float, unit: str) -> str:
    if unit == "IOPS":
        return f"{v:,.0f}"
    if unit == "GB/s":
        return f"{v:.3f}"
    return f"{v:.3f}"
