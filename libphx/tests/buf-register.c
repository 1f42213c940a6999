/* SPDX-License-Identifier: Apache-2.0 */
/*
 * Description: registered host buffers.  Aligned requests inside a buffer
 * registered with phx_buf_register use fixed-buffer I/O (fixed_buf_ios
 * grows) and move the right bytes, including sub-ranges and writes;
 * unaligned requests inside it still work; after phx_buf_deregister the
 * same memory still works.  Skips where the kernel or RLIMIT_MEMLOCK
 * refuses registration.  On the threads backend registration is kept but
 * fixes nothing: the same bytes, fixed_buf_ios stays 0.
 */
#include <stdbool.h>

#include "helpers.h"

int main(void)
{
	phx_engine *eng;
	phx_file *f;
	const char *path;
	unsigned char *data, *buf = t_alloc(4 * MiB, 4096), *chk = t_alloc(4 * MiB, 64);
	struct phx_stats a, b;
	bool uring;
	int ret;

	t_seed();
	path = t_path("reg");
	data = t_random_file(path, 4 * MiB);
	eng = t_engine(NULL);
	if (!(phx_engine_features(eng) & PHX_FEAT_USER_BUFS))
		T_SKIP("engine reports no buffer registration support");
	ret = phx_buf_register(eng, buf, 4 * MiB);
	if (ret == -ENOMEM || ret == -EPERM || ret == -EOPNOTSUPP)
		T_SKIP("phx_buf_register: %d (%s)", ret, phx_strerror_last());
	T_CHECK(ret == 0, "register %d", ret);
	uring = !strcmp(phx_engine_backend(eng), "uring");
	f = t_open(eng, path, O_RDWR, 0);

	phx_engine_stats(eng, &a);
	T_CHECK(phx_pread(f, buf, 4 * MiB, 0) == (int64_t)(4 * MiB), "read");
	T_SAME(buf, data, 4 * MiB, "fixed read");
	T_CHECK(phx_pread(f, buf + 64 * KiB, 128 * KiB, 1 * MiB) == 128 * KiB, "sub-range read");
	T_SAME(buf + 64 * KiB, data + MiB, 128 * KiB, "sub-range");
	phx_engine_stats(eng, &b);
	T_CHECK(uring ? b.fixed_buf_ios - a.fixed_buf_ios >= 2 : b.fixed_buf_ios == 0,
		"fixed_buf_ios grew by %" PRIu64 " on %s", b.fixed_buf_ios - a.fixed_buf_ios,
		phx_engine_backend(eng));

	/* writes from the registered buffer */
	t_fill(buf, 256 * KiB);
	T_CHECK(phx_pwrite(f, buf, 256 * KiB, 512 * KiB) == 256 * KiB, "fixed write");
	memcpy(data + 512 * KiB, buf, 256 * KiB);
	/* unaligned inside the registered buffer */
	t_fill(buf + 1, 5000);
	T_CHECK(phx_pwrite(f, buf + 1, 5000, 3) == 5000, "unaligned write from a registered buffer");
	memcpy(data + 3, buf + 1, 5000);
	T_CHECK(phx_pread(f, buf + 7, 10000, 11) == 10000, "unaligned read");
	T_SAME(buf + 7, data + 11, 10000, "unaligned read into registered");
	/* a request crossing the end of the registration */
	{
		unsigned char *two = t_alloc(2 * MiB, 4096);

		T_CHECK(phx_buf_register(eng, two, MiB) == 0, "register second");
		T_CHECK(phx_pread(f, two, 2 * MiB, 0) == (int64_t)(2 * MiB), "read across registration end");
		T_SAME(two, data, 2 * MiB, "across registration end");
		T_CHECK(phx_buf_deregister(eng, two) == 0, "deregister second");
		free(two);
	}

	T_CHECK(phx_buf_deregister(eng, buf) == 0, "deregister");
	phx_engine_stats(eng, &a);
	T_CHECK(phx_pread(f, buf, MiB, 0) == (int64_t)MiB, "read after deregister");
	phx_engine_stats(eng, &b);
	T_CHECK(b.fixed_buf_ios == a.fixed_buf_ios, "fixed I/O on a deregistered buffer");
	T_SAME(buf, data, MiB, "after deregister");
	T_CHECK(phx_file_close(f) == 0, "close");
	T_CHECK(t_pread(path, chk, 4 * MiB, 0) == 4 * MiB, "ref");
	T_SAME(chk, data, 4 * MiB, "file");
	T_CHECK(phx_engine_destroy(eng) == 0, "destroy");
	free(buf); free(chk); free(data);
	return T_EXIT_PASS;
}
