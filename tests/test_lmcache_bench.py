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
    assert r.returncode == 0
    assert "not run:" in r.stdout
