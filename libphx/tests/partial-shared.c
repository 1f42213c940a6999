/* SPDX-License-Identifier: Apache-2.0 */
/*
 * Description: writers of disjoint bytes of the same blocks, on different
 * handles of one file.  Four threads, each with its own engine and handle
 * (then: four handles on one engine), write small interleaved pieces that
 * share every block, all at once, inside the file and past its end.  Each
 * piece is a read-modify-write or a page-cache write of a shared block; if
 * they were serialised only per handle, one handle's merge would write back
 * bytes another just replaced.  The file must end up exactly as the pieces
 * say, round after round.
 */
#include <pthread.h>

#include "helpers.h"

#define WRITERS 4
#define BLOCKS 24
#define PIECES_PER_BLOCK 24
#define ROUNDS 40
#define MAXP (BLOCKS * PIECES_PER_BLOCK)

struct writer {
	phx_engine *eng;
	phx_file *f;
	pthread_barrier_t *go;
	struct phx_io ios[MAXP];
	int n;
};

static void *run(void *arg)
{
	struct writer *w = arg;

	pthread_barrier_wait(w->go);
	T_CHECK(phx_submit_wait(w->eng, w->ios, w->n) == 0, "submit");
	for (int i = 0; i < w->n; i++)
		T_CHECK(w->ios[i].result == (int64_t)w->ios[i].len,
			"piece %d (%zu @ %" PRIu64 "): %" PRId64, i, w->ios[i].len,
			w->ios[i].offset, w->ios[i].result);
	return NULL;
}

int main(void)
{
	static struct writer ws[WRITERS];
	phx_engine *engs[WRITERS];
	const char *path;
	unsigned char *model, *got, *data;
	uint64_t size, cap = (BLOCKS + 8) * 4096;
	pthread_barrier_t go;

	t_seed();
	path = t_path("shared");
	size = 9 * 4096 + t_range(1, 4095);
	model = calloc(1, cap);
	got = t_alloc(cap, 4096);
	/* piece data lives at odd addresses: every piece goes through a bounce */
	data = malloc(cap * 2 + 1);
	memcpy(model, t_random_file(path, size), size);
	for (int shared = 0; shared < 2; shared++) {
		for (int w = 0; w < WRITERS; w++) {
			engs[w] = shared && w ? engs[0] : t_engine(NULL);
			ws[w].eng = engs[w];
			ws[w].f = t_open(engs[w], path, O_RDWR, 0);
			ws[w].go = &go;
		}
		for (int r = 0; r < ROUNDS; r++) {
			/* this round reaches a few blocks past the current end */
			uint64_t start = r % 2 ? 0 : (size - size % 4096) - (size > 4096 ? 4096 : 0);
			uint64_t end = size + t_range(1, 3 * 4096);
			uint64_t cut[MAXP + 1], pos = 1;
			int np = 0;

			if (end > cap)
				end = cap;
			/* cut [start, end) into pieces of 1..~2*len/MAXP bytes */
			cut[0] = start;
			while (pos < MAXP && cut[pos - 1] < end) {
				uint64_t step = t_range(1, 2 * (end - start) / MAXP + 2);

				cut[pos] = cut[pos - 1] + step < end ? cut[pos - 1] + step : end;
				pos++;
			}
			if (cut[pos - 1] < end)
				cut[pos++] = end;
			t_fill(data, cap * 2 + 1);
			for (int w = 0; w < WRITERS; w++)
				ws[w].n = 0;
			for (uint64_t i = 0; i + 1 < pos; i++, np++) {
				struct writer *w = &ws[np % WRITERS];
				uint64_t off = cut[i], len = cut[i + 1] - cut[i];
				unsigned char *src = data + 1 + off * 2 % cap;

				phx_io_prep(&w->ios[w->n++], w->f, PHX_OP_WRITE, src, len, off);
				memcpy(model + off, src, len);
			}
			pthread_barrier_init(&go, NULL, WRITERS);
			{
				pthread_t th[WRITERS];

				for (int w = 0; w < WRITERS; w++)
					pthread_create(&th[w], NULL, run, &ws[w]);
				for (int w = 0; w < WRITERS; w++)
					pthread_join(th[w], NULL);
			}
			pthread_barrier_destroy(&go);
			if (end > size)
				size = end;
			T_CHECK(t_file_size(path) == size, "%s engines, round %d: size %" PRIu64
				", expected %" PRIu64, shared ? "shared" : "own", r,
				t_file_size(path), size);
			memset(got, 0, cap);
			T_CHECK(t_pread(path, got, size, 0) == size, "read back");
			T_SAME(got, model, size, "%s engines, round %d", shared ? "shared" : "own", r);
		}
		for (int w = 0; w < WRITERS; w++)
			T_CHECK(phx_file_close(ws[w].f) == 0, "close");
		for (int w = 0; w < (shared ? 1 : WRITERS); w++)
			phx_engine_destroy(engs[w]);
	}
	free(model);
	free(data);
	t_cleanup();
	return T_EXIT_PASS;
}
