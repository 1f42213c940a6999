"""Live counters across processes (issue 27): what ``phx stats`` and ``phx top`` read.

Every check runs a second, real process that uses phx and is watched from
this one through the files libphx publishes (``PHX_STATS_DIR``, a folder of
the test's own so that other processes on the box do not interfere).
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from phx import livestats

pytest.importorskip("phx._lib.engine")

# A child that reads a file of random bytes through its own engine, then, at
# each line on stdin: "io" reads again, "pub" publishes and prints its own
# phx.stats() as JSON, "exit" leaves.
CHILD = textwrap.dedent(r"""
    import json, os, sys
    import phx
    from phx._lib import engine as _e
    path = sys.argv[1]
    eng = phx.Engine()
    f = phx.open(path, "r", engine=eng)
    buf = phx.empty_aligned(1 << 20)
    def io():
        for i in range(8):
            f.pread(buf, i << 20)
        f.pread(memoryview(buf)[:5000], 4097)      # unaligned: a bounce
    io()
    print("ready", os.getpid(), _e.stats_path(), flush=True)
    for line in sys.stdin:
        cmd = line.strip()
        if cmd == "io":
            io()
            print("ok", flush=True)
        elif cmd == "pub":
            _e.stats_publish()
            print(json.dumps(eng.stats()), flush=True)
        elif cmd == "loop":
            import time
            t = time.time()
            while time.time() - t < float(sys.argv[2]):
                io()
            print("ok", flush=True)
        elif cmd == "exit":
            break
    f.close()
""")


@pytest.fixture
def data(tmp_path):
    p = tmp_path / "data.bin"
    p.write_bytes(os.urandom(8 << 20))
    return str(p)


@pytest.fixture
def sdir(tmp_path, monkeypatch):
    d = tmp_path / "stats"
    d.mkdir()
    monkeypatch.setenv("PHX_STATS_DIR", str(d))
    return str(d)


class Child:
    def __init__(self, data: str, *args: str, env: dict | None = None, code: str = CHILD):
        self.p = subprocess.Popen([sys.executable, "-c", code, data, *args],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                  env=env or dict(os.environ))
        ready = self.p.stdout.readline().split()
        assert ready and ready[0] == "ready", ready
        self.pid, self.path = int(ready[1]), ready[2]

    def cmd(self, c: str) -> str:
        self.p.stdin.write(c + "\n")
        self.p.stdin.flush()
        return self.p.stdout.readline().strip()

    def close(self) -> None:
        if self.p.poll() is None:
            self.p.stdin.write("exit\n")
            self.p.stdin.flush()
            self.p.wait(timeout=30)


def test_a_running_process_is_seen_and_matches_its_own_stats(data, sdir):
    c = Child(data)
    try:
        assert os.path.dirname(c.path) == sdir
        own = json.loads(c.cmd("pub"))
        procs = livestats.scan(pid=c.pid)
        assert [p.pid for p in procs] == [c.pid]
        p = procs[0]
        assert p.comm.startswith("python") and "python" in p.cmdline and "\n" not in p.cmdline
        engines = [s for s in p.sources if s.kind == "engine"]
        assert len(engines) == 1, p.sources
        pub = engines[0].counters
        assert own["bytes_read"] == 8 * (1 << 20) + 5000
        for k, v in own.items():
            if k in pub:
                assert pub[k] == v, (k, pub[k], v)
        assert own["bounce_bytes"] > 0 and pub["bounce_ios"] == own["bounce_ios"] >= 1
        # the thread keeps it fresh without being asked
        c.cmd("io")
        time.sleep(0.6)
        again = livestats.scan(pid=c.pid)[0]
        assert again.sources[0].counters["bytes_read"] == 2 * own["bytes_read"]
    finally:
        c.close()
    # gone at exit: the file removed, nothing listed
    assert not os.path.exists(c.path)
    assert livestats.scan(pid=c.pid) == []


def test_a_killed_process_is_not_listed_and_its_file_is_removed(data, sdir):
    c = Child(data)
    c.cmd("pub")
    assert livestats.scan(pid=c.pid)
    c.p.send_signal(signal.SIGKILL)
    c.p.wait(timeout=30)
    assert os.path.exists(c.path), "a killed process cannot remove its file"
    assert livestats.scan(pid=c.pid) == []
    assert not os.path.exists(c.path), "scan removes the file of a process that is gone"


def test_a_file_of_a_reused_pid_is_not_taken_for_the_process(sdir, tmp_path):
    """The file names a live pid (this one) but another start time: stale."""
    c = Child.__new__(Child)
    code = textwrap.dedent("""
        import phx, sys
        from phx._lib import engine as _e
        e = phx.Engine(); _e.stats_publish(); print(_e.stats_path(), flush=True)
        sys.stdin.readline()
    """)
    p = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True)
    path = p.stdout.readline().strip()
    fake = os.path.join(sdir, f"phx-stats.{os.getpid()}.0")
    with open(path, "rb") as f:
        raw = bytearray(f.read())
    raw[48:52] = os.getpid().to_bytes(4, "little")       # pid, start time unchanged
    with open(fake, "wb") as f:
        f.write(raw)
    p.stdin.write("x\n")
    p.stdin.flush()
    p.wait(timeout=30)
    assert livestats.read_file(fake) is None
    assert livestats.scan(pid=os.getpid()) == []
    assert not os.path.exists(fake)
    del c


def test_off_and_unwritable(data, sdir, tmp_path):
    env = dict(os.environ, PHX_STATS="0")
    c = Child(data, env=env)
    try:
        assert c.path == "None"
        assert os.listdir(sdir) == []
    finally:
        c.close()
    r = subprocess.run([sys.executable, "-c", "import phx; from phx._lib import engine as e; "
                        "phx.Engine(); print(e.stats_path(), '|', e.stats_path_reason())"],
                       env=dict(os.environ, PHX_STATS_DIR=str(tmp_path / "missing")),
                       capture_output=True, text=True, check=True)
    assert r.stdout.startswith("None |") and "cannot create a file" in r.stdout, r.stdout


def test_a_forked_child_publishes_its_own_and_leaves_the_parents_alone(data, sdir):
    code = textwrap.dedent(r"""
        import json, os, sys
        import phx
        from phx._lib import engine as _e
        eng = phx.Engine()
        f = phx.open(sys.argv[1], "r", engine=eng)
        buf = phx.empty_aligned(1 << 20)
        f.pread(buf, 0)
        _e.stats_publish()
        mine = _e.stats_path()
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(r)
            e2 = phx.Engine()
            f2 = phx.open(sys.argv[1], "r", engine=e2)
            for i in range(4):
                f2.pread(buf, i << 20)
            _e.stats_publish()
            os.write(w, (str(_e.stats_path()) + "\n").encode())
            os.close(w)
            import time; time.sleep(1.5)
            os._exit(0)
        os.close(w)
        child_path = os.read(r, 4096).decode().strip()
        print(json.dumps({"parent": mine, "child": child_path, "child_pid": pid}), flush=True)
        os.waitpid(pid, 0)
        sys.stdin.readline()
    """)
    p = subprocess.Popen([sys.executable, "-c", code, data], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True)
    try:
        got = json.loads(p.stdout.readline())
        assert got["parent"] != got["child"] and f".{got['child_pid']}." in got["child"]
        par = livestats.scan(pid=p.pid)[0]
        assert [s.counters["bytes_read"] for s in par.sources] == [1 << 20], par.sources
    finally:
        p.stdin.write("x\n")
        p.stdin.flush()
        p.wait(timeout=30)


def test_phx_stats_and_phx_top_watch_a_running_process(data, sdir, tmp_path):
    c = Child(data, "4")
    try:
        c.p.stdin.write("loop\n")
        c.p.stdin.flush()
        phx_cli = [sys.executable, "-m", "phx"]
        r = subprocess.run(phx_cli + ["stats", "--pid", str(c.pid), "--json"],
                           capture_output=True, text=True, check=True)
        js = json.loads(r.stdout)
        assert [p["pid"] for p in js["processes"]] == [c.pid]
        r = subprocess.run(phx_cli + ["stats"], capture_output=True, text=True, check=True)
        assert f"pid {c.pid}" in r.stdout and "engine: engine" in r.stdout
        rec, png = tmp_path / "top.json", tmp_path / "top.png"
        r = subprocess.run(phx_cli + ["top", "-n", "3", "-d", "0.4", "--pid", str(c.pid),
                                      "--record", str(rec), "--plot", str(png)],
                           capture_output=True, text=True, check=True, timeout=60)
        screens = r.stdout.strip().split("\n\n")
        assert len(screens) == 3, r.stdout
        assert all(f"{c.pid}" in s and "READ GB/s" in s for s in screens), r.stdout
        samples = json.loads(rec.read_text())["samples"]
        assert samples and all(s["pid"] == c.pid for s in samples)
        assert max(s["read_gbs"] for s in samples) > 0
        assert all(0 < s["paths"]["direct"] <= 1 for s in samples if s["paths"])
        assert png.stat().st_size > 1000
        assert c.p.stdout.readline().strip() == "ok"
    finally:
        c.close()
    r = subprocess.run([sys.executable, "-m", "phx", "stats", "--pid", str(c.pid)],
                       capture_output=True, text=True)
    assert r.returncode == 1 and "no phx counters" in r.stdout


def test_rates_from_two_samples():
    def proc(t, n):
        src = livestats.Source("engine", "e", 1, "f", 0, t, {
            "reads": n, "writes": n // 2, "bytes_read": n << 20, "bytes_written": n << 19,
            "direct_bytes": 3 * n << 19, "bounce_bytes": n << 18, "buffered_bytes": n << 18,
            "rmw_ios": n // 4, "errors": n // 500})
        return livestats.Process(7, "x", "x", ["f"], 200, t, "0", [src])
    r, = livestats.rates([proc(0, 0)], [proc(2_000_000_000, 1000)])
    assert r.read_gbs == pytest.approx(1000 * (1 << 20) / 2 / 1e9)
    assert r.iops == pytest.approx(750)
    assert r.paths == pytest.approx({"direct": 0.75, "bounce": 0.125, "page_cache": 0.125})
    assert r.rmw_share == pytest.approx(0.5)
    assert r.errors == 2 and r.errors_total == 2
    assert r.staging_bytes is None and r.early_share is None


def test_a_gpu_context_is_published_and_its_lanes_are_not(fake_cuda, tmp_path, sdir):
    code = textwrap.dedent(r"""
        import sys
        import phx
        from phx._lib import cuda as _c, engine as _e
        eng = phx.Engine()
        ctx = _c.Context(eng, 0, lanes=3, bufs_per_lane=2, buf_size=1 << 20)
        _e.stats_publish()
        print("up", flush=True)
        sys.stdin.readline()
        ctx.close()
        _e.stats_publish()
        print("closed", flush=True)
        sys.stdin.readline()
    """)
    env = dict(os.environ, LD_LIBRARY_PATH=str(fake_cuda))
    p = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert p.stdout.readline().strip() == "up"
        src = livestats.scan(pid=p.pid)[0].sources
        kinds = sorted(s.kind for s in src)
        assert kinds == ["cuda", "engine"], [(s.kind, s.label) for s in src]
        cu = next(s for s in src if s.kind == "cuda")
        assert cu.label.startswith("GPU 0, 3 lanes") and cu.counters["pinned_bytes"] >= 6 << 20
        p.stdin.write("\n")
        p.stdin.flush()
        assert p.stdout.readline().strip() == "closed"
        assert [s.kind for s in livestats.scan(pid=p.pid)[0].sources] == ["engine"]
    finally:
        p.stdin.write("\n")
        p.stdin.flush()
        p.wait(timeout=60)


def test_libphxfile_publishes_its_counters(fake_cuda, tmp_path, sdir):
    phx_lmcache = pytest.importorskip("phx_lmcache")
    lib = phx_lmcache.library_path()
    if not os.path.exists(lib):
        pytest.skip("libphxfile.so not installed (pip install .)")
    code = textwrap.dedent(r"""
        import ctypes, sys
        lib = ctypes.CDLL(sys.argv[1])
        assert lib.phxFileDriverOpen() == 0
        print("up", flush=True)
        sys.stdin.readline()
        lib.phxFileDriverClose()
    """)
    env = dict(os.environ, LD_LIBRARY_PATH=str(fake_cuda))
    p = subprocess.Popen([sys.executable, "-c", code, lib], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert p.stdout.readline().strip() == "up"
        deadline = time.time() + 5
        while time.time() < deadline:
            procs = livestats.scan(pid=p.pid)
            pf = [s for q in procs for s in q.sources if s.kind == "phxfile"]
            if pf and pf[0].counters["driver_opens"] == 1:
                break
            time.sleep(0.1)
        assert pf and pf[0].counters["driver_opens"] == 1, procs
        assert pf[0].counters["path"] == 1            # PHXFILE_PATH_STAGING
    finally:
        p.stdin.write("\n")
        p.stdin.flush()
        p.wait(timeout=60)


def test_top_lists_a_process_between_its_engines_as_idle():
    """A process whose engines are all closed right now (a benchmark between
    rows) stays on the screen as idle instead of vanishing; the "no process"
    line only when nothing publishes."""
    from phx import top
    busy = livestats.Process(7, "bench", "phx bench io", ["f"], 200, 0, "0", [
        livestats.Source("engine", "e", 1, "f", 0, 10**9, {"bytes_read": 1 << 30})])
    idle = livestats.Process(9, "bench2", "phx bench gpu", ["g"], 200, 0, "0", [])
    rows = livestats.rates([], [busy])
    screen = top.render(rows, 200, 0, idle=[idle, busy])
    assert "(+1 idle)" in screen and "9  bench2  idle" in screen
    assert any(ln.split()[:2] == ["7", "bench"] for ln in screen.splitlines())
    assert "no process publishes" not in screen
    screen = top.render([], 200, 0, idle=[idle])
    assert "0 processes, 0 sources (+1 idle)" in screen and "no process publishes" not in screen
    assert "no process publishes" in top.render([], 200, 0)
