"""``PhxModelLoader``: vLLM's ``--load-format phx``.

``download_model`` makes sure the safetensors files are local (a directory
as given, else vLLM's own Hugging Face download of ``*.safetensors`` and the
index); ``load_weights`` feeds ``model.load_weights`` with
:func:`phx.loader.iter_tensors`: every header validated first, merged
contiguous O_DIRECT reads in file order, each tensor handed over once its
bytes are on the device the model's parameters live on (GPU: through
phx.gpu's bounded pinned staging; vLLM's weight loaders then copy or narrow
it into the parameter, so tensor parallelism works as with the default
loader, each rank reading whole tensors).

``--model-loader-extra-config`` keys: ``group_bytes`` and ``inflight_bytes``
(integers, see :func:`phx.loader.iter_tensors`), ``progress`` (bool, default:
vLLM's ``use_tqdm_on_load``), ``device`` (override the target device).
"""
from __future__ import annotations

import glob
import os
from collections.abc import Iterator

import torch
from torch import nn
from vllm.config import ModelConfig
from vllm.config.load import LoadConfig
from vllm.model_executor.model_loader import BaseModelLoader, register_model_loader

from phx import loader as phx_loader

_KEYS = {"group_bytes": int, "inflight_bytes": int, "progress": bool, "device": str}


@register_model_loader("phx")
class PhxModelLoader(BaseModelLoader):
    """Safetensors checkpoints through phx (O_DIRECT, GPU staging, validated)."""

    def __init__(self, load_config: LoadConfig):
        super().__init__(load_config)
        extra = load_config.model_loader_extra_config or {}
        if not isinstance(extra, dict):
            raise ValueError(f"model_loader_extra_config must be a dict for load format phx, "
                             f"got {type(extra).__name__}")
        bad = set(extra) - set(_KEYS)
        if bad:
            raise ValueError(f"unexpected model_loader_extra_config keys for load format "
                             f"phx: {sorted(bad)} (known: {sorted(_KEYS)})")
        for k, typ in _KEYS.items():
            if k in extra and not isinstance(extra[k], typ):
                raise ValueError(f"model_loader_extra_config[{k!r}] must be {typ.__name__}")
        self.extra = dict(extra)
        self._prepared = None           # create_model()'s head start on the staging

    def _folder(self, model_config: ModelConfig) -> str:
        path = model_config.model
        if os.path.isdir(path):
            return path
        from vllm.model_executor.model_loader.weight_utils import download_weights_from_hf
        return download_weights_from_hf(
            path, self.load_config.download_dir,
            ["*.safetensors", "*.safetensors.index.json"],
            revision=model_config.revision,
            ignore_patterns=self.load_config.ignore_patterns)

    def create_model(self, vllm_config, model_config: ModelConfig, prefix: str = ""):
        """vLLM's model construction, with phx's staging context made meanwhile
        on another thread (:func:`phx.loader.prepare`), so its start-up is not
        part of the load.  Best effort: a failure here is the load's to report."""
        device = (self.extra.get("device") or self.load_config.device
                  or vllm_config.device_config.device)
        try:
            self._prepared = phx_loader.prepare(device)
        except Exception:  # noqa: BLE001 - only a head start; load_weights says why
            self._prepared = None
        return super().create_model(vllm_config, model_config, prefix)

    def download_model(self, model_config: ModelConfig) -> None:
        folder = self._folder(model_config)
        if not glob.glob(os.path.join(folder, "*.safetensors")):
            raise RuntimeError(f"load format phx: no *.safetensors in {folder}")

    def _device(self, model: nn.Module) -> torch.device:
        if "device" in self.extra:
            return torch.device(self.extra["device"])
        for p in model.parameters():
            if p.device.type in ("cpu", "cuda"):
                return p.device
        return torch.device(self.load_config.device or "cpu")

    def weights(self, model_config: ModelConfig, device) -> Iterator[tuple[str, torch.Tensor]]:
        """The ``(name, tensor)`` iterator handed to ``model.load_weights``."""
        kw = {k: self.extra[k] for k in ("group_bytes", "inflight_bytes") if k in self.extra}
        return phx_loader.iter_tensors(
            self._folder(model_config), device,
            progress=self.extra.get("progress", bool(self.load_config.use_tqdm_on_load)),
            **kw)

    def load_weights(self, model: nn.Module, model_config: ModelConfig) -> None:
        loaded = model.load_weights(self.weights(model_config, self._device(model)))
        if loaded is not None and model_config.quantization is None:
            missing = {n for n, _ in model.named_parameters()} - set(loaded)
            if missing:
                raise ValueError("load format phx: weights not found in the checkpoint: "
                                 f"{sorted(missing)[:8]}")
