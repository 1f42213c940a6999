// SPDX-License-Identifier: Apache-2.0
/*
 * be_uring.c - the io_uring backend: the ring, its registered resources,
 * and the progress loop.
 *
 * Progress is leader/follower: a thread that needs completions takes the
 * reaping role if nobody has it, waits on the ring with the lock dropped,
 * then handles every completion it finds (for all threads) under the lock
 * and wakes the others.  Threads that find a reaper at work sleep on the
 * condition variable instead.  Submission happens under the lock at any
 * time, so a reaper asleep in the kernel never delays new work.
 *
 * Where ops never sleep (a filesystem on zram, the page cache) the kernel
 * runs each read or write to its end inside the io_uring_enter that submits
 * it; large batches then go out mostly with IOSQE_ASYNC so that io_uring's
 * io-wq workers run them on several CPUs ("Spreading", below).
 */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "internal.h"

/* ------------------------------------------------------------------------ */
/* Set-up                                                                   */
/* ------------------------------------------------------------------------ */

/*
 * Fixed buffers: a sparse table whose first bounce_count entries are the
 * bounce buffers and the rest caller registrations.  Either step may fail
 * (old kernel, RLIMIT_MEMLOCK); the engine then works without them.
 */
static void fixed_bufs_setup(phx_engine *eng)
{
	struct io_uring *ring = &eng->u.uring.ring;
	uint32_t n = eng->cfg.bounce_count, i;
	struct iovec *iov;
	int ret;

	if (eng->cfg.flags & PHX_ENGINE_NO_FIXED_BUFS)
		return;
	ret = io_uring_register_buffers_sparse(ring, n + PHX_USER_BUF_SLOTS);
	if (ret < 0)
		return;
	eng->features |= PHX_FEAT_USER_BUFS;
	iov = calloc(n, sizeof(*iov));
	if (!iov)
		return;
	for (i = 0; i < n; i++) {
		iov[i].iov_base = eng->bounce_mem + (size_t)i * eng->cfg.bounce_size;
		iov[i].iov_len = eng->cfg.bounce_size;
	}
	ret = io_uring_register_buffers_update_tag(ring, 0, iov, NULL, n);
	free(iov);
	if (ret >= 0)
		eng->features |= PHX_FEAT_FIXED_BUFS;
}

static void fixed_files_setup(phx_engine *eng)
{
	if (eng->cfg.flags & PHX_ENGINE_NO_FIXED_FILES)
		return;
	if (io_uring_register_files_sparse(&eng->u.uring.ring, eng->cfg.max_files) >= 0)
		eng->features |= PHX_FEAT_FIXED_FILES;
}

/*
 * The ring, with the most helpful setup flags the kernel accepts: each set
 * below is tried in turn, dropping what older kernels refuse (-EINVAL).
 *   SUBMIT_ALL (5.18): an SQE that fails at submission does not hold back
 *     the ones behind it;
 *   COOP_TASKRUN | TASKRUN_FLAG (5.19): completions need not interrupt us;
 *   SINGLE_ISSUER | DEFER_TASKRUN (6.0 / 6.1), single-thread engines only:
 *     completion work runs in batches when we wait, not per completion.
 * The SQ has one entry more than the queue depth for the retry tick.
 */
static int ring_init(struct io_uring *ring, uint32_t depth, bool single,
		     struct io_uring_params *p)
{
	static const unsigned coop = IORING_SETUP_COOP_TASKRUN | IORING_SETUP_TASKRUN_FLAG;
	static const unsigned one = IORING_SETUP_SINGLE_ISSUER | IORING_SETUP_DEFER_TASKRUN;
	unsigned tries[6], ntries = 0, i;
	int ret = -EINVAL;

	if (single) {
		tries[ntries++] = IORING_SETUP_SUBMIT_ALL | one | IORING_SETUP_TASKRUN_FLAG;
		tries[ntries++] = IORING_SETUP_SUBMIT_ALL | IORING_SETUP_SINGLE_ISSUER | coop;
	}
	tries[ntries++] = IORING_SETUP_SUBMIT_ALL | coop;
	tries[ntries++] = coop;
	tries[ntries++] = 0;
	for (i = 0; i < ntries; i++) {
		memset(p, 0, sizeof(*p));
		/* Completions outnumber submissions only transiently: 2x is ample. */
		p->flags = IORING_SETUP_CQSIZE | tries[i];
		p->cq_entries = 2 * (depth + 1);
		ret = io_uring_queue_init_params(depth + 1, ring, p);
		if (ret != -EINVAL)
			break;
	}
	return ret;
}

/* What a refused io_uring_setup most likely means, for the reason text. */
static const char *refusal_hint(int ret)
{
	switch (ret) {
	case -EPERM:
		return " (a seccomp filter - containers' default profiles refuse io_uring - or sysctl kernel.io_uring_disabled)";
	case -EACCES:
		return " (refused by a security module)";
	case -ENOSYS:
		return " (kernel without io_uring, or a sandbox that does not implement it)";
	case -ENOMEM:
		return " (RLIMIT_MEMLOCK too low for a ring on this kernel? see ulimit -l)";
	default:
		return "";
	}
}

static int uring_probe(char *why, size_t n)
{
	struct io_uring_params p;
	struct io_uring ring;
	int ret = ring_init(&ring, 1, false, &p);

	if (ret < 0) {
		snprintf(why, n, "io_uring_setup: %s%s", strerror(-ret), refusal_hint(ret));
		return ret;
	}
	io_uring_queue_exit(&ring);
	snprintf(why, n, "io_uring_setup succeeded");
	return 0;
}

/* ------------------------------------------------------------------------ */
/* Spreading: ops that complete inside the submitting call                  */
/* ------------------------------------------------------------------------ */

/*
 * A read from a filesystem on zram (or a page-cache hit on ext4, xfs) never
 * sleeps: io_uring runs it to its end - the copy or decompression - inside
 * the io_uring_enter that submits it, in the submitting thread.  (A raw
 * zram device and tmpfs take no non-blocking I/O: io_uring hands each op
 * to io-wq, which runs such work one op at a time; PHX_URING_SPREAD=1
 * spreads them, auto does not see them.)  However deep the queue, one engine
 * is then one CPU: on the 16-CPU H100 box, 4-64 KiB random pieces from
 * ext4 on zram ran at 1.0-3.1 GB/s through one engine inline, 2.0-13.7
 * spread (docs/bench-io.md, "Spreading").
 *
 * Such a device shows itself in a batch of at least SPREAD_MIN_BATCH reads
 * and writes: its last one has completed when the call that submitted it
 * returns (enter_sampled).  On a device that sleeps this cannot happen - the
 * last op reached the device a microsecond before the call returned, and no
 * device answers that fast - so earlier ops completing meanwhile (a fast
 * NVMe drive) do not fool it.  A score of recent samples decides, as in
 * be_threads.c, so that one batch does not flip it.
 *
 * On such a device a batch's reads and writes go out with IOSQE_ASYNC - the
 * io-wq workers of the submitting thread run them in parallel - except a
 * share of 1 / (workers + 1), last in the batch, that the submitting thread
 * runs itself while the workers start on the rest: it stays busy rather
 * than waking for each completion, and its last op is the next sample.
 * Batches below SPREAD_MIN_BATCH stay inline (QD 1 above all): a hop to a
 * worker and back costs a wake-up, as much as a small op; for the same
 * reason small ops are spread only over many CPUs (SPREAD_MIN_SHARE).
 *
 * Workers only help on CPUs nobody else wants; where every CPU is busy
 * they take turns with the threads already there, and each hop is a loss.
 * So only batches whose submitting thread then waits for them are spread
 * (phx_submit_wait; what a waiting thread submits while it reaps): one that
 * submits and goes on (phx_submit, phx_poll) keeps its ops inline.  That
 * is a GPU context's lanes, one thread and engine per CPU already: spread,
 * 16 lanes on the 16-CPU H100 box read 64 KiB pieces at 11-14.5 GB/s
 * instead of 16.  And a batch is cut for as many workers as CPUs are left
 * by runnable threads that are not ours (spare_cpus: /proc/loadavg's count,
 * read at most every SPREAD_LOAD_NS).
 *
 * PHX_URING_SPREAD: auto (the default), 0 (never), 1 (every large batch,
 * whatever the device and the load; no samples).
 */
#define SPREAD_MIN_BATCH 8u
#define SPREAD_SCORE_RANGE 4
#define SPREAD_LOAD_NS 1000000
/*
 * A hop to a worker costs its CPU some microseconds (the 2-core box: about
 * 4 per op).  It pays when the op's copy takes longer than that spread over
 * the CPUs that share the batch: on that box (zram, QD 32) 4 KiB sequential
 * reads ran 0.85x spread over 2 CPUs, random ones 1.0x, 16 KiB random ones
 * 1.1x; on the 16-CPU H100 box 4 KiB random reads ran 2.0x.  So the mean
 * op of an automatically spread batch times the CPUs it is cut for must
 * come to SPREAD_MIN_SHARE.
 */
#define SPREAD_MIN_SHARE (32u << 10)

/* What a publication handed to the kernel, for the sample after the entry. */
struct sq_batch {
	uint64_t probe;		/* user_data of the last read/write it runs inline */
	bool sample;		/* probe is set: submit, then look for it */
	int8_t seen;		/* after the entry: 1 the probe completed within it,
				 * 0 it did not (its completion decides), -1 no sample */
};

static void spread_setup(struct be_uring_state *u)
{
	u->spread = phx_env_choice("PHX_URING_SPREAD", phx_spread_choices, SPREAD_AUTO);
	/* not yet: two batches that complete inline turn it on */
	u->inline_score = -1;
	/* the submitting thread is the CPU the workers leave */
	u->max_workers = phx_cpus_usable() - 1;
	if (!u->max_workers && u->spread == SPREAD_ON)
		u->max_workers = 1;
	u->load_fd = u->spread == SPREAD_AUTO && u->max_workers ?
		open("/proc/loadavg", O_RDONLY | O_CLOEXEC) : -1;
}

/* A sample (1 inline, 0 not) moves the score (lock held). */
static void spread_score(struct be_uring_state *u, int sample)
{
	if (sample > 0 && u->inline_score < SPREAD_SCORE_RANGE)
		u->inline_score++;
	else if (!sample && u->inline_score > -SPREAD_SCORE_RANGE)
		u->inline_score--;
}

/*
 * What enter_sampled saw (lock held): a probe complete inside the call is
 * a sample; one that was not is decided when it completes (spread_late).
 */
static void spread_note(struct be_uring_state *u, const struct sq_batch *b)
{
	if (b->seen > 0)
		spread_score(u, 1);
	else if (!b->seen)
		u->probe_late = (struct chunk *)(uintptr_t)b->probe;
}

/*
 * The completion of a probe that was not complete when its call returned
 * (lock held, from the reaper).  A device that sleeps explains it - but so
 * does io_uring itself, which finishes a short read of a regular file in
 * io-wq: a read across the end of the file returns what there was inline,
 * then goes to a worker for the rest (and finds 0).  Such a read, or one
 * that failed, says nothing about the device: no sample.  Without this,
 * random reads on ext4 on zram that happened to end a batch at the end of
 * the file kept it from being detected (the uring-spread test, now and
 * then under load).
 */
static void spread_late(struct be_uring_state *u, const struct chunk *c, int res)
{
	u->probe_late = NULL;
	if (res >= 0 && (uint64_t)res >= c->dop.len)
		spread_score(u, 0);
}

/* Runnable threads now, all processes, from /proc/loadavg ("0.1 0.2 0.3 R/T P"). */
static int runnable_now(int fd)
{
	char buf[128], *p;
	ssize_t n = pread(fd, buf, sizeof(buf) - 1, 0);

	if (n <= 0)
		return -1;
	buf[n] = 0;
	p = strchr(buf, '/');
	while (p && p > buf && p[-1] >= '0' && p[-1] <= '9')
		p--;
	return p ? atoi(p) : -1;
}

/*
 * CPUs that runnable threads other than this one leave idle (lock held).
 * Read only while no op of ours is with io-wq, whose workers would count
 * as others (and at most every SPREAD_LOAD_NS): a running pipeline keeps
 * the figure of its start, an engine that pauses between batches (a GPU
 * lane) renews it.  Smoothed, an instant's count being noisy.
 */
static uint32_t spare_cpus(struct be_uring_state *u)
{
	int64_t now;
	int r;

	if (u->load_fd < 0)
		return u->max_workers;
	now = phx_now_ns();
	if (!u->async_inflight && now - u->load_at >= SPREAD_LOAD_NS) {
		/* minus the reading thread */
		r = runnable_now(u->load_fd) - 1;
		if (r >= 0)
			u->others16 = u->load_at ? u->others16 / 2 + 8 * (uint32_t)r :
				      16 * (uint32_t)r;
		u->load_at = now;
	}
	r = (int)u->max_workers - (int)((u->others16 + 8) / 16);
	return r > 0 ? (uint32_t)r : 0;
}

/*
 * The workers a large batch is cut for (lock held): none while the device
 * sleeps or no CPU is spare.
 */
static uint32_t spread_workers(struct be_uring_state *u)
{
	switch (u->spread) {
	case SPREAD_ON:
		return u->max_workers;
	case SPREAD_AUTO:
		if (u->inline_score > 0)
			return spare_cpus(u);
		/* fallthrough */
	default:
		return 0;
	}
}

/*
 * io-wq runs a file read or write sent with IOSQE_ASYNC as unbounded work
 * (its file is looked up only when it runs), of which it starts up to
 * RLIMIT_NPROC workers per submitting thread; bounded work up to min(ring
 * entries, 4 x CPUs).  Spread ops never sleep, so workers beyond those the
 * batch is cut for only take turns with them: on the 2-core box 8 of them
 * ran at once, and one did as much.  Both kinds are capped there.  The cap
 * is io-wq's: it holds for every ring of each thread that uses this one
 * (blocking work of theirs too, sockets say), from the first spread batch
 * (a sleeping device never sets it) until the engine is destroyed, when
 * the limits it found come back.  A failure (Linux < 5.15) leaves them.
 */
static void iowq_cap(struct be_uring_state *u, uint32_t w)
{
	unsigned vals[2] = { w, w };

	if (w == u->iowq_cap)
		return;
	if (io_uring_register_iowq_max_workers(&u->ring, vals) < 0)
		return;
	if (!u->iowq_cap) {
		u->iowq_found[0] = vals[0];
		u->iowq_found[1] = vals[1];
	}
	u->iowq_cap = w;
}

/* At teardown: the limits the first cap found, for the threads that used us. */
static void iowq_restore(struct be_uring_state *u)
{
	if (u->iowq_cap)
		io_uring_register_iowq_max_workers(&u->ring, u->iowq_found);
}

static bool sqe_is_rw(const struct io_uring_sqe *sqe)
{
	switch (sqe->opcode) {
	case IORING_OP_READ:
	case IORING_OP_READ_FIXED:
	case IORING_OP_WRITE:
	case IORING_OP_WRITE_FIXED:
		return true;
	default:
		return false;
	}
}

/*
 * The SQEs about to be published (lock held): the first of a large batch's
 * reads and writes to io-wq when spreading and the submitting thread then
 * waits (@waiter); the last one run inline is the sample in auto mode.
 */
static void spread_mark(phx_engine *eng, struct sq_batch *b, bool waiter)
{
	struct be_uring_state *u = &eng->u.uring;
	struct io_uring_sq *sq = &u->ring.sq;
	unsigned i, nrw = 0, nasync = 0;
	struct io_uring_sqe *sqe;
	uint64_t bytes = 0;
	uint32_t w;

	if (u->spread == SPREAD_OFF)
		return;
	for (i = sq->sqe_head; i != sq->sqe_tail; i++) {
		sqe = &sq->sqes[i & sq->ring_mask];
		if (sqe_is_rw(sqe)) {
			nrw++;
			bytes += sqe->len;
		}
	}
	if (nrw < SPREAD_MIN_BATCH)
		return;
	w = waiter ? spread_workers(u) : 0;
	if (u->spread == SPREAD_AUTO && bytes / nrw * (w + 1) < SPREAD_MIN_SHARE)
		w = 0;
	if (w) {
		nasync = nrw - (nrw + w) / (w + 1);
		iowq_cap(u, w);
	}
	for (i = sq->sqe_head; i != sq->sqe_tail; i++) {
		sqe = &sq->sqes[i & sq->ring_mask];
		if (!sqe_is_rw(sqe))
			continue;
		if (nasync) {
			struct chunk *c = (struct chunk *)(uintptr_t)sqe->user_data;

			sqe->flags |= IOSQE_ASYNC;
			c->uring_async = true;
			u->async_inflight++;
			u->async_sqes++;
			nasync--;
		} else {
			b->probe = sqe->user_data;
		}
	}
	b->sample = u->spread == SPREAD_AUTO;
}

/*
 * Whether the completion of @probe was posted at or after CQ index @from
 * (the reaping role or the lock held: nobody consumes completions now).
 */
static bool cq_posted_since(struct io_uring *ring, unsigned from, uint64_t probe)
{
	unsigned tail = io_uring_smp_load_acquire(ring->cq.ktail);

	/* inline ops complete in order: the probe is at the end */
	while (tail != from) {
		tail--;
		if (ring->cq.cqes[tail & ring->cq.ring_mask].user_data == probe)
			return true;
	}
	return false;
}

static int uring_setup(phx_engine *eng)
{
	struct be_uring_state *u = &eng->u.uring;
	bool single = eng->cfg.flags & PHX_ENGINE_SINGLE_THREAD;
	struct io_uring_params p;
	int ret = ring_init(&u->ring, eng->cfg.queue_depth, single, &p);

	if (ret < 0)
		return phx_err(ret, "io_uring_queue_init(%u) failed%s", eng->cfg.queue_depth,
			       refusal_hint(ret));
	if (p.flags & IORING_SETUP_SUBMIT_ALL)
		eng->features |= PHX_FEAT_SUBMIT_ALL;
	if (p.flags & IORING_SETUP_SINGLE_ISSUER)
		eng->features |= PHX_FEAT_SINGLE_ISSUER;
	if (p.flags & IORING_SETUP_DEFER_TASKRUN)
		eng->features |= PHX_FEAT_DEFER_TASKRUN;
	u->enter_fd = u->ring.ring_fd;
	/* A registered ring fd is per thread: only for single-thread engines. */
	if (single && io_uring_register_ring_fd(&u->ring) == 1) {
		u->enter_fd = u->ring.enter_ring_fd;
		u->enter_flags = IORING_ENTER_REGISTERED_RING;
		eng->features |= PHX_FEAT_REG_RING;
	}
	u->tick_ts.tv_nsec = PHX_TICK_NS;
	u->spin_ns = phx_env_u32("PHX_SPIN_NS", 0);
	spread_setup(u);
	fixed_files_setup(eng);
	fixed_bufs_setup(eng);
	return 0;
}

static void uring_teardown(phx_engine *eng)
{
	iowq_restore(&eng->u.uring);
	io_uring_queue_exit(&eng->u.uring.ring);
	if (eng->u.uring.load_fd >= 0)
		close(eng->u.uring.load_fd);
}

static int uring_eventfd(phx_engine *eng, int fd)
{
	int ret = io_uring_register_eventfd(&eng->u.uring.ring, fd);

	return ret < 0 ? phx_err(ret, "io_uring_register_eventfd") : 0;
}

static int uring_buf_update(phx_engine *eng, int index, void *addr, size_t len)
{
	struct iovec iov = { .iov_base = addr, .iov_len = len };
	int ret;

	ret = io_uring_register_buffers_update_tag(&eng->u.uring.ring, index, &iov, NULL, 1);
	return ret < 0 ? ret : 0;
}

static int uring_file_update(phx_engine *eng, int slot, int fd)
{
	int ret = io_uring_register_files_update(&eng->u.uring.ring, slot, &fd, 1);

	return ret == 1 ? 0 : ret < 0 ? ret : -EIO;
}

/* ------------------------------------------------------------------------ */
/* Submission                                                               */
/* ------------------------------------------------------------------------ */

/* Put a chunk's device op on the submission queue (lock held). */
static void uring_queue(phx_engine *eng, struct chunk *c)
{
	/* Chunks (and the one retry tick) never outnumber ring entries. */
	struct io_uring_sqe *sqe = io_uring_get_sqe(&eng->u.uring.ring);
	const struct devop *d = &c->dop;
	int fd = d->slot >= 0 ? d->slot : d->fd;
	unsigned len = (unsigned)d->len;

	switch (d->kind) {
	case DOP_SYNC_RANGE:
		io_uring_prep_sync_file_range(sqe, fd, len, d->off,
					      SYNC_FILE_RANGE_WAIT_BEFORE |
					      SYNC_FILE_RANGE_WRITE |
					      SYNC_FILE_RANGE_WAIT_AFTER);
		break;
	case DOP_DONTNEED:
		io_uring_prep_fadvise(sqe, fd, d->off, (off_t)d->len, POSIX_FADV_DONTNEED);
		break;
	case DOP_READ:
		if (d->buf_index >= 0)
			io_uring_prep_read_fixed(sqe, fd, d->mem, len, d->off, d->buf_index);
		else
			io_uring_prep_read(sqe, fd, d->mem, len, d->off);
		break;
	default:
		if (d->buf_index >= 0)
			io_uring_prep_write_fixed(sqe, fd, d->mem, len, d->off, d->buf_index);
		else
			io_uring_prep_write(sqe, fd, d->mem, len, d->off);
		break;
	}
	if (d->buf_index >= 0)
		eng->st.fixed_buf_ios++;
	if (d->slot >= 0)
		sqe->flags |= IOSQE_FIXED_FILE;
	io_uring_sqe_set_data(sqe, c);
	eng->unsubmitted++;
}

/*
 * Make prepared SQEs visible to the kernel without entering it (lock held).
 * Returns how many the kernel has not taken yet - including any an earlier
 * entry left behind (-EAGAIN, -EBUSY, or a submission that stopped early),
 * so whoever enters next always submits everything that is ready.
 * Several threads may enter at once; each submits what it finds, so counts
 * are only ever a hint.
 */
static unsigned sq_publish(phx_engine *eng, struct sq_batch *b, bool waiter)
{
	struct io_uring_sq *sq = &eng->u.uring.ring.sq;

	b->sample = false;
	b->seen = -1;
	if (sq->sqe_head != sq->sqe_tail) {
		spread_mark(eng, b, waiter);
		sq->sqe_head = sq->sqe_tail;
		__atomic_store_n(sq->ktail, sq->sqe_tail, __ATOMIC_RELEASE);
	}
	eng->unsubmitted = 0;
	return io_uring_sq_ready(&eng->u.uring.ring);
}

static int enter_once(phx_engine *eng, unsigned to_submit, unsigned wait_nr)
{
	struct be_uring_state *u = &eng->u.uring;
	unsigned flags = u->enter_flags;

	/* Deferred completion work runs only when we ask for events. */
	if (wait_nr || (eng->features & PHX_FEAT_DEFER_TASKRUN))
		flags |= IORING_ENTER_GETEVENTS;
	return io_uring_enter(u->enter_fd, to_submit, wait_nr, flags, NULL);
}

/*
 * Submit @to_submit SQEs in slices of submit_batch: the kernel prepares a
 * whole slice before the device sees any of it, so on a device with a few
 * microseconds per request (virtio, NVMe) slices keep it busy sooner;
 * measured on the dev box's virtio disk, 4 KiB random reads at QD 32 went
 * from ~0.88x to ~1.0x fio with slices of 4 (docs/bench-io.md).  The last
 * slice waits for @wait_nr completions.  Returns the last entry's result:
 * -EAGAIN / -EBUSY leave the rest in the ring for the next entry.
 */
static int ring_enter(phx_engine *eng, unsigned to_submit, unsigned wait_nr)
{
	unsigned slice = eng->cfg.submit_batch;
	int ret;

	while (slice && to_submit > slice) {
		ret = enter_once(eng, slice, 0);
		if (ret == -EINTR)
			continue;
		if (ret <= 0)
			return ret;
		to_submit -= (unsigned)ret < to_submit ? (unsigned)ret : to_submit;
	}
	do {
		ret = enter_once(eng, to_submit, wait_nr);
	} while (ret == -EINTR);
	return ret;
}

/*
 * Submit @n published SQEs without waiting and see whether @b's probe
 * completed within the call (@b->seen).  Returns ring_enter()'s result.
 */
static int enter_sampled(phx_engine *eng, unsigned n, struct sq_batch *b)
{
	struct io_uring *ring = &eng->u.uring.ring;
	unsigned from = io_uring_smp_load_acquire(ring->cq.ktail);
	int ret = ring_enter(eng, n, 0);

	if (b->sample && ret > 0)
		b->seen = cq_posted_since(ring, from, b->probe);
	return ret;
}

/* Hand what is queued to the kernel; @waiter: the calling thread then waits. */
static void submit_now(phx_engine *eng, bool waiter)
{
	struct sq_batch b;
	unsigned n;

	if (!eng->unsubmitted && !io_uring_sq_ready(&eng->u.uring.ring))
		return;
	n = sq_publish(eng, &b, waiter);
	if (!n)
		return;
	eng->st.submits++;
	/*
	 * -EAGAIN (no memory for requests) and -EBUSY (completions not yet
	 * reaped) leave the SQEs in the ring: the reaper submits them again
	 * once it has reaped (uring_progress), with the lock dropped.
	 */
	enter_sampled(eng, n, &b);
	spread_note(&eng->u.uring, &b);
}

/*
 * From submit_locked (engine.c): phx_submit_wait's caller waits for what it
 * submits, phx_submit's goes on with its own work (a GPU lane: one thread
 * per CPU already) and keeps its ops inline.
 */
static void uring_submit(phx_engine *eng)
{
	submit_now(eng, eng->submit_waits);
}

/* Fires after PHX_TICK_NS so that a chunk waiting on a claim is retried. */
static void uring_arm_tick(phx_engine *eng)
{
	struct be_uring_state *u = &eng->u.uring;
	struct io_uring_sqe *sqe;

	if (eng->tick_armed)
		return;
	sqe = io_uring_get_sqe(&u->ring);
	if (!sqe)
		return;
	io_uring_prep_timeout(sqe, &u->tick_ts, 0, 0);
	io_uring_sqe_set_data(sqe, &u->tick_ts);
	eng->tick_armed = true;
	eng->inflight++;
	eng->unsubmitted++;
}

/* ------------------------------------------------------------------------ */
/* Progress                                                                 */
/* ------------------------------------------------------------------------ */

/* Handle every completion already posted (lock held, reaping role held). */
static unsigned reap_locked(phx_engine *eng)
{
	struct be_uring_state *u = &eng->u.uring;
	struct io_uring_cqe *cqes[64];
	unsigned n, i, total = 0;

	do {
		n = io_uring_peek_batch_cqe(&u->ring, cqes, 64);
		for (i = 0; i < n; i++) {
			void *data = io_uring_cqe_get_data(cqes[i]);
			int res = cqes[i]->res;

			io_uring_cqe_seen(&u->ring, cqes[i]);
			if (data == &u->tick_ts) {
				eng->tick_armed = false;
				eng->inflight--;
				continue;
			}
			if (data == u->probe_late)
				spread_late(u, data, res);
			if (((struct chunk *)data)->uring_async) {
				((struct chunk *)data)->uring_async = false;
				u->async_inflight--;
			}
			/*
			 * io-wq dropped the op before it ran: the thread whose
			 * io-wq held it exited (a thread submits whatever is
			 * queued, other threads' ops too, and spreading sends
			 * many there).  libphx cancels nothing, so that is all
			 * -ECANCELED can mean here: run it again, as -EAGAIN.
			 */
			if (res == -ECANCELED)
				res = -EAGAIN;
			io_complete_op(eng, data, res);
		}
		total += n;
	} while (n == 64);
	return total;
}

/*
 * The kernel took none of our SQEs (-EAGAIN, -EBUSY): wait without
 * spinning.  With requests of ours in the kernel, until one completes
 * (which frees what the kernel ran short of); otherwise a short sleep.
 */
static int enter_backoff(phx_engine *eng, int ret, bool in_kernel)
{
	struct timespec ts = { 0, 50 * 1000 };

	if (io_uring_cq_ready(&eng->u.uring.ring))
		return 0;
	if (in_kernel) {
		ret = enter_once(eng, 0, 1);
		return ret == -EINTR ? 0 : ret;
	}
	nanosleep(&ts, NULL);
	return 0;
}

/*
 * Submit @n published SQEs and wait for a completion; @in_kernel says
 * whether requests of ours were already in the kernel.  A completion often
 * follows within microseconds; spinning that long before sleeping saves a
 * wake-up at the price of CPU time (PHX_SPIN_NS; default 0, never spin).
 */
static int reaper_wait(phx_engine *eng, unsigned n, bool in_kernel,
		       struct sq_batch *b)
{
	struct be_uring_state *u = &eng->u.uring;
	/* A batch to sample is submitted first and waited for after. */
	bool apart = u->spin_ns || b->sample;
	int64_t until;
	int ret;

	if (!apart && !io_uring_cq_ready(&u->ring))
		ret = ring_enter(eng, n, 1);
	else
		ret = n ? enter_sampled(eng, n, b) : 0;
	if (ret == -EAGAIN || ret == -EBUSY)
		return enter_backoff(eng, ret, in_kernel);
	if (ret < 0 || !apart || io_uring_cq_ready(&u->ring))
		return ret;
	if (!u->spin_ns)
		return ring_enter(eng, 0, 1);
	until = phx_now_ns() + u->spin_ns;
	do {
		if (io_uring_cq_ready(&u->ring))
			return 0;
		/* Completions may wait in task work until we enter the kernel. */
		if (IO_URING_READ_ONCE(*u->ring.sq.kflags) & IORING_SQ_TASKRUN)
			enter_once(eng, 0, 0);
	} while (phx_now_ns() < until);
	return ring_enter(eng, 0, 1);
}

static bool io_is_done(struct phx_io *io)
{
	return __atomic_load_n(&io->done, __ATOMIC_ACQUIRE);
}

static int uring_progress(phx_engine *eng, struct phx_io *io, int64_t timeout_ns,
			  bool block)
{
	struct be_uring_state *u = &eng->u.uring;
	int64_t deadline = timeout_ns >= 0 ? phx_now_ns() + timeout_ns : -1;
	struct io_uring_cqe *cqe;
	int ret = 0;

	pthread_mutex_lock(&eng->lock);
	for (;;) {
		io_fill(eng);
		if (io && io_is_done(io)) {
			submit_now(eng, block);
			break;
		}
		/* A future reaper submits as it waits; everyone else now. */
		if (u->reaping || !block || deadline >= 0 || !eng->inflight)
			submit_now(eng, block);
		if (u->reaping) {
			if (!block)
				break;
			ret = phx_cond_wait_until(&eng->cond, &eng->lock, deadline);
			if (ret || !io)
				break;
			continue;
		}
		if (!eng->inflight) {
			/* Nothing can complete: either done or blocked on nothing. */
			break;
		}
		u->reaping = true;
		if (block) {
			struct sq_batch b;
			unsigned n = sq_publish(eng, &b, true);
			bool in_kernel = eng->inflight > n;

			if (n)
				eng->st.submits++;
			pthread_mutex_unlock(&eng->lock);
			if (deadline < 0) {
				ret = reaper_wait(eng, n, in_kernel, &b);
				ret = ret < 0 ? ret : 0;
			} else {
				int64_t left = deadline - phx_now_ns();
				struct __kernel_timespec kts = {
					.tv_sec = left > 0 ? left / 1000000000 : 0,
					.tv_nsec = left > 0 ? left % 1000000000 : 0,
				};

				ret = n ? enter_sampled(eng, n, &b) : 0;
				if (ret == -EAGAIN || ret == -EBUSY)
					ret = enter_backoff(eng, ret, in_kernel);
				if (ret >= 0)
					ret = io_uring_wait_cqe_timeout(&u->ring, &cqe, &kts);
			}
			pthread_mutex_lock(&eng->lock);
			spread_note(u, &b);
		} else if (eng->features & PHX_FEAT_DEFER_TASKRUN) {
			/* Run deferred completion work without waiting. */
			enter_once(eng, 0, 0);
		}
		reap_locked(eng);
		u->reaping = false;
		pthread_cond_broadcast(&eng->cond);
		if (ret == -ETIME || (ret == 0 && deadline >= 0 && phx_now_ns() >= deadline &&
				      !(io && io_is_done(io)))) {
			ret = -ETIME;
			break;
		}
		ret = 0;
		if (!block || !io)
			break;
	}
	if (ret == -ETIME && io && io_is_done(io))
		ret = 0;
	pthread_mutex_unlock(&eng->lock);
	return ret;
}

const struct phx_backend be_uring = {
	.name = "uring",
	.desc = "io_uring: batched submissions, fixed files and buffers",
	.probe = uring_probe,
	.setup = uring_setup,
	.teardown = uring_teardown,
	.queue = uring_queue,
	.submit = uring_submit,
	.arm_tick = uring_arm_tick,
	.progress = uring_progress,
	.eventfd = uring_eventfd,
	.buf_update = uring_buf_update,
	.file_update = uring_file_update,
};
