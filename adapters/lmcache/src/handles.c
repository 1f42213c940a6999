// SPDX-License-Identifier: Apache-2.0
/*
 * handles.c - phxFileHandleRegister/Deregister: the slab files.
 *
 * A handle owns a duplicate of the caller's fd (F_DUPFD_CLOEXEC), adopted
 * by libphx's engine (phx_file_from_fd) and registered with every staging
 * context, whose lanes then keep it.  LMCache closes its fd right after
 * deregistering, and ignores the return value: with our own descriptor a
 * number reused by another open can never receive a transfer meant for the
 * slab.  Handles are validated against this list before use, so a stale or
 * bogus handle is -EBADF, never a crash.
 *
 * Deregistration with transfers in flight waits for them (they always
 * complete once queued) up to PF_DEREG_WAIT_NS; then -EBUSY, and the
 * handle stays registered and usable.
 *
 * One slab per process: LMCache opens its slab with O_TRUNC, so two GPU
 * processes given the same path would wipe each other's KV without a word.
 * A registration takes a POSIX write lock on the file's first byte (per
 * process, so one process may register a file twice); another process's
 * registration of the same file is -EBUSY, naming the holder.  Advisory:
 * it stops nobody's I/O, and it lapses once this process closes any fd of
 * the file (POSIX lock semantics).  Where the file cannot be locked (opened
 * read-only, a filesystem without locks) nothing is enforced.
 */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "internal.h"

#define PF_DEREG_WAIT_NS (30ll * 1000000000)

struct pf_handle *pf_handle_find_locked(struct pf_driver *d, void *fh)
{
	struct pf_handle *h;

	for (h = d->handles; h; h = h->next)
		if (h == fh && h->magic == PF_HANDLE_MAGIC)
			return h;
	return NULL;
}

/* Register @h with device @dev's context @cu: its lanes keep the fd. */
int pf_handle_attach_setup(struct pf_driver *d, struct pf_handle *h, int dev, phx_cuda *cu)
{
	int ret;

	if (h->ctx_registered & (1ull << dev) || !cu)
		return 0;
	ret = phx_cuda_file_register(cu, h->f);
	if (ret) {
		pf_log("%s: registering with device %d's staging lanes: %s (lanes adopt it per use instead)",
		       h->path, dev, phx_cuda_strerror_last());
		return ret;
	}
	h->ctx_registered |= 1ull << dev;
	return 0;
}

void pf_handles_attach_all_setup(struct pf_driver *d, int dev, phx_cuda *cu)
{
	struct pf_handle *h;

	for (h = d->handles; h; h = h->next)
		pf_handle_attach_setup(d, h, dev, cu);
}

static void attach_all_setup(struct pf_driver *d, struct pf_handle *h)
{
	int i;

	for (i = 0; i < PF_MAX_DEVICES; i++)
		pf_handle_attach_setup(d, h, i, d->ctx[i]);
}

static void detach_all_setup(struct pf_driver *d, struct pf_handle *h)
{
	int i;

	for (i = 0; i < PF_MAX_DEVICES; i++)
		if (h->ctx_registered & (1ull << i) && d->ctx[i])
			phx_cuda_file_deregister(d->ctx[i], h->f);
	h->ctx_registered = 0;
}

static int check_fd(int fd)
{
	struct stat st;

	if (fd < 0 || fcntl(fd, F_GETFL) < 0)
		return -EBADF;
	if (fstat(fd, &st))
		return -EBADF;
	if (!S_ISREG(st.st_mode) && !S_ISBLK(st.st_mode))
		return -EINVAL;
	return 0;
}

static struct pf_handle *handle_new(int fd, int *err)
{
	struct pf_handle *h = calloc(1, sizeof(*h));
	char link[64];
	ssize_t n;

	if (!h) {
		*err = -ENOMEM;
		return NULL;
	}
	h->fd = fcntl(fd, F_DUPFD_CLOEXEC, 3);
	if (h->fd < 0) {
		*err = -errno;
		free(h);
		return NULL;
	}
	snprintf(link, sizeof(link), "/proc/self/fd/%d", fd);
	n = readlink(link, h->path, sizeof(h->path) - 1);
	if (n < 0)
		snprintf(h->path, sizeof(h->path), "fd %d", fd);
	else
		h->path[n] = '\0';
	h->magic = PF_HANDLE_MAGIC;
	return h;
}

/* The slab's process claim (see above): 0, or -EBUSY with *@holder set. */
static int claim(struct pf_handle *h, pid_t *holder)
{
	struct flock fl = { .l_type = F_WRLCK, .l_whence = SEEK_SET, .l_start = 0, .l_len = 1 };

	*holder = 0;
	if (fcntl(h->fd, F_SETLK, &fl) == 0)
		return 0;
	if (errno != EACCES && errno != EAGAIN)
		return 0;		/* not lockable here: not enforced */
	fl.l_type = F_WRLCK;
	if (fcntl(h->fd, F_GETLK, &fl) == 0 && fl.l_type != F_UNLCK)
		*holder = fl.l_pid;
	return -EBUSY;
}

static void handle_free(struct pf_handle *h)
{
	h->magic = 0;
	close(h->fd);
	free(h);
}

PF_EXPORT int phxFileHandleRegister(void **fh, int fd)
{
	struct pf_driver *d = pf_drv();
	struct pf_handle *h;
	pid_t holder;
	int ret = 0;

	if (!fh)
		return pf_submit_fail(d, -EINVAL, NULL, "phxFileHandleRegister (NULL handle pointer)");
	*fh = NULL;
	ret = check_fd(fd);
	if (ret)
		return pf_submit_fail(d, ret, NULL, ret == -EBADF ?
				      "phxFileHandleRegister (fd not open)" :
				      "phxFileHandleRegister (not a regular file or block device)");
	h = handle_new(fd, &ret);
	if (!h)
		return pf_submit_fail(d, ret, NULL, "phxFileHandleRegister (dup)");
	if (claim(h, &holder)) {
		char path[PATH_MAX], what[128];

		snprintf(path, sizeof(path), "%s", h->path);
		snprintf(what, sizeof(what),
			 "phxFileHandleRegister (slab in use by process %d: one slab path per GPU process)",
			 (int)holder);
		handle_free(h);
		return pf_submit_fail(d, -EBUSY, path, what);
	}
	pf_publish();
	pthread_mutex_lock(&d->setup);
	ret = pf_get_setup(d);
	if (!ret) {
		ret = phx_file_from_fd(d->eng, h->fd, &h->f);
		if (ret)
			pf_log("%s: phx_file_from_fd: %s", h->path, phx_strerror_last());
	}
	if (!ret) {
		attach_all_setup(d, h);
		pthread_mutex_lock(&d->lock);
		h->next = d->handles;
		d->handles = h;
		d->st.handles++;
		pthread_mutex_unlock(&d->lock);
		*fh = h;
	}
	pthread_mutex_unlock(&d->setup);
	if (ret) {
		char path[PATH_MAX];

		snprintf(path, sizeof(path), "%s", h->path);
		handle_free(h);
		return pf_submit_fail(d, ret, path, "phxFileHandleRegister");
	}
	return 0;
}

static void deadline_of(struct timespec *ts, int64_t ns)
{
	clock_gettime(CLOCK_REALTIME, ts);
	ts->tv_sec += ns / 1000000000;
	ts->tv_nsec += ns % 1000000000;
	if (ts->tv_nsec >= 1000000000) {
		ts->tv_sec++;
		ts->tv_nsec -= 1000000000;
	}
}

static bool past(const struct timespec *until)
{
	struct timespec now;

	clock_gettime(CLOCK_REALTIME, &now);
	return now.tv_sec > until->tv_sec ||
	       (now.tv_sec == until->tv_sec && now.tv_nsec >= until->tv_nsec);
}

/* Lock held: wait until *@inflight is 0 (a handle's, a buffer's), or -EBUSY at @until. */
static int wait_zero_locked(struct pf_driver *d, const uint64_t *inflight,
			    const struct timespec *until)
{
	while (*inflight)
		if (pthread_cond_timedwait(&d->idle, &d->lock, until))
			return *inflight ? -EBUSY : 0;
	return 0;
}

static int wait_idle_locked(struct pf_driver *d, struct pf_handle *h,
			    const struct timespec *until)
{
	return wait_zero_locked(d, &h->inflight, until);
}

/*
 * Lock held: wait until no transfer on @b is in flight, at most
 * PF_DEREG_WAIT_NS; -EBUSY then.  A transfer whose stream has passed ends
 * a moment later, when libphx's poller calls its completion: a caller who
 * synchronised the stream and deregisters at once waits that moment.
 */
int pf_wait_buf_idle_locked(struct pf_driver *d, struct pf_buf *b)
{
	struct timespec until;

	deadline_of(&until, PF_DEREG_WAIT_NS);
	return wait_zero_locked(d, &b->inflight, &until);
}

/*
 * Setup held: close @h's phx_file once nothing is in flight (libphx may
 * hold the file a moment after the stream has passed: -EBUSY is retried).
 */
static int quiesce_setup(struct pf_driver *d, struct pf_handle *h)
{
	struct timespec until, nap;
	int ret;

	deadline_of(&until, PF_DEREG_WAIT_NS);
	for (;;) {
		pthread_mutex_lock(&d->lock);
		ret = wait_idle_locked(d, h, &until);
		pthread_mutex_unlock(&d->lock);
		if (ret)
			return ret;
		detach_all_setup(d, h);
		ret = phx_file_close(h->f);
		if (ret != -EBUSY)
			return ret;
		attach_all_setup(d, h);
		if (past(&until))
			return -EBUSY;
		nap.tv_sec = 0;
		nap.tv_nsec = 1000000;
		nanosleep(&nap, NULL);
	}
}

static void unlink_locked(struct pf_driver *d, struct pf_handle *h)
{
	struct pf_handle **pp;

	for (pp = &d->handles; *pp; pp = &(*pp)->next) {
		if (*pp == h) {
			*pp = h->next;
			break;
		}
	}
	d->st.handles--;
}

/*
 * The wait holds the setup lock (no other registration meanwhile) but not
 * the state lock: transfers on other handles go on, and new ones on this
 * handle still work until it is gone.
 */
PF_EXPORT int phxFileHandleDeregister(void *fh)
{
	struct pf_driver *d = pf_drv();
	struct pf_handle *h;
	char path[PATH_MAX];
	int ret;

	pthread_mutex_lock(&d->setup);
	h = pf_handle_find_locked(d, fh);
	if (!h) {
		pthread_mutex_unlock(&d->setup);
		return pf_submit_fail(d, -EBADF, NULL, "phxFileHandleDeregister (not a registered handle)");
	}
	ret = quiesce_setup(d, h);
	if (ret) {
		snprintf(path, sizeof(path), "%s", h->path);
		pthread_mutex_unlock(&d->setup);
		return pf_submit_fail(d, ret, path, "phxFileHandleDeregister (transfers still in flight after 30 s)");
	}
	pthread_mutex_lock(&d->lock);
	unlink_locked(d, h);
	pthread_mutex_unlock(&d->lock);
	pthread_mutex_unlock(&d->setup);
	handle_free(h);
	return 0;
}
