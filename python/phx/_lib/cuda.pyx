# cython: language_level=3
"""Thin wrapper of libphx/include/phx_cuda.h (GPU memory through pinned staging).

Everything here takes raw addresses (``phx_file *``, ``phx_engine *``,
CUdeviceptr, CUstream) as ints; :mod:`phx.gpu` holds the Pythonic layer.
"""
cimport cython
from cpython.buffer cimport PyBUF_SIMPLE, PyBUF_WRITABLE, PyBuffer_Release, PyObject_GetBuffer
from cpython.pycapsule cimport PyCapsule_GetPointer, PyCapsule_IsValid
from libc.errno cimport EINVAL, EIO
from libc.stdint cimport int32_t, int64_t, uint32_t, uint64_t, uintptr_t
from libc.stdlib cimport calloc, free
from libc.string cimport memset

import errno as _errno
import os as _os

# cuMemcpyDtoHAsync_v2 (cuda.h): the driver's, by address (stream_loop)
ctypedef int (*d2h_fn)(void *dst, uint64_t src, size_t n, void *stream) noexcept nogil

# PHX_OP_READ / PHX_OP_WRITE (phx.h)
cdef enum:
    OP_READ = 0
    OP_WRITE = 1


cdef object _err(int rc, object path=None, str what=None):
    """``-errno`` -> OSError (its subclass by errno) with libphx's text."""
    cdef int e = -rc
    text = phx_cuda_strerror_last().decode("utf-8", "replace")
    msg = _os.strerror(e)
    if what:
        msg = f"{what}: {msg}"
    if text and text != "no error":
        msg = f"{msg} ({text})"
    if path is not None:
        return OSError(e, msg, path)
    return OSError(e, msg)


def available():
    """(True, description) when CUDA can be used, else (False, reason)."""
    cdef char why[256]
    cdef int ok
    with nogil:
        ok = phx_cuda_available(why, sizeof(why))
    return bool(ok), why.decode("utf-8", "replace")


def pointer_device(uint64_t ptr) -> int:
    """CUDA device ordinal owning ``ptr``; OSError(EINVAL) for non-device memory."""
    cdef int rc
    with nogil:
        rc = phx_cuda_ptr_device(ptr)
    if rc < 0:
        raise _err(rc)
    return rc


def device_numa_node(int device) -> int:
    """NUMA node of CUDA ``device`` as sysfs reports it (-1: unknown);
    OSError(ENODEV) when there is no such device."""
    cdef int node = -1
    cdef int rc
    with nogil:
        rc = phx_cuda_device_numa_node(device, &node)
    if rc < 0:
        raise _err(rc)
    return node


def default_config() -> dict:
    """The configuration a new context gets (defaults + PHX_CUDA_* variables)."""
    cdef phx_cuda_config cfg
    phx_cuda_config_init(&cfg)
    return _cfg_dict(&cfg)


cdef dict _cfg_dict(phx_cuda_config *cfg):
    return {
        "device": cfg.device,
        "lanes": cfg.lanes,
        "bufs_per_lane": cfg.bufs_per_lane,
        "buf_size": cfg.buf_size,
        "max_io_size": cfg.max_io_size,
        "memops": not (cfg.flags & PHX_CUDA_NO_MEMOPS),
        "batch_copy": not (cfg.flags & PHX_CUDA_NO_BATCH_COPY),
        "fixed_bufs": not (cfg.flags & PHX_CUDA_NO_FIXED_BUFS),
        "early_reads": bool(cfg.flags & PHX_CUDA_EARLY_READS),
    }


MAX_PINNED = PHX_CUDA_MAX_PINNED


# DLPack (dlpack.h v0.8, the unversioned capsule "dltensor")
cdef struct DLDevice:
    int device_type
    int32_t device_id

cdef struct DLDataType:
    unsigned char code
    unsigned char bits
    unsigned short lanes

cdef struct DLTensor:
    void *data
    DLDevice device
    int32_t ndim
    DLDataType dtype
    int64_t *shape
    int64_t *strides
    uint64_t byte_offset

cdef struct DLManagedTensor:
    DLTensor dl_tensor
    void *manager_ctx
    void *deleter


def dlpack_view(capsule):
    """(address, nbytes, device_type, device_id, contiguous) of an unconsumed
    DLPack capsule.  The capsule must stay alive while the memory is used."""
    cdef DLManagedTensor *m
    cdef DLTensor *t
    cdef int64_t n = 1, expect, i
    cdef bint contig = True
    if not PyCapsule_IsValid(capsule, b"dltensor"):
        raise TypeError("not an unconsumed DLPack capsule")
    m = <DLManagedTensor *>PyCapsule_GetPointer(capsule, b"dltensor")
    t = &m.dl_tensor
    for i in range(t.ndim):
        n *= t.shape[i]
    itemsize = (t.dtype.bits * t.dtype.lanes + 7) // 8
    if t.strides != NULL and n > 0:
        expect = 1
        for i in range(t.ndim - 1, -1, -1):
            if t.shape[i] != 1 and t.strides[i] != expect:
                contig = False
            expect *= t.shape[i]
    return (<uintptr_t>t.data + t.byte_offset, n * itemsize, t.device.device_type,
            t.device.device_id, contig)


cdef class IO:
    """One GPU request (struct phx_cuda_io) and what it keeps alive."""
    cdef phx_cuda_io *io
    cdef Context ctx
    cdef object keep
    cdef readonly object path

    def __dealloc__(self):
        if self.io != NULL:
            if not self.io.done and self.ctx is not None and self.ctx.cu != NULL:
                with nogil:
                    phx_cuda_wait(self.ctx.cu, self.io, -1)
            free(self.io)
            self.io = NULL

    def done(self) -> bool:
        """True once libphx no longer touches the request (result final)."""
        return bool(__atomic_done(self.io))

    def wait(self, timeout=None) -> int:
        """Wait for completion; return the raw result (bytes or -errno)."""
        cdef int64_t t = -1 if timeout is None else <int64_t>(timeout * 1e9)
        cdef int rc
        if not __atomic_done(self.io):
            with nogil:
                rc = phx_cuda_wait(self.ctx.cu, self.io, t)
            if rc < 0:
                raise TimeoutError("GPU request not complete within the timeout")
        self.keep = None
        return self.io.result

    @property
    def raw_result(self) -> int:
        """Bytes moved or -errno; valid once done (or the stream passed it)."""
        return self.io.result

    @property
    def by_path(self) -> dict:
        return {"direct": self.io.direct_bytes, "bounce": self.io.bounce_bytes,
                "page_cache": self.io.buffered_bytes, "paths": self.io.paths}

    def eventfd(self) -> int:
        """The context's completion eventfd (phx_cuda_eventfd)."""
        return _ctx_eventfd(self.ctx)

    def check(self, int64_t res):
        """``res`` as a byte count, or raise its OSError."""
        if res < 0:
            raise _err(<int>res, self.path)
        return res


cdef inline bint __atomic_done(phx_cuda_io *io) nogil:
    return (<volatile uint32_t *>&io.done)[0] != 0


cdef class Batch:
    """Many GPU requests submitted with one call (an array of phx_cuda_io)."""
    cdef phx_cuda_io *ios
    cdef size_t n
    cdef Context ctx
    cdef object keep
    cdef readonly object path

    def __dealloc__(self):
        cdef size_t i
        if self.ios != NULL:
            if self.ctx is not None and self.ctx.cu != NULL:
                with nogil:
                    for i in range(self.n):
                        if not __atomic_done(&self.ios[i]):
                            phx_cuda_wait(self.ctx.cu, &self.ios[i], -1)
            free(self.ios)
            self.ios = NULL

    def __len__(self):
        return self.n

    def done(self) -> bool:
        cdef size_t i
        for i in range(self.n):
            if not __atomic_done(&self.ios[i]):
                return False
        return True

    def wait(self, timeout=None) -> list:
        """Wait for all; return the raw results (bytes or -errno), in order."""
        cdef int64_t t = -1 if timeout is None else <int64_t>(timeout * 1e9)
        cdef size_t i
        cdef int rc = 0
        with nogil:
            for i in range(self.n):
                if not __atomic_done(&self.ios[i]):
                    rc = phx_cuda_wait(self.ctx.cu, &self.ios[i], t)
                    if rc < 0:
                        break
        if rc < 0:
            raise TimeoutError("GPU batch not complete within the timeout")
        self.keep = None
        return [self.ios[i].result for i in range(self.n)]

    @property
    def by_path(self) -> dict:
        """Bytes moved by path, summed over the requests."""
        cdef size_t i
        cdef uint64_t d = 0, b = 0, c = 0
        for i in range(self.n):
            d += self.ios[i].direct_bytes
            b += self.ios[i].bounce_bytes
            c += self.ios[i].buffered_bytes
        return {"direct": d, "bounce": b, "page_cache": c}

    def eventfd(self) -> int:
        """The context's completion eventfd (phx_cuda_eventfd)."""
        return _ctx_eventfd(self.ctx)

    def check(self, list res) -> list:
        """``res`` as byte counts, or raise the first request's OSError."""
        for r in res:
            if r < 0:
                raise _err(<int>r, self.path)
        return res


@cython.auto_pickle(False)  # results libphx is writing: nothing to pickle
cdef class ManyStream:
    """Stream-ordered pieces of one file and one GPU buffer (phx_cuda_many_async):
    ``results`` (int64, one per piece) is -EINPROGRESS until the stream is
    past the piece, then its bytes or -errno.  The object holds the arrays
    libphx writes and the buffer until every piece is over."""
    cdef readonly object results
    cdef object pending                 # int64[1]: libphx's ->pending
    cdef object keep
    cdef readonly object path

    def done(self) -> bool:
        """True once every piece is over: its GPU copies ran (a final result
        alone comes before the copy; libphx counts ->pending down after)."""
        if self.pending is None:
            return True
        if int(self.pending[0]) != 0:
            return False
        self.keep = None
        return True


def _i64(a, str what):
    """A contiguous 1-D int64 array of ``a`` (no copy when it is one)."""
    import numpy as np
    arr = np.ascontiguousarray(a, dtype=np.int64).reshape(-1)
    return arr


cdef int _many_fill(phx_cuda_many_s *m, uintptr_t file_addr, uint64_t devptr, uint64_t dev_len,
                    fo, do, ln, res, bint write) except -1:
    """Fill ``m`` from int64 arrays of one length (checked here)."""
    cdef Py_ssize_t n = fo.shape[0]
    if do.shape[0] != n or ln.shape[0] != n:
        raise ValueError(f"{n} file offsets, {do.shape[0]} GPU offsets and {ln.shape[0]} "
                         "lengths: they must be of one length")
    memset(m, 0, sizeof(phx_cuda_many_s))
    m.size = sizeof(phx_cuda_many_s)
    m.op = OP_WRITE if write else OP_READ
    m.file = <phx_file *>file_addr
    m.devptr = devptr
    m.dev_len = dev_len
    m.n = <size_t>n
    if n:
        m.file_offsets = <const int64_t *><uintptr_t>fo.ctypes.data
        m.dev_offsets = <const int64_t *><uintptr_t>do.ctypes.data
        m.lens = <const int64_t *><uintptr_t>ln.ctypes.data
        m.results = <int64_t *><uintptr_t>res.ctypes.data
    return 0


cdef object _many_refused(int rc, object path):
    """A call phx_cuda_many_check() refused: ValueError for bad arguments."""
    text = phx_cuda_strerror_last().decode("utf-8", "replace")
    if rc == -EINVAL:
        return ValueError(text)
    return _err(rc, path)


def many_check(uintptr_t file_addr, uint64_t devptr, uint64_t dev_len, file_offsets,
               dev_offsets, lens, bint write) -> None:
    """phx_cuda_many_check(): raise ValueError naming the first bad piece."""
    import numpy as np
    cdef phx_cuda_many_s m
    cdef int rc
    fo, do, ln = _i64(file_offsets, "file"), _i64(dev_offsets, "GPU"), _i64(lens, "len")
    res = np.empty(fo.shape[0], dtype=np.int64)
    _many_fill(&m, file_addr, devptr, dev_len, fo, do, ln, res, write)
    with nogil:
        rc = phx_cuda_many_check(&m)
    if rc < 0:
        raise _many_refused(rc, None)


cdef int _ctx_eventfd(Context ctx) except -1:
    cdef int fd = phx_cuda_eventfd(ctx.cu)
    if fd < 0:
        raise _err(fd, None)
    return fd


cdef class Context:
    """A phx_cuda context: pinned staging lanes for one engine and device."""
    cdef phx_cuda *cu
    cdef object engine
    cdef readonly int device
    cdef readonly int pid

    def __cinit__(self, engine, int device=0, lanes=None, bufs_per_lane=None,
                  buf_size=None, max_io_size=None, memops=None, batch_copy=None,
                  fixed_bufs=None, early_reads=None):
        cdef phx_cuda_config cfg
        cdef phx_engine *e = NULL
        cdef int rc
        self.cu = NULL
        phx_cuda_config_init(&cfg)
        cfg.device = device
        if lanes is not None:
            cfg.lanes = lanes
        if bufs_per_lane is not None:
            cfg.bufs_per_lane = bufs_per_lane
        if buf_size is not None:
            cfg.buf_size = buf_size
        if max_io_size is not None:
            cfg.max_io_size = max_io_size
        if memops is not None:
            cfg.flags = (cfg.flags & ~PHX_CUDA_NO_MEMOPS) if memops else \
                (cfg.flags | PHX_CUDA_NO_MEMOPS)
        if batch_copy is not None:
            cfg.flags = (cfg.flags & ~PHX_CUDA_NO_BATCH_COPY) if batch_copy else \
                (cfg.flags | PHX_CUDA_NO_BATCH_COPY)
        if fixed_bufs is not None:
            cfg.flags = (cfg.flags & ~PHX_CUDA_NO_FIXED_BUFS) if fixed_bufs else \
                (cfg.flags | PHX_CUDA_NO_FIXED_BUFS)
        if early_reads is not None:     # an experiment: docs/gpu.md, "Early reads"
            cfg.flags = (cfg.flags | PHX_CUDA_EARLY_READS) if early_reads else \
                (cfg.flags & ~PHX_CUDA_EARLY_READS)
        if engine is not None:
            e = <phx_engine *><uintptr_t>engine._c_engine
        with nogil:
            rc = phx_cuda_create(e, &cfg, &self.cu)
        if rc < 0:
            self.cu = NULL
            raise _err(rc, None, "creating the GPU staging context")
        self.engine = engine
        self.device = device
        self.pid = _os.getpid()

    def __dealloc__(self):
        if self.cu != NULL and self.pid == _os.getpid():
            with nogil:
                phx_cuda_destroy(self.cu)
        self.cu = NULL

    cdef phx_cuda *_get(self) except NULL:
        if self.cu == NULL:
            raise ValueError("GPU context is closed")
        if self.pid != _os.getpid():
            raise RuntimeError("GPU context used after fork (CUDA does not survive fork)")
        return self.cu

    def close(self) -> None:
        """Wait for every request (stream-ordered ones too), stop the lanes,
        unpin the staging memory."""
        cdef phx_cuda *c = self.cu
        if c == NULL:
            return
        self.cu = NULL
        with nogil:
            phx_cuda_destroy(c)

    @property
    def config(self) -> dict:
        """The configuration in force and what the context found it can use."""
        cdef phx_cuda_config cfg
        cdef uint32_t feat
        phx_cuda_config_get(self._get(), &cfg)
        feat = phx_cuda_features(self.cu)
        d = _cfg_dict(&cfg)
        d["memops"] = bool(feat & PHX_CUDA_FEAT_MEMOPS)
        d["batch_copy"] = bool(feat & PHX_CUDA_FEAT_BATCH_COPY)
        d["fixed_bufs"] = bool(feat & PHX_CUDA_FEAT_FIXED_BUFS)
        d["dead"] = bool(feat & PHX_CUDA_FEAT_DEAD)
        d["stream_ops_why"] = phx_cuda_memops_why(self.cu).decode()
        d["pinned_bytes"] = self.stats()["pinned_bytes"]
        d["staging_node"] = phx_cuda_staging_node(self.cu)
        return d

    @property
    def staging_node(self) -> int:
        """NUMA node the staging memory is bound to (the device's, on a
        machine of several nodes), or -1 when it is not bound."""
        return phx_cuda_staging_node(self._get())

    def stats(self) -> dict:
        """Every counter of phx_cuda_stats (the stream ops' time split too)."""
        cdef phx_cuda_stats_s st
        phx_cuda_stats_get(self._get(), &st, sizeof(st))
        cdef dict d = st
        return d

    def reset_stats(self) -> None:
        phx_cuda_stats_reset(self._get())

    def register_file(self, uintptr_t file_addr, path=None) -> None:
        """Adopt the file on every lane now and hold it until deregistered."""
        cdef int rc = phx_cuda_file_register(self._get(), <phx_file *>file_addr)
        if rc < 0:
            raise _err(rc, path)

    def deregister_file(self, uintptr_t file_addr, path=None) -> None:
        cdef int rc = phx_cuda_file_deregister(self._get(), <phx_file *>file_addr)
        if rc < 0:
            raise _err(rc, path)

    def pread(self, uintptr_t file_addr, uint64_t devptr, size_t n, uint64_t offset,
              path=None) -> int:
        """Synchronous read (cuFileRead semantics: not ordered against streams)."""
        cdef phx_cuda *c = self._get()
        cdef int64_t r
        with nogil:
            r = phx_cuda_pread(c, <phx_file *>file_addr, devptr, n, offset)
        if r < 0:
            raise _err(<int>r, path)
        return r

    def pwrite(self, uintptr_t file_addr, uint64_t devptr, size_t n, uint64_t offset,
               path=None) -> int:
        cdef phx_cuda *c = self._get()
        cdef int64_t r
        with nogil:
            r = phx_cuda_pwrite(c, <phx_file *>file_addr, devptr, n, offset)
        if r < 0:
            raise _err(<int>r, path)
        return r

    cdef IO _new(self, uintptr_t file_addr, uint64_t devptr, size_t n, uint64_t offset,
                 bint write, keep, path):
        cdef IO h = IO.__new__(IO)
        h.io = <phx_cuda_io *>calloc(1, sizeof(phx_cuda_io))
        if h.io == NULL:
            raise MemoryError()
        phx_cuda_io_prep(h.io, <phx_file *>file_addr, OP_WRITE if write else OP_READ,
                         devptr, n, offset)
        h.ctx = self
        h.keep = keep
        h.path = path
        return h

    def submit(self, uintptr_t file_addr, uint64_t devptr, size_t n, uint64_t offset,
               bint write, keep=None, path=None, after_stream=None) -> IO:
        """Host-async request.  With ``after_stream`` (a CUstream int; 0 =
        legacy default) its copies follow the work queued there now."""
        cdef phx_cuda *c = self._get()
        cdef IO h = self._new(file_addr, devptr, n, offset, write, keep, path)
        cdef phx_cuda_io *io = h.io
        cdef int rc
        cdef uintptr_t s = 0
        if after_stream is None:
            with nogil:
                rc = phx_cuda_submit(c, &io, 1)
        else:
            s = <uintptr_t>after_stream
            with nogil:
                rc = phx_cuda_submit_after(c, &io, 1, <void *>s)
        if rc < 0:
            h.io.done = 1
            raise _err(rc, path)
        return h

    def submit_batch(self, uintptr_t file_addr, uint64_t base, file_offsets,
                     buf_offsets, sizes, bint write, keep=None, path=None,
                     after_stream=None) -> Batch:
        """N requests on one file in one call: request i moves ``sizes[i]``
        bytes between ``file_offsets[i]`` and GPU address ``base +
        buf_offsets[i]``.  The three are sequences of ints (or uint64/int64
        arrays).  With ``after_stream`` the copies follow that stream."""
        cdef phx_cuda *c = self._get()
        cdef Batch b = Batch.__new__(Batch)
        cdef size_t n = len(sizes), i
        cdef phx_cuda_io **ptrs
        cdef int rc
        cdef uintptr_t s = 0
        cdef bint after = after_stream is not None
        cdef const uint64_t *fo
        cdef const uint64_t *bo
        cdef const uint64_t *sz
        if len(file_offsets) != n or len(buf_offsets) != n:
            raise ValueError("file_offsets, buf_offsets and sizes differ in length")
        fa, ba, sa = _u64(file_offsets), _u64(buf_offsets), _u64(sizes)
        fo = <const uint64_t *><uintptr_t>_addr(fa)
        bo = <const uint64_t *><uintptr_t>_addr(ba)
        sz = <const uint64_t *><uintptr_t>_addr(sa)
        b.ctx = self
        b.keep = keep
        b.path = path
        b.n = n
        b.ios = <phx_cuda_io *>calloc(n if n else 1, sizeof(phx_cuda_io))
        ptrs = <phx_cuda_io **>calloc(n if n else 1, sizeof(phx_cuda_io *))
        if b.ios == NULL or ptrs == NULL:
            free(ptrs)
            raise MemoryError()
        if after:
            s = <uintptr_t>after_stream
        with nogil:
            for i in range(n):
                phx_cuda_io_prep(&b.ios[i], <phx_file *>file_addr,
                                 OP_WRITE if write else OP_READ,
                                 base + bo[i], sz[i], fo[i])
                # not queued until the C side accepts it (it clears done)
                b.ios[i].done = 1
                b.ios[i].result = -125  # -ECANCELED
                ptrs[i] = &b.ios[i]
            if after:
                rc = phx_cuda_submit_after(c, ptrs, n, <void *>s)
            else:
                rc = phx_cuda_submit(c, ptrs, n)
        free(ptrs)
        if rc < 0:
            b.wait()
            raise _err(rc, path)
        return b

    def many(self, uintptr_t file_addr, uint64_t devptr, uint64_t dev_len, file_offsets,
             dev_offsets, lens, bint write, after_stream=None, path=None) -> tuple:
        """phx_cuda_many(): piece i moves ``lens[i]`` bytes between
        ``file_offsets[i]`` and GPU address ``devptr + dev_offsets[i]``, all
        inside ``[devptr, devptr + dev_len)``; returns when all are done.
        ``(total, results)``: the sum of bytes or the first failed piece's
        -errno, and an int64 array of each piece's.  Bad arguments raise
        ValueError (nothing queued).  With ``after_stream`` the copies follow
        the work queued on that stream."""
        import numpy as np
        cdef phx_cuda *c = self._get()
        cdef phx_cuda_many_s m
        cdef int64_t total
        fo, do, ln = _i64(file_offsets, "file"), _i64(dev_offsets, "GPU"), _i64(lens, "len")
        res = np.full(fo.shape[0], -(2 ** 63), dtype=np.int64)  # untouched: never queued
        _many_fill(&m, file_addr, devptr, dev_len, fo, do, ln, res, write)
        if after_stream is not None:
            m.flags = PHX_CUDA_MANY_AFTER
            m.stream = <void *><uintptr_t>after_stream
        with nogil:
            total = phx_cuda_many(c, &m)
        if total < 0 and (m.n == 0 or res[0] == -(2 ** 63)):
            raise _many_refused(<int>total, path)
        return total, res

    def many_stream(self, uintptr_t file_addr, uint64_t devptr, uint64_t dev_len,
                    file_offsets, dev_offsets, lens, bint write, uintptr_t stream,
                    keep=None, path=None) -> ManyStream:
        """phx_cuda_many_async() on ``stream`` (a CUstream int): the pieces
        run when the stream gets there, in order.  Returns a
        :class:`ManyStream`; hold it (or its ``results``) until it is done."""
        import numpy as np
        cdef phx_cuda *c = self._get()
        cdef phx_cuda_many_s m
        cdef ManyStream h = ManyStream.__new__(ManyStream)
        cdef int rc
        fo, do, ln = _i64(file_offsets, "file"), _i64(dev_offsets, "GPU"), _i64(lens, "len")
        res = np.full(fo.shape[0], -(2 ** 63), dtype=np.int64)
        pending = np.zeros(1, dtype=np.int64)
        _many_fill(&m, file_addr, devptr, dev_len, fo, do, ln, res, write)
        m.stream = <void *>stream
        m.pending = <int64_t *><uintptr_t>pending.ctypes.data
        h.results = res
        h.pending = pending
        h.keep = keep
        h.path = path
        with nogil:
            rc = phx_cuda_many_async(c, &m)
        if rc < 0 and (m.n == 0 or res[0] == -(2 ** 63)):
            raise _many_refused(rc, path)
        # rc < 0 past the checks: the pieces before the refused one are
        # queued and their results still arrive; the others carry the error
        # (h must live on until done, so it is returned, not raised)
        return h

    def submit_stream(self, uintptr_t file_addr, uint64_t devptr, size_t n,
                      uint64_t offset, bint write, uintptr_t stream, keep=None,
                      path=None) -> IO:
        """Stream-ordered request on ``stream`` (a CUstream int)."""
        cdef phx_cuda *c = self._get()
        cdef IO h = self._new(file_addr, devptr, n, offset, write, keep, path)
        cdef int rc
        with nogil:
            rc = phx_cuda_submit_stream(c, h.io, <void *>stream)
        if rc < 0:
            h.io.done = 1
            raise _err(rc, path)
        return h

    def stream_deferred(self, uintptr_t file_addr, uint64_t base, uintptr_t args,
                        bint write, uintptr_t stream, path=None) -> None:
        """cuFile-style stream op whose arguments are read when the stream
        gets there: ``args`` is the address of four int64 in host memory,
        [size, file_offset, buf_offset, bytes_done]; the caller keeps them
        alive until the stream has passed the operation."""
        cdef phx_cuda *c = self._get()
        cdef int64_t *a = <int64_t *>args
        cdef int rc
        with nogil:
            if write:
                rc = phx_cuda_write_async(c, <phx_file *>file_addr, base, <size_t *>&a[0],
                                          &a[1], &a[2], &a[3], <void *>stream)
            else:
                rc = phx_cuda_read_async(c, <phx_file *>file_addr, base, <size_t *>&a[0],
                                         &a[1], &a[2], &a[3], <void *>stream)
        if rc < 0:
            raise _err(rc, path)

    def stream_loop(self, uintptr_t file_addr, uint64_t base, uintptr_t args, size_t n,
                    bint write, uintptr_t stream, uintptr_t d2h=0, uintptr_t probe=0,
                    uint64_t probe_bytes=0) -> int:
        """Queue ``n`` stream ops on ``stream`` in one loop that never holds
        the GIL: how a C or C++ server (or one thread of it) drives libphx,
        for the stream benchmark's ``phx-stream-c`` rows.  ``args``: the
        address of ``n`` rows of four int64 as for :meth:`stream_deferred`,
        kept alive by the caller until the stream has passed them.  After
        each read, when ``d2h`` (the address of the driver's
        ``cuMemcpyDtoHAsync_v2``) is given, the chunk's first ``probe_bytes``
        are copied to ``probe + k * probe_bytes`` (pinned host memory) on the
        same stream: work that needs the chunk, queued behind its read.
        Returns ``n``; the first failure raises (ops before it are queued)."""
        cdef phx_cuda *c = self._get()
        cdef int64_t *a = <int64_t *>args
        cdef d2h_fn copy = <d2h_fn>d2h
        cdef size_t k = 0
        cdef int rc = 0
        with nogil:
            while k < n:
                if write:
                    rc = phx_cuda_write_async(c, <phx_file *>file_addr, base,
                                              <size_t *>&a[4 * k], &a[4 * k + 1],
                                              &a[4 * k + 2], &a[4 * k + 3], <void *>stream)
                else:
                    rc = phx_cuda_read_async(c, <phx_file *>file_addr, base,
                                             <size_t *>&a[4 * k], &a[4 * k + 1],
                                             &a[4 * k + 2], &a[4 * k + 3], <void *>stream)
                    if rc == 0 and copy != NULL:
                        rc = copy(<void *>(probe + k * probe_bytes),
                                  base + <uint64_t>a[4 * k + 2], probe_bytes, <void *>stream)
                        if rc != 0:
                            rc = -EIO       # a CUresult, not an errno
                if rc < 0:
                    break
                k += 1
        if rc < 0:
            raise _err(rc, None, f"stream op {k} of {n}")
        return n


def _u64(seq):
    """A contiguous uint64 array of a sequence of non-negative ints."""
    import numpy as np
    a = np.ascontiguousarray(seq)
    if a.size and a.dtype.kind not in "iu":
        raise TypeError("offsets and sizes must be integers")
    if a.dtype.kind == "i" and a.size and a.min() < 0:
        raise OSError(_errno.EINVAL, "negative offset or size")
    return np.ascontiguousarray(a, dtype=np.uint64)


def _addr(a) -> int:
    return a.ctypes.data if a.size else 0


# ---------------------------------------------------------------------------
# Pinned host memory and copy streams (PHX_0.7): no staging context
# ---------------------------------------------------------------------------

cdef class HostRegistration:
    """Host memory of a buffer-protocol object page-locked for ``device``'s
    copies (phx_cuda_host_register) until :meth:`close`; the object's buffer
    is held (it cannot be resized or freed) meanwhile."""
    cdef Py_buffer view
    cdef bint held
    cdef bint _pinned
    cdef readonly int device
    cdef readonly int pid

    def __cinit__(self, obj, int device=0):
        cdef int rc
        self.held = self._pinned = False
        PyObject_GetBuffer(obj, &self.view, PyBUF_SIMPLE)
        self.held = True
        self.device = device
        self.pid = _os.getpid()
        if self.view.len == 0:
            return                      # nothing to pin
        with nogil:
            rc = phx_cuda_host_register(device, self.view.buf, <size_t>self.view.len)
        if rc < 0:
            PyBuffer_Release(&self.view)
            self.held = False
            raise _err(rc, None, "pinning host memory")
        self._pinned = True

    def __dealloc__(self):
        if self._pinned and self.pid == _os.getpid():
            phx_cuda_host_unregister(self.device, self.view.buf)
        self._pinned = False
        if self.held:
            PyBuffer_Release(&self.view)
            self.held = False

    @property
    def address(self) -> int:
        return <uintptr_t>self.view.buf if self.held else 0

    @property
    def nbytes(self) -> int:
        return self.view.len if self.held else 0

    @property
    def pinned(self) -> bool:
        """True while the memory is page-locked."""
        return self._pinned

    def close(self) -> None:
        """Unpin (idempotent) and let the buffer go."""
        cdef int rc = 0
        if self._pinned:
            self._pinned = False
            if self.pid == _os.getpid():
                with nogil:
                    rc = phx_cuda_host_unregister(self.device, self.view.buf)
        if self.held:
            PyBuffer_Release(&self.view)
            self.held = False
        if rc < 0:
            raise _err(rc, None, "unpinning host memory")


cdef class Stream:
    """A CUDA stream of ``device``'s primary context for copies between host
    memory and the GPU (phx_cuda_stream); addresses are ints."""
    cdef phx_cuda_stream *s
    cdef readonly int device
    cdef readonly int pid

    def __cinit__(self, int device=0):
        cdef int rc
        self.s = NULL
        with nogil:
            rc = phx_cuda_stream_create(device, &self.s)
        if rc < 0:
            self.s = NULL
            raise _err(rc, None, "creating a copy stream")
        self.device = device
        self.pid = _os.getpid()

    def __dealloc__(self):
        if self.s != NULL and self.pid == _os.getpid():
            with nogil:
                phx_cuda_stream_destroy(self.s)
        self.s = NULL

    cdef phx_cuda_stream *_get(self) except NULL:
        if self.s == NULL:
            raise ValueError("copy stream is closed")
        if self.pid != _os.getpid():
            raise RuntimeError("copy stream used after fork (CUDA does not survive fork)")
        return self.s

    @property
    def handle(self) -> int:
        """The CUstream as an int."""
        return <uintptr_t>phx_cuda_stream_handle(self._get())

    def after(self, uintptr_t producer=0) -> None:
        """Work queued from now on waits for what ``producer`` (a CUstream int;
        0: the legacy default stream) has queued now."""
        cdef phx_cuda_stream *s = self._get()
        cdef int rc
        with nogil:
            rc = phx_cuda_stream_after(s, <void *>producer)
        if rc < 0:
            raise _err(rc)

    def h2d(self, uint64_t dst, uintptr_t src, size_t n) -> None:
        """Queue host ``src`` -> device ``dst``, ``n`` bytes."""
        cdef phx_cuda_stream *s = self._get()
        cdef int rc
        with nogil:
            rc = phx_cuda_stream_h2d(s, dst, <const void *>src, n)
        if rc < 0:
            raise _err(rc)

    def d2h(self, uintptr_t dst, uint64_t src, size_t n) -> None:
        """Queue device ``src`` -> host ``dst``, ``n`` bytes."""
        cdef phx_cuda_stream *s = self._get()
        cdef int rc
        with nogil:
            rc = phx_cuda_stream_d2h(s, <void *>dst, src, n)
        if rc < 0:
            raise _err(rc)

    def synchronize(self) -> None:
        """Wait until everything queued so far has run."""
        cdef phx_cuda_stream *s = self._get()
        cdef int rc
        with nogil:
            rc = phx_cuda_stream_sync(s)
        if rc < 0:
            raise _err(rc)

    def close(self) -> None:
        """Wait for the queued copies, then free the stream (idempotent)."""
        cdef phx_cuda_stream *s = self.s
        cdef int rc
        if s == NULL:
            return
        self.s = NULL
        if self.pid != _os.getpid():
            return
        with nogil:
            rc = phx_cuda_stream_destroy(s)
        if rc < 0:
            raise _err(rc)


def host_buffer(obj, bint writable=False):
    """(address, nbytes) of a contiguous host buffer (buffer protocol);
    BufferError when it is not contiguous (or read-only and ``writable``)."""
    cdef Py_buffer v
    PyObject_GetBuffer(obj, &v, PyBUF_SIMPLE | (PyBUF_WRITABLE if writable else 0))
    try:
        return <uintptr_t>v.buf, v.len
    finally:
        PyBuffer_Release(&v)
