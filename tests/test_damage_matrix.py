"""The fault matrix's damage half (issue #12): every damage case applied to each kind of chunk record.

Kinds: raw, zstd, byte planes, an XOR delta against a parent's chunk, and a record that dedup shares
between two BOs.  Damage: the record's magic, its header length, its header checksum, a header byte, the
first and the last payload byte, the file cut inside the record, the record zeroed, and another record of
the same image written over it.  Each restore and each verify ends with one typed error naming the data
file, the BO that needed the record and the chunk's offset in it, never success; the images are real
(dumped through the engine from memfds) and the damage is done to their files.
"""
from __future__ import annotations

import os
import random
import shutil

import pytest
from helpers import bf16_like, engine, image_records, memfd, open_dir, run

from vramd import errors, inproc
from vramd.backends import BoRef
from vramd.engine import BoSpec, RestoreTarget
from vramd.engine.jobs import dump as dump_job
from vramd.image.codec import Compression
from vramd.image.format import RECORD_PREFIX
from vramd.pb import image_pb2 as pb

CHUNK = 64 << 10


def _nudged(b: bytes, seed: int) -> bytes:
    """About 1% of the bf16 elements changed in their lowest bits: what a delta pays for."""
    w, rnd = bytearray(b), random.Random(seed)
    for _ in range(len(w) // 200):
        w[rnd.randrange(0, len(w), 2)] ^= 1 << rnd.randrange(3)
    return bytes(w)


def _dump(dfd: int, data: dict[int, bytes], compression: str, parent_fds=()) -> pb.Manifest:
    fds = {i: memfd(d) for i, d in data.items()}

    async def go():  # one data file: "another record" pastes a record of the same file over the damaged one
        async with engine(staging_budget=4 << 20, chunk_size=CHUNK, data_files_per_gpu=1) as e:
            return await inproc.dump(e, dfd, [BoSpec(i, len(d), BoRef("mmap", fds[i])) for i, d in data.items()],
                                parent_fds=parent_fds, compression=Compression.parse(compression))
    try:
        return run(go())
    finally:
        for fd in fds.values():
            os.close(fd)


text = (b"the quick brown fox %d jumps over the lazy dog " * 4000)[:4 * CHUNK]
rnd = random.Random(12)
# kind -> (codec of the damaged record, compression, the image's BOs, the parent's BOs or None)
KINDS = {
    "raw": (pb.CODEC_RAW, "none", {1: rnd.randbytes(4 * CHUNK), 2: rnd.randbytes(CHUNK + 77)}, None),
    "zstd": (pb.CODEC_ZSTD, "zstd", {1: text, 2: rnd.randbytes(CHUNK)}, None),
    "bplanes": (pb.CODEC_PLANES, "bplanes", {1: bf16_like(4 * CHUNK, 3), 2: rnd.randbytes(CHUNK)}, None),
    "xor": (pb.CODEC_XOR_PLANES, "zstd", {1: _nudged(bf16_like(4 * CHUNK, 5), 6)}, {1: bf16_like(4 * CHUNK, 5)}),
    # a delta as the first format v2 writers stored it (the XOR as it is, not as byte planes)
    "xor-unsplit": (pb.CODEC_XOR, "zstd", {1: _nudged(bf16_like(4 * CHUNK, 5), 6)}, {1: bf16_like(4 * CHUNK, 5)}),
    "dedup": (pb.CODEC_RAW, "none", {1: rnd.randbytes(2 * CHUNK)}, None),
}
KINDS["dedup"][2][2] = KINDS["dedup"][2][1][CHUNK:] + rnd.randbytes(CHUNK)  # BO 2's chunk 0 is BO 1's chunk 1


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    """kind -> the directory of a committed image holding such records (and its parent's, for xor)."""
    out = {}
    for kind, (codec, compression, data, parent) in KINDS.items():
        root = tmp_path_factory.mktemp(kind)
        parent_fds = []
        if parent is not None:
            (root / "parent").mkdir()
            parent_fds = [open_dir(root / "parent")]
            _dump(parent_fds[0], parent, compression)
        (root / "image").mkdir()
        fd = open_dir(root / "image")
        word = dump_job.DELTA_WORD
        try:
            if codec == pb.CODEC_XOR:
                dump_job.DELTA_WORD = 0
            _dump(fd, data, compression, parent_fds)
        finally:
            dump_job.DELTA_WORD = word
            os.close(fd)
            for pfd in parent_fds:
                os.close(pfd)
        out[kind] = root
    return out


def _target(kind: str, path) -> tuple[str, int, int, int, int, tuple[int, int] | None]:
    """The damaged record: (file name, its offset, its length, the BO that needs it, the chunk's offset in
    that BO, another record of the same file as (offset, length) or None)."""
    m, records = image_records(path)
    if kind == "dedup":  # the BO that refers to a record another BO stored: the one the error must name
        owners: dict[int, tuple] = {}
        for rec in records:
            owners.setdefault(rec[6], rec)
        bo_id, i, fi, off, ln, _, _ = next(rec for rec in records if owners[rec[6]][:2] != rec[:2])
    else:
        bo_id, i, fi, off, ln, _, _ = next(rec for rec in records if rec[5] == KINDS[kind][0])
    other = next(((o, n) for (_, _, f, o, n, _, _) in records if f == fi and o != off), None)
    return m.files[fi].name, off, ln, bo_id, i * m.chunk_size, other


def _first_cut(path, name: str, at: int) -> tuple[int, int]:
    """A data file cut at `at` is reported, before any byte moves, as the chunk whose record is the first
    (by file position) that the cut lost; of chunks sharing that record, the first in BO and chunk order:
    (BO, offset).  Where records lie in the file depends on the order the copies landed in."""
    m, records = image_records(path)
    fi = next(k for k, f in enumerate(m.files) if f.name == name)
    lost = [(o, b, i) for (b, i, f, o, n, _, _) in records if f == fi and o + n > at]
    _, bo_id, i = min(lost, key=lambda r: r[0])  # min keeps the first of equals: BO and chunk order
    return bo_id, i * m.chunk_size


def _poke(f, offset: int, data: bytes) -> None:
    with open(f, "r+b") as fh:
        fh.seek(offset)
        fh.write(data)


def _flip(f, offset: int) -> None:
    with open(f, "rb") as fh:
        fh.seek(offset)
        b = fh.read(1)
    _poke(f, offset, bytes([b[0] ^ 0x5A]))


def _payload(f, off: int) -> int:
    """Where the record's payload starts."""
    _, hlen, _ = RECORD_PREFIX.unpack_from(f.read_bytes()[off:off + RECORD_PREFIX.size])
    return off + RECORD_PREFIX.size + hlen


DAMAGES = {
    "magic": (errors.CorruptChunkError, "magic", lambda f, off, ln, other: _flip(f, off)),
    "header length": (errors.CorruptChunkError, "header length",
                      lambda f, off, ln, other: _poke(f, off + 4, (10_000).to_bytes(4, "little"))),
    "header checksum": (errors.CorruptChunkError, "header checksum",
                        lambda f, off, ln, other: _flip(f, off + 8)),
    "header byte": (errors.CorruptChunkError, "header checksum",
                    lambda f, off, ln, other: _flip(f, off + RECORD_PREFIX.size + 1)),
    "first payload byte": (errors.CorruptChunkError, "payload checksum",
                           lambda f, off, ln, other: _flip(f, _payload(f, off))),
    "last payload byte": (errors.CorruptChunkError, "payload checksum",
                          lambda f, off, ln, other: _flip(f, off + ln - 1)),
    "cut inside": (errors.TruncatedDataError, "", lambda f, off, ln, other: os.truncate(f, off + ln // 2)),
    "zeroed": (errors.CorruptChunkError, "magic", lambda f, off, ln, other: _poke(f, off, bytes(ln))),
    "another record": (errors.CorruptChunkError, "",
                       lambda f, off, ln, other: _poke(f, off, f.read_bytes()[other[0]:other[0] + ln])),
}


def _restore(dfd: int, sizes: dict[int, int], parent_fds) -> None:
    targets = {i: memfd(size=n) for i, n in sizes.items()}

    async def go():
        async with engine(staging_budget=4 << 20) as e:
            await inproc.restore(e, dfd, [RestoreTarget(i, BoRef("mmap", fd)) for i, fd in targets.items()],
                            parent_fds=parent_fds, allow_partial=True)
    try:
        run(go())
    finally:
        for fd in targets.values():
            os.close(fd)


def _verify(dfd: int, parent_fds) -> None:
    async def go():
        async with engine(staging_budget=4 << 20) as e:
            await inproc.verify(e, dfd, parent_fds=parent_fds)
    run(go())


@pytest.mark.parametrize("damage", list(DAMAGES))
@pytest.mark.parametrize("kind", list(KINDS))
def test_every_damage_to_every_kind_of_record_is_one_typed_error(pristine, tmp_path, kind, damage):
    shutil.copytree(pristine[kind], tmp_path / kind)
    path = tmp_path / kind / "image"
    name, off, ln, bo_id, offset, other = _target(kind, path)
    if damage == "cut inside":  # the file, not the record, is found short: named by the first lost record
        bo_id, offset = _first_cut(path, name, off + ln // 2)
    if damage == "another record" and other is None:
        pytest.fail(f"the {kind} image has one record in {name}: the test needs two")
    error, says, do = DAMAGES[damage]
    do(path / name, off, ln, other)
    parent_fds = [open_dir(tmp_path / kind / "parent")] if KINDS[kind][3] is not None else []
    dfd = open_dir(path)
    size = len(KINDS[kind][2][bo_id])
    try:
        for action in ("restore", "verify"):
            with pytest.raises(errors.ImageError) as ei:
                if action == "restore":  # the BO that needs the record, alone
                    _restore(dfd, {bo_id: size}, parent_fds)
                else:
                    _verify(dfd, parent_fds)
            e = ei.value
            assert type(e) is error, (action, e)
            assert says in str(e) and name in str(e), (action, e)
            if action == "restore" or kind != "dedup" or damage == "cut inside":
                assert (e.bo_id, e.offset) == (bo_id, offset), (action, e)
            else:  # a verify reads every BO: either BO needing the shared record may meet it first
                assert e.bo_id in KINDS[kind][2] and e.offset is not None, (action, e)
    finally:
        os.close(dfd)
        for fd in parent_fds:
            os.close(fd)
