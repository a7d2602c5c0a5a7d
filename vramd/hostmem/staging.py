"""The staging-memory budget: page-aligned host buffers, allocated once, reused.

All host memory that holds BO bytes in flight comes from one pool whose
size never exceeds the configured budget, whatever the BO sizes.  A chunk
in flight holds one buffer (raw bytes) or two (raw + compressed).  Buffers
are anonymous mmaps, so they are page-aligned (as SDMA userptr registration
needs) and cost no resident memory until first touched.  A buffer of 2 MiB
or more sits on transparent huge pages where the kernel has them (`huge`):
its whole 2 MiB pieces are asked for as huge pages (MADV_HUGEPAGE), the
rest as small pages, so it never holds more memory than its size.  An
O_DIRECT read or write then reaches the disk in requests of up to the
device's limit instead of one segment per 4 KiB page, and copies miss the
TLB less: measured on a 2-core VM's virtual disk (at most 254 segments a
request), a 1 GiB cold restore ran 1.3 -> 1.7 GB/s at 0.60 -> 0.46 CPU s/GiB
and a dump 1.74 -> 2.07 GB/s (bench/README.md).  Buffers are kept
per size and reused; an idle buffer of another size is unmapped only when
a request cannot otherwise fit the budget.  Backends that must register
host memory (SDMA userptr BOs) hook `on_alloc`/`on_free`, so each buffer is
registered exactly once in its life.
"""
from __future__ import annotations

import asyncio
import collections
import mmap
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..errors import InvalidRequestError, JobError, from_os_error
from ..units import PAGE, round_up
from .libc import Pointer, address, ffi, pointer

# Each buffer holds one chunk plus headroom for a record's prefix and header.
HEADROOM = PAGE


def buffer_unit(chunk_size: int) -> int:
    """Bytes of budget one staging buffer for `chunk_size`-byte chunks takes."""
    return round_up(chunk_size + HEADROOM)


def staging_shortfall(budget: int, chunk_size: int, buffers: int) -> str | None:
    """The rule a batch's staging obeys: all its buffers fit the budget at once, or no byte ever moves.  None
    where they fit, else why not (one line).  The pool (`acquire`), the engine (a job refused up front) and
    the daemon's configuration check (vramd.service.config) all apply this one."""
    need = buffers * buffer_unit(chunk_size)
    if need <= budget:
        return None
    return (f"chunk size {chunk_size} needs {buffers} x {buffer_unit(chunk_size)} = {need} bytes of staging per "
            f"batch; the staging budget is {budget} bytes")


HUGE_PAGE = 2 << 20  # a transparent huge page (x86-64, arm64 with 4 KiB pages)


def anonymous(size: int, huge: bool = False) -> mmap.mmap:
    """Private anonymous memory (mmap.mmap(-1, n) alone would be MAP_SHARED: shmem, which
    the kernel refuses as an SDMA userptr).

    `huge` (and `size` at least HUGE_PAGE): mapped as a whole number of huge pages, which the
    kernel aligns to one, with the whole huge pages `size` covers advised MADV_HUGEPAGE and the
    rest MADV_NOHUGEPAGE, so that no more than `size` bytes (rounded up to a page) are ever
    touched or resident: the caller uses the first `size` bytes only.  Where the kernel has no
    transparent huge pages, the advice fails and the memory stays small pages."""
    if not huge or size < HUGE_PAGE:
        return mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    mapped = round_up(size, HUGE_PAGE)
    m = mmap.mmap(-1, mapped, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    body = size - size % HUGE_PAGE
    try:
        m.madvise(mmap.MADV_HUGEPAGE, 0, body)
        if mapped > body:  # the tail: small pages, even where the kernel makes every mapping huge
            m.madvise(mmap.MADV_NOHUGEPAGE, body, mapped - body)
    except OSError:  # EINVAL: a kernel without transparent huge pages
        pass
    return m


@dataclass(eq=False)
class StagingBuffer:
    size: int
    mm: mmap.mmap = field(repr=False)
    writable: bool = True
    backend_state: dict[object, Any] = field(default_factory=dict, repr=False)  # e.g. an SDMA userptr handle

    def __post_init__(self) -> None:
        # `size` bytes: a buffer on huge pages is mapped a whole number of them (anonymous)
        self.view = memoryview(self.mm)[:self.size]
        self.ptr: Pointer = pointer(self.mm, writable=self.writable)
        self._address = address(self.ptr)

    @property
    def address(self) -> int:
        return self._address

    def unmap(self) -> None:
        ffi.release(self.ptr)
        self.view.release()
        self.mm.close()


class StagingPool:
    """Hands out staging buffers n at a time, first come first served, within a byte budget."""

    def __init__(self, budget: int, huge_pages: bool = True) -> None:
        if budget < 2 * buffer_unit(0):
            raise InvalidRequestError(f"staging budget {budget} is too small")
        self.budget = budget
        self.huge_pages = huge_pages  # buffers of HUGE_PAGE or more on transparent huge pages (`anonymous`)
        self._free: dict[int, list[StagingBuffer]] = collections.defaultdict(list)
        self._waiters: collections.deque[tuple[int, int, asyncio.Future[list[StagingBuffer]]]] = collections.deque()
        self.allocated_bytes = 0  # mapped: in use + idle; never above budget
        self.in_use_bytes = 0
        self.peak_in_use_bytes = 0
        self.on_alloc: list[Callable[[StagingBuffer], None]] = []
        self.on_free: list[Callable[[StagingBuffer], None]] = []
        self._zeros: dict[int, StagingBuffer] = {}

    def zeros(self, size: int) -> StagingBuffer:
        """An all-zero source, never written (no budget used: untouched pages are the kernel's zero page).

        Private anonymous and mapped read-write, like every staging buffer, because an
        SDMA backend registers it as a userptr BO: the kernel accepts only anonymous
        private memory there, pinned writable.
        """
        buf = self._zeros.get(size)
        if buf is None:
            buf = self._zeros[size] = StagingBuffer(size, anonymous(max(size, 1)), writable=False)
        return buf

    def max_buffers(self, chunk_size: int) -> int:
        return self.budget // buffer_unit(chunk_size)

    async def acquire(self, chunk_size: int, n: int = 1) -> list[StagingBuffer]:
        unit = buffer_unit(chunk_size)
        short = staging_shortfall(self.budget, chunk_size, n)
        if short is not None:
            raise InvalidRequestError(short)
        if not self._waiters and self.in_use_bytes + n * unit <= self.budget:
            return self._take(unit, n)
        fut: asyncio.Future[list[StagingBuffer]] = asyncio.get_running_loop().create_future()
        entry = (unit, n, fut)
        self._waiters.append(entry)
        try:
            return await fut
        except BaseException:
            if fut.done() and not fut.cancelled():
                self.release(fut.result())  # handed over just as we were cancelled
            else:
                self._waiters.remove(entry)
                self._wake()
            raise

    def _take(self, unit: int, n: int) -> list[StagingBuffer]:
        """`n` buffers of `unit` bytes, idle ones first, the rest mapped now.  Where mapping one fails (the host
        is out of memory: JobError) or an on_alloc hook refuses it (its error), the pool is as it was: the
        idle buffers taken go back, the new ones stay idle (the refused one is unmapped), and nothing is
        counted in use."""
        free = self._free[unit]
        bufs = [free.pop() for _ in range(min(n, len(free)))]
        try:
            while len(bufs) < n:
                while self.allocated_bytes + unit > self.budget:
                    self._evict_one(keep=unit)
                try:
                    buf = StagingBuffer(unit, anonymous(unit, huge=self.huge_pages))
                except OSError as e:
                    raise from_os_error(e, f"cannot map {unit} bytes of staging memory", JobError) from None
                self.allocated_bytes += unit
                try:
                    for hook in self.on_alloc:
                        hook(buf)
                except BaseException:
                    self._unmap(buf)
                    raise
                bufs.append(buf)
        except BaseException:
            free.extend(bufs)
            raise
        self.in_use_bytes += n * unit
        self.peak_in_use_bytes = max(self.peak_in_use_bytes, self.in_use_bytes)
        return bufs

    def _evict_one(self, keep: int) -> None:
        for unit, free in self._free.items():
            if unit != keep and free:
                self._unmap(free.pop())
                return
        raise AssertionError("staging accounting: nothing idle to evict")

    def _unmap(self, buf: StagingBuffer) -> None:
        for hook in self.on_free:
            hook(buf)
        self.allocated_bytes -= buf.size
        buf.unmap()

    def release(self, bufs: list[StagingBuffer]) -> None:
        for b in bufs:
            self._free[b.size].append(b)
            self.in_use_bytes -= b.size
        self._wake()

    def _wake(self) -> None:
        while self._waiters:
            unit, n, fut = self._waiters[0]
            if fut.done():
                self._waiters.popleft()
                continue
            if self.in_use_bytes + n * unit > self.budget:
                return
            self._waiters.popleft()
            try:
                bufs = self._take(unit, n)
            except Exception as e:  # the waiter's, not the releaser's: it fails, the others still wait their turn
                fut.set_exception(e)
                continue
            fut.set_result(bufs)

    def close(self) -> None:
        for free in self._free.values():
            while free:
                self._unmap(free.pop())
        for z in self._zeros.values():
            z.unmap()
        self._zeros.clear()
