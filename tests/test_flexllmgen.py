"""adapters/flexllmgen: PhxDisk (FlexLLMGen's TorchDisk on phx.kv) and the four-way runner.

On this CPU box: flexgen 0.1.8 imports, and PhxDisk is driven through FlexLLMGen's
own ``general_copy`` with CPU tensors, the way ``flex_opt.py``'s store_cache /
load_cache use it (prefill rows, one row per decode step, reads of rows
[0:prompt+i], a part of each row), in all three modes, against a model of the
bytes.  The runner's arithmetic, its token-id check, table and plot are tested on
made-up results.  Running FlexLLMGen itself needs CUDA: tools/flex_gpu_run.sh on
the H200 (tests skip here with 'no usable GPU').
"""
from __future__ import annotations

import importlib
import os
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ADAPTER = os.path.join(ROOT, "adapters", "flexllmgen")
sys.path.insert(0, ADAPTER)


def _flexgen():
    pytest.importorskip("torch")
    try:
        return importlib.import_module("flexgen.pytorch_backend")
    except ImportError as e:
        pytest.skip(f"flexgen 0.1.8 is not installed (make venv installs it): {e}")


@pytest.fixture
def kvdir(data_dir):
    return data_dir


class _Cfg:
    n_head, input_dim = 8, 128


class _Task:
    prompt_len, gen_len = 40, 6


class _Pol:
    gpu_batch_size = 2


def test_flexgen_imports_and_phxdisk_is_a_disk():
    pb = _flexgen()
    import flexgen.flex_opt as fo
    assert fo.TorchDisk is pb.TorchDisk
    from phx_disk import PhxDisk
    for name in ("allocate", "delete", "init_cache_one_gpu_batch", "submit_copy",
                 "synchronize", "close_copy_threads", "add_link"):
        assert callable(getattr(PhxDisk, name)), name


@pytest.mark.parametrize("dev", ["cpu", "cuda"])
@pytest.mark.parametrize("mode", ["dual", "dual+no-write-behind", "direct", "cachepolicy",
                                  "dual-mem"])
def test_phxdisk_through_general_copy(kvdir, mode, dev):
    """FlexLLMGen's KV traffic through its general_copy onto PhxDisk (CPU tensors
    here; CUDA tensors through the Co-DMA relays on a GPU): every read returns the
    bytes written; dual splits the layers by the budget, CachePolicy-only evicts
    past it, direct keeps nothing in the page cache."""
    pb = _flexgen()
    import torch
    if dev == "cuda" and not torch.cuda.is_available():
        pytest.skip("no usable GPU")
    from phx_disk import PhxDisk
    host = pb.TorchDevice("cpu")
    cpu = host if dev == "cpu" else pb.TorchDevice("cuda:0")
    tb = 45 * 16 * 16 * 2                       # (prompt+gen-1, B*heads, head_dim) fp16
    budget = 3 * 2 * 24576 if mode != "direct" else None    # 3 layers of 6
    mode, _, nowb = mode.partition("+")
    d = PhxDisk(os.path.join(kvdir, mode), mode=mode, budget=budget, num_copy_threads=4,
                relay_bytes=tb if dev == "cuda" else None,
                write_behind=False if nowb else None)
    # write-behind: Dual-Blade's default under a cgroup v2 limit, never CachePolicy-only's
    from phx.kv.store import write_behind_default
    assert d.store.write_behind is (mode == "dual" and not nowb and write_behind_default())
    caches = [d.init_cache_one_gpu_batch(_Cfg, _Task, _Pol) for _ in range(6)]
    assert caches[0][0].shape == (45, 16, 16) and caches[0][0].data.nbytes == tb
    g = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    model = {}
    for k, v in caches:                          # prefill: store_cache(i=0)
        for t in (k, v):
            x = torch.randn(40, 16, 16, generator=g).half()
            pb.general_copy(t, (slice(0, 40), slice(0, 16)),
                            pb.TorchTensor.create_from_torch(x.to(dev), cpu), None)
            model[t.name] = torch.zeros(45, 16, 16).half()
            model[t.name][:40] = x
    d.synchronize()
    for i in range(1, 6):                        # decode: load_cache then store_cache
        for k, v in caches:
            for t in (k, v):
                ret = cpu.allocate((40 + i, 16, 16), np.float16, pin_memory=False)
                pb.general_copy(ret, None, t, (slice(0, 40 + i), slice(0, 16)))
                d.synchronize()
                assert torch.equal(ret.data.cpu(), model[t.name][:40 + i]), (mode, i, t.name)
                x = torch.randn(1, 16, 16, generator=g).half()
                pb.general_copy(t, (slice(39 + i, 40 + i), slice(0, 16)),
                                pb.TorchTensor.create_from_torch(x.to(dev), cpu), None)
                model[t.name][39 + i:40 + i] = x
        d.synchronize()
    # a part of each row (FlexLLMGen's mixed-device path cuts the head axis)
    k = caches[2][0]
    part = torch.randn(4, 5, 16, generator=g).half()
    pb.general_copy(k, (slice(10, 14), slice(3, 8)),
                    pb.TorchTensor.create_from_torch(part.to(dev), cpu), None)
    model[k.name][10:14, 3:8] = part
    d.synchronize()
    sub = cpu.allocate((4, 5, 16), np.float16, pin_memory=False)
    pb.general_copy(sub, None, k, (slice(10, 14), slice(3, 8)))
    d.synchronize()
    assert torch.equal(sub.data.cpu(), model[k.name][10:14, 3:8])
    st = d.stats()
    if mode in ("dual", "dual-mem"):
        assert st["plan"]["layers_pagecache"] == [0, 1, 2], st
    elif mode == "direct":
        assert st["plan"]["layers_pagecache"] == []
    else:
        assert st["evict_from_layer"] is not None and st["evict_from_layer"] <= 3, st
        # fadvise(DONTNEED) drops clean pages only: once written back, the next write
        # to an evicted tensor leaves at most the pages it just dirtied
        from phx.kv import _sys
        if _sys.cachestat_available():
            os.sync()
            row = pb.TorchTensor.create_from_torch(model[k.name][44:45].clone().to(dev), cpu)
            evicted = [t for kv in caches for t in kv
                       if t.data.layer >= st["evict_from_layer"]]
            for t in evicted:
                pb.general_copy(t, (slice(44, 45), slice(0, 16)), row, None)
                model[t.name][44:45] = row.data.cpu()
            d.synchronize()
            # (pages still in another CPU's LRU batch can survive one DONTNEED:
            # counted over all evicted tensors, not one by one)
            counts = [d.store.cached_pages(t.data) for t in evicted]
            hits, pages = sum(h for h, _ in counts), sum(p for _, p in counts)
            assert pages == 6 * len(evicted) and hits <= pages // 2, counts
    for k, v in caches:
        k.delete()
        v.delete()
    assert d.store.tensors() == []
    d.close()


def _prefill_and_decode(d, pb, seed, steps=3):
    """FlexLLMGen's traffic on a PhxDisk (CPU tensors): 4 layers, prefill of 40
    rows, ``steps`` decode steps; returns (caches, the reference bytes, whether each
    load returned the bytes written)."""
    import torch
    cpu = pb.TorchDevice("cpu")
    caches = [d.init_cache_one_gpu_batch(_Cfg, _Task, _Pol) for _ in range(4)]
    g = torch.Generator().manual_seed(seed)
    model = {}
    for k, v in caches:
        for t in (k, v):
            x = torch.randn(40, 16, 16, generator=g).half()
            pb.general_copy(t, (slice(0, 40), slice(0, 16)),
                            pb.TorchTensor.create_from_torch(x, cpu), None)
            model[t.name] = torch.zeros(45, 16, 16).half()
            model[t.name][:40] = x
    d.synchronize()
    loads = []
    for i in range(1, steps + 1):
        for k, v in caches:
            for t in (k, v):
                ret = cpu.allocate((40 + i, 16, 16), np.float16, pin_memory=False)
                pb.general_copy(ret, None, t, (slice(0, 40 + i), slice(0, 16)))
                d.synchronize()
                loads.append(bool(torch.equal(ret.data, model[t.name][:40 + i])))
                x = torch.randn(1, 16, 16, generator=g).half()
                pb.general_copy(t, (slice(39 + i, 40 + i), slice(0, 16)),
                                pb.TorchTensor.create_from_torch(x, cpu), None)
                model[t.name][39 + i:40 + i] = x
        d.synchronize()
    return caches, model, loads


def test_phxdisk_kv_digest_and_negative_control(kvdir):
    """kv_digest(): SHA-256 over every KV tensor's prefill rows as the store gives
    them back, in allocation order -- the same for every mode on the same data and
    equal to the digest of the reference bytes; corrupt_read=True (the negative
    control) changes both the loads and the digest."""
    pb = _flexgen()
    import hashlib
    from phx_disk import PhxDisk
    digests = {}
    for mode in ("dual", "dual-mem", "direct", "cachepolicy", "dual-mem+corrupt",
                 "dual-mem+readahead", "direct+readahead"):
        m, _, extra = mode.partition("+")
        corrupt = extra == "corrupt"
        d = PhxDisk(os.path.join(kvdir, mode), mode=m, budget=2 * 2 * 24576,
                    num_copy_threads=2, corrupt_read=corrupt,
                    readahead=3 if extra == "readahead" else 0)
        caches, model, loads = _prefill_and_decode(d, pb, seed=11)
        assert all(loads) is (not corrupt), mode
        if extra == "readahead":
            # Group 2 loads came from the read-ahead, and every load was exact
            ra = d.stats()["readahead"]
            assert ra["served"] > 0 and ra["failed"] == 0, ra
        for k, v in caches:
            k.delete()
            v.delete()
        digests[mode] = d.kv_digest()
        ref = hashlib.sha256()
        for t in [t for kv in caches for t in kv]:
            ref.update(hashlib.sha256(model[t.name][:40].numpy().tobytes()).hexdigest().encode())
        if not corrupt:
            assert digests[mode] == ref.hexdigest(), mode
        d.close()
    assert len({digests[m] for m in ("dual", "dual-mem", "direct", "cachepolicy",
                                     "dual-mem+readahead", "direct+readahead")}) == 1
    assert digests["dual-mem+corrupt"] != digests["dual"]


def test_phxdisk_dual_mem_rebalances_at_a_step_boundary(kvdir):
    """dual-mem re-plans at the first synchronisation of each decode step: when
    the budget grows, Group 2 layers are promoted to Group 1 (memory) there, and
    every load still returns the bytes written."""
    pb = _flexgen()
    from phx_disk import PhxDisk
    d = PhxDisk(os.path.join(kvdir, "rb"), mode="dual-mem", budget=1 * 2 * 24576,
                num_copy_threads=2)
    caches, model, loads = _prefill_and_decode(d, pb, seed=5, steps=1)
    assert d.stats()["plan"]["layers_pagecache"] == [0]
    d.store.budget_override = 3 * 2 * 24576
    caches2 = caches
    import torch
    cpu = pb.TorchDevice("cpu")
    for i in (2, 3):
        for k, v in caches2:
            for t in (k, v):
                ret = cpu.allocate((40 + i - 1, 16, 16), np.float16, pin_memory=False)
                pb.general_copy(ret, None, t, (slice(0, 40 + i - 1), slice(0, 16)))
                d.synchronize()
                assert torch.equal(ret.data, model[t.name][:40 + i - 1]), (i, t.name)
    st = d.stats()
    assert st["plan"]["layers_pagecache"] == [0, 1, 2], st
    assert [r["promoted"] for r in st["rebalances"]] == [[1, 2]], st["rebalances"]
    for k, v in caches:
        k.delete()
        v.delete()
    d.close()


def test_phxdisk_copy_errors_reach_synchronize(kvdir):
    """A failing copy (rows outside the tensor) surfaces at synchronize(), where
    FlexLLMGen waits, instead of dying in a copy thread."""
    pb = _flexgen()
    from phx_disk import PhxDisk
    cpu = pb.TorchDevice("cpu")
    d = PhxDisk(os.path.join(kvdir, "e"), mode="direct")
    k, v = d.init_cache_one_gpu_batch(_Cfg, _Task, _Pol)
    ret = cpu.allocate((50, 16, 16), np.float16, pin_memory=False)
    pb.general_copy(ret, None, k, (slice(0, 50), slice(0, 16)))
    with pytest.raises(IndexError):
        d.synchronize()
    d.close()


def test_phxdisk_overlap_probe_locks_a_strategy():
    """The adaptive pipeline over FlexLLMGen's copy threads: step 1 unmeasured,
    step 2 Intra, step 3 Cross (timed), then the faster is locked."""
    pytest.importorskip("torch")
    _flexgen()
    import time
    from phx_disk import CROSS, INTRA, _Overlap
    ov = _Overlap()
    seen = []
    for step in range(1, 6):
        for j in range(4):
            ov.begin_read(j == 0)
            seen.append(ov.strategy)
            time.sleep(0.004 if ov.strategy == INTRA else 0.001)
            ov.end_read(1 << 20)
    assert seen[:4] == [INTRA] * 4 and seen[4:8] == [INTRA] * 4 and seen[8:12] == [CROSS] * 4
    assert ov.locked == CROSS and seen[12:] == [CROSS] * 8
    assert ov.measured[CROSS]["gbps"] > ov.measured[INTRA]["gbps"]


# -- the runner's arithmetic and report ---------------------------------------------
def _conf():
    return {"model": "facebook/opt-6.7b", "layers": 32, "hidden": 4096, "heads": 32,
            "batch": 4, "prompt": 512, "gen": 8, "caps": [0.5, 1.2],
            "configs": ["stock", "cachepolicy", "direct", "dual"]}


def test_runner_workload_arithmetic():
    import run_four as rf
    c = _conf()
    assert rf.kv_shape(c) == (519, 128, 128)
    assert rf.tensor_bytes(c) == 519 * 128 * 128 * 2
    assert rf.working_set(c) == 64 * rf.tensor_bytes(c)
    reads = rf.decode_read_bytes(c)
    assert len(reads) == 7 and reads[0] == 64 * 513 * 4 * 4096 * 2
    # all cached and compute-bound / nothing cached and I/O-bound
    assert rf.ideal_decode_s(c, 1.0, 1.0, 1e12, 1e9) == pytest.approx(7.0)
    assert rf.ideal_decode_s(c, 0.0, 0.0, 1e12, 1e9) == pytest.approx(sum(reads) / 1e9)


def _runs(cfg, ids, t, hit=0.5, error=None):
    return {"config": cfg, "pinned_bytes": 4 << 20, "runs": [
        {"cap_fraction": f, "cap_bytes": int(f * 100), "prefill_s": t, "decode_s": 2 * t,
         "hit_rate": hit, "device_read_bytes": 10, "device_write_bytes": 5, "peak_bytes": 1,
         "output_ids": ids, "error": error, "phx": {"plan": {"layers_pagecache": [0, 1]},
                                                     "pipeline": {"choice": "overlap-cross"}}}
        for f in (0.5, 1.2)]}


def test_runner_checks_token_ids_and_reports(tmp_path):
    import run_four as rf
    c = _conf()
    ids = [[1, 2, 3]]
    cal = _runs("dual", ids, 1.0)
    cal["calibration"] = {"pagecache_read_gbps": 10.0, "dev_read_gbps": 1.0}
    cal["compute"] = {"decode_step_s": 0.01}
    res = [_runs("stock", ids, 2.0), _runs("cachepolicy", ids, 1.5),
           _runs("direct", ids, 1.2), cal]
    agg = rf.aggregate(res, c)
    assert agg["ids_identical"] and not agg["checks"]
    dual = [r for r in agg["rows"] if r["config"] == "dual"]
    assert dual[0]["decode_vs_stock"] == pytest.approx(0.5)
    assert dual[0]["ideal_decode_s"] == pytest.approx(rf.ideal_decode_s(c, 0.5, 0.01, 1e10, 1e9))
    assert dual[0]["n1"] == [2] and dual[0]["pipeline"] == ["overlap-cross"]
    # one configuration's tokens differ: the run fails the check and leaves the figures
    res[2] = _runs("direct", [[1, 2, 4]], 1.2)
    agg = rf.aggregate(res, c)
    assert not agg["ids_identical"]
    assert {x["config"] for x in agg["checks"]} == {"direct"}
    d = [r for r in agg["rows"] if r["config"] == "direct"]
    assert d[0]["runs"] == 0 and d[0]["decode_s"] is None
    assert "differ" in rf.table(agg["rows"])
    png = tmp_path / "f.png"
    rf.plot(agg["rows"], str(png), c)
    assert png.stat().st_size > 1000


def test_runner_dual_write_behind_row_and_bad_configs(tmp_path, capsys):
    """dual-nowb (Dual-Blade without write-behind) is a row of its own beside dual, with its
    ratio to stock; an unknown configuration is refused before anything runs."""
    import run_four as rf
    c = {**_conf(), "configs": ["stock", "dual", "dual-nowb"]}
    ids = [[1, 2, 3]]
    agg = rf.aggregate([_runs("stock", ids, 2.0), _runs("dual", ids, 1.0),
                        _runs("dual-nowb", ids, 0.8)], c)
    wb = [r for r in agg["rows"] if r["config"] == "dual-nowb"]
    assert len(wb) == 2 and wb[0]["decode_vs_stock"] == pytest.approx(0.4)
    assert wb[0]["n1"] == [2]
    assert "dual-nowb" in rf.table(agg["rows"])
    rf.plot(agg["rows"], str(tmp_path / "wb.png"), c)
    assert rf.main(["--configs", "stock,dual,bogus", "--dir", str(tmp_path)]) == 2
    assert "unknown configuration(s) bogus" in capsys.readouterr().err


def test_runner_on_a_real_gpu(tmp_path):
    """The whole runner, tiny: OPT-125M, 2 caps.  Needs CUDA and root."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no usable GPU")
    _flexgen()
    if os.geteuid() != 0:
        pytest.skip("memory cgroups need root")
    import json
    import subprocess
    js = tmp_path / "r.json"
    r = subprocess.run([sys.executable, os.path.join(ADAPTER, "run_four.py"), "--model",
                        "facebook/opt-125m", "--batch", "2", "--prompt", "64", "--gen", "4",
                        "--caps", "0.5,1.2", "--dir", str(tmp_path / "d"), "--json", str(js)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    doc = json.loads(js.read_text())
    assert doc["ids_identical"] and len(doc["rows"]) == 8


def test_runner_moves_itself_into_the_cap_and_back(kvdir):
    """run_capped: the whole process runs fn inside a fresh cgroup of the cap (its
    page cache held to the cap), then is back in its base cgroup; the cap cgroup is
    gone.  (Root and a memory cgroup controller; no GPU needed.)"""
    if os.geteuid() != 0:
        pytest.skip("memory cgroups need root")
    from phx.bench._kv_cgroup import MemCgroup, can_create
    ok, why = can_create()
    if not ok:
        pytest.skip(why)
    import json
    import subprocess
    import textwrap
    code = textwrap.dedent(r"""
        import json, os, sys, threading
        sys.path.insert(0, sys.argv[1])
        import run_four as rf
        path, base = sys.argv[2], sys.argv[3]
        def fn():
            # a helper thread must move with the process (cgroup.procs, not tasks)
            seen = {}
            t = threading.Thread(target=lambda: seen.update(
                c=open(f"/proc/self/task/{threading.get_native_id()}/cgroup").read()))
            t.start(); t.join()
            with open(path, "wb") as f:
                for _ in range(64):
                    f.write(os.urandom(1 << 20))      # 64 MiB of page cache
            return {"in": open("/proc/self/cgroup").read(), "thread": seen["c"]}
        val, info = rf.run_capped("phx-test-capped-%d" % os.getpid(), 24 << 20, base, fn)
        print(json.dumps({"val": val, "info": info, "after": open("/proc/self/cgroup").read()}))
    """)
    with MemCgroup(f"phx-test-capbase-{os.getpid()}", None) as base:
        p = base.popen([sys.executable, "-c", code, ADAPTER, os.path.join(kvdir, "f.bin"),
                        base.path], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
    doc = json.loads(out)
    assert "error" not in doc["info"], doc["info"]
    assert "phx-test-capped-" in doc["val"]["in"] and "phx-test-capped-" in doc["val"]["thread"]
    assert "phx-test-capped-" not in doc["after"] and "phx-test-capbase-" in doc["after"]
    assert doc["info"]["peak_bytes"] is None or doc["info"]["peak_bytes"] <= 24 << 20
    assert doc["info"]["oom_kills"] == 0 and doc["info"]["swap_limited"]


def test_runner_issue26_harness(tmp_path):
    """run_four's harness (issue 26, part 5): caps and configurations rotate per
    repeat (5 by default) with the negative control last; the ideal caches the
    cap's KV share (not a configuration's hit rate) and reads the rest at fio's
    bandwidth; stalls are counted; a run whose KV digest differs from stock's
    fails; the control is detected when its digest or tokens change."""
    import run_four as rf
    jobs = rf.plan_jobs(["stock", "dual", "dual-mem"], [0.2, 0.4, 0.6], 5, True)
    assert len(jobs) == 16 and jobs[-1] == (0, "dual-mem", [0.2], True)
    assert [j[2][0] for j in jobs[:15:3]] == [0.2, 0.4, 0.6, 0.2, 0.4]
    assert [j[1] for j in jobs[:15:3]] == ["stock", "dual", "dual-mem", "stock", "dual"]
    import argparse  # noqa: F401  (the default repeat is read from main's parser below)
    assert rf.stall_steps([1.0, 1.0, 3.0, 1.1]) == [2]
    assert rf.mixed_cpu_percent(0.4) == pytest.approx(40.0) and rf.mixed_cpu_percent(1.2) == 100
    c = {**_conf(), "configs": ["stock", "dual", "dual-mem"], "fio": {"gbps": 2.0}}
    ids = [[1, 2, 3]]
    cal = _runs("dual", ids, 1.0, hit=0.9)
    cal["calibration"] = {"pagecache_read_gbps": 10.0, "dev_read_gbps": 1.0}
    cal["compute"] = {"decode_step_s": 0.01}
    res = [_runs("stock", ids, 2.0), cal, _runs("dual-mem", ids, 0.9)]
    for r in res:
        for x in r["runs"]:
            x["kv_digest"] = "d"
            x["decode_step_s"] = [0.1, 0.1, 0.5]
            x["stall_steps"] = [2]
    ctl = _runs("dual-mem", ids, 0.9)
    for x in ctl["runs"]:
        x["kv_digest"] = "other"
    ctl["control"] = True
    agg = rf.aggregate(res + [ctl], c)
    assert agg["digests_identical"] and agg["ids_identical"] and not agg["checks"]
    assert agg["negative_control"]["detected"] and agg["negative_control"]["digest_changed"]
    row = [r for r in agg["rows"] if r["config"] == "dual-mem"][0]
    assert row["ideal_decode_s"] == pytest.approx(rf.ideal_decode_s(c, 0.5, 0.01, 1e10, 2e9))
    assert row["stall_steps"] == 1 and row["prefill_runs"] == [0.9]
    # a KV digest other than stock's fails the run; an undetected control fails too
    res[2]["runs"][0]["kv_digest"] = "x"
    for x in ctl["runs"]:
        x["kv_digest"] = "d"
    agg = rf.aggregate(res + [ctl], c)
    assert not agg["digests_identical"]
    assert [x["config"] for x in agg["checks"]] == ["dual-mem"]
    assert agg["negative_control"]["detected"] is False


def test_runner_mixed_device_digest_and_delete(kvdir):
    """stock-mixed's KV (FlexLLMGen's TorchMixedDevice, half the heads on the CPU,
    half on disk): deleting a tensor digests the prefill rows of the whole tensor
    (both segments joined) and then does what FlexLLMGen's delete does."""
    pb = _flexgen()
    import hashlib
    import run_four as rf
    import torch
    pb.fix_recursive_import()              # as flex_opt.py does
    dg = rf._Digests()
    Disk, Mixed = rf._digesting_devices(dg)
    cpu = pb.TorchDevice("cpu")
    disk = Disk.__new__(Disk)              # no copy threads (they need CUDA)
    disk.name, disk.path, disk.device_type = "d", os.path.join(kvdir, "mixed"), pb.DeviceType.DISK
    os.makedirs(disk.path)

    class Pol:
        gpu_batch_size, cache_gpu_percent, cache_cpu_percent, cache_disk_percent = 2, 0, 50, 50
    mixed = Mixed([cpu, cpu, disk])
    k, v = mixed.init_cache_one_gpu_batch(_Cfg, _Task, Pol)
    want = {}
    for t in (k, v):
        segs = t.data[0]
        assert segs[0] is None and segs[1].shape[1] == 8 and segs[2].shape[1] == 8
        full = torch.randn(t.shape).half()
        segs[1].data.copy_(full[:, :8])
        mm = np.load(segs[2].data, mmap_mode="r+")
        mm[:] = full[:, 8:].numpy()
        mm.flush()
        del mm
        want[t.name] = hashlib.sha256(full[:_Task.prompt_len].numpy().tobytes()).hexdigest()
    names = (k.name, v.name)
    k.delete()
    v.delete()
    assert k.device is None and v.data is None          # FlexLLMGen's own delete ran
    assert dg.by_index == {0: want[names[0]], 1: want[names[1]]}
    assert dg.digest() is not None
