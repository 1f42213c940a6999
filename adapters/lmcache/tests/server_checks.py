"""LMCache 0.5.6's own L1 server path with a GDS L1 of backend ``phx``, on
tests/gpu_fake's stand-in libcuda (run by tests/test_lmcache_fake.py in
children with the fake first on LD_LIBRARY_PATH and the phx_lmcache import
hook active, as in an LMCache server).

What is LMCache's own code: ``L1Manager`` built from an ``L1ManagerConfig``
with a ``GdsL1Config`` (that is how the cache server starts its GDS L1:
``initialize_l1_gds_context`` -> ``GDSContext.initialize`` ->
``create_backend("phx")`` -> ``open_slab``), ``GDSL1MemoryManager``'s
allocations, ``register_gds_gpu_buffer``, ``gpu_ops.lmcache_memcpy_async_d2h``
/ ``_h2d`` (-> ``GDSContext.transfer_async`` -> the phx backend's
``AsyncHandle``), ``reserve_write`` / ``finish_write`` (the stream callback a
store ends with) / ``reserve_read`` / ``unsafe_read`` / ``finish_read``.
What stands in, because torch here is a CPU build: the platform stream
helpers (one fake CUDA stream), tensors over fake "device" memory that say
``is_cuda``, and the phx backend's ``validate_environment``.  The store and
retrieve steps follow ``lmcache_driven_transfer.store`` / ``retrieve``
without vLLM's paged-KV kernel: a retrieve fails when a transfer raises.

Usage: server_checks.py MODE SLAB_DIR [ARGS]; prints ``ok ...`` or
``FAIL ...`` lines (the parent reads them).
  hold DIR N     start a server, store N random chunks, print "ready PID",
                 wait for a line on stdin, then retrieve them all and print
                 "ok hold" when every byte is right (and the slab file too)
  start DIR      start a server on DIR and print "ok started" or
                 "refused <message>"
  failed_store DIR BACKING   stores while the filesystem under DIR can
                 allocate nothing more (the test filled BACKING, the loop
                 device's backing filesystem, after the first stores)
"""
from __future__ import annotations

import ctypes
import os
import sys
import time
import traceback

import numpy as np
import torch

from lmcache.v1.distributed.api import MemoryLayoutDesc, ObjectKey
from lmcache.v1.distributed.config import GdsL1Config, L1ManagerConfig, L1MemoryManagerConfig
from lmcache.v1.distributed.l1_manager import L1Manager
from lmcache.v1.distributed.error import L1Error
from lmcache.v1.gpu_connector import gds_context, gpu_ops
from lmcache.v1.gpu_connector.gds_backends import phx as lmphx

import phx_lmcache

cuda = ctypes.CDLL("libcuda.so.1")
assert hasattr(cuda, "fake_sleep_async"), "not the fake libcuda"
cuda.cuStreamSynchronize.argtypes = [ctypes.c_void_p]

MiB = 1 << 20
CHUNK = MiB + 3 * 4096          # one KV chunk (a multiple of 4 KiB, as LMCache's are)
TAG = "_l1_write"
RNG = np.random.default_rng(int.from_bytes(os.urandom(8), "little"))


def stream() -> int:
    s = ctypes.c_void_p()
    assert cuda.cuStreamCreate(ctypes.byref(s), 1) == 0
    return s.value


def sync(s: int) -> None:
    assert cuda.cuStreamSynchronize(ctypes.c_void_p(s)) == 0


class FakeCudaTensor(torch.Tensor):
    """A CPU tensor over fake "device" memory that says it is on a GPU (the
    phx backend's register_buffer checks ``is_cuda``)."""

    @property
    def is_cuda(self):  # noqa: D401
        return True


def gpu_tensor(n: int) -> tuple[int, torch.Tensor]:
    p = ctypes.c_uint64()
    assert cuda.cuMemAlloc_v2(ctypes.byref(p), ctypes.c_size_t(n)) == 0
    arr = (ctypes.c_ubyte * n).from_address(p.value)
    t = torch.frombuffer(arr, dtype=torch.uint8).as_subclass(FakeCudaTensor)
    return p.value, t


class _Done:
    def __init__(self, s: int) -> None:
        self.s = s

    def is_complete(self) -> bool:
        sync(self.s)
        return True


class _Streams:
    """lmcache.v1.platform.stream for one fake CUDA stream."""

    def __init__(self) -> None:
        self.s = stream()

    def current_stream(self, device):
        return self.s

    def stream_handle(self, device, s):
        return s

    def synchronize_stream(self, device, s):
        sync(s)

    def synchronize_device(self, device):
        sync(self.s)

    def record_completion_event(self, device, s):
        return _Done(s)


STREAMS = _Streams()
gds_context.platform_stream = STREAMS
# torch here is a CPU build; the fake libcuda is the GPU
lmphx.Backend.validate_environment = lambda self: None


def server(location: str, size: int) -> L1Manager:
    """An L1 manager with a GDS L1 of backend phx, as the cache server makes it."""
    cfg = L1ManagerConfig(
        memory_config=L1MemoryManagerConfig(size_in_bytes=size, use_lazy=False),
        gds_l1_config=GdsL1Config(file_location=location, size_in_bytes=size, backend="phx"))
    return L1Manager(cfg)


LAYOUT = MemoryLayoutDesc(shapes=[torch.Size([CHUNK])], dtypes=[torch.uint8])


def new_keys(n: int) -> list[ObjectKey]:
    return [ObjectKey(chunk_hash=os.urandom(16), model_name="m", kv_rank=0) for _ in range(n)]


class Staging:
    """The GPU staging buffer LMCache registers (register_gds_gpu_buffer)."""

    def __init__(self, nchunks: int) -> None:
        self.ptr, self.t = gpu_tensor(nchunks * CHUNK)
        gds_context.register_gds_gpu_buffer(self.t)

    def chunk(self, i: int) -> torch.Tensor:
        return self.t[i * CHUNK:(i + 1) * CHUNK]

    def view(self, i: int) -> np.ndarray:
        return self.chunk(i).numpy()

    def close(self) -> None:
        gds_context.deregister_gds_gpu_buffer(self.t)


def store(l1: L1Manager, st: Staging, keys, datas) -> dict:
    """lmcache_driven_transfer.store: reserve, copy each chunk to its slab
    object on the stream, then finish_write once the stream has passed the
    copies (LMCache queues it as a stream callback).  The objects used."""
    res = l1.reserve_write(keys, [False] * len(keys), LAYOUT, tag=TAG)
    objs = {}
    for i, (k, d) in enumerate(zip(keys, datas)):
        err, obj = res[k]
        assert err == L1Error.SUCCESS, err
        st.view(i)[:] = d
        gpu_ops.lmcache_memcpy_async_d2h(st.chunk(i), obj)
        objs[k] = obj
    sync(STREAMS.s)
    l1.finish_write(keys, tag=TAG)
    return objs


def retrieve(l1: L1Manager, st: Staging, keys) -> tuple[bool, str]:
    """lmcache_driven_transfer.retrieve: lock, read every chunk into the
    staging buffer on the stream; an exception fails the retrieve (vLLM then
    recomputes).  (ok, why)."""
    locked = l1.reserve_read(keys)
    present = [k for k in keys if locked[k][0] == L1Error.SUCCESS]
    if len(present) != len(keys):
        l1.finish_read(present)
        return False, f"{len(keys) - len(present)} key(s) not found"
    ok, why = True, ""
    try:
        objs = l1.unsafe_read(keys)
        for i, k in enumerate(keys):
            gpu_ops.lmcache_memcpy_async_h2d(objs[k][1], st.chunk(i))
    except Exception as e:  # noqa: BLE001 - as LMCache's retrieve does
        ok, why = False, f"{type(e).__name__}: {e}"
    finally:
        sync(STREAMS.s)
        l1.finish_read(keys)
    return ok, why


def random_chunks(n: int) -> list[np.ndarray]:
    return [RNG.integers(0, 256, CHUNK, dtype=np.uint8) for _ in range(n)]


def slab_file(location: str) -> str:
    return os.path.join(location, "lmcache_gds_slab.bin")


# ---------------------------------------------------------------------------

def mode_hold(location: str, n: str) -> None:
    n = int(n)
    l1 = server(location, 64 * MiB)
    st = Staging(n)
    keys, datas = new_keys(n), random_chunks(n)
    objs = store(l1, st, keys, datas)
    print(f"ready {os.getpid()}", flush=True)
    sys.stdin.readline()
    for i in range(n):
        st.view(i)[:] = 0
    ok, why = retrieve(l1, st, keys)
    assert ok, why
    for i in range(n):
        assert (st.view(i) == datas[i]).all(), f"chunk {i}: the KV changed"
    with open(slab_file(location), "rb") as f:    # (lets the POSIX lock go: last)
        for k, d in zip(keys, datas):
            f.seek(objs[k].slab_offset)
            assert f.read(CHUNK) == d.tobytes(), "the slab file changed"
    print("ok hold", flush=True)


def mode_start(location: str) -> None:
    try:
        server(location, 64 * MiB)
    except Exception as e:  # noqa: BLE001 - reported to the parent
        print(f"refused {type(e).__name__}: {e}", flush=True)
        return
    print("ok started", flush=True)


def mode_failed_store(location: str, backing: str) -> None:
    """First stores land; then the backing filesystem of the slab's device is
    filled, and every new store's slab write fails (ENOSPC or EIO); the test
    shows: the failed store is not admitted (a miss, not a hit whose load
    serves stale or zero KV), its slab space is freed, a retrieve that is
    still attempted on its range fails, and the good chunks load byte-exact."""
    l1 = server(location, 32 * MiB)
    st = Staging(4)
    good_keys, good = new_keys(2), random_chunks(2)
    store(l1, st, good_keys, good)
    used_good = l1.get_memory_usage()[0]
    # the backing filesystem full: blocks never written before cannot be
    # allocated (the good chunks' blocks exist)
    with open(os.path.join(backing, "filler"), "wb") as f:
        try:
            while True:
                f.write(b"\0" * MiB)
                f.flush()
        except OSError:
            pass
    before = phx_lmcache.stats()
    bad_keys, bad = new_keys(2), random_chunks(2)
    bad_objs = store(l1, st, bad_keys, bad)
    deadline = time.monotonic() + 5
    while phx_lmcache.stats()["inflight"] and time.monotonic() < deadline:
        time.sleep(0.001)
    after = phx_lmcache.stats()
    assert after["failures"] >= before["failures"] + 2, (before, after)
    assert after["last_error"] in (-28, -5), after["last_error"]
    if os.environ.get("PHX_LMCACHE_HOOK") == "0":
        # without the hook LMCache admits the failed stores (it never reads
        # bytes_done) and keeps their space; libphxfile refuses their loads,
        # so the retrieve fails instead of serving the old or zero bytes
        assert all(k in l1._objects for k in bad_keys), "LMCache did not admit them?"
        for i in range(2):
            st.view(i)[:] = 0x5A
        ok, why = retrieve(l1, st, bad_keys)
        assert not ok and "rc=-5" in why, (ok, why)
        assert (st.view(0) == 0x5A).all() and (st.view(1) == 0x5A).all(), \
            "a failed retrieve wrote KV"
        ok, why = retrieve(l1, st, good_keys)
        assert ok, why
        for i in range(2):
            assert (st.view(i) == good[i]).all(), f"good chunk {i} differs"
        print("ok failed_store", flush=True)
        return
    # not admitted, and the space given back
    assert all(k not in l1._objects for k in bad_keys), "a failed store was admitted"
    assert l1.get_memory_usage()[0] == used_good, \
        f"the failed stores' slab space was not freed: {l1.get_memory_usage()[0]} != {used_good}"
    ok, why = retrieve(l1, st, bad_keys[:1])
    assert not ok and "not found" in why, (ok, why)
    # a load of the failed range, were it attempted, is refused: the
    # retrieve fails and the destination keeps its bytes
    h = gds_context.get_l1_gds_context(bad_objs[bad_keys[0]].get_l1_manager())._slab_handle
    st.view(0)[:] = 0x5A
    try:
        h.read_async(st.ptr, CHUNK, bad_objs[bad_keys[0]].slab_offset, 0, STREAMS.s)
    except RuntimeError as e:
        assert "rc=-5" in str(e), e
    else:
        raise AssertionError("a load of a failed store's range was accepted")
    sync(STREAMS.s)
    assert (st.view(0) == 0x5A).all(), "a refused load wrote the destination"
    # the good chunks still load right
    ok, why = retrieve(l1, st, good_keys)
    assert ok, why
    for i in range(2):
        assert (st.view(i) == good[i]).all(), f"good chunk {i} differs"
    # the space is usable again once the filesystem has room: a store there succeeds
    os.unlink(os.path.join(backing, "filler"))
    again = random_chunks(2)
    store(l1, st, bad_keys, again)
    assert all(k in l1._objects for k in bad_keys), "the store anew was not admitted"
    ok, why = retrieve(l1, st, bad_keys)
    assert ok, why
    for i in range(2):
        assert (st.view(i) == again[i]).all(), f"chunk {i} stored anew differs"
    from phx_lmcache import _slab
    assert _slab.discarded_stores() == 2, _slab.discarded_stores()
    print("ok failed_store", flush=True)


def main() -> int:
    mode, args = sys.argv[1], sys.argv[2:]
    try:
        globals()[f"mode_{mode}"](*args)
    except Exception as e:  # noqa: BLE001
        tb = traceback.format_exc().strip().splitlines()
        print(f"FAIL {mode}: {e!r} [{' | '.join(tb[-4:])}]", flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
