// SPDX-License-Identifier: Apache-2.0
/*
 * cuda_context.c - floor 4: GPU staging contexts: configuration, what they
 * pin and allocate, their threads, destroy.
 *
 * A context pins lanes * bufs_per_lane * buf_size bytes of staging once,
 * plus the stream slots' progress words (48 KiB) and copy descriptors
 * (1 MiB, with a 1 MiB copy in GPU memory), and starts its threads: one
 * lane per lane, the copier and the poller.  Nothing else is pinned later:
 * that sum is what phx_cuda_stats.pinned_bytes reports.
 */
#include <errno.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <unistd.h>

#include "cuda_internal.h"
#include "cuda_copy_ptx.h"

#define WORDS_BYTES (sizeof(struct cu_words))
#define DESCS_BYTES ((size_t)CU_SLOTS * CU_RING * sizeof(struct cu_copy_desc))

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
	 * Built-in defaults, used until `phx tune` has measured the machine
	 * (phx.gpu then passes its choice explicitly): one lane per CPU up to
	 * 16 (RAM-speed devices complete I/O inline in each lane's thread), 4
	 * buffers of 4 MiB each (256 MiB pinned at 16 lanes), which kept the
	 * H200 box's virtio disk at its O_DIRECT limit in docs/gpu.md's sweep.
	 */
	cfg->lanes = phx_env_u32("PHX_CUDA_LANES",
				 ncpu < 4 ? 4 : ncpu > 16 ? 16 : (uint32_t)ncpu);
	cfg->bufs_per_lane = phx_env_u32("PHX_CUDA_BUFS", 4);
	cfg->buf_size = phx_env_u32("PHX_CUDA_BUF_SIZE", 4u << 20);
	cfg->max_io_size = phx_env_u32("PHX_CUDA_MAX_IO", 4u << 20);
	if (phx_env_u32("PHX_CUDA_NO_BATCH_COPY", 0))
		cfg->flags |= PHX_CUDA_NO_BATCH_COPY;
	if (phx_env_u32("PHX_CUDA_NO_MEMOPS", 0))
		cfg->flags |= PHX_CUDA_NO_MEMOPS;
	if (phx_env_u32("PHX_CUDA_EARLY_READS", 0))
		cfg->flags |= PHX_CUDA_EARLY_READS;
}

static int config_check(const struct phx_cuda_config *c)
{
	uint64_t pinned = (uint64_t)c->lanes * c->bufs_per_lane * c->buf_size;

	if (c->lanes < 1 || c->lanes > CU_MAX_LANES)
		return cu_err(-EINVAL, "lanes %u is outside 1..%u", c->lanes, CU_MAX_LANES);
	if (c->bufs_per_lane < 1 || c->lanes * c->bufs_per_lane > CU_MAX_BUFS)
		return cu_err(-EINVAL, "bufs_per_lane %u: 1.. and lanes * bufs_per_lane <= %u",
			      c->bufs_per_lane, CU_MAX_BUFS);
	if (c->buf_size < 65536 || c->buf_size > (256u << 20) || c->buf_size % 65536)
		return cu_err(-EINVAL, "buf_size %u must be a multiple of 64 KiB in 64 KiB..256 MiB",
			      c->buf_size);
	if (c->max_io_size < 4096 || c->max_io_size % 4096)
		return cu_err(-EINVAL, "max_io_size %u must be a multiple of 4096",
			      c->max_io_size);
	if (pinned > PHX_CUDA_MAX_PINNED)
		return cu_err(-EINVAL, "lanes * bufs_per_lane * buf_size = %llu MiB exceeds the %u MiB bound",
			      (unsigned long long)(pinned >> 20), PHX_CUDA_MAX_PINNED >> 20);
	return 0;
}

CU_EXPORT void phx_cuda_config_get(const phx_cuda *c, struct phx_cuda_config *cfg)
{
	*cfg = c->cfg;
}

CU_EXPORT uint32_t phx_cuda_features(const phx_cuda *c)
{
	return (c->memops ? PHX_CUDA_FEAT_MEMOPS : 0) |
	       (__atomic_load_n(&c->batch_copy, __ATOMIC_RELAXED) ? PHX_CUDA_FEAT_BATCH_COPY : 0) |
	       (c->fixed_bufs ? PHX_CUDA_FEAT_FIXED_BUFS : 0) |
	       (__atomic_load_n(&c->early_reads, __ATOMIC_RELAXED) ? PHX_CUDA_FEAT_EARLY_READS : 0) |
	       (__atomic_load_n(&c->dead, __ATOMIC_RELAXED) ? PHX_CUDA_FEAT_DEAD : 0);
}

CU_EXPORT const char *phx_cuda_memops_why(const phx_cuda *c)
{
	return c->memops ? "" : c->memops_why;
}

/*
 * Turning early reads off also voids the early pieces of reads already
 * queued (the epoch moves on): they are judged at arrival as changed and
 * read again, so that a caller who turns them off because another writer
 * appeared (libphxfile's second device, its direct path) is never served
 * bytes read before.
 */
CU_EXPORT int phx_cuda_set_early_reads(phx_cuda *c, int on)
{
	if (on && !c->memops)
		return cu_err(-ENOTSUP, "early reads need stream-ordered I/O: %s", c->memops_why);
	pthread_mutex_lock(&c->lock);
	if (c->early_reads && !on)
		c->early_epoch++;
	__atomic_store_n(&c->early_reads, on != 0, __ATOMIC_RELAXED);
	pthread_mutex_unlock(&c->lock);
	return 0;
}

/* ------------------------------------------------------------------------ */
/* Pinned memory and the kernels                                            */
/* ------------------------------------------------------------------------ */

/*
 * Pin @p (@len bytes) for the GPU, device-mapped too (the copy kernels and
 * stream memory operations reach it): *@registered once pinned, so that
 * phx_cuda_destroy() unpins exactly what was pinned.
 */
static int host_map(phx_cuda *c, void *p, size_t len, CUdeviceptr *dptr, bool *registered,
		    const char *what)
{
	char call[96];
	CUresult r;

	r = c->d->MemHostRegister(p, len, CU_MEMHOSTREGISTER_PORTABLE | CU_MEMHOSTREGISTER_DEVICEMAP);
	if (r != CUDA_SUCCESS) {
		snprintf(call, sizeof(call), "cuMemHostRegister (%s)", what);
		return cu_fail(c->d, r, call);
	}
	*registered = true;
	r = c->d->MemHostGetDevicePointer(dptr, p, 0);
	if (r != CUDA_SUCCESS) {
		snprintf(call, sizeof(call), "cuMemHostGetDevicePointer (%s)", what);
		return cu_fail(c->d, r, call);
	}
	return 0;
}

static void *map_anon(size_t len)
{
	void *p = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_POPULATE,
		       -1, 0);

	return p == MAP_FAILED ? NULL : p;
}

/* Stream slots: the progress words, the descriptors (host and GPU), the free list. */
static int slots_setup(phx_cuda *c)
{
	uint32_t i;
	int ret;

	c->words = map_anon(WORDS_BYTES);
	if (!c->words)
		return cu_err(-ENOMEM, "cannot map the progress words");
	ret = host_map(c, c->words, WORDS_BYTES, &c->words_d, &c->words_registered,
		       "progress words");
	if (ret)
		return ret;
	c->descs = map_anon(DESCS_BYTES);
	if (!c->descs)
		return cu_err(-ENOMEM, "cannot map the copy descriptors");
	ret = host_map(c, c->descs, DESCS_BYTES, &c->descs_d, &c->descs_registered,
		       "copy descriptors");
	if (ret)
		return ret;
	if (c->d->MemAlloc(&c->descs_gpu, DESCS_BYTES) != CUDA_SUCCESS) {
		c->descs_gpu = 0;
		return cu_err(-ENOMEM, "cannot allocate %zu bytes of GPU memory for the copy descriptors",
			      DESCS_BYTES);
	}
	c->slot_free = calloc(CU_SLOTS, sizeof(*c->slot_free));
	c->slot_seq = calloc(CU_SLOTS, sizeof(*c->slot_seq));
	if (!c->slot_free || !c->slot_seq)
		return cu_err(-ENOMEM, "out of memory");
	for (i = 0; i < CU_SLOTS; i++)
		c->slot_free[i] = CU_SLOTS - 1 - i;
	c->nslot_free = CU_SLOTS;
	return 0;
}

/* Can a stream wait for a host-written word and write one back here? */
static bool memops_work(phx_cuda *c)
{
	CUdeviceptr probe = c->words_d + offsetof(struct cu_words, probe);
	CUstream s = NULL;
	CUresult r;
	bool ok;

	if (c->d->StreamCreate(&s, CU_STREAM_NON_BLOCKING) != CUDA_SUCCESS)
		return false;
	c->words->probe[0] = 1;
	c->words->probe[1] = 0;
	r = c->d->StreamWaitValue32(s, probe, 1, CU_STREAM_WAIT_VALUE_GEQ);
	if (r == CUDA_SUCCESS)
		r = c->d->StreamWriteValue32(s, probe + 4, 7, CU_STREAM_WRITE_VALUE_DEFAULT);
	ok = r == CUDA_SUCCESS && c->d->StreamSynchronize(s) == CUDA_SUCCESS &&
	     __atomic_load_n(&c->words->probe[1], __ATOMIC_ACQUIRE) == 7;
	c->d->StreamDestroy(s);
	if (!ok)
		snprintf(c->memops_why, sizeof(c->memops_why),
			 "the device refuses stream memory operations (cuStreamWaitValue32/WriteValue32: CUDA error %d)",
			 r);
	return ok;
}

/*
 * The copy kernels (cuda_copy.cu as PTX; the driver compiles it for this
 * device).  Without them stream ops are refused, and memops_why says why.
 */
static bool kernel_load(phx_cuda *c)
{
	const char *s = NULL;
	CUresult r;

	r = c->d->ModuleLoadData(&c->module, cuda_copy_ptx);
	if (r != CUDA_SUCCESS) {
		c->module = NULL;
		c->d->GetErrorString(r, &s);
		snprintf(c->memops_why, sizeof(c->memops_why),
			 "the driver (CUDA %d.%d) cannot load the copy kernels' PTX (ISA 7.0): CUDA error %d (%s)",
			 c->d->version / 1000, c->d->version % 1000 / 10, r, s ? s : "?");
		return false;
	}
	if (c->d->ModuleGetFunction(&c->desc_fn, c->module, "phx_desc") != CUDA_SUCCESS ||
	    c->d->ModuleGetFunction(&c->copy_fn, c->module, "phx_copy") != CUDA_SUCCESS) {
		c->d->ModuleUnload(c->module);
		c->module = NULL;
		snprintf(c->memops_why, sizeof(c->memops_why), "the copy kernels are missing from their module");
		return false;
	}
	/*
	 * With the descriptor in GPU memory the block count hardly matters for
	 * speed (H200: 8 to 132 blocks of 1024 threads all move 1 MiB at 39
	 * GB/s, 4 MiB at 47.6): 16 keeps most multiprocessors for the
	 * caller's kernels.
	 */
	c->copy_blocks = 16;
	c->copy_threads = 1024;
	return true;
}

/*
 * Does cuMemcpyBatchAsync do what cuda_internal.h declares it to?  Two small
 * copies into device memory through it, read back with plain copies: a
 * driver that answers with another signature, or refuses, leaves the
 * context on one copy call per piece.
 */
static bool batch_copy_works(phx_cuda *c)
{
	const struct cu_driver *d = c->d;
	struct cu_memcpy_attr attr;
	CUdeviceptr dev = 0, dsts[2], srcs[2];
	size_t sizes[2] = { 8, 8 }, idx = 0, fail = SIZE_MAX;
	unsigned char *h = (unsigned char *)&c->words->probe[8];
	CUstream s = NULL;
	bool ok = false;
	int i;

	if (!d->MemcpyBatchAsync || d->MemAlloc(&dev, 16) != CUDA_SUCCESS)
		return false;
	if (d->StreamCreate(&s, CU_STREAM_NON_BLOCKING) != CUDA_SUCCESS)
		goto out;
	for (i = 0; i < 32; i++)
		h[i] = (unsigned char)(0x5a ^ (i * 37));
	dsts[0] = dev + 8;
	dsts[1] = dev;
	srcs[0] = (CUdeviceptr)(uintptr_t)h;
	srcs[1] = (CUdeviceptr)(uintptr_t)(h + 8);
	memset(&attr, 0, sizeof(attr));
	attr.src_access_order = CU_MEMCPY_SRC_ACCESS_ORDER_STREAM;
	if (d->MemcpyBatchAsync(dsts, srcs, sizes, 2, &attr, &idx, 1, &fail, s) != CUDA_SUCCESS)
		goto out;
	if (d->MemcpyDtoHAsync(h + 16, dev, 16, s) != CUDA_SUCCESS ||
	    d->StreamSynchronize(s) != CUDA_SUCCESS)
		goto out;
	ok = !memcmp(h + 16, h + 8, 8) && !memcmp(h + 24, h, 8);
out:
	if (s)
		d->StreamDestroy(s);
	d->MemFree(dev);
	return ok;
}

/*
 * Every lane's staging as one region, 2 MiB aligned and backed by
 * transparent huge pages where the kernel gives them.  Pinning is most of a
 * context's start-up: one cuMemHostRegister of the whole region costs
 * about what one lane's did (measured on an H200: 12-40 ms each, whatever
 * their size, and serialised), and huge pages make the page walks short.
 * Faulted in by the lanes' set-up threads, in parallel.
 */
static int staging_map(phx_cuda *c)
{
	const size_t huge = 2UL << 20;
	size_t len = (size_t)c->nlanes * c->cfg.bufs_per_lane * c->cfg.buf_size, head;
	char *p;

	p = mmap(NULL, len + huge, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
	if (p == MAP_FAILED)
		return cu_err(-ENOMEM, "mmap of %zu staging bytes failed", len);
	head = (huge - ((uintptr_t)p & (huge - 1))) & (huge - 1);
	if (head)
		munmap(p, head);
	munmap(p + head + len, huge - head);
	c->stage = p + head;
	c->stage_len = len;
	madvise(c->stage, len, MADV_HUGEPAGE);	/* a hint: 4 KiB pages work too */
	return 0;
}

/* ------------------------------------------------------------------------ */
/* Threads                                                                  */
/* ------------------------------------------------------------------------ */

struct lane_init {
	phx_cuda *c;
	uint32_t index;
	int ret;
	char err[512];
};

static void *lane_init_main(void *arg)
{
	struct lane_init *li = arg;

	li->ret = lane_setup(li->c, &li->c->lanes[li->index], li->index);
	if (li->ret)
		cu_err_save(li->err, sizeof(li->err));
	return NULL;
}

/*
 * Set the lanes up on threads of their own, all at once (faulting their
 * staging in, their engines), then register the staging with CUDA once.
 * A lane whose set-up thread cannot start is set up here.  The first
 * failure by lane order is the one reported; phx_cuda_destroy() frees
 * whatever each lane got.
 */
static int lanes_setup(phx_cuda *c, int64_t *t_reg)
{
	struct lane_init *li;
	pthread_t *thr;
	bool *started;
	uint32_t i;
	int ret = 0;

	li = calloc(c->nlanes, sizeof(*li));
	thr = calloc(c->nlanes, sizeof(*thr));
	started = calloc(c->nlanes, sizeof(*started));
	if (!li || !thr || !started) {
		ret = cu_err(-ENOMEM, "out of memory");
		goto out;
	}
	for (i = 0; i < c->nlanes; i++) {
		li[i].c = c;
		li[i].index = i;
		started[i] = !pthread_create(&thr[i], NULL, lane_init_main, &li[i]);
	}
	for (i = 0; i < c->nlanes; i++) {
		if (started[i]) {
			pthread_join(thr[i], NULL);
			continue;
		}
		li[i].ret = lane_setup(c, &c->lanes[i], i);
		if (li[i].ret)
			cu_err_save(li[i].err, sizeof(li[i].err));
	}
	for (i = 0; i < c->nlanes && !ret; i++) {
		if (li[i].ret) {
			ret = li[i].ret;
			cu_err_restore(li[i].err);
		}
	}
	*t_reg = phx_now_ns();
	if (!ret)	/* after the lanes' threads have faulted it in */
		ret = host_map(c, c->stage, c->stage_len, &c->stage_d, &c->stage_registered,
			       "staging buffers");
out:
	free(li);
	free(thr);
	free(started);
	return ret;
}

/* The copier's streams and one event per staging buffer (its copies' outcome). */
static int copier_setup(phx_cuda *c)
{
	uint32_t i, k;
	CUresult r;

	for (i = 0; i < CU_COPY_STREAMS; i++) {
		r = c->d->StreamCreate(&c->copy_streams[i], CU_STREAM_NON_BLOCKING);
		if (r != CUDA_SUCCESS) {
			c->copy_streams[i] = NULL;
			return cu_fail(c->d, r, "cuStreamCreate (copier)");
		}
	}
	for (i = 0; i < c->nlanes; i++) {
		for (k = 0; k < c->lanes[i].nbufs; k++) {
			r = c->d->EventCreate(&c->lanes[i].bufs[k].ev, CU_EVENT_DISABLE_TIMING);
			if (r != CUDA_SUCCESS) {
				c->lanes[i].bufs[k].ev = NULL;
				return cu_fail(c->d, r, "cuEventCreate (staging buffer)");
			}
		}
	}
	return 0;
}

static int threads_start(phx_cuda *c)
{
	uint32_t i;
	int ret = 0;

	c->poller_efd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
	c->copier_efd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
	if (c->poller_efd < 0 || c->copier_efd < 0)
		return cu_err(-errno, "eventfd: %s", strerror(errno));
	for (i = 0; i < c->nlanes && !ret; i++)
		ret = lane_start(c, &c->lanes[i]);
	if (!ret)
		ret = copier_start(c);
	if (!ret)
		ret = poller_start(c);
	return ret;
}

/* PHX_CUDA_TRACE=1: where a context's start-up went, in us. */
static void setup_trace(const phx_cuda *c, const int64_t *t)
{
	uint32_t i, k;

	if (c->stage_node >= 0)
		fprintf(stderr, "phx-trace staging on NUMA node %d\n", c->stage_node);
	else
		fprintf(stderr, "phx-trace staging not NUMA-bound: %s\n",
			c->stage_node_err == -EDOM ? "one node" :
			c->stage_node_err == -ENOENT ? "the device's node is unknown" :
			c->stage_node_err == -ENOSYS ? "no cuDeviceGetPCIBusId" :
			strerror(-c->stage_node_err));
	fprintf(stderr, "phx-trace create us: slots %lld probes+kernels %lld batch-copy+map %lld "
		"lanes %lld staging-register+threads %lld\n", (long long)(t[1] - t[0]) / 1000,
		(long long)(t[2] - t[1]) / 1000, (long long)(t[3] - t[2]) / 1000,
		(long long)(t[4] - t[3]) / 1000, (long long)(t[5] - t[4]) / 1000);
	for (i = 0; i < c->nlanes; i++) {
		const int64_t *l = c->lanes[i].setup_ns;

		fprintf(stderr, "phx-trace lane %u us: start %lld", i, (long long)(l[0] - t[3]) / 1000);
		for (k = 1; k < LANE_SETUP_STEPS; k++)
			fprintf(stderr, " %lld", l[k] ? (long long)(l[k] - l[k - 1]) / 1000 : -1LL);
		fprintf(stderr, " (populate engine uring-register)\n");
	}
	if (!c->memops)
		fprintf(stderr, "phx-trace stream ops unavailable: %s\n", c->memops_why);
}

static int ctx_setup(phx_cuda *c)
{
	int64_t t[6] = { 0 };
	int ret;

	t[0] = phx_now_ns();
	ret = slots_setup(c);
	if (ret)
		return ret;
	t[1] = phx_now_ns();
	if (c->cfg.flags & PHX_CUDA_NO_MEMOPS)
		snprintf(c->memops_why, sizeof(c->memops_why), "turned off (PHX_CUDA_NO_MEMOPS)");
	else
		c->memops = memops_work(c) && kernel_load(c);
	c->early_reads = c->memops && (c->cfg.flags & PHX_CUDA_EARLY_READS);
	t[2] = phx_now_ns();
	c->batch_copy = !(c->cfg.flags & PHX_CUDA_NO_BATCH_COPY) && batch_copy_works(c);
	c->fixed_bufs = !(c->cfg.flags & PHX_CUDA_NO_FIXED_BUFS);
	c->nlanes = c->cfg.lanes;
	c->nbufs = c->cfg.lanes * c->cfg.bufs_per_lane;
	/*
	 * Classes (cuda_internal.h): an eighth of the staging (one buffer at
	 * least) only arrived stream ops may take; early reads hold three
	 * quarters at most, so host-async work always finds an eighth (none in
	 * a context of one buffer).  On the H200 half was too little for 8
	 * streams of 1 MiB reads: only a quarter of them found a buffer early.
	 */
	c->reserve = c->nbufs / 8 ? c->nbufs / 8 : 1;
	c->early_max = c->nbufs * 3 / 4;
	c->lanes = calloc(c->nlanes, sizeof(*c->lanes));
	if (!c->lanes)
		return cu_err(-ENOMEM, "out of memory");
	ret = staging_map(c);
	if (ret)
		return ret;
	c->stage_node_err = cu_staging_bind(c);	/* best effort: cuda_numa.c */
	t[3] = phx_now_ns();
	ret = lanes_setup(c, &t[4]);
	if (!ret)
		ret = copier_setup(c);
	if (!ret)
		ret = threads_start(c);
	if (ret)
		return ret;
	t[5] = phx_now_ns();
	if (c->trace)
		setup_trace(c, t);
	c->st.staging_bytes = (uint64_t)c->nbufs * c->cfg.buf_size;
	c->st.pinned_bytes = c->st.staging_bytes + WORDS_BYTES + DESCS_BYTES;
	return 0;
}

static void ctx_locks_init(phx_cuda *c)
{
	pthread_mutex_init(&c->lock, NULL);
	pthread_mutex_init(&c->done_lock, NULL);
	pthread_cond_init(&c->done_cond, NULL);
	pthread_cond_init(&c->slot_cond, NULL);
}

static void ctx_locks_destroy(phx_cuda *c)
{
	pthread_mutex_destroy(&c->lock);
	pthread_mutex_destroy(&c->done_lock);
	pthread_cond_destroy(&c->done_cond);
	pthread_cond_destroy(&c->slot_cond);
}

CU_EXPORT int phx_cuda_create(phx_engine *eng, const struct phx_cuda_config *cfg,
			      phx_cuda **out)
{
	const struct cu_driver *d;
	phx_cuda *c;
	CUresult r;
	int ret;

	if (!out)
		return cu_err(-EINVAL, "phx_cuda_create: NULL argument");
	*out = NULL;
	d = cu_driver();
	if (!d)
		return -ENODEV;
	c = calloc(1, sizeof(*c));
	if (!c)
		return cu_err(-ENOMEM, "out of memory");
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
	c->d = d;
	c->stage_node = -1;
	c->poller_efd = c->copier_efd = c->done_efd = -1;
	c->trace = phx_env_u32("PHX_CUDA_TRACE", 0) != 0;
	c->queue_wait_ms = phx_env_u32("PHX_CUDA_QUEUE_WAIT_MS", 30000);
	c->eng = eng;
	ctx_locks_init(c);
	if (c->cfg.device < 0 || c->cfg.device >= d->ndev) {
		ret = cu_err(-ENODEV, "CUDA device %d does not exist (%d present)",
			     c->cfg.device, d->ndev);
		goto fail_free;
	}
	r = d->DeviceGet(&c->dev, c->cfg.device);
	if (r != CUDA_SUCCESS) {
		ret = cu_fail(d, r, "cuDeviceGet");
		goto fail_free;
	}
	r = d->DevicePrimaryCtxRetain(&c->ctx, c->dev);
	if (r != CUDA_SUCCESS) {
		ret = cu_fail(d, r, "cuDevicePrimaryCtxRetain");
		goto fail_free;
	}
	ret = ctx_push(c);
	if (ret) {
		d->DevicePrimaryCtxRelease(c->dev);
		goto fail_free;
	}
	ret = ctx_setup(c);
	ctx_pop(c);
	if (ret) {
		char keep[512];

		cu_err_save(keep, sizeof(keep));
		phx_cuda_destroy(c);
		cu_err_restore(keep);
		return ret;
	}
	cu_stats_publish(c);
	*out = c;
	return 0;

fail_free:
	ctx_locks_destroy(c);
	free(c);
	return ret;
}

/* ------------------------------------------------------------------------ */
/* Destroy                                                                  */
/* ------------------------------------------------------------------------ */

/*
 * Wait until every request has finished, including stream operations whose
 * streams have not reached them yet: their waits, kernels and words refer
 * to this context's memory, so it can only go once the stream has passed
 * the last of them.  A dead context (the copier's health check) has the
 * poller end them instead.
 */
static void wait_idle(phx_cuda *c)
{
	pthread_mutex_lock(&c->done_lock);
	while (c->live)
		pthread_cond_wait(&c->done_cond, &c->done_lock);
	pthread_mutex_unlock(&c->done_lock);
}

static void files_drop(phx_cuda *c)
{
	struct cu_file *cf;
	uint32_t i;

	while ((cf = c->files)) {
		c->files = cf->next;
		for (i = 0; i < c->nlanes; i++)
			if (cf->lf[i])
				phx_file_close(cf->lf[i]);
		phx_file_unhold(cf->f);
		free(cf);
	}
}

/* What the GPU side holds: unpinned and freed, unless an orphan's stream may still read it. */
static void gpu_memory_free(phx_cuda *c)
{
	const struct cu_driver *d = c->d;
	uint32_t i, k;

	for (i = 0; i < CU_COPY_STREAMS; i++)
		if (c->copy_streams[i]) {
			d->StreamSynchronize(c->copy_streams[i]);
			d->StreamDestroy(c->copy_streams[i]);
		}
	for (i = 0; c->lanes && i < c->nlanes; i++)
		for (k = 0; c->lanes[i].bufs && k < c->lanes[i].nbufs; k++)
			if (c->lanes[i].bufs[k].ev)
				d->EventDestroy(c->lanes[i].bufs[k].ev);
	if (c->stage_registered)
		d->MemHostUnregister(c->stage);
	while (c->nev_free)
		d->EventDestroy(c->ev_free[--c->nev_free]);
	if (c->orphans) {
		/* documented in phx_cuda.h: kept, never reused */
		c->words = NULL;
		c->descs = NULL;
		return;
	}
	if (c->words_registered)
		d->MemHostUnregister(c->words);
	if (c->descs_registered)
		d->MemHostUnregister(c->descs);
	if (c->descs_gpu)
		d->MemFree(c->descs_gpu);
	if (c->module)
		d->ModuleUnload(c->module);
}

CU_EXPORT int phx_cuda_destroy(phx_cuda *c)
{
	struct cu_req *rq;
	uint32_t i;

	if (!c)
		return 0;
	phx_stats_source_remove(c->pub);	/* its fill reads the lanes */
	wait_idle(c);
	poller_stop(c);
	copier_stop(c);
	for (i = 0; c->lanes && i < c->nlanes; i++)
		lane_stop(c, &c->lanes[i]);
	files_drop(c);	/* registered ones: their lane files first */
	if (ctx_push(c) == 0) {
		gpu_memory_free(c);	/* the buffers' events: before the lanes' buffers go */
		ctx_pop(c);
	}
	for (i = 0; c->lanes && i < c->nlanes; i++)
		lane_free(c, &c->lanes[i]);
	if (c->stage)
		munmap(c->stage, c->stage_len);
	if (c->words)
		munmap(c->words, WORDS_BYTES);
	if (c->descs)
		munmap(c->descs, DESCS_BYTES);
	while ((rq = c->free_reqs)) {
		c->free_reqs = rq->next;
		free(rq);
	}
	if (c->poller_efd >= 0)
		close(c->poller_efd);
	if (c->done_efd >= 0)
		close(c->done_efd);
	if (c->copier_efd >= 0)
		close(c->copier_efd);
	free(c->ev_free);
	free(c->slot_free);
	free(c->slot_seq);
	free(c->lanes);
	c->d->DevicePrimaryCtxRelease(c->dev);
	ctx_locks_destroy(c);
	free(c);
	return 0;
}
