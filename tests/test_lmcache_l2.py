"""phx's LMCache L2 plugin (issue 28) against real LMCache 0.5.6, on ext4 and xfs.

One child process (adapters/lmcache/tests/l2_checks.py) imports torch and
lmcache once and runs every scenario on both filesystems, each phase in a
forked process with its own LMCache StorageManager that loads the plugin from
LMCache's configuration; the tests below assert on what it reports.  Every
chunk is fresh random data (a new seed per run, printed on failure) compared
byte for byte.  ~20-40 s on the 2-core dev box, most of it importing torch and
lmcache once and making the two filesystems.
"""
from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
from typing import Any

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "adapters", "lmcache", "tests"))
import support  # noqa: E402

CHECKS = os.path.join(ROOT, "adapters", "lmcache", "tests", "l2_checks.py")
SRC = os.path.join(ROOT, "adapters", "lmcache", "python", "phx_lmcache", "l2")
FS = ("ext4", "xfs")
SITE = support.lmcache_site()

pytestmark = [
    pytest.mark.skipif(SITE is None, reason="lmcache not installed: " + support.INSTALL_HINT),
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root (loop mounts)"),
    pytest.mark.root,
]


def _installed_matches_source() -> str | None:
    """The plugin LMCache imports is the installed copy: it must be this tree's."""
    code = "import phx_lmcache.l2.backend as b, os; print(os.path.dirname(b.__file__))"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       env=support.child_env(SITE or ""))
    if r.returncode:
        return r.stderr[-2000:]
    inst = r.stdout.strip()
    for name in os.listdir(SRC):
        if name.endswith(".py"):
            with open(os.path.join(SRC, name), "rb") as a:
                src = a.read()
            try:
                with open(os.path.join(inst, name), "rb") as b:
                    if b.read() != src:
                        return f"{inst}/{name} differs from the source"
            except FileNotFoundError:
                return f"{inst}/{name} missing"
    return None


def _mount(base: str, fs: str) -> str:
    img, mnt = os.path.join(base, f"{fs}.img"), os.path.join(base, fs)
    os.makedirs(mnt)
    with open(img, "wb") as f:
        f.truncate(640 << 20)
    mk = ["mkfs.ext4", "-q", "-F", img] if fs == "ext4" else ["mkfs.xfs", "-q", "-f", img]
    subprocess.run(mk, check=True, capture_output=True)
    subprocess.run(["mount", "-o", "loop", img, mnt], check=True, capture_output=True)
    return mnt


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    bad = _installed_matches_source()
    if bad:
        pytest.fail("the installed phx_lmcache.l2 is not this tree's: run "
                    f"`pip install --no-build-isolation -e .` ({bad})")
    for tool in ("mkfs.ext4", "mkfs.xfs"):
        if shutil.which(tool) is None:
            pytest.skip(f"{tool} missing (make deps)")
    base = str(tmp_path_factory.mktemp("l2fs"))
    mounts: dict[str, str] = {}
    try:
        for fs in FS:
            mounts[fs] = _mount(base, fs)
        seed = random.randrange(1 << 30)
        args = [f"--seed={seed}"] + [f"--fs={fs}={d}" for fs, d in mounts.items()]
        if os.environ.get("PHX_L2_ONLY"):      # development: some scenarios only
            args.append("--only=" + os.environ["PHX_L2_ONLY"])
        r = support.run_py(CHECKS, args, support.child_env(SITE or ""), timeout=600)
        line = [x for x in r.stdout.splitlines() if x.startswith("L2RESULT ")]
        if r.returncode or not line:
            pytest.fail(f"l2_checks.py failed (rc {r.returncode}, seed {seed}):\n"
                        f"{r.stdout[-3000:]}\n{r.stderr[-6000:]}")
        out: dict[str, Any] = json.loads(line[0][len("L2RESULT "):])
        out["_log"] = r.stderr
        return out
    finally:
        for d in mounts.values():
            subprocess.run(["umount", d], capture_output=True)


def _sc(results: dict[str, Any], fs: str, name: str) -> Any:
    r = results[fs][name]
    if isinstance(r, dict) and "error" in r:
        pytest.fail(f"seed {results['seed']}: {r['error']}")
    return r


def _exact(chk: dict[str, list[int]], want: list[int] | range, missing: list[int] | range = ()
           ) -> None:
    assert chk["wrong"] == [], "a wrong chunk was served"
    assert chk["exact"] == list(want)
    assert chk["missing"] == list(missing)


@pytest.mark.parametrize("fs", FS)
def test_roundtrip_restart_and_api(results: dict[str, Any], fs: str) -> None:
    r = _sc(results, fs, "roundtrip")
    _exact(r["a"]["before"], range(24))
    assert r["a"]["via_sm"] == 4                     # LMCache's StorageManager.batched_get
    assert r["a"]["api"] == {
        "contains": True, "contains_absent": False, "batched_contains": 2,
        "in_put_tasks": False, "pin": True, "unpin": True, "pin_absent": False,
        "remove": True, "remove_again": False, "after_remove": False,
        "async_contains": 2, "async_get": [True, True, 2], "get_non_blocking": True}
    # a new process: the index comes back from the slab; the removed key stays removed
    assert r["b"]["stats"]["recovered"] == 23
    _exact(r["b"]["check"], [i for i in range(24) if i != 5], [5])


@pytest.mark.parametrize("fs", FS)
def test_kill9_during_puts(results: dict[str, Any], fs: str) -> None:
    for rnd in _sc(results, fs, "kill_random"):
        acked = set(rnd["acked"])
        chk = rnd["check"]
        assert chk["wrong"] == []
        assert acked <= set(chk["exact"]), "a completed put was lost"
        assert rnd["stats"].get("checksum_failures", 0) == 0


@pytest.mark.parametrize("fs", FS)
def test_kill9_between_payloads_and_headers(results: dict[str, Any], fs: str) -> None:
    r = _sc(results, fs, "kill_header")
    # batch 1 (0-7) done; batch 2 (8-15) died after 3 of its headers
    assert r["acked"] == list(range(8))
    _exact(r["check"], range(11), range(11, 16))
    assert r["stats"]["recovered"] == 11


@pytest.mark.parametrize("fs", FS)
def test_kill9_while_reusing_slots(results: dict[str, Any], fs: str) -> None:
    r = _sc(results, fs, "kill_reuse")
    # 6 slots full; the next 6 evict them all and die before any header: the
    # evicted entries must not come back over the new payloads (tombstones)
    assert r["acked"] == list(range(6))
    _exact(r["check"], [], range(12))
    assert r["stats"]["recovered"] == 0 and r["stats"]["recovery_dropped"] == 0
    assert r["stats"].get("checksum_failures", 0) == 0


@pytest.mark.parametrize("fs", FS)
def test_bit_flip_in_payload(results: dict[str, Any], fs: str) -> None:
    r = _sc(results, fs, "flip_payload")
    _exact(r["restart"]["first"], [0, 1, 3, 4, 5, 6, 7], [2])      # flipped while down
    _exact(r["restart"]["second"], [0, 1, 3, 4, 6, 7], [2, 5])     # flipped while running
    assert r["restart"]["stats"]["checksum_failures"] == 2
    _exact(r["again"]["check"], [0, 1, 3, 4, 6, 7], [2, 5])
    _exact(r["two_readers"]["check"], [0, 1, 3, 4, 6], [2, 5, 7])   # readers: 2
    assert r["two_readers"]["stats"]["checksum_failures"] == 1
    _exact(r["auto_readers"]["check"], [0, 1, 3, 4], [2, 5, 6, 7])  # 16 CPUs: 8 readers
    assert (r["auto_readers"]["readers"], r["auto_readers"]["engines"]) == (8, 8)
    assert r["auto_readers"]["stats"]["checksum_failures"] == 1
    _exact(r["crc_thread"]["check"], [0, 1, 3], [2, 4, 5, 6, 7])     # crc_thread: true
    assert r["crc_thread"]["stats"]["checksum_failures"] == 1
    _exact(r["crc_threads"]["check"], [0, 3], [1, 2, 4, 5, 6, 7])   # 3 readers, 3 crc threads
    assert r["crc_threads"]["stats"]["checksum_failures"] == 1
    assert r["crc_threads"]["crc_threads"] == ["phx-l2-rcrc0", "phx-l2-rcrc1", "phx-l2-rcrc2"]
    assert r["restart"]["stats"]["pool_registered_bytes"] > 0      # LMCache's pool, fixed
    assert "pool_registered_bytes" not in r["crc_thread"]["stats"]
    assert "payload checksum mismatch" in results["_log"]


@pytest.mark.parametrize("fs", FS)
def test_bit_flip_in_header(results: dict[str, Any], fs: str) -> None:
    r = _sc(results, fs, "flip_header")["restart"]
    assert r["stats"]["recovery_dropped"] == 1                     # flipped while down
    _exact(r["first"], [0, 2, 3, 4, 5, 6, 7], [1])
    _exact(r["second"], [0, 2, 3, 4, 5, 7], [1, 6])                # flipped while running
    assert r["stats"]["header_failures"] == 1


@pytest.mark.parametrize("fs", FS)
def test_truncated_slab(results: dict[str, Any], fs: str) -> None:
    r = _sc(results, fs, "truncate")
    surv = r["survivors"]
    assert surv and len(surv) < 10
    _exact(r["after"]["first"], surv, [i for i in range(10) if i not in surv])
    _exact(r["after"]["new"], range(100, 107))                      # writable again
    assert r["after"]["size"] > 4096 + 10 * (4096 + 256 * 1024)     # extended back


@pytest.mark.parametrize("fs", FS)
def test_full_filesystem(results: dict[str, Any], fs: str) -> None:
    r = _sc(results, fs, "enospc")
    assert r["start"] == {"no_plugin": True, "left_behind": False}
    for name in ("", "_writers2"):       # payloads by one engine, then by two at once
        d = r["during" + name]
        assert d["stats"]["writers"] == (2 if name else 1)
        assert d["stats"].get("payload_failures", 0) + d["stats"].get("header_failures", 0) > 0
        assert d["stats"]["puts"] > 0
        stored = d["check"]["exact"]
        assert d["check"]["wrong"] == [] and len(stored) == d["stats"]["puts"]
        _exact(r["after" + name]["check"], stored, [i for i in range(40) if i not in stored])


@pytest.mark.parametrize("fs", FS)
def test_two_servers_one_slab(results: dict[str, Any], fs: str) -> None:
    r = _sc(results, fs, "two_servers")
    assert r["second"]["plugin_loaded"] is False
    assert r["second"]["error"].startswith("SlabInUseError")
    assert f"slab in use by process {r['holder_pid']}" in r["second"]["error"]
    assert r["unchanged"] and r["mtime_unchanged"] and r["size_unchanged"]
    _exact(r["holder"]["check"], range(6))


@pytest.mark.parametrize("fs", FS)
def test_lru_eviction_and_pins(results: dict[str, Any], fs: str) -> None:
    r = _sc(results, fs, "lru")
    assert r["run"]["present"] == [0, 1, 6, 7, 8, 9, 10, 11]    # 0 pinned, 1 hit
    _exact(r["run"]["check"], r["run"]["present"])
    assert r["run"]["present2"] == [1, 6, 7, 8, 9, 10, 11, 12]  # unpinned 0 went first
    _exact(r["run"]["check2"], r["run"]["present2"])
    _exact(r["restart"]["check"], r["run"]["present2"], [0, 2, 3, 4, 5])


@pytest.mark.parametrize("fs", FS)
def test_two_slab_files(results: dict[str, Any], fs: str) -> None:
    r = _sc(results, fs, "two_files")
    assert [os.path.basename(p) for p in r["run"]["files"]] == ["a.slab", "b.slab"]
    _exact(r["run"]["check"], range(12))
    assert r["run"]["second"] == "SlabInUseError"
    _exact(r["restart"]["check"], range(12))
    w = r["writers3"]                     # phx_l2.writers 3: payloads on three engines
    assert w["stats"]["writers"] == 3 and w["engines"] == 3 and w["stats"]["puts"] == 13
    _exact(w["check"], range(13))
    _exact(r["writers3_restart"]["check"], range(13))


def test_readers_setting() -> None:
    """``phx_l2.readers``: a count, or auto (the usable CPUs, 1 to 8);
    anything else is refused with the key's name."""
    code = ("import os, json\n"
            "from phx_lmcache.l2.backend import _readers\n"
            "out = {}\n"
            "for n in (1, 2, 3, 16, 64):\n"
            "    os.sched_getaffinity = lambda pid, n=n: set(range(n))\n"
            "    out[n] = _readers('auto')\n"
            "out['ints'] = [_readers(3), _readers('5')]\n"
            "for bad in (0, -1, 'many', None):\n"
            "    try:\n"
            "        _readers(bad)\n"
            "    except ValueError as e:\n"
            "        out[repr(bad)] = str(e)\n"
            "print(json.dumps(out))\n")
    r = support.run_py(code, [], support.child_env(SITE or ""))
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout)
    assert [out[str(n)] for n in (1, 2, 3, 16, 64)] == [1, 2, 3, 8, 8]
    assert out["ints"] == [3, 5]
    for bad in ("0", "-1", "'many'", "None"):
        assert "phx_l2.readers" in out[bad], out


def test_payload_writes_keep_what_a_failed_batch_wrote() -> None:
    """Payloads go out in pieces, in one ``pwrite_batch`` per writer and slab file;
    when it fails (which says only that some write failed) each piece is written
    again on its own, so one piece that cannot be written loses only its payload
    (the payload's other pieces were written: still not paid); a short count for
    one piece in a batch that succeeded marks only that payload unwritten."""
    code = r'''
import collections, concurrent.futures, json, os, threading
from phx_lmcache.l2.backend import PhxL2Backend, _Put

class Obj:
    def __init__(self, i): self.byte_array = os.urandom(8192 + 512 * i)

class File:
    path, index = "/slab", 0
    def __init__(self, batch, bad):
        self.f, self.batch, self.bad, self.written = self, batch, bad, {}
    def pwrite_batch(self, reqs):
        if self.batch == "fail":
            raise OSError(28, "No space left on device")
        out = []
        for buf, off in reqs:
            n = len(buf) - (512 if off == self.bad else 0)
            self.written[off] = bytes(buf[:n])
            out.append(n)
        return out
    def pwrite_async(self, buf, off):
        fut = concurrent.futures.Future()
        if off == self.bad:
            fut.set_exception(OSError(28, "No space left on device"))
        else:
            self.written[off] = bytes(buf)
            fut.set_result(len(buf))
        return fut

class Slab:
    def __init__(self, f): self.files = [f]
    def locate(self, slot): return self.files[0], slot << 20

out = {}
for batch in ("fail", "short"):
    f = File(batch, bad=(2 << 20) + 2 * 4096)     # slot 2's payload's second piece
    be = PhxL2Backend.__new__(PhxL2Backend)
    be.header_bytes, be._slab = 4096, Slab(f)
    be.counters, be._logged_fail = collections.defaultdict(int), set()
    be.write_piece = 4096      # payloads of 8-9.5 KiB: 2 or 3 pieces each
    # two writers: slots 0 and 2 in this thread, 1 and 3 on a pool thread
    be.writers, be._efiles, be._lock = 2, [[f], [f]], threading.Lock()
    be._io_pool = concurrent.futures.ThreadPoolExecutor(1)
    work = []
    for i in range(4):
        o = Obj(i)
        p = _Put(f"k{i}", None, o, len(o.byte_array))
        p.slot = i
        work.append(p)
    be._write_payloads(work)
    base = [(p.slot << 20) + 4096 for p in work]
    out[batch] = {"paid": [p.paid for p in work],
                  "exact": [b"".join(f.written.get(b + k, b"") for k in range(0, p.nbytes, 4096))
                            == p.obj.byte_array for b, p in zip(base, work)],
                  "pieces": len(f.written),
                  "failures": be.counters["payload_failures"]}
print(json.dumps(out))
'''
    r = support.run_py(code, [], support.child_env(SITE or ""))
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    for case in ("fail", "short"):
        assert out[case]["paid"] == [True, True, False, True], out
        assert out[case]["exact"] == [True, True, False, True], out
        assert out[case]["failures"] == 1, out
        # 4 payloads of 8192 + 512 i bytes in 11 pieces: all but slot 2's second
        # written where each went alone, all (that one short) in the batch
        assert out[case]["pieces"] == (10 if case == "fail" else 11), out


def test_reader_hashes_landed_reads_at_once_and_keeps_a_window_otherwise() -> None:
    """A reader reaps (and checksums) every read that has landed right after
    submitting the next: on zram each piece is hashed while still in cache.
    Reads that have not landed (a device that DMAs) fill the window,
    ``read_window`` in flight, and are reaped oldest first in both cases."""
    code = r'''
import json
from phx_lmcache.l2.backend import PhxL2Backend, _Results

class Fut:
    def __init__(self, log, off, landed): self.log, self.off, self.landed = log, off, landed
    def done(self): return self.landed
    def result(self, timeout=None):
        self.log.append(["reap", self.off])
        return 4096

class File:
    def __init__(self, log, landed): self.log, self.landed = log, landed
    def pread_async(self, mv, off):
        self.log.append(["submit", off])
        return Fut(self.log, off, self.landed)

out = {}
for landed in (True, False):
    log = []
    be = PhxL2Backend.__new__(PhxL2Backend)
    be.window, be.verify = 4, True
    f, buf = File(log, landed), memoryview(bytearray(10 * 4096))
    plan = [(0, 4096, f, buf[i * 4096:(i + 1) * 4096], i * 4096) for i in range(10)]
    q = _Results()
    be._reader(plan, q, None)
    depth, most = 0, 0
    for what, _ in log:
        depth += 1 if what == "submit" else -1
        most = max(most, depth)
    out[str(landed)] = {"most": most, "reaped": [o for w, o in log if w == "reap"],
                        "results": len(q.items)}
print(json.dumps(out))
'''
    r = support.run_py(code, [], support.child_env(SITE or ""))
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    order = [i * 4096 for i in range(10)]
    assert out["True"] == {"most": 1, "reaped": order, "results": 10}, out
    assert out["False"] == {"most": 4, "reaped": order, "results": 10}, out
