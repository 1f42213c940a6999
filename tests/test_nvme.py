"""phx.nvme on the host: what needs no NVMe device.

The extent map and the KV backend run against an in-memory stand-in for a
namespace (same methods, checks alignment and range like libphx); the C
library's argument and device checks run against files that are not
namespaces.  Everything that needs a real /dev/ngXnY is in
tests/guest/nvme/test_nvme_guest.py (make test-guest-nvme).
"""
from __future__ import annotations

import errno
import glob
import os
import random
import stat

import numpy as np
import pytest

nvme = pytest.importorskip("phx.nvme")


class FakeNamespace:
    """Enough of phx.nvme.Namespace, on a bytearray, with libphx's checks."""

    def __init__(self, lba_size=512, first_lba=0, nr_lbas=8192, total=16384):
        self.lba_size, self.first_lba, self.nr_lbas = lba_size, first_lba, nr_lbas
        self.path = "/dev/fake0n1"
        self.mem = bytearray(os.urandom(total * lba_size))
        self.deallocated: list[tuple[int, int]] = []
        self.closed = False
        self.info = {"nr_queues": 2}

    start = property(lambda s: s.first_lba * s.lba_size)
    end = property(lambda s: (s.first_lba + s.nr_lbas) * s.lba_size)

    def _chk(self, off, n):
        if off % self.lba_size or n % self.lba_size:
            raise nvme.NvmeError(errno.EINVAL, "not LBA multiples")
        if off < self.start or off + n > self.end:
            raise nvme.NvmeError(errno.ERANGE, "outside the claimed range")

    def read(self, buf, off):
        mv = memoryview(buf).cast("B")
        self._chk(off, mv.nbytes)
        mv[:] = self.mem[off:off + mv.nbytes]
        return mv.nbytes

    def write(self, buf, off):
        mv = memoryview(buf).cast("B")
        self._chk(off, mv.nbytes)
        self.mem[off:off + mv.nbytes] = mv
        return mv.nbytes

    def read_batch(self, reqs):
        return [self.read(b, o) for b, o in reqs]

    def deallocate(self, off, n):
        self._chk(off, n)
        self.mem[off:off + n] = bytes(n)
        self.deallocated.append((off, n))

    def close(self):
        self.closed = True


# ---------------------------------------------------------------------------
# ExtentMap
# ---------------------------------------------------------------------------

def test_sequential_placement_from_first_lba():
    ns = FakeNamespace(lba_size=4096, first_lba=100, nr_lbas=1000)
    m = nvme.ExtentMap(ns, first_lba=300)
    es = m.bind_run([("k0", 10000), ("v0", 4096), ("k1", 1)])
    assert [e.lba for e in es] == [300, 303, 304]
    assert [e.blocks for e in es] == [3, 1, 1]
    nxt = m.bind("v1", 8192)
    assert nxt.lba == es[-1].end_lba                # start(n+1) = start(n) + blocks(n)
    m.check()
    with pytest.raises(KeyError):
        m.bind("k0", 1)
    with pytest.raises(nvme.NvmeError) as ei:
        nvme.ExtentMap(ns, first_lba=50)
    assert ei.value.errno == errno.ERANGE


def test_free_coalesce_reuse_and_destroy():
    ns = FakeNamespace(lba_size=512, nr_lbas=4096)
    m = nvme.ExtentMap(ns, first_lba=10)
    a = m.bind_run([(i, 4 * 512) for i in range(5)])          # LBAs 10..30
    m.free(1)
    m.free(3)
    assert m.holes == [(14, 4), (22, 4)]
    m.free(2)                                                 # joins both
    assert m.holes == [(14, 12)]
    b = m.bind_run([("x", 512 * 5), ("y", 512 * 5)])          # fits the hole, whole
    assert b[0].lba == 14 and b[1].lba == 19
    big = m.bind_run([("z", 512 * 20)])                      # too big for what is left
    assert big[0].lba == a[-1].end_lba
    m.check()
    assert ns.deallocated == [(e.offset, e.length) for e in (a[1], a[3], a[2])]
    m.free("z")
    assert m.tail == a[-1].end_lba                            # tail shrinks back
    ns.deallocated.clear()
    m.destroy()
    assert ns.deallocated == [(10 * 512, (big[0].end_lba - 10) * 512)]
    assert len(m) == 0
    with pytest.raises(ValueError):
        m.bind("again", 1)


def test_best_fit_prefers_the_smallest_hole():
    ns = FakeNamespace(lba_size=512, nr_lbas=4096)
    m = nvme.ExtentMap(ns)
    m.bind_run([(i, 512 * n) for i, n in enumerate([8, 1, 3, 1, 20, 1])])
    m.free(0)     # hole of 8 at LBA 0
    m.free(2)     # hole of 3 at LBA 9
    m.free(4)     # hole of 20 at LBA 13
    assert m.bind("a", 3 * 512).lba == 9
    assert m.bind("b", 7 * 512).lba == 0
    assert m.bind("c", 9 * 512).lba == 13
    m.check()


def test_random_allocate_free_keeps_invariants():
    rng = random.Random(1234)
    ns = FakeNamespace(lba_size=4096, first_lba=64, nr_lbas=100000, total=100064)
    m = nvme.ExtentMap(ns, trim_on_free=False)
    live, k = [], 0
    for step in range(2000):
        if live and rng.random() < 0.45:
            m.free(live.pop(rng.randrange(len(live))))
        else:
            run = [(k + i, rng.randint(1, 40000)) for i in range(rng.randint(1, 4))]
            k += len(run)
            try:
                es = m.bind_run(run)
            except nvme.NvmeError as e:
                assert e.errno == errno.ENOSPC
                continue
            for x, y in zip(es, es[1:]):
                assert y.lba == x.end_lba
            live += [key for key, _ in run]
        if step % 200 == 0:
            m.check()
    m.check()
    assert sorted(e.key for e in m.extents()) == sorted(live)


def test_extent_io_bounds():
    ns = FakeNamespace(lba_size=512)
    m = nvme.ExtentMap(ns)
    e = m.bind("t", 1000)                     # 2 LBAs
    data = np.frombuffer(os.urandom(1024), np.uint8)
    assert m.write("t", data) == 1024
    out = np.zeros(512, np.uint8)
    m.read("t", out, 512)
    assert out.tobytes() == data[512:].tobytes()
    with pytest.raises(nvme.NvmeError) as ei:
        m.write("t", data, 512)
    assert ei.value.errno == errno.ERANGE
    assert e.offset == 0 and e.length == 1024


# ---------------------------------------------------------------------------
# phx.kv's NVMe backend (unaligned rows: bounce reads, read-modify-write)
# ---------------------------------------------------------------------------

def test_kv_backend_unaligned_rows():
    from phx.kv.nvme_backend import NvmeBackend
    ns = FakeNamespace(lba_size=512, first_lba=256, nr_lbas=4096)
    be = NvmeBackend(namespace=ns)
    exts = be.bind([3000, 700, 5000])
    assert exts[0].start == 256 * 512
    assert exts[1].start == exts[0].end and exts[2].start == exts[1].end
    model = bytearray(ns.mem)
    rng = random.Random(7)
    for _ in range(300):
        e = rng.choice(exts)
        off = e.start + rng.randrange(e.nbytes)
        n = rng.randint(1, e.start + e.nbytes - off)
        data = os.urandom(n)
        if rng.random() < 0.5:
            be.write(data, off)
        else:
            be.write_async(np.frombuffer(data, np.uint8), off).result()
        model[off:off + n] = data
        roff = e.start + rng.randrange(e.nbytes)
        rn = rng.randint(1, e.start + e.nbytes - roff)
        out = bytearray(rn)
        be.read(out, roff)
        assert out == model[roff:roff + rn]
    assert ns.mem == model
    outs = [bytearray(512), bytearray(100)]
    be.read_batch([(outs[0], exts[0].start), (outs[1], exts[1].start + 3)])
    assert outs[0] == model[exts[0].start:exts[0].start + 512]
    assert outs[1] == model[exts[1].start + 3:exts[1].start + 103]
    be.discard(exts[1])
    assert ns.deallocated[-1] == (exts[1].start, exts[1].length)
    be.close()
    assert ns.deallocated[-2:] == [(e.start, e.length) for e in (exts[0], exts[2])]  # once each
    assert not ns.closed                      # not ours: the caller closes it


def test_kv_backend_from_env(monkeypatch):
    from phx.kv.nvme_backend import from_env
    monkeypatch.delenv("PHX_KV_NVME", raising=False)
    assert from_env() is None
    monkeypatch.setenv("PHX_KV_NVME", "/dev/null,bogus=1")
    with pytest.raises(ValueError):
        from_env()
    monkeypatch.setenv("PHX_KV_NVME", "/dev/null,first_lba=8")
    with pytest.raises(OSError) as ei:
        from_env()
    assert ei.value.errno == errno.ENOTTY


def test_kv_store_with_backend():
    from phx.kv import KVStore
    from phx.kv.nvme_backend import NvmeBackend
    import tempfile
    ns = FakeNamespace(lba_size=4096, first_lba=0, nr_lbas=2048, total=2048)
    with tempfile.TemporaryDirectory() as d:
        with KVStore(d, mode="direct", direct_backend=NvmeBackend(namespace=ns)) as st:
            k, v = st.allocate(0, (16, 4, 40), np.float16)
            ref = np.frombuffer(os.urandom(k.nbytes), np.float16).reshape(k.shape)
            st.write(k, 0, ref[:5])
            st.write(k, 5, ref[5:])
            assert st.read(k).tobytes() == ref.tobytes()
            assert st.read(k, 2, 11).tobytes() == ref[2:11].tobytes()
            assert v.extent.start == k.extent.end


# ---------------------------------------------------------------------------
# the C library without a device
# ---------------------------------------------------------------------------

def test_not_a_namespace(tmp_path):
    f = tmp_path / "plain"
    f.write_bytes(b"x" * 4096)
    for path, err in ((str(tmp_path / "missing"), errno.ENOENT), (str(f), errno.ENOTTY),
                      ("/dev/null", errno.ENOTTY)):
        for call in (nvme.open, nvme.identify, nvme.check):
            with pytest.raises(nvme.NvmeError) as ei:
                call(path)
            assert ei.value.errno == err, (path, call, str(ei.value))
            assert path in str(ei.value)


def test_status_strings():
    assert nvme.status_str(0x080) == "LBA Out of Range"
    assert nvme.status_str(0x002) == "Invalid Field in Command"
    assert nvme.status_str(0x182) == "Attempted Write to Read Only Range"
    assert nvme.status_str(0x4281) == "Unrecovered Read Error"      # DNR bit ignored
    assert "Vendor" in nvme.status_str(0x7c0)


def test_open_argument_checks():
    with pytest.raises(ValueError):
        nvme.open("/dev/null", queue_depth=0)
    with pytest.raises(OverflowError):
        nvme.open("/dev/null", first_lba=-1)


def test_probe_shape(tmp_path, monkeypatch):
    """probe() says, per path, what identify() and check() said, and never calls a node usable
    that libphx refused."""
    # the C library on nodes that are not namespaces: identify fails, the reason is libphx's
    plain = tmp_path / "plain"
    plain.write_bytes(b"x" * 4096)
    for path, text in (("/dev/null", "not an NVMe namespace"),
                       (str(plain), "not an NVMe namespace"),
                       (str(tmp_path / "missing"), "No such file")):
        got = nvme.probe([path])
        assert len(got) == 1 and got[0]["name"] == path and got[0]["usable"] is False, got
        assert set(got[0]) == {"name", "usable", "reason"}, got
        assert got[0]["reason"].startswith("cannot identify: ") and text in got[0]["reason"], got
    # without paths: exactly the generic char devices of this machine (none on the host)
    ng = sorted(p for p in glob.glob("/dev/ng*n*") if stat.S_ISCHR(os.stat(p).st_mode))
    assert sorted(p["name"] for p in nvme.probe()) == ng

    # the verdicts, with identify/check standing in for three namespaces
    info = {"block_device": "nvme7n1", "model": "M", "lba_size": 4096, "capacity": 1 << 30,
            "max_transfer": 1 << 17, "deallocated_reads": "zeroes", "serial": "S"}
    checked = []

    def identify(p):
        if p == "/dev/ngC":
            raise nvme.NvmeError(errno.EACCES, "Permission denied")
        return dict(info)

    def check(p):
        checked.append(p)
        if p == "/dev/ngB":
            raise nvme.NvmeError(errno.EBUSY, "/dev/nvme7n1 is mounted at /mnt")

    monkeypatch.setattr(nvme, "identify", identify)
    monkeypatch.setattr(nvme, "check", check)
    a, b, c = nvme.probe(["/dev/ngA", "/dev/ngB", "/dev/ngC"])
    assert checked == ["/dev/ngA", "/dev/ngB"]               # check only what identified
    assert [a["name"], b["name"], c["name"]] == ["/dev/ngA", "/dev/ngB", "/dev/ngC"]
    assert a["usable"] is True and "no filesystem" in a["reason"]
    for k in ("block_device", "model", "lba_size", "capacity", "max_transfer",
              "deallocated_reads"):
        assert a[k] == info[k] and b[k] == info[k], k
    assert b["usable"] is False and b["reason"] == "/dev/nvme7n1 is mounted at /mnt"
    assert c["usable"] is False and "needs root" in c["reason"] and "block_device" not in c


def test_bench_registered():
    from phx.cli import BENCHMARKS
    assert BENCHMARKS["nvme"][0] == "phx.bench.nvme"
