// SPDX-License-Identifier: Apache-2.0
/*
 * be_threads.c - the thread-pool backend: where io_uring cannot be had
 * (containers' seccomp profiles refuse io_uring_setup), or when asked for.
 *
 * Device ops queue on the engine (under eng->lock) and a pool of workers
 * runs each as one blocking preadv2/pwritev2 (sync_file_range,
 * posix_fadvise for the partial-block flush) on the same O_DIRECT
 * descriptors and memory io_uring would use.  The worker that ran an op
 * also completes it: it takes the lock, hands the result to io.c exactly
 * as a CQE would be (io_complete_op: short transfers continued, bounce
 * copies, read-modify-write halves, claims released), cuts the next chunks
 * (io_fill) and wakes the waiters.  So requests move on with nobody
 * waiting, as they do in the kernel with io_uring, and every rule of io.c
 * (alignment, bounce, short I/O, write claims, counters) holds unchanged.
 *
 * One worker starts with the engine, more whenever an op is queued and no
 * idle one can take it, up to io_threads (default: the queue depth, at
 * most 64): as many blocking calls in flight as io_uring would have
 * requests in the device - of small ops: big ones run only as many at once
 * as fit in THREADS_BUSY_BYTES.  They
 * block every signal (a caller's handlers run in the caller's threads)
 * and live until the engine is destroyed.  They are not copied by fork():
 * in a child the parent's engine can only be destroyed (its progress
 * fails with -ECHILD).
 */
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

#include "internal.h"

#define THREADS_DEFAULT_MAX 64u
/*
 * Bytes the workers move at once: beyond one op, no more ops run than fit
 * in this.  On the 2-core box's zram, 32 workers each copying 1 MiB (QD 32)
 * ran at 0.77x io_uring, and 1.08x with this cap (8 at once); 4 KiB ops
 * still run 32 at once, which the virtio disk's random IOPS need (8 workers
 * gave 0.69x of 32).  Three 1.5 s runs each, medians, a busy machine
 * (docs/bench-io.md, "Thread-pool engine").
 */
#define THREADS_BUSY_BYTES (8ull << 20)
/* A worker's stack: it calls one syscall and io.c's completion. */
#define THREADS_STACK (256u << 10)

static int threads_probe(char *why, size_t n)
{
	snprintf(why, n, "preadv2/pwritev2 on a pool of threads: always available");
	return 0;
}

/* ------------------------------------------------------------------------ */
/* Workers                                                                  */
/* ------------------------------------------------------------------------ */

/* One device op, blocking; bytes moved or -errno, as a CQE's res. */
static int op_run(const struct devop *d)
{
	struct iovec iov = { .iov_base = d->mem, .iov_len = d->len };
	ssize_t r;
	int ret;

	switch (d->kind) {
	case DOP_READ:
		r = preadv2(d->fd, &iov, 1, (off_t)d->off, 0);
		break;
	case DOP_WRITE:
		r = pwritev2(d->fd, &iov, 1, (off_t)d->off, 0);
		break;
	case DOP_SYNC_RANGE:
		r = sync_file_range(d->fd, (off_t)d->off, (off_t)d->len,
				    SYNC_FILE_RANGE_WAIT_BEFORE | SYNC_FILE_RANGE_WRITE |
				    SYNC_FILE_RANGE_WAIT_AFTER);
		break;
	default:
		/* posix_fadvise returns the error number itself */
		ret = posix_fadvise(d->fd, (off_t)d->off, (off_t)d->len, POSIX_FADV_DONTNEED);
		return -ret;
	}
	/* io_uring ignores the offset of a pipe or socket (a stream): so do we */
	if (r < 0 && errno == ESPIPE && (d->kind == DOP_READ || d->kind == DOP_WRITE))
		r = d->kind == DOP_READ ? readv(d->fd, &iov, 1) : writev(d->fd, &iov, 1);
	return r < 0 ? -errno : (int)r;
}

/* Bytes an op moves through memory (a flush or fadvise range moves none). */
static uint64_t op_bytes(const struct chunk *c)
{
	return c->dop.kind == DOP_READ || c->dop.kind == DOP_WRITE ? c->dop.len : 0;
}

/* May the head op run now, beside what runs (lock held)? */
static bool op_may_run(const struct be_threads_state *t)
{
	const struct chunk *c = t->head;

	return c && (!t->busy_bytes || t->busy_bytes + op_bytes(c) <= THREADS_BUSY_BYTES);
}

static struct chunk *op_pop(struct be_threads_state *t)
{
	struct chunk *c = t->head;

	if (c) {
		t->head = c->next_op;
		if (!t->head)
			t->tail = NULL;
		c->next_op = NULL;
	}
	return c;
}

/*
 * The head op for this worker, or NULL (lock held); wakes one more idle
 * worker when the next op may run too, so that a burst fans out.
 */
static struct chunk *op_take(struct be_threads_state *t)
{
	struct chunk *c;

	if (!op_may_run(t))
		return NULL;
	c = op_pop(t);
	t->busy_bytes += op_bytes(c);
	if (op_may_run(t) && t->idle > t->woken) {
		t->woken++;
		pthread_cond_signal(&t->work);
	}
	return c;
}

static void handover(phx_engine *eng, uint32_t mine);

/* Requests finished so far: waiters need waking only when it moves. */
static uint64_t finished(const phx_engine *eng)
{
	return eng->st.reads + eng->st.writes + eng->st.errors;
}

/*
 * After an op or a tick (lock held): cut what can go next, hand it over
 * (the first op is this worker's next), and wake the waiters if a request
 * finished or nothing is left in flight (what phx_engine_destroy waits
 * for).  Waking them for every op cost a context switch per 4 KiB read.
 */
static void worker_after(phx_engine *eng, uint64_t before)
{
	io_fill(eng);
	handover(eng, 1);
	if (finished(eng) != before || !eng->inflight)
		pthread_cond_broadcast(&eng->cond);
}

/* The claim-retry tick: what io_uring's timeout SQE does (io.c, io_fill). */
static void worker_tick(phx_engine *eng)
{
	struct timespec ts = { 0, PHX_TICK_NS };
	uint64_t before;

	pthread_mutex_unlock(&eng->lock);
	nanosleep(&ts, NULL);
	pthread_mutex_lock(&eng->lock);
	before = finished(eng);
	eng->tick_armed = false;
	eng->inflight--;
	worker_after(eng, before);
}

static void *worker_main(void *arg)
{
	phx_engine *eng = arg;
	struct be_threads_state *t = &eng->u.threads;
	struct chunk *c;
	struct devop d;
	uint64_t before;
	int res;

	pthread_mutex_lock(&eng->lock);
	for (;;) {
		if (t->tick_queued) {
			t->tick_queued = false;
			worker_tick(eng);
			continue;
		}
		c = op_take(t);
		if (!c) {
			if (t->stop && !t->head)
				break;
			t->idle++;
			pthread_cond_wait(&t->work, &eng->lock);
			t->idle--;
			/* a wake-up is one handover() counted (or spurious: then
			 * handover() under-counts the idle, costing only overlap) */
			if (t->woken)
				t->woken--;
			continue;
		}
		d = c->dop;
		pthread_mutex_unlock(&eng->lock);
		res = op_run(&d);
		pthread_mutex_lock(&eng->lock);
		t->busy_bytes -= d.kind == DOP_READ || d.kind == DOP_WRITE ? d.len : 0;
		before = finished(eng);
		io_complete_op(eng, c, res);
		worker_after(eng, before);
	}
	pthread_mutex_unlock(&eng->lock);
	return NULL;
}

/* One more worker, with every signal blocked (lock held); -errno. */
static int worker_start(phx_engine *eng)
{
	struct be_threads_state *t = &eng->u.threads;
	sigset_t all, old;
	pthread_attr_t attr;
	int ret;

	sigfillset(&all);
	pthread_attr_init(&attr);
	pthread_attr_setstacksize(&attr, THREADS_STACK);
	pthread_sigmask(SIG_SETMASK, &all, &old);
	ret = pthread_create(&t->tids[t->nthreads], &attr, worker_main, eng);
	pthread_sigmask(SIG_SETMASK, &old, NULL);
	pthread_attr_destroy(&attr);
	if (ret)
		return -ret;
	t->nthreads++;
	return 0;
}

/* ------------------------------------------------------------------------ */
/* The backend                                                              */
/* ------------------------------------------------------------------------ */

static void threads_queue(phx_engine *eng, struct chunk *c)
{
	struct be_threads_state *t = &eng->u.threads;

	c->next_op = NULL;
	if (t->tail)
		t->tail->next_op = c;
	else
		t->head = c;
	t->tail = c;
	t->fresh++;
}

/*
 * Hand fresh ops over (lock held): wake an idle worker for each, and start
 * workers (up to the maximum) for those no idle one can take.  @mine ops
 * are the caller's own: a worker that just finished takes the next itself.
 * A worker that cannot be started leaves its op to the ones there are (at
 * least one: threads_setup starts it).
 */
static void handover(phx_engine *eng, uint32_t mine)
{
	struct be_threads_state *t = &eng->u.threads;
	uint32_t want = t->fresh + (t->tick_queued ? 1 : 0), avail, wake;

	if (!want)
		return;
	eng->st.submits++;
	t->fresh = 0;
	want = want > mine ? want - mine : 0;
	avail = t->idle > t->woken ? t->idle - t->woken : 0;
	wake = want < avail ? want : avail;
	t->woken += wake;
	want -= wake;
	while (wake--)
		pthread_cond_signal(&t->work);
	while (want-- && t->nthreads < t->max && !worker_start(eng))
		;
}

static void threads_submit(phx_engine *eng)
{
	handover(eng, 0);
}

static void threads_arm_tick(phx_engine *eng)
{
	if (eng->tick_armed)
		return;
	eng->tick_armed = true;
	eng->u.threads.tick_queued = true;
	eng->inflight++;
}

static bool io_is_done(struct phx_io *io)
{
	return __atomic_load_n(&io->done, __ATOMIC_ACQUIRE);
}

/*
 * An op of @io for the thread that waits for @io, or NULL (lock held): the
 * first queued one that may run now.  Only @io's: another request's op
 * might block (a FIFO) after @io is done.
 */
static struct chunk *op_take_mine(struct be_threads_state *t, struct phx_io *io)
{
	struct chunk **pp, *c, *prev = NULL;

	for (pp = &t->head; (c = *pp); prev = c, pp = &c->next_op) {
		if (c->io != io)
			continue;
		if (t->busy_bytes && t->busy_bytes + op_bytes(c) > THREADS_BUSY_BYTES)
			return NULL;
		*pp = c->next_op;
		if (t->tail == c)
			t->tail = prev;
		c->next_op = NULL;
		t->busy_bytes += op_bytes(c);
		return c;
	}
	return NULL;
}

/* Run @c in the calling thread and complete it (lock held, dropped meanwhile). */
static void op_run_here(phx_engine *eng, struct chunk *c)
{
	struct be_threads_state *t = &eng->u.threads;
	struct devop d = c->dop;
	uint64_t before;
	int res;

	pthread_mutex_unlock(&eng->lock);
	res = op_run(&d);
	pthread_mutex_lock(&eng->lock);
	t->busy_bytes -= d.kind == DOP_READ || d.kind == DOP_WRITE ? d.len : 0;
	before = finished(eng);
	io_complete_op(eng, c, res);
	io_fill(eng);
	handover(eng, 0);
	if (finished(eng) != before || !eng->inflight)
		pthread_cond_broadcast(&eng->cond);
}

/*
 * Workers complete ops themselves: a caller only waits for them to say so
 * (eng->cond), after cutting and handing over what it can.  A caller that
 * would wait without a deadline for @io runs @io's queued ops itself
 * instead (the worker woken for it finds nothing): one 1 MiB read at QD 1
 * then costs no hand-over to a worker and back.  With a deadline it only
 * waits: an op cannot be left half-way when the time is up.
 */
static int threads_progress(phx_engine *eng, struct phx_io *io, int64_t timeout_ns,
			    bool block)
{
	int64_t deadline = timeout_ns >= 0 ? phx_now_ns() + timeout_ns : -1;
	struct chunk *c;
	int ret = 0;

	if (eng->pid != getpid())
		return phx_err(-ECHILD, "this engine was created by process %d: its I/O threads are not in this forked child (make an engine here)",
			       (int)eng->pid);
	pthread_mutex_lock(&eng->lock);
	for (;;) {
		io_fill(eng);
		threads_submit(eng);
		if ((io && io_is_done(io)) || !block || !eng->inflight)
			break;
		if (deadline < 0 && io && (c = op_take_mine(&eng->u.threads, io))) {
			op_run_here(eng, c);
			continue;
		}
		ret = phx_cond_wait_until(&eng->cond, &eng->lock, deadline);
		if (ret || !io)
			break;
	}
	if (ret == -ETIME && io && io_is_done(io))
		ret = 0;
	pthread_mutex_unlock(&eng->lock);
	return ret;
}

static int threads_setup(phx_engine *eng)
{
	struct be_threads_state *t = &eng->u.threads;
	int ret;

	memset(t, 0, sizeof(*t));
	t->max = eng->cfg.io_threads;
	if (!t->max)
		t->max = eng->cfg.queue_depth < THREADS_DEFAULT_MAX ?
			eng->cfg.queue_depth : THREADS_DEFAULT_MAX;
	t->tids = calloc(t->max, sizeof(*t->tids));
	if (!t->tids)
		return phx_err(-ENOMEM, "out of memory");
	pthread_cond_init(&t->work, NULL);
	/* one worker now, so that every queued op has one to run it */
	ret = worker_start(eng);
	if (ret) {
		pthread_cond_destroy(&t->work);
		free(t->tids);
		return phx_err(ret, "cannot start an I/O thread");
	}
	/* registration is kept and checked (engine.c) but fixes nothing here */
	eng->features |= PHX_FEAT_USER_BUFS;
	return 0;
}

/* Nothing is in flight any more (phx_engine_destroy drained the engine). */
static void threads_teardown(phx_engine *eng)
{
	struct be_threads_state *t = &eng->u.threads;
	uint32_t i;

	if (eng->pid && eng->pid != getpid()) {
		/* fork()'s copy: the workers (and waiters on t->work) are the parent's */
		free(t->tids);
		t->tids = NULL;
		return;
	}
	pthread_mutex_lock(&eng->lock);
	t->stop = true;
	pthread_cond_broadcast(&t->work);
	pthread_mutex_unlock(&eng->lock);
	for (i = 0; i < t->nthreads; i++)
		pthread_join(t->tids[i], NULL);
	pthread_cond_destroy(&t->work);
	free(t->tids);
	t->tids = NULL;
	t->nthreads = 0;
}

/* Async completions write the eventfd from io.c (engine_notify): no more to do. */
static int threads_eventfd(phx_engine *eng, int fd)
{
	return 0;
}

static int threads_buf_update(phx_engine *eng, int index, void *addr, size_t len)
{
	return 0;
}

static int threads_file_update(phx_engine *eng, int slot, int fd)
{
	return -EOPNOTSUPP;
}

const struct phx_backend be_threads = {
	.name = "threads",
	.desc = "a pool of threads calling preadv2/pwritev2 (no io_uring needed)",
	.probe = threads_probe,
	.setup = threads_setup,
	.teardown = threads_teardown,
	.queue = threads_queue,
	.submit = threads_submit,
	.arm_tick = threads_arm_tick,
	.progress = threads_progress,
	.eventfd = threads_eventfd,
	.buf_update = threads_buf_update,
	.file_update = threads_file_update,
};
