"""A blocking client for the vramd daemon (what vramctl, the selftest and tests use).

    with Client() as c:                       # connects, says Hello
        s = c.open_session(SESSION_DUMP, dir_fd, compression="zstd")
        c.add_bos(s.token, [ClientBo(1, mem_fd, offset=addr, size=n)])
        c.start(s.token)
        info = c.wait(s.token)                # the barrier (a dump: then committed); raises the typed error

A blocking socket adapter over the sans-io client machine
(`vramd.protocol.ClientMachine`), which owns the session's steps, request
ids, Hello and the packing of BOs and files into messages: the Client sends
and receives its packets and does the file steps it asks for.  Every fd
passed in stays the caller's: the daemon gets duplicates through SCM_RIGHTS.

The image directory never reaches the daemon (docs/protocol.md, "Image
files: the client's rights"): this client opens and creates every file of
the image with its own process's rights (vramd.imagedir) and attaches
them, and commits a dump itself when its Wait answers DONE.  A dump is
committed by the Client that opened it.
"""
from __future__ import annotations

import errno
import os
import socket
from collections.abc import Iterator, Mapping, Sequence

from . import __version__
from .errors import VramdError, WaitTimeoutError
from .imagedir import DumpDirectory, ImageFiles, OpenedSessions, SessionFiles
from .paths import TrustedUids, check_peer, check_socket_path, client_socket_path
from .pb import rpc_pb2 as rpc
from .protocol import events as ev
from .protocol import requests
from .protocol.client import Call, ClientBo, ClientFile, Outgoing, RequestBody
from .protocol.connection import Transcript
from .protocol.fds import pack_fds, unpack_fds
from .protocol.requests import OpenSpec
from .protocol.session import ClientMachine
from .topology import CHECK_ENV

SESSION_DUMP, SESSION_RESTORE, SESSION_VERIFY = rpc.SESSION_DUMP, rpc.SESSION_RESTORE, rpc.SESSION_VERIFY
# CRIU's topology switches (its amdgpu plugin's KFD_*_CHECK variables), as OpenSession.topology_checks names them
CHECK_NAMES = tuple(CHECK_ENV.values())

__all__ = ["CHECK_NAMES", "SESSION_DUMP", "SESSION_RESTORE", "SESSION_VERIFY", "Client", "ClientBo", "ClientFile",
           "topology_checks_from_env"]
# sendmsg's errors that mean nothing was sent: the connection is still in step
HUNG_UP_AT_HELLO = "the daemon hung up before it answered"  # vramctl adds what to look at
_NOT_SENT = (errno.EBADF, errno.EMSGSIZE, errno.ENOBUFS, errno.ENOMEM, errno.ETOOMANYREFS)


def topology_checks_from_env(environ: Mapping[str, str] | None = None) -> dict[str, bool]:
    """CRIU's KFD_*_CHECK variables of an environment (default: this process's) as OpenSession.topology_checks.

    As CRIU reads them: 0/no turn a check off, 1/yes on; other values and absent variables are left out."""
    env = os.environ if environ is None else environ
    out = {}
    for name in CHECK_NAMES:
        value = env.get(name, "").lower()
        if value in ("0", "no"):
            out[name] = False
        elif value in ("1", "yes"):
            out[name] = True
    return out


class Client:
    """A connection to the daemon at `path` (default: `client_socket_path()`), authenticated before anything is
    sent (vramd.paths: the path's directories, then the listener's uid); UntrustedDaemonError if either belongs
    to a uid other than root, ours or `daemon_user` (default: $VRAMD_DAEMON_USER, else "vramd").
    `record`: keep a transcript of every packet (`transcript`, docs/protocol.md "Transcripts")."""

    def __init__(self, path: str | os.PathLike[str] | None = None, *, timeout: float | None = None,
                 name: str = "python", daemon_user: str | int | None = None, record: bool = False) -> None:
        self.path = os.fspath(path) if path else client_socket_path()
        self.machine = ClientMachine(f"{name} {__version__}", record=record)
        trusted = TrustedUids(daemon_user)
        check_socket_path(self.path, trusted)
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        self.sock.settimeout(timeout)
        self._local = OpenedSessions()  # the files of the sessions this client opened
        try:
            try:
                self.sock.connect(self.path)
            except OSError as e:
                raise ConnectionError(f"cannot connect to vramd at {self.path}: {e.strerror or e}") from None
            check_peer(self.sock, self.path, trusted)
            self.machine.say_hello()
            try:
                self._drive()
            except TimeoutError:
                raise
            except OSError as e:  # ECONNRESET, EPIPE, EOF: e.g. a socket unit whose service failed to start
                raise ConnectionError(f"cannot connect to vramd at {self.path}: {HUNG_UP_AT_HELLO} "
                                      f"({getattr(e, 'strerror', None) or e})") from None
        except BaseException:
            self.sock.close()
            raise

    @property
    def hello(self) -> rpc.HelloReply:
        assert self.machine.hello is not None  # the constructor completed Hello
        return self.machine.hello

    @property
    def supply_notes(self) -> bool:
        """Whether the daemon sends notes back over a streamed session's supply socket (RELEASED, WAITING):
        False from a daemon older than them, which never writes to it (HelloReply.supply_notes)."""
        return self.hello.supply_notes

    @property
    def limits(self) -> rpc.Limits:
        return self.machine.connection.limits

    @property
    def transcript(self) -> Transcript | None:
        """What this connection sent and received (with `record`; else None)."""
        return self.machine.transcript

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._local.close()
        self.sock.close()

    # --- the machine's driver ------------------------------------------------------

    def _drive(self, opening: SessionFiles | None = None) -> rpc.Response:
        """Take the machine's events to the end of its operation: packets sent and received, file steps done
        (`opening`: the files of a session being opened); returns its response or raises its error."""
        m = self.machine
        while True:
            e = m.next_event()
            if isinstance(e, ev.Done):
                return e.response
            if isinstance(e, ev.Failed):
                if self.sock.fileno() < 0:
                    self.close()  # a timeout closed the socket: every session's files go too
                if type(e.error) is ConnectionError:
                    raise ConnectionError(f"the daemon at {self.path} closed the connection") from None
                raise e.error
            if isinstance(e, ev.Send):
                self._transfer(e.packet)
                continue
            self._local.answer(m, e, opening)

    def _transfer(self, out: Outgoing) -> None:
        try:
            try:
                self.sock.sendmsg([out.data], pack_fds(out.fds))
            except OSError as e:
                if isinstance(e, TimeoutError) or e.errno not in _NOT_SENT:
                    raise
                self.machine.not_sent(e)
                return
            data, anc, flags, _ = self.sock.recvmsg(self.machine.connection.max_response_bytes,
                                                    socket.CMSG_SPACE(4 * 4))
        except TimeoutError:
            # The reply may still come and would be taken for the next request's: this
            # connection is unusable now (_drive closes the rest of the Client once the
            # machine has cleaned up).  (Use wait(timeout=...) for bounded barriers.)
            timeout = self.sock.gettimeout()
            self.sock.close()
            self.machine.lost(TimeoutError(f"no reply from vramd within {timeout} s; connection closed"))
            return
        except OSError as e:  # EPIPE, ECONNRESET: the daemon is gone; the operation cleans up, then raises it
            self.machine.lost(e)
            return
        self.machine.receive(data, unpack_fds(anc), flags)

    def exchange(self, call: Call) -> rpc.Response:
        """Send one typed request (vramd.protocol.requests builds them) and return its response, its error
        included (not raised): the low-level seam for tools and tests."""
        self.machine.exchange(call)
        return self._drive()

    def request(self, fds: Sequence[int] = (), **body: RequestBody) -> rpc.Response:
        """Send one request given by its field, e.g. `request(get_status=rpc.GetStatus())`; return its response
        (error included, not raised)."""
        ((name, value),) = body.items()
        call = requests.raw(value, fds)
        if call.field != name:
            raise TypeError(f"{name}= takes a {name} message, not {type(value).__name__}")
        return self.exchange(call)

    def _session(self) -> rpc.SessionInfo:
        return self._drive().session

    # --- sessions ------------------------------------------------------------

    def open_session(self, kind: rpc.SessionKind, dir_fd: int, *, compression: str = "", chunk_size: int = 0,
                     label: str = "", allow_partial: bool = False,
                     topology_checks: Mapping[str, bool] | None = None, parent_fds: Sequence[int] = (),
                     parent_hint: str = "", dedup: bool = True, replace_parent: bool = False,
                     where: str = "the image directory", hold_s: int = 0,
                     supply_fd: int | None = None) -> rpc.SessionInfo:
        """Open a session on the image directory `dir_fd`: this process opens (a dump: locks, and later
        creates) the image's files with its own rights and attaches them.
        `topology_checks`: a restore's CRIU switches by name, e.g. {"KFD_FW_VER_CHECK": False}
        (`topology_checks_from_env()` reads them from an environment as CRIU's plugin does).
        `parent_fds`: an incremental image's parent directories, nearest first (a dump: the parent and its
        own parents; a restore or verify: the image's); `parent_hint`: a dump's parent path relative to the
        image directory (recorded for tools, never opened); `dedup` False stores every chunk;
        `replace_parent`: a dump may replace an image that incremental images need.  `where`: how errors
        name the directory (its path).  `hold_s`: a restore the daemon keeps this many seconds once no
        connection holds it, for another to come back by its token (granted up to the daemon's max_hold:
        the reply's `hold_s`); 0: the grace period.  `supply_fd`: a streamed restore or verify, whose data
        files this process fills while the session runs: the read end of a pipe over which it says how far
        each is final (vramd.image.supply; docs/protocol.md, "Streamed sessions").  It stays the caller's:
        close it here once sent, and the write end when nothing more comes."""
        dump = kind == rpc.SESSION_DUMP
        out = DumpDirectory(dir_fd, parent_fds, replace_parent=replace_parent, where=where) if dump else None
        try:
            files = ImageFiles(None if dump else dir_fd, parent_fds, where=where)
        except BaseException:
            if out is not None:
                out.close()
            raise
        local = SessionFiles(files, out)
        spec = OpenSpec(kind, compression=compression, chunk_size=chunk_size, label=label,
                        allow_partial=allow_partial, topology_checks=tuple((topology_checks or {}).items()),
                        parents=len(parent_fds), parent_hint=parent_hint, dedup=dedup, replace_parent=replace_parent,
                        hold_s=hold_s)
        try:
            self.machine.open_session(spec, supply_fd)
            info = self._drive(local).session
        except BaseException:
            local.close()
            raise
        self._local.add(info.token, local)
        return info

    def add_bos(self, token: str, bos: Sequence[ClientBo]) -> rpc.SessionInfo:
        """Add BOs in as many messages as the daemon's limits need; returns the session's info after the last.
        A dump's data files for each GPU (as many as the daemon asked for) are created and attached
        before its first BO."""
        self.machine.add_bos(token, bos)
        return self._session()

    def run_session(self, kind: rpc.SessionKind, dir_fd: int, bos: Sequence[ClientBo], *,
                    compression: str = "", chunk_size: int = 0, label: str = "", allow_partial: bool = False,
                    topology_checks: Mapping[str, bool] | None = None, parent_fds: Sequence[int] = (),
                    parent_hint: str = "", dedup: bool = True, replace_parent: bool = False,
                    where: str = "the image directory") -> rpc.SessionInfo:
        """One whole session on this connection: open (`open_session`'s options), add the BOs, start, wait,
        close.  Returns the final info; raises the session's typed error (after closing it)."""
        s = self.open_session(kind, dir_fd, compression=compression, chunk_size=chunk_size, label=label,
                              allow_partial=allow_partial, topology_checks=topology_checks, parent_fds=parent_fds,
                              parent_hint=parent_hint, dedup=dedup, replace_parent=replace_parent, where=where)
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
        """No more BOs; a dump's manifest file is created and handed over here."""
        self.machine.start(token)
        return self._session()

    def progress(self, token: str) -> rpc.SessionInfo:
        self.machine.progress(token)
        return self._session()

    def wait(self, token: str, timeout: float | None = None) -> rpc.SessionInfo:
        """The barrier: the session's final info, or its typed error; WaitTimeoutError if it runs longer.
        A dump this client opened is committed here (its files renamed into place) once it is DONE; a
        session that failed has its files closed (a dump's removed)."""
        self.machine.wait(token, None if timeout is None else max(0, int(timeout * 1000)))
        return self._session()

    def poll(self, token: str, interval: float = 0.2) -> Iterator[rpc.SessionInfo]:
        """Yield the session's info every `interval` seconds until it ends; the last one is final."""
        while True:
            try:
                yield self.wait(token, interval)
                return
            except WaitTimeoutError:
                yield self.progress(token)

    def cancel(self, token: str, reason: str = "") -> rpc.SessionInfo:
        self.machine.cancel(token, reason)
        return self._session()

    def cancel_by_id(self, session_id: int, reason: str = "") -> rpc.SessionInfo:
        """Cancel any uid's session by its id (an operator's call: only uid 0 and the daemon's own uid may;
        PermissionDeniedError for others).  This connection does not become a holder."""
        self.machine.cancel_by_id(session_id, reason)
        return self._session()

    def close_session(self, token: str) -> rpc.SessionInfo:
        """End the session (cancelled if it still runs); an uncommitted dump's files are removed."""
        try:
            self.machine.close_session(token)
            return self._session()
        finally:
            self._local.forget(token)

    def status(self) -> rpc.StatusReply:
        self.machine.status()
        return self._drive().status

    def sessions(self) -> list[rpc.SessionInfo]:
        """The caller's uid's sessions; every uid's for uid 0 and the daemon's own uid (the admin listing)."""
        self.machine.list_sessions()
        return list(self._drive().sessions.sessions)
