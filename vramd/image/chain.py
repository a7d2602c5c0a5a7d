"""Where an incremental image's parents are (the hint each image records): one rule for every client
tool (vramctl's restore, verify, flatten and export, and a registry push).

The first parent is where the caller says (`--parent`), else where the image recorded it, relative to the
image's own directory; each next one is where the parent before it recorded its own.  A recorded path is a
hint for tools, never something the daemon opens; a tool opens each directory itself, and the daemon then
checks each is the very image the chain names."""

from __future__ import annotations

import os
from collections.abc import Callable

from ..errors import ParentMissingError
from ..pb import image_pb2 as pb


def parent_chain(image_dir: str, manifest: pb.Manifest, first: str | None,
                 read: Callable[[str, int], pb.Manifest]) -> list[str]:
    """The directories of `image_dir`'s parents, nearest first.  `read(path, k)` opens parent #k's
    directory as the caller needs it (and keeps what it opened) and returns its manifest, raising the
    caller's own error where it cannot.  ParentMissingError where a parent was not recorded where a tool can
    find it, or where the directory found holds another image."""
    paths: list[str] = []
    here, m = image_dir, manifest
    for k, ref in enumerate(manifest.parents, 1):
        rel = m.parents[0].relative_path if m.parents else ""
        if k == 1 and first:
            path = first
        elif rel and not os.path.isabs(rel):
            path = os.path.normpath(os.path.join(here, rel))
        else:
            raise ParentMissingError(f"{image_dir} is incremental and its parent #{k} was not recorded where "
                                     "vramctl can find it; name the parent with --parent DIR")
        m = read(path, k)
        if m.image_id != ref.image_id:
            raise ParentMissingError(f"{path} holds another image than parent #{k} of {image_dir}; name the "
                                     "parent with --parent DIR")
        paths.append(path)
        here = path
    return paths
