"""A SOCK_SEQPACKET unix socket on the event loop: packets with their fds.

asyncio's transports (and uvloop's) cannot carry SCM_RIGHTS, so this uses a
raw non-blocking socket with add_reader/add_writer and recvmsg/sendmsg.
Received fds get close-on-exec atomically (MSG_CMSG_CLOEXEC); truncation of
the packet or of its fds is reported in the flags for the protocol to
refuse.  Works on asyncio's loop and on uvloop.
"""
from __future__ import annotations

import array
import asyncio
import errno
import socket
import struct
from collections.abc import Callable, Sequence
from typing import Any

from ..protocol.fds import close_fds, pack_fds, unpack_fds
from ..protocol.frames import SCM_MAX_FD


class PacketChannel:
    def __init__(self, sock: socket.socket, *, max_bytes: int, max_fds: int = SCM_MAX_FD) -> None:
        sock.setblocking(False)
        self.sock = sock
        self.max_bytes = max_bytes
        self.cmsg_space = socket.CMSG_SPACE(max_fds * 4)
        self.closed = False

    async def _ready(self, add: Callable[..., Any], remove: Callable[[int], Any]) -> None:
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[None] = loop.create_future()
        fd = self.sock.fileno()
        def ready() -> None:
            if not fut.done():
                fut.set_result(None)
        add(fd, ready)
        try:
            await fut
        finally:
            remove(fd)

    async def recv(self) -> tuple[bytes, list[int], int] | None:
        """One packet: (data, fds, flags), or None at end of stream."""
        loop = asyncio.get_running_loop()
        while True:
            try:
                data, anc, flags, _ = self.sock.recvmsg(self.max_bytes + 1, self.cmsg_space, socket.MSG_CMSG_CLOEXEC)
                break
            except (BlockingIOError, InterruptedError):
                await self._ready(loop.add_reader, loop.remove_reader)
            except ConnectionResetError:
                return None
        fds = unpack_fds(anc)
        if not data and not fds:
            return None
        return data, fds, flags

    async def send(self, data: bytes, fds: Sequence[int] = ()) -> bool:
        """Send one packet; False if the peer has gone."""
        loop = asyncio.get_running_loop()
        while True:
            try:
                self.sock.sendmsg([data], pack_fds(fds))
                return True
            except (BlockingIOError, InterruptedError):
                await self._ready(loop.add_writer, loop.remove_writer)
            except OSError as e:
                if e.errno in (errno.EPIPE, errno.ECONNRESET, errno.ENOTCONN, errno.EBADF):
                    return False
                raise

    def peercred(self) -> tuple[int, int, int]:
        """(pid, uid, gid) of the peer at connect time."""
        pid, uid, gid = struct.unpack("3i", self.sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
        return pid, uid, gid

    def peergroups(self) -> set[int]:
        """The peer's supplementary groups (SO_PEERGROUPS, Linux >= 4.13); empty if unknown."""
        so_peergroups = getattr(socket, "SO_PEERGROUPS", 59)
        size = 64 * 4
        while size <= 65536 * 4:
            try:
                raw = self.sock.getsockopt(socket.SOL_SOCKET, so_peergroups, size)
            except OSError as e:
                if e.errno == errno.ERANGE:
                    size *= 4
                    continue
                return set()
            return set(array.array("I", raw[: len(raw) - len(raw) % 4]))
        return set()

    def discard_pending(self) -> None:
        """Drop packets still queued (closing their fds): closing a unix socket with unread
        data would reset the connection, and the peer could lose our last reply."""
        while True:
            try:
                data, anc, _, _ = self.sock.recvmsg(self.max_bytes + 1, self.cmsg_space, socket.MSG_CMSG_CLOEXEC)
            except OSError:
                return
            close_fds(unpack_fds(anc))
            if not data and not anc:
                return

    def close(self) -> None:
        if not self.closed:
            self.discard_pending()
            self.closed = True
            self.sock.close()
