"""The transfer engine: one staging budget, the backends, and the thread pools.

    async with Engine(EngineConfig(staging_budget=512 << 20)) as engine:
        manifest = await engine.dump(dir_fd, [BoSpec(1, size, BoRef("procmem", mem_fd, addr))])
        await engine.restore(dir_fd, [RestoreTarget(1, BoRef("procmem", mem_fd2, addr))])
        report = await engine.verify(dir_fd)

Every fd (BO sources and targets, the image directory) is the caller's;
the engine never opens a path it is given and never closes a caller's fd.
"""
from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from .backends import BACKENDS, Backend
from .codec import Compression
from .backends.sdma import SdmaBackend
from .errors import BackendUnavailableError, InvalidRequestError
from .image import ImageReader
from .jobs import BoSpec, DumpJob, JobContext, RestoreJob, RestoreTarget
from .pb import image_pb2 as pb
from .pipeline import Progress
from .staging import StagingPool

MiB = 1 << 20


@dataclass
class EngineConfig:
    staging_budget: int = 512 * MiB
    chunk_size: int = 8 * MiB
    workers_per_gpu: int = 4
    compression: Compression = field(default_factory=Compression)
    cpu_threads: int = field(default_factory=lambda: os.cpu_count() or 2)
    io_threads: int = 4
    # SDMA: library None = $VRAMD_AMDGPU_LIBRARY ("" system libdrm_amdgpu, "model", or a path)
    sdma: bool = True
    sdma_library: str | None = None
    render_nodes: dict[int, str] = field(default_factory=dict)      # gpu_id -> /dev/dri/renderD<minor>
    recommended_mask: dict[int, int] = field(default_factory=dict)  # gpu_id -> SDMA engines for host copies

    def check(self) -> None:
        if not 4096 <= self.chunk_size <= 1 << 30 or self.chunk_size % 4096:
            raise InvalidRequestError(f"chunk size {self.chunk_size} must be a multiple of 4 KiB, at most 1 GiB")
        if self.workers_per_gpu < 1 or self.cpu_threads < 1 or self.io_threads < 1:
            raise InvalidRequestError("worker and thread counts must be at least 1")


@dataclass
class VerifyReport:
    manifest: pb.Manifest
    progress: Progress


class Engine:
    def __init__(self, config: EngineConfig | None = None, backends: dict[str, Backend] | None = None):
        self.config = config or EngineConfig()
        self.config.check()
        self.pool = StagingPool(self.config.staging_budget)
        self.unavailable: dict[str, str] = {}  # backend name -> why it is not here
        if backends is None:
            backends = {name: cls(workers_per_gpu=self.config.workers_per_gpu) for name, cls in BACKENDS.items()}
            if self.config.sdma:
                try:
                    backends["sdma"] = SdmaBackend(self.config.workers_per_gpu, library=self.config.sdma_library,
                                                   render_nodes=self.config.render_nodes,
                                                   recommended_mask=self.config.recommended_mask)
                except BackendUnavailableError as e:
                    self.unavailable["sdma"] = e.message
            else:
                self.unavailable["sdma"] = "disabled in the configuration"
        self.backends = backends
        for b in backends.values():
            b.attach(self.pool)
        self._cpu = ThreadPoolExecutor(self.config.cpu_threads, thread_name_prefix="vramd-cpu")
        self._io = ThreadPoolExecutor(self.config.io_threads, thread_name_prefix="vramd-io")
        self.ctx = JobContext(self.pool, self.backends, self._cpu, self._io, self.config.workers_per_gpu)

    async def __aenter__(self) -> "Engine":
        return self

    async def __aexit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        for b in self.backends.values():
            b.close()
        self._cpu.shutdown(wait=True)
        self._io.shutdown(wait=True)
        self.pool.close()

    # --- jobs --------------------------------------------------------------

    def start_dump(self, dir_fd: int, *, compression: Compression | None = None, chunk_size: int | None = None,
                   on_progress=None) -> DumpJob:
        cs = chunk_size or self.config.chunk_size
        if cs != self.config.chunk_size:
            EngineConfig(chunk_size=cs).check()
        return DumpJob(self.ctx, dir_fd, chunk_size=cs, compression=compression or self.config.compression,
                       on_progress=on_progress)

    async def start_restore(self, dir_fd: int, *, on_progress=None, gpu_map=None) -> RestoreJob:
        """`gpu_map(manifest) -> {image gpu_id: present gpu_id}` places each BO on its present GPU."""
        reader = await ImageReader.open(dir_fd)
        try:
            mapping = gpu_map(reader.manifest) if gpu_map is not None else None
        except BaseException:
            reader.close()
            raise
        return RestoreJob(self.ctx, reader, on_progress=on_progress, gpu_map=mapping)

    async def start_verify(self, dir_fd: int, *, on_progress=None) -> RestoreJob:
        """A job that reads and checks every chunk of the image, writing nowhere."""
        job = RestoreJob(self.ctx, await ImageReader.open(dir_fd), verify_only=True, on_progress=on_progress)
        job.add_all_for_verify()
        return job

    async def dump(self, dir_fd: int, bos: list[BoSpec], **kw) -> pb.Manifest:
        job = self.start_dump(dir_fd, **kw)
        try:
            job.add(bos)
        finally:
            manifest = await job.finish()  # on a failed add this raises the add's error, after cleanup
        return manifest

    async def restore(self, dir_fd: int, targets: list[RestoreTarget], *, allow_partial: bool = False,
                      on_progress=None) -> Progress:
        job = await self.start_restore(dir_fd, on_progress=on_progress)
        try:
            job.add(targets)
        finally:
            progress = await job.finish(allow_partial=allow_partial)
        return progress

    async def verify(self, dir_fd: int, *, on_progress=None) -> VerifyReport:
        """Read every chunk and check it (checksums, lengths, zstd frames) without writing anywhere."""
        job = await self.start_verify(dir_fd, on_progress=on_progress)
        return VerifyReport(job.manifest, await job.finish())
