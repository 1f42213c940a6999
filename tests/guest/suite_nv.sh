#!/bin/bash
# The NVIDIA-path part of suite_phx.sh alone (PHX_SUITE_ONLY=nv), with its
# own list of expected results: `make test-guest-nv` (Debian 6.12, quick)
# and `make test-guest-debug-nv` (the debug kernel, 1000 race iterations).
# Also the PCI unbind test, which runs only where a device is bound to phx.
#
# PHX-EXPECT: insmod pci-unbind nv-insmod nv-ext4/io-pread nv-ext4/io-uring nv-xfs/io-pread
# PHX-EXPECT: nv-xfs/io-uring nv/fillbar nv/fork nv/unreg nvcb nvreg nvreuse nvsparse nvfail
# PHX-EXPECT: nv/splice nv/fixedbuf nv/fixedbuf-exit nonroot
# PHX-EXPECT: race/mmap-unreg race/mmap-free race/munmap-free race/fork-free race/unreg-free
# PHX-EXPECT: race/munmap-unreg race/fork-unreg race/unreg-rereg
# PHX-EXPECT: nv-rmmod-refused nv-rmmod-after-free nv-rmmod nvapi-cap nvapi-none nv-gpl rmmod
PHX_SUITE_ONLY=nv
# shellcheck source=suite_phx.sh
. "$PHX_REPO/tests/guest/suite_phx.sh"
