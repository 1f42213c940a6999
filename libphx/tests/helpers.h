/* SPDX-License-Identifier: Apache-2.0 */
/*
 * helpers.h - what every libphx test program shares (header-only, so that
 * each tests/NAME.c stays one standalone program).
 *
 * Exit codes: T_EXIT_PASS 0, T_EXIT_FAIL 1, T_EXIT_SKIP 77 (ctest treats 77
 * as "skipped").  Test files go to $PHX_TEST_DIR, else the current directory
 * (ctest runs in the build tree, on the real disk), and are removed at exit.
 * Data is random (never zeros); $PHX_TEST_SEED replays a run.
 */
#ifndef PHX_TEST_HELPERS_H
#define PHX_TEST_HELPERS_H

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <time.h>
#include <unistd.h>

#include "phx.h"

#define T_EXIT_PASS 0
#define T_EXIT_FAIL 1
#define T_EXIT_SKIP 77

#define KiB (1024ull)
#define MiB (1024ull * 1024ull)

/* Fail the test (print where and why) unless @cond holds. */
#define T_CHECK(cond, ...)                                                   \
	do {                                                                 \
		if (!(cond)) {                                               \
			fprintf(stderr, "%s:%d: check failed: %s: ", __FILE__, \
				__LINE__, #cond);                            \
			fprintf(stderr, __VA_ARGS__);                        \
			fprintf(stderr, " (last phx error: %s)\n",           \
				phx_strerror_last());                        \
			t_cleanup();                                         \
			exit(T_EXIT_FAIL);                                   \
		}                                                            \
	} while (0)

#define T_SKIP(...)                                                          \
	do {                                                                 \
		fprintf(stderr, "skip: ");                                   \
		fprintf(stderr, __VA_ARGS__);                                \
		fprintf(stderr, "\n");                                       \
		t_cleanup();                                                 \
		exit(T_EXIT_SKIP);                                           \
	} while (0)

/* ---- files removed at exit ---- */

#define T_MAX_FILES 64
static char t_files[T_MAX_FILES][512];
static int t_nfiles;

static inline void t_cleanup(void)
{
	for (int i = 0; i < t_nfiles; i++)
		if (t_files[i][0])
			unlink(t_files[i]);
	t_nfiles = 0;
}

/* A fresh path in the test directory; removed by t_cleanup(). */
static inline const char *t_path(const char *tag)
{
	const char *dir = getenv("PHX_TEST_DIR");
	static unsigned seq;
	char *p;

	if (t_nfiles == 0)
		atexit(t_cleanup);
	if (t_nfiles >= T_MAX_FILES) {
		fprintf(stderr, "too many test files\n");
		exit(T_EXIT_FAIL);
	}
	p = t_files[t_nfiles++];
	snprintf(p, sizeof(t_files[0]), "%s/.phx-test-%s-%d-%u",
		 dir && *dir ? dir : ".", tag, (int)getpid(), seq++);
	unlink(p);
	return p;
}

/* ---- random data ---- */

static uint64_t t_rng_state;

static inline uint64_t t_rand(void)
{
	uint64_t x = t_rng_state;

	x ^= x << 13;
	x ^= x >> 7;
	x ^= x << 17;
	return t_rng_state = x;
}

static inline void t_seed(void)
{
	const char *s = getenv("PHX_TEST_SEED");
	struct timespec ts;

	if (s && *s) {
		t_rng_state = strtoull(s, NULL, 0);
	} else {
		clock_gettime(CLOCK_REALTIME, &ts);
		t_rng_state = (uint64_t)ts.tv_nsec * 0x9E3779B97F4A7C15ull ^
			      (uint64_t)getpid() << 32 ^ (uint64_t)ts.tv_sec;
	}
	if (!t_rng_state)
		t_rng_state = 0x1234567887654321ull;
	fprintf(stderr, "seed: PHX_TEST_SEED=%" PRIu64 "\n", t_rng_state);
}

/* A number in [lo, hi]. */
static inline uint64_t t_range(uint64_t lo, uint64_t hi)
{
	return lo + t_rand() % (hi - lo + 1);
}

/* Fill with random bytes; never leaves a zero byte (so zeros mean "not written"). */
static inline void t_fill(void *buf, size_t n)
{
	unsigned char *p = buf;
	size_t i = 0;

	while (i < n) {
		uint64_t r = t_rand();

		for (int k = 0; k < 8 && i < n; k++, i++) {
			unsigned char c = (unsigned char)(r >> (8 * k));

			p[i] = c ? c : 0xA5;
		}
	}
}

/* Index of the first difference, or -1. */
static inline long t_memdiff(const void *a, const void *b, size_t n)
{
	const unsigned char *x = a, *y = b;

	if (!memcmp(a, b, n))
		return -1;
	for (size_t i = 0; i < n; i++)
		if (x[i] != y[i])
			return (long)i;
	return -1;
}

#define T_SAME(got, exp, n, ...)                                             \
	do {                                                                 \
		long _d = t_memdiff((got), (exp), (n));                      \
		if (_d >= 0) {                                               \
			fprintf(stderr, "%s:%d: bytes differ at %ld of %zu "  \
				"(got %02x expected %02x): ", __FILE__,      \
				__LINE__, _d, (size_t)(n),                   \
				((const unsigned char *)(got))[_d],          \
				((const unsigned char *)(exp))[_d]);         \
			fprintf(stderr, __VA_ARGS__);                        \
			fprintf(stderr, "\n");                               \
			t_cleanup();                                         \
			exit(T_EXIT_FAIL);                                   \
		}                                                            \
	} while (0)

/* ---- memory ---- */

static inline void *t_alloc(size_t n, size_t align)
{
	void *p = NULL;

	if (posix_memalign(&p, align, n ? n : 1)) {
		fprintf(stderr, "posix_memalign(%zu) failed\n", n);
		exit(T_EXIT_FAIL);
	}
	return p;
}

/* ---- plain POSIX helpers (the reference) ---- */

static inline void t_write_file(const char *path, const void *data, size_t n)
{
	int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC, 0644);
	size_t off = 0;

	if (fd < 0) {
		fprintf(stderr, "open %s: %s\n", path, strerror(errno));
		exit(T_EXIT_FAIL);
	}
	while (off < n) {
		ssize_t r = pwrite(fd, (const char *)data + off, n - off, off);

		if (r <= 0) {
			fprintf(stderr, "pwrite %s: %s\n", path, strerror(errno));
			exit(T_EXIT_FAIL);
		}
		off += r;
	}
	close(fd);
}

/* Read up to n bytes at off with plain pread; returns bytes read. */
static inline size_t t_pread(const char *path, void *buf, size_t n, uint64_t off)
{
	int fd = open(path, O_RDONLY);
	size_t got = 0;

	if (fd < 0) {
		fprintf(stderr, "open %s: %s\n", path, strerror(errno));
		exit(T_EXIT_FAIL);
	}
	while (got < n) {
		ssize_t r = pread(fd, (char *)buf + got, n - got, off + got);

		if (r < 0) {
			fprintf(stderr, "pread %s: %s\n", path, strerror(errno));
			exit(T_EXIT_FAIL);
		}
		if (!r)
			break;
		got += r;
	}
	close(fd);
	return got;
}

static inline uint64_t t_file_size(const char *path)
{
	struct stat st;

	if (stat(path, &st)) {
		fprintf(stderr, "stat %s: %s\n", path, strerror(errno));
		exit(T_EXIT_FAIL);
	}
	return (uint64_t)st.st_size;
}

/* A file of n random bytes; returns its contents (malloc'ed). */
static inline unsigned char *t_random_file(const char *path, size_t n)
{
	unsigned char *d = t_alloc(n, 64);

	t_fill(d, n);
	t_write_file(path, d, n);
	return d;
}

/* ---- engines ---- */

/* Create an engine or skip when io_uring is unavailable here. */
static inline phx_engine *t_engine(const struct phx_engine_config *cfg)
{
	phx_engine *eng = NULL;
	int ret = phx_engine_create(cfg, &eng);

	if (ret == -ENOSYS || ret == -EPERM)
		T_SKIP("io_uring unavailable: %s", phx_strerror_last());
	T_CHECK(ret == 0 && eng, "phx_engine_create: %d", ret);
	return eng;
}

static inline phx_file *t_open(phx_engine *eng, const char *path, int flags, uint32_t pflags)
{
	phx_file *f = NULL;
	int ret = phx_file_open(eng, path, flags, 0644, pflags, &f);

	T_CHECK(ret == 0 && f, "phx_file_open(%s): %d", path, ret);
	return f;
}

#endif /* PHX_TEST_HELPERS_H */
