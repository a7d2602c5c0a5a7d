"""The client's side of an image directory: every open, creation, rename and removal of a name.

The daemon never touches a name (docs/protocol.md, "Image files: the client's
rights"): whoever runs this code (vramctl, vramd.client, in-process users such
as flatten and the engine's conveniences) opens and creates an image's files
with its own rights and hands the fds on, so the kernel checks the client's
access and a non-root client owns the files of its images.  libvramd does the
same in C.

- `ImageFiles`: an image to read (restore, verify) or a dump's parent chain:
  the manifests opened, then the data files the daemon names (`open_needed`).
- `lock_directory`: the directory's lock, a file `.lock` only those who may write the image can open
  (one dump, rm or gc at a time; children hold their parents' shared).
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
import time
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
from .fileio import FILE_MODE, OPEN_FLAGS, image_os_error, read_manifest_now
from .format import MAX_STRIPES
from .names import (
    CHILD_MARK,
    DATA_FILE_NAME,
    LOCK_NAME,
    MANIFEST_NAME,
    MAX_CHILD_MARK_BYTES,
    child_mark_content,
    child_mark_name,
    data_file_name,
    is_own_temporary,
    manifest_tmp_name,
    parse_child_mark,
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


class DirectoryLock:
    """An image directory's lock, held: its `.lock` file open and flocked.  `release` unlocks, and removes the
    name where no other holder is left, so the file exists only while someone holds it (or after a crash)."""

    def __init__(self, dir_fd: int, fd: int, shared: bool) -> None:
        self.dir_fd = dir_fd  # our own duplicate of the directory's fd
        self.fd = fd
        self.shared = shared

    def release(self) -> None:
        if self.fd < 0:
            return
        try:
            # the name is ours to remove where nobody else holds the lock: an exclusive holder knows it; a
            # shared one takes it exclusively at once, which succeeds only then (the conversion may drop its
            # own lock first: it is releasing anyway).  A process that opened this file meanwhile sees, once it
            # holds it or fails to, that the name has gone, and takes the new one.  The name is checked first,
            # while we hold the lock (nobody removes it meanwhile), so that a shared holder's exclusive lock,
            # which refuses a sibling's shared one, is held for one unlink only (take_lock waits that out).
            if _same_file(os.fstat(self.fd), self.dir_fd, LOCK_NAME):
                if self.shared:
                    fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                os.unlink(LOCK_NAME, dir_fd=self.dir_fd)
        except OSError:
            pass
        os.close(self.fd)
        os.close(self.dir_fd)
        self.fd = self.dir_fd = -1


def _same_file(st: os.stat_result, dir_fd: int, name: str | bytes, *, follow: bool = False) -> bool:
    """Whether `name` in `dir_fd` is the file `st` describes (False where it is missing)."""
    try:
        now = os.stat(name, dir_fd=dir_fd, follow_symlinks=follow)
    except OSError:
        return False
    return (now.st_dev, now.st_ino) == (st.st_dev, st.st_ino)


def _lock_refused(where: str, why: str) -> InvalidRequestError:
    return InvalidRequestError(f"cannot lock {where}: its {LOCK_NAME} {why}; refused (remove it if no dump, rm or "
                               "gc runs there)")


GONE = -1  # _open_lock_file: `.lock` was removed under it


def _open_lock_file(dir_fd: int, where: str, owner: os.stat_result, optional: bool) -> int | None:
    """`.lock` in the directory, opened read-write (created 0600 if missing; created by root: given to the
    directory's owner, who may then take it too) and checked: a regular file, one link, of the directory's
    owner or of this uid, nobody else's to open.  None where `optional` and this uid may not create it; GONE
    where it went between the create and the open."""
    me = os.geteuid()
    flags = os.O_RDWR | OPEN_FLAGS
    try:
        fd = os.open(LOCK_NAME, flags | os.O_CREAT | os.O_EXCL, FILE_MODE, dir_fd=dir_fd)
        created = True
    except FileExistsError:
        created = False
        try:
            fd = os.open(LOCK_NAME, flags, dir_fd=dir_fd)
        except FileNotFoundError:
            return GONE  # its holder removed it just now: take_lock looks again
        except OSError as e:
            if optional and e.errno == errno.EROFS:
                return None
            if e.errno == errno.ELOOP:
                raise _lock_refused(where, "is a symbolic link") from None
            if e.errno in (errno.EACCES, errno.EPERM):
                try:
                    uid = os.stat(LOCK_NAME, dir_fd=dir_fd, follow_symlinks=False).st_uid
                except OSError:
                    uid = -1
                raise _lock_refused(where, f"is uid {uid}'s, and {_who()} may not open it") from None
            raise from_os_error(e, f"cannot lock {where}: cannot open its {LOCK_NAME}", InvalidRequestError) \
                from None
    except OSError as e:
        if optional and e.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
            return None
        if e.errno in (errno.EACCES, errno.EPERM):
            raise NotWritableError(f"cannot lock {where}: {_who()} may not create {LOCK_NAME} there "
                                   f"({e.strerror})") from None
        raise image_os_error(e, f"cannot lock {where}: cannot create its {LOCK_NAME}") from None
    try:
        if created:
            os.fchmod(fd, FILE_MODE)  # whatever the umask: its owner may open it read-write again
            if me == 0 and owner.st_uid != 0:
                os.fchown(fd, owner.st_uid, owner.st_gid)
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise _lock_refused(where, "is not a regular file")
        if st.st_nlink > 1:  # 0: its last holder removed it just now (take_lock starts again)
            raise _lock_refused(where, f"has {st.st_nlink} links")
        if st.st_uid not in (owner.st_uid, me):
            raise _lock_refused(where, f"is uid {st.st_uid}'s, neither the directory's owner's (uid "
                                       f"{owner.st_uid}) nor {_who()}'s")
        if st.st_mode & 0o077:
            raise _lock_refused(where, f"has mode {stat.S_IMODE(st.st_mode):04o}: others may open it")
    except BaseException:
        os.close(fd)
        if created:
            try:
                os.unlink(LOCK_NAME, dir_fd=dir_fd)
            except OSError:
                pass
        raise
    return fd


# How often a shared taker looks again at a lock held exclusively under an unchanged name: a sibling child
# releasing its shared lock holds it exclusively for one unlink (DirectoryLock.release), which a preempted
# releaser may stretch to a scheduler's time slice.  The first RELEASE_YIELDS looks yield the CPU, the others
# follow a pause of RELEASE_PAUSE seconds: a dump's exclusive lock refuses a shared taker after about 0.2 s.
RELEASE_SPINS = 300
RELEASE_YIELDS = 100
RELEASE_PAUSE = 0.001


def _flock_waiting_out_releases(fd: int, dir_fd: int, shared: bool) -> bool:
    """flock `fd` (shared or exclusive, never waiting): True once held, False where `.lock` is no longer this
    file (its last holder removed it: take the new one); EWOULDBLOCK raised where another holds it."""
    for spin in range(RELEASE_SPINS if shared else 1):
        try:
            fcntl.flock(fd, (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if not _same_file(os.fstat(fd), dir_fd, LOCK_NAME):
                return False
            if shared and spin < RELEASE_YIELDS:
                os.sched_yield()
            elif shared:
                time.sleep(RELEASE_PAUSE)
    raise OSError(errno.EWOULDBLOCK, os.strerror(errno.EWOULDBLOCK))


def take_lock(dir_fd: int, where: str = "the image directory", *, shared: bool = False,
              optional: bool = False) -> DirectoryLock | None:
    """The directory's lock (`.lock` in it, flocked): one dump, or gc, or rm, at a time.  Another holder is
    INVALID_REQUEST.  `shared`: the lock children take of their parents' directories: they never exclude each
    other (sibling dumps commit at once), only a dump writing into the directory, or gc, or rm, excludes
    them, and they it.  Only who may open `.lock` (its owner, the directory's, and root) can take it, and
    only who may write the directory can create it: a reader of an image blocks nobody.  `optional`: None
    where this uid may not create it (a read-only directory or file system)."""
    try:
        owner = os.fstat(dir_fd)
    except OSError as e:
        raise from_os_error(e, f"{where} cannot be opened", InvalidRequestError) from None
    for _ in range(8):
        fd = _open_lock_file(dir_fd, where, owner, optional)
        if fd is None:
            return None
        if fd == GONE:
            continue
        try:
            # its last holder may have removed the name between our open and our flock (or held it exclusively
            # to remove it): then this file excludes nobody, and the one at the name now is the lock
            if _flock_waiting_out_releases(fd, dir_fd, shared) and _same_file(os.fstat(fd), dir_fd, LOCK_NAME):
                return DirectoryLock(os.dup(dir_fd), fd, shared)
        except OSError as e:
            os.close(fd)
            if e.errno == errno.EWOULDBLOCK:
                also = "" if shared else " (or an incremental dump reads its image as its parent)"
                raise InvalidRequestError(f"another dump is writing into {where}{also}") from None
            raise from_os_error(e, f"cannot lock {where}", InvalidRequestError) from None
        os.close(fd)
    raise InvalidRequestError(f"cannot lock {where}: its {LOCK_NAME} was replaced 8 times in a row")


def lock_directory(dir_fd: int, where: str = "the image directory", *, shared: bool = False) -> DirectoryLock:
    """`take_lock`, required."""
    lock = take_lock(dir_fd, where, shared=shared)
    assert lock is not None
    return lock


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


def dir_path(fd: int) -> bytes | None:
    """The path of the directory `fd` (from /proc/self/fd), None where there is none."""
    try:
        p = os.readlink(f"/proc/self/fd/{fd}".encode())
    except OSError:
        return None
    return p if p.startswith(b"/") and not p.endswith(b" (deleted)") else None


def read_mark(dir_fd: int, name: str) -> tuple[bytes, list[bytes]] | None:
    """The child image id and the paths of the child's directory (relative to dir_fd, then absolute) the mark
    `name` holds; None where it is not a regular file, cannot be read, names no child (an older, empty mark)
    or another image than its name."""
    try:
        fd = open_regular(dir_fd, name, "the parent directory")
    except (OSError, VramdError):
        return None
    try:
        data = os.read(fd, MAX_CHILD_MARK_BYTES + 1)
    except OSError:
        return None
    finally:
        os.close(fd)
    got = parse_child_mark(data) if len(data) <= MAX_CHILD_MARK_BYTES else None
    return got if got is not None and got[1] and child_mark_name(got[0]) == name else None


def mark_names(dir_fd: int, name: str, child: os.stat_result, image_id: bytes | None = None) -> bool:
    """Whether the mark `name` in dir_fd names the directory `child` (and the image `image_id`, where given),
    and no other: a path it records, from dir_fd, leads to that very directory, and each other one leads
    nowhere (a mark whose other path finds a directory, maybe its live child moved along with its parent, is
    not this directory's to remove)."""
    got = read_mark(dir_fd, name)
    if got is None or (image_id is not None and got[0] != image_id):
        return False
    here = 0
    for path in got[1]:
        try:
            now = os.stat(path, dir_fd=dir_fd)
        except (FileNotFoundError, NotADirectoryError):
            continue
        except OSError:
            return False
        if (now.st_dev, now.st_ino) != (child.st_dev, child.st_ino):
            return False
        here += 1
    return here > 0


def mark_state(dir_fd: int, name: str) -> tuple[str, str]:
    """Whether the mark `name` in dir_fd still protects a child: ("live", ...), ("stale", why: its child's
    directory is gone, holds no image or another image), ("unknown", why: it names no child this client
    can check; it counts as live)."""
    try:
        if not stat.S_ISREG(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode):
            return "unknown", "not a regular file"
    except OSError as e:
        return "unknown", e.strerror or "cannot stat it"
    got = read_mark(dir_fd, name)
    if got is None:
        return "unknown", "it names no child (made by an older vramd, or not by vramd)"
    image_id, paths = got
    stale: list[str] = []
    for path in paths:  # live where either path finds the child; stale where neither does
        state, why = _child_state(dir_fd, path, image_id)
        if state != "stale":
            return state, why
        stale.append(why)
    return "stale", " and ".join(stale)


def _child_state(dir_fd: int, path: bytes, image_id: bytes) -> tuple[str, str]:
    """mark_state of one path a mark records for its child."""
    shown = os.fsdecode(path)
    try:
        cfd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dir_fd)
    except (FileNotFoundError, NotADirectoryError):
        return "stale", f"{shown} is gone"
    except OSError as e:
        return "unknown", f"its child's directory {shown} cannot be opened ({e.strerror})"
    try:
        try:
            mfd = open_manifest(cfd, shown)
        except ManifestMissingError:
            return "stale", f"{shown} holds no image"
        try:
            m = read_manifest_now(mfd)
        finally:
            os.close(mfd)
    except VramdError as e:
        return "unknown", f"its child's image in {shown} cannot be read ({e.message})"
    finally:
        os.close(cfd)
    if m.image_id != image_id:
        return "stale", f"{shown} holds another image ({m.image_id.hex()[:16]})"
    return "live", shown


def remove_stale_marks(dir_fd: int) -> tuple[list[str], list[tuple[str, str]]]:
    """Under the directory's lock: remove its stale marks (regular files only); returns the names removed and
    (name, why) of each live or unknown one kept."""
    removed: list[str] = []
    kept: list[tuple[str, str]] = []
    for name in children_marks(dir_fd):
        state, why = mark_state(dir_fd, name)
        if state == "stale":
            try:
                if unlink_regular(dir_fd, name):
                    removed.append(f"{name} ({why})")
                    continue
            except OSError as e:
                why = f"{why}; not removed: {e.strerror}"
        kept.append((name, why))
    return removed, kept


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
        self._lock: DirectoryLock | None = lock_directory(dir_fd, where)
        self.image_id = b""
        self.stripes = 1  # data files per GPU (begin)
        self.data: dict[tuple[int, int], OpenedFile] = {}  # (gpu_id, stripe) -> a data file (created as name + ".tmp")
        self.manifest_fd: int | None = None
        self._created: list[str] = []           # names this dump made that go unless it commits
        self._marked: list[int] = []            # parent directories marked (unmarked unless it commits)
        self._parent_locks: list[DirectoryLock | None] = []  # each parent directory's lock, shared, held to
        # the end (None: this client may not take it, and does not mark that parent)
        self.committed = False
        try:
            marks = [] if replace_parent else children_marks(dir_fd)
            if marks:
                raise InvalidRequestError(
                    f"the image in {where} is the parent of {len(marks)} incremental image(s) (marked "
                    f"{marks[0]}...); replacing it would break them: flatten or remove them first "
                    "(vramctl flatten, vramctl rm; vramctl gc removes stale marks), or replace it anyway "
                    "(replace_parent)")
            here = os.fstat(dir_fd)
            for fd in self.parent_dirs:
                st = os.fstat(fd)
                if (st.st_dev, st.st_ino) == (here.st_dev, here.st_ino):
                    raise InvalidRequestError(f"{where} is a directory of the parent chain: an incremental image "
                                              "goes into a directory of its own")
            # Each parent directory's lock, shared, from before the parents are read to the end: a dump replacing
            # a parent (or an rm of it) takes that lock exclusively, so it cannot run between this child's
            # reading of the parent and its mark there (it would see no mark, and the child would commit
            # against an image that is gone); children of one parent do not exclude each other.  Only where
            # this client owns the parent's directory (or is root) and may write it, and the parent's directory
            # has this directory's owner: a lock, like a mark, must never let one user block another's image
            # (a mark lasts as long as its child, which whoever may write the child's directory keeps).
            me = os.geteuid()
            for k, fd in enumerate(self.parent_dirs, 1):
                lock = None
                owner = os.fstat(fd).st_uid
                if (me == 0 or owner == me) and owner == here.st_uid:
                    lock = take_lock(fd, f"parent directory #{k}", shared=True, optional=True)
                if lock is None:
                    log.info("parent directory #%d neither locked nor marked: %s may not, or this directory's "
                             "owner is not its owner", k, _who())
                self._parent_locks.append(lock)
            sweep_temporaries(dir_fd)
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
            os.fsync(d)
        except OSError as e:
            raise image_os_error(e, f"cannot fsync {self.where}") from None
        self._remove_replaced()
        self._unmark_replaced()

    def _remove_replaced(self) -> None:
        """The data files of the image this one replaced: vramd's data file names of another image id."""
        mine = data_file_name(self.image_id, 0)[:len("data-") + 16]  # "data-<this image's id>"
        try:
            names = os.listdir(self.dir_fd)
        except OSError:
            return
        for name in names:
            if not DATA_FILE_NAME.fullmatch(name) or name.startswith(mine):
                continue
            try:
                unlink_regular(self.dir_fd, name)
            except OSError as e:
                log.warning("data file %s of the replaced image not removed: %s", name, e.strerror)

    def _unmark_replaced(self) -> None:
        """After the commit: in each parent directory this dump marked, the marks that name this directory
        but another image (the image this one replaced, or a child dump into it that died in its commit) go."""
        mine = child_mark_name(self.image_id)
        try:
            here = os.fstat(self.dir_fd)
        except OSError:
            return  # best effort: the new image is committed either way (what is left reads as stale)
        for fd in self._marked:
            for name in children_marks(fd):
                if name == mine or not mark_names(fd, name, here):
                    continue
                try:
                    unlink_regular(fd, name)
                except OSError as e:
                    log.warning("mark %s of the replaced image not removed: %s", name, e.strerror)

    def _mark_parents(self) -> None:
        """Before the commit: this child's mark in each directory of its parent chain whose lock it holds
        (one it may not lock: not its own, read-only, on a read-only file system, is left unmarked: that
        parent is not protected), each fsynced, under that directory's lock.  The mark names this image and
        this directory (its path from the parent's)."""
        name = child_mark_name(self.image_id)
        here = dir_path(self.dir_fd)
        for k, (fd, lock) in enumerate(zip(self.parent_dirs, self._parent_locks, strict=True), 1):
            if lock is None:
                continue
            # under the parent directory's lock, held since this dump began (__init__): every later dump of
            # that directory sees the mark, and no earlier one replaced the image this child read
            there = dir_path(fd)
            path = os.path.relpath(here, there) if here and there else b""
            try:
                try:
                    mark = os.open(name, CREATE_FLAGS, FILE_MODE, dir_fd=fd)
                except OSError as e:
                    if e.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
                        log.info("parent directory #%d not marked: %s may not write it", k, _who())
                        continue
                    raise
                self._marked.append(fd)
                try:
                    os.write(mark, child_mark_content(self.image_id, path, here or b""))
                    os.fsync(mark)
                finally:
                    os.close(mark)
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
            if lock is not None:
                lock.release()
        self._parent_locks.clear()
        if self._lock is not None:
            self._lock.release()
            self._lock = None

    def __enter__(self) -> DumpDirectory:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
