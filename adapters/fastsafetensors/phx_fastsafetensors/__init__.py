"""A fastsafetensors copier backed by phx (fastsafetensors >= 0.5).

fastsafetensors builds a copier per file from a factory registered under a
copier type name.  :func:`register` adds the type ``"phx"`` (use it with
``BaseSafeTensorsFileLoader(pg, device, copier_type="phx")``);
:func:`replace` also puts phx's factory under ``"nogds"`` and ``"gds"``, so
code that only picks fastsafetensors' own copiers - vLLM's ``--load-format
fastsafetensors`` among them - reads through phx without a change.  The vLLM
plugin of this package (``phx_vllm``) calls :func:`replace` in every vLLM
process when ``PHX_FASTSAFETENSORS=1`` is set: the one setting.

Reads: O_DIRECT through phx's engine, straight into the device buffer
fastsafetensors allocated (GPU: ``phx.gpu.read_chunks_async``, staged through
phx's bounded pinned buffers; host: ``File.pread_many``).
"""
from __future__ import annotations

_done: set[str] = set()


def register(*names: str) -> None:
    """Register phx's copier factory under ``names`` (default ``"phx"``);
    idempotent.  Raises ImportError saying so when fastsafetensors (0.5) is
    not installed: importing this package never needs it."""
    try:
        import fastsafetensors  # noqa: F401
    except ImportError as e:
        raise ImportError(f"phx_fastsafetensors: fastsafetensors is not installed ({e}); "
                          "pip install 'fastsafetensors>=0.5' to use phx's copier") from e
    from phx_fastsafetensors.copier import factory_for, note_identities
    note_identities()
    for name in names or ("phx",):
        if name not in _done:
            factory_for(name)
            _done.add(name)


def replace() -> None:
    """Register phx as ``"phx"``, ``"nogds"`` and ``"gds"`` (fastsafetensors'
    own types, so existing callers get phx)."""
    register("phx", "nogds", "gds")
