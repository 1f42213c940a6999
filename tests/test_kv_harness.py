"""The honest harness of issue 26, part 5 (``phx bench kv``): warm-up before every
configuration, rotated cap and configuration order, the fio-measured device
bandwidth in the one ideal, ``stock-mixed`` (FlexLLMGen's CPU + disk split at the
cap), one CachePolicy-only definition, KV digests identical across
configurations, and the negative control (one corrupted KV read changes them).

~6 s here (the worker replays run in-process on tiny shapes; no cgroup)."""
from __future__ import annotations

import argparse
import pathlib

import numpy as np
import pytest

from phx.bench import kv as bench
from phx.bench import _kv_worker as worker
from phx.kv.planner import cachepolicy_split, place_layers

TINY = {"layers": 3, "batch": 1, "hidden": 512, "heads": 4, "prompt": 24, "gen": 6,
        "threads": 2}


@pytest.fixture
def tmp_path(data_dir):
    return pathlib.Path(data_dir)


def test_every_configuration_reads_back_the_same_kv(tmp_path):
    """One seed, every configuration: the bytes verify against what was written,
    and the digests of every tensor after prefill and at the end are identical."""
    seen = set()
    for cfg in bench.CONFIGS + bench.EXTRA_CONFIGS:
        res = worker.run_worker({**TINY, "config": cfg, "dir": str(tmp_path / cfg)})
        assert res["verified"] is True, (cfg, res["verify"])
        seen.add((res["prefill_digest"], res["kv_digest"]))
        assert res["decode_step_max_s"] >= res["decode_step_median_s"]
    assert len(seen) == 1, seen


def test_negative_control_changes_the_digests(tmp_path):
    """A deliberately corrupted KV read (one byte of tensor 1 flipped on its way
    out) fails verification and changes both digests; another seed changes them
    too (the digests depend on the data)."""
    good = worker.run_worker({**TINY, "config": "dual-mem", "dir": str(tmp_path / "a")})
    bad = worker.run_worker({**TINY, "config": "dual-mem", "corrupt_read": 1,
                             "dir": str(tmp_path / "b")})
    assert good["verified"] is True and bad["verified"] is False
    assert bad["verify"]["mismatched"] == [1]
    assert bad["kv_digest"] != good["kv_digest"]
    assert bad["prefill_digest"] != good["prefill_digest"]
    other = worker.run_worker({**TINY, "config": "baseline", "seed": 7,
                               "dir": str(tmp_path / "c")})
    assert other["kv_digest"] != good["kv_digest"]
    # and the bench's check names the seed whose runs disagree
    raw = [{**good, "repeat": 0}, {**bad, "repeat": 0}, {**other, "repeat": 1}]
    d = bench.check_digests(raw)
    assert not d["identical"] and d["seeds_with_several_digests"] == {0: 2}
    assert bench.check_digests(raw[:1] + raw[2:])["identical"]


def test_warmup_runs_before_the_measured_replay(tmp_path, monkeypatch):
    """Every measured configuration first replays a 2-layer, 2-step warm-up in its
    own directory; the warm-up itself does not warm up again."""
    calls = []
    real = worker.run_worker

    def spy(c):
        calls.append((c["config"], c["layers"], c["gen"], c.get("warmup", True)))
        return real(c)
    monkeypatch.setattr(worker, "run_worker", spy)
    res = spy({**TINY, "config": "baseline", "dir": str(tmp_path / "w")})
    assert res["verified"] is True
    assert calls == [("baseline", 3, 6, True), ("baseline", 2, 3, False)], calls
    assert not (tmp_path / "w" / "warm").exists()


def test_stock_mixed_splits_like_flexllmgen(tmp_path):
    """FlexLLMGen's TorchMixedDevice: int(cols x percent / 100) // num_head x
    num_head columns of axis 1 on the CPU (whole batch elements), the rest on
    disk; rows read back across both segments."""
    s = worker.Shape({**TINY, "batch": 4})              # 16 columns, 4 heads each
    (tmp_path / "m").mkdir()
    (tmp_path / "n").mkdir()
    io = worker.MixedIO(s, str(tmp_path / "m"), 60.0)
    assert io.ncpu == 8                                  # int(9.6) // 4 * 4
    assert worker.MixedIO(s, str(tmp_path / "n"), 10.0).ncpu == 0
    rng = np.random.default_rng(3)
    data = rng.integers(0, 255, s.tensor_bytes, dtype=np.uint8)
    io.write(0, 0, data[:s.prompt * s.row_bytes])
    io.write_row(0, s.prompt, data[s.prompt * s.row_bytes:(s.prompt + 1) * s.row_bytes])
    relay = np.zeros(s.tensor_bytes, np.uint8)
    nb = io.read(0, 0, s.prompt + 1, relay)
    assert bytes(relay[:nb]) == bytes(data[:nb])
    nb = io.read(0, 3, 9, relay)
    assert bytes(relay[:nb]) == bytes(data[3 * s.row_bytes:9 * s.row_bytes])
    assert io.plan()["cpu_bytes"] == s.ntensors * s.rows * 8 * s.head_dim * 2
    io.close()


def test_one_cachepolicy_definition():
    """The bench worker and the FlexLLMGen adapter use phx.kv.planner's split:
    Algorithm 1 over the budget less one tensor + readahead per copy thread."""
    pair = [2 * 4096 * 10] * 8
    n = cachepolicy_split(pair, 10 * 81920, 40000, 2, 128 << 10)
    assert n == place_layers(pair, 10 * 81920 - 2 * (40960 + (128 << 10))).n1 == 5
    import inspect
    assert "cachepolicy_split(" in inspect.getsource(worker.run_worker)


def test_bench_rotates_caps_and_configurations_and_runs_the_control(tmp_path, monkeypatch):
    """5 repeats by default; each repeat starts at another cap and another
    configuration; the ideal uses fio's bandwidth; the negative control runs
    once and must be detected; an OOM kill fails a row."""
    p = argparse.ArgumentParser()
    bench.add_arguments(p)
    args = p.parse_args(["--caps", "0.2,0.5,0.8", "--methods", "baseline,dual-mem",
                         "--dir", str(tmp_path / "kv"), "--quiet", "--no-dma"])
    assert args.repeat == 5
    order = []

    def fake(conf, limit, timeout, keep=False):
        if conf["config"] == "probe":
            return {"usage": 10 << 20}
        if conf["config"] == "calibrate":
            return {"dev_read_gbps": 0.5, "pagecache_read_gbps": 10.0}
        order.append((conf["config"], limit, conf.get("corrupt_read")))
        bad = conf.get("corrupt_read") is not None
        return {"config": conf["config"], "prefill_s": 1.0, "decode_s": 2.0,
                "decode_step_s": [0.5, 0.5, 1.0], "hit_rate": 0.5,
                "decode_device_read_bytes": 0, "verified": not bad,
                "kv_digest": "x" if bad else f"k{conf['seed']}",
                "prefill_digest": "y" if bad else f"p{conf['seed']}",
                "plan": {"layers_pagecache": []}, "peak_usage": 1}
    monkeypatch.setattr(bench, "_run_in_cgroup", fake)
    monkeypatch.setattr("phx.bench._kv_cgroup.can_create", lambda: (True, ""))
    monkeypatch.setattr(bench._common, "drop_caches", lambda: True)
    monkeypatch.setattr(bench, "fio_read_gbps", lambda root: {"gbps": 2.0, "qd": 8})
    assert bench.run(args) == 0
    runs = [o for o in order if o[2] is None]
    assert len(runs) == 5 * 3 * 2 and order[-1][2] == 1       # the control, last
    firsts = [runs[i * 6] for i in range(5)]
    caps = sorted({o[1] for o in runs})
    assert [f[1] for f in firsts] == [caps[0], caps[1], caps[2], caps[0], caps[1]]
    assert [f[0] for f in firsts] == ["baseline", "dual-mem"] * 2 + ["baseline"]
    # the ideal: fio's 2 GB/s, not the calibration's 0.5
    shape = worker.Shape({**bench.model_shape(args), "batch": 1, "prompt": 512, "gen": 32})
    ideal = bench.ideal_decode_s(shape, 0.2 * shape.working_set, 10e9, 2e9)
    import json
    assert bench._failure({"oom_kills": 1, "verified": True}) is not None
    # a control that is not detected fails the bench
    monkeypatch.setattr(bench, "fio_read_gbps", lambda root: {"gbps": 2.0, "qd": 8})

    def blind(conf, limit, timeout, keep=False):
        r = fake(conf, limit, timeout, keep)
        if conf.get("corrupt_read") is not None:
            r.update(kv_digest=f"k{conf['seed']}", prefill_digest=f"p{conf['seed']}")
        return r
    monkeypatch.setattr(bench, "_run_in_cgroup", blind)
    args.json = str(tmp_path / "out.json")
    assert bench.run(args) == 1
    doc = json.loads(pathlib.Path(args.json).read_text())
    assert doc["negative_control"]["detected"] is False
    assert doc["calibration"]["ideal_dev_source"] == "fio"
    assert abs(doc["rows"][0]["ideal_decode_s"] - ideal) < 1e-9


def test_dual_mem_ra_reads_group2_ahead_and_verifies(tmp_path):
    """dual-mem-ra with every layer in Group 2 (a reserve larger than any
    machine): the decode's reads come from the read-ahead, every byte verifies
    and the digests are direct's."""
    conf = {**TINY, "reserve": 1 << 50}
    ra = worker.run_worker({**conf, "config": "dual-mem-ra", "dir": str(tmp_path / "ra")})
    ref = worker.run_worker({**conf, "config": "direct", "dir": str(tmp_path / "d")})
    assert ra["verified"] is True, ra["verify"]
    assert ra["plan"]["layers_pagecache"] == []
    r = ra["plan"]["readahead"]
    # the first layer of each step is never read ahead; the rest are
    steps = TINY["gen"] - 1
    assert r["served"] >= steps * 2 * (TINY["layers"] - 1) and r["failed"] == 0, r
    assert (ra["prefill_digest"], ra["kv_digest"]) == (ref["prefill_digest"], ref["kv_digest"])
