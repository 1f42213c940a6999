"""The page-cache budget B_pc: how much KV may live in the page cache without thrashing.

    headroom = min(MemAvailable, min over the cgroup and its ancestors of
                                 (cap - (usage - own)))      cap = min(limit, memory.high)
    B_pc     = max(0, headroom - pinned - reserve)

``own`` is the caller's own page cache already charged there (the Group 1 pages a
store holds: B_pc is the total Group 1 may hold, what it holds included);
``pinned`` is memory phx will still pin for its copy buffers (the paper's
N_threads * M_pin); ``reserve`` keeps slack for everything else (default: 8 MiB +
2% of the headroom).  The cgroup's ``inactive_file`` does NOT count as free: in a
cgroup made for an inference process it is that process's own file pages
(libraries, modules, data it read), already part of the memory the cap was sized
for; counting it let Group 1 take ~3 layers more than the cap held (measured:
9 of 32 layers at 0.2 x the working set, where 6 fit).  It is reported
(``explain()``).  The cgroup figures come from :mod:`phx.cgroup` (v1 and v2, the
process's own cgroup up to the root, ``memory.high`` too); they are taken fresh on
every call.
"""
from __future__ import annotations

from dataclasses import dataclass

# phx.cgroup is the one reader; its names stay importable from here
from phx.cgroup import UNLIMITED as UNLIMITED
from phx.cgroup import CgroupLevel as CgroupLevel
from phx.cgroup import CgroupMemory as CgroupMemory
from phx.cgroup import memory as _cgroup_memory
from phx.cgroup import parse_memory_stat as parse_memory_stat
from phx.cgroup import parse_proc_cgroup as parse_proc_cgroup

cgroup_memory = _cgroup_memory

MiB = 1 << 20


def mem_available(meminfo: str = "/proc/meminfo") -> int:
    with open(meminfo) as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise OSError(f"no MemAvailable in {meminfo}")


@dataclass
class Budget:
    """The numbers behind one page-cache budget, as measured."""
    mem_available: int
    cgroup: CgroupMemory | None
    pinned: int
    reserve: int
    override: int | None = None
    own: int = 0
    #: bytes the cgroup holds that reclaim cannot free without waiting (dirty and
    #: under-writeback file pages now): subtracted for a Group 1 in memory, whose
    #: own pages are never reclaimable (see ``measure_budget(held_dirty=True)``)
    held: int = 0

    @property
    def cgroup_headroom(self) -> int | None:
        b = self.cgroup.binding if self.cgroup else None
        return b.headroom + min(self.own, b.usage) if b else None

    @property
    def headroom(self) -> int:
        h = self.cgroup_headroom
        return self.mem_available if h is None else min(self.mem_available, h)

    @property
    def bytes(self) -> int:
        """B_pc: bytes of KV the page-cache path may hold."""
        if self.override is not None:
            return max(0, self.override)
        return max(0, self.headroom - self.pinned - self.reserve - self.held)

    @property
    def dirty_threshold(self) -> int | None:
        """The dirty-page threshold that applies to the binding cgroup (cgroup v2:
        ``vm.dirty_ratio`` of its cap, or ``vm.dirty_bytes``; v1: the global
        one, taken against MemAvailable): how much of the cap buffered writers may
        leave dirty before they are throttled.  Information: the budget subtracts
        what is dirty now (:attr:`held`), not this ceiling."""
        return dirty_threshold(self.cgroup, self.mem_available)

    def explain(self) -> str:
        lines = [f"MemAvailable            {self.mem_available / MiB:12.1f} MiB"]
        b = self.cgroup.binding if self.cgroup else None
        if self.cgroup is None:
            lines.append("cgroup                  none (no memory controller)")
        elif b is None:
            lines.append(f"cgroup v{self.cgroup.version}               {self.cgroup.path}: no limit")
        else:
            what = "limit" if b.limit <= b.high else "high "
            lines.append(f"cgroup v{self.cgroup.version} {what}         {b.cap / MiB:12.1f} MiB  ({b.path})")
            lines.append(f"  - usage               {b.usage / MiB:12.1f} MiB  "
                         f"(inactive file {b.inactive_file / MiB:.1f} MiB, "
                         f"mapped {b.mapped_file / MiB:.1f} MiB: not counted as free)")
            lines.append(f"  + own Group 1 pages   {min(self.own, b.usage) / MiB:12.1f} MiB")
            lines.append(f"  = headroom            {(self.cgroup_headroom or 0) / MiB:12.1f} MiB")
        lines.append(f"headroom (the smaller)  {self.headroom / MiB:12.1f} MiB")
        lines.append(f"- pinned copy buffers   {self.pinned / MiB:12.1f} MiB")
        lines.append(f"- reserve               {self.reserve / MiB:12.1f} MiB")
        if self.held:
            lines.append(f"- dirty + writeback now {self.held / MiB:12.1f} MiB")
        dt = self.dirty_threshold
        if dt is not None:
            lines.append(f"  (dirty threshold      {dt / MiB:12.1f} MiB: information)")
        if self.override is not None:
            lines.append(f"B_pc (set by caller)    {self.bytes / MiB:12.1f} MiB")
        else:
            lines.append(f"= B_pc                  {self.bytes / MiB:12.1f} MiB")
        return "\n".join(lines)

    def as_dict(self) -> dict[str, int | str | None]:
        b = self.cgroup.binding if self.cgroup else None
        return {
            "mem_available": self.mem_available,
            "cgroup_version": self.cgroup.version if self.cgroup else None,
            "cgroup_path": b.path if b else (self.cgroup.path if self.cgroup else None),
            "cgroup_limit": b.limit if b else None,
            "cgroup_high": (b.high if b.high < UNLIMITED else None) if b else None,
            "cgroup_cap": b.cap if b else None,
            "cgroup_usage": b.usage if b else None,
            "cgroup_inactive_file": b.inactive_file if b else None,
            "cgroup_mapped_file": b.mapped_file if b else None,
            "own_pagecache": self.own,
            "headroom": self.headroom,
            "pinned": self.pinned,
            "reserve": self.reserve,
            "override": self.override,
            "held_dirty": self.held,
            "dirty_threshold": self.dirty_threshold,
            "budget": self.bytes,
        }


def default_reserve(headroom: int) -> int:
    return 8 * MiB + headroom // 50


def measure_budget(pinned_bytes: int = 0, reserve: int | None = None,
                   override: int | None = None, root: str = "/sys/fs/cgroup",
                   meminfo: str = "/proc/meminfo", pid: int | str = "self",
                   own_bytes: int = 0, held_dirty: bool = False) -> Budget:
    """Measure B_pc now (MemAvailable, the cgroup's limit and usage, pinned, reserve).

    ``own_bytes``: the caller's page cache already charged to the cgroup (a store's
    resident Group 1), added back so that B_pc is the total Group 1 may hold.
    ``held_dirty``: also subtract the binding cgroup's dirty and under-writeback
    pages (a Group 1 in memory cannot be reclaimed, so the room it takes must be
    room reclaim could give back at once).
    """
    cg = cgroup_memory(pid, root)
    b = Budget(mem_available(meminfo), cg, int(pinned_bytes), 0, override, int(own_bytes))
    b.reserve = default_reserve(b.headroom) if reserve is None else int(reserve)
    if held_dirty and cg is not None and cg.binding is not None:
        b.held = cg.binding.dirty + cg.binding.writeback
    return b


def _sysctl(name: str) -> int | None:
    try:
        with open(f"/proc/sys/vm/{name}") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def dirty_threshold(cg: CgroupMemory | None, mem_avail: int) -> int | None:
    """``vm.dirty_bytes`` or ``vm.dirty_ratio`` % of the binding cgroup's cap (v2,
    which keeps dirty pages per cgroup) or of MemAvailable (v1: global only)."""
    db = _sysctl("dirty_bytes")
    if db:
        return db
    ratio = _sysctl("dirty_ratio")
    if ratio is None:
        return None
    b = cg.binding if cg is not None else None
    base = b.cap if (b is not None and cg is not None and cg.dirty_accounting) else mem_avail
    return base * ratio // 100


class RoomReader:
    """:func:`cgroup_room`, cheaply: the capped levels (and their caps) are found
    once, and again by :meth:`refresh`; each call then reads only their usage
    files (``memory.usage_in_bytes`` / ``memory.current``), no ``memory.stat``.
    The store's admission check and guard use it (~1 ms -> tens of us a look)."""

    def __init__(self, pid: int | str = "self", root: str = "/sys/fs/cgroup"):
        self._pid, self._root = pid, root
        self._levels: list[tuple[str, int]] = []
        self.cap: int | None = None
        self.refresh()

    def refresh(self) -> None:
        """Find the capped levels and their caps again (limits can change)."""
        import os
        cg = cgroup_memory(self._pid, self._root)
        levels = [lv for lv in (cg.levels if cg is not None else []) if lv.capped]
        usage = "memory.usage_in_bytes" if cg is not None and cg.version == 1 else "memory.current"
        self._levels = [(os.path.join(lv.path, usage), lv.cap) for lv in levels]
        self.cap = min((c for _, c in self._levels), default=None)

    def room(self) -> int | None:
        """Bytes that may still be charged before the tightest cap; None if none."""
        best: int | None = None
        for path, cap in self._levels:
            try:
                with open(path) as f:
                    r = cap - int(f.read().split()[0])
            except (OSError, ValueError, IndexError):
                continue
            best = r if best is None else min(best, r)
        return best


def cgroup_room(pid: int | str = "self", root: str = "/sys/fs/cgroup") -> int | None:
    """Bytes that may still be charged before the tightest cap of this process's
    memory cgroup (its binding level's cap - usage), None where no level is capped.
    Reads only the limit and usage files of each level (cheap: the store's guard
    polls it)."""
    cg = cgroup_memory(pid, root)
    b = cg.binding if cg is not None else None
    return b.headroom if b is not None else None
