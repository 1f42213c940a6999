/* SPDX-License-Identifier: Apache-2.0 */
/*
 * Description: phx_submit_wait with 1000 small requests of random sizes and
 * offsets (aligned and not, some across or past EOF): each io->result is
 * what pread/pwrite would have returned and the bytes match; a batch larger
 * than the queue depth and the bounce pool; a batch refused as a whole
 * (NULL, bad op) leaves nothing in flight.
 */
#include "helpers.h"

#define N 1000
#define FSIZE (8 * MiB + 5)

static uint64_t rand_off(uint64_t hi)
{
	switch (t_rand() % 3) {
	case 0: return t_range(0, hi / 4096) * 4096;
	case 1: return t_range(0, hi / 512) * 512 + 1;
	default: return t_range(0, hi);
	}
}

static size_t rand_len(void)
{
	static const size_t l[] = { 1, 2, 511, 512, 4095, 4096, 4097, 8192 };

	return t_rand() % 2 ? l[t_rand() % 8] : t_range(1, 16384);
}

static void reads(phx_engine *eng, const char *path, const unsigned char *data)
{
	struct phx_io *ios = calloc(N, sizeof(*ios));
	unsigned char **bufs = calloc(N, sizeof(*bufs));
	phx_file *f = t_open(eng, path, O_RDONLY, 0);

	for (int i = 0; i < N; i++) {
		size_t len = rand_len();
		uint64_t off = rand_off(FSIZE + 8192);

		bufs[i] = t_alloc(len + 7, 4096);
		t_fill(bufs[i], len + 7);
		phx_io_prep(&ios[i], f, PHX_OP_READ, bufs[i] + (t_rand() % 2 ? 7 : 0), len, off);
		ios[i].user_data = bufs[i];
	}
	T_CHECK(phx_submit_wait(eng, ios, N) == 0, "submit_wait");
	for (int i = 0; i < N; i++) {
		uint64_t off = ios[i].offset;
		size_t want = off >= FSIZE ? 0 : (FSIZE - off < ios[i].len ? FSIZE - off : ios[i].len);

		T_CHECK(ios[i].done, "request %d not done", i);
		T_CHECK(ios[i].user_data == bufs[i], "user_data changed");
		T_CHECK(ios[i].result == (int64_t)want, "request %d: %zu @ %" PRIu64 " -> %" PRId64
			" expected %zu", i, ios[i].len, off, ios[i].result, want);
		T_SAME(ios[i].buf, data + off, want, "request %d", i);
		if (want)
			T_CHECK(ios[i].paths != 0, "request %d: no path recorded", i);
		free(bufs[i]);
	}
	T_CHECK(phx_file_close(f) == 0, "close");
	free(ios);
	free(bufs);
}

static void writes(phx_engine *eng, const char *path, unsigned char *model)
{
	struct phx_io *ios = calloc(N, sizeof(*ios));
	unsigned char **bufs = calloc(N, sizeof(*bufs));
	uint64_t slot = FSIZE / N;
	phx_file *f = t_open(eng, path, O_RDWR, 0);
	unsigned char *got = t_alloc(FSIZE, 64);

	/* non-overlapping extents inside the file, submitted in shuffled order */
	for (int i = 0; i < N; i++) {
		int j = (int)((i * 7919u) % N);	/* a permutation of 0..N-1 */
		size_t len = t_range(1, slot < 16384 ? slot : 16384);
		uint64_t off = j * slot + t_range(0, slot - len);

		bufs[i] = t_alloc(len + 3, 4096);
		t_fill(bufs[i], len + 3);
		phx_io_prep(&ios[i], f, PHX_OP_WRITE, bufs[i] + (i % 2 ? 3 : 0), len, off);
		memcpy(model + off, ios[i].buf, len);
	}
	T_CHECK(phx_submit_wait(eng, ios, N) == 0, "submit_wait");
	for (int i = 0; i < N; i++) {
		T_CHECK(ios[i].done && ios[i].result == (int64_t)ios[i].len,
			"write %d: %" PRId64 " of %zu", i, ios[i].result, ios[i].len);
		free(bufs[i]);
	}
	T_CHECK(phx_file_close(f) == 0, "close");
	T_CHECK(t_file_size(path) == FSIZE, "size changed: %" PRIu64, t_file_size(path));
	T_CHECK(t_pread(path, got, FSIZE, 0) == FSIZE, "ref read");
	T_SAME(got, model, FSIZE, "file after the write batch");
	free(got);
	free(ios);
	free(bufs);
}

int main(void)
{
	struct phx_engine_config cfg;
	phx_engine *eng, *small;
	const char *path;
	unsigned char *data;

	t_seed();
	path = t_path("batch");
	data = t_random_file(path, FSIZE);
	eng = t_engine(NULL);
	phx_engine_config_init(&cfg);
	cfg.queue_depth = 4;
	cfg.bounce_count = 1;
	cfg.bounce_size = 4096;
	cfg.max_io_size = 8192;
	small = t_engine(&cfg);

	reads(eng, path, data);
	reads(small, path, data);
	writes(eng, path, data);
	writes(small, path, data);

	/* refused batches */
	{
		struct phx_io io[2];
		unsigned char b[64];
		phx_file *f = t_open(eng, path, O_RDONLY, 0);
		int ret;

		T_CHECK(phx_submit_wait(eng, NULL, 1) == -EINVAL, "NULL ios");
		T_CHECK(phx_submit_wait(eng, io, 0) == 0, "empty batch");
		phx_io_prep(&io[0], f, PHX_OP_READ, b, 64, 0);
		phx_io_prep(&io[1], f, PHX_OP_READ, b, 64, 0);
		io[1].op = 7;
		ret = phx_submit_wait(eng, io, 2);
		T_CHECK(ret == -EINVAL || (ret == 0 && io[1].result == -EINVAL),
			"bad op: ret %d result %" PRId64, ret, io[1].result);
		phx_io_prep(&io[0], f, PHX_OP_READ, b, 64, 0);
		phx_io_prep(&io[1], NULL, PHX_OP_READ, b, 64, 0);
		ret = phx_submit_wait(eng, io, 2);
		T_CHECK(ret == -EINVAL || ret == -EBADF || (ret == 0 && io[1].result < 0),
			"NULL file: ret %d", ret);
		/* nothing may be left in flight: close succeeds */
		T_CHECK(phx_file_close(f) == 0, "close after refused batches: %s", phx_strerror_last());
	}

	T_CHECK(phx_engine_destroy(small) == 0, "destroy");
	T_CHECK(phx_engine_destroy(eng) == 0, "destroy");
	free(data);
	return T_EXIT_PASS;
}
