# phx.ko for the running kernel, included by the top Makefile.
#   make insmod   build kernel/ against /lib/modules/$(uname -r)/build, load it
#   make rmmod    unload it
PHX_KDIR ?= /lib/modules/$(shell uname -r)/build

.PHONY: kmod insmod rmmod

kmod:
	@if [ ! -d "$(PHX_KDIR)" ]; then \
		$(SUDO) apt-get install -y -qq --no-install-recommends \
			linux-headers-$(shell uname -r) make gcc libelf-dev bc || \
		{ echo "no build tree for $(shell uname -r): set PHX_KDIR"; exit 1; }; \
	fi
	$(MAKE) -C kernel KDIR=$(PHX_KDIR)

insmod: kmod
	@if lsmod | grep -q '^phx '; then echo "phx already loaded"; \
	else $(SUDO) insmod kernel/phx.ko && ls -l /dev/phx; fi

rmmod:
	$(SUDO) rmmod phx
