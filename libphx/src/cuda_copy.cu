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

/*
 * Bytes [0, len) in steps of T (a power of two up to 16) from src to dst, which
 * agree modulo T; every thread keeps four loads in flight before it stores,
 * since the source of a read is host memory across PCIe (each load a round
 * trip of a microsecond or so).
 */
template <typename T>
__device__ void copy_as(unsigned long long src, unsigned long long dst,
			unsigned long long len, unsigned long long tid,
			unsigned long long nth)
{
	const unsigned long long w = sizeof(T);
	unsigned long long head = (w - (dst & (w - 1))) & (w - 1), n, base, i;

	if (head > len)
		head = len;
	if (tid < head)
		((unsigned char *)dst)[tid] = ((const unsigned char *)src)[tid];
	n = (len - head) / w;
	const T *__restrict__ s = (const T *)(src + head);
	T *__restrict__ d = (T *)(dst + head);
	for (i = tid; i + 3 * nth < n; i += 4 * nth) {
		T a = s[i], b = s[i + nth], c = s[i + 2 * nth], e = s[i + 3 * nth];

		d[i] = a;
		d[i + nth] = b;
		d[i + 2 * nth] = c;
		d[i + 3 * nth] = e;
	}
	for (; i < n; i += nth)
		d[i] = s[i];
	base = head + n * w;
	if (tid < len - base)
		((unsigned char *)dst)[base + tid] = ((const unsigned char *)src)[base + tid];
}

extern "C" __global__ void phx_copy(const phx_copy_desc *d)
{
	/*
	 * The descriptor lives in host memory: one thread per block reads it
	 * (volatile: a lane wrote it after the launch was queued).  Reading it
	 * in every thread cost ~6 ms per launch on an H200, whatever the size.
	 */
	__shared__ unsigned long long sd[3];
	unsigned long long tid = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x;
	unsigned long long nth = (unsigned long long)gridDim.x * blockDim.x;
	unsigned long long src, dst, len;

	if (threadIdx.x == 0) {
		const volatile phx_copy_desc *vd = d;

		sd[0] = vd->src;
		sd[1] = vd->dst;
		sd[2] = vd->len;
	}
	__syncthreads();
	src = sd[0];
	dst = sd[1];
	len = sd[2];
	if (!len)
		return;
	if (((src ^ dst) & 15) == 0)
		copy_as<uint4>(src, dst, len, tid, nth);
	else if (((src ^ dst) & 7) == 0)
		copy_as<unsigned long long>(src, dst, len, tid, nth);
	else if (((src ^ dst) & 3) == 0)
		copy_as<unsigned int>(src, dst, len, tid, nth);
	else
		copy_as<unsigned char>(src, dst, len, tid, nth);
	/*
	 * No __threadfence_system(): a write's bytes land in pinned host memory,
	 * and what a kernel wrote is visible to the stream's next operation (the
	 * host function that hands the buffer to the file) once it completes.
	 * The fence in every thread cost ~0.9 ms a launch on an H200.
	 */
}
