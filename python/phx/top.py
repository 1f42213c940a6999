"""``phx stats`` and ``phx top``: what running phx processes are doing, from outside.

Both read the files every phx process publishes (:mod:`phx.livestats`); they
need no engine, GPU or privilege beyond reading ``$PHX_STATS_DIR`` (default
``/dev/shm``).  In a container, share that folder (or ``/dev/shm``) with the
host to watch from there.

``phx stats`` prints each process's counters once (``--json`` for scripts).
``phx top`` samples every ``--interval`` seconds and shows, per source, read
and write GB/s, requests per second, the share of bytes by path (direct
O_DIRECT, bounce buffers, page cache), the share of writes that needed a
read-modify-write, errors, pinned staging memory and the share of stream
reads served by early file I/O; ``--record`` keeps every sample as JSON and
``--plot`` draws them when it ends.
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from typing import Any, Iterable, TextIO

from phx import livestats
from phx.bench._common import plot_path, positive_float, positive_int

__all__ = ["add_stats_arguments", "add_top_arguments", "stats_main", "top_main", "render"]


def add_stats_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--pid", type=positive_int, help="only this process")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.add_argument("--dir", help="where the files are (default $PHX_STATS_DIR or /dev/shm)")


def add_top_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--pid", type=positive_int, help="only this process")
    p.add_argument("--interval", "-d", type=positive_float, default=1.0,
                   help="seconds between screens (default 1)")
    p.add_argument("--iterations", "-n", type=positive_int,
                   help="screens to show, then exit (default: until Ctrl-C)")
    p.add_argument("--batch", "-b", action="store_true",
                   help="print screens one after the other (default when stdout is not a terminal)")
    p.add_argument("--record", metavar="FILE.json", help="write every sample here at the end")
    p.add_argument("--plot", metavar="FILE.png", type=plot_path,
                   help="plot the recorded GB/s per source at the end")
    p.add_argument("--dir", help="where the files are (default $PHX_STATS_DIR or /dev/shm)")


def _gib(n: float) -> str:
    for unit, div in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= div:
            return f"{n / div:.1f} {unit}"
    return f"{int(n)} B"


def stats_main(args: argparse.Namespace, out: TextIO = sys.stdout) -> int:
    """``phx stats``: every publishing process's counters, once."""
    procs = livestats.scan(args.dir, args.pid)
    if args.json:
        json.dump({"dir": args.dir or livestats.stats_dir(), "time": time.time(),
                   "processes": [p.as_dict() for p in procs]}, out, indent=2)
        out.write("\n")
        return 0 if procs or args.pid is None else 1
    if not procs:
        where = args.dir or livestats.stats_dir()
        who = f"process {args.pid}" if args.pid else "no process"
        print(f"{who}: no phx counters published in {where}"
              + (" (not running, or PHX_STATS=0 there)" if args.pid else ""), file=out)
        return 1 if args.pid else 0
    for p in procs:
        print(f"pid {p.pid} {p.comm}: {p.cmdline}  (phx {p.version}, every {p.interval_ms} ms)",
              file=out)
        for s in p.sources:
            print(f"  {s.kind}: {s.label}", file=out)
            items = [f"{k}={_gib(v) if 'bytes' in k.split('_') and v >= 1024 else v}"
                     for k, v in s.counters.items() if v]
            line = "    "
            for it in items or ["(all zero)"]:
                if len(line) + len(it) > 100:
                    print(line.rstrip(), file=out)
                    line = "    "
                line += it + "  "
            print(line.rstrip(), file=out)
    return 0


_COLS = ("PID", "COMMAND", "SOURCE", "READ GB/s", "WRITE GB/s", "IOPS", "DIRECT", "BOUNCE",
         "CACHE", "RMW", "ERR", "STAGING", "EARLY")


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.0f}%"


def render(rows: list[livestats.Rates], width: int = 160, now: float | None = None,
           idle: Iterable[livestats.Process] = ()) -> str:
    """One screen of ``phx top`` (text) for the rates of one interval;
    ``idle``: processes that publish but have no engine or context open
    right now (a benchmark between its rows), listed below the table."""
    now = time.time() if now is None else now
    pids = {r.pid for r in rows}
    idle = [p for p in idle if p.pid not in pids]
    # libphxfile's transfers also pass through the GPU contexts shown: not counted twice
    rd = sum(r.read_gbs for r in rows if r.kind != "phxfile")
    wr = sum(r.write_gbs for r in rows if r.kind != "phxfile")
    lines = [f"phx top - {time.strftime('%H:%M:%S', time.localtime(now))}  "
             f"{len(pids)} process{'es' if len(pids) != 1 else ''}, {len(rows)} "
             f"source{'s' if len(rows) != 1 else ''}"
             + (f" (+{len(idle)} idle)" if idle else "")
             + f"  read {rd:.2f} GB/s  write {wr:.2f} GB/s"]
    table = [_COLS]
    for r in sorted(rows, key=lambda r: (-(r.read_gbs + r.write_gbs), r.pid, r.label)):
        src = f"{r.kind}: {r.label}"
        table.append((str(r.pid), r.comm[:15], src[:48], f"{r.read_gbs:.2f}", f"{r.write_gbs:.2f}",
                      f"{r.iops:.0f}", _pct(r.paths.get("direct") if r.paths else None),
                      _pct(r.paths.get("bounce") if r.paths else None),
                      _pct(r.paths.get("page_cache") if r.paths else None), _pct(r.rmw_share),
                      f"{r.errors}/{r.errors_total}" if r.errors_total else "0",
                      _gib(r.staging_bytes) if r.staging_bytes else "-", _pct(r.early_share)))
    widths = [max(len(row[i]) for row in table) for i in range(len(_COLS))]
    for row in table:
        cells = [c.ljust(w) if i < 3 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))]
        lines.append("  ".join(cells)[:width])
    for p in sorted(idle, key=lambda p: p.pid):
        lines.append(f"{p.pid}  {p.comm[:15]}  idle: no engine or GPU context open now"[:width])
    if len(table) == 1 and not idle:
        lines.append("(no process publishes phx counters)")
    return "\n".join(lines)


def _plot(samples: list[dict[str, Any]], path: str) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit("phx top: --plot needs matplotlib (pip install 'phx[bench]')") from None
    series: dict[str, tuple[list[float], list[float], list[float]]] = {}
    t0 = samples[0]["time"] if samples else 0.0
    for s in samples:
        key = f"{s['pid']} {s['kind']}: {s['label']}"
        t, r, w = series.setdefault(key, ([], [], []))
        t.append(s["time"] - t0)
        r.append(s["read_gbs"])
        w.append(s["write_gbs"])
    fig, axes = plt.subplots(2, 1, figsize=(10, 6), sharex=True)
    for key, (t, r, w) in series.items():
        axes[0].plot(t, r, label=key)
        axes[1].plot(t, w, label=key)
    axes[0].set_ylabel("read GB/s")
    axes[1].set_ylabel("write GB/s")
    axes[1].set_xlabel("seconds")
    axes[0].set_title("phx top: GB/s per source")
    if series:
        axes[0].legend(fontsize=7, loc="best")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def top_main(args: argparse.Namespace, out: TextIO = sys.stdout) -> int:
    """``phx top``: sample, show, repeat."""
    batch = args.batch or not out.isatty()
    samples: list[dict[str, Any]] = []
    # idle processes too: a benchmark between rows has closed its engines,
    # and must not look as if it had gone
    before = livestats.scan(args.dir, args.pid, include_idle=True)
    shown = 0
    try:
        while args.iterations is None or shown < args.iterations:
            time.sleep(args.interval)
            after = livestats.scan(args.dir, args.pid, include_idle=True)
            now = time.time()
            rows = livestats.rates(before, after)
            before = after
            screen = render(rows, shutil.get_terminal_size((160, 40)).columns, now,
                            idle=[p for p in after if not p.sources])
            if batch:
                out.write(screen + "\n\n")
            else:
                out.write("\x1b[H\x1b[2J" + screen + "\n")
            out.flush()
            shown += 1
            if args.record or args.plot:
                samples += [dict(r.as_dict(), time=now) for r in rows]
    except KeyboardInterrupt:
        pass
    if args.record:
        with open(args.record, "w") as f:
            json.dump({"schema": "phx-top/1", "interval": args.interval, "samples": samples},
                      f, indent=1)
    if args.plot:
        _plot(samples, args.plot)
    return 0

