"""Copy backends: how bytes get between a BO and host staging memory.

`REGISTRY` is every backend vramd has, by name; the engine creates each one
with `Backend.create(BackendOptions)` and lists the ones that cannot work
here (no GPU, no library) as unavailable, with the reason.  Nothing outside
this package names a backend class.
"""
from __future__ import annotations

from .base import (
    Backend,
    BackendOptions,
    BoHandle,
    BoRef,
    Capabilities,
    CopyItem,
    Direction,
    FdMemo,
    OpenItem,
    land_all,
)
from .mmapfd import MmapBackend
from .procmem import ProcMemBackend
from .sdma import SdmaBackend

REGISTRY: dict[str, type[Backend]] = {
    ProcMemBackend.name: ProcMemBackend,
    MmapBackend.name: MmapBackend,
    SdmaBackend.name: SdmaBackend,
}

__all__ = ["REGISTRY", "Backend", "BackendOptions", "BoHandle", "BoRef", "Capabilities", "CopyItem", "Direction",
           "FdMemo", "MmapBackend", "OpenItem", "ProcMemBackend", "SdmaBackend", "land_all"]
