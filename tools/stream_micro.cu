// SPDX-License-Identifier: Apache-2.0
/*
 * stream_micro.cu - what the pieces of a stream-ordered GPU read cost on
 * this machine, measured in isolation (diagnosis for the stream path's
 * design, docs/gpu.md "Stream path v3"):
 *
 *   zc      a copy kernel reading (or writing) pinned host memory, by grid
 *   ce      the copy engine for the same bytes
 *   pp-*    GPU <-> host round trips: stream memory ops against a spinning
 *           host thread, host functions, blocking-sync events
 *   pipe-*  the GPU program of one stream op per chunk (arrival marker, flag
 *           wait, copy kernel, done marker) against a host thread that
 *           raises the flag as soon as it sees the arrival, by chunk size;
 *           the same with host functions for arrival and done
 *
 * nvcc -O3 -arch=sm_90 -o stream_micro tools/stream_micro.cu -lcuda
 * ./stream_micro > micro.json      (one JSON object per line)
 */
#include <cuda.h>
#include <cuda_runtime.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#define CK(x)                                                                   \
	do {                                                                    \
		CUresult r_ = (x);                                              \
		if (r_ != CUDA_SUCCESS) {                                       \
			const char *s_ = "?";                                   \
			cuGetErrorString(r_, &s_);                              \
			fprintf(stderr, "%s:%d %s: %d %s\n", __FILE__, __LINE__, #x, r_, s_); \
			exit(1);                                                \
		}                                                               \
	} while (0)

struct desc {
	unsigned long long src, dst, len, pad;
};

static double now(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return ts.tv_sec + ts.tv_nsec * 1e-9;
}

template <int U>
__device__ void copy16(const uint4 *__restrict__ s, uint4 *__restrict__ d, unsigned long long n,
		       unsigned long long tid, unsigned long long nth)
{
	unsigned long long i = tid;

	for (; i + (U - 1) * nth < n; i += U * nth) {
		uint4 v[U];
#pragma unroll
		for (int k = 0; k < U; k++)
			v[k] = s[i + k * nth];
#pragma unroll
		for (int k = 0; k < U; k++)
			d[i + k * nth] = v[k];
	}
	for (; i < n; i += nth)
		d[i] = s[i];
}

/* descriptor in host memory, read once per block (as libphx's phx_copy) */
template <int U>
__global__ void kcopy(const desc *dd)
{
	__shared__ unsigned long long sd[3];

	if (threadIdx.x == 0) {
		const volatile desc *v = dd;
		sd[0] = v->src;
		sd[1] = v->dst;
		sd[2] = v->len;
	}
	__syncthreads();
	if (!sd[2])
		return;
	copy16<U>((const uint4 *)sd[0], (uint4 *)sd[1], sd[2] / 16,
		  blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x,
		  (unsigned long long)gridDim.x * blockDim.x);
}

/* blocked layout: each block copies one contiguous slice (fewer pages per block) */
template <int U>
__global__ void kcopy_blk(const desc *dd)
{
	__shared__ unsigned long long sd[3];

	if (threadIdx.x == 0) {
		const volatile desc *v = dd;
		sd[0] = v->src;
		sd[1] = v->dst;
		sd[2] = v->len;
	}
	__syncthreads();
	unsigned long long n = sd[2] / 16, per = (n + gridDim.x - 1) / gridDim.x;
	unsigned long long b0 = blockIdx.x * per, b1 = b0 + per < n ? b0 + per : n;

	if (b0 >= b1)
		return;
	copy16<U>((const uint4 *)sd[0] + b0, (uint4 *)sd[1] + b0, b1 - b0, threadIdx.x,
		  blockDim.x);
}

/* descriptor in device memory (written there by kdesc) */
template <int U>
__global__ void kcopy_dev(const desc *dd)
{
	unsigned long long len = dd->len;

	if (!len)
		return;
	copy16<U>((const uint4 *)dd->src, (uint4 *)dd->dst, len / 16,
		  blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x,
		  (unsigned long long)gridDim.x * blockDim.x);
}

/* one warp: the host descriptor into device memory, read once */
__global__ void kdesc(const desc *h, desc *d)
{
	if (threadIdx.x < 4)
		((unsigned long long *)d)[threadIdx.x] =
			((const volatile unsigned long long *)h)[threadIdx.x];
}

/* R copies of the descriptor 128 bytes apart: block b reads copy b % R */
template <int U, int R>
__global__ void kcopy_rep(const desc *dd)
{
	__shared__ unsigned long long sd[3];

	if (threadIdx.x == 0) {
		const volatile desc *v = (const volatile desc *)((const char *)dd + 128 * (blockIdx.x % R));
		sd[0] = v->src;
		sd[1] = v->dst;
		sd[2] = v->len;
	}
	__syncthreads();
	if (!sd[2])
		return;
	copy16<U>((const uint4 *)sd[0], (uint4 *)sd[1], sd[2] / 16,
		  blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x,
		  (unsigned long long)gridDim.x * blockDim.x);
}

static char *host_region(size_t len, CUdeviceptr *dp)
{
	size_t huge = 2u << 20;
	char *p = (char *)mmap(NULL, len + huge, PROT_READ | PROT_WRITE,
			       MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
	char *a = (char *)(((uintptr_t)p + huge - 1) & ~(uintptr_t)(huge - 1));

	madvise(a, len, MADV_HUGEPAGE);
	for (size_t i = 0; i < len; i++)
		a[i] = (char)(i * 131 + 7);
	CK(cuMemHostRegister(a, len, CU_MEMHOSTREGISTER_PORTABLE | CU_MEMHOSTREGISTER_DEVICEMAP));
	CK(cuMemHostGetDevicePointer(dp, a, 0));
	return a;
}

typedef void (*kfn)(const desc *);

static double run_kernel(kfn f, int blocks, int threads, desc *hd, CUdeviceptr hd_d,
			 CUstream s, int reps)
{
	cudaEvent_t e0, e1;
	float ms;

	cudaEventCreate(&e0);
	cudaEventCreate(&e1);
	f<<<blocks, threads, 0, (cudaStream_t)s>>>((const desc *)hd_d);
	cudaStreamSynchronize((cudaStream_t)s);
	cudaEventRecord(e0, (cudaStream_t)s);
	for (int i = 0; i < reps; i++)
		f<<<blocks, threads, 0, (cudaStream_t)s>>>((const desc *)hd_d);
	cudaEventRecord(e1, (cudaStream_t)s);
	cudaEventSynchronize(e1);
	cudaEventElapsedTime(&ms, e0, e1);
	cudaEventDestroy(e0);
	cudaEventDestroy(e1);
	return hd->len * (double)reps / (ms * 1e-3) / 1e9;
}

/* ---- ping-pong ---- */

struct pp {
	volatile uint32_t *flag, *ack;
	int n;
	double t;
};

static void *pp_host(void *arg)
{
	struct pp *p = (struct pp *)arg;

	for (int i = 1; i <= p->n; i++) {
		while (*p->ack != (uint32_t)(i - 1))
			;
		*p->flag = i;
	}
	while (*p->ack != (uint32_t)p->n)
		;
	return NULL;
}

static volatile uint32_t hf_count;
static void hf_inc(void *a)
{
	(void)a;
	__atomic_add_fetch(&hf_count, 1, __ATOMIC_RELAXED);
}

/* ---- pipeline: per op: arrive marker, wait, kernel, done marker ---- */

struct pipe {
	volatile uint32_t *arrive, *flag, *done;
	int n;
	int hostfn;		/* arrival/done by host functions + eventfd wake */
	int efd;
	volatile int stop;
};

static void hf_arrive(void *a)
{
	struct pipe *p = (struct pipe *)a;

	__atomic_add_fetch(p->arrive, 1, __ATOMIC_RELEASE);
	eventfd_write(p->efd, 1);
}

static void *pipe_host(void *arg)
{
	struct pipe *p = (struct pipe *)arg;
	uint32_t seen = 0;
	eventfd_t v;

	while (seen < (uint32_t)p->n) {
		uint32_t a = __atomic_load_n(p->arrive, __ATOMIC_ACQUIRE);

		if (a == seen) {
			if (p->hostfn)
				eventfd_read(p->efd, &v);
			continue;
		}
		seen = a;
		__atomic_store_n(p->flag, seen, __ATOMIC_RELEASE);
	}
	return NULL;
}

static double gbps_since(cudaEvent_t e0, cudaEvent_t e1, double bytes)
{
	float ms;

	cudaEventSynchronize(e1);
	cudaEventElapsedTime(&ms, e0, e1);
	return bytes / (ms * 1e-3) / 1e9;
}

/* per round: the 1-warp descriptor kernel, then the copy from device memory */
static double run_two(int blocks, int threads, desc *hd, CUdeviceptr hd_d, CUdeviceptr dd,
		      CUstream s, int reps)
{
	cudaEvent_t e0, e1;
	double r;

	cudaEventCreate(&e0);
	cudaEventCreate(&e1);
	cudaEventRecord(e0, (cudaStream_t)s);
	for (int i = 0; i < reps; i++) {
		kdesc<<<1, 32, 0, (cudaStream_t)s>>>((const desc *)hd_d, (desc *)dd);
		kcopy_dev<4><<<blocks, threads, 0, (cudaStream_t)s>>>((const desc *)dd);
	}
	cudaEventRecord(e1, (cudaStream_t)s);
	r = gbps_since(e0, e1, hd->len * (double)reps);
	cudaEventDestroy(e0);
	cudaEventDestroy(e1);
	return r;
}

static void mode_zc(CUstream s, char *stage, CUdeviceptr stage_d, CUdeviceptr dbuf, desc *hd,
		    CUdeviceptr hd_d, CUdeviceptr dd, size_t big)
{
	size_t sizes[] = { 1u << 20, 4u << 20, 32u << 20 };
	int grids[] = { 8, 16, 32, 64, 132 };
	int thr[] = { 512, 1024 };

	for (size_t si = 0; si < 3; si++) {
		for (int dir = 0; dir < 2; dir++) {
			int reps = (int)((256u << 20) / sizes[si]);

			printf("{\"what\":\"zc2\",\"size\":%zu,\"dir\":\"%s\"", sizes[si], dir ? "d2h" : "h2d");
			for (int k = 0; k < 32; k++) {	/* replicated copies for kcopy_rep */
				desc *r = (desc *)((char *)hd + 128 * k);
				r->src = dir ? dbuf : stage_d;
				r->dst = dir ? stage_d : dbuf;
				r->len = sizes[si];
			}
			for (int gi = 0; gi < 5; gi++)
				for (int ti = 0; ti < 2; ti++) {
					double a = run_kernel(kcopy<4>, grids[gi], thr[ti], hd, hd_d, s, reps);
					double b = run_two(grids[gi], thr[ti], hd, hd_d, dd, s, reps);
					double c = run_kernel(kcopy_rep<4, 32>, grids[gi], thr[ti], hd, hd_d, s, reps);
					printf(",\"%dx%d\":[%.1f,%.1f,%.1f]", grids[gi], thr[ti], a, b, c);
				}
			printf("}\n");
			fflush(stdout);
		}
	}
	(void)stage;
	(void)big;
}

static void mode_rt(CUstream s, uint32_t *flags, CUdeviceptr flags_d, desc *hd, CUdeviceptr hd_d)
{
	struct pp p;
	pthread_t th;
	int n = 4000;
	double t;

	flags[0] = flags[1] = 0;
	p.flag = &flags[0];
	p.ack = &flags[1];
	p.n = n;
	t = now();
	pthread_create(&th, NULL, pp_host, &p);
	for (int i = 1; i <= n; i++) {
		CK(cuStreamWaitValue32(s, flags_d, i, CU_STREAM_WAIT_VALUE_GEQ));
		CK(cuStreamWriteValue32(s, flags_d + 4, i, 0));
	}
	pthread_join(th, NULL);
	t = now() - t;
	printf("{\"what\":\"pp-memops\",\"us\":%.2f}\n", t / n * 1e6);
	cuStreamSynchronize(s);
	flags[0] = flags[1] = 0;
	hd->len = 0;
	t = now();
	pthread_create(&th, NULL, pp_host, &p);
	for (int i = 1; i <= n; i++) {
		CK(cuStreamWaitValue32(s, flags_d, i, CU_STREAM_WAIT_VALUE_GEQ));
		kcopy<4><<<8, 1024, 0, (cudaStream_t)s>>>((const desc *)hd_d);
		CK(cuStreamWriteValue32(s, flags_d + 4, i, 0));
	}
	pthread_join(th, NULL);
	t = now() - t;
	printf("{\"what\":\"pp-memops-kernel\",\"us\":%.2f}\n", t / n * 1e6);
	cuStreamSynchronize(s);
	hf_count = 0;
	t = now();
	for (int i = 0; i < n; i++)
		CK(cuLaunchHostFunc(s, hf_inc, NULL));
	cuStreamSynchronize(s);
	t = now() - t;
	printf("{\"what\":\"hostfn-throughput\",\"us\":%.2f}\n", t / n * 1e6);
	{
		double sum = 0;
		for (int i = 0; i < 200; i++) {
			uint32_t c0 = hf_count;
			double t0 = now();
			CK(cuLaunchHostFunc(s, hf_inc, NULL));
			while (hf_count == c0)
				;
			sum += now() - t0;
		}
		printf("{\"what\":\"hostfn-latency-idle\",\"us\":%.2f}\n", sum / 200 * 1e6);
	}
	{
		double sum = 0;
		for (int i = 0; i < 200; i++) {
			((volatile uint32_t *)flags)[2] = 0;
			double t0 = now();
			CK(cuStreamWriteValue32(s, flags_d + 8, 1, 0));
			while (((volatile uint32_t *)flags)[2] != 1)
				;
			sum += now() - t0;
		}
		printf("{\"what\":\"writevalue-latency-idle\",\"us\":%.2f}\n", sum / 200 * 1e6);
	}
	{
		CUevent ev;
		double sum = 0;
		CK(cuEventCreate(&ev, CU_EVENT_BLOCKING_SYNC | CU_EVENT_DISABLE_TIMING));
		for (int i = 0; i < 200; i++) {
			double t0 = now();
			CK(cuEventRecord(ev, s));
			CK(cuEventSynchronize(ev));
			sum += now() - t0;
		}
		printf("{\"what\":\"event-blocking-sync\",\"us\":%.2f}\n", sum / 200 * 1e6);
	}
	fflush(stdout);
}

/* the GPU program of one stream op per chunk, against a host thread */
static void mode_pipe(CUstream s, uint32_t *flags, CUdeviceptr flags_d, CUdeviceptr stage_d,
		      CUdeviceptr dbuf, desc *hd, CUdeviceptr hd_d, CUdeviceptr dd, size_t big)
{
	size_t csz[] = { 1u << 20, 4u << 20, 16u << 20, 32u << 20 };

	for (int hostfn = 0; hostfn < 2; hostfn++)
		for (int kern = 0; kern < 2; kern++)
			for (int ci = 0; ci < 4; ci++) {
				size_t chunk = csz[ci], rsz = chunk < (4u << 20) ? chunk : (4u << 20);
				int rounds = (int)(chunk / rsz), n = (int)((512u << 20) / chunk);
				int blocks = kern ? 64 : 8;
				struct pipe p;
				pthread_t th;
				double t;

				memset(flags, 0, 64);
				for (int k = 0; k < 64; k++) {
					hd[k].src = stage_d + (k * rsz) % (big - rsz);
					hd[k].dst = dbuf + (k * rsz) % (big - rsz);
					hd[k].len = rsz;
				}
				p.arrive = &flags[0];
				p.flag = &flags[1];
				p.done = &flags[2];
				p.n = n;
				p.hostfn = hostfn;
				p.efd = eventfd(0, 0);
				t = now();
				pthread_create(&th, NULL, pipe_host, &p);
				for (int i = 1; i <= n; i++) {
					if (hostfn)
						CK(cuLaunchHostFunc(s, hf_arrive, &p));
					else
						CK(cuStreamWriteValue32(s, flags_d, i, 0));
					CK(cuStreamWaitValue32(s, flags_d + 4, i, CU_STREAM_WAIT_VALUE_GEQ));
					for (int k = 0; k < rounds; k++) {
						const desc *hk = (const desc *)(hd_d + (k % 64) * sizeof(desc));
						if (kern) {
							desc *dk = (desc *)(dd + (k % 64) * sizeof(desc));
							kdesc<<<1, 32, 0, (cudaStream_t)s>>>(hk, dk);
							kcopy_dev<4><<<blocks, 1024, 0, (cudaStream_t)s>>>(dk);
						} else {
							kcopy<4><<<blocks, 1024, 0, (cudaStream_t)s>>>(hk);
						}
					}
					if (hostfn)
						CK(cuLaunchHostFunc(s, hf_inc, NULL));
					else
						CK(cuStreamWriteValue32(s, flags_d + 8, i, 0));
				}
				pthread_join(th, NULL);
				cuStreamSynchronize(s);
				t = now() - t;
				close(p.efd);
				printf("{\"what\":\"pipe\",\"hostfn\":%d,\"kernel\":\"%s\",\"chunk\":%zu,\"rounds\":%d,\"gbps\":%.2f,\"us_per_op\":%.1f}\n",
				       hostfn, kern ? "desc+dev64" : "host8", chunk, rounds,
				       n * (double)chunk / t / 1e9, t / n * 1e6);
				fflush(stdout);
			}
}

__global__ void kfault(int *p)
{
	*p = 1;
}

static volatile int fault_hf;
static void hf_mark(void *a)
{
	(void)a;
	fault_hf = 1;
}

/* what a stream and the context do after a kernel faults (run last: it kills the context) */
static void mode_fault(CUstream s, uint32_t *flags, CUdeviceptr flags_d)
{
	CUstream s2;
	CUresult q1, q2, w, h, sy, al;
	CUdeviceptr x;

	CK(cuStreamCreate(&s2, CU_STREAM_NON_BLOCKING));
	memset(flags, 0, 64);
	CK(cuStreamWaitValue32(s2, flags_d + 16, 1, CU_STREAM_WAIT_VALUE_GEQ));
	CK(cuLaunchHostFunc(s2, hf_mark, NULL));
	kfault<<<1, 1, 0, (cudaStream_t)s>>>((int *)0x10);
	w = cuStreamWaitValue32(s, flags_d, 1, CU_STREAM_WAIT_VALUE_GEQ);
	h = cuLaunchHostFunc(s, hf_mark, NULL);
	usleep(200000);
	q1 = cuStreamQuery(s);
	q2 = cuStreamQuery(s2);
	flags[0] = 1;
	flags[4] = 1;
	usleep(200000);
	sy = cuStreamSynchronize(s2);
	al = cuMemAlloc(&x, 4096);
	printf("{\"what\":\"fault\",\"queue_wait\":%d,\"queue_hostfn\":%d,\"query_faulted\":%d,"
	       "\"query_other\":%d,\"hostfn_ran\":%d,\"sync_other\":%d,\"alloc_after\":%d,"
	       "\"write_value_after\":%d}\n", w, h, q1, q2, fault_hf, sy, al,
	       cuStreamWriteValue32(s2, flags_d + 20, 1, 0));
	fflush(stdout);
}

int main(int argc, char **argv)
{
	const char *mode = argc > 1 ? argv[1] : "all";
	CUdevice dev;
	CUcontext ctx;
	CUstream s;
	size_t big = 64u << 20;
	CUdeviceptr stage_d, dbuf, hd_d, flags_d, dd;
	char *stage;
	desc *hd;
	uint32_t *flags;

	CK(cuInit(0));
	CK(cuDeviceGet(&dev, 0));
	CK(cuDevicePrimaryCtxRetain(&ctx, dev));
	CK(cuCtxSetCurrent(ctx));
	cudaSetDevice(0);
	CK(cuStreamCreate(&s, CU_STREAM_NON_BLOCKING));
	stage = host_region(big, &stage_d);
	CK(cuMemAlloc(&dbuf, big));
	CK(cuMemAlloc(&dd, 1 << 16));
	hd = (desc *)host_region(1 << 16, &hd_d);
	flags = (uint32_t *)host_region(4096, &flags_d);
	memset(flags, 0, 4096);
	if (!strcmp(mode, "zc") || !strcmp(mode, "all"))
		mode_zc(s, stage, stage_d, dbuf, hd, hd_d, dd, big);
	if (!strcmp(mode, "rt") || !strcmp(mode, "all"))
		mode_rt(s, flags, flags_d, hd, hd_d);
	if (!strcmp(mode, "pipe") || !strcmp(mode, "all"))
		mode_pipe(s, flags, flags_d, stage_d, dbuf, hd, hd_d, dd, big);
	if (!strcmp(mode, "fault"))
		mode_fault(s, flags, flags_d);
	return 0;
}
