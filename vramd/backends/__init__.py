"""Copy backends: how bytes get between a BO and host staging memory."""
from __future__ import annotations

from .base import Backend, BoHandle, BoRef, Capabilities, Direction
from .mmapfd import MmapBackend
from .procmem import ProcMemBackend

BACKENDS: dict[str, type[Backend]] = {
    ProcMemBackend.name: ProcMemBackend,
    MmapBackend.name: MmapBackend,
}

__all__ = ["Backend", "BoHandle", "BoRef", "Capabilities", "Direction", "BACKENDS",
           "MmapBackend", "ProcMemBackend"]
