// SPDX-License-Identifier: Apache-2.0
/*
 * cuhook.c - the few CUDA driver calls libphxfile makes itself.
 *
 * libphx queues the transfers; the adapter adds one host function behind
 * each on the caller's stream.  It runs once the stream has passed the
 * transfer, copies the result into the caller's bytes_done (so that it is
 * there before any later stream work) and counts or logs a failure, which
 * LMCache would otherwise never see.  It never blocks and makes no CUDA
 * call.  The direct path's host function does the file I/O itself.
 *
 * The driver is found with dlopen("libcuda.so.1") like libphx does, so
 * the library loads on machines without CUDA.
 */
#include <dlfcn.h>
#include <errno.h>
#include <string.h>

#include "internal.h"

#define CUDA_OK 0
#define CUDA_ERROR_OUT_OF_MEMORY 2

static int sym(struct pf_cuda *cu, void *fp, const char *name)
{
	void *p = dlsym(cu->lib, name);

	if (!p) {
		pf_log("libcuda.so.1 lacks %s", name);
		return -ENOSYS;
	}
	memcpy(fp, &p, sizeof(p));
	return 0;
}

int pf_cuda_load(struct pf_cuda *cu)
{
	int ret = 0;

	memset(cu, 0, sizeof(*cu));
	cu->lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
	if (!cu->lib) {
		pf_log("libcuda.so.1: %s", dlerror());
		return -ENODEV;
	}
	ret = ret ?: sym(cu, &cu->DeviceGet, "cuDeviceGet");
	ret = ret ?: sym(cu, &cu->PrimaryCtxRetain, "cuDevicePrimaryCtxRetain");
	ret = ret ?: sym(cu, &cu->PrimaryCtxRelease, "cuDevicePrimaryCtxRelease_v2");
	ret = ret ?: sym(cu, &cu->CtxPush, "cuCtxPushCurrent_v2");
	ret = ret ?: sym(cu, &cu->CtxPop, "cuCtxPopCurrent_v2");
	ret = ret ?: sym(cu, &cu->LaunchHostFunc, "cuLaunchHostFunc");
	ret = ret ?: sym(cu, &cu->StreamSynchronize, "cuStreamSynchronize");
	ret = ret ?: sym(cu, &cu->GetErrorString, "cuGetErrorString");
	if (ret) {
		dlclose(cu->lib);
		cu->lib = NULL;
		return ret;
	}
	cu->fake = dlsym(cu->lib, "fake_sleep_async") != NULL;
	return 0;
}

void pf_cuda_unload(struct pf_cuda *cu)
{
	int i;

	if (!cu->lib)
		return;
	for (i = 0; i < PF_MAX_DEVICES; i++)
		if (cu->ctx[i])
			cu->PrimaryCtxRelease(i);
	dlclose(cu->lib);
	memset(cu, 0, sizeof(*cu));
}

static int cu_errno(struct pf_cuda *cu, int r, const char *what)
{
	const char *s = NULL;

	cu->GetErrorString(r, &s);
	pf_log("%s: CUDA error %d (%s)", what, r, s ? s : "?");
	return r == CUDA_ERROR_OUT_OF_MEMORY ? -ENOMEM : -EIO;
}

/* Retain @dev's primary context once (driver lock held). */
int pf_cuda_retain(struct pf_cuda *cu, int dev)
{
	int d, r;

	if (dev < 0 || dev >= PF_MAX_DEVICES)
		return -EINVAL;
	if (cu->ctx[dev])
		return 0;
	r = cu->DeviceGet(&d, dev);
	if (r == CUDA_OK)
		r = cu->PrimaryCtxRetain(&cu->ctx[dev], d);
	if (r != CUDA_OK) {
		cu->ctx[dev] = NULL;
		return cu_errno(cu, r, "retaining the device's primary context");
	}
	return 0;
}

/* Make @dev's (retained) primary context current on this thread. */
static int push(struct pf_cuda *cu, int dev)
{
	int r;

	if (dev < 0 || dev >= PF_MAX_DEVICES || !cu->ctx[dev])
		return -EINVAL;
	r = cu->CtxPush(cu->ctx[dev]);
	return r == CUDA_OK ? 0 : cu_errno(cu, r, "cuCtxPushCurrent");
}

static void pop(struct pf_cuda *cu)
{
	void *c;

	cu->CtxPop(&c);
}

/*
 * Queue @fn(@arg) on @stream of device @dev (its context retained by
 * pf_cuda_retain()).  Cheap; never waits for the stream.
 */
int pf_cuda_launch(struct pf_cuda *cu, int dev, void *stream, pf_hostfn fn, void *arg)
{
	int r, ret = push(cu, dev);

	if (ret)
		return ret;
	r = cu->LaunchHostFunc(stream, fn, arg);
	pop(cu);
	return r == CUDA_OK ? 0 : cu_errno(cu, r, "cuLaunchHostFunc");
}

int pf_cuda_sync(struct pf_cuda *cu, int dev, void *stream)
{
	int r, ret = push(cu, dev);

	if (ret)
		return ret;
	r = cu->StreamSynchronize(stream);
	pop(cu);
	return r == CUDA_OK ? 0 : cu_errno(cu, r, "cuStreamSynchronize");
}
