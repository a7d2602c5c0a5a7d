"""The RPC protocol, sans I/O on both sides: frames, fds and their ownership, wire errors, server and client.

The client's side: typed requests (`requests`, `Call`), one connection (`ClientConnection`: Hello, ids,
pairing, transcripts) and the client-session state machine over it (`ClientMachine`, its `events`).
docs/protocol.md is the specification; proto/vramd/pb/rpc.proto holds the messages.
"""
from .client import Call, ClientBo, ClientFile, Outgoing, decode_response, encode_request, pack_bos
from .connection import ClientConnection, ConnState, Transcript
from .events import (
    BeginDump,
    Commit,
    CreateDataFile,
    CreateManifest,
    Done,
    DropDataFiles,
    Event,
    Failed,
    OpenDataFile,
    OpenManifest,
    ReleaseFiles,
    Send,
    SessionPhase,
)
from .fds import FdBundle, close_fds, pack_fds, unpack_fds
from .frames import DEFAULT_MAX_MESSAGE, HEADER_SIZE, PROTOCOL_VERSIONS, SCM_MAX_FD, decode_frame, encode_frame
from .requests import OpenSpec
from .server import Received, Reply, ServerProtocol, reply, response
from .session import ClientMachine
from .wire import error_from_pb, error_to_pb, raise_for_error

__all__ = [
    "DEFAULT_MAX_MESSAGE", "HEADER_SIZE", "PROTOCOL_VERSIONS", "SCM_MAX_FD", "BeginDump", "Call", "ClientBo",
    "ClientConnection", "ClientFile", "ClientMachine", "Commit", "ConnState", "CreateDataFile", "CreateManifest",
    "Done", "DropDataFiles", "Event", "Failed", "FdBundle", "OpenDataFile", "OpenManifest", "OpenSpec", "Outgoing",
    "Received", "ReleaseFiles", "Reply", "Send", "ServerProtocol", "SessionPhase", "Transcript", "close_fds",
    "decode_frame", "decode_response", "encode_frame", "encode_request", "error_from_pb", "error_to_pb",
    "pack_bos", "pack_fds", "raise_for_error", "reply", "response", "unpack_fds",
]
