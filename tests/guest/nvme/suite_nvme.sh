#!/bin/bash
# The NVMe-direct guest suite (issue 6): run by tests/guest/nvme/run_guest.py
# (tests/guest/phxguest.py with discard=unmap on the NVMe drives) inside the
# guest, chrooted into the host tree.  Controllers (see nvme.mk): serials
# phx0000 (4 KiB LBAs, MDTS 3), phx0001 (512 B, MDTS 2), phx0002 (4 KiB,
# MDTS 5, 512 MiB; reformatted, partitioned and finally hot-removed by the tests).
#
# PHX-EXPECT: nvme-devices nvme-pytest nvme-bench-smoke
set -u
export PYTHONDONTWRITEBYTECODE=1
pass() { echo "PHX-PASS $*"; }
fail() { echo "PHX-FAIL $*"; }

echo "suite: kernel $(uname -r), nvme: $PHX_NVME"
ls -l /dev/ng* 2>&1
n=$(ls /dev/ng*n1 2>/dev/null | wc -l)
if [ "$n" -ge 3 ]; then pass nvme-devices "$n namespaces"; else fail nvme-devices "$n of 3"; exit 1; fi

PY="$PHX_REPO/.venv/bin/python"
if ! "$PY" -c 'import pytest, phx.nvme' 2>/tmp/imp.err; then
	fail nvme-pytest "cannot import pytest/phx.nvme with $PY: $(tail -1 /tmp/imp.err)"
	exit 1
fi
# run_guest.py adds discard=unmap to the drives and says so on the kernel command line
grep -o 'phx.nvme_discard=[a-z]*' /proc/cmdline || echo "drives without discard=unmap"

# a short benchmark run first (phx0002 is still there and clean)
ng2=$("$PY" -c 'import phx.nvme as n; print([p for p in n._generic_devices() if n.identify(p)["serial"]=="phx0002"][0])')
if timeout 300 "$PY" -m phx bench nvme --device "$ng2" --force --size 16m --seconds 0.3 \
	--json /tmp/bench-nvme.json >/tmp/bench.log 2>&1; then
	cat /tmp/bench.log
	pass nvme-bench-smoke
else
	cat /tmp/bench.log
	fail nvme-bench-smoke
fi

cd /tmp
timeout 900 "$PY" -m pytest -v -s -p no:cacheprovider --rootdir="$PHX_REPO" \
	"$PHX_REPO/tests/guest/nvme/test_nvme_guest.py" >/tmp/pytest.log 2>&1
rc=$?
tail -200 /tmp/pytest.log
summary=$(grep -E '^=+ .*(passed|failed|error).* =+$' /tmp/pytest.log | tail -1 | tr -d '=')
if [ "$rc" = 0 ]; then pass nvme-pytest "$summary"; else fail nvme-pytest "pytest rc=$rc:$summary"; fi
exit 0
