/* SPDX-License-Identifier: Apache-2.0 */
/*
 * Description: phx_pread/phx_pwrite byte for byte against pread/pwrite on
 * random data: sizes 1, 4095, 4096, 4097, 1 MiB + 7 at file offsets 0, 1,
 * 511, 4095, 4096, 4097 and a large odd one, memory at +0/+1/+7 from a page.
 * Reads leave memory around the buffer alone; writes into existing data
 * leave the neighbouring bytes intact (read-modify-write); both with the
 * default engine and one with tiny bounce buffers and chunks.
 */
#include "helpers.h"

static const size_t sizes[] = { 1, 4095, 4096, 4097, (1 << 20) + 7 };
static const uint64_t offsets[] = { 0, 1, 511, 4095, 4096, 4097, 123456789 };
static const size_t mis[] = { 0, 1, 7 };
#define PAD 8192

static void one(phx_engine *eng, const char *path, size_t len, uint64_t off, size_t m)
{
	uint64_t start = off > PAD ? off - PAD : 0, end = off + len + PAD;
	size_t span = end - start;
	unsigned char *before = t_alloc(span, 64), *after = t_alloc(span, 64);
	unsigned char *whole = t_alloc(len + m + 4096, 4096), *canary = t_alloc(len + m + 4096, 64);
	unsigned char *exp = t_alloc(len, 64), *neu = t_alloc(len, 64);
	int fd;
	phx_file *f;
	int64_t n;

	/* sparse file, random around the region */
	fd = open(path, O_RDWR | O_CREAT | O_TRUNC, 0644);
	T_CHECK(fd >= 0, "open");
	T_CHECK(ftruncate(fd, end) == 0, "ftruncate");
	t_fill(before, span);
	T_CHECK(pwrite(fd, before, span, start) == (ssize_t)span, "pwrite");
	close(fd);

	/* read */
	t_fill(canary, len + m + 4096);
	memcpy(whole, canary, len + m + 4096);
	f = t_open(eng, path, O_RDWR, 0);
	n = phx_pread(f, whole + m, len, off);
	T_CHECK(n == (int64_t)len, "pread(%zu @ %" PRIu64 " +%zu) = %" PRId64, len, off, m, n);
	T_CHECK(t_pread(path, exp, len, off) == len, "ref pread");
	T_SAME(whole + m, exp, len, "pread(%zu @ %" PRIu64 " +%zu)", len, off, m);
	T_SAME(whole, canary, m, "memory before the buffer (%zu @ %" PRIu64 ")", len, off);
	T_SAME(whole + m + len, canary + m + len, 4096, "memory after the buffer (%zu @ %" PRIu64 ")", len, off);

	/* write into the middle of existing data */
	t_fill(neu, len);
	memcpy(whole + m, neu, len);
	n = phx_pwrite(f, whole + m, len, off);
	T_CHECK(n == (int64_t)len, "pwrite(%zu @ %" PRIu64 " +%zu) = %" PRId64, len, off, m, n);
	T_CHECK(phx_file_close(f) == 0, "close");
	T_CHECK(t_file_size(path) == end, "size changed by an in-place write: %" PRIu64,
		t_file_size(path));
	T_CHECK(t_pread(path, after, span, start) == span, "ref read back");
	memcpy(before + (off - start), neu, len);
	T_SAME(after, before, span, "file after pwrite(%zu @ %" PRIu64 " +%zu)", len, off, m);
	T_SAME(whole + m, neu, len, "source buffer modified");

	free(before); free(after); free(whole); free(canary); free(exp); free(neu);
}

int main(void)
{
	struct phx_engine_config cfg;
	phx_engine *engs[2];
	const char *path;

	t_seed();
	path = t_path("rw");
	engs[0] = t_engine(NULL);
	phx_engine_config_init(&cfg);
	cfg.queue_depth = 2;
	cfg.max_io_size = 8192;
	cfg.bounce_size = 8192;
	cfg.bounce_count = 1;
	engs[1] = t_engine(&cfg);

	for (int e = 0; e < 2; e++)
		for (unsigned i = 0; i < sizeof(sizes) / sizeof(*sizes); i++)
			for (unsigned j = 0; j < sizeof(offsets) / sizeof(*offsets); j++)
				for (unsigned k = 0; k < sizeof(mis) / sizeof(*mis); k++)
					one(engs[e], path, sizes[i], offsets[j], mis[k]);

	T_CHECK(phx_engine_destroy(engs[0]) == 0, "destroy");
	T_CHECK(phx_engine_destroy(engs[1]) == 0, "destroy");
	return T_EXIT_PASS;
}
