// SPDX-License-Identifier: GPL-2.0
/*
 * phx_nv.ko - the NVIDIA provider of phx: the caller's own GPU memory
 * through the NVIDIA driver's peer-to-peer API (nv-p2p.h).
 *
 * A module of its own, so that phx.ko loads on machines without the
 * NVIDIA driver: phx_nv.ko links against nvidia_p2p_get_pages(),
 * nvidia_p2p_put_pages() and nvidia_p2p_free_page_table() like
 * nvidia-peermem does (built with the driver's Module.symvers, it depends
 * on the module exporting them), and registers itself with phx.ko.  No
 * run-time symbol lookup: a kprobe lookup returns an address past the
 * ENDBR on IBT kernels, where the indirect call faults.
 *
 * p2p_token 0 / va_space 0 ask the driver for the caller's own address
 * space: a process can only register GPU memory it owns.
 *
 * The free callback.  The driver calls phx_nv_free_cb() when the memory
 * goes away under a registration (cudaFree, process exit) and frees or
 * reuses the memory as soon as it returns.  So the callback revokes the
 * registration (user PTEs zapped: later access SIGBUS, later I/O -EFAULT)
 * and waits, bounded, until no DMA into the memory is in flight; it frees
 * the page table, and never calls put_pages.  The callback may come at any
 * time after get_pages registered it, even before get_pages returned or
 * while phx is still setting the registration up: a small state machine
 * under ctx->lock decides who frees the page table, and phx's core makes
 * a registration live only if it was not revoked first.
 */
#define pr_fmt(fmt) KBUILD_MODNAME ": " fmt

#include <linux/completion.h>
#include <linux/module.h>
#include <linux/pci.h>
#include <linux/slab.h>
#include <linux/spinlock.h>

#include "phx.h"
#include "phx_nv_p2p.h"

/**
 * enum phx_nv_state - who owns the page table of a &struct phx_nv_ctx.
 * @PHX_NV_ACQUIRING: get_pages runs.
 * @PHX_NV_READING: phx reads the table (sleeps: not under the lock); a
 *	callback now waits until phx is done with it.
 * @PHX_NV_ACTIVE: registered; the callback or phx_nv_release() ends it.
 * @PHX_NV_FREED_EARLY: the callback came while get_pages ran: it freed the
 *	table if get_pages had already stored it (else the acquiring side
 *	does), and the registration fails.
 * @PHX_NV_FREED: the callback took it (it frees the table).
 * @PHX_NV_RELEASED: phx_nv_release() took it (put_pages frees the table).
 */
enum phx_nv_state {
	PHX_NV_ACQUIRING,
	PHX_NV_READING,
	PHX_NV_ACTIVE,
	PHX_NV_FREED_EARLY,
	PHX_NV_FREED,
	PHX_NV_RELEASED,
};

/**
 * struct phx_nv_ctx - one registration's NVIDIA state.
 * @reg: the registration.
 * @pt: the driver's page table.
 * @va: the GPU virtual address registered.
 * @lock: protects @state, @early_freed, @cb_waiting (a spinlock: unlike a
 *	mutex, it may be freed as soon as the last holder dropped it).
 * @state: see &enum phx_nv_state.
 * @early_freed: FREED_EARLY, and the callback freed the table.
 * @cb_waiting: a callback waits for @read_done.
 * @read_done: completed when phx stopped reading the table.
 * @cb_done: completed when a callback that took the table is done with it.
 */
struct phx_nv_ctx {
	struct phx_reg *reg;
	struct nvidia_p2p_page_table *pt;
	u64 va;
	spinlock_t lock;		/* see above */
	enum phx_nv_state state;
	bool early_freed;
	bool cb_waiting;
	struct completion read_done;
	struct completion cb_done;
};

/*
 * The driver takes the memory back.  Whatever phx was doing, the table is
 * freed here (as the driver requires) unless put_pages already took it.
 */
static void phx_nv_free_cb(void *data)
{
	struct phx_nv_ctx *ctx = data;
	struct nvidia_p2p_page_table *early;
	enum phx_nv_state was;

	spin_lock(&ctx->lock);
	was = ctx->state;
	switch (was) {
	case PHX_NV_ACQUIRING:
		/* not used yet: nothing to wait for */
		ctx->state = PHX_NV_FREED_EARLY;
		early = READ_ONCE(ctx->pt);
		ctx->early_freed = !!early;
		spin_unlock(&ctx->lock);
		if (early)
			nvidia_p2p_free_page_table(early);
		return;
	case PHX_NV_READING:
		ctx->cb_waiting = true;
		spin_unlock(&ctx->lock);
		wait_for_completion(&ctx->read_done);
		spin_lock(&ctx->lock);
		was = ctx->state;	/* ACTIVE, or FREED by a failed read */
		break;
	default:
		break;
	}
	if (was == PHX_NV_ACTIVE)
		ctx->state = PHX_NV_FREED;
	spin_unlock(&ctx->lock);
	if (was != PHX_NV_ACTIVE && was != PHX_NV_FREED)
		return;		/* released: put_pages has the table */
	/* no user access from now on, and no DMA in flight when we return */
	phx_reg_provider_revoke(ctx->reg);
	nvidia_p2p_free_page_table(ctx->pt);
	complete(&ctx->cb_done);
}

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
		pr_info_ratelimited("page table version %#x, phx was built for %#x\n",
				    pt->version, NVIDIA_P2P_PAGE_TABLE_VERSION);
		return -EPROTO;
	}
	if (!psz || (u64)pt->entries * psz != reg->length)
		return -EINVAL;
	reg->ranges = kvcalloc(pt->entries, sizeof(*reg->ranges), GFP_KERNEL);
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

static void phx_nv_put(struct phx_nv_ctx *ctx)
{
	int ret = nvidia_p2p_put_pages(0, 0, ctx->va, ctx->pt);

	if (ret)
		pr_info_ratelimited("nvidia_p2p_put_pages: %d\n", ret);
}

static int phx_nv_acquire(struct phx_reg *reg, const struct phx_register *arg,
			  struct file *file)
{
	struct phx_nv_ctx *ctx;
	bool waiting;
	int ret;

	ctx = kzalloc(sizeof(*ctx), GFP_KERNEL);
	if (!ctx)
		return -ENOMEM;
	ctx->reg = reg;
	ctx->va = arg->gpu_va;
	spin_lock_init(&ctx->lock);
	init_completion(&ctx->read_done);
	init_completion(&ctx->cb_done);
	ctx->state = PHX_NV_ACQUIRING;

	/* not under ctx->lock: the driver may call back from inside */
	ret = nvidia_p2p_get_pages(0, 0, arg->gpu_va, arg->length, &ctx->pt,
				   phx_nv_free_cb, ctx);
	if (ret) {
		kfree(ctx);
		return ret < 0 ? ret : -EINVAL;
	}

	spin_lock(&ctx->lock);
	if (ctx->state == PHX_NV_FREED_EARLY) {
		bool freed = ctx->early_freed;

		spin_unlock(&ctx->lock);
		if (!freed)	/* the driver called back before storing it */
			nvidia_p2p_free_page_table(ctx->pt);
		kfree(ctx);
		return -EFAULT;		/* freed before it could be used */
	}
	ctx->state = PHX_NV_READING;
	spin_unlock(&ctx->lock);

	ret = phx_nv_ranges(reg, ctx->pt);
	if (!ret && reg->nr_ranges)
		reg->pdev = phx_nv_find_dev(reg->ranges[0].start, &reg->bar);

	spin_lock(&ctx->lock);
	waiting = ctx->cb_waiting;
	if (!ret)
		ctx->state = PHX_NV_ACTIVE;	/* a waiting callback revokes */
	else
		ctx->state = waiting ? PHX_NV_FREED : PHX_NV_RELEASED;
	spin_unlock(&ctx->lock);
	complete_all(&ctx->read_done);
	if (ret) {
		if (waiting)
			wait_for_completion(&ctx->cb_done);
		else
			phx_nv_put(ctx);
		kfree(ctx);
		return ret;
	}
	reg->prov_data = ctx;
	return 0;
}

static void phx_nv_release(struct phx_reg *reg)
{
	struct phx_nv_ctx *ctx = reg->prov_data;
	bool put;

	if (!ctx)
		return;
	spin_lock(&ctx->lock);
	put = ctx->state == PHX_NV_ACTIVE;
	if (put)
		ctx->state = PHX_NV_RELEASED;
	spin_unlock(&ctx->lock);
	if (put)
		phx_nv_put(ctx);	/* the driver frees the table */
	else
		wait_for_completion(&ctx->cb_done);
	reg->prov_data = NULL;
	kfree(ctx);
}

static const struct phx_provider phx_nvidia_provider = {
	.name = "nvidia",
	.owner = THIS_MODULE,
	.revocable = true,
	.acquire = phx_nv_acquire,
	.release = phx_nv_release,
};

static int __init phx_nv_init(void)
{
	int ret = phx_provider_register(PHX_PROV_NVIDIA, &phx_nvidia_provider);

	if (!ret)
		pr_info("NVIDIA provider registered with phx\n");
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
