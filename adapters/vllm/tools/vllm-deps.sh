#!/usr/bin/env bash
# Install vLLM 0.33.0 and the few small packages that importing its
# model-loader and engine-argument modules needs into a private folder
# (pip --no-deps --target), so tests/test_vllm*.py run against the real
# package without touching the venv: vLLM pins torch 2.14 and
# transformers < 5.21, and the venv keeps its own (torch 2.13 CPU).  Only
# Python modules are used on the CPU box: vllm._C (built for torch 2.14 and
# CUDA) is never loaded; VLLM_TARGET_DEVICE=cpu makes its platform the CPU.
#
#   adapters/vllm/tools/vllm-deps.sh install TARGET   (skips when TARGET is complete)
#
# The list was found by importing vllm.engine.arg_utils,
# vllm.model_executor.model_loader and vllm.model_executor.models.utils one
# missing module at a time on top of `make venv`'s packages; compressed-tensors
# and loguru are what vLLM's load_model path (create_model's quantization
# log) imports, for tests/test_vllm_parallel.py.  TARGET/.complete holds the
# list it was installed with: packages added to the list since are installed
# into it on the next run.
set -euo pipefail
PKGS=(vllm==0.33.0 aiohappyeyeballs aiohttp aiosignal apache-tvm-ffi attrs cachetools cbor2
      certifi cloudpickle einops fastapi frozenlist llguidance msgspec multidict openai
      openai-harmony opentelemetry-api partial-json-parser prometheus_client propcache psutil
      py-cpuinfo pybase64 pyzmq requests sniffio starlette urllib3 uvloop xgrammar yarl
      compressed-tensors==0.17.0 loguru)
cmd=${1:?install TARGET}
dir=${2:?folder}
case $cmd in
install)
	python3=${PYTHON:-python3}
	want=$(printf '%s\n' "${PKGS[@]}")
	if [ -f "$dir/.complete" ]; then
		have=$(cat "$dir/.complete")
		[ "$have" = "$want" ] && exit 0
		# an older list (an empty marker: the first one): add what is new
		mapfile -t new < <(printf '%s\n' "${PKGS[@]}" | grep -vxF -f <(printf '%s\n' "$have" vllm==0.33.0))
		if [ ${#new[@]} -gt 0 ]; then
			"$python3" -m pip install -q --no-deps --no-compile --only-binary=:all: \
				--target "$dir" "${new[@]}"
		fi
		printf '%s\n' "$want" >"$dir/.complete"
		exit 0
	fi
	rm -rf "$dir.tmp"
	"$python3" -m pip install -q --no-deps --no-compile --only-binary=:all: --target "$dir.tmp" \
		"${PKGS[@]}"
	printf '%s\n' "$want" >"$dir.tmp/.complete"
	rm -rf "$dir"
	mv "$dir.tmp" "$dir"
	;;
*)
	echo "unknown command $cmd" >&2
	exit 2
	;;
esac
