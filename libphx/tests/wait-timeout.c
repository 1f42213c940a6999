/* SPDX-License-Identifier: Apache-2.0 */
/*
 * Description: phx_wait with a timeout.  A read from an empty FIFO (a file
 * opened PHX_FILE_BUFFERED) cannot complete: phx_wait(.., 50 ms) returns
 * -ETIME and leaves the request pending; once data is written into the FIFO
 * phx_wait(.., -1) returns 0 with the bytes.  A completed request returns 0
 * at once even with a zero timeout.  Skips if the engine completes the FIFO
 * read at once (then nothing can be held pending this way).
 */
#include <sys/stat.h>

#include "helpers.h"

int main(void)
{
	phx_engine *eng;
	phx_file *f;
	const char *fifo;
	struct phx_io io, *p = &io;
	unsigned char buf[64], payload[64];
	int ret, wfd;

	t_seed();
	fifo = t_path("fifo");
	T_CHECK(mkfifo(fifo, 0600) == 0, "mkfifo: %s", strerror(errno));
	eng = t_engine(NULL);
	ret = phx_file_open(eng, fifo, O_RDWR, 0, PHX_FILE_BUFFERED, &f);
	if (ret < 0)
		T_SKIP("phx_file_open on a FIFO: %d (%s)", ret, phx_strerror_last());

	memset(buf, 0x5a, sizeof(buf));
	phx_io_prep(&io, f, PHX_OP_READ, buf, sizeof(buf), 0);
	io.flags = PHX_IO_NO_POLL;
	T_CHECK(phx_submit(eng, &p, 1) == 0, "submit");

	ret = phx_wait(eng, &io, 50 * 1000 * 1000);
	if (ret == 0)
		T_SKIP("the engine completed a read from an empty FIFO at once (result %" PRId64 ")",
		       io.result);
	T_CHECK(ret == -ETIME, "phx_wait(50 ms) on a pending request = %d", ret);
	T_CHECK(!__atomic_load_n(&io.done, __ATOMIC_ACQUIRE), "done set after -ETIME");
	T_CHECK(phx_wait(eng, &io, 0) == -ETIME, "zero timeout on a pending request");

	/* A file with I/O in flight cannot be closed. */
	T_CHECK(phx_file_close(f) == -EBUSY, "close with a request in flight");

	t_fill(payload, sizeof(payload));
	wfd = open(fifo, O_WRONLY | O_NONBLOCK);
	T_CHECK(wfd >= 0, "open fifo for writing: %s", strerror(errno));
	T_CHECK(write(wfd, payload, sizeof(payload)) == sizeof(payload), "write fifo");
	close(wfd);

	T_CHECK(phx_wait(eng, &io, -1) == 0, "phx_wait(-1)");
	T_CHECK(io.done, "not done");
	T_CHECK(io.result == sizeof(payload), "result %" PRId64, io.result);
	T_SAME(buf, payload, sizeof(payload), "FIFO bytes");
	T_CHECK(phx_wait(eng, &io, 0) == 0, "zero timeout on a done request");

	T_CHECK(phx_file_close(f) == 0, "close after completion: %s", phx_strerror_last());
	T_CHECK(phx_engine_destroy(eng) == 0, "destroy");
	return T_EXIT_PASS;
}
