// SPDX-License-Identifier: GPL-2.0
/*
 * Struct pages for registered device memory.
 *
 * Two ways, chosen per registration:
 *
 * MEMORY_DEVICE_PCI_P2PDMA (kernels with CONFIG_PCI_P2PDMA, devices bound
 * to phx's own PCI driver, see phx_pci.c): the device's BARs were
 * published once, when phx bound it, and phx holds all of that memory; a
 * registration takes its sub-range.  The block layer maps the pages with
 * the P2PDMA rules (bus addresses, IOMMU-aware).  No devres is ever added
 * to a device another driver owns.
 *
 * MEMORY_DEVICE_GENERIC (everything else, e.g. Debian 6.12 kernels, GPU
 * memory owned by the NVIDIA driver): the ranges are handed to
 * memremap_pages() as they are.  The DMA API then treats the pages like
 * RAM: DMA addresses are CPU physical addresses.  That reaches the device
 * memory only when no IOMMU translates for the DMA initiator and no bounce
 * buffering (swiotlb) is forced.  The initiator is not known when memory
 * is registered (any storage controller may be handed the pages later),
 * so phx looks at every PCI storage controller as well as at the device
 * holding the memory, and refuses when any of them translates or bounces,
 * or when it cannot tell (the device holding the memory was not found),
 * unless PHX_REG_ALLOW_IOMMU is passed by an opener with CAP_SYS_RAWIO.
 *
 * Reference counts: before 6.15 every ZONE_DEVICE page of these two kinds
 * idles at count 1; from 6.15 on P2PDMA pages idle at 0 (vm_insert_page()
 * refuses those) and are handed back to the P2PDMA pool when a count falls
 * to 0.  phx therefore looks at the pages it got: where they are at 0 it
 * takes the idle reference itself and drops it at teardown without
 * freeing (the whole allocation goes back at once).  Either way a phx page
 * idles at 1, and teardown waits for that.
 */
#define pr_fmt(fmt) KBUILD_MODNAME ": " fmt

#include <linux/cc_platform.h>
#include <linux/device.h>
#include <linux/iommu.h>
#include <linux/memremap.h>
#include <linux/mm.h>
#include <linux/page_ref.h>
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

/**
 * phx_mem_initiator_status - PHX_ST_* conditions of the possible DMA
 * initiators.
 *
 * The device that will DMA into a registration is whichever storage
 * controller serves the file the user reads later; it is not known at
 * registration.  So every PCI mass-storage controller counts (NVMe, SATA,
 * SAS, RAID): one whose DMA an IOMMU translates or swiotlb bounces makes
 * the DMA address of a GENERIC page (its CPU physical address) unsafe.
 *
 * Return: PHX_ST_IOMMU and/or PHX_ST_BOUNCE, or 0.
 */
u32 phx_mem_initiator_status(void)
{
	struct pci_dev *pdev = NULL;
	u32 st = 0;

	while ((pdev = pci_get_device(PCI_ANY_ID, PCI_ANY_ID, pdev))) {
		if ((pdev->class >> 16) != PCI_BASE_CLASS_STORAGE)
			continue;
		st |= phx_mem_dev_status(pdev) & (PHX_ST_IOMMU | PHX_ST_BOUNCE);
	}
	return st;
}

/* Give every page of @reg the idle count 1 (see the top of this file). */
static void phx_mem_take_refs(struct phx_reg *reg)
{
	unsigned long nr = reg->length >> PAGE_SHIFT, idx;

	reg->own_ref = !page_ref_count(phx_reg_page(reg, 0));
	if (!reg->own_ref)
		return;
	for (idx = 0; idx < nr; idx++)
		set_page_count(phx_reg_page(reg, idx), 1);
}

/* Drop the references phx_mem_take_refs() took; the pages are idle. */
static void phx_mem_drop_refs(struct phx_reg *reg)
{
	unsigned long nr = reg->length >> PAGE_SHIFT, idx, odd = 0;

	if (!reg->own_ref)
		return;
	for (idx = 0; idx < nr; idx++)
		if (!page_ref_dec_and_test(phx_reg_page(reg, idx)))
			odd++;
	if (odd)
		pr_err("handle %u: %lu pages still referenced at teardown\n",
		       reg->handle, odd);
	reg->own_ref = false;
}

/* serialises the creation and removal of GENERIC pagemaps */
static DEFINE_MUTEX(phx_mem_lock);

/*
 * memremap_pages() of GENERIC pages: their count never reaches 0 while
 * phx holds the initial reference, and the core resets a freed GENERIC
 * page to 1 itself, so the pagemap needs no free callback (which is
 * .page_free before 6.19 and .folio_free after: no version switch).
 */
static int phx_generic_create(struct phx_reg *reg)
{
	struct dev_pagemap *pgmap;
	void *addr;
	int nid = reg->pdev ? dev_to_node(&reg->pdev->dev) : NUMA_NO_NODE;

	/* CPU physical addresses as DMA addresses: only without translation */
	if ((reg->status & (PHX_ST_IOMMU | PHX_ST_BOUNCE | PHX_ST_UNKNOWN_DEV)) &&
	    !(reg->flags & PHX_REG_ALLOW_IOMMU)) {
		pr_info_ratelimited("%s: DMA for %s is %s; GENERIC pages might not reach its memory (boot with iommu=pt, use a CONFIG_PCI_P2PDMA kernel, or pass PHX_REG_ALLOW_IOMMU)\n",
				    current->comm,
				    reg->pdev ? pci_name(reg->pdev) : "the memory",
				    reg->status & PHX_ST_IOMMU ? "IOMMU-translated" :
				    reg->status & PHX_ST_BOUNCE ? "bounced" :
				    "of unknown translation (no PCI device holds it)");
		return -EOPNOTSUPP;
	}
	pgmap = kzalloc(struct_size(pgmap, ranges, reg->nr_ranges),
			GFP_KERNEL_ACCOUNT);
	if (!pgmap)
		return -ENOMEM;
	pgmap->type = MEMORY_DEVICE_GENERIC;
	pgmap->nr_range = reg->nr_ranges;
	memcpy(pgmap->ranges, reg->ranges,
	       reg->nr_ranges * sizeof(*reg->ranges));
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

/*
 * Under phx_mem_lock, like the creation: memunmap_pages() clears the
 * sections (pfn_valid() turns false) before it drops the pagemap, so a
 * registration of the same range in between would pass phx's check and
 * meet the old pagemap inside memremap_pages().
 */
static void phx_generic_destroy(struct phx_reg *reg)
{
	lockdep_assert_held(&phx_mem_lock);
	memunmap_pages(reg->pgmap);
	kfree(reg->pgmap);
	reg->pgmap = NULL;
}

/*
 * memremap_pages() WARNs on a range that already has a pagemap or is RAM;
 * a user must never get there.  Refuse every 2 MiB chunk (a memory
 * subsection) that already has struct pages: ours, anyone's, or RAM's.
 * (pfn_valid() has subsection granularity; get_dev_pagemap() changed its
 * signature between 6.12 and 7.x.)
 */
static bool phx_mem_range_busy(const struct range *r)
{
	u64 a;

	for (a = r->start; a < r->end; a += PHX_REG_ALIGN)
		if (pfn_valid(PHYS_PFN(a)))
			return true;
	return false;
}

/**
 * phx_mem_create - create (or, on a phx-bound device, claim) the struct
 * pages of @reg.
 * @reg: ranges, chunk table, pdev and bar filled.
 *
 * Return: 0 (reg->mode says which kind), -EBUSY when part of the memory
 * already has struct pages or is registered, or another -errno.
 */
int phx_mem_create(struct phx_reg *reg)
{
	struct phx_pci *pp;
	unsigned int i;
	int ret;

	pp = reg->prov == &phx_pcibar_provider ? phx_pci_get(reg->pdev) : NULL;
	if (pp) {
		ret = phx_pci_claim(pp, reg);	/* keeps the reference on success */
		if (ret)
			phx_pci_put(pp);
		goto out_refs;
	}
	mutex_lock(&phx_mem_lock);
	for (i = 0; i < reg->nr_ranges; i++) {
		if (phx_mem_range_busy(&reg->ranges[i])) {
			mutex_unlock(&phx_mem_lock);
			return -EBUSY;
		}
	}
	ret = phx_generic_create(reg);
	mutex_unlock(&phx_mem_lock);
out_refs:
	if (!ret)
		phx_mem_take_refs(reg);
	return ret;
}

/* Remove the pages of @reg; nobody may hold one any more. */
void phx_mem_destroy(struct phx_reg *reg)
{
	phx_mem_drop_refs(reg);
	if (reg->p2p) {
		phx_pci_unclaim(reg);
	} else if (reg->pgmap) {
		mutex_lock(&phx_mem_lock);
		phx_generic_destroy(reg);
		mutex_unlock(&phx_mem_lock);
	}
}
