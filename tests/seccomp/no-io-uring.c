// SPDX-License-Identifier: Apache-2.0
/*
 * no-io-uring - run a command in a process whose seccomp filter refuses
 * io_uring, as the default profiles of Docker and containerd do.
 *
 *   no-io-uring [--errno NAME] COMMAND [ARG...]
 *
 * io_uring_setup, io_uring_enter and io_uring_register fail with EPERM
 * (what those profiles return; --errno ENOSYS for sandboxes that do not
 * implement io_uring); every other system call is allowed.  The filter is
 * inherited by everything the command starts.  Built with libseccomp
 * (Debian's libseccomp-dev) by tests/seccomp/seccomp.mk.
 */
#include <errno.h>
#include <seccomp.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

static int filter_load(int err)
{
	static const char *const calls[] = { "io_uring_setup", "io_uring_enter",
					     "io_uring_register" };
	scmp_filter_ctx ctx = seccomp_init(SCMP_ACT_ALLOW);
	size_t i;
	int ret = 0;

	if (!ctx)
		return -ENOMEM;
	for (i = 0; i < sizeof(calls) / sizeof(calls[0]) && !ret; i++) {
		int nr = seccomp_syscall_resolve_name(calls[i]);

		ret = nr == __NR_SCMP_ERROR ? -ENOSYS :
		      seccomp_rule_add(ctx, SCMP_ACT_ERRNO(err), nr, 0);
	}
	/* seccomp_load sets no_new_privs first (SCMP_FLTATR_CTL_NNP, the default) */
	if (!ret)
		ret = seccomp_load(ctx);
	seccomp_release(ctx);
	return ret;
}

int main(int argc, char **argv)
{
	int err = EPERM, arg = 1, ret;

	if (argc > 2 && !strcmp(argv[1], "--errno")) {
		if (!strcmp(argv[2], "ENOSYS"))
			err = ENOSYS;
		else if (strcmp(argv[2], "EPERM")) {
			fprintf(stderr, "no-io-uring: --errno EPERM or ENOSYS, not %s\n", argv[2]);
			return 2;
		}
		arg = 3;
	}
	if (arg >= argc) {
		fprintf(stderr, "usage: no-io-uring [--errno EPERM|ENOSYS] COMMAND [ARG...]\n");
		return 2;
	}
	ret = filter_load(err);
	if (ret) {
		fprintf(stderr, "no-io-uring: cannot load the seccomp filter: %s\n", strerror(-ret));
		return 1;
	}
	execvp(argv[arg], argv + arg);
	fprintf(stderr, "no-io-uring: %s: %s\n", argv[arg], strerror(errno));
	return 127;
}
