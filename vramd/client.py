"""A blocking client for the vramd daemon (what vramctl, the selftest and tests use).

    with Client() as c:                       # connects, says Hello
        s = c.open_session(SESSION_DUMP, dir_fd, compression="zstd")
        c.add_bos(s.token, [ClientBo(1, mem_fd, offset=addr, size=n)])
        c.start(s.token)
        info = c.wait(s.token)                # the barrier (a dump: then committed); raises the typed error

A thin socket adapter over the sans-io `vramd.protocol.ClientProtocol`,
which owns request ids, Hello and the packing of BOs and files into
messages.  Every fd passed in stays the caller's: the daemon gets duplicates
through SCM_RIGHTS.

The image directory never reaches the daemon (docs/protocol.md, "Image
files: the client's rights"): this client opens and creates every file of
the image with its own process's rights (vramd.imagedir) and attaches
them, and commits a dump itself when its Wait answers DONE.  A dump is
committed by the Client that opened it.
"""
from __future__ import annotations

import os
import socket
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from . import __version__
from .errors import VramdError, WaitTimeoutError
from .imagedir import DumpDirectory, ImageFiles, OpenedFile
from .paths import TrustedUids, check_peer, check_socket_path, client_socket_path
from .pb import rpc_pb2 as rpc
from .protocol.client import ClientBo, ClientFile, ClientProtocol, Outgoing
from .protocol.fds import pack_fds, unpack_fds
from .protocol.wire import raise_for_error
from .topology import CHECK_ENV

SESSION_DUMP, SESSION_RESTORE, SESSION_VERIFY = rpc.SESSION_DUMP, rpc.SESSION_RESTORE, rpc.SESSION_VERIFY
# CRIU's topology switches (its amdgpu plugin's KFD_*_CHECK variables), as OpenSession.topology_checks names them
CHECK_NAMES = tuple(CHECK_ENV.values())

__all__ = ["CHECK_NAMES", "SESSION_DUMP", "SESSION_RESTORE", "SESSION_VERIFY", "Client", "ClientBo",
           "topology_checks_from_env"]


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


class _Local:
    """This client's side of one session's image: the files it opened or created, and a dump's directory."""

    def __init__(self, files: ImageFiles, dump: DumpDirectory | None) -> None:
        self.files = files
        self.dump = dump

    def close(self) -> None:
        """Close every file; an uncommitted dump's files and marks are removed."""
        try:
            if self.dump is not None:
                self.dump.close()
        finally:
            self.files.close()


def _wire(f: OpenedFile) -> ClientFile:
    return ClientFile(f.image, f.name, f.fd, f.direct_fd, f.gpu_id, f.stripe)


class Client:
    """A connection to the daemon at `path` (default: `client_socket_path()`), authenticated before anything is
    sent (vramd.paths: the path's directories, then the listener's uid); UntrustedDaemonError if either belongs
    to a uid other than root, ours or `daemon_user` (default: $VRAMD_DAEMON_USER, else "vramd")."""

    def __init__(self, path: str | os.PathLike[str] | None = None, *, timeout: float | None = None,
                 name: str = "python", daemon_user: str | int | None = None) -> None:
        self.path = os.fspath(path) if path else client_socket_path()
        self.protocol = ClientProtocol(f"{name} {__version__}")
        trusted = TrustedUids(daemon_user)
        check_socket_path(self.path, trusted)
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        self.sock.settimeout(timeout)
        self._local: dict[str, _Local] = {}  # token -> the files of the sessions this client opened
        try:
            try:
                self.sock.connect(self.path)
            except OSError as e:
                raise ConnectionError(f"cannot connect to vramd at {self.path}: {e.strerror or e}") from None
            check_peer(self.sock, self.path, trusted)
            self._exchange(self.protocol.hello_request())
        except BaseException:
            self.sock.close()
            raise

    @property
    def hello(self) -> rpc.HelloReply:
        assert self.protocol.hello is not None  # the constructor completed Hello
        return self.protocol.hello

    @property
    def limits(self) -> rpc.Limits:
        return self.protocol.limits

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        for local in self._local.values():
            local.close()
        self._local.clear()
        self.sock.close()

    # --- transport -----------------------------------------------------------

    def _exchange(self, out: Outgoing) -> rpc.Response:
        try:
            self.sock.sendmsg([out.data], pack_fds(out.fds))
            data, anc, flags, _ = self.sock.recvmsg(self.protocol.max_response_bytes, socket.CMSG_SPACE(4 * 4))
        except TimeoutError:
            # The reply may still come and would be taken for the next request's: this
            # connection is unusable now.  (Use wait(timeout=...) for bounded barriers.)
            timeout = self.sock.gettimeout()
            self.close()
            raise TimeoutError(f"no reply from vramd within {timeout} s; connection closed") from None
        try:
            return self.protocol.receive(data, unpack_fds(anc), flags)
        except ConnectionError:
            raise ConnectionError(f"the daemon at {self.path} closed the connection") from None

    def request(self, fds: Sequence[int] = (), **body: Any) -> rpc.Response:
        """Send one request, return its response (error included, not raised)."""
        return self._exchange(self.protocol.request(fds, **body))

    def _session_call(self, fds: Sequence[int] = (), **body: Any) -> rpc.SessionInfo:
        return raise_for_error(self.request(fds, **body)).session

    # --- sessions ------------------------------------------------------------

    def open_session(self, kind: rpc.SessionKind, dir_fd: int, *, compression: str = "", chunk_size: int = 0,
                     label: str = "", allow_partial: bool = False,
                     topology_checks: Mapping[str, bool] | None = None, parent_fds: Sequence[int] = (),
                     parent_hint: str = "", dedup: bool = True, replace_parent: bool = False,
                     where: str = "the image directory") -> rpc.SessionInfo:
        """Open a session on the image directory `dir_fd`: this process opens (a dump: locks, and later
        creates) the image's files with its own rights and attaches them.
        `topology_checks`: a restore's CRIU switches by name, e.g. {"KFD_FW_VER_CHECK": False}
        (`topology_checks_from_env()` reads them from an environment as CRIU's plugin does).
        `parent_fds`: an incremental image's parent directories, nearest first (a dump: the parent and its
        own parents; a restore or verify: the image's); `parent_hint`: a dump's parent path relative to the
        image directory (recorded for tools, never opened); `dedup` False stores every chunk;
        `replace_parent`: a dump may replace an image that incremental images need.  `where`: how errors
        name the directory (its path)."""
        dump = kind == rpc.SESSION_DUMP
        out = DumpDirectory(dir_fd, parent_fds, replace_parent=replace_parent, where=where) if dump else None
        try:
            files = ImageFiles(None if dump else dir_fd, parent_fds, where=where)
        except BaseException:
            if out is not None:
                out.close()
            raise
        local = _Local(files, out)
        try:
            info = self._session_call_out(self.protocol.open_session_request(
                kind, manifest_fd=files.manifest_fd, parent_manifest_fds=files.parent_manifest_fds,
                compression=compression, chunk_size=chunk_size, label=label, allow_partial=allow_partial,
                topology_checks=dict(topology_checks or {}), parent_hint=parent_hint, no_dedup=not dedup,
                replace_parent=replace_parent))
            try:
                if out is not None:
                    out.begin(info.image_id, info.data_files_per_gpu)
                opened = files.open_needed((f.image, f.name) for f in info.files_needed)
                self._attach(info.token, opened)
            except BaseException:
                self._close_quietly(info.token)
                raise
        except BaseException:
            local.close()
            raise
        self._local[info.token] = local
        return info

    def _session_call_out(self, out: Outgoing) -> rpc.SessionInfo:
        return raise_for_error(self._exchange(out)).session

    def _attach(self, token: str, files: Sequence[OpenedFile], taken: list[int] | None = None) -> None:
        """AttachFiles `files`, in as many messages as the limits need; `taken[0]` counts the files of the
        messages the daemon took."""
        for out in self.protocol.attach_requests(token, [_wire(f) for f in files]):
            raise_for_error(self._exchange(out))
            if taken is not None:
                taken[0] += len(out.request.attach_files.files)

    def _close_quietly(self, token: str) -> None:
        try:
            self.request(close_session=rpc.CloseSession(token=token))
        except (VramdError, OSError):
            pass  # the first error is the one to report

    def add_bos(self, token: str, bos: Sequence[ClientBo]) -> rpc.SessionInfo:
        """Add BOs in as many messages as the daemon's limits need; returns the session's info after the last.
        A dump's data files for each GPU (as many as the daemon asked for) are created and attached
        before its first BO."""
        local = self._local.get(token)
        if local is not None and local.dump is not None:
            # a GPU the daemon does not know gets no file: its BO's refusal names the BO
            known = set(self.hello.allowed_gpu_ids)
            new = sorted(({b.gpu_id or 0 for b in bos} & known) - local.dump.gpus())
            if new:
                made: list[OpenedFile] = []
                taken = [0]
                try:
                    for g in new:  # one at a time: a create that fails leaves the ones before it in `made`
                        for k in range(local.dump.stripes):
                            made.append(local.dump.data_file(g, k))
                    self._attach(token, made, taken)
                except BaseException:
                    # the daemon attached none of a refused message's own data files: those, the ones after, and
                    # any made but never sent (a create failed) go; the next add_bos makes and attaches them again
                    local.dump.drop(made[taken[0]:])
                    raise
        info = None
        for out in self.protocol.add_bos_requests(token, bos):
            info = self._session_call_out(out)
        return info if info is not None else self.progress(token)

    def run_session(self, kind: rpc.SessionKind, dir_fd: int, bos: Sequence[ClientBo],
                    **open_kw: Any) -> rpc.SessionInfo:
        """One whole session on this connection: open, add the BOs, start, wait, close.

        Returns the final info; raises the session's typed error (after closing it)."""
        s = self.open_session(kind, dir_fd, **open_kw)
        try:
            if bos:
                self.add_bos(s.token, bos)
            self.start(s.token)
            return self.wait(s.token)
        finally:
            self._close_quietly(s.token)
            self._forget(s.token)

    def start(self, token: str) -> rpc.SessionInfo:
        """No more BOs; a dump's manifest file is created and handed over here."""
        local = self._local.get(token)
        manifest = local.dump.manifest_file() if local is not None and local.dump is not None else None
        return self._session_call_out(self.protocol.start_request(token, manifest))

    def progress(self, token: str) -> rpc.SessionInfo:
        return self._session_call(get_progress=rpc.GetProgress(token=token))

    def wait(self, token: str, timeout: float | None = None) -> rpc.SessionInfo:
        """The barrier: the session's final info, or its typed error; WaitTimeoutError if it runs longer.
        A dump this client opened is committed here (its files renamed into place) once it is DONE; a
        session that failed has its files closed (a dump's removed)."""
        w = rpc.Wait(token=token)
        if timeout is not None:
            w.timeout_ms = max(0, int(timeout * 1000))
        try:
            info = self._session_call(wait=w)
        except WaitTimeoutError:
            raise
        except VramdError:
            self._forget(token)
            raise
        local = self._local.get(token)
        if local is not None and local.dump is not None and info.state == rpc.SESSION_DONE:
            try:
                local.dump.commit()
            finally:
                self._forget(token)
        return info

    def _forget(self, token: str) -> None:
        local = self._local.pop(token, None)
        if local is not None:
            local.close()

    def poll(self, token: str, interval: float = 0.2) -> Iterator[rpc.SessionInfo]:
        """Yield the session's info every `interval` seconds until it ends; the last one is final."""
        while True:
            try:
                yield self.wait(token, interval)
                return
            except WaitTimeoutError:
                yield self.progress(token)

    def cancel(self, token: str, reason: str = "") -> rpc.SessionInfo:
        return self._session_call_out(self.protocol.cancel_request(token=token, reason=reason))

    def cancel_by_id(self, session_id: int, reason: str = "") -> rpc.SessionInfo:
        """Cancel any uid's session by its id (an operator's call: only uid 0 and the daemon's own uid may;
        PermissionDeniedError for others).  This connection does not become a holder."""
        return self._session_call_out(self.protocol.cancel_request(session_id=session_id, reason=reason))

    def close_session(self, token: str) -> rpc.SessionInfo:
        """End the session (cancelled if it still runs); an uncommitted dump's files are removed."""
        try:
            return self._session_call(close_session=rpc.CloseSession(token=token))
        finally:
            self._forget(token)

    def status(self) -> rpc.StatusReply:
        return raise_for_error(self.request(get_status=rpc.GetStatus())).status

    def sessions(self) -> list[rpc.SessionInfo]:
        """The caller's uid's sessions; every uid's for uid 0 and the daemon's own uid (the admin listing)."""
        return list(raise_for_error(self._exchange(self.protocol.list_sessions_request())).sessions.sessions)
