"""``phx bench io``: file read/write GB/s and IOPS, phx vs fio vs os.preadv.

For each row (operation, block size, queue depth) every engine runs for
``--runtime`` seconds on the same file, ``--repeats`` times, the engines taking
turns within each repeat (the order rotates from repeat to repeat) so that
drift of a shared disk hits all of them alike.  Reported: the median GB/s and
IOPS of the repeats, their spread ((max - min) / median) and each engine's
ratio to fio's median.

Engines
  phx     the libphx io_uring engine through the public Python API: a
          ``phx.Engine(queue_depth=QD)``, the file opened on it, and
          ``File.pread_batch``/``pwrite_batch`` with many requests per call
          (sized for about 50 ms of work and at least 16 x QD, so the refill
          at the end of a batch costs little); buffers: 2 x QD block-sized
          slices of one ``phx.empty_aligned`` buffer registered with the
          engine, used round robin.
  fio     ``fio --ioengine=io_uring --direct=1 --iodepth=QD``, one job, same
          file, same block size, time-based (see :mod:`phx.bench._fio`).
  preadv  ``os.preadv``/``os.pwritev`` on an ``O_DIRECT`` descriptor from QD
          Python threads, each with its own page-aligned (mmap) buffer.
  (fio keeps QD buffers; all three touch about as much memory.)

The pattern is the same for all three: sequential rows walk the file from
offset 0 in block-size steps, wrapping at its end (with QD > 1 the next
offset goes to whichever request is issued next); random rows draw uniform,
block-aligned offsets with replacement, afresh each run (fio:
``--randrepeat=0 --norandommap``).  Writes overwrite the same test file in
place with random data (its blocks are already allocated, so no engine pays
for allocation); the file is written once, with random data, before the
first row.  Everything is O_DIRECT: the page cache is dropped once after the
file is written and before each row, but no figure here depends on it.
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import itertools
import mmap
import os
import random
import resource
import shutil
import signal
import stat
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

# No BLAS work happens here; an idle OpenBLAS thread pool would only take CPU
# time from the engines on a small machine.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

from phx.bench import _fio  # noqa: E402
from phx.bench._common import (cpu_model, drop_caches, fmt_size, fmt_table,  # noqa: E402
                               median_spread, parse_size, progress, storage_description,
                               write_json)

KiB = 1 << 10
MiB = 1 << 20

ENGINES = ("phx", "fio", "preadv")
OPS = _fio.OPS

DEFAULT_SIZE = "1g"
DEFAULT_BS = "4k,1m"
DEFAULT_QD = "1,8,32"
DEFAULT_OPS = "read,randread,write,randwrite"
DEFAULT_RUNTIME = 0.4
DEFAULT_REPEATS = 3

#: The issue's acceptance checks (computed from the run, never assumed).
SEQ_READ_MIN_RATIO = 0.95   # large sequential reads, at fio's best QD
RAND_READ_MIN_RATIO = 0.90  # 4 KiB random reads at QD 32 (IOPS)
LARGE_BS = 128 * KiB        # "large" sequential blocks start here


# ---------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------

def _csv(parse: Callable[[str], Any]) -> Callable[[str], list[Any]]:
    def conv(text: str) -> list[Any]:
        try:
            vals = [parse(t) for t in text.split(",") if t.strip()]
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
        if not vals:
            raise argparse.ArgumentTypeError("empty list")
        return vals
    return conv


def _positive_int(text: str) -> int:
    v = int(text)
    if v <= 0:
        raise ValueError(f"not a positive integer: {text!r}")
    return v


def _op(text: str) -> str:
    t = text.strip()
    if t not in OPS:
        raise ValueError(f"unknown op {t!r} (choose from {', '.join(OPS)})")
    return t


def _engine(text: str) -> str:
    t = text.strip()
    if t not in ENGINES:
        raise ValueError(f"unknown engine {t!r} (choose from {', '.join(ENGINES)})")
    return t


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``phx bench io``."""
    p.add_argument("--path", default=None,
                   help="directory to hold the test file (removed afterwards), or the name of a "
                        "new file to create and keep; any filesystem that takes O_DIRECT, e.g. a "
                        "zram-backed ext4 mount for RAM-speed rows (default: a temporary directory "
                        "under the current directory, i.e. on its filesystem)")
    p.add_argument("--size", type=parse_size, default=parse_size(DEFAULT_SIZE),
                   help=f"test file size (default {DEFAULT_SIZE})")
    p.add_argument("--bs", type=_csv(parse_size), default=_csv(parse_size)(DEFAULT_BS),
                   help=f"block sizes, comma-separated (default {DEFAULT_BS})")
    p.add_argument("--qd", type=_csv(_positive_int), default=_csv(_positive_int)(DEFAULT_QD),
                   help=f"queue depths, comma-separated (default {DEFAULT_QD})")
    p.add_argument("--ops", type=_csv(_op), default=_csv(_op)(DEFAULT_OPS),
                   help=f"operations, comma-separated, fio's names (default {DEFAULT_OPS})")
    p.add_argument("--runtime", type=float, default=DEFAULT_RUNTIME,
                   help=f"seconds per engine per repeat per row (default {DEFAULT_RUNTIME})")
    p.add_argument("--repeats", type=_positive_int, default=DEFAULT_REPEATS,
                   help=f"repeats per row; medians are reported (default {DEFAULT_REPEATS})")
    p.add_argument("--engines", type=_csv(_engine), default=list(ENGINES),
                   help=f"engines, comma-separated (default {','.join(ENGINES)})")
    p.add_argument("--fio-args", default="",
                   help="extra fio options, space-separated, appended to every fio run "
                        "(e.g. '--fixedbufs --registerfiles')")
    p.add_argument("--no-register", action="store_true",
                   help="do not register phx's buffers with its engine (plain READ/WRITE "
                        "instead of READ_FIXED/WRITE_FIXED)")
    p.add_argument("--seed", type=int, default=None,
                   help="seed for the test data and phx/preadv offsets (default: fresh)")
    p.add_argument("--json", metavar="PATH", default=None, help="write the results as JSON")
    p.add_argument("--plot", metavar="PATH", default=None, help="write a PNG plot")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


# ---------------------------------------------------------------------------
# The test file
# ---------------------------------------------------------------------------

@dataclass
class Target:
    """The test file and how to clean up after it."""
    path: str
    size: int
    cleanup: list[str] = field(default_factory=list)  # paths to remove, files first

    def remove(self) -> None:
        for p in self.cleanup:
            if os.path.isdir(p):
                shutil.rmtree(p, ignore_errors=True)
            else:
                try:
                    os.unlink(p)
                except FileNotFoundError:
                    pass


def prepare_target(path: str | None, size: int) -> Target:
    """Pick the test file's name from ``--path`` (see its help)."""
    if path is None:
        d = tempfile.mkdtemp(prefix=".phx-bench-io-", dir=os.getcwd())
        return Target(os.path.join(d, "testfile"), size, [d])
    if os.path.isdir(path):
        fd, name = tempfile.mkstemp(prefix="phx-bench-io-", suffix=".dat", dir=path)
        os.close(fd)
        return Target(name, size, [name])
    if os.path.exists(path):
        st = os.stat(path)
        what = "a block device" if stat.S_ISBLK(st.st_mode) else "an existing file"
        raise SystemExit(f"phx bench io: --path {path} is {what}; the benchmark writes to its "
                         f"test file, so give a directory (e.g. a zram-backed mount) or a new "
                         f"file name")
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        raise SystemExit(f"phx bench io: --path {path}: directory {parent} does not exist")
    return Target(os.path.abspath(path), size, [])


def _aligned(nbytes: int) -> mmap.mmap:
    """Page-aligned anonymous memory (O_DIRECT-safe) that needs no phx."""
    return mmap.mmap(-1, max(nbytes, mmap.PAGESIZE))


def write_test_file(path: str, size: int, seed: int | None) -> float:
    """Fill ``path`` with ``size`` bytes of fresh random data (O_DIRECT); return seconds."""
    import numpy as np
    rng = np.random.default_rng(seed)
    chunk = 16 * MiB
    buf = _aligned(chunk)
    t0 = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o644)
    try:
        os.ftruncate(fd, size)
        off = 0
        while off < size:
            n = min(chunk, size - off)
            buf[:n] = rng.bytes(n)
            nw = n if n % 4096 == 0 else (n + 4095) // 4096 * 4096
            os.pwritev(fd, [memoryview(buf)[:nw]], off)
            off += n
        os.ftruncate(fd, size)  # the last block may have been rounded up
        os.fsync(fd)
    except OSError as e:
        raise SystemExit(f"phx bench io: cannot write the test file {path} with O_DIRECT: {e}")
    finally:
        os.close(fd)
    return time.perf_counter() - t0


# ---------------------------------------------------------------------------
# Engines
# ---------------------------------------------------------------------------

@dataclass
class Sample:
    """One engine's run of one row."""
    nbytes: int
    ios: int
    seconds: float
    cpu_pct: float
    extra: dict[str, Any] = field(default_factory=dict)  # engine-specific counters

    @property
    def gbps(self) -> float:
        return self.nbytes / self.seconds / 1e9

    @property
    def iops(self) -> float:
        return self.ios / self.seconds


@contextlib.contextmanager
def _no_gc():
    """Python's cyclic GC off while an engine is timed (as :mod:`timeit` does): the
    request tuples a batch allocates would otherwise trigger collections that
    have nothing to do with I/O."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def _cpu_seconds() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)  # all threads, io_uring workers included
    return ru.ru_utime + ru.ru_stime


class PreadvEngine:
    """``os.preadv``/``os.pwritev`` with O_DIRECT from QD threads."""
    name = "preadv"

    def __init__(self, path: str, size: int, seed: int | None):
        self.path, self.size = path, size
        self.seeds = random.Random(seed)

    def run(self, op: str, bs: int, qd: int, runtime: float) -> Sample:
        write = "write" in op
        rand = op.startswith("rand")
        nblocks = self.size // bs
        fd = os.open(self.path, (os.O_RDWR if write else os.O_RDONLY) | os.O_DIRECT)
        counter = itertools.count()  # next() is atomic under the GIL
        start = threading.Barrier(qd + 1)
        state = {"deadline": 0.0}
        ios = [0] * qd
        ends = [0.0] * qd
        errors: list[BaseException] = []
        bufs = [_aligned(bs) for _ in range(qd)]
        if write:
            for b in bufs:
                b[:] = os.urandom(bs)

        def worker(i: int, seed: int) -> None:
            view = memoryview(bufs[i])[:bs]
            try:
                call = os.pwritev if write else os.preadv
                iov = [view]
                randrange = random.Random(seed).randrange
                nxt = counter.__next__
                clock = time.perf_counter
                n = 0
                start.wait()
                deadline = state["deadline"]
                while clock() < deadline:
                    off = (randrange(nblocks) if rand else nxt() % nblocks) * bs
                    got = call(fd, iov, off)
                    if got != bs:
                        raise OSError(f"short {'write' if write else 'read'}: {got} of {bs} "
                                      f"bytes at offset {off}")
                    n += 1
                ios[i] = n
                ends[i] = clock()
            except BaseException as e:  # noqa: BLE001 - reported by the caller
                errors.append(e)
                start.abort()
            finally:
                view.release()  # the mmap can close even if the error outlives us
                finished[i].set()

        # Set by each worker on its way out; Thread.join() is not to be trusted after
        # a signal interrupted it (CPython may then take a live thread for stopped).
        finished = [threading.Event() for _ in range(qd)]
        threads = [threading.Thread(target=worker, args=(i, self.seeds.getrandbits(64)),
                                    daemon=True) for i in range(qd)]
        try:
            for t in threads:
                t.start()
            cpu0 = _cpu_seconds()
            t0 = time.perf_counter()
            state["deadline"] = t0 + runtime
            try:
                start.wait()
            except threading.BrokenBarrierError:
                pass
            for t in threads:
                t.join()
            cpu = _cpu_seconds() - cpu0
        finally:
            # Interrupted (Ctrl-C, SIGTERM): let the workers finish their last call
            # (at most one block past the deadline) before their buffers go.
            start.abort()
            for t, done in zip(threads, finished):
                if t.ident is not None:
                    done.wait()
            os.close(fd)
            for b in bufs:
                b.close()
        if errors:
            raise errors[0]
        secs = max(ends) - t0
        total = sum(ios)
        return Sample(total * bs, total, secs, 100.0 * cpu / secs)


class FioEngine:
    """fio, one process per run (see :mod:`phx.bench._fio`)."""
    name = "fio"

    def __init__(self, path: str, size: int, extra: list[str]):
        exe = _fio.fio_path()
        if exe is None:
            raise SystemExit("phx bench io: fio is not installed (apt-get install fio), "
                             "or leave it out with --engines phx,preadv")
        self.exe, self.path, self.size, self.extra = exe, path, size, extra
        self.version = _fio.fio_version(exe)

    def command(self, op: str, bs: int, qd: int, runtime: float) -> list[str]:
        return _fio.fio_command(self.exe, self.path, self.size, op, bs, qd, runtime, self.extra)

    def run(self, op: str, bs: int, qd: int, runtime: float) -> Sample:
        r = _fio.run_fio(self.command(op, bs, qd, runtime), op, timeout_s=runtime * 10 + 60)
        return Sample(r.nbytes, r.ios, r.seconds, r.cpu_pct)


class PhxEngine:
    """libphx through the Python API: one Engine per run, batches of requests."""
    name = "phx"
    #: a batch is sized for this much work, and at least MIN_BATCH_PER_QD x QD requests
    BATCH_SECONDS = 0.05
    MIN_BATCH_PER_QD = 16
    MAX_BATCH = 1 << 16
    #: distinct buffer slices per queue-depth slot; fio keeps QD buffers, preadv one per
    #: thread; a small multiple keeps the cache footprint alike (a large pool would make
    #: phx pay for cache misses the others do not pay on RAM-speed devices)
    BUFFERS_PER_QD = 2

    def __init__(self, path: str, size: int, seed: int | None, register: bool):
        try:
            import phx
            phx.Engine  # noqa: B018 - a source tree without the built extension lacks it
        except (ImportError, AttributeError) as e:
            raise SystemExit(f"phx bench io: cannot use phx ({e}); build it with "
                             f"`make build`, or leave it out with --engines fio,preadv")
        import numpy as np
        self.phx, self.np = phx, np
        self.path, self.size, self.register = path, size, register
        self.rng = np.random.default_rng(seed)
        self.version = getattr(phx, "__version__", "")
        self.registered: bool | None = None  # whether register_buffer worked (last run)
        self.register_error = ""

    def _engine(self, bs: int, qd: int):
        kw: dict[str, Any] = {"queue_depth": qd}
        if bs > MiB:  # one device request per block, as fio issues it
            kw["max_io_size"] = bs
        return self.phx.Engine(**kw)

    def run(self, op: str, bs: int, qd: int, runtime: float) -> Sample:
        phx, np = self.phx, self.np
        write = "write" in op
        rand = op.startswith("rand")
        nblocks = self.size // bs
        min_batch = min(max(self.MIN_BATCH_PER_QD * qd, 16), self.MAX_BATCH)
        nbuf = self.BUFFERS_PER_QD * qd
        big = phx.empty_aligned(nbuf * bs)
        if write:
            np.frombuffer(big, dtype=np.uint8)[:] = np.frombuffer(
                self.rng.bytes(nbuf * bs), dtype=np.uint8)
        mv = memoryview(big)
        views = [mv[i * bs:(i + 1) * bs] for i in range(nbuf)]
        eng = self._engine(bs, qd)
        self.registered = False
        if self.register:
            try:
                eng.register_buffer(big)
                self.registered = True
            except OSError as e:  # e.g. RLIMIT_MEMLOCK; measured unregistered then
                self.register_error = str(e)
        f = phx.open(self.path, "r+" if write else "r", engine=eng)
        try:
            call = f.pwrite_batch if write else f.pread_batch
            views_rep = (views * (self.MAX_BATCH // nbuf + 1))[:self.MAX_BATCH]
            integers, arange = self.rng.integers, np.arange
            n = min_batch
            k = 0  # sequential: next block index
            done = 0
            clock = time.perf_counter
            cpu0 = _cpu_seconds()
            t0 = clock()
            deadline = t0 + runtime
            while True:
                tb = clock()
                if rand:
                    offs = (integers(0, nblocks, n) * bs).tolist()
                else:
                    offs = ((arange(k, k + n) % nblocks) * bs).tolist()
                    k += n
                res = call(list(zip(views_rep[:n], offs)))
                if sum(res) != n * bs:
                    bad = next(i for i, r in enumerate(res) if r != bs)
                    raise OSError(f"phx {op}: request {bad} ({bs} bytes at offset {offs[bad]}) "
                                  f"returned {res[bad]}")
                done += n
                now = clock()
                if now >= deadline:
                    break
                rate = n / max(now - tb, 1e-9)
                want = rate * min(self.BATCH_SECONDS, deadline - now)
                n = int(min(self.MAX_BATCH, max(min_batch, want)))
            secs = clock() - t0
            cpu = _cpu_seconds() - cpu0
            st = eng.stats()
            extra = {k: st[k] for k in ("sqes", "submits", "fixed_buf_ios", "bounce_ios",
                                        "short_ios", "errors") if k in st}
        finally:
            f.close()
            if self.registered:
                try:
                    eng.unregister_buffer(big)
                except OSError:
                    pass
            close = getattr(eng, "close", None)
            if close is not None:
                close()
        return Sample(done * bs, done, secs, 100.0 * cpu / secs, extra)


# ---------------------------------------------------------------------------
# Results
# ---------------------------------------------------------------------------

@dataclass
class Row:
    op: str
    bs: int
    qd: int

    @property
    def key(self) -> tuple[str, int, int]:
        return (self.op, self.bs, self.qd)


def summarise(rows: list[Row], engines: list[str],
              samples: dict[tuple[tuple[str, int, int], str], list[Sample]],
              errors: dict[tuple[tuple[str, int, int], str], str]) -> list[dict[str, Any]]:
    """One result record per (row, engine): medians, spread, ratio to fio."""
    out = []
    for row in rows:
        fio = samples.get((row.key, "fio")) or []
        fio_gbps = median_spread([s.gbps for s in fio])[0] if fio else None
        for eng in engines:
            ss = samples.get((row.key, eng)) or []
            rec: dict[str, Any] = {"op": row.op, "bs": row.bs, "qd": row.qd, "engine": eng,
                                   "repeats": len(ss)}
            if ss:
                gbps, spread = median_spread([s.gbps for s in ss])
                iops, iops_spread = median_spread([s.iops for s in ss])
                rec.update(
                    gbps=gbps, iops=iops, spread=spread, iops_spread=iops_spread,
                    cpu_pct=median_spread([s.cpu_pct for s in ss])[0],
                    ratio_vs_fio=(gbps / fio_gbps) if fio_gbps else None,
                    ratio_vs_fio_paired=(
                        median_spread([a.gbps / b.gbps for a, b in zip(ss, fio)])[0]
                        if len(fio) == len(ss) and fio else None),
                    gbps_runs=[s.gbps for s in ss], iops_runs=[s.iops for s in ss],
                    seconds_runs=[s.seconds for s in ss])
                if ss[-1].extra:
                    rec["counters_last_run"] = ss[-1].extra
            else:
                rec.update(gbps=None, iops=None, spread=None, ratio_vs_fio=None)
            if (row.key, eng) in errors:
                rec["error"] = errors[(row.key, eng)]
            out.append(rec)
    return out


def _find(results: list[dict[str, Any]], op: str, bs: int, qd: int, eng: str):
    for r in results:
        if (r["op"], r["bs"], r["qd"], r["engine"]) == (op, bs, qd, eng):
            return r
    return None


def acceptance_checks(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The issue's two checks, from the measured medians."""
    checks = []
    # 1. Large sequential reads at fio's best queue depth.
    name = (f"large sequential reads: phx >= {SEQ_READ_MIN_RATIO:g} x fio GB/s "
            f"at fio's best queue depth")
    seq = [r for r in results if r["op"] == "read" and r["bs"] >= LARGE_BS
           and r["engine"] == "fio" and r.get("gbps")]
    if seq:
        bs = max(r["bs"] for r in seq)
        best = max((r for r in seq if r["bs"] == bs), key=lambda r: r["gbps"])
        phx = _find(results, "read", bs, best["qd"], "phx")
        ratio = phx["gbps"] / best["gbps"] if phx and phx.get("gbps") else None
        every_qd = {}
        for r in seq:
            if r["bs"] == bs:
                p = _find(results, "read", bs, r["qd"], "phx")
                if p and p.get("gbps"):
                    every_qd[r["qd"]] = p["gbps"] / r["gbps"]
        checks.append({"check": name, "op": "read", "bs": bs, "qd": best["qd"],
                       "ratio_at_every_qd": every_qd,
                       "fio": best["gbps"], "phx": phx.get("gbps") if phx else None,
                       "fio_spread": best["spread"], "phx_spread": phx.get("spread") if phx else None,
                       "unit": "GB/s", "ratio": ratio, "threshold": SEQ_READ_MIN_RATIO,
                       "status": ("not measured" if ratio is None else
                                  "PASS" if ratio >= SEQ_READ_MIN_RATIO else "FAIL")})
    else:
        checks.append({"check": name, "status": "not measured",
                       "why": f"no fio 'read' row with bs >= {fmt_size(LARGE_BS)}"})
    # 2. 4 KiB random reads at QD 32, IOPS.
    name = f"4 KiB random reads at QD 32: phx >= {RAND_READ_MIN_RATIO:g} x fio IOPS"
    fio = _find(results, "randread", 4 * KiB, 32, "fio")
    phx = _find(results, "randread", 4 * KiB, 32, "phx")
    if fio and phx and fio.get("iops") and phx.get("iops"):
        ratio = phx["iops"] / fio["iops"]
        checks.append({"check": name, "op": "randread", "bs": 4 * KiB, "qd": 32,
                       "fio": fio["iops"], "phx": phx["iops"], "unit": "IOPS", "ratio": ratio,
                       "fio_spread": fio["iops_spread"], "phx_spread": phx["iops_spread"],
                       "threshold": RAND_READ_MIN_RATIO,
                       "status": "PASS" if ratio >= RAND_READ_MIN_RATIO else "FAIL"})
    else:
        checks.append({"check": name, "status": "not measured",
                       "why": "needs randread, bs 4k, qd 32 for both phx and fio"})
    return checks


def print_table(results: list[dict[str, Any]], file=sys.stdout) -> None:
    def f(v, fmt):
        return "-" if v is None else format(v, fmt)
    rows = []
    for r in results:
        rows.append([r["op"], fmt_size(r["bs"]), r["qd"], r["engine"],
                     f(r.get("gbps"), ".3f"), f(r.get("iops"), ",.0f"),
                     "-" if r.get("spread") is None else f"{100 * r['spread']:.0f}%",
                     f(r.get("cpu_pct"), ".0f"), f(r.get("ratio_vs_fio"), ".3f"),
                     r.get("error", "")[:60]])
    print(fmt_table(["op", "bs", "qd", "engine", "GB/s", "IOPS", "spread", "cpu%",
                     "ratio_vs_fio", "error"], rows), file=file)


def print_checks(checks: list[dict[str, Any]], file=sys.stdout) -> None:
    print("\nacceptance (issue 2, medians of this run):", file=file)
    for c in checks:
        if c.get("ratio") is None:
            print(f"  [{c['status']}] {c['check']}: {c.get('why', 'no phx figure')}", file=file)
            continue
        fmtv = ".3f" if c["unit"] == "GB/s" else ",.0f"
        noise = max(c["phx_spread"], c["fio_spread"])
        verdict = ("; the difference from 1 is inside the spread (noise)"
                   if abs(c["ratio"] - 1) <= noise else "")
        print(f"  [{c['status']}] {c['check']}: {fmt_size(c['bs'])} QD {c['qd']}: "
              f"phx {c['phx']:{fmtv}} vs fio {c['fio']:{fmtv}} {c['unit']} -> "
              f"ratio {c['ratio']:.3f} (need >= {c['threshold']:g}); spread phx "
              f"{100 * c['phx_spread']:.0f}%, fio {100 * c['fio_spread']:.0f}%{verdict}",
              file=file)
        if len(c.get("ratio_at_every_qd", {})) > 1:
            print("        phx / fio at each QD: " + ", ".join(
                f"QD {q}: {v:.3f}" for q, v in sorted(c["ratio_at_every_qd"].items())),
                file=file)


def plot(results: list[dict[str, Any]], path: str, title: str) -> None:
    """Bars per queue depth, one colour per engine, one panel per (op, bs)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ops = [o for o in OPS if any(r["op"] == o for r in results)]
    bss = sorted({r["bs"] for r in results})
    engines = list(dict.fromkeys(r["engine"] for r in results))
    qds = sorted({r["qd"] for r in results})
    colours = {"phx": "tab:blue", "fio": "tab:orange", "preadv": "tab:green"}
    fig, axes = plt.subplots(len(ops), len(bss), squeeze=False,
                             figsize=(4.2 * len(bss) + 1, 2.9 * len(ops) + 0.8))
    width = 0.8 / max(1, len(engines))
    for i, op in enumerate(ops):
        for j, bs in enumerate(bss):
            ax = axes[i][j]
            use_iops = bs < 64 * KiB
            for e, eng in enumerate(engines):
                xs, ys, lo, hi = [], [], [], []
                for q, qd in enumerate(qds):
                    r = _find(results, op, bs, qd, eng)
                    if not r or r.get("gbps") is None:
                        continue
                    key, runs = ("iops", "iops_runs") if use_iops else ("gbps", "gbps_runs")
                    scale = 1e-3 if use_iops else 1.0
                    v = r[key] * scale
                    xs.append(q + (e - (len(engines) - 1) / 2) * width)
                    ys.append(v)
                    lo.append(v - min(r[runs]) * scale)
                    hi.append(max(r[runs]) * scale - v)
                    if eng == "phx" and r.get("ratio_vs_fio"):
                        ax.annotate(f"{r['ratio_vs_fio']:.2f}", (xs[-1], v + hi[-1]),
                                    ha="center", va="bottom", fontsize=7, color=colours["phx"])
                ax.bar(xs, ys, width, yerr=[lo, hi], capsize=2, label=eng,
                       color=colours.get(eng))
            ax.set_xticks(range(len(qds)), [f"QD {q}" for q in qds])
            ax.set_ylabel("kIOPS" if use_iops else "GB/s")
            ax.set_title(f"{op}, bs {fmt_size(bs)}", fontsize=10)
            ax.grid(axis="y", alpha=0.3)
            ax.margins(y=0.15)
    axes[0][0].legend(fontsize=8)
    fig.suptitle(title + "\n(median of repeats; whiskers: min-max; numbers: phx / fio)",
                 fontsize=10)
    fig.tight_layout()
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---------------------------------------------------------------------------
# Main
# ---------------------------------------------------------------------------

def _terminate(signum, frame):
    raise SystemExit(128 + signum)


def run(args: argparse.Namespace) -> int:
    """Run ``phx bench io`` with parsed ``args``; 0 on success, 1 if a run failed."""
    engines = list(dict.fromkeys(args.engines))
    ops = list(dict.fromkeys(args.ops))
    bss = sorted(set(args.bs))
    qds = sorted(set(args.qd))
    for bs in bss:
        if bs % 4096:
            raise SystemExit(f"phx bench io: --bs {bs} is not a multiple of 4096 (O_DIRECT)")
        if bs > args.size:
            raise SystemExit(f"phx bench io: --bs {fmt_size(bs)} exceeds --size")
    if args.size % 4096:
        raise SystemExit("phx bench io: --size must be a multiple of 4096")
    if args.runtime <= 0:
        raise SystemExit("phx bench io: --runtime must be positive")
    rows = [Row(op, bs, qd) for op in ops for bs in bss for qd in qds]

    seed = args.seed if args.seed is not None else int.from_bytes(os.urandom(8), "little")
    target = prepare_target(args.path, args.size)
    # A SIGTERM (e.g. from a CI timeout) unwinds like Ctrl-C, so the test file goes too.
    old_term = signal.signal(signal.SIGTERM, _terminate) \
        if threading.current_thread() is threading.main_thread() else None
    try:
        runners: dict[str, Any] = {}
        # Construct every engine before writing anything: a missing one fails fast.
        for e in engines:
            if e == "phx":
                runners[e] = PhxEngine(target.path, args.size, seed, not args.no_register)
            elif e == "fio":
                runners[e] = FioEngine(target.path, args.size, args.fio_args.split())
            else:
                runners[e] = PreadvEngine(target.path, args.size, seed)
        storage = storage_description(os.path.dirname(target.path))
        free = shutil.disk_usage(os.path.dirname(target.path)).free
        if free < args.size + 64 * MiB:
            raise SystemExit(f"phx bench io: {fmt_size(args.size)} test file does not fit in "
                             f"{os.path.dirname(target.path)} ({free / 1e9:.1f} GB free)")
        load_start = os.getloadavg()
        t_start = time.perf_counter()
        write_s = write_test_file(target.path, args.size, seed)
        dropped = drop_caches()
        print(f"phx bench io: {target.path} ({storage['fstype']} on {storage['device']}), "
              f"{fmt_size(args.size)} of random data written in {write_s:.1f} s; "
              f"{len(rows)} rows x {len(engines)} engines x {args.repeats} repeats x "
              f"{args.runtime:g} s", file=sys.stderr)

        samples: dict[Any, list[Sample]] = {}
        errors: dict[Any, str] = {}
        total = len(rows) * len(engines) * args.repeats
        bar = progress(total, "bench io", enabled=not args.no_progress, unit="run")
        with bar:
            for row in rows:
                drop_caches()
                for rep in range(args.repeats):
                    order = engines[rep % len(engines):] + engines[:rep % len(engines)]
                    for e in order:
                        bar.set_postfix_str(f"{row.op} {fmt_size(row.bs)} QD{row.qd} {e}")
                        if (row.key, e) not in errors:
                            try:
                                with _no_gc():
                                    s = runners[e].run(row.op, row.bs, row.qd, args.runtime)
                                samples.setdefault((row.key, e), []).append(s)
                            except (OSError, RuntimeError, ValueError) as exc:
                                errors[(row.key, e)] = f"{type(exc).__name__}: {exc}"
                        bar.update(1)
        elapsed = time.perf_counter() - t_start
        load_end = os.getloadavg()
    finally:
        target.remove()
        if old_term is not None:
            signal.signal(signal.SIGTERM, old_term)

    results = summarise(rows, engines, samples, errors)
    checks = acceptance_checks(results) if {"phx", "fio"} <= set(engines) else []
    print_table(results)
    if checks:
        print_checks(checks)
    where = (f"{storage['fstype']} on {storage['device']} ({storage['mount']}), "
             f"{os.cpu_count()} CPUs {cpu_model()}")
    print(f"\n{fmt_size(args.size)} file on {where}; {args.repeats} repeats x "
          f"{args.runtime:g} s per engine per row; {elapsed:.0f} s in all")
    busy = max(load_start[0], load_end[0])
    if busy > (os.cpu_count() or 1):
        print(f"note: the machine was busy (load average {busy:.1f} on {os.cpu_count()} CPUs): "
              f"other work shared the CPUs and the disk; expect noisy figures")
    phx_runner = runners.get("phx")
    if phx_runner is not None and phx_runner.register and not phx_runner.registered:
        print(f"note: phx buffers could not be registered ({phx_runner.register_error}); "
              f"phx ran with plain READ/WRITE", file=sys.stderr)
    for (key, e), msg in errors.items():
        print(f"error: {e} {key[0]} {fmt_size(key[1])} QD{key[2]}: {msg}", file=sys.stderr)

    config = {
        "path": target.path, "storage": storage, "cpu_model": cpu_model(),
        "size": args.size, "bs": bss, "qd": qds, "ops": ops, "engines": engines,
        "runtime_s": args.runtime, "repeats": args.repeats, "seed": seed,
        "page_cache_dropped": dropped, "elapsed_s": elapsed,
        "loadavg_start": load_start, "loadavg_end": load_end,
        "pattern": ("sequential: from offset 0 in bs steps, wrapping; random: uniform "
                    "bs-aligned offsets with replacement, fresh each run (fio "
                    "--randrepeat=0 --norandommap); writes overwrite the read file in place "
                    "with random data"),
        "ratio_vs_fio": "median GB/s of the engine / median GB/s of fio in the same row",
        "spread": "(max - min) / median of the repeats' GB/s",
    }
    if "fio" in runners:
        cmd = " ".join(runners["fio"].command("read", 4096, 1, args.runtime))
        for a, b in (("--rw=read", "--rw=OP"), ("--bs=4096", "--bs=BS"),
                     ("--iodepth=1 ", "--iodepth=QD ")):
            cmd = cmd.replace(a, b)
        config["fio"] = {"version": runners["fio"].version, "command": cmd}
    if phx_runner is not None:
        config["phx"] = {"version": phx_runner.version, "registered_buffers": phx_runner.registered,
                         "batch": f"pread_batch/pwrite_batch of >= max(16 x QD, ~"
                                  f"{PhxEngine.BATCH_SECONDS * 1000:.0f} ms of work) requests"}
    write_json(args.json, {"benchmark": "io", "config": config, "rows": results,
                           "checks": checks})
    if args.plot:
        plot(results, args.plot, f"phx bench io: {fmt_size(args.size)} file, {where}")
    return 1 if errors else 0
