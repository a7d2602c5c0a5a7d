"""What the request handlers and the connections see of the daemon (`Host`), and of a connection (`Connection`).

The daemon (daemon.py) implements `Host`; connection.py and handlers.py depend
on this module only, never on the daemon, so the import arrows in service/ run
one way: main -> daemon -> connection -> handlers -> host -> session_table ->
sessions (the import-linter contract in pyproject.toml).
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Protocol

from ..engine.engine import Engine
from ..pb import rpc_pb2 as rpc
from ..protocol.server import ServerProtocol
from .config import DaemonConfig
from .metrics import Metrics
from .session_table import SessionTable
from .sessions import Session
from .transport import PacketChannel


@dataclass(eq=False)
class Connection:
    id: int
    channel: PacketChannel
    protocol: ServerProtocol
    pid: int
    uid: int
    gid: int
    sessions: set[Session] = field(default_factory=set)  # sessions whose token this connection used
    waiting: asyncio.Future[None] | None = None          # a pending Wait, abandoned if the peer hangs up


class Host(Protocol):
    """The daemon, as its connections and request handlers use it."""

    cfg: DaemonConfig
    engine: Engine
    metrics: Metrics
    sessions: SessionTable
    connections: dict[int, Connection]
    hello: rpc.HelloReply
    server: str
    started: float
    draining: bool
    refusing: int  # refused peers being answered

    def backend_infos(self) -> list[rpc.BackendInfo]: ...

    def update_gauges(self) -> None: ...

    def authorised(self, uid: int, gid: int, groups: set[int]) -> bool: ...

    def connections_of(self, uid: int) -> int: ...

    def register(self, channel: PacketChannel, protocol: ServerProtocol, pid: int, uid: int,
                 gid: int) -> Connection: ...

    def unregister(self, conn: Connection) -> None: ...
