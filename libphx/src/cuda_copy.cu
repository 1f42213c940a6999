// SPDX-License-Identifier: Apache-2.0
/*
 * cuda_copy.cu - the copy kernels of stream-ordered requests.
 *
 * A stream-ordered request queues all of its GPU work when it is submitted:
 * per staging round a wait on a pinned flag, these two kernels and a write
 * of a pinned progress word (cuda_stream.c).  The lengths are not known
 * then (cuFile semantics: the size and offsets are read when the stream
 * gets there, and end of file is judged then), so the kernels read them
 * from a descriptor a lane or the poller writes into pinned host memory
 * before it raises the flag; no thread makes a CUDA call for the request
 * after submission.
 *
 * phx_desc copies the descriptor into GPU memory with one warp; phx_copy
 * reads it from there.  Why two: when every block of the copy read the
 * pinned descriptor itself, each block paid ~3 us for it, one block after
 * the other (an H200: 1 MiB through 64 blocks at 4.9 GB/s, 8 blocks 25 GB/s;
 * through phx_desc 39 GB/s at any block count, 47.6 at 4 MiB, 50.8 at
 * 32 MiB; tools/stream_micro.cu).
 *
 * Built into PTX (cuda_copy_ptx.h, committed) with tools/gen_cuda_ptx.sh,
 * which declares the oldest PTX ISA the code needs (7.0), so that drivers
 * back to CUDA 11.0 (R450) compile it for the device when a context loads
 * it; nvcc 13 would stamp ISA 9.0, which only R580 and later accept.
 */
struct phx_copy_desc {
	unsigned long long src;
	unsigned long long dst;
	unsigned long long len;
	unsigned long long pad;
};

extern "C" __global__ void phx_desc(const phx_copy_desc *host, phx_copy_desc *dev)
{
	/* volatile: written by the host after this launch was queued */
	if (threadIdx.x < 4)
		((unsigned long long *)dev)[threadIdx.x] =
			((const volatile unsigned long long *)host)[threadIdx.x];
}

/*
 * Bytes [0, len) in steps of T (a power of two up to 16) from src to dst, which
 * agree modulo T; every thread keeps four loads in flight before it stores,
 * since one side is host memory across PCIe (each load a round trip of a
 * microsecond or so).
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
	unsigned long long tid = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x;
	unsigned long long nth = (unsigned long long)gridDim.x * blockDim.x;
	unsigned long long src = d->src, dst = d->dst, len = d->len;

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
	 * progress word whose write the poller sees before the lane writes the
	 * file) once it completes.  The fence in every thread cost ~0.9 ms a
	 * launch on an H200.
	 */
}
