/* SPDX-License-Identifier: Apache-2.0 */
/*
 * Description: contiguous reads submitted in one batch, which the thread
 * pool runs as one preadv2 (a "run", be_threads.c), each get exactly the
 * result they get alone, on both backends (ctest runs every program on
 * threads too): full reads the right bytes; where end of file falls inside
 * the batch, the read across it its short count and those past it 0; a
 * read whose memory cannot be written (PROT_NONE) -EFAULT while its
 * neighbours, before and after it, still read their bytes.  O_DIRECT and
 * buffered files, 4 KiB and 12 KiB requests.
 */
#include <sys/mman.h>

#include "helpers.h"

#define NREQ 24
#define PAGE 4096

/* A file of @fs random bytes read as @NREQ contiguous requests of @rl bytes
 * from 0 into @mem (request i at mem + i * rl); results checked one by one. */
static void batch_check(phx_engine *eng, uint32_t pflags, size_t fs, size_t rl,
			unsigned char *mem, int bad)
{
	const char *path = t_path("runs");
	unsigned char *data = t_random_file(path, fs);
	phx_file *f = t_open(eng, path, O_RDONLY, pflags);
	struct phx_io ios[NREQ];
	int i, ret;

	for (i = 0; i < NREQ; i++) {
		if (i != bad)
			t_fill(mem + (size_t)i * rl, rl);
		phx_io_prep(&ios[i], f, PHX_OP_READ, mem + (size_t)i * rl, rl, (uint64_t)i * rl);
	}
	ret = phx_submit_wait(eng, ios, NREQ);
	T_CHECK(ret == 0, "phx_submit_wait: %d", ret);
	for (i = 0; i < NREQ; i++) {
		uint64_t off = (uint64_t)i * rl;
		int64_t want = off >= fs ? 0 : (int64_t)(fs - off < rl ? fs - off : rl);

		if (i == bad)
			want = -EFAULT;
		T_CHECK(ios[i].result == want,
			"%s file of %zu bytes, %zu-byte reads: request %d (at %" PRIu64 ") = %" PRId64
			", expected %" PRId64, pflags ? "buffered" : "O_DIRECT", fs, rl, i, off,
			ios[i].result, want);
		if (want > 0)
			T_SAME(mem + off, data + off, (size_t)want, "request %d's bytes", i);
	}
	T_CHECK(phx_file_close(f) == 0, "close");
	unlink(path);
	free(data);
}

int main(void)
{
	static const uint32_t pflags[] = { 0, PHX_FILE_BUFFERED };
	static const size_t rls[] = { PAGE, 3 * PAGE };
	struct phx_engine_config cfg;
	size_t span = NREQ * 3 * PAGE;
	unsigned char *mem;
	phx_engine *eng;

	t_seed();
	phx_engine_config_init(&cfg);
	cfg.queue_depth = 32;
	eng = t_engine(&cfg);
	mem = mmap(NULL, span, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
	T_CHECK(mem != MAP_FAILED, "mmap: %s", strerror(errno));

	for (unsigned p = 0; p < sizeof(pflags) / sizeof(*pflags); p++) {
		for (unsigned r = 0; r < sizeof(rls) / sizeof(*rls); r++) {
			size_t rl = rls[r];
			/* end of file: past the batch, at a request's end, inside
			 * the first, a middle and the last request */
			size_t fss[] = { NREQ * rl + 5, 10 * rl, 1000, 10 * rl + 1000,
					 (NREQ - 1) * rl + 1 };

			for (unsigned k = 0; k < sizeof(fss) / sizeof(*fss); k++)
				batch_check(eng, pflags[p], fss[k], rl, mem, -1);
			/* request 7's memory unwritable: only it fails */
			T_CHECK(!mprotect(mem + 7 * rl, rl, PROT_NONE), "mprotect: %s",
				strerror(errno));
			batch_check(eng, pflags[p], NREQ * rl, rl, mem, 7);
			T_CHECK(!mprotect(mem + 7 * rl, rl, PROT_READ | PROT_WRITE), "mprotect: %s",
				strerror(errno));
		}
	}
	munmap(mem, span);
	T_CHECK(phx_engine_destroy(eng) == 0, "destroy");
	return T_EXIT_PASS;
}
