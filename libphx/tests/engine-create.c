/* SPDX-License-Identifier: Apache-2.0 */
/*
 * Description: engine create/destroy with default, environment-driven and
 * explicit configurations (every combination of the PHX_ENGINE_* flags), the
 * configuration in force reported back, features reported, an engine that
 * does I/O after each create, and invalid configurations refused with
 * -EINVAL (never a crash).
 */
#include "helpers.h"

static void do_io(phx_engine *eng, const char *path, const unsigned char *data)
{
	unsigned char buf[5000];
	phx_file *f = t_open(eng, path, O_RDONLY, 0);
	int64_t n = phx_pread(f, buf, sizeof(buf), 3);

	T_CHECK(n == sizeof(buf), "pread %" PRId64, n);
	T_SAME(buf, data + 3, sizeof(buf), "read after create");
	T_CHECK(phx_file_close(f) == 0, "close");
}

int main(void)
{
	struct phx_engine_config cfg, got;
	phx_engine *eng;
	const char *path;
	unsigned char *data;

	t_seed();
	path = t_path("create");
	data = t_random_file(path, 64 * KiB);

	/* Defaults: documented values, no environment. */
	unsetenv("PHX_QUEUE_DEPTH");
	unsetenv("PHX_MAX_IO_SIZE");
	unsetenv("PHX_BOUNCE_SIZE");
	unsetenv("PHX_BOUNCE_COUNT");
	phx_engine_config_init(&cfg);
	T_CHECK(cfg.size == sizeof(cfg), "size %u", cfg.size);
	T_CHECK(cfg.queue_depth == 128, "qd %u", cfg.queue_depth);
	T_CHECK(cfg.max_io_size == 1 << 20, "max_io %u", cfg.max_io_size);
	T_CHECK(cfg.bounce_size == 1 << 20, "bounce_size %u", cfg.bounce_size);
	T_CHECK(cfg.bounce_count == 4, "bounce_count %u", cfg.bounce_count);
	T_CHECK(cfg.max_files == 256, "max_files %u", cfg.max_files);
	T_CHECK(cfg.flags == 0, "flags %u", cfg.flags);

	/* NULL config = defaults. */
	eng = t_engine(NULL);
	phx_engine_config_get(eng, &got);
	T_CHECK(got.queue_depth == 128 && got.max_io_size == 1 << 20 &&
		got.bounce_size == 1 << 20 && got.bounce_count == 4,
		"defaults in force: qd %u max_io %u bsize %u bcount %u",
		got.queue_depth, got.max_io_size, got.bounce_size, got.bounce_count);
	do_io(eng, path, data);
	T_CHECK(phx_engine_destroy(eng) == 0, "destroy");

	/* Environment overrides. */
	setenv("PHX_QUEUE_DEPTH", "64", 1);
	setenv("PHX_MAX_IO_SIZE", "262144", 1);
	setenv("PHX_BOUNCE_SIZE", "65536", 1);
	setenv("PHX_BOUNCE_COUNT", "3", 1);
	phx_engine_config_init(&cfg);
	T_CHECK(cfg.queue_depth == 64 && cfg.max_io_size == 262144 &&
		cfg.bounce_size == 65536 && cfg.bounce_count == 3,
		"env: qd %u max_io %u bsize %u bcount %u", cfg.queue_depth,
		cfg.max_io_size, cfg.bounce_size, cfg.bounce_count);
	eng = t_engine(&cfg);
	phx_engine_config_get(eng, &got);
	T_CHECK(got.queue_depth == 64 && got.bounce_count == 3, "env in force");
	do_io(eng, path, data);
	T_CHECK(phx_engine_destroy(eng) == 0, "destroy");
	unsetenv("PHX_QUEUE_DEPTH");
	unsetenv("PHX_MAX_IO_SIZE");
	unsetenv("PHX_BOUNCE_SIZE");
	unsetenv("PHX_BOUNCE_COUNT");

	/* Explicit configurations x every flag combination. */
	static const struct { uint32_t qd, max_io, bsize, bcount, files; } confs[] = {
		{ 1, 4096, 4096, 1, 1 },
		{ 2, 8192, 4096, 1, 4 },
		{ 32, 65536, 65536, 2, 16 },
		{ 128, 1 << 20, 1 << 20, 4, 256 },
		{ 1024, 4 << 20, 2 << 20, 8, 1024 },
	};
	for (unsigned i = 0; i < sizeof(confs) / sizeof(confs[0]); i++) {
		for (uint32_t flags = 0; flags < 4; flags++) {
			phx_engine_config_init(&cfg);
			cfg.queue_depth = confs[i].qd;
			cfg.max_io_size = confs[i].max_io;
			cfg.bounce_size = confs[i].bsize;
			cfg.bounce_count = confs[i].bcount;
			cfg.max_files = confs[i].files;
			cfg.flags = flags;
			eng = t_engine(&cfg);
			phx_engine_config_get(eng, &got);
			T_CHECK(got.size == sizeof(got), "get size");
			T_CHECK(got.queue_depth >= confs[i].qd, "qd %u < %u",
				got.queue_depth, confs[i].qd);
			T_CHECK(got.max_io_size == confs[i].max_io, "max_io %u", got.max_io_size);
			T_CHECK(got.bounce_size == confs[i].bsize, "bsize %u", got.bounce_size);
			T_CHECK(got.bounce_count == confs[i].bcount, "bcount %u", got.bounce_count);
			T_CHECK(got.flags == flags, "flags %u", got.flags);
			uint32_t feat = phx_engine_features(eng);
			if (flags & PHX_ENGINE_NO_FIXED_FILES)
				T_CHECK(!(feat & PHX_FEAT_FIXED_FILES), "fixed files despite flag");
			if (flags & PHX_ENGINE_NO_FIXED_BUFS)
				T_CHECK(!(feat & PHX_FEAT_FIXED_BUFS), "fixed bufs despite flag");
			T_CHECK(phx_engine_eventfd(eng) >= 0, "eventfd");
			do_io(eng, path, data);
			T_CHECK(phx_engine_destroy(eng) == 0, "destroy conf %u flags %u", i, flags);
		}
	}

	/* Many engines alive at once. */
	{
		phx_engine *many[16];

		for (int i = 0; i < 16; i++)
			many[i] = t_engine(NULL);
		for (int i = 0; i < 16; i++)
			do_io(many[i], path, data);
		for (int i = 15; i >= 0; i--)
			T_CHECK(phx_engine_destroy(many[i]) == 0, "destroy %d", i);
	}

	/* Destroy closes files still open on it. */
	eng = t_engine(NULL);
	(void)t_open(eng, path, O_RDONLY, 0);
	(void)t_open(eng, path, O_RDWR, 0);
	T_CHECK(phx_engine_destroy(eng) == 0, "destroy with open files");

	/* Invalid configurations: -EINVAL, nothing created. */
	{
		struct phx_engine_config bad[8];
		int nb = 0;

		for (int i = 0; i < 8; i++)
			phx_engine_config_init(&bad[i]);
		bad[nb++].queue_depth = 0;
		bad[nb].max_io_size = 0; nb++;
		bad[nb].max_io_size = 1000; nb++;	/* not a multiple of a block */
		bad[nb].bounce_size = 0; nb++;
		bad[nb].bounce_count = 0; nb++;
		for (int i = 0; i < nb; i++) {
			eng = (phx_engine *)0x1;
			int ret = phx_engine_create(&bad[i], &eng);

			T_CHECK(ret == -EINVAL, "bad config %d accepted: %d", i, ret);
			T_CHECK(strlen(phx_strerror_last()) > 0, "no message");
		}
		T_CHECK(phx_engine_create(NULL, NULL) == -EINVAL, "NULL out");
	}
	free(data);
	return T_EXIT_PASS;
}
