"""``phx bench io`` end to end on a tiny workload: table, JSON fields, plot."""
from __future__ import annotations

import json
import os
import shutil

import pytest

from phx.bench import _fio
from phx.bench._common import fmt_size, parse_size
from phx.cli import main

ROW_FIELDS = {"op", "bs", "qd", "engine", "gbps", "iops", "ratio_vs_fio", "repeats", "spread"}


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


@pytest.mark.skipif(shutil.which("fio") is None, reason="fio not installed (apt-get install fio)")
def test_bench_io_smoke(data_dir, tmp_path, capsys):
    out_json = tmp_path / "r" / "bench-io.json"
    out_png = tmp_path / "r" / "bench-io.png"
    rc = main(["bench", "io", "--path", data_dir, "--size", "8m", "--bs", "4k,128k",
               "--qd", "32", "--ops", "read,randread,randwrite", "--runtime", "0.05",
               "--repeats", "2", "--json", str(out_json), "--plot", str(out_png),
               "--no-progress"])
    printed = capsys.readouterr().out
    assert rc == 0, printed
    doc = json.loads(out_json.read_text())
    assert doc["benchmark"] == "io"
    assert {"host", "kernel", "cpus"} <= set(doc["machine"])
    assert doc["config"]["storage"]["fstype"]
    rows = doc["rows"]
    assert len(rows) == 3 * 2 * 1 * 3  # ops x bs x qd x engines
    for r in rows:
        assert ROW_FIELDS <= set(r), r
        assert "error" not in r, r
        assert r["repeats"] == 2 and r["gbps"] > 0 and r["iops"] > 0
        assert r["gbps"] == pytest.approx(r["iops"] * r["bs"] / 1e9, rel=0.05)
        if r["engine"] == "fio":
            assert r["ratio_vs_fio"] == pytest.approx(1.0)
        else:
            assert r["ratio_vs_fio"] > 0
    checks = {c["check"].split(":")[0]: c for c in doc["checks"]}
    assert len(checks) == 2
    for c in checks.values():
        assert c["status"] in ("PASS", "FAIL")
        assert c["status"] in printed and f"{c['ratio']:.3f}" in printed
    assert "ratio_vs_fio" in printed
    assert out_png.stat().st_size > 10_000
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert os.listdir(data_dir) == []  # the test file was removed


def test_bench_io_refuses_existing_file(data_dir):
    path = os.path.join(data_dir, "precious")
    with open(path, "wb") as f:
        f.write(os.urandom(4096))
    with pytest.raises(SystemExit, match="existing file"):
        main(["bench", "io", "--path", path, "--engines", "preadv", "--no-progress"])
    assert os.path.getsize(path) == 4096
