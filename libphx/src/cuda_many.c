// SPDX-License-Identifier: Apache-2.0
/*
 * cuda_many.c - floor 5: many small pieces of one file and one GPU buffer,
 * given as three arrays (phx_cuda.h, PHX_0.8; issue 29).
 *
 * KV cache blocks of 8-64 KiB come in thousands per call; a struct and a
 * Python object per piece cost more than the piece's I/O.  These calls
 * take offsets and lengths as arrays, check them all before queueing any
 * (so a bad argument queues nothing), and turn each piece into an ordinary
 * request: the lanes pack small requests many to a staging buffer, with
 * one io_uring submission and one copy call per buffer (cuda_lanes.c,
 * cuda_copier.c).  Nothing here is new machinery, only a cheaper door.
 */
#include <errno.h>
#include <inttypes.h>
#include <stdlib.h>
#include <string.h>

#include "cuda_internal.h"

/* A piece's span on the side where two pieces must not meet. */
struct span {
	uint64_t lo, hi;
	size_t index;
};

static int span_cmp(const void *a, const void *b)
{
	const struct span *x = a, *y = b;

	if (x->lo != y->lo)
		return x->lo < y->lo ? -1 : 1;
	return x->index < y->index ? -1 : (x->index > y->index);
}

/* Each value non-negative, each piece inside the GPU buffer. */
static int check_values(const struct phx_cuda_many *m)
{
	size_t i;

	for (i = 0; i < m->n; i++) {
		int64_t fo = m->file_offsets[i], dof = m->dev_offsets[i], len = m->lens[i];

		if (fo < 0 || dof < 0 || len < 0)
			return cu_err(-EINVAL, "piece %zu: negative %s (%" PRId64 ")", i,
				      fo < 0 ? "file offset" : dof < 0 ? "GPU offset" : "length",
				      fo < 0 ? fo : dof < 0 ? dof : len);
		/* a file offset is an off_t: the end must fit one too */
		if (fo > INT64_MAX - len)
			return cu_err(-EINVAL, "piece %zu: file range ends past the largest offset", i);
		if ((uint64_t)dof > m->dev_len || (uint64_t)len > m->dev_len - (uint64_t)dof)
			return cu_err(-EINVAL, "piece %zu: GPU bytes %" PRId64 "..%" PRIu64
				      " run past the %" PRIu64 "-byte buffer", i, dof,
				      (uint64_t)dof + (uint64_t)len, m->dev_len);
	}
	return 0;
}

/*
 * No two non-empty pieces overlap on the side where their order would
 * decide the outcome: the GPU for reads, the file for writes.  Sorting
 * costs O(n log n) against n pieces of I/O, so it is always done.
 */
static int check_overlap(const struct phx_cuda_many *m)
{
	bool read = m->op == PHX_OP_READ;
	const int64_t *start = read ? m->dev_offsets : m->file_offsets;
	struct span *sp;
	size_t i, k = 0;
	int ret = 0;

	if (m->n < 2)
		return 0;
	sp = malloc(m->n * sizeof(*sp));
	if (!sp)
		return cu_err(-ENOMEM, "out of memory for %zu pieces", m->n);
	for (i = 0; i < m->n; i++) {
		if (!m->lens[i])
			continue;
		sp[k].lo = (uint64_t)start[i];
		sp[k].hi = (uint64_t)start[i] + (uint64_t)m->lens[i];
		sp[k].index = i;
		k++;
	}
	qsort(sp, k, sizeof(*sp), span_cmp);
	for (i = 1; i < k; i++) {
		if (sp[i].lo < sp[i - 1].hi) {
			size_t a = sp[i - 1].index < sp[i].index ? sp[i - 1].index : sp[i].index;
			size_t b = sp[i - 1].index < sp[i].index ? sp[i].index : sp[i - 1].index;

			ret = cu_err(-EINVAL, "pieces %zu and %zu overlap in the %s", a, b,
				     read ? "GPU buffer (two reads into one place)" :
					    "file (two writes to one place)");
			break;
		}
	}
	free(sp);
	return ret;
}

CU_EXPORT int phx_cuda_many_check(const struct phx_cuda_many *m)
{
	int ret;

	if (!m)
		return cu_err(-EINVAL, "phx_cuda_many: NULL argument");
	if (m->size < offsetof(struct phx_cuda_many, reserved))
		return cu_err(-EINVAL, "phx_cuda_many: struct size %u is too small", m->size);
	if (m->op != PHX_OP_READ && m->op != PHX_OP_WRITE)
		return cu_err(-EINVAL, "unknown op %u", m->op);
	if (!m->file)
		return cu_err(-EINVAL, "NULL file");
	if (m->n && (!m->file_offsets || !m->dev_offsets || !m->lens))
		return cu_err(-EINVAL, "%zu pieces without their offset and length arrays", m->n);
	if (m->n && !m->devptr)
		return cu_err(-EINVAL, "NULL GPU address");
	if (m->devptr + m->dev_len < m->devptr)
		return cu_err(-EINVAL, "the GPU buffer wraps around");
	ret = check_values(m);
	if (!ret)
		ret = check_overlap(m);
	return ret;
}

/* The sum of the results, or the first (by index) error. */
static int64_t many_total(const struct phx_cuda_io *ios, size_t n, int64_t *results)
{
	int64_t sum = 0, first_err = 0;
	size_t i;

	for (i = 0; i < n; i++) {
		if (results)
			results[i] = ios[i].result;
		if (ios[i].result < 0 && !first_err)
			first_err = ios[i].result;
		else if (ios[i].result > 0)
			sum += ios[i].result;
	}
	return first_err ? first_err : sum;
}

/*
 * Wait for a group's requests: the @never not accepted (a refusal mid-way)
 * leave the group first; the others wake this thread once, with the last
 * of them.
 */
static void many_wait(phx_cuda *c, struct cu_group *grp, size_t never)
{
	pthread_mutex_lock(&c->done_lock);
	grp->left -= never;
	while (grp->left)
		pthread_cond_wait(&c->done_cond, &c->done_lock);
	pthread_mutex_unlock(&c->done_lock);
}

CU_EXPORT int64_t phx_cuda_many(phx_cuda *c, const struct phx_cuda_many *m)
{
	struct phx_cuda_io *ios, **ptrs;
	struct cu_group grp;
	int64_t t0 = phx_now_ns(), total;
	size_t i, accepted;
	int ret;

	if (!c)
		return cu_err(-EINVAL, "NULL context");
	ret = phx_cuda_many_check(m);
	if (ret)
		return ret;
	stat_add(c, &c->st.many_calls, 1);
	if (!m->n)
		return 0;
	ios = calloc(m->n, sizeof(*ios));
	ptrs = malloc(m->n * sizeof(*ptrs));
	if (!ios || !ptrs) {
		free(ios);
		free(ptrs);
		return cu_err(-ENOMEM, "out of memory for %zu pieces", m->n);
	}
	for (i = 0; i < m->n; i++) {
		phx_cuda_io_prep(&ios[i], m->file, m->op, m->devptr + (uint64_t)m->dev_offsets[i],
				 (size_t)m->lens[i], (uint64_t)m->file_offsets[i]);
		/* a request never accepted keeps these: done, cancelled */
		ios[i].done = 1;
		ios[i].result = -ECANCELED;
		ptrs[i] = &ios[i];
	}
	stat_add(c, &c->st.many_pieces, m->n);
	/* the building is the call's time too; cu_submit_host counts its own */
	stat_add(c, &c->st.ph_call_ns, (uint64_t)(phx_now_ns() - t0));
	grp.left = m->n;
	ret = cu_submit_host(c, ptrs, m->n, m->flags & PHX_CUDA_MANY_AFTER, m->stream, &grp,
			     &accepted);
	many_wait(c, &grp, m->n - accepted);
	/* the refused piece and those after it were never queued */
	for (i = accepted; i < m->n; i++)
		ios[i].result = ret;
	total = many_total(ios, m->n, m->results);
	free(ptrs);
	free(ios);
	return ret ? ret : total;
}

/*
 * The pieces' arguments for stream-ordered calls, copied at the call and
 * read by the pieces when their stream arrives; freed by the last piece's
 * completion call (on the poller's thread: no lock, no CUDA call).
 */
struct many_args {
	int refs;			/* pieces not released, + the call (atomic) */
	int64_t *pending;		/* the caller's ->pending, or NULL */
	size_t *lens;
	int64_t *foff;
	int64_t *doff;
};

static void many_args_drop(struct many_args *a, int refs)
{
	if (__atomic_sub_fetch(&a->refs, refs, __ATOMIC_ACQ_REL) == 0)
		free(a);
}

/* A piece is released (its GPU copies ran): ->pending tells the caller. */
static void many_piece_over(void *arg, int64_t result)
{
	struct many_args *a = arg;

	(void)result;
	if (a->pending)
		__atomic_sub_fetch(a->pending, 1, __ATOMIC_RELEASE);
	many_args_drop(a, 1);
}

static struct many_args *many_args_new(const struct phx_cuda_many *m)
{
	struct many_args *a;
	char *p;
	size_t i;

	a = malloc(sizeof(*a) + m->n * (sizeof(size_t) + 2 * sizeof(int64_t)));
	if (!a)
		return NULL;
	p = (char *)(a + 1);
	a->lens = (size_t *)p;
	a->foff = (int64_t *)(p + m->n * sizeof(size_t));
	a->doff = a->foff + m->n;
	for (i = 0; i < m->n; i++) {
		a->lens[i] = (size_t)m->lens[i];
		a->foff[i] = m->file_offsets[i];
		a->doff[i] = m->dev_offsets[i];
	}
	a->refs = (int)m->n + 1;
	a->pending = m->pending;
	if (a->pending)
		__atomic_store_n(a->pending, (int64_t)m->n, __ATOMIC_RELEASE);
	return a;
}

CU_EXPORT int phx_cuda_many_async(phx_cuda *c, const struct phx_cuda_many *m)
{
	int64_t t0 = phx_now_ns();
	struct many_args *a;
	size_t i;
	int ret;

	if (!c)
		return cu_err(-EINVAL, "NULL context");
	ret = phx_cuda_many_check(m);
	if (ret)
		return ret;
	if (m->n && !m->results)
		return cu_err(-EINVAL, "phx_cuda_many_async needs ->results");
	if (m->n > INT32_MAX - 1)
		return cu_err(-EINVAL, "%zu pieces in one call: at most %d", m->n, INT32_MAX - 1);
	stat_add(c, &c->st.many_calls, 1);
	if (!m->n)
		return 0;
	a = many_args_new(m);
	if (!a)
		return cu_err(-ENOMEM, "out of memory for %zu pieces", m->n);
	for (i = 0; i < m->n; i++)
		m->results[i] = -EINPROGRESS;
	stat_add(c, &c->st.many_pieces, m->n);
	for (i = 0; i < m->n; i++) {
		ret = cu_async_owned(c, m->file, m->op, m->devptr, &a->lens[i], &a->foff[i],
				     &a->doff[i], &m->results[i], m->stream, many_piece_over, a);
		if (ret)
			break;
	}
	if (ret) {
		size_t k;

		for (k = i; k < m->n; k++)
			m->results[k] = ret;
		/* the pieces never queued are over, and drop no reference later */
		if (a->pending)
			__atomic_sub_fetch(a->pending, (int64_t)(m->n - i), __ATOMIC_RELEASE);
		__atomic_sub_fetch(&a->refs, (int)(m->n - i), __ATOMIC_ACQ_REL);
	}
	stat_add(c, &c->st.ph_call_ns, (uint64_t)(phx_now_ns() - t0));
	many_args_drop(a, 1);
	return ret;
}

static int64_t many_plain(phx_cuda *c, uint32_t op, phx_file *f, uint64_t devptr,
			  uint64_t dev_len, const int64_t *fo, const int64_t *dof,
			  const int64_t *lens, size_t n, int64_t *results)
{
	struct phx_cuda_many m;

	memset(&m, 0, sizeof(m));
	m.size = sizeof(m);
	m.op = op;
	m.file = f;
	m.devptr = devptr;
	m.dev_len = dev_len;
	m.n = n;
	m.file_offsets = fo;
	m.dev_offsets = dof;
	m.lens = lens;
	m.results = results;
	return phx_cuda_many(c, &m);
}

CU_EXPORT int64_t phx_cuda_pread_many(phx_cuda *c, phx_file *f, uint64_t devptr,
				      uint64_t dev_len, const int64_t *file_offsets,
				      const int64_t *dev_offsets, const int64_t *lens,
				      size_t n, int64_t *results)
{
	return many_plain(c, PHX_OP_READ, f, devptr, dev_len, file_offsets, dev_offsets,
			  lens, n, results);
}

CU_EXPORT int64_t phx_cuda_pwrite_many(phx_cuda *c, phx_file *f, uint64_t devptr,
				       uint64_t dev_len, const int64_t *file_offsets,
				       const int64_t *dev_offsets, const int64_t *lens,
				       size_t n, int64_t *results)
{
	return many_plain(c, PHX_OP_WRITE, f, devptr, dev_len, file_offsets, dev_offsets,
			  lens, n, results);
}
