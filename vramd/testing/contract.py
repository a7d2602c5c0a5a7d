"""The backend contract: one suite every copy backend passes (`check_backend`), and subjects to run it on.

    check_backend(mmap_subject)        # procmem_subject, sdma_model_subject, fake_subject likewise

A subject is a backend plus a way to make BOs it can reach, with known
contents, and to read a BO's bytes back.  The suite checks what the engine
relies on: capabilities that tell the truth, byte-exact copies in both
directions at any offset and into any slot of a staging buffer, one
future per batch (`submit_many`) that completes when every copy landed,
typed errors that name the BO, release/close that free everything, and
identities that take one buffer given twice for one, and no two for one.
A backend that hands out a CPU copier (`Backend.cpu_copier`) has that half
checked too, the way the engine's copy threads drive it: planned copies run
by batchcopy, `after_copy`, write locks, and `copy_error` naming the BO.
"""
from __future__ import annotations

import asyncio
import fcntl
import mmap
import os
import random
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from ..backends import REGISTRY, Backend, BackendKind, BackendOptions, BoHandle, BoRef, Direction
from ..backends.base import holding
from ..errors import BackendError, BadDescriptorError, VramdError
from ..hostmem.batchcopy import END_OF_FILE, copy_batch
from ..hostmem.libc import address, pointer
from ..hostmem.staging import StagingPool
from ..units import PAGE, round_up
from .fake import FakeDmaBackend

GPU = 0x1002


@dataclass
class Subject:
    """A backend under test and BOs for it."""

    backend: Backend
    kind: str                                       # the BoRef kind of its BOs
    new_bo: Callable[[bytes], tuple[BoRef, Callable[[], bytes]]]  # data -> (ref, read back its bytes)
    cleanups: list[Callable[[], None]] = field(default_factory=list)

    def close(self) -> None:
        self.backend.close()
        for c in reversed(self.cleanups):
            c()


def _memfd_bo(kind: str, subject_cleanups: list[Callable[[], None]], data: bytes, *,
              page_rounded: bool = False, sealed: bool = False) -> tuple[BoRef, Callable[[], bytes]]:
    fd = os.memfd_create(f"contract-{kind}", os.MFD_CLOEXEC | (os.MFD_ALLOW_SEALING if sealed else 0))
    subject_cleanups.append(lambda: os.close(fd))
    os.ftruncate(fd, round_up(max(len(data), 1)) if page_rounded else len(data))
    os.pwrite(fd, data, 0)
    if sealed:
        seal_size(fd)
    return BoRef(kind, fd, 0), lambda: os.pread(fd, len(data), 0)


def seal_size(fd: int) -> None:
    """Seal a memfd (made with MFD_ALLOW_SEALING) against shrinking and growing: its size is fixed for its life,
    as a dmabuf's is, and the mmap backend maps it as it maps a dmabuf (the large-BAR path)."""
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)


def mmap_subject() -> Subject:
    """mmap on memfds, read and written with pread/pwrite (a memfd that may shrink is never mapped)."""
    s = Subject(REGISTRY[BackendKind.MMAP].create(BackendOptions()), "mmap", lambda d: _memfd_bo("mmap", s.cleanups, d))
    return s


def mapped_subject() -> Subject:
    """mmap on memfds sealed to their size: mapped and copied through the mapping, as a dmabuf (large BAR) is."""
    s = Subject(REGISTRY[BackendKind.MMAP].create(BackendOptions()), "mmap",
                lambda d: _memfd_bo("mmap", s.cleanups, d, sealed=True))
    return s


def fake_subject() -> Subject:
    s = Subject(FakeDmaBackend(), "fake", lambda d: _memfd_bo("fake", s.cleanups, d))
    return s


def sdma_model_subject() -> Subject:
    """SDMA on the software model of libdrm_amdgpu + SDMA: a dmabuf is a page-rounded memfd there."""
    backend = REGISTRY[BackendKind.SDMA].create(BackendOptions(sdma_library="model"))
    s = Subject(backend, "sdma", lambda d: _memfd_bo("sdma", s.cleanups, d, page_rounded=True))
    return s


def procmem_subject() -> Subject:
    """procmem on this very process: BOs are anonymous mappings, reached through /proc/self/mem."""
    mem = os.open("/proc/self/mem", os.O_RDWR | os.O_CLOEXEC)
    s = Subject(REGISTRY[BackendKind.PROCMEM].create(BackendOptions()), "procmem", lambda d: new(d))
    s.cleanups.append(lambda: os.close(mem))

    def new(data: bytes) -> tuple[BoRef, Callable[[], bytes]]:
        m = mmap.mmap(-1, round_up(max(len(data), 1)), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        m[:len(data)] = data
        with pointer(m, writable=True) as p:
            addr = address(p)
        s.cleanups.append(m.close)
        return BoRef("procmem", mem, addr), lambda: m[:len(data)]
    return s


SUBJECTS: dict[str, Callable[[], Subject]] = {
    "procmem": procmem_subject, "mmap": mmap_subject, "mmap-mapped": mapped_subject, "sdma": sdma_model_subject,
    "fake": fake_subject,
}


# --- the suite ----------------------------------------------------------------

@contextmanager
def _subject(make: Callable[[], Subject]) -> Iterator[tuple[Subject, StagingPool]]:
    s = make()
    pool = StagingPool(16 << 20)
    s.backend.attach(pool)
    try:
        yield s, pool
    finally:
        s.close()
        pool.close()


def _data(n: int, seed: int) -> bytes:
    return random.Random(seed).randbytes(n)


async def _capabilities(make: Callable[[], Subject]) -> None:
    with _subject(make) as (s, _):
        caps = s.backend.capabilities()
        assert caps.name == s.backend.name, (caps.name, s.backend.name)
        assert caps.can_read and caps.can_write, "every backend vramd has dumps and restores"
        assert caps.preferred_chunk > 0 and caps.max_inflight > 0
        has_copier = s.backend.cpu_copier() is not None
        assert has_copier != caps.asynchronous_dma, \
            f"a backend has a CPU copier exactly when its copies are not asynchronous DMA (copier: {has_copier})"


async def _read_round_trip(make: Callable[[], Subject]) -> None:
    """BO -> staging: whole BOs and pieces at offsets, into several slots of one buffer, in one batch."""
    with _subject(make) as (s, pool):
        a, b = _data(3 * PAGE + 123, 1), _data(2 * PAGE, 2)
        ra, _ = s.new_bo(a)
        rb, _ = s.new_bo(b)
        ha = s.backend.open(1, ra, len(a), GPU, Direction.READ)
        hb = s.backend.open(2, rb, len(b), GPU, Direction.READ)
        buf, = await pool.acquire(1 << 20)
        try:
            fut = s.backend.submit(ha, 0, buf, 0, len(a))
            assert isinstance(fut, asyncio.Future)
            await fut
            assert buf.view[:len(a)] == a, "submit copied other bytes"
            slot = round_up(len(a))
            await s.backend.submit_many([(hb, 0, buf, slot, len(b)), (ha, PAGE + 5, buf, slot + 2 * PAGE, 1000)])
            assert buf.view[slot:slot + len(b)] == b, "submit_many: first piece differs"
            assert buf.view[slot + 2 * PAGE:slot + 2 * PAGE + 1000] == a[PAGE + 5:PAGE + 1005], "piece at an offset"
        finally:
            pool.release([buf])
            s.backend.release(ha)
            s.backend.release(hb)


async def _write_round_trip(make: Callable[[], Subject]) -> None:
    """staging -> BO: a whole BO from slot 0, and a piece into the middle of another from a later slot."""
    with _subject(make) as (s, pool):
        n = 5 * PAGE + 7
        ra, read_a = s.new_bo(bytes(n))
        rb, read_b = s.new_bo(bytes(n))
        ha = s.backend.open(1, ra, n, GPU, Direction.WRITE)
        hb = s.backend.open(2, rb, n, GPU, Direction.WRITE)
        src = _data(n, 3)
        buf, = await pool.acquire(1 << 20)
        try:
            buf.view[:n] = src
            buf.view[8 * PAGE:8 * PAGE + 4000] = src[:4000]
            await s.backend.submit_many([(ha, 0, buf, 0, n), (hb, PAGE + 1, buf, 8 * PAGE, 4000)])
        finally:
            pool.release([buf])
            s.backend.release(ha)
            s.backend.release(hb)
        assert read_a() == src, "a restored BO differs from the staged bytes"
        assert read_b() == bytes(PAGE + 1) + src[:4000] + bytes(n - PAGE - 1 - 4000), "a piece landed elsewhere"


async def _errors_name_the_bo(make: Callable[[], Subject]) -> None:
    with _subject(make) as (s, _):
        closed = os.memfd_create("closed", os.MFD_CLOEXEC)
        os.close(closed)
        for direction in (Direction.READ, Direction.WRITE):
            try:
                s.backend.open(7, BoRef(s.kind, closed, 0), PAGE, GPU, direction)
            except BadDescriptorError as e:
                assert e.bo_id == 7, e
            else:
                raise AssertionError(f"a closed fd was accepted for {direction.value}")
        ref, _ = s.new_bo(_data(2 * PAGE, 4))
        try:  # 1 TiB: past any fd's end, and past the end of user address space for procmem
            h: BoHandle | None = s.backend.open(8, ref, 1 << 40, GPU, Direction.READ)
        except BackendError as e:
            assert e.bo_id == 8, e
            h = None
        else:
            raise AssertionError("a BO larger than what its fd reaches was accepted")
        assert h is None


async def _cpu_copier(make: Callable[[], Subject]) -> None:
    """The CPU-copier half, as the engine's copy threads use it: a BO read whole and in a piece, a piece written
    into another BO under its write lock, each landed copy told to `after_copy`; a copy that stops is
    `copy_error`'s typed error naming the BO and the offset."""
    with _subject(make) as (s, pool):
        copier = s.backend.cpu_copier()
        if copier is None:
            return  # asynchronous DMA only: the other checks cover it
        n = 3 * PAGE + 77
        a = _data(n, 5)
        ra, _ = s.new_bo(a)
        rb, read_b = s.new_bo(bytes(n))
        ha = s.backend.open(1, ra, n, GPU, Direction.READ)
        hb = s.backend.open(2, rb, n, GPU, Direction.WRITE)
        buf, = await pool.acquire(1 << 20)
        try:
            plans = [copier.plan(ha, 0, buf.address, n), copier.plan(ha, PAGE + 3, buf.address + 8 * PAGE, 500)]
            outcomes, failed = copy_batch(plans)
            assert failed < 0, f"a planned read failed: {outcomes}"
            for bo_offset, length in ((0, n), (PAGE + 3, 500)):
                copier.after_copy(ha, bo_offset, length)
            assert buf.view[:n] == a, "a planned read copied other bytes"
            assert buf.view[8 * PAGE:8 * PAGE + 500] == a[PAGE + 3:PAGE + 503], "a planned piece at an offset"
            with holding([copier.write_lock(hb)]):
                outcomes, failed = copy_batch([copier.plan(hb, PAGE, buf.address + 8 * PAGE, 500)])
            assert failed < 0, f"a planned write failed: {outcomes}"
            copier.after_copy(hb, PAGE, 500)
        finally:
            pool.release([buf])
            s.backend.release(ha)
            s.backend.release(hb)
        assert read_b() == bytes(PAGE) + a[PAGE + 3:PAGE + 503] + bytes(n - PAGE - 500), \
            "a planned write landed elsewhere"
        for err in (5, END_OF_FILE):  # EIO, and an fd that ended inside the BO
            e = copier.copy_error(ha, PAGE, err)
            assert isinstance(e, VramdError) and e.bo_id == 1 and e.offset == PAGE, (err, e)


async def _identity(make: Callable[[], Subject]) -> None:
    """`identity` (a dump's alias rule): one buffer given for two BOs (the same fd, or a dup of it) is one
    buffer, two buffers of one size are two, another offset or size into one buffer is another BO; None
    (never aliased) is always allowed.  Found after `prepare_identity`, in a worker thread, where it is."""
    with _subject(make) as (s, _):
        backend = s.backend
        ra, _ = s.new_bo(_data(2 * PAGE, 6))
        rb, _ = s.new_bo(_data(2 * PAGE, 7))
        dup = os.dup(ra.fd)
        s.cleanups.append(lambda: os.close(dup))
        opens = [(1, ra, 2 * PAGE), (2, ra, 2 * PAGE), (3, ra._replace(fd=dup), 2 * PAGE), (4, rb, 2 * PAGE),
                 (5, ra, PAGE), (6, ra._replace(offset=ra.offset + PAGE), PAGE)]
        handles = [backend.open(i, ref, n, GPU, Direction.READ) for i, ref, n in opens]
        try:
            if backend.prepares_identity:
                await asyncio.to_thread(backend.prepare_identity, handles)
            ids = [backend.identity(h) for h in handles]
        finally:
            for h in handles:
                backend.release(h)
        if any(i is None for i in ids):
            assert all(i is None for i in ids), f"identities known for some BOs of one kind only: {ids}"
            return
        assert ids[0] == ids[1] == ids[2], f"one buffer given three times has several identities: {ids[:3]}"
        assert len({ids[0], ids[3], ids[4], ids[5]}) == 4, f"different buffers or ranges share an identity: {ids}"


CHECKS = (_capabilities, _read_round_trip, _write_round_trip, _errors_name_the_bo, _cpu_copier, _identity)


def check_backend(make: Callable[[], Subject]) -> None:
    """Run every check of the contract on fresh subjects from `make`; raises AssertionError on a breach."""
    for check in CHECKS:
        asyncio.run(check(make))
