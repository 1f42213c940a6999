"""A real memory cgroup (v1 or v2) to run one benchmark worker under a cap."""
from __future__ import annotations

import os
import subprocess
import time

from phx import cgroup as _cgroup

V1_ROOT = os.path.join(_cgroup.ROOT, "memory")
#: where a cgroup v2 hierarchy may be mounted (unified, or hybrid's "unified")
V2_ROOTS = (_cgroup.ROOT, os.path.join(_cgroup.ROOT, "unified"))
V2_ROOT = V2_ROOTS[0]


def _v2_root() -> str | None:
    """The v2 mount whose controllers include memory (v2 is preferred: it caps swap
    with memory.swap.max and reports memory.peak), else None."""
    h = _cgroup.hierarchy()
    return h[1] if h and h[0] == 2 else None


def cgroup_version() -> int | None:
    """1 or 2 for the memory controller mounted here, None without one."""
    h = _cgroup.hierarchy()
    return h[0] if h else None


def can_create() -> tuple[bool, str]:
    """Whether a memory cgroup can be created here (and why not)."""
    v = cgroup_version()
    if v is None:
        return False, "no memory cgroup controller mounted"
    if os.geteuid() != 0:
        return False, "creating cgroups needs root"
    try:
        cg = MemCgroup(f"phx-probe-{os.getpid()}", None)
        cg.close()
    except OSError as e:
        return False, f"cannot create a memory cgroup: {e}"
    return True, ""


class MemCgroup:
    """A child memory cgroup with an optional limit; removed by :meth:`close`."""

    def __init__(self, name: str, limit: int | None):
        self.version = cgroup_version()
        if self.version is None:
            raise OSError("no memory cgroup controller")
        if self.version == 1:
            self.path = os.path.join(V1_ROOT, name)
        else:
            root = _v2_root()
            self._enable_v2(root)
            self.path = os.path.join(root, name)
        os.makedirs(self.path, exist_ok=True)
        self.limit = limit
        self.swap_limited = False
        if limit is not None:
            self.set_limit(limit)

    @staticmethod
    def _enable_v2(root: str) -> None:
        ctl = os.path.join(root, "cgroup.subtree_control")
        with open(ctl) as f:
            if "memory" in f.read().split():
                return
        with open(ctl, "w") as f:
            f.write("+memory")

    def _w(self, name: str, value: str) -> None:
        with open(os.path.join(self.path, name), "w") as f:
            f.write(value)

    def _r(self, name: str) -> str | None:
        try:
            with open(os.path.join(self.path, name)) as f:
                return f.read().strip()
        except OSError:
            return None

    def set_limit(self, limit: int) -> None:
        """Cap memory at ``limit`` bytes, swap included.

        Without the swap part a capped process's anonymous memory goes to swap and
        its page cache keeps the room: v1 caps memory + swap with
        ``memory.memsw.limit_in_bytes`` (= the memory limit: no swap), v2 sets
        ``memory.swap.max`` to 0.  :attr:`swap_limited` says whether it could
        (False where the kernel keeps no swap accounting).
        """
        self.limit = limit
        if self.version == 1:
            memsw = os.path.join(self.path, "memory.memsw.limit_in_bytes")
            if not os.path.exists(memsw):
                self._w("memory.limit_in_bytes", str(limit))
                self.swap_limited = False
                return
            # memsw >= the memory limit at every moment: raise memsw first, lower it last
            cur = int(self._r("memory.memsw.limit_in_bytes") or 0)
            if limit > cur:
                self._w("memory.memsw.limit_in_bytes", str(limit))
                self._w("memory.limit_in_bytes", str(limit))
            else:
                self._w("memory.limit_in_bytes", str(limit))
                self._w("memory.memsw.limit_in_bytes", str(limit))
            self.swap_limited = True
        else:
            self._w("memory.max", str(limit))
            try:
                self._w("memory.swap.max", "0")
                self.swap_limited = True
            except OSError:
                self.swap_limited = False

    def add(self, pid: int) -> None:
        self._w("cgroup.procs", str(pid))

    def level(self) -> _cgroup.CgroupLevel | None:
        """This cgroup's figures now, read by :mod:`phx.cgroup`."""
        return _cgroup.level(self.path, self.version)

    def usage(self) -> int:
        lv = self.level()
        return lv.usage if lv else 0

    def peak(self) -> int | None:
        lv = self.level()
        return lv.peak if lv else None

    def stat(self) -> dict[str, int]:
        return _cgroup.stat(self.path)

    def oom_kills(self) -> int:
        return _cgroup.oom_kills(self.path, self.version)

    def popen(self, argv: list[str], **kw) -> subprocess.Popen:
        """Start ``argv`` inside this cgroup (it joins before exec)."""
        procs = os.path.join(self.path, "cgroup.procs")

        def join() -> None:
            with open(procs, "w") as f:
                f.write(str(os.getpid()))
        return subprocess.Popen(argv, preexec_fn=join, **kw)

    def close(self) -> None:
        """Remove the cgroup (waits briefly for its last task to leave)."""
        for _ in range(100):
            try:
                os.rmdir(self.path)
                return
            except FileNotFoundError:
                return
            except OSError:
                time.sleep(0.05)
        os.rmdir(self.path)

    def __enter__(self) -> "MemCgroup":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
