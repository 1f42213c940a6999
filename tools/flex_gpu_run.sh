#!/bin/bash
# tools/flex_gpu_run.sh - issue 12 on the H200 in ONE device call (~7 min):
# build phx, run the GPU KV tests, the FlexLLMGen four-configuration sweep
# (adapters/flexllmgen/run_four.py: stock TorchDisk, CachePolicy-only,
# NVMe-direct-only, Dual-Blade) and, if time is left, `phx bench kv`.
# Everything lands in $OUT (run.log, JSON, PNG).
#
#   tools/flex_gpu_run.sh [STEPS...]    default: build test flex bench
#
# Carried (git-ignored): .devcarry/deb (Debian's liburing-dev + liburing2 .debs,
# as tools/gpu_run.sh) and .whl-flex (flexgen-0.1.8-py3-none-any.whl; torch,
# transformers, attrs, tqdm and numpy are on the box already).
#
# Workload (FLEX_* override): OPT-6.7B with random weights on the GPU, prompt 512,
# batch 4, 8 generated tokens: a KV working set of 1.01 GiB (64 tensors of
# (519, 128, 128) fp16), decode reads 7 x ~1 GiB; caps = 256 MiB + 0.2 ... 1.2 x
# the working set; one worker per configuration (model loaded once, all caps).
# FLEX_ARGS: more run_four.py options; FLEX_CONFIGS: the configurations (add
# dual-nowb for Dual-Blade without its write-behind beside dual); KV_ARGS: the
# workload of `phx bench kv` (e.g. --model llama-3-8b, the GQA shape).
. "$(dirname "$0")/gpu_common.sh" || exit 1
DATA=${FLEX_DIR:-/var/tmp/flexkv}
gpu_begin --elapsed run.log "$DATA"
BUDGET=${FLEX_BUDGET_S:-400}	# seconds this script may take in all

setup() {
	unpack_liburing
	install_wheels /tmp/flexsite .whl-flex/*.whl || return 1
	use_phx_target /tmp/flexsite
	python3 -c "import flexgen.flex_opt, torch; print('flexgen', flexgen.__file__, 'torch', torch.__version__, torch.cuda.get_device_name(0))" 2>&1 | tail -3 | tee -a "$LOG" || true
	cat /sys/fs/cgroup/cgroup.controllers 2>&1 | sed 's/^/cgroup v2 controllers: /' | tee -a "$LOG" || true
	return 0
}

build() {
	log build
	build_phx "$PHX_TARGET" || return 1
	show_phx
}

tests() {
	log tests "(GPU KV, FlexLLMGen adapter, phx.kv with cgroup v2)"
	PHX_TEST_DIR=$TESTDIR timeout ${FLEX_TEST_S:-150} python3 -m pytest -q -ra -p no:cacheprovider \
		--timeout 120 --timeout-method=thread tests/test_kv_gpu.py tests/test_flexllmgen.py \
		tests/test_kv.py -k "not runner_on_a_real_gpu" 2>&1 | tee -a "$LOG" | tail -30
}

flex() {
	log flex sweep
	local t=$(($(time_left) - ${FLEX_BENCH_S:-60}))	# what is left after it goes to phx bench kv
	[ $t -gt 90 ] || { log "no time left for the sweep"; return 1; }
	timeout $((t + 30)) python3 adapters/flexllmgen/run_four.py --budget-s $((t - 10)) \
		--model facebook/opt-6.7b --prompt 512 --batch ${FLEX_BATCH:-4} --gen ${FLEX_GEN:-8} \
		--caps ${FLEX_CAPS:-0.2,0.4,0.6,0.8,1.0,1.2} --repeat ${FLEX_REPEAT:-1} \
		--configs ${FLEX_CONFIGS:-stock,cachepolicy,direct,dual} \
		--dir "$DATA" ${FLEX_ARGS:-} \
		--json "$OUT/flex.json" --plot "$OUT/flex.png" 2>&1 | tee -a "$LOG" | tail -45
	rm -rf "$DATA"
}

bench() {
	local t=$(($(time_left) - 10))
	[ $t -gt 60 ] || { log "no time left for phx bench kv ($t s)"; return 0; }
	log "phx bench kv (${KV_ARGS:-gen 8, 3 caps, 1 repeat}, $t s)"
	timeout $t python3 -m phx bench kv ${KV_ARGS:---gen 8 --caps 0.4,0.8,1.2 --repeat 1} --quiet \
		--dir /var/tmp/phxkv --json "$OUT/bench-kv.json" --plot "$OUT/bench-kv.png" 2>&1 |
		tee -a "$LOG" | tail -25
	rm -rf /var/tmp/phxkv
}

setup || exit 1
[ $# -gt 0 ] || set -- build test flex bench
for step in "$@"; do
	case $step in
	build) build || exit 1 ;;
	test) tests ;;
	flex) flex ;;
	bench) bench ;;
	*) echo "unknown step $step"; exit 2 ;;
	esac
done
log done
