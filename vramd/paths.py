"""Where the daemon's socket is: one rule for the daemon, vramctl and every client.

Clients import this alone (not the daemon's configuration) to find the socket.
"""
from __future__ import annotations

import os
import stat

SYSTEM_SOCKET = "/run/vramd/vramd.sock"


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


def default_socket_path() -> str:
    """Where a daemon started by hand listens: $VRAMD_SOCKET, else the user's run dir."""
    return os.environ.get("VRAMD_SOCKET") or os.path.join(user_run_dir(), "vramd.sock")


def client_socket_path() -> str:
    """Where clients look: $VRAMD_SOCKET, the user's own daemon if running, else the system one."""
    env = os.environ.get("VRAMD_SOCKET")
    if env:
        return env
    mine = os.path.join(user_run_dir(), "vramd.sock")
    if os.path.exists(mine) or not os.path.exists(SYSTEM_SOCKET):
        return mine
    return SYSTEM_SOCKET
