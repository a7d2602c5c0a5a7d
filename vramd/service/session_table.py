"""The session table: every live session by token; opening, lookup with the uid check, holders and reaping.

Deciding what to reap (`detach`, `detach_all`) is apart from awaiting the
reaped sessions' ends (`Session.close`).
"""
from __future__ import annotations

import asyncio
import json
import logging
import os
from collections.abc import Iterator, Mapping
from dataclasses import replace

from ..engine.engine import Engine
from ..engine.jobs.interface import Job
from ..errors import InvalidRequestError, LimitExceededError, NotFoundError, PermissionDeniedError, TopologyError
from ..image.codec import Compression
from ..image.reader import ImageReader
from ..pb import image_pb2 as pb
from ..pb import rpc_pb2 as rpc
from ..protocol.fds import FdBundle, close_fds
from ..topology import CHECK_ENV, Checks, Topology, map_gpus
from .metrics import Metrics
from .session_report import image_summary
from .session_state import KIND_NAMES
from .sessions import Session
from .usage import SessionLimits, UidLimits, UidUsage

log = logging.getLogger("vramd.service.sessions")


MAX_PARENT_FDS = 64  # parent manifests one OpenSession may pass (a chain is at most max_chain_depth deep)


class SessionTable:
    """Every live session, by token; opening, lookup with the uid check, reaping."""

    def __init__(self, engine: Engine, metrics: Metrics, *, grace_period: float, max_per_uid: int,
                 limits: SessionLimits, max_hold: float = 0.0,
                 uid_limits: UidLimits | None = None, topology: Topology | None = None,
                 topology_checks: Mapping[str, bool] | None = None) -> None:
        self.engine = engine
        self.metrics = metrics
        self.grace_period = grace_period
        self.max_hold = max_hold  # the most a restore's OpenSession.hold_s is granted (config max_hold)
        self.max_per_uid = max_per_uid
        self.limits = limits
        self.by_token: dict[str, Session] = {}
        uid_limits = uid_limits or UidLimits(limits.max_bos * max_per_uid, limits.max_fds * max_per_uid)
        self.uid_limits = replace(uid_limits, max_sessions=max_per_uid)
        self.usage: dict[int, UidUsage] = {}  # what each uid's sessions and requests hold (usage.py)
        # CRIU's KFD_*_CHECK switches as configured; a restore request may override each
        self.topology_checks = dict(topology_checks or {})
        self.topology = topology  # this machine's KFD topology: saved by dumps, mapped onto by restores
        self._topology_json = json.dumps(topology.to_dict()).encode() if topology is not None else b""
        self._next_id = 1

    def __len__(self) -> int:
        return len(self.by_token)

    def __iter__(self) -> Iterator[Session]:
        return iter(list(self.by_token.values()))

    def usage_of(self, uid: int) -> UidUsage:
        """What `uid`'s sessions and queued requests hold (one object per uid, for as long as the daemon runs)."""
        usage = self.usage.get(uid)
        if usage is None:
            usage = self.usage[uid] = UidUsage(self.uid_limits, uid)
        return usage

    async def open(self, req: rpc.OpenSession, bundle: FdBundle, *, uid: int, pid: int) -> Session:
        # Everything this open counts against its uid (a session, fds) is reserved before the first await
        # (usage.py), and given back if the open fails: concurrent opens cannot all pass one check.
        usage = self.usage_of(uid)
        usage.reserve_session()  # counted from here until the session leaves the table (`detach`)
        try:
            s = await self._open(req, bundle, usage, uid, pid)
        except BaseException:
            usage.release_session()
            raise
        log.info("session %d (%s) opened by uid %d pid %d%s", s.id, s.kind_name, uid, pid,
                 f" [{req.label}]" if req.label else "")
        return s

    async def _open(self, req: rpc.OpenSession, bundle: FdBundle, usage: UidUsage, uid: int, pid: int) -> Session:
        if req.kind not in KIND_NAMES:
            raise InvalidRequestError(f"unknown session kind {req.kind}")
        if req.hold_s and req.kind != rpc.SESSION_RESTORE:
            raise InvalidRequestError("hold_s is a restore option")
        checks = self._checks(req)
        nparents = len(req.parent_manifest_fd_indexes)
        if nparents > MAX_PARENT_FDS:
            raise LimitExceededError(f"{nparents} parent manifests; at most {MAX_PARENT_FDS} are taken")
        reads = req.kind != rpc.SESSION_DUMP  # restore and verify read an image: its manifest comes along
        streamed = req.HasField("supply_fd_index")
        if streamed and not reads:
            raise InvalidRequestError("supply_fd_index is a restore and verify option (a streamed image)")
        usage.reserve(fds=reads + nparents + streamed)  # until the Session, which counts them, is made
        fds: list[int] = []
        try:
            if reads:
                fds.append(bundle.take(req.manifest_fd_index))
            for i in req.parent_manifest_fd_indexes:  # held, like the image's, until the session ends
                fds.append(bundle.take(i))
            if streamed:  # the supply pipe: held too, read by the job until it ends
                fds.append(bundle.take(req.supply_fd_index))
            bundle.close()  # what the packet carried besides: not held, uncounted, while the image is read
            manifest_fd = fds[0] if reads else None
            supply_fd = fds[-1] if streamed else None
            job, manifest, image_id = await self._job(req, manifest_fd, checks, fds[reads:reads + nparents],
                                                      supply_fd)
        except BaseException:
            close_fds(fds)
            raise
        finally:
            usage.release(fds=reads + nparents + streamed)
        s = Session(self._next_id, req.kind, uid, pid, req.label, job, self.limits, self.metrics, usage,
                    fds=fds, image_id=image_id)
        self._next_id += 1
        if manifest is not None:  # the image a restore or verify reads
            s.image = image_summary(manifest)
        if req.hold_s:
            s.hold = min(float(req.hold_s), self.max_hold)
            log.info("session %d: held %g s once no connection holds it (asked %d s, max_hold %g s)", s.id, s.hold,
                     req.hold_s, self.max_hold)
        if req.replace_parent:
            log.warning("session %d: uid %d replaces an image that incremental images are marked as needing "
                        "(replace_parent)", s.id, uid)
        if s.ready and req.kind == rpc.SESSION_VERIFY:
            await s.seal()
        self.by_token[s.token] = s
        return s

    def _checks(self, req: rpc.OpenSession) -> Checks:
        """The topology checks of a restore: the configured switches, then the request's."""
        switches = {**self.topology_checks, **req.topology_checks}
        unknown = sorted(set(switches) - set(CHECK_ENV.values()))
        if unknown:
            raise InvalidRequestError(f"unknown topology check {unknown[0]!r} (known: "
                                      f"{', '.join(sorted(CHECK_ENV.values()))})")
        return Checks(**{attr: switches.get(var, True) for attr, var in CHECK_ENV.items()})

    async def _job(self, req: rpc.OpenSession, manifest_fd: int | None, checks: Checks,
                   parent_fds: list[int], supply_fd: int | None) -> tuple[Job, pb.Manifest | None, bytes]:
        """The session's job, the manifest of the image it reads (None for a dump), and the image's id.
        `supply_fd`: a streamed restore's or verify's supply pipe."""
        if req.kind == rpc.SESSION_DUMP:
            try:
                comp = Compression.parse(req.compression) if req.compression else None  # None: the engine's
            except ValueError as e:
                raise InvalidRequestError(str(e)) from None
            parent = await self.engine.open_parent(parent_fds) if parent_fds else None
            image_id = os.urandom(16)
            job = self.engine.start_dump(image_id, compression=comp,
                                         chunk_size=req.chunk_size or None, parent=parent,
                                         parent_hint=req.parent_hint, dedup=not req.no_dedup)
            job.topology_json = self._topology_json
            return job, None, image_id
        if req.parent_hint or req.no_dedup or req.replace_parent:
            raise InvalidRequestError("parent_hint, no_dedup and replace_parent are dump options")
        assert manifest_fd is not None
        reader = await ImageReader.from_manifests(manifest_fd, parent_fds)
        if req.kind == rpc.SESSION_RESTORE:
            restore = self.engine.start_restore(reader, gpu_map=lambda m: self._gpu_map(m, checks),
                                                allow_partial=req.allow_partial, supply_fd=supply_fd)
            return restore, reader.manifest, reader.manifest.image_id
        verify = self.engine.start_verify(reader, supply_fd=supply_fd)
        return verify, reader.manifest, reader.manifest.image_id

    def _gpu_map(self, manifest: pb.Manifest, checks: Checks) -> dict[int, int] | None:
        """Image GPUs -> present GPUs, by CRIU's rules (the KFD_*_CHECK switches in `checks`); None: as saved."""
        if not manifest.topology_json:
            return None
        if self.topology is None:
            log.warning("the image records a KFD topology but this machine has none: BOs keep their gpu_ids")
            return None
        try:
            saved = Topology.from_dict(json.loads(manifest.topology_json))
        except ValueError as e:
            raise TopologyError(f"the image's topology cannot be read: {e}") from None
        mapping = map_gpus(saved, self.topology, checks)
        off = checks.disabled()
        log.info("GPU map (image -> here): %s%s", ", ".join(f"{a:#x}->{b:#x}" for a, b in sorted(mapping.items())),
                 f" (checks off: {', '.join(off)})" if off else "")
        return mapping

    def get(self, token: str, uid: int) -> Session:
        s = self.by_token.get(token)
        if s is None:
            raise NotFoundError("no session with that token (closed, reaped, or never opened)")
        if s.uid != uid:
            raise PermissionDeniedError(f"the session belongs to another uid; uid {uid} may not use its token")
        return s

    def by_id(self, session_id: int) -> Session:
        """The live session with that id (an operator's handle: ids are small numbers, not credentials)."""
        for s in self.by_token.values():
            if s.id == session_id:
                return s
        raise NotFoundError(f"no session {session_id} (closed, reaped, or never opened)")

    # --- holders and reaping -------------------------------------------------

    def hold(self, s: Session, conn: object) -> None:
        s.holders.add(conn)

    def let_go(self, s: Session, conn: object) -> None:
        """`conn` is gone; a session nobody holds is reaped after the grace period, or after its hold where it
        was granted a longer one (a restore's OpenSession.hold_s: the CRIU offload's submit) and was started
        (one nobody started never runs: its fds go after the grace period).  Either way it counts against its
        uid's sessions until then."""
        s.holders.discard(conn)
        if not s.holders and s.token in self.by_token and s.holders.reap_timer is None:
            if self._held(s):
                log.info("session %d: no connection holds it; kept %g s for its token (hold)", s.id, s.hold)
            self._arm(s, 0.0)

    def _held(self, s: Session) -> bool:
        return s.hold > self.grace_period and s.state != rpc.SESSION_OPEN

    def _arm(self, s: Session, elapsed: float) -> None:
        """Reap `s` once nobody has held it for its hold (or the grace period); `elapsed` of that is gone."""
        loop = asyncio.get_running_loop()
        held = self._held(s)
        why = "hold over" if held else "grace period over"

        def expire() -> None:
            s.holders.reap_timer = None
            if held and s.token in self.by_token:
                log.info("session %d: hold over (%g s): reaped, its token forgotten", s.id, s.hold)
            if self.detach(s, why):
                s.holders.reap_task = loop.create_task(s.close(f"session reaped: {why}"))  # kept
        wait = s.hold if held else self.grace_period
        s.holders.reap_timer = loop.call_later(max(0.0, wait - elapsed), expire)
        s.holders.let_go_at = loop.time() - elapsed

    def set_max_hold(self, max_hold: float) -> None:
        """SIGHUP: a lower max_hold bounds the holds granted before it too, those counting down included
        (counted from when nobody held the session any more); a higher one lengthens none."""
        self.max_hold = max_hold
        for s in self.by_token.values():
            if s.hold <= max_hold:
                continue
            log.info("session %d: hold %g s cut to max_hold %g s", s.id, s.hold, max_hold)
            s.hold = max_hold
            if s.holders.reap_timer is not None:
                s.holders.stop_timer()
                self._arm(s, asyncio.get_running_loop().time() - s.holders.let_go_at)

    def detach(self, s: Session, why: str) -> bool:
        """Take `s` out of the table (no token reaches it any more); False if it was not there.

        The caller then awaits `s.close(...)`, which cancels a job still running."""
        if self.by_token.get(s.token) is not s:
            return False
        del self.by_token[s.token]
        s.usage.release(bos=s.bo_count)  # its BOs go with it (its fds are closed by its end)
        s.usage.release_session()
        # No token reaches it any more: the connections that held it forget it (a long-lived connection that
        # looked at sessions others closed kept each, with its job and image, for as long as it lived)
        for conn in s.holders:
            held = getattr(conn, "sessions", None)
            if held is not None:
                held.discard(s)
        s.holders.clear()
        if not s.done:
            log.warning("session %d: no client holds it any more (%s); cancelling", s.id, why)
        return True

    def detach_all(self, why: str) -> list[Session]:
        """Take every session out of the table (shutdown); the caller awaits their ends."""
        return [s for s in self if self.detach(s, why)]

    async def close(self, s: Session) -> None:
        """A client closed `s`: it ends now (cancelled if it still runs)."""
        if self.detach(s, "closed by client"):
            await s.close("session reaped: closed by client")
