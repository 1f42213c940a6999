"""phx.kv: planner, extents, both I/O paths, release of space, budgeter, pipeline, bench."""
from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from phx.kv import (CROSS, DIRECT, INTRA, PAGECACHE, AdaptivePipeline, CopyJob,
                    ExtentAllocator, KVStore, cgroup_memory, measure_budget,
                    parse_proc_cgroup, place_layers)
from phx.kv import _sys
from phx.kv.budget import UNLIMITED, Budget, CgroupLevel, CgroupMemory

MiB = 1 << 20
ROOT = os.geteuid() == 0


@pytest.fixture
def tmp_path(data_dir):
    """KV files on the real disk (conftest's ``data_dir``), not wherever /tmp is."""
    return pathlib.Path(data_dir)


# -- Algorithm 1 --------------------------------------------------------------------
def test_place_budget_zero_all_direct():
    p = place_layers([100] * 8, 0)
    assert p.n1 == 0 and p.groups == (DIRECT,) * 8
    assert p.group1_bytes == 0 and p.group2_bytes == 800


def test_place_partial_prefix():
    p = place_layers([100] * 8, 350)
    assert p.n1 == 3
    assert p.groups == (PAGECACHE,) * 3 + (DIRECT,) * 5
    assert p.group1_bytes == 300 and p.group2_bytes == 500
    # exact fit
    assert place_layers([100] * 8, 400).n1 == 4


def test_place_budget_at_least_all():
    assert place_layers([100] * 8, 800).groups == (PAGECACHE,) * 8
    assert place_layers([100] * 8, 10**12).n1 == 8


def test_place_is_a_prefix():
    # a big layer that does not fit stops the prefix; later small layers stay direct
    p = place_layers([100, 500, 10, 10], 200)
    assert p.groups == (PAGECACHE, DIRECT, DIRECT, DIRECT)


def test_store_plan_follows_budget(tmp_path):
    shape = (16, 4, 128)                       # 16 KiB per tensor
    for budget, n1 in ((0, 0), (3 * 32 * 1024 + 100, 3), (10 * MiB, 6)):
        st = KVStore(str(tmp_path / f"b{budget}"), budget=budget)
        for L in range(6):
            st.allocate(L, shape, np.float16)
        plan = st.plan()
        assert plan.n1 == n1, str(plan)
        groups = [t.group for t in st.tensors()]
        assert groups == [PAGECACHE] * (2 * n1) + [DIRECT] * (2 * (6 - n1))
        assert "B_pc" in str(plan) and "Group 2" in str(plan)
        # binding is logical: nothing was materialized, no space used yet
        assert all(not t.materialized for t in st.tensors())
        if st.slab_path:
            assert os.stat(st.slab_path).st_blocks == 0
        st.destroy()


# -- sequential extents ---------------------------------------------------------------
def test_extent_run_invariants():
    a = ExtentAllocator(4096)
    sizes = [5000, 4096, 1, 12288, 7000]
    run = a.allocate_run(sizes)
    assert run[0].start == 0
    for e, s in zip(run, sizes):
        assert e.start % 4096 == 0 and e.length % 4096 == 0 and e.length >= s
        assert e.nbytes == s
    for x, y in zip(run, run[1:]):
        assert y.start == x.start + x.length              # start(n+1) = start(n) + bytes(n)
    run2 = a.allocate_run([4096, 4096])
    assert run2[0].start == run[-1].end and run2[1].start == run2[0].end
    a.check()


def test_extent_reuse_keeps_runs_contiguous():
    a = ExtentAllocator(4096)
    ex = a.allocate_run([8192] * 6)
    a.free(ex[1])
    a.free(ex[2])                                     # coalesces into one 16 KiB hole
    assert a.holes == [(8192, 16384)]
    r = a.allocate_run([8192, 8192])                  # fits the hole exactly, in order
    assert [e.start for e in r] == [8192, 16384]
    assert a.holes == []
    r3 = a.allocate_run([8192, 8192, 8192])          # no hole fits: goes to the tail, whole
    assert r3[0].start == ex[-1].end
    assert r3[1].start == r3[0].end and r3[2].start == r3[1].end
    a.free(ex[3])
    big = a.allocate_run([8192, 8192])               # 8 KiB hole is too small: tail
    assert big[0].start == r3[-1].end
    a.check()


def test_extent_tail_pullback_and_capacity():
    a = ExtentAllocator(4096, capacity=64 * 1024)
    ex = a.allocate_run([16384] * 4)
    with pytest.raises(OSError):
        a.allocate(1)
    a.free(ex[3])
    assert a.tail == 3 * 16384
    a.free(ex[2])
    assert a.tail == 2 * 16384 and a.holes == []
    assert a.allocate(16384).start == 2 * 16384


def test_extent_random_alloc_free():
    rng = np.random.default_rng(7)
    a = ExtentAllocator(4096)
    live = []
    for _ in range(400):
        if live and rng.random() < 0.45:
            a.free(live.pop(int(rng.integers(len(live)))))
        else:
            run = a.allocate_run([int(s) for s in rng.integers(1, 40000, int(rng.integers(1, 4)))])
            for x, y in zip(run, run[1:]):
                assert y.start == x.end
            live.extend(run)
        a.check()
    for e in live:
        a.free(e)
    assert a.tail == 0 and a.holes == [] and a.used == 0


# -- data through both paths ----------------------------------------------------------
def _rand(rng, shape, dtype):
    raw = rng.integers(1, 255, size=int(np.prod(shape)) * np.dtype(dtype).itemsize,
                       dtype=np.uint8)
    return raw.view(dtype).reshape(shape)


def _eq(a, b) -> bool:
    """Byte equality (random bytes may be NaNs)."""
    return a.shape == b.shape and a.tobytes() == b.tobytes()


@pytest.mark.parametrize("shape,dtype", [((40, 8, 128), np.float16),     # 2 KiB rows
                                         ((37, 3, 5), np.float16),       # 30-byte rows
                                         ((33, 1029), np.float32)])      # unaligned rows
def test_readback_both_paths(tmp_path, shape, dtype):
    rng = np.random.default_rng(1)
    layers = 4
    pair = 2 * ((int(np.prod(shape)) * np.dtype(dtype).itemsize + 4095) // 4096 * 4096)
    st = KVStore(str(tmp_path), budget=2 * pair)      # layers 0-1 page cache, 2-3 direct
    ts = [t for L in range(layers) for t in st.allocate(L, shape, dtype)]
    st.plan()
    assert {t.group for t in ts[:4]} == {PAGECACHE} and {t.group for t in ts[4:]} == {DIRECT}
    data = [_rand(rng, shape, dtype) for _ in ts]
    rows = shape[0]
    for t, d in zip(ts, data):
        st.write(t, 0, d[:rows - 5])                  # prefill-like
        for r in range(rows - 5, rows):               # decode-like single rows, up to the last
            st.write(t, r, d[r:r + 1])
    for t, d in zip(ts, data):
        assert _eq(st.read(t), d)
        assert _eq(st.read(t, rows - 1, rows), d[rows - 1:])       # last row
        for a, b in ((0, 1), (3, 17), (5, rows), (rows - 7, rows - 2), (11, 12)):
            out = np.empty((b - a,) + shape[1:], dtype)
            st.read(t, a, b, out=out)
            assert _eq(out, d[a:b]), (t, a, b)
    # overwrite an unaligned middle range, re-check neighbours survive
    t, d = ts[-1], data[-1]
    new = _rand(rng, (4,) + shape[1:], dtype)
    st.write(t, 9, new)
    d[9:13] = new
    assert _eq(st.read(t), d)
    # asynchronous row writes on both paths
    futs = []
    for t, d in zip(ts, data):
        row = _rand(rng, (1,) + shape[1:], dtype)
        futs.append(st.write_async(t, rows - 2, row))
        d[rows - 2:rows - 1] = row
    assert [f.result() for f in futs] == [rows and ts[0].row_bytes] * len(ts)
    for t, d in zip(ts, data):
        assert _eq(st.read(t), d)
    with pytest.raises(IndexError):
        st.read(t, 0, rows + 1)
    with pytest.raises(ValueError):
        st.read(t, 0, 2, out=np.empty((3,) + shape[1:], dtype))
    st.destroy()


def test_readback_torch(tmp_path):
    torch = pytest.importorskip("torch")
    st = KVStore(str(tmp_path), budget=0)             # all direct
    k, v = st.allocate(0, (20, 4, 64), torch.bfloat16)
    x = torch.randn(20, 4, 64).to(torch.bfloat16)
    st.write(k, 0, x)
    st.write(v, 0, x[:7].contiguous())
    y = st.read(k)
    assert isinstance(y, torch.Tensor) and torch.equal(y, x)
    out = torch.empty(5, 4, 64, dtype=torch.bfloat16)
    st.read(v, 2, 7, out=out)
    assert torch.equal(out, x[2:7])
    st.destroy()


def _need_cachestat():
    if not _sys.cachestat_available():
        pytest.skip(f"cachestat(2) is not available (kernel {os.uname().release}; it needs "
                    "Linux >= 6.5 and no seccomp filter against it): the page cache of a "
                    "range cannot be seen")


def test_direct_reads_bypass_page_cache(tmp_path):
    """Written and read on the direct path: none of the tensor's pages are in the
    page cache; the same on the page-cache path: all of them are (which shows that
    cachestat sees cached pages at all)."""
    _need_cachestat()
    rng = np.random.default_rng(3)
    shape = (64, 16, 128)                             # 256 KiB per tensor
    st = KVStore(str(tmp_path), budget=2 * 256 * 1024)  # layer 0 page cache, layer 1 direct
    (pk, _), (dk, _) = st.allocate(0, shape, np.float16), st.allocate(1, shape, np.float16)
    st.plan()
    assert pk.group == PAGECACHE and dk.group == DIRECT
    for t in (pk, dk):
        d = _rand(rng, shape, np.float16)
        st.write(t, 0, d)
        assert _eq(st.read(t), d)
    assert st.cached_pages(dk) == (0, 64), "direct-path tensor pages in the page cache"
    assert st.cached_pages(pk) == (64, 64), "page-cache-path tensor not (all) cached"
    st.destroy()


def test_write_behind_thread_counts_failures_and_stops():
    """The write-behind thread: a failing sync_file_range (a pipe: ESPIPE) is counted,
    not raised into the writer; wait() returns once everything queued was tried;
    close() stops the thread before the fd goes, and twice is harmless."""
    from phx.kv.slab import _WriteBehind
    r, w = os.pipe()
    try:
        wb = _WriteBehind(w, "pipe")
        for i in range(5):
            wb.submit(i << 20, 1 << 20)
        wb.wait()
        assert wb.errors == 5 and wb.last_error is not None
        t = wb._thread
        wb.close()
        assert t is not None and not t.is_alive()
        wb.close()
    finally:
        os.close(r)
        os.close(w)


@pytest.mark.parametrize("v2_limit", [True, False])
def test_write_behind_default_follows_the_cgroup(tmp_path, monkeypatch, v2_limit):
    """Unset, write-behind is on in dual mode only under a cgroup v2 memory limit
    (where per-cgroup dirty throttling makes it pay), never in pagecache mode; an
    explicit choice wins; once Group 1's file exists the store reports what it does."""
    from phx.kv import store as store_mod
    monkeypatch.setattr(store_mod, "write_behind_default", lambda: v2_limit)
    st = KVStore(str(tmp_path / "d"), mode="dual", budget=1 << 30)
    assert st.write_behind is v2_limit
    t, _ = st.allocate(0, (64, 8, 128), np.float16)
    st.plan()
    monkeypatch.setattr(store_mod, "write_behind_default", lambda: not v2_limit)
    assert st.write_behind is v2_limit and st.backend_of(t).write_behind is v2_limit
    st.destroy()
    assert KVStore(str(tmp_path / "p"), mode="pagecache").write_behind is False
    assert KVStore(str(tmp_path / "x"), mode="dual", write_behind=True).write_behind is True
    assert KVStore(str(tmp_path / "y"), mode="dual", write_behind=False).write_behind is False


def test_write_behind_default_reads_this_box(monkeypatch):
    """write_behind_default() is cgroup_memory()'s answer: v2 with a limit."""
    from phx.kv import store as store_mod
    from phx.kv.budget import CgroupLevel, CgroupMemory
    lim = [CgroupLevel("/x", 1 << 30, 0, 0)]
    for cg, want in ((None, False), (CgroupMemory(1, "/x", lim), False),
                     (CgroupMemory(2, "/x", []), False), (CgroupMemory(2, "/x", lim), True)):
        monkeypatch.setattr(store_mod, "cgroup_memory", lambda cg=cg: cg)
        assert store_mod.write_behind_default() is want, cg


@pytest.mark.parametrize("behind", [True, False])
def test_group1_write_behind(fs_dir, behind):
    """With ``write_behind``, right after a large Group 1 write none of its
    pages is left dirty (their writeback has started), all are still cached,
    and the bytes read back are the ones written; without it the buffered
    writes stay dirty, as FlexLLMGen's do (on ext4, xfs and xfs with 4 KiB
    sectors)."""
    _need_cachestat()
    rng = np.random.default_rng(11)
    shape = (600, 8, 128)                             # 1.2 MiB, 2 KiB rows
    st = KVStore(fs_dir, mode="dual", budget=1 << 30, write_behind=behind)
    assert st.write_behind is behind
    t, _ = st.allocate(0, shape, np.float16)
    st.plan()
    assert t.group == PAGECACHE
    d = _rand(rng, shape, np.float16)
    st.write(t, 0, d)
    pc = st.backend_of(t)
    pc.wait_write_behind()          # started on its own thread: not in the writer
    dirty = _sys.dirty_pages(pc.fileno(), t.extent.start, t.nbytes)
    if behind:
        assert dirty == 0, f"{dirty} Group 1 pages still dirty after a write-behind write"
    else:
        assert dirty > 0, "CachePolicy-only's pages were not dirty: the check sees nothing"
    assert st.cached_pages(t) == (300, 300)
    assert pc.write_behind_errors == 0
    # rows written again while their pages may still be under writeback (a
    # redirtied folio then waits for the flusher: write-behind does not wait)
    st.write(t, 7, _rand(rng, (3,) + shape[1:], np.float16))
    st.write(t, 7, d[7:10])
    assert _eq(st.read(t), d)
    st.destroy()


# -- release of space -------------------------------------------------------------------
def test_free_and_destroy_release_blocks(tmp_path):
    rng = np.random.default_rng(5)
    shape = (256, 16, 128)                            # 1 MiB per tensor
    pair = 2 * MiB
    st = KVStore(str(tmp_path), budget=pair)          # layer 0 page cache, 1-2 direct
    ts = [t for L in range(3) for t in st.allocate(L, shape, np.float16)]
    for t in ts:
        st.write(t, 0, _rand(rng, shape, np.float16))
    os.sync()
    slab, pc = st.slab_path, st.pagecache_path
    b_slab, b_pc = os.stat(slab).st_blocks * 512, os.stat(pc).st_blocks * 512
    assert b_slab >= 4 * MiB and b_pc >= 2 * MiB
    st.free(ts[-1])                                   # one direct tensor
    assert os.stat(slab).st_blocks * 512 <= b_slab - MiB
    st.free(ts[0])                                    # one page-cache tensor
    assert os.stat(pc).st_blocks * 512 <= b_pc - MiB
    # a freed extent is reused by the next tensor of the same size
    t2 = st.allocate_tensor(9, "k", shape, np.float16)
    st.plan()
    st.write(t2, 0, _rand(rng, shape, np.float16))
    st.destroy(unlink=False)
    assert os.stat(slab).st_blocks == 0 and os.stat(pc).st_blocks == 0
    st2 = KVStore(str(tmp_path / "u"), budget=0)
    k, _ = st2.allocate(0, shape, np.float16)
    st2.write(k, 0, _rand(rng, shape, np.float16))
    p = st2.slab_path
    st2.destroy()
    assert not os.path.exists(p)
    with pytest.raises(ValueError):
        st2.read(k)


# -- budgeter -------------------------------------------------------------------------
def test_parse_proc_cgroup():
    v1 = "12:memory:/phx/a\n11:cpu,cpuacct:/x\n0::/user.slice\n"
    assert parse_proc_cgroup(v1) == {"v1": "/phx/a", "v2": "/user.slice"}
    assert parse_proc_cgroup("0::/system.slice/x.service\n") == {"v2": "/system.slice/x.service"}


def _mk(d, files):
    os.makedirs(d, exist_ok=True)
    for k, v in files.items():
        with open(os.path.join(d, k), "w") as f:
            f.write(v)


def test_cgroup_files_v1_and_v2(tmp_path):
    # v1: the child has no limit of its own, its parent has 1 GiB: the parent binds
    r1 = tmp_path / "v1"
    _mk(r1 / "memory", {"memory.limit_in_bytes": str(UNLIMITED * 8),
                        "memory.usage_in_bytes": "0", "memory.stat": ""})
    _mk(r1 / "memory" / "p", {"memory.limit_in_bytes": str(1 << 30),
                              "memory.usage_in_bytes": str(300 * MiB),
                              "memory.stat": f"total_inactive_file {100 * MiB}\n"})
    _mk(r1 / "memory" / "p" / "c", {"memory.limit_in_bytes": "9223372036854771712",
                                    "memory.usage_in_bytes": str(200 * MiB),
                                    "memory.stat": "total_inactive_file 0\n"})
    cg = cgroup_memory(root=str(r1), proc_cgroup="5:memory:/p/c\n")
    assert cg.version == 1 and len(cg.levels) == 3
    assert cg.binding.limit == 1 << 30
    # inactive file pages are not free: in an inference cgroup they are the
    # process's own (libraries, modules), part of the memory the cap was sized for
    assert cg.binding.headroom == (1 << 30) - 300 * MiB
    assert cg.binding.inactive_file == 100 * MiB
    # v2
    r2 = tmp_path / "v2"
    _mk(r2, {"cgroup.controllers": "cpu memory", "memory.stat": ""})
    _mk(r2 / "a", {"memory.max": str(512 * MiB), "memory.current": str(100 * MiB),
                   "memory.stat": f"anon 1\ninactive_file {10 * MiB}\n"
                                  f"file_mapped {4 * MiB}\n"})
    cg2 = cgroup_memory(root=str(r2), proc_cgroup="0::/a\n")
    assert cg2.version == 2 and cg2.binding.limit == 512 * MiB
    assert cg2.binding.headroom == 412 * MiB and cg2.binding.mapped_file == 4 * MiB
    b = Budget(8 << 30, cg2, pinned=50 * MiB, reserve=12 * MiB)
    assert b.bytes == 350 * MiB
    # the caller's own resident page cache (Group 1) is added back, once
    b_own = Budget(8 << 30, cg2, pinned=50 * MiB, reserve=12 * MiB, own=30 * MiB)
    assert b_own.bytes == 380 * MiB
    assert "B_pc" in b.explain()
    _mk(r2 / "m", {"memory.max": "max", "memory.current": "5", "memory.stat": ""})
    cg3 = cgroup_memory(root=str(r2), proc_cgroup="0::/m\n")
    assert cg3.binding is None
    assert Budget(1 << 30, cg3, 0, 0).bytes == 1 << 30


def test_budget_in_a_real_cgroup():
    if not ROOT:
        pytest.skip("creating a memory cgroup needs root")
    from phx.bench._kv_cgroup import MemCgroup, can_create
    ok, why = can_create()
    if not ok:
        pytest.skip(why)
    limit = 256 * MiB
    code = ("import json; from phx.kv import measure_budget; "
            "b = measure_budget(pinned_bytes=16 << 20, reserve=8 << 20); "
            "print(json.dumps(b.as_dict()))")
    with MemCgroup(f"phx-test-kv-{os.getpid()}", limit) as cg:
        p = cg.popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                     stderr=subprocess.PIPE, text=True)
        out, err = p.communicate(timeout=60)
        assert p.returncode == 0, err
    b = json.loads(out)
    assert b["cgroup_limit"] == limit, b
    assert 0 < b["cgroup_usage"] < limit
    assert b["budget"] == b["headroom"] - 24 * MiB
    assert b["headroom"] <= limit - b["cgroup_usage"]
    assert b["budget"] < limit


def _meminfo_available() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    pytest.skip("no MemAvailable in /proc/meminfo (kernel < 3.14)")


def test_budget_here_is_sane():
    """measure_budget() on this machine: MemAvailable as /proc/meminfo has it
    (read just before and after), B_pc = headroom - pinned - reserve with the
    default reserve (8 MiB + 2 % of the headroom), headroom never above either
    MemAvailable or the cgroup's headroom."""
    before = _meminfo_available()
    b = measure_budget(pinned_bytes=3 * MiB)
    after = _meminfo_available()
    slack = 8 * MiB + abs(after - before)   # other processes allocate meanwhile
    assert min(before, after) - slack <= b.mem_available <= max(before, after) + slack, \
        (before, b.mem_available, after)
    assert b.pinned == 3 * MiB and b.override is None
    assert b.reserve == 8 * MiB + b.headroom // 50
    assert b.bytes == max(0, b.headroom - 3 * MiB - b.reserve)
    cg = b.cgroup_headroom
    assert b.headroom == (b.mem_available if cg is None else min(b.mem_available, cg))
    assert b.as_dict()["budget"] == b.bytes
    # an explicit reserve and an override are taken as given
    b2 = measure_budget(pinned_bytes=0, reserve=5 * MiB)
    assert b2.reserve == 5 * MiB and b2.bytes == max(0, b2.headroom - 5 * MiB)
    assert measure_budget(override=12345).bytes == 12345


def _own_memory_cgroup():
    """(version, directory, [directories up to the mount]) of this process's memory
    cgroup, read straight from /proc/self/cgroup and the mounts; None if none."""
    with open("/proc/self/cgroup") as f:
        lines = [ln.strip().split(":", 2) for ln in f if ln.count(":") >= 2]
    for hid, ctrls, rel in lines:
        if "memory" in ctrls.split(",") and os.path.isdir("/sys/fs/cgroup/memory"):
            version, mount = 1, "/sys/fs/cgroup/memory"
            break
    else:
        for hid, ctrls, rel in lines:
            if hid == "0" and ctrls == "" and os.path.exists("/sys/fs/cgroup/cgroup.controllers"):
                version, mount = 2, "/sys/fs/cgroup"
                break
        else:
            return None
    own = os.path.join(mount, rel.strip("/")) if rel.strip("/") else mount
    if not os.path.isdir(own):
        own = mount                      # a cgroup namespace: we sit at the mount's root
    chain, d = [], own
    while True:
        chain.append(d)
        if os.path.samefile(d, mount):
            return version, own, chain
        d = os.path.dirname(d)


def test_budget_here_sees_the_cgroup():
    """The budgeter finds this process's memory cgroup and, where a level sets a
    limit, takes the tightest (limit - usage) as the headroom."""
    found = _own_memory_cgroup()
    if found is None:
        pytest.skip("no memory cgroup controller is mounted here: nothing to find")
    version, own, chain = found
    b = measure_budget()
    assert b.cgroup is not None, f"memory cgroup v{version} at {own} not found"
    assert b.cgroup.version == version and os.path.samefile(b.cgroup.path, own), \
        (b.cgroup.version, b.cgroup.path, version, own)
    names = (("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file")
             if version == 1 else ("memory.max", "memory.current", "inactive_file"))
    headrooms = []
    for d in chain:
        try:
            with open(os.path.join(d, names[0])) as f:
                lim = f.read().strip()
            with open(os.path.join(d, names[1])) as f:
                use = int(f.read())
            with open(os.path.join(d, "memory.stat")) as f:
                stat = dict(ln.split() for ln in f)
        except OSError:
            continue                     # the root of v2 has no memory.max
        if lim != "max" and int(lim) < UNLIMITED:
            headrooms.append(int(lim) - use)
    if not headrooms:
        assert b.cgroup.binding is None and b.cgroup_headroom is None
        assert b.headroom == b.mem_available
        return
    # usage moves between the two reads: allow 16 MiB
    assert b.cgroup_headroom is not None, "a cgroup limit is set but the budgeter saw none"
    assert abs(b.cgroup_headroom - min(headrooms)) <= 16 * MiB, (b.cgroup_headroom, headrooms)
    assert b.headroom <= b.cgroup_headroom


# -- adaptive pipeline ----------------------------------------------------------------
def _jobs(n, read_s=0.004, dma_s=0.002, nbytes=1 << 20):
    def read(relay):
        time.sleep(read_s)
        relay[:8] = 7
        return nbytes

    def dma(relay, nb):
        assert relay[0] == 7
        time.sleep(dma_s)
    return [CopyJob(read, dma) for _ in range(n)]


def _drive(pipe, steps=5, per_step=3):
    seen = []
    for _ in range(steps):
        seen.append(pipe.begin_step())
        for _ in range(per_step):
            pipe.run(_jobs(2))
        pipe.end_step()
    return seen


@pytest.mark.parametrize("slow,expect", [(INTRA, CROSS), (CROSS, INTRA)])
def test_pipeline_locks_the_faster_strategy(slow, expect):
    def hook(strategy, thread, job):
        if strategy == slow:
            time.sleep(0.03)
    with AdaptivePipeline(4096, threads=2, delay_hook=hook) as pipe:
        seen = _drive(pipe)
        assert seen[:3] == [INTRA, INTRA, CROSS]     # 1 skipped (cold), 2 intra, 3 cross
        assert pipe.locked == expect
        assert seen[3:] == [expect, expect]
        rep = pipe.report()
        assert rep["choice"] == expect and set(rep["probe"]) == {INTRA, CROSS}
        assert rep["probe"][slow]["gbps"] < rep["probe"][expect]["gbps"]


def test_pipeline_cross_staggers_reads():
    active = [0]
    peak = [0]
    lock = threading.Lock()

    def read(relay):
        with lock:
            active[0] += 1
            peak[0] = max(peak[0], active[0])
        time.sleep(0.02)
        with lock:
            active[0] -= 1
        return 10

    jobs = [CopyJob(read, lambda r, n: time.sleep(0.001)) for _ in range(6)]
    with AdaptivePipeline(4096, threads=2, strategy=CROSS) as pipe:
        pipe.begin_step()
        assert pipe.run(jobs) == 60
    assert peak[0] == 1
    peak[0] = 0
    with AdaptivePipeline(4096, threads=2, strategy=INTRA) as pipe:
        pipe.begin_step()
        pipe.run(jobs)
    assert peak[0] == 2


def test_pipeline_propagates_errors():
    def bad(relay):
        raise OSError(5, "boom")
    with AdaptivePipeline(4096, threads=2, strategy=CROSS) as pipe:
        pipe.begin_step()
        with pytest.raises(OSError):
            pipe.run([CopyJob(bad, lambda r, n: None)] + _jobs(3))


# -- the benchmark --------------------------------------------------------------------
TINY = {"layers": 3, "batch": 1, "hidden": 512, "heads": 4, "prompt": 24, "gen": 6,
        "dtype": "float16", "threads": 2}


@pytest.mark.parametrize("config", ["baseline", "cachepolicy", "direct", "dual", "dual-nowb"])
def test_bench_worker_replay(tmp_path, config):
    from phx.bench._kv_worker import run_worker
    res = run_worker({**TINY, "config": config, "dir": str(tmp_path / config)})
    assert res["verified"] is True, res["verify"]
    assert res["verify"]["tensors"] == 6 and res["verify"]["mismatched"] == []
    assert res["decode_logical_read_bytes"] == sum(6 * (24 + i) * 1024 for i in range(5))
    assert len(res["decode_step_s"]) == 5
    assert res["decode_s"] == pytest.approx(sum(res["decode_step_s"]))
    if config.startswith("dual"):
        assert res["pipeline"]["choice"] in (INTRA, CROSS)


@pytest.mark.parametrize("config", ["baseline", "direct", "dual"])
def test_bench_worker_hit_rate(tmp_path, config):
    """The decode reads' page-cache hit rate (cachestat before each read): none on
    the direct path; the page-cache paths, with no memory cap here, hit."""
    _need_cachestat()
    from phx.bench._kv_worker import run_worker
    res = run_worker({**TINY, "config": config, "dir": str(tmp_path / config)})
    assert res["read_pages"] > 0 and res["hit_rate"] is not None, res
    if config == "direct" or (config == "dual" and not res["plan"]["layers_pagecache"]):
        assert res["hit_pages"] == 0, res
    else:
        assert res["hit_rate"] > 0.5, res


def _swap_tensors_0_1(cls, monkeypatch):
    """Prefill writes of tensors 0 and 1 (layer 0's K and V) go to each other."""
    orig = cls.write
    monkeypatch.setattr(cls, "write", lambda self, tid, start, src:
                        orig(self, {0: 1, 1: 0}.get(tid, tid), start, src))


def _row_off_tensor_2(cls, monkeypatch):
    """Tensor 2's prefill lands one row late (its row 0 is never written)."""
    orig = cls.write
    monkeypatch.setattr(cls, "write", lambda self, tid, start, src:
                        orig(self, tid, start + (tid == 2), src[:src.nbytes - self.s.row_bytes]
                             if tid == 2 else src))


def _byte_off_first_write(cls, monkeypatch):
    """The storage layer's first write lands 8 bytes late (phx.kv backends)."""
    from phx.kv import slab
    for be in (slab.SlabBackend, slab.PageCacheBackend):
        orig = be.write
        state = {"n": 0}

        def write(self, buf, offset, _orig=orig, _state=state):
            _state["n"] += 1
            return _orig(self, buf, offset + (8 if _state["n"] == 1 else 0))
        monkeypatch.setattr(be, "write", write)


_FAULTS = [(_swap_tensors_0_1, [0, 1], "swapped"), (_row_off_tensor_2, [2], "row-offset"),
           (_byte_off_first_write, None, "byte-offset")]


@pytest.mark.parametrize("config,fault,bad", [
    pytest.param(c, f, b, id=f"{c}-{name}") for c in ("baseline", "direct", "dual")
    for f, b, name in _FAULTS
    # the memmap baseline has no phx.kv storage layer to shift bytes in
    if not (c == "baseline" and f is _byte_off_first_write)])
def test_bench_worker_catches_misplaced_data(tmp_path, monkeypatch, config, fault, bad):
    """The bench's verification fails the run when two tensors are swapped or data
    lands at the wrong offset, and names the tensors."""
    from phx.bench import _kv_worker
    cls = _kv_worker.MemmapIO if config == "baseline" else _kv_worker.StoreIO
    fault(cls, monkeypatch)
    # no warm-up: its own store would take the fault that counts writes
    res = _kv_worker.run_worker({**TINY, "config": config, "dir": str(tmp_path / config),
                                 "warmup": False})
    assert res["verified"] is False, res["verify"]
    if bad is not None:
        assert res["verify"]["mismatched"] == bad
    else:
        assert res["verify"]["mismatched"], res["verify"]


@pytest.mark.parametrize("model", ["opt-6.7b", "llama-3-8b"])
def test_bench_kv_cli_in_cgroups(tmp_path, model):
    if not ROOT:
        pytest.skip("memory cgroups and drop_caches need root")
    from phx.bench._kv_cgroup import can_create
    ok, why = can_create()
    if not ok:
        pytest.skip(why)
    js = tmp_path / "kv.json"
    png = tmp_path / "kv.png"
    cmd = [sys.executable, "-m", "phx", "bench", "kv", "--model", model,
           "--layers", "3", "--hidden", "512", "--heads", "8", "--prompt", "24",
           *(["--kv-heads", "2"] if model == "llama-3-8b" else []), "--gen", "6", "--caps", "0.5,1.5",
           "--repeat", "1", "--quiet", "--dir", str(tmp_path / "d"),
           "--json", str(js), "--plot", str(png),
           # fio (a 256 MiB file, ~5 s) once, in the OPT case
           *(["--no-fio"] if model == "llama-3-8b" else [])]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=170)
    assert p.returncode == 0, p.stdout + p.stderr
    doc = json.loads(js.read_text())
    assert len(doc["rows"]) == 14
    assert {r["config"] for r in doc["rows"]} == {"baseline", "stock-mixed", "cachepolicy",
                                                 "direct", "dual", "dual-mem", "dual-mem-ra"}
    assert doc["digests"]["identical"] and doc["negative_control"]["detected"]
    assert doc["calibration"]["ideal_dev_source"] == ("fio" if model == "opt-6.7b" and
                                                       shutil.which("fio") else "phx calibration")
    for pc in doc["per_cap"]:
        assert "ratio_decode_vs_baseline" in pc and "ratio_prefill_vs_baseline" in pc
    assert all(r["runs"] == 1 for r in doc["rows"])
    assert png.stat().st_size > 1000
    w = doc["workload"]
    assert w["model"] == model and w["kv_heads"] == (8 if model == "opt-6.7b" else 2)
    assert w["dtype"] == ("float16" if model == "opt-6.7b" else "bfloat16")


@pytest.mark.parametrize("strategy", [INTRA, CROSS])
@pytest.mark.parametrize("where", ["read", "dma"])
def test_pipeline_failure_releases_the_other_threads(strategy, where):
    """A failing storage read or DMA of one job ends the whole batch with that
    error (no deadlock: under Overlap-Cross the other thread waits for a read
    turn the failed thread owns)."""
    def read(relay):
        return 8

    def bad_read(relay):
        raise OSError(5, "read boom")

    def bad_dma(relay, nb):
        raise OSError(5, "dma boom")
    jobs = [CopyJob(bad_read if where == "read" else read,
                    (lambda r, n: None) if where == "read" else bad_dma)]
    jobs += [CopyJob(read, lambda r, n: None) for _ in range(5)]
    out = {}

    def go():
        with AdaptivePipeline(4096, threads=2, strategy=strategy) as pipe:
            pipe.begin_step()
            try:
                pipe.run(jobs)
            except BaseException as e:
                out["err"] = e
    t = threading.Thread(target=go, daemon=True)
    t.start()
    t.join(10)
    assert not t.is_alive(), f"{strategy}: a failed {where} left the pipeline waiting forever"
    assert isinstance(out.get("err"), OSError) and f"{where} boom" in str(out["err"]), out


def test_repeated_plan_counts_group1_once(tmp_path):
    """plan() again after Group 1 was written: its resident pages are in the
    cgroup's usage, and they must not also come off the budget a second time.
    The same layers end up on the page-cache path as with one plan() for all."""
    _need_cachestat()
    shape = (64, 4, 128)                                   # 64 KiB per tensor
    base = 20 * MiB

    class Store(KVStore):
        def measure_budget(self):
            own = self.resident_group1_bytes()
            # a cgroup whose usage is base + this store's resident Group 1 pages
            cg = CgroupMemory(1, "/fake", [CgroupLevel("/fake", limit, base + own, 0)])
            return Budget(1 << 40, cg, 0, 0, None, own)

    def levels(st):
        return sorted({t.layer for t in st.tensors() if t.group == PAGECACHE})

    limit = base + 20 * 128 * 1024        # room for 20 of the 24 (K, V) pairs of 128 KiB
    one = Store(str(tmp_path / "one"))
    for L in range(24):
        one.allocate(L, shape, np.float16)
    one.plan()
    want = levels(one)
    assert len(want) == 20, want
    two = Store(str(tmp_path / "two"))
    first = [two.allocate(L, shape, np.float16) for L in range(12)]
    two.plan()
    for k, v in first:
        for t in (k, v):
            two.write(t, 0, np.ones(shape, np.float16))
    assert two.resident_group1_bytes() == 24 * 64 * 1024
    for L in range(12, 24):
        two.allocate(L, shape, np.float16)
    two.plan()
    assert levels(two) == want, str(two.last_plan)
    one.destroy()
    two.destroy()


def test_dual_stays_under_the_cap_in_a_real_cgroup(tmp_path):
    """The bench's dual run under a real memory cgroup of fixed + 0.5 x the working
    set: Group 1 holds at most 0.5 x the working set (the worker's own file pages
    and its untouched stand-in GPU buffers are not free memory)."""
    if not ROOT:
        pytest.skip("memory cgroups need root")
    from phx.bench._kv_cgroup import can_create
    ok, why = can_create()
    if not ok:
        pytest.skip(why)
    from phx.bench import kv as bench
    from phx.bench._kv_worker import Shape
    conf = {**TINY, "layers": 12, "hidden": 2048, "heads": 16, "prompt": 200, "gen": 4,
            "reserve": 0}
    shape = Shape(conf)
    from phx.bench import _common
    # as the bench does: a cold cache, so the worker's own file pages (libraries,
    # modules) are charged to its cgroup
    _common.drop_caches()
    probe = bench._run_in_cgroup({**conf, "config": "probe", "dir": str(tmp_path / "p")},
                                 None, 120)
    assert "error" not in probe, probe
    cap = int(probe["usage"]) + shape.working_set // 2
    _common.drop_caches()
    res = bench._run_in_cgroup({**conf, "config": "dual", "dir": str(tmp_path / "d")},
                               cap, 120)
    assert res.get("verified") is True, res
    g1 = res["plan"]["pagecache_bytes"]
    b = res["budget"]
    # what the cgroup really had room for when the plan was made
    assert 0 < g1 <= b["cgroup_limit"] - b["cgroup_usage"] - b["pinned"], (g1, b)
    # and the cap's KV share, give or take one layer: the probe's fixed memory
    # varies by a MiB or two from run to run
    pair = 2 * shape.tensor_bytes
    assert g1 <= shape.working_set // 2 + pair, (g1, shape.working_set, b)


def test_bench_cgroup_caps_swap_too():
    """The bench's memory cgroup limits memory + swap, not memory alone (v1:
    memory.memsw.limit_in_bytes = the limit; v2: memory.swap.max = 0), also when
    the limit is lowered and raised again."""
    if not ROOT:
        pytest.skip("memory cgroups need root")
    from phx.bench._kv_cgroup import MemCgroup, can_create
    ok, why = can_create()
    if not ok:
        pytest.skip(why)
    with MemCgroup(f"phx-test-swap-{os.getpid()}", 256 * MiB) as cg:
        for limit in (256 * MiB, 64 * MiB, 512 * MiB):
            cg.set_limit(limit)
            if cg.version == 1:
                memsw = os.path.join(cg.path, "memory.memsw.limit_in_bytes")
                if not os.path.exists(memsw):
                    pytest.skip("this kernel keeps no swap accounting (swapaccount=0)")
                assert int(open(memsw).read()) == limit
                assert int(open(os.path.join(cg.path, "memory.limit_in_bytes")).read()) == limit
            else:
                swap = os.path.join(cg.path, "memory.swap.max")
                if not os.path.exists(swap):
                    pytest.skip("this kernel has no swap controller (no memory.swap.max)")
                assert open(swap).read().strip() == "0"
                assert int(open(os.path.join(cg.path, "memory.max")).read()) == limit
            assert cg.swap_limited


# -- the NVMe backend, against a namespace double -------------------------------------
class _FakeNamespace:
    """phx.nvme.Namespace's surface over a bytearray: LBAs of 512 B; ``short``
    makes the n-th I/O call (counted from 1) move one block less."""

    def __init__(self, nblocks=4096, lba=512):
        self.path, self.lba_size, self.start, self.end = "/dev/fake-ng", lba, 0, nblocks * lba
        self.info = {"nr_queues": 2}
        self.data = bytearray(os.urandom(self.end))
        self.closed = False
        self.calls = 0
        self.short = None
        self.deallocated: list[tuple[int, int]] = []

    def _n(self, n):
        self.calls += 1
        return n - self.lba_size if self.calls == self.short else n

    def read(self, buf, off):
        mv = memoryview(buf).cast("B")
        n = self._n(mv.nbytes)
        mv[:n] = self.data[off:off + n]
        return n

    def write(self, buf, off):
        mv = memoryview(buf).cast("B")
        n = self._n(mv.nbytes)
        self.data[off:off + n] = mv[:n]
        return n

    def deallocate(self, off, length):
        self.deallocated.append((off, length))

    def close(self):
        self.closed = True


@pytest.mark.parametrize("op", ["read", "write"])
@pytest.mark.parametrize("which", [1, 2, 3])
def test_nvme_backend_short_partial_block_raises(op, which):
    """A short count on ANY command of an unaligned transfer (the aligned middle,
    the head block's read, the tail block's read or write-back) is an error, not
    stale bytes handed on or written back."""
    from phx.kv.nvme_backend import NvmeBackend
    ns = _FakeNamespace()
    be = NvmeBackend(namespace=ns)
    buf = bytearray(os.urandom(3000))
    off = 700                               # head 324 B, middle 2048 B, tail 628 B
    calls = {"read": 3, "write": 5}[op]     # write: middle + (read, write) x 2
    ns.short = which if which <= calls else None
    with pytest.raises(OSError, match="short"):
        getattr(be, op)(buf, off)
    ns.short, ns.calls = calls, 0           # the last command of the transfer
    with pytest.raises(OSError, match="short"):
        getattr(be, op)(buf, off)
    ns.short, ns.calls = None, 0
    be.write(buf, off)                      # and without faults it round-trips
    back = bytearray(3000)
    be.read(back, off)
    assert back == buf


def test_nvme_backend_trims_each_lba_once(tmp_path):
    """free() deallocates a tensor's LBAs; destroy() deallocates only what is still
    bound: no LBA range is TRIMmed twice."""
    from phx.kv.nvme_backend import NvmeBackend
    ns = _FakeNamespace(nblocks=8192)
    st = KVStore(str(tmp_path / "nv"), mode="direct", direct_backend=NvmeBackend(namespace=ns))
    kv = [st.allocate(L, (8, 2, 64), np.float16) for L in range(4)]   # 2 KiB each
    for k, v in kv:
        st.write(k, 0, np.ones((8, 2, 64), np.float16))
    st.free(kv[1][0])
    st.destroy()
    covered = np.zeros(ns.end, dtype=np.int32)
    for off, ln in ns.deallocated:
        covered[off:off + ln] += 1
    assert covered.max() == 1, ns.deallocated
    assert covered[:8 * 2048].all(), ns.deallocated      # every tensor's LBAs, once


# -- the Llama-3-8B (GQA) shape -------------------------------------------------------
def test_bench_model_shapes():
    """--model picks the KV shape: OPT-6.7B 32 x (rows, B*32, 128) fp16; Llama-3-8B
    GQA 32 x (rows, B*8, 128) bf16 (a quarter of OPT's bytes); flags override."""
    import argparse
    from phx.bench import kv as bench
    from phx.bench._kv_worker import Shape
    p = argparse.ArgumentParser()
    bench.add_arguments(p)
    opt = Shape({**bench.model_shape(p.parse_args([])), "batch": 2, "prompt": 512, "gen": 32})
    assert opt.tshape == (543, 64, 128) and opt.row_bytes == 2 * 32 * 128 * 2
    assert opt.working_set == 64 * 543 * 2 * 8192
    ll = Shape({**bench.model_shape(p.parse_args(["--model", "llama-3-8b"])),
                "batch": 2, "prompt": 512, "gen": 32})
    assert ll.tshape == (543, 16, 128) and ll.dtype_name == "bfloat16"
    assert ll.dtype.itemsize == 2 and ll.working_set * 4 == opt.working_set
    small = bench.model_shape(p.parse_args(["--model", "llama-3-8b", "--layers", "3",
                                            "--heads", "8", "--hidden", "512"]))
    assert (small["layers"], small["heads"], small["kv_heads"]) == (3, 8, 8)
    assert bench.model_shape(p.parse_args(["--heads", "4", "--hidden", "512"]))["kv_heads"] == 4
    from phx.bench._common import BenchError
    with pytest.raises(BenchError):
        bench.model_shape(p.parse_args(["--model", "llama-3-8b", "--heads", "12"]))


@pytest.mark.parametrize("config", ["baseline", "dual"])
def test_bench_worker_replay_gqa_bf16(tmp_path, config):
    """A scaled-down Llama-3 GQA shape in bf16 replays and verifies."""
    from phx.bench._kv_worker import run_worker
    conf = {**TINY, "heads": 8, "kv_heads": 2, "dtype": "bfloat16"}
    res = run_worker({**conf, "config": config, "dir": str(tmp_path / config)})
    assert res["verified"] is True, res["verify"]
    row = 2 * 64 * 2                               # kv_heads x head_dim x 2 bytes
    assert res["decode_logical_read_bytes"] == sum(6 * (24 + i) * row for i in range(5))
