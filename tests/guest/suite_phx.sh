#!/bin/bash
# The phx.ko guest suite (issue 5): run by tests/guest/phxguest.py inside the
# guest, chrooted into the host tree.  Environment: see phxguest.py.
#
# BAR 2 of the ivshmem device (256 MiB) is laid out as:
#   0-32M io tests, validate, garbage(0-64M), lifecycle tests
#   64M-160M three concurrent registrations of 32 MiB
#   160M the first 2 MiB of the stub's sparse GPU region (nvsparse)
#   168M NVIDIA-path fillbar (the host checks 8 MiB there)
#   192M fillbar (the host checks 8 MiB there after the guest exits)
#   224M checkbar (the host seeds 8 MiB there before the guest boots)
# The NVIDIA section maps the stub's GPU VA 0x100000000000 + off onto
# BAR 2 + off, so it reuses 0-32M after the PCIBAR tests are done.
#
# Knobs (host environment): PHX_SUITE_RACE_ITERS (iterations of each race
# and of the registration race, default 100; `make test-guest-races` runs
# 1000), PHX_SUITE_NVCB_ROUNDS (callback-under-I/O rounds, default 5),
# PHX_SUITE_BIND (on a CONFIG_PCI_P2PDMA kernel, bind the ivshmem device
# to phx for the PCIBAR tests: P2PDMA pages; default 1).
#
# PHX-EXPECT: insmod ext4/io-pread ext4/io-uring xfs/io-pread xfs/io-uring
# PHX-EXPECT: fillbar checkbar validate validate-prefetch garbage rmmod-refused kill-midio
# PHX-EXPECT: fixedbuf fixedbuf-exit fork unreg splice pci-unbind concurrent python-direct
# PHX-EXPECT: libphx-devmem dm-eio
# PHX-EXPECT: nv-insmod nv-ext4/io-pread nv-ext4/io-uring nv-xfs/io-pread nv-xfs/io-uring
# PHX-EXPECT: nv/fillbar nv/fork nv/unreg nvcb nvreg nvreuse nvsparse nvfail nv/splice
# PHX-EXPECT: nv/fixedbuf nv/fixedbuf-exit nonroot
# PHX-EXPECT: race/mmap-unreg race/mmap-free race/munmap-free race/fork-free race/unreg-free
# PHX-EXPECT: race/munmap-unreg race/fork-unreg race/unreg-rereg
# PHX-EXPECT: nv-rmmod-refused nv-rmmod-after-free nv-rmmod nvapi-cap nvapi-none nv-gpl rmmod
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
# On a P2PDMA kernel the ivshmem device is bound to phx (one P2PDMA
# publication of its BAR for as long as it is bound).
P2P=0
P2PMEM=/sys/bus/pci/devices/$B/p2pmem
if [ "$(( $($T info | sed -n 's/.* flags \(0x[0-9a-f]*\|[0-9]*\) .*/\1/p') & 2 ))" != 0 ] &&
	[ "${PHX_SUITE_BIND:-1}" = 1 ]; then
	echo phx >/sys/bus/pci/devices/$B/driver_override
	echo "$B" >/sys/bus/pci/drivers_probe
	if [ "$(basename "$(readlink /sys/bus/pci/devices/$B/driver)")" = phx ]; then
		P2P=1
		echo "p2pdma: $B bound to phx: $(cat /sys/bus/pci/devices/$B/p2pmem/size 2>/dev/null) bytes published"
	else
		fail "p2pdma-bind: $B did not bind to phx"
	fi
fi

# PHX_SUITE_ONLY=nv (host environment) runs only the NVIDIA section (quick
# checks; the PHX-EXPECT list then reports the rest missing).
if [ "${PHX_SUITE_ONLY:-}" != nv ]; then
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
# BAR 0 of ivshmem is registers: refused for not being prefetchable
if dmesg | grep -q "BAR 0 is not prefetchable"; then
	pass validate-prefetch "non-prefetchable BAR refused"
else
	fail "validate-prefetch: no refusal of the register BAR in dmesg"
fi
# PHX_SUITE_GARBAGE_SEEDS="1 2 3" on the host runs more rounds (default: seed 1)
SEEDS=${PHX_SUITE_GARBAGE_SEEDS:-1}
for seed in ${SEEDS//,/ }; do
	$T garbage "$B" 2 10000 "$seed"
done

# --- rmmod refused while a mapping exists ---
$T hold "$B" 2 0 $((16 * M)) >/tmp/hold.log &
HP=$!
for _ in $(seq 100); do grep -q PHX-HOLDING /tmp/hold.log && break; sleep 0.1; done
if [ $P2P = 1 ] && [ ! -d $P2PMEM ]; then
	fail "p2pdma-state: no $P2PMEM while the device is bound to phx"
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

# --- a page held by a pipe past the unregister; rmmod meanwhile ---
timeout 120 $T splice "$B" 0 $((16 * M)) rmmod || fail "splice: exit $?"
lsmod | grep -q '^phx ' || { fail "splice: phx was unloaded"; insmod "$PHX_KO"; }

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

# --- I/O errors from device-mapper (flakey, error) never become data: the
# stream path on the fake libcuda, and LMCache's GDS backend (issue 22) ---
if [ -e /dev/mapper/control ] && command -v dmsetup >/dev/null; then
	run_pytest dm-eio "$PHX_REPO/tests/guest/test_guest_dm.py"
else
	fail "dm-eio: no device-mapper in the guest ($(ls /dev/mapper 2>&1)) or no dmsetup"
fi

fi # PHX_SUITE_ONLY

# --- unbinding a phx-bound device under a live registration, and while
# registrations are torn down; rebinding after (P2PDMA kernels) ---
bind_phx() {
	echo phx >/sys/bus/pci/devices/$B/driver_override
	echo "$B" >/sys/bus/pci/drivers_probe
	[ "$(basename "$(readlink /sys/bus/pci/devices/$B/driver)")" = phx ]
}
unbind_phx() {	# prints the seconds it took; fails past 60 s
	local t0=$(date +%s)
	timeout 60 bash -c "echo $B >/sys/bus/pci/drivers/phx/unbind" || return 1
	echo $(( $(date +%s) - t0 ))
}
if [ $P2P = 1 ]; then
	ok=1
	mountpoint -q $MNT || mkfs_mount ext4
	$T hold "$B" 2 0 $((16 * M)) >/tmp/uhold.log &
	HP=$!
	for _ in $(seq 100); do grep -q PHX-HOLDING /tmp/uhold.log && break; sleep 0.1; done
	s1=$(unbind_phx) || { ok=0; fail "pci-unbind: unbind with a live registration hung"; }
	wait_regs0 || { ok=0; fail "pci-unbind: the holder's registration survived the unbind"; }
	kill -9 $HP; wait $HP 2>/dev/null
	bind_phx || { ok=0; fail "pci-unbind: rebinding failed"; }
	$T busyio "$B" 2 0 $((32 * M)) $MNT >/tmp/ubusy.log &
	BP=$!
	for _ in $(seq 200); do grep -q PHX-BUSY /tmp/ubusy.log && break; sleep 0.1; done
	sleep 1
	kill -9 $BP
	s2=$(unbind_phx) || { ok=0; fail "pci-unbind: unbind during a teardown hung"; }
	wait $BP 2>/dev/null
	wait_regs0 || { ok=0; fail "pci-unbind: registrations left after the unbind"; }
	bind_phx || { ok=0; fail "pci-unbind: rebinding after the teardown failed"; }
	$T fork "$B" 2 0 $((16 * M)) >/tmp/ufork.log || { ok=0; fail "pci-unbind: no registration after rebinding"; }
	[ $ok = 1 ] && pass pci-unbind "live registration revoked by unbind (${s1} s), unbind during a teardown (${s2} s), rebound twice, registering works"
else
	pass pci-unbind "not run: no device bound to phx (this kernel has no CONFIG_PCI_P2PDMA)"
fi

# --- the NVIDIA provider: phx_nv.ko built against the stub's Module.symvers ---
if [ $P2P = 1 ]; then
	# the stub lends the same BAR: GENERIC pages, not phx's P2PDMA ones
	echo "$B" >/sys/bus/pci/drivers/phx/unbind
	echo >/sys/bus/pci/devices/$B/driver_override
	[ -d $P2PMEM ] && fail "p2pdma-state: $P2PMEM still there after unbinding"
fi
mountpoint -q /sys/kernel/debug || mount -t debugfs none /sys/kernel/debug
NV=nv:0x100000000000
ITERS=${PHX_SUITE_RACE_ITERS:-100}
STATS=/sys/kernel/debug/nv_p2p_stub/stats
if insmod "$PHX_STUB_KO" && insmod "$PHX_NV_KO"; then
	pass nv-insmod "phx_nv depends on: $(modinfo -F depends "$PHX_NV_KO"); $($T info)"
else
	fail "nv-insmod: the stub or phx_nv.ko did not load"
fi
for fs in ext4 xfs; do
	mkfs_mount $fs || { fail "nv-$fs/setup: mkfs/mount failed"; continue; }
	for eng in pread uring; do
		$T io $NV 2 0 $((32 * M)) $MNT $eng | prefix nv-$fs
	done
done
mkfs_mount ext4
# the host checks this memory after the guest: the stub must not poison it
echo 0 >/sys/kernel/debug/nv_p2p_stub/poison
$T fillbar $NV 2 $((168 * M)) $((8 * M)) $MNT 0 $((8 * M)) 999 | prefix nv
echo 1 >/sys/kernel/debug/nv_p2p_stub/poison
$T fork $NV 2 0 $((16 * M)) | prefix nv
$T unreg $NV 2 0 $((32 * M)) $MNT | prefix nv
t0=$(date +%s)
$T nvcb $NV 0 $((16 * M)) $MNT "${PHX_SUITE_NVCB_ROUNDS:-5}"
$T nvreg $NV "$ITERS"
$T nvreuse $NV 0 $((8 * M)) $MNT
$T nvsparse 0x200000000000 $((18 << 30)) $MNT
$T nvfail $NV $MNT
timeout 120 $T splice $NV 0 $((4 * M)) || fail "nv/splice: exit $?"
# a long-term pin (io_uring fixed buffer) of pinned GPU memory, exit with it
timeout 60 $T fixedbuf $NV 2 0 $((16 * M)) $MNT >/tmp/nvfixed.log 2>&1
rc=$?
prefix nv </tmp/nvfixed.log
if [ $rc = 0 ]; then
	if wait_regs0 && grep -q '^tables 0 ' $STATS; then
		pass nv/fixedbuf-exit "exit did not hang; memory back to the driver after the ring"
	else
		fail "nv/fixedbuf-exit: left: $($T info); $(cat $STATS)"
	fi
else
	fail "nv/fixedbuf-exit: the process failed or hung"
fi
# as a non-root member of /dev/phx's group ("phx", gid 4242 here)
chgrp 4242 /dev/phx
$T nonroot $NV 1000 4242
chgrp 0 /dev/phx
echo "PHX-INFO nv tests: $(( $(date +%s) - t0 )) s"
for kind in mmap-unreg mmap-free munmap-free fork-free unreg-free munmap-unreg fork-unreg \
	unreg-rereg; do
	t0=$(date +%s)
	$T race $NV $kind "$ITERS" 1
	echo "PHX-INFO race/$kind: $ITERS iterations in $(( $(date +%s) - t0 )) s"
done
cat $STATS

# rmmod with users: a process holding an NVIDIA mapping (fd closed)
$T hold $NV 2 0 $((16 * M)) >/tmp/nvhold.log &
HP=$!
for _ in $(seq 100); do grep -q PHX-HOLDING /tmp/nvhold.log && break; sleep 0.1; done
e1=$(rmmod phx_nv 2>&1) && fail "nv-rmmod-refused: rmmod phx_nv succeeded with a live registration"
e2=$(rmmod nv_p2p_stub 2>&1) && fail "nv-rmmod-refused: rmmod nv_p2p_stub succeeded under phx_nv"
e3=$(rmmod phx 2>&1) && fail "nv-rmmod-refused: rmmod phx succeeded with users"
if lsmod | grep -q '^phx_nv ' && lsmod | grep -q '^nv_p2p_stub '; then
	pass nv-rmmod-refused "$e1 / $e2 / $e3"
fi
# the application frees the memory under the holder: the registration
# keeps it (persistent), so phx_nv stays in use until the holder goes
echo 0 >/sys/kernel/debug/nv_p2p_stub/free_now
sleep 0.5
if [ "$(info_regs)" = 1 ] && ! rmmod phx_nv 2>/dev/null && kill -0 $HP; then
	kill -9 $HP
	wait $HP 2>/dev/null
	if wait_regs0 && rmmod phx_nv; then
		pass nv-rmmod-after-free "cudaFree kept the holder's registration; phx_nv unloaded once it went"
	else
		fail "nv-rmmod-after-free: phx_nv did not unload after the holder went: $($T info)"
	fi
else
	fail "nv-rmmod-after-free: cudaFree revoked the holder's registration: $($T info)"
	kill -9 $HP
	wait $HP 2>/dev/null
	rmmod phx_nv
fi
cat $STATS
if wait_regs0 && grep -q '^tables 0 .* client_bugs 0 poison_bad 0 slow_cb 0' $STATS &&
	rmmod nv_p2p_stub; then
	pass nv-rmmod "stub clean and unloaded"
else
	fail "nv-rmmod: $(cat $STATS 2>/dev/null); $($T info)"
fi

# the driver's older APIs: R515-R530 (persistent pages through get_pages
# without a callback) works, a driver without persistent pages is refused
for v in cap none; do
	ko=PHX_STUB_${v^^}_KO
	if insmod "${!ko}" && insmod "$PHX_NV_KO"; then
		$T nvapi $NV $v
		rmmod phx_nv
	else
		fail "nvapi-$v: the $v stub or phx_nv.ko did not load"
	fi
	rmmod nv_p2p_stub
done

# next to a proprietary driver the kernel must refuse phx_nv.ko (phx's
# provider interface is GPL-only).  Last: the proprietary module taints
# the kernel, which turns lockdep off.
if insmod "$PHX_STUB_NVIDIA_KO"; then
	if insmod "$PHX_NV_KO" 2>/tmp/gpl.err; then
		fail "nv-gpl: phx_nv.ko loaded next to a proprietary NVIDIA driver"
		rmmod phx_nv
	else
		pass nv-gpl "refused: $(head -1 /tmp/gpl.err); $(dmesg | grep -E 'GPL|Unknown symbol' | tail -1)"
	fi
	rmmod nv_p2p_stub
else
	fail "nv-gpl: the proprietary stub did not load"
fi

umount $MNT
$T info
if wait_regs0 && rmmod phx; then pass rmmod; else fail rmmod "$($T info)"; fi
exit 0
