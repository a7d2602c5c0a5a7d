"""The image directories vramctl opens with the caller's rights (the daemon never opens a path): an image's,
created where a dump needs it, its parents' along the chain, and its manifest."""
from __future__ import annotations

import os

from ..errors import NotWritableError, ParentMissingError, PermissionDeniedError, VramdError
from ..image.chain import parent_chain
from ..image.names import MANIFEST_NAME
from ..pb import image_pb2 as pb
from .common import Failure


def open_image_dir(path: str, *, create: bool, created: list[str] | None = None) -> int:
    """An fd of the image directory; with `create`, made first where missing (`created` then gets the
    directories this call made, deepest first, for `remove_created`)."""
    try:
        if create:
            made = []
            d = os.path.abspath(path)
            while not os.path.lexists(d):
                made.append(d)
                d = os.path.dirname(d)
            os.makedirs(path, exist_ok=True)
            if created is not None:
                created += made
        return os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except PermissionError as e:  # this process's own rights: the daemon never opens it
        if create:
            raise NotWritableError(f"cannot create the image directory {path}: uid {os.geteuid()} may not "
                                   f"({e.strerror})") from None
        raise PermissionDeniedError(f"cannot open the image directory {path}: uid {os.geteuid()} may not read "
                                    f"it ({e.strerror})") from None
    except OSError as e:
        raise Failure(f"cannot open image directory {path}: {e.strerror}") from None


def remove_created(created: list[str]) -> None:
    """Remove the directories vramctl made (deepest first) that are still empty: a failed dump leaves none."""
    for d in created:
        try:
            os.rmdir(d)
        except OSError:
            return  # not empty (or no longer ours to remove): it and its parents stay


def open_parents(image_dir: str, manifest: pb.Manifest, first: str | None) -> tuple[list[str], list[int]]:
    """The directories of an image's parents, nearest first, and an fd of each (the caller closes them).

    The first is `first` (--parent) or where the image recorded it, relative to itself; each next one is
    where the one before recorded its own parent.  vramctl opens them (the daemon opens no path); the
    daemon then checks each is the very image the chain names (image id and manifest hash)."""
    fds: list[int] = []

    def read(path: str, k: int) -> pb.Manifest:
        try:
            fd = open_image_dir(path, create=False)
        except Failure as e:
            raise Failure(f"{e}; {image_dir} is incremental: name its parent #{k} with --parent DIR") from None
        fds.append(fd)
        try:
            return read_manifest_offline(fd)
        except VramdError as e:
            raise Failure(f"{path} (parent #{k} of {image_dir}): {e.message}") from None

    try:
        paths = parent_chain(image_dir, manifest, first, read)
    except BaseException as e:
        for fd in fds:
            os.close(fd)
        if isinstance(e, ParentMissingError):
            raise Failure(e.message) from None
        raise
    return paths, fds


class ImageAndParents:
    """`with ImageAndParents(dir, parent) as (dir_fd, parent_fds)`: an image directory and its parents'
    (open_parents), all closed on the way out."""

    def __init__(self, path: str, first_parent: str | None) -> None:
        self.path, self.first_parent = path, first_parent
        self.fds: list[int] = []

    def __enter__(self) -> tuple[int, list[int]]:
        dfd = open_image_dir(self.path, create=False)
        self.fds.append(dfd)
        try:
            _paths, parent_fds = open_parents(self.path, read_manifest_offline(dfd, self.path), self.first_parent)
        except BaseException:
            os.close(dfd)
            raise
        self.fds += parent_fds
        return dfd, parent_fds

    def __exit__(self, *exc: object) -> None:
        for fd in self.fds:
            os.close(fd)


def holds_image(dfd: int) -> bool:
    """Whether the directory holds a committed image (its manifest)."""
    try:
        os.stat(MANIFEST_NAME, dir_fd=dfd, follow_symlinks=False)
    except FileNotFoundError:
        return False
    return True


def read_manifest_offline(dfd: int, where: str = "the image directory") -> pb.Manifest:
    """The committed manifest of the image in `dfd`, read by this process (its own rights)."""
    from ..image.fileio import read_manifest_now
    from ..imagedir import open_manifest
    fd = open_manifest(dfd, where)
    try:
        return read_manifest_now(fd)
    finally:
        os.close(fd)
