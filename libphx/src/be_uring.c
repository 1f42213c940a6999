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
 */
#include <errno.h>
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
	fixed_files_setup(eng);
	fixed_bufs_setup(eng);
	return 0;
}

static void uring_teardown(phx_engine *eng)
{
	io_uring_queue_exit(&eng->u.uring.ring);
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
static unsigned sq_publish(phx_engine *eng)
{
	struct io_uring_sq *sq = &eng->u.uring.ring.sq;

	if (sq->sqe_head != sq->sqe_tail) {
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

static void uring_submit(phx_engine *eng)
{
	unsigned n;

	if (!eng->unsubmitted && !io_uring_sq_ready(&eng->u.uring.ring))
		return;
	n = sq_publish(eng);
	if (!n)
		return;
	eng->st.submits++;
	/*
	 * -EAGAIN (no memory for requests) and -EBUSY (completions not yet
	 * reaped) leave the SQEs in the ring: the reaper submits them again
	 * once it has reaped (uring_progress), with the lock dropped.
	 */
	ring_enter(eng, n, 0);
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
static int reaper_wait(phx_engine *eng, unsigned n, bool in_kernel)
{
	struct be_uring_state *u = &eng->u.uring;
	int64_t until;
	int ret;

	if (io_uring_cq_ready(&u->ring))
		ret = n ? ring_enter(eng, n, 0) : 0;
	else if (!u->spin_ns)
		ret = ring_enter(eng, n, 1);
	else
		ret = n ? ring_enter(eng, n, 0) : 0;
	if (ret == -EAGAIN || ret == -EBUSY)
		return enter_backoff(eng, ret, in_kernel);
	if (ret < 0 || !u->spin_ns || io_uring_cq_ready(&u->ring))
		return ret;
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
			uring_submit(eng);
			break;
		}
		/* A future reaper submits as it waits; everyone else now. */
		if (u->reaping || !block || deadline >= 0 || !eng->inflight)
			uring_submit(eng);
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
			unsigned n = sq_publish(eng);
			bool in_kernel = eng->inflight > n;

			if (n)
				eng->st.submits++;
			pthread_mutex_unlock(&eng->lock);
			if (deadline < 0) {
				ret = reaper_wait(eng, n, in_kernel);
				ret = ret < 0 ? ret : 0;
			} else {
				int64_t left = deadline - phx_now_ns();
				struct __kernel_timespec kts = {
					.tv_sec = left > 0 ? left / 1000000000 : 0,
					.tv_nsec = left > 0 ? left % 1000000000 : 0,
				};

				ret = n ? ring_enter(eng, n, 0) : 0;
				if (ret == -EAGAIN || ret == -EBUSY)
					ret = enter_backoff(eng, ret, in_kernel);
				if (ret >= 0)
					ret = io_uring_wait_cqe_timeout(&u->ring, &cqe, &kts);
			}
			pthread_mutex_lock(&eng->lock);
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
