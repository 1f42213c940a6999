"""phx_vllm.trace, the dry run that tells which boxes of each checkpoint
tensor a model's loading code copies (torch only, no vLLM): views it
follows (narrow, basic indexing, select, split/chunk, transposes, dtype and
device moves) give the exact box, anything else the whole view; tensors
never used are reported unused; real parameters are never written; what it
cannot run on meta tensors raises TraceError."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from phx_vllm.trace import TraceError, trace_uses  # noqa: E402


def run(body, shapes, model=None):
    """Trace ``body(params, name, tensor)`` over meta tensors of ``shapes``."""
    model = model or torch.nn.Module()
    dst = torch.zeros(64, 64)

    def load(weights):
        for name, t in weights:
            body(dst, name, t)
    return trace_uses(load, model, [(n, s, torch.float32) for n, s in shapes.items()])


def boxes(u):
    return sorted(set(u.boxes))


def test_views_give_exact_boxes():
    def body(dst, name, t):
        if name == "narrow":
            dst[:4, :10].copy_(t.narrow(0, 4, 4).narrow(1, 20, 10))
        elif name == "index":
            dst[0, :5].copy_(t[2, 3:8])
        elif name == "transposed":
            dst[:3, :2].copy_(t.t()[1:4, 5:7])
        elif name == "select":
            dst[0, :6].copy_(t.select(0, -2))
        elif name == "split":
            a, b = t.split([3, 5], dim=1)
            dst[:2, :5].copy_(b.to(torch.float16))
        elif name == "chunk":
            dst[:16].copy_(t.chunk(2)[1].contiguous().cpu())
        elif name == "ellipsis":
            dst[:2, :4].copy_(t[..., 1, :])
    u = run(body, {"narrow": (16, 40), "index": (4, 8), "transposed": (8, 6),
                   "select": (4, 6), "split": (2, 8),
                   "chunk": (32, 64), "ellipsis": (2, 3, 4)})
    assert boxes(u["narrow"]) == [((4, 8), (20, 30))]
    assert boxes(u["index"]) == [((2, 3), (3, 8))]
    assert boxes(u["transposed"]) == [((5, 7), (1, 4))]        # rows/cols swapped back
    assert boxes(u["select"]) == [((2, 3), (0, 6))]
    assert boxes(u["split"]) == [((0, 2), (3, 8))]
    assert boxes(u["chunk"]) == [((16, 32), (0, 64))]
    assert boxes(u["ellipsis"]) == [((0, 2), (1, 2), (0, 4))]


def test_unfollowed_ops_read_the_whole_view_and_unused_tensors_are_reported():
    def body(dst, name, t):
        if name == "reshaped":
            dst[:8].copy_(t.narrow(0, 2, 4).reshape(8, 8))   # the narrowed rows, reshaped
        elif name == "fancy":
            dst[:2].copy_(t[torch.tensor([0, 3])])
        elif name == "math":
            dst[:4, :4].copy_(t.narrow(1, 0, 4) * 2)
    u = run(body, {"reshaped": (8, 16), "fancy": (4, 64), "math": (4, 8), "unused": (3, 3)})
    assert boxes(u["reshaped"]) == [((2, 6), (0, 16))]
    assert boxes(u["fancy"]) == [((0, 4), (0, 64))] and u["fancy"].whole_because
    assert boxes(u["math"]) == [((0, 4), (0, 4))]
    assert not u["unused"].used


def test_parameters_are_not_written_and_item_reads_whole():
    model = torch.nn.Linear(4, 4)
    before = model.weight.detach().clone()

    def body(dst, name, t):
        model.weight.data.copy_(t)
        model.weight.data.fill_(t.item() if name == "scalar" else 0.0)
        model.weight.data[1:] = 5.0
    u = run(body, {"w": (4, 4), "scalar": ()}, model)
    assert torch.equal(model.weight.detach(), before)
    assert boxes(u["w"]) == [((0, 4), (0, 4))]
    assert u["scalar"].used


def test_what_cannot_run_on_meta_raises():
    def body(dst, name, t):
        if bool(t.sum() > 0):           # a decision on the values
            dst.copy_(t)
    with pytest.raises(TraceError):
        run(body, {"w": (64, 64)})
