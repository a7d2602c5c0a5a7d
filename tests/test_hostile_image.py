"""Hostile images and hostile requests (issue #12): an image is data, never instructions.

A manifest names only plain data-file names of the image's own format; files are
opened O_NOFOLLOW|O_NONBLOCK and must be regular; errors name files and offsets, never
bytes a client may not read; every record is bound to its image; a restore that
cannot move a byte fails; declared sizes cost nothing until bytes move.
"""
from __future__ import annotations

import gc
import os
import threading
import tracemalloc
import weakref
from dataclasses import dataclass

import pytest
from helpers import dump_job, engine, memfd, open_dir, run, v1_contents, v1_image

from vramd import errors, inproc
from vramd.backends import BoRef
from vramd.engine import BoSpec, RestoreTarget
from vramd.engine.pipeline import ChunkTask, Pipeline
from vramd.hostmem.staging import StagingPool, buffer_unit
from vramd.image.manifest import chunk_record, decode_manifest, encode_manifest
from vramd.image.names import MANIFEST_NAME

MiB = 1 << 20
GiB = 1 << 30
SECRET = b"TOPSECRET-0123456789-not-for-the-client"


def _dump(dfd, data: dict[int, bytes], chunk_size=MiB, budget=16 * MiB, compression=None):
    fds = {i: memfd(d) for i, d in data.items()}

    async def go():
        async with engine(staging_budget=budget, chunk_size=chunk_size) as e:
            kw = {"compression": compression} if compression else {}
            return await inproc.dump(e, dfd, [BoSpec(i, len(d), BoRef("mmap", fds[i])) for i, d in data.items()], **kw)
    try:
        return run(go())
    finally:
        for fd in fds.values():
            os.close(fd)


def _restore(dfd, sizes: dict[int, int], budget=16 * MiB):
    targets = {i: memfd(size=n) for i, n in sizes.items()}

    async def go():
        async with engine(staging_budget=budget) as e:
            await inproc.restore(e, dfd, [RestoreTarget(i, BoRef("mmap", fd)) for i, fd in targets.items()])
    try:
        run(go())
        return {i: os.pread(fd, sizes[i], 0) for i, fd in targets.items()}
    finally:
        for fd in targets.values():
            os.close(fd)


def _verify(dfd, budget=16 * MiB):
    async def go():
        async with engine(staging_budget=budget) as e:
            return await inproc.verify(e, dfd)
    return run(go())


def _rewrite_manifest(path, edit):
    m = decode_manifest((path / MANIFEST_NAME).read_bytes())
    edit(m)
    (path / MANIFEST_NAME).write_bytes(encode_manifest(m))


@pytest.fixture
def image(image_dir):
    """(path, dfd, manifest, data): a committed image of two BOs."""
    path, dfd = image_dir
    data = {1: os.urandom(2 * MiB + 100), 2: os.urandom(MiB)}
    return path, dfd, _dump(dfd, data), data


# --- 1. names from a manifest ---------------------------------------------------------------

@pytest.mark.parametrize("bad", ["../victim", ".", "..", "/etc/hostname", "manifest.vrdm", "data-1-2.vrd",
                                 "data-0123456789abcdef-00000000.vrd.tmp", "sub/data-0123456789abcdef-00000000.vrd",
                                 "DATA-0123456789ABCDEF-00000000.vrd", "data-0123456789abcdef-00000000.vrd\n"])
def test_manifest_names_only_its_own_data_files(image, bad):
    path, dfd, _manifest, data = image
    (path.parent / "victim").write_bytes(SECRET)

    def edit(m):
        m.files[0].name = bad
    _rewrite_manifest(path, edit)
    for action in (lambda: _verify(dfd), lambda: _restore(dfd, {i: len(d) for i, d in data.items()})):
        with pytest.raises(errors.CorruptManifestError, match=r"files\[0\]\.name") as ei:
            action()
        assert SECRET[:8].decode() not in str(ei.value)


def test_a_dump_never_removes_files_the_previous_manifest_names_outside(image):
    """The commit removes the replaced image's data files: only names of the image's own format."""
    path, dfd, _manifest, _data = image
    victim = path.parent / "victim"
    victim.write_bytes(SECRET)

    def edit(m):
        m.files[0].name = "../victim"
    _rewrite_manifest(path, edit)
    m2 = _dump(dfd, {7: os.urandom(MiB)})
    assert victim.read_bytes() == SECRET
    assert _restore(dfd, {7: MiB}) and m2.files[0].name in os.listdir(path)


def test_a_symlinked_data_file_is_not_followed(image):
    path, dfd, manifest, data = image
    name = manifest.files[0].name
    outside = path.parent / "elsewhere.vrd"
    os.rename(path / name, outside)  # the real bytes, moved out: following the link would "work"
    os.symlink(outside, path / name)
    for action in (lambda: _verify(dfd), lambda: _restore(dfd, {i: len(d) for i, d in data.items()})):
        with pytest.raises(errors.ForeignDataFileError, match="symbolic link") as ei:
            action()
        assert name in str(ei.value)


def test_a_symlinked_manifest_is_not_followed(image):
    path, dfd, _manifest, _ = image
    secret = path.parent / "secret"
    secret.write_bytes(SECRET * 4)
    os.rename(path / MANIFEST_NAME, path.parent / "real-manifest")
    os.symlink(secret, path / MANIFEST_NAME)
    with pytest.raises(errors.CorruptManifestError, match="symbolic link") as ei:
        _verify(dfd)
    assert SECRET[:8].decode() not in str(ei.value)


class _Unblock:
    """If an open of the FIFO blocks (the bug), open its other end after a while so the test ends."""

    def __init__(self, fifo):
        self.fifo, self.stop = fifo, threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self.stop.wait(5):
            try:
                os.close(os.open(self.fifo, os.O_WRONLY | os.O_NONBLOCK))
            except OSError:
                pass

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join()


def test_a_fifo_data_file_is_refused_without_blocking(image):
    path, dfd, manifest, _ = image
    name = manifest.files[0].name
    os.unlink(path / name)
    os.mkfifo(path / name)

    async def go():
        async with engine(staging_budget=16 * MiB) as e:
            with pytest.raises(errors.ForeignDataFileError, match="not a regular file") as ei:
                await inproc.verify(e, dfd)
        return ei.value
    with _Unblock(path / name):
        err = run(go())
    assert name in str(err)


def test_a_fifo_in_an_image_does_not_stall_the_daemon(daemon, image):
    """Another client is served while (and after) one opens an image holding a FIFO."""
    from vramd.client import SESSION_VERIFY, Client
    path, dfd, manifest, _ = image
    name = manifest.files[0].name
    os.unlink(path / name)
    os.mkfifo(path / name)
    with _Unblock(path / name), Client(daemon.socket, timeout=60) as a, Client(daemon.socket, timeout=60) as b:
        with pytest.raises(errors.ForeignDataFileError, match="not a regular file"):
            a.open_session(SESSION_VERIFY, dfd)
        assert b.status().server


# --- 2. errors never quote what the client could not read ------------------------------------

def test_errors_quote_no_bytes_of_a_data_file(image):
    path, dfd, manifest, _ = image
    name = manifest.files[0].name
    (path / name).write_bytes(SECRET * 100)
    with pytest.raises(errors.ForeignDataFileError) as ei:
        _verify(dfd)
    assert name in str(ei.value) and "TOPSECRE" not in str(ei.value) and "bad magic" in str(ei.value)


def test_errors_quote_no_bytes_of_a_manifest(image):
    path, dfd, _, _ = image
    (path / MANIFEST_NAME).write_bytes(SECRET * 4)
    with pytest.raises(errors.CorruptManifestError) as ei:
        _verify(dfd)
    assert "TOPSECRE" not in str(ei.value) and MANIFEST_NAME in str(ei.value)


# --- 3. records are bound to their image ---------------------------------------------------

@pytest.mark.parametrize("compression", ["none", "zstd"])
def test_a_record_spliced_from_another_image_is_corrupt(tmp_path, compression):
    from vramd.image.codec import Compression
    imgs = []
    for which in ("a", "b"):
        d = tmp_path / which
        d.mkdir()
        dfd = open_dir(d)
        # same BO id, size and chunking; contents that differ but compress to the same length
        # (and differ from chunk to chunk: a chunk equal to another would refer to its record)
        data = {1: b"".join(bytes([ord(which) + k]) * MiB for k in range(3))}
        imgs.append((d, dfd, _dump(dfd, data, compression=Compression.parse(compression))))
    (pa, dfa, ma), (pb_, dfb, mb) = imgs
    try:
        chunk = 1  # splice B's record of chunk 1 over A's, same place, same length
        fi, off, ln, _ = chunk_record(ma, ma.bos[0], chunk)
        bfi, boff, bln, _ = chunk_record(mb, mb.bos[0], chunk)
        assert ln == bln
        with open(pb_ / mb.files[bfi].name, "rb") as f:
            f.seek(boff)
            rec = f.read(ln)
        fd = os.open(pa / ma.files[fi].name, os.O_WRONLY)
        os.pwrite(fd, rec, off)
        os.close(fd)
        for action in (lambda: _verify(dfa), lambda: _restore(dfa, {1: 3 * MiB})):
            with pytest.raises(errors.CorruptChunkError, match="record checksum") as ei:
                action()
            assert (ei.value.bo_id, ei.value.offset) == (1, chunk * MiB)
            assert ma.files[fi].name in str(ei.value)
    finally:
        os.close(dfa)
        os.close(dfb)


def test_images_without_record_checksums_stay_readable(tmp_path):
    """v1 images written before records were bound: read and checked as before."""
    path, dfd = v1_image(tmp_path)
    data = v1_contents()

    def edit(m):
        for bo in m.bos:
            del bo.record_checksums[:]
    _rewrite_manifest(path, edit)
    assert _restore(dfd, {i: len(d) for i, d in data.items()}) == data


def test_record_checksums_must_cover_every_record(tmp_path):
    path, dfd = v1_image(tmp_path)

    def edit(m):
        del m.bos[0].record_checksums[-1]
    _rewrite_manifest(path, edit)
    with pytest.raises(errors.CorruptManifestError, match="record_checksums"):
        _verify(dfd)


# --- 4. a restore that cannot move a byte fails ------------------------------------------

def test_chunks_larger_than_the_staging_budget_fail_the_job(image_dir):
    _path, dfd = image_dir
    data = {1: os.urandom(9 * MiB)}
    _dump(dfd, data, chunk_size=8 * MiB, budget=64 * MiB)
    for action in (lambda: _verify(dfd, budget=4 * MiB), lambda: _restore(dfd, {1: 9 * MiB}, budget=4 * MiB)):
        with pytest.raises(errors.LimitExceededError) as ei:
            action()
        assert str(8 * MiB) in str(ei.value) and str(4 * MiB) in str(ei.value)


def test_a_verify_opens_a_bounded_number_of_lanes_whatever_gpu_ids_the_image_names(image_dir):
    """A crafted image may name thousands of gpu_ids; a verify (which moves no GPU memory) spreads them over
    at most VERIFY_LANES lanes and still reads every chunk."""
    from vramd.engine.jobs.verify import VERIFY_LANES
    from vramd.imagedir import ImageFiles, read_image
    _path, dfd = image_dir
    n = 3 * VERIFY_LANES + 1
    data = {i: os.urandom(4096 + i) for i in range(1, n + 1)}
    fds = {i: memfd(d) for i, d in data.items()}

    async def go():
        async with engine(staging_budget=16 * MiB, chunk_size=MiB) as e:
            m = await inproc.dump(e, dfd, [BoSpec(i, len(d), BoRef("mmap", fds[i]), gpu_id=1000 + i)
                                   for i, d in data.items()])
            assert len({b.gpu_id for b in m.bos}) == n and len({f.gpu_id for f in m.files}) == n
            with ImageFiles(dfd) as files:
                job = e.start_verify(await read_image(files))
                await job.finish()
            return job
    try:
        job = run(go())
    finally:
        for fd in fds.values():
            os.close(fd)
    assert job.progress.bos_done == n and job.progress.bytes_done == sum(map(len, data.values()))
    assert job.pipeline.lane_count == VERIFY_LANES


@dataclass(eq=False)
class _Bo:
    id: int
    chunks_left: int
    backend: None = None


class _Ends:
    chunk_size = 4 * MiB
    buffers_per_chunk = 1

    async def fill(self, tasks, bufs):
        return None

    def transform(self, tasks, bufs, filled):
        return None

    async def drain(self, tasks, bufs, product):
        return None

    def bo_done(self, bo):
        pass


def test_a_pipeline_worker_that_cannot_get_staging_fails_the_job():
    """The first error fails the job: a worker never dies silently and the job never reports success."""
    from concurrent.futures import ThreadPoolExecutor

    async def go():
        pool = StagingPool(2 * buffer_unit(0))  # far below one 4 MiB chunk
        with ThreadPoolExecutor(1) as cpu:
            p = Pipeline(_Ends(), pool, cpu, workers_per_gpu=2)
            bo = _Bo(1, 1)
            p.add(0, iter([ChunkTask(bo, 0, 0, 4096)]), 4096)
            with pytest.raises(errors.InvalidRequestError, match="budget"):
                await p.wait()
            assert p.progress.bytes_done == 0
        pool.close()
    run(go())


# --- 5. declared sizes, offsets, and freed memory --------------------------------------

def test_a_huge_declared_bo_costs_no_memory_until_bytes_move(image_dir):
    _, dfd = image_dir
    fd = memfd(size=256 * GiB)  # sparse: the mmap backend accepts it without touching it

    async def go():
        async with engine(staging_budget=16 * MiB) as e, dump_job(e, dfd, chunk_size=4096) as job:
            tracemalloc.start()
            try:
                job.add([BoSpec(1, 256 * GiB, BoRef("mmap", fd))])
                _, peak = tracemalloc.get_traced_memory()
            finally:
                tracemalloc.stop()
                job.cancel()
            with pytest.raises(errors.JobCancelledError):
                await job.finish()
            return peak
    try:
        peak = run(go())
    finally:
        os.close(fd)
    assert peak < 1 * MiB, f"adding one 256 GiB BO allocated {peak} bytes"


@pytest.mark.parametrize("kind", ["procmem", "mmap"])
@pytest.mark.parametrize("offset", [1 << 63, (1 << 64) - 4096, (1 << 63) - 4096])
def test_offsets_past_off_t_are_invalid_requests(image_dir, kind, offset):
    _, dfd = image_dir
    mem = os.open("/proc/self/mem", os.O_RDONLY) if kind == "procmem" else memfd(size=MiB)

    async def go():
        async with engine(staging_budget=16 * MiB, chunk_size=MiB) as e:
            await inproc.dump(e, dfd, [BoSpec(3, 2 * 4096, BoRef(kind, mem, offset))])
    try:
        with pytest.raises(errors.InvalidRequestError, match="64-bit file offset") as ei:
            run(go())
    finally:
        os.close(mem)
    assert ei.value.bo_id == 3


def test_restore_target_offsets_past_off_t_are_invalid_requests(image):
    _, dfd, _, _data = image
    mem = os.open("/proc/self/mem", os.O_RDWR)

    async def go():
        async with engine(staging_budget=16 * MiB) as e:
            await inproc.restore(e, dfd, [RestoreTarget(1, BoRef("procmem", mem, 1 << 63))], allow_partial=True)
    try:
        with pytest.raises(errors.InvalidRequestError, match="64-bit file offset") as ei:
            run(go())
    finally:
        os.close(mem)
    assert ei.value.bo_id == 1


@pytest.mark.parametrize("size", [(1 << 64) - 1, (1 << 40) + 1])
def test_declared_sizes_are_bounded(image_dir, size):
    _, dfd = image_dir
    r, w = os.pipe()

    async def go():  # the job's own bound (a daemon's session refuses that many chunks first)
        async with engine(staging_budget=16 * MiB, chunk_size=MiB) as e, dump_job(e, dfd) as job:
            try:
                job.add([BoSpec(4, size, BoRef("procmem", r, 0))])
            finally:
                await job.finish()
    try:
        with pytest.raises(errors.LimitExceededError, match="max_bo_bytes") as ei:
            run(go())
    finally:
        os.close(r)
        os.close(w)
    assert ei.value.bo_id == 4


def test_the_bo_limit_is_configurable(image_dir):
    _, dfd = image_dir
    fd = memfd(size=2 * MiB)

    async def go():
        async with engine(staging_budget=16 * MiB, chunk_size=MiB, max_bo_bytes=MiB) as e:
            await inproc.dump(e, dfd, [BoSpec(5, 2 * MiB, BoRef("mmap", fd))])
    try:
        with pytest.raises(errors.LimitExceededError) as ei:
            run(go())
    finally:
        os.close(fd)
    assert ei.value.bo_id == 5


class _Owner:
    """Holds a job and hands it its own bound methods as callbacks, as a session does."""

    def __init__(self):
        self.failures = []
        self.updates = 0

    def failed(self, exc):
        self.failures.append(exc)

    def progressed(self, progress):
        self.updates += 1


@pytest.mark.parametrize("outcome", ["done", "failed"])
def test_a_finished_job_leaves_no_reference_cycle(image_dir, outcome):
    _, dfd = image_dir
    fd = memfd(os.urandom(MiB))
    small = memfd(size=4096)

    async def go():
        async with engine(staging_budget=16 * MiB, chunk_size=MiB) as e:
            owner = _Owner()
            async with dump_job(e, dfd, on_progress=owner.progressed) as owner.job:  # held by its owner only
                owner.job.on_fail(owner.failed)
                bos = [BoSpec(1, MiB, BoRef("mmap", fd))]
                if outcome == "failed":
                    bos.append(BoSpec(2, MiB, BoRef("mmap", small)))  # too small: the job fails
                try:
                    owner.job.add(bos)
                except errors.VramdError:
                    pass
                try:
                    await owner.job.finish()
                except errors.VramdError:
                    assert outcome == "failed" and owner.failures
                refs = weakref.ref(owner), weakref.ref(owner.job.index)
                del owner
            return refs
    gc.collect()
    gc.disable()
    try:
        ref, index = run(go())
        assert ref() is None, "the owner is only reachable through a cycle (left to the cyclic GC)"
        if outcome == "done":  # (a failed job's error keeps it: its traceback's frames hold the job)
            # the chunk index, which holds an entry per record, goes with its job (building the chunk table
            # once left it in a cycle of its own, which a daemon under constant load frees every minute)
            assert index() is None, "the job's chunk index is only reachable through a cycle"
    finally:
        gc.enable()
        os.close(fd)
        os.close(small)
