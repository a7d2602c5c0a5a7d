"""One client connection: the peer check, a reader that sees a hang-up at once, requests handled in order."""
from __future__ import annotations

import asyncio
import errno
import logging
import socket
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..errors import LimitExceededError, PermissionDeniedError, VramdError
from ..protocol.fds import close_fds
from ..protocol.server import Received, Reply, ServerProtocol, reply
from .handlers import dispatch
from .sessions import Session
from .transport import PacketChannel

if TYPE_CHECKING:
    from .daemon import Daemon

log = logging.getLogger("vramd.service.connection")

QUEUE_DEPTH = 16  # requests read ahead of the one being handled


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


async def serve_connection(daemon: Daemon, sock: socket.socket) -> None:
    """Serve one accepted socket until the peer hangs up or the protocol closes it; always closes it."""
    cfg = daemon.cfg
    channel = PacketChannel(sock, max_bytes=cfg.max_message_bytes, max_fds=cfg.max_fds_per_message)
    try:  # room for big replies (status, session lists); the kernel caps it at wmem_max
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 2 * cfg.max_message_bytes)
    except OSError:
        pass
    protocol = ServerProtocol(daemon.hello, cfg.max_message_bytes, cfg.max_fds_per_message)
    try:
        pid, uid, gid = channel.peercred()
        refusal: VramdError | None = None
        if not daemon.authorised(uid, gid, channel.peergroups()):
            refusal = PermissionDeniedError(f"uid {uid} (gid {gid}) is not allowed to use vramd")
        elif len(daemon.connections) >= cfg.max_connections:
            refusal = LimitExceededError(f"too many connections (limit {cfg.max_connections})")
        if refusal is not None:
            await _refuse(daemon, channel, protocol, refusal, pid, uid)
            return
        conn = daemon.register(channel, protocol, pid, uid, gid)
        try:
            await _serve(daemon, conn)
        finally:
            daemon.unregister(conn)
    finally:
        channel.close()


async def _refuse(daemon: Daemon, channel: PacketChannel, protocol: ServerProtocol, refusal: VramdError,
                  pid: int, uid: int) -> None:
    log.warning("refused pid %d uid %d: %s", pid, uid, refusal.message)
    daemon.metrics.inc("vramd_connections_refused_total")
    try:  # answer the client's first request (its Hello) with the refusal
        first = await asyncio.wait_for(channel.recv(), 5.0)
    except TimeoutError:
        first = None
    if first is not None:
        close_fds(first[1])
    for r in protocol.refuse(refusal):
        await channel.send(r.data)


async def _serve(daemon: Daemon, conn: Connection) -> None:
    """Requests are handled in order; the reader goes on meanwhile, so a hang-up is seen at once."""
    queue: asyncio.Queue[Received | Reply | None] = asyncio.Queue(maxsize=QUEUE_DEPTH)
    handler = asyncio.get_running_loop().create_task(_handle_queue(daemon, conn, queue))
    try:
        while not conn.protocol.closed and not handler.done():
            packet = await conn.channel.recv()
            if packet is None:
                break
            for event in conn.protocol.receive(*packet):
                await queue.put(event)
    finally:
        if conn.waiting is not None:  # the peer is gone: nobody to answer
            conn.waiting.cancel()
        if not handler.done():
            await queue.put(None)
        await asyncio.gather(handler, return_exceptions=True)
        while not queue.empty():  # events never handled: release their fds
            ev = queue.get_nowait()
            if isinstance(ev, Received):
                ev.fds.close()


async def _handle_queue(daemon: Daemon, conn: Connection, queue: asyncio.Queue[Received | Reply | None]) -> None:
    while (event := await queue.get()) is not None:
        if isinstance(event, Reply):
            if not await conn.channel.send(event.data) or event.close:
                return
            continue
        try:
            out = await dispatch(daemon, conn, event.request, event.fds)
        finally:
            event.fds.close()
        if out is None or not await _send_reply(conn, event.request.id, out):
            return


async def _send_reply(conn: Connection, request_id: int, out: Reply) -> bool:
    try:
        return await conn.channel.send(out.data)
    except OSError as e:
        if e.errno != errno.EMSGSIZE:
            raise
    err = LimitExceededError(f"the reply ({len(out.data)} bytes) is larger than this socket can carry")
    return await conn.channel.send(reply(request_id, err).data)
