"""File descriptors that ride on packets: SCM_RIGHTS (un)packing and who owns which fd.

No I/O but closing: a packet's fds belong to an `FdBundle` until a handler
takes them, and whatever nobody took is closed.
"""
from __future__ import annotations

import array
import os
import socket
from collections.abc import Iterable, Sequence

from ..errors import BadDescriptorError

# sendmsg's ancillary data: (level, type, data)
SendAncData = list[tuple[int, int, "array.array[int]"]]


def unpack_fds(ancdata: Iterable[tuple[int, int, bytes]]) -> list[int]:
    """The fds of every SCM_RIGHTS message in `ancdata`, in order."""
    fds = array.array("i")
    for level, kind, blob in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(blob[: len(blob) - len(blob) % fds.itemsize])
    return list(fds)


def pack_fds(fds: Sequence[int]) -> SendAncData:
    return [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))] if fds else []


def close_fds(fds: Iterable[int]) -> None:
    """Close every fd of `fds`, whatever state each is in (one failing does not stop the rest)."""
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass


class FdBundle:
    """The fds that arrived with one packet; closes every fd nobody took."""

    def __init__(self, fds: Sequence[int]) -> None:
        self._fds: list[int | None] = list(fds)

    def __len__(self) -> int:
        return len(self._fds)

    def peek(self, index: int) -> int:
        """The fd at `index` (still owned by the bundle); raises BadDescriptorError if absent."""
        fd = self._fds[index] if 0 <= index < len(self._fds) else None
        if fd is None:
            raise BadDescriptorError(f"fd index {index} names no fd ({len(self._fds)} attached to this message)")
        return fd

    def take(self, index: int) -> int:
        """Take ownership of the fd at `index`; the caller must close it."""
        fd = self.peek(index)
        self._fds[index] = None
        return fd

    def close(self) -> None:
        fds, self._fds = [fd for fd in self._fds if fd is not None], [None] * len(self._fds)
        close_fds(fds)
