# tools/gpu_common.sh - the set-up that the H200 run scripts share
# (tools/gpu_run.sh, lmcache_gpu_run.sh, flex_gpu_run.sh, loader_gpu_run.sh).
# Each of them runs on the GPU box in ONE call of the device tool, from the
# repository root, with $OUT a folder whose files come back.  The box has no
# internet, no apt and no liburing headers: everything phx needs to build and
# run there is carried in git-ignored folders (.devcarry/deb: Debian's
# liburing-dev and liburing2 .debs; .devcarry/whl, .whl-*: wheels;
# .devcarry/bin: a static fio, the yardstick the box lacks, built from
# Debian's fio 3.33 source with `./configure --build-static` and the optional
# engines off - found on PATH once gpu_begin ran).
#
# Sourced, never run:  . "$(dirname "$0")/gpu_common.sh"
# It only defines names; nothing happens until a script calls gpu_begin.
#
#   gpu_begin [--elapsed] LOGFILE [DIR...]
#                          the start of every run: strict shell, $OUT, $LOG, the
#                          scratch folders; --elapsed adds "(+N s)" to log lines
#   log MSG...             a timestamped "== HH:MM:SS MSG" line, on stdout and in $LOG
#   time_left              seconds of $BUDGET not yet used by this script
#   unpack_liburing        the carried liburing .debs into $URING_ROOT
#   install_wheels DIR WHEEL...
#                          carried wheels into DIR, offline (pip --target)
#   use_phx_target SITE    the environment that finds phx in $PHX_TARGET and SITE
#   build_phx [TARGET]     pip install of this tree, into TARGET or the box's Python
#   show_phx               which phx was imported and whether phx.gpu can work
#   show_gpus              nvidia-smi's view of the GPUs
#
# Every function returns the status of what it ran, so a script decides what
# a failure stops (a failed build ends each script; a missing nvidia-smi ends
# some of them, as it did before these helpers existed).

URING_ROOT=/tmp/uring		# the unpacked liburing-dev: headers and liburing.a
PHX_TARGET=/tmp/phx		# where `build_phx $PHX_TARGET` puts phx (pip --target)
PHX_BUILD_LOG=/tmp/build.log	# pip's whole build output; only its tail goes to $LOG
TESTDIR=/var/tmp/phxtest	# PHX_TEST_DIR for the pytest steps: the real disk
BENCHDIR=/var/tmp/phxbench	# the benchmarks' files on the real disk
GPU_LOG_ELAPSED=		# set by gpu_begin --elapsed

# gpu_begin [--elapsed] LOGFILE [DIR...]: what each script did first, in one
# place.  Unset variables and failures inside pipelines count as errors (set
# -u, pipefail; not -e: a failed step must not hide the steps after it); $OUT
# defaults to /tmp/phx-out; Python output is unbuffered so that a step cut by
# `timeout` still leaves its lines in the log; $LOG is $OUT/LOGFILE; $TESTDIR
# and the DIRs are created.  --elapsed: log lines also say the seconds since
# the script started (scripts that share a time budget between steps).
gpu_begin() {
	if [ "${1:-}" = --elapsed ]; then
		GPU_LOG_ELAPSED=1
		shift
	fi
	set -uo pipefail
	OUT=${OUT:-/tmp/phx-out}
	mkdir -p "$OUT"
	export PYTHONUNBUFFERED=1
	[ ! -x .devcarry/bin/fio ] || export PATH=$PWD/.devcarry/bin:$PATH
	LOG=$OUT/$1
	shift
	mkdir -p "$TESTDIR" "$@"
}

# log MSG...: one "== HH:MM:SS MSG" line (with --elapsed "== HH:MM:SS (+N s)
# MSG"), printed and appended to $LOG, so that the log that comes back says
# when each step began.
log() {
	local stamp
	stamp=$(date +%T)
	[ -z "$GPU_LOG_ELAPSED" ] || stamp="$stamp (+$SECONDS s)"
	echo "== $stamp $*" | tee -a "$LOG"
}

# time_left: $BUDGET (seconds the script may take in all, set by the script)
# less the seconds since it started.  One device call may run 600 s, and a
# step cut by the call's limit loses everything it had not yet written to
# $OUT, so steps size their `timeout` from this.
time_left() {
	echo $((BUDGET - SECONDS))
}

# unpack_liburing: Debian's liburing-dev and liburing2 (.devcarry/deb) into
# $URING_ROOT with dpkg-deb -x (no dpkg database, no install).  The box has
# no liburing headers; CMake finds them there through PHX_LIBURING_ROOT.  A
# .deb that does not unpack is not an error here: the build that needs it
# fails and says what is missing.
unpack_liburing() {
	local deb
	mkdir -p "$URING_ROOT"
	for deb in .devcarry/deb/*.deb; do
		dpkg-deb -x "$deb" "$URING_ROOT"
	done
}

# install_wheels DIR WHEEL...: carried wheels into DIR without the index
# (there is no network), without dependencies (what the box's Python already
# has must not be replaced) and without byte-compiling (time).  pip's output
# goes to $LOG; on failure its last 20 lines are also printed.
install_wheels() {
	local dir=$1
	shift
	python3 -m pip install -q --no-index --no-deps --no-compile --target "$dir" \
		"$@" >>"$LOG" 2>&1 || { tail -20 "$LOG"; return 1; }
}

# use_phx_target SITE: the environment for a phx built with
# `build_phx $PHX_TARGET`: Python finds phx there and the carried packages in
# SITE; PHX_LIBURING_ROOT tells the tests that compile C (the fake libcuda)
# where the liburing headers are.
use_phx_target() {
	export PHX_LIBURING_ROOT=$URING_ROOT
	export PYTHONPATH=$PHX_TARGET:$1
}

# build_phx [TARGET]: pip install of this tree, the way a user builds it, but
# with no build isolation (an isolated build would download its build tools:
# no network) and liburing from $URING_ROOT.  With TARGET, into that folder
# (pip --target, found through PYTHONPATH); without, into the box's Python
# (its site-packages, where the .pth import hooks of the adapters work).  The
# whole output goes to $PHX_BUILD_LOG; on failure its last 60 lines go to $LOG.
build_phx() {
	python3 -m pip install -q --no-build-isolation --no-deps --no-compile ${1:+--target "$1"} \
		-C cmake.define.PHX_LIBURING_ROOT="$URING_ROOT" . >"$PHX_BUILD_LOG" 2>&1 ||
		{ tail -60 "$PHX_BUILD_LOG" | tee -a "$LOG"; return 1; }
}

# show_phx: the phx that Python imports now and phx.gpu.is_available() (with
# its reason), into $LOG: the log then says which build ran and why the GPU
# path could not work if it could not.
show_phx() {
	python3 -c "import phx, phx.gpu; print(phx.__file__, phx.gpu.is_available())" 2>&1 | tee -a "$LOG"
}

# show_gpus: name, driver and memory in use of each GPU, into $LOG (another
# process holding GPU memory changes what a benchmark measures).  Returns
# nvidia-smi's status.
show_gpus() {
	nvidia-smi --query-gpu=name,driver_version,memory.used --format=csv 2>&1 | tee -a "$LOG"
}
