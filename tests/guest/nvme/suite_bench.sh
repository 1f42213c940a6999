#!/bin/bash
# phx bench nvme in the guest (make bench-guest-nvme): one 1 GiB namespace,
# 4 KiB LBAs, MDTS 7; 512 MiB region, 2 s per figure.  The table and the
# JSON (printed between PHX-JSON-BEGIN/END) go into docs/nvme.md.
#
# PHX-EXPECT: nvme-bench
set -u
export PYTHONDONTWRITEBYTECODE=1
PY="$PHX_REPO/.venv/bin/python"
ng=$(ls /dev/ng*n1 | head -1)
cd /tmp
if "$PY" -m phx bench nvme --device "$ng" --size 512m --seconds ${PHX_BENCH_SECONDS:-2} \
	--json /tmp/bench-nvme.json; then
	echo PHX-JSON-BEGIN
	cat /tmp/bench-nvme.json
	echo PHX-JSON-END
	echo "PHX-PASS nvme-bench"
else
	echo "PHX-FAIL nvme-bench"
fi
