/* SPDX-License-Identifier: Apache-2.0 */
/*
 * phx_nvme.h - NVMe-direct I/O: NVMe commands on a namespace's generic char
 * device (/dev/ngXnY) through io_uring passthrough (IORING_OP_URING_CMD).
 *
 * A phx_nvme handle claims a range of a namespace's LBAs and moves host
 * buffers to and from it with NVMe Read/Write commands, bypassing the
 * filesystem and the block layer's request splitting and merging:
 *
 *   - identify: namespace (in-use LBA format, capacity, DLFEAT) and
 *     controller (MDTS, ONCS) with admin passthrough (NVME_IOCTL_ADMIN_CMD);
 *   - requests are split at the largest transfer the controller and the
 *     kernel accept (MDTS, max_hw_sectors, max_segments), kept in flight up
 *     to queue_depth, many commands per io_uring_enter;
 *   - registered (fixed) buffers use IORING_URING_CMD_FIXED where the kernel
 *     has it (6.1+), plain user addresses otherwise;
 *   - deallocate (TRIM) with Dataset Management (opcode 0x09, AD), falling
 *     back to Write Zeroes (0x08, with DEAC where DLFEAT allows) when the
 *     controller lacks DSM;
 *   - every command is checked against the claimed range before it is built;
 *   - the namespace's block device is found from the device number of the
 *     node opened (any name: a renamed mknod, a symlink), and the namespace
 *     is refused unless PHX_NVME_FORCE when that block device cannot be
 *     found or opened with O_EXCL, or is mounted, partitioned, held by
 *     another driver, or carries a signature libblkid recognises.
 *
 * A handle has nr_queues io_uring rings ("queues"); each call takes a free
 * queue for its whole duration, so calls from several threads run in
 * parallel up to nr_queues and wait for a queue beyond that.
 *
 * Offsets and lengths are bytes from the start of the namespace and must be
 * multiples of the LBA size.  Functions return 0 (or a byte count) or a
 * negative errno, never touch errno, and leave a text for the last error of
 * the calling thread in phx_strerror_last() (phx.h).  A command the
 * controller rejects fails with an errno chosen from its status (EINVAL,
 * EOPNOTSUPP, ERANGE, EROFS, EIO, ...); the text holds the NVMe status code
 * and its meaning.  A namespace that disappears gives -ENODEV.
 */
#ifndef PHX_NVME_H
#define PHX_NVME_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct phx_nvme phx_nvme;

/* ------------------------------------------------------------------------ */
/* Open / close                                                             */
/* ------------------------------------------------------------------------ */

/* struct phx_nvme_config.flags */
enum {
	/*
	 * Skip the safety checks (block device found and claimed O_EXCL,
	 * mounted, partitions, holders, signatures).
	 */
	PHX_NVME_FORCE = 1u << 0,
	/* Do not use registered buffers even where the kernel supports them. */
	PHX_NVME_NO_FIXED_BUFS = 1u << 1,
	/* Deallocate with Write Zeroes even when the controller has DSM. */
	PHX_NVME_NO_DSM = 1u << 2,
	/* Open read-only: writes and deallocation fail with -EBADF. */
	PHX_NVME_READONLY = 1u << 3,
	/*
	 * For tests only: let the claimed range extend past the namespace's
	 * capacity so that the controller, not libphx, rejects a command.
	 */
	PHX_NVME_TEST_NO_CAPACITY_CHECK = 1u << 15,
};

struct phx_nvme_config {
	uint32_t size;		/* sizeof(struct phx_nvme_config) */
	uint32_t queue_depth;	/* commands in flight per queue (32) */
	uint32_t nr_queues;	/* io_uring rings (2) */
	uint32_t max_transfer;	/* cap on bytes per command; 0: device limit */
	uint32_t flags;		/* PHX_NVME_* */
	uint32_t reserved0;
	uint64_t first_lba;	/* first LBA of the claimed range (0) */
	uint64_t nr_lbas;	/* LBAs claimed; 0: to the end of the namespace */
	uint32_t reserved[8];
};

/* Defaults above, overridden by PHX_NVME_QUEUE_DEPTH / PHX_NVME_QUEUES. */
void phx_nvme_config_init(struct phx_nvme_config *cfg);

/*
 * Open the namespace behind @path (its generic char device, /dev/ngXnY, or
 * any node with that device number) and claim [first_lba, first_lba +
 * nr_lbas).  Unless PHX_NVME_FORCE, the namespace's block device stays open
 * with O_EXCL while the handle lives, so nothing can mount it meanwhile.
 * Errors: -ENOTTY not an NVMe namespace char device (a block device, a
 * controller); -ENODEV its block device not found in sysfs; -ENOENT no
 * /dev node with the block device's number; -EBUSY mounted, held,
 * partitioned or claimed by someone else; -EACCES (or any other errno of
 * the O_EXCL open) the block device cannot be claimed; -EEXIST a foreign
 * signature; -ENOSYS libphx built without libblkid; -ERANGE a claimed
 * range outside the namespace; -EOPNOTSUPP a format libphx cannot drive
 * (metadata/PI).
 */
int phx_nvme_open(const char *path, const struct phx_nvme_config *cfg,
		  phx_nvme **out);

/* Wait for nothing (every call is synchronous), release rings and fds. */
int phx_nvme_close(phx_nvme *nv);

/* struct phx_nvme_info.features */
enum {
	PHX_NVME_FEAT_DSM = 1u << 0,		/* ONCS: Dataset Management */
	PHX_NVME_FEAT_WRITE_ZEROES = 1u << 1,	/* ONCS: Write Zeroes */
	PHX_NVME_FEAT_WZ_DEALLOC = 1u << 2,	/* DLFEAT: Write Zeroes DEAC */
	PHX_NVME_FEAT_FIXED_BUFS = 1u << 3,	/* IORING_URING_CMD_FIXED works */
	PHX_NVME_FEAT_EXCLUSIVE = 1u << 4,	/* block device held O_EXCL */
};

struct phx_nvme_info {
	uint32_t size;		/* sizeof(struct phx_nvme_info) */
	uint32_t nsid;
	uint32_t lba_size;	/* bytes, from the in-use LBA format */
	uint32_t metadata_size;	/* per-LBA metadata bytes of that format */
	uint64_t nr_lbas;	/* namespace size (NSZE) */
	uint64_t capacity;	/* nr_lbas * lba_size */
	uint32_t mdts;		/* raw MDTS (0: no limit) */
	uint32_t max_transfer;	/* bytes per command actually used */
	uint32_t max_segments;	/* kernel's limit (sysfs), 0 if unknown */
	uint32_t dlfeat;	/* raw DLFEAT: bits 2:0 what deallocated reads give */
	uint32_t oncs;		/* raw ONCS */
	uint32_t features;	/* PHX_NVME_FEAT_* */
	uint64_t first_lba;	/* claimed range */
	uint64_t claimed_lbas;
	uint32_t queue_depth;
	uint32_t nr_queues;
	char model[41];
	char serial[21];
	char firmware[9];
	char block_device[33];	/* "nvme0n1" (by device number), "" if none found */
	uint32_t reserved[8];
};

int phx_nvme_get_info(const phx_nvme *nv, struct phx_nvme_info *info);

/*
 * Identify the namespace behind @path (its generic char device or its block
 * device, any node name) without claiming it (no safety checks, nothing
 * written).  Fills @info (claimed fields zero; block_device "" if it was
 * not found).
 */
int phx_nvme_identify(const char *path, struct phx_nvme_info *info);

/*
 * The safety check phx_nvme_open() does, on its own, on the namespace's
 * char device or its block device: 0 when the namespace may be claimed, or
 * the errno phx_nvme_open() would refuse with and the reason in
 * phx_strerror_last().
 */
int phx_nvme_check(const char *path);

/* DLFEAT bits 2:0: what a deallocated block reads as. */
enum {
	PHX_NVME_DEALLOC_READS_UNKNOWN = 0,	/* not reported */
	PHX_NVME_DEALLOC_READS_ZEROES = 1,	/* all bytes 0x00 */
	PHX_NVME_DEALLOC_READS_ONES = 2,	/* all bytes 0xff */
};

/* ------------------------------------------------------------------------ */
/* Registered buffers                                                       */
/* ------------------------------------------------------------------------ */

/*
 * Register [addr, addr + len) with every queue's ring; commands whose data
 * lies inside it then use IORING_URING_CMD_FIXED.  -EOPNOTSUPP if the
 * kernel cannot, -ENOMEM/-EPERM under RLIMIT_MEMLOCK, -ENOSPC when 64
 * buffers are registered.  Returns 0 even if fixed uring_cmds turn out not
 * to work later (the handle then falls back to plain addresses).
 */
int phx_nvme_buf_register(phx_nvme *nv, void *addr, size_t len);
int phx_nvme_buf_deregister(phx_nvme *nv, void *addr);

/* ------------------------------------------------------------------------ */
/* I/O                                                                      */
/* ------------------------------------------------------------------------ */

enum phx_nvme_op {
	PHX_NVME_READ = 0,
	PHX_NVME_WRITE = 1,
};

/* One request of a batch.  Owned by the caller. */
struct phx_nvme_io {
	uint32_t op;		/* enum phx_nvme_op */
	uint32_t flags;		/* 0 */
	void *buf;
	uint64_t len;		/* bytes, a multiple of the LBA size */
	uint64_t offset;	/* bytes from LBA 0, a multiple of the LBA size */
	/* out */
	int64_t result;		/* len, or -errno */
	uint32_t status;	/* NVMe status (SCT << 8 | SC) of a failure, 0 */
	uint32_t commands;	/* NVMe commands it took */
};

/*
 * Move every request of @ios: each is split into commands of at most
 * max_transfer bytes, all kept in flight together up to queue_depth.
 * Returns 0 when all ran (each ios[i].result says how), or -errno when the
 * batch was refused before any command was issued (range, alignment).
 */
int phx_nvme_submit_wait(phx_nvme *nv, struct phx_nvme_io *ios, size_t n);

/* Single requests: bytes moved (= len) or -errno. */
int64_t phx_nvme_read(phx_nvme *nv, void *buf, uint64_t len, uint64_t offset);
int64_t phx_nvme_write(phx_nvme *nv, const void *buf, uint64_t len,
		       uint64_t offset);

/*
 * Deallocate (TRIM) [offset, offset + len): Dataset Management with the AD
 * attribute, up to 256 ranges per command; Write Zeroes when the
 * controller lacks DSM (or PHX_NVME_NO_DSM).  -EOPNOTSUPP when it has
 * neither.  What the range reads as afterwards: see info.dlfeat.
 */
int phx_nvme_deallocate(phx_nvme *nv, uint64_t offset, uint64_t len);

/* Write Zeroes over the range (no deallocation requested). */
int phx_nvme_write_zeroes(phx_nvme *nv, uint64_t offset, uint64_t len);

/* NVMe Flush (opcode 0x00) of the namespace. */
int phx_nvme_flush(phx_nvme *nv);

/* ------------------------------------------------------------------------ */
/* Counters and status codes                                                */
/* ------------------------------------------------------------------------ */

struct phx_nvme_stats {
	uint64_t reads;		/* requests, by op */
	uint64_t writes;
	uint64_t bytes_read;
	uint64_t bytes_written;
	uint64_t commands;	/* NVMe commands issued (all kinds) */
	uint64_t fixed_commands;	/* of them on registered buffers */
	uint64_t submits;	/* io_uring_enter calls */
	uint64_t max_inflight;	/* most commands in flight on one queue */
	uint64_t dsm_commands;
	uint64_t write_zeroes_commands;
	uint64_t deallocated_bytes;
	uint64_t errors;	/* commands that failed */
	uint64_t reserved[8];
};

void phx_nvme_stats(phx_nvme *nv, struct phx_nvme_stats *st);
void phx_nvme_stats_reset(phx_nvme *nv);

/* Meaning of an NVMe status (SCT << 8 | SC); never NULL. */
const char *phx_nvme_status_str(uint32_t status);

#ifdef __cplusplus
}
#endif

#endif /* PHX_NVME_H */
