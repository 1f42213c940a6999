// SPDX-License-Identifier: Apache-2.0
/*
 * buffers.c - phxFileBufRegister/Deregister: the registered GPU ranges.
 *
 * Staging needs no registration (libphx finds the allocation itself), so a
 * registration records the range and its device; any size and alignment
 * is accepted.  On the direct path it also maps the range through
 * /dev/phx; where that fails the buffer stays on staging (counted in
 * direct_fallbacks, logged).  Transfers on an unregistered buffer work and
 * are counted (unregistered_ops).  Ranges are kept sorted by base.
 */
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"

/* Index of the first range whose base is > @addr. */
static size_t upper(struct pf_driver *d, uint64_t addr)
{
	size_t lo = 0, hi = d->nbufs;

	while (lo < hi) {
		size_t mid = (lo + hi) / 2;

		if (d->bufs[mid]->base <= addr)
			lo = mid + 1;
		else
			hi = mid;
	}
	return lo;
}

/* The registered range that contains @addr, or NULL. */
struct pf_buf *pf_buf_find_locked(struct pf_driver *d, uint64_t addr)
{
	size_t i = upper(d, addr);
	struct pf_buf *b;

	if (!i)
		return NULL;
	b = d->bufs[i - 1];
	return addr - b->base < b->len ? b : NULL;
}

static bool overlaps(struct pf_driver *d, size_t at, uint64_t base, uint64_t len)
{
	if (at > 0 && d->bufs[at - 1]->base + d->bufs[at - 1]->len > base)
		return true;
	return at < d->nbufs && d->bufs[at]->base < base + len;
}

static int insert_locked(struct pf_driver *d, const struct pf_buf *nb)
{
	size_t at = upper(d, nb->base);
	struct pf_buf *b;

	if (overlaps(d, at, nb->base, nb->len))
		return -EEXIST;
	if (d->nbufs == d->capbufs) {
		size_t cap = d->capbufs ? d->capbufs * 2 : 64;
		struct pf_buf **n = realloc(d->bufs, cap * sizeof(*n));

		if (!n)
			return -ENOMEM;
		d->bufs = n;
		d->capbufs = cap;
	}
	/* one allocation each: transfers in flight point at it */
	b = malloc(sizeof(*b));
	if (!b)
		return -ENOMEM;
	*b = *nb;
	memmove(&d->bufs[at + 1], &d->bufs[at], (d->nbufs - at) * sizeof(*d->bufs));
	d->bufs[at] = b;
	d->nbufs++;
	d->st.buffers = d->nbufs;
	return 0;
}

/* Both ends must be device memory of one GPU. */
static int buf_device(uint64_t base, uint64_t len)
{
	int dev = phx_cuda_ptr_device(base), last;

	if (dev < 0)
		return dev;
	last = phx_cuda_ptr_device(base + len - 1);
	if (last < 0)
		return last;
	return last == dev ? dev : -EINVAL;
}

PF_EXPORT int phxFileBufRegister(const void *addr, size_t len)
{
	struct pf_driver *d = pf_drv();
	struct pf_buf nb = { .base = (uint64_t)(uintptr_t)addr, .len = len };
	int ret;

	if (!addr || !len || nb.base + len < nb.base)
		return pf_submit_fail(d, -EINVAL, NULL, "phxFileBufRegister (NULL or empty range)");
	pf_publish();
	pthread_mutex_lock(&d->setup);
	ret = pf_get_setup(d);
	if (!ret) {
		ret = nb.dev = buf_device(nb.base, len);
		if (ret > 0)
			ret = 0;
	}
	/* the host functions of its transfers are queued in that context */
	if (!ret)
		ret = pf_cuda_retain(&d->cuda, nb.dev);
	if (!ret && d->path == PHXFILE_PATH_DIRECT && pf_direct_map(d, &nb)) {
		pthread_mutex_lock(&d->lock);
		d->st.direct_fallbacks++;
		pthread_mutex_unlock(&d->lock);
	}
	/* staging serves it: the device is checked now, not at its first transfer */
	if (!ret && !nb.host) {
		phx_cuda *cu;

		ret = pf_ctx_get_setup(d, nb.dev, &cu);
	}
	if (!ret) {
		pthread_mutex_lock(&d->lock);
		ret = insert_locked(d, &nb);
		pthread_mutex_unlock(&d->lock);
		if (ret)
			pf_direct_unmap(&nb);
	}
	pthread_mutex_unlock(&d->setup);
	if (ret == -EINVAL)
		return pf_submit_fail(d, ret, NULL, "phxFileBufRegister (not GPU memory of one device)");
	if (ret == -EEXIST)
		return pf_submit_fail(d, ret, NULL, "phxFileBufRegister (overlaps a registered buffer)");
	if (ret == -EOPNOTSUPP)
		return pf_submit_fail(d, ret, NULL, "phxFileBufRegister (the GPU lacks stream memory operations: see the device's start-up line)");
	if (ret)
		return pf_submit_fail(d, ret, NULL, "phxFileBufRegister");
	return 0;
}

PF_EXPORT int phxFileBufDeregister(const void *addr)
{
	struct pf_driver *d = pf_drv();
	uint64_t base = (uint64_t)(uintptr_t)addr;
	struct pf_buf *b = NULL;
	size_t i;
	int ret = 0;

	pthread_mutex_lock(&d->setup);
	pthread_mutex_lock(&d->lock);
	i = upper(d, base);
	if (i && d->bufs[i - 1]->base == base)
		ret = pf_wait_buf_idle_locked(d, d->bufs[i - 1]);
	i = upper(d, base);
	if (!i || d->bufs[i - 1]->base != base) {
		ret = -ENOENT;
	} else if (ret || d->bufs[i - 1]->inflight) {
		ret = -EBUSY;
	} else {
		b = d->bufs[i - 1];
		memmove(&d->bufs[i - 1], &d->bufs[i], (d->nbufs - i) * sizeof(d->bufs[0]));
		d->nbufs--;
		d->st.buffers = d->nbufs;
	}
	pthread_mutex_unlock(&d->lock);
	if (b) {
		pf_direct_unmap(b);
		free(b);
	}
	pthread_mutex_unlock(&d->setup);
	if (ret == -ENOENT)
		return pf_submit_fail(d, ret, NULL, "phxFileBufDeregister (not a registered base)");
	if (ret)
		return pf_submit_fail(d, ret, NULL, "phxFileBufDeregister (transfers in flight)");
	return 0;
}
