/* SPDX-License-Identifier: GPL-2.0 */
/*
 * The NVIDIA peer-to-peer kernel API (nv-p2p.h of the NVIDIA driver),
 * declared from its documentation: only what phx_nv.ko calls.  The symbols
 * come from the module that exports them (nvidia.ko, or the guest tests'
 * stub), through that module's Module.symvers.
 *
 * Not every driver has every function: phx_nv.ko defines PHX_NV_OPTIONAL
 * as __weak before including this, so the ones a driver lacks resolve to
 * NULL at load time instead of failing it.
 */
#ifndef _PHX_NV_P2P_H
#define _PHX_NV_P2P_H

#include <linux/types.h>

#ifndef PHX_NV_OPTIONAL
#define PHX_NV_OPTIONAL
#endif

/*
 * Versions: major in the upper 16 bits, minor in the lower 16.  Major 2
 * (drivers from 580.95 on) appended @flags to the page table; phx reads
 * both majors.
 */
#define NVIDIA_P2P_PAGE_TABLE_VERSION	0x00020000
#define PHX_NV_PT_VERSION_V1		0x00010002
#define NVIDIA_P2P_VERSION_MAJOR(v)	(((v) >> 16) & 0xffff)
#define NVIDIA_P2P_VERSION_MINOR(v)	((v) & 0xffff)
enum nvidia_p2p_page_size_type {
	NVIDIA_P2P_PAGE_SIZE_4KB = 0,
	NVIDIA_P2P_PAGE_SIZE_64KB,
	NVIDIA_P2P_PAGE_SIZE_128KB,
	NVIDIA_P2P_PAGE_SIZE_COUNT
};

struct nvidia_p2p_page {
	u64 physical_address;
	union {
		struct {
			u32 wreqmb_h;
			u32 rreqmb_h;
			u32 rreqmb_0;
			u32 reserved[3];
		} fermi;
	} registers;
};

/* page table flags (major 2) */
#define NVIDIA_P2P_PAGE_TABLE_FLAGS_CPU_CACHEABLE	0x1

struct nvidia_p2p_page_table {
	u32 version;
	u32 page_size;
	struct nvidia_p2p_page **pages;
	u32 entries;
	u8 *gpu_uuid;
	u32 flags;		/* major 2 only: not there in a major 1 table */
};

/* Major 1 from the minor phx knows (2), or major 2 with any minor. */
static inline bool phx_nv_pt_compatible(const struct nvidia_p2p_page_table *pt)
{
	u32 major = NVIDIA_P2P_VERSION_MAJOR(pt->version);

	if (major == NVIDIA_P2P_VERSION_MAJOR(PHX_NV_PT_VERSION_V1))
		return NVIDIA_P2P_VERSION_MINOR(pt->version) >=
		       NVIDIA_P2P_VERSION_MINOR(PHX_NV_PT_VERSION_V1);
	return major == NVIDIA_P2P_VERSION_MAJOR(NVIDIA_P2P_PAGE_TABLE_VERSION);
}

static inline u32 phx_nv_pt_flags(const struct nvidia_p2p_page_table *pt)
{
	return NVIDIA_P2P_VERSION_MAJOR(pt->version) >= 2 ? pt->flags : 0;
}

int nvidia_p2p_get_pages(u64 p2p_token, u32 va_space, u64 virtual_address,
			 u64 length, struct nvidia_p2p_page_table **page_table,
			 void (*free_callback)(void *data), void *data);
int nvidia_p2p_put_pages(u64 p2p_token, u32 va_space, u64 virtual_address,
			 struct nvidia_p2p_page_table *page_table);
int nvidia_p2p_free_page_table(struct nvidia_p2p_page_table *page_table);

/* persistent pages, drivers from R535 on */
int nvidia_p2p_get_pages_persistent(u64 virtual_address, u64 length,
				    struct nvidia_p2p_page_table **page_table,
				    u32 flags) PHX_NV_OPTIONAL;
int nvidia_p2p_put_pages_persistent(u64 virtual_address,
				    struct nvidia_p2p_page_table *page_table,
				    u32 flags) PHX_NV_OPTIONAL;
/* R515 to R530: non-zero when get_pages without a callback is persistent */
extern int nvidia_p2p_cap_persistent_pages PHX_NV_OPTIONAL;

#endif /* _PHX_NV_P2P_H */
