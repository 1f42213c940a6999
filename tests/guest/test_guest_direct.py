"""The Python direct path in the guest: /dev/phx mapped with mmap, O_DIRECT
os.preadv/os.pwritev straight between a file and the device memory.

Runs inside the QEMU guest (tests/guest/suite_phx.sh); skips elsewhere.
Works under pytest or as a plain script (exit 0 pass, 1 fail, 77 skip).
"""
import ctypes
import fcntl
import mmap
import os
import struct
import sys

try:
    import pytest
except ImportError:  # plain python3 in the guest
    pytest = None

# kernel/include/uapi/phx_uapi.h
PHX_ABI_VERSION = 1
PHX_PROV_PCIBAR = 1
REG_FMT = "<IIIIBBBBIQQQQII4Q"
INFO_FMT = "<IIIIQQQ4Q"
MB = 1 << 20


def _iowr(nr, size):
    return (3 << 30) | (size << 16) | (0xD7 << 8) | nr


PHX_IOC_INFO = _iowr(0, struct.calcsize(INFO_FMT))
PHX_IOC_REGISTER = _iowr(1, struct.calcsize(REG_FMT))


def _need_phx():
    if not os.path.exists("/dev/phx") or not os.environ.get("PHX_IVSHMEM_BDF"):
        if pytest:
            pytest.skip("needs /dev/phx and an ivshmem BAR (runs in the QEMU guest)")
        sys.exit(77)


def _register(fd, offset, length):
    d, b, s, f = (int(x, 16) for x in os.environ["PHX_IVSHMEM_BDF"].replace(".", ":").split(":"))
    buf = bytearray(struct.pack(REG_FMT, PHX_ABI_VERSION, PHX_PROV_PCIBAR, 0, d, b,
                                (s << 3) | f, 2, 0, 0, offset, length, 0, 0, 0, 0,
                                0, 0, 0, 0))
    fcntl.ioctl(fd, PHX_IOC_REGISTER, buf, True)
    fields = struct.unpack(REG_FMT, buf)
    return fields[8], fields[12], fields[13]   # handle, mmap_offset, mode


def test_info():
    _need_phx()
    fd = os.open("/dev/phx", os.O_RDWR)
    try:
        buf = bytearray(struct.pack(INFO_FMT, PHX_ABI_VERSION, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0))
        fcntl.ioctl(fd, PHX_IOC_INFO, buf, True)
        abi, flags, align = struct.unpack(INFO_FMT, buf)[:3]
        assert abi == PHX_ABI_VERSION and align == 2 * MB
    finally:
        os.close(fd)


def test_direct_read_write():
    _need_phx()
    d = os.environ.get("PHX_GUEST_DIR", "/tmp")
    path = os.path.join(d, "phx-python.dat")
    size = 8 * MB
    data = os.urandom(size)
    with open(path, "wb") as f:
        f.write(data)
        os.fsync(f.fileno())
    fd = os.open("/dev/phx", os.O_RDWR)
    try:
        handle, off, mode = _register(fd, 0, 16 * MB)
        mm = mmap.mmap(fd, 16 * MB, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE,
                       offset=off)
        view = memoryview(mm)
        dfd = os.open(path, os.O_RDWR | os.O_DIRECT)
        try:
            for boff, foff, n in ((0, 0, size), (MB, 4096, MB), (4096, 2 * MB, 64 * 1024)):
                view[boff:boff + n] = b"\0" * n
                assert os.preadv(dfd, [view[boff:boff + n]], foff) == n
                assert view[boff:boff + n] == data[foff:foff + n], (boff, foff, n)
            new = os.urandom(MB)
            view[3 * MB:4 * MB] = new
            assert os.pwritev(dfd, [view[3 * MB:4 * MB]], 5 * MB) == MB
        finally:
            os.close(dfd)
        with open(path, "rb") as f:
            f.seek(5 * MB)
            assert f.read(MB) == new
        view.release()
        mm.close()
    finally:
        os.close(fd)
        os.unlink(path)


if __name__ == "__main__":
    pytest = None  # noqa: F811  (a plain run reports a skip as exit 77)
    for name, fn in list(globals().items()):
        if name.startswith("test_") and callable(fn):
            fn()
            print(f"ok {name}")
    sys.exit(0)
