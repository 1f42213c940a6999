"""``PhxCopier``: fastsafetensors' copier interface on phx reads.

fastsafetensors hands a copier one file's metadata; ``submit_io`` allocates
the device buffer through the framework and starts the reads, ``wait_io``
waits, checks every byte arrived and returns the tensors (views of the
buffer, made by fastsafetensors' metadata).  Byte ranges and sub-file chunks
(``set_byte_ranges`` / ``set_chunk``, used by its planner under
``max_batch_bytes``) read only the runs asked for.

One file or none: fastsafetensors reads a header through a descriptor of
its own and closes it.  :func:`note_identities` wraps its
``SafeTensorsMetadata.from_fd`` so that each metadata object carries the
identity (device, inode, size, mtime, ctime) of the file its header came
from; the copier checks its own handle against it when it opens the file
and again after the reads, and raises :class:`phx.loader.CheckpointError`
naming the file on a difference (a shard replaced by a rename, or written).
Metadata made without a descriptor (``from_buffer``) or before the wrap only
has its size to compare.  A file mostly in the page cache is read buffered
(:func:`phx.loader.open_for_data`).
"""
from __future__ import annotations

import concurrent.futures
import ctypes
import os
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np
import numpy.typing as npt
from fastsafetensors.copier.base import (CopierInterface, validated_byte_ranges,
                                         validated_chunk_allocation_size)
from fastsafetensors.common import SafeTensorsMetadata
from fastsafetensors.copier.registry import register_copier_constructor
from fastsafetensors.st_types import DeviceType, DType

import phx.gpu
from phx.loader import CheckpointError, FileIdentity, check_identity, open_for_data

_pool: concurrent.futures.ThreadPoolExecutor | None = None


def _host_pool() -> concurrent.futures.ThreadPoolExecutor:
    global _pool
    if _pool is None:
        _pool = concurrent.futures.ThreadPoolExecutor(4, thread_name_prefix="phx-fst")
    return _pool


_IDENT = "_phx_identity"      # the attribute noted on fastsafetensors' metadata


def note_identities() -> None:
    """Make fastsafetensors' ``SafeTensorsMetadata.from_fd`` note the
    identity of the file each header is read from (idempotent)."""
    inner = SafeTensorsMetadata.__dict__["from_fd"]
    func = inner.__func__
    # the mark is on the function: a classmethod does not show its attributes
    if getattr(func, "_phx", False):
        return

    def from_fd(cls: type[Any], fd: int, filename: str, *args: Any, **kwargs: Any) -> Any:
        before = FileIdentity.of(os.fstat(fd))
        md = func(cls, fd, filename, *args, **kwargs)
        # a file that changed while its header was read is refused now
        check_identity(filename, before, fd, "while fastsafetensors read its header")
        setattr(md, _IDENT, before)
        return md
    from_fd.__doc__ = func.__doc__
    from_fd._phx = True  # type: ignore[attr-defined]  # the mark idempotence looks for
    SafeTensorsMetadata.from_fd = classmethod(from_fd)


def identity_of(metadata: Any) -> FileIdentity | None:
    """The identity noted for ``metadata``'s file, if any."""
    return getattr(metadata, _IDENT, None)


class _DeviceMemory:
    """GPU memory at an address, for phx.gpu (``__cuda_array_interface__``)."""

    def __init__(self, ptr: int, nbytes: int):
        self.ptr, self.nbytes = ptr, nbytes

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        return {"shape": (self.nbytes,), "typestr": "|u1", "data": (self.ptr, False),
                "version": 3, "stream": None}


class PhxCopier(CopierInterface):  # type: ignore[misc]  # fastsafetensors is untyped
    """Reads one safetensors file into fastsafetensors' device buffer via phx."""

    def __init__(self, metadata: Any, device: Any, framework: Any) -> None:
        self.metadata = metadata
        self.device = device
        self.framework = framework
        self.byte_ranges: list[tuple[int, int]] | None = None
        self._names: set[str] | None = None
        self._alloc: int | None = None
        self._base = metadata.header_length
        self._pending: tuple[Any, Any, npt.NDArray[np.int64]] | None = None

    def set_byte_ranges(self, byte_ranges: list[tuple[int, int]]) -> None:
        self.byte_ranges = validated_byte_ranges(self.metadata, byte_ranges)

    def set_chunk(self, byte_ranges: list[tuple[int, int]], names: Iterable[str],
                  allocation_size: int | None = None) -> None:
        runs = validated_byte_ranges(self.metadata, byte_ranges)
        self.byte_ranges = runs
        self._names = set(names)
        self._alloc = validated_chunk_allocation_size(runs, allocation_size)

    @classmethod
    def chunk_transient_multiplier(cls, paths: Any) -> int:
        return 1      # only the chunk's own buffer; staging is phx's fixed pool

    @classmethod
    def fixed_device_overhead(cls, paths: Any) -> int:
        return 0      # phx's staging is pinned host memory

    def submit_io(self, use_buf_register: bool, max_copy_block_size: int) -> Any:
        md = self.metadata
        runs = self.byte_ranges
        if runs is None:
            runs = [(md.header_length, md.size_bytes)]
        if self._names is not None:
            self._base = min((s for s, _ in runs), default=md.header_length)
            length = self._alloc or (max((e for _, e in runs), default=self._base) - self._base)
        else:
            self._base = md.header_length
            length = md.size_bytes - md.header_length
        gbuf = self.framework.alloc_tensor_memory(length, self.device)
        pieces = np.array([(s, s - self._base, e - s) for s, e in runs if e > s],
                          dtype=np.int64).reshape(-1, 3)
        try:
            f = open_for_data(md.src, identity_of(md))
            size = os.fstat(f.fileno()).st_size
            if identity_of(md) is None and size != md.size_bytes:
                f.close()
                raise CheckpointError(md.src, f"the file is {size} bytes, its header was "
                                      f"read from one of {md.size_bytes}: changed")
        except BaseException:
            self.framework.free_tensor_memory(gbuf, self.device)
            raise
        try:
            addr = gbuf.get_base_address()
            handle: concurrent.futures.Future[Any] | phx.gpu.GPUBatch | None
            if not len(pieces):
                handle = None
            elif self.device.type == DeviceType.CPU:
                host = (ctypes.c_ubyte * max(length, 1)).from_address(addr)
                handle = _host_pool().submit(f.pread_many, host, pieces[:, 0], pieces[:, 2],
                                             pieces[:, 1])
            else:
                handle = phx.gpu.read_chunks_async(_DeviceMemory(addr, length), f,
                                                   pieces[:, 0], pieces[:, 1], pieces[:, 2])
        except BaseException:
            f.close()
            self.framework.free_tensor_memory(gbuf, self.device)
            raise
        self._pending = (f, handle, pieces)
        return gbuf

    def finish_io(self) -> None:
        if self._pending is None:
            return
        f, handle, pieces = self._pending
        self._pending = None
        try:
            got = None if handle is None else np.asarray(handle.result(), dtype=np.int64)
            # the bytes came from the header's file, unchanged until now
            check_identity(self.metadata.src, identity_of(self.metadata), f.fileno(),
                           "after reading it")
        finally:
            f.close()
        if got is not None and (got != pieces[:, 2]).any():
            i = int(np.flatnonzero(got != pieces[:, 2])[0])
            raise OSError(5, f"short read: {int(got[i])} of {int(pieces[i, 2])} bytes at "
                          f"offset {int(pieces[i, 0])} (file truncated?)", self.metadata.src)

    def wait_io(self, gbuf: Any, dtype: DType = DType.AUTO, noalign: bool = False,
                owner: Any = None) -> Any:
        self.finish_io()
        if self._names is None:
            return self.metadata.get_tensors(gbuf, self.device, self._base, dtype=dtype,
                                             owner=owner)
        # a compact chunk holds only these tensors (fastsafetensors' own
        # nogds copier uses the same entry point for it)
        return self.metadata._get_tensors(gbuf, self.device, self._base, dtype=dtype,
                                          names=self._names, owner=owner)


def factory_for(name: str) -> Callable[..., Any]:
    """Register the phx factory under copier type ``name``."""
    def new_phx_copier(device: Any, **kwargs: Any) -> Callable[[Any, Any, Any], PhxCopier]:
        # fastsafetensors' native helpers (its buffers, DLPack views) need the
        # GPU runtime loaded, which its own factories do first; so do we
        from fastsafetensors.copier.nogds import load_library_func
        load_library_func(kwargs.get("framework"))

        def construct(metadata: Any, device: Any, framework: Any) -> PhxCopier:
            return PhxCopier(metadata, device, framework)
        return construct
    # (not as a decorator: fastsafetensors has no type information)
    registered: Callable[..., Any] = register_copier_constructor(name, PhxCopier)(new_phx_copier)
    return registered
