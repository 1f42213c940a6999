// SPDX-License-Identifier: Apache-2.0
/*
 * cuda_poller.c - floor 3: the poller, which watches stream ops' progress.
 *
 * Every stream op queued writes words into pinned memory as its stream
 * passes it (cuda_stream.c): its arrival, and after each round's kernel the
 * round's number.  The poller reads them - plain loads, no CUDA call, so no
 * device-synchronising call elsewhere can hold it up - and acts at once:
 * an arrival has its arguments read and checked and its early pieces
 * judged right here (st_arrived), so an op whose bytes are staged already
 * goes to the GPU without waking any other thread; a done round frees its
 * buffer; the last word releases the op.
 *
 * It spins while there is progress (an op's round trip through it is a few
 * microseconds: a stream waiting for a flag waits for this thread), then
 * sleeps in growing naps, up to NAP_MAX_US, while ops are queued whose
 * streams are busy elsewhere, and on its eventfd when none is queued.  A
 * dead context (c->dead, set by the copier's health check) ends every op.
 */
#include <errno.h>
#include <poll.h>
#include <sched.h>
#include <stdlib.h>
#include <sys/eventfd.h>
#include <sys/prctl.h>
#include <time.h>

#include "cuda_internal.h"

#define SPIN_US 200		/* spin this long after the last progress */
#define NAP_MAX_US 50		/* then nap, at most this long at a time */

/*
 * Live stream ops, by stream, in the order they were queued.  A stream
 * reaches its ops in that order, so each pass looks for arrivals at the
 * first few not yet arrived of each stream only (a deep queue costs nothing
 * per pass); every FULL_SCAN_NS all of them are looked at, in case two
 * threads queued on one stream in the other order than they told us, or a
 * destroyed stream's handle came back for a new one.
 */
#define PEEK 4
#define FULL_SCAN_NS 1000000

struct pstream {
	CUstream s;
	struct cu_req *head, *tail;
};

struct poller {
	phx_cuda *c;
	struct pstream *g;
	uint32_t ng, capg;
	int64_t last_full;
};

static struct pstream *group_of(struct poller *p, CUstream s)
{
	uint32_t i;

	for (i = 0; i < p->ng; i++)
		if (p->g[i].s == s)
			return &p->g[i];
	if (p->ng == p->capg) {
		uint32_t cap = p->capg ? p->capg * 2 : 16;
		struct pstream *ng = realloc(p->g, cap * sizeof(*ng));

		if (!ng)
			return NULL;
		p->g = ng;
		p->capg = cap;
	}
	p->g[p->ng] = (struct pstream){ .s = s };
	return &p->g[p->ng++];
}

static void list_add(struct pstream *g, struct cu_req *rq)
{
	rq->p_next = NULL;
	rq->p_prev = g->tail;
	if (g->tail)
		g->tail->p_next = rq;
	else
		g->head = rq;
	g->tail = rq;
}

static void list_del(struct pstream *g, struct cu_req *rq)
{
	if (rq->p_prev)
		rq->p_prev->p_next = rq->p_next;
	else
		g->head = rq->p_next;
	if (rq->p_next)
		rq->p_next->p_prev = rq->p_prev;
	else
		g->tail = rq->p_prev;
	rq->p_next = rq->p_prev = NULL;
}

/* The ops queued since the last look, oldest first. */
static void take_incoming(struct poller *p)
{
	phx_cuda *c = p->c;
	struct cu_req *rq, *next, *rev = NULL;

	pthread_mutex_lock(&c->lock);
	rq = c->p_incoming;
	c->p_incoming = NULL;
	pthread_mutex_unlock(&c->lock);
	for (; rq; rq = next) {		/* pushed newest first: reverse */
		next = rq->p_next;
		rq->p_next = rev;
		rev = rq;
	}
	for (rq = rev; rq; rq = next) {
		struct pstream *g = group_of(p, rq->stream);

		next = rq->p_next;
		if (!g && !p->ng) {
			/* no memory for even one group: look again next pass */
			pthread_mutex_lock(&c->lock);
			rq->p_next = c->p_incoming;
			c->p_incoming = rq;
			pthread_mutex_unlock(&c->lock);
			continue;
		}
		/* no memory for a group: the first one takes it, still watched (full scans) */
		list_add(g ? g : &p->g[0], rq);
	}
}

/* The op leaves the list for good: the stream is past it (or never will be). */
static void op_end(struct poller *p, struct pstream *g, struct cu_req *rq)
{
	list_del(g, rq);
	__atomic_sub_fetch(&p->c->stream_live, 1, __ATOMIC_ACQ_REL);
	st_final(rq);
}

/* One look at an arrived op's words; true when something happened. */
static bool op_progress(struct poller *p, struct pstream *g, struct cu_req *rq)
{
	uint32_t done = st_words_done(rq), kd;
	bool any = false;

	kd = rq->orphan ? rq->orphan_rounds : rq->nrounds;
	while (rq->kdone < kd && (int32_t)(done - (rq->seq + 1 + rq->kdone)) >= 0) {
		st_kernel_done(rq, rq->kdone);
		any = true;
	}
	if (st_final_passed(rq, done)) {
		if (rq->orphan)
			st_orphan_end(rq);
		op_end(p, g, rq);
		any = true;
	}
	return any;
}

static bool op_arrival(struct poller *p, struct pstream *g, struct cu_req *rq)
{
	if (__atomic_load_n(&p->c->words->arrive[rq->slot], __ATOMIC_ACQUIRE) != rq->seq)
		return false;
	st_arrived(rq);
	op_progress(p, g, rq);
	return true;
}

/* One pass over the live ops; true when something happened. */
static bool pass(struct poller *p)
{
	phx_cuda *c = p->c;
	int dead = __atomic_load_n(&c->dead, __ATOMIC_ACQUIRE);
	int64_t now = phx_now_ns();
	bool any = false, full = now - p->last_full > FULL_SCAN_NS;
	uint32_t i;

	take_incoming(p);
	if (full)
		p->last_full = now;
	for (i = 0; i < p->ng; i++) {
		struct pstream *g = &p->g[i];
		struct cu_req *rq, *next;
		int peek = 0;

		for (rq = g->head; rq; rq = next) {
			next = rq->p_next;
			if (dead) {
				st_kill(rq, dead);
				op_end(p, g, rq);
				any = true;
			} else if (rq->arrived) {
				any |= op_progress(p, g, rq);
			} else if (peek < PEEK || full) {
				peek++;
				any |= op_arrival(p, g, rq);
			} else {
				break;	/* the stream gets to the others later */
			}
		}
	}
	/* streams with nothing live: their slots go (handles may be reused) */
	for (i = 0; i < p->ng;) {
		if (!p->g[i].head)
			p->g[i] = p->g[--p->ng];
		else
			i++;
	}
	return any;
}

static bool live(const struct poller *p)
{
	return p->ng > 0;
}

static void nap(int efd, int64_t us)
{
	struct pollfd pfd = { .fd = efd, .events = POLLIN };
	struct timespec ts = { 0, us * 1000 };
	eventfd_t v;

	if (us < 0)
		poll(&pfd, 1, -1);
	else
		ppoll(&pfd, 1, &ts, NULL);
	eventfd_read(efd, &v);
}

static void *poller_main(void *arg)
{
	struct poller p = { .c = arg };
	phx_cuda *c = p.c;
	int64_t last = phx_now_ns();
	bool stop;

	/* naps of microseconds: the default 50 us of timer slack would double them */
	prctl(PR_SET_TIMERSLACK, 1000UL, 0, 0, 0);
	p.capg = 16;
	p.g = calloc(p.capg, sizeof(*p.g));
	if (!p.g)
		p.capg = 0;	/* group_of() tries again; nothing is lost meanwhile */
	for (;;) {
		int64_t now, idle;

		if (pass(&p)) {
			last = phx_now_ns();
			__atomic_store_n(&c->stream_progress_ns, last, __ATOMIC_RELEASE);
			continue;
		}
		pthread_mutex_lock(&c->lock);
		stop = c->poller_stop && !live(&p) && !c->p_incoming;
		pthread_mutex_unlock(&c->lock);
		if (stop)
			break;
		if (!live(&p)) {
			nap(c->poller_efd, -1);
			last = phx_now_ns();
			__atomic_store_n(&c->stream_progress_ns, last, __ATOMIC_RELEASE);
			continue;
		}
		now = phx_now_ns();
		idle = (now - last) / 1000;
		if (idle < SPIN_US) {
			sched_yield();
			continue;
		}
		nap(c->poller_efd, idle / 8 < NAP_MAX_US ? (idle / 8 > 10 ? idle / 8 : 10) : NAP_MAX_US);
	}
	free(p.g);
	return NULL;
}

int poller_start(phx_cuda *c)
{
	if (pthread_create(&c->poller, NULL, poller_main, c))
		return cu_err(-EAGAIN, "cannot start the poller thread");
	c->poller_started = true;
	return 0;
}

/* Once every stream op is released (destroy waited for them). */
void poller_stop(phx_cuda *c)
{
	if (!c->poller_started)
		return;
	pthread_mutex_lock(&c->lock);
	c->poller_stop = true;
	pthread_mutex_unlock(&c->lock);
	waker_kick(c->poller_efd);
	pthread_join(c->poller, NULL);
	c->poller_started = false;
}
