"""A session: one dump, restore or verify job, addressed by a token.

A session owns the fds its clients passed (image files, BO fds) and closes
them when its job ends.  Any connection of the same uid that
presents the token is a *holder* (session_table.py reaps a session whose
holders are all gone), so the process that submits a restore and the
process that waits for it (the offload) can be different connections.

Its state moves only through `_enter`, by the table `TRANSITIONS`.
"""
from __future__ import annotations

import asyncio
import logging
import secrets
import time
import weakref
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from ..backends import BackendKind, BoRef
from ..engine import Ahead, BoSpec, DumpJob, Job, RestoreJob, RestoreTarget, VerifyJob
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
from ..image.codec import compression_name
from ..image.fileio import check_attached, check_direct
from ..image.names import data_file_name, manifest_tmp_name
from ..image.reader import ImageReader
from ..image.writer import DataFileWriter
from ..pb import image_pb2 as pb
from ..pb import rpc_pb2 as rpc
from ..protocol.fds import FdBundle, close_fds
from ..protocol.wire import error_to_pb
from .metrics import Metrics

log = logging.getLogger("vramd.service.sessions")

# Which state may follow which: the one place a session's state changes (Session._enter).
# CANCELLING: the job was cancelled and its copies are stopping; the end state follows once they have.
TRANSITIONS: dict[rpc.SessionState, frozenset[rpc.SessionState]] = {
    rpc.SESSION_OPEN: frozenset({rpc.SESSION_SEALED, rpc.SESSION_DONE, rpc.SESSION_FAILED, rpc.SESSION_CANCELLED,
                                 rpc.SESSION_CANCELLING}),
    rpc.SESSION_SEALED: frozenset({rpc.SESSION_DONE, rpc.SESSION_FAILED, rpc.SESSION_CANCELLED,
                                   rpc.SESSION_CANCELLING}),
    rpc.SESSION_CANCELLING: frozenset({rpc.SESSION_CANCELLED, rpc.SESSION_FAILED, rpc.SESSION_DONE}),
    rpc.SESSION_DONE: frozenset(),
    rpc.SESSION_FAILED: frozenset(),
    rpc.SESSION_CANCELLED: frozenset(),
}

RATE_WINDOW = 5.0  # seconds: a running session's rate is measured over looks at most this far back
KIND_NAMES = {rpc.SESSION_DUMP: "dump", rpc.SESSION_RESTORE: "restore", rpc.SESSION_VERIFY: "verify"}


ENDED = frozenset({rpc.SESSION_DONE, rpc.SESSION_FAILED, rpc.SESSION_CANCELLED})  # no way out of these


def outcome_state(error: VramdError | None) -> rpc.SessionState:
    """The state a session ends in, from how its job ended."""
    if error is None:
        return rpc.SESSION_DONE
    return rpc.SESSION_CANCELLED if isinstance(error, JobCancelledError) else rpc.SESSION_FAILED


def image_summary(m: pb.Manifest) -> rpc.ImageSummary:
    comp = compression_name(m.compression)
    return rpc.ImageSummary(bo_count=m.totals.bo_count, bo_bytes=m.totals.bo_bytes,
                            stored_bytes=m.totals.stored_bytes, zero_bytes=m.totals.zero_bytes,
                            chunk_size=m.chunk_size, compression=comp, data_files=len(m.files))


def dump_fds(stripes: int) -> int:
    """The fds the smallest dump holds at once (one GPU, one BO): its GPU's `stripes` data files, the BO's fd,
    and the manifest's file given at Start.  Limits below this make every dump fail LIMIT_EXCEEDED (the
    configuration check refuses them).  Where the image's file system has O_DIRECT each data file also comes
    with its O_DIRECT twin: `stripes` more."""
    return stripes + 2


@dataclass(frozen=True)
class SessionLimits:
    max_bos: int
    max_fds: int
    max_chunks: int = 1 << 20                                  # a dump's sum of ceil(size / chunk_size)
    gpu_ids: frozenset[int] = field(default_factory=lambda: frozenset({0}))  # the gpu_ids a BO may name


@dataclass(frozen=True)
class UidLimits:
    max_bos: int  # BOs held by one uid's sessions, ended but unclosed ones included
    max_fds: int  # fds held by one uid's sessions


@dataclass
class UidUsage:
    """What one uid's sessions hold (kept by the session table, updated by the sessions), and the fds on its
    requests received and not yet handled (`queued`, reserved by the connection that read them) or being
    handled (`handling`: until the handler is done; what a session takes from them is counted in `fds` too
    meanwhile, so a new request is refused early rather than late)."""

    limits: UidLimits
    bos: int = 0
    fds: int = 0
    queued: int = 0
    handling: int = 0


# Per-BO work of an AddBos runs on the event loop in steps of at most this long, so
# that one big message never holds the loop (and every other client) for long.
ADD_STEP_SECONDS = 0.002
_CHECK_EVERY = 32  # BOs between looks at the clock


class _Stepper:
    """Yield to the event loop whenever ADD_STEP_SECONDS have passed since the last yield.

    Callers work in slices of _CHECK_EVERY BOs and call `tick` between slices,
    so the clock is read once per slice, not once per BO.
    """

    def __init__(self) -> None:
        self.since = time.perf_counter()

    async def tick(self) -> None:
        if time.perf_counter() - self.since > ADD_STEP_SECONDS:
            await asyncio.sleep(0)
            self.since = time.perf_counter()


@dataclass(eq=False)
class Session:
    id: int
    kind: rpc.SessionKind
    uid: int
    pid: int
    label: str
    job: Job
    limits: SessionLimits
    metrics: Metrics
    usage: UidUsage
    image_id: bytes = b""  # the image written (dump) or read
    token: str = field(default_factory=lambda: secrets.token_hex(16))
    state: rpc.SessionState = rpc.SESSION_OPEN
    error: VramdError | None = None
    image: rpc.ImageSummary | None = None
    fds: list[int] = field(default_factory=list)
    holders: set[object] = field(default_factory=set)  # the connections that used its token
    # the connection that opened it (a dump is committed there, and only there); weak: no cycle through its
    # `sessions`, which the daemon's garbage collection policy would leave to full collections
    opener: weakref.ref[object] | None = None
    started: float = field(default_factory=time.monotonic)
    ended: float | None = None
    bo_count: int = 0  # BOs taken (reserved by an AddBos under way, then added)
    chunks: int = 0    # a dump's chunks
    finisher: asyncio.Task[None] | None = None
    reap_timer: asyncio.TimerHandle | None = None
    reap_task: asyncio.Task[None] | None = None
    target_pids: set[int] = field(default_factory=set)  # the pids of the /proc/<pid>/mem fds it was given
    rate_samples: deque[tuple[float, int]] = field(default_factory=deque)  # (when, bytes_done) of recent looks

    def __post_init__(self) -> None:
        self.usage.fds += len(self.fds)  # the manifests given at open, held until the end
        self._done = asyncio.Event()
        self._adding = asyncio.Lock()  # one AddBos at a time; Start waits for the one under way
        # A copy that fails while the client is still adding BOs ends the session now,
        # so progress shows the error and the fds are released without waiting for Start.
        self.job.on_fail(self._job_stopped)

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

    def _reader(self) -> ImageReader | None:
        """The image whose data files the client attaches: a restore's or verify's, a dump's parent."""
        job = self.job
        if isinstance(job, DumpJob):
            return job.parent
        return job.reader if isinstance(job, (RestoreJob, VerifyJob)) else None

    def needed(self) -> list[tuple[int, str]]:
        """The files the client must still attach: (image, name), image 0 the session's, k its k-th parent."""
        reader = self._reader()
        if reader is None:
            return []
        shift = 1 if isinstance(self.job, DumpJob) else 0  # a dump's parent reader: its image 0 is parent #1
        return [(k + shift, name) for k, name in reader.needed()]

    @property
    def ready(self) -> bool:
        """Every file of files_needed attached."""
        reader = self._reader()
        return reader is None or reader.ready

    def _check_ready(self) -> None:
        if not self.ready:
            missing = self.needed()
            raise InvalidRequestError(f"{len(missing)} file(s) the session needs are not attached yet (first: "
                                      f"{missing[0][1]} of image #{missing[0][0]}): AttachFiles first")

    def _keep(self, bundle: FdBundle, index: int) -> int:
        """The fd at `index` of the packet, held by the session (closed when it ends, counted for its uid)."""
        if len(self.fds) + 1 > self.limits.max_fds:
            raise LimitExceededError(f"more than {self.limits.max_fds} fds in one session (max_fds_per_session)")
        if self.usage.fds + self.usage.queued + 1 > self.usage.limits.max_fds:
            raise LimitExceededError(f"uid {self.uid}'s sessions would hold more than "
                                     f"{self.usage.limits.max_fds} fds (max_fds_per_uid)")
        fd = bundle.take(index)
        self.fds.append(fd)
        self.usage.fds += 1
        return fd

    def _unkeep(self, fds: list[int]) -> list[int]:
        """`fds`, held by the session, no longer held nor counted (the caller closes them)."""
        for fd in fds:
            self.fds.remove(fd)
            self.usage.fds -= 1
        return fds

    async def attach(self, files: Sequence[rpc.FileRef], bundle: FdBundle) -> None:
        """Take the image files of one AttachFiles message: files_needed entries, and a dump's data files.
        Each is checked as it comes (fileio.check_attached; a read image's header and length in a thread);
        the first bad one is the reply's error.  The files_needed entries before it stay attached; a dump's
        own data files of the message do not (the clients remove the files of a refused message, so the
        manifest must not list one of them; the GPU's files can then be attached again).  Those are written
        into only once the whole message is taken (`ImageWriter.publish`)."""
        async with self._adding:
            self._check_open()
            job = self.job
            dump = job if isinstance(job, DumpJob) else None
            own: list[tuple[DataFileWriter, list[int]]] = []  # a dump's own data files this message attached
            try:
                for f in files:
                    if dump is not None and f.HasField("gpu_id"):
                        own.append(self._take_data_file(dump, f, bundle))
                    else:
                        await self._attach_needed(job, f, *self._keep_file(bundle, f))
            except BaseException:
                if dump is not None and own:
                    dump.writer.detach([w for w, _ in own])
                    for w, fds in own:  # closed in the file's writer thread, after its header write (the
                        # session's end waits for this message before it closes the fds it holds: _finish)
                        w.abandon(self._unkeep(fds))
                raise
            if dump is not None and own:
                dump.writer.publish([w for w, _ in own])
            if self.ready and self.kind == rpc.SESSION_VERIFY and self.state == rpc.SESSION_OPEN:
                self._enter(rpc.SESSION_SEALED)
                self._end_soon()

    def _keep_file(self, bundle: FdBundle, f: rpc.FileRef) -> tuple[int, int | None]:
        """The file's fd and its O_DIRECT twin's (if given), held by the session (`_keep`)."""
        fd = self._keep(bundle, f.fd_index)
        return fd, self._keep(bundle, f.direct_fd_index) if f.HasField("direct_fd_index") else None

    def _take_data_file(self, job: DumpJob, f: rpc.FileRef, bundle: FdBundle) -> tuple[DataFileWriter, list[int]]:
        """A dump's own data file, attached (`_attach_data_file`), with the fds the session holds for it; a
        refused one holds none."""
        mark = len(self.fds)
        try:
            return self._attach_data_file(job, f, *self._keep_file(bundle, f)), self.fds[mark:]
        except BaseException:
            close_fds(self._unkeep(self.fds[mark:]))
            raise

    async def _attach_needed(self, job: Job, f: rpc.FileRef, fd: int, direct: int | None) -> None:
        """A file of files_needed: of the image a restore or verify reads, or of a parent."""
        reader = self._reader()
        if reader is None:
            raise InvalidRequestError(f"{f.name!r} is not a file this session needs (a dump without a "
                                      "parent needs only its own data files, each with its gpu_id)")
        shift = 1 if isinstance(job, DumpJob) else 0
        if f.image < shift:
            raise InvalidRequestError(f"{f.name!r}: a dump's own data file names its gpu_id")
        await reader.attach(f.image - shift, f.name, fd, direct)
        self._check_open()  # still open after the check in a thread

    def _attach_data_file(self, job: DumpJob, f: rpc.FileRef, fd: int, direct: int | None) -> DataFileWriter:
        """A dump's data file for one GPU (one of its data_files_per_gpu: `stripe`): created by the client under
        the name the image id gives it.  Attached, not yet written into (`ImageWriter.publish`)."""
        gpu, stripe = f.gpu_id, f.stripe
        if gpu not in self.limits.gpu_ids:
            known = ", ".join(f"{g:#x}" for g in sorted(self.limits.gpu_ids))
            raise InvalidRequestError(f"gpu_id {gpu:#x} is not a GPU of this daemon (known: {known})")
        job.writer.check_stripe(gpu, stripe)
        want = data_file_name(self.image_id, gpu, stripe)
        if f.image != 0 or f.name != want:
            what = f"data file {stripe} of gpu_id {gpu:#x}" if stripe else f"data file of gpu_id {gpu:#x}"
            raise InvalidRequestError(f"the {what} must be {want} (the client creates it as {want}.tmp); got "
                                      f"{f.name!r} of image #{f.image}")
        check_attached(fd, want + ".tmp", write=True)
        if direct is not None:
            check_direct(direct, fd, want + ".tmp", write=True)
        return job.writer.attach(gpu, fd, direct, stripe, publish=False)

    async def add(self, bos: Sequence[rpc.Bo], bundle: FdBundle) -> None:
        """Take the BOs of one AddBos message (and the fds they name) into the job.

        Every BO is checked before any fd is taken, so a refused message leaves
        the session as it was.  The per-BO work runs in short steps (see
        ADD_STEP_SECONDS): a message of many BOs never stalls other clients.
        """
        job = self.job
        if not isinstance(job, (DumpJob, RestoreJob)):
            raise InvalidRequestError("a verify session takes no BOs")
        async with self._adding:
            self._check_open()
            self._check_ready()
            n = len(bos)
            if self.bo_count + n > self.limits.max_bos:
                raise LimitExceededError(f"more than {self.limits.max_bos} BOs in one session (max_bos_per_session)")
            step = _Stepper()
            fds: dict[int, int] = {}
            kinds: dict[int, BackendKind] = {}  # a BO naming no backend: its fd picks one, looked at once
            pids: set[int] = set()
            chunks = 0
            chunk_size = job.chunk_size if isinstance(job, DumpJob) else 0
            gpu_ids = self.limits.gpu_ids
            default_gpu = 0 in gpu_ids and isinstance(job, DumpJob)  # a dump BO naming no gpu_id is on GPU 0
            files = job.writer.files if isinstance(job, DumpJob) else {}
            make = self._spec if isinstance(job, DumpJob) else self._target
            items: list[BoSpec | RestoreTarget] = []  # what the job takes: specs (dump) or targets (restore)
            for i in range(0, n, _CHECK_EVERY):  # check every BO (and make its spec) before taking any fd
                if i:
                    await step.tick()
                for bo in bos[i:i + _CHECK_EVERY]:
                    index = bo.fd_index
                    fd = fds.get(index)
                    if fd is None:
                        fd = fds[index] = bundle.peek(index)
                        kinds[index], pid = BackendKind.for_fd(fd)
                        if pid is not None:
                            pids.add(pid)
                    if not (default_gpu and not bo.HasField("gpu_id")):
                        self._check_gpu(job, bo)
                    if chunk_size:
                        size = bo.size
                        if size:
                            if (bo.gpu_id, 0) not in files:  # its first data file (stripe 0)
                                raise InvalidRequestError(f"no data file is attached for gpu_id {bo.gpu_id:#x} "
                                                          "(AttachFiles it before its first BO)", bo_id=bo.id)
                            chunks += -(-size // chunk_size)
                    kind = BackendKind.parse(bo.backend) if bo.backend else kinds[index]
                    items.append(make(bo, BoRef(kind, fd, bo.offset)))
            self._check_open()  # still open after the steps
            # the per-uid checks here, with no await before the reservation: other sessions of the uid add too
            if self.usage.bos + n > self.usage.limits.max_bos:
                raise LimitExceededError(f"uid {self.uid}'s sessions would hold more than {self.usage.limits.max_bos}"
                                         " BOs (max_bos_per_uid)")
            if self.chunks + chunks > self.limits.max_chunks:
                raise LimitExceededError(
                    f"the session's BOs would make more than {self.limits.max_chunks} chunks of {chunk_size} bytes "
                    "(max_chunks_per_session)")
            if len(self.fds) + len(fds) > self.limits.max_fds:
                raise LimitExceededError(f"more than {self.limits.max_fds} fds in one session (max_fds_per_session)")
            if self.usage.fds + self.usage.queued + len(fds) > self.usage.limits.max_fds:
                raise LimitExceededError(f"uid {self.uid}'s sessions would hold more than "
                                         f"{self.usage.limits.max_fds} fds (max_fds_per_uid)")
            # reserved from here on: the BOs count whether or not the job takes them all
            self.bo_count += n
            self.usage.bos += n
            self.chunks += chunks
            for index in fds:
                self.fds.append(bundle.take(index))
            bundle.close()  # the fds no BO names: not held, uncounted, while the BOs are opened
            self.usage.fds += len(fds)
            self.target_pids.update(pids)

            def prepare() -> Ahead:
                """In a worker thread: check the fds of many BOs, open the BOs the job can open there."""
                if len(fds) > 1:
                    job.precheck({item.ref.fd: (item[0], item.ref) for item in items}.values())
                return job.open_ahead(items)
            # the syscalls of opening (procmem probes, fd checks) happen off the event loop
            ahead = await asyncio.get_running_loop().run_in_executor(job.ctx.io, prepare)
            try:
                self._raise_failure()  # failed while we were checking
                i, since = 0, time.perf_counter()
                while i < n:  # the job takes them a few at a time, yielding between steps
                    j = min(n, i + _CHECK_EVERY)
                    job.add(items[i:j], ahead)  # type: ignore[arg-type]  # specs for a dump, targets for a restore
                    i = j
                    if i < n and time.perf_counter() - since > ADD_STEP_SECONDS:
                        await asyncio.sleep(0)
                        since = time.perf_counter()
                        self._raise_failure()  # failed (or cancelled) meanwhile
            except VramdError as e:
                self._end_soon()  # the job has failed: clean up now, the error stays for Wait
                raise e
            finally:
                job.drop_ahead(ahead)  # what the job did not take

    def _check_open(self) -> None:
        self._raise_failure()
        if self.state != rpc.SESSION_OPEN:
            if self.error is not None:
                raise self.error
            raise InvalidRequestError(
                f"the session is {rpc.SessionState.Name(self.state)} and takes no more BOs")

    def _check_gpu(self, job: DumpJob | RestoreJob, bo: rpc.Bo) -> None:
        """A BO may only name a GPU the daemon knows: each gpu_id gets its own pools and lanes."""
        if bo.HasField("gpu_id"):
            gpu = bo.gpu_id
        elif isinstance(job, DumpJob):
            gpu = 0
        else:  # a restore target runs where the image's BO goes: its gpu_id, mapped onto this machine's GPUs
            entry = job.reader.bos.get(bo.id)
            if entry is None:
                return  # the job reports the BO the image lacks
            gpu = job.gpu_map.get(entry.gpu_id, entry.gpu_id)
        if gpu not in self.limits.gpu_ids:
            known = ", ".join(f"{g:#x}" for g in sorted(self.limits.gpu_ids))
            raise InvalidRequestError(f"gpu_id {gpu:#x} is not a GPU of this daemon (known: {known})", bo_id=bo.id)

    def _raise_failure(self) -> None:
        """Raise the job's first error, if it has failed already."""
        error = self.job.error
        if error is not None:
            raise error

    @staticmethod
    def _spec(bo: rpc.Bo, ref: BoRef) -> BoSpec:
        # an unset gpu_id reads as 0, the default GPU of a dump (positional: this runs once per BO)
        return BoSpec(bo.id, bo.size, ref, bo.gpu_id, bo.alloc_flags, bo.va_addr, bo.name)

    @staticmethod
    def _target(bo: rpc.Bo, ref: BoRef) -> RestoreTarget:
        return RestoreTarget(bo.id, ref, gpu_id=bo.gpu_id if bo.HasField("gpu_id") else None)

    async def seal(self, bundle: FdBundle | None = None, manifest_fd_index: int | None = None) -> None:
        """No more BOs (after the AddBos under way, if any): the session ends when every copy has landed.
        A dump takes its manifest's file here (`manifest_fd_index` of the Start packet)."""
        async with self._adding:
            if self.state == rpc.SESSION_OPEN:
                if self.error is None and self.job.error is None:
                    self._check_ready()
                    if isinstance(self.job, DumpJob):
                        if manifest_fd_index is None or bundle is None:
                            raise InvalidRequestError("a dump's Start names the manifest's file (manifest_fd_index: "
                                                      f"{manifest_tmp_name(self.image_id)}, created by the "
                                                      "client)")
                        fd = self._keep(bundle, manifest_fd_index)
                        check_attached(fd, manifest_tmp_name(self.image_id), write=True)
                        self.job.writer.manifest_fd = fd
                self._enter(rpc.SESSION_SEALED)
            self._end_soon()

    def cancel(self, reason: str) -> None:
        """End the session CANCELLED with `reason`, unless it has ended already: CANCELLING at once (the job
        stops: `_job_stopped`), CANCELLED once its copies have."""
        if not self.done:
            self.job.cancel(reason)
            if self.state in (rpc.SESSION_OPEN, rpc.SESSION_SEALED):
                # every copy had landed (the job reports no more failures): it is finishing (a dump: writing
                # its manifest), and ends CANCELLED, or DONE where the cancel came too late to stop it
                self._job_stopped(JobCancelledError(reason))
            self._end_soon()

    def opened_by(self, conn: object) -> None:
        self.opener = weakref.ref(conn)

    def opener_gone(self, conn: object) -> bool:
        """`conn` has closed.  If it opened this dump, nobody can commit the image any more (a dump is committed
        by the client on the connection that opened it): the dump is cancelled now, not at the end of the grace
        period, and True is returned (the caller reaps it now unless another connection holds it).  A restore
        or verify goes on for its other holders (the offload: one process submits, another waits), as the
        grace period allows: False."""
        if self.opener is None or self.opener() is not conn or self.kind != rpc.SESSION_DUMP:
            return False
        if not self.done:
            log.warning("session %d: the connection that opened the dump has closed; cancelling", self.id)
            self.cancel("cancelled: the connection that opened the dump has closed (no one can commit it)")
        return True

    def _job_stopped(self, exc: BaseException) -> None:
        """The job's first error (a failed copy or AddBos, or a cancel), as it happens: a failure ends the
        session FAILED at once, with that error, so GetProgress and Wait say so from now on; a cancel makes it
        CANCELLING until its copies have stopped.  Its fds are closed once they have (`_finish`)."""
        if self.state in (rpc.SESSION_OPEN, rpc.SESSION_SEALED):
            error = exc if isinstance(exc, VramdError) else InternalError(f"internal error: {exc!r}")
            self.error = error
            self._enter(rpc.SESSION_CANCELLING if isinstance(error, JobCancelledError) else rpc.SESSION_FAILED)
            p = self.job.progress  # what had moved when it stopped; the summary at its end says what moved in all
            log.info("session %d: %s at %d/%d bytes: %s", self.id, rpc.SessionState.Name(self.state), p.bytes_done,
                     p.bytes_total, error)
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
            if self.state not in ENDED:  # FAILED already (`_job_stopped`): its first error stays
                self.error = error
                self._enter(outcome_state(error))
            elif self.error is not None:
                self.error = self.error.with_traceback(None)
            try:
                # An AddBos or AttachFiles under way uses the session's fds in a worker thread (fd checks,
                # probes, a header read): they are closed once it is done, never under it, where their
                # numbers could already be another client's fds
                async with self._adding:
                    self._close_fds()
            finally:
                self._close_fds()  # nothing left, unless the wait above was cancelled (the daemon stopping)
            self.ended = time.monotonic()
            self._account()
            self._done.set()
            log.log(logging.INFO if self.state == rpc.SESSION_DONE else logging.WARNING, "%s", self.summary())

    def summary(self) -> str:
        """One line for the log: the outcome, bytes, seconds, GB/s (decimal) and the error if any."""
        p = self.job.progress
        secs = (self.ended if self.ended is not None else time.monotonic()) - self.started
        rate = p.bytes_done / secs / 1e9 if secs > 0 else 0.0
        label = f" [{self.label}]" if self.label else ""
        line = (f"session {self.id} ({self.kind_name}, uid {self.uid}, pid {self.pid}): "
                f"{rpc.SessionState.Name(self.state)}: "
                f"{p.bos_done}/{p.bos_total} BOs, {p.bytes_done}/{p.bytes_total} bytes in {secs:.3f} s, "
                f"{rate:.3f} GB/s{label}")
        return f"{line}: {self.error.code}: {self.error}" if self.error is not None else line

    def _close_fds(self) -> None:
        fds, self.fds = self.fds, []
        self.usage.fds -= len(fds)
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
            m.count_error(self.error, self.error.code)  # not again if a reply (a failed AddBos) counted it

    # --- reporting -----------------------------------------------------------

    def rate(self, now: float) -> float:
        """Bytes per second: while running, since the oldest look of the last RATE_WINDOW seconds (this look
        is remembered; with no earlier one, since the session opened); once ended, the session's average."""
        done = self.job.progress.bytes_done
        if self.ended is not None:
            secs = self.ended - self.started
            return done / secs if secs > 0 else 0.0
        samples = self.rate_samples
        while samples and now - samples[0][0] > RATE_WINDOW:
            samples.popleft()
        since, then = samples[0] if samples else (self.started, 0)
        if not samples or now - samples[-1][0] >= RATE_WINDOW / 20:  # a bounded number of looks kept
            samples.append((now, done))
        return (done - then) / (now - since) if now > since else 0.0

    def info(self, *, with_token: bool = False) -> rpc.SessionInfo:
        p = self.job.progress
        now = time.monotonic()
        end = self.ended if self.ended is not None else now
        info = rpc.SessionInfo(
            session_id=self.id, kind=self.kind, state=self.state, uid=self.uid, pid=self.pid, label=self.label,
            holders=len(self.holders), target_pids=sorted(self.target_pids), rate_bytes_per_s=self.rate(now),
            age_s=now - self.started,
            progress=rpc.Progress(bos_total=p.bos_total, bos_done=p.bos_done, bytes_total=p.bytes_total,
                                  bytes_done=p.bytes_done, chunks_done=p.chunks_done, elapsed_s=end - self.started))
        info.image_id = self.image_id
        if with_token:
            info.token = self.token
            info.files_needed.extend(rpc.FileRef(image=k, name=name) for k, name in self.needed())
            if isinstance(self.job, DumpJob):
                info.data_files_per_gpu = self.job.writer.stripes
        if self.error is not None:
            info.error.CopyFrom(error_to_pb(self.error))
        if self.image is not None:
            info.image.CopyFrom(self.image)
        return info
