"""vramd.hostmem.batchcopy: the C module and the Python fallback give the same results, and the engine
round-trips through either."""
from __future__ import annotations

import mmap
import os
import shutil

import pytest
import xxhash
from helpers import Workload, blank_spec_like, engine, memfd, o_direct_here, run

from vramd import inproc
from vramd.backends import BoRef
from vramd.engine import BoSpec, RestoreTarget
from vramd.hostmem import batchcopy, native
from vramd.hostmem.batchcopy import END_OF_FILE, HASH, RECORD, WHOLE, ZERO, Copy, copy_batch
from vramd.hostmem.staging import StagingBuffer
from vramd.image.codec import record_head
from vramd.pb import image_pb2 as pb
from vramd.testing.seams import has_cachestat, intercept_copies, mincore_only, python_copier
from vramd.units import MiB


@pytest.fixture(params=["native", "python"])
def flavour(request):
    if request.param == "native":
        if not batchcopy.NATIVE:
            pytest.skip("vramd.hostmem._copy is not built (needs <xxhash.h>: libxxhash-dev)")
        yield request.param
    else:
        with python_copier():
            yield request.param


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


@pytest.fixture(params=["avx2", "baseline"])
def xxh3_build(request):
    """The C module's xxh3 builds in turn: the AVX2 build only where it exists and this CPU has AVX2,
    and always the baseline one (what a CPU without AVX2 runs, whatever this machine is)."""
    if not batchcopy.NATIVE:
        pytest.skip("vramd.hostmem._copy is not built (needs <xxhash.h>: libxxhash-dev)")
    lib = native.built().lib
    chosen = lib.vd_xxh3_use_avx2(1)  # what the module chose at load: the best build this CPU runs
    if request.param == "avx2" and not chosen:
        pytest.skip("no AVX2 build of xxh3 here, or no AVX2 on this CPU")
    try:
        assert lib.vd_xxh3_use_avx2(request.param == "avx2") == (request.param == "avx2")
        yield request.param
    finally:
        lib.vd_xxh3_use_avx2(chosen)


def test_each_xxh3_build_gives_xxhash_digests(xxh3_build):
    """Whole-buffer and block-by-block (streamed across the copier's 256 KiB blocks) digests equal the
    xxhash package's, at every length class xxh3 treats differently."""
    block = batchcopy.BLOCK
    sizes = [0, 1, 3, 4, 8, 9, 16, 17, 128, 129, 240, 241, 1000, 1024, 4096, 65_537, block - 1, block, block + 1,
             3 * block + 123]
    data = os.urandom(max(sizes))
    src, buf = _buffer(len(data)), _buffer(len(data))
    try:
        src.view[:] = data
        for n in sizes:
            want = xxhash.xxh3_64_intdigest(data[:n])
            assert batchcopy.xxh3(src.address, n) == want, n
            outs, failed = copy_batch([Copy(-1, src.address, -1, buf.address, n)], HASH)
            assert failed == -1 and outs[0].hash == want, n
    finally:
        src.unmap()
        buf.unmap()


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


def _read_calls() -> int:
    """This process's read system calls so far (/proc/self/io syscr)."""
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("syscr"))


def test_whole_moves_a_copy_in_one_read_and_hashes_the_same(flavour):
    """A record read that waits on a device (O_DIRECT from a disk) is one request, not sixteen 256 KiB ones the
    copy thread would wait for one after another (WHOLE); without it, the C loop reads a block at a time, so
    that the hash finds the bytes still in this core's cache.  Both give the same bytes and hash."""
    payload = os.urandom(4 * MiB - 200)
    head = record_head(5, 0, len(payload), pb.CODEC_RAW, len(payload), xxhash.xxh3_64_intdigest(payload))
    f = memfd(head + payload)
    buf = _buffer(4 * MiB)
    try:
        n = len(head) + len(payload)
        counting = _read_calls() - _read_calls()  # what asking costs (negated)
        calls = {}
        for flags in (HASH | RECORD, HASH | RECORD | WHOLE):
            before = _read_calls()
            outs, failed = copy_batch([Copy(f, 0, -1, buf.address, n, 0, n)], flags)
            calls[flags] = _read_calls() - before + counting
            assert failed == -1 and outs[0].hash == xxhash.xxh3_64_intdigest(payload)
            assert buf.view[len(head):n] == payload
        assert calls[HASH | RECORD | WHOLE] == 1
        assert calls[HASH | RECORD] == (1 if flavour == "python" else -(-n // batchcopy.BLOCK))
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
                        await inproc.dump(e, dfd, bos)
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
                        await inproc.restore(e, dfd, [*targets, RestoreTarget(9, BoRef("mmap", dst))])
                        await inproc.verify(e, dfd)
                run(restore())
            finally:
                os.close(mem)
            assert t.digests() == want
        assert os.pread(dst, len(content) + 1, 0) == content
    finally:
        os.close(src)
        os.close(dst)


# --- the one-thread batch path keeps the image's guarantees (issue #12) -------------------



def test_inline_dump_binds_every_record_and_writes_off_the_loop(flavour, image_dir, monkeypatch):
    """Records written by the copy threads (buffered and O_DIRECT) are listed with their record_checksums,
    every write and every O_DIRECT open runs in a copy thread, and the image reads back bound."""
    import threading

    from vramd.image import writer
    from vramd.image.format import RECORD_PREFIX, record_checksum
    from vramd.image.manifest import chunk_record
    from vramd.image.names import data_file_name
    from vramd.imagedir import ImageFiles, read_image
    path, dfd = image_dir
    seen: dict[str, set[str]] = {"pwrite": set(), "direct": set()}
    real_pwrite = writer.DataFileWriter.pwrite

    def pwrite(self, iov, offset, **kw):
        seen["direct" if kw.get("direct") else "pwrite"].add(threading.current_thread().name)
        return real_pwrite(self, iov, offset, **kw)
    monkeypatch.setattr(writer.DataFileWriter, "pwrite", pwrite)
    content = os.urandom(3 * MiB) + bytes(MiB) + os.urandom(5000)
    src = memfd(content)
    small = memfd(os.urandom(3000))
    try:
        async def dump():
            async with engine(chunk_size=MiB, staging_budget=16 * MiB, copy_threads=2) as e:
                return await inproc.dump(e, dfd, [BoSpec(1, len(content), BoRef("mmap", src)),
                                          BoSpec(2, 3000, BoRef("mmap", small))])
        m = run(dump())
    finally:
        os.close(src)
        os.close(small)
    assert seen["pwrite"] and all(n.startswith("vramd-copy") for s in seen.values() for n in s), seen
    direct = o_direct_here(path)
    assert bool(seen["direct"]) == direct  # O_DIRECT wherever the file system takes it (not tmpfs)
    data = [(path / f.name).read_bytes() for f in m.files]  # the GPU's stripes (two copy threads: two)
    assert len(data) == 2 and [f.name for f in m.files] == [data_file_name(m.image_id, 0, k) for k in (0, 1)]
    for bo in m.bos:
        recs = [r for r in (chunk_record(m, bo, i) for i in range(len(bo.chunk_refs))) if r is not None]
        assert len(recs) == len(bo.chunk_refs) - (1 if bo.id == 1 else 0)  # BO 1's zero chunk is a hole
        for fi, off, ln, rsum in recs:
            assert record_checksum(data[fi][off:off + RECORD_PREFIX.size]) == rsum and off + ln <= len(data[fi])
        if direct and bo.id == 1:
            # the head right before a page-aligned payload: gaps between records, listed exactly
            assert any((off + ln - 5000) % 4096 == 0 or (off + ln) % 4096 == 0 for _fi, off, ln, _ in recs)

    async def check():
        with ImageFiles(dfd) as files:
            (await read_image(files)).close()  # the manifest checks accept the layout
        async with engine(chunk_size=MiB, staging_budget=16 * MiB) as e:
            await inproc.verify(e, dfd)
            dst = memfd(size=len(content))
            try:
                await inproc.restore(e, dfd, [RestoreTarget(1, BoRef("mmap", dst))], allow_partial=True)
                return os.pread(dst, len(content) + 1, 0)
            finally:
                os.close(dst)
    assert run(check()) == content


@pytest.mark.parametrize("inflight,device_inflight", [(4, 1), (1, 2)], ids=["in-flight", "added-on-device"])
def test_a_cold_image_is_read_by_the_io_threads_several_records_at_once(flavour, image_dir, inflight,
                                                                        device_inflight):
    """Records not in the page cache are read with O_DIRECT, which waits on the device: they are read (and
    checked) in the io threads, as many at once as batches are in flight, not one per copy thread.  With one
    copy thread, three reads must be waiting together (a barrier of three); the restore and the verify
    read the image back exactly.  `added-on-device`: one batch in flight, and the lane adds two more once
    its first read waits on the device (EngineConfig.device_inflight_per_gpu); without them one read
    would wait at a time."""
    import itertools
    import threading

    path, dfd = image_dir
    if not o_direct_here(path):
        pytest.skip("the file system of tmp_path refuses O_DIRECT")
    content = os.urandom(6 * MiB)
    src = memfd(content)
    try:
        async def dump():
            async with engine(chunk_size=MiB, staging_budget=16 * MiB) as e:
                return await inproc.dump(e, dfd, [BoSpec(1, len(content), BoRef("mmap", src))])
        m = run(dump())
    finally:
        os.close(src)

    def evict() -> None:  # every record cold: its pages dropped from the page cache
        fd = os.open(path / m.files[0].name, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    together = threading.Barrier(3, timeout=10)
    calls = itertools.count()
    threads: set[str] = set()

    def spy(copies, flags, run):  # a batch of record reads (RECORD: only a restore's or a verify's)
        if flags & RECORD:
            threads.add(threading.current_thread().name)
            if next(calls) < 3:
                together.wait()  # BrokenBarrierError, and the restore fails, unless three reads wait at once
        return run(copies, flags)

    async def back():
        async with engine(chunk_size=MiB, staging_budget=16 * MiB, copy_threads=1, inflight_per_gpu=inflight,
                          device_inflight_per_gpu=device_inflight, io_threads=4) as e:
            dst = memfd(size=len(content))
            try:
                evict()
                await inproc.restore(e, dfd, [RestoreTarget(1, BoRef("mmap", dst))])
                got = os.pread(dst, len(content) + 1, 0)
            finally:
                os.close(dst)
            evict()
            await inproc.verify(e, dfd)
            return got
    with intercept_copies(spy):
        assert run(back()) == content
    assert len(threads) >= 3 and all(n.startswith("vramd-io") for n in threads), threads


def test_a_cached_or_tmpfs_record_stays_in_the_copy_thread(flavour, tmp_path):
    """Only a read that waits on a device leaves the copy thread: records in the page cache (an image just
    written through it) and on tmpfs (which cannot say whether it caches: its files are memory) are read,
    checked and copied out by one copy thread, which costs less (bench/README.md)."""
    import tempfile
    import threading

    threads: set[str] = set()

    def spy(copies, flags, run):  # a batch of record reads
        if flags & RECORD:
            threads.add(threading.current_thread().name)
        return run(copies, flags)
    content = os.urandom(4 * MiB)
    places = [tmp_path] + ([tempfile.mkdtemp(dir="/dev/shm")] if os.path.isdir("/dev/shm") else [])
    try:
        for place in places:
            d = os.path.join(place, "img")
            os.mkdir(d)
            dfd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
            src, dst = memfd(content), memfd(size=len(content))
            try:
                async def dump(dfd=dfd, src=src):
                    async with engine(chunk_size=MiB, staging_budget=16 * MiB) as e:
                        return await inproc.dump(e, dfd, [BoSpec(1, len(content), BoRef("mmap", src))])

                async def back(dfd=dfd, dst=dst):
                    async with engine(chunk_size=MiB, staging_budget=16 * MiB) as e:
                        await inproc.restore(e, dfd, [RestoreTarget(1, BoRef("mmap", dst))])
                        await inproc.verify(e, dfd)
                m = run(dump())
                for df in m.files:  # into the page cache (written O_DIRECT)
                    with open(os.path.join(d, df.name), "rb") as f:
                        while f.read(1 << 20):
                            pass
                with intercept_copies(spy):
                    run(back())
                assert os.pread(dst, len(content) + 1, 0) == content
            finally:
                for fd in (dfd, src, dst):
                    os.close(fd)
    finally:
        if len(places) > 1:
            shutil.rmtree(places[1])
    assert threads and all(n.startswith("vramd-copy") for n in threads), threads


def test_a_record_of_another_image_is_refused_on_the_inline_read(flavour, image_dir, tmp_path):
    """Same BO, offset and length in two images: swapping the data file is caught by record_checksums."""
    from vramd import errors
    from vramd.image.manifest import chunk_record
    path, dfd = image_dir
    other = tmp_path / "other"
    other.mkdir()
    odfd = os.open(other, os.O_RDONLY | os.O_DIRECTORY)
    try:
        ms = []
        for d in (dfd, odfd):
            src = memfd(os.urandom(2 * MiB))
            try:
                async def dump(d=d, src=src):  # one batch at a time: the same record layout in both
                    async with engine(chunk_size=MiB, staging_budget=16 * MiB, copy_threads=1,
                                      inflight_per_gpu=1) as e:
                        return await inproc.dump(e, d, [BoSpec(1, 2 * MiB, BoRef("mmap", src))])
                ms.append(run(dump()))
            finally:
                os.close(src)
        a, b = ms
        # the other image's data bytes under this image's name, with this image's file header
        mine = (path / a.files[0].name).read_bytes()
        theirs = (other / b.files[0].name).read_bytes()
        (path / a.files[0].name).write_bytes(mine[:32] + theirs[32:])
        assert [chunk_record(a, a.bos[0], i)[1:3] for i in range(2)] == \
            [chunk_record(b, b.bos[0], i)[1:3] for i in range(2)]

        async def verify():
            async with engine(chunk_size=MiB, staging_budget=16 * MiB) as e:
                await inproc.verify(e, dfd)
        with pytest.raises(errors.CorruptChunkError, match="record checksum mismatch"):
            run(verify())
    finally:
        os.close(odfd)


def test_reopen_direct_follows_the_image_opening_rules(tmp_path):
    """The O_DIRECT descriptor is the very file already open, never through a symlink, never another file."""
    from vramd.imagedir import reopen_direct
    d = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        (tmp_path / "a").write_bytes(b"x" * 4096)
        (tmp_path / "b").write_bytes(b"y" * 4096)
        os.symlink("a", tmp_path / "link")
        fd = os.open(tmp_path / "a", os.O_RDONLY)
        try:
            assert reopen_direct(d, "link", fd, os.O_RDONLY) is None
            assert reopen_direct(d, "b", fd, os.O_RDONLY) is None
            got = reopen_direct(d, "a", fd, os.O_RDONLY)
            if o_direct_here(tmp_path):
                assert got is not None and os.fstat(got).st_ino == os.fstat(fd).st_ino
                os.close(got)
            else:
                assert got is None
        finally:
            os.close(fd)
    finally:
        os.close(d)


@pytest.fixture(params=["cachestat", "mincore"])
def ask(request):
    """How the read plan asks the page cache what it holds: cachestat(2), or mincore(2) as where the kernel
    has no cachestat."""
    from vramd.hostmem import libc
    if request.param == "mincore":
        with mincore_only():
            yield request.param
    elif libc.cached_pages(0, 0, 0) is None or not has_cachestat():
        pytest.skip("this kernel has no cachestat (Linux 6.5+)")
    else:
        yield request.param


def test_a_cached_record_is_read_through_the_page_cache_and_an_evicted_one_with_o_direct(image_dir, ask):
    """O_DIRECT reads a record from the disk even where the page cache holds it (a restore right after its
    dump ran 3x slower): the read plan asks the page cache (cachestat, or mincore where the kernel has no
    cachestat) and goes direct only for what it does not hold.  Asking reads nothing: asked again and again,
    an evicted record stays evicted, and direct (a one-byte RWF_NOWAIT probe started readahead where it
    missed, so the third question found the record "cached" and it was read through the cache).  Each
    record read is seen on its way (intercept_copies): from an O_DIRECT descriptor or not, in one request
    (WHOLE: from the disk) or a block at a time (through the cache)."""
    import fcntl

    from vramd.hostmem import libc
    from vramd.image.manifest import chunk_record
    path, dfd = image_dir
    if not o_direct_here(path):
        pytest.skip("this file system refuses O_DIRECT (tmpfs): nothing to choose")
    src = memfd(os.urandom(8 * MiB))
    try:
        async def dump():
            async with engine(chunk_size=MiB, staging_budget=16 * MiB) as e:
                return await inproc.dump(e, dfd, [BoSpec(1, 8 * MiB, BoRef("mmap", src))])
        m = run(dump())
    finally:
        os.close(src)
    fds = [os.open(path / f.name, os.O_RDONLY) for f in m.files]
    records = [r for r in (chunk_record(m, m.bos[0], i) for i in range(8)) if r is not None]
    # the records a verify's read of the data files' headers (through the cache, with readahead) leaves alone
    far = [r for r in records if r[1] >= MiB]
    assert len(records) == 8 and far

    def cached(which=records) -> list[int | None]:
        """The pages of each record the page cache holds."""
        return [libc.cached_pages(fds[fi], off, n) for fi, off, n, _ in which]

    def evict():
        """Whichever way the dump wrote them: clean pages, dropped.  DONTNEED is advice (pages still on a
        per-CPU LRU list stay), so it is repeated until the page cache holds none of the records."""
        for _ in range(20):
            for fd in fds:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            if not any(cached()):
                return
        pytest.skip("the kernel kept the records' pages cached")

    def reads() -> list[tuple[bool, bool]]:
        """A verify's record reads: (from an O_DIRECT descriptor, in one request), a batch each."""
        seen = []

        def spy(copies, flags, go):
            if flags & RECORD:
                seen.extend((bool(fcntl.fcntl(c.src_fd, fcntl.F_GETFL) & os.O_DIRECT), bool(flags & WHOLE))
                            for c in copies)
            return go(copies, flags)

        async def verify():
            async with engine(chunk_size=MiB, staging_budget=16 * MiB) as e:
                await inproc.verify(e, dfd)
        with intercept_copies(spy):
            run(verify())
        return seen
    try:
        evict()
        for _ in range(3):  # asked again and again: still evicted, still direct
            assert reads() == [(True, True)] * 8
            assert not any(cached(far))  # what the questions (and the O_DIRECT reads) read: nothing
        for fi, off, n, _ in records:
            os.pread(fds[fi], n, off)  # read once through the cache (e.g. a verify before)
        assert reads() == [(False, False)] * 8
        evict()
        assert reads() == [(True, True)] * 8
    finally:
        for fd in fds:
            os.close(fd)


def test_a_dump_keeps_fewer_batches_in_flight_than_a_restore(image_dir, monkeypatch):
    """A dump's lane ends in its GPU's data files, each written a batch at a time: it keeps at most
    dump_inflight_per_gpu (by default 4) batches in its copy threads, where a restore keeps
    inflight_per_gpu.  The first copy-thread batches wait at a barrier for each other (four for the dump,
    five for the restore: more than a dump may have), and the most batches seen in the copy threads at
    once is recorded."""
    import itertools
    import threading

    from vramd.engine.jobs import dump as dump_job
    from vramd.engine.jobs import read
    _, dfd = image_dir
    content = os.urandom(24 * MiB)
    lock, active, most = threading.Lock(), [0], {"dump": 0, "restore": 0}

    def spying(cls, kind, together):
        real, calls = cls.run, itertools.count()

        def spy(self, *args):
            with lock:
                active[0] += 1
                most[kind] = max(most[kind], active[0])
            try:
                if next(calls) < together.parties:  # the first ones wait until that many are in at once
                    together.wait()  # else BrokenBarrierError, and the job fails
                return real(self, *args)
            finally:
                with lock:
                    active[0] -= 1
        monkeypatch.setattr(cls, "run", spy)
    spying(dump_job.DumpEnds, "dump", threading.Barrier(4, timeout=30))
    spying(read.ImageReadEnds, "restore", threading.Barrier(5, timeout=30))
    src, dst = memfd(content), memfd(size=len(content))
    try:
        async def go():
            async with engine(chunk_size=MiB, staging_budget=64 * MiB, copy_threads=8, inflight_per_gpu=8) as e:
                assert e.config.dump_inflight_per_gpu == 4
                await inproc.dump(e, dfd, [BoSpec(1, len(content), BoRef("mmap", src))])
                await inproc.restore(e, dfd, [RestoreTarget(1, BoRef("mmap", dst))])
        run(go())
        assert os.pread(dst, len(content) + 1, 0) == content
    finally:
        os.close(src)
        os.close(dst)
    assert most["dump"] == 4 and most["restore"] >= 5, most


def test_copies_into_one_file_take_turns(tmp_path):
    """pwrites into one regular file or memfd run one at a time in the kernel, whose waiters spin on its
    inode lock: the copy threads take turns before they get there (Backend.write_lock).  Two BOs in one
    memfd, restored by two copy threads: no two copies into that memfd are ever under way at once, and
    the bytes land.  (Without the turns, the other thread gets in: this fails.)"""
    import threading

    content = {1: os.urandom(16 * MiB), 2: os.urandom(16 * MiB)}
    image = tmp_path / "image"
    image.mkdir()
    dfd = os.open(image, os.O_RDONLY | os.O_DIRECTORY)
    srcs = {i: memfd(d) for i, d in content.items()}
    dst = memfd(size=32 * MiB)
    inode = os.fstat(dst).st_ino
    lock, inside, most, calls = threading.Lock(), [0], [0], [0]

    def spy(copies, flags, run):
        into = any(c.dst_fd >= 0 and os.fstat(c.dst_fd).st_ino == inode for c in copies)
        if into:
            with lock:
                inside[0] += 1
                calls[0] += 1
                most[0] = max(most[0], inside[0])
        try:
            os.sched_yield()  # a chance for the other copy thread to come in, were it let
            return run(copies, flags)
        finally:
            if into:
                with lock:
                    inside[0] -= 1
    try:  # the copies into dst: the copy thread's copy-out, and the backend's (a cold read)
        async def go():
            async with engine(chunk_size=MiB, staging_budget=32 * MiB, copy_threads=2, inflight_per_gpu=4) as e:
                await inproc.dump(e, dfd, [BoSpec(i, len(d), BoRef("mmap", srcs[i])) for i, d in content.items()])
                await inproc.restore(e, dfd, [RestoreTarget(1, BoRef("mmap", dst, 0)),
                                      RestoreTarget(2, BoRef("mmap", dst, 16 * MiB))])
        with intercept_copies(spy):
            run(go())
        assert os.pread(dst, 32 * MiB + 1, 0) == content[1] + content[2]
    finally:
        for fd in (dfd, dst, *srcs.values()):
            os.close(fd)
    assert calls[0] >= 2 and most[0] == 1, (calls, most)
