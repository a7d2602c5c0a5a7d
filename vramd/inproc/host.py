"""The daemon's session path in this process: the service's own connection handling on one end of a socketpair.

`InProcess(engine, gpu_ids)` makes a `vramd.service.Daemon` around the
caller's engine and serves each `connect()` with `serve_connection`, the
code that serves a client of the real daemon, on the same event loop; the
other end is an asyncio client connection (adapter.py).  Every request,
its fds (SCM_RIGHTS, duplicated by the kernel), the session table, the
sessions and their jobs are the daemon's; only the socket is a socketpair
instead of an accepted one.

What differs from a daemon a client connects to, and why: no KFD topology
(an image records none and a restore maps no GPU, as the engine's own jobs
do), the GPUs a BO may name are the caller's (`gpu_ids`), and no limit on
BOs, chunks, fds or sessions keeps one process from itself.
"""
from __future__ import annotations

import asyncio
import logging
import os
import socket
from collections.abc import Iterable

from ..engine import Engine
from ..service.config import DaemonConfig
from ..service.connection import serve_connection
from ..service.daemon import Daemon
from .adapter import Connection

UNLIMITED = 2**31 - 1  # the largest count a daemon setting takes

# The daemon's log lines in this process go where the caller's logging sends them; with none configured they
# are not printed (by Python's last-resort handler): a session's failure reaches the caller as its typed error.
logging.getLogger("vramd.service").addHandler(logging.NullHandler())


def daemon_config(engine: Engine, gpu_ids: Iterable[int]) -> DaemonConfig:
    """The settings of an in-process daemon around `engine`: the engine's chunk size as the default, the
    caller's GPUs, no topology, no limits (module docstring)."""
    return DaemonConfig(
        chunk_size=engine.config.chunk_size, staging_budget=engine.config.staging_budget,
        gpu_ids=sorted(set(gpu_ids) - {0}), topology_root=os.devnull,  # not a directory: no KFD topology
        grace_period=0.0, max_bos_per_session=UNLIMITED, max_fds_per_session=UNLIMITED,
        max_chunks_per_session=UNLIMITED, max_sessions_per_uid=UNLIMITED, max_bos_per_uid=UNLIMITED,
        max_fds_per_uid=UNLIMITED, max_queued_requests=UNLIMITED)


class InProcess:
    """A daemon around `engine` in this process; `connect()` gives a client connection to it.  `close` (or
    leaving `async with`) ends every connection and every session still open; the engine stays the caller's."""

    def __init__(self, engine: Engine, gpu_ids: Iterable[int] = (0,)) -> None:
        self.daemon = Daemon(daemon_config(engine, gpu_ids), engine)
        self._served: list[asyncio.Task[None]] = []
        self._connections: list[Connection] = []

    async def connect(self) -> Connection:
        """A new connection, Hello said."""
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        self._served.append(asyncio.get_running_loop().create_task(serve_connection(self.daemon, theirs),
                                                                   name="vramd-inproc-connection"))
        conn = Connection(mine)
        self._connections.append(conn)
        await conn.hello()
        return conn

    async def close(self) -> None:
        """Hang up every connection (the daemon sees each peer go, as it would a client's), wait for their
        serving to end, then end what sessions are left, as the daemon's shutdown does."""
        for conn in self._connections:
            conn.close()
        self._connections.clear()
        await asyncio.gather(*self._served, return_exceptions=True)
        self._served.clear()
        for s in self.daemon.sessions.detach_all("the in-process daemon closes"):
            await s.close("session reaped: the in-process daemon closes")

    async def __aenter__(self) -> InProcess:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
