"""``phx bench lmcache --mode l2``: LMCache's persistent disk tier, side by side.

Methods, each built by LMCache 0.5.6's own ``StorageManager`` from its
configuration, on the same filesystem (the disk under ``--dir``, and a zram
ext4 with ``--zram``), one after another inside every repeat, in an order
rotated by one each repeat (:func:`run_order`):

* ``phx`` — ``phx_lmcache.l2.PhxL2Backend`` (storage plugin; checksums verified)
* ``phx-crcthread`` — the same with ``phx_l2.crc_thread: true`` (a get's crc32c on a
  thread of its own, beside the read: what hides the checksum where cores are free)
* ``phx-1writer`` — the same with ``phx_l2.writers: 1`` (a put batch's payloads
  written by one engine, not by one per usable CPU: what the writers give)
* ``phx-wholewrites`` — the same with ``phx_l2.write_piece_kb: 0`` (each payload
  one write, not 2 MiB pieces: what the pieces give)
* ``phx-noverify`` — the same with ``phx_l2.verify: false`` (the checksum's cost);
  ``PHX_BENCH_L2_MODULE`` names another importable copy of the plugin for both
  (an earlier tree's, for before/after tables)
* ``localdisk`` — LMCache's ``LocalDiskBackend`` as configured by default (buffered)
* ``localdisk-odirect`` — the same with ``use_odirect: true``
* ``rawblock-uring`` / ``rawblock-posix`` — LMCache's ``rust_raw_block`` plugin
  (``lmcache-rust-raw-block-io`` on the path; skipped with a note otherwise) on a
  preallocated file, O_DIRECT, io_uring or posix engine

Rows per chunk size (``--l2-chunk-mib``, default 1,4,16,32): put throughput (all
chunks submitted in one ``batched_submit_put_task``, timed until every chunk is
persisted: ``contains`` true and no put task left), get throughput
(``batched_get_blocking`` over groups of 8, page cache dropped first), p50/p99
latency of single puts and single gets (``--l2-latency`` each, one at a time),
and the restart: a new StorageManager on the same files, timed until it serves,
with the entries it recovered.  Every get is compared byte for byte with what
was put.  Separately, ``--l2-recovery N`` slots (default 100000) of 4 KiB chunks
are put into a phx slab and the restart is timed.
"""
from __future__ import annotations

import gc
import os
import shutil
import sys
import time
from typing import Any

import numpy as np

from phx.bench._common import drop_caches, fmt_table, median_spread, parse_size

MiB, GiB = 1 << 20, 1 << 30
#: the phx rows that run checksummed, as users run the tier: stats kept, ratios given
CHECKED = ("phx", "phx-crcthread", "phx-1writer", "phx-wholewrites")
METHODS = CHECKED + ("phx-noverify", "localdisk", "localdisk-odirect",
           "rawblock-uring", "rawblock-posix")


def add_arguments(p: Any) -> None:
    from phx.bench._common import checked, csv, positive_int, positive_size
    p.add_argument("--l2-chunk-mib", type=checked(csv(int)), default="1,4,16,32",
                   help="l2 mode: chunk sizes in MiB (default 1,4,16,32)")
    p.add_argument("--l2-bytes", type=checked(positive_size), default="256m",
                   help="l2 mode: bytes per throughput row (default 256m)")
    p.add_argument("--l2-latency", type=positive_int, default=16,
                   help="l2 mode: single puts and gets timed per size (default 16)")
    p.add_argument("--l2-methods", type=checked(csv(str, allowed=METHODS)),
                   default=",".join(METHODS), help="l2 mode: subset of " + ",".join(METHODS))
    p.add_argument("--l2-recovery", type=int, default=100_000,
                   help="l2 mode: slots for the phx recovery row (0: none; default 100000)")


def _rawblock_missing() -> str | None:
    try:
        import lmcache_rust_raw_block_io  # noqa: F401
    except ImportError:
        return ("rust_raw_block rows skipped: its extension is not installed (pip install "
                "--target DIR lmcache-rust-raw-block-io==0.5.7rc2, DIR on PYTHONPATH)")
    return None


def _manager(method: str, d: str, mib: int, nchunks: int, extra_cfg: dict | None = None):
    import torch
    from lmcache.v1.config import LMCacheEngineConfig
    from lmcache.v1.event_manager import EventManager
    from lmcache.v1.metadata import LMCacheMetadata
    from lmcache.v1.storage_backend.storage_manager import StorageManager
    chunk = mib * MiB
    cap = 4096 + (nchunks + 4) * (chunk + 4096)
    kw: dict[str, Any] = {}
    extra: dict[str, Any] = {}
    name = method
    if method.startswith("phx"):
        name = "phx_l2"
        kw["storage_plugins"] = [name]
        # PHX_BENCH_L2_MODULE: another copy of the plugin (an earlier tree's, for a
        # before/after table in one run); default the installed phx_lmcache.l2
        extra.update({"storage_plugin.phx_l2.module_path":
                      os.environ.get("PHX_BENCH_L2_MODULE") or "phx_lmcache.l2",
                      "storage_plugin.phx_l2.class_name": "PhxL2Backend",
                      "phx_l2.paths": os.path.join(d, "phx-l2.slab"),
                      "phx_l2.capacity_gb": cap / GiB,
                      "phx_l2.max_queued_gb": 2 * cap / GiB,
                      "phx_l2.verify": method != "phx-noverify",
                      "phx_l2.crc_thread": method == "phx-crcthread",
                      "phx_l2.writers": 1 if method == "phx-1writer" else "auto",
                      "phx_l2.write_piece_kb": 0 if method == "phx-wholewrites" else 2048})
    elif method.startswith("localdisk"):
        name = "LocalDiskBackend"
        kw.update(local_disk=os.path.join(d, "localdisk") + "/",
                  max_local_disk_size=2 * cap / GiB)
        extra["use_odirect"] = method.endswith("odirect")
    else:
        name = "rust_raw_block"
        path = os.path.join(d, "rawblock.img")
        meta = 16 * MiB
        size = meta + (nchunks + 4) * (chunk + 4096)
        if not os.path.exists(path):
            fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o644)
            try:
                os.posix_fallocate(fd, 0, size)
            finally:
                os.close(fd)
        kw["storage_plugins"] = [name]
        extra.update({
            "storage_plugin.rust_raw_block.module_path":
                "lmcache.v1.storage_backend.plugins.rust_raw_block_backend",
            "storage_plugin.rust_raw_block.class_name": "RustRawBlockBackend",
            "rust_raw_block.device_path": path, "rust_raw_block.capacity_bytes": size,
            "rust_raw_block.use_odirect": True, "rust_raw_block.meta_total_bytes": meta,
            "rust_raw_block.io_engine": "io_uring" if method.endswith("uring") else "posix"})
    extra.update(extra_cfg or {})
    heads_x_hd = 1024
    layers = mib if mib >= 1 else 1
    cfg = LMCacheEngineConfig.from_defaults(
        chunk_size=256, local_cpu=True,
        max_local_cpu_size=max(1.0, 2.5 * min(nchunks * chunk, 640 * MiB) / GiB + 0.5),
        extra_config=extra, **kw)
    md = LMCacheMetadata(model_name="phx-bench-l2", world_size=1, local_world_size=1,
                         worker_id=0, local_worker_id=0, kv_dtype=torch.bfloat16,
                         kv_shape=(layers, 2, 256, 8, heads_x_hd // 8))
    sm = StorageManager(cfg, md, EventManager())
    be = sm.storage_backends.get(name)
    if be is None:
        sm.close()
        raise RuntimeError(f"{method}: LMCache did not create {name} (see its log)")
    return sm, be, sm.storage_backends["LocalCPUBackend"]


def _keys(n: int, base: int = 0) -> list:
    import torch
    from lmcache.utils import CacheEngineKey
    return [CacheEngineKey("phx-bench-l2", 1, 0, 0x5000000 + base + i, torch.bfloat16)
            for i in range(n)]


def _wait_persisted(be: Any, keys: list, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    flush = getattr(be, "flush", None)
    if flush is not None:
        flush(timeout)
    pending = list(keys)
    while pending:
        pending = [k for k in pending if be.exists_in_put_tasks(k) or not be.contains(k)]
        if not pending:
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"{len(pending)} puts never finished")
        time.sleep(0.0005)


def _put(be: Any, keys: list, objs: list) -> float:
    t = time.perf_counter()
    be.batched_submit_put_task(keys, objs)
    _wait_persisted(be, keys)
    return time.perf_counter() - t


def _get(be: Any, keys: list, srcs: list, group: int = 8) -> tuple[float, bool, int]:
    t_all = 0.0
    exact = True
    hits = 0
    for s in range(0, len(keys), group):
        ks = keys[s:s + group]
        t = time.perf_counter()
        objs = be.batched_get_blocking(ks)
        t_all += time.perf_counter() - t
        for o, src in zip(objs, srcs[s:s + group]):
            if o is None:
                exact = False
                continue
            hits += 1
            if not np.array_equal(np.frombuffer(o.byte_array, dtype=np.uint8), src):
                exact = False
            o.ref_count_down()
    return t_all, exact, hits


def _sources(cpu: Any, n: int, mib: int, rng: np.random.Generator) -> tuple[list, list]:
    import torch
    shape = torch.Size([2, mib, 256, 1024])
    objs, srcs = [], []
    block = rng.integers(0, 256, mib * MiB + 4096, dtype=np.uint8)
    for i in range(n):
        o = cpu.allocate(shape, torch.bfloat16)
        if o is None:
            raise RuntimeError("LMCache's CPU pool is full: lower --l2-bytes")
        a = np.frombuffer(o.byte_array, dtype=np.uint8)
        off = (i * 4099) % 4096
        a[:] = block[off:off + a.size]
        a[:8] = np.frombuffer(np.int64(i).tobytes(), dtype=np.uint8)
        objs.append(o)
        srcs.append(a.copy())
    return objs, srcs


def _clean(d: str) -> None:
    for name in ("phx-l2.slab", "rawblock.img", "localdisk"):
        p = os.path.join(d, name)
        if os.path.isdir(p):
            shutil.rmtree(p, ignore_errors=True)
        elif os.path.exists(p):
            os.unlink(p)


def _one(method: str, d: str, mib: int, nbytes: int, nlat: int,
         rng: np.random.Generator) -> dict[str, Any]:
    n = max(2, nbytes // (mib * MiB))
    _clean(d)
    sm, be, cpu = _manager(method, d, mib, n + nlat)
    row: dict[str, Any] = {"method": method, "chunk_mib": mib, "chunks": n}
    try:
        objs, srcs = _sources(cpu, n, mib, rng)
        keys = _keys(n)
        drop_caches()
        t = _put(be, keys, objs)
        row["put_gbs"] = n * mib * MiB / t / 1e9
        drop_caches()
        t, exact, hits = _get(be, keys, srcs)
        row["get_gbs"] = hits * mib * MiB / t / 1e9 if hits else 0.0
        row["byte_exact"] = exact and hits == n
        for o in objs:
            o.ref_count_down()
        # latency: one chunk at a time
        lobjs, lsrcs = _sources(cpu, nlat, mib, rng)
        lkeys = _keys(nlat, base=1 << 20)
        pl, gl = [], []
        for k, o in zip(lkeys, lobjs):
            pl.append(_put(be, [k], [o]))
        drop_caches()
        for k, src in zip(lkeys, lsrcs):
            t, ok, _ = _get(be, [k], [src], 1)
            gl.append(t)
            row["byte_exact"] = row["byte_exact"] and ok
        for o in lobjs:
            o.ref_count_down()
        row["put_p50_ms"], row["put_p99_ms"] = (float(np.percentile(pl, 50)) * 1e3,
                                                float(np.percentile(pl, 99)) * 1e3)
        row["get_p50_ms"], row["get_p99_ms"] = (float(np.percentile(gl, 50)) * 1e3,
                                                float(np.percentile(gl, 99)) * 1e3)
        if method in CHECKED:
            row["phx_stats"] = {k: v for k, v in be.stats().items() if v}
    finally:
        sm.close()
        del sm, be, cpu
        gc.collect()
    # restart: the tier built again on the same files, as LMCache builds it (the
    # StorageManager and its CPU pool first, untimed: the same for every method)
    try:
        sm, be, cpu = _manager(method, d, mib, n + nlat)
        cls, cfg, md = type(be), sm.config, sm.metadata
        if method.startswith("localdisk"):
            be.close()
            t = time.perf_counter()
            be = cls(cfg, sm.loop, cpu, "cpu", None, md)
        else:
            be.close()
            gc.collect()
            drop_caches()
            t = time.perf_counter()
            be = cls(config=cfg, metadata=md, local_cpu_backend=cpu, loop=sm.loop,
                     dst_device="cpu")
        row["restart_s"] = time.perf_counter() - t
        row["recovered"] = sum(be.contains(k) for k in _keys(n))
        be.close()
        sm.close()
    except Exception as e:
        row["restart_error"] = f"{type(e).__name__}: {e}"
    _clean(d)
    return row


def recovery_row(d: str, nslots: int) -> dict[str, Any]:
    """Put ``nslots`` 4 KiB chunks into a phx slab of exactly that many slots,
    then time a restart (a new StorageManager + plugin) until it serves."""
    import torch
    from lmcache.utils import CacheEngineKey
    from lmcache.v1.config import LMCacheEngineConfig
    from lmcache.v1.event_manager import EventManager
    from lmcache.v1.metadata import LMCacheMetadata
    from lmcache.v1.storage_backend.storage_manager import StorageManager
    _clean(d)
    slot = 8192
    extra = {"storage_plugin.phx_l2.module_path": "phx_lmcache.l2",
             "storage_plugin.phx_l2.class_name": "PhxL2Backend",
             "phx_l2.paths": os.path.join(d, "phx-l2.slab"),
             "phx_l2.capacity_gb": (4096 + nslots * slot) / GiB, "phx_l2.slot_bytes": slot}

    def mk():
        cfg = LMCacheEngineConfig.from_defaults(chunk_size=256, local_cpu=True,
                                                max_local_cpu_size=0.5,
                                                storage_plugins=["phx_l2"], extra_config=extra)
        md = LMCacheMetadata(model_name="phx-bench-l2", world_size=1, local_world_size=1,
                             worker_id=0, local_worker_id=0, kv_dtype=torch.bfloat16,
                             kv_shape=(1, 2, 256, 1, 4))
        sm = StorageManager(cfg, md, EventManager())
        return sm, sm.storage_backends["phx_l2"], sm.storage_backends["LocalCPUBackend"]

    sm, be, cpu = mk()
    t0 = time.perf_counter()
    step = 2048
    for s in range(0, nslots, step):
        n = min(step, nslots - s)
        keys = [CacheEngineKey("phx-bench-rec", 1, 0, s + i, torch.bfloat16) for i in range(n)]
        objs = [cpu.allocate(torch.Size([2, 1, 256, 4]), torch.bfloat16) for _ in range(n)]
        for i, o in enumerate(objs):
            np.frombuffer(o.byte_array, dtype=np.uint8)[:8] = np.frombuffer(
                np.int64(s + i).tobytes(), dtype=np.uint8)
        be.batched_submit_put_task(keys, objs)
        for o in objs:
            o.ref_count_down()
        be.flush(600)
    fill_s = time.perf_counter() - t0
    entries = be.stats()["entries"]
    be.close()
    be = sm.storage_backends.pop("phx_l2")
    gc.collect()
    drop_caches()
    t = time.perf_counter()
    be = type(be)(config=sm.config, metadata=sm.metadata, local_cpu_backend=cpu, loop=sm.loop,
                  dst_device="cpu")
    total = time.perf_counter() - t
    st = be.stats()
    be.close()
    sm.close()
    _clean(d)
    return {"slots": nslots, "entries_before": entries, "recovered": st["recovered"],
            "scan_s": st["recovery_s"], "restart_s": total, "fill_s": fill_s}


def run_order(methods: list[str], rep: int) -> list[str]:
    """The methods in the order repeat ``rep`` runs them: rotated by one each
    repeat, so that no method always runs first (on a fresh zram device, a cold
    cache) or right after the same neighbour.  Within one run the position
    moved a put row by up to 25 % (docs/lmcache-l2.md, "Batched payload
    writes"); the medians over repeats then carry every position."""
    k = rep % len(methods) if methods else 0
    return methods[k:] + methods[:k]


def run_l2(args: Any, places: list[tuple[str, str]], notes: dict[str, str]) -> dict[str, Any]:
    methods = args.l2_methods.split(",")
    miss = _rawblock_missing()
    if miss:
        notes["rawblock"] = miss
        print(f"lmcache bench: {miss}", file=sys.stderr)
        methods = [m for m in methods if not m.startswith("rawblock")]
    sizes = [int(x) for x in args.l2_chunk_mib.split(",")]
    rng = np.random.default_rng()
    rows: list[dict[str, Any]] = []
    recovery: dict[str, Any] = {}
    for device, d in places:
        for rep in range(args.repeat):
            for mib in sizes:
                for m in run_order(methods, rep):
                    try:
                        r = _one(m, d, mib, parse_size(args.l2_bytes), args.l2_latency, rng)
                    except Exception as e:
                        r = {"method": m, "chunk_mib": mib, "error": f"{type(e).__name__}: {e}"}
                        print(f"lmcache bench: l2 {device} {m} {mib} MiB: {r['error']}",
                              file=sys.stderr)
                    r.update(device=device, repeat=rep)
                    rows.append(r)
                    if not args.quiet and "error" not in r:
                        print(f"  l2 {device} {mib:>2} MiB {m:<18} put {r['put_gbs']:6.2f} "
                              f"get {r['get_gbs']:6.2f} GB/s  p99 put {r['put_p99_ms']:7.1f} "
                              f"get {r['get_p99_ms']:7.1f} ms  restart "
                              f"{r.get('restart_s', float('nan')):.3f} s "
                              f"({r.get('recovered', 0)})", file=sys.stderr)
        if args.l2_recovery > 0 and "phx" in methods:
            recovery[device] = recovery_row(d, args.l2_recovery)
            print(f"  l2 {device} recovery of {args.l2_recovery} slots: "
                  f"{recovery[device]['restart_s']:.3f} s", file=sys.stderr)
    return {"rows": rows, "summary": summarise(rows), "recovery": recovery}


def summarise(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    keys = sorted({(r["device"], r["chunk_mib"], r["method"]) for r in rows if "error" not in r},
                  key=lambda k: (k[0], k[1], METHODS.index(k[2])))
    for dev, mib, m in keys:
        rs = [r for r in rows if (r["device"], r["chunk_mib"], r["method"]) == (dev, mib, m)
              and "error" not in r]
        s: dict[str, Any] = {"device": dev, "chunk_mib": mib, "method": m, "n": len(rs)}
        for f in ("put_gbs", "get_gbs", "put_p99_ms", "get_p99_ms", "restart_s"):
            vals = [r[f] for r in rs if f in r]
            if vals:
                s[f], s[f + "_spread"] = median_spread(vals)
        s["recovered"] = min(r.get("recovered", 0) for r in rs)
        s["chunks"] = rs[0]["chunks"]
        s["byte_exact"] = all(r.get("byte_exact") for r in rs)
        out.append(s)
    # ratios: phx against the best other method of the same device and size
    for s in out:
        if s["method"] not in CHECKED:
            continue
        others = [o for o in out if (o["device"], o["chunk_mib"]) == (s["device"], s["chunk_mib"])
                  and not o["method"].startswith("phx")]
        for f in ("put_gbs", "get_gbs"):
            best = max((o.get(f, 0.0) for o in others), default=0.0)
            if best > 0:
                s[f + "_vs_best"] = s.get(f, 0.0) / best
        nv = [o for o in out if (o["device"], o["chunk_mib"], o["method"]) ==
              (s["device"], s["chunk_mib"], "phx-noverify")]
        if nv and nv[0].get("get_gbs"):
            s["verify_cost"] = 1 - s.get("get_gbs", 0.0) / nv[0]["get_gbs"]
    return out


def print_summary(res: dict[str, Any]) -> None:
    rows = []
    for s in res["summary"]:
        rows.append([s["device"], s["chunk_mib"], s["method"],
                     f"{s.get('put_gbs', 0):.2f} ({s.get('put_gbs_spread', 0):.0%})",
                     f"{s.get('get_gbs', 0):.2f} ({s.get('get_gbs_spread', 0):.0%})",
                     f"{s.get('put_p99_ms', 0):.1f}", f"{s.get('get_p99_ms', 0):.1f}",
                     f"{s.get('restart_s', 0):.3f} ({s['recovered']}/{s['chunks']})",
                     "yes" if s["byte_exact"] else "NO",
                     f"{s['put_gbs_vs_best']:.2f}/{s['get_gbs_vs_best']:.2f}"
                     if "put_gbs_vs_best" in s else "",
                     f"{s['verify_cost']:.1%}" if "verify_cost" in s else ""])
    print(fmt_table(["device", "MiB", "method", "put GB/s", "get GB/s", "put p99 ms",
                     "get p99 ms", "restart s (entries)", "exact", "phx/best put/get",
                     "crc cost"], rows))
    for dev, r in res["recovery"].items():
        print(f"{dev}: phx recovery of {r['recovered']}/{r['slots']} slots: restart "
              f"{r['restart_s']:.3f} s (header scan {r['scan_s']:.3f} s)")
