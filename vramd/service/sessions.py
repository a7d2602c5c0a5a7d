"""A session: one dump, restore or verify job, addressed by a token.

A session owns the fds its clients passed (the image directory, BO fds)
and closes them when its job ends.  Any connection of the same uid that
presents the token is a *holder* (session_table.py reaps a session whose
holders are all gone), so the process that submits a restore and the
process that waits for it (the offload) can be different connections.

Its state moves only through `_enter`, by the table `TRANSITIONS`.
"""
from __future__ import annotations

import asyncio
import logging
import os
import re
import secrets
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from ..backends import BoRef
from ..engine import BoSpec, DumpJob, Job, RestoreJob, RestoreTarget
from ..errors import (
    InternalError,
    InvalidRequestError,
    JobCancelledError,
    LimitExceededError,
    VramdError,
    WaitTimeoutError,
)
from ..pb import image_pb2 as pb
from ..pb import rpc_pb2 as rpc
from ..protocol.fds import FdBundle, close_fds
from ..protocol.wire import error_to_pb
from .metrics import Metrics

log = logging.getLogger("vramd.service.sessions")

# Which state may follow which: the one place a session's state changes (Session._enter).
TRANSITIONS: dict[rpc.SessionState, frozenset[rpc.SessionState]] = {
    rpc.SESSION_OPEN: frozenset({rpc.SESSION_SEALED, rpc.SESSION_DONE, rpc.SESSION_FAILED, rpc.SESSION_CANCELLED}),
    rpc.SESSION_SEALED: frozenset({rpc.SESSION_DONE, rpc.SESSION_FAILED, rpc.SESSION_CANCELLED}),
    rpc.SESSION_DONE: frozenset(),
    rpc.SESSION_FAILED: frozenset(),
    rpc.SESSION_CANCELLED: frozenset(),
}

_PROCMEM_LINK = re.compile(r"^/proc/\d+/mem$")
KIND_NAMES = {rpc.SESSION_DUMP: "dump", rpc.SESSION_RESTORE: "restore", rpc.SESSION_VERIFY: "verify"}


def pick_backend(fd: int) -> str:
    """The backend for an fd whose client named none: procmem for /proc/<pid>/mem, else mmap."""
    try:
        target = os.readlink(f"/proc/self/fd/{fd}")  # our own fd table, not a client-named path
    except OSError:
        return "mmap"
    return "procmem" if _PROCMEM_LINK.match(target) else "mmap"


def outcome_state(error: VramdError | None) -> rpc.SessionState:
    """The state a session ends in, from how its job ended."""
    if error is None:
        return rpc.SESSION_DONE
    return rpc.SESSION_CANCELLED if isinstance(error, JobCancelledError) else rpc.SESSION_FAILED


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
    kind: rpc.SessionKind
    uid: int
    pid: int
    label: str
    job: Job
    dir_fd: int
    limits: SessionLimits
    metrics: Metrics
    token: str = field(default_factory=lambda: secrets.token_hex(16))
    state: rpc.SessionState = rpc.SESSION_OPEN
    error: VramdError | None = None
    image: rpc.ImageSummary | None = None
    fds: list[int] = field(default_factory=list)
    holders: set[object] = field(default_factory=set)  # the connections that used its token
    started: float = field(default_factory=time.monotonic)
    ended: float | None = None
    bo_count: int = 0
    finisher: asyncio.Task[None] | None = None
    reap_timer: asyncio.TimerHandle | None = None
    reap_task: asyncio.Task[None] | None = None

    def __post_init__(self) -> None:
        self.fds.append(self.dir_fd)
        self._done = asyncio.Event()
        # A copy that fails while the client is still adding BOs ends the session now,
        # so progress shows the error and the fds are released without waiting for Start.
        self.job.on_fail(lambda exc: self._end_soon())

    @property
    def kind_name(self) -> str:
        return KIND_NAMES[self.kind]

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def _enter(self, state: rpc.SessionState) -> None:
        """The one place the state changes; a move the table does not allow is a bug."""
        if state != self.state and state not in TRANSITIONS[self.state]:
            raise InternalError(f"session {self.id}: no transition {rpc.SessionState.Name(self.state)} -> "
                                f"{rpc.SessionState.Name(state)}")
        self.state = state

    # --- requests ------------------------------------------------------------

    async def add(self, bos: Sequence[rpc.Bo], bundle: FdBundle) -> None:
        """Take the BOs of one AddBos message (and the fds they name) into the job."""
        job = self.job
        if not isinstance(job, (DumpJob, RestoreJob)):
            raise InvalidRequestError("a verify session takes no BOs")
        self._raise_failure()
        if self.state != rpc.SESSION_OPEN:
            if self.error is not None:
                raise self.error
            raise InvalidRequestError(
                f"the session is {rpc.SessionState.Name(self.state)} and takes no more BOs")
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
        refs = [BoRef(bo.backend or kinds[bo.fd_index], fds[bo.fd_index], bo.offset) for bo in bos]
        if len(fds) > 1:  # fds of many BOs: check them in a worker thread, off the event loop
            distinct = {ref.fd: (bo.id, ref) for bo, ref in zip(bos, refs)}
            await asyncio.get_running_loop().run_in_executor(job.ctx.io, job.precheck, distinct.values())
        try:
            self._raise_failure()  # failed while we were checking
            if isinstance(job, DumpJob):
                job.add([self._spec(bo, ref) for bo, ref in zip(bos, refs)])
            else:
                job.add([self._target(bo, ref) for bo, ref in zip(bos, refs)])
        except VramdError as e:
            self._end_soon()  # the job has failed: clean up now, the error stays for Wait
            raise e
        self.bo_count += len(bos)

    def _raise_failure(self) -> None:
        """Raise the job's first error, if it has failed already."""
        error = self.job.error
        if error is not None:
            raise error

    @staticmethod
    def _spec(bo: rpc.Bo, ref: BoRef) -> BoSpec:
        return BoSpec(bo.id, bo.size, ref, gpu_id=bo.gpu_id if bo.HasField("gpu_id") else 0,
                      alloc_flags=bo.alloc_flags, va_addr=bo.va_addr, name=bo.name)

    @staticmethod
    def _target(bo: rpc.Bo, ref: BoRef) -> RestoreTarget:
        return RestoreTarget(bo.id, ref, gpu_id=bo.gpu_id if bo.HasField("gpu_id") else None)

    def seal(self) -> None:
        if self.state == rpc.SESSION_OPEN:
            self._enter(rpc.SESSION_SEALED)
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
        except TimeoutError:
            raise WaitTimeoutError(f"session {self.id} still running after {timeout:g} s") from None

    async def close(self, reason: str = "session closed") -> None:
        self.cancel(reason)
        self._end_soon()
        assert self.finisher is not None  # _end_soon made it
        await asyncio.shield(self.finisher)

    # --- the end -------------------------------------------------------------

    def _end_soon(self) -> None:
        if self.finisher is None:
            self.finisher = asyncio.get_running_loop().create_task(self._finish(), name=f"vramd-session-{self.id}")

    async def _finish(self) -> None:
        try:
            self.image = image_summary(await self.job.finish())
        except VramdError as e:
            self.error = e
        except Exception as e:  # a bug: still an answer for the client
            log.exception("session %d: internal error", self.id)
            self.error = InternalError(f"internal error: {e!r}")
        finally:
            self._enter(outcome_state(self.error))
            self._close_fds()
            self.ended = time.monotonic()
            self._account()
            self._done.set()
            log.info("session %d (%s, uid %d): %s%s", self.id, self.kind_name, self.uid,
                     rpc.SessionState.Name(self.state),
                     f": {self.error}" if self.error else "")

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
