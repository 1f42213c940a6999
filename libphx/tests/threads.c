/* SPDX-License-Identifier: Apache-2.0 */
/*
 * Description: 8 threads x 200 requests on one engine (and again with one
 * engine per thread): sync reads, batches and async submits with phx_wait,
 * random sizes and offsets, each thread also writing its own region of the
 * file; every read checked, the final file checked against a model.
 */
#include <pthread.h>

#include "helpers.h"

#define NT 8
#define NR 200
#define FSIZE (8 * MiB)
#define RO_END (FSIZE / 2)	/* reads are checked below this; writes go above */

static unsigned char *data, *model;
static const char *path;
static phx_engine *shared;
static int per_thread;

struct targ {
	int id;
	uint64_t seed;
	int failed;
	char why[256];
};

static uint64_t rnd(uint64_t *s)
{
	*s ^= *s << 13;
	*s ^= *s >> 7;
	*s ^= *s << 17;
	return *s;
}

#define TFAIL(...) do { snprintf(a->why, sizeof(a->why), __VA_ARGS__); a->failed = 1; goto out; } while (0)

static void *worker(void *p)
{
	struct targ *a = p;
	uint64_t s = a->seed;
	phx_engine *eng = shared;
	phx_file *f = NULL;
	uint64_t wlo = RO_END + (uint64_t)a->id * ((FSIZE - RO_END) / NT);
	uint64_t slot = ((FSIZE - RO_END) / NT) / NR;
	unsigned char *buf = t_alloc(70000, 4096);

	if (per_thread && phx_engine_create(NULL, &eng))
		TFAIL("engine create");
	if (phx_file_open(eng, path, O_RDWR, 0, 0, &f))
		TFAIL("open: %s", phx_strerror_last());
	for (int i = 0; i < NR; i++) {
		size_t len = 1 + rnd(&s) % 65536;
		uint64_t off = rnd(&s) % RO_END;
		size_t m = rnd(&s) % 2 ? 0 : rnd(&s) % 64;
		size_t want = off + len > RO_END ? RO_END - off : len;
		int64_t n;

		switch (i % 4) {
		case 0:	/* sync read */
			n = phx_pread(f, buf + m, want, off);
			if (n != (int64_t)want)
				TFAIL("pread %zu @ %" PRIu64 " = %" PRId64, want, off, n);
			break;
		case 1: {	/* async + wait */
			struct phx_io io, *pp = &io;

			phx_io_prep(&io, f, PHX_OP_READ, buf + m, want, off);
			io.flags = PHX_IO_NO_POLL;
			if (phx_submit(eng, &pp, 1) || phx_wait(eng, &io, -1) || io.result != (int64_t)want)
				TFAIL("async read %zu @ %" PRIu64 " = %" PRId64, want, off, io.result);
			break;
		}
		case 2: {	/* batch of one read */
			struct phx_io io;

			phx_io_prep(&io, f, PHX_OP_READ, buf + m, want, off);
			if (phx_submit_wait(eng, &io, 1) || io.result != (int64_t)want)
				TFAIL("batch read = %" PRId64, io.result);
			break;
		}
		default: {	/* write into this thread's own slot */
			uint64_t woff = wlo + (uint64_t)i * slot;
			size_t wlen = 1 + rnd(&s) % slot;

			for (size_t k = 0; k < wlen; k++)
				buf[m + k] = (unsigned char)(rnd(&s) | 1);
			memcpy(model + woff, buf + m, wlen);
			n = phx_pwrite(f, buf + m, wlen, woff);
			if (n != (int64_t)wlen)
				TFAIL("pwrite %zu @ %" PRIu64 " = %" PRId64, wlen, woff, n);
			continue;
		}
		}
		if (memcmp(buf + m, data + off, want))
			TFAIL("bytes differ: %zu @ %" PRIu64 " (op %d)", want, off, i % 4);
	}
out:
	if (f)
		phx_file_close(f);
	if (per_thread && eng)
		phx_engine_destroy(eng);
	free(buf);
	return NULL;
}

int main(void)
{
	pthread_t th[NT];
	struct targ args[NT];
	unsigned char *got;

	t_seed();
	path = t_path("threads");
	data = t_random_file(path, FSIZE);
	model = t_alloc(FSIZE, 64);
	memcpy(model, data, FSIZE);
	got = t_alloc(FSIZE, 64);

	for (per_thread = 0; per_thread < 2; per_thread++) {
		shared = per_thread ? NULL : t_engine(NULL);
		for (int i = 0; i < NT; i++) {
			args[i] = (struct targ){ .id = i, .seed = t_rand() | 1 };
			T_CHECK(pthread_create(&th[i], NULL, worker, &args[i]) == 0, "pthread_create");
		}
		for (int i = 0; i < NT; i++)
			pthread_join(th[i], NULL);
		for (int i = 0; i < NT; i++)
			T_CHECK(!args[i].failed, "thread %d (%s engine): %s", i,
				per_thread ? "own" : "shared", args[i].why);
		if (shared)
			T_CHECK(phx_engine_destroy(shared) == 0, "destroy");
		T_CHECK(t_pread(path, got, FSIZE, 0) == FSIZE, "ref");
		T_SAME(got, model, FSIZE, "file after concurrent writes (%s engine)",
		       per_thread ? "own" : "shared");
	}
	free(got); free(model); free(data);
	return T_EXIT_PASS;
}
