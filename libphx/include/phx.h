/* SPDX-License-Identifier: Apache-2.0 */
/*
 * phx.h - the public C API of libphx.
 *
 * libphx moves bytes between files (O_DIRECT by default) and memory through
 * io_uring, or where io_uring is refused (containers' seccomp profiles) a
 * pool of threads (see enum phx_backend_kind).  Everything is reached
 * through opaque handles:
 *
 *   phx_engine   one io_uring (or thread pool), its bounce buffers, its
 *                registered files and buffers, and its counters.  Thread-safe: any number of
 *                threads may submit to and wait on one engine.
 *   phx_file     a file opened (or adopted) on an engine.
 *   struct phx_io one read or write request.  Owned by the caller; it must
 *                stay valid, unmoved, until the engine reports it complete.
 *
 * Every function that can fail returns 0 (or a byte count) on success and a
 * negative errno on failure; none of them touches errno or aborts.  The last
 * error's text is kept per thread (phx_strerror_last()).
 *
 * Requests of any size, alignment and file offset are accepted.  Large ones
 * are split into chunks of at most max_io_size, kept in flight up to the
 * queue depth; short transfers are continued; parts that cannot go to the
 * device directly (unaligned memory, offset or length) go through the
 * engine's aligned bounce buffers and are counted in phx_stats.bounce_bytes.
 * One exception: a partial block the file ends inside (or any partial block
 * of a write-only descriptor) is written with exactly the caller's bytes
 * through the page cache, then flushed and dropped (buffered_bytes), so that
 * nothing past the caller's end is ever written.  Writes to the same blocks
 * from any handle or engine of the process are serialised where they must
 * be (docs/design.md, "Partial blocks").
 */
#ifndef PHX_H
#define PHX_H

#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#ifdef __cplusplus
extern "C" {
#endif

#define PHX_VERSION_MAJOR 0
#define PHX_VERSION_MINOR 1
#define PHX_VERSION_PATCH 0

/* ------------------------------------------------------------------------ */
/* Engines                                                                  */
/* ------------------------------------------------------------------------ */

typedef struct phx_engine phx_engine;
typedef struct phx_file phx_file;

/* Engine behaviour flags (struct phx_engine_config.flags). */
enum {
	/* Do not register files with the ring (use plain fds). */
	PHX_ENGINE_NO_FIXED_FILES = 1u << 0,
	/* Do not register bounce buffers as fixed buffers. */
	PHX_ENGINE_NO_FIXED_BUFS = 1u << 1,
	/*
	 * Only the creating thread will ever use the engine (every call but
	 * phx_engine_destroy() of an idle engine, phx_engine_stats() and
	 * phx_engine_config_get(); others fail with -EPERM).  The ring is then
	 * set up single-issuer with deferred task running (Linux >= 6.1) and
	 * its fd registered, which saves work on every submission and
	 * completion.  Falls back silently where the kernel lacks them (see
	 * phx_engine_features()).
	 */
	PHX_ENGINE_SINGLE_THREAD = 1u << 2,
	/*
	 * Do not publish this engine's counters for `phx top` (see "Live
	 * counters" below): a GPU context's lane engines, whose sums the
	 * context publishes.
	 */
	PHX_ENGINE_UNPUBLISHED = 1u << 3,
};

/*
 * Backends (struct phx_engine_config.backend; PHX_0.6): how an engine's
 * device requests reach the kernel.  Both run the same API with the same
 * alignment, bounce, short-transfer, write-claim and counter rules.
 */
enum phx_backend_kind {
	/* io_uring; the thread pool where io_uring cannot be had (io_uring_setup
	 * refused: EPERM from a seccomp filter or kernel.io_uring_disabled,
	 * ENOSYS, EACCES, or ENOMEM under an old kernel's RLIMIT_MEMLOCK) */
	PHX_BACKEND_AUTO = 0,
	PHX_BACKEND_URING = 1,	/* io_uring only: fail where it is refused */
	PHX_BACKEND_THREADS = 2,	/* a pool of threads calling preadv2/pwritev2 */
};

struct phx_engine_config {
	uint32_t size;		/* sizeof(struct phx_engine_config) */
	uint32_t queue_depth;	/* requests in flight; ring entries (128) */
	uint32_t max_io_size;	/* largest single device request (1 MiB) */
	uint32_t bounce_size;	/* bytes per bounce buffer (1 MiB) */
	uint32_t bounce_count;	/* bounce buffers (4) */
	uint32_t flags;		/* PHX_ENGINE_* */
	uint32_t max_files;	/* registered-file slots (256) */
	uint32_t submit_batch;	/* SQEs per io_uring_enter; 0: all (4) */
	uint32_t backend;	/* enum phx_backend_kind (PHX_ENGINE: auto) */
	uint32_t io_threads;	/* threads backend: most workers; 0: the queue
				 * depth, at most 64 (PHX_IO_THREADS) */
	uint32_t reserved[6];
};

/* Fill @cfg with the defaults above, overridden by PHX_* environment vars. */
void phx_engine_config_init(struct phx_engine_config *cfg);

/* Create an engine; @cfg may be NULL for the defaults. */
int phx_engine_create(const struct phx_engine_config *cfg, phx_engine **out);

/*
 * Destroy an engine.  Waits for every request in flight; files still open
 * on it are closed.  Returns the first error seen while draining, or
 * -EBUSY (and destroys nothing) while GPU work still holds one of its files
 * (phx_cuda.h): its lanes use the file's descriptor.
 */
int phx_engine_destroy(phx_engine *eng);

/* The configuration in force (after defaults and clamping). */
void phx_engine_config_get(const phx_engine *eng, struct phx_engine_config *cfg);

/* Kernel-level features the engine found when it was created. */
enum {
	PHX_FEAT_FIXED_FILES = 1u << 0,	/* files registered with the ring */
	PHX_FEAT_FIXED_BUFS = 1u << 1,	/* bounce buffers registered */
	PHX_FEAT_USER_BUFS = 1u << 2,	/* phx_buf_register() available */
	PHX_FEAT_SUBMIT_ALL = 1u << 3,	/* a bad SQE does not stop submission */
	PHX_FEAT_SINGLE_ISSUER = 1u << 4,	/* PHX_ENGINE_SINGLE_THREAD rings: */
	PHX_FEAT_DEFER_TASKRUN = 1u << 5,	/*   completions run when we wait */
	PHX_FEAT_REG_RING = 1u << 6,	/*   the ring fd is registered */
};
uint32_t phx_engine_features(const phx_engine *eng);

/*
 * The backend an engine runs on ("uring" or "threads"; PHX_0.6), and why:
 * "io_uring_setup succeeded", "asked for (...)", or the reason io_uring
 * could not be had.  The strings live as long as the engine.  An automatic
 * fall-back to threads is also logged once per process on stderr.
 */
const char *phx_engine_backend(const phx_engine *eng);
const char *phx_engine_backend_reason(const phx_engine *eng);

/*
 * Whether backend @kind (PHX_BACKEND_URING or _THREADS) can run here: 0, or
 * -errno with the reason in phx_strerror_last() (PHX_0.6).  Its name and a
 * one-line description go to @name and @desc when they are not NULL.
 */
int phx_backend_check(uint32_t kind, const char **name, const char **desc);

/* ------------------------------------------------------------------------ */
/* Files                                                                    */
/* ------------------------------------------------------------------------ */

/* phx_file_open() flags (the @phx_flags argument). */
enum {
	/* Open without O_DIRECT: all I/O goes through the page cache. */
	PHX_FILE_BUFFERED = 1u << 0,
	/*
	 * If the filesystem refuses O_DIRECT, open buffered instead of failing.
	 * The choice is visible in phx_file_info.direct and in the counters.
	 */
	PHX_FILE_ALLOW_BUFFERED = 1u << 1,
};

struct phx_file_info {
	uint32_t size;		/* sizeof(struct phx_file_info) */
	int fd;			/* the underlying descriptor */
	int direct;		/* 1 when opened with O_DIRECT */
	int registered;		/* 1 when registered with the ring */
	uint32_t mem_align;	/* required buffer alignment for O_DIRECT */
	uint32_t offset_align;	/* required offset/length alignment */
	int align_from_statx;	/* 1: from statx(STATX_DIOALIGN); 0: default */
	int open_flags;		/* flags passed to open(2) */
	uint32_t reserved[8];
};

/*
 * Open @path with open(2) @flags (O_RDONLY, O_RDWR | O_CREAT, ...) and
 * @mode.  O_DIRECT is added unless PHX_FILE_BUFFERED is given.
 */
int phx_file_open(phx_engine *eng, const char *path, int flags, mode_t mode,
		  uint32_t phx_flags, phx_file **out);

/* Adopt an fd the caller keeps owning (phx_file_close() does not close it). */
int phx_file_from_fd(phx_engine *eng, int fd, phx_file **out);

/*
 * Close the file; fails with -EBUSY while requests on it are in flight or
 * GPU work holds it (phx_cuda.h).
 */
int phx_file_close(phx_file *f);

int phx_file_get_info(const phx_file *f, struct phx_file_info *info);

/*
 * 0 when every byte of [@offset, @offset + @len) may be read, -EIO when the
 * last write through libphx to some of them failed (a read of them is
 * refused until they are written again successfully; PHX_0.5).  The text
 * names the bad range.  Bad ranges are per file (inode), process-wide.
 */
int phx_file_check_range(const phx_file *f, uint64_t offset, uint64_t len);

/* ------------------------------------------------------------------------ */
/* Registered host buffers                                                  */
/* ------------------------------------------------------------------------ */

/*
 * Register [addr, addr + len) as an io_uring fixed buffer.  Direct requests
 * that fall inside a registered buffer use READ_FIXED/WRITE_FIXED (no page
 * pinning per request).  Fails with -ENOMEM/-EPERM under RLIMIT_MEMLOCK,
 * -EOPNOTSUPP where the kernel lacks sparse buffer tables.  On the threads
 * backend registration is kept (the same -EEXIST/-ENOENT/-EBUSY rules) but
 * changes nothing: there are no fixed buffers (fixed_buf_ios stays 0).
 */
int phx_buf_register(phx_engine *eng, void *addr, size_t len);
int phx_buf_deregister(phx_engine *eng, void *addr);

/* ------------------------------------------------------------------------ */
/* Requests                                                                 */
/* ------------------------------------------------------------------------ */

enum phx_op {
	PHX_OP_READ = 0,
	PHX_OP_WRITE = 1,
};

/* Which path moved a request's bytes (phx_io.paths, a bit set). */
enum {
	PHX_PATH_DIRECT = 1u << 0,	/* O_DIRECT straight into the buffer */
	PHX_PATH_BOUNCE = 1u << 1,	/* O_DIRECT through a bounce buffer */
	PHX_PATH_BUFFERED = 1u << 2,	/* page cache (buffered file) */
};

/* Request flags (struct phx_io.flags). */
enum {
	/*
	 * An asynchronous request the caller will phx_wait() on (or watch
	 * phx_io.done for): phx_poll() never hands it back.
	 */
	PHX_IO_NO_POLL = 1u << 0,
};

/*
 * One request.  The caller fills the first block with phx_io_prep() (which
 * zeroes the rest) and must not touch it until it completes.  Requests that
 * overlap in the file are not ordered with respect to each other.
 */
struct phx_io {
	/* in */
	phx_file *file;
	void *buf;
	size_t len;
	uint64_t offset;
	uint32_t op;		/* enum phx_op */
	uint32_t flags;		/* PHX_IO_* */
	void *user_data;	/* returned untouched */

	/* out, valid once complete */
	int64_t result;		/* bytes moved, or -errno */
	uint32_t paths;		/* PHX_PATH_* that carried bytes */
	uint32_t done;		/* nonzero once complete (read it atomically) */

	/* engine-private */
	uint64_t priv[16];
};

/* Zero @io and fill its in-fields. */
void phx_io_prep(struct phx_io *io, phx_file *f, enum phx_op op, void *buf,
		 size_t len, uint64_t offset);

/* The bytes a request moved, by path (PHX_0.6; PHX_PATH_* says which carried any). */
struct phx_io_bytes {
	uint64_t direct;	/* O_DIRECT between the file and the caller's memory */
	uint64_t bounce;	/* O_DIRECT through the engine's bounce buffers */
	uint64_t buffered;	/* through the page cache */
};

/* Fill @out for @io, complete (all zero before it completes). */
void phx_io_bytes_by_path(const struct phx_io *io, struct phx_io_bytes *out);

/*
 * Synchronous read/write: returns the bytes moved or -errno.  A read that
 * reaches end of file returns the short count (0 at or past it).
 */
int64_t phx_pread(phx_file *f, void *buf, size_t len, uint64_t offset);
int64_t phx_pwrite(phx_file *f, const void *buf, size_t len, uint64_t offset);

/*
 * Submit @n requests at once and wait for all of them.  Returns 0 when all
 * were submitted and have completed (each io->result says how it went), or
 * -errno when the batch itself was refused (nothing then is in flight).
 */
int phx_submit_wait(phx_engine *eng, struct phx_io *ios, size_t n);

/*
 * Asynchronous: queue @n requests and return.  Completion is observed with
 * phx_wait(), phx_poll() or by waiting on phx_engine_eventfd().
 */
int phx_submit(phx_engine *eng, struct phx_io *const *ios, size_t n);

/*
 * Drive the engine until @io completes or @timeout_ns passes (< 0: forever).
 * Returns 0 when complete (see io->result), -ETIME on timeout.
 */
int phx_wait(phx_engine *eng, struct phx_io *io, int64_t timeout_ns);

/*
 * Reap whatever has completed without blocking, keep queued work moving, and
 * hand back up to @max completed asynchronous requests.  Returns their
 * number.  Requests are handed back once, here or (if waited on) never.
 */
int phx_poll(phx_engine *eng, struct phx_io **done, size_t max);

/*
 * An eventfd that becomes readable whenever the engine may have progress to
 * report: read it (to reset), then call phx_poll().  It is readable again
 * after a phx_poll() that left completed requests behind (more than @max).
 * Owned by the engine.
 */
int phx_engine_eventfd(phx_engine *eng);

/* ------------------------------------------------------------------------ */
/* Counters                                                                 */
/* ------------------------------------------------------------------------ */

struct phx_stats {
	uint64_t reads;			/* requests completed, by op */
	uint64_t writes;
	uint64_t bytes_read;		/* bytes moved, by op */
	uint64_t bytes_written;
	uint64_t direct_bytes;		/* by path: O_DIRECT, user memory */
	uint64_t bounce_bytes;		/* O_DIRECT through bounce buffers */
	uint64_t buffered_bytes;	/* page cache */
	uint64_t bounce_ios;		/* requests that needed a bounce */
	uint64_t rmw_ios;		/* partial-block writes (read first) */
	uint64_t short_ios;		/* short transfers that were continued */
	uint64_t fixed_buf_ios;		/* device requests on fixed buffers */
	uint64_t sqes;			/* device requests issued */
	uint64_t submits;		/* io_uring_submit calls (threads: hand-overs) */
	uint64_t errors;		/* requests that failed */
	uint64_t bad_marks;		/* failed writes whose range reads now refuse */
	uint64_t bad_refusals;		/* reads refused: the last write of their range failed */
	uint64_t reserved[8];
};

void phx_engine_stats(phx_engine *eng, struct phx_stats *st);
void phx_engine_stats_reset(phx_engine *eng);

/* ------------------------------------------------------------------------ */
/* Live counters for other processes (`phx stats`, `phx top`)               */
/* ------------------------------------------------------------------------ */

/*
 * Every engine and GPU context of a process (and libphxfile, and any caller
 * that adds a source) publishes its counters in one shared-memory file per
 * copy of libphx in the process, PHX_STATS_DIR/phx-stats.<pid>.<n> (default
 * /dev/shm), which `phx stats` and `phx top` of another process read.  A
 * thread of libphx's own copies each source's counters there every
 * PHX_STATS_INTERVAL_MS (default 200); it runs only while something is
 * published.  PHX_STATS=0 turns publication off.  The file describes itself
 * (each kind of source with the names of its counters; the layout is in
 * docs/design.md, "Live counters"), so readers need no header.  It is removed
 * when the last source goes and at exit; readers remove the files of
 * processes that died.  A forked child publishes only what it creates.
 */
typedef struct phx_stats_source phx_stats_source;

/*
 * Fill @vals[0..n) with a source's current counters.  It is called with
 * libphx's publication lock held: it must not wait for a lock whose holder
 * may add or remove a source (or create an engine or GPU context, which do);
 * when it cannot read its counters now it returns leaving @vals, which hold
 * the values last published.
 */
typedef void (*phx_stats_fill_fn)(void *arg, uint64_t *vals, uint32_t n);

/*
 * Publish a source of kind @kind ("engine", "cuda", "phxfile", ...) whose @n
 * counters are named @names (at most PHX_STATS_MAX_COUNTERS; a kind's names
 * are fixed by its first source), shown as @label.  @fill is called from
 * libphx's publishing thread, and from phx_stats_publish(), until
 * phx_stats_source_remove() returns.  Returns 0 and *@out, or -errno: -EINVAL
 * for bad arguments or a kind whose names differ, -ENOSPC when the file has
 * no room for the kind or the source, -ENOTSUP with PHX_STATS=0 or where the
 * file cannot be made (the reason in phx_strerror_last()).  Publication is
 * best effort: callers go on without it.
 */
#define PHX_STATS_MAX_COUNTERS 64
int phx_stats_source_add(const char *kind, const char *const *names, uint32_t n,
			 const char *label, phx_stats_fill_fn fill, void *arg,
			 phx_stats_source **out);

/* Stop publishing @src (NULL: nothing); after it returns @fill is not called. */
void phx_stats_source_remove(phx_stats_source *src);

/* Copy every source's counters into the file now; 0, or -errno (nothing published). */
int phx_stats_publish(void);

/*
 * The file this copy of libphx publishes in (NUL-terminated in @buf of @len
 * bytes): its length, or -ENOENT (nothing published yet), -ENOTSUP (off, the
 * reason in phx_strerror_last()), -ERANGE (@len too small).
 */
int phx_stats_path(char *buf, size_t len);

/* ------------------------------------------------------------------------ */
/* Device memory through /dev/phx (phx.ko)                                  */
/* ------------------------------------------------------------------------ */

/*
 * With the phx kernel module loaded, device memory (a GPU range, a PCI BAR)
 * can be mapped into this process as ZONE_DEVICE pages.  The returned host
 * address is an ordinary buffer for phx_pread()/phx_pwrite() on O_DIRECT
 * files: the device DMAs between the SSD and the device memory directly.
 * Such memory must not be registered with phx_buf_register().
 */
typedef struct phx_devmem phx_devmem;

/* struct phx_devmem_info.mode */
enum {
	PHX_DEVMEM_GENERIC = 1,		/* MEMORY_DEVICE_GENERIC pages */
	PHX_DEVMEM_P2PDMA = 2,		/* MEMORY_DEVICE_PCI_P2PDMA pages */
};

struct phx_devmem_info {
	void *addr;		/* host address of the caller's range */
	uint64_t length;	/* bytes from addr */
	uint32_t mode;		/* PHX_DEVMEM_* */
	uint32_t status;	/* PHX_ST_* bits of the module (phx_uapi.h) */
	uint32_t reserved[8];
};

/* 0 when /dev/phx is usable; else -errno and the reason (phx_strerror_last). */
int phx_devmem_probe(void);

/* Map [offset, offset + length) of a PCI BAR (root only). */
int phx_devmem_map_pci_bar(uint32_t domain, uint32_t bus, uint32_t devfn,
			   uint32_t bar, uint64_t offset, uint64_t length,
			   phx_devmem **out);

/* Map the caller's GPU range [gpu_va, gpu_va + length) (NVIDIA). */
int phx_devmem_map_gpu(uint64_t gpu_va, uint64_t length, phx_devmem **out);

int phx_devmem_get_info(const phx_devmem *m, struct phx_devmem_info *info);

/* Unmap and unregister; I/O on the range must have completed. */
int phx_devmem_unmap(phx_devmem *m);

/* ------------------------------------------------------------------------ */
/* Errors and version                                                       */
/* ------------------------------------------------------------------------ */

/* Text of the last error returned to this thread (never NULL). */
const char *phx_strerror_last(void);

/* "MAJOR.MINOR.PATCH" of the library actually loaded. */
const char *phx_version(void);

#ifdef __cplusplus
}
#endif

#endif /* PHX_H */
