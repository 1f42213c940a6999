"""One run of FlexLLMGen's KV I/O pattern under one configuration (runs inside the cgroup).

The replay, per configuration, with the same threads, buffers and data:

- tensors: for each of ``layers`` layers a K and a V of shape
  ``(prompt + gen - 1, batch * heads, hidden // heads)`` (FlexLLMGen's cache layout);
- prefill: rows ``[0:prompt]`` of every K and V are written (K and V of a layer on
  two copy threads at once);
- decode step i (i = 0 .. gen-2), layer by layer: rows ``[0:prompt+i]`` of K and V
  are read into the copy threads' relay buffers and copied ("DMA") to per-tensor
  destination buffers, then row ``prompt+i`` of K and V is written.

Configurations:

- ``baseline``: FlexLLMGen's ``TorchDisk``: one ``.npy`` file per tensor, opened with
  ``np.lib.format.open_memmap`` on every copy and sliced (page cache + mmap);
- ``cachepolicy``: the same, plus ``posix_fadvise(DONTNEED)`` after every write (the last
  access of a step) to the tensors Algorithm 1 keeps out of the page-cache budget
  (the budget less one tensor + readahead in transit per copy thread);
- ``direct``: :class:`phx.kv.KVStore` with everything on the direct (O_DIRECT) path;
- ``dual``: :class:`phx.kv.KVStore` in dual mode with the adaptive pipeline;
- ``dual-mem``: the same with Group 1 in memory that is never written back
  (``KVStore(group1="memory")``), re-planned after the warm-up and rebalanced
  between decode steps (issue 26, parts 1 and 2);
- ``dual-mem-ra``: ``dual-mem`` with read-ahead (issue 26, part 4): before each
  layer is read, the store is asked to start reading the next layers' Group 2 K
  and V (``KVStore.prefetch``, :mod:`phx.kv.readahead`), up to
  :data:`READAHEAD_TENSORS` at once, in buffers its budget counts;
- ``stock-mixed``: FlexLLMGen's own CPU + disk split sized to the budget
  (``Policy(cache_cpu_percent=...)``, its ``TorchMixedDevice``): the first
  columns of axis 1 of every tensor (whole heads of whole batch elements, as
  FlexLLMGen rounds them) in process memory, the rest in the per-tensor memmaps.

Every configuration first warms up (a 2-layer prefill and two decode steps
through the same code, in the same cgroup, files removed) before anything is
timed or the budget is measured.

The page-cache hit rate of every read is taken with ``cachestat`` on the range just
before reading it.  The result is one JSON document on ``--out``.

Verification: every tensor gets its own fresh random bytes (prefill rows and each
decode row), drawn outside the timed parts and hashed (SHA-256) as they are written;
after the run every tensor is read back whole through the configuration's own read
path and its hash compared, so a tensor written to another tensor's place, two
tensors swapped or rows written at the wrong offset all fail the run
(``verified``: false, ``verify.mismatched`` names the tensors).
"""
from __future__ import annotations

import hashlib
import json
import os
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from phx import cgroup as _cgroup
from phx.kv import _sys
from phx.kv.budget import measure_budget
from phx.kv.pipeline import AdaptivePipeline, CopyJob
from phx.kv.planner import cachepolicy_split, readahead_bytes
from phx.kv.slab import round_up



#: numpy has no bfloat16: its bytes are stored as 2-byte integers (the replay only
#: moves bytes; every tensor still gets its own random ones)
STORAGE_DTYPES = {"bfloat16": "<u2"}


#: dual-mem-ra: tensors read ahead at once (buffers of one tensor each), and how
#: many layers past the current one it looks for Group 2 tensors to start
READAHEAD_TENSORS = 8
AHEAD_LAYERS = 8


class Shape:
    """FlexLLMGen's KV layout: per layer a K and a V of
    ``(prompt + gen - 1, batch * kv_heads, head_dim)``; ``kv_heads`` < ``heads`` is
    grouped-query attention (Llama-3-8B: 32 query heads, 8 KV heads of 128)."""

    def __init__(self, c: dict):
        self.layers = c["layers"]
        self.batch = c["batch"]
        self.hidden = c["hidden"]
        self.heads = c["heads"]
        self.kv_heads = c.get("kv_heads") or self.heads
        self.head_dim = self.hidden // self.heads
        self.prompt = c["prompt"]
        self.gen = c["gen"]
        self.dtype_name = c.get("dtype", "float16")
        self.dtype = np.dtype(STORAGE_DTYPES.get(self.dtype_name, self.dtype_name))
        self.rows = self.prompt + self.gen - 1
        self.tshape = (self.rows, self.batch * self.kv_heads, self.head_dim)
        self.row_bytes = self.batch * self.kv_heads * self.head_dim * self.dtype.itemsize
        self.tensor_bytes = self.rows * self.row_bytes
        self.ntensors = 2 * self.layers

    @property
    def working_set(self) -> int:
        return self.ntensors * self.tensor_bytes


def own_cgroup():
    """This process's own memory cgroup level (phx.cgroup), or None."""
    cg = _cgroup.memory()
    return cg.own if cg is not None else None


# -- the I/O layer of each configuration --------------------------------------------
class MemmapIO:
    """FlexLLMGen's disk tier: one .npy per tensor, reopened as a memmap on every copy."""

    def __init__(self, shape: Shape, d: str, evict_from_layer: int | None = None):
        self.s = shape
        self.paths = []
        self.fds = []       # measurement/advice only (cachestat, fadvise)
        self.offs = []
        self.evict_from = evict_from_layer
        for i in range(shape.ntensors):
            p = os.path.join(d, f"t{i}.npy")
            mm = np.lib.format.open_memmap(p, mode="w+", shape=shape.tshape, dtype=shape.dtype)
            self.offs.append(mm.offset)
            del mm
            self.paths.append(p)
            self.fds.append(os.open(p, os.O_RDONLY))

    def _evict(self, tid: int) -> None:
        if self.evict_from is not None and tid // 2 >= self.evict_from:
            os.posix_fadvise(self.fds[tid], 0, 0, os.POSIX_FADV_DONTNEED)

    def write(self, tid: int, start: int, src: np.ndarray) -> None:
        mm = np.lib.format.open_memmap(self.paths[tid])
        n = src.nbytes // self.s.row_bytes
        mm[start:start + n] = src.view(self.s.dtype).reshape((n,) + self.s.tshape[1:])
        del mm
        self._evict(tid)

    def read(self, tid: int, start: int, stop: int, relay: np.ndarray) -> int:
        mm = np.lib.format.open_memmap(self.paths[tid])
        nb = (stop - start) * self.s.row_bytes
        dst = relay[:nb].view(self.s.dtype).reshape((stop - start,) + self.s.tshape[1:])
        np.copyto(dst, mm[start:stop])
        del mm
        # no eviction here: the step's row write comes next and would fault the
        # tensor back in (mmap read-around); evicting after that write is enough
        return nb

    def cached(self, tid: int, start: int, stop: int) -> tuple[int, int]:
        return _sys.cached_pages(self.fds[tid], self.offs[tid] + start * self.s.row_bytes,
                                 (stop - start) * self.s.row_bytes)

    def write_row(self, tid: int, row: int, src: np.ndarray) -> None:
        self.write(tid, row, src)

    def sync(self) -> None:
        pass

    def plan(self) -> dict:
        return {"evict_from_layer": self.evict_from,
                "layers_pagecache": list(range(self.evict_from or 0))
                if self.evict_from is not None else None}

    def close(self) -> None:
        for fd, p in zip(self.fds, self.paths):
            os.close(fd)
            os.unlink(p)


class MixedIO:
    """FlexLLMGen's ``TorchMixedDevice`` for the KV cache (``cache_cpu_percent`` of
    axis 1 in memory, the rest on its disk): per tensor a process-memory segment of
    the first ``ncpu`` columns and a ``.npy`` memmap of the others; a read of rows
    ``[a:b]`` copies both segments into the relay (FlexLLMGen copies each segment
    to its own slice of the GPU buffer)."""

    def __init__(self, shape: Shape, d: str, cpu_percent: float):
        self.s = shape
        cols = shape.tshape[1]
        step = shape.kv_heads              # FlexLLMGen: // num_head * num_head
        self.ncpu = min(cols, int(cols * cpu_percent / 100) // step * step)
        self.cpu_percent = cpu_percent
        self.cpu = [np.zeros((shape.rows, self.ncpu, shape.head_dim), shape.dtype)
                    for _ in range(shape.ntensors)] if self.ncpu else []
        dshape = (shape.rows, cols - self.ncpu, shape.head_dim)
        self.disk = None
        if self.ncpu < cols:
            self.disk = MemmapIO.__new__(MemmapIO)
            sub = Shape.__new__(Shape)
            sub.__dict__.update(shape.__dict__)
            sub.tshape = dshape
            sub.row_bytes = (cols - self.ncpu) * shape.head_dim * shape.dtype.itemsize
            MemmapIO.__init__(self.disk, sub, d)

    def _rows(self, src: np.ndarray, n: int) -> np.ndarray:
        return src.view(self.s.dtype).reshape((n,) + self.s.tshape[1:])

    def write(self, tid: int, start: int, src: np.ndarray) -> None:
        n = src.nbytes // self.s.row_bytes
        a = self._rows(src, n)
        if self.ncpu:
            self.cpu[tid][start:start + n] = a[:, :self.ncpu]
        if self.disk is not None:
            mm = np.lib.format.open_memmap(self.disk.paths[tid])
            mm[start:start + n] = a[:, self.ncpu:]
            del mm

    def write_row(self, tid: int, row: int, src: np.ndarray) -> None:
        self.write(tid, row, src)

    def read(self, tid: int, start: int, stop: int, relay: np.ndarray) -> int:
        n = stop - start
        nb = n * self.s.row_bytes
        dst = self._rows(relay[:nb], n)
        if self.ncpu:
            np.copyto(dst[:, :self.ncpu], self.cpu[tid][start:stop])
        if self.disk is not None:
            mm = np.lib.format.open_memmap(self.disk.paths[tid])
            np.copyto(dst[:, self.ncpu:], mm[start:stop])
            del mm
        return nb

    def cached(self, tid: int, start: int, stop: int) -> tuple[int, int]:
        # memory columns count as hits, the memmap's as cachestat says
        n = stop - start
        mem_pages = (n * self.ncpu * self.s.head_dim * self.s.dtype.itemsize + 4095) // 4096
        if self.disk is None:
            return mem_pages, mem_pages
        h, t = self.disk.cached(tid, start, stop)
        return h + mem_pages, t + mem_pages

    def sync(self) -> None:
        pass

    def plan(self) -> dict:
        return {"cache_cpu_percent": self.cpu_percent, "cpu_columns": self.ncpu,
                "columns": self.s.tshape[1],
                "cpu_bytes": sum(a.nbytes for a in self.cpu)}

    def close(self) -> None:
        if self.disk is not None:
            self.disk.close()
        self.cpu = []


class StoreIO:
    """phx.kv's store (direct-only or dual-path)."""

    def __init__(self, shape: Shape, d: str, mode: str, pinned: int, reserve: int | None,
                 write_behind: bool | None = None, group1: str = "pagecache",
                 readahead: int = 0):
        from phx.kv.store import KVStore
        self.s = shape
        self.store = KVStore(d, mode=mode, pinned_bytes=pinned, reserve=reserve,
                             write_behind=write_behind, group1=group1, readahead=readahead)
        self.t = []
        for L in range(shape.layers):
            self.t.extend(self.store.allocate(L, shape.tshape, shape.dtype))
        self._plan = self.store.plan()
        self._pending = []

    def write(self, tid: int, start: int, src: np.ndarray) -> None:
        self.store.write(self.t[tid], start, src)

    def write_row(self, tid: int, row: int, src: np.ndarray) -> None:
        # the new token's row: submitted, waited for at the end of the step (the page
        # cache gives the memmap baseline the same asynchrony through writeback)
        self._pending.append(self.store.write_async(self.t[tid], row, src))

    def sync(self) -> None:
        for f in self._pending:
            f.result()
        self._pending.clear()

    def read(self, tid: int, start: int, stop: int, relay: np.ndarray) -> int:
        nb = (stop - start) * self.s.row_bytes
        self.store.read(self.t[tid], start, stop, out=relay[:nb])
        return nb

    def cached(self, tid: int, start: int, stop: int) -> tuple[int, int]:
        return self.store.cached_pages(self.t[tid], start, stop)

    def prefetch(self, tid: int, start: int, stop: int) -> bool:
        return self.store.prefetch(self.t[tid], start, stop)

    def plan(self) -> dict:
        p = self.store.last_plan or self._plan
        d = p.as_dict()
        d["moves"] = [list(m) for m in self.store.moves]
        ra = self.store.readahead_report()
        if ra is not None:
            d["readahead"] = ra
        return d

    def rebalance(self) -> dict:
        return self.store.rebalance()

    def close(self) -> None:
        self.store.destroy()


# -- the replay ---------------------------------------------------------------------
def run_worker(c: dict) -> dict:
    s = Shape(c)
    cfg = c["config"]
    d = c["dir"]
    os.makedirs(d, exist_ok=True)
    threads = c.get("threads", 2)
    hitrate = c.get("hitrate", True) and _sys.cachestat_available()
    rng = np.random.default_rng(c.get("seed", 1))
    # "device-side" data, aligned: one layer's K and V prompt rows and one step's
    # new rows of every tensor, refilled with fresh random bytes for each layer
    # and step (every tensor holds its own data; see verify()).  Allocated and
    # touched here so that the probe counts them in the worker's fixed memory.
    srcs = [_sys.aligned_empty(s.prompt * s.row_bytes) for _ in range(2)]
    step_rows = _sys.aligned_empty(s.ntensors * s.row_bytes)
    for a in (*srcs, step_rows):
        _fill(rng, a)
    dev = [_sys.aligned_empty(s.tensor_bytes) for _ in range(2)]   # "GPU" K and V buffers
    for x in dev:
        # touched now, before the budget is measured: untouched pages are not yet
        # charged to the cgroup, and the budget would hand them to Group 1
        x[:] = 0
    pinned = threads * s.tensor_bytes
    lv = own_cgroup()
    base_usage = lv.usage if lv else None
    limit = lv.cap if lv and lv.capped else None
    if cfg == "probe":
        # what the worker holds before any KV I/O: the cap's fixed part
        relays = [_sys.aligned_empty(s.tensor_bytes) for _ in range(threads)]
        for r in relays:
            r[:] = 1
        for x in dev:
            x[:] = 1
        import phx  # noqa: F401  (the engine's bounce buffers)
        # what a configuration's warm-up leaves behind (the engine, threads): the
        # same warm-up as the measured workers, through the direct path
        run_worker({**c, "config": "direct", "layers": min(2, s.layers), "gen": 3,
                    "warmup": False, "hitrate": False, "dir": os.path.join(d, "warm")})
        import shutil
        shutil.rmtree(os.path.join(d, "warm"), ignore_errors=True)
        lv = own_cgroup()
        return {"config": "probe", "usage": lv.usage if lv else None,
                "base_usage_before_buffers": base_usage}

    if cfg == "calibrate":
        return calibrate(s, d, srcs[0], threads)

    if c.get("warmup", True):
        # every configuration warms up the same way before it is measured: a
        # small prefill and two decode steps through its own code (imports,
        # threads, the engine, numpy's first copies), in this cgroup
        warm = {**c, "layers": min(2, s.layers), "gen": 3, "warmup": False,
                "hitrate": False, "corrupt_read": None,
                "dir": os.path.join(d, "warm")}
        run_worker(warm)
        import shutil
        shutil.rmtree(warm["dir"], ignore_errors=True)
    budget = measure_budget(pinned, c.get("reserve"))
    if cfg == "baseline":
        io = MemmapIO(s, d)
    elif cfg == "cachepolicy":
        n1 = cachepolicy_split([round_up(s.tensor_bytes, 4096) * 2] * s.layers, budget.bytes,
                               s.tensor_bytes, threads, readahead_bytes(d))
        io = MemmapIO(s, d, evict_from_layer=n1)
    elif cfg == "stock-mixed":
        # FlexLLMGen's percent of the cache on the CPU, sized to the budget
        pct = max(0.0, min(100.0, 100.0 * budget.bytes / s.working_set))
        io = MixedIO(s, d, pct)
    elif cfg == "direct":
        io = StoreIO(s, d, "direct", pinned, c.get("reserve"))
    elif cfg in ("dual", "dual-nowb"):
        io = StoreIO(s, d, "dual", pinned, c.get("reserve"),
                     write_behind=False if cfg == "dual-nowb" else None)
    elif cfg == "dual-mem":
        io = StoreIO(s, d, "dual", pinned, c.get("reserve"), group1="memory")
    elif cfg == "dual-mem-ra":
        # v2 with Group 2 read ahead: the next layers' K and V start reading while
        # this one is read and copied (READAHEAD_TENSORS buffers, within the cap)
        io = StoreIO(s, d, "dual", pinned, c.get("reserve"), group1="memory",
                     readahead=int(c.get("readahead", READAHEAD_TENSORS)))
    else:
        raise ValueError(f"unknown configuration {cfg}")
    if c.get("corrupt_read") is not None:
        io = _CorruptOneRead(io, int(c["corrupt_read"]), s)

    strategy = c.get("strategy")                 # dual: None = adaptive
    if cfg.startswith("dual"):
        # the store's relays (registered with phx's io_uring as fixed buffers)
        pipe = AdaptivePipeline(s.tensor_bytes, threads, strategy=strategy,
                                relays=io.store.relays())
        relays = pipe.relays
        pool = None
        if cfg.startswith("dual-mem"):
            # the relays exist now (touched, charged): later budgets see them in the
            # cgroup's usage, so they are no longer "still to pin"
            io.store.pinned_bytes = 0
    else:
        pipe = None
        relays = [_sys.aligned_empty(s.tensor_bytes) for _ in range(threads)]
        pool = ThreadPoolExecutor(threads)
    for r in relays:
        r[:] = 0
    dma = c.get("dma", True)
    hit = [0, 0]
    hit_lock = threading.Lock()

    def read_job(tid: int, stop: int):
        def read(relay):
            if hitrate:
                hc, ht = io.cached(tid, 0, stop)
                with hit_lock:
                    hit[0] += hc
                    hit[1] += ht
            return io.read(tid, 0, stop, relay)

        def copy(relay, nb):
            if dma:
                np.copyto(dev[tid % 2][:nb], relay[:nb])
        return CopyJob(read, copy)

    def plain(jobs):
        # FlexLLMGen-style copy threads: each job read + copy on its own thread
        ts = list(pool.map(lambda ij: _plain_one(ij[1], relays[ij[0] % threads]),
                           enumerate(jobs)))
        return sum(ts)

    # what each tensor must hold, hashed as it is written (rows in order)
    digests = [hashlib.sha256() for _ in range(s.ntensors)]
    io0 = _sys.proc_io()
    blk0 = _block_read_bytes()
    # prefill (timed: the writes; not the drawing and hashing of the data)
    t_prefill = 0.0
    layer_s = []
    for L in range(s.layers):
        ws = [(2 * L, srcs[0]), (2 * L + 1, srcs[1])]
        for tid, a in ws:
            if L:
                _fill(rng, a)
            digests[tid].update(a)
        t0 = time.perf_counter()
        if pool is not None:
            list(pool.map(lambda a: io.write(a[0], 0, a[1]), ws))
        else:
            list(pipe._pool.map(lambda a: io.write(a[0], 0, a[1]), ws))
        layer_s.append(time.perf_counter() - t0)
        t_prefill += layer_s[-1]
    io1 = _sys.proc_io()
    blk1 = _block_read_bytes()
    # dual-mem: re-plan with the footprint measured now (after the warm-up and the
    # prefill) and between steps: Group 1 grows into the room the cap has
    rebalances = []
    can_rebalance = hasattr(io, "rebalance") and cfg.startswith("dual-mem")
    if can_rebalance:
        t0 = time.perf_counter()
        rebalances.append({**io.rebalance(), "seconds": time.perf_counter() - t0,
                           "after": "prefill"})
    # decode
    steps = []
    strategies = []
    for i in range(s.gen - 1):
        # this step's new row of every tensor: fresh bytes (untimed; the previous
        # step's writes are done: io.sync() waited for them)
        _fill(rng, step_rows)
        rows = [step_rows[tid * s.row_bytes:(tid + 1) * s.row_bytes]
                for tid in range(s.ntensors)]
        for tid in range(s.ntensors):
            digests[tid].update(rows[tid])
        ts = time.perf_counter()
        if pipe is not None:
            strategies.append(pipe.begin_step())
        stop = s.prompt + i
        ahead = getattr(io, "prefetch", None) if cfg == "dual-mem-ra" else None
        for L in range(s.layers):
            if ahead is not None:
                # the next Group 2 tensors, in the order they will be read (the
                # store starts as many as it has buffers for, Group 2 only)
                for tid in range(2 * L + 2, min(2 * s.layers, 2 * L + 2 + 2 * AHEAD_LAYERS)):
                    ahead(tid, 0, stop)
            jobs = [read_job(2 * L, stop), read_job(2 * L + 1, stop)]
            if pipe is not None:
                pipe.run(jobs)
            else:
                plain(jobs)
            io.write_row(2 * L, stop, rows[2 * L])
            io.write_row(2 * L + 1, stop, rows[2 * L + 1])
        io.sync()
        if pipe is not None:
            pipe.end_step()
        if can_rebalance:
            # inside the step's time: a move costs the decode it delays
            rb = io.rebalance()
            if rb["promoted"] or rb["demoted"]:
                rebalances.append({**rb, "after": f"step {i}"})
        steps.append(time.perf_counter() - ts)
    t_decode = sum(steps)
    io2 = _sys.proc_io()
    blk2 = _block_read_bytes()
    res = {
        "config": cfg,
        "prefill_s": t_prefill,
        "prefill_layer_s": layer_s,
        "decode_s": t_decode,
        "decode_step_s": steps,
        "hit_pages": hit[0],
        "read_pages": hit[1],
        "hit_rate": hit[0] / hit[1] if hit[1] else None,
        "prefill_device_read_bytes": io1.get("read_bytes", 0) - io0.get("read_bytes", 0),
        "prefill_device_write_bytes": io1.get("write_bytes", 0) - io0.get("write_bytes", 0),
        "decode_device_read_bytes": io2.get("read_bytes", 0) - io1.get("read_bytes", 0),
        "decode_device_write_bytes": io2.get("write_bytes", 0) - io1.get("write_bytes", 0),
        "disk_read_bytes_all_processes": (blk2 - blk1) if blk1 is not None else None,
        "decode_logical_read_bytes": sum(2 * s.layers * (s.prompt + i) * s.row_bytes
                                         for i in range(s.gen - 1)),
        "budget": budget.as_dict(),
        "plan": io.plan(),
        "pipeline": pipe.report() if pipe else None,
        "strategies": strategies,
        "rebalances": rebalances,
        "decode_step_median_s": float(np.median(steps)) if steps else None,
        "decode_step_max_s": max(steps) if steps else None,
        # a stall: a step over twice the run's median step (reported, and left in
        # decode_s for every configuration alike)
        "stall_steps": [i for i, x in enumerate(steps) if steps and x > 2 * float(np.median(steps))],
        "cgroup_limit": limit,
        "usage_at_start": base_usage,
        "peak_usage": (own_cgroup() or _cgroup.CgroupLevel("", 0, 0)).peak,
    }
    # after every figure is taken: read each tensor back whole and compare hashes
    mismatched, kv_digest, prefill_digest = verify(io, s, relays[0],
                                                   [d.digest() for d in digests])
    res["verify"] = {"tensors": s.ntensors, "mismatched": mismatched,
                     "how": "SHA-256 of every tensor read back whole through the "
                            "configuration's read path, against the bytes written"}
    res["verified"] = not mismatched
    # the same data in every configuration of a repeat (one seed): these must be
    # equal across configurations (the bench compares them)
    res["kv_digest"] = kv_digest
    res["prefill_digest"] = prefill_digest
    res["corrupt_read"] = c.get("corrupt_read")
    if pipe is not None:
        pipe.close()
    if pool is not None:
        pool.shutdown()
    io.close()
    return res


def _fill(rng: np.random.Generator, a: np.ndarray) -> None:
    """Fresh random bytes into ``a`` (uint8)."""
    a[:] = np.frombuffer(rng.bytes(a.nbytes), dtype=np.uint8)


def verify(io, s: Shape, relay: np.ndarray,
           expected: list[bytes]) -> tuple[list[int], str, str]:
    """Ids of the tensors whose bytes, read back whole, do not hash to ``expected``;
    the SHA-256 of every tensor as read back (in order), and of their prefill rows
    ``[0:prompt]``."""
    bad = []
    whole, pre = hashlib.sha256(), hashlib.sha256()
    for tid in range(s.ntensors):
        relay[:s.tensor_bytes] = 0
        nb = io.read(tid, 0, s.rows, relay)
        whole.update(relay[:nb])
        pre.update(relay[:s.prompt * s.row_bytes])
        if nb != s.tensor_bytes or hashlib.sha256(relay[:nb]).digest() != expected[tid]:
            bad.append(tid)
    return bad, whole.hexdigest(), pre.hexdigest()


class _CorruptOneRead:
    """The negative control: every read of tensor ``tid`` comes back with its
    first prefill byte flipped (the stored bytes are untouched).  The bench runs
    it once and requires the digests to change."""

    def __init__(self, io, tid: int, s: Shape):
        self._io, self._tid = io, tid

    def read(self, tid: int, start: int, stop: int, relay: np.ndarray) -> int:
        nb = self._io.read(tid, start, stop, relay)
        if tid == self._tid and start == 0 and nb:
            relay[0] ^= 0xFF
        return nb

    def __getattr__(self, name: str):
        return getattr(self._io, name)


def calibrate(s: Shape, d: str, src: np.ndarray, threads: int) -> dict:
    """Device read (cold, phx O_DIRECT) and page-cache copy (warm preadv) bandwidths,
    reading rows [0:prompt] of up to 256 MiB of tensors the way decode does."""
    from phx.kv.store import KVStore
    n = max(2, min(s.ntensors, (256 << 20) // s.tensor_bytes))
    relays = [_sys.aligned_empty(s.tensor_bytes) for _ in range(threads)]
    nb = s.prompt * s.row_bytes
    out = {}
    with ThreadPoolExecutor(threads) as pool:
        for mode, key, passes in (("direct", "dev_read_gbps", 1),
                                  ("pagecache", "pagecache_read_gbps", 2)):
            st = KVStore(os.path.join(d, mode), mode=mode)
            ts = [st.allocate_tensor(i, "k", s.tshape, s.dtype) for i in range(n)]
            for t in ts:
                st.write(t, 0, src)
            for _ in range(passes):
                t0 = time.perf_counter()
                list(pool.map(lambda it: st.read(it[1], 0, s.prompt,
                                                 out=relays[it[0] % threads][:nb]),
                              enumerate(ts)))
                dt = time.perf_counter() - t0
            out[key] = n * nb / dt / 1e9
            st.destroy()
    a, b = _sys.aligned_empty(nb), _sys.aligned_empty(nb)
    a[:] = 1
    t0 = time.perf_counter()
    for _ in range(20):
        np.copyto(b, a)
    out["memcpy_gbps"] = 20 * nb / (time.perf_counter() - t0) / 1e9
    out["config"] = "calibrate"
    out["bytes"] = n * nb
    return out


def _plain_one(job: CopyJob, relay: np.ndarray) -> int:
    nb = job.read(relay)
    job.dma(relay, nb)
    return nb


def _block_read_bytes() -> int | None:
    """Bytes read from the disk holding the working directory (all processes)."""
    try:
        dev = os.stat(".").st_dev
        major, minor = os.major(dev), os.minor(dev)
        with open(f"/sys/dev/block/{major}:{minor}/stat") as f:
            return int(f.read().split()[2]) * 512
    except (OSError, IndexError, ValueError):
        return None


def main(argv: list[str]) -> int:
    conf = json.loads(argv[0])
    out = argv[1]
    os.makedirs(conf["dir"], exist_ok=True)
    os.chdir(conf["dir"])
    res = run_worker(conf)
    with open(out, "w") as f:
        json.dump(res, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
