#!/usr/bin/env python3
"""Run a suite with tests/guest/phxguest.py, the NVMe drives opened with discard=unmap.

phxguest.py attaches its emulated NVMe drives with QEMU's default
``discard=ignore``: the controller then accepts Dataset Management deallocate
and reports (DLFEAT) that deallocated blocks read as zeroes, but the data stay.
This wrapper changes nothing else: it adds ``discard=unmap`` to each
``-drive`` of the QEMU command line phxguest builds, so what QEMU reports is
true and the deallocate tests can hold it to its word.  If phxguest ever
changes shape, the wrapper falls back to the plain command (the suite is told
through PHX_NVME_DISCARD and then only checks what the emulator can promise).

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
    out = []
    for c in cmd:
        if isinstance(c, str) and c.startswith("file=") and ",if=none," in c \
                and "discard=" not in c:
            c += ",discard=unmap"
        out.append(c)
    return out


if _orig is not None:
    phxguest.qemu_cmd = _qemu_cmd

if __name__ == "__main__":
    sys.exit(phxguest.main())
