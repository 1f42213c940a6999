/* SPDX-License-Identifier: Apache-2.0 */
/*
 * nvme_internal.h - what nvme.c and nvme_safety.c share; not installed.
 */
#ifndef PHX_NVME_INTERNAL_H
#define PHX_NVME_INTERNAL_H

#include <stddef.h>
#include <stdint.h>

#include "phx_nvme.h"

/* NVMe opcodes (NVM command set) and admin opcodes libphx sends. */
#define NVME_OP_FLUSH 0x00
#define NVME_OP_WRITE 0x01
#define NVME_OP_READ 0x02
#define NVME_OP_WRITE_ZEROES 0x08
#define NVME_OP_DSM 0x09
#define NVME_ADMIN_IDENTIFY 0x06

int nvme_status_errno(uint32_t status);
void nvme_block_name(const char *path, char *blk, size_t len);
uint64_t nvme_sysfs_u64(const char *blk, const char *attr);
int nvme_claim_block(const char *blk);
int nvme_safety_check(int fd, uint32_t nsid, uint32_t lba_size,
		      uint64_t capacity, const char *path, const char *blk,
		      int *claim);

#endif /* PHX_NVME_INTERNAL_H */
