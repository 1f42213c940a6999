/* SPDX-License-Identifier: Apache-2.0 */
/*
 * phx_cuda.h - GPU memory as the source and target of libphx I/O.
 *
 * Without the phx kernel module the NVMe controller cannot DMA into GPU
 * memory, so bytes are staged through host memory.  libphx does that with
 * "Co-DMA": a small set of pinned host buffers, allocated once per context,
 * registered with CUDA (page-locked) and with io_uring (fixed buffers).  A
 * read is a pipeline: the SSD fills staging buffer k with an O_DIRECT
 * READ_FIXED while buffer k-1 is copied to the GPU by the copy engine
 * (cuMemcpyHtoDAsync); a write mirrors it (cuMemcpyDtoHAsync, then
 * WRITE_FIXED).  The CPU copies no payload bytes; only the sub-block head
 * and tail of an unaligned *write* go through the engine's bounce buffers
 * (read-modify-write), and they are counted as bounce bytes.
 *
 * Staging buffers belong to "lanes": a thread with its own phx_engine (one
 * io_uring), so several lanes keep the device busy in parallel (RAM-speed
 * block devices such as zram complete I/O inline in the submitting thread).
 *
 * CUDA is reached through the driver API, loaded at run time with
 * dlopen("libcuda.so.1"): libphx builds and runs without CUDA headers,
 * driver or GPU; then phx_cuda_available() says why not and every other
 * call fails with -ENODEV.
 *
 * Stream-ordered calls (phx_cuda_read_async(), phx_cuda_write_async(),
 * phx_cuda_submit_stream()) keep cuFile's ordering on the caller's stream:
 * work queued on the stream after a read sees its data, a write sends the
 * data produced by work queued before it, and I/O calls on one stream take
 * effect in the order they were queued.  Unlike cuFile, the size and
 * offsets are taken when the call is made, not when the stream reaches it.
 * The device copies are queued on the caller's stream itself, each behind a
 * wait (cuStreamWaitValue32) on a host-written flag that says the staging
 * buffer holds the data; no host function blocks the stream.
 *
 * Device pointers are CUdeviceptr values (as uint64_t); streams are
 * CUstream handles (as void *; NULL is the legacy default stream).  The
 * memory must belong to the context's device and be plain device memory
 * (cuMemAlloc, cudaMalloc, PyTorch's allocator).
 *
 * Every function that can fail returns 0 (or a byte count) or a negative
 * errno; phx_cuda_strerror_last() has the text of the last failure.
 */
#ifndef PHX_CUDA_H
#define PHX_CUDA_H

#include <stddef.h>
#include <stdint.h>

#include "phx.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ------------------------------------------------------------------------ */
/* Availability                                                             */
/* ------------------------------------------------------------------------ */

/*
 * 1 when libcuda loads, initialises and reports at least one device, else
 * 0.  @why (may be NULL) receives a one-line reason either way ("CUDA 13.0
 * driver, 1 device" or "libcuda.so.1 not found: ...").
 */
int phx_cuda_available(char *why, size_t len);

/* The device ordinal that owns @ptr, or -EINVAL if it is not device memory. */
int phx_cuda_ptr_device(uint64_t ptr);

/* Text of the last error returned to this thread by a phx_cuda_* call. */
const char *phx_cuda_strerror_last(void);

/* ------------------------------------------------------------------------ */
/* Contexts                                                                 */
/* ------------------------------------------------------------------------ */

typedef struct phx_cuda phx_cuda;

struct phx_cuda_config {
	uint32_t size;		/* sizeof(struct phx_cuda_config) */
	int32_t device;		/* CUDA device ordinal (0) */
	uint32_t lanes;		/* staging threads, one io_uring each (CPUs, 4..16) */
	uint32_t bufs_per_lane;	/* pinned staging buffers per lane (4) */
	uint32_t buf_size;	/* bytes per staging buffer (2 MiB) */
	uint32_t max_io_size;	/* lane engines' largest device request (1 MiB) */
	uint32_t flags;		/* PHX_CUDA_* */
	uint32_t reserved[9];
};

enum {
	/* Gate stream copies with blocking host functions instead of
	 * cuStreamWaitValue32 (chosen automatically where memops fail). */
	PHX_CUDA_HOSTFN_GATE = 1u << 0,
	/* Do not register staging buffers with io_uring. */
	PHX_CUDA_NO_FIXED_BUFS = 1u << 1,
};

/*
 * Fill @cfg with the defaults above, overridden by PHX_CUDA_DEVICE,
 * PHX_CUDA_LANES, PHX_CUDA_BUFS, PHX_CUDA_BUF_SIZE and PHX_CUDA_MAX_IO.
 */
void phx_cuda_config_init(struct phx_cuda_config *cfg);

/*
 * Create the GPU staging context of @eng for one device: pins
 * lanes * bufs_per_lane * buf_size bytes of host memory once, starts the
 * lane threads.  @eng may be NULL; it only names the engine whose files
 * will be used (their fds are adopted per request by the lanes).
 */
int phx_cuda_create(phx_engine *eng, const struct phx_cuda_config *cfg,
		    phx_cuda **out);

/* Wait for everything queued, stop the lanes, free the staging memory. */
int phx_cuda_destroy(phx_cuda *cu);

void phx_cuda_config_get(const phx_cuda *cu, struct phx_cuda_config *cfg);

/* 1 when stream copies are gated by cuStreamWaitValue32, 0 for host fns. */
int phx_cuda_uses_memops(const phx_cuda *cu);

/* ------------------------------------------------------------------------ */
/* Requests                                                                 */
/* ------------------------------------------------------------------------ */

/*
 * One GPU request, caller-owned like struct phx_io: fill it with
 * phx_cuda_io_prep() and leave it alone until ->done is nonzero.
 */
struct phx_cuda_io {
	/* in */
	phx_file *file;
	uint64_t devptr;	/* CUdeviceptr */
	size_t len;
	uint64_t offset;	/* file offset (any alignment) */
	uint32_t op;		/* PHX_OP_READ / PHX_OP_WRITE */
	uint32_t flags;		/* reserved, 0 */
	void *user_data;

	/* out, valid once done (result also once the stream passed it) */
	int64_t result;		/* bytes moved, or -errno */
	uint32_t paths;		/* PHX_PATH_* that carried bytes */
	uint32_t done;		/* nonzero once complete (read atomically) */
	uint64_t direct_bytes;	/* bytes by path */
	uint64_t bounce_bytes;
	uint64_t buffered_bytes;

	/* private */
	uint64_t priv[8];
};

void phx_cuda_io_prep(struct phx_cuda_io *io, phx_file *f, enum phx_op op,
		      uint64_t devptr, size_t len, uint64_t offset);

/*
 * Synchronous: returns when the bytes are in GPU memory (read) or in the
 * file (write); bytes moved or -errno.  Reads stop at end of file (short
 * count); GPU bytes past it are left untouched.  Like cuFileRead, the call
 * is not ordered against other streams: synchronise them first.
 */
int64_t phx_cuda_pread(phx_cuda *cu, phx_file *f, uint64_t devptr, size_t len,
		       uint64_t offset);
int64_t phx_cuda_pwrite(phx_cuda *cu, phx_file *f, uint64_t devptr, size_t len,
			uint64_t offset);

/*
 * Asynchronous (host-side): queue @n requests on internal streams and
 * return; completion via phx_cuda_wait() or ->done.
 */
int phx_cuda_submit(phx_cuda *cu, struct phx_cuda_io *const *ios, size_t n);

/*
 * Like phx_cuda_submit(), but each request first waits for the work queued
 * on @stream at the time of the call (NULL: the legacy default stream):
 * a write sends what kernels queued there before produced, a read lands
 * after them.  The caller learns of completion on the host (->done), so
 * work it queues after that sees the data.
 */
int phx_cuda_submit_after(phx_cuda *cu, struct phx_cuda_io *const *ios,
			  size_t n, void *stream);

/* Wait for @io (timeout_ns < 0: forever); 0, or -ETIME. */
int phx_cuda_wait(phx_cuda *cu, struct phx_cuda_io *io, int64_t timeout_ns);

/* Submit @n requests and wait for all; 0 (see each ->result) or -errno. */
int phx_cuda_submit_wait(phx_cuda *cu, struct phx_cuda_io *ios, size_t n);

/*
 * Stream-ordered: queue @io on @stream (a CUstream).  ->result is valid
 * once the stream has passed the operation; ->done turns nonzero when libphx
 * no longer touches @io (at or shortly after that point).
 */
int phx_cuda_submit_stream(phx_cuda *cu, struct phx_cuda_io *io, void *stream);

/*
 * cuFileReadAsync-style convenience: read @size bytes at @file_offset into
 * @devptr on @stream; *@bytes_done (bytes or -errno) is valid once the
 * stream has passed the operation.  libphx owns the request.
 */
int phx_cuda_read_async(phx_cuda *cu, phx_file *f, uint64_t devptr,
			size_t size, uint64_t file_offset, int64_t *bytes_done,
			void *stream);
int phx_cuda_write_async(phx_cuda *cu, phx_file *f, uint64_t devptr,
			 size_t size, uint64_t file_offset, int64_t *bytes_done,
			 void *stream);

/* ------------------------------------------------------------------------ */
/* Counters                                                                 */
/* ------------------------------------------------------------------------ */

struct phx_cuda_stats {
	uint64_t reads;			/* requests completed, by op */
	uint64_t writes;
	uint64_t bytes_read;		/* file -> GPU */
	uint64_t bytes_written;		/* GPU -> file */
	uint64_t direct_bytes;		/* by path: O_DIRECT into staging */
	uint64_t bounce_bytes;		/* engine bounce (unaligned write edges) */
	uint64_t buffered_bytes;	/* page cache (buffered files) */
	uint64_t h2d_bytes;		/* staging -> GPU copies */
	uint64_t d2h_bytes;		/* GPU -> staging copies */
	uint64_t chunks;		/* staging-buffer uses */
	uint64_t stream_ops;		/* stream-ordered requests */
	uint64_t errors;		/* requests that failed */
	uint64_t fixed_buf_ios;		/* lane engines: fixed-buffer SQEs */
	uint64_t sqes;			/* lane engines: device requests */
	uint64_t staging_bytes;		/* pinned staging memory held */
	uint64_t reserved[9];
};

void phx_cuda_stats(phx_cuda *cu, struct phx_cuda_stats *st);
void phx_cuda_stats_reset(phx_cuda *cu);

#ifdef __cplusplus
}
#endif

#endif /* PHX_CUDA_H */
