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
    DRAIN_PACKETS = 64   # packets a close discards at most: more than a client that keeps to the protocol queues
    DRAIN_SLICE = 8      # packets discarded between yields to the event loop (< 1 ms with 253 fds each)

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

    def stop_reading(self) -> None:
        """shutdown(SHUT_RD): the peer's sends fail (EPIPE) from now on; it still reads what we send."""
        try:
            self.sock.shutdown(socket.SHUT_RD)
        except OSError:  # not connected any more
            pass

    async def close(self) -> None:
        """Close the socket, after draining a bounded amount of what the peer sent and nobody read.

        Closing a unix socket with unread data resets the connection: the peer's next read fails
        with ECONNRESET, and it could lose our last reply (a refusal saying why).  So first
        shutdown(SHUT_RD): from then on the peer's sends fail (EPIPE), and what is queued is all
        there will be; then read and discard that (closing its fds), at most DRAIN_PACKETS
        packets, DRAIN_SLICE at a time with a yield to the event loop between slices; then close.
        A peer that queued more than that (it raised its send buffer, and was flooding) may see
        the reset, and the kernel's freeing of the rest (a few µs a packet) runs in a worker
        thread: no other client waits on a drain for more than a slice.
        """
        if self.closed:
            return
        self.closed = True
        left = False
        drained = 0
        self.stop_reading()
        try:
            for _ in range(0, self.DRAIN_PACKETS, self.DRAIN_SLICE):
                left, n = self._discard(self.DRAIN_SLICE)
                drained += n
                if not left:
                    break
                await asyncio.sleep(0)
        finally:
            # An empty packet reads as the end of the queue: where anything was drained, more may follow it,
            # and the kernel's freeing of that (tens of ms for a queue of 253-fd packets) is no loop's work.
            if left or drained:
                await asyncio.shield(asyncio.get_running_loop().run_in_executor(None, self.sock.close))
            else:
                self.sock.close()

    def _discard(self, budget: int) -> tuple[bool, int]:
        """Read and drop up to `budget` queued packets, closing their fds: (whether more may be queued, how many
        were dropped)."""
        for i in range(budget):
            try:
                data, anc, _, _ = self.sock.recvmsg(self.max_bytes + 1, self.cmsg_space, socket.MSG_CMSG_CLOEXEC)
            except OSError:  # EAGAIN: empty; or the peer is gone
                return False, i
            fds = unpack_fds(anc)
            close_fds(fds)
            if not data and not fds:  # end of stream (after SHUT_RD, also what an empty queue reads as)
                return False, i
        return True, budget
