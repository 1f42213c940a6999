// SPDX-License-Identifier: Apache-2.0
/*
 * be_threads.c - the thread-pool backend: where io_uring cannot be had
 * (containers' seccomp profiles refuse io_uring_setup), or when asked for.
 *
 * Device ops queue on the engine (under eng->lock) and a pool of workers
 * runs each as one blocking preadv2/pwritev2 (sync_file_range,
 * posix_fadvise for the partial-block flush) on the same O_DIRECT
 * descriptors and memory io_uring would use.  The thread that ran an op
 * also completes it: it takes the lock, hands the result to io.c exactly
 * as a CQE would be (io_complete_op: short transfers continued, bounce
 * copies, read-modify-write halves, claims released), cuts the next chunks
 * (io_fill) and wakes the waiters whose request is done.  So requests move
 * on with nobody waiting, as they do in the kernel with io_uring, and
 * every rule of io.c (alignment, bounce, short I/O, write claims,
 * counters) holds unchanged.
 *
 * What a hand-off costs decides the speed on RAM-speed devices, where an
 * op is a copy of a few microseconds that io_uring runs inline in the
 * submitting thread: waking a thread costs as much as the op.  So
 *   - a caller that waits (no deadline) runs queued ops itself, as a
 *     worker would, and wakes workers only for the ops it does not take:
 *     at QD 1 no op leaves the caller's thread;
 *   - a thread that completes an op takes the next one itself;
 *   - a waiter is woken when its own request is done, not at every
 *     request's end (phx_submit_wait waits for a batch's last request);
 *   - contiguous reads queued together run as one preadv2 (a run): what
 *     the block layer's merging gives io_uring's batched submissions;
 *   - ops that keep a CPU busy (they never sleep: zram, the page cache)
 *     run at most one per CPU at once; those that wait for a device run
 *     as many at once as the queue depth has.
 *
 * Workers: one starts with the engine, more whenever an op is queued and
 * no idle one can take it, up to io_threads (default: the queue depth, at
 * most 64): as many blocking calls in flight as io_uring would have
 * requests in the device - of small ops: big ones run only as many at once
 * as fit in THREADS_BUSY_BYTES.  They block every signal (a caller's
 * handlers run in the caller's threads) and live until the engine is
 * destroyed.  They are not copied by fork(): in a child the parent's
 * engine can only be destroyed (its progress fails with -ECHILD).
 */
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
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
/* A worker's stack: it calls one syscall and io.c's completion (and holds
 * a run's iovecs and results). */
#define THREADS_STACK (256u << 10)
/*
 * A run (contiguous reads as one preadv2; threads_queue): at most this
 * many ops and bytes, and on a device that sleeps at most the queue depth
 * / THREADS_RUN_SPREAD ops (run_ops_max).  Sequential 4 KiB reads at QD 32
 * on the virtio disk: 32 requests of 4 KiB without runs, io_uring's merged
 * to ~16 KiB; runs of 8 ops gave 184k IOPS, of 32 (one request in flight)
 * 106k, of 1 73k, io_uring 140k (3 runs of 1 s each, load average 6).
 */
#define THREADS_RUN_OPS 64u
#define THREADS_RUN_BYTES (128u << 10)
#define THREADS_RUN_SPREAD 4u
/*
 * Every THREADS_SAMPLE_EVERY-th run is checked for a voluntary sleep
 * (runs_cpu_bound): two getrusage calls, under 1 % of a 4 KiB zram read
 * spread over eight.  The score saturates at +-THREADS_SAMPLE_RANGE so
 * that it turns within a few samples when the device's kind changes.
 */
#define THREADS_SAMPLE_EVERY 8u
#define THREADS_SAMPLE_RANGE 4

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

/*
 * Several contiguous reads of one file, run as one preadv2 (lock dropped):
 * each op's result into @res, as its own call would give it.  Whole ops
 * the one call filled are theirs; from the first op it did not fill (end
 * of file, an error), each runs again by itself, so that every short read
 * and -errno is exactly the one that op alone gets.  Reads only: running a
 * read again changes nothing.
 */
static void run_ops(struct chunk *const *ops, uint32_t n, int *res)
{
	struct iovec iov[THREADS_RUN_OPS];
	ssize_t r = -1;
	uint32_t i;

	if (n > 1) {
		for (i = 0; i < n; i++) {
			iov[i].iov_base = ops[i]->dop.mem;
			iov[i].iov_len = ops[i]->dop.len;
		}
		r = preadv2(ops[0]->dop.fd, iov, (int)n, (off_t)ops[0]->dop.off, 0);
	}
	for (i = 0; i < n; i++) {
		if (r >= 0 && (uint64_t)r >= ops[i]->dop.len) {
			res[i] = (int)ops[i]->dop.len;
			r -= (ssize_t)ops[i]->dop.len;
		} else {
			r = -1;
			res[i] = op_run(&ops[i]->dop);
		}
	}
}

/* Bytes an op moves through memory (a flush or fadvise range moves none). */
static uint64_t op_bytes(const struct chunk *c)
{
	return c->dop.kind == DOP_READ || c->dop.kind == DOP_WRITE ? c->dop.len : 0;
}

/*
 * Do the device's ops keep the CPU busy (lock held)?  A read from zram or
 * the page cache is a copy that never sleeps: more of them at once than
 * CPUs only adds switching and lock contention (zram's per-CPU streams).
 * A disk's op sleeps until the device answers: those need the depth.
 */
static bool runs_cpu_bound(const struct be_threads_state *t)
{
	return t->sleep_score < 0;
}

/* May queue entry @c (a run) run now, beside what runs (lock held)? */
static bool run_may_run(const struct be_threads_state *t, const struct chunk *c)
{
	if (!t->runs)
		return true;
	if (runs_cpu_bound(t) && t->runs >= t->ncpu)
		return false;
	return !t->busy_bytes || t->busy_bytes + c->run_bytes <= THREADS_BUSY_BYTES;
}

/* Take queue entry @c, whose link is *@pp and predecessor @prev (lock held). */
static struct chunk *run_unlink(struct be_threads_state *t, struct chunk **pp,
				struct chunk *c, struct chunk *prev)
{
	*pp = c->next_op;
	if (t->tail == c)
		t->tail = prev;
	c->next_op = NULL;
	t->busy_bytes += c->run_bytes;
	t->runs++;
	return c;
}

/*
 * The head run for this worker, or NULL (lock held); wakes one more idle
 * worker when the next run may go too, so that a burst fans out.
 */
static struct chunk *op_take(struct be_threads_state *t)
{
	struct chunk *c = t->head;

	if (!c || !run_may_run(t, c))
		return NULL;
	run_unlink(t, &t->head, c, NULL);
	if (t->head && run_may_run(t, t->head) && t->idle > t->woken) {
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

static bool io_is_done(struct phx_io *io)
{
	return __atomic_load_n(&io->done, __ATOMIC_ACQUIRE);
}

/*
 * Wake the callers asleep in threads_progress whose wait is over (lock
 * held): the request they wait for is done, or (those waiting for no
 * request in particular) some request finished, or nothing is in flight.
 * Only those: waking a caller for every request cost a context switch per
 * 4 KiB read, where it waits for the last of a batch (phx_submit_wait).
 */
static void waiters_wake(phx_engine *eng, uint64_t before)
{
	struct threads_waiter *w;
	bool moved = finished(eng) != before;

	for (w = eng->u.threads.waiters; w; w = w->next) {
		if (w->io ? io_is_done(w->io) : moved || !eng->inflight) {
			pthread_cond_broadcast(&eng->cond);
			return;
		}
	}
}

/* After an op or a tick (lock held): cut what can go next, hand it over
 * (the first op is this worker's next), wake whoever's wait is over. */
static void worker_after(phx_engine *eng, uint64_t before)
{
	io_fill(eng);
	handover(eng, 1);
	waiters_wake(eng, before);
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

/*
 * A sampled run slept (waited for its device) or not (lock held): the
 * score moves towards the recent ops' kind, in a range that lets it turn
 * after a few samples when the engine moves to another device.
 */
static void sleep_note(struct be_threads_state *t, bool slept)
{
	if (slept && t->sleep_score < THREADS_SAMPLE_RANGE)
		t->sleep_score++;
	else if (!slept && t->sleep_score > -THREADS_SAMPLE_RANGE)
		t->sleep_score--;
}

/*
 * run_ops, watched for a voluntary sleep when @sample (lock dropped):
 * 1 when the thread slept in it, 0 when not, -1 when not watched.
 */
static int run_watched(struct chunk *const *ops, uint32_t n, int *res, bool sample)
{
	struct rusage r0, r1;

	if (!sample || getrusage(RUSAGE_THREAD, &r0)) {
		run_ops(ops, n, res);
		return -1;
	}
	run_ops(ops, n, res);
	if (getrusage(RUSAGE_THREAD, &r1))
		return -1;
	return r1.ru_nvcsw != r0.ru_nvcsw;
}

/*
 * Run the run @head with the lock dropped and complete its ops (lock
 * held): what CQEs' arrival does; the caller cuts and hands over what
 * follows.  @before: requests finished before the completions.
 */
static void run_complete(phx_engine *eng, struct chunk *head, uint64_t *before)
{
	struct be_threads_state *t = &eng->u.threads;
	struct chunk *ops[THREADS_RUN_OPS], *c;
	int res[THREADS_RUN_OPS], slept;
	uint64_t bytes = head->run_bytes;
	bool sample = ++t->sample_tick >= THREADS_SAMPLE_EVERY;
	uint32_t n = 0, i;

	/* collected first: a completion may queue the chunk again */
	for (c = head; c; c = c->run_next)
		ops[n++] = c;
	if (sample)
		t->sample_tick = 0;
	pthread_mutex_unlock(&eng->lock);
	slept = run_watched(ops, n, res, sample);
	pthread_mutex_lock(&eng->lock);
	if (slept >= 0)
		sleep_note(t, slept);
	t->busy_bytes -= bytes;
	t->runs--;
	*before = finished(eng);
	for (i = 0; i < n; i++)
		io_complete_op(eng, ops[i], res[i]);
}

static void *worker_main(void *arg)
{
	phx_engine *eng = arg;
	struct be_threads_state *t = &eng->u.threads;
	struct chunk *c;
	uint64_t before;

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
		t->running++;
		run_complete(eng, c, &before);
		t->running--;
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

/*
 * Most ops in a run (lock held).  Ops that keep the CPU busy gain from the
 * longest runs (fewer calls); a device gains from a few requests in flight
 * as much as from bigger ones, so the queue depth is cut into
 * THREADS_RUN_SPREAD runs or more (io_uring's 4-SQE submissions let the
 * block layer merge about as many).
 */
static uint32_t run_ops_max(const phx_engine *eng)
{
	uint32_t n = eng->cfg.queue_depth / THREADS_RUN_SPREAD;

	if (runs_cpu_bound(&eng->u.threads))
		return THREADS_RUN_OPS;
	return n < 1 ? 1 : n < THREADS_RUN_OPS ? n : THREADS_RUN_OPS;
}

/*
 * May @c join the run at the queue's tail (lock held)?  Reads of a regular
 * file or block device that continue it: one preadv2 then moves them all,
 * as io_uring's batched submissions let the block layer merge sequential
 * 4 KiB reads into bigger requests (independent preadv2 calls are never
 * merged).  A run grows only while no worker has taken it: ops queued one
 * at a time still go one at a time.
 */
static bool run_joins(const phx_engine *eng, const struct chunk *c)
{
	const struct be_threads_state *t = &eng->u.threads;
	const struct chunk *h = t->tail, *l;

	if (!h || c->dop.kind != DOP_READ || !c->io->file->bounded)
		return false;
	l = h->run_last;
	return l->dop.kind == DOP_READ && l->dop.fd == c->dop.fd &&
	       l->dop.off + l->dop.len == c->dop.off && h->run_n < run_ops_max(eng) &&
	       h->run_bytes + c->dop.len <= THREADS_RUN_BYTES;
}

static void threads_queue(phx_engine *eng, struct chunk *c)
{
	struct be_threads_state *t = &eng->u.threads;

	c->next_op = NULL;
	c->run_next = NULL;
	if (run_joins(eng, c)) {
		t->tail->run_last->run_next = c;
		t->tail->run_last = c;
		t->tail->run_n++;
		t->tail->run_bytes += c->dop.len;
		return;
	}
	c->run_last = c;
	c->run_n = 1;
	c->run_bytes = op_bytes(c);
	if (t->tail)
		t->tail->next_op = c;
	else
		t->head = c;
	t->tail = c;
	t->fresh++;
}

/* Wake an idle worker, or start one; false when neither can be had. */
static bool worker_call(phx_engine *eng)
{
	struct be_threads_state *t = &eng->u.threads;

	if (t->idle > t->woken) {
		t->woken++;
		pthread_cond_signal(&t->work);
		return true;
	}
	return t->nthreads < t->max && !worker_start(eng);
}

/*
 * Hand fresh ops over (lock held): wake an idle worker for each, and start
 * workers (up to the maximum) for those no idle one can take.  @mine ops
 * are the caller's own: a thread that goes on to run one takes it itself.
 * A worker that cannot be started leaves its op to the ones there are (at
 * least one: threads_setup starts it).  With nothing of its own to run
 * (@mine 0), the caller also makes sure that queued ops have a worker
 * running or on its way: an op held back by THREADS_BUSY_BYTES behind one
 * that the caller ran itself would otherwise wait for the next hand-over.
 */
static void handover(phx_engine *eng, uint32_t mine)
{
	struct be_threads_state *t = &eng->u.threads;
	uint32_t want = t->fresh + (t->tick_queued ? 1 : 0);

	if (want) {
		eng->st.submits++;
		t->fresh = 0;
	}
	want = want > mine ? want - mine : 0;
	while (want && worker_call(eng))
		want--;
	if (!mine && (t->head || t->tick_queued) && !t->running && !t->woken)
		worker_call(eng);
}

static void threads_submit(phx_engine *eng)
{
	handover(eng, 0);
	/* io_fill may have ended a request (an error, end of file) */
	waiters_wake(eng, finished(eng));
}

static void threads_arm_tick(phx_engine *eng)
{
	if (eng->tick_armed)
		return;
	eng->tick_armed = true;
	eng->u.threads.tick_queued = true;
	eng->inflight++;
}

/*
 * A queued op that a caller waiting for @io may run itself, or NULL (lock
 * held): the first of @io's, or of any file whose ops end by themselves
 * (f->bounded) - not another request's op on a FIFO, which might wait for
 * a writer long after @io is done.  Ops held back by THREADS_BUSY_BYTES
 * stay queued.
 */
static struct chunk *op_take_helper(struct be_threads_state *t, struct phx_io *io)
{
	struct chunk **pp, *c, *prev = NULL;

	for (pp = &t->head; (c = *pp); prev = c, pp = &c->next_op) {
		if (c->io != io && !c->io->file->bounded)
			continue;
		return run_may_run(t, c) ? run_unlink(t, pp, c, prev) : NULL;
	}
	return NULL;
}

/* Sleep on eng->cond until waiters_wake says so, or @deadline (lock held). */
static int waiter_sleep(phx_engine *eng, struct phx_io *io, int64_t deadline)
{
	struct be_threads_state *t = &eng->u.threads;
	struct threads_waiter w = { .io = io, .next = t->waiters }, **pp;
	int ret;

	t->waiters = &w;
	ret = phx_cond_wait_until(&eng->cond, &eng->lock, deadline);
	for (pp = &t->waiters; *pp != &w; pp = &(*pp)->next)
		;
	*pp = w.next;
	return ret;
}

/*
 * Workers complete ops themselves: a caller only waits for them to say so
 * (waiters_wake), after cutting and handing over what it can.  A caller
 * that would wait without a deadline for @io runs queued ops itself
 * instead, as a worker would (op_take_helper), and hands over only what it
 * does not run: at QD 1 no op then goes to a worker and back, and at any
 * depth the caller, which io_uring would keep busy submitting and reaping,
 * moves data instead of sleeping.  With a deadline it only waits: an op
 * cannot be left half-way when the time is up.
 */
static int threads_progress(phx_engine *eng, struct phx_io *io, int64_t timeout_ns,
			    bool block)
{
	int64_t deadline = timeout_ns >= 0 ? phx_now_ns() + timeout_ns : -1;
	struct chunk *c;
	uint64_t before;
	int ret = 0;

	if (eng->pid != getpid())
		return phx_err(-ECHILD, "this engine was created by process %d: its I/O threads are not in this forked child (make an engine here)",
			       (int)eng->pid);
	pthread_mutex_lock(&eng->lock);
	for (;;) {
		io_fill(eng);
		if ((io && io_is_done(io)) || !block || !eng->inflight) {
			handover(eng, 0);
			break;
		}
		if (deadline < 0 && io && (c = op_take_helper(&eng->u.threads, io))) {
			handover(eng, 1);
			run_complete(eng, c, &before);
			waiters_wake(eng, before);
			continue;
		}
		handover(eng, 0);
		ret = waiter_sleep(eng, io, deadline);
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
	t->ncpu = phx_cpus_usable();
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
