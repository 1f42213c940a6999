"""phx: direct-storage I/O for LLM inference.

``phx.open(path, mode)`` gives a :class:`File` whose reads and writes go
through an io_uring engine with O_DIRECT (page cache bypassed), into host
buffers, numpy arrays, torch tensors or (with :mod:`phx.gpu`) GPU memory.

>>> import phx
>>> buf = phx.empty_aligned(1 << 20)
>>> with phx.open("data.bin", "r") as f:
...     n = f.pread(buf, 0)
"""
from __future__ import annotations

import os
import threading
from typing import Any

from phx._lib.engine import (AlignedBuffer, BufferNotContiguousError,
                             BufferReadOnlyError, ClosedFileError, Engine, File,
                             Future, __version__, empty_aligned, is_device_buffer)

from phx.futures import PhxFuture

# the compiled host future follows the one protocol (phx.futures)
PhxFuture.register(Future)

__all__ = [
    "AlignedBuffer", "BufferNotContiguousError", "BufferReadOnlyError",
    "ClosedFileError", "Engine", "File", "Future", "PhxFuture", "__version__",
    "default_engine", "empty_aligned", "info", "is_device_buffer", "open", "stats",
]

_default_lock = threading.Lock()
_default: tuple[int, Engine] | None = None


def default_engine() -> Engine:
    """This process's shared engine, created on first use (anew after fork)."""
    global _default
    with _default_lock:
        if _default is None or _default[0] != os.getpid():
            _default = (os.getpid(), Engine())
        return _default[1]


def open(path: str | os.PathLike[str], mode: str = "r", *, direct: bool = True,
         allow_buffered: bool = False, engine: Engine | None = None) -> File:
    """Open ``path`` for phx I/O.

    mode: ``"r"``, ``"r+"``, ``"w"``, ``"w+"``, ``"x"``, ``"x+"`` (as for
    :func:`open`; no append, every call names its offset).
    direct: O_DIRECT (default): the page cache is bypassed; unaligned requests
    go through the engine's aligned bounce buffers (a partial block the file
    ends inside is written through the page cache, exactly the caller's bytes,
    then flushed: nothing past the caller's end is ever written).
    ``direct=False`` uses the page cache on purpose.
    allow_buffered: open buffered when the filesystem refuses O_DIRECT
    (``File.direct`` then says False) instead of raising.
    engine: the :class:`Engine` to use; default :func:`default_engine`.
    """
    return File(engine if engine is not None else default_engine(), path, mode,
                direct, allow_buffered)


def stats() -> dict[str, Any]:
    """Counters of :func:`default_engine` (bytes by path: direct, bounce, page cache;
    ``backend`` and ``backend_reason`` are strings)."""
    return default_engine().stats()


def info(path: str | os.PathLike[str] = ".") -> dict[str, Any]:
    """What this machine offers phx, and why a path is unavailable (see ``phx info``)."""
    from phx.probe import gather
    return gather(path)
