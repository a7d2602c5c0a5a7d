"""Which backend moves a BO's bytes: the one typed name the registry, the engine and the jobs use.

The wire (AddBos' `backend`) and the CLI carry the name as a string; the
daemon parses it into a `BackendKind` where the request arrives
(`BackendKind.parse`), and a BO that names none gets the one default chosen
here, from what its fd is (`BackendKind.for_fd`).  The engine's backends
go by these names (a test may hand it one of its own under another name).
"""
from __future__ import annotations

import enum
import os
import re

_PROCMEM_LINK = re.compile(r"^/proc/(\d+)/mem$")


class BackendKind(enum.StrEnum):
    """The backends vramd has, by the name the wire, the CLI and the manifest's source field use."""

    PROCMEM = "procmem"  # a caller-opened /proc/<pid>/mem fd
    MMAP = "mmap"        # a dmabuf, render node, memfd or file, mapped or read by the CPU (large BAR)
    SDMA = "sdma"        # a dmabuf copied by the GPU's SDMA engines

    @classmethod
    def parse(cls, name: str) -> BackendKind | str:
        """The kind a client named.  A name vramd has no backend for stays the client's string: the job refuses
        it when it reaches that BO (BACKEND_UNAVAILABLE, failing the session), as it refuses a backend that is
        not available here, so every BO before it is checked and taken as usual."""
        try:
            return cls(name)
        except ValueError:
            return name

    @classmethod
    def for_fd(cls, fd: int) -> tuple[BackendKind, int | None]:
        """The backend for a BO whose client named none, from what its fd is, and the pid whose memory it is:
        procmem for a /proc/<pid>/mem fd (its pid), else mmap (None)."""
        pid = procmem_pid(fd)
        return (cls.MMAP, None) if pid is None else (cls.PROCMEM, pid)


def procmem_pid(fd: int) -> int | None:
    """The pid of the process whose memory `fd` is, when it is a /proc/<pid>/mem fd; else None.

    Read from the link of our own fd table, never from a path a client named."""
    try:
        target = os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return None
    m = _PROCMEM_LINK.match(target)
    return int(m.group(1)) if m else None
