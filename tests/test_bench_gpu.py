"""``phx bench gpu``'s parts that need no GPU: which devices ``--devices``
names, and the fan-out that runs a row on every device at once (its time is
from the common start to the last one done; each device gets its own
arguments and its own binding; errors come out).  The rows themselves run on
a GPU box only (tools/gpu_run.sh)."""
from __future__ import annotations

import threading
import time

import pytest

from phx.bench import gpu as bench


def test_parse_devices():
    assert bench.parse_devices("0", 1) == [0]
    assert bench.parse_devices("all", 4) == [0, 1, 2, 3]
    assert bench.parse_devices("2,0", 3) == [2, 0]
    for bad, count in (("3", 2), ("0,0", 2), ("x", 2), ("", 2), ("-1", 2), ("all", 0)):
        with pytest.raises(ValueError):
            bench.parse_devices(bad, count)


def test_fan_out_runs_every_item_at_once_and_times_the_slowest():
    seen: dict[int, tuple] = {}
    bound: dict[int, int] = {}
    inside = []
    lock = threading.Lock()
    most = [0]

    def fn(path, pat, gpu):
        with lock:
            inside.append(1)
            most[0] = max(most[0], len(inside))
        time.sleep(0.05 * (gpu + 1))
        with lock:
            inside.pop()
            seen[gpu] = (path, pat, threading.get_ident())

    def bind(i):
        bound[threading.get_ident()] = i

    args = [(f"f{i}", "pat", i) for i in range(4)]
    dt = bench.fan_out(fn, args, bind)
    assert sorted(seen) == [0, 1, 2, 3]
    assert all(seen[i][0] == f"f{i}" for i in range(4))
    # each item ran on a thread bound to its own index
    assert all(bound[seen[i][2]] == i for i in range(4))
    assert most[0] == 4, "the items did not run at once"
    assert 0.2 <= dt < 0.6, dt          # the slowest (0.2 s), not the sum (0.5 s)


def test_fan_out_single_item_runs_here_and_errors_come_out():
    here = threading.get_ident()
    got = []
    dt = bench.fan_out(lambda a: got.append((a, threading.get_ident())), [("x",)])
    assert got == [("x", here)] and dt >= 0

    done = []

    def fn(i):
        if i == 1:
            raise OSError(5, "boom")
        time.sleep(0.05)
        done.append(i)

    with pytest.raises(OSError, match="boom"):
        bench.fan_out(fn, [(0,), (1,), (2,)])
    assert sorted(done) == [0, 2], "the other items were not waited for"

    with pytest.raises(RuntimeError, match="no such device"):
        bench.fan_out(lambda i: done.append(i), [(7,), (8,)],
                      bind=lambda i: (_ for _ in ()).throw(RuntimeError("no such device")))
    assert 7 not in done and 8 not in done, "items ran after their binding failed"


def test_small_chunk_goals_and_phase_shares():
    """Issue 29: pieces of 64 KiB and less are judged against the host row and
    KvikIO; larger chunks keep issue 10's goals; phase shares sum to 1."""
    row = {"pattern": "chunks 16K", "chunk": 16 << 10, "device": "zram", "op": "read"}
    assert bench._goals_for(row) == [("host", 0.8), ("kvikio", 3.0)]
    assert bench._goals_for(dict(row, device="disk")) == [("host", 0.9), ("kvikio", 1.5)]
    assert bench._goals_for(dict(row, op="write")) == [("host", 0.8)]
    assert bench._goals_for(dict(row, chunk=256 << 10)) == bench.GOALS[("chunks", "zram")]
    sh = bench.phase_shares({"call": 1, "pack": 1, "submit": 2, "io": 4, "copy": 0})
    assert sh == {"call": 0.125, "pack": 0.125, "submit": 0.25, "io": 0.5, "copy": 0.0,
                  "done": 0.0}
    assert bench._phase_text({"phase_shares": sh}).startswith("io ")
    assert bench.phase_shares({}) == {k: 0.0 for k in bench.PHASES}


def test_rows_for_batch_and_variants():
    """--methods batch adds phx's per-piece API as a row of its own, and each
    --phx-variant a phx row on a staging context with those switches; both
    count as phx rows (checked byte for byte, phase counters kept)."""
    import argparse
    p = argparse.ArgumentParser()
    bench.add_arguments(p)
    args = p.parse_args(["--methods", "phx,batch", "--phx-variant", "batch_copy=0",
                         "--phx-variant", "batch_copy=1,fixed_bufs=0"])
    rows = bench._methods(args, False, "read", "chunks")
    names = [r[0] for r in rows]
    assert names == ["phx", "batch", "phx[batch_copy=0]", "phx[batch_copy=1,fixed_bufs=0]"]
    assert rows[2][1]["batch_copy"] is False and rows[3][1]["fixed_bufs"] is False
    assert rows[1][1]["api"] == "pread_batch"
    assert [r[0] for r in bench._methods(args, False, "write", "seq")][:1] == ["phx"]
    assert all(bench._is_phx_row(n) for n in names) and not bench._is_phx_row("host")
    for bad in ("scatter=0", "batch_copy=2", "batch_copy", "lanes=4"):
        with pytest.raises(SystemExit):
            p.parse_args(["--phx-variant", bad])
