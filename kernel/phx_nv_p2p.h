/* SPDX-License-Identifier: GPL-2.0 */
/*
 * The NVIDIA peer-to-peer kernel API (nv-p2p.h of the NVIDIA driver),
 * declared from its documentation: only what phx_nv.ko calls.  The symbols
 * come from the module that exports them (nvidia.ko, or the guest tests'
 * stub), through that module's Module.symvers.
 */
#ifndef _PHX_NV_P2P_H
#define _PHX_NV_P2P_H

#include <linux/types.h>

/* Versions: major in the upper 16 bits, minor in the lower 16. */
#define NVIDIA_P2P_PAGE_TABLE_VERSION	0x00010002
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

struct nvidia_p2p_page_table {
	u32 version;
	u32 page_size;
	struct nvidia_p2p_page **pages;
	u32 entries;
	u8 *gpu_uuid;
};

/* Same major, and at least the minor phx was built against. */
static inline bool phx_nv_pt_compatible(const struct nvidia_p2p_page_table *pt)
{
	return NVIDIA_P2P_VERSION_MAJOR(pt->version) ==
	       NVIDIA_P2P_VERSION_MAJOR(NVIDIA_P2P_PAGE_TABLE_VERSION) &&
	       NVIDIA_P2P_VERSION_MINOR(pt->version) >=
	       NVIDIA_P2P_VERSION_MINOR(NVIDIA_P2P_PAGE_TABLE_VERSION);
}

int nvidia_p2p_get_pages(u64 p2p_token, u32 va_space, u64 virtual_address,
			 u64 length, struct nvidia_p2p_page_table **page_table,
			 void (*free_callback)(void *data), void *data);
int nvidia_p2p_put_pages(u64 p2p_token, u32 va_space, u64 virtual_address,
			 struct nvidia_p2p_page_table *page_table);
int nvidia_p2p_free_page_table(struct nvidia_p2p_page_table *page_table);

#endif /* _PHX_NV_P2P_H */
