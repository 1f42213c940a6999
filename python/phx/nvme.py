"""phx.nvme: NVMe-direct I/O (io_uring passthrough on /dev/ngXnY) with sequential extents.

The second path of Dual-Blade: tensors that do not fit the page-cache budget go
straight to an NVMe namespace as NVMe Read/Write commands, laid out so that the
controller sees one sequential stream.

- :func:`open` claims an LBA range of a namespace (:class:`Namespace`), after
  refusing namespaces that are mounted, partitioned, held, carry a foreign
  signature, or whose block device cannot be found or claimed exclusively
  (``force=True`` overrides);
- :class:`ExtentMap` binds tensors to extents of the claimed range with the
  paper's invariants (LBA aligned, disjoint, contiguous: ``start(n+1) =
  start(n) + blocks(n)`` from a first LBA the user picks), reuses freed extents
  without splitting a run, and deallocates (TRIM) everything on destroy;
- :func:`probe` lists the namespaces of this machine and whether each is usable.

>>> import phx.nvme
>>> with phx.nvme.open("/dev/ng0n1", first_lba=2048) as ns:
...     m = phx.nvme.ExtentMap(ns)
...     k, v = m.bind_run([("k0", 1 << 20), ("v0", 1 << 20)])
...     m.write("k0", buf)
...     m.destroy()
"""
from __future__ import annotations

import bisect
import errno
import glob
import os
import stat
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Hashable, Iterable, Sequence

from phx._lib.nvme import Namespace, NvmeError, check, identify, status_str

if TYPE_CHECKING:
    from typing_extensions import Buffer

__all__ = ["Extent", "ExtentMap", "Namespace", "NvmeError", "check", "identify", "open",
           "probe", "status_str"]


def open(path: str | os.PathLike[str], *, first_lba: int = 0, nr_lbas: int = 0,
         queue_depth: int | None = None, nr_queues: int | None = None,
         max_transfer: int | None = None, force: bool = False, fixed_buffers: bool = True,
         dsm: bool = True, readonly: bool = False) -> Namespace:
    """Claim LBAs ``[first_lba, first_lba + nr_lbas)`` of the namespace at ``path``.

    path: the namespace's generic char device, ``/dev/ngXnY``, under any name (a
        renamed node or a symlink: the block device is found by device number).
    nr_lbas: 0 claims up to the end of the namespace.
    queue_depth: commands in flight per call (default 32, ``PHX_NVME_QUEUE_DEPTH``).
    nr_queues: io_uring rings, i.e. calls that run in parallel (2, ``PHX_NVME_QUEUES``).
    max_transfer: cap on bytes per NVMe command (default: MDTS and the kernel's limits).
    force: skip the safety checks (block device found and claimed O_EXCL, mounted,
        partitions, holders, signatures).
    fixed_buffers: use registered buffers (``register_buffer``) where the kernel can.
    dsm: deallocate with Dataset Management; False forces Write Zeroes.
    readonly: refuse writes and deallocation.

    Raises :class:`NvmeError` (an OSError): EBUSY mounted/held/partitioned/claimed,
    EEXIST a foreign signature, ENODEV/ENOENT no block device or no node for it,
    EACCES (or another errno of the O_EXCL open) the block device cannot be claimed,
    ENOSYS libphx built without libblkid, ERANGE a range outside the namespace,
    ENOTTY not a namespace (a block device: pass its ``/dev/ngXnY``).
    """
    return Namespace(path, first_lba=first_lba, nr_lbas=nr_lbas, queue_depth=queue_depth,
                     nr_queues=nr_queues, max_transfer=max_transfer, force=force,
                     fixed_buffers=fixed_buffers, dsm=dsm, readonly=readonly)


# ---------------------------------------------------------------------------
# Extents
# ---------------------------------------------------------------------------

@dataclass(frozen=True)
class Extent:
    """``blocks`` LBAs from ``lba`` holding ``nbytes`` of payload for ``key``."""

    key: Hashable
    lba: int
    blocks: int
    nbytes: int
    lba_size: int

    @property
    def end_lba(self) -> int:
        return self.lba + self.blocks

    @property
    def offset(self) -> int:
        """Byte offset in the namespace."""
        return self.lba * self.lba_size

    @property
    def length(self) -> int:
        return self.blocks * self.lba_size


class ExtentMap:
    """The map M: tensor -> <lba_start, n_blocks> over a claimed LBA range.

    Invariants (:meth:`check`): every extent is a whole number of LBAs (aligned),
    no two live extents overlap (disjoint), and the tensors of one run are back to
    back (contiguous: ``start(n+1) = start(n) + blocks(n)``).  New runs go to the
    tail, which starts at ``first_lba`` (default: the namespace's claimed start),
    so tensors bound one after another form one sequential stream.  A freed extent
    becomes a hole; a later run reuses the smallest hole that holds it *whole*
    (best fit, never split across holes), so reuse never interleaves a run with
    other data.  Freed neighbours coalesce; a hole touching the tail shrinks it.

    Freeing deallocates the extent (DSM, or Write Zeroes); :meth:`destroy`
    deallocates every extent still live and the whole range ever used.
    Thread-safe.
    """

    def __init__(self, ns: Namespace, first_lba: int | None = None,
                 nr_lbas: int | None = None, trim_on_free: bool = True):
        self.ns = ns
        self.lba_size = ns.lba_size
        lo, hi = ns.first_lba, ns.first_lba + ns.nr_lbas
        self.first_lba = lo if first_lba is None else int(first_lba)
        self.limit = hi if nr_lbas is None else self.first_lba + int(nr_lbas)
        if not lo <= self.first_lba < self.limit <= hi:
            raise NvmeError(errno.ERANGE, f"extent range [{self.first_lba}, {self.limit}) is "
                            f"not inside the claimed LBAs [{lo}, {hi})", ns.path)
        self.trim_on_free = trim_on_free
        self._lock = threading.RLock()
        self._tail = self.first_lba
        self._high = self.first_lba          # highest LBA ever used (for destroy)
        self._holes: list[tuple[int, int]] = []   # sorted (lba, blocks), coalesced
        self._live: dict[Hashable, Extent] = {}
        self._order: list[Hashable] = []     # keys in binding order
        self._destroyed = False

    # -- binding ---------------------------------------------------------------
    def blocks_for(self, nbytes: int) -> int:
        return max(1, -(-int(nbytes) // self.lba_size))

    def bind(self, key: Hashable, nbytes: int) -> Extent:
        """One tensor (a run of one)."""
        return self.bind_run([(key, nbytes)])[0]

    def bind_run(self, items: Sequence[tuple[Hashable, int]]) -> list[Extent]:
        """Extents for ``[(key, nbytes), ...]``, back to back, in this order."""
        with self._lock:
            self._alive()
            items = list(items)
            if not items:
                return []
            keys = [k for k, _ in items]
            if len(set(keys)) != len(keys) or any(k in self._live for k in keys):
                raise KeyError(f"key already bound: {keys}")
            blocks = [self.blocks_for(n) for _, n in items]
            total = sum(blocks)
            start = self._take_hole(total)
            if start is None:
                if self._tail + total > self.limit:
                    raise NvmeError(errno.ENOSPC,
                                    f"{total} LBAs do not fit: tail at LBA {self._tail}, "
                                    f"range ends at {self.limit}", self.ns.path)
                start = self._tail
                self._tail += total
                self._high = max(self._high, self._tail)
            out, lba = [], start
            for (k, n), b in zip(items, blocks):
                e = Extent(k, lba, b, int(n), self.lba_size)
                self._live[k] = e
                self._order.append(k)
                out.append(e)
                lba += b
            return out

    def _take_hole(self, total: int) -> int | None:
        best = None
        for i, (hs, hl) in enumerate(self._holes):
            if hl >= total and (best is None or hl < self._holes[best][1]):
                best = i
        if best is None:
            return None
        hs, hl = self._holes[best]
        if hl == total:
            del self._holes[best]
        else:
            self._holes[best] = (hs + total, hl - total)
        return hs

    def free(self, key: Hashable) -> None:
        """Deallocate ``key``'s extent and make it reusable."""
        with self._lock:
            self._alive()
            e = self._live[key]
            if self.trim_on_free:            # a failure leaves the extent bound
                self.ns.deallocate(e.offset, e.length)
            del self._live[key]
            self._order.remove(key)
            s, ln = e.lba, e.blocks
            i = bisect.bisect_left(self._holes, (s, 0))
            if i > 0 and sum(self._holes[i - 1]) == s:
                ps, pl = self._holes.pop(i - 1)
                s, ln = ps, pl + ln
                i -= 1
            if i < len(self._holes) and s + ln == self._holes[i][0]:
                ln += self._holes.pop(i)[1]
            if s + ln == self._tail:
                self._tail = s
            else:
                self._holes.insert(i, (s, ln))

    def destroy(self) -> None:
        """Deallocate everything ever used, forget every extent."""
        with self._lock:
            if self._destroyed:
                return
            if self._high > self.first_lba:
                self.ns.deallocate(self.first_lba * self.lba_size,
                                   (self._high - self.first_lba) * self.lba_size)
            self._live.clear()
            self._order.clear()
            self._holes.clear()
            self._tail = self._high = self.first_lba
            self._destroyed = True

    def _alive(self) -> None:
        if self._destroyed:
            raise ValueError("extent map destroyed")

    # -- lookup and I/O ----------------------------------------------------------
    def __getitem__(self, key: Hashable) -> Extent:
        return self._live[key]

    def __contains__(self, key: Hashable) -> bool:
        return key in self._live

    def __len__(self) -> int:
        return len(self._live)

    def extents(self) -> list[Extent]:
        """Live extents in LBA order."""
        return sorted(self._live.values(), key=lambda e: e.lba)

    @property
    def tail(self) -> int:
        return self._tail

    @property
    def holes(self) -> list[tuple[int, int]]:
        return list(self._holes)

    def _span(self, key: Hashable, nbytes: int, offset: int) -> int:
        e = self._live[key]
        if offset < 0 or offset + nbytes > e.length:
            raise NvmeError(errno.ERANGE, f"bytes [{offset}, {offset + nbytes}) outside "
                            f"{key!r}'s {e.length}-byte extent", self.ns.path)
        return e.offset + offset

    def write(self, key: Hashable, buf: Buffer, offset: int = 0) -> int:
        """Write ``buf`` at byte ``offset`` of ``key``'s extent (LBA multiples)."""
        return self.ns.write(buf, self._span(key, memoryview(buf).nbytes, offset))

    def read(self, key: Hashable, buf: Buffer, offset: int = 0) -> int:
        return self.ns.read(buf, self._span(key, memoryview(buf).nbytes, offset))

    def check(self) -> None:
        """Raise AssertionError unless the invariants hold."""
        with self._lock:
            prev = self.first_lba
            for e in self.extents():
                assert e.blocks == self.blocks_for(e.nbytes), f"{e}: not LBA-sized"
                assert e.lba >= prev, f"{e} overlaps the extent before it"
                assert e.end_lba <= self._tail <= self.limit, f"{e} past the tail"
                prev = e.end_lba
            for hs, hl in self._holes:
                assert hl > 0 and hs + hl <= self._tail
                for e in self._live.values():
                    assert e.end_lba <= hs or e.lba >= hs + hl, f"{e} inside hole {hs}+{hl}"

    def __repr__(self) -> str:
        return (f"<phx.nvme.ExtentMap {len(self._live)} extents, LBAs [{self.first_lba}, "
                f"{self._tail}) of [{self.first_lba}, {self.limit}), {len(self._holes)} holes>")


# ---------------------------------------------------------------------------
# Which namespaces are usable
# ---------------------------------------------------------------------------

def _generic_devices() -> list[str]:
    out = []
    for p in glob.glob("/dev/ng*n*"):
        try:
            if stat.S_ISCHR(os.stat(p).st_mode):
                out.append(p)
        except OSError:
            pass

    def key(p: str) -> list[int]:
        import re
        return [int(x) for x in re.findall(r"\d+", os.path.basename(p))]
    return sorted(out, key=key)


def probe(paths: Iterable[str] | None = None) -> list[dict[str, Any]]:
    """Every NVMe namespace char device and whether phx may claim it.

    Each entry: ``name`` (/dev/ngXnY), ``usable`` (bool), ``reason`` (what to do
    about it), and when identify worked ``block_device``, ``model``,
    ``lba_size``, ``capacity``, ``max_transfer``, ``deallocated_reads``.
    Nothing is written; each block device is opened O_EXCL only for the
    moment of its check.
    """
    out = []
    for p in (list(paths) if paths is not None else _generic_devices()):
        d: dict[str, Any] = {"name": p, "usable": False}
        try:
            info = identify(p)
        except OSError as e:
            d["reason"] = (f"cannot identify: {e.strerror}" +
                           (" (needs root or read access to the device)"
                            if e.errno in (errno.EACCES, errno.EPERM) else ""))
            out.append(d)
            continue
        d.update(block_device=info["block_device"], model=info["model"],
                 lba_size=info["lba_size"], capacity=info["capacity"],
                 max_transfer=info["max_transfer"],
                 deallocated_reads=info["deallocated_reads"])
        try:
            check(p)
        except OSError as e:
            d["reason"] = e.strerror
        else:
            d["usable"] = True
            d["reason"] = "no filesystem, partition table or signature; not mounted or held"
        out.append(d)
    return out
