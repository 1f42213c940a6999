// SPDX-License-Identifier: Apache-2.0
/*
 * cuda_stream.c - floor 2b: stream-ordered requests (cuFile semantics).
 *
 * The operation runs when the caller's stream reaches it; its arguments
 * (*size, *file_offset, *buf_offset, or the io's fields) are read then; its
 * result is in *bytes_done before the stream goes past it.  Everything the
 * stream needs is queued at submission (st_submit), so that afterwards no
 * thread has to make a CUDA call for it; on the caller's stream, for a
 * slot s with sequence number q and R staging rounds:
 *
 *   write-value  arrive[s] = q              the poller sees the stream here
 *   per round k:
 *     wait-value flag[s] >= q + 1 + k       raised once round k's descriptor is out
 *     phx_desc   host descriptor -> GPU     one warp: one read of pinned memory
 *     phx_copy   staging <-> the caller's memory, as the descriptor says
 *     write-value done[s] = q + 1 + k       the poller: round k's buffer is free
 *   writes:
 *     wait-value flag[s] >= q + 1 + R       every round is in the file
 *     write-value done[s] = q + 1 + R
 *
 * No host function: a host function stalls the stream for a round trip
 * through CUDA's one callback thread (measured on an H200: one stream of
 * 1 MiB ops 14.9 GB/s with host functions for arrival and end, 32.2 GB/s
 * with stream memory writes the poller watches; docs/gpu.md).  The
 * descriptor goes through GPU memory because every block of a kernel that
 * reads pinned memory pays ~3 us for it, one block after the other (64
 * blocks copying 1 MiB: 4.9 GB/s; via phx_desc: 39 GB/s).
 *
 * The life of one op:
 *   RQ_WAITING   queued; with early reads its file I/O may already run
 *   (arrival)    the poller calls st_arrived(): arguments read and checked;
 *                early pieces judged (early_settle); -> RQ_READY on the
 *                stream ready queue, or nothing to move (every round empty)
 *   RQ_READY     lanes cut rounds (one per staging buffer) and read them
 *   RQ_CUT       every byte handed out; st_cut_done_locked() marks the
 *                rounds left over empty
 *   rounds       st_round_staged() / _reserved() / _written(); st_advance()
 *                writes descriptors in round order (so a round's length can
 *                be cut at the lowest short read of the rounds before it:
 *                a short read fills exactly what it reports) and raises the
 *                flag; the result is published before the last flag
 *   release      the poller saw the last done word: st_final()
 *
 * Early reads (cfg flag PHX_CUDA_EARLY_READS; early_begin, early_settle):
 * right after queueing, a read's arguments are taken as they are then and
 * lanes may read its rounds into staging (half the staging at most) while
 * the stream is still busy.  At arrival the early pieces stand only if the
 * arguments are the same, no write through libphx in this process touched
 * the range since the read began (inode.c's write log; none was in flight
 * or pending then), and the file's size and change time are unchanged:
 * this last check is what sees other processes, and it is sound only where
 * change times are fine-grained, so early reads are off elsewhere (and on
 * block devices).  Otherwise they are thrown away and read again.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "cuda_internal.h"

static uint64_t min_u64(uint64_t a, uint64_t b)
{
	return a < b ? a : b;
}

/* Cyclic: has the 32-bit counter @v reached @want? */
static bool passed(uint32_t v, uint32_t want)
{
	return (int32_t)(v - want) >= 0;
}

void st_trace_print(const struct cu_req *rq)
{
	const int64_t *t = rq->trace;

	fprintf(stderr, "phx-trace %s slot=%u rounds=%u len=%llu us: arrived %lld ready %lld final %lld released %lld%s\n",
		rq->op == PHX_OP_READ ? "read" : "write", rq->slot, rq->nrounds,
		(unsigned long long)rq->len,
		t[TR_ARRIVED] ? (long long)(t[TR_ARRIVED] - t[TR_QUEUED]) / 1000 : -1LL,
		t[TR_READY] ? (long long)(t[TR_READY] - t[TR_QUEUED]) / 1000 : -1LL,
		t[TR_FINAL] ? (long long)(t[TR_FINAL] - t[TR_QUEUED]) / 1000 : -1LL,
		t[TR_RELEASE] ? (long long)(t[TR_RELEASE] - t[TR_QUEUED]) / 1000 : -1LL,
		rq->e_state == E_OK ? " early" : "");
}

static void trace(struct cu_req *rq, int pt)
{
	if (!rq->trace[pt])
		rq->trace[pt] = phx_now_ns();
}

/* ------------------------------------------------------------------------ */
/* Arguments                                                                */
/* ------------------------------------------------------------------------ */

/* Rounds an op of @len bytes at @off needs (rq_cut's cutting, @round bytes each). */
static uint64_t rounds_needed(uint32_t op, uint64_t off, uint64_t len, uint32_t A,
			      uint32_t round)
{
	uint64_t span;

	if (!len)
		return 0;
	if (op == PHX_OP_READ)
		span = align_up(off + len, A) - align_down(off, A);
	else
		span = len + off % A;
	return (span + round - 1) / round;
}

/*
 * The bytes of one round.  Reads: a whole staging buffer (their file I/O
 * runs ahead with early reads, and fewer rounds are fewer kernels).
 * Writes: the op spread over the lanes, 256 KiB at least: a stream write
 * holds its stream until every round is in the file, and one lane writing
 * a whole op alone was a third slower than eight writers on the H200's
 * zram (its writes complete in the writing thread).
 */
static uint32_t round_bytes(const phx_cuda *c, uint32_t op, uint64_t len, uint32_t align)
{
	uint64_t r = c->cfg.buf_size;

	if (op == PHX_OP_WRITE) {
		r = align_up((len + c->nlanes - 1) / c->nlanes, 65536);
		if (r < (256u << 10))
			r = 256u << 10;
		r = align_up(r, align);
		if (r > c->cfg.buf_size)
			r = c->cfg.buf_size;
	}
	return (uint32_t)r;
}

/*
 * A stream op's arguments as they are now: 0, 1 (zero length) or -errno
 * (-EINVAL a negative offset, -EFAULT outside the GPU memory checked at
 * submission, -E2BIG more staging rounds than were queued).  No CUDA call.
 */
static int args_read(const struct cu_req *rq, uint64_t *devptr, uint64_t *off, uint64_t *len)
{
	int64_t foff, boff;

	if (rq->io_args) {
		*devptr = rq->io->devptr;
		*len = rq->io->len;
		*off = rq->io->offset;
	} else {
		*len = *rq->size_p;
		foff = *rq->foff_p;
		boff = *rq->boff_p;
		if (foff < 0 || boff < 0)
			return -EINVAL;
		*off = (uint64_t)foff;
		*devptr = rq->base + (uint64_t)boff;
	}
	if (!*len)
		return 1;
	if (*off + *len < *off)
		return -EINVAL;
	if (*devptr < rq->alloc_lo || *devptr + *len > rq->alloc_hi || *devptr + *len < *devptr)
		return -EFAULT;
	if (rounds_needed(rq->op, *off, *len, rq->cf->align, rq->round_bytes) > rq->nrounds)
		return -E2BIG;
	return 0;
}

/* The file's size and change time (early reads' guard against other writers). */
static bool file_stamp(const struct cu_file *cf, int64_t *size, int64_t *ctime_ns)
{
	struct stat stb;

	if (fstat(cf->fd, &stb))
		return false;
	*size = (int64_t)stb.st_size;
	*ctime_ns = (int64_t)stb.st_ctim.tv_sec * 1000000000 + stb.st_ctim.tv_nsec;
	/* a change time without nanoseconds is not fine-grained (ext4, 128-byte inodes) */
	return stb.st_ctim.tv_nsec != 0;
}

/* ------------------------------------------------------------------------ */
/* Rounds                                                                   */
/* ------------------------------------------------------------------------ */

/*
 * Round @rq->round_next is cut into piece @p of buffer @b (c->lock held):
 * it holds a reference, and the buffer one more live piece.  Several rounds,
 * of one op or of several, may share a buffer: a 1 MiB op takes a quarter
 * of a 4 MiB buffer, not all of it.
 */
void st_round_take_locked(struct cu_req *rq, struct cu_sbuf *b, struct cu_piece *p)
{
	struct cu_round *r = &rq->rounds[rq->round_next++];

	r->p = p;
	p->b = b;
	p->round = r;
	p->pstate = P_IO;
	b->live++;
	__atomic_add_fetch(&rq->pieces, 1, __ATOMIC_RELAXED);
}

/*
 * How far into @b the next stream round may reach (c->lock held).  Rounds
 * are packed only while they are small: a lane's pieces of one buffer are
 * its file I/O in one submission, which RAM-speed devices run in that one
 * thread, so two big rounds in one buffer read (or write) in series what
 * two lanes would read at once (the H200's zram: 1 MiB reads packed four to
 * a buffer, 14 GB/s; one to a buffer, 16-19).  So: a write round (its
 * stream waits for the file) has a buffer to itself, a read round of a
 * quarter buffer or more too, and smaller reads share one, each of them
 * less than a quarter.
 */
uint32_t st_pack_limit(const phx_cuda *c, const struct cu_sbuf *b)
{
	uint32_t q = c->cfg.buf_size / 4;

	if (!b->npieces)
		return c->cfg.buf_size;
	if (b->op == PHX_OP_WRITE || b->pieces[b->npieces - 1].io_len >= q ||
	    b->fill + q >= c->cfg.buf_size)
		return b->fill;		/* nothing more fits */
	return (uint32_t)align_up(b->fill, 4096) + q - 1;
}

/* Every piece is cut (c->lock held): the rounds left over carry nothing. */
void st_cut_done_locked(struct cu_req *rq)
{
	uint32_t k;

	rq->needed = rq->round_next;
	for (k = rq->round_next; k < rq->nrounds; k++) {
		rq->rounds[k].p = NULL;
		rq->rounds[k].ready = true;
	}
	rq->round_next = rq->nrounds;
}

/*
 * Round @k's descriptor (c->lock held), written in round order: every round
 * before it is judged, so its length is cut at the lowest short read so far
 * (nothing past what the result will report reaches the caller's memory),
 * and a request that failed copies nothing more.
 */
static void desc_write_locked(struct cu_req *rq, uint32_t k)
{
	phx_cuda *c = rq->c;
	struct cu_round *r = &rq->rounds[k];
	struct cu_copy_desc *d = slot_desc(c, rq->slot, k);
	struct cu_piece *p = r->p;
	bool bad = __atomic_load_n(&rq->err, __ATOMIC_ACQUIRE) != 0;

	d->src = d->dst = d->len = 0;
	if (!p || bad)
		return;
	if (rq->op == PHX_OP_READ) {
		uint64_t se = __atomic_load_n(&rq->short_end, __ATOMIC_ACQUIRE);
		uint64_t end = min_u64(p->user_off + p->got, se);

		d->src = p->b->mem_d + p->soff + (p->user_off - p->io_off);
		d->dst = rq->devptr + (p->user_off - rq->off);
		d->len = end > p->user_off ? end - p->user_off : 0;
		c->st.h2d_bytes += d->len;
	} else {
		d->src = rq->devptr + (p->user_off - rq->off);
		d->dst = p->b->mem_d + p->soff;
		d->len = p->user_len;
		c->st.d2h_bytes += d->len;
	}
}

static void flag_raise_locked(struct cu_req *rq, uint32_t value)
{
	if ((int32_t)(value - rq->raised) > 0) {
		rq->raised = value;
		__atomic_store_n(&rq->c->words->flag[rq->slot], value, __ATOMIC_RELEASE);
	}
}

/*
 * Write the descriptors of the rounds that are ready, in order and within
 * the ring (round k reuses round k - CU_RING's descriptor once that one's
 * kernel ran), and raise the flag over them.  The result is published when
 * the last flag is due: a read's once every round is staged, a write's
 * once every round is in the file.  The flag only ever rises, under
 * c->lock, so threads racing here cannot lower it.
 */
void st_advance(struct cu_req *rq)
{
	phx_cuda *c = rq->c;
	uint32_t final = rq->seq + rq->nrounds + (rq->op == PHX_OP_WRITE ? 1 : 0);
	bool publish = false;
	uint32_t target;

	pthread_mutex_lock(&c->lock);
	while (rq->prefix < rq->nrounds && rq->rounds[rq->prefix].ready &&
	       rq->prefix < rq->kdone + CU_RING)
		desc_write_locked(rq, rq->prefix++);
	target = rq->seq + rq->prefix;
	if (rq->prefix == rq->nrounds && rq->state == RQ_CUT &&
	    (rq->op == PHX_OP_READ || rq->written == (int)rq->needed)) {
		if (!rq->publish_claimed) {
			rq->publish_claimed = true;
			publish = true;
		}
		/* the last one goes up once the result is published */
		target = final - 1;
	}
	flag_raise_locked(rq, target);
	pthread_mutex_unlock(&c->lock);
	if (!publish)
		return;
	trace(rq, TR_FINAL);
	rq_publish(rq);
	pthread_mutex_lock(&c->lock);
	flag_raise_locked(rq, final);
	pthread_mutex_unlock(&c->lock);
}

/*
 * A round lets go of its piece (c->lock held); the caller drops the round's
 * reference.  The buffer is free once its last live piece goes.
 */
static void round_unbuffer_locked(phx_cuda *c, struct cu_round *r)
{
	struct cu_piece *p = r->p;
	struct cu_sbuf *b;

	if (!p)
		return;
	b = p->b;
	r->p = NULL;
	p->round = NULL;
	p->pstate = P_DONE;
	if (p->early) {
		p->early = false;
		r->rq->e_live--;
	}
	if (--b->live)
		return;
	b->npieces = 0;
	b->state = SB_FREE;
	cls_drop_locked(c, b);
	waker_kick(b->ln->efd);
}

/* A piece's next file I/O is its lane's (c->lock held): a write, or a read again. */
static void piece_back_locked(phx_cuda *c, struct cu_piece *p)
{
	p->pstate = P_BACK;
	lane_give_back_locked(c, p->b);
}

/* A read round's file I/O is over (or an early one stands): its bytes may go. */
void st_round_staged(struct cu_round *r)
{
	struct cu_req *rq = r->rq;
	phx_cuda *c = rq->c;
	struct cu_piece *p = r->p;
	bool last;

	rq_piece_io(p);
	rq_piece_account(rq, p);
	pthread_mutex_lock(&c->lock);
	r->ready = true;
	if (rq->gpu_gone) {
		/* no kernel of it will run any more (st_kill): nothing waits for the piece */
		round_unbuffer_locked(c, r);
		pthread_mutex_unlock(&c->lock);
		rq_ref_drop(rq, 1);
		return;
	}
	p->pstate = P_GPU;
	last = rq->state == RQ_CUT;
	rq_ref_hold_locked(rq);
	pthread_mutex_unlock(&c->lock);
	if (last)
		trace(rq, TR_READY);
	st_advance(rq);
	rq_ref_drop(rq, 1);
}

/* A write round's piece is reserved: the kernel may fill it. */
void st_round_reserved(struct cu_round *r)
{
	struct cu_req *rq = r->rq;
	phx_cuda *c = rq->c;

	pthread_mutex_lock(&c->lock);
	r->ready = true;
	if (rq->gpu_gone) {
		round_unbuffer_locked(c, r);
		pthread_mutex_unlock(&c->lock);
		rq_ref_drop(rq, 1);
		return;
	}
	r->p->pstate = P_GPU;
	rq_ref_hold_locked(rq);
	pthread_mutex_unlock(&c->lock);
	st_advance(rq);
	rq_ref_drop(rq, 1);
}

/* A write round's bytes are in the file (or were not written: the request failed). */
void st_round_written(struct cu_round *r)
{
	struct cu_req *rq = r->rq;
	phx_cuda *c = rq->c;

	rq_piece_io(r->p);
	rq_piece_account(rq, r->p);
	pthread_mutex_lock(&c->lock);
	r->written = true;
	rq->written++;
	round_unbuffer_locked(c, r);
	pthread_mutex_unlock(&c->lock);
	st_advance(rq);
	rq_ref_drop(rq, 1);
}

/*
 * Round @k's kernel ran (the poller saw its done word): a read's piece is
 * let go of; a write's holds the bytes for the file, and goes back to its
 * lane.
 */
void st_kernel_done(struct cu_req *rq, uint32_t k)
{
	phx_cuda *c = rq->c;
	struct cu_round *r = &rq->rounds[k];
	bool drop = false;

	pthread_mutex_lock(&c->lock);
	rq->kdone = k + 1;
	if (r->p) {
		if (rq->op == PHX_OP_READ) {
			round_unbuffer_locked(c, r);
			drop = true;
		} else {
			piece_back_locked(c, r->p);
		}
	}
	pthread_mutex_unlock(&c->lock);
	if (rq->prefix < rq->nrounds)
		st_advance(rq);		/* the ring may have room now */
	if (drop)
		rq_ref_drop(rq, 1);
}

uint32_t st_words_done(const struct cu_req *rq)
{
	return __atomic_load_n(&rq->c->words->done[rq->slot], __ATOMIC_ACQUIRE);
}

/*
 * Has the stream passed the whole op (every command queued for it), by the
 * done word @done (one read of it: the caller acted on every round it
 * shows)?  For an orphan: the last round whose commands all went in.
 */
bool st_final_passed(const struct cu_req *rq, uint32_t done)
{
	uint32_t final = rq->seq + rq->nrounds + (rq->op == PHX_OP_WRITE ? 1 : 0);

	if (rq->orphan) {
		if (!rq->orphan_rounds)
			return rq->arrived;
		final = rq->seq + rq->orphan_rounds;
	}
	return rq->arrived && passed(done, final);
}

/* ------------------------------------------------------------------------ */
/* Arrival                                                                  */
/* ------------------------------------------------------------------------ */

/* Nothing (more) to move: every round empty, the result published as flags go up. */
static void nothing_to_move(struct cu_req *rq)
{
	phx_cuda *c = rq->c;

	pthread_mutex_lock(&c->lock);
	rq->len = 0;
	rq->end = rq->off;
	rq->state = RQ_CUT;
	st_cut_done_locked(rq);
	pthread_mutex_unlock(&c->lock);
	trace(rq, TR_READY);
	st_advance(rq);
	rq_ref_drop(rq, 1);		/* the cutting reference */
}

/* Read the arguments as the stream found them, check them, and queue the op. */
static void resolve(struct cu_req *rq)
{
	phx_cuda *c = rq->c;
	uint64_t devptr = 0, off = 0, len = 0;
	int ret;

	if (__atomic_load_n(&rq->err, __ATOMIC_ACQUIRE)) {
		nothing_to_move(rq);
		return;
	}
	ret = args_read(rq, &devptr, &off, &len);
	rq_set_range(rq, devptr, off, len);
	switch (ret) {
	case 0:
		break;
	case 1:
		nothing_to_move(rq);
		return;
	case -EINVAL:
		rq_fail(rq, cu_err(-EINVAL, "negative or overflowing file or buffer offset"));
		nothing_to_move(rq);
		return;
	case -EFAULT:
		rq_fail(rq, cu_err(-EFAULT, "0x%llx + %llu is outside the GPU memory checked when the operation was queued (0x%llx..0x%llx)",
				   (unsigned long long)devptr, (unsigned long long)len,
				   (unsigned long long)rq->alloc_lo, (unsigned long long)rq->alloc_hi));
		nothing_to_move(rq);
		return;
	default:
		rq_fail(rq, cu_err(-EINVAL, "%llu bytes at %llu need more staging rounds than the %u planned from the size and offsets the operation had when queued (cuFile: *size must be the largest it will be)",
				   (unsigned long long)len, (unsigned long long)off, rq->nrounds));
		nothing_to_move(rq);
		return;
	}
	if (rq->op == PHX_OP_WRITE) {
		rq_write_register(rq, off, len);
	} else if (inode_bad_check(rq->cf->f->inode, off, len)) {
		stat_add(c, &c->st.bad_refusals, 1);
		rq_fail(rq, -EIO);
		nothing_to_move(rq);
		return;
	}
	pthread_mutex_lock(&c->lock);
	rq->state = RQ_READY;
	ready_push_locked(c, rq, false);
	pthread_mutex_unlock(&c->lock);
	lanes_wake(c, (uint32_t)min_u64(c->nlanes, rq->nrounds));
}

/* Forget the early pieces (none holds a buffer any more): an ordinary op. */
static void early_reset_locked(struct cu_req *rq)
{
	uint32_t k;

	rq->e_state = E_NONE;
	rq->e_cut = false;
	rq->round_next = 0;
	rq->prefix = 0;
	for (k = 0; k < rq->nrounds; k++) {
		rq->rounds[k].p = NULL;
		rq->rounds[k].ready = false;
	}
}

/* Off c->early_head (c->lock held). */
static void early_unlink_locked(struct cu_req *rq)
{
	phx_cuda *c = rq->c;
	struct cu_req **pp, *prev = NULL;

	if (!rq->e_queued)
		return;
	for (pp = &c->early_head; *pp; prev = *pp, pp = &(*pp)->e_next) {
		if (*pp == rq) {
			*pp = rq->e_next;
			if (c->early_tail == rq)
				c->early_tail = prev;
			break;
		}
	}
	rq->e_queued = false;
	rq->e_next = NULL;
}

/* Every byte the piece carries was read (the early read may stand as it is). */
static bool piece_whole(const struct cu_piece *p)
{
	return p->io_started && p->pio.result >= 0 &&
	       (uint64_t)p->pio.result >= (p->user_off - p->io_off) + p->user_len;
}

/*
 * An early piece joins the arrived op (c->lock held).  Its buffer keeps
 * counting as early staging until it is free (other early pieces may share
 * it): the class only bounds what early reads hold, and this one is about
 * to go to the GPU.
 */
static void early_adopt_locked(struct cu_piece *p)
{
	p->early = false;
	p->round->rq->e_live--;
}

/*
 * The stream reached an early read: judge its early pieces.  Returns true
 * when the op is taken care of, false when it is an ordinary op again now
 * (the caller resolves it).
 */
static bool early_settle(struct cu_req *rq)
{
	phx_cuda *c = rq->c;
	uint64_t devptr = 0, off = 0, len = 0;
	int64_t size = -1, ctime_ns = -1;
	struct cu_round **staged = NULL;
	uint32_t nstaged = 0, k, freed = 0;
	bool ok, restart = false, cut;
	int ret;

	ret = args_read(rq, &devptr, &off, &len);
	ok = ret == 0 && devptr == rq->devptr && off == rq->off && len == rq->len &&
	     !__atomic_load_n(&rq->err, __ATOMIC_ACQUIRE) &&
	     file_stamp(rq->cf, &size, &ctime_ns) && size == rq->e_size &&
	     ctime_ns == rq->e_ctime_ns &&
	     !inode_written_since(rq->cf->f->inode, rq->e_gen, rq->off, rq->len);
	if (ok)
		staged = malloc(rq->nrounds * sizeof(*staged));
	pthread_mutex_lock(&c->lock);
	early_unlink_locked(rq);
	ok = ok && staged && rq->e_epoch == c->early_epoch && c->early_reads;
	rq->e_state = ok ? E_OK : E_BAD;
	if (!ok) {
		/* held pieces go back now; pieces still reading come back later */
		for (k = 0; k < rq->round_next; k++) {
			struct cu_round *r = &rq->rounds[k];

			if (r->p && r->p->pstate == P_HELD) {
				round_unbuffer_locked(c, r);
				freed++;
			}
		}
		restart = !rq->e_live;
		if (restart)
			early_reset_locked(rq);
		pthread_mutex_unlock(&c->lock);
		free(staged);
		stat_add(c, &c->st.early_misses, 1);
		rq_ref_drop(rq, (int)freed);
		return !restart;
	}
	for (k = 0; k < rq->round_next; k++) {
		struct cu_round *r = &rq->rounds[k];
		struct cu_piece *p = r->p;

		if (!p || p->pstate != P_HELD)
			continue;	/* still reading: its lane sees E_OK when done */
		early_adopt_locked(p);
		if (piece_whole(p))
			staged[nstaged++] = r;
		else
			piece_back_locked(c, p);	/* short or failed early: read again, in order */
	}
	cut = rq->e_cut;
	if (cut) {
		rq->state = RQ_CUT;
		st_cut_done_locked(rq);
	} else {
		rq->state = RQ_READY;
		ready_push_locked(c, rq, true);
	}
	pthread_mutex_unlock(&c->lock);
	stat_add(c, &c->st.early_reads, 1);
	for (k = 0; k < nstaged; k++)
		st_round_staged(staged[k]);
	free(staged);
	if (cut) {
		st_advance(rq);
		rq_ref_drop(rq, 1);		/* the cutting reference */
	} else {
		lanes_wake(c, (uint32_t)min_u64(c->nlanes, rq->nrounds));
	}
	return true;
}

/* The poller saw the stream arrive at @rq. */
void st_arrived(struct cu_req *rq)
{
	/* under the lock: early_begin() reads the caller's arguments only before this */
	pthread_mutex_lock(&rq->c->lock);
	rq->arrived = true;
	pthread_mutex_unlock(&rq->c->lock);
	trace(rq, TR_ARRIVED);
	if (rq->e_state == E_PENDING && early_settle(rq))
		return;
	resolve(rq);
}

/* ------------------------------------------------------------------------ */
/* Early reads                                                              */
/* ------------------------------------------------------------------------ */

/*
 * Right after queueing: take the arguments as they are now and let lanes
 * read the rounds (c->early_head) while the stream is still busy.  Not when
 * the stream got there already (the poller's arrival would race), nor when
 * a write through libphx overlapping the range is in flight or pending: it
 * may be ordered before.
 */
static void early_begin(struct cu_req *rq)
{
	phx_cuda *c = rq->c;
	uint64_t devptr, off, len, gen;
	int64_t size, ctime_ns;
	struct cu_file *cf;
	bool ok;

	/*
	 * Once the stream got there the request may finish at any moment, and
	 * its caller's arguments and its file entry go with it: they are read
	 * and taken while it is still waiting (the poller marks the arrival
	 * under c->lock).
	 */
	pthread_mutex_lock(&c->lock);
	if (rq->arrived || !rq->cf || !rq->cf->early_ok ||
	    args_read(rq, &devptr, &off, &len) != 0) {
		pthread_mutex_unlock(&c->lock);
		return;
	}
	cf = rq->cf;
	cf->refs++;
	pthread_mutex_unlock(&c->lock);
	gen = inode_wgen(cf->f->inode);
	if (inode_write_busy(cf->f->inode, off, len)) {
		stat_add(c, &c->st.early_refused, 1);
		cf_put(c, cf);
		return;
	}
	ok = file_stamp(cf, &size, &ctime_ns);
	pthread_mutex_lock(&c->lock);
	if (!ok || !c->early_reads || rq->arrived || rq->state != RQ_WAITING ||
	    __atomic_load_n(&rq->err, __ATOMIC_ACQUIRE)) {
		pthread_mutex_unlock(&c->lock);
		cf_put(c, cf);
		return;
	}
	rq->e_size = size;
	rq->e_ctime_ns = ctime_ns;
	rq->e_gen = gen;
	rq_set_range(rq, devptr, off, len);
	rq->e_state = E_PENDING;
	rq->e_epoch = c->early_epoch;
	rq->e_queued = true;
	rq->e_next = NULL;
	if (c->early_tail)
		c->early_tail->e_next = rq;
	else
		c->early_head = rq;
	c->early_tail = rq;
	pthread_mutex_unlock(&c->lock);
	cf_put(c, cf);
	lanes_wake(c, (uint32_t)min_u64(c->nlanes, rq->nrounds));
}

/*
 * A lane with a free buffer and no arrived work (c->lock held): rounds of
 * the first early reads the stream has not reached, packed into @b, within
 * the early class.
 */
bool st_early_take_locked(phx_cuda *c, struct cu_sbuf *b)
{
	struct cu_req *rq, *next;

	if (!c->early_head || !cls_may_take_locked(c, SBC_EARLY))
		return false;
	b->op = PHX_OP_READ;
	b->fill = 0;
	b->npieces = 0;
	for (rq = c->early_head; rq && b->npieces < CU_MAX_PIECES; rq = next) {
		next = rq->e_next;
		if (rq->arrived || rq->state != RQ_WAITING)
			continue;
		while (rq->cursor < rq->end && b->npieces < CU_MAX_PIECES) {
			struct cu_piece *p = &b->pieces[b->npieces];

			if (rq->round_next >= rq->nrounds)
				break;	/* cannot happen (whole rounds): judged at arrival */
			if (!rq_cut(rq, p, &b->fill, st_pack_limit(c, b), rq->round_bytes, !b->npieces))
				goto full;
			st_round_take_locked(rq, b, p);
			p->early = true;
			rq->e_live++;
			b->npieces++;
		}
		if (rq->cursor >= rq->end) {
			early_unlink_locked(rq);
			rq->e_cut = true;
		}
	}
full:
	if (!b->npieces)
		return false;
	b->state = SB_STREAM;
	cls_take_locked(c, b, SBC_EARLY);
	return true;
}

/*
 * An early piece goes back unused (its request was judged E_BAD, or the
 * context died); the last one restarts the request as an ordinary op.
 */
static void early_release(struct cu_piece *p)
{
	struct cu_req *rq = p->round->rq;
	phx_cuda *c = rq->c;
	bool restart;

	pthread_mutex_lock(&c->lock);
	round_unbuffer_locked(c, p->round);
	restart = rq->e_live == 0 && rq->e_state == E_BAD && rq->arrived && !rq->gpu_gone;
	if (restart)
		early_reset_locked(rq);
	pthread_mutex_unlock(&c->lock);
	rq_ref_drop(rq, 1);
	if (restart)
		resolve(rq);
}

/*
 * A lane: the file I/O of an early piece is over.  Returns 0 when done with
 * it (held for the verdict, staged, or given back), 1 when it must be read
 * again (a short or failed early read of an op that stands).
 */
int st_early_round(struct cu_piece *p)
{
	struct cu_round *r = p->round;
	struct cu_req *rq = r->rq;
	phx_cuda *c = rq->c;
	uint8_t s;

	pthread_mutex_lock(&c->lock);
	s = rq->e_state;
	if (s == E_PENDING)
		p->pstate = P_HELD;
	else if (s == E_OK)
		early_adopt_locked(p);
	pthread_mutex_unlock(&c->lock);
	if (s == E_PENDING)
		return 0;
	if (s != E_OK) {
		early_release(p);
		return 0;
	}
	if (!piece_whole(p))
		return 1;
	st_round_staged(r);
	return 0;
}

/* ------------------------------------------------------------------------ */
/* Submission                                                               */
/* ------------------------------------------------------------------------ */

/* Is @s capturing a CUDA graph?  Then the op is refused (-EBUSY). */
static int capture_check(phx_cuda *c, CUstream s)
{
	int st = CU_STREAM_CAPTURE_STATUS_NONE;
	CUresult r;

	if (!c->d->StreamIsCapturing)
		return 0;
	r = c->d->StreamIsCapturing(s, &st);
	if (r == CUDA_SUCCESS && st == CU_STREAM_CAPTURE_STATUS_NONE)
		return 0;
	return cu_err(-EBUSY, "the stream is being captured into a CUDA graph (capture status %d, CUDA %d): a replayed graph would run a phx request that no longer exists; queue phx I/O outside the capture",
		      st, r);
}

/*
 * The GPU memory an op may use: the planned range [base + *buf_offset, +
 * *size) as it is now, and the allocation (or run of segments) around it;
 * where the planned range is not checkable yet, the allocation of @probe.
 */
static int check_memory(phx_cuda *c, struct cu_req *rq, uint64_t probe, uint64_t pdev,
			uint64_t plen)
{
	uint64_t range[2] = { 0, 0 };
	int ret = -EINVAL;

	if (plen)
		ret = cu_check_devptr(c, pdev, plen, range);
	if (ret)
		ret = cu_check_devptr(c, probe, 1, range);
	if (ret)
		return ret;
	rq->alloc_lo = range[0];
	rq->alloc_hi = range[1];
	return 0;
}

/*
 * Queue the op's GPU program on @s (see the top of this file).  Returns how
 * many commands were queued before a failure, or -1 when all were.
 */
static int program_queue(phx_cuda *c, struct cu_req *rq, CUstream s, bool *arrival_queued)
{
	const struct cu_driver *d = c->d;
	CUdeviceptr flag = c->words_d + offsetof(struct cu_words, flag) + 4ull * rq->slot;
	CUdeviceptr arrive = c->words_d + offsetof(struct cu_words, arrive) + 4ull * rq->slot;
	CUdeviceptr done = c->words_d + offsetof(struct cu_words, done) + 4ull * rq->slot;
	uint32_t k;
	CUresult r;

	*arrival_queued = false;
	r = d->StreamWriteValue32(s, arrive, rq->seq, CU_STREAM_WRITE_VALUE_DEFAULT);
	if (r != CUDA_SUCCESS)
		return cu_fail(d, r, "cuStreamWriteValue32 (stream-ordered request)"), 0;
	*arrival_queued = true;
	/* from here the stream may reach it at any time: the poller must watch */
	poller_add(c, rq);
	for (k = 0; k < rq->nrounds; k++) {
		size_t di = (size_t)rq->slot * CU_RING + k % CU_RING;
		CUdeviceptr hdesc = c->descs_d + di * sizeof(struct cu_copy_desc);
		CUdeviceptr ddesc = c->descs_gpu + di * sizeof(struct cu_copy_desc);
		void *pdesc[] = { &hdesc, &ddesc };
		void *pcopy[] = { &ddesc };

		r = d->StreamWaitValue32(s, flag, rq->seq + 1 + k, CU_STREAM_WAIT_VALUE_GEQ);
		if (r == CUDA_SUCCESS)
			r = d->LaunchKernel(c->desc_fn, 1, 1, 1, 32, 1, 1, 0, s, pdesc, NULL);
		if (r == CUDA_SUCCESS)
			r = d->LaunchKernel(c->copy_fn, c->copy_blocks, 1, 1, c->copy_threads, 1, 1,
					    0, s, pcopy, NULL);
		if (r == CUDA_SUCCESS)
			r = d->StreamWriteValue32(s, done, rq->seq + 1 + k,
						  CU_STREAM_WRITE_VALUE_DEFAULT);
		if (r != CUDA_SUCCESS) {
			cu_fail(d, r, "queueing a stream-ordered request");
			return (int)k;
		}
	}
	if (rq->op == PHX_OP_WRITE) {
		r = d->StreamWaitValue32(s, flag, rq->seq + 1 + rq->nrounds, CU_STREAM_WAIT_VALUE_GEQ);
		if (r == CUDA_SUCCESS)
			r = d->StreamWriteValue32(s, done, rq->seq + 1 + rq->nrounds,
						  CU_STREAM_WRITE_VALUE_DEFAULT);
		if (r != CUDA_SUCCESS) {
			cu_fail(d, r, "queueing a stream-ordered write's end");
			return (int)rq->nrounds;
		}
	}
	return -1;
}

/*
 * Only part of the program could be queued (after the arrival): the op
 * fails (-EIO in *bytes_done) and becomes an orphan.  Its @queued first
 * rounds went in whole; whatever of the next one went in (a wait, a
 * descriptor kernel) must pass without copying anything.  A whole round
 * may have copied already: lanes start on an op as soon as its stream
 * reaches it, which can be while this call is still queueing its rounds
 * (holding them back until the program is in could deadlock an op of
 * many rounds on CUDA's full command queue).  So the destination holds
 * the file's bytes in some of its places and its old bytes in the rest,
 * never anything else.  Once the stream
 * is past the last whole round the poller calls st_orphan_end(): the
 * slot's descriptors are zeroed, its flag raised all the way, and the slot
 * is never used again, since nothing tells when the stream is past those
 * last commands.
 */
static void orphan(phx_cuda *c, struct cu_req *rq, uint32_t queued)
{
	char keep[512];

	cu_err_save(keep, sizeof(keep));
	rq_fail(rq, cu_err(-EIO, "%s", keep));
	/*
	 * The result must be in *bytes_done before the stream goes past the op,
	 * and nothing queued for it will hold the stream until the poller
	 * publishes (its end was never queued; st_orphan_end() raises the flag
	 * before the op is published, and a program cut at a round boundary has
	 * no wait left at all): so write it now, in the call.  The publish later
	 * writes the same -EIO again.
	 */
	if (rq->bytes_done)
		*rq->bytes_done = rq_result(rq);
	pthread_mutex_lock(&c->lock);
	rq->orphan_rounds = queued;
	rq->orphan = true;
	c->orphans++;		/* destroy keeps the words and descriptors mapped */
	pthread_mutex_unlock(&c->lock);
	stat_add(c, &c->st.orphans, 1);
	cu_err_restore(keep);
}

/* The poller: an orphan's stream passed its whole rounds. */
void st_orphan_end(struct cu_req *rq)
{
	phx_cuda *c = rq->c;
	uint32_t k;

	pthread_mutex_lock(&c->lock);
	for (k = 0; k < CU_RING; k++)
		memset(slot_desc(c, rq->slot, k), 0, sizeof(struct cu_copy_desc));
	flag_raise_locked(rq, rq->seq + rq->nrounds + 1);
	pthread_mutex_unlock(&c->lock);
	st_kill(rq, -EIO);
}

int st_submit(phx_cuda *c, struct phx_cuda_io *io, bool owned, phx_file *f, uint32_t op,
	      uint64_t base, const size_t *size_p, const int64_t *foff_p,
	      const int64_t *boff_p, int64_t *bytes_done, CUstream s,
	      phx_cuda_done_fn done_fn, void *done_arg)
{
	bool io_args = io && !owned, arrival;
	uint64_t plen, poff = 0, pdev = 0, probe, rounds;
	int ret, err = 0, queued;
	struct cu_req *rq;

	if (!c->memops)
		return cu_err(-ENOTSUP, "stream-ordered I/O is unavailable on this context: %s",
			      c->memops_why);
	if (__atomic_load_n(&c->dead, __ATOMIC_ACQUIRE))
		return cu_err(-EIO, "the context's device hit a sticky CUDA error; make a new context");
	if (!f)
		return cu_err(-EINVAL, "NULL file");
	if (op != PHX_OP_READ && op != PHX_OP_WRITE)
		return cu_err(-EINVAL, "unknown op %u", op);
	if (!io_args && (!size_p || !foff_p || !boff_p))
		return cu_err(-EINVAL, "NULL size or offset pointer");
	/* the plan, from the arguments as they are now (read again on arrival) */
	if (io_args) {
		plen = io->len;
		poff = io->offset;
		pdev = io->devptr;
		probe = io->devptr;
	} else {
		plen = *size_p;
		if (*foff_p >= 0 && *boff_p >= 0) {
			poff = (uint64_t)*foff_p;
			pdev = base + (uint64_t)*boff_p;
		} else {
			plen = 0;
		}
		probe = base;
	}
	rq = rq_new(c);
	if (!rq)
		return cu_err(-ENOMEM, "out of memory");
	ret = ctx_push(c);
	if (ret) {
		free(rq);
		return ret;
	}
	ret = capture_check(c, s);
	if (!ret && probe)
		ret = check_memory(c, rq, probe, pdev, plen);
	if (ret)
		goto fail_early;
	rq->cf = cf_get(c, f, &err);
	if (!rq->cf) {
		ret = err;
		goto fail_early;
	}
	rq->io = io;
	rq->owned = owned;
	rq->stream_op = true;
	rq->io_args = io_args;
	rq->op = (uint8_t)op;
	rq->base = base;
	rq->size_p = size_p;
	rq->foff_p = foff_p;
	rq->boff_p = boff_p;
	rq->bytes_done = bytes_done;
	rq->done_fn = done_fn;
	rq->done_arg = done_arg;
	rq->stream = s;
	rq->state = RQ_WAITING;
	rq->round_bytes = round_bytes(c, op, plen, rq->cf->align);
	rounds = rounds_needed(op, poff, plen, rq->cf->align, rq->round_bytes);
	rq->nrounds = rounds ? (uint32_t)(rounds > UINT32_MAX / 2 ? UINT32_MAX / 2 : rounds) : 1;
	rq->rounds = calloc(rq->nrounds, sizeof(*rq->rounds));
	if (!rq->rounds) {
		ret = cu_err(-ENOMEM, "out of memory for %u staging rounds", rq->nrounds);
		goto fail_cf;
	}
	for (uint32_t k = 0; k < rq->nrounds; k++) {
		rq->rounds[k].rq = rq;
		rq->rounds[k].index = k;
	}
	/* its arrival, its rounds, its end: that many values of the slot's counter */
	ret = slot_get(c, rq->nrounds + 2, &rq->slot, &rq->seq);
	if (ret)
		goto fail_cf;
	rq->raised = rq->seq;
	if (plen)
		rq_write_register(rq, poff, plen);
	if (io) {
		io->done = 0;
		io->result = 0;
	}
	/* references: cutting, the GPU program, this call */
	rq->pieces = 3;
	rq_live_inc(c);
	rq->trace[TR_QUEUED] = phx_now_ns();
	queued = program_queue(c, rq, s, &arrival);
	if (!arrival) {
		ctx_pop(c);
		rq_abandon(rq, -EIO);
		return -EIO;
	}
	if (queued >= 0)
		orphan(c, rq, (uint32_t)queued);
	ctx_pop(c);
	stat_add(c, &c->st.stream_ops, 1);
	if (op == PHX_OP_READ && queued < 0 && __atomic_load_n(&c->early_reads, __ATOMIC_RELAXED))
		early_begin(rq);	/* this call's reference keeps it alive */
	rq_ref_drop(rq, 1);
	return 0;

fail_cf:
	cf_put(c, rq->cf);
	rq->cf = NULL;
fail_early:
	ctx_pop(c);
	pthread_mutex_lock(&c->lock);
	rq_record_put_locked(c, rq);
	pthread_mutex_unlock(&c->lock);
	return ret;
}

/* ------------------------------------------------------------------------ */
/* End                                                                      */
/* ------------------------------------------------------------------------ */

/*
 * No kernel of @rq will run any more: the context died (a sticky CUDA error:
 * nothing on its streams runs), or it is an orphan past its last whole
 * round.  End it now with @err.  Buffers waiting for its kernels are free;
 * rounds still in file I/O let go of theirs when it ends (the request has
 * failed, so nothing more is copied or written).
 *
 * Its result is published by its last reference (rq_ref_drop), not here:
 * a lane may be starting one of its pieces right now - it saw no error a
 * moment ago - and uses the file entry (rq->cf) that the publish lets go
 * of.  Freed under it once (ASan, the fake-CUDA test of partly queued ops).
 * An orphan's result is in *bytes_done already (orphan()); a dead
 * context's streams run nothing that could read it.
 */
void st_kill(struct cu_req *rq, int err)
{
	phx_cuda *c = rq->c;
	uint32_t k;
	int drop = 0;
	bool cutting = false;

	rq_fail(rq, err);
	pthread_mutex_lock(&c->lock);
	rq->gpu_gone = true;
	early_unlink_locked(rq);
	if (rq->e_state == E_PENDING)
		rq->e_state = E_BAD;
	for (k = 0; k < rq->round_next && k < rq->nrounds; k++) {
		struct cu_round *r = &rq->rounds[k];

		if (r->p && (r->p->pstate == P_GPU || r->p->pstate == P_HELD)) {
			round_unbuffer_locked(c, r);
			drop++;
		}
	}
	if (rq->state == RQ_WAITING) {
		/* never arrived: nobody will cut it */
		rq->state = RQ_CUT;
		st_cut_done_locked(rq);
		cutting = true;
	}
	if (!rq->publish_claimed) {
		rq->publish_claimed = true;
		rq->publish_at_release = true;
	}
	pthread_mutex_unlock(&c->lock);
	if (!rq->orphan)
		stat_add(c, &c->st.broken, 1);
	rq_ref_drop(rq, drop + (cutting ? 1 : 0));
}

/*
 * The stream is past the op (the poller saw its last word): count where its
 * time went, trace it, and drop the GPU program's reference.
 */
void st_final(struct cu_req *rq)
{
	phx_cuda *c = rq->c;
	int64_t *t = rq->trace;

	t[TR_RELEASE] = phx_now_ns();
	if (t[TR_ARRIVED]) {
		int64_t ready = t[TR_READY] > t[TR_ARRIVED] ? t[TR_READY] : t[TR_ARRIVED];

		stat_add(c, &c->st.stream_queue_ns, (uint64_t)(t[TR_ARRIVED] - t[TR_QUEUED]));
		stat_add(c, &c->st.stream_data_ns, (uint64_t)(ready - t[TR_ARRIVED]));
		stat_add(c, &c->st.stream_gpu_ns, (uint64_t)(t[TR_RELEASE] > ready ?
							     t[TR_RELEASE] - ready : 0));
	}
	stat_add(c, &c->st.stream_released, 1);
	if (c->trace)
		st_trace_print(rq);
	rq_ref_drop(rq, 1);
}
