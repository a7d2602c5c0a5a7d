"""One client connection: the peer check, a reader that sees a hang-up at once, requests handled in order."""
from __future__ import annotations

import asyncio
import errno
import logging
import socket

from ..errors import LimitExceededError, PermissionDeniedError, VramdError
from ..protocol.fds import close_fds
from ..protocol.server import Received, Reply, ServerProtocol, reply
from .handlers import TAKES_FDS, dispatch
from .host import Connection
from .host import Host as Daemon  # what a connection sees of the daemon
from .transport import PacketChannel
from .usage import UidUsage

__all__ = ["MAX_PENDING_REFUSALS", "Connection", "serve_connection"]

log = logging.getLogger("vramd.service.connection")


MAX_PENDING_REFUSALS = 64  # refused peers answered at once; past that, a refused peer is closed unanswered


async def serve_connection(daemon: Daemon, sock: socket.socket) -> None:
    """Serve one accepted socket until the peer hangs up or the protocol closes it; always closes it."""
    cfg = daemon.cfg
    channel = PacketChannel(sock, max_bytes=cfg.max_message_bytes, max_fds=cfg.max_fds_per_message)
    try:  # room for big replies (status, session lists); the kernel caps it at wmem_max
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 2 * cfg.max_message_bytes)
    except OSError:
        pass
    protocol = ServerProtocol(daemon.hello, cfg.max_message_bytes, cfg.max_fds_per_message)
    what = "refused connection"
    try:
        pid, uid, gid = channel.peercred()
        try:
            usage = _admit(daemon, channel, uid, gid)
        except VramdError as refusal:
            await _refuse(daemon, channel, protocol, refusal, pid, uid)
            return
        try:
            conn = daemon.register(channel, protocol, pid, uid, gid)
            what = f"connection {conn.id}"
            try:
                await _serve(daemon, conn)
            finally:
                daemon.unregister(conn)
        finally:
            usage.release_connection()
    finally:
        await channel.close()  # bounded, and yields: a peer that floods the socket holds nobody else
        log.debug("%s closed", what)  # its socket, and every fd it sent, are closed by now


def _admit(daemon: Daemon, channel: PacketChannel, uid: int, gid: int) -> UidUsage:
    """The peer's uid's usage, this connection counted in it (until `release_connection`); raises why the peer
    is refused."""
    cfg = daemon.cfg
    if not daemon.authorised(uid, gid, channel.peergroups()):
        raise PermissionDeniedError(f"uid {uid} (gid {gid}) is not allowed to use vramd")
    if len(daemon.connections) >= cfg.max_connections:
        raise LimitExceededError(f"too many connections (limit max_connections = {cfg.max_connections})")
    usage = daemon.sessions.usage_of(uid)
    usage.reserve_connection(cfg.max_connections_per_uid)
    return usage


async def _refuse(daemon: Daemon, channel: PacketChannel, protocol: ServerProtocol, refusal: VramdError,
                  pid: int, uid: int) -> None:
    log.warning("refused pid %d uid %d: %s", pid, uid, refusal.message)
    daemon.metrics.inc("vramd_connections_refused_total")
    if daemon.refusing >= MAX_PENDING_REFUSALS:  # a flood: no task waits on any more of them
        return
    daemon.refusing += 1
    try:
        try:  # answer the client's first request (its Hello) with the refusal
            first = await asyncio.wait_for(channel.recv(), daemon.cfg.hello_timeout)
        except TimeoutError:
            first = None
        if first is not None:
            close_fds(first[1])
        for r in protocol.refuse(refusal):
            await channel.send(r.data)
    finally:
        daemon.refusing -= 1


async def _serve(daemon: Daemon, conn: Connection) -> None:
    """Requests are handled in order by one task while this one goes on reading.

    The reader never blocks on the handler: a hang-up is seen at once, and a
    client that queues more than `max_queued_requests` is answered
    LIMIT_EXCEEDED and closed.  A connection that has not said Hello within
    `hello_timeout` is answered LIMIT_EXCEEDED and closed.  Requests never
    handled (the peer hung up, or was closed) have their fds closed.
    """
    cfg = daemon.cfg
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[Received | Reply | None] = asyncio.Queue()  # bounded by the check below
    usage = daemon.sessions.usage_of(conn.uid)  # the fds of the requests queued here count for the uid
    handler = loop.create_task(_handle_queue(daemon, conn, queue, usage))
    hello_deadline = loop.time() + cfg.hello_timeout
    hung_up = False
    turn_fds = turn_bytes = 0  # read since the last yield to the event loop
    try:
        while not conn.protocol.closed and not handler.done():
            if conn.protocol.version is None:  # no Hello yet: only until the deadline
                try:
                    async with asyncio.timeout_at(hello_deadline):  # no task of its own, unlike wait_for
                        packet = await conn.channel.recv()
                except TimeoutError:
                    log.warning("connection %d (pid %d uid %d): no Hello within %g s; closing", conn.id, conn.pid,
                                conn.uid, cfg.hello_timeout)
                    _queue_refusal(conn, queue, usage, LimitExceededError(
                        f"no Hello within {cfg.hello_timeout:g} s (hello_timeout)"))
                    break
            else:
                packet = await conn.channel.recv()
            if packet is None:
                hung_up = True
                break
            turn_fds += len(packet[1])  # counted before the protocol takes them (and may close them)
            turn_bytes += len(packet[0])
            events = conn.protocol.receive(*packet)
            if queue.qsize() + len(events) > cfg.max_queued_requests:
                for ev in events:
                    if isinstance(ev, Received):
                        ev.fds.close()
                log.warning("connection %d (pid %d uid %d): more than %d requests queued; closing", conn.id,
                            conn.pid, conn.uid, cfg.max_queued_requests)
                _queue_refusal(conn, queue, usage, LimitExceededError(
                    f"more than {cfg.max_queued_requests} requests queued on one connection (max_queued_requests)"))
                break
            for event in events:
                queue.put_nowait(_reserve(conn, usage, event))
            if conn.protocol.closed:
                # The packet broke the protocol: its error is the last answer, and no request queued before
                # it is handled. One could be a Wait that never ends, and from here on nobody reads the
                # socket to see the peer hang up.
                _drop_queued(queue, usage, keep_replies=True)
            # recv() returns at once while the socket holds more: without a yield a connection kept full was
            # read up to max_queued_requests + 1 packets (4,301 fds) in one go, and every other client waited
            # for that, once per flooding connection.  A turn of the event loop reads at most a packet's worth
            # of fds (their receipt and closing is the cost) or of bytes; small requests are still read ahead.
            if turn_fds >= cfg.max_fds_per_message or turn_bytes >= cfg.max_message_bytes:
                turn_fds = turn_bytes = 0
                await asyncio.sleep(0)
    finally:
        conn.channel.stop_reading()  # nothing more is read: a flooding peer's sends fail now, not at the close
        if hung_up:  # nobody to answer: what is still queued is never handled
            _drop_queued(queue, usage)
        if conn.waiting is not None:  # the peer is gone (or closed): nobody to answer the Wait
            conn.waiting.cancel()
        queue.put_nowait(None)
        await asyncio.gather(handler, return_exceptions=True)
        _drop_queued(queue, usage)  # events never handled: release their fds


def _reserve(conn: Connection, usage: UidUsage, event: Received | Reply) -> Received | Reply:
    """A request's fds count for its uid from now until it is handled (`UidUsage.start_handling`) or dropped;
    one that would take the uid past max_fds_per_uid is answered LIMIT_EXCEEDED in its place, its fds closed at
    once.  Every connection of the uid reserves from the same `usage`, atomically (`UidUsage.queue`)."""
    if not isinstance(event, Received) or not (n := len(event.fds)):
        return event
    try:
        usage.queue(n)
    except LimitExceededError as err:
        event.fds.close()
        log.warning("connection %d (pid %d uid %d): request %d refused: %s", conn.id, conn.pid, conn.uid,
                    event.request.id, err.message)
        return reply(event.request.id, err)
    return event


def _queue_refusal(conn: Connection, queue: asyncio.Queue[Received | Reply | None], usage: UidUsage,
                   err: VramdError) -> None:
    """Drop what is queued and not yet handled, then say why the connection closes."""
    _drop_queued(queue, usage)
    for r in conn.protocol.refuse(err):
        queue.put_nowait(r)


def _drop_queued(queue: asyncio.Queue[Received | Reply | None], usage: UidUsage, *,
                 keep_replies: bool = False) -> None:
    """Drop the requests queued and not yet handled (their fds closed); `keep_replies`: the answers queued
    (a refusal, a protocol error) stay, in order."""
    kept: list[Received | Reply | None] = []
    while not queue.empty():
        ev = queue.get_nowait()
        if isinstance(ev, Received):
            usage.unqueue(len(ev.fds))
            ev.fds.close()
        elif keep_replies:
            kept.append(ev)
    for ev in kept:
        queue.put_nowait(ev)


async def _handle_queue(daemon: Daemon, conn: Connection, queue: asyncio.Queue[Received | Reply | None],
                        usage: UidUsage) -> None:
    while (event := await queue.get()) is not None:
        if isinstance(event, Reply):
            if not await conn.channel.send(event.data) or event.close:
                return
            continue
        # From queued to being handled: the fds still count for the uid while the handler may wait (an AddBos
        # or Start on its session's lock), until it has taken what it keeps and closed the rest.
        # (A request that takes no fds has them closed before it runs: a Wait holds none.)
        held = len(event.fds) if event.request.WhichOneof("body") in TAKES_FDS else 0
        usage.start_handling(len(event.fds), held)
        try:
            out = await dispatch(daemon, conn, event.request, event.fds)
        finally:
            event.fds.close()
            usage.done_handling(held)
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
