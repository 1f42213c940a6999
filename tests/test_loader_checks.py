"""phx.loader: one checkpoint or none, index entries inside the model folder,
warm files read from the page cache, partial reads, what a load holds.

* A shard replaced by a rename after the headers were read, or written in
  place while it is being read, fails the load with a CheckpointError naming
  the file; no tensor of the new bytes is handed out.
* An index naming a file outside its folder (absolute, ``..``) is refused; a
  symbolic link inside the folder (a Hugging Face cache) is not.
* ``cachestat`` and ``mincore`` agree on page-cache residency; a file mostly
  in the page cache is read buffered (phx's buffered counter), a cold one
  O_DIRECT, a warm one on a memory device (zram) O_DIRECT too; ``cached=``
  forces either.
* :class:`Partial` reads only its boxes, the tensor keeping its shape.
* ``LoadStats.peak_held_bytes`` stays within the in-flight bound.
"""
from __future__ import annotations

import json
import os

import pytest

torch = pytest.importorskip("torch")
st = pytest.importorskip("safetensors.torch")

import phx  # noqa: E402
from phx import loader  # noqa: E402
from phx.loader import CheckpointError, Partial, cache  # noqa: E402

from test_loader import rand_tensor, raw  # noqa: E402

MiB = 1 << 20


def evict(path: str) -> None:
    """Drop ``path``'s pages from the page cache (written back first)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def two_shards(d, rng, n=4, size=256 * 1024):
    """An index over two shards of ``n`` int8 tensors each (file order = name order)."""
    sd, wm = {}, {}
    for s in range(2):
        fname = f"model-{s + 1:05d}-of-00002.safetensors"
        part = {f"s{s}.t{i}": rand_tensor(rng, (size,), torch.int8) for i in range(n)}
        st.save_file(part, os.path.join(d, fname))
        sd.update(part)
        wm.update({k: fname for k in part})
    idx = os.path.join(d, "model.safetensors.index.json")
    with open(idx, "w") as f:
        json.dump({"metadata": {}, "weight_map": wm}, f)
    return sd, idx


@pytest.mark.parametrize("cached", ["never", "always"])
def test_shard_replaced_by_rename_after_the_headers_fails(data_dir, rng, cached):
    """The headers are read; while shard 1 is being handed out, shard 2 is
    replaced (same names, shapes and size: a new checkpoint version) by a
    rename.  Its data must not be loaded under the old headers."""
    sd, idx = two_shards(data_dir, rng)
    second = os.path.join(data_dir, "model-00002-of-00002.safetensors")
    it = loader.iter_tensors(idx, group_bytes=1, inflight_bytes=1, cached=cached)
    got = dict([next(it)])
    assert list(got) == ["s0.t0"]
    new = {k: rand_tensor(rng, (256 * 1024,), torch.int8) for k in sd if k.startswith("s1.")}
    st.save_file(new, second + ".tmp")
    assert os.path.getsize(second + ".tmp") == os.path.getsize(second)
    os.rename(second + ".tmp", second)
    with pytest.raises(CheckpointError, match="changed since its header was read") as e:
        for k, t in it:
            got[k] = t
    assert e.value.path == second and "another file" in str(e.value)
    # shard 2 is opened (and refused) while shard 1's last reads are in flight
    assert {"s0.t0", "s0.t1"} <= set(got) <= {f"s0.t{i}" for i in range(4)}
    for k, t in got.items():
        assert raw(t) == raw(sd[k])


def test_shard_written_in_place_while_loading_fails(data_dir, rng):
    """Bytes of a shard overwritten in place (same inode, same size) after it
    was opened: the check after the read sees its mtime move."""
    sd, idx = two_shards(data_dir, rng)
    first = os.path.join(data_dir, "model-00001-of-00002.safetensors")
    info = loader.open_checkpoint(idx).tensors
    it = loader.iter_tensors(idx, group_bytes=1, inflight_bytes=1, cached="never")
    got = dict([next(it)])
    fd = os.open(first, os.O_WRONLY)
    try:
        os.pwrite(fd, b"\x55" * 4096, info["s0.t3"].start)
    finally:
        os.close(fd)
    with pytest.raises(CheckpointError, match="mtime changed") as e:
        for k, t in it:
            got[k] = t
    assert e.value.path == first
    assert "s0.t3" not in got
    for k, t in got.items():
        assert raw(t) == raw(sd[k])


def test_unchanged_checkpoint_loads(data_dir, rng):
    """The checks do not fire on a checkpoint left alone (renaming another
    file in the folder included)."""
    sd, idx = two_shards(data_dir, rng)
    open(os.path.join(data_dir, "other"), "w").close()
    it = loader.iter_tensors(idx, group_bytes=1, inflight_bytes=1)
    got = dict([next(it)])
    os.rename(os.path.join(data_dir, "other"), os.path.join(data_dir, "other2"))
    got.update(it)
    assert sorted(got) == sorted(sd)
    for k, t in got.items():
        assert raw(t) == raw(sd[k])


@pytest.mark.parametrize("name", ["../outside.safetensors", "/etc/outside.safetensors",
                                  "sub/../../outside.safetensors"])
def test_index_entry_outside_the_folder_is_refused(data_dir, rng, name):
    d = os.path.join(data_dir, "model")
    os.makedirs(d)
    st.save_file({"a": rand_tensor(rng, (64,), torch.int8)},
                 os.path.join(data_dir, "outside.safetensors"))
    idx = os.path.join(d, "model.safetensors.index.json")
    with open(idx, "w") as f:
        json.dump({"weight_map": {"a": name}}, f)
    with pytest.raises(CheckpointError, match="outside the model folder") as e:
        loader.load_file(idx)
    assert e.value.path == idx and name in str(e.value)


def test_symlinked_shard_inside_the_folder_is_accepted(data_dir, rng):
    """A Hugging Face snapshot folder links its files into ../../blobs."""
    blobs = os.path.join(data_dir, "blobs")
    snap = os.path.join(data_dir, "snapshots", "abc")
    os.makedirs(blobs)
    os.makedirs(snap)
    t = rand_tensor(rng, (1000,), torch.int8)
    st.save_file({"a": t}, os.path.join(blobs, "deadbeef"))
    os.symlink("../../blobs/deadbeef", os.path.join(snap, "model.safetensors"))
    with open(os.path.join(snap, "model.safetensors.index.json"), "w") as f:
        json.dump({"weight_map": {"a": "model.safetensors"}}, f)
    assert raw(loader.load_file(snap)["a"]) == raw(t)


# ---------------------------------------------------------------------------
# warm files
# ---------------------------------------------------------------------------

def test_cachestat_and_mincore_agree(data_dir, rand_bytes):
    path = os.path.join(data_dir, "f")
    with open(path, "wb") as f:
        f.write(rand_bytes(16 * MiB))
    evict(path)
    fd = os.open(path, os.O_RDONLY)
    try:
        pages = 16 * MiB // 4096
        assert cache.mincore_pages(fd, 16 * MiB) < pages * 0.05
        assert cache.resident_fraction(fd) < 0.05
        # half of it, without readahead (whose pages are counted by one
        # call and not yet by the other while they are still being read)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        os.pread(fd, 8 * MiB, 0)
        via_mincore = cache.mincore_pages(fd, 16 * MiB)
        via_cachestat = cache.cachestat_pages(fd, 16 * MiB)
        assert pages * 0.49 < via_mincore < pages * 0.6, via_mincore
        if via_cachestat is not None:          # Linux 6.5+
            assert abs(via_cachestat - via_mincore) <= pages * 0.02, (via_cachestat, via_mincore)
        assert 0.49 < cache.resident_fraction(fd) < 0.6
        os.pread(fd, 16 * MiB, 0)
        assert cache.resident_fraction(fd) > 0.98
    finally:
        os.close(fd)
    assert cache.method() in ("cachestat", "mincore")


def test_mincore_fallback_where_cachestat_is_missing(data_dir, rand_bytes, monkeypatch):
    """A kernel before 6.5 (or a seccomp filter) has no cachestat: the
    fraction comes from mincore, and a warm file is still found warm."""
    path = os.path.join(data_dir, "f")
    with open(path, "wb") as f:
        f.write(rand_bytes(4 * MiB))
    monkeypatch.setattr(cache, "_cachestat_ok", False)
    assert cache.cachestat_pages(0, 4096) is None and cache.method() == "mincore"
    fd = os.open(path, os.O_RDONLY)
    try:
        os.pread(fd, 4 * MiB, 0)
        assert cache.resident_fraction(fd) > 0.98
        evict(path)
        assert cache.resident_fraction(fd) < 0.05
    finally:
        os.close(fd)


def _load_counting(path, **kw):
    before = phx.stats()
    it = loader.iter_tensors(path, **kw)
    got = dict(it)
    after = phx.stats()
    return got, it.stats, {k: after[k] - before[k] for k in ("direct_bytes", "buffered_bytes")}


def test_warm_file_is_read_from_the_page_cache_cold_one_direct(data_dir, rng):
    sd = {"a": rand_tensor(rng, (4 * MiB,), torch.int8),
          "b": rand_tensor(rng, (1 * MiB + 7,), torch.float16)}
    path = os.path.join(data_dir, "m.safetensors")
    st.save_file(sd, path)
    payload = sum(raw(t).__len__() for t in sd.values())
    with open(path, "rb") as f:             # read once: warm
        f.read()
    got, stats, moved = _load_counting(path)
    assert stats.buffered_files == [path] and stats.resident[path] >= loader.WARM_FRACTION
    assert moved["buffered_bytes"] >= payload and moved["direct_bytes"] == 0, moved
    for k in sd:
        assert raw(got[k]) == raw(sd[k])
    evict(path)                             # cold
    got, stats, moved = _load_counting(path)
    assert stats.buffered_files == [] and stats.resident[path] < 0.2
    assert moved["direct_bytes"] >= 0.99 * payload, moved
    for k in sd:
        assert raw(got[k]) == raw(sd[k])
    # forced either way
    _, stats, moved = _load_counting(path, cached="always")
    assert stats.buffered_files == [path] and moved["direct_bytes"] == 0
    with open(path, "rb") as f:
        f.read()
    _, stats, moved = _load_counting(path, cached="never")
    assert stats.buffered_files == [] and moved["direct_bytes"] >= 0.99 * payload
    with pytest.raises(ValueError, match="cached"):
        loader.iter_tensors(path, cached="sometimes")



def test_warm_file_on_a_memory_device_is_read_direct(rng):
    """zram is memory: its warm file is read O_DIRECT all the same (the page
    cache is slower there), said in the stats; "always" still forces the cache."""
    from phx.bench import _zram
    why = _zram.unavailable(64 * MiB)
    if why:
        pytest.skip(f"no zram here: {why}")
    with _zram.zram_ext4(64 * MiB) as z:
        sd = {"a": rand_tensor(rng, (3 * MiB + 5,), torch.int8)}
        path = os.path.join(z.mountpoint, "m.safetensors")
        st.save_file(sd, path)
        with open(path, "rb") as f:         # read once: warm
            f.read()
        dev = os.path.basename(os.path.realpath(z.device))
        with open(path, "rb") as f:
            assert cache.memory_device(f.fileno()) == dev
        got, stats, moved = _load_counting(path)
        assert stats.resident[path] >= loader.WARM_FRACTION
        assert stats.buffered_files == [] and stats.memory_direct == {path: dev}
        assert moved["direct_bytes"] >= 0.99 * (3 * MiB) and moved["buffered_bytes"] == 0, moved
        assert raw(got["a"]) == raw(sd["a"])
        got, stats, moved = _load_counting(path, cached="always")
        assert stats.buffered_files == [path] and moved["direct_bytes"] == 0
        assert raw(got["a"]) == raw(sd["a"])


def _sysfs_block(root, name, slaves=(), parts=()):
    d = os.path.join(root, "devices", name)
    os.makedirs(os.path.join(d, "slaves"), exist_ok=True)
    for s in slaves:
        os.symlink(os.path.join(root, "devices", s), os.path.join(d, "slaves", s))
    for p in parts:
        os.makedirs(os.path.join(d, p), exist_ok=True)
        open(os.path.join(d, p, "partition"), "w").close()
    return d


@pytest.mark.parametrize("entry,want", [
    ("zram3", "zram3"), ("ram0", "ram0"), ("pmem1/pmem1p2", "pmem1"),
    ("nvme0n1/nvme0n1p1", None), ("vda", None),
    ("dm-0", "zram1"),          # a dm device made only of memory devices
    ("dm-1", None),             # one of its slaves is not memory
])
def test_which_block_devices_are_memory(tmp_path, entry, want):
    root = str(tmp_path)
    _sysfs_block(root, "zram1")
    _sysfs_block(root, "zram3")
    _sysfs_block(root, "ram0")
    _sysfs_block(root, "vda")
    _sysfs_block(root, "pmem1", parts=["pmem1p2"])
    _sysfs_block(root, "nvme0n1", parts=["nvme0n1p1"])
    _sysfs_block(root, "dm-0", slaves=["zram1", "zram3"])
    _sysfs_block(root, "dm-1", slaves=["zram1", "vda"])
    assert cache._block_memory(os.path.join(root, "devices", entry)) == want


# ---------------------------------------------------------------------------
# partial reads, what a load holds
# ---------------------------------------------------------------------------

def test_partial_reads_only_its_boxes(data_dir, rng):
    """Rows 3..7 and 10..12 of a matrix, and a column block of another: the
    tensors keep their shapes, the boxes hold the file's bytes, and only the
    boxes' bytes are read."""
    a = rand_tensor(rng, (16, 1000), torch.float32)
    b = rand_tensor(rng, (64, 256), torch.bfloat16)
    c = rand_tensor(rng, (77,), torch.int8)
    path = os.path.join(data_dir, "m.safetensors")
    st.save_file({"a": a, "b": b, "c": c}, path)
    boxes = {"a": Partial((((3, 7), (0, 1000)), ((10, 12), (0, 1000)), ((4, 5), (0, 1000)))),
             "b": Partial((((0, 64), (128, 192)),))}
    it = loader.iter_tensors(path, shard=lambda n, s: boxes.get(n), cached="never")
    got = dict(it)
    assert got["a"].shape == a.shape and got["b"].shape == b.shape
    assert torch.equal(got["a"][3:7], a[3:7]) and torch.equal(got["a"][10:12], a[10:12])
    assert raw(got["b"][:, 128:192]) == raw(b[:, 128:192])
    assert raw(got["c"]) == raw(c)
    want = (4 + 2) * 1000 * 4 + 64 * 64 * 2 + 77
    assert it.stats.bytes_read == want
    # boxes that cover everything are an ordinary whole read
    whole = loader.iter_tensors(path, shard=lambda n, s: Partial((((0, s[0]),) + tuple(
        (0, x) for x in s[1:]),)), cached="never")
    assert raw(dict(whole)["a"]) == raw(a) and whole.stats.bytes_read == a.numel() * 4 + \
        b.numel() * 2 + 77
    with pytest.raises(ValueError, match="not inside"):
        loader.load_file(path, shard=lambda n, s: Partial((((0, 99), (0, 1)),)) if n == "a" else None)


def test_peak_held_bytes_stays_within_the_inflight_bound(data_dir, rng):
    """The iterator's own memory: what it allocated and has not handed out.
    Consumed one tensor at a time, it stays within inflight_bytes plus one
    job (here: 8 tensors of 1 MiB, groups of 2 MiB, 3 MiB in flight)."""
    sd = {f"t{i}": rand_tensor(rng, (MiB,), torch.int8) for i in range(8)}
    path = os.path.join(data_dir, "m.safetensors")
    st.save_file(sd, path)
    it = loader.iter_tensors(path, group_bytes=2 * MiB, inflight_bytes=3 * MiB)
    n = 0
    for k, t in it:
        assert raw(t) == raw(sd[k])
        n += 1
    assert n == 8 and it.stats.tensors == 8 and it.stats.bytes_read == 8 * MiB
    assert 2 * MiB <= it.stats.peak_held_bytes <= 3 * MiB + 2 * MiB, it.stats
    all_at_once = loader.iter_tensors(path, group_bytes=2 * MiB, inflight_bytes=64 * MiB)
    dict(all_at_once)
    assert all_at_once.stats.peak_held_bytes == 8 * MiB
