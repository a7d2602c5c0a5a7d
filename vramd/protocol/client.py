"""The RPC protocol on the client's side, sans I/O: requests out as packets, packets in as responses.

`ClientProtocol` holds one connection's state: request ids, the Hello
exchange and what it negotiated (version, the daemon's limits), and the
packing of BO lists into AddBos messages under those limits.  It produces
`Outgoing` packets (bytes + the fds to attach) and takes received packets
back; the socket belongs to an adapter (vramd.client for blocking sockets).
The C client (native/client) implements the same rules.
"""
from __future__ import annotations

import itertools
import socket
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..errors import ProtocolError
from ..pb import rpc_pb2 as rpc
from .fds import close_fds
from .frames import (
    DEFAULT_MAX_MESSAGE,
    HEADER_SIZE,
    KIND_REQUEST,
    KIND_RESPONSE,
    PROTOCOL_VERSIONS,
    SCM_MAX_FD,
    decode_frame,
    encode_frame,
)
from .wire import raise_for_error

TARGET_MESSAGE_BYTES = 64 << 10  # what AddBos packing aims for per message: well under every socket buffer
_BO_OVERHEAD = 8                 # bytes a Bo's field tag and length add inside an AddBos message


@dataclass
class ClientBo:
    """One BO for AddBos: `fd` is the caller's (procmem: /proc/<pid>/mem; mmap: memfd/dmabuf/file)."""

    id: int
    fd: int
    offset: int = 0
    size: int = 0
    backend: str = ""
    gpu_id: int | None = None
    alloc_flags: int = 0
    va_addr: int = 0
    name: str = ""


@dataclass
class ClientFile:
    """One image file for AttachFiles, opened by the client (the fds stay the caller's)."""

    image: int                  # 0: the session's image; k: its k-th parent
    name: str                   # its name in that image's directory (a dump's data file: without ".tmp")
    fd: int
    direct_fd: int | None = None  # the same file opened with O_DIRECT, where the file system allows
    gpu_id: int | None = None     # a dump's own data file
    stripe: int = 0               # a dump's own data file: which of the GPU's (SessionInfo.data_files_per_gpu)


@dataclass
class Outgoing:
    """One packet to send: the frame and the fds to attach (still the caller's; the kernel duplicates them)."""

    request: rpc.Request
    data: bytes
    fds: Sequence[int] = field(default_factory=tuple)


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
    except Exception as e:  # protobuf raises DecodeError (and others on hostile input)
        raise ProtocolError(f"undecodable response: {e}") from None
    return resp


class ClientProtocol:
    """One connection, the client's side.  Requests are answered in order, one at a time."""

    def __init__(self, client_name: str) -> None:
        self.client_name = client_name
        self._ids = itertools.count(1)
        self.hello: rpc.HelloReply | None = None  # set once the daemon answered Hello
        self.waiting_for: int | None = None       # the id of the request sent and not yet answered

    @property
    def limits(self) -> rpc.Limits:
        """The daemon's limits (defaults before Hello is answered)."""
        return self.hello.limits if self.hello is not None else rpc.Limits()

    @property
    def version(self) -> int | None:
        return self.hello.version if self.hello is not None else None

    @property
    def max_response_bytes(self) -> int:
        """The receive buffer a response needs."""
        return (self.limits.max_message_bytes or DEFAULT_MAX_MESSAGE) + HEADER_SIZE

    def request(self, fds: Sequence[int] = (), **body: Any) -> Outgoing:
        """The packet for one request; its response must be received before the next request."""
        if self.waiting_for is not None:
            raise ProtocolError(f"request {self.waiting_for} is still unanswered")
        req = rpc.Request(id=next(self._ids), **body)
        self.waiting_for = req.id
        return Outgoing(req, encode_request(req), tuple(fds))

    def hello_request(self) -> Outgoing:
        return self.request(hello=rpc.Hello(versions=PROTOCOL_VERSIONS, client=self.client_name))

    def cancel_request(self, *, token: str = "", session_id: int | None = None, reason: str = "") -> Outgoing:
        """Cancel one session: by its token (as a holder) or by its session id (an operator: uid 0 or the
        daemon's uid).  Exactly one of the two."""
        if bool(token) == (session_id is not None):
            raise ValueError("cancel a session by its token or by its session id: exactly one of them")
        body = rpc.Cancel(token=token, reason=reason)
        if session_id is not None:
            body.session_id = session_id
        return self.request(cancel=body)

    def list_sessions_request(self) -> Outgoing:
        """The caller's uid's sessions; every uid's for uid 0 and the daemon's own uid."""
        return self.request(list_sessions=rpc.ListSessions())

    def receive(self, data: bytes, fds: Sequence[int] = (), flags: int = 0) -> rpc.Response:
        """The response in one received packet (its error not raised).

        The daemon never sends fds: any that came are closed.  A response to
        Hello records what was negotiated (raising the daemon's refusal).
        """
        close_fds(fds)
        if not data:
            raise ConnectionError("the daemon closed the connection")
        resp = decode_response(data, flags)
        expected, self.waiting_for = self.waiting_for, None
        if expected is None:
            raise ProtocolError(f"response {resp.id} to no request")
        if resp.id not in (expected, 0):  # 0: an answer sent before the request could be read (a refusal)
            raise ProtocolError(f"response for request {resp.id}, expected {expected}")
        if self.hello is None:
            self.hello = raise_for_error(resp).hello
        return resp

    def open_session_request(self, kind: rpc.SessionKind, *, manifest_fd: int | None = None,
                             parent_manifest_fds: Sequence[int] = (), **options: Any) -> Outgoing:
        """OpenSession: a restore's or verify's manifest (`manifest_fd`), an incremental image's parents'
        manifests (nearest first), and the other OpenSession fields by name."""
        fds = ([manifest_fd] if manifest_fd is not None else []) + list(parent_manifest_fds)
        first = 0 if manifest_fd is None else 1
        body = rpc.OpenSession(kind=kind, manifest_fd_index=0,
                               parent_manifest_fd_indexes=range(first, first + len(parent_manifest_fds)), **options)
        return self.request(fds, open_session=body)

    def attach_requests(self, token: str, files: Sequence[ClientFile]) -> Iterator[Outgoing]:
        """The AttachFiles packets for `files`, each within the daemon's limit of fds per message (a file
        takes one fd, two with its O_DIRECT twin).  Each is produced when the previous one was answered."""
        max_fds = min(self.limits.max_fds_per_message or SCM_MAX_FD, SCM_MAX_FD)
        refs: list[rpc.FileRef] = []
        fds: list[int] = []
        for f in files:
            need = 1 if f.direct_fd is None else 2
            if refs and len(fds) + need > max_fds:
                yield self.request(fds, attach_files=rpc.AttachFiles(token=token, files=refs))
                refs, fds = [], []
            ref = rpc.FileRef(image=f.image, name=f.name, fd_index=len(fds))
            fds.append(f.fd)
            if f.direct_fd is not None:
                ref.direct_fd_index = len(fds)
                fds.append(f.direct_fd)
            if f.gpu_id is not None:
                ref.gpu_id = f.gpu_id
            if f.stripe:
                ref.stripe = f.stripe
            refs.append(ref)
        if refs:
            yield self.request(fds, attach_files=rpc.AttachFiles(token=token, files=refs))

    def start_request(self, token: str, manifest_fd: int | None = None) -> Outgoing:
        """Start; a dump's names the manifest's temporary file the client created."""
        body = rpc.Start(token=token)
        if manifest_fd is None:
            return self.request(start=body)
        body.manifest_fd_index = 0
        return self.request([manifest_fd], start=body)

    def add_bos_requests(self, token: str, bos: Sequence[ClientBo]) -> Iterator[Outgoing]:
        """The AddBos packets for `bos`, each within the daemon's limits of bytes and fds per message.

        An fd named by several BOs of one message is attached once.  Each
        packet is produced when the previous one has been answered.
        """
        for msg, fds in self.pack_bos(token, bos):
            yield self.request(fds, add_bos=rpc.AddBos(token=token, bos=msg))

    def pack_bos(self, token: str, bos: Sequence[ClientBo]) -> Iterator[tuple[list[rpc.Bo], list[int]]]:
        """Split `bos` into (messages' Bo lists, fds to attach) under the negotiated limits."""
        limits = self.limits
        max_fds = min(limits.max_fds_per_message or SCM_MAX_FD, SCM_MAX_FD)
        budget = min(TARGET_MESSAGE_BYTES, (limits.max_message_bytes or TARGET_MESSAGE_BYTES) - 1024)
        msg: list[rpc.Bo] = []
        index: dict[int, int] = {}
        size = len(token) + _BO_OVERHEAD
        for b in bos:
            bo = rpc.Bo(id=b.id, size=b.size, alloc_flags=b.alloc_flags, va_addr=b.va_addr, name=b.name,
                        backend=b.backend, offset=b.offset)
            if b.gpu_id is not None:
                bo.gpu_id = b.gpu_id
            new_fd = b.fd not in index
            bo_bytes = bo.ByteSize() + _BO_OVERHEAD
            if msg and (size + bo_bytes > budget or (new_fd and len(index) >= max_fds)):
                yield msg, list(index)
                msg, index, size, new_fd = [], {}, len(token) + _BO_OVERHEAD, True
            if new_fd:
                index[b.fd] = len(index)
            bo.fd_index = index[b.fd]
            msg.append(bo)
            size += bo_bytes
        if msg:
            yield msg, list(index)
