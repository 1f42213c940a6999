// SPDX-License-Identifier: Apache-2.0
/*
 * cuda_copy.cu - the copy kernel of stream-ordered requests.
 *
 * A stream-ordered request queues all of its GPU work when it is submitted:
 * per staging round a wait on a pinned flag, this kernel, and a host
 * function.  The lengths are not known then (cuFile semantics: the size and
 * offsets are read when the stream gets there, and end of file is judged
 * then), so the kernel reads them from a descriptor in pinned, device-mapped
 * host memory that a lane writes before it raises the flag.  The lanes thus
 * make no CUDA call for stream-ordered requests, and no other thread's
 * device-synchronising call (cudaFree, a growing allocator) can wedge them.
 *
 * Built into PTX (cuda_copy_ptx.h, committed) with tools/gen_cuda_ptx.sh;
 * the driver compiles the PTX for the device when a context loads it.
 */
struct phx_copy_desc {
	unsigned long long src;
	unsigned long long dst;
	unsigned long long len;
	unsigned long long pad;
};

extern "C" __global__ void phx_copy(const phx_copy_desc *d)
{
	const volatile phx_copy_desc *vd = d;
	unsigned long long src = vd->src, dst = vd->dst, len = vd->len;
	unsigned long long tid = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x;
	unsigned long long nth = (unsigned long long)gridDim.x * blockDim.x;
	unsigned long long i;

	if (!len)
		return;
	if (((src ^ dst) & 15) == 0) {
		unsigned long long head = (16 - (dst & 15)) & 15, n16, base;

		if (head > len)
			head = len;
		if (tid < head)
			((unsigned char *)dst)[tid] = ((const unsigned char *)src)[tid];
		n16 = (len - head) / 16;
		const uint4 *s4 = (const uint4 *)(src + head);
		uint4 *d4 = (uint4 *)(dst + head);
		for (i = tid; i < n16; i += nth)
			d4[i] = s4[i];
		base = head + n16 * 16;
		if (tid < len - base)
			((unsigned char *)dst)[base + tid] = ((const unsigned char *)src)[base + tid];
	} else if (((src ^ dst) & 3) == 0) {
		unsigned long long head = (4 - (dst & 3)) & 3, n4, base;

		if (head > len)
			head = len;
		if (tid < head)
			((unsigned char *)dst)[tid] = ((const unsigned char *)src)[tid];
		n4 = (len - head) / 4;
		const unsigned int *s = (const unsigned int *)(src + head);
		unsigned int *o = (unsigned int *)(dst + head);
		for (i = tid; i < n4; i += nth)
			o[i] = s[i];
		base = head + n4 * 4;
		if (tid < len - base)
			((unsigned char *)dst)[base + tid] = ((const unsigned char *)src)[base + tid];
	} else {
		for (i = tid; i < len; i += nth)
			((unsigned char *)dst)[i] = ((const unsigned char *)src)[i];
	}
	/* writes land in pinned host memory: visible before the host function */
	__threadfence_system();
}
