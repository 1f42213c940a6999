#!/bin/bash
# tools/stream_gpu_run.sh - the stream-ordered path on the H200 box, in one
# call of the device tool (issue 22).  Logs and JSON go to $OUT.
#
#   tools/stream_gpu_run.sh STEP...   any of, in order:
#     micro   tools/stream_micro.cu: the pieces of a stream op in isolation
#     build   pip install of this tree into $PHX_TARGET
#     probe   tools/stream_probe.py on zram (one stream, op by op), early reads off and on
#     tests   the GPU tests (tests/test_gpu*.py, the stream tests, the fake-libcuda tests)
#     bench   phx bench gpu --pattern stream: zram and disk, reads and stores, 1-32 MiB
#             chunks, 1/2/4/8 streams, beside pread_batch and the host-staged pool
#     bench32 the same with CUDA_DEVICE_MAX_CONNECTIONS=32 (stream-conn32.json)
#   (STREAM_BUDGET_S: seconds the whole call may take, 570 by default; GPU_TESTS:
#   the test files; STREAM_BENCH_ARGS: the bench's options; STREAM_EARLY=0: early
#   reads off for the bench)
#
# Carried (git-ignored): .devcarry/deb (Debian's liburing-dev and liburing2)
# and .devcarry/whl (KvikIO wheels).
. "$(dirname "$0")/gpu_common.sh" || exit 1
gpu_begin --elapsed stream.log "$BENCHDIR"
BUDGET=${STREAM_BUDGET_S:-570}

setup() {
	unpack_liburing
	if ls .devcarry/whl/*.whl >/dev/null 2>&1; then
		install_wheels /tmp/site .devcarry/whl/*.whl
		export LD_LIBRARY_PATH=/tmp/site/libkvikio/lib64:/tmp/site/rapids_logger/lib64:${LD_LIBRARY_PATH:-}
	fi
	use_phx_target /tmp/site
}

zram_up() {	# $1 size -> prints the device id; mounted at /mnt/phx-s$id
	local id
	id=$(cat /sys/class/zram-control/hot_add)
	echo "$1" >/sys/block/zram$id/disksize
	mkfs.ext4 -q -F /dev/zram$id && mkdir -p /mnt/phx-s$id && mount -o discard /dev/zram$id /mnt/phx-s$id
	echo "$id"
}

zram_down() {
	umount /mnt/phx-s$1 && echo 1 >/sys/block/zram$1/reset
}

micro() {
	log micro
	nvcc -O3 -arch=sm_90 -o /tmp/stream_micro tools/stream_micro.cu -lcuda 2>&1 | tee -a "$LOG" || return 1
	timeout 150 /tmp/stream_micro all 2>&1 | tee "$OUT/micro.json" | tee -a "$LOG"
	# last, in a process of its own: a faulting kernel kills its context
	timeout 30 /tmp/stream_micro fault 2>&1 | tee -a "$OUT/micro.json" | tee -a "$LOG"
}

build() {
	log build
	build_phx "$PHX_TARGET" || return 1
	show_phx
	show_gpus
}

probe() {
	log probe
	local id
	id=$(zram_up 6G)
	for early in 0 1; do
		for chunk in 4M 16M; do
			log "probe early=$early chunk=$chunk"
			PHX_CUDA_EARLY_READS=$early PROBE_CONFIGS=default timeout 120 python3 tools/stream_probe.py \
				/mnt/phx-s$id/probe.bin --ops 64 --chunk $(numfmt --from=iec $chunk) 2>&1 | tee -a "$LOG"
		done
		PHX_CUDA_TRACE=1 PHX_CUDA_EARLY_READS=$early PROBE_CONFIGS=default PROBE_LATENCY_ONLY=1 \
			timeout 60 python3 tools/stream_probe.py /mnt/phx-s$id/probe.bin --ops 8 \
			--chunk $((4 << 20)) 2>&1 | grep -v '^phx-trace lane' | tail -60 >>"$LOG"
	done
	zram_down "$id"
}

tests() {
	log tests
	PHX_TEST_DIR=$TESTDIR timeout ${TEST_TIMEOUT:-240} python3 -m pytest -q -ra -p no:cacheprovider \
		${GPU_TESTS:-tests/test_gpu.py tests/test_gpu_basic.py tests/test_gpu_fake.py tests/test_gpu_stream.py} \
		${EXTRA_TESTS:-} 2>&1 | tee -a "$LOG" | tail -40
}

bench() {	# $1: the name of the JSON and plot (stream)
	log "bench ${1:-stream}"
	local left
	left=$(time_left)
	[ "$left" -gt 60 ] || { log "bench skipped: no time left"; return 0; }
	# early reads on: what libphxfile (LMCache) runs with, and what lets one
	# stream overlap its ops' file I/O (STREAM_EARLY=0 for a run without)
	PHX_CUDA_EARLY_READS=${STREAM_EARLY:-1} timeout $((left - 10)) python3 -m phx bench gpu \
		--pattern stream --dir $BENCHDIR --zram 8G --quiet \
		${STREAM_BENCH_ARGS:---chunk-bytes 512M --repeat 2} \
		--json "$OUT/${1:-stream}.json" --plot "$OUT/${1:-stream}.png" 2>&1 | tee -a "$LOG" | tail -100
}

setup || exit 1
for step in "$@"; do
	case $step in
	micro) micro ;;
	build) build || exit 1 ;;
	probe) probe ;;
	tests) tests ;;
	bench) bench ;;
	# the same with 32 hardware work queues instead of CUDA's 8: does a stream
	# waiting on a flag hold up others that share its queue?
	bench32) CUDA_DEVICE_MAX_CONNECTIONS=32 STREAM_BENCH_ARGS=${STREAM_BENCH32_ARGS:-${STREAM_BENCH_ARGS:-}} \
		bench stream-conn32 ;;
	*) echo "unknown step $step"; exit 2 ;;
	esac
done
log done
