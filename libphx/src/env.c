// SPDX-License-Identifier: Apache-2.0
/*
 * env.c - runtime settings from PHX_* environment variables, read in one
 * place.  A value the parser cannot read leaves the default in force.
 */
#include <stdlib.h>

#include "internal.h"

uint32_t phx_env_u32(const char *name, uint32_t dflt)
{
	const char *s = getenv(name);
	char *end;
	unsigned long long v;

	if (!s || !*s)
		return dflt;
	v = strtoull(s, &end, 0);
	if (*end == 'k' || *end == 'K')
		v <<= 10, end++;
	else if (*end == 'm' || *end == 'M')
		v <<= 20, end++;
	if (*end || v > UINT32_MAX)
		return dflt;
	return (uint32_t)v;
}
