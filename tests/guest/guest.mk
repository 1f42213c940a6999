# Guest tests (QEMU TCG), included by the top Makefile.
# The cache (kernels, initramfs, builds) lives outside the tree:
# $(PHX_GUEST_CACHE), default ~/.cache/phx-guest.
PHX_GUEST := $(PYTHON) tests/guest/phxguest.py
PHX_GUEST_NVME ?= size=512M,lba=4096,mdts=7
PHX_GUEST_IVSHMEM ?= 256M

.PHONY: test-guest-phx test-guest-p2pdma test-guest-next test-guest-races test-guest-debug \
	test-guest-nv test-guest-debug-nv

# phx.ko on Debian's 6.12 kernel (MEMORY_DEVICE_GENERIC pages).
test-guest-phx: build
	$(PHX_GUEST) tests/guest/suite_phx.sh --kernel debian \
		--nvme $(PHX_GUEST_NVME) --ivshmem-size $(PHX_GUEST_IVSHMEM)

# The same suite on a kernel built with CONFIG_PCI_P2PDMA (MEMORY_DEVICE_PCI_P2PDMA
# pages through pci_p2pdma_add_resource).  Builds the kernel once (~10 min on
# 2 cores), cached afterwards.  Not part of test-guest: see docs/kernel.md.
test-guest-p2pdma:
	$(PHX_GUEST) tests/guest/suite_phx.sh --kernel p2pdma \
		--nvme $(PHX_GUEST_NVME) --ivshmem-size $(PHX_GUEST_IVSHMEM)

# The same suite on Debian's newest kernel of trixie-backports (7.3 when
# written: >= 6.15 refcount rules, .folio_free, CONFIG_PCI_P2PDMA=y, so the
# PCIBAR tests run on P2PDMA pages of the ivshmem device bound to phx).
# ~300 MB of packages and a 10 s modules_prepare on first use, cached.
test-guest-next:
	$(PHX_GUEST) tests/guest/suite_phx.sh --kernel debian-next \
		--nvme $(PHX_GUEST_NVME) --ivshmem-size $(PHX_GUEST_IVSHMEM)

# The race tests at 1000 iterations each (CI runs 100: ~12 s a race in
# TCG, so this target takes ~25 min in the guest).
test-guest-races:
	PHX_SUITE_RACE_ITERS=1000 PHX_SUITE_NVCB_ROUNDS=50 \
	$(PHX_GUEST) tests/guest/suite_phx.sh --kernel $(or $(PHX_GUEST_KERNEL),debian) \
		--nvme $(PHX_GUEST_NVME) --ivshmem-size $(PHX_GUEST_IVSHMEM) --timeout 3600

# The suite on the P2PDMA kernel built with KASAN, PROVE_LOCKING, DEBUG_VM,
# DEBUG_ATOMIC_SLEEP (their reports are WARNING/BUG lines: a run with one
# fails).  Builds the kernel once (~25 min at -j1 on the 2 shared cores),
# cached in $(PHX_GUEST_CACHE)/debug; ~12 min in the guest.  Not in CI.
test-guest-debug:
	$(PHX_GUEST) tests/guest/suite_phx.sh --kernel debug \
		--nvme $(PHX_GUEST_NVME) --ivshmem-size $(PHX_GUEST_IVSHMEM) --timeout 2400

# Only the NVIDIA-path tests (suite_nv.sh), on Debian 6.12: a quick check.
test-guest-nv:
	$(PHX_GUEST) tests/guest/suite_nv.sh --kernel $(or $(PHX_GUEST_KERNEL),debian) \
		--nvme $(PHX_GUEST_NVME) --ivshmem-size $(PHX_GUEST_IVSHMEM)

# The NVIDIA-path tests (and the PCI unbind test) on the debug kernel, at
# 1000 race iterations and 50 cudaFree-under-I/O rounds (issue 25).  Builds
# the debug kernel once like test-guest-debug.  Not in CI.
test-guest-debug-nv:
	PHX_SUITE_RACE_ITERS=1000 PHX_SUITE_NVCB_ROUNDS=50 \
	$(PHX_GUEST) tests/guest/suite_nv.sh --kernel debug \
		--nvme $(PHX_GUEST_NVME) --ivshmem-size $(PHX_GUEST_IVSHMEM) --timeout 7200

test-guest:: test-guest-phx test-guest-next
