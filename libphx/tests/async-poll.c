/* SPDX-License-Identifier: Apache-2.0 */
/*
 * Description: asynchronous requests with phx_submit, completion observed
 * by waiting on phx_engine_eventfd() and calling phx_poll(): every request
 * is handed back exactly once with user_data untouched and the right bytes;
 * more requests than the queue depth; requests flagged PHX_IO_NO_POLL are
 * waited on with phx_wait and never handed back by phx_poll.
 */
#include <poll.h>

#include "helpers.h"

#define N 500
#define FSIZE (4 * MiB + 3)

int main(void)
{
	struct phx_engine_config cfg;
	phx_engine *eng;
	const char *path;
	unsigned char *data;
	struct phx_io *ios = calloc(N, sizeof(*ios));
	struct phx_io **ptrs = calloc(N, sizeof(*ptrs));
	unsigned char *seen = calloc(N, 1);
	unsigned char **bufs = calloc(N, sizeof(*bufs));
	phx_file *f;
	int efd, got = 0, loops = 0;

	t_seed();
	path = t_path("async");
	data = t_random_file(path, FSIZE);
	phx_engine_config_init(&cfg);
	cfg.queue_depth = 16;
	eng = t_engine(&cfg);
	f = t_open(eng, path, O_RDONLY, 0);
	efd = phx_engine_eventfd(eng);
	T_CHECK(efd >= 0, "eventfd %d", efd);

	for (int i = 0; i < N; i++) {
		size_t len = t_range(1, 70000);
		uint64_t off = t_range(0, FSIZE);

		bufs[i] = t_alloc(len, 4096);
		t_fill(bufs[i], len);
		phx_io_prep(&ios[i], f, PHX_OP_READ, bufs[i], len, off);
		ios[i].user_data = (void *)(uintptr_t)(i + 1);
		ptrs[i] = &ios[i];
	}
	/* submit in several calls */
	T_CHECK(phx_submit(eng, ptrs, 100) == 0, "submit");
	T_CHECK(phx_submit(eng, ptrs + 100, N - 100) == 0, "submit");

	while (got < N) {
		struct pollfd pfd = { .fd = efd, .events = POLLIN };
		struct phx_io *done[64];
		uint64_t v;
		int n, r;

		T_CHECK(++loops < 1000000, "no progress after %d loops (%d of %d done)", loops, got, N);
		r = poll(&pfd, 1, 10000);
		T_CHECK(r >= 0, "poll: %s", strerror(errno));
		if (r == 0) {
			/* eventfd never fired: still poll once, but this is a failure */
			n = phx_poll(eng, done, 64);
			T_CHECK(0, "eventfd not readable for 10 s with %d requests pending "
				"(phx_poll would have returned %d)", N - got, n);
		}
		if (pfd.revents & POLLIN)
			(void)!read(efd, &v, sizeof(v));
		n = phx_poll(eng, done, 64);
		T_CHECK(n >= 0 && n <= 64, "phx_poll %d", n);
		for (int k = 0; k < n; k++) {
			struct phx_io *io = done[k];
			int i = (int)((uintptr_t)io->user_data - 1);
			uint64_t off = io->offset;
			size_t want = off >= FSIZE ? 0 : (FSIZE - off < io->len ? FSIZE - off : io->len);

			T_CHECK(io >= ios && io < ios + N && io == &ios[i], "foreign request %p", (void *)io);
			T_CHECK(!seen[i], "request %d handed back twice", i);
			seen[i] = 1;
			T_CHECK(io->done, "handed back before done");
			T_CHECK(io->result == (int64_t)want, "request %d: %" PRId64 " expected %zu",
				i, io->result, want);
			T_SAME(io->buf, data + off, want, "request %d", i);
			got++;
		}
	}
	{
		struct phx_io *done[4];

		T_CHECK(phx_poll(eng, done, 4) == 0, "extra completions handed back");
	}

	/* NO_POLL requests: waited on, never handed to phx_poll */
	{
		struct phx_io io[8], *p[8], *done[16];

		for (int i = 0; i < 8; i++) {
			/* bufs[i] may be shorter than 4096: use fresh page buffers */
			phx_io_prep(&io[i], f, PHX_OP_READ, t_alloc(4096, 4096), 4096, i * 4096);
			io[i].flags = PHX_IO_NO_POLL;
			p[i] = &io[i];
		}
		T_CHECK(phx_submit(eng, p, 8) == 0, "submit");
		for (int i = 0; i < 8; i++) {
			T_CHECK(phx_wait(eng, &io[i], -1) == 0, "wait");
			T_CHECK(io[i].result == 4096, "result %" PRId64, io[i].result);
			T_SAME(io[i].buf, data + i * 4096, 4096, "no-poll %d", i);
			free(io[i].buf);
		}
		T_CHECK(phx_poll(eng, done, 16) == 0, "NO_POLL request handed back by phx_poll");
	}

	/* phx_wait on a pollable request that already completed returns at once */
	{
		struct phx_io io, *p = &io, *done[2];
		unsigned char small[100];

		phx_io_prep(&io, f, PHX_OP_READ, small, 100, 5);
		T_CHECK(phx_submit(eng, &p, 1) == 0, "submit");
		T_CHECK(phx_wait(eng, &io, -1) == 0, "wait");
		T_CHECK(io.result == 100, "result");
		T_CHECK(phx_wait(eng, &io, 0) == 0, "wait on a done request");
		/* it may still be handed back once by phx_poll: drain it */
		int n = phx_poll(eng, done, 2);
		T_CHECK(n == 0 || (n == 1 && done[0] == &io), "poll after wait: %d", n);
	}

	T_CHECK(phx_file_close(f) == 0, "close");
	T_CHECK(phx_engine_destroy(eng) == 0, "destroy");
	for (int i = 0; i < N; i++)
		free(bufs[i]);
	free(bufs); free(seen); free(ptrs); free(ios); free(data);
	return T_EXIT_PASS;
}
