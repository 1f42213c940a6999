"""Read plans: which file ranges go to which place of which target buffer.

A plan is a list of :class:`Job` in file order.  A job is one target
allocation (host or GPU memory that becomes the tensors' final memory),
the file ranges read into it (``pieces``: file offset, offset in the
target, size) and the tensors that are views of it (``outputs``).

* Tensors that lie next to each other in a file are merged into one job of
  at most ``group_bytes`` (a larger tensor is a job of its own): one
  contiguous read, as few requests as the file allows.
* A tensor-parallel slice (:class:`Slice`: ``dim``, ``rank``,
  ``world_size``) is a job of its own that reads only the slice: one range
  when the slice is contiguous in the file (``dim`` 0, or every dimension
  before it of size 1), else one range per outer index (a column slice of a
  matrix: one piece per row).
"""
from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from phx.loader.format import TensorInfo


@dataclass(frozen=True)
class Slice:
    """Rank ``rank`` of ``world_size`` equal parts of a tensor along ``dim``."""
    dim: int
    rank: int
    world_size: int


#: name, shape -> the slice to read, or None for the whole tensor
Sharder = Callable[[str, tuple[int, ...]], "Slice | None"]


def tp_sharder(rank: int, world_size: int, rules: Mapping[str, int]) -> Sharder:
    """A :data:`Sharder` that slices tensors whose name matches a regular
    expression of ``rules`` (``re.search``; first match wins) along its dim;
    other tensors are read whole.  E.g. ``{r"(q|k|v|gate|up)_proj\\.weight$": 0,
    r"(o|down)_proj\\.weight$": 1}`` (column- and row-parallel linears)."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in [0, {world_size})")
    compiled = [(re.compile(p), d) for p, d in rules.items()]

    def shard(name: str, shape: tuple[int, ...]) -> Slice | None:
        for rx, dim in compiled:
            if rx.search(name):
                return Slice(dim, rank, world_size)
        return None
    return shard


@dataclass
class Output:
    """A tensor that is a view of its job's target at ``offset``."""
    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int
    info: TensorInfo


@dataclass
class Job:
    path: str
    nbytes: int                            # the target's size
    align_offset: int                      # a file offset the target should be congruent to
    pieces: list[tuple[int, int, int]]     # (file offset, target offset, size)
    outputs: list[Output]

    @property
    def read_bytes(self) -> int:
        return sum(p[2] for p in self.pieces)


def slice_shape(t: TensorInfo, s: Slice) -> tuple[int, ...]:
    """The shape of ``s`` of ``t`` (checked: in range, divisible)."""
    nd = len(t.shape)
    if not -nd <= s.dim < nd:
        raise ValueError(f"tensor {t.name!r} {t.shape}: no dim {s.dim} to slice")
    if not 0 <= s.rank < s.world_size:
        raise ValueError(f"tensor {t.name!r}: rank {s.rank} not in [0, {s.world_size})")
    dim = s.dim % nd
    if t.shape[dim] % s.world_size:
        raise ValueError(f"tensor {t.name!r} {t.shape}: dim {dim} ({t.shape[dim]}) does not "
                         f"divide into {s.world_size} equal parts")
    return t.shape[:dim] + (t.shape[dim] // s.world_size,) + t.shape[dim + 1:]


def _slice_job(t: TensorInfo, s: Slice) -> Job:
    shape = slice_shape(t, s)
    dim = s.dim % len(t.shape)
    inner = math.prod(t.shape[dim + 1:]) * t.itemsize     # bytes per index of dim
    outer = math.prod(t.shape[:dim])
    part = shape[dim] * inner                              # bytes per outer index
    first = t.start + s.rank * part
    stride = t.shape[dim] * inner
    pieces: list[tuple[int, int, int]] = []
    for o in range(outer):
        fo, bo = first + o * stride, o * part
        if pieces and pieces[-1][0] + pieces[-1][2] == fo:   # contiguous: merge
            p = pieces[-1]
            pieces[-1] = (p[0], p[1], p[2] + part)
        elif part:
            pieces.append((fo, bo, part))
    n = outer * part
    return Job(t.path, n, first, pieces, [Output(t.name, t.dtype, shape, 0, n, t)])


def plan(tensors: Iterable[TensorInfo], group_bytes: int = 256 << 20,
         shard: Sharder | None = None) -> list[Job]:
    """Jobs for ``tensors`` in file order (files in the order given)."""
    by_file: dict[str, list[TensorInfo]] = {}
    for t in tensors:
        by_file.setdefault(t.path, []).append(t)
    jobs: list[Job] = []
    for path, ts in by_file.items():
        ts.sort(key=lambda t: (t.start, t.end))
        run: list[TensorInfo] = []

        def flush() -> None:
            if not run:
                return
            start, end = run[0].start, max(t.end for t in run)
            outs = [Output(t.name, t.dtype, t.shape, t.start - start, t.nbytes, t) for t in run]
            pieces = [(start, 0, end - start)] if end > start else []
            jobs.append(Job(path, end - start, start, pieces, outs))
            run.clear()

        for t in ts:
            s = shard(t.name, t.shape) if shard is not None and t.shape else None
            if s is not None:
                flush()
                jobs.append(_slice_job(t, s))
                continue
            if run and (t.start != max(r.end for r in run)
                        or t.end - run[0].start > group_bytes):
                flush()
            run.append(t)
        flush()
    return jobs
