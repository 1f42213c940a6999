/* SPDX-License-Identifier: Apache-2.0 */
/*
 * Description: without a CUDA driver every pinned-memory and copy-stream
 * call (PHX_0.7) fails with -ENODEV, says why in phx_cuda_strerror_last(),
 * and creates nothing; NULL handles are refused or ignored, never followed.
 * Skips where libcuda.so.1 loads (the fake-driver tests in
 * tests/gpu_fake/cuda_host_test.c cover the calls themselves).
 */
#include "helpers.h"
#include "phx_cuda.h"

int main(void)
{
	char why[256], buf[4096];
	phx_cuda_stream *s = (phx_cuda_stream *)&why;	/* must be left alone */

	if (phx_cuda_available(why, sizeof(why)))
		T_SKIP("CUDA is available here: %s", why);
	T_CHECK(phx_cuda_host_register(0, buf, sizeof(buf)) == -ENODEV, "register");
	T_CHECK(strlen(phx_cuda_strerror_last()) > 5, "no reason given");
	T_CHECK(phx_cuda_host_unregister(0, buf) == -ENODEV, "unregister");
	T_CHECK(phx_cuda_stream_create(0, &s) == -ENODEV, "stream_create");
	T_CHECK(s == (phx_cuda_stream *)&why, "*out written on failure");
	T_CHECK(phx_cuda_stream_handle(NULL) == NULL, "handle(NULL)");
	T_CHECK(phx_cuda_stream_destroy(NULL) == 0, "destroy(NULL)");
	T_CHECK(phx_cuda_stream_sync(NULL) == -EINVAL, "sync(NULL)");
	T_CHECK(phx_cuda_stream_after(NULL, NULL) == -EINVAL, "after(NULL)");
	T_CHECK(phx_cuda_stream_h2d(NULL, 0, buf, 1) == -EINVAL, "h2d(NULL)");
	T_CHECK(phx_cuda_stream_d2h(NULL, buf, 0, 1) == -EINVAL, "d2h(NULL)");
	return T_EXIT_PASS;
}
