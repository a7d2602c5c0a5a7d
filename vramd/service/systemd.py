"""The systemd protocols vramd speaks, without libsystemd.

Socket activation (LISTEN_FDS/LISTEN_PID, fds from 3), readiness and status
(NOTIFY_SOCKET datagrams: READY=1, STATUS=..., STOPPING=1, RELOADING=1,
EXTEND_TIMEOUT_USEC=... while a drain runs), the journal stream
(JOURNAL_STREAM: stderr lines prefixed with their priority) and the watchdog
(WATCHDOG_USEC/WATCHDOG_PID: ping WATCHDOG=1 at half the interval).  All of
them are stable interfaces documented in sd_listen_fds(3), sd_notify(3),
sd-daemon(3), systemd.exec(5) and sd_watchdog_enabled(3).  Outside systemd every function is a no-op.
"""
from __future__ import annotations

import logging
import os
import socket

log = logging.getLogger("vramd.service.systemd")

LISTEN_FDS_START = 3
_dropped = 0  # notes dropped because the manager's socket was full
_sock: socket.socket | None = None


def notify(*lines: str) -> bool:
    """Send KEY=VALUE lines to the service manager; False if there is none, or the note was dropped.

    Never blocks: the daemon's event loop calls this, and a manager that does
    not read (a full socket) must not freeze it.  A note that does not fit
    now is dropped (the next STATUS/WATCHDOG note says the same again).
    """
    global _dropped, _sock
    addr = os.environ.get("NOTIFY_SOCKET")
    if not addr:
        return False
    if addr[0] == "@":
        addr = "\0" + addr[1:]
    try:
        if _sock is None:  # one socket for the daemon's life, not one per note
            _sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC | socket.SOCK_NONBLOCK)
        _sock.sendto("\n".join(lines).encode(), socket.MSG_DONTWAIT, addr)
    except (BlockingIOError, InterruptedError):
        _dropped += 1
        if _dropped == 1 or _dropped % 1000 == 0:  # once, then rarely: a stuck manager must not flood the log
            log.warning("sd_notify: the notify socket is full; dropped %d note(s) so far", _dropped)
        return False
    except OSError:
        return False
    return True


# journald reads a "<N>" prefix on each line of a service's stderr as its priority (sd-daemon(3))
_PRIORITY = ((logging.ERROR, 3), (logging.WARNING, 4), (logging.INFO, 6))


def journal_priority(levelno: int) -> int:
    """The syslog priority of a logging level: <3> error and above, <4> warning, <6> info, <7> debug."""
    for level, prio in _PRIORITY:
        if levelno >= level:
            return prio
    return 7


class JournalFormatter(logging.Formatter):
    """Prefix every line of a record (a traceback's too) with its journald priority."""

    def format(self, record: logging.LogRecord) -> str:
        prefix = f"<{journal_priority(record.levelno)}>"
        return "\n".join(prefix + line for line in super().format(record).split("\n"))


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


def stderr_is_journal(fd: int = 2) -> bool:
    """Whether `fd` is the journal stream systemd connected (JOURNAL_STREAM="dev:ino" names it).

    The variable is inherited by children whose stderr may go elsewhere (a
    pipe, a file): only an fd whose device and inode match is the journal.
    """
    value = os.environ.get("JOURNAL_STREAM", "")
    dev, _, ino = value.partition(":")
    if not (dev.isdigit() and ino.isdigit()):
        return False
    try:
        st = os.fstat(fd)
    except OSError:
        return False
    return (st.st_dev, st.st_ino) == (int(dev), int(ino))
