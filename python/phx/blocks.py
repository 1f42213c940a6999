"""KV cache blocks (vLLM's layout) as the offset arrays phx's array calls take.

vLLM keeps one KV cache per layer, each ``[2, num_blocks, block_size,
num_kv_heads, head_size]`` (K and V apart: ``kv=2``) or with K and V inside
each block (MLA, FlashInfer's ``[num_blocks, 2, ...]``: ``kv=1``).  Saving
or loading blocks moves, for every block id and every layer (and K/V), one
piece of ``block_bytes`` -- 8 to 64 KiB at vLLM's block sizes (issue 29).

:func:`vllm_block_pieces` turns block ids x layers into the three int64
arrays :func:`phx.gpu.pread_many` / :func:`phx.gpu.pwrite_many` (and
``File.pread_many``, :func:`phx.gpu.read_many_async`) take, for one GPU
buffer holding every layer at ``layer_stride`` bytes apart.  In the file, a
block's pieces lie together, one slot per block: layer by layer, K then V.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt

__all__ = ["vllm_block_pieces"]


def vllm_block_pieces(block_ids: npt.ArrayLike, num_layers: int, block_bytes: int, *,
                      layer_stride: int, kv: int = 2, kv_stride: int | None = None,
                      block_stride: int | None = None, file_slots: npt.ArrayLike | None = None,
                      file_base: int = 0
                      ) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64],
                                 npt.NDArray[np.int64]]:
    """``(file_offsets, gpu_offsets, lens)`` for ``block_ids`` x layers x K/V.

    GPU: piece (block ``b``, layer ``l``, half ``k``) starts at byte
    ``l * layer_stride + k * kv_stride + b * block_stride`` of the buffer
    (``block_stride`` defaults to ``block_bytes``; ``kv_stride`` to
    ``num_blocks_in_layer * block_stride``, which cannot be guessed: pass it
    when ``kv == 2``).  File: block ``i`` of ``block_ids`` goes to slot
    ``file_slots[i]`` (default ``i``) of ``num_layers * kv * block_bytes``
    bytes from ``file_base``, its pieces in (layer, half) order.  Pieces
    come block by block, so the file offsets ascend for ascending slots.
    Raises ValueError for negative or inconsistent arguments (a block id
    twice, two blocks sharing a slot); strides that make GPU places overlap
    are refused by the read calls themselves."""
    import numpy as np

    ids = np.ascontiguousarray(block_ids, dtype=np.int64).reshape(-1)
    if num_layers <= 0 or block_bytes <= 0 or kv not in (1, 2):
        raise ValueError("num_layers and block_bytes must be positive and kv 1 or 2")
    bstride = block_bytes if block_stride is None else int(block_stride)
    kstride = 0
    if kv == 2:
        if kv_stride is None:
            raise ValueError("kv=2 needs kv_stride (bytes from a layer's K to its V)")
        kstride = int(kv_stride)
    if layer_stride < 0 or bstride < block_bytes or (kv == 2 and kstride < block_bytes):
        raise ValueError("strides must leave room for a block (block_stride, kv_stride "
                         ">= block_bytes; layer_stride >= 0)")
    if ids.size and ids.min() < 0:
        raise ValueError("negative block id")
    if np.unique(ids).size != ids.size:
        raise ValueError("a block id appears twice")
    slots = (np.arange(ids.size, dtype=np.int64) if file_slots is None
             else np.ascontiguousarray(file_slots, dtype=np.int64).reshape(-1))
    if slots.shape != ids.shape:
        raise ValueError(f"{ids.size} block ids but {slots.size} file slots")
    if slots.size and (slots.min() < 0 or np.unique(slots).size != slots.size):
        raise ValueError("file slots must be distinct and non-negative")
    per_block = num_layers * kv
    layer = np.repeat(np.arange(num_layers, dtype=np.int64), kv)
    half = np.tile(np.arange(kv, dtype=np.int64), num_layers)
    gpu: npt.NDArray[Any] = (ids[:, None] * bstride + layer[None, :] * int(layer_stride)
                             + half[None, :] * kstride)
    fo: npt.NDArray[Any] = (int(file_base) + slots[:, None] * (per_block * block_bytes)
                            + np.arange(per_block, dtype=np.int64)[None, :] * block_bytes)
    lens = np.full(ids.size * per_block, block_bytes, dtype=np.int64)
    return (np.ascontiguousarray(fo.reshape(-1)), np.ascontiguousarray(gpu.reshape(-1)), lens)
