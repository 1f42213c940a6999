"""phx.nvme on emulated NVMe controllers in the QEMU guest (tests/guest/nvme/suite_nvme.sh).

The suite boots three controllers (see nvme.mk), told apart by their serial
numbers, not by their names (controllers probe in any order):

  phx0000  64 MiB, 4 KiB LBAs, MDTS 3 (32 KiB per command)
  phx0001  64 MiB, 512 B LBAs, MDTS 2 (16 KiB per command)
  phx0002  512 MiB, 4 KiB LBAs, MDTS 5: mkfs/mount/partition refusals, then hot-removed

Everything skips where no /dev/ng* exists (the host).  Data is random.
"""
from __future__ import annotations

import errno
import fcntl
import glob
import os
import stat
import struct
import subprocess
import sys
import threading
import time
import uuid
import zlib

import numpy as np
import pytest

KiB, MiB = 1024, 1024 * 1024

pytestmark = pytest.mark.guest

nvme = pytest.importorskip("phx.nvme")

# serial -> (LBA size, MDTS, bytes); phx0002 is big enough for mkfs.xfs (300 MiB minimum)
LAYOUT = {"phx0000": (4096, 3, 64 * MiB), "phx0001": (512, 2, 64 * MiB),
          "phx0002": (4096, 5, 512 * MiB)}


def _namespaces() -> dict[str, str]:
    """serial -> /dev/ngXnY of the guest's controllers."""
    out = {}
    for p in sorted(glob.glob("/dev/ng*n1")):
        try:
            out[nvme.identify(p)["serial"]] = p
        except OSError:
            pass
    return out


NS = _namespaces() if glob.glob("/dev/ng*") else {}
if not NS:
    pytest.skip("no NVMe namespace char device (/dev/ng*): runs in the QEMU guest "
                "(make test-guest-nvme)", allow_module_level=True)


def dev(serial: str) -> str:
    if serial not in NS:
        pytest.skip(f"no controller with serial {serial}")
    return NS[serial]


DATA_SERIALS = ["phx0000", "phx0001"]


@pytest.fixture(params=DATA_SERIALS)
def ns(request):
    """A data namespace, claimed whole (force: earlier tests leave random data)."""
    with nvme.open(dev(request.param), force=True) as n:
        yield n


@pytest.fixture
def rbytes():
    rng = np.random.default_rng(int.from_bytes(os.urandom(4), "little"))

    def make(n: int) -> np.ndarray:
        return rng.integers(1, 256, n, dtype=np.uint8)
    return make


def _aligned(n: int, align: int = 4096, shift: int = 0) -> np.ndarray:
    raw = np.empty(n + align + shift, dtype=np.uint8)
    off = (-raw.ctypes.data) % align + shift
    return raw[off:off + n]


# ---------------------------------------------------------------------------
# identify
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("serial", ["phx0000", "phx0001", "phx0002"])
def test_identify_matches_kernel(serial):
    info = nvme.identify(dev(serial))
    lba, mdts, size = LAYOUT[serial]
    blk = info["block_device"]
    assert blk and os.path.exists(f"/sys/block/{blk}")
    with open(f"/sys/block/{blk}/queue/logical_block_size") as f:
        assert info["lba_size"] == int(f.read()) == lba
    with open(f"/sys/block/{blk}/size") as f:
        assert info["capacity"] == int(f.read()) * 512 == size
    assert info["mdts"] == mdts
    assert info["max_transfer"] == min(4096 << mdts, info["max_segments"] * 4096)
    assert info["max_transfer"] % lba == 0
    assert info["features"]["dsm"] and info["features"]["write_zeroes"]
    assert info["model"].startswith("QEMU")
    print(f"{serial}: {info}")


# ---------------------------------------------------------------------------
# data: across extent boundaries, chunking, end of range, parallel
# ---------------------------------------------------------------------------

def test_roundtrip_across_extent_boundaries(ns, rbytes):
    ls = ns.lba_size
    mt = ns.info["max_transfer"]
    first = 1000 if ls == 512 else 100           # a first LBA of our choosing
    m = nvme.ExtentMap(ns, first_lba=first)
    sizes = [3 * mt + ls, 5 * ls, mt, 7 * 1000 + 3]   # last one not LBA-sized
    exts = m.bind_run([(f"t{i}", s) for i, s in enumerate(sizes)])
    assert exts[0].lba == first
    for a, b in zip(exts, exts[1:]):
        assert b.lba == a.lba + a.blocks                   # start(n+1) = start(n) + blocks(n)
    m.check()
    span = exts[-1].end_lba * ls - exts[0].offset
    data = rbytes(span)
    ns.reset_stats()
    assert ns.write(data, exts[0].offset) == span          # one write over all four
    st = ns.stats()
    assert st["commands"] == -(-span // mt)                # split at max_transfer
    assert st["max_inflight"] > 1
    assert st["submits"] < st["commands"]                  # many commands per submit
    # each extent on its own, and a read that straddles a boundary
    for e in exts:
        got = np.zeros(e.length, np.uint8)
        assert m.read(e.key, got) == e.length
        o = e.offset - exts[0].offset
        assert np.array_equal(got, data[o:o + e.length])
    b = exts[1]
    got = np.zeros(4 * ls, np.uint8)
    ns.read(got, b.offset - 2 * ls)
    o = b.offset - 2 * ls - exts[0].offset
    assert np.array_equal(got, data[o:o + 4 * ls])
    whole = np.zeros(span, np.uint8)
    ns.read(whole, exts[0].offset)
    assert np.array_equal(whole, data)


def test_end_of_claimed_range(rbytes):
    for serial in DATA_SERIALS:
        info = nvme.identify(dev(serial))
        ls, total = info["lba_size"], info["nr_lbas"]
        first, count = total - 300, 300                  # the last 300 LBAs
        with nvme.open(dev(serial), first_lba=first, nr_lbas=count, force=True) as n:
            assert (n.first_lba, n.nr_lbas) == (first, count)
            tail = rbytes(40 * ls)
            off = (first + count - 40) * ls
            assert n.write(tail, off) == tail.nbytes
            got = np.zeros_like(tail)
            n.read(got, off)
            assert np.array_equal(got, tail)
            for bad in (off + ls, (first - 1) * ls):       # one past the end, one before
                with pytest.raises(nvme.NvmeError) as ei:
                    n.read(np.zeros(40 * ls, np.uint8), bad)
                assert ei.value.errno == errno.ERANGE and "claimed range" in str(ei.value)
            with pytest.raises(nvme.NvmeError) as ei:
                n.write(np.zeros(ls, np.uint8), (first + count) * ls)
            assert ei.value.errno == errno.ERANGE
            # the data in front of the claimed range was never touched
        with nvme.open(dev(serial), force=True) as n:
            got = np.zeros(40 * ls, np.uint8)
            n.read(got, (first + count - 40) * ls)
            assert np.array_equal(got, tail)


def test_alignment_errors(ns):
    ls = ns.lba_size
    for buf, off in ((np.zeros(ls, np.uint8), ls // 2), (np.zeros(ls + 1, np.uint8), 0)):
        with pytest.raises(nvme.NvmeError) as ei:
            ns.read(buf, off)
        assert ei.value.errno == errno.EINVAL and "LBA size" in str(ei.value)


def test_unaligned_memory(ns, rbytes):
    """Buffers not page aligned (the kernel may need one more segment per command)."""
    n = 4 * ns.info["max_transfer"] + 8 * ns.lba_size
    src = _aligned(n, shift=512)
    src[:] = rbytes(n)
    ns.write(src, 64 * ns.lba_size)
    dst = _aligned(n, shift=64)
    dst[:] = 0
    ns.read(dst, 64 * ns.lba_size)
    assert np.array_equal(src, dst)


def test_fixed_buffers(ns, rbytes):
    assert ns.info["features"]["fixed_buffers"], "kernel 6.12 has IORING_URING_CMD_FIXED"
    n = 2 * MiB
    buf = _aligned(n)
    buf[:] = rbytes(n)
    ns.register_buffer(buf)
    try:
        ns.reset_stats()
        ns.write(buf, 0)
        out = _aligned(n)
        ns.register_buffer(out)
        out[:] = 0
        ns.read(out, 0)
        st = ns.stats()
        assert st["fixed_commands"] == st["commands"] > 0
        assert np.array_equal(buf, out)
        ns.unregister_buffer(out)
        ns.reset_stats()
        ns.read(out, 0)                        # no longer fixed
        assert ns.stats()["fixed_commands"] == 0
    finally:
        ns.unregister_buffer(buf)


def test_no_fixed_buffers_flag():
    with nvme.open(dev("phx0000"), force=True, fixed_buffers=False) as n:
        assert not n.info["features"]["fixed_buffers"]
        with pytest.raises(nvme.NvmeError) as ei:
            n.register_buffer(_aligned(4096))
        assert ei.value.errno == errno.EOPNOTSUPP


def test_parallel_threads(rbytes):
    """Four threads on one handle (two queues), each on its own extent, plus a batch."""
    with nvme.open(dev("phx0000"), force=True, nr_queues=2) as n:
        m = nvme.ExtentMap(n, first_lba=2048)
        size = 3 * MiB + 4096
        exts = m.bind_run([(i, size) for i in range(4)])
        datas = [rbytes(e.length) for e in exts]
        errs = []

        def work(i):
            try:
                for _ in range(3):
                    m.write(i, datas[i])
                    got = np.zeros(exts[i].length, np.uint8)
                    m.read(i, got)
                    assert np.array_equal(got, datas[i]), f"thread {i}"
            except BaseException as e:   # noqa: BLE001
                errs.append(e)
        ts = [threading.Thread(target=work, args=(i,)) for i in range(4)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        assert not errs, errs
        outs = [np.zeros(e.length, np.uint8) for e in exts]
        assert n.read_batch([(o, e.offset) for o, e in zip(outs, exts)]) == [e.length for e in exts]
        for o, d in zip(outs, datas):
            assert np.array_equal(o, d)
        m.destroy()


# ---------------------------------------------------------------------------
# extents: invariants after allocate / free / allocate; TRIM on free and destroy
# ---------------------------------------------------------------------------

def test_extent_invariants_and_reuse(ns, rbytes):
    ls = ns.lba_size
    m = nvme.ExtentMap(ns, first_lba=512)
    a = m.bind_run([(f"a{i}", 40 * KiB) for i in range(6)])
    m.check()
    datas = {e.key: rbytes(e.length) for e in a}
    for e in a:
        m.write(e.key, datas[e.key])
    m.free("a1")
    m.free("a2")                               # one hole of 2 extents (coalesced)
    assert m.holes == [(a[1].lba, a[1].blocks + a[2].blocks)]
    m.check()
    b = m.bind_run([("b0", 30 * KiB), ("b1", 40 * KiB)])      # fits the hole: reused
    assert b[0].lba == a[1].lba and b[1].lba == b[0].end_lba
    c = m.bind_run([("c0", 64 * KiB), ("c1", 64 * KiB)])      # does not fit: tail
    assert c[0].lba == a[-1].end_lba and c[1].lba == c[0].end_lba
    m.check()
    for e in b + c:
        datas[e.key] = rbytes(e.length)
        m.write(e.key, datas[e.key])
    for e in m.extents():                      # neighbours of reused space intact
        got = np.zeros(e.length, np.uint8)
        m.read(e.key, got)
        assert np.array_equal(got, datas[e.key]), e.key
    m.free("c1")                               # freeing the last one shrinks the tail
    assert m.tail == c[0].end_lba
    ns.reset_stats()
    m.destroy()
    st = ns.stats()
    assert st["dsm_commands"] >= 1 and st["deallocated_bytes"] == (c[1].end_lba - 512) * ls
    with pytest.raises(ValueError):
        m.bind("x", 1)


def test_extent_map_space():
    with nvme.open(dev("phx0000"), first_lba=100, nr_lbas=64, force=True) as n:
        m = nvme.ExtentMap(n)
        m.bind("x", 60 * 4096)
        with pytest.raises(nvme.NvmeError) as ei:
            m.bind("y", 5 * 4096)
        assert ei.value.errno == errno.ENOSPC
        with pytest.raises(nvme.NvmeError):
            nvme.ExtentMap(n, first_lba=10)      # outside the claimed range


def _discard_honoured() -> bool:
    """run_guest.py attached the drives with discard=unmap (see its docstring)."""
    try:
        with open("/proc/cmdline") as f:
            return "phx.nvme_discard=unmap" in f.read().split()
    except OSError:
        return False


def test_deallocate_reads_as_reported(ns, rbytes):
    """DLFEAT says what deallocated blocks read as; check QEMU keeps its word."""
    info = ns.info
    ls = ns.lba_size
    off, n = 4096 * ls, 512 * KiB
    ns.write(rbytes(n), off)
    ns.reset_stats()
    ns.deallocate(off + ls, n - 2 * ls)          # leave one written block either side
    st = ns.stats()
    assert st["dsm_commands"] == 1 and st["write_zeroes_commands"] == 0
    got = np.zeros(n, np.uint8)
    ns.read(got, off)
    inner = got[ls:n - ls]
    print(f"{ns.path}: DLFEAT {info['dlfeat']:#x} ({info['deallocated_reads']}), "
          f"deallocated range reads as zeroes: {not inner.any()}")
    assert got[:ls].any() and got[n - ls:].any()  # neighbours untouched
    if info["deallocated_reads"] == "zeroes" and _discard_honoured():
        assert not inner.any()
    elif info["deallocated_reads"] == "ones" and _discard_honoured():
        assert (inner == 0xff).all()


def test_write_zeroes_fallback(rbytes):
    with nvme.open(dev("phx0001"), force=True, dsm=False) as n:
        off, size = 200 * KiB, 300 * KiB
        n.write(rbytes(size), off)
        n.reset_stats()
        n.deallocate(off, size)
        st = n.stats()
        assert st["dsm_commands"] == 0 and st["write_zeroes_commands"] >= 1
        got = np.ones(size, np.uint8)
        n.read(got, off)
        assert not got.any()                     # Write Zeroes always reads back zero
        n.write(rbytes(size), off)
        n.write_zeroes(off, size)
        n.read(got, off)
        assert not got.any()
        n.flush()


# ---------------------------------------------------------------------------
# refusals and errors
# ---------------------------------------------------------------------------

def _blk(serial: str) -> str:
    return "/dev/" + nvme.identify(dev(serial))["block_device"]


def _wipe(serial: str) -> None:
    """Zero the first and the last MiB, where signatures live (GPT keeps a backup at the end)."""
    with nvme.open(dev(serial), force=True) as n:
        n.write_zeroes(0, 1 * MiB)
        n.write_zeroes(n.end - 1 * MiB, 1 * MiB)


def _rereadpt(blk: str) -> None:
    fd = os.open(blk, os.O_RDONLY)
    try:
        fcntl.ioctl(fd, 0x125F)                  # BLKRRPART: the kernel rereads the table
    finally:
        os.close(fd)


def _names(d: str, where) -> list[str]:
    """The namespace under three names: its /dev node, a mknod of its number, a symlink.

    libphx must find the block device from the device number, so every name
    gets the same checks and the same answers.
    """
    mine = os.path.join(str(where), "mydisk")
    os.mknod(mine, stat.S_IFCHR | 0o600, os.stat(d).st_rdev)
    link = os.path.join(str(where), "link")
    os.symlink(mine, link)
    return [d, mine, link]


def _refused(names: list[str], blk: str, err: int, text: str) -> None:
    """open() and check() refuse every name (check() the block device too), naming it."""
    for p in names:
        with pytest.raises(nvme.NvmeError) as ei:
            nvme.open(p)
        m = str(ei.value)
        assert ei.value.errno == err and text in m and blk in m, (p, m)
        assert not nvme.probe([p])[0]["usable"], p
    for p in names + [blk]:
        with pytest.raises(nvme.NvmeError) as ei:
            nvme.check(p)
        assert ei.value.errno == err and text in str(ei.value), (p, str(ei.value))
    print(f"refused ({errno.errorcode[err]}): {m}")


def test_renamed_node_is_the_same_namespace(tmp_path):
    d = dev("phx0002")
    want = nvme.identify(d)
    for p in _names(d, tmp_path) + ["/dev/" + want["block_device"]]:
        got = nvme.identify(p)
        assert (got["serial"], got["nsid"], got["block_device"]) == \
            (want["serial"], want["nsid"], want["block_device"]), p


def test_refuses_filesystems_and_mounts(tmp_path, rbytes):
    d, blk = dev("phx0002"), _blk("phx0002")
    names = _names(d, tmp_path)
    _wipe("phx0002")
    for p in names + [blk]:
        nvme.check(p)                            # clean: usable under every name
    for mkfs, name in ((["mkfs.ext4", "-q", "-F", "-E", "nodiscard"], "ext4"),
                       (["mkfs.xfs", "-q", "-f", "-K"], "xfs")):
        subprocess.run(mkfs + [blk], check=True, capture_output=True)
        _refused(names, blk, errno.EEXIST, name)
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    subprocess.run(["mount", blk, str(mnt)], check=True)
    try:
        _refused(names, blk, errno.EBUSY, "is mounted at")
    finally:
        subprocess.run(["umount", str(mnt)], check=True)
    with nvme.open(names[1], force=True) as n:   # force overrides a signature
        assert n.info["features"]["exclusive"] is False
    # Passthrough writes bypass the block device's page cache.  While another
    # process holds the block device open (so the kernel keeps its cache),
    # its cached superblock goes stale when the namespace is wiped through
    # passthrough: the check must read the namespace, not those pages.
    subprocess.run(["mkfs.ext4", "-q", "-F", "-E", "nodiscard", blk], check=True,
                   capture_output=True)
    keep = os.open(blk, os.O_RDONLY)             # not O_EXCL: claiming still works
    try:
        assert os.pread(keep, 2, 1080) == b"\x53\xef"   # ext4's magic, now cached
        _wipe("phx0002")
        for p in names + [blk]:
            nvme.check(p)
        # and the check leaves none of the pages it read behind to go stale
        # under the handle's own writes
        mark = rbytes(4096)
        with nvme.open(d) as n:
            n.write(mark, 0)
        assert os.pread(keep, 4096, 0) == mark.tobytes()
    finally:
        os.close(keep)
    _wipe("phx0002")
    for p in names:
        with nvme.open(p) as n:                  # clean again: claimed, and held O_EXCL
            assert n.info["features"]["exclusive"]
            with pytest.raises(OSError) as ei:   # so nothing can mount it meanwhile
                os.close(os.open(blk, os.O_RDONLY | os.O_EXCL))
            assert ei.value.errno == errno.EBUSY
        os.close(os.open(blk, os.O_RDONLY | os.O_EXCL))   # released on close


def test_refuses_partition_tables(tmp_path):
    d, blk = dev("phx0002"), _blk("phx0002")
    names = _names(d, tmp_path)
    _wipe("phx0002")
    mbr = np.zeros(4096, np.uint8)
    e = 446
    mbr[e + 4] = 0x83                            # one Linux partition, LBA 2048, 8 MiB
    mbr[e + 8:e + 12] = np.frombuffer((2048).to_bytes(4, "little"), np.uint8)
    mbr[e + 12:e + 16] = np.frombuffer((16384).to_bytes(4, "little"), np.uint8)
    mbr[510], mbr[511] = 0x55, 0xAA
    with nvme.open(d, force=True) as n:
        n.write(mbr, 0)
    _refused(names, blk, errno.EEXIST, "dos partition table")
    _rereadpt(blk)
    try:
        assert os.path.exists(blk + "p1")        # the kernel sees the partition
        _refused(names, blk, errno.EBUSY, "partition(s)")
    finally:
        _wipe("phx0002")
        _rereadpt(blk)
    assert not os.path.exists(blk + "p1")
    # GPT, written through passthrough (the kernel is not told): libblkid finds it
    with nvme.open(d, force=True) as n:
        head, tail = _gpt(n.lba_size, n.end // n.lba_size)
        n.write(head, 0)
        n.write(tail, n.end - len(tail))
    try:
        _refused(names, blk, errno.EEXIST, "gpt partition table")
        with nvme.open(d, force=True) as n:      # the primary copy (and the protective
            n.write_zeroes(0, 1 * MiB)           # MBR) wiped: the backup at the end counts
        _refused(names, blk, errno.EEXIST, "gpt partition table")
    finally:
        _wipe("phx0002")
    nvme.check(d)


def _gpt(lba: int, nr_lbas: int) -> tuple[np.ndarray, np.ndarray]:
    """A GPT with one 8 MiB Linux partition (UEFI layout): (LBAs 0.., the last LBAs)."""
    entries = bytearray(128 * 128)
    entries[0:16] = uuid.UUID("0fc63daf-8483-4772-8e79-3d69d8477de4").bytes_le  # Linux fs
    entries[16:32] = uuid.uuid4().bytes_le
    first = (1 * MiB) // lba
    entries[32:56] = struct.pack("<QQQ", first, first + 8 * MiB // lba - 1, 0)
    entries[56:62] = "phx".encode("utf-16-le")
    ne = -(-len(entries) // lba)                 # LBAs the entry array takes
    entries += bytes(ne * lba - len(entries))
    last, disk = nr_lbas - 1, uuid.uuid4().bytes_le
    ecrc = zlib.crc32(entries[:128 * 128])

    def header(me: int, alt: int, at: int) -> bytes:
        h = struct.pack("<8sIIIIQQQQ16sQIII", b"EFI PART", 0x10000, 92, 0, 0, me, alt,
                        2 + ne, last - 1 - ne, disk, at, 128, 128, ecrc)
        h = h[:16] + struct.pack("<I", zlib.crc32(h)) + h[20:]
        return h + bytes(lba - len(h))
    pmbr = bytearray(lba)
    pmbr[446:462] = bytes([0, 0, 2, 0, 0xEE, 0xFF, 0xFF, 0xFF]) + \
        struct.pack("<II", 1, min(nr_lbas - 1, 0xFFFFFFFF))
    pmbr[510:512] = b"\x55\xaa"
    head = bytes(pmbr) + header(1, last, 2) + bytes(entries)
    tail = bytes(entries) + header(last, 1, last - ne)
    return np.frombuffer(head, np.uint8).copy(), np.frombuffer(tail, np.uint8).copy()


def test_refuses_unclaimable_block_device(tmp_path):
    """No block device found, no node for it, or no O_EXCL open: refused unless forced."""
    d, blk = dev("phx0002"), _blk("phx0002")
    names = _names(d, tmp_path)
    _wipe("phx0002")
    nvme.check(d)

    def forced_ok(p):
        with nvme.open(p, force=True) as n:
            assert n.read(np.zeros(4096, np.uint8), 0) == 4096
            assert n.info["features"]["exclusive"] is False

    # claimed by someone else (O_EXCL, as a mount or a driver would)
    fd = os.open(blk, os.O_RDONLY | os.O_EXCL)
    try:
        _refused(names, blk, errno.EBUSY, "cannot claim it exclusively")
        forced_ok(names[1])
    finally:
        os.close(fd)
    # the block device's node is missing, then another device's node has its name
    away = blk + ".away"
    os.rename(blk, away)
    try:
        for p in names:
            with pytest.raises(nvme.NvmeError) as ei:
                nvme.open(p)
            assert ei.value.errno == errno.ENOENT and "no device node " + blk in \
                str(ei.value), str(ei.value)
        forced_ok(names[1])
        os.mknod(blk, stat.S_IFBLK | 0o600, os.stat(_blk("phx0000")).st_rdev)
        try:
            for p in names:
                with pytest.raises(nvme.NvmeError) as ei:
                    nvme.open(p)
                assert ei.value.errno == errno.ENOENT and f"{blk} is not block device" in \
                    str(ei.value), str(ei.value)
            forced_ok(names[1])
        finally:
            os.unlink(blk)
    finally:
        os.rename(away, blk)
    nvme.check(d)
    # the block device cannot be found: sysfs's /sys/dev/char hidden (as a
    # container may), in a private mount namespace
    empty = tmp_path / "empty"
    empty.mkdir()
    code = ("import errno, sys, phx.nvme as n\n"
            "p = sys.argv[1]\n"
            "try:\n    n.open(p).close(); print('OPENED')\n"
            "except OSError as e:\n    print(errno.errorcode[e.errno], e)\n"
            "with n.open(p, force=True) as ns:\n    print('FORCED', ns.info['block_device'])\n")
    for p in names:
        r = subprocess.run(["unshare", "-m", "sh", "-c",
                            f'mount --bind {empty} /sys/dev/char && exec "$0" -c "$1" "$2"',
                            sys.executable, code, p], capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
        assert r.stdout.startswith("ENODEV ") and \
            "cannot find the namespace's block device" in r.stdout, r.stdout
        assert "FORCED" in r.stdout, r.stdout
    print(r.stdout)
    # no permission on the block device: a process that may open the char
    # device but not the block device (root without capabilities, the block
    # device's node at mode 0) gets EACCES
    mode = os.stat(blk).st_mode
    os.chmod(blk, 0)
    try:
        for p in names:
            r = subprocess.run(["setpriv", "--inh-caps=-all", "--ambient-caps=-all",
                                "--bounding-set=-all", "--", sys.executable, "-c", code, p],
                               capture_output=True, text=True)
            assert r.returncode == 0, r.stderr
            assert r.stdout.startswith("EACCES ") and "cannot claim it exclusively" in \
                r.stdout and blk in r.stdout, r.stdout
            assert "FORCED" in r.stdout, r.stdout
    finally:
        os.chmod(blk, stat.S_IMODE(mode))
    print(r.stdout)


def _blkid_finds(blk: str) -> str:
    """What util-linux's blkid -p says about @blk ('' for nothing), caches flushed."""
    subprocess.run(["blockdev", "--flushbufs", blk], check=True)
    r = subprocess.run(["blkid", "-p", "-o", "export", blk], capture_output=True, text=True)
    return r.stdout if r.returncode == 0 else ""


def test_raw_namespace_is_accepted(tmp_path, rbytes):
    """Zeroed, then random first and last MiBs: no signature, so claimed without force."""
    d, blk = dev("phx0002"), _blk("phx0002")
    names = _names(d, tmp_path)
    _wipe("phx0002")
    for p in names:
        with nvme.open(p) as n:
            assert n.info["features"]["exclusive"]
    with nvme.open(d, force=True) as n:
        n.write(rbytes(1 * MiB), 0)
        n.write(rbytes(1 * MiB), n.end - 1 * MiB)
    other = _blkid_finds(blk)
    for p in names + [blk]:
        if other:                                # 2 bytes of random data can look like a
            with pytest.raises(nvme.NvmeError):  # magic: then libphx must agree with blkid
                nvme.check(p)
        else:
            nvme.check(p)
    print(f"random data: blkid -p found {other!r}")
    _wipe("phx0002")


def test_bad_paths(tmp_path):
    cases = [(_blk("phx0000"), errno.ENOTTY, "block device"),
             ("/dev/null", errno.ENOTTY, "not an NVMe namespace"),
             (str(tmp_path / "missing"), errno.ENOENT, "")]
    ctrl = "/dev/" + os.path.basename(
        os.path.realpath(f"/sys/class/nvme-generic/{os.path.basename(dev('phx0000'))}/device"))
    if os.path.exists(ctrl) and ctrl.startswith("/dev/nvme"):
        cases.append((ctrl, errno.ENOTTY, ""))
    for path, err, text in cases:
        with pytest.raises(OSError) as ei:
            nvme.open(path, force=True)
        assert ei.value.errno == err and text in str(ei.value), (path, str(ei.value))


def test_bad_ranges_and_modes(rbytes):
    d = dev("phx0000")
    total = nvme.identify(d)["nr_lbas"]
    for kw in ({"first_lba": total}, {"first_lba": total - 10, "nr_lbas": 11}):
        with pytest.raises(nvme.NvmeError) as ei:
            nvme.open(d, force=True, **kw)
        assert ei.value.errno == errno.ERANGE, kw
    with nvme.open(d, force=True, readonly=True) as n:
        n.read(np.zeros(4096, np.uint8), 0)
        for call in (lambda: n.write(np.zeros(4096, np.uint8), 0),
                     lambda: n.deallocate(0, 4096)):
            with pytest.raises(nvme.NvmeError) as ei:
                call()
            assert ei.value.errno == errno.EBADF
    n = nvme.open(d, force=True)
    n.close()
    with pytest.raises(ValueError):
        n.read(np.zeros(4096, np.uint8), 0)


def test_controller_rejects_with_status():
    """Past the namespace's end (libphx's own check disabled): the controller says no."""
    d = dev("phx0000")
    total = nvme.identify(d)["nr_lbas"]
    n = nvme.Namespace(d, force=True, nr_lbas=total + 1024, _no_capacity_check=True)
    try:
        with pytest.raises(nvme.NvmeError) as ei:
            n.read(np.zeros(8192, np.uint8), (total - 1) * 4096)
        e = ei.value
        assert e.status == 0x080 and e.errno == errno.ERANGE
        assert "NVMe status 0x080 (LBA Out of Range)" in str(e), str(e)
        assert n.stats()["errors"] == 1
        n.read(np.zeros(4096, np.uint8), (total - 1) * 4096)     # the handle still works
    finally:
        n.close()
    assert nvme.status_str(0x281) == "Unrecovered Read Error"


def test_probe_lists_namespaces():
    _wipe("phx0002")
    got = {p["name"]: p for p in nvme.probe()}
    assert set(NS.values()) <= set(got)
    for p in got.values():
        assert isinstance(p["usable"], bool) and p["reason"]
        print(p)


# ---------------------------------------------------------------------------
# phx.kv on a namespace
# ---------------------------------------------------------------------------

def test_kv_store_on_nvme(tmp_path, rbytes):
    from phx.kv import KVStore
    from phx.kv.nvme_backend import NvmeBackend, from_env
    for serial in DATA_SERIALS:
        be = NvmeBackend(dev(serial), first_lba=4096, force=True)
        with KVStore(str(tmp_path / serial), mode="direct", direct_backend=be) as st:
            shape = (20, 3, 50)                  # 300-byte rows: not LBA multiples
            ts = [st.allocate(L, shape, np.float16) for L in range(3)]
            st.plan()
            exts = [t.extent for pair in ts for t in pair]
            assert exts[0].start == 4096 * be.alignment
            for a, b in zip(exts, exts[1:]):
                assert b.start == a.end                     # sequential LBAs
            ref = {}
            for pair in ts:
                for t in pair:
                    arr = rbytes(t.nbytes).view(np.float16).reshape(shape)
                    st.write(t, 0, arr[:7])
                    st.write_async(t, 7, arr[7:12]).result()
                    st.write(t, 12, arr[12:])
                    ref[t.id] = arr
            for pair in ts:
                for t in pair:                   # bytes: random halves hold NaNs
                    assert st.read(t).tobytes() == ref[t.id].tobytes()
                    assert st.read(t, 3, 9).tobytes() == ref[t.id][3:9].tobytes()
            st.free(ts[0][0])
        assert be.ns.closed
    os.environ["PHX_KV_NVME"] = f"{dev('phx0000')},first_lba=8192,force=1"
    try:
        b = from_env()
        assert b is not None and b.ns.first_lba == 8192
        b.close()
    finally:
        del os.environ["PHX_KV_NVME"]
    assert from_env() is None


# ---------------------------------------------------------------------------
# a namespace that disappears (last: it removes phx0002's controller)
# ---------------------------------------------------------------------------

def test_zz_device_disappears(rbytes):
    d = dev("phx0002")
    ng = os.path.basename(d)
    pci = os.path.realpath(f"/sys/class/nvme-generic/{ng}/device/device")
    assert os.path.exists(pci + "/remove"), pci
    _wipe("phx0002")
    n = nvme.open(d)
    try:
        n.write(rbytes(64 * KiB), 0)
        with open(pci + "/remove", "w") as f:
            f.write("1\n")
        for _ in range(100):
            if not os.path.exists(d):
                break
            time.sleep(0.05)
        with pytest.raises(OSError) as ei:
            n.read(np.zeros(64 * KiB, np.uint8), 0)
        assert ei.value.errno == errno.ENODEV and "disappeared" in str(ei.value), str(ei.value)
        print(str(ei.value))
    finally:
        n.close()
    assert not [p for p in nvme.probe() if p["name"] == d]
