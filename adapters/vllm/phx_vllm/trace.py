"""Which bytes of each checkpoint tensor a model's ``load_weights`` keeps:
a dry run of the model's own loading code on meta tensors.

vLLM's weight loaders take each rank's part out of the checkpoint's whole
tensor themselves: a pipeline stage skips the layers it does not hold
(``is_pp_missing_parameter``), an expert-parallel rank the experts it does
not own, and tensor-parallel layers ``narrow`` the tensor along the
dimension their parameter declares (``output_dim`` / ``input_dim``, the
vocabulary shard of an embedding, the q/k/v shards of a fused projection).
Which slice that is depends on the layer class, the rank, the head counts,
the padding - knowledge that lives in the model's code.  So instead of
re-deriving it, :func:`trace_uses` runs ``model.load_weights`` once on
*meta* tensors of the checkpoint's names, shapes and dtypes (no data) under
a ``TorchFunctionMode`` that

* follows the views taken of each checkpoint tensor (``narrow``, basic
  indexing, ``select``, ``split``/``chunk``/``unbind``, transposes,
  ``contiguous``/``to``/``detach``), as index boxes of the original tensor;
* records, for any other use of such a view (the ``copy_`` into a parameter,
  arithmetic, a ``cat``), the box the view covers: those are the bytes the
  real load will read - an operation it cannot follow (``reshape``, fancy
  indexing) records the view's whole box, so it errs towards reading more;
* skips every write into a real (non-meta) tensor, so the model's
  parameters are not touched;
* answers ``.item()`` / ``.tolist()`` of a checkpoint tensor (a scalar
  filled into a parameter) with zeros after recording the whole tensor as
  used, so that the dry run goes on.

A tensor no use was recorded for is one the model does not load on this
rank.  Anything the dry run cannot do on meta tensors (a value read with
``.item()``, a device mix) raises :class:`TraceError`; the caller then reads
whole tensors.  The real load runs the same code on the same shapes, so it
takes the same slices.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

Box = tuple[tuple[int, int], ...]


class TraceError(RuntimeError):
    """The dry run could not follow the model's loading code."""


@dataclass
class Uses:
    """What the dry run saw of one checkpoint tensor: the boxes (index
    ranges of the original tensor) its uses covered."""
    shape: tuple[int, ...]
    boxes: list[Box] = field(default_factory=list)
    whole_because: str | None = None    # an operation that could not be followed

    @property
    def used(self) -> bool:
        return bool(self.boxes)


@dataclass
class _View:
    """A view of checkpoint tensor ``name``: ``box`` (start, stop) per
    dimension of the original; ``dims``: for each dimension of the view, the
    original dimension it runs along (None for an inserted size-1 one)."""
    name: str
    box: list[tuple[int, int]]
    dims: list[int | None]

    def full(self) -> Box:
        return tuple(self.box)


# operations whose result is the same elements (a copy or a dtype/device
# change): the view's box carries over unchanged
_SAME = {"contiguous", "clone", "detach", "float", "half", "bfloat16", "double", "int",
         "long", "short", "bool", "byte", "char", "to", "cpu", "cuda", "type", "type_as",
         "requires_grad_", "pin_memory"}
# getters that give the same elements
_SAME_ATTRS = {"data"}


def _name(func: Any) -> str:
    n = getattr(func, "__name__", "")
    if n in ("__get__", "__set__", "__delete__"):
        owner = getattr(func, "__self__", None)
        return f"{getattr(owner, '__name__', '?')}.{n}"
    return n.split(".")[0]      # OpOverload "copy_.default"


def _mutates(name: str, kwargs: dict[str, Any]) -> bool:
    if "." in name:                     # an attribute: "data.__set__" writes, a getter not
        return name.endswith((".__set__", ".__delete__"))
    if name in ("__setitem__", "set_"):
        return True
    if "out" in kwargs:
        return True
    return name.endswith("_") and not name.startswith("_")


def _flat(x: Any, out: list[torch.Tensor]) -> list[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        out.append(x)
    elif isinstance(x, (list, tuple)):
        for y in x:
            _flat(y, out)
    elif isinstance(x, dict):
        for y in x.values():
            _flat(y, out)
    return out


class _Tracer(TorchFunctionMode):
    def __init__(self, uses: dict[str, Uses]):
        super().__init__()
        self.uses = uses
        self.views: dict[int, tuple[torch.Tensor, _View]] = {}

    def track(self, t: torch.Tensor, v: _View) -> torch.Tensor:
        self.views[id(t)] = (t, v)      # the tensor is kept: its id stays unique
        return t

    def view_of(self, t: Any) -> _View | None:
        e = self.views.get(id(t)) if isinstance(t, torch.Tensor) else None
        return e[1] if e is not None and e[0] is t else None

    def use(self, v: _View, why: str | None = None) -> None:
        u = self.uses[v.name]
        u.boxes.append(v.full())
        if why and u.whole_because is None and v.full() == tuple((0, n) for n in u.shape):
            u.whole_because = why

    # -- views -------------------------------------------------------------

    def _narrowed(self, v: _View, d: int, start: int, stop: int) -> _View:
        box, dims = list(v.box), list(v.dims)
        od = dims[d]
        if od is not None:
            s = box[od][0]
            box[od] = (s + start, s + stop)
        return _View(v.name, box, dims)

    def _selected(self, v: _View, d: int, i: int) -> _View:
        w = self._narrowed(v, d, i, i + 1)
        w.dims.pop(d)
        return w

    def _index(self, v: _View, shape: tuple[int, ...], idx: Any) -> _View | None:
        """Basic indexing (ints, unit-step slices, ``...``, None) as a view."""
        items = idx if isinstance(idx, tuple) else (idx,)
        if any(not isinstance(i, (int, slice, type(None), type(Ellipsis))) or isinstance(i, bool)
               for i in items):
            return None
        if sum(i is Ellipsis for i in items) > 1:
            return None
        real = sum(1 for i in items if i is not None and i is not Ellipsis)
        if Ellipsis in items:
            k = items.index(Ellipsis)
            items = items[:k] + (slice(None),) * (len(shape) - real) + items[k + 1:]
        w = _View(v.name, list(v.box), list(v.dims))
        sizes = list(shape)
        d = 0
        for i in items:
            if i is None:
                w.dims.insert(d, None)
                sizes.insert(d, 1)
                d += 1
            elif isinstance(i, int):
                if d >= len(sizes):
                    return None
                n = sizes[d]
                j = i + n if i < 0 else i
                if not 0 <= j < n:
                    return None
                w = self._selected(w, d, j)
                sizes.pop(d)
            else:
                if d >= len(sizes):
                    return None
                start, stop, step = i.indices(sizes[d])
                if step != 1:
                    return None
                stop = max(start, stop)
                w = self._narrowed(w, d, start, stop)
                sizes[d] = stop - start
                d += 1
        return w

    def _view_result(self, name: str, v: _View, x: torch.Tensor, args: tuple[Any, ...],
                     kwargs: dict[str, Any]) -> tuple[Any, Any] | None:
        """(result, its views) for a view operation on ``x``, or None when
        ``name`` is not one that is followed."""
        nd = x.dim()

        def dim_arg(pos: int, key: str = "dim", default: int = 0) -> int:
            d = args[pos] if len(args) > pos else kwargs.get(key, default)
            return d % nd if nd else 0

        if name == "narrow":
            d = dim_arg(1)
            start = args[2] if len(args) > 2 else kwargs["start"]
            length = args[3] if len(args) > 3 else kwargs["length"]
            if isinstance(start, torch.Tensor):
                return None
            start = start + x.shape[d] if start < 0 else start
            return x.narrow(d, start, length), self._narrowed(v, d, start, start + length)
        if name == "select":
            d = dim_arg(1)
            i = args[2] if len(args) > 2 else kwargs["index"]
            i = i + x.shape[d] if i < 0 else i
            return x.select(d, i), self._selected(v, d, i)
        if name == "__getitem__":
            w = self._index(v, tuple(x.shape), args[1])
            return None if w is None else (x[args[1]], w)
        if name in ("split", "chunk", "tensor_split", "unbind", "split_with_sizes"):
            res = _call(name, x, args, kwargs)
            if name == "unbind":
                d = dim_arg(1)
                return res, [self._selected(v, d, i) for i in range(len(res))]
            key_pos = 2
            d = dim_arg(key_pos)
            out, at = [], 0
            for r in res:
                out.append(self._narrowed(v, d, at, at + r.shape[d]))
                at += r.shape[d]
            return res, out
        if name in ("t", "T.__get__") and nd <= 2:
            w = _View(v.name, list(v.box), list(reversed(v.dims)))
            return (x.t() if nd == 2 else x), w
        if name in ("transpose", "swapaxes", "swapdims"):
            a, b = dim_arg(1, "dim0"), dim_arg(2, "dim1")
            dims = list(v.dims)
            dims[a], dims[b] = dims[b], dims[a]
            return x.transpose(a, b), _View(v.name, list(v.box), dims)
        if name == "permute":
            order = args[1] if len(args) == 2 and isinstance(args[1], (list, tuple)) else args[1:]
            order = [o % nd for o in order]
            return x.permute(order), _View(v.name, list(v.box), [v.dims[o] for o in order])
        if name == "unsqueeze":
            d = (args[1] if len(args) > 1 else kwargs["dim"]) % (nd + 1)
            dims = list(v.dims)
            dims.insert(d, None)
            return x.unsqueeze(d), _View(v.name, list(v.box), dims)
        if name == "type" and len(args) < 2 and "dtype" not in kwargs:
            return None             # x.type(): the type's name, metadata
        if name in _SAME or name in (a + ".__get__" for a in _SAME_ATTRS):
            return _same(name, x, args, kwargs), _View(v.name, list(v.box), list(v.dims))
        return None

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        name = _name(func)
        tensors = _flat((args, kwargs), [])
        views = [(t, v) for t in tensors if (v := self.view_of(t)) is not None]
        if _mutates(name, kwargs):
            dest = kwargs.get("out", args[0] if args else None)
            if isinstance(dest, torch.Tensor) and not dest.is_meta:
                # a write into real memory (a parameter): what it reads is
                # recorded, the write itself is not done
                for t, v in views:
                    if t is not dest:
                        self.use(v)
                return dest
            for t, v in views:
                self.use(v, name)
            return func(*args, **kwargs)
        if not views:
            return func(*args, **kwargs)
        first: Any = args[0] if args else None
        v0 = self.view_of(first)
        if v0 is not None and name in ("item", "tolist"):
            # a value (a scalar scale filled into a parameter): the tensor is
            # read whole; the dry run goes on with zeros in its place
            self.use(v0, name)
            z = torch.zeros(first.shape, dtype=first.dtype)
            return z.item() if name == "item" else z.tolist()
        if v0 is not None and len(views) == 1:
            got = self._view_result(name, v0, first, args, kwargs)
            if got is not None:
                res, vs = got
                if isinstance(res, torch.Tensor):
                    return self.track(res, vs)
                return type(res)(self.track(r, w) for r, w in zip(res, vs))
        res = func(*args, **kwargs)
        if not _flat(res, []):
            return res              # metadata: a shape, a dtype, a size
        for t, v in views:
            self.use(v, name)
        return res


def _call(name: str, x: torch.Tensor, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    return getattr(torch.Tensor, name)(x, *args[1:], **kwargs)


def _same(name: str, x: torch.Tensor, args: tuple[Any, ...],
          kwargs: dict[str, Any]) -> torch.Tensor:
    """The result of a same-elements operation, kept on the meta device
    (a meta tensor cannot be moved to a real device)."""
    if name in (a + ".__get__" for a in _SAME_ATTRS) or name in ("cpu", "cuda", "pin_memory",
                                                                  "requires_grad_"):
        return torch.empty_like(x)
    dtype = kwargs.get("dtype")
    for a in args[1:]:
        if isinstance(a, torch.dtype):
            dtype = a
        elif isinstance(a, torch.Tensor):
            dtype = a.dtype
        elif isinstance(a, str) and name == "type" and a.startswith("torch."):
            dtype = getattr(torch, a.rsplit(".", 1)[1].replace("Tensor", "").lower(), None)
    named = {"float": torch.float32, "half": torch.float16, "bfloat16": torch.bfloat16,
             "double": torch.float64, "int": torch.int32, "long": torch.int64,
             "short": torch.int16, "bool": torch.bool, "byte": torch.uint8, "char": torch.int8}
    dtype = named.get(name, dtype)
    return torch.empty_like(x, dtype=dtype if isinstance(dtype, torch.dtype) else x.dtype)


def _state(model: torch.nn.Module) -> list[tuple[str, int, int]]:
    out = []
    for n, p in list(model.named_parameters()) + list(model.named_buffers()):
        out.append((n, id(p), p.data_ptr() if not p.is_meta else -1))
    return out


def trace_uses(load_weights: Callable[[Iterable[tuple[str, torch.Tensor]]], Any],
               model: torch.nn.Module,
               tensors: Iterable[tuple[str, tuple[int, ...], torch.dtype]]) -> dict[str, Uses]:
    """Run ``load_weights`` (the model's own) on meta tensors ``(name,
    shape, dtype)`` and return what it used of each.  Raises
    :class:`TraceError` when the dry run fails or would have changed the
    model."""
    specs = list(tensors)
    uses = {n: Uses(tuple(s)) for n, s, _ in specs}
    before = _state(model)
    mode = _Tracer(uses)

    def feed() -> Iterator[tuple[str, torch.Tensor]]:
        for n, s, dt in specs:
            t = torch.empty(s, dtype=dt, device="meta")
            yield n, mode.track(t, _View(n, [(0, k) for k in s], list(range(len(s)))))
    try:
        with mode:
            load_weights(feed())
    except Exception as e:  # noqa: BLE001 - any failure means: read whole tensors
        raise TraceError(f"{type(e).__name__}: {e}") from e
    finally:
        mode.views.clear()
    if _state(model) != before:
        raise TraceError("the dry run changed the model's parameters or buffers")
    return uses
