# cython: language_level=3, boundscheck=False, wraparound=False
"""Thin bindings of libphx: engines, files, futures, aligned buffers.

Each method converts its arguments, calls libphx with the GIL released, and
turns a negative errno into an exception.  Docstrings of the public API live
here because these classes *are* the public API; :mod:`phx` re-exports them.
"""
from cpython.buffer cimport (PyBUF_RECORDS_RO, PyBuffer_IsContiguous,
                             PyBuffer_Release, PyObject_CheckBuffer,
                             PyObject_GetBuffer, PyBuffer_FillInfo)
from libc.errno cimport EBADF, EBUSY, EINVAL
from libc.stdint cimport int64_t, uint32_t, uint64_t, uintptr_t
from cpython.exc cimport PyErr_CheckSignals
from libc.stdlib cimport calloc, free
from libc.string cimport memset, strchr
from posix.stdlib cimport posix_memalign
from posix.unistd cimport usleep

from phx._lib.libphx cimport *

cimport cython

import operator as _operator
import os as _os
import sys as _sys
import weakref as _weakref

__version__ = phx_version().decode()


# ---------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------

class ClosedFileError(OSError, ValueError):
    """An operation on a closed :class:`File` (errno EBADF)."""


class BufferNotContiguousError(OSError, ValueError):
    """A buffer whose bytes are not one contiguous run (errno EINVAL)."""


class BufferReadOnlyError(OSError, ValueError):
    """A read into memory that cannot be written (errno EINVAL)."""


cdef object _error(int rc, object path, str what=None):
    """The exception for ``-errno`` ``rc`` (picks the OSError subclass)."""
    cdef int err = -rc
    msg = _os.strerror(err)
    detail = phx_strerror_last().decode(errors="replace")
    if what:
        msg = f"{what}: {msg}"
    elif detail:
        msg = f"{msg} ({detail})"
    if path is None:
        return OSError(err, msg)
    return OSError(err, msg, path)


# ---------------------------------------------------------------------------
# Buffers
# ---------------------------------------------------------------------------

cdef class _Buf:
    """Memory of one request: pointer, size and what keeps it alive."""
    cdef Py_buffer view
    cdef bint has_view
    cdef void *ptr
    cdef size_t nbytes
    cdef object keep

    def __dealloc__(self):
        if self.has_view:
            PyBuffer_Release(&self.view)
            self.has_view = False

    cdef void release(self):
        if self.has_view:
            PyBuffer_Release(&self.view)
            self.has_view = False
        self.keep = None


cdef bint _is_torch(object obj):
    return type(obj).__module__.startswith("torch") and hasattr(obj, "data_ptr")


def is_device_buffer(obj) -> bool:
    """True for GPU memory: CUDA torch tensors, ``__cuda_array_interface__``
    objects, and DLPack objects on a CUDA device."""
    # CUDA interfaces first: some GPU arrays (CuPy) also offer the buffer protocol.
    if hasattr(obj, "__cuda_array_interface__"):
        return True
    if PyObject_CheckBuffer(obj):
        return False
    if _is_torch(obj):
        return bool(getattr(obj, "is_cuda", False))
    dev = getattr(obj, "__dlpack_device__", None)
    if dev is not None:
        try:
            return dev()[0] in (2, 3, 13)   # kDLCUDA, kDLCUDAHost, kDLCUDAManaged
        except Exception:
            return False
    return False


cdef _Buf _get_buf(object obj, bint writable, object path):
    """Pin ``obj``'s memory for one request, or raise a clear error."""
    cdef _Buf b = _Buf.__new__(_Buf)
    if PyObject_CheckBuffer(obj):
        PyObject_GetBuffer(obj, &b.view, PyBUF_RECORDS_RO)
        b.has_view = True
        if not PyBuffer_IsContiguous(&b.view, b'C'):
            b.release()
            raise BufferNotContiguousError(
                EINVAL, "buffer is not C-contiguous (copy it, e.g. numpy.ascontiguousarray)", path)
        if writable and b.view.readonly:
            b.release()
            raise BufferReadOnlyError(
                EINVAL, "cannot read into a read-only buffer", path)
        if b.view.format != NULL and strchr(b.view.format, b'O') != NULL:
            b.release()
            raise TypeError("buffer of Python objects (dtype=object): its bytes are pointers")
        b.ptr = b.view.buf
        b.nbytes = <size_t>b.view.len
        return b
    if _is_torch(obj):
        if obj.device.type != "cpu":
            raise TypeError(f"{obj.device} tensor: only CPU tensors take the host path")
        if not obj.is_contiguous():
            raise BufferNotContiguousError(
                EINVAL, "tensor is not contiguous (use .contiguous())", path)
        b.ptr = <void *><uintptr_t>obj.data_ptr()
        b.nbytes = <size_t>(obj.numel() * obj.element_size())
        b.keep = obj
        return b
    raise TypeError(f"{type(obj).__name__} is not a buffer (needs the buffer protocol, "
                    "a numpy array or a contiguous torch tensor)")


cdef class AlignedBuffer:
    """Writable host memory aligned for O_DIRECT (see :func:`empty_aligned`).

    Supports the buffer protocol: wrap it with ``memoryview``,
    ``numpy.frombuffer`` or ``torch.frombuffer``.
    """
    cdef char *ptr
    cdef Py_ssize_t size
    cdef readonly size_t alignment

    def __cinit__(self, Py_ssize_t nbytes, size_t alignment=4096):
        if nbytes < 0:
            raise ValueError("nbytes must be >= 0")
        if alignment == 0 or alignment & (alignment - 1) or alignment % sizeof(void *):
            raise ValueError("alignment must be a power of two multiple of the pointer size")
        if posix_memalign(<void **>&self.ptr, alignment, nbytes if nbytes else 1):
            raise MemoryError(f"cannot allocate {nbytes} aligned bytes")
        self.size = nbytes
        self.alignment = alignment

    def __dealloc__(self):
        free(self.ptr)

    def __len__(self):
        return self.size

    @property
    def address(self) -> int:
        """The memory's address."""
        return <uintptr_t>self.ptr

    def __getbuffer__(self, Py_buffer *view, int flags):
        PyBuffer_FillInfo(view, self, self.ptr, self.size, 0, flags)

    def __releasebuffer__(self, Py_buffer *view):
        pass

    def __repr__(self):
        return f"<phx.AlignedBuffer {self.size} bytes at 0x{<uintptr_t>self.ptr:x}, align {self.alignment}>"


def empty_aligned(Py_ssize_t nbytes, size_t alignment=4096) -> AlignedBuffer:
    """Uninitialised host memory of ``nbytes``, aligned to ``alignment``."""
    return AlignedBuffer(nbytes, alignment)


# ---------------------------------------------------------------------------
# Engine
# ---------------------------------------------------------------------------

_STATS_FIELDS = ("reads", "writes", "bytes_read", "bytes_written", "direct_bytes",
                 "bounce_bytes", "buffered_bytes", "bounce_ios", "rmw_ios",
                 "short_ios", "fixed_buf_ios", "sqes", "submits", "errors")


#: ``backend=`` names, by ``enum phx_backend_kind``.
_BACKENDS = {"auto": PHX_BACKEND_AUTO, "uring": PHX_BACKEND_URING,
             "threads": PHX_BACKEND_THREADS}


def backends() -> list:
    """Each backend an engine can run on, whether it can here, and why not:
    ``[{"name", "description", "available", "reason"}, ...]`` (``phx info``)."""
    cdef const char *name = NULL
    cdef const char *desc = NULL
    cdef int rc
    out = []
    for kind in (PHX_BACKEND_URING, PHX_BACKEND_THREADS):
        with nogil:
            rc = phx_backend_check(kind, &name, &desc)
        out.append({"name": name.decode(), "description": desc.decode(),
                    "available": rc == 0,
                    "reason": phx_strerror_last().decode(errors="replace") if rc else
                    "available"})
    return out


def stats_publish() -> None:
    """Copy every engine's and GPU context's counters into this process's live
    counters file now (libphx's thread does it every PHX_STATS_INTERVAL_MS):
    what ``phx stats`` of another process then reads.  OSError when nothing
    is published (ENOENT) or publication is off (ENOTSUP, with the reason)."""
    cdef int rc
    with nogil:
        rc = phx_stats_publish()
    if rc < 0:
        raise OSError(-rc, phx_strerror_last().decode(errors="replace"))


def stats_path():
    """This process's live counters file (``phx stats``, ``phx top``), or None
    when nothing is published yet or publication is off (``phx info`` says why)."""
    cdef char buf[4200]
    cdef int rc = phx_stats_path(buf, sizeof(buf))
    return buf[:rc].decode() if rc >= 0 else None


def stats_path_reason() -> str:
    """Why :func:`stats_path` is None (empty when it is not)."""
    cdef char buf[4200]
    cdef int rc = phx_stats_path(buf, sizeof(buf))
    return "" if rc >= 0 else phx_strerror_last().decode(errors="replace")


cdef class Engine:
    """One io_uring (or thread pool) with its bounce buffers, registered files
    and counters.

    ``backend``: ``"auto"`` (io_uring; a pool of threads calling
    preadv2/pwritev2 where io_uring is refused, as containers' seccomp
    profiles do), ``"uring"`` (fail instead) or ``"threads"``; ``None``
    takes ``PHX_ENGINE`` (default auto).  :attr:`backend` and
    :attr:`backend_reason` say which runs and why.

    Thread-safe, unless ``single_thread=True``: then only the thread that
    created it may use it (other threads get ``PermissionError``), and in
    return its ring is set up single-issuer with deferred task running and
    a registered ring fd (Linux >= 6.1; see :attr:`features`), which costs
    less per request.  Arguments left as ``None`` take the ``PHX_*``
    environment settings or the built-in defaults (see ``docs/design.md``).
    """
    cdef phx_engine *eng
    cdef dict _registered
    cdef object _files
    cdef object __weakref__

    def __cinit__(self, queue_depth=None, max_io_size=None, bounce_size=None,
                  bounce_count=None, *, submit_batch=None, bint fixed_files=True,
                  bint fixed_buffers=True, bint single_thread=False, backend=None,
                  io_threads=None):
        cdef phx_engine_config cfg
        cdef int rc
        phx_engine_config_init(&cfg)
        for name, v in (("queue_depth", queue_depth), ("max_io_size", max_io_size),
                        ("bounce_size", bounce_size), ("bounce_count", bounce_count),
                        ("submit_batch", submit_batch), ("io_threads", io_threads)):
            if v is not None and not hasattr(type(v), "__index__"):
                # settings are counts, like offsets: 1.5 or "8" is a mistake
                raise TypeError(f"{name} must be an integer, not {type(v).__name__} {v!r}")
            if v is not None and name not in ("submit_batch", "io_threads") and \
                    not (0 < v < 2**32):
                raise ValueError(f"{name} must be a positive integer, not {v!r}")
        if queue_depth is not None:
            cfg.queue_depth = queue_depth
        if max_io_size is not None:
            cfg.max_io_size = max_io_size
        if bounce_size is not None:
            cfg.bounce_size = bounce_size
        if bounce_count is not None:
            cfg.bounce_count = bounce_count
        if submit_batch is not None:
            if not (0 <= submit_batch < 2**32):
                raise ValueError(f"submit_batch must be >= 0, not {submit_batch!r}")
            cfg.submit_batch = submit_batch
        if io_threads is not None:
            if not (0 <= io_threads < 2**32):
                raise ValueError(f"io_threads must be >= 0, not {io_threads!r}")
            cfg.io_threads = io_threads
        if backend is not None:
            if backend not in _BACKENDS:
                raise ValueError(f"backend must be one of {', '.join(_BACKENDS)}, "
                                 f"not {backend!r}")
            cfg.backend = _BACKENDS[backend]
        if not fixed_files:
            cfg.flags |= PHX_ENGINE_NO_FIXED_FILES
        if not fixed_buffers:
            cfg.flags |= PHX_ENGINE_NO_FIXED_BUFS
        if single_thread:
            cfg.flags |= PHX_ENGINE_SINGLE_THREAD
        with nogil:
            rc = phx_engine_create(&cfg, &self.eng)
        if rc < 0:
            if rc == -EINVAL:
                raise ValueError(phx_strerror_last().decode())
            raise _error(rc, None)
        self._registered = {}
        self._files = _weakref.WeakSet()

    def __dealloc__(self):
        if self.eng != NULL:
            with nogil:
                phx_engine_destroy(self.eng)
            self.eng = NULL

    cdef phx_engine *_get(self) except NULL:
        if self.eng == NULL:
            raise ValueError("engine is closed")
        return self.eng

    def close(self) -> None:
        """Wait for everything in flight, close the engine's files, free it."""
        cdef phx_engine *e = self.eng
        cdef int rc = 0
        if e == NULL:
            return
        for f in list(self._files):
            f.close()
        self.eng = NULL
        with nogil:
            rc = phx_engine_destroy(e)
        self._registered.clear()
        if rc < 0:
            raise _error(rc, None)

    @property
    def _c_engine(self) -> int:
        """Address of the ``phx_engine`` (for other Cython modules)."""
        return <uintptr_t>self._get()

    @property
    def config(self) -> dict:
        """The configuration in force."""
        cdef phx_engine_config cfg
        phx_engine_config_get(self._get(), &cfg)
        return {"queue_depth": cfg.queue_depth, "max_io_size": cfg.max_io_size,
                "bounce_size": cfg.bounce_size, "bounce_count": cfg.bounce_count,
                "max_files": cfg.max_files, "submit_batch": cfg.submit_batch,
                "io_threads": cfg.io_threads}

    @property
    def features(self) -> dict:
        """Kernel features the engine uses: fixed files/buffers, and how its ring
        was set up (``single_issuer``, ``defer_taskrun`` and ``registered_ring``
        only for ``single_thread=True`` engines)."""
        cdef uint32_t f = phx_engine_features(self._get())
        return {"fixed_files": bool(f & PHX_FEAT_FIXED_FILES),
                "fixed_bounce_buffers": bool(f & PHX_FEAT_FIXED_BUFS),
                "buffer_registration": bool(f & PHX_FEAT_USER_BUFS),
                "submit_all": bool(f & PHX_FEAT_SUBMIT_ALL),
                "single_issuer": bool(f & PHX_FEAT_SINGLE_ISSUER),
                "defer_taskrun": bool(f & PHX_FEAT_DEFER_TASKRUN),
                "registered_ring": bool(f & PHX_FEAT_REG_RING)}

    @property
    def backend(self) -> str:
        """What the engine runs on: ``"uring"`` or ``"threads"``."""
        return phx_engine_backend(self._get()).decode()

    @property
    def backend_reason(self) -> str:
        """Why: ``"io_uring_setup succeeded"``, ``"asked for ..."``, or why
        io_uring could not be had."""
        return phx_engine_backend_reason(self._get()).decode(errors="replace")

    def stats(self) -> dict:
        """Counters: requests, bytes, and bytes by path (direct / bounce / page
        cache); ``backend`` and ``backend_reason`` say what moved them."""
        cdef phx_stats st
        phx_engine_stats(self._get(), &st)
        vals = (st.reads, st.writes, st.bytes_read, st.bytes_written, st.direct_bytes,
                st.bounce_bytes, st.buffered_bytes, st.bounce_ios, st.rmw_ios,
                st.short_ios, st.fixed_buf_ios, st.sqes, st.submits, st.errors)
        out = dict(zip(_STATS_FIELDS, vals))
        out["backend"] = self.backend
        out["backend_reason"] = self.backend_reason
        gpu = _sys.modules.get("phx.gpu")     # only if GPU I/O was ever used
        if gpu is not None:
            out.update(gpu.engine_stats(self))
        return out

    def reset_stats(self) -> None:
        """Zero the counters."""
        phx_engine_stats_reset(self._get())

    @property
    def eventfd(self) -> int:
        """An eventfd readable when requests may have completed (then call :meth:`poll`)."""
        cdef int fd = phx_engine_eventfd(self._get())
        if fd < 0:
            raise _error(fd, None)
        return fd

    def poll(self) -> None:
        """Reap completions and keep queued work moving, without blocking."""
        cdef phx_engine *e = self._get()
        with nogil:
            phx_poll(e, NULL, 0)

    def register_buffer(self, buf) -> None:
        """Register host memory as an io_uring fixed buffer (kept alive until unregistered)."""
        cdef _Buf b = _get_buf(buf, False, None)
        cdef phx_engine *e = self._get()
        cdef int rc
        with nogil:
            rc = phx_buf_register(e, b.ptr, b.nbytes)
        if rc < 0:
            b.release()
            raise _error(rc, None)
        self._registered[<uintptr_t>b.ptr] = b

    def unregister_buffer(self, buf) -> None:
        """Undo :meth:`register_buffer`."""
        cdef _Buf b = _get_buf(buf, False, None)
        cdef uintptr_t addr = <uintptr_t>b.ptr
        cdef phx_engine *e = self._get()
        cdef int rc
        b.release()
        with nogil:
            rc = phx_buf_deregister(e, <void *>addr)
        if rc < 0:
            raise _error(rc, None)
        held = self._registered.pop(addr, None)
        if held is not None:
            (<_Buf>held).release()

    def open(self, path, mode="r", *, bint direct=True, bint allow_buffered=False) -> File:
        """Open ``path`` on this engine (see :func:`phx.open`)."""
        return File(self, path, mode, direct, allow_buffered)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self):
        if self.eng == NULL:
            return "<phx.Engine closed>"
        c = self.config
        return f"<phx.Engine qd={c['queue_depth']} max_io={c['max_io_size']}>"


# ---------------------------------------------------------------------------
# Futures
# ---------------------------------------------------------------------------

@cython.no_gc_clear
cdef class Future:
    """The result of an asynchronous read or write.

    ``result()`` and ``done()`` may be called from any thread, any number of
    times; the buffer is held until the request completes.
    """
    cdef phx_io *io
    cdef File file
    cdef _Buf buf
    cdef bint finished

    def __dealloc__(self):
        if self.io != NULL:
            if (not self.io.done and self.file is not None and
                    self.file.engine is not None and self.file.engine.eng != NULL):
                # The kernel may still write into the buffer: wait, never leak it.
                with nogil:
                    phx_wait(self.file.engine.eng, self.io, -1)
            free(self.io)
            self.io = NULL

    cdef void _finish(self):
        if not self.finished:
            self.finished = True
            if self.buf is not None:
                self.buf.release()
                self.buf = None
            self.file._pending.discard(self)

    def done(self) -> bool:
        """Whether the request has completed (drives the engine without blocking)."""
        cdef phx_engine *e
        if self.finished:
            return True
        e = self.file.engine.eng
        if not self.io.done:
            with nogil:
                phx_poll(e, NULL, 0)
        if self.io.done:
            self._finish()
            return True
        return False

    def result(self, timeout=None) -> int:
        """Bytes moved; waits up to ``timeout`` seconds (None: forever).

        Raises :class:`TimeoutError` on timeout and :class:`OSError` if the
        request failed.
        """
        cdef int64_t left = -1 if timeout is None else <int64_t>(timeout * 1e9)
        cdef int64_t step
        cdef int rc = 0
        cdef phx_engine *e = self.file.engine.eng
        # Wait in slices so that Ctrl-C (and other signals) get through.
        while not self.io.done:
            step = 100000000 if left < 0 or left > 100000000 else left
            with nogil:
                rc = phx_wait(e, self.io, step)
            if self.io.done:
                break
            PyErr_CheckSignals()
            if left >= 0:
                left -= step
                if left <= 0:
                    raise TimeoutError(f"request on {self.file.path} not complete after {timeout} s")
        self._finish()
        if self.io.result < 0:
            raise _error(<int>self.io.result, self.file.path,
                         "read" if self.io.op == PHX_OP_READ else "write")
        return self.io.result

    def exception(self, timeout=None):
        """The request's exception, or None (TimeoutError when not done in time)."""
        try:
            self.result(timeout)
        except TimeoutError:
            raise
        except Exception as e:
            return e
        return None

    @property
    def paths(self) -> set:
        """Which paths moved the bytes ('direct', 'bounce', 'buffered'); empty
        until done.  Deprecated: :meth:`bytes_by_path` has the byte counts, with
        the names every phx future uses."""
        return _paths(self.io.paths) if self.io.done else set()

    def bytes_by_path(self) -> dict:
        """Bytes moved by path once done: ``{"direct", "bounce", "page_cache"}``
        (:data:`phx.futures.PATHS`); zeros before."""
        cdef phx_io_bytes b
        phx_io_bytes_by_path(self.io, &b)
        return {"direct": b.direct, "bounce": b.bounce, "page_cache": b.buffered}

    def add_done_callback(self, fn) -> None:
        """Call ``fn(self)`` once done (now, if it already is); see :mod:`phx.futures`."""
        from phx import futures
        futures.add_done_callback(self, fn)

    def _wake_fd(self):
        """The engine's eventfd: the completion thread sleeps on it."""
        return self.file.engine.eventfd

    def __await__(self):
        from phx import futures
        return futures.wait_async(self).__await__()

    def __repr__(self):
        state = f"done result={self.io.result}" if self.io.done else "pending"
        return f"<phx.Future {state}>"


cdef set _paths(uint32_t p):
    s = set()
    if p & PHX_PATH_DIRECT:
        s.add("direct")
    if p & PHX_PATH_BOUNCE:
        s.add("bounce")
    if p & PHX_PATH_BUFFERED:
        s.add("buffered")
    return s


# ---------------------------------------------------------------------------
# Files
# ---------------------------------------------------------------------------

_MODES = {
    "r": _os.O_RDONLY,
    "r+": _os.O_RDWR,
    "w": _os.O_WRONLY | _os.O_CREAT | _os.O_TRUNC,
    "w+": _os.O_RDWR | _os.O_CREAT | _os.O_TRUNC,
    "x": _os.O_WRONLY | _os.O_CREAT | _os.O_EXCL,
    "x+": _os.O_RDWR | _os.O_CREAT | _os.O_EXCL,
}


@cython.no_gc_clear
cdef class File:
    """A file opened on an :class:`Engine`; see :func:`phx.open`."""
    cdef phx_file *f
    cdef readonly Engine engine
    cdef readonly object path
    cdef readonly str mode
    cdef readonly bint direct
    cdef readonly bint readable
    cdef readonly bint writable
    cdef readonly uint32_t mem_align
    cdef readonly uint32_t offset_align
    cdef readonly bint align_from_statx
    cdef set _pending
    cdef object _gpu
    cdef int _users          # calls inside libphx right now (GIL released)
    cdef bint _closing
    cdef object __weakref__

    def __cinit__(self, Engine engine, path, mode="r", bint direct=True,
                  bint allow_buffered=False):
        cdef phx_file_info info
        cdef int rc, flags
        cdef uint32_t pflags = 0
        cdef bytes bpath
        if not isinstance(mode, str):
            raise TypeError(f"mode must be a str, not {type(mode).__name__}")
        m = mode.replace("b", "")
        if m not in _MODES:
            raise ValueError(f"mode {mode!r} not supported: use one of "
                             f"{', '.join(sorted(_MODES))} (no append: offsets are explicit)")
        flags = _MODES[m]
        self.engine = engine
        self.path = _os.fspath(path)
        self.mode = mode
        self._pending = set()
        bpath = _os.fsencode(self.path)
        if not direct:
            pflags |= PHX_FILE_BUFFERED
        if allow_buffered:
            pflags |= PHX_FILE_ALLOW_BUFFERED
        cdef phx_engine *e = engine._get()
        cdef const char *cpath = bpath
        with nogil:
            rc = phx_file_open(e, cpath, flags, 0o644, pflags, &self.f)
        if rc < 0:
            if rc == -EINVAL and "unknown" in phx_strerror_last().decode():
                raise ValueError(phx_strerror_last().decode())
            raise _error(rc, self.path)
        engine._files.add(self)
        phx_file_get_info(self.f, &info)
        self.direct = info.direct
        self.mem_align = info.mem_align
        self.offset_align = info.offset_align
        self.align_from_statx = info.align_from_statx
        self.readable = (flags & 3) != _os.O_WRONLY
        self.writable = (flags & 3) != _os.O_RDONLY

    def __dealloc__(self):
        if self.f != NULL:
            phx_file_close(self.f)
            self.f = NULL

    cdef phx_file *_get(self) except NULL:
        if self.f == NULL or self._closing:
            raise ClosedFileError(EBADF, "I/O operation on a closed file", self.path)
        return self.f

    @property
    def closed(self) -> bool:
        return self.f == NULL or self._closing

    @property
    def _c_file(self) -> int:
        """Address of the ``phx_file`` (for other Cython modules)."""
        return <uintptr_t>self._get()

    @property
    def alignment(self) -> tuple:
        """(memory alignment, offset/length alignment) that O_DIRECT needs here."""
        return (self.mem_align, self.offset_align)

    def fileno(self) -> int:
        """The file descriptor."""
        cdef phx_file_info info
        phx_file_get_info(self._get(), &info)
        return info.fd

    @property
    def size(self) -> int:
        """Current file size in bytes."""
        return _os.fstat(self.fileno()).st_size

    def truncate(self, size) -> None:
        """Set the file's size."""
        _os.ftruncate(self.fileno(), _operator.index(size))

    def fsync(self) -> None:
        """Flush the file's data and metadata to the device."""
        _os.fsync(self.fileno())

    cdef object _device(self):
        if self._gpu is None:
            from phx import gpu
            self._gpu = gpu
        return self._gpu

    cdef object _check(self, bint write, offset):
        """Validate a call; returns the offset as an int (TypeError for floats)."""
        self._get()
        offset = _operator.index(offset)
        if offset < 0:
            raise OSError(EINVAL, "negative offset", self.path)
        if write and not self.writable:
            raise OSError(EBADF, "file not open for writing", self.path)
        if not write and not self.readable:
            raise OSError(EBADF, "file not open for reading", self.path)
        return offset

    cdef int64_t _sync(self, bint write, buf, uint64_t offset) except? -1:
        cdef _Buf b = _get_buf(buf, not write, self.path)
        cdef int64_t r
        cdef phx_file *f = self._get()
        self._users += 1
        try:
            with nogil:
                if write:
                    r = phx_pwrite(f, b.ptr, b.nbytes, offset)
                else:
                    r = phx_pread(f, b.ptr, b.nbytes, offset)
        finally:
            self._users -= 1
        b.release()
        if r < 0:
            raise _error(<int>r, self.path)
        return r

    def pread(self, buf, offset=0) -> int:
        """Read ``len(buf)`` bytes at ``offset`` into ``buf``; fewer at end of file.

        ``buf``: anything with the writable buffer protocol, a numpy array, a
        contiguous torch tensor (CPU, or CUDA through :mod:`phx.gpu`).
        """
        offset = self._check(False, offset)
        if is_device_buffer(buf):
            return self._device().pread(buf, self, offset)
        return self._sync(False, buf, offset)

    def pwrite(self, buf, offset=0) -> int:
        """Write all of ``buf`` at ``offset``; returns the bytes written."""
        offset = self._check(True, offset)
        if is_device_buffer(buf):
            return self._device().pwrite(buf, self, offset)
        return self._sync(True, buf, offset)

    cdef Future _submit(self, bint write, buf, uint64_t offset):
        cdef Future fut = Future.__new__(Future)
        cdef phx_io *io
        cdef phx_engine *e = self.engine._get()
        cdef int rc
        fut.file = self
        fut.buf = _get_buf(buf, not write, self.path)
        fut.io = <phx_io *>calloc(1, sizeof(phx_io))
        if fut.io == NULL:
            raise MemoryError()
        io = fut.io
        phx_io_prep(io, self._get(), PHX_OP_WRITE if write else PHX_OP_READ,
                    fut.buf.ptr, fut.buf.nbytes, offset)
        io.flags = PHX_IO_NO_POLL
        self._users += 1
        try:
            with nogil:
                rc = phx_submit(e, &io, 1)
        finally:
            self._users -= 1
        if rc < 0:
            fut.buf.release()
            free(fut.io)
            fut.io = NULL
            raise _error(rc, self.path)
        self._pending.add(fut)
        return fut

    def pread_async(self, buf, offset=0):
        """Start a read; returns a :class:`Future` whose ``result()`` is the byte count."""
        offset = self._check(False, offset)
        if is_device_buffer(buf):
            return self._device().pread_async(buf, self, offset)
        return self._submit(False, buf, offset)

    def pwrite_async(self, buf, offset=0):
        """Start a write; returns a :class:`Future`."""
        offset = self._check(True, offset)
        if is_device_buffer(buf):
            return self._device().pwrite_async(buf, self, offset)
        return self._submit(True, buf, offset)

    cdef list _batch(self, bint write, reqs):
        cdef list items = list(reqs)
        cdef Py_ssize_t n = len(items), i
        cdef phx_io *ios
        cdef list bufs = []
        cdef _Buf b
        cdef int rc
        cdef phx_engine *e = self.engine._get()
        self._get()
        if n == 0:
            return []
        ios = <phx_io *>calloc(n, sizeof(phx_io))
        if ios == NULL:
            raise MemoryError()
        self._users += 1
        try:
            for i in range(n):
                buf, off = items[i]
                off = self._check(write, off)
                b = _get_buf(buf, not write, self.path)
                bufs.append(b)
                phx_io_prep(&ios[i], self.f, PHX_OP_WRITE if write else PHX_OP_READ,
                            b.ptr, b.nbytes, <uint64_t>off)
            with nogil:
                rc = phx_submit_wait(e, ios, n)
            if rc < 0:
                raise _error(rc, self.path)
            out = [ios[i].result for i in range(n)]
        finally:
            self._users -= 1
            for b in bufs:
                b.release()
            free(ios)
        for i in range(n):
            if out[i] < 0:
                raise _error(<int>out[i], self.path,
                             f"batch request {i} ({'write' if write else 'read'} at {items[i][1]})")
        return out

    cdef object _many(self, bint write, buf, offsets, nbytes, buf_offsets):
        import numpy as np
        cdef _Buf b
        cdef const int64_t[::1] offs
        cdef const int64_t[::1] lens
        cdef const int64_t[::1] boffs
        cdef int64_t[::1] res
        cdef Py_ssize_t n, i, bad = -1
        cdef phx_io *ios
        cdef int rc = 0
        cdef int64_t ln, bo, packed = 0
        cdef phx_file *f = self._get()
        cdef phx_engine *e = self.engine._get()
        self._check(write, 0)
        if is_device_buffer(buf):
            # GPU memory: phx.gpu's array call (phx_cuda_many), same arguments
            if write:
                return self._device().pwrite_many(buf, self, offsets, nbytes, buf_offsets)
            return self._device().pread_many(buf, self, offsets, nbytes, buf_offsets)
        offs = np.ascontiguousarray(offsets, dtype=np.int64).reshape(-1)
        n = offs.shape[0]
        if np.ndim(nbytes) == 0:
            lens = np.full(n, _operator.index(nbytes), dtype=np.int64)
        else:
            lens = np.ascontiguousarray(nbytes, dtype=np.int64).reshape(-1)
        if lens.shape[0] != n:
            raise ValueError(f"{n} offsets but {lens.shape[0]} sizes")
        if buf_offsets is None:
            boffs = np.concatenate(([0], np.cumsum(lens[:n - 1] if n else lens))).astype(np.int64)
        else:
            boffs = np.ascontiguousarray(buf_offsets, dtype=np.int64).reshape(-1)
            if boffs.shape[0] != n:
                raise ValueError(f"{n} offsets but {boffs.shape[0]} buffer offsets")
        out = np.zeros(n, dtype=np.int64)
        if n == 0:
            return out
        res = out
        b = _get_buf(buf, not write, self.path)
        ios = <phx_io *>calloc(n, sizeof(phx_io))
        if ios == NULL:
            b.release()
            raise MemoryError()
        self._users += 1
        try:
            for i in range(n):
                ln = lens[i]
                bo = boffs[i]
                if offs[i] < 0 or ln < 0 or bo < 0 or bo + ln > <int64_t>b.nbytes:
                    raise ValueError(
                        f"piece {i}: {ln} bytes at file offset {offs[i]} into buffer offset "
                        f"{bo} does not fit a {b.nbytes}-byte buffer (or is negative)")
                phx_io_prep(&ios[i], f, PHX_OP_WRITE if write else PHX_OP_READ,
                            <char *>b.ptr + bo, <size_t>ln, <uint64_t>offs[i])
            with nogil:
                rc = phx_submit_wait(e, ios, n)
                if rc == 0:
                    for i in range(n):
                        res[i] = ios[i].result
                        if ios[i].result < 0 and bad < 0:
                            bad = i
            if rc < 0:
                raise _error(rc, self.path)
        finally:
            self._users -= 1
            b.release()
            free(ios)
        if bad >= 0:
            raise _error(<int>res[bad], self.path,
                         f"piece {bad} ({'write' if write else 'read'} of {lens[bad]} bytes "
                         f"at {offs[bad]})")
        return out

    def pread_many(self, buf, offsets, nbytes, buf_offsets=None):
        """Read many pieces of the file into one buffer, in one submission.

        Piece ``i`` is ``nbytes[i]`` bytes (or ``nbytes`` for all) at file
        offset ``offsets[i]``, landing at ``buf_offsets[i]`` of ``buf`` (by
        default the pieces are packed back to back).  The arguments are
        integer arrays (numpy or sequences); no Python object is made per
        piece, so thousands of KV chunks cost what their I/O costs.  Returns a
        numpy int64 array of byte counts (short at end of file); raises the
        first failure's OSError after all have finished, like
        :meth:`pread_batch`.  A GPU buffer goes to :func:`phx.gpu.pread_many`
        (pinned staging; pieces checked at once, ValueError when bad).
        """
        return self._many(False, buf, offsets, nbytes, buf_offsets)

    def pwrite_many(self, buf, offsets, nbytes, buf_offsets=None):
        """Write many pieces of one host buffer to the file, in one submission
        (the arguments as for :meth:`pread_many`)."""
        return self._many(True, buf, offsets, nbytes, buf_offsets)

    def pread_batch(self, reqs) -> list:
        """Read a list of ``(buffer, offset)`` pairs in one submission.

        All requests are in flight together (up to the engine's queue depth);
        returns the byte count of each.  Raises the first failure's OSError
        after all have finished.  GPU buffers go through :mod:`phx.gpu`.
        """
        reqs = list(reqs)
        if reqs and is_device_buffer(reqs[0][0]):
            return self._device().pread_batch(reqs, self)
        return self._batch(False, reqs)

    def pwrite_batch(self, reqs) -> list:
        """Write a list of ``(buffer, offset)`` pairs in one submission."""
        reqs = list(reqs)
        if reqs and is_device_buffer(reqs[0][0]):
            return self._device().pwrite_batch(reqs, self)
        return self._batch(True, reqs)

    def close(self) -> None:
        """Wait for this file's outstanding requests, then close it."""
        cdef int rc
        if self.f == NULL or self._closing:
            return
        # New calls now fail; calls already inside libphx finish first.
        self._closing = True
        try:
            while self._users or self._pending:
                for fut in list(self._pending):
                    try:
                        fut.result()
                    except OSError:
                        pass
                if self._users:
                    with nogil:
                        usleep(200)
            rc = phx_file_close(self.f)
            if rc < 0:
                raise _error(rc, self.path)
            self.f = NULL
        finally:
            if self.f != NULL:
                self._closing = False

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self):
        state = "closed" if self.f == NULL else ("direct" if self.direct else "buffered")
        return f"<phx.File {self.path!r} mode={self.mode!r} {state}>"
