"""The memory cgroup a process runs in: phx's one reader (``phx info``, ``phx.kv``, the benches).

Where the process is (``/proc/<pid>/cgroup``), then every level from its own cgroup
up to the root of the hierarchy, each as read now:

- cgroup v1, the ``memory`` hierarchy: ``memory.limit_in_bytes``,
  ``memory.usage_in_bytes``, ``memory.max_usage_in_bytes``, ``memory.stat``'s
  ``total_*`` figures (the level and its descendants).  v1 has no ``memory.high``
  and no per-cgroup dirty accounting.  A parent whose ``memory.use_hierarchy`` is
  0 does not count its children: the walk stops below it.
- cgroup v2 (a unified mount, or hybrid's ``unified`` when it holds the memory
  controller): ``memory.max``, ``memory.high``, ``memory.current``,
  ``memory.peak``, ``memory.stat`` (``file_dirty``, ``file_writeback``, ...).
  The root has no limit files: it is not a level.

A level's *cap* is the lower of its hard limit and ``memory.high`` (above
``memory.high`` the kernel throttles and reclaims the cgroup: page cache there is
not room, it is thrash).  The *binding* level is the one with the least headroom
(cap - usage): what a budget must fit.  A cgroup namespace (the process's own
path not below the mount) is read from the mount's root.

Only reads: creating cgroups (the benches' capped workers) is
``phx.bench._kv_cgroup``.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

#: Limits at or above this are "no limit" (v1 reports PAGE_COUNTER_MAX pages,
#: v2 writes "max").
UNLIMITED = 1 << 60

#: Where the hierarchies are mounted.
ROOT = "/sys/fs/cgroup"


def parse_proc_cgroup(text: str) -> dict[str, str]:
    """``/proc/<pid>/cgroup`` -> {"v1": path in the memory hierarchy, "v2": unified path}."""
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


def parse_memory_stat(text: str) -> dict[str, int]:
    """``memory.stat`` -> {name: value}."""
    out = {}
    for line in text.splitlines():
        k, _, v = line.partition(" ")
        try:
            out[k] = int(v)
        except ValueError:
            pass
    return out


def read_text(path: str) -> str | None:
    """A small kernel file's text (cgroup control, /proc), stripped; None where
    it cannot be read (absent controller, no permission)."""
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def _read_int(path: str) -> int | None:
    """An integer control file; "max" is :data:`UNLIMITED`; None if absent."""
    s = read_text(path)
    if s is None:
        return None
    if s == "max":
        return UNLIMITED
    try:
        return int(s.split()[0])
    except (ValueError, IndexError):
        return None


#: memory.stat names by version: (v1 hierarchical total, v2)
_STAT = {"inactive_file": ("total_inactive_file", "inactive_file"),
         "mapped_file": ("total_mapped_file", "file_mapped"),
         "dirty": ("total_dirty", "file_dirty"),
         "writeback": ("total_writeback", "file_writeback"),
         "file": ("total_cache", "file")}


@dataclass
class CgroupLevel:
    """One memory cgroup on the way to the root, as read.

    ``limit``: the hard limit (``memory.max`` / ``memory.limit_in_bytes``);
    ``high``: ``memory.high`` (:data:`UNLIMITED` where unset, and on v1);
    ``usage``: bytes charged now; the rest from ``memory.stat`` (0 where absent).
    """
    path: str
    limit: int
    usage: int
    inactive_file: int = 0
    mapped_file: int = 0
    high: int = UNLIMITED
    dirty: int = 0
    writeback: int = 0
    file: int = 0
    peak: int | None = None

    @property
    def cap(self) -> int:
        """What may be charged here before the kernel throttles or reclaims."""
        return min(self.limit, self.high)

    @property
    def capped(self) -> bool:
        return self.cap < UNLIMITED

    @property
    def headroom(self) -> int:
        """Bytes that may still be charged here before the cap."""
        return self.cap - self.usage

    def as_dict(self) -> dict[str, Any]:
        def lim(x: int) -> int | str:
            return "unlimited" if x >= UNLIMITED else x
        return {"path": self.path, "limit": lim(self.limit), "high": lim(self.high),
                "usage": self.usage, "peak": self.peak,
                "headroom": self.headroom if self.capped else None,
                "inactive_file": self.inactive_file, "mapped_file": self.mapped_file,
                "dirty": self.dirty, "writeback": self.writeback}


@dataclass
class CgroupMemory:
    """The memory cgroup a process runs in: its levels, its own first."""
    version: int
    path: str                    # directory of the process's own cgroup
    levels: list[CgroupLevel] = field(default_factory=list)
    mount: str = ""

    @property
    def own(self) -> CgroupLevel | None:
        """The process's own cgroup's level (None where it has no limit files:
        the v2 root)."""
        if self.levels and self.levels[0].path == self.path:
            return self.levels[0]
        return None

    @property
    def binding(self) -> CgroupLevel | None:
        """The capped level with the least headroom (None if no level is capped)."""
        capped = [lv for lv in self.levels if lv.capped]
        return min(capped, key=lambda lv: lv.headroom) if capped else None

    @property
    def limit(self) -> int:
        """The tightest cap of any level (:data:`UNLIMITED` if none)."""
        return min((lv.cap for lv in self.levels), default=UNLIMITED)

    @property
    def dirty_accounting(self) -> bool:
        """Whether the kernel keeps dirty pages per cgroup (v2: the cgroup's own
        dirty limit, a fraction of its memory, throttles its writers; v1 has only
        the global one)."""
        return self.version == 2

    def as_dict(self) -> dict[str, Any]:
        """What ``phx info`` prints: the binding level's figures, with the tightest
        limit and ``memory.high`` of the whole chain."""
        b = self.binding
        own = self.own
        at = b or own
        highs = [lv.high for lv in self.levels if lv.high < UNLIMITED]
        limits = [lv.limit for lv in self.levels if lv.limit < UNLIMITED]
        return {
            "version": self.version,
            "path": self.path,
            "limit": min(limits) if limits else "unlimited",
            "high": min(highs) if highs else "unlimited",
            "binding": b.path if b else None,
            "headroom": b.headroom if b else None,
            "usage": at.usage if at else None,
            "dirty": at.dirty if at else None,
            "writeback": at.writeback if at else None,
            "dirty_accounting": "per cgroup" if self.dirty_accounting else "global only (v1)",
            "levels": len(self.levels),
        }


def hierarchy(root: str = ROOT) -> tuple[int, str] | None:
    """(version, mount) of the hierarchy that holds the memory controller here
    (v2 where a unified mount lists it, else v1's ``memory``), None without one."""
    for m in (root, os.path.join(root, "unified")):
        ctl = read_text(os.path.join(m, "cgroup.controllers"))
        if ctl is not None and "memory" in ctl.split():
            return 2, m
    v1 = os.path.join(root, "memory")
    if os.path.exists(os.path.join(v1, "memory.limit_in_bytes")):
        return 1, v1
    return None


def level(path: str, version: int) -> CgroupLevel | None:
    """One cgroup directory's figures (None where it has no limit files)."""
    return _level(version, path)


def stat(path: str) -> dict[str, int]:
    """A cgroup directory's ``memory.stat``."""
    return parse_memory_stat(read_text(os.path.join(path, "memory.stat")) or "")


def oom_kills(path: str, version: int) -> int:
    """OOM kills inside the cgroup at ``path`` (v1 ``memory.oom_control``, v2
    ``memory.events``)."""
    s = read_text(os.path.join(path, "memory.oom_control" if version == 1 else "memory.events"))
    for line in (s or "").splitlines():
        k, _, v = line.partition(" ")
        if k == "oom_kill":
            return int(v)
    return 0


def _level(version: int, d: str) -> CgroupLevel | None:
    if version == 1:
        limit = _read_int(os.path.join(d, "memory.limit_in_bytes"))
        usage = _read_int(os.path.join(d, "memory.usage_in_bytes"))
        high: int | None = UNLIMITED
        peak = _read_int(os.path.join(d, "memory.max_usage_in_bytes"))
    else:
        limit = _read_int(os.path.join(d, "memory.max"))
        usage = _read_int(os.path.join(d, "memory.current"))
        high = _read_int(os.path.join(d, "memory.high"))
        peak = _read_int(os.path.join(d, "memory.peak"))
    if limit is None or usage is None:
        return None
    st = parse_memory_stat(read_text(os.path.join(d, "memory.stat")) or "")
    i = 0 if version == 1 else 1
    fig = {k: st.get(names[i], st.get(names[1], 0)) for k, names in _STAT.items()}
    return CgroupLevel(d, limit, usage, high=UNLIMITED if high is None else high,
                       peak=peak, **fig)


def _mounts(root: str, paths: dict[str, str]) -> list[tuple[int, str, str]]:
    """(version, mount, path in it) of the memory controller, most likely first."""
    out = []
    if "v1" in paths and os.path.isdir(os.path.join(root, "memory")):
        out.append((1, os.path.join(root, "memory"), paths["v1"]))
    if "v2" in paths:
        for m in (root, os.path.join(root, "unified")):
            ctl = read_text(os.path.join(m, "cgroup.controllers"))
            if ctl is not None and "memory" in ctl.split():
                out.append((2, m, paths["v2"]))
    return out


def memory(pid: int | str = "self", root: str = ROOT,
           proc_cgroup: str | None = None) -> CgroupMemory | None:
    """The memory cgroup of ``pid`` with every level up to the hierarchy's root.

    ``root``: where the hierarchies are mounted; ``proc_cgroup`` replaces the
    contents of ``/proc/<pid>/cgroup`` (tests, another process's view).
    Returns None where no memory controller is mounted.
    """
    if proc_cgroup is None:
        proc_cgroup = read_text(f"/proc/{pid}/cgroup") or ""
    for version, mount, rel in _mounts(root, parse_proc_cgroup(proc_cgroup)):
        rel = rel.strip("/")
        own = os.path.join(mount, rel) if rel else mount
        if not os.path.isdir(own):
            own = mount          # a cgroup namespace: our cgroup is the mount's root
        levels = []
        d = own
        while True:
            lv = _level(version, d)
            if lv is not None:
                levels.append(lv)
            if d == mount or not d.startswith(mount + os.sep):
                break
            parent = os.path.dirname(d)
            # v1 without use_hierarchy: the parent does not count this subtree
            if version == 1 and read_text(os.path.join(parent, "memory.use_hierarchy")) == "0":
                break
            d = parent
        return CgroupMemory(version, own, levels, mount)
    return None


def info() -> dict[str, Any]:
    """``phx info``'s "cgroup" entry."""
    cg = memory()
    if cg is None:
        return {"version": None, "reason": "no memory cgroup controller is mounted"}
    return cg.as_dict()
