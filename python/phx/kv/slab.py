"""Sequential extents and the two storage backends of the KV store.

:class:`ExtentAllocator` hands out byte extents of one address space (a slab file
now, LBAs of an NVMe namespace once passthrough lands) with the invariants of the
paper's sequential-LBA placement, for every *run* of tensors bound together:

- aligned: every extent starts on, and is sized to, a multiple of ``alignment``;
- disjoint: no two live extents overlap;
- contiguous: ``start(n+1) == start(n) + length(n)`` inside a run, so a run of
  tensors occupies one gap-free range.

A run goes to the first freed range large enough for all of it (freed neighbours
coalesce), else to the tail; it is never split, so reusing freed space cannot
break the sequence of the tensors placed together.

Backends (the direct one is an interface: :class:`DirectBackend`):

- :class:`SlabBackend`: ONE preallocated file opened with O_DIRECT through phx;
  discard = ``fallocate(PUNCH_HOLE)``.
- :class:`PageCacheBackend`: one ordinary file, buffered ``preadv``/``pwritev``
  through the page cache; discard = ``PUNCH_HOLE`` too (which also drops its pages).
"""
from __future__ import annotations

import bisect
import errno
import os
import queue
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, Sequence, runtime_checkable

from phx.futures import DoneFuture, PhxFuture
from phx.kv import _sys

if TYPE_CHECKING:
    from phx import Engine, File
    from phx._typing import BufferLike


def round_up(n: int, a: int) -> int:
    return (n + a - 1) // a * a


@dataclass(frozen=True)
class Extent:
    """``length`` bytes at ``start`` (both aligned) holding ``nbytes`` of payload."""

    start: int
    length: int
    nbytes: int

    @property
    def end(self) -> int:
        return self.start + self.length


class ExtentAllocator:
    """First-fit allocator of aligned, disjoint, contiguous runs of extents.

    ``capacity`` (bytes, None = unbounded) makes an allocation past it fail with
    ``OSError(ENOSPC)``.
    """

    def __init__(self, alignment: int = 4096, capacity: int | None = None, base: int = 0):
        if alignment <= 0 or alignment & (alignment - 1):
            raise ValueError(f"alignment must be a power of two, not {alignment}")
        if base % alignment:
            raise ValueError("base must be aligned")
        self.alignment = alignment
        self.capacity = capacity
        self.base = base
        self._tail = base
        self._holes: list[tuple[int, int]] = []   # sorted (start, length), coalesced
        self._live: dict[int, Extent] = {}        # start -> extent

    @property
    def tail(self) -> int:
        """End of the highest extent ever in use (the next run goes here if no hole fits)."""
        return self._tail

    @property
    def used(self) -> int:
        return sum(e.length for e in self._live.values())

    @property
    def holes(self) -> list[tuple[int, int]]:
        return list(self._holes)

    def live(self) -> list[Extent]:
        return [self._live[s] for s in sorted(self._live)]

    def allocate(self, nbytes: int) -> Extent:
        return self.allocate_run([nbytes])[0]

    def allocate_run(self, sizes: Sequence[int]) -> list[Extent]:
        """Extents for ``sizes`` (bytes each), back to back in one range."""
        lengths = [round_up(max(int(s), 1), self.alignment) for s in sizes]
        total = sum(lengths)
        if not lengths:
            return []
        start = None
        for i, (hs, hl) in enumerate(self._holes):
            if hl >= total:
                start = hs
                if hl == total:
                    del self._holes[i]
                else:
                    self._holes[i] = (hs + total, hl - total)
                break
        if start is None:
            if self.capacity is not None and self._tail + total > self.base + self.capacity:
                raise OSError(errno.ENOSPC, f"extent allocator: {total} bytes do not fit "
                              f"(tail {self._tail}, capacity {self.capacity})")
            start = self._tail
            self._tail += total
        out = []
        pos = start
        for s, ln in zip(sizes, lengths):
            e = Extent(pos, ln, int(s))
            self._live[pos] = e
            out.append(e)
            pos += ln
        return out

    def free(self, ext: Extent) -> None:
        """Return ``ext``; it coalesces with free neighbours (and the tail)."""
        if self._live.get(ext.start) != ext:
            raise ValueError(f"{ext} is not allocated here")
        del self._live[ext.start]
        s, ln = ext.start, ext.length
        i = bisect.bisect_left(self._holes, (s, 0))
        if i > 0 and self._holes[i - 1][0] + self._holes[i - 1][1] == s:
            ps, pl = self._holes.pop(i - 1)
            s, ln = ps, pl + ln
            i -= 1
        if i < len(self._holes) and s + ln == self._holes[i][0]:
            _, nl = self._holes.pop(i)
            ln += nl
        if s + ln == self._tail:
            self._tail = s
        else:
            self._holes.insert(i, (s, ln))

    def check(self) -> None:
        """Assert the invariants (aligned, disjoint, within the tail); for tests."""
        prev_end = self.base
        for e in self.live():
            assert e.start % self.alignment == 0 and e.length % self.alignment == 0, e
            assert e.length >= e.nbytes, e
            assert e.start >= prev_end, f"overlap at {e}"
            prev_end = e.end
        assert prev_end <= self._tail


@runtime_checkable
class DirectBackend(Protocol):
    """What the direct path needs from its storage (the slab now, an NVMe namespace later).

    Offsets are bytes in the backend's address space; ``alignment`` is its block size.
    """

    alignment: int
    path: str

    def bind(self, sizes: Sequence[int]) -> list[Extent]:
        """Reserve extents for a run of tensors (logical: no I/O)."""

    def materialize(self, ext: Extent) -> None:
        """Make ``ext`` backed by storage (first access)."""

    def read(self, buf: BufferLike, offset: int) -> None:
        """Fill ``buf`` (buffer protocol) from ``offset``; short reads raise EIO."""

    def write(self, buf: BufferLike, offset: int) -> None:
        """Write all of ``buf`` at ``offset``."""

    def discard(self, ext: Extent) -> None:
        """Release ``ext``'s storage (PUNCH_HOLE / DSM deallocate) and its address range."""

    def fileno(self) -> int:
        """A file descriptor for ``cachestat`` (-1 if none)."""

    def cached_pages(self, offset: int, length: int) -> tuple[int, int]:
        """(pages of ``[offset, offset+length)`` in the page cache, pages)."""

    def close(self, unlink: bool = True) -> None:
        """Release everything; remove the backing file when ``unlink``."""


class _FileBackendBase:
    alignment = 4096

    def __init__(self, path: str, capacity: int | None):
        self.path = path
        self.alloc = ExtentAllocator(self.alignment, capacity)
        self._materialized: set[int] = set()
        self._size = 0

    def bind(self, sizes: Sequence[int]) -> list[Extent]:
        return self.alloc.allocate_run(sizes)

    def fileno(self) -> int:
        raise NotImplementedError

    def cached_pages(self, offset: int, length: int) -> tuple[int, int]:
        return _sys.cached_pages(self.fileno(), offset, length)

    def discard(self, ext: Extent) -> None:
        if ext.start in self._materialized:
            _sys.punch_hole(self.fileno(), ext.start, ext.length, self.path)
            self._materialized.discard(ext.start)
        self.alloc.free(ext)

    def _discard_all(self) -> None:
        for e in self.alloc.live():
            self.discard(e)
        if self._size:
            _sys.punch_hole(self.fileno(), 0, self._size, self.path)


class SlabBackend(_FileBackendBase):
    """One slab file, O_DIRECT through phx; extents placed back to back.

    ``capacity`` preallocates the slab (one ``fallocate``); without it, each extent is
    allocated (``fallocate``) when it is first touched, in first-access order.
    """

    def __init__(self, path: str, capacity: int | None = None, engine: Engine | None = None):
        import phx
        super().__init__(path, None)
        self._f: File | None = phx.open(path, "w+", direct=True, engine=engine)
        mem_align, off_align = getattr(self._f, "alignment", (4096, 4096))
        self.alignment = max(4096, int(off_align))
        self.alloc.alignment = self.alignment
        if capacity:
            cap = round_up(capacity, self.alignment)
            _sys.fallocate(self._file.fileno(), 0, cap, 0, path)
            self._size = cap
            self._prealloc = cap
        else:
            self._prealloc = 0

    @property
    def _file(self) -> File:
        f = self._f
        if f is None:
            raise ValueError(f"slab {self.path} is closed")
        return f

    def fileno(self) -> int:
        return self._file.fileno()

    def materialize(self, ext: Extent) -> None:
        if ext.start in self._materialized:
            return
        if ext.end > self._prealloc:
            _sys.fallocate(self._file.fileno(), ext.start, ext.length, 0, self.path)
            self._size = max(self._size, ext.end)
        self._materialized.add(ext.start)

    def read(self, buf: BufferLike, offset: int) -> None:
        n = self._file.pread(buf, offset)
        want = memoryview(buf).nbytes
        if n != want:
            raise OSError(errno.EIO, f"short direct read: {n} of {want} bytes at {offset}",
                          self.path)

    def write(self, buf: BufferLike, offset: int) -> None:
        n = self._file.pwrite(buf, offset)
        want = memoryview(buf).nbytes
        if n != want:
            raise OSError(errno.EIO, f"short direct write: {n} of {want} bytes at {offset}",
                          self.path)

    def write_async(self, buf: BufferLike, offset: int) -> _CheckedFuture:
        """Start writing all of ``buf`` at ``offset``; a future whose ``result()`` is bytes."""
        return _CheckedFuture(self._file.pwrite_async(buf, offset), memoryview(buf).nbytes,
                              offset, self.path)

    def read_async(self, buf: BufferLike, offset: int) -> _CheckedFuture:
        """Start reading all of ``buf`` from ``offset`` (a short read fails the future)."""
        return _CheckedFuture(self._file.pread_async(buf, offset), memoryview(buf).nbytes,
                              offset, self.path, "read")

    def read_batch(self, items: Sequence[tuple[BufferLike, int]]) -> None:
        """``[(buf, offset), ...]`` in one submission."""
        got = self._file.pread_batch(list(items))
        for (b, off), n in zip(items, got):
            if n != memoryview(b).nbytes:
                raise OSError(errno.EIO, f"short direct read at {off}", self.path)

    def close(self, unlink: bool = True) -> None:
        if self._f is None:
            return
        self._discard_all()
        self._f.close()
        self._f = None
        if unlink:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass


class _CheckedFuture(PhxFuture):
    """A phx future whose result must be the whole request."""

    def __init__(self, fut: PhxFuture, want: int, offset: int, path: str, what: str = "write"):
        self._fut, self._want, self._off, self._path = fut, want, offset, path
        self._what = what

    def done(self) -> bool:
        return self._fut.done()

    def result(self, timeout: float | None = None) -> int:
        n: int = self._fut.result(timeout)
        if n != self._want:
            raise OSError(errno.EIO, f"short direct {self._what}: {n} of {self._want} bytes "
                          f"at {self._off}", self._path)
        return n

    def bytes_by_path(self) -> dict[str, int]:
        return self._fut.bytes_by_path()

    def _wake_fd(self) -> int | None:
        return self._fut._wake_fd()


def Done(n: int, path: str = "page_cache") -> DoneFuture:
    """An already-finished write (the page-cache path copies synchronously)."""
    return DoneFuture(n, path)


#: the smallest page-cache write that ``write_behind`` starts the writeback of:
#: with large folios, writing back a decode step's one-row append would write a
#: whole folio (up to 2 MiB) for a few KiB
WRITE_BEHIND_MIN = 1 << 20


class _WriteBehind:
    """Starts the writeback of the ranges handed to it on a thread of its own.

    ``sync_file_range(SYNC_FILE_RANGE_WRITE)`` blocks while the device's queue
    is full, which during a prefill it is (the direct half writes too): on
    the H200 the call in the writer cost Dual-Blade 0.06-0.17 s of a 0.5 s
    prefill.  Here the writer only queues the range.  A failed call loses
    nothing (the pages stay dirty, the flusher writes them): it is counted.
    """

    def __init__(self, fd: int, path: str):
        self._fd, self._path = fd, path
        self._q: queue.SimpleQueue[tuple[int, int] | None] = queue.SimpleQueue()
        self._cv = threading.Condition()
        self._pending = 0
        self._thread: threading.Thread | None = None
        self.errors = 0
        self.last_error: OSError | None = None

    def submit(self, offset: int, length: int) -> None:
        with self._cv:
            self._pending += 1
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="phx-kv-writeback",
                                                daemon=True)
                self._thread.start()
        self._q.put((offset, length))

    def _run(self) -> None:
        while True:
            item = self._q.get()
            if item is None:
                return
            try:
                _sys.start_writeback(self._fd, item[0], item[1], self._path)
            except OSError as e:
                self.errors += 1
                self.last_error = e
            with self._cv:
                self._pending -= 1
                if not self._pending:
                    self._cv.notify_all()

    def wait(self) -> None:
        """Until every range handed over so far has had its writeback started."""
        with self._cv:
            while self._pending:
                self._cv.wait()

    def close(self) -> None:
        """Finish what is queued and stop the thread (before the fd is closed)."""
        with self._cv:
            t, self._thread = self._thread, None
        if t is not None:
            self._q.put(None)
            t.join()


class PageCacheBackend(_FileBackendBase):
    """One ordinary file read and written through the page cache (Group 1).

    ``write_behind``: start the writeback of every write of at least
    :data:`WRITE_BEHIND_MIN` bytes at once (``sync_file_range(
    SYNC_FILE_RANGE_WRITE)`` on a thread of its own, :class:`_WriteBehind`,
    not waited for), so Group 1's pages turn clean while they stay cached.  Why: left dirty, a prefill's worth of KV is
    written back by the flusher later, during decode, and under a memory cap
    dirty pages cannot be reclaimed without waiting for their writeback (and a
    cgroup's dirty limit, a fraction of its cap, throttles the writer).  On the
    H200 every page-cache configuration of the FlexLLMGen runs (stock
    FlexLLMGen too) had one decode step, or the prefill, of 1.2-2.4 s where
    the others took 0.2-0.7 s; Dual-Blade with write-behind had none
    (docs/kv.md, "Write-behind").
    """

    def __init__(self, path: str, write_behind: bool = False):
        super().__init__(path, None)
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
        self.write_behind = write_behind
        self._behind = _WriteBehind(self._fd, path) if write_behind else None

    def fileno(self) -> int:
        return self._fd

    def materialize(self, ext: Extent) -> None:
        if ext.start in self._materialized:
            return
        if ext.end > self._size:
            os.ftruncate(self._fd, ext.end)
            self._size = ext.end
        self._materialized.add(ext.start)

    def read(self, buf: BufferLike, offset: int) -> None:
        mv = memoryview(buf).cast("B")
        done = 0
        while done < len(mv):
            n = os.preadv(self._fd, [mv[done:]], offset + done)
            if n <= 0:
                raise OSError(errno.EIO, f"short read at {offset + done}", self.path)
            done += n

    def write(self, buf: BufferLike, offset: int) -> None:
        mv = memoryview(buf).cast("B")
        done = 0
        while done < len(mv):
            n = os.pwritev(self._fd, [mv[done:]], offset + done)
            if n <= 0:
                raise OSError(errno.EIO, f"short write at {offset + done}", self.path)
            done += n
        if self._behind is not None and done >= WRITE_BEHIND_MIN:
            self._behind.submit(offset, done)

    def wait_write_behind(self) -> None:
        """Until the writeback of every write so far has been started."""
        if self._behind is not None:
            self._behind.wait()

    @property
    def write_behind_errors(self) -> int:
        """``sync_file_range`` calls that failed (nothing is lost: see _WriteBehind)."""
        return self._behind.errors if self._behind is not None else 0

    def write_async(self, buf: BufferLike, offset: int) -> DoneFuture:
        """Buffered writes are a copy into the page cache: done on return."""
        self.write(buf, offset)
        return Done(memoryview(buf).nbytes)

    def evict(self, ext: Extent) -> None:
        """Ask the kernel to drop ``ext``'s clean pages (``POSIX_FADV_DONTNEED``)."""
        os.posix_fadvise(self._fd, ext.start, ext.length, os.POSIX_FADV_DONTNEED)

    def close(self, unlink: bool = True) -> None:
        if self._fd < 0:
            return
        if self._behind is not None:
            self._behind.close()  # its thread uses the fd
        self._discard_all()
        os.close(self._fd)
        self._fd = -1
        if unlink:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass


class MemoryBackend(PageCacheBackend):
    """Group 1 in memory that is never written back: one ``memfd`` (shmem) file.

    Its pages are charged to the process's memory cgroup like any page cache, but
    they are never dirty file pages of a disk: nothing is written to the device
    during prefill (no flusher burst later, no dirty-limit throttling), and with
    swap off (the benches' caps) the kernel cannot reclaim them either -- so their
    size is the store's to keep inside the cap: :meth:`materialize` allocates an
    extent at once (``fallocate``: charged then, not at the first write), the
    store checks the cgroup's room first and moves tensors to Group 2 when the
    room shrinks (:meth:`phx.kv.KVStore.rebalance`, the store's guard).
    ``discard`` punches the extent out (the memory is uncharged at once).
    """

    def __init__(self, name: str = "phx-kv-group1"):
        _FileBackendBase.__init__(self, f"memfd:{name}", None)
        self._fd = os.memfd_create(name, os.MFD_CLOEXEC)
        self.write_behind = False
        self._behind = None

    def materialize(self, ext: Extent) -> None:
        if ext.start in self._materialized:
            return
        _sys.fallocate(self._fd, ext.start, ext.length, 0, self.path)
        self._size = max(self._size, ext.end)
        self._materialized.add(ext.start)

    def allocated_bytes(self) -> int:
        """Bytes of memory the file holds now (its allocated blocks): what Group 1
        has charged to the cgroup."""
        return os.fstat(self._fd).st_blocks * 512

    def evict(self, ext: Extent) -> None:
        raise ValueError("Group 1 in memory is not evicted: move it to Group 2")

    def close(self, unlink: bool = True) -> None:
        if self._fd < 0:
            return
        self._discard_all()
        os.close(self._fd)
        self._fd = -1
