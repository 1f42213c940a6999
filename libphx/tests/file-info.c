/* SPDX-License-Identifier: Apache-2.0 */
/*
 * Description: phx_file_get_info.  A default open is O_DIRECT with power of
 * two alignments that match statx(STATX_DIOALIGN) when the kernel reports
 * it; PHX_FILE_BUFFERED opens without O_DIRECT; phx_file_from_fd adopts a
 * descriptor without owning it (close leaves it open) and does I/O through
 * it; files beyond max_files still work (unregistered).
 */
#include <sys/syscall.h>

#include "helpers.h"

#ifndef STATX_DIOALIGN
#define STATX_DIOALIGN 0x00002000U
#endif

/* statx via the raw syscall so an old libc does not hide stx_dio_*. */
struct t_statx {
	uint32_t stx_mask, stx_blksize;
	uint64_t stx_attributes;
	uint32_t stx_nlink, stx_uid, stx_gid;
	uint16_t stx_mode, pad0;
	uint64_t stx_ino, stx_size, stx_blocks, stx_attributes_mask;
	uint64_t ts[8];
	uint32_t stx_rdev_major, stx_rdev_minor, stx_dev_major, stx_dev_minor;
	uint64_t stx_mnt_id;
	uint32_t stx_dio_mem_align, stx_dio_offset_align;
	uint64_t spare[12];
};

int main(void)
{
	phx_engine *eng;
	phx_file *f;
	struct phx_file_info fi;
	struct t_statx sx;
	const char *path;
	unsigned char *data, buf[1000];
	int fd, ret;

	t_seed();
	path = t_path("info");
	data = t_random_file(path, 100000);
	eng = t_engine(NULL);

	f = t_open(eng, path, O_RDONLY, 0);
	memset(&fi, 0, sizeof(fi));
	fi.size = sizeof(fi);
	T_CHECK(phx_file_get_info(f, &fi) == 0, "get_info");
	T_CHECK(fi.fd >= 0, "fd %d", fi.fd);
	T_CHECK(fi.direct == 1, "direct %d", fi.direct);
	T_CHECK(fi.open_flags & O_DIRECT, "O_DIRECT not in open flags %#x", fi.open_flags);
	T_CHECK(fcntl(fi.fd, F_GETFL) & O_DIRECT, "descriptor lacks O_DIRECT");
	T_CHECK(fi.mem_align && !(fi.mem_align & (fi.mem_align - 1)), "mem_align %u", fi.mem_align);
	T_CHECK(fi.offset_align && !(fi.offset_align & (fi.offset_align - 1)) && fi.offset_align <= 65536,
		"offset_align %u", fi.offset_align);
	memset(&sx, 0, sizeof(sx));
	ret = syscall(SYS_statx, AT_FDCWD, path, 0, STATX_DIOALIGN, &sx);
	if (ret == 0 && (sx.stx_mask & STATX_DIOALIGN) && sx.stx_dio_offset_align) {
		T_CHECK(fi.align_from_statx == 1, "kernel reports DIOALIGN but align_from_statx=0");
		T_CHECK(fi.offset_align == sx.stx_dio_offset_align, "offset_align %u, statx %u",
			fi.offset_align, sx.stx_dio_offset_align);
		T_CHECK(fi.mem_align >= sx.stx_dio_mem_align, "mem_align %u < statx %u", fi.mem_align,
			sx.stx_dio_mem_align);
	} else {
		T_CHECK(fi.offset_align == 4096 && fi.mem_align == 4096 && !fi.align_from_statx,
			"no DIOALIGN: expected the 4096 default, got %u/%u", fi.mem_align, fi.offset_align);
	}
	T_CHECK(phx_file_close(f) == 0, "close");

	/* buffered */
	f = t_open(eng, path, O_RDONLY, PHX_FILE_BUFFERED);
	fi.size = sizeof(fi);
	T_CHECK(phx_file_get_info(f, &fi) == 0, "get_info");
	T_CHECK(fi.direct == 0 && !(fcntl(fi.fd, F_GETFL) & O_DIRECT), "buffered open has O_DIRECT");
	T_CHECK(phx_pread(f, buf, 1000, 3) == 1000, "buffered read");
	T_SAME(buf, data + 3, 1000, "buffered read");
	T_CHECK(phx_file_close(f) == 0, "close");

	/* adopted fd */
	fd = open(path, O_RDWR | O_DIRECT);
	T_CHECK(fd >= 0, "open");
	T_CHECK(phx_file_from_fd(eng, fd, &f) == 0, "from_fd");
	fi.size = sizeof(fi);
	T_CHECK(phx_file_get_info(f, &fi) == 0 && fi.fd == fd, "fd %d vs %d", fi.fd, fd);
	T_CHECK(fi.direct == 1, "adopted O_DIRECT fd reported direct=%d", fi.direct);
	T_CHECK(phx_pread(f, buf, 1000, 4097) == 1000, "read via adopted fd");
	T_SAME(buf, data + 4097, 1000, "adopted fd read");
	T_CHECK(phx_file_close(f) == 0, "close adopted");
	T_CHECK(fcntl(fd, F_GETFD) >= 0, "phx_file_close closed an adopted fd");
	close(fd);

	/* an adopted buffered fd */
	fd = open(path, O_RDONLY);
	T_CHECK(phx_file_from_fd(eng, fd, &f) == 0, "from_fd buffered");
	fi.size = sizeof(fi);
	T_CHECK(phx_file_get_info(f, &fi) == 0 && fi.direct == 0, "adopted buffered fd direct=%d", fi.direct);
	T_CHECK(phx_pread(f, buf + 1, 999, 1) == 999, "read");
	T_SAME(buf + 1, data + 1, 999, "adopted buffered read");
	T_CHECK(phx_file_close(f) == 0, "close");
	T_CHECK(fcntl(fd, F_GETFD) >= 0, "closed an adopted fd");
	close(fd);
	T_CHECK(phx_engine_destroy(eng) == 0, "destroy");

	/* more files than registered slots */
	{
		struct phx_engine_config cfg;
		phx_file *fs[10];

		phx_engine_config_init(&cfg);
		cfg.max_files = 2;
		eng = t_engine(&cfg);
		for (int i = 0; i < 10; i++)
			fs[i] = t_open(eng, path, O_RDONLY, 0);
		for (int i = 0; i < 10; i++) {
			T_CHECK(phx_pread(fs[i], buf, 100, i * 100) == 100, "read file %d", i);
			T_SAME(buf, data + i * 100, 100, "file %d", i);
		}
		for (int i = 0; i < 10; i++)
			T_CHECK(phx_file_close(fs[i]) == 0, "close %d", i);
		T_CHECK(phx_engine_destroy(eng) == 0, "destroy");
	}
	free(data);
	return T_EXIT_PASS;
}
