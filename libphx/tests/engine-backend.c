/* SPDX-License-Identifier: Apache-2.0 */
/*
 * Description: choosing the backend (issue 24).  phx_backend_check() names
 * both and reports io_uring's availability; an engine asked for threads
 * (config or PHX_ENGINE) runs on threads and says why, without fixed files
 * or buffers; PHX_ENGINE that names no backend is refused (-EINVAL, the
 * text names it); io_threads out of range is refused.  Then, in child
 * processes whose seccomp filter refuses io_uring_setup (EPERM, as
 * containers' default profiles do, and ENOSYS), an automatic engine falls
 * back to threads, says why and moves the right bytes (aligned, unaligned,
 * short read at EOF), while an engine asked for io_uring only fails with
 * that errno.  The filter is raw BPF so that this test needs no libseccomp
 * (tests/seccomp/ runs whole suites under libseccomp's).  A forked child
 * cannot use its parent's threads engine (-ECHILD, no hang) but can
 * destroy it and make its own.  The eventfd stays readable while phx_poll()
 * leaves completed requests behind.
 */
#include <linux/audit.h>
#include <linux/filter.h>
#include <linux/seccomp.h>
#include <poll.h>
#include <stddef.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <sys/wait.h>

#include "helpers.h"

#if defined(__x86_64__)
#define T_AUDIT_ARCH AUDIT_ARCH_X86_64
#elif defined(__aarch64__)
#define T_AUDIT_ARCH AUDIT_ARCH_AARCH64
#endif

static phx_engine *engine_on(uint32_t backend, uint32_t io_threads)
{
	struct phx_engine_config cfg;
	phx_engine *eng = NULL;
	int ret;

	phx_engine_config_init(&cfg);
	cfg.backend = backend;
	cfg.io_threads = io_threads;
	ret = phx_engine_create(&cfg, &eng);
	T_CHECK(ret == 0, "create on backend %u: %d", backend, ret);
	return eng;
}

/* Bytes through @eng: aligned, unaligned, a write, a short read at EOF. */
static void bytes_check(phx_engine *eng, const char *tag)
{
	size_t n = 3 * MiB + 1234;
	const char *path = t_path(tag);
	unsigned char *data = t_random_file(path, n);
	unsigned char *buf = t_alloc(4 * MiB, 4096), *mine = t_alloc(70000, 64);
	phx_file *f = t_open(eng, path, O_RDWR, 0);

	T_CHECK(phx_pread(f, buf, 2 * MiB, 0) == (int64_t)(2 * MiB), "aligned read");
	T_SAME(buf, data, 2 * MiB, "aligned read");
	T_CHECK(phx_pread(f, buf + 3, 100001, 4097) == 100001, "unaligned read");
	T_SAME(buf + 3, data + 4097, 100001, "unaligned read");
	t_fill(mine, 70000);
	T_CHECK(phx_pwrite(f, mine + 1, 69999, 12345) == 69999, "unaligned write");
	memcpy(data + 12345, mine + 1, 69999);
	T_CHECK(phx_pread(f, buf, 4 * MiB, 0) == (int64_t)n, "short read at EOF");
	T_SAME(buf, data, n, "whole file");
	T_CHECK(phx_file_close(f) == 0, "close");
	T_CHECK(t_pread(path, buf, n, 0) == (ssize_t)n, "reference read");
	T_SAME(buf, data, n, "file on disk");
	free(data); free(buf); free(mine);
}

static void selection(void)
{
	struct phx_engine_config cfg;
	struct phx_file_info fi;
	const char *name = NULL, *desc = NULL;
	phx_engine *eng;
	phx_file *f;
	int ret;

	T_CHECK(phx_backend_check(PHX_BACKEND_THREADS, &name, &desc) == 0, "threads check");
	T_CHECK(!strcmp(name, "threads") && desc && *desc, "threads name %s", name);
	ret = phx_backend_check(PHX_BACKEND_URING, &name, NULL);
	T_CHECK(!strcmp(name, "uring"), "uring name %s", name);
	T_CHECK(ret == 0 || strstr(phx_strerror_last(), "io_uring_setup"), "uring check %d: %s",
		ret, phx_strerror_last());
	T_CHECK(phx_backend_check(PHX_BACKEND_AUTO, NULL, NULL) == -EINVAL, "auto is no backend");
	T_CHECK(phx_backend_check(7, NULL, NULL) == -EINVAL, "kind 7");

	eng = engine_on(PHX_BACKEND_THREADS, 0);
	T_CHECK(!strcmp(phx_engine_backend(eng), "threads"), "backend %s", phx_engine_backend(eng));
	T_CHECK(strstr(phx_engine_backend_reason(eng), "asked for"), "reason %s",
		phx_engine_backend_reason(eng));
	T_CHECK(phx_engine_features(eng) == PHX_FEAT_USER_BUFS, "threads features 0x%x",
		phx_engine_features(eng));
	f = t_open(eng, t_path("sel"), O_RDWR | O_CREAT, 0);
	T_CHECK(phx_file_get_info(f, &fi) == 0 && !fi.registered, "no fixed files on threads");
	phx_file_close(f);
	bytes_check(eng, "threads");
	T_CHECK(phx_engine_destroy(eng) == 0, "destroy");

	/* two workers at most, a queue four times deeper: everything still moves */
	eng = engine_on(PHX_BACKEND_THREADS, 2);
	bytes_check(eng, "two");
	T_CHECK(phx_engine_destroy(eng) == 0, "destroy");

	if (ret == 0) {
		eng = engine_on(PHX_BACKEND_URING, 0);
		T_CHECK(!strcmp(phx_engine_backend(eng), "uring"), "backend %s", phx_engine_backend(eng));
		T_CHECK(strstr(phx_engine_backend_reason(eng), "succeeded"), "reason %s",
			phx_engine_backend_reason(eng));
		T_CHECK(phx_engine_destroy(eng) == 0, "destroy");
	}

	setenv("PHX_ENGINE", "threads", 1);
	phx_engine_config_init(&cfg);
	T_CHECK(cfg.backend == PHX_BACKEND_THREADS, "PHX_ENGINE=threads gave %u", cfg.backend);
	T_CHECK(phx_engine_create(NULL, &eng) == 0, "create");
	T_CHECK(!strcmp(phx_engine_backend(eng), "threads"), "PHX_ENGINE=threads: %s",
		phx_engine_backend(eng));
	phx_engine_destroy(eng);
	setenv("PHX_ENGINE", "thread", 1);
	T_CHECK(phx_engine_create(NULL, &eng) == -EINVAL, "PHX_ENGINE=thread accepted");
	T_CHECK(strstr(phx_strerror_last(), "PHX_ENGINE"), "message %s", phx_strerror_last());
	unsetenv("PHX_ENGINE");

	phx_engine_config_init(&cfg);
	cfg.io_threads = 5000;
	T_CHECK(phx_engine_create(&cfg, &eng) == -EINVAL, "io_threads 5000 accepted");
}

#ifdef T_AUDIT_ARCH
/* Refuse io_uring_setup/enter/register with @err, allow everything else. */
static int refuse_io_uring(int err)
{
	struct sock_filter prog[] = {
		BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(struct seccomp_data, arch)),
		BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, T_AUDIT_ARCH, 1, 0),
		BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW),
		BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(struct seccomp_data, nr)),
		BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, __NR_io_uring_setup, 3, 0),
		BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, __NR_io_uring_enter, 2, 0),
		BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, __NR_io_uring_register, 1, 0),
		BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW),
		BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ERRNO | (err & SECCOMP_RET_DATA)),
	};
	struct sock_fprog fp = { .len = sizeof(prog) / sizeof(prog[0]), .filter = prog };

	if (prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0))
		return -errno;
	return prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, &fp) ? -errno : 0;
}

/* In a child: the fall-back under a filter that refuses io_uring with @err. */
static void fallback(int err)
{
	struct phx_engine_config cfg;
	phx_engine *eng = NULL;

	T_CHECK(refuse_io_uring(err) == 0, "seccomp filter: %s", strerror(errno));
	T_CHECK(syscall(__NR_io_uring_setup, 1, NULL) == -1 && errno == err,
		"io_uring_setup not refused with %d", err);
	T_CHECK(phx_backend_check(PHX_BACKEND_URING, NULL, NULL) == -err, "uring check");
	T_CHECK(strstr(phx_strerror_last(), strerror(err)), "check text %s", phx_strerror_last());

	phx_engine_config_init(&cfg);
	cfg.backend = PHX_BACKEND_URING;
	T_CHECK(phx_engine_create(&cfg, &eng) == -err, "io_uring only: not %d", -err);

	T_CHECK(phx_engine_create(NULL, &eng) == 0, "automatic engine under the filter");
	T_CHECK(!strcmp(phx_engine_backend(eng), "threads"), "fell back to %s",
		phx_engine_backend(eng));
	T_CHECK(strstr(phx_engine_backend_reason(eng), "io_uring unavailable") &&
		strstr(phx_engine_backend_reason(eng), strerror(err)), "reason %s",
		phx_engine_backend_reason(eng));
	bytes_check(eng, "fallback");
	T_CHECK(phx_engine_destroy(eng) == 0, "destroy");
	exit(T_EXIT_PASS);
}

static void fallback_in_child(int err)
{
	int st;
	pid_t pid = fork();

	T_CHECK(pid >= 0, "fork");
	if (!pid)
		fallback(err);
	T_CHECK(waitpid(pid, &st, 0) == pid, "waitpid");
	T_CHECK(WIFEXITED(st) && WEXITSTATUS(st) == 0, "fall-back child (errno %d) status 0x%x",
		err, st);
}
#endif

/*
 * fork() copies no I/O thread: in the child the parent's threads engine
 * fails (-ECHILD) instead of waiting forever, is destroyed at once, and a
 * new engine works; the parent's goes on.
 */
static void forked(void)
{
	phx_engine *eng = engine_on(PHX_BACKEND_THREADS, 0);
	const char *path = t_path("fork");
	unsigned char *data = t_random_file(path, MiB), *buf = t_alloc(MiB, 4096);
	phx_file *f = t_open(eng, path, O_RDONLY, 0);
	pid_t pid;
	int st;

	T_CHECK(phx_pread(f, buf, MiB, 0) == (int64_t)MiB, "read before fork");
	pid = fork();
	T_CHECK(pid >= 0, "fork");
	if (!pid) {
		alarm(20);	/* a hang fails the test */
		T_CHECK(phx_pread(f, buf, 4096, 0) == -ECHILD, "parent's engine in the child");
		T_CHECK(phx_engine_destroy(eng) == 0, "destroy the parent's engine in the child");
		eng = engine_on(PHX_BACKEND_THREADS, 0);
		bytes_check(eng, "child");
		T_CHECK(phx_engine_destroy(eng) == 0, "destroy");
		exit(T_EXIT_PASS);
	}
	T_CHECK(waitpid(pid, &st, 0) == pid, "waitpid");
	T_CHECK(WIFEXITED(st) && WEXITSTATUS(st) == 0, "forked child status 0x%x", st);
	memset(buf, 0, MiB);
	T_CHECK(phx_pread(f, buf, MiB, 0) == (int64_t)MiB, "read after fork");
	T_SAME(buf, data, MiB, "parent after fork");
	T_CHECK(phx_engine_destroy(eng) == 0, "destroy");
	free(data); free(buf);
}

/*
 * The eventfd stays readable while phx_poll() leaves completed requests
 * behind: on threads every completion may be published (and counted on the
 * eventfd) before the caller reads it, so a caller that reads, then polls
 * 64 at a time, must be woken for the rest.
 */
static void eventfd_rearm(void)
{
	enum { N = 200 };
	phx_engine *eng = engine_on(PHX_BACKEND_THREADS, 0);
	const char *path = t_path("efd");
	unsigned char *data = t_random_file(path, N * 4096), *buf = t_alloc(N * 4096, 4096);
	phx_file *f = t_open(eng, path, O_RDONLY, 0);
	struct phx_io ios[N], *ptrs[N], *done[64];
	struct pollfd pfd;
	int efd = phx_engine_eventfd(eng), got = 0, i, n;
	uint64_t v;

	T_CHECK(efd >= 0, "eventfd");
	for (i = 0; i < N; i++) {
		phx_io_prep(&ios[i], f, PHX_OP_READ, buf + i * 4096, 4096, (uint64_t)i * 4096);
		ptrs[i] = &ios[i];
	}
	T_CHECK(phx_submit(eng, ptrs, N) == 0, "submit");
	for (i = 0; i < N; i++)	/* workers complete them with nobody polling */
		while (!__atomic_load_n(&ios[i].done, __ATOMIC_ACQUIRE))
			usleep(100);
	while (got < N) {
		pfd.fd = efd;
		pfd.events = POLLIN;
		T_CHECK(poll(&pfd, 1, 0) == 1, "eventfd not readable with %d of %d handed back", got, N);
		(void)!read(efd, &v, sizeof(v));
		n = phx_poll(eng, done, 64);
		T_CHECK(n > 0, "phx_poll %d", n);
		got += n;
	}
	T_SAME(buf, data, N * 4096, "async reads");
	T_CHECK(phx_file_close(f) == 0, "close");
	T_CHECK(phx_engine_destroy(eng) == 0, "destroy");
	free(data); free(buf);
}

int main(void)
{
	t_seed();
	unsetenv("PHX_ENGINE");
	selection();
	eventfd_rearm();
	forked();
#ifdef T_AUDIT_ARCH
	fallback_in_child(EPERM);
	fallback_in_child(ENOSYS);
#endif
	return T_EXIT_PASS;
}
