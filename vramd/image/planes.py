"""The byte-plane ("planes") codec: a float-aware transform in front of one zstd frame.

GPU buffers are mostly arrays of 2- or 4-byte numbers (bf16/fp16, fp32).  Read as
little-endian words, the high byte of each holds the sign and the exponent, which
vary little across a tensor; the low bytes are mantissa bits that look random.
Interleaved, zstd sees the noisy bytes between the regular ones and finds few
matches.  `split_planes` regroups a chunk as `word` byte planes (every word's byte 0,
then every word's byte 1, ...), so the exponent bytes sit together as one long,
low-entropy run that zstd's entropy coder shrinks well, while the mantissa planes
cost about what they did.  docs/codecs.md has the measured ratios.

A planes payload is ONE standard zstd frame (content size and content checksum
written) whose content is the planes, not the raw bytes: decoding it is zstd, then
`merge_planes`.  The word size is not in the payload: the chunk's codec says it.

The transform runs in C (vd_planes_split / vd_planes_merge in native/copy/, part of
the cffi module vramd.hostmem._copy, called without the GIL) where that module is
built; otherwise in Python with extended slicing (C speed in CPython, but an extra
copy).  `NATIVE` says whether it is built (hostmem.native.python_only() sets it
aside); both give identical bytes, and the tests run both.
Pure functions, no I/O.
"""
from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import zstandard

from ..errors import CorruptChunkError
from ..hostmem import native

# an older build of the module has no planes functions
NATIVE: bool = native.built() is not None and hasattr(native.built().lib, "vd_planes_split")


def _native() -> Any:
    """The C module where it has the planes functions and is not set aside (native.python_only), else None."""
    return native.module() if NATIVE else None

WORDS = (2, 4)  # the word sizes the codec knows: 16-bit (bf16, fp16) and 32-bit (fp32) numbers

Buffer = bytes | bytearray | memoryview


def _check_word(word: int) -> None:
    if word not in WORDS:
        raise ValueError(f"planes word size must be 2 or 4, not {word!r}")


def _bytes_view(b: Buffer) -> memoryview:
    """A flat, unsigned-byte view of `b` (a memoryview of any format or shape is recast)."""
    m = memoryview(b)
    if m.format != "B" or m.ndim != 1:
        m = m.cast("B")
    if not m.c_contiguous:
        raise ValueError("planes: buffer is not contiguous")
    return m


def _pair(src: Buffer, word: int, dest: memoryview) -> tuple[memoryview, memoryview]:
    """Byte views of a transform's source and destination, checked: a word size of 2 or 4, a writable
    destination of the source's length."""
    _check_word(word)
    s, d = _bytes_view(src), _bytes_view(dest)
    if len(d) != len(s):
        raise ValueError(f"planes: destination holds {len(d)} bytes, source {len(s)}")
    if d.readonly:
        raise ValueError("planes: destination is read-only")
    return s, d


def split_into(src: Buffer, word: int, dest: memoryview) -> None:
    """Write the planes of `src` into `dest` (writable, exactly len(src) bytes; must not overlap `src`)."""
    s, d = _pair(src, word, dest)
    n = len(s)
    if not n:
        return
    mod = _native()
    if mod is not None:
        mod.lib.vd_planes_split(mod.ffi.from_buffer("uint8_t[]", s), mod.ffi.from_buffer("uint8_t[]", d), n, word)
        return
    w = n // word
    body = bytes(s[:w * word])
    for k in range(word):
        d[k * w:(k + 1) * w] = body[k::word]
    d[w * word:] = s[w * word:]


def merge_into(planes: Buffer, word: int, dest: memoryview) -> None:
    """Inverse of split_into: write the words whose planes are `planes` into `dest` (exactly len(planes) bytes)."""
    s, d = _pair(planes, word, dest)
    n = len(s)
    if not n:
        return
    mod = _native()
    if mod is not None:
        mod.lib.vd_planes_merge(mod.ffi.from_buffer("uint8_t[]", s), mod.ffi.from_buffer("uint8_t[]", d), n, word)
        return
    w = n // word
    out = bytearray(w * word)
    for k in range(word):
        out[k::word] = s[k * w:(k + 1) * w]
    d[:w * word] = out
    d[w * word:] = s[w * word:]


def split_planes(src: Buffer, word: int) -> bytes:
    """The chunk `src` as `word` byte planes (word 2 or 4), any trailing len % word bytes appended unchanged."""
    out = bytearray(len(src) if not isinstance(src, memoryview) else src.nbytes)
    split_into(src, word, memoryview(out))
    return bytes(out)


def merge_planes(planes: Buffer, word: int, dest: memoryview) -> None:
    """Inverse of split_planes: write the original bytes into `dest` (writable, exactly len(planes) bytes)."""
    merge_into(planes, word, dest)


# --- the codec: planes, then one zstd frame -----------------------------------

_local = threading.local()  # zstd contexts are not thread-safe: one per thread (and level); so is the scratch


def zstd_compressor(level: int) -> zstandard.ZstdCompressor:
    """This thread's zstd compressor for `level` (checksum and content size in every frame)."""
    cache: dict[int, zstandard.ZstdCompressor] | None = getattr(_local, "cctx", None)
    if cache is None:
        cache = _local.cctx = {}
    c = cache.get(level)
    if c is None:
        c = cache[level] = zstandard.ZstdCompressor(level=level, write_checksum=True, write_content_size=True)
    return c


def zstd_decompressor() -> zstandard.ZstdDecompressor:
    """This thread's zstd decompressor."""
    d: zstandard.ZstdDecompressor | None = getattr(_local, "dctx", None)
    if d is None:
        d = _local.dctx = zstandard.ZstdDecompressor()
    return d


def _scratch(n: int) -> memoryview:
    """This thread's reusable buffer, at least n bytes: a view of its first n (no page faults per chunk)."""
    buf: bytearray | None = getattr(_local, "scratch", None)
    if buf is None or len(buf) < n:
        buf = _local.scratch = bytearray(n)
    return memoryview(buf)[:n]


def compress_planes(src: memoryview, word: int, level: int) -> bytes:
    """One zstd frame (content size, content checksum) of the `word` byte planes of `src`."""
    s = _bytes_view(src)
    scratch = _scratch(len(s))
    try:
        split_into(s, word, scratch)
        return zstd_compressor(level).compress(scratch)
    finally:
        scratch.release()


def compress_zstd(src: Buffer, level: int) -> bytes:
    """One plain zstd frame (content size, content checksum) of `src`, as codec.py writes them."""
    return zstd_compressor(level).compress(src)


def zstd_frame_length(p: memoryview) -> int:
    """The length of the zstd frame at the start of `p` (its header, blocks and checksum); -1: cut short.

    zstd's streaming decoder accepts a frame whose 4-byte content checksum is
    missing or cut short (it sees no more input and stops), so the length is
    walked here, block header by block header (64 of them in an 8 MiB chunk), as
    ZSTD_findFrameCompressedSize does.  A header too short to read (an empty payload) is cut short too.
    """
    try:
        at = zstandard.frame_header_size(p)
    except zstandard.ZstdError:
        return -1
    while True:
        if at + 3 > len(p):
            return -1
        block = p[at] | p[at + 1] << 8 | p[at + 2] << 16
        kind, size = (block >> 1) & 3, block >> 3
        if kind == 3:  # reserved: not a block
            return -1
        at += 3 + (1 if kind == 1 else size)  # RLE blocks store one byte
        if block & 1:  # the last block
            break
    at += 4 if zstandard.get_frame_parameters(p).has_checksum else 0
    return at if at <= len(p) else -1


def _corrupt(what: str) -> Exception:
    return CorruptChunkError(what)


def decompress_planes(payload: Buffer, word: int, raw_length: int, dest: memoryview,
                      bad: Callable[[str], Exception] = _corrupt) -> None:
    """Decode a compress_planes payload into dest[:raw_length].

    The payload must be exactly one zstd frame that says it holds `raw_length`
    bytes and carries zstd's content checksum, and decode to exactly that (the
    checksum is checked at the frame's end); anything else raises `bad(reason)` (by default a
    CorruptChunkError without BO or offset: callers pass a factory that adds them).
    `dest` is written only after the whole frame decoded and verified.
    """
    _check_word(word)
    # Both views are released before anything raised here reaches the caller: an exception's traceback keeps
    # this frame, and a view still open in it would make the caller's release of `payload` (or unmapping of
    # `dest`'s buffer) fail with BufferError instead of the CorruptChunkError (found by the long fuzz run).
    with _bytes_view(payload) as p:
        try:
            params = zstandard.get_frame_parameters(p)
        except zstandard.ZstdError as e:
            raise bad(f"planes frame has no valid zstd frame header: {e}") from None
        if params.content_size != raw_length:
            size = "no content size" if params.content_size == zstandard.CONTENTSIZE_UNKNOWN else \
                f"content size {params.content_size}"
            raise bad(f"planes frame says {size}, expected {raw_length}")
        if not params.has_checksum:
            raise bad("planes frame carries no content checksum")
        length = zstd_frame_length(p)
        if length != len(p):
            raise bad(f"planes payload holds {len(p)} bytes, its zstd frame {length}"
                      if length > 0 else "planes frame is cut short")
        with _bytes_view(dest) as d:
            if len(d) < raw_length:
                raise ValueError(f"planes: destination holds {len(d)} bytes, expected {raw_length}")
            scratch = _scratch(raw_length)
            try:
                unzstd_exact(p, scratch, raw_length, bad, "planes frame")
                merge_into(scratch, word, d[:raw_length])
            finally:
                scratch.release()


def unzstd_exact(payload: Buffer, out: memoryview, raw_length: int, bad: Callable[[str], Exception],
                 what: str = "zstd frame") -> None:
    """Decompress one zstd frame into out[:raw_length]: exactly raw_length bytes, and its content checksum
    checked (zstd checks it when reading past the end); anything else is `bad(...)` naming `what`.

    The reader (which holds a view of `payload`) is gone before `bad` is raised, so the caller can release
    `payload` while the error propagates."""
    problem = None
    reader = zstd_decompressor().stream_reader(payload, read_across_frames=False)
    try:
        got = 0
        while got < raw_length:
            n = reader.readinto(out[got:raw_length])
            if not n:
                break
            got += n
        if got != raw_length or reader.read(1):
            problem = f"{what} holds {'more than' if got == raw_length else got} bytes, expected {raw_length}"
    except zstandard.ZstdError as e:
        problem = f"{what} does not decode: {e}"
    finally:
        del reader  # its last reference: its view of `payload` goes with it
    if problem is not None:
        raise bad(problem)
