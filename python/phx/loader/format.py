"""The safetensors file format: header parsing and validation.

A safetensors file is an 8-byte little-endian header length ``N``, ``N``
bytes of JSON (``{name: {"dtype", "shape", "data_offsets": [begin, end]},
"__metadata__": {str: str}}``, padded with spaces), then the data; offsets
are relative to the first data byte ``8 + N``.

Everything a read will rely on is checked here, before any byte of data is
read: the header length against the file size, the JSON, each tensor's
dtype, shape and byte size against its offsets, offsets inside the file,
and no two tensors overlapping.  A failure raises :class:`CheckpointError`
naming the file and the tensor.
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from typing import Any

#: the largest header accepted (the safetensors library's own limit)
MAX_HEADER = 100_000_000

#: safetensors dtype -> (bytes per element, torch dtype attribute)
DTYPES: dict[str, tuple[int, str]] = {
    "F64": (8, "float64"), "F32": (4, "float32"), "F16": (2, "float16"),
    "BF16": (2, "bfloat16"), "I64": (8, "int64"), "I32": (4, "int32"),
    "I16": (2, "int16"), "I8": (1, "int8"), "U64": (8, "uint64"),
    "U32": (4, "uint32"), "U16": (2, "uint16"), "U8": (1, "uint8"),
    "BOOL": (1, "bool"), "F8_E4M3": (1, "float8_e4m3fn"),
    "F8_E5M2": (1, "float8_e5m2"), "F8_E8M0": (1, "float8_e8m0fnu"),
    "C64": (8, "complex64"),
}


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded as it is: truncated, corrupt or
    inconsistent.  ``path`` and ``tensor`` (None when it concerns the whole
    file) say where."""

    def __init__(self, path: str, what: str, tensor: str | None = None):
        self.path = str(path)
        self.tensor = tensor
        self.what = what
        where = f"{self.path}: tensor {tensor!r}" if tensor is not None else self.path
        super().__init__(f"{where}: {what}")


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of a file: ``start``/``end`` are absolute file offsets."""
    name: str
    dtype: str
    shape: tuple[int, ...]
    start: int
    end: int
    path: str

    @property
    def nbytes(self) -> int:
        return self.end - self.start

    @property
    def itemsize(self) -> int:
        return DTYPES[self.dtype][0]


@dataclass(frozen=True)
class FileIdentity:
    """Which file a header was read from, and its state then: a file whose
    device, inode, size, mtime or ctime differ later is not the file the
    header describes (replaced by a rename, or written in place)."""
    dev: int
    ino: int
    size: int
    mtime_ns: int
    ctime_ns: int

    @classmethod
    def of(cls, st: os.stat_result) -> "FileIdentity":
        return cls(st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)

    def differences(self, st: os.stat_result) -> list[str]:
        """What changed in ``st`` (a later fstat) against this identity; empty if nothing."""
        now = FileIdentity.of(st)
        if (now.dev, now.ino) != (self.dev, self.ino):
            return [f"another file (inode {self.dev}:{self.ino} -> {now.dev}:{now.ino}: "
                    "replaced, e.g. by a rename)"]
        out = []
        if now.size != self.size:
            out.append(f"size {self.size} -> {now.size}")
        if now.mtime_ns != self.mtime_ns:
            out.append("mtime changed (written)")
        elif now.ctime_ns != self.ctime_ns:
            out.append("ctime changed")
        return out


def check_identity(path: str, want: "FileIdentity | None", fd: int, when: str) -> None:
    """Raise :class:`CheckpointError` naming ``path`` when the file open as
    ``fd`` is not (or no longer) the one ``want`` describes."""
    if want is None:
        return
    diff = want.differences(os.fstat(fd))
    if diff:
        raise CheckpointError(path, f"the file changed since its header was read ({when}): "
                              + ", ".join(diff))


@dataclass
class Header:
    """A validated safetensors header: tensors in file order.  ``identity``:
    the file it was read from (checked again when the data are read)."""
    path: str
    size: int               # file size when it was opened
    data_start: int         # 8 + header length
    tensors: list[TensorInfo]
    metadata: dict[str, str] = field(default_factory=dict)
    identity: FileIdentity | None = None


def _read_exact(fd: int, n: int, off: int) -> bytes:
    out = bytearray()
    while len(out) < n:
        b = os.pread(fd, n - len(out), off + len(out))
        if not b:
            break
        out += b
    return bytes(out)


def read_header(path: str | os.PathLike[str]) -> Header:
    """Parse and validate the header of the safetensors file at ``path``."""
    path = os.fspath(path)
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        ident = FileIdentity.of(os.fstat(fd))
        size = ident.size
        if size < 8:
            raise CheckpointError(path, f"truncated: {size} bytes, no 8-byte header length")
        n = int.from_bytes(_read_exact(fd, 8, 0), "little")
        if n > MAX_HEADER:
            raise CheckpointError(path, f"header length {n} is larger than {MAX_HEADER} "
                                  "(not a safetensors file, or corrupt)")
        if 8 + n > size:
            raise CheckpointError(path, f"truncated: header length {n} runs past the "
                                  f"end of the {size}-byte file")
        raw = _read_exact(fd, n, 8)
        # the same handle, after the read: a file written while its header
        # was read is not trusted either
        check_identity(path, ident, fd, "while reading the header")
    finally:
        os.close(fd)
    h = parse_header(path, raw, size)
    h.identity = ident
    return h


def parse_header(path: str, raw: bytes, size: int) -> Header:
    """Validate header bytes ``raw`` of a file of ``size`` bytes."""
    try:
        doc = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(path, f"header is not valid JSON: {e}") from None
    if not isinstance(doc, dict):
        raise CheckpointError(path, "header is not a JSON object")
    data_start = 8 + len(raw)
    meta = doc.pop("__metadata__", None) or {}
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise CheckpointError(path, "__metadata__ is not a map of strings")
    tensors = [_tensor(path, name, entry, data_start, size) for name, entry in doc.items()]
    tensors.sort(key=lambda t: (t.start, t.end))
    prev: TensorInfo | None = None
    for t in tensors:
        # zero-byte tensors occupy nothing and may sit anywhere
        if t.nbytes == 0:
            continue
        if prev is not None and t.start < prev.end:
            raise CheckpointError(path, f"bytes [{t.start - data_start}, {t.end - data_start}) "
                                  f"overlap tensor {prev.name!r} "
                                  f"[{prev.start - data_start}, {prev.end - data_start})", t.name)
        prev = t
    return Header(path, size, data_start, tensors, dict(meta))


def _tensor(path: str, name: Any, e: Any, data_start: int, size: int) -> TensorInfo:
    if not isinstance(e, dict):
        raise CheckpointError(path, "entry is not a JSON object", name)
    dtype = e.get("dtype")
    if dtype not in DTYPES:
        raise CheckpointError(path, f"unknown or unsupported dtype {dtype!r}", name)
    shape = e.get("shape")
    if not isinstance(shape, list) or not all(
            isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
        raise CheckpointError(path, f"shape {shape!r} is not a list of non-negative integers", name)
    offs = e.get("data_offsets")
    if (not isinstance(offs, list) or len(offs) != 2
            or not all(isinstance(o, int) and not isinstance(o, bool) for o in offs)):
        raise CheckpointError(path, f"data_offsets {offs!r} is not [begin, end]", name)
    begin, end = offs
    if begin < 0 or end < begin:
        raise CheckpointError(path, f"data_offsets [{begin}, {end}] are reversed or negative", name)
    want = math.prod(shape) * DTYPES[dtype][0]
    if end - begin != want:
        raise CheckpointError(path, f"{dtype} {tuple(shape)} needs {want} bytes but "
                              f"data_offsets [{begin}, {end}] hold {end - begin}", name)
    if data_start + end > size:
        raise CheckpointError(path, f"data_offsets [{begin}, {end}] run past the end of the "
                              f"file (truncated? {size - data_start} data bytes)", name)
    return TensorInfo(name, dtype, tuple(shape), data_start + begin, data_start + end, path)
