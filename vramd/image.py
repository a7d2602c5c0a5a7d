"""Image directories: data files written at reserved offsets, committed atomically.

Everything goes through the directory fd the caller passed (openat-style
`dir_fd=`), never through a path, so the engine only touches the directory
it was handed.  A dump writes `<data>.tmp` files; commit fsyncs them,
renames them into place, writes the manifest to a temporary name, fsyncs
it, renames it to `manifest.vrdm` and fsyncs the directory.  Until that last
rename the directory holds no (new) image; after it, the old image's data
files are removed.  One dump per directory at a time (flock on the fd).
"""
from __future__ import annotations

import asyncio
import errno
import fcntl
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import aiofiles
import aiofiles.os

from . import __version__
from .errors import (
    InvalidRequestError,
    ManifestMissingError,
    TruncatedDataError,
    VramdError,
)
from .imageformat import (
    DATA_HEADER,
    FORMAT_VERSION,
    MANIFEST_NAME,
    MAX_MANIFEST_BYTES,
    check_data_header,
    data_file_name,
    decode_manifest,
    encode_data_header,
    encode_manifest,
)
from .pb import image_pb2 as pb

_FILE_MODE = 0o600  # images hold process memory


def _opener(dir_fd: int):
    return lambda path, flags: os.open(path, flags | os.O_CLOEXEC, _FILE_MODE, dir_fd=dir_fd)


def pwrite_all(fd: int, iov: list, offset: int) -> None:
    """pwritev until every byte of iov is written (short writes continue)."""
    views = [memoryview(b).cast("B") for b in iov]
    while views:
        n = os.pwritev(fd, views, offset)
        offset += n
        while views and n >= len(views[0]):
            n -= len(views.pop(0))
        if views and n:
            views[0] = views[0][n:]


def pread_into(fd: int, view: memoryview, offset: int) -> int:
    """preadv until view is full or end of file; returns bytes read."""
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], offset + done)
        if n == 0:
            break
        done += n
    return done


def preadv_all(fd: int, views: list[memoryview], offset: int) -> int:
    """preadv until every view is full or end of file; returns bytes read."""
    views = [v for v in views if len(v)]
    total = 0
    while views:
        n = os.preadv(fd, views, offset)
        if n == 0:
            break
        offset += n
        total += n
        while views and n >= len(views[0]):
            n -= len(views.pop(0))
        if views and n:
            views[0] = views[0][n:]
    return total


async def read_manifest(dir_fd: int) -> pb.Manifest:
    try:
        async with aiofiles.open(MANIFEST_NAME, "rb", opener=_opener(dir_fd)) as f:
            blob = await f.read(MAX_MANIFEST_BYTES + 1)
    except FileNotFoundError:
        raise ManifestMissingError(
            f"no committed image here: {MANIFEST_NAME} is missing (an interrupted dump never commits one)"
        ) from None
    return decode_manifest(blob)


@dataclass(eq=False)
class DataFileWriter:
    """One per-GPU data file.  Offsets are reserved on the event loop; the
    writes themselves go through one thread per file, because concurrent
    writes to one file only contend on its inode lock (measured: 4 writers
    into one tmpfs file ran 3x slower than one)."""

    index: int
    gpu_id: int
    name: str
    fd: int
    end: int  # next free byte
    writer: ThreadPoolExecutor = field(repr=False, default=None)

    def __post_init__(self) -> None:
        self.writer = ThreadPoolExecutor(1, thread_name_prefix=f"vramd-write-{self.gpu_id:x}")

    def reserve(self, length: int) -> int:
        off = self.end
        self.end += length
        return off

    def write(self, iov: list, offset: int) -> asyncio.Future:
        return asyncio.get_running_loop().run_in_executor(self.writer, pwrite_all, self.fd, iov, offset)

    def close(self) -> None:
        self.writer.shutdown(wait=True)
        os.close(self.fd)


class ImageWriter:
    def __init__(self, dir_fd: int, *, chunk_size: int, compression: pb.Compression):
        # flock is per open file description: lock a description of our own
        # (the same directory, reopened through the fd) so that two jobs given
        # the same fd still exclude each other.
        try:
            self._lock_fd = os.open(".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=dir_fd)
        except OSError as e:
            raise InvalidRequestError(f"image directory fd {dir_fd} is unusable: {e.strerror}") from None
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            os.close(self._lock_fd)
            if e.errno == errno.EWOULDBLOCK:
                raise InvalidRequestError("another dump is writing into this image directory") from None
            raise InvalidRequestError(f"cannot lock the image directory: {e.strerror}") from None
        self.dir_fd = dir_fd
        self.image_id = os.urandom(16)
        self.chunk_size = chunk_size
        self.compression = compression
        self.files: dict[int, DataFileWriter] = {}
        # Names this dump created that must go unless the manifest commits.
        self._owned: list[str] = []

    def data_file(self, gpu_id: int) -> DataFileWriter:
        f = self.files.get(gpu_id)
        if f is None:
            name = data_file_name(self.image_id, gpu_id)
            tmp = name + ".tmp"
            try:
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, _FILE_MODE, dir_fd=self.dir_fd)
            except OSError as e:
                raise VramdError(f"cannot create {tmp} in the image directory: {e.strerror}") from None
            self._owned.append(tmp)
            header = encode_data_header(self.image_id)
            pwrite_all(fd, [header], 0)
            f = self.files[gpu_id] = DataFileWriter(len(self.files), gpu_id, name, fd, len(header))
        return f

    async def commit(self, bos: list[pb.BoEntry], totals: pb.Totals, topology_json: bytes = b"") -> pb.Manifest:
        loop = asyncio.get_running_loop()
        files = sorted(self.files.values(), key=lambda f: f.index)
        await asyncio.gather(*(loop.run_in_executor(None, os.fsync, f.fd) for f in files))
        try:
            previous = await read_manifest(self.dir_fd)
        except VramdError:
            previous = None
        for f in files:
            os.rename(f.name + ".tmp", f.name, src_dir_fd=self.dir_fd, dst_dir_fd=self.dir_fd)
            self._owned[self._owned.index(f.name + ".tmp")] = f.name
        manifest = pb.Manifest(
            format_version=FORMAT_VERSION, image_id=self.image_id, writer=f"vramd {__version__}",
            created_unix_ns=time.time_ns(), chunk_size=self.chunk_size, compression=self.compression,
            files=[pb.DataFile(name=f.name, gpu_id=f.gpu_id, length=f.end) for f in files],
            bos=bos, totals=totals, topology_json=topology_json,
        )
        tmp = f".{MANIFEST_NAME}.{self.image_id.hex()}.tmp"
        self._owned.append(tmp)
        async with aiofiles.open(tmp, "xb", opener=_opener(self.dir_fd)) as out:
            await out.write(encode_manifest(manifest))
            await out.flush()
            await loop.run_in_executor(None, os.fsync, out.fileno())
        await aiofiles.os.rename(tmp, MANIFEST_NAME, src_dir_fd=self.dir_fd, dst_dir_fd=self.dir_fd)
        self._owned.clear()  # committed: from here on the image is the new one
        await loop.run_in_executor(None, os.fsync, self.dir_fd)
        if previous is not None:
            keep = {f.name for f in files}
            for old in previous.files:
                if old.name not in keep:
                    try:
                        os.unlink(old.name, dir_fd=self.dir_fd)
                    except FileNotFoundError:
                        pass
        return manifest

    def close(self) -> None:
        """Close files; if the image was not committed, remove everything this dump created."""
        for f in self.files.values():
            f.close()
        self.files.clear()
        for name in self._owned:
            try:
                os.unlink(name, dir_fd=self.dir_fd)
            except OSError:
                pass
        self._owned.clear()
        if self._lock_fd >= 0:
            os.close(self._lock_fd)  # drops the lock
            self._lock_fd = -1


class ImageReader:
    """A committed image, its data files opened and checked up front."""

    def __init__(self, dir_fd: int, manifest: pb.Manifest, fds: list[int]):
        self.dir_fd = dir_fd
        self.manifest = manifest
        self.fds = fds
        self.bos = {bo.id: bo for bo in manifest.bos}

    @classmethod
    async def open(cls, dir_fd: int) -> "ImageReader":
        manifest = await read_manifest(dir_fd)
        fds: list[int] = []
        try:
            for df in manifest.files:
                try:
                    fd = os.open(df.name, os.O_RDONLY | os.O_CLOEXEC, dir_fd=dir_fd)
                except FileNotFoundError:
                    raise TruncatedDataError(f"data file {df.name} listed in the manifest is missing") from None
                fds.append(fd)
                check_data_header(os.pread(fd, DATA_HEADER.size, 0), manifest.image_id, df.name)
                size = os.fstat(fd).st_size
                if size < df.length:
                    raise cls._truncation(manifest, df, len(fds) - 1, size)
        except BaseException:
            for fd in fds:
                os.close(fd)
            raise
        return cls(dir_fd, manifest, fds)

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

    def read(self, file_index: int, view: memoryview, offset: int, *, bo_id: int, bo_offset: int) -> None:
        got = pread_into(self.fds[file_index], view, offset)
        if got != len(view):
            name = self.manifest.files[file_index].name
            raise TruncatedDataError(f"data file {name} ends inside a chunk record at {offset + got:#x}",
                                     bo_id=bo_id, offset=bo_offset)

    def readv(self, file_index: int, views: list[memoryview], offset: int) -> int:
        """Fill `views` from consecutive file bytes at `offset`; returns bytes read (short at end of file)."""
        return preadv_all(self.fds[file_index], views, offset)

    def close(self) -> None:
        for fd in self.fds:
            os.close(fd)
        self.fds = []
