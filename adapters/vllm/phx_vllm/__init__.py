"""vLLM plugin: ``--load-format phx`` loads safetensors weights with phx.loader.

vLLM calls :func:`register` in every process it starts (the
``vllm.general_plugins`` entry point ``phx`` of the phx package), possibly
several times; registering is idempotent.  The loader class lives in
:mod:`phx_vllm.loader`, imported only here, so that importing this package
never needs vLLM.  With ``PHX_FASTSAFETENSORS=1`` it also puts phx's
fastsafetensors copier under fastsafetensors' own copier names, so that
``--load-format fastsafetensors`` reads through phx (phx_fastsafetensors).
"""
from __future__ import annotations

import os

_registered = False


def register() -> None:
    """Register the ``phx`` load format with vLLM (once per process)."""
    global _registered
    if _registered:
        return
    from phx_vllm import loader  # noqa: F401  (the decorator registers the class)
    if os.environ.get("PHX_FASTSAFETENSORS", "") not in ("", "0"):
        import phx_fastsafetensors
        phx_fastsafetensors.replace()
    _registered = True
