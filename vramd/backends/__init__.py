"""Copy backends: how bytes get between a BO and host staging memory.

`REGISTRY` is every backend vramd has, by its `BackendKind`; the engine creates each one
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
    CpuCopier,
    Direction,
    FdMemo,
    OpenItem,
    land_all,
)
from .kind import BackendKind, procmem_pid
from .mmapfd import MmapBackend
from .procmem import ProcMemBackend
from .sdma import SdmaBackend

REGISTRY: dict[BackendKind, type[Backend]] = {
    BackendKind.PROCMEM: ProcMemBackend,
    BackendKind.MMAP: MmapBackend,
    BackendKind.SDMA: SdmaBackend,
}

__all__ = ["REGISTRY", "Backend", "BackendKind", "BackendOptions", "BoHandle", "BoRef", "Capabilities", "CopyItem",
           "CpuCopier", "Direction", "FdMemo", "MmapBackend", "OpenItem", "ProcMemBackend", "SdmaBackend", "land_all",
           "procmem_pid"]
