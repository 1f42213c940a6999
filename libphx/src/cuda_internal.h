/* SPDX-License-Identifier: Apache-2.0 */
/*
 * cuda_internal.h - state shared by the cuda_*.c files; not installed.
 *
 * The GPU path in five files, one concern each:
 *   cuda_driver.c   libcuda loaded at run time (no CUDA headers), errors
 *   cuda_context.c  contexts: configuration, pinned staging, lanes' setup,
 *                   completion-flag slots, pools, destroy
 *   cuda_request.c  a request's whole life cycle, from submission to the
 *                   published result (read that file first)
 *   cuda_lanes.c    lane threads: pieces of requests through staging buffers
 *                   (file I/O on the lane's io_uring, copies on its stream)
 *   cuda_api.c      the public request calls and counters
 *
 * Locks.  c->lock guards the ready queue, the sleeping lanes, the file
 * entries and the pools; c->done_lock guards c->live and host waiters.  The
 * order is c->lock, then c->done_lock.  Neither is ever held across a CUDA
 * call or file I/O: a CUDA call may block (a full stream command queue)
 * until lanes make progress, and CUDA's callback thread takes c->lock.
 */
#ifndef PHX_CUDA_INTERNAL_H
#define PHX_CUDA_INTERNAL_H

#include <pthread.h>
#include <stdbool.h>
#include <stdint.h>

#include "phx_cuda.h"
#include "internal.h"

#define CU_EXPORT __attribute__((visibility("default")))

#define CU_MAX_LANES 64u
#define CU_MAX_BUFS 1024u	/* lanes * bufs_per_lane */
#define CU_MAX_PIECES 64u	/* request pieces packed into one staging buffer */
#define CU_SLOTS 4096u		/* stream operations in flight per context */
#define CU_DESCS 16384u		/* copy descriptors (stream-op rounds) in flight */
#define CU_MAX_STAGES 4096u	/* staging rounds of one stream operation */

/* ------------------------------------------------------------------------ */
/* The driver API, declared by hand (cuda_driver.c)                         */
/* ------------------------------------------------------------------------ */

typedef int CUresult;
typedef int CUdevice;
typedef struct CUctx_st *CUcontext;
typedef struct CUstream_st *CUstream;
typedef struct CUevent_st *CUevent;
typedef uint64_t CUdeviceptr;
typedef struct CUmod_st *CUmodule;
typedef struct CUfunc_st *CUfunction;
typedef void (*CUhostFn)(void *user);

enum {
	CUDA_SUCCESS = 0,
	CUDA_ERROR_INVALID_VALUE = 1,
	CUDA_ERROR_OUT_OF_MEMORY = 2,
	CUDA_ERROR_NOT_READY = 600,
	CU_STREAM_NON_BLOCKING = 1,
	CU_EVENT_DISABLE_TIMING = 2,
	CU_MEMHOSTREGISTER_PORTABLE = 1,
	CU_MEMHOSTREGISTER_DEVICEMAP = 2,
	CU_STREAM_WAIT_VALUE_GEQ = 0,
	CU_POINTER_ATTRIBUTE_MEMORY_TYPE = 2,
	CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL = 9,
	CU_MEMORYTYPE_DEVICE = 2,
	CU_MEMORYTYPE_UNIFIED = 4,
	CU_MEMCPY_SRC_ACCESS_ORDER_STREAM = 1,
};

/* CUmemLocation and CUmemcpyAttributes (cuda.h 12.8+) */
struct cu_memloc {
	int type;
	int id;
};

struct cu_memcpy_attr {
	int src_access_order;
	struct cu_memloc src_hint;
	struct cu_memloc dst_hint;
	unsigned int flags;
};

struct cu_driver {
	int version;		/* cuDriverGetVersion, e.g. 13000 */
	int ndev;
	CUresult (*Init)(unsigned);
	CUresult (*DriverGetVersion)(int *);
	CUresult (*DeviceGetCount)(int *);
	CUresult (*DeviceGet)(CUdevice *, int);
	CUresult (*DevicePrimaryCtxRetain)(CUcontext *, CUdevice);
	CUresult (*DevicePrimaryCtxRelease)(CUdevice);
	CUresult (*CtxSetCurrent)(CUcontext);
	CUresult (*CtxPushCurrent)(CUcontext);
	CUresult (*CtxPopCurrent)(CUcontext *);
	CUresult (*StreamCreate)(CUstream *, unsigned);
	CUresult (*StreamDestroy)(CUstream);
	CUresult (*StreamSynchronize)(CUstream);
	CUresult (*StreamQuery)(CUstream);
	CUresult (*StreamWaitEvent)(CUstream, CUevent, unsigned);
	CUresult (*StreamWaitValue32)(CUstream, CUdeviceptr, uint32_t, unsigned);
	CUresult (*EventCreate)(CUevent *, unsigned);
	CUresult (*EventDestroy)(CUevent);
	CUresult (*EventRecord)(CUevent, CUstream);
	CUresult (*EventQuery)(CUevent);
	CUresult (*EventSynchronize)(CUevent);
	CUresult (*MemcpyHtoDAsync)(CUdeviceptr, const void *, size_t, CUstream);
	CUresult (*MemcpyDtoHAsync)(void *, CUdeviceptr, size_t, CUstream);
	CUresult (*MemHostRegister)(void *, size_t, unsigned);
	CUresult (*MemHostUnregister)(void *);
	CUresult (*MemHostGetDevicePointer)(CUdeviceptr *, void *, unsigned);
	CUresult (*MemGetAddressRange)(CUdeviceptr *, size_t *, CUdeviceptr);
	CUresult (*MemAlloc)(CUdeviceptr *, size_t);
	CUresult (*MemFree)(CUdeviceptr);
	CUresult (*LaunchHostFunc)(CUstream, CUhostFn, void *);
	CUresult (*ModuleLoadData)(CUmodule *, const void *);
	CUresult (*ModuleUnload)(CUmodule);
	CUresult (*ModuleGetFunction)(CUfunction *, CUmodule, const char *);
	CUresult (*LaunchKernel)(CUfunction, unsigned, unsigned, unsigned, unsigned,
				 unsigned, unsigned, unsigned, CUstream, void **, void **);
	CUresult (*GetErrorString)(CUresult, const char **);
	CUresult (*PointerGetAttribute)(void *, int, CUdeviceptr);
	/* CUDA >= 12.8 (the 12.8 ABI, with failIdx), else NULL */
	CUresult (*MemcpyBatchAsync)(CUdeviceptr *dsts, CUdeviceptr *srcs,
				     size_t *sizes, size_t count,
				     struct cu_memcpy_attr *attrs, size_t *attr_idxs,
				     size_t nattrs, size_t *fail_idx, CUstream s);
	/* optional (staging's NUMA node only), else NULL */
	CUresult (*DeviceGetPCIBusId)(char *, int, CUdevice);
};

/* The driver table once libcuda is loaded, else NULL (and the reason set). */
const struct cu_driver *cu_driver(void);
/* Why CUDA can or cannot be used ("CUDA driver 13.0, 1 device"). */
const char *cu_driver_why(void);
/* -errno for a failed driver call, with the driver's text as last error. */
int cu_fail(const struct cu_driver *d, CUresult r, const char *what);
/* Set this thread's last-error text; returns @err. */
int cu_err(int err, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/* Keep / restore the last-error text across cleanup that may overwrite it. */
void cu_err_save(char *buf, size_t len);
void cu_err_restore(const char *buf);

/* ------------------------------------------------------------------------ */
/* Requests (cuda_request.c)                                                */
/* ------------------------------------------------------------------------ */

enum rq_state {
	RQ_WAITING,	/* stream op: queued on the caller's stream, not reached */
	RQ_ARRIVED,	/* the stream reached it: its arguments are to be read */
	RQ_READY,	/* on the ready queue with pieces left to hand out */
	RQ_CUT,		/* every piece handed to a lane; pieces in flight */
	RQ_DONE,
};

/* A file as the GPU path uses it: held, and adopted once per lane. */
struct cu_file {
	struct cu_file *next;		/* c->files */
	phx_file *f;			/* the caller's file (held) */
	int fd;
	bool direct;
	uint32_t align;			/* staging congruence: 1, or >= 512 */
	uint32_t refs;			/* requests + registrations (c->lock) */
	uint32_t registrations;
	/* early reads: writes through this context queued, not yet in the file */
	uint32_t writes_live;		/* c->lock */
	uint32_t write_gen;		/* bumped by every write accepted (c->lock) */
	phx_file *lf[];			/* per lane; created and used by that lane */
};

/*
 * One staging round of a stream-ordered request: queued at submission on
 * the caller's stream as "wait for the flag to reach seq + 1 + index", the
 * copy kernel on the descriptor, a host function (stage_done_fn).
 */
struct cu_stage {
	struct cu_req *rq;
	struct cu_sbuf *b;		/* its staging buffer, or NULL (no bytes) */
	uint32_t index;
	uint32_t desc;			/* descriptor slot */
	bool ready;			/* descriptor written (c->lock) */
	int gpu_done;			/* the kernel ran (host function) */
};

/* What the copy kernel reads (cuda_copy.cu), in pinned device-mapped memory. */
struct cu_copy_desc {
	uint64_t src, dst, len, pad;
};

/* An event on a producer stream that host-async copies wait for. */
struct cu_after {
	CUevent ev;
	int refs;			/* atomic */
};

/*
 * Early reads (PHX_CUDA_EARLY_READS): a stream read's file I/O begins when
 * it is queued, on the arguments as they are then; when the stream arrives
 * the arguments are read again and the early pieces are used only if
 * nothing changed (enum early_state).
 */
enum early_state {
	E_NONE,		/* not early (or fallen back: an ordinary stream op) */
	E_PENDING,	/* early pieces may be cut and read; not yet judged */
	E_OK,		/* judged at arrival: the early pieces stand */
	E_BAD,		/* judged: thrown away; read again once they are back */
};

/* stream-op milestones, printed at release when PHX_CUDA_TRACE=1 */
enum rq_trace_point {
	TR_QUEUED, TR_ARRIVED, TR_RESOLVED, TR_FILL0, TR_FLAG0, TR_DONE0, TR_FINAL,
	TR_RELEASE, RQ_TRACE_N
};

struct cu_req {
	struct cu_req *next;		/* ready queue / free list (c->lock) */
	phx_cuda *c;
	struct phx_cuda_io *io;		/* the caller's, or owned */
	struct cu_file *cf;
	struct cu_after *after;
	uint8_t state;			/* enum rq_state */
	uint8_t op;
	bool owned;			/* io is ours: free it at the end */
	bool stream_op;
	bool io_args;			/* stream op: arguments are io's fields */
	bool wtracked;			/* a write counted in cf->writes_live */
	/* early reads (c->lock): see enum early_state */
	uint8_t e_state;
	bool e_queued;			/* on c->early_head */
	bool e_cut;			/* every piece was handed out early */
	uint32_t e_live;		/* staging buffers holding its early pieces */
	uint32_t e_gen;			/* cf->write_gen when it began */
	uint32_t e_epoch;		/* c->early_epoch when it began */
	int64_t e_size, e_ctime_ns;	/* the file (fstat) when it began */
	struct cu_req *e_next;		/* c->early_head */
	/* stream ops: read when the stream reaches the operation */
	const size_t *size_p;
	const int64_t *foff_p, *boff_p;
	uint64_t base;
	int64_t *bytes_done;
	uint32_t slot, seq;		/* the flag the caller's stream waits on */
	struct cu_stage *stages;	/* one per staging round queued */
	uint32_t nstages;
	uint32_t stage_next;		/* next round to cut (c->lock) */
	uint32_t prefix;		/* rounds whose flag is raised (c->lock) */
	uint32_t raised;		/* flag value stored last (c->lock) */
	uint32_t needed;		/* rounds that carry bytes, once cut */
	int written;			/* stream writes: rounds in the file */
	bool publish_claimed;		/* c->lock */
	uint64_t alloc_lo, alloc_hi;	/* the GPU allocation, found at submission */
	/* resolved arguments */
	uint64_t devptr, off, len, end;
	uint64_t cursor;		/* next file offset to hand out (c->lock) */
	int pieces;			/* pieces not finished, +1 until RQ_CUT */
	/* outcome, updated atomically by the lanes */
	int64_t err;
	uint64_t short_end;		/* lowest end of a short read */
	uint64_t direct_bytes, bounce_bytes, buffered_bytes;
	uint32_t paths;
	/* PHX_CUDA_TRACE=1: stream-op milestones (phx_now_ns), see rq_trace() */
	int64_t trace[RQ_TRACE_N];
};

int rq_host(phx_cuda *c, struct phx_cuda_io *io, struct cu_after *after,
	    uint64_t range[2], struct cu_file **cfp, struct cu_req **out);
int rq_stream(phx_cuda *c, struct phx_cuda_io *io, bool owned, phx_file *f,
	      uint32_t op, uint64_t base, const size_t *size_p,
	      const int64_t *foff_p, const int64_t *boff_p, int64_t *bytes_done,
	      CUstream s);
void rq_queue(phx_cuda *c, struct cu_req **rqs, size_t n);
int rq_resolve(struct cu_req *rq);
struct cu_piece;
bool rq_cut(struct cu_req *rq, struct cu_piece *p, uint32_t *fill, uint32_t size,
	    bool first);
void rq_piece_io(struct cu_piece *p);
void rq_piece_done(struct cu_piece *p);
void rq_piece_done_ref(struct cu_req *rq);
void rq_piece_done_n(struct cu_req *rq, int n);
void rq_abandon(struct cu_req *rq, int err);
void rq_fail(struct cu_req *rq, int64_t err);
void rq_finish(struct cu_req *rq);
void rq_stage_fill(struct cu_stage *st, struct cu_piece *p, uint64_t staging_d);
void rq_stages_advance(struct cu_req *rq);
void rq_trace(struct cu_req *rq, int pt);
void rq_stage_written(struct cu_stage *st, struct cu_piece *p);
void rq_stages_cut_done_locked(struct cu_req *rq);
void rq_early_unlink_locked(struct cu_req *rq);
void ready_push_tail_locked(phx_cuda *c, struct cu_req *rq);
void ready_push_head_locked(phx_cuda *c, struct cu_req *rq);
void rq_early_restart_locked(struct cu_req *rq);
struct cu_file *cf_get(phx_cuda *c, phx_file *f, int *err);
void cf_put(phx_cuda *c, struct cu_file *cf);
int cu_check_devptr(phx_cuda *c, uint64_t p, size_t len, uint64_t range[2]);

/* ------------------------------------------------------------------------ */
/* Lanes (cuda_lanes.c)                                                     */
/* ------------------------------------------------------------------------ */

/* A part of one request that fits one staging buffer. */
struct cu_piece {
	struct cu_req *rq;
	uint64_t io_off;		/* the file operation */
	uint32_t io_len;
	uint32_t soff;			/* staging offset of io_off */
	uint64_t user_off;		/* the caller's bytes it carries (file range) */
	uint32_t user_len;
	uint32_t got;			/* of those, delivered */
	bool io_started;		/* pio was submitted */
	struct phx_io pio;
};

enum sb_state {
	SB_FREE,
	SB_IO,		/* file I/O in flight (read: first; write: last) */
	SB_COPY,	/* copies in flight on the lane's stream */
	SB_GPU,		/* stream-op round: waiting for its kernel's host function */
	SB_HELD,	/* early read done: waiting for its request to be judged */
};

struct cu_lane;

struct cu_sbuf {
	struct cu_lane *ln;
	char *mem;
	uint8_t state;
	uint8_t op;
	bool early;			/* an early read's round (c->lock) */
	uint32_t fill, npieces, ios_left;
	CUevent ev;			/* recorded after the copies */
	int copied;			/* set by the lane stream's host function */
	struct cu_stage *stage;		/* a stream-op round: its one piece */
	int64_t started_ns;		/* when the copies were queued */
	struct cu_piece pieces[CU_MAX_PIECES];
};

/* lane_setup()'s steps, timed for PHX_CUDA_TRACE: start, staging populated,
 * engine made, io_uring-registered, stream and events */
#define LANE_SETUP_STEPS 5

struct cu_lane {
	phx_cuda *c;
	uint32_t index;
	pthread_t thr;
	bool started;
	bool stop;			/* c->lock */
	bool sleeping;			/* on c->sleepers (c->lock) */
	struct cu_lane *next_sleeper;
	phx_engine *eng;
	int efd;			/* the engine's eventfd: CQEs, wakeups */
	char *mem;
	CUdeviceptr mem_d;		/* the same memory, as the GPU sees it */
	size_t mem_len;
	bool uring_registered;
	int64_t setup_ns[LANE_SETUP_STEPS];	/* PHX_CUDA_TRACE: when each step ended */
	CUstream stream;
	struct cu_sbuf *bufs;
	uint32_t nbufs;
	/* copy lists, one batch at a time */
	CUdeviceptr dsts[CU_MAX_PIECES], srcs[CU_MAX_PIECES];
	size_t sizes[CU_MAX_PIECES];
};

int lane_setup(phx_cuda *c, struct cu_lane *ln, uint32_t index);
int lane_start(phx_cuda *c, struct cu_lane *ln);
void lane_stop(phx_cuda *c, struct cu_lane *ln);
void lane_free(phx_cuda *c, struct cu_lane *ln);
void lanes_wake(phx_cuda *c, uint32_t want);
void lanes_kick(phx_cuda *c);

/* ------------------------------------------------------------------------ */
/* Contexts (cuda_context.c)                                                */
/* ------------------------------------------------------------------------ */

struct phx_cuda {
	struct phx_cuda_config cfg;
	const struct cu_driver *d;
	phx_engine *eng;
	CUdevice dev;
	CUcontext ctx;
	bool memops;
	bool trace;			/* PHX_CUDA_TRACE: stream-op timings to stderr */
	bool batch_copy;
	bool fixed_bufs;
	struct cu_lane *lanes;
	uint32_t nlanes;
	char *stage;			/* every lane's staging, one region */
	size_t stage_len;
	CUdeviceptr stage_d;		/* the same memory, as the GPU sees it */
	bool stage_registered;
	int stage_node;			/* NUMA node staging is bound to, or -1 */
	int stage_node_err;		/* why not bound: -errno (PHX_CUDA_TRACE) */

	pthread_mutex_t lock;
	struct cu_req *ready_head, *ready_tail;
	/* early reads: stream reads queued, not arrived, with pieces to cut */
	bool early_reads;		/* PHX_CUDA_EARLY_READS, phx_cuda_set_early_reads() */
	uint32_t early_epoch;		/* bumped when they are turned off */
	struct cu_req *early_head, *early_tail;
	uint32_t early_bufs;		/* staging buffers holding early pieces */
	uint32_t early_max;		/* at most this many: the rest serve arrived work */
	struct cu_lane *sleepers;
	struct cu_file *files;
	struct cu_req *free_reqs;
	uint32_t *slot_free;		/* stack of free flag slots */
	uint32_t nslot_free;
	uint32_t *slot_seq;		/* last sequence number of each slot */
	uint32_t *desc_free;		/* stack of free copy descriptors */
	uint32_t ndesc_free;
	CUevent *ev_free;		/* event pool */
	size_t nev_free, ev_cap;

	uint32_t *flags;		/* CU_SLOTS words, device-mapped */
	CUdeviceptr flags_d;
	bool flags_registered;
	struct cu_copy_desc *descs;	/* CU_DESCS, device-mapped */
	CUdeviceptr descs_d;
	bool descs_registered;
	CUmodule module;		/* the copy kernel */
	CUfunction copy_fn;
	unsigned copy_blocks, copy_threads;

	pthread_mutex_t done_lock;
	pthread_cond_t done_cond;
	uint64_t live;			/* requests not finished (done_lock) */

	pthread_mutex_t st_lock;
	struct phx_cuda_stats st;
};

int ctx_push(phx_cuda *c);
void ctx_pop(phx_cuda *c);
int ev_get(phx_cuda *c, CUevent *ev);
void ev_put(phx_cuda *c, CUevent ev);
int slot_get(phx_cuda *c, uint32_t *slot, uint32_t *seq);
void slot_put_locked(phx_cuda *c, uint32_t slot);
int descs_get(phx_cuda *c, struct cu_stage *st, uint32_t n);
void descs_put_locked(phx_cuda *c, struct cu_stage *st, uint32_t n);
void stat_add(phx_cuda *c, uint64_t *field, uint64_t n);
/* Staging placement helpers, exposed for tests/gpu_fake/cuda_fake_test.c. */
int cu_pci_sysfs_name(const char *bus_id, char *out, size_t len);
int cu_node_list_count(const char *list);
/* Bind c->stage to the GPU's NUMA node before it is faulted in: 0 or -errno (cuda_numa.c). */
int cu_staging_bind(phx_cuda *c);

#endif /* PHX_CUDA_INTERNAL_H */
