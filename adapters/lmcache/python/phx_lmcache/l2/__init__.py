"""phx as LMCache's persistent, checksummed disk tier (issue 28).

LMCache loads :class:`PhxL2Backend` as a storage plugin::

    storage_plugins: ["phx_l2"]
    extra_config:
      storage_plugin.phx_l2.module_path: phx_lmcache.l2
      storage_plugin.phx_l2.class_name: PhxL2Backend
      phx_l2.paths: /mnt/nvme/lmcache-l2.slab
      phx_l2.capacity_gb: 64

Design and measurements: docs/lmcache-l2.md.  The format module has no
LMCache import; the backend is imported only when LMCache asks for it.
"""
from __future__ import annotations

from typing import Any

__all__ = ["PhxL2Backend", "SlabInUseError"]


def __getattr__(name: str) -> Any:
    if name == "PhxL2Backend":
        from .backend import PhxL2Backend
        return PhxL2Backend
    if name == "SlabInUseError":
        from .slab import SlabInUseError
        return SlabInUseError
    raise AttributeError(name)
