// SPDX-License-Identifier: Apache-2.0
/*
 * cuda_host_test.c - pinned host memory and copy streams (PHX_0.7:
 * phx_cuda_host_register/unregister, phx_cuda_stream_*) against fake_cuda.c.
 *
 * Description: registration pins and unpins exactly once and holds the
 * device's primary context while it lives; copies on a phx_cuda_stream are
 * byte-exact both ways at unaligned addresses; a copy ordered after a
 * producer stream sees what the producer wrote even when it is slow; a
 * producer capturing a graph is refused; bad device addresses fail with the
 * driver call named; any thread may call (no context current, or another
 * device's), and what was current there is restored; destroy waits and
 * releases the context.  With FAKE_CUDA_DEVICES=2 everything runs on device
 * 1 from threads whose current context is device 0's (or none).
 *
 * Run by tests/test_kv_gpu.py with the fake as libcuda.so.1.  Exit 0 = all
 * passed.
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <dlfcn.h>
#include <errno.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "phx_cuda.h"
#include "fake_check.h"


/* the fake's own entry points */
static int (*MemAlloc)(uint64_t *, size_t);
static int (*MemFree)(uint64_t);
static int (*StreamCreate)(void **, unsigned);
static int (*StreamSynchronize)(void *);
static int (*MemsetAsync)(uint64_t, unsigned char, size_t, void *);
static int (*SleepAsync)(void *, unsigned long);
static int (*FakeHostRegistered)(size_t *);
static void (*FailHostRegister)(int);
static int (*PrimaryCtxRetain)(void **, int);
static int (*PrimaryCtxRelease)(int);
static int (*CtxPush)(void *);
static int (*CtxPop)(void **);
static int (*CtxRetained)(int);
static void (*StreamCapture)(void *, int);

static int dev;			/* the device under test: the last one */
static int ndev;

static void *amalloc(size_t n)
{
	void *p = NULL;

	if (posix_memalign(&p, 4096, n))
		abort();
	return p;
}

static int registered(void)
{
	size_t a;

	return FakeHostRegistered(&a);
}

/* The fake's calls need @d's context current in this thread. */
static void *ctx_of(int d)
{
	void *c = NULL;

	PrimaryCtxRetain(&c, d);
	PrimaryCtxRelease(d);
	return c;
}

static void fill(unsigned char *p, size_t n, unsigned seed)
{
	size_t i;

	for (i = 0; i < n; i++)
		p[i] = (unsigned char)((i * 131u + seed * 7u) >> 3);
}

static void test_register(void)
{
	size_t n = 1 << 20;
	unsigned char *buf = amalloc(n);
	int live = registered(), refs = CtxRetained(dev);

	CHECK(phx_cuda_host_register(dev, buf + 100, n - 200) == 0, "register");
	CHECK(registered() == live + 1, "not registered with the driver");
	CHECK(CtxRetained(dev) == refs + 1, "the registration holds no context reference");
	CHECK(phx_cuda_host_unregister(dev, buf + 100) == 0, "unregister");
	CHECK(registered() == live, "still registered");
	CHECK(CtxRetained(dev) == refs, "context reference kept: %d vs %d", CtxRetained(dev), refs);

	CHECK(phx_cuda_host_register(dev, NULL, n) == -EINVAL, "NULL");
	CHECK(phx_cuda_host_register(dev, buf, 0) == -EINVAL, "empty");
	CHECK(phx_cuda_host_register(ndev, buf, n) == -ENODEV, "device %d does not exist", ndev);
	CHECK(phx_cuda_host_register(-1, buf, n) == -ENODEV, "device -1");
	CHECK(strstr(phx_cuda_strerror_last(), "no CUDA device"), "reason");
	FailHostRegister(0);
	CHECK(phx_cuda_host_register(dev, buf, n) == -ENOMEM, "a refused pin is -ENOMEM");
	CHECK(strstr(phx_cuda_strerror_last(), "cuMemHostRegister"), "the call is named");
	CHECK(registered() == live && CtxRetained(dev) == refs, "a failed register leaked");
	free(buf);
}

struct copy_args {
	int with_ctx;		/* -1: none current; else that device's */
	int ok;
};

/* Copies both ways at unaligned addresses, from whatever thread runs it. */
static void *copies(void *arg)
{
	struct copy_args *a = arg;
	size_t n = 3 * 65536 + 77;
	unsigned char *src = amalloc(n + 4096), *back = amalloc(n + 4096);
	phx_cuda_stream *s = NULL;
	uint64_t d = 0;
	void *was = NULL;
	int fails = failures;

	if (a->with_ctx >= 0)
		CtxPush(ctx_of(a->with_ctx));
	fill(src, n + 4096, 1);
	memset(back, 0xEE, n + 4096);
	CHECK(phx_cuda_host_register(dev, src, n + 4096) == 0, "register src");
	CHECK(phx_cuda_host_register(dev, back, n + 4096) == 0, "register back");
	CHECK(phx_cuda_stream_create(dev, &s) == 0 && s, "create");
	CHECK(phx_cuda_stream_handle(s) != NULL, "no CUstream");
	CtxPush(ctx_of(dev));
	MemAlloc(&d, n + 64);
	CtxPop(&was);
	CHECK(phx_cuda_stream_h2d(s, d + 5, src + 3, n) == 0, "h2d");
	CHECK(phx_cuda_stream_sync(s) == 0, "sync");
	CHECK(memcmp((void *)(uintptr_t)(d + 5), src + 3, n) == 0, "h2d bytes differ");
	CHECK(phx_cuda_stream_d2h(s, back + 11, d + 5, n) == 0, "d2h");
	CHECK(phx_cuda_stream_sync(s) == 0, "sync");
	CHECK(memcmp(back + 11, src + 3, n) == 0, "d2h bytes differ");
	CHECK(back[10] == 0xEE && back[11 + n] == 0xEE, "d2h wrote outside its range");
	CHECK(phx_cuda_stream_h2d(s, d, src, 0) == 0 && phx_cuda_stream_d2h(s, back, d, 0) == 0,
	      "empty copies are no-ops");
	CHECK(phx_cuda_stream_destroy(s) == 0, "destroy");
	CHECK(phx_cuda_host_unregister(dev, src) == 0 && phx_cuda_host_unregister(dev, back) == 0,
	      "unregister");
	/* what was current here still is: exactly one level when we pushed one */
	if (a->with_ctx >= 0) {
		CHECK(CtxPop(&was) == 0 && was == ctx_of(a->with_ctx), "the caller's context was lost");
	}
	CHECK(CtxPop(&was) != 0, "a context was left current in this thread");
	CtxPush(ctx_of(dev));
	MemFree(d);
	CtxPop(&was);
	free(src);
	free(back);
	a->ok = failures == fails;
	return NULL;
}

static void test_threads(void)
{
	int refs = CtxRetained(dev), live = registered();
	struct copy_args none = { -1, 0 }, other = { 0, 0 }, own = { dev, 0 };
	pthread_t t;

	pthread_create(&t, NULL, copies, &none);
	pthread_join(t, NULL);
	CHECK(none.ok, "copies from a thread with no context current");
	pthread_create(&t, NULL, copies, &other);
	pthread_join(t, NULL);
	CHECK(other.ok, "copies from a thread with device 0's context current");
	pthread_create(&t, NULL, copies, &own);
	pthread_join(t, NULL);
	CHECK(own.ok, "copies from a thread with the device's context current");
	CHECK(CtxRetained(dev) == refs, "context references leaked: %d vs %d", CtxRetained(dev), refs);
	CHECK(registered() == live, "registrations leaked");
}

static void test_after(void)
{
	size_t n = 256 * 1024;
	unsigned char *dst = amalloc(n);
	phx_cuda_stream *s = NULL;
	void *prod = NULL, *was;
	uint64_t d = 0;
	size_t i, bad = 0;

	CtxPush(ctx_of(dev));
	MemAlloc(&d, n);
	memset((void *)(uintptr_t)d, 0, n);
	StreamCreate(&prod, 1);
	CHECK(phx_cuda_stream_create(dev, &s) == 0, "create");
	/* the producer is slow (0.2 s of "kernels"), then writes the bytes */
	SleepAsync(prod, 200000);
	MemsetAsync(d, 0xAB, n, prod);
	CHECK(phx_cuda_stream_after(s, prod) == 0, "after");
	CHECK(phx_cuda_stream_d2h(s, dst, d, n) == 0, "d2h");
	CHECK(phx_cuda_stream_sync(s) == 0, "sync");
	for (i = 0; i < n; i++)
		bad += dst[i] != 0xAB;
	CHECK(bad == 0, "%zu bytes read before the producer wrote them", bad);
	CHECK(phx_cuda_stream_after(s, NULL) == 0, "after the legacy default stream");
	StreamCapture(prod, 1);
	CHECK(phx_cuda_stream_after(s, prod) == -EBUSY, "a capturing producer is refused");
	StreamCapture(prod, 0);
	/* device addresses that are not device memory: the call is named */
	MemFree(d);
	CHECK(phx_cuda_stream_h2d(s, d, dst, 4096) == -EINVAL, "h2d to freed memory");
	CHECK(strstr(phx_cuda_strerror_last(), "cuMemcpyHtoDAsync"), "h2d: the call is named");
	CHECK(phx_cuda_stream_d2h(s, dst, d, 4096) == -EINVAL, "d2h from freed memory");
	CHECK(strstr(phx_cuda_strerror_last(), "cuMemcpyDtoHAsync"), "d2h: the call is named");
	CHECK(phx_cuda_stream_h2d(NULL, d, dst, 1) == -EINVAL, "NULL stream");
	CHECK(phx_cuda_stream_sync(NULL) == -EINVAL, "NULL stream");
	CHECK(phx_cuda_stream_create(ndev, &s) == -ENODEV, "no such device");
	CHECK(phx_cuda_stream_destroy(NULL) == 0, "destroy(NULL)");
	CHECK(phx_cuda_stream_destroy(s) == 0, "destroy");
	StreamSynchronize(prod);
	CtxPop(&was);
	free(dst);
}

/* destroy waits for the copies queued, whatever the caller did not sync */
static void test_destroy_waits(void)
{
	size_t n = 64 * 1024;
	unsigned char *src = amalloc(n);
	phx_cuda_stream *s = NULL;
	uint64_t d = 0;
	void *was;

	fill(src, n, 9);
	CtxPush(ctx_of(dev));
	MemAlloc(&d, n);
	memset((void *)(uintptr_t)d, 0, n);
	CtxPop(&was);
	CHECK(phx_cuda_stream_create(dev, &s) == 0, "create");
	SleepAsync(phx_cuda_stream_handle(s), 100000);
	CHECK(phx_cuda_stream_h2d(s, d, src, n) == 0, "h2d");
	CHECK(phx_cuda_stream_destroy(s) == 0, "destroy");
	CHECK(memcmp((void *)(uintptr_t)d, src, n) == 0, "destroy did not wait for the copy");
	CtxPush(ctx_of(dev));
	MemFree(d);
	CtxPop(&was);
	free(src);
}

int main(void)
{
	char why[256];
	void *h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_GLOBAL);

	if (!h || !dlsym(h, "fake_sleep_async")) {
		fprintf(stderr, "not the fake libcuda (set LD_LIBRARY_PATH)\n");
		return 77;
	}
	*(void **)&MemAlloc = dlsym(h, "cuMemAlloc_v2");
	*(void **)&MemFree = dlsym(h, "cuMemFree_v2");
	*(void **)&StreamCreate = dlsym(h, "cuStreamCreate");
	*(void **)&StreamSynchronize = dlsym(h, "cuStreamSynchronize");
	*(void **)&MemsetAsync = dlsym(h, "cuMemsetD8Async");
	*(void **)&SleepAsync = dlsym(h, "fake_sleep_async");
	*(void **)&FakeHostRegistered = dlsym(h, "fake_host_registered");
	*(void **)&FailHostRegister = dlsym(h, "fake_fail_host_register");
	*(void **)&PrimaryCtxRetain = dlsym(h, "cuDevicePrimaryCtxRetain");
	*(void **)&PrimaryCtxRelease = dlsym(h, "cuDevicePrimaryCtxRelease_v2");
	*(void **)&CtxPush = dlsym(h, "cuCtxPushCurrent_v2");
	*(void **)&CtxPop = dlsym(h, "cuCtxPopCurrent_v2");
	*(void **)&CtxRetained = dlsym(h, "fake_ctx_retained");
	*(void **)&StreamCapture = dlsym(h, "fake_stream_capture");
	if (!phx_cuda_available(why, sizeof(why))) {
		fprintf(stderr, "CUDA unavailable: %s\n", why);
		return 1;
	}
	ndev = getenv("FAKE_CUDA_DEVICES") ? atoi(getenv("FAKE_CUDA_DEVICES")) : 1;
	dev = ndev - 1;
	printf("%s; testing device %d\n", why, dev);
	test_register();
	test_threads();
	test_after();
	test_destroy_waits();
	if (failures) {
		printf("%d failure(s)\n", failures);
		return 1;
	}
	printf("all passed\n");
	return 0;
}
