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
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from .. import __version__
from ..errors import InvalidRequestError, VramdError, from_os_error
from ..pb import image_pb2 as pb
from .fileio import FILE_MODE, pwrite_all, read_manifest
from .format import FORMAT_VERSION, MANIFEST_NAME, Bytes, data_file_name, encode_data_header, encode_manifest


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
    writer: ThreadPoolExecutor = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.writer = ThreadPoolExecutor(1, thread_name_prefix=f"vramd-write-{self.gpu_id:x}")

    def reserve(self, length: int) -> int:
        off = self.end
        self.end += length
        return off

    def write(self, iov: Sequence[Bytes], offset: int) -> asyncio.Future[None]:
        return asyncio.get_running_loop().run_in_executor(self.writer, pwrite_all, self.fd, iov, offset)

    def close(self) -> None:
        self.writer.shutdown(wait=True)
        os.close(self.fd)


class ImageWriter:
    def __init__(self, dir_fd: int, *, chunk_size: int, compression: pb.Compression) -> None:
        # flock is per open file description: lock a description of our own
        # (the same directory, reopened through the fd) so that two jobs given
        # the same fd still exclude each other.
        try:
            self._lock_fd = os.open(".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=dir_fd)
        except OSError as e:
            raise from_os_error(e, f"image directory fd {dir_fd} is unusable", InvalidRequestError) from None
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            os.close(self._lock_fd)
            if e.errno == errno.EWOULDBLOCK:
                raise InvalidRequestError("another dump is writing into this image directory") from None
            raise from_os_error(e, "cannot lock the image directory", InvalidRequestError) from None
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
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, FILE_MODE, dir_fd=self.dir_fd)
            except OSError as e:
                raise from_os_error(e, f"cannot create {tmp} in the image directory") from None
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
        await loop.run_in_executor(None, self._commit_manifest, tmp, encode_manifest(manifest))
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

    def _commit_manifest(self, tmp: str, blob: bytes) -> None:
        """Write and fsync the manifest under its temporary name, then rename it into place (in a thread)."""
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, FILE_MODE, dir_fd=self.dir_fd)
        try:
            pwrite_all(fd, [blob], 0)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.rename(tmp, MANIFEST_NAME, src_dir_fd=self.dir_fd, dst_dir_fd=self.dir_fd)

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


