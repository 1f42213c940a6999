"""The command line: ``python -m phx`` and the ``phx`` console script."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

STATS_KEYS = {"reads", "writes", "bytes_read", "bytes_written", "direct_bytes", "bounce_bytes",
              "buffered_bytes", "bounce_ios", "rmw_ios", "short_ios", "fixed_buf_ios", "sqes",
              "submits", "errors"}


def run(args, timeout=120):
    return subprocess.run(args, capture_output=True, text=True, timeout=timeout)


def console_script():
    exe = shutil.which("phx", path=os.path.dirname(sys.executable)) or shutil.which("phx")
    if exe is None:
        pytest.skip("the phx console script is not installed next to this python "
                    "(pip install -e . creates it)")
    return exe


@pytest.fixture(params=["python -m phx", "phx"])
def phx_cmd(request):
    if request.param == "phx":
        return [console_script()]
    return [sys.executable, "-m", "phx"]


def check_info_json(d):
    for key in ("io_uring", "o_direct", "cuda", "kernel_module"):
        assert key in d, f"{key} missing from phx info --json: {sorted(d)}"
        e = d[key]
        flag = e.get("available", e.get("loaded"))
        assert isinstance(flag, bool), e
        assert isinstance(e.get("reason"), str) and e["reason"].strip(), e


def test_info_text(phx_cmd, data_dir):
    r = run(phx_cmd + ["info", data_dir])
    assert r.returncode == 0, r.stderr
    out = r.stdout.lower()
    for word in ("io_uring", "cuda", "module", "align"):
        assert word in out, f"{word!r} missing from `phx info`:\n{r.stdout}"


def test_info_json(phx_cmd, data_dir):
    r = run(phx_cmd + ["info", "--json", data_dir])
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    check_info_json(d)
    assert d["o_direct"]["available"] is True
    for k in ("mem_align", "offset_align"):
        a = d["o_direct"][k]
        assert isinstance(a, int) and a >= 1 and a & (a - 1) == 0


def test_info_json_default_path(phx_cmd):
    r = run(phx_cmd + ["info", "--json"])
    assert r.returncode == 0, r.stderr
    check_info_json(json.loads(r.stdout))


def test_info_json_missing_path(phx_cmd, data_dir):
    missing = os.path.join(data_dir, "missing", "x")
    r = run(phx_cmd + ["info", "--json", missing])
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert d["o_direct"]["available"] is False
    assert d["o_direct"]["reason"].strip()


def test_info_json_matches_python_api(data_dir):
    import phx
    r = run([sys.executable, "-m", "phx", "info", "--json", data_dir])
    assert r.returncode == 0, r.stderr
    cli = json.loads(r.stdout)
    api = phx.info(data_dir)
    for key in ("io_uring", "cuda", "kernel_module"):
        assert cli[key].get("available", cli[key].get("loaded")) == \
            api[key].get("available", api[key].get("loaded")), key
    assert cli["o_direct"]["offset_align"] == api["o_direct"]["offset_align"]


def test_stats_json(phx_cmd):
    r = run(phx_cmd + ["stats"])
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert STATS_KEYS <= set(d), sorted(STATS_KEYS - set(d))


def test_help_and_usage_errors(phx_cmd):
    r = run(phx_cmd + ["--help"])
    assert r.returncode == 0 and "info" in r.stdout
    r = run(phx_cmd + ["info", "--help"])
    assert r.returncode == 0 and "--json" in r.stdout
    r = run(phx_cmd)  # no sub-command: usage error, not a traceback
    assert r.returncode == 2 and "Traceback" not in r.stderr
    r = run(phx_cmd + ["no-such-command"])
    assert r.returncode == 2 and "Traceback" not in r.stderr
