"""A new image's files, written through fds the client created: data files at reserved offsets, then the manifest.

The daemon never opens, creates or renames a name (docs/protocol.md, "Image
files: the client's rights"): the client creates each GPU's data files (as
`<name>.tmp`; `stripes` of them, format v3) and the manifest's temporary
file, and attaches them; the
writer writes the data files (a header, then records at offsets reserved on
the event loop), fsyncs them, writes the manifest into its file and fsyncs
it.  The client then commits: renames them into place and fsyncs the
directory (vramd.imagedir, DumpDirectory).  The fds are the caller's: the
writer never closes them.

No file I/O runs on the event loop: each data file has its own writer
thread (its header, its writes, its fsync, in that order), and the manifest
is built, encoded and written in the image's own thread.  Every OSError
becomes a typed error naming the file (NO_SPACE, READ_ONLY_FS, IO_ERROR,
NOT_WRITABLE, else IMAGE_ERROR).
"""
from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import threading
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

from .. import __version__
from ..errors import InvalidRequestError
from ..hostmem.libc import SYNC_FILE_RANGE_WRITE, libc, memory_file
from ..hostmem.libc import ffi as libc_ffi
from ..pb import image_pb2 as pb
from .fileio import image_os_error, pwrite_all
from .format import FORMAT_VERSION, MAX_STRIPES, Bytes, encode_data_header
from .manifest import encode_manifest
from .names import data_file_name, manifest_tmp_name

WRITEBACK_EVERY = 2 << 20  # see DataFileWriter._written

log = logging.getLogger(__name__)

@dataclass(eq=False)
class _Writeback:
    """What the file systems of one image's data files said to sync_file_range, by st_dev: it started the
    writeback (`taken`), or it has no such call (`refused`: not asked again).  `asking`: held for a device's
    first ask, so that its data files ask once between them."""

    taken: set[int] = field(default_factory=set)
    refused: set[int] = field(default_factory=set)
    asking: threading.Lock = field(default_factory=threading.Lock)


@dataclass(eq=False)
class DataFileWriter:
    """One of a GPU's data files (`stripe`), written through the fd the client created (`fd`; `direct`: the
    same file opened with O_DIRECT, or None).  Offsets are reserved on the event loop; the header, the writes and the
    fsync run in one thread of its own, because concurrent writes to one file only contend on its inode
    lock (measured: 4 writers into one tmpfs file ran 3x slower than one).  The header is the thread's
    first task, so every write finds the file begun (or fails with the header's error).

    The engine's copy threads also write whole batches themselves (`pwrite`, in the calling thread, never
    on the event loop), page-aligned ones through `direct` where there is one; offsets are reserved under
    a lock for that."""

    index: int
    gpu_id: int
    name: str
    fd: int
    image_id: bytes
    direct: int | None = None
    stripe: int = 0  # which of its GPU's data files
    version: int = FORMAT_VERSION  # the image's format version, in the header
    # what the image's file systems said to sync_file_range: shared by its data files (_written)
    writeback: _Writeback = field(default_factory=_Writeback, repr=False)
    end: int = 0  # next free byte
    writer: ThreadPoolExecutor = field(init=False, repr=False)
    _opened: Future[None] = field(init=False, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False)
    busy: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False)  # ImageWriter.claim
    memory: bool = field(init=False, default=False)  # on a file system whose files are memory (tmpfs)
    device: int = field(init=False, default=0)  # the file's st_dev
    # bytes written through the page cache since the last writeback began (_written)
    _dirty: int = field(default=0, init=False, repr=False)

    def __post_init__(self) -> None:
        self.memory = memory_file(self.fd)
        self.device = os.fstat(self.fd).st_dev
        self.end = len(encode_data_header(self.image_id, self.version))
        self.writer = ThreadPoolExecutor(1, thread_name_prefix=f"vramd-write-{self.gpu_id:x}.{self.stripe}")
        self._opened = self.writer.submit(self._begin)

    @property
    def tmp(self) -> str:
        """The file's name until the client commits it (what errors name)."""
        return self.name + ".tmp"

    def _begin(self) -> None:
        try:
            os.ftruncate(self.fd, 0)  # whatever the file held: the image is only what this dump writes
        except OSError as e:
            raise image_os_error(e, f"cannot write {self.tmp}") from None
        self._write_header(self.version)

    def _write_header(self, version: int) -> None:
        try:
            pwrite_all(self.fd, [encode_data_header(self.image_id, version)], 0)
        except OSError as e:
            raise image_os_error(e, f"cannot write {self.tmp}") from None

    def reserve(self, length: int, align: int = 1) -> int:
        """`length` bytes of the file, at an offset that is a multiple of `align` (the bytes skipped to get
        there are a gap no record uses: the manifest lists every record's offset and length)."""
        with self._lock:  # the copy threads reserve too
            self.end += -self.end % align
            off = self.end
            self.end += length
            return off

    def _pwrite(self, iov: Sequence[Bytes], offset: int, bo_id: int | None, bo_offset: int | None,
                direct: bool = False) -> None:
        self._opened.result()  # in the writer thread: done, it ran first; elsewhere: waits for it
        fd = self.direct if direct and self.direct is not None else self.fd
        try:
            n = pwrite_all(fd, iov, offset)
            if fd == self.fd:  # through the page cache
                self._written(n)
        except OSError as e:
            raise image_os_error(e, f"cannot write {self.tmp} at {offset:#x}", bo_id=bo_id,
                                 offset=bo_offset) from None

    def _written(self, n: int) -> None:
        """Every WRITEBACK_EVERY bytes written through the page cache, start writing the file's dirty pages
        to its device (sync_file_range, waiting for nothing): the commit's fsync then finds little left to
        write, instead of all of it.  An error it reports is the write's: nothing here may hide one from
        the fsync.  A file system without it (EINVAL, ESPIPE) is asked once per image, whatever the number of
        its data files on it (`writeback`)."""
        with self._lock:  # the copy threads write too
            self._dirty += n
            if self._dirty < WRITEBACK_EVERY or self.device in self.writeback.refused:
                return
            self._dirty = 0
        wb = self.writeback
        if self.device in wb.taken:
            self._start_writeback()
            return
        with wb.asking:  # the device's first ask: once, by whichever of the image's files gets there first
            if self.device not in wb.refused:
                self._start_writeback()

    def _start_writeback(self) -> None:
        if libc.sync_file_range(self.fd, 0, 0, SYNC_FILE_RANGE_WRITE) != 0:
            err = libc_ffi.errno
            if err in (errno.EINVAL, errno.ESPIPE, errno.ENOSYS):
                self.writeback.refused.add(self.device)
                return
            raise OSError(err, os.strerror(err))
        self.writeback.taken.add(self.device)

    def pwrite(self, iov: Sequence[Bytes], offset: int, *, bo_id: int | None = None, bo_offset: int | None = None,
               direct: bool = False) -> None:
        """Write `iov` at `offset` in the calling thread (a copy thread: never the event loop); `direct`:
        through `direct_fd` (page-aligned offset, length and memory).  Errors as `write`'s."""
        self._pwrite(iov, offset, bo_id, bo_offset, direct)

    def direct_fd(self) -> int | None:
        """The file opened with O_DIRECT by the client (None where the file system refused it)."""
        self._opened.result()
        return self.direct

    def write(self, iov: Sequence[Bytes], offset: int, *, bo_id: int | None = None,
              bo_offset: int | None = None) -> asyncio.Future[None]:
        """Write `iov` at `offset` in the writer thread; an error names the file and (if given) the BO."""
        return asyncio.get_running_loop().run_in_executor(self.writer, self._pwrite, iov, offset, bo_id, bo_offset)

    def _fsync(self) -> None:
        self._opened.result()
        try:
            os.fsync(self.fd)
        except OSError as e:
            raise image_os_error(e, f"cannot fsync {self.tmp}") from None

    def fsync(self) -> asyncio.Future[None]:
        """fsync in the writer thread, after every write queued before it."""
        return asyncio.get_running_loop().run_in_executor(self.writer, self._fsync)

    def _set_version(self, version: int) -> None:
        self._opened.result()
        self._write_header(version)
        self.version = version

    def set_version(self, version: int) -> asyncio.Future[None]:
        """The header says `version` (written over, in the writer thread; the header's length is the same in
        every version, so no record moves)."""
        return asyncio.get_running_loop().run_in_executor(self.writer, self._set_version, version)

    def close(self) -> None:
        """Wait for the writer thread to drain (the fds stay the caller's)."""
        self.writer.shutdown(wait=True)

    def abandon(self, fds: Sequence[int]) -> None:
        """A file never written into but its header (ImageWriter.detach): `fds` (its own, handed over) are
        closed in its writer thread once the header write is done, and the thread ends; nothing waits.  Where
        the image closed the file already (its session ended meanwhile: `close`), they are closed here."""
        def close() -> None:
            for fd in fds:
                try:
                    os.close(fd)
                except OSError:
                    pass
        try:
            self.writer.submit(close)
        except RuntimeError:  # shut down: the header write is done, nothing to wait for
            close()
            return
        self.writer.shutdown(wait=False)


class ImageWriter:
    """A new image's data files and manifest, written through fds the client created.

    `image_id`: the new image's id (the session chose it and told the client, whose file names carry it).
    Each GPU's data files are attached (`attach`) and the manifest's file set (`manifest_fd`) before `commit`,
    by the daemon's session from what its client created (vramd.imagedir), or by an in-process client
    (vramd.imagedir.flatten) alike.
    """

    def __init__(self, image_id: bytes, *, chunk_size: int, compression: pb.Compression,
                 stripes: int = 1) -> None:
        if not 1 <= stripes <= MAX_STRIPES:
            raise InvalidRequestError(f"{stripes} data files per GPU: 1 to {MAX_STRIPES}")
        self.image_id = image_id
        self.chunk_size = chunk_size
        self.compression = compression
        self.stripes = stripes  # data files per GPU the client may attach (SessionInfo.data_files_per_gpu)
        # One data file per GPU is format v2, which readers older than v3 read; more is v3 (docs/image-format.md).
        # The data files' headers say this version from the start; a dump whose client attached only each
        # GPU's first file (one written before stripes) is v2 after all, and says so at commit.
        self.version = FORMAT_VERSION if stripes > 1 else 2
        self.files: dict[tuple[int, int], DataFileWriter] = {}  # (gpu_id, stripe) -> its data file
        self._gpus: dict[int, list[DataFileWriter]] = {}  # gpu_id -> its data files, in stripe order
        self._turn: dict[int, int] = {}  # gpu_id -> the last of its files `next_file` gave
        self._turn_lock = threading.Lock()
        self._device_turns: dict[int, threading.Lock] = {}  # st_dev -> its O_DIRECT writes take turns (claim)
        self._writeback = _Writeback()  # what its file systems said to sync_file_range (DataFileWriter._written)
        self.manifest_fd: int | None = None  # where the manifest goes (set before commit)
        # The manifest is built, encoded and written off the event loop, in the image's own thread.
        self._dirops = ThreadPoolExecutor(1, thread_name_prefix="vramd-image")

    def check_stripe(self, gpu_id: int, stripe: int) -> None:
        """INVALID_REQUEST unless data file `stripe` of the GPU is one this dump takes and is not attached yet."""
        if not 0 <= stripe < self.stripes:
            raise InvalidRequestError(f"data file {stripe} of gpu_id {gpu_id:#x}: this dump takes {self.stripes} per "
                                      f"GPU (data_files_per_gpu), 0 to {self.stripes - 1}")
        if (gpu_id, stripe) in self.files:
            raise InvalidRequestError(f"data file {stripe} of gpu_id {gpu_id:#x} is attached already")

    def attach(self, gpu_id: int, fd: int, direct: int | None = None, stripe: int = 0, *,
               publish: bool = True) -> DataFileWriter:
        """Data file `stripe` of `gpu_id` (the caller checked the fds; they stay the caller's).  `publish`
        False: written into only once `publish` is called with it (or forgotten again: `detach`)."""
        self.check_stripe(gpu_id, stripe)
        f = self.files[(gpu_id, stripe)] = DataFileWriter(
            len(self.files), gpu_id, data_file_name(self.image_id, gpu_id, stripe), fd, self.image_id, direct,
            stripe=stripe, version=self.version, writeback=self._writeback)
        self._device_turns.setdefault(f.device, threading.Lock())
        if publish:
            self.publish([f])
        return f

    def publish(self, files: Sequence[DataFileWriter]) -> None:
        """Let the copy threads write into `files`.  Each GPU's list is replaced, never changed in place:
        a copy thread in `claim` holds the list it read."""
        for f in files:
            self._gpus[f.gpu_id] = sorted([*self._gpus.get(f.gpu_id, ()), f], key=lambda x: x.stripe)

    def detach(self, files: Sequence[DataFileWriter]) -> None:
        """Forget data files attached last and never published (an AttachFiles message refused part-way:
        the clients remove the files of that message, so none of them may be listed in the manifest).
        The caller ends each (`DataFileWriter.abandon`)."""
        last = sorted(self.files.values(), key=lambda x: x.index)[len(self.files) - len(files):]
        assert sorted(f.index for f in files) == [f.index for f in last], "detach: not the last attached"
        for f in files:
            assert f not in self._gpus.get(f.gpu_id, ()), "detach: a published file"
            del self.files[(f.gpu_id, f.stripe)]

    def data_file(self, gpu_id: int) -> DataFileWriter:
        """The GPU's data file (stripe 0), attached; none is INVALID_REQUEST."""
        f = self.files.get((gpu_id, 0))
        if f is None:
            raise InvalidRequestError(f"no data file is attached for gpu_id {gpu_id:#x} (AttachFiles)")
        return f

    @contextlib.contextmanager
    def claim(self, gpu_id: int, *, direct: bool = False) -> Iterator[DataFileWriter]:
        """A data file of the GPU for one copy thread's write: the first no other copy thread is writing,
        else (every one busy) the next in turn, once it is free.  Writes into one file run one at a time in
        the kernel, under its inode lock, where the waiter spins: two copy threads writing 1 GiB into two
        tmpfs files instead of one spent 0.48 CPU s/GiB instead of 0.76 (bench/README.md).

        `direct`, a write meant for O_DIRECT: where it waits on a device (the file has an O_DIRECT twin and
        is not on tmpfs, whose files are memory), always stripe 0, and one such write of this dump at a time
        on that device, whatever its GPU (the waiter sleeps here).  On a 2-core VM's virtual disk, two at
        once into two stripes made 1 GiB dumps 24-30 % slower (1.41 -> 0.99 GB/s), and two GPUs' at once
        12-13 % slower; one at a time they ran as fast as one file (bench/README.md)."""
        files = self._gpus[gpu_id]  # in stripe order: stripe 0 first (data_file made sure it is there)
        first = files[0]
        if direct and first.direct is not None and not first.memory:
            with self._device_turns[first.device], first.busy:
                yield first
            return
        for f in files:
            if f.busy.acquire(blocking=False):
                break
        else:
            f = self.next_file(gpu_id)
            f.busy.acquire()
        try:
            yield f
        finally:
            f.busy.release()

    def next_file(self, gpu_id: int) -> DataFileWriter:
        """The GPU's data files in turn (a write queued to a file's own writer thread: `DataFileWriter.write`)."""
        files = self._gpus[gpu_id]
        with self._turn_lock:
            turn = self._turn[gpu_id] = self._turn.get(gpu_id, -1) + 1
        return files[turn % len(files)]

    async def commit(self, bos: pb.Manifest, totals: pb.Totals, topology_json: bytes = b"", *,
                     chunks: pb.ChunkTable | None = None, parents: Sequence[pb.ParentRef] = ()) -> pb.Manifest:
        """Every data file fsynced, then the manifest written into `manifest_fd` and fsynced.  The image is
        committed when the client renames the files into place.

        `bos`: a manifest holding only the image's BO entries, each made in place with `bos.add` (extending
        a repeated field with ready messages copies them one by one: 10,000 entries and the encoding took
        ~44 ms that way, ~17 ms made in place)."""
        if self.manifest_fd is None:
            raise InvalidRequestError("no file for the manifest was given (Start's manifest_fd_index)")
        files = sorted(self.files.values(), key=lambda f: f.index)
        version = FORMAT_VERSION if any(f.stripe for f in files) else 2
        if version != self.version:
            await asyncio.gather(*(f.set_version(version) for f in files))
            self.version = version
        await asyncio.gather(*(f.fsync() for f in files))
        loop = asyncio.get_running_loop()
        # Building and encoding the manifest is CPU work that grows with the BOs: in the image's thread too,
        # so the event loop keeps answering other clients while a big image commits.
        return await loop.run_in_executor(self._dirops, self._build_and_write, files, bos, totals, topology_json,
                                          chunks, parents)

    def _build_and_write(self, files: list[DataFileWriter], bos: pb.Manifest, totals: pb.Totals,
                         topology_json: bytes, chunks: pb.ChunkTable | None,
                         parents: Sequence[pb.ParentRef]) -> pb.Manifest:
        manifest = pb.Manifest(
            format_version=self.version, image_id=self.image_id, writer=f"vramd {__version__}",
            created_unix_ns=time.time_ns(), chunk_size=self.chunk_size, compression=self.compression,
            files=[pb.DataFile(name=f.name, gpu_id=f.gpu_id, length=f.end) for f in files],
            totals=totals, topology_json=topology_json, parents=parents,
        )
        manifest.MergeFrom(bos)  # its BO entries, copied whole by the protobuf runtime
        manifest.chunks.CopyFrom(chunks or pb.ChunkTable())
        blob = encode_manifest(manifest)
        fd = self.manifest_fd
        assert fd is not None
        what = manifest_tmp_name(self.image_id)
        try:
            os.ftruncate(fd, 0)
            pwrite_all(fd, [blob], 0)
            os.fsync(fd)
        except OSError as e:
            raise image_os_error(e, f"cannot write {what}") from None
        return manifest

    def _close(self) -> None:
        for f in self.files.values():
            f.close()

    async def aclose(self) -> None:
        """Wait for the writers to drain (in the image thread: no waiting on the event loop)."""
        loop = asyncio.get_running_loop()
        try:
            await loop.run_in_executor(self._dirops, self._close)
        finally:
            self._dirops.shutdown(wait=False)

    def close(self) -> None:
        """Synchronous close (outside an event loop)."""
        self._dirops.shutdown(wait=True)
        self._close()
