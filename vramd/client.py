"""A blocking client for the vramd daemon (what vramctl and tests use).

    with Client() as c:                       # connects, says Hello
        s = c.open_session(SESSION_DUMP, dir_fd, compression="zstd")
        c.add_bos(s.token, [ClientBo(1, mem_fd, offset=addr, size=n)])
        c.start(s.token)
        info = c.wait(s.token)                # the barrier; raises the job's typed error

Every fd passed in stays the caller's: the daemon gets duplicates through
SCM_RIGHTS.  add_bos splits big BO lists into messages within the daemon's
limits (bytes and fds per message).
"""
from __future__ import annotations

import itertools
import socket
from dataclasses import dataclass

from . import __version__
from .config import client_socket_path
from .errors import ProtocolError, VramdError, WaitTimeoutError
from .pb import rpc_pb2 as rpc
from .protocol import HEADER_SIZE, PROTOCOL_VERSIONS, decode_response, encode_request, raise_for_error
from .transport import pack_fds, unpack_fds

SESSION_DUMP, SESSION_RESTORE, SESSION_VERIFY = rpc.SESSION_DUMP, rpc.SESSION_RESTORE, rpc.SESSION_VERIFY
TARGET_MESSAGE_BYTES = 64 << 10  # what add_bos aims for per message: well under every socket buffer


@dataclass
class ClientBo:
    """One BO for add_bos: `fd` is the caller's (procmem: /proc/<pid>/mem; mmap: memfd/dmabuf/file)."""

    id: int
    fd: int
    offset: int = 0
    size: int = 0
    backend: str = ""
    gpu_id: int | None = None
    alloc_flags: int = 0
    va_addr: int = 0
    name: str = ""


class Client:
    def __init__(self, path: str | None = None, *, timeout: float | None = None, name: str = "python"):
        self.path = path or client_socket_path()
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        self.sock.settimeout(timeout)
        self._ids = itertools.count(1)
        try:
            try:
                self.sock.connect(self.path)
            except OSError as e:
                raise ConnectionError(f"cannot connect to vramd at {self.path}: {e.strerror or e}") from None
            self.hello = self._call(fds=(), hello=rpc.Hello(versions=PROTOCOL_VERSIONS, client=f"{name} {__version__}"),
                                    want="hello")
        except BaseException:
            self.sock.close()
            raise
        self.limits = self.hello.limits

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self.sock.close()

    # --- transport -----------------------------------------------------------

    def request(self, fds=(), **body) -> rpc.Response:
        """Send one request, return its response (error included, not raised)."""
        req = rpc.Request(id=next(self._ids), **body)
        max_bytes = getattr(self, "limits", None) and self.limits.max_message_bytes or (1 << 20)
        try:
            self.sock.sendmsg([encode_request(req)], pack_fds(list(fds)))
            data, anc, flags, _ = self.sock.recvmsg(max_bytes + HEADER_SIZE, socket.CMSG_SPACE(4 * 4))
        except socket.timeout:
            # The reply may still come and would be taken for the next request's: this
            # connection is unusable now.  (Use wait(timeout=...) for bounded barriers.)
            self.close()
            raise TimeoutError(f"no reply from vramd within {self.sock.gettimeout()} s; connection closed") from None
        for fd in unpack_fds(anc):  # the daemon never sends fds; never leak one
            socket.close(fd)
        if not data:
            raise ConnectionError(f"the daemon at {self.path} closed the connection")
        resp = decode_response(data, flags)
        if resp.id not in (req.id, 0):
            raise ProtocolError(f"response for request {resp.id}, expected {req.id}")
        return resp

    def _call(self, fds=(), want: str | None = None, **body):
        resp = raise_for_error(self.request(fds, **body))
        return getattr(resp, want) if want else resp

    # --- sessions ------------------------------------------------------------

    def open_session(self, kind: int, dir_fd: int, *, compression: str = "", chunk_size: int = 0, label: str = "",
                     allow_partial: bool = False) -> rpc.SessionInfo:
        return self._call([dir_fd], want="session", open_session=rpc.OpenSession(
            kind=kind, dir_fd_index=0, compression=compression, chunk_size=chunk_size, label=label,
            allow_partial=allow_partial))

    def add_bos(self, token: str, bos: list[ClientBo]) -> rpc.SessionInfo:
        info = None
        for msg_bos, fds in self._batches(token, bos):
            info = self._call(fds, want="session", add_bos=rpc.AddBos(token=token, bos=msg_bos))
        return info if info is not None else self.progress(token)

    def _batches(self, token: str, bos: list[ClientBo]):
        max_fds = min(self.limits.max_fds_per_message or 253, 253)
        budget = min(TARGET_MESSAGE_BYTES, (self.limits.max_message_bytes or TARGET_MESSAGE_BYTES) - 1024)
        msg: list[rpc.Bo] = []
        index: dict[int, int] = {}
        size = len(token) + 8
        for b in bos:
            bo = rpc.Bo(id=b.id, size=b.size, alloc_flags=b.alloc_flags, va_addr=b.va_addr, name=b.name,
                        backend=b.backend, offset=b.offset)
            if b.gpu_id is not None:
                bo.gpu_id = b.gpu_id
            new_fd = b.fd not in index
            bo_bytes = bo.ByteSize() + 8
            if msg and (size + bo_bytes > budget or (new_fd and len(index) >= max_fds)):
                yield msg, list(index)
                msg, index, size, new_fd = [], {}, len(token) + 8, True
            if new_fd:
                index[b.fd] = len(index)
            bo.fd_index = index[b.fd]
            msg.append(bo)
            size += bo_bytes
        if msg:
            yield msg, list(index)

    def run_session(self, kind: int, dir_fd: int, bos: list[ClientBo], **open_kw) -> rpc.SessionInfo:
        """One whole session on this connection: open, add the BOs, start, wait, close.

        Returns the final info; raises the session's typed error (after closing it)."""
        s = self.open_session(kind, dir_fd, **open_kw)
        try:
            if bos:
                self.add_bos(s.token, bos)
            self.start(s.token)
            return self.wait(s.token)
        finally:
            try:
                self.close_session(s.token)
            except (VramdError, OSError):
                pass  # the first error is the one to report

    def start(self, token: str) -> rpc.SessionInfo:
        return self._call(want="session", start=rpc.Start(token=token))

    def progress(self, token: str) -> rpc.SessionInfo:
        return self._call(want="session", get_progress=rpc.GetProgress(token=token))

    def wait(self, token: str, timeout: float | None = None) -> rpc.SessionInfo:
        """The barrier: the session's final info, or its typed error; WaitTimeoutError if it runs longer."""
        w = rpc.Wait(token=token)
        if timeout is not None:
            w.timeout_ms = max(0, int(timeout * 1000))
        return self._call(want="session", wait=w)

    def poll(self, token: str, interval: float = 0.2):
        """Yield the session's info every `interval` seconds until it ends; the last one is final."""
        while True:
            try:
                yield self.wait(token, interval)
                return
            except WaitTimeoutError:
                yield self.progress(token)

    def cancel(self, token: str, reason: str = "") -> rpc.SessionInfo:
        return self._call(want="session", cancel=rpc.Cancel(token=token, reason=reason))

    def close_session(self, token: str) -> rpc.SessionInfo:
        return self._call(want="session", close_session=rpc.CloseSession(token=token))

    def status(self) -> rpc.StatusReply:
        return self._call(want="status", get_status=rpc.GetStatus())

    def sessions(self) -> list[rpc.SessionInfo]:
        return list(self._call(want="sessions", list_sessions=rpc.ListSessions()).sessions)
