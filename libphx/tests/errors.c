/* SPDX-License-Identifier: Apache-2.0 */
/*
 * Description: error returns.  Missing file -ENOENT, existing file with
 * O_EXCL -EEXIST, a directory opened for writing -EISDIR, write to an
 * O_RDONLY file -EBADF (direct and bounce paths), read from O_WRONLY -EBADF,
 * NULL/invalid arguments -EINVAL, O_APPEND refused (opened or adopted), an offset + length that
 * overflows -EINVAL; each with a message from phx_strerror_last() and the
 * file unchanged.  (errno is checked in errno-untouched.c.)
 */
#include "helpers.h"

int main(void)
{
	phx_engine *eng;
	phx_file *f = NULL;
	const char *path, *missing;
	unsigned char *data, *buf = t_alloc(8192, 4096), *chk = t_alloc(64 * KiB, 64);
	int ret;

	t_seed();
	path = t_path("err");
	missing = t_path("missing");
	data = t_random_file(path, 64 * KiB);
	eng = t_engine(NULL);

	ret = phx_file_open(eng, missing, O_RDONLY, 0, 0, &f);
	T_CHECK(ret == -ENOENT, "missing file: %d", ret);
	T_CHECK(strstr(phx_strerror_last(), missing) != NULL || strlen(phx_strerror_last()) > 0,
		"no message");
	T_CHECK(access(missing, F_OK) != 0, "O_RDONLY open created the file");

	ret = phx_file_open(eng, path, O_RDWR | O_CREAT | O_EXCL, 0644, 0, &f);
	T_CHECK(ret == -EEXIST, "O_EXCL on an existing file: %d", ret);

	ret = phx_file_open(eng, ".", O_RDWR, 0, 0, &f);
	T_CHECK(ret == -EISDIR, "directory O_RDWR: %d", ret);

	ret = phx_file_open(eng, path, O_RDWR | O_APPEND, 0, 0, &f);
	T_CHECK(ret == -EINVAL, "O_APPEND: %d", ret);
	{
		/* An adopted fd with O_APPEND: the kernel would ignore offsets. */
		int afd = open(path, O_WRONLY | O_APPEND | O_DIRECT);

		T_CHECK(afd >= 0, "open O_APPEND");
		ret = phx_file_from_fd(eng, afd, &f);
		T_CHECK(ret == -EINVAL && strstr(phx_strerror_last(), "O_APPEND"),
			"adopted O_APPEND fd: %d (%s)", ret, phx_strerror_last());
		T_CHECK(fcntl(afd, F_GETFL) >= 0, "the caller's fd was closed");
		close(afd);
	}

	T_CHECK(phx_file_open(NULL, path, O_RDONLY, 0, 0, &f) == -EINVAL, "NULL engine");
	T_CHECK(phx_file_open(eng, NULL, O_RDONLY, 0, 0, &f) == -EINVAL, "NULL path");
	T_CHECK(phx_file_open(eng, path, O_RDONLY, 0, 0, NULL) == -EINVAL, "NULL out");
	T_CHECK(phx_file_open(eng, path, O_RDONLY, 0, 0x80000000u, &f) == -EINVAL, "bad phx flags");

	/* read-only file */
	f = t_open(eng, path, O_RDONLY, 0);
	t_fill(buf, 8192);
	T_CHECK(phx_pwrite(f, buf, 4096, 0) == -EBADF, "aligned write to O_RDONLY");
	T_CHECK(phx_pwrite(f, buf + 1, 10, 3) == -EBADF, "unaligned write to O_RDONLY");
	T_CHECK(phx_pwrite(f, buf, 8192, 4095) == -EBADF, "split write to O_RDONLY");
	T_CHECK(strlen(phx_strerror_last()) > 0, "no message");
	{
		struct phx_io io;

		phx_io_prep(&io, f, PHX_OP_WRITE, buf, 4096, 0);
		/* refused as a batch, or accepted with the request failing */
		ret = phx_submit_wait(eng, &io, 1);
		T_CHECK(ret == -EBADF || (ret == 0 && io.result == -EBADF),
			"batched write to O_RDONLY: ret %d result %" PRId64, ret, io.result);
		/* offset + len overflow */
		phx_io_prep(&io, f, PHX_OP_READ, buf, 4096, UINT64_MAX - 100);
		ret = phx_submit_wait(eng, &io, 1);
		T_CHECK(ret == -EINVAL || io.result == -EINVAL, "overflowing offset: ret %d result %" PRId64,
			ret, io.result);
		ret = (int)phx_pread(f, buf, 4096, (uint64_t)INT64_MAX + 1);
		T_CHECK(ret == -EINVAL || ret == 0, "offset beyond off_t: %d", ret);
	}
	T_CHECK(phx_pread(f, NULL, 10, 0) == -EINVAL || phx_pread(f, NULL, 10, 0) == -EFAULT,
		"NULL buffer");
	T_CHECK(phx_pread(NULL, buf, 10, 0) == -EINVAL || phx_pread(NULL, buf, 10, 0) == -EBADF,
		"NULL file");
	T_CHECK(phx_file_close(f) == 0, "close");
	T_CHECK(t_pread(path, chk, 64 * KiB, 0) == 64 * KiB, "ref");
	T_SAME(chk, data, 64 * KiB, "file after refused writes");

	/* write-only file */
	f = t_open(eng, path, O_WRONLY, 0);
	T_CHECK(phx_pread(f, buf, 4096, 0) == -EBADF, "read from O_WRONLY");
	T_CHECK(phx_pread(f, buf + 1, 10, 1) == -EBADF, "unaligned read from O_WRONLY");
	/* ...while writes, even partial-block ones, still work */
	t_fill(buf, 8192);
	T_CHECK(phx_pwrite(f, buf + 3, 100, 7) == 100, "unaligned write to O_WRONLY: %s", phx_strerror_last());
	memcpy(data + 7, buf + 3, 100);
	T_CHECK(phx_file_close(f) == 0, "close");
	T_CHECK(t_pread(path, chk, 64 * KiB, 0) == 64 * KiB, "ref");
	T_SAME(chk, data, 64 * KiB, "file after O_WRONLY partial write");

	T_CHECK(phx_file_from_fd(eng, -1, &f) == -EINVAL || phx_file_from_fd(eng, -1, &f) == -EBADF,
		"from_fd(-1)");
	T_CHECK(phx_file_close(NULL) == -EINVAL || phx_file_close(NULL) == -EBADF, "close(NULL)");
	T_CHECK(phx_buf_register(eng, NULL, 0) == -EINVAL, "register empty");
	T_CHECK(phx_buf_deregister(eng, buf) == -ENOENT || phx_buf_deregister(eng, buf) == -EINVAL,
		"deregister unknown");
	T_CHECK(phx_wait(eng, NULL, 0) == -EINVAL, "wait NULL");
	T_CHECK(phx_submit(eng, NULL, 1) == -EINVAL, "submit NULL");
	T_CHECK(phx_poll(NULL, NULL, 0) == -EINVAL, "poll NULL");

	T_CHECK(phx_engine_destroy(eng) == 0, "destroy");
	free(buf); free(chk); free(data);
	return T_EXIT_PASS;
}
