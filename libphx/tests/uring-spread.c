/* SPDX-License-Identifier: Apache-2.0 */
/*
 * Description: large batches spread over io_uring's io-wq workers
 * (be_uring.c, "Spreading"; PHX_URING_SPREAD=1, auto and 0), on a file in
 * the test directory, the same through the page cache and - as root,
 * where zram can be had - ext4 on a new zram device, whose ops complete
 * inside the submitting call.  In each mode: random pieces (aligned and
 * not, some across or past the end) read byte for byte against the
 * reference with nothing written beside them; pieces written and read back;
 * four threads on one engine (one that exits leaves io-wq work of the
 * others cancelled: -ECANCELED, run again); pieces into read-only memory
 * fail with -EFAULT while the rest arrive.  On a raw zram device with a
 * memory limit, writes that fail with -EIO leave ranges that read -EIO,
 * never data.  On the io_uring backend: forced spreading sends ops to io-wq
 * workers and 0 none, and the detection calls zram and the page cache
 * inline, a disk not.
 */
#include <dirent.h>
#include <pthread.h>
#include <sys/mman.h>
#include <sys/mount.h>
#include <sys/sysmacros.h>
#include <sys/vfs.h>
#include <sys/wait.h>

#include "helpers.h"
/* the detection's score (be_uring.c): a test of the backend's heuristic */
#include "../src/internal.h"

#define NPIECES 256
#define SLOT (72 * KiB)		/* room per piece in the destination */
#define MAXLEN (64 * KiB)
#define NT 4
#define TMPFS_MAGIC_ 0x01021994

struct target {
	const char *name;
	const char *path;
	uint32_t pflags;	/* phx_file_open's */
	uint64_t size;
	unsigned char *model;	/* what it holds */
	bool inline_dev;	/* its ops never sleep (zram, page cache) */
	bool disk;		/* a block device that sleeps (not tmpfs, zram, overlay) */
};

/* ---- zram (root) ---- */

static int zram_ids[2] = { -1, -1 };
static char zram_mnt[64];

static int write_sys(const char *path, const char *val)
{
	int fd = open(path, O_WRONLY);
	ssize_t n;

	if (fd < 0)
		return -errno;
	n = write(fd, val, strlen(val));
	close(fd);
	return n < 0 ? -errno : 0;
}

static pid_t zram_owner;	/* the process that made them (not the test's child) */

static void zram_remove_all(void)
{
	char p[128], v[16];

	if (getpid() != zram_owner)
		return;

	if (zram_mnt[0]) {
		/* io_uring drops a closed file's registration a moment later */
		for (int i = 0; i < 100 && umount(zram_mnt); i++)
			usleep(10000);
		umount2(zram_mnt, MNT_DETACH);
		rmdir(zram_mnt);
		zram_mnt[0] = 0;
	}
	for (int i = 0; i < 2; i++) {
		if (zram_ids[i] < 0)
			continue;
		snprintf(p, sizeof(p), "/sys/block/zram%d/reset", zram_ids[i]);
		write_sys(p, "1\n");
		snprintf(v, sizeof(v), "%d\n", zram_ids[i]);
		write_sys("/sys/class/zram-control/hot_remove", v);
		zram_ids[i] = -1;
	}
}

/* A new zram device of @size (@limit: its memory limit, NULL none) in @dev; 0 or why not. */
static const char *zram_make(int k, const char *size, const char *limit, char *dev, size_t n)
{
	char p[128], buf[16];
	int fd, id;
	ssize_t r;

	if (geteuid() != 0)
		return "not root";
	fd = open("/sys/class/zram-control/hot_add", O_RDONLY);
	if (fd < 0)
		return "no /sys/class/zram-control";
	r = read(fd, buf, sizeof(buf) - 1);
	close(fd);
	if (r <= 0)
		return "hot_add gave no device";
	buf[r] = 0;
	id = atoi(buf);
	if (zram_ids[0] < 0 && zram_ids[1] < 0) {
		zram_owner = getpid();
		atexit(zram_remove_all);
	}
	zram_ids[k] = id;
	snprintf(p, sizeof(p), "/sys/block/zram%d/disksize", id);
	if (write_sys(p, size))
		return "cannot size it";
	snprintf(p, sizeof(p), "/sys/block/zram%d/mem_limit", id);
	if (limit && write_sys(p, limit))
		return "cannot limit its memory";
	snprintf(dev, n, "/dev/zram%d", id);
	for (int i = 0; i < 100 && access(dev, F_OK); i++)
		usleep(10000);	/* devtmpfs makes the node */
	return access(dev, F_OK) ? "no device node" : NULL;
}

/*
 * ext4 on a new zram device, mounted on a fresh directory (zram_mnt); NULL
 * or why not.  A raw zram device would not do: it takes no non-blocking
 * I/O, so io_uring sends every op to io-wq and none completes inline.
 */
static const char *zram_ext4(void)
{
	char dev[64], cmd[160];
	const char *why = zram_make(0, "96M\n", NULL, dev, sizeof(dev));

	if (why)
		return why;
	snprintf(cmd, sizeof(cmd), "mkfs.ext4 -q -F -E lazy_itable_init=0,lazy_journal_init=0 %s "
		 ">/dev/null 2>&1", dev);
	if (system(cmd))
		return "mkfs.ext4 failed or is missing";
	snprintf(zram_mnt, sizeof(zram_mnt), "/tmp/phx-test-zram-XXXXXX");
	if (!mkdtemp(zram_mnt)) {
		zram_mnt[0] = 0;
		return "mkdtemp failed";
	}
	if (mount(dev, zram_mnt, "ext4", 0, NULL)) {
		rmdir(zram_mnt);
		zram_mnt[0] = 0;
		return "mount failed";
	}
	return NULL;
}

/* ---- targets ---- */

/* Is @path's filesystem on a block device that sleeps (a disk)? */
static bool on_disk(const char *path)
{
	struct statfs sf;
	struct stat st;
	char p[128], link[256];
	ssize_t n;

	if (statfs(path, &sf) || sf.f_type == TMPFS_MAGIC_ || stat(path, &st) ||
	    major(st.st_dev) == 0)
		return false;
	snprintf(p, sizeof(p), "/sys/dev/block/%u:%u", major(st.st_dev), minor(st.st_dev));
	n = readlink(p, link, sizeof(link) - 1);
	if (n <= 0)
		return false;
	link[n] = 0;
	return !strstr(link, "/zram") && !strstr(link, "/loop") && !strstr(link, "/ram");
}

/* Fill @t with random data (a plain pwrite, the reference). */
static void target_fill(struct target *t)
{
	int fd = open(t->path, O_WRONLY | O_CREAT, 0644);
	uint64_t off = 0;

	T_CHECK(fd >= 0, "open %s: %s", t->path, strerror(errno));
	t->model = t_alloc(t->size, 4096);
	t_fill(t->model, t->size);
	while (off < t->size) {
		ssize_t r = pwrite(fd, t->model + off, t->size - off, off);

		T_CHECK(r > 0, "pwrite %s: %s", t->path, strerror(errno));
		off += r;
	}
	T_CHECK(fsync(fd) == 0, "fsync %s", t->path);
	close(fd);
}

/* ---- pieces ---- */

struct piece {
	uint64_t off;
	size_t len;
	size_t mem;	/* offset in the destination */
	int64_t want;	/* expected result */
};

/*
 * A random piece in slot @i of [lo, hi) of @t: aligned or not, now and
 * then across or past the end.  Its memory is either congruent with its
 * offset modulo 4096 or off by a non-multiple of 512: never 512-aligned
 * but not page-aligned, which Linux 6.18's O_DIRECT on ext4 on zram reads
 * wrongly into (data from 512 bytes on; a plain pread does the same) - not
 * this test's subject.
 */
static void piece_pick(struct piece *p, const struct target *t, uint64_t lo, uint64_t hi,
		       size_t i, bool read)
{
	uint64_t end;

	if (t_rand() % 3 == 0) {
		p->len = t_range(1, MAXLEN / 4096) * 4096;
		p->off = lo + t_range(0, (hi - lo - p->len) / 4096) * 4096;
	} else {
		p->len = t_range(1, MAXLEN);
		p->off = lo + t_range(0, hi - lo - p->len);
	}
	if (read && t_rand() % 16 == 0)	/* at or past the end */
		p->off = t->size - t_range(0, 8192) + t_range(0, 4096) / 512 * 512;
	p->mem = (size_t)i * SLOT + p->off % 4096;
	if (t_rand() % 2)
		p->mem += t_range(1, 511);
	end = p->off + p->len < t->size ? p->off + p->len : t->size;
	p->want = end > p->off ? (int64_t)(end - p->off) : 0;
}

/* Read @n pieces in one batch into @dst (zeroed) and check every byte. */
static void read_check(phx_file *f, const struct target *t, struct piece *ps, size_t n,
		       unsigned char *dst, const char *what)
{
	struct phx_io *ios = calloc(n, sizeof(*ios));

	memset(dst, 0, n * SLOT);
	for (size_t i = 0; i < n; i++)
		phx_io_prep(&ios[i], f, PHX_OP_READ, dst + ps[i].mem, ps[i].len, ps[i].off);
	T_CHECK(phx_submit_wait(f->eng, ios, n) == 0, "%s: submit_wait", what);
	for (size_t i = 0; i < n; i++) {
		const struct piece *p = &ps[i];
		size_t base = i * SLOT;

		T_CHECK(ios[i].result == p->want, "%s %s: piece %zu (%zu @ %" PRIu64
			") read %" PRId64 ", expected %" PRId64, t->name, what, i, p->len,
			p->off, ios[i].result, p->want);
		T_SAME(dst + p->mem, t->model + p->off, (size_t)p->want, "%s %s: piece %zu",
		       t->name, what, i);
		/* nothing beside it */
		for (size_t k = base; k < base + SLOT; k++)
			T_CHECK(dst[k] == 0 || (k >= p->mem && k < p->mem + (size_t)p->want),
				"%s %s: piece %zu wrote byte %zu of its slot", t->name, what, i,
				k - base);
	}
	free(ios);
}

static void read_batch(phx_file *f, const struct target *t, unsigned char *dst, const char *what)
{
	struct piece ps[NPIECES];

	for (size_t i = 0; i < NPIECES; i++)
		piece_pick(&ps[i], t, 0, t->size, i, true);
	read_check(f, t, ps, NPIECES, dst, what);
}

/* Write pieces, one per 64 KiB slot of the upper half, then read them back. */
static void write_batch(phx_file *f, struct target *t, unsigned char *dst, const char *what)
{
	size_t n = (size_t)(t->size / 2 / MAXLEN) < NPIECES ? t->size / 2 / MAXLEN : NPIECES;
	struct phx_io *ios = calloc(n, sizeof(*ios));
	struct piece *ps = calloc(n, sizeof(*ps));
	unsigned char *src = t_alloc(n * SLOT, 4096);

	t_fill(src, n * SLOT);
	for (size_t i = 0; i < n; i++) {
		uint64_t lo = t->size / 2 + i * MAXLEN;
		struct piece *p = &ps[i];

		piece_pick(p, t, lo, lo + MAXLEN, i, false);
		phx_io_prep(&ios[i], f, PHX_OP_WRITE, src + p->mem, p->len, p->off);
	}
	T_CHECK(phx_submit_wait(f->eng, ios, n) == 0, "%s: write submit_wait", what);
	for (size_t i = 0; i < n; i++) {
		T_CHECK(ios[i].result == (int64_t)ps[i].len, "%s %s: write %zu (%zu @ %" PRIu64
			") = %" PRId64, t->name, what, i, ps[i].len, ps[i].off, ios[i].result);
		memcpy(t->model + ps[i].off, src + ps[i].mem, ps[i].len);
	}
	read_check(f, t, ps, n, dst, what);
	/* and what a plain pread sees */
	for (size_t i = 0; i < n; i++) {
		unsigned char *got = malloc(ps[i].len);

		T_CHECK(t_pread(t->path, got, ps[i].len, ps[i].off) == ps[i].len, "ref read");
		T_SAME(got, t->model + ps[i].off, ps[i].len, "%s %s: written piece %zu (pread)",
		       t->name, what, i);
		free(got);
	}
	free(src);
	free(ps);
	free(ios);
}

/*
 * Aligned pieces, every other one into read-only memory: those fail with
 * -EFAULT (a kernel error through the same completions), the others arrive.
 */
static void efault_batch(phx_file *f, const struct target *t, const char *what)
{
	size_t n = 64, len = 16 * KiB;
	unsigned char *mem = mmap(NULL, n * len, PROT_READ | PROT_WRITE,
				  MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
	struct phx_io ios[64];
	uint64_t offs[64];

	T_CHECK(mem != MAP_FAILED, "mmap");
	memset(mem, 0, n * len);
	for (size_t i = 0; i < n; i += 2)
		T_CHECK(mprotect(mem + i * len, len, PROT_READ) == 0, "mprotect");
	for (size_t i = 0; i < n; i++) {
		offs[i] = t_range(0, (t->size - len) / 4096) * 4096;
		phx_io_prep(&ios[i], f, PHX_OP_READ, mem + i * len, len, offs[i]);
	}
	T_CHECK(phx_submit_wait(f->eng, ios, n) == 0, "%s: efault submit_wait", what);
	for (size_t i = 0; i < n; i++) {
		if (i % 2 == 0) {
			T_CHECK(ios[i].result == -EFAULT, "%s %s: read into read-only memory = %"
				PRId64, t->name, what, ios[i].result);
			continue;
		}
		T_CHECK(ios[i].result == (int64_t)len, "%s %s: piece %zu = %" PRId64, t->name,
			what, i, ios[i].result);
		T_SAME(mem + i * len, t->model + offs[i], len, "%s %s: piece %zu beside read-only ones",
		       t->name, what, i);
	}
	munmap(mem, n * len);
}

/* ---- threads on one engine ---- */

struct targ {
	phx_file *f;
	const struct target *t;
	uint64_t seed;
	int failed;
	char why[200];
};

static void *reader(void *p)
{
	struct targ *a = p;
	unsigned char *dst = t_alloc(64 * SLOT, 4096);
	struct phx_io ios[64];
	struct piece ps[64];
	uint64_t s = a->seed;

	for (int round = 0; round < 20 && !a->failed; round++) {
		for (size_t i = 0; i < 64; i++) {
			struct piece *q = &ps[i];

			s ^= s << 13, s ^= s >> 7, s ^= s << 17;
			q->len = 1 + s % MAXLEN;
			q->off = (s >> 20) % (a->t->size / 2 - q->len);
			q->mem = i * SLOT + q->off % 4096;
			phx_io_prep(&ios[i], a->f, PHX_OP_READ, dst + q->mem, q->len, q->off);
		}
		if (phx_submit_wait(a->f->eng, ios, 64)) {
			snprintf(a->why, sizeof(a->why), "submit_wait: %s", phx_strerror_last());
			a->failed = 1;
		}
		for (size_t i = 0; i < 64 && !a->failed; i++) {
			if (ios[i].result != (int64_t)ps[i].len ||
			    memcmp(dst + ps[i].mem, a->t->model + ps[i].off, ps[i].len)) {
				snprintf(a->why, sizeof(a->why), "round %d piece %zu: %zu @ %" PRIu64
					 " = %" PRId64 "%s", round, i, ps[i].len, ps[i].off,
					 ios[i].result, ios[i].result > 0 ? " (bytes differ)" : "");
				a->failed = 1;
			}
		}
	}
	free(dst);
	return NULL;
}

static void threads_check(phx_file *f, const struct target *t, const char *what)
{
	pthread_t th[NT];
	struct targ a[NT];

	for (int i = 0; i < NT; i++) {
		a[i] = (struct targ){ .f = f, .t = t, .seed = t_rand() | 1 };
		T_CHECK(pthread_create(&th[i], NULL, reader, &a[i]) == 0, "pthread_create");
	}
	for (int i = 0; i < NT; i++)
		pthread_join(th[i], NULL);
	for (int i = 0; i < NT; i++)
		T_CHECK(!a[i].failed, "%s %s: thread %d: %s", t->name, what, i, a[i].why);
}

/* ---- io-wq workers of one thread ---- */

/* io-wq workers are threads named "iou-wrk-<tid of the submitting thread>". */
static int workers_of(pid_t tid)
{
	char want[32], p[300], comm[32];
	struct dirent *e;
	DIR *d = opendir("/proc/self/task");
	int n = 0;

	snprintf(want, sizeof(want), "iou-wrk-%d", (int)tid);
	if (!d)
		return -1;
	while ((e = readdir(d))) {
		FILE *fp;

		if (e->d_name[0] == '.')
			continue;
		snprintf(p, sizeof(p), "/proc/self/task/%s/comm", e->d_name);
		fp = fopen(p, "r");
		if (!fp)
			continue;
		if (fgets(comm, sizeof(comm), fp) && !strncmp(comm, want, strlen(want)))
			n++;
		fclose(fp);
	}
	closedir(d);
	return n;
}

struct wargs {
	phx_file *f;
	const struct target *t;
	unsigned char *dst;
	int workers;
};

/* Two read batches from a fresh thread; its io-wq workers counted after. */
static void *fresh_reader(void *p)
{
	struct wargs *w = p;

	read_batch(w->f, w->t, w->dst, "fresh thread");
	read_batch(w->f, w->t, w->dst, "fresh thread");
	w->workers = workers_of(gettid());
	return NULL;
}

static int workers_used(phx_file *f, const struct target *t, unsigned char *dst)
{
	struct wargs w = { .f = f, .t = t, .dst = dst, .workers = -1 };
	pthread_t th;

	T_CHECK(pthread_create(&th, NULL, fresh_reader, &w) == 0, "pthread_create");
	pthread_join(th, NULL);
	return w.workers;
}

/* ---- one target, one mode ---- */

static void run_mode(struct target *t, const char *mode, unsigned char *dst)
{
	struct phx_engine_config cfg;
	char what[64];
	phx_engine *eng;
	phx_file *f;
	bool uring;

	snprintf(what, sizeof(what), "PHX_URING_SPREAD=%s", mode);
	setenv("PHX_URING_SPREAD", mode, 1);
	phx_engine_config_init(&cfg);
	cfg.queue_depth = 64;
	eng = t_engine(&cfg);
	uring = !strcmp(phx_engine_backend(eng), "uring");
	f = t_open(eng, t->path, O_RDWR, t->pflags);

	for (int i = 0; i < 4; i++)
		read_batch(f, t, dst, what);
	if (uring && !strcmp(mode, "auto")) {
		int score = eng->u.uring.inline_score;

		/* a disk's ops sleep; zram's and the page cache's never */
		if (t->inline_dev)
			T_CHECK(score > 0, "%s: inline device not detected (score %d)", t->name, score);
		else if (t->disk)
			T_CHECK(score <= 0, "%s: disk taken for inline (score %d)", t->name, score);
		fprintf(stderr, "%s: detection score %d after 4 batches\n", t->name, score);
	}
	if (uring && !strcmp(mode, "1")) {
		int n = workers_used(f, t, dst);

		/* one CPU: no worker to spread to (a forced engine still takes one) */
		T_CHECK(eng->u.uring.async_sqes > 0 && n > 0,
			"%s: forced spreading sent %" PRIu64 " ops to io-wq, %d workers",
			t->name, eng->u.uring.async_sqes, n);
		fprintf(stderr, "%s %s: %" PRIu64 " ops through io-wq, %d workers\n", t->name,
			what, eng->u.uring.async_sqes, n);
	}
	if (uring && !strcmp(mode, "0"))
		T_CHECK(eng->u.uring.async_sqes == 0 && !eng->u.uring.iowq_cap,
			"%s: %" PRIu64 " ops sent to io-wq with spreading off", t->name,
			eng->u.uring.async_sqes);
	write_batch(f, t, dst, what);
	efault_batch(f, t, what);
	threads_check(f, t, what);
	T_CHECK(phx_file_close(f) == 0, "close");
	T_CHECK(phx_engine_destroy(eng) == 0, "destroy");
}

/*
 * zram with a memory limit: writes past it fail with -EIO (in io-wq when
 * spread).  A failed piece's range then reads -EIO, never data; the pieces
 * that were written read back exactly.
 */
static void eio_check(const char *dev, const char *why, unsigned char *dst)
{
	size_t n = 192, len = 64 * KiB, bad = 0;
	struct phx_io *ios = calloc(n, sizeof(*ios));
	bool *failed = calloc(n, sizeof(*failed));
	unsigned char *src = t_alloc(n * len, 4096);
	phx_engine *eng;
	phx_file *f;

	if (why) {
		fprintf(stderr, "the -EIO part left out: no zram device (%s)\n", why);
		free(ios);
		free(failed);
		free(src);
		return;
	}
	setenv("PHX_URING_SPREAD", "1", 1);
	eng = t_engine(NULL);
	f = t_open(eng, dev, O_RDWR, 0);
	t_fill(src, n * len);
	for (size_t i = 0; i < n; i++)
		phx_io_prep(&ios[i], f, PHX_OP_WRITE, src + i * len, len, i * len);
	T_CHECK(phx_submit_wait(eng, ios, n) == 0, "eio: write submit_wait");
	for (size_t i = 0; i < n; i++) {
		T_CHECK(ios[i].result == (int64_t)len || ios[i].result == -EIO,
			"eio: write %zu = %" PRId64, i, ios[i].result);
		failed[i] = ios[i].result < 0;
		bad += failed[i];
	}
	T_CHECK(bad > 0 && bad < n, "eio: %zu of %zu writes failed (want some, not all)", bad, n);
	for (size_t i = 0; i < n; i++)
		phx_io_prep(&ios[i], f, PHX_OP_READ, dst + i * len, len, i * len);
	memset(dst, 0, n * len);
	T_CHECK(phx_submit_wait(eng, ios, n) == 0, "eio: read submit_wait");
	for (size_t i = 0; i < n; i++) {
		if (failed[i]) {
			T_CHECK(ios[i].result == -EIO, "eio: failed write's range read %" PRId64,
				ios[i].result);
			for (size_t k = 0; k < len; k++)
				T_CHECK(dst[i * len + k] == 0, "eio: failed range %zu gave data", i);
		} else {
			T_CHECK(ios[i].result == (int64_t)len, "eio: read %zu = %" PRId64, i,
				ios[i].result);
			T_SAME(dst + i * len, src + i * len, len, "eio: written piece %zu", i);
		}
	}
	fprintf(stderr, "zram with a memory limit: %zu of %zu writes failed with -EIO, "
		"their ranges read -EIO\n", bad, n);
	T_CHECK(phx_file_close(f) == 0, "close");
	T_CHECK(phx_engine_destroy(eng) == 0, "destroy");
	free(ios);
	free(failed);
	free(src);
}

/*
 * The checks run in a child: one that fails exits with files still open on
 * the zram devices, which the parent can then unmount and remove.
 */
int main(void)
{
	static const char *const modes[] = { "1", "auto", "0" };
	unsigned char *dst = t_alloc(NPIECES * SLOT, 4096);
	struct target ts[3];
	const char *why, *eio_why;
	char zpath[128], eio_dev[64];
	size_t nt = 0;
	int status;
	bool disk;
	pid_t pid;

	t_seed();
	disk = on_disk(getenv("PHX_TEST_DIR") && *getenv("PHX_TEST_DIR") ?
		       getenv("PHX_TEST_DIR") : ".");
	ts[nt++] = (struct target){ .name = "file", .path = t_path("spread"),
				    .size = 24 * MiB + 1234, .disk = disk };
	/*
	 * The same through the page cache: a hit is a copy that never sleeps,
	 * run inline where the filesystem takes non-blocking buffered reads
	 * (ext4, xfs); tmpfs does not, and io_uring sends every one to io-wq.
	 */
	ts[nt++] = (struct target){ .name = "page cache", .path = t_path("spread-pc"),
				    .pflags = PHX_FILE_BUFFERED, .size = 24 * MiB + 777,
				    .inline_dev = disk };
	why = zram_ext4();
	if (!why) {
		snprintf(zpath, sizeof(zpath), "%s/spread", zram_mnt);
		ts[nt++] = (struct target){ .name = "ext4 on zram", .path = zpath,
					    .size = 32 * MiB + 4321, .inline_dev = true };
	} else {
		fprintf(stderr, "no ext4 on zram (%s): that target left out\n", why);
	}
	eio_why = zram_make(1, "32M\n", "4M\n", eio_dev, sizeof(eio_dev));

	pid = fork();
	T_CHECK(pid >= 0, "fork");
	if (pid == 0) {
		for (size_t i = 0; i < nt; i++) {
			target_fill(&ts[i]);
			for (size_t m = 0; m < 3; m++)
				run_mode(&ts[i], modes[m], dst);
			free(ts[i].model);
		}
		eio_check(eio_why ? NULL : eio_dev, eio_why, dst);
		exit(T_EXIT_PASS);
	}
	T_CHECK(waitpid(pid, &status, 0) == pid, "waitpid");
	free(dst);
	if (!WIFEXITED(status)) {
		fprintf(stderr, "test child ended by signal %d\n", WTERMSIG(status));
		return T_EXIT_FAIL;
	}
	return WEXITSTATUS(status);
}
