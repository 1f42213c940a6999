// SPDX-License-Identifier: Apache-2.0
/*
 * file.c - opening files on an engine: O_DIRECT, alignment, registration
 * (with the backend's fixed-file table, where it has one).
 */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <unistd.h>

#include "internal.h"

#ifndef STATX_DIOALIGN
#define STATX_DIOALIGN 0x00002000U
#endif

/*
 * Whether the block device @dev is zram.  Its reads into memory that is not
 * page aligned return the wrong bytes (kernel 6.18, ext4 on zram, O_DIRECT
 * into a 512-aligned buffer at +512: the data lands shifted by the
 * buffer's offset in its page, no error), though statx allows 512.
 */
static bool dev_is_zram(dev_t dev)
{
	char link[64], target[256];
	ssize_t n;
	const char *base;

	snprintf(link, sizeof(link), "/sys/dev/block/%u:%u", major(dev), minor(dev));
	n = readlink(link, target, sizeof(target) - 1);
	if (n <= 0)
		return false;
	target[n] = '\0';
	base = strrchr(target, '/');
	base = base ? base + 1 : target;
	return !strncmp(base, "zram", 4);
}

/*
 * O_DIRECT alignment from statx(STATX_DIOALIGN) (Linux >= 6.1); 4096 for
 * both where the kernel does not say, which every device accepts.  Memory
 * alignment is never below a page on zram (dev_is_zram): data that is
 * wrong without an error is worse than a bounce.
 */
static void file_alignment(phx_file *f)
{
	struct statx stx;

	f->mem_align = PHX_PAGE;
	f->offset_align = PHX_PAGE;
	f->align_from_statx = false;
	memset(&stx, 0, sizeof(stx));
	if (statx(f->fd, "", AT_EMPTY_PATH, STATX_DIOALIGN | STATX_TYPE, &stx) == 0 &&
	    (stx.stx_mask & STATX_DIOALIGN) && stx.stx_dio_offset_align &&
	    stx.stx_dio_mem_align) {
		f->mem_align = stx.stx_dio_mem_align;
		f->offset_align = stx.stx_dio_offset_align;
		f->align_from_statx = true;
		if (f->mem_align < PHX_PAGE &&
		    dev_is_zram(S_ISBLK(stx.stx_mode) ?
				makedev(stx.stx_rdev_major, stx.stx_rdev_minor) :
				makedev(stx.stx_dev_major, stx.stx_dev_minor)))
			f->mem_align = PHX_PAGE;
	}
}

static void file_register(phx_engine *eng, phx_file *f)
{
	uint32_t i;

	f->slot = -1;
	if (!(eng->features & PHX_FEAT_FIXED_FILES))
		return;
	for (i = 0; i < eng->cfg.max_files; i++) {
		if (eng->file_slots[i] != -1)
			continue;
		if (eng->be->file_update(eng, (int)i, f->fd) == 0) {
			eng->file_slots[i] = f->fd;
			f->slot = (int)i;
		}
		return;
	}
}

static void file_unregister(phx_engine *eng, phx_file *f)
{
	if (f->slot < 0)
		return;
	eng->be->file_update(eng, f->slot, -1);
	eng->file_slots[f->slot] = -1;
	f->slot = -1;
}

/*
 * The largest folio the page cache may hold of this file: a PMD's worth
 * (page size x page size / 8: 2 MiB with 4 KiB pages), or the filesystem
 * block or O_DIRECT alignment where that is larger.  Folios are naturally
 * aligned, so a range rounded out to this covers every folio it touches.
 */
static uint32_t folio_granule(const phx_file *f, const struct stat *st)
{
	uint64_t page = (uint64_t)sysconf(_SC_PAGESIZE), g;

	if (page < PHX_PAGE)
		page = PHX_PAGE;
	g = page * page / 8;
	if (g > (1u << 30))
		g = 1u << 30;
	if (f->offset_align > g)
		g = f->offset_align;
	if (st->st_blksize > 0 && (uint64_t)st->st_blksize > g &&
	    !(st->st_blksize & (st->st_blksize - 1)) && st->st_blksize <= (1 << 30))
		g = (uint64_t)st->st_blksize;
	return (uint32_t)g;
}

static int file_attach(phx_engine *eng, int fd, bool owns, int acc,
		       phx_file **out)
{
	struct stat st;
	phx_file *f;
	int fl, ret;

	fl = fcntl(fd, F_GETFL);
	if (fl < 0)
		return phx_err(-errno, "fd %d", fd);
	if (fl & O_APPEND)
		return phx_err(-EINVAL, "fd %d is open with O_APPEND, which makes the kernel ignore the explicit offsets phx writes at",
			       fd);
	if (fstat(fd, &st))
		return phx_err(-errno, "fstat(%d)", fd);
	f = calloc(1, sizeof(*f));
	if (!f)
		return phx_err(-ENOMEM, "out of memory");
	ret = inode_get(&st, &f->inode);
	if (ret) {
		free(f);
		return ret;
	}
	f->eng = eng;
	f->fd = fd;
	f->owns_fd = owns;
	f->open_flags = fl;
	f->direct = !!(fl & O_DIRECT);
	/* What the caller asked for, which may be less than the fd allows. */
	if (acc < 0)
		acc = fl & O_ACCMODE;
	f->readable = acc != O_WRONLY;
	f->writable = acc != O_RDONLY;
	f->can_read_back = (fl & O_ACCMODE) != O_WRONLY;
	f->bounded = S_ISREG(st.st_mode) || S_ISBLK(st.st_mode);
	f->alt_fd = -1;
	file_alignment(f);
	f->folio_align = folio_granule(f, &st);
	pthread_mutex_lock(&eng->lock);
	file_register(eng, f);
	f->next = eng->files;
	eng->files = f;
	pthread_mutex_unlock(&eng->lock);
	*out = f;
	return 0;
}

/*
 * The buffered descriptor partial blocks are written through (eng->lock
 * held), opened on first use: a reopen of the same file without O_DIRECT.
 * Returns it, or -errno.
 */
int file_alt_fd(phx_file *f)
{
	char proc[64];
	int fd;

	if (f->alt_fd >= 0)
		return f->alt_fd;
	snprintf(proc, sizeof(proc), "/proc/self/fd/%d", f->fd);
	fd = open(proc, O_WRONLY | O_CLOEXEC);
	if (fd < 0)
		return phx_err(-errno, "fd %d: cannot reopen it without O_DIRECT (through %s) to write a partial block",
			       f->fd, proc);
	f->alt_fd = fd;
	return fd;
}

static int file_open(phx_engine *eng, const char *path, int flags, mode_t mode,
		     uint32_t phx_flags, phx_file **out);

/*
 * open(2) with O_DIRECT (in @flags unless buffered was asked for), with the
 * fallbacks a caller expects; returns an fd or -errno.
 */
static int open_direct(const char *path, int flags, mode_t mode,
		       uint32_t phx_flags)
{
	int try = flags, fd, err;
	bool existed = true;
	struct stat st;

	if (flags & O_CREAT)
		existed = !stat(path, &st);
	/*
	 * Partial-block O_DIRECT writes read the block first, so a write-only
	 * request is opened read-write where permissions allow.
	 */
	if ((flags & O_DIRECT) && (flags & O_ACCMODE) == O_WRONLY)
		try = (flags & ~O_ACCMODE) | O_RDWR;
	fd = open(path, try, mode);
	if (fd < 0 && errno == EACCES && try != flags) {
		try = flags;
		fd = open(path, try, mode);
	}
	if (fd >= 0 || errno != EINVAL || !(try & O_DIRECT))
		return fd >= 0 ? fd : -errno;

	/* EINVAL with O_DIRECT: a directory, or a filesystem without it. */
	if (!stat(path, &st) && S_ISDIR(st.st_mode))
		return -EISDIR;
	/* The open may have created the file before refusing O_DIRECT. */
	if (!existed && !stat(path, &st))
		try &= ~O_EXCL;
	if (phx_flags & PHX_FILE_ALLOW_BUFFERED) {
		fd = open(path, try & ~O_DIRECT, mode);
		if (fd >= 0)
			return fd;
	}
	err = fd < 0 && errno != EINVAL ? -errno : -EINVAL;
	if (!existed && !(phx_flags & PHX_FILE_ALLOW_BUFFERED))
		unlink(path);
	return err;
}

PHX_EXPORT int phx_file_open(phx_engine *eng, const char *path, int flags,
			     mode_t mode, uint32_t phx_flags, phx_file **out)
{
	int saved = errno, ret = file_open(eng, path, flags, mode, phx_flags, out);

	errno = saved;
	return ret;
}

static int file_open(phx_engine *eng, const char *path, int flags, mode_t mode,
		     uint32_t phx_flags, phx_file **out)
{
	int fd, ret;

	if (!eng || !path || !out)
		return phx_err(-EINVAL, "phx_file_open: NULL argument");
	*out = NULL;
	if (phx_flags & ~(PHX_FILE_BUFFERED | PHX_FILE_ALLOW_BUFFERED))
		return phx_err(-EINVAL, "%s: unknown phx flags 0x%x", path, phx_flags);
	if (flags & O_APPEND)
		return phx_err(-EINVAL, "%s: O_APPEND is not supported (offsets are explicit)",
			       path);
	flags |= O_CLOEXEC;
	if (!(phx_flags & PHX_FILE_BUFFERED))
		flags |= O_DIRECT;
	else
		flags &= ~O_DIRECT;
	fd = open_direct(path, flags, mode, phx_flags);
	if (fd < 0) {
		ret = fd;
		return phx_err(ret, "%s%s", path,
			       ret == -EINVAL && (flags & O_DIRECT) ?
			       " (the filesystem refuses O_DIRECT; open buffered to use the page cache)" : "");
	}
	ret = file_attach(eng, fd, true, flags & O_ACCMODE, out);
	if (ret)
		close(fd);
	return ret;
}

PHX_EXPORT int phx_file_from_fd(phx_engine *eng, int fd, phx_file **out)
{
	int saved = errno, ret;

	if (!eng || !out || fd < 0)
		return phx_err(-EINVAL, "phx_file_from_fd: bad argument");
	ret = file_attach(eng, fd, false, -1, out);
	errno = saved;
	return ret;
}

static void file_free(phx_engine *eng, phx_file *f)
{
	phx_file **pp;

	for (pp = &eng->files; *pp; pp = &(*pp)->next) {
		if (*pp == f) {
			*pp = f->next;
			break;
		}
	}
	file_unregister(eng, f);
	if (f->alt_fd >= 0)
		close(f->alt_fd);
	if (f->owns_fd)
		close(f->fd);
	inode_put(f->inode);
	free(f);
}

PHX_EXPORT int phx_file_close(phx_file *f)
{
	phx_engine *eng;
	int saved;

	if (!f)
		return phx_err(-EBADF, "phx_file_close: NULL file");
	eng = f->eng;
	pthread_mutex_lock(&eng->lock);
	if (f->refs) {
		pthread_mutex_unlock(&eng->lock);
		return phx_err(-EBUSY, "file has %u requests in flight", f->refs);
	}
	saved = errno;
	file_free(eng, f);
	errno = saved;
	pthread_mutex_unlock(&eng->lock);
	return 0;
}

void phx_file_hold(phx_file *f)
{
	pthread_mutex_lock(&f->eng->lock);
	f->refs++;
	f->holds++;
	pthread_mutex_unlock(&f->eng->lock);
}

void phx_file_unhold(phx_file *f)
{
	pthread_mutex_lock(&f->eng->lock);
	f->refs--;
	f->holds--;
	pthread_mutex_unlock(&f->eng->lock);
}

/* A file of @eng that GPU work holds (eng->lock held), or NULL. */
phx_file *file_held_locked(phx_engine *eng)
{
	phx_file *f;

	for (f = eng->files; f; f = f->next)
		if (f->holds)
			return f;
	return NULL;
}

PHX_EXPORT int phx_file_check_range(const phx_file *f, uint64_t offset, uint64_t len)
{
	if (!f)
		return phx_err(-EBADF, "phx_file_check_range: NULL file");
	return inode_bad_check(f->inode, offset, len);
}

void file_close_all(phx_engine *eng)
{
	pthread_mutex_lock(&eng->lock);
	while (eng->files)
		file_free(eng, eng->files);
	pthread_mutex_unlock(&eng->lock);
}

PHX_EXPORT int phx_file_get_info(const phx_file *f, struct phx_file_info *info)
{
	if (!f || !info)
		return phx_err(-EINVAL, "phx_file_get_info: NULL argument");
	memset(info, 0, sizeof(*info));
	info->size = sizeof(*info);
	info->fd = f->fd;
	info->direct = f->direct;
	info->registered = f->slot >= 0;
	info->mem_align = f->mem_align;
	info->offset_align = f->offset_align;
	info->align_from_statx = f->align_from_statx;
	info->open_flags = f->open_flags;
	return 0;
}
