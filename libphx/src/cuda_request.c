// SPDX-License-Identifier: Apache-2.0
/*
 * cuda_request.c - the life cycle of one GPU request, start to end.
 *
 * A request moves bytes between a file range and GPU memory through the
 * context's pinned staging buffers.  Its states (struct cu_req.state):
 *
 *   host-async (phx_cuda_submit, _submit_after, _pread, _pwrite)
 *     rq_host() checks the arguments now and takes a reference on the file
 *     ------------------------------------------------------> RQ_READY
 *
 *   stream-ordered (phx_cuda_submit_stream, _read_async, _write_async)
 *     rq_stream() queues two things on the caller's stream: a host function
 *     (arrive_fn, which only links the request into the ready queue and
 *     wakes a lane; it never waits for anything) and a cuStreamWaitValue32
 *     on the request's completion flag.                       RQ_WAITING
 *     The stream reaches the host function: all work queued before is done.
 *                                                             RQ_ARRIVED
 *     A lane reads the arguments now (cuFile semantics: the pointed-to size,
 *     file offset and buffer offset are taken when the stream gets there)
 *     and checks them: rq_resolve().                          RQ_READY
 *
 *   both
 *     Lanes cut the request into pieces that fit a staging buffer, packing
 *     small requests together (rq_cut(), under c->lock).  Once every byte
 *     is handed out:                                          RQ_CUT
 *     Each piece: file I/O and a copy (reads: file -> staging -> GPU;
 *     writes: GPU -> staging -> file).  rq_piece_io() judges the file I/O
 *     (end of file is found here, by a short read, never by an fstat at
 *     submission), rq_piece_done() counts the piece once its copy, or its
 *     write, is complete; the last one calls rq_finish().
 *     rq_finish(): the result is the bytes moved (short at end of file) or
 *     the first error of any piece, copy errors included.  It is stored in
 *     io->result and *bytes_done *before* the completion flag is raised, so
 *     it is valid once the caller's stream has passed the operation; then
 *     the file reference is dropped and the caller is told (io->done).
 *                                                             RQ_DONE
 *
 * Files.  Every request holds its file through a struct cu_file (one per
 * caller phx_file): phx_file_hold() keeps phx_file_close() failing with
 * -EBUSY while GPU I/O on it is queued or in flight, and each lane adopts
 * the fd once per cu_file (phx_file_from_fd on the lane's engine) instead of
 * once per request.  The entry lives while requests use it, or while the
 * file is registered (phx_cuda_file_register).
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/stat.h>

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

CU_EXPORT int phx_cuda_file_register(phx_cuda *c, phx_file *f)
{
	struct cu_file *cf;
	int err = 0;

	if (!c || !f)
		return cu_err(-EINVAL, "phx_cuda_file_register: NULL argument");
	cf = cf_get(c, f, &err);
	if (!cf)
		return err;
	pthread_mutex_lock(&c->lock);
	cf->registrations++;
	pthread_mutex_unlock(&c->lock);
	return 0;
}

CU_EXPORT int phx_cuda_file_deregister(phx_cuda *c, phx_file *f)
{
	struct cu_file *cf;

	if (!c || !f)
		return cu_err(-EINVAL, "phx_cuda_file_deregister: NULL argument");
	pthread_mutex_lock(&c->lock);
	cf = cf_find_locked(c, f);
	if (!cf || !cf->registrations) {
		pthread_mutex_unlock(&c->lock);
		return cu_err(-ENOENT, "file is not registered with this context");
	}
	cf->registrations--;
	pthread_mutex_unlock(&c->lock);
	cf_put(c, cf);
	return 0;
}

/* ------------------------------------------------------------------------ */
/* Device memory checks                                                     */
/* ------------------------------------------------------------------------ */

/*
 * @p .. @p + @len must be device memory of the context's device, inside one
 * allocation.  @range (may be NULL) caches the last allocation checked, so
 * a batch of pieces of one buffer costs the driver queries once.
 */
int cu_check_devptr(phx_cuda *c, uint64_t p, size_t len, uint64_t range[2])
{
	const struct cu_driver *d = c->d;
	unsigned int mtype = 0;
	CUdeviceptr base = 0;
	size_t size = 0;
	int ord = -1;
	CUresult r;

	if (range && p >= range[0] && p + len <= range[1] && p + len >= p)
		return 0;
	r = d->PointerGetAttribute(&mtype, CU_POINTER_ATTRIBUTE_MEMORY_TYPE, p);
	if (r != CUDA_SUCCESS || (mtype != CU_MEMORYTYPE_DEVICE && mtype != CU_MEMORYTYPE_UNIFIED))
		return cu_err(-EINVAL, "0x%llx is not CUDA device memory",
			      (unsigned long long)p);
	r = d->PointerGetAttribute(&ord, CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, p);
	if (r == CUDA_SUCCESS && ord != c->cfg.device)
		return cu_err(-EXDEV, "memory of device %d given to the context of device %d",
			      ord, c->cfg.device);
	r = d->MemGetAddressRange(&base, &size, p);
	if (r != CUDA_SUCCESS)
		return cu_fail(d, r, "cuMemGetAddressRange");
	if (p + len < p || p + len > base + size)
		return cu_err(-EFAULT, "0x%llx + %zu runs past its allocation (%zu bytes at 0x%llx)",
			      (unsigned long long)p, len, size, (unsigned long long)base);
	if (range) {
		range[0] = base;
		range[1] = base + size;
	}
	return 0;
}

/* ------------------------------------------------------------------------ */
/* Birth                                                                    */
/* ------------------------------------------------------------------------ */

static struct cu_req *rq_alloc(phx_cuda *c)
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
		rq->pieces = 1;		/* dropped once every piece is handed out */
	}
	return rq;
}

static void live_inc(phx_cuda *c)
{
	pthread_mutex_lock(&c->done_lock);
	c->live++;
	pthread_mutex_unlock(&c->done_lock);
}

/* The ready queue (c->lock held): arrivals and new work at the tail... */
void ready_push_tail_locked(phx_cuda *c, struct cu_req *rq)
{
	rq->next = NULL;
	if (c->ready_tail)
		c->ready_tail->next = rq;
	else
		c->ready_head = rq;
	c->ready_tail = rq;
}

/* ...and a request a lane goes on cutting (or restarts) back at the head. */
void ready_push_head_locked(phx_cuda *c, struct cu_req *rq)
{
	rq->next = c->ready_head;
	c->ready_head = rq;
	if (!c->ready_tail)
		c->ready_tail = rq;
}

/* The byte range a stream op moves, once its arguments are read. */
static void rq_set_range(struct cu_req *rq, uint64_t devptr, uint64_t off, uint64_t len)
{
	rq->devptr = devptr;
	rq->off = off;
	rq->len = len;
	rq->end = off + len;
	rq->cursor = off;
}

/* A write accepted on @rq->cf: early reads of the file stand back (c->lock). */
static void write_track_locked(struct cu_req *rq)
{
	if (rq->op != PHX_OP_WRITE || rq->wtracked)
		return;
	rq->cf->writes_live++;
	rq->cf->write_gen++;
	rq->wtracked = true;
}

/* The write is in the file (or never was queued). */
static void write_untrack(struct cu_req *rq)
{
	if (!rq->wtracked || !rq->cf)
		return;
	pthread_mutex_lock(&rq->c->lock);
	rq->cf->writes_live--;
	rq->wtracked = false;
	pthread_mutex_unlock(&rq->c->lock);
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
 * (zero length).  Queue it with rq_queue().  *@cfp is the caller's file
 * entry for a batch (NULL at first; cf_put() it after the batch), so a
 * batch on one file looks the entry up once and keeps it alive throughout.
 */
int rq_host(phx_cuda *c, struct phx_cuda_io *io, struct cu_after *after,
	    uint64_t range[2], struct cu_file **cfp, struct cu_req **out)
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
	rq = rq_alloc(c);
	if (!rq)
		return cu_err(-ENOMEM, "out of memory");
	rq->cf = *cfp;
	rq->op = (uint8_t)io->op;
	pthread_mutex_lock(&c->lock);
	(*cfp)->refs++;
	write_track_locked(rq);
	pthread_mutex_unlock(&c->lock);
	/* accepted: from here on it always completes */
	io->done = 0;
	io->result = 0;
	rq->io = io;
	rq_set_range(rq, io->devptr, io->offset, io->len);
	if (after) {
		__atomic_add_fetch(&after->refs, 1, __ATOMIC_RELAXED);
		rq->after = after;
	}
	live_inc(c);
	if (!rq->len) {
		rq->pieces = 0;
		rq_finish(rq);
		return 0;
	}
	rq->state = RQ_READY;
	*out = rq;
	return 0;
}

/* Diagnosis (PHX_CUDA_TRACE=1): note when a stream op passes @pt. */
void rq_trace(struct cu_req *rq, int pt)
{
	if (rq->c->trace && rq->stream_op && !rq->trace[pt])
		rq->trace[pt] = phx_now_ns();
}

/* The milestones of one stream op, in microseconds after it was queued. */
static void rq_trace_print(struct cu_req *rq)
{
	const int64_t *t = rq->trace;
	int64_t t0 = t[TR_QUEUED];
	char line[256];
	int i, n;

	if (!rq->c->trace || !rq->stream_op)
		return;
	n = snprintf(line, sizeof(line), "phx-trace %s rounds=%u us:",
		     rq->op == PHX_OP_READ ? "read" : "write", rq->nstages);
	for (i = 1; i < RQ_TRACE_N && n > 0 && n < (int)sizeof(line); i++)
		n += snprintf(line + n, sizeof(line) - n, " %lld",
			      t[i] ? (long long)(t[i] - t0) / 1000 : -1LL);
	fprintf(stderr, "%s\n", line);
}

/* CUDA's callback thread: the caller's stream reached the request. */
static void arrive_fn(void *arg)
{
	struct cu_req *rq = arg;
	phx_cuda *c = rq->c;

	rq_trace(rq, TR_ARRIVED);

	pthread_mutex_lock(&c->lock);
	rq->state = RQ_ARRIVED;
	ready_push_tail_locked(c, rq);
	pthread_mutex_unlock(&c->lock);
	lanes_wake(c, 1);
}

/*
 * CUDA's callback thread: the stream ran round @st's kernel.  A round with a
 * staging buffer hands it back to its lane (a read's buffer is free, a
 * write's bytes can go to the file); one without is over.
 */
static void stage_done_fn(void *arg)
{
	struct cu_stage *st = arg;
	struct cu_sbuf *b = __atomic_load_n(&st->b, __ATOMIC_ACQUIRE);

	rq_trace(st->rq, TR_DONE0);

	if (b) {
		__atomic_store_n(&st->gpu_done, 1, __ATOMIC_RELEASE);
		eventfd_write(b->ln->efd, 1);
	} else {
		rq_piece_done_ref(st->rq);
	}
}

/* CUDA's callback thread: the stream is past the request's last operation. */
static void release_fn(void *arg)
{
	rq_trace(arg, TR_RELEASE);
	rq_trace_print(arg);
	rq_piece_done_ref(arg);
}

/* How many staging rounds a request of @size at any offset can need. */
static uint32_t rounds_for(phx_cuda *c, uint64_t size, uint32_t align)
{
	uint64_t n = (size + 2ull * align + c->cfg.buf_size - 1) / c->cfg.buf_size;

	return n < 1 ? 1 : n > CU_MAX_STAGES ? CU_MAX_STAGES : (uint32_t)n;
}

/*
 * Queue the request's GPU work on @s, all of it, now: the arrival host
 * function, then per round a flag wait, the copy kernel and a host
 * function, then (writes) a wait for the file side and the release host
 * function.  Returns how many host functions that hold a reference were
 * queued (stage_done_fn and release_fn), or -errno if not even the arrival
 * could be queued.
 */
static int stream_enqueue(phx_cuda *c, struct cu_req *rq, CUstream s, int *queued)
{
	const struct cu_driver *d = c->d;
	CUdeviceptr flag = c->flags_d + 4ull * rq->slot;
	unsigned threads = c->copy_threads;
	CUresult r;
	uint32_t k;

	*queued = 0;
	r = d->LaunchHostFunc(s, arrive_fn, rq);
	if (r != CUDA_SUCCESS)
		return cu_fail(d, r, "cuLaunchHostFunc (stream-ordered request)");
	for (k = 0; k < rq->nstages; k++) {
		CUdeviceptr desc = c->descs_d + (uint64_t)rq->stages[k].desc * sizeof(struct cu_copy_desc);
		void *params[] = { &desc };

		r = d->StreamWaitValue32(s, flag, rq->seq + 1 + k, CU_STREAM_WAIT_VALUE_GEQ);
		if (r == CUDA_SUCCESS)
			r = d->LaunchKernel(c->copy_fn, c->copy_blocks, 1, 1, threads, 1, 1, 0, s,
					    params, NULL);
		if (r == CUDA_SUCCESS)
			r = d->LaunchHostFunc(s, stage_done_fn, &rq->stages[k]);
		if (r != CUDA_SUCCESS)
			goto broken;
		(*queued)++;
	}
	if (rq->op == PHX_OP_WRITE) {
		r = d->StreamWaitValue32(s, flag, rq->seq + 1 + rq->nstages,
					 CU_STREAM_WAIT_VALUE_GEQ);
		if (r != CUDA_SUCCESS)
			goto broken;
	}
	r = d->LaunchHostFunc(s, release_fn, rq);
	if (r != CUDA_SUCCESS)
		goto broken;
	(*queued)++;
	return 0;
broken:
	/* the request arrives anyway and fails there; what is queued runs */
	rq_fail(rq, cu_fail(d, r, "queueing a stream-ordered request"));
	return 0;
}

static void early_begin(struct cu_req *rq);

/*
 * A stream-ordered request on @s.  With @io set and not @owned
 * (phx_cuda_submit_stream) its fields are the arguments; otherwise the
 * pointers are.  Either way they are read when the stream gets there; the
 * values now only size the rounds queued (a request that needs more rounds
 * when it arrives, because its size grew, fails with -EINVAL).  Returns 0
 * once queued: from then on the request always finishes, with its result in
 * *@bytes_done / io->result.
 */
int rq_stream(phx_cuda *c, struct phx_cuda_io *io, bool owned, phx_file *f,
	      uint32_t op, uint64_t base, const size_t *size_p,
	      const int64_t *foff_p, const int64_t *boff_p, int64_t *bytes_done,
	      CUstream s)
{
	struct cu_req *rq;
	uint64_t planned, range[2] = { 0, 0 }, probe;
	int ret, err = 0, queued;
	uint32_t k, slots;

	if (!c->memops)
		return cu_err(-ENOTSUP, "stream-ordered I/O needs stream memory operations (cuStreamWaitValue32) and the copy kernel, which this context does not have");
	if (!f)
		return cu_err(-EINVAL, "NULL file");
	if (op != PHX_OP_READ && op != PHX_OP_WRITE)
		return cu_err(-EINVAL, "unknown op %u", op);
	if (!io && (!size_p || !foff_p || !boff_p))
		return cu_err(-EINVAL, "NULL size or offset pointer");
	planned = io && !owned ? io->len : *size_p;
	probe = io && !owned ? io->devptr : base;
	/* the allocation, found now: lanes check against it without CUDA calls */
	if (probe) {
		ret = cu_check_devptr(c, probe, 1, range);
		if (ret)
			return ret;
	}
	rq = rq_alloc(c);
	if (!rq)
		return cu_err(-ENOMEM, "out of memory");
	rq->cf = cf_get(c, f, &err);
	if (!rq->cf) {
		free(rq);
		return err;
	}
	rq->io = io;
	rq->owned = owned;
	rq->stream_op = true;
	rq->io_args = io && !owned;
	rq->op = (uint8_t)op;
	rq->base = base;
	rq->size_p = size_p;
	rq->foff_p = foff_p;
	rq->boff_p = boff_p;
	rq->bytes_done = bytes_done;
	rq->alloc_lo = range[0];
	rq->alloc_hi = range[1];
	rq->state = RQ_WAITING;
	rq->nstages = rounds_for(c, planned, rq->cf->align);
	rq->stages = calloc(rq->nstages, sizeof(*rq->stages));
	if (!rq->stages) {
		cf_put(c, rq->cf);
		free(rq);
		return cu_err(-ENOMEM, "out of memory");
	}
	for (k = 0; k < rq->nstages; k++) {
		rq->stages[k].rq = rq;
		rq->stages[k].index = k;
	}
	ret = descs_get(c, rq->stages, rq->nstages);
	if (ret) {
		cf_put(c, rq->cf);
		free(rq->stages);
		free(rq);
		return ret;
	}
	ret = slot_get(c, &rq->slot, &rq->seq);
	if (ret) {
		pthread_mutex_lock(&c->lock);
		descs_put_locked(c, rq->stages, rq->nstages);
		pthread_mutex_unlock(&c->lock);
		cf_put(c, rq->cf);
		free(rq->stages);
		free(rq);
		return ret;
	}
	/* the slot's counter moves on by every round (and the file side) */
	slots = rq->nstages + (op == PHX_OP_WRITE ? 1 : 0);
	pthread_mutex_lock(&c->lock);
	c->slot_seq[rq->slot] = rq->seq + slots;
	write_track_locked(rq);
	pthread_mutex_unlock(&c->lock);
	rq->raised = rq->seq;
	if (io) {
		io->done = 0;
		io->result = 0;
	}
	/*
	 * References: cutting (1), each round's host function, the release
	 * host function, and this call's own while it queues.
	 */
	rq->pieces = 1 + (int)rq->nstages + 1 + 1;
	live_inc(c);
	rq_trace(rq, TR_QUEUED);

	ret = ctx_push(c);
	if (!ret) {
		ret = stream_enqueue(c, rq, s, &queued);
		ctx_pop(c);
	}
	if (ret) {
		rq_abandon(rq, ret);
		return ret;
	}
	stat_add(c, &c->st.stream_ops, 1);
	if (op == PHX_OP_READ && __atomic_load_n(&c->early_reads, __ATOMIC_RELAXED))
		early_begin(rq);	/* this call's reference keeps it alive */
	/* host functions never queued never drop their references */
	rq_piece_done_n(rq, (int)(rq->nstages + 1) - queued + 1);
	return 0;
}

/* Link host-async requests into the ready queue and wake lanes for them. */
void rq_queue(phx_cuda *c, struct cu_req **rqs, size_t n)
{
	uint64_t bytes = 0;
	size_t i;

	if (!n)
		return;
	pthread_mutex_lock(&c->lock);
	for (i = 0; i < n; i++) {
		ready_push_tail_locked(c, rqs[i]);
		bytes += rqs[i]->len;
	}
	pthread_mutex_unlock(&c->lock);
	lanes_wake(c, (uint32_t)min_u64(c->nlanes, bytes / c->cfg.buf_size + 1));
}

/*
 * A stream op's arguments as they are now: 0, 1 (zero length) or -errno
 * (-EINVAL a negative offset, -EFAULT outside the allocation found at
 * submission, -E2BIG more staging rounds than were queued).  No CUDA call.
 */
static int args_read(const struct cu_req *rq, const struct cu_file *cf, uint64_t *devptr,
		     uint64_t *off, uint64_t *len)
{
	phx_cuda *c = rq->c;
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
	if (*devptr < rq->alloc_lo || *devptr + *len > rq->alloc_hi || *devptr + *len < *devptr)
		return -EFAULT;
	if ((align_up(*off + *len, cf->align) - align_down(*off, cf->align) +
	     c->cfg.buf_size - 1) / c->cfg.buf_size > rq->nstages)
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
	return true;
}

/*
 * Early reads: right after queueing, take the arguments as they are now and
 * let lanes cut and read pieces of them (c->early_head) while the stream is
 * still busy.  Not when the stream got there already (the arrival takes
 * c->lock to say so), nor when a write on the file is in flight through
 * this context: it may be ordered before.
 */
static void early_begin(struct cu_req *rq)
{
	phx_cuda *c = rq->c;
	uint64_t devptr, off, len;
	int64_t size, ctime_ns;
	struct cu_file *cf;
	bool ok;

	/*
	 * Once the stream got there the request may finish, and its caller and
	 * file may go, at any moment: the arguments are read, and the file is
	 * taken, while it is still waiting (its arrival takes c->lock).
	 */
	pthread_mutex_lock(&c->lock);
	if (rq->state != RQ_WAITING || args_read(rq, rq->cf, &devptr, &off, &len) != 0) {
		pthread_mutex_unlock(&c->lock);
		return;
	}
	cf = rq->cf;
	cf->refs++;
	pthread_mutex_unlock(&c->lock);
	ok = file_stamp(cf, &size, &ctime_ns);
	pthread_mutex_lock(&c->lock);
	if (!ok || !c->early_reads || rq->state != RQ_WAITING || cf->writes_live ||
	    __atomic_load_n(&rq->err, __ATOMIC_ACQUIRE)) {
		pthread_mutex_unlock(&c->lock);
		cf_put(c, cf);
		return;
	}
	rq->e_size = size;
	rq->e_ctime_ns = ctime_ns;
	rq_set_range(rq, devptr, off, len);
	rq->e_state = E_PENDING;
	rq->e_gen = rq->cf->write_gen;
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
	lanes_wake(c, (uint32_t)min_u64(c->nlanes, len / c->cfg.buf_size + 1));
}

/* Off c->early_head (c->lock held). */
void rq_early_unlink_locked(struct cu_req *rq)
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

/* Forget the early pieces (none holds a buffer any more): an ordinary op. */
static void early_reset_locked(struct cu_req *rq)
{
	uint32_t k;

	rq->e_state = E_NONE;
	rq->e_cut = false;
	rq->stage_next = 0;
	rq->prefix = 0;
	for (k = 0; k < rq->nstages; k++) {
		rq->stages[k].b = NULL;
		rq->stages[k].ready = false;
		rq->stages[k].gpu_done = 0;
	}
}

/*
 * The last early buffer of a request judged E_BAD came back (c->lock
 * held): it arrives again, at the head of the ready queue, as an ordinary
 * stream op; the caller wakes a lane.
 */
void rq_early_restart_locked(struct cu_req *rq)
{
	phx_cuda *c = rq->c;

	early_reset_locked(rq);
	rq->state = RQ_ARRIVED;
	ready_push_head_locked(c, rq);
}

/*
 * The stream reached an early read: judge its early pieces.  Returns 0 when
 * it is RQ_READY with pieces left to cut, 1 when the caller has nothing to
 * do with it (every piece already cut, or thrown-away pieces still coming
 * back: the last one restarts it), 2 when it is an ordinary op again now.
 */
static int early_settle(struct cu_req *rq)
{
	phx_cuda *c = rq->c;
	uint64_t devptr = 0, off = 0, len = 0;
	int64_t size = -1, ctime_ns = -1;
	bool ok, kick;
	int ret;

	ret = args_read(rq, rq->cf, &devptr, &off, &len);
	ok = ret == 0 && devptr == rq->devptr && off == rq->off && len == rq->len &&
	     !__atomic_load_n(&rq->err, __ATOMIC_ACQUIRE) &&
	     file_stamp(rq->cf, &size, &ctime_ns) && size == rq->e_size &&
	     ctime_ns == rq->e_ctime_ns;
	pthread_mutex_lock(&c->lock);
	rq_early_unlink_locked(rq);
	ok = ok && rq->cf->write_gen == rq->e_gen && rq->e_epoch == c->early_epoch;
	rq->e_state = ok ? E_OK : E_BAD;
	kick = rq->e_live > 0;
	if (!ok) {
		if (!rq->e_live)
			early_reset_locked(rq);
		pthread_mutex_unlock(&c->lock);
		stat_add(c, &c->st.early_misses, 1);
		if (kick)
			lanes_kick(c);
		return kick ? 1 : 2;
	}
	if (rq->e_cut) {
		rq->state = RQ_CUT;
		rq_stages_cut_done_locked(rq);
	} else {
		rq->state = RQ_READY;
	}
	pthread_mutex_unlock(&c->lock);
	stat_add(c, &c->st.early_reads, 1);
	if (kick)
		lanes_kick(c);		/* their held rounds can go to the GPU */
	if (!rq->e_cut)
		return 0;
	rq_stages_advance(rq);
	rq_piece_done_ref(rq);		/* the cutting reference */
	return 1;
}

/*
 * A lane, on an arrived stream op (no lock held): read the arguments, as
 * the stream found them, and check them.  Returns 0 when the request is
 * RQ_READY for cutting, 1 when there is nothing to move (bad arguments,
 * zero length, or an error from queueing): then its rounds are released
 * empty and the result is published as they go; 1 also for an early read
 * that needs nothing more from the caller (see early_settle()).
 */
int rq_resolve(struct cu_req *rq)
{
	phx_cuda *c = rq->c;
	uint64_t devptr = 0, off = 0, len = 0;
	int ret;

	rq_trace(rq, TR_RESOLVED);
	if (rq->e_state == E_PENDING) {
		ret = early_settle(rq);
		if (ret < 2)
			return ret;
	}
	if (__atomic_load_n(&rq->err, __ATOMIC_ACQUIRE))
		goto finish;
	ret = args_read(rq, rq->cf, &devptr, &off, &len);
	rq_set_range(rq, devptr, off, len);
	switch (ret) {
	case 0:
		break;
	case 1:
		goto finish;
	case -EINVAL:
		rq_fail(rq, cu_err(-EINVAL, "negative file or buffer offset"));
		goto finish;
	case -EFAULT:
		rq_fail(rq, cu_err(-EFAULT, "0x%llx + %llu is outside the GPU allocation (0x%llx..0x%llx) found when the operation was queued",
				   (unsigned long long)devptr, (unsigned long long)len,
				   (unsigned long long)rq->alloc_lo, (unsigned long long)rq->alloc_hi));
		goto finish;
	default:
		rq_fail(rq, cu_err(-EINVAL, "the size grew to %llu after queueing: more staging rounds than were queued (%u)",
				   (unsigned long long)len, rq->nstages));
		goto finish;
	}
	rq->state = RQ_READY;
	return 0;
finish:
	/* nothing to move: every round's flag goes up with an empty descriptor */
	rq->len = 0;
	rq->end = rq->off;
	pthread_mutex_lock(&c->lock);
	rq->state = RQ_CUT;
	rq_stages_cut_done_locked(rq);
	pthread_mutex_unlock(&c->lock);
	rq_stages_advance(rq);
	rq_piece_done_ref(rq);		/* the cutting reference */
	return 1;
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
 * tail take the engine's read-modify-write path.  A piece that would be cut
 * short by a nearly full buffer waits for an empty one instead (@first).
 */
bool rq_cut(struct cu_req *rq, struct cu_piece *p, uint32_t *fill, uint32_t size,
	    bool first)
{
	uint64_t A = rq->cf->align, cur = rq->cursor, left = rq->end - cur;
	uint64_t g = A > 4096 ? A : 4096;	/* staging position granule */
	uint64_t pos = (*fill + g - 1) / g * g, len;

	if (pos >= size)
		return false;
	if (rq->op == PHX_OP_READ) {
		uint64_t w0 = align_down(cur, A), wend = align_up(rq->end, A);

		len = min_u64(wend - w0, align_down(size - pos, A));
		if (!len)
			return false;
		p->io_off = w0;
		p->io_len = (uint32_t)len;
		p->user_len = (uint32_t)(min_u64(rq->end, w0 + len) - cur);
	} else {
		pos += cur % A;
		if (pos >= size)
			return false;
		len = min_u64(left, size - pos);
		p->io_off = cur;
		p->io_len = (uint32_t)len;
		p->user_len = (uint32_t)len;
	}
	if (!first && p->user_len < left && len < size / 4)
		return false;
	p->rq = rq;
	p->soff = (uint32_t)pos;
	p->user_off = cur;
	p->got = 0;
	p->io_started = false;
	*fill = (uint32_t)(pos + len);
	rq->cursor = cur + p->user_len;
	/* a stream op's rounds were counted when it was queued */
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
	uint64_t end, cur;

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
	{
		uint64_t skip = p->user_off - p->io_off;

		p->got = (uint64_t)res > skip ? (uint32_t)min_u64((uint64_t)res - skip, p->user_len) : 0;
	}
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
static void piece_account(struct cu_req *rq, struct cu_piece *p)
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

void rq_piece_done(struct cu_piece *p)
{
	struct cu_req *rq = p->rq;

	piece_account(rq, p);
	rq_piece_done_ref(rq);
}

static void rq_release(struct cu_req *rq);

/* Drop @n references; the last one ends the request. */
void rq_piece_done_n(struct cu_req *rq, int n)
{
	if (n <= 0 || __atomic_sub_fetch(&rq->pieces, n, __ATOMIC_ACQ_REL) != 0)
		return;
	if (rq->stream_op)
		rq_release(rq);		/* published when its last flag went up */
	else
		rq_finish(rq);
}

void rq_piece_done_ref(struct cu_req *rq)
{
	rq_piece_done_n(rq, 1);
}

/* ------------------------------------------------------------------------ */
/* Stream-op rounds                                                         */
/* ------------------------------------------------------------------------ */

static void rq_publish(struct cu_req *rq);

/*
 * A lane filled round @st from piece @p (a read: its file I/O is done; a
 * write: its buffer is reserved): the descriptor the kernel will read.  The
 * flag that lets the kernel run goes up in rq_stages_advance().
 */
void rq_stage_fill(struct cu_stage *st, struct cu_piece *p, uint64_t staging_d)
{
	struct cu_req *rq = st->rq;
	phx_cuda *c = rq->c;
	struct cu_copy_desc *d = &c->descs[st->desc];
	bool bad = __atomic_load_n(&rq->err, __ATOMIC_ACQUIRE) != 0;

	if (rq->op == PHX_OP_READ) {
		piece_account(rq, p);
		d->src = staging_d + p->soff + (p->user_off - p->io_off);
		d->dst = rq->devptr + (p->user_off - rq->off);
		d->len = bad ? 0 : p->got;
	} else {
		d->src = rq->devptr + (p->user_off - rq->off);
		d->dst = staging_d + p->soff;
		d->len = bad ? 0 : p->user_len;
	}
	stat_add(c, rq->op == PHX_OP_READ ? &c->st.h2d_bytes : &c->st.d2h_bytes, d->len);
	rq_trace(rq, TR_FILL0);
	pthread_mutex_lock(&c->lock);
	st->ready = true;
	pthread_mutex_unlock(&c->lock);
}

/* Every piece is cut (c->lock held): the rounds left over carry nothing. */
void rq_stages_cut_done_locked(struct cu_req *rq)
{
	phx_cuda *c = rq->c;
	uint32_t k;

	rq->needed = rq->stage_next;
	for (k = rq->stage_next; k < rq->nstages; k++) {
		struct cu_copy_desc *d = &c->descs[rq->stages[k].desc];

		d->src = d->dst = d->len = 0;
		rq->stages[k].b = NULL;
		rq->stages[k].ready = true;
	}
	rq->stage_next = rq->nstages;
}

/*
 * Raise the flag over the rounds that are ready, in order (a kernel may run
 * only once its descriptor is written).  The result is published first when
 * the last flag goes up: a read's once every round's file I/O is judged, a
 * write's once every round is in the file.  The flag is only ever raised,
 * under c->lock, so lanes racing here cannot lower it.
 */
void rq_stages_advance(struct cu_req *rq)
{
	phx_cuda *c = rq->c;
	uint32_t final = rq->nstages + (rq->op == PHX_OP_WRITE ? 1 : 0);
	bool publish = false;
	uint32_t target;

	pthread_mutex_lock(&c->lock);
	while (rq->prefix < rq->nstages && rq->stages[rq->prefix].ready)
		rq->prefix++;
	target = rq->prefix;
	if (rq->prefix == rq->nstages && rq->state == RQ_CUT &&
	    (rq->op == PHX_OP_READ ||
	     __atomic_load_n(&rq->written, __ATOMIC_ACQUIRE) == (int)rq->needed))
		target = final;
	if (target == final && !rq->publish_claimed) {
		rq->publish_claimed = true;
		publish = true;
		target = final - 1;	/* the last one after publishing */
	}
	if ((int32_t)(rq->seq + target - rq->raised) > 0) {
		rq_trace(rq, TR_FLAG0);
		rq->raised = rq->seq + target;
		__atomic_store_n(&c->flags[rq->slot], rq->raised, __ATOMIC_RELEASE);
	}
	pthread_mutex_unlock(&c->lock);
	if (!publish)
		return;
	rq_publish(rq);
	rq_trace(rq, TR_FINAL);
	pthread_mutex_lock(&c->lock);
	rq->raised = rq->seq + final;
	__atomic_store_n(&c->flags[rq->slot], rq->raised, __ATOMIC_RELEASE);
	pthread_mutex_unlock(&c->lock);
}

/* A write round's file I/O is over (judged by rq_piece_io()). */
void rq_stage_written(struct cu_stage *st, struct cu_piece *p)
{
	if (p->io_started)
		piece_account(st->rq, p);
	__atomic_add_fetch(&st->rq->written, 1, __ATOMIC_ACQ_REL);
	rq_stages_advance(st->rq);
}

/* ------------------------------------------------------------------------ */
/* End                                                                      */
/* ------------------------------------------------------------------------ */

static void after_put(phx_cuda *c, struct cu_after *a)
{
	if (a && __atomic_sub_fetch(&a->refs, 1, __ATOMIC_ACQ_REL) == 0) {
		ev_put(c, a->ev);
		free(a);
	}
}

/* The last touch of @c by a request: destroy may go ahead after it. */
static void live_dec(phx_cuda *c, struct phx_cuda_io *io)
{
	pthread_mutex_lock(&c->done_lock);
	if (io)
		__atomic_store_n(&io->done, 1, __ATOMIC_RELEASE);
	c->live--;
	pthread_cond_broadcast(&c->done_cond);
	pthread_mutex_unlock(&c->done_lock);
}

/*
 * Publish the result: bytes moved (short at end of file) or the first
 * error.  It is in io->result and *bytes_done before anyone is told, and the
 * file is let go of, so a caller may close it as soon as it learns.
 */
static void rq_publish(struct cu_req *rq)
{
	phx_cuda *c = rq->c;
	struct phx_cuda_io *io = rq->io;
	int64_t res, err = __atomic_load_n(&rq->err, __ATOMIC_ACQUIRE);

	if (err)
		res = err;
	else if (rq->short_end < rq->end)
		res = (int64_t)(rq->short_end - rq->off);
	else
		res = (int64_t)rq->len;
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
	write_untrack(rq);
	cf_put(c, rq->cf);
	rq->cf = NULL;
}

/* Nothing refers to the request any more: hand everything back. */
static void rq_release(struct cu_req *rq)
{
	phx_cuda *c = rq->c;
	struct phx_cuda_io *io = rq->owned ? NULL : rq->io;

	rq->state = RQ_DONE;
	if (rq->owned)
		free(rq->io);
	write_untrack(rq);		/* abandoned before it was published */
	if (rq->cf)
		cf_put(c, rq->cf);
	after_put(c, rq->after);
	pthread_mutex_lock(&c->lock);
	if (rq->stream_op) {
		slot_put_locked(c, rq->slot);
		descs_put_locked(c, rq->stages, rq->nstages);
	}
	/*
	 * Everything of the record before it is on the free list: from there
	 * another thread may take it at once (rq_alloc) and give it new rounds,
	 * which a free() after the unlock would take away from it (the H200's
	 * seed-scale LMCache replay segfaulted in phxFileReadAsync that way).
	 */
	free(rq->stages);
	rq->stages = NULL;
	rq->next = c->free_reqs;
	c->free_reqs = rq;
	pthread_mutex_unlock(&c->lock);
	live_dec(c, io);
}

/* A host-async request's end: publish, then release. */
void rq_finish(struct cu_req *rq)
{
	rq_publish(rq);
	rq_release(rq);
}

/*
 * Undo a stream op whose arrival could not be queued: nothing of it is on
 * the stream, and the caller gets the error from the call itself.  An owned
 * io stays the caller's to free, as on every other failure of rq_stream().
 */
void rq_abandon(struct cu_req *rq, int err)
{
	if (rq->io && !rq->owned)
		rq->io->result = err;
	if (rq->owned) {
		rq->owned = false;
		rq->io = NULL;
	}
	rq_release(rq);
}
