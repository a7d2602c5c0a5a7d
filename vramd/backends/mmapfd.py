"""mmap backend: the large-BAR path — map a caller-given fd, copy, unmap.

On AMD hardware the fd is a dmabuf (or render node at the BO's mmap
offset) of a CPU-visible BO; in tests it is a memfd or a regular file.

A regular file, or a memfd that may still shrink, is never mapped: it is
read and written with pread/pwrite at the BO's offset (the same single CPU
copy, without the page table work).  Mapping one would let its owner kill
the daemon: a caller that truncates a file it passed in while the daemon
copies from a mapping of it makes the next access SIGBUS, and SIGBUS in a
copy thread ends the whole process.  pread instead returns short, which
becomes a typed error naming the BO and offset.  Only objects that cannot
shrink are mapped: a dmabuf keeps its size for its life, a render node's
driver refuses a mapping outside the BO, and a memfd sealed against
shrinking (F_SEAL_SHRINK, which no one can lift) refuses every ftruncate
below its size.  Such a memfd takes the very path a dmabuf takes, which is
how the tests and bench/throughput.py run the large-BAR path without a GPU.
A huge-page memfd is not mapped even so (`cannot_shrink`), and a window
the kernel says it cannot fault in (MADV_POPULATE: EFAULT, where a touch
would raise SIGBUS) is a typed error, never touched.

Each BO is mapped once, at its first chunk, and unmapped as soon as its
last chunk has landed (the engine releases a BO's handle then).  Mapping
per chunk instead was measured 4x slower on 2 cores: every mmap/munmap
takes the process's mmap lock for writing and every munmap interrupts the
other copy threads for a TLB shootdown.  Each chunk's window is prefaulted
in one call (MADV_POPULATE_READ/WRITE, Linux 5.14+) rather than a fault
per page.

The fd's size is checked up front, so a copy never starts beyond the end
of the object.  Copies run in vramd.hostmem.batchcopy, without the GIL.
Copies into one regular file or memfd that is not mapped take turns
(`write_lock`): the kernel runs its pwrites one at a time anyway, and there
a waiter spins.
"""
from __future__ import annotations

import fcntl
import mmap
import os
import stat
import threading
from dataclasses import dataclass, field

from ..errors import BackendError, BadDescriptorError, TargetTooSmallError
from ..hostmem.libc import TMPFS_MAGIC, Pointer, address, ffi, fs_type, pointer, populate
from ..units import PAGE
from .base import BoHandle, BoRef, Capabilities, Direction, FdMemo, fd_size
from .kind import BackendKind
from .threaded import ThreadedBackend


@dataclass(eq=False)
class _MappedBo(BoHandle):
    lock: threading.Lock = field(default_factory=threading.Lock)
    mm: mmap.mmap | None = None
    base: Pointer = None  # cdata pointer to the BO's first byte in the mapping
    anchor: Pointer = None  # the from_buffer cdata keeping the mapping's buffer exported
    by_fd: bool = False  # a regular file or a memfd that may shrink: pread/pwrite, never mapped
    write_lock: threading.Lock | None = None  # writes into a file: its inode's (one of _WRITE_LOCKS)


# pwrites into one regular file or memfd run one at a time in the kernel (its inode lock), where the waiters spin:
# measured on 2 cores, two copy threads restoring into one memfd spent 13 % of their CPU spinning there.  So
# writes into one file take one of these, chosen by its inode (two files that share one only take turns).
_WRITE_LOCKS = tuple(threading.Lock() for _ in range(64))


DRM_MAJOR = 226  # /dev/dri/card*, /dev/dri/renderD*: a BO is mapped through its node at the BO's mmap offset
DMA_BUF_MAGIC = 0x444D4142  # fstatfs(2) f_type of a dmabuf's file ("DMAB")


def unmappable_kind(fd: int, st: os.stat_result) -> str | None:
    """What fd is, where it is nothing this backend can copy a BO through (said up front, at AddBos, rather than
    as a failed mmap at copy time); None where it can: a regular file or memfd (pread/pwrite, or mapped when
    sealed), a DRM device node (a render node at the BO's offset), a dmabuf."""
    mode = st.st_mode
    if stat.S_ISREG(mode):
        return None
    if stat.S_ISCHR(mode):
        return None if os.major(st.st_rdev) == DRM_MAJOR else \
            f"a character device ({os.major(st.st_rdev)}:{os.minor(st.st_rdev)}) that is not a DRM device"
    for test, kind in ((stat.S_ISFIFO, "a pipe or FIFO"), (stat.S_ISSOCK, "a socket"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISDIR, "a directory")):
        if test(mode):
            return kind
    if fs_type(fd) == DMA_BUF_MAGIC:
        return None
    return "an anonymous inode that is not a dmabuf (an eventfd, a timerfd, an epoll fd, ...)"


def cannot_shrink(fd: int) -> bool:
    """Whether fd is a memfd of shared memory (shmem) sealed against shrinking (F_SEAL_SHRINK): then no one,
    its owner included, can cut it short, and mapping it is as safe as mapping a dmabuf.  Any other file says
    EINVAL (no seals).  A huge-page memfd (MFD_HUGETLB, on hugetlbfs) takes the seal but is not mapped: its
    owner can still punch holes in it, and hugetlbfs has no zero page, so the next touch of a hole needs a
    huge page from a pool its owner can empty, and without one the kernel raises SIGBUS."""
    try:
        sealed = bool(fcntl.fcntl(fd, fcntl.F_GET_SEALS) & fcntl.F_SEAL_SHRINK)
    except OSError:
        return False
    return sealed and fs_type(fd) == TMPFS_MAGIC


class MmapBackend(ThreadedBackend):
    name = BackendKind.MMAP
    write_needs_rdwr = True  # a MAP_SHARED writable mapping needs O_RDWR

    def capabilities(self) -> Capabilities:
        return Capabilities(
            name=self.name, can_read=True, can_write=True, preferred_chunk=8 << 20,
            max_inflight=self.workers_per_gpu, asynchronous_dma=False,
            description="CPU mapping of a dmabuf / render-node / memfd fd (large BAR)",
        )

    def check(self, fd: int, direction: Direction, *, bo_id: int, checked: FdMemo | None = None) -> os.stat_result:
        """check_fd, then the kind of object: one a BO can be copied through (`unmappable_kind`), else
        BAD_DESCRIPTOR naming the BO."""
        st = super().check(fd, direction, bo_id=bo_id, checked=checked)
        kind = unmappable_kind(fd, st)
        if kind is not None:
            raise BadDescriptorError(f"BO {bo_id}'s fd is {kind}: the mmap backend copies through a dmabuf, a "
                                     "DRM render node, a memfd or a regular file", bo_id=bo_id)
        return st

    def open(self, bo_id: int, ref: BoRef, size: int, gpu_id: int, direction: Direction,
             checked: FdMemo | None = None) -> BoHandle:
        st = self.check(ref.fd, direction, bo_id=bo_id, checked=checked)
        have = fd_size(ref.fd, st)
        if have is not None and ref.offset + size > have:
            raise TargetTooSmallError(
                f"the fd of BO {bo_id} (gpu {gpu_id:#x}) holds {have} bytes; the BO needs {size} bytes at its "
                f"offset {ref.offset:#x}", bo_id=bo_id, offset=max(0, have - ref.offset),
            )
        by_fd = stat.S_ISREG(st.st_mode) and not cannot_shrink(ref.fd)
        lock = _WRITE_LOCKS[hash((st.st_dev, st.st_ino)) % len(_WRITE_LOCKS)] \
            if by_fd and direction is Direction.WRITE else None
        return _MappedBo(bo_id, ref, size, gpu_id, direction, by_fd=by_fd, write_lock=lock)

    def _map(self, h: _MappedBo) -> None:
        writing = h.direction is Direction.WRITE
        aligned = h.ref.offset - h.ref.offset % PAGE
        delta = h.ref.offset - aligned
        try:
            h.mm = mmap.mmap(h.ref.fd, delta + h.size, flags=mmap.MAP_SHARED,
                             prot=mmap.PROT_READ | (mmap.PROT_WRITE if writing else 0), offset=aligned)
        except (OSError, ValueError) as e:
            why = (e.strerror or str(e)) if isinstance(e, OSError) else str(e)
            raise BackendError(f"mmap of BO {h.bo_id} (gpu {h.gpu_id:#x}) at its fd's offset {aligned:#x}, "
                               f"{delta + h.size} bytes, failed: {why}", bo_id=h.bo_id, offset=0) from None
        h.anchor = pointer(h.mm, writable=writing)
        h.base = h.anchor + delta

    def endpoint(self, handle: BoHandle, bo_offset: int, length: int) -> tuple[int, int]:
        assert isinstance(handle, _MappedBo)
        h = handle
        if h.by_fd:
            return h.ref.fd, h.ref.offset + bo_offset
        with h.lock:
            if h.mm is None:
                self._map(h)
        start = h.base + bo_offset
        # prefault the window in one call (where unsupported, the copy faults pages in itself); a window the
        # kernel says cannot be faulted in is not touched, since touching it would raise SIGBUS
        lo = address(start) % PAGE
        err = populate(start - lo, lo + length, writing=h.direction is Direction.WRITE)
        if err:
            raise BackendError(f"BO {h.bo_id} (gpu {h.gpu_id:#x}): {length} bytes at {h.ref.offset + bo_offset:#x} of "
                               f"its fd's mapping cannot be faulted in: {os.strerror(err)}", bo_id=h.bo_id,
                               offset=bo_offset)
        return -1, address(start)

    def write_lock(self, handle: BoHandle) -> threading.Lock | None:
        assert isinstance(handle, _MappedBo)
        return handle.write_lock

    def copy_error(self, handle: BoHandle, bo_offset: int, err: int) -> BackendError:
        bo = f"BO {handle.bo_id} (gpu {handle.gpu_id:#x})"
        if err > 0:
            return BackendError(f"copy {'from' if handle.direction is Direction.READ else 'to'} {bo} at its fd's "
                                f"offset {handle.ref.offset + bo_offset:#x} failed: {os.strerror(err)}",
                                bo_id=handle.bo_id, offset=bo_offset)
        return TargetTooSmallError(f"the fd of {bo} ends at {handle.ref.offset + bo_offset:#x}, inside the BO: "
                                   f"it was truncated during the copy", bo_id=handle.bo_id, offset=bo_offset)

    def after_copy(self, handle: BoHandle, bo_offset: int, length: int) -> None:
        assert isinstance(handle, _MappedBo)
        if bo_offset == 0 and length == handle.size and handle.mm is not None:
            # A BO copied in one piece (every small BO) needs its mapping no longer:
            # unmap here, in the copy thread, not in the event loop at release.
            self._unmap(handle)

    def release(self, handle: BoHandle) -> None:
        assert isinstance(handle, _MappedBo)
        self._unmap(handle)

    @staticmethod
    def _unmap(h: _MappedBo) -> None:
        with h.lock:
            if h.mm is not None:
                ffi.release(h.anchor)
                h.anchor = h.base = None
                h.mm.close()
                h.mm = None
