/* SPDX-License-Identifier: Apache-2.0 */
/*
 * Description: engine counters.  An aligned read counts direct_bytes only;
 * an unaligned one (memory, offset or length) counts bounce_ios and
 * bounce_bytes; a partial-block write counts rmw_ios; a PHX_FILE_BUFFERED
 * file counts buffered_bytes; reads/writes/bytes_* count requests and bytes;
 * a large request counts one sqe per chunk; io->paths says which path moved
 * the bytes; a failed request counts errors; phx_engine_stats_reset zeroes.
 */
#include "helpers.h"

static struct phx_stats st0;

static void snap(phx_engine *eng)
{
	phx_engine_stats(eng, &st0);
}

static struct phx_stats delta(phx_engine *eng)
{
	struct phx_stats s, d;
	uint64_t *a = (uint64_t *)&s, *b = (uint64_t *)&st0, *c = (uint64_t *)&d;

	phx_engine_stats(eng, &s);
	for (size_t i = 0; i < sizeof(s) / 8; i++)
		c[i] = a[i] - b[i];
	return d;
}

int main(void)
{
	struct phx_engine_config cfg;
	phx_engine *eng;
	phx_file *f;
	const char *path;
	unsigned char *data, *buf = t_alloc(2 * MiB + 4096, 4096);
	struct phx_stats d, z;
	struct phx_io io;
	int64_t n;

	t_seed();
	path = t_path("stats");
	data = t_random_file(path, 4 * MiB);
	phx_engine_config_init(&cfg);
	cfg.max_io_size = 64 * KiB;
	eng = t_engine(&cfg);
	phx_engine_stats(eng, &z);
	T_CHECK(z.reads == 0 && z.bytes_read == 0 && z.sqes == 0 && z.errors == 0, "fresh engine counters");
	f = t_open(eng, path, O_RDWR, 0);

	/* aligned read: direct only; split into 64 KiB sqes */
	snap(eng);
	phx_io_prep(&io, f, PHX_OP_READ, buf, 1 * MiB, 4096);
	T_CHECK(phx_submit_wait(eng, &io, 1) == 0 && io.result == (int64_t)MiB, "aligned read");
	T_SAME(buf, data + 4096, MiB, "aligned read");
	d = delta(eng);
	T_CHECK(io.paths == PHX_PATH_DIRECT, "paths %#x", io.paths);
	T_CHECK(d.reads == 1 && d.bytes_read == MiB, "reads %" PRIu64 " bytes %" PRIu64, d.reads, d.bytes_read);
	T_CHECK(d.direct_bytes == MiB, "direct_bytes %" PRIu64, d.direct_bytes);
	T_CHECK(d.bounce_bytes == 0 && d.bounce_ios == 0 && d.buffered_bytes == 0,
		"bounce %" PRIu64 "/%" PRIu64 " buffered %" PRIu64, d.bounce_bytes, d.bounce_ios, d.buffered_bytes);
	T_CHECK(d.sqes >= 16, "1 MiB in 64 KiB chunks took %" PRIu64 " sqes", d.sqes);
	T_CHECK(d.submits >= 1, "submits %" PRIu64, d.submits);

	/* misaligned memory: bounce */
	snap(eng);
	n = phx_pread(f, buf + 1, 100000, 0);
	T_CHECK(n == 100000, "pread %" PRId64, n);
	T_SAME(buf + 1, data, 100000, "unaligned read");
	d = delta(eng);
	T_CHECK(d.bounce_ios == 1, "bounce_ios %" PRIu64 " after one unaligned read", d.bounce_ios);
	T_CHECK(d.bounce_bytes >= 100000, "bounce_bytes %" PRIu64, d.bounce_bytes);
	T_CHECK(d.direct_bytes == 0, "direct_bytes %" PRIu64, d.direct_bytes);

	/* unaligned offset, aligned-congruent memory: head/tail bounce, middle direct */
	snap(eng);
	phx_io_prep(&io, f, PHX_OP_READ, buf + 100, 3 * 65536, 100);
	T_CHECK(phx_submit_wait(eng, &io, 1) == 0 && io.result == 3 * 65536, "split read");
	T_SAME(buf + 100, data + 100, 3 * 65536, "split read");
	d = delta(eng);
	T_CHECK(d.bounce_ios == 1, "bounce_ios %" PRIu64, d.bounce_ios);
	T_CHECK(d.bounce_bytes > 0 && d.bounce_bytes + d.direct_bytes >= 3 * 65536,
		"bounce %" PRIu64 " direct %" PRIu64, d.bounce_bytes, d.direct_bytes);
	T_CHECK(io.paths & PHX_PATH_BOUNCE, "paths %#x", io.paths);

	/* partial-block write: rmw */
	snap(eng);
	t_fill(buf, 100);
	T_CHECK(phx_pwrite(f, buf, 100, 5000) == 100, "small write");
	memcpy(data + 5000, buf, 100);
	d = delta(eng);
	T_CHECK(d.writes == 1 && d.bytes_written == 100, "writes %" PRIu64 " bytes %" PRIu64, d.writes, d.bytes_written);
	T_CHECK(d.rmw_ios >= 1, "rmw_ios %" PRIu64, d.rmw_ios);
	T_CHECK(d.bounce_ios == 1, "bounce_ios %" PRIu64, d.bounce_ios);
	{
		unsigned char *all = t_alloc(4 * MiB, 64);

		T_CHECK(t_pread(path, all, 4 * MiB, 0) == 4 * MiB, "ref");
		T_SAME(all, data, 4 * MiB, "file after the small write");
		free(all);
	}

	/* aligned write: no rmw */
	snap(eng);
	t_fill(buf, 8192);
	T_CHECK(phx_pwrite(f, buf, 8192, 8192) == 8192, "aligned write");
	memcpy(data + 8192, buf, 8192);
	d = delta(eng);
	T_CHECK(d.rmw_ios == 0 && d.bounce_ios == 0 && d.direct_bytes == 8192, "aligned write counted rmw %" PRIu64
		" bounce %" PRIu64 " direct %" PRIu64, d.rmw_ios, d.bounce_ios, d.direct_bytes);

	T_CHECK(phx_file_close(f) == 0, "close");

	/* buffered file */
	f = t_open(eng, path, O_RDWR, PHX_FILE_BUFFERED);
	snap(eng);
	n = phx_pread(f, buf + 3, 123457, 11);
	T_CHECK(n == 123457, "buffered pread %" PRId64, n);
	T_SAME(buf + 3, data + 11, 123457, "buffered read");
	d = delta(eng);
	T_CHECK(d.buffered_bytes == 123457, "buffered_bytes %" PRIu64, d.buffered_bytes);
	T_CHECK(d.direct_bytes == 0 && d.bounce_bytes == 0 && d.bounce_ios == 0, "buffered used O_DIRECT paths");
	T_CHECK(phx_file_close(f) == 0, "close");

	/* errors */
	snap(eng);
	{
		phx_file *ro = t_open(eng, path, O_RDONLY, 0);

		T_CHECK(phx_pwrite(ro, buf, 4096, 0) == -EBADF, "write to O_RDONLY");
		d = delta(eng);
		T_CHECK(d.errors == 1, "errors %" PRIu64, d.errors);
		T_CHECK(d.writes == 0 && d.bytes_written == 0, "failed write counted as a write");
		T_CHECK(phx_file_close(ro) == 0, "close");
	}
	/* reset */
	phx_engine_stats_reset(eng);
	phx_engine_stats(eng, &z);
	T_CHECK(z.reads == 0 && z.writes == 0 && z.bytes_read == 0 && z.direct_bytes == 0 &&
		z.bounce_bytes == 0 && z.bounce_ios == 0 && z.rmw_ios == 0 && z.sqes == 0 &&
		z.submits == 0 && z.errors == 0 && z.buffered_bytes == 0, "reset left counters");

	T_CHECK(phx_engine_destroy(eng) == 0, "destroy");
	free(buf);
	free(data);
	return T_EXIT_PASS;
}
