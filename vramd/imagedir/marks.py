"""What lies in an image directory besides the image: a crashed dump's temporaries, and the `.child.<id>` marks
incremental images leave in their parents' directories (made by a dump's commit, dump.py; read by vramctl
rm and gc)."""
from __future__ import annotations

import logging
import os
import stat
from collections.abc import Callable

from ..errors import (
    ManifestMissingError,
    VramdError,
)
from ..image.fileio import read_manifest_now
from ..image.names import CHILD_MARK, MAX_CHILD_MARK_BYTES, child_mark_name, is_own_temporary, parse_child_mark
from .files import open_manifest, open_regular

log = logging.getLogger(__name__)


def unlink_regular(dir_fd: int, name: str) -> bool:
    """Remove `name` from the directory `dir_fd` if it is a regular file (never a symlink, a FIFO or a
    directory that bears a name like vramd's); False where it is something else.  An OSError comes as it is."""
    return unlink_kind(dir_fd, name, stat.S_ISREG)


def unlink_kind(dir_fd: int, name: str, kind: Callable[[int], bool]) -> bool:
    """Remove `name` from the directory `dir_fd` if `kind` (stat.S_ISREG, S_ISLNK, ...) holds of its lstat mode
    (then unlinkat of the name: a symlink itself, never what it points to); False where it does not.  An
    OSError (FileNotFoundError too) comes as it is."""
    if not kind(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode):
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
