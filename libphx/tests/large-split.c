/* SPDX-License-Identifier: Apache-2.0 */
/*
 * Description: 64 MiB requests, aligned and unaligned, read and write,
 * through the default engine, and 8 MiB ones through one with 4 KiB chunks, queue depth
 * 2 and a single 4 KiB bounce buffer (thousands of chunks, bounce buffer
 * reuse); bytes match pread/pwrite and nothing outside the buffer changes.
 */
#include "helpers.h"

#define SZ (64 * MiB)

static void run(phx_engine *eng, const char *path, unsigned char *file, uint64_t off, size_t m,
		size_t sz)
{
	unsigned char *buf = t_alloc(sz + 8192, 4096), *canary = t_alloc(8192, 64);
	unsigned char *chk = t_alloc(sz + 8192, 64);
	phx_file *f = t_open(eng, path, O_RDWR, 0);
	int64_t n;

	t_fill(canary, 8192);
	memcpy(buf, canary, m);
	memcpy(buf + m + sz, canary, 4096);
	n = phx_pread(f, buf + m, sz, off);
	T_CHECK(n == (int64_t)sz, "read %zu @ %" PRIu64 " +%zu = %" PRId64, sz, off, m, n);
	T_SAME(buf + m, file + off, sz, "%zu-byte read @ %" PRIu64 " +%zu", sz, off, m);
	T_SAME(buf, canary, m, "before buffer");
	T_SAME(buf + m + sz, canary, 4096, "after buffer");

	t_fill(buf + m, sz);
	n = phx_pwrite(f, buf + m, sz, off);
	T_CHECK(n == (int64_t)sz, "write %zu = %" PRId64, sz, n);
	memcpy(file + off, buf + m, sz);
	T_CHECK(phx_file_close(f) == 0, "close");
	T_CHECK(t_pread(path, chk, sz + 8192, 0) == sz + 8192, "ref");
	T_SAME(chk, file, sz + 8192, "file after %zu-byte write @ %" PRIu64 " +%zu", sz, off, m);
	free(buf); free(canary); free(chk);
}

int main(void)
{
	struct phx_engine_config cfg;
	phx_engine *eng, *tiny;
	const char *path;
	unsigned char *file;

	t_seed();
	path = t_path("large");
	file = t_random_file(path, SZ + 8192);
	eng = t_engine(NULL);
	phx_engine_config_init(&cfg);
	cfg.queue_depth = 2;
	cfg.max_io_size = 4096;
	cfg.bounce_size = 4096;
	cfg.bounce_count = 1;
	tiny = t_engine(&cfg);

	run(eng, path, file, 0, 0, SZ);
	run(eng, path, file, 4097, 0, SZ);
	run(eng, path, file, 4096, 3, SZ);
	run(tiny, path, file, 0, 0, 8 * MiB);
	run(tiny, path, file, 511, 9, 8 * MiB);

	T_CHECK(phx_engine_destroy(tiny) == 0, "destroy");
	T_CHECK(phx_engine_destroy(eng) == 0, "destroy");
	free(file);
	return T_EXIT_PASS;
}
