"""vramd.hostmem.batchcopy: the C module and the Python fallback give the same results, and the engine
round-trips through either."""
from __future__ import annotations

import mmap
import os

import pytest
import xxhash
from helpers import Workload, blank_spec_like, engine, memfd, run

from vramd.backends import BoRef
from vramd.engine import BoSpec, RestoreTarget
from vramd.hostmem import batchcopy
from vramd.hostmem.batchcopy import END_OF_FILE, HASH, RECORD, ZERO, Copy, copy_batch
from vramd.hostmem.staging import StagingBuffer
from vramd.image.codec import record_head
from vramd.pb import image_pb2 as pb
from vramd.units import MiB


@pytest.fixture(params=["native", "python"])
def flavour(request, monkeypatch):
    if request.param == "native":
        if not batchcopy.NATIVE:
            pytest.skip("vramd.hostmem._copy is not built (needs <xxhash.h>: libxxhash-dev)")
    else:
        monkeypatch.setattr(batchcopy, "_copy", None)
    return request.param


def _buffer(n: int) -> StagingBuffer:
    return StagingBuffer(n, mmap.mmap(-1, n))


def test_copies_hash_and_zero_scan(flavour):
    data = os.urandom(3 * batchcopy.BLOCK + 123)  # several C blocks and a ragged end
    src, dst = memfd(data), memfd(b"\0" * len(data))
    buf, zeros = _buffer(4 << 20), _buffer(1 << 20)
    try:
        n = len(data)
        copies = [Copy(src, 0, -1, buf.address, n), Copy(-1, zeros.address, -1, buf.address + n, 5000)]
        outs, failed = copy_batch(copies, HASH | ZERO)
        assert failed == -1
        assert bytes(buf.view[:n]) == data and bytes(buf.view[n:n + 5000]) == bytes(5000)
        assert outs[0].hash == xxhash.xxh3_64_intdigest(data) and not outs[0].zero and outs[0].done == n
        assert outs[1].zero and outs[1].hash == xxhash.xxh3_64_intdigest(bytes(5000))
        outs, failed = copy_batch([Copy(-1, buf.address, dst, 0, n)])  # memory -> fd
        assert failed == -1 and os.pread(dst, n + 1, 0) == data
    finally:
        os.close(src)
        os.close(dst)


def test_record_payload_hash_and_end_of_file(flavour):
    payload = os.urandom(700_000)
    head = record_head(5, 0, len(payload), pb.CODEC_RAW, len(payload), xxhash.xxh3_64_intdigest(payload))
    f = memfd(b"x" * 100 + head + payload)
    buf = _buffer(1 << 20)
    try:
        n = len(head) + len(payload)
        outs, failed = copy_batch([Copy(f, 100, -1, buf.address, n, 0, n)], HASH | RECORD)
        assert failed == -1 and outs[0].payload_at == len(head)
        assert outs[0].hash == xxhash.xxh3_64_intdigest(payload)
        # a record read that runs past the end of the file: where it stopped, and why
        outs, failed = copy_batch([Copy(f, 0, -1, buf.address, 64), Copy(f, 100, -1, buf.address, n + 10, 0, n)],
                                  HASH | RECORD)
        assert failed == 1 and outs[1].err == END_OF_FILE and outs[1].done == n
    finally:
        os.close(f)


def test_engine_round_trip(flavour, image_dir):
    """Dump and restore procmem and memfd BOs, big and small, through whichever copier is in use."""
    _, dfd = image_dir
    spec = [{"size": 3 * MiB + 5, "seed": 1}, {"size": 4096, "seed": 2}, {"size": 2 * MiB, "fill": "zero"}]
    content = os.urandom(5 * MiB + 17)
    src, dst = memfd(content), memfd(b"\xee" * len(content))
    try:
        with Workload(spec) as w:
            mem = w.open_mem()
            try:
                bos = [BoSpec(i + 1, r["size"], BoRef("procmem", mem, r["addr"])) for i, r in enumerate(w.regions)]
                bos.append(BoSpec(9, len(content), BoRef("mmap", src)))

                async def dump():
                    async with engine(chunk_size=1 * MiB, staging_budget=16 * MiB) as e:
                        await e.dump(dfd, bos)
                run(dump())
            finally:
                os.close(mem)
            regions, want = w.regions, w.digests()
        with Workload(blank_spec_like(regions)) as t:
            mem = t.open_mem(os.O_RDWR)
            try:
                async def restore():
                    async with engine(chunk_size=1 * MiB, staging_budget=16 * MiB) as e:
                        targets = [RestoreTarget(i + 1, BoRef("procmem", mem, r["addr"]))
                                   for i, r in enumerate(regions)]
                        await e.restore(dfd, [*targets, RestoreTarget(9, BoRef("mmap", dst))])
                        await e.verify(dfd)
                run(restore())
            finally:
                os.close(mem)
            assert t.digests() == want
        assert os.pread(dst, len(content) + 1, 0) == content
    finally:
        os.close(src)
        os.close(dst)
