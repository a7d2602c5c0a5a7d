"""The RPC protocol on the daemon's side, sans I/O: packets and their fds in, events out.

Nothing here touches a socket.  The daemon's transport hands each received
packet (bytes, the fds that came with it, the recvmsg flags) to
`ServerProtocol.receive` and gets back events: a `Received` request to
dispatch (with its fds in an `FdBundle` that owns them) or a `Reply` to send
(possibly closing the connection).  docs/protocol.md specifies the wire format.
"""
from __future__ import annotations

import socket
from dataclasses import dataclass

from ..errors import LimitExceededError, ProtocolError, UnsupportedProtocolError, VramdError
from ..pb import rpc_pb2 as rpc
from .fds import FdBundle
from .frames import (
    DEFAULT_MAX_MESSAGE,
    KIND_REQUEST,
    KIND_RESPONSE,
    PROTOCOL_VERSIONS,
    SCM_MAX_FD,
    decode_frame,
    encode_frame,
)
from .wire import error_to_pb


@dataclass
class Received:
    """A request to dispatch; its fds belong to the bundle until taken."""

    request: rpc.Request
    fds: FdBundle


@dataclass
class Reply:
    """A response to send; `close`: close the connection after it."""

    data: bytes
    close: bool = False


ResponseBody = rpc.HelloReply | rpc.SessionInfo | rpc.StatusReply | rpc.SessionList  # by its field's name


def response(request_id: int, error: VramdError | None = None, **body: ResponseBody) -> rpc.Response:
    """The Response to `request_id`: `error` (None: OK) and at most one body, by its field (`session=info`)."""
    resp = rpc.Response(id=request_id)
    for name, value in body.items():
        getattr(resp, name).CopyFrom(value)
    if error is not None:
        resp.error.CopyFrom(error_to_pb(error))
    return resp


def reply(request_id: int, error: VramdError | None = None, *, close: bool = False, **body: ResponseBody) -> Reply:
    return Reply(encode_frame(KIND_RESPONSE, response(request_id, error, **body)), close)


@dataclass
class ServerProtocol:
    """One connection's protocol state, on the daemon's side.

    `hello` is what the daemon says about itself (backends, GPUs, limits);
    the protocol fills in the negotiated version.
    """

    hello: rpc.HelloReply
    max_message_bytes: int = DEFAULT_MAX_MESSAGE
    max_fds: int = SCM_MAX_FD
    version: int | None = None  # set once Hello has been answered
    closed: bool = False

    def refuse(self, exc: VramdError) -> list[Reply]:
        """Say why the peer is not served, then close (e.g. an unauthorised uid)."""
        self.closed = True
        return [reply(0, exc, close=True)]

    def receive(self, data: bytes, fds: list[int], flags: int = 0) -> list[Received | Reply]:
        """The events one packet makes; every fd of it is owned by an event or already closed."""
        bundle = FdBundle(fds)
        if self.closed:
            bundle.close()
            return []
        try:
            return self._receive(data, bundle, flags)
        except VramdError as e:
            bundle.close()
            self.closed = True
            return [reply(0, e, close=True)]

    def _receive(self, data: bytes, bundle: FdBundle, flags: int) -> list[Received | Reply]:
        if flags & socket.MSG_CTRUNC:
            raise LimitExceededError(f"fds were dropped: more than {self.max_fds} fds in one message "
                                     "(max_fds_per_message)")
        if flags & socket.MSG_TRUNC or len(data) > self.max_message_bytes:
            raise LimitExceededError(f"message larger than the limit of {self.max_message_bytes} bytes "
                                     "(max_message_bytes)")
        if len(bundle) > self.max_fds:
            raise LimitExceededError(f"{len(bundle)} fds in one message; the limit is {self.max_fds} "
                                     "(max_fds_per_message)")
        body = decode_frame(data, KIND_REQUEST)
        req = rpc.Request()
        try:
            req.ParseFromString(body)
        except Exception as e:  # protobuf raises DecodeError (and others on hostile input)
            raise ProtocolError(f"undecodable request: {e}") from None
        kind = req.WhichOneof("body")
        if kind is None:
            raise ProtocolError("request with no body (unknown request type?)")
        if self.version is None:
            if kind != "hello":
                raise ProtocolError(f"the first request must be hello, not {kind}")
            bundle.close()
            return [self._hello(req)]
        if kind == "hello":
            raise ProtocolError("hello sent twice")
        return [Received(req, bundle)]

    def _hello(self, req: rpc.Request) -> Reply:
        common = set(req.hello.versions) & set(PROTOCOL_VERSIONS)
        if not common:
            self.closed = True
            return reply(req.id, UnsupportedProtocolError(
                f"client speaks protocol versions {list(req.hello.versions)}, daemon speaks {list(PROTOCOL_VERSIONS)}"),
                close=True)
        self.version = max(common)
        hello = rpc.HelloReply()
        hello.CopyFrom(self.hello)
        hello.version = self.version
        return reply(req.id, hello=hello)
