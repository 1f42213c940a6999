"""Running a read plan: targets allocated, reads in flight, tensors handed out.

Each :class:`~phx.loader.plan.Job` gets one target allocation, which is the
tensors' final memory (they are views of it), and its file ranges are read
straight into it:

* host memory (:class:`HostBackend`): ``File.pread_many`` through phx's
  engine, O_DIRECT.  The target is placed so that its address is congruent
  to the job's file offset modulo 4 KiB, so the whole body of the read goes
  direct (no copy); only the unaligned head and tail pass the engine's
  bounce buffers.  Reads run on two worker threads (the calls release the
  GIL).
* GPU memory (:class:`GPUBackend`): ``phx.gpu.read_chunks_async``, which
  stages through the context's pinned buffers (bounded: ``phx info``
  shows how many bytes) with the SSD and the copy engine both DMAing; no
  CPU copy of payload.

Jobs are submitted in file order while fewer than ``inflight_bytes`` are in
flight (never fewer than two jobs: the next is read while the current one
is handed out).  A job's tensors are handed out only once all its bytes
have arrived; a short read (a file truncated since it was opened) raises
:class:`~phx.loader.format.CheckpointError` naming the tensor, an I/O error
raises ``OSError`` naming it.  Whatever happens, every read in flight is
waited for before the files close.

One checkpoint or none: each file is checked against the identity its
header was read with (device, inode, size, mtime, ctime) when it is opened
for the data and again after each read of it completes, before that read's
tensors are handed out; a difference raises
:class:`~phx.loader.format.CheckpointError` naming the file.  (A file
replaced by a rename *after* it was opened is still read from the open
inode, which is the file the header described.)

Warm files: a file most of which (:data:`WARM_FRACTION`) is in the page
cache when it is opened is read through the page cache (buffered) instead
of O_DIRECT, which would read it from the device again
(:mod:`phx.loader.cache`) - unless the device is memory itself (zram, ram,
pmem), where the page cache is slower than O_DIRECT.  ``cached="never"`` /
``"always"`` force either.
"""
from __future__ import annotations

import concurrent.futures
from collections import deque
from collections.abc import Generator, Iterable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

import numpy as np
import numpy.typing as npt

from phx.loader.cache import memory_device, resident_fraction
from phx.loader.format import CheckpointError, FileIdentity, check_identity
from phx.loader.plan import Job, Output

if TYPE_CHECKING:
    import torch

    import phx.gpu
    from phx import File

#: rows of (file offset, buffer offset, size)
_Pieces = npt.NDArray[np.int64]

#: a file at least this much in the page cache is read buffered ("auto")
WARM_FRACTION = 0.8
CACHED = ("auto", "always", "never")


@dataclass
class LoadStats:
    """What a load read and held.  ``bytes_read``: payload bytes asked of the
    files (sliced tensors count only their slices); ``buffered_files``: files
    read through the page cache (warm, or O_DIRECT refused), the others went
    O_DIRECT; ``memory_direct``: warm files read O_DIRECT all the same
    because their device is memory (file -> device name, e.g. "zram0");
    ``peak_held_bytes``: the most target memory (on the load's
    device) allocated by the loader and not yet handed out at any time - its
    extra memory beyond what the consumer keeps."""
    tensors: int = 0
    bytes_read: int = 0
    files: list[str] = field(default_factory=list)
    buffered_files: list[str] = field(default_factory=list)
    resident: dict[str, float] = field(default_factory=dict)
    memory_direct: dict[str, str] = field(default_factory=dict)
    held_bytes: int = 0
    peak_held_bytes: int = 0


class TensorStream(Iterator[tuple[str, Any]]):
    """The ``(name, tensor)`` iterator of a load, with its :class:`LoadStats`."""

    def __init__(self, gen: Generator[tuple[str, Any], None, None], stats: LoadStats):
        self._gen = gen
        self.stats = stats

    def __iter__(self) -> "TensorStream":
        return self

    def __next__(self) -> tuple[str, Any]:
        return next(self._gen)

    def close(self) -> None:
        """Stop early: reads in flight are waited for, the files closed."""
        self._gen.close()


class Backend:
    """Where targets live.  ``alignment``: the congruence a target's address
    is given with its file offset (O_DIRECT block for host memory)."""

    alignment = 4096

    def alloc(self, nbytes: int) -> tuple[Any, int]:
        """A buffer of at least ``nbytes + alignment`` bytes and its address."""
        raise NotImplementedError

    def submit(self, file: File, buf: Any, pieces: _Pieces) -> Any:
        """Start reading ``pieces`` (rows: file offset, buffer offset, size)."""
        raise NotImplementedError

    def wait(self, handle: Any) -> _Pieces:
        """Bytes moved by each piece."""
        raise NotImplementedError

    def view(self, buf: Any, addr: int, offset: int, out: Output) -> Any:
        """The tensor ``out`` at byte ``offset`` of ``buf`` (address ``addr``)."""
        raise NotImplementedError

    def close(self) -> None:
        pass


def _torch_dtype(name: str) -> torch.dtype:
    import torch

    from phx.loader.format import DTYPES
    dt = getattr(torch, DTYPES[name][1], None)
    if dt is None:
        raise TypeError(f"this torch ({torch.__version__}) has no {DTYPES[name][1]} "
                        f"for safetensors dtype {name}")
    assert isinstance(dt, torch.dtype)
    return dt


def _torch_view(buf: torch.Tensor, addr: int, offset: int, out: Output) -> torch.Tensor:
    """A view of bytes ``[offset, offset + nbytes)`` of a uint8 tensor as
    ``out``; a copy where the address does not suit the dtype."""
    import torch
    dt = _torch_dtype(out.dtype)
    if out.nbytes == 0:
        return torch.empty(out.shape, dtype=dt, device=buf.device)
    region = buf[offset:offset + out.nbytes]
    if (addr + offset) % out.info.itemsize:
        # a file that puts a tensor at an offset its dtype cannot be viewed at
        region = region.clone()
    return region.view(dt).reshape(out.shape)


class HostBackend(Backend):
    """CPU torch tensors, read by phx's engine (O_DIRECT, bounce at the edges)."""

    alignment = 4096

    def __init__(self, threads: int = 2):
        self._pool = concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="phx-load")

    def alloc(self, nbytes: int) -> tuple[torch.Tensor, int]:
        import torch
        buf = torch.empty(nbytes + self.alignment, dtype=torch.uint8)
        return buf, buf.data_ptr()

    def submit(self, file: File, buf: torch.Tensor,
               pieces: _Pieces) -> concurrent.futures.Future[_Pieces]:
        return self._pool.submit(file.pread_many, buf, pieces[:, 0], pieces[:, 2], pieces[:, 1])

    def wait(self, handle: concurrent.futures.Future[_Pieces]) -> _Pieces:
        return np.asarray(handle.result(), dtype=np.int64)

    def view(self, buf: torch.Tensor, addr: int, offset: int, out: Output) -> torch.Tensor:
        return _torch_view(buf, addr, offset, out)

    def close(self) -> None:
        self._pool.shutdown(wait=True)


class GPUBackend(Backend):
    """GPU targets read by ``phx.gpu.read_chunks_async``; subclasses say how
    GPU memory is allocated and viewed (torch: :class:`TorchGPUBackend`)."""

    alignment = 256

    def submit(self, file: File, buf: Any, pieces: _Pieces) -> phx.gpu.GPUBatch:
        import phx.gpu
        return phx.gpu.read_chunks_async(buf, file, pieces[:, 0], pieces[:, 1], pieces[:, 2])

    def wait(self, handle: phx.gpu.GPUBatch) -> _Pieces:
        return np.asarray(handle.result(), dtype=np.int64)


class TorchGPUBackend(GPUBackend):
    """CUDA torch tensors on ``device``."""

    def __init__(self, device: Any) -> None:
        import torch

        import phx.gpu
        ok, why = phx.gpu.is_available()
        if not ok:
            raise RuntimeError(f"phx.loader: cannot load to {device}: {why}")
        idx = cuda_index(device)
        self.device = torch.device("cuda", idx) if idx is not None else torch.device("cuda")

    def alloc(self, nbytes: int) -> tuple[torch.Tensor, int]:
        import torch
        buf = torch.empty(nbytes + self.alignment, dtype=torch.uint8, device=self.device)
        return buf, buf.data_ptr()

    def view(self, buf: torch.Tensor, addr: int, offset: int, out: Output) -> torch.Tensor:
        return _torch_view(buf, addr, offset, out)


def _kind(device: Any) -> str:
    """"cpu" or "cuda" for a device spelling (int, "cuda[:N]", "cpu", torch.device)."""
    kind = "cuda" if isinstance(device, int) else str(device).partition(":")[0]
    if kind not in ("cpu", "cuda"):
        raise ValueError(f"phx.loader: unsupported device {device!r} (cpu or cuda)")
    return kind


def cuda_index(device: Any) -> int | None:
    """The CUDA ordinal of a device spelling (bare "cuda": torch's current
    device), or None for the CPU."""
    if _kind(device) == "cpu":
        return None
    if isinstance(device, int):
        return device
    idx = str(device).partition(":")[2]
    if idx:
        return int(idx)
    import torch
    return torch.cuda.current_device()


def backend_for(device: Any) -> Backend:
    """The backend for a torch device spelling ("cpu", "cuda", "cuda:1", torch.device)."""
    return HostBackend() if _kind(device) == "cpu" else TorchGPUBackend(device)


def _check(job: Job, pieces: _Pieces, got: _Pieces) -> None:
    short = np.flatnonzero(got != pieces[:, 2])
    if not short.size:
        return
    i = int(short[0])
    fo, _, size = (int(x) for x in pieces[i])
    end = fo + int(got[i])           # the first byte that did not arrive
    name = next((o.name for o in job.outputs
                 if o.info.start <= end < o.info.end), job.outputs[0].name)
    raise CheckpointError(job.path, f"short read: {int(got[i])} of {size} bytes at offset "
                          f"{fo} (the file ends at {end}: truncated while loading?)", name)


def open_for_data(path: str, ident: FileIdentity | None = None, cached: str = "auto",
                  stats: LoadStats | None = None) -> File:
    """Open ``path`` (a phx ``File``) for the data: O_DIRECT, or buffered when
    it is warm (or O_DIRECT is refused); the handle is checked to be the file
    ``ident`` describes (the header's).  ``stats`` records how it was opened."""
    if stats is None:
        stats = LoadStats()
    import phx
    f = phx.open(path, "r", allow_buffered=True)
    try:
        check_identity(path, ident, f.fileno(), "at open")
        warm = cached == "always"
        if cached == "auto" and f.direct:
            frac = resident_fraction(f.fileno())
            stats.resident[path] = frac
            warm = frac >= WARM_FRACTION
            mem = memory_device(f.fileno()) if warm else None
            if mem is not None:
                # the device is memory: the page cache is no faster (cache.py)
                stats.memory_direct[path] = mem
                warm = False
        if warm and f.direct:
            g = phx.open(path, "r", direct=False)
            f.close()
            f = g
            check_identity(path, ident, f.fileno(), "at open")
    except BaseException:
        f.close()
        raise
    stats.files.append(path)
    if not f.direct:
        stats.buffered_files.append(path)
    return f


def run(jobs: Iterable[Job], backend: Backend, *, inflight_bytes: int = 1 << 30,
        progress: bool = False, open_file: Callable[[str], Any] | None = None,
        identities: dict[str, FileIdentity | None] | None = None,
        cached: str = "auto") -> TensorStream:
    """Read ``jobs`` and yield ``(name, tensor)`` in file order.
    ``identities``: each file's :class:`FileIdentity` from its header (the
    data must come from that file); ``cached``: "auto" (page cache when the
    file is warm), "always" or "never" (O_DIRECT where the filesystem allows)."""
    if cached not in CACHED:
        raise ValueError(f"cached must be one of {CACHED}, not {cached!r}")
    stats = LoadStats()
    return TensorStream(_run(list(jobs), backend, inflight_bytes, progress, open_file,
                             identities or {}, cached, stats), stats)


def _run(jobs: list[Job], backend: Backend, inflight_bytes: int, progress: bool,
         open_file: Callable[[str], Any] | None, identities: dict[str, FileIdentity | None],
         cached: str, stats: LoadStats) -> Generator[tuple[str, Any], None, None]:
    files: dict[str, Any] = {}
    pending: deque[tuple[Job, Any, int, int, _Pieces, Any]] = deque()
    bar = None
    if progress:
        try:
            from tqdm import tqdm       # optional (phx[bench]; vLLM has it)
        except ImportError:
            tqdm = None
        if tqdm is not None:
            bar = tqdm(total=sum(j.read_bytes for j in jobs), unit="B", unit_scale=True,
                       unit_divisor=1024, desc="phx load", dynamic_ncols=True)
    opener = open_file or (lambda p: open_for_data(p, identities.get(p), cached, stats))
    it = iter(jobs)
    flight = 0
    try:
        while True:
            while len(pending) < 2 or flight < inflight_bytes:
                job = next(it, None)
                if job is None:
                    break
                f = files.get(job.path)
                if f is None:
                    f = files[job.path] = opener(job.path)
                buf, addr = backend.alloc(job.nbytes)
                stats.held_bytes += job.nbytes
                stats.peak_held_bytes = max(stats.peak_held_bytes, stats.held_bytes)
                stats.bytes_read += job.read_bytes
                pad = (job.align_offset - addr) % backend.alignment
                pieces = np.array([(fo, bo + pad, sz) for fo, bo, sz in job.pieces],
                                  dtype=np.int64).reshape(-1, 3)
                handle = backend.submit(f, buf, pieces) if len(pieces) else None
                pending.append((job, buf, addr, pad, pieces, handle))
                flight += job.read_bytes
            if not pending:
                break
            job, buf, addr, pad, pieces, handle = pending.popleft()
            flight -= job.read_bytes
            if handle is not None:
                try:
                    got = backend.wait(handle)
                except OSError as e:
                    raise OSError(e.errno, f"{e.strerror} (reading tensor "
                                  f"{job.outputs[0].name!r}...)", job.path) from e
                _check(job, pieces, got)
                # every byte of this job came from the header's file, unchanged
                # until now; else nothing of it is handed out
                ident = identities.get(job.path)
                if ident is not None:
                    check_identity(job.path, ident, files[job.path].fileno(), "after reading it")
            outs = [(o.name, backend.view(buf, addr, pad + o.offset, o)) for o in job.outputs]
            del buf
            stats.held_bytes -= job.nbytes
            stats.tensors += len(outs)
            if bar is not None:
                bar.update(job.read_bytes)
            yield from outs
            # the consumer has them now: do not keep this job's memory alive
            # while the next reads are submitted
            del outs
    finally:
        for *_, handle in pending:
            if handle is not None:
                try:
                    backend.wait(handle)
                except Exception:  # noqa: BLE001 - the first error is already raised
                    pass
        pending.clear()
        for f in files.values():
            f.close()
        backend.close()
        if bar is not None:
            bar.close()
