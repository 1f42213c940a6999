/* SPDX-License-Identifier: Apache-2.0 */
/*
 * Description: concurrent writes that extend a file.  One batch (and, again,
 * async requests) of 200 non-overlapping unaligned writes past the end of an
 * empty file: the file ends up exactly as long as the furthest write, every
 * write's bytes are there and the gaps are zeros - as if each had been a
 * pwrite(2).  Also neighbouring writes that share a block, repeated with
 * several strides (the failure this catches is a race: it does not show
 * every run).
 */
#include "helpers.h"

#define N 200

static void check(const char *path, struct phx_io *ios, int n, uint64_t end, const char *what)
{
	unsigned char *got = t_alloc(end + 1, 64), *exp = calloc(1, end + 1);
	uint64_t size = t_file_size(path);

	for (int i = 0; i < n; i++)
		memcpy(exp + ios[i].offset, ios[i].buf, ios[i].len);
	T_CHECK(size == end, "%s: file size %" PRIu64 ", expected %" PRIu64, what, size, end);
	T_CHECK(t_pread(path, got, end, 0) == end, "ref");
	for (int i = 0; i < n; i++)
		T_SAME(got + ios[i].offset, ios[i].buf, ios[i].len, "%s: write %d (%zu @ %" PRIu64 ")",
		       what, i, ios[i].len, ios[i].offset);
	T_SAME(got, exp, end, "%s: gaps", what);
	free(got); free(exp);
}

int main(void)
{
	phx_engine *eng;
	phx_file *f;
	const char *path;
	struct phx_io ios[N], *ptrs[N];
	unsigned char *bufs[N];
	uint64_t end = 0;

	t_seed();
	path = t_path("extend");
	eng = t_engine(NULL);

	/* round 0: one batch; 1: async; 2..: strides that share blocks */
	for (int round = 0; round < 12; round++) {
		static const uint64_t strides[] = { 10007, 10007, 700, 300, 1500, 4100 };
		uint64_t stride = strides[round < 6 ? round : 2 + round % 4];

		t_write_file(path, "", 0);
		f = t_open(eng, path, O_RDWR, 0);
		end = 0;
		for (int i = 0; i < N; i++) {
			size_t len = t_range(1, stride - 8);
			uint64_t off = i * stride + t_range(0, stride - len);

			bufs[i] = t_alloc(len, 64);
			t_fill(bufs[i], len);
			phx_io_prep(&ios[i], f, PHX_OP_WRITE, bufs[i], len, off);
			ptrs[i] = &ios[i];
			if (off + len > end)
				end = off + len;
		}
		if (round == 1) {
			T_CHECK(phx_submit(eng, ptrs, N) == 0, "submit");
			for (int i = 0; i < N; i++)
				T_CHECK(phx_wait(eng, &ios[i], -1) == 0, "wait");
		} else {
			T_CHECK(phx_submit_wait(eng, ios, N) == 0, "submit_wait");
		}
		for (int i = 0; i < N; i++)
			T_CHECK(ios[i].result == (int64_t)ios[i].len, "write %d = %" PRId64, i, ios[i].result);
		if (round == 1) {
			struct phx_io *done[N];

			while (phx_poll(eng, done, N) > 0)
				;
		}
		T_CHECK(phx_file_close(f) == 0, "close");
		check(path, ios, N, end, round == 0 ? "batch" : round == 1 ? "async" : "shared blocks (batch)");
		for (int i = 0; i < N; i++)
			free(bufs[i]);
	}
	T_CHECK(phx_engine_destroy(eng) == 0, "destroy");
	return T_EXIT_PASS;
}
