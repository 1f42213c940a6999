"""``phx bench gpu --pattern stream``'s parts that need no GPU: its options
(and that the seq/chunks patterns keep theirs), the chunk list, the counter
selection, the ratios and the report, the JSON, the plot, and the "no GPU:
say so, exit 0" path of the command.  The rows themselves run on a GPU box
only (tools/stream_gpu_run.sh bench)."""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from phx.bench import _gpu_stream as st
from phx.bench import gpu as bench

MiB = 1 << 20


def _args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    bench.add_arguments(p)
    return p.parse_args(list(argv))


# ---------------------------------------------------------------------------
# options
# ---------------------------------------------------------------------------

def test_defaults():
    o = st.options(_args("--pattern", "stream"))
    assert o.chunks == [1 * MiB, 4 * MiB, 16 * MiB, 32 * MiB]
    assert o.chunk_bytes == 1 << 30 and o.file_bytes == 1 << 30
    assert o.threads == [1, 2, 4, 8]
    assert o.pool_threads == [8]
    assert o.kvikio_threads == [16, 64]
    assert o.ops == ["read", "write"]
    assert o.methods == ["stream", "stream-c", "batch", "pool", "kvikio"]
    assert o.repeat == 3


def test_options_given():
    o = st.options(_args("--pattern", "stream", "--stream-chunks", "64k,2M", "--chunk-bytes",
                         "3M", "--stream-threads", "8,2,2", "--pool-threads", "4,16",
                         "--kvikio-threads", "32", "--ops", "write", "--stream-methods",
                         "stream,pool", "--repeat", "1"))
    assert o.chunks == [64 << 10, 2 * MiB]
    assert o.threads == [1, 2, 8]              # 1 always, duplicates once
    assert o.pool_threads == [4, 16] and o.kvikio_threads == [32]
    assert o.ops == ["write"] and o.methods == ["stream", "pool"] and o.repeat == 1
    # 3 MiB in 2 MiB chunks: 2 chunks, so the files hold 4 MiB
    assert o.file_bytes == 4 * MiB


@pytest.mark.parametrize("argv", [
    ("--stream-chunks", "1000"),            # not a multiple of 4096
    ("--stream-chunks", "0"),
    ("--stream-chunks", "x"),
    ("--stream-threads", "0"),
    ("--stream-threads", "two"),
    ("--pool-threads", ""),
    ("--kvikio-threads", "-1"),
    ("--ops", "read,erase"),
    ("--stream-methods", "stream,dma"),
    ("--chunk-bytes", "0"),
    ("--repeat", "0"),
])
def test_bad_options(argv):
    """Refused while the command line is parsed (exit 2), or by options()."""
    try:
        a = _args("--pattern", "stream", *argv)
    except SystemExit as e:
        assert e.code == 2
        return
    with pytest.raises(ValueError):
        st.options(a)


def test_classic_patterns_keep_their_kvikio_sweep():
    """--kvikio-threads has one default per pattern now: seq/chunks keep 4,16,64."""
    a = _args()
    assert a.pattern == "seq,chunks" and a.kvikio_threads is None
    rows = bench._methods(a, True, "read", "chunks")
    assert [c["threads"] for name, c, _ in rows if name == "kvikio"] == [4, 16, 64]
    rows = bench._methods(_args("--kvikio-threads", "8"), True, "read", "chunks")
    assert [c["threads"] for name, c, _ in rows if name == "kvikio"] == [8]


def test_plan_rows():
    o = st.options(_args("--stream-chunks", "1M,4M", "--stream-threads", "4"))
    rows = st.plan(o, stream_ok=True, have_kvikio=True, eng=None)
    names = sorted({(m.name, m.threads) for m in rows})
    assert names == [("kvikio", 16), ("kvikio", 64), ("phx-batch", None), ("phx-stream-1", 1),
                     ("phx-stream-4", 4), ("phx-stream-c-1", 1), ("phx-stream-c-4", 4),
                     ("pool-8", 8)]
    assert len(rows) == 2 * 2 * 8                # chunks x ops x rows
    rows = st.plan(o, stream_ok=False, have_kvikio=False, eng=None)
    assert {m.family for m in rows} == {"batch", "pool"}


# ---------------------------------------------------------------------------
# the chunk list
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("chunk_bytes,chunks", [
    (64 * MiB, [MiB, 4 * MiB, 16 * MiB, 32 * MiB]),
    (10 * MiB, [MiB, 3 * MiB, 4 * MiB]),         # not all multiples of each other
    (4096, [4096, MiB]),
])
def test_chunk_list(chunk_bytes, chunks):
    size = st.file_bytes(chunk_bytes, chunks)
    for c in chunks:
        pat = st.chunk_list(size, c, chunk_bytes, seed=c)
        n = -(-chunk_bytes // c)
        fo, bo = pat.foffs, pat.boffs
        assert len(fo) == len(bo) == n and pat.piece == c
        assert pat.total == n * c >= chunk_bytes     # covers the bytes
        assert len(set(fo.tolist())) == n and len(set(bo.tolist())) == n   # distinct
        assert not (fo % c).any() and not (bo % c).any()                    # aligned
        assert fo.min() >= 0 and fo.max() + c <= size                       # in the file
        assert bo.min() >= 0 and bo.max() + c <= size                       # in the tensor
        assert (pat.sizes == c).all()
        if n >= 8:
            assert (np.diff(fo) < 0).any(), "file offsets not in a random order"
            assert (np.diff(bo) < 0).any(), "GPU places not in a random order"


def test_chunk_list_full_file_is_a_permutation():
    pat = st.chunk_list(64 * MiB, MiB, 64 * MiB, seed=3)
    assert sorted(pat.foffs.tolist()) == list(range(0, 64 * MiB, MiB))
    assert sorted(pat.boffs.tolist()) == list(range(0, 64 * MiB, MiB))
    with pytest.raises(ValueError):
        st.chunk_list(MiB, MiB, 2 * MiB, seed=1)


# ---------------------------------------------------------------------------
# counters
# ---------------------------------------------------------------------------

def test_counters():
    before = {"reads": 5, "stream_ops": 10, "stream_queue_ns": 1_000, "stream_data_ns": 0,
              "early_reads": 0, "pinned_bytes": 7}
    after = {"reads": 9, "stream_ops": 14, "stream_queue_ns": 9_000, "stream_data_ns": 4_000,
             "early_reads": 2, "pinned_bytes": 7, "lane_wait_ns": 800}
    d = st.counter_delta(before, after)
    assert d == {"stream_ops": 4, "stream_queue_ns": 8_000, "stream_data_ns": 4_000,
                 "early_reads": 2, "lane_wait_ns": 800}
    p = st.per_op(d, 4)
    assert p == {"stream_ops": 1.0, "stream_queue_us": 2.0, "stream_data_us": 1.0,
                 "early_reads": 0.5, "lane_wait_us": 0.2}
    assert st.per_op(d, 0) == {}


def test_suffixed():
    assert st.suffixed("out/r.json", "-stream") == "out/r-stream.json"
    assert st.suffixed("plot", "-stream") == "plot-stream"
    assert st.suffixed(None, "-stream") is None


# ---------------------------------------------------------------------------
# ratios, report, JSON, plot, on canned rows
# ---------------------------------------------------------------------------

def _row(method, family, device, op, chunk, threads, runs, verified=True, errors=(),
         counters=None, ops=0):
    med = float(np.median(runs)) if runs else None
    spread = (max(runs) - min(runs)) / med if runs else None
    return {"method": method, "family": family, "device": device, "fs": "ext4 on /dev/x",
            "op": op, "chunk": chunk, "threads": threads, "runs_gbps": list(runs),
            "median_gbps": med, "spread": spread, "verified": verified, "errors": list(errors),
            "counters": counters, "counter_ops": ops,
            "counters_per_op": st.per_op(counters or {}, ops) or None}


def _canned() -> list[dict]:
    rows = []
    for dev, scale in (("disk", 1.0), ("zram", 10.0)):
        for op in ("read", "write"):
            for chunk in (MiB, 16 * MiB):
                k = scale * (2 if chunk > MiB else 1)
                c = {"stream_ops": 1024, "stream_queue_ns": 1024 * 50_000,
                     "stream_data_ns": 1024 * 20_000, "early_reads": 0}
                rows += [
                    _row("phx-stream-1", "stream", dev, op, chunk, 1, [1.0 * k] * 3,
                         counters=c, ops=1024),
                    _row("phx-stream-2", "stream", dev, op, chunk, 2, [1.8 * k, 1.9 * k, 2.0 * k]),
                    _row("phx-stream-8", "stream", dev, op, chunk, 8, [0.9 * k] * 3),
                    _row("phx-stream-c-1", "stream-c", dev, op, chunk, 1, [1.5 * k] * 3),
                    _row("phx-stream-c-8", "stream-c", dev, op, chunk, 8, [1.2 * k] * 3),
                    _row("phx-batch", "batch", dev, op, chunk, None, [2.0 * k] * 3),
                    _row("pool-8", "pool", dev, op, chunk, 8, [1.25 * k] * 3),
                    _row("kvikio", "kvikio", dev, op, chunk, 16, [0.5 * k] * 3),
                    _row("kvikio", "kvikio", dev, op, chunk, 64, [0.8 * k] * 3),
                ]
    return rows


META = {"gpu": "Fake H200", "chunk_bytes": 1 << 30, "file_bytes": 1 << 30, "repeat": 3,
        "env": {"PHX_CUDA_EARLY_READS": "1"}, "staging": {"lanes": 16},
        "skipped": {}}


def test_ratios():
    rat = st.ratios(_canned())
    assert len(rat) == 2 * 2 * 2
    x = next(r for r in rat if (r["device"], r["op"], r["chunk"]) == ("zram", "write", 16 * MiB))
    assert x["stream1_vs_batch"] == pytest.approx(0.5)
    assert x["stream1_vs_pool"] == pytest.approx(0.8) and x["pool"] == "pool-8"
    assert x["streamN_vs_stream1_min"] == pytest.approx(0.9) and x["streamN_min_threads"] == 8
    assert x["stream1_vs_kvikio"] == pytest.approx(1.25) and x["kvikio_threads"] == 64
    assert x["phx_best_vs_kvikio"] == pytest.approx(2.5) and x["phx_best"] == "phx-batch"
    # the GIL-free rows against the batch and against their own one-thread row
    assert x["streamc1_vs_batch"] == pytest.approx(0.75)
    assert x["streamcN_vs_streamc1_min"] == pytest.approx(0.8) and x["streamcN_min_threads"] == 8


def test_ratios_missing_sides_are_none():
    rows = [r for r in _canned() if r["family"] in ("batch", "pool")]
    x = st.ratios(rows)[0]
    assert x["stream1_vs_batch"] is None and x["streamN_vs_stream1_min"] is None
    assert x["streamc1_vs_batch"] is None and x["streamcN_vs_streamc1_min"] is None
    assert x["stream1_vs_kvikio"] is None and x["phx_best_vs_kvikio"] is None
    assert x["phx_best"] == "phx-batch"


def test_report():
    text = st.report(_canned(), META)
    assert "PHX_CUDA_EARLY_READS=1" in text
    for panel in ("disk (ext4 on /dev/x): reads", "disk (ext4 on /dev/x): writes",
                  "zram (ext4 on /dev/x): reads", "zram (ext4 on /dev/x): writes"):
        assert panel in text
    for col in ("phx-stream-1", "phx-stream-2", "phx-stream-8", "phx-batch", "pool-8", "kvikio",
                "phx-stream-c-1", "phx-stream-c-8", "stream-c-1/batch",
                "min stream-c-N/stream-c-1",
                "stream-1/batch", "stream-1/pool", "min stream-N/stream-1", "best phx/kvikio"):
        assert col in text
    assert "0.80 ±0% 64t" in text                   # the best KvikIO, its thread count
    assert "0.90 (N=8)" in text
    assert "stream_queue_us" in text and "50" in text     # 50 us per op
    assert "0.80 (N=8)" in text                   # phx-stream-c-8 / phx-stream-c-1
    assert "all 72 rows right" in text and "FAILED" not in text


def test_report_shows_failures_loudly():
    rows = _canned()
    rows[0] = dict(rows[0], verified=False, errors=["mismatch: the chunk at 0 differs"])
    rows[5] = _row("phx-batch", "batch", "disk", "read", MiB, None, [], verified=False,
                   errors=["OSError: [Errno 5] boom"])
    text = st.report(rows, META)
    assert "FAILED ROWS" in text
    assert "mismatch: the chunk at 0 differs" in text and "boom" in text
    assert "ERROR" in text                      # a row with no run at all
    assert " !" in text                         # the mismatching row's cell is marked


def test_report_no_stream_rows():
    rows = [r for r in _canned() if r["family"] != "stream"]
    text = st.report(rows, dict(META, env={}, skipped={"phx-stream": "no memops"}))
    assert "(none set)" in text and "skipped phx-stream: no memops" in text
    assert "phx-stream rows" not in text


def test_json(tmp_path):
    path = tmp_path / "sub" / "stream.json"
    rows = _canned()
    st.save(str(path), rows, META)
    doc = json.loads(path.read_text())
    assert doc["benchmark"] == "gpu" and doc["pattern"] == "stream"
    assert doc["env"] == {"PHX_CUDA_EARLY_READS": "1"} and doc["repeat"] == 3
    assert "machine" in doc and len(doc["ratios"]) == 8
    assert len(doc["rows"]) == len(rows)
    r = doc["rows"][0]
    for key in ("method", "device", "op", "chunk", "threads", "runs_gbps", "median_gbps",
                "spread", "verified", "errors", "counters", "counters_per_op"):
        assert key in r
    assert r["counters"]["stream_ops"] == 1024 and r["counters_per_op"]["stream_queue_us"] == 50
    st.save(None, rows, META)                   # no --json: nothing written, no error


def test_plot(tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "stream.png"
    rows = _canned()
    rows.append(_row("phx-batch", "batch", "disk", "read", 4 * MiB, None, []))   # an error row
    assert st.plot(rows, str(path))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# ---------------------------------------------------------------------------
# the command without a GPU
# ---------------------------------------------------------------------------

def _cmd(*argv: str, cwd) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "phx", "bench", "gpu", *argv],
                          capture_output=True, text=True, timeout=120, cwd=cwd,
                          env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})


def test_no_gpu_exits_2(tmp_path):
    # CUDA_VISIBLE_DEVICES="" hides any GPU, so this holds on a GPU box too;
    # nothing measured: one line and exit 2 (phx.bench._common's exit status)
    for pattern in ("stream", "seq,stream", "seq"):
        p = _cmd("--pattern", pattern, "--dir", str(tmp_path), "--quiet",
                 "--json", str(tmp_path / "s.json"), cwd=tmp_path)
        assert p.returncode == 2, p.stderr
        assert "no GPU here" in p.stderr and len(p.stderr.strip().splitlines()) == 1
        assert not os.listdir(tmp_path), "files left behind"


def test_bad_option_exits_2(tmp_path):
    p = _cmd("--pattern", "stream", "--stream-chunks", "1000", cwd=tmp_path)
    assert p.returncode == 2 and "--stream-chunks" in p.stderr


# ---------------------------------------------------------------------------
# the checks and the row loops, on CPU tensors (torch's CUDA calls faked:
# this proves the bookkeeping - shares, queue, double buffers, offsets,
# result checks - not anything about CUDA)
# ---------------------------------------------------------------------------

def test_compare_finds_the_wrong_chunk():
    torch = pytest.importorskip("torch")
    pat = st.chunk_list(64 << 10, 4096, 64 << 10, seed=5)
    file_t = torch.randint(0, 256, (64 << 10,), dtype=torch.uint8)
    gpu_t = torch.zeros_like(file_t)
    for fo, bo in zip(pat.foffs.tolist(), pat.boffs.tolist()):
        gpu_t[bo:bo + 4096] = file_t[fo:fo + 4096]
    assert st.compare(file_t, gpu_t, pat) is None
    probes = [(k, gpu_t[int(b):int(b) + st.PROBE].sum()) for k, b in enumerate(pat.boffs)]
    assert st.compare_probes(file_t, pat, probes) is None
    bo = int(pat.boffs[7])
    gpu_t[bo + 100] ^= 1
    assert f"file offset {int(pat.foffs[7])}" in st.compare(file_t, gpu_t, pat)
    # a dependent kernel that ran before its data: it summed zeros
    probes[3] = (3, torch.zeros((), dtype=torch.int64))
    assert "ran before the data" in st.compare_probes(file_t, pat, probes)


class _FakeCuda:
    """Stand-ins for the torch.cuda calls the loops make (no device)."""

    class Stream:
        def __init__(self, device=None):
            pass

        def synchronize(self):
            pass

    class Event:
        def record(self, stream=None):
            pass

        def synchronize(self):
            pass

    @staticmethod
    def stream(s):
        import contextlib
        return contextlib.nullcontext()

    @staticmethod
    def set_device(d):
        pass


@pytest.fixture
def fake_cuda(monkeypatch):
    torch = pytest.importorskip("torch")
    import mmap
    for name in ("Stream", "Event", "stream", "set_device"):
        monkeypatch.setattr(torch.cuda, name, getattr(_FakeCuda, name))

    def pinned(n):      # page-aligned host memory, as the real one is
        t = torch.from_numpy(np.frombuffer(mmap.mmap(-1, n), dtype=np.uint8))
        return t, t.numpy()
    monkeypatch.setattr(st, "_pinned", pinned)
    return torch


def _files(data_dir, size, seed):
    rng = np.random.default_rng(seed)
    data = rng.integers(0, 256, size, dtype=np.uint8)
    path = os.path.join(data_dir, f"f{seed}.bin")
    data.tofile(path)
    return path, data


@pytest.mark.parametrize("threads", [1, 3])
def test_pool_moves_the_right_bytes(fake_cuda, data_dir, threads):
    torch = fake_cuda
    size, chunk = 2 * MiB, 64 << 10
    path, data = _files(data_dir, size, 1)
    pat = st.chunk_list(size, chunk, size, seed=2)
    gpu = torch.zeros(size, dtype=torch.uint8)
    dt, probes = st.pool(path, gpu, pat, False, threads)
    assert dt > 0 and probes == []
    assert st.compare(torch.from_numpy(data), gpu, pat) is None
    src = torch.randint(0, 256, (size,), dtype=torch.uint8)
    st.pool(path, src, pat, True, threads)
    assert st.compare(torch.from_numpy(np.fromfile(path, dtype=np.uint8)), src, pat) is None


@pytest.mark.parametrize("threads", [1, 4])
def test_phx_stream_loop(fake_cuda, data_dir, monkeypatch, threads):
    """The loop with phx.gpu's stream calls replaced by synchronous host I/O."""
    torch = fake_cuda
    import phx
    import phx.gpu
    size, chunk = MiB, 64 << 10
    path, data = _files(data_dir, size, 3)
    calls = []

    class Op:
        def __init__(self, n):
            self.n = n

        def result(self, timeout=None):
            return self.n

    def read_async(view, f, off, stream=None):
        calls.append(("r", off, stream))
        with open(path, "rb") as h:
            h.seek(off)
            b = h.read(view.numel())
        view.copy_(torch.frombuffer(bytearray(b), dtype=torch.uint8))
        return Op(len(b))

    def write_async(view, f, off, stream=None):
        calls.append(("w", off, stream))
        with open(path, "r+b") as h:
            h.seek(off)
            return Op(h.write(view.numpy().tobytes()))

    monkeypatch.setattr(phx.gpu, "read_async", read_async)
    monkeypatch.setattr(phx.gpu, "write_async", write_async)
    eng = phx.Engine()
    pat = st.chunk_list(size, chunk, size, seed=4)
    gpu = torch.zeros(size, dtype=torch.uint8)
    dt, probes = st.phx_stream(path, gpu, pat, False, threads, eng)
    assert len(calls) == len(pat.foffs) and sorted(c[1] for c in calls) == sorted(pat.foffs)
    assert len({id(c[2]) for c in calls}) == threads          # a stream per thread
    file_t = torch.from_numpy(data)
    assert st.compare(file_t, gpu, pat) is None
    assert len(probes) == len(pat.foffs) and st.compare_probes(file_t, pat, probes) is None
    calls.clear()
    src = torch.randint(0, 256, (size,), dtype=torch.uint8)
    _, probes = st.phx_stream(path, src, pat, True, threads, eng)
    assert probes == [] and len(calls) == len(pat.foffs)
    assert st.compare(torch.from_numpy(np.fromfile(path, dtype=np.uint8)), src, pat) is None

    # a short op is an error, not a figure
    monkeypatch.setattr(phx.gpu, "read_async", lambda v, f, o, stream=None: Op(5))
    with pytest.raises(RuntimeError, match="moved 5 of"):
        st.phx_stream(path, gpu, pat, False, threads, eng)
