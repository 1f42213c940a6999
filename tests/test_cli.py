"""The command line: ``python -m phx`` and the ``phx`` console script."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

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


def test_stats_json(phx_cmd, tmp_path):
    """`phx stats` shows other processes' counters (tests/test_livestats.py):
    here none publish in an empty folder."""
    env = dict(os.environ, PHX_STATS_DIR=str(tmp_path))
    r = subprocess.run(phx_cmd + ["stats", "--json"], capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert d["processes"] == [] and d["dir"] == str(tmp_path)
    r = subprocess.run(phx_cmd + ["stats"], capture_output=True, text=True, env=env)
    assert r.returncode == 0 and "no phx counters published" in r.stdout


def test_help_and_usage_errors(phx_cmd):
    r = run(phx_cmd + ["--help"])
    assert r.returncode == 0 and "info" in r.stdout
    r = run(phx_cmd + ["info", "--help"])
    assert r.returncode == 0 and "--json" in r.stdout
    r = run(phx_cmd)  # no sub-command: usage error, not a traceback
    assert r.returncode == 2 and "Traceback" not in r.stderr
    r = run(phx_cmd + ["no-such-command"])
    assert r.returncode == 2 and "Traceback" not in r.stderr


# ---------------------------------------------------------------------------
# A command line that behaves (issue 27, part 4): bad values, exit status,
# PHX_* settings, the JSON envelope, cleanup, optional dependencies
# ---------------------------------------------------------------------------

import re  # noqa: E402

from phx.bench import _common  # noqa: E402
from phx.cli import BENCHMARKS, main  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

#: (argv, what the one line must name): every bench and subcommand fed bad
#: values; refused while parsing unless marked (run time, still before work)
BAD = [
    # phx bench io
    (["bench", "io", "--size", "12q"], "--size"),
    (["bench", "io", "--size", "0"], "--size"),
    (["bench", "io", "--bs", "3x"], "--bs"),
    (["bench", "io", "--bs", "3k"], "--bs"),                  # run time: not 4 KiB-aligned
    (["bench", "io", "--qd", "0"], "--qd"),
    (["bench", "io", "--ops", "erase"], "--ops"),
    (["bench", "io", "--runtime", "0"], "--runtime"),
    (["bench", "io", "--runtime", "nan"], "--runtime"),
    (["bench", "io", "--repeat", "0"], "--repeat"),
    (["bench", "io", "--repeats", "x"], "--repeats"),
    (["bench", "io", "--methods", "dd"], "--methods"),
    (["bench", "io", "--engines", "dd"], "--engines"),
    (["bench", "io", "--zram", "2q"], "--zram"),
    (["bench", "io", "--seed", "x"], "--seed"),
    (["bench", "io", "--dir", "/dev/null"], "--dir"),
    (["bench", "io", "--path", "/dev/null"], "--path"),
    (["bench", "io", "--plot", "/"], "--plot"),
    (["bench", "io", "--json", "/"], "--json"),
    (["bench", "io", "--bogus"], "--bogus"),
    # phx bench kv
    (["bench", "kv", "--caps", "x"], "--caps"),
    (["bench", "kv", "--caps", "0.2,0"], "--caps"),
    (["bench", "kv", "--methods", "dd"], "--methods"),
    (["bench", "kv", "--configs", "dd"], "--configs"),
    (["bench", "kv", "--model", "gpt-9"], "--model"),
    (["bench", "kv", "--layers", "0"], "--layers"),
    (["bench", "kv", "--heads", "x"], "--heads"),
    (["bench", "kv", "--batch", "-1"], "--batch"),
    (["bench", "kv", "--gen", "1"], "--gen"),
    (["bench", "kv", "--dtype", "int8"], "--dtype"),
    (["bench", "kv", "--threads", "0"], "--threads"),
    (["bench", "kv", "--reserve", "-1"], "--reserve"),
    (["bench", "kv", "--timeout", "0"], "--timeout"),
    (["bench", "kv", "--repeat", "x"], "--repeat"),
    (["bench", "kv", "--dir", "/dev/null"], "--dir"),
    # phx bench gpu (refused before it looks for a GPU)
    (["bench", "gpu", "--pattern", "zigzag"], "--pattern"),
    (["bench", "gpu", "--size", "12q"], "--size"),
    (["bench", "gpu", "--chunk-sizes", "64k,x"], "--chunk-sizes"),
    (["bench", "gpu", "--chunk-bytes", "0"], "--chunk-bytes"),
    (["bench", "gpu", "--methods", "dd"], "--methods"),
    (["bench", "gpu", "--ops", "erase"], "--ops"),
    (["bench", "gpu", "--raw-threads", "0"], "--raw-threads"),
    (["bench", "gpu", "--kvikio-threads", "x"], "--kvikio-threads"),
    (["bench", "gpu", "--lanes", "0"], "--lanes"),
    (["bench", "gpu", "--buf-size", "1q"], "--buf-size"),
    (["bench", "gpu", "--devices", "0,x"], "--devices"),
    (["bench", "gpu", "--zram", "x"], "--zram"),
    (["bench", "gpu", "--repeat", "0"], "--repeat"),
    (["bench", "gpu", "--stream-chunks", "x"], "--stream-chunks"),
    (["bench", "gpu", "--stream-threads", "0"], "--stream-threads"),
    (["bench", "gpu", "--stream-methods", "dd"], "--stream-methods"),
    (["bench", "gpu", "--dir", "/dev/null"], "--dir"),
    # phx bench nvme
    (["bench", "nvme", "--device", "/dev/null"], "--device"),  # run time: not a namespace
    (["bench", "nvme", "--device", "/nonexistent/ng0n1"], "--device"),
    (["bench", "nvme", "--device", "/"], "--device"),
    (["bench", "nvme", "--size", "0"], "--size"),
    (["bench", "nvme", "--seconds", "x"], "--seconds"),
    (["bench", "nvme", "--first-lba", "-1"], "--first-lba"),
    (["bench", "nvme", "--repeat", "0"], "--repeat"),
    (["bench", "nvme", "--seed", "x"], "--seed"),
    # phx bench lmcache
    (["bench", "lmcache", "--mode", "x"], "--mode"),
    (["bench", "lmcache", "--methods", "dd"], "--methods"),
    (["bench", "lmcache", "--chunks", "0"], "--chunks"),
    (["bench", "lmcache", "--latency-chunks", "x"], "--latency-chunks"),
    (["bench", "lmcache", "--tokens", "0"], "--tokens"),
    (["bench", "lmcache", "--zram", "x"], "--zram"),
    (["bench", "lmcache", "--repeat", "0"], "--repeat"),
    (["bench", "lmcache", "--sessions", "0"], "--sessions"),
    (["bench", "lmcache", "--rounds", "x"], "--rounds"),
    (["bench", "lmcache", "--token-scale", "0"], "--token-scale"),
    (["bench", "lmcache", "--concurrency", "1,x"], "--concurrency"),
    (["bench", "lmcache", "--ttft-limit", "-1"], "--ttft-limit"),
    (["bench", "lmcache", "--replay-methods", "dd"], "--replay-methods"),
    (["bench", "lmcache", "--seed", "x"], "--seed"),
    (["bench", "lmcache", "--dir", "/dev/null"], "--dir"),
    # phx bench load
    (["bench", "load", "--size", "12q"], "--size"),
    (["bench", "load", "--shards", "0"], "--shards"),
    (["bench", "load", "--device", "gpu"], "--device"),
    (["bench", "load", "--methods", "phx,dd"], "--methods"),
    (["bench", "load", "--warm", "raw"], "--warm"),
    (["bench", "load", "--raw-threads", "x"], "--raw-threads"),
    (["bench", "load", "--tp", "0"], "--tp"),
    (["bench", "load", "--timeout", "x"], "--timeout"),
    (["bench", "load", "--zram", "x"], "--zram"),
    (["bench", "load", "--repeat", "0"], "--repeat"),
    (["bench", "load", "--dir", "/dev/null"], "--dir"),
    (["bench", "load", "--plot", "/"], "--plot"),
    # the other commands
    (["bench", "nope"], "nope"),
    (["tune", "--size", "12q"], "--size"),
    (["tune", "/dev/null"], "path"),
    (["info", "--bogus"], "--bogus"),
    (["stats", "--bogus"], "--bogus"),
]


def _one_line(err: str) -> str:
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1, f"want one line on stderr, got:\n{err}"
    assert "Traceback" not in err
    return lines[0]


def _main(argv, capsys) -> tuple[int, str, str]:
    """``phx ARGV`` in this process: (status, stdout, stderr); a traceback
    here is an exception that fails the test."""
    try:
        rc = main(list(argv))
    except SystemExit as e:
        rc = e.code if isinstance(e.code, int) else 1
    out = capsys.readouterr()
    return rc, out.out, out.err


@pytest.mark.parametrize("argv,flag", BAD, ids=[" ".join(a) for a, _ in BAD])
def test_bad_value_is_one_line_and_exit_2(argv, flag, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)                      # nothing may be left behind
    rc, _, err = _main(argv, capsys)
    line = _one_line(err)
    assert rc == 2, err
    assert flag in line, line
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("argv", [["bench", "load", "--size", "12q"],
                                  ["bench", "kv", "--caps", "x"],
                                  ["bench", "nvme", "--device", "/dev/null"]])
def test_issue_examples_through_the_console_script(argv):
    """The three tracebacks of issue 27, through the real `phx` command."""
    r = run([console_script(), *argv])
    assert r.returncode == 2
    line = _one_line(r.stderr)
    assert line.startswith(f"phx bench {argv[1]}: ") and argv[2] in line


def test_every_bench_has_the_common_options():
    from phx.cli import _build_parser
    sub = _build_parser()._subparsers._group_actions[0].choices["bench"]
    benches = sub._subparsers._group_actions[0].choices
    assert set(benches) == set(BENCHMARKS)
    for name, p in benches.items():
        opts = {o for a in p._actions for o in a.option_strings if a.help != "==SUPPRESS=="}
        want = {"--repeat", "--json", "--plot", "--quiet"} | ({"--dir"} if name != "nvme" else set())
        assert want <= opts, (name, sorted(want - opts))
        assert not opts & {"--path", "--repeats", "--no-progress", "--engines", "--configs"}, name
        h = p.format_help()
        for old in ("--path", "--repeats", "--no-progress", "--engines", "--configs"):
            assert old not in h, (name, old)          # hidden deprecated aliases
    keeps = {n for n, p in benches.items() if any("--keep" in a.option_strings for a in p._actions)}
    assert {"io", "kv", "gpu", "load"} <= keeps


@pytest.mark.parametrize("bench,old,new,dest,value", [
    ("io", ["--path", "DIR"], "--dir", "dir", "DIR"),
    ("io", ["--repeats", "4"], "--repeat", "repeat", 4),
    ("io", ["--no-progress"], "--quiet", "quiet", True),
    ("io", ["--engines", "preadv"], "--methods", "engines", ["preadv"]),
    ("kv", ["--no-progress"], "--quiet", "quiet", True),
    ("kv", ["--configs", "dual"], "--methods", "configs", ["dual"]),
])
def test_old_spellings_still_work_with_a_note(bench, old, new, dest, value, capsys, tmp_path):
    from phx.cli import _build_parser
    old = [str(tmp_path) if x == "DIR" else x for x in old]
    args = _build_parser().parse_args(["bench", bench, *old])
    assert getattr(args, dest) == (str(tmp_path) if value == "DIR" else value)
    line = _one_line(capsys.readouterr().err)
    assert f"{old[0]} is deprecated, use {new}" in line


def test_plot_without_matplotlib_names_the_extra(capsys, monkeypatch, tmp_path):
    real = _common.importlib.util.find_spec
    monkeypatch.setattr(_common.importlib.util, "find_spec",
                        lambda name, *a: None if name == "matplotlib" else real(name, *a))
    for bench in BENCHMARKS:
        # the bad --repeat after it ends the run at once should --plot pass
        rc, _, err = _main(["bench", bench, "--plot", str(tmp_path / "p.png"), "--repeat", "0"],
                           capsys)
        line = _one_line(err)
        assert rc == 2 and "--plot" in line and "pip install 'phx[bench]'" in line, line


def test_progress_without_tqdm_is_plain_lines(capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "tqdm", None)          # import tqdm -> ImportError
    bar = _common.progress(3, "demo", unit="run")
    bar.set_postfix_str("x")
    for _ in range(3):
        bar.update(1)
    bar.write("row line")
    bar.close()
    out = capsys.readouterr()
    assert "demo: 3/3 run (x)" in out.err and "row line" in out.out
    quiet = _common.progress(3, "demo", enabled=False)
    quiet.update(3)
    assert capsys.readouterr().err == ""


def _io_args(d, *extra):
    return ["bench", "io", "--dir", str(d), "--size", "1m", "--bs", "4k", "--qd", "1",
            "--ops", "read", "--methods", "preadv", "--runtime", "0.02", "--repeat", "1",
            "--quiet", *extra]


def test_json_envelope(capsys, tmp_path):
    out = tmp_path / "r.json"
    argv = _io_args(tmp_path / "d", "--json", str(out))
    rc, _, err = _main(argv, capsys)
    assert rc == 0, err
    doc = json.loads(out.read_text())
    assert list(doc)[:2] == ["schema_version", "phx_version"]
    assert doc["schema_version"] == _common.SCHEMA_VERSION
    import phx
    assert doc["phx_version"] == phx.__version__
    assert doc["command"] == ["phx", *argv]
    if os.path.isdir(os.path.join(ROOT, ".git")):
        assert re.fullmatch(r"[0-9a-f]{40}", doc["commit"]) and isinstance(doc["commit_dirty"], bool)
    m = doc["machine"]
    assert {"host", "kernel", "cpu_model", "cpus", "mem_bytes", "gpus"} <= set(m)
    assert isinstance(m["gpus"], list) and m["cpus"] >= 1
    assert doc["benchmark"] == "io" and doc["rows"]


def test_io_removes_its_files_unless_keep(capsys, tmp_path):
    d = tmp_path / "made" / "here"
    rc, _, err = _main(_io_args(d), capsys)
    assert rc == 0, err
    assert not (tmp_path / "made").exists()            # the file and the folders made for it
    rc, _, err = _main(_io_args(d, "--keep"), capsys)
    assert rc == 0, err
    (kept,) = os.listdir(d)
    assert os.path.getsize(d / kept) == 1 << 20 and "kept the test file" in err


def test_nothing_measured_exits_nonzero(capsys, tmp_path, monkeypatch):
    from phx.bench import io as bio

    def fail(self, *a):
        raise OSError(5, "every run fails")
    monkeypatch.setattr(bio.PreadvEngine, "run", fail)
    rc, _, err = _main(_io_args(tmp_path / "d"), capsys)
    assert rc == 1 and "nothing was measured" in err


def _load_args(d, *extra):
    return ["bench", "load", "--dir", str(d), "--size", "1m", "--shards", "1",
            "--device", "cpu", "--methods", "raw", "--warm", "", "--repeat", "1", "--quiet",
            *extra]


def test_load_removes_its_checkpoint_unless_keep(capsys, tmp_path):
    pytest.importorskip("torch")
    pytest.importorskip("safetensors")
    ckpt = tmp_path / "phx-bench-load"
    rc, out, err = _main(_load_args(tmp_path), capsys)
    assert rc == 0, out + err
    assert not ckpt.exists()
    rc, out, err = _main(_load_args(tmp_path, "--keep"), capsys)
    assert rc == 0, out + err
    assert (ckpt / "digests.json").exists() and "kept the checkpoint" in err
    mtime = (ckpt / "digests.json").stat().st_mtime_ns
    rc, out, err = _main(_load_args(tmp_path, "--keep"), capsys)   # reused, not rewritten
    assert rc == 0 and (ckpt / "digests.json").stat().st_mtime_ns == mtime
    rc, out, err = _main(_load_args(tmp_path), capsys)             # rewritten, then removed
    assert rc == 0 and not ckpt.exists()


def test_load_failed_rows_exit_1_and_still_clean_up(capsys, tmp_path, monkeypatch):
    pytest.importorskip("torch")
    pytest.importorskip("safetensors")
    from phx.bench import load as bload
    monkeypatch.setattr(bload, "_spawn", lambda *a, **k: {"error": "exit 1: boom"})
    rc, out, err = _main(_load_args(tmp_path), capsys)
    assert rc == 1 and "boom" in err
    assert not (tmp_path / "phx-bench-load").exists()


def test_phx_bench_dir_that_is_not_a_directory(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("PHX_BENCH_DIR", "/dev/null")
    rc, _, err = _main(["bench", "load", "--size", "1m", "--device", "cpu"], capsys)
    line = _one_line(err)
    assert rc == 2 and "PHX_BENCH_DIR" in line


def test_nvme_median_and_plot(tmp_path):
    pytest.importorskip("matplotlib")
    from phx.bench import nvme
    runs = [{**{k: float(i) for k, _, _ in nvme.METRICS}, "write_256k_samples": 20,
             "cold_cache": i != 2} for i in (3, 1, 2)]
    m = nvme._median_run(runs)
    assert m["seqread_1m"] == 2.0 and m["write_256k_samples"] == 60 and m["cold_cache"] is False
    nvme.plot({k: m for k in nvme.PATHS}, str(tmp_path / "n.png"), "fake")
    assert (tmp_path / "n.png").stat().st_size > 10_000


# ---- PHX_* settings: an unreadable value is an error naming the variable ----

def _libphx_settings() -> list[str]:
    """Every PHX_* name libphx reads through env.c (phx_env_u32 / phx_env_choice)."""
    names = set()
    src = os.path.join(ROOT, "libphx", "src")
    for f in os.listdir(src):
        if f.endswith(".c"):
            with open(os.path.join(src, f)) as fh:
                names |= set(re.findall(r'phx_env_(?:u32|choice)\(\s*"(PHX_[A-Z0-9_]+)"',
                                        fh.read()))
    return sorted(names)


GARBAGE_CHILD = r"""
import errno, os, sys
import phx
bad = []
for name in sys.argv[1:]:
    for value in ("abc", "-1", "12q", "99999999999"):
        os.environ[name] = value
        try:
            phx.Engine().close()
            bad.append(f"{name}={value}: engine made")
        except (OSError, ValueError) as e:   # the binding: ValueError for EINVAL
            if getattr(e, "errno", errno.EINVAL) != errno.EINVAL or name not in str(e):
                bad.append(f"{name}={value}: {e!r}")
    del os.environ[name]
phx.Engine().close()
print("\n".join(bad) or "ok")
"""


def test_every_libphx_setting_refuses_garbage():
    """libphx (C): engine create fails with EINVAL naming the variable, for
    every setting any file of libphx/src reads (a new one missing from
    env.c's table fails here)."""
    names = _libphx_settings()
    assert {"PHX_QUEUE_DEPTH", "PHX_SUBMIT_BATCH", "PHX_CUDA_LANES"} <= set(names), names
    env = {k: v for k, v in os.environ.items() if not k.startswith("PHX_") or k == "PHX_TEST_DIR"}
    r = subprocess.run([sys.executable, "-c", GARBAGE_CHILD, *names], capture_output=True,
                       text=True, timeout=120, env=env)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "ok", r.stdout


@pytest.mark.parametrize("argv", [["info"], ["stats"], ["bench", "io", "--size", "1m"],
                                  ["bench", "kv"], ["tune"]])
def test_cli_refuses_garbage_settings(argv, phx_cmd):
    """The CLI (Python): one line naming the variable, exit 2, nothing run."""
    r = subprocess.run(phx_cmd + argv, capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PHX_QUEUE_DEPTH": "64x"})
    line = _one_line(r.stderr)
    assert r.returncode == 2 and "PHX_QUEUE_DEPTH" in line and "64x" in line, line


@pytest.mark.parametrize("spec", ["/dev/null,first_lba=x", "/dev/null,queue_depth=4k",
                                  "/dev/null,bogus=1"])
def test_phx_kv_nvme_garbage_names_the_variable(spec, monkeypatch):
    """The one PHX_* value the Python side parses itself (phx.kv's NVMe backend)."""
    from phx.kv.nvme_backend import from_env
    monkeypatch.setenv("PHX_KV_NVME", spec)
    with pytest.raises(ValueError, match="PHX_KV_NVME"):
        from_env()
