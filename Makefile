# phx: top-level targets.  `make bench` and `make test` set everything up on a
# fresh Debian 12 machine (apt packages, a venv, an editable install); they
# assume only make and python3 (README.md).  `make test-fresh` checks that claim
# in a clean Debian 12 root (tests/fresh/run.sh).
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
VPY := $(VENV)/bin/python
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

# The one list of Debian packages that every target here uses (the guest
# harness gets it through PHX_APT_PACKAGES, exported below).
#   build: build-essential cmake ninja-build pkg-config liburing-dev libblkid-dev (NVMe
#     signature checks) python3-venv python3-dev
#   tests and bench: fio xfsprogs e2fsprogs util-linux mount (mkfs, losetup, mount)
#   guest harness: qemu-system-x86 busybox-static cpio xz-utils kmod (depmod, insmod in
#     the guest), dmsetup (device-mapper I/O errors in the guest), libelf-dev bc
#     dwarves (pahole: the BTF step of phx.ko's modfinal);
#     flex bison libssl-dev for the P2PDMA kernel (make test-guest-p2pdma)
#   test-fresh: debootstrap
#   test-seccomp: libseccomp-dev (tests/seccomp's launcher that refuses io_uring)
APT_PACKAGES := build-essential cmake ninja-build pkg-config liburing-dev libblkid-dev \
	python3-venv python3-dev \
	fio xfsprogs e2fsprogs util-linux mount \
	qemu-system-x86 busybox-static cpio xz-utils kmod dmsetup libelf-dev bc dwarves \
	flex bison libssl-dev \
	debootstrap libseccomp-dev
export PHX_APT_PACKAGES := $(APT_PACKAGES)
# What `make bench` (`phx bench io`) needs of them: the build, fio, and mkfs,
# mount and modprobe for its zram rows.
APT_BENCH_PACKAGES := build-essential cmake ninja-build pkg-config liburing-dev libblkid-dev \
	python3-venv python3-dev fio e2fsprogs util-linux mount kmod

# The bench's RAM-speed row set: ext4 on a zram device of this size, made for
# the run and removed after it (skipped, with the reason, where it cannot be).
BENCH_ZRAM ?= 2g
# Extra `phx bench io` options for `make bench`, e.g. a short run:
#   make bench BENCH_ARGS="--size 64m --runtime 0.1 --repeat 1"
BENCH_ARGS ?=
RESULTS := results

.PHONY: all deps deps-bench venv venv-bench build build-bench bench test test-py test-c \
	test-guest test-fresh clean

all: build

# System packages: apt-get runs only when one of the list is not installed
# (dpkg's "ii"; `dpkg -s` also succeeds for removed packages that left config).
define apt_install
	@missing=; for p in $(1); do \
		dpkg-query -W -f='$${db:Status-Abbrev}' $$p 2>/dev/null | grep -q '^ii' || \
			missing="$$missing $$p"; \
	done; \
	if [ -n "$$missing" ]; then \
		echo "apt-get install$$missing"; \
		$(SUDO) apt-get update -qq && \
		DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq \
			--no-install-recommends $$missing; \
	fi
endef

deps:
	$(call apt_install,$(APT_PACKAGES))

deps-bench:
	$(call apt_install,$(APT_BENCH_PACKAGES))

$(VPY): | deps-bench
	$(PYTHON) -m venv $(VENV)
	$(VPY) -m pip install -q --upgrade pip

# What `make bench` needs in the venv: the build tools, numpy and phx[bench]'s
# matplotlib (--plot) and tqdm.
venv-bench: deps-bench $(VPY)
	$(VPY) -m pip install -q "scikit-build-core>=0.10" "cython>=3.0" numpy matplotlib tqdm

# Everything the tests use.  torch is optional: the CPU build is installed for
# the tests when available.
venv: deps venv-bench
	$(VPY) -m pip install -q pytest pytest-timeout
	@# crc32c: the LMCache L2 plugin's checksum (phx[lmcache]; docs/lmcache-l2.md)
	$(VPY) -m pip install -q "crc32c>=2.3"
	@# mypy: tests/test_typing.py (mypy --strict, stubtest; skipped without it)
	$(VPY) -m pip install -q mypy
	$(VPY) -m pip show torch >/dev/null 2>&1 || $(VPY) -m pip install -q "torch==2.13.0" \
		|| echo "torch not installed: torch tests will skip"
	@# transformers: the LMCache replay test builds a small random Llama on the CPU
	$(VPY) -m pip install -q transformers || echo "transformers not installed: its tests will skip"
	@# the weight loader's tests: safetensors (reference), fastsafetensors (copier), vllm (plugin; private folder)
	$(VPY) -m pip install -q safetensors "fastsafetensors==0.5.0" && PYTHON=$(VPY) bash adapters/vllm/tools/vllm-deps.sh install .vllm-site
	@# flexgen 0.1.8 (FlexLLMGen) for adapters/flexllmgen's tests; --no-deps: its pins
	@# (pulp, torch) are not needed to import it, attrs is
	$(VPY) -m pip install -q --no-deps "flexgen==0.1.8" attrs || echo "flexgen not installed: its tests will skip"

build: venv
	$(VPY) -m pip install -q --no-build-isolation -e .

build-bench: venv-bench
	$(VPY) -m pip install -q --no-build-isolation -e .

# The real lmcache 0.5.6 (and the small packages its GDS modules import), for
# the LMCache adapter's tests, in a private folder the tests find by itself
# (pip --no-deps --target: the venv's own packages stay as they are).
LMCACHE_SITE := .lmcache-site
$(LMCACHE_SITE): | venv
	rm -rf $@.tmp
	PYTHON=$(VPY) bash adapters/lmcache/tools/lmcache-deps.sh install $@.tmp
	mv $@.tmp $@

test-c: deps
	cmake -S . -B build/c -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
	cmake --build build/c
	cd build/c && ctest --output-on-failure

# --timeout: a hung test fails with its stack instead of stalling CI;
# --durations: the slowest tests named in every CI log (docs/ci.md)
test-py: build $(LMCACHE_SITE)
	$(VPY) -m pytest -ra --timeout=900 --durations=25 tests

test: test-c test-py test-guest test-seccomp

# Only what `phx bench io` needs (build-bench); `make test` installs the rest.
bench: build-bench
	mkdir -p $(RESULTS)
	$(VENV)/bin/phx bench io --dir $(RESULTS) --zram $(BENCH_ZRAM) \
		--json $(RESULTS)/bench-io.json --plot $(RESULTS)/bench-io.png $(BENCH_ARGS)

# The README's two commands in a clean Debian 12 root built by debootstrap,
# on a clean clone of HEAD: fails on anything they do not install.
test-fresh: deps
	$(SUDO) tests/fresh/run.sh

clean:
	rm -rf build $(RESULTS)

# Kernel module and guest-harness targets live beside their code.
-include kernel/kernel.mk
-include tests/guest/guest.mk
-include tests/guest/nvme/nvme.mk
-include tests/seccomp/seccomp.mk

# test-guest is the sum of the fragments' double-colon rules (none without them).
test-guest::
