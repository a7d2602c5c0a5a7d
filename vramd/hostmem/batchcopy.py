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
Otherwise the same loop runs here in Python (`NATIVE` is False, or
native.python_only() holds): os.preadv / os.pwritev and libc memcpy release the
GIL, the zero scan and xxh3 hold it.  Both give identical results; the tests run
both.
"""
from __future__ import annotations

import errno
import functools
import os
import struct
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, NamedTuple

import xxhash

from . import native
from .libc import ffi as libc_ffi
from .libc import is_zero_ptr, libc

NATIVE: bool = native.BUILT

HASH, ZERO, RECORD = 1, 2, 4
WHOLE = 8  # move each copy in one call, not BLOCK at a time: reads that wait on a device (the C loop; Python always)
BLOCK = 256 << 10  # the C loop's block: moved, then hashed while still in this core's L2 cache
RECORD_PREFIX = 16  # a chunk record's prefix: magic (4), header length (u32 LE), header checksum (8)
MAX_CHUNK_HEADER = 256
END_OF_FILE = -1  # Outcome.err when the fd ended (a read or write of 0 bytes)


class Copy(NamedTuple):
    """One copy: from `src` to `dst`; each is a file offset of `src_fd`/`dst_fd`, or an address when that is -1
    (a named tuple: one is made per piece of every batch)."""

    src_fd: int
    src: int
    dst_fd: int
    dst: int
    length: int
    rec_at: int = 0   # RECORD: where the record starts within the moved bytes
    rec_len: int = 0  # RECORD: its length


class Outcome(NamedTuple):
    """What became of one copy: struct vd_copy as the C loop left it, its inputs first (a named tuple made
    straight from the unpacked struct: one per copy of every batch)."""

    src_fd: int
    dst_fd: int
    src: int
    dst: int
    length: int
    rec_at: int
    rec_len: int
    hash: int        # HASH: xxh3-64 of the bytes (RECORD: of the record's payload)
    done: int        # bytes moved (< length only when err is set)
    payload_at: int  # RECORD: where the payload starts within the moved bytes (0: not a record)
    err: int         # 0, an errno, or END_OF_FILE
    zero: int        # ZERO: 1 where every byte was 0


_as_outcome = functools.partial(tuple.__new__, Outcome)  # an unpacked struct as an Outcome (Outcome._make, in C)


def _outcome(c: Copy, done: int, err: int = 0, digest: int = 0, zero: bool = False, payload_at: int = 0) -> Outcome:
    return Outcome(c.src_fd, c.dst_fd, c.src, c.dst, c.length, c.rec_at, c.rec_len, digest, done, payload_at, err,
                   int(zero))


def copy_batch(copies: Sequence[Copy], flags: int = 0) -> tuple[list[Outcome], int]:
    """Run `copies` in order; returns each one's outcome and the index of the failed one (-1: none).

    Copies after a failed one are not run (their outcome says done=0).
    """
    if _interceptors:
        return _interceptors[-1](copies, flags, _run)
    return _run(copies, flags)


def _run(copies: Sequence[Copy], flags: int = 0) -> tuple[list[Outcome], int]:
    mod = native.module()
    if mod is not None and copies:
        return _native(mod, copies, flags)
    return _python(copies, flags)


# --- the tests' seam: every batch seen, and changed, on its way ---------------

Run = Callable[[Sequence[Copy], int], tuple[list[Outcome], int]]
Interceptor = Callable[[Sequence[Copy], int, Run], tuple[list[Outcome], int]]
_interceptors: list[Interceptor] = []


@contextmanager
def intercepted(fn: Interceptor) -> Iterator[None]:
    """While held, each `copy_batch(copies, flags)` in this process, in whatever thread, returns
    `fn(copies, flags, run)`, where `run(copies, flags)` does the batch as it would have been done: `fn` may
    watch it (the calling thread, the flags), hold it, or change what it reports (an injected fault).  Only
    the innermost one runs.  vramd.testing.intercept_copies; nothing else holds it."""
    _interceptors.append(fn)
    try:
        yield
    finally:
        _interceptors.remove(fn)


def xxh3(address: int, n: int) -> int:
    """xxh3-64 of n bytes at an address (without the GIL where the C module is present)."""
    mod = native.module()
    if mod is not None:
        return int(mod.lib.vd_xxh3(address, n))
    return xxhash.xxh3_64_intdigest(_memory(address, n))


# struct vd_copy (native/copy/vd_copy.h) as the struct module packs it: in, src_fd dst_fd src dst length rec_at
# rec_len; out, hash done payload_at err zero.  A batch's copies are packed with it and their outcomes read back
# with iter_unpack, instead of setting and getting each field through cffi: a batch of 10,000 one-byte probes
# took 2.26 us of CPU per copy against 3.19, the pread included (what a restore of 10,000 small BOs pays twice).
_VD_COPY = struct.Struct("=iiQQQQQQQQii")
_VD_FIELDS = Outcome._fields  # struct vd_copy's fields in order (checked against the module's struct below)


def _check_layout(ffi: Any) -> None:
    """The module's struct vd_copy is the one _VD_COPY packs (a build from another header fails here, loudly)."""
    offsets, at = [], 0
    for code in _VD_COPY.format.lstrip("="):
        offsets.append(at)
        at += struct.calcsize("=" + code)
    got = [ffi.offsetof("struct vd_copy", f) for f in _VD_FIELDS]
    if ffi.sizeof("struct vd_copy") != _VD_COPY.size or got != offsets:
        raise ImportError(f"vramd.hostmem._copy: struct vd_copy is {ffi.sizeof('struct vd_copy')} bytes with "
                          f"fields at {got}; this module packs {_VD_COPY.size} bytes at {offsets}")


if native.built() is not None:
    _check_layout(native.built().ffi)


def _native(mod: Any, copies: Sequence[Copy], flags: int) -> tuple[list[Outcome], int]:
    n = len(copies)
    pack = _VD_COPY.pack
    # writable (the outcomes land in it), joined in one copy
    raw = bytearray().join([pack(src_fd, dst_fd, src, dst, length, rec_at, rec_len, 0, 0, 0, 0, 0)
                            for src_fd, src, dst_fd, dst, length, rec_at, rec_len in copies])
    arr = mod.ffi.from_buffer("struct vd_copy[]", raw)
    failed = int(mod.lib.vd_copy_batch(arr, n, flags))  # cffi releases the GIL around the call
    with memoryview(raw) as view:
        out = list(map(_as_outcome, _VD_COPY.iter_unpack(view)))  # the copies not run: done 0, err 0
    return out, failed


def _memory(address: int, n: int) -> memoryview:
    return memoryview(libc_ffi.buffer(libc_ffi.cast("char *", address), n))


def _python(copies: Sequence[Copy], flags: int) -> tuple[list[Outcome], int]:
    out: list[Outcome] = []
    failed = -1
    for i, c in enumerate(copies):
        if failed >= 0:
            out.append(_outcome(c, 0))
            continue
        o = _one(c, flags)
        out.append(o)
        if o.err:
            failed = i
    return out, failed


def _one(c: Copy, flags: int) -> Outcome:
    if c.src_fd >= 0 and c.dst_fd >= 0:
        return _outcome(c, 0, errno.EINVAL)
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
    zero = bool(flags & ZERO) and is_zero_ptr(libc_ffi.cast("char *", mem_addr), done)
    if flags & HASH:
        lo, hi = 0, done
        if flags & RECORD:
            hi = min(c.rec_at + c.rec_len, c.length) if c.rec_at + c.rec_len >= c.rec_at else c.length
            if done < c.rec_at + RECORD_PREFIX:
                return _outcome(c, done, err, zero=zero)
            hlen = int.from_bytes(mem[c.rec_at + 4:c.rec_at + 8], "little")
            lo = c.rec_at + RECORD_PREFIX + hlen
            if hlen > MAX_CHUNK_HEADER or lo > hi:
                return _outcome(c, done, err, zero=zero)
            return _outcome(c, done, err, xxhash.xxh3_64_intdigest(mem[lo:min(hi, done)]), zero, lo)
        return _outcome(c, done, err, xxhash.xxh3_64_intdigest(mem[lo:min(hi, done)]), zero)
    return _outcome(c, done, err, zero=zero)


def xor_into(dest: memoryview, src: memoryview | bytes) -> None:
    """dest[i] ^= src[i] for every byte (a delta record's bytes against its base chunk)."""
    n = len(dest)
    if len(src) != n:
        raise ValueError(f"xor of {n} bytes with {len(src)}")
    mod = native.module()
    if mod is not None:
        mod.lib.vd_xor(mod.ffi.from_buffer(dest), mod.ffi.from_buffer(src), n)
        return
    x = int.from_bytes(dest, "little") ^ int.from_bytes(src, "little")
    dest[:] = x.to_bytes(n, "little")
