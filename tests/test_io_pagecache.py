"""O_DIRECT means O_DIRECT: unaligned requests go through the engine's
bounce buffers, never silently through the page cache.

Checked with cachestat(2) (Linux >= 6.5): after dropping a file's cached
pages, phx reads and writes of any alignment leave none behind; a file
opened direct=False does fill the cache (so the probe itself works).
"""
from __future__ import annotations

import ctypes
import errno
import os

import pytest

import phx
from conftest import MiB, assert_same, fresh_bytes, write_file

_NR_CACHESTAT = {"x86_64": 451, "aarch64": 451}.get(os.uname().machine)


class _Range(ctypes.Structure):
    _fields_ = [("off", ctypes.c_uint64), ("len", ctypes.c_uint64)]


class _Stat(ctypes.Structure):
    _fields_ = [(n, ctypes.c_uint64) for n in
                ("nr_cache", "nr_dirty", "nr_writeback", "nr_evicted", "nr_recently_evicted")]


def cached_pages(path: str) -> int:
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(path, os.O_RDONLY)
    try:
        r, st = _Range(0, 0), _Stat()
        if libc.syscall(_NR_CACHESTAT, fd, ctypes.byref(r), ctypes.byref(st), 0) != 0:
            e = ctypes.get_errno()
            if e == errno.ENOSYS:
                pytest.skip("cachestat(2) not available (kernel < 6.5)")
            raise OSError(e, "cachestat")
        return st.nr_cache
    finally:
        os.close(fd)


def drop(path: str) -> None:
    os.sync()
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    if cached_pages(path):
        pytest.skip("cannot drop this file's pages from the page cache here")


@pytest.fixture
def cold(data_dir, rng):
    if _NR_CACHESTAT is None:
        pytest.skip(f"cachestat syscall number unknown on {os.uname().machine}")
    path = os.path.join(data_dir, "cold")
    data = fresh_bytes(rng, 8 * MiB)
    write_file(path, data)
    drop(path)
    return path, data


@pytest.mark.parametrize("off,n,mis", [(0, 1 * MiB, 0), (12_345, 3 * MiB, 0), (4096, 100_000, 1),
                                       (8 * MiB - 7, 100, 3), (1, 1, 0)])
def test_reads_bypass_page_cache(cold, off, n, mis):
    path, data = cold
    whole = phx.empty_aligned(n + 64)
    view = memoryview(whole)[mis:mis + n]
    with phx.open(path, "r") as f:
        got = f.pread(view, off)
        assert_same(view[:got], data[off:off + n])
        f.pread_batch([(bytearray(777), o) for o in range(5, 8 * MiB, 1 * MiB)])
        f.pread_async(bytearray(4097), 3).result()
    assert cached_pages(path) == 0, "an O_DIRECT read left pages in the page cache"


@pytest.mark.parametrize("off,n", [(0, 4096), (1, 1), (4097, 1 * MiB + 7), (8 * MiB - 3, 10)])
def test_writes_bypass_page_cache(cold, rng, off, n):
    path, data = cold
    new = fresh_bytes(rng, n)
    with phx.open(path, "r+") as f:
        assert f.pwrite(new, off) == n
        f.pwrite_batch([(fresh_bytes(rng, 100), o) for o in range(7, 4 * MiB, 1 * MiB)])
    # A write that ends the file off a block boundary is cut back with
    # ftruncate(2), and the kernel zeroes the rest of that last block through
    # the page cache: at most that one page may stay cached.
    allowed = 1 if off + n > len(data) and (off + n) % 4096 else 0
    assert cached_pages(path) <= allowed, "an O_DIRECT write (read-modify-write) left pages cached"


def test_buffered_file_does_use_page_cache(cold):
    """Control: the probe sees pages when phx is asked for the page cache."""
    path, data = cold
    with phx.open(path, "r", direct=False) as f:
        b = bytearray(1 * MiB)
        assert f.pread(b, 0) == 1 * MiB
    assert cached_pages(path) > 0
