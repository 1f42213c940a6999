// SPDX-License-Identifier: GPL-2.0
/*
 * nv_p2p_stub.ko - a stand-in for the NVIDIA driver's peer-to-peer API in
 * the QEMU guest, so that phx_nv.ko runs end to end without a GPU.
 *
 * It exports nvidia_p2p_get_pages(), nvidia_p2p_put_pages() and
 * nvidia_p2p_free_page_table() with the driver's signatures (declared once,
 * in kernel/phx_nv_p2p.h); phx_nv.ko is built against this module's
 * Module.symvers exactly as against the driver's.  "GPU memory" is the
 * ivshmem device's BAR 2, handed out in 64 KiB pages:
 *
 *   GPU VA STUB_VA_BASE + off      -> BAR 2 + off            (identity)
 *   GPU VA STUB_SPARSE_VA + off    -> first 2 MiB: BAR 2 + sparse_bar_off,
 *                                     the rest: a free physical range with
 *                                     nothing behind it (huge, sparse)
 *
 * The driver's rules it enforces or mimics: token and VA space 0, 64 KiB
 * alignment, the free callback may fire at any time after get_pages; in it
 * the client frees the page table (never calls put_pages); after it
 * returns the memory is the driver's again.  To see whether anything
 * writes the memory after that, the stub fills it with a poison byte when
 * the callback returns and checks it later (reported in "stats").
 *
 * debugfs, /sys/kernel/debug/nv_p2p_stub/:
 *   free_now         write VA: fire the callback of every page table that
 *                    covers VA (0: all), from the writer, like cudaFree
 *   free_during_reg  write "N DELAY_US": the next N get_pages fire their own
 *                    callback from a work item DELAY_US after returning
 *   fail_get         write "ERRNO [N]": the next N get_pages fail with -ERRNO
 *   fail_put         write "ERRNO [N]": the next N put_pages fail (the table
 *                    is still released, as the driver does)
 *   fragment         0: contiguous; 1: 2 MiB chunks in reverse order;
 *                    2: 64 KiB pages shuffled (not 2 MiB runs)
 *   pt_version       the version put in page tables
 *   stats            read: live tables, callbacks, client bugs, poison
 */
#define pr_fmt(fmt) KBUILD_MODNAME ": " fmt

#include <linux/debugfs.h>
#include <linux/delay.h>
#include <linux/io.h>
#include <linux/ioport.h>
#include <linux/module.h>
#include <linux/mutex.h>
#include <linux/pci.h>
#include <linux/slab.h>
#include <linux/uaccess.h>
#include <linux/wait.h>
#include <linux/workqueue.h>

#include "phx_nv_p2p.h"

#define STUB_VA_BASE	0x100000000000ULL
#define STUB_SPARSE_VA	0x200000000000ULL
#define STUB_PAGE	SZ_64K
#define STUB_CHUNK	SZ_2M
#define STUB_POISON	0x5a

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
	int state;
	bool client_freed;
	bool put_waiting;
	wait_queue_head_t wq;
	struct work_struct fire_work;
	unsigned long fire_delay_us;
};

struct stub_poison {
	struct list_head node;
	u64 bar_off, len;
};

static DEFINE_MUTEX(stub_lock);		/* everything below */
static LIST_HEAD(stub_tables);
static LIST_HEAD(stub_poisoned);
static struct pci_dev *stub_pdev;
static phys_addr_t bar_start;
static u64 bar_len;
static struct resource *sparse_res;
static u32 fragment;
static u32 pt_version = NVIDIA_P2P_PAGE_TABLE_VERSION;
static int fail_get_errno, fail_get_n, fail_put_errno, fail_put_n;
static int during_reg_n;
static unsigned long during_reg_us;
static unsigned long n_tables, n_gets, n_puts, n_fired, n_client_bugs;
static u8 stub_uuid[16] = "nv_p2p_stub-gpu";
static struct dentry *stub_dir;

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

/* Fill the BAR-backed part of @sp with poison and remember it (lock held). */
static void stub_poison(struct stub_pt *sp)
{
	unsigned long i;

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

/* Bytes of poisoned memory that were written after the callback returned. */
static unsigned long stub_poison_bad(void)
{
	struct stub_poison *p;
	unsigned long bad = 0;

	list_for_each_entry(p, &stub_poisoned, node) {
		u8 *kva = memremap(bar_start + p->bar_off, p->len, MEMREMAP_WB);
		u64 i;

		if (!kva)
			continue;
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

static struct stub_pt *stub_find(struct nvidia_p2p_page_table *pt)
{
	struct stub_pt *sp;

	list_for_each_entry(sp, &stub_tables, node)
		if (&sp->pt == pt)
			return sp;
	return NULL;
}

/* Claim a live table for firing (stub_lock held). */
static bool stub_claim(struct stub_pt *sp)
{
	if (sp->state != ST_LIVE)
		return false;
	sp->state = ST_FIRING;
	return true;
}

/*
 * The memory under a claimed table goes away: call back, then take the
 * memory back.  Whoever frees a table first cancels its fire work (and
 * waits for it), unless it is that work.
 */
static void stub_fire_claimed(struct stub_pt *sp, bool from_work)
{
	bool put_waiting;

	sp->cb(sp->data);

	mutex_lock(&stub_lock);
	n_fired++;
	/* the client frees the table in the callback, or has put_pages waiting */
	if (!sp->client_freed && !sp->put_waiting) {
		n_client_bugs++;
		pr_err("free callback returned without freeing the page table\n");
	}
	stub_poison(sp);	/* the memory is ours again */
	sp->state = ST_DONE;
	list_del(&sp->node);
	n_tables--;
	put_waiting = sp->put_waiting;
	wake_up_all(&sp->wq);
	mutex_unlock(&stub_lock);
	if (put_waiting)
		return;		/* the waiting put_pages frees it */
	if (!from_work)
		cancel_work_sync(&sp->fire_work);
	stub_free(sp);
}

static void stub_fire_work(struct work_struct *work)
{
	struct stub_pt *sp = container_of(work, struct stub_pt, fire_work);
	bool claimed;

	/* microseconds, not jiffies: the window is phx's registration */
	if (sp->fire_delay_us)
		usleep_range(sp->fire_delay_us, sp->fire_delay_us + 5);
	mutex_lock(&stub_lock);
	claimed = stub_claim(sp);
	mutex_unlock(&stub_lock);
	if (claimed)
		stub_fire_claimed(sp, true);
}

int nvidia_p2p_get_pages(u64 p2p_token, u32 va_space, u64 virtual_address,
			 u64 length, struct nvidia_p2p_page_table **page_table,
			 void (*free_callback)(void *data), void *data)
{
	unsigned long n = length / STUB_PAGE, i;
	struct stub_pt *sp;
	bool fire = false;
	int ret = 0;

	if (p2p_token || va_space || !page_table || !free_callback || !data ||
	    !length || !IS_ALIGNED(virtual_address | length, STUB_PAGE) ||
	    !stub_va_to_pa(virtual_address) ||
	    !stub_va_to_pa(virtual_address + length - 1))
		return -EINVAL;
	mutex_lock(&stub_lock);
	n_gets++;
	if (fail_get_n > 0) {
		fail_get_n--;
		ret = -fail_get_errno;
	}
	mutex_unlock(&stub_lock);
	if (ret)
		return ret;

	sp = kzalloc(sizeof(*sp), GFP_KERNEL);
	if (!sp)
		return -ENOMEM;
	sp->page_arr = kvcalloc(n, sizeof(*sp->page_arr), GFP_KERNEL);
	sp->pt.pages = kvcalloc(n, sizeof(*sp->pt.pages), GFP_KERNEL);
	if (!sp->page_arr || !sp->pt.pages) {
		stub_free(sp);
		return -ENOMEM;
	}
	for (i = 0; i < n; i++) {
		sp->page_arr[i].physical_address =
			stub_page_pa(virtual_address, i, n);
		sp->pt.pages[i] = &sp->page_arr[i];
	}
	sp->pt.version = pt_version;
	sp->pt.page_size = NVIDIA_P2P_PAGE_SIZE_64KB;
	sp->pt.entries = n;
	sp->pt.gpu_uuid = stub_uuid;
	sp->va = virtual_address;
	sp->len = length;
	sp->cb = free_callback;
	sp->data = data;
	init_waitqueue_head(&sp->wq);
	INIT_WORK(&sp->fire_work, stub_fire_work);

	mutex_lock(&stub_lock);
	for (i = 0; i < n; i++)
		if (stub_in_bar(sp->page_arr[i].physical_address))
			stub_unpoison(sp->page_arr[i].physical_address, STUB_PAGE);
	list_add(&sp->node, &stub_tables);
	n_tables++;
	if (during_reg_n > 0) {
		during_reg_n--;
		fire = true;
	}
	*page_table = &sp->pt;
	if (fire) {
		sp->fire_delay_us = during_reg_us;
		queue_work(system_unbound_wq, &sp->fire_work);
	}
	mutex_unlock(&stub_lock);
	return 0;
}
EXPORT_SYMBOL(nvidia_p2p_get_pages);

int nvidia_p2p_put_pages(u64 p2p_token, u32 va_space, u64 virtual_address,
			 struct nvidia_p2p_page_table *page_table)
{
	struct stub_pt *sp;
	int ret = 0;

	mutex_lock(&stub_lock);
	n_puts++;
	sp = stub_find(page_table);
	if (!sp || sp->va != virtual_address || p2p_token || va_space) {
		mutex_unlock(&stub_lock);
		pr_err("put_pages of an unknown page table\n");
		return -EINVAL;
	}
	/* a callback in progress: the driver waits for it, then it is gone */
	if (sp->state == ST_FIRING) {
		sp->put_waiting = true;
		mutex_unlock(&stub_lock);
		wait_event(sp->wq, READ_ONCE(sp->state) != ST_FIRING);
		cancel_work_sync(&sp->fire_work);
		stub_free(sp);
		return 0;
	}
	if (fail_put_n > 0) {
		fail_put_n--;
		ret = -fail_put_errno;
	}
	sp->state = ST_DONE;
	list_del(&sp->node);
	n_tables--;
	mutex_unlock(&stub_lock);
	cancel_work_sync(&sp->fire_work);	/* it sees ST_DONE */
	stub_free(sp);
	return ret;
}
EXPORT_SYMBOL(nvidia_p2p_put_pages);

int nvidia_p2p_free_page_table(struct nvidia_p2p_page_table *page_table)
{
	struct stub_pt *sp;
	int ret = 0;

	mutex_lock(&stub_lock);
	sp = stub_find(page_table);
	if (!sp || sp->state != ST_FIRING || sp->client_freed) {
		pr_err("free_page_table outside of its free callback\n");
		n_client_bugs++;
		ret = -EINVAL;
	} else {
		sp->client_freed = true;
	}
	mutex_unlock(&stub_lock);
	return ret;
}
EXPORT_SYMBOL(nvidia_p2p_free_page_table);

/* ---- debugfs ---- */

static ssize_t stub_free_now_write(struct file *f, const char __user *ubuf,
				   size_t len, loff_t *ppos)
{
	struct stub_pt *sp;
	u64 va;
	int ret = kstrtoull_from_user(ubuf, len, 0, &va);

	if (ret)
		return ret;
	for (;;) {
		struct stub_pt *hit = NULL;

		mutex_lock(&stub_lock);
		list_for_each_entry(sp, &stub_tables, node) {
			if ((!va || (va >= sp->va && va - sp->va < sp->len)) &&
			    stub_claim(sp)) {
				hit = sp;
				break;
			}
		}
		mutex_unlock(&stub_lock);
		if (!hit)
			break;
		/* claimed: put_pages waits for it, nobody else fires it */
		stub_fire_claimed(hit, false);
	}
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

static int stub_stats_show(struct seq_file *m, void *v)
{
	mutex_lock(&stub_lock);
	seq_printf(m, "tables %lu gets %lu puts %lu fired %lu client_bugs %lu poison_bad %lu\n",
		   n_tables, n_gets, n_puts, n_fired, n_client_bugs,
		   stub_poison_bad());
	mutex_unlock(&stub_lock);
	return 0;
}
DEFINE_SHOW_ATTRIBUTE(stub_stats);

static const struct file_operations stub_free_now_fops = {
	.write = stub_free_now_write,
};

static const struct file_operations stub_during_reg_fops = {
	.write = stub_during_reg_write,
};

static const struct file_operations stub_fail_fops = {
	.write = stub_fail_write,
};

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
	stub_dir = debugfs_create_dir("nv_p2p_stub", NULL);
	debugfs_create_file("free_now", 0200, stub_dir, NULL, &stub_free_now_fops);
	debugfs_create_file("free_during_reg", 0200, stub_dir, NULL,
			    &stub_during_reg_fops);
	debugfs_create_file("fail_get", 0200, stub_dir, NULL, &stub_fail_fops);
	debugfs_create_file("fail_put", 0200, stub_dir, NULL, &stub_fail_fops);
	debugfs_create_u32("fragment", 0600, stub_dir, &fragment);
	debugfs_create_x32("pt_version", 0600, stub_dir, &pt_version);
	debugfs_create_file("stats", 0400, stub_dir, NULL, &stub_stats_fops);
	pr_info("GPU memory: ivshmem %s BAR 2, %llu MiB at VA %#llx; sparse %llu MiB at VA %#llx\n",
		pci_name(stub_pdev), bar_len >> 20, STUB_VA_BASE,
		sparse_res ? sparse_bytes >> 20 : 0, STUB_SPARSE_VA);
	return 0;
}

static void __exit stub_exit(void)
{
	struct stub_poison *p, *t;

	debugfs_remove_recursive(stub_dir);
	/* module refcounts: no client can hold a table now */
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
