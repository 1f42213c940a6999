/* SPDX-License-Identifier: Apache-2.0 */
/*
 * Description: end of file.  Reads across, at and past EOF return the short
 * count pread returns (0 at or after EOF) for files of 1, 4095, 4096, 4097
 * and 1 MiB + 7 bytes; writes that extend a file leave exactly
 * offset + length bytes, the old prefix intact and a zero-filled hole
 * between; writes to an empty file; zero-length requests.
 */
#include "helpers.h"

static const size_t fsizes[] = { 1, 4095, 4096, 4097, (1 << 20) + 7 };
static const size_t lens[] = { 1, 4096, 8192, (1 << 20) + 7 };

int main(void)
{
	phx_engine *eng;
	const char *path;

	t_seed();
	path = t_path("eof");
	eng = t_engine(NULL);

	/* short reads */
	for (unsigned i = 0; i < sizeof(fsizes) / sizeof(*fsizes); i++) {
		size_t fs = fsizes[i];
		unsigned char *data = t_random_file(path, fs);
		phx_file *f = t_open(eng, path, O_RDONLY, 0);
		uint64_t offs[] = { 0, 1, fs - 1, fs, fs + 1, fs + 4096, fs > 4097 ? fs - 4097 : 0 };

		for (unsigned j = 0; j < sizeof(offs) / sizeof(*offs); j++) {
			for (unsigned k = 0; k < sizeof(lens) / sizeof(*lens); k++) {
				for (size_t m = 0; m < 4; m += 3) {
					size_t len = lens[k];
					uint64_t off = offs[j];
					unsigned char *buf = t_alloc(len + 8, 4096);
					size_t want = off >= fs ? 0 : (fs - off < len ? fs - off : len);
					int64_t n;

					t_fill(buf, len + 8);
					n = phx_pread(f, buf + m, len, off);
					T_CHECK(n == (int64_t)want, "pread(%zu @ %" PRIu64 ") of a %zu-byte file = %" PRId64
						", expected %zu", len, off, fs, n, want);
					T_SAME(buf + m, data + off, want, "pread(%zu @ %" PRIu64 ")", len, off);
					free(buf);
				}
			}
		}
		T_CHECK(phx_file_close(f) == 0, "close");
		free(data);
	}

	/* extending writes: prefix p bytes, then len bytes at off >= p */
	{
		static const uint64_t woffs[] = { 0, 1, 511, 4095, 4096, 4097, 1000003 };

		for (unsigned j = 0; j < sizeof(woffs) / sizeof(*woffs); j++) {
			for (unsigned k = 0; k < sizeof(fsizes) / sizeof(*fsizes); k++) {
				uint64_t off = woffs[j];
				size_t len = fsizes[k], p = off < 5000 ? off : 5000;
				unsigned char *pre, *neu = t_alloc(len + 1, 4096), *got;
				phx_file *f;
				int64_t n;

				pre = t_random_file(path, p);
				t_fill(neu, len + 1);
				f = t_open(eng, path, O_RDWR, 0);
				n = phx_pwrite(f, neu + 1, len, off);
				T_CHECK(n == (int64_t)len, "extending pwrite(%zu @ %" PRIu64 ") = %" PRId64, len, off, n);
				T_CHECK(phx_file_close(f) == 0, "close");
				T_CHECK(t_file_size(path) == off + len, "size %" PRIu64 " after pwrite(%zu @ %" PRIu64
					"), expected %" PRIu64, t_file_size(path), len, off, off + len);
				got = t_alloc(off + len, 64);
				T_CHECK(t_pread(path, got, off + len, 0) == off + len, "ref read");
				T_SAME(got, pre, p, "old prefix after pwrite(%zu @ %" PRIu64 ")", len, off);
				for (uint64_t h = p; h < off; h++)
					T_CHECK(got[h] == 0, "hole byte %" PRIu64 " is %02x", h, got[h]);
				T_SAME(got + off, neu + 1, len, "new data of pwrite(%zu @ %" PRIu64 ")", len, off);
				free(pre); free(neu); free(got);
			}
		}
	}

	/* zero-length requests and an empty file */
	{
		phx_file *f;
		unsigned char b[16];

		t_write_file(path, "", 0);
		f = t_open(eng, path, O_RDWR, 0);
		T_CHECK(phx_pread(f, b, 16, 0) == 0, "read of an empty file");
		T_CHECK(phx_pread(f, b, 0, 0) == 0, "zero-length read");
		T_CHECK(phx_pwrite(f, b, 0, 4096) == 0, "zero-length write");
		T_CHECK(t_file_size(path) == 0, "zero-length write changed the size");
		T_CHECK(phx_file_close(f) == 0, "close");
	}

	T_CHECK(phx_engine_destroy(eng) == 0, "destroy");
	return T_EXIT_PASS;
}
