/* SPDX-License-Identifier: Apache-2.0 */
/*
 * Description: phx_file_close() on a file with requests in flight fails with
 * -EBUSY and leaves the file usable; after the requests complete it closes.
 * Requests held in flight by a read from an empty FIFO (skips if the engine
 * cannot hold one) and, on a regular file, by a 64 MiB read submitted just
 * before the close (which may legitimately have finished: then 0).
 * Destroying an engine with a request in flight waits for it.
 */
#include <sys/stat.h>

#include "helpers.h"

int main(void)
{
	phx_engine *eng;
	phx_file *f;
	const char *fifo, *path;
	struct phx_io io, *p = &io;
	unsigned char buf[32], payload[32];
	int ret, wfd;

	t_seed();
	eng = t_engine(NULL);

	/* 1. regular file, big read */
	{
		size_t n = 64 * MiB;
		unsigned char *data, *big = t_alloc(n, 4096);

		path = t_path("busy");
		data = t_random_file(path, n);
		f = t_open(eng, path, O_RDONLY, 0);
		phx_io_prep(&io, f, PHX_OP_READ, big, n, 0);
		io.flags = PHX_IO_NO_POLL;
		T_CHECK(phx_submit(eng, &p, 1) == 0, "submit");
		ret = phx_file_close(f);
		if (ret == 0) {
			/* closed: the request must have been complete already */
			T_CHECK(__atomic_load_n(&io.done, __ATOMIC_ACQUIRE),
				"close returned 0 with the request still in flight");
			T_CHECK(io.result == (int64_t)n, "result %" PRId64, io.result);
		} else {
			T_CHECK(ret == -EBUSY, "close with I/O in flight = %d", ret);
			T_CHECK(strlen(phx_strerror_last()) > 0, "no message");
			T_CHECK(phx_wait(eng, &io, -1) == 0, "wait");
			T_CHECK(io.result == (int64_t)n, "result %" PRId64, io.result);
			/* the file still works */
			T_CHECK(phx_pread(f, buf, 32, 5) == 32, "pread after -EBUSY");
			T_SAME(buf, data + 5, 32, "after -EBUSY");
			T_CHECK(phx_file_close(f) == 0, "close after completion");
		}
		T_SAME(big, data, n, "64 MiB read");
		free(big);
		free(data);
	}

	/* 2. FIFO: deterministically in flight */
	fifo = t_path("fifo");
	T_CHECK(mkfifo(fifo, 0600) == 0, "mkfifo");
	ret = phx_file_open(eng, fifo, O_RDWR, 0, PHX_FILE_BUFFERED, &f);
	if (ret < 0)
		T_SKIP("phx_file_open on a FIFO: %d (%s)", ret, phx_strerror_last());
	phx_io_prep(&io, f, PHX_OP_READ, buf, sizeof(buf), 0);
	io.flags = PHX_IO_NO_POLL;
	T_CHECK(phx_submit(eng, &p, 1) == 0, "submit");
	if (phx_wait(eng, &io, 20 * 1000 * 1000) == 0)
		T_SKIP("the engine completed a read from an empty FIFO at once");
	for (int i = 0; i < 3; i++)
		T_CHECK(phx_file_close(f) == -EBUSY, "close with a FIFO read in flight (try %d)", i);
	t_fill(payload, sizeof(payload));
	wfd = open(fifo, O_WRONLY | O_NONBLOCK);
	T_CHECK(wfd >= 0, "open fifo");
	T_CHECK(write(wfd, payload, sizeof(payload)) == sizeof(payload), "write fifo");
	T_CHECK(phx_wait(eng, &io, -1) == 0, "wait");
	T_CHECK(io.result == sizeof(payload), "result %" PRId64, io.result);
	T_SAME(buf, payload, sizeof(payload), "fifo bytes");
	T_CHECK(phx_file_close(f) == 0, "close after completion");

	/* 3. destroy waits for a request in flight */
	ret = phx_file_open(eng, fifo, O_RDWR, 0, PHX_FILE_BUFFERED, &f);
	T_CHECK(ret == 0, "reopen fifo");
	phx_io_prep(&io, f, PHX_OP_READ, buf, sizeof(buf), 0);
	io.flags = PHX_IO_NO_POLL;
	T_CHECK(phx_submit(eng, &p, 1) == 0, "submit");
	T_CHECK(write(wfd, payload, sizeof(payload)) == sizeof(payload), "write fifo");
	close(wfd);
	T_CHECK(phx_engine_destroy(eng) == 0, "destroy with a request completing");
	T_CHECK(io.done && io.result == sizeof(payload), "request not finished by destroy: done %u result %" PRId64,
		io.done, io.result);
	return T_EXIT_PASS;
}
