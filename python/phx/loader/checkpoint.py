"""A checkpoint: one safetensors file, or the shards an ``*.index.json`` names.

:func:`open_checkpoint` reads and validates every header (and the index's
agreement with them) before anything is read, so a corrupt shard is found
before the first tensor is handed out.
"""
from __future__ import annotations

import glob
import json
import os
from dataclasses import dataclass, field

from phx.loader.format import CheckpointError, Header, TensorInfo, read_header


@dataclass
class Checkpoint:
    """Validated headers of every file, and every tensor by name (file order)."""
    files: list[Header]
    tensors: dict[str, TensorInfo]
    index_path: str | None = None
    metadata: dict = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())


def _resolve(path: str) -> tuple[list[str], str | None]:
    """The files of ``path``: a .safetensors file, an index, or a directory."""
    if os.path.isdir(path):
        idx = sorted(glob.glob(os.path.join(path, "*.safetensors.index.json")))
        if len(idx) > 1:
            raise CheckpointError(path, f"several index files: {[os.path.basename(i) for i in idx]}")
        if idx:
            return _resolve(idx[0])
        files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
        if not files:
            raise CheckpointError(path, "no *.safetensors file and no *.safetensors.index.json")
        return files, None
    if path.endswith(".json"):
        try:
            with open(path) as f:
                doc = json.load(f)
        except FileNotFoundError:
            raise
        except (OSError, ValueError) as e:
            raise CheckpointError(path, f"index is not readable JSON: {e}") from None
        wm = doc.get("weight_map") if isinstance(doc, dict) else None
        if not isinstance(wm, dict) or not all(isinstance(v, str) for v in wm.values()):
            raise CheckpointError(path, "index has no weight_map of tensor -> file")
        base = os.path.dirname(os.path.abspath(path))
        files = []
        for name in dict.fromkeys(wm.values()):
            p = os.path.join(base, name)
            if not os.path.exists(p):
                raise CheckpointError(path, f"shard {name!r} does not exist",
                                      next(k for k, v in wm.items() if v == name))
            files.append(p)
        return files, path
    if not os.path.exists(path):
        raise FileNotFoundError(2, "No such file or directory", path)
    return [path], None


def open_checkpoint(path: str | os.PathLike) -> Checkpoint:
    """Validate the checkpoint at ``path`` (file, ``*.index.json`` or directory)."""
    files, index = _resolve(os.fspath(path))
    headers = [read_header(p) for p in files]
    tensors: dict[str, TensorInfo] = {}
    for h in headers:
        for t in h.tensors:
            if t.name in tensors:
                raise CheckpointError(h.path, f"also stored in {tensors[t.name].path}", t.name)
            tensors[t.name] = t
    meta: dict = {}
    if index is not None:
        with open(index) as f:
            doc = json.load(f)
        meta = doc.get("metadata") or {}
        base = os.path.dirname(os.path.abspath(index))
        for name, fname in doc["weight_map"].items():
            t = tensors.get(name)
            want = os.path.join(base, fname)
            if t is None:
                raise CheckpointError(want, f"the index {os.path.basename(index)} names it, "
                                      "but the shard has no such tensor", name)
            if os.path.abspath(t.path) != os.path.abspath(want):
                raise CheckpointError(index, f"the index puts it in {fname}, but it is in "
                                      f"{os.path.basename(t.path)}", name)
    elif len(headers) == 1:
        meta = headers[0].metadata
    return Checkpoint(headers, tensors, index, meta)
