"""The client's side of an image directory: every open, creation, rename and removal of a name.

The daemon never touches a name (docs/protocol.md, "Image files: the client's
rights"): whoever runs this code (vramctl, vramd.client, in-process users such
as flatten and the engine's conveniences) opens and creates an image's files
with its own rights and hands the fds on, so the kernel checks the client's
access and a non-root client owns the files of its images.  libvramd does the
same in C.

- `ImageFiles`: an image to read (restore, verify) or a dump's parent chain:
  the manifests opened, then the data files the daemon names (`open_needed`).
- `DumpDirectory`: a dump's directory: locked, checked for children marks,
  swept of a crashed dump's temporaries; the data files and the manifest's
  temporary created; the commit (renames, parent marks, fsync, removal of the
  replaced image's files); everything undone if the dump does not commit.

Every open is O_NOFOLLOW|O_NONBLOCK|O_CLOEXEC of a plain name inside a
directory fd; files must be regular.  A refused open is one typed error
naming the file (and the directory the caller called it, `where`) and the uid
whose rights were missing.
"""
from __future__ import annotations

import errno
import fcntl
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
    ProtocolError,
    TruncatedDataError,
    VramdError,
    from_os_error,
)
from .fileio import FILE_MODE, OPEN_FLAGS, image_os_error
from .format import (
    CHILD_MARK,
    DATA_FILE_NAME,
    MANIFEST_NAME,
    MAX_STRIPES,
    child_mark_name,
    data_file_name,
    is_own_temporary,
    manifest_tmp_name,
)

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


def _who() -> str:
    return f"uid {os.geteuid()}"


def _refused(e: OSError, name: str, where: str, *, write: bool,
             not_regular: type[VramdError] = ForeignDataFileError) -> VramdError:
    """A refused open/create of `name` in `where` as its typed error: whose rights were missing."""
    if e.errno in (errno.EACCES, errno.EPERM):
        if write:
            return NotWritableError(f"cannot create {name} in {where}: {_who()} may not write that directory "
                                    f"({e.strerror})")
        return PermissionDeniedError(f"cannot read {name} in {where}: {_who()} may not read it ({e.strerror})")
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
        raise _refused(e, name, where, write=False, not_regular=not_regular) from None
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


def lock_directory(dir_fd: int, where: str = "the image directory", *, shared: bool = False) -> int:
    """A description of the directory of our own, flocked (one dump, or gc, or rm, at a time): the caller
    closes it to unlock.  Another holder is INVALID_REQUEST.  `shared`: the lock children take to mark the
    directory as their parent's: they never exclude each other (sibling dumps commit at once), only a dump
    writing into the directory, or gc, or rm, excludes them, and they it."""
    try:
        lock_fd = os.open(".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=dir_fd)
    except OSError as e:
        raise from_os_error(e, f"{where} cannot be opened", InvalidRequestError) from None
    try:
        fcntl.flock(lock_fd, (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | fcntl.LOCK_NB)
    except OSError as e:
        os.close(lock_fd)
        if e.errno == errno.EWOULDBLOCK:
            also = "" if shared else " (or an incremental dump reads its image as its parent)"
            raise InvalidRequestError(f"another dump is writing into {where}{also}") from None
        raise from_os_error(e, f"cannot lock {where}", InvalidRequestError) from None
    return lock_fd


def unlink_regular(dir_fd: int, name: str) -> bool:
    """Remove `name` from the directory `dir_fd` if it is a regular file (lstat, then unlinkat of the name:
    never a symlink, a FIFO or a directory that bears a name like vramd's); False where it is something
    else.  An OSError comes as it is."""
    if not stat.S_ISREG(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode):
        return False
    os.unlink(name, dir_fd=dir_fd)
    return True


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
            if unlink_regular(dir_fd, name):
                removed.append(name)
        except OSError as e:
            log.warning("stale temporary %s not removed: %s", name, e.strerror)
    if removed:
        log.info("removed %d temporaries of an interrupted dump: %s", len(removed), ", ".join(removed))
    return removed


def children_marks(dir_fd: int) -> list[str]:
    """The `.child.<id>` marks in a directory: incremental images that need its image."""
    try:
        return sorted(n for n in os.listdir(dir_fd) if CHILD_MARK.fullmatch(n))
    except OSError:
        return []


class DumpDirectory:
    """A dump's directory, on the client's side: locked from here to `close`, and each of its parent
    chain's directories (`parent_dirs`, nearest first) locked shared, so that none is replaced or removed
    while this child reads it and until its mark is there.

    Refuses a directory whose image incremental images need (their `.child.<id>`
    marks) unless `replace_parent`, and one of the dump's own parent chain;
    removes a crashed dump's temporaries.  Once
    the daemon has named the image (`begin`), creates each GPU's data file and
    the manifest's temporary (mode 0600, the client's); `commit` puts them in
    place after the daemon has written and fsynced them.  Without a commit,
    `close` removes everything this dump created.
    """

    def __init__(self, dir_fd: int, parent_dirs: Sequence[int] = (), *, replace_parent: bool = False,
                 where: str = "the image directory") -> None:
        self.dir_fd = dir_fd
        self.where = where
        self.parent_dirs = list(parent_dirs)
        self._lock_fd = lock_directory(dir_fd, where)
        self.image_id = b""
        self.stripes = 1  # data files per GPU (begin)
        self.data: dict[tuple[int, int], OpenedFile] = {}  # (gpu_id, stripe) -> a data file (created as name + ".tmp")
        self.manifest_fd: int | None = None
        self._created: list[str] = []           # names this dump made that go unless it commits
        self._marked: list[int] = []            # parent directories marked (unmarked unless it commits)
        self._parent_locks: list[int] = []      # each parent directory's lock, shared, held to the end
        self.committed = False
        try:
            marks = [] if replace_parent else children_marks(self._lock_fd)
            if marks:
                raise InvalidRequestError(
                    f"the image in {where} is the parent of {len(marks)} incremental image(s) (marked "
                    f"{marks[0]}...); replacing it would break them: flatten or remove them first "
                    "(vramctl flatten, vramctl rm), or replace it anyway (replace_parent)")
            here = os.fstat(dir_fd)
            for fd in self.parent_dirs:
                st = os.fstat(fd)
                if (st.st_dev, st.st_ino) == (here.st_dev, here.st_ino):
                    raise InvalidRequestError(f"{where} is a directory of the parent chain: an incremental image "
                                              "goes into a directory of its own")
            # Each parent directory's lock, shared, from before the parents are read to the end: a dump replacing
            # a parent (or an rm of it) takes that lock exclusively, so it cannot run between this child's
            # reading of the parent and its mark there (it would see no mark, and the child would commit
            # against an image that is gone); children of one parent do not exclude each other.
            for k, fd in enumerate(self.parent_dirs, 1):
                self._parent_locks.append(lock_directory(fd, f"parent directory #{k}", shared=True))
            sweep_temporaries(self._lock_fd)
        except BaseException:
            self.close()
            raise

    def begin(self, image_id: bytes, stripes: int = 1) -> None:
        """The image id the daemon chose: it names the files; `stripes`: the data files per GPU it asked for
        (SessionInfo.data_files_per_gpu; 0, from a daemon that predates it: 1)."""
        if len(image_id) != 16:
            raise InvalidRequestError(f"the daemon named the image with {len(image_id)} bytes, not 16")
        if stripes > MAX_STRIPES:
            raise ProtocolError(f"the daemon asked for {stripes} data files per GPU; the format allows "
                                f"{MAX_STRIPES}")
        self.image_id = image_id
        self.stripes = max(1, stripes)

    def gpus(self) -> set[int]:
        """The GPUs whose data files are created."""
        return {gpu for gpu, _ in self.data}

    def _create(self, name: str) -> int:
        try:
            fd = os.open(name, CREATE_FLAGS, FILE_MODE, dir_fd=self.dir_fd)
        except OSError as e:
            raise _refused(e, name, self.where, write=True) from None
        self._created.append(name)
        return fd

    def data_file(self, gpu_id: int, stripe: int = 0) -> OpenedFile:
        """Data file `stripe` of the GPU, created on first use (as its name + ".tmp") with its O_DIRECT twin."""
        f = self.data.get((gpu_id, stripe))
        if f is None:
            assert self.image_id, "begin() first"
            name = data_file_name(self.image_id, gpu_id, stripe)
            fd = self._create(name + ".tmp")
            direct = reopen_direct(self.dir_fd, name + ".tmp", fd, os.O_WRONLY)
            f = self.data[(gpu_id, stripe)] = OpenedFile(0, name, fd, direct, gpu_id, stripe)
        return f

    def drop(self, files: Iterable[OpenedFile]) -> None:
        """Remove data files this dump created (their AttachFiles was refused: the daemon attached none of
        them), so that the GPU's files are made and attached again by the next try."""
        for f in files:
            if self.data.pop((f.gpu_id or 0, f.stripe), None) is None:
                continue
            f.close()
            tmp = f.name + ".tmp"
            self._created.remove(tmp)
            try:
                os.unlink(tmp, dir_fd=self.dir_fd)
            except OSError as e:
                log.warning("%s not removed from %s: %s", tmp, self.where, e.strerror)

    def file_source(self, gpu_id: int, stripe: int = 0) -> tuple[int, int | None]:
        """`data_file`'s fds: an in-process ImageWriter's source of files (writer.LocalFiles)."""
        f = self.data_file(gpu_id, stripe)
        return f.fd, f.direct_fd

    def manifest_file(self) -> int:
        """The manifest's temporary file (created once)."""
        if self.manifest_fd is None:
            assert self.image_id, "begin() first"
            self.manifest_fd = self._create(manifest_tmp_name(self.image_id))
        return self.manifest_fd

    def commit(self) -> None:
        """After the daemon wrote and fsynced every file: data files into place, this child marked in its
        parents' directories, the manifest renamed into place (the commit), the directory fsynced, the
        replaced image's data files removed."""
        assert self.manifest_fd is not None, "manifest_file() first"
        d = self.dir_fd
        for f in self.data.values():
            try:
                os.rename(f.name + ".tmp", f.name, src_dir_fd=d, dst_dir_fd=d)
            except OSError as e:
                raise image_os_error(e, f"cannot rename {f.name}.tmp to {f.name} in {self.where}") from None
            self._created.append(f.name)
        self._mark_parents()
        tmp = manifest_tmp_name(self.image_id)
        try:
            os.rename(tmp, MANIFEST_NAME, src_dir_fd=d, dst_dir_fd=d)
        except OSError as e:
            raise image_os_error(e, f"cannot rename {tmp} to {MANIFEST_NAME} in {self.where}") from None
        self.committed = True  # from here on the image is the new one
        self._created.clear()
        try:
            os.fsync(self._lock_fd)
        except OSError as e:
            raise image_os_error(e, f"cannot fsync {self.where}") from None
        self._remove_replaced()

    def _remove_replaced(self) -> None:
        """The data files of the image this one replaced: vramd's data file names of another image id."""
        mine = data_file_name(self.image_id, 0)[:len("data-") + 16]  # "data-<this image's id>"
        try:
            names = os.listdir(self._lock_fd)
        except OSError:
            return
        for name in names:
            if not DATA_FILE_NAME.fullmatch(name) or name.startswith(mine):
                continue
            try:
                unlink_regular(self.dir_fd, name)
            except OSError as e:
                log.warning("data file %s of the replaced image not removed: %s", name, e.strerror)

    def _mark_parents(self) -> None:
        """Before the commit: this child's mark in each directory of its parent chain the client may write
        (one it may not write, or on a read-only file system, is left unmarked: that parent is not protected),
        each fsynced, under that directory's lock."""
        name = child_mark_name(self.image_id)
        me = os.geteuid()
        for k, fd in enumerate(self.parent_dirs, 1):
            if me != 0 and os.fstat(fd).st_uid != me:  # a mark must never let one user block another's image
                log.info("parent directory #%d not marked: %s does not own it", k, _who())
                continue
            # under the parent directory's lock, held since this dump began (__init__): every later dump of
            # that directory sees the mark, and no earlier one replaced the image this child read
            try:
                try:
                    mark = os.open(name, CREATE_FLAGS, FILE_MODE, dir_fd=fd)
                except OSError as e:
                    if e.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
                        log.info("parent directory #%d not marked: %s may not write it", k, _who())
                        continue
                    raise
                os.close(mark)
                self._marked.append(fd)
                os.fsync(fd)
            except OSError as e:
                raise image_os_error(e, f"cannot mark this incremental image ({name}) in parent directory #{k}") \
                    from None

    def close(self) -> None:
        """Close the files; without a commit, remove everything this dump created; unlock."""
        for f in self.data.values():
            f.close()
        self.data.clear()
        if self.manifest_fd is not None:
            os.close(self.manifest_fd)
            self.manifest_fd = None
        if not self.committed:
            for name in self._created:
                try:
                    os.unlink(name, dir_fd=self.dir_fd)
                except OSError:
                    pass
            for fd in self._marked:
                try:
                    os.unlink(child_mark_name(self.image_id), dir_fd=fd)
                except OSError:
                    pass
        self._created.clear()
        self._marked.clear()
        for lock in self._parent_locks:
            os.close(lock)
        self._parent_locks.clear()
        if self._lock_fd >= 0:
            os.close(self._lock_fd)  # drops the lock
            self._lock_fd = -1

    def __enter__(self) -> DumpDirectory:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
