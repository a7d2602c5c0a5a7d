"""A committed image opened for reading: the manifest checked, every data file opened and checked up front."""
from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Sequence

from ..errors import ForeignDataFileError, TruncatedDataError
from ..pb import image_pb2 as pb
from .fileio import image_os_error, open_regular, pread_into, preadv_all, read_manifest, reopen_direct
from .format import DATA_HEADER, check_data_header


class ImageReader:
    """A committed image, its data files opened and checked up front."""

    def __init__(self, dir_fd: int, manifest: pb.Manifest, fds: list[int]) -> None:
        self.dir_fd = dir_fd
        self.manifest = manifest
        self.fds = fds
        self.bos = {bo.id: bo for bo in manifest.bos}
        self._lock = threading.Lock()
        self._direct: dict[int, tuple[int, int] | None] = {}  # file index -> (O_DIRECT fd, file size), or None

    @classmethod
    async def open(cls, dir_fd: int) -> ImageReader:
        """Read and check the manifest, then open and check every data file (file I/O in a thread).

        The manifest's file names were checked by decode_manifest (plain names of this
        format only); each is opened O_NOFOLLOW|O_NONBLOCK and must be a regular file.
        """
        manifest = await read_manifest(dir_fd)
        fds = await asyncio.get_running_loop().run_in_executor(None, cls._open_files, dir_fd, manifest)
        return cls(dir_fd, manifest, fds)

    @classmethod
    def _open_files(cls, dir_fd: int, manifest: pb.Manifest) -> list[int]:
        fds: list[int] = []
        try:
            for df in manifest.files:
                try:
                    fd = open_regular(df.name, dir_fd, ForeignDataFileError)
                except FileNotFoundError:
                    raise TruncatedDataError(f"data file {df.name} listed in the manifest is missing") from None
                fds.append(fd)
                header = memoryview(bytearray(DATA_HEADER.size))
                try:
                    got = pread_into(fd, header, 0)
                    size = os.fstat(fd).st_size
                except OSError as e:
                    raise image_os_error(e, f"cannot read data file {df.name}") from None
                check_data_header(bytes(header[:got]), manifest.image_id, df.name)
                if size < df.length:
                    raise cls._truncation(manifest, df, len(fds) - 1, size)
        except BaseException:
            for fd in fds:
                os.close(fd)
            raise
        return fds

    @staticmethod
    def _truncation(manifest: pb.Manifest, df: pb.DataFile, index: int, size: int) -> TruncatedDataError:
        msg = f"data file {df.name} is {size} bytes; the manifest says {df.length}"
        first = None  # the first chunk (by file position) that is cut short
        for bo in manifest.bos:
            if bo.file_index != index:
                continue
            for i, (off, ln) in enumerate(zip(bo.record_offsets, bo.record_lengths)):
                if off + ln > size and (first is None or off < first[0]):
                    first = (off, bo.id, i * manifest.chunk_size)
        if first:
            return TruncatedDataError(msg, bo_id=first[1], offset=first[2])
        return TruncatedDataError(msg)

    def readv(self, file_index: int, views: Sequence[memoryview], offset: int) -> int:
        """Fill `views` from consecutive file bytes at `offset`; returns bytes read (short at end of file)."""
        return preadv_all(self.fds[file_index], views, offset)

    def direct_fd(self, file_index: int) -> tuple[int, int] | None:
        """(the data file opened a second time with O_DIRECT, its size), by the same opening rules as
        every image file and checked to be the file already open (fileio.reopen_direct); None where
        the file system refuses O_DIRECT.  Opened on first use, in the calling thread (never the loop)."""
        with self._lock:
            if file_index not in self._direct:
                fd = reopen_direct(self.manifest.files[file_index].name, self.dir_fd, self.fds[file_index],
                                   os.O_RDONLY)
                if fd is not None:
                    try:
                        self._direct[file_index] = (fd, os.fstat(fd).st_size)
                    except OSError:
                        os.close(fd)
                        self._direct[file_index] = None
                else:
                    self._direct[file_index] = None
            return self._direct[file_index]

    def close(self) -> None:
        with self._lock:
            for d in self._direct.values():
                if d is not None:
                    os.close(d[0])
            self._direct.clear()
        for fd in self.fds:
            os.close(fd)
        self.fds = []
