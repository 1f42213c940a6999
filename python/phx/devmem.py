"""Device memory as ordinary I/O buffers, through the phx kernel module.

With ``phx.ko`` loaded (``make insmod``), a GPU range or a PCI BAR range is
mapped into this process as ZONE_DEVICE pages; an O_DIRECT read or write on
such a buffer (``phx.File.pread(mapping, offset)``) moves the bytes between
the SSD and the device memory directly.  Without the module, :func:`available`
says why, and GPU data takes the pinned bounce path (:mod:`phx.gpu`).

>>> import phx, phx.devmem
>>> ok, why = phx.devmem.available()
>>> mem = phx.devmem.map_pci_bar("0000:00:04.0", bar=2, offset=0, length=16 << 20)
>>> phx.open("kv.bin").pread(mem, 0)
"""
from __future__ import annotations

from phx._lib import devmem as _d
from phx._lib.devmem import DeviceMemory

__all__ = ["DeviceMemory", "available", "map_gpu", "map_pci_bar"]


def available() -> tuple[bool, str]:
    """Whether /dev/phx can be used, and why (not)."""
    return _d.probe()


def _parse_bdf(bdf: str) -> tuple[int, int, int]:
    parts = bdf.replace(".", ":").split(":")
    if len(parts) == 3:
        parts.insert(0, "0")
    if len(parts) != 4:
        raise ValueError(f"PCI address {bdf!r} is not DDDD:BB:SS.F")
    dom, bus, slot, fn = (int(x, 16) for x in parts)
    if bus > 255 or slot > 31 or fn > 7:
        raise ValueError(f"PCI address {bdf!r} out of range")
    return dom, bus, (slot << 3) | fn


def map_pci_bar(bdf: str, bar: int, offset: int, length: int) -> DeviceMemory:
    """Map ``[offset, offset + length)`` of BAR ``bar`` of PCI device ``bdf``.

    Root only (CAP_SYS_ADMIN); offset and length in 2 MiB units.  The stand-in
    for a GPU in tests (QEMU ivshmem), and real device memory (NVMe CMB, FPGA).
    """
    dom, bus, devfn = _parse_bdf(bdf)
    return _d.map_pci_bar(dom, bus, devfn, bar, offset, length)


def map_gpu(ptr: int, length: int) -> DeviceMemory:
    """Map the caller's own GPU memory ``[ptr, ptr + length)`` (NVIDIA).

    ``ptr`` is a CUDA device pointer (e.g. ``tensor.data_ptr()``).
    """
    return _d.map_gpu(ptr, length)
