// SPDX-License-Identifier: Apache-2.0
/*
 * io.c - a request's life: validation, cutting into chunks, issuing them,
 * completing them (continuing short ones), and finishing the request.
 *
 * Every function here runs with eng->lock held.
 */
#include <errno.h>
#include <fcntl.h>
#include <string.h>
#include <unistd.h>

#include "internal.h"

#define OFF_MAX ((uint64_t)INT64_MAX)

int io_validate(struct phx_io *io)
{
	phx_file *f;

	if (!io)
		return phx_err(-EINVAL, "NULL request");
	f = io->file;
	if (!f)
		return phx_err(-EBADF, "request without a file");
	if (io->op != PHX_OP_READ && io->op != PHX_OP_WRITE)
		return phx_err(-EINVAL, "unknown op %u", io->op);
	if (io->flags & ~(uint32_t)PHX_IO_NO_POLL)
		return phx_err(-EINVAL, "unknown request flags 0x%x", io->flags);
	if (!io->buf && io->len)
		return phx_err(-EFAULT, "NULL buffer");
	if (io->offset > OFF_MAX || io->len > OFF_MAX - io->offset)
		return phx_err(-EINVAL, "offset %llu + length %zu overflows",
			       (unsigned long long)io->offset, io->len);
	if (io->op == PHX_OP_READ && !f->readable)
		return phx_err(-EBADF, "file is not open for reading");
	if (io->op == PHX_OP_WRITE && !f->writable)
		return phx_err(-EBADF, "file is not open for writing");
	if (f->direct && align_down(f->eng->cfg.bounce_size, f->offset_align) == 0)
		return phx_err(-EINVAL, "file alignment %u exceeds the bounce size %u",
			       f->offset_align, f->eng->cfg.bounce_size);
	return 0;
}

static enum io_mode io_choose_mode(struct phx_io *io, struct io_priv *p)
{
	phx_file *f = io->file;
	uint64_t a = f->offset_align, m = f->mem_align;
	uintptr_t addr = (uintptr_t)io->buf;
	uint64_t h, t;

	if (!f->direct)
		return MODE_BUFFERED;
	if (io->offset % a == 0 && io->len % a == 0 && addr % m == 0)
		return MODE_DIRECT;
	/*
	 * The aligned middle can go straight to the caller's memory when that
	 * memory is aligned where the middle starts.
	 */
	h = align_up(io->offset, a);
	t = align_down(p->end, a);
	if (h < t && (addr + (h - io->offset)) % m == 0) {
		p->mid0 = h;
		p->mid1 = t;
		return MODE_SPLIT;
	}
	return MODE_BOUNCE;
}

static void io_finish(phx_engine *eng, struct phx_io *io);
static void io_publish(phx_engine *eng, struct phx_io *io, int64_t result);

void io_start(phx_engine *eng, struct phx_io *io, bool async)
{
	struct io_priv *p = io_priv(io);

	memset(p, 0, sizeof(*p));
	io->result = 0;
	io->paths = 0;
	__atomic_store_n(&io->done, 0, __ATOMIC_RELAXED);
	p->cursor = io->offset;
	p->end = io->offset + io->len;
	p->eof = UINT64_MAX;
	p->async = async;
	p->pollable = async && !(io->flags & PHX_IO_NO_POLL);
	p->mode = io_choose_mode(io, p);
	io->file->refs++;
	/* a range whose last write failed holds no data anyone may read (inode.c) */
	if (io->op == PHX_OP_READ && inode_bad_check(io->file->inode, io->offset, io->len)) {
		p->err = -EIO;
		eng->st.bad_refusals++;
	}
	if (!io->len || p->err) {
		io_finish(eng, io);
		return;
	}
	p->queued = 1;
	if (eng->pend_tail)
		io_priv(eng->pend_tail)->next = io;
	else
		eng->pend_head = io;
	eng->pend_tail = io;
}

/* ------------------------------------------------------------------------ */
/* Cutting chunks                                                           */
/* ------------------------------------------------------------------------ */

/*
 * A partial block that cannot be read back whole: the caller's bytes of it,
 * and no others, go through the page cache (CH_PC_WRITE, then CH_PC_SYNC and
 * CH_PC_DROP).  Nothing past the caller's end is written and nothing is cut
 * back later, so a file that another writer grew meanwhile keeps its bytes.
 */
static int chunk_to_pc(struct chunk *c)
{
	struct phx_io *io = c->io;
	int fd = file_alt_fd(io->file);

	if (fd < 0)
		return fd;
	c->kind = CH_PC_WRITE;
	c->op = PHX_OP_WRITE;
	c->alt = true;
	c->dev_off = c->user_off;
	c->dev_len = c->user_len;
	c->mem = (char *)io->buf + (c->user_off - io->offset);
	c->done = 0;
	c->buf_index = -1;
	io->paths |= PHX_PATH_BUFFERED;
	return 0;
}

/*
 * Describe the next chunk of @io into @n; nothing is claimed yet.  Returns
 * 0, or -errno when the request cannot go on.
 */
static int io_cut(phx_engine *eng, struct phx_io *io, struct chunk *n)
{
	struct io_priv *p = io_priv(io);
	phx_file *f = io->file;
	uint64_t cur = p->cursor, a = f->offset_align, seg_end, d0, d1, ue;

	memset(n, 0, sizeof(*n));
	n->io = io;
	n->op = io->op;
	n->bounce = -1;
	n->buf_index = -1;
	if (p->mode == MODE_DIRECT || p->mode == MODE_BUFFERED ||
	    (p->mode == MODE_SPLIT && cur >= p->mid0 && cur < p->mid1)) {
		uint64_t lim = p->mode == MODE_SPLIT ? p->mid1 : p->end;

		n->kind = p->mode == MODE_BUFFERED ? CH_BUFFERED : CH_DIRECT;
		n->dev_off = n->user_off = cur;
		n->dev_len = n->user_len = lim - cur < eng->cfg.max_io_size ?
			lim - cur : eng->cfg.max_io_size;
		n->mem = (char *)io->buf + (cur - io->offset);
		return 0;
	}
	seg_end = p->mode == MODE_SPLIT && cur < p->mid0 ? p->mid0 : p->end;
	d0 = align_down(cur, a);
	d1 = align_up(seg_end, a);
	if (d1 - d0 > align_down(eng->cfg.bounce_size, a))
		d1 = d0 + align_down(eng->cfg.bounce_size, a);
	ue = seg_end < d1 ? seg_end : d1;
	n->dev_off = d0;
	n->dev_len = d1 - d0;
	n->user_off = cur;
	n->user_len = ue - cur;
	if (io->op == PHX_OP_READ) {
		n->kind = CH_BOUNCE_READ;
	} else if (cur == d0 && ue == d1) {
		n->kind = CH_BOUNCE_WRITE;
	} else if (!f->can_read_back) {
		/* Write-only descriptor: the blocks cannot be read for a merge. */
		return chunk_to_pc(n);
	} else {
		n->kind = CH_RMW_READ;
		n->op = PHX_OP_READ;
	}
	return 0;
}

static int user_buf_index(phx_engine *eng, const char *mem, uint64_t len)
{
	uint32_t i;

	for (i = 0; i < PHX_USER_BUF_SLOTS; i++) {
		const struct user_buf *b = &eng->ubufs[i];

		if (b->len && mem >= b->addr && mem + len <= b->addr + b->len)
			return b->index;
	}
	return -1;
}

/* Describe the chunk's (remaining) device op and hand it to the backend. */
static void chunk_prep(phx_engine *eng, struct chunk *c)
{
	phx_file *f = c->io->file;
	struct devop *d = &c->dop;

	d->fd = c->alt ? f->alt_fd : f->fd;
	d->slot = c->alt ? -1 : f->slot;
	d->buf_index = -1;
	if (c->kind == CH_PC_SYNC || c->kind == CH_PC_DROP) {
		/*
		 * The whole claim: no folio in it may stay dirty, and every
		 * folio the write touched lies inside it (inode.c).
		 */
		d->kind = c->kind == CH_PC_SYNC ? DOP_SYNC_RANGE : DOP_DONTNEED;
		d->mem = NULL;
		d->off = c->wr.off;
		d->len = c->wr.len;
	} else {
		d->kind = c->op == PHX_OP_READ ? DOP_READ : DOP_WRITE;
		d->buf_index = c->buf_index;
		d->mem = c->mem + c->done;
		d->off = c->dev_off + c->done;
		d->len = c->dev_len - c->done;
	}
	eng->st.sqes++;
	eng->be->queue(eng, c);
}

/*
 * A write's claim on its byte range (inode.c): the exact range for whole
 * blocks written directly; rounded out to folios for what reads blocks back
 * or goes through the page cache.
 */
static void chunk_range(phx_engine *eng, struct chunk *c)
{
	phx_file *f = c->io->file;
	uint64_t g = f->folio_align;

	c->wr.owner = eng;
	switch (c->kind) {
	case CH_RMW_READ:
		c->wr.wclass = WC_RMW;
		break;
	case CH_PC_WRITE:
	case CH_BUFFERED:
		c->wr.wclass = WC_PAGECACHE;
		break;
	default:
		c->wr.wclass = WC_DIRECT;
		c->wr.off = c->dev_off;
		c->wr.len = c->dev_len;
		return;
	}
	c->wr.off = align_down(c->dev_off, g);
	c->wr.len = align_up(c->dev_off + c->dev_len, g) - c->wr.off;
}

static bool needs_bounce(const struct chunk *c)
{
	return c->kind == CH_BOUNCE_READ || c->kind == CH_BOUNCE_WRITE ||
	       c->kind == CH_RMW_READ;
}

/* Claim resources for a described chunk; false if it must wait. */
static bool chunk_claim(phx_engine *eng, struct chunk *n)
{
	struct chunk *c = eng->free_chunks;
	bool foreign = false;

	if (!c)
		return false;
	if (needs_bounce(n) && !eng->nbounce_free)
		return false;
	if (n->io->op == PHX_OP_WRITE) {
		/* Claimed in place: the claim links the chunk's own wrange. */
		struct chunk *next = c->next_free;

		*c = *n;
		chunk_range(eng, c);
		if (inode_claim(c->io->file->inode, &c->wr, &foreign)) {
			c->next_free = next;
			/* Another engine's write is in the way: come back for it. */
			if (foreign)
				engine_arm_tick(eng);
			return false;
		}
		eng->free_chunks = next;
	} else {
		eng->free_chunks = c->next_free;
		*c = *n;
	}
	c->in_use = true;
	if (needs_bounce(c)) {
		c->bounce = eng->bounce_free[--eng->nbounce_free];
		c->mem = eng->bounce_mem + (size_t)c->bounce * eng->cfg.bounce_size;
		if (eng->features & PHX_FEAT_FIXED_BUFS)
			c->buf_index = c->bounce;
		c->io->paths |= PHX_PATH_BOUNCE;
	} else {
		c->buf_index = c->kind == CH_DIRECT ?
			user_buf_index(eng, c->mem, c->dev_len) : -1;
		c->io->paths |= c->kind == CH_DIRECT ? PHX_PATH_DIRECT : PHX_PATH_BUFFERED;
	}
	if (c->kind == CH_BOUNCE_WRITE)
		memcpy(c->mem, (char *)c->io->buf + (c->user_off - c->io->offset),
		       c->user_len);
	io_priv(c->io)->chunks++;
	eng->inflight++;
	chunk_prep(eng, c);
	return true;
}

static void pend_pop(phx_engine *eng)
{
	struct phx_io *io = eng->pend_head;

	eng->pend_head = io_priv(io)->next;
	if (!eng->pend_head)
		eng->pend_tail = NULL;
	io_priv(io)->next = NULL;
	io_priv(io)->queued = 0;
}

/*
 * Issue chunks from the pending queue, in order, until the queue depth is
 * reached or the head chunk must wait (no bounce buffer, or a write in
 * flight on the range it must claim).
 */
void io_fill(phx_engine *eng)
{
	struct chunk n;
	int ret;

	while (eng->pend_head && eng->free_chunks) {
		struct phx_io *io = eng->pend_head;
		struct io_priv *p = io_priv(io);

		/* Past an error or end of file nothing more is worth reading. */
		if (p->err || p->eof <= p->cursor)
			p->cursor = p->end;
		if (p->cursor >= p->end) {
			pend_pop(eng);
			if (!p->chunks)
				io_finish(eng, io);
			continue;
		}
		ret = io_cut(eng, io, &n);
		if (ret) {
			p->err = ret;
			continue;
		}
		if (!chunk_claim(eng, &n))
			break;
		p->cursor = n.user_off + n.user_len;
	}
}

/* ------------------------------------------------------------------------ */
/* Completion                                                               */
/* ------------------------------------------------------------------------ */

static void bounce_put(phx_engine *eng, struct chunk *c)
{
	if (c->bounce >= 0)
		eng->bounce_free[eng->nbounce_free++] = c->bounce;
	c->bounce = -1;
}

static void chunk_release(phx_engine *eng, struct chunk *c)
{
	bounce_put(eng, c);
	inode_release(c->io->file->inode, &c->wr);
	c->in_use = false;
	c->next_free = eng->free_chunks;
	eng->free_chunks = c;
	eng->inflight--;
}

static void note_eof(struct io_priv *p, uint64_t at)
{
	if (at < p->eof)
		p->eof = at;
}

static void chunk_done(phx_engine *eng, struct chunk *c);

/* The read half of a read-modify-write finished: merge and write back. */
static void rmw_merge(phx_engine *eng, struct chunk *c)
{
	struct phx_io *io = c->io;
	struct io_priv *p = io_priv(io);
	int ret;

	eng->st.rmw_ios++;
	if (c->done < c->dev_len) {
		/*
		 * The file ends inside these blocks: writing them whole would
		 * put bytes past the caller's end.  The caller's bytes go
		 * through the page cache instead (the claim, rounded out to
		 * pages when it was made, already covers them).
		 */
		bounce_put(eng, c);
		ret = chunk_to_pc(c);
		if (ret) {
			if (!p->err)
				p->err = ret;
			chunk_done(eng, c);
			return;
		}
		chunk_prep(eng, c);
		return;
	}
	memcpy(c->mem + (c->user_off - c->dev_off),
	       (char *)io->buf + (c->user_off - io->offset), c->user_len);
	c->kind = CH_BOUNCE_WRITE;
	c->op = PHX_OP_WRITE;
	c->done = 0;
	chunk_prep(eng, c);
}

/* Copy what a bounce read brought in to the caller; returns bytes copied. */
static uint64_t bounce_copy_out(struct chunk *c)
{
	struct phx_io *io = c->io;
	uint64_t valid_end = c->dev_off + c->done, uend = c->user_off + c->user_len;
	uint64_t end = uend < valid_end ? uend : valid_end;

	if (end <= c->user_off)
		return 0;
	memcpy((char *)io->buf + (c->user_off - io->offset),
	       c->mem + (c->user_off - c->dev_off), end - c->user_off);
	return end - c->user_off;
}

/* @moved bytes of a request went by @path: its own count and the engine's. */
static void path_add(phx_engine *eng, struct io_priv *p, enum io_path path, uint64_t moved)
{
	p->bytes[path] += moved;
	if (path == IOP_DIRECT)
		eng->st.direct_bytes += moved;
	else if (path == IOP_BOUNCE)
		eng->st.bounce_bytes += moved;
	else
		eng->st.buffered_bytes += moved;
}

/* A chunk's device op is over (complete, at EOF, or failed). */
static void chunk_done(phx_engine *eng, struct chunk *c)
{
	struct phx_io *io = c->io;
	struct io_priv *p = io_priv(io);
	uint64_t moved = 0;

	if (!p->err) {
		switch (c->kind) {
		case CH_BOUNCE_READ:
			moved = bounce_copy_out(c);
			if (c->done < c->dev_len)
				note_eof(p, c->dev_off + c->done);
			path_add(eng, p, IOP_BOUNCE, moved);
			break;
		case CH_BOUNCE_WRITE:
			moved = c->user_len;
			path_add(eng, p, IOP_BOUNCE, moved);
			break;
		case CH_PC_WRITE:
		case CH_PC_SYNC:
		case CH_PC_DROP:
			moved = c->user_len;
			path_add(eng, p, IOP_BUFFERED, moved);
			break;
		default:
			moved = c->done;
			if (c->op == PHX_OP_READ && c->done < c->dev_len)
				note_eof(p, c->dev_off + c->done);
			path_add(eng, p, c->kind == CH_DIRECT ? IOP_DIRECT : IOP_BUFFERED, moved);
			break;
		}
	}
	p->chunks--;
	chunk_release(eng, c);
	if (!p->chunks && !p->queued)
		io_finish(eng, io);
}

/* The flush steps after a page-cache write of a partial block. */
static void pc_step(phx_engine *eng, struct chunk *c, int res)
{
	struct io_priv *p = io_priv(c->io);

	if (c->kind == CH_PC_SYNC) {
		if (res < 0 && !p->err)
			p->err = res;
		if (!p->err) {
			c->kind = CH_PC_DROP;
			chunk_prep(eng, c);
			return;
		}
	}
	/* DONTNEED only keeps the page cache small: its failure loses nothing. */
	chunk_done(eng, c);
}

void io_complete_op(phx_engine *eng, struct chunk *c, int res)
{
	struct io_priv *p = io_priv(c->io);
	uint64_t a = c->io->file->offset_align;

	if (res == -EAGAIN || res == -EINTR) {
		chunk_prep(eng, c);
		return;
	}
	if (c->kind == CH_PC_SYNC || c->kind == CH_PC_DROP) {
		pc_step(eng, c, res);
		return;
	}
	if (res < 0) {
		if (!p->err)
			p->err = res;
		chunk_done(eng, c);
		return;
	}
	if (res == 0 && c->op == PHX_OP_WRITE) {
		if (!p->err)
			p->err = -EIO;
		chunk_done(eng, c);
		return;
	}
	c->done += (uint64_t)res;
	/*
	 * Continue a short transfer - unless it is a read that stopped at end
	 * of file: nothing came back, or (O_DIRECT) it stopped off a block
	 * boundary, which only happens at the end of the file.
	 */
	if (c->done < c->dev_len && res > 0 &&
	    !(c->op == PHX_OP_READ && c->io->file->direct && c->done % a)) {
		eng->st.short_ios++;
		chunk_prep(eng, c);
		return;
	}
	if (c->kind == CH_RMW_READ && !p->err) {
		rmw_merge(eng, c);
		return;
	}
	if (c->kind == CH_PC_WRITE && !p->err) {
		c->kind = CH_PC_SYNC;
		chunk_prep(eng, c);
		return;
	}
	chunk_done(eng, c);
}

static void io_finish(phx_engine *eng, struct phx_io *io)
{
	struct io_priv *p = io_priv(io);
	int64_t result;

	if (p->err) {
		result = p->err;
		eng->st.errors++;
	} else if (io->op == PHX_OP_READ) {
		uint64_t end = p->eof < p->end ? p->eof : p->end;

		result = end > io->offset ? (int64_t)(end - io->offset) : 0;
		eng->st.reads++;
		eng->st.bytes_read += result;
	} else {
		result = (int64_t)io->len;
		eng->st.writes++;
		eng->st.bytes_written += result;
	}
	if (io->paths & PHX_PATH_BOUNCE)
		eng->st.bounce_ios++;
	/* a failed write leaves its range bad; a good one makes it good again */
	if (io->op == PHX_OP_WRITE &&
	    inode_write_result(io->file->inode, io->offset, io->len, !p->err))
		eng->st.bad_marks++;
	io->file->refs--;
	io_publish(eng, io, result);
}

/* Hand a finished request to whoever waits for it. */
static void io_publish(phx_engine *eng, struct phx_io *io, int64_t result)
{
	struct io_priv *p = io_priv(io);

	io->result = result;
	if (p->pollable) {
		p->next = NULL;
		if (eng->poll_tail)
			io_priv(eng->poll_tail)->next = io;
		else
			eng->poll_head = io;
		eng->poll_tail = io;
	}
	if (p->async)
		engine_notify(eng);
	/* Last: a waiter may free the request as soon as it sees this. */
	__atomic_store_n(&io->done, 1, __ATOMIC_RELEASE);
}

/* A request refused before it started: complete it with @err. */
void io_fail(phx_engine *eng, struct phx_io *io, int err, bool async)
{
	struct io_priv *p = io_priv(io);

	memset(p, 0, sizeof(*p));
	io->paths = 0;
	p->async = async;
	p->pollable = async && !(io->flags & PHX_IO_NO_POLL);
	eng->st.errors++;
	io_publish(eng, io, err);
}
