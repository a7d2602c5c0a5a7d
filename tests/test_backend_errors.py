"""Bad sources and targets become typed errors naming the BO, offset and address."""
import contextlib
import os
from collections.abc import Iterator

import pytest
from helpers import Workload, dump_job, engine, run

from vramd import errors, inproc
from vramd.backends import BoRef
from vramd.engine import BoSpec, RestoreTarget

MiB = 1 << 20


def _dump(dfd, specs, **kw):
    async def go():
        async with engine(staging_budget=8 * MiB, chunk_size=MiB, **kw) as e:
            return await inproc.dump(e, dfd, specs)
    return run(go())


def _job_add(dfd, specs):
    """`specs` added to a dump job in one go (as a session adds one AddBos), then its end: the job's own error."""
    async def go():
        async with engine(staging_budget=8 * MiB, chunk_size=MiB) as e, dump_job(e, dfd) as job:
            try:
                job.add(specs)
            finally:
                await job.finish()
    return run(go())


def test_unmapped_start_is_named(image_dir):
    _, dfd = image_dir
    with Workload([{"size": 2 * MiB, "fill": "random", "holes": [[MiB, MiB]]}]) as w:
        mem = w.open_mem()
        addr = w.regions[0]["addr"]
        try:
            with pytest.raises(errors.UnmappedRangeError) as ei:
                _dump(dfd, [BoSpec(5, 2 * MiB, BoRef("procmem", mem, addr))])  # runs past the mapping
        finally:
            os.close(mem)
    assert ei.value.bo_id == 5
    # the last byte's probe found the hole; the error names where the hole starts
    assert ei.value.offset == MiB  # (its address travels in its message: the wire has no field for it)
    assert f"{addr + MiB:#x}" in str(ei.value)


def test_hole_in_the_middle_fails_mid_copy_and_leaves_nothing(image_dir):
    path, dfd = image_dir
    # an unmapped MiB in the middle of the BO: the ends probe fine, the copy fails
    with Workload([{"size": 3 * MiB, "fill": "random", "holes": [[MiB, MiB]]}]) as w:
        base = w.regions[0]["addr"]
        mem = w.open_mem()
        try:
            with pytest.raises(errors.UnmappedRangeError) as ei:
                _dump(dfd, [BoSpec(1, 3 * MiB, BoRef("procmem", mem, base))])
        finally:
            os.close(mem)
    assert f"address {base + MiB:#x}" in ei.value.message  # (the wire names it in the message)
    assert (ei.value.bo_id, ei.value.offset) == (1, MiB)
    assert os.listdir(path) == []  # no manifest, no data file, no temporaries


def _is_open(fd):
    try:
        os.fstat(fd)
        return True
    except OSError:
        return False


def test_wrong_fds(image_dir, tmp_path):
    _, dfd = image_dir
    small = os.memfd_create("small")
    os.ftruncate(small, 1000)
    closed = next(fd for fd in range(999, 100, -1) if not _is_open(fd))
    ro = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        with pytest.raises(errors.TargetTooSmallError, match="holds 1000 bytes") as ei:
            _dump(dfd, [BoSpec(1, 4096, BoRef("mmap", small))])
        assert ei.value.bo_id == 1
        with pytest.raises(errors.BadDescriptorError, match="directory"):
            _dump(dfd, [BoSpec(2, 4096, BoRef("mmap", ro))])
        with pytest.raises(errors.BadDescriptorError, match="directory"):
            _dump(dfd, [BoSpec(2, 4096, BoRef("procmem", ro))])
        with pytest.raises(errors.BadDescriptorError, match="not usable"):
            _dump(dfd, [BoSpec(3, 4096, BoRef("mmap", closed))])
        with pytest.raises(errors.BackendUnavailableError, match="sdma"):
            _dump(dfd, [BoSpec(4, 4096, BoRef("sdma", small))])
        with pytest.raises(errors.InvalidRequestError, match="twice"):
            _dump(dfd, [BoSpec(5, 10, BoRef("mmap", small)), BoSpec(5, 10, BoRef("mmap", small))])
    finally:
        os.close(small)
        os.close(ro)


def test_read_only_target_is_refused(image_dir):
    _, dfd = image_dir
    src = os.memfd_create("src")
    os.write(src, os.urandom(8192))
    _dump(dfd, [BoSpec(1, 8192, BoRef("mmap", src))])
    ro = os.open(f"/proc/self/fd/{src}", os.O_RDONLY)
    try:
        async def go():
            async with engine(staging_budget=8 * MiB) as e:
                await inproc.restore(e, dfd, [RestoreTarget(1, BoRef("mmap", ro))])
        with pytest.raises(errors.BadDescriptorError, match="read-only"):
            run(go())
    finally:
        os.close(ro)
        os.close(src)


def test_many_small_bos_in_one_add_name_the_first_failure_in_order(image_dir):
    """One add of many BOs probes their ranges together (ProcMemBackend.open_many): an unmapped
    BO among them is still named with its address, before a later BO's own error, and a
    write-only fd is still left for the copy to report (as `open` alone does)."""
    from vramd.backends import Direction, ProcMemBackend

    page = 4096
    with Workload([{"size": 8 * page, "fill": "random", "holes": [[5 * page, page]]}]) as w:
        base = w.regions[0]["addr"]
        mem = w.open_mem()
        wo = w.open_mem(os.O_WRONLY)
        b = ProcMemBackend()
        try:
            items = [(i + 1, BoRef("procmem", mem, base + i * page), page, 0) for i in range(8)]
            assert len(b.open_many(items[:5], Direction.READ)) == 5
            with pytest.raises(errors.UnmappedRangeError) as ei:
                b.open_many(items, Direction.READ)
            assert (ei.value.bo_id, ei.value.address, ei.value.offset) == (6, base + 5 * page, 0)
            # spanning into the hole from BO 5: the hole's first byte is the one named
            with pytest.raises(errors.UnmappedRangeError) as ei:
                b.open_many([items[0], (5, BoRef("procmem", mem, base + 4 * page + 8), page, 0)], Direction.READ)
            assert (ei.value.bo_id, ei.value.address, ei.value.offset) == (5, base + 5 * page, page - 8)
            # a write-only fd: open_many answers as open does (nothing to probe with; the copy reports)
            wo_items = [(i + 1, BoRef("procmem", wo, base + i * page), page, 0) for i in range(8)]
            assert len(b.open_many(wo_items, Direction.WRITE)) == 8
            # through a job: the unmapped BO 6 is reported, not BO 9's size past the limit after it (a daemon's
            # session refuses the chunks of such a BO before its job sees it: max_chunks_per_session)
            specs = [BoSpec(i + 1, page, BoRef("procmem", mem, base + i * page)) for i in range(8)]
            specs.append(BoSpec(9, 1 << 62, BoRef("procmem", mem, base)))
            with pytest.raises(errors.UnmappedRangeError) as ei:
                _job_add(image_dir[1], specs)
            assert (ei.value.bo_id, ei.value.address) == (6, base + 5 * page)
            with pytest.raises(errors.LimitExceededError) as ei2:
                _job_add(image_dir[1], specs[:5] + specs[8:])
            assert ei2.value.bo_id == 9
        finally:
            b.close()
            os.close(mem)
            os.close(wo)


PAGE = 4096


@contextlib.contextmanager
def eight_pages_with_a_hole() -> Iterator[tuple[int, int, list[BoSpec]]]:
    """A process's 8 pages of random bytes with page 5 unmapped: (their address, its /proc/<pid>/mem fd open
    for reading, a procmem BO per page, ids 1 to 8: BO 6 is the hole)."""
    with Workload([{"size": 8 * PAGE, "fill": "random", "holes": [[5 * PAGE, PAGE]]}]) as w:
        base = w.regions[0]["addr"]
        mem = w.open_mem()
        try:
            yield base, mem, [BoSpec(i + 1, PAGE, BoRef("procmem", mem, base + i * PAGE)) for i in range(8)]
        finally:
            os.close(mem)


def test_open_ahead_is_only_a_head_start(image_dir):
    """JobBase.open_ahead (what a session runs in its io thread) opens what add would; add takes a
    handle only for the very same BO; an error in the thread keeps nothing and add raises it, in order."""
    page = PAGE
    with eight_pages_with_a_hole() as (base, mem, specs):
        async def go():
            async with engine(staging_budget=8 * MiB, chunk_size=MiB) as e, dump_job(e, image_dir[1]) as job:
                ahead = job.open_ahead(specs[:5])
                assert sorted(ahead) == [1, 2, 3, 4, 5]
                moved = BoSpec(4, page, BoRef("procmem", mem, base + 6 * page))  # not what was opened for BO 4
                job.add([specs[0], specs[1], moved], ahead)
                assert sorted(ahead) == [3, 5]  # BO 4's handle was dropped, not used for another range
                job.drop_ahead(ahead)
                assert ahead == {}
                assert job.open_ahead(specs[4:]) == {}  # BO 6 is unmapped: nothing is kept
                with pytest.raises(errors.UnmappedRangeError) as ei:
                    job.add([*specs[4:], BoSpec(9, 1 << 62, BoRef("procmem", mem, base))], {})
                assert (ei.value.bo_id, ei.value.address) == (6, base + 5 * page)
                with pytest.raises(errors.UnmappedRangeError):
                    await job.finish()
        run(go())


def test_a_bo_whose_open_failed_ahead_is_not_opened_again_on_the_event_loop(image_dir, monkeypatch):
    """A BO whose probe failed in the worker thread (open_ahead, as a session runs it) is not probed again by
    add, on the event loop: add raises the error the thread met, naming the BO and where its hole starts, in
    order.  Finding that start reads the BO's bytes before the hole (here BO 5's first page, whose second
    page is the hole; the one-byte probes of the BOs' ends are not that scan), which for a BO of tens of
    GiB held the event loop, and every other client, for seconds."""
    import asyncio
    import threading

    scans: list[threading.Thread] = []
    real = os.preadv

    def preadv(fd, buffers, offset, *flags):
        if fd == mem and sum(len(memoryview(b)) for b in buffers) > 1:  # reading up to the hole
            scans.append(threading.current_thread())
        return real(fd, buffers, offset, *flags)
    monkeypatch.setattr(os, "preadv", preadv)
    with eight_pages_with_a_hole() as (base, mem, pages):
        specs = [*pages[:4], BoSpec(5, 2 * PAGE, BoRef("procmem", mem, base + 4 * PAGE)), *pages[6:]]

        async def go():
            async with engine(staging_budget=8 * MiB, chunk_size=MiB) as e, dump_job(e, image_dir[1]) as job:
                ahead = await asyncio.get_running_loop().run_in_executor(None, job.open_ahead, specs)
                assert ahead == {} and ahead.failed is not None and ahead.failed[0] == 5
                assert len(scans) == 1 and scans[0] is not threading.current_thread()
                with pytest.raises(errors.UnmappedRangeError) as ei:
                    job.add(specs, ahead)
                assert (ei.value.bo_id, ei.value.address) == (5, base + 5 * PAGE)
                assert len(scans) == 1  # not again, on the event loop
                with pytest.raises(errors.UnmappedRangeError):
                    await job.finish()
        run(go())
