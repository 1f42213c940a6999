// SPDX-License-Identifier: GPL-2.0
/*
 * Provider: the caller's own GPU memory through the NVIDIA
 * driver's documented peer-to-peer API (nv-p2p.h).
 *
 * phx must load on machines without the NVIDIA driver, so it neither
 * includes nv-p2p.h nor links against the nvidia_p2p_* symbols: the API is
 * declared in phx_nv_p2p.h from its documentation and resolved at
 * registration time.  symbol_get() refuses non-GPL exports since Linux 6.6
 * and the NVIDIA exports are plain EXPORT_SYMBOL, so the addresses are
 * found through a kprobe lookup (register_kprobe() resolves any symbol,
 * module symbols included, and is unregistered at once).  A module
 * notifier forgets the addresses when the nvidia module goes away.
 *
 * p2p_token 0 / va_space 0 ask the driver for the caller's own address
 * space: a process can only register GPU memory it owns.  When the memory
 * is freed under us, the driver calls phx_nv_free_cb(): the user PTEs are
 * zapped at once (later access: SIGBUS; later I/O: -EFAULT) and the pages
 * are removed once in-flight I/O has drained.
 */
#define pr_fmt(fmt) KBUILD_MODNAME ": " fmt

#include <linux/completion.h>
#include <linux/kprobes.h>
#include <linux/module.h>
#include <linux/mutex.h>
#include <linux/pci.h>
#include <linux/slab.h>

#include "phx.h"
#include "phx_nv_p2p.h"

/* ---- resolution ---- */

struct phx_nv_api {
	nvidia_p2p_get_pages_fn get_pages;
	nvidia_p2p_put_pages_fn put_pages;
	nvidia_p2p_free_page_table_fn free_page_table;
};

static DEFINE_MUTEX(phx_nv_lock);
static struct phx_nv_api phx_nv;

static void *phx_nv_lookup(const char *name)
{
#ifdef CONFIG_KPROBES
	struct kprobe kp = { .symbol_name = name };
	void *addr;

	if (register_kprobe(&kp))
		return NULL;
	addr = kp.addr;
	unregister_kprobe(&kp);
	return addr;
#else
	return NULL;
#endif
}

/* Fill phx_nv if the driver is there; called with phx_nv_lock held. */
static bool phx_nv_resolve(void)
{
	if (phx_nv.get_pages)
		return true;
	phx_nv.get_pages = phx_nv_lookup("nvidia_p2p_get_pages");
	phx_nv.put_pages = phx_nv_lookup("nvidia_p2p_put_pages");
	phx_nv.free_page_table = phx_nv_lookup("nvidia_p2p_free_page_table");
	if (phx_nv.get_pages && phx_nv.put_pages && phx_nv.free_page_table)
		return true;
	memset(&phx_nv, 0, sizeof(phx_nv));
	return false;
}

bool phx_nvidia_available(void)
{
	bool ok;

	mutex_lock(&phx_nv_lock);
	ok = phx_nv_resolve();
	mutex_unlock(&phx_nv_lock);
	return ok;
}

static int phx_nv_module_event(struct notifier_block *nb, unsigned long ev,
			       void *data)
{
	struct module *mod = data;

	if (ev == MODULE_STATE_GOING && !strcmp(mod->name, "nvidia")) {
		mutex_lock(&phx_nv_lock);
		memset(&phx_nv, 0, sizeof(phx_nv));
		mutex_unlock(&phx_nv_lock);
	}
	return NOTIFY_DONE;
}

static struct notifier_block phx_nv_nb = {
	.notifier_call = phx_nv_module_event,
};

int phx_nvidia_init(void)
{
	return register_module_notifier(&phx_nv_nb);
}

void phx_nvidia_exit(void)
{
	unregister_module_notifier(&phx_nv_nb);
}

/* ---- the provider ---- */

enum { PHX_NV_ACTIVE, PHX_NV_RELEASED, PHX_NV_FREED };

struct phx_nv_ctx {
	struct phx_reg *reg;
	struct phx_nv_api api;		/* what get_pages was called through */
	struct nvidia_p2p_page_table *pt;
	u64 va;
	atomic_t state;
	struct completion cb_done;
};

/* The driver frees the GPU memory under us: revoke. */
static void phx_nv_free_cb(void *data)
{
	struct phx_nv_ctx *ctx = data;
	struct phx_reg *reg = ctx->reg;

	if (atomic_cmpxchg(&ctx->state, PHX_NV_ACTIVE, PHX_NV_FREED) !=
	    PHX_NV_ACTIVE)
		return;
	/* stop user access now; pages go once in-flight I/O has drained */
	phx_reg_revoke_async(reg);
	ctx->api.free_page_table(ctx->pt);
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

/* Merge the GPU pages into physically contiguous, 2 MiB aligned runs. */
static int phx_nv_ranges(struct phx_reg *reg, struct nvidia_p2p_page_table *pt)
{
	u64 psz = phx_nv_page_bytes(pt->page_size);
	unsigned int i, n = 0;

	if (!psz || (u64)pt->entries * psz != reg->length)
		return -EINVAL;
	reg->ranges = kcalloc(pt->entries, sizeof(*reg->ranges), GFP_KERNEL);
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
	for (i = 0; i < n; i++)
		if (!IS_ALIGNED(reg->ranges[i].start, PHX_REG_ALIGN) ||
		    !IS_ALIGNED(range_len(&reg->ranges[i]), PHX_REG_ALIGN))
			return -EINVAL;
	reg->nr_ranges = n;
	return 0;
}

/* The GPU whose BAR holds @pa, with a reference; its BAR index in *bar. */
static struct pci_dev *phx_nv_find_gpu(u64 pa, int *bar)
{
	struct pci_dev *pdev = NULL;
	int i;

	while ((pdev = pci_get_device(PCI_VENDOR_ID_NVIDIA, PCI_ANY_ID, pdev))) {
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

static void phx_nv_release(struct phx_reg *reg);

static int phx_nv_acquire(struct phx_reg *reg, const struct phx_register *arg)
{
	struct phx_nv_ctx *ctx;
	int ret;

	reg->bar = -1;
	ctx = kzalloc(sizeof(*ctx), GFP_KERNEL);
	if (!ctx)
		return -ENOMEM;
	ctx->reg = reg;
	ctx->va = arg->gpu_va;
	init_completion(&ctx->cb_done);

	mutex_lock(&phx_nv_lock);
	if (!phx_nv_resolve()) {
		mutex_unlock(&phx_nv_lock);
		kfree(ctx);
		return -ENODEV;
	}
	ctx->api = phx_nv;
	/*
	 * The driver cannot go away while this call runs: the caller holds
	 * its GPU context (an open /dev/nvidia* file) to own the memory.
	 */
	mutex_unlock(&phx_nv_lock);

	atomic_set(&ctx->state, PHX_NV_ACTIVE);
	ret = ctx->api.get_pages(0, 0, arg->gpu_va, arg->length, &ctx->pt,
				 phx_nv_free_cb, ctx);
	if (ret) {
		kfree(ctx);
		return ret < 0 ? ret : -EINVAL;
	}
	reg->prov_data = ctx;
	if (NVIDIA_P2P_VERSION_MAJOR(ctx->pt->version) !=
	    NVIDIA_P2P_VERSION_MAJOR(NVIDIA_P2P_PAGE_TABLE_VERSION)) {
		ret = -EPROTO;
		goto err_put;
	}
	ret = phx_nv_ranges(reg, ctx->pt);
	if (ret)
		goto err_put;
	reg->pdev = phx_nv_find_gpu(reg->ranges[0].start, &reg->bar);
	return 0;

err_put:
	phx_nv_release(reg);
	return ret;
}

static void phx_nv_release(struct phx_reg *reg)
{
	struct phx_nv_ctx *ctx = reg->prov_data;

	if (!ctx)
		return;
	if (atomic_cmpxchg(&ctx->state, PHX_NV_ACTIVE, PHX_NV_RELEASED) ==
	    PHX_NV_ACTIVE)
		ctx->api.put_pages(0, 0, ctx->va, ctx->pt);
	else
		wait_for_completion(&ctx->cb_done);
	reg->prov_data = NULL;
	kfree(ctx);
}

const struct phx_provider phx_nvidia_provider = {
	.name = "nvidia",
	.acquire = phx_nv_acquire,
	.release = phx_nv_release,
};
