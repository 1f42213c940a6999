#!/bin/bash
# tools/loader_gpu_run.sh - phx.loader on the H200 box in one call of the
# device tool (about 6 minutes): build phx, run the loader's GPU tests, then
# `phx bench load` on zram and on the disk.  Logs and JSON go to $OUT.
#
#   tools/loader_gpu_run.sh                 build tests bench  (SIZE=8G REPEAT=1)
#   tools/loader_gpu_run.sh STEP...         any of: build tests bench (setup always runs)
#   SIZE=4G REPEAT=2 tools/loader_gpu_run.sh    a smaller checkpoint, two repeats
#   LOADER_TESTS="tests/..." LOADER_BENCH_ARGS=--no-disk   other tests; more bench options
#
# Carried (git-ignored): .devcarry/deb (Debian's liburing-dev and liburing2
# .debs: the box has no liburing headers) and .whl-loader (fastsafetensors
# 0.5.0 for cp312, 2.7 MB: `pip download --no-deps --only-binary=:all:
# --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64
# -d .whl-loader fastsafetensors==0.5.0`; its one dependency, typer, and
# safetensors 0.8 are already in the box's Python).  Runs as root there.
set -uo pipefail
OUT=${OUT:-/tmp/phx-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
TESTDIR=/var/tmp/phxtest
BENCHDIR=/var/tmp/phxbench
mkdir -p $TESTDIR $BENCHDIR
LOG=$OUT/loader.log
WHEELS=${WHEELS:-.whl-loader}	# (another folder only to try the script elsewhere)
SIZE=${SIZE:-8G}
REPEAT=${REPEAT:-1}
BUDGET=${BUDGET:-560}	# seconds for all steps (one call may run 600)
log() { echo "== $(date +%T) $*" | tee -a "$LOG"; }
left() { echo $((BUDGET - SECONDS)); }

setup() {
	log setup
	mkdir -p /tmp/uring
	for d in .devcarry/deb/*.deb; do dpkg-deb -x "$d" /tmp/uring; done
	python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site \
		"$WHEELS"/*.whl >>"$LOG" 2>&1 || { tail -20 "$LOG"; return 1; }
	export PHX_LIBURING_ROOT=/tmp/uring
	export PYTHONPATH=/tmp/phx:/tmp/site
}

build() {
	log build
	python3 -m pip install -q --no-build-isolation --no-deps --no-compile --target /tmp/phx \
		-C cmake.define.PHX_LIBURING_ROOT=/tmp/uring . >/tmp/build.log 2>&1 ||
		{ tail -60 /tmp/build.log | tee -a "$LOG"; return 1; }
	python3 -c "import phx, phx.gpu, phx.loader, phx_fastsafetensors, fastsafetensors, safetensors
print(phx.__file__, phx.gpu.is_available(), 'fastsafetensors', fastsafetensors.__version__,
      'safetensors', safetensors.__version__)" 2>&1 | tee -a "$LOG"
	nvidia-smi --query-gpu=name,driver_version,memory.used --format=csv 2>&1 | tee -a "$LOG" || true
}

tests() {
	local t
	t=$(left)
	t=$((t > 300 ? 180 : t / 3))
	log "tests ($t s)"
	PHX_TEST_DIR=$TESTDIR timeout -s INT -k 20 $t python3 -m pytest -q -ra -p no:cacheprovider \
		${LOADER_TESTS:-tests/test_loader_gpu.py tests/test_loader.py tests/test_loader_fake.py \
		tests/test_fastsafetensors.py} 2>&1 | tee -a "$LOG" | tail -40
}

bench() {
	local t
	t=$(($(left) - 10))
	[ $t -gt 60 ] || { log "bench skipped: $t s left"; return 0; }
	log "bench load ($t s left): size $SIZE, repeat $REPEAT, disk and zram"
	free -g | tee -a "$LOG"
	timeout -s INT -k 20 $t python3 -m phx bench load --size "$SIZE" --repeat "$REPEAT" --dir $BENCHDIR \
		--raw-threads 16,64 \
		--zram "$(python3 -c "
from phx.bench._common import parse_size
print(int(parse_size('$SIZE') * 1.1) + (512 << 20))")" \
		--quiet --json "$OUT/load.json" ${LOADER_BENCH_ARGS:-} 2>&1 | tee -a "$LOG" | tail -30
	rm -rf $BENCHDIR/phx-bench-load
}

[ $# -gt 0 ] || set -- build tests bench
setup || exit 1
rc=0
for s in "$@"; do
	case $s in
	build) build || { rc=1; break; } ;;
	tests) tests || rc=1 ;;
	bench) bench || rc=1 ;;
	*) echo "unknown step $s" | tee -a "$LOG"; exit 2 ;;
	esac
done
log "done (rc $rc, $SECONDS s)"
exit $rc
