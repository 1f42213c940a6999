"""FlexLLMGen's real ``generate`` on the CPU: stock ``TorchDisk`` vs ``PhxDisk``, checked.

A correctness harness, not a benchmark (issue 26, part 6).  One process builds
OPT (``opt-125m`` by default) with seeded random weights, once, and runs
FlexLLMGen 0.1.8's own ``OptLM.generate`` with the whole KV cache on its disk
device (policy ``--percent 100 0 0 0 100 0``, overlap on), under
:func:`cpu_shim.cuda_on_cpu` (no GPU: FlexLLMGen's "GPU" is the CPU):

1. ``stock``: FlexLLMGen's ``TorchDisk`` (per-tensor digests of every KV
   tensor's prefill rows, as ``run_four.py`` takes them);
2. ``phx``: :class:`phx_disk.PhxDisk` (``dual`` with a budget of
   ``group1_layers`` layers: those in the page cache, the rest -- Group 2 -- on
   the direct backend: an NVMe namespace through ``NvmeBackend`` when
   ``PHX_KV_NVME`` names one, which :func:`main`'s ``--nvme`` sets, else the
   O_DIRECT slab);
3. ``control`` (optional): the same as 2, but when decode step 1 first reads
   Group 2, the prefill rows of that layer's K and V are overwritten *on the
   storage* (the backend's own write, behind the store's back) with seeded
   garbage before either is read.

What each PhxDisk run records for the checks (:func:`check`): the token ids and
the KV digest; every tensor's group and extent (byte offsets in the backend's
address space: LBA x LBA size on a namespace) as the plan bound them; for each
Group 2 tensor, the SHA-256 of its prefill rows read *raw* from the storage
(the namespace's LBAs, or the slab file with ``pread``) just before FlexLLMGen
deletes it; the namespace's command counters (DSM deallocate commands and
bytes) after ``generate`` freed everything; and, for a namespace, what the
LBAs of the Group 2 run read as afterwards, with a sentinel pattern written
around them before the run (deallocated blocks read as zeroes on QEMU's NVMe
with ``discard=unmap``; the sentinel just outside must survive).

The model is built once and the runs share it (``OptLM``'s layers hold the
``ExecutionEnv``; each run gets its own env with its own disk): weights are
host memory the disk device never touches, and generating 125 M seeded values
three times costs minutes in a TCG guest.  Weights are random bit patterns of
fp16 values of magnitude 1/64..1/32 (layer-norm scales 1..2), made with integer
arithmetic (cheap under TCG): FlexLLMGen's own dummy weights are all ones,
which makes every KV row alike and would hide a misplaced row.

Run: ``python adapters/flexllmgen/cpu_check.py [--nvme /dev/ngXnY --first-lba N]``
(exit 0 when every check holds).  The QEMU guest test is
``tests/guest/nvme/test_flexllmgen_nvme.py`` (``make test-guest-flex``).
"""
from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import sys
import tempfile
import threading
import time
import zlib
from collections.abc import Callable
from typing import Any

import numpy as np
import numpy.typing as npt

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

#: the sentinel byte written around the Group 2 run before a namespace run
SENTINEL = 0xA5


@dataclasses.dataclass(frozen=True)
class Workload:
    """What one check runs: small enough for a TCG guest (minutes per run)."""

    model: str = "opt-125m"
    prompt: int = 4
    gen: int = 3
    batch: int = 1
    seed: int = 26
    #: layers whose K and V the budget puts in the page cache (Group 1); the rest
    #: go to the direct backend (Group 2).  0: everything on the direct backend
    group1_layers: int = 6


# -- weights -----------------------------------------------------------------------------

def _weight_bits(name: str, shape: tuple[int, ...], seed: int) -> np.ndarray:
    """Seeded fp16 values, per weight name: sign and mantissa random, magnitude
    1/64..1/32 (layer-norm scales 1..2, positive); integer arithmetic only."""
    n = int(np.prod(shape))
    rng = np.random.Generator(np.random.PCG64(seed ^ zlib.crc32(name.encode())))
    bits: npt.NDArray[Any] = np.frombuffer(rng.bytes(2 * n), dtype=np.uint16)
    if "layer_norm" in name and name.endswith("weight"):
        bits = (bits & 0x03FF) | (15 << 10)              # +1.0 .. +2.0
    else:
        bits = (bits & 0x83FF) | (9 << 10)               # +-(1/64 .. 1/32)
    return bits.view(np.float16).reshape(shape)


@dataclasses.dataclass
class _SeededWeights:
    """A stand-in for ``flex_opt.init_weight_list`` while the model is built."""

    seed: int

    def __call__(self, weight_specs: Any, policy: Any, env: Any) -> list[Any]:
        if policy.w_gpu_percent != 100:
            raise ValueError("the check keeps the weights on the compute device")
        out = []
        for shape, dtype, filename in weight_specs:
            w = env.gpu.allocate(shape, dtype)
            w.load_from_np(_weight_bits(os.path.basename(filename), tuple(shape), self.seed))
            out.append(w)
        return out


def _policy(batch: int) -> Any:
    """Weights and activations on the compute device, the KV cache 100 % on the disk
    device, overlap on (FlexLLMGen's defaults otherwise)."""
    from flexgen import flex_opt as fo
    from flexgen.compression import CompressionConfig
    cc = CompressionConfig(num_bits=4, group_size=64, group_dim=0, symmetric=False)
    return fo.Policy(batch, 1, 100, 0, 0, 0, 100, 0, True, True, True, False, 1.0, False,
                     cc, False, CompressionConfig(num_bits=4, group_size=64, group_dim=2,
                                                  symmetric=False))


def build_model(w: Workload) -> Any:
    """An ``OptLM`` on the CPU with seeded weights (call inside ``cuda_on_cpu()``)."""
    from flexgen import flex_opt as fo
    from flexgen.pytorch_backend import TorchDevice
    from flexgen.utils import ExecutionEnv
    cpu = TorchDevice("cpu")
    env = ExecutionEnv(gpu=TorchDevice("cpu"), cpu=cpu, disk=None, mixed=None)
    own, fo.init_weight_list = fo.init_weight_list, _SeededWeights(w.seed)
    try:
        return fo.OptLM(fo.get_opt_config(w.model), env, fo.DUMMY_WEIGHT, _policy(w.batch))
    finally:
        fo.init_weight_list = own


def _use_disk(model: Any, disk: Any) -> None:
    """Give the model (and each of its layers) an env whose disk is ``disk``."""
    from flexgen.pytorch_backend import TorchMixedDevice
    old = model.env
    env = dataclasses.replace(old, disk=disk,
                              mixed=TorchMixedDevice([old.gpu, old.cpu, disk]))
    model.env = env
    for layer in model.layers:
        layer.env = env
        for sub in ("attention", "mlp"):         # TransformerLayer (sep_layer=False)
            if hasattr(layer, sub):
                getattr(layer, sub).env = env


def inputs_for(w: Workload) -> list[list[int]]:
    """Synthetic prompts (no tokenizer: no network), the same for every run."""
    rng = np.random.default_rng(w.seed)
    return [rng.integers(4, 50000, w.prompt).tolist() for _ in range(w.batch)]


# -- raw access to the direct backend's storage -----------------------------------------

def _raw_read(be: Any, offset: int, nbytes: int) -> bytes:
    """``nbytes`` at ``offset`` of the backend's storage, bypassing the store and the
    backend's own read path: the namespace's LBAs (whole blocks), or the slab file."""
    ns = getattr(be, "ns", None)
    if ns is not None:
        from phx.kv import _sys
        a = ns.lba_size
        lo = offset // a * a
        buf = _sys.aligned_empty(-(-(offset + nbytes - lo) // a) * a)
        got = ns.read(buf, lo)
        if got != buf.nbytes:
            raise OSError(f"short read of LBAs at byte {lo}: {got} of {buf.nbytes}")
        return bytes(buf[offset - lo:offset - lo + nbytes])
    fd = os.open(be.path, os.O_RDONLY)
    try:
        return os.pread(fd, nbytes, offset)
    finally:
        os.close(fd)


def _garbage(nbytes: int, seed: int) -> np.ndarray:
    """Finite fp16 values of magnitude 4..8 with random signs: KV no model wrote."""
    bits = np.frombuffer(np.random.default_rng(seed).bytes(nbytes), dtype=np.uint16)
    return ((bits & 0x83FF) | (17 << 10)).view(np.uint8)


def observed_disk(prompt: int, corrupt: bool) -> type:
    """A :class:`phx_disk.PhxDisk` that records what the checks need (see the module doc)."""
    from phx.kv.planner import DIRECT
    from phx_disk import PhxDisk

    class ObservedDisk(PhxDisk):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            self.placement: list[dict[str, Any]] = []
            self.direct: Any = None
            self.raw_digests: dict[int, str] = {}
            self.corrupted: list[dict[str, Any]] | None = None
            self._corrupt_pending = corrupt
            self._hook_lock = threading.Lock()
            super().__init__(*args, **kwargs)

        def _plan(self) -> None:
            super()._plan()
            ts = self.store.tensors()
            for t in ts:
                e = t.extent
                assert e is not None                # plan() binds every tensor
                # PhxDisk names a tensor by FlexLLMGen's name; its K is allocated first
                kind = "k" if t.id == min(u.id for u in ts if u.layer == t.layer) else "v"
                self.placement.append({"id": t.id, "layer": t.layer, "kind": kind,
                                       "group": "direct" if t.group == DIRECT else "pagecache",
                                       "start": e.start, "length": e.length,
                                       "nbytes": t.nbytes, "row_bytes": t.row_bytes})
                if t.group == DIRECT and self.direct is None:
                    self.direct = self.store.backend_of(t)

        def _load(self, dst: Any, dst_indices: Any, src: Any, src_indices: Any) -> None:
            kv = src.data
            # every load passes here first, so the first Group 2 read (decode step 1:
            # every prefill row is stored by then) finds its layer's K and V
            # corrupted, whichever copy thread gets there first
            with self._hook_lock:
                if self._corrupt_pending and kv.group == DIRECT:
                    self._corrupt_pending = False
                    self.corrupted = []
                    for t in self.store.tensors():
                        if t.layer == kv.layer and t.group == DIRECT:
                            n = prompt * t.row_bytes
                            be, e = self.store.backend_of(t), t.extent
                            assert be is not None and e is not None   # bound, not freed
                            be.write(_garbage(n, t.id), e.start)
                            self.corrupted.append({"id": t.id, "layer": t.layer,
                                                   "start": e.start, "bytes": n})
            super()._load(dst, dst_indices, src, src_indices)

        def delete(self, tensor: Any) -> None:
            kv = tensor.data
            if (kv is not None and kv in self.store.tensors() and kv.group == DIRECT
                    and kv.materialized):
                raw = _raw_read(self.store.backend_of(kv), kv.extent.start,
                                prompt * kv.row_bytes)
                self.raw_digests[kv.id] = hashlib.sha256(raw).hexdigest()
            super().delete(tensor)
    return ObservedDisk


# -- the runs ------------------------------------------------------------------------------

def _generate(model: Any, w: Workload) -> tuple[list[list[int]], list[float]]:
    from flexgen.timer import timers
    timers("generate").reset()
    ids = model.generate(inputs_for(w), max_new_tokens=w.gen)
    return np.asarray(ids).tolist(), list(timers("generate").costs)


def run_stock(model: Any, w: Workload, root: str) -> dict[str, Any]:
    """FlexLLMGen's TorchDisk, digesting each KV tensor's prefill rows as it is deleted."""
    from run_four import _Digests, _digesting_devices
    dg = _Digests()
    DigestDisk, _ = _digesting_devices(dg)
    disk = DigestDisk(os.path.join(root, "stock"))
    _use_disk(model, disk)
    t0 = time.perf_counter()
    try:
        ids, costs = _generate(model, w)
    finally:
        disk.close_copy_threads()
    return {"config": "stock", "ids": ids, "kv_digest": dg.digest(),
            "tensor_digests": {int(k): v for k, v in dg.by_index.items()},
            "step_s": costs, "seconds": time.perf_counter() - t0}


def _pair_bytes(w: Workload) -> int:
    """One layer's K + V, page-rounded: Algorithm 1's unit."""
    from flexgen import flex_opt as fo
    c = fo.get_opt_config(w.model)
    rows = w.prompt + w.gen - 1
    t = int(rows * w.batch * c.n_head * (c.input_dim // c.n_head) * 2)
    return 2 * (-(-t // 4096) * 4096)


def run_phx(model: Any, w: Workload, root: str, corrupt: bool = False) -> dict[str, Any]:
    """PhxDisk (dual, Group 1 = the first ``group1_layers`` layers), observed."""
    name = "control" if corrupt else "phx"
    mode = "dual" if w.group1_layers else "direct"
    disk = observed_disk(w.prompt, corrupt)(
        os.path.join(root, name), mode=mode,
        budget=w.group1_layers * _pair_bytes(w) if w.group1_layers else None)
    _use_disk(model, disk)
    t0 = time.perf_counter()
    try:
        ids, costs = _generate(model, w)
        be = disk.direct
        ns = getattr(be, "ns", None)
        res: dict[str, Any] = {
            "config": name, "ids": ids, "kv_digest": disk.kv_digest(),
            "tensor_digests": {int(k): v for k, v in disk._digests.items()},
            "raw_digests": disk.raw_digests, "placement": disk.placement,
            "backend": type(be).__name__ if be is not None else None,
            "backend_path": getattr(be, "path", None),
            "alignment": getattr(be, "alignment", None),
            "corrupted": disk.corrupted, "plan": disk.stats()["plan"],
            "nvme_stats": ns.stats() if ns is not None else None,
            "nvme_info": ({k: ns.info[k] for k in ("lba_size", "dlfeat", "deallocated_reads")}
                          if ns is not None else None),
            "step_s": costs}
    finally:
        disk.close()
    res["seconds"] = time.perf_counter() - t0
    return res


# -- the namespace around the run: sentinel before, read-back after -----------------------

def _open_whole(dev: str) -> Any:
    import phx.nvme
    return phx.nvme.open(dev, force=True)


def fill_sentinel(dev: str, first_lba: int, nbytes: int, margin_lbas: int = 8) -> None:
    """Write :data:`SENTINEL` over ``margin`` LBAs before ``first_lba`` and ``nbytes``
    (+ margin) from it: what was there before the run, so that afterwards a
    deallocated block (zeroes) is told from one never written."""
    from phx.kv import _sys
    with _open_whole(dev) as ns:
        a = ns.lba_size
        lo = (first_lba - margin_lbas) * a
        buf = _sys.aligned_empty((-(-nbytes // a) + 2 * margin_lbas) * a)
        buf[:] = SENTINEL
        if ns.write(buf, lo) != buf.nbytes:
            raise OSError("short sentinel write")


def read_back(dev: str, start: int, end: int, margin_lbas: int = 8) -> dict[str, Any]:
    """After the run: the Group 2 range ``[start, end)`` (bytes) and ``margin`` LBAs
    either side, read through a fresh handle on the namespace."""
    from phx.kv import _sys
    with _open_whole(dev) as ns:
        a = ns.lba_size
        m = margin_lbas * a
        buf = _sys.aligned_empty(end - start + 2 * m)
        if ns.read(buf, start - m) != buf.nbytes:
            raise OSError("short read-back")
    inside = buf[m:m + end - start]
    return {"start": start, "end": end, "lba_size": a,
            "inside_nonzero_bytes": int(np.count_nonzero(inside)),
            "inside_sentinel_bytes": int(np.count_nonzero(inside == SENTINEL)),
            "before_intact": bool((buf[:m] == SENTINEL).all()),
            "after_intact": bool((buf[m + end - start:] == SENTINEL).all())}


def group2_run(res: dict[str, Any]) -> tuple[int, int]:
    """[first byte, end) of the Group 2 extents of a phx run."""
    g2 = [p for p in res["placement"] if p["group"] == "direct"]
    return min(p["start"] for p in g2), max(p["start"] + p["length"] for p in g2)


def run_all(w: Workload, root: str, nvme: str | None = None, first_lba: int = 2048,
            control: bool = True, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Stock, phx (and the control): everything :func:`check` needs."""
    from phx.kv.nvme_backend import ENV
    saved = os.environ.pop(ENV, None)
    if nvme:
        # the store's direct backend comes from the environment (phx.kv.nvme_backend)
        os.environ[ENV] = f"{nvme},first_lba={first_lba},force=1"
    try:
        return _run_all(w, root, nvme, first_lba, control, log)
    finally:
        os.environ.pop(ENV, None)
        if saved is not None:
            os.environ[ENV] = saved


def _run_all(w: Workload, root: str, nvme: str | None, first_lba: int, control: bool,
             log: Callable[[str], None]) -> dict[str, Any]:
    from cpu_shim import cuda_on_cpu
    out: dict[str, Any] = {"workload": dataclasses.asdict(w), "nvme": nvme,
                           "first_lba": first_lba if nvme else None}
    with cuda_on_cpu():
        t0 = time.perf_counter()
        model = build_model(w)
        out["build_s"] = time.perf_counter() - t0
        log(f"model {w.model} built in {out['build_s']:.1f} s")
        out["stock"] = run_stock(model, w, root)
        log(f"stock: {out['stock']['seconds']:.1f} s, ids {out['stock']['ids']}")
        from flexgen import flex_opt as fo
        span = 2 * fo.get_opt_config(w.model).num_hidden_layers * _pair_bytes(w)   # twice the KV
        if nvme:
            fill_sentinel(nvme, first_lba, span)
        out["phx"] = run_phx(model, w, root)
        log(f"phx ({out['phx']['backend']}): {out['phx']['seconds']:.1f} s, "
            f"ids {out['phx']['ids']}")
        if nvme:
            out["read_back"] = read_back(nvme, *group2_run(out["phx"]))
        if control:
            out["control"] = run_phx(model, w, root, corrupt=True)
            log(f"control: {out['control']['seconds']:.1f} s, ids {out['control']['ids']}")
    return out


# -- the checks ----------------------------------------------------------------------------

def check(out: dict[str, Any]) -> list[str]:
    """Every failed check as a sentence (empty: all hold).  See the module doc."""
    bad: list[str] = []
    st, px = out["stock"], out["phx"]
    if px["ids"] != st["ids"]:
        bad.append(f"token ids differ: stock {st['ids']}, phx {px['ids']}")
    if px["kv_digest"] != st["kv_digest"] or st["kv_digest"] is None:
        bad.append(f"KV digest differs: stock {st['kv_digest']}, phx {px['kv_digest']}")
    g2 = sorted((p for p in px["placement"] if p["group"] == "direct"),
                key=lambda p: p["start"])
    if not g2:
        bad.append("no tensor on the direct backend (Group 2)")
        return bad
    if out.get("nvme") and px["backend"] != "NvmeBackend":
        bad.append(f"Group 2 went to {px['backend']}, not the NVMe namespace")
    # sequential: one gap-free run from the first LBA, in layer order (K, V)
    lba = px["alignment"]
    first = out["first_lba"] * lba if out.get("first_lba") is not None else g2[0]["start"]
    if g2[0]["start"] != first:
        bad.append(f"Group 2 starts at byte {g2[0]['start']}, not at the first LBA ({first})")
    for a, b in zip(g2, g2[1:]):
        if b["start"] != a["start"] + a["length"]:
            bad.append(f"gap or overlap: layer {a['layer']}{a['kind']} ends at "
                       f"{a['start'] + a['length']}, layer {b['layer']}{b['kind']} starts at "
                       f"{b['start']}")
    if [p["layer"] for p in g2] != sorted(p["layer"] for p in g2):
        bad.append("Group 2 extents are not in layer order")
    if any(p["start"] % lba or p["length"] % lba for p in g2):
        bad.append("an extent is not LBA aligned")
    # the bytes at those LBAs are the KV stock computed
    for p in g2:
        want = st["tensor_digests"].get(p["id"])
        got = px["raw_digests"].get(p["id"])
        if got is None or got != want:
            bad.append(f"layer {p['layer']}{p['kind']}: raw bytes at byte {p['start']} "
                       f"{'missing' if got is None else 'differ from stock'}")
    # TRIM: one deallocate per Group 2 tensor as FlexLLMGen freed it, exactly its LBAs
    ns = px.get("nvme_stats")
    if out.get("nvme"):
        total = sum(p["length"] for p in g2)
        if ns is None or ns["dsm_commands"] != len(g2) or ns["deallocated_bytes"] != total:
            bad.append(f"TRIM: {ns and ns['dsm_commands']} DSM commands for "
                       f"{ns and ns['deallocated_bytes']} bytes, want {len(g2)} for {total}")
        rb = out.get("read_back")
        if rb is None:
            bad.append("no read-back of the Group 2 LBAs")
        else:
            if not (rb["before_intact"] and rb["after_intact"]):
                bad.append(f"the sentinel around the Group 2 run was touched: {rb}")
            zeroes = (px["nvme_info"] or {}).get("deallocated_reads") == "zeroes"
            if zeroes and out.get("discard_honoured", True) and rb["inside_nonzero_bytes"]:
                bad.append(f"{rb['inside_nonzero_bytes']} bytes of the deallocated Group 2 "
                           "LBAs do not read as zeroes")
    # the negative control must be caught
    ct = out.get("control")
    if ct is not None:
        if ct["corrupted"] is None:
            bad.append("control: nothing was corrupted")
        elif ct["kv_digest"] == st["kv_digest"]:
            bad.append("control: corrupted KV on the storage went unnoticed (same digest)")
    return bad


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--nvme", help="namespace char device (/dev/ngXnY) for Group 2")
    ap.add_argument("--first-lba", type=int, default=2048)
    ap.add_argument("--model", default=Workload.model)
    ap.add_argument("--prompt", type=int, default=Workload.prompt)
    ap.add_argument("--gen", type=int, default=Workload.gen)
    ap.add_argument("--batch", type=int, default=Workload.batch)
    ap.add_argument("--group1-layers", type=int, default=Workload.group1_layers)
    ap.add_argument("--no-control", action="store_true")
    ap.add_argument("--dir", help="offload directory (default: a temporary one)")
    ap.add_argument("--json", help="write every result here")
    a = ap.parse_args(argv)
    w = Workload(a.model, a.prompt, a.gen, a.batch, Workload.seed, a.group1_layers)
    with tempfile.TemporaryDirectory(dir=a.dir) as root:
        out = run_all(w, root, a.nvme, a.first_lba, not a.no_control)
    out["failures"] = check(out)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    for f in out["failures"]:
        print(f"FAIL: {f}")
    print("all checks hold" if not out["failures"] else f"{len(out['failures'])} checks failed")
    return 1 if out["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
