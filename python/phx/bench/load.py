"""``phx bench load``: a safetensors checkpoint into GPU (or host) memory,
phx.loader against the ways vLLM users load weights today.

The checkpoint is synthetic and Llama-3-8B-shaped (embedding, 32 layers of
q/k/v/o, gate/up/down and two norms, final norm, lm_head; random bf16;
``--shards`` files with a ``model.safetensors.index.json``), 16.06 GB: any
``--size`` within 10 % of that gives exactly its shapes, a smaller one scales
every dimension down, a larger one adds layers, to about that many bytes.  Methods, each in a fresh subprocess (so peak RSS and CPU time
are its own), page cache dropped before every row:

* ``phx``          ``phx.loader.load_file(index, device)``
* ``phx-prepared`` the same with phx.gpu's staging context made before the clock
                   starts (``phx.loader.prepare``, as the vLLM loader does while
                   vLLM builds the model; GPU only)
* ``phx-iter``     ``phx.loader.iter_tensors``, each tensor copied into a
                   destination of its shape made before the clock (the model's
                   parameters) and dropped, as vLLM's loader consumes it: its
                   peak extra memory is the loader's own
* ``st``           ``safetensors.torch.load_file(shard, device=device)`` per shard
                   (on the CPU its tensors map the file: every method's rows to
                   the CPU include touching each page once)
* ``st-cpu``       the same to the CPU, then ``.to(device)`` (GPU only)
* ``fst-nogds``    fastsafetensors ``SafeTensorsFileLoader(nogds=True)``
* ``fst-phx``      the same after ``phx_fastsafetensors.replace()``: phx's copier
* ``raw``          O_DIRECT ``preadv`` of the same files into host memory,
                   ``--raw-threads`` threads, 16 MiB requests: what the device gives

Tensor parallelism (``--tp N``): N ranks in the one process, a thread each,
rank r's tensors on ``cuda:(r mod GPUs)``; column-parallel linears, the
embedding and lm_head are sliced along dim 0, o/down_proj along dim 1, the
norms are whole (:data:`LLAMA_TP`).  ``phx``: each rank's ``load_file(...,
shard=tp_sharder(r, N, LLAMA_TP))`` reads only its slices; ``st``: each rank
loads whole tensors and keeps its slice, as vLLM's default loader does;
``raw``: the files once.  Every rank's slices are checked against the
checkpoint's.  Other methods are not run with ``--tp``.

Warm rows (``--warm METHODS``, default ``phx,st,fst-nogds``): the same
checkpoint read right after it was read once, page cache kept: the page
cache is dropped, every file read through it once, then the method runs
(``cache`` column "warm"; all other rows are "cold").  phx reads a file that
is mostly in the page cache from there (buffered) instead of O_DIRECT,
except on a device that is memory (zram: the page cache is slower there);
the phx rows report how many files it read that way.

Reported: seconds until every tensor is on the device, GB/s, CPU seconds
(user + system of the process, getrusage), peak RSS and its growth over the
process's state just before loading (after imports and CUDA start-up), the
peak *extra* device memory (GPU: ``torch.cuda.max_memory_allocated`` during
the load minus what is allocated when it ends, i.e. what was allocated and
given back; for phx rows also the loader's own count of target bytes held
and not yet handed out, ``LoadStats.peak_held_bytes``, on any device), and
whether every tensor's bytes equal the checkpoint's (BLAKE2 of each tensor,
against digests taken when it was written).  Rows run on a fresh zram block
device with ext4 (``--zram SIZE``; first) and on ``--dir`` (the disk); the
table and JSON are written after each.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import hashlib
import json
import math
import os
import random
import resource
import shutil
import subprocess
import sys
import threading
import time
from typing import Any

from phx.bench._common import (BenchError, add_common_arguments, bench_dir, checked, csv,
                               drop_caches, fmt_table, median_spread, need_space, parse_size,
                               peak_rss, positive_float, positive_int, positive_size,
                               positive_size_value, progress, reset_peak_rss,
                               storage_description, write_json)

MiB, GiB = 1 << 20, 1 << 30
METHODS = ("phx", "phx-prepared", "phx-iter", "st", "st-cpu", "fst-nogds", "fst-phx", "raw")
#: methods whose warm row reads through the page cache in a way worth showing
WARM_METHODS = ("phx", "phx-iter", "st", "st-cpu", "fst-nogds", "fst-phx")
LLAMA3_8B = {"vocab": 128256, "hidden": 4096, "inter": 14336, "layers": 32, "kv": 1024}
#: Megatron-style tensor parallelism of a Llama checkpoint: name regex -> dim
LLAMA_TP = {r"(q|k|v|gate|up)_proj\.weight$": 0, r"(o|down)_proj\.weight$": 1,
            r"(embed_tokens|lm_head)\.weight$": 0}
TP_METHODS = ("phx", "st", "raw")


def _device(text: str) -> str:
    t = text.strip()
    if t == "cpu" or t == "cuda" or (t.startswith("cuda:") and t[5:].isdigit()):
        return t
    raise ValueError(f"{text!r}: want cpu, cuda or cuda:N")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--zram", metavar="SIZE", type=checked(positive_size), default=None,
                   help="also run on a zram device of SIZE with ext4 (root; >= the checkpoint)")
    p.add_argument("--no-disk", action="store_true", help="only the zram rows")
    p.add_argument("--size", type=checked(positive_size), default="16G",
                   help="checkpoint size (default 16G, Llama-3-8B)")
    p.add_argument("--shards", type=positive_int, default=4, help="safetensors files (default 4)")
    p.add_argument("--device", type=checked(_device), default=None,
                   help="cuda (default where available), cuda:N or cpu")
    p.add_argument("--methods", type=checked(csv(str, allowed=METHODS)), default=",".join(METHODS),
                   help="comma list of " + ",".join(METHODS))
    p.add_argument("--raw-threads", type=checked(csv(positive_int)), default="16",
                   help="thread counts for raw (best is shown)")
    p.add_argument("--warm", type=checked(csv(str, allowed=WARM_METHODS, empty_ok=True)),
                   default="phx,st,fst-nogds",
                   help="methods that also get a warm row (page cache kept after one read of "
                        "the checkpoint; '' for none; of " + ",".join(WARM_METHODS) + ")")
    p.add_argument("--tp", type=positive_int, default=1,
                   help="tensor-parallel ranks in one process (default 1; with N > 1 only "
                        + ",".join(TP_METHODS) + " run)")
    p.add_argument("--timeout", type=positive_float, default=600, help="seconds per method run")
    add_common_arguments(
        p, dir_help="where the checkpoint is written, made if missing (default "
                    "$PHX_BENCH_DIR or .); it is removed at the end unless --keep",
        repeat=2,
        keep_help="keep the generated checkpoint (DIR/phx-bench-load) and reuse one already "
                  "there")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--worker-path", default=None, help=argparse.SUPPRESS)
    p.add_argument("--worker-threads", type=int, default=16, help=argparse.SUPPRESS)
    p.add_argument("--worker-tp", type=int, default=1, help=argparse.SUPPRESS)


# ---------------------------------------------------------------------------
# the synthetic checkpoint
# ---------------------------------------------------------------------------

def llama_shapes(size: int) -> list[tuple[str, tuple[int, ...]]]:
    """Tensor names and shapes of a Llama-3-8B-like model of about ``size`` bf16 bytes."""
    def layout(vocab, hidden, inter, layers, kv):
        out = [("model.embed_tokens.weight", (vocab, hidden))]
        for i in range(layers):
            p = f"model.layers.{i}."
            out += [(p + "self_attn.q_proj.weight", (hidden, hidden)),
                    (p + "self_attn.k_proj.weight", (kv, hidden)),
                    (p + "self_attn.v_proj.weight", (kv, hidden)),
                    (p + "self_attn.o_proj.weight", (hidden, hidden)),
                    (p + "mlp.gate_proj.weight", (inter, hidden)),
                    (p + "mlp.up_proj.weight", (inter, hidden)),
                    (p + "mlp.down_proj.weight", (hidden, inter)),
                    (p + "input_layernorm.weight", (hidden,)),
                    (p + "post_attention_layernorm.weight", (hidden,))]
        return out + [("model.norm.weight", (hidden,)), ("lm_head.weight", (vocab, hidden))]

    def nbytes(shapes):
        return sum(2 * math.prod(s) for _, s in shapes)

    L = LLAMA3_8B
    full = layout(L["vocab"], L["hidden"], L["inter"], L["layers"], L["kv"])
    if 0.9 * nbytes(full) <= size <= 1.1 * nbytes(full):
        return full            # "16G" (binary or not): the real model's shapes
    if size > nbytes(full):
        per_layer = nbytes(layout(0, L["hidden"], L["inter"], 1, L["kv"]))
        extra = (size - nbytes(full)) // per_layer
        return layout(L["vocab"], L["hidden"], L["inter"], L["layers"] + extra, L["kv"])
    def scaled(s):
        def r64(x):
            return max(64, int(round(x / 64)) * 64)
        hidden = r64(L["hidden"] * s)
        return layout(r64(L["vocab"] * s), hidden, r64(hidden * 3.5), L["layers"],
                      max(64, hidden // 4))
    lo, hi = 0.0, 1.0          # bytes grow with the scale: bisect for it
    for _ in range(40):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if nbytes(scaled(mid)) <= size else (lo, mid)
    return min((scaled(lo), scaled(hi)), key=lambda sh: abs(nbytes(sh) - size))


def digest(buf) -> str:
    return hashlib.blake2b(memoryview(buf).cast("B"), digest_size=16).hexdigest()


def write_checkpoint(d: str, size: int, shards: int, seed: int, show: bool) -> dict[str, str]:
    """Write the checkpoint into ``d``; return {tensor: digest of its bytes}."""
    import torch
    from safetensors.torch import save_file
    shapes = llama_shapes(size)
    total = sum(2 * math.prod(s) for _, s in shapes)
    g = torch.Generator().manual_seed(seed)
    per = total / shards
    groups: list[list[tuple[str, tuple[int, ...]]]] = [[] for _ in range(shards)]
    acc = 0
    for name, shp in shapes:
        groups[min(shards - 1, int(acc // per))].append((name, shp))
        acc += 2 * math.prod(shp)
    digests: dict[str, str] = {}
    weight_map: dict[str, str] = {}
    bar = progress(total, "writing checkpoint", show, unit="B")
    pool = concurrent.futures.ThreadPoolExecutor(min(16, os.cpu_count() or 2))
    futs: dict[str, concurrent.futures.Future] = {}
    for k, group in enumerate(groups):
        fname = f"model-{k + 1:05d}-of-{shards:05d}.safetensors"
        part = {}
        for name, shp in group:
            n = math.prod(shp)
            words = torch.empty((n * 2 + 7) // 8, dtype=torch.int64)
            words.random_(generator=g)
            t = words.view(torch.uint8)[:n * 2].view(torch.bfloat16).reshape(shp)
            part[name] = t
            futs[name] = pool.submit(digest, t.view(-1).view(torch.uint8).numpy())
            weight_map[name] = fname
        save_file(part, os.path.join(d, fname))
        digests.update((k, f.result()) for k, f in futs.items())
        futs.clear()
        bar.update(sum(2 * math.prod(s) for _, s in group))
        del part
    bar.close()
    pool.shutdown()
    with open(os.path.join(d, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f)
    with open(os.path.join(d, "digests.json"), "w") as f:
        json.dump(digests, f)
    return digests


def compare(ref: dict[str, str], got: dict[str, str]) -> str:
    """'ok', or what differs (missing, extra, wrong bytes)."""
    missing = sorted(set(ref) - set(got))
    extra = sorted(set(got) - set(ref))
    wrong = sorted(k for k in set(ref) & set(got) if ref[k] != got[k])
    if not (missing or extra or wrong):
        return "ok"
    parts = []
    for what, names in (("missing", missing), ("extra", extra), ("wrong bytes", wrong)):
        if names:
            parts.append(f"{len(names)} {what} (e.g. {names[0]})")
    return "; ".join(parts)


# ---------------------------------------------------------------------------
# the methods (run in a worker subprocess)
# ---------------------------------------------------------------------------

def _shards(d: str) -> list[str]:
    with open(os.path.join(d, "model.safetensors.index.json")) as f:
        return [os.path.join(d, x) for x in dict.fromkeys(json.load(f)["weight_map"].values())]


def _raw(d: str, threads: int) -> tuple[float, int]:
    """O_DIRECT preadv of every shard in 16 MiB requests by ``threads`` threads,
    one reused buffer each (host memory, no GPU)."""
    block = 16 * MiB
    work = []
    for p in _shards(d):
        size = os.path.getsize(p)
        work += [(p, o, min(block, size - o)) for o in range(0, size, block)]
    fds = {p: os.open(p, os.O_RDONLY | os.O_DIRECT) for p in _shards(d)}
    errs: list[BaseException] = []
    done = [0] * threads

    def run(i):
        import phx
        buf = phx.empty_aligned(block)
        mv = memoryview(buf)
        try:
            for p, o, n in work[i::threads]:
                # O_DIRECT wants whole blocks: the file's tail is read whole, short
                want = (n + 4095) & ~4095
                got = os.preadv(fds[p], [mv[:want]], o)
                if got < n:
                    raise OSError(5, f"short read at {o}", p)
                done[i] += n
        except BaseException as e:  # noqa: BLE001
            errs.append(e)
        finally:
            mv.release()

    th = [threading.Thread(target=run, args=(i,)) for i in range(threads)]
    t0 = time.perf_counter()
    for t in th:
        t.start()
    for t in th:
        t.join()
    dt = time.perf_counter() - t0
    for fd in fds.values():
        os.close(fd)
    if errs:
        raise errs[0]
    return dt, sum(done)


def _rank_devices(device: str, tp: int) -> list[str]:
    """Rank r's device: ``cuda:(r mod GPUs)`` for a CUDA device, else ``device``."""
    if not device.startswith("cuda"):
        return [device] * tp
    import torch
    n = max(1, torch.cuda.device_count())
    return [f"cuda:{r % n}" for r in range(tp)]


def _narrow(t, name: str, rank: int, tp: int):
    """Rank ``rank``'s slice of tensor ``name`` under :data:`LLAMA_TP` (a copy),
    as ``phx.loader.tp_sharder`` slices it."""
    from phx.loader import tp_sharder
    sl = tp_sharder(rank, tp, LLAMA_TP)(name, tuple(t.shape))
    if sl is None:
        return t
    k = t.shape[sl.dim] // tp
    return t.narrow(sl.dim, rank * k, k).contiguous()


def _load_tp(method: str, d: str, device: str, tp: int) -> dict[str, Any]:
    """``tp`` ranks at once, a thread each; tensors keyed ``"rank:name"``."""
    from phx import loader
    devs = _rank_devices(device, tp)
    index = os.path.join(d, "model.safetensors.index.json")

    def rank(r):
        if devs[r].startswith("cuda"):
            import torch
            torch.cuda.set_device(devs[r])
        if method == "phx":
            sd = loader.load_file(index, devs[r], shard=loader.tp_sharder(r, tp, LLAMA_TP))
        else:
            from safetensors.torch import load_file
            sd = {}
            for p in _shards(d):
                sd.update({k: _narrow(v, k, r, tp)
                           for k, v in load_file(p, device=devs[r]).items()})
        return {f"{r}:{k}": v for k, v in sd.items()}
    out: dict[str, Any] = {}
    with concurrent.futures.ThreadPoolExecutor(tp) as ex:
        for part in ex.map(rank, range(tp)):
            out.update(part)
    return {"tensors": out}


def _check_tp(d: str, tp: int) -> None:
    """Every sliced dimension of the checkpoint divides by ``tp`` (BenchError if not)."""
    from phx.loader import open_checkpoint, slice_shape, tp_sharder
    shard = tp_sharder(0, tp, LLAMA_TP)
    for name, t in open_checkpoint(os.path.join(d, "model.safetensors.index.json")).tensors.items():
        sl = shard(name, t.shape)
        if sl is not None:
            try:
                slice_shape(t, sl)
            except ValueError as e:
                raise BenchError(f"--tp {tp} does not divide: {e}") from None


def tp_reference(d: str, tp: int) -> dict[str, str]:
    """Digests of every rank's slices, ``"rank:name"``, from the files (safetensors)."""
    import torch
    from safetensors.torch import load_file
    refs: dict[str, str] = {}
    for p in _shards(d):
        for k, v in load_file(p).items():
            for r in range(tp):
                refs[f"{r}:{k}"] = digest(_narrow(v, k, r, tp).view(-1).view(torch.uint8).numpy())
    return refs


def _destinations(d: str, device: str) -> dict[str, Any]:
    """Tensors of every checkpoint tensor's shape and dtype on ``device``
    (phx-iter's "model parameters"), made before the clock starts."""
    import torch

    from phx import loader
    ck = loader.open_checkpoint(os.path.join(d, "model.safetensors.index.json"))
    return {n: torch.empty(t.shape, dtype=getattr(torch, loader.DTYPES[t.dtype][1]),
                           device=device) for n, t in ck.tensors.items()}


def _load(method: str, d: str, device: str, dest: dict | None = None) -> dict[str, Any]:
    """Run ``method``; returns the tensors (and what keeps them alive)."""
    index = os.path.join(d, "model.safetensors.index.json")
    if method in ("phx", "phx-prepared"):
        from phx import loader
        it = loader.iter_tensors(index, device, inflight_bytes=4 * loader.INFLIGHT_BYTES)
        return {"tensors": dict(it), "phx_stats": it.stats}
    if method == "phx-iter":
        from phx import loader
        it = loader.iter_tensors(index, device)
        for name, t in it:
            dest[name].copy_(t)            # vLLM's weight loaders copy into the parameter
            del t
        return {"tensors": dest, "phx_stats": it.stats}
    if method in ("st", "st-cpu"):
        from safetensors.torch import load_file
        out = {}
        for p in _shards(d):
            if method == "st":
                out.update(load_file(p, device=device))
            else:
                out.update({k: v.to(device) for k, v in load_file(p).items()})
        return {"tensors": out}
    if method in ("fst-nogds", "fst-phx"):
        if method == "fst-phx":
            import phx_fastsafetensors
            phx_fastsafetensors.replace()
        from fastsafetensors import SafeTensorsFileLoader
        import torch
        dev = torch.device(device)
        if dev.type == "cuda" and dev.index is None:   # fastsafetensors wants "cuda:N"
            dev = torch.device("cuda", torch.cuda.current_device())
        ld = SafeTensorsFileLoader(None, str(dev), nogds=True)
        ld.add_filenames({0: _shards(d)})
        fb = ld.copy_files_to_device()
        return {"tensors": {k: fb.get_tensor(k) for k in ld.get_keys()}, "keep": (ld, fb)}
    raise ValueError(f"unknown method {method}")


def _usage() -> tuple[float, int]:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime, peak_rss()


def worker(method: str, d: str, device: str, threads: int, tp: int = 1) -> dict[str, Any]:
    """One measured run in this (fresh) process."""
    if method == "raw":
        cpu0, _ = _usage()
        base = reset_peak_rss()
        dt, n = _raw(d, threads)
        cpu1, peak = _usage()
        return {"seconds": dt, "bytes": n, "cpu_s": cpu1 - cpu0, "peak_rss": peak,
                "extra_rss": peak - base, "digests": None}
    import torch
    cuda = device.startswith("cuda")
    if cuda:
        torch.zeros(1, device=device)          # CUDA start-up is not the loader's
        torch.cuda.synchronize()
    import safetensors.torch  # noqa: F401   (imports are not timed)
    if method.startswith("fst"):
        import fastsafetensors  # noqa: F401
    if method in ("phx", "phx-prepared", "phx-iter", "fst-phx"):
        import phx.gpu  # noqa: F401
        import phx.loader
        if method == "phx-prepared":      # the staging made before the clock starts
            phx.loader.prepare(device).result()
    dest = _destinations(d, device) if method == "phx-iter" else None
    devs = sorted(set(_rank_devices(device, tp))) if cuda else []
    for dev in devs:
        torch.cuda.synchronize(dev)
        torch.cuda.reset_peak_memory_stats(dev)
    gpu0 = sum(torch.cuda.memory_allocated(dev) for dev in devs)
    base = reset_peak_rss()
    cpu0, _ = _usage()
    t0 = time.perf_counter()
    res = _load(method, d, device, dest) if tp == 1 else _load_tp(method, d, device, tp)
    for dev in devs:
        torch.cuda.synchronize(dev)
    else:
        # safetensors' CPU tensors are a copy-on-write mmap of the file: read
        # lazily.  Touch one byte of every page, for every method alike, so
        # the time is until the weights are in memory.
        for t in res["tensors"].values():
            if t.numel():
                t.reshape(-1).view(torch.uint8)[::4096].max()
    dt = time.perf_counter() - t0
    cpu1, peak = _usage()
    gpu = None
    if devs:
        # what the load allocated on the GPU and gave back before it ended:
        # its extra memory beyond the tensors it returns (the peak of the sum
        # over devices is at most the sum of their peaks)
        end = sum(torch.cuda.memory_allocated(dev) for dev in devs)
        top = sum(torch.cuda.max_memory_allocated(dev) for dev in devs)
        gpu = {"before": gpu0, "end": end, "peak": top, "extra": top - end}
    st = res.get("phx_stats")
    phx_stats = None if st is None else {
        "files": len(st.files), "buffered_files": len(st.buffered_files),
        "memory_direct": sorted(set(st.memory_direct.values())),
        "peak_held_bytes": st.peak_held_bytes, "bytes_read": st.bytes_read}
    tensors = res["tensors"]
    n = sum(t.numel() * t.element_size() for t in tensors.values())

    def dig(item):
        k, t = item
        host = t.detach().contiguous().view(-1).view(torch.uint8).cpu()
        return k, digest(host.numpy())
    with concurrent.futures.ThreadPoolExecutor(min(16, os.cpu_count() or 2)) as ex:
        digests = dict(ex.map(dig, tensors.items()))
    return {"seconds": dt, "bytes": n, "cpu_s": cpu1 - cpu0, "peak_rss": peak,
            "extra_rss": peak - base, "gpu": gpu, "phx": phx_stats, "digests": digests}


def run_worker(args) -> int:
    out = worker(args.worker, args.worker_path, args.device, args.worker_threads,
                 args.worker_tp)
    sys.stdout.write("\nPHX-BENCH-RESULT " + json.dumps(out) + "\n")
    return 0


def _spawn(method: str, d: str, device: str, threads: int, timeout: float,
           tp: int = 1) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "phx", "bench", "load", "--worker", method,
           "--worker-path", d, "--device", device, "--worker-threads", str(threads),
           "--worker-tp", str(tp)]
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    for line in p.stdout.splitlines():
        if line.startswith("PHX-BENCH-RESULT "):
            return json.loads(line.split(" ", 1)[1])
    err = (p.stderr.strip().splitlines() or ["no output"])[-1]
    return {"error": f"exit {p.returncode}: {err[:300]}"}


# ---------------------------------------------------------------------------
# the run
# ---------------------------------------------------------------------------

def _default_device() -> str:
    try:
        import torch

        import phx.gpu
        if torch.cuda.is_available() and phx.gpu.is_available()[0]:
            return "cuda"
    except Exception:  # noqa: BLE001
        pass
    return "cpu"


def _methods(spec: str, device: str) -> list[str]:
    ms = [m.strip() for m in spec.split(",") if m.strip()]
    bad = [m for m in ms if m not in METHODS]
    if bad:
        raise BenchError(f"unknown methods {bad} (known: {', '.join(METHODS)})")
    for m in ("st-cpu", "phx-prepared"):
        if device == "cpu" and m in ms:
            ms.remove(m)             # identical to st / phx on the CPU
    return ms


def _copy_tree(src: str, dst: str) -> None:
    os.makedirs(dst, exist_ok=True)
    for f in os.listdir(src):
        if f.endswith((".safetensors", ".json")):
            shutil.copyfile(os.path.join(src, f), os.path.join(dst, f))


def read_once(d: str) -> None:
    """Read every shard of ``d`` through the page cache once (a warm row's
    "it was just read": a restart, a second replica, a fresh download)."""
    buf = bytearray(16 * MiB)
    for p in _shards(d):
        with open(p, "rb", buffering=0) as f:
            while f.readinto(buf):
                pass


def _warm_methods(spec: str, methods: list[str]) -> list[str]:
    ms = [m.strip() for m in spec.split(",") if m.strip()]
    bad = [m for m in ms if m not in WARM_METHODS]
    if bad:
        raise BenchError(f"no warm row for {bad} (known: {', '.join(WARM_METHODS)})")
    return [m for m in ms if m in methods]


def _row(where: str, m: str, t: int, cache: str, rs: list[dict[str, Any]]) -> dict[str, Any]:
    ok = [r for r in rs if "error" not in r]
    row: dict[str, Any] = {"where": where, "method": m if m != "raw" else f"raw ({t}t)",
                           "cache": cache, "runs": rs}
    if ok:
        secs, spread = median_spread([r["seconds"] for r in ok])
        row.update(seconds=secs, spread=spread, bytes=ok[0]["bytes"],
                   gbps=ok[0]["bytes"] / secs / 1e9,
                   cpu_s=median_spread([r["cpu_s"] for r in ok])[0],
                   peak_rss=max(r["peak_rss"] for r in ok),
                   extra_rss=max(r["extra_rss"] for r in ok),
                   check=("ok" if all(r["check"] in ("ok", "bytes only") for r in ok)
                          else next(r["check"] for r in ok
                                    if r["check"] not in ("ok", "bytes only"))),
                   caches_kept=any(r["caches_kept"] for r in ok))
        gpus = [r["gpu"] for r in ok if r.get("gpu")]
        if gpus:
            row["gpu_extra"] = max(g["extra"] for g in gpus)
        phx = [r["phx"] for r in ok if r.get("phx")]
        if phx:
            row["held_peak"] = max(x["peak_held_bytes"] for x in phx)
            row["buffered_files"] = max(x["buffered_files"] for x in phx)
            row["memory_direct"] = phx[0].get("memory_direct", [])
            row["files"] = phx[0]["files"]
    if len(ok) < len(rs):
        row["error"] = next(r["error"] for r in rs if "error" in r)
    return row


def _rows_for(where: str, d: str, methods, device, args, ref, bar) -> list[dict[str, Any]]:
    threads = [int(x) for x in args.raw_threads.split(",") if x]
    runs: list[tuple[str, int, str]] = []
    for m in methods:
        runs += [(m, t, "cold") for t in threads] if m == "raw" else [(m, 0, "cold")]
    runs += [(m, 0, "warm") for m in _warm_methods(args.warm, methods)]
    results: dict[tuple[str, int, str], list[dict[str, Any]]] = {r: [] for r in runs}
    for _ in range(args.repeat):
        order = list(runs)
        random.shuffle(order)          # no method always follows another
        for m, t, cache in order:
            kept = not drop_caches()
            if cache == "warm":
                read_once(d)
            r = _spawn(m, d, device, t or 16, args.timeout, 1 if m == "raw" else args.tp)
            r["caches_kept"] = kept
            if "error" not in r and r.get("digests") is not None:
                r["check"] = compare(ref, r.pop("digests"))
            elif "error" not in r:
                r.pop("digests", None)
                r["check"] = "bytes only" if r["bytes"] == sum(
                    os.path.getsize(p) for p in _shards(d)) else "short"
            results[(m, t, cache)].append(r)
            bar.update(1)
    rows = [_row(where, m, t, cache, rs) for (m, t, cache), rs in results.items()]
    best_raw = max((r for r in rows if r["method"].startswith("raw") and "gbps" in r),
                   key=lambda r: r["gbps"], default=None)
    for r in rows:
        if best_raw is not None and "gbps" in r:
            r["vs_raw"] = r["gbps"] / best_raw["gbps"]
    return rows


def _mib(x) -> float:
    return float("nan") if x is None else x / MiB


def _print(rows, device) -> None:
    print(fmt_table(
        ["where", "method", "cache", "s", "GB/s", "spread", "x raw", "CPU s", "peak RSS MiB",
         "extra RSS MiB", "extra GPU MiB", "held MiB", "check"],
        [[r["where"], r["method"], r["cache"], r.get("seconds", float("nan")),
          r.get("gbps", float("nan")), f"{r.get('spread', 0) * 100:.0f}%",
          r.get("vs_raw", float("nan")), r.get("cpu_s", float("nan")),
          (r.get("peak_rss") or 0) / MiB, (r.get("extra_rss") or 0) / MiB,
          _mib(r.get("gpu_extra")), _mib(r.get("held_peak")),
          r.get("check", r.get("error", "?")) + (" (caches not dropped)"
                                                 if r.get("caches_kept") else "")]
         for r in rows]))
    for where in dict.fromkeys(r["where"] for r in rows):
        by = {(r["method"], r["cache"]): r for r in rows if r["where"] == where and "gbps" in r}
        raws = [r for (m, c), r in by.items() if m.startswith("raw")]
        for ours in ("phx", "phx-prepared", "phx-iter"):
            if (ours, "cold") not in by:
                continue
            mine = by[(ours, "cold")]
            line = [f"{where}: {ours}"]
            if raws:
                line.append(f"{mine['gbps'] / max(r['gbps'] for r in raws):.2f}x raw")
            for m in ("fst-nogds", "st", "st-cpu"):
                if (m, "cold") in by:
                    line.append(f"{mine['gbps'] / by[(m, 'cold')]['gbps']:.2f}x {m}")
            print(", ".join(line) + f" (to {device})")
        warm = {m: r for (m, c), r in by.items() if c == "warm"}
        if "phx" in warm:
            line = [f"{where} warm: phx {warm['phx']['gbps']:.2f} GB/s"]
            if ("phx", "cold") in by:
                line.append(f"{warm['phx']['gbps'] / by[('phx', 'cold')]['gbps']:.2f}x phx cold")
            for m, r in warm.items():
                if m != "phx":
                    line.append(f"{warm['phx']['gbps'] / r['gbps']:.2f}x {m} warm")
            mem = warm["phx"].get("memory_direct")
            why = f" ({', '.join(mem)} is memory: read O_DIRECT)" if mem else ""
            print(", ".join(line) + f"; {warm['phx'].get('buffered_files', 0)} of "
                  f"{warm['phx'].get('files', 0)} files read from the page cache{why}")


def run(args) -> int:
    if args.worker:
        return run_worker(args)
    device = args.device or _default_device()
    methods = _methods(args.methods, device)
    _warm_methods(args.warm, methods)
    base = bench_dir(args.dir, ".")
    ckpt = os.path.join(base, "phx-bench-load")
    size = positive_size_value(args.size)
    if os.geteuid() != 0:
        print("phx bench load: not root: the page cache cannot be dropped, rows are warm",
              file=sys.stderr)
    reuse = args.keep and os.path.exists(os.path.join(ckpt, "digests.json"))
    if not reuse:
        try:
            import safetensors  # noqa: F401
            import torch  # noqa: F401
        except ImportError as e:
            raise BenchError(f"writing the checkpoint needs torch and safetensors ({e})") \
                from None
        shutil.rmtree(ckpt, ignore_errors=True)
        need_space(base, int(size * 1.1) + (64 << 20), "the checkpoint")
    try:
        return _run(args, device, methods, ckpt, size, reuse)
    finally:
        if not args.keep:
            shutil.rmtree(ckpt, ignore_errors=True)
        else:
            print(f"phx bench load: kept the checkpoint in {ckpt} (--keep)", file=sys.stderr)


def _run(args, device: str, methods: list[str], ckpt: str, size: int, reuse: bool) -> int:
    if reuse:
        with open(os.path.join(ckpt, "digests.json")) as f:
            ref = json.load(f)
    else:
        os.makedirs(ckpt)
        ref = write_checkpoint(ckpt, size, args.shards, 1234, not args.quiet)
    total = sum(os.path.getsize(p) for p in _shards(ckpt))
    if args.tp > 1:
        methods = [m for m in methods if m in TP_METHODS]
        _check_tp(ckpt, args.tp)
        ref = tp_reference(ckpt, args.tp)
    nrows = sum(len(args.raw_threads.split(",")) if m == "raw" else 1 for m in methods)
    nrows += len(_warm_methods(args.warm, methods))
    rows: list[dict[str, Any]] = []

    def report() -> None:
        # after each place: a run cut short still leaves its table and JSON
        _print(rows, device)
        write_json(args.json, {
            "benchmark": "load", "device": device, "checkpoint_bytes": total,
            "tensors": len(ref), "shards": args.shards, "repeat": args.repeat, "tp": args.tp,
            "storage": storage_description(ckpt), "rows": rows})
        if args.plot and rows:
            plot(rows, device, args.plot)

    bar = progress(nrows * args.repeat * ((not args.no_disk) + bool(args.zram)),
                   "phx bench load", not args.quiet)
    try:
        if args.zram:          # first: where software, not the device, decides
            from phx.bench._zram import unavailable, zram_ext4
            zsize = parse_size(args.zram)
            why = unavailable(zsize)
            if why is None and zsize < total * 1.05 + 64 * MiB:
                why = f"{args.zram} is too small for the {total / GiB:.1f} GiB checkpoint"
            if why:
                print(f"phx bench load: no zram rows: {why}", file=sys.stderr)
            else:
                with zram_ext4(zsize) as z:
                    zd = os.path.join(z.mountpoint, "ckpt")
                    _copy_tree(ckpt, zd)
                    rows += _rows_for("zram", zd, methods, device, args, ref, bar)
                report()
        if not args.no_disk:
            rows += _rows_for("disk", ckpt, methods, device, args, ref, bar)
            report()
    finally:
        bar.close()
    bad = [r for r in rows if r.get("check") not in ("ok", "bytes only")]
    for r in bad:
        print(f"phx bench load: {r['where']} {r['method']}: "
              f"{r.get('check') or r.get('error')}", file=sys.stderr)
    if not rows:
        print("phx bench load: nothing was measured", file=sys.stderr)
        return 1
    return 1 if bad else 0


def plot(rows: list[dict[str, Any]], device: str, path: str) -> None:
    """GB/s per method (median, whiskers min-max of the runs), one panel per
    place (zram, disk), cold and warm rows side by side."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    places = list(dict.fromkeys(r["where"] for r in rows))
    fig, axes = plt.subplots(1, len(places), squeeze=False,
                             figsize=(max(5.0, 0.7 * len(rows) / len(places) + 2) * len(places),
                                      4.2))
    for ax, where in zip(axes[0], places):
        mine = [r for r in rows if r["where"] == where and "gbps" in r]
        labels, ys, lo, hi, colours = [], [], [], [], []
        for r in mine:
            gb = [r["bytes"] / x["seconds"] / 1e9 for x in r["runs"] if "seconds" in x]
            labels.append(r["method"] + (" warm" if r["cache"] == "warm" else ""))
            ys.append(r["gbps"])
            lo.append(r["gbps"] - min(gb, default=r["gbps"]))
            hi.append(max(gb, default=r["gbps"]) - r["gbps"])
            colours.append("tab:red" if r["method"].startswith("phx") else
                           "tab:gray" if r["method"].startswith("raw") else "tab:blue")
        ax.bar(range(len(ys)), ys, yerr=[lo, hi], capsize=2, color=colours)
        ax.set_xticks(range(len(ys)), labels, rotation=30, ha="right", fontsize=8)
        ax.set_ylabel("GB/s (median, min-max)")
        ax.set_title(f"{where} -> {device}", fontsize=10)
        ax.grid(axis="y", alpha=0.3)
    fig.suptitle("phx bench load: checkpoint load", fontsize=10)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
