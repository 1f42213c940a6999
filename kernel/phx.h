/* SPDX-License-Identifier: GPL-2.0 */
/*
 * Private declarations shared by the files of phx.ko, and the interface
 * a provider module (phx_nv.ko) builds against.
 */
#ifndef _PHX_H
#define _PHX_H

#include <linux/completion.h>
#include <linux/fs.h>
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
/* Registrations are made of 2 MiB chunks (PHX_REG_ALIGN). */
#define PHX_CHUNK_SHIFT		21
#define PHX_CHUNK_PAGES		(1UL << (PHX_CHUNK_SHIFT - PAGE_SHIFT))

/* Number of provider ids (PHX_PROV_*) the core knows. */
#define PHX_NR_PROVIDERS	3

struct phx_reg;
struct phx_pci;

/**
 * struct phx_provider - a source of device memory.
 * @name: for messages.
 * @owner: the module implementing it (held while a registration uses it).
 * @acquire: validate @arg, check the rights of @file's opener, fill
 *	reg->ranges (kvmalloc'ed, freed by the core), reg->nr_ranges,
 *	reg->pdev (a reference) and reg->bar; 0 or -errno.  The memory must
 *	stay the registration's until @release: phx has no way to take
 *	back a page that I/O or a pipe still holds, so a provider whose
 *	memory can be revoked by its owner (a free callback) must refuse.
 * @release: undo @acquire (may sleep; runs on phx's workqueue, in no
 *	particular process, once no page of the registration is referenced).
 */
struct phx_provider {
	const char *name;
	struct module *owner;
	int (*acquire)(struct phx_reg *reg, const struct phx_register *arg,
		       struct file *file);
	void (*release)(struct phx_reg *reg);
};

/**
 * struct phx_reg - one registered range of device memory.
 * @kref: held by the owning file's list, by every VMA mapping it and by
 *	a queued teardown.  Each registration also holds phx.ko until it is
 *	freed, so rmmod is refused (not blocked) while a teardown waits.
 * @node: in the owning file's list (under phx_file.lock).
 * @handle: user-visible id, unique in the module.
 * @mmap_off: byte offset of the mapping window in the device file.
 * @length: bytes.
 * @mapping: the device file's address_space, for revocation.
 * @prov: provider.
 * @prov_data: the provider's private state.
 * @pdev: the PCI device holding the memory (a reference), or NULL.
 * @bar: its BAR index, or -1.
 * @flags: PHX_REG_* from the caller.
 * @uid: the user charged for it (per-user limits), until its pages are gone.
 * @mode: PHX_MODE_*.
 * @status: PHX_ST_*.
 * @nr_ranges: entries in @ranges.
 * @ranges: the memory, as physical CPU address ranges.
 * @chunk_pfn: first pfn of each 2 MiB chunk: O(1) page lookup.
 * @pgmap: GENERIC mode: our pagemap (nr_range == @nr_ranges).
 * @p2p: P2PDMA mode: the phx-bound device whose published BAR holds it.
 * @own_ref: phx holds the idle reference of every page (the kernel left
 *	them at 0: P2PDMA pages from 6.15 on) and drops it at teardown.
 * @lock: held to test @live and insert PTEs, to clear @live and zap, and
 *	while the pages are created.
 * @live: pages exist and may be mapped.
 * @revoked: revocation started; the registration never goes live again.
 * @charged: @uid is charged for it.
 * @finish_work: the teardown after revocation: polls (never sleeps in a
 *	worker) until no page is referenced, then removes the pages.
 * @scan_idx: pages below it were seen idle by the teardown (after the
 *	revocation nothing can take a new reference, so they stay idle).
 * @rcu_synced: the teardown waited for racing GUP-fast walkers once.
 * @busy_counted: the teardown counts in phx_nr_pages_busy().
 * @done: completed when the pages are gone and the provider released.
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
	kuid_t uid;
	u32 mode;
	u32 status;
	unsigned int nr_ranges;
	struct range *ranges;
	unsigned long *chunk_pfn;
	struct dev_pagemap *pgmap;
	struct phx_pci *p2p;
	bool own_ref;
	struct mutex lock;		/* see @lock above */
	bool live;
	bool revoked;
	bool charged;
	struct delayed_work finish_work;
	unsigned long scan_idx;
	bool rcu_synced;
	bool busy_counted;
	struct completion done;
};

/* the provider interface (exported, GPL-only, for phx_nv.ko) */
int phx_provider_register(u32 id, const struct phx_provider *prov);
void phx_provider_unregister(u32 id);

/* phx_main.c */
extern unsigned long long phx_max_reg_bytes;
struct page *phx_reg_page(struct phx_reg *reg, unsigned long idx);
void phx_reg_put(struct phx_reg *reg);
bool phx_reg_revoke(struct phx_reg *reg);
void phx_reg_revoke_async(struct phx_reg *reg);
u64 phx_nr_regs(void);
u64 phx_nr_pages_busy(void);
bool phx_provider_available(u32 id);

/* phx_mem.c: struct pages for device memory */
int phx_mem_create(struct phx_reg *reg);
void phx_mem_destroy(struct phx_reg *reg);
u32 phx_mem_dev_status(struct pci_dev *pdev);
u32 phx_mem_module_status(void);
u32 phx_mem_initiator_status(void);

/* phx_pci.c: devices bound to phx (one P2PDMA publication each) */
int phx_pci_init(void);
void phx_pci_exit(void);
struct phx_pci *phx_pci_get(struct pci_dev *pdev);
void phx_pci_put(struct phx_pci *pp);
int phx_pci_claim(struct phx_pci *pp, struct phx_reg *reg);
void phx_pci_unclaim(struct phx_reg *reg);

/* phx_ioctl.c */
struct phx_file;
long phx_ioctl(struct file *file, unsigned int cmd, unsigned long arg);
int phx_file_add(struct phx_file *pf, struct phx_reg *reg);
struct phx_reg *phx_file_take(struct phx_file *pf, u32 handle);
int phx_register(struct file *file, struct phx_register *arg);
int phx_unregister(struct file *file, u32 handle);

/* the built-in provider */
extern const struct phx_provider phx_pcibar_provider;

#endif /* _PHX_H */
