"""Image directories: data files written at reserved offsets, committed atomically.

Everything goes through the directory fd the caller passed (openat-style
`dir_fd=`), never through a path, so the engine only touches the directory
it was handed.  A dump writes `<data>.tmp` files; commit fsyncs them,
renames them into place, writes the manifest to a temporary name, fsyncs
it, renames it to `manifest.vrdm` and fsyncs the directory.  Until that last
rename the directory holds no (new) image; after it, the old image's data
files are removed.  One dump per directory at a time (flock on the fd); the
dump that takes the lock first removes the temporaries a crashed dump left.

No file I/O runs on the event loop: each data file has its own writer
thread (its creation, its writes, its fsync, in that order), and the
directory's operations (the sweep, the renames, the manifest, the removals)
run in the image's own thread.  Every OSError becomes a typed error naming
the file (NO_SPACE, READ_ONLY_FS, IO_ERROR, NOT_WRITABLE, else IMAGE_ERROR).
"""
from __future__ import annotations

import asyncio
import errno
import fcntl
import logging
import os
import stat
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

from .. import __version__
from ..errors import InvalidRequestError, VramdError, from_os_error
from ..pb import image_pb2 as pb
from .fileio import FILE_MODE, OPEN_FLAGS, image_os_error, pwrite_all, read_manifest_now, reopen_direct
from .format import (
    CHILD_MARK,
    FORMAT_VERSION,
    MANIFEST_NAME,
    Bytes,
    child_mark_name,
    data_file_name,
    encode_data_header,
    encode_manifest,
    is_own_temporary,
    manifest_tmp_name,
)

log = logging.getLogger(__name__)

CREATE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | OPEN_FLAGS


@dataclass(eq=False)
class DataFileWriter:
    """One per-GPU data file.  Offsets are reserved on the event loop; the
    file is created, written and fsynced by one thread of its own, because
    concurrent writes to one file only contend on its inode lock (measured: 4
    writers into one tmpfs file ran 3x slower than one).  Its creation is the
    thread's first task, so every write finds the file there (or fails with
    the creation's error).

    The engine's copy threads also write whole batches themselves (`pwrite`,
    in the calling thread, never on the event loop), page-aligned ones through
    a second descriptor opened with O_DIRECT (`direct_fd`) where the file
    system allows it; offsets are reserved under a lock for that."""

    index: int
    gpu_id: int
    name: str
    dir_fd: int
    image_id: bytes
    end: int = 0  # next free byte
    fd: int | None = field(default=None, init=False)
    created: bool = field(default=False, init=False)  # the .tmp exists and is ours: remove it unless committed
    writer: ThreadPoolExecutor = field(init=False, repr=False)
    _opened: Future[None] = field(init=False, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False)
    _direct: int | None = field(default=None, init=False, repr=False)  # the O_DIRECT descriptor, once opened
    _direct_tried: bool = field(default=False, init=False, repr=False)

    def __post_init__(self) -> None:
        self.end = len(encode_data_header(self.image_id))
        self.writer = ThreadPoolExecutor(1, thread_name_prefix=f"vramd-write-{self.gpu_id:x}")
        self._opened = self.writer.submit(self._create)

    @property
    def tmp(self) -> str:
        return self.name + ".tmp"

    def _create(self) -> None:
        try:
            fd = os.open(self.tmp, CREATE_FLAGS, FILE_MODE, dir_fd=self.dir_fd)
        except OSError as e:
            raise image_os_error(e, f"cannot create {self.tmp} in the image directory") from None
        self.fd, self.created = fd, True
        try:
            pwrite_all(fd, [encode_data_header(self.image_id)], 0)
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
        fd = self._direct if direct else self.fd
        assert fd is not None
        try:
            pwrite_all(fd, iov, offset)
        except OSError as e:
            raise image_os_error(e, f"cannot write {self.tmp} at {offset:#x}", bo_id=bo_id,
                                 offset=bo_offset) from None

    def pwrite(self, iov: Sequence[Bytes], offset: int, *, bo_id: int | None = None, bo_offset: int | None = None,
               direct: bool = False) -> None:
        """Write `iov` at `offset` in the calling thread (a copy thread: never the event loop); `direct`:
        through `direct_fd` (page-aligned offset, length and memory).  Errors as `write`'s."""
        self._pwrite(iov, offset, bo_id, bo_offset, direct)

    def direct_fd(self) -> int | None:
        """The file opened a second time with O_DIRECT, by the image's opening rules (fileio.reopen_direct);
        None where the file system refuses it.  Opened on first use, in the calling thread (never the loop)."""
        self._opened.result()
        with self._lock:
            if not self._direct_tried:
                self._direct_tried = True
                assert self.fd is not None
                self._direct = reopen_direct(self.tmp, self.dir_fd, self.fd, os.O_WRONLY)
            return self._direct

    def write(self, iov: Sequence[Bytes], offset: int, *, bo_id: int | None = None,
              bo_offset: int | None = None) -> asyncio.Future[None]:
        """Write `iov` at `offset` in the writer thread; an error names the file and (if given) the BO."""
        return asyncio.get_running_loop().run_in_executor(self.writer, self._pwrite, iov, offset, bo_id, bo_offset)

    def _fsync(self) -> None:
        self._opened.result()
        assert self.fd is not None
        try:
            os.fsync(self.fd)
        except OSError as e:
            raise image_os_error(e, f"cannot fsync {self.tmp}") from None

    def fsync(self) -> asyncio.Future[None]:
        """fsync in the writer thread, after every write queued before it."""
        return asyncio.get_running_loop().run_in_executor(self.writer, self._fsync)

    def close(self) -> None:
        self.writer.shutdown(wait=True)
        if self._direct is not None:
            os.close(self._direct)
            self._direct = None
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def sweep_temporaries(dir_fd: int, keep: str = "") -> list[str]:
    """Remove the temporaries crashed dumps left in the directory `dir_fd` (whose flock the caller holds:
    a dump that died cannot hold it, so whatever matches is garbage); returns their names.

    Only vramd's own patterns (data-<16 hex>-<8 hex>.vrd.tmp, .manifest.vrdm.<32 hex>.tmp), only
    regular files (never a symlink: lstat, then unlinkat of the name), never a name containing `keep`
    (a dump's own image id).
    """
    removed: list[str] = []
    try:
        names = os.listdir(dir_fd)
    except OSError as e:
        log.warning("image directory not swept: %s", e.strerror)
        return removed
    for name in names:
        if not is_own_temporary(name) or (keep and keep in name):
            continue
        try:
            st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
            if stat.S_ISREG(st.st_mode):
                os.unlink(name, dir_fd=dir_fd)
                removed.append(name)
        except OSError as e:
            log.warning("stale temporary %s not removed: %s", name, e.strerror)
    if removed:
        log.info("removed %d temporaries of an interrupted dump: %s", len(removed), ", ".join(removed))
    return removed


def lock_directory(dir_fd: int) -> int:
    """A description of the image directory of our own, flocked (one dump, or gc, at a time): the caller
    closes it to unlock.  Another holder is INVALID_REQUEST."""
    try:
        lock_fd = os.open(".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=dir_fd)
    except OSError as e:
        raise from_os_error(e, f"image directory fd {dir_fd} is unusable", InvalidRequestError) from None
    try:
        fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        os.close(lock_fd)
        if e.errno == errno.EWOULDBLOCK:
            raise InvalidRequestError("another dump is writing into this image directory") from None
        raise from_os_error(e, "cannot lock the image directory", InvalidRequestError) from None
    return lock_fd


class ImageWriter:
    def __init__(self, dir_fd: int, *, chunk_size: int, compression: pb.Compression,
                 parent_dirs: Sequence[int] = (), replace_parent: bool = False, client_uid: int | None = None) -> None:
        """`parent_dirs`: an incremental image's parent chain (directory fds, the caller's): the commit marks
        the child in each (`.child.<id>`), so that no dump replaces an image a child needs by accident.
        `replace_parent`: replace this directory's image even when children are marked in it.
        `client_uid`: the client's uid, where it is not the daemon's own: a parent directory is marked only
        where that uid owns it (or is root), so no client can block another user's image with a mark."""
        # flock is per open file description: lock a description of our own
        # (the same directory, reopened through the fd) so that two jobs given
        # the same fd still exclude each other.
        self._lock_fd = lock_directory(dir_fd)
        self.dir_fd = dir_fd
        self.parent_dirs = list(parent_dirs)
        self.client_uid = client_uid
        self._marked: list[int] = []  # parent directories this dump marked (unmarked again unless it commits)
        if not replace_parent:
            try:
                children = sorted(n for n in os.listdir(self._lock_fd) if CHILD_MARK.fullmatch(n))
            except OSError:
                children = []
            if children:
                os.close(self._lock_fd)
                raise InvalidRequestError(
                    f"the image in this directory is the parent of {len(children)} incremental image(s) "
                    f"(marked {children[0]}...); replacing it would break them: flatten or remove them first "
                    "(vramctl flatten, vramctl rm), or replace it anyway (replace_parent)")
        self.image_id = os.urandom(16)
        self.chunk_size = chunk_size
        self.compression = compression
        self.files: dict[int, DataFileWriter] = {}
        # Names this dump renamed into place that must go unless the manifest commits
        # (its .tmp files: each DataFileWriter knows whether it created one).
        self._owned: list[str] = []
        self._committed = False
        # The directory's own operations, one at a time, off the event loop.
        self._dirops = ThreadPoolExecutor(1, thread_name_prefix="vramd-image")
        self._swept = self._dirops.submit(self.sweep)

    def sweep(self) -> list[str]:
        """Remove the temporaries a crashed dump left (in the image thread, under the lock); returns their names.
        Never this dump's own (see sweep_temporaries)."""
        return sweep_temporaries(self._lock_fd, keep=self.image_id.hex()[:16])

    def data_file(self, gpu_id: int) -> DataFileWriter:
        """The GPU's data file (created in its writer thread; a creation error fails its first write)."""
        f = self.files.get(gpu_id)
        if f is None:
            f = self.files[gpu_id] = DataFileWriter(len(self.files), gpu_id, data_file_name(self.image_id, gpu_id),
                                                    self.dir_fd, self.image_id)
        return f

    async def commit(self, bos: list[pb.BoEntry], totals: pb.Totals, topology_json: bytes = b"", *,
                     chunks: pb.ChunkTable | None = None, parents: Sequence[pb.ParentRef] = ()) -> pb.Manifest:
        await asyncio.wrap_future(self._swept)
        files = sorted(self.files.values(), key=lambda f: f.index)
        await asyncio.gather(*(f.fsync() for f in files))
        loop = asyncio.get_running_loop()
        # Building and encoding the manifest is CPU work that grows with the BOs: in the image's thread too,
        # so the event loop keeps answering other clients while a big image commits.
        return await loop.run_in_executor(self._dirops, self._build_and_commit, files, bos, totals, topology_json,
                                          chunks, parents)

    def _build_and_commit(self, files: list[DataFileWriter], bos: list[pb.BoEntry], totals: pb.Totals,
                          topology_json: bytes, chunks: pb.ChunkTable | None,
                          parents: Sequence[pb.ParentRef]) -> pb.Manifest:
        try:
            previous = read_manifest_now(self.dir_fd)
        except (VramdError, FileNotFoundError):
            previous = None
        manifest = pb.Manifest(
            format_version=FORMAT_VERSION, image_id=self.image_id, writer=f"vramd {__version__}",
            created_unix_ns=time.time_ns(), chunk_size=self.chunk_size, compression=self.compression,
            files=[pb.DataFile(name=f.name, gpu_id=f.gpu_id, length=f.end) for f in files],
            bos=bos, totals=totals, topology_json=topology_json, chunks=chunks or pb.ChunkTable(), parents=parents,
        )
        self._commit(files, encode_manifest(manifest), previous)
        return manifest

    def _commit(self, files: list[DataFileWriter], blob: bytes, previous: pb.Manifest | None) -> None:
        """In the image thread: data files into place, the manifest written and renamed (the commit), the
        directory fsynced, the previous image's data files removed."""
        for f in files:
            try:
                os.rename(f.tmp, f.name, src_dir_fd=self.dir_fd, dst_dir_fd=self.dir_fd)
            except OSError as e:
                raise image_os_error(e, f"cannot rename {f.tmp} to {f.name}") from None
            f.created = False
            self._owned.append(f.name)
        self._mark_parents()
        self._commit_manifest(manifest_tmp_name(self.image_id), blob)
        self._committed = True  # from here on the image is the new one
        self._owned.clear()
        try:
            os.fsync(self._lock_fd)
        except OSError as e:
            raise image_os_error(e, "cannot fsync the image directory") from None
        if previous is not None:
            keep = {f.name for f in files}
            for old in previous.files:  # plain data-file names: decode_manifest admits no other
                if old.name not in keep:
                    try:
                        os.unlink(old.name, dir_fd=self.dir_fd)
                    except FileNotFoundError:
                        pass
                    except OSError as e:
                        log.warning("data file %s of the replaced image not removed: %s", old.name, e.strerror)

    def _mark_parents(self) -> None:
        """Before the commit: this child's mark in every directory of its parent chain, each fsynced."""
        name = child_mark_name(self.image_id)
        for fd in self.parent_dirs:
            if self.client_uid not in (None, 0) and os.fstat(fd).st_uid != self.client_uid:
                log.info("parent directory not marked: uid %d does not own it (its owner is not protected from "
                         "replacing it)", self.client_uid)
                continue
            # under the parent directory's lock: a dump replacing that image, which checked for marks when it
            # began, holds it to its end, so this child either fails here or is seen by every later dump
            lock = lock_directory(fd)
            try:
                mark = os.open(name, CREATE_FLAGS, FILE_MODE, dir_fd=fd)
                os.close(mark)
                self._marked.append(fd)
                os.fsync(fd)
            except OSError as e:
                raise image_os_error(e, f"cannot mark this incremental image ({name}) in a parent's directory") \
                    from None
            finally:
                os.close(lock)

    def _commit_manifest(self, tmp: str, blob: bytes) -> None:
        """Write and fsync the manifest under its temporary name, then rename it into place."""
        try:
            fd = os.open(tmp, CREATE_FLAGS, FILE_MODE, dir_fd=self.dir_fd)
        except OSError as e:
            raise image_os_error(e, f"cannot create {tmp} in the image directory") from None
        self._owned.append(tmp)
        try:
            pwrite_all(fd, [blob], 0)
            os.fsync(fd)
        except OSError as e:
            raise image_os_error(e, f"cannot write {tmp}") from None
        finally:
            os.close(fd)
        try:
            os.rename(tmp, MANIFEST_NAME, src_dir_fd=self.dir_fd, dst_dir_fd=self.dir_fd)
        except OSError as e:
            raise image_os_error(e, f"cannot rename {tmp} to {MANIFEST_NAME}") from None

    def _close(self) -> None:
        """Close files; if the image was not committed, remove everything this dump created; unlock."""
        try:
            self._swept.result()
        except Exception:  # the sweep logs its own trouble; nothing of it can fail the dump
            pass
        for f in self.files.values():
            f.close()
        names = [f.tmp for f in self.files.values() if f.created] + self._owned
        self.files.clear()
        if not self._committed:
            for name in names:
                try:
                    os.unlink(name, dir_fd=self.dir_fd)
                except OSError:
                    pass
            for fd in self._marked:
                try:
                    os.unlink(child_mark_name(self.image_id), dir_fd=fd)
                except OSError:
                    pass
        self._marked.clear()
        self._owned.clear()
        if self._lock_fd >= 0:
            os.close(self._lock_fd)  # drops the lock
            self._lock_fd = -1

    async def aclose(self) -> None:
        """`close`, in the image thread (waits for the writers to drain; no file I/O on the event loop)."""
        loop = asyncio.get_running_loop()
        try:
            await loop.run_in_executor(self._dirops, self._close)
        finally:
            self._dirops.shutdown(wait=False)

    def close(self) -> None:
        """Synchronous close (outside an event loop)."""
        self._dirops.shutdown(wait=True)
        self._close()
