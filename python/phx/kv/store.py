"""The dual-path KV store: per-layer K and V tensors ("KV placement units", KPUs).

Each KPU is a 2-D-or-more array whose first axis is the token row (FlexLLMGen's
layout: ``(rows, batch*heads, head_dim)``).  A budgeter measures the page-cache
budget, Algorithm 1 puts the first layers whose (K, V) pairs fit it on the
page-cache path (Group 1: one buffered file) and the rest on the direct path
(Group 2: O_DIRECT through phx into one slab file, or any :class:`DirectBackend`),
tensors of one run placed back to back.

Binding is logical: planning only assigns groups and extents (the map M: tensor
-> <start, length>); storage is allocated when a tensor is first read or written.
Rows are packed in row-major order from an aligned extent start, so a read of rows
``[0:n]`` -- what every decode step does -- starts aligned; ranges whose byte
offsets are not block-aligned are handled by phx's bounce buffers.
"""
from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from phx.kv import _sys
from phx.kv.nvme_backend import from_env as nvme_from_env
from phx.kv import budget as _budget
from phx.kv.budget import Budget, MiB, cgroup_memory, measure_budget
from phx.kv.planner import DIRECT, PAGECACHE, Placement, place_layers
from phx.kv.readahead import ReadAhead
from phx.kv.slab import (DirectBackend, Extent, MemoryBackend, PageCacheBackend, SlabBackend,
                         round_up)

if TYPE_CHECKING:
    from phx import Engine, PhxFuture
    from phx.gpu import _View
    from phx.kv.codma import Relay, RelayPool
    from phx.kv.pipeline import CopyJob

MODES = ("dual", "direct", "pagecache")
#: where Group 1 lives: a buffered file (the paper's page-cache path) or a memfd
#: (shmem) that is never written back (Dual-Blade v2, issue 26)
GROUP1_KINDS = ("pagecache", "memory")
#: the copy buffer of a move between the groups (small: a move under memory
#: pressure must not need much memory)
MOVE_CHUNK = 1 << 20


class _Gate:
    """Many I/O calls at once, or one move between the groups (which waits for the
    calls in progress and holds new ones back).  A thread already inside passes
    again (a read that falls back to another read)."""

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._active = 0
        self._moving = False
        self._mine = threading.local()

    @contextmanager
    def shared(self) -> Iterator[None]:
        depth = getattr(self._mine, "depth", 0)
        if depth:
            self._mine.depth = depth + 1
            try:
                yield
            finally:
                self._mine.depth = depth
            return
        with self._cv:
            while self._moving:
                self._cv.wait()
            self._active += 1
        self._mine.depth = 1
        try:
            yield
        finally:
            self._mine.depth = 0
            with self._cv:
                self._active -= 1
                if not self._active:
                    self._cv.notify_all()

    @contextmanager
    def exclusive(self) -> Iterator[None]:
        if getattr(self._mine, "depth", 0):
            raise RuntimeError("a move between the groups from inside an I/O call")
        with self._cv:
            while self._moving:
                self._cv.wait()
            self._moving = True
            while self._active:
                self._cv.wait()
        try:
            yield
        finally:
            with self._cv:
                self._moving = False
                self._cv.notify_all()
GROUP_NAMES = {PAGECACHE: "pagecache", DIRECT: "direct", None: "unbound"}


def _itemsize(dtype: Any) -> tuple[int, bool]:
    """(bytes per element, is a torch dtype)."""
    try:
        return np.dtype(dtype).itemsize, False
    except TypeError:
        import torch
        if isinstance(dtype, torch.dtype):
            return torch.empty((), dtype=dtype).element_size(), True
        raise


def _byte_view(obj: Any, writable: bool) -> npt.NDArray[np.uint8]:
    """A flat uint8 numpy view of a contiguous numpy array or CPU torch tensor
    (GPU buffers are resolved by :func:`phx.kv.codma.gpu_view` before this)."""
    if isinstance(obj, np.ndarray):
        if not obj.flags.c_contiguous:
            raise ValueError("KV arrays must be C-contiguous")
        if writable and not obj.flags.writeable:
            raise ValueError("destination array is read-only")
        return obj.reshape(-1).view(np.uint8)
    mod = type(obj).__module__
    if mod.startswith("torch"):
        import torch
        if obj.device.type != "cpu":
            raise ValueError(f"{obj.device} tensors are not supported (CPU or CUDA only)")
        if not obj.is_contiguous():
            raise ValueError("KV tensors must be contiguous")
        out: npt.NDArray[np.uint8] = obj.detach().reshape(-1).view(torch.uint8).numpy()
        return out
    mv = memoryview(obj)
    if not mv.c_contiguous:
        raise ValueError("KV buffers must be contiguous")
    return np.frombuffer(mv.cast("B"), dtype=np.uint8)


class KVTensor:
    """A handle on one KPU of a :class:`KVStore` (never touch storage directly)."""

    __slots__ = ("id", "layer", "kind", "shape", "dtype", "row_bytes", "nbytes",
                 "group", "extent", "materialized", "freed", "_torch")

    def __init__(self, tid: int, layer: int, kind: str, shape: tuple[int, ...], dtype: Any):
        if len(shape) < 1 or any(int(s) <= 0 for s in shape):
            raise ValueError(f"bad KV shape {shape}")
        item, is_torch = _itemsize(dtype)
        self.id = tid
        self.layer = int(layer)
        self.kind = kind
        self.shape = tuple(int(s) for s in shape)
        self.dtype = dtype
        self._torch = is_torch
        self.row_bytes = int(np.prod(self.shape[1:], dtype=np.int64)) * item
        self.nbytes = self.row_bytes * self.shape[0]
        self.group: int | None = None
        self.extent: Extent | None = None
        self.materialized = False
        self.freed = False

    @property
    def rows(self) -> int:
        return self.shape[0]

    def __repr__(self) -> str:
        return (f"KVTensor(layer={self.layer}, kind={self.kind!r}, shape={self.shape}, "
                f"group={GROUP_NAMES[self.group]}, extent={self.extent})")


@dataclass
class Plan:
    """What :meth:`KVStore.plan` decided, with the numbers behind it."""
    mode: str
    budget: Budget
    knob: int
    placement: Placement | None
    tensors: list[KVTensor] = field(default_factory=list)

    @property
    def n1(self) -> int:
        """Layers on the page-cache path (all bound tensors, not only the last run)."""
        return len({t.layer for t in self.tensors if t.group == PAGECACHE})

    def group_bytes(self, group: int) -> int:
        return sum(t.extent.length for t in self.tensors if t.group == group and t.extent)

    def as_dict(self) -> dict[str, Any]:
        return {
            "mode": self.mode,
            "budget": self.budget.as_dict(),
            "knob": self.knob,
            "layers_pagecache": sorted({t.layer for t in self.tensors if t.group == PAGECACHE}),
            "layers_direct": sorted({t.layer for t in self.tensors if t.group == DIRECT}),
            "pagecache_bytes": self.group_bytes(PAGECACHE),
            "direct_bytes": self.group_bytes(DIRECT),
        }

    def __str__(self) -> str:
        out = [f"phx.kv plan (mode {self.mode})", self.budget.explain(),
               f"knob X                  {self.knob / MiB:12.1f} MiB"]
        out.append(f"Group 1 (page cache)    {self.group_bytes(PAGECACHE) / MiB:12.1f} MiB, "
                   f"layers {_ranges(sorted({t.layer for t in self.tensors if t.group == PAGECACHE}))}")
        out.append(f"Group 2 (direct)        {self.group_bytes(DIRECT) / MiB:12.1f} MiB, "
                   f"layers {_ranges(sorted({t.layer for t in self.tensors if t.group == DIRECT}))}")
        out.append("layer kind  group      start        length       state")
        for t in sorted(self.tensors, key=lambda t: (t.layer, t.kind)):
            e = t.extent
            out.append(f"{t.layer:5d} {t.kind:4s}  {GROUP_NAMES[t.group]:9s}  "
                       f"{(e.start if e else -1):11d}  {(e.length if e else 0):11d}  "
                       f"{'materialized' if t.materialized else 'bound (logical)'}")
        return "\n".join(out)


def _ranges(xs: list[int]) -> str:
    if not xs:
        return "none"
    out, a, b = [], xs[0], xs[0]
    for x in xs[1:]:
        if x == b + 1:
            b = x
            continue
        out.append(f"{a}-{b}" if a != b else f"{a}")
        a = b = x
    out.append(f"{a}-{b}" if a != b else f"{a}")
    return ",".join(out)


def _lease_to_gpu(got: tuple[Relay, int], n: int, ptr: int, device: int,
                  r: Relay | None) -> None:
    """``n`` bytes of a read-ahead lease (relay, offset) to GPU address ``ptr``:
    one DMA when its buffer is pinned for ``device``, else through relay ``r``."""
    src, off = got
    if src.pinned and src.device == device:
        src.to_device(ptr, n, off)
    elif r is not None:
        np.copyto(r.buf[:n], src.buf[off:off + n])
        r.to_device(ptr, n)
    else:
        raise RuntimeError("copy_job needs a pipeline running on this store's relays")


def write_behind_default() -> bool:
    """Dual-Blade's write-behind where it pays: under a cgroup v2 memory limit.

    There the cgroup's own dirty limit (a fraction of its memory) throttles the
    writer and reclaim under the cap waits for dirty pages' writeback: on the
    H200 (cgroup v2) every page-cache configuration had 1-2.4 s stalls in decode
    or prefill without it and Dual-Blade none with it.  cgroup v1 has no
    per-cgroup dirty accounting: on the dev box (v1) it only cost prefill time
    (docs/kv.md, "Write-behind").
    """
    cg = cgroup_memory()
    return cg is not None and cg.dirty_accounting and cg.binding is not None


class KVStore:
    """Per-layer K/V offload store over the page-cache and direct paths.

    Args:
        directory: where the page-cache file and the slab live (created if needed).
        mode: ``"dual"`` (Algorithm 1), ``"direct"`` (everything on the direct path)
            or ``"pagecache"`` (everything buffered).
        budget: B_pc in bytes, instead of measuring it.
        reserve: bytes the budgeter keeps free (default 8 MiB + 2% of the headroom).
        pinned_bytes: copy buffers the caller will still pin (subtracted from B_pc).
        direct_backend: a :class:`DirectBackend`; default a :class:`SlabBackend`
            (``kv-slab.bin``) created on the first direct binding.
        slab_capacity: preallocate the default slab to this many bytes.
        engine: the phx engine for the default slab (default: phx's default engine).
        device: CUDA device whose tensors this store moves.  Given, the store's
            Co-DMA relays (``copy_threads`` pinned buffers of one K or V tensor
            each, see :mod:`phx.kv.codma`) are counted in the plan's budget before
            they exist; without it they are made on the first GPU transfer, on
            that tensor's device (and counted by later plans as cgroup usage).
        copy_threads: relays for GPU transfers (the paper's N_threads).
        relays: a :class:`~phx.kv.codma.RelayPool` to use instead of making one
            (e.g. one pool kept over several stores); not closed by :meth:`destroy`.
        group1: ``"pagecache"`` (a buffered file: the paper's Group 1) or
            ``"memory"`` (a memfd never written back: charged to the cgroup,
            sized by the budgeter with the cgroup's terms, and guarded: a
            thread polls the cgroup's room and moves Group 1's last layers to
            Group 2 when it falls under ``guard`` bytes; see :meth:`rebalance`).
        guard: the room (bytes below the tightest cap) under which Group 1 in
            memory shrinks (default 4 MiB + 1% of the cap; 0: no guard thread).
        guard_interval: seconds between the guard's looks at the cgroup.
        readahead: tensors whose Group 2 rows :meth:`prefetch` may read ahead at
            once (host buffers of one tensor each, counted in the budget before
            they exist; see :mod:`phx.kv.readahead`).  0: none.
        write_behind: start the writeback of each page-cache write of at least
            :data:`~phx.kv.slab.WRITE_BEHIND_MIN` bytes at once, so Group 1 stays
            cached but clean.  ``None`` (the default): :func:`write_behind_default`
            in ``dual`` mode, decided when Group 1's file is made; off in
            ``pagecache`` mode (CachePolicy-only: the paper's configuration, kept).
    """

    def __init__(self, directory: str, *, mode: str = "dual", budget: int | None = None,
                 reserve: int | None = None, pinned_bytes: int = 0,
                 direct_backend: DirectBackend | None = None,
                 slab_capacity: int | None = None, engine: Engine | None = None,
                 device: int | None = None, copy_threads: int = 2,
                 relays: RelayPool | None = None,
                 write_behind: bool | None = None,
                 group1: str = "pagecache", guard: int | None = None,
                 guard_interval: float = 0.05, readahead: int = 0):
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, not {mode!r}")
        if group1 not in GROUP1_KINDS:
            raise ValueError(f"group1 must be one of {GROUP1_KINDS}, not {group1!r}")
        if group1 == "memory" and mode == "pagecache":
            raise ValueError("group1='memory' is for dual mode (CachePolicy-only is the "
                             "page cache's)")
        self.group1 = group1
        self._guard_bytes = guard
        self._guard_interval = float(guard_interval)
        self._guard_thread: threading.Thread | None = None
        self._rooms: _budget.RoomReader | None = None
        self._guard_stop = threading.Event()
        self._gate = _Gate()
        #: what the guard and rebalance() moved: [(what, layer, bytes, why)]
        self.moves: list[tuple[str, int, int, str]] = []
        os.makedirs(directory, exist_ok=True)
        self.directory = directory
        self.mode = mode
        self._write_behind = write_behind
        self.budget_override = budget
        self.reserve = reserve
        self.pinned_bytes = pinned_bytes
        self._slab_capacity = slab_capacity
        self._engine = engine
        self._lock = threading.RLock()
        self._tensors: dict[int, KVTensor] = {}
        self._next = 0
        self._pc: PageCacheBackend | None = None
        self._direct: DirectBackend | None = direct_backend
        self._own_direct = direct_backend is None
        self._last_plan: Plan | None = None
        self._closed = False
        self.device = device
        self.copy_threads = int(copy_threads)
        self._relays = relays               # made on demand
        self._own_relays = relays is None
        if relays is not None and device is None:
            self.device = relays.device
        if readahead < 0:
            raise ValueError(f"readahead must be >= 0, not {readahead}")
        self.readahead = int(readahead)
        self._ahead: ReadAhead | None = None    # made at the first prefetch()

    # -- allocation ---------------------------------------------------------
    def allocate_tensor(self, layer: int, kind: str, shape: tuple[int, ...],
                        dtype: Any = np.float16) -> KVTensor:
        """Register one KPU (logical: no storage until first access)."""
        self._check_open()
        with self._lock:
            t = KVTensor(self._next, layer, kind, tuple(shape), dtype)
            self._next += 1
            self._tensors[t.id] = t
            return t

    def allocate(self, layer: int, shape: tuple[int, ...],
                 dtype: Any = np.float16) -> tuple[KVTensor, KVTensor]:
        """Register layer ``layer``'s K and V, each of ``shape`` (rows first)."""
        return (self.allocate_tensor(layer, "k", shape, dtype),
                self.allocate_tensor(layer, "v", shape, dtype))

    def tensors(self) -> list[KVTensor]:
        return sorted(self._tensors.values(), key=lambda t: (t.layer, t.kind, t.id))

    # -- planning -----------------------------------------------------------
    def measure_budget(self) -> Budget:
        """B_pc now: what Group 1 may hold in total (its resident pages included)."""
        return measure_budget(self.pinned_bytes + self.relay_bytes_to_pin()
                              + self.readahead_bytes_to_alloc(), self.reserve,
                              self.budget_override, own_bytes=self.resident_group1_bytes(),
                              held_dirty=self.group1 == "memory")

    def relay_bytes_to_pin(self) -> int:
        """Co-DMA relay bytes this store will still pin (for ``device=`` stores whose
        relays are not made yet; made ones are in the cgroup's usage already)."""
        if self.device is None or self._relays is not None:
            return 0
        return self.copy_threads * self._relay_size()

    def readahead_bytes_to_alloc(self) -> int:
        """Read-ahead buffer bytes this store will still allocate."""
        if self._ahead is not None:
            return self._ahead.bytes_to_alloc()
        return self.readahead * self._relay_size()

    def _relay_size(self) -> int:
        """One relay: the largest K or V tensor, rounded to the page."""
        sizes = [t.nbytes for t in self._tensors.values()]
        return round_up(max(sizes), 4096) if sizes else 0

    def relays(self, device: int | None = None) -> RelayPool:
        """The store's :class:`~phx.kv.codma.RelayPool` (made on first use: pinned
        on ``device``, or host relays for ``device=None`` with no store device)."""
        from phx.kv.codma import RelayPool
        with self._lock:
            dev = self.device if self.device is not None else device
            if self._relays is None:
                size = self._relay_size()
                if size == 0:
                    raise ValueError("no tensors allocated: relay size unknown")
                self._relays = RelayPool(self.copy_threads, size, dev, self._relay_engine())
                if self.device is None:
                    self.device = dev
            elif device is not None and self._relays.device != device:
                raise ValueError(f"this store moves tensors of device {self._relays.device}, "
                                 f"not {device}")
            return self._relays

    def _relay_engine(self) -> Engine | None:
        """The engine relays are registered with: the slab's, whose O_DIRECT I/O
        into a relay uses it as a fixed buffer (an NVMe namespace has its own ring)."""
        if not self._own_direct:
            return None
        import phx
        return self._engine or phx.default_engine()

    @property
    def relay_pool(self) -> RelayPool | None:
        """The relay pool if made (None before the first GPU transfer)."""
        return self._relays

    def resident_group1_bytes(self) -> int:
        """Bytes of this store's Group 1 in the page cache now (``cachestat``; where
        it is missing, every materialized Group 1 extent counts as resident)."""
        if isinstance(self._pc, MemoryBackend):
            return self._pc.allocated_bytes()
        total = 0
        for t in list(self._tensors.values()):
            if t.group != PAGECACHE or not t.materialized or t.extent is None:
                continue
            if _sys.cachestat_available() and self._pc is not None:
                hit, _ = self._pc.cached_pages(t.extent.start, t.extent.length)
                total += hit * _sys.PAGE
            else:
                total += t.extent.length
        return total

    def plan(self) -> Plan:
        """Bind every unbound tensor (Algorithm 1) and explain the whole placement."""
        self._check_open()
        with self._lock:
            if self.group1 == "memory" and self.mode == "dual":
                # the direct path's engine (rings, bounce buffers: ~8 MiB) exists
                # before Group 1 is sized: made later, by the first layer that
                # goes there, it would take memory the budget handed to Group 1
                self._direct_backend()
            budget = self.measure_budget()
            unbound = [t for t in self.tensors() if t.group is None]
            bound_g1 = sum(t.extent.length for t in self._tensors.values()
                           if t.group == PAGECACHE and t.extent)
            if self.mode == "direct":
                knob = 0
            elif self.mode == "pagecache":
                knob = 1 << 62
            else:
                # B_pc counts Group 1's resident pages as its own (measure_budget),
                # so what is already bound comes off once
                knob = max(0, budget.bytes - bound_g1)
            placement = None
            if unbound:
                layers = sorted({t.layer for t in unbound})
                pair = {L: 0 for L in layers}
                for t in unbound:
                    pair[t.layer] += round_up(t.nbytes, 4096)
                placement = place_layers([pair[L] for L in layers], knob)
                g_of = dict(zip(layers, placement.groups))
                g1 = [t for t in unbound if g_of[t.layer] == PAGECACHE]
                g2 = [t for t in unbound if g_of[t.layer] == DIRECT]
                if g1:
                    for t, e in zip(g1, self._pagecache().bind([t.nbytes for t in g1])):
                        t.group, t.extent = PAGECACHE, e
                if g2:
                    for t, e in zip(g2, self._direct_backend().bind([t.nbytes for t in g2])):
                        t.group, t.extent = DIRECT, e
            self._last_plan = Plan(self.mode, budget, knob, placement, self.tensors())
            return self._last_plan

    # -- Group 1 in memory: the guard, and moves between the groups -----------
    def _room_reader(self) -> _budget.RoomReader:
        if self._rooms is None:
            self._rooms = _budget.RoomReader()
        return self._rooms

    def guard_bytes(self) -> int:
        """The room under the tightest cap below which Group 1 in memory shrinks."""
        if self._guard_bytes is not None:
            return int(self._guard_bytes)
        cap = self._room_reader().cap
        return 4 * MiB + (cap // 100 if cap is not None else 0)

    def _room(self) -> int:
        """Bytes that may still be charged now: the tightest cap's room, or
        MemAvailable where no cgroup level is capped."""
        r = self._room_reader().room()
        return _budget.mem_available() if r is None else r

    def _admit_group1(self, layer: int) -> None:
        """Before Group 1 in memory grows by a layer: the cgroup must still have
        room for it and twice the guard; if not, that layer and every later layer
        still unmaterialized go to Group 2 (a budget that was wrong shrinks Group
        1; it never charges memory the cap does not have).  Twice: the guard acts
        below one guard, so the job may grow by a guard after admission before
        anything moves (without that band, the dev-box runs' guard moved layers in
        most runs and the rebalance moved them back).  Store lock held."""
        grow = [t for t in self._tensors.values()
                if t.group == PAGECACHE and not t.materialized and t.layer == layer]
        need = sum(t.extent.length for t in grow if t.extent is not None)
        room = self._room()
        if room - need >= 2 * self.guard_bytes():
            return
        later = sorted((t for t in self._tensors.values()
                        if t.group == PAGECACHE and not t.materialized and t.layer >= layer),
                       key=lambda t: (t.layer, t.kind, t.id))
        self._rebind(later, DIRECT)
        for L in sorted({t.layer for t in later}):
            self.moves.append(("demote", L, sum(t.nbytes for t in later if t.layer == L),
                               f"admission: room {room} < need {need} + 2 x guard"))

    def _rebind(self, ts: list[KVTensor], group: int) -> None:
        """Move unmaterialized tensors to ``group`` (a new run there)."""
        if not ts:
            return
        old = self._pagecache() if group == DIRECT else self._direct_backend()
        new = self._direct_backend() if group == DIRECT else self._pagecache()
        for t in ts:
            assert t.extent is not None and not t.materialized
            old.discard(t.extent)
        for t, e in zip(ts, new.bind([t.nbytes for t in ts])):
            t.group, t.extent = group, e

    def _move_layers(self, layers: list[int], group: int, why: str) -> None:
        """Move every tensor of ``layers`` to ``group``, data and all (gate held
        exclusively: no I/O in progress).  A layer's K and V form one run there;
        each old extent is discarded right after its copy (a demotion under
        pressure frees memory tensor by tensor)."""
        if self._ahead is not None:
            self._ahead.drop()          # read from where the tensors were
        for L in layers:
            ts = sorted((t for t in self._tensors.values() if t.layer == L and t.group != group
                         and t.group is not None), key=lambda t: (t.kind, t.id))
            if not ts:
                continue
            old_be = self.backend_of(ts[0])
            new_be = self._direct_backend() if group == DIRECT else self._pagecache()
            exts = new_be.bind([t.nbytes for t in ts])
            buf = None
            for t, e in zip(ts, exts):
                assert t.extent is not None and old_be is not None
                if t.materialized:
                    new_be.materialize(e)
                    if buf is None:
                        buf = _sys.aligned_empty(MOVE_CHUNK)
                    n = min(t.extent.length, e.length)
                    for pos in range(0, n, MOVE_CHUNK):
                        k = min(MOVE_CHUNK, n - pos)
                        old_be.read(buf[:k], t.extent.start + pos)
                        new_be.write(buf[:k], e.start + pos)
                old_be.discard(t.extent)
                t.group, t.extent = group, e
            self.moves.append(("demote" if group == DIRECT else "promote", L,
                               sum(t.nbytes for t in ts), why))

    def rebalance(self) -> dict[str, Any]:
        """Re-measure the budget and move whole layers between the groups.

        Call it between steps, with no I/O of this store in progress (no
        ``write_async`` future pending): Group 1 is grown by the next Group 2
        layers (lowest first) while they fit the budget now -- the room the
        non-KV footprint left after warm-up -- and shrunk from its last layer
        while it is over it, so Group 1 stays a prefix of the layers.  Returns
        ``{"promoted": [...], "demoted": [...], "budget": B_pc, "group1_bytes":
        ...}``.  Direct-only and CachePolicy-only stores do not move.
        """
        self._check_open()
        out: dict[str, Any] = {"promoted": [], "demoted": []}
        if self.mode != "dual":
            return out
        with self._gate.exclusive(), self._lock:
            if self._rooms is not None:
                self._rooms.refresh()          # a limit may have changed
            budget = self.measure_budget()
            target = budget.bytes
            pair: dict[int, int] = {}
            for t in self._tensors.values():
                if t.group is not None and t.extent is not None:
                    pair[t.layer] = pair.get(t.layer, 0) + round_up(t.nbytes, 4096)
            g1 = sorted({t.layer for t in self._tensors.values() if t.group == PAGECACHE})
            g2 = sorted({t.layer for t in self._tensors.values() if t.group == DIRECT})
            cur = sum(pair[L] for L in g1)
            while g1 and cur > target:
                L = g1.pop()
                self._move_layers([L], DIRECT, f"rebalance: Group 1 {cur} > budget {target}")
                out["demoted"].append(L)
                cur -= pair[L]
            if not out["demoted"]:
                # grow only with twice the guard left, as admission does
                while g2 and cur + pair[g2[0]] <= target and \
                        self._room() - pair[g2[0]] >= 2 * self.guard_bytes():
                    L = g2.pop(0)
                    self._move_layers([L], PAGECACHE, f"rebalance: room for {pair[L]} "
                                                      f"under budget {target}")
                    out["promoted"].append(L)
                    cur += pair[L]
            out["budget"] = target
            out["group1_bytes"] = cur
            self._last_plan = Plan(self.mode, budget, max(0, target - cur), None, self.tensors())
        return out

    def shed(self, nbytes: int, why: str = "shed") -> list[int]:
        """Move Group 1's last layers to Group 2 until ``nbytes`` are freed (or
        Group 1 is empty); the layers moved.  Waits for I/O in progress."""
        moved: list[int] = []
        with self._gate.exclusive(), self._lock:
            if self._closed:
                return moved
            freed = 0
            while freed < nbytes:
                g1 = [t for t in self._tensors.values() if t.group == PAGECACHE]
                if not g1:
                    break
                L = max(t.layer for t in g1)
                freed += sum(t.extent.length for t in g1 if t.layer == L and t.extent
                             and t.materialized)
                self._move_layers([L], DIRECT, why)
                moved.append(L)
        return moved

    def _start_guard(self) -> None:
        if self._guard_thread is not None or self._guard_interval <= 0 or \
                self._guard_bytes == 0 or self._room_reader().room() is None:
            return
        self._guard_thread = threading.Thread(target=self._guard_loop, name="phx-kv-guard",
                                              daemon=True)
        self._guard_thread.start()

    def _guard_loop(self) -> None:
        low = self.guard_bytes()
        rooms = self._room_reader()
        below = 0
        while not self._guard_stop.wait(self._guard_interval):
            room = rooms.room()
            pc = self._pc
            if room is None or room >= low or not isinstance(pc, MemoryBackend) or \
                    pc.allocated_bytes() == 0:
                below = 0
                continue
            below += 1
            # one low look may be a passing allocation (the job's temporaries):
            # act on the second in a row, or at once when under half the guard
            if below < 2 and room >= low // 2:
                continue
            below = 0
            # free twice the shortfall: one layer at a time until there is room
            self.shed(2 * low - room, f"guard: room {room} < {low}")

    @property
    def last_plan(self) -> Plan | None:
        return self._last_plan

    @property
    def write_behind(self) -> bool:
        """Whether Group 1's writes are written behind (see the constructor)."""
        if self.group1 == "memory":
            return False
        if self._pc is not None:
            return self._pc.write_behind
        if self._write_behind is not None:
            return bool(self._write_behind)
        return self.mode == "dual" and write_behind_default()

    def _pagecache(self) -> PageCacheBackend:
        if self._pc is None:
            if self.group1 == "memory":
                self._pc = MemoryBackend(f"phx-kv-{os.getpid()}-{id(self):x}")
                self._start_guard()
            else:
                self._pc = PageCacheBackend(os.path.join(self.directory, "kv-pagecache.bin"),
                                            write_behind=self.write_behind)
        return self._pc

    def _direct_backend(self) -> DirectBackend:
        if self._direct is None:
            # An NVMe namespace named by PHX_KV_NVME, else the O_DIRECT slab file.
            self._direct = nvme_from_env() or SlabBackend(
                os.path.join(self.directory, "kv-slab.bin"), self._slab_capacity, self._engine)
        return self._direct

    def backend_of(self, t: KVTensor) -> PageCacheBackend | DirectBackend | None:
        return self._pc if t.group == PAGECACHE else self._direct

    def _ready(self, t: KVTensor) -> PageCacheBackend | DirectBackend:
        """Bind (plan) if needed and materialize on first access; the tensor's backend."""
        if t.freed:
            raise ValueError(f"{t} was freed")
        if t.group is None or not t.materialized:
            with self._lock:
                self._check_open()
                if t.group is None:
                    self.plan()
                if not t.materialized and t.group == PAGECACHE and self.group1 == "memory":
                    self._admit_group1(t.layer)
                if not t.materialized:
                    be, ext = self.backend_of(t), t.extent
                    assert be is not None and ext is not None       # planned above
                    be.materialize(ext)
                    t.materialized = True
        be = self.backend_of(t)
        assert be is not None                   # bound
        return be

    # -- I/O ----------------------------------------------------------------
    def _range(self, t: KVTensor, start: int, stop: int) -> tuple[int, int]:
        if not 0 <= start <= stop <= t.rows:
            raise IndexError(f"rows [{start}:{stop}] outside 0..{t.rows} of {t}")
        assert t.extent is not None             # callers _ready() it first
        return t.extent.start + start * t.row_bytes, (stop - start) * t.row_bytes

    def write(self, t: KVTensor, start: int, src: Any) -> int:
        """Write ``src`` (array/tensor of whole rows) at rows ``start:``; returns rows written.

        A CUDA ``src`` goes GPU -> this thread's pinned relay (D2H on the relay's
        stream, after the work queued on ``src``'s stream) -> storage.
        """
        self._check_open()
        with self._gate.shared(), self._announced_write(t):
            return self._write(t, start, src)

    @contextmanager
    def _announced_write(self, t: KVTensor, futs: list[Any] | None = None) -> Iterator[None]:
        """Tell the read-ahead a write of ``t`` runs (in flight until the block
        ends, or, for an async write, until the future left in ``futs`` is done)."""
        ahead = self._ahead
        if ahead is None:
            yield
            return
        ahead.writing(t.id)
        try:
            yield
        finally:
            ahead.written(t.id, futs[0] if futs else None)

    def _write(self, t: KVTensor, start: int, src: Any) -> int:
        from phx.kv.codma import gpu_view
        g = gpu_view(src)
        if g is not None:
            return self._write_gpu(t, start, g)
        view = _byte_view(src, writable=False)
        if view.nbytes % t.row_bytes:
            raise ValueError(f"{view.nbytes} bytes is not a whole number of "
                             f"{t.row_bytes}-byte rows")
        n = view.nbytes // t.row_bytes
        be = self._ready(t)
        off, ln = self._range(t, start, start + n)
        if ln:
            be.write(view, off)
        return n

    def _rows_of(self, t: KVTensor, nbytes: int) -> int:
        if nbytes % t.row_bytes:
            raise ValueError(f"{nbytes} bytes is not a whole number of "
                             f"{t.row_bytes}-byte rows")
        return nbytes // t.row_bytes

    def _write_gpu(self, t: KVTensor, start: int, g: _View) -> int:
        n = self._rows_of(t, g.nbytes)
        be = self._ready(t)
        off, ln = self._range(t, start, start + n)
        with self.relays(g.device).acquire() as r:
            for pos in range(0, ln, r.nbytes):
                k = min(r.nbytes, ln - pos)
                r.from_device(g.ptr + pos, k, after=g.stream)
                be.write(r.buf[:k], off + pos)
        return n

    def _read_gpu(self, t: KVTensor, off: int, ln: int, g: _View) -> None:
        be = self._ready(t)
        assert t.extent is not None
        start = (off - t.extent.start) // t.row_bytes
        with self.relays(g.device).acquire() as r:
            if 0 < ln <= r.nbytes and self._ahead_to_gpu(t, start, start + ln // t.row_bytes,
                                                         g.ptr, g.device, r):
                return
            for pos in range(0, ln, r.nbytes):
                k = min(r.nbytes, ln - pos)
                be.read(r.buf[:k], off + pos)
                r.to_device(g.ptr + pos, k)

    def copy_job(self, t: KVTensor, start: int, stop: int, out: Any) -> CopyJob:
        """A :class:`~phx.kv.CopyJob` for :class:`~phx.kv.AdaptivePipeline` built on
        this store's relays (``AdaptivePipeline(relays=store.relays(dev))``): its
        ``read`` fills the copy thread's relay from storage, its ``dma`` moves the
        relay to ``out`` (H2D for a CUDA ``out``, a host copy otherwise), so the
        pipeline can overlap and time the two."""
        from phx.kv.codma import gpu_view
        from phx.kv.pipeline import CopyJob
        with self._gate.shared():
            self._ready(t)
            off, ln = self._range(t, start, stop)
        g = gpu_view(out)
        if g is None:
            dst = _byte_view(out, writable=True)
            nbytes = dst.nbytes
        else:
            nbytes = g.nbytes
            self.relays(g.device)
        if nbytes != ln:
            raise ValueError(f"destination holds {nbytes} bytes, rows [{start}:{stop}] "
                             f"are {ln}")
        pool = self._relays
        # a read-ahead of these rows, held from read() to dma(): its bytes go to
        # the destination directly (one copy or DMA, not through the relay)
        held: list[Any] = []

        def read(relay_buf: npt.NDArray[np.uint8]) -> int:
            if ln > relay_buf.nbytes:
                return 0                    # bigger than a relay: dma() moves it in pieces
            if ln:
                # where the tensor is now (a move between the groups may have
                # happened since the job was made)
                with self._gate.shared():
                    be = self._ready(t)
                    o, _ = self._range(t, start, stop)
                    if g is None and self._take_ahead(t, start, stop, dst):
                        held.append(None)   # already in place
                        return ln
                    if g is not None and self._ahead is not None:
                        stack = ExitStack()
                        got = stack.enter_context(
                            self._ahead.lease(t.id, start, stop, t.row_bytes))
                        if got is not None:
                            held.append((stack, got))
                            return ln
                        stack.close()
                    be.read(relay_buf[:ln], o)
            return ln

        def dma(relay_buf: npt.NDArray[np.uint8], nb: int) -> None:
            if held:
                lease = held.pop()
                if lease is not None:
                    stack, got = lease
                    assert g is not None        # leases are held for GPU destinations
                    with stack:
                        _lease_to_gpu(got, nb, g.ptr, g.device,
                                      pool.current() if pool is not None else None)
                return
            if nb == 0 and ln:
                self.read(t, start, stop, out=out)
                return
            if g is None:
                np.copyto(dst, relay_buf[:nb])
            else:
                r = pool.current() if pool is not None else None
                if r is None or r.buf.ctypes.data != relay_buf.ctypes.data:
                    raise RuntimeError("copy_job needs a pipeline running on this "
                                       "store's relays (AdaptivePipeline(relays=...))")
                r.to_device(g.ptr, nb)
        return CopyJob(read, dma)

    def write_async(self, t: KVTensor, start: int, src: Any) -> PhxFuture:
        """Start :meth:`write`; returns a future (``result()`` = bytes written).

        The direct path submits through phx and returns at once; the page-cache path
        copies into the cache and returns a finished future.  ``src`` must stay alive
        and unchanged until the future is done.  Backends without ``write_async``
        write synchronously.
        """
        self._check_open()
        futs: list[PhxFuture] = []
        with self._gate.shared(), self._announced_write(t, futs):
            futs.append(self._write_async(t, start, src))
            return futs[0]

    def _write_async(self, t: KVTensor, start: int, src: Any) -> PhxFuture:
        from phx.kv.codma import gpu_view
        from phx.kv.slab import Done
        g = gpu_view(src)
        if g is not None:
            # the relay is this thread's until the bytes are stored: done on return
            n = self._write_gpu(t, start, g) * t.row_bytes
            return Done(n, "page_cache" if t.group == PAGECACHE else "direct")
        view = _byte_view(src, writable=False)
        if view.nbytes % t.row_bytes:
            raise ValueError(f"{view.nbytes} bytes is not a whole number of "
                             f"{t.row_bytes}-byte rows")
        be = self._ready(t)
        off, ln = self._range(t, start, start + view.nbytes // t.row_bytes)
        if hasattr(be, "write_async") and ln:
            fut: PhxFuture = be.write_async(view, off)
            return fut
        if ln:
            be.write(view, off)
        return Done(ln)

    def read(self, t: KVTensor, start: int = 0, stop: int | None = None, out: Any = None) -> Any:
        """Read rows ``[start:stop]`` into ``out`` (allocated, aligned, when None); returns it.

        A CUDA ``out`` is filled storage -> this thread's pinned relay -> H2D on the
        relay's stream (done when this returns).
        """
        self._check_open()
        with self._gate.shared():
            return self._read(t, start, stop, out)

    def _read(self, t: KVTensor, start: int, stop: int | None, out: Any) -> Any:
        stop = t.rows if stop is None else stop
        be = self._ready(t)
        off, ln = self._range(t, start, stop)
        if out is not None:
            from phx.kv.codma import gpu_view
            g = gpu_view(out)
            if g is not None:
                if g.nbytes != ln:
                    raise ValueError(f"destination holds {g.nbytes} bytes, rows "
                                     f"[{start}:{stop}] are {ln}")
                if g.readonly:
                    raise ValueError("destination GPU buffer is read-only")
                self._read_gpu(t, off, ln, g)
                return out
        if out is None:
            out = self._empty(t, stop - start)
        view = _byte_view(out, writable=True)
        if view.nbytes != ln:
            raise ValueError(f"destination holds {view.nbytes} bytes, rows [{start}:{stop}] "
                             f"are {ln}")
        if ln and not self._take_ahead(t, start, stop, view):
            be.read(view, off)
        return out

    def _take_ahead(self, t: KVTensor, start: int, stop: int,
                    dst: npt.NDArray[np.uint8]) -> bool:
        """Rows ``[start:stop]`` of ``t`` into ``dst`` from a read-ahead, if one
        holds them unchanged (False: read them from the device)."""
        ahead = self._ahead
        return ahead is not None and ahead.take(t.id, start, stop, t.row_bytes, dst)

    def prefetch(self, t: KVTensor, start: int = 0, stop: int | None = None) -> bool:
        """Start reading rows ``[start:stop]`` of ``t`` ahead of the read that will
        ask for them (a later :meth:`read`, :meth:`copy_job` or GPU read of rows
        within them takes them from a host buffer).  Only Group 2 tensors on a
        backend with ``read_async`` are read ahead, only ``readahead`` at once,
        never while a write of ``t`` is in flight; False when nothing was
        started.  Bytes read ahead are served only if no write of ``t`` began
        after the read-ahead did (see :mod:`phx.kv.readahead`)."""
        self._check_open()
        if self.readahead == 0:
            return False
        with self._gate.shared():
            stop = t.rows if stop is None else stop
            be = self._ready(t)
            if t.group != DIRECT or not hasattr(be, "read_async"):
                return False
            off, ln = self._range(t, start, stop)
            with self._lock:
                if self._ahead is None:
                    self._ahead = ReadAhead(self.readahead, self._relay_size(),
                                            self._ahead_relay)
                ahead = self._ahead
            return ahead.start(t.id, start, stop, ln,
                               lambda buf: be.read_async(buf, off))

    def _ahead_relay(self, nbytes: int) -> Relay:
        """A read-ahead buffer: a relay pinned for the store's device (a host one
        without), registered with the slab's engine like the copy relays."""
        from phx.kv.codma import Relay
        try:
            return Relay(nbytes, self.device, self._relay_engine())
        except OSError:
            # the engine's fixed-buffer slots are shared by every store of the
            # process (64): without one, O_DIRECT reads into the buffer still work
            return Relay(nbytes, self.device, None)

    def _ahead_to_gpu(self, t: KVTensor, start: int, stop: int, ptr: int, device: int,
                      r: Relay) -> bool:
        """Rows ``[start:stop]`` of ``t`` from a read-ahead to GPU address ``ptr``:
        one DMA from the read-ahead's pinned buffer (through the thread's relay
        ``r`` when it is not pinned for ``device``).  False: none, read the device."""
        ahead = self._ahead
        if ahead is None:
            return False
        with ahead.lease(t.id, start, stop, t.row_bytes) as got:
            if got is None:
                return False
            _lease_to_gpu(got, (stop - start) * t.row_bytes, ptr, device, r)
            return True

    def readahead_report(self) -> dict[str, Any] | None:
        """The read-ahead's counters (None before the first :meth:`prefetch`)."""
        return self._ahead.report() if self._ahead is not None else None

    def _empty(self, t: KVTensor, rows: int) -> Any:
        shape = (rows,) + t.shape[1:]
        if t._torch:
            import torch
            return torch.empty(shape, dtype=t.dtype)
        dt = np.dtype(t.dtype)
        return _sys.aligned_empty(rows * t.row_bytes).view(dt).reshape(shape)

    def cached_pages(self, t: KVTensor, start: int = 0, stop: int | None = None) -> tuple[int, int]:
        """(pages of rows ``[start:stop]`` in the page cache, pages) via ``cachestat``."""
        with self._gate.shared():
            return self._cached_pages(t, start, stop)

    def _cached_pages(self, t: KVTensor, start: int, stop: int | None) -> tuple[int, int]:
        stop = t.rows if stop is None else stop
        if t.extent is None or not t.materialized:
            return 0, 0
        off, ln = self._range(t, start, stop)
        be = self._ready(t)
        if hasattr(be, "cached_pages"):
            pages: tuple[int, int] = be.cached_pages(off, ln)
            return pages
        fd = be.fileno()       # a DirectBackend written before cached_pages existed
        if fd < 0:
            return 0, (ln + _sys.PAGE - 1) // _sys.PAGE
        return _sys.cached_pages(fd, off, ln)

    # -- release ------------------------------------------------------------
    def free(self, t: KVTensor) -> None:
        """Release ``t``: its extent is discarded (PUNCH_HOLE / DSM) and reusable."""
        with self._lock:
            if t.freed:
                return
            if self._ahead is not None:
                self._ahead.drop(t.id)
            be = self.backend_of(t)
            if t.extent is not None and be is not None:
                be.discard(t.extent)
            t.freed = True
            t.extent = None
            t.materialized = False
            self._tensors.pop(t.id, None)

    def destroy(self, unlink: bool = True) -> None:
        """Free every tensor, punch the files empty, close (and remove) them."""
        self._guard_stop.set()
        if self._guard_thread is not None and self._guard_thread is not threading.current_thread():
            self._guard_thread.join()
        with self._lock:
            if self._closed:
                return
            for t in list(self._tensors.values()):
                self.free(t)
            if self._ahead is not None:
                self._ahead.close()     # before the slab's engine goes
            if self._pc is not None:
                self._pc.close(unlink)
            if self._direct is not None:
                self._direct.close(unlink if self._own_direct else False)
            if self._relays is not None and self._own_relays:
                self._relays.close()
            self._closed = True

    close = destroy

    def __enter__(self) -> "KVStore":
        return self

    def __exit__(self, *exc: object) -> None:
        self.destroy()

    def _check_open(self) -> None:
        if self._closed:
            raise ValueError("KV store is destroyed")

    # -- introspection ------------------------------------------------------
    @property
    def slab_path(self) -> str | None:
        return self._direct.path if self._direct is not None else None

    @property
    def pagecache_path(self) -> str | None:
        return self._pc.path if self._pc is not None else None
