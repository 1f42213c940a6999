/* SPDX-License-Identifier: Apache-2.0 */
/*
 * Description: a fork() while writes are in flight.  The parent starts a
 * 47 MiB write (its chunks claim their ranges in the process-wide inode
 * table) and forks while it runs; the child opens the same file on a new
 * engine and writes an unaligned piece just past the parent's range, in the
 * same 2 MiB folio region, so that its read-modify-write claim overlaps the
 * parent's last chunks (no byte of it does: the two processes are not
 * serialised against each other).  The child must not inherit the parent's
 * claims (chunks it cannot reap would block it forever): it has 20 s, then
 * fails.  Both writes must land.
 */
#include <signal.h>
#include <sys/wait.h>

#include "helpers.h"

#define BIG (48 * MiB)
#define PART (47 * MiB)	/* the parent's write */
#define AT (PART + 333)	/* the child's piece */
#define PLEN (2 * 4096 + 7)

int main(void)
{
	phx_engine *eng;
	phx_file *f;
	const char *path;
	unsigned char *big = t_alloc(BIG, 4096), *piece = t_alloc(3 * 4096, 64);
	unsigned char *got = t_alloc(BIG, 4096), *orig;
	struct phx_io io, *ios[1] = { &io };
	int status, inflight_at_fork;
	pid_t pid;

	t_seed();
	path = t_path("fork");
	orig = t_random_file(path, BIG);
	t_fill(big, BIG);
	t_fill(piece, 3 * 4096);
	eng = t_engine(NULL);
	f = t_open(eng, path, O_RDWR, 0);
	phx_io_prep(&io, f, PHX_OP_WRITE, big, PART, 0);
	T_CHECK(phx_submit(eng, ios, 1) == 0, "submit");
	inflight_at_fork = !__atomic_load_n(&io.done, __ATOMIC_ACQUIRE);
	pid = fork();
	T_CHECK(pid >= 0, "fork");
	if (pid == 0) {
		phx_engine *ce;
		phx_file *cf;
		int64_t r;

		alarm(20);	/* a child stuck on inherited claims dies here */
		T_CHECK(phx_engine_create(NULL, &ce) == 0, "child engine");
		T_CHECK(phx_file_open(ce, path, O_RDWR, 0, 0, &cf) == 0, "child open");
		/* unaligned: a read-modify-write next to the parent's range */
		r = phx_pwrite(cf, piece + 5, PLEN, AT);
		T_CHECK(r == PLEN, "child write: %" PRId64, r);
		phx_file_close(cf);
		phx_engine_destroy(ce);
		_exit(0);
	}
	T_CHECK(phx_wait(eng, &io, -1) == 0 && io.result == (int64_t)PART,
		"parent write: %" PRId64, io.result);
	T_CHECK(waitpid(pid, &status, 0) == pid, "waitpid");
	T_CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0,
		"child %s %d (write in flight at fork: %d)",
		WIFSIGNALED(status) ? "killed by signal" : "exited with",
		WIFSIGNALED(status) ? WTERMSIG(status) : WEXITSTATUS(status), inflight_at_fork);
	T_CHECK(t_pread(path, got, BIG, 0) == BIG, "read back");
	T_SAME(got, big, PART, "the parent's write");
	T_SAME(got + AT, piece + 5, PLEN, "the child's piece");
	T_SAME(got + PART, orig + PART, AT - PART, "bytes between them");
	T_SAME(got + AT + PLEN, orig + AT + PLEN, BIG - AT - PLEN, "bytes after the piece");
	if (!inflight_at_fork)
		fprintf(stderr, "note: the parent's write had finished before the fork\n");
	phx_file_close(f);
	phx_engine_destroy(eng);
	t_cleanup();
	return T_EXIT_PASS;
}
