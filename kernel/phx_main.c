// SPDX-License-Identifier: GPL-2.0
/*
 * /dev/phx: map registered device memory, backed by
 * ZONE_DEVICE struct pages, into user space so that O_DIRECT I/O can DMA
 * between a storage device and that memory with no host copy.
 *
 * Lifetimes: a registration (struct phx_reg) is owned by the file that
 * created it.  Every VMA mapping it holds a reference; every VMA also holds
 * the file (vm_file), which holds the module, so rmmod is refused while any
 * mapping exists.  Teardown (unregister, close, provider revocation) zaps
 * all user PTEs, waits until no I/O holds a page, then removes the pages.
 */
#define pr_fmt(fmt) KBUILD_MODNAME ": " fmt

#include <linux/atomic.h>
#include <linux/delay.h>
#include <linux/fs.h>
#include <linux/idr.h>
#include <linux/miscdevice.h>
#include <linux/mm.h>
#include <linux/module.h>
#include <linux/rcupdate.h>
#include <linux/slab.h>

#include "phx.h"

unsigned long long phx_max_reg_bytes = 64ULL << 30;
module_param_named(max_reg_bytes, phx_max_reg_bytes, ullong, 0644);
MODULE_PARM_DESC(max_reg_bytes,
		 "Largest registration in bytes (struct pages cost 1/64 of it in RAM)");

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
/* Registrations                                                            */

/**
 * phx_reg_page - the struct page backing byte (idx << PAGE_SHIFT) of @reg.
 * @reg: a live registration.
 * @idx: page index inside the registration.
 *
 * Return: the page, or NULL when @idx is out of range.
 */
struct page *phx_reg_page(struct phx_reg *reg, unsigned long idx)
{
	unsigned int i;

	for (i = 0; i < reg->nr_ranges; i++) {
		unsigned long n = range_len(&reg->ranges[i]) >> PAGE_SHIFT;

		if (idx < n)
			return pfn_to_page(PHYS_PFN(reg->ranges[i].start) + idx);
		idx -= n;
	}
	return NULL;
}

static void phx_reg_free(struct kref *kref)
{
	struct phx_reg *reg = container_of(kref, struct phx_reg, kref);

	WARN_ON_ONCE(reg->live);
	if (reg->handle)
		ida_free(&phx_ida, reg->handle);
	pci_dev_put(reg->pdev);
	kfree(reg->ranges);
	kfree(reg);
}

void phx_reg_put(struct phx_reg *reg)
{
	kref_put(&reg->kref, phx_reg_free);
}

/*
 * Wait until no one but the pagemap itself holds a page: I/O in flight
 * pinned pages through GUP before the PTEs were zapped.  Nothing can take
 * a new reference once the PTEs are gone and reg->live is false.
 */
static void phx_reg_wait_idle(struct phx_reg *reg)
{
	unsigned long nr = reg->length >> PAGE_SHIFT, idx, waited = 0;

	/* GUP-fast runs with interrupts off: let racing walkers finish. */
	synchronize_rcu();
	for (idx = 0; idx < nr; idx++) {
		struct page *page = phx_reg_page(reg, idx);
		bool counted = false;

		while (page_ref_count(page) > 1) {
			if (!counted) {
				atomic64_inc(&phx_pages_busy);
				counted = true;
			}
			msleep(20);
			waited += 20;
			if (waited % 10000 == 0)
				pr_info("handle %u: waiting for I/O on its pages (%lu s)\n",
					reg->handle, waited / 1000);
		}
		if (counted)
			atomic64_dec(&phx_pages_busy);
	}
}

/**
 * phx_reg_revoke - stop all user access to @reg now.
 * @reg: the registration.
 *
 * Clears @live under @lock and zaps every user PTE of the registration (a
 * fault or mmap that inserted one before is zapped here, none inserts one
 * after).  Later CPU access gets SIGBUS, later I/O -EFAULT.  Pages pinned
 * by I/O already in flight stay valid until phx_reg_finish() saw them go.
 *
 * Return: true for the caller that revoked it, which must then queue
 * phx_reg_finish(); false if it was revoked already.
 */
bool phx_reg_revoke(struct phx_reg *reg)
{
	bool was_live;

	mutex_lock(&reg->lock);
	was_live = reg->live;
	WRITE_ONCE(reg->live, false);
	reg->status |= PHX_ST_REVOKED;
	if (was_live && reg->mapping)
		unmap_mapping_range(reg->mapping, reg->mmap_off, reg->length, 1);
	mutex_unlock(&reg->lock);
	return was_live;
}

/* True when no I/O holds a page of @reg (revoked: nothing new can). */
static bool phx_reg_quiet(struct phx_reg *reg)
{
	unsigned long nr = reg->length >> PAGE_SHIFT, idx;

	synchronize_rcu();
	for (idx = 0; idx < nr; idx++)
		if (page_ref_count(phx_reg_page(reg, idx)) > 1)
			return false;
	return true;
}

/* After the revocation: wait for in-flight I/O, remove the pages. */
static void phx_reg_finish_now(struct phx_reg *reg)
{
	phx_reg_wait_idle(reg);
	phx_mem_destroy(reg);
	if (reg->prov->release)
		reg->prov->release(reg);
	atomic64_dec(&phx_regs_live);
	complete_all(&reg->done);
}

/*
 * The same on phx_wq, so that close() and process exit never wait for I/O
 * (io_uring may hold pages until its ring is torn down, after our file);
 * module exit drains phx_wq.
 */
static void phx_reg_finish(struct work_struct *work)
{
	struct phx_reg *reg = container_of(work, struct phx_reg, finish_work);

	phx_reg_finish_now(reg);
	phx_reg_put(reg);
}

static struct workqueue_struct *phx_wq;

/* Revoke @reg and queue the rest of its teardown (if not done already). */
void phx_reg_revoke_async(struct phx_reg *reg)
{
	if (!phx_reg_revoke(reg))
		return;
	kref_get(&reg->kref);		/* put by phx_reg_finish() */
	queue_work(phx_wq, &reg->finish_work);
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

/**
 * phx_register - create a registration for @file from a validated @arg.
 * @file: the /dev/phx file that will own it.
 * @arg: in/out argument of PHX_IOC_REGISTER (already checked for form).
 *
 * Return: 0 with @arg's out fields filled, or -errno.
 */
int phx_register(struct file *file, struct phx_register *arg)
{
	const struct phx_provider *prov;
	struct phx_reg *reg;
	int ret;

	if (arg->provider == PHX_PROV_PCIBAR)
		prov = &phx_pcibar_provider;
	else if (arg->provider == PHX_PROV_NVIDIA)
		prov = &phx_nvidia_provider;
	else
		return -EINVAL;

	reg = kzalloc(sizeof(*reg), GFP_KERNEL);
	if (!reg)
		return -ENOMEM;
	kref_init(&reg->kref);
	INIT_LIST_HEAD(&reg->node);
	mutex_init(&reg->lock);
	init_completion(&reg->done);
	INIT_WORK(&reg->finish_work, phx_reg_finish);
	reg->prov = prov;
	reg->flags = arg->flags;
	reg->length = arg->length;
	reg->mapping = file->f_mapping;

	ret = ida_alloc_range(&phx_ida, 1, PHX_MAX_HANDLE, GFP_KERNEL);
	if (ret < 0)
		goto err_free;
	reg->handle = ret;
	reg->mmap_off = (u64)reg->handle << PHX_MMAP_SHIFT;

	ret = prov->acquire(reg, arg);
	if (ret)
		goto err_free;
	if (reg->pdev)
		reg->status |= phx_mem_dev_status(reg->pdev);
	ret = phx_mem_create(reg);
	if (ret)
		goto err_release;
	reg->live = true;
	atomic64_inc(&phx_regs_live);

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
	phx_reg_put(reg);
	return ret;
}

int phx_unregister(struct file *file, u32 handle)
{
	struct phx_reg *reg = phx_file_take(file->private_data, handle);

	if (!reg)
		return -ENOENT;
	phx_reg_revoke_async(reg);
	/* the ABI promises: in-flight I/O done and pages gone on return */
	if (wait_for_completion_killable(&reg->done))
		pr_info_ratelimited("%s: unregister of handle %u interrupted; it completes in the background\n",
				    current->comm, handle);
	phx_reg_put(reg);
	return 0;
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
 * PTEs are installed at mmap time; a fault means they were zapped: by
 * revocation (SIGBUS) or by madvise(MADV_DONTNEED) (reinstall).
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

static vm_fault_t phx_vm_fault_dead(struct vm_fault *vmf)
{
	return VM_FAULT_SIGBUS;
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

/* for a VMA whose mmap failed half way: nothing to release */
static const struct vm_operations_struct phx_vm_dead_ops = {
	.fault = phx_vm_fault_dead,
};

static int phx_mmap(struct file *file, struct vm_area_struct *vma)
{
	struct phx_file *pf = file->private_data;
	u64 off = (u64)vma->vm_pgoff << PAGE_SHIFT;
	unsigned long len = vma->vm_end - vma->vm_start, idx, addr;
	struct phx_reg *reg;
	int ret = 0;

	if (!(vma->vm_flags & VM_SHARED))
		return -EINVAL;		/* a private (COW) mapping makes no sense */
	reg = phx_file_find_off(pf, off);
	if (!reg)
		return -ENXIO;
	idx = (off - reg->mmap_off) >> PAGE_SHIFT;
	if (off - reg->mmap_off > reg->length ||
	    len > reg->length - (off - reg->mmap_off)) {
		ret = -EINVAL;
		goto err_put;
	}

	/*
	 * VM_DONTCOPY: fork() does not give the child the mapping.
	 * VM_MIXEDMAP: pages are ZONE_DEVICE pages (GUP works, no VM_IO).
	 */
	vm_flags_set(vma, VM_DONTCOPY | VM_DONTEXPAND | VM_DONTDUMP |
		     VM_MIXEDMAP);
	vma->vm_ops = &phx_vm_ops;
	vma->vm_private_data = reg;	/* the reference found above */

	mutex_lock(&reg->lock);
	if (!reg->live) {
		ret = -ENODEV;
	} else {
		for (addr = vma->vm_start; addr < vma->vm_end;
		     addr += PAGE_SIZE, idx++) {
			ret = vm_insert_page(vma, addr, phx_reg_page(reg, idx));
			if (ret)
				break;
		}
	}
	mutex_unlock(&reg->lock);
	if (ret) {
		/* the core unmaps the VMA; make sure it does not see us */
		vma->vm_ops = &phx_vm_dead_ops;
		vma->vm_private_data = NULL;
		goto err_put;
	}
	return 0;

err_put:
	phx_reg_put(reg);
	return ret;
}

/* ---------------------------------------------------------------------- */
/* open / release                                                           */

static int phx_open(struct inode *inode, struct file *file)
{
	struct phx_file *pf = kzalloc(sizeof(*pf), GFP_KERNEL);

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
			if (phx_reg_quiet(reg)) {
				phx_reg_finish_now(reg);	/* the usual case */
			} else {
				kref_get(&reg->kref);
				queue_work(phx_wq, &reg->finish_work);
			}
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
	ret = phx_nvidia_init();
	if (ret)
		goto err_wq;
	ret = misc_register(&phx_misc);
	if (ret)
		goto err_nvidia;
	pr_info("ready: /dev/phx, ABI %d, kernel P2PDMA %s, NVIDIA p2p %s\n",
		PHX_ABI_VERSION,
		IS_ENABLED(CONFIG_PCI_P2PDMA) ? "yes" : "no (GENERIC pages)",
		phx_nvidia_available() ? "found" : "not loaded");
	return 0;

err_nvidia:
	phx_nvidia_exit();
err_wq:
	destroy_workqueue(phx_wq);
	return ret;
}

static void __exit phx_exit(void)
{
	misc_deregister(&phx_misc);
	destroy_workqueue(phx_wq);	/* waits for teardowns still running */
	phx_nvidia_exit();
	ida_destroy(&phx_ida);
}

module_init(phx_init);
module_exit(phx_exit);

MODULE_DESCRIPTION("phx: device memory as ZONE_DEVICE pages for O_DIRECT I/O");
MODULE_LICENSE("GPL");
