"""Positional file I/O that finishes what it starts, the checks of a file fd a client attached, and the
manifest read from one.

Nothing here opens a name: the daemon acts only on fds its client opened
(vramd.imagedir is the client's side).
"""
from __future__ import annotations

import asyncio
import errno
import fcntl
import os
import stat
from collections.abc import Sequence

from ..errors import (
    BadDescriptorError,
    CorruptManifestError,
    ImageError,
    ImageIoError,
    NoSpaceError,
    NotWritableError,
    ReadOnlyFsError,
    TruncatedDataError,
    VramdError,
    from_os_error,
)
from ..pb import image_pb2 as pb
from .format import Bytes, content_hash
from .manifest import MAX_MANIFEST_BYTES, decode_manifest
from .names import MANIFEST_NAME

FILE_MODE = 0o600  # images hold process memory

# Every open of a file inside an image directory (the client's: vramd.imagedir, and
# libvramd's files.c alike): never through a symlink, never blocking (a FIFO or a
# device opens at once, and is then refused as not regular).
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


def check_attached(fd: int, name: str, *, write: bool) -> int:
    """A file fd a client attached: a regular file open for reading (`write`: for reading and writing);
    returns its size.  Otherwise BAD_DESCRIPTOR naming the file.  Never opens anything."""
    try:
        st = os.fstat(fd)
        mode = fcntl.fcntl(fd, fcntl.F_GETFL)
    except OSError as e:
        raise from_os_error(e, f"the fd given for {name} is unusable", BadDescriptorError) from None
    if not stat.S_ISREG(st.st_mode):
        raise BadDescriptorError(f"the fd given for {name} is not a regular file")
    if mode & os.O_PATH:
        raise BadDescriptorError(f"the fd given for {name} is an O_PATH fd")
    acc = mode & os.O_ACCMODE
    if write and acc != os.O_RDWR:
        raise BadDescriptorError(f"the fd given for {name} is not open for reading and writing (O_RDWR)")
    if not write and acc not in (os.O_RDONLY, os.O_RDWR):
        raise BadDescriptorError(f"the fd given for {name} is not open for reading")
    return st.st_size


def check_direct(direct_fd: int, fd: int, name: str, *, write: bool = False) -> None:
    """`direct_fd` must be the file `fd` has open (same device and inode, a regular file), opened with
    O_DIRECT, and open for writing (`write`: a dump's data file) or reading; else BAD_DESCRIPTOR naming the file."""
    try:
        st, want = os.fstat(direct_fd), os.fstat(fd)
        mode = fcntl.fcntl(direct_fd, fcntl.F_GETFL)
    except OSError as e:
        raise from_os_error(e, f"the O_DIRECT fd given for {name} is unusable", BadDescriptorError) from None
    if (st.st_dev, st.st_ino) != (want.st_dev, want.st_ino) or not stat.S_ISREG(st.st_mode):
        raise BadDescriptorError(f"the O_DIRECT fd given for {name} is another file")
    if not mode & os.O_DIRECT:
        raise BadDescriptorError(f"the O_DIRECT fd given for {name} was not opened with O_DIRECT")
    acc = mode & os.O_ACCMODE
    if acc not in ((os.O_WRONLY, os.O_RDWR) if write else (os.O_RDONLY, os.O_RDWR)):
        raise BadDescriptorError(f"the O_DIRECT fd given for {name} is not open for "
                                 f"{'writing' if write else 'reading'}")


def pwrite_all(fd: int, iov: Sequence[Bytes], offset: int) -> int:
    """pwritev until every byte of iov is written (short writes continue); returns the bytes written."""
    views = [memoryview(b).cast("B") for b in iov]
    start = offset
    while views:
        n = os.pwritev(fd, views, offset)
        offset += n
        while views and n >= len(views[0]):
            n -= len(views.pop(0))
        if views and n:
            views[0] = views[0][n:]
    return offset - start


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


def pread_exact(fd: int, n: int, offset: int, what: str, *, bo_id: int | None = None,
                bo_offset: int | None = None) -> bytes:
    """Exactly `n` bytes of the file `fd` at `offset` (short reads continue): the one read of an image file
    whose every failure is typed.  A file that ends first is TRUNCATED_DATA; an OSError is its kind
    (image_os_error: EIO is IO_ERROR); each names `what` (the file) and `offset`, and the BO and the offset in
    it (`bo_id`, `bo_offset`) where the caller knows them."""
    try:
        data = os.pread(fd, n, offset)  # one read, no copy, in the usual case
        while len(data) < n:
            more = os.pread(fd, n - len(data), offset + len(data))
            if not more:
                raise TruncatedDataError(f"{what}: {n} bytes expected at {offset:#x}, the file ends at "
                                         f"{offset + len(data):#x}", bo_id=bo_id, offset=bo_offset)
            data += more
    except OSError as e:
        raise image_os_error(e, f"cannot read {what} at {offset:#x} ({n} bytes)", bo_id=bo_id,
                             offset=bo_offset) from None
    return data


def read_manifest_blob(fd: int, what: str = MANIFEST_NAME) -> bytes:
    """The whole manifest file `fd` (read with pread from offset 0: its file position is not ours); `what`
    names it in errors (the daemon knows only the name, a client its path)."""
    try:
        size = os.fstat(fd).st_size
        if size > MAX_MANIFEST_BYTES:
            raise CorruptManifestError(f"{what} is {size} bytes; at most {MAX_MANIFEST_BYTES} are read")
        buf = bytearray(size)
        got = pread_into(fd, memoryview(buf), 0)
        return bytes(buf[:got])
    except OSError as e:
        raise image_os_error(e, f"cannot read {what}") from None


def read_manifest_now(fd: int) -> pb.Manifest:
    """The manifest in the file `fd`, decoded and checked, in the calling thread (never the event loop)."""
    return decode_manifest(read_manifest_blob(fd))


async def read_manifest_hashed(fd: int) -> tuple[pb.Manifest, bytes]:
    """The manifest in the file `fd` (a manifest.vrdm the client opened), decoded and checked in a thread, and
    the BLAKE3-256 of the whole file (how a child names its parent)."""
    # read, decoded and checked in a thread: the checks grow with the image (never on the event loop)
    return await asyncio.get_running_loop().run_in_executor(None, _read_and_decode, fd)


def _read_and_decode(fd: int) -> tuple[pb.Manifest, bytes]:
    check_attached(fd, MANIFEST_NAME, write=False)
    blob = read_manifest_blob(fd)
    return decode_manifest(blob), content_hash(blob)
