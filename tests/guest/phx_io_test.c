// SPDX-License-Identifier: GPL-2.0
/*
 * Description: guest-side tests of phx.ko (and host-side checks of the
 * ivshmem backing file).  One program, one sub-command per test; each
 * prints "PHX-PASS <name>" / "PHX-FAIL <name>: why" lines and exits 0 when
 * everything it ran passed, 1 otherwise, 77 when it cannot run here.
 *
 *   phx_io_test io BDF BAR REGOFF REGLEN DIR ENGINE   O_DIRECT byte checks
 *   phx_io_test fillbar BDF BAR REGOFF REGLEN DIR OFF LEN SEED
 *                    file of seeded data -> BAR (host checks the file)
 *   phx_io_test checkbar BDF BAR REGOFF REGLEN DIR OFF LEN SEED
 *                    BAR bytes the host seeded -> file -> compare
 *   phx_io_test hostfill FILE OFF LEN SEED   (host) seed the backing file
 *   phx_io_test hostcheck FILE OFF LEN SEED  (host) compare it
 *   phx_io_test validate BDF BAR              every bad argument refused
 *   phx_io_test garbage BDF BAR N [SEED]      N random ioctls/mmaps
 *   phx_io_test hold BDF BAR REGOFF REGLEN    register, map, sleep
 *   phx_io_test busyio BDF BAR REGOFF REGLEN DIR   I/O until killed
 *   phx_io_test unreg BDF BAR REGOFF REGLEN DIR    unregister under I/O
 *   phx_io_test fork BDF BAR REGOFF REGLEN    the child has no mapping
 *   phx_io_test fixedbuf BDF BAR REGOFF REGLEN DIR  io_uring fixed buffer, exit
 *   phx_io_test info                          print PHX_IOC_INFO
 *
 *   phx_io_test splice BDF REGOFF REGLEN [rmmod]  a page (BAR 2) held by a
 *                    pipe past the unregister (and rmmod must not hang)
 *   phx_io_test nonroot BDF UID GID             ioctls, ALLOW_IOMMU, limits
 *                    as a non-root member of /dev/phx's group
 *
 * BDF may be "nv:VA": the NVIDIA provider (phx_nv.ko over nv_p2p_stub.ko)
 * at GPU VA + REGOFF instead of a BAR.  NVIDIA-only commands:
 *   phx_io_test nvcb nv:VA REGOFF REGLEN DIR ROUNDS  cudaFree under I/O
 *   phx_io_test nvreg nv:VA N                 cudaFree racing registration
 *   phx_io_test nvreuse nv:VA REGOFF REGLEN DIR  freed memory registered again
 *   phx_io_test nvsparse VA LEN DIR            > 16 GiB sparse registration
 *   phx_io_test nvfail nv:VA DIR               driver errors, odd page tables
 *   phx_io_test nvapi nv:VA KIND               stub variant: cap, none
 *   phx_io_test race nv:VA KIND N SEED         two racing actors, N times
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <liburing.h>
#include <pthread.h>
#include <setjmp.h>
#include <signal.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <linux/capability.h>
#include <sys/ioctl.h>
#include <grp.h>
#include <sys/prctl.h>
#include <sys/uio.h>
#include <sys/syscall.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "../../kernel/include/uapi/phx_uapi.h"

static int failures;

#define PASS(...) do { printf("PHX-PASS "); printf(__VA_ARGS__); \
	printf("\n"); fflush(stdout); } while (0)
#define FAIL(...) do { printf("PHX-FAIL "); printf(__VA_ARGS__); \
	printf("\n"); fflush(stdout); failures++; } while (0)

/* ---- seeded data: xorshift64, 8 bytes little-endian per step ---- */

static uint64_t seeded_word(uint64_t seed, uint64_t w)
{
	uint64_t x = (seed ^ w) * 0x9E3779B97F4A7C15ULL;

	x ^= x >> 29;
	x *= 0xBF58476D1CE4E5B9ULL;
	x ^= x >> 32;
	return x;
}

/* Byte i of the stream (seed) sits at stream position pos + i. */
static void seeded(uint8_t *p, size_t len, uint64_t seed, uint64_t pos)
{
	size_t i = 0;

	if (!(pos & 7) && !((uintptr_t)p & 7)) {
		for (; i + 8 <= len; i += 8) {
			uint64_t x = seeded_word(seed, (pos + i) >> 3);

			memcpy(p + i, &x, 8);	/* little-endian host */
		}
	}
	for (; i < len; i++)
		p[i] = (uint8_t)(seeded_word(seed, (pos + i) >> 3) >>
				 (((pos + i) & 7) * 8));
}

static void *xalloc(size_t len)
{
	void *p;

	if (posix_memalign(&p, 4096, len ? len : 4096)) {
		perror("posix_memalign");
		exit(1);
	}
	return p;
}

static int first_diff(const uint8_t *a, const uint8_t *b, size_t len)
{
	size_t i;

	for (i = 0; i < len; i++)
		if (a[i] != b[i])
			return (int)(i < 0x7fffffff ? i : 0x7fffffff);
	return -1;
}

/* ---- /dev/phx ---- */

/*
 * Where a test's registration comes from: a PCI BAR ("DDDD:BB:DD.F") or,
 * with "nv:VA", the NVIDIA provider at GPU VA + offset (the stub maps its
 * VA base onto the ivshmem BAR, so offsets mean the same in both).
 */
struct bdf { unsigned int dom, bus, dev, fn; int nv; uint64_t nv_va; };

static int parse_bdf(const char *s, struct bdf *b)
{
	memset(b, 0, sizeof(*b));
	if (!strncmp(s, "nv:", 3)) {
		b->nv = 1;
		b->nv_va = strtoull(s + 3, NULL, 0);
		return 0;
	}
	return sscanf(s, "%x:%x:%x.%x", &b->dom, &b->bus, &b->dev, &b->fn) == 4
		? 0 : -1;
}

static int phx_open(void)
{
	int fd = open(PHX_DEVICE_PATH, O_RDWR | O_CLOEXEC);

	if (fd < 0) {
		printf("PHX-SKIP cannot open %s: %s\n", PHX_DEVICE_PATH,
		       strerror(errno));
		exit(77);
	}
	return fd;
}

static void reg_init(struct phx_register *r, const struct bdf *b, int bar,
		     uint64_t off, uint64_t len)
{
	memset(r, 0, sizeof(*r));
	r->abi_version = PHX_ABI_VERSION;
	r->length = len;
	if (b->nv) {
		r->provider = PHX_PROV_NVIDIA;
		r->gpu_va = b->nv_va + off;
		return;
	}
	r->provider = PHX_PROV_PCIBAR;
	r->pci_domain = b->dom;
	r->pci_bus = b->bus;
	r->pci_devfn = (b->dev << 3) | b->fn;
	r->pci_bar = bar;
	r->offset = off;
	r->length = len;
}

/* register + mmap; returns the mapping, fills *reg */
static uint8_t *phx_map(int fd, const struct bdf *b, int bar, uint64_t off,
			uint64_t len, struct phx_register *reg)
{
	void *p;

	int tries = 0;

	/* EBUSY: a process that just exited may still be releasing the range */
	do {
		reg_init(reg, b, bar, off, len);
		if (!ioctl(fd, PHX_IOC_REGISTER, reg) || errno != EBUSY)
			break;
		usleep(10000);
	} while (++tries < 500);
	if (tries == 500 || reg->handle == 0) {
		printf("PHX-FAIL register %#" PRIx64 "+%#" PRIx64 ": %s\n",
		       off, len, strerror(errno));
		exit(1);
	}
	p = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_SHARED, fd,
		 (off_t)reg->mmap_offset);
	if (p == MAP_FAILED) {
		printf("PHX-FAIL mmap: %s\n", strerror(errno));
		exit(1);
	}
	return p;
}

static int phx_unreg(int fd, uint32_t handle)
{
	struct phx_unregister u = { .abi_version = PHX_ABI_VERSION,
				    .handle = handle };

	return ioctl(fd, PHX_IOC_UNREGISTER, &u) ? -errno : 0;
}

static int phx_info(int fd, struct phx_info *info)
{
	memset(info, 0, sizeof(*info));
	info->abi_version = PHX_ABI_VERSION;
	return ioctl(fd, PHX_IOC_INFO, info) ? -errno : 0;
}

/* ---- files ---- */

/* A file of @len seeded bytes, written through the page cache, synced. */
static void make_file(const char *path, size_t len, uint64_t seed)
{
	size_t chunk = 1 << 20, done;
	uint8_t *buf = xalloc(chunk);
	int fd = open(path, O_CREAT | O_TRUNC | O_WRONLY, 0644);

	if (fd < 0) {
		perror(path);
		exit(1);
	}
	for (done = 0; done < len; done += chunk) {
		size_t n = len - done < chunk ? len - done : chunk;

		seeded(buf, n, seed, done);
		if (write(fd, buf, n) != (ssize_t)n) {
			perror("write");
			exit(1);
		}
	}
	fsync(fd);
	close(fd);
	free(buf);
}

static void drop_caches(void)
{
	int fd = open("/proc/sys/vm/drop_caches", O_WRONLY);

	if (fd >= 0) {
		if (write(fd, "3", 1) < 0)
			perror("drop_caches");
		close(fd);
	}
}

/* Read @len bytes at @off of @path into host memory (buffered, no phx). */
static uint8_t *slurp(const char *path, off_t off, size_t len)
{
	uint8_t *buf = xalloc(len);
	int fd = open(path, O_RDONLY);

	if (fd < 0 || pread(fd, buf, len, off) != (ssize_t)len) {
		perror("slurp");
		exit(1);
	}
	close(fd);
	return buf;
}

/* ---- one O_DIRECT transfer, pread/pwrite or io_uring ---- */

static struct io_uring ring;
static int ring_ok;

static ssize_t xfer(int fd, void *buf, size_t len, off_t off, int write_,
		    int uring)
{
	if (!uring)
		return write_ ? pwrite(fd, buf, len, off) : pread(fd, buf, len, off);
	{
		struct io_uring_sqe *sqe;
		struct io_uring_cqe *cqe;
		ssize_t res;

		if (!ring_ok) {
			if (io_uring_queue_init(8, &ring, 0)) {
				errno = ENOSYS;
				return -1;
			}
			ring_ok = 1;
		}
		sqe = io_uring_get_sqe(&ring);
		if (write_)
			io_uring_prep_write(sqe, fd, buf, len, off);
		else
			io_uring_prep_read(sqe, fd, buf, len, off);
		io_uring_submit(&ring);
		if (io_uring_wait_cqe(&ring, &cqe)) {
			errno = EIO;
			return -1;
		}
		res = cqe->res;
		io_uring_cqe_seen(&ring, cqe);
		if (res < 0) {
			errno = (int)-res;
			return -1;
		}
		return res;
	}
}

/*
 * The core test: for several sizes, file offsets and offsets inside the
 * mapping, O_DIRECT read a seeded file into the BAR and compare, then fill
 * the BAR with new bytes, O_DIRECT write them to the file and compare what
 * the file holds (read back through the page cache, into host memory).
 */
static int cmd_io(const struct bdf *b, int bar, uint64_t regoff, uint64_t reglen,
		  const char *dir, const char *engine)
{
	static const size_t sizes[] = { 4096, 65536, 1 << 20, 8 << 20, 24 << 20 };
	static const off_t foffs[] = { 0, 4096, 3 << 20 };
	static const size_t boffs[] = { 0, 4096, 1 << 20 };
	int uring = !strcmp(engine, "uring");
	struct phx_register reg;
	char path[512];
	size_t fsize = 32 << 20;
	uint8_t *map, *exp;
	int fd = phx_open(), dfd;
	unsigned int si, fi, bi, cases = 0;
	uint64_t seed = 0x5eed0000 + (uring ? 1 : 0);

	map = phx_map(fd, b, bar, regoff, reglen, &reg);
	snprintf(path, sizeof(path), "%s/phx-io-%s.dat", dir, engine);
	make_file(path, fsize, seed);
	drop_caches();
	exp = xalloc(fsize);
	dfd = open(path, O_RDWR | O_DIRECT);
	if (dfd < 0) {
		FAIL("io-%s open O_DIRECT %s: %s", engine, path, strerror(errno));
		return 1;
	}
	for (si = 0; si < sizeof(sizes) / sizeof(sizes[0]); si++)
	for (fi = 0; fi < sizeof(foffs) / sizeof(foffs[0]); fi++)
	for (bi = 0; bi < sizeof(boffs) / sizeof(boffs[0]); bi++) {
		size_t len = sizes[si], boff = boffs[bi];
		off_t foff = foffs[fi];
		ssize_t n;
		int d;
		uint8_t *file;

		if (boff + len > reglen || foff + len > fsize)
			continue;
		cases++;
		/* read: SSD -> BAR */
		memset(map + boff, 0xA5, len);
		n = xfer(dfd, map + boff, len, foff, 0, uring);
		seeded(exp, len, seed, foff);
		if (n != (ssize_t)len) {
			FAIL("io-%s read len=%zu foff=%jd boff=%zu: %zd (%s)",
			     engine, len, (intmax_t)foff, boff, n, strerror(errno));
			continue;
		}
		d = first_diff(map + boff, exp, len);
		if (d >= 0) {
			FAIL("io-%s read len=%zu foff=%jd boff=%zu: byte %d differs",
			     engine, len, (intmax_t)foff, boff, d);
			continue;
		}
		/* write: BAR -> SSD, with new bytes */
		seeded(map + boff, len, seed ^ 0xFFFF, foff);
		n = xfer(dfd, map + boff, len, foff, 1, uring);
		if (n != (ssize_t)len) {
			FAIL("io-%s write len=%zu foff=%jd boff=%zu: %zd (%s)",
			     engine, len, (intmax_t)foff, boff, n, strerror(errno));
			continue;
		}
		drop_caches();
		file = slurp(path, foff, len);
		seeded(exp, len, seed ^ 0xFFFF, foff);
		d = first_diff(file, exp, len);
		free(file);
		if (d >= 0) {
			FAIL("io-%s write len=%zu foff=%jd boff=%zu: file byte %d differs",
			     engine, len, (intmax_t)foff, boff, d);
			continue;
		}
		/* restore the file for later cases */
		seeded(exp, len, seed, foff);
		if (pwrite(dfd, exp, len, foff) != (ssize_t)len)
			FAIL("io-%s restore: %s", engine, strerror(errno));
	}
	close(dfd);
	unlink(path);
	munmap(map, reglen);
	if (phx_unreg(fd, reg.handle))
		FAIL("io-%s unregister", engine);
	close(fd);
	if (!failures)
		PASS("io-%s (%u cases, mode %s, 4 KiB..24 MiB)", engine, cases,
		     reg.mode == PHX_MODE_P2PDMA ? "P2PDMA" : "GENERIC");
	return failures ? 1 : 0;
}

/* Seeded file -> O_DIRECT read into the BAR at @off; the host checks. */
static int cmd_fillbar(const struct bdf *b, int bar, uint64_t regoff,
		       uint64_t reglen, const char *dir, uint64_t off,
		       uint64_t len, uint64_t seed)
{
	struct phx_register reg;
	char path[512];
	int fd = phx_open(), dfd;
	uint8_t *map = phx_map(fd, b, bar, regoff, reglen, &reg);
	uint8_t *exp = xalloc(len);

	snprintf(path, sizeof(path), "%s/phx-fill.dat", dir);
	make_file(path, len, seed);
	drop_caches();
	dfd = open(path, O_RDONLY | O_DIRECT);
	if (dfd < 0 || pread(dfd, map + off, len, 0) != (ssize_t)len) {
		FAIL("fillbar pread: %s", strerror(errno));
		return 1;
	}
	seeded(exp, len, seed, 0);
	if (first_diff(map + off, exp, len) >= 0)
		FAIL("fillbar guest compare");
	else
		PASS("fillbar %#" PRIx64 "+%#" PRIx64 " (guest compare)", off, len);
	/* BAR offset of the bytes = regoff + off: the host checks there */
	printf("PHX-HOSTCHECK %" PRIu64 " %" PRIu64 " %" PRIu64 "\n",
	       regoff + off, len, seed);
	close(dfd);
	unlink(path);
	return failures ? 1 : 0;
}

/* The host seeded BAR bytes before boot: O_DIRECT write them to a file. */
static int cmd_checkbar(const struct bdf *b, int bar, uint64_t regoff,
			uint64_t reglen, const char *dir, uint64_t off,
			uint64_t len, uint64_t seed)
{
	struct phx_register reg;
	char path[512];
	int fd = phx_open(), dfd;
	uint8_t *map = phx_map(fd, b, bar, regoff, reglen, &reg);
	uint8_t *exp = xalloc(len), *file;

	snprintf(path, sizeof(path), "%s/phx-check.dat", dir);
	dfd = open(path, O_CREAT | O_TRUNC | O_WRONLY | O_DIRECT, 0644);
	if (dfd < 0 || pwrite(dfd, map + off, len, 0) != (ssize_t)len) {
		FAIL("checkbar pwrite: %s", strerror(errno));
		return 1;
	}
	close(dfd);
	drop_caches();
	file = slurp(path, 0, len);
	seeded(exp, len, seed, 0);
	if (first_diff(file, exp, len) >= 0)
		FAIL("checkbar: file differs from the host-seeded BAR bytes");
	else
		PASS("checkbar %#" PRIx64 "+%#" PRIx64 " (host-seeded BAR -> SSD)",
		     off, len);
	unlink(path);
	return failures ? 1 : 0;
}

static int cmd_host(const char *file, uint64_t off, uint64_t len, uint64_t seed,
		    int fill)
{
	uint8_t *exp = xalloc(len), *got;
	int fd, d;

	seeded(exp, len, seed, 0);
	if (fill) {
		fd = open(file, O_WRONLY);
		if (fd < 0 || pwrite(fd, exp, len, off) != (ssize_t)len) {
			perror("hostfill");
			return 1;
		}
		close(fd);
		return 0;
	}
	got = slurp(file, off, len);
	d = first_diff(got, exp, len);
	if (d >= 0) {
		FAIL("hostcheck %s %#" PRIx64 "+%#" PRIx64 ": byte %d differs",
		     file, off, len, d);
		return 1;
	}
	PASS("hostcheck %#" PRIx64 "+%#" PRIx64 " of the ivshmem backing file",
	     off, len);
	return 0;
}

/* ---- argument validation ---- */

/* Drop CAP_SYS_ADMIN from every set of this process (uid stays 0). */
static int drop_cap_sys_admin(void)
{
	struct __user_cap_header_struct h = { _LINUX_CAPABILITY_VERSION_3, 0 };
	struct __user_cap_data_struct d[2];

	if (prctl(PR_CAPBSET_DROP, CAP_SYS_ADMIN, 0, 0, 0) ||
	    syscall(SYS_capget, &h, d))
		return -1;
	d[CAP_SYS_ADMIN / 32].effective &= ~(1U << (CAP_SYS_ADMIN % 32));
	d[CAP_SYS_ADMIN / 32].permitted &= ~(1U << (CAP_SYS_ADMIN % 32));
	d[CAP_SYS_ADMIN / 32].inheritable &= ~(1U << (CAP_SYS_ADMIN % 32));
	return syscall(SYS_capset, &h, d) ? -1 : 0;
}

static void expect_errno(const char *what, int ret, int want)
{
	if (ret == -1 && errno == want)
		return;
	FAIL("validate %s: got %d/%s, want %s", what, ret,
	     ret ? strerror(errno) : "success", strerror(want));
}

static int cmd_validate(const struct bdf *b, int bar)
{
	int fd = phx_open();
	struct phx_register r;
	struct phx_unregister u;
	struct phx_info info;
	struct stat st;
	void *p;
	pid_t pid;
	int status;

#define BAD(field_stmt, want) do { reg_init(&r, b, bar, 0, 2 << 20); \
	field_stmt; expect_errno(#field_stmt, ioctl(fd, PHX_IOC_REGISTER, &r), \
				 want); } while (0)
	BAD(r.abi_version = 0, EINVAL);
	BAD(r.abi_version = 2, EINVAL);
	BAD(r.provider = 0, EINVAL);
	BAD(r.provider = 99, EINVAL);
	BAD(r.flags = 1U << 31, EINVAL);
	BAD(r.pad = 1, EINVAL);
	BAD(r.reserved[3] = 1, EINVAL);
	BAD(r.length = 0, EINVAL);
	BAD(r.length = 4096, EINVAL);
	BAD(r.offset = 4096, EINVAL);
	BAD(r.length = 1ULL << 50, EINVAL);
	BAD(r.offset = ~0ULL << 21, EINVAL);
	BAD(r.offset = 1ULL << 40, EINVAL);
	BAD(r.pci_bar = 6, EINVAL);
	BAD(r.pci_bar = 255, EINVAL);
	BAD(r.gpu_va = 1 << 21, EINVAL);
	BAD(r.pci_bus = 0xfe, ENODEV);
	BAD(r.pci_domain = 0x10000, EINVAL);
	BAD(r.pci_bar = 0, EINVAL);	/* ivshmem BAR 0 is 256 bytes */
	BAD((r.provider = PHX_PROV_NVIDIA, r.pci_bus = 0, r.pci_devfn = 0,
	     r.pci_bar = 0, r.pci_domain = 0), ENODEV);
#undef BAD
	expect_errno("register NULL", ioctl(fd, PHX_IOC_REGISTER, NULL), EFAULT);
	expect_errno("register bad ptr",
		     ioctl(fd, PHX_IOC_REGISTER, (void *)0xffff880000000000ULL),
		     EFAULT);
	expect_errno("unknown ioctl", ioctl(fd, _IO(PHX_IOC_MAGIC, 0x42)), ENOTTY);
	memset(&u, 0, sizeof(u));
	u.abi_version = PHX_ABI_VERSION;
	u.handle = 12345;
	expect_errno("unregister unknown", ioctl(fd, PHX_IOC_UNREGISTER, &u), ENOENT);
	u.flags = 1;
	expect_errno("unregister flags", ioctl(fd, PHX_IOC_UNREGISTER, &u), EINVAL);
	memset(&info, 0, sizeof(info));
	expect_errno("info version 0", ioctl(fd, PHX_IOC_INFO, &info), EINVAL);

	/* mmap misuse */
	reg_init(&r, b, bar, 0, 2 << 20);
	if (ioctl(fd, PHX_IOC_REGISTER, &r)) {
		FAIL("validate register: %s", strerror(errno));
		return 1;
	}
	if (r.mmap_offset < (1ULL << 40) || r.handle == 0)
		FAIL("validate: odd handle/offset %u %#llx", r.handle,
		     (unsigned long long)r.mmap_offset);
	reg_init(&r, b, bar, 0, 2 << 20);
	expect_errno("register same range twice",
		     ioctl(fd, PHX_IOC_REGISTER, &r), EBUSY);
	reg_init(&r, b, bar, 0, 2 << 20);
	r.handle = 0;
	/* re-fetch the first registration's values */
	{
		struct phx_register r0;

		reg_init(&r0, b, bar, 2 << 20, 2 << 20);
		if (ioctl(fd, PHX_IOC_REGISTER, &r0)) {
			FAIL("validate second register: %s", strerror(errno));
			return 1;
		}
		p = mmap(NULL, 2 << 20, PROT_READ | PROT_WRITE, MAP_PRIVATE, fd,
			 (off_t)r0.mmap_offset);
		expect_errno("mmap MAP_PRIVATE", p == MAP_FAILED ? -1 : 0, EINVAL);
		p = mmap(NULL, 4 << 20, PROT_READ | PROT_WRITE, MAP_SHARED, fd,
			 (off_t)r0.mmap_offset);
		expect_errno("mmap too long", p == MAP_FAILED ? -1 : 0, EINVAL);
		p = mmap(NULL, 4096, PROT_READ | PROT_WRITE, MAP_SHARED, fd,
			 (off_t)(r0.mmap_offset + (2 << 20)));
		expect_errno("mmap past end", p == MAP_FAILED ? -1 : 0, EINVAL);
		p = mmap(NULL, 4096, PROT_READ | PROT_WRITE, MAP_SHARED, fd,
			 (off_t)(999ULL << 40));
		expect_errno("mmap unknown offset", p == MAP_FAILED ? -1 : 0, ENXIO);
		p = mmap(NULL, 4096, PROT_READ, MAP_SHARED, fd, 0);
		expect_errno("mmap offset 0", p == MAP_FAILED ? -1 : 0, ENXIO);
		/* another open file cannot map this registration */
		{
			int fd2 = phx_open();

			p = mmap(NULL, 4096, PROT_READ, MAP_SHARED, fd2,
				 (off_t)r0.mmap_offset);
			expect_errno("mmap from another fd",
				     p == MAP_FAILED ? -1 : 0, ENXIO);
			u.flags = 0;
			u.handle = r0.handle;
			expect_errno("unregister from another fd",
				     ioctl(fd2, PHX_IOC_UNREGISTER, &u), ENOENT);
			close(fd2);
		}
		/* PTEs dropped by MADV_DONTNEED come back on the next touch */
		p = mmap(NULL, 2 << 20, PROT_READ | PROT_WRITE, MAP_SHARED, fd,
			 (off_t)r0.mmap_offset);
		if (p == MAP_FAILED) {
			FAIL("validate mmap: %s", strerror(errno));
		} else {
			memset(p, 0x3c, 8192);
			if (madvise(p, 2 << 20, MADV_DONTNEED))
				FAIL("validate madvise: %s", strerror(errno));
			if (((uint8_t *)p)[4096] != 0x3c)
				FAIL("validate: refault after MADV_DONTNEED lost the bytes");
			munmap(p, 2 << 20);
		}
		/* a sub-range mapping at an offset works */
		p = mmap(NULL, 1 << 20, PROT_READ | PROT_WRITE, MAP_SHARED, fd,
			 (off_t)(r0.mmap_offset + (1 << 20)));
		if (p == MAP_FAILED)
			FAIL("validate sub-range mmap: %s", strerror(errno));
		else
			munmap(p, 1 << 20);
	}

	/*
	 * The PCI BAR provider checks CAP_SYS_ADMIN of the opener of the fd:
	 * a process that opened /dev/phx without it is refused, and an fd
	 * opened with it keeps working after its holder dropped privileges.
	 */
	pid = fork();
	if (pid == 0) {
		int fd2;

		if (drop_cap_sys_admin())
			_exit(2);
		fd2 = phx_open();
		reg_init(&r, b, bar, 8 << 20, 2 << 20);
		_exit(ioctl(fd2, PHX_IOC_REGISTER, &r) == -1 && errno == EPERM ? 0 : 1);
	}
	waitpid(pid, &status, 0);
	if (!WIFEXITED(status) || WEXITSTATUS(status))
		FAIL("validate: PCI BAR registration on an fd opened without CAP_SYS_ADMIN not refused (%d)",
		     WIFEXITED(status) ? WEXITSTATUS(status) : -1);
	pid = fork();
	if (pid == 0) {
		reg_init(&r, b, bar, 8 << 20, 2 << 20);
		if (setgid(65534) || setuid(65534))
			_exit(2);
		_exit(ioctl(fd, PHX_IOC_REGISTER, &r) == 0 ? 0 : 1);
	}
	waitpid(pid, &status, 0);
	if (!WIFEXITED(status) || WEXITSTATUS(status))
		FAIL("validate: an fd opened by root refused a registration after setuid(65534) "
		     "(the opener's rights must count)");

	if (stat(PHX_DEVICE_PATH, &st) || (st.st_mode & 0777) != 0660)
		FAIL("validate: %s mode %o, want 0660", PHX_DEVICE_PATH,
		     st.st_mode & 0777);
	if (phx_info(fd, &info) || info.abi_version != PHX_ABI_VERSION ||
	    info.reg_align != PHX_REG_ALIGN)
		FAIL("validate: info");
	close(fd);	/* releases both registrations (in the background) */
	fd = phx_open();
	for (int i = 0; i < 500; i++) {
		if (phx_info(fd, &info) || info.nr_regs == 0)
			break;
		usleep(10000);
	}
	if (phx_info(fd, &info) || info.nr_regs != 0)
		FAIL("validate: %llu registrations left after close",
		     (unsigned long long)info.nr_regs);
	close(fd);
	if (!failures)
		PASS("validate (bad arguments refused with the right errno)");
	return failures ? 1 : 0;
}

/* ---- garbage ---- */

static uint64_t rng_state = 0x1234567;

static uint64_t rnd(void)
{
	rng_state ^= rng_state << 13;
	rng_state ^= rng_state >> 7;
	rng_state ^= rng_state << 17;
	return rng_state;
}

/*
 * What the fuzzer knows, to judge each call against the ABI contract
 * (phx_uapi.h, docs/kernel.md) rather than only surviving it: the device,
 * the live registrations of the current fd and every mapping it made.
 */
struct gz {
	const struct bdf *b;
	int bar;
	uint64_t bar_size;
	uint64_t max_reg;
	int fd;
	uint32_t live[256];	/* handles registered on fd, not unregistered */
	uint64_t live_len[256];
	int nlive;
	struct { void *p; size_t len; } maps[4096];
	int nmaps;
	long judged, wrong;
};

#define GZ_WRONG(gz, ...) do { if ((gz)->wrong++ < 10) FAIL(__VA_ARGS__); } while (0)

/* Size of BAR @bar of @b from sysfs (0 if unknown). */
static uint64_t bar_size(const struct bdf *b, int bar)
{
	char path[128];
	unsigned long long start, end, flags;
	FILE *f;
	int i, ok = 0;

	snprintf(path, sizeof(path), "/sys/bus/pci/devices/%04x:%02x:%02x.%x/resource",
		 b->dom, b->bus, b->dev, b->fn);
	f = fopen(path, "r");
	if (!f)
		return 0;
	for (i = 0; i <= bar; i++)
		ok = fscanf(f, "%llx %llx %llx", &start, &end, &flags) == 3;
	fclose(f);
	return ok && end > start ? end - start + 1 : 0;
}

static int gz_find(const struct gz *gz, uint32_t handle)
{
	int i;

	for (i = 0; i < gz->nlive; i++)
		if (gz->live[i] == handle)
			return i;
	return -1;
}

static void gz_track_map(struct gz *gz, void *p, size_t len)
{
	if (gz->nmaps < (int)(sizeof(gz->maps) / sizeof(gz->maps[0]))) {
		gz->maps[gz->nmaps].p = p;
		gz->maps[gz->nmaps].len = len;
		gz->nmaps++;
	} else {
		munmap(p, len);
	}
}

enum { PRED_VALID, PRED_EINVAL, PRED_FAIL };

/* What PHX_IOC_REGISTER must do with @r (as passed) on this device. */
static int reg_predict(const struct gz *gz, const struct phx_register *r)
{
	uint64_t end;
	int i;

	if (r->abi_version != PHX_ABI_VERSION || (r->flags & ~PHX_REG_FLAGS_ALL) ||
	    r->pad)
		return PRED_EINVAL;
	for (i = 0; i < 4; i++)
		if (r->reserved[i])
			return PRED_EINVAL;
	if (!r->length || r->length % PHX_REG_ALIGN || r->length > gz->max_reg ||
	    r->length > (1ULL << 40))
		return PRED_EINVAL;
	if (r->provider != PHX_PROV_PCIBAR)
		return r->provider == PHX_PROV_NVIDIA ? PRED_FAIL : PRED_EINVAL;
	if (r->gpu_va || r->pci_bar > 5 || r->pci_domain > 0xffff ||
	    r->offset % PHX_REG_ALIGN || __builtin_add_overflow(r->offset, r->length, &end))
		return PRED_EINVAL;
	if (r->pci_domain != gz->b->dom || r->pci_bus != gz->b->bus ||
	    r->pci_devfn != ((gz->b->dev << 3) | gz->b->fn) || r->pci_bar != gz->bar)
		return PRED_FAIL;	/* another device or BAR: refused, errno varies */
	if (end > gz->bar_size)
		return PRED_EINVAL;
	return PRED_VALID;
}

/*
 * Judge one ioctl that reached phx (cmd is one of its three): @in is the
 * argument as passed (@arg_kind 0 NULL, 1 wild, 2 straddling, 3 buf).
 */
static void gz_judge_ioctl(struct gz *gz, unsigned int cmd, int arg_kind,
			   uint64_t wild, const uint8_t *in, const uint8_t *out,
			   int ret, int err)
{
	const char *name = cmd == PHX_IOC_INFO ? "INFO" :
			   cmd == PHX_IOC_REGISTER ? "REGISTER" : "UNREGISTER";

	if (arg_kind == 0 || (arg_kind == 1 && wild >= (1ULL << 47))) {
		/* NULL or a kernel/non-canonical address */
		gz->judged++;
		if (ret == 0 || err != EFAULT)
			GZ_WRONG(gz, "garbage: %s with pointer %#" PRIx64 ": %s, want EFAULT",
				 name, wild, ret ? strerror(err) : "success");
		return;
	}
	if (arg_kind == 1)
		return;		/* a user address: may be mapped, not judged */
	if (arg_kind == 2) {
		/* 8 random bytes of buf, then whatever follows it */
		gz->judged++;
		if (ret == 0 || (err != EFAULT && err != EINVAL))
			GZ_WRONG(gz, "garbage: %s straddling buf: %s, want EFAULT or EINVAL",
				 name, ret ? strerror(err) : "success");
		return;
	}
	gz->judged++;
	if (cmd == PHX_IOC_INFO) {
		const struct phx_info *i = (const void *)in, *o = (const void *)out;
		int valid = i->abi_version == PHX_ABI_VERSION && !i->pad &&
			    !i->reserved[0] && !i->reserved[1] && !i->reserved[2] &&
			    !i->reserved[3];

		if (valid && (ret || o->abi_version != PHX_ABI_VERSION ||
			      o->reg_align != PHX_REG_ALIGN || o->max_reg_bytes != gz->max_reg))
			GZ_WRONG(gz, "garbage: valid INFO: %s, abi %u align %u",
				 ret ? strerror(err) : "ok", o->abi_version, o->reg_align);
		else if (!valid && (ret == 0 || err != EINVAL))
			GZ_WRONG(gz, "garbage: INFO with bad fields: %s, want EINVAL",
				 ret ? strerror(err) : "success");
	} else if (cmd == PHX_IOC_REGISTER) {
		const struct phx_register *i = (const void *)in, *o = (const void *)out;
		int pred = reg_predict(gz, i);

		if (ret == 0) {
			if (pred != PRED_VALID)
				GZ_WRONG(gz, "garbage: REGISTER accepted what the ABI refuses "
					 "(off %#llx len %#llx flags %#x)",
					 (unsigned long long)i->offset,
					 (unsigned long long)i->length, i->flags);
			if (!o->handle || o->mmap_offset != (uint64_t)o->handle << 40 ||
			    (o->mode != PHX_MODE_GENERIC && o->mode != PHX_MODE_P2PDMA) ||
			    gz_find(gz, o->handle) >= 0)
				GZ_WRONG(gz, "garbage: REGISTER out fields: handle %u "
					 "mmap_offset %#llx mode %u", o->handle,
					 (unsigned long long)o->mmap_offset, o->mode);
			else if (gz->nlive < 256) {
				gz->live[gz->nlive] = o->handle;
				gz->live_len[gz->nlive++] = i->length;
			}
		} else if (pred == PRED_EINVAL && err != EINVAL) {
			GZ_WRONG(gz, "garbage: bad REGISTER: %s, want EINVAL", strerror(err));
		} else if (pred == PRED_VALID && err != EBUSY && err != ENOMEM) {
			/* valid: only a range in use or memory may stop it */
			GZ_WRONG(gz, "garbage: valid REGISTER off %#llx len %#llx"
				 ": %s, want success, EBUSY or ENOMEM",
				 (unsigned long long)i->offset,
				 (unsigned long long)i->length, strerror(err));
		}
	} else {
		const struct phx_unregister *u = (const void *)in;
		int valid = u->abi_version == PHX_ABI_VERSION && !u->flags && !u->pad &&
			    u->handle;
		int at = valid ? gz_find(gz, u->handle) : -1;
		int want = !valid ? EINVAL : at < 0 ? ENOENT : 0;

		if ((want == 0 && ret) || (want && (ret == 0 || err != want)))
			GZ_WRONG(gz, "garbage: UNREGISTER handle %u (%s): %s, want %s",
				 u->handle, at >= 0 ? "live" : "not live",
				 ret ? strerror(err) : "success",
				 want ? strerror(want) : "success");
		if (ret == 0 && at >= 0) {
			gz->live[at] = gz->live[--gz->nlive];
			gz->live_len[at] = gz->live_len[gz->nlive];
		}
	}
}

/*
 * Break exactly one rule of a valid PCI BAR registration, so that every
 * rule is exercised on its own (several broken at once hide each other).
 */
static void reg_break_one(const struct gz *gz, struct phx_register *r)
{
	switch (rnd() % 15) {
	case 0:
		r->abi_version = (uint32_t)rnd() | 2;	/* never 1 */
		break;
	case 1:
		r->provider = 3 + rnd() % 100;
		break;
	case 2:
		r->flags = (uint32_t)rnd() | 2;		/* an undefined bit */
		break;
	case 3:
		r->pad = 1 + rnd() % 255;
		break;
	case 4:
		r->reserved[rnd() % 4] = rnd() | 1;
		break;
	case 5:
		r->length = 0;
		break;
	case 6:
		r->length += 4096 * (1 + rnd() % 511);	/* not 2 MiB aligned */
		break;
	case 7:
		r->offset += 4096 * (1 + rnd() % 511);
		break;
	case 8:
		r->offset = gz->bar_size + ((rnd() % 4) << 21);	/* past the BAR */
		break;
	case 9:
		r->length = (rnd() | (1ULL << 41)) & ~(PHX_REG_ALIGN - 1);	/* too big */
		break;
	case 10:
		r->gpu_va = rnd() | 1;
		break;
	case 11:
		r->pci_bar = 6 + rnd() % 250;
		break;
	case 12:
		r->pci_bar = 0;		/* ivshmem's BAR 0: 256 bytes of registers */
		break;
	case 13:
		r->pci_bus = 0xf0 + rnd() % 15;	/* no device there */
		break;
	default:
		r->offset = ~0ULL & ~(PHX_REG_ALIGN - 1);	/* offset + length overflows */
	}
}

/* A random mmap: success only for a shared mapping inside a live registration. */
static void gz_random_mmap(struct gz *gz)
{
	size_t len = (rnd() % 5) << 20;
	int shared = rnd() & 1;
	uint64_t off = ((rnd() % 20) << 40) + ((rnd() % 8) << 20);
	void *p = mmap(NULL, len, PROT_READ, shared ? MAP_SHARED : MAP_PRIVATE, gz->fd,
		       (off_t)off);
	int err = errno, at = gz_find(gz, (uint32_t)(off >> 40));
	int want;

	if (!len || !shared)
		want = EINVAL;
	else if (at < 0)
		want = ENXIO;
	else if ((off & ((1ULL << 40) - 1)) + len > gz->live_len[at])
		want = EINVAL;
	else
		want = 0;
	gz->judged++;
	if (p != MAP_FAILED)
		gz_track_map(gz, p, len);
	if ((want == 0 && p == MAP_FAILED && err != ENOMEM) ||
	    (want && (p != MAP_FAILED || err != want)))
		GZ_WRONG(gz, "garbage: mmap len %#zx %s off %#" PRIx64 " (%s): %s, want %s",
			 len, shared ? "shared" : "private", off,
			 at >= 0 ? "live handle" : "no live handle",
			 p != MAP_FAILED ? "success" : strerror(err),
			 want ? strerror(want) : "success");
}

/* After the storm: a fresh registration works end to end. */
static void gz_still_works(const struct bdf *b, int bar)
{
	struct phx_register r;
	int fd = phx_open(), i;
	uint8_t *p = phx_map(fd, b, bar, 0, 2 << 20, &r);

	for (i = 0; i < 2 << 20; i += 4096)
		p[i] = (uint8_t)(i >> 12);
	for (i = 0; i < 2 << 20; i += 4096)
		if (p[i] != (uint8_t)(i >> 12)) {
			FAIL("garbage: a registration after the storm lost bytes");
			break;
		}
	munmap(p, 2 << 20);
	if (phx_unreg(fd, r.handle))
		FAIL("garbage: unregister after the storm failed");
	close(fd);
}

/*
 * N random calls: ioctls with random numbers, near-valid and random
 * structures, NULL / wild / straddling pointers, random mmaps, the device
 * reopened with mappings live.  Each call that reaches phx is judged against
 * the ABI (right errno, success only when valid, coherent out fields); at the
 * end every mapping goes and the registrations must drop back to where they
 * were, and a new registration must still work.
 */
static int cmd_garbage(const struct bdf *b, int bar, long n, uint64_t seed)
{
	static const unsigned int cmds[] = { PHX_IOC_INFO, PHX_IOC_REGISTER,
					     PHX_IOC_UNREGISTER };
	static struct gz gz;
	uint8_t *buf = xalloc(4096), in[sizeof(struct phx_register)];
	long i, ok = 0, regs = 0, other = 0;
	struct phx_info info;
	uint64_t regs0;
	int j;

	gz.b = b;
	gz.bar = bar;
	gz.bar_size = bar_size(b, bar);
	gz.fd = phx_open();
	if (!gz.bar_size || phx_info(gz.fd, &info)) {
		FAIL("garbage: BAR %d size or PHX_IOC_INFO unknown", bar);
		return 1;
	}
	gz.max_reg = info.max_reg_bytes;
	regs0 = info.nr_regs;
	rng_state ^= seed * 0x9E3779B97F4A7C15ULL;
	if (!rng_state)
		rng_state = 1;
	for (i = 0; i < n; i++) {
		unsigned int cmd;
		void *arg;
		uint64_t k = rnd(), wild = 0;
		int arg_kind, ret, err;
		size_t q;

		for (q = 0; q < 4096; q += 8) {
			uint64_t v = rnd();

			memcpy(buf + q, &v, 8);
		}
		/*
		 * half of the time a registration of 2-8 MiB in the BAR's first
		 * 64 MiB: valid, or with exactly one rule broken
		 */
		if (k & 1) {
			struct phx_register *r = (void *)buf;

			reg_init(r, b, bar, (rnd() % 28) << 21, ((rnd() % 4) + 1) << 21);
			if (rnd() & 1)
				reg_break_one(&gz, r);
			else if (rnd() % 8 == 0)
				r->flags = PHX_REG_ALLOW_IOMMU;	/* the one defined flag */
		} else if (k & 2) {
			struct phx_unregister *u = (void *)buf;

			u->abi_version = PHX_ABI_VERSION;
			u->handle = (uint32_t)(rnd() % 16);
			u->flags = 0;
			u->pad = 0;
		} else if (k & 4) {
			((struct phx_info *)buf)->abi_version = PHX_ABI_VERSION;
		}
		if ((k >> 8) % 4 == 0)
			cmd = (uint32_t)rnd();
		else if ((k >> 8) % 4 == 1)
			cmd = _IOC((rnd() % 4), PHX_IOC_MAGIC, rnd() % 8,
				   rnd() % 256);
		else
			cmd = cmds[rnd() % 3];
		arg_kind = (k >> 16) % 8;
		switch (arg_kind) {
		case 0:
			arg = NULL;
			break;
		case 1:
			wild = rnd();
			arg = (void *)(uintptr_t)wild;
			break;
		case 2:
			arg = buf + 4096 - 8;	/* straddles the allocation */
			break;
		default:
			arg_kind = 3;
			arg = buf;
		}
		memcpy(in, buf, sizeof(in));
		ret = ioctl(gz.fd, cmd, arg);
		err = errno;
		if (ret == 0)
			ok++;
		if (cmd == PHX_IOC_INFO || cmd == PHX_IOC_REGISTER ||
		    cmd == PHX_IOC_UNREGISTER) {
			gz_judge_ioctl(&gz, cmd, arg_kind, wild, in, buf, ret, err);
		} else if (_IOC_TYPE(cmd) == PHX_IOC_MAGIC) {
			/* phx's magic, not one of its commands */
			gz.judged++;
			if (ret == 0 || err != ENOTTY)
				GZ_WRONG(&gz, "garbage: ioctl %#x: %s, want ENOTTY", cmd,
					 ret ? strerror(err) : "success");
		} else {
			other++;	/* another magic: the VFS may answer it */
		}
		if (ret == 0 && cmd == PHX_IOC_REGISTER && arg_kind == 3) {
			struct phx_register *r = (void *)buf;
			uint8_t *p;

			regs++;
			p = mmap(NULL, r->length, PROT_READ | PROT_WRITE, MAP_SHARED,
				 gz.fd, (off_t)r->mmap_offset);
			if (p == MAP_FAILED) {
				GZ_WRONG(&gz, "garbage: mmap of a new registration: %s",
					 strerror(errno));
			} else {
				memset(p, 0x5a, 4096);
				if (p[0] != 0x5a || p[4095] != 0x5a)
					GZ_WRONG(&gz, "garbage: bytes lost in a new mapping");
				if (rnd() & 1)
					munmap(p, r->length);
				else
					gz_track_map(&gz, p, r->length);
			}
		}
		if (rnd() % 64 == 0)	/* random mmaps */
			gz_random_mmap(&gz);
		if (rnd() % 500 == 0) {	/* start over, mappings still live */
			close(gz.fd);
			gz.fd = phx_open();
			gz.nlive = 0;
		}
	}
	/* everything goes: the registrations must follow */
	for (j = 0; j < gz.nmaps; j++)
		munmap(gz.maps[j].p, gz.maps[j].len);
	close(gz.fd);
	gz.fd = phx_open();
	for (j = 0; j < 500; j++) {
		if (phx_info(gz.fd, &info) || info.nr_regs <= regs0)
			break;
		usleep(10000);
	}
	if (phx_info(gz.fd, &info))
		FAIL("garbage: info after the storm");
	else if (info.nr_regs != regs0)
		FAIL("garbage: %llu registrations live after every fd and mapping went (%llu before)",
		     (unsigned long long)info.nr_regs, (unsigned long long)regs0);
	close(gz.fd);
	gz_still_works(b, bar);
	printf("garbage (seed %" PRIu64 "): %ld calls, %ld succeeded, %ld registrations, "
	       "%ld judged, %ld wrong, %ld of other magic not judged, %d mappings unmapped at the end\n",
	       seed, n, ok, regs, gz.judged, gz.wrong, other, gz.nmaps);
	if (gz.wrong > 10)
		FAIL("garbage: %ld calls broke the ABI contract (first 10 shown)", gz.wrong);
	if (!failures)
		PASS("garbage %ld random ioctls/mmaps, each judged against the ABI; nothing left",
		     n);
	return failures ? 1 : 0;
}

/* ---- the NVIDIA provider against nv_p2p_stub.ko ---- */

#define STUB_DIR "/sys/kernel/debug/nv_p2p_stub/"

static int stub_write(const char *knob, const char *fmt, ...)
{
	char path[256], buf[128];
	va_list ap;
	int fd, n, ret = 0;

	va_start(ap, fmt);
	n = vsnprintf(buf, sizeof(buf), fmt, ap);
	va_end(ap);
	snprintf(path, sizeof(path), STUB_DIR "%s", knob);
	fd = open(path, O_WRONLY);
	if (fd < 0 || write(fd, buf, n) != n)
		ret = -errno;
	if (fd >= 0)
		close(fd);
	if (ret)
		FAIL("stub %s <- %s: %s", knob, buf, strerror(-ret));
	return ret;
}

struct stub_stats {
	long tables, gets, puts, fired, client_bugs, poison_bad, slow_cb, put_miss, app_freed;
};

/*
 * The stub's stats; @scan false reads "counters", which skips the scan of
 * every poisoned byte (poison_bad -1): for loops that poll, which the KASAN
 * kernel otherwise slows to seconds a read.
 */
static int stub_read(struct stub_stats *st, bool scan)
{
	FILE *f = fopen(scan ? STUB_DIR "stats" : STUB_DIR "counters", "r");
	int n;

	memset(st, 0, sizeof(*st));
	if (!f)
		return -1;
	n = fscanf(f, "tables %ld gets %ld puts %ld fired %ld client_bugs %ld poison_bad %ld slow_cb %ld put_miss %ld app_freed %ld",
		   &st->tables, &st->gets, &st->puts, &st->fired, &st->client_bugs,
		   &st->poison_bad, &st->slow_cb, &st->put_miss, &st->app_freed);
	fclose(f);
	return n == 9 ? 0 : -1;
}

static int stub_stats(struct stub_stats *st)
{
	return stub_read(st, true);
}

static int stub_counters(struct stub_stats *st)
{
	return stub_read(st, false);
}

/* Wait (5 s at most) until phx has no registration and the stub no table. */
static int nv_settled(const char *name)
{
	struct stub_stats st;
	struct phx_info info;
	int fd = phx_open(), i;

	for (i = 0; i < 500; i++) {
		if (!phx_info(fd, &info) && !info.nr_regs && !stub_counters(&st) &&
		    !st.tables)
			break;
		usleep(10000);
	}
	close(fd);
	stub_stats(&st);
	if (info.nr_regs || st.tables) {
		FAIL("%s: left behind: %llu registrations, %ld stub page tables", name,
		     (unsigned long long)info.nr_regs, st.tables);
		return -1;
	}
	if (st.client_bugs) {
		FAIL("%s: the stub saw %ld API misuses (see dmesg)", name, st.client_bugs);
		return -1;
	}
	if (st.poison_bad) {
		FAIL("%s: %ld bytes of memory were written after the driver got it back",
		     name, st.poison_bad);
		return -1;
	}
	if (st.slow_cb) {
		FAIL("%s: %ld free callbacks took over 50 ms (they stall the driver's free path)",
		     name, st.slow_cb);
		return -1;
	}
	return 0;
}

static int nv_register(int fd, uint64_t va, uint64_t len, struct phx_register *r)
{
	memset(r, 0, sizeof(*r));
	r->abi_version = PHX_ABI_VERSION;
	r->provider = PHX_PROV_NVIDIA;
	r->gpu_va = va;
	r->length = len;
	return ioctl(fd, PHX_IOC_REGISTER, r) ? -errno : 0;
}

/* Present PTEs in [p, p + len), from /proc/self/pagemap (-1: unreadable). */
static long pagemap_present(const void *p, size_t len)
{
	uint64_t e;
	long n = 0;
	size_t off;
	int fd = open("/proc/self/pagemap", O_RDONLY);

	if (fd < 0)
		return -1;
	for (off = 0; off < len; off += 4096) {
		uint64_t vpn = ((uintptr_t)p + off) / 4096;

		if (pread(fd, &e, sizeof(e), (off_t)(vpn * sizeof(e))) != sizeof(e)) {
			n = -1;
			break;
		}
		n += !!(e & (1ULL << 63));
	}
	close(fd);
	return n;
}

/* ---- lifecycle ---- */

static int cmd_hold(const struct bdf *b, int bar, uint64_t regoff,
		    uint64_t reglen)
{
	struct phx_register reg;
	int fd = phx_open();
	uint8_t *map = phx_map(fd, b, bar, regoff, reglen, &reg);

	close(fd);		/* the mapping alone keeps everything alive */
	map[0] = 1;
	printf("PHX-HOLDING\n");
	fflush(stdout);
	for (;;)
		pause();
	return 0;
}

struct busy {
	int dfd;
	uint8_t *map;
	size_t len;
	atomic_long done;
	atomic_long efault;
	atomic_int stop;
	/*
	 * Set once PHX_IOC_UNREGISTER has returned: a read that starts after
	 * that must fail with EFAULT (the pages are gone).  Reads are counted
	 * by what the flag was when they started.
	 */
	atomic_int revoked;
	atomic_long after_ok, after_efault, after_other;
};

static void *busy_thread(void *arg)
{
	struct busy *bz = arg;

	while (!atomic_load(&bz->stop)) {
		int revoked = atomic_load(&bz->revoked);
		ssize_t n = pread(bz->dfd, bz->map, bz->len, 0);
		int err = errno;

		if (n == (ssize_t)bz->len)
			atomic_fetch_add(&bz->done, 1);
		else if (n < 0 && err == EFAULT)
			atomic_fetch_add(&bz->efault, 1);
		if (!revoked)
			continue;
		if (n == (ssize_t)bz->len)
			atomic_fetch_add(&bz->after_ok, 1);
		else if (n < 0 && err == EFAULT)
			atomic_fetch_add(&bz->after_efault, 1);
		else
			atomic_fetch_add(&bz->after_other, 1);
	}
	return NULL;
}

/* I/O through the mapping from a thread and an io_uring, forever. */
static int cmd_busyio(const struct bdf *b, int bar, uint64_t regoff,
		      uint64_t reglen, const char *dir)
{
	struct phx_register reg;
	struct busy bz = { 0 };
	pthread_t t;
	char path[512];
	int fd = phx_open(), i;
	uint8_t *map = phx_map(fd, b, bar, regoff, reglen, &reg);
	struct io_uring r;

	snprintf(path, sizeof(path), "%s/phx-busy.dat", dir);
	make_file(path, reglen, 7);
	bz.dfd = open(path, O_RDONLY | O_DIRECT);
	bz.map = map;
	bz.len = reglen / 2;
	pthread_create(&t, NULL, busy_thread, &bz);
	if (io_uring_queue_init(64, &r, 0))
		return 1;
	printf("PHX-BUSY\n");
	fflush(stdout);
	for (;;) {
		struct io_uring_cqe *cqe;

		for (i = 0; i < 32; i++) {
			struct io_uring_sqe *sqe = io_uring_get_sqe(&r);
			size_t chunk = reglen / 2 / 32;

			if (!sqe)
				break;
			io_uring_prep_read(sqe, bz.dfd, map + reglen / 2 + i * chunk,
					   chunk, i * chunk);
		}
		io_uring_submit(&r);
		for (i = 0; i < 32; i++) {
			if (io_uring_wait_cqe(&r, &cqe))
				break;
			io_uring_cqe_seen(&r, cqe);
		}
	}
	return 0;
}

static sigjmp_buf jb;

static void on_fault(int sig)
{
	siglongjmp(jb, sig);
}

static int touch(volatile uint8_t *p)
{
	int sig = sigsetjmp(jb, 1);

	if (sig)
		return sig;
	(void)*p;
	return 0;
}

/* Unregister while another thread does I/O into the mapping. */
static int cmd_unreg(const struct bdf *b, int bar, uint64_t regoff,
		     uint64_t reglen, const char *dir)
{
	struct phx_register reg;
	struct busy bz = { 0 };
	struct phx_info info;
	pthread_t t[2];
	char path[512];
	int fd = phx_open(), ret, sig, i;
	uint8_t *map = phx_map(fd, b, bar, regoff, reglen, &reg);

	snprintf(path, sizeof(path), "%s/phx-unreg.dat", dir);
	make_file(path, reglen, 9);
	bz.dfd = open(path, O_RDONLY | O_DIRECT);
	if (bz.dfd < 0) {
		FAIL("unreg: open %s O_DIRECT: %s", path, strerror(errno));
		return 1;
	}
	bz.map = map;
	bz.len = reglen;
	pthread_create(&t[0], NULL, busy_thread, &bz);
	pthread_create(&t[1], NULL, busy_thread, &bz);
	/* I/O into the mapping works before the revoke (60 s at most) */
	for (i = 0; i < 60000 && atomic_load(&bz.done) < 4; i++)
		usleep(1000);
	ret = phx_unreg(fd, reg.handle);
	atomic_store(&bz.revoked, 1);
	usleep(200000);
	atomic_store(&bz.stop, 1);
	pthread_join(t[0], NULL);
	pthread_join(t[1], NULL);
	signal(SIGBUS, on_fault);
	signal(SIGSEGV, on_fault);
	sig = touch(map + 4096);
	printf("unreg: %ld reads done before; reads started after the revoke: %ld EFAULT, "
	       "%ld succeeded, %ld other; touch -> signal %d\n",
	       atomic_load(&bz.done) - atomic_load(&bz.after_ok),
	       atomic_load(&bz.after_efault), atomic_load(&bz.after_ok),
	       atomic_load(&bz.after_other), sig);
	if (atomic_load(&bz.done) - atomic_load(&bz.after_ok) < 4)
		FAIL("unreg: O_DIRECT reads into the mapping did not work before the revoke");
	if (ret)
		FAIL("unreg: unregister returned %d", ret);
	if (sig != SIGBUS)
		FAIL("unreg: access after revoke gave signal %d, want SIGBUS", sig);
	if (atomic_load(&bz.after_efault) == 0)
		FAIL("unreg: no read started after the revoke failed with EFAULT");
	if (atomic_load(&bz.after_ok) || atomic_load(&bz.after_other))
		FAIL("unreg: %ld reads started after the revoke succeeded, %ld ended otherwise "
		     "(want EFAULT for all)", atomic_load(&bz.after_ok),
		     atomic_load(&bz.after_other));
	ret = pagemap_present(map, reglen);
	if (ret)
		FAIL("unreg: %d present PTEs in the mapping after the unregister (pagemap)", ret);
	munmap(map, reglen);
	unlink(path);
	if (phx_info(fd, &info) || info.nr_regs || info.nr_pages_busy)
		FAIL("unreg: %llu registrations left", (unsigned long long)info.nr_regs);
	close(fd);
	if (!failures)
		PASS("unreg (revoked under I/O: later I/O EFAULT, access SIGBUS, no PTE left)");
	return failures ? 1 : 0;
}

/*
 * A page of the mapping held by a pipe (vmsplice) past the unregister and
 * the close.  The unregister returns EINTR on a signal instead of waiting
 * for the pipe; the registration (and the NVIDIA driver's memory, after a
 * cudaFree too) stays until the pipe lets go; the pipe then reads what was
 * written, never memory the driver got back; with "rmmod", rmmod phx is
 * refused meanwhile rather than hanging.  P2PDMA pages cannot be spliced
 * (GUP refuses them without FOLL_PCI_P2PDMA): that refusal is checked.
 */
struct splice_dog {
	int pfd;
	uint8_t *buf;
	size_t len;
	ssize_t got;
	atomic_int stop, fired;
};

/*
 * Drains the pipe (into d->buf) after 8 s, so that a kernel that waits for
 * it goes on; the data is checked all the same.
 */
static void *splice_watchdog(void *arg)
{
	struct splice_dog *d = arg;
	int i;

	for (i = 0; i < 800 && !atomic_load(&d->stop); i++)
		usleep(10000);
	if (atomic_load(&d->stop))
		return NULL;
	atomic_store(&d->fired, 1);
	d->got = read(d->pfd, d->buf, d->len);
	return NULL;
}

static void on_alarm(int sig)
{
	(void)sig;
}

static double now_s(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return ts.tv_sec + ts.tv_nsec / 1e9;
}

static int cmd_splice(const struct bdf *b, int bar, uint64_t regoff, uint64_t reglen,
		      int do_rmmod)
{
	const size_t len = 64 << 10;
	struct sigaction sa = { .sa_handler = on_alarm };
	struct phx_register reg;
	struct splice_dog dog = { 0 };
	struct stub_stats st;
	struct phx_info info;
	struct iovec iov;
	pthread_t t;
	uint8_t *buf = xalloc(len);
	int fd = phx_open(), p[2], ret, i;
	uint8_t *map = phx_map(fd, b, bar, regoff, reglen, &reg);
	const char *name = b->nv ? "nv/splice" : "splice";
	double t0, dt;
	ssize_t n;

	memset(map, 0xA5, len);
	if (pipe(p)) {
		FAIL("%s: pipe: %s", name, strerror(errno));
		return 1;
	}
	iov.iov_base = map;
	iov.iov_len = len;
	n = vmsplice(p[1], &iov, 1, 0);
	if (n < 0 && reg.mode == PHX_MODE_P2PDMA) {
		if (errno != EFAULT && errno != EREMOTEIO)
			FAIL("%s: vmsplice of P2PDMA pages: %s, want EFAULT", name,
			     strerror(errno));
		else
			PASS("%s (P2PDMA pages cannot be spliced into a pipe: %s)", name,
			     strerror(errno));
		phx_unreg(fd, reg.handle);
		return failures ? 1 : 0;
	}
	if (n != (ssize_t)len) {
		FAIL("%s: vmsplice of the mapping: %zd (%s)", name, n, strerror(errno));
		return 1;
	}
	if (b->nv)	/* the application frees the memory */
		stub_write("free_now", "%#llx", (unsigned long long)reg.gpu_va);
	munmap(map, reglen);
	dog.pfd = p[0];
	dog.buf = buf;
	dog.len = len;
	pthread_create(&t, NULL, splice_watchdog, &dog);
	sigaction(SIGALRM, &sa, NULL);	/* no SA_RESTART */
	alarm(1);
	t0 = now_s();
	ret = phx_unreg(fd, reg.handle);
	dt = now_s() - t0;
	alarm(0);
	printf("%s: unregister with a page in a pipe: %s after %.1f s\n", name,
	       ret ? strerror(-ret) : "returned", dt);
	if (ret != -EINTR || atomic_load(&dog.fired))
		FAIL("%s: unregister with a page held by a pipe: %s after %.1f s, want EINTR at the signal (1 s)",
		     name, ret ? strerror(-ret) : "success", dt);
	if (!atomic_load(&dog.fired)) {
		if (phx_info(fd, &info) || info.nr_regs != 1)
			FAIL("%s: the registration went while a pipe holds its page (%llu left)",
			     name, (unsigned long long)info.nr_regs);
		if (b->nv && (stub_counters(&st) || st.tables != 1))
			FAIL("%s: the driver got the memory back while a pipe holds a page of it (%ld tables)",
			     name, st.tables);
	}
	close(fd);
	if (do_rmmod && !atomic_load(&dog.fired)) {
		pid_t pid = fork();
		int status = 0;

		if (pid == 0)
			_exit(syscall(__NR_delete_module, "phx", O_NONBLOCK) ? errno : 0);
		for (i = 0; i < 500 && waitpid(pid, &status, WNOHANG) == 0; i++)
			usleep(10000);
		if (i == 500) {
			FAIL("%s: rmmod phx blocked (5 s) while a pipe holds a page", name);
			waitpid(pid, &status, 0);
		} else if (!WIFEXITED(status) || (WEXITSTATUS(status) != EBUSY &&
						   WEXITSTATUS(status) != EAGAIN)) {
			FAIL("%s: rmmod phx with a teardown pending: %s, want it refused (in use)",
			     name, WIFEXITED(status) ? strerror(WEXITSTATUS(status)) : "killed");
		} else {
			printf("%s: rmmod phx refused: %s\n", name,
			       strerror(WEXITSTATUS(status)));
		}
	}
	atomic_store(&dog.stop, 1);
	pthread_join(t, NULL);
	n = atomic_load(&dog.fired) ? dog.got : read(p[0], buf, len);
	for (i = 0; i < (int)len && n == (ssize_t)len && buf[i] == 0xA5; i++)
		;
	if (n != (ssize_t)len || i != (int)len)
		FAIL("%s: the pipe read %zd bytes, byte %d is %#x, want 0xa5: memory given back was exposed",
		     name, n, i, i < (int)len ? buf[i] : 0);
	close(p[0]);
	close(p[1]);
	/* now the teardown can finish */
	fd = phx_open();
	for (i = 0; i < 500 && !phx_info(fd, &info) && info.nr_regs; i++)
		usleep(10000);
	close(fd);
	if (info.nr_regs)
		FAIL("%s: the registration stayed after the pipe let go", name);
	if (b->nv && nv_settled(name))
		return 1;
	if (!failures)
		PASS("%s (a page held by a pipe: unregister EINTR at a signal, memory kept until the pipe let go%s, it read the data)",
		     name, do_rmmod ? ", rmmod refused meanwhile" : "");
	return failures ? 1 : 0;
}

/* /sys/module/phx/parameters/NAME (read, then write @val unless NULL). */
static int phx_param(const char *name, char *old, size_t oldlen, const char *val)
{
	char path[256];
	FILE *f;
	int ret = 0;

	snprintf(path, sizeof(path), "/sys/module/phx/parameters/%s", name);
	f = fopen(path, "r");
	if (!f || !fgets(old, (int)oldlen, f))
		ret = -1;
	if (f)
		fclose(f);
	old[strcspn(old, "\n")] = 0;
	if (!ret && val) {
		f = fopen(path, "w");
		if (!f || fputs(val, f) < 0)
			ret = -1;
		if (f && fclose(f))
			ret = -1;
	}
	return ret;
}

/*
 * As a non-root member of /dev/phx's group (the suite gives the device
 * group GID): the ioctls work, PCIBAR needs CAP_SYS_ADMIN (EPERM),
 * PHX_REG_ALLOW_IOMMU needs CAP_SYS_RAWIO (EPERM), and the per-user
 * limits hold (EDQUOT): 4 registrations, then 16 MiB.
 */
static int nonroot_child(const struct bdf *b, int uid, int gid)
{
	struct phx_register r, rs[5];
	struct phx_info info;
	gid_t g = gid;
	int fd, ret, i;
	uint8_t *m;

	if (setgroups(1, &g) || setgid(gid) || setuid(uid) || !geteuid()) {
		FAIL("nonroot: could not become uid %d gid %d", uid, gid);
		return 1;
	}
	fd = open(PHX_DEVICE_PATH, O_RDWR | O_CLOEXEC);
	if (fd < 0) {
		FAIL("nonroot: open %s as a group member: %s", PHX_DEVICE_PATH, strerror(errno));
		return 1;
	}
	if (phx_info(fd, &info))
		FAIL("nonroot: PHX_IOC_INFO: %s", strerror(errno));
	reg_init(&r, &(struct bdf){ 0 }, 2, 0, 2 << 20);
	if (!ioctl(fd, PHX_IOC_REGISTER, &r) || errno != EPERM)
		FAIL("nonroot: a PCI BAR registration without CAP_SYS_ADMIN: %s, want EPERM",
		     strerror(errno));
	memset(&r, 0, sizeof(r));
	r.abi_version = PHX_ABI_VERSION;
	r.provider = PHX_PROV_NVIDIA;
	r.gpu_va = b->nv_va;
	r.length = 2 << 20;
	r.flags = PHX_REG_ALLOW_IOMMU;
	ret = ioctl(fd, PHX_IOC_REGISTER, &r) ? -errno : 0;
	if (ret != -EPERM) {
		FAIL("nonroot: PHX_REG_ALLOW_IOMMU without CAP_SYS_RAWIO: %s, want EPERM",
		     strerror(-ret));
		if (!ret)
			phx_unreg(fd, r.handle);
	}
	for (i = 0; i < 5; i++) {
		ret = nv_register(fd, b->nv_va + (uint64_t)i * (2 << 20), 2 << 20, &rs[i]);
		if (i < 4 && ret)
			FAIL("nonroot: registration %d of 4 allowed: %s", i + 1, strerror(-ret));
		if (i == 4 && ret != -EDQUOT)
			FAIL("nonroot: a 5th registration past max_user_regs=4: %s, want EDQUOT",
			     strerror(-ret));
		if (i == 4 && !ret)
			phx_unreg(fd, rs[i].handle);
	}
	m = mmap(NULL, 2 << 20, PROT_READ | PROT_WRITE, MAP_SHARED, fd,
		 (off_t)rs[0].mmap_offset);
	if (m == MAP_FAILED)
		FAIL("nonroot: mmap: %s", strerror(errno));
	else
		m[0] = 1, munmap(m, 2 << 20);
	for (i = 0; i < 4; i++)
		if (phx_unreg(fd, rs[i].handle))
			FAIL("nonroot: unregister %d", i);
	ret = nv_register(fd, b->nv_va, 16 << 20, &rs[0]);
	if (ret)
		FAIL("nonroot: 16 MiB within max_user_bytes: %s", strerror(-ret));
	ret = nv_register(fd, b->nv_va + (16 << 20), 2 << 20, &rs[1]);
	if (ret != -EDQUOT)
		FAIL("nonroot: 2 MiB more past max_user_bytes=16 MiB: %s, want EDQUOT",
		     strerror(-ret));
	close(fd);	/* releases everything */
	return failures ? 1 : 0;
}

static int cmd_nonroot(const struct bdf *b, int uid, int gid)
{
	char regs[64], bytes[64], tmp[64];
	int status = 0;
	pid_t pid;

	if (phx_param("max_user_regs", regs, sizeof(regs), "4") ||
	    phx_param("max_user_bytes", bytes, sizeof(bytes), "16777216")) {
		FAIL("nonroot: cannot set phx's per-user limits");
		return 1;
	}
	pid = fork();
	if (pid == 0)
		_exit(nonroot_child(b, uid, gid));
	waitpid(pid, &status, 0);
	phx_param("max_user_regs", tmp, sizeof(tmp), regs);
	phx_param("max_user_bytes", tmp, sizeof(tmp), bytes);
	if (!WIFEXITED(status) || WEXITSTATUS(status))
		return 1;
	if (nv_settled("nonroot"))
		return 1;
	PASS("nonroot (uid %d in /dev/phx's group %d: ioctls work, PCIBAR EPERM, ALLOW_IOMMU EPERM, 4 registrations then EDQUOT, 16 MiB then EDQUOT)",
	     uid, gid);
	return 0;
}

/* fork() does not copy the mapping (VM_DONTCOPY). */
static int cmd_fork(const struct bdf *b, int bar, uint64_t regoff,
		    uint64_t reglen)
{
	struct phx_register reg;
	int fd = phx_open(), status;
	uint8_t *map = phx_map(fd, b, bar, regoff, reglen, &reg);
	pid_t pid;

	map[0] = 0x42;
	pid = fork();
	if (pid == 0) {
		signal(SIGSEGV, on_fault);
		signal(SIGBUS, on_fault);
		_exit(touch(map) == SIGSEGV ? 0 : 1);
	}
	waitpid(pid, &status, 0);
	if (!WIFEXITED(status) || WEXITSTATUS(status))
		FAIL("fork: the child could access the mapping");
	else if (map[0] != 0x42)
		FAIL("fork: parent lost its mapping");
	else
		PASS("fork (child has no mapping, parent keeps it)");
	munmap(map, reglen);
	close(fd);
	return failures ? 1 : 0;
}

/*
 * The mapping as an io_uring fixed buffer (long-term pin), then exit with
 * the buffer still registered: exit must not hang, phx must let go after
 * the ring is gone (the suite checks that).  What docs/kernel.md promises
 * for the mode the registration got: GENERIC pages can be long-term pinned,
 * so the registration succeeds and a READ_FIXED into the mapping is
 * byte-checked; P2PDMA pages cannot (upstream refuses FOLL_LONGTERM on
 * them), so io_uring must refuse the buffer with EREMOTEIO.
 */
static int cmd_fixedbuf(const struct bdf *b, int bar, uint64_t regoff,
			uint64_t reglen, const char *dir)
{
	struct phx_register reg;
	struct io_uring r;
	struct iovec iov;
	char path[512];
	int fd = phx_open(), dfd, ret;
	uint8_t *map = phx_map(fd, b, bar, regoff, reglen, &reg);
	uint8_t *exp = xalloc(1 << 20);

	if (io_uring_queue_init(8, &r, 0)) {
		FAIL("fixedbuf: io_uring_queue_init");
		return 1;
	}
	iov.iov_base = map;
	iov.iov_len = reglen;
	ret = io_uring_register_buffers(&r, &iov, 1);
	printf("fixedbuf: registering the mapping (mode %s) as a fixed buffer: %s\n",
	       reg.mode == PHX_MODE_P2PDMA ? "P2PDMA" :
	       reg.mode == PHX_MODE_GENERIC ? "GENERIC" : "unknown",
	       ret ? strerror(-ret) : "accepted");
	if (reg.mode == PHX_MODE_P2PDMA) {
		if (ret == -EREMOTEIO) {
			PASS("fixedbuf refused in P2PDMA mode with EREMOTEIO, as documented");
			return 0;
		}
		FAIL("fixedbuf: P2PDMA pages as a fixed buffer: %s, want EREMOTEIO",
		     ret ? strerror(-ret) : "accepted");
		return 1;
	}
	if (reg.mode != PHX_MODE_GENERIC) {
		FAIL("fixedbuf: registration mode %u is neither GENERIC nor P2PDMA", reg.mode);
		return 1;
	}
	if (ret) {
		FAIL("fixedbuf: GENERIC pages refused as a fixed buffer: %s "
		     "(documented: they can be long-term pinned)", strerror(-ret));
		return 1;
	}
	snprintf(path, sizeof(path), "%s/phx-fixed.dat", dir);
	make_file(path, 1 << 20, 31);
	drop_caches();
	dfd = open(path, O_RDONLY | O_DIRECT);
	if (dfd < 0) {
		FAIL("fixedbuf: open %s O_DIRECT: %s", path, strerror(errno));
		return 1;
	}
	memset(map, 0xA5, 1 << 20);
	{
		struct io_uring_sqe *sqe = io_uring_get_sqe(&r);
		struct io_uring_cqe *cqe;

		io_uring_prep_read_fixed(sqe, dfd, map, 1 << 20, 0, 0);
		io_uring_submit(&r);
		if (io_uring_wait_cqe(&r, &cqe) || cqe->res != 1 << 20) {
			FAIL("fixedbuf: READ_FIXED");
			return 1;
		}
		io_uring_cqe_seen(&r, cqe);
	}
	seeded(exp, 1 << 20, 31, 0);
	if (first_diff(map, exp, 1 << 20) >= 0) {
		FAIL("fixedbuf: READ_FIXED bytes differ");
		return 1;
	}
	unlink(path);
	/* exit with the buffer registered, the mapping and /dev/phx open */
	PASS("fixedbuf GENERIC: READ_FIXED into the mapping byte-checked; exiting with it pinned");
	return 0;
}


/*
 * cudaFree under I/O: threads O_DIRECT-read a file into the mapping (DMA
 * into "GPU memory") while the application frees the memory.  The mapping
 * is persistent: reads keep working and the driver keeps the memory until
 * the unregister; reads started after the unregister fail with EFAULT,
 * the CPU gets SIGBUS, and the driver, which poisons the memory when it
 * gets it back, finds no byte written after that.
 */
static int cmd_nvcb(const struct bdf *b, uint64_t regoff, uint64_t reglen,
		    const char *dir, int rounds)
{
	char path[512];
	int round;

	snprintf(path, sizeof(path), "%s/phx-nvcb.dat", dir);
	make_file(path, reglen, 13);
	for (round = 0; round < rounds; round++) {
		struct phx_register reg;
		struct stub_stats st0, st;
		struct busy bz = { 0 };
		pthread_t t[3];
		int fd = phx_open(), i, sig, ret;
		uint8_t *map = phx_map(fd, b, 0, regoff, reglen, &reg);
		long before;

		bz.dfd = open(path, O_RDONLY | O_DIRECT);
		bz.map = map;
		bz.len = reglen;
		for (i = 0; i < 3; i++)
			pthread_create(&t[i], NULL, busy_thread, &bz);
		for (i = 0; i < 60000 && atomic_load(&bz.done) < 2; i++)
			usleep(1000);
		usleep(1000 * (round % 7));
		stub_counters(&st0);
		stub_write("free_now", "%#llx", (unsigned long long)reg.gpu_va);
		before = atomic_load(&bz.done);
		for (i = 0; i < 60000 && atomic_load(&bz.done) < before + 3; i++)
			usleep(1000);
		stub_counters(&st);
		if (atomic_load(&bz.done) < before + 3 || atomic_load(&bz.efault))
			FAIL("nvcb: round %d: reads stopped working after cudaFree (%ld EFAULT): the registration was revoked, but its memory is pinned",
			     round, atomic_load(&bz.efault));
		if (st.tables != st0.tables || st.fired != st0.fired)
			FAIL("nvcb: round %d: the driver took the memory back at cudaFree (%ld tables, %ld callbacks)",
			     round, st.tables - st0.tables, st.fired - st0.fired);
		ret = phx_unreg(fd, reg.handle);
		atomic_store(&bz.revoked, 1);
		usleep(100000);
		atomic_store(&bz.stop, 1);
		for (i = 0; i < 3; i++)
			pthread_join(t[i], NULL);
		signal(SIGBUS, on_fault);
		signal(SIGSEGV, on_fault);
		sig = touch(map + 8192);
		if (round == 0)
			printf("nvcb: %ld reads done, after the unregister: %ld EFAULT, %ld ok, %ld other; touch -> %d\n",
			       atomic_load(&bz.done), atomic_load(&bz.after_efault),
			       atomic_load(&bz.after_ok), atomic_load(&bz.after_other), sig);
		if (ret)
			FAIL("nvcb: unregister: %s", strerror(-ret));
		if (atomic_load(&bz.after_ok) || atomic_load(&bz.after_other))
			FAIL("nvcb: %ld reads started after the unregister succeeded, %ld failed otherwise",
			     atomic_load(&bz.after_ok), atomic_load(&bz.after_other));
		if (sig != SIGBUS)
			FAIL("nvcb: access after the unregister gave signal %d, want SIGBUS", sig);
		if (pagemap_present(map, reglen))
			FAIL("nvcb: present PTEs left after the unregister (pagemap)");
		munmap(map, reglen);
		close(fd);
		close(bz.dfd);
		if (nv_settled("nvcb") || failures)
			break;
	}
	unlink(path);
	if (!failures)
		PASS("nvcb (%d rounds: cudaFree under O_DIRECT reads: the pinned memory stays until the unregister; then EFAULT, SIGBUS, no PTE, nothing written after the driver got it back)",
		     rounds);
	return failures ? 1 : 0;
}

/*
 * cudaFree while phx sets the registration up (the stub frees from a work
 * item 0-2 ms after get_pages returned).  The mapping is persistent:
 * every registration succeeds and stays usable until it is unregistered.
 */
static int cmd_nvreg(const struct bdf *b, int n)
{
	int i;

	signal(SIGBUS, on_fault);
	signal(SIGSEGV, on_fault);
	for (i = 0; i < n; i++) {
		struct phx_register reg;
		struct stub_stats st0, st;
		int fd = phx_open(), ret, k, sig;
		uint8_t *p;

		stub_counters(&st0);
		/* half at once (the window right after get_pages), half spread */
		stub_write("free_during_reg", "1 %d", i & 1 ? (i * 37) % 2000 : (i * 7) % 50);
		ret = nv_register(fd, b->nv_va, 4 << 20, &reg);
		if (ret) {
			FAIL("nvreg: round %d: register: %s (cudaFree must not fail a persistent mapping)",
			     i, strerror(-ret));
			close(fd);
			break;
		}
		for (k = 0; k < 2000 && !stub_counters(&st) && st.app_freed == st0.app_freed &&
		     st.fired == st0.fired; k++)
			usleep(1000);
		p = mmap(NULL, 4 << 20, PROT_READ | PROT_WRITE, MAP_SHARED, fd,
			 (off_t)reg.mmap_offset);
		if (p == MAP_FAILED) {
			FAIL("nvreg: round %d: mmap after cudaFree: %s", i, strerror(errno));
		} else {
			sig = touch(p + (i % 1024) * 4096);
			if (sig)
				FAIL("nvreg: round %d: the registration was revoked by cudaFree (signal %d)",
				     i, sig);
			munmap(p, 4 << 20);
		}
		phx_unreg(fd, reg.handle);
		close(fd);
		if (failures)
			break;
	}
	stub_write("free_during_reg", "0 0");
	if (!nv_settled("nvreg") && !failures)
		PASS("nvreg (%d cudaFrees racing registration: all registered and usable until unregistered, none left behind)", n);
	return failures ? 1 : 0;
}

/*
 * Memory freed by the application under a registration, then asked for
 * again (the stub hands out the same physical memory for the same VA):
 * the old registration keeps it (the old mapping still reads what was
 * written), a new registration of it is refused (EBUSY) until the old one
 * is gone, and then works, byte-checked.
 */
static int cmd_nvreuse(const struct bdf *b, uint64_t regoff, uint64_t reglen,
		       const char *dir)
{
	struct phx_register r1, r2;
	uint8_t *m1, *m2, *exp = xalloc(reglen);
	char path[512];
	int fd = phx_open(), dfd, sig, tries = 0, ret;

	m1 = phx_map(fd, b, 0, regoff, reglen, &r1);
	memset(m1, 0x11, reglen);
	stub_write("free_now", "%#llx", (unsigned long long)r1.gpu_va);
	signal(SIGBUS, on_fault);
	signal(SIGSEGV, on_fault);
	sig = touch(m1);
	if (sig || m1[reglen - 1] != 0x11)
		FAIL("nvreuse: after cudaFree the registration lost its memory (signal %d)", sig);
	ret = nv_register(fd, r1.gpu_va, reglen, &r2);
	if (ret != -EBUSY)
		FAIL("nvreuse: the memory of a live registration registered again: %s, want EBUSY",
		     strerror(-ret));
	if (phx_unreg(fd, r1.handle))
		FAIL("nvreuse: unregister");
	if (touch(m1) != SIGBUS)
		FAIL("nvreuse: the unregistered mapping still works");
	while ((ret = nv_register(fd, r1.gpu_va, reglen, &r2)) == -EBUSY && tries++ < 500)
		usleep(10000);
	if (ret) {
		FAIL("nvreuse: registering the reused memory: %s", strerror(-ret));
		return 1;
	}
	m2 = mmap(NULL, reglen, PROT_READ | PROT_WRITE, MAP_SHARED, fd, (off_t)r2.mmap_offset);
	if (m2 == MAP_FAILED) {
		FAIL("nvreuse: mmap: %s", strerror(errno));
		return 1;
	}
	snprintf(path, sizeof(path), "%s/phx-nvreuse.dat", dir);
	make_file(path, reglen, 21);
	drop_caches();
	dfd = open(path, O_RDONLY | O_DIRECT);
	if (dfd < 0 || pread(dfd, m2, reglen, 0) != (ssize_t)reglen)
		FAIL("nvreuse: O_DIRECT read into the new registration: %s", strerror(errno));
	seeded(exp, reglen, 21, 0);
	if (first_diff(m2, exp, reglen) >= 0)
		FAIL("nvreuse: bytes differ in the new registration");
	if (touch(m1) != SIGBUS)
		FAIL("nvreuse: the old mapping came back");
	munmap(m1, reglen);
	munmap(m2, reglen);
	close(dfd);
	unlink(path);
	phx_unreg(fd, r2.handle);
	close(fd);
	if (!nv_settled("nvreuse") && !failures)
		PASS("nvreuse (cudaFree under a registration: it keeps the memory; registered again only after it is gone, byte-checked)");
	return failures ? 1 : 0;
}

/*
 * A registration larger than 16 GiB (256 Ki page-table entries: the
 * kcalloc limit), sparse: only its first 2 MiB are BAR memory; O_DIRECT
 * into and out of that part is byte-checked.
 */
static int cmd_nvsparse(uint64_t va, uint64_t len, const char *dir)
{
	struct phx_register r;
	uint8_t *m, *exp = xalloc(2 << 20), *file;
	char path[512];
	int fd = phx_open(), dfd, ret;

	ret = nv_register(fd, va, len, &r);
	if (ret) {
		FAIL("nvsparse: register %llu GiB: %s", (unsigned long long)(len >> 30),
		     strerror(-ret));
		return 1;
	}
	m = mmap(NULL, 2 << 20, PROT_READ | PROT_WRITE, MAP_SHARED, fd, (off_t)r.mmap_offset);
	if (m == MAP_FAILED) {
		FAIL("nvsparse: mmap: %s", strerror(errno));
		return 1;
	}
	snprintf(path, sizeof(path), "%s/phx-nvsparse.dat", dir);
	make_file(path, 2 << 20, 5);
	drop_caches();
	dfd = open(path, O_RDWR | O_DIRECT);
	if (dfd < 0 || pread(dfd, m, 2 << 20, 0) != 2 << 20)
		FAIL("nvsparse: O_DIRECT read: %s", strerror(errno));
	seeded(exp, 2 << 20, 5, 0);
	if (first_diff(m, exp, 2 << 20) >= 0)
		FAIL("nvsparse: read bytes differ");
	seeded(m, 2 << 20, 55, 0);
	if (pwrite(dfd, m, 2 << 20, 0) != 2 << 20)
		FAIL("nvsparse: O_DIRECT write: %s", strerror(errno));
	drop_caches();
	file = slurp(path, 0, 2 << 20);
	seeded(exp, 2 << 20, 55, 0);
	if (first_diff(file, exp, 2 << 20) >= 0)
		FAIL("nvsparse: written bytes differ");
	munmap(m, 2 << 20);
	close(dfd);
	unlink(path);
	if (phx_unreg(fd, r.handle))
		FAIL("nvsparse: unregister");
	close(fd);
	if (!nv_settled("nvsparse") && !failures)
		PASS("nvsparse (%llu GiB registration, %llu page-table entries, I/O byte-checked)",
		     (unsigned long long)(len >> 30), (unsigned long long)(len >> 16));
	return failures ? 1 : 0;
}

/* Driver errors and odd page tables end cleanly with the right errno. */
static int cmd_nvfail(const struct bdf *b, const char *dir)
{
	struct phx_register r;
	struct stub_stats st;
	int fd = phx_open(), ret, i;
	char ptv[32] = "0x00020000";
	FILE *f = fopen(STUB_DIR "pt_version", "r");

	if (f) {	/* restored at the end */
		if (!fgets(ptv, sizeof(ptv), f))
			strcpy(ptv, "0x00020000");
		ptv[strcspn(ptv, "\n")] = 0;
		fclose(f);
	}
#define NVEXPECT(what, want) do { ret = nv_register(fd, b->nv_va, 4 << 20, &r); \
	if (ret != (want)) FAIL("nvfail %s: got %s, want %s", what, strerror(-ret), \
				strerror(-(want))); \
	else if (!ret) phx_unreg(fd, r.handle); } while (0)
	stub_write("fail_get", "524 1");	/* the driver's -ENOTSUPP */
	NVEXPECT("ENOTSUPP from get_pages", -EOPNOTSUPP);
	stub_write("fail_get", "5 1");
	NVEXPECT("EIO from get_pages", -EIO);
	stub_write("refuse_persistent", "524");	/* MIG, vGPU, CC */
	NVEXPECT("persistent mapping refused (MIG/vGPU/CC)", -EOPNOTSUPP);
	stub_write("refuse_persistent", "0");
	stub_write("pt_version", "0x00030000");
	NVEXPECT("page table major 3", -EPROTO);
	stub_write("pt_version", "0x00010001");
	NVEXPECT("page table 1.1 (older than phx reads)", -EPROTO);
	stub_write("pt_version", "0x00010007");
	NVEXPECT("page table 1.7", 0);
	stub_write("pt_version", "0x00010002");
	NVEXPECT("page table 1.2", 0);
	stub_write("pt_version", "0x00020000");
	NVEXPECT("page table 2.0 (drivers from 580.95)", 0);
	stub_write("pt_flags", "1");
	NVEXPECT("CPU-cacheable memory (coherent platform)", -EOPNOTSUPP);
	stub_write("pt_flags", "0");
	stub_write("pt_version", "%s", ptv);
	stub_write("fragment", "2");
	NVEXPECT("64 KiB fragments", -EINVAL);
	stub_write("fragment", "0");
	/* a failing put: the driver keeps the table; phx must not touch it again */
	stub_write("fail_put", "5 1");
	NVEXPECT("put_pages failing", 0);
	for (i = 0; i < 200 && !stub_counters(&st) && st.tables != 1; i++)
		usleep(10000);
	if (st.tables != 1)
		FAIL("nvfail: after a failing put the driver should still hold 1 table, holds %ld",
		     st.tables);
	stub_write("reap", "1");	/* what the driver does at exit or unload */
	ret = nv_register(fd, b->nv_va + 3, 4 << 20, &r);
	if (ret != -EINVAL)
		FAIL("nvfail: unaligned VA: %s, want EINVAL", strerror(-ret));
	ret = nv_register(fd, 0x7000000000ULL, 4 << 20, &r);
	if (ret != -EINVAL)
		FAIL("nvfail: VA that is no GPU memory: %s, want EINVAL", strerror(-ret));
#undef NVEXPECT
	close(fd);
	(void)dir;
	if (!nv_settled("nvfail") && !failures)
		PASS("nvfail (driver errors mapped: ENOTSUPP->EOPNOTSUPP, persistent refused, page tables 1.2+ and 2.x, cacheable refused, fragments, failing put keeps the table)");
	return failures ? 1 : 0;
}

/*
 * The NVIDIA provider over the stub's older APIs: "cap" (R515-R530, get
 * pages without callback) works end to end and puts from the workqueue;
 * "none" (no persistent pages) is refused with EOPNOTSUPP.
 */
static int cmd_nvapi(const struct bdf *b, const char *kind)
{
	struct phx_register r;
	int fd = phx_open(), ret, sig;
	uint8_t *m;

	ret = nv_register(fd, b->nv_va, 4 << 20, &r);
	if (!strcmp(kind, "none")) {
		if (ret != -EOPNOTSUPP)
			FAIL("nvapi none: a driver without persistent pages: %s, want EOPNOTSUPP",
			     strerror(-ret));
		close(fd);
		if (!nv_settled("nvapi-none") && !failures)
			PASS("nvapi-none (no persistent API: refused EOPNOTSUPP)");
		return failures ? 1 : 0;
	}
	if (ret) {
		FAIL("nvapi %s: register: %s", kind, strerror(-ret));
		return 1;
	}
	m = mmap(NULL, 4 << 20, PROT_READ | PROT_WRITE, MAP_SHARED, fd, (off_t)r.mmap_offset);
	if (m == MAP_FAILED) {
		FAIL("nvapi %s: mmap: %s", kind, strerror(errno));
		return 1;
	}
	signal(SIGBUS, on_fault);
	signal(SIGSEGV, on_fault);
	memset(m, 0x3c, 4 << 20);
	stub_write("free_now", "%#llx", (unsigned long long)r.gpu_va);
	sig = touch(m + 4096);
	if (sig || m[4096] != 0x3c)
		FAIL("nvapi %s: cudaFree revoked a persistent mapping (signal %d)", kind, sig);
	munmap(m, 4 << 20);
	close(fd);	/* the teardown and the put run on phx's workqueue */
	if (!nv_settled(kind) && !failures)
		PASS("nvapi-%s (R515-R530 API: persistent, put from the workqueue, nothing left)", kind);
	return failures ? 1 : 0;
}

/*
 * Races, one pair of actors per kind, each iteration on a fresh
 * registration with random delays: mmap+touch, munmap, fork (the child
 * touches), unregister, cudaFree (the stub's free_now), and registering
 * the same range again from another fd while it is being torn down.
 * Every outcome a user can see must be one the ABI allows (cudaFree never
 * revokes: with it alone, mmap and touch must work); the kernel log must
 * stay clean (the harness checks); after the unregister no PTE is left
 * (pagemap), and nothing may be left behind.
 */
enum { A_MMAP, A_MUNMAP, A_FORK, A_UNREG, A_CB, A_REREG };

struct race {
	int fd;
	struct phx_register reg;
	uint8_t *premap;
	size_t len;
	int action;
	int strict;		/* no unregister in this kind: mmap must work */
	unsigned int delay_us;
	long bad;
};

static __thread sigjmp_buf race_jb;

static void race_fault(int sig)
{
	siglongjmp(race_jb, sig);
}

static int race_touch(volatile uint8_t *p, size_t len)
{
	size_t off;
	int sig = sigsetjmp(race_jb, 1);

	if (sig)
		return sig;
	for (off = 0; off < len; off += 64 << 10)
		p[off] = (uint8_t)off;
	return 0;
}

static void *race_actor(void *arg)
{
	struct race *r = arg;
	uint8_t *p;
	pid_t pid;
	int status, sig;

	usleep(r->delay_us);
	switch (r->action) {
	case A_MMAP:
		p = mmap(NULL, r->len, PROT_READ | PROT_WRITE, MAP_SHARED, r->fd,
			 (off_t)r->reg.mmap_offset);
		if (p == MAP_FAILED) {
			if (r->strict || (errno != ENODEV && errno != ENXIO))
				r->bad++;
			break;
		}
		sig = race_touch(p, r->len);
		if (sig && (r->strict || sig != SIGBUS))
			r->bad++;
		munmap(p, r->len);
		break;
	case A_MUNMAP:
		munmap(r->premap, r->len);
		break;
	case A_FORK:
		pid = fork();
		if (pid == 0) {
			/* VM_DONTCOPY: the child has nothing there */
			signal(SIGSEGV, race_fault);
			signal(SIGBUS, race_fault);
			_exit(race_touch(r->premap, 4096) == SIGSEGV ? 0 : 1);
		}
		if (pid < 0 || waitpid(pid, &status, 0) != pid ||
		    !WIFEXITED(status) || WEXITSTATUS(status))
			r->bad++;
		break;
	case A_UNREG: {
		int ret = phx_unreg(r->fd, r->reg.handle);

		if (ret && ret != -ENOENT)
			r->bad++;
		break;
	}
	case A_CB:
		stub_write("free_now", "%#llx", (unsigned long long)r->reg.gpu_va);
		break;
	case A_REREG: {
		struct phx_register r2;
		int fd2 = phx_open(), ret, k;

		/* hammer: the window is inside the other side's page removal */
		for (k = 0; k < 200; k++) {
			ret = nv_register(fd2, r->reg.gpu_va, r->len, &r2);
			if (ret != -EBUSY)
				break;
		}
		if (!ret)
			ret = phx_unreg(fd2, r2.handle);
		else if (ret == -EBUSY)
			ret = 0;	/* the old pages are still there */
		if (ret)
			r->bad++;
		close(fd2);
		break;
	}
	}
	return NULL;
}

static int cmd_race(const struct bdf *b, const char *kind, int n, uint64_t seed)
{
	static const struct { const char *name; int a, b; } kinds[] = {
		{ "mmap-unreg", A_MMAP, A_UNREG }, { "mmap-free", A_MMAP, A_CB },
		{ "munmap-free", A_MUNMAP, A_CB }, { "fork-free", A_FORK, A_CB },
		{ "unreg-free", A_UNREG, A_CB }, { "munmap-unreg", A_MUNMAP, A_UNREG },
		{ "fork-unreg", A_FORK, A_UNREG }, { "unreg-rereg", A_UNREG, A_REREG },
	};
	unsigned int k;
	long bad = 0;
	int i;

	rng_state = seed;
	signal(SIGSEGV, race_fault);
	signal(SIGBUS, race_fault);
	for (k = 0; k < sizeof(kinds) / sizeof(kinds[0]); k++)
		if (!strcmp(kinds[k].name, kind))
			break;
	if (k == sizeof(kinds) / sizeof(kinds[0])) {
		FAIL("race: unknown kind %s", kind);
		return 1;
	}
	for (i = 0; i < n && !failures; i++) {
		struct race ra = { 0 }, rb;
		pthread_t ta, tb;
		int ret, tries = 0;

		ra.fd = phx_open();
		ra.len = 2 << 20;
		while ((ret = nv_register(ra.fd, b->nv_va + (i % 4) * (2 << 20), ra.len,
					  &ra.reg)) == -EBUSY && tries++ < 500)
			usleep(2000);
		if (ret) {
			FAIL("race %s: register: %s", kind, strerror(-ret));
			break;
		}
		ra.premap = mmap(NULL, ra.len, PROT_READ | PROT_WRITE, MAP_SHARED, ra.fd,
				 (off_t)ra.reg.mmap_offset);
		if (ra.premap == MAP_FAILED) {
			FAIL("race %s: mmap: %s", kind, strerror(errno));
			break;
		}
		race_touch(ra.premap, ra.len);
		ra.strict = kinds[k].a != A_UNREG && kinds[k].b != A_UNREG;
		rb = ra;
		ra.action = kinds[k].a;
		rb.action = kinds[k].b;
		ra.delay_us = rnd() % 300;
		rb.delay_us = rnd() % 300;
		pthread_create(&ta, NULL, race_actor, &ra);
		pthread_create(&tb, NULL, race_actor, &rb);
		pthread_join(ta, NULL);
		pthread_join(tb, NULL);
		bad += ra.bad + rb.bad;
		ret = phx_unreg(ra.fd, ra.reg.handle);
		if (ret && ret != -ENOENT)
			bad++;
		if (ra.action != A_MUNMAP && rb.action != A_MUNMAP) {
			long pres = pagemap_present(ra.premap, ra.len);

			if (pres) {
				FAIL("race %s: iteration %d: %ld present PTEs after the unregister",
				     kind, i, pres);
				break;
			}
			munmap(ra.premap, ra.len);
		}
		close(ra.fd);
		if (bad) {
			FAIL("race %s: iteration %d: an actor saw an outcome the ABI does not allow", kind, i);
			break;
		}
		if (i % 250 == 249 && nv_settled(kind))
			break;
	}
	if (!nv_settled(kind) && !failures)
		PASS("race/%s %d iterations", kind, n);
	return failures ? 1 : 0;
}

static int cmd_info(void)
{
	struct phx_info info;
	int fd = phx_open();

	if (phx_info(fd, &info)) {
		FAIL("info: %s", strerror(errno));
		return 1;
	}
	printf("phx info: abi %u flags %#x align %u max %llu regs %llu busy %llu\n",
	       info.abi_version, info.flags, info.reg_align,
	       (unsigned long long)info.max_reg_bytes,
	       (unsigned long long)info.nr_regs,
	       (unsigned long long)info.nr_pages_busy);
	close(fd);
	return 0;
}

static uint64_t num(const char *s)
{
	return strtoull(s, NULL, 0);
}

int main(int argc, char **argv)
{
	struct bdf b;
	const char *cmd = argc > 1 ? argv[1] : "";

	setvbuf(stdout, NULL, _IOLBF, 0);
	if (!strcmp(cmd, "hostfill") && argc == 6)
		return cmd_host(argv[2], num(argv[3]), num(argv[4]), num(argv[5]), 1);
	if (!strcmp(cmd, "hostcheck") && argc == 6)
		return cmd_host(argv[2], num(argv[3]), num(argv[4]), num(argv[5]), 0);
	if (!strcmp(cmd, "info"))
		return cmd_info();
	if (!strcmp(cmd, "nvsparse") && argc == 5)
		return cmd_nvsparse(num(argv[2]), num(argv[3]), argv[4]);
	if (argc < 4 || parse_bdf(argv[2], &b)) {
		fprintf(stderr, "usage: see the comment at the top of %s\n", __FILE__);
		return 2;
	}
	if (!strcmp(cmd, "validate"))
		return cmd_validate(&b, atoi(argv[3]));
	if (!strcmp(cmd, "nvreg"))
		return cmd_nvreg(&b, atoi(argv[3]));
	if (!strcmp(cmd, "nvfail"))
		return cmd_nvfail(&b, argv[3]);
	if (!strcmp(cmd, "race") && argc == 6)
		return cmd_race(&b, argv[3], atoi(argv[4]), num(argv[5]));
	if (!strcmp(cmd, "nvapi") && argc == 4)
		return cmd_nvapi(&b, argv[3]);
	if (!strcmp(cmd, "nonroot") && argc == 5)
		return cmd_nonroot(&b, atoi(argv[3]), atoi(argv[4]));
	if (!strcmp(cmd, "splice") && (argc == 5 || argc == 6))
		return cmd_splice(&b, 2, num(argv[3]), num(argv[4]), argc == 6);
	if (!strcmp(cmd, "nvreuse") && argc == 6)
		return cmd_nvreuse(&b, num(argv[3]), num(argv[4]), argv[5]);
	if (!strcmp(cmd, "nvcb") && argc == 7)
		return cmd_nvcb(&b, num(argv[3]), num(argv[4]), argv[5], atoi(argv[6]));
	if (!strcmp(cmd, "garbage") && (argc == 5 || argc == 6))
		return cmd_garbage(&b, atoi(argv[3]), atol(argv[4]),
				   argc == 6 ? num(argv[5]) : 1);
	if (argc < 6)
		return 2;
	if (!strcmp(cmd, "hold"))
		return cmd_hold(&b, atoi(argv[3]), num(argv[4]), num(argv[5]));
	if (!strcmp(cmd, "fork"))
		return cmd_fork(&b, atoi(argv[3]), num(argv[4]), num(argv[5]));
	if (argc < 7)
		return 2;
	if (!strcmp(cmd, "busyio"))
		return cmd_busyio(&b, atoi(argv[3]), num(argv[4]), num(argv[5]), argv[6]);
	if (!strcmp(cmd, "fixedbuf"))
		return cmd_fixedbuf(&b, atoi(argv[3]), num(argv[4]), num(argv[5]),
				    argv[6]);
	if (!strcmp(cmd, "unreg"))
		return cmd_unreg(&b, atoi(argv[3]), num(argv[4]), num(argv[5]), argv[6]);
	if (!strcmp(cmd, "io") && argc == 8)
		return cmd_io(&b, atoi(argv[3]), num(argv[4]), num(argv[5]), argv[6],
			      argv[7]);
	if (!strcmp(cmd, "fillbar") && argc == 10)
		return cmd_fillbar(&b, atoi(argv[3]), num(argv[4]), num(argv[5]),
				   argv[6], num(argv[7]), num(argv[8]), num(argv[9]));
	if (!strcmp(cmd, "checkbar") && argc == 10)
		return cmd_checkbar(&b, atoi(argv[3]), num(argv[4]), num(argv[5]),
				    argv[6], num(argv[7]), num(argv[8]), num(argv[9]));
	fprintf(stderr, "unknown command or wrong arguments\n");
	return 2;
}
