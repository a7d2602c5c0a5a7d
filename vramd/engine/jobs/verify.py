"""The verify job: reads and checks every chunk of an image, writing nowhere."""
from __future__ import annotations

from ...errors import InvalidRequestError
from ...hostmem.staging import StagingBuffer
from ...image.codec import DecodedChunk
from ...image.format import chunk_count
from ...image.reader import ImageReader
from ...pb import image_pb2 as pb
from ..pipeline import ChunkTask, ProgressCallback
from .common import JobContext
from .image_job import ImageJob
from .interface import BoIntake
from .read import ImageBo, ImageReadEnds

# A verify moves no GPU memory: its lanes only set how many batches are in flight.  It spreads the
# image's gpu_ids over at most this many (a node's GPU count), whatever an image names: each lane is
# `workers_per_gpu` tasks, and a crafted manifest may name thousands of gpu_ids.
VERIFY_LANES = 8


class VerifyEnds(ImageReadEnds):
    """Drain: nothing; every chunk has been checked (and decoded) by then."""

    async def drain(self, tasks: list[ChunkTask[ImageBo]], bufs: list[StagingBuffer],
                    decoded: list[DecodedChunk]) -> None:
        return None


class VerifyJob(ImageJob):
    """Reads and checks every chunk of the image, writing nowhere; every BO is queued when it begins
    (`finish`: the image's data files are attached by then)."""

    def __init__(self, ctx: JobContext, reader: ImageReader, *, on_progress: ProgressCallback | None = None) -> None:
        super().__init__(ctx, reader, VerifyEnds(reader, ctx.pool, ctx.io), on_progress)
        self._begun = False
        self._lanes: dict[int, int] = {}  # the image's gpu_id -> lane

    def intake(self, gpu_ids: frozenset[int]) -> BoIntake:
        raise InvalidRequestError("a verify session takes no BOs")

    def _lane(self, bo: ImageBo) -> int:
        return self._lanes.setdefault(bo.gpu_id, len(self._lanes) % VERIFY_LANES)

    def begin(self) -> None:
        """Queue every BO of the image (once)."""
        if self._begun:
            return
        self._begun = True
        for entry in self.manifest.bos:
            nchunks = chunk_count(entry.size, self.manifest.chunk_size)
            bo = self.bos[entry.id] = ImageBo(entry.id, entry.gpu_id, entry.size, None, None,
                                              chunks_left=nchunks, entry=entry)
            self._queue(bo)

    async def finish(self) -> pb.Manifest:
        self.begin()
        return await super().finish()
