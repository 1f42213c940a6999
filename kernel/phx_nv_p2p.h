/* SPDX-License-Identifier: GPL-2.0 */
/*
 * The NVIDIA peer-to-peer kernel API (nv-p2p.h of the NVIDIA driver),
 * declared from its documentation so that phx builds and loads without the
 * driver.  Only what phx calls; the symbols are resolved at run time.
 */
#ifndef _PHX_NV_P2P_H
#define _PHX_NV_P2P_H

#include <linux/types.h>

#define NVIDIA_P2P_PAGE_TABLE_VERSION	0x00010002
#define NVIDIA_P2P_VERSION_MAJOR(v)	((v) & 0xffff0000)

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

int nvidia_p2p_get_pages(u64 p2p_token, u32 va_space, u64 virtual_address,
			 u64 length, struct nvidia_p2p_page_table **page_table,
			 void (*free_callback)(void *data), void *data);
int nvidia_p2p_put_pages(u64 p2p_token, u32 va_space, u64 virtual_address,
			 struct nvidia_p2p_page_table *page_table);
int nvidia_p2p_free_page_table(struct nvidia_p2p_page_table *page_table);

typedef int (*nvidia_p2p_get_pages_fn)(u64 p2p_token, u32 va_space,
				       u64 virtual_address, u64 length,
				       struct nvidia_p2p_page_table **page_table,
				       void (*free_callback)(void *data),
				       void *data);
typedef int (*nvidia_p2p_put_pages_fn)(u64 p2p_token, u32 va_space,
				       u64 virtual_address,
				       struct nvidia_p2p_page_table *page_table);
typedef int (*nvidia_p2p_free_page_table_fn)(struct nvidia_p2p_page_table *page_table);

#endif /* _PHX_NV_P2P_H */
