// SPDX-License-Identifier: Apache-2.0
/*
 * log.c - libphxfile's log lines: one line each on stderr, prefixed
 * "phxfile:", so that they land in LMCache's server log.  Written with one
 * write(2) so lines from several threads never interleave.
 */
#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <unistd.h>

#include "internal.h"

void pf_log(const char *fmt, ...)
{
	char line[1024];
	int saved = errno, n = snprintf(line, sizeof(line), "phxfile: ");
	va_list ap;

	va_start(ap, fmt);
	n += vsnprintf(line + n, sizeof(line) - n - 1, fmt, ap);
	va_end(ap);
	if (n > (int)sizeof(line) - 2)
		n = sizeof(line) - 2;
	line[n++] = '\n';
	/* a failed write has nowhere else to be reported */
	n = (int)write(STDERR_FILENO, line, n);
	errno = saved;
}

const char *pf_path_name(uint32_t path)
{
	switch (path) {
	case PHXFILE_PATH_STAGING:
		return "staging";
	case PHXFILE_PATH_DIRECT:
		return "direct";
	default:
		return "none";
	}
}
