/* SPDX-License-Identifier: Apache-2.0 */
/*
 * phx_cuda.h - GPU memory as the source and target of libphx I/O.
 *
 * Without the phx kernel module the NVMe controller cannot DMA into GPU
 * memory, so bytes are staged through host memory ("Co-DMA"): a bounded set
 * of pinned host buffers, allocated once per context, registered with CUDA
 * (page-locked) and with io_uring (fixed buffers).  The SSD reads into them
 * with O_DIRECT READ_FIXED and the copy engine moves them to the GPU; the
 * CPU copies no payload byte.  Only the sub-block head and tail of an
 * unaligned *write* go through the engine's read-modify-write path.
 *
 * Staging buffers belong to "lanes": threads with their own phx_engine (one
 * io_uring) and CUDA stream.  A request is cut into pieces that fit one
 * buffer; many small requests share one buffer, and a buffer's pieces cost
 * one io_uring submission and one copy call (cuMemcpyBatchAsync where the
 * driver has it, CUDA >= 12.8), whatever their number.
 *
 * CUDA is reached through the driver API, loaded at run time with
 * dlopen("libcuda.so.1"): libphx builds and runs without CUDA headers,
 * driver or GPU; then phx_cuda_available() says why not and every other
 * call fails with -ENODEV.
 *
 * Device pointers are CUdeviceptr values (as uint64_t); streams are
 * CUstream handles (as void *; NULL is the legacy default stream).  The
 * memory must belong to the context's device and be device memory
 * (cuMemAlloc, cudaMalloc, PyTorch's allocator, managed memory).
 *
 * Every function that can fail returns 0 (or a byte count) or a negative
 * errno and never touches errno; phx_cuda_strerror_last() has the text of
 * the last failure of this thread.
 *
 * Files: a phx_file used for GPU I/O is held by a reference from the time a
 * request is submitted until it is complete (for stream-ordered requests:
 * until the stream has passed them); meanwhile phx_file_close() on it fails
 * with -EBUSY.  Close it after waiting (or synchronising the stream).
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
 * 0.  @why (may be NULL) receives a one-line reason either way ("CUDA driver
 * 13.0, 1 device" or "libcuda.so.1 not found: ...").
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
	uint32_t bufs_per_lane;	/* pinned staging buffers per lane: depth (4) */
	uint32_t buf_size;	/* bytes per staging buffer: largest piece (4 MiB) */
	uint32_t max_io_size;	/* lane engines' largest device request (4 MiB) */
	uint32_t flags;		/* PHX_CUDA_* */
	uint32_t reserved[9];
};

/* The most staging memory one context may pin (lanes * bufs * buf_size). */
#define PHX_CUDA_MAX_PINNED (2048u << 20)

enum {
	/*
	 * Do not use stream memory operations (cuStreamWaitValue32); then
	 * stream-ordered calls fail with -ENOTSUP.  Also chosen when the
	 * device refuses them.  No host function ever blocks a stream.
	 */
	PHX_CUDA_NO_MEMOPS = 1u << 0,
	/* Do not register staging buffers with io_uring. */
	PHX_CUDA_NO_FIXED_BUFS = 1u << 1,
	/* One copy call per piece instead of cuMemcpyBatchAsync. */
	PHX_CUDA_NO_BATCH_COPY = 1u << 2,
	/*
	 * Early reads (off by default; PHX_CUDA_EARLY_READS=1): a
	 * stream-ordered read's file I/O into staging starts when it is
	 * queued, on its arguments as they are then, so that reads queued on
	 * one stream overlap their file I/O.  When the stream arrives the
	 * arguments are read again (cuFile semantics are kept) and the early
	 * bytes are used only if nothing could have changed them: the same
	 * arguments; no write through libphx in this process (any handle,
	 * engine or context) overlapping the range was in flight when it
	 * began or started since; the file's size and change time unchanged.
	 * Never on block devices, nor on files whose change time is not
	 * fine-grained (see docs/gpu.md).  What it cannot see: another
	 * process's write (or a store through a shared mapping) that changes
	 * neither size nor change time.
	 */
	PHX_CUDA_EARLY_READS = 1u << 3,
};

/*
 * Fill @cfg with the defaults above, overridden by PHX_CUDA_DEVICE,
 * PHX_CUDA_LANES, PHX_CUDA_BUFS, PHX_CUDA_BUF_SIZE, PHX_CUDA_MAX_IO,
 * PHX_CUDA_NO_MEMOPS=1, PHX_CUDA_NO_BATCH_COPY=1 and PHX_CUDA_EARLY_READS=1.
 */
void phx_cuda_config_init(struct phx_cuda_config *cfg);

/*
 * Create a GPU staging context for one device: pins lanes * bufs_per_lane *
 * buf_size bytes of host memory (at most PHX_CUDA_MAX_PINNED) plus 1.1 MiB
 * of progress words and copy descriptors (and 1 MiB of GPU memory for the
 * descriptors), once, and starts its threads: the lanes (file I/O), the
 * copier (host-async copies) and the poller (stream progress).  @eng may be
 * NULL; it only names the engine whose files the caller will use.
 */
int phx_cuda_create(phx_engine *eng, const struct phx_cuda_config *cfg,
		    phx_cuda **out);

/*
 * Wait until every request has finished, stream-ordered ones whose streams
 * have not reached them yet included, then stop the lanes and free the
 * staging memory.  A stream that waits on work that can only happen after
 * this call returns therefore deadlocks it: synchronise such streams first.
 * A context whose device hit a sticky error (a kernel that faulted) ends
 * its stream operations with -EIO instead of waiting for them.  Files still
 * registered are deregistered.
 */
int phx_cuda_destroy(phx_cuda *cu);

void phx_cuda_config_get(const phx_cuda *cu, struct phx_cuda_config *cfg);

/* What a context found it can use (phx_cuda_features()). */
enum {
	PHX_CUDA_FEAT_MEMOPS = 1u << 0,		/* cuStreamWaitValue32: stream ops */
	PHX_CUDA_FEAT_BATCH_COPY = 1u << 1,	/* cuMemcpyBatchAsync */
	PHX_CUDA_FEAT_FIXED_BUFS = 1u << 2,	/* staging as io_uring fixed buffers */
	PHX_CUDA_FEAT_EARLY_READS = 1u << 3,	/* early reads are on now */
	PHX_CUDA_FEAT_DEAD = 1u << 4,		/* a sticky CUDA error: every call fails */
};
uint32_t phx_cuda_features(const phx_cuda *cu);

/*
 * Turn early reads (PHX_CUDA_EARLY_READS) on or off while the context
 * runs.  Off also voids the early pieces of reads already queued: they are
 * read again when their stream arrives.  0, or -ENOTSUP to turn them on
 * without stream memory operations.
 */
int phx_cuda_set_early_reads(phx_cuda *cu, int on);

/*
 * The NUMA node the context's staging memory is bound to (the GPU's, on a
 * machine of several nodes), or -1 when it is not bound: one node, a node
 * the firmware does not report, or a refused mbind (not an error: staging
 * then goes where the kernel puts it).  phx_cuda_device_numa_node() gives
 * *@node for @device as sysfs reports it (-1 unknown); 0 or -ENODEV.
 */
int phx_cuda_staging_node(const phx_cuda *cu);
int phx_cuda_device_numa_node(int device, int *node);

/*
 * Register @f with the context (like cuFileHandleRegister): each lane
 * adopts its fd now and keeps it until phx_cuda_file_deregister().  Without
 * it, lanes adopt a file's fd on first use and drop it when no request of
 * the context uses the file any more.  A registered file is held:
 * phx_file_close() fails with -EBUSY until it is deregistered.
 */
int phx_cuda_file_register(phx_cuda *cu, phx_file *f);
int phx_cuda_file_deregister(phx_cuda *cu, phx_file *f);

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
 * Results, for every call below: bytes moved, or -errno.  A read stops at
 * end of file as the file is when its I/O runs (short count; 0 at or past
 * it) and writes no GPU byte past that point.  Any failure, of the file
 * I/O or of a copy between staging and the GPU, makes the result -errno.
 */

/*
 * Synchronous: returns when the bytes are in GPU memory (read) or in the
 * file (write).  Like cuFileRead, not ordered against any stream:
 * synchronise the producer first, or use phx_cuda_submit_after().
 */
int64_t phx_cuda_pread(phx_cuda *cu, phx_file *f, uint64_t devptr, size_t len,
		       uint64_t offset);
int64_t phx_cuda_pwrite(phx_cuda *cu, phx_file *f, uint64_t devptr, size_t len,
			uint64_t offset);

/*
 * Asynchronous (host-side): check @n requests and queue them; completion
 * via phx_cuda_wait() or ->done.  A batch is worth making: its requests
 * share staging buffers and copy calls.  On a bad request the call returns
 * its error; the requests before it stay queued, it and those after it are
 * not (->done is cleared only on the requests queued).
 */
int phx_cuda_submit(phx_cuda *cu, struct phx_cuda_io *const *ios, size_t n);

/*
 * Like phx_cuda_submit(), but the requests' GPU copies wait for the work
 * queued on @stream at the time of the call (NULL: the legacy default
 * stream): a write sends what kernels queued there before produced, a read
 * lands after them.  The file side starts at once.  Completion is seen on
 * the host (->done).
 */
int phx_cuda_submit_after(phx_cuda *cu, struct phx_cuda_io *const *ios,
			  size_t n, void *stream);

/* Wait for @io (timeout_ns < 0: forever); 0, or -ETIME. */
int phx_cuda_wait(phx_cuda *cu, struct phx_cuda_io *io, int64_t timeout_ns);

/*
 * An eventfd (PHX_0.7) that becomes readable whenever a request of @cu may
 * have completed (->done set): read it to reset, then look at ->done.  For
 * event loops and completion callbacks (phx.futures); made on the first
 * call, owned by the context.  Returns the fd or -errno.
 */
int phx_cuda_eventfd(phx_cuda *cu);

/* Submit @n requests and wait for all; 0 (see each ->result) or -errno. */
int phx_cuda_submit_wait(phx_cuda *cu, struct phx_cuda_io *ios, size_t n);

/*
 * Stream-ordered, with cuFile's semantics (cuFileReadAsync/WriteAsync):
 * the operation runs when @stream reaches it, after all work queued there
 * before (a write sends what that work produced), and work queued after it
 * runs once it is complete (a read's data is there).  Operations on one
 * stream run one after the other, in order, so a read queued after a write
 * on the same stream sees the write, and end of file is judged then.
 *
 * The arguments are read when the stream reaches the operation: for
 * phx_cuda_submit_stream() the fields of @io; for read_async/write_async
 * *@size, *@file_offset and *@buf_offset (the GPU address is @devptr_base +
 * *@buf_offset).  They must stay valid until then.  The result is stored in
 * io->result / *@bytes_done before the stream is released, so it is valid
 * once the stream has passed the operation.  ->done turns nonzero when
 * libphx no longer touches @io.  No CUDA callback thread ever waits: the
 * stream waits on a pinned flag (cuStreamWaitValue32) that a lane raises.
 *
 * Any thread may call these, whatever context is current (or none): the
 * context's own is made current for the call and restored after.  The
 * stream must belong to the context's device; it must not be capturing a
 * CUDA graph (-EBUSY: a graph would replay a request that no longer exists).
 * The memory may span several mapped segments (PyTorch's expandable
 * segments, VMM allocators) as long as they are contiguous.
 *
 * Errors never become data: a short read fills exactly the bytes it
 * reports and leaves the rest of the destination alone; a failed write
 * marks its file range bad, and every later read of any part of it through
 * libphx fails with -EIO until the range is written again successfully.
 *
 * With 4096 stream operations in flight on the context a call waits for
 * one to finish, at most PHX_CUDA_QUEUE_WAIT_MS (30000 by default), then
 * returns -EAGAIN.  Returns 0 once queued (the result then always
 * arrives), -ENOTSUP without stream memory operations (phx_cuda_features();
 * phx_cuda_memops_why() says why).
 */
int phx_cuda_submit_stream(phx_cuda *cu, struct phx_cuda_io *io, void *stream);
int phx_cuda_read_async(phx_cuda *cu, phx_file *f, uint64_t devptr_base,
			const size_t *size, const int64_t *file_offset,
			const int64_t *buf_offset, int64_t *bytes_done,
			void *stream);
int phx_cuda_write_async(phx_cuda *cu, phx_file *f, uint64_t devptr_base,
			 const size_t *size, const int64_t *file_offset,
			 const int64_t *buf_offset, int64_t *bytes_done,
			 void *stream);

/*
 * The same with a completion call (PHX_0.5): @done, when not NULL, is
 * called once with the result after the stream has passed the operation and
 * libphx no longer touches the arguments.  It runs on a libphx thread that
 * serves every stream of the context: it must return quickly, and must not
 * block or make CUDA calls.
 */
typedef void (*phx_cuda_done_fn)(void *arg, int64_t result);

struct phx_cuda_async {
	uint32_t size;			/* sizeof(struct phx_cuda_async) */
	uint32_t op;			/* PHX_OP_READ / PHX_OP_WRITE */
	phx_file *file;
	uint64_t devptr_base;
	const size_t *nbytes;		/* read when the stream arrives */
	const int64_t *file_offset;
	const int64_t *buf_offset;
	int64_t *bytes_done;		/* may be NULL */
	void *stream;
	phx_cuda_done_fn done;		/* may be NULL */
	void *done_arg;
	uint64_t reserved[4];
};

int phx_cuda_submit_async(phx_cuda *cu, const struct phx_cuda_async *a);

/* Why stream-ordered calls are unavailable on @cu ("" when they are not). */
const char *phx_cuda_memops_why(const phx_cuda *cu);

/* ------------------------------------------------------------------------ */
/* Many small pieces of one file and one GPU buffer (PHX_0.8)               */
/* ------------------------------------------------------------------------ */

/*
 * Issue 29: KV cache blocks of 8-64 KiB, thousands per call.  Piece i moves
 * lens[i] bytes between file offset file_offsets[i] and GPU address devptr +
 * dev_offsets[i]; three arrays, no struct per piece.  Inside, the pieces are
 * requests like any other: packed many to a staging buffer, one io_uring
 * submission and one copy call per buffer (unverified on a real GPU).
 *
 * Checked before anything is queued (-EINVAL, the piece named in
 * phx_cuda_strerror_last()): n > 0 needs the three arrays; no value may be
 * negative; every piece must lie inside [devptr, devptr + dev_len); and no
 * two pieces may overlap where the outcome would depend on their order:
 * GPU ranges for reads (two reads into one place), file ranges for writes
 * (two writes to one place).  Empty pieces are allowed (result 0).
 */
struct phx_cuda_many {
	uint32_t size;			/* sizeof(struct phx_cuda_many) */
	uint32_t op;			/* PHX_OP_READ / PHX_OP_WRITE */
	phx_file *file;
	uint64_t devptr;		/* the GPU buffer (CUdeviceptr) ... */
	uint64_t dev_len;		/* ... and its length in bytes */
	size_t n;			/* pieces */
	const int64_t *file_offsets;	/* n each; copied by the call */
	const int64_t *dev_offsets;
	const int64_t *lens;
	int64_t *results;		/* n: bytes (short at end of file) or -errno */
	void *stream;			/* CUstream; see each call */
	uint32_t flags;			/* PHX_CUDA_MANY_* */
	uint32_t reserved32;
	/*
	 * phx_cuda_many_async(), optional: set to n by the call, less one
	 * (atomically) as each piece is over - its GPU copies have run on the
	 * stream, so a read's bytes are in the buffer - or was never queued.
	 * 0: every piece is over.  (->results are final earlier: once the
	 * stream is committed to passing a piece, before its last copy.)
	 */
	int64_t *pending;
	uint64_t reserved[3];
};

enum {
	/* phx_cuda_many(): the copies follow the work queued on ->stream (submit_after) */
	PHX_CUDA_MANY_AFTER = 1u << 0,
};

/* Only the checks above: 0 or -EINVAL (no context, no CUDA needed). */
int phx_cuda_many_check(const struct phx_cuda_many *m);

/*
 * Synchronous: returns once every piece is complete.  The sum of the
 * pieces' bytes, or the error of the first piece (by index) that failed;
 * ->results (may be NULL here) has each piece's.  A failed piece's result
 * is never a byte count: its destination may hold some of its bytes (a
 * read) or its file range is bad (a write; see phx_cuda_submit_stream()).
 */
int64_t phx_cuda_many(phx_cuda *cu, const struct phx_cuda_many *m);

/*
 * Stream-ordered on ->stream, with phx_cuda_submit_stream()'s semantics
 * per piece, pieces in index order; unlike phx_cuda_read_async() the
 * offsets and lengths are copied now (only ->results is written later).
 * ->results is required: each is -EINPROGRESS until the stream has passed
 * its piece, and must stay valid until then.  A host thread waiting for the
 * data waits for ->pending to reach 0 (or synchronises the stream): a final
 * result alone does not mean the copy ran.  0 once all are queued; on an
 * error the pieces before the one refused stay queued, and the results of
 * it and of those after it are that error.
 */
int phx_cuda_many_async(phx_cuda *cu, const struct phx_cuda_many *m);

/* phx_cuda_many() without the struct: @results may be NULL. */
int64_t phx_cuda_pread_many(phx_cuda *cu, phx_file *f, uint64_t devptr, uint64_t dev_len,
			    const int64_t *file_offsets, const int64_t *dev_offsets,
			    const int64_t *lens, size_t n, int64_t *results);
int64_t phx_cuda_pwrite_many(phx_cuda *cu, phx_file *f, uint64_t devptr, uint64_t dev_len,
			     const int64_t *file_offsets, const int64_t *dev_offsets,
			     const int64_t *lens, size_t n, int64_t *results);

/* ------------------------------------------------------------------------ */
/* Pinned host memory and copy streams (PHX_0.7)                            */
/* ------------------------------------------------------------------------ */

/*
 * For callers that move bytes between host buffers of their own and GPU
 * memory themselves (phx.kv's Co-DMA relays: one pinned buffer and one
 * stream per copy thread), with no staging context: nothing is pinned but
 * what the caller registers, no thread is started.  Every call makes
 * @device's primary context (the one PyTorch and CuPy use) current for its
 * duration and restores what was current, so any thread may call.
 */

/*
 * Page-lock [@ptr, @ptr + @len) for the copy engine (cuMemHostRegister,
 * portable: every context may copy from and to it).  The registration
 * lives in @device's primary context, which stays retained until
 * phx_cuda_host_unregister(@device, @ptr); the memory must stay mapped
 * until then.  Unaligned ranges are allowed (the driver pins whole pages).
 * 0, -EINVAL (NULL or empty), -ENODEV (no such device, or no CUDA), or the
 * driver's error (-ENOMEM when it cannot pin, -EINVAL for a range that
 * overlaps one already registered).
 */
int phx_cuda_host_register(int device, void *ptr, size_t len);
int phx_cuda_host_unregister(int device, void *ptr);

typedef struct phx_cuda_stream phx_cuda_stream;

/*
 * A non-blocking CUDA stream of @device's primary context, with what it
 * needs to order its work after another stream's.  Copies queued on one
 * phx_cuda_stream run in order; phx_cuda_stream_destroy() waits for them,
 * then frees it (0, or the error of that wait).
 */
int phx_cuda_stream_create(int device, phx_cuda_stream **out);
int phx_cuda_stream_destroy(phx_cuda_stream *s);

/* The CUstream, for the caller's own CUDA calls (NULL for NULL). */
void *phx_cuda_stream_handle(const phx_cuda_stream *s);

/*
 * Work queued on @s from now on waits until the work queued on @producer
 * (NULL: the legacy default stream) at the time of the call is done; the
 * host does not wait.  -EBUSY when @producer is capturing a CUDA graph.
 */
int phx_cuda_stream_after(phx_cuda_stream *s, void *producer);

/*
 * Queue a copy of @len bytes on @s: host -> device (h2d) or device -> host
 * (d2h).  Asynchronous to the host when the host memory is page-locked
 * (phx_cuda_host_register()); the memory must stay valid until
 * phx_cuda_stream_sync().  0, or the driver's error for the call (a device
 * address that is not device memory of @s's device: -EINVAL).  A copy that
 * fails while it runs is reported by phx_cuda_stream_sync().
 */
int phx_cuda_stream_h2d(phx_cuda_stream *s, uint64_t dst, const void *src, size_t len);
int phx_cuda_stream_d2h(phx_cuda_stream *s, void *dst, uint64_t src, size_t len);

/* Wait until everything queued on @s so far has run; 0 or -errno. */
int phx_cuda_stream_sync(phx_cuda_stream *s);

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
	uint64_t chunks;		/* request pieces moved through staging */
	uint64_t stream_ops;		/* stream-ordered requests */
	uint64_t errors;		/* requests that failed */
	uint64_t fixed_buf_ios;		/* lane engines: fixed-buffer SQEs */
	uint64_t sqes;			/* lane engines: device requests */
	uint64_t staging_bytes;		/* pinned staging memory held */
	uint64_t staging_fills;		/* staging-buffer rounds */
	uint64_t memcpy_calls;		/* copy calls made (batched or not) */
	uint64_t memcpy_batch_calls;	/* of those, cuMemcpyBatchAsync */
	uint64_t file_adoptions;	/* lanes' phx_file_from_fd calls */
	uint64_t pinned_bytes;		/* all pinned memory (staging + flags) */
	uint64_t early_reads;		/* stream reads served by early file I/O */
	uint64_t early_misses;		/* early file I/O thrown away at arrival */
	uint64_t reserved[2];
	/* ---- PHX_0.5: only phx_cuda_stats_get() fills these ---- */
	/*
	 * Where stream ops' time goes, summed over the ops released: from
	 * queueing until the poller saw the stream arrive (the work ahead
	 * of it), from the arrival until its last round was staged (the
	 * stream waiting for file I/O), and from then until the stream was
	 * past it (copies on the GPU and the release).  Divide by
	 * stream_released for a mean per op.
	 */
	uint64_t stream_released;
	uint64_t stream_queue_ns;
	uint64_t stream_data_ns;
	uint64_t stream_gpu_ns;
	uint64_t queue_waits;		/* submissions that waited for a slot */
	uint64_t early_refused;		/* stream reads not started early: a write overlapped */
	uint64_t bad_marks;		/* failed writes whose range is now refused */
	uint64_t bad_refusals;		/* reads refused: their range's last write failed */
	uint64_t orphans;		/* stream ops whose GPU work could only be partly queued */
	uint64_t broken;		/* stream ops ended by a dead context (sticky CUDA error) */
	/*
	 * ---- PHX_0.8: where a batch of small pieces spends its time ----
	 * Always on (two clock reads per staging buffer and phase).  The
	 * lanes' and copier's sums are buffer-nanoseconds: buffers overlap
	 * in time, so compare the phases with each other (the largest
	 * bounds the rate), not with wall time.
	 *   call     callers inside the submission calls (checks, records,
	 *            queueing; phx_cuda_many* and the host-async calls)
	 *   pack     lanes cutting pieces into staging buffers (under the
	 *            context's lock)
	 *   submit   lanes handing a buffer's SQEs to io_uring (RAM-speed
	 *            devices complete the I/O inside this call)
	 *   io       host-async buffers from their submission until their
	 *            last file I/O completed (the device wait)
	 *   copy     host-async buffers from being queued for the copier
	 *            until their copies were done (queueing + copy engine)
	 *   done     completing host-async pieces: each request's result,
	 *            counters, record and wake-up (the copier's or a lane's
	 *            thread; see ph_done_ns below)
	 */
	uint64_t ph_call_ns;
	uint64_t ph_pack_ns;
	uint64_t ph_submit_ns;
	uint64_t ph_io_ns;
	uint64_t ph_copy_ns;
	uint64_t ph_buffers;		/* host-async buffers timed (io and copy) */
	uint64_t many_calls;		/* phx_cuda_many* calls */
	uint64_t many_pieces;		/* their pieces */
	uint64_t ph_done_ns;
	uint64_t reserved3[7];
};

/*
 * The counters.  phx_cuda_stats() fills the fields before reserved[] (the
 * PHX_0.2 layout); phx_cuda_stats_get() fills @size bytes of @st (pass
 * sizeof(*st)), so a caller built against an older header gets what it
 * knows.
 */
void phx_cuda_stats(phx_cuda *cu, struct phx_cuda_stats *st);
void phx_cuda_stats_get(phx_cuda *cu, struct phx_cuda_stats *st, size_t size);
void phx_cuda_stats_reset(phx_cuda *cu);

#ifdef __cplusplus
}
#endif

#endif /* PHX_CUDA_H */
