"""Damaged images give typed errors naming what is wrong; a restore never reports success."""
import os
import struct

import pytest
from helpers import engine, memfd, run

from vramd import errors, inproc
from vramd.backends import BoRef
from vramd.engine import BoSpec, RestoreTarget
from vramd.image.codec import Compression
from vramd.image.format import FORMAT_VERSION, RECORD_PREFIX
from vramd.image.manifest import MANIFEST_PREFIX, chunk_record, decode_manifest
from vramd.image.names import MANIFEST_NAME

MiB = 1 << 20
CHUNK = 1 * MiB


@pytest.fixture(params=["none", "zstd"])
def dumped(request, image_dir):
    """An image of two BOs (3.5 MiB of text-like data, 1 MiB) plus the original bytes."""
    path, dfd = image_dir
    data = {1: (b"the quick brown fox %d " * 200000)[:3 * MiB + MiB // 2], 2: os.urandom(MiB)}
    fds = {i: memfd(d) for i, d in data.items()}

    async def go():
        async with engine(staging_budget=8 * MiB, chunk_size=CHUNK) as e:
            return await inproc.dump(e, dfd, [BoSpec(i, len(d), BoRef("mmap", fds[i])) for i, d in data.items()],
                                compression=Compression.parse(request.param))
    manifest = run(go())
    for fd in fds.values():
        os.close(fd)
    return path, dfd, manifest, data


def _restore(dfd, data):
    targets = {i: memfd(size=len(d)) for i, d in data.items()}

    async def go():
        async with engine(staging_budget=8 * MiB, chunk_size=CHUNK) as e:
            return await inproc.restore(e, dfd, [RestoreTarget(i, BoRef("mmap", fd)) for i, fd in targets.items()])
    try:
        return run(go())
    finally:
        for fd in targets.values():
            os.close(fd)


def _verify(dfd):
    async def go():
        async with engine(staging_budget=8 * MiB) as e:
            return await inproc.verify(e, dfd)
    return run(go())


def _record(manifest, bo_id, chunk):
    bo = next(b for b in manifest.bos if b.id == bo_id)
    fi, off, ln, _ = chunk_record(manifest, bo, chunk)
    return manifest.files[fi].name, off, ln


def _flip(path, offset):
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x40]))


def test_intact_image_restores_and_verifies(dumped):
    _, dfd, manifest, data = dumped
    assert _restore(dfd, data).bytes_done == sum(map(len, data.values()))
    assert _verify(dfd).progress.chunks_done == manifest.totals.chunk_count


def test_corrupt_payload_is_caught_before_use(dumped):
    path, dfd, manifest, data = dumped
    name, off, length = _record(manifest, 1, 2)  # BO 1, chunk 2
    _flip(path / name, off + length - 10)  # a byte of the payload
    for action in (lambda: _restore(dfd, data), lambda: _verify(dfd)):
        with pytest.raises(errors.CorruptChunkError) as ei:
            action()
        assert ei.value.bo_id == 1 and ei.value.offset == 2 * CHUNK
        assert "checksum" in str(ei.value) or "zstd" in str(ei.value)
        assert name in str(ei.value)


def test_corrupt_chunk_header_is_caught(dumped):
    path, dfd, manifest, data = dumped
    name, off, _ = _record(manifest, 2, 0)
    _flip(path / name, off + RECORD_PREFIX.size + 2)  # inside the protobuf header
    with pytest.raises(errors.CorruptChunkError, match="header checksum") as ei:
        _restore(dfd, data)
    assert (ei.value.bo_id, ei.value.offset) == (2, 0)


def test_record_magic_damage_is_caught(dumped):
    path, dfd, manifest, _ = dumped
    name, off, _ = _record(manifest, 1, 1)
    _flip(path / name, off)
    with pytest.raises(errors.CorruptChunkError, match="magic") as ei:
        _verify(dfd)
    assert (ei.value.bo_id, ei.value.offset) == (1, CHUNK)


def test_truncated_data_file(dumped):
    path, dfd, manifest, data = dumped
    name, off, _ = _record(manifest, 1, 3)
    os.truncate(path / name, off + 20)
    for action in (lambda: _restore(dfd, data), lambda: _verify(dfd)):
        with pytest.raises(errors.TruncatedDataError) as ei:
            action()
        assert name in str(ei.value) and ei.value.bo_id is not None and ei.value.offset is not None
    # a chunk the cut lost is named (of the data file cut: a GPU's records may lie in several)
    assert ei.value.bo_id in data


def test_missing_data_file(dumped):
    path, dfd, manifest, data = dumped
    os.unlink(path / manifest.files[0].name)
    with pytest.raises(errors.TruncatedDataError, match="missing"):
        _restore(dfd, data)


def test_missing_manifest(dumped):
    path, dfd, _, data = dumped
    os.unlink(path / MANIFEST_NAME)
    with pytest.raises(errors.ManifestMissingError):
        _restore(dfd, data)
    with pytest.raises(errors.ManifestMissingError):
        _verify(dfd)


def test_foreign_version_manifest(dumped):
    path, dfd, _, data = dumped
    blob = bytearray((path / MANIFEST_NAME).read_bytes())
    struct.pack_into("<I", blob, 8, FORMAT_VERSION + 1)  # a future format version
    (path / MANIFEST_NAME).write_bytes(blob)
    with pytest.raises(errors.UnsupportedVersionError, match=f"version {FORMAT_VERSION + 1}"):
        _restore(dfd, data)


def test_damaged_manifest(dumped):
    path, dfd, _, data = dumped
    blob = bytearray((path / MANIFEST_NAME).read_bytes())
    blob[MANIFEST_PREFIX.size + 5] ^= 1
    (path / MANIFEST_NAME).write_bytes(blob)
    with pytest.raises(errors.CorruptManifestError, match="digest"):
        _restore(dfd, data)
    (path / MANIFEST_NAME).write_bytes(b"not a manifest at all, just text......")
    with pytest.raises(errors.CorruptManifestError, match="magic"):
        _verify(dfd)


def test_data_file_of_another_image(dumped, tmp_path):
    path, dfd, manifest, data = dumped
    other = tmp_path / "other"
    other.mkdir()
    ofd = os.open(other, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fd = memfd(os.urandom(MiB))

        async def go():
            async with engine(staging_budget=8 * MiB, chunk_size=CHUNK) as e:
                return await inproc.dump(e, ofd, [BoSpec(1, MiB, BoRef("mmap", fd))])
        om = run(go())
        os.close(fd)
    finally:
        os.close(ofd)
    os.replace(other / om.files[0].name, path / manifest.files[0].name)
    with pytest.raises(errors.ForeignDataFileError, match="belongs to another image") as ei:
        _restore(dfd, data)
    assert om.image_id.hex()[:8] not in str(ei.value)  # never the other image's id: the client may not read it


def test_manifest_consistency_checks():
    from vramd.image.manifest import encode_manifest
    from vramd.pb import image_pb2 as pb

    m = pb.Manifest(format_version=1, image_id=b"x" * 16, chunk_size=4096,
                    bos=[pb.BoEntry(id=1, size=10000, record_offsets=[32], record_lengths=[50])],
                    files=[pb.DataFile(name="data-0123456789abcdef-00000000.vrd", length=100)])
    with pytest.raises(errors.CorruptManifestError, match="1 records for 10000 bytes"):
        decode_manifest(encode_manifest(m))


def test_restore_needs_a_target_for_every_bo(dumped):
    _, dfd, _, data = dumped
    with pytest.raises(errors.IncompleteRestoreError) as ei:
        _restore(dfd, {1: data[1]})
    assert ei.value.bo_id == 2
