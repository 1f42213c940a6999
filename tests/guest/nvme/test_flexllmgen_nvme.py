"""FlexLLMGen's real generate with Group 2 of the KV cache on an NVMe namespace (issue 26, part 6).

In the QEMU guest (``make test-guest-flex``: tests/guest/nvme/suite_flex.sh, one
emulated controller with ``discard=unmap``): FlexLLMGen 0.1.8's ``OptLM`` for
OPT-125M on the CPU (``adapters/flexllmgen/cpu_shim.py``), seeded weights, a
4-token prompt, 3 new tokens, batch 1, the KV cache 100 % on the disk device.
Three runs in one process (``adapters/flexllmgen/cpu_check.py``): stock
``TorchDisk``; ``PhxDisk`` (dual, layers 0-5 in the page cache, 6-11 -- Group 2 --
on the namespace through ``NvmeBackend``, named by ``PHX_KV_NVME``); and the same
with the first Group 2 layer's K and V overwritten on the namespace before decode
reads them (the negative control).

On the host (no ``/dev/ng*``) the same runs go to the O_DIRECT slab instead and
the namespace-only checks skip.  A correctness run, not a speed claim.
"""
from __future__ import annotations

import glob
import os
import sys
from typing import Any

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))))
sys.path.insert(0, os.path.join(ROOT, "adapters", "flexllmgen"))

pytest.importorskip("torch")
try:
    import flexgen.flex_opt  # noqa: F401
except ImportError as e:
    pytest.skip(f"flexgen 0.1.8 is not installed (make venv installs it): {e}",
                allow_module_level=True)

FIRST_LBA = 2048


def _namespace() -> str | None:
    """The guest's emulated namespace (serial phx0000, a QEMU controller: the harness
    names it so), or None.  The check writes LBAs with ``force``: never a real drive."""
    if not glob.glob("/dev/ng*n1"):
        return None
    import phx.nvme
    for p in sorted(glob.glob("/dev/ng*n1")):
        try:
            info = phx.nvme.identify(p)
        except OSError:
            continue
        if info["serial"] == "phx0000" and info["model"].startswith("QEMU"):
            return p
    return None


def _discard_honoured() -> bool:
    """run_guest.py attached the drive with discard=unmap (it says so on the kernel
    command line): deallocated blocks then really read as zeroes."""
    try:
        with open("/proc/cmdline") as f:
            return "phx.nvme_discard=unmap" in f.read().split()
    except OSError:
        return False


@pytest.fixture(scope="module")
def out(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    import cpu_check
    dev = _namespace()
    root = str(tmp_path_factory.mktemp("flexkv"))
    res = cpu_check.run_all(cpu_check.Workload(), root, nvme=dev, first_lba=FIRST_LBA,
                            log=lambda s: print(f"PHX-INFO flex: {s}", flush=True))
    res["discard_honoured"] = _discard_honoured()
    res["failures"] = cpu_check.check(res)
    return res


def _group2(out: dict[str, Any]) -> list[dict[str, Any]]:
    return sorted((p for p in out["phx"]["placement"] if p["group"] == "direct"),
                  key=lambda p: p["start"])


def test_tokens_and_kv_identical_to_stock(out):
    st, px = out["stock"], out["phx"]
    print(f"PHX-INFO flex: stock ids {st['ids']}, phx ids {px['ids']}, "
          f"digest {px['kv_digest'][:16]}")
    assert len(st["ids"][0]) == out["workload"]["prompt"] + out["workload"]["gen"]
    assert px["ids"] == st["ids"]
    assert st["kv_digest"] is not None and px["kv_digest"] == st["kv_digest"]
    assert px["tensor_digests"] == st["tensor_digests"]


def test_group2_on_the_namespace_sequential_by_lba(out):
    px = out["phx"]
    g2 = _group2(out)
    if out["nvme"]:
        assert px["backend"] == "NvmeBackend" and px["backend_path"] == out["nvme"]
    layers = sorted({p["layer"] for p in g2})
    assert layers == list(range(6, 12)), px["plan"]            # Group 1: layers 0-5
    assert px["plan"]["layers_pagecache"] == list(range(6))
    lba = px["alignment"]
    runs = [(p["layer"], p["kind"], p["start"] // lba, p["length"] // lba) for p in g2]
    print("PHX-INFO flex: Group 2 extents (layer, kind, first LBA, LBAs): " + str(runs))
    if out["nvme"]:
        assert runs[0][2] == FIRST_LBA
    for (_, _, a, n), (_, _, b, _) in zip(runs, runs[1:]):
        assert b == a + n                                       # start(n+1) = start(n) + blocks(n)
    assert [r[0] for r in runs] == sorted(r[0] for r in runs)  # layer order
    # the bytes at those LBAs, read raw, are the KV stock computed for that tensor
    for p in g2:
        assert px["raw_digests"][p["id"]] == out["stock"]["tensor_digests"][p["id"]], p


def test_trim_when_flexllmgen_frees_the_kv(out):
    if not out["nvme"]:
        pytest.skip("runs in the QEMU guest (make test-guest-flex): no NVMe namespace here")
    g2 = _group2(out)
    st = out["phx"]["nvme_stats"]
    rb = out["read_back"]
    print(f"PHX-INFO flex: DSM deallocate commands {st['dsm_commands']}, "
          f"bytes {st['deallocated_bytes']}; read-back {rb}; "
          f"DLFEAT {out['phx']['nvme_info']}")
    assert st["dsm_commands"] == len(g2)                        # one per freed tensor
    assert st["deallocated_bytes"] == sum(p["length"] for p in g2)
    assert rb["before_intact"] and rb["after_intact"]           # nothing outside the run
    if out["phx"]["nvme_info"]["deallocated_reads"] == "zeroes" and out["discard_honoured"]:
        assert rb["inside_nonzero_bytes"] == 0                  # deallocated: zeroes
        assert rb["inside_sentinel_bytes"] == 0


def test_negative_control_is_caught(out):
    ct, st = out["control"], out["stock"]
    print(f"PHX-INFO flex: control corrupted {ct['corrupted']}; ids {ct['ids']} "
          f"(stock {st['ids']}); digest changed: {ct['kv_digest'] != st['kv_digest']}")
    assert ct["corrupted"] and {c["layer"] for c in ct["corrupted"]} == {6}
    assert ct["kv_digest"] != st["kv_digest"]


def test_all_checks(out):
    """cpu_check.check() (what its command line exits on) agrees."""
    assert out["failures"] == []
