"""``phx bench load`` on this box (CPU targets): the synthetic Llama-3-8B
checkpoint's shapes, every method runs and its tensors are checked against
the checkpoint's digests (and a flipped byte is caught), disk and zram rows,
the JSON document.  Its GPU rows run on the H200 (tools/loader_gpu_run.sh).
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

pytest.importorskip("torch")
pytest.importorskip("safetensors")

from phx.bench import load as bench  # noqa: E402

MiB = 1 << 20


def test_llama_shapes_scale_to_the_size():
    full = bench.llama_shapes(16 << 30)
    names = [n for n, _ in full]
    assert sum(".mlp.down_proj.weight" in n for n in names) == 32
    assert dict(full)["model.embed_tokens.weight"] == (128256, 4096)
    assert dict(full)["model.layers.0.self_attn.k_proj.weight"] == (1024, 4096)
    assert abs(sum(2 * math.prod(s) for _, s in full) - 16.06e9) < 0.01e9
    for size in (32 * MiB, 1 << 30, 8 << 30, 20 << 30):
        got = sum(2 * math.prod(s) for _, s in bench.llama_shapes(size))
        assert 0.7 * size < got < 1.3 * size, (size, got)


def test_gpu_only_methods_are_dropped_for_the_cpu():
    """st-cpu and phx-prepared equal st and phx when the target is the CPU."""
    ms = ",".join(bench.METHODS)
    assert bench._methods(ms, "cuda") == list(bench.METHODS)
    assert bench._methods(ms, "cpu") == [m for m in bench.METHODS
                                         if m not in ("st-cpu", "phx-prepared")]
    from phx.bench._common import BenchError
    with pytest.raises(BenchError, match="unknown methods"):
        bench._methods("phx,nope", "cuda")


def test_compare():
    ref = {"a": "1", "b": "2", "c": "3"}
    assert bench.compare(ref, dict(ref)) == "ok"
    out = bench.compare(ref, {"a": "1", "b": "x", "d": "4"})
    assert "1 missing (e.g. c)" in out and "1 extra (e.g. d)" in out and "1 wrong bytes (e.g. b)" in out


def _bench(args, timeout=600):
    return subprocess.run([sys.executable, "-m", "phx", "bench", "load", "--quiet", *args],
                          capture_output=True, text=True, timeout=timeout)


def test_bench_load_cpu_all_methods_disk_and_zram(data_dir):
    out = os.path.join(data_dir, "r.json")
    args = ["--size", "24m", "--dir", data_dir, "--repeat", "1", "--device", "cpu",
            "--json", out]
    if os.geteuid() == 0:
        args += ["--zram", "128m"]
    r = _bench(args)
    assert r.returncode == 0, r.stdout + r.stderr
    doc = json.load(open(out))
    assert doc["benchmark"] == "load" and doc["device"] == "cpu" and doc["shards"] == 4
    wheres = ["disk", "zram"] if os.geteuid() == 0 else ["disk"]
    for where in wheres:
        rows = {(x["method"], x["cache"]): x for x in doc["rows"] if x["where"] == where}
        cold = ["phx", "phx-iter", "st", "fst-nogds", "fst-phx", "raw (16t)"]
        assert sorted(rows) == sorted([(m, "cold") for m in cold]
                                      + [(m, "warm") for m in ("phx", "st", "fst-nogds")]), rows
        for m, x in rows.items():
            assert x["check"] in ("ok", "bytes only"), (where, m, x)
            assert x["bytes"] >= doc["checkpoint_bytes"] * 0.99
            assert x["gbps"] > 0 and x["cpu_s"] >= 0 and x["peak_rss"] > 0
            assert "gpu_extra" not in x            # no GPU here
        assert rows[("phx", "cold")]["check"] == "ok" and "vs_raw" in rows[("phx", "cold")]
        # the warm row read every file from the page cache, the cold one none
        # (when the caches could be dropped: root); on zram, which is memory,
        # the warm row reads O_DIRECT too and says which device
        warm, coldphx = rows[("phx", "warm")], rows[("phx", "cold")]
        if where == "zram":
            assert warm["files"] == 4 and warm["buffered_files"] == 0, warm
            assert len(warm["memory_direct"]) == 1, warm
            assert warm["memory_direct"][0].startswith("zram"), warm
        else:
            assert warm["files"] == 4 and warm["buffered_files"] == 4, warm
            assert warm["memory_direct"] == [], warm
        if os.geteuid() == 0:
            assert coldphx["buffered_files"] == 0, coldphx
        # the loader's own memory: load_file holds all it read until the end,
        # the iterator (tensors copied into "parameters" and dropped) at most
        # its in-flight window plus one group (here the whole 24 MB
        # checkpoint fits in the window: tests/test_loader_checks.py checks
        # the bound with a small one)
        assert coldphx["held_peak"] >= coldphx["bytes"]
        it = rows[("phx-iter", "cold")]
        assert 0 < it["held_peak"] <= min(it["bytes"], (1 << 30) + (256 << 20)), it
    assert "phx" in r.stdout and "x raw" in r.stdout and "warm: phx" in r.stdout


def test_bench_load_tensor_parallel_ranks_get_their_slices(data_dir):
    """--tp 2: two ranks in one process; phx reads only each rank's slices,
    safetensors whole tensors then narrows; every rank's slices match the
    checkpoint's (digests from the files), the sliced bytes once in all."""
    out = os.path.join(data_dir, "tp.json")
    r = _bench(["--size", "24m", "--dir", data_dir, "--repeat", "1", "--device", "cpu",
                "--tp", "2", "--json", out, "--keep"])
    assert r.returncode == 0, r.stdout + r.stderr
    doc = json.load(open(out))
    assert doc["tp"] == 2
    rows = {x["method"]: x for x in doc["rows"]}
    assert sorted(rows) == ["phx", "raw (16t)", "st"], rows        # TP methods only
    for m in ("phx", "st"):
        assert rows[m]["check"] == "ok", rows[m]
    # two ranks of every tensor: the sliced ones once in all, the norms twice
    shapes = dict(bench.llama_shapes(bench.parse_size("24m")))
    norms = sum(2 * math.prod(s) for n, s in shapes.items() if n.endswith("norm.weight"))
    assert rows["phx"]["bytes"] == sum(2 * math.prod(s) for s in shapes.values()) + norms
    ref = bench.tp_reference(os.path.join(data_dir, "phx-bench-load"), 2)
    assert len(ref) == 2 * len(shapes)


def test_bench_load_tp_must_divide_the_sliced_dims(data_dir):
    shapes = bench.llama_shapes(bench.parse_size("8m"))
    tp = next(n for n in (3, 5, 7, 11, 13)
              if any(s[0] % n for name, s in shapes if name.endswith("q_proj.weight")))
    r = _bench(["--size", "8m", "--dir", data_dir, "--repeat", "1", "--device", "cpu",
                "--tp", str(tp)])
    assert r.returncode != 0 and f"--tp {tp} does not divide" in r.stderr, r.stderr


def test_bench_load_catches_a_flipped_byte(data_dir):
    r = _bench(["--size", "8m", "--dir", data_dir, "--repeat", "1", "--device", "cpu",
                "--methods", "st", "--keep"])
    assert r.returncode == 0, r.stdout + r.stderr
    d = os.path.join(data_dir, "phx-bench-load")
    shard = os.path.join(d, "model-00002-of-00004.safetensors")
    with open(shard, "r+b") as f:
        f.seek(os.path.getsize(shard) - 100)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0x40]))
    r = _bench(["--size", "8m", "--dir", data_dir, "--repeat", "1", "--device", "cpu",
                "--methods", "phx,st", "--keep"])
    assert r.returncode == 1, r.stdout + r.stderr
    assert "wrong bytes" in r.stderr and "disk phx" in r.stderr and "disk st" in r.stderr
