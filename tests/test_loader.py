"""phx.loader on host memory: every tensor byte-for-byte against
``safetensors.torch.load_file``, on fresh random data (never zeros), odd
shapes and every dtype, unaligned offsets, sharded checkpoints, tensor-parallel
slices against torch slicing, each corruption case (a clear error naming the
file and tensor, nothing returned), on the disk, xfs (512 B and 4 KiB
sectors) and a loop ext4.
"""
from __future__ import annotations

import json
import os
import struct

import numpy as np
import pytest

torch = pytest.importorskip("torch")
st = pytest.importorskip("safetensors.torch")

import phx  # noqa: E402
from phx import loader  # noqa: E402
from phx.loader import CheckpointError, Slice  # noqa: E402

KiB, MiB = 1 << 10, 1 << 20


@pytest.fixture(autouse=True)
def _o_direct_by_default(monkeypatch):
    """A file a test has just written is in the page cache, which would send
    every load here down the warm (buffered) path; these tests are about the
    O_DIRECT path, so "auto" never finds a file warm unless a test says so
    (tests/test_loader_checks.py covers the warm path)."""
    from phx.loader import stream
    monkeypatch.setattr(stream, "WARM_FRACTION", 1.01)

DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.float64, torch.int8,
          torch.uint8, torch.int16, torch.int32, torch.int64, torch.bool,
          torch.float8_e4m3fn, torch.float8_e5m2]


def rand_tensor(rng, shape, dtype):
    """Random bytes reinterpreted as ``dtype`` (bool: random 0/1), never all zero."""
    n = int(np.prod(shape)) if shape else 1
    if n == 0:
        return torch.empty(shape, dtype=dtype)
    if dtype == torch.bool:
        a = rng.integers(0, 2, n, dtype=np.uint8)
        if n:
            a[0] = 1
        return torch.from_numpy(a).view(torch.bool).reshape(shape)
    size = torch.empty((), dtype=dtype).element_size()
    b = rng.integers(1, 256, n * size, dtype=np.uint8)
    t = torch.from_numpy(b).view(dtype).reshape(shape)
    if dtype.is_floating_point:
        # NaN payloads compare unequal: keep the bytes exact but finite
        t = torch.where(torch.isfinite(t.float()), t, torch.ones((), dtype=dtype))
    return t.clone()


def raw(t) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""


def assert_same_tensors(got: dict, ref: dict) -> None:
    assert sorted(got) == sorted(ref)
    for k, r in ref.items():
        g = got[k]
        assert g.dtype == r.dtype, (k, g.dtype, r.dtype)
        assert tuple(g.shape) == tuple(r.shape), (k, g.shape, r.shape)
        assert g.device.type == "cpu"
        assert raw(g) == raw(r), f"{k}: bytes differ"


def random_state(rng, big: int = 3 * MiB + 17):
    sd = {}
    shapes = [(), (1,), (7,), (3, 5), (33, 17, 3), (0,), (2, 0, 4), (4097,), (129, 31)]
    for i, dt in enumerate(DTYPES):
        for j, shp in enumerate(shapes[(i % 3)::3]):
            sd[f"layer{i}.{j}.w"] = rand_tensor(rng, shp, dt)
    sd["big.bf16"] = rand_tensor(rng, (big // 2,), torch.bfloat16)
    sd["big.i8"] = rand_tensor(rng, (big,), torch.int8)
    return sd


def write_raw(path, entries, data: bytes, pad_header_to: int | None = None,
              header: bytes | None = None) -> None:
    """A safetensors file by hand: ``entries`` {name: (dtype, shape, begin, end)}."""
    if header is None:
        doc = {k: {"dtype": d, "shape": list(s), "data_offsets": [b, e]}
               for k, (d, s, b, e) in entries.items()}
        header = json.dumps(doc).encode()
        if pad_header_to is not None:
            header += b" " * (pad_header_to - len(header))
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(header)) + header + data)


# ---------------------------------------------------------------------------
# correctness against safetensors
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("group", [256 << 20, 64 * KiB])
def test_every_dtype_and_shape_matches_safetensors(fs_dir, rng, group):
    sd = random_state(rng)
    path = os.path.join(fs_dir, "m.safetensors")
    st.save_file(sd, path)
    ref = st.load_file(path)
    got = loader.load_file(path, group_bytes=group)
    assert_same_tensors(got, ref)


def test_bulk_of_the_bytes_goes_o_direct(data_dir, rng):
    sd = {"a": rand_tensor(rng, (8 * MiB + 3,), torch.int8),
          "b": rand_tensor(rng, (3, 1 * MiB + 1), torch.float16)}
    path = os.path.join(data_dir, "m.safetensors")
    st.save_file(sd, path)
    before = phx.stats()
    got = loader.load_file(path)
    after = phx.stats()
    assert_same_tensors(got, st.load_file(path))
    direct = after["direct_bytes"] - before["direct_bytes"]
    assert direct >= 0.99 * sum(t.numel() * t.element_size() for t in sd.values()), (before, after)


def test_unaligned_offsets_odd_header(data_dir, rng):
    """Header length not a multiple of 8 and tensors at odd offsets: fp32 at
    an offset it cannot be viewed at is copied into aligned memory, and the
    bytes are still exact."""
    parts = [("i8", "I8", (3,)), ("f32", "F32", (5, 3)), ("bf", "BF16", (9,)),
             ("u8", "U8", (1,)), ("f64", "F64", (7,)), ("bool", "BOOL", (6,))]
    entries, data, off = {}, b"", 0
    sizes = {"I8": 1, "F32": 4, "BF16": 2, "U8": 1, "F64": 8, "BOOL": 1}
    for name, dt, shp in parts:
        n = int(np.prod(shp)) * sizes[dt]
        b = rng.integers(1, 127, n, dtype=np.uint8).tobytes()
        if dt == "BOOL":
            b = bytes(x & 1 for x in b)
        entries[name] = (dt, shp, off, off + n)
        data += b
        off += n
    path = os.path.join(data_dir, "odd.safetensors")
    hdr_len = len(json.dumps({k: {"dtype": d, "shape": list(s), "data_offsets": [b, e]}
                              for k, (d, s, b, e) in entries.items()})) + 3
    write_raw(path, entries, data, pad_header_to=hdr_len | 1)
    ref = st.load_file(path)
    got = loader.load_file(path)
    assert_same_tensors(got, ref)
    # the fp32 tensor sits at an odd address in the file: aligned in memory anyway
    assert got["f32"].data_ptr() % 4 == 0


def test_iterator_yields_in_file_order_with_small_inflight(data_dir, rng):
    sd = random_state(rng, big=1 * MiB)
    path = os.path.join(data_dir, "m.safetensors")
    st.save_file(sd, path)
    hdr = loader.open_checkpoint(path).files[0]
    order = [t.name for t in hdr.tensors]
    seen = []
    for name, t in loader.iter_tensors(path, group_bytes=16 * KiB, inflight_bytes=32 * KiB):
        seen.append(name)
        assert raw(t) == raw(sd[name]), name
    assert seen == order


def test_names_subset(data_dir, rng):
    sd = random_state(rng, big=64 * KiB)
    path = os.path.join(data_dir, "m.safetensors")
    st.save_file(sd, path)
    want = ["big.i8", "layer3.1.w"]
    got = loader.load_file(path, names=want)
    assert_same_tensors(got, {k: sd[k] for k in want})
    with pytest.raises(KeyError, match="nope"):
        loader.load_file(path, names=["nope"])


def test_progress_bar(data_dir, rng, capsys):
    path = os.path.join(data_dir, "m.safetensors")
    st.save_file({"a": rand_tensor(rng, (1000,), torch.float32)}, path)
    loader.load_file(path, progress=True)
    err = capsys.readouterr().err
    assert "phx load" in err and "100%" in err, err
    loader.load_file(path)
    assert "phx load" not in capsys.readouterr().err


# ---------------------------------------------------------------------------
# sharded checkpoints
# ---------------------------------------------------------------------------

def write_sharded(d, rng, nshards=3):
    sd = random_state(rng, big=256 * KiB)
    names = sorted(sd)
    weight_map = {}
    for s in range(nshards):
        fname = f"model-{s + 1:05d}-of-{nshards:05d}.safetensors"
        part = {k: sd[k] for k in names[s::nshards]}
        st.save_file(part, os.path.join(d, fname))
        weight_map.update({k: fname for k in part})
    idx = os.path.join(d, "model.safetensors.index.json")
    with open(idx, "w") as f:
        json.dump({"metadata": {"total_size": 1}, "weight_map": weight_map}, f)
    return sd, idx, weight_map


@pytest.mark.parametrize("how", ["index", "dir"])
def test_sharded_index(fs_dir, rng, how):
    sd, idx, _ = write_sharded(fs_dir, rng)
    ref = {}
    for f in sorted(os.listdir(fs_dir)):
        if f.endswith(".safetensors"):
            ref.update(st.load_file(os.path.join(fs_dir, f)))
    got = loader.load_file(idx if how == "index" else fs_dir)
    assert_same_tensors(got, ref)
    assert_same_tensors(got, sd)


def test_index_disagreeing_with_shards(data_dir, rng):
    sd, idx, wm = write_sharded(data_dir, rng)
    doc = json.load(open(idx))
    name = next(iter(wm))
    other = next(v for v in set(wm.values()) if v != wm[name])
    doc["weight_map"][name] = other                         # says the wrong shard
    json.dump(doc, open(idx, "w"))
    with pytest.raises(CheckpointError, match=name):
        loader.load_file(idx)
    doc["weight_map"] = dict(wm, **{"ghost.weight": wm[name]})  # a tensor no shard has
    json.dump(doc, open(idx, "w"))
    with pytest.raises(CheckpointError, match="ghost.weight") as e:
        loader.load_file(idx)
    assert e.value.tensor == "ghost.weight"
    doc["weight_map"] = dict(wm, **{"lost.weight": "model-missing.safetensors"})
    json.dump(doc, open(idx, "w"))
    with pytest.raises(CheckpointError, match="model-missing.safetensors"):
        loader.load_file(idx)


def test_one_corrupt_shard_fails_before_anything_is_read(data_dir, rng):
    _, idx, wm = write_sharded(data_dir, rng)
    bad = os.path.join(data_dir, sorted(set(wm.values()))[-1])
    os.truncate(bad, os.path.getsize(bad) - 1)
    before = phx.stats()["bytes_read"]
    with pytest.raises(CheckpointError) as e:
        loader.iter_tensors(idx)                 # raises at the call, before any yield
    assert e.value.path == bad and e.value.tensor is not None
    assert phx.stats()["bytes_read"] == before


# ---------------------------------------------------------------------------
# tensor-parallel slices
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.int8])
def test_tp_slices_match_torch_slicing(data_dir, rng, dtype):
    sd = {"w2": rand_tensor(rng, (12, 20), dtype), "w3": rand_tensor(rng, (6, 8, 10), dtype),
          "lead1": rand_tensor(rng, (1, 1, 12, 6), dtype), "v": rand_tensor(rng, (30,), dtype),
          "keep": rand_tensor(rng, (5, 3), dtype)}
    path = os.path.join(data_dir, "tp.safetensors")
    st.save_file(sd, path)
    ref = st.load_file(path)
    for ws in (1, 2, 3):
        for rank in range(ws):
            for dim in (0, 1, -1):
                def shard(name, shape, dim=dim):
                    if name == "keep" or (name == "v" and dim != 0):
                        return None
                    d = dim % len(shape)
                    return Slice(dim, rank, ws) if shape[d] % ws == 0 else None
                got = loader.load_file(path, shard=shard)
                for k, r in ref.items():
                    s = shard(k, tuple(r.shape))
                    want = r if s is None else torch.chunk(r, ws, dim=s.dim)[rank]
                    assert tuple(got[k].shape) == tuple(want.shape), (k, ws, rank, dim)
                    assert raw(got[k]) == raw(want), (k, ws, rank, dim)


def test_tp_sharder_rules_and_reads_only_the_slice(data_dir, rng):
    sd = {"l.q_proj.weight": rand_tensor(rng, (64, 1024), torch.bfloat16),
          "l.o_proj.weight": rand_tensor(rng, (1024, 64), torch.bfloat16),
          "l.norm.weight": rand_tensor(rng, (1024,), torch.bfloat16)}
    path = os.path.join(data_dir, "tp.safetensors")
    st.save_file(sd, path)
    sh = loader.tp_sharder(1, 4, {r"q_proj\.weight$": 0, r"o_proj\.weight$": 1})
    before = phx.stats()["bytes_read"]
    got = loader.load_file(path, shard=sh)
    moved = phx.stats()["bytes_read"] - before
    assert raw(got["l.q_proj.weight"]) == raw(sd["l.q_proj.weight"][16:32])
    assert raw(got["l.o_proj.weight"]) == raw(sd["l.o_proj.weight"][:, 16:32])
    assert raw(got["l.norm.weight"]) == raw(sd["l.norm.weight"])
    # a quarter of each sliced tensor, all of the norm (plus block rounding)
    assert moved < (2 * 64 * 1024 * 2) // 4 + 2048 + 64 * KiB, moved
    with pytest.raises(ValueError, match="rank"):
        loader.tp_sharder(4, 4, {})
    with pytest.raises(ValueError, match="equal parts"):
        loader.load_file(path, shard=lambda n, s: Slice(0, 0, 3) if "q_proj" in n else None)


# ---------------------------------------------------------------------------
# corrupt and truncated files
# ---------------------------------------------------------------------------

def _good(rng):
    a = rng.integers(1, 256, 64, dtype=np.uint8).tobytes()
    return {"x": ("F32", (4, 2), 0, 32), "y": ("BF16", (16,), 32, 64)}, a


CORRUPT = {
    # name: (mutation of (entries, data) -> (entries, data, header override), error text, tensor)
    "shape-vs-size": (lambda e, d: ({**e, "y": ("BF16", (15,), 32, 64)}, d, None),
                      "needs 30 bytes", "y"),
    "dtype-unknown": (lambda e, d: ({**e, "x": ("F33", (4, 2), 0, 32)}, d, None),
                      "dtype", "x"),
    "past-eof": (lambda e, d: ({**e, "y": ("BF16", (20,), 32, 72)}, d, None),
                 "past the end", "y"),
    "overlap": (lambda e, d: ({**e, "y": ("BF16", (16,), 24, 56)}, d, None),
                "overlap", "y"),
    "reversed": (lambda e, d: ({**e, "x": ("F32", (0,), 32, 0)}, d, None),
                 "reversed", "x"),
    "shape-not-ints": (lambda e, d: ({**e, "x": ("F32", (4, 2.0), 0, 32)}, d, None),
                       "shape", "x"),
    "bad-json": (lambda e, d: (e, d, b'{"x": {"dtype": "F32",'), "not valid JSON", None),
    "not-object": (lambda e, d: (e, d, b'[1, 2, 3]'), "not a JSON object", None),
    "truncated-data": (lambda e, d: (e, d[:50], None), "past the end", "y"),
}


@pytest.mark.parametrize("case", sorted(CORRUPT))
def test_corrupt_file_names_file_and_tensor(data_dir, rng, case):
    mutate, text, tensor = CORRUPT[case]
    entries, data = _good(rng)
    entries, data, header = mutate(entries, data)
    path = os.path.join(data_dir, f"{case}.safetensors")
    write_raw(path, entries, data, header=header)
    with pytest.raises(CheckpointError, match=text) as e:
        loader.load_file(path)
    assert e.value.path == path
    assert e.value.tensor == tensor
    assert path in str(e.value)
    if tensor:
        assert repr(tensor) in str(e.value)


@pytest.mark.parametrize("case", ["empty", "short-length", "huge-length", "length-past-eof"])
def test_corrupt_header_length(data_dir, case):
    path = os.path.join(data_dir, f"{case}.safetensors")
    body = {"empty": b"", "short-length": b"\x10\x00\x00",
            "huge-length": struct.pack("<Q", 1 << 40) + b"{}",
            "length-past-eof": struct.pack("<Q", 100) + b'{"a": 1}'}[case]
    with open(path, "wb") as f:
        f.write(body)
    with pytest.raises(CheckpointError, match="truncated|larger than") as e:
        loader.load_file(path)
    assert e.value.path == path and e.value.tensor is None


def test_missing_file():
    with pytest.raises(FileNotFoundError):
        loader.load_file("/nonexistent/dir/m.safetensors")


def test_truncated_while_loading_fails(data_dir, rng):
    """A file cut while it is being loaded (after it was opened for the
    data): the load fails with a CheckpointError naming the file (its size
    no longer the header's, checked after every read; a read that came back
    short says so and names the tensor), nothing read after the cut is
    handed out, and what was handed out is right."""
    sd = {"a": rand_tensor(rng, (2 * MiB,), torch.int8),
          "b": rand_tensor(rng, (1 * MiB,), torch.int8),
          "c": rand_tensor(rng, (1 * MiB,), torch.int8),
          "d": rand_tensor(rng, (1 * MiB,), torch.int8)}    # one dtype: file order a-d
    path = os.path.join(data_dir, "m.safetensors")
    st.save_file(sd, path)
    info = loader.open_checkpoint(path).tensors
    it = loader.iter_tensors(path, group_bytes=1 * MiB, inflight_bytes=1)
    got = dict([next(it)])
    assert list(got) == ["a"]
    os.truncate(path, info["d"].start + 12345)
    with pytest.raises(CheckpointError, match="changed since its header was read|short read") as e:
        for name, t in it:
            got[name] = t
    assert e.value.path == path
    assert "size" in str(e.value) or e.value.tensor == "d", e.value
    assert set(got) <= {"a", "b", "c"}
    for k in got:
        assert raw(got[k]) == raw(sd[k])
