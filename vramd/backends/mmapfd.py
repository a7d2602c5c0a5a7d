"""mmap backend: the large-BAR path — map a caller-given fd, copy, unmap.

On AMD hardware the fd is a dmabuf (or render node at the BO's mmap
offset) of a CPU-visible BO; in tests it is a memfd or a regular file.
Each copy maps exactly the window it needs and unmaps it straight away.
The fd's size is checked up front, so a copy can never touch a page beyond
the end of the object (which would SIGBUS the whole daemon).  The copy is
libc memcpy through cffi, so it runs without the GIL.
"""
from __future__ import annotations

import mmap
import os
import stat

from ..errors import BackendError, TargetTooSmallError
from ..memops import copy_ptr, pointer
from .base import BoHandle, Capabilities, Direction, ThreadedBackend, check_fd

_PAGE = mmap.PAGESIZE


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


class MmapBackend(ThreadedBackend):
    name = "mmap"

    def capabilities(self) -> Capabilities:
        return Capabilities(
            name=self.name, can_read=True, can_write=True, preferred_chunk=8 << 20,
            max_inflight=self.workers_per_gpu, asynchronous_dma=False,
            description="CPU mapping of a dmabuf / render-node / memfd fd (large BAR)",
        )

    def open(self, bo_id, ref, size, gpu_id, direction):
        st = check_fd(ref.fd, direction, bo_id=bo_id)
        if direction is Direction.WRITE:
            import fcntl

            if fcntl.fcntl(ref.fd, fcntl.F_GETFL) & os.O_ACCMODE != os.O_RDWR:
                from ..errors import BadDescriptorError

                raise BadDescriptorError(f"fd {ref.fd} must be open read-write to map it for writing", bo_id=bo_id)
        have = fd_size(ref.fd, st)
        if have is not None and ref.offset + size > have:
            raise TargetTooSmallError(
                f"fd {ref.fd} holds {have} bytes; the BO needs {size} bytes at offset {ref.offset:#x}",
                bo_id=bo_id, offset=max(0, have - ref.offset),
            )
        return BoHandle(bo_id, ref, size, gpu_id, direction)

    def _copy(self, handle, bo_offset, buf, buf_offset, length):
        writing = handle.direction is Direction.WRITE
        start = handle.ref.offset + bo_offset
        aligned = start - start % _PAGE
        delta = start - aligned
        prot = mmap.PROT_READ | (mmap.PROT_WRITE if writing else 0)
        try:
            mm = mmap.mmap(handle.ref.fd, delta + length, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE,
                           prot=prot, offset=aligned)
        except (OSError, ValueError) as e:
            raise BackendError(f"mmap of fd {handle.ref.fd} at {aligned:#x}+{delta + length} failed: {e}",
                               bo_id=handle.bo_id, offset=bo_offset) from None
        try:
            with pointer(mm, writable=writing) as m:
                if writing:
                    copy_ptr(m + delta, buf.ptr + buf_offset, length)
                else:
                    copy_ptr(buf.ptr + buf_offset, m + delta, length)
        finally:
            mm.close()
