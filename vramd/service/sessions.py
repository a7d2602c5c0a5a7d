"""A session: one dump, restore or verify job, addressed by a token.

A session owns the fds its clients passed (image files, BO fds: `HeldFds`) and
closes them when its job ends.  Any connection of the same uid that presents
the token is a *holder* (session_table.py reaps a session whose holders are
all gone), so the process that submits a restore and the process that waits
for it (the offload) can be different connections.

It drives its job through the `Job` interface alone (engine/jobs/interface.py);
its state moves only through its `Lifecycle` (session_state.py); the files of
an AttachFiles are taken by attach.py, the BOs of an AddBos by intake.py; what
it reports (progress, rate, the log's summary line) is session_report.py's.
"""
from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import Sequence

from ..engine.jobs.interface import BoIntake, Job
from ..errors import (
    InternalError,
    InvalidRequestError,
    JobCancelledError,
    JobError,
    LimitExceededError,
    VramdError,
    WaitTimeoutError,
    from_os_error,
)
from ..pb import rpc_pb2 as rpc
from ..protocol.fds import FdBundle
from . import intake
from .attach import attach_files
from .holders import Holders
from .metrics import Metrics
from .session_report import RateMeter, account, image_summary, session_info, summary_line
from .session_state import KIND_NAMES, Lifecycle
from .usage import HeldFds, SessionLimits, UidLimits, UidUsage

__all__ = ["Session", "SessionLimits", "UidLimits", "UidUsage"]  # (the limits: usage.py's, named here too)

log = logging.getLogger("vramd.service.sessions")


class Session:
    """One job, its token, its holders, the fds it holds, its state; requests act on it (handlers.py)."""

    def __init__(self, id: int, kind: rpc.SessionKind, uid: int, pid: int, label: str, job: Job,
                 limits: SessionLimits, metrics: Metrics, usage: UidUsage, *, fds: list[int] | None = None,
                 image_id: bytes = b"") -> None:
        """`fds`: what the session holds from its start (the manifests given at open), until its end."""
        self.id, self.kind, self.uid, self.pid, self.label = id, kind, uid, pid, label
        self.job = job
        self.limits = limits
        self.metrics = metrics
        self.usage = usage
        self.image_id = image_id  # the image written (dump) or read
        self.token = secrets.token_hex(16)
        self.life = Lifecycle(id)
        self.image: rpc.ImageSummary | None = None
        self.held = HeldFds(usage, limits.max_fds, fds)
        self.holders = Holders()  # the connections that used its token, the one that opened it, its reaping
        self.hold = 0.0  # seconds it is kept once nobody holds it, if longer than the grace period (a restore's)
        self.started = time.monotonic()
        self.ended: float | None = None
        self.bo_count = 0  # BOs taken (reserved by an AddBos under way, then added)
        self.chunks = 0    # a dump's chunks
        self.finisher: asyncio.Task[None] | None = None
        self.target_pids: set[int] = set()  # the pids of the /proc/<pid>/mem fds it was given
        self.rate_meter = RateMeter(self.started)
        self._done = asyncio.Event()
        self._adding = asyncio.Lock()  # one AddBos or AttachFiles at a time; Start waits for the one under way
        # A copy that fails while the client is still adding BOs ends the session now,
        # so progress shows the error and the fds are released without waiting for Start.
        self.job.on_fail(self._job_stopped)

    @property
    def state(self) -> rpc.SessionState:
        return self.life.state

    @property
    def error(self) -> VramdError | None:
        return self.life.error

    @property
    def fds(self) -> list[int]:
        """The fds the session holds."""
        return self.held.fds

    @property
    def kind_name(self) -> str:
        return KIND_NAMES[self.kind]

    @property
    def done(self) -> bool:
        return self._done.is_set()

    # --- requests ------------------------------------------------------------

    def needed(self) -> list[tuple[int, str]]:
        """The files the client must still attach: (image, name), image 0 the session's, k its k-th parent."""
        return self.job.files_needed()

    @property
    def ready(self) -> bool:
        """Every file of files_needed attached."""
        return self.job.ready

    def _check_ready(self) -> None:
        if not self.ready:
            missing = self.needed()
            raise InvalidRequestError(f"{len(missing)} file(s) the session needs are not attached yet (first: "
                                      f"{missing[0][1]} of image #{missing[0][0]}): AttachFiles first")

    async def attach(self, files: Sequence[rpc.FileRef], bundle: FdBundle) -> None:
        """Take the image files of one AttachFiles message (attach.py): files_needed entries, and a dump's own
        data files.  A verify begins once the last file it needs is attached."""
        async with self._adding:
            self._check_open()
            await attach_files(self.job, self.held, files, bundle, self.limits.gpu_ids, self._check_open)
            if self.ready and self.kind == rpc.SESSION_VERIFY and self.state == rpc.SESSION_OPEN:
                self.life.enter(rpc.SESSION_SEALED)
                self._end_soon()

    async def add(self, bos: Sequence[rpc.Bo], bundle: FdBundle) -> None:
        """Take the BOs of one AddBos message (and the fds they name) into the job: validate every BO (taking
        no fd, so a refused message leaves the session as it was), reserve what they take (no await from the
        checks to the counts: other sessions of the uid add too), then feed them to the job.  Both steps run on
        the event loop in short steps (intake.ADD_STEP_SECONDS): a message of many BOs never stalls others."""
        bos_in = self.job.intake(self.limits.gpu_ids)  # a verify session takes none
        async with self._adding:
            self._check_open()
            self._check_ready()
            if self.bo_count + len(bos) > self.limits.max_bos:
                raise LimitExceededError(f"more than {self.limits.max_bos} BOs in one session (max_bos_per_session)")
            taken = await intake.validate(bos, bundle, bos_in)
            self._check_open()  # still open after the steps
            self._reserve(bos_in, taken, bundle)
            try:
                await intake.feed(bos_in, self._raise_failure)
            except VramdError:
                self._end_soon()  # the job has failed: clean up now, the error stays for Wait
                raise

    def _reserve(self, bos_in: BoIntake, taken: intake.Validated, bundle: FdBundle) -> None:
        """Reserve the BOs, chunks and fds of a validated AddBos, then take its fds (no await in here)."""
        if self.chunks + bos_in.chunks > self.limits.max_chunks:
            raise LimitExceededError(
                f"the session's BOs would make more than {self.limits.max_chunks} chunks of {bos_in.chunk_size} "
                "bytes (max_chunks_per_session)")
        self.held.check(len(taken.fds))
        self.usage.reserve(bos=len(bos_in), fds=len(taken.fds))  # the uid's bounds, both at once
        # reserved from here on: the BOs count whether or not the job takes them all
        self.bo_count += len(bos_in)
        self.chunks += bos_in.chunks
        self.held.adopt([bundle.take(index) for index in taken.fds])
        bundle.close()  # the fds no BO names: not held, uncounted, while the BOs are opened
        self.target_pids.update(taken.pids)

    def _check_open(self) -> None:
        self._raise_failure()
        self.life.check_open()

    def _raise_failure(self) -> None:
        """Raise the job's first error, if it has failed already."""
        error = self.job.error
        if error is not None:
            raise error

    async def seal(self, bundle: FdBundle | None = None, manifest_fd_index: int | None = None) -> None:
        """No more BOs (after the AddBos under way, if any): the session ends when every copy has landed.
        A dump takes its manifest's file here (`manifest_fd_index` of the Start packet)."""
        async with self._adding:
            if self.state == rpc.SESSION_OPEN:
                if self.error is None and self.job.error is None:
                    self._check_ready()
                    fd = None
                    if self.job.manifest_name is not None and manifest_fd_index is not None and bundle is not None:
                        fd = self.held.keep(bundle, manifest_fd_index)
                    self.job.seal(fd)
                self.life.enter(rpc.SESSION_SEALED)
            self._end_soon()

    def cancel(self, reason: str) -> None:
        """End the session CANCELLED with `reason`, unless it has ended already: CANCELLING at once (the job
        stops: `_job_stopped`), CANCELLED once its copies have."""
        if not self.done:
            self.job.cancel(reason)
            if self.life.running:
                # every copy had landed (the job reports no more failures): it is finishing (a dump: writing
                # its manifest), and ends CANCELLED, or DONE where the cancel came too late to stop it
                self._job_stopped(JobCancelledError(reason))
            self._end_soon()

    def opened_by(self, conn: object) -> None:
        self.holders.opened_by(conn)

    def opener_gone(self, conn: object) -> bool:
        """`conn` has closed.  If it opened this dump, nobody can commit the image any more (a dump is committed
        by the client on the connection that opened it): the dump is cancelled now, not at the end of the grace
        period, and True is returned (the caller reaps it now unless another connection holds it).  A restore
        or verify goes on for its other holders (the offload: one process submits, another waits), as the
        grace period allows: False."""
        if not self.holders.opened(conn) or self.kind != rpc.SESSION_DUMP:
            return False
        if not self.done:
            log.warning("session %d: the connection that opened the dump has closed; cancelling", self.id)
            self.cancel("cancelled: the connection that opened the dump has closed (no one can commit it)")
        return True

    def _job_stopped(self, exc: BaseException) -> None:
        """The job's first error (a failed copy or AddBos, or a cancel), as it happens: a failure ends the
        session FAILED at once, with that error, so GetProgress and Wait say so from now on; a cancel makes it
        CANCELLING until its copies have stopped.  Its fds are closed once they have (`_finish`)."""
        if self.life.stop(exc):
            p = self.job.progress  # what had moved when it stopped; the summary at its end says what moved in all
            log.info("session %d: %s at %d/%d bytes: %s", self.id, rpc.SessionState.Name(self.state), p.bytes_done,
                     p.bytes_total, self.error)
        self._end_soon()

    async def wait(self, timeout: float | None) -> None:
        """The barrier: returns when the job has ended; raises WaitTimeoutError first if it takes longer."""
        if timeout is None or self._done.is_set():  # ended: even a 0 s poll answers (3.11's wait_for(.., 0) never does)
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
        error: VramdError | None = None
        try:
            self.image = image_summary(await self.job.finish())
        except VramdError as e:
            # A typed error is answered by its code and message, never logged with a traceback; dropping it
            # frees the job's frames (which hold the job, which holds the error: a cycle) by reference counting.
            error = e.with_traceback(None)
        except OSError as e:  # the daemon's own I/O (a full disk, an I/O error): not a bug, but typed
            error = from_os_error(e, f"{self.kind_name} failed", JobError)
        except Exception as e:  # a bug: still an answer for the client
            log.exception("session %d: internal error", self.id)
            error = InternalError(f"internal error: {e!r}")
        finally:
            self.life.end(error)  # FAILED already (`_job_stopped`): its first error stays
            try:
                # An AddBos or AttachFiles under way uses the session's fds in a worker thread (fd checks,
                # probes, a header read): they are closed once it is done, never under it, where their
                # numbers could already be another client's fds
                async with self._adding:
                    self.held.close()
            finally:
                self.held.close()  # nothing left, unless the wait above was cancelled (the daemon stopping)
            self.ended = time.monotonic()
            account(self.metrics, self.kind_name, self.state, self.error, self.job.progress)
            self._done.set()
            log.log(logging.INFO if self.state == rpc.SESSION_DONE else logging.WARNING, "%s", self.summary())

    # --- reporting -----------------------------------------------------------

    def summary(self) -> str:
        """One line for the log: the outcome, bytes, seconds, GB/s (decimal) and the error if any."""
        secs = (self.ended if self.ended is not None else time.monotonic()) - self.started
        who = f"session {self.id} ({self.kind_name}, uid {self.uid}, pid {self.pid})"
        return summary_line(who, self.state, self.job.progress, secs, self.label, self.error)

    def rate(self, now: float) -> float:
        """Bytes per second (session_report.RateMeter): recent while running; once ended, the average."""
        return self.rate_meter.rate(now, self.job.progress.bytes_done, self.ended)

    def info(self, *, with_token: bool = False) -> rpc.SessionInfo:
        info = session_info(self, self.job.progress, self.rate)
        info.hold_s = int(self.hold)
        if with_token:
            info.token = self.token
            info.files_needed.extend(rpc.FileRef(image=k, name=name) for k, name in self.needed())
            if per_gpu := self.job.data_files_per_gpu:
                info.data_files_per_gpu = per_gpu
        return info
