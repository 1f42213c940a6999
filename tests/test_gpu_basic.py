"""phx.gpu on any machine: it imports, says whether it can work, and why."""
from __future__ import annotations

import platform

import numpy as np
import pytest

import phx
import phx.gpu


def test_is_available_says_why():
    ok, why = phx.gpu.is_available()
    assert isinstance(ok, bool) and isinstance(why, str) and why
    if not ok:
        with pytest.raises(RuntimeError, match="unavailable"):
            phx.gpu.context()


def test_host_buffers_are_not_device_buffers():
    assert not phx.gpu.is_device_buffer(bytearray(8))
    assert not phx.gpu.is_device_buffer(np.zeros(4))


def test_info_reports_cuda():
    info = phx.info()
    assert "cuda" in info and isinstance(info["cuda"]["reason"], str)


def test_tune_cache_is_keyed_by_gpu_kernel_and_device(tmp_path, monkeypatch):
    """The tuned choice applies only to the GPU and kernel it was measured on,
    takes the largest setting over tuned filesystems, and is explained."""
    from phx import tune
    monkeypatch.setenv("PHX_CACHE_DIR", str(tmp_path))
    for v in ("PHX_CUDA_LANES", "PHX_CUDA_BUFS", "PHX_CUDA_BUF_SIZE", "PHX_CUDA_MAX_IO"):
        monkeypatch.delenv(v, raising=False)
    assert tune.defaults_for(0) == {}
    key = tune.key_for(str(tmp_path), 0)
    assert platform.release() in key and tune.block_device(str(tmp_path)) in key
    mk = lambda ln, b, s: {"lanes": ln, "bufs_per_lane": b, "buf_size": s,  # noqa: E731
                           "max_io_size": 1 << 20}
    tune._save({"version": 1, "entries": {
        key: {"choice": mk(8, 4, 2 << 20), "reason": "r1", "block_device": "a"},
        key + "-other-fs": {"choice": mk(4, 8, 1 << 20), "reason": "r2", "block_device": "b"},
        "other GPU|driver x|kernel 1.0|8:0 sda": {"choice": mk(64, 64, 64 << 20),
                                                  "reason": "no", "block_device": "c"},
    }})
    assert tune.defaults_for(0) == mk(8, 8, 2 << 20)
    ex = tune.explain(0)
    assert ex["config"]["lanes"] == 8 and ex["config"]["bufs_per_lane"] == 8
    assert "phx tune" in ex["source"] and "r1" in ex["why"] and "r2" in ex["why"]
    assert ex["config"]["pinned_bytes"] == 8 * 8 * (2 << 20)
    monkeypatch.setenv("PHX_CUDA_LANES", "3")
    assert "PHX_CUDA_LANES" in tune.explain(0)["source"]
    # a kernel change invalidates it
    monkeypatch.setattr(platform, "release", lambda: "0.0-other")
    assert tune.defaults_for(0) == {}
