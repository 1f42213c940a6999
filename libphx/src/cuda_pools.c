// SPDX-License-Identifier: Apache-2.0
/*
 * cuda_pools.c - floor 1: what requests draw from, and how threads hand
 * work to each other.
 *
 *   staging classes  which kind of work holds how many staging buffers
 *                    (enum sb_class; the reason is in cuda_internal.h)
 *   events           a pool of CUDA events for producer streams
 *   stream slots     one per stream op in flight: a flag the host raises, an
 *                    arrival and a done word the caller's stream writes, and
 *                    CU_RING copy descriptors; a submission waits (bounded)
 *                    while all CU_SLOTS are in flight
 *   request records  a free list
 *   hand-overs       lane wake-ups and inboxes, the copier's queue, the
 *                    poller's incoming list: each a list under c->lock and an
 *                    eventfd kick
 *   counters
 */
#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>

#include "cuda_internal.h"

/* ------------------------------------------------------------------------ */
/* Wakers                                                                   */
/* ------------------------------------------------------------------------ */

void waker_kick(int efd)
{
	if (efd >= 0)
		eventfd_write(efd, 1);
}

/* Wake up to @want lanes sleeping with a free buffer (any thread, no lock held). */
void lanes_wake(phx_cuda *c, uint32_t want)
{
	int fds[CU_MAX_LANES];
	uint32_t n = 0, i;

	if (!want)
		want = 1;
	pthread_mutex_lock(&c->lock);
	while (n < want && c->sleepers) {
		struct cu_lane *ln = c->sleepers;

		c->sleepers = ln->next_sleeper;
		ln->sleeping = false;
		fds[n++] = ln->efd;
	}
	pthread_mutex_unlock(&c->lock);
	for (i = 0; i < n; i++)
		waker_kick(fds[i]);
}

/* Wake every lane (held buffers were judged: whichever lane holds them acts). */
void lanes_kick(phx_cuda *c)
{
	uint32_t i;

	for (i = 0; i < c->nlanes; i++)
		waker_kick(c->lanes[i].efd);
}

/*
 * Hand @b back to its lane, which starts the buffer's file write (a
 * host-async write back from the copier) or the file I/O of its P_BACK
 * pieces (stream rounds) (c->lock held).
 */
void lane_give_back_locked(phx_cuda *c, struct cu_sbuf *b)
{
	(void)c;
	if (b->state != SB_STREAM)
		b->state = SB_BACK;
	if (b->in_inbox)
		return;
	b->in_inbox = true;
	b->next = b->ln->inbox;
	b->ln->inbox = b;
	waker_kick(b->ln->efd);
}

/* Queue @b for the copier, in order (c->lock held). */
void copier_push_locked(phx_cuda *c, struct cu_sbuf *b)
{
	b->copy_ns = phx_now_ns();
	b->state = SB_COPY;
	b->next = NULL;
	if (c->copy_tail)
		c->copy_tail->next = b;
	else
		c->copy_head = b;
	c->copy_tail = b;
	waker_kick(c->copier_efd);
}

/* A stream op was queued: the poller watches its words from now on. */
void poller_add(phx_cuda *c, struct cu_req *rq)
{
	pthread_mutex_lock(&c->lock);
	rq->p_next = c->p_incoming;
	c->p_incoming = rq;
	pthread_mutex_unlock(&c->lock);
	/* the first one in flight: the copier's health check starts looking */
	if (__atomic_fetch_add(&c->stream_live, 1, __ATOMIC_ACQ_REL) == 0)
		waker_kick(c->copier_efd);
	waker_kick(c->poller_efd);
}

/* ------------------------------------------------------------------------ */
/* Staging classes                                                          */
/* ------------------------------------------------------------------------ */

bool cls_may_take_locked(const phx_cuda *c, uint8_t cls)
{
	uint32_t waiting = c->cls_held[SBC_HOST] + c->cls_held[SBC_EARLY];

	switch (cls) {
	case SBC_STREAM:
		return true;
	case SBC_HOST:
		return waiting < c->nbufs - c->reserve;
	case SBC_EARLY:
		return c->early_reads && c->cls_held[SBC_EARLY] < c->early_max &&
		       waiting < c->nbufs - c->reserve;
	default:
		return false;
	}
}

void cls_take_locked(phx_cuda *c, struct cu_sbuf *b, uint8_t cls)
{
	b->cls = cls;
	c->cls_held[cls]++;
}

void cls_drop_locked(phx_cuda *c, struct cu_sbuf *b)
{
	if (b->cls != SBC_NONE)
		c->cls_held[b->cls]--;
	b->cls = SBC_NONE;
}

/* ------------------------------------------------------------------------ */
/* Events                                                                   */
/* ------------------------------------------------------------------------ */

int ctx_push(phx_cuda *c)
{
	CUresult r = c->d->CtxPushCurrent(c->ctx);

	return r == CUDA_SUCCESS ? 0 : cu_fail(c->d, r, "cuCtxPushCurrent");
}

void ctx_pop(phx_cuda *c)
{
	CUcontext dummy;

	c->d->CtxPopCurrent(&dummy);
}

int ev_get(phx_cuda *c, CUevent *ev)
{
	CUresult r;

	pthread_mutex_lock(&c->lock);
	if (c->nev_free) {
		*ev = c->ev_free[--c->nev_free];
		pthread_mutex_unlock(&c->lock);
		return 0;
	}
	pthread_mutex_unlock(&c->lock);
	r = c->d->EventCreate(ev, CU_EVENT_DISABLE_TIMING);
	return r == CUDA_SUCCESS ? 0 : cu_fail(c->d, r, "cuEventCreate");
}

void ev_put(phx_cuda *c, CUevent ev)
{
	bool kept = false;

	if (!ev)
		return;
	pthread_mutex_lock(&c->lock);
	if (c->nev_free == c->ev_cap) {
		size_t cap = c->ev_cap ? c->ev_cap * 2 : 64;
		CUevent *nv = realloc(c->ev_free, cap * sizeof(*nv));

		if (nv) {
			c->ev_free = nv;
			c->ev_cap = cap;
		}
	}
	if (c->nev_free < c->ev_cap) {
		c->ev_free[c->nev_free++] = ev;
		kept = true;
	}
	pthread_mutex_unlock(&c->lock);
	if (!kept)
		c->d->EventDestroy(ev);
}

/* ------------------------------------------------------------------------ */
/* Stream slots                                                             */
/* ------------------------------------------------------------------------ */

/*
 * A slot for one stream op that will use @need values of the slot's
 * counter (its arrival, its rounds, its end).  Each slot's counter only
 * grows and the caller's stream compares cyclically (>=), so a slot is
 * handed out again as soon as its op is released: a later use moves the
 * counter on and can never hold back, or release early, an earlier one.
 *
 * With every slot in flight the caller waits for one, at most
 * c->queue_wait_ms: backpressure instead of failure (the stream frees slots
 * as it passes ops, and nothing it waits for needs this thread).
 */
int slot_get(phx_cuda *c, uint32_t need, uint32_t *slot, uint32_t *seq)
{
	int64_t deadline = phx_now_ns() + (int64_t)c->queue_wait_ms * 1000000;
	bool waited = false;

	pthread_mutex_lock(&c->lock);
	while (!c->nslot_free) {
		int64_t left = deadline - phx_now_ns();

		if (__atomic_load_n(&c->dead, __ATOMIC_ACQUIRE) || left <= 0) {
			pthread_mutex_unlock(&c->lock);
			return cu_err(__atomic_load_n(&c->dead, __ATOMIC_ACQUIRE) ? -EIO : -EAGAIN,
				      "%u stream operations are in flight on this context and none finished within %u ms",
				      CU_SLOTS, c->queue_wait_ms);
		}
		waited = true;
		c->slot_waiters++;
		phx_cond_wait_ns(&c->slot_cond, &c->lock, left);
		c->slot_waiters--;
	}
	*slot = c->slot_free[--c->nslot_free];
	*seq = c->slot_seq[*slot] + 1;
	c->slot_seq[*slot] += need;
	pthread_mutex_unlock(&c->lock);
	if (waited)
		stat_add(c, &c->st.queue_waits, 1);
	return 0;
}

void slot_put_locked(phx_cuda *c, uint32_t slot)
{
	c->slot_free[c->nslot_free++] = slot;
	if (c->slot_waiters)
		pthread_cond_signal(&c->slot_cond);
}

/* The host copy of round @round's descriptor (reused every CU_RING rounds). */
struct cu_copy_desc *slot_desc(phx_cuda *c, uint32_t slot, uint32_t round)
{
	return &c->descs[(size_t)slot * CU_RING + round % CU_RING];
}

/* ------------------------------------------------------------------------ */
/* Request records                                                          */
/* ------------------------------------------------------------------------ */

struct cu_req *rq_record_get(phx_cuda *c)
{
	struct cu_req *rq;

	pthread_mutex_lock(&c->lock);
	rq = c->free_reqs;
	if (rq)
		c->free_reqs = rq->next;
	pthread_mutex_unlock(&c->lock);
	if (!rq)
		rq = malloc(sizeof(*rq));
	if (rq) {
		memset(rq, 0, sizeof(*rq));
		rq->c = c;
		rq->short_end = UINT64_MAX;
		rq->pieces = 1;		/* the cutting reference */
	}
	return rq;
}

/*
 * Everything of the record is handed back before it goes on the free list:
 * from there another thread may take it at once (the H200's seed-scale
 * LMCache replay segfaulted when a record's rounds were freed after the
 * unlock).
 */
void rq_record_put_locked(phx_cuda *c, struct cu_req *rq)
{
	free(rq->rounds);
	rq->rounds = NULL;
	rq->next = c->free_reqs;
	c->free_reqs = rq;
}

/* ------------------------------------------------------------------------ */
/* Counters                                                                 */
/* ------------------------------------------------------------------------ */

void stat_add(phx_cuda *c, uint64_t *field, uint64_t n)
{
	(void)c;
	__atomic_add_fetch(field, n, __ATOMIC_RELAXED);
}
