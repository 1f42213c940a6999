// SPDX-License-Identifier: Apache-2.0
/*
 * env.c - runtime settings from PHX_* environment variables, read in one
 * place.
 *
 * Every setting is a whole number that fits 32 bits: decimal, 0x hex or 0
 * octal (strtoull base 0), optionally followed by k or m (KiB, MiB).  Unset
 * or empty: the default.  A value the parser cannot read is an error, never
 * a silent default: phx_env_u32() returns the default for it (its callers
 * fill configurations and cannot fail), and phx_env_check(), run where an
 * engine or an NVMe namespace is created, refuses with -EINVAL and a message
 * naming the variable, so that a typo cannot pass for a measurement of the
 * default.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"

/*
 * Every setting libphx reads with phx_env_u32(): what phx_env_check()
 * looks at.  A new phx_env_u32("PHX_...") belongs here too
 * (tests/test_cli.py finds every call in src/ and checks each name).
 */
static const char *const phx_settings[] = {
	/* engine.c */
	"PHX_QUEUE_DEPTH", "PHX_MAX_IO_SIZE", "PHX_BOUNCE_SIZE", "PHX_BOUNCE_COUNT",
	"PHX_SUBMIT_BATCH", "PHX_IO_THREADS",
	/* be_uring.c */
	"PHX_SPIN_NS",
	/* cuda_context.c */
	"PHX_CUDA_DEVICE", "PHX_CUDA_LANES", "PHX_CUDA_BUFS", "PHX_CUDA_BUF_SIZE",
	"PHX_CUDA_MAX_IO", "PHX_CUDA_NO_BATCH_COPY", "PHX_CUDA_NO_MEMOPS",
	"PHX_CUDA_EARLY_READS", "PHX_CUDA_TRACE", "PHX_CUDA_QUEUE_WAIT_MS",
	/* nvme.c */
	"PHX_NVME_QUEUE_DEPTH", "PHX_NVME_QUEUES",
	/* stats_pub.c */
	"PHX_STATS", "PHX_STATS_INTERVAL_MS",
};

/* PHX_ENGINE's values, indexed by enum phx_backend_kind (engine.c). */
const char *const phx_engine_choices[] = { "auto", "uring", "threads", NULL };

/* PHX_URING_SPREAD's values, indexed by enum uring_spread (be_uring.c). */
const char *const phx_spread_choices[] = { "auto", "0", "1", NULL };

/* The settings read with phx_env_choice(): one of a few names each. */
static const struct {
	const char *name;
	const char *const *choices;
} phx_choice_settings[] = {
	{ "PHX_ENGINE", phx_engine_choices },
	{ "PHX_URING_SPREAD", phx_spread_choices },
};

/* 0 and *out on success, -ENOENT when unset or empty, -EINVAL when unreadable. */
static int env_parse(const char *name, uint32_t *out)
{
	const char *s = getenv(name);
	char *end;
	unsigned long long v;

	if (!s || !*s)
		return -ENOENT;
	if (*s == '-' || *s == '+' || *s == ' ' || *s == '\t')
		return -EINVAL;		/* strtoull would take "-1" as 2^64 - 1 */
	errno = 0;
	v = strtoull(s, &end, 0);
	if (errno || end == s)
		return -EINVAL;
	if (*end == 'k' || *end == 'K') {
		if (v > UINT32_MAX >> 10)
			return -EINVAL;
		v <<= 10, end++;
	} else if (*end == 'm' || *end == 'M') {
		if (v > UINT32_MAX >> 20)
			return -EINVAL;
		v <<= 20, end++;
	}
	if (*end || v > UINT32_MAX)
		return -EINVAL;
	*out = (uint32_t)v;
	return 0;
}

uint32_t phx_env_u32(const char *name, uint32_t dflt)
{
	uint32_t v;

	return env_parse(name, &v) ? dflt : v;
}

/* The index of $name's value in @choices, -ENOENT unset or empty, -EINVAL none. */
static int env_choice(const char *name, const char *const *choices)
{
	const char *s = getenv(name);
	int i;

	if (!s || !*s)
		return -ENOENT;
	for (i = 0; choices[i]; i++)
		if (!strcmp(s, choices[i]))
			return i;
	return -EINVAL;
}

uint32_t phx_env_choice(const char *name, const char *const *choices, uint32_t dflt)
{
	int i = env_choice(name, choices);

	return i < 0 ? dflt : (uint32_t)i;
}

/* A choice setting naming none of its choices: -EINVAL, the text lists them. */
static int env_check_choices(void)
{
	size_t i, k, n;
	char list[128];

	for (i = 0; i < sizeof(phx_choice_settings) / sizeof(phx_choice_settings[0]); i++) {
		const char *name = phx_choice_settings[i].name;
		const char *const *ch = phx_choice_settings[i].choices;

		if (env_choice(name, ch) != -EINVAL)
			continue;
		list[0] = 0;
		for (k = 0, n = 0; ch[k] && n < sizeof(list); k++)
			n += snprintf(list + n, sizeof(list) - n, "%s%s", k ? ", " : "", ch[k]);
		return phx_err(-EINVAL, "%s=\"%.40s\" is none of %s; fix or unset it",
			       name, getenv(name), list);
	}
	return 0;
}

int phx_env_check(void)
{
	size_t i;
	uint32_t v;

	for (i = 0; i < sizeof(phx_settings) / sizeof(phx_settings[0]); i++) {
		const char *name = phx_settings[i];

		if (env_parse(name, &v) == -EINVAL)
			return phx_err(-EINVAL,
				       "%s=\"%.40s\" is not a whole number of 32 bits (e.g. 64, 0x40, 4k, 1m); fix or unset it",
				       name, getenv(name));
	}
	return env_check_choices();
}
