"""``phx bench io``: file read/write GB/s and IOPS, phx vs fio at its strongest vs os.preadv.

For each row (operation, block size, queue depth) every engine runs for
``--runtime`` seconds on the same file, ``--repeat`` times, the engines taking
turns within each repeat (the order rotates from repeat to repeat) so that
drift of a shared disk hits all of them alike.  Reported: the median GB/s and
IOPS of the repeats, their spread ((max - min) / median), each engine's ratio
to fio's median, and how the engine's requests reached the device (requests,
merges and average request size from ``/sys/block/<dev>/stat``, diffed around
each run).

Engines
  phx     the libphx io_uring engine through the public Python API: a
          ``phx.Engine(queue_depth=QD)``, the file opened on it, and
          ``File.pread_batch``/``pwrite_batch`` with many requests per call
          (sized for about 50 ms of work and at least 16 x QD, so the refill
          at the end of a batch costs little); buffers: 2 x QD block-sized
          slices of one ``phx.empty_aligned`` buffer registered with the
          engine, used round robin.
  phx-threads  the same on libphx's thread-pool backend
          (``phx.Engine(backend="threads")``: preadv2/pwritev2 workers, what
          phx falls back to where io_uring is refused, docs/design.md).
  phx-inline, phx-spread  (not run unless named) the phx row with its
          engine made under ``PHX_URING_SPREAD=0`` / ``=1``: large batches
          never / always sent to io_uring's io-wq workers, where the phx row
          decides by itself (be_uring.c, "Spreading"; docs/bench-io.md).
  fio     fio's io_uring engine at its strongest (see :mod:`phx.bench._fio`):
          fixed buffers, registered file, phx's submit batching, every ready
          completion reaped at once, no buffer scrambling, no latency
          accounting; one job, same file, same block size, time-based.
  preadv  ``os.preadv``/``os.pwritev`` on an ``O_DIRECT`` descriptor from QD
          Python threads, each with its own page-aligned buffer.
  (fio keeps QD buffers; all three touch about as much memory.)

Writes are timed with an fsync at the end, for every engine (phx
``File.fsync()`` and preadv ``os.fsync`` inside their timed runs; for fio the
benchmark fsyncs the file as soon as fio exits and adds that time to fio's,
because fio 3.33 loses its own ``--end_fsync=1`` with ``--fixedbufs``: see
:mod:`phx.bench._fio`).

The pattern is the same for all three: sequential rows walk the file from
offset 0 in block-size steps, wrapping at its end (with QD > 1 the next
offset goes to whichever request is issued next); random rows draw uniform,
block-aligned offsets with replacement, afresh each run (fio:
``--randrepeat=0 --norandommap``).  Writes overwrite the same test file in
place with random data (its blocks are already allocated, so no engine pays
for allocation); the file is written once, with random data, before the
first row.  Everything is O_DIRECT: the page cache is dropped once after the
file is written and before each row, but no figure here depends on it.

With ``--zram SIZE`` the same rows run a second time in the same invocation
on ext4 on a private zram device (RAM speed: software decides), made for the
run and removed afterwards (see :mod:`phx.bench._zram`).
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
import shlex
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

from phx.bench import _blockstat, _fio, _zram  # noqa: E402
from phx.bench._common import (BenchError, add_common_arguments, cpu_model,  # noqa: E402
                               deprecated_alias, dir_path, drop_caches, fmt_size, fmt_table,
                               median_spread, need_space, parse_size, positive_float,
                               positive_size, progress, storage_description, write_json)

KiB = 1 << 10
MiB = 1 << 20

ENGINES = ("phx", "phx-threads", "fio", "preadv")
#: named with --methods only: the phx row with spreading off / forced
#: (PHX_URING_SPREAD at the engine's creation)
SPREAD_ENGINES = {"phx-inline": "0", "phx-spread": "1"}
OPS = _fio.OPS

DEFAULT_SIZE = "1g"
#: The default rows: what the acceptance checks need plus the 4 KiB sequential
#: read whose merging docs/bench-io.md explains.  1 MiB sequential at three
#: depths so that "fio's best depth" is found among them.
DEFAULT_ROWS = (("read", MiB, 1), ("read", MiB, 8), ("read", MiB, 32),
                ("write", MiB, 1), ("write", MiB, 8), ("write", MiB, 32),
                ("randread", 4 * KiB, 1), ("randread", 4 * KiB, 32),
                ("randwrite", 4 * KiB, 32),
                ("read", 4 * KiB, 32))
#: With any of --bs/--qd/--ops given, the rows are every combination of these
#: (the ones not given taking these values).
GRID_BS = "4k,1m"
GRID_QD = "1,8,32"
GRID_OPS = "read,randread,write,randwrite"
DEFAULT_RUNTIME = 5.0
DEFAULT_REPEATS = 5
QUICK_RUNTIME = 0.5
QUICK_REPEATS = 3
#: Seconds a run costs beyond --runtime (process start, engine setup, the
#: page-cache drop per row), for the estimate printed at the start; measured
#: on the 2-core development box (0.24 s per run on average).
RUN_OVERHEAD_S = {"fio": 0.35, "phx": 0.15, "phx-threads": 0.15, "preadv": 0.15,
                  "phx-inline": 0.15, "phx-spread": 0.15}
TEST_FILE_WRITE_GBPS = 0.5  # for the same estimate


# ---------------------------------------------------------------------------
# Acceptance checks (issue 9)
# ---------------------------------------------------------------------------

#: Repeats needed before the spread of the paired ratios says anything.
MIN_PAIRS_FOR_NOISE = 3


@dataclass(frozen=True)
class CheckSpec:
    """One acceptance check: phx's median over fio's median on one row."""
    name: str
    target: str            # "disk" (the --dir target) or "zram"
    op: str
    bs: int
    qd: int | None         # None: the queue depth where fio's median is highest
    threshold: float


CHECKS = (
    CheckSpec("1 MiB sequential read, fio's best QD", "disk", "read", MiB, None, 1.0),
    CheckSpec("1 MiB sequential write, fio's best QD", "disk", "write", MiB, None, 1.0),
    CheckSpec("4 KiB random read, QD 32", "disk", "randread", 4 * KiB, 32, 1.0),
    CheckSpec("zram: 4 KiB random read, QD 32", "zram", "randread", 4 * KiB, 32, 1.2),
)


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
    try:
        v = int(text)
    except ValueError:
        raise ValueError(f"not a whole number: {text!r}") from None
    if v <= 0:
        raise ValueError(f"not a positive integer: {text!r}")
    return v


def _csv_one(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    def conv(text: str) -> Any:
        try:
            return parse(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    return conv


def _op(text: str) -> str:
    t = text.strip()
    if t not in OPS:
        raise ValueError(f"unknown op {t!r} (choose from {', '.join(OPS)})")
    return t


def _engine(text: str) -> str:
    t = text.strip()
    if t not in ENGINES and t not in SPREAD_ENGINES:
        raise ValueError(f"unknown engine {t!r} (choose from "
                         f"{', '.join((*ENGINES, *SPREAD_ENGINES))})")
    return t


def _default_rows_text() -> str:
    return ", ".join(f"{op} {fmt_size(bs)} QD {qd}" for op, bs, qd in DEFAULT_ROWS)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``phx bench io``."""
    p.description = (
        f"Default rows: {_default_rows_text()}; {DEFAULT_REPEATS} repeats x "
        f"{DEFAULT_RUNTIME:g} s per engine per row, four engines: about 17 minutes per "
        f"row set on the 2-core development box (1 GiB file), 35 with --zram. --quick: "
        f"{QUICK_REPEATS} x {QUICK_RUNTIME:g} s (about 1 minute per row set). The time is "
        f"printed at the start.")
    p.add_argument("--size", type=positive_size, default=parse_size(DEFAULT_SIZE),
                   help=f"test file size (default {DEFAULT_SIZE})")
    p.add_argument("--bs", type=_csv(parse_size), default=None,
                   help=f"block sizes, comma-separated; with any of --bs/--qd/--ops the rows are "
                        f"every combination (default for this grid {GRID_BS}; without all three, "
                        f"the default rows above)")
    p.add_argument("--qd", type=_csv(_positive_int), default=None,
                   help=f"queue depths, comma-separated (grid default {GRID_QD})")
    p.add_argument("--ops", type=_csv(_op), default=None,
                   help=f"operations, comma-separated, fio's names (grid default {GRID_OPS})")
    p.add_argument("--runtime", type=positive_float, default=None,
                   help=f"seconds per engine per repeat per row (default {DEFAULT_RUNTIME:g}; "
                        f"--quick {QUICK_RUNTIME:g})")
    p.add_argument("--quick", action="store_true",
                   help=f"short runs: --runtime {QUICK_RUNTIME:g} --repeat {QUICK_REPEATS} "
                        f"unless given (figures too noisy for a verdict)")
    p.add_argument("--methods", dest="engines", type=_csv(_engine), default=list(ENGINES),
                   help=f"engines, comma-separated (default {','.join(ENGINES)}; also "
                        f"{', '.join(SPREAD_ENGINES)}: phx with PHX_URING_SPREAD=0 / 1)")
    p.add_argument("--zram", metavar="SIZE", type=parse_size, default=None,
                   help="also run the same rows on ext4 on a new zram device of SIZE bytes "
                        "(e.g. 2g; at least --size + 10%% + 64m), made for the run and removed "
                        "afterwards; needs root; skipped with the reason printed when it cannot "
                        "be made")
    p.add_argument("--fio-args", default="",
                   help="extra fio options, space-separated, appended to every fio run")
    p.add_argument("--no-register", action="store_true",
                   help="do not register phx's buffers with its engine (plain READ/WRITE "
                        "instead of READ_FIXED/WRITE_FIXED)")
    p.add_argument("--seed", type=int, default=None,
                   help="seed for the test data and phx/preadv offsets (default: fresh)")
    add_common_arguments(
        p, dir_help="directory to hold the test file, made if missing; any filesystem that "
                    "takes O_DIRECT (default: a temporary directory under the current "
                    "directory, i.e. on its filesystem); the file (and a directory made for "
                    "it) is removed afterwards unless --keep",
        repeat=None,
        repeat_help=f"interleaved repeats per row; medians are reported (default "
                    f"{DEFAULT_REPEATS}; --quick {QUICK_REPEATS})",
        keep_help="keep the test file (its name is printed)")
    # the zram rows' plot goes to PATH with '-zram' before the extension
    deprecated_alias(p, "--path", "--dir", "dir", type=dir_path)
    deprecated_alias(p, "--repeats", "--repeat", "repeat", type=_csv_one(_positive_int))
    deprecated_alias(p, "--engines", "--methods", "engines", type=_csv(_engine))
    deprecated_alias(p, "--no-progress", "--quiet", "quiet", flag=True)


@dataclass
class Row:
    op: str
    bs: int
    qd: int

    @property
    def key(self) -> tuple[str, int, int]:
        return (self.op, self.bs, self.qd)


def rows_from_args(args: argparse.Namespace) -> list[Row]:
    """The default rows, or every combination of --ops x --bs x --qd when any is given."""
    if args.bs is None and args.qd is None and args.ops is None:
        return [Row(*r) for r in DEFAULT_ROWS]
    ops = list(dict.fromkeys(args.ops or _csv(_op)(GRID_OPS)))
    bss = sorted(set(args.bs or _csv(parse_size)(GRID_BS)))
    qds = sorted(set(args.qd or _csv(_positive_int)(GRID_QD)))
    return [Row(op, bs, qd) for op in ops for bs in bss for qd in qds]


def timing_from_args(args: argparse.Namespace) -> tuple[float, int]:
    """(--runtime, --repeats) after --quick and the defaults."""
    runtime = args.runtime if args.runtime is not None else (
        QUICK_RUNTIME if args.quick else DEFAULT_RUNTIME)
    repeats = args.repeat if args.repeat is not None else (
        QUICK_REPEATS if args.quick else DEFAULT_REPEATS)
    return runtime, repeats


def estimate_seconds(rows: int, engines: list[str], repeats: int, runtime: float,
                     size: int, row_sets: int) -> float:
    """About how long the benchmark takes (printed at the start)."""
    per_row = sum(runtime + RUN_OVERHEAD_S.get(e, 0.1) for e in engines) * repeats
    return row_sets * (rows * per_row + size / (TEST_FILE_WRITE_GBPS * 1e9))


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


def prepare_target(path: str | None, size: int, keep: bool = False) -> Target:
    """The test file's name: a new file in ``--dir`` (made if missing), else in a
    temporary directory under the current one; removed (with a directory made
    for it) unless ``keep``."""
    if path is None:
        d = tempfile.mkdtemp(prefix=".phx-bench-io-", dir=os.getcwd())
        return Target(os.path.join(d, "testfile"), size, [] if keep else [d])
    if os.path.exists(path) and not os.path.isdir(path):
        st = os.stat(path)
        what = "a block device" if stat.S_ISBLK(st.st_mode) else "an existing file"
        raise BenchError(f"--dir {path} is {what}; the benchmark writes a test file, so give "
                         f"a directory (e.g. a zram-backed mount)")
    made = []
    d = os.path.abspath(path)
    while not os.path.exists(d):
        made.append(d)
        d = os.path.dirname(d)
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        raise BenchError(f"--dir {path}: cannot make it: {e.strerror}") from None
    fd, name = tempfile.mkstemp(prefix="phx-bench-io-", suffix=".dat", dir=path)
    os.close(fd)
    return Target(name, size, [] if keep else [name, *made])


def _aligned(nbytes: int) -> memoryview:
    """Page-aligned memory (O_DIRECT-safe) from phx's one allocator
    (:func:`phx.empty_aligned`), writable by slices; the raw rows do no phx I/O."""
    import phx
    return memoryview(phx.empty_aligned(max(nbytes, mmap.PAGESIZE)))


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
        raise BenchError(f"cannot write the test file {path} with O_DIRECT: {e}") from None
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
    argv: list[str] | None = None                        # fio: the exact command
    blk: _blockstat.BlockStat | None = None              # device counters over the run

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
                view.release()  # the buffer can go even if the error outlives us
                finished[i].set()

        # Set by each worker on its way out; Thread.join() is not to be trusted after
        # a signal interrupted it (CPython may then take a live thread for stopped).
        finished = [threading.Event() for _ in range(qd)]
        threads = [threading.Thread(target=worker, args=(i, self.seeds.getrandbits(64)),
                                    daemon=True) for i in range(qd)]
        fsync_s = 0.0
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
            if write and not errors:
                # An fsync at the end, timed, for every engine: the data is on stable storage
                # when the clock stops.
                t1 = time.perf_counter()
                os.fsync(fd)
                fsync_s = time.perf_counter() - t1
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
                b.release()
        if errors:
            raise errors[0]
        secs = max(ends) - t0 + fsync_s
        total = sum(ios)
        return Sample(total * bs, total, secs, 100.0 * cpu / secs,
                      {"fsync_s": fsync_s} if write else {})


def phx_submit_batch() -> tuple[int, str]:
    """phx's ``submit_batch`` (SQEs per ``io_uring_enter``) as its engine config has it.

    Read from a real ``phx.Engine`` so that fio's ``--iodepth_batch_submit``
    follows ``PHX_SUBMIT_BATCH`` and phx's built-in default, whatever they are.
    """
    try:
        import phx
        eng = phx.Engine(queue_depth=1)
    except (ImportError, AttributeError, OSError, ValueError) as e:
        return 4, f"phx's documented default; phx is not usable here ({e})"
    try:
        return int(eng.config["submit_batch"]), "phx.Engine().config['submit_batch']"
    finally:
        eng.close()


class FioEngine:
    """fio, one process per run (see :mod:`phx.bench._fio`)."""
    name = "fio"

    def __init__(self, path: str, size: int, extra: list[str], submit_batch: int):
        exe = _fio.fio_path()
        if exe is None:
            raise BenchError("fio is not installed (apt-get install fio), "
                             "or leave it out with --engines phx,preadv")
        self.exe, self.path, self.size, self.extra = exe, path, size, extra
        self.submit_batch = submit_batch
        self.version = _fio.fio_version(exe)

    def command(self, op: str, bs: int, qd: int, runtime: float) -> list[str]:
        return _fio.fio_command(self.exe, self.path, self.size, op, bs, qd, runtime,
                                self.submit_batch, self.extra)

    def run(self, op: str, bs: int, qd: int, runtime: float) -> Sample:
        argv = self.command(op, bs, qd, runtime)
        r = _fio.run_fio(argv, op, timeout_s=runtime * 10 + 60)
        if "write" not in op:
            return Sample(r.nbytes, r.ios, r.seconds, r.cpu_pct, argv=argv)
        # fio's own --end_fsync=1 is lost with --fixedbufs (see phx.bench._fio): the
        # fsync follows fio's exit, and its time is fio's.
        fsync_s = _fio.timed_fsync(self.path)
        return Sample(r.nbytes, r.ios, r.seconds + fsync_s, r.cpu_pct * r.seconds /
                      (r.seconds + fsync_s), {"fsync_s": fsync_s}, argv=argv)


class PhxEngine:
    """libphx through the Python API: one Engine per run, batches of requests."""
    name = "phx"
    #: a batch is sized for this much work, and at least MIN_BATCH_PER_QD x QD requests
    BATCH_SECONDS = 0.05
    MIN_BATCH_PER_QD = 16
    MAX_BATCH = 1 << 16
    #: distinct buffer slices per queue-depth slot: one, as fio keeps one buffer per
    #: io_u (QD in all) and preadv one per thread.  On RAM-speed devices the copy is
    #: the work, and a pool twice fio's (the earlier choice) left phx's 16 MiB at QD 8
    #: out of cache where fio's 8 MiB fit: 1 MiB writes on zram ran 0.92x fio there.
    #: Two requests in flight may then share a slot; the bytes are not checked, and
    #: fio's io_u reuse is no different.
    BUFFERS_PER_QD = 1

    def __init__(self, path: str, size: int, seed: int | None, register: bool,
                 backend: str = "uring", spread: str | None = None):
        try:
            import phx
            phx.Engine  # noqa: B018 - a source tree without the built extension lacks it
        except (ImportError, AttributeError) as e:
            raise BenchError(f"cannot use phx ({e}); build it with "
                             f"`make build`, or leave it out with --methods fio,preadv")
        import numpy as np
        self.phx, self.np = phx, np
        self.path, self.size, self.register = path, size, register
        self.backend = backend    # "uring" for the phx row, so it never falls back unseen
        self.spread = spread      # PHX_URING_SPREAD for its engines; None: as set
        self.rng = np.random.default_rng(seed)
        self.version = getattr(phx, "__version__", "")
        self.registered: bool | None = None  # whether register_buffer worked (last run)
        self.register_error = ""
        self.engine_config: dict[str, Any] = {}    # of the last run's engine
        self.engine_features: dict[str, Any] = {}

    def _engine(self, bs: int, qd: int):
        # One thread drives each run, as fio's one job does: the engine may
        # then use a single-issuer ring with deferred task running and a
        # registered ring fd (fio 3.33 sets the first two as well).
        kw: dict[str, Any] = {"queue_depth": qd, "single_thread": True,
                              "backend": self.backend}
        if bs > MiB:  # one device request per block, as fio issues it
            kw["max_io_size"] = bs
        if self.spread is None:
            return self.phx.Engine(**kw)
        # libphx reads it when the engine is made
        old = os.environ.get("PHX_URING_SPREAD")
        os.environ["PHX_URING_SPREAD"] = self.spread
        try:
            return self.phx.Engine(**kw)
        finally:
            if old is None:
                del os.environ["PHX_URING_SPREAD"]
            else:
                os.environ["PHX_URING_SPREAD"] = old

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
        eng = self._engine(bs, qd)
        self.engine_config = dict(eng.config)
        self.engine_features = dict(getattr(eng, "features", {}) or {})
        self.registered = False
        if self.register:
            try:
                eng.register_buffer(big)
                self.registered = True
            except OSError as e:  # e.g. RLIMIT_MEMLOCK; measured unregistered then
                self.register_error = str(e)
        f = phx.open(self.path, "r+" if write else "r", engine=eng)
        try:
            # pread_many/pwrite_many: one host buffer, numpy arrays of offsets, no
            # Python object per request (what a KV-chunk reader would call)
            call = f.pwrite_many if write else f.pread_many
            slots = (np.arange(self.MAX_BATCH) % nbuf) * bs
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
                    offs = integers(0, nblocks, n) * bs
                else:
                    offs = (arange(k, k + n) % nblocks) * bs
                    k += n
                res = call(big, offs, bs, slots[:n])
                if int(res.sum()) != n * bs:
                    bad = int(np.flatnonzero(res != bs)[0])
                    raise OSError(f"phx {op}: request {bad} ({bs} bytes at offset {offs[bad]}) "
                                  f"returned {res[bad]}")
                done += n
                now = clock()
                if now >= deadline:
                    break
                rate = n / max(now - tb, 1e-9)
                want = rate * min(self.BATCH_SECONDS, deadline - now)
                n = int(min(self.MAX_BATCH, max(min_batch, want)))
            fsync_s = 0.0
            if write:
                # An fsync at the end, timed, for every engine: the data is on stable storage
                # when the clock stops.
                t1 = clock()
                f.fsync()
                fsync_s = clock() - t1
            secs = clock() - t0
            cpu = _cpu_seconds() - cpu0
            st = eng.stats()
            extra = {k: st[k] for k in ("sqes", "submits", "fixed_buf_ios", "bounce_ios",
                                        "short_ios", "errors", "backend") if k in st}
            if write:
                extra["fsync_s"] = fsync_s
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

def summarise(rows: list[Row], engines: list[str],
              samples: dict[tuple[tuple[str, int, int], str], list[Sample]],
              errors: dict[tuple[tuple[str, int, int], str], str],
              target: str = "disk", blockdev_na: str | None = None) -> list[dict[str, Any]]:
    """One result record per (row, engine): medians, spread, ratio to fio, device counts."""
    out = []
    for row in rows:
        fio = samples.get((row.key, "fio")) or []
        fio_gbps = median_spread([s.gbps for s in fio])[0] if fio else None
        for eng in engines:
            ss = samples.get((row.key, eng)) or []
            rec: dict[str, Any] = {"target": target, "op": row.op, "bs": row.bs, "qd": row.qd,
                                   "engine": eng, "repeats": len(ss)}
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
                if eng == "fio" and ss[-1].argv:
                    rec["fio_argv"] = ss[-1].argv
                blks = [s.blk for s in ss if s.blk is not None]
                if blks and len(blks) == len(ss):
                    total = blks[0]
                    for b in blks[1:]:
                        total = total + b
                    rec["blockdev"] = _blockstat.summarise(total, "write" in row.op,
                                                           sum(s.ios for s in ss))
                    rec["blockdev_runs"] = [b.as_dict() for b in blks]
                else:
                    rec["blockdev"] = None
                    rec["blockdev_na"] = blockdev_na or "not read"
            else:
                rec.update(gbps=None, iops=None, spread=None, ratio_vs_fio=None)
            if (row.key, eng) in errors:
                rec["error"] = errors[(row.key, eng)]
            out.append(rec)
    return out


def _find(results: list[dict[str, Any]], op: str, bs: int, qd: int, eng: str,
          target: str | None = None):
    for r in results:
        if (r["op"], r["bs"], r["qd"], r["engine"]) == (op, bs, qd, eng) and \
                (target is None or r.get("target", "disk") == target):
            return r
    return None


def evaluate_check(spec: CheckSpec, results: list[dict[str, Any]],
                   missing: str | None = None) -> dict[str, Any]:
    """One acceptance check from the measured medians of this run (never assumed).

    The verdict compares the ratio of the medians with the threshold.  The
    repeats are paired (phx's i-th run with fio's i-th run of the same row,
    taken next to each other); when their ratios fall on both sides of the
    threshold, the verdict is inside the noise, and the record says so.
    """
    base = {"check": spec.name, "target": spec.target, "op": spec.op, "bs": spec.bs,
            "threshold": spec.threshold, "unit": "GB/s" if spec.bs >= 64 * KiB else "IOPS"}
    if missing:
        return {**base, "qd": spec.qd, "status": "not measured", "why": missing}
    rows = [r for r in results if r.get("target", "disk") == spec.target and
            r["op"] == spec.op and r["bs"] == spec.bs and r.get("gbps")]
    fio_rows = [r for r in rows if r["engine"] == "fio"]
    if spec.qd is None:
        if not fio_rows:
            return {**base, "qd": None, "status": "not measured",
                    "why": f"no fio {spec.op} {fmt_size(spec.bs)} row on {spec.target}"}
        qd = max(fio_rows, key=lambda r: r["gbps"])["qd"]
    else:
        qd = spec.qd
    fio = _find(rows, spec.op, spec.bs, qd, "fio", spec.target)
    phx = _find(rows, spec.op, spec.bs, qd, "phx", spec.target)
    if not fio or not phx:
        return {**base, "qd": qd, "status": "not measured",
                "why": f"needs {spec.op} {fmt_size(spec.bs)} QD {qd} on {spec.target} "
                       f"for both phx and fio"}
    key, runs = ("gbps", "gbps_runs") if base["unit"] == "GB/s" else ("iops", "iops_runs")
    ratio = phx[key] / fio[key]
    paired = ([a / b for a, b in zip(phx[runs], fio[runs])]
              if len(phx[runs]) == len(fio[runs]) else [])
    lo, hi = (min(paired), max(paired)) if paired else (None, None)
    # With fewer than 3 pairs a range says little about the noise: unknown.
    noise = (lo < spec.threshold <= hi) if len(paired) >= MIN_PAIRS_FOR_NOISE else None
    every_qd = {}
    for r in fio_rows:
        p = _find(rows, spec.op, spec.bs, r["qd"], "phx", spec.target)
        if p:
            every_qd[r["qd"]] = p["gbps"] / r["gbps"]
    return {**base, "qd": qd, "fio": fio[key], "phx": phx[key], "ratio": ratio,
            "fio_spread": fio["spread"], "phx_spread": phx["spread"],
            "paired_ratios": paired, "paired_min": lo, "paired_max": hi,
            "inside_noise": noise, "ratio_at_every_qd": every_qd,
            "fio_best_qd": spec.qd is None,
            "status": "PASS" if ratio >= spec.threshold else "FAIL"}


def acceptance_checks(results: list[dict[str, Any]],
                      missing: dict[str, str] | None = None) -> list[dict[str, Any]]:
    """Issue 9's checks; ``missing`` maps a target that did not run to the reason."""
    missing = missing or {}
    return [evaluate_check(s, results, missing.get(s.target)) for s in CHECKS]


def _kib(v: float | None) -> str:
    return "n/a" if v is None else f"{v / KiB:.1f}k"


def print_table(results: list[dict[str, Any]], file=None) -> None:
    """The results as a text table, one line per row and engine."""
    file = file or sys.stdout
    def f(v, fmt):
        return "-" if v is None else format(v, fmt)
    rows = []
    for r in results:
        blk = r.get("blockdev")
        rows.append([r["op"], fmt_size(r["bs"]), r["qd"], r["engine"],
                     f(r.get("gbps"), ".3f"), f(r.get("iops"), ",.0f"),
                     "-" if r.get("spread") is None else f"{100 * r['spread']:.0f}%",
                     f(r.get("cpu_pct"), ".0f"), f(r.get("ratio_vs_fio"), ".3f"),
                     _kib(blk["avg_request_bytes"]) if blk else "n/a",
                     (f"{100 * blk['merge_ratio']:.0f}%" if blk and blk["merge_ratio"] is not None
                      else "n/a"),
                     r.get("error", "")[:60]])
    print(fmt_table(["op", "bs", "qd", "engine", "GB/s", "IOPS", "spread", "cpu%",
                     "ratio_vs_fio", "dev_req", "merged", "error"], rows), file=file)


def print_checks(checks: list[dict[str, Any]], file=None) -> None:
    """The acceptance checks: what was measured, the verdict, spreads and noise."""
    file = file or sys.stdout
    print("\nacceptance (issue 9, medians of this run; phx vs fio at its strongest):", file=file)
    for c in checks:
        if c.get("ratio") is None:
            print(f"  [{c['status']}] {c['check']}: {c.get('why', 'no phx figure')}", file=file)
            continue
        fmtv = ".3f" if c["unit"] == "GB/s" else ",.0f"
        if c["inside_noise"] is None:
            noise = (f"; {len(c['paired_ratios'])} paired repeat(s): too few to tell the noise"
                     if c["paired_ratios"] else "; repeats not paired, noise unknown")
        elif c["inside_noise"]:
            noise = (f"; repeat by repeat phx/fio {c['paired_min']:.3f}-{c['paired_max']:.3f}, "
                     f"both sides of {c['threshold']:g}: inside the noise")
        else:
            noise = (f"; repeat by repeat phx/fio {c['paired_min']:.3f}-{c['paired_max']:.3f}, "
                     f"all on one side of {c['threshold']:g}")
        print(f"  [{c['status']}] {c['check']}: {fmt_size(c['bs'])} QD {c['qd']}"
              f"{' (fio best)' if c['fio_best_qd'] else ''}: phx {c['phx']:{fmtv}} vs fio "
              f"{c['fio']:{fmtv}} {c['unit']} -> ratio {c['ratio']:.3f} (need >= "
              f"{c['threshold']:g}); spread phx {100 * c['phx_spread']:.0f}%, fio "
              f"{100 * c['fio_spread']:.0f}%{noise}", file=file)
        if len(c.get("ratio_at_every_qd", {})) > 1:
            print("        phx / fio at each QD: " + ", ".join(
                f"QD {q}: {v:.3f}" for q, v in sorted(c["ratio_at_every_qd"].items())),
                file=file)


def plot_path(path: str, label: str, first: bool) -> str:
    """Where a row set's plot goes: the first at ``path``, the zram rows beside it."""
    if first:
        return path
    root, ext = os.path.splitext(path)
    return f"{root}-{label}{ext or '.png'}"


def plot(results: list[dict[str, Any]], path: str, title: str) -> None:
    """Bars per queue depth, one colour per engine, one panel per (op, bs) measured."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = list(dict.fromkeys((r["op"], r["bs"]) for r in results))
    engines = list(dict.fromkeys(r["engine"] for r in results))
    colours = {"phx": "tab:blue", "phx-threads": "tab:purple", "fio": "tab:orange",
               "preadv": "tab:green", "phx-inline": "tab:cyan", "phx-spread": "tab:red"}
    ncols = min(3, len(panels))
    nrows = (len(panels) + ncols - 1) // ncols
    fig, axes = plt.subplots(nrows, ncols, squeeze=False,
                             figsize=(4.2 * ncols + 1, 2.9 * nrows + 0.8))
    width = 0.8 / max(1, len(engines))
    for n, (op, bs) in enumerate(panels):
        ax = axes[n // ncols][n % ncols]
        qds = sorted({r["qd"] for r in results if (r["op"], r["bs"]) == (op, bs)})
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
            ax.bar(xs, ys, width, yerr=[lo, hi], capsize=2, label=eng, color=colours.get(eng))
        ax.set_xticks(range(len(qds)), [f"QD {q}" for q in qds])
        ax.set_ylabel("kIOPS" if use_iops else "GB/s")
        ax.set_title(f"{op}, bs {fmt_size(bs)}", fontsize=10)
        ax.grid(axis="y", alpha=0.3)
        ax.margins(y=0.15)
    for n in range(len(panels), nrows * ncols):
        axes[n // ncols][n % ncols].set_visible(False)
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


@dataclass
class RowSet:
    """The rows measured on one filesystem: its results and where it was."""
    label: str
    target: Target
    storage: dict[str, Any]
    blockdev: _blockstat.BlockDevice | None
    blockdev_how: str
    results: list[dict[str, Any]] = field(default_factory=list)
    errors: dict[Any, str] = field(default_factory=dict)
    write_s: float = 0.0
    elapsed_s: float = 0.0
    zram: dict[str, Any] | None = None

    def describe(self) -> dict[str, Any]:
        return {"label": self.label, "path": self.target.path, "storage": self.storage,
                "blockdev": self.blockdev.describe() if self.blockdev else None,
                "blockdev_found_by": self.blockdev_how, "test_file_write_s": self.write_s,
                "elapsed_s": self.elapsed_s, "zram": self.zram}


def _label(blockdev: _blockstat.BlockDevice | None, storage: dict[str, Any]) -> str:
    if blockdev is not None and blockdev.kind == "zram":
        return "zram"
    return "disk" if blockdev is not None else storage.get("fstype", "disk")


def _make_runners(engines: list[str], path: str, size: int, seed: int, args,
                  submit_batch: int) -> dict[str, Any]:
    runners: dict[str, Any] = {}
    for e in engines:
        if e in ("phx", "phx-threads") or e in SPREAD_ENGINES:
            runners[e] = PhxEngine(path, size, seed, not args.no_register,
                                   "threads" if e == "phx-threads" else "uring",
                                   SPREAD_ENGINES.get(e))
        elif e == "fio":
            runners[e] = FioEngine(path, size, args.fio_args.split(), submit_batch)
        else:
            runners[e] = PreadvEngine(path, size, seed)
    return runners


def _measure(rs: RowSet, runners: dict[str, Any], rows: list[Row], engines: list[str],
             runtime: float, repeats: int, seed: int, bar) -> None:
    """Write the test file, then every row: repeats, the engines taking turns."""
    size = rs.target.size
    rs.write_s = write_test_file(rs.target.path, size, seed)
    drop_caches()
    print(f"phx bench io [{rs.label}]: {rs.target.path} ({rs.storage['fstype']} on "
          f"{rs.storage['device']}; device counters: "
          f"{rs.blockdev.stat_path if rs.blockdev else 'n/a, ' + rs.blockdev_how}), "
          f"{fmt_size(size)} of random data written in {rs.write_s:.1f} s", file=sys.stderr)
    samples: dict[Any, list[Sample]] = {}
    t0 = time.perf_counter()
    for row in rows:
        drop_caches()
        for rep in range(repeats):
            order = engines[rep % len(engines):] + engines[:rep % len(engines)]
            for e in order:
                bar.set_postfix_str(f"{rs.label} {row.op} {fmt_size(row.bs)} QD{row.qd} {e}")
                if (row.key, e) not in rs.errors:
                    try:
                        before = rs.blockdev.read() if rs.blockdev else None
                        with _no_gc():
                            s = runners[e].run(row.op, row.bs, row.qd, runtime)
                        if rs.blockdev is not None:
                            s.blk = rs.blockdev.read() - before
                        samples.setdefault((row.key, e), []).append(s)
                    except (OSError, RuntimeError, ValueError) as exc:
                        rs.errors[(row.key, e)] = f"{type(exc).__name__}: {exc}"
                bar.update(1)
    rs.elapsed_s = time.perf_counter() - t0
    rs.results = summarise(rows, engines, samples, rs.errors, rs.label,
                           None if rs.blockdev else rs.blockdev_how)


def _row_set(label: str | None, target: Target) -> RowSet:
    d = os.path.dirname(target.path)
    storage = storage_description(d)
    dev, how = _blockstat.device_for_path(d)
    return RowSet(label or _label(dev, storage), target, storage, dev, how)


def run(args: argparse.Namespace) -> int:
    """Run ``phx bench io`` with parsed ``args``; 0 on success, 1 if a run failed."""
    engines = list(dict.fromkeys(args.engines))
    rows = rows_from_args(args)
    runtime, repeats = timing_from_args(args)
    for bs in sorted({r.bs for r in rows}):
        if bs % 4096:
            raise BenchError(f"--bs {bs} is not a multiple of 4096 (O_DIRECT)")
        if bs > args.size:
            raise BenchError(f"--bs {fmt_size(bs)} exceeds --size")
    if args.size % 4096:
        raise BenchError("--size must be a multiple of 4096")
    if runtime <= 0:
        raise BenchError("--runtime must be positive")
    if args.zram is not None and args.zram < args.size * 1.1 + 64 * MiB:
        raise BenchError(f"--zram {fmt_size(args.zram)} is too small for a "
                         f"{fmt_size(args.size)} test file (need >= --size + 10% + 64m)")

    seed = args.seed if args.seed is not None else int.from_bytes(os.urandom(8), "little")
    submit_batch, submit_batch_source = phx_submit_batch()
    main_target = prepare_target(args.dir, args.size, args.keep)
    # A SIGTERM (e.g. from a CI timeout) unwinds like Ctrl-C: test files and zram go too.
    old_term = signal.signal(signal.SIGTERM, _terminate) \
        if threading.current_thread() is threading.main_thread() else None
    sets: list[RowSet] = []
    missing: dict[str, str] = {}
    try:
        with contextlib.ExitStack() as stack:
            stack.callback(main_target.remove)
            # Construct every engine before writing anything: a missing one fails fast.
            runners = _make_runners(engines, main_target.path, args.size, seed, args,
                                    submit_batch)
            main = _row_set(None, main_target)
            d = os.path.dirname(main_target.path)
            need_space(d, args.size + 64 * MiB, f"the {fmt_size(args.size)} test file")
            zram_why = None
            if args.zram is None:
                zram_why = "not asked for (--zram SIZE)"
            elif main.label == "zram":
                zram_why = "--dir is on zram already"
            else:
                zram_why = _zram.unavailable(args.zram)
            if args.zram is not None and zram_why:
                print(f"phx bench io: zram rows skipped: {zram_why}")
            n_sets = 1 if zram_why else 2
            if zram_why and main.label != "zram":
                missing["zram"] = f"zram rows not run: {zram_why}"
            if main.label != "disk":
                missing["disk"] = f"the --dir target is {main.label}, not a disk"
            est = estimate_seconds(len(rows), engines, repeats, runtime, args.size, n_sets)
            print(f"phx bench io: {len(rows)} rows x {len(engines)} engines x {repeats} repeats "
                  f"x {runtime:g} s on {n_sets} row set(s); about {est / 60:.0f} min "
                  f"(fio's --iodepth_batch_submit={submit_batch}, from {submit_batch_source})",
                  file=sys.stderr)
            load_start = os.getloadavg()
            t_start = time.perf_counter()
            bar = stack.enter_context(progress(len(rows) * len(engines) * repeats * n_sets,
                                               "bench io", enabled=not args.quiet,
                                               unit="run"))
            sets.append(main)
            _measure(main, runners, rows, engines, runtime, repeats, seed, bar)
            main_target.remove()
            if not zram_why:
                z = stack.enter_context(_zram.zram_ext4(args.zram))
                zt = prepare_target(z.mountpoint, args.size)  # goes with the device
                stack.callback(zt.remove)
                zs = _row_set("zram", zt)
                zs.zram = {"device": z.device, "disksize": z.disksize, "fs": "ext4",
                           "mountpoint": z.mountpoint}
                sets.append(zs)
                _measure(zs, _make_runners(engines, zt.path, args.size, seed, args,
                                           submit_batch),
                         rows, engines, runtime, repeats, seed, bar)
            elapsed = time.perf_counter() - t_start
            load_end = os.getloadavg()
    finally:
        if old_term is not None:
            signal.signal(signal.SIGTERM, old_term)

    results = [r for s in sets for r in s.results]
    checks = acceptance_checks(results, missing) if {"phx", "fio"} <= set(engines) else []
    for s in sets:
        print(f"\n== {s.label}: {s.storage['fstype']} on {s.storage['device']} "
              f"({s.storage['mount']}); device counters "
              f"{s.blockdev.name + ' (' + s.blockdev.kind + ')' if s.blockdev else 'n/a'} ==")
        print_table(s.results)
    if checks:
        print_checks(checks)
    fio_version = runners["fio"].version if "fio" in runners else "-"
    print(f"\n{fmt_size(args.size)} file; {os.cpu_count()} CPUs {cpu_model()}; {repeats} "
          f"repeats x {runtime:g} s per engine per row; {fio_version} with "
          f"--iodepth_batch_submit={submit_batch} (phx's submit_batch); {elapsed:.0f} s in all")
    print("dev_req: average device request size, merged: share of bios merged into another "
          "request (from /sys/block/<dev>/stat over the engine's runs; device-wide)")
    busy = max(load_start[0], load_end[0])
    if busy > (os.cpu_count() or 1):
        print(f"note: the machine was busy (load average {busy:.1f} on {os.cpu_count()} CPUs): "
              f"other work shared the CPUs and the disk; expect noisy figures")
    phx_runner = runners.get("phx")
    if phx_runner is not None and phx_runner.register and not phx_runner.registered:
        print(f"note: phx buffers could not be registered ({phx_runner.register_error}); "
              f"phx ran with plain READ/WRITE", file=sys.stderr)
    if phx_runner is not None and phx_runner.engine_config.get("submit_batch") not in (
            None, submit_batch):
        print(f"note: phx ran with submit_batch {phx_runner.engine_config['submit_batch']}, "
              f"fio with {submit_batch}", file=sys.stderr)
    n_errors = 0
    for s in sets:
        for (key, e), msg in s.errors.items():
            n_errors += 1
            print(f"error: [{s.label}] {e} {key[0]} {fmt_size(key[1])} QD{key[2]}: {msg}",
                  file=sys.stderr)
    if args.keep:
        print(f"phx bench io: kept the test file {main_target.path} (--keep)", file=sys.stderr)

    config = {
        "targets": [s.describe() for s in sets], "cpu_model": cpu_model(),
        "size": args.size, "rows": [list(r.key) for r in rows], "engines": engines,
        "runtime_s": runtime, "repeats": repeats, "seed": seed,
        "elapsed_s": elapsed, "loadavg_start": load_start, "loadavg_end": load_end,
        "zram": {"asked": args.zram, "skipped": zram_why if args.zram is not None else None},
        "pattern": ("sequential: from offset 0 in bs steps, wrapping; random: uniform "
                    "bs-aligned offsets with replacement, fresh each run (fio "
                    "--randrepeat=0 --norandommap); writes overwrite the read file in place "
                    "with random data and end with an fsync inside the timed region"),
        "ratio_vs_fio": "median GB/s of the engine / median GB/s of fio in the same row",
        "spread": "(max - min) / median of the repeats' GB/s",
        "blockdev": ("diff of /sys/block/<dev>/stat around each run, summed over the "
                     "repeats; device-wide (other I/O on the device is in it too)"),
    }
    if "fio" in runners:
        config["fio"] = {"version": runners["fio"].version, "submit_batch": submit_batch,
                         "submit_batch_source": submit_batch_source,
                         "extra_args": args.fio_args.split(),
                         "example": shlex.join(runners["fio"].command("randread", 4 * KiB,
                                                                      32, runtime)),
                         "note": "every fio row's exact argv is its record's fio_argv"}
    if phx_runner is not None:
        config["phx"] = {"version": phx_runner.version, "registered_buffers": phx_runner.registered,
                         "engine_config_last_run": phx_runner.engine_config,
                         "engine_features_last_run": phx_runner.engine_features,
                         "batch": f"pread_batch/pwrite_batch of >= max(16 x QD, ~"
                                  f"{PhxEngine.BATCH_SECONDS * 1000:.0f} ms of work) requests"}
    write_json(args.json, {"benchmark": "io", "config": config, "rows": results,
                           "checks": checks})
    if args.plot:
        for i, s in enumerate(sets):
            plot(s.results, plot_path(args.plot, s.label, i == 0),
                 f"phx bench io [{s.label}]: {fmt_size(args.size)} file, {s.storage['fstype']} "
                 f"on {s.storage['device']}, {os.cpu_count()} CPUs {cpu_model()}")
    if not any(r.get("gbps") is not None for r in results):
        print("phx bench io: nothing was measured", file=sys.stderr)
        return 1
    return 1 if n_errors else 0
