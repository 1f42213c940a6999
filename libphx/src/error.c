// SPDX-License-Identifier: Apache-2.0
/*
 * error.c - the per-thread text of the last error, and the version string.
 * Functions return -errno; the text says what, in the caller's terms.
 */
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include "internal.h"

static __thread char last_error[512];

int phx_err(int err, const char *fmt, ...)
{
	va_list ap;
	int n;

	va_start(ap, fmt);
	n = vsnprintf(last_error, sizeof(last_error), fmt, ap);
	va_end(ap);
	if (n >= 0 && (size_t)n < sizeof(last_error) && err < 0)
		snprintf(last_error + n, sizeof(last_error) - n, ": %s",
			 strerror(-err));
	return err;
}

PHX_EXPORT const char *phx_strerror_last(void)
{
	return last_error;
}

PHX_EXPORT const char *phx_version(void)
{
#define PHX_STR2(x) #x
#define PHX_STR(x) PHX_STR2(x)
	return PHX_STR(PHX_VERSION_MAJOR) "." PHX_STR(PHX_VERSION_MINOR) "."
		PHX_STR(PHX_VERSION_PATCH);
}
