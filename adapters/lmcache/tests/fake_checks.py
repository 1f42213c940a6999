"""libphxfile.so driven through LMCache's own phx backend, on tests/gpu_fake's
stand-in libcuda (run by tests/test_lmcache_fake.py in a subprocess with the
fake first on LD_LIBRARY_PATH).

"Device" memory is host memory there, so bytes are compared directly.  Each
check prints ``ok NAME`` or ``FAIL NAME: why``; a crash shows as a missing
line.  Usage: fake_checks.py WORKDIR SMALLFS_DIR|- CHECK...  (or ``all``).
"""
from __future__ import annotations

import ctypes
import errno
import os
import subprocess
import sys
import threading
import time
import traceback

import numpy as np

from lmcache.v1.gpu_connector.gds_backends import phx as lmphx
from lmcache.v1.gpu_connector.gds_backends.base import Submission

import phx_lmcache

cuda = ctypes.CDLL("libcuda.so.1")
assert hasattr(cuda, "fake_sleep_async"), "not the fake libcuda"
cuda.fake_sleep_async.argtypes = [ctypes.c_void_p, ctypes.c_ulong]
cuda.cuMemcpyDtoHAsync_v2.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_size_t,
                                      ctypes.c_void_p]
cuda.cuStreamSynchronize.argtypes = [ctypes.c_void_p]

WORK, SMALLFS = sys.argv[1], sys.argv[2]
RNG = np.random.default_rng(int.from_bytes(os.urandom(8), "little"))
MiB = 1 << 20


def alloc(n: int) -> int:
    p = ctypes.c_uint64()
    assert cuda.cuMemAlloc_v2(ctypes.byref(p), ctypes.c_size_t(n)) == 0
    return p.value


def view(p: int, n: int) -> np.ndarray:
    return np.ctypeslib.as_array((ctypes.c_ubyte * n).from_address(p))


def stream() -> int:
    s = ctypes.c_void_p()
    assert cuda.cuStreamCreate(ctypes.byref(s), 1) == 0
    return s.value


def sync(s: int) -> None:
    assert cuda.cuStreamSynchronize(ctypes.c_void_p(s)) == 0


def busy(s: int, ms: int) -> None:
    cuda.fake_sleep_async(ctypes.c_void_p(s), ms * 1000)


BACKEND = lmphx.Backend()


def lib():
    return BACKEND.library()


def register(p: int, n: int) -> None:
    rc = lib().phxFileBufRegister(ctypes.c_void_p(p), ctypes.c_size_t(n))
    assert rc == 0, rc


def deregister(p: int) -> int:
    return lib().phxFileBufDeregister(ctypes.c_void_p(p))


def slab(name: str, size: int, where: str = WORK):
    """LMCache's own open_slab: fallocated file, O_DIRECT, handle registered."""
    d = os.path.join(where, name)
    return BACKEND.open_slab(d, size, True)


def random(n: int) -> np.ndarray:
    return RNG.integers(0, 256, n, dtype=np.uint8)


def written(h, data: np.ndarray, foff: int, s: int) -> int:
    """A registered GPU buffer holding ``data``, written through ``h`` at ``foff``
    on stream ``s`` and checked; the caller deregisters it."""
    n = len(data)
    buf = alloc(n)
    register(buf, n)
    view(buf, n)[:] = data
    w = h.write_async(buf, n, foff, 0, s)
    sync(s)
    assert w.bytes_done == n, (w.bytes_done, n)
    return buf


def settled() -> dict:
    """phx_lmcache.stats() once no transfer counts as in flight: libphx ends a
    transfer (its counters, its log line) on its poller thread a moment after
    the stream has passed it, so a check that has just synchronised waits
    for that moment before reading the counters."""
    deadline = time.monotonic() + 5
    st = phx_lmcache.stats()
    while st["inflight"] and time.monotonic() < deadline:
        time.sleep(0.001)
        st = phx_lmcache.stats()
    return st


class Skip(Exception):
    pass


# ---------------------------------------------------------------------------

def check_loaded_is_ours():
    maps = open("/proc/self/maps").read()
    want = os.path.realpath(phx_lmcache.library_path())
    assert want in maps, "LMCache's libphxfile.so is not this package's"


def check_roundtrip_chunks():
    """Random KV chunks through the slab, split at 16 MiB-like region edges
    (regions of 1 MiB + odd here), byte-exact, bytes_done per transfer."""
    region, nreg = MiB + 4096 * 3, 4
    buf = alloc(region * nreg)
    for r in range(nreg):
        register(buf + r * region, region)
    s = stream()
    h = slab("rt", 64 * MiB)
    chunks = [(int(RNG.integers(1, 3 * region)), int(RNG.integers(0, 60 * MiB)))
              for _ in range(24)]
    for size, foff in chunks:
        data = random(size)
        src = alloc(size)
        view(src, size)[:] = data
        register(src, size)
        sub = h.write_async(src, size, foff, 0, s)
        sync(s)
        assert sub.bytes_done == size, (sub.bytes_done, size)
        # read back into the staging regions, cut at region boundaries as
        # GDSContext.transfer_async does
        dst_off = int(RNG.integers(0, region))
        pos, subs = 0, []
        while pos < size:
            r, off = divmod(dst_off + pos, region)
            if r >= nreg:
                break
            seg = min(size - pos, region - off)
            subs.append((h.read_async(buf + r * region, seg, foff + pos, off, s), seg))
            pos += seg
        sync(s)
        assert all(x.bytes_done == seg for x, seg in subs), [x.bytes_done for x, _ in subs]
        got = view(buf + dst_off, pos)
        assert (got == data[:pos]).all(), "bytes differ"
        assert deregister(src) == 0
    st = settled()
    assert st["failures"] == 0 and st["reads"] > 0 and st["writes"] == len(chunks), st
    h.close()
    for r in range(nreg):
        assert deregister(buf + r * region) == 0


def check_deferred_arguments():
    """The Submission's size and offsets are read when the stream arrives."""
    n = 3 * MiB + 7
    data = random(n)
    h = slab("deferred", 8 * MiB)
    s = stream()
    src = written(h, data, 0, s)
    dst = alloc(n + 100)
    register(dst, n + 100)
    view(dst, n + 100)[:] = 0xAB
    busy(s, 200)
    sub = h.read_async(dst, 10, 0, 0, s)      # placeholder arguments...
    sub.size.value = 123457                    # ...changed before arrival
    sub.file_offset.value = 4099
    sub.buf_offset.value = 17
    sync(s)
    assert sub.bytes_done == 123457, sub.bytes_done
    got = view(dst, n + 100)
    assert (got[17:17 + 123457] == data[4099:4099 + 123457]).all()
    assert (got[:17] == 0xAB).all() and (got[17 + 123457:] == 0xAB).all()
    h.close()
    deregister(src)
    deregister(dst)


def _queued_reads(h, dst: int, data: np.ndarray, s: int, n: int = 6) -> int:
    """``n`` unaligned reads queued behind a busy stream, checked; the early
    reads they made (phx_lmcache.stats())."""
    before = phx_lmcache.stats()["early_reads"]
    busy(s, 150)
    subs = [(h.read_async(dst, 300001 + i, 4096 * i + 3 * i, 400000 * i + i, s),
             300001 + i, 4096 * i + 3 * i, 400000 * i + i) for i in range(n)]
    sync(s)
    for sub, size, foff, boff in subs:
        assert sub.bytes_done == size, (sub.bytes_done, size)
        assert (view(dst + boff, size) == data[foff:foff + size]).all(), "bytes differ"
    return phx_lmcache.stats()["early_reads"] - before


def check_early_reads():
    """libphx's early reads are on by default in libphxfile (the slab is this
    process's alone), off with PHX_CUDA_EARLY_READS=0 and once the direct path
    has run (here: the slab written through it); right either way.  On the
    direct path registered buffers bypass staging, so there the reads go into an
    unregistered buffer, which staging serves on either path."""
    direct = phx_lmcache.stats()["path"] == "direct"
    n = 4 * MiB + 5
    data = random(n)
    h = slab("early", 8 * MiB)
    s = stream()
    buf = written(h, data, 0, s)
    dst = alloc(6 * 400000 + 400000)
    if not direct:
        register(dst, 6 * 400000 + 400000)
    early = _queued_reads(h, dst, data, s)
    if os.environ.get("PHX_CUDA_EARLY_READS") == "0":
        assert early == 0, f"{early} early reads with PHX_CUDA_EARLY_READS=0"
    elif direct:
        # the slab was written through the direct path: early reads are off
        assert early == 0, f"{early} early reads after the direct path ran"
    else:
        assert early >= 3, f"only {early} of 6 reads behind a busy stream were early"
    h.close()
    deregister(buf)
    if not direct:
        deregister(dst)


def _two_devices(name):
    """Contexts on devices 0 and 1 (FAKE_CUDA_DEVICES=2), a slab written from
    device 0 and its reads shown to go early when device 0 is alone: the
    starting point of the two-device early-read checks."""
    if os.environ.get("FAKE_CUDA_DEVICES", "1") == "1":
        raise Skip("needs FAKE_CUDA_DEVICES=2")
    ctxs = []
    for d in (0, 1):
        c = ctypes.c_void_p()
        assert cuda.cuDevicePrimaryCtxRetain(ctypes.byref(c), d) == 0
        ctxs.append(c)
    data = random(4 * MiB + 5)
    h = slab(name, 8 * MiB)
    assert cuda.cuCtxPushCurrent_v2(ctxs[0]) == 0
    dst, s = alloc(3 * MiB), stream()
    register(dst, 3 * MiB)
    buf = written(h, data, 0, s)
    assert _queued_reads(h, dst, data, s, 4) >= 2, "device 0 alone: no early reads"
    assert cuda.cuCtxPopCurrent_v2(None) == 0
    return ctxs, data, h, dst, s, buf


def check_second_device_writes_void_early_reads():
    """Two devices in one process (FAKE_CUDA_DEVICES=2), early reads on for both:
    device 0's reads, queued behind a busy stream, read early; device 1 then
    rewrites their range through its own context before device 0's stream gets
    there.  libphx's per-inode write log sees a write from any context, so the
    early bytes are thrown away and the reads return device 1's data."""
    ctxs, data, h, dst, s, buf = _two_devices("two")
    assert cuda.cuCtxPushCurrent_v2(ctxs[1]) == 0          # device 1 has a context now
    buf1 = written(h, data[: MiB], 0, stream())
    assert cuda.cuCtxPopCurrent_v2(None) == 0
    # device 0: reads behind a busy stream, early pieces read ...
    assert cuda.cuCtxPushCurrent_v2(ctxs[0]) == 0
    misses = phx_lmcache.stats()["early_misses"]
    busy(s, 300)
    subs = [(h.read_async(dst, 300001 + i, 4096 * i + 3 * i, 400000 * i + i, s),
             300001 + i, 4096 * i + 3 * i, 400000 * i + i) for i in range(4)]
    time.sleep(0.1)
    assert cuda.cuCtxPopCurrent_v2(None) == 0
    # ... then device 1 rewrites their range, done before device 0's stream arrives
    new = random(2 * MiB)
    data[: 2 * MiB] = new
    assert cuda.cuCtxPushCurrent_v2(ctxs[1]) == 0
    buf2 = written(h, new, 0, stream())
    assert cuda.cuCtxPopCurrent_v2(None) == 0
    sync(s)
    for sub, size, foff, boff in subs:
        assert sub.bytes_done == size, (sub.bytes_done, size)
        assert (view(dst + boff, size) == data[foff:foff + size]).all(), \
            "an early read served bytes another device's context had rewritten"
    assert phx_lmcache.stats()["early_misses"] - misses >= 1, "no early read was voided"
    h.close()
    for p in (buf, dst, buf1, buf2):
        assert deregister(p) == 0


def check_second_device_pending_write_blocks_early_reads():
    """Two devices (FAKE_CUDA_DEVICES=2): device 1 queues a rewrite of a range
    behind a busy stream (accepted, not yet in the file); device 0 then queues
    reads of that range behind a longer busy stream.  libphx's per-inode write
    log is process-wide, so device 0's context sees device 1's pending write
    and starts no early read of the range (none voided later either: nothing
    was read early to void), and the reads, arriving after the write, return
    device 1's bytes.  A log per context would start them early, on the old
    bytes (the change-time check would then void them: early_misses)."""
    ctxs, data, h, dst, s0, buf = _two_devices("pending")
    # device 1: the rewrite, pending behind a busy stream
    assert cuda.cuCtxPushCurrent_v2(ctxs[1]) == 0
    new = random(2 * MiB)
    s1 = stream()
    src1 = alloc(2 * MiB)
    register(src1, 2 * MiB)
    view(src1, 2 * MiB)[:] = new
    busy(s1, 200)
    w = h.write_async(src1, 2 * MiB, 0, 0, s1)
    assert cuda.cuCtxPopCurrent_v2(None) == 0
    data[: 2 * MiB] = new
    # device 0: reads of that range, arriving after the write has landed
    assert cuda.cuCtxPushCurrent_v2(ctxs[0]) == 0
    st0 = phx_lmcache.stats()
    busy(s0, 900)
    subs = [(h.read_async(dst, 300001 + i, 4096 * i + 3 * i, 400000 * i + i, s0),
             300001 + i, 4096 * i + 3 * i, 400000 * i + i) for i in range(4)]
    sync(s0)
    assert cuda.cuCtxPopCurrent_v2(None) == 0
    assert cuda.cuCtxPushCurrent_v2(ctxs[1]) == 0
    sync(s1)
    assert cuda.cuCtxPopCurrent_v2(None) == 0
    assert w.bytes_done == 2 * MiB, w.bytes_done
    for sub, size, foff, boff in subs:
        assert sub.bytes_done == size, (sub.bytes_done, size)
        assert (view(dst + boff, size) == data[foff:foff + size]).all(), \
            "a read returned bytes from before another device's write"
    st1 = settled()
    started = (st1["early_reads"] - st0["early_reads"]) + (st1["early_misses"] - st0["early_misses"])
    assert started == 0, f"{started} reads started early under another device's pending write"
    h.close()
    for p in (buf, dst, src1):
        assert deregister(p) == 0


def check_work_after_read_sees_data():
    """A copy queued after the read on the same stream sees the read's data
    (the stream is held up first, so nothing has run at queue time)."""
    n = 5 * MiB + 11
    data = random(n)
    h = slab("order", 8 * MiB)
    s = stream()
    src = written(h, data, 4096, s)
    dst = alloc(n)
    register(dst, n)
    host = np.zeros(n, dtype=np.uint8)
    busy(s, 100)
    sub = h.read_async(dst, n, 4096, 0, s)
    assert cuda.cuMemcpyDtoHAsync_v2(host.ctypes.data, dst, n, ctypes.c_void_p(s)) == 0
    sync(s)
    assert sub.bytes_done == n
    assert (host == data).all(), "work queued after the read missed its data"
    h.close()
    deregister(src)
    deregister(dst)


def check_threads_and_streams():
    """Eight threads, each with its own stream, region and slab range."""
    h = slab("threads", 64 * MiB)
    errors: list[str] = []

    def worker(k: int) -> None:
        try:
            s = stream()
            n = 2 * MiB + 13 * k + 1
            buf = alloc(2 * n)
            register(buf, 2 * n)
            for it in range(6):
                data = random(n)
                view(buf, n)[:] = data
                foff = k * 8 * MiB + it * 7
                w = h.write_async(buf, n, foff, 0, s)
                r = h.read_async(buf, n, foff, n, s)
                sync(s)
                if (w.bytes_done, r.bytes_done) != (n, n):
                    errors.append(f"{k}/{it}: {w.bytes_done} {r.bytes_done}")
                if not (view(buf + n, n) == data).all():
                    errors.append(f"{k}/{it}: bytes differ")
            assert deregister(buf) == 0
        except Exception as e:  # noqa: BLE001
            errors.append(f"{k}: {e!r}")

    th = [threading.Thread(target=worker, args=(k,)) for k in range(8)]
    for t in th:
        t.start()
    for t in th:
        t.join()
    assert not errors, errors
    h.close()


def check_unregistered_buffer():
    """An unregistered GPU buffer works and is counted; host memory is -EINVAL."""
    before = settled()["unregistered_ops"]
    n = MiB + 5
    data = random(n)
    src = alloc(n)
    view(src, n)[:] = data
    h = slab("unreg", 4 * MiB)
    s = stream()
    w = h.write_async(src, n, 0, 0, s)
    dst = alloc(n)
    r = h.read_async(dst, n, 0, 0, s)
    sync(s)
    assert (w.bytes_done, r.bytes_done) == (n, n)
    assert (view(dst, n) == data).all()
    assert settled()["unregistered_ops"] == before + 2
    host = np.zeros(4096, dtype=np.uint8)
    try:
        h.read_async(host.ctypes.data, 4096, 0, 0, s)
    except RuntimeError as e:
        assert f"rc={-errno.EINVAL}" in str(e), e
    else:
        raise AssertionError("host memory accepted")
    h.close()


def check_enospc():
    """A slab on a full filesystem: a write past the fallocated slab fails
    with -ENOSPC in bytes_done, logged once; a load of that range is refused
    (-EIO at submission); the slab is untouched."""
    if SMALLFS == "-":
        raise Skip("no small filesystem (needs root to mount one)")
    h = slab("small", 4 * MiB, SMALLFS)
    n = 2 * MiB
    data = random(n)
    src = alloc(n)
    register(src, n)
    view(src, n)[:] = data
    s = stream()
    ok = h.write_async(src, n, 0, 0, s)
    sync(s)
    assert ok.bytes_done == n
    filler = os.path.join(SMALLFS, "filler")
    with open(filler, "wb") as f:
        try:
            while True:
                f.write(b"\0" * (1 << 20))
                f.flush()
        except OSError as e:
            assert e.errno == errno.ENOSPC
    before = settled()["failures"]
    bad = [h.write_async(src, n, (8 + 2 * i) * MiB, 0, s) for i in range(2)]
    sync(s)
    assert [b.bytes_done for b in bad] == [-errno.ENOSPC] * 2, [b.bytes_done for b in bad]
    st = settled()
    assert st["failures"] == before + 2 and st["last_error"] == -errno.ENOSPC, st
    dst = alloc(n)
    register(dst, n)
    # a range whose write failed holds no KV: its load is refused (LMCache
    # sees a failed retrieve and recomputes), the destination untouched
    view(dst, n)[:] = 0x5A
    try:
        h.read_async(dst, n, 8 * MiB, 0, s)
    except RuntimeError as e:
        assert f"rc={-errno.EIO}" in str(e), e
    else:
        raise AssertionError("a load of a failed store's range was accepted")
    assert (view(dst, n) == 0x5A).all(), "a refused load wrote the destination"
    assert settled()["bad_refusals"] >= 1
    r = h.read_async(dst, n, 0, 0, s)
    sync(s)
    assert r.bytes_done == n and (view(dst, n) == data).all(), "slab corrupted"
    h.close()
    os.unlink(filler)
    deregister(src)
    deregister(dst)


def check_failure_totals():
    """Failures are logged with running totals, not only once
    (PHXFILE_LOG_INTERVAL_S=1 here): three ENOSPC writes at once give the
    first line; a second later the periodic flush adds "3 times so far, 2
    since the last line"; a fourth failure after the interval gets its own
    line at once (or from the flush, or at driver close, on a slow box).  The
    test reads the lines from stderr."""
    if SMALLFS == "-":
        raise Skip("no small filesystem (needs root to mount one)")
    if os.environ.get("PHXFILE_LOG_INTERVAL_S") != "1":
        raise Skip("needs PHXFILE_LOG_INTERVAL_S=1")
    h = slab("totals", 1 * MiB, SMALLFS)
    n = MiB
    src = alloc(n)
    register(src, n)
    view(src, n)[:] = random(n)
    filler = os.path.join(SMALLFS, "filler2")
    with open(filler, "wb") as f:
        try:
            while True:
                f.write(b"\0" * (1 << 20))
                f.flush()
        except OSError as e:
            assert e.errno == errno.ENOSPC
    s = stream()
    bad = [h.write_async(src, n, (4 + 2 * i) * MiB, 0, s) for i in range(3)]
    sync(s)
    assert [b.bytes_done for b in bad] == [-errno.ENOSPC] * 3, [b.bytes_done for b in bad]
    time.sleep(2.2)                      # the periodic flush's line, then the interval again
    w = h.write_async(src, n, 12 * MiB, 0, s)
    sync(s)
    assert w.bytes_done == -errno.ENOSPC
    settled()
    h.close()
    os.unlink(filler)
    deregister(src)
    # driver close: a line for any failure not yet in one
    while phx_lmcache.stats()["path"] != "none":
        assert lib().phxFileDriverClose() == 0


def check_startup_no_memops():
    """A GPU without stream memory operations (FAKE_CUDA_NO_MEMOPS=1) is
    refused when its first buffer is registered (LMCache's register_buffer
    raises), with one line saying why, not at its first transfer; a transfer
    on its memory is refused the same way, with no second line."""
    if not os.environ.get("FAKE_CUDA_NO_MEMOPS"):
        raise Skip("needs FAKE_CUDA_NO_MEMOPS=1")
    n = MiB
    p = alloc(n)
    rc = lib().phxFileBufRegister(ctypes.c_void_p(p), ctypes.c_size_t(n))
    assert rc == -errno.EOPNOTSUPP, rc
    assert settled()["buffers"] == 0
    h = slab("nomemops", 4 * MiB)
    try:
        h.read_async(p, n, 0, 0, stream())
    except RuntimeError as e:
        assert f"rc={-errno.EOPNOTSUPP}" in str(e), e
    else:
        raise AssertionError("a transfer on a device without stream ops was accepted")
    h.close()


def check_startup_pinning():
    """The staging context's pinned memory cannot be registered with CUDA
    (the fake's next cuMemHostRegister fails): the first buffer registration
    fails and says so; the refusal is kept (no retry per call)."""
    cuda.fake_fail_host_register(0)
    n = MiB
    p = alloc(n)
    rc = lib().phxFileBufRegister(ctypes.c_void_p(p), ctypes.c_size_t(n))
    assert rc < 0, rc
    rc2 = lib().phxFileBufRegister(ctypes.c_void_p(p), ctypes.c_size_t(n))
    assert rc2 == rc, (rc, rc2)
    assert settled()["buffers"] == 0


def _dm_load(table: str) -> None:
    # --nolockfs: suspending a device with ext4 mounted on it would freeze the
    # filesystem, whose flush fails while the table refuses writes (EIO)
    name, env = os.environ["PHX_TEST_DM"], dict(os.environ, DM_DISABLE_UDEV="1")
    for cmd in (["suspend", "--nolockfs"], ["reload"], ["resume"]):
        subprocess.run(["dmsetup", "--noudevsync", *cmd, name], env=env, check=True,
                       input=table + "\n" if cmd[0] == "reload" else None, text=True)


def check_dm_failed_store():
    """The slab on a device that starts failing writes (dm-flakey with
    error_writes, set up by tests/guest/test_guest_dm.py in the QEMU guest):
    the failed store's chunk is a failed load (-EIO at submission) although
    the device still holds the old bytes; the good chunk loads right;
    healthy again, the chunk stored anew loads right."""
    if not os.environ.get("PHX_TEST_DM"):
        raise Skip("needs PHX_TEST_DM (tests/guest/test_guest_dm.py, in the QEMU guest)")
    n = 2 * MiB
    h = slab("dm", 16 * MiB)
    # every slot written once, fsynced: no unwritten extent is left for ext4
    # to convert (journal writes) while the device refuses writes
    slab_file = os.path.join(WORK, "dm", "lmcache_gds_slab.bin")
    with open(slab_file, "r+b") as fh:
        fh.write(b"\0" * (16 * MiB))
        fh.flush()
        os.fsync(fh.fileno())
    s = stream()
    good, old, new = random(n), random(n), random(n)
    src = written(h, good, 0, s)
    view(src, n)[:] = old
    w = h.write_async(src, n, 4 * MiB, 0, s)
    sync(s)
    assert w.bytes_done == n
    _dm_load(os.environ["PHX_TEST_DM_FLAKEY"])
    try:
        view(src, n)[:] = new
        w = h.write_async(src, n, 4 * MiB, 0, s)
        sync(s)
        assert w.bytes_done == -errno.EIO, w.bytes_done
        with open(slab_file, "rb") as fh:
            fh.seek(4 * MiB)
            assert fh.read(4096) == old[:4096].tobytes(), "the device does not hold the old bytes"
        dst = alloc(n)
        register(dst, n)
        view(dst, n)[:] = 0x5A
        try:
            h.read_async(dst, n, 4 * MiB, 0, s)
        except RuntimeError as e:
            assert f"rc={-errno.EIO}" in str(e), e
        else:
            raise AssertionError("the failed store's chunk was loaded")
        assert (view(dst, n) == 0x5A).all(), "a refused load wrote the destination"
        r = h.read_async(dst, n, 0, 0, s)
        sync(s)
        assert r.bytes_done == n and (view(dst, n) == good).all(), "the good chunk"
    finally:
        _dm_load(os.environ["PHX_TEST_DM_LINEAR"])
    view(src, n)[:] = new
    w = h.write_async(src, n, 4 * MiB, 0, s)
    sync(s)
    assert w.bytes_done == n
    r = h.read_async(dst, n, 4 * MiB, 0, s)
    sync(s)
    assert r.bytes_done == n and (view(dst, n) == new).all(), "the chunk stored anew"
    assert settled()["bad_refusals"] >= 1
    h.close()
    deregister(src)
    deregister(dst)


def check_closed_fd():
    """A closed fd is -EBADF; closing the caller's fd after registration and
    reusing its number for another file never redirects the slab's I/O."""
    path = os.path.join(WORK, "closed.bin")
    fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o644)
    os.ftruncate(fd, 4 * MiB)
    os.close(fd)
    fh = ctypes.c_void_p()
    rc = lib().phxFileHandleRegister(ctypes.byref(fh), fd)
    assert rc == -errno.EBADF, rc
    try:
        BACKEND.register_handle(fd)
    except RuntimeError as e:
        assert f"rc={-errno.EBADF}" in str(e)
    else:
        raise AssertionError("closed fd accepted")
    fd = os.open(path, os.O_RDWR | os.O_DIRECT)
    hnd = BACKEND.register_handle(fd)
    os.close(fd)
    other = os.path.join(WORK, "other.bin")
    fd2 = os.open(other, os.O_CREAT | os.O_RDWR, 0o644)
    assert fd2 == fd, "the fd number was not reused; the check needs it"
    n = 64 * 1024
    data = random(n)
    src = alloc(n)
    view(src, n)[:] = data
    register(src, n)
    s = stream()
    sub = Submission(n, 0, 0)
    rc = lib().phxFileWriteAsync(ctypes.c_void_p(hnd), ctypes.c_void_p(src),
                                 ctypes.byref(sub.size), ctypes.byref(sub.file_offset),
                                 ctypes.byref(sub.buf_offset), ctypes.byref(sub.result),
                                 ctypes.c_void_p(s))
    assert rc == 0
    sync(s)
    assert sub.bytes_done == n
    assert os.fstat(fd2).st_size == 0, "I/O went to the file that reused the number"
    assert (np.fromfile(path, dtype=np.uint8, count=n) == data).all()
    os.close(fd2)
    assert lib().phxFileHandleDeregister(ctypes.c_void_p(hnd)) == 0
    assert lib().phxFileHandleDeregister(ctypes.c_void_p(hnd)) == -errno.EBADF
    # a stale handle in a transfer: -EBADF, no crash
    rc = lib().phxFileReadAsync(ctypes.c_void_p(hnd), ctypes.c_void_p(src),
                                ctypes.byref(sub.size), ctypes.byref(sub.file_offset),
                                ctypes.byref(sub.buf_offset), ctypes.byref(sub.result),
                                ctypes.c_void_p(s))
    assert rc == -errno.EBADF, rc
    deregister(src)


def check_registration_rules():
    """Overlaps, unknown bases; deregistration with I/O in flight waits for it."""
    n = 2 * MiB
    p = alloc(n)
    register(p, n)
    assert lib().phxFileBufRegister(ctypes.c_void_p(p + 4096), ctypes.c_size_t(4096)) == -errno.EEXIST
    assert lib().phxFileBufRegister(ctypes.c_void_p(p), ctypes.c_size_t(0)) == -errno.EINVAL
    assert deregister(p + 1) == -errno.ENOENT
    h = slab("rules", 4 * MiB)
    s = stream()
    busy(s, 200)
    sub = h.read_async(p, n, 0, 0, s)
    t0 = time.monotonic()
    assert deregister(p) == 0            # waits for the transfer in flight
    assert time.monotonic() - t0 > 0.1, "deregistration did not wait for the transfer"
    assert sub.bytes_done == n
    sync(s)
    assert deregister(p) == -errno.ENOENT
    h.close()


def check_close_with_io_in_flight():
    """Deregistering a handle (LMCache's slab close) with transfers queued
    waits for them; the driver refuses to close while anything is
    registered and closes once it is not."""
    n = 4 * MiB
    data = random(n)
    p = alloc(n)
    register(p, n)
    view(p, n)[:] = data
    h = slab("inflight", 8 * MiB)
    s = stream()
    busy(s, 300)
    w = h.write_async(p, n, 0, 0, s)
    t0 = time.monotonic()
    rc = lib().phxFileDriverClose()
    assert rc == -errno.EBUSY, rc
    h.close()                      # phxFileHandleDeregister, then os.close
    waited = time.monotonic() - t0
    assert waited > 0.2, f"deregistration did not wait ({waited:.3f} s)"
    assert w.bytes_done == n, w.bytes_done
    assert settled()["inflight"] == 0
    assert (np.fromfile(os.path.join(WORK, "inflight", "lmcache_gds_slab.bin"),
                        dtype=np.uint8, count=n) == data).all()
    assert deregister(p) == 0


def check_driver_refcount():
    """Explicit opens are counted; the implicit one (LMCache never calls
    phxFileDriverOpen) is dropped by one close; extra closes are no-ops."""
    L = lib()
    st = phx_lmcache.stats()
    assert st["buffers"] == 0 and st["handles"] == 0, st
    while phx_lmcache.stats()["path"] != "none":
        assert L.phxFileDriverClose() == 0
    assert L.phxFileDriverClose() == 0
    opens = phx_lmcache.stats()["driver_opens"]
    assert L.phxFileDriverOpen() == 0 and L.phxFileDriverOpen() == 0
    assert phx_lmcache.stats()["driver_opens"] == opens + 1
    assert L.phxFileDriverClose() == 0
    assert phx_lmcache.stats()["path"] != "none"
    assert L.phxFileDriverClose() == 0
    assert phx_lmcache.stats()["path"] == "none"
    # implicit: a registration opens it, the backend's close_driver closes it
    p = alloc(4096)
    register(p, 4096)
    assert phx_lmcache.stats()["path"] != "none"
    assert deregister(p) == 0
    BACKEND._driver.acquire(BACKEND, BACKEND._open_driver)
    BACKEND.close_driver()
    assert phx_lmcache.stats()["path"] == "none"


CHECKS = {name[6:]: fn for name, fn in globals().items() if name.startswith("check_")}


def main() -> int:
    names = sys.argv[3:]
    if names == ["all"]:
        # the refcount check needs a driver with nothing registered: first;
        # the start-up checks leave their device refused: run alone
        alone = ("driver_refcount", "startup_pinning", "startup_no_memops", "failure_totals")
        names = ["driver_refcount"] + [n for n in CHECKS if n not in alone]
    for name in names:
        try:
            CHECKS[name]()
            print(f"ok {name}", flush=True)
        except Skip as e:
            print(f"skip {name}: {e}", flush=True)
        except Exception as e:  # noqa: BLE001
            tb = traceback.format_exc().strip().splitlines()
            print(f"FAIL {name}: {e!r} [{' | '.join(tb[-4:])}]", flush=True)
    st = phx_lmcache.stats()
    print("stats", st, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
