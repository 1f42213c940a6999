"""Pieces every ``phx bench`` shares: the common options, exit status, JSON
envelope, progress, repeats, tables, caches.

Benchmarks compare engines side by side in one run; these helpers keep the
way they are asked, measure and report identical.

The command line (:func:`add_common_arguments`): every bench takes ``--dir``,
``--repeat``, ``--json``, ``--plot``, ``--quiet`` and, where it makes files it
could keep, ``--keep`` (``phx bench nvme`` measures a device: no ``--dir`` or
``--keep``; ``phx bench lmcache`` removes each method's files to make room for
the next: no ``--keep``).  Old spellings (``--path``, ``--repeats``, ``--no-progress``,
``--engines``, ``--configs``) still work, hidden from ``--help``, with a
one-line note on stderr.  Every value is checked by its ``type=`` function
while the command line is parsed: a bad one is one line naming the flag
(:class:`Parser`) and exit status 2, before anything is measured.

Exit status (:data:`EXIT_OK`, :data:`EXIT_FAILED`, :data:`EXIT_USAGE`):
0 every row measured (and checked); 1 a measurement failed, a check did not
hold, or nothing came out of the run; 2 nothing was measured because the
command line, a ``PHX_*`` setting or the machine does not allow it (a bad
value, a missing device, no GPU, no space): one line on stderr says why
(:class:`BenchError`).

The JSON every bench writes (:func:`write_json`) starts with the same
envelope: ``schema_version`` (:data:`SCHEMA_VERSION`), ``phx_version``,
``commit`` (the git commit of the phx source tree, when it is one),
``command`` (the argv), ``time`` and ``machine`` (host, kernel, CPU, memory,
GPUs).
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

#: Version of the JSON layout the benches write (the envelope and each
#: bench's own keys); raised when a key changes meaning or goes away.
SCHEMA_VERSION = 1

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2

#: What ``--plot`` and the progress bar need beyond phx itself.
BENCH_EXTRA = "pip install 'phx[bench]'"


class BenchError(Exception):
    """A reason the user can act on (a bad value, a missing device, no
    space): ``phx bench NAME: <message>`` on one line, exit ``status``."""

    def __init__(self, message: str, status: int = EXIT_USAGE):
        super().__init__(message)
        self.status = status


# ---------------------------------------------------------------------------
# The command line every bench shares
# ---------------------------------------------------------------------------

class Parser(argparse.ArgumentParser):
    """argparse whose errors are one line: ``PROG: argument --flag: why``,
    exit status 2 (no usage block: ``--help`` has it)."""

    def error(self, message: str):  # type: ignore[override]
        self.exit(EXIT_USAGE, f"{self.prog}: {message}\n")


def _type(name: str, fn: Callable[[str], Any]) -> Callable[[str], Any]:
    """``fn`` as an argparse ``type``: ValueError -> ArgumentTypeError (one line)."""
    def conv(text: str) -> Any:
        try:
            return fn(text)
        except (ValueError, TypeError) as e:
            raise argparse.ArgumentTypeError(str(e) or f"not {name}: {text!r}") from None
    conv.__name__ = name
    return conv


def _int(text: str) -> int:
    try:
        return int(text.strip(), 0)
    except ValueError:
        raise ValueError(f"not a whole number: {text!r}") from None


def _float(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise ValueError(f"not a number: {text!r}") from None
    if v != v or v in (float("inf"), float("-inf")):
        raise ValueError(f"not a finite number: {text!r}")
    return v


def _at_least(conv: Callable[[str], Any], low: float, what: str) -> Callable[[str], Any]:
    def check(text: str) -> Any:
        v = conv(text)
        if v < low:
            raise ValueError(f"{text!r}: want {what}")
        return v
    return check


def _positive_float(text: str) -> float:
    v = _float(text)
    if v <= 0:
        raise ValueError(f"{text!r}: want a number above 0")
    return v


#: ``type=`` functions: each returns the parsed value or raises
#: ArgumentTypeError with a one-line reason (argparse adds the flag).
positive_int = _type("positive_int", _at_least(_int, 1, "a whole number >= 1"))
nonneg_int = _type("nonneg_int", _at_least(_int, 0, "a whole number >= 0"))
positive_float = _type("positive_float", _positive_float)
nonneg_float = _type("nonneg_float", _at_least(_float, 0, "a number >= 0"))
any_int = _type("int", _int)


def _size_value(text: str) -> int:
    return parse_size(text)


size = _type("size", _size_value)


def positive_size_value(text: str) -> int:
    v = parse_size(text)
    if v <= 0:
        raise ValueError(f"{text!r}: want a size above 0")
    return v


positive_size = _type("positive_size", positive_size_value)


def csv(parse: Callable[[str], Any], *, allowed: Sequence[str] | None = None,
        empty_ok: bool = False) -> Callable[[str], list[Any]]:
    """A comma list, each item through ``parse`` (or one of ``allowed``)."""
    def conv(text: str) -> list[Any]:
        items = [t.strip() for t in text.split(",") if t.strip()]
        if not items and not empty_ok:
            raise ValueError(f"{text!r}: want a comma list"
                             + (f" of {','.join(allowed)}" if allowed else ""))
        if allowed is not None:
            bad = [t for t in items if t not in allowed]
            if bad:
                raise ValueError(f"unknown {','.join(bad)} (choose from {','.join(allowed)})")
            return items
        return [parse(t) for t in items]
    return _type("list", conv)


def checked(conv: Callable[[str], Any]) -> Callable[[str], str]:
    """A ``type=`` that checks the text with ``conv`` and keeps the text (for
    a bench that parses the option itself later)."""
    def keep(text: str) -> str:
        conv(text)
        return text
    return _type(getattr(conv, "__name__", "value"), keep)


def plot_path(text: str) -> str:
    """``--plot``'s ``type``: refused at once when matplotlib is missing."""
    if importlib.util.find_spec("matplotlib") is None:
        raise argparse.ArgumentTypeError(f"matplotlib is not installed ({BENCH_EXTRA})")
    return _out_path(text)


def _out_path(text: str) -> str:
    if not text.strip():
        raise argparse.ArgumentTypeError("empty path")
    if os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"{text} is a directory; want a file name")
    return text


def dir_path(text: str) -> str:
    """``--dir``'s ``type``: a directory, made when missing (not a file)."""
    if not text.strip():
        raise argparse.ArgumentTypeError("empty path")
    if os.path.exists(text) and not os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"{text} exists and is not a directory")
    return text


class _Deprecated(argparse.Action):
    """An old spelling: does what ``new`` does, after a one-line note."""

    def __init__(self, option_strings, dest, new: str, const: Any = None,
                 nargs: Any = None, **kw):
        self.new = new
        super().__init__(option_strings, dest, nargs=nargs, const=const, **kw)

    def __call__(self, parser, namespace, values, option_string=None):
        print(f"{parser.prog}: {option_string} is deprecated, use {self.new}",
              file=sys.stderr)
        setattr(namespace, self.dest, self.const if self.nargs == 0 else values)


def deprecated_alias(p: argparse.ArgumentParser, old: str, new: str, dest: str,
                     type: Callable[[str], Any] | None = None, flag: bool = False,
                     metavar: str | None = None) -> None:
    """``old`` as a hidden alias of ``new`` (stores into ``dest``).
    ``flag``: a switch that sets ``dest`` to True (``--no-progress`` -> ``--quiet``)."""
    if flag:
        p.add_argument(old, dest=dest, action=_Deprecated, new=new, nargs=0, const=True,
                       default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    else:
        p.add_argument(old, dest=dest, action=_Deprecated, new=new, type=type,
                       default=argparse.SUPPRESS, help=argparse.SUPPRESS, metavar=metavar)


def add_common_arguments(p: argparse.ArgumentParser, *, dir_help: str | None,
                         repeat: int | None, repeat_help: str = "repeats per row",
                         keep_help: str | None = None, dir_repeatable: bool = False,
                         quiet_help: str = "no progress bar (plain lines without tqdm)"
                         ) -> None:
    """The options every bench takes (see the module's docstring).

    dir_help: ``--dir``'s help (None: the bench has no ``--dir``).
    repeat: ``--repeat``'s default (None: the bench's own choice, e.g. ``--quick``).
    keep_help: ``--keep``'s help (None: the bench makes no files to keep).
    """
    g = p.add_argument_group("common options (every phx bench)")
    if dir_help is not None:
        g.add_argument("--dir", metavar="DIR", type=dir_path, default=None,
                       action="append" if dir_repeatable else "store",
                       help=dir_help + (" (repeatable)" if dir_repeatable else ""))
    g.add_argument("--repeat", metavar="N", type=positive_int, default=repeat,
                   help=repeat_help + (f" (default {repeat})" if repeat is not None else ""))
    g.add_argument("--json", metavar="PATH", type=_out_path, default=None,
                   help="write the results as JSON (schema_version, phx version, commit, "
                        "machine, command, then the bench's own keys)")
    g.add_argument("--plot", metavar="PATH", type=plot_path, default=None,
                   help=f"write a PNG plot (needs matplotlib: {BENCH_EXTRA})")
    g.add_argument("--quiet", action="store_true", help=quiet_help)
    if keep_help is not None:
        g.add_argument("--keep", action="store_true", help=keep_help)


def bench_dir(arg: str | None, default: str) -> str:
    """``--dir``, else ``$PHX_BENCH_DIR``, else ``default``, made if missing;
    BenchError naming the flag or variable when it cannot be a directory."""
    if arg:
        where, path = "--dir", arg
    elif os.environ.get("PHX_BENCH_DIR"):
        where, path = "PHX_BENCH_DIR", os.environ["PHX_BENCH_DIR"]
    else:
        where, path = "the default directory", default
    if os.path.exists(path) and not os.path.isdir(path):
        raise BenchError(f"{where} {path} is not a directory")
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        raise BenchError(f"{where} {path}: cannot make it: {e.strerror}") from None
    return os.path.abspath(path)


def need_space(directory: str, nbytes: int, what: str) -> None:
    """BenchError (exit 2) unless ``directory``'s filesystem has ``nbytes`` free."""
    free = shutil.disk_usage(directory).free
    if free < nbytes:
        raise BenchError(f"{what} needs {nbytes / 1e9:.2f} GB in {directory}, "
                         f"{free / 1e9:.2f} GB free (--dir elsewhere, or smaller --size)")


# ---------------------------------------------------------------------------
# Progress
# ---------------------------------------------------------------------------

class _Lines:
    """tqdm's surface used here, as plain lines on stderr (no tqdm, or
    disabled): a line at most every ``every`` seconds, and at the end."""

    def __init__(self, total: int, desc: str, unit: str, enabled: bool, every: float = 10.0):
        self.total, self.desc, self.unit, self.enabled = total, desc, unit, enabled
        self.n, self.every, self._last, self._post = 0, every, time.monotonic(), ""

    def _fmt(self, n: float) -> str:
        return f"{n / 1e9:.2f} GB" if self.unit == "B" else f"{n:g}"

    def update(self, n: float = 1) -> None:
        self.n += n
        now = time.monotonic()
        if self.enabled and (now - self._last >= self.every or self.n >= self.total):
            self._last = now
            print(f"{self.desc}: {self._fmt(self.n)}/{self._fmt(self.total)} {self.unit}"
                  + (f" ({self._post})" if self._post else ""), file=sys.stderr, flush=True)

    def set_postfix_str(self, s: str, refresh: bool = True) -> None:
        self._post = s

    def write(self, s: str, file: Any = None) -> None:
        print(s, file=file or sys.stdout)

    def close(self) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def progress(total: int, desc: str, enabled: bool = True, unit: str = "row"):
    """A progress bar on stderr (tqdm when installed: ``phx[bench]``), else
    plain lines; nothing when disabled (``--quiet``)."""
    if enabled:
        try:
            from tqdm import tqdm
        except ImportError:
            return _Lines(total, desc, unit, True)
        return tqdm(total=total, desc=desc, unit=unit, file=sys.stderr,
                    dynamic_ncols=True, leave=True)
    return _Lines(total, desc, unit, False)


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
    """Where a figure was taken: host, kernel, CPU, memory, GPUs."""
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
        "cpu_model": cpu_model(),
        "cpus": os.cpu_count(),
        "mem_bytes": mem,
        "gpus": gpu_models(),
        "python": platform.python_version(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def gpu_models() -> list[str]:
    """The NVIDIA GPUs' model names, from the driver's /proc files (no CUDA
    start-up), else ``nvidia-smi -L``; [] without any."""
    base = "/proc/driver/nvidia/gpus"
    out: list[str] = []
    try:
        for bus in sorted(os.listdir(base)):
            with open(os.path.join(base, bus, "information")) as f:
                for line in f:
                    if line.startswith("Model:"):
                        out.append(line.split(":", 1)[1].strip())
    except OSError:
        pass
    if out or not shutil.which("nvidia-smi"):
        return out
    try:
        p = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=10)
        return [ln.split(":", 1)[1].split("(UUID")[0].strip()
                for ln in p.stdout.splitlines() if ln.startswith("GPU ") and ":" in ln]
    except (OSError, subprocess.SubprocessError):
        return []


#: The command line the JSON records (set by phx.cli; sys.argv otherwise).
_command: list[str] | None = None


def set_command(argv: Sequence[str]) -> None:
    """Record the command line for the JSON envelope (``phx.cli.main``)."""
    global _command
    _command = list(argv)


def phx_version() -> str | None:
    try:
        import phx
        return phx.__version__
    except Exception:  # noqa: BLE001 - the envelope must not fail the run
        try:
            from importlib.metadata import version
            return version("phx")
        except Exception:  # noqa: BLE001
            return None


def source_commit() -> dict[str, Any] | None:
    """The git commit of the phx source this runs from ({'commit', 'dirty'}),
    or None when it is not a git checkout (an installed wheel)."""
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        p = subprocess.run(["git", "-C", here, "rev-parse", "HEAD"], capture_output=True,
                           text=True, timeout=10)
        if p.returncode != 0:
            return None
        d = subprocess.run(["git", "-C", here, "status", "--porcelain", "--untracked-files=no"],
                           capture_output=True, text=True, timeout=30)
        return {"commit": p.stdout.strip(),
                "dirty": bool(d.stdout.strip()) if d.returncode == 0 else None}
    except (OSError, subprocess.SubprocessError):
        return None


def envelope() -> dict[str, Any]:
    """What every result document starts with (see the module's docstring)."""
    src = source_commit()
    return {
        "schema_version": SCHEMA_VERSION,
        "phx_version": phx_version(),
        "commit": src["commit"] if src else None,
        "commit_dirty": src["dirty"] if src else None,
        "command": list(_command) if _command is not None else list(sys.argv),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": machine_description(),
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
    """Write a result document to ``path``: :func:`envelope`, then ``payload``."""
    if not path:
        return
    payload = {**envelope(), **payload}
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
    try:
        if unit not in _SIZE_UNITS or not num:
            raise ValueError
        n = float(num) * _SIZE_UNITS[unit]
    except ValueError:
        raise ValueError(f"not a size: {text!r} (use e.g. 4096, 4k, 1m, 1g)") from None
    if n != n or n in (float("inf"), float("-inf")):
        raise ValueError(f"not a size: {text!r} (use e.g. 4096, 4k, 1m, 1g)")
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
