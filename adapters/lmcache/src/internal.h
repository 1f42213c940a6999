/* SPDX-License-Identifier: Apache-2.0 */
/*
 * internal.h - the state libphxfile shares between its files.
 *
 * The frozen ABI has no context argument, so the library has exactly one
 * driver object per process (struct pf_driver, defined in driver.c and
 * reached through pf_drv()).
 *
 * Two locks, taken in this order:
 *   setup  serialises open/close, context creation and (de)registration;
 *          CUDA and libphx calls may be made under it.
 *   lock   guards the registries, counters and in-flight counts for short
 *          moments; no CUDA call is ever made under it, because the
 *          completions that end transfers take it on libphx's poller thread
 *          or CUDA's callback thread (a CUDA call that waits for the
 *          streams would deadlock there).
 * Registries change only with both held, so either one is enough to read.
 */
#ifndef PHXFILE_INTERNAL_H
#define PHXFILE_INTERNAL_H

#include <limits.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdint.h>

#include "phx.h"
#include "phx_cuda.h"
#include "phxfile.h"

#define PF_EXPORT __attribute__((visibility("default")))
#define PF_MAX_DEVICES 64
#define PF_MAX_LOGGED 256	/* kinds of failure (call, errno, file) logged */

/* ---- libcuda entry points the adapter calls itself (cuhook.c) ---------- */

typedef void (*pf_hostfn)(void *arg);

struct pf_cuda {
	void *lib;
	int (*DeviceGet)(int *dev, int ordinal);
	int (*PrimaryCtxRetain)(void **ctx, int dev);
	int (*PrimaryCtxRelease)(int dev);
	int (*CtxPush)(void *ctx);
	int (*CtxPop)(void **ctx);
	int (*LaunchHostFunc)(void *stream, pf_hostfn fn, void *arg);
	int (*StreamSynchronize)(void *stream);
	int (*GetErrorString)(int res, const char **s);
	void *ctx[PF_MAX_DEVICES];	/* retained primary contexts */
	bool fake;			/* tests/gpu_fake's stand-in driver */
};

int pf_cuda_load(struct pf_cuda *cu);
void pf_cuda_unload(struct pf_cuda *cu);
int pf_cuda_retain(struct pf_cuda *cu, int dev);
int pf_cuda_launch(struct pf_cuda *cu, int dev, void *stream, pf_hostfn fn, void *arg);
int pf_cuda_sync(struct pf_cuda *cu, int dev, void *stream);

/* ---- registries --------------------------------------------------------- */

struct pf_buf {
	uint64_t base;
	uint64_t len;
	int dev;
	phx_devmem *map;	/* direct path: the /dev/phx mapping, or NULL */
	char *host;		/* host address of base through the mapping */
	uint64_t inflight;
};

#define PF_HANDLE_MAGIC 0x70686678u	/* "phfx" */

struct pf_handle {
	uint32_t magic;
	int fd;			/* our duplicate of the caller's fd */
	phx_file *f;
	uint64_t inflight;
	uint64_t ctx_registered;	/* bit per device: phx_cuda_file_register */
	struct pf_handle *next;
	char path[PATH_MAX];
};

struct pf_logged {		/* a kind of failure (failures.c) */
	int err;
	char what[160];
	char path[PATH_MAX];
	uint64_t count;		/* failures of the kind */
	uint64_t reported;	/* of them, in a log line already */
	int64_t last_ns;	/* that line's time (CLOCK_MONOTONIC) */
};

struct pf_driver {
	pthread_mutex_t setup;
	pthread_mutex_t lock;
	pthread_cond_t idle;		/* an in-flight count fell */
	unsigned int opens;		/* explicit opens not yet closed */
	bool implicit;			/* opened by a registration */
	bool live;
	uint32_t path;			/* enum phxfile_path */
	bool identity_map;		/* test hook: fake "device" memory is host memory */
	phx_engine *eng;
	phx_cuda *ctx[PF_MAX_DEVICES];
	int ctx_err[PF_MAX_DEVICES];	/* a device refused at start-up: its -errno */
	struct pf_cuda cuda;
	struct pf_buf **bufs;		/* sorted by base */
	size_t nbufs, capbufs;
	struct pf_handle *handles;
	struct pf_logged logged[PF_MAX_LOGGED];
	size_t nlogged;
	bool log_overflow;
	bool nodev_logged;
	bool direct_used;		/* the direct path ran: early reads off (atomic) */
	struct phxfile_stats st;
};


struct pf_driver *pf_drv(void);
/* Publish phxFileGetStats for `phx top` (once; no setup lock held). */
void pf_publish(void);

/* driver.c */
int pf_get_setup(struct pf_driver *d);	/* setup held: open implicitly if needed */
int pf_ctx_get(struct pf_driver *d, int dev, phx_cuda **out);	/* no lock held */
int pf_ctx_get_setup(struct pf_driver *d, int dev, phx_cuda **out);	/* setup held */

/* buffers.c (either lock held) */
struct pf_buf *pf_buf_find_locked(struct pf_driver *d, uint64_t addr);
/* handles.c (lock held): a buffer's transfers done, or -EBUSY after a bound */
int pf_wait_buf_idle_locked(struct pf_driver *d, struct pf_buf *b);

/* handles.c (either lock held) */
struct pf_handle *pf_handle_find_locked(struct pf_driver *d, void *fh);
/* setup held */
int pf_handle_attach_setup(struct pf_driver *d, struct pf_handle *h, int dev, phx_cuda *cu);
void pf_handles_attach_all_setup(struct pf_driver *d, int dev, phx_cuda *cu);

/* driver.c */
void pf_direct_early_off(struct pf_driver *d);

/* direct.c */
int pf_direct_map(struct pf_driver *d, struct pf_buf *b);
void pf_direct_unmap(struct pf_buf *b);
void pf_direct_run(void *arg);			/* a host function */

/* failures.c */
void pf_fail_locked(struct pf_driver *d, int err, const char *path, const char *what);
int pf_submit_fail(struct pf_driver *d, int err, const char *path, const char *what);
void pf_fail_flush(struct pf_driver *d, bool all);	/* no lock held */

/* log.c */
void pf_log(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
const char *pf_path_name(uint32_t path);

/* io.c: one transfer, from call to the end of its stream passage */
struct pf_op {
	struct pf_driver *d;
	struct pf_handle *h;
	struct pf_buf *b;		/* registered buffer, or NULL */
	uint32_t op;			/* PHX_OP_READ / PHX_OP_WRITE */
	uint64_t base;
	const size_t *size;
	const int64_t *foff;
	const int64_t *boff;
	int64_t *bytes_done;		/* the caller's */
};

void pf_op_finish(struct pf_op *o, int64_t res);

#endif
