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
 * Locking: inode_table_lock protects the hash chains and refs; each inode's
 * own lock protects its range lists and is a leaf lock (callers may hold an
 * engine lock; nothing is taken while an inode lock is held).
 */
#include <errno.h>
#include <stdlib.h>
#include <sys/stat.h>

#include "internal.h"

#define INODE_BUCKETS 64u

struct phx_inode {
	dev_t dev;		/* st_dev, or st_rdev of a block device */
	ino_t ino;		/* st_ino, or 0 for a block device */
	bool blk;
	uint32_t refs;		/* files attached (inode_table_lock) */
	pthread_mutex_t lock;
	struct wrange *claims[WC_COUNT];	/* writes in flight, by class */
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
	if (--n->refs) {
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
	free(n);
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
