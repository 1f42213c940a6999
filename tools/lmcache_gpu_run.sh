#!/bin/bash
# tools/lmcache_gpu_run.sh - the LMCache adapter on the H200 box, in one call
# of the device tool: build and install phx the way a user does (pip install
# . into the box's Python, so the .pth import hook is live), install LMCache
# 0.5.6 from carried wheels, run the lmcache tests, the chunk benchmark and
# the agentic replay.  Logs and JSON go to $OUT.
#
#   tools/lmcache_gpu_run.sh small     build, all lmcache tests, short bench + replay (~4 min)
#   tools/lmcache_gpu_run.sh chunks    build, full chunk benchmark, disk and zram (~5 min)
#   tools/lmcache_gpu_run.sh replay    build, full replay on zram, short on disk (~5 min)
#   tools/lmcache_gpu_run.sh STEP...   any of: setup build tests bench-small replay-small
#                                      bench-mid bench-mid-noearly bench-full replay-mid replay-full
#                                      replay-disk replay-seed (the seed's token counts, ~6 min)
#                                      l2 (issue 28's persistent tier, zram and disk, ~4 min;
#                                      L2_ARGS: other bench options)
#                                      live (issue 23's measured concurrency, zram, ~5 min;
#                                      LIVE_ARGS: other bench options)
#                                      cufile-diag (why LMCache's cufile backend fails, ~1 min)
#                                      udev (from here on, the udev database entries cuFile
#                                      needs and this box lacks: tools/udev_db_fill.py)
#   (EXTRA_TESTS: more pytest paths for the tests step)
#
# Carried (git-ignored, in .git/info/exclude): .whl-lmcache (lmcache 0.5.6 and
# the small packages the box's venv lacks, from `adapters/lmcache/tools/
# lmcache-deps.sh download .whl-lmcache 3.12`, 27 MiB, plus
# lmcache_rust_raw_block_io 0.5.7rc2 for cp312 for the l2 step's raw_block rows) and .devcarry (deb/:
# Debian's liburing-dev + liburing2 .debs for the build; whl/: KvikIO wheels,
# used only where LMCache's cufile backend cannot start).
. "$(dirname "$0")/gpu_common.sh" || exit 1
gpu_begin lmcache.log "$BENCHDIR"
BUDGET=${LMC_BUDGET_S:-570}	# one device call may run 600 s: each bench step gets what is left of 570 s

setup() {
	log setup
	unpack_liburing
	install_wheels /tmp/lmsite .whl-lmcache/*.whl || return 1
	if ls .devcarry/whl/*.whl >/dev/null 2>&1; then
		# not needed by most runs: a failure here is logged, not fatal
		install_wheels /tmp/kvsite .devcarry/whl/*.whl
		export LD_LIBRARY_PATH=/tmp/kvsite/libkvikio/lib64:/tmp/kvsite/rapids_logger/lib64:${LD_LIBRARY_PATH:-}
	fi
	# lmcache on PYTHONPATH, the tests find it there (support.lmcache_site);
	# phx itself is installed into the box's Python (build), not PHX_TARGET
	export PYTHONPATH=/tmp/lmsite:/tmp/kvsite
	export PHX_LMCACHE_SITE=/tmp/lmsite
}

build() {
	log build: pip install . into $(python3 -c 'import sys; print(sys.prefix)')
	build_phx || return 1	# no TARGET on purpose: the .pth import hook must be live
	# what LMCache loads, found with no environment (the hook from the .pth)
	(cd /tmp && env -u LD_LIBRARY_PATH python3 -W ignore -m phx_lmcache) 2>&1 | tee -a "$LOG"
	show_gpus
}

tests() {
	log tests
	PHX_TEST_DIR=$TESTDIR timeout ${TEST_TIMEOUT:-300} python3 -m pytest -q -ra -p no:cacheprovider \
		tests/test_lmcache_gpu.py tests/test_lmcache_cpu.py tests/test_lmcache_fake.py \
		tests/test_lmcache_bench.py ${EXTRA_TESTS:-} 2>&1 | tee -a "$LOG" | tail -40
}

bench() {	# $1 name, then phx bench lmcache options
	local name=$1
	shift
	local left
	left=$(time_left)
	[ $left -gt 30 ] || { log "bench $name skipped: no time left"; return 0; }
	log "bench $name ($left s left): $*"
	PYTHONFAULTHANDLER=1 timeout $left python3 -m phx bench lmcache --dir $BENCHDIR \
		--json "$OUT/$name.json" --plot "$OUT/$name.png" "$@" 2>&1 |
		grep --line-buffered -v "GDSContext: registered" | tee -a "$LOG" | tail -60
}

# MID_METHODS: the chunk bench's methods (e.g. phx,cufile,kvikio16,kvikio64,host-odirect)
MID="--mode chunks --chunks 32 --latency-chunks 8 --repeat 3 --zram 4G ${MID_METHODS:+--methods $MID_METHODS}"

step() {
	case $1 in
	setup) setup ;;
	flood) log "flood: $(command -v gdb || echo no gdb)"
		PYTHONFAULTHANDLER=1 timeout 120 python3 tools/stream_flood.py $BENCHDIR/flood.bin \
			--ops ${FLOOD_OPS:-2000} 2>&1 | tee -a "$LOG" | tail -30 ;;
	build) build ;;
	tests) tests ;;
	bench-small) bench bench-small --mode chunks --chunks 16 --latency-chunks 8 --repeat 1 \
		--zram 4G ;;
	replay-small) bench replay-small --mode replay --no-disk --zram 8G --sessions 2 --rounds 8 \
		--token-scale 0.0625 --concurrency 1,2,4,8 ;;
	bench-mid) bench bench-mid $MID ;;
	# the same with libphx's early reads off (libphxfile has them on by default;
	# docs/gpu.md, "Early reads"): only phx's rows change
	bench-mid-noearly) PHX_CUDA_EARLY_READS=0 bench bench-mid-noearly $MID ;;
	bench-full) bench bench-full --mode chunks --chunks 128 --latency-chunks 32 --repeat 3 \
		--zram 20G ;;
	replay-full) bench replay-full --mode replay --no-disk --zram 16G --sessions 6 --rounds 30 \
		--token-scale 0.125 ;;
	replay-mid) bench replay-mid --mode replay --no-disk --zram 12G --sessions 4 --rounds 12 \
		--token-scale 0.125 --concurrency 1,2,4,8,16 ;;
	replay-disk) bench replay-disk --mode replay --sessions 2 --rounds 10 --token-scale 0.0625 \
		--concurrency 1,2,4,8 ;;
	# the seed's scale (contexts ~85K tokens by round 30, 99K at most; 93 % prefix
	# hits): 2 sessions = 22 GB of KV, ~330 GB of prefix loads per method; estimated
	# ~6 min with build (REPLAY_METHODS: which, in order: the slowest last, as a
	# method cut off by the time limit leaves only its log line)
	replay-seed) bench replay-seed --mode replay --no-disk --zram 28G --sessions 2 --rounds 30 \
		--token-scale 1.0 --concurrency 1,2,3,4,5,6,7,8,10,12,16 \
		--replay-methods ${REPLAY_METHODS:-phx,host-odirect,host-buffered,cufile} ;;
	# issue 23's measured concurrency: the replay's trace (16 sessions of 30
	# rounds, 1/8 scale: a 20.5 GiB slab) with C sessions at once, loads, stores
	# and prefills concurrent, 15 s of arrivals per C (~7 min with build;
	# LIVE_ARGS: other options)
	live) bench live --mode live --no-disk ${LIVE_ARGS:---zram 24G --sessions 16 --rounds 30 \
		--token-scale 0.125 --live-concurrency 1,4,8,16 --live-seconds 15 \
		--replay-methods phx,host-odirect,cufile} ;;
	# issue 28's persistent tier (no GPU needed; the box's 16 CPUs and its
	# disk): every method side by side, zram and disk, the recovery row
	l2) bench l2 --mode l2 ${L2_ARGS:---zram 3G --repeat 3 --l2-chunk-mib 1,4,16,32 \
		--l2-bytes 256m --l2-latency 16 --l2-recovery 100000} ;;
	# issue 23: why LMCache's cufile backend fails (cuFile 5027) - cuFile's own
	# calls and LMCache's backend, three configurations, zram and disk, with
	# cuFile's TRACE logs (~1 min; tools/cufile_diag.py)
	cufile-diag) log "cufile-diag${UDEV_FILL:+ (udev database filled)}"
		timeout $(time_left) python3 - "$OUT/cufile-diag${UDEV_FILL:+-udev}" "$BENCHDIR" <<'PY' 2>&1 | tee -a "$LOG" | tail -40 ;;
import subprocess, sys
from phx.bench._zram import zram_ext4
out, disk = sys.argv[1:]
with zram_ext4(1 << 30) as z:
    sys.exit(subprocess.call([sys.executable, "tools/cufile_diag.py", out,
                              "--dir", f"zram={z.mountpoint}", "--dir", f"disk={disk}"]))
PY
	# this box runs no udevd, so cuFile finds no ID_FS_USAGE for any block
	# device and registers no file (5027): from here on, what udevd would have
	# recorded for every ext4/xfs mount, the benches' zram ones included
	# (tools/udev_db_fill.py; a normal host has it already)
	udev) log "udev: filling /run/udev/data for cuFile"
		python3 tools/udev_db_fill.py --watch 0.2 >> "$LOG" 2>&1 &
		UDEV_FILL=$! ;;
	*) echo "unknown step $1" | tee -a "$LOG"; return 2 ;;
	esac
}

case ${1:-small} in
small) set -- setup build tests bench-small replay-small ;;
chunks) set -- setup build bench-full ;;
replay) set -- setup build replay-full replay-disk ;;
esac
rc=0
for s in "$@"; do
	step "$s" || { rc=$?; log "step $s failed ($rc)"; [ "$s" = setup ] || [ "$s" = build ] && break; }
done
[ -z "${UDEV_FILL:-}" ] || kill "$UDEV_FILL" 2>/dev/null
# the device tool brings back a few files from $OUT: each diag folder as one
for d in "$OUT"/cufile-diag*/; do
	[ -d "$d" ] || continue
	tar czf "${d%/}.tgz" -C "$OUT" "$(basename "$d")" && rm -rf "$d"
done
log "done (rc $rc)"
exit $rc
