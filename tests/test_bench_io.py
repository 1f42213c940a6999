"""``phx bench io``: fio at its strongest, device counters, zram rows, acceptance checks.

Small sizes and short runs: these check that the benchmark measures what it
says, not how fast anything is.  Tests that need root (loop devices, zram)
skip without it.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import time
import uuid

import pytest

from conftest import sigint_default
from phx.bench import _blockstat, _fio, _zram
from phx.bench import io as bio
from phx.bench._common import fmt_size, parse_size
from phx.cli import main

KiB, MiB = 1 << 10, 1 << 20
ROW_FIELDS = {"target", "op", "bs", "qd", "engine", "gbps", "iops", "ratio_vs_fio", "repeats",
              "spread", "blockdev"}
HAVE_FIO = shutil.which("fio") is not None
needs_fio = pytest.mark.skipif(not HAVE_FIO, reason="fio not installed (apt-get install fio)")
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (loop devices, zram, mount)")


def _phx_usable() -> bool:
    try:
        import phx
        phx.Engine(queue_depth=1).close()
        return True
    except Exception:  # noqa: BLE001 - any failure means: skip
        return False


needs_phx = pytest.mark.skipif(not _phx_usable(), reason="phx extension not built")


def _opts(argv: list[str]) -> dict[str, str]:
    """fio's --name=value options as a dict (flags map to '')."""
    out = {}
    for a in argv[1:]:
        k, _, v = a.partition("=")
        out[k] = v
    return out


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    bio.add_arguments(p)
    return p


# ---------------------------------------------------------------------------
# Pure pieces
# ---------------------------------------------------------------------------

def test_parse_and_format_sizes():
    assert parse_size("4k") == 4096 and parse_size("1M") == 1 << 20 and parse_size("2GiB") == 2 << 30
    assert parse_size("4096") == 4096 and fmt_size(4096) == "4k" and fmt_size(3 << 20) == "3m"
    with pytest.raises(ValueError):
        parse_size("4x")


def test_fio_json_parsing():
    doc = {"jobs": [{"error": 0, "usr_cpu": 10.0, "sys_cpu": 5.0,
                     "read": {"io_bytes": 8192, "total_ios": 2, "runtime": 4},
                     "write": {"io_bytes": 0, "total_ios": 0, "runtime": 0}}]}
    r = _fio.parse_fio_json("note: something\n" + json.dumps(doc), "randread")
    assert (r.nbytes, r.ios, r.seconds, r.cpu_pct) == (8192, 2, 0.004, 15.0)
    with pytest.raises(RuntimeError):
        _fio.parse_fio_json(json.dumps(doc), "write")  # the write side moved nothing


@pytest.mark.parametrize("op", _fio.OPS)
@pytest.mark.parametrize("qd,batch", [(1, 4), (32, 4), (32, 0), (8, 16)])
def test_fio_argv_has_the_strong_options(op, qd, batch):
    argv = _fio.fio_command("/usr/bin/fio", "/x/a:b.dat", 1 << 30, op, 4096, qd, 5.0, batch)
    o = _opts(argv)
    assert argv[0] == "/usr/bin/fio"
    assert "--fixedbufs" in o and "--registerfiles" in o
    assert o["--iodepth_batch_submit"] == str(batch)
    assert o["--iodepth_batch_complete_min"] == "1"
    assert o["--iodepth_batch_complete_max"] == str(qd)  # reap every ready completion
    assert o["--scramble_buffers"] == "0"
    assert o["--gtod_reduce"] == "1"
    assert o["--iodepth"] == str(qd) and o["--rw"] == op and o["--bs"] == "4096"
    assert o["--runtime"] == "5000ms" and "--time_based" in o
    assert o["--filename"] == "/x/a\\:b.dat"  # fio's escape for a colon
    # fio 3.33 loses --end_fsync=1 with --fixedbufs; the bench fsyncs after fio instead.
    assert "--end_fsync" not in o and "--fsync_on_close" not in o
    # Extra options come last, so they can override.
    assert _fio.fio_command("fio", "/f", 4096, op, 4096, qd, 1, batch, ["--foo=1"])[-1] == "--foo=1"


@needs_phx
@pytest.mark.parametrize("value", ["7", "1", "0", None])
def test_fio_submit_batch_follows_phx_engine_config(monkeypatch, value):
    import phx
    if value is None:
        monkeypatch.delenv("PHX_SUBMIT_BATCH", raising=False)
    else:
        monkeypatch.setenv("PHX_SUBMIT_BATCH", value)
    with phx.Engine(queue_depth=4) as eng:
        want = eng.config["submit_batch"]
    if value is not None:
        assert want == int(value)
    got, source = bio.phx_submit_batch()
    assert got == want and "config" in source
    if HAVE_FIO:
        fe = bio.FioEngine("/f", 1 << 20, [], got)
        assert _opts(fe.command("read", 4096, 32, 1.0))["--iodepth_batch_submit"] == str(want)


def test_parse_stat_and_summary():
    line17 = "  100 300 3200 7 40 10 800 9 2 50 60 1 0 8 1 5 3\n"
    s = _blockstat.parse_stat(line17)
    assert (s.read_ios, s.read_merges, s.read_sectors, s.read_ticks_ms) == (100, 300, 3200, 7)
    assert (s.write_ios, s.write_merges, s.write_sectors, s.in_flight) == (40, 10, 800, 2)
    assert (s.discard_ios, s.discard_sectors, s.flush_ios, s.flush_ticks_ms) == (1, 8, 5, 3)
    s15 = _blockstat.parse_stat(" ".join(line17.split()[:15]))
    assert s15.discard_ticks_ms == 1 and s15.flush_ios == 0
    s11 = _blockstat.parse_stat(" ".join(line17.split()[:11]))
    assert s11.time_in_queue_ms == 60 and s11.discard_ios == 0
    with pytest.raises(ValueError):
        _blockstat.parse_stat("1 2 3")
    later = _blockstat.parse_stat("1100 3300 35200 20 40 10 800 9 0 70 80 1 0 8 1 6 3")
    d = later - s
    assert (d.read_ios, d.read_merges, d.read_sectors, d.flush_ios, d.in_flight) == \
        (1000, 3000, 32000, 1, 0)
    sm = _blockstat.summarise(d, write=False, engine_ios=4000)
    # 4000 reads of 4 KiB reached the device as 1000 requests of 16 KiB, 3000 bios merged.
    assert sm["requests"] == 1000 and sm["merged"] == 3000
    assert sm["avg_request_bytes"] == 16 * KiB and sm["bytes"] == 16000 * KiB
    assert sm["merge_ratio"] == pytest.approx(0.75)
    assert sm["requests_per_io"] == pytest.approx(0.25)
    assert (d + d).read_ios == 2000
    empty = _blockstat.summarise(later - later, write=True, engine_ios=0)
    assert empty["avg_request_bytes"] is None and empty["merge_ratio"] is None


# ---------------------------------------------------------------------------
# Device counters on real devices
# ---------------------------------------------------------------------------

def _odirect_reads(path: str, offsets: list[int], bs: int = 4096) -> None:
    import mmap
    buf = mmap.mmap(-1, bs)
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    try:
        for off in offsets:
            assert os.preadv(fd, [buf], off) == bs
    finally:
        os.close(fd)
        buf.close()


def test_blockstat_on_the_real_disk(data_dir, make_file):
    dev, how = _blockstat.device_for_path(data_dir)
    if dev is None:
        pytest.skip(f"the test directory has no block device here ({how})")
    from phx.bench._common import storage_description
    st = storage_description(data_dir)
    if st["device"].startswith("/dev/"):
        assert os.path.realpath(st["device"]).endswith(dev.name)
    assert os.path.exists(dev.stat_path) and how.startswith(("st_dev", "mount source"))
    path, _ = make_file(8 * MiB, dir=data_dir)
    fd = os.open(path, os.O_RDONLY)
    os.fsync(fd)
    os.close(fd)
    before = dev.read()
    # 16 reads 256 KiB apart: O_DIRECT, no page cache, too far apart to merge.
    _odirect_reads(path, [i * 256 * KiB for i in range(16)])
    d = dev.read() - before
    assert d.read_ios >= 16 and d.read_sectors >= 16 * 4096 // 512


def test_blockstat_na_on_tmpfs(tmp_path):
    shm = "/dev/shm"
    from phx.bench._common import storage_description
    if not os.path.isdir(shm) or storage_description(shm)["fstype"] != "tmpfs":
        pytest.skip("/dev/shm is not a tmpfs here")
    dev, why = _blockstat.device_for_path(shm)
    assert dev is None and "no block device" in why


def _write_mbr(img: str, size: int) -> None:
    """One Linux partition from sector 2048 to the end (the kernel here has no
    partition-table parsers, so the test adds it with partx / BLKPG instead)."""
    with open(img, "wb") as f:
        f.truncate(size)
        entry = struct.pack("<B3sB3sII", 0, b"\0\0\0", 0x83, b"\0\0\0", 2048, size // 512 - 2048)
        mbr = bytearray(512)
        mbr[446:462] = entry
        mbr[510:512] = b"\x55\xaa"
        f.write(mbr)


@needs_root
def test_blockstat_partition_has_its_own_stat(disk_base):
    if shutil.which("partx") is None or shutil.which("mkfs.ext4") is None:
        pytest.skip("needs partx and mkfs.ext4 (util-linux, e2fsprogs)")
    img = os.path.join(disk_base, f"part-{uuid.uuid4().hex[:8]}.img")
    mnt = tempfile.mkdtemp(dir=disk_base)
    _write_mbr(img, 64 * MiB)
    loop = subprocess.run(["losetup", "--find", "--show", img], check=True, capture_output=True,
                          text=True).stdout.strip()
    part = loop + "p1"
    try:
        subprocess.run(["partx", "-a", loop], check=True, capture_output=True)
        for _ in range(50):
            if os.path.exists(part):
                break
            time.sleep(0.02)
        subprocess.run(["mkfs.ext4", "-q", "-F", part], check=True, capture_output=True)
        subprocess.run(["mount", part, mnt], check=True, capture_output=True)
        dev, how = _blockstat.device_for_path(mnt)
        name = os.path.basename(loop)
        assert dev is not None, how
        assert (dev.name, dev.kind, dev.parent) == (f"{name}p1", "partition", name)
        assert dev.stat_path.endswith(f"/{name}/{name}p1/stat")
        path = os.path.join(mnt, "f")
        with open(path, "wb") as f:
            f.write(os.urandom(4 * MiB))
            f.flush()
            os.fsync(f.fileno())
        before = dev.read()
        _odirect_reads(path, [i * 512 * KiB for i in range(8)])
        d = dev.read() - before
        assert d.read_ios >= 8  # counted on the partition itself
        # Reads of the disk before the partition starts (sector 2048) count on the
        # disk, not on the partition: the partition's counters are its own.
        with open(f"/sys/block/{name}/dev") as f:
            disk = _blockstat.device_by_number(*map(int, f.read().split(":")))
        before, disk_before = dev.read(), disk.read()
        _odirect_reads(loop, [i * 64 * KiB for i in range(8)])
        assert (dev.read() - before).read_ios == 0
        assert (disk.read() - disk_before).read_ios >= 8
    finally:
        subprocess.run(["umount", mnt], capture_output=True)
        subprocess.run(["partx", "-d", loop], capture_output=True)
        subprocess.run(["losetup", "-d", loop], capture_output=True)
        os.rmdir(mnt)
        os.unlink(img)


@pytest.fixture(scope="module")
def private_ext4(disk_base):
    """ext4 on a loop device nothing else uses, so its counters are ours alone;
    journal commits only every 300 s and reads touch no atime, so a flush in a
    short run is an fsync's."""
    if os.geteuid() != 0:
        pytest.skip("needs root (loop device)")
    if shutil.which("mkfs.ext4") is None:
        pytest.skip("mkfs.ext4 not installed (apt-get install e2fsprogs)")
    base = tempfile.mkdtemp(prefix="phx-bench-loop-", dir=disk_base)
    img, mnt = os.path.join(base, "img"), os.path.join(base, "mnt")
    os.mkdir(mnt)
    with open(img, "wb") as f:
        f.truncate(256 * MiB)
    loop = subprocess.run(["losetup", "--find", "--show", "--direct-io=on", img], check=True,
                          capture_output=True, text=True).stdout.strip()
    try:
        subprocess.run(["mkfs.ext4", "-q", "-F", "-E", "lazy_itable_init=0,lazy_journal_init=0",
                        loop], check=True, capture_output=True)
        # noatime: a read run dirties no inode, so it has nothing to commit.
        subprocess.run(["mount", "-o", "commit=300,noatime", loop, mnt], check=True,
                       capture_output=True)
        yield mnt
    finally:
        # io_uring rings release their registered files asynchronously after
        # close: the mount can be busy for a moment.
        for _ in range(100):
            if not os.path.ismount(mnt) or subprocess.run(
                    ["umount", mnt], capture_output=True).returncode == 0:
                break
            time.sleep(0.1)
        subprocess.run(["losetup", "-d", loop], capture_output=True)
        if not os.path.ismount(mnt):
            shutil.rmtree(base, ignore_errors=True)


def _test_file(d: str, size: int) -> str:
    path = os.path.join(d, f"t-{uuid.uuid4().hex[:8]}")
    bio.write_test_file(path, size, None)
    return path


def _engines(path: str, size: int) -> dict[str, object]:
    out: dict[str, object] = {"preadv": bio.PreadvEngine(path, size, 1)}
    if _phx_usable():
        out["phx"] = bio.PhxEngine(path, size, 1, True)
    if HAVE_FIO:
        out["fio"] = bio.FioEngine(path, size, [], 4)
    return out


@pytest.mark.parametrize("op", ["write", "randwrite", "read"])
def test_writes_end_with_a_timed_fsync(private_ext4, op):
    """Every engine's write run ends with an fsync inside its timed region (a
    flush reaches the device); read runs have none."""
    size = 16 * MiB
    path = _test_file(private_ext4, size)
    dev, how = _blockstat.device_for_path(path)
    assert dev is not None, how
    try:
        for name, eng in _engines(path, size).items():
            # fio's own end fsync is lost only now and then (see phx.bench._fio), so
            # every write run of 3 must flush.  A read run must not fsync; now and then
            # a journal commit of an earlier test's deferred work (a ring releasing an
            # unlinked file late) lands in one, so 1 of 3 without a flush suffices.
            flushes = []
            for _ in range(3 if name == "fio" or "write" not in op else 1):
                os.sync()
                before = dev.read()
                s = eng.run(op, 4096, 8, 0.1)
                d = dev.read() - before
                flushes.append(d.flush_ios)
                if "write" in op:
                    assert d.flush_ios >= 1, (name, d)
                    assert 0 < s.extra["fsync_s"] < s.seconds, (name, s.extra)
                else:
                    assert "fsync_s" not in s.extra
            if "write" not in op:
                assert min(flushes) == 0, (name, flushes)
    finally:
        os.unlink(path)


@needs_fio
def test_fio_strong_batches_submissions(private_ext4):
    """The options reach fio: with every ready completion reaped, 4 KiB sequential
    reads at QD 32 go in batches of 4, which the block layer merges; reaping one
    completion at a time (fio's default) merges next to nothing."""
    size = 32 * MiB
    path = _test_file(private_ext4, size)
    dev, _ = _blockstat.device_for_path(path)
    try:
        strong = _fio.fio_command("fio", path, size, "read", 4096, 32, 0.5, 4)
        one_at_a_time = [a for a in strong if not a.startswith("--iodepth_batch_complete_max")]
        merged = {}
        for name, argv in (("strong", strong), ("one", one_at_a_time)):
            before = dev.read()
            r = _fio.run_fio(argv, "read", 60)
            merged[name] = _blockstat.summarise(dev.read() - before, False, r.ios)["merge_ratio"]
        assert merged["strong"] > 0.4 and merged["one"] < 0.2, merged
    finally:
        os.unlink(path)


# ---------------------------------------------------------------------------
# zram
# ---------------------------------------------------------------------------

def _zram_devices() -> set[str]:
    return {n for n in os.listdir("/sys/block") if n.startswith("zram")}


def _zram_skip(size: int) -> None:
    why = _zram.unavailable(size)
    if why:
        pytest.skip(f"no zram here: {why}")


@needs_root
def test_zram_setup_and_teardown():
    _zram_skip(256 * MiB)
    before = _zram_devices()
    with _zram.zram_ext4(256 * MiB) as z:
        name = os.path.basename(z.device)
        assert name not in before and os.path.ismount(z.mountpoint)
        dev, how = _blockstat.device_for_path(z.mountpoint)
        assert dev is not None and dev.kind == "zram" and dev.name == name, how
        from phx.bench._common import storage_description
        assert storage_description(z.mountpoint)["fstype"] == "ext4"
        with open(f"/sys/block/{name}/disksize") as f:
            assert int(f.read()) == 256 * MiB
        path = os.path.join(z.mountpoint, "f")
        bio.write_test_file(path, 4 * MiB, 3)
        _odirect_reads(path, [0, MiB])
    assert not os.path.ismount(z.mountpoint) and not os.path.exists(z.mountpoint)
    assert _zram_devices() == before


@needs_root
def test_zram_teardown_on_error():
    _zram_skip(128 * MiB)
    before = _zram_devices()
    with pytest.raises(KeyboardInterrupt):
        with _zram.zram_ext4(128 * MiB) as z:
            raise KeyboardInterrupt
    assert not os.path.ismount(z.mountpoint) and _zram_devices() == before


@needs_root
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_bench_removes_zram_when_interrupted(data_dir, sig):
    _zram_skip(256 * MiB)
    before = _zram_devices()
    cmd = [sys.executable, "-m", "phx.cli", "bench", "io", "--dir", data_dir, "--size", "16m",
           "--zram", "256m", "--methods", "preadv", "--ops", "read", "--bs", "4k",
           "--qd", "1,2,3,4,5,6,7,8", "--runtime", "0.5", "--repeat", "2", "--quiet"]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         preexec_fn=sigint_default)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and p.poll() is None:
            with open("/proc/mounts") as f:
                if "phx-bench-zram" in f.read():
                    break
            time.sleep(0.1)
        else:
            pytest.fail(f"the zram row set never started: {p.communicate()[0][-2000:]}")
        time.sleep(0.5)
        p.send_signal(sig)
        out = p.communicate(timeout=60)[0]
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert p.returncode != 0, out
    with open("/proc/mounts") as f:
        assert "phx-bench-zram" not in f.read()
    assert _zram_devices() == before, out
    assert os.listdir(data_dir) == []  # the disk's test file went too


# ---------------------------------------------------------------------------
# Grid, timing, acceptance logic
# ---------------------------------------------------------------------------

def test_default_grid_timing_and_budget():
    a = _parser().parse_args([])
    rows = [r.key for r in bio.rows_from_args(a)]
    assert rows == list(bio.DEFAULT_ROWS)
    for need in [("read", MiB, q) for q in (1, 8, 32)] + [("write", MiB, q) for q in (1, 8, 32)] \
            + [("randread", 4 * KiB, 32), ("read", 4 * KiB, 32)]:
        assert need in rows
    assert bio.timing_from_args(a) == (5.0, 5)
    # The default (disk + zram) stays within make bench's budget: 45 minutes.
    est = bio.estimate_seconds(len(rows), list(bio.ENGINES), 5, 5.0, 1 << 30, 2)
    assert 20 * 60 < est < 45 * 60
    q = _parser().parse_args(["--quick"])
    assert bio.timing_from_args(q) == (bio.QUICK_RUNTIME, bio.QUICK_REPEATS)
    assert bio.timing_from_args(_parser().parse_args(["--quick", "--repeat", "7"]))[1] == 7
    # Any of --bs/--qd/--ops: every combination, the others from the grid defaults.
    g = bio.rows_from_args(_parser().parse_args(["--qd", "1,8"]))
    assert len(g) == 4 * 2 * 2 and {r.qd for r in g} == {1, 8}
    g = bio.rows_from_args(_parser().parse_args(["--ops", "read", "--bs", "64k"]))
    assert [r.key for r in g] == [("read", 64 * KiB, q) for q in (1, 8, 32)]


def _rec(target, op, bs, qd, eng, runs):
    import statistics
    med = statistics.median(runs)
    return {"target": target, "op": op, "bs": bs, "qd": qd, "engine": eng, "gbps": med,
            "iops": med * 1e9 / bs, "gbps_runs": runs, "iops_runs": [r * 1e9 / bs for r in runs],
            "spread": (max(runs) - min(runs)) / med}


def _synthetic(seq_phx_at_best, rand_phx, zram_phx, write_phx=(1.1, 1.1, 1.1)):
    """fio's best 1 MiB read depth is QD 8 (1.2 GB/s); phx leads elsewhere."""
    res = []
    for qd, fio, phx in ((1, [0.8] * 3, [1.5] * 3), (8, [1.2, 1.2, 1.2], seq_phx_at_best),
                         (32, [1.0] * 3, [2.0] * 3)):
        res += [_rec("disk", "read", MiB, qd, "fio", fio), _rec("disk", "read", MiB, qd, "phx", phx)]
    for qd, fio in ((1, [1.0] * 3), (8, [2.0] * 3), (32, [1.5] * 3)):
        res += [_rec("disk", "write", MiB, qd, "fio", fio),
                _rec("disk", "write", MiB, qd, "phx", [x * f for x, f in zip(write_phx, fio)])]
    res += [_rec("disk", "randread", 4 * KiB, 32, "fio", [0.30] * 3),
            _rec("disk", "randread", 4 * KiB, 32, "phx", [0.30 * x for x in rand_phx]),
            _rec("zram", "randread", 4 * KiB, 32, "fio", [0.80] * 3),
            _rec("zram", "randread", 4 * KiB, 32, "phx", [0.80 * x for x in zram_phx])]
    return res


def test_acceptance_checks_pass():
    checks = bio.acceptance_checks(_synthetic([1.25, 1.3, 1.35], [1.0, 1.02, 1.05],
                                              [1.25, 1.3, 1.4]))
    by = {c["check"]: c for c in checks}
    assert len(checks) == 4 and all(c["status"] == "PASS" for c in checks), checks
    seq = by["1 MiB sequential read, fio's best QD"]
    assert seq["qd"] == 8 and seq["ratio"] == pytest.approx(1.3 / 1.2) and seq["fio_best_qd"]
    assert seq["ratio_at_every_qd"] == pytest.approx({1: 1.875, 8: 1.3 / 1.2, 32: 2.0})
    assert not seq["inside_noise"]
    assert by["1 MiB sequential write, fio's best QD"]["qd"] == 8
    assert by["zram: 4 KiB random read, QD 32"]["threshold"] == 1.2
    assert by["4 KiB random read, QD 32"]["ratio"] == pytest.approx(1.02)


def test_acceptance_checks_fail_and_noise(capsys):
    # phx beats fio at QD 1 and 32, but not at fio's best depth (QD 8): FAIL.
    # Random reads: median 0.98, repeats 0.9-1.1: FAIL, inside the noise.
    # zram: 1.15 x fio passes 1.0 but not the 1.2 the issue asks for.
    checks = bio.acceptance_checks(_synthetic([1.0, 1.1, 1.15], [0.9, 0.98, 1.1],
                                              [1.1, 1.15, 1.18], write_phx=(0.9, 0.95, 0.97)))
    by = {c["check"]: c for c in checks}
    assert all(c["status"] == "FAIL" for c in checks), checks
    seq = by["1 MiB sequential read, fio's best QD"]
    assert seq["qd"] == 8 and seq["ratio"] == pytest.approx(1.1 / 1.2)
    assert not seq["inside_noise"]  # every repeat below 1
    rnd = by["4 KiB random read, QD 32"]
    assert rnd["inside_noise"] and rnd["paired_min"] == pytest.approx(0.9)
    assert by["zram: 4 KiB random read, QD 32"]["ratio"] == pytest.approx(1.15)
    bio.print_checks(checks)
    out = capsys.readouterr().out
    assert out.count("[FAIL]") == 4 and "inside the noise" in out and "ratio 0.917" in out


def test_acceptance_noise_needs_three_repeats(capsys):
    res = [_rec("disk", "randread", 4 * KiB, 32, "fio", [0.30, 0.30]),
           _rec("disk", "randread", 4 * KiB, 32, "phx", [0.27, 0.33])]
    (c,) = [c for c in bio.acceptance_checks(res) if c["op"] == "randread" and
            c["target"] == "disk"]
    assert c["status"] == "PASS" and c["inside_noise"] is None
    bio.print_checks([c])
    assert "too few to tell the noise" in capsys.readouterr().out


def test_acceptance_checks_not_measured():
    res = [r for r in _synthetic([1.3] * 3, [1.0] * 3, [1.3] * 3) if r["target"] == "disk"
           and r["op"] != "write"]
    checks = bio.acceptance_checks(res, {"zram": "zram rows not run: not root"})
    by = {c["check"]: c for c in checks}
    assert by["zram: 4 KiB random read, QD 32"]["status"] == "not measured"
    assert "not root" in by["zram: 4 KiB random read, QD 32"]["why"]
    assert by["1 MiB sequential write, fio's best QD"]["status"] == "not measured"
    assert by["1 MiB sequential read, fio's best QD"]["status"] == "PASS"


# ---------------------------------------------------------------------------
# End to end
# ---------------------------------------------------------------------------

@needs_fio
@needs_phx
def test_bench_io_smoke(data_dir, tmp_path, capsys):
    out_json = tmp_path / "r" / "bench-io.json"
    out_png = tmp_path / "r" / "bench-io.png"
    rc = main(["bench", "io", "--dir", data_dir, "--size", "8m", "--bs", "4k,1m",
               "--qd", "32", "--ops", "read,randread,write", "--runtime", "0.05",
               "--repeat", "2", "--json", str(out_json), "--plot", str(out_png),
               "--quiet"])
    printed = capsys.readouterr().out
    assert rc == 0, printed
    doc = json.loads(out_json.read_text())
    assert doc["benchmark"] == "io"
    assert {"host", "kernel", "cpus"} <= set(doc["machine"])
    cfg = doc["config"]
    assert cfg["targets"][0]["storage"]["fstype"] and cfg["targets"][0]["label"] == "disk"
    assert cfg["fio"]["submit_batch"] == cfg["phx"]["engine_config_last_run"]["submit_batch"]
    rows = doc["rows"]
    assert len(rows) == 3 * 2 * 1 * len(bio.ENGINES)  # ops x bs x qd x engines
    assert {r["counters_last_run"]["backend"] for r in rows if r["engine"] == "phx-threads"} \
        == {"threads"}
    test_file = cfg["targets"][0]["path"]
    for r in rows:
        assert ROW_FIELDS <= set(r), r
        assert "error" not in r, r
        assert r["repeats"] == 2 and r["gbps"] > 0 and r["iops"] > 0
        assert r["gbps"] == pytest.approx(r["iops"] * r["bs"] / 1e9, rel=0.05)
        # The engine's own requests are in the device's counters (and maybe others').
        assert r["blockdev"]["requests"] > 0 and len(r["blockdev_runs"]) == 2
        if r["engine"] == "fio":
            assert r["ratio_vs_fio"] == pytest.approx(1.0)
            o = _opts(r["fio_argv"])
            assert os.path.isabs(r["fio_argv"][0]) and os.access(r["fio_argv"][0], os.X_OK)
            assert (o["--rw"], o["--bs"], o["--iodepth"]) == (r["op"], str(r["bs"]), str(r["qd"]))
            assert o["--filename"] == test_file and o["--size"] == str(8 * MiB)
            assert o["--iodepth_batch_submit"] == str(cfg["fio"]["submit_batch"])
            assert "--fixedbufs" in o and "--registerfiles" in o
        else:
            assert r["ratio_vs_fio"] > 0 and "fio_argv" not in r
        if r["op"] == "write":
            assert r["counters_last_run"]["fsync_s"] > 0
    checks = {c["check"]: c for c in doc["checks"]}
    assert len(checks) == 4
    for name, c in checks.items():
        if name.startswith("zram"):
            assert c["status"] == "not measured" and "not asked" in c["why"]
        else:
            assert c["status"] in ("PASS", "FAIL")
            assert f"{c['ratio']:.3f}" in printed
    assert "dev_req" in printed and "merged" in printed
    assert out_png.stat().st_size > 10_000
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert os.listdir(data_dir) == []  # the test file was removed


def test_bench_io_on_tmpfs_reports_na(tmp_path, capsys):
    shm = "/dev/shm"
    from phx.bench._common import storage_description
    if not os.path.isdir(shm) or storage_description(shm)["fstype"] != "tmpfs":
        pytest.skip("/dev/shm is not a tmpfs here")
    if shutil.disk_usage(shm).free < 256 * MiB:
        pytest.skip("/dev/shm too small")
    d = tempfile.mkdtemp(dir=shm)
    try:
        out_json = tmp_path / "r.json"
        rc = main(["bench", "io", "--dir", d, "--size", "4m", "--bs", "4k", "--qd", "2",
                   "--ops", "read", "--methods", "preadv", "--runtime", "0.05", "--repeat", "1",
                   "--json", str(out_json), "--quiet"])
        printed = capsys.readouterr().out
        assert rc == 0, printed
        doc = json.loads(out_json.read_text())
        (r,) = doc["rows"]
        assert r["blockdev"] is None and "no block device" in r["blockdev_na"]
        assert doc["config"]["targets"][0]["blockdev"] is None
        assert "n/a" in printed
    finally:
        shutil.rmtree(d, ignore_errors=True)


@needs_root
@needs_fio
@needs_phx
def test_bench_io_zram_row_set(data_dir, tmp_path, capsys):
    _zram_skip(256 * MiB)
    before = _zram_devices()
    out_json, out_png = tmp_path / "r.json", tmp_path / "p.png"
    rc = main(["bench", "io", "--dir", data_dir, "--size", "16m", "--zram", "256m",
               "--bs", "4k", "--qd", "32", "--ops", "randread", "--runtime", "0.05",
               "--repeat", "2", "--json", str(out_json), "--plot", str(out_png),
               "--quiet"])
    printed = capsys.readouterr().out
    assert rc == 0, printed
    doc = json.loads(out_json.read_text())
    labels = [t["label"] for t in doc["config"]["targets"]]
    assert labels == ["disk", "zram"]
    z = doc["config"]["targets"][1]
    assert z["blockdev"]["kind"] == "zram" and z["zram"]["disksize"] == 256 * MiB
    zrows = [r for r in doc["rows"] if r["target"] == "zram"]
    assert len(zrows) == len(bio.ENGINES) and all(r["blockdev"]["requests"] > 0 for r in zrows)
    zfio = next(r for r in zrows if r["engine"] == "fio")
    assert _opts(zfio["fio_argv"])["--filename"] == z["path"]
    check = next(c for c in doc["checks"] if c["target"] == "zram")
    assert check["status"] in ("PASS", "FAIL") and check["threshold"] == 1.2
    assert "== zram" in printed
    assert (tmp_path / "p-zram.png").stat().st_size > 10_000 and out_png.exists()
    assert _zram_devices() == before


def test_bench_io_refuses_existing_file(data_dir, capsys):
    path = os.path.join(data_dir, "precious")
    with open(path, "wb") as f:
        f.write(os.urandom(4096))
    with pytest.raises(SystemExit) as e:
        main(["bench", "io", "--dir", path, "--methods", "preadv", "--quiet"])
    assert e.value.code == 2 and "not a directory" in capsys.readouterr().err
    assert os.path.getsize(path) == 4096


def test_bench_io_refuses_small_zram(data_dir, capsys):
    assert main(["bench", "io", "--dir", data_dir, "--size", "1g", "--zram", "512m",
                 "--methods", "preadv", "--quiet"]) == 2
    assert "too small" in capsys.readouterr().err
    assert os.listdir(data_dir) == []
