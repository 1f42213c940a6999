// SPDX-License-Identifier: Apache-2.0
/*
 * cuda_host.c - floor 1: pinned host memory and copy streams for callers
 * that move bytes between their own host buffers and the GPU (PHX_0.7).
 *
 * No staging context is involved (no lanes, nothing pinned but what the
 * caller registers): phx.kv's Co-DMA relays, one pinned host buffer and one
 * stream per copy thread, are the user.  Only the driver table
 * (cuda_driver.c) lies below.  Every call makes the device's primary
 * context (the one PyTorch and CuPy use) current for its duration, pushed
 * and popped, so any thread may call whatever is current there.
 */
#include <errno.h>
#include <pthread.h>
#include <stdlib.h>

#include "cuda_internal.h"

struct phx_cuda_stream {
	const struct cu_driver *d;
	CUdevice dev;
	CUcontext ctx;		/* @dev's primary context, retained */
	CUstream stream;
	CUevent ev;		/* phx_cuda_stream_after()'s marker */
	pthread_mutex_t lock;	/* @ev from its record to the wait on it */
};

/*
 * Retain @device's primary context and make it current: 0 with *@dev and
 * *@ctx set (undo with primary_pop(), then release), or -errno.
 */
static int primary_push(const struct cu_driver *d, int device, CUdevice *dev, CUcontext *ctx)
{
	CUresult r;

	if (device < 0 || device >= d->ndev)
		return cu_err(-ENODEV, "no CUDA device %d (%d present)", device, d->ndev);
	r = d->DeviceGet(dev, device);
	if (r != CUDA_SUCCESS)
		return cu_fail(d, r, "cuDeviceGet");
	r = d->DevicePrimaryCtxRetain(ctx, *dev);
	if (r != CUDA_SUCCESS)
		return cu_fail(d, r, "cuDevicePrimaryCtxRetain");
	r = d->CtxPushCurrent(*ctx);
	if (r != CUDA_SUCCESS) {
		d->DevicePrimaryCtxRelease(*dev);
		return cu_fail(d, r, "cuCtxPushCurrent");
	}
	return 0;
}

static void primary_pop(const struct cu_driver *d)
{
	CUcontext dummy;

	d->CtxPopCurrent(&dummy);
}

/* ------------------------------------------------------------------------ */
/* Host memory                                                              */
/* ------------------------------------------------------------------------ */

CU_EXPORT int phx_cuda_host_register(int device, void *ptr, size_t len)
{
	const struct cu_driver *d = cu_driver();
	CUcontext ctx;
	CUdevice dev;
	CUresult r;
	int ret;

	if (!d)
		return -ENODEV;
	if (!ptr || !len)
		return cu_err(-EINVAL, "phx_cuda_host_register: NULL or empty range");
	ret = primary_push(d, device, &dev, &ctx);
	if (ret)
		return ret;
	r = d->MemHostRegister(ptr, len, CU_MEMHOSTREGISTER_PORTABLE);
	primary_pop(d);
	if (r != CUDA_SUCCESS) {
		d->DevicePrimaryCtxRelease(dev);
		return cu_fail(d, r, "cuMemHostRegister");
	}
	/* the registration lives in the primary context: its reference stays */
	return 0;
}

CU_EXPORT int phx_cuda_host_unregister(int device, void *ptr)
{
	const struct cu_driver *d = cu_driver();
	CUcontext ctx;
	CUdevice dev;
	CUresult r;
	int ret;

	if (!d)
		return -ENODEV;
	if (!ptr)
		return cu_err(-EINVAL, "phx_cuda_host_unregister: NULL pointer");
	ret = primary_push(d, device, &dev, &ctx);
	if (ret)
		return ret;
	r = d->MemHostUnregister(ptr);
	primary_pop(d);
	d->DevicePrimaryCtxRelease(dev);		/* this call's */
	if (r != CUDA_SUCCESS)
		return cu_fail(d, r, "cuMemHostUnregister");
	d->DevicePrimaryCtxRelease(dev);		/* phx_cuda_host_register()'s */
	return 0;
}

/* ------------------------------------------------------------------------ */
/* Copy streams                                                             */
/* ------------------------------------------------------------------------ */

CU_EXPORT int phx_cuda_stream_create(int device, phx_cuda_stream **out)
{
	const struct cu_driver *d = cu_driver();
	struct phx_cuda_stream *s;
	CUresult r;
	int ret;

	if (!d)
		return -ENODEV;
	if (!out)
		return cu_err(-EINVAL, "phx_cuda_stream_create: NULL argument");
	s = calloc(1, sizeof(*s));
	if (!s)
		return cu_err(-ENOMEM, "out of memory");
	s->d = d;
	ret = primary_push(d, device, &s->dev, &s->ctx);
	if (ret)
		goto err_free;
	r = d->StreamCreate(&s->stream, CU_STREAM_NON_BLOCKING);
	if (r != CUDA_SUCCESS) {
		ret = cu_fail(d, r, "cuStreamCreate");
		goto err_release;
	}
	r = d->EventCreate(&s->ev, CU_EVENT_DISABLE_TIMING);
	if (r != CUDA_SUCCESS) {
		ret = cu_fail(d, r, "cuEventCreate");
		goto err_stream;
	}
	primary_pop(d);
	pthread_mutex_init(&s->lock, NULL);
	*out = s;
	return 0;

err_stream:
	d->StreamDestroy(s->stream);
err_release:
	primary_pop(d);
	d->DevicePrimaryCtxRelease(s->dev);
err_free:
	free(s);
	return ret;
}

CU_EXPORT int phx_cuda_stream_destroy(phx_cuda_stream *s)
{
	const struct cu_driver *d;
	CUresult r = CUDA_SUCCESS;
	int ret = 0;

	if (!s)
		return 0;
	d = s->d;
	if (d->CtxPushCurrent(s->ctx) == CUDA_SUCCESS) {
		r = d->StreamSynchronize(s->stream);
		d->EventDestroy(s->ev);
		d->StreamDestroy(s->stream);
		primary_pop(d);
	}
	if (r != CUDA_SUCCESS)
		ret = cu_fail(d, r, "cuStreamSynchronize");
	d->DevicePrimaryCtxRelease(s->dev);
	pthread_mutex_destroy(&s->lock);
	free(s);
	return ret;
}

CU_EXPORT void *phx_cuda_stream_handle(const phx_cuda_stream *s)
{
	return s ? (void *)s->stream : NULL;
}

static int push(phx_cuda_stream *s)
{
	CUresult r = s->d->CtxPushCurrent(s->ctx);

	return r == CUDA_SUCCESS ? 0 : cu_fail(s->d, r, "cuCtxPushCurrent");
}

CU_EXPORT int phx_cuda_stream_after(phx_cuda_stream *s, void *producer)
{
	CUstream p = producer ? (CUstream)producer : (CUstream)1;	/* CU_STREAM_LEGACY */
	const struct cu_driver *d;
	int st = CU_STREAM_CAPTURE_STATUS_NONE;
	CUresult r;
	int ret;

	if (!s)
		return cu_err(-EINVAL, "phx_cuda_stream_after: NULL stream");
	d = s->d;
	ret = push(s);
	if (ret)
		return ret;
	/* an event recorded inside a capture is a graph node, not a point in time */
	if (d->StreamIsCapturing &&
	    (d->StreamIsCapturing(p, &st) != CUDA_SUCCESS || st != CU_STREAM_CAPTURE_STATUS_NONE)) {
		primary_pop(d);
		return cu_err(-EBUSY, "the producer stream is being captured into a CUDA graph: a copy ordered after it would wait for a replay");
	}
	pthread_mutex_lock(&s->lock);
	r = d->EventRecord(s->ev, p);
	if (r != CUDA_SUCCESS)
		ret = cu_fail(d, r, "cuEventRecord on the producer stream");
	else if ((r = d->StreamWaitEvent(s->stream, s->ev, 0)) != CUDA_SUCCESS)
		ret = cu_fail(d, r, "cuStreamWaitEvent");
	pthread_mutex_unlock(&s->lock);
	primary_pop(d);
	return ret;
}

/* One async copy on the stream in either direction: the two exported calls
 * differ only in which driver entry point moves the bytes. */
static int stream_copy(phx_cuda_stream *s, int to_device, uint64_t dev, void *host,
		       size_t len, const char *who)
{
	CUresult r;
	int ret;

	if (!s || (!host && len))
		return cu_err(-EINVAL, "%s: NULL argument", who);
	if (!len)
		return 0;
	ret = push(s);
	if (ret)
		return ret;
	if (to_device)
		r = s->d->MemcpyHtoDAsync(dev, host, len, s->stream);
	else
		r = s->d->MemcpyDtoHAsync(host, dev, len, s->stream);
	primary_pop(s->d);
	if (r == CUDA_SUCCESS)
		return 0;
	return cu_fail(s->d, r, to_device ? "cuMemcpyHtoDAsync" : "cuMemcpyDtoHAsync");
}

CU_EXPORT int phx_cuda_stream_h2d(phx_cuda_stream *s, uint64_t dst, const void *src, size_t len)
{
	/* the driver's HtoD takes a const source; nothing writes through it */
	return stream_copy(s, 1, dst, (void *)src, len, "phx_cuda_stream_h2d");
}

CU_EXPORT int phx_cuda_stream_d2h(phx_cuda_stream *s, void *dst, uint64_t src, size_t len)
{
	return stream_copy(s, 0, src, dst, len, "phx_cuda_stream_d2h");
}

CU_EXPORT int phx_cuda_stream_sync(phx_cuda_stream *s)
{
	CUresult r;
	int ret;

	if (!s)
		return cu_err(-EINVAL, "phx_cuda_stream_sync: NULL stream");
	ret = push(s);
	if (ret)
		return ret;
	r = s->d->StreamSynchronize(s->stream);
	primary_pop(s->d);
	return r == CUDA_SUCCESS ? 0 : cu_fail(s->d, r, "cuStreamSynchronize");
}
