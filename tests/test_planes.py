"""The byte-plane transform and the planes codec (vramd/image/planes.py): native and Python paths."""
import array
import os
import random

import pytest
import zstandard

from vramd.errors import CorruptChunkError
from vramd.image import planes
from vramd.testing.seams import python_copier

LENGTHS = [0, 1, 3, 4095, 4096, (8 << 20) + 3]


@pytest.fixture(params=["native", "python"])
def path(request):
    if request.param == "native":
        if not planes.NATIVE:
            pytest.skip("vramd.hostmem._copy is not built (needs <xxhash.h>: libxxhash-dev)")
        yield request.param
    else:
        with python_copier():
            yield request.param


def reference_split(src: bytes, word: int) -> bytes:
    w = len(src) // word
    return b"".join(src[k:w * word:word] for k in range(word)) + src[w * word:]


def floats(n: int, seed: int = 1) -> bytes:
    """n fp32 values from N(0, 0.02); past 64 Ki of them, the first 64 Ki repeat (generating is slow)."""
    rnd = random.Random(seed)
    base = array.array("f", (rnd.gauss(0.0, 0.02) for _ in range(min(n, 1 << 16)))).tobytes()
    return (base * (n // (1 << 16) + 1))[:4 * n]


@pytest.mark.parametrize("word", planes.WORDS)
@pytest.mark.parametrize("n", LENGTHS)
def test_split_merge_round_trip(path, n, word):
    src = os.urandom(n)
    split = planes.split_planes(src, word)
    assert split == reference_split(src, word)
    out = bytearray(n)
    planes.merge_planes(split, word, memoryview(out))
    assert out == src


@pytest.mark.parametrize("word", planes.WORDS)
def test_native_equals_python(word):
    if not planes.NATIVE:
        pytest.skip("vramd.hostmem._copy is not built")
    for n in (5, 63, 64, 65, 4097, (1 << 20) + 7):
        src = os.urandom(n)
        native = planes.split_planes(src, word)
        nout = bytearray(n)
        planes.merge_planes(native, word, memoryview(nout))
        with python_copier():
            assert planes.split_planes(src, word) == native
            pout = bytearray(n)
            planes.merge_planes(native, word, memoryview(pout))
        assert nout == pout == src


def test_planes_layout():
    # words 0x04030201 and 0x08070605 (little-endian): byte planes 01 05 | 02 06 | 03 07 | 04 08, tail kept
    assert planes.split_planes(bytes(range(1, 9)) + b"\xff", 4) == bytes([1, 5, 2, 6, 3, 7, 4, 8, 0xFF])
    assert planes.split_planes(bytes(range(1, 6)), 2) == bytes([1, 3, 2, 4, 5])


def test_other_views_and_bad_arguments(path):
    src = floats(1000)
    as_floats = memoryview(src).cast("f")  # a typed view is read as its bytes
    assert planes.split_planes(as_floats, 4) == reference_split(src, 4)
    with pytest.raises(ValueError, match="2 or 4"):
        planes.split_planes(src, 3)
    with pytest.raises(ValueError, match="destination"):
        planes.merge_planes(src, 4, memoryview(bytearray(len(src) - 1)))
    with pytest.raises(ValueError, match="read-only"):
        planes.merge_planes(src, 4, memoryview(bytes(len(src))))


@pytest.mark.parametrize("word", planes.WORDS)
@pytest.mark.parametrize("n", LENGTHS)
def test_codec_round_trip(path, n, word):
    src = floats(n // 4) + os.urandom(n % 4)
    payload = planes.compress_planes(memoryview(src), word, 1)
    params = zstandard.get_frame_parameters(payload)
    assert params.content_size == n and params.has_checksum
    out = bytearray(n + 5)  # a larger destination: only its first n bytes are written
    planes.decompress_planes(payload, word, n, memoryview(out))
    assert out[:n] == src and out[n:] == bytes(5)


def test_planes_shrink_floats():
    src = memoryview(floats(256 << 10))  # 1 MiB of fp32
    zstd = len(planes.compress_zstd(src, 1))
    assert len(planes.compress_planes(src, 4, 1)) < 0.95 * zstd


def corruptions(payload: bytes, n: int, word: int):
    mid = len(payload) // 2
    yield "truncated", payload[:-7], n
    yield "truncated header", payload[:3], n
    yield "flipped byte", payload[:mid] + bytes([payload[mid] ^ 0x40]) + payload[mid + 1:], n
    yield "flipped checksum", payload[:-1] + bytes([payload[-1] ^ 1]), n
    yield "checksum cut short", payload[:-3], n
    yield "checksum missing", payload[:-4], n
    yield "wrong raw length", payload, n + 1
    yield "shorter raw length", payload, n - word
    other = planes.compress_planes(memoryview(os.urandom(n - 1)), word, 1)  # frame says n - 1
    yield "wrong content size", other, n
    yield "trailing bytes", payload + b"\0" * 8, n
    yield "two frames", payload + payload, n
    yield "no checksum", zstandard.ZstdCompressor(write_checksum=False).compress(os.urandom(n)), n
    stream = zstandard.ZstdCompressor(write_checksum=True).compressobj()
    yield "no content size", stream.compress(os.urandom(n)) + stream.flush(), n
    yield "not zstd", os.urandom(64), n


@pytest.mark.parametrize("word", planes.WORDS)
def test_corrupt_frames_raise(path, word):
    n = 64 << 10
    payload = planes.compress_planes(memoryview(floats(n // 4)), word, 1)
    for what, bad_payload, raw_length in corruptions(payload, n, word):
        out = bytearray(b"\xaa" * (n + 8))
        with pytest.raises(CorruptChunkError) as e:
            planes.decompress_planes(bad_payload, word, raw_length, memoryview(out))
        assert e.value.code == "CORRUPT_CHUNK", what
        assert out == b"\xaa" * (n + 8), f"{what}: the destination was written"


def test_corrupt_frame_uses_callers_factory():
    class Mine(CorruptChunkError):
        pass

    payload = planes.compress_planes(memoryview(floats(1024)), 4, 1)
    with pytest.raises(Mine, match=r"bo 7.*offset 0x1000") as e:
        planes.decompress_planes(payload[:-3], 4, 4096, memoryview(bytearray(4096)),
                                 lambda what: Mine(f"somewhere: {what}", bo_id=7, offset=0x1000))
    assert e.value.bo_id == 7
