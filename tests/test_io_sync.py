"""Synchronous pread/pwrite, byte for byte against os.pread/os.pwrite.

Every case uses fresh random data, sizes around the block size (1 B, 4095,
4096 +- 1, 1 MiB + 7) at aligned and unaligned file offsets and memory
addresses, on the real disk and (as root) on loop-mounted xfs and ext4.
Buffers are surrounded by random canaries: the engine must not write outside
the bytes it was given, whatever path (direct, bounce) it took.
"""
from __future__ import annotations

import fcntl
import os

import pytest

import phx
from conftest import MiB, assert_same, buf_address, fresh_bytes, write_file

SIZES = [1, 4095, 4096, 4097, 1 * MiB + 7]
OFFSETS = [0, 1, 511, 4095, 4096, 4097, 123_456_789]
MISALIGN = [0, 1, 7]
PAD = 8192


def sparse_file(path, rng, offset, size, tail=PAD, head=PAD):
    """A file of offset+size+tail bytes; random data in [offset-head, offset+size+tail)."""
    start = max(0, offset - head)
    data = fresh_bytes(rng, offset + size + tail - start)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.ftruncate(fd, offset + size + tail)
        os.pwrite(fd, data, start)
    finally:
        os.close(fd)
    return start, data


def os_pread(path, n, off):
    fd = os.open(path, os.O_RDONLY)
    try:
        out = bytearray()
        while len(out) < n:
            chunk = os.pread(fd, n - len(out), off + len(out))
            if not chunk:
                break
            out += chunk
        return bytes(out)
    finally:
        os.close(fd)


def guarded(rng, n, misalign):
    """(whole, view): an aligned buffer full of random canary bytes and the
    n-byte window at +misalign inside it."""
    whole = phx.empty_aligned(n + misalign + 4096)
    canary = fresh_bytes(rng, len(whole))
    memoryview(whole)[:] = canary
    view = memoryview(whole)[misalign:misalign + n]
    assert buf_address(view) % 4096 == misalign
    return whole, view, canary


def check_canary(whole, canary, misalign, n):
    mv = memoryview(whole)
    assert_same(mv[:misalign], canary[:misalign], "bytes before the buffer")
    assert_same(mv[misalign + n:], canary[misalign + n:], "bytes after the buffer")


@pytest.mark.parametrize("misalign", MISALIGN)
@pytest.mark.parametrize("offset", OFFSETS)
@pytest.mark.parametrize("size", SIZES)
def test_pread_matches_os_pread(fs_dir, rng, size, offset, misalign):
    path = os.path.join(fs_dir, "r")
    sparse_file(path, rng, offset, size)
    expected = os_pread(path, size, offset)
    whole, view, canary = guarded(rng, size, misalign)
    with phx.open(path, "r") as f:
        n = f.pread(view, offset)
    assert n == size
    assert_same(view, expected, f"pread({size} @ {offset}, mem +{misalign})")
    check_canary(whole, canary, misalign, size)


@pytest.mark.parametrize("misalign", MISALIGN)
@pytest.mark.parametrize("offset", OFFSETS)
@pytest.mark.parametrize("size", SIZES)
def test_pwrite_in_place_keeps_neighbours(fs_dir, rng, size, offset, misalign):
    """Writing into the middle of existing data changes exactly those bytes
    (the partial blocks around them are read-modify-written correctly)."""
    path = os.path.join(fs_dir, "w")
    start, before = sparse_file(path, rng, offset, size)
    total = offset + size + PAD
    new = fresh_bytes(rng, size)
    whole, view, canary = guarded(rng, size, misalign)
    view[:] = new
    with phx.open(path, "r+") as f:
        n = f.pwrite(view, offset)
    assert n == size
    assert os.stat(path).st_size == total
    rel = offset - start
    expected = before[:rel] + new + before[rel + size:]
    assert_same(os_pread(path, total - start, start), expected,
                f"file after pwrite({size} @ {offset}, mem +{misalign})")
    # The source buffer is untouched, canaries included.
    assert_same(view, new, "source buffer")
    check_canary(whole, canary, misalign, size)


@pytest.mark.parametrize("misalign", [0, 7])
@pytest.mark.parametrize("offset", OFFSETS)
@pytest.mark.parametrize("size", SIZES)
def test_pwrite_extends_file(fs_dir, rng, size, offset, misalign):
    """A write past the end leaves size = offset + len, the old prefix intact
    and (where a hole opened) zeros between, exactly like os.pwrite."""
    path = os.path.join(fs_dir, "x")
    prefix_len = min(offset, 5000)  # old contents end at or before the offset
    prefix = fresh_bytes(rng, prefix_len)
    write_file(path, prefix)
    new = fresh_bytes(rng, size)
    whole, view, canary = guarded(rng, size, misalign)
    view[:] = new
    with phx.open(path, "r+") as f:
        assert f.pwrite(view, offset) == size
        assert f.size == offset + size
    assert os.stat(path).st_size == offset + size
    assert_same(os_pread(path, prefix_len, 0), prefix, "old contents before the write")
    # The hole (if any) reads as zeros: check its first and last 64 KiB.
    hole = offset - prefix_len
    for lo in {prefix_len, offset - min(hole, 65536)}:
        n = min(hole, 65536)
        assert_same(os_pread(path, n, lo), bytes(n), f"hole at {lo}")
    assert_same(os_pread(path, size, offset), new, f"data of extending pwrite({size} @ {offset})")


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("mode", ["w", "w+", "x", "x+"])
def test_pwrite_new_file(data_dir, rng, mode, size):
    path = os.path.join(data_dir, "new")
    data = fresh_bytes(rng, size)
    with phx.open(path, mode) as f:
        assert f.pwrite(data, 0) == size
    assert os.stat(path).st_size == size
    with open(path, "rb") as g:
        assert_same(g.read(), data, "new file")


# ---- end of file -------------------------------------------------------------

EOF_FILE_SIZES = [1, 4095, 4096, 4097, 1 * MiB + 7]


@pytest.mark.parametrize("fsize", EOF_FILE_SIZES)
def test_pread_past_eof_short_count(fs_dir, rng, fsize):
    """Reads across, at and after EOF return what os.pread returns (0 after)."""
    path = os.path.join(fs_dir, "eof")
    data = fresh_bytes(rng, fsize)
    write_file(path, data)
    cases = []
    for off in sorted({0, 1, fsize - 1, fsize, fsize + 1, fsize + 4096, max(0, fsize - 4097)}):
        for ln in (1, 4096, 8192, 1 * MiB + 7):
            cases.append((off, ln))
    with phx.open(path, "r") as f:
        for off, ln in cases:
            for mis in (0, 3):
                whole, view, canary = guarded(rng, ln, mis)
                n = f.pread(view, off)
                expect = data[off:off + ln]
                assert n == len(expect), f"pread({ln} @ {off}) of a {fsize}-byte file"
                assert_same(view[:n], expect, f"pread({ln} @ {off})")
                # Bytes past the short count are not the caller's business, but
                # nothing outside the buffer may change.
                check_canary(whole, canary, mis, ln)


def test_pread_empty_file_and_zero_length(data_dir, rng):
    path = os.path.join(data_dir, "empty")
    write_file(path, b"")
    with phx.open(path, "r") as f:
        assert f.size == 0
        assert f.pread(bytearray(4096), 0) == 0
        assert f.pread(bytearray(1), 12345) == 0
        assert f.pread(bytearray(0), 0) == 0
    with phx.open(path, "r+") as f:
        assert f.pwrite(b"", 100) == 0
    assert os.stat(path).st_size == 0


def test_pread_hole_reads_zeros(data_dir, rng):
    path = os.path.join(data_dir, "hole")
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    tail = fresh_bytes(rng, 100)
    os.pwrite(fd, tail, 3 * MiB + 5)
    os.close(fd)
    buf = bytearray(fresh_bytes(rng, 2 * MiB + 200))
    with phx.open(path, "r") as f:
        n = f.pread(buf, 1 * MiB + 3)
    assert n == 2 * MiB + 102
    assert_same(buf[:n], os_pread(path, n, 1 * MiB + 3), "hole then data")


# ---- 64 MiB --------------------------------------------------------------------

@pytest.mark.parametrize("offset,misalign", [(0, 0), (123_457, 5)])
def test_64mib_read_write(data_dir, rng, offset, misalign):
    size = 64 * MiB
    path = os.path.join(data_dir, "big")
    before = fresh_bytes(rng, offset + size + 4096)
    write_file(path, before)
    whole, view, canary = guarded(rng, size, misalign)
    with phx.open(path, "r") as f:
        assert f.pread(view, offset) == size
    assert_same(view, before[offset:offset + size], f"64 MiB read @ {offset} +{misalign}")
    check_canary(whole, canary, misalign, size)
    del view, whole

    new = fresh_bytes(rng, size)
    whole, view, canary = guarded(rng, size, misalign)
    view[:] = new
    with phx.open(path, "r+") as f:
        assert f.pwrite(view, offset) == size
    expected = before[:offset] + new + before[offset + size:]
    assert os.stat(path).st_size == len(before)
    assert_same(read_all(path), expected, "64 MiB write")


def test_64mib_on_xfs(xfs_dir, rng):
    size = 64 * MiB
    path = os.path.join(xfs_dir, "big")
    data = fresh_bytes(rng, size)
    with phx.open(path, "w+") as f:
        assert f.pwrite(data, 4097) == size
        buf = phx.empty_aligned(size)
        assert f.pread(buf, 4097) == size
    assert_same(buf, data, "xfs 64 MiB readback")
    assert os.stat(path).st_size == size + 4097
    assert_same(os_pread(path, size, 4097), data, "xfs 64 MiB via os.pread")


def read_all(path):
    with open(path, "rb") as f:
        return f.read()


# ---- sequences of operations ---------------------------------------------------

def test_random_ops_against_model(fs_dir, rng):
    """300 random preads/pwrites/truncates on one file, checked against a
    model kept with plain bytes after every operation."""
    path = os.path.join(fs_dir, "model")
    model = bytearray(fresh_bytes(rng, 200_000))
    write_file(path, bytes(model))
    with phx.open(path, "r+") as f:
        for i in range(300):
            op = rng.integers(0, 10)
            off = int(rng.integers(0, 300_000))
            ln = int(rng.choice([1, 511, 512, 4095, 4096, 4097, int(rng.integers(1, 70_000))]))
            if op < 4:
                buf = bytearray(fresh_bytes(rng, ln))
                n = f.pread(buf, off)
                exp = bytes(model[off:off + ln])
                assert n == len(exp), f"op {i}: pread({ln} @ {off})"
                assert_same(buf[:n], exp, f"op {i}: pread({ln} @ {off})")
            elif op < 9:
                data = fresh_bytes(rng, ln)
                assert f.pwrite(data, off) == ln, f"op {i}"
                if off > len(model):
                    model.extend(bytes(off - len(model)))
                model[off:off + ln] = data
            else:
                size = int(rng.integers(0, 300_000))
                f.truncate(size)
                if size < len(model):
                    del model[size:]
                else:
                    model.extend(bytes(size - len(model)))
            assert f.size == len(model), f"op {i}: size"
    assert_same(read_all(path), bytes(model), "final file")


# ---- file object ---------------------------------------------------------------

def test_file_attributes(data_dir, rng):
    path = os.path.join(data_dir, "attrs")
    data = fresh_bytes(rng, 10_000)
    write_file(path, data)
    with phx.open(path, "r+") as f:
        assert isinstance(f, phx.File)
        assert os.fspath(f.path) == path
        assert f.direct is True
        assert f.size == 10_000
        fd = f.fileno()
        assert isinstance(fd, int) and fd >= 0
        assert os.fstat(fd).st_ino == os.stat(path).st_ino
        assert os.O_DIRECT & fcntl.fcntl(fd, fcntl.F_GETFL)
        mem_align, off_align = f.alignment
        for a in (mem_align, off_align):
            assert isinstance(a, int) and a >= 1 and (a & (a - 1)) == 0 and a <= 65536
        f.truncate(4097)
        assert f.size == 4097 == os.stat(path).st_size
        f.fsync()
    assert_same(read_all(path), data[:4097], "after truncate")


def test_pathlike_accepted(data_dir, rng):
    import pathlib
    p = pathlib.Path(data_dir) / "pl"
    data = fresh_bytes(rng, 5000)
    with phx.open(p, "w+") as f:
        assert f.pwrite(data, 0) == 5000
        b = bytearray(5000)
        assert f.pread(b, 0) == 5000
    assert_same(b, data)


def test_default_offset_is_zero(data_dir, rng):
    path = os.path.join(data_dir, "d")
    data = fresh_bytes(rng, 8191)
    with phx.open(path, "w+") as f:
        assert f.pwrite(data) == 8191
        b = bytearray(8191)
        assert f.pread(b) == 8191
    assert_same(b, data)


@pytest.mark.parametrize("mode", ["r+", "w+", "x+"])
def test_modes_read_and_write(data_dir, rng, mode):
    path = os.path.join(data_dir, "m")
    if mode == "r+":
        write_file(path, fresh_bytes(rng, 100))
    data = fresh_bytes(rng, 4097)
    with phx.open(path, mode) as f:
        assert f.pwrite(data, 3) == 4097
        b = bytearray(4097)
        assert f.pread(b, 3) == 4097
    assert_same(b, data)


def test_mode_w_truncates_and_r_plus_does_not(data_dir, rng):
    path = os.path.join(data_dir, "t")
    old = fresh_bytes(rng, 20_000)
    write_file(path, old)
    with phx.open(path, "r+") as f:
        assert f.size == 20_000
    assert_same(read_all(path), old, "r+ must not truncate")
    with phx.open(path, "w") as f:
        assert f.size == 0
    assert os.stat(path).st_size == 0


def test_direct_false_buffered(data_dir, rng):
    path = os.path.join(data_dir, "b")
    data = fresh_bytes(rng, 3 * 4096 + 5)
    with phx.open(path, "w+", direct=False) as f:
        assert f.direct is False
        assert f.pwrite(data, 11) == len(data)
        b = bytearray(len(data))
        assert f.pread(b, 11) == len(data)
    assert_same(b, data)
    assert_same(os_pread(path, len(data), 11), data)


def test_pread_sees_os_pwrite_and_vice_versa(data_dir, rng):
    """No stale cache anywhere: what one side writes the other reads at once."""
    path = os.path.join(data_dir, "coh")
    write_file(path, fresh_bytes(rng, 64 * 1024))
    fd = os.open(path, os.O_RDWR)
    try:
        with phx.open(path, "r+") as f:
            for off, ln in [(0, 4096), (1, 10), (4095, 2), (7000, 30_000)]:
                a = fresh_bytes(rng, ln)
                os.pwrite(fd, a, off)
                b = bytearray(ln)
                assert f.pread(b, off) == ln
                assert_same(b, a, "phx reads os.pwrite")
                c = fresh_bytes(rng, ln)
                assert f.pwrite(c, off) == ln
                assert_same(os.pread(fd, ln, off), c, "os.pread reads phx pwrite")
    finally:
        os.close(fd)


def test_size_changes_by_others_are_seen(data_dir, rng):
    """Another descriptor truncates or extends the file: phx's reads, short
    counts and f.size follow at once (no cached size)."""
    path = os.path.join(data_dir, "sz")
    data = fresh_bytes(rng, 100_000)
    write_file(path, data)
    with phx.open(path, "r+") as f:
        assert f.size == 100_000
        os.truncate(path, 5000)
        assert f.size == 5000
        b = bytearray(8192)
        assert f.pread(b, 0) == 5000
        assert_same(b[:5000], data[:5000])
        assert f.pread(b, 5000) == 0
        more = fresh_bytes(rng, 20_000)
        fd = os.open(path, os.O_WRONLY)
        os.pwrite(fd, more, 70_000)
        os.close(fd)
        assert f.size == 90_000
        b = bytearray(30_000)
        assert f.pread(b, 65_000) == 25_000
        assert_same(b[:5000], bytes(5000), "hole")
        assert_same(b[5000:25_000], more)


def test_two_engines_same_file(data_dir, rng):
    """Two Files on one path through two engines: each sees the other's writes."""
    path = os.path.join(data_dir, "two")
    write_file(path, fresh_bytes(rng, 1 * MiB))
    a = phx.open(path, "r+", engine=phx.Engine())
    b = phx.open(path, "r+", engine=phx.Engine())
    try:
        for off, ln in [(0, 4096), (3, 77), (4095, 8193), (500_000, 100_000)]:
            x = fresh_bytes(rng, ln)
            assert a.pwrite(x, off) == ln
            got = bytearray(ln)
            assert b.pread(got, off) == ln
            assert_same(got, x, f"engine B sees A's write {ln} @ {off}")
            y = fresh_bytes(rng, ln)
            assert b.pwrite_async(y, off).result(timeout=60) == ln
            assert a.pread_batch([(got, off)]) == [ln]
            assert_same(got, y, f"engine A sees B's write {ln} @ {off}")
    finally:
        a.close()
        b.close()


def test_batch_of_10000(data_dir, rng):
    path = os.path.join(data_dir, "b10k")
    data = fresh_bytes(rng, 4 * MiB)
    write_file(path, data)
    offs = rng.integers(0, 4 * MiB, size=10_000)
    lens = rng.integers(1, 600, size=10_000)
    reqs = [(bytearray(int(n)), int(o)) for o, n in zip(offs, lens)]
    with phx.open(path, "r") as f:
        res = f.pread_batch(reqs)
    assert len(res) == 10_000
    for (b, o), n in zip(reqs, res):
        assert n == len(data[o:o + len(b)])
        assert bytes(b[:n]) == data[o:o + n]


ENGINE_CONFIGS = {
    "default": {},
    "tiny": dict(queue_depth=2, max_io_size=8192, bounce_size=4096, bounce_count=1),
    "small-bounce-many": dict(queue_depth=64, max_io_size=16384, bounce_size=4096, bounce_count=2),
}


@pytest.mark.parametrize("cfg", list(ENGINE_CONFIGS))
def test_random_mixed_ops_against_model(fs_dir, rng, cfg):
    """400 random operations - sync, async and batched reads and writes
    (batches of non-overlapping extents), truncates - through engines with
    tiny chunks and bounce pools, checked against a bytes model."""
    path = os.path.join(fs_dir, "mix")
    model = bytearray(fresh_bytes(rng, 150_000))
    write_file(path, bytes(model))
    eng = phx.Engine(**ENGINE_CONFIGS[cfg])

    def extents(k):
        """k non-overlapping random extents, possibly past the end."""
        cuts = sorted(int(x) for x in rng.integers(0, 260_000, size=2 * k))
        return [(cuts[2 * i], cuts[2 * i + 1] - cuts[2 * i]) for i in range(k)
                if cuts[2 * i + 1] > cuts[2 * i]]

    def apply_write(data, off):
        if off > len(model):
            model.extend(bytes(off - len(model)))
        model[off:off + len(data)] = data

    with phx.open(path, "r+", engine=eng) as f:
        for i in range(400):
            op = int(rng.integers(0, 7))
            if op == 0:  # sync read
                (off, ln), = extents(1) or [(0, 1)]
                b = bytearray(ln)
                n = f.pread(b, off)
                assert n == len(model[off:off + ln]) and b[:n] == model[off:off + n], f"op {i}"
            elif op == 1:  # sync write
                (off, ln), = extents(1) or [(0, 1)]
                d = fresh_bytes(rng, ln)
                assert f.pwrite(d, off) == ln
                apply_write(d, off)
            elif op == 2:  # async read
                (off, ln), = extents(1) or [(0, 1)]
                b = bytearray(ln)
                n = f.pread_async(b, off).result(timeout=60)
                assert n == len(model[off:off + ln]) and b[:n] == model[off:off + n], f"op {i}"
            elif op == 3:  # async writes, several in flight, non-overlapping
                ws = [(fresh_bytes(rng, ln), off) for off, ln in extents(int(rng.integers(1, 6)))]
                futs = [f.pwrite_async(d, off) for d, off in ws]
                assert [x.result(timeout=60) for x in futs] == [len(d) for d, _ in ws], f"op {i}"
                for d, off in ws:
                    apply_write(d, off)
            elif op == 4:  # batch read
                ext = extents(int(rng.integers(1, 9)))
                bufs = [bytearray(ln) for _, ln in ext]
                res = f.pread_batch([(b, off) for b, (off, _) in zip(bufs, ext)])
                for b, (off, ln), n in zip(bufs, ext, res):
                    assert n == len(model[off:off + ln]) and b[:n] == model[off:off + n], f"op {i}"
            elif op == 5:  # batch write
                ws = [(fresh_bytes(rng, ln), off) for off, ln in extents(int(rng.integers(1, 9)))]
                assert f.pwrite_batch(ws) == [len(d) for d, _ in ws], f"op {i}"
                for d, off in ws:
                    apply_write(d, off)
            else:
                size = int(rng.integers(0, 260_000))
                f.truncate(size)
                if size < len(model):
                    del model[size:]
                else:
                    model.extend(bytes(size - len(model)))
            assert f.size == len(model), f"op {i} ({op}): size {f.size} != model {len(model)}"
    assert_same(read_all(path), bytes(model), f"final file ({cfg})")
