/* SPDX-License-Identifier: Apache-2.0 */
/*
 * Description: a filesystem that refuses O_DIRECT (ramfs, mounted here;
 * needs root, skips otherwise).  Without PHX_FILE_ALLOW_BUFFERED every open
 * fails with -EINVAL (not -EEXIST, even for O_EXCL, whose first attempt may
 * have created the file); with it, every access mode - O_EXCL included -
 * opens buffered (phx_file_info.direct = 0) and I/O works.
 */
#include <sys/mount.h>

#include "helpers.h"

static char mnt[256];

static void unmount(void)
{
	if (mnt[0]) {
		umount2(mnt, MNT_DETACH);
		rmdir(mnt);
	}
}

int main(void)
{
	static const struct { int flags; const char *name; } modes[] = {
		{ O_WRONLY | O_CREAT | O_EXCL, "O_WRONLY|O_CREAT|O_EXCL" },
		{ O_RDWR | O_CREAT | O_EXCL, "O_RDWR|O_CREAT|O_EXCL" },
		{ O_WRONLY | O_CREAT | O_TRUNC, "O_WRONLY|O_CREAT|O_TRUNC" },
		{ O_RDWR | O_CREAT, "O_RDWR|O_CREAT" },
	};
	phx_engine *eng;
	char path[300];
	unsigned char buf[5000], back[5000];

	t_seed();
	if (geteuid() != 0)
		T_SKIP("mounting ramfs needs root");
	snprintf(mnt, sizeof(mnt), "%s/.phx-test-ramfs-%d",
		 getenv("PHX_TEST_DIR") ? getenv("PHX_TEST_DIR") : ".", (int)getpid());
	T_CHECK(mkdir(mnt, 0755) == 0, "mkdir %s: %s", mnt, strerror(errno));
	if (mount("phx-test", mnt, "ramfs", 0, NULL)) {
		int e = errno;

		rmdir(mnt);
		mnt[0] = 0;
		T_SKIP("cannot mount ramfs: %s", strerror(e));
	}
	atexit(unmount);
	eng = t_engine(NULL);

	for (unsigned i = 0; i < sizeof(modes) / sizeof(*modes); i++) {
		phx_file *f = NULL;
		struct phx_file_info fi = { .size = sizeof(fi) };
		int ret;

		snprintf(path, sizeof(path), "%s/refused-%u", mnt, i);
		ret = phx_file_open(eng, path, modes[i].flags, 0644, 0, &f);
		T_CHECK(ret == -EINVAL, "%s without ALLOW_BUFFERED on ramfs: %d (%s)", modes[i].name,
			ret, phx_strerror_last());
		snprintf(path, sizeof(path), "%s/allowed-%u", mnt, i);
		ret = phx_file_open(eng, path, modes[i].flags, 0644, PHX_FILE_ALLOW_BUFFERED, &f);
		T_CHECK(ret == 0, "%s with ALLOW_BUFFERED on ramfs: %d (%s)", modes[i].name, ret,
			phx_strerror_last());
		T_CHECK(phx_file_get_info(f, &fi) == 0 && fi.direct == 0, "direct=%d", fi.direct);
		t_fill(buf, sizeof(buf));
		T_CHECK(phx_pwrite(f, buf + 1, 4000, 3) == 4000, "write");
		T_CHECK(phx_file_close(f) == 0, "close");
		T_CHECK(t_pread(path, back, 4000, 3) == 4000, "ref read");
		T_SAME(back, buf + 1, 4000, "%s", modes[i].name);
	}
	T_CHECK(phx_engine_destroy(eng) == 0, "destroy");
	return T_EXIT_PASS;
}
