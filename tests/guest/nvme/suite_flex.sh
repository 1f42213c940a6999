#!/bin/bash
# FlexLLMGen with Group 2 of the KV cache on an NVMe namespace (issue 26, part
# 6), run by tests/guest/nvme/run_guest.py inside the guest (make
# test-guest-flex): one controller (4 KiB LBAs, MDTS 3, discard=unmap), torch
# and flexgen from the host's .venv over 9p.  Minutes: torch under TCG is slow.
#
# PHX-EXPECT: flex-devices flex-pytest
set -u
export PYTHONDONTWRITEBYTECODE=1
pass() { echo "PHX-PASS $*"; }
fail() { echo "PHX-FAIL $*"; }

echo "suite: kernel $(uname -r), nvme: $PHX_NVME"
n=$(ls /dev/ng*n1 2>/dev/null | wc -l)
if [ "$n" -ge 1 ]; then pass flex-devices "$(ls /dev/ng*n1)"; else fail flex-devices "no /dev/ng*n1"; exit 1; fi
grep -o 'phx.nvme_discard=[a-z]*' /proc/cmdline || echo "drive without discard=unmap"
# torch's CPU kernels need AVX2 at most: QEMU's TCG 'max' CPU has it (7.2+)
grep -m1 -o -w 'avx2' /proc/cpuinfo || echo "no avx2 in the guest CPU"

PY="$PHX_REPO/.venv/bin/python"
cd /tmp
start=$(date +%s)
timeout 1500 "$PY" -m pytest -v -s -p no:cacheprovider --rootdir="$PHX_REPO" \
	"$PHX_REPO/tests/guest/nvme/test_flexllmgen_nvme.py" >/tmp/pytest.log 2>&1
rc=$?
tail -60 /tmp/pytest.log
summary=$(grep -E '^=+ .*(passed|failed|error).* =+$' /tmp/pytest.log | tail -1 | tr -d '=')
echo "PHX-INFO flex: pytest took $(( $(date +%s) - start )) s in the guest"
if [ "$rc" = 0 ]; then pass flex-pytest "$summary"; else fail flex-pytest "pytest rc=$rc:$summary"; fi
exit 0
