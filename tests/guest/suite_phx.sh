#!/bin/bash
# The phx.ko guest suite (issue 5): run by tests/guest/phxguest.py inside the
# guest, chrooted into the host tree.  Environment: see phxguest.py.
#
# BAR 2 of the ivshmem device (256 MiB) is laid out as:
#   0-32M io tests, validate, garbage(0-64M), lifecycle tests
#   64M-160M three concurrent registrations of 32 MiB
#   192M fillbar (the host checks 8 MiB there after the guest exits)
#   224M checkbar (the host seeds 8 MiB there before the guest boots)
#
# PHX-EXPECT: insmod ext4/io-pread ext4/io-uring xfs/io-pread xfs/io-uring
# PHX-EXPECT: fillbar checkbar validate garbage rmmod-refused kill-midio
# PHX-EXPECT: fixedbuf fixedbuf-exit fork unreg concurrent python-direct libphx-devmem rmmod
# PHX-HOSTFILL: 234881024 8388608 4242
set -u
export PYTHONDONTWRITEBYTECODE=1
T=$PHX_BIN/phx_io_test
B=$PHX_IVSHMEM_BDF
M=$((1 << 20))
read -r DEV _ <<<"$PHX_NVME"
MNT=/tmp/mnt
mkdir -p $MNT

pass() { echo "PHX-PASS $*"; }
fail() { echo "PHX-FAIL $*"; }
prefix() { sed -u "s|^PHX-PASS |PHX-PASS $1/|; s|^PHX-FAIL |PHX-FAIL $1/|"; }
info_regs() { $T info | sed -n 's/.* regs \([0-9]*\) busy.*/\1/p'; }
wait_regs0() {
	for _ in $(seq 100); do [ "$(info_regs)" = 0 ] && return 0; sleep 0.1; done
	return 1
}
# run_pytest NAME FILE: PASS only if pytest exits 0 having run and passed at
# least one test and skipped none (everything these files need is here: a
# skip in the guest means a test did not run, which is not a pass).
run_pytest() {
	local name=$1 file=$2 log=/tmp/pytest-$1.log rc summary passed skipped
	PHX_GUEST_DIR=$MNT "$PY" -m pytest -q -rs -p no:cacheprovider "$file" >"$log" 2>&1
	rc=$?
	tail -15 "$log"
	summary=$(grep -E '(passed|failed|skipped|error|errors|no tests ran).* in [0-9.]+s' "$log" |
		tail -1 | tr -d '=' | sed 's/^ *//; s/ *$//')
	passed=$(grep -oE '[0-9]+ passed' <<<"$summary" | grep -oE '[0-9]+')
	skipped=$(grep -oE '[0-9]+ skipped' <<<"$summary" | grep -oE '[0-9]+')
	if [ "$rc" = 0 ] && [ "${passed:-0}" -gt 0 ] && [ "${skipped:-0}" = 0 ]; then
		pass "$name" "$summary"
	else
		fail "$name: $file: pytest rc=$rc, ${summary:-no summary line} (all must run and pass)"
	fi
}
mkfs_mount() {
	umount $MNT 2>/dev/null
	case $1 in
	ext4) mkfs.ext4 -q -F $DEV ;;
	xfs) mkfs.xfs -q -f $DEV ;;
	esac && mount -t "$1" $DEV $MNT
}

echo "suite: kernel $(uname -r) ($PHX_KERNEL), ivshmem $B, nvme $DEV"
if [ -z "$B" ] || [ -z "$DEV" ]; then
	fail "setup: no ivshmem ($B) or nvme ($DEV) in the guest"
	exit 1
fi
if insmod "$PHX_KO" && [ -c /dev/phx ]; then
	pass insmod "$(ls -l /dev/phx)"
else
	fail insmod "insmod $PHX_KO failed"
	exit 1
fi
$T info

# --- O_DIRECT SSD <-> BAR, byte-checked in the guest, on ext4 and xfs ---
for fs in ext4 xfs; do
	if ! mkfs_mount $fs; then
		fail "$fs/setup: mkfs/mount failed"
		continue
	fi
	for eng in pread uring; do
		$T io "$B" 2 0 $((32 * M)) $MNT $eng | prefix $fs
	done
done

# --- the host checks: BAR -> file -> host, and host -> BAR -> file ---
mkfs_mount ext4
$T checkbar "$B" 2 $((224 * M)) $((16 * M)) $MNT 0 $((8 * M)) 4242
$T fillbar "$B" 2 $((192 * M)) $((16 * M)) $MNT 0 $((8 * M)) 777

# --- arguments, garbage ---
$T validate "$B" 2
# PHX_SUITE_GARBAGE_SEEDS="1 2 3" on the host runs more rounds (default: seed 1)
SEEDS=${PHX_SUITE_GARBAGE_SEEDS:-1}
for seed in ${SEEDS//,/ }; do
	$T garbage "$B" 2 10000 "$seed"
done

# --- rmmod refused while a mapping exists ---
$T hold "$B" 2 0 $((16 * M)) >/tmp/hold.log &
HP=$!
for _ in $(seq 100); do grep -q PHX-HOLDING /tmp/hold.log && break; sleep 0.1; done
P2PMEM=/sys/bus/pci/devices/$B/p2pmem
if [ "$PHX_KERNEL" = p2pdma ]; then
	# upstream P2PDMA state exists on the device while phx has a registration
	if [ -d $P2PMEM ]; then
		echo "p2pdma: $P2PMEM present while registered: $(cat $P2PMEM/size 2>/dev/null) bytes"
	else
		fail "p2pdma-state: no $P2PMEM while a registration is live"
	fi
fi
if rmmod phx 2>/tmp/rmmod.err; then
	fail "rmmod-refused: rmmod succeeded with a live mapping"
	insmod "$PHX_KO"
else
	pass rmmod-refused "$(head -1 /tmp/rmmod.err)"
fi
kill -9 $HP
wait $HP 2>/dev/null
if ! wait_regs0; then
	fail "rmmod-refused: the holder was killed but registrations are left: $($T info)"
fi
if [ "$PHX_KERNEL" = p2pdma ] && [ -d $P2PMEM ]; then
	fail "p2pdma-state: $P2PMEM still there after the last registration went"
fi

# --- a process killed in the middle of I/O leaves nothing behind ---
$T busyio "$B" 2 0 $((32 * M)) $MNT >/tmp/busy.log &
BP=$!
for _ in $(seq 200); do grep -q PHX-BUSY /tmp/busy.log && break; sleep 0.1; done
sleep 2
kill -9 $BP
wait $BP 2>/dev/null
if ! wait_regs0; then
	fail "kill-midio: registrations left: $($T info)"
elif ! rmmod phx; then
	fail "kill-midio: rmmod failed after the kill"
elif ! insmod "$PHX_KO"; then
	fail "kill-midio: insmod again failed"
else
	pass kill-midio "nothing left; rmmod and insmod worked"
fi

# --- exit with the mapping pinned as an io_uring fixed buffer ---
if timeout 60 $T fixedbuf "$B" 2 0 $((16 * M)) $MNT >/tmp/fixed.log 2>&1; then
	cat /tmp/fixed.log
	if wait_regs0; then
		pass fixedbuf-exit "exit did not hang; registration released after the ring"
	else
		fail "fixedbuf-exit: registration left: $($T info)"
	fi
else
	cat /tmp/fixed.log
	fail "fixedbuf-exit: the process failed or hung"
fi

# --- fork, unregister under I/O ---
$T fork "$B" 2 0 $((16 * M))
$T unreg "$B" 2 0 $((32 * M)) $MNT

# --- concurrent registrations from several processes ---
pids=()
for i in 0 1 2; do
	mkdir -p $MNT/c$i
	$T io "$B" 2 $(((64 + 32 * i) * M)) $((32 * M)) $MNT/c$i pread >/tmp/conc$i.log 2>&1 &
	pids+=($!)
done
ok=1
for i in 0 1 2; do
	wait "${pids[$i]}" || ok=0
	grep -q '^PHX-PASS io-pread' /tmp/conc$i.log || ok=0
	grep '^PHX-FAIL' /tmp/conc$i.log
done
if [ $ok = 1 ]; then pass concurrent "3 processes, disjoint ranges"; else fail concurrent; fi

# --- the Python direct path: mmap of /dev/phx + os.preadv/pwritev O_DIRECT ---
PY=python3
if [ -x "$PHX_REPO/.venv/bin/python" ] && "$PHX_REPO/.venv/bin/python" -c 'import pytest' 2>/dev/null; then
	PY="$PHX_REPO/.venv/bin/python"
	run_pytest python-direct "$PHX_REPO/tests/guest/test_guest_direct.py"
else
	# plain python3: the file runs its tests itself (exit 0 pass, 1 fail, 77 skip)
	PHX_GUEST_DIR=$MNT "$PY" "$PHX_REPO/tests/guest/test_guest_direct.py"
	rc=$?
	if [ "$rc" = 0 ]; then pass python-direct "$PY"
	elif [ "$rc" = 77 ]; then fail python-direct "$PY: the tests skipped (no /dev/phx or BAR?)"
	else fail python-direct "$PY: rc=$rc"; fi
fi

# --- libphx's engine on device memory (phx.devmem) ---
# PHX_SUITE_LIBPHX=0 on the host skips tests/guest/test_guest_libphx.py here.
if [ "${PHX_SUITE_LIBPHX:-1}" != 1 ]; then
	echo "PHX-SKIP libphx-devmem: PHX_SUITE_LIBPHX=0"
elif [ -f "$PHX_REPO/tests/guest/test_guest_libphx.py" ] &&
	"$PY" -c 'import pytest, phx.devmem' 2>/dev/null; then
	run_pytest libphx-devmem "$PHX_REPO/tests/guest/test_guest_libphx.py"
else
	echo "PHX-SKIP libphx-devmem: phx.devmem not importable with $PY (build the venv first)"
fi

umount $MNT
$T info
if wait_regs0 && rmmod phx; then pass rmmod; else fail rmmod "$($T info)"; fi
exit 0
