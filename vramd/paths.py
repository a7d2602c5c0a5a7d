"""Where the daemon's socket is, and whether a client may trust it: one rule for the daemon, vramctl and every
client (libvramd's auth.c implements the same rule).

Clients import this alone (not the daemon's configuration) to find the socket.

The search order (`client_socket_path`): $VRAMD_SOCKET; else the system socket /run/vramd/vramd.sock when it
exists (an untrustworthy one is refused, never passed over); else the user's own daemon,
$XDG_RUNTIME_DIR/vramd/vramd.sock, or without XDG_RUNTIME_DIR /tmp/vramd-<uid>/vramd.sock, the latter only for a
uid other than root.

The trust rule (`check_socket_path` before connect, `check_peer` after it, before anything is sent): the trusted
uids are root, this process's (effective) uid and the daemon user ($VRAMD_DAEMON_USER, a name or a uid, default
`vramd`; a user that does not exist adds nothing; libvramd looks a name up in /etc/passwd only, never through
NSS).  Every directory on the way to the socket, symbolic links
resolved, must be owned by a trusted uid and writable by nobody else (no group or other write bit), except that a
root-owned sticky directory (/tmp) may be an ancestor but not the socket's own directory; a symbolic link on the
way must itself be owned by a trusted uid.  The listener's SO_PEERCRED uid must be trusted.  Otherwise:
UntrustedDaemonError naming the path and the offending uid, and nothing is sent.
"""
from __future__ import annotations

import os
import pwd
import socket
import stat
import struct

from .errors import PermissionDeniedError

SYSTEM_SOCKET = "/run/vramd/vramd.sock"
DAEMON_USER_ENV = "VRAMD_DAEMON_USER"
DEFAULT_DAEMON_USER = "vramd"
MAX_SYMLINKS = 40  # as the kernel's path walk


class UntrustedDaemonError(PermissionDeniedError):
    """The socket's path or its listener belongs to a uid this client does not trust: nothing was sent."""


def user_run_dir() -> str:
    """$XDG_RUNTIME_DIR/vramd, else /tmp/vramd-<uid>: a directory only this uid can enter."""
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    return os.path.join(xdg, "vramd") if xdg else f"/tmp/vramd-{os.getuid()}"


def ensure_private_dir(path: str) -> None:
    """Create `path` mode 0700, or check that an existing one is ours and private (no squatting)."""
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise PermissionError(f"{path} must be a directory owned by uid {os.getuid()} with mode 0700")


def _is_root() -> bool:
    return os.getuid() == 0 or os.geteuid() == 0


def default_socket_path() -> str:
    """Where a daemon started by hand listens: $VRAMD_SOCKET, else the user's run dir; root without
    XDG_RUNTIME_DIR: the system socket (root's clients never look in /tmp)."""
    env = os.environ.get("VRAMD_SOCKET")
    if env:
        return env
    if _is_root() and not os.environ.get("XDG_RUNTIME_DIR"):
        return SYSTEM_SOCKET
    return os.path.join(user_run_dir(), "vramd.sock")


def client_socket_path() -> str:
    """Where clients look: $VRAMD_SOCKET, else the system socket if it exists, else the user's own daemon
    ($XDG_RUNTIME_DIR, or /tmp for a uid other than root); root without either: the system socket."""
    env = os.environ.get("VRAMD_SOCKET")
    if env:
        return env
    if os.path.lexists(SYSTEM_SOCKET):
        return SYSTEM_SOCKET
    if os.environ.get("XDG_RUNTIME_DIR") or not _is_root():
        return os.path.join(user_run_dir(), "vramd.sock")
    return SYSTEM_SOCKET


# --- trust ------------------------------------------------------------------------------------------------

class TrustedUids:
    """Root, this process's effective uid, and the daemon user (`daemon_user`, else $VRAMD_DAEMON_USER, else
    "vramd": a name or a uid), which is looked up only when a uid is neither root nor ours."""

    def __init__(self, daemon_user: str | int | None = None) -> None:
        if daemon_user is None:
            daemon_user = os.environ.get(DAEMON_USER_ENV) or DEFAULT_DAEMON_USER
        self.daemon_user = daemon_user
        self.me = os.geteuid()
        self._daemon_uid: int | None = None
        self._looked_up = False

    @property
    def daemon_uid(self) -> int | None:
        """The daemon user's uid; None if there is no such user."""
        if not self._looked_up:
            self._looked_up = True
            user = self.daemon_user
            if isinstance(user, int):
                self._daemon_uid = user
            elif user.strip().isascii() and user.strip().isdigit():  # as libvramd: "²" is a name
                self._daemon_uid = int(user.strip())
            else:
                try:
                    self._daemon_uid = pwd.getpwnam(user.strip()).pw_uid
                except KeyError:
                    self._daemon_uid = None
        return self._daemon_uid

    def __contains__(self, uid: object) -> bool:
        return uid in (0, self.me) or (uid == self.daemon_uid and uid is not None)

    def describe(self) -> str:
        duid = self.daemon_uid
        who = f"the daemon user {self.daemon_user} (uid {duid})" if duid is not None else \
            f"the daemon user {self.daemon_user} (no such user)"
        return f"root, uid {self.me} or {who}"


def _owner(uid: int) -> str:
    try:
        return f"uid {uid} ({pwd.getpwuid(uid).pw_name})"
    except KeyError:
        return f"uid {uid}"


def check_socket_path(path: str, trusted: TrustedUids) -> None:
    """Walk `path` component by component (lstat, symbolic links resolved here) and raise UntrustedDaemonError
    unless every directory on it and every link is owned by a trusted uid and writable by nobody else (a
    root-owned sticky directory only as an ancestor); ConnectionError where the walk fails (a missing
    component, no search permission), as connect would."""
    def refuse(what: str, st: os.stat_result, why: str) -> UntrustedDaemonError:
        return UntrustedDaemonError(f"untrusted vramd socket {path}: {_owner(st.st_uid)} owns {what} (mode "
                                    f"{stat.S_IMODE(st.st_mode):04o}; {why}); trusted: {trusted.describe()}")

    def check_dir(d: str, st: os.stat_result) -> bool:
        """Whether `d` is trusted only as an ancestor (a root-owned sticky directory others may write)."""
        if not stat.S_ISDIR(st.st_mode):
            raise ConnectionError(f"cannot connect to vramd at {path}: {d} is not a directory")
        if st.st_uid not in trusted:
            raise refuse(d, st, "not a trusted uid")
        if st.st_mode & 0o022:
            if st.st_uid == 0 and st.st_mode & stat.S_ISVTX:
                return True
            raise refuse(d, st, "writable by others")
        return False

    if "\0" in path:  # an abstract socket ("\0name"): no path to walk, and any uid may bind any name
        shown = path.replace("\0", "@")
        raise UntrustedDaemonError(f"untrusted vramd socket {shown}: an abstract socket (or a name with a NUL byte)"
                                   " cannot be authenticated; use a socket path")
    cur = "/"
    try:
        full = path if os.path.isabs(path) else os.path.join(os.getcwd(), path)  # (a removed cwd: ENOENT)
        todo = [p for p in reversed(full.split("/")) if p]  # a stack: the next component last
        st = os.lstat(cur)
        sticky_only = check_dir(cur, st)
        links = 0
        while todo:
            name = todo.pop()
            if name == ".":
                continue
            if name == "..":  # `cur` is resolved: its parent was checked on the way down
                cur = os.path.dirname(cur)
                st = os.lstat(cur)
                sticky_only = check_dir(cur, st)
                continue
            nxt = os.path.join(cur, name)
            st = os.lstat(nxt)
            if stat.S_ISLNK(st.st_mode):
                if st.st_uid not in trusted:
                    raise refuse(nxt, st, "a symbolic link of an untrusted uid")
                links += 1
                if links > MAX_SYMLINKS:
                    raise ConnectionError(f"cannot connect to vramd at {path}: too many levels of symbolic links")
                target = os.readlink(nxt)
                todo.extend(p for p in reversed(target.split("/")) if p)
                if target.startswith("/"):
                    cur = "/"
                    st = os.lstat(cur)
                    sticky_only = check_dir(cur, st)
                continue
            if not todo:  # the socket itself: its own directory must be one only trusted uids write
                if sticky_only:
                    parent = os.lstat(cur)
                    raise refuse(cur, parent, "the socket's own directory, writable by others")
                return
            sticky_only = check_dir(nxt, st)
            cur = nxt
    except ConnectionError:
        raise
    except OSError as e:
        raise ConnectionError(f"cannot connect to vramd at {path}: {e.strerror or e}") from None
    raise ConnectionError(f"cannot connect to vramd at {path}: not a socket")


def peer_creds(sock: socket.socket) -> tuple[int, int, int]:
    """(pid, uid, gid) of the listener at the other end of the connected `sock` (SO_PEERCRED: the
    credentials it had when it called listen)."""
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("iII"))
    pid, uid, gid = struct.unpack("iII", creds)
    return int(pid), int(uid), int(gid)


def check_peer(sock: socket.socket, path: str, trusted: TrustedUids) -> None:
    """Raise UntrustedDaemonError unless the listener at the other end of the connected `sock` runs as a
    trusted uid (peer_creds)."""
    pid, uid, _gid = peer_creds(sock)
    if uid not in trusted:
        raise UntrustedDaemonError(f"untrusted vramd socket {path}: its listener (pid {pid}) runs as "
                                   f"{_owner(uid)}; trusted: {trusted.describe()}")
