"""Fault checks of phx's LMCache L2 plugin against real LMCache 0.5.6 (CPU).

Run by tests/test_lmcache_l2.py as one process per run: it imports torch and
lmcache once (seconds on a busy box), then runs every phase of every scenario
in a forked child (a real process with its own LMCache StorageManager and the
plugin loaded from LMCache's configuration: ``storage_plugins`` +
``extra_config``), so a writer can be killed with SIGKILL and a restart is a
new process.  This process itself starts no thread before forking.

    l2_checks.py --seed S --fs ext4=/mnt/a [--fs xfs=/mnt/b] [--only name,...]

prints one JSON object: {fs: {scenario: result}}.  Every chunk is fresh random
data from (seed, index); every get is compared byte for byte.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import shutil
import signal
import sys
import threading
import time
import traceback

import numpy as np
import torch

from lmcache.utils import CacheEngineKey
from lmcache.v1.config import LMCacheEngineConfig
from lmcache.v1.event_manager import EventManager
from lmcache.v1.metadata import LMCacheMetadata
from lmcache.v1.storage_backend.storage_manager import StorageManager

LAYERS, HEADS, HD, TOK = 2, 2, 64, 256
SHAPE = torch.Size([2, LAYERS, TOK, HEADS * HD])
CHUNK = 2 * LAYERS * TOK * HEADS * HD * 2          # 256 KiB of bf16
SLOT = 4096 + CHUNK
SEED = 0


def data(i: int) -> np.ndarray:
    return np.random.default_rng([SEED, i]).integers(0, 256, CHUNK, dtype=np.uint8)


def key(i: int) -> CacheEngineKey:
    return CacheEngineKey("phx-l2-test", 1, 0, 0x1000 + i, torch.bfloat16)


def make(slab: str, slots: int, **extra: object) -> tuple[StorageManager, object, object]:
    cfg = make_cfg(slab, slots, **extra)
    md = LMCacheMetadata(model_name="phx-l2-test", world_size=1, local_world_size=1,
                         worker_id=0, local_worker_id=0, kv_dtype=torch.bfloat16,
                         kv_shape=(LAYERS, 2, TOK, HEADS, HD))
    sm = StorageManager(cfg, md, EventManager())
    return sm, sm.storage_backends.get("phx_l2"), sm.storage_backends["LocalCPUBackend"]


def make_cfg(slab: str, slots: int, **extra: object) -> LMCacheEngineConfig:
    """LMCache's configuration with the plugin (capacity: ``slots`` chunks in all)."""
    ex = {"storage_plugin.phx_l2.module_path": "phx_lmcache.l2",
          "storage_plugin.phx_l2.class_name": "PhxL2Backend",
          "phx_l2.paths": slab,
          "phx_l2.capacity_gb": (4096 + slots * SLOT) / (1 << 30),
          # 4 pieces per chunk, 2 in flight: the verify pipeline's piece and window
          # paths; one reader whatever the CPUs (sc_flip_payload also runs two, and
          # "auto" as on 16 CPUs); two payload writers whatever the CPUs, so every
          # fault below meets puts written by two engines at once (sc_enospc also
          # runs one, sc_two_files three); payloads written in 4 pieces each, so a
          # fault can fail one piece of a chunk and leave the others written
          "phx_l2.read_piece_kb": 64, "phx_l2.read_window": 2, "phx_l2.readers": 1,
          "phx_l2.writers": 2, "phx_l2.write_piece_kb": 64}
    ex.update({f"phx_l2.{k}": v for k, v in extra.items()})
    if "," in slab:
        ex["phx_l2.capacity_gb"] = (slab.count(",") + 1) * (4096 + slots * SLOT) / (1 << 30)
    return LMCacheEngineConfig.from_defaults(chunk_size=TOK, local_cpu=True,
                                             max_local_cpu_size=0.1,
                                             storage_plugins=["phx_l2"], extra_config=ex)


def put(sm, l2, cpu, idx: list[int]) -> None:
    """Through LMCache's own StorageManager.batched_put, then wait for the tier."""
    objs = []
    for i in idx:
        o = cpu.allocate(SHAPE, torch.bfloat16)
        assert o is not None, "CPU pool exhausted"
        np.frombuffer(o.byte_array, dtype=np.uint8)[:] = data(i)
        objs.append(o)
    sm.batched_put([key(i) for i in idx], objs)
    assert l2.flush(60)


def check(sm, l2, idx: list[int]) -> dict:
    """Get each index from the tier (LMCache's batched_get, location = the
    plugin) and compare bytes: exact / wrong / missing."""
    out = {"exact": [], "wrong": [], "missing": []}
    for s in range(0, len(idx), 8):
        part = idx[s:s + 8]
        objs = l2.batched_get_blocking([key(i) for i in part])
        for i, o in zip(part, objs):
            if o is None:
                out["missing"].append(i)
                continue
            got = np.frombuffer(o.byte_array, dtype=np.uint8)
            (out["exact"] if np.array_equal(got, data(i)) else out["wrong"]).append(i)
            o.ref_count_down()
    return out


def stats(l2) -> dict:
    return {k: v for k, v in l2.stats().items()}


def slot_offset(l2, i: int) -> int:
    e = l2._index[key(i).to_string()]
    return l2._slab.locate(e.slot)[1]


def flip(path: str, off: int) -> None:
    fd = os.open(path, os.O_RDWR)
    try:
        b = bytearray(os.pread(fd, 1, off))
        b[0] ^= 0x10
        os.pwrite(fd, bytes(b), off)
        os.fsync(fd)
    finally:
        os.close(fd)


def file_hash(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while blk := f.read(1 << 20):
            h.update(blk)
    return h.hexdigest()


# ---------------------------------------------------------------- forking
class Child:
    def __init__(self, fn, *args, env: dict | None = None) -> None:
        r, w = os.pipe()
        self.pid = os.fork()
        if self.pid == 0:
            os.close(r)
            code = 0
            try:
                if env:
                    os.environ.update(env)
                res = fn(*args, out=w)
                os.write(w, (json.dumps({"result": res}) + "\n").encode())
            except BaseException:
                os.write(w, (json.dumps({"error": traceback.format_exc()}) + "\n").encode())
                code = 1
            finally:
                os._exit(code)
        os.close(w)
        self.f = os.fdopen(r, "r")

    def lines(self, timeout: float | None = None):
        """Messages as they come; with a timeout, None whenever none came in time."""
        import select
        while True:
            if timeout is not None and not select.select([self.f], [], [], timeout)[0]:
                yield None
                continue
            line = self.f.readline()
            if not line:
                return
            yield json.loads(line)

    def finish(self) -> dict:
        res: dict = {}
        for msg in self.lines():
            res = msg
        os.waitpid(self.pid, 0)
        self.f.close()
        if "error" in res:
            raise RuntimeError(res["error"])
        return res.get("result", {"killed": True})

    def kill(self) -> None:
        os.kill(self.pid, signal.SIGKILL)


def run(fn, *args, env: dict | None = None) -> dict:
    return Child(fn, *args, env=env).finish()


def say(out: int, **kw) -> None:
    os.write(out, (json.dumps(kw) + "\n").encode())


# ---------------------------------------------------------------- phases
def ph_put(slab, slots, idx, extra=None, check_after=True, close=True, *, out):
    sm, l2, cpu = make(slab, slots, **(extra or {}))
    put(sm, l2, cpu, idx)
    res = {"check": check(sm, l2, idx) if check_after else None, "stats": stats(l2),
           "offsets": {i: slot_offset(l2, i) for i in idx
                       if key(i).to_string() in l2._index}}
    if close:
        sm.close()
    return res


def ph_check(slab, slots, idx, extra=None, *, out):
    sm, l2, cpu = make(slab, slots, **(extra or {}))
    if l2 is None:
        return {"no_plugin": True}
    res = {"check": check(sm, l2, idx), "stats": stats(l2)}
    sm.close()
    return res


def ph_writer(slab, slots, first=0, batch=4, crash_from=None, *, out):
    """Puts batches forever (for kill -9), saying which finished."""
    sm, l2, cpu = make(slab, slots)
    i = first
    while True:
        if crash_from is not None and i >= crash_from[0]:
            os.environ["PHX_L2_TEST_CRASH"] = crash_from[1]
        idx = list(range(i, i + batch))
        put(sm, l2, cpu, idx)
        say(out, acked=idx)
        i += batch
        if crash_from is None and i + batch - first > slots:   # never evict: acked must stay
            time.sleep(60)


# ---------------------------------------------------------------- scenarios
def sc_roundtrip(d):
    slab = os.path.join(d, "rt.slab")
    idx = list(range(24))

    def phase_a(out):
        sm, l2, cpu = make(slab, 32)
        put(sm, l2, cpu, idx[:16])
        put(sm, l2, cpu, idx[16:])
        before = check(sm, l2, idx)
        # LMCache's own paths: batched_get (tier by location), contains, pins, remove
        objs = sm.batched_get([key(i) for i in idx[:4]], location="phx_l2")
        via_sm = sum(o is not None and np.array_equal(np.frombuffer(o.byte_array, np.uint8),
                                                      data(i)) for i, o in zip(idx, objs))
        for o in objs:
            if o is not None:
                o.ref_count_down()
        api = {
            "contains": l2.contains(key(0)), "contains_absent": l2.contains(key(999)),
            "batched_contains": l2.batched_contains([key(0), key(1), key(999), key(2)]),
            "in_put_tasks": l2.exists_in_put_tasks(key(0)),
            "pin": l2.pin(key(3)), "unpin": l2.unpin(key(3)), "pin_absent": l2.pin(key(999)),
            "remove": l2.remove(key(5)), "remove_again": l2.remove(key(5)),
            "after_remove": l2.contains(key(5)),
        }
        import asyncio
        fut = asyncio.run_coroutine_threadsafe(
            l2.batched_async_contains("l", [key(6), key(7), key(5)], pin=True), sm.loop)
        api["async_contains"] = fut.result(30)
        fut = asyncio.run_coroutine_threadsafe(
            l2.batched_get_non_blocking("l", [key(6), key(7), key(5), key(8)]), sm.loop)
        got = fut.result(30)
        api["async_get"] = [bool(np.array_equal(np.frombuffer(o.byte_array, np.uint8), data(i)))
                            for i, o in zip([6, 7], got)] + [len(got)]
        for o in got:
            o.ref_count_down()
        l2.unpin(key(6)), l2.unpin(key(7))
        nb = l2.get_non_blocking(key(9))
        o = nb.result(30)
        api["get_non_blocking"] = bool(np.array_equal(np.frombuffer(o.byte_array, np.uint8),
                                                      data(9)))
        o.ref_count_down()
        st = stats(l2)
        sm.close()
        return {"before": before, "via_sm": int(via_sm), "api": api, "stats": st}

    a = run(phase_a)
    b = run(ph_check, slab, 32, idx)
    return {"a": a, "b": b}


def sc_kill_random(d, rounds=3):
    """kill -9 at a random moment while batches of puts run; restart."""
    res = []
    for r in range(rounds):
        slab = os.path.join(d, f"kill{r}.slab")
        slots = 512
        c = Child(ph_writer, slab, slots)
        acked: list[int] = []
        deadline = None
        for msg in c.lines(timeout=0.005):
            if msg is not None:
                acked += msg.get("acked", [])
            if acked and deadline is None:
                deadline = time.monotonic() + random.uniform(0.005, 0.2)
            if deadline is not None and time.monotonic() > deadline:
                c.kill()          # at a random moment, most likely inside a batch
                break
        c.finish()
        last = max(acked) + 1
        chk = run(ph_check, slab, slots, list(range(last + 8)))
        res.append({"acked": acked, "check": chk["check"], "stats": chk["stats"]})
        os.unlink(slab)
    return res


def sc_kill_header(d):
    """Batch 2 dies after 3 of its 8 headers are on disk (payloads all written)."""
    slab = os.path.join(d, "khdr.slab")
    c = Child(ph_writer, slab, 32, 0, 8, (8, "header:3"))
    acked = []
    for msg in c.lines():
        acked += msg.get("acked", [])
    c.finish()
    chk = run(ph_check, slab, 32, list(range(16)))
    return {"acked": acked, "check": chk["check"], "stats": chk["stats"]}


def sc_kill_reuse(d):
    """Full slab: the next batch evicts and reuses 3 slots, and the process dies
    after their payloads are written, before any header."""
    slab = os.path.join(d, "kreuse.slab")
    c = Child(ph_writer, slab, 6, 0, 6, (6, "payload"))
    acked = []
    for msg in c.lines():
        acked += msg.get("acked", [])
    c.finish()
    chk = run(ph_check, slab, 6, list(range(12)))
    return {"acked": acked, "check": chk["check"], "stats": chk["stats"]}


def sc_flip_payload(d):
    slab = os.path.join(d, "fp.slab")
    idx = list(range(8))
    a = run(ph_put, slab, 16, idx)
    flip(slab, a["offsets"]["2"] + 4096 + 12345)

    def live(out):
        sm, l2, cpu = make(slab, 16)
        first = check(sm, l2, idx)
        flip(slab, slot_offset(l2, 5) + 4096 + CHUNK - 1)     # while it runs
        second = check(sm, l2, idx)
        st = stats(l2)
        sm.close()
        return {"first": first, "second": second, "stats": st}

    b = run(live)
    c = run(ph_check, slab, 16, idx)
    flip(slab, a["offsets"]["7"] + 4096 + 3 * CHUNK // 4 + 5)      # in its last piece
    two = run(ph_check, slab, 16, idx, {"readers": 2})             # two reader threads
    flip(slab, a["offsets"]["6"] + 4096 + CHUNK - 4096)           # in its last piece

    def auto(out):
        # readers "auto" where 16 CPUs are usable: 8 readers, an engine each, the
        # live chunks dealt one to a reader
        os.sched_getaffinity = lambda pid: set(range(16))
        sm, l2, cpu = make(slab, 16, readers="auto")
        res = {"check": check(sm, l2, idx), "stats": stats(l2), "readers": l2.readers,
               "engines": len(l2._engines)}
        sm.close()
        return res

    many = run(auto)
    flip(slab, a["offsets"]["4"] + 4096 + CHUNK // 3)
    # the checksum on the crc thread, LMCache's pool not registered
    ct = run(ph_check, slab, 16, idx, {"crc_thread": True, "register_pool": False})
    flip(slab, a["offsets"]["1"] + 4096 + CHUNK - 1)              # in its last piece

    def crc_threads(out):
        # three readers, each handing its chunks' pieces to a crc thread of its own
        sm, l2, cpu = make(slab, 16, readers=3, crc_thread=True)
        res = {"check": check(sm, l2, idx), "stats": stats(l2),
               "crc_threads": sorted(t.name.split("_")[0] for t in threading.enumerate()
                                     if t.name.startswith("phx-l2-rcrc"))}
        sm.close()
        return res

    ct3 = run(crc_threads)
    return {"restart": b, "again": c, "two_readers": two, "auto_readers": many,
            "crc_thread": ct, "crc_threads": ct3}


def sc_flip_header(d):
    slab = os.path.join(d, "fh.slab")
    idx = list(range(8))
    a = run(ph_put, slab, 16, idx)
    flip(slab, a["offsets"]["1"] + 60)              # inside the key

    def live(out):
        sm, l2, cpu = make(slab, 16)
        first = check(sm, l2, idx)
        flip(slab, slot_offset(l2, 6) + 40)          # payload length field, while it runs
        second = check(sm, l2, idx)
        st = stats(l2)
        sm.close()
        return {"first": first, "second": second, "stats": st}

    return {"restart": run(live)}


def sc_truncate(d):
    slab = os.path.join(d, "tr.slab")
    idx = list(range(10))
    a = run(ph_put, slab, 16, idx)
    cut = a["offsets"]["6"] + 4096 + CHUNK // 2
    os.truncate(slab, cut)
    order = sorted(idx, key=lambda i: a["offsets"][str(i)])
    survivors = [i for i in idx if a["offsets"][str(i)] + 4096 + CHUNK <= cut]

    def after(out):
        sm, l2, cpu = make(slab, 16)
        first = check(sm, l2, idx)
        put(sm, l2, cpu, [100, 101, 102, 103, 104, 105, 106])
        new = check(sm, l2, [100, 101, 102, 103, 104, 105, 106])
        st = stats(l2)
        sm.close()
        return {"first": first, "new": new, "stats": st, "size": os.path.getsize(slab)}

    return {"survivors": survivors, "order": order, "after": run(after)}


def fill_fs(d: str, leave: int) -> str:
    """A filler file that leaves about ``leave`` bytes writable: allocate until
    ENOSPC (whatever the filesystem keeps in reserve), then give ``leave`` back."""
    filler = os.path.join(d, "filler")
    fd = os.open(filler, os.O_CREAT | os.O_WRONLY, 0o644)
    try:
        size, step = 0, 64 << 20
        while step >= (64 << 10):
            try:
                os.posix_fallocate(fd, size, step)
                size += step
            except OSError:
                step //= 2
        os.ftruncate(fd, max(0, size - leave))
        os.fsync(fd)
    finally:
        os.close(fd)
    return filler


def sc_enospc(d):
    sub = os.path.join(d, "nospc")
    os.makedirs(sub, exist_ok=True)
    filler = fill_fs(d, 4 << 20)
    try:
        # 1. a slab that cannot be allocated: the plugin is refused, nothing left behind
        big = os.path.join(sub, "big.slab")
        start = run(ph_check, big, 64, [0])
        start["left_behind"] = os.path.exists(big)
        # 2. a sparse slab (preallocate false) that runs out while putting, its
        # batches' payloads written by one engine, then (a new slab) by two at once
        idx = list(range(40))                      # 10 MiB into ~4 MiB free
        res = {"start": start}
        for writers, name in ((1, ""), (2, "_writers2")):
            slab = os.path.join(sub, f"sparse{name}.slab")

            def fill(out):
                sm, l2, cpu = make(slab, 48, preallocate=False, writers=writers)
                for s in range(0, len(idx), 4):
                    put(sm, l2, cpu, idx[s:s + 4])
                r = {"check": check(sm, l2, idx), "stats": stats(l2)}
                sm.close()
                return r

            res["during" + name] = run(fill)
            res["after" + name] = run(ph_check, slab, 48, idx, {"preallocate": False})
            os.unlink(slab)
    finally:
        os.unlink(filler)
        shutil.rmtree(sub, ignore_errors=True)
    return res


def sc_two_servers(d):
    slab = os.path.join(d, "two.slab")
    idx = list(range(6))

    def holder(out):
        sm, l2, cpu = make(slab, 16)
        put(sm, l2, cpu, idx)
        say(out, ready=os.getpid())
        while not os.path.exists(slab + ".done"):
            time.sleep(0.05)
        res = {"check": check(sm, l2, idx)}
        sm.close()
        return res

    h = Child(holder)
    pid = None
    for msg in h.lines():
        if "ready" in msg:
            pid = msg["ready"]
            break
    before = file_hash(slab)
    st_before = os.stat(slab)

    def second(out):
        sm, l2, cpu = make(slab, 16)
        res = {"plugin_loaded": l2 is not None}
        from phx_lmcache.l2 import PhxL2Backend
        try:
            PhxL2Backend(config=sm.config, metadata=sm.metadata, local_cpu_backend=cpu,
                         loop=sm.loop)
            res["error"] = None
        except OSError as e:
            res["error"] = f"{type(e).__name__}: {e}"
        sm.close()
        return res

    sec = run(second)
    after = file_hash(slab)
    st_after = os.stat(slab)
    open(slab + ".done", "w").close()
    held = h.finish()
    os.unlink(slab + ".done")
    return {"holder_pid": pid, "second": sec, "unchanged": before == after,
            "mtime_unchanged": st_before.st_mtime_ns == st_after.st_mtime_ns,
            "size_unchanged": st_before.st_size == st_after.st_size, "holder": held}


def sc_lru(d):
    slab = os.path.join(d, "lru.slab")

    def go(out):
        sm, l2, cpu = make(slab, 8)
        put(sm, l2, cpu, list(range(8)))
        l2.contains(key(0), pin=True)          # pinned: never evicted
        o = l2.get_blocking(key(1))            # a hit: most recently used
        o.ref_count_down()
        put(sm, l2, cpu, [8, 9, 10, 11])
        present = [i for i in range(12) if l2.contains(key(i))]
        chk = check(sm, l2, present)
        l2.unpin(key(0))
        put(sm, l2, cpu, [12])
        present2 = [i for i in range(13) if l2.contains(key(i))]
        chk2 = check(sm, l2, present2)
        st = stats(l2)
        sm.close()
        return {"present": present, "check": chk, "present2": present2, "check2": chk2,
                "stats": st}

    a = run(go)
    b = run(ph_check, slab, 8, list(range(13)))
    return {"run": a, "restart": b}


def sc_two_files(d):
    """A tier over two slab files: chunks striped over both, both locked,
    everything back after a restart."""
    slabs = [os.path.join(d, "a.slab"), os.path.join(d, "b.slab")]
    idx = list(range(12))

    def go(out):
        sm, l2, cpu = make(",".join(slabs), 16)
        put(sm, l2, cpu, idx)
        files = sorted({l2._slab.locate(l2._index[key(i).to_string()].slot)[0].path
                        for i in idx})
        chk = check(sm, l2, idx)
        from phx_lmcache.l2 import PhxL2Backend
        try:          # the second file alone is held too
            PhxL2Backend(config=make_cfg(slabs[1], 16), metadata=sm.metadata,
                         local_cpu_backend=cpu, loop=sm.loop)
            second = None
        except OSError as e:
            second = type(e).__name__
        sm.close()
        return {"files": files, "check": chk, "second": second}

    a = run(go)
    b = run(ph_check, ",".join(slabs), 16, idx)

    # three writers over two files: every batch's payloads on three engines at once
    # (13 chunks: shares of unequal size, in both files)
    slabs3 = [os.path.join(d, "c.slab"), os.path.join(d, "d.slab")]
    idx3 = list(range(13))

    def go3(out):
        sm, l2, cpu = make(",".join(slabs3), 16, writers=3)
        put(sm, l2, cpu, idx3)
        res = {"check": check(sm, l2, idx3), "stats": stats(l2), "engines": len(l2._engines)}
        sm.close()
        return res

    c = run(go3)
    e = run(ph_check, ",".join(slabs3), 16, idx3)
    return {"run": a, "restart": b, "writers3": c, "writers3_restart": e}


SCENARIOS = {
    "roundtrip": sc_roundtrip, "kill_random": sc_kill_random, "kill_header": sc_kill_header,
    "kill_reuse": sc_kill_reuse, "flip_payload": sc_flip_payload,
    "flip_header": sc_flip_header, "truncate": sc_truncate, "enospc": sc_enospc,
    "two_servers": sc_two_servers, "lru": sc_lru, "two_files": sc_two_files,
}


def main() -> int:
    global SEED
    ap = argparse.ArgumentParser()
    ap.add_argument("--seed", type=int, default=random.randrange(1 << 30))
    ap.add_argument("--fs", action="append", default=[], help="name=dir")
    ap.add_argument("--only", default="")
    a = ap.parse_args()
    SEED = a.seed
    random.seed(SEED)
    names = [n for n in a.only.split(",") if n] or list(SCENARIOS)
    out: dict = {"seed": SEED}
    for spec in a.fs:
        name, d = spec.split("=", 1)
        out[name] = {}
        for n in names:
            sub = os.path.join(d, n)
            shutil.rmtree(sub, ignore_errors=True)
            os.makedirs(sub)
            t = time.monotonic()
            try:
                out[name][n] = SCENARIOS[n](sub)
            except Exception:
                out[name][n] = {"error": traceback.format_exc()}
            out[name][n + "_s"] = round(time.monotonic() - t, 2)
            shutil.rmtree(sub, ignore_errors=True)
    print("L2RESULT " + json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
