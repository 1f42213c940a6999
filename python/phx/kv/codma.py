"""Co-DMA relays: one pinned host buffer per copy thread, shared by storage I/O and
the GPU copy (Dual-Blade's GPU-NVMe Co-DMA over host pinned memory).

A :class:`Relay` is a 4 KiB-aligned host buffer the size of one K or V tensor that
is

- page-locked and registered with CUDA (``cuMemHostRegister``), so the copy engine
  moves it to and from the GPU by DMA,
- registered with the phx engine's io_uring as a fixed buffer, so O_DIRECT reads
  and writes of the direct path (Group 2) DMA straight into it,
- paired with its own CUDA stream, on which that thread's H2D / D2H copies run.

Group 2 is then the paper's symmetric two hops (storage <-> relay <-> GPU); Group 1
is three (page cache <-> relay by a CPU copy, relay <-> GPU).  Host destinations
(numpy arrays, CPU tensors) bypass the relays: no copy is added for them.

:class:`RelayPool` holds a store's relays: a copy thread gets one for as long as
it runs (:meth:`RelayPool.bind`, done by :class:`phx.kv.AdaptivePipeline`) or for
one call (:meth:`RelayPool.acquire`); more threads than relays wait for one.
Every H2D / D2H is timed (stream synchronised), so the adaptive pipeline's probe
measures real copy work.

CUDA is reached through the driver API, loaded at run time (``libcuda.so.1``, as
phx's GPU module loads it); buffers are recognised and resolved by
:mod:`phx.gpu` (CUDA torch tensors, ``__cuda_array_interface__``, DLPack).  Without
a GPU the pool holds plain aligned host relays (``device=None``): what the CPU
benchmark uses as its stand-in.
"""
from __future__ import annotations

import contextlib
import ctypes
import threading
import time
from typing import Any, Iterator


from phx.kv import _sys

CU_MEMHOSTREGISTER_PORTABLE = 0x01
CU_STREAM_NON_BLOCKING = 0x01
CU_EVENT_DISABLE_TIMING = 0x02


class CudaError(RuntimeError):
    """A CUDA driver call failed (the call and its error string)."""


class _Driver:
    """The few driver entry points the relays need, loaded once per process."""

    _inst: "_Driver | None" = None
    _lock = threading.Lock()

    def __init__(self) -> None:
        lib = ctypes.CDLL("libcuda.so.1")
        vp, sz, u = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint
        for name, args in (("cuInit", [u]),
                           ("cuDevicePrimaryCtxRetain", [ctypes.POINTER(vp), ctypes.c_int]),
                           ("cuCtxSetCurrent", [vp]),
                           ("cuMemHostRegister_v2", [vp, sz, u]),
                           ("cuMemHostUnregister", [vp]),
                           ("cuStreamCreate", [ctypes.POINTER(vp), u]),
                           ("cuStreamDestroy_v2", [vp]),
                           ("cuStreamSynchronize", [vp]),
                           ("cuStreamWaitEvent", [vp, vp, u]),
                           ("cuEventCreate", [ctypes.POINTER(vp), u]),
                           ("cuEventRecord", [vp, vp]),
                           ("cuEventDestroy_v2", [vp]),
                           ("cuMemcpyHtoDAsync_v2", [ctypes.c_uint64, vp, sz, vp]),
                           ("cuMemcpyDtoHAsync_v2", [vp, ctypes.c_uint64, sz, vp]),
                           ("cuGetErrorString", [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)])):
            f = getattr(lib, name)
            f.argtypes = args
            f.restype = ctypes.c_int
        self.lib = lib
        self._ctx: dict[int, ctypes.c_void_p] = {}
        self.call("cuInit", 0)

    @classmethod
    def get(cls) -> "_Driver":
        with cls._lock:
            if cls._inst is None:
                cls._inst = cls()
            return cls._inst

    def call(self, name: str, *args) -> None:
        rc = getattr(self.lib, name)(*args)
        if rc != 0:
            s = ctypes.c_char_p()
            self.lib.cuGetErrorString(rc, ctypes.byref(s))
            raise CudaError(f"{name}: CUDA error {rc} ({(s.value or b'?').decode()})")

    def current(self, device: int) -> None:
        """Make ``device``'s primary context (the one torch and CuPy use) current."""
        ctx = self._ctx.get(device)
        if ctx is None:
            ctx = ctypes.c_void_p()
            self.call("cuDevicePrimaryCtxRetain", ctypes.byref(ctx), device)
            self._ctx[device] = ctx
        self.call("cuCtxSetCurrent", ctx)


def gpu_view(obj: Any):
    """phx.gpu's view (ptr, nbytes, device, producer stream) of a GPU buffer, or None
    for host memory."""
    import phx.gpu
    if not phx.gpu.is_device_buffer(obj):
        return None
    ok, why = phx.gpu.is_available()
    if not ok:
        raise RuntimeError(f"a GPU buffer, but phx GPU I/O is unavailable: {why}")
    return phx.gpu._view(obj)


class Relay:
    """One copy thread's relay: ``buf`` (uint8, aligned), on ``device`` (None: host)."""

    def __init__(self, nbytes: int, device: int | None = None, engine=None):
        self.nbytes = int(nbytes)
        self.device = device
        self.buf = _sys.aligned_empty(max(self.nbytes, 1))
        self.buf[:] = 0                 # touched: charged (and locked) now, not at first use
        self.h2d_bytes = self.d2h_bytes = 0
        self.h2d_s = self.d2h_s = 0.0
        self._stream = ctypes.c_void_p()
        self._event = ctypes.c_void_p()
        self._cuda_registered = False
        self._engine = None
        if device is not None:
            drv = _Driver.get()
            drv.current(device)
            drv.call("cuMemHostRegister_v2", ctypes.c_void_p(self.buf.ctypes.data),
                     self.buf.nbytes, CU_MEMHOSTREGISTER_PORTABLE)
            self._cuda_registered = True
            drv.call("cuStreamCreate", ctypes.byref(self._stream), CU_STREAM_NON_BLOCKING)
            drv.call("cuEventCreate", ctypes.byref(self._event), CU_EVENT_DISABLE_TIMING)
        if engine is not None:
            # io_uring fixed buffer: O_DIRECT I/O into the relay needs no bounce
            engine.register_buffer(self.buf)
            self._engine = engine

    @property
    def pinned(self) -> bool:
        return self._cuda_registered

    @property
    def stream(self) -> int:
        """The CUstream of this relay's copies (0 for a host relay)."""
        return int(self._stream.value or 0)

    def to_device(self, ptr: int, nbytes: int, offset: int = 0) -> float:
        """Copy ``buf[offset:offset+nbytes]`` to GPU address ``ptr`` on this relay's
        stream and wait for it; returns the seconds it took."""
        drv = _Driver.get()
        t0 = time.perf_counter()
        drv.current(self.device)
        drv.call("cuMemcpyHtoDAsync_v2", ctypes.c_uint64(ptr),
                 ctypes.c_void_p(self.buf.ctypes.data + offset), nbytes, self._stream)
        drv.call("cuStreamSynchronize", self._stream)
        dt = time.perf_counter() - t0
        self.h2d_s += dt
        self.h2d_bytes += nbytes
        return dt

    def from_device(self, ptr: int, nbytes: int, offset: int = 0, after: int = 0) -> float:
        """Copy ``nbytes`` at GPU address ``ptr`` into ``buf[offset:]`` once the work
        queued on stream ``after`` (the producer's) is done; waits; seconds taken."""
        drv = _Driver.get()
        t0 = time.perf_counter()
        drv.current(self.device)
        # ordered after the producer's kernels without blocking the host on them
        drv.call("cuEventRecord", self._event, ctypes.c_void_p(after or None))
        drv.call("cuStreamWaitEvent", self._stream, self._event, 0)
        drv.call("cuMemcpyDtoHAsync_v2", ctypes.c_void_p(self.buf.ctypes.data + offset),
                 ctypes.c_uint64(ptr), nbytes, self._stream)
        drv.call("cuStreamSynchronize", self._stream)
        dt = time.perf_counter() - t0
        self.d2h_s += dt
        self.d2h_bytes += nbytes
        return dt

    def close(self) -> None:
        if self._engine is not None:
            self._engine.unregister_buffer(self.buf)
            self._engine = None
        if self.device is not None and self._cuda_registered:
            drv = _Driver.get()
            drv.current(self.device)
            drv.call("cuStreamSynchronize", self._stream)
            drv.call("cuEventDestroy_v2", self._event)
            drv.call("cuStreamDestroy_v2", self._stream)
            drv.call("cuMemHostUnregister", ctypes.c_void_p(self.buf.ctypes.data))
            self._cuda_registered = False


class RelayPool:
    """``count`` relays of ``nbytes`` each (one per copy thread).

    Args:
        count: relays (the paper's N_threads).
        nbytes: bytes of each (one K or V tensor: M_pin).
        device: CUDA device for pinned relays with streams; None for host relays.
        engine: phx engine to register the relays with (io_uring fixed buffers).
    """

    def __init__(self, count: int, nbytes: int, device: int | None = None, engine=None):
        if count < 1:
            raise ValueError("a relay pool needs at least one relay")
        self.device = device
        self.relays = [Relay(nbytes, device, engine) for _ in range(count)]
        self.nbytes = int(nbytes)
        self._free = list(self.relays)
        self._cond = threading.Condition()
        self._local = threading.local()

    @property
    def pinned_bytes(self) -> int:
        """Host bytes the relays hold (page-locked when on a device)."""
        return sum(r.buf.nbytes for r in self.relays)

    def current(self) -> Relay | None:
        """The relay bound to the calling thread, if any."""
        return getattr(self._local, "relay", None)

    @contextlib.contextmanager
    def bind(self, relay: Relay) -> Iterator[Relay]:
        """Make ``relay`` the calling thread's relay while the block runs."""
        prev = self.current()
        self._local.relay = relay
        try:
            yield relay
        finally:
            self._local.relay = prev

    @contextlib.contextmanager
    def acquire(self) -> Iterator[Relay]:
        """The calling thread's bound relay, else a free one for the block (waits)."""
        r = self.current()
        if r is not None:
            yield r
            return
        with self._cond:
            while not self._free:
                self._cond.wait()
            r = self._free.pop()
        try:
            with self.bind(r):
                yield r
        finally:
            with self._cond:
                self._free.append(r)
                self._cond.notify()

    def stats(self) -> dict:
        return {"relays": len(self.relays), "relay_bytes": self.nbytes,
                "pinned_bytes": self.pinned_bytes if self.device is not None else 0,
                "device": self.device,
                "h2d_bytes": sum(r.h2d_bytes for r in self.relays),
                "h2d_s": sum(r.h2d_s for r in self.relays),
                "d2h_bytes": sum(r.d2h_bytes for r in self.relays),
                "d2h_s": sum(r.d2h_s for r in self.relays)}

    def close(self) -> None:
        for r in self.relays:
            r.close()
