#!/usr/bin/env bash
# Install LMCache 0.5.6 and the small packages its GDS modules import into a
# private folder (pip --no-deps --target), for the tests and the benchmark,
# without touching an environment's own packages.
#
#   adapters/lmcache/tools/lmcache-deps.sh install TARGET       (this machine's Python)
#   adapters/lmcache/tools/lmcache-deps.sh download DIR [3.12]  (wheels for the H200 box)
#
# Then: PYTHONPATH=TARGET python -m pytest tests/test_lmcache*.py, or put
# TARGET in PHX_LMCACHE_SITE (the tests add it to sys.path).  lmcache's own
# requirements (torch, numpy<=2.2.6, ...) are not installed: the modules used
# here run with the torch and numpy already present (its numpy pin is
# metadata only).
set -euo pipefail
# Imported by lmcache.v1.gpu_connector.gds_{backends.phx,backends.cufile,context}
# and lmcache.v1.storage_backend.local_disk_backend (found by importing them
# one missing module at a time; the H200's torch venv already has the rest;
# numba (and its llvmlite) are imported by lmcache/__init__).
PKGS=(lmcache==0.5.6 cachetools pyyaml requests urllib3 idna certifi charset-normalizer
      prometheus_client py-cpuinfo psutil aiohttp multidict attrs yarl propcache
      aiohappyeyeballs aiosignal frozenlist sortedcontainers cryptography cffi pycparser
      aiofile caio msgspec pyzmq blake3 nvtx redis setuptools_scm cufile-python numba llvmlite)
# What the H200's /opt/torch venv lacks (docs: shared notes on the machines):
# the rest of the list above is already there; crc32c is phx_lmcache.l2's
# checksum (phx[lmcache]; its absence stopped a first l2 run on the box).
H200_PKGS=(lmcache==0.5.6 cachetools msgspec blake3 nvtx pyzmq aiofile caio redis
           setuptools_scm cufile-python cryptography cffi pycparser "crc32c>=2.3")
cmd=${1:?install TARGET | download DIR [PYVER]}
dir=${2:?folder}
case $cmd in
install)
	python3=${PYTHON:-python3}
	"$python3" -m pip install -q --no-deps --only-binary=:all: --target "$dir" "${PKGS[@]}"
	;;
download)
	pyver=${3:-3.12}
	mkdir -p "$dir"
	pip download -q --no-deps --only-binary=:all: --python-version "$pyver" \
		--implementation cp --platform manylinux_2_28_x86_64 \
		--platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
		-d "$dir" "${H200_PKGS[@]}"
	;;
*)
	echo "unknown command $cmd" >&2
	exit 2
	;;
esac
