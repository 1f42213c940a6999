/* SPDX-License-Identifier: Apache-2.0 */
/*
 * internal.h - state shared by libphx's source files; not installed.
 *
 * Locking: one mutex per engine (eng->lock) protects everything below that
 * is not marked otherwise.  The io_uring completion queue is touched only by
 * the thread that holds eng->u.uring.reaping (see be_uring.c).
 */
#ifndef PHX_INTERNAL_H
#define PHX_INTERNAL_H

#include <errno.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdint.h>
#include <sys/types.h>
#include <time.h>
#include <liburing.h>

#include "phx.h"

#define PHX_EXPORT __attribute__((visibility("default")))

#define PHX_DEFAULT_QD 128u
#define PHX_DEFAULT_MAX_IO (1u << 20)
#define PHX_DEFAULT_BOUNCE_SIZE (1u << 20)
#define PHX_DEFAULT_BOUNCE_COUNT 4u
#define PHX_DEFAULT_MAX_FILES 256u
#define PHX_DEFAULT_SUBMIT_BATCH 4u
#define PHX_USER_BUF_SLOTS 64u
#define PHX_PAGE 4096u
/* How soon a write waiting on another engine's claim is retried. */
#define PHX_TICK_NS 100000

/* The paths a request's bytes take, as counted per request (io_priv.bytes). */
enum io_path { IOP_DIRECT, IOP_BOUNCE, IOP_BUFFERED };

/* How a request is cut into chunks (decided once, at submission). */
enum io_mode {
	MODE_DIRECT,	/* everything aligned: direct chunks only */
	MODE_SPLIT,	/* bounced head, direct middle, bounced tail */
	MODE_BOUNCE,	/* memory not congruent with the file: all bounced */
	MODE_BUFFERED,	/* page-cache file */
};

/* What one in-flight device operation is doing. */
enum chunk_kind {
	CH_DIRECT,	/* caller memory, O_DIRECT */
	CH_BUFFERED,	/* caller memory, page cache (a buffered file) */
	CH_BOUNCE_READ,	/* device -> bounce, then copy out */
	CH_BOUNCE_WRITE,	/* copy in, bounce -> device */
	CH_RMW_READ,	/* read the blocks a partial write will rewrite */
	/*
	 * A partial block that cannot be read back whole (it reaches past the
	 * end of the file, or the file is write-only): the caller's bytes, and
	 * no others, through the page cache, then flushed and dropped.
	 */
	CH_PC_WRITE,	/* pwrite through the buffered descriptor */
	CH_PC_SYNC,	/* sync_file_range of what it wrote */
	CH_PC_DROP,	/* fadvise(DONTNEED): leave no page behind */
};

/* A write's claim on a byte range of its inode (inode.c says which conflict). */
enum wclass {
	WC_DIRECT,	/* whole blocks, O_DIRECT: the exact range */
	WC_RMW,		/* read-modify-write: rounded out to folio_align */
	WC_PAGECACHE,	/* through the page cache: rounded out to folio_align */
	WC_COUNT,
};

struct wrange {
	struct wrange *prev, *next;
	uint64_t off, len;
	const void *owner;	/* the engine that issued it */
	uint8_t wclass;		/* enum wclass */
	bool claimed;
};

struct phx_inode;

struct phx_file {
	phx_engine *eng;
	struct phx_inode *inode;	/* shared by every handle of the file */
	int fd;
	int alt_fd;		/* buffered fd for partial blocks, or -1 until needed */
	bool owns_fd;
	bool direct;
	bool readable;
	bool writable;
	bool can_read_back;	/* the fd is readable: partial blocks can be RMW'd */
	bool bounded;		/* a regular file or block device: its ops end by
				 * themselves (a FIFO's may wait for a writer) */
	int slot;		/* registered-file index, or -1 */
	uint32_t mem_align;
	uint32_t offset_align;
	uint32_t folio_align;	/* the largest folio the page cache may use here */
	bool align_from_statx;
	int open_flags;
	uint32_t refs;		/* requests queued or in flight, and phx_file_hold()s */
	uint32_t holds;		/* of those, phx_file_hold()s (GPU work) */
	struct phx_file *next;	/* engine's list of open files */
};

/* A request's private state, kept in struct phx_io.priv. */
struct io_priv {
	struct phx_io *next;	/* pending queue or poll list link */
	uint64_t cursor;	/* next file offset to cut a chunk at */
	uint64_t end;		/* offset + len */
	uint64_t mid0, mid1;	/* MODE_SPLIT: the direct middle [mid0, mid1) */
	uint64_t eof;		/* lowest end of file seen, or UINT64_MAX */
	int64_t err;		/* first error, or 0 */
	uint64_t bytes[3];	/* moved by path (enum io_path): phx_io_bytes_by_path() */
	uint32_t chunks;	/* chunks in flight */
	uint8_t mode;		/* enum io_mode */
	uint8_t async;		/* submitted with phx_submit() */
	uint8_t queued;		/* still on the pending queue */
	uint8_t pollable;	/* goes on the poll list when done */
};

_Static_assert(sizeof(struct io_priv) <= sizeof(((struct phx_io *)0)->priv),
	       "struct io_priv outgrew struct phx_io.priv");

static inline struct io_priv *io_priv(struct phx_io *io)
{
	return (struct io_priv *)io->priv;
}

/*
 * One device operation of a chunk, as io.c describes it to the backend
 * (chunk_prep): what to do, on which descriptor, with which memory.
 */
enum dop_kind {
	DOP_READ,
	DOP_WRITE,
	DOP_SYNC_RANGE,	/* sync_file_range(WAIT_BEFORE | WRITE | WAIT_AFTER) */
	DOP_DONTNEED,	/* posix_fadvise(POSIX_FADV_DONTNEED) */
};

struct devop {
	uint8_t kind;		/* enum dop_kind */
	int fd;			/* plain descriptor */
	int slot;		/* registered-file index, or -1 */
	int buf_index;		/* fixed-buffer index, or -1 */
	char *mem;
	uint64_t len;
	uint64_t off;
};

struct chunk {
	struct phx_io *io;
	struct chunk *next_free;
	struct chunk *next_op;	/* threads backend: its queue of device ops */
	/* threads backend: contiguous reads queued as one preadv2 (a run) */
	struct chunk *run_next;	/* the next op of this one's run */
	struct chunk *run_last;	/* (a run's first op) its last op */
	uint32_t run_n;		/* (a run's first op) ops in the run */
	uint64_t run_bytes;	/* (a run's first op) the bytes they move */
	uint8_t kind;		/* enum chunk_kind */
	uint8_t op;		/* device op: PHX_OP_READ/WRITE */
	bool in_use;
	bool alt;		/* on the file's buffered alt_fd */
	bool uring_async;	/* io_uring backend: its op went out with IOSQE_ASYNC */
	struct wrange wr;	/* a write's claim on its range (inode.c) */
	int bounce;		/* bounce index, or -1 */
	int buf_index;		/* fixed-buffer index, or -1 */
	char *mem;		/* memory of the device op */
	uint64_t dev_off;	/* device op range */
	uint64_t dev_len;
	uint64_t done;		/* bytes of the device op completed */
	uint64_t user_off;	/* file range of caller data it carries */
	uint64_t user_len;
	struct devop dop;	/* the device op as last queued (chunk_prep) */
};

struct user_buf {
	char *addr;
	size_t len;
	int index;		/* fixed-buffer index; 0 len = free slot */
};

/*
 * A backend: how an engine's device operations reach the kernel.  One
 * struct of functions per backend (be_uring.c, be_threads.c); io.c and
 * engine.c never ask which one runs.  Functions marked "lock held" are
 * called with eng->lock held.
 */
struct phx_backend {
	const char *name;	/* "uring", "threads" (phx_engine_backend()) */
	const char *desc;
	/* Can it run here?  0, or -errno with the reason in @why. */
	int (*probe)(char *why, size_t n);
	/* Resources for @eng (features set here); -errno, phx_err() says why. */
	int (*setup)(phx_engine *eng);
	/* After the engine drained (nothing in flight). */
	void (*teardown)(phx_engine *eng);
	/* Queue @c's device op, described in c->dop (lock held). */
	void (*queue)(phx_engine *eng, struct chunk *c);
	/* Hand every queued op to the kernel or the workers (lock held). */
	void (*submit)(phx_engine *eng);
	/* Come back in PHX_TICK_NS: a write waits on another engine (lock held). */
	void (*arm_tick)(phx_engine *eng);
	/* engine_progress() below. */
	int (*progress)(phx_engine *eng, struct phx_io *io, int64_t timeout_ns,
			bool block);
	/* Have @fd written when requests complete; -errno. */
	int (*eventfd)(phx_engine *eng, int fd);
	/* Fixed buffer @index := [addr, addr + len) (len 0: none); -errno (lock held). */
	int (*buf_update)(phx_engine *eng, int index, void *addr, size_t len);
	/* Fixed file @slot := @fd (-1: none); -errno (lock held). */
	int (*file_update)(phx_engine *eng, int slot, int fd);
};

extern const struct phx_backend be_uring;
extern const struct phx_backend be_threads;

/* CPUs this process may run on (its affinity; at least 1): engine.c. */
uint32_t phx_cpus_usable(void);

/* PHX_URING_SPREAD's values (be_uring.c: ops that complete inline -> io-wq). */
enum uring_spread { SPREAD_AUTO, SPREAD_OFF, SPREAD_ON };
extern const char *const phx_spread_choices[];	/* indexed by enum uring_spread */

/* be_uring.c's state of an engine. */
struct be_uring_state {
	struct io_uring ring;
	bool reaping;		/* a thread owns the completion queue */
	struct __kernel_timespec tick_ts;
	int enter_fd;		/* ring fd, or its registered index */
	unsigned enter_flags;	/* IORING_ENTER_REGISTERED_RING when registered */
	int64_t spin_ns;	/* how long a reaper spins before sleeping */
	uint8_t spread;		/* enum uring_spread (PHX_URING_SPREAD) */
	int32_t inline_score;	/* sampled batches whose ops completed inside the
				 * submitting call minus those whose did not */
	struct chunk *probe_late;	/* a sampled batch's last op, not complete
					 * when its call returned (spread_late) */
	uint32_t max_workers;	/* the CPUs beside the submitting thread */
	uint32_t iowq_cap;	/* io-wq's workers as last capped (0: never) */
	unsigned iowq_found[2];	/* io-wq's limits before the first cap */
	uint32_t async_inflight;	/* our ops sent with IOSQE_ASYNC, not reaped */
	uint64_t async_sqes;	/* ops ever sent with IOSQE_ASYNC (tests) */
	int load_fd;		/* /proc/loadavg, or -1 */
	int64_t load_at;	/* when it was last read (phx_now_ns) */
	uint32_t others16;	/* runnable threads not ours, x16, smoothed */
};

/* A thread asleep in be_threads.c's progress, on its stack. */
struct threads_waiter {
	struct phx_io *io;	/* what it waits for; NULL: any request's end */
	struct threads_waiter *next;
};

/* be_threads.c's state of an engine (all under eng->lock). */
struct be_threads_state {
	pthread_cond_t work;	/* idle workers sleep here */
	struct chunk *head, *tail;	/* device ops no worker has taken */
	struct threads_waiter *waiters;	/* callers asleep on eng->cond */
	uint32_t fresh;		/* ops queued since the last hand-over */
	uint32_t max;		/* most workers (phx_engine_config.io_threads) */
	uint32_t nthreads;	/* workers started (started lazily, up to max) */
	uint32_t idle;		/* of those, asleep on work */
	uint32_t woken;		/* of those, signalled and not yet awake */
	uint32_t running;	/* of those, running an op */
	uint64_t busy_bytes;	/* of the reads and writes running now */
	uint32_t runs;		/* runs in progress (workers' and callers') */
	uint32_t ncpu;		/* CPUs this process may run on */
	uint32_t sample_tick;	/* runs since the last sleep sample */
	int32_t sleep_score;	/* sampled runs that slept minus those that did not */
	pthread_t *tids;
	bool tick_queued;	/* a tick waits for a worker */
	bool stop;
};

struct phx_engine {
	pthread_mutex_t lock;
	pthread_cond_t cond;	/* signalled when completions were handled */
	struct phx_engine_config cfg;
	uint32_t features;
	const struct phx_backend *be;
	char be_why[256];	/* why this backend runs (phx_engine_backend_reason) */
	uint32_t inflight;	/* chunks prepared or submitted (and a tick) */
	uint32_t unsubmitted;	/* ops queued but not yet handed over (uring) */
	bool tick_armed;	/* a retry tick is in flight (see io_fill) */
	bool submit_waits;	/* the submission under way is phx_submit_wait's: its
				 * caller waits for it (be_uring.c spreads only such) */
	pid_t owner_tid;	/* PHX_ENGINE_SINGLE_THREAD: the only thread allowed */
	pid_t pid;		/* the process that created it (a fork's copy is not it) */

	union {
		struct be_uring_state uring;
		struct be_threads_state threads;
	} u;

	struct chunk *chunks;	/* queue_depth of them */
	struct chunk *free_chunks;

	char *bounce_mem;	/* bounce_count * bounce_size, page aligned */
	int *bounce_free;	/* stack of free bounce indices */
	uint32_t nbounce_free;

	struct phx_io *pend_head, *pend_tail;	/* requests with chunks to cut */
	struct phx_io *poll_head, *poll_tail;	/* done, not yet handed back */

	int efd;		/* eventfd, or -1 until asked for */
	int *file_slots;	/* registered-file table (fd or -1) */
	struct phx_file *files;
	struct user_buf ubufs[PHX_USER_BUF_SLOTS];

	struct phx_stats st;
	phx_stats_source *pub;	/* live counters (stats_pub.c), or NULL */
};

/* env.c */
uint32_t phx_env_u32(const char *name, uint32_t dflt);
int phx_env_check(void);
/*
 * The index of $name's value in @choices (NULL-terminated), else @dflt
 * (phx_env_check() refuses a value that is none of them).
 */
uint32_t phx_env_choice(const char *name, const char *const *choices, uint32_t dflt);
extern const char *const phx_engine_choices[];	/* PHX_ENGINE's */

/* error.c */
int phx_err(int err, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

/* io.c: request life cycle (lock held) */
int io_validate(struct phx_io *io);
void io_start(phx_engine *eng, struct phx_io *io, bool async);
void io_fail(phx_engine *eng, struct phx_io *io, int err, bool async);
void io_fill(phx_engine *eng);
/* @c's device op ended with @res (bytes moved, or -errno): any backend calls it. */
void io_complete_op(phx_engine *eng, struct chunk *c, int res);

/* inode.c: process-wide write-range claims per inode */
struct stat;
int inode_get(const struct stat *st, struct phx_inode **out);
void inode_put(struct phx_inode *n);
int inode_claim(struct phx_inode *n, struct wrange *r, bool *foreign);
void inode_release(struct phx_inode *n, struct wrange *r);
bool inode_is_blk(const struct phx_inode *n);

/*
 * inode.c: what early GPU reads need to know about writes (cuda_stream.c).
 * Every write claim is logged with a generation number; a GPU write that is
 * accepted but not yet issued (a stream op its stream has not reached)
 * registers its range as pending.
 */
struct phx_wpend {
	struct phx_wpend *prev, *next;
	uint64_t off, len;
	bool on;
};
uint64_t inode_wgen(struct phx_inode *n);
/* A write claim or pending write overlapping [off, off + len) now? */
bool inode_write_busy(struct phx_inode *n, uint64_t off, uint64_t len);
/* A write overlapping [off, off + len) logged since @gen (or can't tell)? */
bool inode_written_since(struct phx_inode *n, uint64_t gen, uint64_t off, uint64_t len);
void inode_pend_add(struct phx_inode *n, struct phx_wpend *w, uint64_t off, uint64_t len);
void inode_pend_move(struct phx_inode *n, struct phx_wpend *w, uint64_t off, uint64_t len);
void inode_pend_del(struct phx_inode *n, struct phx_wpend *w);

/*
 * inode.c: bad ranges.  A write that failed leaves its range bad (the file
 * may hold old bytes there, or half of the new ones); a later successful
 * write clears what it covers; a read of any bad byte is refused (-EIO)
 * until then.  Returns true when the call marked something bad.
 */
bool inode_write_result(struct phx_inode *n, uint64_t off, uint64_t len, bool ok);
int inode_bad_check(struct phx_inode *n, uint64_t off, uint64_t len);

/* engine.c: what io.c and the backends call */
int engine_thread_check(const phx_engine *eng);
void engine_notify(phx_engine *eng);
/* eng->be's submit, arm_tick and progress. */
void engine_submit_locked(phx_engine *eng);
void engine_arm_tick(phx_engine *eng);
/*
 * Make progress until @io is done (or, with @io NULL, until one round of
 * completions was handled), @timeout_ns elapses, or - when !@block - at
 * once.  Returns 0, or -ETIME when the time ran out first.
 */
int engine_progress(phx_engine *eng, struct phx_io *io, int64_t timeout_ns,
		    bool block);

/* file.c */
void file_close_all(phx_engine *eng);
int file_alt_fd(phx_file *f);
/*
 * A reference that keeps @f open while work outside the engine (a GPU
 * request) still uses it: phx_file_close() fails with -EBUSY until every
 * phx_file_hold() is matched by a phx_file_unhold().  Both take eng->lock.
 */
void phx_file_hold(phx_file *f);
void phx_file_unhold(phx_file *f);
phx_file *file_held_locked(phx_engine *eng);

/* Monotonic time in nanoseconds (deadlines). */
static inline int64_t phx_now_ns(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

/* Sleep on @cond for at most @left_ns (pthread conditions use CLOCK_REALTIME). */
static inline void phx_cond_wait_ns(pthread_cond_t *cond, pthread_mutex_t *lock,
				    int64_t left_ns)
{
	struct timespec ts;

	clock_gettime(CLOCK_REALTIME, &ts);
	ts.tv_sec += left_ns / 1000000000;
	ts.tv_nsec += left_ns % 1000000000;
	if (ts.tv_nsec >= 1000000000) {
		ts.tv_sec++;
		ts.tv_nsec -= 1000000000;
	}
	pthread_cond_timedwait(cond, lock, &ts);
}

/*
 * Sleep on @cond until signalled or @deadline_ns (phx_now_ns(); < 0: none);
 * -ETIME, without sleeping, once the deadline has passed.
 */
static inline int phx_cond_wait_until(pthread_cond_t *cond, pthread_mutex_t *lock,
				      int64_t deadline_ns)
{
	int64_t left;

	if (deadline_ns < 0) {
		pthread_cond_wait(cond, lock);
		return 0;
	}
	left = deadline_ns - phx_now_ns();
	if (left <= 0)
		return -ETIME;
	phx_cond_wait_ns(cond, lock, left);
	return 0;
}

static inline uint64_t align_down(uint64_t x, uint64_t a)
{
	return x - x % a;
}

static inline uint64_t align_up(uint64_t x, uint64_t a)
{
	return align_down(x + a - 1, a);
}

/*
 * stats_pub.c: a struct of uint64_t counters published by field name (what
 * engines and GPU contexts publish; phx.h, "Live counters").  @get fills a
 * struct of at most STAT_STRUCT_MAX bytes.
 */
struct stat_field {
	const char *name;
	uint32_t off;
};

#define STAT_FIELD(type, f) { #f, (uint32_t)offsetof(type, f) }
#define STAT_STRUCT_MAX 1024u

int stats_add_struct(const char *kind, const char *label, const struct stat_field *fields,
		     uint32_t n, void (*get)(void *obj, void *st), void *obj,
		     phx_stats_source **out);

#endif /* PHX_INTERNAL_H */
