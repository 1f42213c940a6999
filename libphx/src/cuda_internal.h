/* SPDX-License-Identifier: Apache-2.0 */
/*
 * cuda_internal.h - state shared by the cuda_*.c files; not installed.
 *
 * The GPU path in floors.  Each file calls only the floors below it; the
 * threads of floor 3 never call each other: they hand work over through
 * the queues of floor 1 and wake each other with its wakers.
 *
 *   5  cuda_api.c      the public request calls and counters
 *      cuda_many.c     many small pieces by arrays (PHX_0.8), on cuda_api.c's
 *                      host-async and stream-op doors
 *   4  cuda_context.c  contexts: configuration, pinned memory, threads,
 *                      destroy
 *   3  cuda_lanes.c    I/O lanes: file I/O into and out of staging (io_uring);
 *                      they make NO CUDA call
 *      cuda_copier.c   the copier: host-async copies between staging and the
 *                      GPU on its own streams, and the context's health check
 *      cuda_poller.c   the poller: watches the progress words the callers'
 *                      streams write (arrival, rounds done) and acts on them;
 *                      NO CUDA call
 *   2b cuda_stream.c   a stream-ordered request: its GPU program, its rounds,
 *                      the arrival (arguments read, early reads judged), flags
 *   2a cuda_request.c  every request's life cycle: arguments, pieces, results,
 *                      publication, release; file entries
 *   1  cuda_pools.c    what requests draw from: staging-buffer classes, events,
 *                      stream slots (flags, progress words, descriptor rings),
 *                      request records; wakers; counters
 *      cuda_numa.c     where staging memory goes (the GPU's NUMA node)
 *   0  cuda_driver.c   libcuda loaded at run time (no CUDA headers), errors
 *
 * Why the threads are split so.  A thread that raises a stream's flag must
 * never make a CUDA call: a device-synchronising call in another thread
 * (cudaFree, a growing allocator) blocks every CUDA call until all streams
 * are idle, and the caller's stream is waiting for that flag.  So the lanes
 * and the poller, which raise flags, make none; the copier, which makes them,
 * raises none.  Staging buffers are drawn in classes (enum sb_class) so that
 * work that can wait on a stream (host-async copies after a producer stream,
 * early reads) can never hold the buffers an arrived stream op needs.
 *
 * Locks.  c->lock guards the queues, the buffers' states and classes, the
 * file entries and the pools; c->done_lock guards c->live and host waiters.
 * The order is c->lock, then c->done_lock, then an inode's lock (inode.c).
 * None is ever held across a CUDA call or file I/O.
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
#define CU_RING 8u		/* copy descriptors per stream op, reused round after round */
#define CU_COPY_STREAMS 4u	/* the copier's streams */
/*
 * A host-async read buffer of more pieces than this is completed by its
 * lane, not by the copier: completing a piece (result, counters, record,
 * wake-up) costs a few locks, and thousands of small pieces a second would
 * make the one copier thread the bound; a buffer of a few large pieces
 * keeps the shorter way (no hand-over).
 */
#define CU_DONE_ON_LANE 8u

/* ------------------------------------------------------------------------ */
/* Floor 0: the driver API, declared by hand (cuda_driver.c)                */
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
	CUDA_ERROR_NOT_SUPPORTED = 801,
	CU_STREAM_NON_BLOCKING = 1,
	CU_EVENT_DISABLE_TIMING = 2,
	CU_MEMHOSTREGISTER_PORTABLE = 1,
	CU_MEMHOSTREGISTER_DEVICEMAP = 2,
	CU_STREAM_WAIT_VALUE_GEQ = 0,
	CU_STREAM_WRITE_VALUE_DEFAULT = 0,
	CU_POINTER_ATTRIBUTE_MEMORY_TYPE = 2,
	CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL = 9,
	CU_MEMORYTYPE_DEVICE = 2,
	CU_MEMORYTYPE_UNIFIED = 4,
	CU_MEMCPY_SRC_ACCESS_ORDER_STREAM = 1,
	CU_STREAM_CAPTURE_STATUS_NONE = 0,
	CU_STREAM_CAPTURE_MODE_RELAXED = 2,
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
	CUresult (*StreamWriteValue32)(CUstream, CUdeviceptr, uint32_t, unsigned);
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
	/* optional, else NULL */
	CUresult (*DeviceGetPCIBusId)(char *, int, CUdevice);	/* staging's NUMA node */
	CUresult (*StreamIsCapturing)(CUstream, int *);		/* refuse graph capture */
	CUresult (*ThreadExchangeStreamCaptureMode)(int *);	/* the copier: relaxed */
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
/* Shared records                                                           */
/* ------------------------------------------------------------------------ */

typedef struct phx_cuda phx_cuda;
struct cu_req;
struct cu_lane;

/*
 * Where a stream round's piece is (struct cu_piece.pstate): stream rounds
 * share buffers (several pieces, of one op or of several), and each goes
 * its own way.
 */
enum piece_state {
	P_IO,		/* file I/O in flight, or about to be */
	P_HELD,		/* an early read, read: waiting for its request's verdict */
	P_GPU,		/* waiting for its kernel on the caller's stream */
	P_BACK,		/* handed back to its lane: file I/O next (a write, a re-read) */
	P_DONE,		/* let go of: its bytes are no longer needed */
};

/* A part of one request that fits one staging buffer. */
struct cu_piece {
	struct cu_req *rq;
	struct cu_sbuf *b;		/* the buffer it is in */
	struct cu_round *round;		/* a stream op's round, or NULL (host-async) */
	uint64_t io_off;		/* the file operation */
	uint32_t io_len;
	uint32_t soff;			/* staging offset of io_off */
	uint64_t user_off;		/* the caller's bytes it carries (file range) */
	uint32_t user_len;
	uint32_t got;			/* of those, delivered */
	bool io_started;		/* pio was submitted */
	bool early;			/* an early read's (c->lock) */
	uint8_t pstate;			/* enum piece_state (stream rounds; c->lock) */
	struct phx_io pio;
};

enum sb_state {
	SB_FREE,
	SB_IO,		/* host-async: file I/O in flight (read: first; write: last) */
	SB_COPY,	/* host-async: queued for or in the copier */
	SB_BACK,	/* host-async write: back from the copier, file write next */
	SB_STREAM,	/* stream rounds: each piece has its own state (pstate) */
};

/* Who holds a buffer (struct phx_cuda.cls_held); see the top of this file. */
enum sb_class {
	SBC_NONE,
	SBC_STREAM,	/* an arrived stream op: any free buffer */
	SBC_HOST,	/* host-async: at most nbufs - reserve, with early */
	SBC_EARLY,	/* an early read: at most early_max */
	SBC_COUNT,
};

struct cu_sbuf {
	struct cu_lane *ln;		/* owner: only it starts file I/O on it */
	char *mem;
	CUdeviceptr mem_d;		/* the same memory, as the GPU sees it */
	uint8_t state;			/* enum sb_state (c->lock for hand-overs) */
	uint8_t op;
	uint8_t cls;			/* enum sb_class */
	bool in_inbox;			/* on its lane's inbox (c->lock) */
	uint32_t fill, npieces, ios_left;
	uint32_t live;			/* stream rounds not P_DONE (c->lock) */
	struct cu_sbuf *next;		/* lane inbox / copier queue (c->lock) */
	/* the copier's */
	CUevent ev;			/* recorded after the copies */
	int copied;			/* set by the copier stream's host function */
	int64_t started_ns;
	/* phase counters (struct phx_cuda_stats ph_*): when its file I/O was
	 * submitted, when it was queued for the copier (host-async only) */
	int64_t io_ns, copy_ns;
	struct cu_piece pieces[CU_MAX_PIECES];
};

/* A file as the GPU path uses it: held, and adopted once per lane. */
struct cu_file {
	struct cu_file *next;		/* c->files */
	phx_file *f;			/* the caller's file (held) */
	int fd;
	bool direct;
	bool early_ok;			/* early reads may be sound here (see cuda_stream.c) */
	uint32_t align;			/* staging congruence: 1, or >= 512 */
	uint32_t refs;			/* requests + registrations (c->lock) */
	uint32_t registrations;
	phx_file *lf[];			/* per lane; created and used by that lane */
};

/* What the copy kernels read (cuda_copy.cu): in pinned memory, then the GPU's. */
struct cu_copy_desc {
	uint64_t src, dst, len, pad;
};

/* An event on a producer stream that host-async copies wait for. */
struct cu_after {
	CUevent ev;
	int refs;			/* atomic */
};

/* ------------------------------------------------------------------------ */
/* Floor 1: pools, wakers, counters (cuda_pools.c)                          */
/* ------------------------------------------------------------------------ */

/* The progress words of stream slots: pinned, device-mapped (see cuda_stream.c). */
struct cu_words {
	uint32_t flag[CU_SLOTS];	/* the host raises: rounds the stream may run */
	uint32_t arrive[CU_SLOTS];	/* the stream writes its op's seq on arrival */
	uint32_t done[CU_SLOTS];	/* the stream writes seq + 1 + k after round k */
	uint32_t probe[64];		/* creation-time probes */
};

void waker_kick(int efd);
/* Any thread: wake up to @want lanes sleeping with a free buffer / every lane. */
void lanes_wake(phx_cuda *c, uint32_t want);
void lanes_kick(phx_cuda *c);
/*
 * Hand @b back to its lane (c->lock held): it starts the file I/O of the
 * buffer (host-async) or of its P_BACK pieces (stream rounds).
 */
void lane_give_back_locked(phx_cuda *c, struct cu_sbuf *b);
/* Queue @b for the copier (c->lock held); it is kicked. */
void copier_push_locked(phx_cuda *c, struct cu_sbuf *b);
/* A stream op was queued: the poller watches its words from now on (any thread). */
void poller_add(phx_cuda *c, struct cu_req *rq);
int ev_get(phx_cuda *c, CUevent *ev);
void ev_put(phx_cuda *c, CUevent ev);
/* A slot for one stream op, waiting (bounded) while all are in flight. */
int slot_get(phx_cuda *c, uint32_t need, uint32_t *slot, uint32_t *seq);
void slot_put_locked(phx_cuda *c, uint32_t slot);
struct cu_copy_desc *slot_desc(phx_cuda *c, uint32_t slot, uint32_t round);
/* Staging classes (c->lock held): may @cls take one more buffer? */
bool cls_may_take_locked(const phx_cuda *c, uint8_t cls);
void cls_take_locked(phx_cuda *c, struct cu_sbuf *b, uint8_t cls);
void cls_drop_locked(phx_cuda *c, struct cu_sbuf *b);
struct cu_req *rq_record_get(phx_cuda *c);
void rq_record_put_locked(phx_cuda *c, struct cu_req *rq);
void stat_add(phx_cuda *c, uint64_t *field, uint64_t n);
int ctx_push(phx_cuda *c);
void ctx_pop(phx_cuda *c);
/* Staging placement helpers, exposed for tests/gpu_fake/cuda_fake_test.c. */
int cu_pci_sysfs_name(const char *bus_id, char *out, size_t len);
int cu_node_list_count(const char *list);
/* Bind c->stage to the GPU's NUMA node before it is faulted in: 0 or -errno (cuda_numa.c). */
int cu_staging_bind(phx_cuda *c);

/* ------------------------------------------------------------------------ */
/* Floor 2a: requests (cuda_request.c)                                      */
/* ------------------------------------------------------------------------ */

enum rq_state {
	RQ_WAITING,	/* stream op: queued on the caller's stream, not reached */
	RQ_READY,	/* on a ready queue with pieces left to hand out */
	RQ_CUT,		/* every piece handed out; pieces in flight */
	RQ_DONE,
};

/* Early reads: see cuda_stream.c. */
enum early_state {
	E_NONE,		/* not early (or fallen back: an ordinary stream op) */
	E_PENDING,	/* early pieces may be cut and read; not yet judged */
	E_OK,		/* judged at arrival: the early pieces stand */
	E_BAD,		/* judged: thrown away; read again once they are back */
};

/* One staging round of a stream op (cuda_stream.c). */
struct cu_round {
	struct cu_req *rq;
	struct cu_piece *p;		/* its piece of a staging buffer, or NULL (no bytes) */
	uint32_t index;
	bool ready;			/* staged (read) / reserved (write) (c->lock) */
	bool written;			/* a write round's bytes are in the file */
};

/* stream-op milestones (phx_now_ns), for the counters and PHX_CUDA_TRACE */
enum rq_trace_point {
	TR_QUEUED, TR_ARRIVED, TR_READY, TR_FINAL, TR_RELEASE, RQ_TRACE_N
};

/*
 * Requests one caller waits for all at once (phx_cuda_many): their
 * completions wake that caller only when the last is done, instead of once
 * each (c->done_lock).
 */
struct cu_group {
	size_t left;			/* requests of the group not yet complete */
};

struct cu_req {
	struct cu_req *next;		/* ready queue / free list (c->lock) */
	phx_cuda *c;
	struct cu_group *grp;		/* host-async: its group, or NULL */
	struct phx_cuda_io *io;		/* the caller's, or owned */
	struct cu_file *cf;
	struct cu_after *after;
	uint8_t state;			/* enum rq_state */
	uint8_t op;
	bool owned;			/* io is ours: free it at the end */
	bool stream_op;
	bool io_args;			/* stream op: arguments are io's fields */
	bool wpend;			/* a write registered on its inode (inode_pend_*) */
	struct phx_wpend wp;		/* that registration */
	/* early reads (c->lock): see enum early_state */
	uint8_t e_state;
	bool e_queued;			/* on c->early_head */
	bool e_cut;			/* every piece was handed out early */
	uint32_t e_live;		/* staging buffers holding its early pieces */
	uint64_t e_gen;			/* the inode's write generation when it began */
	uint32_t e_epoch;		/* c->early_epoch when it began */
	int64_t e_size, e_ctime_ns;	/* the file (fstat) when it began */
	struct cu_req *e_next;		/* c->early_head */
	/* stream ops: read when the stream reaches the operation */
	const size_t *size_p;
	const int64_t *foff_p, *boff_p;
	uint64_t base;
	int64_t *bytes_done;
	phx_cuda_done_fn done_fn;	/* told once released (the poller's thread) */
	void *done_arg;
	CUstream stream;
	uint32_t slot, seq;		/* its progress words and flag (cuda_stream.c) */
	struct cu_round *rounds;
	uint32_t nrounds;
	uint32_t round_bytes;		/* bytes of staging per round (cuda_stream.c) */
	uint32_t round_next;		/* next round to cut (c->lock) */
	uint32_t prefix;		/* rounds whose descriptor is out (c->lock) */
	uint32_t kdone;			/* rounds whose kernel ran (poller) */
	uint32_t raised;		/* flag value stored last (c->lock) */
	uint32_t needed;		/* rounds that carry bytes, once cut */
	int written;			/* stream writes: rounds in the file */
	bool publish_claimed;		/* c->lock */
	bool publish_at_release;	/* killed: published by the last reference */
	bool arrived;			/* the poller saw the arrival word */
	bool orphan;			/* its GPU program is only partly queued */
	uint32_t orphan_rounds;		/* of its rounds, those queued whole */
	bool gpu_gone;			/* no kernel of it runs any more (st_kill) */
	uint64_t alloc_lo, alloc_hi;	/* GPU memory checked at submission */
	struct cu_req *p_next, *p_prev;	/* the poller's list of live stream ops */
	/* resolved arguments */
	uint64_t devptr, off, len, end;
	uint64_t cursor;		/* next file offset to hand out (c->lock) */
	int pieces;			/* references: pieces, host functions, cutting */
	/* outcome, updated atomically by the lanes */
	int64_t err;
	uint64_t short_end;		/* lowest end of a short read */
	uint64_t direct_bytes, bounce_bytes, buffered_bytes;
	uint32_t paths;
	int64_t trace[RQ_TRACE_N];
};

/* Files */
struct cu_file *cf_get(phx_cuda *c, phx_file *f, int *err);
void cf_put(phx_cuda *c, struct cu_file *cf);
/* Device memory of the context's device, one allocation or contiguous segments. */
int cu_check_devptr(phx_cuda *c, uint64_t p, size_t len, uint64_t range[2]);
/* Birth */
int rq_host(phx_cuda *c, struct phx_cuda_io *io, struct cu_after *after,
	    struct cu_group *grp, uint64_t range[2], struct cu_file **cfp,
	    struct cu_req **out);
struct cu_req *rq_new(phx_cuda *c);
void rq_set_range(struct cu_req *rq, uint64_t devptr, uint64_t off, uint64_t len);
void rq_live_inc(phx_cuda *c);
void rq_write_register(struct cu_req *rq, uint64_t off, uint64_t len);
/* Pieces */
bool rq_cut(struct cu_req *rq, struct cu_piece *p, uint32_t *fill, uint32_t size,
	    uint32_t max_len, bool first);
void rq_piece_io(struct cu_piece *p);
void rq_piece_account(struct cu_req *rq, struct cu_piece *p);
void rq_piece_done(struct cu_piece *p);
void rq_ref_hold_locked(struct cu_req *rq);
void rq_ref_drop(struct cu_req *rq, int n);
void rq_fail(struct cu_req *rq, int64_t err);
int64_t rq_result(const struct cu_req *rq);
/* End */
void rq_publish(struct cu_req *rq);
void rq_release(struct cu_req *rq);
void rq_abandon(struct cu_req *rq, int err);
void after_put(phx_cuda *c, struct cu_after *a);
/* The ready queues (c->lock held) */
void ready_push_locked(phx_cuda *c, struct cu_req *rq, bool head);
struct cu_req *ready_head_locked(phx_cuda *c, bool stream);
void ready_pop_locked(phx_cuda *c, bool stream);

/* ------------------------------------------------------------------------ */
/* Floor 2b: stream-ordered requests (cuda_stream.c)                        */
/* ------------------------------------------------------------------------ */

int st_submit(phx_cuda *c, struct phx_cuda_io *io, bool owned, phx_file *f, uint32_t op,
	      uint64_t base, const size_t *size_p, const int64_t *foff_p,
	      const int64_t *boff_p, int64_t *bytes_done, CUstream s,
	      phx_cuda_done_fn done_fn, void *done_arg);
/* The poller saw the arrival (no lock held): read and check the arguments. */
void st_arrived(struct cu_req *rq);
/* Round @k's kernel ran (the done word passed it). */
void st_kernel_done(struct cu_req *rq, uint32_t k);
/* A round was cut into piece @p of buffer @b, or its file I/O ended. */
void st_round_take_locked(struct cu_req *rq, struct cu_sbuf *b, struct cu_piece *p);
void st_round_staged(struct cu_round *r);
void st_round_reserved(struct cu_round *r);
void st_round_written(struct cu_round *r);
void st_cut_done_locked(struct cu_req *rq);
uint32_t st_pack_limit(const phx_cuda *c, const struct cu_sbuf *b);
void st_advance(struct cu_req *rq);
/* Early reads */
bool st_early_take_locked(phx_cuda *c, struct cu_sbuf *b);
int st_early_round(struct cu_piece *p);		/* a lane: an early round is read */
/* No kernel of @rq runs any more (a dead context, an orphan): end it now, with @err. */
void st_kill(struct cu_req *rq, int err);
/* The stream is past the whole op: counters, trace, the GPU program's reference. */
void st_final(struct cu_req *rq);
/* An orphan's stream passed its queued rounds: let the rest pass harmlessly. */
void st_orphan_end(struct cu_req *rq);
/* Is the stream op's release due (every word it waits for has passed)? */
bool st_final_passed(const struct cu_req *rq, uint32_t done);
uint32_t st_words_done(const struct cu_req *rq);
void st_trace_print(const struct cu_req *rq);

/* ------------------------------------------------------------------------ */
/* Floor 3: threads (cuda_lanes.c, cuda_copier.c, cuda_poller.c)            */
/* ------------------------------------------------------------------------ */

/* lane_setup()'s steps, timed for PHX_CUDA_TRACE: start, staging populated,
 * engine made, io_uring-registered */
#define LANE_SETUP_STEPS 4

struct cu_lane {
	phx_cuda *c;
	uint32_t index;
	pthread_t thr;
	bool started;
	bool stop;			/* c->lock */
	bool sleeping;			/* on c->sleepers (c->lock) */
	struct cu_lane *next_sleeper;
	struct cu_sbuf *inbox;		/* buffers handed back (c->lock) */
	phx_engine *eng;
	int efd;			/* the engine's eventfd: CQEs, wakeups */
	char *mem;
	CUdeviceptr mem_d;
	size_t mem_len;
	bool uring_registered;
	int64_t setup_ns[LANE_SETUP_STEPS];
	struct cu_sbuf *bufs;
	uint32_t nbufs;
};

int lane_setup(phx_cuda *c, struct cu_lane *ln, uint32_t index);
int lane_start(phx_cuda *c, struct cu_lane *ln);
void lane_stop(phx_cuda *c, struct cu_lane *ln);
void lane_free(phx_cuda *c, struct cu_lane *ln);

int copier_start(phx_cuda *c);
void copier_stop(phx_cuda *c);

int poller_start(phx_cuda *c);
void poller_stop(phx_cuda *c);

/* ------------------------------------------------------------------------ */
/* Floor 4: contexts (cuda_context.c)                                       */
/* ------------------------------------------------------------------------ */

struct phx_cuda {
	struct phx_cuda_config cfg;
	const struct cu_driver *d;
	phx_engine *eng;
	CUdevice dev;
	CUcontext ctx;
	bool memops;
	char memops_why[160];		/* why stream ops are unavailable */
	bool trace;			/* PHX_CUDA_TRACE: stream-op timings to stderr */
	bool batch_copy;
	bool fixed_bufs;
	uint32_t queue_wait_ms;		/* PHX_CUDA_QUEUE_WAIT_MS: backpressure bound */
	struct cu_lane *lanes;
	uint32_t nlanes;
	uint32_t nbufs;			/* all lanes' buffers */
	char *stage;			/* every lane's staging, one region */
	size_t stage_len;
	CUdeviceptr stage_d;
	bool stage_registered;
	int stage_node;			/* NUMA node staging is bound to, or -1 */
	int stage_node_err;		/* why not bound: -errno (PHX_CUDA_TRACE) */

	pthread_mutex_t lock;
	/* ready queues: arrived stream ops first, then host-async work */
	struct cu_req *ready_head[2], *ready_tail[2];	/* [1]: stream */
	/* staging classes: buffers held by each (enum sb_class) */
	uint32_t cls_held[SBC_COUNT];
	uint32_t reserve;		/* buffers only arrived stream ops may take */
	uint32_t early_max;
	/* early reads: stream reads queued, not arrived, with pieces to cut */
	bool early_reads;
	uint32_t early_epoch;		/* bumped when they are turned off */
	struct cu_req *early_head, *early_tail;
	struct cu_lane *sleepers;
	struct cu_file *files;
	struct cu_req *free_reqs;
	uint32_t *slot_free;		/* stack of free slots */
	uint32_t nslot_free;
	uint32_t *slot_seq;		/* last sequence number used by each slot */
	pthread_cond_t slot_cond;	/* a slot came free */
	uint32_t slot_waiters;
	CUevent *ev_free;		/* event pool */
	size_t nev_free, ev_cap;

	struct cu_words *words;		/* pinned, device-mapped */
	CUdeviceptr words_d;
	bool words_registered;
	struct cu_copy_desc *descs;	/* CU_SLOTS * CU_RING, pinned, device-mapped */
	CUdeviceptr descs_d;
	bool descs_registered;
	CUdeviceptr descs_gpu;		/* where the descriptor kernel puts them */
	CUmodule module;		/* the copy kernels */
	CUfunction desc_fn, copy_fn;
	unsigned copy_blocks, copy_threads;
	uint32_t orphans;		/* stream ops only partly queued: memory kept */

	/* the poller */
	pthread_t poller;
	bool poller_started;
	bool poller_stop;		/* c->lock */
	int poller_efd;
	struct cu_req *p_incoming;	/* stream ops to watch (c->lock) */
	uint32_t stream_live;		/* stream ops queued, not released (atomic) */
	int64_t stream_progress_ns;	/* the poller's last progress (atomic) */
	int dead;			/* -errno: the context has a sticky error (atomic) */

	/* the copier */
	pthread_t copier;
	bool copier_started;
	bool copier_stop;		/* c->lock */
	int copier_efd;
	struct cu_sbuf *copy_head, *copy_tail;	/* c->lock */
	CUstream copy_streams[CU_COPY_STREAMS];

	pthread_mutex_t done_lock;
	pthread_cond_t done_cond;
	uint64_t live;			/* requests not finished (done_lock) */
	int done_efd;			/* phx_cuda_eventfd(), or -1 (done_lock) */

	struct phx_cuda_stats st;
	phx_stats_source *pub;		/* live counters (stats_pub.c), or NULL */
};

/* cuda_api.c: publish @c's counters for `phx top` (best effort). */
void cu_stats_publish(phx_cuda *c);
/*
 * cuda_api.c, for cuda_many.c: queue host-async requests (stops at the
 * first bad one; those before stay queued: *@accepted, when not NULL, says
 * how many; @grp, when not NULL, is their group), and one stream op whose
 * arguments are read on arrival and whose phx_cuda_io libphx owns.
 */
int cu_submit_host(phx_cuda *c, struct phx_cuda_io *const *ios, size_t n,
		   bool ordered, void *after_stream, struct cu_group *grp,
		   size_t *accepted);
int cu_async_owned(phx_cuda *c, phx_file *f, uint32_t op, uint64_t base,
		   const size_t *size, const int64_t *foff, const int64_t *boff,
		   int64_t *bytes_done, void *stream, phx_cuda_done_fn fn, void *arg);

#endif /* PHX_CUDA_INTERNAL_H */
