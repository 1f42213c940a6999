// SPDX-License-Identifier: Apache-2.0
/*
 * cuda_request.c - floor 2a: the life cycle every GPU request shares.
 *
 * A request moves bytes between a file range and GPU memory through the
 * context's pinned staging buffers.  Host-async ones (phx_cuda_submit,
 * _submit_after, _pread, _pwrite) are checked here at submission and go on
 * the host ready queue; stream-ordered ones are born in cuda_stream.c and
 * join the stream ready queue when their stream arrives.  Then, for both:
 *
 *   cut      lanes cut a request into pieces that fit a staging buffer,
 *            packing small host-async requests together (rq_cut, under
 *            c->lock); once every byte is handed out it is RQ_CUT;
 *   pieces   each piece's file I/O is judged by rq_piece_io() (end of file is
 *            found here, by a short read, never by an fstat at submission)
 *            and counted done by rq_piece_done() once its copy, or its
 *            write, is complete;
 *   publish  rq_publish(): the result is the bytes moved (short at end of
 *            file) or the first error of any piece, copy errors included; it
 *            is in io->result and *bytes_done before anyone is told; a write
 *            that failed leaves its range bad (inode.c), so that no later
 *            read returns what the file holds there;
 *   release  rq_release() once the last reference is gone: the record, its
 *            file entry, its slot go back.
 *
 * References (rq->pieces): one for cutting, dropped once RQ_CUT; one per
 * piece or stream round holding a buffer; for stream ops one for the GPU
 * program, dropped when the stream is past it (cuda_stream.c).
 *
 * Files.  Every request holds its file through a struct cu_file (one per
 * caller phx_file): phx_file_hold() keeps phx_file_close() failing with
 * -EBUSY while GPU I/O on it is queued or in flight, and each lane adopts
 * the fd once per cu_file instead of once per request.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/stat.h>
#include <sys/statfs.h>
#include <sys/utsname.h>

#include "cuda_internal.h"

static uint64_t min_u64(uint64_t a, uint64_t b)
{
	return a < b ? a : b;
}

/* ------------------------------------------------------------------------ */
/* Files                                                                    */
/* ------------------------------------------------------------------------ */

static struct cu_file *cf_find_locked(phx_cuda *c, phx_file *f)
{
	struct cu_file *cf;

	for (cf = c->files; cf; cf = cf->next)
		if (cf->f == f)
			return cf;
	return NULL;
}

/*
 * Filesystems whose change times are fine-grained once someone looked at
 * them (multigrain timestamps, Linux 6.13): a change after an fstat always
 * gets a newer ctime, so an early read's stamp sees every change through
 * write(2) by anyone, this process or another.  Elsewhere two changes
 * within a clock tick share one ctime, and early reads stay off.
 */
static bool fine_ctime(int fd)
{
	static const long mg_fs[] = {
		0xEF53,		/* ext4 */
		0x58465342,	/* xfs */
		(long)0x9123683E, /* btrfs */
		0x01021994,	/* tmpfs */
	};
	struct utsname u;
	struct statfs sf;
	int major = 0, minor = 0;
	size_t i;

	if (uname(&u) || sscanf(u.release, "%d.%d", &major, &minor) != 2 ||
	    major < 6 || (major == 6 && minor < 13))
		return false;
	if (fstatfs(fd, &sf))
		return false;
	for (i = 0; i < sizeof(mg_fs) / sizeof(mg_fs[0]); i++)
		if ((long)sf.f_type == mg_fs[i])
			return true;
	return false;
}

struct cu_file *cf_get(phx_cuda *c, phx_file *f, int *err)
{
	struct phx_file_info fi;
	struct cu_file *cf, *old;
	int ret;

	pthread_mutex_lock(&c->lock);
	cf = cf_find_locked(c, f);
	if (cf) {
		cf->refs++;
		pthread_mutex_unlock(&c->lock);
		return cf;
	}
	pthread_mutex_unlock(&c->lock);

	ret = phx_file_get_info(f, &fi);
	if (ret) {
		*err = cu_err(ret, "%s", phx_strerror_last());
		return NULL;
	}
	cf = calloc(1, sizeof(*cf) + c->nlanes * sizeof(cf->lf[0]));
	if (!cf) {
		*err = cu_err(-ENOMEM, "out of memory");
		return NULL;
	}
	cf->f = f;
	cf->fd = fi.fd;
	cf->direct = fi.direct;
	cf->align = 1;
	if (fi.direct) {
		cf->align = fi.offset_align > fi.mem_align ? fi.offset_align : fi.mem_align;
		if (cf->align < 512)
			cf->align = 512;
	}
	if (cf->align > c->cfg.buf_size) {
		*err = cu_err(-EINVAL, "file alignment %u exceeds the staging buffer", cf->align);
		free(cf);
		return NULL;
	}
	/* block devices: size 0 and a ctime nobody changes; see fine_ctime() */
	cf->early_ok = !inode_is_blk(f->inode) && fine_ctime(fi.fd);
	cf->refs = 1;
	phx_file_hold(f);

	pthread_mutex_lock(&c->lock);
	old = cf_find_locked(c, f);	/* another thread was quicker */
	if (old) {
		old->refs++;
		pthread_mutex_unlock(&c->lock);
		phx_file_unhold(f);
		free(cf);
		return old;
	}
	cf->next = c->files;
	c->files = cf;
	pthread_mutex_unlock(&c->lock);
	return cf;
}

void cf_put(phx_cuda *c, struct cu_file *cf)
{
	struct cu_file **pp;
	uint32_t i;

	pthread_mutex_lock(&c->lock);
	if (--cf->refs) {
		pthread_mutex_unlock(&c->lock);
		return;
	}
	for (pp = &c->files; *pp; pp = &(*pp)->next) {
		if (*pp == cf) {
			*pp = cf->next;
			break;
		}
	}
	pthread_mutex_unlock(&c->lock);
	/* no request uses it any more: no lane touches its lf[] now */
	for (i = 0; i < c->nlanes; i++)
		if (cf->lf[i])
			phx_file_close(cf->lf[i]);
	phx_file_unhold(cf->f);
	free(cf);
}

/* ------------------------------------------------------------------------ */
/* Device memory                                                            */
/* ------------------------------------------------------------------------ */

/* @p must be device memory of the context's device. */
static int devptr_kind(phx_cuda *c, uint64_t p)
{
	const struct cu_driver *d = c->d;
	unsigned int mtype = 0;
	int ord = -1;
	CUresult r;

	r = d->PointerGetAttribute(&mtype, CU_POINTER_ATTRIBUTE_MEMORY_TYPE, p);
	if (r != CUDA_SUCCESS || (mtype != CU_MEMORYTYPE_DEVICE && mtype != CU_MEMORYTYPE_UNIFIED))
		return cu_err(-EINVAL, "0x%llx is not CUDA device memory", (unsigned long long)p);
	r = d->PointerGetAttribute(&ord, CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, p);
	if (r == CUDA_SUCCESS && ord != c->cfg.device)
		return cu_err(-EXDEV, "memory of device %d given to the context of device %d",
			      ord, c->cfg.device);
	return 0;
}

/*
 * @p .. @p + @len must be device memory of the context's device: one
 * allocation, or mapped segments that follow each other with no hole
 * (PyTorch's expandable segments and vLLM's allocator map a tensor as many
 * VMM chunks, and cuMemGetAddressRange reports one chunk at a time).
 * @range (may be NULL) caches the span checked, so a batch of pieces of one
 * buffer costs the driver queries once.  The calling thread must have the
 * context current (the API calls push it).
 */
int cu_check_devptr(phx_cuda *c, uint64_t p, size_t len, uint64_t range[2])
{
	const struct cu_driver *d = c->d;
	CUdeviceptr base = 0, next;
	size_t size = 0;
	uint64_t lo, hi;
	uint32_t segs = 0;
	CUresult r;
	int ret;

	if (p + len < p)
		return cu_err(-EFAULT, "0x%llx + %zu wraps around", (unsigned long long)p, len);
	if (range && p >= range[0] && p + len <= range[1])
		return 0;
	ret = devptr_kind(c, p);
	if (ret)
		return ret;
	r = d->MemGetAddressRange(&base, &size, p);
	if (r != CUDA_SUCCESS)
		return cu_fail(d, r, "cuMemGetAddressRange");
	lo = base;
	hi = base + size;
	while (p + len > hi) {
		/* the next segment must start where this one ends */
		if (++segs > 65536 || devptr_kind(c, hi) ||
		    d->MemGetAddressRange(&next, &size, hi) != CUDA_SUCCESS || next != hi || !size)
			return cu_err(-EFAULT, "0x%llx + %zu runs past its allocation (mapped up to 0x%llx from 0x%llx)",
				      (unsigned long long)p, len, (unsigned long long)hi,
				      (unsigned long long)lo);
		hi = next + size;
	}
	if (range) {
		range[0] = lo;
		range[1] = hi;
	}
	return 0;
}

/* ------------------------------------------------------------------------ */
/* Birth                                                                    */
/* ------------------------------------------------------------------------ */

struct cu_req *rq_new(phx_cuda *c)
{
	return rq_record_get(c);
}

void rq_live_inc(phx_cuda *c)
{
	pthread_mutex_lock(&c->done_lock);
	c->live++;
	pthread_mutex_unlock(&c->done_lock);
}

/* The byte range the request moves, once its arguments are known. */
void rq_set_range(struct cu_req *rq, uint64_t devptr, uint64_t off, uint64_t len)
{
	rq->devptr = devptr;
	rq->off = off;
	rq->len = len;
	rq->end = off + len;
	rq->cursor = off;
}

/*
 * A write accepted on the file: its range counts as written from now on
 * for early reads (inode.c), until it is published.
 */
void rq_write_register(struct cu_req *rq, uint64_t off, uint64_t len)
{
	if (rq->op != PHX_OP_WRITE)
		return;
	if (rq->wpend) {
		inode_pend_move(rq->cf->f->inode, &rq->wp, off, len);
		return;
	}
	inode_pend_add(rq->cf->f->inode, &rq->wp, off, len);
	rq->wpend = true;
}

static void write_unregister(struct cu_req *rq)
{
	if (!rq->wpend || !rq->cf)
		return;
	inode_pend_del(rq->cf->f->inode, &rq->wp);
	rq->wpend = false;
}

static int check_io(const struct phx_cuda_io *io)
{
	if (!io || !io->file)
		return cu_err(-EINVAL, "NULL request or file");
	if (io->op != PHX_OP_READ && io->op != PHX_OP_WRITE)
		return cu_err(-EINVAL, "unknown op %u", io->op);
	return 0;
}

/*
 * A host-async request, checked now; *@out is NULL when it finished at once
 * (zero length, or a read of a bad range).  *@cfp is the caller's file entry
 * for a batch (NULL at first; cf_put() it after the batch), so a batch on
 * one file looks the entry up once.
 */
int rq_host(phx_cuda *c, struct phx_cuda_io *io, struct cu_after *after,
	    struct cu_group *grp, uint64_t range[2], struct cu_file **cfp,
	    struct cu_req **out)
{
	struct cu_req *rq;
	int ret, err = 0;

	*out = NULL;
	ret = check_io(io);
	if (ret)
		return ret;
	if (io->len) {
		ret = cu_check_devptr(c, io->devptr, io->len, range);
		if (ret)
			return ret;
	}
	if (!*cfp || (*cfp)->f != io->file) {
		if (*cfp)
			cf_put(c, *cfp);
		*cfp = cf_get(c, io->file, &err);
		if (!*cfp)
			return err;
	}
	rq = rq_new(c);
	if (!rq)
		return cu_err(-ENOMEM, "out of memory");
	rq->cf = *cfp;
	rq->grp = grp;
	rq->op = (uint8_t)io->op;
	pthread_mutex_lock(&c->lock);
	(*cfp)->refs++;
	pthread_mutex_unlock(&c->lock);
	/* accepted: from here on it always completes */
	io->done = 0;
	io->result = 0;
	rq->io = io;
	rq_set_range(rq, io->devptr, io->offset, io->len);
	rq_write_register(rq, io->offset, io->len);
	if (after) {
		__atomic_add_fetch(&after->refs, 1, __ATOMIC_RELAXED);
		rq->after = after;
	}
	rq_live_inc(c);
	if (rq->op == PHX_OP_READ && inode_bad_check(rq->cf->f->inode, rq->off, rq->len)) {
		stat_add(c, &c->st.bad_refusals, 1);
		rq_fail(rq, -EIO);
		rq->len = 0;
	}
	if (!rq->len) {
		rq->pieces = 0;
		rq_publish(rq);
		rq_release(rq);
		return 0;
	}
	rq->state = RQ_READY;
	*out = rq;
	return 0;
}

/* ------------------------------------------------------------------------ */
/* Pieces                                                                   */
/* ------------------------------------------------------------------------ */

/*
 * Cut the next piece of @rq into a staging buffer of @size bytes whose
 * first *@fill bytes are taken (c->lock held).  Reads read the aligned
 * window around their bytes into staging, so unaligned offsets and sizes
 * cost nothing; writes place their bytes at the file offset's position in
 * the block (memory congruent with the file), so only a sub-block head and
 * tail take the engine's read-modify-write path.  A piece is at most
 * @max_len bytes (a stream op's round).  A piece that would be cut short by
 * a nearly full buffer waits for an empty one instead (@first).
 */
bool rq_cut(struct cu_req *rq, struct cu_piece *p, uint32_t *fill, uint32_t size,
	    uint32_t max_len, bool first)
{
	uint64_t A = rq->cf->align, cur = rq->cursor, left = rq->end - cur;
	uint64_t g = A > 4096 ? A : 4096;	/* staging position granule */
	uint64_t pos = (*fill + g - 1) / g * g, len, full;
	/*
	 * A stream op's round is whole or not at all: its rounds were counted
	 * when it was queued, at max_len apart from the aligned start of its
	 * range, and a round cut short by a full buffer would need one more.
	 */
	bool whole = rq->stream_op;

	if (pos >= size)
		return false;
	if (rq->op == PHX_OP_READ) {
		uint64_t w0 = align_down(cur, A), wend = align_up(rq->end, A);

		full = min_u64(wend - w0, align_down(max_len, A));
		len = min_u64(full, align_down(size - pos, A));
		if (!len || (whole && len < full))
			return false;
		p->io_off = w0;
		p->io_len = (uint32_t)len;
		p->user_len = (uint32_t)(min_u64(rq->end, w0 + len) - cur);
	} else {
		pos += cur % A;
		if (pos >= size)
			return false;
		full = whole ? min_u64(left, max_len - (cur - align_down(rq->off, A)) % max_len) :
			       min_u64(left, max_len);
		len = min_u64(full, size - pos);
		if (whole && len < full)
			return false;
		p->io_off = cur;
		p->io_len = (uint32_t)len;
		p->user_len = (uint32_t)len;
	}
	if (!whole && !first && p->user_len < left && len < min_u64(size, max_len) / 4)
		return false;
	p->rq = rq;
	p->round = NULL;
	p->early = false;
	p->soff = (uint32_t)pos;
	p->user_off = cur;
	p->got = 0;
	p->io_started = false;
	*fill = (uint32_t)(pos + len);
	rq->cursor = cur + p->user_len;
	/* a stream op's rounds hold their references themselves */
	if (!rq->stream_op)
		__atomic_add_fetch(&rq->pieces, 1, __ATOMIC_RELAXED);
	return true;
}

void rq_fail(struct cu_req *rq, int64_t err)
{
	int64_t zero = 0;

	__atomic_compare_exchange_n(&rq->err, &zero, err, false, __ATOMIC_ACQ_REL,
				    __ATOMIC_ACQUIRE);
}

/*
 * The file I/O of a piece completed: how many of the caller's bytes it
 * delivered.  A short read is end of file as it is now; the request's
 * result ends at the lowest such point.
 */
void rq_piece_io(struct cu_piece *p)
{
	struct cu_req *rq = p->rq;
	int64_t res = p->pio.result;
	uint64_t end, cur, skip;

	if (!p->io_started) {
		p->got = 0;
		return;
	}
	if (res < 0) {
		rq_fail(rq, res);
		p->got = 0;
		return;
	}
	if (rq->op == PHX_OP_WRITE) {
		p->got = (uint32_t)res;
		if ((uint64_t)res < p->io_len)
			rq_fail(rq, cu_err(-EIO, "short write at %llu",
					   (unsigned long long)(p->io_off + (uint64_t)res)));
		return;
	}
	skip = p->user_off - p->io_off;
	p->got = (uint64_t)res > skip ? (uint32_t)min_u64((uint64_t)res - skip, p->user_len) : 0;
	if (p->got == p->user_len)
		return;
	end = p->user_off + p->got;
	cur = __atomic_load_n(&rq->short_end, __ATOMIC_RELAXED);
	while (end < cur &&
	       !__atomic_compare_exchange_n(&rq->short_end, &cur, end, false,
					    __ATOMIC_ACQ_REL, __ATOMIC_RELAXED))
		;
}

/* Bytes of a piece by path, once its file I/O is judged. */
void rq_piece_account(struct cu_req *rq, struct cu_piece *p)
{
	uint32_t paths = p->pio.paths;
	uint64_t got = p->got, direct = 0, bounce = 0, buffered = 0;

	if (!p->io_started || !got)
		return;
	if (paths & PHX_PATH_BUFFERED) {
		buffered = got;
	} else if (rq->op == PHX_OP_READ || paths == PHX_PATH_DIRECT) {
		/* reads go whole blocks into staging: one path */
		if (paths & PHX_PATH_BOUNCE)
			bounce = got;
		else
			direct = got;
	} else if (paths == PHX_PATH_BOUNCE) {
		bounce = got;
	} else {
		/* a write split into bounced sub-block edges and a direct middle */
		uint64_t s = p->io_off, e = p->io_off + got;
		uint64_t m0 = align_up(s, 4096), m1 = align_down(e, 4096);

		bounce = m1 > m0 ? (m0 - s) + (e - m1) : got;
		direct = got - bounce;
	}
	__atomic_or_fetch(&rq->paths, paths, __ATOMIC_RELAXED);
	__atomic_add_fetch(&rq->direct_bytes, direct, __ATOMIC_RELAXED);
	__atomic_add_fetch(&rq->bounce_bytes, bounce, __ATOMIC_RELAXED);
	__atomic_add_fetch(&rq->buffered_bytes, buffered, __ATOMIC_RELAXED);
}

/* A host-async piece is complete (copied, or written). */
void rq_piece_done(struct cu_piece *p)
{
	rq_piece_account(p->rq, p);
	rq_ref_drop(p->rq, 1);
}

/*
 * One more reference, for a thread about to work on @rq with none of its
 * own (c->lock held): a round that just went to the GPU is no longer its
 * lane's to count on - st_kill() may let go of it, and the request end,
 * in the next instant.
 */
void rq_ref_hold_locked(struct cu_req *rq)
{
	__atomic_add_fetch(&rq->pieces, 1, __ATOMIC_RELAXED);
}

/* Drop @n references; the last one ends the request. */
void rq_ref_drop(struct cu_req *rq, int n)
{
	if (n <= 0 || __atomic_sub_fetch(&rq->pieces, n, __ATOMIC_ACQ_REL) != 0)
		return;
	/* a stream op published before its last flag, unless it was killed */
	if (!rq->stream_op || rq->publish_at_release)
		rq_publish(rq);
	rq_release(rq);
}

/* Bytes moved (short at end of file) or the first error. */
int64_t rq_result(const struct cu_req *rq)
{
	int64_t err = __atomic_load_n(&rq->err, __ATOMIC_ACQUIRE);
	uint64_t se = __atomic_load_n(&rq->short_end, __ATOMIC_ACQUIRE);

	if (err)
		return err;
	if (se < rq->end)
		return se > rq->off ? (int64_t)(se - rq->off) : 0;
	return (int64_t)rq->len;
}

/* ------------------------------------------------------------------------ */
/* End                                                                      */
/* ------------------------------------------------------------------------ */

void after_put(phx_cuda *c, struct cu_after *a)
{
	if (a && __atomic_sub_fetch(&a->refs, 1, __ATOMIC_ACQ_REL) == 0) {
		ev_put(c, a->ev);
		free(a);
	}
}

/*
 * The last touch of @c by a request: destroy may go ahead after it.  A
 * member of a group wakes the waiters only as the group's last (its caller
 * waits for nothing else, and nobody else waits for its members) or when
 * nothing is live any more (destroy waits for that): thousands of small
 * pieces then cost one wake-up, not one each.
 */
static void live_dec(phx_cuda *c, struct phx_cuda_io *io, struct cu_group *grp)
{
	bool wake = true;

	pthread_mutex_lock(&c->done_lock);
	if (io) {
		__atomic_store_n(&io->done, 1, __ATOMIC_RELEASE);
		if (c->done_efd >= 0)
			eventfd_write(c->done_efd, 1);
	}
	c->live--;
	if (grp)
		wake = --grp->left == 0 || !c->live;
	if (wake)
		pthread_cond_broadcast(&c->done_cond);
	pthread_mutex_unlock(&c->done_lock);
}

/*
 * Publish the result.  It is in io->result and *bytes_done before anyone
 * is told, and the file is let go of, so a caller may close it as soon as
 * it learns.  A write that failed leaves its range bad: whatever the file
 * holds there now (old bytes, or some of the new ones) is never served.
 */
void rq_publish(struct cu_req *rq)
{
	phx_cuda *c = rq->c;
	struct phx_cuda_io *io = rq->io;
	int64_t res = rq_result(rq);

	if (io) {
		io->result = res;
		io->paths = rq->paths;
		io->direct_bytes = rq->direct_bytes;
		io->bounce_bytes = rq->bounce_bytes;
		io->buffered_bytes = rq->buffered_bytes;
	}
	if (rq->bytes_done)
		*rq->bytes_done = res;
	if (res < 0) {
		stat_add(c, &c->st.errors, 1);
		if (rq->op == PHX_OP_WRITE && rq->cf &&
		    inode_write_result(rq->cf->f->inode, rq->off, rq->len, false))
			stat_add(c, &c->st.bad_marks, 1);
	} else if (rq->op == PHX_OP_READ) {
		stat_add(c, &c->st.reads, 1);
		stat_add(c, &c->st.bytes_read, (uint64_t)res);
	} else {
		stat_add(c, &c->st.writes, 1);
		stat_add(c, &c->st.bytes_written, (uint64_t)res);
	}
	stat_add(c, &c->st.direct_bytes, rq->direct_bytes);
	stat_add(c, &c->st.bounce_bytes, rq->bounce_bytes);
	stat_add(c, &c->st.buffered_bytes, rq->buffered_bytes);
	write_unregister(rq);
	if (rq->cf) {
		cf_put(c, rq->cf);
		rq->cf = NULL;
	}
}

/* Nothing refers to the request any more: hand everything back. */
void rq_release(struct cu_req *rq)
{
	phx_cuda *c = rq->c;
	struct phx_cuda_io *io = rq->owned ? NULL : rq->io;
	phx_cuda_done_fn fn = rq->done_fn;
	void *arg = rq->done_arg;
	struct cu_group *grp = rq->grp;
	int64_t res = fn ? rq_result(rq) : 0;

	rq->state = RQ_DONE;
	if (rq->owned)
		free(rq->io);
	write_unregister(rq);		/* abandoned before it was published */
	if (rq->cf) {
		cf_put(c, rq->cf);
		rq->cf = NULL;
	}
	after_put(c, rq->after);
	pthread_mutex_lock(&c->lock);
	/* an orphan's slot stays taken: its stream may still read its words */
	if (rq->stream_op && !rq->orphan)
		slot_put_locked(c, rq->slot);
	rq_record_put_locked(c, rq);
	pthread_mutex_unlock(&c->lock);
	if (fn)
		fn(arg, res);
	live_dec(c, io, grp);
}

/*
 * Undo a stream op of which nothing was queued: the caller gets the error
 * from the call itself.  An owned io stays the caller's to free.
 */
void rq_abandon(struct cu_req *rq, int err)
{
	if (rq->io && !rq->owned)
		rq->io->result = err;
	if (rq->owned) {
		rq->owned = false;
		rq->io = NULL;
	}
	rq->done_fn = NULL;
	rq_release(rq);
}

/* ------------------------------------------------------------------------ */
/* Ready queues (c->lock held)                                              */
/* ------------------------------------------------------------------------ */

/* [1] arrived stream ops, [0] host-async work; @head for a request a lane goes on cutting. */
void ready_push_locked(phx_cuda *c, struct cu_req *rq, bool head)
{
	int q = rq->stream_op ? 1 : 0;

	if (head) {
		rq->next = c->ready_head[q];
		c->ready_head[q] = rq;
		if (!c->ready_tail[q])
			c->ready_tail[q] = rq;
		return;
	}
	rq->next = NULL;
	if (c->ready_tail[q])
		c->ready_tail[q]->next = rq;
	else
		c->ready_head[q] = rq;
	c->ready_tail[q] = rq;
}

struct cu_req *ready_head_locked(phx_cuda *c, bool stream)
{
	return c->ready_head[stream ? 1 : 0];
}

void ready_pop_locked(phx_cuda *c, bool stream)
{
	int q = stream ? 1 : 0;
	struct cu_req *rq = c->ready_head[q];

	if (!rq)
		return;
	c->ready_head[q] = rq->next;
	if (!c->ready_head[q])
		c->ready_tail[q] = NULL;
	rq->next = NULL;
}
