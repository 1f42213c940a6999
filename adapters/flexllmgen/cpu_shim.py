"""FlexLLMGen 0.1.8 without a GPU: its "GPU" is the CPU.  A correctness harness only.

FlexLLMGen computes on ``env.gpu`` and assumes CUDA in places that have
nothing to do with the numbers it computes: ``OptLM`` makes three
``torch.cuda.Stream()`` and enters them with ``torch.cuda.stream``, ``sync()``
calls ``torch.cuda.synchronize()``, every ``TorchDisk`` copy thread calls
``torch.cuda.set_device`` and allocates a pinned relay, CPU tensors are
allocated pinned, and the decode attention of a CPU-resident cache ends in
``.cuda()``.  :func:`cuda_on_cpu` makes each of those what it means on a
machine whose only device is the CPU, for as long as it is entered:

- ``torch.cuda.Stream()`` is an inert object, ``torch.cuda.stream(s)`` a null
  context, ``torch.cuda.synchronize()`` and ``torch.cuda.set_device()`` return
  at once: CPU kernels run synchronously, in order, on the calling thread, so
  there is nothing to wait for;
- ``pin_memory=True`` in ``torch.empty`` and ``Tensor.pin_memory()`` give
  ordinary memory (there is no DMA engine to pin for);
- ``Tensor.cuda()`` returns the tensor itself (the "GPU" is the CPU).

Nothing else changes: FlexLLMGen's own code runs, with ``TorchDevice("cpu")``
as ``env.gpu``, in fp16 (decode attention over a CPU-resident cache in fp32, as
FlexLLMGen does it), its copy threads moving the KV cache.  The patches are
process-wide while the context is entered (every thread sees them).  It refuses
to start where torch has CUDA: use the GPU.  Not a speed path: CPU fp16 kernels
are slow and, in a TCG guest, very slow.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any


class _NoStream:
    """What ``torch.cuda.Stream()`` stands for where every kernel is synchronous."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def wait_stream(self, other: Any) -> None:
        pass


@contextlib.contextmanager
def cuda_on_cpu() -> Iterator[None]:
    """Patch torch's CUDA entry points FlexLLMGen uses (see the module doc); restore on exit."""
    import torch
    if torch.cuda.is_available():
        raise RuntimeError("cuda_on_cpu() is for machines without a GPU: this one has "
                           "CUDA, run FlexLLMGen on it")
    empty = torch.empty

    def empty_unpinned(*args: Any, **kwargs: Any) -> Any:
        # nothing to pin for without a device that DMAs from host memory
        kwargs.pop("pin_memory", None)
        return empty(*args, **kwargs)

    saved: list[tuple[Any, str, Any]] = []

    def patch(obj: Any, name: str, value: Any) -> None:
        saved.append((obj, name, getattr(obj, name)))
        setattr(obj, name, value)

    try:
        patch(torch.cuda, "Stream", _NoStream)
        patch(torch.cuda, "stream", lambda s=None: contextlib.nullcontext())
        patch(torch.cuda, "synchronize", lambda device=None: None)
        patch(torch.cuda, "set_device", lambda device: None)
        patch(torch, "empty", empty_unpinned)
        patch(torch.Tensor, "pin_memory", lambda self, *a, **k: self)
        patch(torch.Tensor, "cuda", lambda self, *a, **k: self)
        yield
    finally:
        for obj, name, value in reversed(saved):
            setattr(obj, name, value)
