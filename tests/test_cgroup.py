"""phx.cgroup: the one memory-cgroup reader (phx info, phx.kv's budgeter, the benches).

- v2 (unified and hybrid), against fake trees in tmp_path (this box has v1): the
  process's own cgroup up to the root, the tightest of memory.max and memory.high,
  usage, dirty and writeback figures, a cgroup namespace, no controller;
- v1, against a fake tree: hierarchical totals, use_hierarchy=0 ends the walk;
- real v1 cgroups (root): a child process inside a 256 MiB cap, and inside a
  cgroup with no limit of its own below that cap, gets the same limit from
  ``phx info --json`` and from the budgeter, and both are right.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from phx import cgroup
from phx.cgroup import UNLIMITED, CgroupLevel, CgroupMemory
from phx.kv.budget import Budget

MiB = 1 << 20
ROOT = os.geteuid() == 0


def _mk(d, files):
    os.makedirs(d, exist_ok=True)
    for k, v in files.items():
        with open(os.path.join(d, k), "w") as f:
            f.write(v)


def _v2(d, mx, cur, high="max", stat=""):
    _mk(d, {"memory.max": str(mx), "memory.high": str(high), "memory.current": str(cur),
            "memory.peak": str(cur + 5), "memory.stat": stat})


# -- v2, fake trees ---------------------------------------------------------------------
def test_v2_walks_up_and_takes_the_tightest_of_max_and_high(tmp_path):
    r = tmp_path
    _mk(r, {"cgroup.controllers": "cpu io memory pids", "memory.stat": ""})
    # the parent sets memory.high (300 MiB) under a looser memory.max (1 GiB);
    # the child sets a memory.max of 512 MiB and no high; the grandchild (ours) nothing
    _v2(r / "p", 1 << 30, 200 * MiB, high=300 * MiB)
    _v2(r / "p" / "c", 512 * MiB, 150 * MiB)
    _v2(r / "p" / "c" / "me", "max", 100 * MiB,
        stat=f"anon 1\nfile {70 * MiB}\ninactive_file {40 * MiB}\nfile_mapped {3 * MiB}\n"
             f"file_dirty {5 * MiB}\nfile_writeback {MiB}\n")
    cg = cgroup.memory(root=str(r), proc_cgroup="0::/p/c/me\n")
    assert cg.version == 2 and cg.path == str(r / "p" / "c" / "me") and cg.mount == str(r)
    assert [lv.path for lv in cg.levels] == [str(r / "p" / "c" / "me"), str(r / "p" / "c"),
                                            str(r / "p")]       # the root is no level
    own = cg.own
    assert own.limit == UNLIMITED and not own.capped
    assert (own.usage, own.peak, own.dirty, own.writeback, own.file, own.inactive_file,
            own.mapped_file) == (100 * MiB, 100 * MiB + 5, 5 * MiB, MiB, 70 * MiB, 40 * MiB,
                                 3 * MiB)
    # memory.high binds: 300 - 200 = 100 MiB of headroom, less than 512 - 150
    b = cg.binding
    assert b.path == str(r / "p") and b.high == 300 * MiB and b.cap == 300 * MiB
    assert b.headroom == 100 * MiB
    assert cg.limit == 300 * MiB and cg.dirty_accounting
    d = cg.as_dict()
    assert d["limit"] == 512 * MiB and d["high"] == 300 * MiB and d["binding"] == str(r / "p")
    assert d["headroom"] == 100 * MiB and d["dirty_accounting"] == "per cgroup"
    # the budgeter fits the cap (memory.high), not the hard limit
    bud = Budget(8 << 30, cg, pinned=10 * MiB, reserve=10 * MiB)
    assert bud.cgroup_headroom == 100 * MiB and bud.bytes == 80 * MiB
    assert bud.as_dict()["cgroup_high"] == 300 * MiB and bud.as_dict()["cgroup_cap"] == 300 * MiB
    assert "high" in bud.explain()


def test_v2_hybrid_namespace_and_no_controller(tmp_path):
    # hybrid: the unified mount under "unified" holds memory, the v1 tree does not
    r = tmp_path / "h"
    _mk(r / "unified", {"cgroup.controllers": "memory"})
    _v2(r / "unified" / "s", 64 * MiB, 10 * MiB)
    cg = cgroup.memory(root=str(r), proc_cgroup="1:name=systemd:/s\n0::/s\n")
    assert cg.version == 2 and cg.mount == str(r / "unified") and cg.limit == 64 * MiB
    assert cgroup.hierarchy(str(r)) == (2, str(r / "unified"))
    # a cgroup namespace: /proc/self/cgroup names a path the mount does not have
    r2 = tmp_path / "ns"
    _mk(r2, {"cgroup.controllers": "memory", "memory.max": str(32 * MiB),
             "memory.current": str(MiB), "memory.stat": ""})
    cg = cgroup.memory(root=str(r2), proc_cgroup="0::/../../outside\n")
    assert cg.path == str(r2) and cg.binding.headroom == 31 * MiB
    # a unified mount without the memory controller, no v1 memory: nothing
    r3 = tmp_path / "none"
    _mk(r3, {"cgroup.controllers": "cpu io"})
    assert cgroup.memory(root=str(r3), proc_cgroup="0::/\n") is None
    assert cgroup.hierarchy(str(r3)) is None
    assert Budget(1 << 30, None, 0, 0).bytes == 1 << 30
    # the process in the v2 root: a cgroup, no level, no limit
    cg = cgroup.memory(root=str(r), proc_cgroup="0::/\n")
    assert cg.version == 2 and cg.levels == [] and cg.binding is None
    assert cg.as_dict()["limit"] == "unlimited"


# -- v1, fake trees ---------------------------------------------------------------------
def test_v1_totals_and_use_hierarchy(tmp_path):
    m = tmp_path / "memory"
    _mk(m, {"memory.limit_in_bytes": "9223372036854771712", "memory.usage_in_bytes": "0",
            "memory.use_hierarchy": "1", "memory.stat": ""})
    _mk(m / "p", {"memory.limit_in_bytes": str(256 * MiB),
                  "memory.usage_in_bytes": str(100 * MiB), "memory.use_hierarchy": "1",
                  "memory.max_usage_in_bytes": str(120 * MiB),
                  "memory.stat": f"dirty 1\ntotal_dirty {2 * MiB}\ntotal_writeback 4096\n"
                                 f"total_inactive_file {8 * MiB}\n"})
    _mk(m / "p" / "c", {"memory.limit_in_bytes": "9223372036854771712",
                        "memory.usage_in_bytes": str(60 * MiB),
                        "memory.stat": f"total_dirty {MiB}\n"})
    cg = cgroup.memory(root=str(tmp_path), proc_cgroup="4:memory:/p/c\n0::/\n")
    assert cg.version == 1 and len(cg.levels) == 3 and not cg.dirty_accounting
    assert cg.binding.path == str(m / "p") and cg.binding.headroom == 156 * MiB
    assert cg.binding.dirty == 2 * MiB and cg.binding.writeback == 4096
    assert cg.binding.peak == 120 * MiB and cg.binding.high == UNLIMITED
    assert cg.own.dirty == MiB
    assert cg.as_dict()["limit"] == 256 * MiB and cg.as_dict()["high"] == "unlimited"
    assert cgroup.oom_kills(str(m / "p"), 1) == 0
    _mk(m / "p", {"memory.oom_control": "oom_kill_disable 0\nunder_oom 0\noom_kill 3\n"})
    assert cgroup.oom_kills(str(m / "p"), 1) == 3
    # a parent that does not count its children (use_hierarchy 0) ends the walk
    _mk(m / "p", {"memory.use_hierarchy": "0"})
    cg = cgroup.memory(root=str(tmp_path), proc_cgroup="4:memory:/p/c\n")
    assert [lv.path for lv in cg.levels] == [str(m / "p" / "c")] and cg.binding is None


def test_write_behind_default_reads_dirty_accounting():
    """phx.kv turns write-behind on by default only where the cgroup keeps its own
    dirty pages (v2) and a level is capped."""
    from phx.kv import store as store_mod
    lv = [CgroupLevel("/x", 1 << 30, 0)]
    assert CgroupMemory(2, "/x", lv).dirty_accounting
    assert not CgroupMemory(1, "/x", lv).dirty_accounting
    assert store_mod.write_behind_default() is (
        bool(cgroup.memory()) and cgroup.memory().dirty_accounting
        and cgroup.memory().binding is not None)


# -- real cgroups ---------------------------------------------------------------------------
CHILD = r"""
import json, subprocess, sys
from phx.kv import measure_budget
info = json.loads(subprocess.run([sys.executable, "-m", "phx", "info", "--json"],
                                 check=True, capture_output=True, text=True).stdout)
b = measure_budget(pinned_bytes=0, reserve=0)
print(json.dumps({"info": info["cgroup"], "budget": b.as_dict(),
                  "binding": b.cgroup.binding.path if b.cgroup and b.cgroup.binding else None}))
"""


@pytest.mark.parametrize("nested", [False, True])
def test_info_and_budget_agree_in_a_real_cgroup(nested):
    """A child process in a 256 MiB memory cgroup (``nested``: in a cgroup with no
    limit of its own below it) runs ``phx info --json`` and the budgeter: both see
    the 256 MiB limit of the capped cgroup, and the same usage to within what the
    child allocates between the two reads."""
    if not ROOT:
        pytest.skip("creating a memory cgroup needs root")
    from phx.bench._kv_cgroup import MemCgroup, can_create
    ok, why = can_create()
    if not ok:
        pytest.skip(why)
    limit = 256 * MiB
    name = f"phx-test-cg-{os.getpid()}"
    with MemCgroup(name, limit) as outer:
        inner = MemCgroup(f"{name}/inner", None) if nested else None
        try:
            where = inner or outer
            p = where.popen([sys.executable, "-c", CHILD], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
            out, err = p.communicate(timeout=120)
            assert p.returncode == 0, err
        finally:
            if inner is not None:
                inner.close()
    got = json.loads(out)
    info, bud = got["info"], got["budget"]
    assert info["version"] == outer.version
    assert info["path"] == where.path
    assert info["limit"] == limit, info            # not the root's "unlimited"
    assert info["binding"] == outer.path == got["binding"], (info, got)
    assert bud["cgroup_limit"] == limit and bud["cgroup_cap"] == limit
    assert 0 < info["usage"] < limit and 0 < bud["cgroup_usage"] < limit
    assert abs(info["usage"] - bud["cgroup_usage"]) < 64 * MiB, (info, bud)
    assert info["headroom"] + info["usage"] == limit
    assert bud["headroom"] <= limit - bud["cgroup_usage"]
