/* SPDX-License-Identifier: Apache-2.0 */
/*
 * fake_check.h - what the C tests against fake_cuda.c share: sizes and a
 * CHECK() that counts a failure, says where, and adds libphx's last CUDA
 * error (the driver call it names is usually the answer).  Each test is one
 * program: failures is that program's count, its exit status.
 */
#ifndef PHX_FAKE_CHECK_H
#define PHX_FAKE_CHECK_H

#include <stdio.h>

#include "phx_cuda.h"

#define KiB 1024ull
#define MiB (1024ull * 1024)

static int failures;

#define CHECK(cond, ...)                                                     \
	do {                                                                 \
		if (!(cond)) {                                               \
			fprintf(stderr, "FAIL %s:%d: ", __FILE__, __LINE__); \
			fprintf(stderr, __VA_ARGS__);                        \
			fprintf(stderr, " [%s]\n", phx_cuda_strerror_last()); \
			failures++;                                          \
		}                                                            \
	} while (0)

#endif /* PHX_FAKE_CHECK_H */
