"""The frame: a 12-byte header and one protobuf message per SOCK_SEQPACKET packet (docs/protocol.md)."""
from __future__ import annotations

import struct

from google.protobuf.message import Message

from ..errors import ProtocolError

MAGIC = b"VRDP"
FRAME_VERSION = 1
KIND_REQUEST = 1
KIND_RESPONSE = 2
_HEADER = struct.Struct("<4sBBHI")  # magic, frame version, kind, reserved (0), body length
HEADER_SIZE = _HEADER.size

PROTOCOL_VERSIONS = (2,)        # what this code speaks, newest last (2: the client opens every image file)
SCM_MAX_FD = 253                # the kernel's limit of fds in one SCM_RIGHTS message
DEFAULT_MAX_MESSAGE = 1 << 20   # bytes in one packet, header included


def encode_frame(kind: int, message: Message) -> bytes:
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
