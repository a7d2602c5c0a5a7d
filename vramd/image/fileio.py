"""Positional file I/O that finishes what it starts, and the manifest read.

Everything goes through the directory fd a caller passed (openat-style
`dir_fd=`), never through a path of the caller's, so the engine only
touches the directory it was handed.
"""
from __future__ import annotations

import asyncio
import errno
import os
import stat
from collections.abc import Sequence

from ..errors import (
    CorruptManifestError,
    ImageError,
    ImageIoError,
    ManifestMissingError,
    NoSpaceError,
    NotWritableError,
    ReadOnlyFsError,
    VramdError,
    from_os_error,
)
from ..pb import image_pb2 as pb
from .format import MANIFEST_NAME, MAX_MANIFEST_BYTES, Bytes, content_hash, decode_manifest

FILE_MODE = 0o600  # images hold process memory

# Every open of a file inside an image directory: never through a symlink, never
# blocking (a FIFO or a device opens at once, and is then refused as not regular).
OPEN_FLAGS = os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC

_ERRNO_CLASS: dict[int, type[VramdError]] = {
    errno.ENOSPC: NoSpaceError, errno.EDQUOT: NoSpaceError,
    errno.EROFS: ReadOnlyFsError,
    errno.EIO: ImageIoError,
    errno.EACCES: NotWritableError, errno.EPERM: NotWritableError,
}


def image_os_error(e: OSError, what: str, *, bo_id: int | None = None, offset: int | None = None,
                   default: type[VramdError] = ImageError) -> VramdError:
    """An OSError of image file I/O as its typed error: NO_SPACE, READ_ONLY_FS, IO_ERROR,
    NOT_WRITABLE, else `default`; `what` names the file (and the operation)."""
    cls = _ERRNO_CLASS.get(e.errno or 0, default)
    return from_os_error(e, what, cls, bo_id=bo_id, offset=offset)


def open_regular(name: str, dir_fd: int, not_regular: type[VramdError]) -> int:
    """Open an existing file of an image directory for reading: O_NOFOLLOW, O_NONBLOCK, regular files only.

    Raises FileNotFoundError as is (the caller knows what a missing file means), and
    `not_regular` naming the file for a symlink, a FIFO, a device, a directory...
    Call it in a thread, never on the event loop.
    """
    try:
        fd = os.open(name, os.O_RDONLY | OPEN_FLAGS, dir_fd=dir_fd)
    except FileNotFoundError:
        raise
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise not_regular(f"{name} is a symbolic link, not a regular file") from None
        raise image_os_error(e, f"cannot open {name}", default=not_regular) from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise not_regular(f"{name} is not a regular file")
    except BaseException:
        os.close(fd)
        raise
    return fd


def reopen_direct(name: str, dir_fd: int, fd: int, flags: int) -> int | None:
    """`name` in the image directory opened once more with O_DIRECT (for page-aligned I/O), by the same
    rules as every image file (O_NOFOLLOW|O_NONBLOCK, no O_CREAT); it must be the very file `fd` has open
    (same device and inode, regular), else None.  None too where the file system refuses O_DIRECT (tmpfs:
    EINVAL) or the open fails otherwise: the caller keeps using `fd`.  Call it in a thread, never on the
    event loop.
    """
    try:
        dfd = os.open(name, flags | os.O_DIRECT | OPEN_FLAGS, dir_fd=dir_fd)
    except OSError:
        return None
    try:
        st, want = os.fstat(dfd), os.fstat(fd)
        if stat.S_ISREG(st.st_mode) and (st.st_dev, st.st_ino) == (want.st_dev, want.st_ino):
            return dfd
    except OSError:
        pass
    os.close(dfd)
    return None


def pwrite_all(fd: int, iov: Sequence[Bytes], offset: int) -> None:
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
    return preadv_all(fd, [view], offset)


def preadv_all(fd: int, views: Sequence[memoryview], offset: int) -> int:
    """preadv until every view is full or end of file; returns bytes read."""
    todo = [v for v in views if len(v)]
    total = 0
    while todo:
        n = os.preadv(fd, todo, offset)
        if n == 0:
            break
        offset += n
        total += n
        while todo and n >= len(todo[0]):
            n -= len(todo.pop(0))
        if todo and n:
            todo[0] = todo[0][n:]
    return total


def _read_manifest_blob(dir_fd: int) -> bytes:
    fd = open_regular(MANIFEST_NAME, dir_fd, CorruptManifestError)
    try:
        size = os.fstat(fd).st_size
        if size > MAX_MANIFEST_BYTES:
            raise CorruptManifestError(f"{MANIFEST_NAME} is {size} bytes; at most {MAX_MANIFEST_BYTES} are read")
        with os.fdopen(fd, "rb", closefd=False) as f:
            return f.read(MAX_MANIFEST_BYTES + 1)
    except OSError as e:
        raise image_os_error(e, f"cannot read {MANIFEST_NAME}") from None
    finally:
        os.close(fd)


def read_manifest_now(dir_fd: int) -> pb.Manifest:
    """`read_manifest` in the calling thread (never the event loop); a missing manifest raises
    FileNotFoundError."""
    return decode_manifest(_read_manifest_blob(dir_fd))


async def read_manifest(dir_fd: int) -> pb.Manifest:
    """The committed manifest of the image in `dir_fd`, decoded and checked (the read in a thread)."""
    return (await read_manifest_hashed(dir_fd))[0]


async def read_manifest_hashed(dir_fd: int) -> tuple[pb.Manifest, bytes]:
    """`read_manifest`, and the BLAKE3-256 of the whole manifest file (how a child names its parent)."""
    try:
        # read, decoded and checked in a thread: the checks grow with the image (never on the event loop)
        return await asyncio.get_running_loop().run_in_executor(None, _read_and_decode, dir_fd)
    except FileNotFoundError:
        raise ManifestMissingError(
            f"no committed image here: {MANIFEST_NAME} is missing (an interrupted dump never commits one)"
        ) from None


def _read_and_decode(dir_fd: int) -> tuple[pb.Manifest, bytes]:
    blob = _read_manifest_blob(dir_fd)
    return decode_manifest(blob), content_hash(blob)
