"""A checkpoint: one safetensors file, the shards an ``*.index.json`` names,
or a list of files.

:func:`open_checkpoint` reads and validates every header (and the index's
agreement with them) before anything is read, so a corrupt shard is found
before the first tensor is handed out.  Each header remembers the file it
was read from (:class:`~phx.loader.format.FileIdentity`), so that the data
are read from that file or not at all.  An index may only name files inside
its own folder.
"""
from __future__ import annotations

import glob
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, cast

from phx.loader.format import CheckpointError, FileIdentity, Header, TensorInfo, read_header


@dataclass
class Checkpoint:
    """Validated headers of every file, and every tensor by name (file order)."""
    files: list[Header]
    tensors: dict[str, TensorInfo]
    index_path: str | None = None
    metadata: dict[str, Any] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())

    def identity(self, path: str) -> FileIdentity | None:
        """The identity of the file ``path``'s header was read from."""
        for h in self.files:
            if h.path == path:
                return h.identity
        return None


def _inside(index: str, name: str) -> str:
    """The path of shard ``name`` of ``index``, refusing names that leave the
    index's folder.  Checked on the name, not the resolved path: a Hugging
    Face cache folder holds symbolic links into ../../blobs, which are fine;
    an absolute name or a ``..`` component is not."""
    parts = name.replace("\\", "/").split("/")
    if os.path.isabs(name) or ".." in parts or not name:
        raise CheckpointError(index, f"the index names {name!r}, which is outside the "
                              "model folder: refused")
    return os.path.join(os.path.dirname(os.path.abspath(index)), name)


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
        files = []
        for name in dict.fromkeys(wm.values()):
            p = _inside(path, name)
            if not os.path.exists(p):
                raise CheckpointError(path, f"shard {name!r} does not exist",
                                      next(k for k, v in wm.items() if v == name))
            files.append(p)
        return files, path
    if not os.path.exists(path):
        raise FileNotFoundError(2, "No such file or directory", path)
    return [path], None


def open_checkpoint(path: "str | os.PathLike[str] | Sequence[str | os.PathLike[str]]") -> Checkpoint:
    """Validate the checkpoint at ``path``: a file, an ``*.index.json``, a
    directory, or a list of safetensors files (taken as they are: no index)."""
    if isinstance(path, (list, tuple)):
        files, index = [os.fspath(p) for p in path], None
        if not files:
            raise CheckpointError("(no files)", "an empty list of checkpoint files")
        for p in files:
            if not os.path.exists(p):
                raise FileNotFoundError(2, "No such file or directory", p)
    else:
        files, index = _resolve(os.fspath(cast("str | os.PathLike[str]", path)))
    headers = [read_header(p) for p in files]
    tensors: dict[str, TensorInfo] = {}
    for h in headers:
        for t in h.tensors:
            if t.name in tensors:
                raise CheckpointError(h.path, f"also stored in {tensors[t.name].path}", t.name)
            tensors[t.name] = t
    meta: dict[str, Any] = {}
    if index is not None:
        with open(index) as f:
            doc = json.load(f)
        meta = doc.get("metadata") or {}
        for name, fname in doc["weight_map"].items():
            found = tensors.get(name)
            want = _inside(index, fname)
            if found is None:
                raise CheckpointError(want, f"the index {os.path.basename(index)} names it, "
                                      "but the shard has no such tensor", name)
            if os.path.abspath(found.path) != os.path.abspath(want):
                raise CheckpointError(index, f"the index puts it in {fname}, but it is in "
                                      f"{os.path.basename(found.path)}", name)
    elif len(headers) == 1:
        meta = headers[0].metadata
    return Checkpoint(headers, tensors, index, meta)
