// SPDX-License-Identifier: Apache-2.0
/*
 * cuda_lanes.c - lane threads: request pieces through pinned staging.
 *
 * A lane is a thread with its own phx_engine (one io_uring), its own CUDA
 * stream and bufs_per_lane pinned staging buffers, registered with CUDA
 * and, as fixed buffers, with the lane's ring.  RAM-speed devices (zram)
 * complete O_DIRECT I/O inline in the submitting thread, so several lanes
 * run the file side in parallel.
 *
 * One buffer's round (struct cu_sbuf):
 *   fill     take pieces from the ready queue, small requests packed
 *            together (rq_cut), up to CU_MAX_PIECES;
 *   read     all pieces' file reads in one phx_submit -> SB_IO; when they
 *            are complete, one copy call for all of them (cuMemcpyBatchAsync,
 *            contiguous pieces merged; one cuMemcpyHtoDAsync each without
 *            it) and a host function on the lane's stream -> SB_COPY; the
 *            host function only flags the buffer and wakes the lane;
 *   write    the copies from the GPU first (SB_COPY), then all file writes
 *            in one phx_submit (SB_IO);
 *   then every piece is handed back to its request (rq_piece_done) and the
 *            buffer is free again.
 * Copies of a host-async request that must follow work on a producer stream
 * wait for the event recorded there (cuStreamWaitEvent) on the lane stream.
 *
 * A lane sleeps on its engine's eventfd, which io_uring completions, the
 * host functions and new work all write: it never polls with naps.  While
 * copies are in flight it also wakes every COPY_CHECK_MS to ask the stream
 * for a sticky CUDA error, the one case in which the host function would
 * never run.
 */
#include <errno.h>
#include <poll.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/mman.h>

#include "cuda_internal.h"

#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23	/* Linux 5.14; older headers lack it */
#endif

#define COPY_CHECK_MS 200
#define CUDA_ERROR_NOT_SUPPORTED 801

/* ------------------------------------------------------------------------ */
/* Waking                                                                   */
/* ------------------------------------------------------------------------ */

/* Wake up to @want lanes sleeping with a free buffer (any thread, no locks). */
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
		eventfd_write(fds[i], 1);
}

/* Wake every lane (early reads judged: whichever holds their rounds). */
void lanes_kick(phx_cuda *c)
{
	uint32_t i;

	for (i = 0; i < c->nlanes; i++)
		if (c->lanes[i].efd >= 0)
			eventfd_write(c->lanes[i].efd, 1);
}

static void sleeper_remove_locked(phx_cuda *c, struct cu_lane *ln)
{
	struct cu_lane **pp;

	if (!ln->sleeping)
		return;
	for (pp = &c->sleepers; *pp; pp = &(*pp)->next_sleeper) {
		if (*pp == ln) {
			*pp = ln->next_sleeper;
			break;
		}
	}
	ln->sleeping = false;
}

/* The lane stream's host function: copies before it are complete. */
static void copied_fn(void *arg)
{
	struct cu_sbuf *b = arg;

	__atomic_store_n(&b->copied, 1, __ATOMIC_RELEASE);
	eventfd_write(b->ln->efd, 1);
}

/* ------------------------------------------------------------------------ */
/* Filling a buffer                                                         */
/* ------------------------------------------------------------------------ */

static struct cu_sbuf *free_buf(struct cu_lane *ln)
{
	uint32_t i;

	for (i = 0; i < ln->nbufs; i++)
		if (ln->bufs[i].state == SB_FREE)
			return &ln->bufs[i];
	return NULL;
}

/*
 * Early reads (c->lock held): one piece of the first queued read the stream
 * has not reached, into @b, within the share of staging early reads may
 * hold.  Its round is taken as for an arrived op; nothing goes to the GPU
 * until the request is judged (rq_resolve()).
 */
static bool early_fill_locked(struct cu_lane *ln, struct cu_sbuf *b)
{
	phx_cuda *c = ln->c;
	struct cu_req *rq;

	if (!c->early_reads || c->early_bufs >= c->early_max)
		return false;
	for (rq = c->early_head; rq && rq->state != RQ_WAITING; rq = rq->e_next)
		;
	if (!rq)
		return false;
	b->op = PHX_OP_READ;
	b->fill = 0;
	b->npieces = 0;
	if (!rq_cut(rq, &b->pieces[0], &b->fill, c->cfg.buf_size, true))
		return false;
	b->stage = &rq->stages[rq->stage_next++];
	__atomic_store_n(&b->stage->b, b, __ATOMIC_RELEASE);
	b->npieces = 1;
	b->early = true;
	c->early_bufs++;
	rq->e_live++;
	if (rq->cursor >= rq->end) {
		rq_early_unlink_locked(rq);
		rq->e_cut = true;
	}
	return true;
}

/*
 * Take work for one free buffer; NULL when there is none (then the lane is
 * listed as a sleeper, so new work wakes it).  An arrived stream op at the
 * head is resolved first, outside the lock; with no arrived work, an early
 * read's piece (early_fill_locked()).
 */
static struct cu_sbuf *lane_fill(struct cu_lane *ln)
{
	phx_cuda *c = ln->c;
	struct cu_sbuf *b = free_buf(ln);
	struct cu_req *rq, *advance = NULL;

	if (!b)
		return NULL;
	pthread_mutex_lock(&c->lock);
	for (;;) {
		rq = c->ready_head;
		if (!rq || rq->state != RQ_ARRIVED)
			break;
		c->ready_head = rq->next;
		if (!c->ready_head)
			c->ready_tail = NULL;
		pthread_mutex_unlock(&c->lock);
		if (rq_resolve(rq) == 0) {
			pthread_mutex_lock(&c->lock);
			ready_push_head_locked(c, rq);
			pthread_mutex_unlock(&c->lock);
			if (rq->len > c->cfg.buf_size)
				lanes_wake(c, (uint32_t)(rq->len / c->cfg.buf_size));
		}
		pthread_mutex_lock(&c->lock);
	}
	if (!rq && c->early_head && early_fill_locked(ln, b)) {
		sleeper_remove_locked(c, ln);
		pthread_mutex_unlock(&c->lock);
		b->state = SB_IO;
		stat_add(c, &c->st.staging_fills, 1);
		stat_add(c, &c->st.chunks, 1);
		return b;
	}
	if (!rq) {
		if (!ln->sleeping && !ln->stop) {
			ln->sleeping = true;
			ln->next_sleeper = c->sleepers;
			c->sleepers = ln;
		}
		pthread_mutex_unlock(&c->lock);
		return NULL;
	}
	sleeper_remove_locked(c, ln);
	b->op = rq->op;
	b->fill = 0;
	b->npieces = 0;
	b->stage = NULL;
	/*
	 * Host-async requests share a buffer; a stream op's round has one to
	 * itself (its kernel copies one contiguous range).
	 */
	while (rq && rq->state == RQ_READY && rq->op == b->op &&
	       b->npieces < CU_MAX_PIECES && !b->stage &&
	       (!rq->stream_op || !b->npieces)) {
		if (!rq_cut(rq, &b->pieces[b->npieces], &b->fill, c->cfg.buf_size,
			    b->npieces == 0))
			break;
		if (rq->stream_op) {
			b->stage = &rq->stages[rq->stage_next++];
			__atomic_store_n(&b->stage->b, b, __ATOMIC_RELEASE);
		}
		b->npieces++;
		if (rq->cursor < rq->end)
			continue;
		/* every byte handed out: off the queue */
		c->ready_head = rq->next;
		if (!c->ready_head)
			c->ready_tail = NULL;
		rq->state = RQ_CUT;
		if (rq->stream_op) {
			rq_stages_cut_done_locked(rq);
			advance = rq;
		}
		__atomic_sub_fetch(&rq->pieces, 1, __ATOMIC_ACQ_REL);
		rq = c->ready_head;
	}
	pthread_mutex_unlock(&c->lock);
	if (advance)
		rq_stages_advance(advance);
	if (!b->npieces)
		return NULL;
	b->state = SB_IO;
	stat_add(c, &c->st.staging_fills, 1);
	stat_add(c, &c->st.chunks, b->npieces);
	return b;
}

/* ------------------------------------------------------------------------ */
/* File I/O                                                                 */
/* ------------------------------------------------------------------------ */

/* The lane's adoption of a request's file, made once per file entry. */
static phx_file *lane_file(struct cu_lane *ln, struct cu_file *cf, int *err)
{
	int ret;

	if (cf->lf[ln->index])
		return cf->lf[ln->index];
	ret = phx_file_from_fd(ln->eng, cf->fd, &cf->lf[ln->index]);
	if (ret) {
		cf->lf[ln->index] = NULL;
		*err = cu_err(ret, "lane %u: %s", ln->index, phx_strerror_last());
		return NULL;
	}
	stat_add(ln->c, &ln->c->st.file_adoptions, 1);
	return cf->lf[ln->index];
}

static void buf_io_done(struct cu_lane *ln, struct cu_sbuf *b);

/* Submit the file I/O of every piece of @b whose request is still healthy. */
static void buf_start_io(struct cu_lane *ln, struct cu_sbuf *b)
{
	struct phx_io *ios[CU_MAX_PIECES];
	uint32_t i, n = 0;
	int ret, err = 0;

	for (i = 0; i < b->npieces; i++) {
		struct cu_piece *p = &b->pieces[i];
		struct cu_req *rq = p->rq;
		phx_file *lf;

		p->io_started = false;
		if (__atomic_load_n(&rq->err, __ATOMIC_ACQUIRE))
			continue;
		lf = lane_file(ln, rq->cf, &err);
		if (!lf) {
			if (!b->early)	/* an early read tries again in order */
				rq_fail(rq, err);
			continue;
		}
		phx_io_prep(&p->pio, lf, rq->op, b->mem + p->soff, p->io_len, p->io_off);
		p->pio.user_data = b;
		p->io_started = true;
		ios[n++] = &p->pio;
	}
	b->state = SB_IO;
	b->ios_left = n;
	if (n) {
		ret = phx_submit(ln->eng, ios, n);
		if (ret) {
			for (i = 0; i < n && !b->early; i++)
				rq_fail(((struct cu_piece *)((char *)ios[i] -
					 offsetof(struct cu_piece, pio)))->rq,
					cu_err(ret, "lane %u: %s", ln->index, phx_strerror_last()));
			for (i = 0; i < b->npieces; i++)
				b->pieces[i].io_started = false;
			b->ios_left = 0;
		}
	}
	if (!b->ios_left)
		buf_io_done(ln, b);
}

/*
 * SQEs the engine prepared while reaping (the write half of a
 * read-modify-write, a continued short transfer) that are not yet handed to
 * the kernel.  phx_poll() reaps after it submits, so such SQEs wait for the
 * next call; the lane, about to sleep on the eventfd, must make that call
 * or no completion would ever wake it.
 */
static bool lane_unsubmitted(struct cu_lane *ln)
{
	bool any;

	pthread_mutex_lock(&ln->eng->lock);
	any = ln->eng->unsubmitted || ln->eng->pend_head;
	pthread_mutex_unlock(&ln->eng->lock);
	return any;
}

static bool lane_reap(struct cu_lane *ln)
{
	struct phx_io *done[64];
	bool any = false;
	int n, i;

	for (;;) {
		n = phx_poll(ln->eng, done, 64);
		for (i = 0; i < n; i++) {
			struct cu_sbuf *b = done[i]->user_data;

			any = true;
			if (--b->ios_left == 0)
				buf_io_done(ln, b);
		}
		if (n == 64)
			continue;
		if (n > 0 || !lane_unsubmitted(ln))
			break;
		/* one more call submits them; then their completions wake us */
		n = phx_poll(ln->eng, done, 0);
		if (!lane_unsubmitted(ln))
			break;
		/* still pending: waiting for a resource (bounce buffer, claim) */
		break;
	}
	return any;
}

/* ------------------------------------------------------------------------ */
/* Copies                                                                   */
/* ------------------------------------------------------------------------ */

struct copy_list {
	uint32_t n;
	uint8_t first[CU_MAX_PIECES];	/* entry -> its first piece */
	uint8_t count[CU_MAX_PIECES];	/* pieces it covers */
};

static void copy_add(struct cu_lane *ln, struct copy_list *cl, uint32_t piece,
		     CUdeviceptr dst, CUdeviceptr src, size_t len)
{
	uint32_t k = cl->n;

	/* contiguous on both sides: one copy */
	if (k && ln->dsts[k - 1] + ln->sizes[k - 1] == dst &&
	    ln->srcs[k - 1] + ln->sizes[k - 1] == src) {
		ln->sizes[k - 1] += len;
		cl->count[k - 1]++;
		return;
	}
	ln->dsts[k] = dst;
	ln->srcs[k] = src;
	ln->sizes[k] = len;
	cl->first[k] = (uint8_t)piece;
	cl->count[k] = 1;
	cl->n++;
}

static void copy_fail(struct cu_sbuf *b, const struct copy_list *cl, uint32_t k,
		      int err)
{
	uint32_t i;

	for (i = cl->first[k]; i < (uint32_t)cl->first[k] + cl->count[k]; i++)
		rq_fail(b->pieces[i].rq, err);
}

/*
 * Queue @cl's copies on the lane's stream: one cuMemcpyBatchAsync where
 * the driver has it, else (or if it refuses) one call per copy, which also
 * tells which piece a bad pointer belongs to.
 */
static void lane_copy(struct cu_lane *ln, struct cu_sbuf *b, const struct copy_list *cl,
		      bool h2d)
{
	phx_cuda *c = ln->c;
	const struct cu_driver *d = c->d;
	CUresult r;
	uint32_t k;

	if (!cl->n)
		return;
	if (cl->n > 1 && __atomic_load_n(&c->batch_copy, __ATOMIC_RELAXED)) {
		struct cu_memcpy_attr attr;
		size_t idx = 0, fail = SIZE_MAX;

		memset(&attr, 0, sizeof(attr));
		attr.src_access_order = CU_MEMCPY_SRC_ACCESS_ORDER_STREAM;
		r = d->MemcpyBatchAsync(ln->dsts, ln->srcs, ln->sizes, cl->n, &attr,
					&idx, 1, &fail, ln->stream);
		stat_add(c, &c->st.memcpy_calls, 1);
		stat_add(c, &c->st.memcpy_batch_calls, 1);
		if (r == CUDA_SUCCESS)
			return;
		if (r == CUDA_ERROR_NOT_SUPPORTED)
			__atomic_store_n(&c->batch_copy, false, __ATOMIC_RELAXED);
	}
	for (k = 0; k < cl->n; k++) {
		if (h2d)
			r = d->MemcpyHtoDAsync(ln->dsts[k], (const void *)(uintptr_t)ln->srcs[k],
					       ln->sizes[k], ln->stream);
		else
			r = d->MemcpyDtoHAsync((void *)(uintptr_t)ln->dsts[k], ln->srcs[k],
					       ln->sizes[k], ln->stream);
		stat_add(c, &c->st.memcpy_calls, 1);
		if (r != CUDA_SUCCESS)
			copy_fail(b, cl, k, cu_fail(d, r, h2d ? "copy to the GPU" : "copy from the GPU"));
	}
}

/* Make the lane stream wait for the producer events of @b's requests. */
static void lane_wait_afters(struct cu_lane *ln, struct cu_sbuf *b)
{
	struct cu_after *last = NULL;
	uint32_t i;

	for (i = 0; i < b->npieces; i++) {
		struct cu_req *rq = b->pieces[i].rq;
		CUresult r;

		if (!rq->after || rq->after == last)
			continue;
		last = rq->after;
		r = ln->c->d->StreamWaitEvent(ln->stream, last->ev, 0);
		if (r != CUDA_SUCCESS)
			rq_fail(rq, cu_fail(ln->c->d, r, "ordering after the producer stream"));
	}
}

static void buf_finish(struct cu_lane *ln, struct cu_sbuf *b)
{
	uint32_t i, n = b->npieces;

	b->npieces = 0;
	b->state = SB_FREE;
	for (i = 0; i < n; i++)
		rq_piece_done(&b->pieces[i]);
}

/* Queue @b's copies and the host function that reports them done. */
static void buf_copy(struct cu_lane *ln, struct cu_sbuf *b, const struct copy_list *cl,
		     bool h2d)
{
	const struct cu_driver *d = ln->c->d;
	CUresult r;
	uint32_t i;

	if (!cl->n) {
		if (h2d)
			buf_finish(ln, b);
		else
			buf_start_io(ln, b);
		return;
	}
	lane_wait_afters(ln, b);
	lane_copy(ln, b, cl, h2d);
	b->copied = 0;
	b->started_ns = phx_now_ns();
	b->state = SB_COPY;
	/* the event tells how the copies went; the host function, when */
	r = d->EventRecord(b->ev, ln->stream);
	if (r == CUDA_SUCCESS)
		r = d->LaunchHostFunc(ln->stream, copied_fn, b);
	if (r != CUDA_SUCCESS) {
		/* no host function: wait here (this is a lane, not a callback) */
		r = d->StreamSynchronize(ln->stream);
		if (r != CUDA_SUCCESS)
			for (i = 0; i < b->npieces; i++)
				rq_fail(b->pieces[i].rq, cu_fail(d, r, "copies on the lane stream"));
		b->copied = 1;
	}
}

static uint64_t staging_d(struct cu_lane *ln, struct cu_sbuf *b)
{
	return ln->mem_d + (uint64_t)(b->mem - ln->mem);
}

/* A stream op's round is over: its buffer is free, its reference goes. */
static void buf_release_round(struct cu_lane *ln, struct cu_sbuf *b)
{
	struct cu_req *rq = b->stage->rq;

	b->stage = NULL;
	b->npieces = 0;
	b->state = SB_FREE;
	rq_piece_done_ref(rq);
}

/* A stream op's round, its file I/O judged: the kernel on the caller's stream copies. */
static void round_io_done(struct cu_lane *ln, struct cu_sbuf *b)
{
	struct cu_piece *p = &b->pieces[0];
	struct cu_stage *st = b->stage;

	if (p->io_started)
		rq_piece_io(p);
	if (b->op == PHX_OP_WRITE) {
		rq_stage_written(st, p);
		buf_release_round(ln, b);
		return;
	}
	b->state = SB_GPU;
	rq_stage_fill(st, p, staging_d(ln, b));
	rq_stages_advance(st->rq);
}

/*
 * An early round's buffer goes back unused (its request judged E_BAD); the
 * last one restarts the request as an ordinary op.
 */
static void early_release(struct cu_lane *ln, struct cu_sbuf *b)
{
	phx_cuda *c = ln->c;
	struct cu_req *rq = b->stage->rq;
	bool restart;

	pthread_mutex_lock(&c->lock);
	__atomic_store_n(&b->stage->b, NULL, __ATOMIC_RELEASE);
	b->stage = NULL;
	b->npieces = 0;
	b->early = false;
	b->state = SB_FREE;
	c->early_bufs--;
	restart = --rq->e_live == 0 && rq->e_state == E_BAD;
	if (restart)
		rq_early_restart_locked(rq);
	pthread_mutex_unlock(&c->lock);
	if (restart)
		lanes_wake(c, 1);
}

/* Every byte the piece carries was read (the early read may stand). */
static bool early_piece_whole(const struct cu_piece *p)
{
	return p->io_started && p->pio.result >= 0 &&
	       (uint64_t)p->pio.result >= (p->user_off - p->io_off) + p->user_len;
}

/*
 * An early round whose file I/O is done: held until its request is judged;
 * then used (a short or failed early read is read again, in order) or given
 * back.  False while it is still held.
 */
static bool early_round(struct cu_lane *ln, struct cu_sbuf *b)
{
	phx_cuda *c = ln->c;
	struct cu_req *rq = b->stage->rq;
	uint8_t s;

	pthread_mutex_lock(&c->lock);
	s = rq->e_state;
	if (s == E_OK) {
		b->early = false;
		c->early_bufs--;
		rq->e_live--;
	} else if (s == E_PENDING) {
		b->state = SB_HELD;
	}
	pthread_mutex_unlock(&c->lock);
	if (s == E_PENDING)
		return false;
	if (s != E_OK)
		early_release(ln, b);
	else if (early_piece_whole(&b->pieces[0]))
		round_io_done(ln, b);
	else
		buf_start_io(ln, b);
	return true;
}

/* Held early rounds whose requests were judged. */
static bool lane_held(struct cu_lane *ln)
{
	bool any = false;
	uint32_t i;

	for (i = 0; i < ln->nbufs; i++)
		if (ln->bufs[i].state == SB_HELD)
			any |= early_round(ln, &ln->bufs[i]);
	return any;
}

/* Reads: the file I/O of every piece is over; copy what arrived. */
static void buf_io_done(struct cu_lane *ln, struct cu_sbuf *b)
{
	struct copy_list cl;
	uint32_t i;

	if (b->stage) {
		if (b->early)
			early_round(ln, b);
		else
			round_io_done(ln, b);
		return;
	}
	if (b->op == PHX_OP_WRITE) {
		for (i = 0; i < b->npieces; i++)
			if (b->pieces[i].io_started)
				rq_piece_io(&b->pieces[i]);
		buf_finish(ln, b);
		return;
	}
	cl.n = 0;
	for (i = 0; i < b->npieces; i++) {
		struct cu_piece *p = &b->pieces[i];
		struct cu_req *rq = p->rq;

		if (!p->io_started)
			continue;
		rq_piece_io(p);
		if (!p->got || __atomic_load_n(&rq->err, __ATOMIC_ACQUIRE))
			continue;
		copy_add(ln, &cl, i, rq->devptr + (p->user_off - rq->off),
			 (CUdeviceptr)(uintptr_t)(b->mem + p->soff + (p->user_off - p->io_off)),
			 p->got);
	}
	for (i = 0; i < cl.n; i++)
		stat_add(ln->c, &ln->c->st.h2d_bytes, ln->sizes[i]);
	buf_copy(ln, b, &cl, true);
}

/* Writes: bring the pieces' bytes from the GPU into staging. */
static void buf_start_write(struct cu_lane *ln, struct cu_sbuf *b)
{
	struct copy_list cl;
	uint32_t i;

	if (b->stage) {
		/* the kernel on the caller's stream fills it; then the file */
		b->state = SB_GPU;
		rq_stage_fill(b->stage, &b->pieces[0], staging_d(ln, b));
		rq_stages_advance(b->stage->rq);
		return;
	}
	cl.n = 0;
	for (i = 0; i < b->npieces; i++) {
		struct cu_piece *p = &b->pieces[i];
		struct cu_req *rq = p->rq;

		if (__atomic_load_n(&rq->err, __ATOMIC_ACQUIRE))
			continue;
		copy_add(ln, &cl, i, (CUdeviceptr)(uintptr_t)(b->mem + p->soff),
			 rq->devptr + (p->user_off - rq->off), p->user_len);
	}
	for (i = 0; i < cl.n; i++)
		stat_add(ln->c, &ln->c->st.d2h_bytes, ln->sizes[i]);
	buf_copy(ln, b, &cl, false);
}

/* Buffers whose copies finished (or whose stream broke). */
static bool lane_copied(struct cu_lane *ln)
{
	const struct cu_driver *d = ln->c->d;
	bool any = false;
	uint32_t i, k;

	for (i = 0; i < ln->nbufs; i++) {
		struct cu_sbuf *b = &ln->bufs[i];
		CUresult r;

		if (b->state == SB_GPU) {
			if (!__atomic_load_n(&b->stage->gpu_done, __ATOMIC_ACQUIRE))
				continue;
			any = true;
			if (b->op == PHX_OP_READ)
				buf_release_round(ln, b);
			else
				buf_start_io(ln, b);
			continue;
		}
		if (b->state != SB_COPY)
			continue;
		if (__atomic_load_n(&b->copied, __ATOMIC_ACQUIRE)) {
			/* copy errors become the requests' results */
			r = d->EventQuery(b->ev);
		} else {
			if (phx_now_ns() - b->started_ns < COPY_CHECK_MS * 1000000ll)
				continue;
			/* a sticky error would keep the host function from running */
			r = d->EventQuery(b->ev);
			if (r == CUDA_ERROR_NOT_READY) {
				b->started_ns = phx_now_ns();
				continue;
			}
		}
		if (r != CUDA_SUCCESS)
			for (k = 0; k < b->npieces; k++)
				rq_fail(b->pieces[k].rq, cu_fail(d, r, "copies on the lane stream"));
		any = true;
		if (b->op == PHX_OP_READ)
			buf_finish(ln, b);
		else
			buf_start_io(ln, b);
	}
	return any;
}

static void buf_start(struct cu_lane *ln, struct cu_sbuf *b)
{
	if (b->op == PHX_OP_READ)
		buf_start_io(ln, b);
	else
		buf_start_write(ln, b);
}

/* ------------------------------------------------------------------------ */
/* The thread                                                               */
/* ------------------------------------------------------------------------ */

static bool lane_idle(struct cu_lane *ln)
{
	uint32_t i;

	for (i = 0; i < ln->nbufs; i++)
		if (ln->bufs[i].state != SB_FREE)
			return false;
	return true;
}

static void lane_sleep(struct cu_lane *ln)
{
	struct pollfd pfd = { .fd = ln->efd, .events = POLLIN };
	eventfd_t v;
	uint32_t i;
	int timeout = -1;

	for (i = 0; i < ln->nbufs; i++)
		if (ln->bufs[i].state == SB_COPY)
			timeout = COPY_CHECK_MS;
	poll(&pfd, 1, timeout);
	eventfd_read(ln->efd, &v);
}

static void *lane_main(void *arg)
{
	struct cu_lane *ln = arg;
	phx_cuda *c = ln->c;
	bool stop;

	c->d->CtxSetCurrent(c->ctx);
	for (;;) {
		struct cu_sbuf *b;
		bool busy = lane_reap(ln);

		busy |= lane_copied(ln);
		busy |= lane_held(ln);
		while ((b = lane_fill(ln))) {
			buf_start(ln, b);
			busy = true;
		}
		if (busy)
			continue;
		pthread_mutex_lock(&c->lock);
		stop = ln->stop;
		pthread_mutex_unlock(&c->lock);
		if (stop && lane_idle(ln))
			break;
		lane_sleep(ln);
	}
	return NULL;
}

/* ------------------------------------------------------------------------ */
/* Setup and teardown                                                       */
/* ------------------------------------------------------------------------ */

int lane_setup(phx_cuda *c, struct cu_lane *ln, uint32_t index)
{
	const struct cu_driver *d = c->d;
	struct phx_engine_config ec;
	uint32_t k, per_buf;
	CUresult r;
	int ret;

	ln->c = c;
	ln->index = index;
	ln->efd = -1;
	ln->nbufs = c->cfg.bufs_per_lane;
	ln->bufs = calloc(ln->nbufs, sizeof(*ln->bufs));
	if (!ln->bufs)
		return cu_err(-ENOMEM, "out of memory");
	ln->mem_len = (size_t)ln->nbufs * c->cfg.buf_size;
	ln->mem = c->stage + (size_t)index * ln->mem_len;
	ln->mem_d = 0;			/* lane_start(): once the region is CUDA-registered */
	ln->setup_ns[0] = phx_now_ns();
	/* fault the lane's share in here, on this thread: the lanes do it in parallel */
	if (madvise(ln->mem, ln->mem_len, MADV_POPULATE_WRITE))	/* Linux 5.14+ */
		memset(ln->mem, 0, ln->mem_len);
	ln->setup_ns[1] = phx_now_ns();

	phx_engine_config_init(&ec);
	per_buf = (c->cfg.buf_size + c->cfg.max_io_size - 1) / c->cfg.max_io_size;
	if (per_buf < CU_MAX_PIECES)
		per_buf = CU_MAX_PIECES;
	ec.queue_depth = ln->nbufs * per_buf + 8;
	if (ec.queue_depth > 4096)
		ec.queue_depth = 4096;
	ec.max_io_size = c->cfg.max_io_size;
	/*
	 * A lane reads and writes whole aligned ranges of its registered
	 * staging; its engine bounces only the blocks of a read-modify-write.
	 * Small bounce buffers: 8 x 1 MiB per lane cost 128 MiB of memory over
	 * 16 lanes, and allocating and registering them was most of a lane's
	 * set-up (13-46 ms each on the H200 with 16 lanes at once).
	 */
	ec.bounce_count = 8;
	ec.bounce_size = 64 << 10;
	ec.flags |= PHX_ENGINE_NO_FIXED_FILES;
	ret = phx_engine_create(&ec, &ln->eng);
	if (ret)
		return cu_err(ret, "lane engine: %s", phx_strerror_last());
	ln->setup_ns[2] = phx_now_ns();
	if (c->fixed_bufs && phx_buf_register(ln->eng, ln->mem, ln->mem_len) == 0)
		ln->uring_registered = true;
	ln->setup_ns[3] = phx_now_ns();
	ln->efd = phx_engine_eventfd(ln->eng);
	if (ln->efd < 0)
		return cu_err(ln->efd, "lane eventfd: %s", phx_strerror_last());
	r = d->StreamCreate(&ln->stream, CU_STREAM_NON_BLOCKING);
	if (r != CUDA_SUCCESS) {
		ln->stream = NULL;
		return cu_fail(d, r, "cuStreamCreate (lane)");
	}
	for (k = 0; k < ln->nbufs; k++) {
		ln->bufs[k].ln = ln;
		ln->bufs[k].mem = ln->mem + (size_t)k * c->cfg.buf_size;
		ln->bufs[k].state = SB_FREE;
		r = d->EventCreate(&ln->bufs[k].ev, CU_EVENT_DISABLE_TIMING);
		if (r != CUDA_SUCCESS) {
			ln->bufs[k].ev = NULL;
			return cu_fail(d, r, "cuEventCreate (staging buffer)");
		}
	}
	ln->setup_ns[4] = phx_now_ns();
	return 0;
}

/* Once the staging region is CUDA-registered: the lane's thread. */
int lane_start(phx_cuda *c, struct cu_lane *ln)
{
	ln->mem_d = c->stage_d + (uint64_t)(ln->mem - c->stage);
	if (pthread_create(&ln->thr, NULL, lane_main, ln))
		return cu_err(-EAGAIN, "cannot start a lane thread");
	ln->started = true;
	return 0;
}

void lane_stop(phx_cuda *c, struct cu_lane *ln)
{
	if (!ln->started)
		return;
	pthread_mutex_lock(&c->lock);
	ln->stop = true;
	sleeper_remove_locked(c, ln);
	pthread_mutex_unlock(&c->lock);
	eventfd_write(ln->efd, 1);
	pthread_join(ln->thr, NULL);
	ln->started = false;
}

/* After lane_stop() and once no file entry uses the lane's engine. */
void lane_free(phx_cuda *c, struct cu_lane *ln)
{
	const struct cu_driver *d = c->d;
	uint32_t k;

	if (ln->stream) {
		/* a host function may still be queued behind finished copies */
		d->StreamSynchronize(ln->stream);
		d->StreamDestroy(ln->stream);
	}
	for (k = 0; ln->bufs && k < ln->nbufs; k++)
		if (ln->bufs[k].ev)
			d->EventDestroy(ln->bufs[k].ev);
	if (ln->eng) {
		if (ln->uring_registered)
			phx_buf_deregister(ln->eng, ln->mem);
		phx_engine_destroy(ln->eng);
	}
	free(ln->bufs);
}
