# NVMe-direct guest tests (issue 6).  Included by the top Makefile
# (`-include tests/guest/nvme/nvme.mk`); meanwhile:
#   make -f Makefile -f tests/guest/nvme/nvme.mk test-guest-nvme
# Three emulated controllers: 4 KiB LBAs with MDTS 3 (32 KiB commands), 512 B
# LBAs with MDTS 2 (16 KiB commands) so that chunking is exercised, and one
# that the tests format (512 MiB: mkfs.xfs wants 300), partition and hot-remove.
PHX_GUEST_NVME_RUN := $(PYTHON) tests/guest/nvme/run_guest.py
PHX_GUEST_NVME_DEVS ?= --nvme size=64M,lba=4096,mdts=3 --nvme size=64M,lba=512,mdts=2 \
	--nvme size=512M,lba=4096,mdts=5

.PHONY: test-guest-nvme bench-guest-nvme test-guest-flex

# `build`: the guest runs the host's .venv (phx.nvme, pytest) over 9p.
test-guest-nvme: build
	$(PHX_GUEST_NVME_RUN) tests/guest/nvme/suite_nvme.sh $(PHX_GUEST_NVME_DEVS) \
		--timeout 900

# phx bench nvme in the guest on a 512 MiB namespace (docs/nvme.md).
bench-guest-nvme: build
	$(PHX_GUEST_NVME_RUN) tests/guest/nvme/suite_bench.sh \
		--nvme size=1G,lba=4096,mdts=7 --mem 2G --timeout 1200 --keep

# FlexLLMGen's generate (OPT-125M on the CPU) with Group 2 of the KV cache on a
# namespace, against stock (issue 26, part 6; docs/kv.md).  Part of test-guest
# (guest tests run in CI) though torch under TCG makes it the longest guest run:
# ~11 minutes on the 2-core box (import torch 82 s, three generates 125-168 s
# each).  3 GiB: each of stock
# TorchDisk's four 2 GiB relay buffers must pass the guest's overcommit check.
test-guest-flex: build
	$(PHX_GUEST_NVME_RUN) tests/guest/nvme/suite_flex.sh --nvme size=64M,lba=4096,mdts=3 \
		--mem 3G --timeout 1800

test-guest:: test-guest-nvme test-guest-flex
