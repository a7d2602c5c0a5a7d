"""The RPC protocol, sans I/O: frames and fds in, events out.

Nothing here touches a socket.  The daemon's transport hands each received
packet (bytes, the fds that came with it, the recvmsg flags) to
`ServerProtocol.receive` and gets back events: a `Received` request to
dispatch (with its fds in an `FdBundle` that owns them) or a `Reply` to send
(possibly closing the connection).  The client uses `encode_request` /
`decode_response`.  docs/protocol.md specifies the wire format.
"""
from __future__ import annotations

import os
import socket
import struct
from dataclasses import dataclass

from .errors import (
    BadDescriptorError,
    LimitExceededError,
    ProtocolError,
    UnsupportedProtocolError,
    VramdError,
    error_from_wire,
)
from .pb import rpc_pb2 as rpc

MAGIC = b"VRDP"
FRAME_VERSION = 1
KIND_REQUEST = 1
KIND_RESPONSE = 2
_HEADER = struct.Struct("<4sBBHI")  # magic, frame version, kind, reserved (0), body length
HEADER_SIZE = _HEADER.size

PROTOCOL_VERSIONS = (1,)        # what this code speaks, newest last
SCM_MAX_FD = 253                # the kernel's limit of fds in one SCM_RIGHTS message
DEFAULT_MAX_MESSAGE = 1 << 20   # bytes in one packet, header included


def encode_frame(kind: int, message) -> bytes:
    body = message.SerializeToString()
    return _HEADER.pack(MAGIC, FRAME_VERSION, kind, 0, len(body)) + body


def decode_frame(data: bytes, kind: int) -> bytes:
    """The body of one packet, after checking its header; raises ProtocolError."""
    if len(data) < HEADER_SIZE:
        raise ProtocolError(f"frame of {len(data)} bytes is shorter than its {HEADER_SIZE}-byte header")
    magic, version, got_kind, reserved, length = _HEADER.unpack_from(data)
    if magic != MAGIC:
        raise ProtocolError(f"bad frame magic {magic!r} (expected {MAGIC!r})")
    if version != FRAME_VERSION:
        raise ProtocolError(f"unknown frame version {version}")
    if got_kind != kind:
        raise ProtocolError(f"frame kind {got_kind}, expected {kind}")
    if reserved:
        raise ProtocolError("reserved frame header bits are set")
    if length != len(data) - HEADER_SIZE:
        raise ProtocolError(f"frame says {length} body bytes, packet has {len(data) - HEADER_SIZE}")
    return data[HEADER_SIZE:]


def error_to_pb(exc: VramdError) -> rpc.Error:
    code = exc.code if exc.code in rpc.Code.keys() else "VRAMD_ERROR"
    err = rpc.Error(code=rpc.Code.Value(code), message=exc.message)
    if exc.bo_id is not None:
        err.bo_id = exc.bo_id
    if exc.offset is not None:
        err.offset = exc.offset
    return err


def error_from_pb(err: rpc.Error) -> VramdError:
    return error_from_wire(rpc.Code.Name(err.code), err.message,
                           err.bo_id if err.HasField("bo_id") else None,
                           err.offset if err.HasField("offset") else None)


def close_fds(fds) -> None:
    """Close every fd of `fds`, whatever state each is in (one failing does not stop the rest)."""
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass


class FdBundle:
    """The fds that arrived with one packet; closes every fd nobody took."""

    def __init__(self, fds: list[int]):
        self._fds: list[int | None] = list(fds)

    def __len__(self) -> int:
        return len(self._fds)

    def peek(self, index: int) -> int:
        """The fd at `index` (still owned by the bundle); raises BadDescriptorError if absent."""
        if not 0 <= index < len(self._fds) or self._fds[index] is None:
            raise BadDescriptorError(f"fd index {index} names no fd ({len(self._fds)} attached to this message)")
        return self._fds[index]

    def take(self, index: int) -> int:
        """Take ownership of the fd at `index`; the caller must close it."""
        fd = self.peek(index)
        self._fds[index] = None
        return fd

    def close(self) -> None:
        fds, self._fds = [fd for fd in self._fds if fd is not None], [None] * len(self._fds)
        close_fds(fds)


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


def response(request_id: int, error: VramdError | None = None, **body) -> rpc.Response:
    resp = rpc.Response(id=request_id, **body)
    if error is not None:
        resp.error.CopyFrom(error_to_pb(error))
    return resp


def reply(request_id: int, error: VramdError | None = None, *, close: bool = False, **body) -> Reply:
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
            raise LimitExceededError(f"fds were dropped: more than {self.max_fds} fds in one message")
        if flags & socket.MSG_TRUNC or len(data) > self.max_message_bytes:
            raise LimitExceededError(f"message larger than the limit of {self.max_message_bytes} bytes")
        if len(bundle) > self.max_fds:
            raise LimitExceededError(f"{len(bundle)} fds in one message; the limit is {self.max_fds}")
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


# --- client side -------------------------------------------------------------

def encode_request(request: rpc.Request) -> bytes:
    return encode_frame(KIND_REQUEST, request)


def decode_response(data: bytes, flags: int = 0) -> rpc.Response:
    if flags & socket.MSG_TRUNC:
        raise ProtocolError("response larger than the receive buffer")
    resp = rpc.Response()
    try:
        resp.ParseFromString(decode_frame(data, KIND_RESPONSE))
    except ProtocolError:
        raise
    except Exception as e:
        raise ProtocolError(f"undecodable response: {e}") from None
    return resp


def raise_for_error(resp: rpc.Response) -> rpc.Response:
    if resp.error.code != rpc.OK:
        raise error_from_pb(resp.error)
    return resp


__all__ = [
    "DEFAULT_MAX_MESSAGE", "FdBundle", "close_fds", "HEADER_SIZE", "PROTOCOL_VERSIONS", "Received",
    "Reply", "SCM_MAX_FD", "ServerProtocol", "decode_frame", "decode_response", "encode_frame", "encode_request",
    "error_from_pb", "error_to_pb", "raise_for_error", "reply", "response",
]
