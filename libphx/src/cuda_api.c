// SPDX-License-Identifier: Apache-2.0
/*
 * cuda_api.c - floor 5: the public request calls of phx_cuda.h, file
 * registration and the counters.
 *
 * Each call only builds requests (cuda_request.c, cuda_stream.c) and queues
 * them; the threads (cuda_lanes.c, cuda_copier.c, cuda_poller.c) do the
 * work.  Every call that makes CUDA calls pushes the context's own CUDA
 * context first and pops it after, so any thread may call, whatever is
 * current there (nothing, or another device's context).  A batch of n
 * host-async requests costs n small allocations from a pool, one lock and,
 * after a producer stream, one cuEventRecord.
 */
#include <errno.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>

#include "cuda_internal.h"

#define QUEUE_BATCH 256

CU_EXPORT void phx_cuda_io_prep(struct phx_cuda_io *io, phx_file *f, enum phx_op op,
				uint64_t devptr, size_t len, uint64_t offset)
{
	memset(io, 0, sizeof(*io));
	io->file = f;
	io->op = op;
	io->devptr = devptr;
	io->len = len;
	io->offset = offset;
}

/*
 * An event on @s (NULL: the legacy default stream) for copies to follow.
 * Not on a stream that is capturing a graph: the event would be a node of
 * the graph, recorded only when it is launched, and the copies would wait
 * for it forever.
 */
static int after_new(phx_cuda *c, CUstream s, struct cu_after **out)
{
	struct cu_after *a;
	int st = CU_STREAM_CAPTURE_STATUS_NONE;
	CUresult r;
	int ret;

	if (c->d->StreamIsCapturing &&
	    (c->d->StreamIsCapturing(s ? s : (CUstream)1, &st) != CUDA_SUCCESS ||
	     st != CU_STREAM_CAPTURE_STATUS_NONE))
		return cu_err(-EBUSY, "the producer stream is being captured into a CUDA graph: copies ordered after it would wait for a replay");
	a = calloc(1, sizeof(*a));
	if (!a)
		return cu_err(-ENOMEM, "out of memory");
	ret = ev_get(c, &a->ev);
	if (ret) {
		free(a);
		return ret;
	}
	r = c->d->EventRecord(a->ev, s ? s : (CUstream)1 /* CU_STREAM_LEGACY */);
	if (r != CUDA_SUCCESS) {
		ev_put(c, a->ev);
		free(a);
		return cu_fail(c->d, r, "cuEventRecord on the producer stream");
	}
	a->refs = 1;
	*out = a;
	return 0;
}

/* Link host-async requests into their ready queue and wake lanes for them. */
static void queue_host(phx_cuda *c, struct cu_req **rqs, size_t n)
{
	uint64_t bytes = 0;
	size_t i;

	if (!n)
		return;
	pthread_mutex_lock(&c->lock);
	for (i = 0; i < n; i++) {
		ready_push_locked(c, rqs[i], false);
		bytes += rqs[i]->len;
	}
	pthread_mutex_unlock(&c->lock);
	lanes_wake(c, (uint32_t)(bytes / c->cfg.buf_size + 1 < c->nlanes ?
				 bytes / c->cfg.buf_size + 1 : c->nlanes));
}

/*
 * Queue host-async requests; with @ordered, their copies follow the work on
 * @after_stream at the time of the call.  Stops at the first bad request
 * (its error is returned; the ones before it stay queued).
 */
int cu_submit_host(phx_cuda *c, struct phx_cuda_io *const *ios, size_t n,
		   bool ordered, void *after_stream, struct cu_group *grp,
		   size_t *accepted)
{
	struct cu_req *batch[QUEUE_BATCH];
	struct cu_after *after = NULL;
	struct cu_file *cf = NULL;
	uint64_t range[2] = { 0, 0 };
	int64_t t0 = phx_now_ns();
	size_t i = 0, k = 0;
	int ret;

	if (accepted)
		*accepted = 0;
	if (!c || (!ios && n))
		return cu_err(-EINVAL, "phx_cuda_submit: NULL argument");
	if (!n)
		return 0;
	ret = ctx_push(c);
	if (ret)
		return ret;
	if (ordered) {
		ret = after_new(c, (CUstream)after_stream, &after);
		if (ret) {
			ctx_pop(c);
			return ret;
		}
	}
	for (i = 0; i < n; i++) {
		struct cu_req *rq;

		ret = rq_host(c, ios[i], after, grp, range, &cf, &rq);
		if (ret)
			break;
		if (rq)
			batch[k++] = rq;
		if (k == QUEUE_BATCH) {
			queue_host(c, batch, k);
			k = 0;
		}
	}
	queue_host(c, batch, k);
	if (cf)
		cf_put(c, cf);
	after_put(c, after);
	ctx_pop(c);
	if (accepted)
		*accepted = i;	/* rq_host refuses before it accepts anything */
	stat_add(c, &c->st.ph_call_ns, (uint64_t)(phx_now_ns() - t0));
	return ret;
}

CU_EXPORT int phx_cuda_submit(phx_cuda *c, struct phx_cuda_io *const *ios, size_t n)
{
	return cu_submit_host(c, ios, n, false, NULL, NULL, NULL);
}

CU_EXPORT int phx_cuda_submit_after(phx_cuda *c, struct phx_cuda_io *const *ios,
				    size_t n, void *stream)
{
	return cu_submit_host(c, ios, n, true, stream, NULL, NULL);
}

CU_EXPORT int phx_cuda_eventfd(phx_cuda *c)
{
	int fd;

	if (!c)
		return cu_err(-EINVAL, "phx_cuda_eventfd: NULL context");
	pthread_mutex_lock(&c->done_lock);
	if (c->done_efd < 0)
		c->done_efd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
	fd = c->done_efd >= 0 ? c->done_efd : cu_err(-errno, "eventfd");
	pthread_mutex_unlock(&c->done_lock);
	return fd;
}

CU_EXPORT int phx_cuda_wait(phx_cuda *c, struct phx_cuda_io *io, int64_t timeout_ns)
{
	int64_t deadline = timeout_ns >= 0 ? phx_now_ns() + timeout_ns : -1;

	if (!c || !io)
		return cu_err(-EINVAL, "phx_cuda_wait: NULL argument");
	if (__atomic_load_n(&io->done, __ATOMIC_ACQUIRE))
		return 0;
	pthread_mutex_lock(&c->done_lock);
	while (!__atomic_load_n(&io->done, __ATOMIC_ACQUIRE)) {
		if (deadline < 0) {
			pthread_cond_wait(&c->done_cond, &c->done_lock);
		} else {
			int64_t left = deadline - phx_now_ns();

			if (left <= 0) {
				pthread_mutex_unlock(&c->done_lock);
				return cu_err(-ETIME, "request not complete within the timeout");
			}
			phx_cond_wait_ns(&c->done_cond, &c->done_lock, left);
		}
	}
	pthread_mutex_unlock(&c->done_lock);
	return 0;
}

CU_EXPORT int phx_cuda_submit_wait(phx_cuda *c, struct phx_cuda_io *ios, size_t n)
{
	struct phx_cuda_io *one;
	size_t i, queued = 0;
	int ret = 0;

	if (!c || (!ios && n))
		return cu_err(-EINVAL, "phx_cuda_submit_wait: NULL argument");
	for (i = 0; i < n && !ret; i++) {
		one = &ios[i];
		ret = cu_submit_host(c, &one, 1, false, NULL, NULL, NULL);
		if (!ret)
			queued++;
	}
	for (i = 0; i < queued; i++)
		phx_cuda_wait(c, &ios[i], -1);
	return ret;
}

static int64_t sync_io(phx_cuda *c, phx_file *f, enum phx_op op, uint64_t devptr,
		       size_t len, uint64_t off)
{
	struct phx_cuda_io io, *p = &io;
	int ret;

	if (!c)
		return cu_err(-EINVAL, "NULL context");
	phx_cuda_io_prep(&io, f, op, devptr, len, off);
	ret = cu_submit_host(c, &p, 1, false, NULL, NULL, NULL);
	if (ret)
		return ret;
	phx_cuda_wait(c, &io, -1);
	return io.result;
}

CU_EXPORT int64_t phx_cuda_pread(phx_cuda *c, phx_file *f, uint64_t devptr, size_t len,
				 uint64_t offset)
{
	return sync_io(c, f, PHX_OP_READ, devptr, len, offset);
}

CU_EXPORT int64_t phx_cuda_pwrite(phx_cuda *c, phx_file *f, uint64_t devptr,
				  size_t len, uint64_t offset)
{
	return sync_io(c, f, PHX_OP_WRITE, devptr, len, offset);
}

/* ------------------------------------------------------------------------ */
/* Stream-ordered                                                           */
/* ------------------------------------------------------------------------ */

CU_EXPORT int phx_cuda_submit_stream(phx_cuda *c, struct phx_cuda_io *io, void *stream)
{
	if (!c || !io)
		return cu_err(-EINVAL, "phx_cuda_submit_stream: NULL argument");
	return st_submit(c, io, false, io->file, io->op, 0, NULL, NULL, NULL, NULL,
			 (CUstream)stream, NULL, NULL);
}

int cu_async_owned(phx_cuda *c, phx_file *f, uint32_t op, uint64_t base,
		   const size_t *size, const int64_t *foff, const int64_t *boff,
		   int64_t *bytes_done, void *stream, phx_cuda_done_fn fn, void *arg)
{
	struct phx_cuda_io *io;
	int ret;

	if (!c)
		return cu_err(-EINVAL, "NULL context");
	/* owned, so io->result is there for the counters even without bytes_done */
	io = calloc(1, sizeof(*io));
	if (!io)
		return cu_err(-ENOMEM, "out of memory");
	io->file = f;
	io->op = op;
	ret = st_submit(c, io, true, f, op, base, size, foff, boff, bytes_done,
			(CUstream)stream, fn, arg);
	if (ret)
		free(io);	/* refused: the request never took it */
	return ret;
}

CU_EXPORT int phx_cuda_read_async(phx_cuda *c, phx_file *f, uint64_t devptr_base,
				  const size_t *size, const int64_t *file_offset,
				  const int64_t *buf_offset, int64_t *bytes_done,
				  void *stream)
{
	return cu_async_owned(c, f, PHX_OP_READ, devptr_base, size, file_offset, buf_offset,
			   bytes_done, stream, NULL, NULL);
}

CU_EXPORT int phx_cuda_write_async(phx_cuda *c, phx_file *f, uint64_t devptr_base,
				   const size_t *size, const int64_t *file_offset,
				   const int64_t *buf_offset, int64_t *bytes_done,
				   void *stream)
{
	return cu_async_owned(c, f, PHX_OP_WRITE, devptr_base, size, file_offset, buf_offset,
			   bytes_done, stream, NULL, NULL);
}

CU_EXPORT int phx_cuda_submit_async(phx_cuda *c, const struct phx_cuda_async *a)
{
	if (!c || !a)
		return cu_err(-EINVAL, "phx_cuda_submit_async: NULL argument");
	if (a->size < offsetof(struct phx_cuda_async, reserved))
		return cu_err(-EINVAL, "phx_cuda_submit_async: struct size %u is too small", a->size);
	if (a->op != PHX_OP_READ && a->op != PHX_OP_WRITE)
		return cu_err(-EINVAL, "unknown op %u", a->op);
	return cu_async_owned(c, a->file, a->op, a->devptr_base, a->nbytes, a->file_offset,
			   a->buf_offset, a->bytes_done, a->stream, a->done, a->done_arg);
}

/* ------------------------------------------------------------------------ */
/* Files                                                                    */
/* ------------------------------------------------------------------------ */

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
	for (cf = c->files; cf && cf->f != f; cf = cf->next)
		;
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
/* Counters                                                                 */
/* ------------------------------------------------------------------------ */

CU_EXPORT void phx_cuda_stats_get(phx_cuda *c, struct phx_cuda_stats *st, size_t size)
{
	struct phx_cuda_stats all;
	uint32_t i;

	memcpy(&all, &c->st, sizeof(all));
	all.fixed_buf_ios = 0;
	all.sqes = 0;
	for (i = 0; i < c->nlanes; i++) {
		struct phx_stats es;

		phx_engine_stats(c->lanes[i].eng, &es);
		all.fixed_buf_ios += es.fixed_buf_ios;
		all.sqes += es.sqes;
		all.bad_refusals += es.bad_refusals;
	}
	memcpy(st, &all, size < sizeof(all) ? size : sizeof(all));
}

/* Live counters: every named field of struct phx_cuda_stats, for `phx top`. */
#define CS(f) STAT_FIELD(struct phx_cuda_stats, f)
static const struct stat_field cuda_stat_fields[] = {
	CS(reads), CS(writes), CS(bytes_read), CS(bytes_written), CS(direct_bytes),
	CS(bounce_bytes), CS(buffered_bytes), CS(h2d_bytes), CS(d2h_bytes), CS(chunks),
	CS(stream_ops), CS(errors), CS(fixed_buf_ios), CS(sqes), CS(staging_bytes),
	CS(staging_fills), CS(memcpy_calls), CS(memcpy_batch_calls), CS(file_adoptions),
	CS(pinned_bytes), CS(early_reads), CS(early_misses), CS(stream_released),
	CS(stream_queue_ns), CS(stream_data_ns), CS(stream_gpu_ns), CS(queue_waits),
	CS(early_refused), CS(bad_marks), CS(bad_refusals), CS(orphans), CS(broken),
	CS(ph_call_ns), CS(ph_pack_ns), CS(ph_submit_ns), CS(ph_io_ns), CS(ph_copy_ns),
	CS(ph_buffers), CS(many_calls), CS(many_pieces), CS(ph_done_ns),
};
#undef CS

static void cu_stats_fill(void *obj, void *st)
{
	phx_cuda_stats_get(obj, st, sizeof(struct phx_cuda_stats));
}

void cu_stats_publish(phx_cuda *c)
{
	char label[64];

	snprintf(label, sizeof(label), "GPU %d, %u lanes x %u x %u KiB staging",
		 c->cfg.device, c->nlanes, c->cfg.bufs_per_lane, c->cfg.buf_size >> 10);
	/* best effort: a context without live counters works the same */
	stats_add_struct("cuda", label, cuda_stat_fields,
			 sizeof(cuda_stat_fields) / sizeof(cuda_stat_fields[0]),
			 cu_stats_fill, c, &c->pub);
}

/* The PHX_0.2 layout: everything before reserved[]. */
CU_EXPORT void phx_cuda_stats(phx_cuda *c, struct phx_cuda_stats *st)
{
	phx_cuda_stats_get(c, st, offsetof(struct phx_cuda_stats, reserved));
}

CU_EXPORT void phx_cuda_stats_reset(phx_cuda *c)
{
	uint64_t staging = c->st.staging_bytes, pinned = c->st.pinned_bytes;
	uint32_t i;

	memset(&c->st, 0, sizeof(c->st));
	c->st.staging_bytes = staging;
	c->st.pinned_bytes = pinned;
	for (i = 0; i < c->nlanes; i++)
		phx_engine_stats_reset(c->lanes[i].eng);
}
