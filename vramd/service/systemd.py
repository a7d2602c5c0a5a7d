"""The systemd protocols vramd speaks, without libsystemd.

Socket activation (LISTEN_FDS/LISTEN_PID, fds from 3), readiness and status
(NOTIFY_SOCKET datagrams: READY=1, STATUS=..., STOPPING=1) and the watchdog
(WATCHDOG_USEC/WATCHDOG_PID: ping WATCHDOG=1 at half the interval).  All of
them are stable interfaces documented in sd_listen_fds(3), sd_notify(3) and
sd_watchdog_enabled(3).  Outside systemd every function is a no-op.
"""
from __future__ import annotations

import os
import socket

LISTEN_FDS_START = 3


def notify(*lines: str) -> bool:
    """Send KEY=VALUE lines to the service manager; False if there is none."""
    addr = os.environ.get("NOTIFY_SOCKET")
    if not addr:
        return False
    if addr[0] == "@":
        addr = "\0" + addr[1:]
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as s:
            s.connect(addr)
            s.sendall("\n".join(lines).encode())
    except OSError:
        return False
    return True


def listen_fds() -> list[socket.socket]:
    """Sockets passed by socket activation (consumed: the variables are unset)."""
    if os.environ.get("LISTEN_PID") != str(os.getpid()):
        return []
    n = int(os.environ.pop("LISTEN_FDS", "0"))
    os.environ.pop("LISTEN_PID", None)
    os.environ.pop("LISTEN_FDNAMES", None)
    socks = []
    for fd in range(LISTEN_FDS_START, LISTEN_FDS_START + n):
        os.set_inheritable(fd, False)
        socks.append(socket.socket(fileno=fd))
    return socks


def watchdog_interval() -> float | None:
    """Seconds between watchdog pings (half of WATCHDOG_USEC), or None if no watchdog is armed."""
    usec, pid = os.environ.get("WATCHDOG_USEC"), os.environ.get("WATCHDOG_PID")
    if not usec or (pid is not None and pid != str(os.getpid())):
        return None
    return int(usec) / 2e6


def under_systemd() -> bool:
    return "INVOCATION_ID" in os.environ or "NOTIFY_SOCKET" in os.environ
