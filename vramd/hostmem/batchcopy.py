"""The CPU copy loop of a batch: copy, zero scan and checksum in one call, without the GIL.

A `Copy` moves `length` bytes between a BO end and a staging buffer.  Each
end is either an fd (read with pread / written with pwrite at a file offset:
`/proc/<pid>/mem`, a memfd, an image data file) or memory (an address: a
staging buffer, a mapped dmabuf).  `copy_batch` runs a batch's copies one
after another, stops at the first that fails, and reports for each copy how
far it got, why it stopped, whether its bytes are all zero (`ZERO`) and their
xxh3-64 (`HASH`; with `RECORD`: the xxh3-64 of the chunk record's payload
held in the bytes).  The bytes are hashed block by block right after they
moved, while they are still in the CPU cache, so the checksum costs no
second trip through memory.

Where vramd.hostmem._copy (native/copy/, a cffi API-mode module built at
install time) is present, the whole batch is one C call that holds no GIL.
Otherwise the same loop runs here in Python (`NATIVE` is False): os.preadv /
os.pwritev and libc memcpy release the GIL, the zero scan and xxh3 hold it.
Both give identical results; the tests run both.
"""
from __future__ import annotations

import errno
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import xxhash

from .libc import ffi as libc_ffi
from .libc import is_zero_ptr, libc

try:
    from . import _copy  # type: ignore[attr-defined]  # built by native/copy_build.py
except ImportError:  # no compiler or no <xxhash.h> at install time
    _copy = None

NATIVE: bool = _copy is not None

HASH, ZERO, RECORD = 1, 2, 4
BLOCK = 256 << 10  # the C loop's block: moved, then hashed while still in this core's L2 cache
RECORD_PREFIX = 16  # a chunk record's prefix: magic (4), header length (u32 LE), header checksum (8)
MAX_CHUNK_HEADER = 256
END_OF_FILE = -1  # Outcome.err when the fd ended (a read or write of 0 bytes)


@dataclass(slots=True)
class Copy:
    """One copy: from `src` to `dst`; each is a file offset of `src_fd`/`dst_fd`, or an address when that is -1."""

    src_fd: int
    src: int
    dst_fd: int
    dst: int
    length: int
    rec_at: int = 0   # RECORD: where the record starts within the moved bytes
    rec_len: int = 0  # RECORD: its length


@dataclass(slots=True)
class Outcome:
    done: int            # bytes moved (< length only when err is set)
    err: int = 0         # 0, an errno, or END_OF_FILE
    hash: int = 0        # HASH: xxh3-64 of the bytes (RECORD: of the record's payload)
    zero: bool = False   # ZERO: every byte was 0
    payload_at: int = 0  # RECORD: where the payload starts within the moved bytes (0: not a record)


def copy_batch(copies: Sequence[Copy], flags: int = 0) -> tuple[list[Outcome], int]:
    """Run `copies` in order; returns each one's outcome and the index of the failed one (-1: none).

    Copies after a failed one are not run (their outcome says done=0).
    """
    if _copy is not None and copies:
        return _native(copies, flags)
    return _python(copies, flags)


def xxh3(address: int, n: int) -> int:
    """xxh3-64 of n bytes at an address (without the GIL where the C module is present)."""
    if _copy is not None:
        return int(_copy.lib.vd_xxh3(address, n))
    return xxhash.xxh3_64_intdigest(_memory(address, n))


def _native(copies: Sequence[Copy], flags: int) -> tuple[list[Outcome], int]:
    n = len(copies)
    arr: Any = _copy.ffi.new("struct vd_copy[]", n)
    for i, c in enumerate(copies):
        a = arr[i]
        a.src_fd, a.src, a.dst_fd, a.dst, a.length = c.src_fd, c.src, c.dst_fd, c.dst, c.length
        a.rec_at, a.rec_len = c.rec_at, c.rec_len
    failed = int(_copy.lib.vd_copy_batch(arr, n, flags))  # cffi releases the GIL around the call
    last = n if failed < 0 else failed + 1
    out = [Outcome(a.done, a.err, a.hash, bool(a.zero), a.payload_at) for a in (arr[i] for i in range(last))]
    out += [Outcome(0) for _ in range(last, n)]
    return out, failed


def _memory(address: int, n: int) -> memoryview:
    return memoryview(libc_ffi.buffer(libc_ffi.cast("char *", address), n))


def _python(copies: Sequence[Copy], flags: int) -> tuple[list[Outcome], int]:
    out: list[Outcome] = []
    failed = -1
    for i, c in enumerate(copies):
        if failed >= 0:
            out.append(Outcome(0))
            continue
        o = _one(c, flags)
        out.append(o)
        if o.err:
            failed = i
    return out, failed


def _one(c: Copy, flags: int) -> Outcome:
    if c.src_fd >= 0 and c.dst_fd >= 0:
        return Outcome(0, errno.EINVAL)
    mem_addr = c.src if c.dst_fd >= 0 else c.dst
    mem = _memory(mem_addr, c.length) if c.length else memoryview(b"")
    done, err = 0, 0
    while done < c.length:
        try:
            if c.src_fd >= 0:
                n = os.preadv(c.src_fd, [mem[done:]], c.src + done)
            elif c.dst_fd >= 0:
                n = os.pwritev(c.dst_fd, [mem[done:]], c.dst + done)
            else:
                libc.memcpy(libc_ffi.cast("char *", c.dst + done), libc_ffi.cast("char *", c.src + done),
                            c.length - done)
                n = c.length - done
        except OSError as e:
            err = e.errno or errno.EIO
            break
        if n == 0:
            err = END_OF_FILE
            break
        done += n
    o = Outcome(done, err)
    if flags & ZERO:
        o.zero = is_zero_ptr(libc_ffi.cast("char *", mem_addr), done)
    if flags & HASH:
        lo, hi = 0, done
        if flags & RECORD:
            hi = min(c.rec_at + c.rec_len, c.length) if c.rec_at + c.rec_len >= c.rec_at else c.length
            if done < c.rec_at + RECORD_PREFIX:
                return o
            hlen = int.from_bytes(mem[c.rec_at + 4:c.rec_at + 8], "little")
            lo = c.rec_at + RECORD_PREFIX + hlen
            if hlen > MAX_CHUNK_HEADER or lo > hi:
                return o
            o.payload_at = lo
        o.hash = xxhash.xxh3_64_intdigest(mem[lo:min(hi, done)])
    return o


def xor_into(dest: memoryview, src: memoryview | bytes) -> None:
    """dest[i] ^= src[i] for every byte (a delta record's bytes against its base chunk)."""
    n = len(dest)
    if len(src) != n:
        raise ValueError(f"xor of {n} bytes with {len(src)}")
    if _copy is not None:
        _copy.lib.vd_xor(_copy.ffi.from_buffer(dest), _copy.ffi.from_buffer(src), n)
        return
    x = int.from_bytes(dest, "little") ^ int.from_bytes(src, "little")
    dest[:] = x.to_bytes(n, "little")
