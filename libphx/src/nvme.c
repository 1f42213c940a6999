// SPDX-License-Identifier: Apache-2.0
/*
 * nvme.c - NVMe commands on /dev/ngXnY through io_uring passthrough.
 *
 * Every call takes one queue (an io_uring set up with SQE128 | CQE32) for
 * its whole duration and runs a "pump": a generator of NVMe commands
 * (read/write chunks, DSM range lists, Write Zeroes pieces) that keeps up to
 * queue_depth of them in flight, submits everything prepared with one
 * io_uring_enter that also waits, and hands each completion back to the
 * generator.  cqe->res is 0 on success, a negative errno when the kernel
 * failed the command, and the NVMe status (SCT << 8 | SC, with the DNR and
 * More bits above) when the controller did.
 */
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/stat.h>
#include <unistd.h>
#include <linux/nvme_ioctl.h>

#include "internal.h"
#include "nvme_internal.h"

#define NV_DEFAULT_QD 32u
#define NV_DEFAULT_QUEUES 2u
#define NV_BUF_SLOTS 64u		/* caller registrations; slot 0 is ours */
#define NV_DSM_RANGES 256u		/* ranges per DSM command (the maximum) */
#define NV_DSM_RANGE_BLOCKS 65536u	/* blocks per DSM range */
#define NV_WZ_BLOCKS 65536u		/* NLB is 16 bits */

#ifndef IORING_URING_CMD_FIXED
#define IORING_URING_CMD_FIXED (1U << 0)
#endif
#ifndef IORING_SETUP_COOP_TASKRUN
#define IORING_SETUP_COOP_TASKRUN (1U << 8)
#endif

struct nvq {
	struct io_uring ring;
	bool ready;		/* ring set up */
	bool busy;		/* a call is using it */
	bool broken;		/* the ring failed: never used again */
};

struct nvbuf {
	char *addr;
	size_t len;		/* 0: free slot */
};

/* What one in-flight command carries (indexed by its SQE user_data). */
struct cmdinfo {
	uint32_t job;		/* request index (rw) */
	uint32_t bytes;		/* data bytes of a read/write */
	uint64_t slba;
	uint32_t nlb;
	int buf_index;		/* fixed-buffer slot, or -1 */
	uint8_t opcode;
};

struct phx_nvme {
	int fd;			/* the generic char device */
	int claim_fd;		/* the block device, O_EXCL, or -1 */
	char path[256];
	struct phx_nvme_info info;
	uint32_t flags;
	uint64_t lo, hi;	/* claimed LBAs [lo, hi) */
	uint32_t max_unaligned;	/* per-command bytes for non-page-aligned buffers */

	pthread_mutex_t lock;	/* queues' busy flags, bufs[] */
	pthread_cond_t cond;
	struct nvq *q;
	uint32_t nq;
	bool fixed_table;	/* sparse buffer tables registered */
	bool fixed_ok;		/* fixed uring_cmds work */
	bool dsm_broken;	/* DSM failed as unsupported once */
	char *scratch;		/* lba-sized, page aligned; fixed slot 0 */
	struct nvbuf bufs[NV_BUF_SLOTS];

	struct phx_nvme_stats st;	/* updated atomically */
};

#define ST_ADD(nv, field, v) __atomic_fetch_add(&(nv)->st.field, (v), __ATOMIC_RELAXED)

static void st_max(phx_nvme *nv, uint64_t v)
{
	uint64_t cur = __atomic_load_n(&nv->st.max_inflight, __ATOMIC_RELAXED);

	while (v > cur && !__atomic_compare_exchange_n(&nv->st.max_inflight, &cur, v, false,
						       __ATOMIC_RELAXED, __ATOMIC_RELAXED))
		;
}

/* ------------------------------------------------------------------------ */
/* Configuration                                                            */
/* ------------------------------------------------------------------------ */

/* A setting from env.c; 0 or above 4096: the default. */
static uint32_t env_u32(const char *name, uint32_t dflt)
{
	uint32_t v = phx_env_u32(name, dflt);

	return v == 0 || v > 4096 ? dflt : v;
}

PHX_EXPORT void phx_nvme_config_init(struct phx_nvme_config *cfg)
{
	memset(cfg, 0, sizeof(*cfg));
	cfg->size = sizeof(*cfg);
	cfg->queue_depth = env_u32("PHX_NVME_QUEUE_DEPTH", NV_DEFAULT_QD);
	cfg->nr_queues = env_u32("PHX_NVME_QUEUES", NV_DEFAULT_QUEUES);
}

/* ------------------------------------------------------------------------ */
/* Identify                                                                 */
/* ------------------------------------------------------------------------ */

static uint16_t le16(const uint8_t *p)
{
	return (uint16_t)(p[0] | p[1] << 8);
}

static uint64_t le64(const uint8_t *p)
{
	uint64_t v = 0;
	int i;

	for (i = 7; i >= 0; i--)
		v = v << 8 | p[i];
	return v;
}

static void copy_str(char *dst, const uint8_t *src, size_t n)
{
	memcpy(dst, src, n);
	dst[n] = 0;
	while (n && (dst[n - 1] == ' ' || dst[n - 1] == 0))
		dst[--n] = 0;
}

static int admin_identify(int fd, uint32_t nsid, uint32_t cns, void *buf,
			  const char *path)
{
	struct nvme_admin_cmd c;
	int ret;

	memset(&c, 0, sizeof(c));
	c.opcode = NVME_ADMIN_IDENTIFY;
	c.nsid = nsid;
	c.addr = (uintptr_t)buf;
	c.data_len = 4096;
	c.cdw10 = cns;
	ret = ioctl(fd, NVME_IOCTL_ADMIN_CMD, &c);
	if (ret < 0)
		return phx_err(-errno, "%s: Identify (CNS %u) admin passthrough", path, cns);
	if (ret > 0)
		return phx_err(nvme_status_errno(ret),
			       "%s: Identify (CNS %u) rejected: NVMe status 0x%03x (%s)",
			       path, cns, ret & 0x7ff, phx_nvme_status_str(ret));
	return 0;
}

/* Open-free identification of an fd on a namespace char device. */
static int identify_fd(int fd, const char *path, struct phx_nvme_info *info)
{
	uint8_t *ctrl = NULL, *ns = NULL;
	struct nvme_blkdev blk;
	struct stat stbuf;
	char why[320];
	uint32_t fmt, nlbaf, lbads, hw_kb, segs;
	uint64_t mt;
	int nsid, ret;

	memset(info, 0, sizeof(*info));
	info->size = sizeof(*info);
	if (fstat(fd, &stbuf))
		return phx_err(-errno, "%s", path);
	if (!S_ISCHR(stbuf.st_mode) && !S_ISBLK(stbuf.st_mode))
		return phx_err(-ENOTTY, "%s is not an NVMe namespace char device (/dev/ngXnY)",
			       path);
	nsid = ioctl(fd, NVME_IOCTL_ID);
	if (nsid <= 0)
		return phx_err(nsid < 0 ? -errno : -ENOTTY,
			       "%s: NVME_IOCTL_ID failed: not an NVMe namespace "
			       "(a controller device /dev/nvmeX has no namespace)", path);
	/* The block device by device number; not finding it is the safety check's to judge. */
	ret = nvme_find_block(fd, (uint32_t)nsid, &blk, why, sizeof(why));
	if (ret == -ENOTTY)
		return phx_err(ret, "%s: %s", path, why);
	snprintf(info->block_device, sizeof(info->block_device), "%s", blk.name);
	info->nsid = (uint32_t)nsid;
	if (posix_memalign((void **)&ctrl, 4096, 4096) ||
	    posix_memalign((void **)&ns, 4096, 4096)) {
		ret = phx_err(-ENOMEM, "out of memory");
		goto out;
	}
	memset(ctrl, 0, 4096);
	memset(ns, 0, 4096);
	ret = admin_identify(fd, 0, 1, ctrl, path);
	if (!ret)
		ret = admin_identify(fd, info->nsid, 0, ns, path);
	if (ret)
		goto out;
	copy_str(info->serial, ctrl + 4, 20);
	copy_str(info->model, ctrl + 24, 40);
	copy_str(info->firmware, ctrl + 64, 8);
	info->mdts = ctrl[77];
	info->oncs = le16(ctrl + 520);
	info->nr_lbas = le64(ns);
	nlbaf = ns[25];
	fmt = (ns[26] & 0x0f) | (nlbaf >= 16 ? (ns[26] >> 5 & 3) << 4 : 0);
	lbads = ns[128 + 4 * fmt + 2];
	info->metadata_size = le16(ns + 128 + 4 * fmt);
	info->dlfeat = ns[33];
	if (lbads < 9 || lbads > 16) {
		ret = phx_err(-EOPNOTSUPP, "%s: LBA format %u reports LBADS %u (%s)", path, fmt,
			      lbads, info->nr_lbas ? "unsupported" : "namespace not formatted");
		goto out;
	}
	info->lba_size = 1u << lbads;
	info->capacity = info->nr_lbas * info->lba_size;
	if (info->oncs & (1u << 2))
		info->features |= PHX_NVME_FEAT_DSM;
	if (info->oncs & (1u << 3))
		info->features |= PHX_NVME_FEAT_WRITE_ZEROES;
	if (info->dlfeat & (1u << 3))
		info->features |= PHX_NVME_FEAT_WZ_DEALLOC;

	/* Largest command: MDTS (units of the 4 KiB controller page Linux
	 * uses), the kernel's max_hw_sectors and max_segments, 16-bit NLB. */
	mt = info->mdts ? 4096ull << info->mdts : 1ull << 30;
	hw_kb = (uint32_t)nvme_sysfs_u64(info->block_device, "queue/max_hw_sectors_kb");
	segs = (uint32_t)nvme_sysfs_u64(info->block_device, "queue/max_segments");
	if (hw_kb && (uint64_t)hw_kb * 1024 < mt)
		mt = (uint64_t)hw_kb * 1024;
	if (segs && (uint64_t)segs * 4096 < mt)
		mt = (uint64_t)segs * 4096;
	if (mt > 65536ull * info->lba_size)
		mt = 65536ull * info->lba_size;
	if (mt > 1u << 30)
		mt = 1u << 30;
	mt = mt / info->lba_size * info->lba_size;
	if (!mt)
		mt = info->lba_size;
	info->max_transfer = (uint32_t)mt;
	info->max_segments = segs;
	ret = 0;
out:
	free(ctrl);
	free(ns);
	return ret;
}

PHX_EXPORT int phx_nvme_identify(const char *path, struct phx_nvme_info *info)
{
	int saved = errno, fd, ret;

	if (!path || !info)
		return phx_err(-EINVAL, "phx_nvme_identify: NULL argument");
	fd = open(path, O_RDONLY | O_CLOEXEC);
	if (fd < 0) {
		ret = phx_err(-errno, "%s", path);
	} else {
		ret = identify_fd(fd, path, info);
		close(fd);
	}
	errno = saved;
	return ret;
}

PHX_EXPORT int phx_nvme_check(const char *path)
{
	struct phx_nvme_info info;
	int saved = errno, fd, ret, claim = -1;

	if (!path)
		return phx_err(-EINVAL, "phx_nvme_check: NULL path");
	fd = open(path, O_RDONLY | O_CLOEXEC);
	if (fd < 0) {
		ret = phx_err(-errno, "%s", path);
		goto out;
	}
	ret = identify_fd(fd, path, &info);
	if (!ret && info.metadata_size)
		ret = phx_err(-EOPNOTSUPP,
			      "%s: the in-use LBA format has %u bytes of metadata per block "
			      "(not supported)", path, info.metadata_size);
	if (!ret)
		ret = nvme_safety_check(fd, info.nsid, path, &claim);
	if (claim >= 0)
		close(claim);
	close(fd);
out:
	errno = saved;
	return ret;
}

/* ------------------------------------------------------------------------ */
/* Queues                                                                   */
/* ------------------------------------------------------------------------ */

static int queue_setup(phx_nvme *nv, struct nvq *q)
{
	struct io_uring_params p;
	int ret;

	memset(&p, 0, sizeof(p));
	p.flags = IORING_SETUP_SQE128 | IORING_SETUP_CQE32 | IORING_SETUP_COOP_TASKRUN;
	ret = io_uring_queue_init_params(nv->info.queue_depth, &q->ring, &p);
	if (ret == -EINVAL) {
		memset(&p, 0, sizeof(p));
		p.flags = IORING_SETUP_SQE128 | IORING_SETUP_CQE32;
		ret = io_uring_queue_init_params(nv->info.queue_depth, &q->ring, &p);
	}
	if (ret == -EINVAL)
		return phx_err(-EOPNOTSUPP,
			       "io_uring refuses SQE128/CQE32 rings: NVMe passthrough needs "
			       "Linux 5.19 or later");
	if (ret < 0)
		return phx_err(ret, "io_uring_queue_init (depth %u)", nv->info.queue_depth);
	q->ready = true;
	return 0;
}

static struct nvq *queue_get(phx_nvme *nv)
{
	struct nvq *q = NULL;
	uint32_t i, usable;

	pthread_mutex_lock(&nv->lock);
	for (;;) {
		usable = 0;
		for (i = 0; i < nv->nq; i++) {
			if (nv->q[i].broken)
				continue;
			usable++;
			if (!nv->q[i].busy) {
				q = &nv->q[i];
				q->busy = true;
				break;
			}
		}
		if (q || !usable)
			break;
		pthread_cond_wait(&nv->cond, &nv->lock);
	}
	pthread_mutex_unlock(&nv->lock);
	if (!q)
		phx_err(-EIO, "%s: every io_uring queue of this handle has failed", nv->path);
	return q;
}

static void queue_put(phx_nvme *nv, struct nvq *q)
{
	pthread_mutex_lock(&nv->lock);
	q->busy = false;
	pthread_cond_broadcast(&nv->cond);
	pthread_mutex_unlock(&nv->lock);
}

/* ------------------------------------------------------------------------ */
/* The pump                                                                 */
/* ------------------------------------------------------------------------ */

struct pump {
	phx_nvme *nv;
	struct nvq *q;
	/* Fill the next command for slot @slot; 0 when none is left. */
	int (*next)(struct pump *p, uint32_t slot, struct nvme_uring_cmd *c,
		    struct cmdinfo *ci);
	/* One completion: res 0, -errno, or an NVMe status (> 0). */
	void (*done)(struct pump *p, struct cmdinfo *ci, int res);
	void *ctx;
	int first_err;
};

static bool namespace_gone(phx_nvme *nv)
{
	char p[300];

	if (access(nv->path, F_OK))
		return true;
	if (nv->info.block_device[0]) {
		snprintf(p, sizeof(p), "/sys/block/%s", nv->info.block_device);
		if (access(p, F_OK))
			return true;
	}
	return false;
}

static const char *op_name(uint8_t op)
{
	switch (op) {
	case NVME_OP_READ: return "Read";
	case NVME_OP_WRITE: return "Write";
	case NVME_OP_DSM: return "Dataset Management (deallocate)";
	case NVME_OP_WRITE_ZEROES: return "Write Zeroes";
	case NVME_OP_FLUSH: return "Flush";
	default: return "command";
	}
}

/*
 * The error of a failed command, with the text set for this thread.
 * Returns the -errno the caller should see.
 */
static int cmd_error(phx_nvme *nv, const struct cmdinfo *ci, int res)
{
	ST_ADD(nv, errors, 1);
	if (res > 0)
		return phx_err(nvme_status_errno(res),
			       "%s: NVMe %s of %u blocks at LBA %llu rejected by the controller: "
			       "NVMe status 0x%03x (%s)%s", nv->path, op_name(ci->opcode), ci->nlb,
			       (unsigned long long)ci->slba, res & 0x7ff, phx_nvme_status_str(res),
			       res & 0x4000 ? ", do not retry" : "");
	if (namespace_gone(nv))
		return phx_err(-ENODEV,
			       "%s: NVMe %s at LBA %llu failed (%s): the namespace has disappeared "
			       "(device removed or controller failed)", nv->path,
			       op_name(ci->opcode), (unsigned long long)ci->slba, strerror(-res));
	return phx_err(res, "%s: NVMe %s of %u blocks at LBA %llu failed in the kernel",
		       nv->path, op_name(ci->opcode), ci->nlb, (unsigned long long)ci->slba);
}

/* The next command into *c / *ci, with a slot taken from the free list. */
static bool pump_prepare(struct pump *p, uint32_t *freel, uint32_t *nfree,
			 struct nvme_uring_cmd *c, struct cmdinfo *ci, uint32_t *slot)
{
	*slot = freel[*nfree - 1];
	memset(c, 0, sizeof(*c));
	memset(ci, 0, sizeof(*ci));
	ci->buf_index = -1;
	if (!p->next(p, *slot, c, ci))
		return false;
	(*nfree)--;
	return true;
}

/*
 * Keep up to queue_depth commands in flight until the generator has no more
 * and all have completed.  One command is always prepared ahead (it holds
 * slot queue_depth + 1), so the pump knows when the last one has gone out.
 */
static int pump_run(struct pump *p)
{
	phx_nvme *nv = p->nv;
	struct io_uring *ring = &p->q->ring;
	uint32_t qd = nv->info.queue_depth, inflight = 0, nfree = qd + 1, i, slot;
	struct nvme_uring_cmd c;
	struct cmdinfo ci, *slots;
	uint32_t *freel;
	bool have;
	int ret, fails = 0;

	slots = calloc(qd + 1, sizeof(*slots));
	freel = calloc(qd + 1, sizeof(*freel));
	if (!slots || !freel) {
		free(slots);
		free(freel);
		return phx_err(-ENOMEM, "out of memory");
	}
	for (i = 0; i <= qd; i++)
		freel[i] = qd - i;

	have = pump_prepare(p, freel, &nfree, &c, &ci, &slot);
	while (have || inflight) {
		while (have && inflight < qd) {
			struct io_uring_sqe *sqe = io_uring_get_sqe(ring);

			if (!sqe)	/* cannot happen: the ring has qd entries */
				abort();
			memset(sqe, 0, 2 * sizeof(*sqe));
			sqe->opcode = IORING_OP_URING_CMD;
			sqe->fd = nv->fd;
			sqe->cmd_op = NVME_URING_CMD_IO;
			sqe->user_data = slot;
			if (ci.buf_index >= 0) {
				sqe->uring_cmd_flags = IORING_URING_CMD_FIXED;
				sqe->buf_index = (uint16_t)ci.buf_index;
				ST_ADD(nv, fixed_commands, 1);
			}
			c.nsid = nv->info.nsid;
			ci.opcode = c.opcode;
			memcpy(sqe->cmd, &c, sizeof(c));
			slots[slot] = ci;
			inflight++;
			ST_ADD(nv, commands, 1);
			have = pump_prepare(p, freel, &nfree, &c, &ci, &slot);
		}
		if (!inflight)
			break;
		st_max(nv, inflight);
		/*
		 * While commands are left, wake at the first completion to
		 * refill its slot; once all are in flight, sleep until the last
		 * one is done (one system call instead of one per command).
		 */
		ret = io_uring_submit_and_wait(ring, have ? 1 : inflight);
		ST_ADD(nv, submits, 1);
		if (ret < 0 && ret != -EINTR && ret != -EAGAIN && ret != -EBUSY &&
		    ret != -ETIME) {
			if (++fails < 100)
				continue;
			/* The ring is unusable; commands may be stuck in it. */
			p->q->broken = true;
			ret = phx_err(ret, "%s: io_uring_enter keeps failing", nv->path);
			free(slots);
			free(freel);
			return ret;
		}
		fails = 0;
		for (;;) {
			struct io_uring_cqe *cqe;
			uint32_t done;
			int res;

			if (io_uring_peek_cqe(ring, &cqe) || !cqe)
				break;
			done = (uint32_t)cqe->user_data;
			res = cqe->res;
			io_uring_cqe_seen(ring, cqe);
			if (done > qd)
				continue;
			inflight--;
			freel[nfree++] = done;
			p->done(p, &slots[done], res);
		}
	}
	free(slots);
	free(freel);
	return 0;
}

/* ------------------------------------------------------------------------ */
/* Open / close                                                             */
/* ------------------------------------------------------------------------ */

static void nvme_free(phx_nvme *nv)
{
	uint32_t i;

	for (i = 0; nv->q && i < nv->nq; i++)
		if (nv->q[i].ready)
			io_uring_queue_exit(&nv->q[i].ring);
	free(nv->q);
	if (nv->fd >= 0)
		close(nv->fd);
	if (nv->claim_fd >= 0)
		close(nv->claim_fd);
	free(nv->scratch);
	pthread_cond_destroy(&nv->cond);
	pthread_mutex_destroy(&nv->lock);
	free(nv);
}

/* A 1-block read of the first claimed LBA into the scratch buffer. */
static int probe_read(phx_nvme *nv, struct nvq *q, bool fixed);

static int nvme_open(const char *path, const struct phx_nvme_config *ucfg,
		     phx_nvme **out)
{
	struct phx_nvme_config cfg;
	struct stat st;
	phx_nvme *nv;
	uint32_t i;
	int ret;

	if (!path || !out)
		return phx_err(-EINVAL, "phx_nvme_open: NULL argument");
	*out = NULL;
	phx_nvme_config_init(&cfg);
	ret = phx_env_check();
	if (ret)
		return ret;
	if (ucfg) {
		size_t n = ucfg->size && ucfg->size < sizeof(cfg) ? ucfg->size : sizeof(cfg);

		memcpy(&cfg, ucfg, n);
		cfg.size = sizeof(cfg);
		if (!cfg.queue_depth)
			cfg.queue_depth = NV_DEFAULT_QD;
		if (!cfg.nr_queues)
			cfg.nr_queues = NV_DEFAULT_QUEUES;
	}
	if (cfg.queue_depth > 4096)
		return phx_err(-EINVAL, "queue_depth %u is outside 1..4096", cfg.queue_depth);
	if (cfg.nr_queues > 64)
		return phx_err(-EINVAL, "nr_queues %u is outside 1..64", cfg.nr_queues);

	nv = calloc(1, sizeof(*nv));
	if (!nv)
		return phx_err(-ENOMEM, "out of memory");
	nv->fd = -1;
	nv->claim_fd = -1;
	pthread_mutex_init(&nv->lock, NULL);
	pthread_cond_init(&nv->cond, NULL);
	snprintf(nv->path, sizeof(nv->path), "%s", path);
	nv->flags = cfg.flags;

	nv->fd = open(path, ((cfg.flags & PHX_NVME_READONLY) ? O_RDONLY : O_RDWR) | O_CLOEXEC);
	if (nv->fd < 0) {
		ret = phx_err(-errno, "%s", path);
		goto fail;
	}
	ret = identify_fd(nv->fd, path, &nv->info);
	if (ret)
		goto fail;
	/* io_uring passthrough (uring_cmd) exists on the char device only */
	if (!fstat(nv->fd, &st) && S_ISBLK(st.st_mode)) {
		ret = phx_err(-ENOTTY, "%s is a block device (%s): passthrough needs the "
			      "namespace's generic char device (/dev/ngXnY)", path,
			      nv->info.block_device);
		goto fail;
	}
	if (nv->info.metadata_size) {
		ret = phx_err(-EOPNOTSUPP,
			      "%s: the in-use LBA format has %u bytes of metadata per block "
			      "(not supported: reformat with a metadata-free LBA format)",
			      path, nv->info.metadata_size);
		goto fail;
	}
	/* the claimed range */
	nv->lo = cfg.first_lba;
	if (!(cfg.flags & PHX_NVME_TEST_NO_CAPACITY_CHECK) && nv->lo >= nv->info.nr_lbas) {
		ret = phx_err(-ERANGE, "%s: first LBA %llu is past the namespace's %llu LBAs",
			      path, (unsigned long long)nv->lo,
			      (unsigned long long)nv->info.nr_lbas);
		goto fail;
	}
	nv->hi = cfg.nr_lbas ? nv->lo + cfg.nr_lbas : nv->info.nr_lbas;
	if (nv->hi <= nv->lo ||
	    (!(cfg.flags & PHX_NVME_TEST_NO_CAPACITY_CHECK) && nv->hi > nv->info.nr_lbas)) {
		ret = phx_err(-ERANGE, "%s: LBAs [%llu, %llu) are not inside the namespace's "
			      "[0, %llu)", path, (unsigned long long)nv->lo,
			      (unsigned long long)nv->hi, (unsigned long long)nv->info.nr_lbas);
		goto fail;
	}
	nv->info.first_lba = nv->lo;
	nv->info.claimed_lbas = nv->hi - nv->lo;
	nv->info.queue_depth = cfg.queue_depth;
	nv->info.nr_queues = cfg.nr_queues;
	if (cfg.max_transfer) {
		uint32_t m = cfg.max_transfer / nv->info.lba_size * nv->info.lba_size;

		if (!m) {
			ret = phx_err(-EINVAL, "max_transfer %u is smaller than the LBA size %u",
				      cfg.max_transfer, nv->info.lba_size);
			goto fail;
		}
		if (m < nv->info.max_transfer)
			nv->info.max_transfer = m;
	}
	/* A buffer not page aligned spans one page more per command. */
	nv->max_unaligned = nv->info.max_transfer;
	if (nv->info.max_segments > 1 &&
	    (uint64_t)(nv->info.max_segments - 1) * 4096 < nv->max_unaligned)
		nv->max_unaligned = (nv->info.max_segments - 1) * 4096 / nv->info.lba_size *
				    nv->info.lba_size;
	if (!nv->max_unaligned)
		nv->max_unaligned = nv->info.lba_size;

	/* Unless forced, every doubt about the namespace refuses (nvme_safety.c). */
	if (!(cfg.flags & PHX_NVME_FORCE)) {
		ret = nvme_safety_check(nv->fd, nv->info.nsid, path, &nv->claim_fd);
		if (ret)
			goto fail;
		if (nv->claim_fd >= 0)
			nv->info.features |= PHX_NVME_FEAT_EXCLUSIVE;
	}

	if (posix_memalign((void **)&nv->scratch, 4096,
			   nv->info.lba_size > 4096 ? nv->info.lba_size : 4096)) {
		ret = phx_err(-ENOMEM, "out of memory");
		goto fail;
	}
	nv->nq = cfg.nr_queues;
	nv->q = calloc(nv->nq, sizeof(*nv->q));
	if (!nv->q) {
		ret = phx_err(-ENOMEM, "out of memory");
		goto fail;
	}
	nv->fixed_table = !(cfg.flags & PHX_NVME_NO_FIXED_BUFS);
	for (i = 0; i < nv->nq; i++) {
		ret = queue_setup(nv, &nv->q[i]);
		if (ret)
			goto fail;
		if (nv->fixed_table) {
			struct iovec iov = { nv->scratch, nv->info.lba_size };

			if (io_uring_register_buffers_sparse(&nv->q[i].ring,
							     NV_BUF_SLOTS + 1) < 0 ||
			    io_uring_register_buffers_update_tag(&nv->q[i].ring, 0, &iov,
								 NULL, 1) < 0)
				nv->fixed_table = false;
		}
	}
	/* Passthrough works at all?  Then: do fixed uring_cmds work? */
	ret = probe_read(nv, &nv->q[0], false);
	if (ret) {
		phx_err(ret, "%s: NVMe Read passthrough through io_uring failed (%s); the "
			"kernel needs IORING_OP_URING_CMD for NVMe (5.19+)", path,
			strerror(-ret));
		goto fail;
	}
	if (nv->fixed_table && probe_read(nv, &nv->q[0], true) == 0) {
		nv->fixed_ok = true;
		nv->info.features |= PHX_NVME_FEAT_FIXED_BUFS;
	}
	memset(&nv->st, 0, sizeof(nv->st));
	*out = nv;
	return 0;
fail:
	nvme_free(nv);
	return ret;
}

PHX_EXPORT int phx_nvme_open(const char *path, const struct phx_nvme_config *cfg,
			     phx_nvme **out)
{
	int saved = errno, ret = nvme_open(path, cfg, out);

	errno = saved;
	return ret;
}

PHX_EXPORT int phx_nvme_close(phx_nvme *nv)
{
	uint32_t i;

	if (!nv)
		return 0;
	pthread_mutex_lock(&nv->lock);
	for (i = 0; i < nv->nq; i++) {
		if (nv->q[i].busy) {
			pthread_mutex_unlock(&nv->lock);
			return phx_err(-EBUSY, "%s: close while a call is running on it",
				       nv->path);
		}
	}
	pthread_mutex_unlock(&nv->lock);
	nvme_free(nv);
	return 0;
}

PHX_EXPORT int phx_nvme_get_info(const phx_nvme *nv, struct phx_nvme_info *info)
{
	if (!nv || !info)
		return phx_err(-EINVAL, "phx_nvme_get_info: NULL argument");
	*info = nv->info;
	return 0;
}

/* ------------------------------------------------------------------------ */
/* Registered buffers                                                       */
/* ------------------------------------------------------------------------ */

PHX_EXPORT int phx_nvme_buf_register(phx_nvme *nv, void *addr, size_t len)
{
	struct iovec iov = { addr, len };
	uint32_t i, slot = NV_BUF_SLOTS;
	int ret = 0;

	if (!nv || !addr || !len)
		return phx_err(-EINVAL, "phx_nvme_buf_register: bad argument");
	if (!nv->fixed_table)
		return phx_err(-EOPNOTSUPP, "%s: registered buffers are not available on this "
			       "handle (kernel or PHX_NVME_NO_FIXED_BUFS)", nv->path);
	pthread_mutex_lock(&nv->lock);
	for (i = 0; i < NV_BUF_SLOTS; i++) {
		if (nv->bufs[i].len && nv->bufs[i].addr == addr) {
			ret = phx_err(-EEXIST, "buffer %p is already registered", addr);
			goto out;
		}
		if (!nv->bufs[i].len && slot == NV_BUF_SLOTS)
			slot = i;
	}
	if (slot == NV_BUF_SLOTS) {
		ret = phx_err(-ENOSPC, "%s: %u buffers already registered", nv->path,
			      NV_BUF_SLOTS);
		goto out;
	}
	for (i = 0; i < nv->nq; i++) {
		ret = io_uring_register_buffers_update_tag(&nv->q[i].ring, slot + 1, &iov,
							   NULL, 1);
		if (ret < 0) {
			struct iovec none = { NULL, 0 };
			uint32_t j;

			for (j = 0; j < i; j++)
				io_uring_register_buffers_update_tag(&nv->q[j].ring, slot + 1,
								     &none, NULL, 1);
			ret = phx_err(ret, "registering %zu bytes at %p (RLIMIT_MEMLOCK?)", len,
				      addr);
			goto out;
		}
	}
	nv->bufs[slot].addr = addr;
	nv->bufs[slot].len = len;
	ret = 0;
out:
	pthread_mutex_unlock(&nv->lock);
	return ret;
}

PHX_EXPORT int phx_nvme_buf_deregister(phx_nvme *nv, void *addr)
{
	struct iovec none = { NULL, 0 };
	uint32_t i, j;

	if (!nv)
		return phx_err(-EINVAL, "phx_nvme_buf_deregister: NULL handle");
	pthread_mutex_lock(&nv->lock);
	for (i = 0; i < NV_BUF_SLOTS; i++) {
		if (!nv->bufs[i].len || nv->bufs[i].addr != addr)
			continue;
		/* The kernel keeps the pages of commands in flight alive. */
		for (j = 0; j < nv->nq; j++)
			io_uring_register_buffers_update_tag(&nv->q[j].ring, i + 1, &none,
							     NULL, 1);
		nv->bufs[i].len = 0;
		nv->bufs[i].addr = NULL;
		pthread_mutex_unlock(&nv->lock);
		return 0;
	}
	pthread_mutex_unlock(&nv->lock);
	return phx_err(-ENOENT, "buffer %p is not registered", addr);
}

/* Fixed slot holding [buf, buf + len), or -1. */
static int buf_lookup(phx_nvme *nv, const void *buf, uint64_t len)
{
	const char *b = buf;
	int idx = -1;
	uint32_t i;

	if (!nv->fixed_ok)
		return -1;
	pthread_mutex_lock(&nv->lock);
	for (i = 0; i < NV_BUF_SLOTS; i++) {
		if (nv->bufs[i].len && b >= nv->bufs[i].addr &&
		    b + len <= nv->bufs[i].addr + nv->bufs[i].len) {
			idx = (int)i + 1;
			break;
		}
	}
	pthread_mutex_unlock(&nv->lock);
	return idx;
}

/* ------------------------------------------------------------------------ */
/* Reads and writes                                                         */
/* ------------------------------------------------------------------------ */

struct rw_ctx {
	struct phx_nvme_io *ios;
	size_t n, cur;
	uint64_t cursor;	/* bytes of ios[cur] already cut */
	uint64_t *done;		/* bytes completed, per request */
	int *bufidx;		/* fixed slot, per request */
	uint32_t *chunk;	/* bytes per command, per request */
};

static int rw_next(struct pump *p, uint32_t slot, struct nvme_uring_cmd *c,
		   struct cmdinfo *ci)
{
	struct rw_ctx *x = p->ctx;
	phx_nvme *nv = p->nv;
	struct phx_nvme_io *io;
	uint64_t n, slba;

	for (;;) {
		if (x->cur >= x->n)
			return 0;
		io = &x->ios[x->cur];
		if (io->result >= 0 && x->cursor < io->len)
			break;
		x->cur++;
		x->cursor = 0;
	}
	n = io->len - x->cursor;
	if (n > x->chunk[x->cur])
		n = x->chunk[x->cur];
	slba = (io->offset + x->cursor) / nv->info.lba_size;
	c->opcode = io->op == PHX_NVME_WRITE ? NVME_OP_WRITE : NVME_OP_READ;
	c->addr = (uintptr_t)((char *)io->buf + x->cursor);
	c->data_len = (uint32_t)n;
	c->cdw10 = (uint32_t)slba;
	c->cdw11 = (uint32_t)(slba >> 32);
	c->cdw12 = (uint32_t)(n / nv->info.lba_size - 1);
	ci->job = (uint32_t)x->cur;
	ci->bytes = (uint32_t)n;
	ci->slba = slba;
	ci->nlb = (uint32_t)(n / nv->info.lba_size);
	ci->buf_index = x->bufidx[x->cur];
	io->commands++;
	x->cursor += n;
	return 1;
}

static void rw_done(struct pump *p, struct cmdinfo *ci, int res)
{
	struct rw_ctx *x = p->ctx;
	struct phx_nvme_io *io = &x->ios[ci->job];
	int err;

	if (res == 0) {
		x->done[ci->job] += ci->bytes;
		return;
	}
	if (io->result < 0)
		return;		/* already failed: keep the first error */
	err = cmd_error(p->nv, ci, res);
	io->result = err;
	io->status = res > 0 ? (uint32_t)res & 0x7ff : 0;
	if (!p->first_err)
		p->first_err = err;
}

static int check_range(phx_nvme *nv, uint64_t offset, uint64_t len, const char *what)
{
	uint32_t ls = nv->info.lba_size;
	uint64_t slba, nlb;

	if (offset % ls || len % ls)
		return phx_err(-EINVAL, "%s: %s of %llu bytes at byte %llu: offset and length "
			       "must be multiples of the LBA size %u", nv->path, what,
			       (unsigned long long)len, (unsigned long long)offset, ls);
	slba = offset / ls;
	nlb = len / ls;
	if (slba < nv->lo || slba > nv->hi || nlb > nv->hi - slba)
		return phx_err(-ERANGE, "%s: %s of LBAs [%llu, %llu) is outside the claimed "
			       "range [%llu, %llu)", nv->path, what, (unsigned long long)slba,
			       (unsigned long long)(slba + nlb), (unsigned long long)nv->lo,
			       (unsigned long long)nv->hi);
	return 0;
}

static int submit_wait(phx_nvme *nv, struct phx_nvme_io *ios, size_t n)
{
	struct rw_ctx x;
	struct pump p;
	struct nvq *q;
	size_t i;
	int ret;

	if (!nv || (!ios && n))
		return phx_err(-EINVAL, "phx_nvme_submit_wait: NULL argument");
	for (i = 0; i < n; i++) {
		if (ios[i].op != PHX_NVME_READ && ios[i].op != PHX_NVME_WRITE)
			return phx_err(-EINVAL, "request %zu: unknown op %u", i, ios[i].op);
		if (ios[i].op == PHX_NVME_WRITE && (nv->flags & PHX_NVME_READONLY))
			return phx_err(-EBADF, "%s: opened read-only", nv->path);
		if (!ios[i].buf && ios[i].len)
			return phx_err(-EFAULT, "request %zu: NULL buffer", i);
		ret = check_range(nv, ios[i].offset, ios[i].len,
				  ios[i].op == PHX_NVME_WRITE ? "write" : "read");
		if (ret)
			return ret;
	}
	memset(&x, 0, sizeof(x));
	x.ios = ios;
	x.n = n;
	x.done = calloc(n + 1, sizeof(*x.done));
	x.bufidx = calloc(n + 1, sizeof(*x.bufidx));
	x.chunk = calloc(n + 1, sizeof(*x.chunk));
	if (!x.done || !x.bufidx || !x.chunk) {
		ret = phx_err(-ENOMEM, "out of memory");
		goto out;
	}
	for (i = 0; i < n; i++) {
		ios[i].result = 0;
		ios[i].status = 0;
		ios[i].commands = 0;
		x.bufidx[i] = ios[i].len ? buf_lookup(nv, ios[i].buf, ios[i].len) : -1;
		x.chunk[i] = ((uintptr_t)ios[i].buf % 4096) ? nv->max_unaligned :
			     nv->info.max_transfer;
	}
	q = queue_get(nv);
	if (!q) {
		ret = -EIO;
		goto out;
	}
	memset(&p, 0, sizeof(p));
	p.nv = nv;
	p.q = q;
	p.next = rw_next;
	p.done = rw_done;
	p.ctx = &x;
	ret = pump_run(&p);
	queue_put(nv, q);
	for (i = 0; i < n; i++) {
		if (ret < 0 && ios[i].result >= 0)
			ios[i].result = ret;
		if (ios[i].result < 0)
			continue;
		ios[i].result = (int64_t)x.done[i];
		if (ios[i].op == PHX_NVME_WRITE) {
			ST_ADD(nv, writes, 1);
			ST_ADD(nv, bytes_written, x.done[i]);
		} else {
			ST_ADD(nv, reads, 1);
			ST_ADD(nv, bytes_read, x.done[i]);
		}
	}
	ret = ret < 0 ? ret : 0;
out:
	free(x.done);
	free(x.bufidx);
	free(x.chunk);
	return ret;
}

PHX_EXPORT int phx_nvme_submit_wait(phx_nvme *nv, struct phx_nvme_io *ios, size_t n)
{
	int saved = errno, ret = submit_wait(nv, ios, n);

	errno = saved;
	return ret;
}

static int64_t rw1(phx_nvme *nv, uint32_t op, void *buf, uint64_t len, uint64_t offset)
{
	struct phx_nvme_io io;
	int ret;

	memset(&io, 0, sizeof(io));
	io.op = op;
	io.buf = buf;
	io.len = len;
	io.offset = offset;
	ret = phx_nvme_submit_wait(nv, &io, 1);
	return ret < 0 ? ret : io.result;
}

PHX_EXPORT int64_t phx_nvme_read(phx_nvme *nv, void *buf, uint64_t len, uint64_t offset)
{
	return rw1(nv, PHX_NVME_READ, buf, len, offset);
}

PHX_EXPORT int64_t phx_nvme_write(phx_nvme *nv, const void *buf, uint64_t len,
				  uint64_t offset)
{
	return rw1(nv, PHX_NVME_WRITE, (void *)buf, len, offset);
}

static int probe_read(phx_nvme *nv, struct nvq *q, bool fixed)
{
	struct phx_nvme_io io;
	struct rw_ctx x;
	struct pump p;
	uint64_t done = 0;
	int bufidx = fixed ? 0 : -1;
	uint32_t chunk = nv->info.lba_size;

	memset(&io, 0, sizeof(io));
	io.op = PHX_NVME_READ;
	io.buf = nv->scratch;
	io.len = nv->info.lba_size;
	io.offset = nv->lo * nv->info.lba_size;
	memset(&x, 0, sizeof(x));
	x.ios = &io;
	x.n = 1;
	x.done = &done;
	x.bufidx = &bufidx;
	x.chunk = &chunk;
	memset(&p, 0, sizeof(p));
	p.nv = nv;
	p.q = q;
	p.next = rw_next;
	p.done = rw_done;
	p.ctx = &x;
	if (pump_run(&p) < 0)
		return -EIO;
	return io.result < 0 ? (int)io.result : 0;
}

/* ------------------------------------------------------------------------ */
/* Deallocate, Write Zeroes, Flush                                          */
/* ------------------------------------------------------------------------ */

struct range_ctx {
	uint64_t next, end;	/* LBAs still to cover */
	uint8_t opcode;		/* DSM, Write Zeroes or Flush */
	bool deac;		/* Write Zeroes: ask to deallocate */
	bool flushed;
	char *ranges;		/* DSM: one 4 KiB range list per slot (qd + 1) */
	uint32_t status;
};

static int range_next(struct pump *p, uint32_t slot, struct nvme_uring_cmd *c,
		      struct cmdinfo *ci)
{
	struct range_ctx *x = p->ctx;
	uint32_t nr = 0;

	if (x->opcode == NVME_OP_FLUSH) {
		if (x->flushed)
			return 0;
		x->flushed = true;
		c->opcode = NVME_OP_FLUSH;
		return 1;
	}
	if (p->first_err || x->next >= x->end)
		return 0;
	ci->slba = x->next;
	if (x->opcode == NVME_OP_DSM) {
		uint8_t *r = (uint8_t *)x->ranges + (size_t)slot * 4096;

		memset(r, 0, 4096);
		while (nr < NV_DSM_RANGES && x->next < x->end) {
			uint64_t nlb = x->end - x->next;
			uint32_t n32;
			uint8_t *e = r + 16 * nr;

			if (nlb > NV_DSM_RANGE_BLOCKS)
				nlb = NV_DSM_RANGE_BLOCKS;
			n32 = (uint32_t)nlb;
			/* context attributes 0, length in LBAs, starting LBA (LE) */
			memcpy(e + 4, &n32, 4);
			memcpy(e + 8, &x->next, 8);
			x->next += nlb;
			ci->nlb += n32;
			nr++;
		}
		c->opcode = NVME_OP_DSM;
		c->addr = (uintptr_t)r;
		c->data_len = 16 * nr;
		c->cdw10 = nr - 1;
		c->cdw11 = 1u << 2;	/* AD: attribute deallocate */
		return 1;
	}
	ci->nlb = x->end - x->next > NV_WZ_BLOCKS ? NV_WZ_BLOCKS : (uint32_t)(x->end - x->next);
	c->opcode = NVME_OP_WRITE_ZEROES;
	c->cdw10 = (uint32_t)x->next;
	c->cdw11 = (uint32_t)(x->next >> 32);
	c->cdw12 = (ci->nlb - 1) | (x->deac ? 1u << 25 : 0);
	x->next += ci->nlb;
	return 1;
}

static void range_done(struct pump *p, struct cmdinfo *ci, int res)
{
	struct range_ctx *x = p->ctx;

	if (ci->opcode == NVME_OP_DSM)
		ST_ADD(p->nv, dsm_commands, 1);
	else if (ci->opcode == NVME_OP_WRITE_ZEROES)
		ST_ADD(p->nv, write_zeroes_commands, 1);
	if (res == 0 || p->first_err)
		return;
	x->status = res > 0 ? (uint32_t)res & 0x7ff : 0;
	p->first_err = cmd_error(p->nv, ci, res);
}

static int run_range(phx_nvme *nv, uint8_t opcode, bool deac, uint64_t slba,
		     uint64_t nlb, uint32_t *status)
{
	struct range_ctx x;
	struct pump p;
	struct nvq *q;
	int ret;

	memset(&x, 0, sizeof(x));
	x.next = slba;
	x.end = slba + nlb;
	x.opcode = opcode;
	x.deac = deac;
	if (opcode == NVME_OP_DSM &&
	    posix_memalign((void **)&x.ranges, 4096, ((size_t)nv->info.queue_depth + 1) * 4096))
		return phx_err(-ENOMEM, "out of memory");
	q = queue_get(nv);
	if (!q) {
		free(x.ranges);
		return -EIO;
	}
	memset(&p, 0, sizeof(p));
	p.nv = nv;
	p.q = q;
	p.next = range_next;
	p.done = range_done;
	p.ctx = &x;
	ret = pump_run(&p);
	queue_put(nv, q);
	free(x.ranges);
	*status = x.status;
	if (ret < 0)
		return ret;
	return p.first_err;
}

static int range_args(phx_nvme *nv, uint64_t offset, uint64_t len, const char *what)
{
	if (!nv)
		return phx_err(-EINVAL, "%s: NULL handle", what);
	if (nv->flags & PHX_NVME_READONLY)
		return phx_err(-EBADF, "%s: opened read-only", nv->path);
	return check_range(nv, offset, len, what);
}

static int write_zeroes(phx_nvme *nv, uint64_t offset, uint64_t len, bool deac)
{
	uint32_t status;

	if (!(nv->info.oncs & (1u << 3)))
		return phx_err(-EOPNOTSUPP, "%s: the controller supports neither Dataset "
			       "Management nor Write Zeroes (ONCS 0x%x)", nv->path,
			       nv->info.oncs);
	return run_range(nv, NVME_OP_WRITE_ZEROES, deac, offset / nv->info.lba_size,
			 len / nv->info.lba_size, &status);
}

static int deallocate(phx_nvme *nv, uint64_t offset, uint64_t len)
{
	uint32_t status = 0;
	int ret;

	ret = range_args(nv, offset, len, "deallocate");
	if (ret || !len)
		return ret;
	if ((nv->info.oncs & (1u << 2)) && !(nv->flags & PHX_NVME_NO_DSM) &&
	    !__atomic_load_n(&nv->dsm_broken, __ATOMIC_RELAXED)) {
		ret = run_range(nv, NVME_OP_DSM, false, offset / nv->info.lba_size,
				len / nv->info.lba_size, &status);
		if (ret != -EOPNOTSUPP && !(ret == -EINVAL && status == 0x002))
			goto done;
		/* advertised but refused: use Write Zeroes from now on */
		__atomic_store_n(&nv->dsm_broken, true, __ATOMIC_RELAXED);
	}
	ret = write_zeroes(nv, offset, len, nv->info.dlfeat & (1u << 3));
done:
	if (!ret)
		ST_ADD(nv, deallocated_bytes, len);
	return ret;
}

PHX_EXPORT int phx_nvme_deallocate(phx_nvme *nv, uint64_t offset, uint64_t len)
{
	int saved = errno, ret = deallocate(nv, offset, len);

	errno = saved;
	return ret;
}

PHX_EXPORT int phx_nvme_write_zeroes(phx_nvme *nv, uint64_t offset, uint64_t len)
{
	int saved = errno, ret = range_args(nv, offset, len, "write zeroes");

	if (!ret && len)
		ret = write_zeroes(nv, offset, len, false);
	errno = saved;
	return ret;
}

PHX_EXPORT int phx_nvme_flush(phx_nvme *nv)
{
	uint32_t status;
	int saved = errno, ret;

	if (!nv)
		return phx_err(-EINVAL, "phx_nvme_flush: NULL handle");
	ret = run_range(nv, NVME_OP_FLUSH, false, 0, 0, &status);
	errno = saved;
	return ret;
}

/* ------------------------------------------------------------------------ */
/* Counters                                                                 */
/* ------------------------------------------------------------------------ */

PHX_EXPORT void phx_nvme_stats(phx_nvme *nv, struct phx_nvme_stats *st)
{
	uint64_t *dst = (uint64_t *)st, *src = (uint64_t *)&nv->st;
	size_t i;

	for (i = 0; i < sizeof(*st) / sizeof(uint64_t); i++)
		dst[i] = __atomic_load_n(&src[i], __ATOMIC_RELAXED);
}

PHX_EXPORT void phx_nvme_stats_reset(phx_nvme *nv)
{
	uint64_t *p = (uint64_t *)&nv->st;
	size_t i;

	for (i = 0; i < sizeof(nv->st) / sizeof(uint64_t); i++)
		__atomic_store_n(&p[i], 0, __ATOMIC_RELAXED);
}
