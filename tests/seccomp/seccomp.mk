# The fall-back engine under a container-like seccomp profile (issue 24),
# included by the top Makefile.  A small launcher built with libseccomp
# (APT_PACKAGES: libseccomp-dev) refuses io_uring_setup/enter/register with
# EPERM, as Docker's and containerd's default profiles do, and runs the C
# suite and the engine, file, write-path, GPU-fake, LMCache-fake and loader
# tests under it: every phx path must work on the thread-pool backend that
# libphx falls back to.  PHX_EXPECT_BACKEND makes tests/test_engine_fallback.py
# fail if the filter did not take (the job would otherwise test io_uring).
# Measured on the 2-core box while others worked on it: the C suite 23 s,
# the tests 5.5 minutes file by file, 11 beside a benchmark; about half of
# it the GPU-fake suite (its AddressSanitizer runs are the only ASan check
# of the lanes on threads).
SECCOMP_DIR := build/seccomp
NO_IO_URING := $(SECCOMP_DIR)/no-io-uring
SECCOMP_PYTESTS := tests/test_engine_fallback.py tests/test_io_sync.py \
	tests/test_io_async.py tests/test_io_batch.py tests/test_io_many.py \
	tests/test_io_buffers.py tests/test_io_stats.py tests/test_io_pagecache.py \
	tests/test_errors.py tests/test_write_path.py tests/test_gpu_fake.py tests/test_gpu_small.py \
	tests/test_lmcache_fake.py tests/test_loader.py tests/test_loader_fake.py

.PHONY: test-seccomp

$(NO_IO_URING): tests/seccomp/no-io-uring.c | deps
	mkdir -p $(SECCOMP_DIR)
	cc -O2 -Wall -Wextra -o $@ $< $$(pkg-config --cflags --libs libseccomp)

test-seccomp: $(NO_IO_URING) build $(LMCACHE_SITE)
	cmake -S . -B build/c -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
	cmake --build build/c
	cd build/c && ../seccomp/no-io-uring ctest --output-on-failure -E '.-threads$$'
	PHX_EXPECT_BACKEND=threads $(NO_IO_URING) $(VPY) -m pytest -ra --timeout=900 $(SECCOMP_PYTESTS)
