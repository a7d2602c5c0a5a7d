"""Sessions: one dump, restore or verify job, addressed by a token.

A session owns the fds its clients passed (the image directory, BO fds)
and closes them when its job ends.  Any connection of the same uid that
presents the token is a *holder*; when the last holder goes away the
session is reaped after a grace period (cancelled first if it still runs),
so the process that submits a restore and the process that waits for it
(the offload) can be different connections, and a client that dies leaves
nothing behind.
"""
from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import secrets
import stat
import time
from dataclasses import dataclass, field

from .backends import BoRef
from .codec import Compression
from .engine import Engine
from .errors import (
    CancelledError,
    InternalError,
    InvalidRequestError,
    LimitExceededError,
    NotFoundError,
    PermissionDeniedError,
    VramdError,
    WaitTimeoutError,
)
from .jobs import BoSpec, DumpJob, RestoreTarget
from .metrics import Metrics
from .pb import image_pb2 as pb
from .pb import rpc_pb2 as rpc
from .protocol import FdBundle, close_fds, error_to_pb
from .topology import Checks, Topology, TopologyError, map_gpus

log = logging.getLogger(__name__)

_PROCMEM_LINK = re.compile(r"^/proc/\d+/mem$")
_KIND_NAMES = {rpc.SESSION_DUMP: "dump", rpc.SESSION_RESTORE: "restore", rpc.SESSION_VERIFY: "verify"}


def pick_backend(fd: int) -> str:
    """The backend for an fd whose client named none: procmem for /proc/<pid>/mem, else mmap."""
    try:
        target = os.readlink(f"/proc/self/fd/{fd}")  # our own fd table, not a client-named path
    except OSError:
        return "mmap"
    return "procmem" if _PROCMEM_LINK.match(target) else "mmap"


def image_summary(m: pb.Manifest) -> rpc.ImageSummary:
    comp = "none" if m.compression.codec != pb.CODEC_ZSTD else f"zstd:{m.compression.level}"
    return rpc.ImageSummary(bo_count=m.totals.bo_count, bo_bytes=m.totals.bo_bytes,
                            stored_bytes=m.totals.stored_bytes, zero_bytes=m.totals.zero_bytes,
                            chunk_size=m.chunk_size, compression=comp, data_files=len(m.files))


@dataclass(frozen=True)
class SessionLimits:
    max_bos: int
    max_fds: int


@dataclass(eq=False)
class Session:
    id: int
    kind: int
    uid: int
    pid: int
    label: str
    job: object
    dir_fd: int
    limits: SessionLimits
    metrics: Metrics
    token: str = field(default_factory=lambda: secrets.token_hex(16))
    state: int = rpc.SESSION_OPEN
    error: VramdError | None = None
    image: rpc.ImageSummary | None = None
    fds: list[int] = field(default_factory=list)
    holders: set = field(default_factory=set)
    started: float = field(default_factory=time.monotonic)
    ended: float | None = None
    bo_count: int = 0
    finisher: asyncio.Task | None = None
    reap_timer: asyncio.TimerHandle | None = None
    reap_task: asyncio.Task | None = None
    allow_partial: bool = False

    def __post_init__(self) -> None:
        self.fds.append(self.dir_fd)
        self._done = asyncio.Event()
        # A copy that fails while the client is still adding BOs ends the session now,
        # so progress shows the error and the fds are released without waiting for Start.
        self.job.pipeline.on_fail = lambda exc: self._end_soon()

    @property
    def kind_name(self) -> str:
        return _KIND_NAMES[self.kind]

    @property
    def done(self) -> bool:
        return self._done.is_set()

    # --- requests ------------------------------------------------------------

    async def add(self, bos, bundle: FdBundle) -> None:
        """Take the BOs of one AddBos message (and the fds they name) into the job."""
        if self.kind == rpc.SESSION_VERIFY:
            raise InvalidRequestError("a verify session takes no BOs")
        if self.job.pipeline.error is not None:
            raise self.job.pipeline.error
        if self.state != rpc.SESSION_OPEN:
            if self.error is not None:
                raise self.error
            raise InvalidRequestError(f"the session is {rpc.SessionState.Name(self.state)} and takes no more BOs")
        if self.bo_count + len(bos) > self.limits.max_bos:
            raise LimitExceededError(f"more than {self.limits.max_bos} BOs in one session")
        fds: dict[int, int] = {}
        for bo in bos:  # validate every index before taking any fd
            if bo.fd_index not in fds:
                fds[bo.fd_index] = bundle.peek(bo.fd_index)
        if len(self.fds) + len(fds) > self.limits.max_fds:
            raise LimitExceededError(f"more than {self.limits.max_fds} fds in one session")
        for index in fds:
            self.fds.append(bundle.take(index))
        # the backend of a BO that names none follows from its fd: looked at once per fd, not per BO
        kinds = {i: pick_backend(fds[i]) for i in {bo.fd_index for bo in bos if not bo.backend}}
        make = self._spec if isinstance(self.job, DumpJob) else self._target
        items = [make(bo, BoRef(bo.backend or kinds[bo.fd_index], fds[bo.fd_index], bo.offset)) for bo in bos]
        if len(fds) > 1:  # fds of many BOs: check them in a worker thread, off the event loop
            refs = {it.ref.fd: ((it.id if isinstance(it, BoSpec) else it.bo_id), it.ref) for it in items}
            await asyncio.get_running_loop().run_in_executor(self.job.ctx.io, self.job.precheck, refs.values())
        try:
            if self.job.pipeline.error is not None:  # failed while we were checking
                raise self.job.pipeline.error
            self.job.add(items)
        except VramdError as e:
            self._end_soon()  # the job has failed: clean up now, the error stays for Wait
            raise e
        self.bo_count += len(bos)

    @staticmethod
    def _spec(bo, ref: BoRef) -> BoSpec:
        return BoSpec(bo.id, bo.size, ref, gpu_id=bo.gpu_id if bo.HasField("gpu_id") else 0,
                      alloc_flags=bo.alloc_flags, va_addr=bo.va_addr, name=bo.name)

    @staticmethod
    def _target(bo, ref: BoRef) -> RestoreTarget:
        return RestoreTarget(bo.id, ref, gpu_id=bo.gpu_id if bo.HasField("gpu_id") else None)

    def seal(self) -> None:
        if self.state == rpc.SESSION_OPEN:
            self.state = rpc.SESSION_SEALED
        self._end_soon()

    def cancel(self, reason: str) -> None:
        if not self.done:
            self.job.cancel(reason)
            self._end_soon()

    async def wait(self, timeout: float | None) -> None:
        """The barrier: returns when the job has ended; raises WaitTimeoutError first if it takes longer."""
        if timeout is None:
            await self._done.wait()
            return
        try:
            await asyncio.wait_for(self._done.wait(), timeout)
        except asyncio.TimeoutError:
            raise WaitTimeoutError(f"session {self.id} still running after {timeout:g} s") from None

    async def close(self, reason: str = "session closed") -> None:
        self.cancel(reason)
        self._end_soon()
        await asyncio.shield(self.finisher)

    # --- the end -------------------------------------------------------------

    def _end_soon(self) -> None:
        if self.finisher is None:
            self.finisher = asyncio.get_running_loop().create_task(self._finish(), name=f"vramd-session-{self.id}")

    async def _finish(self) -> None:
        try:
            if isinstance(self.job, DumpJob):
                self.image = image_summary(await self.job.finish())
            else:
                await self.job.finish(allow_partial=self.allow_partial)
            self.state = rpc.SESSION_DONE
        except VramdError as e:
            self.error = e
            self.state = rpc.SESSION_CANCELLED if isinstance(e, CancelledError) else rpc.SESSION_FAILED
        except Exception as e:  # a bug: still an answer for the client
            log.exception("session %d: internal error", self.id)
            self.error = InternalError(f"internal error: {e!r}")
            self.state = rpc.SESSION_FAILED
        finally:
            self._close_fds()
            self.ended = time.monotonic()
            self._account()
            self._done.set()
            log.info("session %d (%s, uid %d): %s%s", self.id, self.kind_name, self.uid,
                     rpc.SessionState.Name(self.state), f": {self.error}" if self.error else "")

    def _close_fds(self) -> None:
        fds, self.fds = self.fds, []
        close_fds(fds)

    def _account(self) -> None:
        m, p = self.metrics, self.job.progress
        direction = "read" if self.kind == rpc.SESSION_DUMP else "write"
        for backend, nbytes in p.per_backend_bytes.items():
            m.inc("vramd_bytes_total", nbytes, backend=backend, direction=direction)
        outcome = {rpc.SESSION_DONE: "done", rpc.SESSION_CANCELLED: "cancelled"}.get(self.state, "failed")
        m.inc("vramd_sessions_total", kind=self.kind_name, outcome=outcome)
        m.inc("vramd_bos_total", p.bos_done, kind=self.kind_name)
        if self.error is not None:
            m.inc("vramd_errors_total", code=self.error.code)

    # --- reporting -----------------------------------------------------------

    def info(self, *, with_token: bool = False) -> rpc.SessionInfo:
        p = self.job.progress
        end = self.ended if self.ended is not None else time.monotonic()
        info = rpc.SessionInfo(
            session_id=self.id, kind=self.kind, state=self.state, uid=self.uid, pid=self.pid, label=self.label,
            holders=len(self.holders),
            progress=rpc.Progress(bos_total=p.bos_total, bos_done=p.bos_done, bytes_total=p.bytes_total,
                                  bytes_done=p.bytes_done, chunks_done=p.chunks_done, elapsed_s=end - self.started))
        if with_token:
            info.token = self.token
        if self.error is not None:
            info.error.CopyFrom(error_to_pb(self.error))
        if self.image is not None:
            info.image.CopyFrom(self.image)
        return info


class SessionTable:
    """Every live session, by token; opening, lookup with the uid check, reaping."""

    def __init__(self, engine: Engine, metrics: Metrics, *, grace_period: float, max_per_uid: int,
                 limits: SessionLimits, default_compression: Compression, default_chunk_size: int,
                 topology: Topology | None = None):
        self.engine = engine
        self.metrics = metrics
        self.grace_period = grace_period
        self.max_per_uid = max_per_uid
        self.limits = limits
        self.default_compression = default_compression
        self.default_chunk_size = default_chunk_size
        self.by_token: dict[str, Session] = {}
        self.topology = topology  # this machine's KFD topology: saved by dumps, mapped onto by restores
        self._topology_json = json.dumps(topology.to_dict()).encode() if topology is not None else b""
        self._next_id = 1

    def __len__(self) -> int:
        return len(self.by_token)

    def __iter__(self):
        return iter(list(self.by_token.values()))

    async def open(self, req: rpc.OpenSession, bundle: FdBundle, *, uid: int, pid: int) -> Session:
        if sum(1 for s in self.by_token.values() if s.uid == uid) >= self.max_per_uid:
            raise LimitExceededError(f"uid {uid} already has {self.max_per_uid} sessions open")
        if req.kind not in _KIND_NAMES:
            raise InvalidRequestError(f"unknown session kind {req.kind}")
        dir_fd = bundle.take(req.dir_fd_index)
        try:
            job = await self._job(req, dir_fd)
        except BaseException:
            os.close(dir_fd)
            raise
        s = Session(self._next_id, req.kind, uid, pid, req.label, job, dir_fd, self.limits, self.metrics,
                    allow_partial=req.allow_partial)
        self._next_id += 1
        if req.kind != rpc.SESSION_DUMP:
            s.image = image_summary(job.manifest)
        if req.kind == rpc.SESSION_VERIFY:
            s.seal()
        self.by_token[s.token] = s
        log.info("session %d (%s) opened by uid %d pid %d%s", s.id, s.kind_name, uid, pid,
                 f" [{req.label}]" if req.label else "")
        return s

    async def _job(self, req: rpc.OpenSession, dir_fd: int):
        try:
            st = os.fstat(dir_fd)
        except OSError as e:
            raise InvalidRequestError(f"image directory fd is not usable: {e.strerror}") from None
        if not stat.S_ISDIR(st.st_mode):
            raise InvalidRequestError("the image directory fd is not a directory")
        if req.kind == rpc.SESSION_DUMP:
            try:
                comp = Compression.parse(req.compression) if req.compression else self.default_compression
            except ValueError as e:
                raise InvalidRequestError(str(e)) from None
            job = self.engine.start_dump(dir_fd, compression=comp,
                                         chunk_size=req.chunk_size or self.default_chunk_size)
            job.topology_json = self._topology_json
            return job
        if req.kind == rpc.SESSION_RESTORE:
            return await self.engine.start_restore(dir_fd, gpu_map=self._gpu_map)
        return await self.engine.start_verify(dir_fd)

    def _gpu_map(self, manifest) -> dict[int, int] | None:
        """Image GPUs -> present GPUs, by CRIU's rules (KFD_*_CHECK switches honoured); None: as saved."""
        if not manifest.topology_json:
            return None
        if self.topology is None:
            log.warning("the image records a KFD topology but this machine has none: BOs keep their gpu_ids")
            return None
        try:
            saved = Topology.from_dict(json.loads(manifest.topology_json))
        except ValueError as e:
            raise TopologyError(f"the image's topology cannot be read: {e}") from None
        mapping = map_gpus(saved, self.topology, Checks.from_env(os.environ))
        log.info("GPU map (image -> here): %s", ", ".join(f"{a:#x}->{b:#x}" for a, b in sorted(mapping.items())))
        return mapping

    def get(self, token: str, uid: int) -> Session:
        s = self.by_token.get(token)
        if s is None:
            raise NotFoundError("no session with that token (closed, reaped, or never opened)")
        if s.uid != uid:
            raise PermissionDeniedError(f"the session belongs to another uid; uid {uid} may not use its token")
        return s

    # --- holders and reaping -------------------------------------------------

    def hold(self, s: Session, conn) -> None:
        s.holders.add(conn)
        if s.reap_timer is not None:
            s.reap_timer.cancel()
            s.reap_timer = None

    def let_go(self, s: Session, conn) -> None:
        s.holders.discard(conn)
        if not s.holders and s.token in self.by_token and s.reap_timer is None:
            loop = asyncio.get_running_loop()

            def expire() -> None:
                s.reap_timer = None
                s.reap_task = loop.create_task(self.reap(s, "grace period over"))  # referenced: not collected
            s.reap_timer = loop.call_later(self.grace_period, expire)

    async def reap(self, s: Session, why: str) -> None:
        if self.by_token.get(s.token) is not s:
            return
        if s.reap_timer is not None:
            s.reap_timer.cancel()
            s.reap_timer = None
        if not s.done:
            log.warning("session %d: no client holds it any more (%s); cancelling", s.id, why)
        await s.close(f"session reaped: {why}")
        self.by_token.pop(s.token, None)

    async def close(self, s: Session) -> None:
        await self.reap(s, "closed by client")
