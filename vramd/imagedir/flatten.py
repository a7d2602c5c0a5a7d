"""`vramctl flatten`: an incremental image copied into a self-contained one (no parents needed), in this process.

The copy is vramd.image.flatten's, through fds; this opens the image and its
parents and creates and commits the new image's files, with the caller's
rights, as any client does.
"""
from __future__ import annotations

import os
from collections.abc import Sequence

from ..image.flatten import check_flattenable, flat_compression, flat_gpus, flatten_into
from ..image.writer import ImageWriter
from ..pb import image_pb2 as pb
from .dump import DumpDirectory
from .files import ImageFiles, read_image


async def flatten(dir_fd: int, parent_fds: Sequence[int], out_fd: int) -> pb.Manifest:
    """Copy the image in `dir_fd` (its parents' directories: `parent_fds`, nearest first) into `out_fd`."""
    with ImageFiles(dir_fd, parent_fds) as files:
        reader = await read_image(files)
        try:
            check_flattenable(reader)
            with DumpDirectory(out_fd) as out:  # locked; its files ours until the commit
                out.begin(os.urandom(16))
                writer = ImageWriter(out.image_id, chunk_size=reader.manifest.chunk_size,
                                     compression=flat_compression(reader))
                try:
                    for gpu in flat_gpus(reader):
                        f = out.data_file(gpu)
                        writer.attach(gpu, f.fd, f.direct_fd)
                    writer.manifest_fd = out.manifest_file()
                    manifest = await flatten_into(reader, writer)
                finally:
                    await writer.aclose()
                out.commit()
                return manifest
        finally:
            reader.close()
