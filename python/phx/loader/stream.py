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
"""
from __future__ import annotations

import concurrent.futures
from collections import deque
from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np

from phx.loader.format import CheckpointError
from phx.loader.plan import Job, Output


class Backend:
    """Where targets live.  ``alignment``: the congruence a target's address
    is given with its file offset (O_DIRECT block for host memory)."""

    alignment = 4096

    def alloc(self, nbytes: int) -> tuple[Any, int]:
        """A buffer of at least ``nbytes + alignment`` bytes and its address."""
        raise NotImplementedError

    def submit(self, file, buf, pieces: np.ndarray) -> Any:
        """Start reading ``pieces`` (rows: file offset, buffer offset, size)."""
        raise NotImplementedError

    def wait(self, handle) -> np.ndarray:
        """Bytes moved by each piece."""
        raise NotImplementedError

    def view(self, buf, addr: int, offset: int, out: Output) -> Any:
        """The tensor ``out`` at byte ``offset`` of ``buf`` (address ``addr``)."""
        raise NotImplementedError

    def close(self) -> None:
        pass


def _torch_dtype(name: str):
    import torch

    from phx.loader.format import DTYPES
    dt = getattr(torch, DTYPES[name][1], None)
    if dt is None:
        raise TypeError(f"this torch ({torch.__version__}) has no {DTYPES[name][1]} "
                        f"for safetensors dtype {name}")
    return dt


def _torch_view(buf, addr: int, offset: int, out: Output):
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

    def alloc(self, nbytes: int):
        import torch
        buf = torch.empty(nbytes + self.alignment, dtype=torch.uint8)
        return buf, buf.data_ptr()

    def submit(self, file, buf, pieces):
        return self._pool.submit(file.pread_many, buf, pieces[:, 0], pieces[:, 2], pieces[:, 1])

    def wait(self, handle):
        return np.asarray(handle.result(), dtype=np.int64)

    def view(self, buf, addr, offset, out):
        return _torch_view(buf, addr, offset, out)

    def close(self) -> None:
        self._pool.shutdown(wait=True)


class GPUBackend(Backend):
    """GPU targets read by ``phx.gpu.read_chunks_async``; subclasses say how
    GPU memory is allocated and viewed (torch: :class:`TorchGPUBackend`)."""

    alignment = 256

    def submit(self, file, buf, pieces):
        import phx.gpu
        return phx.gpu.read_chunks_async(file, buf, pieces[:, 0], pieces[:, 1], pieces[:, 2])

    def wait(self, handle):
        return np.asarray(handle.result(), dtype=np.int64)


class TorchGPUBackend(GPUBackend):
    """CUDA torch tensors on ``device``."""

    def __init__(self, device):
        import torch

        import phx.gpu
        ok, why = phx.gpu.is_available()
        if not ok:
            raise RuntimeError(f"phx.loader: cannot load to {device}: {why}")
        self.device = torch.device("cuda", cuda_index(device))

    def alloc(self, nbytes: int):
        import torch
        buf = torch.empty(nbytes + self.alignment, dtype=torch.uint8, device=self.device)
        return buf, buf.data_ptr()

    def view(self, buf, addr, offset, out):
        return _torch_view(buf, addr, offset, out)


def _kind(device) -> str:
    """"cpu" or "cuda" for a device spelling (int, "cuda[:N]", "cpu", torch.device)."""
    kind = "cuda" if isinstance(device, int) else str(device).partition(":")[0]
    if kind not in ("cpu", "cuda"):
        raise ValueError(f"phx.loader: unsupported device {device!r} (cpu or cuda)")
    return kind


def cuda_index(device) -> int | None:
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


def backend_for(device) -> Backend:
    """The backend for a torch device spelling ("cpu", "cuda", "cuda:1", torch.device)."""
    return HostBackend() if _kind(device) == "cpu" else TorchGPUBackend(device)


def _check(job: Job, pieces: np.ndarray, got: np.ndarray) -> None:
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


def run(jobs: Iterable[Job], backend: Backend, *, inflight_bytes: int = 1 << 30,
        progress: bool = False, open_file=None) -> Iterator[tuple[str, Any]]:
    """Read ``jobs`` and yield ``(name, tensor)`` in file order."""
    import phx
    jobs = list(jobs)
    files: dict[str, Any] = {}
    pending: deque = deque()
    bar = None
    if progress:
        from tqdm import tqdm
        bar = tqdm(total=sum(j.read_bytes for j in jobs), unit="B", unit_scale=True,
                   unit_divisor=1024, desc="phx load", dynamic_ncols=True)
    opener = open_file or (lambda p: phx.open(p, "r", allow_buffered=True))
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
            outs = [(o.name, backend.view(buf, addr, pad + o.offset, o)) for o in job.outputs]
            del buf
            if bar is not None:
                bar.update(job.read_bytes)
            yield from outs
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
