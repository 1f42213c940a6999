// SPDX-License-Identifier: Apache-2.0
/*
 * stats_pub.c - live counters in a shared-memory file that other processes
 * read (`phx stats`, `phx top`).
 *
 * Why a file and a thread: the counters of an engine or a GPU context live
 * under that object's own lock, updated on every completion; copying them
 * into shared memory there would put a second copy on the I/O path.  Instead
 * each object registers a source (a fill function), and one thread of this
 * copy of libphx copies every source into the file every interval.  Readers
 * see counters at most one interval old, and an idle process (nothing
 * published) has no thread.
 *
 * The file describes itself so that readers need no C header: a header
 * (magic written last), a table of kinds (each with its counter names, fixed
 * by the kind's first source) and a table of slots (one per source: kind,
 * label, values under a sequence count: odd while being written).  The
 * layout is documented in docs/design.md, "Live counters";
 * python/phx/livestats.py reads it.
 *
 * This is process-wide state by nature (one file per process and copy of
 * libphx), kept in the one struct `pub` below under pub.lock.  Lock order:
 * pub.lock, then whatever a fill function takes (an engine's or a context's
 * lock); sources are therefore added and removed without those held.
 */
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "internal.h"

#define SHM_MAGIC "PHXSTAT1"
#define SHM_VERSION 1u
#define SHM_HDR_SIZE 1024u
#define SHM_MAX_KINDS 8u
#define SHM_MAX_SLOTS 128u
#define SHM_NAME_LEN 32u
#define SHM_LABEL_LEN 96u
#define SHM_DEFAULT_INTERVAL_MS 200u
/* copies of libphx in one process (the package's, libphxfile's static one) */
#define SHM_MAX_COPIES 16

struct shm_hdr {
	char magic[8];		/* SHM_MAGIC once the file is complete */
	uint32_t version;
	uint32_t hdr_size;
	uint32_t kinds_off;	/* the kinds table */
	uint32_t kind_size;
	uint32_t max_kinds;
	uint32_t slots_off;	/* the slots table */
	uint32_t slot_size;
	uint32_t max_slots;
	uint32_t max_counters;
	uint32_t name_len;	/* bytes of a counter or kind name */
	int32_t pid;
	uint32_t interval_ms;
	uint64_t start_ticks;	/* /proc/<pid>/stat starttime: pid reuse */
	uint64_t rounds;	/* publication rounds so far */
	uint64_t updated_ns;	/* CLOCK_MONOTONIC of the last round */
	char comm[32];
	char cmdline[256];
	char version_str[16];	/* phx_version() */
};

struct shm_kind {
	char name[SHM_NAME_LEN];	/* "" : unused */
	uint32_t ncounters;
	uint32_t pad;
	char counters[PHX_STATS_MAX_COUNTERS][SHM_NAME_LEN];
};

enum { SLOT_FREE = 0, SLOT_LIVE = 1 };

struct shm_slot {
	uint64_t seq;		/* odd while being written */
	uint32_t state;		/* SLOT_* */
	uint32_t kind;		/* index in the kinds table */
	uint64_t id;		/* never reused within the file */
	uint64_t created_ns;	/* CLOCK_MONOTONIC */
	uint64_t updated_ns;
	char label[SHM_LABEL_LEN];
	uint64_t values[PHX_STATS_MAX_COUNTERS];
};

_Static_assert(sizeof(struct shm_hdr) <= SHM_HDR_SIZE, "header too large");

struct phx_stats_source {
	struct phx_stats_source *next;
	phx_stats_fill_fn fill;	/* or, with fill NULL: */
	const struct stat_field *fields;	/* fields of a struct ... */
	void (*get)(void *obj, void *st);	/* ... that this fills */
	void *arg;
	uint32_t n;
	uint32_t slot;
	uint64_t gen;		/* pub.gen when added: a forked child forgets it */
};

enum pub_state { PUB_UNTRIED = 0, PUB_ON = 1, PUB_OFF = 2 };

static struct {
	pthread_mutex_t lock;
	pthread_cond_t wake;	/* CLOCK_MONOTONIC (pub_init) */
	struct phx_stats_source *head;
	enum pub_state state;
	char why[PATH_MAX + 128];	/* PUB_OFF: the reason */
	char path[PATH_MAX];
	int fd;
	struct shm_hdr *hdr;	/* the mapping */
	size_t size;
	uint32_t interval_ms;
	uint64_t next_id;
	uint64_t gen;		/* bumped in a forked child */
	bool running;		/* the publishing thread exists */
	bool stop;		/* exit: the thread ends at its next wake */
} pub = {
	.lock = PTHREAD_MUTEX_INITIALIZER,
	.fd = -1,
};

static pthread_once_t pub_once = PTHREAD_ONCE_INIT;

static uint64_t now_ns(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static struct shm_kind *kind_at(uint32_t i)
{
	return (struct shm_kind *)((char *)pub.hdr + pub.hdr->kinds_off +
				   (size_t)i * sizeof(struct shm_kind));
}

static struct shm_slot *slot_at(uint32_t i)
{
	return (struct shm_slot *)((char *)pub.hdr + pub.hdr->slots_off +
				   (size_t)i * sizeof(struct shm_slot));
}

/* Field 22 of /proc/self/stat (after the command's closing parenthesis). */
static uint64_t self_start_ticks(void)
{
	char buf[1024], *p;
	unsigned long long v = 0;
	ssize_t n;
	int fd = open("/proc/self/stat", O_RDONLY | O_CLOEXEC), i;

	if (fd < 0)
		return 0;
	n = read(fd, buf, sizeof(buf) - 1);
	close(fd);
	if (n <= 0)
		return 0;
	buf[n] = 0;
	p = strrchr(buf, ')');
	/* after ") " come fields 3, 4, ...: skip to field 22 */
	for (i = 3; p && i <= 22; i++) {
		p = strchr(p + 1, ' ');
		if (p && i == 22)
			v = strtoull(p + 1, NULL, 10);
	}
	return v;
}

static void read_cmdline(char *out, size_t len)
{
	ssize_t n, i;
	int fd = open("/proc/self/cmdline", O_RDONLY | O_CLOEXEC);

	out[0] = 0;
	if (fd < 0)
		return;
	n = read(fd, out, len - 1);
	close(fd);
	if (n <= 0)
		return;
	/* arguments apart by spaces; control characters (a -c script's newlines) too */
	for (i = 0; i < n; i++)
		if ((unsigned char)out[i] < 0x20 || out[i] == 0x7f)
			out[i] = ' ';
	while (n > 0 && out[n - 1] == ' ')
		n--;
	out[n] = 0;
}

/* A file named like ours left by a process that had our pid before us. */
static bool file_is_stale(const char *path, uint64_t ticks)
{
	struct shm_hdr h;
	ssize_t n;
	int fd = open(path, O_RDONLY | O_CLOEXEC | O_NOFOLLOW);

	if (fd < 0)
		return false;
	n = pread(fd, &h, sizeof(h), 0);
	close(fd);
	/* incomplete: another copy of libphx here is making it right now */
	if (n != (ssize_t)sizeof(h) || memcmp(h.magic, SHM_MAGIC, 8))
		return false;
	return h.pid != getpid() || h.start_ticks != ticks;
}

static void fill_header(struct shm_hdr *h, uint64_t ticks)
{
	char comm[sizeof(h->comm)];
	int fd;
	ssize_t n;

	h->version = SHM_VERSION;
	h->hdr_size = SHM_HDR_SIZE;
	h->kinds_off = SHM_HDR_SIZE;
	h->kind_size = sizeof(struct shm_kind);
	h->max_kinds = SHM_MAX_KINDS;
	h->slots_off = SHM_HDR_SIZE + SHM_MAX_KINDS * sizeof(struct shm_kind);
	h->slot_size = sizeof(struct shm_slot);
	h->max_slots = SHM_MAX_SLOTS;
	h->max_counters = PHX_STATS_MAX_COUNTERS;
	h->name_len = SHM_NAME_LEN;
	h->pid = getpid();
	h->interval_ms = pub.interval_ms;
	h->start_ticks = ticks;
	h->updated_ns = now_ns();
	fd = open("/proc/self/comm", O_RDONLY | O_CLOEXEC);
	n = fd >= 0 ? read(fd, comm, sizeof(comm) - 1) : -1;
	if (fd >= 0)
		close(fd);
	if (n > 0) {
		comm[n] = 0;
		comm[strcspn(comm, "\n")] = 0;
		snprintf(h->comm, sizeof(h->comm), "%s", comm);
	}
	read_cmdline(h->cmdline, sizeof(h->cmdline));
	snprintf(h->version_str, sizeof(h->version_str), "%s", phx_version());
	__atomic_thread_fence(__ATOMIC_RELEASE);
	memcpy(h->magic, SHM_MAGIC, 8);
}

static int pub_off(int err, const char *fmt, const char *arg)
{
	char msg[PATH_MAX + 64];

	snprintf(msg, sizeof(msg), fmt, arg);
	pub.state = PUB_OFF;
	snprintf(pub.why, sizeof(pub.why), "%s%s%s", msg, err < 0 ? ": " : "",
		 err < 0 ? strerror(-err) : "");
	return -ENOTSUP;
}

/* Make this copy's file (lock held).  0, or -ENOTSUP with pub.why. */
static int pub_open_locked(void)
{
	const char *dir = getenv("PHX_STATS_DIR");
	uint64_t ticks = self_start_ticks();
	size_t size = SHM_HDR_SIZE + SHM_MAX_KINDS * sizeof(struct shm_kind) +
		      SHM_MAX_SLOTS * sizeof(struct shm_slot);
	int fd = -1, k, tries = 0, err;
	void *map;

	if (phx_env_u32("PHX_STATS", 1) == 0)
		return pub_off(0, "off (PHX_STATS=0)%s", "");
	if (!dir || !*dir)
		dir = "/dev/shm";
	pub.interval_ms = phx_env_u32("PHX_STATS_INTERVAL_MS", SHM_DEFAULT_INTERVAL_MS);
	if (!pub.interval_ms)
		pub.interval_ms = SHM_DEFAULT_INTERVAL_MS;
	for (k = 0; k < SHM_MAX_COPIES && tries < 2 * SHM_MAX_COPIES; k++, tries++) {
		snprintf(pub.path, sizeof(pub.path), "%s/phx-stats.%d.%d", dir,
			 (int)getpid(), k);
		fd = open(pub.path, O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC | O_NOFOLLOW, 0644);
		if (fd >= 0)
			break;
		if (errno != EEXIST)
			return pub_off(-errno, "cannot create a file in %s (PHX_STATS_DIR)", dir);
		if (file_is_stale(pub.path, ticks) && !unlink(pub.path))
			k--;		/* a dead process's: take its name */
	}
	if (fd < 0)
		return pub_off(0, "no free file name in %s", dir);
	/* readable by other users' `phx top`, whatever the umask */
	if (fchmod(fd, 0644) || ftruncate(fd, (off_t)size)) {
		err = -errno;
		goto fail;
	}
	map = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
	if (map == MAP_FAILED) {
		err = -errno;
		goto fail;
	}
	pub.fd = fd;
	pub.hdr = map;
	pub.size = size;
	fill_header(pub.hdr, ticks);
	pub.state = PUB_ON;
	return 0;
fail:
	close(fd);
	unlink(pub.path);
	return pub_off(err, "cannot size or map %s", pub.path);
}

/* The index of @kind in the table, added if new (lock held); -errno. */
static int kind_find_locked(const char *kind, const char *const *names, uint32_t n)
{
	struct shm_kind *k;
	uint32_t i, j;

	for (i = 0; i < SHM_MAX_KINDS; i++) {
		k = kind_at(i);
		if (!k->name[0])
			break;
		if (strncmp(k->name, kind, SHM_NAME_LEN))
			continue;
		if (k->ncounters != n)
			return phx_err(-EINVAL, "stats kind %s: %u counters, published with %u",
				       kind, n, k->ncounters);
		for (j = 0; j < n; j++)
			if (strncmp(k->counters[j], names[j], SHM_NAME_LEN))
				return phx_err(-EINVAL, "stats kind %s: counter %u is %s, published as %.32s",
					       kind, j, names[j], k->counters[j]);
		return (int)i;
	}
	if (i == SHM_MAX_KINDS)
		return phx_err(-ENOSPC, "stats kind %s: no room for another kind", kind);
	for (j = 0; j < n; j++)
		snprintf(k->counters[j], SHM_NAME_LEN, "%s", names[j]);
	k->ncounters = n;
	/* the name last: a reader takes a kind with a name as complete */
	__atomic_thread_fence(__ATOMIC_RELEASE);
	snprintf(k->name, SHM_NAME_LEN, "%s", kind);
	return (int)i;
}

static void slot_begin(struct shm_slot *s)
{
	__atomic_store_n(&s->seq, s->seq + 1, __ATOMIC_RELAXED);
	__atomic_thread_fence(__ATOMIC_RELEASE);
}

static void slot_end(struct shm_slot *s)
{
	__atomic_store_n(&s->seq, s->seq + 1, __ATOMIC_RELEASE);
}

/* A struct source: the struct read whole, then its fields picked by name. */
static void fill_fields(const struct phx_stats_source *src, uint64_t *vals)
{
	uint64_t st[STAT_STRUCT_MAX / sizeof(uint64_t)];
	uint32_t i;

	memset(st, 0, sizeof(st));
	src->get(src->arg, st);
	for (i = 0; i < src->n; i++)
		memcpy(&vals[i], (char *)st + src->fields[i].off, sizeof(uint64_t));
}

/* Copy every source into its slot (lock held). */
static void publish_locked(void)
{
	uint64_t vals[PHX_STATS_MAX_COUNTERS], t = now_ns();
	struct phx_stats_source *src;
	struct shm_slot *s;

	for (src = pub.head; src; src = src->next) {
		s = slot_at(src->slot);
		/* a fill that cannot read its counters now leaves the last ones */
		memcpy(vals, s->values, sizeof(vals));
		if (src->fill)
			src->fill(src->arg, vals, src->n);
		else
			fill_fields(src, vals);
		slot_begin(s);
		memcpy(s->values, vals, sizeof(vals));
		s->updated_ns = t;
		slot_end(s);
	}
	pub.hdr->rounds++;
	__atomic_store_n(&pub.hdr->updated_ns, t, __ATOMIC_RELEASE);
}

static void *pub_thread(void *unused)
{
	struct timespec ts;
	uint64_t t;

	pthread_mutex_lock(&pub.lock);
	while (pub.head && !pub.stop) {
		publish_locked();
		t = now_ns() + (uint64_t)pub.interval_ms * 1000000ull;
		ts.tv_sec = (time_t)(t / 1000000000ull);
		ts.tv_nsec = (long)(t % 1000000000ull);
		pthread_cond_timedwait(&pub.wake, &pub.lock, &ts);
	}
	pub.running = false;
	pthread_cond_broadcast(&pub.wake);
	pthread_mutex_unlock(&pub.lock);
	return NULL;
}

static void pub_atfork_prepare(void)
{
	pthread_mutex_lock(&pub.lock);
}

static void pub_atfork_parent(void)
{
	pthread_mutex_unlock(&pub.lock);
}

/* The publishing thread's wake-up, timed on CLOCK_MONOTONIC. */
static void wake_init(void)
{
	pthread_condattr_t ca;

	pthread_condattr_init(&ca);
	pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
	pthread_cond_init(&pub.wake, &ca);
	pthread_condattr_destroy(&ca);
}

/*
 * The child has no publishing thread and must not write the parent's file:
 * it forgets both (its sources' records are freed when removed) and makes
 * its own file for what it publishes itself.  Its copy of the wake-up is
 * made anew: the parent's thread was waiting on it at the fork, and glibc's
 * condvar counts that waiter, which never leaves in the child - its first
 * broadcast waited for it forever (engine-backend's forked child, hung in
 * phx_engine_destroy, 2026-12-07).
 */
static void pub_atfork_child(void)
{
	wake_init();
	if (pub.hdr)
		munmap(pub.hdr, pub.size);
	if (pub.fd >= 0)
		close(pub.fd);
	pub.hdr = NULL;
	pub.fd = -1;
	pub.head = NULL;
	pub.running = false;
	pub.stop = false;
	pub.state = PUB_UNTRIED;
	pub.gen++;
	pthread_mutex_unlock(&pub.lock);
}

static void pub_init(void)
{
	wake_init();
	pthread_atfork(pub_atfork_prepare, pub_atfork_parent, pub_atfork_child);
}

/* At exit (or when this copy of libphx is unloaded): stop, remove the file. */
__attribute__((destructor)) static void pub_fini(void)
{
	struct timespec ts;

	if (pub.state != PUB_ON)
		return;
	pthread_mutex_lock(&pub.lock);
	pub.stop = true;
	pthread_cond_broadcast(&pub.wake);
	/* the thread's code may be unloaded with us: let it leave first */
	clock_gettime(CLOCK_MONOTONIC, &ts);
	ts.tv_nsec += 100000000;
	if (ts.tv_nsec >= 1000000000) {
		ts.tv_sec++;
		ts.tv_nsec -= 1000000000;
	}
	while (pub.running)
		if (pthread_cond_timedwait(&pub.wake, &pub.lock, &ts))
			break;
	if (pub.hdr && pub.hdr->pid == getpid())
		unlink(pub.path);
	pthread_mutex_unlock(&pub.lock);
}

static int source_add_locked(const char *kind, const char *const *names, uint32_t n,
			     const char *label, struct phx_stats_source *src)
{
	struct shm_slot *s;
	uint32_t i;
	int ki;

	if (pub.state == PUB_UNTRIED)
		pub_open_locked();
	if (pub.state != PUB_ON)
		return phx_err(-ENOTSUP, "live counters %s", pub.why);
	ki = kind_find_locked(kind, names, n);
	if (ki < 0)
		return ki;
	for (i = 0; i < SHM_MAX_SLOTS; i++)
		if (slot_at(i)->state == SLOT_FREE)
			break;
	if (i == SHM_MAX_SLOTS)
		return phx_err(-ENOSPC, "live counters: all %u slots of %s are taken",
			       SHM_MAX_SLOTS, pub.path);
	s = slot_at(i);
	slot_begin(s);
	s->kind = (uint32_t)ki;
	s->id = ++pub.next_id;
	s->created_ns = s->updated_ns = now_ns();
	snprintf(s->label, sizeof(s->label), "%s", label ? label : kind);
	memset(s->values, 0, sizeof(s->values));
	s->state = SLOT_LIVE;
	slot_end(s);
	src->slot = i;
	src->n = n;
	src->gen = pub.gen;
	src->next = pub.head;
	pub.head = src;
	return 0;
}

static int check_names(const char *kind, const char *const *names, uint32_t n)
{
	uint32_t i;

	if (!kind || !*kind || strlen(kind) >= SHM_NAME_LEN || !names || !n ||
	    n > PHX_STATS_MAX_COUNTERS)
		return phx_err(-EINVAL, "phx_stats_source_add: a kind (under %u bytes) and 1 to %u names are needed",
			       SHM_NAME_LEN, PHX_STATS_MAX_COUNTERS);
	for (i = 0; i < n; i++)
		if (!names[i] || !*names[i] || strlen(names[i]) >= SHM_NAME_LEN)
			return phx_err(-EINVAL, "phx_stats_source_add: counter %u of %s: a name under %u bytes is needed",
				       i, kind, SHM_NAME_LEN);
	return 0;
}

/* List @src (its fill or fields set) and start the thread if none runs. */
static int source_add(const char *kind, const char *const *names, uint32_t n,
		      const char *label, struct phx_stats_source *src)
{
	pthread_t tid;
	pthread_attr_t attr;
	bool start;
	int ret;

	pthread_once(&pub_once, pub_init);
	pthread_mutex_lock(&pub.lock);
	ret = source_add_locked(kind, names, n, label, src);
	start = !ret && !pub.running;
	if (start)
		pub.running = true;
	pthread_mutex_unlock(&pub.lock);
	if (ret)
		return ret;
	if (start) {
		/* detached: it ends by itself once nothing is published */
		pthread_attr_init(&attr);
		pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
		if (pthread_create(&tid, &attr, pub_thread, NULL)) {
			pthread_mutex_lock(&pub.lock);
			pub.running = false;
			pthread_mutex_unlock(&pub.lock);
		}
		pthread_attr_destroy(&attr);
	}
	return 0;
}

/* A copy of @proto (its fill, or fields and get) published; *@out set on success. */
static int source_new(const char *kind, const char *const *names, uint32_t n,
		      const char *label, const struct phx_stats_source *proto,
		      phx_stats_source **out)
{
	struct phx_stats_source *src;
	int ret = check_names(kind, names, n);

	if (ret)
		return ret;
	src = malloc(sizeof(*src));
	if (!src)
		return phx_err(-ENOMEM, "out of memory");
	*src = *proto;
	ret = source_add(kind, names, n, label, src);
	if (ret)
		free(src);
	else
		*out = src;
	return ret;
}

PHX_EXPORT int phx_stats_source_add(const char *kind, const char *const *names, uint32_t n,
				    const char *label, phx_stats_fill_fn fill, void *arg,
				    phx_stats_source **out)
{
	struct phx_stats_source proto = { .fill = fill, .arg = arg };

	if (!out)
		return phx_err(-EINVAL, "phx_stats_source_add: out is NULL");
	*out = NULL;
	if (!fill)
		return phx_err(-EINVAL, "phx_stats_source_add: no fill function");
	return source_new(kind, names, n, label, &proto, out);
}

int stats_add_struct(const char *kind, const char *label, const struct stat_field *fields,
		     uint32_t n, void (*get)(void *obj, void *st), void *obj,
		     phx_stats_source **out)
{
	struct phx_stats_source proto = { .fields = fields, .get = get, .arg = obj };
	const char *names[PHX_STATS_MAX_COUNTERS];
	uint32_t i;

	*out = NULL;
	if (n > PHX_STATS_MAX_COUNTERS)
		return -EINVAL;
	for (i = 0; i < n; i++) {
		if (fields[i].off + sizeof(uint64_t) > STAT_STRUCT_MAX)
			return -EINVAL;
		names[i] = fields[i].name;
	}
	return source_new(kind, names, n, label, &proto, out);
}

PHX_EXPORT void phx_stats_source_remove(phx_stats_source *src)
{
	struct phx_stats_source **pp;
	struct shm_slot *s;

	if (!src)
		return;
	pthread_mutex_lock(&pub.lock);
	for (pp = &pub.head; *pp; pp = &(*pp)->next)
		if (*pp == src)
			break;
	/* not listed: added before a fork, by the parent */
	if (*pp && src->gen == pub.gen) {
		*pp = src->next;
		s = slot_at(src->slot);
		slot_begin(s);
		s->state = SLOT_FREE;
		slot_end(s);
		if (!pub.head)
			pthread_cond_broadcast(&pub.wake);
	}
	pthread_mutex_unlock(&pub.lock);
	free(src);
}

PHX_EXPORT int phx_stats_publish(void)
{
	int ret = 0;

	pthread_once(&pub_once, pub_init);
	pthread_mutex_lock(&pub.lock);
	if (pub.state == PUB_ON)
		publish_locked();
	else
		ret = pub.state == PUB_OFF ? phx_err(-ENOTSUP, "live counters %s", pub.why) :
			phx_err(-ENOENT, "live counters: nothing published yet");
	pthread_mutex_unlock(&pub.lock);
	return ret;
}

PHX_EXPORT int phx_stats_path(char *buf, size_t len)
{
	size_t n;
	int ret;

	pthread_mutex_lock(&pub.lock);
	if (pub.state == PUB_ON) {
		n = strlen(pub.path);
		ret = n < len ? (int)n : phx_err(-ERANGE, "phx_stats_path: %zu bytes needed", n + 1);
		if (n < len)
			memcpy(buf, pub.path, n + 1);
	} else if (pub.state == PUB_OFF) {
		ret = phx_err(-ENOTSUP, "live counters %s", pub.why);
	} else {
		/* not tried yet: PHX_STATS=0 is known without making the file */
		ret = phx_env_u32("PHX_STATS", 1) == 0 ?
			phx_err(-ENOTSUP, "live counters off (PHX_STATS=0)") :
			phx_err(-ENOENT, "live counters: nothing published yet");
	}
	pthread_mutex_unlock(&pub.lock);
	return ret;
}
