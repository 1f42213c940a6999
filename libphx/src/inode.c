// SPDX-License-Identifier: Apache-2.0
/*
 * inode.c - which byte ranges of a file are being written right now, across
 * every handle, engine and GPU lane of the process.
 *
 * Writes come in three classes (enum wclass):
 *   WC_DIRECT    whole blocks, O_DIRECT, exact range;
 *   WC_RMW       a partial block read, merged and written back with
 *                O_DIRECT - or, where the file ends inside it, handed to the
 *                page cache (io.c);
 *   WC_PAGECACHE bytes written through the page cache.
 * An RMW undoes any other write that lands in its blocks between its read
 * and its write.  A page-cache write reads a folio, dirties it, and writes it
 * back later; an O_DIRECT write into that folio meanwhile either finds it
 * dirty (the kernel cannot drop it afterwards, reports "Page cache
 * invalidation failure on direct I/O", records -EIO on the file and leaves a
 * stale folio) or is overwritten by its writeback.  So RMW and page-cache
 * claims cover their range rounded out to the largest folio the page cache
 * may use (PMD size: 2 MiB on x86-64), and:
 *
 *   two claims of one class, WC_DIRECT or WC_PAGECACHE -> no conflict
 *     (overlapping direct writes are unordered; the kernel orders
 *     page-cache writes itself);
 *   any other pair, overlapping                        -> the later waits.
 *
 * The table is the one piece of process-wide state in libphx, and it has to
 * be: the thing it protects, the kernel's inode, is shared by every
 * descriptor of the process, however it was opened.  Other processes are not
 * covered (the kernel gives O_DIRECT no such guarantee either).
 *
 * Two more things live here because they are about the inode, whoever
 * writes it:
 *   the write log: every claim is logged with a generation number, and GPU
 *     writes accepted but not yet issued register their range as pending,
 *     so that an early GPU read (cuda_stream.c) can tell whether any write
 *     through libphx in this process touched its range since it began;
 *   bad ranges: a write that failed leaves its range refused to readers
 *     until a later write of it succeeds (an I/O error must never turn into
 *     data someone reads).  An entry with bad ranges outlives its last file,
 *     so that closing and reopening the file does not forget them.
 *
 * Locking: inode_table_lock protects the hash chains and refs; each inode's
 * own lock protects its range lists and is a leaf lock (callers may hold an
 * engine lock or a GPU context's lock; nothing is taken while an inode lock
 * is held).
 */
#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "internal.h"

#define INODE_BUCKETS 64u
#define WLOG 1024u		/* writes remembered for early reads */

struct brange {
	uint64_t off, end;
};

struct phx_inode {
	dev_t dev;		/* st_dev, or st_rdev of a block device */
	ino_t ino;		/* st_ino, or 0 for a block device */
	bool blk;
	uint32_t refs;		/* files attached (inode_table_lock) */
	pthread_mutex_t lock;
	struct wrange *claims[WC_COUNT];	/* writes in flight, by class */
	struct phx_wpend *pending;	/* GPU writes accepted, not yet issued */
	uint64_t wgen;		/* writes logged so far */
	struct brange wlog[WLOG];	/* the last WLOG of them: wlog[gen % WLOG] */
	struct brange *bad;	/* sorted, disjoint */
	uint32_t nbad, capbad;	/* nbad read without the lock as a hint */
	struct phx_inode *next;	/* hash chain */
};

static pthread_mutex_t inode_table_lock = PTHREAD_MUTEX_INITIALIZER;
static struct phx_inode *inode_table[INODE_BUCKETS];
static pthread_once_t inode_table_once = PTHREAD_ONCE_INIT;

/*
 * A child of fork() starts with a fresh table: the parent's claims belong
 * to chunks in flight on rings the child cannot reap, and would block its
 * own writes to those files forever.  The old entries are left to whatever
 * inherited handles still point at them (a ring is not usable across fork
 * anyway); the lock may have been held by another thread at the fork.
 */
static void inode_table_forget(void)
{
	unsigned b;

	pthread_mutex_init(&inode_table_lock, NULL);
	for (b = 0; b < INODE_BUCKETS; b++)
		inode_table[b] = NULL;
}

static void inode_table_init(void)
{
	pthread_atfork(NULL, NULL, inode_table_forget);
}

static unsigned inode_bucket(dev_t dev, ino_t ino)
{
	uint64_t h = (uint64_t)dev * 0x9e3779b97f4a7c15ull ^ (uint64_t)ino;

	return (unsigned)(h ^ h >> 29) % INODE_BUCKETS;
}

/*
 * The entry of the inode @st describes (fstat of a descriptor).  Block
 * devices are keyed by the device they name, so two device nodes of one
 * disk share an entry.
 */
int inode_get(const struct stat *st, struct phx_inode **out)
{
	struct phx_inode *n;
	bool blk = S_ISBLK(st->st_mode);
	dev_t dev = blk ? st->st_rdev : st->st_dev;
	ino_t ino = blk ? 0 : st->st_ino;
	unsigned b;

	pthread_once(&inode_table_once, inode_table_init);
	b = inode_bucket(dev, ino);
	pthread_mutex_lock(&inode_table_lock);
	for (n = inode_table[b]; n; n = n->next)
		if (n->dev == dev && n->ino == ino && n->blk == blk)
			break;
	if (!n) {
		n = calloc(1, sizeof(*n));
		if (!n) {
			pthread_mutex_unlock(&inode_table_lock);
			return phx_err(-ENOMEM, "out of memory");
		}
		n->dev = dev;
		n->ino = ino;
		n->blk = blk;
		pthread_mutex_init(&n->lock, NULL);
		n->next = inode_table[b];
		inode_table[b] = n;
	}
	n->refs++;
	pthread_mutex_unlock(&inode_table_lock);
	*out = n;
	return 0;
}

void inode_put(struct phx_inode *n)
{
	struct phx_inode **pp;

	if (!n)
		return;
	pthread_mutex_lock(&inode_table_lock);
	/* bad ranges must survive a close and reopen: the entry stays */
	if (--n->refs || __atomic_load_n(&n->nbad, __ATOMIC_ACQUIRE)) {
		pthread_mutex_unlock(&inode_table_lock);
		return;
	}
	for (pp = &inode_table[inode_bucket(n->dev, n->ino)]; *pp; pp = &(*pp)->next) {
		if (*pp == n) {
			*pp = n->next;
			break;
		}
	}
	pthread_mutex_unlock(&inode_table_lock);
	pthread_mutex_destroy(&n->lock);
	free(n->bad);
	free(n);
}

bool inode_is_blk(const struct phx_inode *n)
{
	return n->blk;
}

/* The first range on @list overlapping [off, off + len), or NULL. */
static const struct wrange *overlap(const struct wrange *list, uint64_t off,
				    uint64_t len)
{
	for (; list; list = list->next)
		if (off < list->off + list->len && list->off < off + len)
			return list;
	return NULL;
}

/* Note a write of [off, off + len) in the log (n->lock held). */
static void wlog_locked(struct phx_inode *n, uint64_t off, uint64_t len)
{
	struct brange *e = &n->wlog[n->wgen % WLOG];

	e->off = off;
	e->end = off + len;
	__atomic_store_n(&n->wgen, n->wgen + 1, __ATOMIC_RELEASE);
}

static bool classes_conflict(enum wclass a, enum wclass b)
{
	return a != b || a == WC_RMW;
}

/*
 * Claim @r (off, len, class and owner filled in) for a write about to be
 * issued.  Returns 0 when claimed, or -EBUSY when a conflicting claim is in
 * flight; then *@foreign says whether that claim belongs to another owner
 * (whose completion the caller will not see by itself).
 */
int inode_claim(struct phx_inode *n, struct wrange *r, bool *foreign)
{
	const struct wrange *hit = NULL;
	int c;

	pthread_mutex_lock(&n->lock);
	for (c = 0; c < WC_COUNT && !hit; c++)
		if (classes_conflict(r->wclass, c))
			hit = overlap(n->claims[c], r->off, r->len);
	if (hit) {
		*foreign = hit->owner != r->owner;
		pthread_mutex_unlock(&n->lock);
		return -EBUSY;
	}
	r->prev = NULL;
	r->next = n->claims[r->wclass];
	if (r->next)
		r->next->prev = r;
	n->claims[r->wclass] = r;
	r->claimed = true;
	wlog_locked(n, r->off, r->len);
	pthread_mutex_unlock(&n->lock);
	return 0;
}

void inode_release(struct phx_inode *n, struct wrange *r)
{
	if (!r->claimed)
		return;
	pthread_mutex_lock(&n->lock);
	if (r->prev)
		r->prev->next = r->next;
	else
		n->claims[r->wclass] = r->next;
	if (r->next)
		r->next->prev = r->prev;
	pthread_mutex_unlock(&n->lock);
	r->claimed = false;
}

/* ------------------------------------------------------------------------ */
/* The write log (early GPU reads)                                          */
/* ------------------------------------------------------------------------ */

uint64_t inode_wgen(struct phx_inode *n)
{
	uint64_t g;

	pthread_mutex_lock(&n->lock);
	g = n->wgen;
	pthread_mutex_unlock(&n->lock);
	return g;
}

static bool hits(uint64_t a0, uint64_t a1, uint64_t off, uint64_t len)
{
	return off < a1 && a0 < off + len;
}

bool inode_write_busy(struct phx_inode *n, uint64_t off, uint64_t len)
{
	const struct phx_wpend *w;
	bool busy = false;
	int c;

	pthread_mutex_lock(&n->lock);
	for (c = 0; c < WC_COUNT && !busy; c++)
		busy = overlap(n->claims[c], off, len) != NULL;
	for (w = n->pending; w && !busy; w = w->next)
		busy = hits(w->off, w->off + w->len, off, len);
	pthread_mutex_unlock(&n->lock);
	return busy;
}

bool inode_written_since(struct phx_inode *n, uint64_t gen, uint64_t off, uint64_t len)
{
	bool hit = false;
	uint64_t g;

	pthread_mutex_lock(&n->lock);
	if (n->wgen - gen > WLOG) {
		hit = true;	/* forgotten: assume the worst */
	} else {
		for (g = gen; g < n->wgen && !hit; g++)
			hit = hits(n->wlog[g % WLOG].off, n->wlog[g % WLOG].end, off, len);
	}
	pthread_mutex_unlock(&n->lock);
	return hit;
}

void inode_pend_add(struct phx_inode *n, struct phx_wpend *w, uint64_t off, uint64_t len)
{
	pthread_mutex_lock(&n->lock);
	w->off = off;
	w->len = len;
	w->prev = NULL;
	w->next = n->pending;
	if (w->next)
		w->next->prev = w;
	n->pending = w;
	w->on = true;
	wlog_locked(n, off, len);
	pthread_mutex_unlock(&n->lock);
}

/* The write's range as its stream found it (logged again: it may be new). */
void inode_pend_move(struct phx_inode *n, struct phx_wpend *w, uint64_t off, uint64_t len)
{
	pthread_mutex_lock(&n->lock);
	if (w->on && (w->off != off || w->len != len)) {
		w->off = off;
		w->len = len;
		wlog_locked(n, off, len);
	}
	pthread_mutex_unlock(&n->lock);
}

void inode_pend_del(struct phx_inode *n, struct phx_wpend *w)
{
	pthread_mutex_lock(&n->lock);
	if (w->on) {
		if (w->prev)
			w->prev->next = w->next;
		else
			n->pending = w->next;
		if (w->next)
			w->next->prev = w->prev;
		w->on = false;
	}
	pthread_mutex_unlock(&n->lock);
}

/* ------------------------------------------------------------------------ */
/* Bad ranges                                                               */
/* ------------------------------------------------------------------------ */

static bool bad_grow(struct phx_inode *n, uint32_t need)
{
	uint32_t cap = n->capbad ? n->capbad : 8;
	struct brange *nb;

	if (need <= n->capbad)
		return true;
	while (cap < need)
		cap *= 2;
	nb = realloc(n->bad, cap * sizeof(*nb));
	if (!nb)
		return false;
	n->bad = nb;
	n->capbad = cap;
	return true;
}

/* Take [off, end) out of the bad list (n->lock held). */
static void bad_clear_locked(struct phx_inode *n, uint64_t off, uint64_t end)
{
	uint32_t i, k = 0;

	for (i = 0; i < n->nbad; i++) {
		struct brange b = n->bad[i];

		if (b.end <= off || b.off >= end) {
			n->bad[k++] = b;
			continue;
		}
		if (b.off < off && b.end > end) {
			/*
			 * Strictly inside one range, so no other range touches
			 * [off, end) (they are disjoint): it splits in two, and the
			 * rest of the list stays as it is.  Without memory for the
			 * split it stays bad whole: refusing too much is safe.
			 */
			if (!bad_grow(n, n->nbad + 1))
				return;
			memmove(&n->bad[i + 2], &n->bad[i + 1], (n->nbad - i - 1) * sizeof(*n->bad));
			n->bad[i] = (struct brange){ b.off, off };
			n->bad[i + 1] = (struct brange){ end, b.end };
			__atomic_store_n(&n->nbad, n->nbad + 1, __ATOMIC_RELEASE);
			return;
		}
		if (b.off < off)
			n->bad[k++] = (struct brange){ b.off, off };
		else if (b.end > end)
			n->bad[k++] = (struct brange){ end, b.end };
		/* else covered whole: dropped */
	}
	__atomic_store_n(&n->nbad, k, __ATOMIC_RELEASE);
}

/* Add [off, end), merging what it touches (n->lock held); false without memory. */
static bool bad_add_locked(struct phx_inode *n, uint64_t off, uint64_t end)
{
	uint32_t i, k = 0;

	if (!bad_grow(n, n->nbad + 1))
		return false;
	for (i = 0; i < n->nbad; i++) {
		struct brange b = n->bad[i];

		if (b.end < off || b.off > end) {
			n->bad[k++] = b;
			continue;
		}
		off = b.off < off ? b.off : off;
		end = b.end > end ? b.end : end;
	}
	for (i = k; i > 0 && n->bad[i - 1].off > off; i--)
		n->bad[i] = n->bad[i - 1];
	n->bad[i] = (struct brange){ off, end };
	__atomic_store_n(&n->nbad, k + 1, __ATOMIC_RELEASE);
	return true;
}

bool inode_write_result(struct phx_inode *n, uint64_t off, uint64_t len, bool ok)
{
	bool marked = false;

	if (!len)
		return false;
	if (ok && !__atomic_load_n(&n->nbad, __ATOMIC_ACQUIRE))
		return false;
	pthread_mutex_lock(&n->lock);
	if (ok)
		bad_clear_locked(n, off, off + len);
	else
		marked = bad_add_locked(n, off, off + len);
	pthread_mutex_unlock(&n->lock);
	/*
	 * Without memory to note it the range cannot be refused later: the
	 * failure itself was still reported to the writer.
	 */
	return marked;
}

int inode_bad_check(struct phx_inode *n, uint64_t off, uint64_t len)
{
	uint64_t b0 = 0, b1 = 0;
	bool hit = false;
	uint32_t i;

	if (!len || !__atomic_load_n(&n->nbad, __ATOMIC_ACQUIRE))
		return 0;
	pthread_mutex_lock(&n->lock);
	for (i = 0; i < n->nbad && !hit; i++) {
		if (hits(n->bad[i].off, n->bad[i].end, off, len)) {
			hit = true;
			b0 = n->bad[i].off;
			b1 = n->bad[i].end;
		}
	}
	pthread_mutex_unlock(&n->lock);
	if (!hit)
		return 0;
	return phx_err(-EIO, "bytes %llu..%llu of the file are bad: the last write to them failed, so reading them would return stale or torn data",
		       (unsigned long long)b0, (unsigned long long)b1);
}
