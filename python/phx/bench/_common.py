"""Pieces every ``phx bench`` shares: progress, repeats, tables, JSON, caches.

Benchmarks compare engines side by side in one run; these helpers keep the
way they measure and report identical.
"""
from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Iterable, Sequence
from typing import Any


def progress(total: int, desc: str, enabled: bool = True, unit: str = "row"):
    """A progress bar on stderr (tqdm), or a no-op object when disabled."""
    from tqdm import tqdm
    return tqdm(total=total, desc=desc, unit=unit, file=sys.stderr,
                disable=not enabled, dynamic_ncols=True, leave=True)


def drop_caches() -> bool:
    """Write back and drop the page cache; False (and nothing done) without root."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def median_spread(values: Sequence[float]) -> tuple[float, float]:
    """Median and relative spread ((max - min) / median) of repeated figures."""
    med = statistics.median(values)
    spread = (max(values) - min(values)) / med if med else 0.0
    return med, spread


def machine_description() -> dict[str, Any]:
    """Where a figure was taken: host, kernel, CPUs, memory."""
    mem = 0
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    mem = int(line.split()[1]) * 1024
    except OSError:
        pass
    return {
        "host": platform.node(),
        "kernel": platform.release(),
        "cpus": os.cpu_count(),
        "mem_bytes": mem,
        "python": platform.python_version(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def fmt_table(headers: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    """A plain, aligned text table."""
    cells = [[str(h) for h in headers]]
    for r in rows:
        cells.append([f"{c:.3g}" if isinstance(c, float) else str(c) for c in r])
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    lines = []
    for n, row in enumerate(cells):
        lines.append("  ".join(c.rjust(w) for c, w in zip(row, widths)))
        if n == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def write_json(path: str | None, payload: dict[str, Any]) -> None:
    """Write a result document (with the machine description) to ``path``."""
    if not path:
        return
    payload = {"machine": machine_description(), **payload}
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
    with open(path, "w") as f:
        json.dump(payload, f, indent=2)
        f.write("\n")


def run_quiet(cmd: Sequence[str], **kw) -> subprocess.CompletedProcess:
    """Run a command, capturing output; raise with its stderr on failure."""
    p = subprocess.run(list(cmd), capture_output=True, text=True, **kw)
    if p.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({p.returncode}): {p.stderr.strip()}")
    return p


_SIZE_UNITS = {"": 1, "b": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def reset_peak_rss() -> int:
    """Reset this process's peak RSS to its current RSS; return that (bytes).

    ``getrusage``'s ``ru_maxrss`` is no use for a child: Linux carries the
    high-water mark across fork and exec, so a child started by a large
    parent reports the parent's peak.  ``VmHWM`` belongs to the process's
    own memory map and can be reset (``clear_refs`` 5, Linux 4.0+)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _status_kib("VmRSS") * 1024


def peak_rss() -> int:
    """This process's peak RSS in bytes since exec or :func:`reset_peak_rss`."""
    return _status_kib("VmHWM") * 1024


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise OSError(f"/proc/self/status has no {field}")


def parse_size(text: str) -> int:
    """Bytes from ``4096``, ``4k``, ``1M``, ``1.5GiB`` (binary units)."""
    s = text.strip().lower().removesuffix("ib").removesuffix("b")
    num = s.rstrip("kmgt")
    unit = s[len(num):]
    if unit not in _SIZE_UNITS or not num:
        raise ValueError(f"not a size: {text!r} (use e.g. 4096, 4k, 1m, 1g)")
    n = float(num) * _SIZE_UNITS[unit]
    if n != int(n) or n < 0:
        raise ValueError(f"not a whole, non-negative number of bytes: {text!r}")
    return int(n)


def fmt_size(n: int) -> str:
    """The shortest exact binary-unit spelling: 4096 -> '4k', 1048576 -> '1m'."""
    for unit in ("t", "g", "m", "k"):
        if n and n % _SIZE_UNITS[unit] == 0:
            return f"{n // _SIZE_UNITS[unit]}{unit}"
    return str(n)


def storage_description(path: str) -> dict[str, Any]:
    """Where a file lives: mount point, filesystem type and backing device."""
    real = os.path.realpath(path)
    best = ("", "unknown", "unknown")
    try:
        with open("/proc/mounts") as f:
            for line in f:
                parts = line.split()
                if len(parts) < 3:
                    continue
                dev, mnt, fstype = parts[0], parts[1].replace("\\040", " "), parts[2]
                if (real == mnt or real.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best[0]):
                    best = (mnt, fstype, dev)
    except OSError:
        pass
    out: dict[str, Any] = {"path": real, "mount": best[0], "fstype": best[1], "device": best[2]}
    name = os.path.basename(os.path.realpath(best[2])) if best[2].startswith("/dev/") else ""
    if name:
        for key, rel in (("rotational", "queue/rotational"), ("model", "device/model")):
            try:
                with open(f"/sys/class/block/{name}/{rel}") as f:
                    out[key] = f.read().strip()
            except OSError:
                pass
    return out


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo ('' when unknown)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""
