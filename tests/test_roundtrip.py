"""Dump real memory and restore it byte-exact: procmem from child processes, mmap from memfds."""
import os

import pytest
from helpers import Workload, blank_spec_like, engine, memfd, procmem_bos, procmem_targets, run

from vramd import inproc
from vramd.backends import BoRef
from vramd.engine import BoSpec, RestoreTarget
from vramd.image.codec import Compression
from vramd.pb import image_pb2 as pb

MiB = 1 << 20

# Random, zero and patterned regions; unaligned sizes and starts; 0- and 1-byte BOs.
SPEC = [
    {"size": 3 * MiB + 7, "fill": "random", "seed": 1},
    {"size": 5 * MiB, "fill": "zero"},
    {"size": 2 * MiB + 4095, "fill": "pattern", "seed": 9, "skew": 123},
    {"size": 0, "fill": "random"},
    {"size": 1, "fill": "random", "seed": 3},
    {"size": 4097, "fill": "random", "seed": 4, "skew": 4095},
    {"size": 1 * MiB, "fill": "zero", "marks": [[MiB - 1, "ff"]]},  # one byte off a hole
]


@pytest.mark.parametrize("compression", ["none", "zstd", "zstd:5"])
def test_procmem_round_trip_into_fresh_process(image_dir, compression):
    _, dfd = image_dir
    with Workload(SPEC) as src:
        want = [r["digest"] for r in src.regions]
        mem = src.open_mem()
        try:
            async def dump():
                async with engine(staging_budget=16 * MiB, chunk_size=1 * MiB) as e:
                    # two "GPUs" so two worker pools run at once
                    return await inproc.dump(e, dfd, procmem_bos(src, mem, gpu_of=lambda i: i % 2),
                                        compression=Compression.parse(compression))
            manifest = run(dump())
        finally:
            os.close(mem)
        regions = src.regions
    assert manifest.totals.bo_count == len(SPEC)
    assert manifest.totals.bo_bytes == sum(r["size"] for r in SPEC)
    assert sorted({f.gpu_id for f in manifest.files}) == [0, 1]  # each GPU's data files
    # the all-zero region became holes; the one with a single non-zero byte did not
    assert manifest.totals.zero_bytes == 5 * MiB

    with Workload(blank_spec_like(regions)) as dst:
        assert [r["addr"] for r in dst.regions] == [r["addr"] for r in regions]
        assert dst.digests() != want  # garbage before the restore
        mem = dst.open_mem(os.O_RDWR)
        try:
            async def restore():
                async with engine(staging_budget=16 * MiB, chunk_size=2 * MiB) as e:  # other chunk size
                    return await inproc.restore(e, dfd, procmem_targets(dst, mem))
            progress = run(restore())
        finally:
            os.close(mem)
        assert progress.bytes_done == manifest.totals.bo_bytes
        assert progress.bos_done == len(SPEC)
        assert dst.digests() == want


@pytest.mark.parametrize("compression,sealed", [("none", False), ("zstd", False), ("none", True), ("zstd", True)])
def test_mmap_round_trip_with_memfds(image_dir, compression, sealed):
    """`sealed`: memfds sealed to their size, which the backend maps and copies through the mapping, as it does a
    dmabuf; else read and written with pread/pwrite."""
    _, dfd = image_dir
    contents = [os.urandom(3 * MiB + 5), bytes(2 * MiB), b"", b"\x07", (b"abc" * 1000000)[:MiB + 77]]
    # BO 5 lives at an unaligned offset inside its fd
    fds = [memfd(c, sealed=sealed) for c in contents[:4]] + [memfd(b"\x01" * 333 + contents[4], sealed=sealed)]
    offsets = [0, 0, 0, 0, 333]
    specs = [BoSpec(10 + i, len(c), BoRef("mmap", fd, off), gpu_id=7)
             for i, (c, fd, off) in enumerate(zip(contents, fds, offsets))]
    targets_fds = [memfd(size=len(c) + off, sealed=sealed) for c, off in zip(contents, offsets)]
    for fd in targets_fds:
        os.pwrite(fd, b"\xee" * os.fstat(fd).st_size, 0) if os.fstat(fd).st_size else None
    try:
        async def go():
            async with engine(staging_budget=8 * MiB, chunk_size=1 * MiB, workers_per_gpu=3) as e:
                m = await inproc.dump(e, dfd, specs, compression=Compression.parse(compression))
                await inproc.restore(e, dfd, [RestoreTarget(10 + i, BoRef("mmap", fd, off))
                                      for i, (fd, off) in enumerate(zip(targets_fds, offsets))])
                return m
        manifest = run(go())
        for c, fd, off in zip(contents, targets_fds, offsets):
            assert os.pread(fd, len(c), off) == c
        assert os.pread(targets_fds[4], 333, 0) == b"\xee" * 333  # bytes before the BO untouched
        if compression == "zstd":
            assert any(bo.stored_bytes < bo.size for bo in manifest.bos if bo.id == 14)
        assert {bo.source for bo in manifest.bos} == {pb.SOURCE_MMAP}
    finally:
        for fd in fds + targets_fds:
            os.close(fd)


@pytest.mark.slow
def test_large_bo_over_4gib_round_trips(image_dir):
    """A BO larger than 4 GiB, mostly zero, with data around the 32-bit boundaries."""
    _, dfd = image_dir
    size = (4 << 30) + 3 * MiB + 12345
    marks = [[0, "0123456789"], [(1 << 32) - 5, "aabbccddeeff00112233"], [(2 << 30) + 17, "5a" * 4096],
             [size - 3, "fedcba"]]
    with Workload([{"size": size, "fill": "sparse", "marks": marks}]) as src:
        want = src.regions[0]["digest"]
        mem = src.open_mem()
        try:
            async def dump():
                async with engine(staging_budget=64 * MiB, chunk_size=8 * MiB) as e:
                    return await inproc.dump(e, dfd, procmem_bos(src, mem))
            manifest = run(dump())
        finally:
            os.close(mem)
        region = src.regions[0]
    bo = manifest.bos[0]
    assert bo.size == size
    assert bo.zero_bytes > size - 4 * 8 * MiB  # holes, not bytes, for the zero pages
    assert manifest.totals.stored_bytes < 4 * 8 * MiB

    with Workload([{"size": size, "at": region["addr"], "fill": "sparse"}]) as dst:
        mem = dst.open_mem(os.O_RDWR)
        try:
            async def restore():
                async with engine(staging_budget=64 * MiB) as e:
                    return await inproc.restore(e, dfd, procmem_targets(dst, mem))
            run(restore())
        finally:
            os.close(mem)
        assert dst.digests() == [want]


def test_verify_reads_every_chunk(image_dir):
    _, dfd = image_dir
    data = os.urandom(5 * MiB + 3)
    fd = memfd(data)
    try:
        async def go():
            async with engine(staging_budget=8 * MiB, chunk_size=1 * MiB) as e:
                await inproc.dump(e, dfd, [BoSpec(1, len(data), BoRef("mmap", fd))],
                                  compression=Compression.parse("zstd"))
                return await inproc.verify(e, dfd)
        report = run(go())
    finally:
        os.close(fd)
    assert report.progress.bytes_done == len(data)
    assert report.progress.chunks_done == 6
