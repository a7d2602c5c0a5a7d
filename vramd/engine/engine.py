"""The transfer engine: one staging budget, the backends, and the thread pools.

Every fd (BO sources and targets, image files) is the caller's; the engine
never opens a path and never closes a caller's fd.  The jobs take image files
a client opened (`start_dump`, `start_restore`, `start_verify`), in the daemon
and in-process alike: vramd.inproc runs a whole session in this process
(`await inproc.dump(engine, dir_fd, bos)`) through the daemon's own session
path, its client side opening and creating the files (vramd.imagedir).
"""
from __future__ import annotations

import asyncio
import os
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from ..backends import REGISTRY, Backend, BackendKind, BackendOptions
from ..errors import BackendUnavailableError, InvalidRequestError, LimitExceededError
from ..hostmem.staging import StagingPool, staging_shortfall
from ..image.chunks import parent_entries
from ..image.compression import Compression
from ..image.format import MAX_STRIPES
from ..image.reader import ImageReader
from ..image.writer import ImageWriter
from ..pb import image_pb2 as pb
from ..units import PAGE, MiB
from .jobs import DumpJob, JobContext, RestoreJob, VerifyJob
from .jobs.common import DEFAULT_MAX_BO_BYTES, OFF_T_MAX
from .jobs.dump import DEFAULT_MAX_CHAIN, dump_buffers
from .jobs.read import buffers_to_read
from .pipeline import ProgressCallback, StageTimes

# A dump's batches in flight per GPU lane, at most, by default (EngineConfig.dump_inflight_per_gpu): so at
# most this many copy threads work for one lane.  Procmem, 1 GiB into tmpfs on 16 cores (bench/throughput.py
# --copy-threads, bench/README.md): 2 copy threads dumped at 2.20 GB/s for 1.05 CPU s/GiB, 4 at 2.96 for 1.46,
# 8 at 2.93 for 2.43, 16 at 2.33-2.89 for 3.1-3.9: past 4, more threads bought no speed and cost CPU (a
# workload's cores, on a GPU box).  Restores gain from more (16 threads: 10.6-13 GB/s against 9.6 with 8),
# so they keep inflight_per_gpu.  On 2 cores the default in flight is 4 anyway.
DUMP_INFLIGHT = 4

# Batches a restore or verify lane adds, by default, once its reads wait on a device
# (EngineConfig.device_inflight_per_gpu): one read the device serves while the next waits queued behind it.
# Cold 1 GiB restores from a 2-core VM's disk, two rounds of 4-5 alternating runs per backend (bench/README.md,
# session 15), GB/s at CPU s/GiB: none added 1.48-1.63 at 0.49-0.57; 2 added 1.88-2.25 at 0.47-0.61; 4 added
# 1.88-2.11 at 0.51-0.70.  Storage that needs deeper queues to stream (a network file system) may want more.
DEVICE_INFLIGHT = 2

# A dump's chunk size when neither the dump nor the configuration names one (EngineConfig.chunk_size; a
# daemon's configuration defaults to it too).
DEFAULT_CHUNK_SIZE = 8 * MiB

# image manifest -> {image gpu_id: present gpu_id}, or None to keep the saved ones
GpuMap = Callable[[pb.Manifest], "dict[int, int] | None"]


def chunk_size_problem(chunk_size: int) -> str | None:
    """Why a chunk size is refused (EngineConfig.chunk_size, or the one a dump asks for), or None."""
    if not PAGE <= chunk_size <= 1 << 30 or chunk_size % PAGE:
        return f"chunk size {chunk_size} must be a multiple of 4 KiB, at most 1 GiB"
    return None


def cores() -> int:
    """The CPUs this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 2


@dataclass
class EngineConfig:
    """The engine's settings; 0 in a count means "chosen from the core count" (see __post_init__).

    `copy_threads` run CPU copies: each takes a whole batch (copy, zero scan,
    checksum, file write; or read, verify, copy out) at a time.  More than
    the machine has cores only makes them take turns on a core and contend
    for the GIL.  `inflight_per_gpu` batches are in flight per GPU lane:
    enough to keep every copy thread (or a DMA engine) busy while the event
    loop books the batches that landed.  `workers_per_gpu` is the old name of
    `inflight_per_gpu`, still accepted.  A dump keeps at most
    `dump_inflight_per_gpu` batches in flight per lane (default: DUMP_INFLIGHT):
    more batches only keep more copy threads busy for no gain (DUMP_INFLIGHT).
    A dump lane's records go to `data_files_per_gpu` data files (default:
    one for each batch the lane's copy threads may write at once, the
    fewer of copy_threads and dump_inflight_per_gpu): writes into one file
    run one at a time in the kernel, under its inode lock, where the other
    writers spin (measured on 2 cores, 1 GiB into tmpfs: two threads into
    one file 2.40 GB/s at 0.76 CPU s/GiB, into two files 3.99 at 0.48).
    A restore or verify lane adds `device_inflight_per_gpu` batches (default:
    DEVICE_INFLIGHT) the first time one of its records is read from a device
    rather than from memory: that read waits in an io thread, and without
    more batches in flight the reads and the copy-outs would share the same
    few batches, leaving the device idle while they copy out (measured on a
    2-core VM, a cold 1 GiB restore from disk: 4 in flight 1.34 GB/s, 6
    1.80, 8 1.82, a lone O_DIRECT reader of the file 2.05).  Restores from
    tmpfs or the page cache never grow: more batches there only rotate more
    staging through the CPU caches (6 in flight: 7 % more CPU than 4).
    """

    staging_budget: int = 512 * MiB
    staging_huge_pages: bool = True  # staging buffers of 2 MiB or more on transparent huge pages (hostmem.staging)
    chunk_size: int = DEFAULT_CHUNK_SIZE
    max_bo_bytes: int = DEFAULT_MAX_BO_BYTES  # the largest BO size a client may declare (LIMIT_EXCEEDED above)
    inflight_per_gpu: int = 0   # 0: copy threads + 2 (at least 4)
    dump_inflight_per_gpu: int = 0  # 0: inflight_per_gpu, at most DUMP_INFLIGHT
    device_inflight_per_gpu: int = 0  # 0: DEVICE_INFLIGHT; added to a restore's lane once its reads wait on a device
    data_files_per_gpu: int = 0  # 0: as many as a dump lane's batches may write at once (see __post_init__)
    copy_threads: int = 0       # 0: the core count
    workers_per_gpu: int | None = None  # alias of inflight_per_gpu (the setting's old name)
    compression: Compression = field(default_factory=Compression)
    cpu_threads: int = field(default_factory=cores)
    io_threads: int = 4
    stage_times: bool = False   # time every batch's stages (Engine.stage_times); off: no clock is read
    # SDMA: library None = $VRAMD_AMDGPU_LIBRARY ("" system libdrm_amdgpu, "model", or a path)
    sdma: bool = True  # False: the sdma backend is not even tried
    sdma_library: str | None = None
    supply_notes: bool = True  # a streamed session's notes over a supply socket (ImageJob.stream)
    max_chain_depth: int = DEFAULT_MAX_CHAIN  # parents an incremental image may have (then: flatten)
    render_nodes: dict[int, str] = field(default_factory=dict)      # gpu_id -> /dev/dri/renderD<minor>
    recommended_mask: dict[int, int] = field(default_factory=dict)  # gpu_id -> SDMA engines for host copies

    def __post_init__(self) -> None:
        if self.workers_per_gpu is not None and not self.inflight_per_gpu:
            self.inflight_per_gpu = self.workers_per_gpu
        if not self.copy_threads:
            self.copy_threads = cores()
        if not self.inflight_per_gpu:
            self.inflight_per_gpu = max(4, self.copy_threads + 2)
        self.workers_per_gpu = self.inflight_per_gpu
        if not self.dump_inflight_per_gpu:
            self.dump_inflight_per_gpu = min(self.inflight_per_gpu, DUMP_INFLIGHT)
        if not self.device_inflight_per_gpu:
            self.device_inflight_per_gpu = DEVICE_INFLIGHT
        if not self.data_files_per_gpu:
            self.data_files_per_gpu = max(1, min(self.copy_threads, self.dump_inflight_per_gpu, MAX_STRIPES))

    def problems(self) -> Iterator[tuple[str, str]]:
        """Every rule these settings break that the engine would refuse them (or a job) for: (the names of
        the settings, why).  `check` raises the first; the daemon's configuration check reports it naming the
        settings (vramd.service.config)."""
        problem = chunk_size_problem(self.chunk_size)
        if problem is not None:
            yield "chunk_size", problem
        counts = {"inflight_per_gpu": self.inflight_per_gpu, "dump_inflight_per_gpu": self.dump_inflight_per_gpu,
                  "device_inflight_per_gpu": self.device_inflight_per_gpu, "copy_threads": self.copy_threads,
                  "cpu_threads": self.cpu_threads, "io_threads": self.io_threads}
        low = [k for k, v in counts.items() if v < 1]
        if low:
            yield ", ".join(low), "batches in flight and thread counts must be at least 1"
        if not 1 <= self.data_files_per_gpu <= MAX_STRIPES:
            yield "data_files_per_gpu", f"data_files_per_gpu {self.data_files_per_gpu} must be 1 to {MAX_STRIPES}"
        if not 0 <= self.max_bo_bytes <= OFF_T_MAX:
            yield "max_bo_bytes", f"max_bo_bytes {self.max_bo_bytes} must be between 0 and 2**63 - 1"

    def check(self) -> None:
        for _names, problem in self.problems():
            raise InvalidRequestError(problem)

    def default_job_problems(self) -> Iterator[tuple[str, str]]:
        """What the engine would refuse every job with the default settings for (`Engine.start_dump`: the
        staging of a batch, `staging_shortfall`), as `problems` says it: a dump with the default compression and
        chunk size, and an incremental one (which also reads its parent's chunk: the most buffers any batch
        takes, as many as a restore of an image with deltas).  An engine may run with less (a caller that
        asks for smaller chunks); a daemon's defaults must not (vramd.service.config)."""
        for what, names, buffers in (
                ("a dump with the default compression", "staging_budget, chunk_size, compression",
                 dump_buffers(self.compression, incremental=False)),
                ("an incremental dump", "staging_budget, chunk_size",
                 dump_buffers(self.compression, incremental=True))):
            short = staging_shortfall(self.staging_budget, self.chunk_size, buffers)
            if short is not None:
                yield names, f"{what}: {short}"
                return


class Engine:
    def __init__(self, config: EngineConfig | None = None, backends: dict[str, Backend] | None = None) -> None:
        self.config = config or EngineConfig()
        self.config.check()
        self.pool = StagingPool(self.config.staging_budget, huge_pages=self.config.staging_huge_pages)
        self.unavailable: dict[str, str] = {}  # backend name -> why it is not here
        self.backends = self._create_backends() if backends is None else backends
        for b in self.backends.values():
            b.attach(self.pool)
        c = self.config
        self._cpu = ThreadPoolExecutor(c.cpu_threads, thread_name_prefix="vramd-cpu")
        self._io = ThreadPoolExecutor(c.io_threads, thread_name_prefix="vramd-io")
        self._copy = ThreadPoolExecutor(c.copy_threads, thread_name_prefix="vramd-copy")
        # every job's stage timings add up here (None: not measured)
        self.stage_times: StageTimes | None = StageTimes() if c.stage_times else None
        self.ctx = JobContext(self.pool, self.backends, self._cpu, self._io, c.inflight_per_gpu, self._copy,
                              self.stage_times, max_bo_bytes=c.max_bo_bytes,
                              compress_workers=min(c.copy_threads, cores()),
                              dump_workers_per_gpu=c.dump_inflight_per_gpu,
                              device_workers_per_gpu=c.device_inflight_per_gpu)

    def _create_backends(self) -> dict[str, Backend]:
        """Every registered backend that can work here; the others go to `unavailable`, with the reason."""
        c = self.config
        options = BackendOptions(workers_per_gpu=c.inflight_per_gpu, copy_threads=c.copy_threads,
                                 sdma_library=c.sdma_library,
                                 render_nodes=c.render_nodes, recommended_mask=c.recommended_mask)
        disabled = set() if c.sdma else {BackendKind.SDMA}
        backends: dict[str, Backend] = {}
        for name, cls in REGISTRY.items():
            if name in disabled:
                self.unavailable[name] = "disabled in the configuration"
                continue
            try:
                backends[name] = cls.create(options)
            except BackendUnavailableError as e:
                self.unavailable[name] = e.message
        return backends

    async def __aenter__(self) -> Engine:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        for b in self.backends.values():
            b.close()
        self._cpu.shutdown(wait=True)
        self._io.shutdown(wait=True)
        self._copy.shutdown(wait=True)
        self.pool.close()

    # --- jobs --------------------------------------------------------------

    def start_dump(self, image_id: bytes, *,
                   compression: Compression | None = None, chunk_size: int | None = None,
                   on_progress: ProgressCallback | None = None, parent: ImageReader | None = None,
                   parent_hint: str = "", dedup: bool = True) -> DumpJob:
        """A dump into a new image `image_id` in chunks of `chunk_size` bytes (None: the engine's), compressed as
        `compression` says (None: the engine's); the image's writer holds the chunk size from here on (the job
        and its pipeline read it there).  Its data files are attached to `job.writer` and its manifest file
        set (`job.writer.manifest_fd`) before `finish`.
        `parent` (from `open_parent`): an incremental dump; the job owns and closes it, even on error."""
        try:
            cs = chunk_size or self.config.chunk_size  # the one default: the engine's (a daemon's: its config's)
            problem = chunk_size_problem(cs)
            if problem is not None:
                raise InvalidRequestError(problem)
            if parent is not None and parent.manifest.chunk_size != cs:
                raise InvalidRequestError(f"the parent image's chunk size is {parent.manifest.chunk_size}; an "
                                          f"incremental image must use the same (asked: {cs})")
            comp = compression or self.config.compression
            self._check_staging(cs, dump_buffers(comp, incremental=parent is not None), "chunk size")
        except BaseException:
            if parent is not None:
                parent.close()
            raise
        writer = ImageWriter(image_id, chunk_size=cs, compression=comp.to_pb(),
                             stripes=self.config.data_files_per_gpu)
        return DumpJob(self.ctx, writer, compression=comp, on_progress=on_progress, parent=parent,
                       parent_hint=parent_hint, dedup=dedup, max_chain=self.config.max_chain_depth)

    async def open_parent(self, parent_manifest_fds: Sequence[int]) -> ImageReader:
        """An incremental dump's parent: `parent_manifest_fds` are its manifest, then those of its own parents.
        Its data files are attached next (`ImageReader.needed`, `attach`)."""
        if not parent_manifest_fds:
            raise InvalidRequestError("no parent manifest given")
        reader = await ImageReader.from_manifests(parent_manifest_fds[0], parent_manifest_fds[1:])
        return await self._parent_entries(reader)

    async def _parent_entries(self, reader: ImageReader) -> ImageReader:
        try:
            if reader.manifest.format_version >= 2:  # its records by hash: work that grows with it, off the loop
                reader.chunk_entries = await asyncio.get_running_loop().run_in_executor(
                    self._cpu, parent_entries, reader.manifest, 1)
        except BaseException:
            reader.close()
            raise
        return reader

    def start_restore(self, reader: ImageReader, *, on_progress: ProgressCallback | None = None,
                      gpu_map: GpuMap | None = None, allow_partial: bool = False,
                      supply_fd: int | None = None) -> RestoreJob:
        """A restore of the image `reader` reads (its data files attached before the first target is added).
        `gpu_map(manifest) -> {image gpu_id: present gpu_id}` places each BO on its present GPU.  `supply_fd`:
        a streamed restore's supply pipe (ImageJob.stream; the caller's fd).  The job owns the reader and
        closes it, even on error."""
        try:
            self._check_image_staging(reader)
            mapping = gpu_map(reader.manifest) if gpu_map is not None else None
            job = RestoreJob(self.ctx, reader, on_progress=on_progress, gpu_map=mapping, allow_partial=allow_partial)
            if supply_fd is not None:
                job.stream(supply_fd, "restored", notes=self.config.supply_notes)
            return job
        except BaseException:
            reader.close()
            raise

    def start_verify(self, reader: ImageReader, *, on_progress: ProgressCallback | None = None,
                     supply_fd: int | None = None) -> VerifyJob:
        """A job that reads and checks every chunk of the image (its data files attached before `finish`),
        writing nowhere.  `supply_fd`: as `start_restore`'s.  The job owns the reader."""
        try:
            self._check_image_staging(reader)
            job = VerifyJob(self.ctx, reader, on_progress=on_progress)
            if supply_fd is not None:
                job.stream(supply_fd, "verified", notes=self.config.supply_notes)
            return job
        except BaseException:
            reader.close()
            raise

    def _check_staging(self, chunk_size: int, buffers: int, what: str) -> None:
        """A job whose one batch cannot fit the staging budget could never move a byte: refuse it up front."""
        short = staging_shortfall(self.pool.budget, chunk_size, buffers)
        if short is not None:
            raise LimitExceededError(f"{what}: {short}")

    def _check_image_staging(self, reader: ImageReader) -> None:
        self._check_staging(reader.manifest.chunk_size, buffers_to_read(reader), "the image's chunk size")
