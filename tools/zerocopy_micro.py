"""GPU kernel reads of pinned host memory (zero-copy), by how the memory was
pinned: cudaHostAlloc, mmap + cuMemHostRegister (4 KiB pages), the same with
transparent huge pages.  The copy engine for reference.  One JSON line."""
import ctypes as C
import json
import mmap
import time

import cupy as cp
import numpy as np

N = 64 << 20
lib = C.CDLL("libcuda.so.1")
libc = C.CDLL("libc.so.6", use_errno=True)
libc.mmap.restype = C.c_void_p
libc.mmap.argtypes = [C.c_void_p, C.c_size_t, C.c_int, C.c_int, C.c_int, C.c_long]
libc.madvise.argtypes = [C.c_void_p, C.c_size_t, C.c_int]
lib.cuMemHostRegister_v2.argtypes = [C.c_void_p, C.c_size_t, C.c_uint]
lib.cuMemHostGetDevicePointer_v2.argtypes = [C.POINTER(C.c_uint64), C.c_void_p, C.c_uint]
ker = cp.RawKernel(r'''
extern "C" __global__ void rd(const uint4 *__restrict__ s, uint4 *__restrict__ d, unsigned long long n) {
  unsigned long long nth = (unsigned long long)gridDim.x * blockDim.x, i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x;
  for (; i + 3 * nth < n; i += 4 * nth) { uint4 a = s[i], b = s[i+nth], c = s[i+2*nth], e = s[i+3*nth];
    d[i] = a; d[i+nth] = b; d[i+2*nth] = c; d[i+3*nth] = e; }
  for (; i < n; i += nth) d[i] = s[i];
}''', "rd")
dst = cp.empty(N, dtype=cp.uint8)


def bw(devptr, blocks):
    n = N // 16
    ker((blocks,), (256,), (np.uint64(devptr), dst, np.uint64(n)))
    cp.cuda.Device().synchronize()
    t = time.perf_counter()
    for _ in range(5):
        ker((blocks,), (256,), (np.uint64(devptr), dst, np.uint64(n)))
    cp.cuda.Device().synchronize()
    return round(5 * N / (time.perf_counter() - t) / 1e9, 2)


out = {}
pm = cp.cuda.alloc_pinned_memory(N)
out["hostalloc"] = {b: bw(pm.ptr, b) for b in (264, 1056, 4096)}
for name, huge in (("register_4k", False), ("register_thp", True)):
    raw = libc.mmap(None, N + (2 << 20), 3, 0x22, -1, 0)
    p = (raw + (2 << 20) - 1) & ~((2 << 20) - 1)
    if huge:
        out["madvise_rc"] = libc.madvise(C.c_void_p(p), N, 14)   # MADV_HUGEPAGE
    C.memset(p, 1, N)
    assert lib.cuMemHostRegister_v2(C.c_void_p(p), N, 0x3) == 0
    dp = C.c_uint64()
    assert lib.cuMemHostGetDevicePointer_v2(C.byref(dp), C.c_void_p(p), 0) == 0
    out[name] = {b: bw(dp.value, b) for b in (264, 1056, 4096)}
try:
    out["thp_enabled"] = open("/sys/kernel/mm/transparent_hugepage/enabled").read().strip()
except OSError as e:
    out["thp_enabled"] = str(e)
print(json.dumps(out), flush=True)
hsrc = cp.cuda.alloc_pinned_memory(N)
t = time.perf_counter()
for _ in range(5):
    dst.data.copy_from_host_async(C.c_void_p(hsrc.ptr), N)
cp.cuda.Device().synchronize()
out["copy_engine_gbps"] = round(5 * N / (time.perf_counter() - t) / 1e9, 2)
print(json.dumps(out), flush=True)
