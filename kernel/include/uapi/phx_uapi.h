/* SPDX-License-Identifier: GPL-2.0 WITH Linux-syscall-note */
/*
 * phx_uapi.h - ioctl ABI of /dev/phx (phx.ko), shared with libphx.
 *
 * Versioning: every argument struct starts with abi_version, which the
 * caller sets to PHX_ABI_VERSION.  The kernel refuses any other value with
 * -EINVAL; the ioctl numbers also encode the struct sizes.  Every reserved
 * field and every undefined flag bit must be zero (-EINVAL otherwise), so
 * later versions can give them a meaning.
 *
 * Sequence (see docs/kernel.md):
 *   fd = open("/dev/phx", O_RDWR | O_CLOEXEC);
 *   ioctl(fd, PHX_IOC_INFO, &info);          optional: what this kernel offers
 *   ioctl(fd, PHX_IOC_REGISTER, &reg);       reg.handle, reg.mmap_offset out
 *   p = mmap(NULL, reg.length, PROT_READ | PROT_WRITE, MAP_SHARED, fd,
 *            reg.mmap_offset);
 *   ... O_DIRECT pread/pwrite/io_uring read/write on p ...
 *   munmap(p, reg.length);
 *   ioctl(fd, PHX_IOC_UNREGISTER, &unreg);   or close(fd): releases all
 */
#ifndef _UAPI_PHX_UAPI_H
#define _UAPI_PHX_UAPI_H

#include <linux/ioctl.h>
#include <linux/types.h>

#define PHX_ABI_VERSION		1
#define PHX_DEVICE_PATH		"/dev/phx"

/* Registrations are made of whole ZONE_DEVICE subsections (2 MiB). */
#define PHX_REG_ALIGN		(2ULL << 20)

/* Providers of device memory (struct phx_register.provider). */
#define PHX_PROV_PCIBAR		1	/* a PCI BAR sub-range; CAP_SYS_ADMIN */
#define PHX_PROV_NVIDIA		2	/* caller's GPU VA via nvidia_p2p */

/* struct phx_register.flags (in) */
/*
 * GENERIC mode only: register even if an IOMMU translates or swiotlb
 * bounces DMA for the provider device or a storage controller (the I/O
 * may then miss the memory).  Needs CAP_SYS_RAWIO of the opener (-EPERM).
 */
#define PHX_REG_ALLOW_IOMMU	(1U << 0)
#define PHX_REG_FLAGS_ALL	(PHX_REG_ALLOW_IOMMU)

/* struct phx_register.mode (out): the kind of struct pages created */
#define PHX_MODE_GENERIC	1	/* MEMORY_DEVICE_GENERIC fallback */
#define PHX_MODE_P2PDMA		2	/* MEMORY_DEVICE_PCI_P2PDMA (upstream) */

/* struct phx_register.status and struct phx_info.flags (out) */
#define PHX_ST_IOMMU		(1U << 0) /* IOMMU translates for the device */
#define PHX_ST_P2PDMA		(1U << 1) /* kernel has CONFIG_PCI_P2PDMA */
#define PHX_ST_NVIDIA		(1U << 2) /* NVIDIA provider (phx_nv.ko) loaded */
#define PHX_ST_REVOKED		(1U << 3) /* registration revoked */
#define PHX_ST_BOUNCE		(1U << 4) /* DMA is bounced (swiotlb, CoCo) */
/* the PCI device holding the memory was not found: DMA translation unknown */
#define PHX_ST_UNKNOWN_DEV	(1U << 5)

/**
 * struct phx_info - PHX_IOC_INFO: what the loaded module offers.
 * @abi_version: in: PHX_ABI_VERSION; out: the module's ABI version.
 * @flags: out: PHX_ST_* bits valid for the whole module.
 * @reg_align: out: alignment of offsets and lengths (PHX_REG_ALIGN).
 * @max_reg_bytes: out: the largest registration accepted.
 * @nr_regs: out: live registrations of all processes.
 * @nr_pages_busy: out: pages of revoked registrations still waited on.
 * @pad: must be zero.
 * @reserved: must be zero.
 */
struct phx_info {
	__u32 abi_version;
	__u32 flags;
	__u32 reg_align;
	__u32 pad;
	__u64 max_reg_bytes;
	__u64 nr_regs;
	__u64 nr_pages_busy;
	__u64 reserved[4];
};

/**
 * struct phx_register - PHX_IOC_REGISTER: make device memory mappable.
 * @abi_version: in: PHX_ABI_VERSION.
 * @provider: in: PHX_PROV_*.
 * @flags: in: PHX_REG_* bits.
 * @pci_domain: in (PCIBAR): PCI domain (segment) of the device.
 * @pci_bus: in (PCIBAR): bus number.
 * @pci_devfn: in (PCIBAR): (slot << 3) | function.
 * @pci_bar: in (PCIBAR): BAR index 0..5 (a memory BAR).
 * @pad: must be zero.
 * @handle: out: names the registration in PHX_IOC_UNREGISTER.
 * @offset: in (PCIBAR): byte offset in the BAR, multiple of PHX_REG_ALIGN.
 * @length: in: bytes, multiple of PHX_REG_ALIGN, at most max_reg_bytes.
 * @gpu_va: in (NVIDIA): the caller's GPU virtual address; 0 for PCIBAR.
 * @mmap_offset: out: the offset to pass to mmap() on the same fd.
 * @mode: out: PHX_MODE_*.
 * @status: out: PHX_ST_* bits for this registration.
 * @reserved: must be zero.
 */
struct phx_register {
	__u32 abi_version;
	__u32 provider;
	__u32 flags;
	__u32 pci_domain;
	__u8  pci_bus;
	__u8  pci_devfn;
	__u8  pci_bar;
	__u8  pad;
	__u32 handle;
	__u64 offset;
	__u64 length;
	__u64 gpu_va;
	__u64 mmap_offset;
	__u32 mode;
	__u32 status;
	__u64 reserved[4];
};

/**
 * struct phx_unregister - PHX_IOC_UNREGISTER: revoke a registration.
 * @abi_version: in: PHX_ABI_VERSION.
 * @handle: in: from PHX_IOC_REGISTER on the same fd.
 * @flags: in: must be zero.
 * @pad: must be zero.
 *
 * All user mappings of the registration are zapped at once (later access
 * gets SIGBUS, later I/O -EFAULT); the call returns after nothing holds
 * its pages any more (I/O in flight, a pipe, a fixed buffer) and they are
 * gone.  A signal ends the wait with -EINTR: the handle is gone then, and
 * the teardown completes in the background.
 */
struct phx_unregister {
	__u32 abi_version;
	__u32 handle;
	__u32 flags;
	__u32 pad;
};

#define PHX_IOC_MAGIC		0xD7
#define PHX_IOC_INFO		_IOWR(PHX_IOC_MAGIC, 0x00, struct phx_info)
#define PHX_IOC_REGISTER	_IOWR(PHX_IOC_MAGIC, 0x01, struct phx_register)
#define PHX_IOC_UNREGISTER	_IOW(PHX_IOC_MAGIC, 0x02, struct phx_unregister)

#endif /* _UAPI_PHX_UAPI_H */
