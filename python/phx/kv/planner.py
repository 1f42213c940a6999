"""Algorithm 1 of Dual-Blade: which layers' (K, V) pairs go to the page-cache path.

Given the knob X in [0, B_pc] and the per-layer pair sizes in layer order, the
first n1 layers whose pairs fit in X together are Group 1 (page cache, x_i = 1);
every later layer is Group 2 (direct path, x_i = 0).  Placement is by prefix, as in
the paper: a later small layer never jumps ahead of an earlier one that did not fit.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

PAGECACHE = 1   # Group 1
DIRECT = 2      # Group 2


@dataclass(frozen=True)
class Placement:
    """x_i for each layer, n1, and the bytes that went to each group."""
    groups: tuple[int, ...]
    n1: int
    knob: int
    group1_bytes: int
    group2_bytes: int


def place_layers(pair_bytes: Sequence[int], knob: int) -> Placement:
    """Algorithm 1: the longest prefix of layers whose (K, V) bytes sum to <= ``knob``."""
    knob = max(0, int(knob))
    used = 0
    n1 = 0
    for b in pair_bytes:
        if used + b > knob:
            break
        used += b
        n1 += 1
    groups = tuple(PAGECACHE if i < n1 else DIRECT for i in range(len(pair_bytes)))
    return Placement(groups, n1, knob, used, sum(pair_bytes) - used)


def cachepolicy_split(pair_bytes: Sequence[int], budget: int, tensor_bytes: int,
                      copy_threads: int, readahead: int) -> int:
    """CachePolicy-only's one definition (``phx bench kv`` and the FlexLLMGen
    runner both use it): how many leading layers keep their pages; every later
    layer's tensors are evicted (``POSIX_FADV_DONTNEED``) after each write to them.

    Every tensor still passes through the page cache on its way, so the budget
    leaves room for one tensor (page-rounded) plus the disk's readahead window in
    transit per copy thread; Algorithm 1 places the rest.
    """
    transit = copy_threads * ((tensor_bytes + 4095) // 4096 * 4096 + readahead)
    return place_layers(pair_bytes, budget - transit).n1


def readahead_bytes(path: str) -> int:
    """The readahead window of the disk holding ``path`` (128 KiB if unknown)."""
    import os
    try:
        dev = os.stat(path).st_dev
        p = f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}"
        for cand in (p + "/queue/read_ahead_kb", p + "/../queue/read_ahead_kb"):
            if os.path.exists(cand):
                with open(cand) as f:
                    return int(f.read()) * 1024
    except (OSError, ValueError):
        pass
    return 128 * 1024
