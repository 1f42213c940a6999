"""``PhxL2Backend``: LMCache 0.5.6's storage plugin on phx slab files.

Design, formats and the crash argument: docs/lmcache-l2.md.  LMCache builds
this class from its configuration (``storage_plugins`` + ``extra_config``
``storage_plugin.<name>.module_path`` / ``.class_name``) with ``config``,
``dst_device``, ``metadata``, ``local_cpu_backend`` and ``loop``.
"""
from __future__ import annotations

import asyncio
import collections
import os
import queue
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Optional, Sequence

import numpy as np
import torch

import phx
from lmcache.v1.storage_backend.abstract_backend import StoragePluginInterface

from . import format as fmt
from .slab import SlabSet, log

GiB = 1 << 30

# slot states
_FREE, _DIRTY, _LIVE, _BUSY = 0, 1, 2, 3


class _Entry:
    __slots__ = ("slot", "length", "crc", "seq", "meta", "pins", "readers", "removed", "_m")

    def __init__(self, slot: int, length: int, crc: int, seq: int, meta: bytes) -> None:
        self.slot, self.length, self.crc, self.seq, self.meta = slot, length, crc, seq, meta
        self.pins = 0
        self.readers = 0
        self.removed = False
        self._m: dict[str, Any] | None = None

    def decoded(self) -> dict[str, Any]:
        if self._m is None:
            self._m = fmt.decode_meta(self.meta)
        return self._m


class _Results:
    """What a reader hands over when it runs in the calling thread: a list."""
    __slots__ = ("items",)

    def __init__(self) -> None:
        self.items: collections.deque[Any] = collections.deque()

    def put(self, item: Any) -> None:
        self.items.append(item)

    def get(self) -> Any:
        return self.items.popleft()


class _Put:
    __slots__ = ("ks", "key", "obj", "nbytes", "slot", "crc", "paid", "ok", "tomb", "seq",
                 "meta")

    def __init__(self, ks: str, key: Any, obj: Any, nbytes: int) -> None:
        self.ks, self.key, self.obj, self.nbytes = ks, key, obj, nbytes
        self.slot = -1
        self.crc = 0
        self.paid = False     # payload on disk
        self.ok = False       # header on disk too: published
        self.tomb = False
        self.seq = 0
        self.meta = b""


def _dtype_from_str(s: str) -> torch.dtype:
    d = getattr(torch, s.replace("torch.", ""), None)
    if not isinstance(d, torch.dtype):
        raise ValueError(f"unknown dtype {s!r}")
    return d


def _obj_meta(obj: Any) -> bytes:
    m = obj.metadata
    shapes = m.shapes if m.shapes else [m.shape]
    dtypes = m.dtypes if m.dtypes else [m.dtype]
    cp = m.cached_positions
    return fmt.encode_meta([list(map(int, s)) for s in shapes], [str(d) for d in dtypes],
                           int(m.fmt.value),
                           None if cp is None else [int(x) for x in cp.tolist()])


def _readers(value: Any, name: str = "readers") -> int:
    """``phx_l2.readers`` (or ``writers``): a count, or ``auto`` - the CPUs this
    process may run on, 1 to 8.  A read from a device that copies inside the submitting call
    (zram, a page-cache hit) is one CPU per reader: on the H100 box's 16 CPUs
    one reader got 3.4-4.2 GB/s from zram where LocalDiskBackend's 4 threads
    got 12.4; on the 2-core dev box two readers got 1.25-1.8x one's from zram
    (1-32 MiB chunks) and the same from the disk (docs/lmcache-l2.md).  At
    most 8: a get of LMCache's usual batch (8 chunks) deals one chunk to each."""
    if isinstance(value, str) and value.strip().lower() == "auto":
        return max(1, min(8, len(os.sched_getaffinity(0))))
    try:
        n = int(value)
    except (TypeError, ValueError):
        raise ValueError(f"phx_l2.{name} must be a count or 'auto', not {value!r}") from None
    if n < 1:
        raise ValueError(f"phx_l2.{name} must be at least 1, not {n}")
    return n


def _as_bool(v: Any) -> bool:
    if isinstance(v, str):
        return v.strip().lower() in ("1", "true", "yes", "on")
    return bool(v)


class PhxL2Backend(StoragePluginInterface):  # type: ignore[misc]  # lmcache is untyped
    """Persistent, checksummed KV tier on phx slab files (see module doc)."""

    def __init__(self, config: Any = None, metadata: Any = None,
                 local_cpu_backend: Any = None,
                 loop: Optional[asyncio.AbstractEventLoop] = None,
                 dst_device: str = "cpu") -> None:
        super().__init__(dst_device=dst_device, config=config, metadata=metadata,
                         local_cpu_backend=local_cpu_backend, loop=loop)
        if config is None or local_cpu_backend is None:
            raise ValueError("PhxL2Backend needs LMCache's config and local_cpu_backend "
                             "(local_cpu: true)")
        extra = dict(config.extra_config or {})
        rank = int(getattr(metadata, "worker_id", 0) or 0)
        raw = extra.get("phx_l2.paths") or extra.get("phx_l2.path")
        if not raw:
            raise ValueError("extra_config['phx_l2.paths'] is required (slab file(s) or "
                             "block device(s), comma-separated; {rank} = the worker id)")
        paths = [p.strip().replace("{rank}", str(rank))
                 for p in (raw.split(",") if isinstance(raw, str) else raw) if p.strip()]
        capacity = int(float(extra.get("phx_l2.capacity_gb", 0)) * GiB)
        self.header_bytes = int(extra.get("phx_l2.header_bytes", 4096))
        if self.header_bytes % fmt.ALIGN or self.header_bytes < 512:
            raise ValueError("phx_l2.header_bytes must be a multiple of 4096")
        full = int(local_cpu_backend.get_full_chunk_size_bytes())
        self.slot_bytes = int(extra.get("phx_l2.slot_bytes",
                                        fmt.round_up(self.header_bytes + full)))
        if self.slot_bytes % fmt.ALIGN or self.slot_bytes <= self.header_bytes:
            raise ValueError("phx_l2.slot_bytes must be a multiple of 4096 above header_bytes")
        self.max_queued = int(float(extra.get("phx_l2.max_queued_gb", 1)) * GiB)
        self.verify = _as_bool(extra.get("phx_l2.verify", True))
        self.fsync = _as_bool(extra.get("phx_l2.fsync", False))
        # 16 pieces of 2 MiB in flight per reader: one reader with that beat two with
        # 2 each on one engine (zram, 16 MiB chunks, the loaded 2-core dev box:
        # 1.74/2.19/1.43 vs 1.25/1.54/1.40 GB/s).  Readers now have an engine each.
        self.window = max(1, int(extra.get("phx_l2.read_window", 16)))   # pieces in flight
        self.piece = max(fmt.ALIGN, int(extra.get("phx_l2.read_piece_kb", 2048)) * 1024
                         // fmt.ALIGN * fmt.ALIGN)
        self.readers = _readers(extra.get("phx_l2.readers", "auto"))
        # A batch's payloads dealt to this many engines, written at once: zram
        # (any synchronous block driver) compresses inside the submitting call,
        # so one engine writes at one CPU's speed.  On the 2-core dev box (2
        # writers): zram puts of 4 / 16 / 32 MiB chunks 1.18 / 1.24 / 1.28x one
        # writer, medians of 4 in one run (docs/lmcache-l2.md, "Writers").
        self.writers = _readers(extra.get("phx_l2.writers", "auto"), "writers")
        # Payloads written in pieces of this size (0: each whole): a writer's share
        # is then a batch of enough ops (libphx spreads a waiting batch of 8 or more
        # over io-wq workers where the device copies inline, be_uring.c) - without
        # pieces 8 writers on 16 CPUs wrote 16-32 MiB chunks one op each, inline,
        # on 8 CPUs: zram puts 0.81-0.84x LocalDiskBackend O_DIRECT.
        self.write_piece = max(0, int(extra.get("phx_l2.write_piece_kb", 2048)) * 1024
                               // fmt.ALIGN * fmt.ALIGN)
        preallocate = _as_bool(extra.get("phx_l2.preallocate", True))
        # crc32c of a get's pieces on a thread of its own, one per reader (see
        # _reader); off by default: on the 2-core dev box it cost ~5 % more CPU per
        # byte (the thread hashes from another core's cache) and gained nothing
        # measurable (no free core)
        self.crc_thread = _as_bool(extra.get("phx_l2.crc_thread", False))
        register_pool = _as_bool(extra.get("phx_l2.register_pool", True))
        max_io_kb = int(extra.get("phx_l2.max_io_kb", 0))

        max_io = max_io_kb * 1024 if max_io_kb > 0 else None
        self.counters: dict[str, float] = collections.defaultdict(int)
        self._engine = phx.Engine(max_io_size=max_io)
        self._slab = SlabSet(paths, capacity, self.header_bytes, self.slot_bytes,
                             self._engine, preallocate)
        # Reader (writer) r reads (writes) through engine r: one engine submits
        # under one lock, and on a device that copies inside io_uring_enter (zram)
        # that lock would let only one thread copy at a time.  Engine 0 also
        # writes the headers and tombstones.
        self._engines = [self._engine]
        self._efiles: list[list[Any]] = [[f.f for f in self._slab.files]]
        try:
            for _ in range(1, max(self.readers, self.writers)):
                eng = phx.Engine(max_io_size=max_io)
                self._engines.append(eng)
                self._efiles.append([eng.open(f.path, "r+") for f in self._slab.files])
        except BaseException:
            self._close_engines()
            self._slab.close()
            raise
        self._pool_regs: list[tuple[Any, Any]] = []
        if register_pool:
            self._register_pool(local_cpu_backend)
        n = self._slab.slot_count
        self._lock = threading.Lock()
        self._index: collections.OrderedDict[str, _Entry] = collections.OrderedDict()
        self._state = np.zeros(n, dtype=np.uint8)
        self._pending: dict[str, int] = {}
        self._queued_bytes = 0
        self._seq = 0
        self._logged_bad: set[int] = set()
        self._logged_fail: set[tuple[str, str, Any]] = set()
        # Rebuild the index: newest sequence wins for a key; LRU = sequence order.
        sl = self._slab
        order = np.argsort(sl.seqs, kind="stable")
        keys, metas = sl.keys, sl.metas
        slots, plens, pcrcs, seqs = (a[order].tolist() for a in (sl.slots, sl.plens,
                                                                sl.pcrcs, sl.seqs))
        index = self._index
        for j, i in enumerate(order.tolist()):
            k = keys[i]
            old = index.pop(k, None)
            if old is not None:
                self._state[old.slot] = _DIRTY
            index[k] = _Entry(slots[j], plens[j], pcrcs[j], seqs[j], metas[i])
        # a slot whose header was not believed still has one: tombstone it before reuse
        self._state[np.asarray(sl.dropped_slots, dtype=np.int64)] = _DIRTY
        live = np.asarray([e.slot for e in index.values()], dtype=np.int64)
        self._state[live] = _LIVE
        self._seq = int(sl.seqs.max()) if len(sl.seqs) else 0
        sl.keys, sl.metas = [], []
        self._free: collections.deque[int] = collections.deque(
            int(i) for i in np.flatnonzero(self._state != _LIVE))
        self.counters["recovered"] = len(self._index)
        self.counters["recovery_dropped"] = self._slab.dropped
        self.counters["recovery_s"] = self._slab.recovery_s
        log.info("phx L2: %d slot(s) of %d KiB in %s; %d entries recovered in %.3f s "
                 "(%d dropped); %d reader(s)", n, self.slot_bytes >> 10, ",".join(paths),
                 len(self._index), self._slab.recovery_s, self._slab.dropped, self.readers)

        self._q: queue.Queue[Any] = queue.Queue()
        self._closed = False
        self._hasher = ThreadPoolExecutor(1, thread_name_prefix="phx-l2-crc")
        # reader r's crc thread (one worker each, so a chunk's pieces, all read by
        # one reader, are hashed in order); its thread starts at the first use
        self._read_hashers = [ThreadPoolExecutor(1, thread_name_prefix=f"phx-l2-rcrc{r}")
                              for r in range(self.readers)]
        # the readers' and the payload writers' pool threads: sized by the engines
        # (the larger of the two counts), so no share waits for a thread
        self._io_pool = ThreadPoolExecutor(max(4, 2 * len(self._engines)),
                                           thread_name_prefix="phx-l2-io")
        self._calls = ThreadPoolExecutor(2, thread_name_prefix="phx-l2-get")
        self._writer = threading.Thread(target=self._writer_loop, name="phx-l2-writer",
                                        daemon=True)
        self._writer.start()

    def __str__(self) -> str:
        return "PhxL2Backend"

    def _register_pool(self, local_cpu_backend: Any) -> None:
        """Register LMCache's CPU pool (where every get lands) with the engine as
        io_uring fixed buffers, so that a read does not pin its pages each time
        (LMCache does the same for rust_raw_block's io_uring engine).  Best effort:
        without it (RLIMIT_MEMLOCK, no fixed buffers, an allocator without one
        buffer) reads work as before."""
        try:
            alloc = local_cpu_backend.get_memory_allocator()
            buf = getattr(alloc, "buffer", None)
            if buf is None or not isinstance(buf, torch.Tensor) or buf.device.type != "cpu" \
                    or not buf.is_contiguous():
                log.info("phx L2: LMCache's CPU pool is not one CPU tensor: not registered")
                return
            mv = memoryview(buf.view(torch.uint8).numpy()).cast("B")
        except Exception as e:   # an allocator of another shape: nothing to register
            log.info("phx L2: LMCache's CPU pool not registered: %s", e)
            return
        region = 1 << 30         # io_uring's largest fixed buffer
        done = 0
        try:
            for eng in self._engines:
                for o in range(0, len(mv), region):
                    part = mv[o:o + region]
                    eng.register_buffer(part)
                    self._pool_regs.append((eng, part))
                    done += len(part)
        except (OSError, ValueError) as e:
            log.warning("phx L2: registered %d of %d bytes of LMCache's CPU pool as fixed "
                        "buffers (%s); reads into the rest pin their pages each time",
                        done, len(mv) * len(self._engines), e)
        self.counters["pool_registered_bytes"] = done

    def _close_engines(self) -> None:
        for files in self._efiles[1:]:
            for f in files:
                try:
                    f.close()
                except OSError:
                    pass
        self._efiles = self._efiles[:1]
        for eng in self._engines[1:]:
            eng.close()
        self._engines = self._engines[:1]

    # ------------------------------------------------------------------ lookup
    def contains(self, key: Any, pin: bool = False) -> bool:
        ks = key.to_string()
        with self._lock:
            e = self._index.get(ks)
            if e is None:
                return False
            if pin:
                e.pins += 1
            return True

    def batched_contains(self, keys: list[Any], pin: bool = False) -> int:
        ks = [k.to_string() for k in keys]
        hits = 0
        with self._lock:
            for s in ks:
                e = self._index.get(s)
                if e is None:
                    break
                if pin:
                    e.pins += 1
                hits += 1
        return hits

    async def batched_async_contains(self, lookup_id: str, keys: list[Any],
                                     pin: bool = False) -> int:
        return self.batched_contains(keys, pin)

    def exists_in_put_tasks(self, key: Any) -> bool:
        with self._lock:
            return key.to_string() in self._pending

    def pin(self, key: Any) -> bool:
        return self.contains(key, pin=True)

    def unpin(self, key: Any) -> bool:
        with self._lock:
            e = self._index.get(key.to_string())
            if e is None:
                return False
            if e.pins > 0:
                e.pins -= 1
            return True

    def touch_cache(self) -> None:
        """LRU is updated on every hit and put already."""

    def remove(self, key: Any, force: bool = True) -> bool:
        ks = key.to_string()
        with self._lock:
            e = self._index.get(ks)
            if e is None or (not force and (e.pins or e.readers)):
                return False
            del self._index[ks]
            self._drop_locked(e)
        return True

    def batched_remove(self, keys: list[Any], force: bool = True) -> int:
        return sum(self.remove(k, force) for k in keys)

    def _drop_locked(self, e: _Entry) -> None:
        """An entry left the index: its slot is freed (tombstoned before reuse,
        and soon by the writer) once no get reads it."""
        e.removed = True
        if e.readers == 0:
            self._release_slot_locked(e.slot)

    def _release_slot_locked(self, slot: int) -> None:
        self._state[slot] = _DIRTY
        self._free.append(slot)
        self._q.put(("tomb", slot))

    # ------------------------------------------------------------------ puts
    def batched_submit_put_task(self, keys: Sequence[Any], objs: list[Any],
                                transfer_spec: Any = None,
                                on_complete_callback: Optional[Callable[[Any], None]] = None
                                ) -> Optional[list[Future[None]]]:
        """Queue the objects for the writer thread; never waits for I/O.  Puts
        beyond ``phx_l2.max_queued_gb`` waiting bytes are dropped (counted)."""
        if self._closed:
            return None
        items: list[_Put] = []
        limit = self.slot_bytes - self.header_bytes
        with self._lock:
            for key, obj in zip(keys, objs):
                ks = key.to_string()
                e = self._index.get(ks)
                if e is not None:
                    self._index.move_to_end(ks)
                    continue
                if ks in self._pending:
                    continue
                nbytes = int(obj.get_size())
                if nbytes > limit:
                    self.counters["puts_too_big"] += 1
                    continue
                if self._queued_bytes + nbytes > self.max_queued:
                    self.counters["puts_dropped_queue_full"] += 1
                    continue
                self._pending[ks] = nbytes
                self._queued_bytes += nbytes
                items.append(_Put(ks, key, obj, nbytes))
        if not items:
            return None
        for p in items:
            p.obj.ref_count_up()
        fut: Future[None] = Future()
        self._q.put(("put", items, on_complete_callback, fut))
        return [fut]

    def submit_put_task(self, key: Any, obj: Any,
                        on_complete_callback: Optional[Callable[[Any], None]] = None
                        ) -> Optional[Future[None]]:
        futs = self.batched_submit_put_task([key], [obj],
                                            on_complete_callback=on_complete_callback)
        return futs[0] if futs else None

    async def async_batched_submit_put_task(self, keys: Sequence[Any], objs: list[Any],
                                            transfer_spec: Any = None,
                                            on_complete_callback: Optional[
                                                Callable[[Any], None]] = None) -> None:
        self.batched_submit_put_task(keys, objs, transfer_spec, on_complete_callback)

    def _writer_loop(self) -> None:
        while True:
            item = self._q.get()
            if item is None:
                return
            batch = [item]
            while len(batch) < 64:
                try:
                    nxt = self._q.get_nowait()
                except queue.Empty:
                    break
                if nxt is None:
                    self._q.put(None)
                    break
                batch.append(nxt)
            tombs = [b[1] for b in batch if b[0] == "tomb"]
            puts = [b for b in batch if b[0] == "put"]
            try:
                if tombs:
                    self._write_tombstones(tombs)
                if puts:
                    self._write_puts(puts)
            except BaseException as e:   # never let the writer die silently
                log.exception("phx L2: writer failed: %s", e)

    def _write_tombstones(self, slots: list[int]) -> None:
        with self._lock:
            todo = [s for s in dict.fromkeys(slots) if self._state[s] == _DIRTY]
        if not todo:
            return
        bad = self._tombstone(todo)
        with self._lock:
            for s in todo:
                if s not in bad and self._state[s] == _DIRTY:
                    self._state[s] = _FREE

    def _tombstone(self, slots: list[int]) -> set[int]:
        """Zero the headers of ``slots``; the set of those that failed."""
        hb = self.header_bytes
        zero = phx.empty_aligned(hb)          # not zeroed by the allocator
        np.frombuffer(zero, dtype=np.uint8)[:] = 0
        bad: set[int] = set()
        byfile: dict[int, list[tuple[int, int]]] = collections.defaultdict(list)
        for s in slots:
            f, off = self._slab.locate(s)
            byfile[f.index].append((s, off))
        for fi, lst in byfile.items():
            f = self._slab.files[fi]
            try:
                f.f.pwrite_many(zero, np.array([o for _, o in lst], dtype=np.int64), hb,
                                np.zeros(len(lst), dtype=np.int64))
            except OSError as e:
                self._fail("tombstone", f.path, e)
                bad.update(s for s, _ in lst)
        return bad

    def _fail(self, what: str, path: str, e: BaseException) -> None:
        kind = (what, path, getattr(e, "errno", None))
        with self._lock:         # payload writers run on several threads
            self.counters[f"{what}_failures"] += 1
            first = kind not in self._logged_fail
            self._logged_fail.add(kind)
        if first:
            log.warning("phx L2: %s write failed on %s: %s (further failures of this kind "
                        "are counted in stats(), not logged)", what, path, e)

    def _evict_one_locked(self) -> int:
        for ks, e in self._index.items():
            if e.pins == 0 and e.readers == 0:
                del self._index[ks]
                e.removed = True
                self.counters["evictions"] += 1
                return e.slot
        return -1

    def _write_puts(self, batches: list[Any]) -> None:
        puts: list[_Put] = [p for b in batches for p in b[1]]
        # 1. slots (evicting LRU entries when none is free)
        with self._lock:
            for p in puts:
                if p.ks in self._index:
                    continue
                slot = -1
                while self._free:
                    s = self._free.popleft()
                    if self._state[s] in (_FREE, _DIRTY):
                        slot = s
                        break
                if slot < 0:
                    slot = self._evict_one_locked()
                    if slot >= 0:
                        self._state[slot] = _DIRTY
                if slot < 0:
                    self.counters["puts_no_space"] += 1
                    continue
                p.tomb = self._state[slot] == _DIRTY
                self._state[slot] = _BUSY
                p.slot = slot
        work = [p for p in puts if p.slot >= 0]
        try:
            # 2. tombstones of reused slots, before their payloads are touched
            tomb = [p.slot for p in work if p.tomb]
            bad = self._tombstone(tomb) if tomb else set()
            work = [p for p in work if p.slot not in bad]
            if tomb and self.fsync:
                self._slab.fdatasync()
            # 3. payloads, and their crc32c on another thread meanwhile
            crcs = self._hasher.submit(lambda: [fmt.checksum(p.obj.byte_array) for p in work])
            self._write_payloads(work)
            for p, c in zip(work, crcs.result()):
                p.crc = c
            if self.fsync:
                self._slab.fdatasync()
            _crash_hook("payload")
            # 4. headers
            self._write_headers([p for p in work if p.paid])
            if self.fsync:
                self._slab.fdatasync()
        finally:
            # 5. publish
            with self._lock:
                for p in puts:
                    self._queued_bytes -= self._pending.pop(p.ks, 0)
                    if p.slot < 0:
                        continue
                    if p.ok:
                        self._index[p.ks] = _Entry(p.slot, p.nbytes, p.crc, p.seq, p.meta)
                        self._state[p.slot] = _LIVE
                        self.counters["puts"] += 1
                        self.counters["put_bytes"] += p.nbytes
                    else:
                        self.counters["puts_failed"] += 1
                        self._state[p.slot] = _DIRTY
                        self._free.append(p.slot)
            for p in puts:
                p.obj.ref_count_down()
            for b in batches:
                cb = b[2]
                if cb is not None:
                    for p in b[1]:
                        if p.ok:
                            try:
                                cb(p.key)
                            except Exception as e:
                                log.warning("phx L2: on_complete_callback failed for %s: %s",
                                            p.ks, e)
                b[3].set_result(None)

    def _write_payloads(self, work: list[_Put]) -> None:
        """Every payload of the batch, ``p.paid`` for each: the payloads dealt
        round-robin to ``writers`` engines, each engine's share one waiting
        submission per slab file, the shares written at once (the first in this
        thread, the others on pool threads).  Headers come only after all of
        them, so a crash in between leaves no header over a partial payload."""
        hb = self.header_bytes
        nw = min(self.writers, len(work))
        shares: dict[tuple[int, int], list[tuple[_Put, int]]] = collections.defaultdict(list)
        for j, p in enumerate(work):
            f, off = self._slab.locate(p.slot)
            shares[(j % nw, f.index)].append((p, off + hb))
        jobs = list(shares.items())
        futs = [self._io_pool.submit(self._write_share, w, fi, lst)
                for (w, fi), lst in jobs[1:]]
        try:
            if jobs:
                (w, fi), lst = jobs[0]
                self._write_share(w, fi, lst)
        finally:
            for fu in futs:
                fu.result()      # _write_share raises nothing: failures are in p.paid

    def _write_share(self, w: int, fi: int, lst: list[tuple[_Put, int]]) -> None:
        """One engine's payloads for one slab file, in ``write_piece`` pieces, in
        one ``pwrite_batch`` (a waiting batch, which the io_uring engine spreads
        over io-wq where the device copies inline).  A failed submission says
        that some write failed, not which: its pieces are then written again one
        at a time (headers are not written yet, so rewriting a payload changes
        nothing on disk).  A payload is paid only when all of its pieces were
        written whole."""
        f = self._efiles[w][fi]
        path = self._slab.files[fi].path
        ops: list[tuple[memoryview, int]] = []   # (piece, file offset)
        owner: list[int] = []                     # the payload (index in lst) of each
        for k, (p, off) in enumerate(lst):
            ba = p.obj.byte_array
            step = self.write_piece or max(p.nbytes, 1)   # range() refuses a 0 step
            for p0 in range(0, p.nbytes, step):
                ops.append((ba[p0:min(p0 + step, p.nbytes)], off + p0))
                owner.append(k)
        done: list[Any]
        try:
            done = f.pwrite_batch(ops)
        except OSError:
            done = []
            for buf, off in ops:
                try:
                    done.append(f.pwrite_async(buf, off))
                except OSError as e:
                    done.append(e)
        err: list[Optional[BaseException]] = [None] * len(lst)
        for k, (buf, _), n in zip(owner, ops, done):
            try:
                if isinstance(n, BaseException):
                    raise n
                n = n if isinstance(n, int) else n.result()
                if n != len(buf):
                    raise OSError(0, f"short write {n} of {len(buf)}")
            except OSError as e:
                err[k] = err[k] or e
        for k, (p, _) in enumerate(lst):
            # the pieces cover the payload and each was checked whole above
            bad = err[k]
            p.paid = bad is None
            if bad is not None:
                self._fail("payload", path, bad)

    def _write_headers(self, ok: list[_Put]) -> None:
        if not ok:
            return
        hb = self.header_bytes
        buf = phx.empty_aligned(len(ok) * hb)
        mv = memoryview(buf)
        byfile: dict[int, list[tuple[_Put, int, int]]] = collections.defaultdict(list)
        for i, p in enumerate(ok):
            meta = _obj_meta(p.obj)
            with self._lock:
                self._seq += 1
                seq = self._seq
            p.seq, p.meta = seq, meta
            f, off = self._slab.locate(p.slot)
            try:
                mv[i * hb:(i + 1) * hb] = fmt.encode_slot(
                    f.uuid, fmt.SlotHeader(self._slab.local(p.slot), seq, p.nbytes, p.crc,
                                           p.ks, meta), hb)
            except ValueError as e:
                p.ok = False
                self._fail("header", f.path, e)
                continue
            byfile[f.index].append((p, off, i * hb))
            p.ok = True
        crash_after = _crash_count("header")
        for fi, lst in byfile.items():
            f = self._slab.files[fi]
            if crash_after is not None:
                lst = lst[:crash_after]
            try:
                f.f.pwrite_many(buf, np.array([o for _, o, _ in lst], dtype=np.int64), hb,
                                np.array([b for _, _, b in lst], dtype=np.int64))
            except OSError as e:
                self._fail("header", f.path, e)
                for p, _, _ in lst:
                    p.ok = False
            if crash_after is not None:
                _crash_hook("header", force=True)

    # ------------------------------------------------------------------ gets
    def _take(self, keys: Sequence[Any], prefix: bool) -> list[Optional[_Entry]]:
        out: list[Optional[_Entry]] = []
        ks = [k.to_string() for k in keys]
        with self._lock:
            for s in ks:
                e = self._index.get(s)
                if e is None:
                    if prefix:
                        break
                    out.append(None)
                    continue
                e.readers += 1
                self._index.move_to_end(s)
                out.append(e)
        return out

    def _give_back(self, entries: list[Optional[_Entry]]) -> None:
        with self._lock:
            for e in entries:
                if e is None:
                    continue
                e.readers -= 1
                if e.removed and e.readers == 0 and self._state[e.slot] == _LIVE:
                    self._release_slot_locked(e.slot)

    def _bad(self, ks: str, e: _Entry, why: str, counter: str) -> None:
        self.counters[counter] += 1
        with self._lock:
            if self._index.get(ks) is e:
                del self._index[ks]
                e.removed = True
            first = e.slot not in self._logged_bad
            self._logged_bad.add(e.slot)
        if first:
            f, off = self._slab.locate(e.slot)
            log.warning("phx L2: %s at slot %d (%s offset %d), key %s: served as a miss",
                        why, e.slot, f.path, off, ks)

    def _alloc(self, e: _Entry) -> Any:
        m = e.decoded()
        shapes = [torch.Size(s) for s in m["s"]]
        dtypes = [_dtype_from_str(d) for d in m["d"]]
        from lmcache.v1.memory_management import MemoryFormat
        f = MemoryFormat(m["f"])
        if len(shapes) == 1:
            return self.local_cpu_backend.allocate(shapes[0], dtypes[0], f, busy_loop=False)
        return self.local_cpu_backend.allocate(shapes, dtypes, f, busy_loop=False)

    def _load(self, keys: Sequence[Any], prefix: bool) -> list[Optional[Any]]:
        """Read and verify; a list aligned with ``keys`` (prefix: up to the first miss)."""
        entries = self._take(keys, prefix)
        objs: list[Optional[Any]] = [None] * len(entries)
        try:
            for i, e in enumerate(entries):
                if e is None:
                    continue
                try:
                    o = self._alloc(e)
                except Exception as ex:
                    log.warning("phx L2: cannot allocate for %s: %s", keys[i], ex)
                    o = None
                if o is None:
                    self.counters["get_alloc_failures"] += 1
                    if prefix:
                        break
                    continue
                if int(o.get_size()) != e.length:
                    o.ref_count_down()
                    self._bad(keys[i].to_string(), e, "length mismatch", "header_failures")
                    if prefix:
                        break
                    continue
                objs[i] = o
            self._read_verify(keys, entries, objs)
        finally:
            self._give_back(entries)
        hits = 0
        for i, o in enumerate(objs):
            if o is not None:
                hits += 1
        self.counters["gets"] += len(keys)
        self.counters["hits"] += hits
        if prefix:
            n = 0
            while n < len(objs) and objs[n] is not None:
                n += 1
            for o in objs[n:]:
                if o is not None:
                    o.ref_count_down()
            return objs[:n]
        return objs + [None] * (len(keys) - len(objs))

    def _read_verify(self, keys: Sequence[Any], entries: list[Optional[_Entry]],
                     objs: list[Optional[Any]]) -> None:
        hb = self.header_bytes
        todo = [i for i, o in enumerate(objs) if o is not None]
        if not todo:
            return
        hdr = phx.empty_aligned(len(todo) * hb)
        hmv = memoryview(hdr)
        # Chunks are dealt to the readers whole: each reads its chunks' pieces in
        # order and checksums every piece as soon as it has landed (still in cache).
        nr = min(self.readers, len(todo))
        plans: list[list[tuple[int, int, Any, memoryview, int]]] = [[] for _ in range(nr)]
        piece = self.piece
        for j, i in enumerate(todo):
            e = entries[i]
            assert e is not None
            plan = plans[j % nr]        # (chunk, piece len or -1 = header, file, mv, off)
            f, off = self._slab.locate(e.slot)
            rf = self._efiles[j % nr][f.index]   # reader r's engine
            plan.append((i, -1, rf, hmv[j * hb:(j + 1) * hb], off))
            pay = objs[i].byte_array  # type: ignore[union-attr]  # todo: allocated objects only
            for p0 in range(0, e.length, piece):
                n = min(piece, e.length - p0)
                plan.append((i, n, rf, pay[p0:p0 + n], off + hb + p0))
        # each reader checksums its own pieces, or hands them to its crc thread
        hashers = self._read_hashers if self.crc_thread else [None] * nr
        q: Any
        if nr == 1:
            q = _Results()      # one reader: this thread
            self._reader(plans[0], q, hashers[0])
        else:
            # the others on pool threads, the first here
            q = queue.Queue()
            for r in range(1, nr):
                self._io_pool.submit(self._reader, plans[r], q, hashers[r])
            self._reader(plans[0], q, hashers[0])
        crc: dict[int, Any] = {}
        got: dict[int, int] = {}
        failed: dict[int, str] = {}
        last: dict[int, Any] = {}     # each chunk's last crc future
        try:
            for _ in range(sum(len(p) for p in plans)):
                (i, n, _f, mv, _off), res, c = q.get()
                if not isinstance(c, int):
                    last[i] = c
                if isinstance(res, BaseException) or (n < 0 and res != hb) or \
                        (n >= 0 and res != n):
                    failed.setdefault(i, f"read failed ({res})" if isinstance(res, BaseException)
                                      else "short read (truncated slab?)")
                    continue
                if i in failed:
                    continue
                if n < 0:
                    e = entries[i]
                    assert e is not None
                    h = fmt.decode_slot(mv, self._slab.uuid_of(e.slot), self._slab.local(e.slot))
                    if not isinstance(h, fmt.SlotHeader) or h.key != keys[i].to_string() or \
                            h.payload_len != e.length or h.payload_crc != e.crc or h.seq != e.seq:
                        failed[i] = ("slot header does not match "
                                     f"({h if isinstance(h, str) else 'other entry'})")
                else:
                    got[i] = got.get(i, 0) + n
                    crc[i] = c
        finally:
            # Every crc a crc thread was given has run before memory goes back (a
            # chunk's last future comes after all of its pieces: its reader's crc
            # thread has one worker and runs them in order).
            for i, c in last.items():
                try:
                    v = c.result()
                except Exception as ex:
                    failed.setdefault(i, f"checksum failed ({ex})")
                    continue
                if c is crc.get(i):
                    crc[i] = v
        for i in todo:
            e = entries[i]
            o = objs[i]
            assert e is not None and o is not None
            why = failed.get(i)
            counter = "header_failures"
            if why is None and got.get(i, 0) != e.length:
                why, counter = "short read", "short_reads"
            if why is None and self.verify and crc.get(i, 0) != e.crc:
                why, counter = "payload checksum mismatch", "checksum_failures"
            if why is not None:
                if why.startswith("short") or why.startswith("read failed"):
                    counter = "short_reads"
                o.ref_count_down()
                objs[i] = None
                self._bad(keys[i].to_string(), e, why, counter)
                continue
            m = e.decoded()
            if "p" in m:
                o.metadata.cached_positions = torch.tensor(m["p"], dtype=torch.long)
            self.counters["get_bytes"] += e.length

    def _reader(self, plan: list[tuple[int, int, Any, memoryview, int]], q: Any,
                hasher: Optional[ThreadPoolExecutor]) -> None:
        """Submit the plan's reads (``read_window`` pieces in flight), reap them in
        order, checksum each payload piece as soon as it has landed, hand results
        to ``q``: (item, bytes or exception, running crc32c of the chunk: an int, or
        a Future of it when the crc thread computes it).

        With a ``hasher`` (this reader's crc thread, ``phx_l2.crc_thread``) the
        pieces' crc32c runs there, one piece after another (one worker: a chunk's
        running crc is chained in order), while this thread goes on reading.  That is what overlaps
        checksum and reads on a device that copies in the submitting thread: zram
        (and any synchronous block driver) does the whole read inside
        io_uring_enter, so a crc computed here comes after the read, not beside it."""
        window: collections.deque[tuple[Any, Any]] = collections.deque()
        limit = self.window
        crc: dict[int, Any] = {}
        verify = self.verify
        for item in plan:
            try:
                fut: Any = item[2].pread_async(item[3], item[4])
            except BaseException as e:
                fut = e
            window.append((item, fut))
            # Reap what has landed, oldest first, not only when the window is
            # full: on a device that copies inside the submit (zram) every read
            # has, and each piece is then hashed while it is still in cache
            # (crc32c here: 27 GB/s on a 2 MiB piece in cache, 13.5 from memory;
            # a full window is 32 MiB of copies later).  On a device that DMAs
            # the window fills up to read_window pieces in flight as before.
            while window and (len(window) >= limit or _landed(window[0][1])):
                self._reap(window.popleft(), q, crc, verify, hasher)
        while window:
            self._reap(window.popleft(), q, crc, verify, hasher)

    @staticmethod
    def _reap(w: tuple[Any, Any], q: Any, crc: dict[int, Any], verify: bool,
              hasher: Optional[ThreadPoolExecutor]) -> None:
        item, fut = w
        i, n, _f, mv, _o = item
        if isinstance(fut, BaseException):
            q.put((item, fut, 0))
            return
        try:
            res = fut.result()
        except BaseException as e:
            q.put((item, e, 0))
            return
        if verify and n >= 0 and res == n:
            prev = crc.get(i, 0)
            if hasher is None:
                crc[i] = fmt.checksum(mv, prev)
            else:
                crc[i] = hasher.submit(_crc_step, mv, prev)
        q.put((item, res, crc.get(i, 0)))

    def get_blocking(self, key: Any) -> Optional[Any]:
        return self._load([key], prefix=False)[0]

    def batched_get_blocking(self, keys: list[Any]) -> list[Optional[Any]]:
        return self._load(keys, prefix=False)

    def get_non_blocking(self, key: Any, location: Optional[str] = None) -> Optional[Future[Any]]:
        if not self.contains(key):
            return None
        return self._calls.submit(self.get_blocking, key)

    async def batched_get_non_blocking(self, lookup_id: str, keys: list[Any],
                                       transfer_spec: Any = None) -> list[Any]:
        return await asyncio.to_thread(self._load, keys, True)

    def get_allocator_backend(self) -> Any:
        return self.local_cpu_backend

    # ------------------------------------------------------------------ misc
    def stats(self) -> dict[str, float]:
        with self._lock:
            d = dict(self.counters)
            d["entries"] = len(self._index)
            d["slots"] = self._slab.slot_count
            d["queued_bytes"] = self._queued_bytes
            d["readers"] = self.readers
            d["writers"] = self.writers
        return d

    def flush(self, timeout: float = 60.0) -> bool:
        """Wait until every queued put and tombstone is on disk (tests, close)."""
        deadline = time.monotonic() + timeout
        ev = threading.Event()
        fut: Future[None] = Future()
        fut.add_done_callback(lambda _: ev.set())
        self._q.put(("put", [], None, fut))
        return ev.wait(max(0.0, deadline - time.monotonic()))

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.flush(30.0)
        self._q.put(None)
        self._writer.join(30.0)
        self._hasher.shutdown(wait=True)
        self._io_pool.shutdown(wait=True)
        self._calls.shutdown(wait=True)
        for h in self._read_hashers:
            h.shutdown(wait=True)
        self._slab.close()
        for eng, part in self._pool_regs:
            try:
                eng.unregister_buffer(part)
            except (OSError, ValueError):
                pass
        self._pool_regs = []
        self._close_engines()
        log.info("phx L2: closed: %s", {k: v for k, v in self.stats().items() if v})


def _landed(fut: Any) -> bool:
    """Whether a read submitted by a reader has completed (or failed at submission)."""
    return isinstance(fut, BaseException) or fut.done()


def _crc_step(mv: memoryview, prev: Any) -> int:
    """One piece's crc32c, continuing ``prev`` (an int, or the Future of the
    piece before it: done already, the crc thread runs them in order)."""
    return fmt.checksum(mv, prev if isinstance(prev, int) else prev.result())


def _crash_count(stage: str) -> int | None:
    """Test hook (PHX_L2_TEST_CRASH=header:N): write only N headers, then die."""
    v = os.environ.get("PHX_L2_TEST_CRASH", "")
    if not v.startswith(stage + ":"):
        return None
    return int(v.split(":", 1)[1])


def _crash_hook(stage: str, force: bool = False) -> None:
    """Test hook: SIGKILL this process at a stage of a put batch
    (PHX_L2_TEST_CRASH=payload: after the payloads, before any header)."""
    v = os.environ.get("PHX_L2_TEST_CRASH", "")
    if v == stage or force:
        os.kill(os.getpid(), 9)
