"""The client's side of an in-process connection: the client machine (vramd.protocol) driven over an asyncio
packet channel.

The same machine vramd.client.Client drives over a blocking socket: it says
which packet to send and which file step to take next; this driver sends and
receives with the event loop (the daemon's side runs on it too) and hands
the file steps to `SessionFiles` (vramd.imagedir).
"""
from __future__ import annotations

import os
import socket
from collections.abc import Sequence

from .. import __version__
from ..errors import BadDescriptorError
from ..imagedir import OpenedSessions, SessionFiles
from ..pb import rpc_pb2 as rpc
from ..protocol import events as ev
from ..protocol.client import ClientBo, Outgoing
from ..protocol.frames import DEFAULT_MAX_MESSAGE, HEADER_SIZE
from ..protocol.requests import OpenSpec
from ..protocol.session import ClientMachine
from ..service.transport import PacketChannel


class Connection:
    """One connection to an in-process daemon (host.py); one operation at a time, each awaited to its end."""

    def __init__(self, sock: socket.socket, name: str = "inproc") -> None:
        self.machine = ClientMachine(f"{name} {__version__}")
        self.channel = PacketChannel(sock, max_bytes=DEFAULT_MAX_MESSAGE + HEADER_SIZE)
        self._files = OpenedSessions()  # the files of the sessions this connection opened

    async def hello(self) -> rpc.HelloReply:
        self.machine.say_hello()
        return (await self.drive()).hello

    async def drive(self, opening: SessionFiles | None = None) -> rpc.Response:
        """Take the machine's events to the end of its operation (`opening`: the files of a session being
        opened); its response, or its error raised."""
        m = self.machine
        while True:
            e = m.next_event()
            if isinstance(e, ev.Done):
                return e.response
            if isinstance(e, ev.Failed):
                raise e.error
            if isinstance(e, ev.Send):
                await self._transfer(e.packet)
                continue
            self._files.answer(m, e, opening)

    async def _transfer(self, out: Outgoing) -> None:
        """Send one packet, receive the answer.  An fd that is not open cannot travel (sendmsg: EBADF):
        BAD_DESCRIPTOR, and nothing is sent."""
        for fd in out.fds:
            try:
                os.fstat(fd)
            except OSError as e:
                self.machine.not_sent(BadDescriptorError(f"fd {fd} is not usable: {e.strerror}; not sent"))
                return
        packet = await self.channel.recv() if await self.channel.send(out.data, out.fds) else None
        if packet is None:  # the daemon's end closed: the machine reports it (ConnectionError)
            self.machine.receive(b"")
            return
        self.machine.receive(*packet)

    async def _session(self) -> rpc.SessionInfo:
        return (await self.drive()).session

    # --- sessions ----------------------------------------------------------------

    async def open_session(self, spec: OpenSpec, files: SessionFiles) -> rpc.SessionInfo:
        """OpenSession with `files` (its manifests, a dump's directory), which the session owns from here on,
        even on error."""
        try:
            self.machine.open_session(spec)
            info = (await self.drive(files)).session
        except BaseException:
            files.close()
            raise
        self._files.add(info.token, files)
        return info

    async def add_bos(self, token: str, bos: Sequence[ClientBo]) -> rpc.SessionInfo:
        self.machine.add_bos(token, bos)
        return await self._session()

    async def start(self, token: str) -> rpc.SessionInfo:
        self.machine.start(token)
        return await self._session()

    async def wait(self, token: str, timeout: float | None = None) -> rpc.SessionInfo:
        """The barrier; a dump is committed here once DONE, a failed session's files closed."""
        self.machine.wait(token, None if timeout is None else max(0, int(timeout * 1000)))
        return await self._session()

    async def progress(self, token: str) -> rpc.SessionInfo:
        self.machine.progress(token)
        return await self._session()

    async def cancel(self, token: str, reason: str = "") -> rpc.SessionInfo:
        self.machine.cancel(token, reason)
        return await self._session()

    async def close_session(self, token: str) -> rpc.SessionInfo:
        """End the session (cancelled if it still runs); an uncommitted dump's files are removed."""
        try:
            self.machine.close_session(token)
            return await self._session()
        finally:
            self._files.forget(token)

    def close(self) -> None:
        """Close every session's files and hang up (the daemon's side sees the peer go)."""
        self._files.close()
        self.channel.sock.close()
