// SPDX-License-Identifier: Apache-2.0
/*
 * cuda_staging.c - GPU memory in and out through pinned staging ("Co-DMA").
 *
 * Pieces, in the order below:
 *   - the CUDA driver API, loaded at run time (no CUDA headers needed);
 *   - contexts: pinned staging buffers grouped into lanes (one thread and
 *     one phx_engine each), a page of host-mapped flags, internal streams;
 *   - enqueueing a request: chunks are assigned round-robin to staging
 *     buffers; for each chunk the device copy is queued on the request's
 *     stream behind a wait on the buffer's flag (read), or ahead of the
 *     file write (write);
 *   - lanes: each staging buffer is a FIFO of uses that its lane serves in
 *     order: read = file -> staging (io_uring, fixed buffer), raise the
 *     flag, wait for the copy out; write = wait for the copy in, staging ->
 *     file, raise the flag.
 *
 * Flags: every staging buffer has a 32-bit counter in pinned, device-mapped
 * host memory.  The lane sets it to the sequence number of each use whose
 * file I/O is complete; GPU-side waits are cyclic greater-or-equal waits
 * (cuStreamWaitValue32), so a counter never needs resetting and a waiter
 * can never be released by a later use.
 */
#include <dlfcn.h>
#include <errno.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "phx_cuda.h"
#include "internal.h"

#define CU_EXPORT __attribute__((visibility("default")))

#define CU_MAX_LANES 64u
#define CU_MAX_BUFS 1024u
#define CU_NSTREAMS 8u

/* ------------------------------------------------------------------------ */
/* The driver API, by hand                                                  */
/* ------------------------------------------------------------------------ */

typedef int CUresult;
typedef int CUdevice;
typedef struct CUctx_st *CUcontext;
typedef struct CUstream_st *CUstream;
typedef struct CUevent_st *CUevent;
typedef uint64_t CUdeviceptr;
typedef void (*CUhostFn)(void *user);

enum {
	CUDA_SUCCESS = 0,
	CUDA_ERROR_NOT_READY = 600,
	CU_STREAM_NON_BLOCKING = 1,
	CU_EVENT_DISABLE_TIMING = 2,
	CU_MEMHOSTREGISTER_PORTABLE = 1,
	CU_MEMHOSTREGISTER_DEVICEMAP = 2,
	CU_STREAM_WAIT_VALUE_GEQ = 0,
	CU_POINTER_ATTRIBUTE_MEMORY_TYPE = 2,
	CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL = 9,
	CU_MEMORYTYPE_HOST = 1,
	CU_MEMORYTYPE_DEVICE = 2,
	CU_MEMORYTYPE_UNIFIED = 4,
};

static struct {
	CUresult (*Init)(unsigned);
	CUresult (*DriverGetVersion)(int *);
	CUresult (*DeviceGetCount)(int *);
	CUresult (*DeviceGet)(CUdevice *, int);
	CUresult (*DeviceGetName)(char *, int, CUdevice);
	CUresult (*DevicePrimaryCtxRetain)(CUcontext *, CUdevice);
	CUresult (*DevicePrimaryCtxRelease)(CUdevice);
	CUresult (*CtxSetCurrent)(CUcontext);
	CUresult (*CtxPushCurrent)(CUcontext);
	CUresult (*CtxPopCurrent)(CUcontext *);
	CUresult (*StreamCreate)(CUstream *, unsigned);
	CUresult (*StreamDestroy)(CUstream);
	CUresult (*StreamSynchronize)(CUstream);
	CUresult (*StreamWaitEvent)(CUstream, CUevent, unsigned);
	CUresult (*StreamWaitValue32)(CUstream, CUdeviceptr, uint32_t, unsigned);
	CUresult (*EventCreate)(CUevent *, unsigned);
	CUresult (*EventDestroy)(CUevent);
	CUresult (*EventRecord)(CUevent, CUstream);
	CUresult (*EventQuery)(CUevent);
	CUresult (*MemcpyHtoDAsync)(CUdeviceptr, const void *, size_t, CUstream);
	CUresult (*MemcpyDtoHAsync)(void *, CUdeviceptr, size_t, CUstream);
	CUresult (*MemHostRegister)(void *, size_t, unsigned);
	CUresult (*MemHostUnregister)(void *);
	CUresult (*MemHostGetDevicePointer)(CUdeviceptr *, void *, unsigned);
	CUresult (*LaunchHostFunc)(CUstream, CUhostFn, void *);
	CUresult (*GetErrorString)(CUresult, const char **);
	CUresult (*PointerGetAttribute)(void *, int, CUdeviceptr);
} cu;

static pthread_once_t cu_once = PTHREAD_ONCE_INIT;
static int cu_load_err;			/* 0, or -errno */
static char cu_load_why[256];
static int cu_ndev;
static int cu_version;

static __thread char cu_errbuf[512];

static int cerr(int err, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static int cerr(int err, const char *fmt, ...)
{
	va_list ap;

	va_start(ap, fmt);
	vsnprintf(cu_errbuf, sizeof(cu_errbuf), fmt, ap);
	va_end(ap);
	return err;
}

CU_EXPORT const char *phx_cuda_strerror_last(void)
{
	return cu_errbuf[0] ? cu_errbuf : "no error";
}

static const char *cu_str(CUresult r)
{
	const char *s = NULL;

	if (cu.GetErrorString && cu.GetErrorString(r, &s) == CUDA_SUCCESS && s)
		return s;
	return "unknown CUDA error";
}

/* A failed driver call: -EIO (or -ENOMEM/-EINVAL) with the driver's text. */
static int cu_fail(CUresult r, const char *what)
{
	int err = r == 2 ? -ENOMEM : (r == 1 || r == 400) ? -EINVAL : -EIO;

	return cerr(err, "%s: CUDA error %d (%s)", what, r, cu_str(r));
}

static void cu_load(void)
{
	void *h;
	int r;

	h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_GLOBAL);
	if (!h) {
		cu_load_err = -ENODEV;
		snprintf(cu_load_why, sizeof(cu_load_why),
			 "libcuda.so.1 not found (no NVIDIA driver): %s", dlerror());
		return;
	}
#define SYM(field, name)                                                     \
	do {                                                                 \
		*(void **)&cu.field = dlsym(h, name);                        \
		if (!cu.field) {                                             \
			cu_load_err = -ENOSYS;                               \
			snprintf(cu_load_why, sizeof(cu_load_why),           \
				 "libcuda.so.1 lacks %s (driver too old)", name); \
			return;                                              \
		}                                                            \
	} while (0)
	SYM(Init, "cuInit");
	SYM(DriverGetVersion, "cuDriverGetVersion");
	SYM(DeviceGetCount, "cuDeviceGetCount");
	SYM(DeviceGet, "cuDeviceGet");
	SYM(DeviceGetName, "cuDeviceGetName");
	SYM(DevicePrimaryCtxRetain, "cuDevicePrimaryCtxRetain");
	SYM(DevicePrimaryCtxRelease, "cuDevicePrimaryCtxRelease_v2");
	SYM(CtxSetCurrent, "cuCtxSetCurrent");
	SYM(CtxPushCurrent, "cuCtxPushCurrent_v2");
	SYM(CtxPopCurrent, "cuCtxPopCurrent_v2");
	SYM(StreamCreate, "cuStreamCreate");
	SYM(StreamDestroy, "cuStreamDestroy_v2");
	SYM(StreamSynchronize, "cuStreamSynchronize");
	SYM(StreamWaitEvent, "cuStreamWaitEvent");
	SYM(StreamWaitValue32, "cuStreamWaitValue32_v2");
	SYM(EventCreate, "cuEventCreate");
	SYM(EventDestroy, "cuEventDestroy_v2");
	SYM(EventRecord, "cuEventRecord");
	SYM(EventQuery, "cuEventQuery");
	SYM(MemcpyHtoDAsync, "cuMemcpyHtoDAsync_v2");
	SYM(MemcpyDtoHAsync, "cuMemcpyDtoHAsync_v2");
	SYM(MemHostRegister, "cuMemHostRegister_v2");
	SYM(MemHostUnregister, "cuMemHostUnregister");
	SYM(MemHostGetDevicePointer, "cuMemHostGetDevicePointer_v2");
	SYM(LaunchHostFunc, "cuLaunchHostFunc");
	SYM(GetErrorString, "cuGetErrorString");
	SYM(PointerGetAttribute, "cuPointerGetAttribute");
#undef SYM
	r = cu.Init(0);
	if (r != CUDA_SUCCESS) {
		cu_load_err = -ENODEV;
		snprintf(cu_load_why, sizeof(cu_load_why),
			 "cuInit failed: CUDA error %d (%s)", r, cu_str(r));
		return;
	}
	cu.DriverGetVersion(&cu_version);
	r = cu.DeviceGetCount(&cu_ndev);
	if (r != CUDA_SUCCESS || cu_ndev < 1) {
		cu_load_err = -ENODEV;
		snprintf(cu_load_why, sizeof(cu_load_why),
			 "the CUDA driver reports no device");
		return;
	}
	snprintf(cu_load_why, sizeof(cu_load_why), "CUDA driver %d.%d, %d device%s",
		 cu_version / 1000, cu_version % 1000 / 10, cu_ndev,
		 cu_ndev == 1 ? "" : "s");
}

static int cu_ready(void)
{
	pthread_once(&cu_once, cu_load);
	if (cu_load_err)
		return cerr(cu_load_err, "%s", cu_load_why);
	return 0;
}

CU_EXPORT int phx_cuda_available(char *why, size_t len)
{
	pthread_once(&cu_once, cu_load);
	if (why && len)
		snprintf(why, len, "%s", cu_load_why);
	return cu_load_err == 0;
}

/* ------------------------------------------------------------------------ */
/* State                                                                    */
/* ------------------------------------------------------------------------ */

enum use_state {
	U_PENDING,	/* queued: waiting for its turn / its inputs */
	U_IO,		/* file I/O in flight */
	U_COPY,		/* read: waiting for the copy to the GPU to finish */
};

struct cureq;
struct sbuf;

/* One chunk of a request on one staging buffer. */
struct use {
	struct use *next;	/* the buffer's FIFO */
	struct cureq *rq;
	struct sbuf *b;
	CUevent ev;		/* read: copy out done; write: copy in done */
	uint32_t seq;		/* the buffer's use number (flag value) */
	uint8_t state;
	bool failed;		/* never enqueued completely: skip the I/O */
	uint64_t io_off, io_len;	/* the file operation */
	uint64_t buf_off;		/* where it starts in the staging buffer */
	uint64_t user_off, user_len;	/* caller bytes it carries (file range) */
	struct phx_io io;
};

struct sbuf {
	struct lane *lane;
	char *mem;
	uint32_t index;			/* global index: flag slot */
	uint32_t seq_enq;		/* last sequence handed out */
	volatile uint32_t *flag;	/* host view */
	CUdeviceptr flag_d;		/* device view */
	struct use *head;		/* oldest unretired use (lane pops) */
	struct use *last;		/* newest unretired use */
	/*
	 * Held while a use is queued on a stream, so uses get their sequence
	 * numbers in stream order.  Never taken by the lane, and never held
	 * with the lane's lock: a CUDA call may block (full command queue)
	 * until the lane raises flags.
	 */
	pthread_mutex_t enq_lock;
};

struct lane {
	phx_cuda *cuc;
	uint32_t index;
	pthread_t thr;
	bool started;
	phx_engine *eng;
	char *mem;
	size_t mem_len;
	bool cuda_registered;
	bool uring_registered;
	pthread_mutex_t lock;
	pthread_cond_t cond;		/* new work / stop */
	pthread_cond_t gate;		/* host-function gates */
	uint32_t active;		/* unretired uses */
	bool stop;
	struct sbuf *bufs;
	uint32_t nbufs;
};

struct cureq {
	phx_cuda *cuc;
	struct phx_cuda_io *io;
	bool owned;			/* free io when done */
	int64_t *bytes_done;
	int fd;
	bool direct;
	uint32_t op;
	uint64_t off, len;		/* after clipping at end of file */
	CUevent start_ev;		/* reads: the stream reached the request */
	int started;
	uint32_t nuses;
	int ios_left;			/* host-side I/O not yet complete (+1) */
	int uses_left;			/* uses not yet retired (+1) */
	int64_t err;
	uint64_t short_end;		/* lowest end of a short read */
	uint64_t direct_bytes, bounce_bytes, buffered_bytes;
	uint32_t paths;
	pthread_mutex_t lock;
	phx_file *lf[CU_MAX_LANES];	/* fd adopted on each lane's engine */
	struct use uses[];
};

struct phx_cuda {
	struct phx_cuda_config cfg;
	phx_engine *eng;
	CUdevice dev;
	CUcontext ctx;
	bool memops;
	struct lane *lanes;
	uint32_t nlanes;
	struct sbuf **bufs;		/* all, global index */
	uint32_t nbufs;
	uint32_t rr;			/* next buffer (round robin) */
	uint32_t *flags;		/* one page, device-mapped */
	CUdeviceptr flags_d;
	bool flags_registered;
	CUstream streams[CU_NSTREAMS];
	uint32_t stream_rr;
	pthread_mutex_t ev_lock;
	CUevent *ev_free;
	size_t nev_free, ev_cap;
	pthread_mutex_t done_lock;
	pthread_cond_t done_cond;
	pthread_mutex_t st_lock;
	struct phx_cuda_stats st;
};

/* ------------------------------------------------------------------------ */
/* Small helpers                                                            */
/* ------------------------------------------------------------------------ */


static uint64_t down(uint64_t x, uint64_t a)
{
	return x - x % a;
}

static uint64_t up(uint64_t x, uint64_t a)
{
	return down(x + a - 1, a);
}


static void nap_ns(long ns)
{
	struct timespec ts = { 0, ns };

	nanosleep(&ts, NULL);
}

static int ctx_push(phx_cuda *c)
{
	CUresult r = cu.CtxPushCurrent(c->ctx);

	return r == CUDA_SUCCESS ? 0 : cu_fail(r, "cuCtxPushCurrent");
}

static void ctx_pop(void)
{
	CUcontext dummy;

	cu.CtxPopCurrent(&dummy);
}

static int ev_get(phx_cuda *c, CUevent *ev)
{
	CUresult r;

	pthread_mutex_lock(&c->ev_lock);
	if (c->nev_free) {
		*ev = c->ev_free[--c->nev_free];
		pthread_mutex_unlock(&c->ev_lock);
		return 0;
	}
	pthread_mutex_unlock(&c->ev_lock);
	r = cu.EventCreate(ev, CU_EVENT_DISABLE_TIMING);
	return r == CUDA_SUCCESS ? 0 : cu_fail(r, "cuEventCreate");
}

static void ev_put(phx_cuda *c, CUevent ev)
{
	if (!ev)
		return;
	pthread_mutex_lock(&c->ev_lock);
	if (c->nev_free == c->ev_cap) {
		size_t cap = c->ev_cap ? c->ev_cap * 2 : 256;
		CUevent *v = realloc(c->ev_free, cap * sizeof(*v));

		if (!v) {
			pthread_mutex_unlock(&c->ev_lock);
			cu.EventDestroy(ev);
			return;
		}
		c->ev_free = v;
		c->ev_cap = cap;
	}
	c->ev_free[c->nev_free++] = ev;
	pthread_mutex_unlock(&c->ev_lock);
}

/* ------------------------------------------------------------------------ */
/* Configuration                                                            */
/* ------------------------------------------------------------------------ */

CU_EXPORT void phx_cuda_config_init(struct phx_cuda_config *cfg)
{
	long ncpu = sysconf(_SC_NPROCESSORS_ONLN);

	memset(cfg, 0, sizeof(*cfg));
	cfg->size = sizeof(*cfg);
	cfg->device = (int32_t)phx_env_u32("PHX_CUDA_DEVICE", 0);
	/*
	 * Defaults from a sweep on the H200 box (docs/gpu.md): 16 lanes x 4 x
	 * 2 MiB (128 MiB pinned) kept its virtio disk at its best and reached
	 * 24 GB/s from zram, where I/O runs inline in each lane's thread.
	 */
	cfg->lanes = phx_env_u32("PHX_CUDA_LANES",
			     ncpu < 4 ? 4 : ncpu > 16 ? 16 : (uint32_t)ncpu);
	cfg->bufs_per_lane = phx_env_u32("PHX_CUDA_BUFS", 4);
	cfg->buf_size = phx_env_u32("PHX_CUDA_BUF_SIZE", 2u << 20);
	cfg->max_io_size = phx_env_u32("PHX_CUDA_MAX_IO", 1u << 20);
	if (getenv("PHX_CUDA_HOSTFN_GATE") && atoi(getenv("PHX_CUDA_HOSTFN_GATE")))
		cfg->flags |= PHX_CUDA_HOSTFN_GATE;
}

static int config_check(const struct phx_cuda_config *c)
{
	if (c->lanes < 1 || c->lanes > CU_MAX_LANES)
		return cerr(-EINVAL, "lanes %u is outside 1..%u", c->lanes, CU_MAX_LANES);
	if (c->bufs_per_lane < 1 || c->lanes * c->bufs_per_lane > CU_MAX_BUFS)
		return cerr(-EINVAL, "bufs_per_lane %u: 1.. and lanes * bufs_per_lane <= %u",
			    c->bufs_per_lane, CU_MAX_BUFS);
	if (c->buf_size < 65536 || c->buf_size > (256u << 20) || c->buf_size % 65536)
		return cerr(-EINVAL, "buf_size %u must be a multiple of 64 KiB in 64 KiB..256 MiB",
			    c->buf_size);
	if (c->max_io_size < 4096 || c->max_io_size % 4096)
		return cerr(-EINVAL, "max_io_size %u must be a multiple of 4096",
			    c->max_io_size);
	return 0;
}

/* ------------------------------------------------------------------------ */
/* Create / destroy                                                         */
/* ------------------------------------------------------------------------ */

static void *lane_main(void *arg);

static int lane_setup(phx_cuda *c, struct lane *ln, uint32_t index)
{
	struct phx_engine_config ec;
	uint32_t k, per_buf_ios;
	CUresult r;
	int ret;

	ln->cuc = c;
	ln->index = index;
	pthread_mutex_init(&ln->lock, NULL);
	pthread_cond_init(&ln->cond, NULL);
	pthread_cond_init(&ln->gate, NULL);
	ln->nbufs = c->cfg.bufs_per_lane;
	ln->bufs = calloc(ln->nbufs, sizeof(*ln->bufs));
	if (!ln->bufs)
		return cerr(-ENOMEM, "out of memory");

	ln->mem_len = (size_t)ln->nbufs * c->cfg.buf_size;
	ln->mem = mmap(NULL, ln->mem_len, PROT_READ | PROT_WRITE,
		       MAP_PRIVATE | MAP_ANONYMOUS | MAP_POPULATE, -1, 0);
	if (ln->mem == MAP_FAILED) {
		ln->mem = NULL;
		return cerr(-errno, "mmap of %zu staging bytes failed", ln->mem_len);
	}
	r = cu.MemHostRegister(ln->mem, ln->mem_len, CU_MEMHOSTREGISTER_PORTABLE);
	if (r != CUDA_SUCCESS)
		return cu_fail(r, "cuMemHostRegister (staging buffers)");
	ln->cuda_registered = true;

	phx_engine_config_init(&ec);
	per_buf_ios = (c->cfg.buf_size + c->cfg.max_io_size - 1) / c->cfg.max_io_size;
	ec.queue_depth = ln->nbufs * per_buf_ios + 8;
	if (ec.queue_depth > 4096)
		ec.queue_depth = 4096;
	ec.max_io_size = c->cfg.max_io_size;
	ec.bounce_count = 4;
	ec.flags |= PHX_ENGINE_NO_FIXED_FILES;
	ret = phx_engine_create(&ec, &ln->eng);
	if (ret)
		return cerr(ret, "lane engine: %s", phx_strerror_last());
	if (!(c->cfg.flags & PHX_CUDA_NO_FIXED_BUFS) &&
	    phx_buf_register(ln->eng, ln->mem, ln->mem_len) == 0)
		ln->uring_registered = true;

	for (k = 0; k < ln->nbufs; k++) {
		struct sbuf *b = &ln->bufs[k];

		b->lane = ln;
		pthread_mutex_init(&b->enq_lock, NULL);
		b->mem = ln->mem + (size_t)k * c->cfg.buf_size;
		/* lane-interleaved global order: consecutive chunks, other lanes */
		b->index = k * c->nlanes + index;
		b->flag = &c->flags[b->index];
		b->flag_d = c->flags_d + 4ull * b->index;
		c->bufs[b->index] = b;
	}
	if (pthread_create(&ln->thr, NULL, lane_main, ln))
		return cerr(-EAGAIN, "cannot start a lane thread");
	ln->started = true;
	return 0;
}

static void lane_teardown(phx_cuda *c, struct lane *ln)
{
	if (ln->started) {
		pthread_mutex_lock(&ln->lock);
		ln->stop = true;
		pthread_cond_broadcast(&ln->cond);
		pthread_mutex_unlock(&ln->lock);
		pthread_join(ln->thr, NULL);
	}
	if (ln->eng) {
		if (ln->uring_registered)
			phx_buf_deregister(ln->eng, ln->mem);
		phx_engine_destroy(ln->eng);
	}
	if (ln->cuda_registered)
		cu.MemHostUnregister(ln->mem);
	if (ln->mem)
		munmap(ln->mem, ln->mem_len);
	free(ln->bufs);
	pthread_mutex_destroy(&ln->lock);
	pthread_cond_destroy(&ln->cond);
	pthread_cond_destroy(&ln->gate);
}

/* Can this context gate a stream on a host-written flag? */
static bool memops_work(phx_cuda *c)
{
	CUresult r;

	c->flags[CU_MAX_BUFS] = 1;
	r = cu.StreamWaitValue32(c->streams[0], c->flags_d + 4ull * CU_MAX_BUFS, 1,
				 CU_STREAM_WAIT_VALUE_GEQ);
	if (r != CUDA_SUCCESS)
		return false;
	return cu.StreamSynchronize(c->streams[0]) == CUDA_SUCCESS;
}

CU_EXPORT int phx_cuda_create(phx_engine *eng, const struct phx_cuda_config *cfg,
			      phx_cuda **out)
{
	phx_cuda *c;
	CUresult r;
	uint32_t i;
	int ret;

	if (!out)
		return cerr(-EINVAL, "phx_cuda_create: NULL argument");
	*out = NULL;
	ret = cu_ready();
	if (ret)
		return ret;
	c = calloc(1, sizeof(*c));
	if (!c)
		return cerr(-ENOMEM, "out of memory");
	if (cfg)
		memcpy(&c->cfg, cfg, cfg->size && cfg->size < sizeof(c->cfg) ?
		       cfg->size : sizeof(c->cfg));
	else
		phx_cuda_config_init(&c->cfg);
	c->cfg.size = sizeof(c->cfg);
	ret = config_check(&c->cfg);
	if (ret) {
		free(c);
		return ret;
	}
	c->eng = eng;
	pthread_mutex_init(&c->ev_lock, NULL);
	pthread_mutex_init(&c->done_lock, NULL);
	pthread_cond_init(&c->done_cond, NULL);
	pthread_mutex_init(&c->st_lock, NULL);

	if (c->cfg.device < 0 || c->cfg.device >= cu_ndev) {
		ret = cerr(-ENODEV, "CUDA device %d does not exist (%d present)",
			   c->cfg.device, cu_ndev);
		goto fail_free;
	}
	r = cu.DeviceGet(&c->dev, c->cfg.device);
	if (r != CUDA_SUCCESS) {
		ret = cu_fail(r, "cuDeviceGet");
		goto fail_free;
	}
	r = cu.DevicePrimaryCtxRetain(&c->ctx, c->dev);
	if (r != CUDA_SUCCESS) {
		ret = cu_fail(r, "cuDevicePrimaryCtxRetain");
		goto fail_free;
	}
	ret = ctx_push(c);
	if (ret)
		goto fail_ctx;

	/* flags: one page, CU_MAX_BUFS slots + one for the probe */
	c->flags = mmap(NULL, 8192, PROT_READ | PROT_WRITE,
			MAP_PRIVATE | MAP_ANONYMOUS | MAP_POPULATE, -1, 0);
	if (c->flags == MAP_FAILED) {
		c->flags = NULL;
		ret = cerr(-ENOMEM, "cannot map the flag page");
		goto fail_pop;
	}
	r = cu.MemHostRegister(c->flags, 8192,
			       CU_MEMHOSTREGISTER_PORTABLE | CU_MEMHOSTREGISTER_DEVICEMAP);
	if (r != CUDA_SUCCESS) {
		ret = cu_fail(r, "cuMemHostRegister (flags)");
		goto fail_pop;
	}
	c->flags_registered = true;
	r = cu.MemHostGetDevicePointer(&c->flags_d, c->flags, 0);
	if (r != CUDA_SUCCESS) {
		ret = cu_fail(r, "cuMemHostGetDevicePointer (flags)");
		goto fail_pop;
	}
	for (i = 0; i < CU_NSTREAMS; i++) {
		r = cu.StreamCreate(&c->streams[i], CU_STREAM_NON_BLOCKING);
		if (r != CUDA_SUCCESS) {
			ret = cu_fail(r, "cuStreamCreate");
			goto fail_pop;
		}
	}
	c->memops = !(c->cfg.flags & PHX_CUDA_HOSTFN_GATE) && memops_work(c);
	if (!c->memops)
		c->cfg.flags |= PHX_CUDA_HOSTFN_GATE;

	c->nlanes = c->cfg.lanes;
	c->nbufs = c->cfg.lanes * c->cfg.bufs_per_lane;
	c->bufs = calloc(c->nbufs, sizeof(*c->bufs));
	c->lanes = calloc(c->nlanes, sizeof(*c->lanes));
	if (!c->bufs || !c->lanes) {
		ret = cerr(-ENOMEM, "out of memory");
		goto fail_pop;
	}
	for (i = 0; i < c->nlanes; i++) {
		ret = lane_setup(c, &c->lanes[i], i);
		if (ret)
			goto fail_pop;
	}
	c->st.staging_bytes = (uint64_t)c->nbufs * c->cfg.buf_size;
	ctx_pop();
	*out = c;
	return 0;

fail_pop:
	ctx_pop();
	{
		char keep[sizeof(cu_errbuf)];

		memcpy(keep, cu_errbuf, sizeof(keep));
		c->nlanes = c->lanes ? c->nlanes : 0;
		phx_cuda_destroy(c);
		memcpy(cu_errbuf, keep, sizeof(keep));
	}
	return ret;
fail_ctx:
	cu.DevicePrimaryCtxRelease(c->dev);
fail_free:
	free(c);
	return ret;
}

CU_EXPORT int phx_cuda_destroy(phx_cuda *c)
{
	uint32_t i;

	if (!c)
		return 0;
	/* wait for everything queued: lanes go idle */
	for (i = 0; c->lanes && i < c->nlanes; i++) {
		struct lane *ln = &c->lanes[i];

		if (!ln->started)
			continue;
		pthread_mutex_lock(&ln->lock);
		while (ln->active) {
			pthread_mutex_unlock(&ln->lock);
			nap_ns(100000);
			pthread_mutex_lock(&ln->lock);
		}
		pthread_mutex_unlock(&ln->lock);
	}
	if (ctx_push(c) == 0) {
		for (i = 0; i < CU_NSTREAMS; i++)
			if (c->streams[i]) {
				cu.StreamSynchronize(c->streams[i]);
				cu.StreamDestroy(c->streams[i]);
			}
		for (i = 0; c->lanes && i < c->nlanes; i++)
			lane_teardown(c, &c->lanes[i]);
		while (c->nev_free)
			cu.EventDestroy(c->ev_free[--c->nev_free]);
		if (c->flags_registered)
			cu.MemHostUnregister(c->flags);
		ctx_pop();
	}
	if (c->flags)
		munmap(c->flags, 8192);
	free(c->ev_free);
	free(c->lanes);
	free(c->bufs);
	cu.DevicePrimaryCtxRelease(c->dev);
	pthread_mutex_destroy(&c->ev_lock);
	pthread_mutex_destroy(&c->done_lock);
	pthread_cond_destroy(&c->done_cond);
	pthread_mutex_destroy(&c->st_lock);
	free(c);
	return 0;
}

CU_EXPORT void phx_cuda_config_get(const phx_cuda *c, struct phx_cuda_config *cfg)
{
	*cfg = c->cfg;
}

CU_EXPORT int phx_cuda_uses_memops(const phx_cuda *c)
{
	return c->memops;
}

/* ------------------------------------------------------------------------ */
/* Request completion                                                       */
/* ------------------------------------------------------------------------ */

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

static void req_fail(struct cureq *rq, int64_t err)
{
	pthread_mutex_lock(&rq->lock);
	if (!rq->err)
		rq->err = err;
	pthread_mutex_unlock(&rq->lock);
}

/* All host-side I/O is done: the result is final (before the last flag). */
static void req_result(struct cureq *rq)
{
	phx_cuda *c = rq->cuc;
	struct phx_cuda_io *io = rq->io;
	int64_t res;

	if (rq->err)
		res = rq->err;
	else if (rq->short_end < rq->off + rq->len)
		res = (int64_t)(rq->short_end - rq->off);
	else
		res = (int64_t)rq->len;
	io->result = res;
	io->paths = rq->paths;
	io->direct_bytes = rq->direct_bytes;
	io->bounce_bytes = rq->bounce_bytes;
	io->buffered_bytes = rq->buffered_bytes;
	if (rq->bytes_done)
		*rq->bytes_done = res;
	pthread_mutex_lock(&c->st_lock);
	if (res < 0) {
		c->st.errors++;
	} else if (rq->op == PHX_OP_READ) {
		c->st.reads++;
		c->st.bytes_read += (uint64_t)res;
	} else {
		c->st.writes++;
		c->st.bytes_written += (uint64_t)res;
	}
	c->st.direct_bytes += rq->direct_bytes;
	c->st.bounce_bytes += rq->bounce_bytes;
	c->st.buffered_bytes += rq->buffered_bytes;
	pthread_mutex_unlock(&c->st_lock);
}

static void req_put_ios(struct cureq *rq, int n)
{
	if (__atomic_sub_fetch(&rq->ios_left, n, __ATOMIC_ACQ_REL) == 0)
		req_result(rq);
}

/* Nothing touches the request any more: hand it back. */
static void req_put_uses(struct cureq *rq, int n)
{
	phx_cuda *c = rq->cuc;
	struct phx_cuda_io *io;
	uint32_t i;

	if (__atomic_sub_fetch(&rq->uses_left, n, __ATOMIC_ACQ_REL) != 0)
		return;
	for (i = 0; i < c->nlanes; i++)
		if (rq->lf[i])
			phx_file_close(rq->lf[i]);
	/* events are recycled only here: a later use may still wait on one */
	for (i = 0; i < rq->nuses; i++)
		ev_put(c, rq->uses[i].ev);
	ev_put(c, rq->start_ev);
	io = rq->io;
	pthread_mutex_destroy(&rq->lock);
	if (rq->owned) {
		free(io);
		free(rq);
		return;
	}
	free(rq);
	pthread_mutex_lock(&c->done_lock);
	__atomic_store_n(&io->done, 1, __ATOMIC_RELEASE);
	pthread_cond_broadcast(&c->done_cond);
	pthread_mutex_unlock(&c->done_lock);
}

/* ------------------------------------------------------------------------ */
/* Lanes                                                                    */
/* ------------------------------------------------------------------------ */

static void flag_raise(struct sbuf *b, uint32_t seq)
{
	__atomic_store_n(b->flag, seq, __ATOMIC_RELEASE);
	if (!b->lane->cuc->memops) {
		pthread_mutex_lock(&b->lane->lock);
		pthread_cond_broadcast(&b->lane->gate);
		pthread_mutex_unlock(&b->lane->lock);
	}
}

static void use_retire(struct lane *ln, struct sbuf *b, struct use *u)
{
	struct cureq *rq = u->rq;

	pthread_mutex_lock(&ln->lock);
	b->head = u->next;
	if (!b->head)
		b->last = NULL;
	ln->active--;
	pthread_mutex_unlock(&ln->lock);
	req_put_uses(rq, 1);
}

/* The file I/O of @u finished (or was skipped): account, raise the flag. */
static void use_io_done(struct lane *ln, struct sbuf *b, struct use *u)
{
	struct cureq *rq = u->rq;
	int64_t res = u->failed ? 0 : u->io.result;
	uint64_t got = 0, direct = 0, bounce = 0, buffered = 0;

	if (u->failed) {
		/* the request already carries its error */
	} else if (res < 0) {
		req_fail(rq, res);
	} else {
		if (rq->op == PHX_OP_READ) {
			uint64_t need = u->user_off + u->user_len - u->io_off;

			if ((uint64_t)res < need) {
				uint64_t skip = u->user_off - u->io_off;

				got = (uint64_t)res > skip ? (uint64_t)res - skip : 0;
				pthread_mutex_lock(&rq->lock);
				if (u->user_off + got < rq->short_end)
					rq->short_end = u->user_off + got;
				pthread_mutex_unlock(&rq->lock);
			} else {
				got = u->user_len;
			}
			/* reads go whole blocks into staging: all one path */
			if (u->io.paths & PHX_PATH_BUFFERED)
				buffered = got;
			else if (u->io.paths & PHX_PATH_BOUNCE)
				bounce = got;
			else
				direct = got;
		} else {
			got = (uint64_t)res;
			if (got < u->io_len)
				req_fail(rq, -EIO);	/* the engine continues short writes */
			if (u->io.paths & PHX_PATH_BUFFERED) {
				buffered = got;
			} else if (u->io.paths == PHX_PATH_DIRECT) {
				direct = got;
			} else if (u->io.paths == PHX_PATH_BOUNCE) {
				bounce = got;
			} else {
				/* split: bounced sub-block head and tail */
				uint64_t a = 4096, s = u->io_off, e = u->io_off + got;
				uint64_t m0 = up(s, a), m1 = down(e, a);

				bounce = m1 > m0 ? (m0 - s) + (e - m1) : got;
				direct = got - bounce;
			}
		}
		pthread_mutex_lock(&rq->lock);
		rq->paths |= u->io.paths;
		rq->direct_bytes += direct;
		rq->bounce_bytes += bounce;
		rq->buffered_bytes += buffered;
		pthread_mutex_unlock(&rq->lock);
	}
	pthread_mutex_lock(&ln->cuc->st_lock);
	ln->cuc->st.chunks++;
	if (rq->op == PHX_OP_READ)
		ln->cuc->st.h2d_bytes += u->user_len;
	else
		ln->cuc->st.d2h_bytes += u->user_len;
	pthread_mutex_unlock(&ln->cuc->st_lock);
	req_put_ios(rq, 1);
	flag_raise(b, u->seq);
}

/* Start the file I/O of @u; false when it must wait. */
static bool use_start(struct lane *ln, struct sbuf *b, struct use *u, int *waiting)
{
	struct cureq *rq = u->rq;
	struct phx_io *pio = &u->io;
	CUresult r;
	int ret;

	if (u->failed || __atomic_load_n(&rq->err, __ATOMIC_RELAXED)) {
		u->failed = true;
		use_io_done(ln, b, u);
		u->state = U_COPY;
		return true;
	}
	if (rq->op == PHX_OP_READ) {
		if (!__atomic_load_n(&rq->started, __ATOMIC_ACQUIRE)) {
			r = cu.EventQuery(rq->start_ev);
			if (r == CUDA_ERROR_NOT_READY) {
				(*waiting)++;
				return false;
			}
			if (r != CUDA_SUCCESS) {
				req_fail(rq, cu_fail(r, "cuEventQuery (start)"));
				u->failed = true;
				use_io_done(ln, b, u);
				u->state = U_COPY;
				return true;
			}
			__atomic_store_n(&rq->started, 1, __ATOMIC_RELEASE);
		}
	} else {
		r = cu.EventQuery(u->ev);
		if (r == CUDA_ERROR_NOT_READY) {
			(*waiting)++;
			return false;
		}
		if (r != CUDA_SUCCESS) {
			req_fail(rq, cu_fail(r, "cuEventQuery (copy to staging)"));
			u->failed = true;
			use_io_done(ln, b, u);
			use_retire(ln, b, u);
			return true;
		}
	}
	if (!rq->lf[ln->index]) {
		ret = phx_file_from_fd(ln->eng, rq->fd, &rq->lf[ln->index]);
		if (ret) {
			req_fail(rq, ret);
			rq->lf[ln->index] = NULL;
			u->failed = true;
			use_io_done(ln, b, u);
			if (rq->op == PHX_OP_READ)
				u->state = U_COPY;
			else
				use_retire(ln, b, u);
			return true;
		}
	}
	phx_io_prep(pio, rq->lf[ln->index], rq->op, b->mem + u->buf_off,
		    u->io_len, u->io_off);
	pio->flags = PHX_IO_NO_POLL;
	ret = phx_submit(ln->eng, &pio, 1);
	if (ret) {
		req_fail(rq, ret);
		u->failed = true;
		use_io_done(ln, b, u);
		if (rq->op == PHX_OP_READ)
			u->state = U_COPY;
		else
			use_retire(ln, b, u);
		return true;
	}
	u->state = U_IO;
	return true;
}

static void *lane_main(void *arg)
{
	struct lane *ln = arg;
	phx_cuda *c = ln->cuc;

	cu.CtxSetCurrent(c->ctx);
	for (;;) {
		int progressed = 0, waiting = 0;
		struct use *wait_io = NULL;
		uint32_t i;

		pthread_mutex_lock(&ln->lock);
		while (!ln->active && !ln->stop)
			pthread_cond_wait(&ln->cond, &ln->lock);
		if (!ln->active && ln->stop) {
			pthread_mutex_unlock(&ln->lock);
			break;
		}
		pthread_mutex_unlock(&ln->lock);

		for (i = 0; i < ln->nbufs; i++) {
			struct sbuf *b = &ln->bufs[i];
			struct use *u = __atomic_load_n(&b->head, __ATOMIC_ACQUIRE);
			CUresult r;

			if (!u)
				continue;
			switch (u->state) {
			case U_PENDING:
				if (use_start(ln, b, u, &waiting))
					progressed++;
				if (u->state == U_IO && !wait_io)
					wait_io = u;
				break;
			case U_IO:
				if (__atomic_load_n(&u->io.done, __ATOMIC_ACQUIRE)) {
					use_io_done(ln, b, u);
					progressed++;
					if (u->rq->op == PHX_OP_READ)
						u->state = U_COPY;
					else
						use_retire(ln, b, u);
				} else if (!wait_io) {
					wait_io = u;
				}
				break;
			case U_COPY:
				r = u->ev ? cu.EventQuery(u->ev) : CUDA_SUCCESS;
				if (r == CUDA_ERROR_NOT_READY) {
					waiting++;
					break;
				}
				if (r != CUDA_SUCCESS)
					req_fail(u->rq, cu_fail(r, "cuEventQuery (copy to GPU)"));
				use_retire(ln, b, u);
				progressed++;
				break;
			}
		}
		if (progressed)
			continue;
		if (wait_io)
			phx_wait(ln->eng, &wait_io->io, waiting ? 20000 : 200000);
		else if (waiting)
			nap_ns(5000);
	}
	return NULL;
}

/* ------------------------------------------------------------------------ */
/* Enqueueing                                                               */
/* ------------------------------------------------------------------------ */

struct gate {
	struct sbuf *b;
	uint32_t seq;
};

static void gate_fn(void *arg)
{
	struct gate *g = arg;
	struct lane *ln = g->b->lane;

	pthread_mutex_lock(&ln->lock);
	while ((int32_t)(__atomic_load_n(g->b->flag, __ATOMIC_ACQUIRE) - g->seq) < 0)
		pthread_cond_wait(&ln->gate, &ln->lock);
	pthread_mutex_unlock(&ln->lock);
	free(g);
}

/* Make @s wait until @b's flag reaches @seq. */
static CUresult gate_stream(phx_cuda *c, CUstream s, struct sbuf *b, uint32_t seq)
{
	struct gate *g;
	CUresult r;

	if (c->memops)
		return cu.StreamWaitValue32(s, b->flag_d, seq, CU_STREAM_WAIT_VALUE_GEQ);
	g = malloc(sizeof(*g));
	if (!g)
		return 2;
	g->b = b;
	g->seq = seq;
	r = cu.LaunchHostFunc(s, gate_fn, g);
	if (r != CUDA_SUCCESS)
		free(g);
	return r;
}

static int check_devptr(phx_cuda *c, uint64_t p, size_t len)
{
	unsigned int mtype = 0;
	int ord = -1;
	CUresult r;

	r = cu.PointerGetAttribute(&mtype, CU_POINTER_ATTRIBUTE_MEMORY_TYPE, p);
	if (r != CUDA_SUCCESS || (mtype != CU_MEMORYTYPE_DEVICE && mtype != CU_MEMORYTYPE_UNIFIED))
		return cerr(-EINVAL, "0x%llx is not CUDA device memory",
			    (unsigned long long)p);
	r = cu.PointerGetAttribute(&ord, CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, p);
	if (r == CUDA_SUCCESS && ord != c->cfg.device)
		return cerr(-EXDEV, "memory of device %d given to the context of device %d",
			    ord, c->cfg.device);
	if (len) {
		r = cu.PointerGetAttribute(&mtype, CU_POINTER_ATTRIBUTE_MEMORY_TYPE, p + len - 1);
		if (r != CUDA_SUCCESS)
			return cerr(-EFAULT, "0x%llx + %zu runs past its allocation",
				    (unsigned long long)p, len);
	}
	return 0;
}

/* Queue one request on @s. */
static int enqueue(phx_cuda *c, struct phx_cuda_io *io, bool owned,
		   int64_t *bytes_done, CUstream s, bool ordered, CUstream after,
		   int sidx)
{
	struct phx_file_info fi;
	struct cureq *rq;
	struct stat stb;
	uint64_t A, S = c->cfg.buf_size, off, len, a0, a1, end;
	uint32_t n, k, start, touched_max = 0;
	uint32_t *lastseq = NULL;
	CUresult r;
	int ret;

	if (!io || !io->file)
		return cerr(-EINVAL, "NULL request or file");
	if (io->op != PHX_OP_READ && io->op != PHX_OP_WRITE)
		return cerr(-EINVAL, "unknown op %u", io->op);
	ret = phx_file_get_info(io->file, &fi);
	if (ret)
		return cerr(ret, "%s", phx_strerror_last());
	off = io->offset;
	len = io->len;
	if (io->op == PHX_OP_READ) {
		if (fstat(fi.fd, &stb))
			return cerr(-errno, "fstat: %s", strerror(errno));
		if (S_ISREG(stb.st_mode)) {
			uint64_t size = (uint64_t)stb.st_size;

			len = off >= size ? 0 : (len < size - off ? len : size - off);
		}
	}
	A = fi.direct ? (fi.offset_align > 512 ? fi.offset_align : 512) : 1;
	if (A > S)
		return cerr(-EINVAL, "file alignment %llu exceeds the staging buffer",
			    (unsigned long long)A);
	if (len) {
		ret = check_devptr(c, io->devptr, len);
		if (ret)
			return ret;
	}
	end = off + len;
	a0 = down(off, A);
	a1 = up(end, A);
	n = len ? (uint32_t)((end - a0 + S - 1) / S) : 0;

	rq = calloc(1, sizeof(*rq) + (size_t)n * sizeof(struct use));
	if (!rq)
		return cerr(-ENOMEM, "out of memory");
	rq->cuc = c;
	rq->io = io;
	rq->owned = owned;
	rq->bytes_done = bytes_done;
	rq->fd = fi.fd;
	rq->direct = fi.direct;
	rq->op = io->op;
	rq->off = off;
	rq->len = len;
	rq->short_end = UINT64_MAX;
	rq->nuses = n;
	rq->ios_left = (int)n + 1;
	rq->uses_left = (int)n + 1;
	/* host-async calls need not wait for their (internal) stream */
	rq->started = !ordered;
	pthread_mutex_init(&rq->lock, NULL);
	io->done = 0;
	io->result = 0;

	ret = ctx_push(c);
	if (ret) {
		pthread_mutex_destroy(&rq->lock);
		free(rq);
		return ret;
	}
	if (n && after) {
		/* the internal streams used first wait for what @after holds now */
		CUevent aev = NULL;

		ret = ev_get(c, &aev);
		if (!ret) {
			uint32_t i, ns = n < CU_NSTREAMS ? n : CU_NSTREAMS;

			r = cu.EventRecord(aev, after);
			for (i = 0; r == CUDA_SUCCESS && i < ns; i++)
				r = cu.StreamWaitEvent(c->streams[(sidx + i) % CU_NSTREAMS], aev, 0);
			if (r != CUDA_SUCCESS)
				ret = cu_fail(r, "ordering after the caller's stream");
			ev_put(c, aev);
		}
		if (ret) {
			ctx_pop();
			pthread_mutex_destroy(&rq->lock);
			free(rq);
			return ret;
		}
	}
	if (n && io->op == PHX_OP_READ && ordered) {
		ret = ev_get(c, &rq->start_ev);
		if (!ret) {
			r = cu.EventRecord(rq->start_ev, s);
			if (r != CUDA_SUCCESS)
				ret = cu_fail(r, "cuEventRecord (start)");
		}
		if (ret) {
			ctx_pop();
			ev_put(c, rq->start_ev);
			pthread_mutex_destroy(&rq->lock);
			free(rq);
			return ret;
		}
	}
	if (n && io->op == PHX_OP_WRITE) {
		lastseq = calloc(c->nbufs, sizeof(*lastseq));
		if (!lastseq) {
			ctx_pop();
			pthread_mutex_destroy(&rq->lock);
			free(rq);
			return cerr(-ENOMEM, "out of memory");
		}
	}

	start = __atomic_fetch_add(&c->rr, n, __ATOMIC_RELAXED);
	for (k = 0; k < n; k++) {
		struct use *u = &rq->uses[k];
		struct sbuf *b = c->bufs[(start + k) % c->nbufs];
		struct lane *ln = b->lane;
		/*
		 * Host-async requests spread their copies over the internal
		 * streams, so one slow chunk does not hold back the copies (and
		 * so the staging buffers) of the chunks after it.
		 */
		CUstream sk = sidx < 0 ? s : c->streams[(sidx + k) % CU_NSTREAMS];
		uint64_t w = a0 + (uint64_t)k * S;
		uint64_t ustart = off > w ? off : w;
		uint64_t uend = end < w + S ? end : w + S;

		u->rq = rq;
		u->b = b;
		u->state = U_PENDING;
		u->user_off = ustart;
		u->user_len = uend - ustart;
		if (io->op == PHX_OP_READ) {
			u->io_off = w > a0 ? w : a0;
			u->io_len = (a1 < w + S ? a1 : w + S) - u->io_off;
			u->buf_off = 0;
		} else {
			u->io_off = ustart;
			u->io_len = u->user_len;
			u->buf_off = ustart - w;
		}
		ret = ev_get(c, &u->ev);

		pthread_mutex_lock(&b->enq_lock);
		u->seq = b->seq_enq + 1;
		if (!ret && io->op == PHX_OP_READ) {
			r = gate_stream(c, sk, b, u->seq);
			if (r == CUDA_SUCCESS)
				r = cu.MemcpyHtoDAsync(io->devptr + (ustart - off),
						       b->mem + (ustart - u->io_off),
						       u->user_len, sk);
			if (r == CUDA_SUCCESS)
				r = cu.EventRecord(u->ev, sk);
			if (r != CUDA_SUCCESS)
				ret = cu_fail(r, "queueing the copy to the GPU");
		} else if (!ret) {
			struct use *prev;
			struct cureq *prq = NULL;
			CUevent pev = NULL;
			uint32_t pseq = 0;

			/* the buffer's previous use must be over before it is filled */
			pthread_mutex_lock(&ln->lock);
			prev = b->last;
			if (prev) {
				prq = prev->rq;
				pseq = prev->seq;
				if (prq->op == PHX_OP_READ)
					pev = prev->ev;
				__atomic_add_fetch(&prq->uses_left, 1, __ATOMIC_ACQ_REL);
			}
			pthread_mutex_unlock(&ln->lock);
			r = CUDA_SUCCESS;
			if (pev)
				r = cu.StreamWaitEvent(sk, pev, 0);
			else if (prq)
				r = gate_stream(c, sk, b, pseq);
			if (prq)
				req_put_uses(prq, 1);
			if (r == CUDA_SUCCESS)
				r = cu.MemcpyDtoHAsync(b->mem + u->buf_off,
						       io->devptr + (ustart - off),
						       u->user_len, sk);
			if (r == CUDA_SUCCESS)
				r = cu.EventRecord(u->ev, sk);
			if (r != CUDA_SUCCESS)
				ret = cu_fail(r, "queueing the copy from the GPU");
			lastseq[b->index] = u->seq;
			if (b->index + 1 > touched_max)
				touched_max = b->index + 1;
		}
		if (ret) {
			/* the lane still raises this use's flag, so gates pass */
			u->failed = true;
			req_fail(rq, ret);
		}
		/* fully queued: now the lane may see it */
		pthread_mutex_lock(&ln->lock);
		b->seq_enq = u->seq;
		u->next = NULL;
		if (b->last)
			__atomic_store_n(&b->last->next, u, __ATOMIC_RELEASE);
		else
			__atomic_store_n(&b->head, u, __ATOMIC_RELEASE);
		b->last = u;
		ln->active++;
		pthread_cond_signal(&ln->cond);
		pthread_mutex_unlock(&ln->lock);
		pthread_mutex_unlock(&b->enq_lock);
		if (ret) {
			k++;
			break;
		}
	}
	/* writes: the stream passes only once every chunk is in the file */
	if (lastseq) {
		uint32_t i;

		for (i = 0; i < touched_max; i++) {
			if (!lastseq[i])
				continue;
			r = gate_stream(c, s, c->bufs[i], lastseq[i]);
			if (r != CUDA_SUCCESS && !rq->err)
				req_fail(rq, cu_fail(r, "queueing the write's end gate"));
		}
		free(lastseq);
	}
	ctx_pop();
	/* uses never queued, then the enqueuer's own reference */
	if (k < n) {
		req_put_ios(rq, (int)(n - k));
		req_put_uses(rq, (int)(n - k));
	}
	/* an error found while queueing becomes the request's result */
	req_put_ios(rq, 1);
	req_put_uses(rq, 1);
	return 0;
}

static int pick_stream(phx_cuda *c)
{
	return (int)(__atomic_fetch_add(&c->stream_rr, 1, __ATOMIC_RELAXED) % CU_NSTREAMS);
}

/* ------------------------------------------------------------------------ */
/* Public request calls                                                     */
/* ------------------------------------------------------------------------ */

CU_EXPORT int phx_cuda_submit_stream(phx_cuda *c, struct phx_cuda_io *io, void *stream)
{
	int ret;

	if (!c)
		return cerr(-EINVAL, "NULL context");
	ret = enqueue(c, io, false, NULL, (CUstream)stream, true, NULL, -1);
	if (!ret) {
		pthread_mutex_lock(&c->st_lock);
		c->st.stream_ops++;
		pthread_mutex_unlock(&c->st_lock);
	}
	return ret;
}

static int async_owned(phx_cuda *c, phx_file *f, enum phx_op op, uint64_t devptr,
		       size_t size, uint64_t off, int64_t *bytes_done, void *stream)
{
	struct phx_cuda_io *io;
	int ret;

	if (!c)
		return cerr(-EINVAL, "NULL context");
	io = malloc(sizeof(*io));
	if (!io)
		return cerr(-ENOMEM, "out of memory");
	phx_cuda_io_prep(io, f, op, devptr, size, off);
	ret = enqueue(c, io, true, bytes_done, (CUstream)stream, true, NULL, -1);
	if (ret) {
		free(io);
		return ret;
	}
	pthread_mutex_lock(&c->st_lock);
	c->st.stream_ops++;
	pthread_mutex_unlock(&c->st_lock);
	return 0;
}

CU_EXPORT int phx_cuda_read_async(phx_cuda *c, phx_file *f, uint64_t devptr,
				  size_t size, uint64_t file_offset,
				  int64_t *bytes_done, void *stream)
{
	return async_owned(c, f, PHX_OP_READ, devptr, size, file_offset, bytes_done,
			   stream);
}

CU_EXPORT int phx_cuda_write_async(phx_cuda *c, phx_file *f, uint64_t devptr,
				   size_t size, uint64_t file_offset,
				   int64_t *bytes_done, void *stream)
{
	return async_owned(c, f, PHX_OP_WRITE, devptr, size, file_offset, bytes_done,
			   stream);
}

CU_EXPORT int phx_cuda_submit(phx_cuda *c, struct phx_cuda_io *const *ios, size_t n)
{
	size_t i;
	int ret;

	if (!c || (!ios && n))
		return cerr(-EINVAL, "phx_cuda_submit: NULL argument");
	for (i = 0; i < n; i++) {
		int si = pick_stream(c);

		ret = enqueue(c, ios[i], false, NULL, c->streams[si], false, NULL, si);
		if (ret)
			return ret;	/* earlier ones stay queued */
	}
	return 0;
}

CU_EXPORT int phx_cuda_submit_after(phx_cuda *c, struct phx_cuda_io *const *ios,
				    size_t n, void *stream)
{
	size_t i;
	int ret;

	if (!c || (!ios && n))
		return cerr(-EINVAL, "phx_cuda_submit_after: NULL argument");
	for (i = 0; i < n; i++) {
		int si = pick_stream(c);

		ret = enqueue(c, ios[i], false, NULL, c->streams[si], true,
			      stream ? (CUstream)stream : (CUstream)1 /* legacy */, si);
		if (ret)
			return ret;
	}
	return 0;
}

CU_EXPORT int phx_cuda_ptr_device(uint64_t ptr)
{
	unsigned int mtype = 0;
	int ord = -1, ret;
	CUresult r;

	ret = cu_ready();
	if (ret)
		return ret;
	r = cu.PointerGetAttribute(&mtype, CU_POINTER_ATTRIBUTE_MEMORY_TYPE, ptr);
	if (r != CUDA_SUCCESS || (mtype != CU_MEMORYTYPE_DEVICE && mtype != CU_MEMORYTYPE_UNIFIED))
		return cerr(-EINVAL, "0x%llx is not CUDA device memory",
			    (unsigned long long)ptr);
	r = cu.PointerGetAttribute(&ord, CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, ptr);
	if (r != CUDA_SUCCESS)
		return cu_fail(r, "cuPointerGetAttribute (device ordinal)");
	return ord;
}

CU_EXPORT int phx_cuda_wait(phx_cuda *c, struct phx_cuda_io *io, int64_t timeout_ns)
{
	int64_t deadline = timeout_ns >= 0 ? phx_now_ns() + timeout_ns : -1;

	if (!c || !io)
		return cerr(-EINVAL, "phx_cuda_wait: NULL argument");
	pthread_mutex_lock(&c->done_lock);
	while (!__atomic_load_n(&io->done, __ATOMIC_ACQUIRE)) {
		if (deadline < 0) {
			pthread_cond_wait(&c->done_cond, &c->done_lock);
		} else {
			int64_t left = deadline - phx_now_ns();

			if (left <= 0) {
				pthread_mutex_unlock(&c->done_lock);
				return cerr(-ETIME, "request not complete within the timeout");
			}
			phx_cond_wait_ns(&c->done_cond, &c->done_lock, left);
		}
	}
	pthread_mutex_unlock(&c->done_lock);
	return 0;
}

CU_EXPORT int phx_cuda_submit_wait(phx_cuda *c, struct phx_cuda_io *ios, size_t n)
{
	size_t i, queued = 0;
	int ret = 0;

	if (!c || (!ios && n))
		return cerr(-EINVAL, "phx_cuda_submit_wait: NULL argument");
	for (i = 0; i < n; i++) {
		int si = pick_stream(c);

		ret = enqueue(c, &ios[i], false, NULL, c->streams[si], false, NULL, si);
		if (ret)
			break;
		queued++;
	}
	for (i = 0; i < queued; i++)
		phx_cuda_wait(c, &ios[i], -1);
	return ret;
}

static int64_t sync_io(phx_cuda *c, phx_file *f, enum phx_op op, uint64_t devptr,
		       size_t len, uint64_t off)
{
	struct phx_cuda_io io;
	int ret, si;

	if (!c)
		return cerr(-EINVAL, "NULL context");
	phx_cuda_io_prep(&io, f, op, devptr, len, off);
	si = pick_stream(c);
	ret = enqueue(c, &io, false, NULL, c->streams[si], false, NULL, si);
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
/* Counters                                                                 */
/* ------------------------------------------------------------------------ */

CU_EXPORT void phx_cuda_stats(phx_cuda *c, struct phx_cuda_stats *st)
{
	uint32_t i;

	pthread_mutex_lock(&c->st_lock);
	*st = c->st;
	pthread_mutex_unlock(&c->st_lock);
	st->fixed_buf_ios = 0;
	st->sqes = 0;
	for (i = 0; i < c->nlanes; i++) {
		struct phx_stats es;

		phx_engine_stats(c->lanes[i].eng, &es);
		st->fixed_buf_ios += es.fixed_buf_ios;
		st->sqes += es.sqes;
	}
}

CU_EXPORT void phx_cuda_stats_reset(phx_cuda *c)
{
	uint32_t i;
	uint64_t staging;

	pthread_mutex_lock(&c->st_lock);
	staging = c->st.staging_bytes;
	memset(&c->st, 0, sizeof(c->st));
	c->st.staging_bytes = staging;
	pthread_mutex_unlock(&c->st_lock);
	for (i = 0; i < c->nlanes; i++)
		phx_engine_stats_reset(c->lanes[i].eng);
}
