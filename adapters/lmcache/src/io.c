// SPDX-License-Identifier: Apache-2.0
/*
 * io.c - phxFileReadAsync/WriteAsync.
 *
 * Staging (any buffer without a /dev/phx mapping): the transfer is
 * libphx's phx_cuda_submit_async on the caller's stream, with the caller's
 * size and offset pointers (read when the stream gets there) and its
 * bytes_done, which libphx fills before the stream goes past the transfer.
 * libphx then calls op_done on its poller thread: the transfer is counted,
 * a failure logged once, and it no longer counts as in flight.  No host
 * function is queued: each would stall the stream for a trip through
 * CUDA's callback thread.
 *
 * A read of a range whose last write failed is refused here, at
 * submission, with -EIO (libphx refuses it again when the stream arrives,
 * should the range go bad meanwhile): LMCache then treats the chunk as
 * missing instead of serving what the slab holds there.
 *
 * Direct (a registered buffer that /dev/phx mapped): one host function does
 * the file I/O on the mapping when the stream reaches it (direct.c); early
 * reads go off on every context once it has run.
 *
 * Every transfer counts as in flight on its handle, its buffer and the
 * driver until its host function has run: deregistration and driver close
 * wait on that.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>

#include "internal.h"

/* The transfer no longer counts as in flight (d->lock held): wake waiters. */
static void op_unpin_locked(struct pf_op *o)
{
	struct pf_driver *d = o->d;

	o->h->inflight--;
	if (o->b)
		o->b->inflight--;
	d->st.inflight--;
	pthread_cond_broadcast(&d->idle);
}

/*
 * The end of a transfer (libphx's poller thread, or CUDA's callback thread
 * for the direct path): never blocks.  The caller's bytes_done is already
 * written (libphx wrote it before releasing the stream; pf_direct_run did),
 * and must not be touched again: the caller may have reused that memory as
 * soon as its stream got past the transfer.
 */
void pf_op_finish(struct pf_op *o, int64_t res)
{
	struct pf_driver *d = o->d;

	pthread_mutex_lock(&d->lock);
	if (res < 0) {
		pf_fail_locked(d, (int)res, o->h->path,
			       o->op == PHX_OP_READ ? "phxFileReadAsync" : "phxFileWriteAsync");
	} else if (o->op == PHX_OP_READ) {
		d->st.reads++;
		d->st.bytes_read += (uint64_t)res;
	} else {
		d->st.writes++;
		d->st.bytes_written += (uint64_t)res;
	}
	op_unpin_locked(o);
	pthread_mutex_unlock(&d->lock);
	free(o);
}

/* libphx's completion, on its poller thread: never blocks. */
static void op_done(void *arg, int64_t res)
{
	pf_op_finish(arg, res);
}

/*
 * Look up handle and buffer and count the transfer in flight; on success
 * *@dev is the buffer's device.
 */
static int op_begin(struct pf_op *o, void *fh, int *dev)
{
	struct pf_driver *d = o->d;
	int ptr_dev = -1;

	for (;;) {
		pthread_mutex_lock(&d->lock);
		o->h = pf_handle_find_locked(d, fh);
		if (!o->h) {
			pthread_mutex_unlock(&d->lock);
			return -EBADF;
		}
		o->b = pf_buf_find_locked(d, o->base);
		if (o->b || ptr_dev >= 0)
			break;
		pthread_mutex_unlock(&d->lock);
		/* unregistered: ask CUDA, outside the lock (see internal.h) */
		ptr_dev = phx_cuda_ptr_device(o->base);
		if (ptr_dev < 0)
			return -EINVAL;
	}
	if (o->b) {
		*dev = o->b->dev;
	} else {
		d->st.unregistered_ops++;
		*dev = ptr_dev;
	}
	o->h->inflight++;
	if (o->b)
		o->b->inflight++;
	d->st.inflight++;
	pthread_mutex_unlock(&d->lock);
	return 0;
}

/* Undo op_begin() for a transfer that was never queued. */
static void op_abort(struct pf_op *o)
{
	struct pf_driver *d = o->d;

	pthread_mutex_lock(&d->lock);
	op_unpin_locked(o);
	pthread_mutex_unlock(&d->lock);
}

static int queue_staging(struct pf_op *o, int dev, void *stream)
{
	struct pf_driver *d = o->d;
	struct phx_cuda_async a = {
		.size = sizeof(a),
		.op = o->op,
		.file = o->h->f,
		.devptr_base = o->base,
		.nbytes = o->size,
		.file_offset = o->foff,
		.buf_offset = o->boff,
		.bytes_done = o->bytes_done,
		.stream = stream,
		.done = op_done,
		.done_arg = o,
	};
	phx_cuda *cu;
	int ret;

	ret = pf_ctx_get(d, dev, &cu);
	if (ret)
		return ret;
	pthread_mutex_lock(&d->lock);
	d->st.staging_ops++;
	pthread_mutex_unlock(&d->lock);
	ret = phx_cuda_submit_async(cu, &a);
	if (ret)
		pf_log("%s: libphx refused the transfer: %s", o->h->path, phx_cuda_strerror_last());
	return ret;
}

static int queue_direct(struct pf_op *o, int dev, void *stream)
{
	struct pf_driver *d = o->d;

	pthread_mutex_lock(&d->lock);
	d->st.direct_ops++;
	pthread_mutex_unlock(&d->lock);
	pf_direct_early_off(d);
	return pf_cuda_launch(&d->cuda, dev, stream, pf_direct_run, o);
}

static int transfer(uint32_t op, void *fh, void *buf_base, size_t *nbytes,
		    int64_t *file_offset, int64_t *buf_offset, int64_t *bytes_done,
		    void *stream)
{
	struct pf_driver *d = pf_drv();
	const char *what = op == PHX_OP_READ ? "phxFileReadAsync" : "phxFileWriteAsync";
	struct pf_op *o;
	int dev = 0, ret;

	if (!fh || !buf_base || !nbytes || !file_offset || !buf_offset || !bytes_done)
		return pf_submit_fail(d, -EINVAL, NULL, what);
	o = calloc(1, sizeof(*o));
	if (!o)
		return pf_submit_fail(d, -ENOMEM, NULL, what);
	o->d = d;
	o->op = op;
	o->base = (uint64_t)(uintptr_t)buf_base;
	o->size = nbytes;
	o->foff = file_offset;
	o->boff = buf_offset;
	o->bytes_done = bytes_done;
	ret = op_begin(o, fh, &dev);
	if (ret) {
		free(o);
		return pf_submit_fail(d, ret, NULL, ret == -EBADF ?
				      "transfer on an unregistered file handle" :
				      "transfer on memory that is not on a GPU");
	}
	/* a range whose last write failed holds no KV anyone may load */
	if (op == PHX_OP_READ && *file_offset >= 0 &&
	    phx_file_check_range(o->h->f, (uint64_t)*file_offset, *nbytes)) {
		char path[PATH_MAX];

		snprintf(path, sizeof(path), "%s", o->h->path);
		pthread_mutex_lock(&d->lock);
		d->st.bad_refusals++;
		pthread_mutex_unlock(&d->lock);
		op_abort(o);
		free(o);
		return pf_submit_fail(d, -EIO, path, "phxFileReadAsync (the range's last write failed)");
	}
	if (o->b && o->b->host)
		ret = queue_direct(o, dev, stream);
	else
		ret = queue_staging(o, dev, stream);
	if (ret) {
		char path[PATH_MAX];

		snprintf(path, sizeof(path), "%s", o->h->path);
		op_abort(o);
		free(o);
		return pf_submit_fail(d, ret, path, what);
	}
	return 0;
}

PF_EXPORT int phxFileReadAsync(void *fh, void *buf_base, size_t *nbytes,
			       int64_t *file_offset, int64_t *buf_offset,
			       int64_t *bytes_done, void *stream)
{
	return transfer(PHX_OP_READ, fh, buf_base, nbytes, file_offset, buf_offset,
			bytes_done, stream);
}

PF_EXPORT int phxFileWriteAsync(void *fh, void *buf_base, size_t *nbytes,
				int64_t *file_offset, int64_t *buf_offset,
				int64_t *bytes_done, void *stream)
{
	return transfer(PHX_OP_WRITE, fh, buf_base, nbytes, file_offset, buf_offset,
			bytes_done, stream);
}

PF_EXPORT int phxFileCheckRange(void *fh, int64_t offset, uint64_t len)
{
	struct pf_driver *d = pf_drv();
	struct pf_handle *h;
	int ret;

	if (offset < 0)
		return -EINVAL;
	pthread_mutex_lock(&d->lock);
	h = pf_handle_find_locked(d, fh);
	if (h)
		h->inflight++;		/* the handle stays while it is asked */
	pthread_mutex_unlock(&d->lock);
	if (!h)
		return -EBADF;
	ret = phx_file_check_range(h->f, (uint64_t)offset, len) ? -EIO : 0;
	pthread_mutex_lock(&d->lock);
	h->inflight--;
	pthread_cond_broadcast(&d->idle);
	pthread_mutex_unlock(&d->lock);
	return ret;
}
