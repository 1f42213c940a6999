"""GPU memory as source and target of phx I/O (pinned "Co-DMA" staging).

Without the phx kernel module an NVMe controller cannot write into GPU
memory, so phx stages through a few pinned host buffers per engine: the SSD
fills one (io_uring, O_DIRECT, fixed buffer) while the copy engine moves the
previous one to the GPU.  No payload byte is copied by the CPU.  CUDA is
loaded at run time, so this module imports on machines without a GPU;
:func:`is_available` says whether it can be used, and why not.

GPU buffers: CUDA torch tensors, objects with ``__cuda_array_interface__``
(CuPy, Numba, ...) and DLPack objects on a CUDA device; they must be
contiguous (:class:`phx.BufferNotContiguousError` otherwise).

Three ways to call it:

* ``File.pread/pwrite(gpu_buf, offset)`` (routed here) or :func:`pread` /
  :func:`pwrite`: synchronous.  They are ordered after the work already
  queued on the buffer's stream (torch: the current stream; CuPy: the
  interface's ``stream``, else the legacy default stream), so writing a
  freshly computed tensor needs no ``synchronize()``; the data is on the GPU
  (or in the file) when they return.
* ``File.pread_async/pwrite_async`` or :func:`pread_async` /
  :func:`pwrite_async`: the same, returning a :class:`GPUFuture`.
* :func:`read_async` / :func:`write_async`: stream-ordered, like
  ``cuFileReadAsync``: queued on a CUDA stream and executed when the stream
  gets there; kernels queued after a read see its data, a write sends what
  kernels queued before it produced.  No host synchronisation.

Batches: :func:`pread_batch` / :func:`pwrite_batch` (a list of buffers) and
:func:`read_chunks` / :func:`write_chunks` (N file ranges <-> N places of one
GPU buffer, e.g. KV blocks) submit everything with one call; the requests
share staging buffers and a few copy calls (``cuMemcpyBatchAsync``).
:func:`pread_many` / :func:`pwrite_many` (also ``File.pread_many`` with a GPU
buffer) and the stream-ordered :func:`read_many_async` /
:func:`write_many_async` take the pieces as int64 arrays, checked at once
(issue 29: thousands of 8-64 KiB KV blocks; :mod:`phx.blocks` makes the
arrays from vLLM block ids and layers).

Host memory the caller moves itself: :func:`pin` page-locks a host buffer for
a device and :class:`CopyStream` queues H2D / D2H copies on a stream of the
device's primary context (ordered after another stream with ``after``), with no
staging context (phx.kv's Co-DMA relays).

Files used for GPU I/O are held while it is in flight: ``File.close()``
then fails with ``EBUSY`` (wait for the futures / synchronise the stream).

Settings: a context takes, in this order, the keyword arguments of
:func:`context`, the ``PHX_CUDA_*`` environment variables (``PHX_CUDA_LANES``,
``PHX_CUDA_BUFS``, ``PHX_CUDA_BUF_SIZE``, ``PHX_CUDA_MAX_IO``,
``PHX_CUDA_NO_BATCH_COPY=1``, ``PHX_CUDA_NO_MEMOPS=1``), the choice ``phx
tune`` measured and cached for the device (:mod:`phx.tune`), and the built-in
defaults (16 lanes x 4 x 4 MiB).  ``phx info`` shows which applied and why.
"""
from __future__ import annotations

import os
import sys
import threading
from collections import deque
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar, cast

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt

    from phx import Engine
    from phx._typing import BufferLike, DeviceBuffer, HostBuffer

__all__ = [
    "CopyStream", "GPUBatch", "GPUFuture", "PinnedMemory", "StreamBatch", "StreamOp",
    "context", "engine_stats", "is_available", "is_device_buffer", "pin",
    "pread", "pread_async", "pread_batch", "pread_many", "pwrite", "pwrite_async",
    "pwrite_batch", "pwrite_many", "read_async", "read_chunks", "read_chunks_async",
    "read_many_async", "stats", "write_async", "write_chunks", "write_chunks_async",
    "write_many_async",
]

try:
    from phx._lib import cuda as _cuda
    _IMPORT_ERROR: str | None = None
except ImportError as e:  # built without the GPU module
    # None only where is_available() says so: _require() guards every use
    _cuda = None  # type: ignore[assignment]
    _IMPORT_ERROR = f"phx was built without its GPU module: {e}"

try:
    from phx._lib.engine import BufferNotContiguousError, BufferReadOnlyError
    from phx._lib.engine import File as _File
    from phx._lib.engine import is_device_buffer as _is_device_buffer
except ImportError:  # the core is missing: only is_available() is useful
    # stand-ins of the compiled names, which the checker knows from the stubs
    BufferNotContiguousError = BufferReadOnlyError = ValueError  # type: ignore[misc, assignment]
    _File = None  # type: ignore[misc, assignment]
    _is_device_buffer = None  # type: ignore[assignment]

from phx.futures import PATHS, PhxFuture, empty_paths

_avail: tuple[bool, str] | None = None
_lock = threading.Lock()
_contexts: dict[tuple[int, int], _Holder] = {}
_pending: deque[_cuda.IO | _cuda.ManyStream] = deque()


def is_available() -> tuple[bool, str]:
    """``(True, "CUDA driver 13.0, 1 device")`` or ``(False, reason)``."""
    global _avail
    if _avail is None:
        if _cuda is None:
            _avail = (False, _IMPORT_ERROR or "no GPU module")
        else:
            _avail = _cuda.available()
    return _avail


def is_device_buffer(buf: object) -> bool:
    """True for GPU memory (CUDA torch tensors, ``__cuda_array_interface__``,
    DLPack on a CUDA device)."""
    # the interfaces first: some GPU arrays (CuPy) also fill the buffer slot
    if hasattr(buf, "__cuda_array_interface__"):
        return True
    t = sys.modules.get("torch")
    if t is not None and isinstance(buf, t.Tensor):
        return bool(buf.is_cuda)
    dev = getattr(buf, "__dlpack_device__", None)
    if dev is not None:
        try:
            return dev()[0] in (2, 3, 13)
        except Exception:
            return False
    if _is_device_buffer is not None:
        return bool(_is_device_buffer(buf))
    return False


def _require() -> None:
    ok, why = is_available()
    if not ok:
        raise RuntimeError(f"phx GPU I/O is unavailable: {why}")


# ---------------------------------------------------------------------------
# Buffers and streams
# ---------------------------------------------------------------------------

class _View:
    __slots__ = ("ptr", "nbytes", "device", "keep", "stream", "readonly")

    def __init__(self, ptr: int, nbytes: int, device: int, keep: object, stream: int,
                 readonly: bool = False) -> None:
        self.ptr, self.nbytes, self.device = int(ptr), int(nbytes), int(device)
        self.keep, self.stream, self.readonly = keep, stream, readonly


def _c_contiguous(shape: Sequence[int], strides: Sequence[int] | None, itemsize: int) -> bool:
    if strides is None:
        return True
    expect = itemsize
    for dim, st in zip(reversed(shape), reversed(strides)):
        if dim != 1 and st != expect:
            return False
        expect *= dim
    return True


def _view(buf: Any, path: object = None) -> _View:
    """Address, size, device and producer stream of a GPU buffer."""
    t = sys.modules.get("torch")
    if t is not None and isinstance(buf, t.Tensor):
        if not buf.is_cuda:
            raise TypeError(f"{buf.device} tensor is not GPU memory")
        if not buf.is_contiguous():
            raise BufferNotContiguousError(
                22, "tensor is not contiguous (use .contiguous())", path)
        dev = buf.device.index if buf.device.index is not None else t.cuda.current_device()
        stream = t.cuda.current_stream(dev).cuda_stream
        return _View(buf.data_ptr(), buf.numel() * buf.element_size(), dev, buf, stream)
    cai = getattr(buf, "__cuda_array_interface__", None)
    if cai is not None:
        ptr, ro = cai["data"]
        shape = tuple(cai["shape"])
        itemsize = int(cai["typestr"][2:])
        if not _c_contiguous(shape, cai.get("strides"), itemsize):
            raise BufferNotContiguousError(
                22, "array is not C-contiguous (copy it first)", path)
        n = itemsize
        for d in shape:
            n *= d
        dev = _cuda.pointer_device(ptr) if ptr and n else 0
        stream = cai.get("stream")
        # v3: None = no synchronisation needed; 1 = legacy default; 2 = per-thread
        return _View(ptr, n, dev, buf, 0 if stream in (None, 1) else stream, bool(ro))
    if hasattr(buf, "__dlpack__"):
        try:
            cap = buf.__dlpack__(stream=None)
        except TypeError:
            cap = buf.__dlpack__()
        ptr, n, dtype, dev, contig = _cuda.dlpack_view(cap)
        if dtype not in (2, 13):
            raise TypeError(f"DLPack device type {dtype} is not CUDA memory")
        if not contig:
            raise BufferNotContiguousError(
                22, "DLPack tensor is not contiguous (copy it first)", path)
        return _View(ptr, n, dev, (buf, cap), 0)
    raise TypeError(f"{type(buf).__name__} is not GPU memory (need a CUDA tensor, "
                    "__cuda_array_interface__ or DLPack)")


def _stream_handle(stream: Any, view: _View | None = None) -> int:
    """A CUstream int from None / int / torch / cupy / __cuda_stream__ objects."""
    if stream is None:
        return int(view.stream) if view is not None and view.stream else 0
    if isinstance(stream, int):
        return stream
    for attr in ("cuda_stream", "ptr", "handle"):
        h = getattr(stream, attr, None)
        if isinstance(h, int):
            return h
    proto = getattr(stream, "__cuda_stream__", None)
    if proto is not None:
        return int(proto()[1])
    raise TypeError(f"cannot use {type(stream).__name__} as a CUDA stream")


# ---------------------------------------------------------------------------
# Contexts (one per engine and device)
# ---------------------------------------------------------------------------

def context(engine: Engine | None = None, device: int = 0, **config: Any) -> _cuda.Context:
    """The staging context of ``engine`` (default: phx's default engine) on
    ``device``, created on first use.  ``config`` (lanes, bufs_per_lane,
    buf_size, max_io_size, memops, batch_copy, fixed_bufs, early_reads) applies when it
    is created, over the environment and the tuned defaults; pass
    ``_new=True`` to get a private one with these settings.

    One process may feed several GPUs: each device has its own context
    (lanes, staging bound to the device's NUMA node where the machine has
    several: ``config["staging_node"]``, -1 when not bound), requests go to
    the context of the device their buffer is on, and :func:`stats` with
    ``device=N`` counts that device's bytes only (docs/multigpu.md)."""
    _require()
    if engine is None:
        import phx
        engine = phx.default_engine()
    new = config.pop("_new", False)
    if new:
        return _cuda.Context(engine, device, **_with_defaults(device, config))
    key = (id(engine), device)
    with _lock:
        ctx = _contexts.get(key)
        if ctx is not None and (ctx.pid != os.getpid() or ctx._engine_ref() is not engine):
            _contexts.pop(key, None)
            ctx = None
        if ctx is None:
            new_ctx = _cuda.Context(engine, device, **_with_defaults(device, config))
            import weakref

            def gone(_r: object, k: tuple[int, int] = key) -> None:
                _drop(k)
            ref: Callable[[], object]
            try:
                ref = weakref.ref(engine, gone)
            except TypeError:
                def strong(e: Engine = engine) -> object:
                    return e
                ref = strong
            _contexts[key] = _Holder(new_ctx, ref)
            return new_ctx
        return ctx.ctx


def stream_ops_status(device: int = 0) -> tuple[bool, str]:
    """Whether stream-ordered calls (:func:`read_async`, libphxfile) work on
    ``device`` with this driver, and why not: a private context of one small
    staging buffer is made to find out (the driver must load the copy
    kernels' PTX and accept stream memory operations)."""
    _require()
    ctx = _cuda.Context(None, device, lanes=1, bufs_per_lane=1, buf_size=64 << 10,
                        max_io_size=64 << 10)
    try:
        cfg = ctx.config
        return bool(cfg["memops"]), cfg["stream_ops_why"] or "available"
    finally:
        ctx.close()


def _with_defaults(device: int, config: dict[str, Any]) -> dict[str, Any]:
    """``config`` completed by the tuned choice for ``device`` where neither
    it nor a PHX_CUDA_* variable sets a value."""
    try:
        from phx import tune
        chosen = tune.defaults_for(device)
    except Exception:  # noqa: BLE001 - a broken cache must not stop I/O
        chosen = {}
    out = dict(config)
    env = {"lanes": "PHX_CUDA_LANES", "bufs_per_lane": "PHX_CUDA_BUFS",
           "buf_size": "PHX_CUDA_BUF_SIZE", "max_io_size": "PHX_CUDA_MAX_IO"}
    for k, v in chosen.items():
        if k in env and k not in out and not os.environ.get(env[k]):
            out[k] = v
    return out


class _Holder:
    __slots__ = ("ctx", "_engine_ref")

    def __init__(self, ctx: _cuda.Context, ref: Callable[[], object]) -> None:
        self.ctx, self._engine_ref = ctx, ref

    @property
    def pid(self) -> int:
        return self.ctx.pid


def _drop(key: tuple[int, int]) -> None:
    with _lock:
        h = _contexts.pop(key, None)
    if h is not None:
        h.ctx.close()


def _ctx_for(file: _File, view: _View) -> _cuda.Context:
    return context(file.engine, view.device)


# ---------------------------------------------------------------------------
# Futures
# ---------------------------------------------------------------------------

class GPUFuture(PhxFuture):
    """A host-async GPU request (:class:`phx.PhxFuture`): ``result()`` is the
    byte count (short at end of file)."""

    __slots__ = ("_h", "_res")

    def __init__(self, h: _cuda.IO) -> None:
        self._h = h
        self._res: int | None = None

    def done(self) -> bool:
        return self._h.done()

    def result(self, timeout: float | None = None) -> int:
        """Bytes moved (short at end of file); raises the request's OSError."""
        if self._res is None:
            self._res = self._h.wait(timeout)
        return self._h.check(self._res)

    def bytes_by_path(self) -> dict[str, int]:
        if not self._h.done():
            return empty_paths()
        return {k: self._h.by_path[k] for k in PATHS}

    def by_path(self) -> dict[str, int]:
        """Deprecated: :meth:`bytes_by_path` (the same counts, without ``paths``)."""
        _deprecated("GPUFuture.by_path()", "bytes_by_path()")
        return self._h.by_path

    def _wake_fd(self) -> int | None:
        return self._h.eventfd()


class StreamOp(PhxFuture):
    """A stream-ordered request (:class:`phx.PhxFuture`).  ``bytes_done`` is
    valid once the stream has passed it (e.g. after ``stream.synchronize()``);
    ``result()`` waits on the host side and returns it, raising on error."""

    __slots__ = ("_h",)

    def __init__(self, h: _cuda.IO) -> None:
        self._h = h

    @property
    def bytes_done(self) -> int:
        return self._h.raw_result

    def done(self) -> bool:
        return self._h.done()

    def result(self, timeout: float | None = None) -> int:
        return self._h.check(self._h.wait(timeout))

    def bytes_by_path(self) -> dict[str, int]:
        if not self._h.done():
            return empty_paths()
        return {k: self._h.by_path[k] for k in PATHS}

    def by_path(self) -> dict[str, int]:
        """Deprecated: :meth:`bytes_by_path`."""
        _deprecated("StreamOp.by_path()", "bytes_by_path()")
        return self._h.by_path

    def _wake_fd(self) -> int | None:
        return self._h.eventfd()


def _deprecated(old: str, new: str) -> None:
    import warnings
    warnings.warn(f"phx.gpu: {old} is deprecated; use {new} (removed in the next release)",
                  DeprecationWarning, stacklevel=3)


_F = TypeVar("_F", bound=Callable[..., Any])


def _buffer_first(name: str, reqs: bool = False) -> Callable[[_F], _F]:
    """Calls take ``(buffer, file, offset)``, like every phx call; the old
    ``(file, buffer, offset)`` order still works for one release, with a
    DeprecationWarning (told apart by the first argument being a phx File).
    (Typed as the new order only.)"""
    def wrap(fn: _F) -> _F:
        def call(first: Any, second: Any, *args: Any, **kw: Any) -> Any:
            if _is_file(first) and not _is_file(second):
                _deprecated(f"{name}(file, {'reqs' if reqs else 'buf'}, ...)",
                            f"{name}({'reqs' if reqs else 'buf'}, file, ...)")
                first, second = second, first
            return fn(first, second, *args, **kw)
        call.__name__ = fn.__name__
        call.__qualname__ = fn.__qualname__
        call.__doc__ = fn.__doc__
        call.__wrapped__ = fn  # type: ignore[attr-defined]  # functools.wraps' attribute, set by hand
        return cast(_F, call)
    return wrap


def _is_file(obj: Any) -> bool:
    return _File is not None and isinstance(obj, _File)


_pending_lock = threading.Lock()


def _keep(h: _cuda.IO | _cuda.ManyStream) -> None:
    """Hold a stream op's handle until it is done (its memory is the
    request's); threads submitting at once share the queue, hence the lock."""
    with _pending_lock:
        while _pending and _pending[0].done():
            _pending.popleft()
        _pending.append(h)


def _submit(file: _File, buf: Any, offset: int, write: bool, stream_mode: bool,
            stream: Any = None) -> _cuda.IO:
    _require()
    if offset < 0:
        raise OSError(22, "negative offset", getattr(file, "path", None))
    view = _view(buf, getattr(file, "path", None))
    if not write and view.readonly:
        raise BufferReadOnlyError(22, "cannot read into a read-only GPU buffer",
                                  getattr(file, "path", None))
    ctx = _ctx_for(file, view)
    if stream_mode:
        h = ctx.submit_stream(file._c_file, view.ptr, view.nbytes, offset, write,
                              _stream_handle(stream, view), keep=(view.keep, file),
                              path=file.path)
        _keep(h)
        return h
    return ctx.submit(file._c_file, view.ptr, view.nbytes, offset, write,
                      keep=(view.keep, file), path=file.path,
                      after_stream=_stream_handle(stream, view))


# ---------------------------------------------------------------------------
# The calls File routes here
# ---------------------------------------------------------------------------

@_buffer_first("pread")
def pread(buf: DeviceBuffer, file: _File, offset: int = 0) -> int:
    """Read ``buf``'s size at ``offset`` into GPU memory; bytes read (short at EOF)."""
    return GPUFuture(_submit(file, buf, offset, False, False)).result()


@_buffer_first("pwrite")
def pwrite(buf: DeviceBuffer, file: _File, offset: int = 0) -> int:
    """Write the GPU buffer at ``offset``; bytes written."""
    return GPUFuture(_submit(file, buf, offset, True, False)).result()


@_buffer_first("pread_async")
def pread_async(buf: DeviceBuffer, file: _File, offset: int = 0) -> GPUFuture:
    """:func:`pread` started: a :class:`GPUFuture`."""
    return GPUFuture(_submit(file, buf, offset, False, False))


@_buffer_first("pwrite_async")
def pwrite_async(buf: DeviceBuffer, file: _File, offset: int = 0) -> GPUFuture:
    """:func:`pwrite` started: a :class:`GPUFuture`."""
    return GPUFuture(_submit(file, buf, offset, True, False))


class GPUBatch(PhxFuture):
    """A batch (:class:`phx.PhxFuture`): ``result()`` is the bytes moved by
    each request, in order; ``bytes_by_path()`` sums them."""

    __slots__ = ("_b", "_res")

    def __init__(self, b: _cuda.Batch | _EmptyBatch) -> None:
        self._b = b
        self._res: list[int] | None = None

    def done(self) -> bool:
        return self._b.done()

    def result(self, timeout: float | None = None) -> list[int]:
        """Bytes moved by each request, in order; raises the first error."""
        if self._res is None:
            self._res = self._b.wait(timeout)
        return self._b.check(self._res)

    def bytes_by_path(self) -> dict[str, int]:
        return self._b.by_path if self._b.done() else empty_paths()

    def _wake_fd(self) -> int | None:
        return self._b.eventfd()


def _batch(file: _File, views: list[_View], offsets: list[int], write: bool) -> GPUBatch:
    _require()
    if not views:
        return GPUBatch(_EmptyBatch())
    dev = views[0].device
    if any(v.device != dev for v in views):
        raise ValueError("a batch's GPU buffers must be on one device")
    for o in offsets:
        if o < 0:
            raise OSError(22, "negative offset", getattr(file, "path", None))
    if not write and any(v.readonly for v in views):
        raise BufferReadOnlyError(22, "cannot read into a read-only GPU buffer",
                                  getattr(file, "path", None))
    ctx = _ctx_for(file, views[0])
    return GPUBatch(ctx.submit_batch(
        file._c_file, 0, list(offsets), [v.ptr for v in views], [v.nbytes for v in views],
        write, keep=([v.keep for v in views], file), path=file.path,
        after_stream=_stream_handle(None, views[0])))


class _EmptyBatch:
    by_path: dict[str, int] = {"direct": 0, "bounce": 0, "page_cache": 0}

    def done(self) -> bool:
        return True

    def wait(self, timeout: float | None = None) -> list[int]:
        return []

    def check(self, res: list[int]) -> list[int]:
        return res

    def eventfd(self) -> None:
        return None


@_buffer_first("pread_batch", reqs=True)
def pread_batch(reqs: Sequence[tuple[DeviceBuffer, int]], file: _File) -> list[int]:
    """Read ``[(gpu_buf, offset), ...]`` with one submission; bytes per request."""
    return pread_batch_async(reqs, file).result()


@_buffer_first("pwrite_batch", reqs=True)
def pwrite_batch(reqs: Sequence[tuple[DeviceBuffer, int]], file: _File) -> list[int]:
    """Write ``[(gpu_buf, offset), ...]`` with one submission; bytes per request."""
    return pwrite_batch_async(reqs, file).result()


@_buffer_first("pread_batch_async", reqs=True)
def pread_batch_async(reqs: Sequence[tuple[DeviceBuffer, int]], file: _File) -> GPUBatch:
    """:func:`pread_batch` started: a :class:`GPUBatch`."""
    path = getattr(file, "path", None)
    return _batch(file, [_view(b, path) for b, _ in reqs], [o for _, o in reqs], False)


@_buffer_first("pwrite_batch_async", reqs=True)
def pwrite_batch_async(reqs: Sequence[tuple[DeviceBuffer, int]], file: _File) -> GPUBatch:
    """:func:`pwrite_batch` started: a :class:`GPUBatch`."""
    path = getattr(file, "path", None)
    return _batch(file, [_view(b, path) for b, _ in reqs], [o for _, o in reqs], True)


def _chunks(file: _File, buf: Any, file_offsets: npt.ArrayLike, buf_offsets: npt.ArrayLike,
            sizes: npt.ArrayLike, write: bool) -> GPUBatch:
    """N ranges of ``file`` <-> N places of one GPU buffer, one submission."""
    _require()
    import numpy as np
    path = getattr(file, "path", None)
    view = _view(buf, path)
    if not write and view.readonly:
        raise BufferReadOnlyError(22, "cannot read into a read-only GPU buffer", path)
    fo = np.asarray(file_offsets, dtype=np.int64)
    bo = np.asarray(buf_offsets, dtype=np.int64)
    sz = np.asarray(sizes, dtype=np.int64)
    if not (fo.shape == bo.shape == sz.shape) or fo.ndim != 1:
        raise ValueError("file_offsets, buf_offsets and sizes must be 1-D and of one length")
    if fo.size and (fo.min() < 0 or bo.min() < 0 or sz.min() < 0):
        raise OSError(22, "negative offset or size", path)
    if fo.size and int((bo + sz).max()) > view.nbytes:
        raise OSError(22, f"a chunk runs past the {view.nbytes}-byte GPU buffer", path)
    ctx = _ctx_for(file, view)
    return GPUBatch(ctx.submit_batch(file._c_file, view.ptr, fo, bo, sz, write,
                                     keep=(view.keep, file), path=file.path,
                                     after_stream=_stream_handle(None, view)))


@_buffer_first("read_chunks_async")
def read_chunks_async(buf: DeviceBuffer, file: _File, file_offsets: npt.ArrayLike,
                      buf_offsets: npt.ArrayLike, sizes: npt.ArrayLike) -> GPUBatch:
    """Read ``sizes[i]`` bytes at ``file_offsets[i]`` into ``buf`` at byte
    ``buf_offsets[i]``, for every i, with one submission."""
    return _chunks(file, buf, file_offsets, buf_offsets, sizes, False)


@_buffer_first("write_chunks_async")
def write_chunks_async(buf: DeviceBuffer, file: _File, file_offsets: npt.ArrayLike,
                       buf_offsets: npt.ArrayLike, sizes: npt.ArrayLike) -> GPUBatch:
    """Write ``sizes[i]`` bytes of ``buf`` at byte ``buf_offsets[i]`` to
    ``file_offsets[i]``, for every i, with one submission."""
    return _chunks(file, buf, file_offsets, buf_offsets, sizes, True)


@_buffer_first("read_chunks")
def read_chunks(buf: DeviceBuffer, file: _File, file_offsets: npt.ArrayLike,
                buf_offsets: npt.ArrayLike, sizes: npt.ArrayLike) -> list[int]:
    """:func:`read_chunks_async`, waited for: bytes per chunk (short at EOF)."""
    return read_chunks_async(buf, file, file_offsets, buf_offsets, sizes).result()


@_buffer_first("write_chunks")
def write_chunks(buf: DeviceBuffer, file: _File, file_offsets: npt.ArrayLike,
                 buf_offsets: npt.ArrayLike, sizes: npt.ArrayLike) -> list[int]:
    """:func:`write_chunks_async`, waited for: bytes per chunk."""
    return write_chunks_async(buf, file, file_offsets, buf_offsets, sizes).result()


# ---------------------------------------------------------------------------
# Many small pieces by arrays (issue 29): no Python object per piece
# ---------------------------------------------------------------------------

def _many_arrays(nbytes: npt.ArrayLike, offsets: npt.ArrayLike,
                 buf_offsets: npt.ArrayLike | None) -> tuple[Any, Any, Any]:
    """int64 arrays (file offsets, buffer offsets, lengths), as File.pread_many
    takes them: ``nbytes`` one int for all or one per piece; ``buf_offsets``
    by default the pieces back to back."""
    import numpy as np
    fo = np.ascontiguousarray(offsets, dtype=np.int64).reshape(-1)
    n = fo.shape[0]
    if np.ndim(nbytes) == 0:
        ln = np.full(n, int(cast(Any, nbytes)), dtype=np.int64)
    else:
        ln = np.ascontiguousarray(nbytes, dtype=np.int64).reshape(-1)
    if ln.shape[0] != n:
        raise ValueError(f"{n} offsets but {ln.shape[0]} sizes")
    if buf_offsets is None:
        bo = np.zeros(n, dtype=np.int64)
        if n > 1:
            np.cumsum(ln[:-1], out=bo[1:])
    else:
        bo = np.ascontiguousarray(buf_offsets, dtype=np.int64).reshape(-1)
        if bo.shape[0] != n:
            raise ValueError(f"{n} offsets but {bo.shape[0]} buffer offsets")
    return fo, bo, ln


def _many_view(file: _File, buf: Any, write: bool) -> _View:
    _require()
    path = getattr(file, "path", None)
    view = _view(buf, path)
    if not write and view.readonly:
        raise BufferReadOnlyError(22, "cannot read into a read-only GPU buffer", path)
    return view


def _first_error(res: Any, path: object, write: bool, fo: Any, ln: Any) -> None:
    """Raise the OSError of the first failed piece (after all are done)."""
    import numpy as np
    bad = np.flatnonzero(res < 0)
    if bad.size:
        i = int(bad[0])
        e = -int(res[i])
        raise OSError(e, f"{os.strerror(e)}: piece {i} ({'write' if write else 'read'} of "
                         f"{int(ln[i])} bytes at {int(fo[i])})", path)


def _many(buf: Any, file: _File, offsets: npt.ArrayLike, nbytes: npt.ArrayLike,
          buf_offsets: npt.ArrayLike | None, write: bool) -> npt.NDArray[np.int64]:
    view = _many_view(file, buf, write)
    fo, bo, ln = _many_arrays(nbytes, offsets, buf_offsets)
    ctx = _ctx_for(file, view)
    _total, res = ctx.many(file._c_file, view.ptr, view.nbytes, fo, bo, ln, write,
                           after_stream=_stream_handle(None, view), path=file.path)
    _first_error(res, file.path, write, fo, ln)
    return res


def pread_many(buf: DeviceBuffer, file: _File, offsets: npt.ArrayLike,
               nbytes: npt.ArrayLike, buf_offsets: npt.ArrayLike | None = None
               ) -> npt.NDArray[np.int64]:
    """Read many pieces of ``file`` into one GPU buffer, as
    ``File.pread_many`` does into host memory: piece ``i`` is ``nbytes[i]``
    bytes (or ``nbytes`` for all) at file offset ``offsets[i]``, landing at
    byte ``buf_offsets[i]`` of ``buf`` (default: back to back).  Integer
    arrays in, no Python object per piece; the pieces are packed many to a
    staging buffer.  Ordered after the work queued on the buffer's stream.
    Returns an int64 array of byte counts (short at end of file); raises the
    first failure's OSError after all have finished, ValueError (nothing
    queued) for pieces past the buffer, negative values or two reads into
    one place."""
    return _many(buf, file, offsets, nbytes, buf_offsets, False)


def pwrite_many(buf: DeviceBuffer, file: _File, offsets: npt.ArrayLike,
                nbytes: npt.ArrayLike, buf_offsets: npt.ArrayLike | None = None
                ) -> npt.NDArray[np.int64]:
    """Write many pieces of one GPU buffer to ``file`` (the arguments as for
    :func:`pread_many`; two pieces may not write one file byte)."""
    return _many(buf, file, offsets, nbytes, buf_offsets, True)


class StreamBatch(PhxFuture):
    """Stream-ordered pieces (:func:`read_many_async`): ``results`` is an
    int64 array, -EINPROGRESS per piece until the stream is past it.
    ``result()`` waits on the host until every piece's copy has run (libphx
    counts them down; a final result comes a little earlier, before the
    stream's copy kernel; the pieces tell no eventfd, so it polls) and
    returns the array, raising the first failure's OSError."""

    __slots__ = ("_h", "_write", "_fo", "_ln")

    def __init__(self, h: _cuda.ManyStream, write: bool, fo: Any, ln: Any) -> None:
        self._h, self._write, self._fo, self._ln = h, write, fo, ln

    @property
    def results(self) -> npt.NDArray[np.int64]:
        return self._h.results

    def done(self) -> bool:
        return self._h.done()

    def result(self, timeout: float | None = None) -> npt.NDArray[np.int64]:
        import time
        deadline = None if timeout is None else time.monotonic() + timeout
        pause = 20e-6
        while not self._h.done():
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError("stream-ordered pieces not complete within the timeout")
            time.sleep(pause)
            pause = min(pause * 2, 2e-3)
        _first_error(self._h.results, self._h.path, self._write, self._fo, self._ln)
        return self._h.results

    def bytes_by_path(self) -> dict[str, int]:
        return empty_paths()


def _many_stream(buf: Any, file: _File, offsets: npt.ArrayLike, nbytes: npt.ArrayLike,
                 buf_offsets: npt.ArrayLike | None, stream: Any, write: bool) -> StreamBatch:
    view = _many_view(file, buf, write)
    fo, bo, ln = _many_arrays(nbytes, offsets, buf_offsets)
    ctx = _ctx_for(file, view)
    h = ctx.many_stream(file._c_file, view.ptr, view.nbytes, fo, bo, ln, write,
                        _stream_handle(stream, view), keep=(view.keep, file), path=file.path)
    _keep(h)
    return StreamBatch(h, write, fo, ln)


def read_many_async(buf: DeviceBuffer, file: _File, offsets: npt.ArrayLike,
                    nbytes: npt.ArrayLike, buf_offsets: npt.ArrayLike | None = None,
                    stream: Any = None) -> StreamBatch:
    """:func:`pread_many` queued on ``stream`` (default as :func:`read_async`):
    the pieces run, in order, when the stream gets there, and kernels queued
    after them see the data.  The arrays are copied at the call."""
    return _many_stream(buf, file, offsets, nbytes, buf_offsets, stream, False)


def write_many_async(buf: DeviceBuffer, file: _File, offsets: npt.ArrayLike,
                     nbytes: npt.ArrayLike, buf_offsets: npt.ArrayLike | None = None,
                     stream: Any = None) -> StreamBatch:
    """:func:`pwrite_many` queued on ``stream``: it sends what the kernels
    queued before it produced."""
    return _many_stream(buf, file, offsets, nbytes, buf_offsets, stream, True)


# ---------------------------------------------------------------------------
# Stream-ordered (cuFile-style)
# ---------------------------------------------------------------------------

def read_async(buf: DeviceBuffer, file: _File, offset: int = 0, stream: Any = None) -> StreamOp:
    """Queue a read of ``buf``'s size at ``offset`` on ``stream`` (default:
    torch's current stream for torch tensors, else the legacy default
    stream).  Kernels queued on the stream afterwards see the data."""
    return StreamOp(_submit(file, buf, offset, False, True, stream))


def write_async(buf: DeviceBuffer, file: _File, offset: int = 0, stream: Any = None) -> StreamOp:
    """Queue a write of ``buf`` at ``offset`` on ``stream``: it sends what the
    kernels queued before it produced; later stream work runs once the bytes
    are in the file."""
    return StreamOp(_submit(file, buf, offset, True, True, stream))


# ---------------------------------------------------------------------------
# Pinned host memory and copy streams (no staging context)
# ---------------------------------------------------------------------------

class PinnedMemory:
    """A host buffer page-locked for the copy engine of ``device`` (libphx's
    ``phx_cuda_host_register``: ``cuMemHostRegister``, portable) until
    :meth:`close`; the buffer is held meanwhile (it cannot be resized).
    Pinned memory is what makes :class:`CopyStream` copies asynchronous, and it
    can also be an io_uring fixed buffer (``Engine.register_buffer``)."""

    def __init__(self, buf: BufferLike, device: int = 0) -> None:
        _require()
        self.device = int(device)
        self._reg = _cuda.HostRegistration(buf, self.device)

    @property
    def address(self) -> int:
        return self._reg.address

    @property
    def nbytes(self) -> int:
        return self._reg.nbytes

    @property
    def pinned(self) -> bool:
        return self._reg.pinned

    def close(self) -> None:
        """Unpin (idempotent)."""
        self._reg.close()

    def __enter__(self) -> "PinnedMemory":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def pin(buf: BufferLike, device: int = 0) -> PinnedMemory:
    """Page-lock the host buffer ``buf`` (any contiguous buffer-protocol object)
    for copies to and from ``device``; see :class:`PinnedMemory`."""
    return PinnedMemory(buf, device)


def _host_ptr(obj: Any, nbytes: int | None, writable: bool, keep: list[object]) -> tuple[int, int]:
    """(address, nbytes) of host memory: an int address (``nbytes`` needed), a
    contiguous CPU torch tensor or a buffer-protocol object (kept in ``keep``)."""
    if isinstance(obj, int):
        if nbytes is None:
            raise TypeError("nbytes is needed with a host address")
        return obj, int(nbytes)
    t = sys.modules.get("torch")
    if t is not None and isinstance(obj, t.Tensor):
        if obj.is_cuda or not obj.is_contiguous():
            raise BufferNotContiguousError(22, "need a contiguous CPU tensor for host memory")
        addr, n = obj.data_ptr(), obj.numel() * obj.element_size()
    else:
        try:
            addr, n = _cuda.host_buffer(obj, writable)
        except (BufferError, ValueError) as e:   # numpy: ValueError when strided
            cls = BufferReadOnlyError if writable and "writable" in str(e) else \
                BufferNotContiguousError
            raise cls(22, f"host buffer: {e}") from None
    keep.append(obj)
    if nbytes is not None:
        if nbytes > n:
            raise ValueError(f"{nbytes} bytes do not fit the host buffer ({n})")
        n = int(nbytes)
    return addr, n


class CopyStream:
    """A CUDA stream of ``device``'s primary context for copies between host
    memory and the GPU, with no staging context (no lanes, nothing pinned but
    what the caller pins): libphx's ``phx_cuda_stream``.  phx.kv's Co-DMA relays
    are one :func:`pin`-ned buffer and one of these per copy thread.

    Copies are queued in order and run asynchronously to the host when the host
    memory is pinned; :meth:`synchronize` waits for them (and lets go of the
    host objects they used).  Host memory: buffer-protocol objects, CPU torch
    tensors, or int addresses; GPU memory: CUDA tensors,
    ``__cuda_array_interface__``, DLPack, or int device addresses.  Errors are
    ``OSError`` naming the driver call.  Any thread may use it (one at a time)."""

    def __init__(self, device: int = 0) -> None:
        _require()
        self.device = int(device)
        self._s = _cuda.Stream(self.device)
        self._keep: list[object] = []

    @property
    def handle(self) -> int:
        """The CUstream as an int (for torch.cuda.ExternalStream and the like)."""
        return self._s.handle

    def _gpu(self, obj: Any, nbytes: int | None) -> tuple[int, int | None]:
        if isinstance(obj, int):
            return obj, nbytes
        v = _view(obj)
        if v.device != self.device:
            raise ValueError(f"GPU buffer on device {v.device}, stream on {self.device}")
        self._keep.append(v)
        if nbytes is not None and nbytes > v.nbytes:
            raise ValueError(f"{nbytes} bytes do not fit the GPU buffer ({v.nbytes})")
        return v.ptr, v.nbytes if nbytes is None else nbytes

    def after(self, stream: Any = None) -> None:
        """Copies queued from now on wait for the work queued on ``stream`` now
        (a CUstream int, a torch/CuPy stream; None: the legacy default
        stream).  The host does not wait."""
        self._s.after(_stream_handle(stream))

    def h2d(self, dst: int | DeviceBuffer, src: int | HostBuffer,
            nbytes: int | None = None) -> None:
        """Queue a copy of host ``src`` into GPU ``dst`` (``nbytes``: default
        the whole of ``src``)."""
        d, dn = self._gpu(dst, nbytes)
        s, n = _host_ptr(src, nbytes if nbytes is not None else
                         (None if not isinstance(src, int) else dn), False, self._keep)
        if dn is not None and n > dn:
            raise ValueError(f"{n} bytes do not fit the GPU buffer ({dn})")
        self._s.h2d(d, s, n)

    def d2h(self, dst: int | HostBuffer, src: int | DeviceBuffer,
            nbytes: int | None = None) -> None:
        """Queue a copy of GPU ``src`` into host ``dst`` (``nbytes``: default
        the whole of ``dst``)."""
        s, sn = self._gpu(src, nbytes)
        d, n = _host_ptr(dst, nbytes if nbytes is not None else
                         (None if not isinstance(dst, int) else sn), True, self._keep)
        if sn is not None and n > sn:
            raise ValueError(f"{n} bytes exceed the GPU buffer ({sn})")
        self._s.d2h(d, s, n)

    def synchronize(self) -> None:
        """Wait until every copy queued so far has run."""
        try:
            self._s.synchronize()
        finally:
            self._keep.clear()

    def close(self) -> None:
        """Wait for the queued copies and free the stream (idempotent)."""
        try:
            self._s.close()
        finally:
            self._keep.clear()

    def __enter__(self) -> "CopyStream":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# ---------------------------------------------------------------------------
# Counters
# ---------------------------------------------------------------------------

def stats(engine: Engine | None = None, device: int | None = None) -> dict[str, int]:
    """GPU counters summed over the contexts of ``engine`` (all engines if None)."""
    out: dict[str, int] = {}
    with _lock:
        items = list(_contexts.items())
    for (eid, dev), h in items:
        if engine is not None and eid != id(engine):
            continue
        if device is not None and dev != device:
            continue
        for k, v in h.ctx.stats().items():
            out[k] = out.get(k, 0) + v
    return out


def engine_stats(engine: Engine) -> dict[str, int]:
    """``gpu_``-prefixed counters for ``engine.stats()``; {} when it never did GPU I/O."""
    if _cuda is None:
        return {}
    return {f"gpu_{k}": v for k, v in stats(engine).items()}
