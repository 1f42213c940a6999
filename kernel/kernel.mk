# phx.ko for the running kernel, included by the top Makefile.
#   make insmod   build kernel/ against /lib/modules/$(uname -r)/build, load it
#   make rmmod    unload it
PHX_KDIR ?= /lib/modules/$(shell uname -r)/build

.PHONY: kmod insmod rmmod

# The toolchain (gcc, make, libelf-dev, bc, pahole from dwarves) comes from the
# one package list (`make deps`); only the running kernel's headers are extra.
kmod: deps
	@if [ ! -d "$(PHX_KDIR)" ]; then \
		$(SUDO) apt-get install -y -qq --no-install-recommends \
			linux-headers-$(shell uname -r) || \
		{ echo "no build tree for $(shell uname -r): set PHX_KDIR"; exit 1; }; \
	fi
	$(MAKE) -C kernel KDIR=$(PHX_KDIR)

insmod: kmod
	@if lsmod | grep -q '^phx '; then echo "phx already loaded"; \
	else $(SUDO) insmod kernel/phx.ko && ls -l /dev/phx; fi

rmmod:
	$(SUDO) rmmod phx

# checkpatch --strict over kernel/, with the checkpatch.pl of Debian's
# linux-source-6.12 (unpacked once into the guest cache).
PHX_GUEST_CACHE ?= $(HOME)/.cache/phx-guest
PHX_CHECKPATCH := $(PHX_GUEST_CACHE)/src/linux-source-6.12/scripts/checkpatch.pl

.PHONY: checkpatch
checkpatch:
	@if [ ! -f "$(PHX_CHECKPATCH)" ]; then \
		mkdir -p $(PHX_GUEST_CACHE)/deb $(PHX_GUEST_CACHE)/src && \
		cd $(PHX_GUEST_CACHE)/deb && \
		apt-get download -o APT::Sandbox::User=root linux-source-6.12 >/dev/null && \
		dpkg-deb --fsys-tarfile linux-source-6.12_*.deb | \
		tar -xO ./usr/src/linux-source-6.12.tar.xz | xz -dc -T0 | \
		tar -x -C $(PHX_GUEST_CACHE)/src --wildcards 'linux-source-6.12/scripts/*'; \
	fi
	cd kernel && perl $(PHX_CHECKPATCH) --strict --no-tree -f \
		$$(ls *.c *.h include/uapi/*.h) Kbuild Makefile \
		../tests/guest/nv_p2p_stub/nv_p2p_stub.c ../tests/guest/nv_p2p_stub/Kbuild
