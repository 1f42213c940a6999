// SPDX-License-Identifier: Apache-2.0
/*
 * cuda_lanes.c - floor 3: I/O lanes, the file side of every request.
 *
 * A lane is a thread with its own phx_engine (one io_uring) and
 * bufs_per_lane pinned staging buffers, registered with its ring as fixed
 * buffers.  RAM-speed devices (zram) complete O_DIRECT I/O inline in the
 * submitting thread, so several lanes run the file side in parallel.
 *
 * A lane makes no CUDA call, ever: it raises stream-op flags (through
 * cuda_stream.c), and a CUDA call may block behind another thread's
 * device-synchronising call until every stream is idle, which a stream
 * waiting for that flag never is.  Copies of host-async requests are the
 * copier's (cuda_copier.c); copies of stream ops are kernels on the
 * caller's stream.
 *
 * One buffer, by what it carries:
 *   stream rounds        pieces of stream ops (one round each, of one op or
 *                        of several, packed), each on its own way (pstate):
 *     read               file read -> st_round_staged (the kernel copies;
 *                        the poller lets the piece go when its done word
 *                        passes)
 *     early read         file read -> held until the verdict (cuda_stream.c)
 *     write              st_round_reserved (the kernel fills it; the poller
 *                        hands it back) -> file write -> st_round_written
 *                        the buffer is free once every piece is let go of
 *   host-async read      pieces packed (rq_cut) -> file reads in one
 *                        submission -> the copier -> free
 *   host-async write     pieces packed -> the copier (from the GPU) -> back
 *                        here -> file writes -> pieces done
 * Work is taken in that order of priority: arrived stream ops first (they
 * may take any free buffer), then host-async work and early reads, each
 * within its class (cuda_pools.c).
 *
 * A lane sleeps on its engine's eventfd, which io_uring completions, the
 * other threads' hand-overs and new work all write: it never polls.
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

/* ------------------------------------------------------------------------ */
/* Taking work                                                              */
/* ------------------------------------------------------------------------ */

static struct cu_sbuf *free_buf(struct cu_lane *ln)
{
	uint32_t i;

	for (i = 0; i < ln->nbufs; i++)
		if (__atomic_load_n(&ln->bufs[i].state, __ATOMIC_ACQUIRE) == SB_FREE)
			return &ln->bufs[i];
	return NULL;
}

static void sleeper_add_locked(phx_cuda *c, struct cu_lane *ln)
{
	if (ln->sleeping || ln->stop)
		return;
	ln->sleeping = true;
	ln->next_sleeper = c->sleepers;
	c->sleepers = ln;
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

/*
 * Rounds of the arrived stream ops at the head of their queue, packed into
 * @b, all of one op kind (c->lock held).  Requests whose last round went in
 * (or that failed: they hand out no more) are taken off the queue and
 * listed in @cut[*@ncut]: the caller advances them and drops their cutting
 * references.
 */
static bool take_stream_locked(phx_cuda *c, struct cu_sbuf *b, struct cu_req **cut,
			       uint32_t *ncut)
{
	struct cu_req *rq;

	*ncut = 0;
	b->npieces = 0;
	b->fill = 0;
	while ((rq = ready_head_locked(c, true)) && b->npieces < CU_MAX_PIECES &&
	       *ncut < CU_MAX_PIECES) {
		if (b->npieces && rq->op != b->op)
			break;
		b->op = rq->op;
		/* rq_cut() cuts whole rounds, so none runs past those planned: were
		 * one to, the op fails rather than write past its rounds */
		if (rq->round_next >= rq->nrounds && rq->cursor < rq->end)
			rq_fail(rq, cu_err(-EIO, "internal: more staging rounds than planned"));
		if (!__atomic_load_n(&rq->err, __ATOMIC_ACQUIRE)) {
			struct cu_piece *p = &b->pieces[b->npieces];

			if (!rq_cut(rq, p, &b->fill, st_pack_limit(c, b), rq->round_bytes, !b->npieces))
				break;
			st_round_take_locked(rq, b, p);
			b->npieces++;
			if (rq->cursor < rq->end)
				continue;
		}
		/* every byte handed out (a failed op hands out no more) */
		ready_pop_locked(c, true);
		rq->state = RQ_CUT;
		st_cut_done_locked(rq);
		cut[(*ncut)++] = rq;
	}
	if (!b->npieces)
		return false;
	b->state = SB_STREAM;
	cls_take_locked(c, b, SBC_STREAM);
	return true;
}

/*
 * Host-async pieces into @b, small requests packed together, all of one op
 * (c->lock held).  Requests whose last piece went in lose their cutting
 * reference here.
 */
static bool take_host_locked(phx_cuda *c, struct cu_sbuf *b)
{
	struct cu_req *rq = ready_head_locked(c, false);

	if (!rq || !cls_may_take_locked(c, SBC_HOST))
		return false;
	b->op = rq->op;
	b->fill = 0;
	b->npieces = 0;
	while (rq && rq->op == b->op && b->npieces < CU_MAX_PIECES) {
		if (!rq_cut(rq, &b->pieces[b->npieces], &b->fill, c->cfg.buf_size,
			    c->cfg.buf_size, b->npieces == 0))
			break;
		b->pieces[b->npieces].b = b;
		b->npieces++;
		if (rq->cursor < rq->end)
			continue;
		ready_pop_locked(c, false);
		rq->state = RQ_CUT;
		/* not the last reference: the piece just cut holds one */
		__atomic_sub_fetch(&rq->pieces, 1, __ATOMIC_ACQ_REL);
		rq = ready_head_locked(c, false);
	}
	if (!b->npieces)
		return false;
	b->state = SB_IO;
	cls_take_locked(c, b, SBC_HOST);
	return true;
}

/*
 * Work for one free buffer, in order of priority; NULL when there is none
 * (the lane is then listed as a sleeper, so new work wakes it).
 */
static struct cu_sbuf *lane_fill(struct cu_lane *ln)
{
	phx_cuda *c = ln->c;
	struct cu_sbuf *b = free_buf(ln);
	struct cu_req *cut[CU_MAX_PIECES];
	int64_t t0;
	uint32_t ncut, i;
	bool got;

	if (!b)
		return NULL;
	t0 = phx_now_ns();
	for (;;) {
		pthread_mutex_lock(&c->lock);
		b->live = 0;
		got = take_stream_locked(c, b, cut, &ncut);
		if (!got && !ncut)
			got = take_host_locked(c, b) || st_early_take_locked(c, b);
		if (got)
			sleeper_remove_locked(c, ln);
		else if (!ncut)
			sleeper_add_locked(c, ln);
		pthread_mutex_unlock(&c->lock);
		for (i = 0; i < ncut; i++) {
			st_advance(cut[i]);
			rq_ref_drop(cut[i], 1);	/* the cutting reference */
		}
		if (got)
			break;
		if (!ncut)
			return NULL;
		/* failed ops were taken off the queue with nothing cut: look again */
	}
	stat_add(c, &c->st.staging_fills, 1);
	stat_add(c, &c->st.chunks, b->npieces);
	/* packing: only a filled buffer's time counts (an idle look is not work) */
	stat_add(c, &c->st.ph_pack_ns, (uint64_t)(phx_now_ns() - t0));
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
static void piece_io_done(struct cu_lane *ln, struct cu_piece *p);

/*
 * Submit the file I/O of @n pieces (of one buffer) whose requests are still
 * healthy (a write of a failed request writes nothing: its staging may hold
 * nothing of the caller's).  Host-async buffers count their I/O and end as
 * a whole (buf_io_done); a stream round's piece ends on its own
 * (piece_io_done), as soon as its I/O does.
 */
static void pieces_start_io(struct cu_lane *ln, struct cu_sbuf *b, struct cu_piece **ps,
			    uint32_t n)
{
	struct phx_io *ios[CU_MAX_PIECES];
	struct cu_piece *idle[CU_MAX_PIECES];
	bool stream = b->state == SB_STREAM;
	uint32_t i, k = 0, nidle = 0;
	int ret, err = 0;

	for (i = 0; i < n; i++) {
		struct cu_piece *p = ps[i];
		struct cu_req *rq = p->rq;
		phx_file *lf;

		p->io_started = false;
		if (__atomic_load_n(&rq->err, __ATOMIC_ACQUIRE)) {
			idle[nidle++] = p;
			continue;
		}
		lf = lane_file(ln, rq->cf, &err);
		if (!lf) {
			if (!p->early)	/* an early read tries again in order */
				rq_fail(rq, err);
			idle[nidle++] = p;
			continue;
		}
		phx_io_prep(&p->pio, lf, b->op, b->mem + p->soff, p->io_len, p->io_off);
		p->pio.user_data = p;
		p->io_started = true;
		ios[k++] = &p->pio;
	}
	if (!stream) {
		b->state = SB_IO;
		b->ios_left = k;
		b->io_ns = phx_now_ns();
	}
	if (k) {
		int64_t t0 = phx_now_ns();

		ret = phx_submit(ln->eng, ios, k);
		stat_add(ln->c, &ln->c->st.ph_submit_ns, (uint64_t)(phx_now_ns() - t0));
		if (ret) {
			for (i = 0; i < k; i++) {
				struct cu_piece *p = (struct cu_piece *)((char *)ios[i] -
						      offsetof(struct cu_piece, pio));

				if (!p->early)
					rq_fail(p->rq, cu_err(ret, "lane %u: %s", ln->index,
							      phx_strerror_last()));
				p->io_started = false;
				idle[nidle++] = p;
			}
			k = 0;
			if (!stream)
				b->ios_left = 0;
		}
	}
	if (!stream) {
		if (!b->ios_left)
			buf_io_done(ln, b);
		return;
	}
	for (i = 0; i < nidle; i++)
		piece_io_done(ln, idle[i]);
}

/* Every piece of a buffer just taken. */
static void buf_start_io(struct cu_lane *ln, struct cu_sbuf *b)
{
	struct cu_piece *ps[CU_MAX_PIECES];
	uint32_t i;

	for (i = 0; i < b->npieces; i++)
		ps[i] = &b->pieces[i];
	pieces_start_io(ln, b, ps, b->npieces);
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
			struct cu_piece *p = done[i]->user_data;
			struct cu_sbuf *b = p->b;

			any = true;
			if (b->state == SB_STREAM)
				piece_io_done(ln, p);
			else if (--b->ios_left == 0)
				buf_io_done(ln, b);
		}
		if (n == 64)
			continue;
		if (n > 0 || !lane_unsubmitted(ln))
			break;
		/* one more call submits them; then their completions wake us */
		phx_poll(ln->eng, done, 0);
		break;
	}
	return any;
}

/* A host-async buffer whose pieces are complete: they are done, it is free. */
static void buf_finish(struct cu_lane *ln, struct cu_sbuf *b)
{
	phx_cuda *c = ln->c;
	struct cu_piece pieces[CU_MAX_PIECES];
	uint32_t i, n = b->npieces;

	/* the pieces first: the buffer may be refilled the moment it is free */
	memcpy(pieces, b->pieces, n * sizeof(pieces[0]));
	int64_t t0;

	pthread_mutex_lock(&c->lock);
	b->npieces = 0;
	b->state = SB_FREE;
	cls_drop_locked(c, b);
	pthread_mutex_unlock(&c->lock);
	t0 = phx_now_ns();
	for (i = 0; i < n; i++)
		rq_piece_done(&pieces[i]);
	stat_add(c, &c->st.ph_done_ns, (uint64_t)(phx_now_ns() - t0));
}

/* Host-async reads: judge the pieces, then the copier takes the bytes to the GPU. */
static void host_read_done(struct cu_lane *ln, struct cu_sbuf *b)
{
	phx_cuda *c = ln->c;
	bool any = false;
	uint32_t i;

	for (i = 0; i < b->npieces; i++) {
		rq_piece_io(&b->pieces[i]);
		any |= b->pieces[i].got > 0;
	}
	if (!any) {
		buf_finish(ln, b);
		return;
	}
	pthread_mutex_lock(&c->lock);
	copier_push_locked(c, b);
	pthread_mutex_unlock(&c->lock);
}

/* The file I/O of a stream round's piece is over. */
static void piece_io_done(struct cu_lane *ln, struct cu_piece *p)
{
	struct cu_piece *again = p;

	if (p->b->op == PHX_OP_WRITE)
		st_round_written(p->round);
	else if (!p->early)
		st_round_staged(p->round);
	else if (st_early_round(p))
		pieces_start_io(ln, p->b, &again, 1);	/* short or failed early: again, in order */
}

/* The file I/O of every piece of a host-async buffer is over. */
static void buf_io_done(struct cu_lane *ln, struct cu_sbuf *b)
{
	uint32_t i;

	stat_add(ln->c, &ln->c->st.ph_io_ns, (uint64_t)(phx_now_ns() - b->io_ns));
	stat_add(ln->c, &ln->c->st.ph_buffers, 1);

	if (b->op == PHX_OP_READ) {
		host_read_done(ln, b);
		return;
	}
	for (i = 0; i < b->npieces; i++)
		rq_piece_io(&b->pieces[i]);
	buf_finish(ln, b);
}

/* A buffer taken: reads go to the file first, writes to the GPU first. */
static void buf_start(struct cu_lane *ln, struct cu_sbuf *b)
{
	phx_cuda *c = ln->c;
	struct cu_round *rs[CU_MAX_PIECES];
	uint32_t i, n = b->npieces;

	if (b->op == PHX_OP_READ) {
		buf_start_io(ln, b);
	} else if (b->state == SB_STREAM) {
		/* the kernels on the callers' streams fill them */
		for (i = 0; i < n; i++)
			rs[i] = b->pieces[i].round;
		for (i = 0; i < n; i++)
			st_round_reserved(rs[i]);
	} else {
		pthread_mutex_lock(&c->lock);
		copier_push_locked(c, b);
		pthread_mutex_unlock(&c->lock);
	}
}

/*
 * Buffers the other threads handed back: host-async writes whose bytes are
 * in staging now (the whole buffer), host-async reads of many pieces whose
 * copies are done (their completions: CU_DONE_ON_LANE), and stream rounds'
 * pieces marked P_BACK (a write whose kernel ran, an early read that must
 * be read again).
 */
static bool lane_inbox(struct cu_lane *ln)
{
	phx_cuda *c = ln->c;
	struct cu_sbuf *b, *next;
	struct cu_piece *ps[CU_MAX_PIECES];
	uint32_t i, n;

	pthread_mutex_lock(&c->lock);
	b = ln->inbox;
	ln->inbox = NULL;
	pthread_mutex_unlock(&c->lock);
	if (!b)
		return false;
	for (; b; b = next) {
		pthread_mutex_lock(&c->lock);
		next = b->next;
		b->next = NULL;
		b->in_inbox = false;
		n = 0;
		if (b->state == SB_STREAM) {
			for (i = 0; i < b->npieces; i++) {
				if (b->pieces[i].pstate == P_BACK) {
					b->pieces[i].pstate = P_IO;
					ps[n++] = &b->pieces[i];
				}
			}
		}
		pthread_mutex_unlock(&c->lock);
		if (b->state == SB_STREAM)
			pieces_start_io(ln, b, ps, n);
		else if (b->op == PHX_OP_READ)
			buf_finish(ln, b);
		else
			buf_start_io(ln, b);
	}
	return true;
}

/* ------------------------------------------------------------------------ */
/* The thread                                                               */
/* ------------------------------------------------------------------------ */

static bool lane_idle(struct cu_lane *ln)
{
	uint32_t i;

	for (i = 0; i < ln->nbufs; i++)
		if (__atomic_load_n(&ln->bufs[i].state, __ATOMIC_ACQUIRE) != SB_FREE)
			return false;
	return true;
}

static void lane_sleep(struct cu_lane *ln)
{
	struct pollfd pfd = { .fd = ln->efd, .events = POLLIN };
	eventfd_t v;

	poll(&pfd, 1, -1);
	eventfd_read(ln->efd, &v);
}

static void *lane_main(void *arg)
{
	struct cu_lane *ln = arg;
	phx_cuda *c = ln->c;
	bool stop;

	for (;;) {
		struct cu_sbuf *b;
		bool busy = lane_reap(ln);

		busy |= lane_inbox(ln);
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

/* On a thread of its own, in parallel with the other lanes (cuda_context.c). */
int lane_setup(phx_cuda *c, struct cu_lane *ln, uint32_t index)
{
	struct phx_engine_config ec;
	uint32_t k, per_buf;
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
	/* the context publishes the lanes' sums (cu_stats_publish) */
	ec.flags |= PHX_ENGINE_NO_FIXED_FILES | PHX_ENGINE_UNPUBLISHED;
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
	for (k = 0; k < ln->nbufs; k++) {
		ln->bufs[k].ln = ln;
		ln->bufs[k].mem = ln->mem + (size_t)k * c->cfg.buf_size;
		ln->bufs[k].state = SB_FREE;
	}
	return 0;
}

/* Once the staging region is CUDA-registered: the lane's thread. */
int lane_start(phx_cuda *c, struct cu_lane *ln)
{
	uint32_t k;

	ln->mem_d = c->stage_d + (uint64_t)(ln->mem - c->stage);
	for (k = 0; k < ln->nbufs; k++)
		ln->bufs[k].mem_d = ln->mem_d + (uint64_t)k * c->cfg.buf_size;
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
	waker_kick(ln->efd);
	pthread_join(ln->thr, NULL);
	ln->started = false;
}

/* After lane_stop() and once no file entry uses the lane's engine. */
void lane_free(phx_cuda *c, struct cu_lane *ln)
{
	(void)c;
	if (ln->eng) {
		if (ln->uring_registered)
			phx_buf_deregister(ln->eng, ln->mem);
		phx_engine_destroy(ln->eng);
	}
	free(ln->bufs);
}
