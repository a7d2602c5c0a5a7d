"""Image format v2: content-hashed chunks, dedup inside an image, incremental images over parents, v1 still read.

Every test dumps real bytes from memfds through the engine, then restores into fresh memfds and compares
byte for byte; damage is done to the real files.
"""
import os
import random
import struct

import pytest
from helpers import bf16_like, engine, image_records, memfd, open_dir, run, v1_contents, v1_image

from vramd import errors, inproc
from vramd.backends import BoRef
from vramd.engine import BoSpec, EngineConfig, RestoreTarget
from vramd.engine.jobs import dump as dump_job
from vramd.image.codec import Compression
from vramd.image.manifest import chunk_record, decode_manifest, encode_manifest
from vramd.image.names import MANIFEST_NAME
from vramd.pb import image_pb2 as pb

MiB = 1 << 20
CHUNK = 256 << 10
SENTINEL = 0xA5


def _dump(dfd, data, *, gpus=None, parent_fds=(), hint="", dedup=True, compression="none", same=None):
    """Dump {bo id: bytes}; `same`: {bo id: other bo id} passes the other BO's memfd again (one dmabuf)."""
    fds = {i: memfd(d) for i, d in data.items() if not same or i not in same}
    specs = [BoSpec(i, len(d), BoRef("mmap", fds[(same or {}).get(i, i)]), gpu_id=(gpus or {}).get(i, 0))
             for i, d in data.items()]

    async def go():
        async with engine(staging_budget=16 * MiB, chunk_size=CHUNK) as e:
            return await inproc.dump(e, dfd, specs, parent_fds=parent_fds, parent_hint=hint, dedup=dedup,
                                compression=Compression.parse(compression))
    try:
        return run(go())
    finally:
        for fd in fds.values():
            os.close(fd)


def _restore(dfd, sizes, parent_fds=(), allow_partial=False):
    """Restore into memfds pre-filled with a sentinel; returns {bo id: bytes} (also when the restore fails:
    the exception carries `.after`, what the targets hold)."""
    targets = {i: memfd(bytes([SENTINEL]) * n) for i, n in sizes.items()}

    async def go():
        async with engine(staging_budget=16 * MiB) as e:
            await inproc.restore(e, dfd, [RestoreTarget(i, BoRef("mmap", fd)) for i, fd in targets.items()],
                            parent_fds=parent_fds, allow_partial=allow_partial)
    try:
        try:
            run(go())
        except errors.VramdError as e:
            e.after = {i: os.pread(fd, sizes[i], 0) for i, fd in targets.items()}
            raise
        return {i: os.pread(fd, sizes[i], 0) for i, fd in targets.items()}
    finally:
        for fd in targets.values():
            os.close(fd)


def _verify(dfd, parent_fds=()):
    async def go():
        async with engine(staging_budget=16 * MiB) as e:
            return await inproc.verify(e, dfd, parent_fds=parent_fds)
    return run(go())


def _dirs(tmp_path, *names):
    out = []
    for n in names:
        (tmp_path / n).mkdir()
        out.append((tmp_path / n, open_dir(tmp_path / n)))
    return out


# --- v1 images stay readable ------------------------------------------------------------------

def test_a_v1_image_restores_and_verifies(tmp_path):
    path, dfd = v1_image(tmp_path)
    data = v1_contents()
    m = decode_manifest((path / MANIFEST_NAME).read_bytes())
    assert m.format_version == 1 and not m.chunks.image
    assert _restore(dfd, {i: len(d) for i, d in data.items()}) == data
    assert _verify(dfd).manifest.format_version == 1


# --- dedup inside one image ---------------------------------------------------------------------

def test_data_parallel_replicas_are_stored_once(tmp_path):
    (_path, dfd), = _dirs(tmp_path, "img")
    state = os.urandom(3 * CHUNK + 1000)
    data = {10 + g: state for g in range(4)}  # the same state on 4 GPUs
    data[20] = os.urandom(CHUNK)  # and something of its own
    m = _dump(dfd, data, gpus={10 + g: g for g in range(4)} | {20: 1})
    # v2 (its chunk tables); v3 where a GPU's records go to more than one data file (the engine's default)
    assert m.format_version == (3 if EngineConfig().data_files_per_gpu > 1 else 2)
    assert m.totals.record_count == 4 + 1
    assert m.totals.dedup_bytes == 3 * len(state)
    assert m.totals.stored_bytes == len(state) + CHUNK
    assert _restore(dfd, {i: len(d) for i, d in data.items()}) == data
    _verify(dfd)


def test_without_dedup_every_chunk_is_stored(tmp_path):
    (_path, dfd), = _dirs(tmp_path, "img")
    state = os.urandom(2 * CHUNK)
    data = {1: state, 2: state}
    m = _dump(dfd, data, dedup=False)
    assert m.totals.record_count == 4 and m.totals.dedup_bytes == 0
    assert m.totals.compressed_records == 0  # a reader of it needs no room to decompress
    assert _restore(dfd, {i: len(d) for i, d in data.items()}) == data


def test_repeated_chunks_inside_a_bo_and_holes(tmp_path):
    (_path, dfd), = _dirs(tmp_path, "img")
    block = os.urandom(CHUNK)
    data = {1: block + bytes(CHUNK) + block + block[:100]}
    m = _dump(dfd, data, compression="zstd")
    assert m.totals.record_count == 2  # the block, its 100-byte tail; the repeat refers; the hole is no record
    assert m.totals.zero_bytes == CHUNK and m.totals.dedup_bytes == CHUNK
    assert list(m.bos[0].chunk_refs)[1] == 0
    assert _restore(dfd, {1: len(data[1])}) == data


def test_one_dmabuf_passed_by_two_processes_is_copied_once(tmp_path):
    (_path, dfd), = _dirs(tmp_path, "img")
    shared = os.urandom(2 * CHUNK)
    data = {1: shared, 2: shared}
    m = _dump(dfd, data, same={2: 1})  # BO 2 is the same memfd (inode) as BO 1
    assert m.totals.record_count == 2 and m.totals.dedup_bytes == len(shared)
    e2 = next(b for b in m.bos if b.id == 2)
    assert e2.stored_bytes == 0 and e2.dedup_bytes == len(shared)
    assert _restore(dfd, {1: len(shared), 2: len(shared)}) == data


def test_a_dedup_reference_to_a_corrupt_record_names_the_bo_that_needs_it(tmp_path):
    (path, dfd), = _dirs(tmp_path, "img")
    shared = os.urandom(CHUNK)
    data = {1: shared, 2: shared}
    m = _dump(dfd, data)
    owner = next(b for b in m.bos if chunk_record(m, b, 0) is not None and b.chunk_refs[0])
    fi, off, ln, _ = chunk_record(m, owner, 0)
    f = path / m.files[fi].name
    blob = bytearray(f.read_bytes())
    blob[off + ln - 10] ^= 0xFF
    f.write_bytes(blob)
    for bo in (1, 2):  # whichever BO restores it, the error names that BO
        with pytest.raises(errors.CorruptChunkError, match="payload checksum") as ei:
            _restore(dfd, {bo: CHUNK}, allow_partial=True)
        assert (ei.value.bo_id, ei.value.offset) == (bo, 0)


# --- incremental images ---------------------------------------------------------------------------

def _three_bos(seed):
    rnd = random.Random(seed)
    return {1: rnd.randbytes(4 * CHUNK), 2: bf16_like(2 * CHUNK, seed), 3: rnd.randbytes(CHUNK + 77)}


def test_an_incremental_image_stores_only_what_changed(tmp_path):
    (_pp, pfd), (_cp, cfd) = _dirs(tmp_path, "parent", "child")
    parent = _three_bos(1)
    _dump(pfd, parent)
    child = dict(parent)
    child[3] = os.urandom(len(parent[3]))  # "the KV cache" changed; weights did not
    m = _dump(cfd, child, parent_fds=[pfd], hint="../parent")
    assert [p.relative_path for p in m.parents] == ["../parent"]
    assert m.totals.parent_bytes == len(parent[1]) + len(parent[2])
    assert m.totals.stored_bytes <= len(child[3]) * 1.02
    assert _restore(cfd, {i: len(d) for i, d in child.items()}, parent_fds=[pfd]) == child
    _verify(cfd, parent_fds=[pfd])


def test_slightly_changed_chunks_are_stored_as_deltas(tmp_path):
    (_pp, pfd), (_cp, cfd) = _dirs(tmp_path, "parent", "child")
    parent = {1: bf16_like(4 * CHUNK, 7)}
    _dump(pfd, parent, compression="zstd")
    w = bytearray(parent[1])
    rnd = random.Random(8)
    for _ in range(len(w) // 200):  # about 1% of the bf16 elements nudged
        i = rnd.randrange(0, len(w), 2)
        w[i] ^= 1 << rnd.randrange(3)
    child = {1: bytes(w)}
    m = _dump(cfd, child, parent_fds=[pfd], compression="zstd")
    assert m.totals.delta_bytes == len(w)
    assert m.totals.stored_bytes < 0.10 * len(w)
    assert all(m.chunks.base[r - 1] for r in m.bos[0].chunk_refs)
    assert _restore(cfd, {1: len(w)}, parent_fds=[pfd]) == child


def _fp32_like(n: int, seed: int) -> bytes:
    """Bytes shaped like fp32 weights: random mantissas, a narrow band of exponents."""
    rnd = random.Random(seed)
    return struct.pack(f"<{n // 4}f", *(rnd.gauss(0, 0.05) for _ in range(n // 4)))


def test_a_delta_is_stored_as_byte_planes_and_deltas_stored_unsplit_still_restore(tmp_path, monkeypatch):
    """fp32 numbers that moved by a relative 1e-4 (an optimizer step on master weights): their XOR's high
    bytes are zero, and as byte planes (CODEC_XOR_PLANES) they are long zero runs, where the XOR as it
    is (CODEC_XOR, what the first format v2 writers stored) interleaves them with the changed bytes."""
    (_pp, pfd), (planes_path, planes_fd), (unsplit_path, unsplit_fd) = _dirs(tmp_path, "parent", "planes",
                                                                          "unsplit")
    parent = {1: _fp32_like(4 * CHUNK, 9)}
    _dump(pfd, parent, compression="zstd")
    rnd = random.Random(10)
    w = struct.pack(f"<{len(parent[1]) // 4}f", *(v * (1 + rnd.gauss(0, 1e-4))  # each number moved by ~1e-4
                                                  for v in struct.unpack(f"<{len(parent[1]) // 4}f", parent[1])))
    child = {1: w}
    m = _dump(planes_fd, child, parent_fds=[pfd], compression="zstd")
    monkeypatch.setattr(dump_job, "DELTA_WORD", 0)
    m_unsplit = _dump(unsplit_fd, child, parent_fds=[pfd], compression="zstd")
    assert {r[5] for r in image_records(planes_path)[1]} == {pb.CODEC_XOR_PLANES}
    assert {r[5] for r in image_records(unsplit_path)[1]} == {pb.CODEC_XOR}
    assert m.totals.delta_bytes == m_unsplit.totals.delta_bytes == len(w)
    assert m.totals.stored_bytes < 0.9 * m_unsplit.totals.stored_bytes  # 0.84 x when written
    for fd in (planes_fd, unsplit_fd):
        assert _restore(fd, {1: len(w)}, parent_fds=[pfd]) == child
        _verify(fd, parent_fds=[pfd])


def test_a_delta_is_kept_only_where_it_saves_a_quarter_of_the_chunk(tmp_path):
    """Each restore pays for a delta with its base's read and decode: a delta that saves little is not kept."""
    (_pp, pfd), (_cp, cfd) = _dirs(tmp_path, "parent", "child")
    rnd = random.Random(11)
    parent = {1: rnd.randbytes(2 * CHUNK)}  # incompressible: the plain records are raw
    _dump(pfd, parent)
    w = bytearray(parent[1])
    for lo, share in ((0, 0.10), (CHUNK, 0.90)):  # chunk 0: a tenth of its bytes changed; chunk 1: nine tenths
        for i in rnd.sample(range(lo, lo + CHUNK), int(share * CHUNK)):
            w[i] ^= rnd.randrange(1, 256)
    child = {1: bytes(w)}
    m = _dump(cfd, child, parent_fds=[pfd])
    assert m.totals.delta_bytes == CHUNK  # chunk 0 only: chunk 1's delta (a tenth of it zeros) saves too little
    bases = [m.chunks.base[r - 1] for r in m.bos[0].chunk_refs]  # chunk_refs: 1 + the entry index
    assert bool(bases[0]) and not bases[1]
    assert m.totals.stored_bytes < CHUNK + 0.5 * CHUNK
    assert _restore(cfd, {1: len(w)}, parent_fds=[pfd]) == child


def test_a_three_deep_chain_restores_and_deltas_keep_a_plain_base(tmp_path):
    dirs = _dirs(tmp_path, "g0", "g1", "g2", "g3")
    states = [{1: bf16_like(3 * CHUNK, 3), 2: os.urandom(CHUNK)}]
    _dump(dirs[0][1], states[0])
    for k in range(1, 4):
        w = bytearray(states[-1][1])
        rnd = random.Random(k)
        for _ in range(len(w) // 300):
            w[rnd.randrange(0, len(w), 2)] ^= 1
        states.append({1: bytes(w), 2: states[-1][2]})
        fds = [d[1] for d in reversed(dirs[:k])]  # the parent, then its parents
        m = _dump(dirs[k][1], states[k], parent_fds=fds, hint=f"../g{k - 1}")
        assert len(m.parents) == k
        t = m.chunks
        assert all(not t.base[b - 1] for b in t.base if b)  # a base is never a delta
    assert [p.relative_path for p in m.parents] == ["../g2", "../g1", "../g0"]
    fds = [d[1] for d in reversed(dirs[:3])]
    assert _restore(dirs[3][1], {1: 3 * CHUNK, 2: CHUNK}, parent_fds=fds) == states[3]


def test_missing_or_wrong_parents_fail_before_any_byte_is_written(tmp_path):
    (pp, pfd), (_cp, cfd), (_op, ofd) = _dirs(tmp_path, "parent", "child", "other")
    parent = _three_bos(2)
    _dump(pfd, parent)
    _dump(ofd, parent)  # the same bytes, but another image
    child = dict(parent)
    child[1] = os.urandom(len(parent[1]))
    _dump(cfd, child, parent_fds=[pfd], hint="../parent")
    sizes = {i: len(d) for i, d in child.items()}
    untouched = {i: bytes([SENTINEL]) * n for i, n in sizes.items()}
    with pytest.raises(errors.ParentMissingError, match=r"parent #1 .*'\.\./parent'") as ei:
        _restore(cfd, sizes)
    assert ei.value.after == untouched
    with pytest.raises(errors.ParentMismatchError, match="another image") as ei:
        _restore(cfd, sizes, parent_fds=[ofd])
    assert ei.value.after == untouched
    with pytest.raises(errors.ParentMismatchError, match="no committed image"):
        _restore(cfd, sizes, parent_fds=[open_dir(tmp_path)])
    # the parent altered after the child was written (its manifest rewritten: same id, other bytes)
    m = decode_manifest((pp / MANIFEST_NAME).read_bytes())
    m.writer = "someone else"
    (pp / MANIFEST_NAME).write_bytes(encode_manifest(m))
    with pytest.raises(errors.ParentMismatchError, match="altered") as ei:
        _restore(cfd, sizes, parent_fds=[pfd])
    assert ei.value.after == untouched
    with pytest.raises(errors.ParentMismatchError):
        _verify(cfd, parent_fds=[pfd])


def test_a_corrupt_parent_record_names_the_child_bo_that_needs_it(tmp_path):
    (pp, pfd), (_cp, cfd) = _dirs(tmp_path, "parent", "child")
    parent = {1: os.urandom(2 * CHUNK), 2: os.urandom(CHUNK)}
    pm = _dump(pfd, parent)
    child = {1: parent[1], 2: os.urandom(CHUNK)}
    _dump(cfd, child, parent_fds=[pfd])
    bo1 = next(b for b in pm.bos if b.id == 1)
    fi, off, ln, _ = chunk_record(pm, bo1, 1)
    f = pp / pm.files[fi].name
    blob = bytearray(f.read_bytes())
    blob[off + ln - 1] ^= 0x01
    f.write_bytes(blob)
    with pytest.raises(errors.CorruptChunkError, match="parent #1") as ei:
        _restore(cfd, {1: 2 * CHUNK, 2: CHUNK}, parent_fds=[pfd])
    assert (ei.value.bo_id, ei.value.offset) == (1, CHUNK)


def test_a_parent_chain_loop_is_a_corrupt_manifest(tmp_path):
    (_pp, pfd), (cp, cfd) = _dirs(tmp_path, "parent", "child")
    _dump(pfd, {1: os.urandom(CHUNK)})
    _dump(cfd, {1: os.urandom(CHUNK)}, parent_fds=[pfd])
    m = decode_manifest((cp / MANIFEST_NAME).read_bytes())
    m.parents[0].image_id = m.image_id  # the child claims to be its own parent
    (cp / MANIFEST_NAME).write_bytes(encode_manifest(m))
    with pytest.raises(errors.CorruptManifestError, match="loop"):
        _verify(cfd, parent_fds=[pfd])


def test_chains_stop_at_the_configured_depth(tmp_path):
    dirs = _dirs(tmp_path, *(f"g{k}" for k in range(3)))
    data = {1: os.urandom(CHUNK)}
    _dump(dirs[0][1], data)

    async def go(k):
        async with engine(staging_budget=16 * MiB, chunk_size=CHUNK, max_chain_depth=1) as e:
            fd = memfd(data[1])
            try:
                return await inproc.dump(e, dirs[k][1], [BoSpec(1, CHUNK, BoRef("mmap", fd))],
                                    parent_fds=[d[1] for d in reversed(dirs[:k])])
            finally:
                os.close(fd)
    run(go(1))
    with pytest.raises(errors.LimitExceededError, match="flatten"):
        run(go(2))
    assert not (dirs[2][0] / MANIFEST_NAME).exists()


def test_a_dump_into_its_parents_directory_is_refused(tmp_path):
    (pp, pfd), = _dirs(tmp_path, "parent")
    parent = {1: os.urandom(CHUNK)}
    _dump(pfd, parent)
    with pytest.raises(errors.InvalidRequestError, match="parent"):
        _dump(pfd, {1: os.urandom(CHUNK)}, parent_fds=[open_dir(pp)])
    assert _restore(pfd, {1: CHUNK}) == parent


# --- codecs -------------------------------------------------------------------------------------

@pytest.mark.parametrize("compression", ["bplanes", "bplanes:3", "auto", "zstd:3"])
def test_float_aware_and_auto_codecs_round_trip(tmp_path, compression):
    (_path, dfd), = _dirs(tmp_path, "img")
    data = {1: bf16_like(3 * CHUNK + 10, 11), 2: os.urandom(CHUNK), 3: bytes(CHUNK) + b"tail"}
    m = _dump(dfd, data, compression=compression)
    assert _restore(dfd, {i: len(d) for i, d in data.items()}) == data
    _verify(dfd)
    if compression != "auto":  # auto compresses only where it pays at the sink's speed: either may happen
        assert m.totals.compressed_records > 0
    if compression.startswith("bplanes"):  # the bf16-like BO compresses as byte planes of 2-byte words
        bo = next(b for b in m.bos if b.id == 1)
        assert bo.stored_bytes < 0.8 * len(data[1])
        heads = []
        for i in range(len(bo.chunk_refs)):
            fi, off, ln, _ = chunk_record(m, bo, i)
            blob = (_path / m.files[fi].name).read_bytes()[off:off + ln]
            from vramd.image.format import decode_record_head
            heads.append(decode_record_head(blob, bo_id=1, offset=i * CHUNK, where="t",
                                            content_hash=m.chunks.hashes[(bo.chunk_refs[i] - 1) * 32:
                                                                         bo.chunk_refs[i] * 32])[0])
        assert {(h.codec, h.word_size) for h in heads[:-1]} == {(pb.CODEC_PLANES, 2)}
        assert heads[-1].raw_length == 10  # too short to shrink: stored raw


def test_a_truncated_zstd_frame_is_corrupt(tmp_path):
    """zstd accepts a frame whose trailing checksum is cut short; the reader does not."""
    from vramd.image.codec import _compressor, _unzstd
    frame = _compressor(1).compress(b"abc" * 1000)
    out = memoryview(bytearray(3000))
    _unzstd(memoryview(frame), out, 0, 3000, lambda m: errors.CorruptChunkError(m))
    for cut in (1, 3, 4):
        with pytest.raises(errors.CorruptChunkError, match="cut short"):
            _unzstd(memoryview(frame[:-cut]), out, 0, 3000, lambda m: errors.CorruptChunkError(m))


def test_a_parent_is_not_replaced_while_a_child_needs_it(tmp_path):
    (pp, pfd), (_cp, cfd) = _dirs(tmp_path, "parent", "child")
    parent = {1: os.urandom(CHUNK)}
    pm = _dump(pfd, parent)
    cm = _dump(cfd, {1: os.urandom(CHUNK)}, parent_fds=[pfd])
    assert (pp / f".child.{cm.image_id.hex()}").exists()
    with pytest.raises(errors.InvalidRequestError, match="replacing it would break them"):
        _dump(pfd, {1: os.urandom(CHUNK)})
    assert decode_manifest((pp / MANIFEST_NAME).read_bytes()).image_id == pm.image_id

    async def replace():
        async with engine(staging_budget=16 * MiB, chunk_size=CHUNK) as e:
            fd = memfd(os.urandom(CHUNK))
            try:
                async with await inproc.start_dump(e, pfd, replace_parent=True) as s:
                    await s.add([BoSpec(1, CHUNK, BoRef("mmap", fd))])
                    return await s.finish()
            finally:
                os.close(fd)
    assert run(replace()).image_id != pm.image_id
    with pytest.raises(errors.ParentMismatchError):
        _restore(cfd, {1: CHUNK}, parent_fds=[pfd])


def test_children_of_one_parent_commit_at_once_but_not_while_a_dump_writes_there(tmp_path):
    """A child marks its parent's directory under a shared lock: another child marking it at that moment
    (a shared lock held on the directory) does not fail its commit; a dump writing into the directory (an
    exclusive lock) does, and the child leaves no mark."""
    from vramd.imagedir import lock_directory
    (pp, pfd), (_ap, afd), (_bp, bfd) = _dirs(tmp_path, "parent", "a", "b")
    _dump(pfd, {1: os.urandom(CHUNK)})
    held = lock_directory(pfd, shared=True)  # a sibling marking the parent right now
    try:
        am = _dump(afd, {1: os.urandom(CHUNK)}, parent_fds=[pfd])
        assert (pp / f".child.{am.image_id.hex()}").exists()
    finally:
        held.release()
    held = lock_directory(pfd)  # a dump writing into the parent's directory
    try:
        with pytest.raises(errors.InvalidRequestError, match="another dump is writing into parent directory #1"):
            _dump(bfd, {1: os.urandom(CHUNK)}, parent_fds=[pfd])
    finally:
        held.release()
    assert [n for n in os.listdir(pp) if n.startswith(".child.")] == [f".child.{am.image_id.hex()}"]


def test_a_parent_cannot_be_replaced_while_a_child_of_it_is_being_dumped(tmp_path):
    """A child dump holds its parent directory's lock, shared, from before it reads the parent to its end.
    A dump replacing the parent in between would see no mark yet, and the child would then commit against
    an image that is gone: it is refused, and the child commits against the image it read."""
    (pp, pfd), (_cp, cfd) = _dirs(tmp_path, "parent", "child")
    parent = os.urandom(CHUNK)
    pm = _dump(pfd, {1: parent})
    fd = memfd(parent)

    async def go():
        async with engine(staging_budget=16 * MiB, chunk_size=CHUNK) as e:
            s = await inproc.start_dump(e, cfd, parent_fds=[pfd])
            async with s:
                await s.add([BoSpec(1, CHUNK, BoRef("mmap", fd))])
                with pytest.raises(errors.InvalidRequestError, match="reads its image as its parent"):
                    await inproc.start_dump(e, pfd)  # replacing the parent: no mark there yet
                return await s.finish()
    try:
        cm = run(go())
    finally:
        os.close(fd)
    assert [p.image_id for p in cm.parents] == [pm.image_id]
    assert (pp / f".child.{cm.image_id.hex()}").exists()
    assert _restore(cfd, {1: CHUNK}, parent_fds=[pfd])[1] == parent


def test_a_failed_child_dump_leaves_no_mark(tmp_path):
    (pp, pfd), (cp, cfd) = _dirs(tmp_path, "parent", "child")
    _dump(pfd, {1: os.urandom(CHUNK)})
    fd = memfd(os.urandom(CHUNK))

    async def go():
        async with engine(staging_budget=16 * MiB, chunk_size=CHUNK) as e:
            s = await inproc.start_dump(e, cfd, parent_fds=[pfd])
            async with s:
                await s.add([BoSpec(1, CHUNK, BoRef("mmap", fd))])
                await s.cancel("test")
                await s.finish()
    try:
        with pytest.raises(errors.JobCancelledError):
            run(go())
    finally:
        os.close(fd)
    assert not [n for n in os.listdir(pp) if n.startswith(".child.")]
    assert not (cp / MANIFEST_NAME).exists()


def test_parent_records_anyone_else_may_write_are_checked_by_content_hash(tmp_path):
    """A parent whose data files only the child's owner can write is trusted as the child's own records;
    one that others may write is verified against BLAKE3 content hashes (xxh3 does not stop a forger)."""
    from vramd.imagedir import ImageFiles, read_image
    (pp, pfd), (_cp, cfd) = _dirs(tmp_path, "parent", "child")
    parent = {1: os.urandom(2 * CHUNK)}
    pm = _dump(pfd, parent)
    _dump(cfd, {1: parent[1], 2: os.urandom(CHUNK)}, parent_fds=[pfd])

    async def trust():
        with ImageFiles(cfd, [pfd]) as files:
            r = await read_image(files)
            try:
                locs = [r.locate(r.bos[1], i) for i in range(2)]
                return r._trusted, [loc.foreign for loc in locs]
            finally:
                r.close()
    assert run(trust()) == ([True, True], [False, False])
    (pp / pm.files[0].name).chmod(0o664)  # group-writable: someone else could have forged its records
    assert run(trust()) == ([True, False], [True, True])
    assert _restore(cfd, {1: 2 * CHUNK, 2: CHUNK}, parent_fds=[pfd])[1] == parent[1]


def test_flatten_of_a_chain_with_deltas_restores_without_parents(tmp_path):
    from vramd.imagedir.flatten import flatten
    dirs = _dirs(tmp_path, "g0", "g1", "g2", "flat")
    states = [{1: bf16_like(3 * CHUNK, 5)}]
    _dump(dirs[0][1], states[0])  # codec none: the flattened deltas still decode
    for k in (1, 2):
        w = bytearray(states[-1][1])
        for i in range(k * 13, len(w), 997):  # other bytes each step
            w[i] ^= 1
        states.append({1: bytes(w)})
        m = _dump(dirs[k][1], states[k], parent_fds=[d[1] for d in reversed(dirs[:k])])
    assert m.totals.delta_bytes == 3 * CHUNK
    flat = run(flatten(dirs[2][1], [dirs[1][1], dirs[0][1]], dirs[3][1]))
    assert not flat.parents and flat.totals.record_count == 3 and flat.compression.codec == pb.CODEC_ZSTD
    assert _restore(dirs[3][1], {1: 3 * CHUNK}) == states[2]
    _verify(dirs[3][1])


def test_a_record_longer_than_its_chunk_is_a_corrupt_manifest(tmp_path):
    """A reader reads a whole record into its staging slot: a manifest may not make it longer than any record
    of its chunk can be (v2's chunk table and v1's record lists alike)."""
    (path, dfd), = _dirs(tmp_path, "img")
    _dump(dfd, {1: os.urandom(CHUNK)})
    m = decode_manifest((path / MANIFEST_NAME).read_bytes())
    m.chunks.length[0] = 64 << 20
    (path / MANIFEST_NAME).write_bytes(encode_manifest(m))
    with pytest.raises(errors.CorruptManifestError, match="longer"):
        _restore(dfd, {1: CHUNK})
    v1path, v1fd = v1_image(tmp_path)
    m = decode_manifest((v1path / MANIFEST_NAME).read_bytes())
    m.bos[3].record_lengths[0] = 1 << 20
    (v1path / MANIFEST_NAME).write_bytes(encode_manifest(m))
    with pytest.raises(errors.CorruptManifestError, match="longer"):
        _verify(v1fd)


def test_a_parent_entry_naming_a_file_the_parent_lacks_is_a_corrupt_manifest(tmp_path):
    (_pp, pfd), (cp, cfd) = _dirs(tmp_path, "parent", "child")
    parent = {1: os.urandom(CHUNK)}
    _dump(pfd, parent)
    _dump(cfd, {1: parent[1], 2: os.urandom(CHUNK)}, parent_fds=[pfd])
    m = decode_manifest((cp / MANIFEST_NAME).read_bytes())
    i = list(m.chunks.image).index(1)
    m.chunks.file_index[i] = 7
    (cp / MANIFEST_NAME).write_bytes(encode_manifest(m))
    with pytest.raises(errors.CorruptManifestError, match="no such file"):
        _restore(cfd, {1: CHUNK, 2: CHUNK}, parent_fds=[pfd])


def test_a_delta_against_a_parent_dumped_without_dedup_keeps_a_plain_base(tmp_path):
    """A parent without dedup may hold the same bytes twice, once as a delta: a child's base is the plain one."""
    dirs = _dirs(tmp_path, "g0", "g1", "g2")
    w0 = bf16_like(CHUNK, 21)
    w1 = bytearray(w0)
    w1[100] ^= 1
    _dump(dirs[0][1], {1: w0})
    # g1: BO 1 is a delta of g0's chunk; BO 2 holds the same bytes again, stored plain (no dedup)
    m1 = _dump(dirs[1][1], {2: bytes(w1), 1: bytes(w1)}, parent_fds=[dirs[0][1]], dedup=False)
    assert m1.totals.delta_bytes >= CHUNK
    w2 = bytearray(w1)
    w2[200] ^= 1
    m2 = _dump(dirs[2][1], {1: bytes(w2), 2: bytes(w1)}, parent_fds=[dirs[1][1], dirs[0][1]])
    t = m2.chunks
    assert all(not t.base[b - 1] for b in t.base if b)
    assert _restore(dirs[2][1], {1: CHUNK, 2: CHUNK}, parent_fds=[dirs[1][1], dirs[0][1]]) == {1: bytes(w2),
                                                                                                2: bytes(w1)}


def test_flatten_of_deltas_stored_raw_and_its_bo_files(tmp_path):
    """flatten stores a decoded delta raw where zstd would not shrink it, and gives BOs its own data files."""
    from vramd.imagedir.flatten import flatten
    dirs = _dirs(tmp_path, "p", "c", "flat")
    rnd = os.urandom(CHUNK)
    _dump(dirs[0][1], {1: rnd}, gpus={1: 5})
    c = bytearray(rnd)
    c[7] ^= 1
    _dump(dirs[1][1], {1: bytes(c), 2: bytes(CHUNK)}, gpus={1: 5, 2: 9}, parent_fds=[dirs[0][1]],
          compression="zstd")
    flat = run(flatten(dirs[1][1], [dirs[0][1]], dirs[2][1]))
    assert [f.gpu_id for f in flat.files] == [5]
    assert [b.file_index for b in flat.bos] == [0, 0]
    assert _restore(dirs[2][1], {1: CHUNK, 2: CHUNK}) == {1: bytes(c), 2: bytes(CHUNK)}


def test_a_child_marks_only_parent_directories_its_client_may_write(tmp_path):
    """No client can block another user's image with a mark: the client marks a parent's directory itself,
    with its own rights, so only where it may write (the daemon marks nothing); the child still restores.
    Here the parent's directory is seen through a read-only bind mount (root may write anywhere else)."""
    import subprocess
    if os.geteuid() != 0:
        pytest.skip("needs root, to bind-mount the parent's directory read-only")
    (pp, pfd), (_cp, cfd) = _dirs(tmp_path, "parent", "child")
    parent = {1: os.urandom(CHUNK)}
    _dump(pfd, parent)
    ro = tmp_path / "parent-ro"
    ro.mkdir()
    if subprocess.run(["mount", "--bind", str(pp), str(ro)], capture_output=True).returncode != 0:
        pytest.skip("bind mounts are not allowed here")
    try:
        subprocess.run(["mount", "-o", "remount,ro,bind", str(ro)], check=True, capture_output=True)
        rofd = os.open(ro, os.O_RDONLY | os.O_DIRECTORY)
        try:
            m = _dump(cfd, {1: os.urandom(CHUNK), 2: parent[1]}, parent_fds=[rofd])
        finally:
            os.close(rofd)
    finally:
        subprocess.run(["umount", str(ro)], check=True)
    assert m.totals.parent_bytes == CHUNK
    assert not [n for n in os.listdir(pp) if n.startswith(".child.")]
    assert _restore(cfd, {2: CHUNK}, parent_fds=[pfd], allow_partial=True)[2] == parent[1]
