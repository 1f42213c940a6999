#!/usr/bin/env python3
"""Does writing a page-cache KV file behind (sync_file_range WRITE after each
tensor) change a capped process's "prefill" and "decode"?  A diagnostic for
phx.kv's ``write_behind`` (docs/kv.md, "Write-behind").

    tools/writeback_probe.py plain|wb FILE

Writes 64 tensors of 16 MiB of random bytes (1 GiB) buffered into FILE, then
runs 7 "decode steps" (read every tensor, write one 32 KiB row into each) and
prints the prefill and per-step seconds.  Run it inside a memory cgroup to see
the cap's effect, e.g. (cgroup v1, as root):

    mkdir /sys/fs/cgroup/memory/wb && echo $((1300 << 20)) > /sys/fs/cgroup/memory/wb/memory.limit_in_bytes
    sync; echo 3 > /proc/sys/vm/drop_caches
    sh -c 'echo $$ > /sys/fs/cgroup/memory/wb/cgroup.procs; exec python3 tools/writeback_probe.py wb /var/tmp/wb.bin'
"""
from __future__ import annotations

import os
import sys
import time

from phx.kv import _sys

TENSORS, SIZE, ROW = 64, 16 << 20, 32 << 10


def main() -> int:
    if len(sys.argv) != 3 or sys.argv[1] not in ("plain", "wb"):
        print(__doc__, file=sys.stderr)
        return 2
    behind, path = sys.argv[1] == "wb", sys.argv[2]
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.ftruncate(fd, TENSORS * SIZE)
        buf = os.urandom(SIZE)
        t0 = time.perf_counter()
        for i in range(TENSORS):
            os.pwrite(fd, buf, i * SIZE)
            if behind:
                _sys.start_writeback(fd, i * SIZE, SIZE, path)
        print(f"{sys.argv[1]} prefill {time.perf_counter() - t0:.3f} s", flush=True)
        rd, row = bytearray(SIZE), os.urandom(ROW)
        steps = []
        for s in range(7):
            t = time.perf_counter()
            for i in range(TENSORS):
                os.preadv(fd, [rd], i * SIZE)
                os.pwrite(fd, row, i * SIZE + ((512 + s) * ROW) % SIZE)
            steps.append(time.perf_counter() - t)
        print(sys.argv[1], "steps", " ".join(f"{x:.2f}" for x in steps), flush=True)
    finally:
        os.close(fd)
        os.unlink(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
