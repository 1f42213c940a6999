"""``phx bench gpu --pattern stream``: phx's stream-ordered (cuFile-style) GPU
I/O driven the way serving stacks (LMCache, vLLM) drive it, beside the
strongest alternatives, in one run.

Workload, for each ``--stream-chunks`` size and each device directory
(``--dir``, plus the zram filesystem ``--zram SIZE`` builds): a file of fresh
random bytes, the distinct chunk-aligned blocks covering ``--chunk-bytes`` in
a random order, each to (reads) or from (stores) a distinct place of one
torch uint8 CUDA tensor.  Page cache dropped before every row; rows in a new
random order each repeat; ``--repeat`` times (median and spread).

Rows (GB/s; stores end with an fsync for every method):

* ``phx-stream-1``  one thread, one ``torch.cuda.Stream``: per chunk
  ``phx.gpu.read_async`` (stores: ``write_async``) and, after each read, a
  small kernel on the same stream that depends on the chunk's data
  (``view[:4096].sum()``, as LMCache does after each load); timed from the
  first submission until ``stream.synchronize()`` returns.
* ``phx-stream-N``  N threads (``--stream-threads``), a stream each, a share
  of the chunks each, released together; all bytes / (common start until
  the last stream is synchronised).
* ``phx-stream-c-N`` the same ops (N = 1 and ``--stream-threads``) queued by
  each thread in one call that never holds the GIL
  (``Context.stream_loop``), as a C or C++ server's threads would; after
  each read, instead of the kernel, a copy of the chunk's first 4 KiB to
  pinned host memory on the same stream (work that needs the chunk,
  checked the same way).  Beside ``phx-stream-N`` it tells phx's own
  scaling over streams from the Python harness's (eight Python threads
  share one GIL).
* ``phx-batch``     ``phx.gpu.read_chunks`` / ``write_chunks``, one call.
* ``pool-K``        the host-staged pool people write by hand (``--pool-threads``):
  K threads, each with two pinned host buffers and its own stream, chunks
  from a shared queue; O_DIRECT ``preadv`` into one buffer while the other
  is copied to the GPU (stores: the GPU -> pinned copy of the next chunk
  while this one is ``pwritev``'d).
* ``kvikio``        KvikIO ``CuFile.pread/pwrite``, one future per chunk, in
  compatibility mode, at each ``--kvikio-threads`` count (best reported).

Every row is checked byte for byte: reads on every repeat (the GPU tensor,
zeroed before the row, against the file's bytes; for the stream rows also
the sums the dependent kernels computed), stores on the last repeat (the
file, read back, against the source tensor, refilled with fresh random bytes
before every store row).  A mismatch or an error is printed loudly and
recorded (``"verified": false``).  For the phx rows the report gives
``phx.gpu.stats()`` deltas (``*_ns``, ``stream_*``, ``early_*``) per op.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import queue
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from phx.bench import gpu as _g
from phx.bench._common import BenchError, checked, csv, positive_int, positive_size
from phx.bench._common import (drop_caches, fmt_table, median_spread, parse_size,
                               progress, write_json)

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
#: O_DIRECT alignment the chunks and the pool's pinned buffers keep
ALIGN = 4096
#: bytes of each chunk the dependent kernel after a stream read sums
PROBE = 4096
#: method families ``--stream-methods`` chooses among
FAMILIES = ("stream", "stream-c", "batch", "pool", "kvikio")
KVIKIO_THREADS = "16,64"


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The stream pattern's own options (gpu.py's --dir, --zram, --chunk-bytes,
    --repeat, --ops, --kvikio-threads, --devices, --json, --plot and --quiet
    apply too)."""
    g = p.add_argument_group("--pattern stream")
    g.add_argument("--stream-chunks", type=checked(csv(positive_size)), default="1M,4M,16M,32M",
                   help="chunk sizes of the stream pattern (default 1M,4M,16M,32M)")
    g.add_argument("--stream-threads", type=checked(csv(positive_int)), default="2,4,8",
                   help="thread (stream) counts of the phx-stream-N rows besides 1 "
                        "(default 2,4,8)")
    g.add_argument("--pool-threads", type=checked(csv(positive_int)), default="8",
                   help="thread counts of the host-staged pool rows (default 8)")
    g.add_argument("--stream-methods", type=checked(csv(str, allowed=FAMILIES)),
                   default=",".join(FAMILIES),
                   help="comma list of stream,stream-c,batch,pool,kvikio (default all)")


# ---------------------------------------------------------------------------
# options and the workload
# ---------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Options:
    """The stream pattern's parsed, checked options."""
    chunks: list[int]
    chunk_bytes: int
    file_bytes: int
    threads: list[int]        # phx-stream-N, 1 first
    pool_threads: list[int]
    kvikio_threads: list[int]
    ops: list[str]
    methods: list[str]
    repeat: int


def _counts(text: str, what: str) -> list[int]:
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"{what} {text!r}: a comma list of whole numbers") from None
    if not out or min(out) < 1:
        raise ValueError(f"{what} {text!r}: want one or more counts >= 1")
    return sorted(set(out))


def _words(text: str, allowed: Sequence[str], what: str) -> list[str]:
    out = [w.strip() for w in text.split(",") if w.strip()]
    bad = [w for w in out if w not in allowed]
    if not out or bad:
        raise ValueError(f"{what} {text!r}: want a comma list of {','.join(allowed)}")
    return out


def file_bytes(chunk_bytes: int, chunks: Sequence[int]) -> int:
    """Size of the files (and GPU tensors): every chunk size gets
    ``ceil(chunk_bytes / chunk)`` distinct blocks out of it."""
    return max(-(-chunk_bytes // c) * c for c in chunks)


def options(args: argparse.Namespace) -> Options:
    """Parse and check the options; ValueError says what is wrong."""
    chunks = sorted({parse_size(c) for c in args.stream_chunks.split(",") if c.strip()})
    if not chunks or any(c <= 0 or c % ALIGN for c in chunks):
        raise ValueError(f"--stream-chunks {args.stream_chunks!r}: want sizes that are "
                         f"multiples of {ALIGN} (O_DIRECT)")
    chunk_bytes = parse_size(args.chunk_bytes)
    if chunk_bytes <= 0:
        raise ValueError(f"--chunk-bytes {args.chunk_bytes!r}: want more than 0")
    if args.repeat < 1:
        raise ValueError(f"--repeat {args.repeat}: want 1 or more")
    threads = sorted({1, *_counts(args.stream_threads, "--stream-threads")})
    return Options(
        chunks=chunks, chunk_bytes=chunk_bytes, file_bytes=file_bytes(chunk_bytes, chunks),
        threads=threads,
        pool_threads=_counts(args.pool_threads, "--pool-threads"),
        # gpu.py's flag: its own default (4,16,64) is for seq/chunks
        kvikio_threads=_counts(args.kvikio_threads or KVIKIO_THREADS, "--kvikio-threads"),
        ops=_words(args.ops, ("read", "write"), "--ops"),
        methods=_words(args.stream_methods, FAMILIES, "--stream-methods"),
        repeat=args.repeat)


def chunk_list(file_size: int, chunk: int, chunk_bytes: int, seed: int) -> _g.Pattern:
    """``ceil(chunk_bytes / chunk)`` distinct chunk-aligned blocks of a file of
    ``file_size`` in a random order -> as many distinct chunk-aligned places
    of the GPU tensor, in another random order (gpu.py's chunk pattern)."""
    n = -(-chunk_bytes // chunk)
    if n * chunk > file_size:
        raise ValueError(f"{n} chunks of {chunk} do not fit a {file_size}-byte file")
    return _g.chunk_pattern(file_size, chunk, n * chunk, seed)


@dataclasses.dataclass
class Method:
    """One row kind: its name, family, op, thread count and the call that
    moves ``pat`` between ``path`` and ``gpu`` and returns (seconds, probes)."""
    name: str
    family: str
    op: str
    chunk: int
    threads: int | None
    fn: Callable[..., tuple[float, list]]


def plan(opts: Options, stream_ok: bool, have_kvikio: bool, eng: Any) -> list[Method]:
    """Every row of one device directory, in a fixed order (shuffled per repeat)."""
    rows: list[Method] = []
    for chunk in opts.chunks:
        for op in opts.ops:
            w = op == "write"
            if "stream" in opts.methods and stream_ok:
                for n in opts.threads:
                    rows.append(Method(
                        f"phx-stream-{n}", "stream", op, chunk, n,
                        lambda p, g, pat, n=n, w=w: phx_stream(p, g, pat, w, n, eng)))
            if "stream-c" in opts.methods and stream_ok:
                for n in opts.threads:
                    rows.append(Method(
                        f"phx-stream-c-{n}", "stream-c", op, chunk, n,
                        lambda p, g, pat, n=n, w=w: phx_stream_c(p, g, pat, w, n, eng)))
            if "batch" in opts.methods:
                rows.append(Method("phx-batch", "batch", op, chunk, None,
                                   lambda p, g, pat, w=w: phx_batch(p, g, pat, w, eng)))
            if "pool" in opts.methods:
                for n in opts.pool_threads:
                    rows.append(Method(f"pool-{n}", "pool", op, chunk, n,
                                       lambda p, g, pat, n=n, w=w: pool(p, g, pat, w, n)))
            if "kvikio" in opts.methods and have_kvikio:
                for n in opts.kvikio_threads:
                    rows.append(Method("kvikio", "kvikio", op, chunk, n,
                                       lambda p, g, pat, n=n, w=w: kvikio_chunks(p, g, pat, w, n)))
    return rows


# ---------------------------------------------------------------------------
# methods: each moves pat.total bytes and returns (seconds, probes); probes
# are (chunk index, 0-dim GPU tensor) from the stream reads' dependent kernels
# ---------------------------------------------------------------------------

def _short(what: str, got: int, want: int, offset: int) -> RuntimeError:
    return RuntimeError(f"{what}: moved {got} of {want} bytes at file offset {offset}")


def _shares(n: int, threads: int) -> list[list[int]]:
    """Every ``threads``-th chunk index per thread (threads with none left out)."""
    return [s for s in (list(range(i, n, threads)) for i in range(threads)) if s]


def _stream_binder(dev: Any, streams: list[Any]) -> Callable[[int], None]:
    """``fan_out``'s bind: thread i makes its own stream on ``dev``
    (before the common start, in the thread that uses it)."""
    import torch

    def bind(i: int) -> None:
        torch.cuda.set_device(dev)
        streams[i] = torch.cuda.Stream(device=dev)
    return bind


def phx_stream(path: str, gpu, pat: _g.Pattern, write: bool, threads: int,
               eng: Any) -> tuple[float, list]:
    """``threads`` threads, each with its own stream and its own share of the
    chunks: ``read_async`` + a dependent kernel per chunk (``write_async``
    for stores); from the common start until the last stream is synchronised
    (+ the fsync for stores).  Every op's result is checked afterwards."""
    import phx
    import phx.gpu
    import torch
    chunk = pat.piece
    foffs, boffs = pat.foffs.tolist(), pat.boffs.tolist()
    shares = _shares(len(foffs), threads)
    streams: list[Any] = [None] * len(shares)
    done: list[list[tuple[int, Any, Any]]] = [[] for _ in shares]
    bind = _stream_binder(gpu.device, streams)

    def body(f, i: int) -> None:
        s = streams[i]
        try:
            with torch.cuda.stream(s):
                for k in shares[i]:
                    view = gpu[boffs[k]:boffs[k] + chunk]
                    if write:
                        done[i].append((k, phx.gpu.write_async(view, f, foffs[k], stream=s), None))
                    else:
                        op = phx.gpu.read_async(view, f, foffs[k], stream=s)
                        # real GPU work that needs the chunk, queued behind its read
                        done[i].append((k, op, view[:PROBE].sum()))
        finally:
            s.synchronize()     # also after an error: nothing left in flight on close

    with phx.open(path, "r+" if write else "r", engine=eng) as f:
        dt = _g.fan_out(body, [(f, i) for i in range(len(shares))], bind)
        if write:
            t = time.perf_counter()
            f.fsync()
            dt += time.perf_counter() - t
        ops = [x for d in done for x in d]
        for k, op, _ in ops:
            n = op.result(timeout=60)       # the stream has passed it: no wait
            if n != chunk:
                raise _short(f"phx-stream-{threads}", n, chunk, foffs[k])
    if len(ops) != len(foffs):
        raise RuntimeError(f"phx-stream-{threads}: {len(ops)} of {len(foffs)} ops queued")
    return dt, [(k, p) for k, _, p in ops if p is not None]


def _d2h_address() -> int:
    """The address of the driver's ``cuMemcpyDtoHAsync_v2`` (libcuda.so.1:
    the library libphx and torch loaded)."""
    import ctypes
    lib = ctypes.CDLL("libcuda.so.1")
    addr = ctypes.cast(lib.cuMemcpyDtoHAsync_v2, ctypes.c_void_p).value
    assert addr
    return addr


def phx_stream_c(path: str, gpu, pat: _g.Pattern, write: bool, threads: int,
                 eng: Any) -> tuple[float, list]:
    """``phx_stream``'s shares, streams and timing, but each thread queues all
    its ops in one ``Context.stream_loop`` call that never holds the GIL;
    after each read a device-to-host copy of the chunk's first PROBE bytes
    on the same stream.  Probes come back as (chunk index, sum on the GPU)
    for :func:`compare_probes`."""
    import numpy as np
    import phx
    import phx.gpu as pg
    import torch
    chunk, n = pat.piece, len(pat.foffs)
    shares = _shares(n, threads)
    order = np.concatenate([np.asarray(sh, dtype=np.int64) for sh in shares])
    starts = np.cumsum([0] + [len(sh) for sh in shares]).tolist()
    # rows of [size, file offset, GPU offset, bytes done], each thread's contiguous
    args = np.empty((n, 4), dtype=np.int64)
    args[:, 0] = chunk
    args[:, 1] = np.asarray(pat.foffs, dtype=np.int64)[order]
    args[:, 2] = np.asarray(pat.boffs, dtype=np.int64)[order]
    args[:, 3] = -1
    probe_t, probe = (None, None) if write else _pinned(n * PROBE)
    d2h = 0 if write else _d2h_address()
    streams: list[Any] = [None] * len(shares)
    dev = gpu.device
    bind = _stream_binder(dev, streams)

    with phx.open(path, "r+" if write else "r", engine=eng) as f:
        view = pg._view(gpu, f.path)
        ctx = pg._ctx_for(f, view)

        def body(i: int) -> None:
            s = streams[i]
            lo, hi = starts[i], starts[i + 1]
            try:
                ctx.stream_loop(f._c_file, view.ptr, args.ctypes.data + lo * args.strides[0],
                                hi - lo, write, s.cuda_stream, d2h,
                                0 if probe is None else probe.ctypes.data + lo * PROBE, PROBE)
            finally:
                s.synchronize()     # also after an error: nothing left in flight on close

        dt = _g.fan_out(body, [(i,) for i in range(len(shares))], bind)
        if write:
            t = time.perf_counter()
            f.fsync()
            dt += time.perf_counter() - t
    short = np.flatnonzero(args[:, 3] != chunk)
    if short.size:
        k = int(short[0])
        raise _short(f"phx-stream-c-{threads}", int(args[k, 3]), chunk, int(args[k, 1]))
    if probe is None:
        return dt, []
    sums = probe_t.view(n, PROBE).to(dev).sum(dim=1)
    return dt, [(int(order[p]), sums[p]) for p in range(n)]


def phx_batch(path: str, gpu, pat: _g.Pattern, write: bool, eng: Any) -> tuple[float, list]:
    """One ``read_chunks`` / ``write_chunks`` call (host-async, batched)."""
    import phx
    import phx.gpu
    with phx.open(path, "r+" if write else "r", engine=eng) as f:
        t0 = time.perf_counter()
        call = phx.gpu.write_chunks if write else phx.gpu.read_chunks
        got = call(gpu, f, pat.foffs, pat.boffs, pat.sizes)
        if write:
            f.fsync()
        dt = time.perf_counter() - t0
    for fo, n in zip(pat.foffs.tolist(), got):
        if n != pat.piece:
            raise _short("phx-batch", n, pat.piece, fo)
    if len(got) != len(pat.foffs):
        raise RuntimeError(f"phx-batch: {len(got)} results for {len(pat.foffs)} chunks")
    return dt, []


def _pinned(n: int):
    """A pinned host tensor of ``n`` bytes at an O_DIRECT-aligned address, and
    a numpy view of it for ``os.preadv``/``pwritev``."""
    import torch
    t = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    if t.data_ptr() % ALIGN:        # cudaHostAlloc memory is page-aligned; be sure
        raw = torch.empty(n + ALIGN, dtype=torch.uint8, pin_memory=True)
        k = -raw.data_ptr() % ALIGN
        t = raw[k:k + n]
    return t, t.numpy()


def pool(path: str, gpu, pat: _g.Pattern, write: bool, threads: int) -> tuple[float, list]:
    """The hand-written host-staged pool: ``threads`` threads, two pinned
    buffers, a stream and two events each, chunks from a shared queue.
    Reads: ``preadv`` (O_DIRECT) into one buffer while the other's copy to
    the GPU runs; a buffer is refilled only once its copy is done.  Stores:
    the next chunk's GPU -> pinned copy runs while this one is
    ``pwritev``'d; fsync at the end."""
    import torch
    chunk = pat.piece
    foffs, boffs = pat.foffs.tolist(), pat.boffs.tolist()
    work: queue.SimpleQueue[int] = queue.SimpleQueue()
    for k in range(len(foffs)):
        work.put(k)
    nthreads = min(threads, len(foffs))
    state: list[dict[str, Any]] = [{} for _ in range(nthreads)]
    dev = gpu.device

    def bind(i: int) -> None:
        torch.cuda.set_device(dev)
        state[i] = {"stream": torch.cuda.Stream(device=dev),
                    "bufs": [_pinned(chunk) for _ in range(2)],
                    "events": [torch.cuda.Event() for _ in range(2)]}

    def take() -> int | None:
        try:
            return work.get_nowait()
        except queue.Empty:
            return None

    def read_body(fd: int, i: int) -> None:
        s, bufs, evs = state[i]["stream"], state[i]["bufs"], state[i]["events"]
        used = [False, False]
        b = 0
        try:
            with torch.cuda.stream(s):
                while (k := take()) is not None:
                    if used[b]:
                        evs[b].synchronize()    # its last copy to the GPU is done
                    n = os.preadv(fd, [bufs[b][1]], foffs[k])
                    if n != chunk:
                        raise _short(f"pool-{threads}", n, chunk, foffs[k])
                    gpu[boffs[k]:boffs[k] + chunk].copy_(bufs[b][0], non_blocking=True)
                    evs[b].record(s)
                    used[b] = True
                    b ^= 1
        finally:
            s.synchronize()

    def write_body(fd: int, i: int) -> None:
        s, bufs, evs = state[i]["stream"], state[i]["bufs"], state[i]["events"]
        prev: tuple[int, int] | None = None     # (buffer, chunk index) copied, not yet written
        b = 0
        try:
            with torch.cuda.stream(s):
                while True:
                    k = take()
                    if k is not None:
                        # bufs[b] was written out (synchronously) two steps ago
                        bufs[b][0].copy_(gpu[boffs[k]:boffs[k] + chunk], non_blocking=True)
                        evs[b].record(s)
                    if prev is not None:
                        pb, pk = prev
                        evs[pb].synchronize()   # its bytes are in pinned memory
                        n = os.pwritev(fd, [bufs[pb][1]], foffs[pk])
                        if n != chunk:
                            raise _short(f"pool-{threads}", n, chunk, foffs[pk])
                    if k is None:
                        break
                    prev = (b, k)
                    b ^= 1
        finally:
            s.synchronize()

    fd = os.open(path, (os.O_RDWR if write else os.O_RDONLY) | os.O_DIRECT)
    try:
        dt = _g.fan_out(write_body if write else read_body,
                        [(fd, i) for i in range(nthreads)], bind)
        if write:
            t = time.perf_counter()
            os.fsync(fd)
            dt += time.perf_counter() - t
    finally:
        os.close(fd)
    if not work.empty():
        raise RuntimeError(f"pool-{threads}: chunks left in the queue")
    return dt, []


def kvikio_chunks(path: str, gpu, pat: _g.Pattern, write: bool,
                  threads: int) -> tuple[float, list]:
    """KvikIO compat mode, ``threads`` in its pool, one future per chunk."""
    kvikio = _g._kvikio_threads(threads)
    chunk = pat.piece
    foffs, boffs = pat.foffs.tolist(), pat.boffs.tolist()
    f = kvikio.CuFile(path, "r+" if write else "r")
    try:
        t0 = time.perf_counter()
        call = f.pwrite if write else f.pread
        futs = [call(gpu[bo:bo + chunk], chunk, fo) for fo, bo in zip(foffs, boffs)]
        got = [fu.get() for fu in futs]
        if write:
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        dt = time.perf_counter() - t0
    finally:
        f.close()
    for fo, n in zip(foffs, got):
        if n != chunk:
            raise _short(f"kvikio-{threads}t", n, chunk, fo)
    return dt, []


# ---------------------------------------------------------------------------
# checks
# ---------------------------------------------------------------------------

def _file_on_gpu(path: str, device):
    """The file's bytes (as the filesystem returns them now) in GPU memory."""
    import numpy as np
    import torch
    return torch.from_numpy(np.fromfile(path, dtype=np.uint8)).to(device)


def compare(file_t, gpu_t, pat: _g.Pattern) -> str | None:
    """None if every chunk's bytes in the file (``file_t``, on the GPU) equal
    its place in ``gpu_t``; else which chunk differs."""
    import torch
    c = pat.piece
    for fo, bo in zip(pat.foffs.tolist(), pat.boffs.tolist()):
        if not torch.equal(file_t[fo:fo + c], gpu_t[bo:bo + c]):
            return f"the {c}-byte chunk at file offset {fo} (GPU offset {bo}) differs"
    return None


def compare_probes(file_t, pat: _g.Pattern, probes: list) -> str | None:
    """None if each dependent kernel's sum equals the sum of its chunk's
    first PROBE bytes in the file: the kernel ran after the data was there."""
    import torch
    if not probes:
        return None
    c = pat.piece
    want = torch.stack([file_t[int(pat.foffs[k]):int(pat.foffs[k]) + PROBE].sum()
                        for k, _ in probes])
    got = torch.stack([p for _, p in probes])
    if torch.equal(got, want):
        return None
    bad = int((got != want).nonzero()[0].item())
    k = probes[bad][0]
    return (f"the kernel queued after the read of file offset {int(pat.foffs[k])} "
            f"({c}-byte chunk) summed {int(got[bad])}, the file's bytes sum to {int(want[bad])}: "
            "it ran before the data was in place")


# ---------------------------------------------------------------------------
# counters
# ---------------------------------------------------------------------------

def counter_keys(stats: dict[str, int]) -> list[str]:
    """phx.gpu.stats() keys that say where a stream op's time goes."""
    return sorted(k for k in stats if k.endswith("_ns") or k.startswith(("stream_", "early_")))


def counter_delta(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    return {k: int(after[k]) - int(before.get(k, 0)) for k in counter_keys(after)}


def per_op(counters: dict[str, int], ops: int) -> dict[str, float]:
    """Each counter per op: ``*_ns`` in microseconds, the others as counts."""
    if ops <= 0:
        return {}
    return {(k[:-3] + "_us" if k.endswith("_ns") else k):
            (v / ops / 1e3 if k.endswith("_ns") else v / ops)
            for k, v in counters.items()}


# ---------------------------------------------------------------------------
# the run
# ---------------------------------------------------------------------------

def suffixed(path: str | None, tag: str) -> str | None:
    """``out.json`` -> ``out-stream.json`` (None stays None)."""
    if not path:
        return path
    root, ext = os.path.splitext(path)
    return f"{root}{tag}{ext}"


def run(args: argparse.Namespace, others: list[str], classic: Callable[[Any], int]) -> int:
    """gpu.py's entry for ``--pattern`` lists naming ``stream``: the other
    patterns first (``classic``), then this one; with both, this one's JSON
    and plot go to ``-stream``-suffixed paths."""
    try:
        opts = options(args)
    except ValueError as e:
        print(f"phx bench gpu: {e}", file=sys.stderr)
        return 2
    ok, why = _g._gpu_ok()
    if not ok:
        raise BenchError(f"no GPU here ({why}); nothing measured")
    rc = 0
    json_path, plot_path = args.json, args.plot
    if others:
        sub = argparse.Namespace(**vars(args))
        sub.pattern = ",".join(others)
        rc = classic(sub)
        json_path, plot_path = suffixed(args.json, "-stream"), suffixed(args.plot, "-stream")
    return max(rc, measure(args, opts, json_path, plot_path))


@dataclasses.dataclass
class _Acc:
    """What the repeats of one row gathered."""
    runs: list[float] = dataclasses.field(default_factory=list)
    errors: list[str] = dataclasses.field(default_factory=list)
    checks: int = 0
    counters: dict[str, int] = dataclasses.field(default_factory=dict)
    ops: int = 0


def _loud(msg: str) -> None:
    print(f"\nphx bench gpu: !!! {msg}", file=sys.stderr, flush=True)


def measure(args: argparse.Namespace, opts: Options, json_path: str | None,
            plot_path: str | None) -> int:
    """Run every row; print the report; 1 if any row failed or mismatched."""
    import numpy as np
    import phx
    import phx.gpu
    import torch
    if os.geteuid() != 0:
        print("phx bench gpu: not root: page cache cannot be dropped, rows are warm",
              file=sys.stderr)
    try:
        devs = _g.parse_devices(args.devices, torch.cuda.device_count())
    except ValueError as e:
        print(f"phx bench gpu: {e}", file=sys.stderr)
        return 2
    dev = devs[0]
    if len(devs) > 1:
        print(f"phx bench gpu: the stream pattern runs on one GPU: cuda:{dev}", file=sys.stderr)
    torch.cuda.set_device(dev)
    device = torch.device("cuda", dev)
    skipped: dict[str, str] = {}
    have_kvikio = False
    if "kvikio" in opts.methods:
        os.environ.setdefault("KVIKIO_COMPAT_MODE", "ON")
        try:
            import kvikio  # noqa: F401
            have_kvikio = True
        except Exception as e:  # noqa: BLE001
            skipped["kvikio"] = f"KvikIO unavailable ({e})"
    eng = phx.Engine()
    staging = dict(phx.gpu.context(eng, dev).config)   # made before any row is timed
    stream_ok = bool(staging.get("memops", True))
    if {"stream", "stream-c"} & set(opts.methods) and not stream_ok:
        why = staging.get("stream_ops_why") or "no stream memory operations"
        skipped["phx-stream"] = f"no stream-ordered ops here: {why}"
    for what, why in skipped.items():
        print(f"phx bench gpu: {what} rows skipped: {why}", file=sys.stderr)
    rows = plan(opts, stream_ok, have_kvikio, eng)
    pats = {c: chunk_list(opts.file_bytes, c, opts.chunk_bytes, seed=c) for c in opts.chunks}
    dirs = [(d, "disk") for d in (args.dir or [os.environ.get("PHX_BENCH_DIR", ".")])]
    env = {k: v for k, v in sorted(os.environ.items()) if k.startswith("PHX_CUDA_")}
    # reads land in dst (zeroed before each row); stores send src (fresh
    # random bytes before each row): a method that moved nothing fails its check
    dst = torch.zeros(opts.file_bytes, dtype=torch.uint8, device=device)
    src = torch.empty(opts.file_bytes, dtype=torch.uint8, device=device)
    results: list[dict[str, Any]] = []
    zram = None
    try:
        if args.zram:
            zram = _g._zram_up(args.zram)
            dirs.append((zram[0], "zram"))
        bar = progress(len(rows) * len(dirs) * opts.repeat, "bench gpu stream", not args.quiet)
        for d, where in dirs:
            rpath = os.path.join(d, "phx-bench-stream.bin")
            wpath = os.path.join(d, "phx-bench-stream-w.bin")
            _g._make_file(rpath, opts.file_bytes, seed=21)
            _g._make_file(wpath, opts.file_bytes, seed=22)
            try:
                ref = _file_on_gpu(rpath, device)     # the read file never changes
                fs = _g._fs_of(rpath)
                accs = [_Acc() for _ in rows]
                for rep in range(opts.repeat):
                    # a fresh order each repeat: no row always follows another's writes
                    for i in np.random.default_rng(rep).permutation(len(rows)).tolist():
                        m = rows[i]
                        bar.set_postfix_str(f"{where} {m.op} {label(m.chunk)} {m.name}"
                                            + (f" {m.threads}t" if m.family == "kvikio" else ""))
                        _one_row(m, accs[i], pats[m.chunk], where, rpath, wpath, ref, dst, src,
                                 eng, last=rep == opts.repeat - 1)
                        bar.update(1)
                for m, a in zip(rows, accs):
                    results.append(_row_result(m, a, where, fs))
                del ref
            finally:
                for p in (rpath, wpath):
                    if os.path.exists(p) and not args.keep:
                        os.unlink(p)
        bar.close()
    finally:
        if zram:
            _g._zram_down(*zram)
    meta = {"gpu": torch.cuda.get_device_name(dev), "device_index": dev,
            "chunk_bytes": opts.chunk_bytes, "file_bytes": opts.file_bytes,
            "repeat": opts.repeat, "env": env, "staging": staging, "skipped": skipped}
    print(report(results, meta))
    save(json_path, results, meta)
    if plot_path:
        plot(results, plot_path)
    if not results:
        print("phx bench gpu: nothing was measured", file=sys.stderr)
        return 1
    return 1 if any(r["verified"] is not True for r in results) else 0


def _one_row(m: Method, acc: _Acc, pat: _g.Pattern, where: str, rpath: str, wpath: str,
             ref, dst, src, eng, last: bool) -> None:
    """One repeat of one row: prepare, drop caches, time, check."""
    import phx.gpu
    import torch
    write = m.op == "write"
    what = f"{m.name}{f' {m.threads}t' if m.family == 'kvikio' else ''} {m.op} " \
           f"{label(m.chunk)} on {where}"
    if write:
        src.random_(0, 256)
    else:
        dst.zero_()
    torch.cuda.synchronize()        # the preparation is done before any method's stream starts
    drop_caches()
    phx_row = m.family in ("stream", "stream-c", "batch")
    c0 = phx.gpu.stats(eng) if phx_row else {}
    try:
        dt, probes = m.fn(wpath if write else rpath, src if write else dst, pat)
    except Exception as e:  # noqa: BLE001 - recorded and shown, the other rows go on
        acc.errors.append(f"{type(e).__name__}: {e}")
        _loud(f"ERROR in {what}: {type(e).__name__}: {e}")
        return
    if phx_row:
        for k, v in counter_delta(c0, phx.gpu.stats(eng)).items():
            acc.counters[k] = acc.counters.get(k, 0) + v
        acc.ops += len(pat.foffs)
    acc.runs.append(pat.total / dt / 1e9)
    # reads: every repeat (GPU-side, cheap); stores: the last one (a read-back)
    if not write:
        bad = compare(ref, dst, pat) or compare_probes(ref, pat, probes)
    elif last:
        drop_caches()               # the file as the device has it
        got = _file_on_gpu(wpath, dst.device)
        bad = compare(got, src, pat)
        del got
    else:
        return
    acc.checks += 1
    if bad:
        acc.errors.append(f"mismatch: {bad}")
        _loud(f"WRONG BYTES in {what}: {bad}")


def _row_result(m: Method, a: _Acc, where: str, fs: str) -> dict[str, Any]:
    med, spread = median_spread(a.runs) if a.runs else (None, None)
    return {"method": m.name, "family": m.family, "device": where, "fs": fs, "op": m.op,
            "chunk": m.chunk, "threads": m.threads, "runs_gbps": a.runs,
            "median_gbps": med, "spread": spread,
            "verified": bool(a.checks) and not a.errors, "errors": a.errors,
            "counters": a.counters if m.family in ("stream", "stream-c", "batch") else None,
            "counter_ops": a.ops, "counters_per_op": per_op(a.counters, a.ops) or None}


# ---------------------------------------------------------------------------
# report
# ---------------------------------------------------------------------------

def _ok(r: dict[str, Any]) -> bool:
    return r.get("median_gbps") is not None


def _best(rows: list[dict[str, Any]], pred: Callable[[dict[str, Any]], bool]) -> dict | None:
    c = [r for r in rows if _ok(r) and pred(r)]
    return max(c, key=lambda r: r["median_gbps"]) if c else None


def _groups(results: list[dict[str, Any]]) -> list[tuple[str, str, int]]:
    seen: list[tuple[str, str, int]] = []
    for r in results:
        key = (r["device"], r["op"], r["chunk"])
        if key not in seen:
            seen.append(key)
    return seen


def _div(a: dict | None, b: dict | None) -> float | None:
    if a is None or b is None or not b["median_gbps"]:
        return None
    return a["median_gbps"] / b["median_gbps"]


def _worst_n(rows: list[dict[str, Any]], family: str,
             one: dict | None) -> tuple[float | None, int | None]:
    """The lowest (ratio, N) of a family's N > 1 rows to its one-thread row."""
    sn = [(_div(r, one), r["threads"]) for r in rows
          if _ok(r) and r["family"] == family and r["threads"] != 1]
    sn = [x for x in sn if x[0] is not None]
    return min(sn) if sn else (None, None)


def ratios(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per device, op and chunk: phx-stream-1 against phx-batch, the best
    pool and the best KvikIO; the slowest phx-stream-N against phx-stream-1;
    the best phx row against the best KvikIO.  None where a side is missing."""
    out = []
    for dev, op, chunk in _groups(results):
        rows = [r for r in results if (r["device"], r["op"], r["chunk"]) == (dev, op, chunk)]
        s1 = _best(rows, lambda r: r["method"] == "phx-stream-1")
        batch = _best(rows, lambda r: r["method"] == "phx-batch")
        pl = _best(rows, lambda r: r["family"] == "pool")
        kv = _best(rows, lambda r: r["family"] == "kvikio")
        c1 = _best(rows, lambda r: r["method"] == "phx-stream-c-1")
        phx_best = _best(rows, lambda r: r["family"] in ("stream", "stream-c", "batch"))
        worst = _worst_n(rows, "stream", s1)
        worst_c = _worst_n(rows, "stream-c", c1)
        out.append({"device": dev, "op": op, "chunk": chunk,
                    "stream1_vs_batch": _div(s1, batch),
                    "streamc1_vs_batch": _div(c1, batch),
                    "streamcN_vs_streamc1_min": worst_c[0], "streamcN_min_threads": worst_c[1],
                    "stream1_vs_pool": _div(s1, pl), "pool": pl and pl["method"],
                    "streamN_vs_stream1_min": worst[0], "streamN_min_threads": worst[1],
                    "stream1_vs_kvikio": _div(s1, kv), "kvikio_threads": kv and kv["threads"],
                    "phx_best_vs_kvikio": _div(phx_best, kv),
                    "phx_best": phx_best and phx_best["method"]})
    return out


def _columns(results: list[dict[str, Any]]) -> list[str]:
    """Table columns: every method name, kvikio once (its best thread count)."""
    cols: list[str] = []
    for r in results:
        if r["method"] not in cols:
            cols.append(r["method"])
    order = {"stream": 0, "stream-c": 1, "batch": 2, "pool": 3, "kvikio": 4}
    fam = {r["method"]: r["family"] for r in results}
    thr = {r["method"]: r["threads"] or 0 for r in results}
    return sorted(cols, key=lambda m: (order.get(fam[m], 9), thr[m]))


def _cell(rows: list[dict[str, Any]], method: str) -> str:
    mine = [r for r in rows if r["method"] == method]
    if not mine:
        return "-"
    b = _best(mine, lambda r: True)
    bad = any(r["verified"] is not True for r in mine)
    if b is None:
        return "ERROR"
    s = f"{b['median_gbps']:.2f} ±{b['spread']:.0%}"
    if b["family"] == "kvikio":
        s += f" {b['threads']}t"
    return s + (" !" if bad else "")


def label(chunk: int) -> str:
    """1M, 32M, 64K: how the report names a chunk size."""
    return f"{chunk >> 20}M" if chunk % MiB == 0 else f"{chunk >> 10}K"


def _fmt_ratio(x: float | None, extra: Any = None) -> str:
    if x is None:
        return "-"
    return f"{x:.2f}" + (f" ({extra})" if extra is not None else "")


def report(results: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    """The text report: GB/s and ratio tables per device and op, the phx
    counters per op, the environment, and every failure."""
    out = [f"\nphx bench gpu --pattern stream: {meta.get('gpu', '?')}, "
           f"{meta['chunk_bytes'] / GiB:.2f} GiB per row from {meta['file_bytes'] / GiB:.2f} GiB "
           f"files, {meta['repeat']} repeats, page cache dropped before each row "
           "(GB/s medians ±spread; '!' = a check failed)"]
    env = meta.get("env") or {}
    out.append("PHX_CUDA_* environment: " +
               (", ".join(f"{k}={v}" for k, v in env.items()) if env else "(none set)"))
    if meta.get("staging"):
        out.append("phx staging: " + ", ".join(f"{k}={v}" for k, v in meta["staging"].items()))
    for what, why in (meta.get("skipped") or {}).items():
        out.append(f"skipped {what}: {why}")
    cols = _columns(results)
    rat = {(x["device"], x["op"], x["chunk"]): x for x in ratios(results)}
    panels: list[tuple[str, str]] = []
    for dev, op, _ in _groups(results):
        if (dev, op) not in panels:
            panels.append((dev, op))
    for dev, op in panels:
        fs = next((r["fs"] for r in results if r["device"] == dev), "?")
        chunks = [c for d, o, c in _groups(results) if (d, o) == (dev, op)]
        body = []
        for c in chunks:
            rows = [r for r in results if (r["device"], r["op"], r["chunk"]) == (dev, op, c)]
            body.append([label(c)] + [_cell(rows, m) for m in cols])
        out.append(f"\n{dev} ({fs}): {op}s, GB/s")
        out.append(fmt_table(["chunk"] + cols, body))
        body = []
        for c in chunks:
            x = rat[(dev, op, c)]
            body.append([label(c), _fmt_ratio(x["stream1_vs_batch"]),
                         _fmt_ratio(x["stream1_vs_pool"], x["pool"]),
                         _fmt_ratio(x["streamN_vs_stream1_min"],
                                    x["streamN_min_threads"] and f"N={x['streamN_min_threads']}"),
                         _fmt_ratio(x["streamc1_vs_batch"]),
                         _fmt_ratio(x["streamcN_vs_streamc1_min"],
                                    x["streamcN_min_threads"] and f"N={x['streamcN_min_threads']}"),
                         _fmt_ratio(x["stream1_vs_kvikio"]),
                         _fmt_ratio(x["phx_best_vs_kvikio"], x["phx_best"])])
        out.append(f"{dev}: {op}s, ratios")
        out.append(fmt_table(["chunk", "stream-1/batch", "stream-1/pool", "min stream-N/stream-1",
                              "stream-c-1/batch", "min stream-c-N/stream-c-1",
                              "stream-1/kvikio", "best phx/kvikio"], body))
    out.extend(_ratio_summary(list(rat.values())))
    out.extend(_counter_report(results))
    fails = [r for r in results if r["verified"] is not True]
    if fails:
        out.append("\n!!! FAILED ROWS (errors or wrong bytes; verified = false in the JSON):")
        for r in fails:
            tag = f" {r['threads']}t" if r["family"] == "kvikio" else ""
            why = "; ".join(r["errors"]) or "never checked"
            out.append(f"!!! {r['device']} {r['op']} {label(r['chunk'])} {r['method']}{tag}: {why}")
    else:
        out.append(f"\nevery row's bytes checked: all {len(results)} rows right")
    return "\n".join(out)


def _ratio_summary(rat: list[dict[str, Any]]) -> list[str]:
    """The ratios the project tracks, as ranges over the chunk sizes."""
    lines = ["\nratios over the chunk sizes (min-max):"]
    keys = (("stream1_vs_batch", "phx-stream-1 / phx-batch"),
            ("stream1_vs_pool", "phx-stream-1 / pool"),
            ("streamN_vs_stream1_min", "min over N of phx-stream-N / phx-stream-1"),
            ("streamc1_vs_batch", "phx-stream-c-1 / phx-batch"),
            ("streamcN_vs_streamc1_min", "min over N of phx-stream-c-N / phx-stream-c-1"),
            ("stream1_vs_kvikio", "phx-stream-1 / KvikIO best"),
            ("phx_best_vs_kvikio", "best phx / KvikIO best"))
    panels: list[tuple[str, str]] = []
    for x in rat:
        if (x["device"], x["op"]) not in panels:
            panels.append((x["device"], x["op"]))
    for dev, op in panels:
        for key, text in keys:
            v = [x[key] for x in rat if (x["device"], x["op"]) == (dev, op) and x[key] is not None]
            if v:
                lines.append(f"  {dev:>4} {op:<5} {text:<44} {min(v):.2f}-{max(v):.2f}")
    return lines if len(lines) > 1 else []


def _counter_report(results: list[dict[str, Any]]) -> list[str]:
    """phx.gpu.stats() deltas of the phx-stream rows, per op."""
    rows = [r for r in results if r["family"] in ("stream", "stream-c")
            and r.get("counters_per_op")]
    if not rows:
        return []
    keys = sorted({k for r in rows for k in r["counters_per_op"]})
    body = [[r["device"], r["op"], label(r["chunk"]), r["method"], r["counter_ops"]]
            + [f"{r['counters_per_op'][k]:.3g}" if k in r["counters_per_op"] else "-"
               for k in keys] for r in rows]
    return ["\nphx-stream rows: phx.gpu.stats() deltas per op over all repeats "
            "(*_us: microseconds per op; the others: count per op)",
            fmt_table(["device", "op", "chunk", "method", "ops"] + keys, body)]


def save(path: str | None, results: list[dict[str, Any]], meta: dict[str, Any]) -> None:
    """``--json``: every row (each repeat's GB/s, median, spread, verified,
    errors, counter deltas), the ratios and the run's settings."""
    write_json(path, {"benchmark": "gpu", "pattern": "stream", **meta,
                      "order": "shuffled per repeat", "rows": results,
                      "ratios": ratios(results)})


def plot(results: list[dict[str, Any]], path: str) -> bool:
    """``--plot``: grouped bars (each method's best) per chunk size, a panel
    per device and op.  False (and a message) without matplotlib."""
    try:
        import matplotlib
    except ImportError:
        print("phx bench gpu: matplotlib is not installed: no plot", file=sys.stderr)
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    cols = _columns(results)
    devs: list[str] = []
    ops: list[str] = []
    for dev, op, _ in _groups(results):
        devs += [dev] if dev not in devs else []
        ops += [op] if op not in ops else []
    if not devs:
        return False
    cmap = plt.get_cmap("tab10")
    colors = {m: cmap(i % 10) for i, m in enumerate(cols)}
    # a row of panels per device, a column per op
    fig, axes = plt.subplots(len(devs), len(ops), figsize=(6.5 * len(ops), 4.2 * len(devs)),
                             squeeze=False)
    width = 0.8 / max(1, len(cols))
    for (i, dev), (j, op) in ((a, b) for a in enumerate(devs) for b in enumerate(ops)):
        ax = axes[i][j]
        chunks = [c for d, o, c in _groups(results) if (d, o) == (dev, op)]
        for n, m in enumerate(cols):
            xs, meds, lo, hi = [], [], [], []
            for x, c in enumerate(chunks):
                b = _best([r for r in results if (r["device"], r["op"], r["chunk"], r["method"])
                           == (dev, op, c, m)], lambda r: True)
                if b is None:
                    continue
                xs.append(x + (n - (len(cols) - 1) / 2) * width)
                meds.append(b["median_gbps"])
                lo.append(b["median_gbps"] - min(b["runs_gbps"]))
                hi.append(max(b["runs_gbps"]) - b["median_gbps"])
            if xs:
                ax.bar(xs, meds, width, yerr=[lo, hi], capsize=2, color=colors[m], label=m)
        ax.set_xticks(range(len(chunks)))
        ax.set_xticklabels([label(c) for c in chunks])
        ax.set_title(f"{dev}: {op}s (kvikio, pool: best thread count)")
        ax.set_xlabel("chunk size")
        ax.set_ylabel("GB/s (median, min-max)")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True
