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
. "$(dirname "$0")/gpu_common.sh" || exit 1
gpu_begin loader.log "$BENCHDIR"
WHEELS=${WHEELS:-.whl-loader}	# (another folder only to try the script elsewhere)
SIZE=${SIZE:-8G}
REPEAT=${REPEAT:-1}
BUDGET=${BUDGET:-560}	# seconds for all steps (one call may run 600)

setup() {
	log setup
	unpack_liburing
	install_wheels /tmp/site "$WHEELS"/*.whl || return 1
	use_phx_target /tmp/site
}

build() {
	log build
	build_phx "$PHX_TARGET" || return 1
	python3 -c "import phx, phx.gpu, phx.loader, phx_fastsafetensors, fastsafetensors, safetensors
print(phx.__file__, phx.gpu.is_available(), 'fastsafetensors', fastsafetensors.__version__,
      'safetensors', safetensors.__version__)" 2>&1 | tee -a "$LOG"
	show_gpus || true
}

tests() {
	local t
	t=$(time_left)
	t=$((t > 300 ? 180 : t / 3))
	log "tests ($t s)"
	PHX_TEST_DIR=$TESTDIR timeout -s INT -k 20 $t python3 -m pytest -q -ra -p no:cacheprovider \
		${LOADER_TESTS:-tests/test_loader_gpu.py tests/test_loader.py tests/test_loader_fake.py \
		tests/test_fastsafetensors.py} 2>&1 | tee -a "$LOG" | tail -40
}

bench() {
	local t
	t=$(($(time_left) - 10))
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
