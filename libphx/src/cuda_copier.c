// SPDX-License-Identifier: Apache-2.0
/*
 * cuda_copier.c - floor 3: the copier, host-async copies between staging
 * and the GPU, and the context's health check.
 *
 * The copier is the one thread of a context that makes CUDA calls for
 * requests in flight, and it raises no stream-op flag: if one of its calls
 * blocks behind another thread's device-synchronising call, only
 * host-async work waits (holding at most its class of the staging, so
 * arrived stream ops keep their buffers and finish, and the device
 * synchronisation completes).
 *
 * A buffer it is handed (the lanes' copier_push_locked) holds pieces of
 * host-async requests: a read's bytes go to the GPU, a write's come from
 * it.  Its copies go on one of CU_COPY_STREAMS streams in turn, after the
 * producer events of its requests (phx_cuda_submit_after), as one
 * cuMemcpyBatchAsync where the driver has it (CUDA >= 12.8; contiguous
 * pieces merged) or one call per piece; an event tells how they went and a
 * host function on that stream (ours, not a caller's) when.  Then a read's
 * pieces are done and its buffer free; a write's buffer goes back to its
 * lane for the file.
 *
 * Health.  A kernel that faults leaves a sticky error on the context:
 * nothing on any of its streams runs again, so stream ops would never see
 * their streams arrive, and destroy would wait forever.  While stream ops
 * are in flight and the poller saw no progress for HEALTH_MS, the copier
 * asks one of its own idle streams; any error other than "not ready" marks
 * the context dead (c->dead) and the poller ends every stream op with it.
 */
#include <errno.h>
#include <poll.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>

#include "cuda_internal.h"

#define HEALTH_MS 100
#define COPY_CHECK_MS 200

struct copy_list {
	uint32_t n;
	CUdeviceptr dsts[CU_MAX_PIECES], srcs[CU_MAX_PIECES];
	size_t sizes[CU_MAX_PIECES];
	uint8_t first[CU_MAX_PIECES];	/* entry -> its first piece */
	uint8_t count[CU_MAX_PIECES];	/* pieces it covers */
};

/* Our copy stream's host function: copies before it are complete. */
static void copied_fn(void *arg)
{
	struct cu_sbuf *b = arg;

	__atomic_store_n(&b->copied, 1, __ATOMIC_RELEASE);
	waker_kick(b->ln->c->copier_efd);
}

static void copy_add(struct copy_list *cl, uint32_t piece, CUdeviceptr dst, CUdeviceptr src,
		     size_t len)
{
	uint32_t k = cl->n;

	/* contiguous on both sides: one copy */
	if (k && cl->dsts[k - 1] + cl->sizes[k - 1] == dst &&
	    cl->srcs[k - 1] + cl->sizes[k - 1] == src) {
		cl->sizes[k - 1] += len;
		cl->count[k - 1]++;
		return;
	}
	cl->dsts[k] = dst;
	cl->srcs[k] = src;
	cl->sizes[k] = len;
	cl->first[k] = (uint8_t)piece;
	cl->count[k] = 1;
	cl->n++;
}

/*
 * What @b's pieces move.  A read piece copies what its file read
 * delivered, cut at the lowest short read of its request known now (a
 * short read fills no more than it reports); a piece of a failed request
 * copies nothing.
 */
static void copy_list_build(phx_cuda *c, struct cu_sbuf *b, struct copy_list *cl)
{
	uint32_t i;

	cl->n = 0;
	for (i = 0; i < b->npieces; i++) {
		struct cu_piece *p = &b->pieces[i];
		struct cu_req *rq = p->rq;

		if (__atomic_load_n(&rq->err, __ATOMIC_ACQUIRE))
			continue;
		if (b->op == PHX_OP_READ) {
			uint64_t se = __atomic_load_n(&rq->short_end, __ATOMIC_ACQUIRE);
			uint64_t end = p->user_off + p->got, len;

			if (se < end)
				end = se;
			if (end <= p->user_off)
				continue;
			len = end - p->user_off;
			copy_add(cl, i, rq->devptr + (p->user_off - rq->off),
				 (CUdeviceptr)(uintptr_t)(b->mem + p->soff + (p->user_off - p->io_off)),
				 len);
			stat_add(c, &c->st.h2d_bytes, len);
		} else {
			copy_add(cl, i, (CUdeviceptr)(uintptr_t)(b->mem + p->soff),
				 rq->devptr + (p->user_off - rq->off), p->user_len);
			stat_add(c, &c->st.d2h_bytes, p->user_len);
		}
	}
}

static void copy_fail(struct cu_sbuf *b, const struct copy_list *cl, uint32_t k, int err)
{
	uint32_t i;

	for (i = cl->first[k]; i < (uint32_t)cl->first[k] + cl->count[k]; i++)
		rq_fail(b->pieces[i].rq, err);
}

/*
 * Queue @cl's copies on @s: one cuMemcpyBatchAsync where the driver has it,
 * else (or if it refuses) one call per copy, which also tells which piece a
 * bad pointer belongs to.
 */
static void copies_queue(phx_cuda *c, CUstream s, struct cu_sbuf *b, struct copy_list *cl)
{
	const struct cu_driver *d = c->d;
	bool h2d = b->op == PHX_OP_READ;
	CUresult r;
	uint32_t k;

	if (cl->n > 1 && __atomic_load_n(&c->batch_copy, __ATOMIC_RELAXED)) {
		struct cu_memcpy_attr attr;
		size_t idx = 0, fail = SIZE_MAX;

		memset(&attr, 0, sizeof(attr));
		attr.src_access_order = CU_MEMCPY_SRC_ACCESS_ORDER_STREAM;
		r = d->MemcpyBatchAsync(cl->dsts, cl->srcs, cl->sizes, cl->n, &attr, &idx, 1,
					&fail, s);
		stat_add(c, &c->st.memcpy_calls, 1);
		stat_add(c, &c->st.memcpy_batch_calls, 1);
		if (r == CUDA_SUCCESS)
			return;
		if (r == CUDA_ERROR_NOT_SUPPORTED)
			__atomic_store_n(&c->batch_copy, false, __ATOMIC_RELAXED);
	}
	for (k = 0; k < cl->n; k++) {
		if (h2d)
			r = d->MemcpyHtoDAsync(cl->dsts[k], (const void *)(uintptr_t)cl->srcs[k],
					       cl->sizes[k], s);
		else
			r = d->MemcpyDtoHAsync((void *)(uintptr_t)cl->dsts[k], cl->srcs[k],
					       cl->sizes[k], s);
		stat_add(c, &c->st.memcpy_calls, 1);
		if (r != CUDA_SUCCESS)
			copy_fail(b, cl, k, cu_fail(d, r, h2d ? "copy to the GPU" : "copy from the GPU"));
	}
}

/* Make @s wait for the producer events of @b's requests. */
static void wait_afters(phx_cuda *c, CUstream s, struct cu_sbuf *b)
{
	struct cu_after *last = NULL;
	uint32_t i;

	for (i = 0; i < b->npieces; i++) {
		struct cu_req *rq = b->pieces[i].rq;
		CUresult r;

		if (!rq->after || rq->after == last)
			continue;
		last = rq->after;
		r = c->d->StreamWaitEvent(s, last->ev, 0);
		if (r != CUDA_SUCCESS)
			rq_fail(rq, cu_fail(c->d, r, "ordering after the producer stream"));
	}
}

/* The copies of @b are over (or failed): its pieces move on. */
static void copy_end(phx_cuda *c, struct cu_sbuf *b, CUresult r)
{
	struct cu_piece pieces[CU_MAX_PIECES];
	uint32_t i, n = b->npieces;

	stat_add(c, &c->st.ph_copy_ns, (uint64_t)(phx_now_ns() - b->copy_ns));
	int64_t t0;

	if (r != CUDA_SUCCESS)
		for (i = 0; i < n; i++)
			rq_fail(b->pieces[i].rq, cu_fail(c->d, r, "copies between staging and the GPU"));
	if (b->op == PHX_OP_WRITE || n > CU_DONE_ON_LANE) {
		/* a write's file I/O, or many pieces' completions, are the lane's */
		pthread_mutex_lock(&c->lock);
		lane_give_back_locked(c, b);
		pthread_mutex_unlock(&c->lock);
		return;
	}
	memcpy(pieces, b->pieces, n * sizeof(pieces[0]));
	pthread_mutex_lock(&c->lock);
	b->npieces = 0;
	b->state = SB_FREE;
	cls_drop_locked(c, b);
	pthread_mutex_unlock(&c->lock);
	waker_kick(b->ln->efd);
	t0 = phx_now_ns();
	for (i = 0; i < n; i++)
		rq_piece_done(&pieces[i]);
	stat_add(c, &c->st.ph_done_ns, (uint64_t)(phx_now_ns() - t0));
}

struct copier {
	phx_cuda *c;
	struct cu_sbuf **live;		/* buffers whose copies are queued */
	uint32_t nlive;
	uint32_t next_stream;
	int64_t last_probe;
};

static void copy_start(struct copier *cp, struct cu_sbuf *b)
{
	phx_cuda *c = cp->c;
	const struct cu_driver *d = c->d;
	CUstream s = c->copy_streams[cp->next_stream++ % CU_COPY_STREAMS];
	struct copy_list cl;
	CUresult r;

	copy_list_build(c, b, &cl);
	if (!cl.n) {
		copy_end(c, b, CUDA_SUCCESS);
		return;
	}
	wait_afters(c, s, b);
	copies_queue(c, s, b, &cl);
	b->copied = 0;
	b->started_ns = phx_now_ns();
	r = d->EventRecord(b->ev, s);
	if (r == CUDA_SUCCESS)
		r = d->LaunchHostFunc(s, copied_fn, b);
	if (r != CUDA_SUCCESS) {
		/* no host function: wait here (this thread raises no flag) */
		r = d->StreamSynchronize(s);
		copy_end(c, b, r);
		return;
	}
	cp->live[cp->nlive++] = b;
}

/* Buffers whose copies finished, or whose stream broke (a sticky error). */
static bool copies_reap(struct copier *cp)
{
	phx_cuda *c = cp->c;
	int64_t now = phx_now_ns();
	bool any = false;
	uint32_t i = 0;

	while (i < cp->nlive) {
		struct cu_sbuf *b = cp->live[i];
		CUresult r;

		if (__atomic_load_n(&b->copied, __ATOMIC_ACQUIRE)) {
			r = c->d->EventQuery(b->ev);
		} else if (now - b->started_ns > COPY_CHECK_MS * 1000000ll) {
			/* a sticky error keeps the host function from ever running */
			r = c->d->EventQuery(b->ev);
			if (r == CUDA_ERROR_NOT_READY) {
				b->started_ns = now;
				i++;
				continue;
			}
		} else {
			i++;
			continue;
		}
		cp->live[i] = cp->live[--cp->nlive];
		copy_end(c, b, r);
		any = true;
	}
	return any;
}

/* While stream ops wait with no progress: is the context still alive? */
static void health_check(struct copier *cp)
{
	phx_cuda *c = cp->c;
	int64_t now = phx_now_ns();
	CUresult r;

	if (!__atomic_load_n(&c->stream_live, __ATOMIC_ACQUIRE) ||
	    __atomic_load_n(&c->dead, __ATOMIC_ACQUIRE) ||
	    now - __atomic_load_n(&c->stream_progress_ns, __ATOMIC_ACQUIRE) < HEALTH_MS * 1000000ll ||
	    now - cp->last_probe < HEALTH_MS * 1000000ll)
		return;
	cp->last_probe = now;
	r = c->d->StreamQuery(c->copy_streams[CU_COPY_STREAMS - 1]);
	if (r == CUDA_SUCCESS || r == CUDA_ERROR_NOT_READY)
		return;
	cu_fail(c->d, r, "the context's device (its stream operations end with -EIO)");
	__atomic_store_n(&c->dead, -EIO, __ATOMIC_RELEASE);
	waker_kick(c->poller_efd);
}

static void *copier_main(void *arg)
{
	struct copier cp = { .c = arg };
	phx_cuda *c = cp.c;
	int mode = CU_STREAM_CAPTURE_MODE_RELAXED;
	bool stop;

	c->d->CtxSetCurrent(c->ctx);
	/* another thread's graph capture in global mode must not refuse our calls */
	if (c->d->ThreadExchangeStreamCaptureMode)
		c->d->ThreadExchangeStreamCaptureMode(&mode);
	cp.live = calloc(c->nbufs, sizeof(*cp.live));
	for (;;) {
		struct cu_sbuf *b, *next;
		struct pollfd pfd = { .fd = c->copier_efd, .events = POLLIN };
		bool busy;
		eventfd_t v;

		pthread_mutex_lock(&c->lock);
		b = c->copy_head;
		c->copy_head = c->copy_tail = NULL;
		stop = c->copier_stop;
		pthread_mutex_unlock(&c->lock);
		busy = b != NULL;
		for (; b; b = next) {
			next = b->next;
			b->next = NULL;
			if (cp.live)
				copy_start(&cp, b);
			else
				copy_end(c, b, CUDA_ERROR_OUT_OF_MEMORY);
		}
		busy |= copies_reap(&cp);
		health_check(&cp);
		if (busy)
			continue;
		if (stop && !cp.nlive)
			break;
		poll(&pfd, 1, cp.nlive || __atomic_load_n(&c->stream_live, __ATOMIC_ACQUIRE) ?
			      HEALTH_MS / 2 : -1);
		eventfd_read(c->copier_efd, &v);
	}
	free(cp.live);
	return NULL;
}

int copier_start(phx_cuda *c)
{
	if (pthread_create(&c->copier, NULL, copier_main, c))
		return cu_err(-EAGAIN, "cannot start the copier thread");
	c->copier_started = true;
	return 0;
}

/* Once no request is live: nothing is queued for it any more. */
void copier_stop(phx_cuda *c)
{
	if (!c->copier_started)
		return;
	pthread_mutex_lock(&c->lock);
	c->copier_stop = true;
	pthread_mutex_unlock(&c->lock);
	waker_kick(c->copier_efd);
	pthread_join(c->copier, NULL);
	c->copier_started = false;
}
