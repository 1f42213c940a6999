"""Every kind of buffer the contract accepts, read into and written from.

bytearray, memoryview (whole and sliced), array.array, mmap, numpy arrays of
several dtypes and shapes (at aligned and unaligned addresses),
phx.empty_aligned, and contiguous torch CPU tensors (skipped without torch).
The count returned is always in bytes.
"""
from __future__ import annotations

import array
import mmap
import os

import numpy as np
import pytest

import phx
from conftest import MiB, assert_same, buf_address, fresh_bytes, torch_or_skip, write_file

DTYPES = [np.uint8, np.int8, np.int16, np.uint32, np.int64, np.float16, np.float32,
          np.float64, np.complex128]


@pytest.fixture
def src(data_dir, rng):
    """(path, data): a 3 MiB + 11 file of random bytes."""
    path = os.path.join(data_dir, "src")
    data = fresh_bytes(rng, 3 * MiB + 11)
    write_file(path, data)
    return path, data


def roundtrip(path, obj, nbytes, offset, data, rng, data_dir):
    """Read nbytes at offset into obj and compare; then write fresh bytes from
    obj to a new file at the same offset and compare."""
    with phx.open(path, "r") as f:
        assert f.pread(obj, offset) == nbytes
    assert_same(bytes(memoryview(obj)), data[offset:offset + nbytes], f"pread into {type(obj).__name__}")
    # now write it back out elsewhere
    out = os.path.join(data_dir, "out")
    with phx.open(out, "w") as f:
        assert f.pwrite(obj, offset) == nbytes
    with open(out, "rb") as g:
        g.seek(offset)
        assert_same(g.read(), data[offset:offset + nbytes], f"pwrite from {type(obj).__name__}")


@pytest.mark.parametrize("offset", [0, 4096, 13])
def test_bytearray(src, rng, data_dir, offset):
    path, data = src
    n = 1 * MiB + 3
    roundtrip(path, bytearray(fresh_bytes(rng, n)), n, offset, data, rng, data_dir)


@pytest.mark.parametrize("start", [0, 1, 7, 4096, 4099])
def test_memoryview_slices(src, rng, data_dir, start):
    path, data = src
    n = 70_001
    backing = bytearray(fresh_bytes(rng, n + 8192))
    mv = memoryview(backing)[start:start + n]
    roundtrip(path, mv, n, 4097, data, rng, data_dir)
    # bytes of the backing store outside the slice untouched
    canary = bytes(backing[:start])
    with phx.open(path, "r") as f:
        f.pread(mv, 0)
    assert bytes(backing[:start]) == canary


def test_memoryview_of_bytes_for_write(src, rng, data_dir):
    data = fresh_bytes(rng, 12_345)
    out = os.path.join(data_dir, "o")
    with phx.open(out, "w") as f:
        assert f.pwrite(memoryview(data)[5:], 1) == 12_340
        assert f.pwrite(data, 20_000) == 12_345  # bytes: read-only is fine for writing
    with open(out, "rb") as g:
        got = g.read()
    assert_same(got[1:12_341], data[5:])
    assert_same(got[20_000:], data)


def test_array_array(src, rng, data_dir):
    path, data = src
    a = array.array("i", range(50_000))
    roundtrip(path, a, a.itemsize * len(a), 511, data, rng, data_dir)


def test_mmap(src, rng, data_dir):
    path, data = src
    m = mmap.mmap(-1, 2 * MiB)
    m[:] = fresh_bytes(rng, 2 * MiB)
    try:
        with phx.open(path, "r") as f:
            assert f.pread(m, 4096) == 2 * MiB
        assert_same(m[:], data[4096:4096 + 2 * MiB], "pread into mmap")
    finally:
        m.close()


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("shape", [(1,), (4097,), (33, 129), (5, 6, 7)], ids=str)
def test_numpy(src, rng, data_dir, dtype, shape):
    path, data = src
    arr = np.empty(shape, dtype=dtype)
    arr.view(np.uint8).reshape(-1)[:] = np.frombuffer(fresh_bytes(rng, arr.nbytes), np.uint8)
    with phx.open(path, "r") as f:
        assert f.pread(arr, 4097) == arr.nbytes
    assert_same(arr.tobytes(), data[4097:4097 + arr.nbytes], f"numpy {arr.dtype} {shape}")
    out = os.path.join(data_dir, "o")
    arr2 = np.frombuffer(fresh_bytes(rng, arr.nbytes), dtype=dtype).reshape(shape).copy()
    with phx.open(out, "w") as f:
        assert f.pwrite(arr2, 1) == arr.nbytes
    with open(out, "rb") as g:
        g.seek(1)
        assert_same(g.read(), arr2.tobytes(), "pwrite from numpy")


@pytest.mark.parametrize("misalign", [0, 1, 8, 511, 4095])
def test_numpy_unaligned_address(src, rng, misalign):
    """A view starting at an arbitrary address inside an aligned numpy array."""
    path, data = src
    n = 300_000
    base = np.frombuffer(phx.empty_aligned(n + 8192), dtype=np.uint8)
    base[:] = np.frombuffer(fresh_bytes(rng, base.size), np.uint8)
    canary = base.copy()
    view = base[misalign:misalign + n]
    assert view.ctypes.data % 4096 == misalign
    with phx.open(path, "r") as f:
        assert f.pread(view, 12_288) == n
    assert_same(view.tobytes(), data[12_288:12_288 + n])
    assert_same(base[:misalign].tobytes(), canary[:misalign].tobytes(), "before")
    assert_same(base[misalign + n:].tobytes(), canary[misalign + n:].tobytes(), "after")


def test_numpy_fortran_order_1d_slices_ok(src, rng):
    """A contiguous row slice of a C array is contiguous and accepted."""
    path, data = src
    a = np.empty((64, 1000), dtype=np.float32)
    row = a[3:9]  # C-contiguous sub-block
    assert row.flags.c_contiguous
    with phx.open(path, "r") as f:
        assert f.pread(row, 0) == row.nbytes
    assert_same(row.tobytes(), data[:row.nbytes])


@pytest.mark.parametrize("alignment", [512, 4096, 65536, 2 * MiB])
@pytest.mark.parametrize("nbytes", [1, 4095, 4096, 1 * MiB + 7])
def test_empty_aligned(alignment, nbytes, src, rng):
    path, data = src
    b = phx.empty_aligned(nbytes, alignment=alignment)
    assert isinstance(b, phx.AlignedBuffer)
    mv = memoryview(b)
    assert mv.nbytes == nbytes == len(mv.cast("B"))
    assert not mv.readonly
    assert mv.contiguous
    assert buf_address(b) % alignment == 0
    fill = fresh_bytes(rng, nbytes)
    mv.cast("B")[:] = fill
    assert bytes(mv) == fill
    with phx.open(path, "r") as f:
        assert f.pread(b, 4096) == nbytes
    assert_same(bytes(mv), data[4096:4096 + nbytes])
    arr = np.frombuffer(b, dtype=np.uint8)
    assert arr.size == nbytes


def test_empty_aligned_default_alignment_and_numpy_view(rng):
    b = phx.empty_aligned(10_000)
    assert buf_address(b) % 4096 == 0
    a = np.frombuffer(b, dtype=np.uint8)
    a[:] = 7
    assert bytes(memoryview(b)) == b"\x07" * 10_000


# ---- torch ---------------------------------------------------------------------

TORCH_DTYPES = ["uint8", "int8", "int16", "int32", "int64", "float16", "bfloat16", "float32",
                "float64"]


@pytest.mark.parametrize("dtype", TORCH_DTYPES)
@pytest.mark.parametrize("shape", [(4097,), (17, 257)], ids=str)
def test_torch_cpu_tensor(src, rng, data_dir, dtype, shape):
    torch = torch_or_skip()
    path, data = src
    t = torch.empty(shape, dtype=getattr(torch, dtype))
    nbytes = t.numel() * t.element_size()
    t.view(torch.uint8).reshape(-1).copy_(torch.frombuffer(bytearray(fresh_bytes(rng, nbytes)),
                                                          dtype=torch.uint8))
    with phx.open(path, "r") as f:
        assert f.pread(t, 4099) == nbytes
    got = t.view(torch.uint8).reshape(-1).numpy().tobytes()
    assert_same(got, data[4099:4099 + nbytes], f"pread into torch {dtype}")
    t2 = torch.frombuffer(bytearray(fresh_bytes(rng, nbytes)), dtype=torch.uint8).view(
        getattr(torch, dtype)).reshape(shape)
    out = os.path.join(data_dir, "o")
    with phx.open(out, "w") as f:
        assert f.pwrite(t2, 0) == nbytes
    with open(out, "rb") as g:
        assert_same(g.read(), t2.view(torch.uint8).reshape(-1).numpy().tobytes(), "pwrite torch")


def test_torch_contiguous_slice_with_storage_offset(src, rng):
    """A contiguous tensor that starts 7 bytes into its storage: the data
    pointer, not the storage start, is what gets filled."""
    torch = torch_or_skip()
    path, data = src
    base = torch.frombuffer(bytearray(fresh_bytes(rng, 100_000)), dtype=torch.uint8)
    canary = base.clone()
    t = base[7:90_007]
    assert t.is_contiguous() and t.storage_offset() == 7
    with phx.open(path, "r") as f:
        assert f.pread(t, 1) == 90_000
    assert_same(t.numpy().tobytes(), data[1:90_001])
    assert torch.equal(base[:7], canary[:7])
    assert torch.equal(base[90_007:], canary[90_007:])


def test_torch_large_tensor(src, rng):
    torch = torch_or_skip()
    path, data = src
    t = torch.empty(3 * MiB // 4, dtype=torch.float32)
    with phx.open(path, "r") as f:
        assert f.pread(t, 11) == 3 * MiB
    assert_same(t.numpy().tobytes(), data[11:11 + 3 * MiB])
