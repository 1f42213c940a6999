// SPDX-License-Identifier: GPL-2.0
/*
 * /dev/phx: map registered device memory, backed by
 * ZONE_DEVICE struct pages, into user space so that O_DIRECT I/O can DMA
 * between a storage device and that memory with no host copy.
 *
 * Lifetimes: a registration (struct phx_reg) is owned by the file that
 * created it.  Every VMA mapping it holds a reference; every VMA also holds
 * the file (vm_file), which holds the module, so rmmod is refused while any
 * mapping exists.  Teardown (unregister, close, unbinding a phx-bound
 * device) zaps all user PTEs, waits until nothing holds a page (I/O, a
 * pipe, a fixed buffer: however long that takes), then removes the pages
 * and only then gives the memory back to its provider.  A registration
 * holds phx.ko until it is freed, so rmmod is refused while one waits.
 */
#define pr_fmt(fmt) KBUILD_MODNAME ": " fmt

#include <linux/atomic.h>
#include <linux/cred.h>
#include <linux/fs.h>
#include <linux/idr.h>
#include <linux/miscdevice.h>
#include <linux/mm.h>
#include <linux/module.h>
#include <linux/pagemap.h>
#include <linux/rcupdate.h>
#include <linux/slab.h>
#include <linux/sort.h>

#include "phx.h"

unsigned long long phx_max_reg_bytes = 64ULL << 30;
module_param_named(max_reg_bytes, phx_max_reg_bytes, ullong, 0644);
MODULE_PARM_DESC(max_reg_bytes,
		 "Largest registration in bytes (struct pages cost 1/64 of it in RAM)");

static unsigned long long phx_max_user_bytes = 1ULL << 40;
module_param_named(max_user_bytes, phx_max_user_bytes, ullong, 0644);
MODULE_PARM_DESC(max_user_bytes,
		 "Bytes one user may have registered, including registrations still being torn down");

static unsigned int phx_max_user_regs = 1024;
module_param_named(max_user_regs, phx_max_user_regs, uint, 0644);
MODULE_PARM_DESC(max_user_regs,
		 "Registrations one user may have, including those still being torn down");

static DEFINE_IDA(phx_ida);
static atomic64_t phx_regs_live = ATOMIC64_INIT(0);
static atomic64_t phx_pages_busy = ATOMIC64_INIT(0);

u64 phx_nr_regs(void)
{
	return atomic64_read(&phx_regs_live);
}

u64 phx_nr_pages_busy(void)
{
	return atomic64_read(&phx_pages_busy);
}

/* ---------------------------------------------------------------------- */
/* Providers                                                                */

static DEFINE_MUTEX(phx_prov_lock);
static const struct phx_provider *phx_providers[PHX_NR_PROVIDERS] = {
	[PHX_PROV_PCIBAR] = &phx_pcibar_provider,
};

/*
 * The provider interface is GPL-only: behind it are GPL-only kernel
 * interfaces (memremap_pages() and ZONE_DEVICE), which a module linked
 * against a proprietary one must not reach through phx.  phx_nv.ko
 * therefore loads only against a GPL-compatible NVIDIA driver (the open
 * kernel modules are "Dual MIT/GPL"); the kernel refuses it next to the
 * proprietary one.
 */

/**
 * phx_provider_register - offer a provider for registrations of type @id.
 * @id: PHX_PROV_* (not PHX_PROV_PCIBAR, which is built in).
 * @prov: the provider; must stay valid until phx_provider_unregister().
 *
 * Return: 0, -EINVAL for a bad @id, -EBUSY when @id is taken.
 */
int phx_provider_register(u32 id, const struct phx_provider *prov)
{
	int ret = 0;

	if (id >= PHX_NR_PROVIDERS || id == PHX_PROV_PCIBAR || !prov)
		return -EINVAL;
	mutex_lock(&phx_prov_lock);
	if (phx_providers[id])
		ret = -EBUSY;
	else
		phx_providers[id] = prov;
	mutex_unlock(&phx_prov_lock);
	return ret;
}
EXPORT_SYMBOL_GPL(phx_provider_register);

/**
 * phx_provider_unregister - withdraw the provider of @id.
 * @id: as given to phx_provider_register().
 *
 * Registrations hold the provider's module, so none is left when its
 * module exit calls this.
 */
void phx_provider_unregister(u32 id)
{
	if (id >= PHX_NR_PROVIDERS || id == PHX_PROV_PCIBAR)
		return;
	mutex_lock(&phx_prov_lock);
	phx_providers[id] = NULL;
	mutex_unlock(&phx_prov_lock);
}
EXPORT_SYMBOL_GPL(phx_provider_unregister);

/* The provider of @id with a reference on its module, or NULL. */
static const struct phx_provider *phx_provider_get(u32 id)
{
	const struct phx_provider *prov = NULL;

	if (id >= PHX_NR_PROVIDERS)
		return NULL;
	mutex_lock(&phx_prov_lock);
	if (phx_providers[id] && try_module_get(phx_providers[id]->owner))
		prov = phx_providers[id];
	mutex_unlock(&phx_prov_lock);
	return prov;
}

bool phx_provider_available(u32 id)
{
	bool ok;

	mutex_lock(&phx_prov_lock);
	ok = id < PHX_NR_PROVIDERS && phx_providers[id];
	mutex_unlock(&phx_prov_lock);
	return ok;
}

/*
 * Providers return the NVIDIA driver's -ENOTSUPP (524), which is not a
 * user-space errno; anything else outside the errno range becomes -EIO.
 */
static int phx_user_errno(int err)
{
	if (err == -ENOTSUPP)
		return -EOPNOTSUPP;
	if (err > 0)
		return -EINVAL;
	if (err < -ERESTART_RESTARTBLOCK)
		return -EIO;
	return err;
}

/* ---------------------------------------------------------------------- */
/* Per-user limits                                                          */

/*
 * What each user has registered, counted until the pages are gone (so a
 * teardown held up by a pipe still counts).  Registrations cost host
 * memory (struct pages, 1/64 of the size, allocated by memory hotplug,
 * which no memcg is charged for) and a memory hotplug each: without a
 * limit one member of the phx group could exhaust both.
 */
struct phx_user {
	struct list_head node;
	kuid_t uid;
	u64 bytes;
	unsigned int regs;
};

static DEFINE_MUTEX(phx_users_lock);
static LIST_HEAD(phx_users);

static struct phx_user *phx_user_find(kuid_t uid)
{
	struct phx_user *u;

	list_for_each_entry(u, &phx_users, node)
		if (uid_eq(u->uid, uid))
			return u;
	return NULL;
}

/* Charge reg->uid for @reg; -EDQUOT past a limit. */
static int phx_user_charge(struct phx_reg *reg)
{
	struct phx_user *u;
	int ret = 0;

	mutex_lock(&phx_users_lock);
	u = phx_user_find(reg->uid);
	if (!u) {
		u = kzalloc(sizeof(*u), GFP_KERNEL_ACCOUNT);
		if (!u) {
			ret = -ENOMEM;
			goto out;
		}
		u->uid = reg->uid;
		list_add(&u->node, &phx_users);
	}
	if (u->regs >= READ_ONCE(phx_max_user_regs) ||
	    reg->length > READ_ONCE(phx_max_user_bytes) - min(u->bytes,
							      READ_ONCE(phx_max_user_bytes))) {
		pr_info_ratelimited("uid %u: registration refused: %u registrations and %llu bytes held (max_user_regs %u, max_user_bytes %llu)\n",
				    from_kuid(&init_user_ns, reg->uid), u->regs,
				    u->bytes, phx_max_user_regs,
				    phx_max_user_bytes);
		ret = -EDQUOT;
	} else {
		u->regs++;
		u->bytes += reg->length;
		reg->charged = true;
	}
	if (!u->regs) {
		list_del(&u->node);
		kfree(u);
	}
out:
	mutex_unlock(&phx_users_lock);
	return ret;
}

static void phx_user_uncharge(struct phx_reg *reg)
{
	struct phx_user *u;

	if (!reg->charged)
		return;
	mutex_lock(&phx_users_lock);
	u = phx_user_find(reg->uid);
	if (!WARN_ON_ONCE(!u)) {
		u->regs--;
		u->bytes -= reg->length;
		if (!u->regs) {
			list_del(&u->node);
			kfree(u);
		}
	}
	reg->charged = false;
	mutex_unlock(&phx_users_lock);
}

/* ---------------------------------------------------------------------- */
/* Registrations                                                            */

/**
 * phx_reg_page - the struct page backing byte (idx << PAGE_SHIFT) of @reg.
 * @reg: a registration whose chunk table is built.
 * @idx: page index inside the registration.
 *
 * Return: the page, or NULL when @idx is out of range.  O(1): one table
 * entry per 2 MiB chunk, however fragmented the memory is.
 */
struct page *phx_reg_page(struct phx_reg *reg, unsigned long idx)
{
	if (idx >= reg->length >> PAGE_SHIFT)
		return NULL;
	return pfn_to_page(reg->chunk_pfn[idx / PHX_CHUNK_PAGES] +
			   idx % PHX_CHUNK_PAGES);
}

static int phx_cmp_ulong(const void *a, const void *b)
{
	unsigned long x = *(const unsigned long *)a;
	unsigned long y = *(const unsigned long *)b;

	return x < y ? -1 : x > y;
}

/*
 * Build reg->chunk_pfn from the provider's ranges, checking what phx
 * relies on: whole 2 MiB chunks, the registered length, no chunk twice.
 */
static int phx_reg_index(struct phx_reg *reg)
{
	unsigned long nr = reg->length >> PHX_CHUNK_SHIFT, n = 0, i, *sorted;
	unsigned int r;
	int ret = 0;

	if (!reg->nr_ranges || !reg->ranges)
		return -EINVAL;
	reg->chunk_pfn = kvcalloc(nr, sizeof(*reg->chunk_pfn), GFP_KERNEL_ACCOUNT);
	if (!reg->chunk_pfn)
		return -ENOMEM;
	for (r = 0; r < reg->nr_ranges; r++) {
		const struct range *rg = &reg->ranges[r];
		u64 a;

		if (!IS_ALIGNED(rg->start, PHX_REG_ALIGN) ||
		    !IS_ALIGNED(range_len(rg), PHX_REG_ALIGN))
			return -EINVAL;
		for (a = rg->start; a < rg->end; a += PHX_REG_ALIGN) {
			if (n == nr)
				return -EINVAL;
			reg->chunk_pfn[n++] = PHYS_PFN(a);
		}
	}
	if (n != nr)
		return -EINVAL;
	sorted = kvmalloc_array(nr, sizeof(*sorted), GFP_KERNEL);
	if (!sorted)
		return -ENOMEM;
	memcpy(sorted, reg->chunk_pfn, nr * sizeof(*sorted));
	sort(sorted, nr, sizeof(*sorted), phx_cmp_ulong, NULL);
	for (i = 1; i < nr; i++)
		if (sorted[i] == sorted[i - 1])
			ret = -EINVAL;	/* the same memory twice */
	kvfree(sorted);
	return ret;
}

static void phx_reg_free(struct kref *kref)
{
	struct phx_reg *reg = container_of(kref, struct phx_reg, kref);

	if (WARN_ON_ONCE(reg->live))
		return;
	phx_user_uncharge(reg);
	if (reg->handle)
		ida_free(&phx_ida, reg->handle);
	pci_dev_put(reg->pdev);
	kvfree(reg->chunk_pfn);
	kvfree(reg->ranges);
	kfree(reg);
	module_put(THIS_MODULE);	/* taken in phx_register() */
}

void phx_reg_put(struct phx_reg *reg)
{
	kref_put(&reg->kref, phx_reg_free);
}

/**
 * phx_reg_revoke - stop all user access to @reg now.
 * @reg: the registration.
 *
 * Marks it revoked and clears @live under @lock, then zaps every user PTE
 * of the registration.  PTEs are only ever inserted by the fault handler,
 * under @lock and into VMAs that are in the file's mapping tree, so none
 * survives the zap and none is inserted after.  Later CPU access gets
 * SIGBUS, later I/O -EFAULT.  Pages already referenced (I/O in flight, a
 * pipe, a fixed buffer) stay valid until the teardown saw them go.
 *
 * Return: true for the caller that took a live registration down, which
 * must then see to the teardown; false otherwise.
 */
bool phx_reg_revoke(struct phx_reg *reg)
{
	bool was_live;

	mutex_lock(&reg->lock);
	was_live = reg->live;
	reg->revoked = true;
	WRITE_ONCE(reg->live, false);
	reg->status |= PHX_ST_REVOKED;
	if (was_live && reg->mapping)
		unmap_mapping_range(reg->mapping, reg->mmap_off, reg->length, 1);
	mutex_unlock(&reg->lock);
	return was_live;
}

/*
 * True when no one but phx holds a page of @reg (revoked: nothing can
 * take a new reference).  phx keeps every idle page at count 1
 * (phx_mem_create() takes that reference where the kernel leaves idle
 * pages at 0), so "busy" is "count > 1" on every kernel.  Resumes where
 * the last call stopped: a page seen idle stays idle.
 */
static bool phx_reg_quiet(struct phx_reg *reg)
{
	unsigned long nr = reg->length >> PAGE_SHIFT;

	/* GUP-fast runs with interrupts off: let racing walkers finish. */
	if (!reg->rcu_synced)
		synchronize_rcu();
	reg->rcu_synced = true;
	for (; reg->scan_idx < nr; reg->scan_idx++) {
		if (page_ref_count(phx_reg_page(reg, reg->scan_idx)) > 1)
			return false;
		if (reg->scan_idx % 4096 == 4095)
			cond_resched();
	}
	return true;
}

/* The pages are idle: remove them, give the memory back. */
static void phx_reg_finish_now(struct phx_reg *reg)
{
	if (reg->busy_counted)
		atomic64_dec(&phx_pages_busy);
	reg->busy_counted = false;
	phx_mem_destroy(reg);
	if (reg->prov->release)
		reg->prov->release(reg);
	module_put(reg->prov->owner);
	phx_user_uncharge(reg);
	atomic64_dec(&phx_regs_live);
	complete_all(&reg->done);
}

static struct workqueue_struct *phx_wq;

/*
 * The teardown after a revocation, on phx_wq.  Pages may be held for any
 * time (a pipe that vmsplice filled, a fixed buffer, an I/O in its
 * timeout): until none is, nothing is given back, and the work polls
 * instead of sleeping in a worker.  It holds a registration reference.
 */
static void phx_reg_finish(struct work_struct *work)
{
	struct phx_reg *reg = container_of(to_delayed_work(work), struct phx_reg,
					   finish_work);

	if (!phx_reg_quiet(reg)) {
		if (!reg->busy_counted)
			atomic64_inc(&phx_pages_busy);
		reg->busy_counted = true;
		queue_delayed_work(phx_wq, &reg->finish_work, msecs_to_jiffies(20));
		return;
	}
	phx_reg_finish_now(reg);
	phx_reg_put(reg);
}

/* Queue the teardown of a revoked registration (once). */
static void phx_reg_queue_finish(struct phx_reg *reg)
{
	kref_get(&reg->kref);		/* put by phx_reg_finish() */
	queue_delayed_work(phx_wq, &reg->finish_work, 0);
}

/* Revoke @reg and queue the rest of its teardown (if not done already). */
void phx_reg_revoke_async(struct phx_reg *reg)
{
	if (phx_reg_revoke(reg))
		phx_reg_queue_finish(reg);
}

/* ---------------------------------------------------------------------- */
/* The per-open state                                                       */

struct phx_file {
	struct mutex lock;		/* protects regs */
	struct list_head regs;
};

int phx_file_add(struct phx_file *pf, struct phx_reg *reg)
{
	mutex_lock(&pf->lock);
	list_add_tail(&reg->node, &pf->regs);
	mutex_unlock(&pf->lock);
	return 0;
}

/* Unlink the registration @handle from @pf; the caller owns its reference. */
struct phx_reg *phx_file_take(struct phx_file *pf, u32 handle)
{
	struct phx_reg *reg;

	mutex_lock(&pf->lock);
	list_for_each_entry(reg, &pf->regs, node) {
		if (reg->handle == handle) {
			list_del_init(&reg->node);
			mutex_unlock(&pf->lock);
			return reg;
		}
	}
	mutex_unlock(&pf->lock);
	return NULL;
}

static struct phx_reg *phx_file_find_off(struct phx_file *pf, u64 off)
{
	struct phx_reg *reg;

	mutex_lock(&pf->lock);
	list_for_each_entry(reg, &pf->regs, node) {
		if ((off >> PHX_MMAP_SHIFT) == (reg->mmap_off >> PHX_MMAP_SHIFT)) {
			kref_get(&reg->kref);
			mutex_unlock(&pf->lock);
			return reg;
		}
	}
	mutex_unlock(&pf->lock);
	return NULL;
}

/* Make @reg live unless it was revoked (unbind) while being set up. */
static int phx_reg_go_live(struct phx_reg *reg)
{
	int ret;

	mutex_lock(&reg->lock);
	if (reg->revoked) {
		ret = -ENODEV;		/* its device went away meanwhile */
		goto out;
	}
	ret = phx_mem_create(reg);
	if (ret)
		goto out;
	reg->live = true;
	atomic64_inc(&phx_regs_live);
out:
	mutex_unlock(&reg->lock);
	return ret;
}

/**
 * phx_register - create a registration for @file from a validated @arg.
 * @file: the /dev/phx file that will own it.
 * @arg: in/out argument of PHX_IOC_REGISTER (already checked for form).
 *
 * The caller's user is charged for it (max_user_regs, max_user_bytes)
 * until its pages are gone; PHX_REG_ALLOW_IOMMU needs CAP_SYS_RAWIO of
 * the opener, since it lets device DMA go to addresses phx cannot vouch
 * for.  The registration goes live under its lock.
 *
 * Return: 0 with @arg's out fields filled, or -errno.
 */
int phx_register(struct file *file, struct phx_register *arg)
{
	const struct phx_provider *prov;
	struct phx_reg *reg;
	int ret;

	if ((arg->flags & PHX_REG_ALLOW_IOMMU) &&
	    !file_ns_capable(file, &init_user_ns, CAP_SYS_RAWIO))
		return -EPERM;
	prov = phx_provider_get(arg->provider);
	if (!prov)
		return -ENODEV;
	reg = kzalloc(sizeof(*reg), GFP_KERNEL_ACCOUNT);
	if (!reg) {
		module_put(prov->owner);
		return -ENOMEM;
	}
	__module_get(THIS_MODULE);	/* the file pins us; put when @reg is freed */
	kref_init(&reg->kref);
	INIT_LIST_HEAD(&reg->node);
	mutex_init(&reg->lock);
	init_completion(&reg->done);
	INIT_DELAYED_WORK(&reg->finish_work, phx_reg_finish);
	reg->prov = prov;
	reg->bar = -1;
	reg->flags = arg->flags;
	reg->length = arg->length;
	reg->mapping = file->f_mapping;
	reg->uid = current_euid();

	ret = phx_user_charge(reg);
	if (ret)
		goto err_free;
	ret = ida_alloc_range(&phx_ida, 1, PHX_MAX_HANDLE, GFP_KERNEL);
	if (ret < 0)
		goto err_free;
	reg->handle = ret;
	reg->mmap_off = (u64)reg->handle << PHX_MMAP_SHIFT;

	ret = prov->acquire(reg, arg, file);
	if (ret)
		goto err_free;
	ret = phx_reg_index(reg);
	if (ret)
		goto err_release;
	/* the provider's device, and every device that may DMA to it */
	if (reg->pdev)
		reg->status |= phx_mem_dev_status(reg->pdev);
	else
		reg->status |= phx_mem_module_status() | PHX_ST_UNKNOWN_DEV;
	reg->status |= phx_mem_initiator_status();
	ret = phx_reg_go_live(reg);
	if (ret)
		goto err_release;

	phx_file_add(file->private_data, reg);
	arg->handle = reg->handle;
	arg->mmap_offset = reg->mmap_off;
	arg->mode = reg->mode;
	arg->status = reg->status;
	return 0;

err_release:
	if (prov->release)
		prov->release(reg);
err_free:
	module_put(prov->owner);
	phx_reg_put(reg);
	return phx_user_errno(ret);
}

/*
 * Revoke @handle and wait until its pages are gone.  The wait lasts as
 * long as something holds a page (a pipe may, indefinitely), so any signal
 * ends it with -EINTR: the handle is gone by then and the teardown
 * completes in the background.
 */
int phx_unregister(struct file *file, u32 handle)
{
	struct phx_reg *reg = phx_file_take(file->private_data, handle);
	int ret = 0;

	if (!reg)
		return -ENOENT;
	phx_reg_revoke_async(reg);
	if (wait_for_completion_interruptible(&reg->done))
		ret = -EINTR;
	phx_reg_put(reg);
	return ret;
}

/* ---------------------------------------------------------------------- */
/* mmap                                                                     */

static unsigned long phx_vma_first_page(struct vm_area_struct *vma,
					struct phx_reg *reg)
{
	return vma->vm_pgoff - (reg->mmap_off >> PAGE_SHIFT);
}

static void phx_vm_open(struct vm_area_struct *vma)
{
	struct phx_reg *reg = vma->vm_private_data;

	kref_get(&reg->kref);
}

static void phx_vm_close(struct vm_area_struct *vma)
{
	phx_reg_put(vma->vm_private_data);
}

/*
 * PTEs are inserted here and nowhere else: a fault runs on a VMA that is
 * already in the file's mapping tree, so a revocation's zap always finds
 * what was inserted before it (inserting inside ->mmap, before the VMA is
 * linked, would let PTEs survive a revocation that ran in between).
 */
static vm_fault_t phx_vm_fault(struct vm_fault *vmf)
{
	struct vm_area_struct *vma = vmf->vma;
	struct phx_reg *reg = vma->vm_private_data;
	unsigned long idx;
	vm_fault_t ret = VM_FAULT_SIGBUS;

	/* lockless first: a revoked registration answers at once */
	if (!READ_ONCE(reg->live))
		return VM_FAULT_SIGBUS;
	idx = phx_vma_first_page(vma, reg) +
	      ((vmf->address - vma->vm_start) >> PAGE_SHIFT);
	mutex_lock(&reg->lock);
	if (reg->live && idx < (reg->length >> PAGE_SHIFT)) {
		int err = vm_insert_page(vma, vmf->address & PAGE_MASK,
					 phx_reg_page(reg, idx));

		ret = (err && err != -EBUSY) ? VM_FAULT_SIGBUS : VM_FAULT_NOPAGE;
	}
	mutex_unlock(&reg->lock);
	return ret;
}

static int phx_vm_mremap(struct vm_area_struct *vma)
{
	return -EINVAL;
}

static const struct vm_operations_struct phx_vm_ops = {
	.open = phx_vm_open,
	.close = phx_vm_close,
	.fault = phx_vm_fault,
	.mremap = phx_vm_mremap,
};

static int phx_mmap(struct file *file, struct vm_area_struct *vma)
{
	struct phx_file *pf = file->private_data;
	u64 off = (u64)vma->vm_pgoff << PAGE_SHIFT;
	unsigned long len = vma->vm_end - vma->vm_start;
	struct phx_reg *reg;
	bool live;

	if (!(vma->vm_flags & VM_SHARED))
		return -EINVAL;		/* a private (COW) mapping makes no sense */
	reg = phx_file_find_off(pf, off);
	if (!reg)
		return -ENXIO;
	if (off - reg->mmap_off > reg->length ||
	    len > reg->length - (off - reg->mmap_off)) {
		phx_reg_put(reg);
		return -EINVAL;
	}
	mutex_lock(&reg->lock);
	live = reg->live;
	mutex_unlock(&reg->lock);
	if (!live) {
		phx_reg_put(reg);
		return -ENODEV;
	}

	/*
	 * VM_DONTCOPY: fork() does not give the child the mapping.
	 * VM_MIXEDMAP: pages are ZONE_DEVICE pages (GUP works, no VM_IO).
	 * Write-combining: the memory is MMIO (a BAR), mapped the way the
	 * GPU driver maps it for user space, never write-back.
	 */
	vm_flags_set(vma, VM_DONTCOPY | VM_DONTEXPAND | VM_DONTDUMP |
		     VM_MIXEDMAP);
	vma->vm_page_prot = pgprot_writecombine(vma->vm_page_prot);
	vma->vm_ops = &phx_vm_ops;
	vma->vm_private_data = reg;	/* the reference found above */
	return 0;
}

/* ---------------------------------------------------------------------- */
/* open / release                                                           */

static int phx_open(struct inode *inode, struct file *file)
{
	struct phx_file *pf = kzalloc(sizeof(*pf), GFP_KERNEL_ACCOUNT);

	if (!pf)
		return -ENOMEM;
	mutex_init(&pf->lock);
	INIT_LIST_HEAD(&pf->regs);
	file->private_data = pf;
	return 0;
}

static int phx_release(struct inode *inode, struct file *file)
{
	struct phx_file *pf = file->private_data;
	struct phx_reg *reg, *tmp;

	/*
	 * No VMA is left (each holds the file), so there is nothing to zap and
	 * the address_space may go with the file; I/O may still hold pages:
	 * the rest happens on phx_wq.
	 */
	list_for_each_entry_safe(reg, tmp, &pf->regs, node) {
		list_del_init(&reg->node);
		mutex_lock(&reg->lock);
		reg->mapping = NULL;
		mutex_unlock(&reg->lock);
		if (phx_reg_revoke(reg)) {
			if (phx_reg_quiet(reg))
				phx_reg_finish_now(reg);	/* the usual case */
			else
				phx_reg_queue_finish(reg);
		}
		phx_reg_put(reg);
	}
	kfree(pf);
	return 0;
}

static const struct file_operations phx_fops = {
	.owner = THIS_MODULE,
	.open = phx_open,
	.release = phx_release,
	.mmap = phx_mmap,
	.unlocked_ioctl = phx_ioctl,
	.compat_ioctl = compat_ptr_ioctl,
	.llseek = noop_llseek,
};

static struct miscdevice phx_misc = {
	.minor = MISC_DYNAMIC_MINOR,
	.name = "phx",
	.fops = &phx_fops,
	.mode = 0660,
};

static int __init phx_init(void)
{
	int ret;

	phx_wq = alloc_workqueue("phx", WQ_UNBOUND, 0);
	if (!phx_wq)
		return -ENOMEM;
	ret = phx_pci_init();
	if (ret)
		goto err_wq;
	ret = misc_register(&phx_misc);
	if (ret)
		goto err_pci;
	pr_info("ready: /dev/phx, ABI %d, kernel P2PDMA %s\n", PHX_ABI_VERSION,
		IS_ENABLED(CONFIG_PCI_P2PDMA) ? "yes (devices bound to phx)" :
		"no (GENERIC pages)");
	return 0;

err_pci:
	phx_pci_exit();
err_wq:
	destroy_workqueue(phx_wq);
	return ret;
}

/* Every registration holds the module: none is left, none is pending. */
static void __exit phx_exit(void)
{
	misc_deregister(&phx_misc);
	phx_pci_exit();
	destroy_workqueue(phx_wq);
	ida_destroy(&phx_ida);
}

module_init(phx_init);
module_exit(phx_exit);

MODULE_DESCRIPTION("phx: device memory as ZONE_DEVICE pages for O_DIRECT I/O");
MODULE_LICENSE("GPL");
