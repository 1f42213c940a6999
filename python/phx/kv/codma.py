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

CUDA is reached through libphx (:func:`phx.gpu.pin`, :class:`phx.gpu.CopyStream`:
``phx_cuda_host_register`` and ``phx_cuda_stream_*``, on the device's primary
context, the one torch and CuPy use); buffers are recognised and resolved by
:mod:`phx.gpu` (CUDA torch tensors, ``__cuda_array_interface__``, DLPack).  Without
a GPU the pool holds plain aligned host relays (``device=None``): what the CPU
benchmark uses as its stand-in.
"""
from __future__ import annotations

import contextlib
import threading
import time
from typing import TYPE_CHECKING, Any, Iterator

from phx.kv import _sys

if TYPE_CHECKING:
    from phx import Engine
    from phx.gpu import CopyStream, PinnedMemory, _View


class CudaError(OSError, RuntimeError):
    """A CUDA call of a relay failed (an ``OSError`` whose text names the
    driver call and its error)."""


@contextlib.contextmanager
def _cuda_errors() -> Iterator[None]:
    try:
        yield
    except CudaError:
        raise
    except OSError as e:
        raise CudaError(e.errno, e.strerror) from e


def gpu_view(obj: Any) -> _View | None:
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
    """One copy thread's relay: ``buf`` (uint8, aligned), on ``device`` (None: host).

    On a device the buffer is pinned for it (:func:`phx.gpu.pin`) and has its own
    :class:`phx.gpu.CopyStream`; with ``engine`` it is also one of that engine's
    io_uring fixed buffers.
    """

    def __init__(self, nbytes: int, device: int | None = None, engine: Engine | None = None):
        self.nbytes = int(nbytes)
        self.device = device
        self.buf = _sys.aligned_empty(max(self.nbytes, 1))
        self.buf[:] = 0                 # touched: charged (and locked) now, not at first use
        self.h2d_bytes = self.d2h_bytes = 0
        self.h2d_s = self.d2h_s = 0.0
        self._addr = self.buf.ctypes.data
        self._pin: PinnedMemory | None = None
        self._copy: CopyStream | None = None
        self._engine: Engine | None = None
        if device is not None:
            import phx.gpu
            try:
                with _cuda_errors():
                    self._pin = phx.gpu.pin(self.buf, device)
                    self._copy = phx.gpu.CopyStream(device)
            except BaseException:
                self.close()
                raise
        if engine is not None:
            # io_uring fixed buffer: O_DIRECT I/O into the relay needs no bounce
            engine.register_buffer(self.buf)
            self._engine = engine

    @property
    def pinned(self) -> bool:
        return self._pin is not None and self._pin.pinned

    @property
    def stream(self) -> int:
        """The CUstream of this relay's copies (0 for a host relay)."""
        return self._copy.handle if self._copy is not None else 0

    def _span(self, nbytes: int, offset: int) -> tuple[CopyStream, int]:
        """The copy stream and the host address of ``buf[offset:offset+nbytes]``."""
        copy = self._copy
        if copy is None:
            raise ValueError("a host relay (device=None) makes no GPU copies")
        if offset < 0 or nbytes < 0 or offset + nbytes > self.buf.nbytes:
            raise ValueError(f"[{offset}, {offset + nbytes}) is outside the relay "
                             f"({self.buf.nbytes} bytes)")
        return copy, self._addr + offset

    def to_device(self, ptr: int, nbytes: int, offset: int = 0) -> float:
        """Copy ``buf[offset:offset+nbytes]`` to GPU address ``ptr`` on this relay's
        stream and wait for it; returns the seconds it took."""
        copy, src = self._span(nbytes, offset)
        t0 = time.perf_counter()
        with _cuda_errors():
            copy.h2d(ptr, src, nbytes)
            copy.synchronize()
        dt = time.perf_counter() - t0
        self.h2d_s += dt
        self.h2d_bytes += nbytes
        return dt

    def from_device(self, ptr: int, nbytes: int, offset: int = 0, after: int = 0) -> float:
        """Copy ``nbytes`` at GPU address ``ptr`` into ``buf[offset:]`` once the work
        queued on stream ``after`` (the producer's; 0: the legacy default stream)
        is done; waits; seconds taken."""
        copy, dst = self._span(nbytes, offset)
        t0 = time.perf_counter()
        with _cuda_errors():
            # ordered after the producer's kernels without blocking the host on them
            copy.after(after or 0)
            copy.d2h(dst, ptr, nbytes)
            copy.synchronize()
        dt = time.perf_counter() - t0
        self.d2h_s += dt
        self.d2h_bytes += nbytes
        return dt

    def close(self) -> None:
        if self._engine is not None:
            self._engine.unregister_buffer(self.buf)
            self._engine = None
        copy, pin = self._copy, self._pin
        self._copy = self._pin = None
        with _cuda_errors():
            try:
                if copy is not None:
                    copy.close()        # waits for the copies still queued
            finally:
                if pin is not None:
                    pin.close()


class RelayPool:
    """``count`` relays of ``nbytes`` each (one per copy thread).

    Args:
        count: relays (the paper's N_threads).
        nbytes: bytes of each (one K or V tensor: M_pin).
        device: CUDA device for pinned relays with streams; None for host relays.
        engine: phx engine to register the relays with (io_uring fixed buffers).
    """

    def __init__(self, count: int, nbytes: int, device: int | None = None,
                 engine: Engine | None = None):
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

    def stats(self) -> dict[str, int | float | None]:
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
