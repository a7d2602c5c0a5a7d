"""A dump's directory on the client's side: locked, checked for children marks, swept of a crashed dump's
temporaries; the data files and the manifest's temporary created; the commit (renames, parent marks, fsync,
removal of the replaced image's files); everything undone if the dump does not commit."""
from __future__ import annotations

import errno
import logging
import os
from collections.abc import Iterable, Sequence

from ..errors import (
    InvalidRequestError,
    ProtocolError,
)
from ..image.fileio import FILE_MODE, image_os_error
from ..image.format import MAX_STRIPES
from ..image.names import (
    DATA_FILE_NAME,
    MANIFEST_NAME,
    child_mark_content,
    child_mark_name,
    data_file_name,
    manifest_tmp_name,
)
from .files import CREATE_FLAGS, OpenedFile, refused, reopen_direct, who
from .lock import DirectoryLock, lock_directory, take_lock
from .marks import children_marks, dir_path, mark_names, sweep_temporaries, unlink_regular

log = logging.getLogger(__name__)


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
                             "owner is not its owner", k, who())
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
            raise refused(e, name, self.where, write=True) from None
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
                        log.info("parent directory #%d not marked: %s may not write it", k, who())
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
