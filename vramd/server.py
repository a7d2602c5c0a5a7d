"""The daemon: connections in, requests dispatched to sessions, replies out.

The protocol (vramd.protocol) decides what a packet means; this module owns
the event-loop side: accepting, peer checks, one reader per connection, the
dispatch table, draining on shutdown, metrics and systemd status.
"""
from __future__ import annotations

import asyncio
import errno
import logging
import os
import socket
import time
from dataclasses import dataclass, field

from . import __version__, systemd, topology
from .backends import BACKENDS
from .codec import Compression
from .config import DaemonConfig
from .engine import Engine, EngineConfig
from .errors import (
    InternalError,
    InvalidRequestError,
    LimitExceededError,
    PermissionDeniedError,
    ShuttingDownError,
    VramdError,
    WaitTimeoutError,
)
from .metrics import Metrics
from .pb import rpc_pb2 as rpc
from .protocol import FdBundle, Received, Reply, ServerProtocol, close_fds, reply
from .sessions import Session, SessionLimits, SessionTable
from .transport import PacketChannel

log = logging.getLogger(__name__)
SERVER = f"vramd {__version__}"


@dataclass(eq=False)
class Connection:
    id: int
    channel: PacketChannel
    protocol: ServerProtocol
    pid: int
    uid: int
    gid: int
    sessions: set = field(default_factory=set)  # sessions whose token this connection used
    waiting: asyncio.Future | None = None        # a pending Wait, abandoned if the peer hangs up


class Daemon:
    def __init__(self, cfg: DaemonConfig, engine: Engine | None = None):
        self.cfg = cfg
        self.topology = self._read_topology()
        gpus = self.topology.gpus if self.topology else []
        self.engine = engine or Engine(EngineConfig(
            staging_budget=cfg.staging_budget, chunk_size=cfg.chunk_size, workers_per_gpu=cfg.workers_per_gpu,
            compression=Compression.parse(cfg.compression), io_threads=cfg.io_threads, sdma=cfg.sdma,
            sdma_library=cfg.sdma_library, render_nodes={g.gpu_id: topology.render_node(g) for g in gpus}))
        self.metrics = Metrics()
        self.sessions = SessionTable(
            self.engine, self.metrics, grace_period=cfg.grace_period, max_per_uid=cfg.max_sessions_per_uid,
            limits=SessionLimits(cfg.max_bos_per_session, cfg.max_fds_per_session),
            default_compression=self.engine.config.compression, default_chunk_size=cfg.chunk_size,
            topology=self.topology)
        self.connections: dict[int, Connection] = {}
        self.allowed_uids = set(cfg.allowed_uids) | {os.getuid()}  # the daemon's own uid, always
        self.allowed_gids = cfg.allowed_gids()
        self.started = time.monotonic()
        self.draining = False
        self._next_conn = 1
        self._conn_tasks: set[asyncio.Task] = set()
        self._stop = asyncio.Event()
        self._hello = self._hello_reply()

    # --- what the daemon says about itself -----------------------------------

    def backend_infos(self) -> list[rpc.BackendInfo]:
        out = []
        for name in [*BACKENDS, "sdma"]:
            b = self.engine.backends.get(name)
            if b is None:
                out.append(rpc.BackendInfo(name=name, available=False,
                                           reason=self.engine.unavailable.get(name, "not loaded")))
                continue
            c = b.capabilities()
            out.append(rpc.BackendInfo(name=name, available=True, can_read=c.can_read, can_write=c.can_write,
                                       asynchronous_dma=c.asynchronous_dma, preferred_chunk=c.preferred_chunk,
                                       description=c.description))
        return out

    def _read_topology(self):
        try:
            topo = topology.parse_topology(self.cfg.topology_root)
        except topology.TopologyError as e:
            log.info("no GPUs: %s", e.message)
            return None
        log.info("KFD topology: %s", topo.summary())
        return topo

    def _hello_reply(self) -> rpc.HelloReply:
        cfg = self.cfg
        gpu_ids = [g.gpu_id for g in self.topology.gpus] if self.topology else []
        return rpc.HelloReply(server=SERVER, backends=self.backend_infos(), gpu_ids=gpu_ids, limits=rpc.Limits(
            max_message_bytes=cfg.max_message_bytes, max_fds_per_message=cfg.max_fds_per_message,
            max_bos_per_session=cfg.max_bos_per_session, max_sessions_per_uid=cfg.max_sessions_per_uid,
            max_fds_per_session=cfg.max_fds_per_session))

    def update_gauges(self) -> None:
        m, pool = self.metrics, self.engine.pool
        m.set("vramd_sessions_active", len(self.sessions))
        m.set("vramd_connections", len(self.connections))
        m.set("vramd_staging_bytes_in_use", pool.in_use_bytes)
        m.set("vramd_staging_bytes_allocated", pool.allocated_bytes)
        m.set("vramd_staging_budget_bytes", pool.budget)
        m.set("vramd_uptime_seconds", round(time.monotonic() - self.started, 3))

    def status_line(self) -> str:
        running = sum(1 for s in self.sessions if not s.done)
        return (f"{'draining; ' if self.draining else ''}{running} session(s) running, {len(self.sessions)} open, "
                f"{len(self.connections)} connection(s)")

    # --- serving -------------------------------------------------------------

    async def serve(self, listener: socket.socket) -> None:
        """Accept until shutdown() is called, then drain and return."""
        listener.setblocking(False)
        loop = asyncio.get_running_loop()
        tasks = [loop.create_task(self._accept_loop(listener), name="vramd-accept"),
                 loop.create_task(self._housekeeping(), name="vramd-housekeeping")]
        systemd.notify("READY=1", f"STATUS={self.status_line()}")
        log.info("%s serving (%d backends, staging budget %d MiB)", SERVER, len(self.engine.backends),
                 self.cfg.staging_budget >> 20)
        try:
            await self._stop.wait()
        finally:
            tasks[0].cancel()
            await asyncio.gather(tasks[0], return_exceptions=True)
            await self._drain()
            tasks[1].cancel()
            await asyncio.gather(tasks[1], return_exceptions=True)
            self._write_metrics()

    def shutdown(self) -> None:
        if not self.draining:
            log.info("shutting down: draining %d session(s)", sum(1 for s in self.sessions if not s.done))
            self.draining = True
            systemd.notify("STOPPING=1", f"STATUS={self.status_line()}")
            self._stop.set()

    async def _drain(self) -> None:
        pending = [s for s in self.sessions if not s.done]
        if pending:
            done_waits = [asyncio.ensure_future(s.wait(None)) for s in pending]
            _, late = await asyncio.wait(done_waits, timeout=self.cfg.drain_timeout)
            for w in late:
                w.cancel()
            if late:
                log.warning("drain timeout (%g s): cancelling %d session(s)", self.cfg.drain_timeout, len(late))
        for s in self.sessions:
            await self.sessions.reap(s, "daemon shutting down")
        for task in list(self._conn_tasks):
            task.cancel()  # each closes its socket on the way out
        await asyncio.gather(*self._conn_tasks, return_exceptions=True)

    async def _accept_loop(self, listener: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                sock, _ = await loop.sock_accept(listener)
            except OSError as e:  # EMFILE and friends: report, back off a little, go on
                log.error("accept failed: %s", e)
                await asyncio.sleep(0.1)
                continue
            task = loop.create_task(self._connection(sock))
            self._conn_tasks.add(task)
            task.add_done_callback(self._conn_tasks.discard)

    async def _housekeeping(self) -> None:
        interval = systemd.watchdog_interval()
        period = min(x for x in (interval, self.cfg.metrics_interval if self.cfg.metrics_textfile else None, 5.0)
                     if x is not None)
        while True:
            if interval is not None:
                systemd.notify("WATCHDOG=1")
            systemd.notify(f"STATUS={self.status_line()}")
            self._write_metrics()
            await asyncio.sleep(period)

    def _write_metrics(self) -> None:
        if not self.cfg.metrics_textfile:
            return
        self.update_gauges()
        try:
            self.metrics.write_textfile(self.cfg.metrics_textfile)
        except OSError as e:
            log.error("cannot write metrics to %s: %s", self.cfg.metrics_textfile, e)

    # --- one connection ------------------------------------------------------

    def _authorised(self, uid: int, gid: int, groups: set[int]) -> bool:
        return uid in self.allowed_uids or bool(({gid} | groups) & self.allowed_gids)

    async def _connection(self, sock: socket.socket) -> None:
        channel = PacketChannel(sock, max_bytes=self.cfg.max_message_bytes, max_fds=self.cfg.max_fds_per_message)
        try:  # room for big replies (status, session lists); the kernel caps it at wmem_max
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 2 * self.cfg.max_message_bytes)
        except OSError:
            pass
        protocol = ServerProtocol(self._hello, self.cfg.max_message_bytes, self.cfg.max_fds_per_message)
        try:
            pid, uid, gid = channel.peercred()
            refusal = None
            if not self._authorised(uid, gid, channel.peergroups()):
                refusal = PermissionDeniedError(f"uid {uid} (gid {gid}) is not allowed to use vramd")
            elif len(self.connections) >= self.cfg.max_connections:
                refusal = LimitExceededError(f"too many connections (limit {self.cfg.max_connections})")
            if refusal is not None:
                log.warning("refused pid %d uid %d: %s", pid, uid, refusal.message)
                self.metrics.inc("vramd_connections_refused_total")
                try:  # answer the client's first request (its Hello) with the refusal
                    first = await asyncio.wait_for(channel.recv(), 5.0)
                except asyncio.TimeoutError:
                    first = None
                if first is not None:
                    close_fds(first[1])
                for r in protocol.refuse(refusal):
                    await channel.send(r.data)
                return
            conn = Connection(self._next_conn, channel, protocol, pid, uid, gid)
            self._next_conn += 1
            self.connections[conn.id] = conn
            try:
                await self._serve_connection(conn)
            finally:
                del self.connections[conn.id]
                for s in conn.sessions:
                    self.sessions.let_go(s, conn)
        finally:
            channel.close()

    async def _serve_connection(self, conn: Connection) -> None:
        """Requests are handled in order; the reader goes on meanwhile, so a hang-up is seen at once."""
        queue: asyncio.Queue = asyncio.Queue(maxsize=16)
        handler = asyncio.get_running_loop().create_task(self._handle_queue(conn, queue))
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

    async def _handle_queue(self, conn: Connection, queue: asyncio.Queue) -> None:
        while (event := await queue.get()) is not None:
            if isinstance(event, Reply):
                if not await conn.channel.send(event.data) or event.close:
                    return
                continue
            try:
                out = await self._dispatch(conn, event.request, event.fds)
            finally:
                event.fds.close()
            if out is None or not await self._send_reply(conn, event.request.id, out):
                return

    async def _send_reply(self, conn: Connection, request_id: int, out: Reply) -> bool:
        try:
            return await conn.channel.send(out.data)
        except OSError as e:
            if e.errno != errno.EMSGSIZE:
                raise
        err = LimitExceededError(f"the reply ({len(out.data)} bytes) is larger than this socket can carry")
        return await conn.channel.send(reply(request_id, err).data)

    # --- dispatch ------------------------------------------------------------

    async def _dispatch(self, conn: Connection, req: rpc.Request, fds: FdBundle) -> Reply | None:
        kind = req.WhichOneof("body")
        self.metrics.inc("vramd_requests_total", type=kind)
        handler = getattr(self, f"_do_{kind}", None)
        try:
            if handler is None:
                raise InvalidRequestError(f"request type {kind!r} is not handled here")
            return await handler(conn, req, getattr(req, kind), fds)
        except VramdError as e:
            self.metrics.inc("vramd_errors_total", code=e.code)
            return reply(req.id, e)
        except asyncio.CancelledError:
            return None  # a Wait whose client hung up
        except Exception as e:
            log.exception("internal error handling %s", kind)
            return reply(req.id, InternalError(f"internal error handling {kind}: {e!r}"))

    def _session(self, conn: Connection, token: str) -> Session:
        return self._hold(conn, self.sessions.get(token, conn.uid))

    def _hold(self, conn: Connection, s: Session) -> Session:
        """`conn` now holds `s`: the session outlives it only by the grace period."""
        self.sessions.hold(s, conn)
        conn.sessions.add(s)
        return s

    async def _do_open_session(self, conn, req, body: rpc.OpenSession, fds) -> Reply:
        if self.draining:
            raise ShuttingDownError("the daemon is shutting down and takes no new sessions")
        s = self._hold(conn, await self.sessions.open(body, fds, uid=conn.uid, pid=conn.pid))
        return reply(req.id, session=s.info(with_token=True))

    async def _do_add_bos(self, conn, req, body: rpc.AddBos, fds) -> Reply:
        s = self._session(conn, body.token)
        await s.add(body.bos, fds)
        return reply(req.id, session=s.info())

    async def _do_start(self, conn, req, body: rpc.Start, fds) -> Reply:
        s = self._session(conn, body.token)
        s.seal()
        return reply(req.id, session=s.info())

    async def _do_get_progress(self, conn, req, body: rpc.GetProgress, fds) -> Reply:
        s = self._session(conn, body.token)
        return reply(req.id, session=s.info())

    async def _do_wait(self, conn, req, body: rpc.Wait, fds) -> Reply:
        s = self._session(conn, body.token)
        timeout = body.timeout_ms / 1000 if body.HasField("timeout_ms") else None
        conn.waiting = asyncio.ensure_future(s.wait(timeout))
        try:
            await conn.waiting
        except WaitTimeoutError as e:
            return reply(req.id, e, session=s.info())
        finally:
            conn.waiting = None
        return reply(req.id, s.error, session=s.info())

    async def _do_cancel(self, conn, req, body: rpc.Cancel, fds) -> Reply:
        s = self._session(conn, body.token)
        s.cancel(body.reason or f"cancelled by pid {conn.pid}")
        return reply(req.id, session=s.info())

    async def _do_close_session(self, conn, req, body: rpc.CloseSession, fds) -> Reply:
        s = self._session(conn, body.token)
        await self.sessions.close(s)
        conn.sessions.discard(s)
        return reply(req.id, session=s.info())

    async def _do_get_status(self, conn, req, body, fds) -> Reply:
        self.update_gauges()
        pool = self.engine.pool
        return reply(req.id, status=rpc.StatusReply(
            server=SERVER, version=conn.protocol.version, uptime_s=time.monotonic() - self.started,
            connections=len(self.connections), sessions=len(self.sessions), staging_budget=pool.budget,
            staging_in_use=pool.in_use_bytes, backends=self.backend_infos(), metrics=self.metrics.render(),
            draining=self.draining))

    async def _do_list_sessions(self, conn, req, body, fds) -> Reply:
        see_all = conn.uid in (0, os.getuid())
        infos = [s.info() for s in self.sessions if see_all or s.uid == conn.uid]
        return reply(req.id, sessions=rpc.SessionList(sessions=infos))
