/* SPDX-License-Identifier: Apache-2.0 */
/*
 * Description: phx.h promises that no function touches errno: failures
 * (missing file, write to a read-only file, bad arguments) and successes
 * leave errno as the caller set it.
 */
#include "helpers.h"

int main(void)
{
	phx_engine *eng;
	phx_file *f = NULL;
	const char *path, *missing;
	unsigned char buf[4096];
	int ret;

	t_seed();
	path = t_path("errno");
	missing = t_path("missing");
	free(t_random_file(path, 8192));

	errno = 12345;
	eng = t_engine(NULL);
	T_CHECK(errno == 12345, "phx_engine_create set errno to %d", errno);

	errno = 12345;
	ret = phx_file_open(eng, missing, O_RDONLY, 0, 0, &f);
	T_CHECK(ret == -ENOENT, "missing: %d", ret);
	T_CHECK(errno == 12345, "failed phx_file_open set errno to %d (%s)", errno, strerror(errno));

	f = t_open(eng, path, O_RDONLY, 0);
	errno = 777;
	T_CHECK(phx_pwrite(f, buf, 4096, 0) == -EBADF, "write to O_RDONLY");
	T_CHECK(errno == 777, "failed phx_pwrite set errno to %d", errno);
	errno = 777;
	T_CHECK(phx_pread(f, buf, 4096, 0) == 4096, "read");
	T_CHECK(phx_pread(f, buf, 10, 8190) == 2, "short read at EOF");
	T_CHECK(errno == 777, "successful phx_pread set errno to %d", errno);
	errno = 777;
	T_CHECK(phx_file_close(f) == 0, "close");
	T_CHECK(phx_engine_destroy(eng) == 0, "destroy");
	T_CHECK(errno == 777, "close/destroy set errno to %d", errno);
	return T_EXIT_PASS;
}
