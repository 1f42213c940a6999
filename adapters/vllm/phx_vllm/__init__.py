"""vLLM plugin: ``--load-format phx`` loads safetensors weights with phx.loader.

vLLM calls :func:`register` in every process it starts (the
``vllm.general_plugins`` entry point ``phx`` of the phx package), possibly
several times, whatever the load format; registering is idempotent and never
raises: a plugin must not take vLLM down.  If the loader cannot be imported
(a vLLM version it does not fit, phx's extension missing), the error is
logged and ``phx`` is registered as a loader that fails with that error when
it is used, so ``--load-format phx`` says why and every other load format is
untouched.  The loader class lives in :mod:`phx_vllm.loader`, imported only
here, so that importing this package never needs vLLM.  With
``PHX_FASTSAFETENSORS=1`` it also puts phx's fastsafetensors copier under
fastsafetensors' own copier names, so that ``--load-format fastsafetensors``
reads through phx (phx_fastsafetensors); if that cannot be done (e.g.
fastsafetensors is not installed) it is logged and fastsafetensors is left
as it is.
"""
from __future__ import annotations

import logging
import os
from typing import Any

# a child of vLLM's logger: its handlers and level apply
logger = logging.getLogger("vllm.phx_vllm")

_registered = False


def _register_unavailable(err: BaseException) -> None:
    """Register ``phx`` as a loader that raises ``err``'s story when used."""
    try:
        from vllm.model_executor.model_loader import BaseModelLoader, register_model_loader
    except Exception as e:  # noqa: BLE001 - vLLM itself is not importable: nothing to do
        logger.warning("phx: cannot register load format phx either: %s", e)
        return
    why = f"{type(err).__name__}: {err}"

    @register_model_loader("phx")
    class PhxUnavailable(BaseModelLoader):  # type: ignore[misc]  # vLLM is untyped here
        """Stands in for PhxModelLoader when it could not be imported."""

        def __init__(self, load_config: Any) -> None:
            raise RuntimeError(f"load format phx is not available in this process: {why} "
                               "(see the phx warning logged at plugin load)")

        def download_model(self, model_config: Any) -> None:  # pragma: no cover - never constructed
            raise NotImplementedError

        def load_weights(self, model: Any, model_config: Any) -> None:  # pragma: no cover
            raise NotImplementedError


def wants_fastsafetensors() -> bool:
    """PHX_FASTSAFETENSORS: 1 puts phx's copier under fastsafetensors; unset, empty
    or 0 does not.  Any other value is logged as an error naming the variable
    and taken as off: a setting phx cannot read is said, never guessed, and a
    vLLM plugin must not raise."""
    setting = os.environ.get("PHX_FASTSAFETENSORS", "")
    if setting not in ("", "0", "1"):
        logger.error("phx: PHX_FASTSAFETENSORS=%r is not 0 or 1: phx's fastsafetensors "
                     "copier is NOT put in place", setting)
    return setting == "1"


def register() -> None:
    """Register the ``phx`` load format with vLLM (once per process); never raises."""
    global _registered
    if _registered:
        return
    _registered = True
    try:
        from phx_vllm import loader  # noqa: F401  (the decorator registers the class)
    except Exception as e:  # noqa: BLE001 - logged; --load-format phx will say it
        logger.warning("phx: the vLLM loader could not be imported, --load-format phx is "
                       "unavailable: %s: %s", type(e).__name__, e, exc_info=True)
        _register_unavailable(e)
    if wants_fastsafetensors():
        try:
            import phx_fastsafetensors
            phx_fastsafetensors.replace()
        except Exception as e:  # noqa: BLE001 - logged; fastsafetensors is left alone
            logger.warning("phx: PHX_FASTSAFETENSORS=1 is not in effect: %s: %s "
                           "(--load-format fastsafetensors reads with its own copier, if "
                           "it is installed)", type(e).__name__, e)
