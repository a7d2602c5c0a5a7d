"""The client's requests, sans I/O: typed request values, the frame codec, and the packing of BOs and files.

- `ClientBo`, `ClientFile`: what a client hands over (the fds stay its own).
- `Call`: one typed request (its body, the fds to attach, and each fd's role in
  a transcript); built by the typed builders of `vramd.protocol.requests`.
- `Outgoing`: one packet to send (the framed request and its fds).
- `pack_bos`: BO lists split into AddBos messages under the negotiated limits,
  each fd attached once per message.

The connection (`vramd.protocol.connection`) numbers and pairs requests; the
session machine (`vramd.protocol.session`) sequences them.  The C client
(native/client) packs by the same rules, so one transcript fits both.
"""
from __future__ import annotations

import socket
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from ..errors import ProtocolError
from ..pb import rpc_pb2 as rpc
from .frames import DEFAULT_MAX_MESSAGE, KIND_REQUEST, KIND_RESPONSE, decode_frame, encode_frame

TARGET_MESSAGE_BYTES = 64 << 10  # what AddBos and AttachFiles packing aims for: well under every socket buffer
_BO_OVERHEAD = 8                 # bytes a Bo's (or FileRef's) field tag and length add inside its message
MESSAGE_SLACK = 1024             # room a message keeps for the header, the token and the Request wrapper

# The request bodies, and the Response body each one's successful answer carries.
RequestBody = (rpc.Hello | rpc.OpenSession | rpc.AttachFiles | rpc.AddBos | rpc.Start | rpc.GetProgress | rpc.Wait
               | rpc.Cancel | rpc.CloseSession | rpc.GetStatus | rpc.ListSessions)
_FIELD: dict[type[RequestBody], str] = {
    rpc.Hello: "hello", rpc.OpenSession: "open_session", rpc.AttachFiles: "attach_files", rpc.AddBos: "add_bos",
    rpc.Start: "start", rpc.GetProgress: "get_progress", rpc.Wait: "wait", rpc.Cancel: "cancel",
    rpc.CloseSession: "close_session", rpc.GetStatus: "get_status", rpc.ListSessions: "list_sessions",
}
_ANSWER = {"hello": "hello", "get_status": "status", "list_sessions": "sessions"}  # any other: "session"


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

    def roles(self) -> tuple[str, ...]:
        """The transcript roles of its fds: "dump-data:gpu=G:stripe=S" (a dump's own) or "data:K:NAME", and
        the O_DIRECT twin's with "+direct"."""
        role = (f"data:{self.image}:{self.name}" if self.gpu_id is None
                else f"dump-data:gpu={self.gpu_id}:stripe={self.stripe}")
        return (role,) if self.direct_fd is None else (role, role + "+direct")


@dataclass(frozen=True)
class Call:
    """One request to send: its body, the fds it attaches (the caller's) and each fd's transcript role.

    Build it with the typed builders of `vramd.protocol.requests`; the
    connection gives it its id (`request`)."""

    body: RequestBody
    fds: tuple[int, ...] = ()
    roles: tuple[str, ...] = ()  # one per fd (docs/protocol.md, "Transcripts")

    def __post_init__(self) -> None:
        if len(self.roles) != len(self.fds):
            raise ValueError(f"{len(self.fds)} fds and {len(self.roles)} roles")

    @property
    def field(self) -> str:
        """The Request's oneof field this body goes in ("open_session", ...)."""
        return _FIELD[type(self.body)]

    @property
    def answer(self) -> str:
        """The Response body a successful answer carries ("hello", "session", "status" or "sessions")."""
        return _ANSWER.get(self.field, "session")

    def request(self, request_id: int) -> rpc.Request:
        req = rpc.Request(id=request_id)
        getattr(req, self.field).CopyFrom(self.body)
        return req


@dataclass(frozen=True)
class Outgoing:
    """One packet to send: the request, its frame and the fds to attach (still the caller's; the kernel
    duplicates them), with their transcript roles."""

    request: rpc.Request
    data: bytes
    fds: tuple[int, ...] = ()
    roles: tuple[str, ...] = ()


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


def message_budget(max_message_bytes: int) -> int:
    """The bytes an AddBos or AttachFiles message aims for under the daemon's `max_message_bytes` (0: the
    default), as libvramd's message_budget."""
    return min(TARGET_MESSAGE_BYTES, (max_message_bytes or DEFAULT_MAX_MESSAGE) - MESSAGE_SLACK)


def bo_message(b: ClientBo, fd_index: int) -> rpc.Bo:
    bo = rpc.Bo(id=b.id, size=b.size, alloc_flags=b.alloc_flags, va_addr=b.va_addr, name=b.name,
                backend=b.backend, offset=b.offset, fd_index=fd_index)
    if b.gpu_id is not None:
        bo.gpu_id = b.gpu_id
    return bo


def pack_bos(token: str, bos: Sequence[ClientBo], *, max_message_bytes: int,
             max_fds: int) -> Iterator[tuple[list[rpc.Bo], list[int], list[str]]]:
    """Split `bos` into AddBos messages: (Bo list, fds to attach, their roles "bo:<id>" of the first BO that
    names each fd).  Each message stays within the byte budget and `max_fds`; an fd named by several BOs of
    one message is attached once."""
    budget = message_budget(max_message_bytes)
    msg: list[rpc.Bo] = []
    index: dict[int, int] = {}
    roles: list[str] = []
    size = len(token) + _BO_OVERHEAD
    for b in bos:
        new_fd = b.fd not in index
        bo = bo_message(b, len(index) if new_fd else index[b.fd])
        bo_bytes = bo.ByteSize() + _BO_OVERHEAD
        if msg and (size + bo_bytes > budget or (new_fd and len(index) >= max_fds)):
            yield msg, list(index), roles
            msg, index, roles, size, new_fd = [], {}, [], len(token) + _BO_OVERHEAD, True
            bo = bo_message(b, 0)
            bo_bytes = bo.ByteSize() + _BO_OVERHEAD
        if new_fd:
            index[b.fd] = len(index)
            roles.append(f"bo:{b.id}")
        msg.append(bo)
        size += bo_bytes
    if msg:
        yield msg, list(index), roles


def file_ref(f: ClientFile, fd_index: int) -> rpc.FileRef:
    """`f` as a FileRef whose fd is at `fd_index` (its O_DIRECT twin, if any, right after it)."""
    ref = rpc.FileRef(image=f.image, name=f.name, fd_index=fd_index)
    if f.direct_fd is not None:
        ref.direct_fd_index = fd_index + 1
    if f.gpu_id is not None:
        ref.gpu_id = f.gpu_id
    if f.stripe:
        ref.stripe = f.stripe
    return ref


DUMP_REF_BYTES = 64  # the budget a dump's own data file's FileRef takes (a name of 36 bytes, gpu, stripe, indexes)


def needed_ref_bytes(image: int, name: str, fd_index: int, *, direct: bool) -> int:
    """The budget a FileRef of a file the daemon asked for takes in an AttachFiles message, as libvramd counts
    it: its encoded size (with an O_DIRECT twin where `direct`) plus the field's overhead."""
    probe = rpc.FileRef(image=image, name=name, fd_index=fd_index)
    if direct:
        probe.direct_fd_index = fd_index + 1
    return probe.ByteSize() + _BO_OVERHEAD
