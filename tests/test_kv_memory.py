"""Dual-Blade v2 (issue 26, parts 1 and 2): Group 1 in memory (a memfd never written
back), the guard that shrinks it instead of letting the cgroup's OOM killer in,
and rebalance() (promote / demote whole layers between steps).

Every test checks every KV byte against a reference made from fresh random data.
The real-cgroup test (root) takes ~3-6 s; the rest well under a second each.
"""
from __future__ import annotations

import hashlib
import os
import pathlib
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from phx.kv import DIRECT, PAGECACHE, KVStore
from phx.kv.slab import MemoryBackend

MiB = 1 << 20
ROOT = os.geteuid() == 0
SHAPE = (100, 8, 64)                      # 100 rows of 1 KiB: 102400 bytes
PAIR = 2 * 102400


@pytest.fixture
def tmp_path(data_dir):
    return pathlib.Path(data_dir)


def _fill(store, layers, rng, shape=SHAPE):
    """Allocate ``layers`` K/V pairs, write random bytes, return {tensor id: bytes}."""
    ref = {}
    kv = [store.allocate(L, shape, np.float16) for L in range(layers)]
    for k, v in kv:
        for t in (k, v):
            a = rng.integers(0, 1 << 16, size=shape, dtype=np.uint16).view(np.float16)
            store.write(t, 0, a)
            ref[t.id] = a.tobytes()
    return kv, ref


def _check(store, ref):
    for t in store.tensors():
        got = store.read(t)
        assert got.tobytes() == ref[t.id], f"{t} reads back other bytes"


def _groups(store):
    return {t.layer: t.group for t in store.tensors()}


def test_memory_group1_readback_and_no_file(tmp_path):
    """Group 1 lives in a memfd: no page-cache file in the KV directory, its
    allocated memory equals the Group 1 extents, and every byte of both groups
    (whole tensors, row ranges, single rows, async row appends) reads back."""
    rng = np.random.default_rng(1)
    st = KVStore(str(tmp_path / "m"), group1="memory", budget=3 * PAIR + 3 * 4096)
    kv, ref = _fill(st, 6, rng)
    assert isinstance(st._pc, MemoryBackend)
    assert st.last_plan is not None and st.last_plan.n1 == 3
    assert [g for _, g in sorted(_groups(st).items())] == [PAGECACHE] * 3 + [DIRECT] * 3
    assert sorted(os.listdir(tmp_path / "m")) == ["kv-slab.bin"]
    g1 = sum(t.extent.length for t in st.tensors() if t.group == PAGECACHE)
    assert st._pc.allocated_bytes() == g1 == st.resident_group1_bytes()
    # rows [a:b] and single rows, into fresh arrays, against the reference
    for t in st.tensors():
        want = np.frombuffer(ref[t.id], dtype=np.float16).reshape(SHAPE)
        for a, b in ((0, 100), (0, 37), (13, 14), (99, 100), (5, 61)):
            assert st.read(t, a, b).tobytes() == want[a:b].tobytes(), (t, a, b)
    # appends (the decode step's new rows) through write_async
    for t in st.tensors():
        row = rng.integers(0, 1 << 16, size=(1,) + SHAPE[1:], dtype=np.uint16)
        st.write_async(t, 42, row.view(np.float16)).result()
        cur = bytearray(ref[t.id])
        cur[42 * 1024:43 * 1024] = row.tobytes()
        ref[t.id] = bytes(cur)
    _check(st, ref)
    st.destroy()
    assert not (tmp_path / "m" / "kv-slab.bin").exists()


def test_memory_group1_is_dual_only(tmp_path):
    with pytest.raises(ValueError):
        KVStore(str(tmp_path / "x"), mode="pagecache", group1="memory")
    with pytest.raises(ValueError):
        KVStore(str(tmp_path / "x"), group1="ram")


@pytest.mark.parametrize("group1", ["memory", "pagecache"])
def test_rebalance_promotes_and_demotes_whole_layers(tmp_path, group1):
    """rebalance() grows Group 1 by the next Group 2 layers while they fit the
    budget now and shrinks it from its last layer while it is over: Group 1 stays
    a prefix, a moved layer's K and V are one contiguous run, memory is given
    back on demotion, and every byte survives each move."""
    rng = np.random.default_rng(2)
    page_pair = PAIR                               # 102400 bytes: 25 pages
    st = KVStore(str(tmp_path / group1), group1=group1, budget=2 * page_pair)
    _, ref = _fill(st, 6, rng)
    assert st.last_plan.n1 == 2
    st.budget_override = 4 * page_pair + 100
    r = st.rebalance()
    assert r["promoted"] == [2, 3] and r["demoted"] == [], r
    assert [g for _, g in sorted(_groups(st).items())] == [PAGECACHE] * 4 + [DIRECT] * 2
    _check(st, ref)
    if group1 == "memory":
        assert st._pc.allocated_bytes() == 4 * page_pair
    st.budget_override = page_pair
    r = st.rebalance()
    assert r["demoted"] == [3, 2, 1] and r["promoted"] == [], r
    assert [g for _, g in sorted(_groups(st).items())] == [PAGECACHE] + [DIRECT] * 5
    if group1 == "memory":
        assert st._pc.allocated_bytes() == page_pair
    for L in (1, 2, 3):
        k, v = sorted((t for t in st.tensors() if t.layer == L), key=lambda t: t.kind)
        assert k.extent.end == v.extent.start, (k.extent, v.extent)   # one run
    st._direct.alloc.check()
    _check(st, ref)
    # nothing to do: no move
    r = st.rebalance()
    assert r["promoted"] == r["demoted"] == []
    assert [m[0] for m in st.moves] == ["promote"] * 2 + ["demote"] * 3
    st.destroy()


def test_rebalance_leaves_direct_only_alone(tmp_path):
    st = KVStore(str(tmp_path / "d"), mode="direct")
    _, ref = _fill(st, 3, np.random.default_rng(3))
    assert st.rebalance() == {"promoted": [], "demoted": []}
    _check(st, ref)
    st.destroy()


def test_admission_sends_layers_to_group2_when_the_room_is_gone(tmp_path, monkeypatch):
    """A budget that was wrong (far above the memory there is) never grows Group
    1 past the room: the layer that does not fit, and every later one not yet
    written, go to Group 2 as they are first touched; the data is intact."""
    rng = np.random.default_rng(4)
    st = KVStore(str(tmp_path / "a"), group1="memory", budget=1 << 40, guard=1 * MiB)
    room = {"left": 2 * MiB + 3 * PAIR + 3 * 8192}      # 3 layers (+ 2 x guard), then no room

    def fake_room():
        return room["left"] - st._pc.allocated_bytes()
    monkeypatch.setattr(st, "_room", fake_room)
    _, ref = _fill(st, 6, rng)
    assert [g for _, g in sorted(_groups(st).items())] == [PAGECACHE] * 3 + [DIRECT] * 3
    assert [m[0] for m in st.moves] == ["demote"] * 3 and all("admission" in m[3] for m in st.moves)
    # layers 3-5 form one run on the slab (moved together, in order)
    ext = [t.extent for t in st.tensors() if t.group == DIRECT]
    assert all(a.end == b.start for a, b in zip(ext, ext[1:])), ext
    _check(st, ref)
    st.destroy()


def test_shed_moves_the_last_layers_and_frees_their_memory(tmp_path):
    rng = np.random.default_rng(5)
    st = KVStore(str(tmp_path / "s"), group1="memory", budget=1 << 40, guard=0)
    _, ref = _fill(st, 4, rng)
    before = st._pc.allocated_bytes()
    assert st.shed(PAIR + 1) == [3, 2]
    assert st._pc.allocated_bytes() == before - 2 * PAIR
    assert [g for _, g in sorted(_groups(st).items())] == [PAGECACHE] * 2 + [DIRECT] * 2
    _check(st, ref)
    st.destroy()


_GUARD_CHILD = textwrap.dedent("""
    import hashlib, json, sys, time
    import numpy as np
    from phx.kv import KVStore
    from phx.bench._kv_worker import own_cgroup
    MiB = 1 << 20
    print(own_cgroup().usage, flush=True)
    assert sys.stdin.readline().strip() == "go"
    guard = int(sys.argv[1])
    rng = np.random.default_rng(6)
    shape = (256, 16, 256)                  # 2 MiB of fp16 per tensor
    # a budget far above the cap: only the admission check and the guard keep
    # Group 1 inside it
    st = KVStore(sys.argv[2], group1="memory", budget=1 << 40, guard=guard,
                 guard_interval=0.01)
    ref = {}
    kv = [st.allocate(L, shape, np.float16) for L in range(12)]   # 48 MiB
    a = np.empty(shape, np.float16)
    for k, v in kv:
        for t in (k, v):
            a.reshape(-1).view(np.uint8)[:] = np.frombuffer(rng.bytes(a.nbytes), np.uint8)
            st.write(t, 0, a)
            ref[t.id] = hashlib.sha256(a).hexdigest()
    g1_written = sum(1 for t in st.tensors() if t.group == 1)
    # the rest of the job grows after the plan (activations, buffers): 32 MiB
    grow = []
    for _ in range(16):
        b = np.empty(2 * MiB, np.uint8)
        b[:] = 1
        grow.append(b)
        time.sleep(0.03)
    time.sleep(0.1)
    bad = [t.id for t in st.tensors()
           if hashlib.sha256(st.read(t)).hexdigest() != ref[t.id]]
    print(json.dumps({"g1_written": g1_written,
                      "g1_end": sum(1 for t in st.tensors() if t.group == 1),
                      "moves": [m[0] + ":" + m[3].split(":")[0] for m in st.moves],
                      "bad": bad}), flush=True)
    st.destroy()
""")


def test_guard_keeps_group1_in_memory_out_of_the_oom_killer(tmp_path):
    """In a real memory cgroup (cap = the process + 48 MiB, swap off) a store told
    a budget far above the cap writes 48 MiB of KV, then the process grows by
    32 MiB: Group 1 must shrink (admission, then the guard thread) instead of
    the job being OOM-killed, and every tensor reads back intact.  With the guard
    off (guard=0: no guard thread, and admission keeps only the layer itself
    inside the cap) the same child is OOM-killed."""
    if not ROOT:
        pytest.skip("memory cgroups need root")
    from phx.bench._kv_cgroup import MemCgroup, can_create
    ok, why = can_create()
    if not ok:
        pytest.skip(why)
    import json

    def run(guard, d):
        with MemCgroup(f"phx-test-guard-{os.getpid()}", None) as cg:
            p = cg.popen([sys.executable, "-c", _GUARD_CHILD, str(guard), d],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
            usage = int(p.stdout.readline())
            cg.set_limit(usage + 48 * MiB)
            p.stdin.write("go\n")
            p.stdin.flush()
            out, err = p.communicate(timeout=120)
            return p.returncode, cg.oom_kills(), out, err

    rc, kills, out, err = run(8 * MiB, str(tmp_path / "g"))
    assert rc == 0 and kills == 0, (rc, kills, err[-2000:])
    res = json.loads(out.strip().splitlines()[-1])
    assert res["bad"] == [], res
    assert res["g1_written"] < 24, res                  # admission held some back
    assert res["g1_end"] < res["g1_written"], res       # the guard shed some
    assert any(m.startswith("demote:guard") for m in res["moves"]), res
    # the control: without the guard the same job is OOM-killed (the scenario
    # really needs it)
    rc, kills, out, err = run(0, str(tmp_path / "g0"))
    assert kills >= 1 and rc != 0, (rc, kills, out, err[-500:])


class _Rooms:
    """A RoomReader whose room the test sets (cap 100 MiB)."""

    def __init__(self):
        self.cap = 100 * MiB
        self.now = 50 * MiB
        self.looks = 0

    def refresh(self):
        pass

    def room(self):
        self.looks += 1
        return self.now


def test_guard_ignores_one_low_look_but_not_two_or_a_deep_one(tmp_path):
    """The guard acts on the second low look in a row (one may be a passing
    temporary of the job), at once when the room is under half the guard, and
    the cheap room reader (usage files only) is what it and admission read."""
    import time
    rng = np.random.default_rng(8)
    st = KVStore(str(tmp_path / "g"), group1="memory", budget=1 << 40, guard=8 * MiB,
                 guard_interval=0.02)
    rooms = _Rooms()
    st._rooms = rooms
    _, ref = _fill(st, 4, rng)
    assert st._guard_thread is not None and not st.moves

    def wait_looks(n):
        end = rooms.looks + n
        t0 = time.monotonic()
        while rooms.looks < end and time.monotonic() - t0 < 5:
            time.sleep(0.005)

    # one low look, then room again: nothing moves
    rooms.now = 7 * MiB
    wait_looks(1)
    rooms.now = 50 * MiB
    wait_looks(3)
    assert not st.moves, st.moves
    # low twice in a row: the last layer goes
    rooms.now = 7 * MiB
    wait_looks(3)
    rooms.now = 50 * MiB
    wait_looks(2)
    assert [m[1] for m in st.moves if m[0] == "demote"][:1] == [3], st.moves
    assert st.rebalance()["promoted"]              # room again: back to Group 1
    n = len(st.moves)
    # under half the guard: at the first look
    rooms.now = 3 * MiB
    wait_looks(1)
    rooms.now = 50 * MiB
    wait_looks(2)
    assert len(st.moves) > n, st.moves
    _check(st, ref)
    st.destroy()


def test_room_reader_matches_the_cgroup_reader():
    """RoomReader (limit files once, usage files per look) gives the cgroup
    reader's room, within what the process charged in between."""
    from phx.kv import budget as B
    r = B.RoomReader()
    a, b = r.room(), B.cgroup_room()
    if b is None:
        assert a is None
    else:
        assert a is not None and abs(a - b) < 4 * MiB, (a, b)
