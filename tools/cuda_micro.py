"""Latency of the CUDA primitives stream-ordered phx I/O is built of (diagnosis).

Host functions, host-raised cuStreamWaitValue32 on registered host memory and
on device memory, as raw driver calls through ctypes.  Prints one JSON line.
"""
import ctypes as C
import json
import mmap
import threading
import time

import torch

lib = C.CDLL("libcuda.so.1")
V, U64, U32 = C.c_void_p, C.c_uint64, C.c_uint32
lib.cuLaunchHostFunc.argtypes = [V, V, V]
lib.cuStreamWaitValue32_v2.argtypes = [V, U64, U32, C.c_uint]
lib.cuStreamWriteValue32_v2.argtypes = [V, U64, U32, C.c_uint]
lib.cuStreamSynchronize.argtypes = [V]
lib.cuMemHostRegister_v2.argtypes = [V, C.c_size_t, C.c_uint]
lib.cuMemHostGetDevicePointer_v2.argtypes = [C.POINTER(U64), V, C.c_uint]
lib.cuEventQuery.argtypes = [V]
CB = C.CFUNCTYPE(None, V)
out = {}
torch.zeros(1, device="cuda")
s = torch.cuda.Stream()
sp = V(s.cuda_stream)
hits = []
cb = CB(lambda _a: hits.append(time.perf_counter()))
cbp = C.cast(cb, V)


def sync():
    r = lib.cuStreamSynchronize(sp)
    assert r == 0, r


sync()
t = time.perf_counter()
for _ in range(50):
    assert lib.cuLaunchHostFunc(sp, cbp, None) == 0
sync()
out["hostfn_back_to_back_us"] = (time.perf_counter() - t) / 50 * 1e6
lat = []
for _ in range(10):
    t = time.perf_counter()
    assert lib.cuLaunchHostFunc(sp, cbp, None) == 0
    sync()
    lat.append((time.perf_counter() - t) * 1e6)
out["hostfn_single_roundtrip_us"] = sorted(lat)[len(lat) // 2]

# flag in registered host memory, device-mapped (as libphx)
mm = mmap.mmap(-1, 4096)
buf = (C.c_char * 4096).from_buffer(mm)
hp = C.addressof(buf)
assert lib.cuMemHostRegister_v2(V(hp), 4096, 0x2 | 0x1) == 0   # DEVICEMAP | PORTABLE
dp = U64()
assert lib.cuMemHostGetDevicePointer_v2(C.byref(dp), V(hp), 0) == 0
flag = C.c_uint32.from_address(hp)


def wait_release(k, raise_fn):
    r = lib.cuStreamWaitValue32_v2(sp, dp.value, k, 0)     # GEQ
    assert r == 0, r
    ev = torch.cuda.Event()
    ev.record(s)
    time.sleep(0.005)
    t = time.perf_counter()
    raise_fn(k)
    while not ev.query():
        pass
    return (time.perf_counter() - t) * 1e6


def host_store(k):
    flag.value = k


out["waitvalue_host_flag_release_us"] = sorted(wait_release(k, host_store) for k in range(1, 8))
# the same, raised by a host function of another stream (as arrive_fn -> lane)
s2 = torch.cuda.Stream()
s2p = V(s2.cuda_stream)
k_box = [0]
rcb = CB(lambda _a: host_store(k_box[0]))


def via_hostfn(k):
    k_box[0] = k
    assert lib.cuLaunchHostFunc(s2p, C.cast(rcb, V), None) == 0


out["waitvalue_raised_by_hostfn_us"] = sorted(wait_release(k, via_hostfn) for k in range(8, 14))


# device-memory flag raised by cuStreamWriteValue32 on another stream
dflag = torch.zeros(1, dtype=torch.int32, device="cuda")
dpv = dflag.data_ptr()


def dev_wait_release(k):
    r = lib.cuStreamWaitValue32_v2(sp, dpv, k, 0)
    assert r == 0, r
    ev = torch.cuda.Event()
    ev.record(s)
    time.sleep(0.005)
    t = time.perf_counter()
    assert lib.cuStreamWriteValue32_v2(s2p, dpv, k, 0) == 0
    while not ev.query():
        pass
    return (time.perf_counter() - t) * 1e6


out["waitvalue_device_flag_writevalue_us"] = sorted(dev_wait_release(k) for k in range(1, 8))

# a whole stream op as phx queues it, flag raised by the hostfn itself:
# [hostfn raises flag k] [wait flag>=k] [small kernel] [hostfn] [hostfn]
x = torch.zeros(1024, device="cuda")
lat = []
for k in range(20, 30):
    k_box[0] = k
    t = time.perf_counter()
    with torch.cuda.stream(s):
        assert lib.cuLaunchHostFunc(sp, C.cast(rcb, V), None) == 0
        assert lib.cuStreamWaitValue32_v2(sp, dp.value, k, 0) == 0
        x.add_(1)
        assert lib.cuLaunchHostFunc(sp, cbp, None) == 0
        assert lib.cuLaunchHostFunc(sp, cbp, None) == 0
    sync()
    lat.append((time.perf_counter() - t) * 1e6)
out["op_shape_selfraised_us"] = sorted(lat)
print(json.dumps(out), flush=True)


# The real shape: the arrival hostfn wakes another thread, which raises the
# flag ~50 us later while the stream is already blocked on it; then a kernel
# and two hostfns.  Host flag (plain store) vs device flag (cuStreamWriteValue32
# on the waker's own stream).
def real_shape(kind, k):
    ready = threading.Event()
    done = threading.Event()

    def waker():
        ready.wait()
        time.sleep(50e-6)
        if kind == "host":
            flag.value = k
        else:
            assert lib.cuStreamWriteValue32_v2(s2p, dpv, k, 0) == 0
        done.set()

    th = threading.Thread(target=waker)
    th.start()
    acb = CB(lambda _a: ready.set())
    addr = dp.value if kind == "host" else dpv
    t = time.perf_counter()
    with torch.cuda.stream(s):
        assert lib.cuLaunchHostFunc(sp, C.cast(acb, V), None) == 0
        assert lib.cuStreamWaitValue32_v2(sp, addr, k, 0) == 0
        x.add_(1)
        assert lib.cuLaunchHostFunc(sp, cbp, None) == 0
        assert lib.cuLaunchHostFunc(sp, cbp, None) == 0
    sync()
    th.join()
    return (time.perf_counter() - t) * 1e6


r2 = {}
for kind in ("host", "device"):
    r2[f"real_shape_{kind}_flag_us"] = sorted(round(real_shape(kind, 100 + 20 * (kind == "device") + i), 1)
                                              for i in range(10))
# no trailing hostfns: only the arrival and the wait (event polled)
def no_tail(kind, k):
    ready = threading.Event()

    def waker():
        ready.wait()
        time.sleep(50e-6)
        if kind == "host":
            flag.value = k
        else:
            assert lib.cuStreamWriteValue32_v2(s2p, dpv, k, 0) == 0

    th = threading.Thread(target=waker)
    th.start()
    acb = CB(lambda _a: ready.set())
    addr = dp.value if kind == "host" else dpv
    t = time.perf_counter()
    with torch.cuda.stream(s):
        assert lib.cuLaunchHostFunc(sp, C.cast(acb, V), None) == 0
        assert lib.cuStreamWaitValue32_v2(sp, addr, k, 0) == 0
        x.add_(1)
        ev = torch.cuda.Event()
        ev.record(s)
    while not ev.query():
        pass
    th.join()
    return (time.perf_counter() - t) * 1e6


for kind in ("host", "device"):
    r2[f"no_tail_{kind}_flag_us"] = sorted(round(no_tail(kind, 200 + 20 * (kind == "device") + i), 1)
                                           for i in range(10))
print(json.dumps(r2), flush=True)
