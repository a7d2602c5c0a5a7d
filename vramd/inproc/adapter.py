"""The client's side of an in-process connection: the sans-io `ClientProtocol` over an asyncio packet channel.

The only code here that touches the socket; the session's steps are
session.py's.  (Kept this small so that a client-session state machine can
take the protocol's place without the steps changing.)
"""
from __future__ import annotations

import os
import socket

from .. import __version__
from ..errors import BadDescriptorError
from ..pb import rpc_pb2 as rpc
from ..protocol.client import ClientProtocol, Outgoing
from ..protocol.frames import DEFAULT_MAX_MESSAGE, HEADER_SIZE
from ..protocol.wire import raise_for_error
from ..service.transport import PacketChannel


class Connection:
    """One connection to an in-process daemon (host.py): requests answered in order, one at a time."""

    def __init__(self, sock: socket.socket, name: str = "inproc") -> None:
        self.protocol = ClientProtocol(f"{name} {__version__}")
        self.channel = PacketChannel(sock, max_bytes=DEFAULT_MAX_MESSAGE + HEADER_SIZE)

    @property
    def hello_reply(self) -> rpc.HelloReply:
        assert self.protocol.hello is not None, "hello() first"
        return self.protocol.hello

    async def hello(self) -> rpc.HelloReply:
        await self.call(self.protocol.hello_request())
        return self.hello_reply

    async def exchange(self, out: Outgoing) -> rpc.Response:
        """Send one request (its fds: the kernel duplicates them), return its response, its error not raised.
        An fd that is not open cannot travel (sendmsg: EBADF): BAD_DESCRIPTOR here, the request not sent."""
        for fd in out.fds:
            try:
                os.fstat(fd)
            except OSError as e:
                self.protocol.waiting_for = None  # never sent: no answer to wait for
                raise BadDescriptorError(f"fd {fd} is not usable: {e.strerror}; not sent") from None
        if not await self.channel.send(out.data, out.fds):
            raise ConnectionError("the in-process daemon closed the connection")
        packet = await self.channel.recv()
        if packet is None:
            raise ConnectionError("the in-process daemon closed the connection")
        return self.protocol.receive(*packet)

    async def call(self, out: Outgoing) -> rpc.Response:
        """`exchange`, the response's typed error raised."""
        return raise_for_error(await self.exchange(out))

    async def session_call(self, out: Outgoing) -> rpc.SessionInfo:
        return (await self.call(out)).session

    def close(self) -> None:
        self.channel.sock.close()
