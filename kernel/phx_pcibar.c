// SPDX-License-Identifier: GPL-2.0
/*
 * Provider: a sub-range of any PCI memory BAR, root only.
 *
 * The stand-in for GPU memory in tests (QEMU ivshmem-plain, whose BAR 2 is
 * a host file) and a way to use real device memory (NVMe CMB, FPGA/DPU
 * BARs).  Only the requested sub-range gets struct pages, never the
 * whole BAR, so the rest of the device keeps working as before (unless the
 * device is bound to phx itself, see phx_pci.c).
 *
 * Rights: CAP_SYS_ADMIN of whoever opened /dev/phx (as for any device
 * file, the opener's credentials count, not those of a process the fd was
 * passed to), and no kernel lockdown of PCI access: mapping a BAR to user
 * space is what LOCKDOWN_PCI_ACCESS forbids.  Only prefetchable BARs are
 * accepted: their reads have no side effects, so write-combining CPU
 * mappings and DMA from another device are safe; registers are not.
 */
#define pr_fmt(fmt) KBUILD_MODNAME ": " fmt

#include <linux/capability.h>
#include <linux/pci.h>
#include <linux/security.h>
#include <linux/slab.h>

#include "phx.h"

static int phx_pcibar_acquire(struct phx_reg *reg, const struct phx_register *arg,
			      struct file *file)
{
	struct pci_dev *pdev;
	resource_size_t start, len;
	unsigned long flags;
	u16 cmd;
	int bar = arg->pci_bar, ret;

	if (!file_ns_capable(file, &init_user_ns, CAP_SYS_ADMIN))
		return -EPERM;
	ret = security_locked_down(LOCKDOWN_PCI_ACCESS);
	if (ret)
		return ret;
	pdev = pci_get_domain_bus_and_slot(arg->pci_domain, arg->pci_bus,
					   arg->pci_devfn);
	if (!pdev)
		return -ENODEV;
	reg->pdev = pdev;	/* put when the registration is freed */
	reg->bar = bar;

	flags = pci_resource_flags(pdev, bar);
	start = pci_resource_start(pdev, bar);
	len = pci_resource_len(pdev, bar);
	if (!(flags & IORESOURCE_MEM) || (flags & IORESOURCE_UNSET) || !len)
		return -EINVAL;
	if (!(flags & IORESOURCE_PREFETCH)) {
		pr_info_ratelimited("%s: BAR %d is not prefetchable (registers, not memory)\n",
				    pci_name(pdev), bar);
		return -EINVAL;
	}
	if (arg->offset >= len || arg->length > len - arg->offset)
		return -EINVAL;
	if (!IS_ALIGNED(start + arg->offset, PHX_REG_ALIGN))
		return -EINVAL;
	pci_read_config_word(pdev, PCI_COMMAND, &cmd);
	if (!(cmd & PCI_COMMAND_MEMORY)) {
		pr_info_ratelimited("%s: memory decoding is off; enable the device first\n",
				    pci_name(pdev));
		return -ENXIO;
	}

	reg->ranges = kvzalloc(sizeof(*reg->ranges), GFP_KERNEL);
	if (!reg->ranges)
		return -ENOMEM;
	reg->ranges[0].start = start + arg->offset;
	reg->ranges[0].end = start + arg->offset + arg->length - 1;
	reg->nr_ranges = 1;
	return 0;
}

const struct phx_provider phx_pcibar_provider = {
	.name = "pcibar",
	.owner = THIS_MODULE,
	.acquire = phx_pcibar_acquire,
};
