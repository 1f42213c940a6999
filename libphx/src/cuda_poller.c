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

struct poller {
	phx_cuda *c;
	struct cu_req *head;		/* live stream ops (p_next / p_prev) */
};

static void list_add(struct poller *p, struct cu_req *rq)
{
	rq->p_prev = NULL;
	rq->p_next = p->head;
	if (p->head)
		p->head->p_prev = rq;
	p->head = rq;
}

static void list_del(struct poller *p, struct cu_req *rq)
{
	if (rq->p_prev)
		rq->p_prev->p_next = rq->p_next;
	else
		p->head = rq->p_next;
	if (rq->p_next)
		rq->p_next->p_prev = rq->p_prev;
	rq->p_next = rq->p_prev = NULL;
}

/* The ops queued since the last look. */
static void take_incoming(struct poller *p)
{
	phx_cuda *c = p->c;
	struct cu_req *rq, *next;

	pthread_mutex_lock(&c->lock);
	rq = c->p_incoming;
	c->p_incoming = NULL;
	pthread_mutex_unlock(&c->lock);
	for (; rq; rq = next) {
		next = rq->p_next;
		list_add(p, rq);
	}
}

/* The op leaves the list for good: the stream is past it (or never will be). */
static void op_end(struct poller *p, struct cu_req *rq)
{
	list_del(p, rq);
	__atomic_sub_fetch(&p->c->stream_live, 1, __ATOMIC_ACQ_REL);
	st_final(rq);
}

/* One look at @rq's words; true when something happened. */
static bool op_look(struct poller *p, struct cu_req *rq)
{
	phx_cuda *c = p->c;
	bool any = false;
	uint32_t done, kd;

	if (!rq->arrived) {
		if (__atomic_load_n(&c->words->arrive[rq->slot], __ATOMIC_ACQUIRE) != rq->seq)
			return false;
		st_arrived(rq);
		any = true;
	}
	done = st_words_done(rq);
	kd = rq->orphan ? rq->orphan_rounds : rq->nrounds;
	while (rq->kdone < kd && (int32_t)(done - (rq->seq + 1 + rq->kdone)) >= 0) {
		st_kernel_done(rq, rq->kdone);
		any = true;
	}
	if (st_final_passed(rq, done)) {
		if (rq->orphan)
			st_orphan_end(rq);
		op_end(p, rq);
		any = true;
	}
	return any;
}

/* One pass over every live op; true when something happened. */
static bool pass(struct poller *p)
{
	phx_cuda *c = p->c;
	int dead = __atomic_load_n(&c->dead, __ATOMIC_ACQUIRE);
	struct cu_req *rq, *next;
	bool any = false;

	take_incoming(p);
	for (rq = p->head; rq; rq = next) {
		next = rq->p_next;
		if (dead) {
			st_kill(rq, dead);
			op_end(p, rq);
			any = true;
			continue;
		}
		any |= op_look(p, rq);
	}
	return any;
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
	for (;;) {
		int64_t now, idle;

		if (pass(&p)) {
			last = phx_now_ns();
			__atomic_store_n(&c->stream_progress_ns, last, __ATOMIC_RELEASE);
			continue;
		}
		pthread_mutex_lock(&c->lock);
		stop = c->poller_stop && !p.head && !c->p_incoming;
		pthread_mutex_unlock(&c->lock);
		if (stop)
			break;
		if (!p.head) {
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
