"""The copy-backend interface, shaped for asynchronous DMA engines.

A backend moves bytes between a BO and a staging buffer.  The engine
attaches the staging pool once (a DMA backend registers/pins every buffer
there, once), opens each BO once per job (a DMA backend imports it there),
then `submit`s copies; each submit returns an awaitable that completes when
the copy has landed.  A DMA backend completes from a fence; the CPU
backends below complete from a worker thread.  Either way the engine keeps
several copies in flight and never blocks its event loop.

The engine moves small chunks in batches and hands a backend a whole
batch's copies at once with `submit_many`: one future for many copies, so a
batch costs one completion (a CPU backend: one thread hand-off; a DMA
backend: one submission of many packets and one fence) however many pieces
it holds.

That asynchronous core (open, submit, completion, release, close) is all a
backend must have.  A backend whose copies are plain CPU copies also hands
out a `CpuCopier` (`Backend.cpu_copier`): the engine asks for it and, where
there is one, runs whole batches through it in its own copy threads.
"""
from __future__ import annotations

import asyncio
import enum
import fcntl
import os
import stat
import threading
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Hashable, Iterable, Iterator, Mapping, MutableMapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import ClassVar, NamedTuple, Protocol, Self

from ..errors import BadDescriptorError, VramdError, from_os_error
from ..hostmem.batchcopy import Copy
from ..hostmem.staging import StagingBuffer, StagingPool


class Direction(enum.Enum):
    READ = "read"    # BO -> staging (dump)
    WRITE = "write"  # staging -> BO (restore)


class BoRef(NamedTuple):
    """Where a BO's bytes are reached: a caller-passed fd plus an offset.

    procmem: fd of /proc/<pid>/mem, offset = virtual address in that process.
    mmap:    fd of a dmabuf / render node / memfd / file, offset = mmap offset.
    sdma:    fd of a dmabuf, offset = byte offset inside it.

    (An immutable named tuple, as BoSpec and RestoreTarget: one is made per BO a
    session adds, and a frozen dataclass cost 3-4 times as much to make.)
    """

    kind: str  # the backend's name: a BackendKind for vramd's own (parsed where a request arrives)
    fd: int
    offset: int = 0


@dataclass(frozen=True)
class BackendOptions:
    """What the engine tells every backend it creates (the constructor contract: `Backend.create`).

    A backend takes what applies to it and ignores the rest.
    """

    workers_per_gpu: int = 4  # batches in flight per GPU
    copy_threads: int = 0     # threads for CPU copies (0: workers_per_gpu)
    # SDMA: library None = $VRAMD_AMDGPU_LIBRARY ("" the system libdrm_amdgpu, "model", or a path)
    sdma_library: str | None = None
    render_nodes: Mapping[int, str] = field(default_factory=dict)      # gpu_id -> /dev/dri/renderD<minor>
    recommended_mask: Mapping[int, int] = field(default_factory=dict)  # gpu_id -> SDMA engines for host copies


# The job's memo of fds already validated: (fd, direction, needs O_RDWR) -> the fd's stat.
FdMemo = MutableMapping[tuple[int, bool, bool], os.stat_result]  # (fd, for writing, write needs O_RDWR) -> its fstat


@dataclass(frozen=True)
class Capabilities:
    name: str
    can_read: bool
    can_write: bool
    preferred_chunk: int   # the chunk size this backend moves best
    max_inflight: int      # copies worth keeping in flight per GPU
    asynchronous_dma: bool  # True for an engine that completes from a fence
    description: str


@dataclass(eq=False)
class BoHandle:
    """One BO opened by a backend for one job; backends may subclass it."""

    bo_id: int
    ref: BoRef
    size: int
    gpu_id: int
    direction: Direction


class Backend(ABC):
    name: ClassVar[str]

    @classmethod
    @abstractmethod
    def create(cls, options: BackendOptions) -> Self:
        """The constructor contract: make the backend from the engine's options.

        Raises BackendUnavailableError, with the reason, where it cannot work
        here (no GPU, no library); the engine then lists it as unavailable.
        """

    @abstractmethod
    def capabilities(self) -> Capabilities: ...

    def attach(self, pool: StagingPool) -> None:
        """Called once per job with the staging pool, before any submit."""

    @abstractmethod
    def open(self, bo_id: int, ref: BoRef, size: int, gpu_id: int, direction: Direction,
             checked: FdMemo | None = None) -> BoHandle:
        """Validate (and import) a BO; raises a typed error naming what is wrong.

        `checked` is the job's memo of fds already validated (see check_fd):
        a job pins its fds for its whole life, so one check per fd is enough
        however many BOs share it.
        """

    def open_many(self, items: Sequence[OpenItem], direction: Direction,
                  checked: FdMemo | None = None) -> list[BoHandle]:
        """`open` of several BOs, each `(bo_id, ref, size, gpu_id)`, in order: their handles.

        The first BO that fails raises its error, exactly as `open` would,
        after the handles already opened here are released; the BOs after it
        are not opened.  A backend may do the work of many opens at once (for
        procmem: every range probe in one call that releases the GIL once).
        """
        handles: list[BoHandle] = []
        try:
            for bo_id, ref, size, gpu_id in items:
                handles.append(self.open(bo_id, ref, size, gpu_id, direction, checked=checked))
        except BaseException:
            for h in handles:
                self.release(h)
            raise
        return handles

    write_needs_rdwr: ClassVar[bool] = False  # restoring needs O_RDWR, not just O_WRONLY (e.g. to map it)

    def check(self, fd: int, direction: Direction, *, bo_id: int, checked: FdMemo | None = None) -> os.stat_result:
        """Validate a caller-passed fd for this backend (see check_fd); open() calls it first."""
        return check_fd(fd, direction, bo_id=bo_id, write_needs_rdwr=self.write_needs_rdwr, checked=checked)

    @abstractmethod
    def submit(
        self, handle: BoHandle, bo_offset: int, buf: StagingBuffer, buf_offset: int, length: int
    ) -> asyncio.Future[None]:
        """Start one copy of `length` bytes; the future completes when it has landed."""

    def submit_many(self, items: Sequence[CopyItem]) -> asyncio.Future[None]:
        """Start several copies, each `(handle, bo_offset, buf, buf_offset, length)`; one future for all.

        The items may name different BOs (of this backend) and different
        slots of one staging buffer.  The future completes when *every* copy
        has landed, also when one fails (so no staging buffer is reused while
        a copy still uses it), and then raises the first failure in item order.
        This default submits each copy on its own; a backend overrides it to
        do better (one thread hand-off for all, or one DMA submission of many
        packets completing on one fence).
        """
        futs: list[asyncio.Future[None]] = []
        try:
            for item in items:
                futs.append(self.submit(*item))
        except BaseException as e:  # let what was started land before reporting
            return land_all(futs, error=e)
        return land_all(futs)

    def release(self, handle: BoHandle) -> None:
        """The job is done with this BO."""

    # --- identity: which BOs of a dump are one buffer --------------------------

    prepares_identity: ClassVar[bool] = False  # `identity` needs `prepare_identity` first (a worker thread's)

    def identity(self, handle: BoHandle) -> Hashable | None:
        """The buffer an opened BO reaches, for a dump's alias rule: BOs of one dump with equal identities
        are one buffer, stored and copied once (one dmabuf given twice, by one process or two).  None: not
        known, and the BO is copied on its own (copying a buffer twice is always right; taking two buffers
        for one never is).  Cheap: on the event loop, once per BO.

        The default: the fd's inode, the offset and the size, right wherever the kernel gives each buffer
        an inode of its own (a dma-buf, a memfd, a file).  A backend that reaches buffers some other way
        says what the device itself takes for one buffer."""
        try:
            st = os.fstat(handle.ref.fd)
        except OSError:
            return None
        return (st.st_dev, st.st_ino, handle.ref.offset, handle.size)

    def prepare_identity(self, handles: Sequence[BoHandle]) -> None:
        """Blocking, in a worker thread, before a dump takes these opened BOs (only where `prepares_identity`):
        whatever `identity` needs that must not run on the event loop (SDMA: each dmabuf imported into its
        GPU's device, which it needs before its first copy anyway).  A BO that fails raises its typed error;
        the caller releases every handle."""

    def cpu_copier(self) -> CpuCopier | None:
        """The backend's CPU copies, where its copies are plain CPU copies (procmem, mmap): the engine then runs
        a whole batch (copy, zero scan, checksum, file I/O) as one call in its own copy threads
        (vramd.hostmem.batchcopy) through it, instead of going through `submit_many`.  None (the default): the
        backend's copies complete asynchronously (a DMA engine), through `submit_many` only."""
        return None

    def close(self) -> None:
        """The job is over; drop per-job resources."""


class CpuCopier(Protocol):
    """The optional half of a backend: copies that are plain CPU copies, run by whoever holds a copy thread.

    Asked for by capability (`Backend.cpu_copier`); every method but `plan` is blocking work for a copy
    thread.  `CpuCopies` (vramd.backends.threaded) is the one implementation the CPU backends share.
    """

    def endpoint(self, handle: BoHandle, bo_offset: int, length: int) -> tuple[int, int]:
        """Where a CPU copy reaches bytes [bo_offset, bo_offset + length) of the BO.

        `(fd, file offset)` for pread/pwrite, or `(-1, address)` for memory
        that stays valid until `release` (e.g. a mapping).  Blocking; called
        in a copy thread.
        """

    def plan(self, handle: BoHandle, bo_offset: int, address: int, length: int) -> Copy:
        """The CPU copy between bytes [bo_offset, +length) of the BO and staging memory at `address`."""

    def copy_error(self, handle: BoHandle, bo_offset: int, err: int) -> VramdError:
        """The typed error for a CPU copy that stopped at BO offset `bo_offset`
        (`err`: an errno, or batchcopy.END_OF_FILE when the fd ended there)."""

    def after_copy(self, handle: BoHandle, bo_offset: int, length: int) -> None:
        """Called in the copy thread after a CPU copy of the BO landed (e.g. to unmap a BO copied whole)."""

    def write_lock(self, handle: BoHandle) -> threading.Lock | None:
        """A lock that every CPU copy into this BO holds (`holding`), where the kernel runs such writes one
        at a time anyway: a copy thread waiting here sleeps, where one waiting in the kernel spins.  None:
        copies into the BO run side by side."""


@contextmanager
def holding(locks: Iterable[threading.Lock | None]) -> Iterator[None]:
    """Hold every distinct lock of `locks` (CpuCopier.write_lock's; None: no lock), taken in one order
    everywhere, so two copy threads that need some of the same locks never wait for each other in a cycle."""
    held = [lock for _, lock in sorted({id(lock): lock for lock in locks if lock is not None}.items())]
    for lock in held:
        lock.acquire()
    try:
        yield
    finally:
        for lock in reversed(held):
            lock.release()


# (handle, bo_offset, staging buffer, buffer offset, length): one copy of a batch
CopyItem = tuple[BoHandle, int, StagingBuffer, int, int]
# (bo_id, ref, size, gpu_id): one BO to open (Backend.open_many)
OpenItem = tuple[int, BoRef, int, int]


def land_all(futs: Iterable[Awaitable[None]], *, error: BaseException | None = None) -> asyncio.Future[None]:
    """One future for several in-flight copies: done when all have landed, then raising the first error.

    Unlike `gather`, an error does not resolve it early and cancelling it
    cancels no copy: it still waits for every copy to land, then re-raises
    the cancellation.  `error` (e.g. a submit that raised before its copy
    started) wins over the copies' own errors.
    """
    started = [asyncio.ensure_future(f) for f in futs]
    if error is None and len(started) == 1:
        return started[0]
    return asyncio.ensure_future(_land_all(started, error))


async def _land_all(futs: Sequence[asyncio.Future[None]], error: BaseException | None) -> None:
    cancelled = False
    while pending := [f for f in futs if not f.done()]:
        try:
            await asyncio.wait(pending)
        except asyncio.CancelledError:
            cancelled = True
    first = error
    for f in futs:  # retrieve every outcome, so none is reported as never retrieved
        exc = asyncio.CancelledError() if f.cancelled() else f.exception()
        if first is None and exc is not None:
            first = exc
    if cancelled:
        raise asyncio.CancelledError()
    if first is not None:
        raise first


def check_fd(fd: int, direction: Direction, *, bo_id: int, write_needs_rdwr: bool = False,
             checked: FdMemo | None = None) -> os.stat_result:
    """fstat a caller-passed fd and check its access mode suits the direction.

    `write_needs_rdwr`: writing needs O_RDWR, not just O_WRONLY (a MAP_SHARED
    writable mapping does).  `checked`: a per-job memo; an fd that passed
    once is not checked again.
    """
    key = (fd, direction is Direction.WRITE, write_needs_rdwr)  # (an Enum member hashes in Python code: slow)
    if checked is not None:
        st = checked.get(key)
        if st is not None:
            return st
    st = _check_fd(fd, direction, bo_id=bo_id, write_needs_rdwr=write_needs_rdwr)
    if checked is not None:
        checked[key] = st
    return st


def _check_fd(fd: int, direction: Direction, *, bo_id: int, write_needs_rdwr: bool) -> os.stat_result:
    # The messages name the BO, never `fd`: that is the daemon's number for the client's fd, which means
    # nothing to the client.
    bo = f"the fd of BO {bo_id}"
    try:
        st = os.fstat(fd)
        flags = fcntl.fcntl(fd, fcntl.F_GETFL)
    except OSError as e:
        raise from_os_error(e, f"{bo} is not usable", BadDescriptorError, bo_id=bo_id) from None
    if stat.S_ISDIR(st.st_mode):
        raise BadDescriptorError(f"{bo} is a directory, not a BO", bo_id=bo_id)
    if flags & getattr(os, "O_PATH", 0o10000000):
        raise BadDescriptorError(f"{bo} is an O_PATH descriptor: it allows no I/O", bo_id=bo_id)
    acc = flags & os.O_ACCMODE
    if direction is Direction.READ and acc == os.O_WRONLY:
        raise BadDescriptorError(f"{bo} is write-only; dumping needs read access", bo_id=bo_id)
    if direction is Direction.WRITE and acc == os.O_RDONLY:
        raise BadDescriptorError(f"{bo} is read-only; restoring needs write access", bo_id=bo_id)
    if direction is Direction.WRITE and write_needs_rdwr and acc != os.O_RDWR:
        raise BadDescriptorError(f"{bo} must be open read-write to map it for writing", bo_id=bo_id)
    return st


def fd_size(fd: int, st: os.stat_result) -> int | None:
    """The byte size of the object behind fd, or None where the kernel cannot say.

    Regular files and memfds report st_size.  A dmabuf reports its size
    through lseek(SEEK_END) (its position is meaningless, so moving it is
    harmless).  A DRM render node cannot say; the driver itself rejects an
    mmap outside the BO behind the offset, so no SIGBUS is possible there.
    """
    if stat.S_ISREG(st.st_mode):
        return st.st_size
    try:
        return os.lseek(fd, 0, os.SEEK_END)
    except OSError:
        return None
