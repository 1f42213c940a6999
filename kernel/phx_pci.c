// SPDX-License-Identifier: GPL-2.0
/*
 * phx's own PCI driver, for P2PDMA pages.
 *
 * Upstream P2PDMA state (pci_p2pdma_add_resource()) is device-managed: it
 * lives in the devres of the device it is added to, and it cannot be taken
 * back piecewise (released chunks would stay in the device's pool).  So
 * phx publishes memory only on devices bound to this driver, once per
 * binding: at probe, each prefetchable memory BAR is added whole and
 * allocated whole by phx; registrations take 2 MiB chunks of it.
 *
 * Lifetime: struct phx_pci is reference-counted.  The binding holds one
 * reference, every registration holding chunks holds one, and lookups
 * (phx_pci_get()) take one under phx_pci_lock, which ->remove() takes to
 * unpublish the device before anything else.  ->remove() revokes every
 * registration and waits, in steps of a second (never one unbounded
 * sleep), until their pages are idle: P2PDMA pages can be referenced only
 * by block I/O (GUP refuses them without FOLL_PCI_P2PDMA, and long-term
 * pins are refused), so the wait ends with the I/O or its time-out.  The
 * allocation is freed when the last reference goes, and the driver core
 * then releases the P2PDMA state.
 *
 * The driver has no ID table: an administrator binds a device on purpose,
 *	echo phx > /sys/bus/pci/devices/BDF/driver_override
 *	echo BDF > /sys/bus/pci/drivers_probe
 * Without CONFIG_PCI_P2PDMA nothing is registered and every registration
 * uses GENERIC pages.
 */
#define pr_fmt(fmt) KBUILD_MODNAME ": " fmt

#include <linux/bitmap.h>
#include <linux/kref.h>
#include <linux/pci.h>
#include <linux/pci-p2pdma.h>
#include <linux/slab.h>
#include <linux/wait.h>

#include "phx.h"

#ifdef CONFIG_PCI_P2PDMA
/**
 * struct phx_pci_bar - one BAR phx published.
 * @kaddr: what pci_alloc_p2pmem() returned for the whole BAR, or NULL.
 * @used: one bit per 2 MiB chunk held by a registration.
 */
struct phx_pci_bar {
	void *kaddr;
	unsigned long *used;
};

/**
 * struct phx_pci - a device bound to phx.
 * @kref: the binding's reference, one per registration holding chunks,
 *	one per lookup in progress.
 * @node: in phx_pci_list while bound (under phx_pci_lock).
 * @pdev: the device (a reference).
 * @bars: the published BARs.
 * @lock: protects @bars[].used, @users, @dying, @regs.
 * @users: registrations holding chunks.
 * @dying: ->remove() started: no new registration.
 * @idle: woken when @users falls to 0.
 * @regs: the registrations on it (for ->remove()).
 */
struct phx_pci {
	struct kref kref;
	struct list_head node;
	struct pci_dev *pdev;
	struct phx_pci_bar bars[PCI_STD_NUM_BARS];
	struct mutex lock;		/* see above */
	unsigned int users;
	bool dying;
	wait_queue_head_t idle;
	struct list_head regs;
};

struct phx_pci_user {
	struct list_head node;
	struct phx_reg *reg;
	bool revoking;
};

/* the bound devices; a lookup and ->remove()'s unpublishing exclude each other */
static DEFINE_MUTEX(phx_pci_lock);
static LIST_HEAD(phx_pci_list);

static void phx_pci_free_bars(struct phx_pci *pp);

static void phx_pci_release(struct kref *kref)
{
	struct phx_pci *pp = container_of(kref, struct phx_pci, kref);

	phx_pci_free_bars(pp);
	pci_dev_put(pp->pdev);
	kfree(pp);
}

/**
 * phx_pci_get - the phx binding of @pdev, with a reference.
 * @pdev: a PCI device, or NULL.
 *
 * Return: the binding (drop it with phx_pci_put()), or NULL when @pdev is
 * not bound to phx or is being unbound.
 */
struct phx_pci *phx_pci_get(struct pci_dev *pdev)
{
	struct phx_pci *pp;

	if (!pdev)
		return NULL;
	mutex_lock(&phx_pci_lock);
	list_for_each_entry(pp, &phx_pci_list, node) {
		if (pp->pdev == pdev) {
			kref_get(&pp->kref);
			mutex_unlock(&phx_pci_lock);
			return pp;
		}
	}
	mutex_unlock(&phx_pci_lock);
	return NULL;
}

void phx_pci_put(struct phx_pci *pp)
{
	kref_put(&pp->kref, phx_pci_release);
}

static bool phx_pci_bar_ok(struct pci_dev *pdev, int bar)
{
	unsigned long flags = pci_resource_flags(pdev, bar);

	return (flags & IORESOURCE_MEM) && (flags & IORESOURCE_PREFETCH) &&
	       !(flags & IORESOURCE_UNSET) &&
	       pci_resource_len(pdev, bar) >= PHX_REG_ALIGN &&
	       IS_ALIGNED(pci_resource_start(pdev, bar), PHX_REG_ALIGN) &&
	       IS_ALIGNED(pci_resource_len(pdev, bar), PHX_REG_ALIGN);
}

/**
 * phx_pci_claim - give @reg its chunks of a published BAR.
 * @pp: the binding of reg->pdev, from phx_pci_get().
 * @reg: one range, inside a BAR of reg->pdev.
 *
 * Return: 0 with reg->mode PHX_MODE_P2PDMA, and @reg owning the caller's
 * reference on @pp (dropped by phx_pci_unclaim()); -EBUSY when a chunk is
 * taken, -EINVAL when the BAR was not published, -ENODEV when the device
 * goes.  On error the caller keeps its reference.
 */
int phx_pci_claim(struct phx_pci *pp, struct phx_reg *reg)
{
	struct phx_pci_user *u;
	struct phx_pci_bar *b;
	unsigned long first, nr;
	int ret = 0;

	if (reg->bar < 0 || reg->nr_ranges != 1)
		return -EINVAL;
	b = &pp->bars[reg->bar];
	if (!b->kaddr)
		return -EINVAL;
	u = kzalloc(sizeof(*u), GFP_KERNEL_ACCOUNT);
	if (!u)
		return -ENOMEM;
	first = (reg->ranges[0].start - pci_resource_start(reg->pdev, reg->bar)) >>
		PHX_CHUNK_SHIFT;
	nr = reg->length >> PHX_CHUNK_SHIFT;
	mutex_lock(&pp->lock);
	if (pp->dying) {
		ret = -ENODEV;
	} else if (find_next_bit(b->used, first + nr, first) < first + nr) {
		ret = -EBUSY;
	} else {
		bitmap_set(b->used, first, nr);
		pp->users++;
		u->reg = reg;
		list_add(&u->node, &pp->regs);
		reg->p2p = pp;
		reg->mode = PHX_MODE_P2PDMA;
	}
	mutex_unlock(&pp->lock);
	if (ret)
		kfree(u);
	return ret;
}

/*
 * Give @reg's chunks back; its pages are idle.  Drops the registration's
 * reference last: @pp may be freed then, never while its lock is held.
 */
void phx_pci_unclaim(struct phx_reg *reg)
{
	struct phx_pci *pp = reg->p2p;
	struct phx_pci_bar *b = &pp->bars[reg->bar];
	struct phx_pci_user *u;
	unsigned long first;

	first = (reg->ranges[0].start - pci_resource_start(reg->pdev, reg->bar)) >>
		PHX_CHUNK_SHIFT;
	mutex_lock(&pp->lock);
	bitmap_clear(b->used, first, reg->length >> PHX_CHUNK_SHIFT);
	list_for_each_entry(u, &pp->regs, node) {
		if (u->reg == reg) {
			list_del(&u->node);
			kfree(u);
			break;
		}
	}
	if (!--pp->users)
		wake_up_all(&pp->idle);
	mutex_unlock(&pp->lock);
	reg->p2p = NULL;
	phx_pci_put(pp);
}

static void phx_pci_free_bars(struct phx_pci *pp)
{
	int i;

	for (i = 0; i < PCI_STD_NUM_BARS; i++) {
		if (pp->bars[i].kaddr)
			pci_free_p2pmem(pp->pdev, pp->bars[i].kaddr,
					pci_resource_len(pp->pdev, i));
		pp->bars[i].kaddr = NULL;
		bitmap_free(pp->bars[i].used);
		pp->bars[i].used = NULL;
	}
}

/* Publish BAR @bar whole and hold all of it. */
static int phx_pci_publish(struct phx_pci *pp, int bar)
{
	struct pci_dev *pdev = pp->pdev;
	size_t len = pci_resource_len(pdev, bar);
	void *kaddr;
	int ret;

	ret = pci_p2pdma_add_resource(pdev, bar, len, 0);
	if (ret)
		return ret;
	/* the newest chunk is tried first: it is this BAR */
	kaddr = pci_alloc_p2pmem(pdev, len);
	if (!kaddr)
		return -ENOMEM;
	if (virt_to_phys(kaddr) != pci_resource_start(pdev, bar)) {
		pci_free_p2pmem(pdev, kaddr, len);
		return -EBUSY;
	}
	pp->bars[bar].kaddr = kaddr;
	pp->bars[bar].used = bitmap_zalloc(len >> PHX_CHUNK_SHIFT, GFP_KERNEL);
	return pp->bars[bar].used ? 0 : -ENOMEM;
}

static int phx_pci_probe(struct pci_dev *pdev, const struct pci_device_id *id)
{
	struct phx_pci *pp;
	int i, ret, nr = 0;

	ret = pcim_enable_device(pdev);
	if (ret)
		return ret;
	pp = kzalloc(sizeof(*pp), GFP_KERNEL);
	if (!pp)
		return -ENOMEM;
	kref_init(&pp->kref);
	pp->pdev = pci_dev_get(pdev);
	mutex_init(&pp->lock);
	init_waitqueue_head(&pp->idle);
	INIT_LIST_HEAD(&pp->regs);
	for (i = 0; i < PCI_STD_NUM_BARS; i++) {
		if (!phx_pci_bar_ok(pdev, i))
			continue;
		ret = phx_pci_publish(pp, i);
		if (ret) {
			pci_info(pdev, "phx: BAR %d not published for P2PDMA: %d\n",
				 i, ret);
			phx_pci_put(pp);
			return ret;
		}
		nr++;
	}
	if (!nr) {
		pci_info(pdev, "phx: no prefetchable memory BAR to publish\n");
		phx_pci_put(pp);
		return -ENODEV;
	}
	pci_set_drvdata(pdev, pp);
	mutex_lock(&phx_pci_lock);
	list_add(&pp->node, &phx_pci_list);
	mutex_unlock(&phx_pci_lock);
	pci_info(pdev, "phx: %d BAR(s) published for P2PDMA registrations\n", nr);
	return 0;
}

/*
 * Unpublish the device, revoke every registration on it and wait for
 * their pages to be idle (see the top of this file for why that ends).
 * The revocation takes reg->lock, which is held around phx_pci_claim():
 * never call it under pp->lock.
 */
static void phx_pci_remove(struct pci_dev *pdev)
{
	struct phx_pci *pp = pci_get_drvdata(pdev);
	struct phx_pci_user *u;
	struct phx_reg *reg;
	unsigned int waited = 0;

	mutex_lock(&phx_pci_lock);
	list_del_init(&pp->node);
	mutex_unlock(&phx_pci_lock);
	for (;;) {
		reg = NULL;
		mutex_lock(&pp->lock);
		pp->dying = true;
		list_for_each_entry(u, &pp->regs, node) {
			if (!u->revoking) {
				u->revoking = true;
				reg = u->reg;
				kref_get(&reg->kref);
				break;
			}
		}
		mutex_unlock(&pp->lock);
		if (!reg)
			break;
		phx_reg_revoke_async(reg);
		phx_reg_put(reg);
	}
	while (!wait_event_timeout(pp->idle, !READ_ONCE(pp->users), HZ))
		if (++waited % 10 == 0)
			pci_info(pdev, "phx: unbinding: I/O still holds pages of %u registration(s) after %u s\n",
				 READ_ONCE(pp->users), waited);
	phx_pci_free_bars(pp);	/* no chunk is held: the allocation goes back */
	pci_set_drvdata(pdev, NULL);
	phx_pci_put(pp);
}

static struct pci_driver phx_pci_driver = {
	.name = "phx",
	.probe = phx_pci_probe,
	.remove = phx_pci_remove,
};

int phx_pci_init(void)
{
	return pci_register_driver(&phx_pci_driver);
}

void phx_pci_exit(void)
{
	pci_unregister_driver(&phx_pci_driver);
}
#else /* !CONFIG_PCI_P2PDMA */
struct phx_pci *phx_pci_get(struct pci_dev *pdev)
{
	return NULL;
}

void phx_pci_put(struct phx_pci *pp)
{
}

int phx_pci_claim(struct phx_pci *pp, struct phx_reg *reg)
{
	return -EOPNOTSUPP;
}

void phx_pci_unclaim(struct phx_reg *reg)
{
}

int phx_pci_init(void)
{
	return 0;
}

void phx_pci_exit(void)
{
}
#endif /* CONFIG_PCI_P2PDMA */
