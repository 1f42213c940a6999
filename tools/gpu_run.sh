#!/bin/bash
# tools/gpu_run.sh - build phx on the H200 box and run the GPU tests and
# benchmarks there, in one call of the device tool.  Logs and JSON go to $OUT.
#
#   tools/gpu_run.sh STEPS...     steps, in order: build test tune|tune-disk smoke seq chunks small probe
#   (SEQ_SIZE, CHUNK_FILE, CHUNK_BYTES, SMALL_FILE, SMALL_BYTES, SMALL_TIMEOUT, TEST_TIMEOUT
#   size the steps; GPU_TESTS, SMALL_METHODS, SMALL_SIZES, SMALL_ARGS pick what they run)
#
# Carried (ignored by git, listed in .git/info/exclude): .devcarry/deb (Debian's
# liburing-dev and liburing2 .debs: the box has no liburing headers) and
# .devcarry/whl (kvikio-cu13, libkvikio-cu13, rapids-logger wheels: no network
# there).  Everything runs as root on the box.
. "$(dirname "$0")/gpu_common.sh" || exit 1
gpu_begin run.log "$BENCHDIR"	# at most 8 files come back from $OUT: one log for all steps

setup() {
	unpack_liburing
	install_wheels /tmp/site .devcarry/whl/*.whl || return 1
	use_phx_target /tmp/site
	export LD_LIBRARY_PATH=/tmp/site/libkvikio/lib64:/tmp/site/rapids_logger/lib64:${LD_LIBRARY_PATH:-}
}

build() {
	log build
	build_phx "$PHX_TARGET" || return 1
	show_phx
	show_gpus
}

tests() {
	log tests
	PHX_TEST_DIR=$TESTDIR timeout ${TEST_TIMEOUT:-300} python3 -m pytest -q -ra -p no:cacheprovider \
		--timeout 120 --timeout-method=thread ${GPU_TESTS:-tests/test_gpu.py tests/test_gpu_basic.py \
		tests/test_gpu_fake.py tests/test_gpu_small.py tests/test_gpu_many.py} 2>&1 |
		tee -a "$LOG" | tail -40
}

zram_up() {	# $1 size -> prints the mount point
	local id
	id=$(cat /sys/class/zram-control/hot_add)
	echo "$1" >/sys/block/zram$id/disksize
	mkfs.ext4 -q -F /dev/zram$id && mkdir -p /mnt/phx-tune$id && mount /dev/zram$id /mnt/phx-tune$id
	echo "$id"
}

zram_down() {
	umount /mnt/phx-tune$1 && echo 1 >/sys/block/zram$1/reset
}

tune() {	# $1: also tune a zram filesystem
	log tune
	python3 -m phx tune $BENCHDIR --size 1G 2>&1 | tee -a "$LOG"
	local id
	if [ "${1:-}" = zram ]; then
		id=$(zram_up 4G)
		python3 -m phx tune /mnt/phx-tune$id --size 1G 2>&1 | tee -a "$LOG"
		zram_down "$id"
	fi
	python3 -m phx info 2>&1 | sed -n '/^cuda:/,/^kernel_module/p' | tee -a "$LOG"
	cp ~/.cache/phx/gpu-tune.json "$OUT/" 2>/dev/null || true
}

smoke() {
	log smoke bench
	timeout 300 python3 -m phx bench gpu --pattern seq,chunks --size 1G --chunk-bytes 256M \
		--repeat 1 --raw-threads 16 --kvikio-threads 16 --dir $BENCHDIR --zram 4G --quiet \
		--json "$OUT/smoke.json" 2>&1 | tee -a "$LOG" | tail -60
}

seq() {
	log seq bench
	timeout 560 python3 -m phx bench gpu --pattern seq --size ${SEQ_SIZE:-2G} --repeat 3 \
		--raw-threads 16,64 --kvikio-threads 16,64 --dir $BENCHDIR --zram 8G --quiet \
		--json "$OUT/seq.json" --plot "$OUT/seq.png" 2>&1 | tee -a "$LOG" | tail -45
}

chunks() {
	log chunks bench
	timeout 560 python3 -m phx bench gpu --pattern chunks --size ${CHUNK_FILE:-2G} \
		--chunk-bytes ${CHUNK_BYTES:-512M} --repeat 3 --raw-threads 16,64 \
		--kvikio-threads 4,16,64 --dir $BENCHDIR --zram 8G --quiet \
		--json "$OUT/chunks.json" --plot "$OUT/chunks.png" 2>&1 | tee -a "$LOG" | tail -90
}

small() {	# issue 29: 4-64 KiB pieces, phx vs its host row (the device's rate) vs KvikIO,
	# beside phx's per-piece pread_batch (the "before" of the array calls)
	log small-chunks bench
	# 5 sizes x read/write x 4 rows x 5 repeats x disk and zram: ~400 rows;
	# with a build in the same call the device's 600 s may run out: then
	# `build` in one call and `small` alone in the next (the box stays warm)
	timeout ${SMALL_TIMEOUT:-500} python3 -m phx bench gpu --pattern chunks --size ${SMALL_FILE:-1G} \
		--chunk-sizes ${SMALL_SIZES:-4K,8K,16K,32K,64K} --chunk-bytes ${SMALL_BYTES:-128M} --repeat 5 \
		--methods ${SMALL_METHODS:-phx,batch,host,kvikio} --kvikio-threads 16,64 \
		${SMALL_ARGS:-} --dir $BENCHDIR --zram 8G --quiet \
		--json "$OUT/small.json" --plot "$OUT/small.png" 2>&1 | tee -a "$LOG" | tail -90
}

probe() {	# stream-ordered ops timed one by one (tools/stream_probe.py), zram then disk
	# (PHX_CUDA_EARLY_READS=1 bash tools/gpu_run.sh build probe: the same with early reads)
	log probe
	local id
	id=$(zram_up 6G)
	PROBE_LATENCY_ONLY=1 timeout 200 python3 tools/stream_probe.py /mnt/phx-tune$id/probe.bin --ops 48 \
		--json "$OUT/probe-zram.json" 2>&1 | tee -a "$LOG"
	zram_down $id
	PROBE_LATENCY_ONLY=1 timeout 150 python3 tools/stream_probe.py $BENCHDIR/probe.bin --ops 24 \
		--json "$OUT/probe-disk.json" 2>&1 | tee -a "$LOG"
}

setup || exit 1
for step in "$@"; do
	case $step in
	build) build || exit 1 ;;
	test) tests ;;
	tune) tune zram ;;
	tune-disk) tune ;;
	smoke) smoke ;;
	seq) seq ;;
	chunks) chunks ;;
	small) small ;;
	probe) probe ;;
	*) echo "unknown step $step"; exit 2 ;;
	esac
done
log done
