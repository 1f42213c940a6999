"""``PhxModelLoader``: vLLM's ``--load-format phx``.

Built on vLLM's ``DefaultModelLoader``, so everything it does around the
reads stays vLLM's own: which files (``*.safetensors``, filtered by the
index; a model's ``allow_patterns_overrides``; sub-folder sources and
``secondary_weights``; the ``--mm-encoder-only`` and ``is_unused_weight``
shard filters), the expert-parallel filter (non-local experts are not
read), the "Loading weights took" log, strict weight tracking, and
``get_all_weights`` for ``reload_weights``.  Only the reading is phx's
(:func:`phx.loader.iter_tensors`): every header of every file validated
first, the data from the same files or a ``CheckpointError``, merged O_DIRECT
reads (buffered for files already in the page cache), GPU targets staged
through phx.gpu's bounded pinned buffers.

Each rank reads its part.  Before the load, the model's own
``load_weights`` is run once on meta tensors (:mod:`phx_vllm.trace`): the
tensors it never touches (another pipeline stage's layers, another rank's
experts, tied or unused weights) are not read at all, and of a tensor its
weight loader narrows (a tensor-parallel rank's rows or columns, a
vocabulary shard, a q/k/v head range) only what it copies is read; it gets
a tensor of the checkpoint's full shape, whose other bytes are left unread
(:class:`phx.loader.Partial`).  Where the dry run cannot follow the code (a
quantized model, an operation on the tensor it cannot trace, a reload,
``slices: false``), whole tensors are read and the log says so.

``--model-loader-extra-config`` keys: ``group_bytes`` and ``inflight_bytes``
(int, :func:`phx.loader.iter_tensors`), ``progress`` (bool, default vLLM's
``use_tqdm_on_load``), ``device`` (str, overrides the target device),
``slices`` (bool, default true: read per rank), ``cached`` ("auto",
"always", "never": page cache for warm files), and vLLM's own
``enable_weights_track``.
"""
from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any, cast

import torch
from torch import nn
from vllm.config import ModelConfig
from vllm.config.load import LoadConfig
from vllm.model_executor.model_loader import DefaultModelLoader, register_model_loader
from vllm.model_executor.model_loader.ep_weight_filter import should_skip_weight
from vllm.model_executor.model_loader.weight_utils import (
    filter_mm_encoder_only_safetensors_files, filter_safetensors_files_by_weight_name)

from phx import loader as phx_loader
from phx.futures import PoolFuture
from phx.loader.plan import box_runs, merge_runs
from phx_vllm.trace import TraceError, Uses, trace_uses

# under vLLM's logger, so that its handlers and level apply (a logger named
# after this module would propagate to the unconfigured root and be dropped)
logger = logging.getLogger("vllm.phx_vllm.loader")

_KEYS = {"group_bytes": int, "inflight_bytes": int, "progress": bool, "device": str,
         "slices": bool, "cached": str}
#: DefaultModelLoader's keys that still mean something here
_VLLM_KEYS = {"enable_weights_track"}


def _torch_dtype(safetensors_dtype: str) -> torch.dtype:
    dt: torch.dtype = getattr(torch, phx_loader.DTYPES[safetensors_dtype][1])
    return dt


@dataclasses.dataclass
class SourcePlan:
    """What one weight source (the model's files, or a secondary source) is
    read as on this rank."""
    source: DefaultModelLoader.Source
    checkpoint: phx_loader.Checkpoint
    names: list[str]                                     # read, in checkpoint names
    partial: dict[str, phx_loader.Partial]               # of those, read in part
    skipped: int = 0                                     # not needed on this rank
    #: tensors read whole because the loading code used them through an
    #: operation the dry run does not follow: name -> that operation
    whole: dict[str, str] = dataclasses.field(default_factory=dict)

    def read_bytes(self) -> int:
        total = 0
        for n in self.names:
            t = self.checkpoint.tensors[n]
            p = self.partial.get(n)
            if p is None:
                total += t.nbytes
            else:
                runs = merge_runs(r for b in p.boxes for r in box_runs(t, b))
                total += sum(size for _, size in runs)
        return total


@register_model_loader("phx")
class PhxModelLoader(DefaultModelLoader):  # type: ignore[misc]  # vLLM is untyped here
    """Safetensors checkpoints through phx, each rank reading its part."""

    counter_before_loading_weights: float     # DefaultModelLoader's

    def __init__(self, load_config: LoadConfig):
        extra = load_config.model_loader_extra_config or {}
        if not isinstance(extra, dict):
            raise ValueError(f"model_loader_extra_config must be a dict for load format phx, "
                             f"got {type(extra).__name__}")
        bad = set(extra) - set(_KEYS) - _VLLM_KEYS
        if bad:
            raise ValueError(f"unexpected model_loader_extra_config keys for load format "
                             f"phx: {sorted(bad)} (known: {sorted(set(_KEYS) | _VLLM_KEYS)})")
        for k, typ in _KEYS.items():
            if k in extra and not isinstance(extra[k], typ):
                raise ValueError(f"model_loader_extra_config[{k!r}] must be {typ.__name__}")
        if extra.get("cached", "auto") not in ("auto", "always", "never"):
            raise ValueError("model_loader_extra_config['cached'] must be auto, always or never")
        # DefaultModelLoader knows the safetensors format, not "phx", and
        # refuses keys it does not know: it is given a safetensors view of
        # the config; self.load_config stays the real one
        self._st_config = dataclasses.replace(
            load_config, load_format="safetensors",
            model_loader_extra_config={k: v for k, v in extra.items() if k in _VLLM_KEYS})
        super().__init__(self._st_config)
        self.load_config = load_config
        self.extra = {k: v for k, v in extra.items() if k in _KEYS}
        # create_model()'s head start on the staging
        self._prepared: PoolFuture | None = None
        self._slicing = False           # set while load_weights runs (not for a reload)
        self.plans: list[SourcePlan] = []
        self.stats: list[phx_loader.LoadStats] = []

    # -- vLLM's DefaultModelLoader, with the safetensors view of the config --

    def _prepare_weights(self, *args: Any, **kwargs: Any) -> Any:
        real, self.load_config = self.load_config, self._st_config
        try:
            return super()._prepare_weights(*args, **kwargs)
        finally:
            self.load_config = real

    def create_model(self, vllm_config: Any, model_config: ModelConfig, prefix: str = "") -> Any:
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

    def load_weights(self, model: nn.Module, model_config: ModelConfig) -> None:
        """DefaultModelLoader's (filters, log, weight tracking), reading per rank."""
        self._slicing = self.extra.get("slices", True)
        try:
            super().load_weights(model, model_config)
        finally:
            self._slicing = False

    # -- the files and what this rank reads of them ------------------------

    def _sources(self, model_config: ModelConfig, model: nn.Module
                 ) -> list[DefaultModelLoader.Source]:
        primary = DefaultModelLoader.Source(
            model_config.model, model_config.revision, prefix="",
            fall_back_to_pt=getattr(model, "fall_back_to_pt_during_load", True),
            allow_patterns_overrides=getattr(model, "allow_patterns_overrides", None),
            is_unused_weight=getattr(model, "is_unused_checkpoint_weight", None))
        secondary = cast(Iterable[DefaultModelLoader.Source],
                         getattr(model, "secondary_weights", ()))
        return [primary, *secondary]

    def _files(self, source: DefaultModelLoader.Source) -> list[str]:
        """The safetensors files of ``source``, filtered as DefaultModelLoader does."""
        folder, files, use_st, index_file = self._prepare_weights(
            source.model_or_path, source.subfolder, source.revision, source.fall_back_to_pt,
            source.allow_patterns_overrides)
        if not use_st:
            raise RuntimeError(f"load format phx reads safetensors checkpoints; "
                               f"{source.model_or_path} has none")
        if self._encoder_only_lm_prefixes is not None and files:
            files = filter_mm_encoder_only_safetensors_files(
                files, folder, index_file, self._encoder_only_lm_prefixes,
                weights_mapper=self._encoder_only_weights_mapper)
            if not files:
                raise RuntimeError("mm-encoder-only shard filter removed all weight files for "
                                   f"{source.model_or_path!r}")
        if source.is_unused_weight is not None:
            files = filter_safetensors_files_by_weight_name(files, source.is_unused_weight)
        return sorted(files)

    def plan(self, model_config: ModelConfig, model: nn.Module) -> list[SourcePlan]:
        """Open and validate every source's headers, and decide what this
        rank reads of each tensor."""
        plans = []
        for src in self._sources(model_config, model):
            ck = phx_loader.open_checkpoint(self._files(src))
            names = [n for n in ck.tensors
                     if not should_skip_weight(n, self.local_expert_ids)
                     and not (src.is_unused_weight is not None and src.is_unused_weight(n))]
            plans.append(SourcePlan(src, ck, names, {}, len(ck.tensors) - len(names)))
        why = self._why_whole(model_config)
        if why is None:
            specs = [(p.source.prefix + n, p.checkpoint.tensors[n].shape,
                      _torch_dtype(p.checkpoint.tensors[n].dtype))
                     for p in plans for n in p.names]
            try:
                load = cast("Callable[[Iterable[tuple[str, torch.Tensor]]], Any]",
                            model.load_weights)
                uses = trace_uses(load, model, specs)
            except TraceError as e:
                why = f"the dry run of the model's load_weights failed ({e})"
            else:
                self._apply(plans, uses)
        self._log_plan(plans, why)
        return plans

    def _why_whole(self, model_config: ModelConfig) -> str | None:
        if not self._slicing:
            return ("reload_weights: the model is in its loaded (kernel) form, so the slices "
                    "its weight loaders take are not known before the reload")
        if model_config.quantization is not None:
            return (f"quantized model ({model_config.quantization}): its weight loaders may "
                    "keep state, so they are not dry-run")
        return None

    @staticmethod
    def _apply(plans: list[SourcePlan], uses: dict[str, Uses]) -> None:
        for p in plans:
            keep, partial = [], {}
            for n in p.names:
                u = uses[p.source.prefix + n]
                if not u.used:
                    continue
                keep.append(n)
                t = p.checkpoint.tensors[n]
                boxes = tuple(dict.fromkeys(u.boxes))
                covered = merge_runs(r for b in boxes for r in box_runs(t, b))
                if u.whole_because:
                    p.whole[n] = u.whole_because
                elif covered != [(0, t.nbytes)]:
                    partial[n] = phx_loader.Partial(boxes)
            p.skipped += len(p.names) - len(keep)
            p.names, p.partial = keep, partial

    def _log_plan(self, plans: list[SourcePlan], why: str | None) -> None:
        total = sum(p.checkpoint.nbytes for p in plans)
        read = sum(p.read_bytes() for p in plans)
        n = sum(len(p.names) for p in plans)
        sliced = sum(len(p.partial) for p in plans)
        skipped = sum(p.skipped for p in plans)
        logger.info("phx: this rank reads %.3f of %.3f GB (%.1f%%) of the checkpoint: %d "
                    "tensors, %d of them in part, %d not needed here",
                    read / 1e9, total / 1e9, 100 * read / max(total, 1), n, sliced, skipped)
        if why is not None:
            logger.info("phx: reading whole tensors: %s", why)
        whole = {n: op for p in plans for n, op in p.whole.items()}
        if whole:
            ops = sorted(set(whole.values()))
            logger.info("phx: %d tensors read whole: the loading code uses them through "
                        "operations the dry run does not follow (%s), e.g. %s", len(whole),
                        ", ".join(ops[:6]), ", ".join(sorted(whole)[:4]))

    # -- the weights -------------------------------------------------------

    def _device(self, model: nn.Module) -> torch.device:
        if "device" in self.extra:
            return torch.device(self.extra["device"])
        for p in model.parameters():
            if p.device.type in ("cpu", "cuda"):
                return p.device
        return torch.device(self.load_config.device or "cpu")

    def get_all_weights(self, model_config: ModelConfig, model: nn.Module
                        ) -> Iterator[tuple[str, torch.Tensor]]:
        """Every weight this rank keeps, ``(name, tensor)``, from every source
        (vLLM's ``reload_weights`` calls this too).  The headers are read and
        validated, and the plan made, now; the data are read as the iterator
        is consumed."""
        if self.counter_before_loading_weights == 0.0:
            self.counter_before_loading_weights = time.perf_counter()
        self.plans = self.plan(model_config, model)
        self.stats = []
        device = self._device(model)
        kw = {k: self.extra[k] for k in ("group_bytes", "inflight_bytes", "cached")
              if k in self.extra}
        progress = self.extra.get("progress", bool(self.load_config.use_tqdm_on_load))

        def source(p: SourcePlan) -> Iterator[tuple[str, torch.Tensor]]:
            if not p.names:
                return
            it = phx_loader.iter_tensors(p.checkpoint, device, names=p.names,
                                         shard=lambda name, shape: p.partial.get(name),
                                         progress=progress, **kw)
            self.stats.append(it.stats)
            for name, t in it:
                yield p.source.prefix + name, t
            s = it.stats
            logger.info("phx: read %.3f GB of %d tensors from %d files (%d through the page "
                        "cache); at most %.1f MiB held by the loader",
                        s.bytes_read / 1e9, s.tensors, len(s.files), len(s.buffered_files),
                        s.peak_held_bytes / (1 << 20))
        return itertools.chain.from_iterable(source(p) for p in self.plans)

    def _get_weights_iterator(self, source: DefaultModelLoader.Source
                              ) -> Iterator[tuple[str, torch.Tensor]]:
        """One source, whole tensors (DefaultModelLoader's hook; phx's own
        path is :meth:`get_all_weights`, which plans all sources at once)."""
        ck = phx_loader.open_checkpoint(self._files(source))
        names = [n for n in ck.tensors if not should_skip_weight(n, self.local_expert_ids)]
        it = phx_loader.iter_tensors(ck, self.extra.get("device", "cpu"), names=names)
        return ((source.prefix + n, t) for n, t in it)
