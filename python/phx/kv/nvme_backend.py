"""The KV store's direct path on an NVMe namespace instead of the O_DIRECT slab.

:class:`NvmeBackend` implements :class:`phx.kv.slab.DirectBackend` with
:mod:`phx.nvme`: extents are LBA ranges of a claimed part of a namespace,
placed back to back from a first LBA the user picks (the paper's
``start(n+1) = start(n) + blocks(n)``); reads and writes are NVMe commands
through io_uring passthrough, split at MDTS and kept in flight up to the queue
depth; ``discard`` is a Dataset Management deallocate (TRIM); closing
deallocates what is still bound (each LBA is deallocated once).

Use it explicitly::

    store = KVStore(dir, direct_backend=NvmeBackend("/dev/ng0n1", first_lba=2048))

or through the environment (``PHX_KV_NVME=/dev/ng0n1,first_lba=2048,nr_lbas=0,force=0``)
with :func:`from_env`, which returns None when the variable is unset.

Byte ranges that do not start or end on an LBA boundary (rows smaller than a
block) are read through a bounce buffer and written read-modify-write, under a
lock, so two writers of this backend never lose each other's bytes in a shared
block.
"""
from __future__ import annotations

import errno
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Iterable, Sequence

import numpy as np

from phx.futures import PoolFuture
from phx.kv import _sys
from phx.kv.slab import Extent, ExtentAllocator

if TYPE_CHECKING:
    from phx._typing import BufferLike
    from phx.nvme import Namespace

ENV = "PHX_KV_NVME"


class NvmeBackend:
    """A :class:`~phx.kv.slab.DirectBackend` on LBAs of an NVMe namespace.

    Args:
        path: the namespace's generic char device (``/dev/ngXnY``).
        first_lba: where the first tensor goes (the claimed range starts here).
        nr_lbas: LBAs claimed (0: to the end of the namespace).
        force: claim it even if it looks used (see :func:`phx.nvme.open`).
        namespace: an already open :class:`phx.nvme.Namespace` to use instead
            (not closed by :meth:`close`).
        open_kw: further :func:`phx.nvme.open` arguments (queue_depth, ...).
    """

    def __init__(self, path: str | None = None, *, first_lba: int = 0, nr_lbas: int = 0,
                 force: bool = False, namespace: Namespace | None = None, **open_kw: Any):
        import phx.nvme
        if namespace is None:
            if path is None:
                raise ValueError("NvmeBackend needs a path or a namespace")
            namespace = phx.nvme.open(path, first_lba=first_lba, nr_lbas=nr_lbas,
                                      force=force, **open_kw)
            self._own = True
        else:
            self._own = False
        self.ns = namespace
        self.path = os.fsdecode(namespace.path)
        self.alignment = namespace.lba_size
        self.alloc = ExtentAllocator(self.alignment, namespace.end - namespace.start,
                                     base=namespace.start)
        self._rmw = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self._pool_lock = threading.Lock()

    # -- DirectBackend ------------------------------------------------------
    def bind(self, sizes: Sequence[int]) -> list[Extent]:
        return self.alloc.allocate_run(sizes)

    def materialize(self, ext: Extent) -> None:
        """LBAs need no allocation."""

    def fileno(self) -> int:
        return -1

    def cached_pages(self, offset: int, length: int) -> tuple[int, int]:
        """LBAs have no page cache: (0, pages)."""
        return 0, (length + 4095) // 4096

    def _pieces(self, n: int, offset: int) -> tuple[tuple[int, int], tuple[int, int], tuple[int, int]]:
        """(head, middle, tail) byte ranges relative to the buffer."""
        a = self.alignment
        h = min(n, (-offset) % a)
        t = (n - h) % a
        return (0, h), (h, n - t), (n - t, n)

    def read(self, buf: BufferLike, offset: int) -> None:
        mv = memoryview(buf).cast("B")
        n = mv.nbytes
        if n == 0:
            return
        a = self.alignment
        if offset % a == 0 and n % a == 0:
            self._check(self.ns.read(mv, offset), n, offset)
            return
        (h0, h1), (m0, m1), (t0, t1) = self._pieces(n, offset)
        if m1 > m0:
            self._check(self.ns.read(mv[m0:m1], offset + m0), m1 - m0, offset + m0)
        for s, e in ((h0, h1), (t0, t1)):
            if e > s:
                lo, blk = self._block_read(offset + s, offset + e)
                mv[s:e] = blk[offset + s - lo:offset + e - lo]

    def write(self, buf: BufferLike, offset: int) -> None:
        mv = memoryview(buf).cast("B")
        n = mv.nbytes
        if n == 0:
            return
        a = self.alignment
        if offset % a == 0 and n % a == 0:
            self._check(self.ns.write(mv, offset), n, offset)
            return
        (h0, h1), (m0, m1), (t0, t1) = self._pieces(n, offset)
        if m1 > m0:
            self._check(self.ns.write(mv[m0:m1], offset + m0), m1 - m0, offset + m0)
        with self._rmw:
            for s, e in ((h0, h1), (t0, t1)):
                if e > s:
                    lo, blk = self._block_read(offset + s, offset + e)
                    blk[offset + s - lo:offset + e - lo] = np.frombuffer(mv[s:e], np.uint8)
                    self._check(self.ns.write(blk, lo), blk.nbytes, lo)

    def _block_read(self, start: int, end: int) -> tuple[int, np.ndarray]:
        """The whole blocks around bytes ``[start, end)``: (their first byte, them).

        A short read here would hand stale bytes to the caller (read) or write
        them back over the neighbours' (read-modify-write): it raises.
        """
        a = self.alignment
        lo = start // a * a
        blk = _sys.aligned_empty(a * (-(-(end - lo) // a)))
        self._check(self.ns.read(blk, lo), blk.nbytes, lo)
        return lo, blk

    def _check(self, got: int, want: int, offset: int) -> None:
        if got != want:
            raise OSError(errno.EIO, f"short NVMe transfer: {got} of {want} bytes at {offset}",
                          self.path)

    def write_async(self, buf: BufferLike, offset: int) -> PoolFuture:
        """Start :meth:`write` on a worker thread; ``result()`` is the byte count."""
        with self._pool_lock:
            if self._pool is None:
                workers = max(1, int(self.ns.info["nr_queues"]))
                self._pool = ThreadPoolExecutor(workers, thread_name_prefix="phx-nvme")
        n = memoryview(buf).nbytes

        def job() -> int:
            self.write(buf, offset)
            return n
        return PoolFuture(self._pool.submit(job), "direct")

    def read_batch(self, items: Iterable[tuple[BufferLike, int]]) -> None:
        """``[(buf, offset), ...]``: aligned ones in one submission, others one by one."""
        a = self.alignment
        fast: list[tuple[memoryview, int]] = []
        slow: list[tuple[memoryview, int]] = []
        for b, off in items:
            mv = memoryview(b).cast("B")
            (fast if off % a == 0 and mv.nbytes % a == 0 else slow).append((mv, off))
        if fast:
            got = self.ns.read_batch(fast)
            for (mv, off), g in zip(fast, got):
                self._check(g, mv.nbytes, off)
        for mv, off in slow:
            self.read(mv, off)

    def discard(self, ext: Extent) -> None:
        """Deallocate (TRIM) the extent's LBAs and return them to the allocator."""
        self.ns.deallocate(ext.start, ext.length)
        self.alloc.free(ext)

    def close(self, unlink: bool = True) -> None:
        """Deallocate the LBAs still bound, then close the namespace (if ours).

        Extents released by :meth:`discard` were deallocated then and are not
        deallocated again; the live ones go in as few commands as they have
        contiguous runs.  ``unlink`` has no meaning for a namespace and is ignored.
        """
        if self.ns is None or self.ns.closed:
            return
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        runs: list[list[int]] = []
        for e in self.alloc.live():
            if runs and runs[-1][1] == e.start:
                runs[-1][1] = e.end
            else:
                runs.append([e.start, e.end])
        for lo, hi in runs:
            self.ns.deallocate(lo, hi - lo)
        for e in self.alloc.live():
            self.alloc.free(e)
        if self._own:
            self.ns.close()


def from_env(env: str = ENV) -> NvmeBackend | None:
    """An :class:`NvmeBackend` from ``$PHX_KV_NVME`` (``path[,key=value...]``), or None.

    Keys: ``first_lba``, ``nr_lbas``, ``queue_depth``, ``nr_queues`` (integers) and
    ``force`` (0/1).
    """
    spec = os.environ.get(env, "").strip()
    if not spec:
        return None
    path, *opts = spec.split(",")
    kw: dict[str, Any] = {}
    for o in filter(None, opts):
        k, _, v = o.partition("=")
        if k == "force":
            kw[k] = v.strip() not in ("", "0", "false", "no")
        elif k in ("first_lba", "nr_lbas", "queue_depth", "nr_queues"):
            try:
                kw[k] = int(v, 0)
            except ValueError:
                raise ValueError(f"{env}: {k}={v!r} is not a whole number") from None
        else:
            raise ValueError(f"{env}: unknown option {k!r} (first_lba, nr_lbas, "
                             "queue_depth, nr_queues, force)")
    return NvmeBackend(path, **kw)
