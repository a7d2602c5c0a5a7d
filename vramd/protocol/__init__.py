"""The RPC protocol, sans I/O on both sides: frames, fds and their ownership, wire errors, server and client.

docs/protocol.md is the specification; proto/vramd/pb/rpc.proto holds the messages.
"""
from .client import ClientBo, ClientFile, ClientProtocol, Outgoing, decode_response, encode_request
from .fds import FdBundle, close_fds, pack_fds, unpack_fds
from .frames import DEFAULT_MAX_MESSAGE, HEADER_SIZE, PROTOCOL_VERSIONS, SCM_MAX_FD, decode_frame, encode_frame
from .server import Received, Reply, ServerProtocol, reply, response
from .wire import error_from_pb, error_to_pb, raise_for_error

__all__ = [
    "DEFAULT_MAX_MESSAGE", "HEADER_SIZE", "PROTOCOL_VERSIONS", "SCM_MAX_FD", "ClientBo", "ClientFile", "ClientProtocol",
    "FdBundle", "Outgoing", "Received", "Reply", "ServerProtocol", "close_fds", "decode_frame", "decode_response",
    "encode_frame", "encode_request", "error_from_pb", "error_to_pb", "pack_fds", "raise_for_error", "reply",
    "response", "unpack_fds",
]
