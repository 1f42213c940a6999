// SPDX-License-Identifier: Apache-2.0
/*
 * failures.c - what happens to a failed transfer besides its -errno.
 *
 * LMCache's GDSContext never reads bytes_done, so a failure would be
 * silent there.  Every failure is counted (phxFileGetStats: failures,
 * submit_errors, last_error) and the first of each (errno, file) pair is
 * logged with both; later ones of the same pair are only counted.
 */
#include <stdio.h>
#include <string.h>

#include "internal.h"

static bool seen_locked(struct pf_driver *d, int err, const char *path)
{
	size_t i;

	for (i = 0; i < d->nlogged; i++)
		if (d->logged[i].err == err && !strcmp(d->logged[i].path, path))
			return true;
	if (d->nlogged == PF_MAX_LOGGED) {
		if (!d->log_overflow)
			pf_log("more than %d distinct (errno, file) failures: no more are logged (see phxFileGetStats)",
			       PF_MAX_LOGGED);
		d->log_overflow = true;
		return true;
	}
	d->logged[d->nlogged].err = err;
	snprintf(d->logged[d->nlogged].path, sizeof(d->logged[0].path), "%s", path);
	d->nlogged++;
	return false;
}

/* A transfer's deferred failure (its bytes_done is @err). */
void pf_fail_locked(struct pf_driver *d, int err, const char *path, const char *what)
{
	d->st.failures++;
	d->st.last_error = (uint64_t)(int64_t)err;
	if (!seen_locked(d, err, path ? path : "?"))
		pf_log("%s failed on %s: %s (errno %d); further failures of this kind on this file are counted, not logged",
		       what, path ? path : "?", strerror(-err), -err);
}

/* A call that returns @err: counted and logged the same way. */
int pf_submit_fail(struct pf_driver *d, int err, const char *path, const char *what)
{
	pthread_mutex_lock(&d->lock);
	d->st.submit_errors++;
	d->st.last_error = (uint64_t)(int64_t)err;
	if (!seen_locked(d, err, path ? path : "-"))
		pf_log("%s refused%s%s: %s (errno %d)", what, path ? " on " : "",
		       path ? path : "", strerror(-err), -err);
	pthread_mutex_unlock(&d->lock);
	return err;
}
