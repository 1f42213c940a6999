"""phx.kv: dual-path KV-cache residency (Dual-Blade) on phx.

- :class:`KVStore`: per-layer K/V tensors, placed by Algorithm 1 on the page-cache
  path (Group 1) or the direct O_DIRECT slab path (Group 2);
- :func:`measure_budget`: the page-cache budget from MemAvailable and the cgroup;
- :func:`place_layers`: Algorithm 1;
- :class:`ExtentAllocator`, :class:`SlabBackend`, :class:`DirectBackend`: sequential
  extents and the direct backend interface;
- :class:`AdaptivePipeline`: Overlap-Intra / Overlap-Cross selection;
- :class:`RelayPool`, :class:`Relay`: the Co-DMA relays (pinned, CUDA- and
  io_uring-registered, one CUDA stream each) through which CUDA tensors move.

See docs/kv.md.
"""
from phx.kv.budget import Budget, cgroup_memory, measure_budget, parse_proc_cgroup
from phx.kv.codma import CudaError, Relay, RelayPool
from phx.kv.pipeline import CROSS, INTRA, AdaptivePipeline, CopyJob
from phx.kv.planner import DIRECT, PAGECACHE, Placement, place_layers
from phx.kv.slab import (DirectBackend, Extent, ExtentAllocator, MemoryBackend,
                         PageCacheBackend, SlabBackend)
from phx.kv.store import KVStore, KVTensor, Plan

__all__ = [
    "AdaptivePipeline", "Budget", "CROSS", "CopyJob", "CudaError", "DIRECT", "DirectBackend", "Extent",
    "ExtentAllocator", "INTRA", "KVStore", "MemoryBackend", "KVTensor", "PAGECACHE", "PageCacheBackend",
    "Placement", "Plan", "Relay", "RelayPool", "SlabBackend", "cgroup_memory", "measure_budget",
    "parse_proc_cgroup", "place_layers",
]
