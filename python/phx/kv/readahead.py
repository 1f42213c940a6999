"""Group 2 reads started before they are asked for (Dual-Blade v2, issue 26 part 4).

A decode step reads every layer's K and V, layer after layer, and the rows it
reads (``[0:prompt + step]``) were all written in earlier steps.  Reading one
layer at a time leaves the device idle while Group 1 layers are read from memory,
while rows are copied to the GPU and while the step's new rows are written.
:class:`ReadAhead` lets a caller start the direct-path reads of the next layers
into a few host buffers of its own; the read that asks for those rows later
takes them from the buffer instead of the device.

Nothing read ahead is ever served when it could differ from the device:

* a tensor with a write in flight (synchronous or asynchronous) is never read
  ahead, and every write marks the tensor's read-ahead stale at its start, so a
  read-ahead is served only when no write of its tensor overlapped it;
* a failed or short read-ahead is dropped: the caller reads from the device as
  if there had been none (an I/O error there is raised to it as usual);
* moves between the groups and frees drop every read-ahead they touch.

The buffers (``slots`` of the largest tensor each) are host memory within the
job's cap: :class:`~phx.kv.KVStore` counts them in its budget before they exist,
as it does its relays, so each slot costs Group 1 the same bytes.  They are
:class:`~phx.kv.codma.Relay` objects (pinned for the store's GPU, io_uring fixed
buffers of the slab's engine), so the bytes go from a read-ahead straight to
their destination -- one host copy, or one DMA to the GPU -- never through a
copy thread's relay first (:meth:`ReadAhead.lease`).
"""
from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

if TYPE_CHECKING:
    from phx.kv.codma import Relay


@dataclass
class _Entry:
    start: int                  # rows [start:stop] of the tensor
    stop: int
    relay: Relay                # its buffer
    fut: Any                    # the read's future (bytes read)
    stale: bool = False


class ReadAhead:
    """Up to ``slots`` tensors' rows read ahead into buffers of ``slot_bytes``.

    Thread-safe.  The store calls :meth:`writing` / :meth:`written` around every
    write, :meth:`start` for a read ahead and :meth:`take` before every read.
    """

    def __init__(self, slots: int, slot_bytes: int, make: Callable[[int], Relay]):
        if slots < 0:
            raise ValueError(f"read-ahead slots must be >= 0, not {slots}")
        self.slots = int(slots)
        self.slot_bytes = int(slot_bytes)
        self._make = make                           # make(nbytes) -> a Relay
        self._lock = threading.Lock()
        self._free: list[Relay] = []
        self._all: list[Relay] = []
        self._made = 0
        self._ent: dict[int, _Entry] = {}
        self._writing: dict[int, int] = {}          # tensor id -> writes in flight
        self._async: dict[int, list[Any]] = {}      # tensor id -> async write futures
        #: started, served, stale (a write overlapped), failed, refused (no slot or
        #: a write in flight), no_buffer (a buffer could not be made), bytes served
        self.stats = {"started": 0, "served": 0, "stale": 0, "failed": 0, "refused": 0,
                      "no_buffer": 0, "bytes_served": 0}

    def bytes_to_alloc(self) -> int:
        """Buffer bytes not allocated yet (for a budget measured before they are)."""
        return (self.slots - self._made) * self.slot_bytes

    # -- writes ---------------------------------------------------------------
    def writing(self, tid: int) -> None:
        """A write of tensor ``tid`` starts: its read-ahead (if any) is stale."""
        with self._lock:
            self._writing[tid] = self._writing.get(tid, 0) + 1
            e = self._ent.get(tid)
            if e is not None:
                e.stale = True

    def written(self, tid: int, fut: Any = None) -> None:
        """The write :meth:`writing` announced returned; ``fut``: it goes on
        asynchronously, in flight until the future is done."""
        with self._lock:
            n = self._writing.get(tid, 0) - 1
            if n > 0:
                self._writing[tid] = n
            else:
                self._writing.pop(tid, None)
            if fut is not None:
                self._async.setdefault(tid, []).append(fut)

    def _write_in_flight_locked(self, tid: int) -> bool:
        if self._writing.get(tid):
            return True
        futs = self._async.get(tid)
        if futs:
            futs[:] = [f for f in futs if not f.done()]
            if futs:
                return True
            del self._async[tid]
        return False

    # -- read-ahead -----------------------------------------------------------
    def start(self, tid: int, start: int, stop: int, nbytes: int, submit: Any) -> bool:
        """Read rows ``[start:stop]`` (``nbytes``) of tensor ``tid`` ahead:
        ``submit(buf)`` starts the read into ``buf`` and returns a future of the
        bytes read.  False when no slot is free or a write of the tensor is in
        flight (nothing started); True when started or already there."""
        if nbytes > self.slot_bytes or nbytes <= 0:
            return False
        with self._lock:
            e = self._ent.get(tid)
            if e is not None and not e.stale and e.start <= start and stop <= e.stop:
                return True
            if e is not None or self._write_in_flight_locked(tid):
                self.stats["refused"] += 1
                return False
            relay = self._relay_locked()
            if relay is None:
                self.stats["refused"] += 1
                return False
            # submitted under the lock (an async submission returns at once), so
            # no entry is ever seen without its read: a write from now on marks
            # it stale, and nobody reuses its buffer before the read is done
            try:
                fut = submit(relay.buf[:nbytes])
            except BaseException:
                self._free.append(relay)
                self.stats["failed"] += 1
                raise
            self._ent[tid] = _Entry(start, stop, relay, fut)
            self.stats["started"] += 1
        return True

    def _relay_locked(self) -> Relay | None:
        if self._free:
            return self._free.pop()
        if self._made < self.slots:
            try:
                r = self._make(self.slot_bytes)     # touched (charged) when made
            except (OSError, RuntimeError, MemoryError):
                # no buffer (pinning or registration refused, memory short):
                # nothing is read ahead, the reads go to the device as before
                self.stats["no_buffer"] += 1
                return None
            self._made += 1
            self._all.append(r)
            return r
        return None

    @contextlib.contextmanager
    def lease(self, tid: int, start: int, stop: int,
              row_bytes: int) -> Iterator[tuple[Relay, int] | None]:
        """Rows ``[start:stop]`` of tensor ``tid`` as (relay, byte offset in its
        buffer) while the block runs, or None when there is no read-ahead of them
        (none, overlapped by a write, not covering the rows, or failed: read
        from the device).  The read-ahead is used up either way; its buffer is
        free again when the block ends."""
        with self._lock:
            e = self._ent.pop(tid, None)
        if e is None:
            yield None
            return
        try:
            ok = self._finish(e, (e.stop - e.start) * row_bytes)
            if ok and e.start <= start and stop <= e.stop:
                with self._lock:
                    self.stats["served"] += 1
                    self.stats["bytes_served"] += (stop - start) * row_bytes
                yield e.relay, (start - e.start) * row_bytes
            else:
                yield None
        finally:
            with self._lock:
                self._free.append(e.relay)

    def take(self, tid: int, start: int, stop: int, row_bytes: int,
             dst: npt.NDArray[np.uint8]) -> bool:
        """Fill ``dst`` (host memory) with rows ``[start:stop]`` of tensor ``tid``
        from its read-ahead; False (``dst`` untouched) when :meth:`lease` has
        none."""
        with self.lease(tid, start, stop, row_bytes) as got:
            if got is None:
                return False
            relay, off = got
            np.copyto(dst, relay.buf[off:off + dst.nbytes])
            return True

    def _finish(self, e: _Entry, want: int) -> bool:
        """Wait for ``e``'s read; True when it read all ``want`` bytes and no
        write overlapped it."""
        try:
            n = e.fut.result()
        except OSError:
            n = -1
        with self._lock:
            if n != want:
                self.stats["failed"] += 1
                return False
            if e.stale:
                self.stats["stale"] += 1
                return False
        return True

    def drop(self, tid: int | None = None) -> None:
        """Forget the read-ahead of ``tid`` (every one for None), waiting for
        reads in flight so that their buffers can be reused."""
        with self._lock:
            if tid is None:
                es = list(self._ent.values())
                self._ent.clear()
            else:
                e = self._ent.pop(tid, None)
                es = [e] if e is not None else []
        for e in es:
            try:
                e.fut.result()
            except OSError:
                pass
            with self._lock:
                self._free.append(e.relay)

    def close(self) -> None:
        """Wait for every read ahead and release the buffers (unpin, unregister)."""
        self.drop()
        with self._lock:
            rs, self._all, self._free = self._all, [], []
            self._made = self.slots          # no more buffers after close
        for r in rs:
            r.close()

    def report(self) -> dict[str, Any]:
        with self._lock:
            return {"slots": self.slots, "slot_bytes": self.slot_bytes, **self.stats}
