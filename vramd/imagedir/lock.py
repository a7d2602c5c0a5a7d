"""An image directory's lock: a file `.lock` only those who may write the image can open (one dump, rm or gc
at a time; children hold their parents' shared).

The file exists only while someone holds it: its last holder removes it as it releases it, and the next taker
creates a new one.  So a taker may open the file just before its last holder removes it, and find, once it
has flocked it, that it locks nothing (the name is gone, or another file's): it looks again.  Siblings (children
of one image, each taking and releasing its lock shared) can make that happen any number of times in a row,
though none ever excludes another.  The rule: a taker looks again every time the file it
opened was removed before it held it, since each removal is another holder's completed release (the lock was
free then: nobody excluded the taker, and the others made progress); it is refused only where another holds
the lock (exclusively, against a child), where `.lock` is not vramd's, on an error (the directory removed:
`.lock` cannot be created there), after STRAYS replacements that no release explains (the file it opened
moved away, still linked), or after RELEASES removals: far more than siblings' churn makes in a row, but a
bound, since a process that may write the directory can remove `.lock` in a loop and would otherwise keep
the taker (a dump inside CRIU) looking for ever.
"""
from __future__ import annotations

import errno
import fcntl
import logging
import os
import stat
import time

from ..errors import (
    InvalidRequestError,
    NotWritableError,
    from_os_error,
)
from ..image.fileio import FILE_MODE, OPEN_FLAGS, image_os_error
from ..image.names import LOCK_NAME
from .files import who

log = logging.getLogger(__name__)


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
            if same_file(os.fstat(self.fd), self.dir_fd, LOCK_NAME):
                if self.shared:
                    fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                os.unlink(LOCK_NAME, dir_fd=self.dir_fd)
        except OSError:
            pass
        os.close(self.fd)
        os.close(self.dir_fd)
        self.fd = self.dir_fd = -1


def same_file(st: os.stat_result, dir_fd: int, name: str | bytes, *, follow: bool = False) -> bool:
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
                raise _lock_refused(where, f"is uid {uid}'s, and {who()} may not open it") from None
            raise from_os_error(e, f"cannot lock {where}: cannot open its {LOCK_NAME}", InvalidRequestError) \
                from None
    except OSError as e:
        if optional and e.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
            return None
        if e.errno in (errno.EACCES, errno.EPERM):
            raise NotWritableError(f"cannot lock {where}: {who()} may not create {LOCK_NAME} there "
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
                                       f"{owner.st_uid}) nor {who()}'s")
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
# How many replacements of `.lock` that no holder's release explains (the file a taker opened moved aside, still
# linked, rather than removed) a taker sees before it gives up: a file system that never shows a removed
# file as unlinked would otherwise keep it looking forever.
STRAYS = 8
# How many removals of the `.lock` a taker opened, before it held it, it outlasts (each one a holder's release, or
# a process removing the name in a loop): 4 siblings taking and releasing 2,000 times each made 8 in a row now
# and then on a loaded machine; a bound all the same (libvramd: the same number).
RELEASES = 1000


def _flock_waiting_out_releases(fd: int, dir_fd: int, shared: bool) -> bool:
    """flock `fd` (shared or exclusive, never waiting): True once held, False where `.lock` is no longer this
    file (its last holder removed it: take the new one); EWOULDBLOCK raised where another holds it."""
    for spin in range(RELEASE_SPINS if shared else 1):
        try:
            fcntl.flock(fd, (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if not same_file(os.fstat(fd), dir_fd, LOCK_NAME):
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
    where this uid may not create it (a read-only directory or file system).  A `.lock` removed between our
    open and our flock (its last holder released it) is no refusal: see the module's docstring."""
    try:
        owner = os.fstat(dir_fd)
    except OSError as e:
        raise from_os_error(e, f"{where} cannot be opened", InvalidRequestError) from None
    strays = 0  # replacements no holder's release explains: at most STRAYS
    releases = 0  # removals of the file we opened before we held it: at most RELEASES
    while True:
        if releases == RELEASES:
            raise InvalidRequestError(f"cannot lock {where}: its {LOCK_NAME} was removed {RELEASES} times before "
                                      "it could be held (by holders' releases, or a process removing it)")
        fd = _open_lock_file(dir_fd, where, owner, optional)
        if fd is None:
            return None
        if fd == GONE:
            releases += 1  # removed between our create and our open: a holder's release
            continue
        try:
            # its last holder may have removed the name between our open and our flock (or held it exclusively
            # to remove it): then this file excludes nobody, and the one at the name now is the lock
            if _flock_waiting_out_releases(fd, dir_fd, shared) and same_file(os.fstat(fd), dir_fd, LOCK_NAME):
                return DirectoryLock(os.dup(dir_fd), fd, shared)
            released = os.fstat(fd).st_nlink == 0
        except OSError as e:
            os.close(fd)
            if e.errno == errno.EWOULDBLOCK:
                also = "" if shared else " (or an incremental dump reads its image as its parent)"
                raise InvalidRequestError(f"another dump is writing into {where}{also}") from None
            raise from_os_error(e, f"cannot lock {where}", InvalidRequestError) from None
        os.close(fd)
        if released:
            releases += 1
        else:
            strays += 1
            if strays == STRAYS:
                raise InvalidRequestError(f"cannot lock {where}: its {LOCK_NAME} was replaced {STRAYS} times while "
                                          "the file opened stayed linked (moved away, not removed by a holder's "
                                          "release)")


def lock_directory(dir_fd: int, where: str = "the image directory", *, shared: bool = False) -> DirectoryLock:
    """`take_lock`, required."""
    lock = take_lock(dir_fd, where, shared=shared)
    assert lock is not None
    return lock
