/* SPDX-License-Identifier: GPL-2.0 */
/*
 * Private declarations shared by the files of phx.ko.
 */
#ifndef _PHX_H
#define _PHX_H

#include <linux/completion.h>
#include <linux/kref.h>
#include <linux/list.h>
#include <linux/memremap.h>
#include <linux/mutex.h>
#include <linux/pci.h>
#include <linux/range.h>
#include <linux/workqueue.h>

#include "include/uapi/phx_uapi.h"

/* Each registration owns a window of 2^PHX_MMAP_SHIFT bytes of mmap offsets. */
#define PHX_MMAP_SHIFT		40
#define PHX_MAX_HANDLE		((1U << 20) - 1)

struct phx_reg;
struct phx_p2p_dev;

/**
 * struct phx_provider - a source of device memory.
 * @name: for messages.
 * @acquire: validate @arg, check the caller's rights, fill reg->ranges,
 *	reg->nr_ranges, reg->pdev and reg->bar; 0 or -errno.
 * @release: undo @acquire (may sleep).  Not called after @revoked_by_owner
 *	has taken the memory away.
 */
struct phx_provider {
	const char *name;
	int (*acquire)(struct phx_reg *reg, const struct phx_register *arg);
	void (*release)(struct phx_reg *reg);
};

/**
 * struct phx_reg - one registered range of device memory.
 * @kref: held by the owning file's list and by every VMA mapping it.
 * @node: in the owning file's list (under phx_file.lock).
 * @handle: user-visible id, unique in the module.
 * @mmap_off: byte offset of the mapping window in the device file.
 * @length: bytes.
 * @mapping: the device file's address_space, for revocation.
 * @prov: provider; @prov_data its private state.
 * @pdev: the PCI device holding the memory (a reference), or NULL.
 * @bar: its BAR index.
 * @flags: PHX_REG_* from the caller.
 * @mode: PHX_MODE_*; @status: PHX_ST_*.
 * @nr_ranges: entries in @ranges (physical CPU addresses).
 * @pgmap: GENERIC mode: our pagemap (nr_range == @nr_ranges).
 * @p2p: P2PDMA mode: per-device state; @p2p_group: devres group;
 *	@p2p_kaddr: what pci_alloc_p2pmem() returned.
 * @lock: held to test @live and insert PTEs, to clear @live and zap.
 * @live: pages exist and may be mapped.
 * @finish_work: the teardown after revocation (waits for I/O).
 * @done: completed when the pages are gone.
 */
struct phx_reg {
	struct kref kref;
	struct list_head node;
	u32 handle;
	u64 mmap_off;
	u64 length;
	struct address_space *mapping;
	const struct phx_provider *prov;
	void *prov_data;
	struct pci_dev *pdev;
	int bar;
	u32 flags;
	u32 mode;
	u32 status;
	unsigned int nr_ranges;
	struct range *ranges;
	struct dev_pagemap *pgmap;
	struct phx_p2p_dev *p2p;
	void *p2p_group;
	void *p2p_kaddr;
	struct mutex lock;		/* protects live, mapping, PTE inserts */
	bool live;
	struct work_struct finish_work;
	struct completion done;
};

/* phx_main.c */
extern unsigned long long phx_max_reg_bytes;
struct page *phx_reg_page(struct phx_reg *reg, unsigned long idx);
void phx_reg_put(struct phx_reg *reg);
bool phx_reg_revoke(struct phx_reg *reg);
void phx_reg_revoke_async(struct phx_reg *reg);
u64 phx_nr_regs(void);
u64 phx_nr_pages_busy(void);

/* phx_mem.c: struct pages for device memory */
int phx_mem_create(struct phx_reg *reg);
void phx_mem_destroy(struct phx_reg *reg);
u32 phx_mem_dev_status(struct pci_dev *pdev);
u32 phx_mem_module_status(void);

/* phx_ioctl.c */
struct phx_file;
long phx_ioctl(struct file *file, unsigned int cmd, unsigned long arg);
int phx_file_add(struct phx_file *pf, struct phx_reg *reg);
struct phx_reg *phx_file_take(struct phx_file *pf, u32 handle);
int phx_register(struct file *file, struct phx_register *arg);
int phx_unregister(struct file *file, u32 handle);

/* providers */
extern const struct phx_provider phx_pcibar_provider;
extern const struct phx_provider phx_nvidia_provider;
int phx_nvidia_init(void);
void phx_nvidia_exit(void);
bool phx_nvidia_available(void);

#endif /* _PHX_H */
