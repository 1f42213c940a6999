// SPDX-License-Identifier: GPL-2.0
/*
 * The ioctl entry points of /dev/phx.
 *
 * Every argument is copied in, checked field by field (version, reserved
 * fields, unknown flags, alignment, overflow, limits) and only then acted
 * upon.  Out fields carry handles and offsets, never kernel addresses.
 */
#define pr_fmt(fmt) KBUILD_MODNAME ": " fmt

#include <linux/fs.h>
#include <linux/overflow.h>
#include <linux/uaccess.h>

#include "phx.h"

static bool phx_zeroed(const u64 *p, size_t n)
{
	size_t i;

	for (i = 0; i < n; i++)
		if (p[i])
			return false;
	return true;
}

static long phx_ioc_info(void __user *uarg)
{
	struct phx_info info;

	if (copy_from_user(&info, uarg, sizeof(info)))
		return -EFAULT;
	if (info.abi_version != PHX_ABI_VERSION || info.pad ||
	    !phx_zeroed(info.reserved, ARRAY_SIZE(info.reserved)))
		return -EINVAL;
	memset(&info, 0, sizeof(info));
	info.abi_version = PHX_ABI_VERSION;
	info.flags = phx_mem_module_status();
	if (phx_provider_available(PHX_PROV_NVIDIA))
		info.flags |= PHX_ST_NVIDIA;
	info.reg_align = PHX_REG_ALIGN;
	info.max_reg_bytes = phx_max_reg_bytes;
	info.nr_regs = phx_nr_regs();
	info.nr_pages_busy = phx_nr_pages_busy();
	if (copy_to_user(uarg, &info, sizeof(info)))
		return -EFAULT;
	return 0;
}

static int phx_check_register(const struct phx_register *r)
{
	u64 end;

	if (r->abi_version != PHX_ABI_VERSION)
		return -EINVAL;
	if (r->flags & ~PHX_REG_FLAGS_ALL)
		return -EINVAL;
	if (r->pad || !phx_zeroed(r->reserved, ARRAY_SIZE(r->reserved)))
		return -EINVAL;
	if (!r->length || !IS_ALIGNED(r->length, PHX_REG_ALIGN) ||
	    r->length > phx_max_reg_bytes ||
	    r->length > (1ULL << PHX_MMAP_SHIFT))
		return -EINVAL;
	switch (r->provider) {
	case PHX_PROV_PCIBAR:
		if (r->gpu_va || r->pci_bar > PCI_STD_RESOURCE_END ||
		    r->pci_domain > 0xffff ||
		    !IS_ALIGNED(r->offset, PHX_REG_ALIGN) ||
		    check_add_overflow(r->offset, r->length, &end))
			return -EINVAL;
		return 0;
	case PHX_PROV_NVIDIA:
		if (r->pci_domain || r->pci_bus || r->pci_devfn ||
		    r->pci_bar || r->offset ||
		    !IS_ALIGNED(r->gpu_va, PHX_REG_ALIGN) ||
		    check_add_overflow(r->gpu_va, r->length, &end))
			return -EINVAL;
		return 0;
	default:
		return -EINVAL;
	}
}

static long phx_ioc_register(struct file *file, void __user *uarg)
{
	struct phx_register r;
	int ret;

	if (copy_from_user(&r, uarg, sizeof(r)))
		return -EFAULT;
	ret = phx_check_register(&r);
	if (ret)
		return ret;
	r.handle = 0;
	r.mmap_offset = 0;
	r.mode = 0;
	r.status = 0;
	ret = phx_register(file, &r);
	if (ret)
		return ret;
	if (copy_to_user(uarg, &r, sizeof(r))) {
		/* the caller cannot learn the handle: do not leave it behind */
		phx_unregister(file, r.handle);
		return -EFAULT;
	}
	return 0;
}

static long phx_ioc_unregister(struct file *file, void __user *uarg)
{
	struct phx_unregister u;

	if (copy_from_user(&u, uarg, sizeof(u)))
		return -EFAULT;
	if (u.abi_version != PHX_ABI_VERSION || u.flags || u.pad ||
	    !u.handle)
		return -EINVAL;
	return phx_unregister(file, u.handle);
}

long phx_ioctl(struct file *file, unsigned int cmd, unsigned long arg)
{
	void __user *uarg = (void __user *)arg;

	switch (cmd) {
	case PHX_IOC_INFO:
		return phx_ioc_info(uarg);
	case PHX_IOC_REGISTER:
		return phx_ioc_register(file, uarg);
	case PHX_IOC_UNREGISTER:
		return phx_ioc_unregister(file, uarg);
	default:
		return -ENOTTY;
	}
}
