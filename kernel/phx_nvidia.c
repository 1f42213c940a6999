// SPDX-License-Identifier: GPL-2.0
/*
 * phx_nv.ko - the NVIDIA provider of phx: the caller's own GPU memory
 * through the NVIDIA driver's peer-to-peer API (nv-p2p.h), pinned.
 *
 * A module of its own, so that phx.ko loads on machines without the
 * NVIDIA driver: phx_nv.ko links against the nvidia_p2p_* symbols like
 * nvidia-peermem does (built with the driver's Module.symvers, it depends
 * on the module exporting them), and registers itself with phx.ko through
 * GPL-only exports, so the kernel loads it only next to a GPL-compatible
 * driver (the open kernel modules).  No run-time symbol lookup.
 *
 * Persistent mappings only.  phx hands the memory to the rest of the
 * kernel as struct pages, and anything that can take a page reference
 * (O_DIRECT I/O in its time-out, vmsplice into a pipe, zero-copy sockets,
 * FUSE or NFS direct I/O) may keep one for as long as it likes.  So the
 * memory must stay phx's until the last reference is gone, which only a
 * persistent mapping gives: the driver keeps the memory allocated (even
 * after cudaFree or the owner's exit) until phx puts the pages, there is
 * no free callback, and the put works from any context (phx puts from a
 * workqueue, after the last page reference went).  The non-persistent
 * API cannot be made safe: its free callback must return promptly (it
 * runs inside the driver's free path, under its locks), and after it
 * returns the driver reuses memory that a page reference may still reach.
 * Drivers that have no persistent API are refused.
 *
 * Two generations of the persistent API are used, found at load time
 * through weak references (absent ones resolve to NULL):
 *   - nvidia_p2p_get_pages_persistent() / nvidia_p2p_put_pages_persistent()
 *     (drivers from R535 on);
 *   - nvidia_p2p_cap_persistent_pages != 0: nvidia_p2p_get_pages() with a
 *     NULL callback, released with nvidia_p2p_put_pages() (R515 to R530).
 * The driver refuses persistent mappings on MIG, vGPU and confidential
 * computing (-ENOTSUPP); phx then fails with -EOPNOTSUPP and says why.
 *
 * Like p2p_token 0 / va_space 0 before it, the persistent API resolves the
 * VA in the calling process's GPU address space: a process can only
 * register GPU memory it owns.
 */
#define pr_fmt(fmt) KBUILD_MODNAME ": " fmt

#define PHX_NV_OPTIONAL __weak
#include <linux/module.h>
#include <linux/pci.h>
#include <linux/slab.h>

#include "phx.h"
#include "phx_nv_p2p.h"

/**
 * enum phx_nv_api - which persistent API the loaded driver offers.
 * @PHX_NV_API_NONE: none: registrations are refused.
 * @PHX_NV_API_PERSISTENT: nvidia_p2p_{get,put}_pages_persistent().
 * @PHX_NV_API_CAP: nvidia_p2p_get_pages() without callback (R515-R530).
 */
enum phx_nv_api {
	PHX_NV_API_NONE,
	PHX_NV_API_PERSISTENT,
	PHX_NV_API_CAP,
};

/**
 * struct phx_nv_ctx - one registration's NVIDIA state.
 * @pt: the driver's page table (the driver's until put).
 * @va: the GPU virtual address registered.
 * @api: the API that got it (and must put it).
 */
struct phx_nv_ctx {
	struct nvidia_p2p_page_table *pt;
	u64 va;
	enum phx_nv_api api;
};

static enum phx_nv_api phx_nv_api(void)
{
	if (nvidia_p2p_get_pages_persistent && nvidia_p2p_put_pages_persistent)
		return PHX_NV_API_PERSISTENT;
	if (&nvidia_p2p_cap_persistent_pages && nvidia_p2p_cap_persistent_pages)
		return PHX_NV_API_CAP;
	return PHX_NV_API_NONE;
}

static const char *const phx_nv_api_names[] = {
	[PHX_NV_API_NONE] = "none",
	[PHX_NV_API_PERSISTENT] = "nvidia_p2p_get_pages_persistent",
	[PHX_NV_API_CAP] = "nvidia_p2p_get_pages without callback",
};

static u64 phx_nv_page_bytes(u32 type)
{
	switch (type) {
	case NVIDIA_P2P_PAGE_SIZE_4KB:
		return SZ_4K;
	case NVIDIA_P2P_PAGE_SIZE_64KB:
		return SZ_64K;
	case NVIDIA_P2P_PAGE_SIZE_128KB:
		return SZ_128K;
	default:
		return 0;
	}
}

/*
 * Merge the GPU pages into physically contiguous runs; the core checks
 * that they are whole 2 MiB chunks.  kvcalloc: a 16 GiB registration of
 * 64 KiB pages has 256 Ki entries, more than kmalloc gives.
 */
static int phx_nv_ranges(struct phx_reg *reg, struct nvidia_p2p_page_table *pt)
{
	u64 psz = phx_nv_page_bytes(pt->page_size);
	unsigned int i, n = 0;

	if (!phx_nv_pt_compatible(pt)) {
		pr_info_ratelimited("page table version %#x, phx reads %#x and %#x\n",
				    pt->version, PHX_NV_PT_VERSION_V1,
				    NVIDIA_P2P_PAGE_TABLE_VERSION);
		return -EPROTO;
	}
	if (phx_nv_pt_flags(pt) & NVIDIA_P2P_PAGE_TABLE_FLAGS_CPU_CACHEABLE) {
		pr_info_ratelimited("the driver gave CPU-cacheable (coherent) memory, not BAR1 memory: not supported\n");
		return -EOPNOTSUPP;
	}
	if (!psz || (u64)pt->entries * psz != reg->length)
		return -EINVAL;
	reg->ranges = kvcalloc(pt->entries, sizeof(*reg->ranges),
			       GFP_KERNEL_ACCOUNT);
	if (!reg->ranges)
		return -ENOMEM;
	for (i = 0; i < pt->entries; i++) {
		u64 pa = pt->pages[i]->physical_address;

		if (n && reg->ranges[n - 1].end + 1 == pa) {
			reg->ranges[n - 1].end += psz;
			continue;
		}
		reg->ranges[n].start = pa;
		reg->ranges[n].end = pa + psz - 1;
		n++;
	}
	reg->nr_ranges = n;
	return 0;
}

/*
 * The PCI device whose BAR holds @pa, with a reference; its BAR index in
 * *bar.  Any vendor: the stub provider of the tests lends another
 * device's BAR.
 */
static struct pci_dev *phx_nv_find_dev(u64 pa, int *bar)
{
	struct pci_dev *pdev = NULL;
	int i;

	while ((pdev = pci_get_device(PCI_ANY_ID, PCI_ANY_ID, pdev))) {
		for (i = 0; i <= PCI_STD_RESOURCE_END; i++) {
			struct resource *r = pci_resource_n(pdev, i);

			if ((r->flags & IORESOURCE_MEM) && pa >= r->start &&
			    pa <= r->end) {
				*bar = i;
				return pdev;
			}
		}
	}
	return NULL;
}

/*
 * Give the memory back to the driver.  Any context: a persistent table is
 * found by its own pointer, not by the calling process.  A failing put
 * leaves the memory pinned by the driver (it keeps the table), which is
 * safe; there is nothing phx could retry.
 */
static void phx_nv_put(struct phx_nv_ctx *ctx)
{
	int ret;

	if (ctx->api == PHX_NV_API_PERSISTENT)
		ret = nvidia_p2p_put_pages_persistent(ctx->va, ctx->pt, 0);
	else
		ret = nvidia_p2p_put_pages(0, 0, ctx->va, ctx->pt);
	if (ret)
		pr_err("putting GPU VA %#llx failed (%d): the driver keeps that memory pinned\n",
		       ctx->va, ret);
}

static int phx_nv_acquire(struct phx_reg *reg, const struct phx_register *arg,
			  struct file *file)
{
	struct phx_nv_ctx *ctx;
	int ret;

	ctx = kzalloc(sizeof(*ctx), GFP_KERNEL_ACCOUNT);
	if (!ctx)
		return -ENOMEM;
	ctx->va = arg->gpu_va;
	ctx->api = phx_nv_api();
	switch (ctx->api) {
	case PHX_NV_API_PERSISTENT:
		ret = nvidia_p2p_get_pages_persistent(arg->gpu_va, arg->length,
						      &ctx->pt, 0);
		break;
	case PHX_NV_API_CAP:
		ret = nvidia_p2p_get_pages(0, 0, arg->gpu_va, arg->length,
					   &ctx->pt, NULL, NULL);
		break;
	default:
		pr_info_ratelimited("%s: the NVIDIA driver offers no persistent peer-to-peer mapping (it needs R515 or later): GPU memory that the driver could take back is not registered\n",
				    current->comm);
		ret = -EOPNOTSUPP;
		break;
	}
	if (ret) {
		if (ret == -ENOTSUPP)
			pr_info_ratelimited("%s: the NVIDIA driver refused a persistent mapping of GPU VA %#llx (not supported with MIG, vGPU or confidential computing)\n",
					    current->comm, arg->gpu_va);
		kfree(ctx);
		return ret < 0 ? ret : -EINVAL;
	}

	ret = phx_nv_ranges(reg, ctx->pt);
	if (!ret && reg->nr_ranges)
		reg->pdev = phx_nv_find_dev(reg->ranges[0].start, &reg->bar);
	if (ret) {
		phx_nv_put(ctx);
		kfree(ctx);
		return ret;
	}
	reg->prov_data = ctx;
	return 0;
}

/* After the last page reference went, on phx's workqueue or in close(). */
static void phx_nv_release(struct phx_reg *reg)
{
	struct phx_nv_ctx *ctx = reg->prov_data;

	if (!ctx)
		return;
	phx_nv_put(ctx);
	reg->prov_data = NULL;
	kfree(ctx);
}

static const struct phx_provider phx_nvidia_provider = {
	.name = "nvidia",
	.owner = THIS_MODULE,
	.acquire = phx_nv_acquire,
	.release = phx_nv_release,
};

static int __init phx_nv_init(void)
{
	int ret = phx_provider_register(PHX_PROV_NVIDIA, &phx_nvidia_provider);

	if (!ret)
		pr_info("NVIDIA provider registered with phx (persistent API: %s)\n",
			phx_nv_api_names[phx_nv_api()]);
	return ret;
}

static void __exit phx_nv_exit(void)
{
	phx_provider_unregister(PHX_PROV_NVIDIA);
}

module_init(phx_nv_init);
module_exit(phx_nv_exit);

MODULE_DESCRIPTION("phx: GPU memory through the NVIDIA peer-to-peer API");
MODULE_LICENSE("GPL");
