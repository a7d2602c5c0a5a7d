"""Small BOs are coalesced: many pieces per staging buffer, one stage call (thread hop) per batch.

Round trips mix 0..5000-byte BOs (random, patterned and zero-filled) with
multi-chunk BOs, procmem BOs of a child process with memfd BOs (mmap) on one
GPU, so batches hold pieces of many BOs and of two backends.  Damage and
unmapped memory inside a batch must still name the one piece that failed.
"""
import asyncio
import os
from dataclasses import dataclass

import pytest
from helpers import Workload, blank_spec_like, engine, memfd, run

from vramd import errors, inproc
from vramd.backends import BoRef, MmapBackend, ProcMemBackend
from vramd.backends.base import Backend, BoHandle, Capabilities
from vramd.engine import BoSpec, Engine, EngineConfig, RestoreTarget
from vramd.engine.pipeline import HEAD_PAGE, MAX_BATCH, SLOT_ALIGN, ChunkTask, Pipeline, slot_size
from vramd.hostmem.staging import StagingPool, buffer_unit
from vramd.image.codec import Compression
from vramd.image.format import RECORD_PREFIX
from vramd.image.manifest import chunk_record
from vramd.image.names import data_file_name
from vramd.imagedir import ImageFiles, read_image

KiB, MiB = 1 << 10, 1 << 20
CHUNK = 256 * KiB
SMALL = [1, 100, 4 * KiB, 5000, 0]


# --- the pipeline's packing, with recording ends --------------------------

@dataclass(eq=False)
class _FakeBo:  # a PipelineBo
    id: int
    chunks_left: int
    backend: None = None  # copies to no backend (as verify)


class _Recorder:
    """Ends that only record what the pipeline hands them."""

    def __init__(self, chunk_size):
        self.chunk_size, self.buffers_per_chunk = chunk_size, 1
        self.batches, self.calls, self.done = [], {"fill": 0, "transform": 0, "drain": 0}, []

    async def fill(self, tasks, bufs):
        self.calls["fill"] += 1
        self.batches.append([(t.bo.id, t.index, t.length, t.buf_offset) for t in tasks])
        return len(tasks)

    def transform(self, tasks, bufs, filled):
        self.calls["transform"] += 1
        assert filled == len(tasks)
        return filled

    async def drain(self, tasks, bufs, product):
        self.calls["drain"] += 1
        assert product == len(tasks)

    def bo_done(self, bo):
        self.done.append(bo.id)


def _feed(pipe, sizes, chunk_size, gpu=0):
    bos = []
    for i, size in enumerate(sizes):
        n = -(-size // chunk_size)
        bo = _FakeBo(i + 1, n)
        bos.append(bo)
        pipe.add(gpu, iter([ChunkTask(bo, k, k * chunk_size, min(chunk_size, size - k * chunk_size))
                            for k in range(n)]), size)
    return bos


def _run_recorded(sizes, chunk_size, budget=64 * MiB, workers=4):
    from concurrent.futures import ThreadPoolExecutor

    async def go():
        pool, cpu = StagingPool(budget), ThreadPoolExecutor(2)
        ends = _Recorder(chunk_size)
        try:
            pipe = Pipeline(ends, pool, cpu, workers_per_gpu=workers)
            _feed(pipe, sizes, chunk_size)
            progress = await pipe.wait()
        finally:
            cpu.shutdown()
            pool.close()
        return ends, progress
    return run(go())


def _check_batches(ends, sizes, chunk_size):
    want = {(i + 1, k) for i, s in enumerate(sizes) for k in range(-(-s // chunk_size))}
    seen = [(b, k) for batch in ends.batches for b, k, _, _ in batch]
    assert len(seen) == len(set(seen)) and set(seen) == want  # every chunk exactly once: none lost to a carry
    for batch in ends.batches:
        assert 1 <= len(batch) <= MAX_BATCH
        assert batch[0][3] == HEAD_PAGE  # every piece has its head page before it
        end = 0
        for _, _, length, off in batch:
            # page-aligned slots (head page, then the bytes) that do not overlap
            assert off % SLOT_ALIGN == 0 and off - HEAD_PAGE >= end
            end = off - HEAD_PAGE + slot_size(length)
        assert end <= buffer_unit(chunk_size)
        if any(length == chunk_size for _, _, length, _ in batch):
            assert len(batch) == 1  # a whole chunk is a batch of its own
    n = len(ends.batches)
    assert ends.calls == {"fill": n, "transform": n, "drain": n}  # one call per stage per batch


def test_small_chunks_share_a_staging_buffer():
    sizes = [1] * 1000
    ends, progress = _run_recorded(sizes, 8 * MiB)
    _check_batches(ends, sizes, 8 * MiB)
    assert max(map(len, ends.batches)) == MAX_BATCH  # bounded by the iovec limit, not the buffer
    assert len(ends.batches) < 10
    assert progress.chunks_done == progress.bos_done == 1000 and progress.bytes_done == 1000
    assert sorted(ends.done) == list(range(1, 1001))


def test_packing_of_mixed_sizes_with_carry_over():
    cs = 64 * KiB
    sizes = ([1, 100, 4096, 4097, 5000, cs - 1, cs, 3 * cs + 5, 20 * KiB, 2 * cs, 8191] * 40)
    for budget, workers in ((64 * MiB, 4), (3 * (cs + 4096), 8)):  # ample, and starved (workers wait for buffers)
        ends, progress = _run_recorded(sizes, cs, budget=budget, workers=workers)
        _check_batches(ends, sizes, cs)
        assert max(map(len, ends.batches)) >= 5
        assert progress.bos_done == len(sizes) and progress.bytes_done == sum(sizes)


# --- Backend.submit_many: one future for many copies ----------------------

class _Manual(Backend):
    """A backend whose copies complete when the test says so (like DMA fences)."""

    name = "manual"

    def __init__(self):
        self.futs = []

    @classmethod
    def create(cls, options):
        return cls()

    def capabilities(self):
        return Capabilities(self.name, True, True, 1, 1, True, "test")

    def open(self, bo_id, ref, size, gpu_id, direction, checked=None):
        return BoHandle(bo_id, ref, size, gpu_id, direction)

    def submit(self, handle, bo_offset, buf, buf_offset, length):
        fut = asyncio.get_running_loop().create_future()
        self.futs.append(fut)
        return fut


async def _turns(n=5):
    """Let the loop run n rounds of ready callbacks (no timers)."""
    loop = asyncio.get_running_loop()
    for _ in range(n):
        f = loop.create_future()
        loop.call_soon(f.set_result, None)
        await f


def test_default_submit_many_waits_for_every_copy_and_raises_the_first_error():
    async def go():
        b = _Manual()
        h = b.open(1, BoRef("manual", -1), 10, 0, None)
        fut = b.submit_many([(h, i, None, 0, 1) for i in range(3)])
        b.futs[2].set_exception(errors.BackendError("third"))
        b.futs[1].set_exception(errors.BackendError("second"))
        await _turns()
        assert not fut.done()  # a copy is still in flight: its staging buffer must not be reused
        fut.cancel()  # cancelling the batch does not abandon its copies
        await _turns()
        assert not fut.done()
        b.futs[0].set_result(None)
        with pytest.raises(asyncio.CancelledError):
            await fut

        fut = b.submit_many([(h, i, None, 0, 1) for i in range(3, 6)])
        b.futs[5].set_exception(errors.BackendError("sixth"))
        b.futs[4].set_exception(errors.BackendError("fifth"))
        await _turns()
        assert not fut.done()
        b.futs[3].set_result(None)
        with pytest.raises(errors.BackendError, match="fifth"):  # the first in item order
            await fut
    run(go())


# --- real round trips -------------------------------------------------------

class _CountingProcMem(ProcMemBackend):
    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.batches = []

    def submit_many(self, items):
        self.batches.append(len(items))
        return super().submit_many(items)


class _CountingMmap(MmapBackend):
    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.batches = []

    def submit_many(self, items):
        self.batches.append(len(items))
        return super().submit_many(items)


def _counting_engine(**kw):
    """An engine whose backends count submissions, and which counts its batches (stage_times)."""
    backends = {"procmem": _CountingProcMem(workers_per_gpu=4), "mmap": _CountingMmap(workers_per_gpu=4)}
    return Engine(EngineConfig(stage_times=True, **kw), backends=backends), backends


def _small_spec(n, seed):
    out = []  # (defaults left out: the spec travels as one argv string)
    for i in range(n):
        r = {"size": SMALL[i % len(SMALL)], "seed": seed + i}
        if i % 7 == 3:
            r = {"size": r["size"], "fill": "zero"}
        elif i % 3 == 0:
            r["fill"] = "pattern"
        if i % 4 == 1:
            r["skew"] = (i * 997) % 4096
        out.append(r)
    # a few multi-chunk BOs among them: their tails are small pieces batched with the rest
    for at, extra in ((0, {"size": 3 * CHUNK + 123, "fill": "random", "seed": 5}),
                      (n // 2, {"size": 2 * CHUNK, "fill": "zero"}),
                      (n // 3, {"size": CHUNK + 4096 + 1, "fill": "pattern", "seed": 6, "skew": 17}),
                      (n, {"size": 5 * CHUNK - 1, "fill": "random", "seed": 7})):
        out.insert(at, extra)
    return out


def _mmap_contents(n):
    rng = __import__("random").Random(11)
    out = []
    for i in range(n):
        size = SMALL[(i + 2) % len(SMALL)]
        out.append(bytes(size) if i % 5 == 1 else rng.randbytes(size))
    out[n // 4] = rng.randbytes(2 * CHUNK + 77)  # multi-chunk
    return out


@pytest.mark.parametrize("compression", ["none", "zstd"])
def test_two_thousand_small_bos_round_trip(image_dir, compression):
    """1,700 small procmem BOs plus 300 small memfd BOs, and multi-chunk ones, in one job on two GPUs."""
    _, dfd = image_dir
    spec = _small_spec(1700, seed=100)
    contents = _mmap_contents(300)
    src_fds = [memfd(c) for c in contents]
    dst_fds = [memfd(b"\xee" * len(c)) for c in contents]
    try:
        with Workload(spec) as src:
            want = [r["digest"] for r in src.regions]
            regions = src.regions
            mem = src.open_mem()
            specs = [BoSpec(i + 1, r["size"], BoRef("procmem", mem, r["addr"]), gpu_id=int(i % 10 == 9))
                     for i, r in enumerate(regions)]
            mspecs = [BoSpec(10_001 + i, len(c), BoRef("mmap", fd), gpu_id=int(i % 10 == 9))
                      for i, (c, fd) in enumerate(zip(contents, src_fds))]
            # interleave the backends: batches hold pieces of both
            mixed = []
            for i, s in enumerate(specs):
                mixed.append(s)
                if i % 7 == 0 and mspecs:
                    mixed.append(mspecs.pop())
            mixed += mspecs
            try:
                async def dump():
                    e, _ = _counting_engine(staging_budget=4 * MiB, chunk_size=CHUNK)
                    async with e:
                        m = await inproc.dump(e, dfd, mixed, compression=Compression.parse(compression))
                    return m, e.stage_times
                manifest, times = run(dump())
            finally:
                os.close(mem)
        assert manifest.totals.bo_count == len(spec) + len(contents)
        assert manifest.totals.bo_bytes == sum(r["size"] for r in spec) + sum(map(len, contents))
        stripes = EngineConfig(staging_budget=4 * MiB, chunk_size=CHUNK).data_files_per_gpu
        assert sorted((f.gpu_id, f.name) for f in manifest.files) == sorted(  # two GPUs, each with its stripes
            (g, data_file_name(manifest.image_id, g, k)) for g in (0, 1) for k in range(stripes))
        zero_bo = next(b for b in manifest.bos if b.size == 2 * CHUNK)
        assert zero_bo.zero_bytes == 2 * CHUNK
        pieces = manifest.totals.chunk_count
        assert times.pieces == pieces
        assert times.batches * 10 < pieces  # batched: far fewer batches (thread hops) than pieces
        assert times.largest > 20

        target = blank_spec_like(regions)
        for r in target:  # keep the spec (one argv string) short
            if not r["skew"]:
                del r["skew"]
        with Workload(target) as dst:
            mem = dst.open_mem(os.O_RDWR)
            try:
                async def restore():
                    e, _ = _counting_engine(staging_budget=4 * MiB, chunk_size=CHUNK)
                    async with e:
                        targets = [RestoreTarget(i + 1, BoRef("procmem", mem, r["addr"]))
                                   for i, r in enumerate(regions)]
                        targets += [RestoreTarget(10_001 + i, BoRef("mmap", fd)) for i, fd in enumerate(dst_fds)]
                        p = await inproc.restore(e, dfd, targets)
                        batches = e.stage_times.batches
                        report = await inproc.verify(e, dfd)
                    return p, report, batches
                progress, report, batches = run(restore())
            finally:
                os.close(mem)
            assert dst.digests() == want
        for c, fd in zip(contents, dst_fds):
            assert os.pread(fd, len(c) + 1, 0) == c
        assert progress.bos_done == progress.bos_total == len(spec) + len(contents)
        assert progress.chunks_done == pieces and progress.bytes_done == manifest.totals.bo_bytes
        assert report.progress.chunks_done == pieces
        assert batches * 10 < pieces
    finally:
        for fd in src_fds + dst_fds:
            os.close(fd)


# --- errors inside a batch name their piece --------------------------------

@pytest.fixture(params=["none", "zstd"])
def batched_image(request, image_dir):
    """300 memfd BOs of 4 KiB (and one two-chunk BO), dumped in batches; returns the original bytes too."""
    path, dfd = image_dir
    rng = __import__("random").Random(3)
    data = {i: (rng.randbytes(2048) * 2 if i % 2 else rng.randbytes(4096)) for i in range(1, 301)}
    data[77] = rng.randbytes(CHUNK + 300)  # its second chunk (300 bytes) is a small piece
    fds = {i: memfd(d) for i, d in data.items()}
    try:
        async def go():
            async with engine(staging_budget=4 * MiB, chunk_size=CHUNK) as e:
                return await inproc.dump(e, dfd, [BoSpec(i, len(d), BoRef("mmap", fds[i])) for i, d in data.items()],
                                    compression=Compression.parse(request.param))
        manifest = run(go())
    finally:
        for fd in fds.values():
            os.close(fd)
    return path, dfd, manifest, data


def _rec(manifest, bo_id, chunk=0):
    bo = next(b for b in manifest.bos if b.id == bo_id)
    fi, off, ln, _ = chunk_record(manifest, bo, chunk)
    return manifest.files[fi].name, off, ln


def _flip(path, offset):
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x40]))


def _restore_all(dfd, data):
    fds = {i: memfd(size=len(d)) for i, d in data.items()}
    try:
        async def go():
            async with engine(staging_budget=4 * MiB, chunk_size=CHUNK) as e:
                return await inproc.restore(e, dfd, [RestoreTarget(i, BoRef("mmap", fd)) for i, fd in fds.items()])
        progress = run(go())
        return progress, {i: os.pread(fd, len(data[i]), 0) for i, fd in fds.items()}
    finally:
        for fd in fds.values():
            os.close(fd)


def _verify(dfd):
    async def go():
        async with engine(staging_budget=4 * MiB) as e:
            return await inproc.verify(e, dfd)
    return run(go())


def test_batched_image_is_intact(batched_image):
    _, dfd, manifest, data = batched_image
    # neighbours' records are back to back: they were written by one vectored write
    for i in (150, 151):
        _, off, ln = _rec(manifest, i)
        assert _rec(manifest, i + 1)[1] == off + ln
    _, got = _restore_all(dfd, data)
    assert got == data
    assert _verify(dfd).progress.chunks_done == manifest.totals.chunk_count


@pytest.mark.parametrize("bo_id, chunk", [(150, 0), (77, 1)])
def test_corrupt_payload_inside_a_batch_names_its_bo(batched_image, bo_id, chunk):
    path, dfd, manifest, data = batched_image
    name, off, length = _rec(manifest, bo_id, chunk)
    assert any(_rec(manifest, j)[1] == off + length for j in data if j != bo_id)  # a record follows it
    _flip(path / name, off + length - 1)  # the last payload byte
    for action in (lambda: _restore_all(dfd, data), lambda: _verify(dfd)):
        with pytest.raises(errors.CorruptChunkError) as ei:
            action()
        assert (ei.value.bo_id, ei.value.offset) == (bo_id, chunk * CHUNK)
        assert "checksum" in str(ei.value) and name in str(ei.value)


def test_corrupt_header_inside_a_batch_names_its_bo(batched_image):
    path, dfd, manifest, data = batched_image
    name, off, _ = _rec(manifest, 151)
    _flip(path / name, off + RECORD_PREFIX.size + 2)  # its head is read together with bo 150's payload
    with pytest.raises(errors.CorruptChunkError, match="header checksum") as ei:
        _restore_all(dfd, data)
    assert (ei.value.bo_id, ei.value.offset) == (151, 0)


@pytest.mark.parametrize("cut_at, named", [(+10, 151), (-10, 150)])
def test_data_file_shrinking_under_a_restore_names_the_record_it_cuts(image_dir, cut_at, named):
    """Bo 151's head is read by the same preadv as the end of bo 150's payload; a file cut there
    names the record the cut falls in.  (One worker each way: records, and reads, in BO order.)"""
    path, dfd = image_dir
    data = {i: os.urandom(4096) for i in range(1, 301)}
    fds = {i: memfd(d) for i, d in data.items()}
    try:
        async def dump():
            async with engine(staging_budget=4 * MiB, chunk_size=CHUNK, workers_per_gpu=1) as e:
                return await inproc.dump(e, dfd, [BoSpec(i, len(d), BoRef("mmap", fds[i])) for i, d in data.items()])
        manifest = run(dump())
    finally:
        for fd in fds.values():
            os.close(fd)
    name, off, _ = _rec(manifest, 151)
    assert _rec(manifest, 150)[1] + _rec(manifest, 150)[2] == off
    fds = {i: memfd(size=len(d)) for i, d in data.items()}
    try:
        async def restore():
            async with engine(staging_budget=4 * MiB, chunk_size=CHUNK, workers_per_gpu=1) as e:
                with ImageFiles(dfd) as files:
                    job = e.start_restore(await read_image(files))  # the data file was checked whole here...
                    os.truncate(path / name, off + cut_at)  # ...and shrinks afterwards
                    job.add([RestoreTarget(i, BoRef("mmap", fd)) for i, fd in fds.items()])
                    await job.finish()
        with pytest.raises(errors.TruncatedDataError) as ei:
            run(restore())
    finally:
        for fd in fds.values():
            os.close(fd)
    assert (ei.value.bo_id, ei.value.offset) == (named, 0)
    assert name in str(ei.value)


# The region with a hole is the child's last mapping (a later one could land in the hole);
# its BO is queued in the middle of the others, so it is one piece of a batch.

def test_unmapped_page_in_one_piece_of_a_dump_batch(image_dir):
    path, dfd = image_dir
    spec = [{"size": 4096, "seed": i} for i in range(59)]
    spec.append({"size": 3 * 4096, "seed": 99, "holes": [[4096, 4096]]})
    contents = [os.urandom(3000) for _ in range(20)]
    fds = [memfd(c) for c in contents]
    try:
        with Workload(spec) as w:
            mem = w.open_mem()
            specs = [BoSpec(i + 1, r["size"], BoRef("procmem", mem, r["addr"])) for i, r in enumerate(w.regions)]
            specs.insert(30, specs.pop())  # bo 60, between bos 30 and 31
            specs[10:10] = [BoSpec(500 + i, len(c), BoRef("mmap", fd)) for i, (c, fd) in enumerate(zip(contents, fds))]
            try:
                async def go():
                    e, _ = _counting_engine(staging_budget=4 * MiB, chunk_size=CHUNK, workers_per_gpu=1)
                    async with e:
                        with pytest.raises(errors.UnmappedRangeError) as ei:
                            await inproc.dump(e, dfd, specs)
                    return ei.value, e.stage_times
                err, times = run(go())
            finally:
                os.close(mem)
            addr = w.regions[59]["addr"]
    finally:
        for fd in fds:
            os.close(fd)
    assert (err.bo_id, err.offset) == (60, 4096) and f"address {addr + 4096:#x}" in err.message  # (on the wire: named)
    assert times.largest > 1  # the failing copy was one piece of a batch
    assert os.listdir(path) == []  # a failed dump leaves nothing


def test_unmapped_page_in_one_piece_of_a_restore_batch(image_dir):
    _, dfd = image_dir
    spec = [{"size": 4096, "seed": i} for i in range(39)] + [{"size": 3 * 4096, "seed": 99}]
    with Workload(spec) as src:
        mem = src.open_mem()
        try:
            async def dump():
                async with engine(staging_budget=4 * MiB, chunk_size=CHUNK) as e:
                    await inproc.dump(e, dfd, [BoSpec(i + 1, r["size"], BoRef("procmem", mem, r["addr"]))
                                       for i, r in enumerate(src.regions)])
            run(dump())
        finally:
            os.close(mem)
        regions = src.regions
    target = blank_spec_like(regions)
    target[39]["holes"] = [[4096, 4096]]  # the target BO's middle page is gone
    with Workload(target) as dst:
        mem = dst.open_mem(os.O_RDWR)
        targets = [RestoreTarget(i + 1, BoRef("procmem", mem, r["addr"])) for i, r in enumerate(regions)]
        targets.insert(20, targets.pop())
        try:
            async def restore():
                e, _ = _counting_engine(staging_budget=4 * MiB, chunk_size=CHUNK, workers_per_gpu=1)
                async with e:
                    with pytest.raises(errors.UnmappedRangeError) as ei:
                        await inproc.restore(e, dfd, targets)
                return ei.value, e.stage_times
            err, times = run(restore())
        finally:
            os.close(mem)
    assert (err.bo_id, err.offset) == (40, 4096) and f"address {regions[39]['addr'] + 4096:#x}" in err.message
    assert times.largest > 1


def test_internal_error_in_one_piece_is_attributed_to_it(image_dir, monkeypatch):
    """A bug (not a VramdError) while encoding one piece of a batch still names that piece,
    and the error kept by the job pins no staging buffer (the engine can still unmap them)."""
    from vramd.engine.jobs import dump as jobs

    _, dfd = image_dir
    def buggy(real):
        def encode(bo_id, offset, *a, **kw):
            if bo_id == 250:  # in the fourth batch of the only worker, not at its start
                raise ZeroDivisionError("boom")
            return real(bo_id, offset, *a, **kw)
        return encode
    monkeypatch.setattr(jobs, "encode_chunk", buggy(jobs.encode_chunk))  # the three stages
    monkeypatch.setattr(jobs, "record_head", buggy(jobs.record_head))    # a whole batch in a copy thread
    fds = [memfd(os.urandom(100)) for _ in range(300)]
    try:
        async def go():
            async with engine(staging_budget=4 * MiB, chunk_size=CHUNK, workers_per_gpu=1) as e:
                await inproc.dump(e, dfd, [BoSpec(i, 100, BoRef("mmap", fd)) for i, fd in enumerate(fds)])
        with pytest.raises(errors.JobError, match="internal error") as ei:
            run(go())
    finally:
        for fd in fds:
            os.close(fd)
    assert (ei.value.bo_id, ei.value.offset) == (250, 0)
