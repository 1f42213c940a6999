"""Live counters of running phx processes: what ``phx stats`` and ``phx top`` show.

Every engine, GPU staging context and ``libphxfile.so`` instance of a process
publishes its counters in a shared-memory file,
``$PHX_STATS_DIR/phx-stats.<pid>.<n>`` (default ``/dev/shm``), refreshed by a
thread of libphx every ``PHX_STATS_INTERVAL_MS`` (default 200 ms; phx.h,
"Live counters").  The file describes itself: a header, a table of kinds with
their counter names, and a table of slots, one per source, each written under
a sequence count (odd while being written).  This module reads those files
without libphx: a process that only watches needs no engine of its own.

>>> from phx import livestats
>>> for p in livestats.scan():
...     print(p.pid, p.comm, [s.label for s in p.sources])

Files of processes that are gone (the pid no longer runs, or runs a process
started at another time) are removed as they are found.
"""
from __future__ import annotations

import dataclasses
import mmap
import os
import re
import struct
import time
from typing import Any, Iterable

__all__ = ["Source", "Process", "stats_dir", "scan", "read_file", "Rates", "rates",
           "PATH_COUNTERS"]

MAGIC = b"PHXSTAT1"
# struct shm_hdr (libphx/src/stats_pub.c), little-endian native layout
_HDR = struct.Struct("<8s10IiIQQQ32s256s16s")
_KIND_HEAD = struct.Struct("<32sII")
_SLOT_HEAD = struct.Struct("<QIIQQQ96s")
_NAME = re.compile(r"^phx-stats\.(\d+)\.(\d+)$")

#: counters whose deltas give bytes by path, per kind (what ``phx top`` shares out)
PATH_COUNTERS = ("direct_bytes", "bounce_bytes", "buffered_bytes")
#: ... under the path names every phx future uses (:data:`phx.futures.PATHS`)
_PATH_NAMES = {"direct_bytes": "direct", "bounce_bytes": "bounce", "buffered_bytes": "page_cache"}


@dataclasses.dataclass
class Source:
    """One published source: an engine, a GPU context, a libphxfile instance."""

    kind: str
    label: str
    id: int
    file: str
    created_ns: int
    updated_ns: int
    counters: dict[str, int]

    @property
    def key(self) -> tuple[str, int]:
        """Unique among the sources of one process."""
        return (self.file, self.id)


@dataclasses.dataclass
class Process:
    """A running process that publishes phx counters (every copy of libphx in it)."""

    pid: int
    comm: str
    cmdline: str
    files: list[str]
    interval_ms: int
    updated_ns: int
    version: str
    sources: list[Source]

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def stats_dir() -> str:
    """Where the files are: ``PHX_STATS_DIR``, else ``/dev/shm``."""
    return os.environ.get("PHX_STATS_DIR") or "/dev/shm"


def _start_ticks(pid: int) -> int | None:
    """Field 22 of /proc/<pid>/stat: when the process started (None: gone)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return None
    rest = data[data.rindex(b")") + 2:].split()
    return int(rest[19])            # fields 3.. follow ") "; field 22 is index 19


def _cstr(b: bytes) -> str:
    return b.split(b"\0", 1)[0].decode("utf-8", "replace")


def _read_slot(m: mmap.mmap, off: int,
               nvals: int) -> tuple[tuple[Any, ...], tuple[int, ...]] | None:
    """One slot read under its sequence count: (head fields, values) or None."""
    for _ in range(100):
        seq0 = struct.unpack_from("<Q", m, off)[0]
        if seq0 & 1:
            time.sleep(0.0001)
            continue
        head = _SLOT_HEAD.unpack_from(m, off)
        vals = struct.unpack_from(f"<{nvals}Q", m, off + _SLOT_HEAD.size)
        if struct.unpack_from("<Q", m, off)[0] == seq0:
            return head, vals
    return None


def read_file(path: str) -> Process | None:
    """The process and sources of one file, or None when it is incomplete,
    not such a file, or of a process that is gone (the file is left alone:
    :func:`scan` removes those)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    except OSError:
        return None
    try:
        size = os.fstat(fd).st_size
        if size < _HDR.size:
            return None
        m = mmap.mmap(fd, size, prot=mmap.PROT_READ)
    finally:
        os.close(fd)
    with m:
        h = _HDR.unpack_from(m, 0)
        (magic, version, _hdr_size, kinds_off, kind_size, max_kinds, slots_off, slot_size,
         max_slots, max_counters, name_len, pid, interval_ms, start_ticks, _rounds,
         updated_ns, comm, cmdline, ver) = h
        if magic != MAGIC or version != 1:
            return None
        if slots_off + slot_size * max_slots > size or name_len != 32:
            return None
        if _start_ticks(pid) != start_ticks:
            return None
        kinds: list[tuple[str, list[str]] | None] = []
        for i in range(max_kinds):
            off = kinds_off + i * kind_size
            name, n, _ = _KIND_HEAD.unpack_from(m, off)
            name = _cstr(name)
            if not name or n > max_counters:
                kinds.append(None)
                continue
            base = off + _KIND_HEAD.size
            kinds.append((name, [_cstr(m[base + j * name_len: base + (j + 1) * name_len])
                                 for j in range(n)]))
        sources = []
        for i in range(max_slots):
            got = _read_slot(m, slots_off + i * slot_size, max_counters)
            if got is None:
                continue
            (_seq, state, kind, sid, created, updated, label), vals = got
            if state != 1 or kind >= len(kinds) or kinds[kind] is None:
                continue
            kname, names = kinds[kind]
            sources.append(Source(kname, _cstr(label), sid, path, created, updated,
                                  dict(zip(names, vals))))
    return Process(pid, _cstr(comm), _cstr(cmdline), [path], interval_ms, updated_ns,
                   _cstr(ver), sources)


def _alive(pid: int, path: str) -> bool:
    """Whether the file's process still runs (its start time matches)."""
    try:
        with open(path, "rb") as f:
            h = f.read(_HDR.size)
    except OSError:
        return True                  # cannot tell: leave it
    if len(h) < _HDR.size or h[:8] != MAGIC:
        return True                  # being made
    fields = _HDR.unpack(h)
    return bool(fields[11] == pid and _start_ticks(pid) == fields[13])


def scan(directory: str | None = None, pid: int | None = None, *,
         clean: bool = True, include_idle: bool = False) -> list[Process]:
    """Every running process with phx counters in ``directory`` (default
    :func:`stats_dir`), by pid; ``pid`` picks one.  Files of processes that
    are gone are removed where permitted (``clean``).  Processes with no
    live source (their engines closed) are left out unless ``include_idle``."""
    directory = directory or stats_dir()
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    by_pid: dict[int, Process] = {}
    for name in sorted(names, key=lambda n: [int(x) for x in _NAME.findall(n)[0]]
                       if _NAME.match(n) else [0, 0]):
        mt = _NAME.match(name)
        if not mt:
            continue
        fpid = int(mt.group(1))
        if pid is not None and fpid != pid:
            continue
        path = os.path.join(directory, name)
        p = read_file(path)
        if p is None:
            if clean and not _alive(fpid, path):
                try:
                    os.unlink(path)
                except OSError:
                    pass
            continue
        if p.pid in by_pid:
            q = by_pid[p.pid]
            q.files += p.files
            q.sources += p.sources
            q.updated_ns = max(q.updated_ns, p.updated_ns)
        else:
            by_pid[p.pid] = p
    return [p for _, p in sorted(by_pid.items()) if include_idle or p.sources]


@dataclasses.dataclass
class Rates:
    """What one source did between two samples (``phx top``'s row)."""

    pid: int
    comm: str
    kind: str
    label: str
    seconds: float
    read_gbs: float
    write_gbs: float
    iops: float
    paths: dict[str, float]          # share of the bytes by path (0..1; phx.futures.PATHS); {} when none moved
    rmw_share: float | None          # partial-block writes / writes
    errors: int                      # in the interval
    errors_total: int
    staging_bytes: int | None        # pinned staging held (GPU contexts, libphxfile)
    early_share: float | None        # stream reads served by early file I/O

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _delta(a: dict[str, int], b: dict[str, int], name: str) -> int:
    return max(0, b.get(name, 0) - a.get(name, 0))


def _error_names(kind: str) -> tuple[str, ...]:
    return ("failures", "submit_errors") if kind == "phxfile" else ("errors",)


def rates(before: Iterable[Process], after: Iterable[Process]) -> list[Rates]:
    """Per source, what changed from ``before`` to ``after`` (sources present in
    both; a source new in ``after`` counts from zero since it was created)."""
    old = {(p.pid, s.key): s for p in before for s in p.sources}
    out = []
    for p in after:
        for s in p.sources:
            a = old.get((p.pid, s.key))
            c0 = a.counters if a else {}
            t0 = a.updated_ns if a else s.created_ns
            dt = max((s.updated_ns - t0) / 1e9, 1e-9)
            c1 = s.counters
            rd, wr = _delta(c0, c1, "bytes_read"), _delta(c0, c1, "bytes_written")
            ios = _delta(c0, c1, "reads") + _delta(c0, c1, "writes")
            moved = {k: _delta(c0, c1, k) for k in PATH_COUNTERS if k in c1}
            tot = sum(moved.values())
            paths = {_PATH_NAMES[k]: v / tot for k, v in moved.items()} if tot else {}
            nw = _delta(c0, c1, "writes")
            rmw = _delta(c0, c1, "rmw_ios") / nw if "rmw_ios" in c1 and nw else None
            errs = sum(_delta(c0, c1, k) for k in _error_names(s.kind))
            etot = sum(c1.get(k, 0) for k in _error_names(s.kind))
            stg = c1.get("pinned_bytes", c1.get("staging_bytes")) if s.kind != "engine" else None
            er, em = _delta(c0, c1, "early_reads"), _delta(c0, c1, "early_misses")
            early = er / (er + em) if "early_reads" in c1 and er + em else None
            out.append(Rates(p.pid, p.comm, s.kind, s.label, dt, rd / dt / 1e9, wr / dt / 1e9,
                             ios / dt, paths, rmw, errs, etot, stg, early))
    return out
