// SPDX-License-Identifier: Apache-2.0
/*
 * engine.c - the ring, its resources, and the progress loop.
 *
 * Progress is leader/follower: a thread that needs completions takes the
 * reaping role if nobody has it, waits on the ring with the lock dropped,
 * then handles every completion it finds (for all threads) under the lock
 * and wakes the others.  Threads that find a reaper at work sleep on the
 * condition variable instead.  Submission happens under the lock at any
 * time, so a reaper asleep in the kernel never delays new work.
 */
#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <time.h>
#include <unistd.h>

#include "internal.h"

/* ------------------------------------------------------------------------ */
/* Configuration                                                            */
/* ------------------------------------------------------------------------ */

PHX_EXPORT void phx_engine_config_init(struct phx_engine_config *cfg)
{
	memset(cfg, 0, sizeof(*cfg));
	cfg->size = sizeof(*cfg);
	cfg->queue_depth = phx_env_u32("PHX_QUEUE_DEPTH", PHX_DEFAULT_QD);
	cfg->max_io_size = phx_env_u32("PHX_MAX_IO_SIZE", PHX_DEFAULT_MAX_IO);
	cfg->bounce_size = phx_env_u32("PHX_BOUNCE_SIZE", PHX_DEFAULT_BOUNCE_SIZE);
	cfg->bounce_count = phx_env_u32("PHX_BOUNCE_COUNT", PHX_DEFAULT_BOUNCE_COUNT);
	cfg->max_files = PHX_DEFAULT_MAX_FILES;
	cfg->submit_batch = phx_env_u32("PHX_SUBMIT_BATCH", PHX_DEFAULT_SUBMIT_BATCH);
}


static int config_check(struct phx_engine_config *c)
{
	if (c->queue_depth < 1 || c->queue_depth > 4096)
		return phx_err(-EINVAL, "queue_depth %u is outside 1..4096",
			       c->queue_depth);
	if (c->max_io_size < PHX_PAGE || c->max_io_size > (1u << 30) ||
	    c->max_io_size % PHX_PAGE)
		return phx_err(-EINVAL,
			       "max_io_size %u must be a multiple of 4096 in 4 KiB..1 GiB",
			       c->max_io_size);
	if (c->bounce_size < PHX_PAGE || c->bounce_size > (1u << 30) ||
	    c->bounce_size % PHX_PAGE)
		return phx_err(-EINVAL,
			       "bounce_size %u must be a multiple of 4096 in 4 KiB..1 GiB",
			       c->bounce_size);
	if (c->bounce_count < 1 || c->bounce_count > 1024)
		return phx_err(-EINVAL, "bounce_count %u is outside 1..1024",
			       c->bounce_count);
	if (c->max_files < 1 || c->max_files > 65536)
		return phx_err(-EINVAL, "max_files %u is outside 1..65536",
			       c->max_files);
	return 0;
}

/* ------------------------------------------------------------------------ */
/* Create / destroy                                                         */
/* ------------------------------------------------------------------------ */

static int bounce_setup(phx_engine *eng)
{
	size_t total = (size_t)eng->cfg.bounce_count * eng->cfg.bounce_size;
	uint32_t i;

	if (posix_memalign((void **)&eng->bounce_mem, PHX_PAGE, total))
		return phx_err(-ENOMEM, "cannot allocate %zu bytes of bounce buffers",
			       total);
	eng->bounce_free = calloc(eng->cfg.bounce_count, sizeof(int));
	if (!eng->bounce_free)
		return phx_err(-ENOMEM, "out of memory");
	for (i = 0; i < eng->cfg.bounce_count; i++)
		eng->bounce_free[i] = eng->cfg.bounce_count - 1 - i;
	eng->nbounce_free = eng->cfg.bounce_count;
	return 0;
}

/*
 * Fixed buffers: a sparse table whose first bounce_count entries are the
 * bounce buffers and the rest caller registrations.  Either step may fail
 * (old kernel, RLIMIT_MEMLOCK); the engine then works without them.
 */
static void fixed_bufs_setup(phx_engine *eng)
{
	uint32_t n = eng->cfg.bounce_count, i;
	struct iovec *iov;
	int ret;

	for (i = 0; i < PHX_USER_BUF_SLOTS; i++)
		eng->ubufs[i].index = n + i;
	if (eng->cfg.flags & PHX_ENGINE_NO_FIXED_BUFS)
		return;
	ret = io_uring_register_buffers_sparse(&eng->ring, n + PHX_USER_BUF_SLOTS);
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
	ret = io_uring_register_buffers_update_tag(&eng->ring, 0, iov, NULL, n);
	free(iov);
	if (ret >= 0)
		eng->features |= PHX_FEAT_FIXED_BUFS;
}

static void fixed_files_setup(phx_engine *eng)
{
	uint32_t i;

	eng->file_slots = malloc(eng->cfg.max_files * sizeof(int));
	if (!eng->file_slots)
		return;
	for (i = 0; i < eng->cfg.max_files; i++)
		eng->file_slots[i] = -1;
	if (eng->cfg.flags & PHX_ENGINE_NO_FIXED_FILES)
		return;
	if (io_uring_register_files_sparse(&eng->ring, eng->cfg.max_files) >= 0)
		eng->features |= PHX_FEAT_FIXED_FILES;
}

static int chunks_setup(phx_engine *eng)
{
	uint32_t i;

	eng->chunks = calloc(eng->cfg.queue_depth, sizeof(*eng->chunks));
	if (!eng->chunks)
		return phx_err(-ENOMEM, "out of memory");
	for (i = 0; i < eng->cfg.queue_depth; i++) {
		eng->chunks[i].next_free = eng->free_chunks;
		eng->free_chunks = &eng->chunks[i];
	}
	return 0;
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
static int ring_setup(phx_engine *eng)
{
	static const unsigned coop = IORING_SETUP_COOP_TASKRUN | IORING_SETUP_TASKRUN_FLAG;
	static const unsigned single = IORING_SETUP_SINGLE_ISSUER | IORING_SETUP_DEFER_TASKRUN;
	unsigned tries[6], ntries = 0, i;
	struct io_uring_params p;
	int ret = -EINVAL;

	if (eng->cfg.flags & PHX_ENGINE_SINGLE_THREAD) {
		tries[ntries++] = IORING_SETUP_SUBMIT_ALL | single | IORING_SETUP_TASKRUN_FLAG;
		tries[ntries++] = IORING_SETUP_SUBMIT_ALL | IORING_SETUP_SINGLE_ISSUER | coop;
	}
	tries[ntries++] = IORING_SETUP_SUBMIT_ALL | coop;
	tries[ntries++] = coop;
	tries[ntries++] = 0;
	for (i = 0; i < ntries; i++) {
		memset(&p, 0, sizeof(p));
		/* Completions outnumber submissions only transiently: 2x is ample. */
		p.flags = IORING_SETUP_CQSIZE | tries[i];
		p.cq_entries = 2 * (eng->cfg.queue_depth + 1);
		ret = io_uring_queue_init_params(eng->cfg.queue_depth + 1, &eng->ring, &p);
		if (ret != -EINVAL)
			break;
	}
	if (ret < 0)
		return phx_err(ret, "io_uring_queue_init(%u) failed%s", eng->cfg.queue_depth,
			       ret == -EPERM ? " (io_uring disabled by sysctl kernel.io_uring_disabled?)" :
			       ret == -ENOSYS ? " (kernel without io_uring)" : "");
	if (p.flags & IORING_SETUP_SUBMIT_ALL)
		eng->features |= PHX_FEAT_SUBMIT_ALL;
	if (p.flags & IORING_SETUP_SINGLE_ISSUER)
		eng->features |= PHX_FEAT_SINGLE_ISSUER;
	if (p.flags & IORING_SETUP_DEFER_TASKRUN)
		eng->features |= PHX_FEAT_DEFER_TASKRUN;
	eng->enter_fd = eng->ring.ring_fd;
	/* A registered ring fd is per thread: only for single-thread engines. */
	if ((eng->cfg.flags & PHX_ENGINE_SINGLE_THREAD) &&
	    io_uring_register_ring_fd(&eng->ring) == 1) {
		eng->enter_fd = eng->ring.enter_ring_fd;
		eng->enter_flags = IORING_ENTER_REGISTERED_RING;
		eng->features |= PHX_FEAT_REG_RING;
	}
	if (eng->cfg.flags & PHX_ENGINE_SINGLE_THREAD)
		eng->owner_tid = gettid();
	eng->tick_ts.tv_nsec = PHX_TICK_NS;
	return 0;
}

/*
 * Single-thread engines: the calling thread must be the creator (the
 * kernel refuses other submitters of a single-issuer ring, and a registered
 * ring fd means nothing in another thread).
 */
int engine_thread_check(const phx_engine *eng)
{
	if (eng->owner_tid && gettid() != eng->owner_tid)
		return phx_err(-EPERM, "engine is single-thread (PHX_ENGINE_SINGLE_THREAD), created by thread %d, called from thread %d",
			       (int)eng->owner_tid, (int)gettid());
	return 0;
}

static void engine_free(phx_engine *eng)
{
	free(eng->chunks);
	free(eng->bounce_free);
	free(eng->bounce_mem);
	free(eng->file_slots);
	pthread_cond_destroy(&eng->cond);
	pthread_mutex_destroy(&eng->lock);
	free(eng);
}

static int engine_create(const struct phx_engine_config *cfg, phx_engine **out);

/* Public entry points that make system calls leave errno as they found it. */
PHX_EXPORT int phx_engine_create(const struct phx_engine_config *cfg,
				 phx_engine **out)
{
	int saved = errno, ret = engine_create(cfg, out);

	errno = saved;
	return ret;
}

static int engine_create(const struct phx_engine_config *cfg, phx_engine **out)
{
	phx_engine *eng;
	int ret;

	if (!out)
		return phx_err(-EINVAL, "phx_engine_create: out is NULL");
	*out = NULL;
	eng = calloc(1, sizeof(*eng));
	if (!eng)
		return phx_err(-ENOMEM, "out of memory");
	pthread_mutex_init(&eng->lock, NULL);
	pthread_cond_init(&eng->cond, NULL);
	eng->efd = -1;
	phx_engine_config_init(&eng->cfg);
	ret = phx_env_check();
	if (ret)
		goto err_free;
	if (cfg) {
		size_t n = cfg->size && cfg->size < sizeof(*cfg) ? cfg->size : sizeof(*cfg);

		memcpy(&eng->cfg, cfg, n);
		eng->cfg.size = sizeof(*cfg);
		if (!eng->cfg.max_files)
			eng->cfg.max_files = PHX_DEFAULT_MAX_FILES;
	}
	ret = config_check(&eng->cfg);
	if (ret)
		goto err_free;
	ret = chunks_setup(eng);
	if (ret)
		goto err_free;
	ret = bounce_setup(eng);
	if (ret)
		goto err_free;

	ret = ring_setup(eng);
	if (ret < 0)
		goto err_free;
	fixed_files_setup(eng);
	fixed_bufs_setup(eng);
	eng->spin_ns = phx_env_u32("PHX_SPIN_NS", 0);
	*out = eng;
	return 0;

err_free:
	engine_free(eng);
	return ret;
}

PHX_EXPORT int phx_engine_destroy(phx_engine *eng)
{
	int ret = 0;

	if (!eng)
		return 0;
	pthread_mutex_lock(&eng->lock);
	/*
	 * GPU lanes use a held file's descriptor number on engines of their
	 * own: closing it here would let them read or write whatever file
	 * takes the number next.
	 */
	if (file_held_locked(eng)) {
		pthread_mutex_unlock(&eng->lock);
		return phx_err(-EBUSY, "a file of this engine is still used by GPU work (a phx_cuda context holds it): finish or deregister that first");
	}
	if ((eng->inflight || eng->pend_head) && engine_thread_check(eng)) {
		pthread_mutex_unlock(&eng->lock);
		return -EPERM;
	}
	while (eng->inflight || eng->pend_head) {
		pthread_mutex_unlock(&eng->lock);
		ret = engine_progress(eng, NULL, -1, true);
		pthread_mutex_lock(&eng->lock);
		if (ret < 0 && ret != -EINTR)
			break;
	}
	pthread_mutex_unlock(&eng->lock);
	file_close_all(eng);
	io_uring_queue_exit(&eng->ring);
	if (eng->efd >= 0)
		close(eng->efd);
	engine_free(eng);
	return ret < 0 ? ret : 0;
}

PHX_EXPORT void phx_engine_config_get(const phx_engine *eng,
				      struct phx_engine_config *cfg)
{
	*cfg = eng->cfg;
}

PHX_EXPORT uint32_t phx_engine_features(const phx_engine *eng)
{
	return eng->features;
}

PHX_EXPORT int phx_engine_eventfd(phx_engine *eng)
{
	int fd, ret, saved = errno;

	pthread_mutex_lock(&eng->lock);
	if (eng->efd >= 0) {
		fd = eng->efd;
		goto out;
	}
	fd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
	if (fd < 0) {
		fd = phx_err(-errno, "eventfd");
		goto out;
	}
	ret = io_uring_register_eventfd(&eng->ring, fd);
	if (ret < 0) {
		close(fd);
		fd = phx_err(ret, "io_uring_register_eventfd");
		goto out;
	}
	eng->efd = fd;
out:
	pthread_mutex_unlock(&eng->lock);
	errno = saved;
	return fd;
}

/* Wake eventfd waiters: an async request finished (lock held). */
void engine_notify(phx_engine *eng)
{
	if (eng->efd >= 0)
		eventfd_write(eng->efd, 1);
}

PHX_EXPORT void phx_engine_stats(phx_engine *eng, struct phx_stats *st)
{
	pthread_mutex_lock(&eng->lock);
	*st = eng->st;
	pthread_mutex_unlock(&eng->lock);
}

PHX_EXPORT void phx_engine_stats_reset(phx_engine *eng)
{
	pthread_mutex_lock(&eng->lock);
	memset(&eng->st, 0, sizeof(eng->st));
	pthread_mutex_unlock(&eng->lock);
}

/* ------------------------------------------------------------------------ */
/* Registered buffers                                                       */
/* ------------------------------------------------------------------------ */

PHX_EXPORT int phx_buf_register(phx_engine *eng, void *addr, size_t len)
{
	struct user_buf *slot = NULL;
	struct iovec iov = { .iov_base = addr, .iov_len = len };
	int ret, i;

	if (!addr || !len)
		return phx_err(-EINVAL, "phx_buf_register: empty buffer");
	ret = engine_thread_check(eng);
	if (ret)
		return ret;
	if (!(eng->features & PHX_FEAT_USER_BUFS))
		return phx_err(-EOPNOTSUPP,
			       "buffer registration unavailable (kernel without sparse fixed buffers, or disabled)");
	pthread_mutex_lock(&eng->lock);
	for (i = 0; i < (int)PHX_USER_BUF_SLOTS; i++) {
		if (eng->ubufs[i].len && eng->ubufs[i].addr == addr) {
			ret = phx_err(-EEXIST, "buffer %p is already registered", addr);
			goto out;
		}
		if (!eng->ubufs[i].len && !slot)
			slot = &eng->ubufs[i];
	}
	if (!slot) {
		ret = phx_err(-ENOSPC, "all %u buffer registration slots are in use",
			      PHX_USER_BUF_SLOTS);
		goto out;
	}
	ret = io_uring_register_buffers_update_tag(&eng->ring, slot->index, &iov,
						   NULL, 1);
	if (ret < 0) {
		phx_err(ret, "registering %zu bytes at %p as a fixed buffer%s", len, addr,
			ret == -ENOMEM || ret == -EPERM ?
			" (RLIMIT_MEMLOCK too low? see ulimit -l)" : "");
		goto out;
	}
	slot->addr = addr;
	slot->len = len;
	ret = 0;
out:
	pthread_mutex_unlock(&eng->lock);
	return ret;
}

PHX_EXPORT int phx_buf_deregister(phx_engine *eng, void *addr)
{
	struct iovec iov = { 0 };
	int ret = phx_err(-ENOENT, "buffer %p is not registered", addr);
	uint32_t i, c;

	pthread_mutex_lock(&eng->lock);
	for (i = 0; i < PHX_USER_BUF_SLOTS; i++) {
		struct user_buf *b = &eng->ubufs[i];

		if (!b->len || b->addr != addr)
			continue;
		for (c = 0; c < eng->cfg.queue_depth; c++) {
			if (eng->chunks[c].in_use && eng->chunks[c].buf_index == b->index) {
				ret = phx_err(-EBUSY, "buffer %p has I/O in flight", addr);
				goto out;
			}
		}
		ret = io_uring_register_buffers_update_tag(&eng->ring, b->index,
							   &iov, NULL, 1);
		if (ret < 0) {
			phx_err(ret, "unregistering buffer %p", addr);
			goto out;
		}
		b->len = 0;
		b->addr = NULL;
		ret = 0;
		break;
	}
out:
	pthread_mutex_unlock(&eng->lock);
	return ret;
}

/* ------------------------------------------------------------------------ */
/* Progress                                                                 */
/* ------------------------------------------------------------------------ */

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
	struct io_uring_sq *sq = &eng->ring.sq;

	if (sq->sqe_head != sq->sqe_tail) {
		sq->sqe_head = sq->sqe_tail;
		__atomic_store_n(sq->ktail, sq->sqe_tail, __ATOMIC_RELEASE);
	}
	eng->unsubmitted = 0;
	return io_uring_sq_ready(&eng->ring);
}

static int enter_once(phx_engine *eng, unsigned to_submit, unsigned wait_nr)
{
	unsigned flags = eng->enter_flags;

	/* Deferred completion work runs only when we ask for events. */
	if (wait_nr || (eng->features & PHX_FEAT_DEFER_TASKRUN))
		flags |= IORING_ENTER_GETEVENTS;
	return io_uring_enter(eng->enter_fd, to_submit, wait_nr, flags, NULL);
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

void engine_submit_locked(phx_engine *eng)
{
	unsigned n;

	if (!eng->unsubmitted && !io_uring_sq_ready(&eng->ring))
		return;
	n = sq_publish(eng);
	if (!n)
		return;
	eng->st.submits++;
	/*
	 * -EAGAIN (no memory for requests) and -EBUSY (completions not yet
	 * reaped) leave the SQEs in the ring: the reaper submits them again
	 * once it has reaped (engine_progress), with the lock dropped.
	 */
	ring_enter(eng, n, 0);
}

/* Fires after PHX_TICK_NS so that a chunk waiting on a claim is retried. */
void engine_arm_tick(phx_engine *eng)
{
	struct io_uring_sqe *sqe;

	if (eng->tick_armed)
		return;
	sqe = io_uring_get_sqe(&eng->ring);
	if (!sqe)
		return;
	io_uring_prep_timeout(sqe, &eng->tick_ts, 0, 0);
	io_uring_sqe_set_data(sqe, &eng->tick_ts);
	eng->tick_armed = true;
	eng->inflight++;
	eng->unsubmitted++;
}

/* Handle every completion already posted (lock held, reaping role held). */
static unsigned reap_locked(phx_engine *eng)
{
	struct io_uring_cqe *cqes[64];
	unsigned n, i, total = 0;

	do {
		n = io_uring_peek_batch_cqe(&eng->ring, cqes, 64);
		for (i = 0; i < n; i++) {
			void *data = io_uring_cqe_get_data(cqes[i]);
			int res = cqes[i]->res;

			io_uring_cqe_seen(&eng->ring, cqes[i]);
			if (data == &eng->tick_ts) {
				eng->tick_armed = false;
				eng->inflight--;
				continue;
			}
			io_complete_cqe(eng, data, res);
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

	if (io_uring_cq_ready(&eng->ring))
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
	int64_t until;
	int ret;

	if (io_uring_cq_ready(&eng->ring))
		ret = n ? ring_enter(eng, n, 0) : 0;
	else if (!eng->spin_ns)
		ret = ring_enter(eng, n, 1);
	else
		ret = n ? ring_enter(eng, n, 0) : 0;
	if (ret == -EAGAIN || ret == -EBUSY)
		return enter_backoff(eng, ret, in_kernel);
	if (ret < 0 || !eng->spin_ns || io_uring_cq_ready(&eng->ring))
		return ret;
	until = phx_now_ns() + eng->spin_ns;
	do {
		if (io_uring_cq_ready(&eng->ring))
			return 0;
		/* Completions may wait in task work until we enter the kernel. */
		if (IO_URING_READ_ONCE(*eng->ring.sq.kflags) & IORING_SQ_TASKRUN)
			enter_once(eng, 0, 0);
	} while (phx_now_ns() < until);
	return ring_enter(eng, 0, 1);
}


static bool io_is_done(struct phx_io *io)
{
	return __atomic_load_n(&io->done, __ATOMIC_ACQUIRE);
}

/*
 * Make progress until @io is done (or, with @io NULL, until one round of
 * completions was handled), @timeout_ns elapses, or - when !@block - at
 * once.  Returns 0, or -ETIME when the time ran out first.
 */
int engine_progress(phx_engine *eng, struct phx_io *io, int64_t timeout_ns,
		    bool block)
{
	int64_t deadline = timeout_ns >= 0 ? phx_now_ns() + timeout_ns : -1;
	struct io_uring_cqe *cqe;
	int ret = 0;

	pthread_mutex_lock(&eng->lock);
	for (;;) {
		io_fill(eng);
		if (io && io_is_done(io)) {
			engine_submit_locked(eng);
			break;
		}
		/* A future reaper submits as it waits; everyone else now. */
		if (eng->reaping || !block || deadline >= 0 || !eng->inflight)
			engine_submit_locked(eng);
		if (eng->reaping) {
			if (!block)
				break;
			if (deadline < 0) {
				pthread_cond_wait(&eng->cond, &eng->lock);
			} else {
				int64_t left = deadline - phx_now_ns();

				if (left <= 0) {
					ret = -ETIME;
					break;
				}
				phx_cond_wait_ns(&eng->cond, &eng->lock, left);
			}
			if (!io)
				break;
			continue;
		}
		if (!eng->inflight) {
			/* Nothing can complete: either done or blocked on nothing. */
			break;
		}
		eng->reaping = true;
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
					ret = io_uring_wait_cqe_timeout(&eng->ring, &cqe, &kts);
			}
			pthread_mutex_lock(&eng->lock);
		} else if (eng->features & PHX_FEAT_DEFER_TASKRUN) {
			/* Run deferred completion work without waiting. */
			enter_once(eng, 0, 0);
		}
		reap_locked(eng);
		eng->reaping = false;
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

/* ------------------------------------------------------------------------ */
/* Request entry points                                                     */
/* ------------------------------------------------------------------------ */

PHX_EXPORT void phx_io_prep(struct phx_io *io, phx_file *f, enum phx_op op,
			    void *buf, size_t len, uint64_t offset)
{
	memset(io, 0, sizeof(*io));
	io->file = f;
	io->op = op;
	io->buf = buf;
	io->len = len;
	io->offset = offset;
}

/*
 * Start @n requests.  A request that is invalid on its own completes at
 * once with -errno in its result; the others go ahead.
 */
static int submit_locked(phx_engine *eng, struct phx_io *const *ios, size_t n,
			 bool async)
{
	size_t i;
	int ret;

	for (i = 0; i < n; i++)
		if (!ios[i])
			return phx_err(-EINVAL, "request %zu is NULL", i);
	for (i = 0; i < n; i++) {
		ret = io_validate(ios[i]);
		if (!ret && ios[i]->file->eng != eng)
			ret = phx_err(-EINVAL, "request %zu: file belongs to another engine", i);
		if (ret)
			io_fail(eng, ios[i], ret, async);
		else
			io_start(eng, ios[i], async);
	}
	io_fill(eng);
	engine_submit_locked(eng);
	return 0;
}

PHX_EXPORT int phx_submit(phx_engine *eng, struct phx_io *const *ios, size_t n)
{
	int ret;

	if (!eng || (!ios && n))
		return phx_err(-EINVAL, "phx_submit: NULL argument");
	ret = engine_thread_check(eng);
	if (ret)
		return ret;
	pthread_mutex_lock(&eng->lock);
	ret = submit_locked(eng, ios, n, true);
	pthread_mutex_unlock(&eng->lock);
	return ret;
}

PHX_EXPORT int phx_wait(phx_engine *eng, struct phx_io *io, int64_t timeout_ns)
{
	int ret;

	if (!eng || !io)
		return phx_err(-EINVAL, "phx_wait: NULL argument");
	ret = engine_thread_check(eng);
	if (ret)
		return ret;
	while (!io_is_done(io)) {
		ret = engine_progress(eng, io, timeout_ns, true);
		if (ret == -ETIME && !io_is_done(io))
			return phx_err(-ETIME, "request not complete within the timeout");
	}
	/* A waited-on request is not handed back by phx_poll(). */
	pthread_mutex_lock(&eng->lock);
	if (io_priv(io)->pollable) {
		struct phx_io **pp = &eng->poll_head, *prev = NULL;

		while (*pp && *pp != io) {
			prev = *pp;
			pp = &io_priv(*pp)->next;
		}
		if (*pp) {
			*pp = io_priv(io)->next;
			if (eng->poll_tail == io)
				eng->poll_tail = prev;
		}
		io_priv(io)->pollable = 0;
	}
	pthread_mutex_unlock(&eng->lock);
	return 0;
}

PHX_EXPORT int phx_submit_wait(phx_engine *eng, struct phx_io *ios, size_t n)
{
	struct phx_io *small[64] = { NULL }, **v = small;
	size_t i;
	int ret;

	if (!eng || (!ios && n))
		return phx_err(-EINVAL, "phx_submit_wait: NULL argument");
	ret = engine_thread_check(eng);
	if (ret)
		return ret;
	if (!n)
		return 0;
	if (n > 64) {
		v = malloc(n * sizeof(*v));
		if (!v)
			return phx_err(-ENOMEM, "out of memory");
	}
	for (i = 0; i < n; i++)
		v[i] = &ios[i];
	pthread_mutex_lock(&eng->lock);
	ret = submit_locked(eng, v, n, false);
	pthread_mutex_unlock(&eng->lock);
	for (i = 0; !ret && i < n; i++)
		while (!io_is_done(&ios[i]))
			engine_progress(eng, &ios[i], -1, true);
	if (v != small)
		free(v);
	return ret;
}

PHX_EXPORT int phx_poll(phx_engine *eng, struct phx_io **done, size_t max)
{
	size_t n = 0;
	int ret;

	if (!eng)
		return phx_err(-EINVAL, "phx_poll: NULL engine");
	ret = engine_thread_check(eng);
	if (ret)
		return ret;
	engine_progress(eng, NULL, 0, false);
	pthread_mutex_lock(&eng->lock);
	while (n < max && eng->poll_head) {
		struct phx_io *io = eng->poll_head;

		eng->poll_head = io_priv(io)->next;
		if (!eng->poll_head)
			eng->poll_tail = NULL;
		io_priv(io)->pollable = 0;
		done[n++] = io;
	}
	pthread_mutex_unlock(&eng->lock);
	return (int)n;
}

static int64_t sync_io(phx_file *f, enum phx_op op, void *buf, size_t len,
		       uint64_t offset)
{
	struct phx_io io;
	int ret;

	if (!f)
		return phx_err(-EBADF, "no file");
	phx_io_prep(&io, f, op, buf, len, offset);
	ret = phx_submit_wait(f->eng, &io, 1);
	return ret ? ret : io.result;
}

PHX_EXPORT int64_t phx_pread(phx_file *f, void *buf, size_t len, uint64_t offset)
{
	return sync_io(f, PHX_OP_READ, buf, len, offset);
}

PHX_EXPORT int64_t phx_pwrite(phx_file *f, const void *buf, size_t len,
			      uint64_t offset)
{
	return sync_io(f, PHX_OP_WRITE, (void *)buf, len, offset);
}
