/* SPDX-License-Identifier: Apache-2.0 */
/*
 * phxfile.h - the frozen phxFile* ABI that LMCache's GDS L1 "phx" backend
 * (lmcache/v1/gpu_connector/gds_backends/phx.py) loads from libphxfile.so,
 * implemented on libphx's stream-ordered GPU API (phx_cuda.h).
 *
 * Every call returns 0 or a negative errno and never touches errno.  The
 * transfer calls are cuFile-style: the pointed-to size and offsets are read
 * when the stream reaches the operation, and *bytes_done receives the bytes
 * moved (short at end of file) or -errno once the stream has passed it.
 *
 * The library keeps one process-wide driver (the ABI has no context
 * argument).  It opens on phxFileDriverOpen() or implicitly on the first
 * registration, and closes when every explicit open and the implicit one
 * have been matched by phxFileDriverClose(); extra closes return 0.
 *
 * Paths: direct (the SSD DMAs into GPU memory mapped through /dev/phx,
 * phx.ko) for registered buffers where the module is loaded, else Co-DMA
 * staging through pinned host memory.  The choice is logged to stderr at
 * driver open and reported by phxFileGetStats().
 */
#ifndef PHXFILE_H
#define PHXFILE_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* ---- the frozen ABI ----------------------------------------------------- */

int phxFileDriverOpen(void);
int phxFileDriverClose(void);

/* Any GPU range; overlapping an existing registration is -EEXIST. */
int phxFileBufRegister(const void *addr, size_t len);
/* -ENOENT for an unknown base, -EBUSY while transfers on it are in flight. */
int phxFileBufDeregister(const void *addr);

/*
 * The handle keeps its own duplicate of @fd: closing @fd afterwards never
 * redirects I/O to whatever file reuses the number.
 */
int phxFileHandleRegister(void **fh, int fd);
/*
 * Waits up to 30 s for the handle's transfers in flight to complete, then
 * releases it; if they have not completed by then, -EBUSY and the handle
 * stays registered (and usable).
 */
int phxFileHandleDeregister(void *fh);

/* Accepted for any stream: each transfer carries its own. */
int phxFileStreamRegister(void *stream);
int phxFileStreamDeregister(void *stream);

int phxFileReadAsync(void *fh, void *buf_base, size_t *nbytes,
		     int64_t *file_offset, int64_t *buf_offset,
		     int64_t *bytes_done, void *stream);
int phxFileWriteAsync(void *fh, void *buf_base, size_t *nbytes,
		      int64_t *file_offset, int64_t *buf_offset,
		      int64_t *bytes_done, void *stream);

/* ---- additions (not used by LMCache) ------------------------------------ */

enum phxfile_path {
	PHXFILE_PATH_NONE = 0,		/* driver not open */
	PHXFILE_PATH_STAGING = 1,	/* Co-DMA through pinned host memory */
	PHXFILE_PATH_DIRECT = 2,	/* /dev/phx mappings (registered buffers) */
};

struct phxfile_stats {
	uint32_t size;			/* sizeof(struct phxfile_stats), set by caller */
	uint32_t path;			/* enum phxfile_path chosen at driver open */
	uint64_t driver_opens;		/* times the driver was opened (not refs) */
	uint64_t reads;			/* transfers completed without error */
	uint64_t writes;
	uint64_t bytes_read;
	uint64_t bytes_written;
	uint64_t failures;		/* transfers whose bytes_done was -errno */
	uint64_t submit_errors;		/* calls that returned -errno */
	uint64_t unregistered_ops;	/* transfers on an unregistered buffer */
	uint64_t direct_ops;		/* transfers by path */
	uint64_t staging_ops;
	uint64_t direct_fallbacks;	/* registrations the module could not map */
	uint64_t buffers;		/* registered now */
	uint64_t handles;
	uint64_t inflight;		/* transfers queued, stream not yet past */
	uint64_t last_error;		/* -errno of the latest failure (0: none) */
	/* libphx's staging counters, summed over the devices' contexts */
	uint64_t staging_errors;
	uint64_t staging_chunks;
	uint64_t h2d_bytes;
	uint64_t d2h_bytes;
	uint64_t pinned_bytes;
	uint64_t early_reads;		/* reads served by early file I/O (libphx) */
	uint64_t early_misses;		/* early file I/O thrown away at arrival */
	uint64_t bad_refusals;		/* reads refused: their range's last write failed */
	uint64_t bad_marks;		/* failed writes whose range reads now refuse (libphx) */
	uint64_t reserved[4];
};

/* Counters since the process loaded the library; 0 or -EINVAL. */
int phxFileGetStats(struct phxfile_stats *st);

/*
 * Not part of the frozen ABI (phx_lmcache's import hook calls it): 0 when
 * no write through this library to [@offset, @offset + @len) of the
 * handle's file failed since the range was last written successfully,
 * -EIO when one did (its loads are refused), -EBADF for an unknown handle,
 * -EINVAL for a negative offset.  LMCache never reads bytes_done; the hook
 * asks this before admitting a store.
 */
int phxFileCheckRange(void *fh, int64_t offset, uint64_t len);

#ifdef __cplusplus
}
#endif

#endif /* PHXFILE_H */
