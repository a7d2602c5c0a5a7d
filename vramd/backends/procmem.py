"""/proc/<pid>/mem backend: the fallback that works for any mapped memory.

The caller opens /proc/<pid>/mem (O_RDONLY to dump, O_RDWR to restore) and
passes the fd; this backend never opens a /proc path itself.  Copies are
positional I/O (pread/pwrite, vramd.hostmem.batchcopy) straight into staging
buffers, continued after short transfers.  A range with nothing mapped is reported
with the first address that failed.
"""
from __future__ import annotations

import errno
import os
from collections.abc import Sequence

from ..errors import BackendError, UnmappedRangeError, VramdError
from ..hostmem.batchcopy import Copy, copy_batch
from ..hostmem.libc import ffi as libc_ffi
from ..units import PAGE
from .base import BoHandle, BoRef, Capabilities, Direction, FdMemo, OpenItem
from .kind import BackendKind
from .threaded import ThreadedBackend


class ProcMemBackend(ThreadedBackend):
    name = BackendKind.PROCMEM

    def capabilities(self) -> Capabilities:
        return Capabilities(
            name=self.name, can_read=True, can_write=True, preferred_chunk=8 << 20,
            max_inflight=self.workers_per_gpu, asynchronous_dma=False,
            description="process memory through a caller-opened /proc/<pid>/mem fd",
        )

    def identity(self, handle: BoHandle) -> None:
        """None: a range of a process's memory is not a buffer a dump takes for another BO's (never aliased)."""
        return None

    def open(self, bo_id: int, ref: BoRef, size: int, gpu_id: int, direction: Direction,
             checked: FdMemo | None = None) -> BoHandle:
        self.check(ref.fd, direction, bo_id=bo_id, checked=checked)
        handle = BoHandle(bo_id, ref, size, gpu_id, direction)
        if size:
            # Fail fast, naming the address, if the range's ends are not mapped
            # (one probe when both ends are in one page: pages are mapped whole).
            self._probe(handle, 0)
            if (ref.offset + size - 1) // PAGE != ref.offset // PAGE:
                self._probe(handle, size - 1)
        return handle

    def open_many(self, items: Sequence[OpenItem], direction: Direction,
                  checked: FdMemo | None = None) -> list[BoHandle]:
        """`open` of many BOs with their range probes in one batchcopy call (one GIL release, not one
        per probe).  A BO whose probes that call did not all pass (unmapped, a write-only fd, or
        after one that failed) is opened by `open` itself, which probes again and raises its error."""
        memo: FdMemo = checked if checked is not None else {}
        probes: list[Copy] = []
        ends: list[int] = []  # per BO: the number of probes planned up to and including its own
        scratch = libc_ffi.new("char[]", 1)  # every probe's byte lands here
        dst = int(libc_ffi.cast("uintptr_t", scratch))
        fd = -1  # the fd checked last: the BOs of one add are mostly ranges of one process's memory
        for bo_id, ref, size, _gpu in items:
            if ref.fd != fd:
                try:
                    self.check(ref.fd, direction, bo_id=bo_id, checked=memo)
                except VramdError:
                    break  # `open` reports it, in order; nothing from here on is probed
                fd = ref.fd
            if size:
                at = ref.offset
                probes.append(Copy(fd, at, -1, dst, 1))
                if (at + size - 1) // PAGE != at // PAGE:
                    probes.append(Copy(fd, at + size - 1, -1, dst, 1))
            ends.append(len(probes))
        passed = len(probes)
        if probes:
            _, failed = copy_batch(probes)
            if failed >= 0:
                passed = failed
        handles: list[BoHandle] = []
        try:
            for i, (bo_id, ref, size, gpu_id) in enumerate(items):
                if i < len(ends) and ends[i] <= passed:  # its fd checked, its ends probed: mapped
                    handles.append(BoHandle(bo_id, ref, size, gpu_id, direction))
                else:
                    handles.append(self.open(bo_id, ref, size, gpu_id, direction, checked=memo))
        except BaseException:
            for h in handles:
                self.release(h)
            raise
        return handles

    def _probe(self, handle: BoHandle, off: int) -> None:
        addr = handle.ref.offset + off
        try:
            got = os.pread(handle.ref.fd, 1, addr)
        except OSError as e:
            if e.errno == errno.EBADF:
                return  # write-only fd: the copy itself will report a bad address
            raise self._unmapped(handle, self._first_unmapped(handle, off), e) from None
        if not got:
            raise self._unmapped(handle, self._first_unmapped(handle, off), None)

    @staticmethod
    def _first_unmapped(handle: BoHandle, off: int) -> int:
        """The BO offset of the first unmapped byte, knowing that byte `off` is unmapped: the error names
        where the hole starts, not the probe that found it.  Only on the error path: the bytes before `off`
        are read in blocks, and a read of /proc/<pid>/mem stops short at the first page it cannot reach."""
        fd, base = handle.ref.fd, handle.ref.offset
        buf = bytearray(min(off, 1 << 20))
        pos = 0
        while pos < off:
            view = memoryview(buf)[:min(len(buf), off - pos)]
            try:
                n = os.preadv(fd, [view], base + pos)
            except OSError:
                return pos
            if n < len(view):
                return pos + n
            pos += n
        return off

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

    def endpoint(self, handle: BoHandle, bo_offset: int, length: int) -> tuple[int, int]:
        return handle.ref.fd, handle.ref.offset + bo_offset

    def copy_error(self, handle: BoHandle, bo_offset: int, err: int) -> BackendError:
        return self._unmapped(handle, bo_offset, OSError(err, os.strerror(err)) if err > 0 else None)
