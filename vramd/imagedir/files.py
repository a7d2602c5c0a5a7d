"""Opening an image's files by name, with the caller's rights: the manifests, then the data files the daemon names.

The daemon never touches a name (docs/protocol.md, "Image files: the client's
rights"): whoever runs this package (vramctl, vramd.client, vramd.inproc,
flatten) opens and creates an image's files with its own rights and hands the
fds on, so the kernel checks the client's access and a non-root client owns
the files of its images.  libvramd does the same in C.

- `ImageFiles`: an image to read (restore, verify) or a dump's parent chain:
  the manifests opened, then the data files the daemon names (`open_needed`);
  `read_image` hands them to an ImageReader in this process.

Every open is O_NOFOLLOW|O_NONBLOCK|O_CLOEXEC of a plain name inside a
directory fd; files must be regular.  A refused open is one typed error
naming the file (and the directory the caller called it, `where`) and the uid
whose rights were missing.
"""
from __future__ import annotations

import asyncio
import errno
import logging
import os
import stat
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from ..errors import (
    CorruptManifestError,
    ForeignDataFileError,
    InvalidRequestError,
    ManifestMissingError,
    NotWritableError,
    ParentMismatchError,
    PermissionDeniedError,
    TruncatedDataError,
    VramdError,
)
from ..image.fileio import OPEN_FLAGS, image_os_error
from ..image.names import DATA_FILE_NAME, MANIFEST_NAME
from ..image.reader import ImageReader

log = logging.getLogger(__name__)

CREATE_FLAGS = os.O_RDWR | os.O_CREAT | os.O_EXCL | OPEN_FLAGS


@dataclass
class OpenedFile:
    """A file of an image opened by the client: what AttachFiles hands over (the fds are the opener's)."""

    image: int                 # 0: the image itself; k: its k-th parent
    name: str                  # its name in that image's directory (a dump's data file: without ".tmp")
    fd: int
    direct_fd: int | None = None  # the same file opened again with O_DIRECT (None where refused)
    gpu_id: int | None = None     # a dump's own data file
    stripe: int = 0               # a dump's own data file: which of its GPU's

    def close(self) -> None:
        for fd in (self.fd, self.direct_fd):
            if fd is not None:
                os.close(fd)


def who() -> str:
    """Whose rights an open used (errors name it)."""
    return f"uid {os.geteuid()}"


def refused(e: OSError, name: str, where: str, *, write: bool,
             not_regular: type[VramdError] = ForeignDataFileError) -> VramdError:
    """A refused open/create of `name` in `where` as its typed error: whose rights were missing."""
    if e.errno in (errno.EACCES, errno.EPERM):
        if write:
            return NotWritableError(f"cannot create {name} in {where}: {who()} may not write that directory "
                                    f"({e.strerror})")
        return PermissionDeniedError(f"cannot read {name} in {where}: {who()} may not read it ({e.strerror})")
    if e.errno == errno.ELOOP:
        return not_regular(f"{name} in {where} is a symbolic link, not a regular file")
    verb = "create" if write else "open"
    return image_os_error(e, f"cannot {verb} {name} in {where}")


def open_regular(dir_fd: int, name: str, where: str, *, flags: int = os.O_RDONLY,
                 not_regular: type[VramdError] = ForeignDataFileError) -> int:
    """`name` in the directory `dir_fd` opened (O_NOFOLLOW|O_NONBLOCK): a regular file, else `not_regular`
    naming it.  FileNotFoundError is raised as is (the caller knows what a missing file means)."""
    try:
        fd = os.open(name, flags | OPEN_FLAGS, dir_fd=dir_fd)
    except FileNotFoundError:
        raise
    except OSError as e:
        raise refused(e, name, where, write=False, not_regular=not_regular) from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise not_regular(f"{name} in {where} is not a regular file")
    except BaseException:
        os.close(fd)
        raise
    return fd


def reopen_direct(dir_fd: int, name: str, fd: int, flags: int) -> int | None:
    """`name` opened once more with O_DIRECT (page-aligned I/O past the page cache), by the same rules; it
    must be the very file `fd` has open, else None.  None too where the file system refuses O_DIRECT (tmpfs:
    EINVAL) or the open fails otherwise: the file is then used through `fd` alone."""
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


def open_manifest(dir_fd: int, where: str) -> int:
    """The committed manifest of the image in `dir_fd`; MANIFEST_MISSING naming `where` if there is none."""
    try:
        return open_regular(dir_fd, MANIFEST_NAME, where, not_regular=CorruptManifestError)
    except FileNotFoundError:
        raise ManifestMissingError(f"no committed image in {where}: {MANIFEST_NAME} is missing (an interrupted "
                                   "dump never commits one)") from None


def open_data(dir_fd: int, image: int, name: str, where: str) -> OpenedFile:
    """A data file the daemon named, for reading, and its O_DIRECT twin where allowed."""
    if not DATA_FILE_NAME.fullmatch(name):  # never open a name the format does not make
        raise InvalidRequestError(f"the daemon asked for {name!r}, which is not a data file name")
    try:
        fd = open_regular(dir_fd, name, where)
    except FileNotFoundError:
        raise TruncatedDataError(f"data file {name} listed in the manifest is missing from {where}") from None
    return OpenedFile(image, name, fd, reopen_direct(dir_fd, name, fd, os.O_RDONLY))


class ImageFiles:
    """A committed image (and its parent chain) opened for reading by the client.

    `dir_fd` None: only a parent chain (an incremental dump's).  `parent_dirs`:
    the parents' directories, nearest first.  The manifests are opened here;
    `open_needed` opens the data files the daemon's `files_needed` names.  The
    directory fds stay the caller's; every fd opened here is closed by `close`.
    """

    def __init__(self, dir_fd: int | None, parent_dirs: Sequence[int] = (), *, where: str = "the image directory",
                 parent_where: Sequence[str] = ()) -> None:
        self.dirs: list[int | None] = [dir_fd, *parent_dirs]
        self.where = [where, *(parent_where[k] if k < len(parent_where) else f"parent directory #{k + 1}"
                               for k in range(len(parent_dirs)))]
        self.manifest_fd: int | None = None
        self.parent_manifest_fds: list[int] = []
        self.files: list[OpenedFile] = []
        try:
            if dir_fd is not None:
                self.manifest_fd = open_manifest(dir_fd, where)
            for k, d in enumerate(parent_dirs, 1):
                try:
                    self.parent_manifest_fds.append(open_manifest(d, self.where[k]))
                except ManifestMissingError:
                    raise ParentMismatchError(f"the directory given as parent #{k} ({self.where[k]}) holds no "
                                              "committed image") from None
        except BaseException:
            self.close()
            raise

    def open_needed(self, needed: Iterable[tuple[int, str]]) -> list[OpenedFile]:
        """Open each (image, name) the daemon needs (image 0: the image; k: parent k); they are kept for
        `close`.  Returns the newly opened files."""
        out: list[OpenedFile] = []
        for image, name in needed:
            d = self.dirs[image] if 0 <= image < len(self.dirs) else None
            if d is None:
                raise InvalidRequestError(f"the daemon asked for {name!r} of image #{image}, which was not given")
            f = open_data(d, image, name, self.where[image])
            self.files.append(f)
            out.append(f)
        return out

    def close(self) -> None:
        for f in self.files:
            f.close()
        self.files = []
        for fd in [self.manifest_fd, *self.parent_manifest_fds]:
            if fd is not None:
                os.close(fd)
        self.manifest_fd, self.parent_manifest_fds = None, []

    def __enter__(self) -> ImageFiles:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


async def read_image(files: ImageFiles) -> ImageReader:
    """The image `files` opened, read as the daemon reads it: its manifests checked
    (`ImageReader.from_manifests`), then each data file it needs opened here and attached.  The reader takes
    fds only: `files` keeps them, and the caller closes it once the reader (or the job owning it) is done."""
    if files.manifest_fd is None:
        raise InvalidRequestError("no image to read: ImageFiles was given no image directory")
    reader = await ImageReader.from_manifests(files.manifest_fd, files.parent_manifest_fds)
    try:
        opened = await asyncio.get_running_loop().run_in_executor(None, files.open_needed, reader.needed())
        for f in opened:
            await reader.attach(f.image, f.name, f.fd, f.direct_fd)
    except BaseException:
        reader.close()
        raise
    return reader
