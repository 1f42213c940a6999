/* SPDX-License-Identifier: Apache-2.0 */
/*
 * consumer.c - a C user of an installed libphx, built by check.sh with
 * `pkg-config --cflags --libs phx` only (no path into the source tree).
 *
 * Description: every installed header compiles; the library that runs is the
 * installed one (its path printed from dladdr, checked by check.sh); one
 * write and one read through an engine move the bytes; the GPU and NVMe
 * entry points answer (CUDA unavailable is an answer).  Argument: a folder
 * for the scratch file.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <phx.h>
#include <phx_cuda.h>
#include <phx_nvme.h>

int main(int argc, char **argv)
{
	char path[4096], why[256];
	struct phx_nvme_config ncfg;
	phx_engine *eng;
	phx_file *f;
	Dl_info info;
	void *w, *r;
	int64_t n;
	int ret;

	if (argc < 2)
		return 2;
	if (!dladdr((void *)phx_version, &info) || !info.dli_fname)
		return 1;
	printf("libphx %s from %s\n", phx_version(), info.dli_fname);
	snprintf(path, sizeof(path), "%s/consumer.bin", argv[1]);
	if (posix_memalign(&w, 4096, 1 << 20) || posix_memalign(&r, 4096, 1 << 20))
		return 1;
	memset(w, 0x5a, 1 << 20);
	memset(r, 0, 1 << 20);
	ret = phx_engine_create(NULL, &eng);
	if (ret < 0) {
		fprintf(stderr, "phx_engine_create: %s\n", phx_strerror_last());
		return 1;
	}
	ret = phx_file_open(eng, path, O_RDWR | O_CREAT | O_TRUNC, 0644,
			    PHX_FILE_ALLOW_BUFFERED, &f);
	if (ret < 0) {
		fprintf(stderr, "phx_file_open %s: %s\n", path, phx_strerror_last());
		return 1;
	}
	n = phx_pwrite(f, w, 1 << 20, 0);
	if (n == 1 << 20)
		n = phx_pread(f, r, 1 << 20, 0);
	if (n != 1 << 20 || memcmp(w, r, 1 << 20)) {
		fprintf(stderr, "I/O: %lld (%s)\n", (long long)n, phx_strerror_last());
		return 1;
	}
	phx_file_close(f);
	phx_engine_destroy(eng);
	unlink(path);
	printf("cuda: %d (%s)\n", phx_cuda_available(why, sizeof(why)), why);
	phx_nvme_config_init(&ncfg);
	printf("ok\n");
	free(w);
	free(r);
	return 0;
}
