/* SPDX-License-Identifier: Apache-2.0 */
/*
 * nvme_internal.h - what nvme.c and nvme_safety.c share; not installed.
 */
#ifndef PHX_NVME_INTERNAL_H
#define PHX_NVME_INTERNAL_H

#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#include "phx_nvme.h"

/* NVMe opcodes (NVM command set) and admin opcodes libphx sends. */
#define NVME_OP_FLUSH 0x00
#define NVME_OP_WRITE 0x01
#define NVME_OP_READ 0x02
#define NVME_OP_WRITE_ZEROES 0x08
#define NVME_OP_DSM 0x09
#define NVME_ADMIN_IDENTIFY 0x06

/* A namespace's block device, as sysfs names and numbers it. */
struct nvme_blkdev {
	char name[33];		/* kernel name, "nvme0n1" */
	dev_t devt;
};

int nvme_status_errno(uint32_t status);

/*
 * The block device of namespace @nsid behind @fd (its generic char device,
 * or the block device itself), found from fstat's st_rdev through sysfs.
 * 0, or -ENOTTY (@fd is no namespace node: a partition, another class) or
 * -ENODEV (not found) with the reason in @why (may be NULL); sets no error
 * text of its own.
 */
int nvme_find_block(int fd, uint32_t nsid, struct nvme_blkdev *b, char *why,
		    size_t len);
/* /sys/block/@blk/@attr as a number; 0 if absent or @blk is "". */
uint64_t nvme_sysfs_u64(const char *blk, const char *attr);
/*
 * All checks on namespace @nsid open at @fd (reached through @path).  0
 * with the block device's O_EXCL fd in *claim, or -errno and the reason.
 */
int nvme_safety_check(int fd, uint32_t nsid, const char *path, int *claim);

#endif /* PHX_NVME_INTERNAL_H */
