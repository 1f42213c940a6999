"""The page-cache budget B_pc: how much KV may live in the page cache without thrashing.

    headroom = min(MemAvailable, min over the cgroup and its ancestors of
                                 (limit - (usage - own)))
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
(``explain()``).  cgroup v1 (``memory.limit_in_bytes`` / ``memory.usage_in_bytes``) and
v2 (``memory.max`` / ``memory.current``) are both read; the figures are taken
fresh on every call.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field

#: Limits at or above this are "no limit" (v1 reports PAGE_COUNTER_MAX pages).
UNLIMITED = 1 << 60
MiB = 1 << 20


def parse_proc_cgroup(text: str) -> dict[str, str]:
    """``/proc/<pid>/cgroup`` -> {"v1": path of the memory hierarchy, "v2": unified path}."""
    out: dict[str, str] = {}
    for line in text.splitlines():
        parts = line.strip().split(":", 2)
        if len(parts) != 3:
            continue
        hid, ctrls, path = parts
        if hid == "0" and ctrls == "":
            out["v2"] = path
        elif "memory" in ctrls.split(","):
            out["v1"] = path
    return out


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def _read_int(path: str) -> int | None:
    s = _read(path)
    if s is None:
        return None
    if s == "max":
        return UNLIMITED
    try:
        return int(s.split()[0])
    except ValueError:
        return None


def parse_memory_stat(text: str) -> dict[str, int]:
    out = {}
    for line in text.splitlines():
        k, _, v = line.partition(" ")
        try:
            out[k] = int(v)
        except ValueError:
            pass
    return out


def mem_available(meminfo: str = "/proc/meminfo") -> int:
    with open(meminfo) as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise OSError(f"no MemAvailable in {meminfo}")


@dataclass
class CgroupLevel:
    """One cgroup on the way to the root, as read."""
    path: str
    limit: int
    usage: int
    inactive_file: int
    mapped_file: int = 0

    @property
    def headroom(self) -> int:
        """Bytes that may still be charged here before the limit."""
        return self.limit - self.usage


@dataclass
class CgroupMemory:
    """The memory cgroup a process runs in, and the tightest level above it."""
    version: int
    path: str                    # directory of the process's own cgroup
    levels: list[CgroupLevel] = field(default_factory=list)

    @property
    def binding(self) -> CgroupLevel | None:
        """The level with the least headroom (None if no level sets a limit)."""
        limited = [lv for lv in self.levels if lv.limit < UNLIMITED]
        return min(limited, key=lambda lv: lv.headroom) if limited else None


def _level(version: int, d: str) -> CgroupLevel | None:
    if version == 1:
        limit = _read_int(os.path.join(d, "memory.limit_in_bytes"))
        usage = _read_int(os.path.join(d, "memory.usage_in_bytes"))
        key, mkey = "total_inactive_file", "total_mapped_file"
    else:
        limit = _read_int(os.path.join(d, "memory.max"))
        usage = _read_int(os.path.join(d, "memory.current"))
        key, mkey = "inactive_file", "file_mapped"
    if limit is None or usage is None:
        return None
    st = parse_memory_stat(_read(os.path.join(d, "memory.stat")) or "")
    inactive = st.get(key, st.get("inactive_file", 0))
    return CgroupLevel(d, limit, usage, inactive, st.get(mkey, st.get("mapped_file", 0)))


def cgroup_memory(pid: int | str = "self", root: str = "/sys/fs/cgroup",
                  proc_cgroup: str | None = None) -> CgroupMemory | None:
    """Read the memory cgroup of ``pid`` (v1 memory hierarchy or v2), all levels to the root.

    ``proc_cgroup`` replaces the contents of ``/proc/<pid>/cgroup`` (tests).
    Returns None where no memory controller is mounted.
    """
    if proc_cgroup is None:
        proc_cgroup = _read(f"/proc/{pid}/cgroup") or ""
    paths = parse_proc_cgroup(proc_cgroup)
    candidates = []
    if "v1" in paths and os.path.isdir(os.path.join(root, "memory")):
        candidates.append((1, os.path.join(root, "memory"), paths["v1"]))
    if "v2" in paths and os.path.exists(os.path.join(root, "cgroup.controllers")):
        candidates.append((2, root, paths["v2"]))
    if "v2" in paths and os.path.exists(os.path.join(root, "unified", "cgroup.controllers")):
        candidates.append((2, os.path.join(root, "unified"), paths["v2"]))
    for version, mount, rel in candidates:
        rel = rel.strip("/")
        own = os.path.join(mount, rel) if rel else mount
        if not os.path.isdir(own):
            own = mount          # a cgroup namespace: our cgroup is the mount's root
            rel = ""
        levels = []
        d = own
        while True:
            lv = _level(version, d)
            if lv is not None:
                levels.append(lv)
            if os.path.samefile(d, mount) if os.path.exists(d) else True:
                break
            d = os.path.dirname(d)
        if levels:
            return CgroupMemory(version, own, levels)
    return None


@dataclass
class Budget:
    """The numbers behind one page-cache budget, as measured."""
    mem_available: int
    cgroup: CgroupMemory | None
    pinned: int
    reserve: int
    override: int | None = None
    own: int = 0

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
        return max(0, self.headroom - self.pinned - self.reserve)

    def explain(self) -> str:
        lines = [f"MemAvailable            {self.mem_available / MiB:12.1f} MiB"]
        b = self.cgroup.binding if self.cgroup else None
        if self.cgroup is None:
            lines.append("cgroup                  none (no memory controller)")
        elif b is None:
            lines.append(f"cgroup v{self.cgroup.version}               {self.cgroup.path}: no limit")
        else:
            lines.append(f"cgroup v{self.cgroup.version} limit         {b.limit / MiB:12.1f} MiB  ({b.path})")
            lines.append(f"  - usage               {b.usage / MiB:12.1f} MiB  "
                         f"(inactive file {b.inactive_file / MiB:.1f} MiB, "
                         f"mapped {b.mapped_file / MiB:.1f} MiB: not counted as free)")
            lines.append(f"  + own Group 1 pages   {min(self.own, b.usage) / MiB:12.1f} MiB")
            lines.append(f"  = headroom            {self.cgroup_headroom / MiB:12.1f} MiB")
        lines.append(f"headroom (the smaller)  {self.headroom / MiB:12.1f} MiB")
        lines.append(f"- pinned copy buffers   {self.pinned / MiB:12.1f} MiB")
        lines.append(f"- reserve               {self.reserve / MiB:12.1f} MiB")
        if self.override is not None:
            lines.append(f"B_pc (set by caller)    {self.bytes / MiB:12.1f} MiB")
        else:
            lines.append(f"= B_pc                  {self.bytes / MiB:12.1f} MiB")
        return "\n".join(lines)

    def as_dict(self) -> dict:
        b = self.cgroup.binding if self.cgroup else None
        return {
            "mem_available": self.mem_available,
            "cgroup_version": self.cgroup.version if self.cgroup else None,
            "cgroup_path": b.path if b else (self.cgroup.path if self.cgroup else None),
            "cgroup_limit": b.limit if b else None,
            "cgroup_usage": b.usage if b else None,
            "cgroup_inactive_file": b.inactive_file if b else None,
            "cgroup_mapped_file": b.mapped_file if b else None,
            "own_pagecache": self.own,
            "headroom": self.headroom,
            "pinned": self.pinned,
            "reserve": self.reserve,
            "override": self.override,
            "budget": self.bytes,
        }


def default_reserve(headroom: int) -> int:
    return 8 * MiB + headroom // 50


def measure_budget(pinned_bytes: int = 0, reserve: int | None = None,
                   override: int | None = None, root: str = "/sys/fs/cgroup",
                   meminfo: str = "/proc/meminfo", pid: int | str = "self",
                   own_bytes: int = 0) -> Budget:
    """Measure B_pc now (MemAvailable, the cgroup's limit and usage, pinned, reserve).

    ``own_bytes``: the caller's page cache already charged to the cgroup (a store's
    resident Group 1), added back so that B_pc is the total Group 1 may hold.
    """
    cg = cgroup_memory(pid, root)
    b = Budget(mem_available(meminfo), cg, int(pinned_bytes), 0, override, int(own_bytes))
    b.reserve = default_reserve(b.headroom) if reserve is None else int(reserve)
    return b
