// SPDX-License-Identifier: GPL-2.0
/*
 * nv_p2p_stub.ko - a stand-in for the NVIDIA driver's peer-to-peer API in
 * the QEMU guest, so that phx_nv.ko runs end to end without a GPU.  It
 * behaves like RM does (open-gpu-kernel-modules, kernel-open/nvidia/
 * nv-p2p.c and src/nvidia/src/kernel/gpu/bus/p2p.c) where a client can
 * tell the difference.
 *
 * It exports the driver's functions with the driver's signatures
 * (declared once, in kernel/phx_nv_p2p.h); phx_nv.ko is built against
 * this module's Module.symvers exactly as against the driver's.  Built in
 * four variants (Kbuild: STUB_API, STUB_LICENSE):
 *   default    R535 and later: get/put_pages, free_page_table,
 *              get/put_pages_persistent
 *   cap        R515-R530: nvidia_p2p_cap_persistent_pages = 1, get_pages
 *              without a callback is persistent, put_pages releases it
 *   none       older: get_pages needs a callback, nothing is persistent
 *   nvidia     the default API under a proprietary license (no debugfs)
 * "GPU memory" is the ivshmem device's BAR 2, handed out in 64 KiB pages:
 *
 *   GPU VA STUB_VA_BASE + off      -> BAR 2 + off            (identity)
 *   GPU VA STUB_SPARSE_VA + off    -> first 2 MiB: BAR 2 + sparse_bar_off,
 *                                     the rest: a free physical range with
 *                                     nothing behind it (huge, sparse)
 *
 * RM's rules it follows:
 *   - Non-persistent tables (a free callback): put_pages finds the table
 *     by the calling process (token 0); from another process or a kworker
 *     it finds nothing, does nothing and returns 0.  A failing put keeps
 *     the table and its callback armed.  The callback runs when the memory
 *     is freed (free_now: cudaFree) with "RM's lock" held, the lock that
 *     get_pages and put_pages take too (lockdep sees the client's
 *     dependencies); a callback that takes longer than 50 ms is counted
 *     (slow_cb) and fails the tests.  After it returns the memory is the
 *     driver's again and the table is gone (free_page_table is a no-op).
 *   - Persistent tables: no callback; the memory stays allocated after
 *     cudaFree (free_now only marks it) until the table is put, from any
 *     context.  get_pages_persistent refuses what RM refuses (debugfs
 *     refuse_persistent: MIG, vGPU, confidential computing).
 * To see whether anything touches memory after the driver got it back,
 * the stub fills it with a poison byte then and checks it later (stats).
 *
 * debugfs, /sys/kernel/debug/nv_p2p_stub/:
 *   free_now         write VA: the application frees the memory covering
 *                    VA (0: all) from the writer: callbacks fire, persistent
 *                    tables keep the memory
 *   free_during_reg  write "N DELAY_US": the next N get_pages free their
 *                    memory from a work item DELAY_US after returning
 *   fail_get         write "ERRNO [N]": the next N get_pages fail with -ERRNO
 *   fail_put         write "ERRNO [N]": the next N puts fail (the table is
 *                    kept, as RM does)
 *   refuse_persistent write ERRNO: persistent mappings fail with it (0: no)
 *   reap             write anything: the driver drops every table left
 *                    (callbacks fire): what a process exit or unload does
 *   fragment         0: contiguous; 1: 2 MiB chunks in reverse order;
 *                    2: 64 KiB pages shuffled (not 2 MiB runs)
 *   pt_version       the version put in page tables
 *   pt_flags         the flags put in major-2 page tables
 *   poison           0: leave memory the driver got back as it is (for
 *                    tests that let the host check it afterwards)
 *   stats            read: live tables, callbacks, client bugs, poison...
 *   counters         read: the same line with poison_bad -1, without the
 *                    scan of every poisoned byte (for tests that poll: on
 *                    the KASAN kernel a scan takes seconds)
 */
#define pr_fmt(fmt) KBUILD_MODNAME ": " fmt

#include <linux/debugfs.h>
#include <linux/delay.h>
#include <linux/io.h>
#include <linux/ioport.h>
#include <linux/ktime.h>
#include <linux/module.h>
#include <linux/mutex.h>
#include <linux/pci.h>
#include <linux/sched.h>
#include <linux/slab.h>
#include <linux/uaccess.h>
#include <linux/workqueue.h>

#include "phx_nv_p2p.h"

#ifdef STUB_PROPRIETARY
/*
 * The proprietary variant exists only so that a test can load phx_nv.ko
 * next to it: the kernel must refuse to link it (phx's provider interface
 * is GPL-only).  A proprietary module may not use GPL-only symbols itself,
 * so this variant is nothing but the API, refusing everything.
 */
int nvidia_p2p_get_pages(u64 p2p_token, u32 va_space, u64 virtual_address,
			 u64 length, struct nvidia_p2p_page_table **page_table,
			 void (*free_callback)(void *data), void *data)
{
	return -ENODEV;
}
EXPORT_SYMBOL(nvidia_p2p_get_pages);

int nvidia_p2p_put_pages(u64 p2p_token, u32 va_space, u64 virtual_address,
			 struct nvidia_p2p_page_table *page_table)
{
	return -EINVAL;
}
EXPORT_SYMBOL(nvidia_p2p_put_pages);

int nvidia_p2p_free_page_table(struct nvidia_p2p_page_table *page_table)
{
	return 0;
}
EXPORT_SYMBOL(nvidia_p2p_free_page_table);

int nvidia_p2p_get_pages_persistent(u64 virtual_address, u64 length,
				    struct nvidia_p2p_page_table **page_table,
				    u32 flags)
{
	return -ENODEV;
}
EXPORT_SYMBOL(nvidia_p2p_get_pages_persistent);

int nvidia_p2p_put_pages_persistent(u64 virtual_address,
				    struct nvidia_p2p_page_table *page_table,
				    u32 flags)
{
	return -EINVAL;
}
EXPORT_SYMBOL(nvidia_p2p_put_pages_persistent);

static int __init stub_init(void)
{
	return 0;
}

static void __exit stub_exit(void)
{
}

module_init(stub_init);
module_exit(stub_exit);

MODULE_DESCRIPTION("Stand-in for the NVIDIA peer-to-peer API, proprietary license (tests)");
MODULE_LICENSE("Proprietary");
#else /* !STUB_PROPRIETARY */

#define STUB_VA_BASE	0x100000000000ULL
#define STUB_SPARSE_VA	0x200000000000ULL
#define STUB_PAGE	SZ_64K
#define STUB_CHUNK	SZ_2M
#define STUB_POISON	0x5a
#define STUB_SLOW_CB_MS	50
#define STUB_FORCE_BAR1	1	/* NVIDIA_P2P_FLAGS_FORCE_BAR1_MAPPING */

static unsigned long long sparse_bytes = 18ULL << 30;
module_param(sparse_bytes, ullong, 0444);
MODULE_PARM_DESC(sparse_bytes, "Size of the sparse GPU VA region");
static unsigned long long sparse_bar_off = 160ULL << 20;
module_param(sparse_bar_off, ullong, 0444);
MODULE_PARM_DESC(sparse_bar_off, "BAR offset behind the sparse region's first 2 MiB");

enum { ST_LIVE, ST_FIRING, ST_DONE };

struct stub_pt {
	struct list_head node;
	struct nvidia_p2p_page_table pt;
	struct nvidia_p2p_page *page_arr;
	u64 va, len;
	void (*cb)(void *data);
	void *data;
	bool persistent;
	pid_t tgid;		/* the process that got it (token-0 lookups) */
	int state;
	bool app_freed;
	struct work_struct fire_work;
	unsigned long fire_delay_us;
};

struct stub_poison {
	struct list_head node;
	u64 bar_off, len;
};

/*
 * "RM's lock": held by get_pages, put_pages and around the free callback,
 * as RM holds its GPU lock there.  Outside stub_lock.
 */
static DEFINE_MUTEX(stub_rm_lock);
static DEFINE_MUTEX(stub_lock);		/* everything below */
static LIST_HEAD(stub_tables);
static LIST_HEAD(stub_poisoned);
static struct pci_dev *stub_pdev;
static phys_addr_t bar_start;
static u64 bar_len;
static struct resource *sparse_res;
static u32 fragment;
static u32 pt_version = NVIDIA_P2P_PAGE_TABLE_VERSION;
static u32 pt_flags;
static bool poison = true;
static int fail_get_errno, fail_get_n, fail_put_errno, fail_put_n;
static int refuse_persistent;
static int during_reg_n;
static unsigned long during_reg_us;
static unsigned long n_tables, n_gets, n_puts, n_fired, n_client_bugs;
static unsigned long n_slow_cb, n_put_miss, n_app_freed;
static struct stub_pt *firing;	/* the table whose callback runs */
static u8 stub_uuid[16] = "nv_p2p_stub-gpu";

/*
 * R515-R530 export it as 1.  The default variant exports it as 0 (R535+
 * drivers do not export it at all) only so that phx_nv.ko, built against
 * that variant's Module.symvers, records its CRC and so also loads next to
 * the cap variant on a CONFIG_MODVERSIONS kernel.  A phx_nv.ko built
 * against a real driver's Module.symvers is loaded next to that driver.
 */
#if defined(STUB_API_CAP)
int nvidia_p2p_cap_persistent_pages = 1;
EXPORT_SYMBOL(nvidia_p2p_cap_persistent_pages);
#elif !defined(STUB_API_NONE)
int nvidia_p2p_cap_persistent_pages;
EXPORT_SYMBOL(nvidia_p2p_cap_persistent_pages);
#endif

/* Physical address of GPU VA @va, or 0 when it is not "GPU memory". */
static u64 stub_va_to_pa(u64 va)
{
	if (va >= STUB_VA_BASE && va - STUB_VA_BASE < bar_len)
		return bar_start + (va - STUB_VA_BASE);
	if (sparse_res && va >= STUB_SPARSE_VA &&
	    va - STUB_SPARSE_VA < sparse_bytes) {
		u64 off = va - STUB_SPARSE_VA;

		if (off < STUB_CHUNK)
			return bar_start + sparse_bar_off + off;
		return sparse_res->start + off;
	}
	return 0;
}

/* Where page @i of a @n-page request at @va lives, under the fragment mode. */
static u64 stub_page_pa(u64 va, unsigned long i, unsigned long n)
{
	unsigned long per_chunk = STUB_CHUNK / STUB_PAGE;

	if (fragment == 1 && !(n % per_chunk)) {
		unsigned long chunks = n / per_chunk, c = i / per_chunk;

		i = (chunks - 1 - c) * per_chunk + i % per_chunk;
	} else if (fragment == 2 && n > 1) {
		/* swap neighbours: 64 KiB runs, never a 2 MiB one */
		i = (i & 1) ? i - 1 : (i + 1 < n ? i + 1 : i);
	}
	return stub_va_to_pa(va + (u64)i * STUB_PAGE);
}

static bool stub_in_bar(u64 pa)
{
	return pa >= bar_start && pa - bar_start < bar_len;
}

/* The driver has the memory of @sp back: poison it, remember (lock held). */
static void stub_poison(struct stub_pt *sp)
{
	unsigned long i;

	if (!poison)
		return;
	for (i = 0; i < sp->pt.entries; i++) {
		u64 pa = sp->page_arr[i].physical_address;
		struct stub_poison *p;
		void *kva;

		if (!stub_in_bar(pa))
			continue;
		kva = memremap(pa, STUB_PAGE, MEMREMAP_WB);
		if (!kva)
			continue;
		memset(kva, STUB_POISON, STUB_PAGE);
		memunmap(kva);
		p = kzalloc(sizeof(*p), GFP_KERNEL);
		if (!p)
			continue;
		p->bar_off = pa - bar_start;
		p->len = STUB_PAGE;
		list_add_tail(&p->node, &stub_poisoned);
	}
}

/* Forget poison records overlapping [pa, pa + len) (handed out again). */
static void stub_unpoison(u64 pa, u64 len)
{
	struct stub_poison *p, *t;

	list_for_each_entry_safe(p, t, &stub_poisoned, node) {
		u64 a = bar_start + p->bar_off;

		if (a < pa + len && pa < a + p->len) {
			list_del(&p->node);
			kfree(p);
		}
	}
}

/* Bytes of poisoned memory written since the driver got it back. */
static unsigned long stub_poison_bad(void)
{
	struct stub_poison *p;
	unsigned long bad = 0;

	list_for_each_entry(p, &stub_poisoned, node) {
		u8 *kva = memremap(bar_start + p->bar_off, p->len, MEMREMAP_WB);
		u64 i;

		if (!kva)
			continue;
		/* word-wise first: a clean range is the common case */
		if (memchr_inv(kva, STUB_POISON, p->len))
			for (i = 0; i < p->len; i++)
				bad += kva[i] != STUB_POISON;
		memunmap(kva);
	}
	return bad;
}

static void stub_free(struct stub_pt *sp)
{
	kvfree(sp->pt.pages);
	kvfree(sp->page_arr);
	kfree(sp);
}

/* The live table at @pt (stub_lock held). */
static struct stub_pt *stub_find(struct nvidia_p2p_page_table *pt)
{
	struct stub_pt *sp;

	list_for_each_entry(sp, &stub_tables, node)
		if (&sp->pt == pt && sp->state == ST_LIVE)
			return sp;
	return NULL;
}

/* @sp's memory goes back to the driver and the table away (both locks held). */
static void stub_drop_locked(struct stub_pt *sp)
{
	stub_poison(sp);
	sp->state = ST_DONE;
	list_del(&sp->node);
	n_tables--;
}

/* Free a dropped table, once no fire work can run for it (no lock held). */
static void stub_drop_finish(struct stub_pt *sp, bool from_work)
{
	if (!from_work)
		cancel_work_sync(&sp->fire_work);	/* it sees ST_DONE */
	stub_free(sp);
}

/*
 * The application frees the memory under @sp (cudaFree).  A callback
 * table: the callback runs under RM's lock, then the memory and the table
 * are the driver's.  A persistent table keeps the memory.  Returns true
 * when @sp was dropped (the caller then calls stub_drop_finish()).
 * stub_rm_lock held.
 */
static bool stub_app_free(struct stub_pt *sp)
{
	ktime_t t0;
	s64 ms;

	lockdep_assert_held(&stub_rm_lock);
	mutex_lock(&stub_lock);
	if (sp->state != ST_LIVE) {
		mutex_unlock(&stub_lock);
		return false;
	}
	if (sp->persistent) {
		if (!sp->app_freed)
			n_app_freed++;
		sp->app_freed = true;
		mutex_unlock(&stub_lock);
		return false;
	}
	sp->state = ST_FIRING;
	firing = sp;
	mutex_unlock(&stub_lock);

	t0 = ktime_get();
	sp->cb(sp->data);
	ms = ktime_ms_delta(ktime_get(), t0);

	mutex_lock(&stub_lock);
	firing = NULL;
	n_fired++;
	if (ms > STUB_SLOW_CB_MS) {
		n_slow_cb++;
		pr_err("a free callback took %lld ms (RM's free path is stalled meanwhile)\n",
		       ms);
	}
	stub_drop_locked(sp);
	mutex_unlock(&stub_lock);
	return true;
}

static void stub_fire_work(struct work_struct *work)
{
	struct stub_pt *sp = container_of(work, struct stub_pt, fire_work);
	bool dropped;

	/* microseconds, not jiffies: the window is phx's registration */
	if (sp->fire_delay_us)
		usleep_range(sp->fire_delay_us, sp->fire_delay_us + 5);
	mutex_lock(&stub_rm_lock);
	dropped = stub_app_free(sp);
	mutex_unlock(&stub_rm_lock);
	if (dropped)
		stub_drop_finish(sp, true);
}

static int stub_get(u64 va, u64 length, struct nvidia_p2p_page_table **page_table,
		    void (*free_callback)(void *data), void *data, bool persistent)
{
	unsigned long n = length / STUB_PAGE, i;
	struct stub_pt *sp;
	int ret = 0;

	if (!page_table || !length || !IS_ALIGNED(va | length, STUB_PAGE) ||
	    !stub_va_to_pa(va) || !stub_va_to_pa(va + length - 1))
		return -EINVAL;
	mutex_lock(&stub_rm_lock);
	mutex_lock(&stub_lock);
	n_gets++;
	if (fail_get_n > 0) {
		fail_get_n--;
		ret = -fail_get_errno;
	} else if (persistent && refuse_persistent) {
		ret = -refuse_persistent;
	}
	mutex_unlock(&stub_lock);
	if (ret)
		goto out;

	ret = -ENOMEM;
	sp = kzalloc(sizeof(*sp), GFP_KERNEL);
	if (!sp)
		goto out;
	sp->page_arr = kvcalloc(n, sizeof(*sp->page_arr), GFP_KERNEL);
	sp->pt.pages = kvcalloc(n, sizeof(*sp->pt.pages), GFP_KERNEL);
	if (!sp->page_arr || !sp->pt.pages) {
		stub_free(sp);
		goto out;
	}
	for (i = 0; i < n; i++) {
		sp->page_arr[i].physical_address = stub_page_pa(va, i, n);
		sp->pt.pages[i] = &sp->page_arr[i];
	}
	sp->pt.version = pt_version;
	sp->pt.page_size = NVIDIA_P2P_PAGE_SIZE_64KB;
	sp->pt.entries = n;
	sp->pt.gpu_uuid = stub_uuid;
	sp->pt.flags = NVIDIA_P2P_VERSION_MAJOR(pt_version) >= 2 ? pt_flags : 0;
	sp->va = va;
	sp->len = length;
	sp->cb = free_callback;
	sp->data = data;
	sp->persistent = persistent;
	sp->tgid = current->tgid;
	INIT_WORK(&sp->fire_work, stub_fire_work);

	mutex_lock(&stub_lock);
	for (i = 0; i < n; i++)
		if (stub_in_bar(sp->page_arr[i].physical_address))
			stub_unpoison(sp->page_arr[i].physical_address, STUB_PAGE);
	list_add(&sp->node, &stub_tables);
	n_tables++;
	*page_table = &sp->pt;
	if (during_reg_n > 0) {
		during_reg_n--;
		sp->fire_delay_us = during_reg_us;
		queue_work(system_unbound_wq, &sp->fire_work);
	}
	mutex_unlock(&stub_lock);
	ret = 0;
out:
	mutex_unlock(&stub_rm_lock);
	return ret;
}

int nvidia_p2p_get_pages(u64 p2p_token, u32 va_space, u64 virtual_address,
			 u64 length, struct nvidia_p2p_page_table **page_table,
			 void (*free_callback)(void *data), void *data)
{
	if (p2p_token || va_space)
		return -EINVAL;		/* the stub knows token 0 only */
	if (!free_callback) {
#ifdef STUB_API_CAP
		return stub_get(virtual_address, length, page_table, NULL, NULL,
				true);
#else
		return -EINVAL;
#endif
	}
	if (!data)
		return -EINVAL;
	return stub_get(virtual_address, length, page_table, free_callback, data,
			false);
}
EXPORT_SYMBOL(nvidia_p2p_get_pages);

/*
 * Release @sp, found by the caller (RM's lock held): a failing put keeps
 * the table (and its callback) as RM does.
 */
static int stub_put(struct stub_pt *sp)
{
	int ret = 0;

	mutex_lock(&stub_lock);
	if (fail_put_n > 0) {
		fail_put_n--;
		ret = -fail_put_errno;
	} else {
		stub_drop_locked(sp);
	}
	mutex_unlock(&stub_lock);
	return ret;
}

int nvidia_p2p_put_pages(u64 p2p_token, u32 va_space, u64 virtual_address,
			 struct nvidia_p2p_page_table *page_table)
{
	struct stub_pt *sp;
	int ret = 0;

	if (!page_table)
		return 0;
	mutex_lock(&stub_rm_lock);
	mutex_lock(&stub_lock);
	n_puts++;
	sp = stub_find(page_table);
	/*
	 * RM looks a token-0 mapping up by the calling process; a persistent
	 * one (R515-R530) by its own object.  Not found: success, nothing done.
	 */
	if (sp && (p2p_token || va_space || sp->va != virtual_address))
		sp = NULL;
#ifdef STUB_API_CAP
	if (sp && !sp->persistent && sp->tgid != current->tgid)
		sp = NULL;
#else
	if (sp && (sp->persistent || sp->tgid != current->tgid))
		sp = NULL;
#endif
	if (!sp)
		n_put_miss++;
	mutex_unlock(&stub_lock);
	if (sp)
		ret = stub_put(sp);
	mutex_unlock(&stub_rm_lock);
	if (sp && !ret)
		stub_drop_finish(sp, false);
	return ret;
}
EXPORT_SYMBOL(nvidia_p2p_put_pages);

#if !defined(STUB_API_CAP) && !defined(STUB_API_NONE)
int nvidia_p2p_get_pages_persistent(u64 virtual_address, u64 length,
				    struct nvidia_p2p_page_table **page_table,
				    u32 flags)
{
	if (flags & STUB_FORCE_BAR1)
		return -ENOTSUPP;	/* coherent platforms only */
	if (flags)
		return -EINVAL;
	return stub_get(virtual_address, length, page_table, NULL, NULL, true);
}
EXPORT_SYMBOL(nvidia_p2p_get_pages_persistent);

int nvidia_p2p_put_pages_persistent(u64 virtual_address,
				    struct nvidia_p2p_page_table *page_table,
				    u32 flags)
{
	struct stub_pt *sp;
	int ret;

	if (flags)
		return -EINVAL;
	if (!page_table)
		return 0;
	mutex_lock(&stub_rm_lock);
	mutex_lock(&stub_lock);
	n_puts++;
	sp = stub_find(page_table);
	if (!sp || !sp->persistent) {
		n_client_bugs++;
		mutex_unlock(&stub_lock);
		mutex_unlock(&stub_rm_lock);
		pr_err("put_pages_persistent of an unknown page table\n");
		return -EINVAL;
	}
	mutex_unlock(&stub_lock);
	ret = stub_put(sp);
	mutex_unlock(&stub_rm_lock);
	if (!ret)
		stub_drop_finish(sp, false);
	return ret;
}
EXPORT_SYMBOL(nvidia_p2p_put_pages_persistent);
#endif

/* A no-op in the driver; the stub checks it is called from the callback. */
int nvidia_p2p_free_page_table(struct nvidia_p2p_page_table *page_table)
{
	int ret = 0;

	mutex_lock(&stub_lock);
	if (!firing || &firing->pt != page_table) {
		pr_err("free_page_table outside of its free callback\n");
		n_client_bugs++;
		ret = -EINVAL;
	}
	mutex_unlock(&stub_lock);
	return ret;
}
EXPORT_SYMBOL(nvidia_p2p_free_page_table);

/* Fire/free every table matching @va (0: all); @reap drops persistent ones too. */
static void stub_free_va(u64 va, bool reap)
{
	struct stub_pt *sp;

	for (;;) {
		struct stub_pt *hit = NULL;
		bool dropped;

		mutex_lock(&stub_rm_lock);
		mutex_lock(&stub_lock);
		list_for_each_entry(sp, &stub_tables, node) {
			if (sp->state != ST_LIVE ||
			    (va && !(va >= sp->va && va - sp->va < sp->len)))
				continue;
			if (sp->persistent && !reap && sp->app_freed)
				continue;
			hit = sp;
			break;
		}
		if (hit && reap && hit->persistent) {
			stub_drop_locked(hit);
			mutex_unlock(&stub_lock);
			mutex_unlock(&stub_rm_lock);
			stub_drop_finish(hit, false);
			continue;
		}
		mutex_unlock(&stub_lock);
		dropped = hit && stub_app_free(hit);
		mutex_unlock(&stub_rm_lock);
		if (!hit)
			break;
		if (dropped)
			stub_drop_finish(hit, false);
	}
}

/* ---- debugfs ---- */

static struct dentry *stub_dir;

static ssize_t stub_free_now_write(struct file *f, const char __user *ubuf,
				   size_t len, loff_t *ppos)
{
	u64 va;
	int ret = kstrtoull_from_user(ubuf, len, 0, &va);

	if (ret)
		return ret;
	stub_free_va(va, false);
	return len;
}

static ssize_t stub_reap_write(struct file *f, const char __user *ubuf,
			       size_t len, loff_t *ppos)
{
	stub_free_va(0, true);
	return len;
}

static int stub_parse2(const char __user *ubuf, size_t len, long *a, long *b)
{
	char buf[64];
	int n;

	if (len >= sizeof(buf))
		return -EINVAL;
	if (copy_from_user(buf, ubuf, len))
		return -EFAULT;
	buf[len] = 0;
	*b = 1;
	n = sscanf(buf, "%ld %ld", a, b);
	return n >= 1 ? 0 : -EINVAL;
}

static ssize_t stub_during_reg_write(struct file *f, const char __user *ubuf,
				     size_t len, loff_t *ppos)
{
	long n, us;
	int ret = stub_parse2(ubuf, len, &n, &us);

	if (ret)
		return ret;
	mutex_lock(&stub_lock);
	during_reg_n = n;
	during_reg_us = us < 0 ? 0 : us;
	mutex_unlock(&stub_lock);
	return len;
}

static ssize_t stub_fail_write(struct file *f, const char __user *ubuf,
			       size_t len, loff_t *ppos)
{
	bool get = f->f_path.dentry->d_name.name[5] == 'g';
	long err, n;
	int ret = stub_parse2(ubuf, len, &err, &n);

	if (ret)
		return ret;
	if (err < 0 || err > 4095)
		return -EINVAL;
	mutex_lock(&stub_lock);
	if (get) {
		fail_get_errno = err;
		fail_get_n = n;
	} else {
		fail_put_errno = err;
		fail_put_n = n;
	}
	mutex_unlock(&stub_lock);
	return len;
}

/* The stats line; @scan: count poisoned bytes written (else -1). */
static void stub_show_line(struct seq_file *m, bool scan)
{
	mutex_lock(&stub_lock);
	seq_printf(m, "tables %lu gets %lu puts %lu fired %lu client_bugs %lu poison_bad %ld slow_cb %lu put_miss %lu app_freed %lu\n",
		   n_tables, n_gets, n_puts, n_fired, n_client_bugs,
		   scan ? (long)stub_poison_bad() : -1L, n_slow_cb, n_put_miss,
		   n_app_freed);
	mutex_unlock(&stub_lock);
}

static int stub_stats_show(struct seq_file *m, void *v)
{
	stub_show_line(m, true);
	return 0;
}
DEFINE_SHOW_ATTRIBUTE(stub_stats);

static int stub_counters_show(struct seq_file *m, void *v)
{
	stub_show_line(m, false);
	return 0;
}
DEFINE_SHOW_ATTRIBUTE(stub_counters);

static const struct file_operations stub_free_now_fops = {
	.write = stub_free_now_write,
};

static const struct file_operations stub_reap_fops = {
	.write = stub_reap_write,
};

static const struct file_operations stub_during_reg_fops = {
	.write = stub_during_reg_write,
};

static const struct file_operations stub_fail_fops = {
	.write = stub_fail_write,
};

static void stub_debugfs_init(void)
{
	stub_dir = debugfs_create_dir("nv_p2p_stub", NULL);
	debugfs_create_file("free_now", 0200, stub_dir, NULL, &stub_free_now_fops);
	debugfs_create_file("reap", 0200, stub_dir, NULL, &stub_reap_fops);
	debugfs_create_file("free_during_reg", 0200, stub_dir, NULL,
			    &stub_during_reg_fops);
	debugfs_create_file("fail_get", 0200, stub_dir, NULL, &stub_fail_fops);
	debugfs_create_file("fail_put", 0200, stub_dir, NULL, &stub_fail_fops);
	debugfs_create_u32("refuse_persistent", 0600, stub_dir,
			   (u32 *)&refuse_persistent);
	debugfs_create_u32("fragment", 0600, stub_dir, &fragment);
	debugfs_create_x32("pt_version", 0600, stub_dir, &pt_version);
	debugfs_create_x32("pt_flags", 0600, stub_dir, &pt_flags);
	debugfs_create_bool("poison", 0600, stub_dir, &poison);
	debugfs_create_file("stats", 0400, stub_dir, NULL, &stub_stats_fops);
	debugfs_create_file("counters", 0400, stub_dir, NULL, &stub_counters_fops);
}

static void stub_debugfs_exit(void)
{
	debugfs_remove_recursive(stub_dir);
}

/*
 * A free physical range with nothing behind it, high in the address space
 * (allocate_resource(): request_free_mem_region() needs
 * CONFIG_GET_FREE_REGION, which not every kernel here has).
 */
static struct resource *stub_reserve_sparse(void)
{
	struct resource *res = kzalloc(sizeof(*res), GFP_KERNEL);
	int ret;

	if (!res)
		return NULL;
	res->name = "nv_p2p_stub sparse";
	res->flags = IORESOURCE_MEM;
	/* the upper half of what the CPU can address (iomem_resource.end) */
	ret = allocate_resource(&iomem_resource, res, sparse_bytes,
				iomem_resource.end / 2 + 1, iomem_resource.end,
				SZ_1G, NULL, NULL);
	if (ret) {
		pr_info("no free physical range for the sparse region: %d\n", ret);
		kfree(res);
		return NULL;
	}
	return res;
}

static int __init stub_init(void)
{
	stub_pdev = pci_get_device(0x1af4, 0x1110, NULL);	/* ivshmem */
	if (!stub_pdev) {
		pr_err("no ivshmem device: nothing to lend as GPU memory\n");
		return -ENODEV;
	}
	bar_start = pci_resource_start(stub_pdev, 2);
	bar_len = pci_resource_len(stub_pdev, 2);
	if (!bar_len || sparse_bar_off + STUB_CHUNK > bar_len) {
		pci_dev_put(stub_pdev);
		return -ENODEV;
	}
	sparse_res = stub_reserve_sparse();
	stub_debugfs_init();
	pr_info("GPU memory: ivshmem %s BAR 2, %llu MiB at VA %#llx; sparse %llu MiB at VA %#llx; API %s\n",
		pci_name(stub_pdev), bar_len >> 20, STUB_VA_BASE,
		sparse_res ? sparse_bytes >> 20 : 0, STUB_SPARSE_VA,
#if defined(STUB_API_CAP)
		"R515-R530 (cap_persistent_pages)"
#elif defined(STUB_API_NONE)
		"no persistent pages"
#else
		"R535+ (get_pages_persistent)"
#endif
		);
	return 0;
}

static void __exit stub_exit(void)
{
	struct stub_poison *p, *t;
	struct stub_pt *sp, *st;

	stub_debugfs_exit();
	/* no client is loaded (module references): drop what clients left */
	list_for_each_entry_safe(sp, st, &stub_tables, node) {
		list_del(&sp->node);
		cancel_work_sync(&sp->fire_work);
		stub_free(sp);
	}
	list_for_each_entry_safe(p, t, &stub_poisoned, node) {
		list_del(&p->node);
		kfree(p);
	}
	if (sparse_res) {
		release_resource(sparse_res);
		kfree(sparse_res);
	}
	pci_dev_put(stub_pdev);
}

module_init(stub_init);
module_exit(stub_exit);

MODULE_DESCRIPTION("Stand-in for the NVIDIA peer-to-peer API over QEMU ivshmem (tests)");
MODULE_LICENSE("GPL");
#endif /* STUB_PROPRIETARY */
