"""/proc/<pid>/mem backend: the fallback that works for any mapped memory.

The caller opens /proc/<pid>/mem (O_RDONLY to dump, O_RDWR to restore) and
passes the fd; this backend never opens a /proc path itself.  Copies are
positional vectored I/O (preadv/pwritev) straight into staging buffers,
continued after short transfers.  A range with nothing mapped is reported
with the first address that failed.
"""
from __future__ import annotations

import errno
import mmap
import os

from ..errors import BackendError, UnmappedRangeError
from .base import BoHandle, Capabilities, Direction, ThreadedBackend

_PAGE = mmap.PAGESIZE


class ProcMemBackend(ThreadedBackend):
    name = "procmem"

    def capabilities(self) -> Capabilities:
        return Capabilities(
            name=self.name, can_read=True, can_write=True, preferred_chunk=8 << 20,
            max_inflight=self.workers_per_gpu, asynchronous_dma=False,
            description="process memory through a caller-opened /proc/<pid>/mem fd",
        )

    def open(self, bo_id, ref, size, gpu_id, direction, checked=None):
        self.check(ref.fd, direction, bo_id=bo_id, checked=checked)
        handle = BoHandle(bo_id, ref, size, gpu_id, direction)
        if size:
            # Fail fast, naming the address, if the range's ends are not mapped
            # (one probe when both ends are in one page: pages are mapped whole).
            self._probe(handle, 0)
            if (ref.offset + size - 1) // _PAGE != ref.offset // _PAGE:
                self._probe(handle, size - 1)
        return handle

    def _probe(self, handle: BoHandle, off: int) -> None:
        addr = handle.ref.offset + off
        try:
            got = os.pread(handle.ref.fd, 1, addr)
        except OSError as e:
            if e.errno == errno.EBADF:
                return  # write-only fd: the copy itself will report a bad address
            raise self._unmapped(handle, off, e) from None
        if not got:
            raise self._unmapped(handle, off, None)

    def _unmapped(self, handle: BoHandle, off: int, err: OSError | None) -> BackendError:
        addr = handle.ref.offset + off
        if err is None or err.errno in (errno.EIO, errno.EFAULT, errno.ENOMEM, errno.ESRCH):
            why = f" ({err.strerror})" if err else ""
            return UnmappedRangeError(
                f"nothing mapped at address {addr:#x} in the target process{why}",
                address=addr, bo_id=handle.bo_id, offset=off,
            )
        return BackendError(f"/proc/<pid>/mem access at {addr:#x} failed: {err.strerror}",
                            bo_id=handle.bo_id, offset=off)

    def _copy(self, handle, bo_offset, buf, buf_offset, length):
        fd, base = handle.ref.fd, handle.ref.offset + bo_offset
        view = buf.view[buf_offset:buf_offset + length]
        io = os.preadv if handle.direction is Direction.READ else os.pwritev
        done = 0
        try:
            while done < length:
                try:
                    n = io(fd, [view[done:]], base + done)
                except OSError as e:
                    raise self._unmapped(handle, bo_offset + done, e) from None
                if n == 0:
                    raise self._unmapped(handle, bo_offset + done, None)
                done += n
        finally:
            view.release()
