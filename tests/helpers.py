"""Shared test plumbing: child workloads, image directories, running the engine."""
from __future__ import annotations

import os
from pathlib import Path

import uvloop

from vramd.backends import BoRef
from vramd.engine import BoSpec, Engine, EngineConfig, RestoreTarget
from vramd.testing import Workload, blank_spec_like  # noqa: F401  (re-exported for tests)

ROOT = str(Path(__file__).resolve().parent.parent)  # the repository


def run(coro):
    return uvloop.run(coro)


def procmem_bos(w: Workload, mem_fd: int, gpu_of=lambda i: 0) -> list[BoSpec]:
    return [BoSpec(i + 1, r["size"], BoRef("procmem", mem_fd, r["addr"]), gpu_id=gpu_of(i), va_addr=r["addr"])
            for i, r in enumerate(w.regions)]


def procmem_targets(w: Workload, mem_fd: int) -> list[RestoreTarget]:
    return [RestoreTarget(i + 1, BoRef("procmem", mem_fd, r["addr"])) for i, r in enumerate(w.regions)]


def engine(**kw) -> Engine:
    return Engine(EngineConfig(**kw))


def memfd(data: bytes = b"", size: int | None = None) -> int:
    """A memfd holding `data`, `size` bytes long (default len(data)): a BO for the mmap backend."""
    fd = os.memfd_create("bo", os.MFD_CLOEXEC)
    os.ftruncate(fd, len(data) if size is None else size)
    if data:
        os.pwrite(fd, data, 0)
    return fd


def open_dir(path) -> int:
    return os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
