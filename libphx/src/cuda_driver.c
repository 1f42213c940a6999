// SPDX-License-Identifier: Apache-2.0
/*
 * cuda_driver.c - the CUDA driver API, loaded at run time.
 *
 * libphx builds without CUDA headers and runs without a driver: libcuda.so.1
 * is dlopen()ed on first use and the entry points the GPU path needs are
 * looked up by name (the versioned names cuda.h maps its macros to).
 * cuMemcpyBatchAsync (CUDA >= 12.8) is optional: it is resolved with
 * cuGetProcAddress for the 12.8 ABI, so newer drivers keep answering with
 * the signature declared here, and the lanes fall back to one copy call per
 * piece without it.  cuDeviceGetPCIBusId is optional too: it only finds
 * the GPU's NUMA node for the staging (cuda_numa.c); so are the graph
 * capture calls (a stream that is being captured is refused with them).
 */
#include <dlfcn.h>
#include <errno.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include "cuda_internal.h"

/*
 * The one process-wide driver table: libcuda itself is process-wide, so
 * loading it once (pthread_once) is the only sensible scope.
 */
static struct cu_driver drv;
static pthread_once_t drv_once = PTHREAD_ONCE_INIT;
static int drv_err;			/* 0, or -errno */
static char drv_why[256];

static __thread char cu_errbuf[512];

int cu_err(int err, const char *fmt, ...)
{
	va_list ap;

	va_start(ap, fmt);
	vsnprintf(cu_errbuf, sizeof(cu_errbuf), fmt, ap);
	va_end(ap);
	return err;
}

void cu_err_save(char *buf, size_t len)
{
	snprintf(buf, len, "%s", cu_errbuf);
}

void cu_err_restore(const char *buf)
{
	snprintf(cu_errbuf, sizeof(cu_errbuf), "%s", buf);
}

CU_EXPORT const char *phx_cuda_strerror_last(void)
{
	return cu_errbuf[0] ? cu_errbuf : "no error";
}

static const char *cu_str(const struct cu_driver *d, CUresult r)
{
	const char *s = NULL;

	if (d && d->GetErrorString && d->GetErrorString(r, &s) == CUDA_SUCCESS && s)
		return s;
	return "unknown CUDA error";
}

int cu_fail(const struct cu_driver *d, CUresult r, const char *what)
{
	int err = r == CUDA_ERROR_OUT_OF_MEMORY ? -ENOMEM :
		  (r == CUDA_ERROR_INVALID_VALUE || r == 400) ? -EINVAL : -EIO;

	return cu_err(err, "%s: CUDA error %d (%s)", what, r, cu_str(d, r));
}

typedef CUresult (*get_proc_fn)(const char *, void **, int, uint64_t, int *);

static void resolve_batch_copy(void *h)
{
	get_proc_fn gpa = (get_proc_fn)dlsym(h, "cuGetProcAddress_v2");
	void *fn = NULL;
	int status = 0;

	/* ask for the 12.8 ABI by version, so a newer driver keeps it */
	if (gpa && gpa("cuMemcpyBatchAsync", &fn, 12080, 0, &status) == CUDA_SUCCESS &&
	    fn && drv.version >= 12080) {
		*(void **)&drv.MemcpyBatchAsync = fn;
		return;
	}
	/* the unsuffixed export keeps the 12.8 signature (cuda.h 13.0) */
	fn = drv.version >= 12080 ? dlsym(h, "cuMemcpyBatchAsync") : NULL;
	*(void **)&drv.MemcpyBatchAsync = fn;
}

static void drv_load(void)
{
	void *h;
	int r;

	h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_GLOBAL);
	if (!h) {
		drv_err = -ENODEV;
		snprintf(drv_why, sizeof(drv_why),
			 "libcuda.so.1 not found (no NVIDIA driver): %s", dlerror());
		return;
	}
#define SYM(field, name)                                                     \
	do {                                                                 \
		*(void **)&drv.field = dlsym(h, name);                       \
		if (!drv.field) {                                            \
			drv_err = -ENOSYS;                                   \
			snprintf(drv_why, sizeof(drv_why),                   \
				 "libcuda.so.1 lacks %s (driver too old)", name); \
			return;                                              \
		}                                                            \
	} while (0)
	SYM(Init, "cuInit");
	SYM(DriverGetVersion, "cuDriverGetVersion");
	SYM(DeviceGetCount, "cuDeviceGetCount");
	SYM(DeviceGet, "cuDeviceGet");
	SYM(DevicePrimaryCtxRetain, "cuDevicePrimaryCtxRetain");
	SYM(DevicePrimaryCtxRelease, "cuDevicePrimaryCtxRelease_v2");
	SYM(CtxSetCurrent, "cuCtxSetCurrent");
	SYM(CtxPushCurrent, "cuCtxPushCurrent_v2");
	SYM(CtxPopCurrent, "cuCtxPopCurrent_v2");
	SYM(StreamCreate, "cuStreamCreate");
	SYM(StreamDestroy, "cuStreamDestroy_v2");
	SYM(StreamSynchronize, "cuStreamSynchronize");
	SYM(StreamQuery, "cuStreamQuery");
	SYM(StreamWaitEvent, "cuStreamWaitEvent");
	SYM(StreamWaitValue32, "cuStreamWaitValue32_v2");
	SYM(StreamWriteValue32, "cuStreamWriteValue32_v2");
	SYM(EventCreate, "cuEventCreate");
	SYM(EventDestroy, "cuEventDestroy_v2");
	SYM(EventRecord, "cuEventRecord");
	SYM(EventQuery, "cuEventQuery");
	SYM(EventSynchronize, "cuEventSynchronize");
	SYM(MemcpyHtoDAsync, "cuMemcpyHtoDAsync_v2");
	SYM(MemcpyDtoHAsync, "cuMemcpyDtoHAsync_v2");
	SYM(MemHostRegister, "cuMemHostRegister_v2");
	SYM(MemHostUnregister, "cuMemHostUnregister");
	SYM(MemHostGetDevicePointer, "cuMemHostGetDevicePointer_v2");
	SYM(MemGetAddressRange, "cuMemGetAddressRange_v2");
	SYM(MemAlloc, "cuMemAlloc_v2");
	SYM(MemFree, "cuMemFree_v2");
	SYM(LaunchHostFunc, "cuLaunchHostFunc");
	SYM(ModuleLoadData, "cuModuleLoadData");
	SYM(ModuleUnload, "cuModuleUnload");
	SYM(ModuleGetFunction, "cuModuleGetFunction");
	SYM(LaunchKernel, "cuLaunchKernel");
	SYM(GetErrorString, "cuGetErrorString");
	SYM(PointerGetAttribute, "cuPointerGetAttribute");
#undef SYM
	/* optional: without it staging is not placed on the GPU's NUMA node */
	*(void **)&drv.DeviceGetPCIBusId = dlsym(h, "cuDeviceGetPCIBusId");
	/* optional (CUDA 10+): graph capture is then not detected, nor avoided */
	*(void **)&drv.StreamIsCapturing = dlsym(h, "cuStreamIsCapturing");
	*(void **)&drv.ThreadExchangeStreamCaptureMode =
		dlsym(h, "cuThreadExchangeStreamCaptureMode");
	r = drv.Init(0);
	if (r != CUDA_SUCCESS) {
		drv_err = -ENODEV;
		snprintf(drv_why, sizeof(drv_why), "cuInit failed: CUDA error %d (%s)",
			 r, cu_str(&drv, r));
		return;
	}
	drv.DriverGetVersion(&drv.version);
	r = drv.DeviceGetCount(&drv.ndev);
	if (r != CUDA_SUCCESS || drv.ndev < 1) {
		drv_err = -ENODEV;
		snprintf(drv_why, sizeof(drv_why), "the CUDA driver reports no device");
		return;
	}
	resolve_batch_copy(h);
	snprintf(drv_why, sizeof(drv_why), "CUDA driver %d.%d, %d device%s",
		 drv.version / 1000, drv.version % 1000 / 10, drv.ndev,
		 drv.ndev == 1 ? "" : "s");
}

const struct cu_driver *cu_driver(void)
{
	pthread_once(&drv_once, drv_load);
	if (drv_err) {
		cu_err(drv_err, "%s", drv_why);
		return NULL;
	}
	return &drv;
}

const char *cu_driver_why(void)
{
	pthread_once(&drv_once, drv_load);
	return drv_why;
}

CU_EXPORT int phx_cuda_available(char *why, size_t len)
{
	pthread_once(&drv_once, drv_load);
	if (why && len)
		snprintf(why, len, "%s", drv_why);
	return drv_err == 0;
}

CU_EXPORT int phx_cuda_ptr_device(uint64_t ptr)
{
	const struct cu_driver *d = cu_driver();
	unsigned int mtype = 0;
	int ord = -1;
	CUresult r;

	if (!d)
		return -ENODEV;
	r = d->PointerGetAttribute(&mtype, CU_POINTER_ATTRIBUTE_MEMORY_TYPE, ptr);
	if (r != CUDA_SUCCESS || (mtype != CU_MEMORYTYPE_DEVICE && mtype != CU_MEMORYTYPE_UNIFIED))
		return cu_err(-EINVAL, "0x%llx is not CUDA device memory",
			      (unsigned long long)ptr);
	r = d->PointerGetAttribute(&ord, CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, ptr);
	if (r != CUDA_SUCCESS)
		return cu_fail(d, r, "cuPointerGetAttribute (device ordinal)");
	return ord;
}
