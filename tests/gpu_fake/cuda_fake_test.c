// SPDX-License-Identifier: Apache-2.0
/*
 * cuda_fake_test.c - libphx's GPU path against fake_cuda.c (no GPU needed).
 *
 * Run by tests/test_gpu_fake.py with the fake as libcuda.so.1.  "Device"
 * memory is host memory there, so every check compares bytes directly with
 * the file.  Data is random, sizes, offsets and GPU addresses unaligned.
 * Exit 0 = all passed; a failure prints what and where.
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "phx.h"
#include "phx_cuda.h"

#define KiB 1024ull
#define MiB (1024ull * 1024)

static int failures;

#define CHECK(cond, ...)                                                     \
	do {                                                                 \
		if (!(cond)) {                                               \
			fprintf(stderr, "FAIL %s:%d: ", __FILE__, __LINE__); \
			fprintf(stderr, __VA_ARGS__);                        \
			fprintf(stderr, " [%s]\n", phx_cuda_strerror_last()); \
			failures++;                                          \
		}                                                            \
	} while (0)

/* the fake's own entry points */
static int (*MemAlloc)(uint64_t *, size_t);
static int (*MemFree)(uint64_t);
static int (*StreamCreate)(void **, unsigned);
static int (*StreamSynchronize)(void *);
static int (*MemsetAsync)(uint64_t, unsigned char, size_t, void *);
static int (*SleepAsync)(void *, unsigned long);
static int64_t (*HostfnMax)(void);
static long (*BatchCalls)(void);
static int (*DeviceSync)(int);
static void (*FailHostRegister)(int);
static int (*FakeHostRegistered)(size_t *);
static void (*FailStreamCreate)(int);

static uint64_t rng = 88172645463325252ull;

static uint64_t rnd(void)
{
	rng ^= rng << 13;
	rng ^= rng >> 7;
	rng ^= rng << 17;
	return rng;
}

static void fill_random(unsigned char *p, size_t n)
{
	size_t i;

	for (i = 0; i < n; i++)
		p[i] = (unsigned char)(rnd() >> 24);
}

static char dir[256];

static const char *path_of(const char *name)
{
	static __thread char p[512];

	snprintf(p, sizeof(p), "%s/%s", dir, name);
	return p;
}

static unsigned char *make_file(const char *name, size_t n)
{
	unsigned char *d = malloc(n);
	int fd = open(path_of(name), O_CREAT | O_TRUNC | O_WRONLY, 0644);

	fill_random(d, n);
	if (fd < 0 || write(fd, d, n) != (ssize_t)n) {
		perror("make_file");
		exit(2);
	}
	fsync(fd);
	close(fd);
	return d;
}

static unsigned char *read_file(const char *name, size_t *n)
{
	struct stat st;
	int fd = open(path_of(name), O_RDONLY);
	unsigned char *d;

	fstat(fd, &st);
	*n = (size_t)st.st_size;
	d = malloc(*n + 1);
	if (pread(fd, d, *n, 0) != (ssize_t)*n)
		exit(2);
	close(fd);
	return d;
}

static unsigned char *dev(uint64_t p)
{
	return (unsigned char *)(uintptr_t)p;
}

static phx_cuda *ctx(phx_engine *eng, uint32_t lanes, uint32_t bufs, uint32_t size,
		     uint32_t flags)
{
	struct phx_cuda_config cfg;
	phx_cuda *c = NULL;
	int ret;

	phx_cuda_config_init(&cfg);
	cfg.lanes = lanes;
	cfg.bufs_per_lane = bufs;
	cfg.buf_size = size;
	cfg.max_io_size = 64 * KiB;
	cfg.flags = flags;
	ret = phx_cuda_create(eng, &cfg, &c);
	CHECK(ret == 0, "phx_cuda_create = %d", ret);
	if (ret)
		exit(1);
	return c;
}

/* ------------------------------------------------------------------------ */

static void test_sync_sizes(phx_cuda *c, phx_engine *eng)
{
	size_t fsize = 3 * MiB + 777, sizes[] = { 1, 7, 4095, 4096, 4097, 65539, 300001, MiB + 5 };
	uint64_t offs[] = { 0, 1, 4095, 86415, 3 * MiB - 4096 };
	unsigned char *data = make_file("sync.bin", fsize);
	uint64_t buf;
	phx_file *f;
	size_t i, j;

	CHECK(phx_file_open(eng, path_of("sync.bin"), O_RDONLY, 0, 0, &f) == 0, "open");
	MemAlloc(&buf, 2 * MiB + 64);
	for (i = 0; i < sizeof(sizes) / sizeof(sizes[0]); i++) {
		for (j = 0; j < sizeof(offs) / sizeof(offs[0]); j++) {
			uint64_t p = buf + 3 + i;	/* unaligned GPU address */
			size_t want = offs[j] + sizes[i] > fsize ? fsize - offs[j] : sizes[i];
			int64_t r;

			memset(dev(buf), 0xA5, 2 * MiB + 64);
			r = phx_cuda_pread(c, f, p, sizes[i], offs[j]);
			CHECK(r == (int64_t)want, "pread %zu at %" PRIu64 " = %" PRId64, sizes[i], offs[j], r);
			CHECK(!memcmp(dev(p), data + offs[j], want), "pread %zu at %" PRIu64 " bytes",
			      sizes[i], offs[j]);
			CHECK(dev(p)[want] == 0xA5, "byte past the read written (%zu at %" PRIu64 ")",
			      sizes[i], offs[j]);
		}
	}
	/* past end of file: 0, nothing written */
	memset(dev(buf), 0xA5, 64);
	CHECK(phx_cuda_pread(c, f, buf, 10, fsize + 5) == 0, "read past EOF");
	CHECK(dev(buf)[0] == 0xA5, "read past EOF wrote");
	phx_file_close(f);
	MemFree(buf);
	free(data);
}

/* A batch of many small random requests: few copy calls, exact bytes. */
static void test_batch(phx_cuda *c, phx_engine *eng, bool direct, bool expect_batch)
{
	enum { N = 600 };
	size_t fsize = 8 * MiB + 123;
	unsigned char *data = make_file("batch.bin", fsize);
	struct phx_cuda_io ios[N], *ptrs[N];
	struct phx_cuda_stats st0, st1;
	uint64_t buf, place[N];
	size_t bsize = 16 * MiB, at = 5;
	phx_file *f;
	long b0 = BatchCalls();
	int i, ret;

	CHECK(phx_file_open(eng, path_of("batch.bin"), O_RDONLY, 0,
			    direct ? 0 : PHX_FILE_BUFFERED, &f) == 0, "open");
	MemAlloc(&buf, bsize);
	memset(dev(buf), 0x5A, bsize);
	phx_cuda_stats(c, &st0);
	for (i = 0; i < N; i++) {
		size_t len = 1 + rnd() % (i % 3 == 0 ? 100 * KiB : 9000);
		uint64_t off = rnd() % (fsize - len);

		if (i % 7 == 0)
			off &= ~4095ull;
		place[i] = at;
		phx_cuda_io_prep(&ios[i], f, PHX_OP_READ, buf + at, len, off);
		ptrs[i] = &ios[i];
		at += len + rnd() % 3;
	}
	ret = phx_cuda_submit(c, ptrs, N);
	CHECK(ret == 0, "submit batch = %d", ret);
	for (i = 0; i < N; i++) {
		phx_cuda_wait(c, &ios[i], -1);
		CHECK(ios[i].result == (int64_t)ios[i].len, "batch %d result %" PRId64, i, ios[i].result);
		CHECK(!memcmp(dev(buf + place[i]), data + ios[i].offset, ios[i].len),
		      "batch %d bytes (len %zu off %" PRIu64 ")", i, ios[i].len, ios[i].offset);
	}
	phx_cuda_stats(c, &st1);
	if (expect_batch) {
		/* one copy call per staging round, not one per request */
		CHECK(st1.memcpy_calls - st0.memcpy_calls <= st1.staging_fills - st0.staging_fills &&
		      st1.memcpy_calls - st0.memcpy_calls < N / 4,
		      "%" PRIu64 " copy calls for %d requests", st1.memcpy_calls - st0.memcpy_calls, N);
		CHECK(BatchCalls() > b0, "cuMemcpyBatchAsync was not used");
	} else {
		CHECK(st1.memcpy_calls - st0.memcpy_calls <= st1.chunks - st0.chunks,
		      "%" PRIu64 " copy calls for %" PRIu64 " pieces", st1.memcpy_calls - st0.memcpy_calls,
		      st1.chunks - st0.chunks);
		CHECK(BatchCalls() == b0, "cuMemcpyBatchAsync used although disabled");
	}
	CHECK(st1.file_adoptions - st0.file_adoptions <= 3,
	      "%" PRIu64 " lane adoptions for one file", st1.file_adoptions - st0.file_adoptions);
	phx_file_close(f);
	MemFree(buf);
	free(data);
}

/* Writes of random disjoint unaligned pieces, then the file byte for byte. */
static void test_batch_writes(phx_cuda *c, phx_engine *eng)
{
	enum { N = 300 };
	size_t fsize = 4 * MiB + 99, got;
	unsigned char *want = make_file("w.bin", fsize), *now;
	struct phx_cuda_io ios[N], *ptrs[N];
	uint64_t buf;
	phx_file *f;
	uint64_t off = 3;
	int i;

	CHECK(phx_file_open(eng, path_of("w.bin"), O_RDWR, 0, 0, &f) == 0, "open");
	MemAlloc(&buf, fsize + 64);
	fill_random(dev(buf), fsize + 64);
	for (i = 0; i < N && off < fsize - 20000; i++) {
		size_t len = 1 + rnd() % 12000;

		phx_cuda_io_prep(&ios[i], f, PHX_OP_WRITE, buf + 1 + off, len, off);
		ptrs[i] = &ios[i];
		memcpy(want + off, dev(buf + 1 + off), len);
		off += len + rnd() % 5000;
	}
	CHECK(phx_cuda_submit(c, ptrs, (size_t)i) == 0, "submit writes");
	while (i--) {
		phx_cuda_wait(c, &ios[i], -1);
		CHECK(ios[i].result == (int64_t)ios[i].len, "write %d = %" PRId64, i, ios[i].result);
	}
	phx_file_close(f);
	now = read_file("w.bin", &got);
	CHECK(got == fsize, "size %zu", got);
	CHECK(!memcmp(now, want, fsize), "file after the write batch");
	free(now);
	free(want);
	MemFree(buf);
}

/*
 * Deferred arguments: size and offsets are read when the stream gets to
 * the operation, not when it is queued.
 */
static void test_stream_deferred(phx_cuda *c, phx_engine *eng, void *s)
{
	size_t fsize = 2 * MiB + 5;
	unsigned char *data = make_file("d.bin", fsize);
	size_t size = 10;
	int64_t foff = 0, boff = 0, done = 12345;
	uint64_t buf;
	phx_file *f;
	int ret;

	phx_file_open(eng, path_of("d.bin"), O_RDONLY, 0, 0, &f);
	MemAlloc(&buf, MiB);
	memset(dev(buf), 0xEE, MiB);
	SleepAsync(s, 150000);			/* the stream is busy */
	ret = phx_cuda_read_async(c, f, buf, &size, &foff, &boff, &done, s);
	CHECK(ret == 0, "read_async = %d", ret);
	/* changed after queueing, before the stream arrives (within one round) */
	size = 100001;
	foff = 4097;
	boff = 33;
	ret = phx_file_close(f);
	CHECK(ret == -EBUSY, "close with stream I/O queued = %d (want -EBUSY)", ret);
	StreamSynchronize(s);
	CHECK(done == 100001, "bytes_done = %" PRId64 " (want the deferred size 100001)", done);
	CHECK(!memcmp(dev(buf + 33), data + 4097, 100001), "deferred read bytes");
	CHECK(dev(buf)[32] == 0xEE && dev(buf)[33 + 100001] == 0xEE, "bytes around the read");
	/* grown past the staging rounds queued for it: refused, nothing written */
	size = 10;
	memset(dev(buf), 0xEE, MiB);
	SleepAsync(s, 50000);
	CHECK(phx_cuda_read_async(c, f, buf, &size, &foff, &boff, &done, s) == 0, "queue");
	size = 900000;
	StreamSynchronize(s);
	CHECK(done == -EINVAL, "grown size: bytes_done = %" PRId64 " (want -EINVAL)", done);
	CHECK(dev(buf)[33] == 0xEE && dev(buf)[500000] == 0xEE, "a refused op wrote GPU memory");
	CHECK(phx_file_close(f) == 0, "close after the stream passed");
	MemFree(buf);
	free(data);
}

/* A read queued after a file-extending write on one stream sees it. */
static void test_stream_write_then_read(phx_cuda *c, phx_engine *eng, void *s)
{
	size_t fsize = 100000, n = 3 * MiB + 17, got;
	unsigned char *data = make_file("wr.bin", fsize), *now;
	size_t wsize = n, rsize = n;
	int64_t woff = (int64_t)fsize + 11, roff = woff, zero = 0, wdone = -1, rdone = -1;
	uint64_t src, dst;
	phx_file *f;

	phx_file_open(eng, path_of("wr.bin"), O_RDWR, 0, 0, &f);
	MemAlloc(&src, n);
	MemAlloc(&dst, n + 1);
	fill_random(dev(src), n);
	memset(dev(dst), 0x11, n + 1);
	SleepAsync(s, 50000);
	CHECK(phx_cuda_write_async(c, f, src, &wsize, &woff, &zero, &wdone, s) == 0, "write_async");
	CHECK(phx_cuda_read_async(c, f, dst, &rsize, &roff, &zero, &rdone, s) == 0, "read_async");
	StreamSynchronize(s);
	CHECK(wdone == (int64_t)n, "write bytes_done %" PRId64, wdone);
	CHECK(rdone == (int64_t)n, "read after the extending write: bytes_done %" PRId64 " (want %zu)",
	      rdone, n);
	CHECK(!memcmp(dev(dst), dev(src), n), "read-after-write bytes");
	CHECK(dev(dst)[n] == 0x11, "byte past the read");
	phx_file_close(f);
	now = read_file("wr.bin", &got);
	CHECK(got == fsize + 11 + n, "file size %zu", got);
	CHECK(!memcmp(now, data, fsize), "old bytes kept");
	CHECK(!memcmp(now + fsize + 11, dev(src), n), "written bytes");
	free(now);
	free(data);
	MemFree(src);
	MemFree(dst);
}

/* End of file is judged when the stream arrives: a shrunk file, a short read. */
static void test_stream_eof_shrink(phx_cuda *c, phx_engine *eng, void *s)
{
	size_t fsize = 2 * MiB, size = 2 * MiB;
	unsigned char *data = make_file("shrink.bin", fsize);
	int64_t foff = 1, boff = 0, done = -1;
	uint64_t buf;
	phx_file *f;

	phx_file_open(eng, path_of("shrink.bin"), O_RDONLY, 0, 0, &f);
	MemAlloc(&buf, 2 * MiB);
	memset(dev(buf), 0x77, 2 * MiB);
	SleepAsync(s, 100000);
	CHECK(phx_cuda_read_async(c, f, buf, &size, &foff, &boff, &done, s) == 0, "read_async");
	CHECK(truncate(path_of("shrink.bin"), 700001) == 0, "truncate");
	StreamSynchronize(s);
	CHECK(done == 700000, "bytes_done after shrinking = %" PRId64 " (want 700000)", done);
	CHECK(!memcmp(dev(buf), data + 1, 700000), "bytes before EOF");
	CHECK(dev(buf)[700000] == 0x77 && dev(buf)[2 * MiB - 1] == 0x77,
	      "GPU bytes past the new EOF were written");
	phx_file_close(f);
	MemFree(buf);
	free(data);
}

/* Errors: bad buffer offset -> bytes_done < 0 via the stream; bad pointer -> call fails. */
static void test_errors(phx_cuda *c, phx_engine *eng, void *s)
{
	unsigned char *data = make_file("e.bin", MiB);
	size_t size = 4096;
	int64_t foff = 0, boff = 1000000, done = 0;
	struct phx_cuda_io io, *p = &io;
	uint64_t buf;
	phx_file *f;

	phx_file_open(eng, path_of("e.bin"), O_RDONLY, 0, 0, &f);
	MemAlloc(&buf, 8192);
	CHECK(phx_cuda_read_async(c, f, buf, &size, &foff, &boff, &done, s) == 0, "queue");
	StreamSynchronize(s);
	CHECK(done < 0, "read past the allocation: bytes_done = %" PRId64, done);
	phx_cuda_io_prep(&io, f, PHX_OP_READ, (uint64_t)(uintptr_t)data, 100, 0);
	CHECK(phx_cuda_submit(c, &p, 1) < 0, "host memory as a device pointer accepted");
	CHECK(phx_cuda_pread(c, f, buf + 8000, 4096, 0) < 0, "read past the allocation accepted");
	phx_file_close(f);
	MemFree(buf);
	free(data);
}

struct thr_arg {
	phx_cuda *c;
	phx_engine *eng;
	const unsigned char *data;
	size_t fsize;
	int id;
};

/* Threads with their own streams doing stream-ordered and host calls. */
static void *thr_main(void *arg)
{
	struct thr_arg *a = arg;
	void *s;
	uint64_t buf;
	phx_file *f;
	int k;

	StreamCreate(&s, 1);
	MemAlloc(&buf, 4 * MiB + 100);
	if (phx_file_open(a->eng, path_of("mt.bin"), O_RDONLY, 0, 0, &f)) {
		CHECK(0, "thread %d: open: %s", a->id, phx_strerror_last());
		return NULL;
	}
	for (k = 0; k < 12; k++) {
		size_t size = 1 + rnd() % (2 * MiB);
		int64_t foff = (int64_t)(rnd() % (a->fsize - size)), boff = 1 + (int64_t)(rnd() % 64);
		int64_t done = -7;

		if (k % 2) {
			CHECK(phx_cuda_read_async(a->c, f, buf, &size, &foff, &boff, &done, s) == 0,
			      "thread %d read_async", a->id);
			StreamSynchronize(s);
		} else {
			done = phx_cuda_pread(a->c, f, buf + (uint64_t)boff, size, (uint64_t)foff);
		}
		CHECK(done == (int64_t)size, "thread %d op %d = %" PRId64, a->id, k, done);
		CHECK(!memcmp(dev(buf + (uint64_t)boff), a->data + foff, size),
		      "thread %d op %d bytes", a->id, k);
	}
	phx_file_close(f);
	MemFree(buf);
	return NULL;
}

static void test_threads(phx_cuda *c, phx_engine *eng)
{
	struct thr_arg a[6];
	pthread_t t[6];
	size_t fsize = 16 * MiB + 3;
	unsigned char *data = make_file("mt.bin", fsize);
	int i;

	for (i = 0; i < 6; i++) {
		a[i] = (struct thr_arg){ c, eng, data, fsize, i };
		pthread_create(&t[i], NULL, thr_main, &a[i]);
	}
	for (i = 0; i < 6; i++)
		pthread_join(t[i], NULL);
	free(data);
}

/*
 * A device-wide synchronisation (cudaFree, a growing allocator) in another
 * thread while stream ops wait on their streams: they must complete without
 * any CUDA call from the lanes, or the process hangs (seen on the H200 with
 * an earlier design whose lanes queued the copies after arrival).
 */
static void test_stream_ops_survive_device_sync(phx_cuda *c, phx_engine *eng, void *s)
{
	size_t fsize = 3 * MiB, rsize = 2 * MiB + 3, wsize = 300000;
	unsigned char *data = make_file("sync2.bin", fsize);
	int64_t roff = 5, woff = 4096 * 3 + 1, zero = 0, rdone = -1, wdone = -1;
	uint64_t buf;
	phx_file *f;

	phx_file_open(eng, path_of("sync2.bin"), O_RDWR, 0, 0, &f);
	MemAlloc(&buf, 4 * MiB);
	fill_random(dev(buf + 3 * MiB), wsize);
	SleepAsync(s, 30000);
	CHECK(phx_cuda_read_async(c, f, buf, &rsize, &roff, &zero, &rdone, s) == 0, "read_async");
	CHECK(phx_cuda_write_async(c, f, buf + 3 * MiB, &wsize, &woff, &zero, &wdone, s) == 0,
	      "write_async");
	CHECK(DeviceSync(10000) == 0, "a device-wide synchronisation hung behind stream ops");
	CHECK(rdone == (int64_t)rsize && wdone == (int64_t)wsize, "results %" PRId64 " %" PRId64,
	      rdone, wdone);
	CHECK(!memcmp(dev(buf), data + 5, rsize), "read bytes");
	StreamSynchronize(s);
	phx_file_close(f);
	{
		size_t got;
		unsigned char *now = read_file("sync2.bin", &got);

		CHECK(!memcmp(now + woff, dev(buf + 3 * MiB), wsize), "written bytes");
		free(now);
	}
	MemFree(buf);
	free(data);
}

/* Destroy with a stream op still queued behind a busy stream: it waits. */
static void test_destroy_with_queued(phx_engine *eng)
{
	phx_cuda *c = ctx(eng, 2, 2, 128 * KiB, 0);
	unsigned char *data = make_file("q.bin", MiB);
	size_t size = 5000;
	int64_t foff = 7, boff = 0, done = -1;
	uint64_t buf;
	void *s;
	phx_file *f;

	StreamCreate(&s, 1);
	MemAlloc(&buf, 8192);
	phx_file_open(eng, path_of("q.bin"), O_RDONLY, 0, 0, &f);
	SleepAsync(s, 200000);
	CHECK(phx_cuda_read_async(c, f, buf, &size, &foff, &boff, &done, s) == 0, "queue");
	CHECK(phx_cuda_destroy(c) == 0, "destroy");
	CHECK(done == 5000, "destroy returned before the queued op ran: %" PRId64, done);
	StreamSynchronize(s);
	CHECK(!memcmp(dev(buf), data + 7, 5000), "bytes of the op destroy waited for");
	CHECK(phx_file_close(f) == 0, "close after destroy");
	MemFree(buf);
	free(data);
}

static void test_no_memops(phx_engine *eng)
{
	phx_cuda *c = ctx(eng, 1, 2, 64 * KiB, PHX_CUDA_NO_MEMOPS);
	size_t size = 1;
	int64_t z = 0, done;
	uint64_t buf;
	phx_file *f;

	make_file("nm.bin", 100);
	phx_file_open(eng, path_of("nm.bin"), O_RDONLY, 0, 0, &f);
	MemAlloc(&buf, 128);
	CHECK(!(phx_cuda_features(c) & PHX_CUDA_FEAT_MEMOPS), "memops reported");
	CHECK(phx_cuda_read_async(c, f, buf, &size, &z, &z, &done, NULL) == -ENOTSUP,
	      "stream op without memops");
	CHECK(phx_cuda_pread(c, f, buf, 100, 0) == 100, "host call without memops");
	phx_file_close(f);
	phx_cuda_destroy(c);
	MemFree(buf);
}

/*
 * Lanes are set up in parallel, and the staging of all of them is one
 * CUDA registration: a failure in a lane (its stream) or in that
 * registration fails the create with its message and leaves nothing
 * registered, and the next create works.  Staging is 2 MiB aligned (huge
 * pages where the kernel has them).
 */
static void create_fails(phx_engine *eng, struct phx_cuda_config *cfg, const char *what)
{
	phx_cuda *c = (phx_cuda *)cfg;
	size_t align;
	int before = FakeHostRegistered(&align), ret;

	ret = phx_cuda_create(eng, cfg, &c);
	CHECK(ret < 0, "create with a failing %s = %d", what, ret);
	CHECK(c == NULL, "create failed but gave a context");
	CHECK(strstr(phx_cuda_strerror_last(), what) != NULL, "message: %s",
	      phx_cuda_strerror_last());
	CHECK(FakeHostRegistered(&align) == before, "%d regions left registered",
	      FakeHostRegistered(&align) - before);
}

static void test_lane_setup_failure(phx_engine *eng)
{
	struct phx_cuda_config cfg;
	phx_cuda *c = NULL;
	size_t align;
	int before, ret;

	before = FakeHostRegistered(&align);
	phx_cuda_config_init(&cfg);
	cfg.lanes = 6;
	cfg.bufs_per_lane = 2;
	cfg.buf_size = MiB;
	FailHostRegister(2);		/* flags, descriptors, then the staging */
	create_fails(eng, &cfg, "cuMemHostRegister (staging buffers)");
	FailStreamCreate(1 + 3);	/* the batch-copy probe's, then the lanes' */
	create_fails(eng, &cfg, "cuStreamCreate (lane)");
	FailHostRegister(-1);
	FailStreamCreate(-1);
	ret = phx_cuda_create(eng, &cfg, &c);
	CHECK(ret == 0, "create after failed ones = %d", ret);
	FakeHostRegistered(&align);
	CHECK(align >= 2 * MiB, "staging aligned to %zu bytes only", align);
	if (!ret)
		phx_cuda_destroy(c);
	CHECK(FakeHostRegistered(&align) == before, "destroy left regions registered");
}

int main(int argc, char **argv)
{
	phx_engine *eng;
	phx_cuda *c;
	void *h, *s1, *s2;
	char why[256];

	snprintf(dir, sizeof(dir), "%s", argc > 1 ? argv[1] : "/tmp");
	h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_GLOBAL);
	if (!h || !dlsym(h, "fake_sleep_async")) {
		fprintf(stderr, "the fake libcuda.so.1 is not on the library path\n");
		return 77;
	}
	*(void **)&MemAlloc = dlsym(h, "cuMemAlloc_v2");
	*(void **)&MemFree = dlsym(h, "cuMemFree_v2");
	*(void **)&StreamCreate = dlsym(h, "cuStreamCreate");
	*(void **)&StreamSynchronize = dlsym(h, "cuStreamSynchronize");
	*(void **)&MemsetAsync = dlsym(h, "cuMemsetD8Async");
	*(void **)&SleepAsync = dlsym(h, "fake_sleep_async");
	*(void **)&HostfnMax = dlsym(h, "fake_hostfn_max_ns");
	*(void **)&BatchCalls = dlsym(h, "fake_batch_calls");
	*(void **)&DeviceSync = dlsym(h, "fake_device_sync");
	*(void **)&FailHostRegister = dlsym(h, "fake_fail_host_register");
	*(void **)&FakeHostRegistered = dlsym(h, "fake_host_registered");
	*(void **)&FailStreamCreate = dlsym(h, "fake_fail_stream_create");

	CHECK(phx_cuda_available(why, sizeof(why)) == 1, "available: %s", why);
	CHECK(phx_engine_create(NULL, &eng) == 0, "engine");
	StreamCreate(&s1, 1);
	StreamCreate(&s2, 1);

	/* few, small buffers: pieces cycle through them many times */
	c = ctx(eng, 3, 2, 128 * KiB, getenv("FAKE_CUDA_NO_BATCH") ? PHX_CUDA_NO_BATCH_COPY : 0);
	test_sync_sizes(c, eng);
	test_batch(c, eng, true, !getenv("FAKE_CUDA_NO_BATCH"));
	test_batch(c, eng, false, !getenv("FAKE_CUDA_NO_BATCH"));
	test_batch_writes(c, eng);
	test_stream_deferred(c, eng, s1);
	test_stream_write_then_read(c, eng, s2);
	test_stream_eof_shrink(c, eng, s1);
	test_errors(c, eng, s2);
	test_threads(c, eng);
	test_stream_ops_survive_device_sync(c, eng, s1);
	CHECK(phx_cuda_destroy(c) == 0, "destroy");
	test_destroy_with_queued(eng);
	test_no_memops(eng);
	test_lane_setup_failure(eng);
	/* every host function libphx queued returned at once */
	CHECK(HostfnMax() < 20 * 1000000, "a host function ran %.1f ms", HostfnMax() / 1e6);
	phx_engine_destroy(eng);
	if (failures) {
		fprintf(stderr, "%d failures\n", failures);
		return 1;
	}
	printf("all passed\n");
	return 0;
}
