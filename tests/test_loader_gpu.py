"""phx.loader into CUDA torch tensors on a real GPU: byte-for-byte against
``safetensors.torch.load_file``, TP slices against torch slicing, sharded
checkpoints, a file truncated while loading, peak host memory bounded by
the staging, not the checkpoint, a warm file read through the page cache,
and the iterator's peak extra GPU memory within its in-flight window.
Files a test just wrote are in the page cache: as in tests/test_loader.py,
"auto" finds none warm here unless a test says so (O_DIRECT is the path
under test).  Skips without a usable GPU (the same GPU
path runs on the fake libcuda in tests/test_loader_fake.py).
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

torch = pytest.importorskip("torch")
st = pytest.importorskip("safetensors.torch")

from phx import loader  # noqa: E402
from phx.loader import CheckpointError  # noqa: E402

from conftest import real_gpu_marks  # noqa: E402
from test_loader import (_o_direct_by_default, rand_tensor, random_state, raw,  # noqa: E402,F401
                         write_sharded)

pytestmark = real_gpu_marks()
MiB = 1 << 20


def same(got: dict, ref: dict) -> None:
    assert sorted(got) == sorted(ref)
    for k, r in ref.items():
        g = got[k]
        assert g.is_cuda, k
        assert g.dtype == r.dtype and tuple(g.shape) == tuple(r.shape), k
        assert raw(g.cpu()) == raw(r.cpu()), k


@pytest.mark.parametrize("group", [256 << 20, 64 << 10])
def test_gpu_every_dtype_matches_safetensors(data_dir, rng, group):
    path = os.path.join(data_dir, "m.safetensors")
    st.save_file(random_state(rng, big=24 * MiB + 5), path)
    same(loader.load_file(path, device="cuda", group_bytes=group), st.load_file(path))
    same(loader.load_file(path, device="cuda:0"), st.load_file(path, device="cuda:0"))


def test_gpu_iterator_sharded(data_dir, rng):
    sd, idx, _ = write_sharded(data_dir, rng)
    got = dict(loader.iter_tensors(idx, device="cuda", group_bytes=32 << 10,
                                   inflight_bytes=64 << 10))
    same(got, sd)


def test_gpu_tp_slices(data_dir, rng):
    sd = {"q.weight": rand_tensor(rng, (256, 1000), torch.bfloat16),
          "o.weight": rand_tensor(rng, (1000, 256), torch.bfloat16),
          "n.weight": rand_tensor(rng, (1000,), torch.float32)}
    path = os.path.join(data_dir, "tp.safetensors")
    st.save_file(sd, path)
    for rank in range(4):
        sh = loader.tp_sharder(rank, 4, {r"^q\.": 0, r"^o\.": 1})
        got = loader.load_file(path, device="cuda", shard=sh)
        assert raw(got["q.weight"].cpu()) == raw(torch.chunk(sd["q.weight"], 4, 0)[rank])
        assert raw(got["o.weight"].cpu()) == raw(torch.chunk(sd["o.weight"], 4, 1)[rank])
        assert raw(got["n.weight"].cpu()) == raw(sd["n.weight"])


def test_gpu_truncated_while_loading(data_dir, rng):
    sd = {k: rand_tensor(rng, (4 * MiB,), torch.int8) for k in "abc"}
    path = os.path.join(data_dir, "m.safetensors")
    st.save_file(sd, path)
    it = loader.iter_tensors(path, device="cuda", group_bytes=1 * MiB, inflight_bytes=1)
    first = next(it)
    os.truncate(path, os.path.getsize(path) - 3 * MiB)      # inside c
    # the size check after each read, or the short read itself
    with pytest.raises(CheckpointError, match="changed since its header was read|short read") as e:
        for _ in it:
            pass
    assert e.value.path == path and first[0] == "a"


RSS_CHILD = textwrap.dedent(r"""
    import sys, torch
    torch.zeros(1, device="cuda")           # CUDA's own host memory, before the baseline
    import phx.gpu
    from phx import loader
    from phx.bench._common import peak_rss, reset_peak_rss
    phx.gpu.context(device=0)               # the staging is pinned here
    base = reset_peak_rss()                 # (ru_maxrss would be pytest's, inherited)
    sd = loader.load_file(sys.argv[1], device="cuda", cached="never")
    torch.cuda.synchronize()
    peak = peak_rss()
    print(peak - base, sum(t.numel() * t.element_size() for t in sd.values()))
""")


def test_gpu_peak_host_memory_is_bounded_by_staging(data_dir, rng):
    """2 GiB of weights to the GPU: the process's peak RSS grows by far less
    than the checkpoint (the staging was pinned before the baseline)."""
    path = os.path.join(data_dir, "big.safetensors")
    st.save_file({f"w{i}": rand_tensor(rng, (256 * MiB,), torch.int8) for i in range(8)}, path)
    r = subprocess.run([sys.executable, "-c", RSS_CHILD, path], capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    grew, total = (int(x) for x in r.stdout.split()[-2:])
    assert total == 2048 * MiB
    assert grew < 256 * MiB, f"peak RSS grew by {grew / MiB:.0f} MiB for a 2 GiB checkpoint"


def test_gpu_warm_file_through_the_page_cache(data_dir, rng):
    path = os.path.join(data_dir, "m.safetensors")
    st.save_file(random_state(rng, big=8 * MiB + 3), path)
    it = loader.iter_tensors(path, device="cuda", cached="always")
    same(dict(it), st.load_file(path))
    assert it.stats.buffered_files == [path]


def test_gpu_iterator_peak_extra_memory_is_its_window(data_dir, rng):
    """Consumed as vLLM does (each tensor copied into its parameter, then
    dropped): the GPU memory allocated beyond the parameters is what the
    loader held (``peak_held_bytes``: at most inflight_bytes plus one group)
    plus the group being handed out."""
    sd = {f"w{i}": rand_tensor(rng, (8 * MiB,), torch.int8) for i in range(16)}
    path = os.path.join(data_dir, "m.safetensors")
    st.save_file(sd, path)
    params = {k: torch.empty_like(v, device="cuda") for k, v in sd.items()}
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    it = loader.iter_tensors(path, device="cuda", group_bytes=16 * MiB,
                             inflight_bytes=32 * MiB)
    for k, t in it:
        params[k].copy_(t)
        del t
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base
    assert it.stats.peak_held_bytes <= 32 * MiB + 16 * MiB
    # plus the group being handed out; the caching allocator rounds each
    # block up (2 MiB pages)
    assert extra <= it.stats.peak_held_bytes + 16 * MiB + 8 * (2 * MiB), (extra, it.stats)
    for k, v in sd.items():
        assert raw(params[k].cpu()) == raw(v), k
