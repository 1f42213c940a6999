"""``phx bench gpu``: file <-> GPU GB/s and CPU cost, phx against the ways
people do it now, for two patterns.

* ``--pattern seq``     one file of ``--size`` <-> one GPU buffer.
* ``--pattern chunks``  KV-cache traffic: N random, block-aligned, distinct
  blocks of the file <-> N distinct places of one GPU buffer, for each
  ``--chunk-sizes`` (4K, 8K, 16K, 32K, 64K, 256K, 2M, 16M: vLLM's KV blocks
  are 8-64 KiB, issue 29); ``--chunk-bytes`` moved per row.

Methods, each on the same files in one run, page cache dropped before every
row, rows interleaved in a new random order each repeat (so no method always
follows another's writes), ``--repeat`` times (median and spread reported):

* ``phx``          phx.gpu with the defaults a context gets (tuned, if
                   ``phx tune`` ran): seq = one ``pread``; chunks = one
                   ``pread_many`` / ``pwrite_many`` call (int64 arrays, no
                   Python object per piece).  Chunks rows also record where
                   phx's time went (the context's ``ph_*`` counters: call,
                   pack, submit, io, copy, done) as shares, in the table's last
                   column and the JSON.
* ``batch``        (chunks, not in the default set) phx's per-piece API from
                   before the array calls: ``File.pread_batch`` /
                   ``pwrite_batch`` with one GPU view per piece, same engine and
                   phase counters: the "before" of issue 29 in the same run.
* ``phx[k=v,..]``  ``--phx-variant``: ``phx`` on a staging context of its own
                   with some switches changed (``batch_copy``, ``fixed_bufs``,
                   ``early_reads``): how the copy paths compare in one run.
* ``host``         the same pieces into page-locked host memory through phx's
                   engine (``File.pread_many`` / ``pwrite_many``), no GPU: the
                   rate the device gives phx's engine at this piece size,
                   which GPU staging can at best approach (issue 29).
* ``raw-odirect``  O_DIRECT ``preadv``/``pwrite`` into host memory, no GPU,
                   N threads, the same pattern: what the device gives.
* ``naive``        buffered ``pread`` into pageable memory, then a copy to the
                   GPU, one request after the other (64 MiB requests for seq;
                   at most 128 MiB of chunks per row).
* ``kvikio``       KvikIO ``CuFile.pread/pwrite`` in compatibility mode, a
                   thread sweep (``--kvikio-threads``); for chunks one future
                   per block.

Writes end with an fsync for every method.  CPU cost: user + system seconds
of the process and its children (getrusage) per GB moved.  Without a GPU the
command says so on one line and exits 2 (nothing measured).

``--pattern stream`` (alone or beside the others) measures the stream-ordered
path (``phx.gpu.read_async``/``write_async`` on one and on N streams) beside
``read_chunks``, a host-staged pool and KvikIO: see :mod:`phx.bench._gpu_stream`.

Several GPUs (``--devices 0,1`` or ``all``): every row runs on all of them at
once from this one process, a thread per device, each device with its own
files and its own buffer (phx: one engine, a staging context per device);
GB/s is the aggregate (bytes moved on all devices / the time from the common
start until the last device is done), the raw rows read the same N files at
once with their threads each: what the storage gives to N readers.
"""
from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import threading
import time
from typing import Any, Callable

from phx.bench._common import (BenchError, add_common_arguments, checked, csv, drop_caches,
                               fmt_table, median_spread, parse_size, positive_int,
                               positive_size, progress, write_json)

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
NAIVE_CAP = 128 * MiB
#: --kvikio-threads of the seq and chunks patterns (the stream pattern has its own)
KVIKIO_THREADS = "4,16,64"


def _devices_syntax(text: str) -> list[int]:
    return parse_devices(text, 1 << 30)     # the real count is checked at run time


def add_arguments(p: argparse.ArgumentParser) -> None:
    # Values are checked here and kept as text: the run parses them (and the
    # stream pattern shares them).
    p.add_argument("--pattern", type=checked(csv(str, allowed=("seq", "chunks", "stream"))),
                   default="seq,chunks",
                   help="comma list of seq, chunks, stream (default seq,chunks)")
    p.add_argument("--zram", metavar="SIZE", type=checked(positive_size), default=None,
                   help="also build a zram block device of SIZE with ext4 (root) and "
                        "run there: the RAM-speed rows where software decides (it holds "
                        "two files of --size per device)")
    p.add_argument("--size", type=checked(positive_size), default="4G",
                   help="file size (default 4G)")
    p.add_argument("--chunk-sizes", type=checked(csv(positive_size)),
                   default="4K,8K,16K,32K,64K,256K,2M,16M",
                   help="chunk pattern sizes (default 4K,8K,16K,32K,64K,256K,2M,16M)")
    p.add_argument("--chunk-bytes", type=checked(positive_size), default="1G",
                   help="bytes moved per chunks (and stream) row (default 1G)")
    p.add_argument("--methods",
                   type=checked(csv(str, allowed=("phx", "batch", "host", "raw", "naive",
                                                      "kvikio"))),
                   default="phx,host,raw,naive,kvikio",
                   help="comma list of phx,batch,host,raw,naive,kvikio (default all but "
                        "batch; host and batch: chunks only)")
    p.add_argument("--phx-variant", type=_variant, action="append", default=None,
                   metavar="KEY=0|1[,...]",
                   help="an extra phx row whose staging context has these switches "
                        f"({', '.join(VARIANT_KEYS)}), e.g. batch_copy=0; "
                        "repeatable")
    p.add_argument("--ops", type=checked(csv(str, allowed=("read", "write"))),
                   default="read,write", help="read,write (default both)")
    p.add_argument("--raw-threads", type=checked(csv(positive_int)), default="16,64",
                   help="thread counts for raw O_DIRECT")
    p.add_argument("--kvikio-threads", type=checked(csv(positive_int)), default=None,
                   help=f"KvikIO thread counts (sweep; default {KVIKIO_THREADS}, "
                        "stream pattern 16,64)")
    p.add_argument("--lanes", type=positive_int, default=None,
                   help="phx staging lanes (else defaults)")
    p.add_argument("--bufs", type=positive_int, default=None,
                   help="phx staging buffers per lane")
    p.add_argument("--buf-size", type=checked(positive_size), default=None,
                   help="phx staging buffer size")
    p.add_argument("--devices", type=checked(_devices_syntax), default="0",
                   help="CUDA devices fed at once: a comma list or 'all' (default 0)")
    add_common_arguments(
        p, dir_help="directory for the test files (default: $PHX_BENCH_DIR or the current "
                    "directory); they are removed after its rows unless --keep",
        dir_repeatable=True, repeat=3,
        keep_help="keep the test files (phx-bench-gpu*.bin in each --dir)")
    from phx.bench import _gpu_stream
    _gpu_stream.add_arguments(p)


# ---------------------------------------------------------------------------
# setup
# ---------------------------------------------------------------------------

def _zram_up(size: str) -> tuple[str, str]:
    if not os.path.exists("/sys/class/zram-control/hot_add") and not os.path.exists("/dev/zram0"):
        subprocess.run(["modprobe", "zram"], capture_output=True)
    with open("/sys/class/zram-control/hot_add") as f:
        name = "zram" + f.read().strip()
    with open(f"/sys/block/{name}/disksize", "w") as f:
        f.write(size)
    subprocess.run(["mkfs.ext4", "-q", "-F", f"/dev/{name}"], check=True)
    mnt = f"/mnt/phx-bench-{name}"
    os.makedirs(mnt, exist_ok=True)
    subprocess.run(["mount", f"/dev/{name}", mnt], check=True)
    return mnt, name


def _zram_down(mnt: str, name: str) -> None:
    subprocess.run(["umount", mnt], capture_output=True)
    try:
        with open(f"/sys/block/{name}/reset", "w") as f:
            f.write("1\n")
    except OSError:
        pass


def _make_file(path: str, size: int, seed: int) -> None:
    """Fresh random bytes (never zeros), written with O_DIRECT, fsynced."""
    import numpy as np
    rng = np.random.default_rng(seed)
    chunk = 64 * MiB
    import phx
    buf = phx.empty_aligned(chunk)
    arr = np.frombuffer(buf, dtype=np.uint8)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644)
    try:
        for off in range(0, size, chunk):
            arr[:] = rng.integers(0, 256, size=chunk, dtype=np.uint8)
            os.pwrite(fd, memoryview(buf), off)
        os.ftruncate(fd, size)
        os.fsync(fd)
    finally:
        os.close(fd)
        del arr


def _fs_of(path: str) -> str:
    try:
        out = subprocess.run(["df", "-T", path], capture_output=True, text=True).stdout
        parts = out.splitlines()[1].split()
        return f"{parts[1]} on {parts[0]}"
    except Exception:  # noqa: BLE001
        return "?"


# ---------------------------------------------------------------------------
# patterns: a list of (file offset, GPU/host buffer offset, size)
# ---------------------------------------------------------------------------

class Pattern:
    """What one row moves: ``n`` pieces, file offsets, buffer offsets, sizes."""

    def __init__(self, name: str, foffs, boffs, size: int):
        import numpy as np
        self.name = name
        self.foffs = np.asarray(foffs, dtype=np.int64)
        self.boffs = np.asarray(boffs, dtype=np.int64)
        self.sizes = np.full(len(self.foffs), size, dtype=np.int64)
        self.piece = size
        self.total = int(self.sizes.sum())

    def head(self, max_bytes: int) -> "Pattern":
        n = max(1, min(len(self.foffs), max_bytes // self.piece))
        p = Pattern(self.name, self.foffs[:n], self.boffs[:n], self.piece)
        return p


def seq_pattern(size: int) -> Pattern:
    return Pattern("seq", [0], [0], size)


def chunk_pattern(file_size: int, chunk: int, nbytes: int, seed: int) -> Pattern:
    """Distinct random blocks of the file -> distinct random slots of the buffer."""
    import numpy as np
    rng = np.random.default_rng(seed)
    nblocks = file_size // chunk
    n = max(1, min(nblocks, nbytes // chunk))
    blocks = rng.choice(nblocks, size=n, replace=False)
    slots = rng.permutation(n)
    return Pattern(f"chunks {chunk >> 10}K", blocks * chunk, slots * chunk, chunk)


# ---------------------------------------------------------------------------
# methods (each returns seconds for moving pattern.total bytes)
# ---------------------------------------------------------------------------

_HOST: dict[int, Any] = {}
HOST_MAX = GiB


def _host_buffer(n: int):
    """A page-aligned host buffer of n bytes of random data for raw O_DIRECT
    (kept for the next row of the same size)."""
    import numpy as np
    if n not in _HOST:
        _HOST.clear()
        import phx
        m = phx.empty_aligned(n)
        a = np.frombuffer(m, dtype=np.uint8)
        rng = np.random.default_rng(3)
        for off in range(0, n, 64 * MiB):
            k = min(64 * MiB, n - off)
            a[off:off + k] = rng.integers(0, 256, k, dtype=np.uint8)
        del a
        _HOST[n] = m
    return _HOST[n]


def raw_odirect(path: str, pat: Pattern, threads: int, write: bool) -> float:
    """O_DIRECT into host memory, no GPU: the same pattern over N threads,
    pieces of more than 4 MiB in 4 MiB requests.  Host places beyond 1 GiB
    wrap around (the place in host memory does not change the device's pace)."""
    fd = os.open(path, (os.O_RDWR if write else os.O_RDONLY) | os.O_DIRECT)
    span = -(-int((pat.boffs + pat.sizes).max()) // 4096) * 4096
    hsize = min(span, HOST_MAX)
    buf = _host_buffer(hsize)
    mv = memoryview(buf)
    work = []
    for fo, bo, sz in zip(pat.foffs.tolist(), pat.boffs.tolist(), pat.sizes.tolist()):
        for k in range(0, sz, 4 * MiB):
            n = min(4 * MiB, sz - k)
            b = (bo + k) % hsize
            if b + n > hsize:
                b = 0
            work.append((fo + k, b, n))
    errs: list[BaseException] = []

    def run(i):
        try:
            for fo, bo, n in work[i::threads]:
                if write:
                    os.pwrite(fd, mv[bo:bo + n], fo)
                else:
                    os.preadv(fd, [mv[bo:bo + n]], fo)
        except BaseException as e:  # noqa: BLE001
            errs.append(e)

    th = [threading.Thread(target=run, args=(i,)) for i in range(min(threads, len(work)))]
    t0 = time.perf_counter()
    for t in th:
        t.start()
    for t in th:
        t.join()
    if write:
        os.fsync(fd)
    dt = time.perf_counter() - t0
    os.close(fd)
    mv.release()
    if errs:
        raise errs[0]
    return dt


def naive(path: str, pat: Pattern, gpu, write: bool) -> float:
    """Pageable memory + buffered pread/pwrite + a synchronous copy, one
    request after another (64 MiB pieces for seq)."""
    import numpy as np
    import torch
    fd = os.open(path, os.O_RDWR if write else os.O_RDONLY)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for fo, bo, sz in zip(pat.foffs.tolist(), pat.boffs.tolist(), pat.sizes.tolist()):
        for k in range(0, sz, 64 * MiB):
            n = min(64 * MiB, sz - k)
            if write:
                host = gpu[bo + k:bo + k + n].cpu()
                os.pwrite(fd, host.numpy().data, fo + k)
            else:
                host = np.empty(n, dtype=np.uint8)
                os.preadv(fd, [host], fo + k)
                gpu[bo + k:bo + k + n].copy_(torch.from_numpy(host))
    if write:
        os.fsync(fd)
    torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    os.close(fd)
    return dt


def _kvikio_threads(threads: int):
    import kvikio
    import kvikio.defaults as kd
    try:
        kd.set({"compat_mode": kvikio.CompatMode.ON, "num_threads": threads})
    except Exception:  # noqa: BLE001 - older API
        kd.compat_mode_reset(True)
        kd.num_threads_reset(threads)
    return kvikio


def kvikio_io(path: str, pat: Pattern, gpu, threads: int, write: bool) -> float:
    """KvikIO compat mode; one future per piece (one for seq)."""
    import torch
    kvikio = _kvikio_threads(threads)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    f = kvikio.CuFile(path, "r+" if write else "r")
    futs = []
    for fo, bo, sz in zip(pat.foffs.tolist(), pat.boffs.tolist(), pat.sizes.tolist()):
        view = gpu[bo:bo + sz]
        futs.append(f.pwrite(view, sz, fo) if write else f.pread(view, sz, fo))
    for fu in futs:
        fu.get()
    f.close()
    if write:
        fd = os.open(path, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)
    return time.perf_counter() - t0


_ENGINES: dict[tuple, Any] = {}


def _phx_engine(ctx_cfg: dict, devices: tuple[int, ...] = ()):
    """One engine per configuration; ``devices`` (run() names them before any
    row is timed) get a staging context of that configuration."""
    import phx
    import phx.gpu
    key = tuple(sorted(ctx_cfg.items()))
    if key not in _ENGINES:
        _ENGINES[key] = phx.Engine()
    for d in devices:
        phx.gpu.context(_ENGINES[key], d, **ctx_cfg)
    return _ENGINES[key]


#: the staging context's on/off switches --phx-variant may set
VARIANT_KEYS = ("batch_copy", "fixed_bufs", "early_reads")


def _variant(text: str) -> dict[str, bool]:
    """--phx-variant's KEY=0|1[,KEY=0|1...] as {key: bool}."""
    out: dict[str, bool] = {}
    for part in text.split(","):
        key, eq, val = part.strip().partition("=")
        if key not in VARIANT_KEYS or not eq or val not in ("0", "1"):
            raise argparse.ArgumentTypeError(
                f"{part!r}: want KEY=0 or KEY=1 with KEY one of {', '.join(VARIANT_KEYS)}")
        out[key] = val == "1"
    return out


def _is_phx_row(name: str) -> bool:
    """Rows that run phx.gpu: checked byte for byte, phase counters kept."""
    return name in ("phx", "batch") or name.startswith("phx[")
#: the phase counters of struct phx_cuda_stats (issue 29), in pipeline order
PHASES = ("call", "pack", "submit", "io", "copy", "done")
#: (pattern name, op, method) -> the phase counters' growth over a phx row's
#: runs, summed
_PHASE_NS: dict[tuple[str, str, str], dict[str, int]] = {}
_PHASE_LOCK = threading.Lock()


def _phase_ns(eng, device: int) -> dict[str, int]:
    import phx.gpu
    st = phx.gpu.context(eng, device).stats()
    return {k: int(st.get(f"ph_{k}_ns", 0)) for k in PHASES}


def phase_shares(ns: dict[str, int]) -> dict[str, float]:
    """Each phase's share of the phases' sum (buffer-time: they overlap, so
    only their proportions mean something; the largest bounds the rate)."""
    total = sum(ns.get(k, 0) for k in PHASES)
    return {k: (ns.get(k, 0) / total if total else 0.0) for k in PHASES}


def phx_io(path: str, pat: Pattern, gpu, write: bool, ctx_cfg: dict,
           per_piece: bool = False, label: str = "phx") -> float:
    """phx.gpu: one array call for chunks (``per_piece``: the older
    ``pread_batch`` with one GPU view per piece), one call for seq; the
    phase counters' growth is kept under ``label`` (the row's method)."""
    import phx
    import phx.gpu
    import torch
    eng = _phx_engine(ctx_cfg)
    dev = gpu.device.index or 0
    torch.cuda.synchronize()
    ph0 = _phase_ns(eng, dev)
    t0 = time.perf_counter()
    with phx.open(path, "r+" if write else "r", engine=eng) as f:
        if pat.name == "seq":
            n = [f.pwrite(gpu[:pat.total], 0) if write else f.pread(gpu[:pat.total], 0)]
        elif per_piece:
            reqs = [(gpu[b:b + s], o) for o, b, s in
                    zip(pat.foffs.tolist(), pat.boffs.tolist(), pat.sizes.tolist())]
            n = f.pwrite_batch(reqs) if write else f.pread_batch(reqs)
        elif write:
            n = phx.gpu.pwrite_many(gpu, f, pat.foffs, pat.sizes, pat.boffs).tolist()
        else:
            n = phx.gpu.pread_many(gpu, f, pat.foffs, pat.sizes, pat.boffs).tolist()
        if write:
            f.fsync()
    dt = time.perf_counter() - t0
    ph1 = _phase_ns(eng, dev)
    with _PHASE_LOCK:
        acc = _PHASE_NS.setdefault((pat.name, "write" if write else "read", label), {})
        for k in PHASES:
            acc[k] = acc.get(k, 0) + ph1[k] - ph0[k]
    if sum(n) != pat.total:
        raise RuntimeError(f"phx moved {sum(n)} of {pat.total} bytes")
    return dt


_PINNED: dict[int, Any] = {}


def _pinned_host(n: int):
    """A page-aligned host buffer of n bytes, page-locked for device 0 as
    staging is (phx.gpu.pin), kept for the next row of the same size."""
    import phx
    import phx.gpu
    if n not in _PINNED:
        for m, pin in _PINNED.values():
            pin.close()
        _PINNED.clear()
        m = phx.empty_aligned(n)
        _PINNED[n] = (m, phx.gpu.pin(m))
    return _PINNED[n][0]


def phx_host_io(path: str, pat: Pattern, write: bool, ctx_cfg: dict) -> float:
    """The same pieces into page-locked host memory through phx's engine
    (``File.pread_many`` / ``pwrite_many``): the device's rate for phx at
    this piece size, no GPU.  Host places beyond 1 GiB wrap around, as for
    raw-odirect."""
    import numpy as np
    import phx
    span = -(-int((pat.boffs + pat.sizes).max()) // 4096) * 4096
    hsize = min(span, HOST_MAX)
    buf = _pinned_host(hsize)
    boffs = pat.boffs % hsize
    boffs = np.where(boffs + pat.sizes > hsize, 0, boffs)
    eng = _phx_engine(ctx_cfg)
    t0 = time.perf_counter()
    with phx.open(path, "r+" if write else "r", engine=eng) as f:
        if write:
            n = f.pwrite_many(buf, pat.foffs, pat.sizes, boffs)
            f.fsync()
        else:
            n = f.pread_many(buf, pat.foffs, pat.sizes, boffs)
    dt = time.perf_counter() - t0
    if int(n.sum()) != pat.total:
        raise RuntimeError(f"phx (host) moved {int(n.sum())} of {pat.total} bytes")
    return dt


def _verify(path: str, gpu, pat: Pattern, what: str) -> None:
    """16 random pieces (up to 64 KiB of each) of the GPU buffer vs the file."""
    import numpy as np
    rng = np.random.default_rng()
    with open(path, "rb") as f:
        for i in rng.integers(0, len(pat.foffs), size=16):
            sz = int(pat.sizes[i])
            k = int(rng.integers(0, max(1, sz - 65536)))
            n = min(65536, sz - k)
            f.seek(int(pat.foffs[i]) + k)
            want = np.frombuffer(f.read(n), dtype=np.uint8)
            b = int(pat.boffs[i]) + k
            got = gpu[b:b + n].cpu().numpy()
            if not np.array_equal(got, want):
                raise RuntimeError(f"{what}: wrong bytes at file offset {int(pat.foffs[i]) + k}")


def parse_devices(spec: str, count: int) -> list[int]:
    """``--devices``: "all", or a comma list of distinct ordinals below ``count``."""
    if spec.strip() == "all":
        if count < 1:
            raise ValueError("no CUDA device")
        return list(range(count))
    try:
        devs = [int(x) for x in spec.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--devices {spec!r}: a comma list of device numbers, or all") from None
    bad = [d for d in devs if not 0 <= d < count]
    if not devs or bad or len(set(devs)) != len(devs):
        raise ValueError(f"--devices {spec!r}: want distinct devices among 0..{count - 1}")
    return devs


def fan_out(fn: Callable, args: list[tuple], bind: Callable[[int], None] | None = None) -> float:
    """Run ``fn(*args[i])`` for every i at once, a thread each (``bind(i)``
    first, in that thread: the CUDA device), all released together; seconds
    from that release until the last is done.  One item runs on this thread.
    The first error is raised once every thread has ended."""
    if len(args) == 1:
        if bind:
            bind(0)
        t0 = time.perf_counter()
        fn(*args[0])
        return time.perf_counter() - t0
    gate = threading.Barrier(len(args) + 1)
    bind_errs: list[BaseException] = []
    errs: list[BaseException] = []
    ends = [0.0] * len(args)

    def one(i):
        try:
            if bind:
                bind(i)
        except BaseException as e:  # noqa: BLE001
            bind_errs.append(e)
        gate.wait()          # every binding is done (or failed) past this point
        try:
            if not bind_errs:
                fn(*args[i])
        except BaseException as e:  # noqa: BLE001
            errs.append(e)
        ends[i] = time.perf_counter()

    th = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(len(args))]
    for t in th:
        t.start()
    gate.wait()
    t0 = time.perf_counter()
    for t in th:
        t.join()
    if bind_errs or errs:
        raise (bind_errs or errs)[0]
    return max(ends) - t0


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
        cfg["buf_size"] = parse_size(args.buf_size)
    return cfg


def _methods(args, have_kvikio: bool, op: str, pattern: str) -> list[tuple[str, dict, Callable]]:
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    w = op == "write"
    cfg = _ctx_cfg(args)
    rows: list[tuple[str, dict, Callable]] = []
    api = ("pwrite_many" if w else "pread_many") if pattern == "chunks" else \
        ("pwrite" if w else "pread")
    if "phx" in methods:
        rows.append(("phx", dict(cfg, api=api),
                     lambda p, pat, g: phx_io(p, pat, g, w, cfg)))
    if "batch" in methods and pattern == "chunks":
        rows.append(("batch", dict(cfg, api="pwrite_batch" if w else "pread_batch"),
                     lambda p, pat, g: phx_io(p, pat, g, w, cfg, per_piece=True,
                                              label="batch")))
    for var in args.phx_variant or []:
        vcfg = dict(cfg, **var)
        label = "phx[" + ",".join(f"{k}={int(v)}" for k, v in var.items()) + "]"
        rows.append((label, dict(vcfg, api=api if "phx" in methods else None),
                     lambda p, pat, g, vcfg=vcfg, label=label:
                     phx_io(p, pat, g, w, vcfg, label=label)))
    if "host" in methods and pattern == "chunks":
        rows.append(("host", {"memory": "pinned",
                              "api": "File.pwrite_many" if w else "File.pread_many"},
                     lambda p, pat, g: phx_host_io(p, pat, w, cfg)))
    if "raw" in methods:
        for n in [int(x) for x in args.raw_threads.split(",")]:
            rows.append(("raw-odirect", {"threads": n},
                         lambda p, pat, g, n=n: raw_odirect(p, pat, n, w)))
    if "naive" in methods:
        rows.append(("naive", {"request": "64MiB" if pattern == "seq" else "chunk",
                               "max_bytes": None if pattern == "seq" else NAIVE_CAP},
                     lambda p, pat, g: naive(p, pat if pattern == "seq" else pat.head(NAIVE_CAP),
                                             g, w)))
    if "kvikio" in methods and have_kvikio:
        for n in [int(x) for x in (args.kvikio_threads or KVIKIO_THREADS).split(",")]:
            rows.append(("kvikio", {"threads": n, "compat": True},
                         lambda p, pat, g, n=n: kvikio_io(p, pat, g, n, w)))
    return rows


def _cpu_seconds() -> float:
    s = resource.getrusage(resource.RUSAGE_SELF)
    c = resource.getrusage(resource.RUSAGE_CHILDREN)
    return s.ru_utime + s.ru_stime + c.ru_utime + c.ru_stime


def run(args) -> int:
    patterns = [p.strip() for p in args.pattern.split(",") if p.strip()]
    if "stream" in patterns:
        from phx.bench import _gpu_stream
        return _gpu_stream.run(args, [p for p in patterns if p != "stream"], _run_patterns)
    return _run_patterns(args)


def _run_patterns(args) -> int:
    """The seq and chunks patterns."""
    ok, why = _gpu_ok()
    if not ok:
        raise BenchError(f"no GPU here ({why}); nothing measured")
    import torch
    if os.geteuid() != 0:
        print("phx bench gpu: not root: page cache cannot be dropped, rows are warm",
              file=sys.stderr)
    os.environ.setdefault("KVIKIO_COMPAT_MODE", "ON")
    try:
        import kvikio  # noqa: F401
        have_kvikio = True
    except Exception as e:  # noqa: BLE001
        print(f"phx bench gpu: KvikIO unavailable ({e}); its rows are skipped", file=sys.stderr)
        have_kvikio = False

    size = parse_size(args.size)
    patterns = [p.strip() for p in args.pattern.split(",") if p.strip()]
    chunk_sizes = [parse_size(c) for c in args.chunk_sizes.split(",")]
    chunk_bytes = min(parse_size(args.chunk_bytes), size)
    ops = [o.strip() for o in args.ops.split(",") if o.strip()]
    dirs = [(d, "disk") for d in (args.dir or [os.environ.get("PHX_BENCH_DIR", ".")])]
    try:
        devices = parse_devices(args.devices, torch.cuda.device_count())
    except ValueError as e:
        print(f"phx bench gpu: {e}", file=sys.stderr)
        return 2
    zram = None
    if args.zram:
        zram = _zram_up(args.zram)
        dirs.append((zram[0], "zram"))
    gpus = []
    for d in devices:
        g = torch.empty(size, dtype=torch.uint8, device=f"cuda:{d}")
        g.random_(0, 256)
        gpus.append(g)
    for d in devices:
        torch.cuda.synchronize(d)
    _phx_engine(_ctx_cfg(args), tuple(devices))

    def bind(i):
        torch.cuda.set_device(devices[i])

    # the rows of one directory: (pattern, op, method, config, fn)
    plan = []
    for pname in patterns:
        pats = [seq_pattern(size)] if pname == "seq" else \
            [chunk_pattern(size, c, chunk_bytes, seed=c) for c in chunk_sizes]
        for pat in pats:
            for op in ops:
                for name, cfg, fn in _methods(args, have_kvikio, op, pname):
                    plan.append((pat, op, name, cfg, fn))
    results: list[dict] = []
    import phx.gpu
    try:
        bar = progress(len(plan) * len(dirs) * args.repeat, "bench gpu", not args.quiet)
        for d, label in dirs:
            # a file to read and one to write per device ("" for the first: the
            # names one device has always had)
            tags = [""] + [f"-{k}" for k in range(1, len(devices))]
            paths = [os.path.join(d, f"phx-bench-gpu{t}.bin") for t in tags]
            wpaths = [os.path.join(d, f"phx-bench-gpu-w{t}.bin") for t in tags]
            for k, (p, w) in enumerate(zip(paths, wpaths)):
                _make_file(p, size, seed=1 + 2 * k)
                _make_file(w, size, seed=2 + 2 * k)
            fs = _fs_of(paths[0])
            runs: dict[int, list[tuple[float, float]]] = {i: [] for i in range(len(plan))}
            import numpy as np
            for rep in range(args.repeat):
                # a fresh order each repeat: no method always follows the
                # writes of another (this disk keeps flushing after them)
                order = np.random.default_rng(rep).permutation(len(plan))
                for i in order.tolist():
                    pat, op, name, cfg, fn = plan[i]
                    targets = wpaths if op == "write" else paths
                    drop_caches()
                    c0 = _cpu_seconds()
                    dt = fan_out(fn, [(t, pat, g) for t, g in zip(targets, gpus)], bind)
                    cpu = _cpu_seconds() - c0
                    moved = len(devices) * (
                        pat.total if not (name == "naive" and pat.name != "seq")
                        else pat.head(NAIVE_CAP).total)
                    runs[i].append((moved / dt / 1e9, cpu / (moved / 1e9)))
                    if rep == 0 and _is_phx_row(name):
                        for t, g in zip(targets, gpus):
                            _verify(t, g, pat, f"{name} {pat.name} {op} on {g.device}")
                    bar.update(1)
            for i, (pat, op, name, cfg, _) in enumerate(plan):
                gb = [r[0] for r in runs[i]]
                med, spread = median_spread(gb)
                cpu_med, _ = median_spread([r[1] for r in runs[i]])
                row = {"device": label, "fs": fs, "gpus": devices,
                       "pattern": pat.name,
                       "chunk": pat.piece if pat.name != "seq" else None,
                       "op": op, "method": name, "config": cfg, "runs_gbps": gb,
                       "median_gbps": med, "spread": spread,
                       "cpu_s_per_gb": cpu_med}
                if _is_phx_row(name):
                    ns = _PHASE_NS.pop((pat.name, op, name), {})
                    row["phase_ns"] = ns
                    row["phase_shares"] = phase_shares(ns)
                results.append(row)
            if not args.keep:
                for p in paths + wpaths:
                    os.unlink(p)
        bar.close()
    finally:
        if zram:
            _zram_down(*zram)
    ctx_info = {}
    try:
        eng = _phx_engine(_ctx_cfg(args), tuple(devices))
        ctx_info = phx.gpu.context(eng, devices[0]).config
        if len(devices) > 1:
            ctx_info = {"devices": devices, "per_device": {
                d: phx.gpu.context(eng, d).config for d in devices}}
    except Exception:  # noqa: BLE001
        pass
    try:
        st = phx.gpu.stats()
        if len(devices) > 1:          # and each device's own share
            st = {"all": st, **{f"cuda:{d}": phx.gpu.stats(device=d) for d in devices}}
    except Exception:  # noqa: BLE001
        st = {}
    _report(results, size, args, ctx_info, st, len(devices))
    if not results:
        print("phx bench gpu: nothing was measured", file=sys.stderr)
        return 1
    return 0


def _best(results, device, pattern, op, method) -> dict | None:
    c = [r for r in results if r["device"] == device and r["pattern"] == pattern
         and r["op"] == op and r["method"] == method]
    return max(c, key=lambda r: r["median_gbps"]) if c else None


#: (pattern kind, device) -> [(vs, min ratio)] from issue 10
GOALS = {
    ("chunks", "zram"): [("kvikio", 1.5), ("raw-odirect", 0.8)],
    ("chunks", "disk"): [("kvikio", 1.0), ("raw-odirect", 0.95)],
    ("seq", "disk"): [("kvikio", 1.0), ("raw-odirect", 0.95)],
}


#: issue 29, pieces of 64 KiB and less: (device, op) -> [(vs, min ratio)]
#: (disk: "the host row's device limit minus 10%")
GOALS_SMALL = {
    ("zram", "read"): [("host", 0.8), ("kvikio", 3.0)],
    ("disk", "read"): [("host", 0.9), ("kvikio", 1.5)],
    ("zram", "write"): [("host", 0.8)],
    ("disk", "write"): [("host", 0.8)],
}
SMALL_MAX = 64 * KiB
SPREAD_GOAL = 0.15


def _goals_for(r: dict) -> list[tuple[str, float]]:
    if r["pattern"] == "seq":
        return GOALS.get(("seq", r["device"]), [])
    if r.get("chunk") and r["chunk"] <= SMALL_MAX:
        return GOALS_SMALL.get((r["device"], r["op"]), [])
    return GOALS.get(("chunks", r["device"]), [])


def _phase_text(r: dict) -> str:
    sh = r.get("phase_shares")
    if not sh or not any(sh.values()):
        return ""
    top = max(PHASES, key=lambda k: sh[k])
    return f"{top} " + "/".join(f"{sh[k]:.0%}" for k in PHASES)


def _report(results: list[dict], size: int, args, ctx_info: dict, st: dict,
            ngpus: int = 1) -> None:
    table = []
    for r in results:
        ph = _best(results, r["device"], r["pattern"], r["op"], "phx")
        ratio = ph["median_gbps"] / r["median_gbps"] if ph and r["median_gbps"] else float("nan")
        cfg = ",".join(f"{k}={v}" for k, v in r["config"].items() if v is not None)
        table.append((r["device"], r["pattern"], r["op"], r["method"], cfg, r["median_gbps"],
                      f"{r['spread']:.0%}", r["cpu_s_per_gb"], ratio, _phase_text(r)))
    print(f"\nphx bench gpu: {size / GiB:.1f} GiB files, {args.repeat} repeats, page cache "
          f"dropped before each row (GB/s medians; CPU s/GB = process user+sys per GB)")
    if ngpus > 1:
        print(f"{ngpus} GPUs fed at once, a file each: GB/s are aggregates")
    if ctx_info:
        print("phx staging: " + ", ".join(f"{k}={v}" for k, v in ctx_info.items()))
    print(fmt_table(["device", "pattern", "op", "method", "config", "GB/s", "spread",
                     "CPU s/GB", "phx/x", "phx time: top call/pack/submit/io/copy/done"], table))
    goals = []
    for r in results:
        if r["method"] != "phx":
            continue
        for base, want in _goals_for(r):
            b = _best(results, r["device"], r["pattern"], r["op"], base)
            if not b:
                continue
            ratio = r["median_gbps"] / b["median_gbps"]
            cpu_ratio = r["cpu_s_per_gb"] / b["cpu_s_per_gb"] if b["cpu_s_per_gb"] else None
            goals.append({"device": r["device"], "pattern": r["pattern"], "op": r["op"],
                          "vs": base, "vs_config": b["config"], "ratio": ratio, "goal": want,
                          "met": ratio >= want, "cpu_ratio": cpu_ratio})
    for g in goals:
        cpu = f", CPU/GB {g['cpu_ratio']:.2f}x" if g["cpu_ratio"] is not None else ""
        print(f"goal {g['device']:>4} {g['pattern']:<12} {g['op']:<5}: phx / best {g['vs']:<11} "
              f"= {g['ratio']:.2f} (>= {g['goal']}) {'met' if g['met'] else 'NOT met'}{cpu}")
    wide = [r for r in results if r["method"] in ("phx", "host") and r["spread"] >= SPREAD_GOAL
            and len(r["runs_gbps"]) > 1]
    for r in wide:
        print(f"spread {r['device']:>4} {r['pattern']:<12} {r['op']:<5} {r['method']}: "
              f"{r['spread']:.0%} (goal < {SPREAD_GOAL:.0%}) NOT met")
    write_json(args.json, {"benchmark": "gpu", "size": size, "repeat": args.repeat,
                           "gpus": ngpus,
                           "patterns": args.pattern, "order": "shuffled per repeat",
                           "staging": ctx_info, "rows": results,
                           "goals": goals, "phx_gpu_stats": st})
    if args.plot:
        _plot(results, args.plot)


def _plot(results: list[dict], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    panels = sorted({(r["device"], r["op"]) for r in results})
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4.5), squeeze=False)
    colors = {"phx": "tab:red", "batch": "tab:pink", "host": "tab:orange",
              "raw-odirect": "tab:gray",
              "naive": "tab:brown", "kvikio": "tab:blue"}
    for ax, (dev, op) in zip(axes[0], panels):
        rs = [r for r in results if r["device"] == dev and r["op"] == op]
        groups = []
        for r in rs:
            if r["pattern"] not in groups:
                groups.append(r["pattern"])
        x = 0
        ticks, labels = [], []
        for g in groups:
            best: dict[str, dict] = {}
            for r in rs:
                if r["pattern"] == g and (r["method"] not in best or
                                          r["median_gbps"] > best[r["method"]]["median_gbps"]):
                    best[r["method"]] = r
            start = x
            for m, r in best.items():
                med = r["median_gbps"]
                ax.bar(x, med, yerr=[[med - min(r["runs_gbps"])], [max(r["runs_gbps"]) - med]],
                       color=colors.get(m, "k"), capsize=2, label=m if g == groups[0] else None)
                x += 1
            ticks.append((start + x - 1) / 2)
            labels.append(g)
            x += 1
        ax.set_xticks(ticks)
        ax.set_xticklabels(labels, fontsize=8, rotation=20)
        ax.set_title(f"{dev}: {op} (best config of each method)")
        ax.set_ylabel("GB/s (median, min-max)")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
