"""The three ways LMCache can move a KV chunk between a GPU and a file, each
driven through LMCache's own code, for ``phx bench lmcache`` and the
agentic replay.

* ``phx``        LMCache's ``GDSContext`` with its in-tree ``phx`` backend,
                 which loads this package's libphxfile.so.
* ``cufile``     the same ``GDSContext`` with LMCache's ``cufile`` backend
                 (cuFile in compatibility mode where nvidia-fs is absent).
* ``kvikio``     where LMCache's cufile backend cannot start (seen on the
                 H200: cuFileHandleRegister error 5027), the same GDSContext
                 with a small backend of ours on KvikIO's compat-mode
                 ``CuFile.pread/pwrite``: the stream is synchronised, then the
                 transfer runs on the host (KvikIO has no stream-ordered compat
                 path).  Reported under its own name.  KvikIO's thread pool
                 (``num_threads``, process-wide) is 1 for ``kvikio`` (its
                 default), 16 for ``kvikio16``, 64 for ``kvikio64``: a chunk is
                 split into ``task_size`` (4 MiB) tasks over the pool, and
                 concurrent sessions share it.
* ``host``       LMCache's host-staged disk tier: ``LocalDiskBackend``'s own
                 ``write_file``/``read_file`` (one file per chunk,
                 ``use_odirect`` off or on), on its default 4 disk threads,
                 staged through pinned host buffers as its LocalCPUBackend
                 does, plus the copy to/from the GPU.

Every method stores chunks from, and loads them into, slots of one GPU pool
(registered with the GDS backends as GDSContext registers staging buffers).
"""
from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

MiB = 1 << 20


def llama3_8b_chunk_shape(tokens: int = 256) -> tuple[int, int, int, int]:
    """LMCache's KV layout [2, layers, tokens, kv_heads * head_dim] for a
    Llama-3-8B (32 layers, 8 KV heads of 128, bf16): 32 MiB per 256 tokens."""
    return (2, 32, tokens, 8 * 128)


def _memory_obj(offset: int, nbytes: int, shape):
    """A real GDSMemoryObject for a slab range (what GDSContext transfers)."""
    import torch
    from lmcache.v1.memory_management import GDSMemoryObject, MemoryObjMetadata
    meta = MemoryObjMetadata(shape=torch.Size(shape), dtype=torch.bfloat16, address=offset,
                             phy_size=nbytes, ref_count=1)
    obj = GDSMemoryObject(meta)
    assert obj.get_size() == nbytes and obj.slab_offset == offset
    return obj


class GPUPool:
    """``slots`` chunk-sized places in one GPU tensor."""

    def __init__(self, slots: int, shape, device: int = 0) -> None:
        import torch
        self.shape = tuple(shape)
        self.chunk = 2
        for d in self.shape:
            self.chunk *= d
        self.slots = slots
        self.t = torch.empty(slots * self.chunk, dtype=torch.uint8, device=f"cuda:{device}")

    def slot(self, i: int):
        return self.t[i * self.chunk:(i + 1) * self.chunk]

    def fill_random(self, seed: int) -> None:
        import torch
        g = torch.Generator(device=self.t.device)
        g.manual_seed(seed)
        self.t.view(torch.int32)[:] = torch.randint(-2**31, 2**31 - 1, (self.t.numel() // 4,),
                                                    dtype=torch.int32, device=self.t.device,
                                                    generator=g)


# ---------------------------------------------------------------------------
# GDS L1 (phx, cufile, kvikio)
# ---------------------------------------------------------------------------

#: method name -> KvikIO thread-pool size
KVIKIO_METHODS = {"kvikio": 1, "kvikio16": 16, "kvikio64": 64}


class _KvikioBackend:
    """A GDSBackend over KvikIO compat mode (see the module docstring)."""

    def __new__(cls, threads: int = 1):
        from lmcache.v1.gpu_connector.gds_backends.base import GDSBackend, GDSHandle, Submission

        class Handle(GDSHandle):
            def __init__(self, path: str, size: int) -> None:
                super().__init__(path)
                import kvikio
                self._f = kvikio.CuFile(path, "r+")

            def _io(self, write, buf_base, size, file_offset, buf_offset, raw_stream):
                import cupy
                import torch
                torch.cuda.current_stream().synchronize()
                mem = cupy.cuda.UnownedMemory(buf_base + buf_offset, size, None)
                arr = cupy.ndarray((size,), dtype=cupy.uint8,
                                   memptr=cupy.cuda.MemoryPointer(mem, 0))
                op = self._f.pwrite if write else self._f.pread
                sub = Submission(size, file_offset, buf_offset)
                sub.result.value = op(arr, size, file_offset).get()
                return sub

            def read_async(self, buf_base, size, file_offset, buf_offset, raw_stream):
                return self._io(False, buf_base, size, file_offset, buf_offset, raw_stream)

            def write_async(self, buf_base, size, file_offset, buf_offset, raw_stream):
                return self._io(True, buf_base, size, file_offset, buf_offset, raw_stream)

            def close(self) -> None:
                self._f.close()

        class Backend(GDSBackend):
            name = f"kvikio-compat-t{threads}"

            def open_slab(self, location, size, direct_io):
                os.makedirs(location, exist_ok=True)
                path = os.path.join(location, "lmcache_gds_slab.bin")
                fd = os.open(path, os.O_CREAT | os.O_RDWR | os.O_TRUNC, 0o644)
                try:
                    os.posix_fallocate(fd, 0, size)
                finally:
                    os.close(fd)
                return Handle(path, size)

            def register_buffer(self, buf): return None
            def deregister_buffer(self, buf): return None
            def register_stream(self, raw_stream): return None
            def deregister_stream(self, raw_stream): return None

        os.environ.setdefault("KVIKIO_COMPAT_MODE", "ON")
        from phx.bench.gpu import _kvikio_threads
        _kvikio_threads(threads)      # compat mode on, the pool resized
        return Backend()


class GDSMethod:
    """One LMCache GDSContext (slab in ``directory``) and the pools it moves."""

    def __init__(self, backend: str, directory: str, slab_bytes: int, shape,
                 pools: list[GPUPool]) -> None:
        import torch
        from lmcache.v1.distributed.config import GdsL1Config
        from lmcache.v1.gpu_connector.gds_context import GDSContext, SlabDirection
        self.name = backend
        self.shape = shape
        self._dir = SlabDirection
        be = _KvikioBackend(KVIKIO_METHODS[backend]) if backend in KVIKIO_METHODS else None
        self.ctx = GDSContext(be)
        cfg = GdsL1Config(file_location=directory, size_in_bytes=slab_bytes,
                          use_direct_io=True, backend="auto" if be else backend)
        self.ctx.initialize(cfg)
        self.pools = pools
        for p in pools:
            self.ctx.register_gpu_buffer(p.t)
        self.stream = torch.cuda.current_stream()
        self.chunk = pools[0].chunk

    def store(self, pool: GPUPool, slot: int, slab_index: int) -> None:
        obj = _memory_obj(slab_index * self.chunk, self.chunk, self.shape)
        self.ctx.transfer_async(obj, pool.slot(slot), self._dir.WRITE)

    def load(self, pool: GPUPool, slot: int, slab_index: int) -> None:
        obj = _memory_obj(slab_index * self.chunk, self.chunk, self.shape)
        self.ctx.transfer_async(obj, pool.slot(slot), self._dir.READ)

    def sync(self) -> None:
        self.stream.synchronize()

    def transfer(self, pool: GPUPool, pairs, write: bool, stream) -> None:
        """Move chunks ``(slot, slab_index)`` on ``stream`` and wait for them
        (that stream only): what one request of the live replay does from its
        own thread; GDSContext takes the calling thread's current stream."""
        import torch
        move = self.store if write else self.load
        with torch.cuda.stream(stream):
            for slot, j in pairs:
                move(pool, slot, j)
        stream.synchronize()

    def close(self) -> None:
        self.sync()
        for p in self.pools:
            self.ctx.deregister_gpu_buffer(p.t)
        self.ctx.close()


def open_gds(backend: str, directory: str, slab_bytes: int, shape, pools) -> tuple[Any, str]:
    """A GDSMethod, or (None, why) where the backend cannot start."""
    try:
        return GDSMethod(backend, directory, slab_bytes, shape, pools), ""
    except Exception as e:  # noqa: BLE001 - reported in the results
        # The slab a backend made before it failed (cufile: fallocated, then
        # cuFileHandleRegister refused it) would leave no room for the
        # fallback's own slab on a filesystem sized for one (seen: ENOSPC at
        # the seed-scale replay's 20.7 GiB slab on 28 GB of zram).
        import gc
        import shutil
        gc.collect()            # the failed context's handle, and its fd
        shutil.rmtree(directory, ignore_errors=True)
        return None, f"{type(e).__name__}: {e}"


# ---------------------------------------------------------------------------
# host-staged (LocalDiskBackend)
# ---------------------------------------------------------------------------

class HostStaged:
    """LocalDiskBackend's file I/O, 4 threads, pinned staging per thread slot."""

    def __init__(self, directory: str, shape, pools: list[GPUPool], odirect: bool,
                 threads: int = 4) -> None:
        import torch
        from lmcache.v1.storage_backend.local_disk_backend import LocalDiskBackend
        os.makedirs(directory, exist_ok=True)
        # only the attributes write_file/read_file use; the rest of the
        # backend (cache policy, controller messages) is not on this path
        be = object.__new__(LocalDiskBackend)
        be.os_disk_bs = os.statvfs(directory).f_bsize
        be.use_odirect = odirect
        be.dict = {}
        self.be = be
        self.name = "host-odirect" if odirect else "host-buffered"
        self.dir = directory
        self.pools = pools
        self.chunk = pools[0].chunk
        self.pool = ThreadPoolExecutor(threads, thread_name_prefix="disk")
        self._pinned = [torch.empty(self.chunk, dtype=torch.uint8, pin_memory=True)
                        for _ in range(threads * 2)]
        self._free = list(range(len(self._pinned)))
        self._lock = threading.Condition()
        self._futs: list = []

    def _path(self, slab_index: int) -> str:
        return os.path.join(self.dir, f"chunk{slab_index}.pt")

    def _take(self):
        with self._lock:
            while not self._free:
                self._lock.wait()
            return self._free.pop()

    def _give(self, i) -> None:
        with self._lock:
            self._free.append(i)
            self._lock.notify()

    def _store_one(self, src, slab_index: int) -> None:
        import torch
        i = self._take()
        try:
            h = self._pinned[i]
            s = torch.cuda.Stream()
            with torch.cuda.stream(s):
                h.copy_(src, non_blocking=True)
            s.synchronize()
            self.be.write_file(h.numpy(), self._path(slab_index))
        finally:
            self._give(i)

    def _load_one(self, dst, slab_index: int) -> None:
        import torch
        i = self._take()
        try:
            h = self._pinned[i]
            self.be.read_file(None, h.numpy(), self._path(slab_index))
            s = torch.cuda.Stream()
            with torch.cuda.stream(s):
                dst.copy_(h, non_blocking=True)
            s.synchronize()
        finally:
            self._give(i)

    def store(self, pool: GPUPool, slot: int, slab_index: int) -> None:
        import torch
        torch.cuda.current_stream().synchronize()
        self._futs.append(self.pool.submit(self._store_one, pool.slot(slot), slab_index))

    def load(self, pool: GPUPool, slot: int, slab_index: int) -> None:
        self._futs.append(self.pool.submit(self._load_one, pool.slot(slot), slab_index))

    def sync(self) -> None:
        futs, self._futs = self._futs, []
        for f in futs:
            f.result()

    def transfer(self, pool: GPUPool, pairs, write: bool, stream=None) -> None:
        """Move chunks ``(slot, slab_index)`` through the disk threads and wait
        for those only (any thread may call it; the threads are shared, as
        LocalDiskBackend's are).  ``stream`` is unused: each copy has its own."""
        fn = self._store_one if write else self._load_one
        futs = [self.pool.submit(fn, pool.slot(slot), j) for slot, j in pairs]
        for f in futs:
            f.result()

    def close(self) -> None:
        self.sync()
        self.pool.shutdown()


def open_method(name: str, directory: str, slab_bytes: int, shape, pools):
    """(method, why-not): name in phx, cufile, ``KVIKIO_METHODS``, host-buffered,
    host-odirect."""
    if name in ("phx", "cufile") or name in KVIKIO_METHODS:
        return open_gds(name, os.path.join(directory, name), slab_bytes, shape, pools)
    try:
        return HostStaged(os.path.join(directory, name), shape, pools,
                          name == "host-odirect"), ""
    except Exception as e:  # noqa: BLE001
        return None, f"{type(e).__name__}: {e}"


def open_with_standin(name: str, directory: str, slab_bytes: int, shape, pools):
    """``open_method``, with KvikIO compat standing in where LMCache's cufile
    backend cannot start: (method or None, why it is None, what stood in for
    cufile and why - None when nothing did)."""
    m, why = open_method(name, directory, slab_bytes, shape, pools)
    if m is not None or name != "cufile":
        return m, why, None
    sub = f"LMCache's cufile backend did not start ({why}): KvikIO compat"
    m, why = open_method("kvikio", directory, slab_bytes, shape, pools)
    if m is None:
        sub += f"; KvikIO compat did not start either: {why}"
    return m, why, sub


def libphxfile_stats() -> dict:
    try:
        import phx_lmcache
        return phx_lmcache.stats()
    except Exception as e:  # noqa: BLE001
        return {"error": str(e)}

