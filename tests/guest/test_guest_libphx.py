"""libphx and the phx package on device memory, in the QEMU guest.

phx.devmem maps the ivshmem BAR (the stand-in for GPU memory) through
/dev/phx; phx.File reads and writes through the io_uring engine with
O_DIRECT straight into / out of it.  Checked byte for byte against os.pread
on fresh random data, aligned and not, sync, async and batched.  Skips
outside the guest (needs /dev/phx and PHX_IVSHMEM_BDF).
"""
import gc
import os

import pytest

import phx
import phx.devmem

MB = 1 << 20

pytestmark = pytest.mark.skipif(
    not (os.path.exists("/dev/phx") and os.environ.get("PHX_IVSHMEM_BDF")),
    reason="needs /dev/phx and an ivshmem BAR (runs in the QEMU guest)")


@pytest.fixture
def mem():
    m = phx.devmem.map_pci_bar(os.environ["PHX_IVSHMEM_BDF"], 2, 0, 16 * MB)
    yield m
    gc.collect()    # views a failed test left in its traceback
    m.close()


@pytest.fixture
def datafile():
    d = os.environ.get("PHX_GUEST_DIR", "/tmp")
    path = os.path.join(d, "libphx-devmem.dat")
    data = os.urandom(12 * MB + 4097)
    with open(path, "wb") as f:
        f.write(data)
        os.fsync(f.fileno())
    yield path, data
    os.unlink(path)


def test_available():
    ok, why = phx.devmem.available()
    assert ok, why


@pytest.mark.parametrize("size,off", [(4096, 0), (MB, 4096), (8 * MB, 0), (3 * MB + 123, 4095),
                                      (12 * MB + 4097, 0)])
def test_read_into_device_memory(mem, datafile, size, off):
    path, data = datafile
    eng = phx.Engine(queue_depth=32)
    # Start the buffer where the file offset sits in its block, so that
    # the aligned middle of the request is aligned in device memory too.
    skew = off % 4096
    with eng.open(path, "r") as f:
        view = memoryview(mem)[skew:skew + size]
        n = f.pread(view, off)
        exp = data[off:off + size]
        assert n == len(exp)
        assert bytes(view[:n]) == exp
        st = eng.stats()
        # aligned middle goes straight into the BAR; only the edges bounce
        assert st["direct_bytes"] >= (len(exp) // 4096 - 2) * 4096, st
        del view
    eng.close()


def test_incongruent_offset_bounces(mem, datafile):
    """Memory and file offset misaligned differently: all through bounce buffers."""
    path, data = datafile
    eng = phx.Engine()
    with eng.open(path, "r") as f:
        view = memoryview(mem)[:MB]
        assert f.pread(view, 4095) == MB
        assert bytes(view) == data[4095:4095 + MB]
        st = eng.stats()
        assert st["direct_bytes"] == 0 and st["bounce_bytes"] == MB, st
        del view
    eng.close()


def test_write_from_device_memory(mem, datafile):
    path, _ = datafile
    src = os.urandom(6 * MB + 11)
    memoryview(mem)[:len(src)] = src
    out = path + ".out"
    with phx.open(out, "w+") as f:
        assert f.pwrite(memoryview(mem)[:len(src)], 4096) == len(src)
        f.fsync()
    fd = os.open(out, os.O_RDONLY)
    try:
        assert os.pread(fd, len(src), 4096) == src
        assert os.fstat(fd).st_size == 4096 + len(src)
    finally:
        os.close(fd)
        os.unlink(out)


def test_async_and_batch(mem, datafile):
    path, data = datafile
    with phx.open(path, "r") as f:
        view = memoryview(mem)
        futs = [f.pread_async(view[i * MB:(i + 1) * MB], i * MB) for i in range(8)]
        assert [fu.result() for fu in futs] == [MB] * 8
        assert bytes(view[:8 * MB]) == data[:8 * MB]
        reqs = [(view[i * 65536:(i + 1) * 65536], (i * 7919 * 4096) % (8 * MB)) for i in range(64)]
        assert f.pread_batch(reqs) == [65536] * 64
        for b, o in reqs:
            assert bytes(b) == data[o:o + 65536]
