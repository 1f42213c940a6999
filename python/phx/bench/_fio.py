"""fio as a baseline engine, at its strongest: build the job, run it, read its JSON.

One fio process per measurement, ``--ioengine=io_uring --direct=1``, one job
of ``--iodepth=QD`` on the benchmark's own file, time-based.  Random offsets
are uniform, block-aligned and drawn with replacement afresh each run
(``--randrepeat=0 --norandommap``), which is what the other engines do too.

The job uses everything fio's io_uring engine offers that makes it faster
without changing the workload (see docs/bench-io.md, "fio at its strongest"):

* ``--fixedbufs --registerfiles``: READ_FIXED/WRITE_FIXED on buffers and a
  file registered once, as phx does.
* ``--iodepth_batch_submit=B`` with B = phx's ``submit_batch`` (the caller
  passes it, read from phx's engine config so that the two stay equal): B
  SQEs per ``io_uring_enter``, as phx hands them to the kernel.
* ``--iodepth_batch_complete_min=1 --iodepth_batch_complete_max=QD``: wait for
  one completion, then take every completion that is there (fio's own
  example in its HOWTO).  Without the ``_max`` fio reaps one completion per
  call, so it refills one request at a time and, in the steady state, hands
  the kernel one SQE per call whatever ``iodepth_batch_submit`` says.
* ``--scramble_buffers=0``: no rewriting of the write buffers before every
  submit (the data is random already, filled once, as phx's is).
* ``--gtod_reduce=1``: fio's latency and bandwidth accounting off (the
  benchmark reads none of it; it costs clock reads per I/O).
* ``--disk_util=0``: no disk-utilisation sampling thread (the benchmark
  reads the device's counters itself).
* writes end with an fsync, timed -- but not fio's own ``--end_fsync=1``:
  with ``--fixedbufs`` fio 3.33 loses it.  Its final fsync reuses an I/O
  unit whose SQE still carries the ``buf_index`` of that unit's last
  WRITE_FIXED (fio zeroes its SQEs once, at setup, and its fsync branch does
  not reset ``buf_index``); the kernel refuses an IORING_OP_FSYNC with a
  nonzero ``buf_index`` (-EINVAL) and fio ignores the failure, so the fsync
  happens only when the unit is number 0.  The benchmark therefore fsyncs
  the file itself as soon as fio exits and adds that time to fio's
  (:func:`timed_fsync`), as phx and preadv fsync inside their timed runs.

fio 3.33 itself sets up its ring with ``IORING_SETUP_SINGLE_ISSUER |
IORING_SETUP_DEFER_TASKRUN | IORING_SETUP_COOP_TASKRUN`` and a CQ of QD
entries (engines/io_uring.c, ``fio_ioring_queue_init``); it has no option for
a registered ring fd.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from dataclasses import dataclass
from typing import Any

#: fio's names for the four operations ``phx bench io`` measures.
OPS = ("read", "write", "randread", "randwrite")


@dataclass
class FioResult:
    """What one fio run moved, and how busy it kept the CPU."""
    nbytes: int
    ios: int
    seconds: float
    cpu_pct: float  # user + system, percent of one CPU


def fio_path() -> str | None:
    """The fio executable, or None when it is not installed."""
    return shutil.which("fio")


def fio_version(fio: str) -> str:
    """``fio --version`` (e.g. ``fio-3.33``)."""
    return subprocess.run([fio, "--version"], capture_output=True, text=True,
                          check=True).stdout.strip()


def _escape(path: str) -> str:
    # fio splits --filename on ':'; a backslash keeps a literal colon.
    return path.replace(":", "\\:")


def strong_options(qd: int, submit_batch: int) -> list[str]:
    """The options that put fio at its strongest for one job (see the module doc).

    ``submit_batch`` is phx's (0: everything at once, which fio spells the same
    way: ``iodepth_batch_submit=0`` means QD).
    """
    if submit_batch < 0:
        raise ValueError(f"submit_batch must be >= 0, not {submit_batch}")
    opts = ["--fixedbufs", "--registerfiles",
            f"--iodepth_batch_submit={submit_batch}",
            "--iodepth_batch_complete_min=1", f"--iodepth_batch_complete_max={qd}",
            "--scramble_buffers=0", "--gtod_reduce=1", "--disk_util=0"]
    return opts


def timed_fsync(path: str) -> float:
    """fsync ``path`` (data and metadata to stable storage); return the seconds it took.

    Stands in for fio's ``--end_fsync=1``, which fio 3.33 loses with
    ``--fixedbufs`` (see the module doc).
    """
    t0 = time.perf_counter()
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    return time.perf_counter() - t0


def fio_command(fio: str, path: str, size: int, op: str, bs: int, qd: int,
                runtime_s: float, submit_batch: int,
                extra: list[str] | tuple[str, ...] = ()) -> list[str]:
    """The fio command line for one measurement (``extra`` goes last)."""
    if op not in OPS:
        raise ValueError(f"unknown op {op!r}")
    ms = max(1, round(runtime_s * 1000))
    return [
        fio, "--name=phx-bench-io", f"--filename={_escape(path)}",
        "--ioengine=io_uring", "--direct=1", f"--rw={op}", f"--bs={bs}",
        f"--iodepth={qd}", f"--size={size}", "--numjobs=1",
        "--time_based", f"--runtime={ms}ms",
        "--randrepeat=0", "--norandommap",
        "--invalidate=0",  # O_DIRECT throughout; nothing to invalidate
        *strong_options(qd, submit_batch),
        "--output-format=json", *extra,
    ]


def parse_fio_json(text: str, op: str) -> FioResult:
    """Totals of the one job in fio's ``--output-format=json`` output."""
    start = text.find("{")  # fio may print notes before the document
    if start < 0:
        raise RuntimeError(f"fio printed no JSON: {text[:400]!r}")
    doc: dict[str, Any] = json.loads(text[start:])
    jobs = doc.get("jobs") or []
    if len(jobs) != 1:
        raise RuntimeError(f"fio reported {len(jobs)} jobs, expected 1")
    job = jobs[0]
    if job.get("error"):
        raise RuntimeError(f"fio job failed: error {job['error']}")
    side = job["write" if "write" in op else "read"]
    ms = side.get("runtime") or 0
    if ms <= 0 or side.get("io_bytes", 0) <= 0:
        raise RuntimeError(f"fio moved no data ({op}): {side}")
    return FioResult(nbytes=int(side["io_bytes"]), ios=int(side["total_ios"]),
                     seconds=ms / 1000.0,
                     cpu_pct=float(job.get("usr_cpu", 0.0)) + float(job.get("sys_cpu", 0.0)))


def run_fio(cmd: list[str], op: str, timeout_s: float) -> FioResult:
    """Run one fio command and parse what it measured."""
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    if p.returncode != 0:
        raise RuntimeError(f"fio failed ({p.returncode}): {p.stderr.strip() or p.stdout[-400:]}"
                           f"\ncommand: {' '.join(cmd)}")
    return parse_fio_json(p.stdout, op)
