"""phx.info(): what this machine offers (io_uring, O_DIRECT alignment for a
path, CUDA, the kernel module), each entry with a reason a person can act on."""
from __future__ import annotations

import ctypes
import json
import os

import pytest

import phx


def _avail(entry: dict) -> bool:
    for k in ("available", "loaded"):
        if k in entry:
            assert isinstance(entry[k], bool), entry
            return entry[k]
    raise AssertionError(f"no available/loaded flag in {entry}")


def _reason(entry: dict) -> str:
    r = entry.get("reason")
    assert isinstance(r, str) and len(r.strip()) >= 5, f"no usable reason in {entry}"
    return r


def test_info_shape(data_dir):
    d = phx.info(data_dir)
    assert isinstance(d, dict)
    for key in ("io_uring", "o_direct", "cuda", "kernel_module"):
        assert key in d, f"phx.info() lacks {key!r}: {sorted(d)}"
        assert isinstance(d[key], dict)
        _avail(d[key])
        _reason(d[key])
    json.dumps(d)  # JSON-serialisable as it is


def test_info_default_path():
    d = phx.info()
    assert "o_direct" in d and "io_uring" in d


def test_info_io_uring_matches_sysctl():
    try:
        with open("/proc/sys/kernel/io_uring_disabled") as f:
            disabled = f.read().strip()
    except OSError:
        disabled = None
    d = phx.info()
    if disabled == "0":
        assert _avail(d["io_uring"]) is True, d["io_uring"]
    elif disabled == "2":
        assert _avail(d["io_uring"]) is False
        assert "io_uring_disabled" in _reason(d["io_uring"])


def test_info_alignment_matches_open(data_dir):
    path = os.path.join(data_dir, "probe")
    with open(path, "wb") as f:
        f.write(os.urandom(8192))
    before = set(os.listdir(data_dir))
    d = phx.info(data_dir)["o_direct"]
    assert set(os.listdir(data_dir)) == before, "phx.info left files behind"
    assert _avail(d) is True, d
    with phx.open(path, "r") as f:
        mem_align, off_align = f.alignment
    assert d["mem_align"] == mem_align and d["offset_align"] == off_align, (d, f.alignment)
    for a in (d["mem_align"], d["offset_align"]):
        assert a >= 1 and a & (a - 1) == 0


def test_info_on_a_file_leaves_it_alone(data_dir):
    path = os.path.join(data_dir, "f")
    data = os.urandom(5000)
    with open(path, "wb") as f:
        f.write(data)
    st = os.stat(path)
    d = phx.info(path)["o_direct"]
    assert _avail(d)
    with open(path, "rb") as f:
        assert f.read() == data
    assert os.stat(path).st_mtime_ns == st.st_mtime_ns


def test_info_on_4k_sector_xfs(xfs4k_mount):
    d = phx.info(xfs4k_mount)["o_direct"]
    assert _avail(d), d
    assert d["offset_align"] == 4096, d
    assert d["mem_align"] >= 1
    assert "xfs" in json.dumps(d) or d.get("filesystem") in (None, "xfs")


def test_info_on_512_sector_xfs(xfs_mount):
    d = phx.info(xfs_mount)["o_direct"]
    assert _avail(d), d
    assert d["offset_align"] in (512, 4096), d


def test_info_missing_path(data_dir):
    missing = os.path.join(data_dir, "no", "such", "dir")
    d = phx.info(missing)
    assert _avail(d["o_direct"]) is False
    _reason(d["o_direct"])


def test_info_cuda_consistent():
    d = phx.info()["cuda"]
    try:
        ctypes.CDLL("libcuda.so.1")
        has_driver = True
    except OSError:
        has_driver = False
    if not has_driver:
        assert _avail(d) is False, d
    _reason(d)


def test_info_kernel_module_consistent():
    d = phx.info()["kernel_module"]
    loaded = _avail(d)
    if not os.path.exists("/dev/phx") and not os.path.isdir("/sys/module/phx"):
        assert loaded is False, d
    _reason(d)


def test_info_cgroup_is_phx_cgroup():
    """phx.info()'s cgroup entry is phx.cgroup's reading of this process's own
    memory cgroup (the reader phx.kv's budgeter uses): same version, path,
    limit and memory.high; the limit is the tightest up the tree."""
    from phx import cgroup
    d = phx.info()["cgroup"]
    cg = cgroup.memory()
    if cg is None:
        assert d["version"] is None and _reason(d)
        return
    assert (d["version"], d["path"]) == (cg.version, cg.path)
    caps = [lv.limit for lv in cg.levels if lv.limit < cgroup.UNLIMITED]
    assert d["limit"] == (min(caps) if caps else "unlimited")
    highs = [lv.high for lv in cg.levels if lv.high < cgroup.UNLIMITED]
    assert d["high"] == (min(highs) if highs else "unlimited")
    assert d["binding"] == (cg.binding.path if cg.binding else None)
    with open("/proc/self/cgroup") as f:
        mine = cgroup.parse_proc_cgroup(f.read())
    own = cg.mount + (mine["v1"] if cg.version == 1 else mine["v2"]).rstrip("/")
    # our own cgroup, not the hierarchy's root (the mount, in a cgroup namespace)
    assert d["path"] == (own if os.path.isdir(own) else cg.mount), (d["path"], own)
