# phx: top-level targets.  `make bench` and `make test` set everything up on a
# fresh Debian/Ubuntu machine (apt packages, a venv, an editable install).
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
VPY := $(VENV)/bin/python
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
APT_PACKAGES := build-essential cmake ninja-build pkg-config liburing-dev fio \
	xfsprogs e2fsprogs util-linux python3-venv python3-dev
RESULTS := results

.PHONY: all deps venv build bench test test-py test-c test-guest clean

all: build

# System packages (once per machine; the stamp lives outside the tree).
deps:
	@if ! dpkg -s $(APT_PACKAGES) >/dev/null 2>&1; then \
		$(SUDO) apt-get update -qq && \
		DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq \
			--no-install-recommends $(APT_PACKAGES); \
	fi

$(VPY):
	$(PYTHON) -m venv $(VENV)
	$(VPY) -m pip install -q --upgrade pip

# torch is optional: the CPU build is installed for the tests when available.
venv: deps $(VPY)
	$(VPY) -m pip install -q "scikit-build-core>=0.10" "cython>=3.0" pytest numpy matplotlib tqdm
	$(VPY) -m pip show torch >/dev/null 2>&1 || $(VPY) -m pip install -q "torch==2.13.0" \
		|| echo "torch not installed: torch tests will skip"

build: venv
	$(VPY) -m pip install -q --no-build-isolation -e .

test-c: deps
	cmake -S . -B build/c -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
	cmake --build build/c
	cd build/c && ctest --output-on-failure

test-py: build
	$(VPY) -m pytest -ra tests

test: test-c test-py test-guest

bench: build
	mkdir -p $(RESULTS)
	$(VENV)/bin/phx bench io --path $(RESULTS) --json $(RESULTS)/bench-io.json --plot $(RESULTS)/bench-io.png

clean:
	rm -rf build $(RESULTS)

# Kernel module and guest-harness targets live beside their code.
-include kernel/kernel.mk
-include tests/guest/guest.mk
-include tests/guest/nvme/nvme.mk

# Until the guest harness exists, test-guest is a no-op.
test-guest::
