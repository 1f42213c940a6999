// SPDX-License-Identifier: Apache-2.0
/*
 * driver.c - the process-wide driver: phxFileDriverOpen/Close, the choice
 * of path, one libphx staging context per GPU.
 *
 * References: every phxFileDriverOpen() counts; the first registration on
 * a closed driver opens it implicitly (LMCache's phx backend never calls
 * phxFileDriverOpen, only phxFileDriverClose at the end).  Close drops an
 * explicit reference, else the implicit one; the driver shuts down when
 * none is left, after waiting for transfers in flight.  Shutting down with
 * handles or buffers still registered is refused with -EBUSY (the reference
 * stays), so that no handle ever points at freed state.
 */
#include <errno.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"

/* The one driver: the frozen ABI has no context argument (see internal.h). */
static struct pf_driver drv = {
	.setup = PTHREAD_MUTEX_INITIALIZER,
	.lock = PTHREAD_MUTEX_INITIALIZER,
	.idle = PTHREAD_COND_INITIALIZER,
};

struct pf_driver *pf_drv(void)
{
	return &drv;
}

/* The test hook of direct.c: only under tests/gpu_fake's stand-in driver. */
static bool want_identity_map(struct pf_driver *d)
{
	const char *v = getenv("PHXFILE_TEST_DIRECT");

	if (!v || strcmp(v, "identity"))
		return false;
	if (!d->cuda.fake) {
		pf_log("PHXFILE_TEST_DIRECT=identity ignored: the CUDA driver is not the test fake");
		return false;
	}
	return true;
}

static void choose_path(struct pf_driver *d)
{
	int ret = phx_devmem_probe();

	d->identity_map = false;
	if (!ret) {
		d->path = PHXFILE_PATH_DIRECT;
		pf_log("driver open (libphx %s): path=direct: registered GPU buffers are mapped through /dev/phx and the SSD DMAs into them; other buffers use Co-DMA staging",
		       phx_version());
	} else if (want_identity_map(d)) {
		d->path = PHXFILE_PATH_DIRECT;
		d->identity_map = true;
		pf_log("driver open (libphx %s): path=direct (test hook: fake device memory used as its own mapping)",
		       phx_version());
	} else {
		d->path = PHXFILE_PATH_STAGING;
		pf_log("driver open (libphx %s): path=staging: Co-DMA through pinned host memory (/dev/phx not usable: %s)",
		       phx_version(), phx_strerror_last());
	}
}

/* Setup held. */
static int open_setup(struct pf_driver *d)
{
	char why[256];
	int ret;

	if (!phx_cuda_available(why, sizeof(why))) {
		if (!d->nodev_logged)
			pf_log("driver open refused: no usable CUDA GPU (%s)", why);
		d->nodev_logged = true;
		return -ENODEV;
	}
	ret = pf_cuda_load(&d->cuda);
	if (ret)
		return ret;
	ret = phx_engine_create(NULL, &d->eng);
	if (ret) {
		pf_log("driver open: phx_engine_create: %s", phx_strerror_last());
		pf_cuda_unload(&d->cuda);
		return ret;
	}
	choose_path(d);
	pthread_mutex_lock(&d->lock);
	d->live = true;
	d->st.driver_opens++;
	pthread_mutex_unlock(&d->lock);
	return 0;
}

/* Open the driver for a registration if it is closed (setup held). */
int pf_get_setup(struct pf_driver *d)
{
	int ret;

	if (d->live)
		return 0;
	ret = open_setup(d);
	if (!ret)
		d->implicit = true;
	return ret;
}

/* Lock held. */
static void ctx_fold_stats(struct pf_driver *d, phx_cuda *cu)
{
	struct phx_cuda_stats cs;

	phx_cuda_stats_get(cu, &cs, sizeof(cs));
	d->st.staging_errors += cs.errors;
	d->st.staging_chunks += cs.chunks;
	d->st.h2d_bytes += cs.h2d_bytes;
	d->st.d2h_bytes += cs.d2h_bytes;
	d->st.early_reads += cs.early_reads;
	d->st.early_misses += cs.early_misses;
	d->st.bad_marks += cs.bad_marks;
}

/*
 * Early reads (libphx: a stream read's file I/O starts when it is queued,
 * and stands only if nothing changed by arrival) are on by default here,
 * though libphx leaves them off: the slab is this process's alone
 * (handles.c claims it), and every write to it goes through libphx in this
 * process, whichever device's context it comes from, so libphx's per-inode
 * write log sees it.  They doubled LMCache's chunk loads on the H200
 * (docs/gpu.md).  Once the direct path has run (phx.ko mapped memory, file
 * I/O from CUDA's callback thread) they go off on every context
 * (pf_direct_early_off).  PHX_CUDA_EARLY_READS=0 turns them off.
 */
static bool early_reads_wanted(struct pf_driver *d)
{
	const char *v = getenv("PHX_CUDA_EARLY_READS");

	return !(v && !atoi(v)) && !__atomic_load_n(&d->direct_used, __ATOMIC_ACQUIRE);
}

/* The direct path ran: early reads off on every context (setup not held). */
void pf_direct_early_off(struct pf_driver *d)
{
	phx_cuda *ctx[PF_MAX_DEVICES];
	int i, n = 0;

	if (__atomic_exchange_n(&d->direct_used, true, __ATOMIC_ACQ_REL))
		return;
	pthread_mutex_lock(&d->setup);
	for (i = 0; i < PF_MAX_DEVICES; i++)
		if (d->ctx[i])
			ctx[n++] = d->ctx[i];
	for (i = 0; i < n; i++)
		phx_cuda_set_early_reads(ctx[i], 0);
	pthread_mutex_unlock(&d->setup);
	if (n)
		pf_log("early reads off: the direct path (/dev/phx) is in use");
}

/*
 * Start-up check of what a device's transfers need: the staging context
 * (its pinned memory registered with CUDA) and stream memory operations
 * (every transfer is stream-ordered).  Done when the first buffer of the
 * device is registered (LMCache registers its staging buffers when a GPU
 * attaches), so a GPU that cannot work is refused there, with one line
 * saying why, instead of failing at its first transfer.  A refusal is kept
 * until the driver closes (no retry, no second line per call).
 */
static int ctx_create_setup(struct pf_driver *d, int dev, phx_cuda **out)
{
	struct phx_cuda_config cfg;
	int ret = pf_cuda_retain(&d->cuda, dev);

	if (ret)
		return ret;
	phx_cuda_config_init(&cfg);
	cfg.device = dev;
	if (early_reads_wanted(d))
		cfg.flags |= PHX_CUDA_EARLY_READS;
	else
		cfg.flags &= ~PHX_CUDA_EARLY_READS;
	ret = phx_cuda_create(d->eng, &cfg, out);
	if (ret) {
		pf_log("device %d: cannot start: the staging context failed: %s (pinned host memory: ulimit -l, PHX_CUDA_MAX_PINNED); this device's buffers and transfers are refused until the driver is reopened",
		       dev, phx_cuda_strerror_last());
		return ret;
	}
	if (!(phx_cuda_features(*out) & PHX_CUDA_FEAT_MEMOPS)) {
		pf_log("device %d: cannot start without stream memory operations, and every phxFile transfer is stream-ordered: %s; this device's buffers and transfers are refused until the driver is reopened",
		       dev, phx_cuda_memops_why(*out));
		phx_cuda_destroy(*out);
		*out = NULL;
		return -EOPNOTSUPP;
	}
	phx_cuda_config_get(*out, &cfg);
	pf_log("device %d: staging context: %u lanes x %u buffers x %u KiB pinned, stream memory operations, early reads %s",
	       dev, cfg.lanes, cfg.bufs_per_lane, cfg.buf_size >> 10,
	       phx_cuda_features(*out) & PHX_CUDA_FEAT_EARLY_READS ? "on" : "off");
	pf_handles_attach_all_setup(d, dev, *out);
	return 0;
}

/* Setup held: pf_ctx_get() for callers that hold it. */
int pf_ctx_get_setup(struct pf_driver *d, int dev, phx_cuda **out)
{
	phx_cuda *cu;
	int ret;

	if (dev < 0 || dev >= PF_MAX_DEVICES)
		return -ENODEV;
	if (!d->live)
		return -ENODEV;
	cu = d->ctx[dev];
	if (!cu) {
		if (d->ctx_err[dev])
			return d->ctx_err[dev];
		ret = ctx_create_setup(d, dev, &cu);
		if (ret) {
			d->ctx_err[dev] = ret;
			return ret;
		}
		pthread_mutex_lock(&d->lock);
		d->ctx[dev] = cu;
		pthread_mutex_unlock(&d->lock);
	}
	*out = cu;
	return 0;
}

/*
 * The staging context of device @dev, created on first use with libphx's
 * defaults (PHX_CUDA_* variables apply).  Live handles are registered with
 * it so that its lanes keep their fds.  Called with no lock held.
 */
int pf_ctx_get(struct pf_driver *d, int dev, phx_cuda **out)
{
	phx_cuda *cu;
	int ret;

	if (dev < 0 || dev >= PF_MAX_DEVICES)
		return -ENODEV;
	pthread_mutex_lock(&d->lock);
	cu = d->ctx[dev];
	pthread_mutex_unlock(&d->lock);
	if (cu) {
		*out = cu;
		return 0;
	}
	pthread_mutex_lock(&d->setup);
	ret = pf_ctx_get_setup(d, dev, out);
	pthread_mutex_unlock(&d->setup);
	return ret;
}

/* Setup held: wait for the transfers in flight, then free everything. */
static void shutdown_setup(struct pf_driver *d)
{
	phx_cuda *ctx[PF_MAX_DEVICES];
	int i;

	pthread_mutex_lock(&d->lock);
	while (d->st.inflight)
		pthread_cond_wait(&d->idle, &d->lock);
	memcpy(ctx, d->ctx, sizeof(ctx));
	memset(d->ctx, 0, sizeof(d->ctx));
	memset(d->ctx_err, 0, sizeof(d->ctx_err));
	for (i = 0; i < PF_MAX_DEVICES; i++)
		if (ctx[i])
			ctx_fold_stats(d, ctx[i]);
	d->live = false;
	pthread_mutex_unlock(&d->lock);
	for (i = 0; i < PF_MAX_DEVICES; i++)
		if (ctx[i])
			phx_cuda_destroy(ctx[i]);
	phx_engine_destroy(d->eng);
	d->eng = NULL;
	pf_fail_flush(d, true);
	pf_cuda_unload(&d->cuda);
	pf_log("driver closed: path=%s reads=%llu writes=%llu bytes_read=%llu bytes_written=%llu failures=%llu submit_errors=%llu unregistered_ops=%llu",
	       pf_path_name(d->path), (unsigned long long)d->st.reads,
	       (unsigned long long)d->st.writes, (unsigned long long)d->st.bytes_read,
	       (unsigned long long)d->st.bytes_written, (unsigned long long)d->st.failures,
	       (unsigned long long)d->st.submit_errors,
	       (unsigned long long)d->st.unregistered_ops);
	d->path = PHXFILE_PATH_NONE;
}

/*
 * Live counters (`phx top`): phxFileGetStats's, published once per process
 * for its whole life (the driver is process-wide).  Added before any setup
 * lock is taken: libphx's publishing thread calls the fill function, which
 * takes d->setup, with its own lock held.
 */
static const char *const pf_stat_names[] = {
	"path", "driver_opens", "reads", "writes", "bytes_read", "bytes_written",
	"failures", "submit_errors", "unregistered_ops", "direct_ops", "staging_ops",
	"direct_fallbacks", "buffers", "handles", "inflight", "last_error",
	"staging_errors", "staging_chunks", "h2d_bytes", "d2h_bytes", "pinned_bytes",
	"early_reads", "early_misses", "bad_refusals", "bad_marks",
};

static int stats_collect(struct phxfile_stats *out, bool nowait);

/*
 * libphx's publishing thread, with its own lock held: it must not wait for
 * d->setup, whose holder may be creating a context, which publishes its
 * counters and so waits for that lock (a deadlock seen in the fake tests).
 * When setup is busy the values of the last round stay.
 */
static void pf_stats_fill(void *unused, uint64_t *vals, uint32_t n)
{
	struct phxfile_stats st;

	pf_fail_flush(pf_drv(), false);	/* running totals of failures, when due */
	if (stats_collect(&st, true))
		return;
	vals[0] = st.path;
	/* the uint64_t fields from driver_opens on, in pf_stat_names' order */
	memcpy(&vals[1], &st.driver_opens, (n - 1) * sizeof(uint64_t));
}

_Static_assert(offsetof(struct phxfile_stats, bad_marks) ==
	       offsetof(struct phxfile_stats, driver_opens) +
	       (sizeof(pf_stat_names) / sizeof(pf_stat_names[0]) - 2) * sizeof(uint64_t),
	       "pf_stat_names must follow struct phxfile_stats");

static void pf_publish_once(void)
{
	phx_stats_source *src;

	/* best effort, never removed; PHX_STATS=0 or no room: nothing shown */
	phx_stats_source_add("phxfile", pf_stat_names,
			     sizeof(pf_stat_names) / sizeof(pf_stat_names[0]),
			     "libphxfile (LMCache GDS phx backend)", pf_stats_fill, NULL, &src);
}

void pf_publish(void)
{
	static pthread_once_t once = PTHREAD_ONCE_INIT;

	pthread_once(&once, pf_publish_once);
}

PF_EXPORT int phxFileDriverOpen(void)
{
	struct pf_driver *d = pf_drv();
	int ret = 0;

	pf_publish();
	pthread_mutex_lock(&d->setup);
	if (!d->live)
		ret = open_setup(d);
	if (!ret)
		d->opens++;
	pthread_mutex_unlock(&d->setup);
	return ret;
}

/* Drop one reference; 1 when it was the last. */
static bool put_ref_setup(struct pf_driver *d, bool *was_implicit)
{
	*was_implicit = !d->opens;
	if (d->opens)
		d->opens--;
	else
		d->implicit = false;
	return !d->opens && !d->implicit;
}

PF_EXPORT int phxFileDriverClose(void)
{
	struct pf_driver *d = pf_drv();
	bool was_implicit;
	int ret = 0;

	pthread_mutex_lock(&d->setup);
	if (d->live && put_ref_setup(d, &was_implicit)) {
		if (d->nbufs || d->handles) {
			if (was_implicit)
				d->implicit = true;
			else
				d->opens++;
			pf_log("driver close refused: %zu buffer(s)%s still registered",
			       d->nbufs, d->handles ? " and file handle(s)" : "");
			ret = -EBUSY;
		} else {
			shutdown_setup(d);
		}
	}
	pthread_mutex_unlock(&d->setup);
	return ret;
}

/* The counters now; -EAGAIN when @nowait and setup is held. */
static int stats_collect(struct phxfile_stats *out, bool nowait)
{
	struct pf_driver *d = pf_drv();
	struct phx_cuda_stats cs;
	int i;

	/* setup: no context is destroyed while its counters are read */
	if (nowait) {
		if (pthread_mutex_trylock(&d->setup))
			return -EAGAIN;
	} else {
		pthread_mutex_lock(&d->setup);
	}
	pthread_mutex_lock(&d->lock);
	*out = d->st;
	out->path = d->live ? d->path : PHXFILE_PATH_NONE;
	pthread_mutex_unlock(&d->lock);
	for (i = 0; i < PF_MAX_DEVICES; i++) {
		if (!d->ctx[i])
			continue;
		phx_cuda_stats_get(d->ctx[i], &cs, sizeof(cs));
		out->staging_errors += cs.errors;
		out->staging_chunks += cs.chunks;
		out->h2d_bytes += cs.h2d_bytes;
		out->d2h_bytes += cs.d2h_bytes;
		out->pinned_bytes += cs.pinned_bytes;
		out->early_reads += cs.early_reads;
		out->early_misses += cs.early_misses;
		out->bad_marks += cs.bad_marks;
	}
	pthread_mutex_unlock(&d->setup);
	return 0;
}

PF_EXPORT int phxFileGetStats(struct phxfile_stats *st)
{
	struct phxfile_stats out;
	uint32_t size;

	if (!st || st->size < sizeof(uint32_t) * 2)
		return -EINVAL;
	size = st->size < sizeof(*st) ? st->size : sizeof(*st);
	stats_collect(&out, false);
	out.size = size;
	memcpy(st, &out, size);
	return 0;
}
