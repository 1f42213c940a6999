#!/usr/bin/env python3
"""Run a suite with tests/guest/phxguest.py, the NVMe drives opened with discard=unmap.

phxguest.py attaches its emulated NVMe drives with QEMU's default
``discard=ignore``: the controller then accepts Dataset Management deallocate
and reports (DLFEAT) that deallocated blocks read as zeroes, but the data stay.
This wrapper changes nothing else: it adds ``discard=unmap`` to each
``-drive`` of the QEMU command line phxguest builds, so what QEMU reports is
true and the deallocate tests can hold it to its word.  If phxguest ever
changes shape, the wrapper falls back to the plain command; the guest learns
which it got from ``phx.nvme_discard=unmap`` on its kernel command line, and
without it the tests only check what the emulator can promise.

Usage: same arguments as phxguest.py.
"""
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import phxguest  # noqa: E402

_orig = getattr(phxguest, "qemu_cmd", None)


def _qemu_cmd(*args, **kw):
    cmd = _orig(*args, **kw)
    out, drives, unmapped = [], 0, 0
    for c in cmd:
        if isinstance(c, str) and c.startswith("file=") and ",if=none," in c:
            drives += 1
            if "discard=" not in c:
                c += ",discard=unmap"
            unmapped += ",discard=unmap" in c
        out.append(c)
    # tell the guest (tests read /proc/cmdline) when every drive has it,
    # whether added here or already there (phxguest.py adds it itself now)
    if drives and unmapped == drives and "-append" in out:
        i = out.index("-append") + 1
        out[i] += " phx.nvme_discard=unmap"
    return out


if _orig is not None:
    phxguest.qemu_cmd = _qemu_cmd

if __name__ == "__main__":
    sys.exit(phxguest.main())
