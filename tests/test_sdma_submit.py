"""SDMA submission under load, on the software model of libdrm_amdgpu + SDMA (no AMD GPU here).

More batches in flight than a ring has IB slots wait for a slot instead of failing,
and no libdrm call but cheap bookkeeping runs on the event loop: device setup, BO
import, VA mapping, userptr registration and submission run in the GPU's submit
thread, fences in the ring's waiter thread.
"""
from __future__ import annotations

import os
import threading

import pytest
from helpers import dump_job, memfd, run

from vramd import errors, inproc
from vramd.backends import BoRef
from vramd.backends.sdma.binding import MODEL_PATH
from vramd.backends.sdma.packets import IB_SLOTS_PER_RING
from vramd.engine import BoSpec, Engine, EngineConfig, RestoreTarget

pytestmark = pytest.mark.skipif(
    not os.path.exists(MODEL_PATH),
    reason="the SDMA model is not built (needs libdrm-dev at install time; ./dev.sh installs it)")

MiB = 1 << 20
KiB = 1 << 10


def _dmabuf(data: bytes = b"", size: int | None = None) -> int:
    n = len(data) if size is None else size
    return memfd(data, -(-max(n, 1) // 4096) * 4096)


class _Spy:
    """Stands in for the cffi lib: forwards every call, noting the thread each libdrm function ran on and the
    arguments it was given."""

    def __init__(self, lib):
        self._lib = lib
        self.threads: dict[str, set[int]] = {}
        self.args: dict[str, list[tuple]] = {}
        self._lock = threading.Lock()

    def __getattr__(self, name):
        value = getattr(self._lib, name)
        if not callable(value):
            return value

        def call(*a):
            with self._lock:
                self.threads.setdefault(name, set()).add(threading.get_ident())
                self.args.setdefault(name, []).append(a)
            return value(*a)
        return call


def test_more_batches_in_flight_than_ib_slots_wait_for_a_slot(image_dir, monkeypatch):
    """With a slow (model) engine, 3x more batches than a ring's 64 IB slots: all land, none fails."""
    monkeypatch.setenv("VRAMD_SDMA_MODEL_PACKET_DELAY_US", "2000")
    _, dfd = image_dir
    workers = 3 * IB_SLOTS_PER_RING
    size = 2 * workers * 64 * KiB
    data = os.urandom(size)
    src, dst = _dmabuf(data), _dmabuf(size=size)

    async def go():
        cfg = EngineConfig(staging_budget=32 * MiB, chunk_size=64 * KiB, workers_per_gpu=workers,
                           sdma_library="model")
        async with Engine(cfg) as e:
            assert "sdma" in e.backends, e.unavailable
            await inproc.dump(e, dfd, [BoSpec(1, size, BoRef("sdma", src), gpu_id=7)])
            await inproc.restore(e, dfd, [RestoreTarget(1, BoRef("sdma", dst))])
    try:
        run(go())
        assert os.pread(dst, size, 0) == data
    finally:
        os.close(src)
        os.close(dst)


def test_no_libdrm_ioctl_runs_on_the_event_loop(image_dir):
    _, dfd = image_dir
    sizes = [4096, 3 * MiB + 5, 12345]
    datas = [os.urandom(n) for n in sizes]
    srcs, dsts = [_dmabuf(d) for d in datas], [_dmabuf(size=n) for n in sizes]
    seen = {}

    async def go():
        cfg = EngineConfig(staging_budget=32 * MiB, chunk_size=MiB, sdma_library="model")
        async with Engine(cfg) as e:
            b = e.backends["sdma"]
            spy = b.lib = _Spy(b.lib)
            loop_thread = threading.get_ident()
            await inproc.dump(e, dfd, [BoSpec(i + 1, n, BoRef("sdma", fd), gpu_id=1 + i % 2)
                               for i, (fd, n) in enumerate(zip(srcs, sizes))])
            await inproc.restore(e, dfd, [RestoreTarget(i + 1, BoRef("sdma", fd)) for i, fd in enumerate(dsts)])
            seen.update({k: set(v) for k, v in spy.threads.items()})  # before the teardown at close
            return loop_thread
    try:
        loop_thread = run(go())
        for fd, d in zip(dsts, datas):
            assert os.pread(fd, len(d), 0) == d
    finally:
        for fd in srcs + dsts:
            os.close(fd)
    for call in ("amdgpu_device_initialize", "amdgpu_bo_import", "amdgpu_bo_va_op", "amdgpu_create_bo_from_user_mem",
                 "amdgpu_cs_submit", "amdgpu_bo_list_create", "amdgpu_cs_query_fence_status"):
        assert call in seen, f"{call} was never called"
        assert loop_thread not in seen[call], f"{call} ran on the event loop"


def test_a_staging_buffer_is_registered_for_its_size_not_its_huge_page_mapping(image_dir):
    """8 MiB chunks take staging buffers of 8 MiB + 4 KiB, mapped as five huge pages' worth (hostmem.staging). The
    userptr BO covers the buffer's 8 MiB + 4 KiB only: the driver pins what it is given, and pinning the untouched
    tail would hold memory beyond the staging budget."""
    from vramd.hostmem.staging import buffer_unit
    _, dfd = image_dir
    data = os.urandom(8 * MiB)
    src, dst = _dmabuf(data), _dmabuf(size=len(data))

    async def go():
        cfg = EngineConfig(staging_budget=64 * MiB, chunk_size=8 * MiB, sdma_library="model")
        async with Engine(cfg) as e:
            b = e.backends["sdma"]
            spy = b.lib = _Spy(b.lib)
            await inproc.dump(e, dfd, [BoSpec(1, len(data), BoRef("sdma", src), gpu_id=1)])
            await inproc.restore(e, dfd, [RestoreTarget(1, BoRef("sdma", dst))])
            return [a[2] for a in spy.args.get("amdgpu_create_bo_from_user_mem", [])]  # (dev, ptr, size, bo)
    try:
        sizes = run(go())
        assert os.pread(dst, len(data), 0) == data
    finally:
        os.close(src)
        os.close(dst)
    assert sizes and set(sizes) == {buffer_unit(8 * MiB)}, sizes


def test_a_cancelled_job_waits_for_its_copies_and_returns_every_ib_slot(image_dir, monkeypatch):
    monkeypatch.setenv("VRAMD_SDMA_MODEL_PACKET_DELAY_US", "2000")
    _, dfd = image_dir
    workers = 3 * IB_SLOTS_PER_RING
    size = 4 * workers * 64 * KiB
    src = _dmabuf(os.urandom(size))

    async def go():
        cfg = EngineConfig(staging_budget=32 * MiB, chunk_size=64 * KiB, workers_per_gpu=workers,
                           sdma_library="model")
        async with Engine(cfg) as e:
            def progress(p):
                if p.chunks_done == 10:  # well inside the job: every slot in flight, others waiting
                    job.cancel()
            async with dump_job(e, dfd, on_progress=progress) as job:
                job.add([BoSpec(1, size, BoRef("sdma", src))])
                with pytest.raises(errors.JobCancelledError):
                    await job.finish()
            rings = [r for g in e.backends["sdma"]._gpus.values() for r in g.rings]
            assert rings and all(sorted(r.free_slots) == list(range(IB_SLOTS_PER_RING)) for r in rings)
            assert not any(r.slot_waiters for r in rings)
            assert e.pool.in_use_bytes == 0
    try:
        run(go())
    finally:
        os.close(src)
    assert os.listdir(image_dir[0]) == []
