"""The daemon's life: what it says about itself, accepting, housekeeping, draining on shutdown.

The protocol (vramd.protocol) decides what a packet means; connection.py
serves one connection, handlers.py answers each request, sessions.py and
session_table.py hold the jobs.
"""
from __future__ import annotations

import asyncio
import gc
import logging
import os
import socket
import time

from .. import __version__, topology
from ..backends import REGISTRY
from ..engine.engine import Engine
from ..errors import WIRE_ERRORS
from ..pb import rpc_pb2 as rpc
from ..protocol.server import ServerProtocol
from . import systemd
from .config import RELOADABLE, DaemonConfig
from .connection import Connection, serve_connection
from .metrics import Metrics
from .session_state import KIND_NAMES
from .session_table import SessionTable
from .sessions import Session
from .transport import PacketChannel
from .usage import SessionLimits, UidLimits

log = logging.getLogger("vramd.service.daemon")
SERVER = f"vramd {__version__}"


class GcPolicy:
    """Python's full (oldest-generation) collection scans every tracked object at once.

    A session of tens of thousands of BOs holds hundreds of thousands of
    objects, and a full collection then holds the event loop (every client)
    for a few hundred ms.  So: what exists at start-up is frozen (never
    scanned), the young generations are collected as usual (their cost is
    bounded by their thresholds; see YOUNG), and the full collection runs only from
    housekeeping, when no session has run for a whole period, or at the
    latest every FULL_EVERY seconds (under constant load, what cyclic garbage
    there is: a finished session is freed by reference counting, but e.g. an
    in-process job's error holds the job through its traceback's frames).
    """

    FULL_EVERY = 60.0
    # Young collections every YOUNG container allocations, not Python's default 700: a session allocates
    # a few objects per BO and chunk, and at 700 the collections that scan them (and every object they
    # reach) cost 0.10-0.14 s of CPU per dump + restore of 10,000 small BOs; at 20,000, 0.03 s.
    YOUNG = 20_000

    def __init__(self) -> None:
        self.last_full = time.monotonic()
        self._saved: tuple[int, ...] | None = None

    def start(self) -> None:
        gc.collect()
        gc.freeze()
        self._saved = gc.get_threshold()
        t0, t1, _ = self._saved
        gc.set_threshold(max(t0, self.YOUNG), t1, 1 << 30)  # no automatic full collection

    def stop(self) -> None:
        if self._saved is not None:
            gc.set_threshold(*self._saved)
            self._saved = None

    def tick(self, *, idle: bool) -> None:
        now = time.monotonic()
        if self._saved is None or not (idle or now - self.last_full > self.FULL_EVERY):
            return
        if gc.get_count()[2] == 0 and not now - self.last_full > self.FULL_EVERY:
            return  # nothing reached the oldest generation since the last one
        t = time.perf_counter()
        found = gc.collect()
        self.last_full = now
        log.debug("full garbage collection: %d unreachable objects, %.1f ms", found, (time.perf_counter() - t) * 1e3)


class Daemon:
    EXTEND_STEP = 5.0  # seconds between EXTEND_TIMEOUT_USEC notes while draining (each asks for twice that)

    def __init__(self, cfg: DaemonConfig, engine: Engine | None = None) -> None:
        self.cfg = cfg
        self.topology = self._read_topology()
        gpus = self.topology.gpus if self.topology else []
        self.engine = engine or Engine(cfg.engine_config(
            render_nodes={g.gpu_id: topology.render_node(g) for g in gpus}))
        self.metrics = Metrics()
        # The GPUs a BO may name (each gpu_id gets pools and lanes): the topology's, else 0 and the configured ones
        self.gpu_ids = frozenset(g.gpu_id for g in gpus) if self.topology else frozenset({0, *cfg.gpu_ids})
        self.sessions = SessionTable(
            self.engine, self.metrics, grace_period=cfg.grace_period, max_hold=cfg.max_hold,
            max_per_uid=cfg.max_sessions_per_uid,
            limits=SessionLimits(cfg.max_bos_per_session, cfg.max_fds_per_session, cfg.max_chunks_per_session,
                                 self.gpu_ids),
            uid_limits=UidLimits(cfg.max_bos_per_uid, cfg.max_fds_per_uid, cfg.max_sessions_per_uid),
            topology=self.topology, topology_checks=cfg.topology_checks)
        self.connections: dict[int, Connection] = {}
        self.allowed_uids = set(cfg.allowed_uids) | {os.getuid()}  # the daemon's own uid, always
        self.allowed_gids = cfg.allowed_gids()
        self.started = time.monotonic()
        self.draining = False
        self._next_conn = 1
        self.refusing = 0  # refused peers being answered
        self._conn_tasks: set[asyncio.Task[None]] = set()
        self._reaping: set[asyncio.Task[None]] = set()  # dumps whose opener hung up, reaped once stopped
        self._stop = asyncio.Event()
        self._wake = asyncio.Event()  # housekeeping runs now (a reload)
        self.server = SERVER
        self.hello = self._hello_reply()
        self.gc = GcPolicy()
        self._metrics_written = float("-inf")  # when metrics_textfile was last written (monotonic)
        self.metrics.set("vramd_build_info", 1, version=__version__)
        self._declare_counters()

    # --- what the daemon says about itself -----------------------------------

    def backend_infos(self) -> list[rpc.BackendInfo]:
        out = []
        for name in REGISTRY:
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

    def _read_topology(self) -> topology.Topology | None:
        try:
            topo = topology.parse_topology(self.cfg.topology_root)
        except topology.TopologyError as e:
            log.info("no GPUs: %s", e.message)
            return None
        log.info("KFD topology: %s", topo.summary())
        return topo

    def _hello_reply(self) -> rpc.HelloReply:
        cfg = self.cfg
        gpu_ids = [g.gpu_id for g in self.topology.gpus] if self.topology else []  # GPUs present, not allowed ids
        return rpc.HelloReply(server=SERVER, backends=self.backend_infos(), gpu_ids=gpu_ids,
                              allowed_gpu_ids=sorted(self.gpu_ids), supply_notes=cfg.supply_notes,
                              limits=rpc.Limits(
            max_message_bytes=cfg.max_message_bytes, max_fds_per_message=cfg.max_fds_per_message,
            max_bos_per_session=cfg.max_bos_per_session, max_sessions_per_uid=cfg.max_sessions_per_uid,
            max_fds_per_session=cfg.max_fds_per_session, max_chunks_per_session=cfg.max_chunks_per_session,
            max_bos_per_uid=cfg.max_bos_per_uid, max_fds_per_uid=cfg.max_fds_per_uid,
            max_queued_requests=cfg.max_queued_requests, max_connections_per_uid=cfg.max_connections_per_uid,
            hello_timeout_ms=int(cfg.hello_timeout * 1000)))

    def _declare_counters(self) -> None:
        """Every counter at 0 for each label value it can take, from the start."""
        m = self.metrics
        m.declare("vramd_bytes_total", *({"backend": b, "direction": d} for b in REGISTRY for d in ("read", "write")))
        m.declare("vramd_sessions_total", *({"kind": k, "outcome": o} for k in KIND_NAMES.values()
                                            for o in ("done", "cancelled", "failed")))
        m.declare("vramd_bos_total", *({"kind": k} for k in KIND_NAMES.values()))
        m.declare("vramd_errors_total", *({"code": code} for code in WIRE_ERRORS))
        body = rpc.Request.DESCRIPTOR.oneofs_by_name["body"]
        m.declare("vramd_requests_total", *({"type": f.name} for f in body.fields))
        m.declare("vramd_connections_refused_total")

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

    def reconfigure(self, new: DaemonConfig) -> None:
        """SIGHUP: apply the keys of RELOADABLE from `new`; other changed keys wait for a restart (logged)."""
        systemd.notify("RELOADING=1", f"STATUS=reloading; {self.status_line()}")
        old = self.cfg
        changed = [k for k in RELOADABLE if getattr(old, k) != getattr(new, k)]
        for key in changed:
            setattr(old, key, getattr(new, key))
        self.allowed_uids = set(old.allowed_uids) | {os.getuid()}
        self.allowed_gids = old.allowed_gids()  # group names looked up again: a group created since counts now
        self.sessions.grace_period = old.grace_period
        self.sessions.set_max_hold(old.max_hold)
        self._metrics_written = float("-inf")  # a new textfile (or interval) is written at the next tick
        self._wake.set()
        later = sorted(k for k in old.effective() if k not in RELOADABLE and getattr(old, k) != getattr(new, k))
        log.info("SIGHUP: configuration reloaded; changed: %s", ", ".join(changed) or "nothing")
        if later:
            log.warning("SIGHUP: %s changed in the file; %s effect only at a restart", ", ".join(later),
                        "it takes" if len(later) == 1 else "they take")
        systemd.notify("READY=1", f"STATUS={self.status_line()}")

    # --- serving -------------------------------------------------------------

    async def serve(self, listener: socket.socket) -> None:
        """Accept until shutdown() is called, then drain and return."""
        listener.setblocking(False)
        loop = asyncio.get_running_loop()
        tasks = [loop.create_task(self._accept_loop(listener), name="vramd-accept"),
                 loop.create_task(self._housekeeping(), name="vramd-housekeeping")]
        self.gc.start()
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
            await self._write_metrics()
            self.gc.stop()

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
            deadline = time.monotonic() + self.cfg.drain_timeout
            late: set[asyncio.Future[None]] = set(done_waits)
            while late and (left := deadline - time.monotonic()) > 0:
                # the manager's stop timeout must not kill a drain that is within drain_timeout:
                # each note asks for EXTEND_STEP more (and the drain ends by the deadline anyway)
                systemd.notify(f"EXTEND_TIMEOUT_USEC={int(self.EXTEND_STEP * 2e6)}",
                               f"STATUS=draining: {len(late)} session(s) running, {left:.0f} s left")
                _, late = await asyncio.wait(late, timeout=min(left, self.EXTEND_STEP))
            for w in late:
                w.cancel()
            if late:
                log.warning("drain timeout (%g s): cancelling %d session(s)", self.cfg.drain_timeout, len(late))
        for s in self.sessions.detach_all("daemon shutting down"):
            await s.close("session reaped: daemon shutting down")
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
            task = loop.create_task(serve_connection(self, sock))
            self._conn_tasks.add(task)
            task.add_done_callback(self._conn_tasks.discard)

    async def _housekeeping(self) -> None:
        interval = systemd.watchdog_interval()
        was_idle = False
        while True:
            if interval is not None:
                systemd.notify("WATCHDOG=1")
            systemd.notify(f"STATUS={self.status_line()}")
            now = time.monotonic()
            if now - self._metrics_written >= self.cfg.metrics_interval:  # the textfile every metrics_interval
                self._metrics_written = now
                await self._write_metrics()
            idle = not any(not s.done for s in self.sessions)
            self.gc.tick(idle=idle and was_idle)  # idle for a whole period: a full collection stalls nobody's copy
            was_idle = idle
            period = min(x for x in (interval, 5.0) if x is not None)
            if self.cfg.metrics_textfile:  # the next tick when the textfile is due, if that is sooner
                period = min(period, max(0.0, self._metrics_written + self.cfg.metrics_interval - time.monotonic()))
            self._wake.clear()
            try:
                await asyncio.wait_for(self._wake.wait(), period)
            except TimeoutError:
                pass

    async def _write_metrics(self) -> None:
        """Render on the loop (a consistent snapshot), write the file in a thread (a slow disk stalls no client)."""
        path = self.cfg.metrics_textfile
        if not path:
            return
        self.update_gauges()
        text = self.metrics.render()
        try:
            await asyncio.get_running_loop().run_in_executor(None, self.metrics.write_textfile, path, text)
        except OSError as e:
            log.error("cannot write metrics to %s: %s", path, e)

    # --- connections --------------------------------------------------------

    def authorised(self, uid: int, gid: int, groups: set[int]) -> bool:
        return uid in self.allowed_uids or bool(({gid} | groups) & self.allowed_gids)

    def connections_of(self, uid: int) -> int:
        return self.sessions.usage_of(uid).connections

    def register(self, channel: PacketChannel, protocol: ServerProtocol, pid: int, uid: int, gid: int) -> Connection:
        conn = Connection(self._next_conn, channel, protocol, pid, uid, gid)
        self._next_conn += 1
        self.connections[conn.id] = conn
        log.debug("connection %d opened: pid %d uid %d", conn.id, pid, uid)
        return conn

    def unregister(self, conn: Connection) -> None:
        """`conn` has closed: it no longer holds its sessions."""
        del self.connections[conn.id]
        for s in list(conn.sessions):
            self.sessions.let_go(s, conn)
            # a dump nobody can commit any more is cancelled now, and reaped once stopped if nobody else holds it
            if s.opener_gone(conn) and not s.holders:
                task = asyncio.get_running_loop().create_task(self._reap_when_stopped(s))
                self._reaping.add(task)
                task.add_done_callback(self._reaping.discard)

    async def _reap_when_stopped(self, s: Session) -> None:
        """A dump whose opener hung up: listed (CANCELLING) until its copies have stopped, then reaped at once,
        not after the grace period, unless another connection has come to hold it meanwhile."""
        await s.wait(None)
        if not s.holders and self.sessions.detach(s, "its opener hung up"):
            await s.close("session reaped: its opener hung up")
