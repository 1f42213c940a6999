// SPDX-License-Identifier: Apache-2.0
/*
 * fake_cuda.c - a stand-in libcuda.so.1 for testing libphx's GPU path on
 * machines without a GPU.  It is a test double, not a CUDA: "device"
 * memory is host memory from cuMemAlloc, each stream is a thread running
 * its operations in order, events count records, and host functions run on
 * ONE shared callback thread while their stream waits (as CUDA does), so a
 * host function that blocks holds up every stream's host functions.
 *
 * Only the driver entry points libphx uses exist, plus what the tests need
 * (cuMemAlloc, cuMemsetD8Async) and test hooks: fake_sleep_async() (a busy
 * stream), fake_hostfn_max_ns() (the longest host function),
 * fake_stream_capture() (a stream capturing a graph), fake_alloc_segments()
 * (one range mapped as several allocations, as VMM allocators do),
 * fake_poison_copies() (copies to a GPU range refused: an injected copy
 * error), fake_fault_async() (a kernel that faults: from then on the context is
 * dead, every stream stops and every call returns 700, as with a sticky
 * error), fake_fail_launch() / fake_fail_write_value() (the (k+1)-th such
 * call from now fails: a stream op only partly queued).
 * FAKE_CUDA_KERNEL_DELAY_US=N makes every phx_copy kernel run N us late.
 * FAKE_CUDA_NO_BATCH=1 hides cuMemcpyBatchAsync; FAKE_CUDA_NO_MEMOPS=1 makes
 * the stream memory operations fail; FAKE_CUDA_PTX_MAX=8.0 refuses PTX of
 * a newer ISA (a CUDA 12.0 driver).  cuMemGetAddressRange needs a current
 * context, as CUDA's does (error 201 without one).
 *
 * Devices: FAKE_CUDA_DEVICES=N (1..8, default 1) fakes N devices, each with
 * its primary context and a PCI bus id (cuDeviceGetPCIBusId, "0000:1B:00.0"
 * for device 0, bus 0x1b + 0x10 per ordinal, upper-case as the driver spells
 * it).  Each thread has a context stack; allocations, streams and events
 * belong to the device whose context is current when they are made, and
 * cuPointerGetAttribute answers that device's ordinal.  With several devices
 * the fake is strict where a mix-up would go unseen on host memory: a call
 * that needs a context fails with CUDA_ERROR_INVALID_CONTEXT (201) when none
 * is current, work queued on a stream needs that stream's context current,
 * and a copy or event on a stream must concern that stream's device
 * (stricter than CUDA, which would copy between devices over peer access:
 * phx never means to).  With one device, calls without a current context
 * act on device 0, as the single-device tests have always relied on.
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <pthread.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

typedef int CUresult;
typedef uint64_t CUdeviceptr;
typedef void (*CUhostFn)(void *);

#define OK 0
#define EINVALID 1
#define ENOCTX 201		/* CUDA_ERROR_INVALID_CONTEXT */
#define ENOTREADY 600
#define ENOTSUP 801
#define MAX_DEV 8

static int64_t now_ns(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

/*
 * ---- a device-synchronising call, as cudaFree or a growing allocator make
 * it: fake_device_sync() blocks every other thread's API calls until all
 * streams are idle.  Work whose completion needs a new API call (from a
 * lane, say) then deadlocks, as it can on a real driver.
 */
static pthread_mutex_t api_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t api_cond = PTHREAD_COND_INITIALIZER;
static int api_syncing;
static pthread_t api_syncer;

static void api_enter(void)
{
	pthread_mutex_lock(&api_lock);
	while (api_syncing && !pthread_equal(api_syncer, pthread_self()))
		pthread_cond_wait(&api_cond, &api_lock);
	pthread_mutex_unlock(&api_lock);
}

/* ---- a sticky error: fake_fault_async() ran; nothing runs any more ---- */
#define EDEAD 700		/* CUDA_ERROR_ILLEGAL_ADDRESS */
static int dead;

static int is_dead(void)
{
	return __atomic_load_n(&dead, __ATOMIC_ACQUIRE);
}

/* ---- devices and the calling thread's context stack ---- */

struct fake_ctx {
	int dev;
	int retained;			/* cuDevicePrimaryCtxRetain - Release */
};

static struct fake_ctx ctxs[MAX_DEV];
static int ndev = 1;
static pthread_once_t dev_once = PTHREAD_ONCE_INIT;

static void dev_init(void)
{
	const char *v = getenv("FAKE_CUDA_DEVICES");
	int i;

	if (v && atoi(v) >= 1)
		ndev = atoi(v) > MAX_DEV ? MAX_DEV : atoi(v);
	for (i = 0; i < MAX_DEV; i++)
		ctxs[i].dev = i;
}

static int ndevices(void)
{
	pthread_once(&dev_once, dev_init);
	return ndev;
}

#define CTX_DEPTH 16
static __thread struct fake_ctx *ctx_stack[CTX_DEPTH];
static __thread int ctx_depth;

/*
 * The device of the calling thread's current context; -1 when none is
 * current and there are several devices (one device: 0, see the top).
 */
static int cur_dev(void)
{
	if (ctx_depth)
		return ctx_stack[ctx_depth - 1]->dev;
	return ndevices() == 1 ? 0 : -1;
}

/* ---- memory ---- */

struct alloc {
	uint64_t base, size;
	int dev;
	struct alloc *next;
};

static pthread_mutex_t mem_lock = PTHREAD_MUTEX_INITIALIZER;
static struct alloc *allocs;

static struct alloc *find_alloc(uint64_t p)
{
	struct alloc *a;

	for (a = allocs; a; a = a->next)
		if (p >= a->base && p < a->base + a->size)
			return a;
	return NULL;
}

/*
 * Is [p, p + n) mapped: one allocation, or allocations of one device that
 * follow each other (VMM segments: copies and kernels cross them, as on a
 * GPU)?  Its device, or -1.
 */
static int dev_range(uint64_t p, size_t n)
{
	struct alloc *a;
	int dev = -1;

	pthread_mutex_lock(&mem_lock);
	a = find_alloc(p);
	if (a)
		dev = a->dev;
	while (a && p + n > a->base + a->size) {
		struct alloc *next = find_alloc(a->base + a->size);

		if (!next || next->dev != a->dev || next->base != a->base + a->size)
			dev = -1;
		a = dev < 0 ? NULL : next;
	}
	pthread_mutex_unlock(&mem_lock);
	return a ? dev : -1;
}

CUresult cuMemAlloc_v2(CUdeviceptr *p, size_t n)
{
	struct alloc *a;
	void *m = NULL;
	int dev = cur_dev();

	if (dev < 0)
		return ENOCTX;
	a = calloc(1, sizeof(*a));
	if (!a || posix_memalign(&m, 256, n ? n : 1))
		return 2;
	a->base = (uint64_t)(uintptr_t)m;
	a->size = n;
	a->dev = dev;
	pthread_mutex_lock(&mem_lock);
	a->next = allocs;
	allocs = a;
	pthread_mutex_unlock(&mem_lock);
	*p = a->base;
	return OK;
}

CUresult cuMemFree_v2(CUdeviceptr p)
{
	struct alloc **pp, *a;

	pthread_mutex_lock(&mem_lock);
	for (pp = &allocs; *pp; pp = &(*pp)->next) {
		if ((*pp)->base == p) {
			a = *pp;
			*pp = a->next;
			pthread_mutex_unlock(&mem_lock);
			free((void *)(uintptr_t)a->base);
			free(a);
			return OK;
		}
	}
	pthread_mutex_unlock(&mem_lock);
	return EINVALID;
}

CUresult cuPointerGetAttribute(void *out, int attr, CUdeviceptr p)
{
	api_enter();
	int dev = dev_range(p, 1);

	if (dev < 0)
		return EINVALID;
	if (attr == 2)
		*(unsigned int *)out = 2;	/* CU_MEMORYTYPE_DEVICE */
	else if (attr == 9)
		*(int *)out = dev;
	return OK;
}

/*
 * Test hook: @nseg allocations of @seg bytes each, one after the other in
 * one range (PyTorch's expandable segments: cuMemGetAddressRange reports
 * one segment at a time).  *@p is the start.
 */
CUresult fake_alloc_segments(CUdeviceptr *p, int nseg, size_t seg)
{
	void *m = NULL;
	int dev = cur_dev(), i;

	if (dev < 0)
		return ENOCTX;
	if (nseg < 1 || posix_memalign(&m, 4096, (size_t)nseg * seg))
		return 2;
	pthread_mutex_lock(&mem_lock);
	for (i = 0; i < nseg; i++) {
		struct alloc *a = calloc(1, sizeof(*a));

		a->base = (uint64_t)(uintptr_t)m + (uint64_t)i * seg;
		a->size = seg;
		a->dev = dev;
		a->next = allocs;
		allocs = a;
	}
	pthread_mutex_unlock(&mem_lock);
	*p = (uint64_t)(uintptr_t)m;
	return OK;
}

CUresult cuMemGetAddressRange_v2(CUdeviceptr *base, size_t *size, CUdeviceptr p)
{
	api_enter();
	struct alloc *a;

	if (!ctx_depth)
		return ENOCTX;	/* CUDA needs a current context here */

	pthread_mutex_lock(&mem_lock);
	a = find_alloc(p);
	if (a) {
		*base = a->base;
		*size = a->size;
	}
	pthread_mutex_unlock(&mem_lock);
	return a ? OK : EINVALID;
}

/*
 * fake_fail_host_register(k): the (k+1)-th cuMemHostRegister from now fails
 * with CUDA_ERROR_OUT_OF_MEMORY (2), once; fake_host_registered(): the
 * number of regions registered now, and the lowest address alignment of
 * any region of 2 MiB or more registered so far.
 */
static int hostreg_fail_in = -1, hostreg_live;
static size_t hostreg_align = (size_t)1 << 40;

void fake_fail_host_register(int k)
{
	pthread_mutex_lock(&mem_lock);
	hostreg_fail_in = k;
	pthread_mutex_unlock(&mem_lock);
}

int fake_host_registered(size_t *min_align)
{
	int n;

	pthread_mutex_lock(&mem_lock);
	n = hostreg_live;
	*min_align = hostreg_align;
	pthread_mutex_unlock(&mem_lock);
	return n;
}

CUresult cuMemHostRegister_v2(void *p, size_t n, unsigned f)
{
	CUresult r = OK;

	if (cur_dev() < 0)
		return ENOCTX;
	pthread_mutex_lock(&mem_lock);
	if (hostreg_fail_in == 0)
		r = 2;
	if (hostreg_fail_in >= 0)
		hostreg_fail_in--;
	if (r == OK) {
		hostreg_live++;
		if (n >= ((size_t)2 << 20)) {	/* staging-sized: how aligned? */
			size_t a = (uintptr_t)p & -(uintptr_t)p;

			if (a < hostreg_align)
				hostreg_align = a;
		}
	}
	pthread_mutex_unlock(&mem_lock);
	return r;
}

CUresult cuMemHostUnregister(void *p)
{
	pthread_mutex_lock(&mem_lock);
	hostreg_live--;
	pthread_mutex_unlock(&mem_lock);
	return OK;
}

CUresult cuMemHostGetDevicePointer_v2(CUdeviceptr *d, void *p, unsigned f)
{
	*d = (uint64_t)(uintptr_t)p;
	return OK;
}

/* ---- the callback thread ---- */

struct cb {
	CUhostFn fn;
	void *arg;
	int done;
	struct cb *next;
};

static pthread_mutex_t cb_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t cb_cond = PTHREAD_COND_INITIALIZER;
static struct cb *cb_head, *cb_tail;
static pthread_once_t cb_once = PTHREAD_ONCE_INIT;
static int64_t cb_max_ns;

static void *cb_main(void *arg)
{
	for (;;) {
		struct cb *c;
		int64_t t0, dt;

		pthread_mutex_lock(&cb_lock);
		while (!cb_head)
			pthread_cond_wait(&cb_cond, &cb_lock);
		c = cb_head;
		cb_head = c->next;
		if (!cb_head)
			cb_tail = NULL;
		pthread_mutex_unlock(&cb_lock);
		t0 = now_ns();
		c->fn(c->arg);
		dt = now_ns() - t0;
		pthread_mutex_lock(&cb_lock);
		if (dt > cb_max_ns)
			cb_max_ns = dt;
		c->done = 1;
		pthread_cond_broadcast(&cb_cond);
		pthread_mutex_unlock(&cb_lock);
	}
	return NULL;
}

static void cb_start(void)
{
	pthread_t t;

	pthread_create(&t, NULL, cb_main, NULL);
	pthread_detach(t);
}

static void cb_run(CUhostFn fn, void *arg)
{
	struct cb c = { fn, arg, 0, NULL };

	pthread_once(&cb_once, cb_start);
	pthread_mutex_lock(&cb_lock);
	if (cb_tail)
		cb_tail->next = &c;
	else
		cb_head = &c;
	cb_tail = &c;
	pthread_cond_broadcast(&cb_cond);
	while (!c.done)
		pthread_cond_wait(&cb_cond, &cb_lock);
	pthread_mutex_unlock(&cb_lock);
}

int64_t fake_hostfn_max_ns(void)
{
	int64_t v;

	pthread_mutex_lock(&cb_lock);
	v = cb_max_ns;
	pthread_mutex_unlock(&cb_lock);
	return v;
}

/* ---- events ---- */

struct event {
	pthread_mutex_t lock;
	pthread_cond_t cond;
	uint64_t recorded, reached;
	int dev;
};

CUresult cuEventCreate(struct event **e, unsigned f)
{
	int dev = cur_dev();

	if (dev < 0)
		return ENOCTX;
	*e = calloc(1, sizeof(**e));
	(*e)->dev = dev;
	pthread_mutex_init(&(*e)->lock, NULL);
	pthread_cond_init(&(*e)->cond, NULL);
	return OK;
}

CUresult cuEventDestroy_v2(struct event *e)
{
	free(e);
	return OK;
}

CUresult cuEventQuery(struct event *e)
{
	if (is_dead())
		return EDEAD;
	api_enter();
	int r;

	pthread_mutex_lock(&e->lock);
	r = e->reached >= e->recorded ? OK : ENOTREADY;
	pthread_mutex_unlock(&e->lock);
	return r;
}

CUresult cuEventSynchronize(struct event *e)
{
	pthread_mutex_lock(&e->lock);
	while (e->reached < e->recorded)
		pthread_cond_wait(&e->cond, &e->lock);
	pthread_mutex_unlock(&e->lock);
	return OK;
}

/* ---- streams ---- */

enum { OP_COPY, OP_WAITVAL, OP_HOSTFN, OP_EVREC, OP_WAITEV, OP_SLEEP, OP_MEMSET, OP_KERNEL,
       OP_WRITEVAL, OP_DESC, OP_FAULT };

struct op {
	int kind;
	void *dst;
	const void *src;
	size_t n;
	volatile uint32_t *addr;
	uint32_t value;
	CUhostFn fn;
	void *arg;
	struct event *ev;
	uint64_t seq;
	struct op *next;
};

struct stream {
	pthread_mutex_t lock;
	pthread_cond_t cond;
	struct op *head, *tail;
	int busy;
	pthread_t thr;
	int dev;			/* -1: the legacy stream, any device's */
	int capturing;			/* fake_stream_capture() */
};

static long kernels_run;

/* FAKE_CUDA_KERNEL_DELAY_US: each phx_copy kernel runs this much later */
static useconds_t kernel_delay_us(void)
{
	static int v = -1;

	if (v < 0) {
		const char *s = getenv("FAKE_CUDA_KERNEL_DELAY_US");

		v = s ? atoi(s) : 0;
	}
	return (useconds_t)v;
}

long fake_kernels_run(void)
{
	return __atomic_load_n(&kernels_run, __ATOMIC_RELAXED);
}

static void run_op(struct op *o)
{
	switch (o->kind) {
	case OP_COPY:
		memcpy(o->dst, o->src, o->n);
		break;
	case OP_MEMSET:
		memset(o->dst, (int)o->value, o->n);
		break;
	case OP_WAITVAL:
		while ((int32_t)(__atomic_load_n(o->addr, __ATOMIC_ACQUIRE) - o->value) < 0)
			usleep(20);
		break;
	case OP_WRITEVAL:
		__atomic_store_n(o->addr, o->value, __ATOMIC_RELEASE);
		break;
	case OP_DESC:
		/* phx_desc: the pinned descriptor into "GPU" memory, read when it runs */
		memcpy(o->dst, (const void *)o->src, 32);
		__atomic_thread_fence(__ATOMIC_SEQ_CST);
		break;
	case OP_FAULT:
		__atomic_store_n(&dead, EDEAD, __ATOMIC_RELEASE);
		break;
	case OP_HOSTFN:
		cb_run(o->fn, o->arg);
		break;
	case OP_EVREC:
		pthread_mutex_lock(&o->ev->lock);
		if (o->seq > o->ev->reached)
			o->ev->reached = o->seq;
		pthread_cond_broadcast(&o->ev->cond);
		pthread_mutex_unlock(&o->ev->lock);
		break;
	case OP_WAITEV:
		pthread_mutex_lock(&o->ev->lock);
		while (o->ev->reached < o->seq)
			pthread_cond_wait(&o->ev->cond, &o->ev->lock);
		pthread_mutex_unlock(&o->ev->lock);
		break;
	case OP_SLEEP:
		usleep((useconds_t)o->n);
		break;
	case OP_KERNEL: {
		/* phx_copy: the descriptor (in "GPU" memory) is read when it runs */
		const volatile uint64_t *d = o->src;

		if (kernel_delay_us())
			usleep(kernel_delay_us());	/* a slow GPU: widen every race */
		if (d[2])
			memcpy((void *)(uintptr_t)d[1], (const void *)(uintptr_t)d[0], d[2]);
		__atomic_add_fetch(&kernels_run, 1, __ATOMIC_RELAXED);
		break;
	}
	}
}

static void *stream_main(void *arg)
{
	struct stream *s = arg;

	for (;;) {
		struct op *o;

		pthread_mutex_lock(&s->lock);
		while (!s->head)
			pthread_cond_wait(&s->cond, &s->lock);
		o = s->head;
		s->busy = 1;
		pthread_mutex_unlock(&s->lock);
		/* a dead context runs nothing: its queues stay as they are */
		while (is_dead())
			usleep(1000);
		run_op(o);
		pthread_mutex_lock(&s->lock);
		s->head = o->next;
		if (!s->head)
			s->tail = NULL;
		s->busy = 0;
		pthread_cond_broadcast(&s->cond);
		pthread_mutex_unlock(&s->lock);
		free(o);
	}
	return NULL;
}

static struct stream *all_streams[4096];
static int nstreams;

static struct stream *stream_new(int dev)
{
	struct stream *s = calloc(1, sizeof(*s));

	s->dev = dev;
	pthread_mutex_lock(&api_lock);
	if (nstreams < 4096)
		all_streams[nstreams++] = s;
	pthread_mutex_unlock(&api_lock);

	pthread_mutex_init(&s->lock, NULL);
	pthread_cond_init(&s->cond, NULL);
	pthread_create(&s->thr, NULL, stream_main, s);
	pthread_detach(s->thr);
	return s;
}

static struct stream *legacy;
static pthread_once_t legacy_once = PTHREAD_ONCE_INIT;

static void legacy_make(void)
{
	legacy = stream_new(-1);
}

static struct stream *S(void *h)
{
	if ((uintptr_t)h <= 2) {
		pthread_once(&legacy_once, legacy_make);
		return legacy;
	}
	return h;
}

/*
 * The device that work queued on @h runs on, or -1 when it may not be
 * queued from this thread: a stream takes work while its own context is
 * current (CUDA: CUDA_ERROR_INVALID_HANDLE otherwise); the legacy stream is
 * the current context's.
 */
static int stream_dev(void *h)
{
	struct stream *s = S(h);
	int cur = cur_dev();

	if (s->dev < 0 || cur < 0)
		return cur;
	return s->dev == cur ? cur : -1;
}

/* Device memory [p, p + n) must be @dev's (see the top). */
static int mem_on(int dev, uint64_t p, size_t n)
{
	return dev >= 0 && dev_range(p, n) == dev;
}

static void push(void *h, struct op *o)
{
	struct stream *s = S(h);

	o->next = NULL;
	pthread_mutex_lock(&s->lock);
	if (s->tail)
		s->tail->next = o;
	else
		s->head = o;
	s->tail = o;
	pthread_cond_broadcast(&s->cond);
	pthread_mutex_unlock(&s->lock);
}

static struct op *op_new(int kind)
{
	struct op *o = calloc(1, sizeof(*o));

	o->kind = kind;
	return o;
}

/* fake_fail_stream_create(k): the (k+1)-th cuStreamCreate from now fails, once. */
static int stream_fail_in = -1;

void fake_fail_stream_create(int k)
{
	pthread_mutex_lock(&mem_lock);
	stream_fail_in = k;
	pthread_mutex_unlock(&mem_lock);
}

CUresult cuStreamCreate(struct stream **s, unsigned f)
{
	bool fail;

	pthread_mutex_lock(&mem_lock);
	fail = stream_fail_in == 0;
	if (stream_fail_in >= 0)
		stream_fail_in--;
	pthread_mutex_unlock(&mem_lock);
	if (fail)
		return 2;
	if (cur_dev() < 0)
		return ENOCTX;
	*s = stream_new(cur_dev());
	return OK;
}

CUresult cuStreamDestroy_v2(struct stream *s) { return OK; /* threads linger: a test double */ }

CUresult cuStreamSynchronize(void *h)
{
	struct stream *s = S(h);

	pthread_mutex_lock(&s->lock);
	while (s->head && !is_dead()) {
		struct timespec ts;

		clock_gettime(CLOCK_REALTIME, &ts);
		ts.tv_nsec += 10000000;
		if (ts.tv_nsec >= 1000000000) {
			ts.tv_sec++;
			ts.tv_nsec -= 1000000000;
		}
		pthread_cond_timedwait(&s->cond, &s->lock, &ts);
	}
	pthread_mutex_unlock(&s->lock);
	return is_dead() ? EDEAD : OK;
}

CUresult cuStreamQuery(void *h)
{
	api_enter();
	struct stream *s = S(h);
	int r;

	if (is_dead())
		return EDEAD;
	pthread_mutex_lock(&s->lock);
	r = s->head ? ENOTREADY : OK;
	pthread_mutex_unlock(&s->lock);
	return r;
}

CUresult cuEventRecord(struct event *e, void *h)
{
	api_enter();
	struct op *o;

	if (stream_dev(h) < 0 || stream_dev(h) != e->dev)
		return 400;		/* an event of another device */
	o = op_new(OP_EVREC);

	pthread_mutex_lock(&e->lock);
	o->seq = ++e->recorded;
	pthread_mutex_unlock(&e->lock);
	o->ev = e;
	push(h, o);
	return OK;
}

CUresult cuStreamWaitEvent(void *h, struct event *e, unsigned f)
{
	api_enter();
	struct op *o;

	if (stream_dev(h) < 0)
		return 400;
	o = op_new(OP_WAITEV);

	pthread_mutex_lock(&e->lock);
	o->seq = e->recorded;
	pthread_mutex_unlock(&e->lock);
	o->ev = e;
	push(h, o);
	return OK;
}

CUresult cuStreamWaitValue32_v2(void *h, CUdeviceptr addr, uint32_t v, unsigned f)
{
	struct op *o;

	if (getenv("FAKE_CUDA_NO_MEMOPS"))
		return ENOTSUP;
	if (is_dead())
		return EDEAD;
	if (stream_dev(h) < 0)
		return 400;
	o = op_new(OP_WAITVAL);
	o->addr = (volatile uint32_t *)(uintptr_t)addr;
	o->value = v;
	push(h, o);
	return OK;
}

/* fake_fail_write_value(k) / fake_fail_launch(k): the (k+1)-th call from now fails, once. */
static int wv_fail_in = -1, launch_fail_in = -1;

void fake_fail_write_value(int k)
{
	__atomic_store_n(&wv_fail_in, k, __ATOMIC_RELEASE);
}

void fake_fail_launch(int k)
{
	__atomic_store_n(&launch_fail_in, k, __ATOMIC_RELEASE);
}

/* Decrement *@cnt if armed; true when this call is the one that fails. */
static bool fail_now(int *cnt)
{
	int v = __atomic_load_n(cnt, __ATOMIC_ACQUIRE);

	while (v >= 0) {
		if (__atomic_compare_exchange_n(cnt, &v, v - 1, false, __ATOMIC_ACQ_REL,
						__ATOMIC_ACQUIRE))
			return v == 0;
	}
	return false;
}

CUresult cuStreamWriteValue32_v2(void *h, CUdeviceptr addr, uint32_t v, unsigned f)
{
	struct op *o;

	if (getenv("FAKE_CUDA_NO_MEMOPS"))
		return ENOTSUP;
	if (is_dead())
		return EDEAD;
	if (stream_dev(h) < 0)
		return 400;
	if (fail_now(&wv_fail_in))
		return 2;
	o = op_new(OP_WRITEVAL);
	o->addr = (volatile uint32_t *)(uintptr_t)addr;
	o->value = v;
	push(h, o);
	return OK;
}

CUresult cuStreamIsCapturing(void *h, int *status)
{
	*status = S(h)->capturing ? 1 : 0;	/* CU_STREAM_CAPTURE_STATUS_ACTIVE */
	return OK;
}

CUresult cuThreadExchangeStreamCaptureMode(int *mode)
{
	*mode = 0;
	return OK;
}

/* Test hook: @h begins (@on) or ends a graph capture. */
void fake_stream_capture(void *h, int on)
{
	S(h)->capturing = on;
}

/* Test hook: a kernel on @h that faults when it runs: the context dies. */
CUresult fake_fault_async(void *h)
{
	push(h, op_new(OP_FAULT));
	return OK;
}

int fake_is_dead(void)
{
	return is_dead();
}

CUresult cuLaunchHostFunc(void *h, CUhostFn fn, void *arg)
{
	api_enter();
	struct op *o;

	if (stream_dev(h) < 0)
		return 400;
	o = op_new(OP_HOSTFN);

	o->fn = fn;
	o->arg = arg;
	push(h, o);
	return OK;
}

static CUresult copy(void *h, void *dst, const void *src, size_t n)
{
	struct op *o = op_new(OP_COPY);

	o->dst = dst;
	o->src = src;
	o->n = n;
	push(h, o);
	return OK;
}

/*
 * fake_poison_copies(lo, hi): from now on every copy to the GPU whose
 * destination meets [lo, hi) is refused (CUDA_ERROR_INVALID_VALUE, in a
 * batch with its index), until fake_poison_copies(0, 0): an injected copy
 * error that must never become data.
 */
static uint64_t poison_lo, poison_hi;

void fake_poison_copies(uint64_t lo, uint64_t hi)
{
	__atomic_store_n(&poison_lo, lo, __ATOMIC_RELEASE);
	__atomic_store_n(&poison_hi, hi, __ATOMIC_RELEASE);
}

static int poisoned(uint64_t d, size_t n)
{
	uint64_t lo = __atomic_load_n(&poison_lo, __ATOMIC_ACQUIRE);
	uint64_t hi = __atomic_load_n(&poison_hi, __ATOMIC_ACQUIRE);

	return lo < hi && d < hi && d + n > lo;
}

CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr d, const void *src, size_t n, void *h)
{
	api_enter();
	if (!mem_on(stream_dev(h), d, n) || poisoned(d, n))
		return EINVALID;
	return copy(h, (void *)(uintptr_t)d, src, n);
}

CUresult cuMemcpyDtoHAsync_v2(void *dst, CUdeviceptr s, size_t n, void *h)
{
	api_enter();
	if (!mem_on(stream_dev(h), s, n))
		return EINVALID;
	return copy(h, dst, (const void *)(uintptr_t)s, n);
}

static long batch_calls;

CUresult fake_MemcpyBatchAsync(CUdeviceptr *dsts, CUdeviceptr *srcs, size_t *sizes,
			       size_t count, void *attrs, size_t *idx, size_t nattrs,
			       size_t *fail, void *h)
{
	size_t i;
	int dev;

	api_enter();
	if ((uintptr_t)h <= 2 || !nattrs || !attrs)
		return EINVALID;	/* as CUDA: no legacy stream */
	dev = stream_dev(h);
	for (i = 0; i < count; i++) {
		if ((!mem_on(dev, dsts[i], sizes[i]) && !mem_on(dev, srcs[i], sizes[i])) ||
		    (mem_on(dev, dsts[i], sizes[i]) && poisoned(dsts[i], sizes[i]))) {
			*fail = i;
			return EINVALID;
		}
	}
	for (i = 0; i < count; i++)
		copy(h, (void *)(uintptr_t)dsts[i], (const void *)(uintptr_t)srcs[i], sizes[i]);
	__atomic_add_fetch(&batch_calls, 1, __ATOMIC_RELAXED);
	return OK;
}

long fake_batch_calls(void)
{
	return __atomic_load_n(&batch_calls, __ATOMIC_RELAXED);
}

CUresult cuMemsetD8Async(CUdeviceptr d, unsigned char v, size_t n, void *h)
{
	struct op *o;

	if (!mem_on(stream_dev(h), d, n))
		return EINVALID;
	o = op_new(OP_MEMSET);
	o->dst = (void *)(uintptr_t)d;
	o->value = v;
	o->n = n;
	push(h, o);
	return OK;
}

/* Test hook: a device-wide synchronisation that blocks other API callers. */
int fake_device_sync(int timeout_ms)
{
	int64_t deadline = now_ns() + (int64_t)timeout_ms * 1000000;
	int i, busy = 1;

	pthread_once(&legacy_once, legacy_make);
	pthread_mutex_lock(&api_lock);
	api_syncing = 1;
	api_syncer = pthread_self();
	pthread_mutex_unlock(&api_lock);
	while (busy && now_ns() < deadline) {
		busy = 0;
		for (i = 0; i < nstreams; i++) {
			struct stream *s = all_streams[i];

			pthread_mutex_lock(&s->lock);
			busy |= s->head != NULL;
			pthread_mutex_unlock(&s->lock);
		}
		if (busy)
			usleep(1000);
	}
	pthread_mutex_lock(&api_lock);
	api_syncing = 0;
	pthread_cond_broadcast(&api_cond);
	pthread_mutex_unlock(&api_lock);
	return busy ? -1 : 0;	/* -1: it would have hung */
}

/* Test hook: keep @h busy for @us microseconds (a long kernel). */
CUresult fake_sleep_async(void *h, unsigned long us)
{
	struct op *o = op_new(OP_SLEEP);

	o->n = us;
	push(h, o);
	return OK;
}

CUresult cuGetProcAddress_v2(const char *sym, void **pfn, int ver, uint64_t flags, int *st)
{
	if (!strcmp(sym, "cuMemcpyBatchAsync") && !getenv("FAKE_CUDA_NO_BATCH")) {
		*pfn = (void *)fake_MemcpyBatchAsync;
		return OK;
	}
	*pfn = NULL;
	return 500;
}

/* ---- modules: only libphx's two copy kernels exist, once per device ---- */

static int the_module[MAX_DEV], fn_desc[MAX_DEV], fn_copy[MAX_DEV];

/* FAKE_CUDA_PTX_MAX: the newest PTX ISA this "driver" compiles (default 9.0). */
static bool ptx_too_new(const char *image)
{
	const char *v = strstr(image, "\n.version "), *max = getenv("FAKE_CUDA_PTX_MAX");
	double have, lim = max ? atof(max) : 9.0;

	if (!v)
		return true;
	have = atof(v + 10);
	return have > lim + 1e-9;
}

CUresult cuModuleLoadData(void **m, const void *image)
{
	int dev = cur_dev();

	if (dev < 0)
		return ENOCTX;
	if (ptx_too_new(image))
		return 222;	/* CUDA_ERROR_UNSUPPORTED_PTX_VERSION */
	if (!strstr((const char *)image, ".entry phx_copy") ||
	    !strstr((const char *)image, ".entry phx_desc"))
		return EINVALID;
	*m = &the_module[dev];
	return OK;
}

CUresult cuModuleUnload(void *m) { return OK; }

CUresult cuModuleGetFunction(void **f, void *m, const char *name)
{
	int dev = (int)((int *)m - the_module);

	if (!strcmp(name, "phx_copy"))
		*f = &fn_copy[dev];
	else if (!strcmp(name, "phx_desc"))
		*f = &fn_desc[dev];
	else
		return 500;
	return OK;
}

CUresult cuLaunchKernel(void *f, unsigned gx, unsigned gy, unsigned gz, unsigned bx,
			unsigned by, unsigned bz, unsigned shm, void *h, void **params,
			void **extra)
{
	struct op *o;
	int dev = stream_dev(h);

	if (is_dead())
		return EDEAD;
	if (dev < 0 || !params || (f != &fn_copy[dev] && f != &fn_desc[dev]))
		return EINVALID;	/* another device's kernel, or none */
	if (fail_now(&launch_fail_in))
		return 2;
	if (f == &fn_desc[dev]) {
		o = op_new(OP_DESC);
		o->src = (const void *)(uintptr_t)*(uint64_t *)params[0];
		o->dst = (void *)(uintptr_t)*(uint64_t *)params[1];
	} else {
		o = op_new(OP_KERNEL);
		o->src = (const void *)(uintptr_t)*(uint64_t *)params[0];
	}
	push(h, o);
	return OK;
}

/* ---- the rest ---- */

CUresult cuInit(unsigned f) { return OK; }
CUresult cuDriverGetVersion(int *v) { *v = 13000; return OK; }
CUresult cuDeviceGetCount(int *n) { *n = ndevices(); return OK; }

CUresult cuDeviceGet(int *d, int o)
{
	*d = o;
	return o >= 0 && o < ndevices() ? OK : EINVALID;
}

/* FAKE_CUDA_NO_PCI_BUS_ID=1 makes it fail (a driver that cannot say). */
CUresult cuDeviceGetPCIBusId(char *id, int len, int d)
{
	if (d < 0 || d >= ndevices() || len < 13 || getenv("FAKE_CUDA_NO_PCI_BUS_ID"))
		return EINVALID;
	snprintf(id, (size_t)len, "0000:%02X:00.0", 0x1b + 0x10 * d);
	return OK;
}

CUresult cuDevicePrimaryCtxRetain(void **c, int d)
{
	if (d < 0 || d >= ndevices())
		return EINVALID;
	__atomic_add_fetch(&ctxs[d].retained, 1, __ATOMIC_RELAXED);
	*c = &ctxs[d];
	return OK;
}

CUresult cuDevicePrimaryCtxRelease_v2(int d)
{
	if (d < 0 || d >= ndevices())
		return EINVALID;
	__atomic_sub_fetch(&ctxs[d].retained, 1, __ATOMIC_RELAXED);
	return OK;
}

/* Test hook: references held on device @d's primary context. */
int fake_ctx_retained(int d)
{
	return d >= 0 && d < MAX_DEV ? __atomic_load_n(&ctxs[d].retained, __ATOMIC_RELAXED) : -1;
}

/* Replaces the top of the thread's stack; NULL unbinds it. */
CUresult cuCtxSetCurrent(void *c)
{
	if (c && ctx_depth)
		ctx_stack[ctx_depth - 1] = c;
	else if (c)
		ctx_stack[ctx_depth++] = c;
	else if (ctx_depth)
		ctx_depth--;
	return OK;
}

CUresult cuCtxPushCurrent_v2(void *c)
{
	if (!c || ctx_depth == CTX_DEPTH)
		return EINVALID;
	ctx_stack[ctx_depth++] = c;
	return OK;
}

CUresult cuCtxPopCurrent_v2(void **c)
{
	if (!ctx_depth)
		return ENOCTX;
	ctx_depth--;
	if (c)
		*c = ctx_stack[ctx_depth];
	return OK;
}

CUresult cuGetErrorString(CUresult r, const char **s)
{
	*s = r == EINVALID ? "invalid argument (fake)" : "fake CUDA error";
	return OK;
}
