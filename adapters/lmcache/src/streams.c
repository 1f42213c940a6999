// SPDX-License-Identifier: Apache-2.0
/*
 * streams.c - phxFileStreamRegister/Deregister.  Every transfer carries its
 * stream and libphx needs no per-stream state, so registration only makes
 * sure the driver is open (it fails with -ENODEV without a GPU).
 */
#include "internal.h"

PF_EXPORT int phxFileStreamRegister(void *stream)
{
	struct pf_driver *d = pf_drv();
	int ret;

	pthread_mutex_lock(&d->setup);
	ret = pf_get_setup(d);
	pthread_mutex_unlock(&d->setup);
	return ret ? pf_submit_fail(d, ret, NULL, "phxFileStreamRegister") : 0;
}

PF_EXPORT int phxFileStreamDeregister(void *stream)
{
	return 0;
}
