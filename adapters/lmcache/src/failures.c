// SPDX-License-Identifier: Apache-2.0
/*
 * failures.c - what happens to a failed transfer besides its -errno.
 *
 * LMCache's GDSContext never reads bytes_done, so a failure would be
 * silent there.  Every failure is counted (phxFileGetStats: failures,
 * submit_errors, last_error; `phx stats` / `phx top` read them from outside
 * the process) and logged by kind, a kind being (call, errno, file):
 *
 *   the first of a kind at once, with the totals so far;
 *   later ones with running totals ("N times so far, M since the last
 *   line"), at most one line per kind every PHXFILE_LOG_INTERVAL_S seconds
 *   (default 10; 0: a line for every failure), written at the next failure
 *   of the kind or by the periodic flush (pf_fail_flush, on libphx's
 *   live-counters thread, which runs every 200 ms while anything is
 *   published) once the interval has passed;
 *   at driver close every kind with failures not yet in a line.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "internal.h"

static int64_t now_ns(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

/* PHXFILE_LOG_INTERVAL_S, read once; a value that is not a whole number is logged and ignored. */
static int64_t interval_ns(void)
{
	static int64_t ns = -1;
	const char *v;
	char *end;
	long s;

	if (ns >= 0)
		return ns;
	ns = 10ll * 1000000000;
	v = getenv("PHXFILE_LOG_INTERVAL_S");
	if (v && *v) {
		s = strtol(v, &end, 10);
		if (*end || s < 0 || s > 86400)
			pf_log("PHXFILE_LOG_INTERVAL_S=%s ignored: not a whole number of seconds from 0 to 86400 (using 10)", v);
		else
			ns = (int64_t)s * 1000000000;
	}
	return ns;
}

/* The entry of a kind (lock held); NULL when the table is full. */
static struct pf_logged *kind_locked(struct pf_driver *d, int err, const char *path,
				     const char *what)
{
	struct pf_logged *e;
	size_t i;

	for (i = 0; i < d->nlogged; i++) {
		e = &d->logged[i];
		if (e->err == err && !strcmp(e->path, path) && !strcmp(e->what, what))
			return e;
	}
	if (d->nlogged == PF_MAX_LOGGED) {
		if (!d->log_overflow)
			pf_log("more than %d kinds of failure: further kinds are counted, not logged (phxFileGetStats, phx stats)",
			       PF_MAX_LOGGED);
		d->log_overflow = true;
		return NULL;
	}
	e = &d->logged[d->nlogged++];
	memset(e, 0, sizeof(*e));
	e->err = err;
	snprintf(e->what, sizeof(e->what), "%s", what);
	snprintf(e->path, sizeof(e->path), "%s", path);
	return e;
}

/* " on FILE", or "" for a call that concerns no file */
static const char *on(const struct pf_logged *e, char *buf, size_t len)
{
	if (!strcmp(e->path, "-"))
		return "";
	snprintf(buf, len, " on %s", e->path);
	return buf;
}

/* A line of running totals for @e (lock held). */
static void report_locked(struct pf_driver *d, struct pf_logged *e, const char *when)
{
	char where[PATH_MAX + 8];

	pf_log("%s%s: %s (errno %d): %llu times so far, %llu since the last line%s (failures: %llu, refused calls: %llu)",
	       e->what, on(e, where, sizeof(where)), strerror(-e->err), -e->err,
	       (unsigned long long)e->count,
	       (unsigned long long)(e->count - e->reported), when,
	       (unsigned long long)d->st.failures, (unsigned long long)d->st.submit_errors);
	e->reported = e->count;
	e->last_ns = now_ns();
}

static void note_locked(struct pf_driver *d, int err, const char *path, const char *what)
{
	struct pf_logged *e = kind_locked(d, err, path, what);

	if (!e)
		return;
	e->count++;
	if (e->count == 1) {
		char where[PATH_MAX + 8];

		pf_log("%s%s: %s (errno %d) (failures: %llu, refused calls: %llu); further failures of this kind are counted and logged with running totals at most every %lld s",
		       what, on(e, where, sizeof(where)), strerror(-err), -err,
		       (unsigned long long)d->st.failures,
		       (unsigned long long)d->st.submit_errors,
		       (long long)(interval_ns() / 1000000000));
		e->reported = 1;
		e->last_ns = now_ns();
	} else if (now_ns() - e->last_ns >= interval_ns()) {
		report_locked(d, e, "");
	}
}

/* A transfer's deferred failure (its bytes_done is @err). */
void pf_fail_locked(struct pf_driver *d, int err, const char *path, const char *what)
{
	char w[64];

	d->st.failures++;
	d->st.last_error = (uint64_t)(int64_t)err;
	snprintf(w, sizeof(w), "%s failed", what);
	note_locked(d, err, path ? path : "?", w);
}

/* A call that returns @err: counted and logged the same way. */
int pf_submit_fail(struct pf_driver *d, int err, const char *path, const char *what)
{
	char w[sizeof(((struct pf_logged *)0)->what)];

	snprintf(w, sizeof(w), "%s refused", what);
	pthread_mutex_lock(&d->lock);
	d->st.submit_errors++;
	d->st.last_error = (uint64_t)(int64_t)err;
	note_locked(d, err, path ? path : "-", w);
	pthread_mutex_unlock(&d->lock);
	return err;
}

/*
 * Lines for the kinds with failures not yet in a line: those whose interval
 * has passed (@all false: the periodic flush), or all of them (driver
 * close).  Never waits for d->lock when periodic: its caller holds libphx's
 * publishing lock.
 */
void pf_fail_flush(struct pf_driver *d, bool all)
{
	int64_t now = now_ns();
	size_t i;

	if (all)
		pthread_mutex_lock(&d->lock);
	else if (pthread_mutex_trylock(&d->lock))
		return;
	for (i = 0; i < d->nlogged; i++) {
		struct pf_logged *e = &d->logged[i];

		if (e->count > e->reported && (all || now - e->last_ns >= interval_ns()))
			report_locked(d, e, all ? ", at driver close" : "");
	}
	pthread_mutex_unlock(&d->lock);
}
