/* SPDX-License-Identifier: Apache-2.0 */
/*
 * Description: PHX_* settings are read strictly: a value the parser cannot
 * read (letters, a sign, a trailing unit it does not know, more than 32
 * bits) makes phx_engine_create fail with -EINVAL and a message naming the
 * variable, for every setting libphx reads (engine, CUDA staging, NVMe), so
 * that a typo never runs as the default; readable values (decimal, hex, k/m
 * suffixes) and empty values (= unset) still create an engine.
 */
#include "helpers.h"

static const char *const names[] = {
	"PHX_QUEUE_DEPTH", "PHX_MAX_IO_SIZE", "PHX_BOUNCE_SIZE", "PHX_BOUNCE_COUNT",
	"PHX_SUBMIT_BATCH", "PHX_SPIN_NS", "PHX_CUDA_DEVICE", "PHX_CUDA_LANES",
	"PHX_CUDA_BUFS", "PHX_CUDA_BUF_SIZE", "PHX_CUDA_MAX_IO",
	"PHX_CUDA_NO_BATCH_COPY", "PHX_CUDA_NO_MEMOPS", "PHX_CUDA_EARLY_READS",
	"PHX_CUDA_TRACE", "PHX_CUDA_QUEUE_WAIT_MS", "PHX_NVME_QUEUE_DEPTH",
	"PHX_NVME_QUEUES",
};

static const char *const garbage[] = {
	"abc", "64x", "-1", "+4", " 8", "4g", "0x", "99999999999", "5000000k", "5000m",
};

int main(void)
{
	struct phx_engine_config cfg;
	phx_engine *eng;
	size_t i, j;
	int ret;

	for (i = 0; i < sizeof(names) / sizeof(names[0]); i++)
		unsetenv(names[i]);

	for (i = 0; i < sizeof(names) / sizeof(names[0]); i++) {
		for (j = 0; j < sizeof(garbage) / sizeof(garbage[0]); j++) {
			setenv(names[i], garbage[j], 1);
			eng = NULL;
			ret = phx_engine_create(NULL, &eng);
			T_CHECK(ret == -EINVAL && !eng, "%s=%s: create gave %d",
				names[i], garbage[j], ret);
			T_CHECK(strstr(phx_strerror_last(), names[i]) != NULL,
				"%s=%s: message does not name it: %s", names[i],
				garbage[j], phx_strerror_last());
			/* an explicit configuration does not hide a bad setting */
			phx_engine_config_init(&cfg);
			cfg.queue_depth = 8;
			T_CHECK(phx_engine_create(&cfg, &eng) == -EINVAL,
				"%s=%s with a config", names[i], garbage[j]);
		}
		unsetenv(names[i]);
	}

	/* readable values and empty ones still work */
	setenv("PHX_QUEUE_DEPTH", "0x40", 1);
	setenv("PHX_MAX_IO_SIZE", "256k", 1);
	setenv("PHX_BOUNCE_SIZE", "1M", 1);
	setenv("PHX_SPIN_NS", "", 1);
	setenv("PHX_CUDA_LANES", "4", 1);
	ret = phx_engine_create(NULL, &eng);
	T_CHECK(ret == 0, "create with readable settings: %d", ret);
	phx_engine_config_get(eng, &cfg);
	T_CHECK(cfg.queue_depth == 64 && cfg.max_io_size == 256 * KiB &&
		cfg.bounce_size == MiB, "qd %u max_io %u bounce %u",
		cfg.queue_depth, cfg.max_io_size, cfg.bounce_size);
	T_CHECK(phx_engine_destroy(eng) == 0, "destroy");
	return T_EXIT_PASS;
}
