"""A restore streamed from a registry: the daemon restores while the image's blobs download (#35).

An incremental image's parents are pulled first, whole, into sibling directories (vramd.oci.pull).  The image
itself goes into a staging directory beside its cache entry, `ENTRY.partial`, made under the flock of the
entry's parent directory (one restore of a reference per node at a time; a staging directory a dead vramctl
left is swept): manifest.vrdm (the artifact's config, every check passed) and the data files under their final
names, created at full length with the skeleton's literal runs written.  The session is opened on it with the
read end of a pipe (vramd.image.supply): vramd.oci.fill's writer downloads the payload blobs in file order,
each checked by digest before an end covers it, and writes each data file's checked prefix to the pipe; the
daemon reads no record before an end covers it.  When the session is done and the files fsynced, the staging
directory is renamed to the entry (the commit); a failure removes it.  A commit that fails after the session
succeeded (an entry in the way that cannot be removed, the rename, the directory's fsync) is a warning: the BOs
are restored, the entry is not kept.  A staging directory that cannot be removed is a warning too, never the
error reported in place of the session's.

A committed entry whose manifest.vrdm is the artifact's config (sha256) is restored as it is: no blob is
downloaded and no payload re-hashed first, because the daemon checks every record it reads against
manifest.vrdm (record heads and their checksums, payload checksums) before a byte reaches a BO.  A damaged entry
fails there, naming the BO, with the advice to remove the entry or restore with `refresh`.  It is read under
a shared flock of the entry's directory: a `refresh` (and a commit) takes it exclusive, so an entry is never
removed while a restore reads it.

With a `window` (`--no-cache`: nothing is kept), the supply is one end of a unix socketpair instead of a
pipe, and a thread reads the daemon's notes off it (RELEASED, WAITING: vramd.image.supply) into the writer's
window (vramd.oci.window): what the daemon read for good is punched out of the files, and a blob starts only
within the window or for a chunk that waits.  Once the session is done, the downloads stop (nothing of a
record no chunk read is kept).

The daemon's session is the caller's (`run`): vramd.oci sits below the client library.  Threads: `run` drives
the session on the calling thread; the writer's threads write 16-byte supply messages (atomic) to the pipe.
"""
from __future__ import annotations

import dataclasses
import os
import socket
import stat
import threading
from collections.abc import Callable
from dataclasses import dataclass

from ..errors import ImageError, VramdError, from_os_error
from ..image.fileio import image_os_error
from ..image.manifest import decode_manifest
from ..image.names import MANIFEST_NAME
from ..pb import image_pb2 as pb
from .fill import Filler
from .layout import Artifact, Skeleton, sha256_digest
from .pull import Pulled, Puller, lock_parent, pull_parents
from .push import open_dir, read_manifest_bytes
from .supply_end import WriteEnd, read_notes, shutdown
from .window import WindowStats


@dataclass(frozen=True)
class SupplyPipe:
    fd: int  # the read end, for Client.open_session(supply_fd=)
    opened: Callable[[], None]  # to call once the session is open (its files attached): the ends flow from then


# (image directory, its first parent's directory or None, the supply pipe or None): runs the restore session on
# it and returns once it is done; raises the daemon's error if it failed
RunSession = Callable[[str, "str | None", "SupplyPipe | None"], None]
STAGING_SUFFIX = ".partial"
Warn = Callable[[str], None]  # one line for the operator (vramctl: stderr)
DAMAGED = ("the cache entry {entry} is damaged: remove it (rm -r {entry}) or restore again with --refresh-cache "
           "to download the image again")


@dataclass(frozen=True)
class Restored:
    digest: str  # of the OCI manifest
    chain: list[Pulled]  # the image (at its entry), then its parents
    warm: bool  # restored from a committed cache entry: no blob of the image downloaded
    window: WindowStats | None = None  # a bounded (`window`) restore's: its peak resident bytes, ...


def restore(puller: Puller, ref: str, entry: str, run: RunSession, *, commit: bool = True,
            refresh: bool = False, artifact: tuple[Artifact, str] | None = None,
            warn: Warn = lambda _text: None, window: int | None = None) -> Restored:
    """Restore the image at `ref` (a digest reference) through `run`, streamed into `entry` + STAGING_SUFFIX and
    committed to `entry` (`commit` False: the staging directory is removed instead); a committed `entry`
    holding the image is restored as it is, unless `refresh` (then it is removed first).  `artifact`: the
    checked OCI manifest at `ref` and its digest (Puller.artifact), where the caller has it already.  A commit
    that fails after the session succeeded, or a staging directory that cannot be removed, is one `warn` line:
    the restore stands (or its first error does), the entry is not kept.  `window` (with `commit` False: a
    restore that keeps nothing): the data files hold at most that many bytes the daemon still needs, beyond
    what a chunk waits for, and lose what it has read for good (vramd.oci.window); the parents are still
    pulled whole first."""
    if window is not None and commit:
        raise ValueError("a bounded window keeps no whole image: it cannot be committed")
    art, digest = artifact or puller.artifact(ref)
    if refresh:
        _locked(entry, lambda: _remove_tree(entry))
    warm = _committed(entry, art.config.digest)
    if warm is not None:
        done = _warm_shared(puller, ref, entry, digest, warm, art, run)
        if done is not None:
            return done
    config, manifest = puller.config(art, digest)
    sk = puller.skeleton(art, digest, manifest)
    child = Pulled(entry, digest, manifest, art.parent, False)
    parents = pull_parents(puller, ref, child, (entry + STAGING_SUFFIX,))  # each under the same flock: before ours
    lock = lock_parent(entry)
    try:
        # another restore of it committed while we waited (its manifest.vrdm is this config, by digest)
        if _committed(entry, art.config.digest) is not None:
            return _warm(dataclasses.replace(child, cached=True), parents, run)
        staging = entry + STAGING_SUFFIX
        _remove_tree(staging)
        try:
            os.mkdir(staging, 0o700)
        except OSError as e:
            raise from_os_error(e, staging, ImageError) from None
        try:
            stats: list[WindowStats] = []
            whole = _stream(puller, manifest, sk, staging, bytes(config), parents, run, window, stats)
        except BaseException:
            _cleanup(staging, warn)  # the session's error is the one reported, whatever the cleanup meets
            raise
        if stats and stats[0].punch_error is not None:
            warn(f"cannot free what the daemon read from the files in {staging} ({stats[0].punch_error}): they "
                 "held all of it, whatever --window said")
        if commit and whole:
            _commit(staging, entry, warn)
        else:
            _cleanup(staging, warn)
    finally:
        os.close(lock)
    return Restored(digest, [child, *parents], False, stats[0] if stats else None)


def _warm_shared(puller: Puller, ref: str, entry: str, digest: str, manifest_bytes: bytes, art: Artifact,
                 run: RunSession) -> Restored | None:
    """A committed entry restored as it is, under a shared flock of its directory (a `refresh` or a commit of
    the same image takes it exclusive: neither removes the entry while a restore reads it); None where the
    entry went (refreshed) before the lock was had: then it is streamed again.  The parents are pulled first,
    each under the same directory's exclusive flock, which a holder of the shared one would wait for forever."""
    child = Pulled(entry, digest, decode_manifest(manifest_bytes, f"{entry}/{MANIFEST_NAME}"), art.parent, True)
    parents = pull_parents(puller, ref, child, (entry + STAGING_SUFFIX,))
    lock = lock_parent(entry, shared=True)
    try:
        # (still there: its manifest.vrdm is the artifact's config by digest, the bytes decoded above)
        if _committed(entry, art.config.digest) is None:
            return None
        return _warm(child, parents, run)
    finally:
        os.close(lock)


def _commit(staging: str, entry: str, warn: Warn) -> None:
    """Rename the whole staging directory to `entry` and make that durable; a failure (an entry in the way that
    cannot be removed, the rename, the directory's fsync) is a warning: the BOs are restored already."""
    try:
        if os.path.lexists(entry):  # an entry not committed by us (damaged, other image): replaced
            _remove_tree(entry)
        os.rename(staging, entry)
    except (OSError, VramdError) as e:
        warn(f"the cache entry {entry} is not kept: {_why(e)}")
        _cleanup(staging, warn)
        return
    try:
        _fsync_dir(os.path.dirname(os.path.abspath(entry)))
    except OSError as e:
        warn(f"the cache entry {entry} is not kept: cannot sync its directory: {_why(e)}")
        _cleanup(entry, warn)


def _why(e: BaseException) -> str:
    if isinstance(e, VramdError):
        return e.message
    if isinstance(e, OSError):
        return e.strerror or str(e)
    return str(e)


def _cleanup(path: str, warn: Warn) -> None:
    try:
        _remove_tree(path)
    except VramdError as e:
        warn(f"cannot remove {path}: {e.message}")


def _stream(puller: Puller, manifest: pb.Manifest, sk: Skeleton, staging: str, config: bytes,
            parents: list[Pulled], run: RunSession, window: int | None = None,
            stats: list[WindowStats] | None = None) -> bool:
    """The session on `staging` while the writer fills it; True if every file is whole and fsynced (the
    session may end before a record it never reads is downloaded: then the restore stands, uncached).
    `window`: the supply is a socket, over which the daemon says what it read for good (the filler punches it
    out of the files) and what a chunk waits for; the filler starts a blob only within `window` bytes
    resident, or for a chunk that waits (vramd.oci.window)."""
    dfd = open_dir(staging)
    if window is None:
        r, w = os.pipe2(os.O_CLOEXEC)
    else:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        w, r = ours.detach(), theirs.detach()
    pipe = WriteEnd(w, sock=window is not None)
    filler = Filler(puller.reg, puller.repo, sk, manifest, concurrency=puller.concurrency, on_supply=pipe.write,
                    where=staging, window=window)
    failed: list[BaseException] = []
    notes: threading.Thread | None = None

    def fill() -> None:
        try:
            filler.run()
        except OSError as e:  # writing the staging files (ENOSPC, EIO): typed, naming the directory
            failed.append(image_os_error(e, f"cannot write the image's files in {staging}"))
        except BaseException as e:  # the main thread reports it
            failed.append(e)
        finally:
            pipe.one_done()

    def opened() -> None:  # the session's files are attached: the ends held back go out, then flow
        filler.release()
        pipe.one_done()

    thread: threading.Thread | None = None
    try:
        _write_manifest(dfd, staging, config)
        filler.hold()
        filler.create(dfd, "", [])
        if window is not None and stats is not None and filler.window is not None:
            stats.append(filler.window.stats)
        if window is not None:
            notes = threading.Thread(target=read_notes, args=(w, filler, [df.length for df in manifest.files]),
                                     name="vramd-notes", daemon=True)
            notes.start()
        thread = threading.Thread(target=fill, name="vramd-stream", daemon=True)
        thread.start()
        try:
            run(staging, parents[0].path if parents else None, SupplyPipe(r, opened))
        except BaseException:
            filler.stop()  # the daemon failed (or the supply did): downloads stop at their next piece
            os.close(r)  # a writer blocked on a full pipe gets EPIPE
            r = -1
            thread.join()
            real = [e for e in failed if isinstance(e, VramdError)]
            if real:  # the session failed because the supply ended: the writer's error is the one to report
                raise real[0] from None
            raise
        pipe.over = True
        os.close(r)
        r = -1
        if window is not None:  # nothing is kept: what the session never read is not downloaded
            filler.stop()
        thread.join()
        if failed or window is not None:
            return False
        filler.sync()
        os.fsync(dfd)
        return True
    finally:
        if notes is not None:  # the notes end with our end shut down (the daemon's may still be open)
            shutdown(w, socket.SHUT_RDWR)
            notes.join()
        pipe.close()
        if r >= 0:
            os.close(r)
        filler.close()
        os.close(dfd)


def _write_manifest(dfd: int, staging: str, config: bytes) -> None:
    try:
        fd = os.open(MANIFEST_NAME, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600,
                     dir_fd=dfd)
        try:
            os.write(fd, config)
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError as e:
        raise from_os_error(e, f"{staging}/{MANIFEST_NAME}", ImageError) from None


def _warm(child: Pulled, parents: list[Pulled], run: RunSession) -> Restored:
    """The committed entry `child` (cached) restored as it is, its parents pulled already."""
    try:
        run(child.path, parents[0].path if parents else None, None)
    except ImageError as e:  # a record the daemon refused (CORRUPT_CHUNK, TRUNCATED_DATA, ...)
        raise _with_advice(e, child.path) from None
    return Restored(child.digest, [child, *parents], True)


def _with_advice(e: ImageError, entry: str) -> ImageError:
    out = ImageError.__new__(type(e))
    VramdError.__init__(out, f"{e.message}; {DAMAGED.format(entry=entry)}", bo_id=e.bo_id, offset=e.offset)
    return out


def _committed(entry: str, config_digest: str) -> bytes | None:
    """manifest.vrdm's bytes, where `entry` is a committed entry holding the image whose config is
    `config_digest`; None where there is no entry (ImageError where it holds something else)."""
    if not os.path.lexists(entry):
        return None
    dfd = open_dir(entry)
    try:
        try:
            data = read_manifest_bytes(dfd, entry)
        except ImageError:
            return None  # no manifest: what a pull killed midway left; replaced by this restore's commit
    finally:
        os.close(dfd)
    if sha256_digest(data) != config_digest:
        raise ImageError(f"{entry}/{MANIFEST_NAME} is not the artifact's config; {DAMAGED.format(entry=entry)}")
    return data


def _locked(entry: str, fn: Callable[[], None]) -> None:
    lock = lock_parent(entry)
    try:
        fn()
    finally:
        os.close(lock)


def _remove_tree(path: str) -> None:
    """Remove a staging directory or cache entry: regular files, one level, then the directory (never a
    link's target)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    except OSError as e:
        raise from_os_error(e, path, ImageError) from None
    try:
        if not stat.S_ISDIR(st.st_mode):
            raise ImageError(f"{path}: not a directory: remove it by hand")
        dfd = open_dir(path)
        try:
            for name in os.listdir(dfd):
                if not stat.S_ISREG(os.stat(name, dir_fd=dfd, follow_symlinks=False).st_mode):
                    raise ImageError(f"{path}/{name}: not a regular file: remove {path} by hand")
                os.unlink(name, dir_fd=dfd)
        finally:
            os.close(dfd)
        os.rmdir(path)
    except OSError as e:
        raise from_os_error(e, path, ImageError) from None


def _fsync_dir(path: str) -> None:
    dfd = open_dir(path)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)
