"""phx.loader's GPU path (phx.gpu.read_chunks_async into device targets) on
the fake libcuda of tests/gpu_fake (host memory posing as device memory), so
it runs on machines without a GPU: every tensor byte-for-byte against
``safetensors.torch.load_file``, TP column slices (one piece per row),
sharded checkpoints and a file truncated while loading.  The same logic on a
real GPU with torch tensors: tests/test_loader_gpu.py.
"""
from __future__ import annotations

import os
import pickle
import subprocess
import sys
import textwrap

import pytest

torch = pytest.importorskip("torch")
st = pytest.importorskip("safetensors.torch")

from test_loader import rand_tensor, random_state, raw, write_sharded  # noqa: E402

MiB = 1 << 20




# The child: loads with a GPUBackend whose targets are fake device memory,
# pickles {name: bytes} (or the error) for the parent to compare.
CHILD = textwrap.dedent(r"""
    import ctypes, pickle, sys
    import phx.gpu
    from phx import loader
    from phx.loader.stream import GPUBackend, run
    lib = ctypes.CDLL("libcuda.so.1")
    assert lib.fake_sleep_async, "not the fake libcuda"
    ok, why = phx.gpu.is_available()
    assert ok, why

    class Dev:
        def __init__(self, ptr, n):
            self.ptr, self.n = ptr, n
        @property
        def __cuda_array_interface__(self):
            return {"shape": (self.n,), "typestr": "|u1", "data": (self.ptr, False),
                    "version": 3}

    class FakeDevice(GPUBackend):
        def alloc(self, n):
            p = ctypes.c_uint64()
            assert lib.cuMemAlloc_v2(ctypes.byref(p), ctypes.c_size_t(n + self.alignment)) == 0
            return Dev(p.value, n + self.alignment), p.value
        def view(self, buf, addr, off, out):
            return ctypes.string_at(addr + off, out.nbytes)

    path, out, mode = sys.argv[1], sys.argv[2], sys.argv[3]
    ctx0 = loader.prepare(0).result() if mode == "prepared" else None
    shard = None
    if mode.startswith("tp"):
        ws, rank = 4, 3
        shard = loader.tp_sharder(rank, ws, {r"^w2$": 1, r"^w3$": 1, r"^v$": 0})
    ck = loader.open_checkpoint(path)
    jobs = loader.plan(ck.tensors.values(), 64 << 10 if mode in ("small", "truncate") else 256 << 20, shard)
    # O_DIRECT unless the mode is "warm" (a file the test just wrote is in
    # the page cache: "auto" would read every case buffered); no header
    # identities, so that a cut file shows the short-read check
    it = run(jobs, FakeDevice(), inflight_bytes=128 << 10,
             cached="always" if mode == "warm" else "never")
    res = {}
    try:
        if mode == "truncate":
            t = ck.tensors[sys.argv[4]]
            import os
            first = next(it)
            res[first[0]] = first[1]
            os.truncate(path, t.start + 100)
        for name, b in it:
            res[name] = b
    except loader.CheckpointError as e:
        res = {"__error__": (e.path, e.tensor, str(e)), **res}
    res["__stats__"] = phx.gpu.stats()
    if ctx0 is not None:
        res["__prepared_used__"] = phx.gpu.context(device=0) is ctx0
    pickle.dump(res, open(out, "wb"))
    print("child ok")
""")


def _child(fake_cuda, tmp_path, path, mode, *extra):
    out = tmp_path / "out.pkl"
    env = dict(os.environ, LD_LIBRARY_PATH=str(fake_cuda), PHX_CUDA_LANES="2",
               PHX_CUDA_BUFS="2", PHX_CUDA_BUF_SIZE="256K")
    r = subprocess.run([sys.executable, "-c", CHILD, str(path), str(out), mode, *extra],
                       env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "child ok" in r.stdout, r.stdout + r.stderr
    return pickle.load(open(out, "rb"))


@pytest.mark.parametrize("mode", ["whole", "small", "prepared", "warm"])
def test_fake_gpu_every_tensor_matches_safetensors(fake_cuda, tmp_path, data_dir, rng, mode):
    """Every tensor byte-exact, O_DIRECT and (warm) through the page cache;
    also after ``loader.prepare(0)``, whose context the load then uses."""
    path = os.path.join(data_dir, "m.safetensors")
    st.save_file(random_state(rng, big=2 * MiB + 7), path)
    ref = st.load_file(path)
    got = _child(fake_cuda, tmp_path, path, mode)
    stats = got.pop("__stats__")
    if mode == "prepared":
        assert got.pop("__prepared_used__") is True, "the load made a context of its own"
    assert sorted(got) == sorted(ref)
    for k, r in ref.items():
        assert got[k] == raw(r), k
    assert stats, "the reads did not go through phx.gpu"


def test_fake_gpu_tp_column_slices(fake_cuda, tmp_path, data_dir, rng):
    sd = {"w2": rand_tensor(rng, (96, 40), torch.bfloat16),
          "w3": rand_tensor(rng, (5, 8, 12), torch.float32),
          "v": rand_tensor(rng, (64,), torch.int8), "keep": rand_tensor(rng, (9,), torch.float16)}
    path = os.path.join(data_dir, "tp.safetensors")
    st.save_file(sd, path)
    got = _child(fake_cuda, tmp_path, path, "tp")
    got.pop("__stats__")
    assert got["w2"] == raw(torch.chunk(sd["w2"], 4, 1)[3])
    assert got["w3"] == raw(torch.chunk(sd["w3"], 4, 1)[3])
    assert got["v"] == raw(torch.chunk(sd["v"], 4, 0)[3])
    assert got["keep"] == raw(sd["keep"])


def test_fake_gpu_sharded(fake_cuda, tmp_path, data_dir, rng):
    sd, idx, _ = write_sharded(data_dir, rng)
    got = _child(fake_cuda, tmp_path, idx, "small")
    got.pop("__stats__")
    assert sorted(got) == sorted(sd)
    for k, t in sd.items():
        assert got[k] == raw(t), k


def test_fake_gpu_truncated_while_loading(fake_cuda, tmp_path, data_dir, rng):
    sd = {"a": rand_tensor(rng, (1 * MiB,), torch.int8),
          "b": rand_tensor(rng, (1 * MiB,), torch.int8),
          "c": rand_tensor(rng, (1 * MiB,), torch.int8)}
    path = os.path.join(data_dir, "m.safetensors")
    st.save_file(sd, path)
    got = _child(fake_cuda, tmp_path, path, "truncate", "c")
    assert "__error__" in got, sorted(got)
    p, tensor, text = got["__error__"]
    assert p == path and tensor == "c" and "short read" in text
    assert "c" not in got
