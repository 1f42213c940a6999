// SPDX-License-Identifier: Apache-2.0
/*
 * direct.c - the direct path: GPU memory mapped through /dev/phx (phx.ko)
 * is an ordinary O_DIRECT buffer, so the SSD DMAs into it.
 *
 * A registered buffer is mapped once (phx_devmem_map_gpu).  A transfer on
 * it is one host function on the caller's stream that reads the deferred
 * arguments, runs phx_pread/phx_pwrite on the mapping and stores the
 * result: work queued after it sees the data.  That host function blocks
 * CUDA's callback thread for the I/O, so transfers of all streams run one
 * at a time; it makes no CUDA call, so it cannot deadlock against the
 * driver.  (A libphx lane-based direct mode would lift the serialisation:
 * see adapters/lmcache/README.md.)
 *
 * Not run on any machine yet: neither box here can load phx.ko.  The test
 * hook PHXFILE_TEST_DIRECT=identity, honoured only under tests/gpu_fake's
 * stand-in libcuda (whose "device" memory is host memory), runs this code
 * with the device address as its own mapping.
 */
#include <errno.h>

#include "internal.h"

int pf_direct_map(struct pf_driver *d, struct pf_buf *b)
{
	struct phx_devmem_info info = { 0 };
	int ret;

	if (d->identity_map) {
		b->host = (char *)(uintptr_t)b->base;
		return 0;
	}
	ret = phx_devmem_map_gpu(b->base, b->len, &b->map);
	if (!ret)
		ret = phx_devmem_get_info(b->map, &info);
	if (ret || info.length < b->len) {
		pf_log("buffer 0x%llx (%llu bytes) stays on staging: /dev/phx mapping failed: %s",
		       (unsigned long long)b->base, (unsigned long long)b->len,
		       ret ? phx_strerror_last() : "short mapping");
		if (b->map)
			phx_devmem_unmap(b->map);
		b->map = NULL;
		return ret ? ret : -ENOMEM;
	}
	b->host = info.addr;
	return 0;
}

void pf_direct_unmap(struct pf_buf *b)
{
	if (b->map)
		phx_devmem_unmap(b->map);
	b->map = NULL;
	b->host = NULL;
}

/* The arguments as they are now (the stream has reached the transfer). */
static int64_t direct_io(struct pf_op *o)
{
	uint64_t size = *o->size;
	int64_t foff = *o->foff, boff = *o->boff;
	uint64_t at = o->base - o->b->base;

	if (foff < 0 || boff < 0)
		return -EINVAL;
	if (at + (uint64_t)boff > o->b->len || size > o->b->len - at - (uint64_t)boff)
		return -EINVAL;
	if (!size)
		return 0;
	if (o->op == PHX_OP_READ)
		return phx_pread(o->h->f, o->b->host + at + boff, size, (uint64_t)foff);
	return phx_pwrite(o->h->f, o->b->host + at + boff, size, (uint64_t)foff);
}

void pf_direct_run(void *arg)
{
	struct pf_op *o = arg;
	int64_t res = direct_io(o);

	*o->bytes_done = res;	/* before the stream goes on past this host function */
	pf_op_finish(o, res);
}
