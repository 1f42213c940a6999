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
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from phx.kv import _sys
from phx.kv.nvme_backend import from_env as nvme_from_env
from phx.kv.budget import Budget, MiB, cgroup_memory, measure_budget
from phx.kv.planner import DIRECT, PAGECACHE, Placement, place_layers
from phx.kv.slab import DirectBackend, Extent, PageCacheBackend, SlabBackend, round_up

if TYPE_CHECKING:
    from phx import Engine, PhxFuture
    from phx.gpu import _View
    from phx.kv.codma import RelayPool
    from phx.kv.pipeline import CopyJob

MODES = ("dual", "direct", "pagecache")
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
                 write_behind: bool | None = None):
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, not {mode!r}")
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
        return measure_budget(self.pinned_bytes + self.relay_bytes_to_pin(), self.reserve,
                              self.budget_override, own_bytes=self.resident_group1_bytes())

    def relay_bytes_to_pin(self) -> int:
        """Co-DMA relay bytes this store will still pin (for ``device=`` stores whose
        relays are not made yet; made ones are in the cgroup's usage already)."""
        if self.device is None or self._relays is not None:
            return 0
        return self.copy_threads * self._relay_size()

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
                eng = None
                if self._own_direct:
                    # the slab's engine: its O_DIRECT I/O into a relay uses it as a
                    # fixed buffer (an NVMe namespace has its own ring)
                    import phx
                    eng = self._engine or phx.default_engine()
                self._relays = RelayPool(self.copy_threads, size, dev, eng)
                if self.device is None:
                    self.device = dev
            elif device is not None and self._relays.device != device:
                raise ValueError(f"this store moves tensors of device {self._relays.device}, "
                                 f"not {device}")
            return self._relays

    @property
    def relay_pool(self) -> RelayPool | None:
        """The relay pool if made (None before the first GPU transfer)."""
        return self._relays

    def resident_group1_bytes(self) -> int:
        """Bytes of this store's Group 1 in the page cache now (``cachestat``; where
        it is missing, every materialized Group 1 extent counts as resident)."""
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

    @property
    def last_plan(self) -> Plan | None:
        return self._last_plan

    @property
    def write_behind(self) -> bool:
        """Whether Group 1's writes are written behind (see the constructor)."""
        if self._pc is not None:
            return self._pc.write_behind
        if self._write_behind is not None:
            return bool(self._write_behind)
        return self.mode == "dual" and write_behind_default()

    def _pagecache(self) -> PageCacheBackend:
        if self._pc is None:
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
        with self.relays(g.device).acquire() as r:
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
        be = self._ready(t)
        pool = self._relays

        def read(relay_buf: npt.NDArray[np.uint8]) -> int:
            if ln > relay_buf.nbytes:
                return 0                    # bigger than a relay: dma() moves it in pieces
            if ln:
                be.read(relay_buf[:ln], off)
            return ln

        def dma(relay_buf: npt.NDArray[np.uint8], nb: int) -> None:
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
        if ln:
            be.read(view, off)
        return out

    def _empty(self, t: KVTensor, rows: int) -> Any:
        shape = (rows,) + t.shape[1:]
        if t._torch:
            import torch
            return torch.empty(shape, dtype=t.dtype)
        dt = np.dtype(t.dtype)
        return _sys.aligned_empty(rows * t.row_bytes).view(dt).reshape(shape)

    def cached_pages(self, t: KVTensor, start: int = 0, stop: int | None = None) -> tuple[int, int]:
        """(pages of rows ``[start:stop]`` in the page cache, pages) via ``cachestat``."""
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
            be = self.backend_of(t)
            if t.extent is not None and be is not None:
                be.discard(t.extent)
            t.freed = True
            t.extent = None
            t.materialized = False
            self._tensors.pop(t.id, None)

    def destroy(self, unlink: bool = True) -> None:
        """Free every tensor, punch the files empty, close (and remove) them."""
        with self._lock:
            if self._closed:
                return
            for t in list(self._tensors.values()):
                self.free(t)
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
