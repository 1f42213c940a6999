// SPDX-License-Identifier: GPL-2.0
/*
 * Struct pages for registered device memory.
 *
 * Two ways, chosen per registration:
 *
 * MEMORY_DEVICE_PCI_P2PDMA (kernels with CONFIG_PCI_P2PDMA): the exact
 * sub-range is published with the upstream pci_p2pdma_add_resource() and
 * allocated back with pci_alloc_p2pmem(); the block layer then maps it
 * with the P2PDMA rules (bus addresses, IOMMU-aware).  No private kernel
 * struct is touched.  The published resources live in a devres group that
 * phx opens on the provider device and releases when its last
 * registration on that device is gone.
 *
 * MEMORY_DEVICE_GENERIC (the fallback, e.g. Debian kernels): the range is
 * handed to memremap_pages() as it is.  The DMA API then treats the pages
 * like RAM: DMA addresses are CPU physical addresses.  That reaches the
 * device memory only when no IOMMU translates for the DMA initiator and no
 * bounce buffering (swiotlb) is forced; phx reports an IOMMU in
 * PHX_ST_IOMMU and refuses unless PHX_REG_ALLOW_IOMMU is passed.
 *
 * In both modes a page's reference count is 1 while nobody uses it; user
 * mappings and pinned I/O raise it, and teardown waits for it to fall back
 * before the pages are removed.
 */
#define pr_fmt(fmt) KBUILD_MODNAME ": " fmt

#include <linux/cc_platform.h>
#include <linux/device.h>
#include <linux/iommu.h>
#include <linux/memremap.h>
#include <linux/pci-p2pdma.h>
#include <linux/slab.h>
#include <linux/swiotlb.h>

#include "phx.h"

u32 phx_mem_module_status(void)
{
	return IS_ENABLED(CONFIG_PCI_P2PDMA) ? PHX_ST_P2PDMA : 0;
}

/**
 * phx_mem_dev_status - PHX_ST_* conditions of a provider device.
 * @pdev: the device.
 *
 * Return: PHX_ST_IOMMU when an IOMMU domain other than identity translates
 * DMA for @pdev, PHX_ST_BOUNCE when swiotlb bounces its DMA or the kernel
 * runs as a confidential guest (both taken as the sign for the platform's
 * DMA initiators too).
 */
u32 phx_mem_dev_status(struct pci_dev *pdev)
{
	u32 st = phx_mem_module_status();
#ifdef CONFIG_IOMMU_API
	struct iommu_domain *dom = iommu_get_domain_for_dev(&pdev->dev);

	if (dom && dom->type != IOMMU_DOMAIN_IDENTITY)
		st |= PHX_ST_IOMMU;
#endif
	if (is_swiotlb_force_bounce(&pdev->dev) ||
	    cc_platform_has(CC_ATTR_GUEST_MEM_ENCRYPT))
		st |= PHX_ST_BOUNCE;
	return st;
}

/* GENERIC pages never reach a zero count while phx holds them. */
static void phx_page_free(struct page *page)
{
}

static const struct dev_pagemap_ops phx_pgmap_ops = {
	.page_free = phx_page_free,
};

static int phx_generic_create(struct phx_reg *reg)
{
	struct dev_pagemap *pgmap;
	void *addr;
	int nid = reg->pdev ? dev_to_node(&reg->pdev->dev) : NUMA_NO_NODE;

	/* CPU physical addresses as DMA addresses: only without translation */
	if ((reg->status & (PHX_ST_IOMMU | PHX_ST_BOUNCE)) &&
	    !(reg->flags & PHX_REG_ALLOW_IOMMU)) {
		pr_info_ratelimited("%s: DMA for %s is %s; GENERIC pages would not reach its memory (boot with iommu=pt, use a CONFIG_PCI_P2PDMA kernel, or pass PHX_REG_ALLOW_IOMMU)\n",
				    current->comm,
				    reg->pdev ? pci_name(reg->pdev) : "the device",
				    reg->status & PHX_ST_IOMMU ? "IOMMU-translated" : "bounced");
		return -EOPNOTSUPP;
	}
	pgmap = kzalloc(struct_size(pgmap, ranges, reg->nr_ranges), GFP_KERNEL);
	if (!pgmap)
		return -ENOMEM;
	pgmap->type = MEMORY_DEVICE_GENERIC;
	pgmap->nr_range = reg->nr_ranges;
	memcpy(pgmap->ranges, reg->ranges,
	       reg->nr_ranges * sizeof(*reg->ranges));
	pgmap->ops = &phx_pgmap_ops;
	addr = memremap_pages(pgmap, nid);
	if (IS_ERR(addr)) {
		pr_info_ratelimited("memremap_pages of %llu bytes failed: %ld (range already registered?)\n",
				    reg->length, PTR_ERR(addr));
		kfree(pgmap);
		return PTR_ERR(addr) == -ENOMEM ? -EBUSY : PTR_ERR(addr);
	}
	reg->pgmap = pgmap;
	reg->mode = PHX_MODE_GENERIC;
	return 0;
}

static void phx_generic_destroy(struct phx_reg *reg)
{
	memunmap_pages(reg->pgmap);
	kfree(reg->pgmap);
	reg->pgmap = NULL;
}

#ifdef CONFIG_PCI_P2PDMA
/*
 * One per provider device on which phx published memory.  @group holds the
 * P2PDMA state phx created on the device (and the first registration's
 * resource); it is released with the device's last registration.
 */
struct phx_p2p_dev {
	struct list_head node;
	struct pci_dev *pdev;
	void *group;
	unsigned int users;
};

static LIST_HEAD(phx_p2p_devs);
static DEFINE_MUTEX(phx_p2p_lock);

static struct phx_p2p_dev *phx_p2p_find(struct pci_dev *pdev)
{
	struct phx_p2p_dev *d;

	list_for_each_entry(d, &phx_p2p_devs, node)
		if (d->pdev == pdev)
			return d;
	return NULL;
}

static int phx_p2p_create(struct phx_reg *reg)
{
	struct pci_dev *pdev = reg->pdev;
	u64 off = reg->ranges[0].start - pci_resource_start(pdev, reg->bar);
	struct phx_p2p_dev *d;
	void *group, *kaddr;
	int ret;

	mutex_lock(&phx_p2p_lock);
	d = phx_p2p_find(pdev);
	if (!d) {
		if (rcu_access_pointer(pdev->p2pdma)) {
			/* its driver owns the P2PDMA state (e.g. an NVMe CMB) */
			ret = -EBUSY;
			goto out_unlock;
		}
		d = kzalloc(sizeof(*d), GFP_KERNEL);
		if (!d) {
			ret = -ENOMEM;
			goto out_unlock;
		}
		d->pdev = pdev;
		list_add(&d->node, &phx_p2p_devs);
	}

	group = devres_open_group(&pdev->dev, NULL, GFP_KERNEL);
	if (!group) {
		ret = -ENOMEM;
		goto out_drop_dev;
	}
	ret = pci_p2pdma_add_resource(pdev, reg->bar, reg->length, off);
	devres_close_group(&pdev->dev, group);
	if (ret) {
		pr_info_ratelimited("%s: publishing BAR %d [%#llx+%#llx] failed: %d\n",
				    pci_name(pdev), reg->bar, off, reg->length,
				    ret);
		goto out_release_group;
	}

	/* The newest chunk is tried first and is exactly our range. */
	kaddr = pci_alloc_p2pmem(pdev, reg->length);
	if (!kaddr) {
		ret = -ENOMEM;
		goto out_release_group;
	}
	if (virt_to_phys(kaddr) != reg->ranges[0].start) {
		pci_free_p2pmem(pdev, kaddr, reg->length);
		ret = -EBUSY;
		goto out_release_group;
	}

	if (!d->group)
		d->group = group;	/* holds the device's P2PDMA state */
	else
		reg->p2p_group = group;
	d->users++;
	reg->p2p = d;
	reg->p2p_kaddr = kaddr;
	reg->mode = PHX_MODE_P2PDMA;
	mutex_unlock(&phx_p2p_lock);
	return 0;

out_release_group:
	devres_release_group(&pdev->dev, group);
out_drop_dev:
	if (!d->users) {
		list_del(&d->node);
		kfree(d);
	}
out_unlock:
	mutex_unlock(&phx_p2p_lock);
	return ret;
}

static void phx_p2p_destroy(struct phx_reg *reg)
{
	struct phx_p2p_dev *d = reg->p2p;

	pci_free_p2pmem(reg->pdev, reg->p2p_kaddr, reg->length);
	mutex_lock(&phx_p2p_lock);
	if (reg->p2p_group)
		devres_release_group(&reg->pdev->dev, reg->p2p_group);
	if (!--d->users) {
		devres_release_group(&d->pdev->dev, d->group);
		list_del(&d->node);
		kfree(d);
	}
	mutex_unlock(&phx_p2p_lock);
	reg->p2p = NULL;
	reg->p2p_group = NULL;
	reg->p2p_kaddr = NULL;
}
#endif /* CONFIG_PCI_P2PDMA */

/*
 * memremap_pages() WARNs on a range that already has a pagemap; a user must
 * never get there.  Refuse ranges with a pagemap (ours or anyone's).
 */
static bool phx_mem_range_busy(const struct range *r)
{
	u64 a;

	for (a = r->start; a < r->end; a += PHX_REG_ALIGN) {
		struct dev_pagemap *pgmap = get_dev_pagemap(PHYS_PFN(a), NULL);

		if (pgmap) {
			put_dev_pagemap(pgmap);
			return true;
		}
	}
	return false;
}

static DEFINE_MUTEX(phx_mem_lock);

/**
 * phx_mem_create - create the struct pages of @reg.
 * @reg: ranges, pdev and bar filled by the provider.
 *
 * Return: 0 (reg->mode says which kind), -EBUSY when part of the memory
 * already has struct pages, or another -errno.
 */
int phx_mem_create(struct phx_reg *reg)
{
	unsigned int i;
	int ret;

	mutex_lock(&phx_mem_lock);
	for (i = 0; i < reg->nr_ranges; i++) {
		if (phx_mem_range_busy(&reg->ranges[i])) {
			ret = -EBUSY;
			goto out;
		}
	}
#ifdef CONFIG_PCI_P2PDMA
	if (reg->pdev && reg->bar >= 0 && reg->nr_ranges == 1) {
		ret = phx_p2p_create(reg);
		goto out;
	}
#endif
	ret = phx_generic_create(reg);
out:
	mutex_unlock(&phx_mem_lock);
	return ret;
}

/* Remove the pages of @reg; nobody may hold one any more. */
void phx_mem_destroy(struct phx_reg *reg)
{
#ifdef CONFIG_PCI_P2PDMA
	if (reg->p2p) {
		phx_p2p_destroy(reg);
		return;
	}
#endif
	if (reg->pgmap)
		phx_generic_destroy(reg);
}
