"""What restore and verify jobs share: a job over a committed image (read.py reads and checks its records)."""
from __future__ import annotations

from collections.abc import Iterator

from ...backends import Direction
from ...image.reader import ImageReader
from ...pb import image_pb2 as pb
from ..pipeline import ChunkTask, ProgressCallback
from .common import JobBase, JobContext, RestoreTarget
from .read import ImageBo, ImageReadEnds
from .stream import Supply


class ImageJob(JobBase[ImageBo, RestoreTarget]):
    """A job over a committed image; finish() waits for every queued BO."""

    direction = Direction.WRITE

    def __init__(self, ctx: JobContext, reader: ImageReader, ends: ImageReadEnds,
                 on_progress: ProgressCallback | None = None) -> None:
        self.reader = reader
        self.ends = ends
        self.supply: Supply | None = None  # a streamed session's (`stream`)
        super().__init__(ctx, ends, on_progress)

    def stream(self, supply_fd: int, done: str, notes: bool = True) -> None:
        """The image's own data files are filled while the job runs: each record is read only once the client
        has said, over the pipe `supply_fd` (the caller's: it closes it after `finish`), that it is final
        (stream.py).  Before any file is attached.  `done`: what a chunk that never came was not ("restored");
        `notes`: over a socket, send notes back (off: read it as a pipe, as a daemon before them did)."""
        supply = Supply(self.reader, supply_fd, self.pipeline.fail, self.ctx.io, done, notes)
        supply.start()
        self.reader.streamed = True  # headers checked once supplied
        # what was just written is in the page cache: O_DIRECT would only make the kernel write it back first
        self.ends.direct = False
        self.pipeline.gate = self.supply = supply

    @property
    def manifest(self) -> pb.Manifest:
        return self.reader.manifest

    # --- what a session sees (interface.Job) ----------------------------------

    def files_needed(self) -> list[tuple[int, str]]:
        """The image's data files (and its parents') the client must still attach: (image, name)."""
        return self.reader.needed()

    @property
    def ready(self) -> bool:
        return self.reader.ready

    async def attach_file(self, image: int, name: str, fd: int, direct: int | None) -> None:
        """A data file of the image (`image` 0) or of its k-th parent (`image` k)."""
        await self.reader.attach(image, name, fd, direct)

    # --- the BOs --------------------------------------------------------------

    def _queue(self, bo: ImageBo) -> None:
        self.pipeline.add(self._lane(bo), self._chunks(bo), bo.size)

    def _lane(self, bo: ImageBo) -> int:
        """The pipeline lane `bo`'s chunks go through: its GPU's."""
        return bo.gpu_id

    def _chunks(self, bo: ImageBo) -> Iterator[ChunkTask[ImageBo]]:
        e, cs, size, locate = bo.manifest_entry, self.ends.chunk_size, bo.size, self.reader.locate  # bo.size: e's
        for i, offset in enumerate(range(0, size, cs)):
            loc = locate(e, i)
            if loc is None:  # a hole
                yield ChunkTask(bo, i, offset, min(cs, size - offset))
            else:
                yield ChunkTask(bo, i, offset, min(cs, size - offset), loc.offset, loc.length, loc)

    def _check_complete(self) -> None:
        """Called after every chunk landed, before the job reports success."""

    async def finish(self) -> pb.Manifest:
        """The barrier: wait until every queued BO is done (or the first error); returns the image's manifest."""
        try:
            await self.pipeline.wait()
            self._check_complete()
            return self.manifest
        finally:
            if self.supply is not None:  # before the caller closes the pipe and the data files
                self.supply.stop()
                await self.supply.closed()
            self._release_all()
            self.reader.close()
