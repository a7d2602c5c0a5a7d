"""What dump, restore and verify jobs share: the BO descriptions callers give, the job base, batch submission.

A job is created, given BOs (all at once or in batches, as an RPC session
receives them), then finished: `finish()` is the barrier that waits for
every chunk and, for a dump, writes the manifest and fsyncs the image's files
(the client then commits them, vramd.inproc's client side included).  A
job that fails or is cancelled is never committed, and whoever created its
files removes them.
"""
from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Generic, NamedTuple, TypeVar

from ...backends import Backend, BoHandle, BoRef, CopyItem, CpuCopier, Direction, FdMemo, OpenItem, land_all
from ...errors import BackendUnavailableError, InvalidRequestError, LimitExceededError, VramdError
from ...hostmem.batchcopy import Outcome
from ...hostmem.staging import StagingPool
from ...image.writer import DataFileWriter
from ..pipeline import ChunkTask, Ends, Pipeline, Progress, ProgressCallback, StageTimes
from ..stages import FilledT, ProductT


class BoSpec(NamedTuple):
    """A BO to dump: its identity, size, and where its bytes are read."""

    id: int
    size: int
    ref: BoRef
    gpu_id: int = 0
    alloc_flags: int = 0
    va_addr: int = 0
    name: str = ""


class RestoreTarget(NamedTuple):
    """Where a BO of the image goes back to."""

    bo_id: int
    ref: BoRef
    gpu_id: int | None = None  # pool to run in; default: the BO's gpu_id in the image


BoItem = BoSpec | RestoreTarget  # what a job takes per BO: a dump's specs, a restore's targets
ItemT = TypeVar("ItemT", BoSpec, RestoreTarget)


@dataclass(eq=False)
class CopiedBo:
    """The part of a job's per-BO record that dump and restore share: a BO reached through a backend."""

    id: int
    gpu_id: int
    size: int
    backend: Backend | None
    handle: BoHandle | None
    chunks_left: int = 0
    copier: CpuCopier | None = field(init=False, default=None)  # the backend's CPU copies, if it has them

    def __post_init__(self) -> None:
        self.copier = self.backend.cpu_copier() if self.backend is not None else None

    def release(self) -> None:
        """The BO's last chunk has landed (or the job ended): let the backend drop it."""
        if self.handle is not None and self.backend is not None:
            self.backend.release(self.handle)
            self.handle = None


def submit_batch(copies: Sequence[tuple[Backend, CopyItem]]) -> asyncio.Future[None]:
    """A batch's backend copies: one `submit_many` per backend; one future, done when all have landed.

    A batch's pieces share a GPU lane but may reach their BOs through
    different backends (procmem and mmap BOs of one GPU in one job).
    """
    groups: dict[Backend, list[CopyItem]] = {}
    for backend, item in copies:
        groups.setdefault(backend, []).append(item)
    if len(groups) == 1:
        (backend, items), = groups.items()
        return backend.submit_many(items)
    futs = []
    try:
        for backend, items in groups.items():
            futs.append(backend.submit_many(items))
    except BaseException as e:  # let what was started land before reporting
        return land_all(futs, error=e)
    return land_all(futs)


class Ahead(dict[int, tuple[Backend, OpenItem, BoHandle, BoItem]]):
    """BOs opened ahead in a worker thread (JobBase.open_ahead): bo_id -> (backend, what was opened, handle,
    the spec or target it was opened for).  `failed`: the BO whose open failed there, and its error: `add`
    raises it when it reaches that BO, without opening it again on the event loop (a failing procmem probe
    reads up to the whole BO to find where its hole starts)."""

    failed: tuple[int, VramdError] | None = None

OFF_T_MAX = (1 << 63) - 1  # the largest file offset (off_t) a syscall takes
DEFAULT_MAX_BO_BYTES = 1 << 40


BoT = TypeVar("BoT", bound=CopiedBo)


def landed(tasks: Sequence[ChunkTask[BoT]], outcomes: Sequence[Outcome], failed: int) -> None:
    """After one `copy_batch` over `tasks`: tell each BO's CPU copier which pieces landed, then raise the
    first failure as its backend's typed error, naming the BO and the offset where it stopped."""
    for t in tasks[:failed if failed >= 0 else len(tasks)]:
        assert t.bo.copier is not None and t.bo.handle is not None  # set by add(), dropped only when done
        t.bo.copier.after_copy(t.bo.handle, t.offset, t.length)
    if failed >= 0:
        t, o = tasks[failed], outcomes[failed]
        assert t.bo.copier is not None and t.bo.handle is not None
        raise t.bo.copier.copy_error(t.bo.handle, t.offset + o.done, o.err)


@dataclass
class JobContext:
    """What jobs share from the engine."""

    pool: StagingPool
    backends: dict[str, Backend]
    cpu: Executor
    io: Executor
    workers_per_gpu: int  # batches in flight per GPU (EngineConfig.inflight_per_gpu)
    copier: Executor | None = None  # the copy threads that run whole batches (None: the three stages only)
    times: StageTimes | None = None
    max_bo_bytes: int = DEFAULT_MAX_BO_BYTES  # the largest BO a job takes (a declared size, before any byte moves)
    compress_workers: int = 1  # threads that compress at once (auto mode weighs CPU against the sink with it)
    dump_workers_per_gpu: int = 0  # a dump's (EngineConfig.dump_inflight_per_gpu); 0: workers_per_gpu
    device_workers_per_gpu: int = 0  # added once a lane's reads wait on a device (EngineConfig.device_inflight_per_gpu)


def check_bo_range(bo_id: int, size: int, ref: BoRef, max_bo_bytes: int) -> None:
    """A BO's declared size and offset, checked before anything is allocated or opened for it.

    The size is bounded by the engine's limit (LIMIT_EXCEEDED); the offset and the
    end must fit a signed 64-bit off_t, which every backend's syscalls take
    (pread on /proc/<pid>/mem, mmap offsets, dmabuf offsets): INVALID_REQUEST.
    """
    if size < 0:
        raise InvalidRequestError("negative BO size", bo_id=bo_id)
    if size > max_bo_bytes:
        raise LimitExceededError(f"BO of {size} bytes is larger than this daemon's limit of {max_bo_bytes} bytes "
                                 "(max_bo_bytes)", bo_id=bo_id)
    if ref.offset < 0 or ref.offset + size > OFF_T_MAX:
        raise InvalidRequestError(f"BO range at {ref.kind} offset {ref.offset:#x} of {size} bytes does not fit a "
                                  "64-bit file offset", bo_id=bo_id)


def check_gpu(gpu: int, gpu_ids: frozenset[int], bo_id: int | None = None) -> None:
    """A BO or a data file may only name a GPU the daemon knows (`gpu_ids`): each gpu_id gets its own pools and
    lanes."""
    if gpu not in gpu_ids:
        known = ", ".join(f"{g:#x}" for g in sorted(gpu_ids))
        raise InvalidRequestError(f"gpu_id {gpu:#x} is not a GPU of this daemon (known: {known})", bo_id=bo_id)


class JobBase(Generic[BoT, ItemT]):
    """The machinery every job has: its pipeline, the backends it may use, the fds it checked; and what a
    session sees of a job that needs no file and takes no data file of its own (interface.Job: the jobs
    override what they do differently)."""

    direction: Direction

    def __init__(self, ctx: JobContext, ends: Ends[BoT, FilledT, ProductT],
                 on_progress: ProgressCallback | None = None) -> None:
        self.ctx = ctx
        self.bos: dict[int, BoT] = {}
        self._usable: dict[str, Backend] = {}
        self._checked: FdMemo = {}  # fds validated once per job (see check_fd)
        self.pipeline: Pipeline[BoT] = Pipeline(ends, ctx.pool, ctx.cpu, workers_per_gpu=self.inflight(ctx),
                                                device_workers=ctx.device_workers_per_gpu,
                                                on_progress=on_progress, copier=ctx.copier, times=ctx.times)

    def inflight(self, ctx: JobContext) -> int:
        """Batches this job keeps in flight per GPU lane."""
        return ctx.workers_per_gpu

    @property
    def progress(self) -> Progress:
        return self.pipeline.progress

    @property
    def error(self) -> BaseException | None:
        """The job's first error, as soon as it happened (before `finish` reports it)."""
        return self.pipeline.error

    def on_fail(self, callback: Callable[[BaseException], None]) -> None:
        """Call `callback` once, with the first error, when the job fails (e.g. to end a session at once)."""
        self.pipeline.on_fail = callback

    # --- what a session sees (interface.Job) ----------------------------------

    @property
    def data_files_per_gpu(self) -> int:
        """The data files per GPU the client attaches for the job to write (a dump's); 0: none."""
        return 0

    @property
    def manifest_name(self) -> str | None:
        """The file the client gives at Start (a dump's manifest), if any."""
        return None

    def files_needed(self) -> list[tuple[int, str]]:
        """The files of images the job reads that the client must still attach: (image, name)."""
        return []

    @property
    def ready(self) -> bool:
        """Every file of files_needed attached."""
        return True

    async def attach_file(self, image: int, name: str, fd: int, direct: int | None) -> None:
        """A file of files_needed (`image` 0: the image the job reads; k: its k-th parent)."""
        raise InvalidRequestError(f"{name!r} is not a file this session needs")

    def attach_data_file(self, image: int, name: str, gpu: int, stripe: int, fd: int,
                         direct: int | None) -> DataFileWriter:
        """A data file the job writes (a dump's), attached but not yet written into (`publish_data_files`)."""
        raise InvalidRequestError(f"{name!r}: this session writes no data file")

    def publish_data_files(self, files: Sequence[DataFileWriter]) -> None:
        """The data files of one message, all attached: written into from now on."""

    def detach_data_files(self, files: Sequence[DataFileWriter]) -> None:
        """The data files of a refused message: never written into, nor listed."""

    def seal(self, manifest_fd: int | None) -> None:
        """Start: no more BOs.  `manifest_fd`: the file named `manifest_name`, held by the session, or None."""

    def _release_all(self) -> None:
        for bo in self.bos.values():
            bo.release()

    def _backend(self, kind: str, bo_id: int) -> Backend:
        backend = self._usable.get(kind)  # checked once per kind and job, not per BO
        if backend is not None:
            return backend
        backend = self.ctx.backends.get(kind)
        if backend is None:
            raise BackendUnavailableError(
                f"backend {str(kind)!r} is not available (have: {', '.join(sorted(self.ctx.backends))})", bo_id=bo_id)
        caps = backend.capabilities()
        if not (caps.can_read if self.direction is Direction.READ else caps.can_write):
            raise BackendUnavailableError(f"backend {str(kind)!r} cannot {self.direction.value}", bo_id=bo_id)
        self._usable[kind] = backend
        return backend

    def _validate(self, todo: Sequence[ItemT]) -> tuple[list[tuple[Backend, OpenItem]], VramdError | None]:
        """The job's checks that need no syscall (dump.py, restore.py); nothing to open by default."""
        return [], None

    def open_ahead(self, todo: Sequence[ItemT]) -> Ahead:
        """In a worker thread, before `add(todo, ahead)`: open what `add` will open, so that the
        event loop makes no syscall for these BOs (procmem's probes) and never waits for the GIL
        after one.  The backends `_opens_ahead` names (CPU-copy ones: fd checks, probes, sizes;
        a dump's also those that find a BO's identity here, `_prepare`); nothing is raised here:
        on any error nothing is kept, and `add` meets the error again, in order.  The caller
        passes what is returned to `add`, then to `drop_ahead`."""
        valid, _ = self._validate(todo)
        opened = [(v, spec) for v, spec in zip(valid, todo) if self._opens_ahead(v[0])]
        ahead = Ahead()
        try:
            handles = self._open_all([v for v, _ in opened])
            try:
                self._prepare([(backend, h) for ((backend, _), _), h in zip(opened, handles)])
            except BaseException:
                for ((backend, _), _), h in zip(opened, handles):
                    backend.release(h)
                raise
        except VramdError as e:
            if e.bo_id is not None and any(item[0] == e.bo_id for (_, item), _ in opened):
                ahead.failed = (e.bo_id, e)
            return ahead
        ahead.update({item[0]: (backend, item, h, spec) for ((backend, item), spec), h in zip(opened, handles)})
        return ahead

    def _opens_ahead(self, backend: Backend) -> bool:
        """Whether `open_ahead` opens the BOs of `backend`: the CPU-copy backends' (their syscalls)."""
        return backend.cpu_copier() is not None

    def _prepare(self, opened: Sequence[tuple[Backend, BoHandle]]) -> None:
        """In `open_ahead`'s worker thread, the BOs it opened: what else the job needs done there (a dump:
        `Backend.prepare_identity`).  Raises a BO's typed error; the caller releases the handles."""

    def _validated(self, todo: Sequence[ItemT], ahead: Ahead | None) -> tuple[list[tuple[Backend, OpenItem]],
                                                                           VramdError | None]:
        """`_validate(todo)`, unless `open_ahead` validated these very specs (the same objects, each opened and
        waiting in `ahead`): then its answer stands, and no BO is checked twice.  (Nothing can be added
        between the two: a session adds one message at a time.)"""
        if ahead:
            valid = []
            for spec in todo:
                got = ahead.get(spec[0])  # a spec's or a target's first field is its BO id
                if got is None or got[3] is not spec:
                    return self._validate(todo)
                valid.append((got[0], got[1]))
            return valid, None
        return self._validate(todo)

    @staticmethod
    def drop_ahead(ahead: Ahead) -> None:
        """Release the handles of `open_ahead` that `add` did not take (it failed, or stopped early)."""
        for backend, _, handle, _ in ahead.values():
            backend.release(handle)
        ahead.clear()

    def _open_all(self, items: Sequence[tuple[Backend, OpenItem]], ahead: Ahead | None = None) -> list[BoHandle]:
        """Open validated BOs in order, each run of one backend with one `open_many` (procmem: every
        probe of the run in one call); a BO that `ahead` holds opened for the very same item is
        taken from there.  The first BO that fails raises its error after the handles opened
        or taken here are released; the BOs after it are not opened."""
        handles: list[BoHandle] = []
        failed = getattr(ahead, "failed", None)  # (a plain dict of handles records no failure)
        i = 0
        try:
            while i < len(items):
                backend, item = items[i]
                if failed is not None and item[0] == failed[0]:
                    raise failed[1]  # as it failed in the worker thread, moments ago
                got = ahead.pop(item[0], None) if ahead else None
                if got is not None:
                    if got[0] is backend and got[1] == item:
                        handles.append(got[2])
                        i += 1
                        continue
                    got[0].release(got[2])  # opened for something else: not this BO's handle
                j = i + 1
                while j < len(items) and items[j][0] is backend and not (ahead and items[j][1][0] in ahead) \
                        and not (failed is not None and items[j][1][0] == failed[0]):
                    j += 1
                handles += backend.open_many([it for _, it in items[i:j]], self.direction, checked=self._checked)
                i = j
        except BaseException:
            for (backend, _), h in zip(items, handles):
                backend.release(h)
            raise
        return handles

    def cancel(self, reason: str = "job cancelled") -> None:
        self.pipeline.cancel(reason)

    def precheck(self, refs: Iterable[tuple[int, BoRef]]) -> None:
        """Validate the fds of BOs about to be added, filling the job's memo.

        Thread-safe and meant for a worker thread: `add` then finds every fd
        checked and makes no syscall for it on the event loop.  Failures are
        not raised here; `add` meets them again and reports them with the BO.
        """
        for bo_id, ref in refs:
            backend = self.ctx.backends.get(ref.kind)
            if backend is None:
                continue
            try:
                backend.check(ref.fd, self.direction, bo_id=bo_id, checked=self._checked)
            except VramdError:
                pass

    def _fail(self, exc: VramdError) -> None:
        """A BO could not be added: the whole job fails (an image is all or nothing)."""
        self.pipeline.fail(exc)
