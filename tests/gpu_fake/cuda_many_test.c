// SPDX-License-Identifier: Apache-2.0
/*
 * cuda_many_test.c - phx_cuda_many*() (PHX_0.8, issue 29) against
 * fake_cuda.c: thousands of small pieces of one file and one GPU buffer.
 *
 * Run by tests/test_gpu_small.py with the fake as libcuda.so.1.  "Device"
 * memory is host memory there, so bytes are compared directly with the
 * file.  Data is random; sizes, file offsets and GPU offsets unaligned.
 * Errors are injected by marking a file range bad (what a failed write
 * leaves): reads of it must fail with -EIO and touch no GPU byte.
 * Exit 0 = all passed.
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "phx.h"
#include "phx_cuda.h"
#include "fake_check.h"
#include "cuda_internal.h"	/* phx_file's inode: the injected bad range */


static int (*MemAlloc)(uint64_t *, size_t);
static int (*MemFree)(uint64_t);
static int (*StreamCreate)(void **, unsigned);
static int (*StreamSynchronize)(void *);
static int (*SleepAsync)(void *, unsigned long);
static void (*PoisonCopies)(uint64_t, uint64_t);

static uint64_t rng = 0x9E3779B97F4A7C15ull;

static uint64_t rnd(void)
{
	rng ^= rng << 13;
	rng ^= rng >> 7;
	rng ^= rng << 17;
	return rng;
}

static char dir[256];

static const char *path_of(const char *name)
{
	static char p[512];

	snprintf(p, sizeof(p), "%s/%s", dir, name);
	return p;
}

static unsigned char *make_file(const char *name, size_t n)
{
	unsigned char *d = malloc(n);
	int fd = open(path_of(name), O_CREAT | O_TRUNC | O_WRONLY, 0644);
	size_t i;

	for (i = 0; i < n; i++)
		d[i] = (unsigned char)(rnd() >> 24);
	if (!d || fd < 0 || write(fd, d, n) != (ssize_t)n) {
		perror("make_file");
		exit(2);
	}
	close(fd);
	return d;
}

static unsigned char *dev(uint64_t p)
{
	return (unsigned char *)(uintptr_t)p;
}

/*
 * @n pieces of 1..@maxlen bytes at random unaligned file offsets below
 * @fsize, placed end to end in the GPU buffer with 0..7-byte gaps (in a
 * shuffled order, so GPU order is not file order); returns the GPU bytes
 * needed.  With @disjoint_file the file ranges do not overlap either
 * (writes): each piece gets its own slot of the file.
 */
static uint64_t plan(size_t n, uint64_t maxlen, uint64_t fsize, bool disjoint_file,
		     int64_t *fo, int64_t *dof, int64_t *len)
{
	size_t *order = malloc(n * sizeof(*order)), i;
	uint64_t at = 3, slot = fsize / n;

	for (i = 0; i < n; i++) {
		len[i] = (int64_t)(1 + rnd() % maxlen);
		if (disjoint_file) {
			if ((uint64_t)len[i] > slot)
				len[i] = (int64_t)slot;
			fo[i] = (int64_t)(i * slot + rnd() % (slot - (uint64_t)len[i] + 1));
		} else {
			fo[i] = (int64_t)(rnd() % (fsize - (uint64_t)len[i]));
		}
		order[i] = i;
	}
	for (i = n - 1; i > 0; i--) {
		size_t j = rnd() % (i + 1), t = order[i];

		order[i] = order[j];
		order[j] = t;
	}
	for (i = 0; i < n; i++) {
		dof[order[i]] = (int64_t)at;
		at += (uint64_t)len[order[i]] + rnd() % 8;
	}
	free(order);
	return at + 8;
}

static struct phx_cuda_many many(uint32_t op, phx_file *f, uint64_t devptr, uint64_t dev_len,
				 size_t n, const int64_t *fo, const int64_t *dof,
				 const int64_t *len, int64_t *res)
{
	struct phx_cuda_many m;

	memset(&m, 0, sizeof(m));
	m.size = sizeof(m);
	m.op = op;
	m.file = f;
	m.devptr = devptr;
	m.dev_len = dev_len;
	m.n = n;
	m.file_offsets = fo;
	m.dev_offsets = dof;
	m.lens = len;
	m.results = res;
	return m;
}

/* Every refusal names its reason and queues nothing. */
static void test_checks(phx_cuda *c, phx_engine *eng)
{
	int64_t fo[3] = { 0, 100, 200 }, dof[3] = { 0, 50, 100 }, len[3] = { 50, 50, 50 };
	struct phx_cuda_stats st0, st1;
	struct phx_cuda_many m;
	uint64_t buf;
	phx_file *f;

	free(make_file("checks.bin", 4096));
	CHECK(phx_file_open(eng, path_of("checks.bin"), O_RDWR, 0, 0, &f) == 0, "open");
	MemAlloc(&buf, 256);
	phx_cuda_stats_get(c, &st0, sizeof(st0));
	m = many(PHX_OP_READ, f, buf, 150, 3, fo, dof, len, NULL);
	CHECK(phx_cuda_many_check(&m) == 0, "good pieces refused");
	m.dev_len = 149;
	CHECK(phx_cuda_many(c, &m) == -EINVAL, "a piece past the GPU buffer");
	CHECK(strstr(phx_cuda_strerror_last(), "piece 2"), "which piece: %s", phx_cuda_strerror_last());
	m.dev_len = 150;
	dof[1] = -1;
	CHECK(phx_cuda_many(c, &m) == -EINVAL, "a negative GPU offset");
	dof[1] = 49;
	CHECK(phx_cuda_many(c, &m) == -EINVAL, "reads into overlapping GPU bytes");
	CHECK(strstr(phx_cuda_strerror_last(), "pieces 0 and 1 overlap"), "%s",
	      phx_cuda_strerror_last());
	/* writes from overlapping GPU bytes are fine; into overlapping file bytes not */
	m.op = PHX_OP_WRITE;
	CHECK(phx_cuda_many_check(&m) == 0, "writes from overlapping GPU bytes refused");
	fo[2] = 149;
	CHECK(phx_cuda_many(c, &m) == -EINVAL, "writes to overlapping file bytes");
	fo[2] = 150;
	len[1] = 0;			/* empty pieces overlap nothing */
	fo[1] = 0;
	CHECK(phx_cuda_many_check(&m) == 0, "an empty piece refused");
	len[0] = -5;
	CHECK(phx_cuda_many(c, &m) == -EINVAL, "a negative length");
	len[0] = 50;
	fo[0] = INT64_MAX - 10;
	CHECK(phx_cuda_many(c, &m) == -EINVAL, "a file range that wraps");
	fo[0] = 0;
	m.file_offsets = NULL;
	CHECK(phx_cuda_many(c, &m) == -EINVAL, "missing arrays");
	m.file_offsets = fo;
	m.size = 8;
	CHECK(phx_cuda_many(c, &m) == -EINVAL, "a struct too small");
	m.size = sizeof(m);
	CHECK(phx_cuda_many_async(c, &m) == -EINVAL, "stream-ordered without results");
	phx_cuda_stats_get(c, &st1, sizeof(st1));
	CHECK(st1.many_pieces == st0.many_pieces && st1.reads == st0.reads &&
	      st1.writes == st0.writes, "a refused call queued pieces: %" PRIu64 " %" PRIu64
	      " %" PRIu64, st1.many_pieces - st0.many_pieces, st1.reads - st0.reads,
	      st1.writes - st0.writes);
	m.n = 0;
	CHECK(phx_cuda_many(c, &m) == 0, "no pieces");
	phx_file_close(f);
	MemFree(buf);
}

/*
 * A piece the request checks refuse mid-way (GPU bytes past the real
 * allocation, though inside the dev_len the caller claimed): the pieces
 * before it are read, it and those after it carry the error, and the call
 * returns (the group's waiter is not left waiting for pieces never queued).
 */
static void test_refused_midway(phx_cuda *c, phx_engine *eng)
{
	enum { N = 40 };
	int64_t fo[N], dof[N], len[N], res[N], total;
	unsigned char *data = make_file("midway.bin", 1 * MiB);
	uint64_t buf;
	phx_file *f;
	size_t i, good = 0, refused = 0;

	CHECK(phx_file_open(eng, path_of("midway.bin"), O_RDONLY, 0, 0, &f) == 0, "open");
	MemAlloc(&buf, 20 * 4096);
	for (i = 0; i < N; i++) {
		fo[i] = (int64_t)(i * 5000 + 3);
		dof[i] = (int64_t)(i * 4096);
		len[i] = 4096;
	}
	total = phx_cuda_pread_many(c, f, buf, N * 4096, fo, dof, len, N, res);
	for (i = 0; i < N; i++) {
		if (i < 20 && res[i] == 4096 && !memcmp(dev(buf) + dof[i], data + fo[i], 4096))
			good++;
		if (i >= 20 && res[i] < 0)
			refused++;
	}
	CHECK(total < 0, "refused mid-way: %" PRId64, total);
	CHECK(good == 20 && refused == 20, "%zu read, %zu refused", good, refused);
	phx_file_close(f);
	MemFree(buf);
	free(data);
}

/* Thousands of small random reads: exact bytes, packed buffers, counters. */
static void test_reads(phx_cuda *c, phx_engine *eng, size_t n, uint64_t maxlen)
{
	uint64_t fsize = 16 * MiB + 333, need, buf, want = 0;
	unsigned char *data = make_file("reads.bin", fsize);
	int64_t *fo = malloc(n * 8), *dof = malloc(n * 8), *len = malloc(n * 8);
	int64_t *res = malloc(n * 8), total;
	struct phx_cuda_stats st0, st1;
	struct phx_cuda_many m;
	phx_file *f;
	size_t i, bad = 0;

	CHECK(phx_file_open(eng, path_of("reads.bin"), O_RDONLY, 0, 0, &f) == 0, "open");
	need = plan(n, maxlen, fsize, false, fo, dof, len);
	MemAlloc(&buf, need);
	memset(dev(buf), 0x5A, need);
	for (i = 0; i < n; i++)
		want += (uint64_t)len[i];
	phx_cuda_stats_get(c, &st0, sizeof(st0));
	total = phx_cuda_pread_many(c, f, buf, need, fo, dof, len, n, res);
	phx_cuda_stats_get(c, &st1, sizeof(st1));
	CHECK(total == (int64_t)want, "pread_many = %" PRId64 ", want %" PRIu64, total, want);
	for (i = 0; i < n; i++) {
		if (res[i] != len[i] || memcmp(dev(buf) + dof[i], data + fo[i], (size_t)len[i]))
			bad++;
	}
	CHECK(!bad, "%zu of %zu pieces wrong", bad, n);
	/* the gaps between pieces are untouched */
	for (i = 0, bad = 0; i < 3; i++)
		bad += dev(buf)[i] != 0x5A;
	CHECK(!bad, "bytes before the first piece written");
	CHECK(st1.many_pieces - st0.many_pieces == n, "many_pieces %" PRIu64,
	      st1.many_pieces - st0.many_pieces);
	/* packed: many pieces per staging buffer and per copy call */
	CHECK(st1.staging_fills - st0.staging_fills < n / 4, "%" PRIu64 " staging fills for %zu pieces",
	      st1.staging_fills - st0.staging_fills, n);
	/* one copy call per buffer with cuMemcpyBatchAsync; without it one per piece */
	CHECK(getenv("FAKE_CUDA_NO_BATCH") || st1.memcpy_calls - st0.memcpy_calls < n / 4,
	      "%" PRIu64 " copy calls for %zu pieces", st1.memcpy_calls - st0.memcpy_calls, n);
	/* every phase was seen */
	CHECK(st1.ph_call_ns > st0.ph_call_ns && st1.ph_pack_ns > st0.ph_pack_ns &&
	      st1.ph_submit_ns > st0.ph_submit_ns && st1.ph_io_ns > st0.ph_io_ns &&
	      st1.ph_copy_ns > st0.ph_copy_ns && st1.ph_buffers > st0.ph_buffers &&
	      st1.ph_done_ns > st0.ph_done_ns,
	      "phase counters: call %" PRIu64 " pack %" PRIu64 " submit %" PRIu64 " io %" PRIu64
	      " copy %" PRIu64 " buffers %" PRIu64, st1.ph_call_ns - st0.ph_call_ns,
	      st1.ph_pack_ns - st0.ph_pack_ns, st1.ph_submit_ns - st0.ph_submit_ns,
	      st1.ph_io_ns - st0.ph_io_ns, st1.ph_copy_ns - st0.ph_copy_ns,
	      st1.ph_buffers - st0.ph_buffers);
	CHECK(st1.ph_buffers - st0.ph_buffers == st1.staging_fills - st0.staging_fills,
	      "buffers timed %" PRIu64 " != filled %" PRIu64, st1.ph_buffers - st0.ph_buffers,
	      st1.staging_fills - st0.staging_fills);

	/* end of file: a piece across it is short, one past it 0, both exact */
	m = many(PHX_OP_READ, f, buf, need, 2, fo, dof, len, res);
	fo[0] = (int64_t)fsize - 100;
	len[0] = 1000;
	fo[1] = (int64_t)fsize + 10;
	len[1] = 10;
	dof[0] = 0;
	dof[1] = 2000;
	memset(dev(buf), 0x5A, 2100);
	total = phx_cuda_many(c, &m);
	CHECK(total == 100 && res[0] == 100 && res[1] == 0, "EOF pieces: %" PRId64 " %" PRId64
	      " %" PRId64, total, res[0], res[1]);
	CHECK(!memcmp(dev(buf), data + fsize - 100, 100) && dev(buf)[100] == 0x5A &&
	      dev(buf)[2000] == 0x5A, "EOF pieces' bytes");
	phx_file_close(f);
	MemFree(buf);
	free(data);
	free(fo);
	free(dof);
	free(len);
	free(res);
}

/* Many small random writes to disjoint file ranges: the file has them. */
static void test_writes(phx_cuda *c, phx_engine *eng, size_t n)
{
	uint64_t fsize = 8 * MiB + 91, need, buf, want = 0;
	unsigned char *data = make_file("writes.bin", fsize), *got;
	int64_t *fo = malloc(n * 8), *dof = malloc(n * 8), *len = malloc(n * 8), total;
	phx_file *f;
	size_t i;
	int fd;

	CHECK(phx_file_open(eng, path_of("writes.bin"), O_RDWR, 0, 0, &f) == 0, "open");
	need = plan(n, 40000, fsize, true, fo, dof, len);
	MemAlloc(&buf, need);
	for (i = 0; i < need; i++)
		dev(buf)[i] = (unsigned char)(rnd() >> 24);
	for (i = 0; i < n; i++) {
		memcpy(data + fo[i], dev(buf) + dof[i], (size_t)len[i]);
		want += (uint64_t)len[i];
	}
	total = phx_cuda_pwrite_many(c, f, buf, need, fo, dof, len, n, NULL);
	CHECK(total == (int64_t)want, "pwrite_many = %" PRId64 ", want %" PRIu64, total, want);
	phx_file_close(f);
	got = malloc(fsize);
	fd = open(path_of("writes.bin"), O_RDONLY);
	CHECK(pread(fd, got, fsize, 0) == (ssize_t)fsize, "read back");
	close(fd);
	CHECK(!memcmp(got, data, fsize), "file differs after pwrite_many");
	MemFree(buf);
	free(got);
	free(data);
	free(fo);
	free(dof);
	free(len);
}

/*
 * An injected error: a bad range (what a failed write leaves) inside some
 * pieces.  Those fail with -EIO, their GPU bytes stay as they were, the
 * result is the error, and the others are exact.
 */
static void test_injected_eio(phx_cuda *c, phx_engine *eng, void *s)
{
	enum { N = 400 };
	uint64_t fsize = 4 * MiB, need, buf, bad_lo = 1 * MiB + 1234, bad_len = 20000;
	unsigned char *data = make_file("eio.bin", fsize);
	int64_t fo[N], dof[N], len[N], res[N], total;
	size_t i, failed = 0, wrong = 0, touched = 0;
	phx_file *f;

	CHECK(phx_file_open(eng, path_of("eio.bin"), O_RDONLY, 0, 0, &f) == 0, "open");
	need = plan(N, 30000, fsize, false, fo, dof, len);
	fo[7] = (int64_t)bad_lo - 100;	/* at least one piece meets the bad range */
	MemAlloc(&buf, need);
	memset(dev(buf), 0x5A, need);
	inode_write_result(f->inode, bad_lo, bad_len, false);
	total = phx_cuda_pread_many(c, f, buf, need, fo, dof, len, N, res);
	for (i = 0; i < N; i++) {
		bool hit = (uint64_t)fo[i] < bad_lo + bad_len &&
			   (uint64_t)(fo[i] + len[i]) > bad_lo;

		if (hit) {
			int64_t k;

			failed += res[i] == -EIO;
			for (k = 0; k < len[i]; k++)
				touched += dev(buf)[dof[i] + k] != 0x5A;
		} else if (res[i] != len[i] || memcmp(dev(buf) + dof[i], data + fo[i], (size_t)len[i])) {
			wrong++;
		}
		if (hit && res[i] != -EIO)
			fprintf(stderr, "piece %zu over the bad range: %" PRId64 "\n", i, res[i]);
	}
	CHECK(total == -EIO, "pread_many with a bad range = %" PRId64, total);
	CHECK(failed >= 1, "no piece failed");
	CHECK(!touched, "%zu GPU bytes of failed pieces written", touched);
	CHECK(!wrong, "%zu good pieces wrong", wrong);
	/* the same through the stream-ordered call */
	{
		struct phx_cuda_many m = many(PHX_OP_READ, f, buf, need, N, fo, dof, len, res);

		memset(dev(buf), 0x5A, need);
		m.stream = s;
		CHECK(phx_cuda_many_async(c, &m) == 0, "many_async");
		StreamSynchronize(s);
		for (i = 0, failed = 0, touched = 0; i < N; i++) {
			bool hit = (uint64_t)fo[i] < bad_lo + bad_len &&
				   (uint64_t)(fo[i] + len[i]) > bad_lo;

			if (hit) {
				failed += res[i] == -EIO;
				touched += dev(buf)[dof[i]] != 0x5A;
			}
		}
		CHECK(failed >= 1 && !touched, "stream: %zu failed, %zu touched", failed, touched);
	}
	phx_file_close(f);
	MemFree(buf);
	free(data);
}

/*
 * An injected copy error: copies to the GPU places of a piece and of what
 * follows it are refused.  Those pieces fail, their places keep their old bytes, and no
 * piece reports bytes it did not deliver; the pieces packed beside them in
 * the same staging buffers and copy calls are exact.
 */
static void test_copy_error(phx_cuda *c, phx_engine *eng)
{
	enum { N = 600 };
	uint64_t fsize = 4 * MiB, need, buf;
	unsigned char *data = make_file("copyerr.bin", fsize);
	int64_t fo[N], dof[N], len[N], res[N], total;
	size_t i, failed = 0, wrong = 0, victims = 0;
	phx_file *f;

	CHECK(phx_file_open(eng, path_of("copyerr.bin"), O_RDONLY, 0, 0, &f) == 0, "open");
	need = plan(N, 12000, fsize, false, fo, dof, len);
	MemAlloc(&buf, need);
	memset(dev(buf), 0x5A, need);
	/* poison piece 100's place and the bytes just after it */
	{
		uint64_t lo = (uint64_t)dof[100], hi = (uint64_t)(dof[100] + len[100]) + 4096;

		PoisonCopies(buf + lo, buf + hi);
		for (i = 0; i < N; i++)
			victims += (uint64_t)dof[i] < hi && (uint64_t)(dof[i] + len[i]) > lo;
	}
	total = phx_cuda_pread_many(c, f, buf, need, fo, dof, len, N, res);
	PoisonCopies(0, 0);
	for (i = 0; i < N; i++) {
		if (res[i] < 0) {
			int64_t k;

			failed++;
			/* a failed piece's place may hold only the old bytes or its own */
			for (k = 0; k < len[i]; k++) {
				unsigned char b = dev(buf)[dof[i] + k];

				wrong += b != 0x5A && b != data[fo[i] + k];
			}
		} else if (res[i] != len[i] ||
			   memcmp(dev(buf) + dof[i], data + fo[i], (size_t)len[i])) {
			wrong++;
		}
	}
	CHECK(total < 0, "pread_many with refused copies = %" PRId64, total);
	CHECK(res[100] < 0, "the poisoned piece: %" PRId64, res[100]);
	CHECK(failed >= victims && failed < N / 4, "%zu failed, %zu poisoned", failed, victims);
	CHECK(!wrong, "%zu pieces wrong", wrong);
	CHECK(dev(buf)[dof[100]] == 0x5A, "a refused copy wrote");
	phx_file_close(f);
	MemFree(buf);
	free(data);
}

/*
 * Stream-ordered: pieces wait for the work queued before them, and the
 * offsets are copied at the call (changing the arrays after it changes
 * nothing); a write then a read on one stream sees the write.
 */
static void test_stream(phx_cuda *c, phx_engine *eng, void *s, size_t n)
{
	uint64_t fsize = 8 * MiB + 5, need, buf, back;
	unsigned char *data = make_file("stream.bin", fsize);
	int64_t *fo = malloc(n * 8), *dof = malloc(n * 8), *len = malloc(n * 8);
	int64_t *res = malloc(n * 8), *fo2 = malloc(n * 8), *res2 = malloc(n * 8);
	struct phx_cuda_many m;
	size_t i, bad = 0, pending = 0;
	phx_file *f;

	CHECK(phx_file_open(eng, path_of("stream.bin"), O_RDWR, 0, 0, &f) == 0, "open");
	need = plan(n, 20000, fsize / 2, true, fo, dof, len);
	MemAlloc(&buf, need);
	MemAlloc(&back, need);
	for (i = 0; i < need; i++)
		dev(buf)[i] = (unsigned char)(rnd() >> 24);
	memset(dev(back), 0x5A, need);
	/* write the pieces to the second half, then read them back, one stream */
	for (i = 0; i < n; i++)
		fo2[i] = fo[i] + (int64_t)(fsize / 2);
	SleepAsync(s, 50000);	/* the stream is busy: nothing may run before */
	m = many(PHX_OP_WRITE, f, buf, need, n, fo2, dof, len, res);
	m.stream = s;
	CHECK(phx_cuda_many_async(c, &m) == 0, "write many_async");
	m = many(PHX_OP_READ, f, back, need, n, fo2, dof, len, res2);
	m.stream = s;
	CHECK(phx_cuda_many_async(c, &m) == 0, "read many_async");
	for (i = 0; i < n; i++)
		pending += res2[i] == -EINPROGRESS;
	memset(fo2, 0, n * 8);	/* copied at the call: no effect */
	StreamSynchronize(s);
	CHECK(pending > n / 2, "only %zu of %zu reads pending behind a busy stream", pending, n);
	for (i = 0; i < n; i++)
		if (res[i] != len[i] || res2[i] != len[i] ||
		    memcmp(dev(back) + dof[i], dev(buf) + dof[i], (size_t)len[i]))
			bad++;
	CHECK(!bad, "%zu of %zu stream pieces wrong", bad, n);
	phx_file_close(f);
	MemFree(buf);
	MemFree(back);
	free(data);
	free(fo);
	free(fo2);
	free(dof);
	free(len);
	free(res);
	free(res2);
}

int main(int argc, char **argv)
{
	phx_engine *eng;
	phx_cuda *c;
	struct phx_cuda_config cfg;
	void *h, *s;

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
	*(void **)&SleepAsync = dlsym(h, "fake_sleep_async");
	*(void **)&PoisonCopies = dlsym(h, "fake_poison_copies");
	CHECK(phx_engine_create(NULL, &eng) == 0, "engine");
	phx_cuda_config_init(&cfg);
	cfg.lanes = 3;
	cfg.bufs_per_lane = 2;
	cfg.buf_size = 256 * KiB;
	cfg.max_io_size = 256 * KiB;
	if (phx_cuda_create(eng, &cfg, &c)) {
		fprintf(stderr, "phx_cuda_create: %s\n", phx_cuda_strerror_last());
		return 1;
	}
	StreamCreate(&s, 1);
	test_checks(c, eng);
	test_refused_midway(c, eng);
	test_reads(c, eng, 3000, 16 * KiB);
	test_reads(c, eng, 1000, 64 * KiB);
	test_writes(c, eng, 1500);
	test_stream(c, eng, s, 500);
	test_injected_eio(c, eng, s);
	test_copy_error(c, eng);
	CHECK(phx_cuda_destroy(c) == 0, "destroy");
	phx_engine_destroy(eng);
	if (failures) {
		fprintf(stderr, "%d failures\n", failures);
		return 1;
	}
	printf("all passed\n");
	return 0;
}
