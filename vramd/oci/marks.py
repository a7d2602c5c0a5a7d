"""A pulled chain's marks: each image's `.child.<id>` in its parent's directory (vramd.image.names), naming the
child's directory and image as a dump's commit leaves it, so that `vramctl rm` of a pulled parent is refused
while the pulled child needs it, as for a dumped chain (without them the parent went, and the child could then
be neither restored nor removed: its parent, to unmark, was gone)."""
from __future__ import annotations

import errno
import itertools
import os
from typing import TYPE_CHECKING

from ..errors import ImageError, from_os_error
from ..image.names import child_mark_content, child_mark_name
from .push import open_dir

if TYPE_CHECKING:
    from .pull import Pulled


def mark_parents(chain: list[Pulled]) -> None:
    """`chain`: an image, then its parents, nearest first.  A mark already there is rewritten.  As a dump, it
    marks a parent only where the parent's directory and the child's have one owner, this user (or root), and
    it may write there; another is left unmarked (that parent is not protected)."""
    for child, parent in itertools.pairwise(chain):
        name = child_mark_name(child.manifest.image_id)
        here, there = os.path.realpath(child.path), os.path.realpath(parent.path)
        content = child_mark_content(child.manifest.image_id, os.fsencode(os.path.relpath(here, there)),
                                     os.fsencode(here))
        dfd = open_dir(parent.path)
        try:
            owner = os.fstat(dfd).st_uid  # a mark never lets one user block another's image (as a dump's)
            if owner != os.stat(child.path).st_uid or os.geteuid() not in (0, owner):
                continue
            try:
                fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600,
                             dir_fd=dfd)
            except OSError as e:
                if e.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
                    continue
                raise
            try:
                os.write(fd, content)
                os.fsync(fd)
            finally:
                os.close(fd)
            os.fsync(dfd)
        except OSError as e:
            raise from_os_error(e, f"{parent.path}/{name}: the mark of its child {child.path}", ImageError) from None
        finally:
            os.close(dfd)
