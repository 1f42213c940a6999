// SPDX-License-Identifier: Apache-2.0
/*
 * engine.c - an engine: its configuration, resources, backend, and the
 * public request entry points.
 *
 * How device operations reach the kernel is the backend's (struct
 * phx_backend: be_uring.c, be_threads.c), chosen once at creation from
 * phx_engine_config.backend (PHX_ENGINE): io_uring where it can be had,
 * else - or when asked for - the thread pool.
 */
#include <errno.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <time.h>
#include <unistd.h>

#include "internal.h"

uint32_t phx_cpus_usable(void)
{
	cpu_set_t set;
	long n;

	if (!sched_getaffinity(0, sizeof(set), &set) && CPU_COUNT(&set) > 0)
		return (uint32_t)CPU_COUNT(&set);
	n = sysconf(_SC_NPROCESSORS_ONLN);
	return n > 0 ? (uint32_t)n : 1;
}

/* ------------------------------------------------------------------------ */
/* Configuration                                                            */
/* ------------------------------------------------------------------------ */

/* The backends by kind (PHX_BACKEND_AUTO: io_uring, then threads). */
static const struct phx_backend *const backends[] = {
	[PHX_BACKEND_URING] = &be_uring,
	[PHX_BACKEND_THREADS] = &be_threads,
};

PHX_EXPORT void phx_engine_config_init(struct phx_engine_config *cfg)
{
	memset(cfg, 0, sizeof(*cfg));
	cfg->size = sizeof(*cfg);
	cfg->queue_depth = phx_env_u32("PHX_QUEUE_DEPTH", PHX_DEFAULT_QD);
	cfg->max_io_size = phx_env_u32("PHX_MAX_IO_SIZE", PHX_DEFAULT_MAX_IO);
	cfg->bounce_size = phx_env_u32("PHX_BOUNCE_SIZE", PHX_DEFAULT_BOUNCE_SIZE);
	cfg->bounce_count = phx_env_u32("PHX_BOUNCE_COUNT", PHX_DEFAULT_BOUNCE_COUNT);
	cfg->max_files = PHX_DEFAULT_MAX_FILES;
	cfg->submit_batch = phx_env_u32("PHX_SUBMIT_BATCH", PHX_DEFAULT_SUBMIT_BATCH);
	cfg->backend = phx_env_choice("PHX_ENGINE", phx_engine_choices, PHX_BACKEND_AUTO);
	cfg->io_threads = phx_env_u32("PHX_IO_THREADS", 0);
}


static int config_check(struct phx_engine_config *c)
{
	if (c->queue_depth < 1 || c->queue_depth > 4096)
		return phx_err(-EINVAL, "queue_depth %u is outside 1..4096",
			       c->queue_depth);
	if (c->max_io_size < PHX_PAGE || c->max_io_size > (1u << 30) ||
	    c->max_io_size % PHX_PAGE)
		return phx_err(-EINVAL,
			       "max_io_size %u must be a multiple of 4096 in 4 KiB..1 GiB",
			       c->max_io_size);
	if (c->bounce_size < PHX_PAGE || c->bounce_size > (1u << 30) ||
	    c->bounce_size % PHX_PAGE)
		return phx_err(-EINVAL,
			       "bounce_size %u must be a multiple of 4096 in 4 KiB..1 GiB",
			       c->bounce_size);
	if (c->bounce_count < 1 || c->bounce_count > 1024)
		return phx_err(-EINVAL, "bounce_count %u is outside 1..1024",
			       c->bounce_count);
	if (c->max_files < 1 || c->max_files > 65536)
		return phx_err(-EINVAL, "max_files %u is outside 1..65536",
			       c->max_files);
	if (c->backend > PHX_BACKEND_THREADS)
		return phx_err(-EINVAL, "backend %u is none of PHX_BACKEND_AUTO, _URING, _THREADS",
			       c->backend);
	if (c->io_threads > 4096)
		return phx_err(-EINVAL, "io_threads %u is outside 0..4096", c->io_threads);
	return 0;
}

/* ------------------------------------------------------------------------ */
/* Create / destroy                                                         */
/* ------------------------------------------------------------------------ */

static int bounce_setup(phx_engine *eng)
{
	size_t total = (size_t)eng->cfg.bounce_count * eng->cfg.bounce_size;
	uint32_t i;

	if (posix_memalign((void **)&eng->bounce_mem, PHX_PAGE, total))
		return phx_err(-ENOMEM, "cannot allocate %zu bytes of bounce buffers",
			       total);
	eng->bounce_free = calloc(eng->cfg.bounce_count, sizeof(int));
	if (!eng->bounce_free)
		return phx_err(-ENOMEM, "out of memory");
	for (i = 0; i < eng->cfg.bounce_count; i++)
		eng->bounce_free[i] = eng->cfg.bounce_count - 1 - i;
	eng->nbounce_free = eng->cfg.bounce_count;
	return 0;
}

/* The registered-file table; the backend says whether slots are used. */
static int file_slots_setup(phx_engine *eng)
{
	uint32_t i;

	eng->file_slots = malloc(eng->cfg.max_files * sizeof(int));
	if (!eng->file_slots)
		return phx_err(-ENOMEM, "out of memory");
	for (i = 0; i < eng->cfg.max_files; i++)
		eng->file_slots[i] = -1;
	/* fixed-buffer indices: the bounce buffers first, then these */
	for (i = 0; i < PHX_USER_BUF_SLOTS; i++)
		eng->ubufs[i].index = eng->cfg.bounce_count + i;
	return 0;
}

static int chunks_setup(phx_engine *eng)
{
	uint32_t i;

	eng->chunks = calloc(eng->cfg.queue_depth, sizeof(*eng->chunks));
	if (!eng->chunks)
		return phx_err(-ENOMEM, "out of memory");
	for (i = 0; i < eng->cfg.queue_depth; i++) {
		eng->chunks[i].next_free = eng->free_chunks;
		eng->free_chunks = &eng->chunks[i];
	}
	return 0;
}

/* io_uring_setup errors that mean "not here" rather than "broken". */
static bool uring_refused(int err)
{
	return err == -EPERM || err == -EACCES || err == -ENOSYS || err == -ENOMEM;
}

/*
 * The automatic fall-back is news once per process (a GPU context makes an
 * engine per lane); the flag is the only state libphx keeps for it.
 */
static void fallback_log_once(const char *why)
{
	static int logged;

	if (!__atomic_exchange_n(&logged, 1, __ATOMIC_RELAXED))
		fprintf(stderr, "phx: %s; running on the thread-pool engine (PHX_ENGINE=threads "
			"chooses it, PHX_ENGINE=uring refuses it)\n", why);
}

/* The backend the configuration asks for, or the first that can run. */
static int backend_setup(phx_engine *eng)
{
	uint32_t want = eng->cfg.backend;
	int ret;

	if (want == PHX_BACKEND_THREADS) {
		eng->be = &be_threads;
		snprintf(eng->be_why, sizeof(eng->be_why),
			 "asked for (PHX_ENGINE=threads or phx_engine_config.backend)");
		return eng->be->setup(eng);
	}
	eng->be = &be_uring;
	ret = eng->be->setup(eng);
	if (!ret) {
		snprintf(eng->be_why, sizeof(eng->be_why), "io_uring_setup succeeded%s",
			 want == PHX_BACKEND_URING ? " (asked for io_uring only)" : "");
		return 0;
	}
	if (want == PHX_BACKEND_URING || !uring_refused(ret))
		return ret;
	/* phx_err's text of the refusal, before the next call replaces it */
	snprintf(eng->be_why, sizeof(eng->be_why), "io_uring unavailable: %s",
		 phx_strerror_last());
	eng->features = 0;
	eng->be = &be_threads;
	ret = eng->be->setup(eng);
	if (!ret)
		fallback_log_once(eng->be_why);
	return ret;
}

/*
 * Single-thread engines: the calling thread must be the creator (the
 * kernel refuses other submitters of a single-issuer ring, and a registered
 * ring fd means nothing in another thread).
 */
int engine_thread_check(const phx_engine *eng)
{
	if (eng->owner_tid && gettid() != eng->owner_tid)
		return phx_err(-EPERM, "engine is single-thread (PHX_ENGINE_SINGLE_THREAD), created by thread %d, called from thread %d",
			       (int)eng->owner_tid, (int)gettid());
	return 0;
}

static void engine_free(phx_engine *eng)
{
	if (eng->be)
		eng->be->teardown(eng);
	free(eng->chunks);
	free(eng->bounce_free);
	free(eng->bounce_mem);
	free(eng->file_slots);
	pthread_cond_destroy(&eng->cond);
	pthread_mutex_destroy(&eng->lock);
	free(eng);
}

static int engine_create(const struct phx_engine_config *cfg, phx_engine **out);

/* Live counters: every named field of struct phx_stats, for `phx top`. */
#define ES(f) STAT_FIELD(struct phx_stats, f)
static const struct stat_field engine_stat_fields[] = {
	ES(reads), ES(writes), ES(bytes_read), ES(bytes_written), ES(direct_bytes),
	ES(bounce_bytes), ES(buffered_bytes), ES(bounce_ios), ES(rmw_ios), ES(short_ios),
	ES(fixed_buf_ios), ES(sqes), ES(submits), ES(errors), ES(bad_marks),
	ES(bad_refusals),
};
#undef ES

static void engine_stats_fill(void *obj, void *st)
{
	phx_engine_stats(obj, st);
}

/* Best effort: an engine without live counters works the same. */
static void engine_publish(phx_engine *eng)
{
	char label[64];

	if (eng->cfg.flags & PHX_ENGINE_UNPUBLISHED)
		return;
	snprintf(label, sizeof(label), "engine %s, queue depth %u", eng->be->name,
		 eng->cfg.queue_depth);
	stats_add_struct("engine", label, engine_stat_fields,
			 sizeof(engine_stat_fields) / sizeof(engine_stat_fields[0]),
			 engine_stats_fill, eng, &eng->pub);
}

/* Public entry points that make system calls leave errno as they found it. */
PHX_EXPORT int phx_engine_create(const struct phx_engine_config *cfg,
				 phx_engine **out)
{
	int saved = errno, ret = engine_create(cfg, out);

	errno = saved;
	return ret;
}

static int engine_create(const struct phx_engine_config *cfg, phx_engine **out)
{
	phx_engine *eng;
	int ret;

	if (!out)
		return phx_err(-EINVAL, "phx_engine_create: out is NULL");
	*out = NULL;
	eng = calloc(1, sizeof(*eng));
	if (!eng)
		return phx_err(-ENOMEM, "out of memory");
	pthread_mutex_init(&eng->lock, NULL);
	pthread_cond_init(&eng->cond, NULL);
	eng->efd = -1;
	eng->pid = getpid();
	phx_engine_config_init(&eng->cfg);
	ret = phx_env_check();
	if (ret)
		goto err_free;
	if (cfg) {
		size_t n = cfg->size && cfg->size < sizeof(*cfg) ? cfg->size : sizeof(*cfg);

		memcpy(&eng->cfg, cfg, n);
		eng->cfg.size = sizeof(*cfg);
		if (!eng->cfg.max_files)
			eng->cfg.max_files = PHX_DEFAULT_MAX_FILES;
	}
	ret = config_check(&eng->cfg);
	if (ret)
		goto err_free;
	ret = chunks_setup(eng);
	if (ret)
		goto err_free;
	ret = bounce_setup(eng);
	if (ret)
		goto err_free;
	ret = file_slots_setup(eng);
	if (ret)
		goto err_free;
	ret = backend_setup(eng);
	if (ret < 0) {
		eng->be = NULL;	/* a failed setup undid itself */
		goto err_free;
	}
	if (eng->cfg.flags & PHX_ENGINE_SINGLE_THREAD)
		eng->owner_tid = gettid();
	engine_publish(eng);
	*out = eng;
	return 0;

err_free:
	engine_free(eng);
	return ret;
}

PHX_EXPORT int phx_engine_destroy(phx_engine *eng)
{
	int ret = 0;

	if (!eng)
		return 0;
	pthread_mutex_lock(&eng->lock);
	/*
	 * GPU lanes use a held file's descriptor number on engines of their
	 * own: closing it here would let them read or write whatever file
	 * takes the number next.
	 */
	if (file_held_locked(eng)) {
		pthread_mutex_unlock(&eng->lock);
		return phx_err(-EBUSY, "a file of this engine is still used by GPU work (a phx_cuda context holds it): finish or deregister that first");
	}
	if ((eng->inflight || eng->pend_head) && engine_thread_check(eng)) {
		pthread_mutex_unlock(&eng->lock);
		return -EPERM;
	}
	/*
	 * A copy made by fork(): what is in flight is the parent's (its ring,
	 * its I/O threads), nothing here can complete it.  Free the copy.
	 */
	while ((eng->inflight || eng->pend_head) && eng->pid == getpid()) {
		pthread_mutex_unlock(&eng->lock);
		ret = engine_progress(eng, NULL, -1, true);
		pthread_mutex_lock(&eng->lock);
		if (ret < 0 && ret != -EINTR)
			break;
	}
	pthread_mutex_unlock(&eng->lock);
	phx_stats_source_remove(eng->pub);	/* before the engine goes: its fill reads it */
	file_close_all(eng);
	if (eng->efd >= 0)
		close(eng->efd);
	engine_free(eng);
	return ret < 0 ? ret : 0;
}

PHX_EXPORT void phx_engine_config_get(const phx_engine *eng,
				      struct phx_engine_config *cfg)
{
	*cfg = eng->cfg;
}

PHX_EXPORT uint32_t phx_engine_features(const phx_engine *eng)
{
	return eng->features;
}

PHX_EXPORT const char *phx_engine_backend(const phx_engine *eng)
{
	return eng->be->name;
}

PHX_EXPORT const char *phx_engine_backend_reason(const phx_engine *eng)
{
	return eng->be_why;
}

PHX_EXPORT int phx_backend_check(uint32_t kind, const char **name, const char **desc)
{
	const struct phx_backend *be;
	char why[256];
	int saved = errno, ret;

	if (kind != PHX_BACKEND_URING && kind != PHX_BACKEND_THREADS)
		return phx_err(-EINVAL, "backend %u is neither PHX_BACKEND_URING nor _THREADS",
			       kind);
	be = backends[kind];
	if (name)
		*name = be->name;
	if (desc)
		*desc = be->desc;
	ret = be->probe(why, sizeof(why));
	errno = saved;
	if (ret)	/* the reason is the whole text: no strerror appended */
		phx_err(0, "%s", why);
	return ret;
}

PHX_EXPORT int phx_engine_eventfd(phx_engine *eng)
{
	int fd, ret, saved = errno;

	pthread_mutex_lock(&eng->lock);
	if (eng->efd >= 0) {
		fd = eng->efd;
		goto out;
	}
	fd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
	if (fd < 0) {
		fd = phx_err(-errno, "eventfd");
		goto out;
	}
	ret = eng->be->eventfd(eng, fd);
	if (ret < 0) {
		close(fd);
		fd = ret;
		goto out;
	}
	eng->efd = fd;
out:
	pthread_mutex_unlock(&eng->lock);
	errno = saved;
	return fd;
}

/* Wake eventfd waiters: an async request finished (lock held). */
void engine_notify(phx_engine *eng)
{
	if (eng->efd >= 0)
		eventfd_write(eng->efd, 1);
}

PHX_EXPORT void phx_engine_stats(phx_engine *eng, struct phx_stats *st)
{
	pthread_mutex_lock(&eng->lock);
	*st = eng->st;
	pthread_mutex_unlock(&eng->lock);
}

PHX_EXPORT void phx_engine_stats_reset(phx_engine *eng)
{
	pthread_mutex_lock(&eng->lock);
	memset(&eng->st, 0, sizeof(eng->st));
	pthread_mutex_unlock(&eng->lock);
}

/* ------------------------------------------------------------------------ */
/* Registered buffers                                                       */
/* ------------------------------------------------------------------------ */

PHX_EXPORT int phx_buf_register(phx_engine *eng, void *addr, size_t len)
{
	struct user_buf *slot = NULL;
	int ret, i;

	if (!addr || !len)
		return phx_err(-EINVAL, "phx_buf_register: empty buffer");
	ret = engine_thread_check(eng);
	if (ret)
		return ret;
	if (!(eng->features & PHX_FEAT_USER_BUFS))
		return phx_err(-EOPNOTSUPP,
			       "buffer registration unavailable (kernel without sparse fixed buffers, or disabled)");
	pthread_mutex_lock(&eng->lock);
	for (i = 0; i < (int)PHX_USER_BUF_SLOTS; i++) {
		if (eng->ubufs[i].len && eng->ubufs[i].addr == addr) {
			ret = phx_err(-EEXIST, "buffer %p is already registered", addr);
			goto out;
		}
		if (!eng->ubufs[i].len && !slot)
			slot = &eng->ubufs[i];
	}
	if (!slot) {
		ret = phx_err(-ENOSPC, "all %u buffer registration slots are in use",
			      PHX_USER_BUF_SLOTS);
		goto out;
	}
	ret = eng->be->buf_update(eng, slot->index, addr, len);
	if (ret < 0) {
		phx_err(ret, "registering %zu bytes at %p as a fixed buffer%s", len, addr,
			ret == -ENOMEM || ret == -EPERM ?
			" (RLIMIT_MEMLOCK too low? see ulimit -l)" : "");
		goto out;
	}
	slot->addr = addr;
	slot->len = len;
	ret = 0;
out:
	pthread_mutex_unlock(&eng->lock);
	return ret;
}

PHX_EXPORT int phx_buf_deregister(phx_engine *eng, void *addr)
{
	int ret = phx_err(-ENOENT, "buffer %p is not registered", addr);
	uint32_t i, c;

	pthread_mutex_lock(&eng->lock);
	for (i = 0; i < PHX_USER_BUF_SLOTS; i++) {
		struct user_buf *b = &eng->ubufs[i];

		if (!b->len || b->addr != addr)
			continue;
		for (c = 0; c < eng->cfg.queue_depth; c++) {
			if (eng->chunks[c].in_use && eng->chunks[c].buf_index == b->index) {
				ret = phx_err(-EBUSY, "buffer %p has I/O in flight", addr);
				goto out;
			}
		}
		ret = eng->be->buf_update(eng, b->index, NULL, 0);
		if (ret < 0) {
			phx_err(ret, "unregistering buffer %p", addr);
			goto out;
		}
		b->len = 0;
		b->addr = NULL;
		ret = 0;
		break;
	}
out:
	pthread_mutex_unlock(&eng->lock);
	return ret;
}

/* ------------------------------------------------------------------------ */
/* Progress: the backend's                                                  */
/* ------------------------------------------------------------------------ */

void engine_submit_locked(phx_engine *eng)
{
	eng->be->submit(eng);
}

void engine_arm_tick(phx_engine *eng)
{
	eng->be->arm_tick(eng);
}

int engine_progress(phx_engine *eng, struct phx_io *io, int64_t timeout_ns,
		    bool block)
{
	return eng->be->progress(eng, io, timeout_ns, block);
}

static bool io_is_done(struct phx_io *io)
{
	return __atomic_load_n(&io->done, __ATOMIC_ACQUIRE);
}

/* ------------------------------------------------------------------------ */
/* Request entry points                                                     */
/* ------------------------------------------------------------------------ */

PHX_EXPORT void phx_io_prep(struct phx_io *io, phx_file *f, enum phx_op op,
			    void *buf, size_t len, uint64_t offset)
{
	memset(io, 0, sizeof(*io));
	io->file = f;
	io->op = op;
	io->buf = buf;
	io->len = len;
	io->offset = offset;
}

PHX_EXPORT void phx_io_bytes_by_path(const struct phx_io *io, struct phx_io_bytes *out)
{
	const struct io_priv *p = (const struct io_priv *)io->priv;

	memset(out, 0, sizeof(*out));
	if (!__atomic_load_n(&io->done, __ATOMIC_ACQUIRE))
		return;
	out->direct = p->bytes[IOP_DIRECT];
	out->bounce = p->bytes[IOP_BOUNCE];
	out->buffered = p->bytes[IOP_BUFFERED];
}

/*
 * Start @n requests.  A request that is invalid on its own completes at
 * once with -errno in its result; the others go ahead.
 */
static int submit_locked(phx_engine *eng, struct phx_io *const *ios, size_t n,
			 bool async)
{
	size_t i;
	int ret;

	for (i = 0; i < n; i++)
		if (!ios[i])
			return phx_err(-EINVAL, "request %zu is NULL", i);
	for (i = 0; i < n; i++) {
		ret = io_validate(ios[i]);
		if (!ret && ios[i]->file->eng != eng)
			ret = phx_err(-EINVAL, "request %zu: file belongs to another engine", i);
		if (ret)
			io_fail(eng, ios[i], ret, async);
		else
			io_start(eng, ios[i], async);
	}
	io_fill(eng);
	engine_submit_locked(eng);
	return 0;
}

PHX_EXPORT int phx_submit(phx_engine *eng, struct phx_io *const *ios, size_t n)
{
	int ret;

	if (!eng || (!ios && n))
		return phx_err(-EINVAL, "phx_submit: NULL argument");
	ret = engine_thread_check(eng);
	if (ret)
		return ret;
	pthread_mutex_lock(&eng->lock);
	ret = submit_locked(eng, ios, n, true);
	pthread_mutex_unlock(&eng->lock);
	return ret;
}

PHX_EXPORT int phx_wait(phx_engine *eng, struct phx_io *io, int64_t timeout_ns)
{
	int ret;

	if (!eng || !io)
		return phx_err(-EINVAL, "phx_wait: NULL argument");
	ret = engine_thread_check(eng);
	if (ret)
		return ret;
	while (!io_is_done(io)) {
		ret = engine_progress(eng, io, timeout_ns, true);
		if (ret == -ETIME && !io_is_done(io))
			return phx_err(-ETIME, "request not complete within the timeout");
		if (ret == -ECHILD)	/* fork()'s copy of a threads engine: never */
			return ret;
	}
	/* A waited-on request is not handed back by phx_poll(). */
	pthread_mutex_lock(&eng->lock);
	if (io_priv(io)->pollable) {
		struct phx_io **pp = &eng->poll_head, *prev = NULL;

		while (*pp && *pp != io) {
			prev = *pp;
			pp = &io_priv(*pp)->next;
		}
		if (*pp) {
			*pp = io_priv(io)->next;
			if (eng->poll_tail == io)
				eng->poll_tail = prev;
		}
		io_priv(io)->pollable = 0;
	}
	pthread_mutex_unlock(&eng->lock);
	return 0;
}

PHX_EXPORT int phx_submit_wait(phx_engine *eng, struct phx_io *ios, size_t n)
{
	struct phx_io *small[64] = { NULL }, **v = small;
	size_t i;
	int ret;

	if (!eng || (!ios && n))
		return phx_err(-EINVAL, "phx_submit_wait: NULL argument");
	ret = engine_thread_check(eng);
	if (ret)
		return ret;
	if (!n)
		return 0;
	if (n > 64) {
		v = malloc(n * sizeof(*v));
		if (!v)
			return phx_err(-ENOMEM, "out of memory");
	}
	for (i = 0; i < n; i++)
		v[i] = &ios[i];
	pthread_mutex_lock(&eng->lock);
	eng->submit_waits = true;	/* the backend may spread what waits (be_uring.c) */
	ret = submit_locked(eng, v, n, false);
	eng->submit_waits = false;
	pthread_mutex_unlock(&eng->lock);
	/*
	 * The last request first: a thread-pool engine's caller runs queued
	 * ops itself until the request it waits for is done, so it stays at
	 * work through the whole batch instead of handing the next op to a
	 * worker at the end of each request (io_uring's reaper takes every
	 * completion, whichever it waits for).  Only fork()'s copy of a
	 * threads engine (-ECHILD) gives up: it never completes.
	 */
	for (i = n; !ret && i > 0; i--)
		while (!ret && !io_is_done(&ios[i - 1]))
			if (engine_progress(eng, &ios[i - 1], -1, true) == -ECHILD)
				ret = -ECHILD;
	if (v != small)
		free(v);
	return ret;
}

PHX_EXPORT int phx_poll(phx_engine *eng, struct phx_io **done, size_t max)
{
	size_t n = 0;
	int ret;

	if (!eng)
		return phx_err(-EINVAL, "phx_poll: NULL engine");
	ret = engine_thread_check(eng);
	if (ret)
		return ret;
	engine_progress(eng, NULL, 0, false);
	pthread_mutex_lock(&eng->lock);
	while (n < max && eng->poll_head) {
		struct phx_io *io = eng->poll_head;

		eng->poll_head = io_priv(io)->next;
		if (!eng->poll_head)
			eng->poll_tail = NULL;
		io_priv(io)->pollable = 0;
		done[n++] = io;
	}
	/*
	 * More than @max were done: keep the eventfd readable for the rest.  A
	 * caller reads it, then polls; the threads backend publishes from its
	 * workers, so every completion may have been counted before that read.
	 */
	if (eng->poll_head)
		engine_notify(eng);
	pthread_mutex_unlock(&eng->lock);
	return (int)n;
}

static int64_t sync_io(phx_file *f, enum phx_op op, void *buf, size_t len,
		       uint64_t offset)
{
	struct phx_io io;
	int ret;

	if (!f)
		return phx_err(-EBADF, "no file");
	phx_io_prep(&io, f, op, buf, len, offset);
	ret = phx_submit_wait(f->eng, &io, 1);
	return ret ? ret : io.result;
}

PHX_EXPORT int64_t phx_pread(phx_file *f, void *buf, size_t len, uint64_t offset)
{
	return sync_io(f, PHX_OP_READ, buf, len, offset);
}

PHX_EXPORT int64_t phx_pwrite(phx_file *f, const void *buf, size_t len,
			      uint64_t offset)
{
	return sync_io(f, PHX_OP_WRITE, (void *)buf, len, offset);
}
