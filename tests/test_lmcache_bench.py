"""``phx bench lmcache`` parts that run without a GPU: the synthetic agentic
trace has the published statistics, the FIFO queue model is right, and the
command says why it does not run here."""
from __future__ import annotations

import subprocess
import sys

from phx.bench._lmcache_replay import make_trace, simulate, trace_stats


def test_trace_matches_the_published_statistics():
    st = trace_stats(make_trace(200, 30, 1.0, 1))
    assert 70_000 <= st["context_at_round_30_mean"] <= 90_000, st     # ~80K by round 30
    assert 140_000 <= st["context_max"] <= 180_000, st                  # up to 180K
    assert 500 <= st["new_tokens_mean"] <= 5_000, st                    # hundreds to thousands
    assert 0.90 <= st["prefix_hit_rate"] <= 0.97, st                    # ~94 %


def test_token_scale_scales_every_count():
    full, small = make_trace(4, 30, 1.0, 7), make_trace(4, 30, 0.125, 7)
    for a, b in zip(full, small):
        assert len(a) == len(b)
        for ra, rb in zip(a, b):
            assert rb["prefix"] == int(ra["prefix"] * 0.125)


def test_fifo_queue_model():
    """One session alone: TTFT = service time.  Sessions whose work exceeds
    the GPU's time queue up: TTFT grows with concurrency."""
    svc = [[{"load_s": 0.5, "prefill_s": 0.1, "think_s": 3.0} for _ in range(10)]]
    assert all(abs(t - 0.6) < 1e-9 for t in simulate(svc, 1, 0))
    assert max(simulate(svc, 4, 0)) < 2.5          # 4 x 0.6 s < one think time
    many = sorted(simulate(svc, 32, 0))
    assert many[len(many) // 2] > 5.0              # 32 x 0.6 s >> 3.6 s per cycle
    assert len(many) == 32 * 10


def test_bench_without_a_gpu_says_why():
    import torch
    if torch.cuda.is_available():
        import pytest
        pytest.skip("a GPU is here: the bench would run")
    r = subprocess.run([sys.executable, "-m", "phx", "bench", "lmcache"], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 2                    # nothing measured: the machine does not allow it
    assert "not run:" in r.stderr and "Traceback" not in r.stderr


def test_prefill_runs_on_the_loaded_kv():
    """The replay's model takes the loaded chunks as its past KV, in LMCache's
    [2, layers, tokens, heads*dim] layout (a tiny model on the CPU)."""
    import pytest
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from phx.bench._lmcache_replay import TOKENS_PER_CHUNK, Prefill
    layers, n = 2, 3
    p = Prefill((2, layers, TOKENS_PER_CHUNK, 1024), device="cpu", hidden=1024,
                intermediate=512)
    cb = 2 * layers * TOKENS_PER_CHUNK * 1024 * 2
    kv = torch.empty(n * cb, dtype=torch.uint8)
    kv.view(torch.bfloat16)[:] = torch.randn(n * cb // 2).to(torch.bfloat16)
    torch.manual_seed(0)
    out = p(kv, n, 37)
    assert out.past_key_values.get_seq_length() == n * TOKENS_PER_CHUNK + 37
    x = kv.view(torch.bfloat16).view(n, 2, layers, TOKENS_PER_CHUNK, 8, 128)
    k1 = out.past_key_values.layers[1].keys[0, :, :n * TOKENS_PER_CHUNK]
    assert torch.equal(k1, x[:, 0, 1].reshape(-1, 8, 128).transpose(0, 1))
    kv2 = kv.clone()
    kv2.view(torch.bfloat16)[:] = torch.randn(n * cb // 2).to(torch.bfloat16)
    torch.manual_seed(0)
    assert not torch.equal(out.logits, p(kv2, n, 37).logits)   # the prefix matters


def test_report_and_plot_from_results(tmp_path, capsys):
    """The summary, the table, the replay summary and the plot from rows of
    the shape the GPU run produces (ratios are phx's load over each)."""
    from phx.bench import lmcache as bench
    from phx.bench._lmcache_replay import print_summary, simulate
    rows = []
    for rep in range(3):
        for m, gbps in (("phx", 20.0 + rep), ("kvikio", 8.0), ("host-odirect", 4.0)):
            rows.append({"device": "zram", "method": m, "repeat": rep, "store_gbps": 2.0,
                         "load_gbps": gbps, "store_cpu_s_per_gb": 0.1,
                         "load_cpu_s_per_gb": 0.2, "load_p50_ms": 3.0, "load_p99_ms": 5.0,
                         "byte_exact": True, "cache_dropped": True})
    summary = bench.summarise(rows)
    by = {s["method"]: s for s in summary}
    assert by["phx"]["load_gbps"] == 21.0 and by["phx"]["repeats"] == 3
    assert abs(by["kvikio"]["phx_load_x"] - 21.0 / 8.0) < 1e-9
    bench._print(summary)
    svc = [[{"load_s": 0.2, "prefill_s": 0.1, "think_s": 3.0, "chunks": 4}] * 5]
    ms = {"phx": {"load_s_mean": 0.2, "prefill_s_mean": 0.1, "alone_ttft_s": [0.3] * 5,
                  "by_concurrency": {c: {"p90_s": sorted(simulate(svc, c, 1))[-1]}
                                     for c in (1, 2, 4)},
                  "sessions_within_limit": 4, "checked_requests": 1, "bad_requests": 0}}
    rep = {"trace": {"sessions": 1, "requests": 5, "prefix_hit_rate": 0.9,
                     "context_at_round_30_mean": None, "context_max": 1000},
           "token_scale": 0.125, "ttft_limit_s": 5.0, "methods": ms}
    print_summary("zram", rep)
    out = capsys.readouterr().out
    assert "phx" in out and "2.62" in out and "sessions <= 5.0 s" in out
    bench._plot(summary, rep, str(tmp_path / "p.png"))
    assert (tmp_path / "p.png").stat().st_size > 1000
    bench._plot([], rep, str(tmp_path / "replay.png"))      # a replay alone: two panels
    import matplotlib.image
    h, w = matplotlib.image.imread(str(tmp_path / "replay.png")).shape[:2]
    assert w > 1.5 * h


def test_replay_charges_every_method_the_same_prefill():
    """The first method measured pays the model's warm-up; TTFTs must not."""
    from phx.bench._lmcache_replay import _common_prefill
    mk = lambda pre: {"service": [[{"load_s": 0.01, "prefill_s": p} for p in pre]]}
    rs = [mk([0.30, 0.20]), mk([0.03, 0.02]), mk([0.04, 0.03])]
    _common_prefill(rs)
    for r in rs:
        assert [q["prefill_s"] for q in r["service"][0]] == [0.04, 0.03]
    assert rs[0]["service"][0][0]["prefill_s_measured"] == 0.30


def test_chunk_rows_zram_holds_every_method_side_by_side():
    """4 methods x 32 chunks of 32 MiB are resident at once: a 4 GiB zram
    (what ran out of room on the H200) is grown to fit them."""
    import argparse
    from phx.bench.lmcache import _chunk_room
    a = argparse.Namespace(tokens=256, chunks=32, methods="phx,cufile,host-odirect,host-buffered")
    assert _chunk_room(a) >= 4 * 32 * (32 << 20)


def test_kvikio_methods_size_kvikios_thread_pool():
    """``kvikio`` / ``kvikio16`` / ``kvikio64``: the same KvikIO compat backend
    under LMCache's GDSContext, with KvikIO's process-wide pool at 1 / 16 / 64
    threads and compat mode on (a stand-in ``kvikio`` module records the
    settings: the real one needs CUDA)."""
    import os

    import pytest
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "adapters", "lmcache",
                                    "tests"))
    import support
    site = support.lmcache_site()
    if site is None:
        pytest.skip("lmcache not installed: " + support.INSTALL_HINT)
    code = r'''
import enum, json, sys, types
got = []
kv = types.ModuleType("kvikio")
class CompatMode(enum.Enum):
    ON = 1
kv.CompatMode = CompatMode
kd = types.ModuleType("kvikio.defaults")
kd.set = lambda d: got.append(d)
kv.defaults = kd
sys.modules["kvikio"], sys.modules["kvikio.defaults"] = kv, kd
from phx.bench._lmcache_methods import KVIKIO_METHODS, _KvikioBackend
out = {}
for name, n in KVIKIO_METHODS.items():
    be = _KvikioBackend(n)
    out[name] = [be.name, got[-1]["num_threads"], got[-1]["compat_mode"] is CompatMode.ON]
print(json.dumps(out))
'''
    r = support.run_py(code, [], support.child_env(site))
    assert r.returncode == 0, r.stderr[-3000:]
    import json
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out == {"kvikio": ["kvikio-compat-t1", 1, True],
                   "kvikio16": ["kvikio-compat-t16", 16, True],
                   "kvikio64": ["kvikio-compat-t64", 64, True]}


def test_kvikio_stands_in_for_cufile_only(monkeypatch):
    """Where LMCache's cufile backend cannot start, KvikIO compat stands in and
    the reason is recorded under ``{tag}-cufile``; any other method that
    cannot start is skipped with its reason; nothing stands in for it."""
    from phx.bench import _lmcache_methods as lm
    from phx.bench._lmcache_replay import open_replay_method
    up = {"phx", "kvikio"}
    monkeypatch.setattr(lm, "open_method", lambda name, *a: (
        (f"<{name}>", "") if name in up else (None, f"{name} refused")))
    notes: dict = {}
    assert open_replay_method("phx", "d", 1, None, [], notes, "live") == "<phx>"
    assert open_replay_method("cufile", "d", 1, None, [], notes, "live") == "<kvikio>"
    assert notes == {"live-cufile": "LMCache's cufile backend did not start (cufile refused): "
                                    "KvikIO compat"}
    assert open_replay_method("host-odirect", "d", 1, None, [], notes, "live") is None
    assert notes["live-host-odirect"] == "host-odirect refused"
    up.discard("kvikio")
    assert open_replay_method("cufile", "d", 1, None, [], notes, "live") is None
    assert notes["live-cufile"].endswith("; KvikIO compat did not start either: kvikio refused")
