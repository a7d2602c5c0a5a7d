"""The answer to each request: an explicit table from request type to handler.

Every handler gets the daemon, the connection, the request's id, its body
and the fds that came with it (owned by the bundle until a handler takes
them), and returns the Reply.  A typed error becomes the reply's error; any
other exception is a bug, answered INTERNAL and logged.
"""
from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Awaitable, Callable
from typing import Any

from ..errors import (
    InternalError,
    InvalidRequestError,
    JobError,
    PermissionDeniedError,
    ShuttingDownError,
    VramdError,
    WaitTimeoutError,
    from_os_error,
)
from ..pb import rpc_pb2 as rpc
from ..protocol.fds import FdBundle
from ..protocol.server import Reply, reply
from .host import Connection
from .host import Host as Daemon  # what a handler sees of the daemon
from .sessions import Session

log = logging.getLogger("vramd.service.handlers")

Handler = Callable[[Daemon, Connection, int, Any, FdBundle], Awaitable[Reply]]


async def dispatch(daemon: Daemon, conn: Connection, req: rpc.Request, fds: FdBundle) -> Reply | None:
    """The reply to `req`; None when there is nobody to answer (a Wait whose client hung up)."""
    kind = req.WhichOneof("body")
    daemon.metrics.inc("vramd_requests_total", type=str(kind))
    handler = HANDLERS.get(kind or "")
    if kind not in TAKES_FDS:
        fds.close()  # it takes none: a Wait that blocks for long holds none of them
    try:
        if handler is None:
            raise InvalidRequestError(f"request type {kind!r} is not handled here")
        return await handler(daemon, conn, req.id, getattr(req, kind or ""), fds)
    except VramdError as e:
        daemon.metrics.count_error(e, e.code)
        return reply(req.id, e)
    except asyncio.CancelledError:
        task = asyncio.current_task()
        if task is not None and task.cancelling():
            raise  # this handler's own task is being cancelled (shutdown): let it unwind
        return None  # only the abandoned Wait's future was cancelled: its client hung up
    except OSError as e:  # the daemon's own I/O failed (e.g. a full disk): an everyday error, typed, one line
        err = from_os_error(e, f"{kind} failed", JobError)
        log.warning("connection %d (pid %d uid %d): %s: %s", conn.id, conn.pid, conn.uid, kind, err)
        daemon.metrics.count_error(err, err.code)
        return reply(req.id, err)
    except Exception as e:
        log.exception("internal error handling %s", kind)
        daemon.metrics.count_error(e, InternalError.code)
        return reply(req.id, InternalError(f"internal error handling {kind}: {e!r}"))


def _session(daemon: Daemon, conn: Connection, token: str) -> Session:
    return _hold(daemon, conn, daemon.sessions.get(token, conn.uid))


def _hold(daemon: Daemon, conn: Connection, s: Session) -> Session:
    """`conn` now holds `s`: the session outlives it only by the grace period (a restore: or its hold)."""
    daemon.sessions.hold(s, conn)
    conn.sessions.add(s)
    return s


async def open_session(daemon: Daemon, conn: Connection, rid: int, body: rpc.OpenSession, fds: FdBundle) -> Reply:
    if daemon.draining:
        raise ShuttingDownError("the daemon is shutting down and takes no new sessions")
    s = _hold(daemon, conn, await daemon.sessions.open(body, fds, uid=conn.uid, pid=conn.pid))
    s.opened_by(conn)  # its hang-up cancels a dump at once (Session.opener_gone)
    return reply(rid, session=s.info(with_token=True))


async def add_bos(daemon: Daemon, conn: Connection, rid: int, body: rpc.AddBos, fds: FdBundle) -> Reply:
    s = _session(daemon, conn, body.token)
    await s.add(body.bos, fds)
    return reply(rid, session=s.info())


async def attach_files(daemon: Daemon, conn: Connection, rid: int, body: rpc.AttachFiles, fds: FdBundle) -> Reply:
    s = _session(daemon, conn, body.token)
    await s.attach(body.files, fds)
    return reply(rid, session=s.info())


async def start(daemon: Daemon, conn: Connection, rid: int, body: rpc.Start, fds: FdBundle) -> Reply:
    s = _session(daemon, conn, body.token)
    await s.seal(fds, body.manifest_fd_index if body.HasField("manifest_fd_index") else None)
    return reply(rid, session=s.info())


async def get_progress(daemon: Daemon, conn: Connection, rid: int, body: rpc.GetProgress, fds: FdBundle) -> Reply:
    s = _session(daemon, conn, body.token)
    return reply(rid, session=s.info())


async def wait(daemon: Daemon, conn: Connection, rid: int, body: rpc.Wait, fds: FdBundle) -> Reply:
    s = _session(daemon, conn, body.token)
    timeout = body.timeout_ms / 1000 if body.HasField("timeout_ms") else None
    log.debug("connection %d waits for session %d", conn.id, s.id)
    conn.waiting = asyncio.ensure_future(s.wait(timeout))
    try:
        await conn.waiting
    except WaitTimeoutError as e:
        return reply(rid, e, session=s.info())
    finally:
        conn.waiting = None
    return reply(rid, s.error, session=s.info())


def is_operator(conn: Connection) -> bool:
    """uid 0 and the daemon's own uid see and may cancel every session of every uid."""
    return conn.uid in (0, os.getuid())


async def cancel(daemon: Daemon, conn: Connection, rid: int, body: rpc.Cancel, fds: FdBundle) -> Reply:
    if not body.HasField("session_id"):
        s = _session(daemon, conn, body.token)
        s.cancel(body.reason or f"cancelled by pid {conn.pid}")
        return reply(rid, session=s.info())
    if body.token:
        raise InvalidRequestError("Cancel names a session by its token or by its session_id, not both")
    sid = body.session_id
    if not is_operator(conn):
        raise PermissionDeniedError(f"uid {conn.uid} may not cancel session {sid} by its id: only uid 0 and the "
                                    f"daemon's uid ({os.getuid()}) may; its holders cancel it by its token")
    s = daemon.sessions.by_id(sid)  # the operator does not become a holder
    reason = body.reason or f"cancelled by uid {conn.uid} pid {conn.pid} (by session id)"
    if not s.done:
        log.warning("session %d (uid %d) cancelled by id by uid %d pid %d: %s", s.id, s.uid, conn.uid, conn.pid,
                    reason)
    s.cancel(reason)
    return reply(rid, session=s.info())


async def close_session(daemon: Daemon, conn: Connection, rid: int, body: rpc.CloseSession, fds: FdBundle) -> Reply:
    s = _session(daemon, conn, body.token)
    await daemon.sessions.close(s)
    conn.sessions.discard(s)
    return reply(rid, session=s.info())


async def get_status(daemon: Daemon, conn: Connection, rid: int, body: rpc.GetStatus, fds: FdBundle) -> Reply:
    """An operator (uid 0, the daemon's uid) sees the whole daemon; any other uid only its own connections and
    sessions, and neither the staging memory in use nor the metrics: both sum up every uid's work (they go to
    the metrics textfile, and to operators)."""
    pool = daemon.engine.pool
    status = rpc.StatusReply(server=daemon.server, version=conn.protocol.version,
                             uptime_s=time.monotonic() - daemon.started, staging_budget=pool.budget,
                             backends=daemon.backend_infos(), draining=daemon.draining)
    if is_operator(conn):
        daemon.update_gauges()
        status.connections, status.sessions = len(daemon.connections), len(daemon.sessions)
        status.staging_in_use, status.metrics = pool.in_use_bytes, daemon.metrics.render()
    else:
        status.connections = daemon.connections_of(conn.uid)
        status.sessions = sum(1 for s in daemon.sessions if s.uid == conn.uid)
    return reply(rid, status=status)


async def list_sessions(daemon: Daemon, conn: Connection, rid: int, body: rpc.ListSessions, fds: FdBundle) -> Reply:
    see_all = is_operator(conn)
    infos = [s.info() for s in daemon.sessions if see_all or s.uid == conn.uid]
    return reply(rid, sessions=rpc.SessionList(sessions=infos))


# The request types whose handlers take fds from their packet; any other request's fds are closed at once.
TAKES_FDS = frozenset({"open_session", "add_bos", "attach_files", "start"})

# Request type (the `body` oneof's field name in rpc.proto) -> handler.  Hello is the protocol's own.
HANDLERS: dict[str, Handler] = {
    "open_session": open_session,
    "add_bos": add_bos,
    "attach_files": attach_files,
    "start": start,
    "get_progress": get_progress,
    "wait": wait,
    "cancel": cancel,
    "close_session": close_session,
    "get_status": get_status,
    "list_sessions": list_sessions,
}
