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
* A :class:`Partial` keeps the tensor's full shape but reads only some
  boxes of it (index ranges per dimension): the other bytes of its target
  are left unread.  This is for consumers that narrow the tensor themselves
  (vLLM's weight loaders take a tensor-parallel rank's rows or columns out of
  the checkpoint's whole tensor): they get the shape they expect, and only
  what they will copy is read.
"""
from __future__ import annotations

import itertools
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


#: index ranges, one ``(start, stop)`` per dimension of a tensor
Box = tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class Partial:
    """Read only ``boxes`` of a tensor; it keeps its full shape and the bytes
    outside every box are left unread (undefined: whatever the allocation
    held).  Only for consumers that touch nothing else."""
    boxes: tuple[Box, ...]


#: name, shape -> the slice or the boxes to read, or None for the whole tensor
Sharder = Callable[[str, tuple[int, ...]], "Slice | Partial | None"]


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


def box_runs(t: TensorInfo, box: Box) -> list[tuple[int, int]]:
    """The byte runs ``(offset in the tensor, size)`` of ``box`` of ``t``
    (row-major), in order, contiguous runs merged."""
    shape = t.shape
    if len(box) != len(shape) or not all(0 <= a <= b <= n for (a, b), n in zip(box, shape)):
        raise ValueError(f"tensor {t.name!r} {shape}: box {box} is not inside it")
    if any(a == b for a, b in box):
        return []
    # the innermost dimension that the box does not span whole: a run is
    # that dimension's range times everything inside it
    k = len(shape) - 1
    while k >= 0 and box[k] == (0, shape[k]):
        k -= 1
    if k < 0:
        return [(0, t.nbytes)]
    inner = math.prod(shape[k + 1:]) * t.itemsize
    strides = [math.prod(shape[d + 1:]) * t.itemsize for d in range(len(shape))]
    run = (box[k][1] - box[k][0]) * inner
    runs: list[tuple[int, int]] = []
    for idx in itertools.product(*(range(a, b) for a, b in box[:k])):
        off = sum(i * st for i, st in zip(idx, strides)) + box[k][0] * inner
        if runs and runs[-1][0] + runs[-1][1] == off:
            runs[-1] = (runs[-1][0], runs[-1][1] + run)
        else:
            runs.append((off, run))
    return runs


def merge_runs(runs: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    """Union of byte runs ``(offset, size)``: sorted, overlapping and touching ones merged."""
    out: list[tuple[int, int]] = []
    for off, n in sorted(r for r in runs if r[1] > 0):
        if out and off <= out[-1][0] + out[-1][1]:
            end = max(out[-1][0] + out[-1][1], off + n)
            out[-1] = (out[-1][0], end - out[-1][0])
        else:
            out.append((off, n))
    return out


def _slice_job(t: TensorInfo, s: Slice) -> Job:
    """A target of just the slice, packed in file order."""
    shape = slice_shape(t, s)
    dim = s.dim % len(t.shape)
    part = shape[dim]
    box = tuple((0, n) if d != dim else (s.rank * part, (s.rank + 1) * part)
                for d, n in enumerate(t.shape))
    runs = box_runs(t, box)
    pieces: list[tuple[int, int, int]] = []
    at = 0
    for off, size in runs:
        pieces.append((t.start + off, at, size))
        at += size
    first = t.start + (runs[0][0] if runs else 0)
    return Job(t.path, at, first, pieces, [Output(t.name, t.dtype, shape, 0, at, t)])


def _partial_job(t: TensorInfo, p: Partial) -> Job:
    """A target of the whole tensor, of which only ``p``'s boxes are read."""
    runs = merge_runs(r for b in p.boxes for r in box_runs(t, b))
    pieces = [(t.start + off, off, size) for off, size in runs]
    return Job(t.path, t.nbytes, t.start, pieces, [Output(t.name, t.dtype, t.shape, 0, t.nbytes, t)])


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
            if isinstance(s, Partial) and merge_runs(
                    r for b in s.boxes for r in box_runs(t, b)) == [(0, t.nbytes)]:
                s = None        # the boxes cover it all: an ordinary, mergeable read
            if s is not None:
                flush()
                jobs.append(_partial_job(t, s) if isinstance(s, Partial) else _slice_job(t, s))
                continue
            if run and (t.start != max(r.end for r in run)
                        or t.end - run[0].start > group_bytes):
                flush()
            run.append(t)
        flush()
    return jobs
