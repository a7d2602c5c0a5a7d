"""The one libc binding: bulk memory primitives that run without holding the GIL.

libc's memcpy/memcmp/madvise/mmap are called through cffi in ABI mode (no
compiler needed); cffi releases the GIL around every C call, so copies and
zero scans in worker threads overlap with the event loop and with each
other.  Measured here: memcmp-based zero scan 34 GB/s and memcpy 19 GB/s
per core, where `memoryview == memoryview` manages 1.3 GB/s holding the GIL.
"""
from __future__ import annotations

import errno
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import cffi

from ..units import PAGE

ffi = cffi.FFI()
ffi.cdef(
    """
    void *memcpy(void *dest, const void *src, size_t n);
    void *memset(void *s, int c, size_t n);
    int memcmp(const void *s1, const void *s2, size_t n);
    int madvise(void *addr, size_t length, int advice);
    void *mmap(void *addr, size_t length, int prot, int flags, int fd, long offset);
    int munmap(void *addr, size_t length);
    int sync_file_range(int fd, long offset, long nbytes, unsigned int flags);
    int mincore(void *addr, size_t length, unsigned char *vec);
    int fstatfs(int fd, void *buf);
    long syscall(long number, ...);
    struct vd_cachestat_range { uint64_t off; uint64_t len; };
    struct vd_cachestat { uint64_t nr_cache, nr_dirty, nr_writeback, nr_evicted, nr_recently_evicted; };
    """
)
libc: Any = ffi.dlopen(None)

MADV_POPULATE_READ, MADV_POPULATE_WRITE = 22, 23  # Linux 5.14+
PROT_READ, PROT_WRITE = 0x1, 0x2
MAP_PRIVATE, MAP_ANONYMOUS, MAP_FIXED_NOREPLACE, MAP_NORESERVE = 0x02, 0x20, 0x100000, 0x4000
MAP_FAILED: Any = ffi.cast("void *", -1)
SYNC_FILE_RANGE_WRITE = 0x2  # start writeback of the range's dirty pages; wait for nothing
PROT_NONE, MAP_SHARED = 0x0, 0x01
SYS_CACHESTAT = 451  # Linux 6.5+, the same number on every architecture (new system calls share one table)
TMPFS_MAGIC, RAMFS_MAGIC = 0x01021994, 0x858458F6
EHWPOISON = 133  # a memory error hit the page (Linux; Python's errno module has no name for it)
MEMORY_FS = (TMPFS_MAGIC, RAMFS_MAGIC)  # file systems whose files are memory

# A cdata char* (cffi has no finer static type for it).
Pointer = Any


def pointer(buf: Any, writable: bool = False) -> Pointer:
    """A cdata char* over a buffer; release it (or use `with`) before closing an mmap."""
    return ffi.from_buffer("char[]", buf, require_writable=writable)  # type: ignore[call-overload]


def address(p: Pointer) -> int:
    """The numeric address of a cdata pointer."""
    return int(ffi.cast("uintptr_t", p))


def is_zero_ptr(p: Pointer, n: int) -> bool:
    """True if the n bytes at cdata pointer p are all zero."""
    if n == 0:
        return True
    # p[0] == 0 and every byte equals its successor  =>  all bytes are zero.
    return bool(p[0] == b"\0" and (n == 1 or libc.memcmp(p, p + 1, n - 1) == 0))


def copy_ptr(dst: Pointer, src: Pointer, n: int) -> None:
    """memcpy between cdata pointers (GIL released)."""
    if n:
        libc.memcpy(dst, src, n)


def populate(p: Pointer, length: int, *, writing: bool) -> int:
    """Prefault `length` bytes at p in one call: 0, or why the range cannot be faulted in (EFAULT: touching
    it would raise SIGBUS; ENOMEM: no memory for it).  Where the kernel cannot prefault (EINVAL, before Linux
    5.14) or was interrupted, 0: the copy faults pages in itself."""
    if libc.madvise(p, length, MADV_POPULATE_WRITE if writing else MADV_POPULATE_READ) == 0:
        return 0
    err: int = ffi.errno
    return err if err in (errno.EFAULT, errno.ENOMEM, EHWPOISON) else 0


_cachestat = [True]  # cleared where the kernel has no cachestat (ENOSYS): mincore then
_mincore_only = [0]  # mincore_only() blocks now open


def has_cachestat() -> bool:
    """Whether this kernel answers cachestat(2) (Linux 6.5+; asked once, with no file: EBADF, not ENOSYS)."""
    if _cachestat[0]:
        rng = ffi.new("struct vd_cachestat_range *", (0, PAGE))
        out: Any = ffi.new("struct vd_cachestat *")
        if libc.syscall(ffi.cast("long", SYS_CACHESTAT), ffi.cast("int", -1), rng, out, ffi.cast("unsigned int", 0)) \
                != 0 and ffi.errno == errno.ENOSYS:
            _cachestat[0] = False
    return _cachestat[0]


@contextmanager
def mincore_only() -> Iterator[None]:
    """While held, `cached_pages` asks mincore(2) as on a kernel without cachestat (the tests run both ways:
    vramd.testing.mincore_only; nothing else holds it)."""
    _mincore_only[0] += 1
    try:
        yield
    finally:
        _mincore_only[0] -= 1


def cached_pages(fd: int, offset: int, length: int) -> int | None:
    """How many of the pages of [offset, offset + length) of the file behind fd the page cache holds, asked
    without reading anything: cachestat(2) where the kernel has it (Linux 6.5+), else mincore(2) on a
    mapping of the range made for the question (PROT_NONE, never touched: no fault, no read) and unmapped
    at once.  None where neither can tell.

    Not a one-byte preadv2(RWF_NOWAIT) probe: where it misses, the kernel starts readahead before it
    answers EAGAIN, so asking again finds pages the question itself brought in (measured: most records of a
    cold restore were then read through the page cache, and their bytes were read from the disk twice)."""
    if length <= 0:
        return 0
    first = offset - offset % PAGE
    span = offset + length - first
    if _cachestat[0] and not _mincore_only[0]:
        rng = ffi.new("struct vd_cachestat_range *", (first, span))
        out: Any = ffi.new("struct vd_cachestat *")
        flags = ffi.cast("unsigned int", 0)
        if libc.syscall(ffi.cast("long", SYS_CACHESTAT), ffi.cast("int", fd), rng, out, flags) == 0:
            return int(out.nr_cache)
        if ffi.errno != errno.ENOSYS:
            return None
        _cachestat[0] = False
    p = libc.mmap(ffi.NULL, span, PROT_NONE, MAP_SHARED, fd, first)
    if p == MAP_FAILED:
        return None
    try:
        vec = ffi.new("unsigned char[]", -(-span // PAGE))
        if libc.mincore(p, span, vec) != 0:
            return None
        resident: bytes = ffi.buffer(vec)[:]  # a byte a page: bit 0 set where resident, other bits reserved (0)
        return len(resident) - resident.count(0)
    finally:
        libc.munmap(p, span)


def fs_type(fd: int) -> int | None:
    """The magic number of the file system behind fd (fstatfs(2)'s f_type, the first field of struct statfs,
    a long on 64-bit Linux); None where fstatfs fails."""
    buf = ffi.new("long[32]")  # struct statfs is 120 bytes on x86-64 and arm64
    return int(buf[0]) & 0xFFFFFFFF if libc.fstatfs(fd, buf) == 0 else None


def memory_file(fd: int) -> bool:
    """Whether the file behind fd lives on a file system whose files are memory (tmpfs, ramfs): reading it
    waits on no device."""
    return fs_type(fd) in MEMORY_FS
