#!/bin/bash
# PHX-EXPECT: smoke
set -u
ls -l /dev/ng* /dev/nvme*
cat /sys/block/nvme0n1/queue/max_hw_sectors_kb /sys/block/nvme0n1/queue/max_segments
cd $PHX_REPO
.venv/bin/python - <<'PY'
import os, phx._lib.nvme as n
print(n.identify("/dev/ng0n1"))
ns = n.Namespace("/dev/ng0n1")
print(ns.info)
b = bytearray(os.urandom(1<<20))
ns.write(b, 0)
r = bytearray(1<<20)
ns.read(r, 0)
print("equal", r == b, ns.stats())
ns.deallocate(0, 1<<20)
ns.read(r, 0)
print("after dealloc zero:", r == bytes(1<<20), ns.stats())
try:
    ns.read(r, ns.end)
except OSError as e: print(repr(e))
ns.close()
ns = n.Namespace("/dev/ng0n1", _no_capacity_check=True, nr_lbas=10**9, force=True)
try:
    ns.read(bytearray(4096*2), (ns.info["nr_lbas"]-1)*ns.lba_size)
except OSError as e: print(repr(e), e.status)
PY
echo "PHX-PASS smoke"
