"""A drop-in for FlexLLMGen's disk device (``flexgen==0.1.8`` ``TorchDisk``) on phx.kv.

FlexLLMGen builds ``TorchDisk(args.offload_dir)`` in ``flex_opt.py``; its tensors
are one ``.npy`` memmap each, moved by four copy threads through 2 GiB pinned
relays.  :class:`PhxDisk` has the same interface (``allocate``, ``delete``,
``init_cache_one_gpu_batch``, ``submit_copy``, ``synchronize``,
``close_copy_threads``, ``add_link``, ``compressed_device``) and keeps the KV
cache in a :class:`phx.kv.KVStore`:

- ``mode="dual"``: Dual-Blade: Algorithm 1 puts the first layers whose K and V fit
  the measured page-cache budget on the page-cache path, the rest on phx's
  O_DIRECT slab; Overlap-Intra / Overlap-Cross chosen over decode steps 2 and 3;
- ``mode="direct"``: NVMe-direct-only (everything O_DIRECT);
- ``mode="cachepolicy"``: CachePolicy-only: everything through the page cache,
  ``posix_fadvise(DONTNEED)`` after every write to the layers Algorithm 1 leaves
  outside the budget (less one tensor + readahead in transit per copy thread:
  :func:`phx.kv.planner.cachepolicy_split`, the one definition ``phx bench kv``
  uses too);
- ``mode="dual-mem"``: Dual-Blade v2: Group 1 in memory that is never written
  back (``KVStore(group1="memory")``), re-planned at every decode step's first
  synchronisation (:meth:`phx.kv.KVStore.rebalance`: the non-KV footprint is
  measured then, Group 2 layers promoted where room appeared, Group 1 shrunk
  where it went), with the store's guard against the OOM killer.

Every KV tensor's prefill rows are hashed as the tensor is deleted (read back
through the store, so a corrupted read changes it): :meth:`PhxDisk.kv_digest`
is one SHA-256 over them in allocation order, comparable across configurations
(``run_four.py`` computes the same for stock FlexLLMGen).  ``corrupt_read=True``
is the negative control: every read of the first KV tensor comes back with one
byte flipped.

GPU tensors move through the store's Co-DMA relays (:mod:`phx.kv.codma`: one
pinned relay of one K or V tensor per copy thread, with its own CUDA stream); CPU
tensors are read and written directly.  A tensor's ``data`` is its
:class:`phx.kv.KVTensor` handle, not a file name: FlexLLMGen code that opens disk
tensors as files (``load_from_np`` of weights placed on disk) is not supported --
place weights and activations on the GPU or CPU (``--percent 100 0 0 0 100 0``).

Use: ``flexgen.flex_opt.TorchDisk = PhxDisk`` before ``run_flexgen``, or build
``ExecutionEnv(..., disk=PhxDisk(dir, mode=...))`` yourself (``run_four.py``).
"""
from __future__ import annotations

import os
import queue
import threading
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from flexgen import pytorch_backend as pb
from flexgen.compression import TorchCompressedDevice

pb.fix_recursive_import()      # as flex_opt.py does: pytorch_backend's late imports

import hashlib

from phx.kv import KVStore, RelayPool
from phx.kv.planner import cachepolicy_split, readahead_bytes
from phx.kv.slab import PageCacheBackend, round_up

MODES = ("dual", "direct", "cachepolicy", "dual-mem")
INTRA, CROSS = "overlap-intra", "overlap-cross"


def _rows(indices: Sequence[slice] | None, shape: Sequence[int]) -> tuple[int, int, bool]:
    """(first row, end row, whole rows?) of FlexLLMGen's slice tuple on a tensor."""
    if not indices:
        return 0, shape[0], True
    r = indices[0]
    a = 0 if r.start is None else r.start
    b = shape[0] if r.stop is None else r.stop
    whole = all((s.start in (None, 0)) and (s.stop in (None, n)) and s.step in (None, 1)
                for s, n in zip(indices[1:], shape[1:]))
    return a, b, whole and (r.step in (None, 1))


class _Overlap:
    """Dual-Blade's adaptive pipeline over FlexLLMGen's copy threads.

    Decode step k begins with the read of the first KV tensor.  Step 1 runs
    Overlap-Intra unmeasured (cold cache), step 2 Intra and step 3 Cross, each
    timed (bytes read / time some copy was busy); the faster is locked.  Intra:
    storage reads in parallel, GPU copies one at a time; Cross: storage reads one
    at a time too, so each read overlaps another thread's copy.
    """

    def __init__(self, forced: str | None = None):
        self.forced = forced
        self.locked = forced
        self.step = 0
        self.measured: dict[str, dict[str, float]] = {}
        self.read_lock = threading.Lock()
        self.dma_lock = threading.Lock()
        self._lock = threading.Lock()
        self._active = 0
        self._since = 0.0
        self._busy = 0.0
        self._bytes = 0

    @property
    def strategy(self) -> str:
        if self.locked:
            return self.locked
        return CROSS if self.step == 3 else INTRA

    def begin_read(self, first_tensor: bool) -> None:
        with self._lock:
            if first_tensor:
                self._finish_step()
                self.step += 1
                self._busy, self._bytes = 0.0, 0
            if self._active == 0:
                self._since = time.perf_counter()
            self._active += 1

    def end_read(self, nbytes: int) -> None:
        with self._lock:
            self._active -= 1
            self._bytes += nbytes
            if self._active == 0:
                self._busy += time.perf_counter() - self._since

    def _finish_step(self) -> None:
        if self.locked is not None and not self.measured:
            return
        if self.step in (2, 3) and self.locked is None:
            s = INTRA if self.step == 2 else CROSS
            self.measured[s] = {"seconds": self._busy, "bytes": self._bytes,
                                "gbps": self._bytes / self._busy / 1e9 if self._busy else 0.0}
            if self.step == 3:
                self.locked = (CROSS if self.measured[CROSS]["gbps"] > self.measured[INTRA]["gbps"]
                               else INTRA)

    def report(self) -> dict[str, Any]:
        return {"choice": self.locked, "forced": self.forced is not None,
                "probe": self.measured, "steps": self.step}


class PhxDisk:
    """FlexLLMGen's ``TorchDisk`` interface on :class:`phx.kv.KVStore`.

    Args:
        path: offload directory (``--offload-dir``).
        mem_capacity, cuda_id, num_copy_threads: as ``TorchDisk``'s.
        mode: ``dual`` | ``direct`` | ``cachepolicy``.
        relay_bytes: bytes of each copy thread's pinned relay (one K or V tensor of
            the run; default: made on the first GPU copy from the tensors then).
        budget, reserve: passed to the store (B_pc override / budgeter reserve).
        strategy: force Overlap-Intra or -Cross (default: adaptive, dual only).
        write_behind: passed to the store (start the writeback of large page-cache
            writes at once; ``None``: the store's default, on for ``dual``).
        readahead: KV tensors of the next layers whose Group 2 rows are read
            ahead while a layer loads (host buffers of one tensor each, counted
            in the store's budget; :mod:`phx.kv.readahead`).  0: none.
    """

    store: KVStore          # set_path()'s

    def __init__(self, path: str, mem_capacity: int | None = None, cuda_id: int = 0,
                 num_copy_threads: int = 4, *,
                 mode: str = "dual", relay_bytes: int | None = None,
                 budget: int | None = None, reserve: int | None = None,
                 strategy: str | None = None, write_behind: bool | None = None,
                 corrupt_read: bool = False, readahead: int = 0):
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}")
        self.name = path
        self.mem_capacity = mem_capacity
        self.device_type = pb.DeviceType.DISK
        self.compressed_device = TorchCompressedDevice(self)
        self.links: dict[Any, Any] = {}
        self.mode = mode
        self.cuda_id = cuda_id
        self.num_copy_threads = num_copy_threads
        self._budget, self._reserve = budget, reserve
        self._strategy = strategy
        self._write_behind = write_behind
        self.corrupt_read = corrupt_read
        self.readahead = int(readahead)
        self.relays: RelayPool | None = None
        if relay_bytes and torch.cuda.is_available():
            # made once, outside any later memory cap (FlexLLMGen's relays are too),
            # registered with the engine of the stores' slabs (phx's default one)
            import phx
            self.relays = RelayPool(num_copy_threads, round_up(relay_bytes, 4096), cuda_id,
                                    phx.default_engine())
        self.set_path(path)
        self.copy_queue: queue.Queue[Any] | None = queue.Queue()
        self._errors: list[BaseException] = []
        self.copy_threads = [threading.Thread(target=self._copy_worker, daemon=True)
                             for _ in range(num_copy_threads)]
        for t in self.copy_threads:
            t.start()
        pb.global_disk_device = self

    # -- the store ----------------------------------------------------------
    def set_path(self, path: str) -> None:
        """Start over in ``path``: a new store (new budget and plan), files of the old
        one removed.  The relays are kept."""
        old = getattr(self, "store", None)
        if old is not None:
            old.destroy()
        self.path = os.path.abspath(os.path.expanduser(path))
        os.makedirs(self.path, exist_ok=True)
        smode = {"dual": "dual", "direct": "direct", "cachepolicy": "pagecache",
                 "dual-mem": "dual"}[self.mode]
        self.store = KVStore(self.path, mode=smode, budget=self._budget, reserve=self._reserve,
                             copy_threads=self.num_copy_threads, relays=self.relays,
                             write_behind=self._write_behind,
                             group1="memory" if self.mode == "dual-mem" else "pagecache",
                             readahead=self.readahead,
                             device=self.cuda_id if self.relays is None and
                             torch.cuda.is_available() else None)
        self._planned = False
        self._evict_from: int | None = None
        self._layer = 0
        self.overlap = _Overlap(self._strategy if self.mode.startswith("dual") else INTRA)
        self._prompt_rows: int | None = None
        self._cache_ids: set[int] = set()
        self._digests: dict[int, str] = {}
        self._rebalanced_step = 0
        self.rebalances: list[dict[str, Any]] = []

    def add_link(self, link: Any) -> None:
        dst = link.b if link.a == self else link.a
        self.links[dst] = link

    def allocate(self, shape: Sequence[int], dtype: Any, pin_memory: bool | None = None,
                 name: str | None = None, layer: int | None = None) -> Any:
        name = name or pb.TorchTensor.next_name()
        if layer is None:
            layer = self._layer
            self._layer += 1
        kv = self.store.allocate_tensor(layer, name, tuple(shape), np.dtype(dtype))
        return pb.TorchTensor(shape, pb.np_dtype_to_torch_dtype[dtype], kv, self, name=name)

    def delete(self, tensor: Any) -> None:
        kv = tensor.data
        # a tensor of a store set_path() already removed is gone with its files
        if kv is not None and kv in self.store.tensors():
            if kv.id in self._cache_ids and self._prompt_rows and kv.materialized:
                # the prefill's KV as the store gives it back
                rows = self.store.read(kv, 0, min(self._prompt_rows, kv.rows))
                b = np.ascontiguousarray(rows).view(np.uint8)
                if self.corrupt_read and kv.id == min(self._cache_ids):
                    b = b.copy()
                    b.reshape(-1)[0] ^= 0xFF
                self._digests[kv.id] = hashlib.sha256(b).hexdigest()
            self.store.free(kv)

    def kv_digest(self) -> str | None:
        """SHA-256 over every deleted KV cache tensor's prefill rows, in allocation
        order (None before any was deleted)."""
        if not self._digests:
            return None
        h = hashlib.sha256()
        for i in sorted(self._digests):
            h.update(self._digests[i].encode())
        return h.hexdigest()

    def init_cache_one_gpu_batch(self, config: Any, task: Any, policy: Any) -> tuple[Any, Any]:
        shape = (task.prompt_len + task.gen_len - 1, policy.gpu_batch_size * config.n_head,
                 config.input_dim // config.n_head)
        layer = self._layer                      # K and V of one layer: one (K, V) pair
        self._layer += 1
        self._prompt_rows = task.prompt_len
        k, v = (self.allocate(shape, np.float16, layer=layer),
                self.allocate(shape, np.float16, layer=layer))
        self._cache_ids.update((k.data.id, v.data.id))
        return k, v

    # -- copies -------------------------------------------------------------
    def _queue(self) -> queue.Queue[Any]:
        q = self.copy_queue
        if q is None:
            raise RuntimeError("PhxDisk is closed: its copy threads are stopped")
        return q

    def submit_copy(self, *args: Any) -> None:
        # A store of GPU memory waits, on the GPU, for the work queued before
        # this call only: an event recorded now, in FlexLLMGen's thread, on its
        # current stream.  Waiting for the producer's stream when a copy thread
        # gets to the store also waited for what FlexLLMGen queued meanwhile -
        # the next layer's compute - so no store overlapped compute (issue 26,
        # part 3; stock FlexLLMGen copies on a stream of its own).
        dst, _, src, _ = args
        data = getattr(src, "data", None)
        ev = None
        if dst.device is self and isinstance(data, torch.Tensor) and data.is_cuda:
            ev = torch.cuda.Event()  # type: ignore[no-untyped-call]  # torch: unannotated
            ev.record(torch.cuda.current_stream(data.device))
        self._queue().put_nowait((args, ev))

    def synchronize(self) -> None:
        self._queue().join()
        if self._errors:
            e, self._errors = self._errors[0], []
            raise e
        if self.mode == "dual-mem" and self.overlap.step > self._rebalanced_step:
            # a safe point (no copy in flight) in a new decode step: re-plan with
            # the footprint measured now
            self._rebalanced_step = self.overlap.step
            t0 = time.perf_counter()
            r = self.store.rebalance()
            if r["promoted"] or r["demoted"]:
                self.rebalances.append({**r, "step": self.overlap.step,
                                        "seconds": time.perf_counter() - t0})

    def _plan(self) -> None:
        plan = self.store.plan()
        if self.mode == "cachepolicy" and self._evict_from is None:
            ts = [t for t in self.store.tensors()]
            layers = sorted({t.layer for t in ts})
            pair = {L: 0 for L in layers}
            for t in ts:
                pair[t.layer] += round_up(t.nbytes, 4096)
            big = max((t.nbytes for t in ts), default=0)
            n1 = cachepolicy_split([pair[L] for L in layers], plan.budget.bytes, big,
                                   self.num_copy_threads, readahead_bytes(self.path))
            self._evict_from = layers[n1] if n1 < len(layers) else None
        self._planned = True

    def _copy_worker(self) -> None:
        stream = None
        if torch.cuda.is_available():
            torch.cuda.set_device(self.cuda_id)
            # this thread's stream for what a store queues (a contiguous copy, a
            # row merge) after the submitter's event; the relay's D2H is ordered
            # after it, and the store waits for that D2H before it returns, so
            # nothing of it is left on this stream when the copy is done
            stream = torch.cuda.Stream()  # type: ignore[no-untyped-call]  # torch: unannotated
        q = self._queue()
        while True:
            item = q.get()
            if item is None:
                q.task_done()
                return
            args, ev = item
            try:
                if ev is not None and stream is not None:
                    stream.wait_event(ev)
                    args[2].data.record_stream(stream)   # the allocator: in use here too
                    with torch.cuda.stream(stream):
                        self._copy(*args)
                else:
                    self._copy(*args)
            except BaseException as e:       # FlexLLMGen's threads would die silently
                self._errors.append(e)
            finally:
                q.task_done()

    def _copy(self, dst: Any, dst_indices: Any, src: Any, src_indices: Any) -> None:
        if src.device is self:
            self._load(dst, dst_indices, src, src_indices)
        elif dst.device is self:
            self._store(dst, dst_indices, src, src_indices)
        else:
            # FlexLLMGen also relays unpinned CPU <- GPU copies through the disk's threads
            d = dst.data[dst_indices] if dst_indices else dst.data
            s = src.data[src_indices] if src_indices else src.data
            d.copy_(s)

    def _ready(self) -> None:
        """Plan once, at the first copy (FlexLLMGen allocates every layer's cache
        before it); tensors allocated later are bound by the store on first use."""
        if not self._planned:
            with self.store._lock:
                if not self._planned:
                    self._plan()

    def _load(self, dst: Any, dst_indices: Any, src: Any, src_indices: Any) -> None:
        self._ready()
        kv = src.data
        a, b, whole = _rows(src_indices, src.shape)
        out = dst.data[dst_indices] if dst_indices else dst.data
        ov = self.overlap
        # the first KV tensor's read starts a decode step
        ov.begin_read(kv.id == min(t.id for t in self.store.tensors()))
        if self.readahead and kv.id in self._cache_ids:
            self._read_ahead(kv, a, b)
        try:
            if not whole or not out.is_contiguous():
                tmp = torch.empty((b - a,) + tuple(src.shape[1:]), dtype=src.dtype,
                                  device=out.device)
                self._read_rows(kv, a, b, tmp, ov)
                out.copy_(tmp[(slice(None),) + tuple(src_indices[1:])] if src_indices else tmp)
            else:
                self._read_rows(kv, a, b, out, ov)
        finally:
            ov.end_read((b - a) * kv.row_bytes)

    def _read_ahead(self, kv: Any, a: int, b: int) -> None:
        """Start reading the same rows of the next KV tensors (the next layers'
        K and V, in the order FlexLLMGen loads them); the store reads only Group
        2 tensors ahead, as many as it has buffers for."""
        ts = {t.id: t for t in self.store.tensors()}
        nxt = sorted(i for i in self._cache_ids if i > kv.id and i in ts)
        for i in nxt[:2 * self.readahead]:
            t = ts[i]
            if b <= t.rows:
                self.store.prefetch(t, a, b)

    def _read_rows(self, kv: Any, a: int, b: int, out: torch.Tensor, ov: _Overlap) -> None:
        self._read_rows_plain(kv, a, b, out, ov)
        if self.corrupt_read and kv.id == min(self._cache_ids, default=-1) and b > a:
            # the negative control: the first KV tensor's rows come back changed
            flat = out.view(-1)
            flat[0] = -flat[0] + 1

    def _read_rows_plain(self, kv: Any, a: int, b: int, out: torch.Tensor,
                         ov: _Overlap) -> None:
        if out.is_cuda:
            job = self.store.copy_job(kv, a, b, out)
            with self.store.relays(out.device.index or 0).acquire() as r:
                if ov.strategy == CROSS:
                    with ov.read_lock:
                        nb = job.read(r.buf)
                else:
                    nb = job.read(r.buf)
                with ov.dma_lock:
                    job.dma(r.buf, nb)
        else:
            self.store.read(kv, a, b, out=out)

    def _store(self, dst: Any, dst_indices: Any, src: Any, src_indices: Any) -> None:
        self._ready()
        kv = dst.data
        a, b, whole = _rows(dst_indices, dst.shape)
        data = src.data[src_indices] if src_indices else src.data
        if not whole:
            # a part of each row: read the rows, change them, write them back
            cur = torch.empty((b - a,) + tuple(dst.shape[1:]), dtype=dst.dtype,
                              device=data.device)
            self.store.read(kv, a, b, out=cur)
            cur[(slice(None),) + tuple(dst_indices[1:])] = data
            data = cur
        self.store.write(kv, a, data.contiguous())
        if self._evict_from is not None and kv.layer >= self._evict_from:
            be = self.store.backend_of(kv)     # the page cache: cachepolicy mode
            if isinstance(be, PageCacheBackend) and kv.extent is not None:
                be.evict(kv.extent)

    def close_copy_threads(self) -> None:
        if self.copy_queue is None:
            return
        for _ in self.copy_threads:
            self.copy_queue.put_nowait(None)
        for t in self.copy_threads:
            t.join()
        self.copy_queue.join()
        self.copy_queue = None

    def close(self) -> None:
        """Stop the threads, remove the files, release the relays."""
        self.close_copy_threads()
        if self.store is not None:
            self.store.destroy()
        if self.relays is not None:
            self.relays.close()
            self.relays = None

    # -- what the runner reports --------------------------------------------
    def stats(self) -> dict[str, Any]:
        plan = self.store.last_plan
        pool = self.relays or self.store.relay_pool
        return {"mode": self.mode, "plan": plan.as_dict() if plan else None,
                "evict_from_layer": self._evict_from,
                "pipeline": self.overlap.report() if self.mode.startswith("dual") else None,
                "kv_digest": self.kv_digest(),
                "rebalances": self.rebalances,
                "moves": [list(m) for m in self.store.moves],
                "readahead": self.store.readahead_report(),
                "relays": pool.stats() if pool else None}

    def mem_stats(self) -> None:
        raise NotImplementedError()

    def print_stats(self) -> None:
        raise NotImplementedError()

    def __del__(self) -> None:
        try:
            self.close_copy_threads()
        except Exception:
            pass
