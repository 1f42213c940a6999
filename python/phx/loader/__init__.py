"""Safetensors checkpoints straight into their final memory (GPU or host).

>>> from phx import loader
>>> sd = loader.load_file("model.safetensors.index.json", device="cuda")   # dict
>>> for name, t in loader.iter_tensors("/models/llama", device="cuda:0"):  # vLLM style
...     model_param[name].copy_(t)

Every header of the checkpoint (one file, the shards of an
``*.index.json``, or a directory holding either) is read and validated
before any data is (:mod:`phx.loader.format`); reads are planned as merged
contiguous ranges in file order (:mod:`phx.loader.plan`) and run through
phx (:mod:`phx.loader.stream`): O_DIRECT, GPU targets through phx.gpu's
bounded pinned staging, host targets directly (only unaligned edges are
bounced).  Tensors are views of a few large allocations (one per merged
range of at most ``group_bytes``), so tensors next to each other in the file
share a storage.

Tensor parallelism: ``shard=`` (a callable ``(name, shape) -> Slice |
Partial | None``, e.g. :func:`tp_sharder`) reads only rank ``r``'s part of a
tensor along a dimension (a column slice reads one piece per row), or, with
:class:`Partial`, only some boxes of a tensor that keeps its full shape.

One checkpoint or none: the data must come from the files the headers were
read from, unchanged (else :class:`CheckpointError` naming the file).  Warm
files (mostly in the page cache) are read buffered, the others O_DIRECT
(``cached=``).  The iterator's ``.stats`` (:class:`LoadStats`) says what was
read, how, and the most memory the loader held.
"""
from __future__ import annotations

import concurrent.futures
import os
from collections.abc import Iterable, Sequence
from typing import Any, TypeAlias

from phx.futures import PoolFuture
from phx.loader.checkpoint import Checkpoint, open_checkpoint
from phx.loader.format import DTYPES, CheckpointError, FileIdentity, TensorInfo, check_identity
from phx.loader.plan import Job, Partial, Sharder, Slice, plan, slice_shape, tp_sharder
from phx.loader.stream import (WARM_FRACTION, Backend, GPUBackend, HostBackend, LoadStats,
                               TensorStream, backend_for, cuda_index, open_for_data, run)

__all__ = [
    "Backend", "Checkpoint", "CheckpointError", "DTYPES", "FileIdentity", "GPUBackend",
    "HostBackend", "Job", "LoadStats", "Partial", "Sharder", "Slice", "TensorInfo",
    "TensorStream", "WARM_FRACTION", "check_identity", "iter_tensors", "load_file",
    "open_checkpoint", "open_for_data", "plan",
    "prepare", "slice_shape", "tp_sharder",
]

#: what ``iter_tensors`` and ``load_file`` take: a file, an index, a folder,
#: a list of files, or a :class:`Checkpoint` already opened
Source: TypeAlias = "str | os.PathLike[str] | Sequence[str | os.PathLike[str]] | Checkpoint"

GROUP_BYTES = 256 << 20
INFLIGHT_BYTES = 1 << 30


def _jobs(ck: Checkpoint, names: Iterable[str] | None, shard: Sharder | None,
          group_bytes: int) -> list[Job]:
    if names is None:
        tensors = list(ck.tensors.values())
    else:
        names = list(names)
        missing = [n for n in names if n not in ck.tensors]
        if missing:
            raise KeyError(f"not in the checkpoint: {missing[:5]}")
        tensors = [ck.tensors[n] for n in names]
    return plan(tensors, group_bytes, shard)


def prepare(device: Any = "cuda") -> PoolFuture | None:
    """Make phx.gpu's staging context for ``device`` on a background thread, now.

    A load creates it on its first read otherwise, and its start-up (pinning
    the staging, the lanes' rings and streams: ~0.06-0.1 s on an H200, see
    docs/gpu.md) is then part of the load.  Call this before other set-up
    work (building the model, say) to take it off the load.  Returns a future
    whose result is the context (``phx.gpu.context(device=N)``; an error is
    raised there, and again by the load), or None for a CPU device.
    """
    index = cuda_index(device)
    if index is None:
        return None
    import phx.gpu
    pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="phx-prepare")
    fut = pool.submit(phx.gpu.context, device=index)
    pool.shutdown(wait=False)
    return PoolFuture(fut, None)


def iter_tensors(path: Source, device: Any = "cpu", *,
                 shard: Sharder | None = None, names: Iterable[str] | None = None,
                 progress: bool = False, group_bytes: int = GROUP_BYTES,
                 inflight_bytes: int = INFLIGHT_BYTES, cached: str = "auto") -> TensorStream:
    """Yield ``(name, tensor)`` for every tensor (or ``names``) in file order,
    each on ``device`` once its bytes have arrived.  At most about
    ``inflight_bytes`` are being read ahead (the loader's own memory on
    ``device`` is at most about ``inflight_bytes`` plus one job of
    ``group_bytes`` or one tensor: ``.stats.peak_held_bytes``); memory the
    caller drops is freed once every tensor of its allocation is dropped.
    Headers are all validated before the first tensor is yielded.
    ``cached``: "auto" reads files that are mostly in the page cache buffered
    (:data:`WARM_FRACTION`) unless their device is memory (zram, ram, pmem),
    "always" / "never" force either."""
    ck = path if isinstance(path, Checkpoint) else open_checkpoint(path)
    jobs = _jobs(ck, names, shard, group_bytes)
    return run(jobs, backend_for(device), inflight_bytes=inflight_bytes, progress=progress,
               identities={h.path: h.identity for h in ck.files}, cached=cached)


def load_file(path: Source, device: Any = "cpu", *,
              shard: Sharder | None = None, names: Iterable[str] | None = None,
              progress: bool = False, group_bytes: int = GROUP_BYTES,
              inflight_bytes: int = 4 * INFLIGHT_BYTES, cached: str = "auto") -> dict[str, Any]:
    """Every tensor (or ``names``) of the checkpoint at ``path`` as a dict of
    torch tensors on ``device`` (like ``safetensors.torch.load_file``, plus
    sharded checkpoints and ``shard=``).  Raises :class:`CheckpointError` (or
    ``OSError``) and returns nothing when any byte cannot be read."""
    return dict(iter_tensors(path, device, shard=shard, names=names, progress=progress,
                             group_bytes=group_bytes, inflight_bytes=inflight_bytes,
                             cached=cached))
