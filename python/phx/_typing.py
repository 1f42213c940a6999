"""Type aliases shared by phx's annotations.

For type checkers only: at run time this module defines nothing (import it
under ``if TYPE_CHECKING:``), so typing_extensions need not be installed.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from typing import Any, TypeAlias

    import numpy.typing as npt
    from typing_extensions import Buffer

    from phx._lib.engine import _AnyBuffer, _DeviceBuffer, _HostBuffer

    #: host memory with the buffer protocol (what ``memoryview()`` takes);
    #: numpy's stubs call an ndarray a Buffer only from Python 3.12 on
    BufferLike: TypeAlias = Buffer | npt.NDArray[Any]
    #: host memory phx's engine reads into and writes from: BufferLike or a
    #: contiguous CPU torch tensor
    HostBuffer: TypeAlias = _HostBuffer
    #: GPU memory: a CUDA torch tensor, ``__cuda_array_interface__``, DLPack
    DeviceBuffer: TypeAlias = _DeviceBuffer
    #: either (``File.pread`` and friends route GPU memory to :mod:`phx.gpu`)
    AnyBuffer: TypeAlias = _AnyBuffer
