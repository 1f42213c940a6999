"""`phx bench lmcache --mode l2` runs end to end on a small workload (real
LMCache 0.5.6, the phx plugin with and without verification, with its crc thread, and LMCache's
LocalDiskBackend on a scratch directory; rust_raw_block where its extension is
installed, else a note): every row byte-exact, the JSON has the summary and the
recovery row.  ~15-25 s on the dev box (importing lmcache)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "adapters", "lmcache", "tests"))
import support  # noqa: E402

SITE = support.lmcache_site()


@pytest.mark.skipif(SITE is None, reason="lmcache not installed: " + support.INSTALL_HINT)
def test_bench_l2_small(tmp_path) -> None:
    out = tmp_path / "l2.json"
    cmd = [sys.executable, "-m", "phx", "bench", "lmcache", "--mode", "l2", "--dir",
           str(tmp_path / "d"), "--repeat", "1", "--l2-chunk-mib", "1", "--l2-bytes", "8m",
           "--l2-latency", "2", "--l2-recovery", "300",
           "--l2-methods", "phx,phx-crcthread,phx-1writer,phx-wholewrites,phx-noverify,localdisk-odirect,rawblock-uring",
           "--json", str(out)]
    r = subprocess.run(cmd, env=support.child_env(SITE or ""), capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    d = json.loads(out.read_text())["l2"]
    methods = {s["method"] for s in d["summary"]}
    assert {"phx", "phx-crcthread", "phx-1writer", "phx-wholewrites", "phx-noverify",
            "localdisk-odirect"} <= methods
    assert all(s["byte_exact"] for s in d["summary"])
    phx = [s for s in d["summary"] if s["method"] == "phx"][0]
    assert phx["recovered"] == phx["chunks"] == 8 and phx["put_gbs"] > 0 and phx["get_gbs"] > 0
    # the crc-thread row (phx_l2.crc_thread: true) ran beside the others, every chunk back
    crct = [s for s in d["summary"] if s["method"] == "phx-crcthread"][0]
    assert "verify_cost" in crct and crct["recovered"] == 8
    assert [s["recovered"] for s in d["summary"] if s["method"].startswith("localdisk")] == [0]
    rec = d["recovery"]["disk"]
    assert rec["recovered"] == rec["slots"] == 300
    assert "phx/best put/get" in r.stdout


def test_every_repeat_rotates_the_method_order() -> None:
    """No method always runs first (a fresh zram device) or after the same
    neighbour: repeat r starts at method r, every method runs once per repeat,
    and over as many repeats as methods each method holds every position."""
    from phx.bench._lmcache_l2 import run_order
    ms = ["phx", "localdisk-odirect", "rawblock-uring"]
    orders = [run_order(ms, r) for r in range(4)]
    assert orders[0] == ms
    assert [o[0] for o in orders] == ["phx", "localdisk-odirect", "rawblock-uring", "phx"]
    assert all(sorted(o) == sorted(ms) for o in orders)
    assert all({o[i] for o in orders[:3]} == set(ms) for i in range(3))
    assert run_order([], 3) == []
