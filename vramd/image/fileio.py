"""Positional file I/O that finishes what it starts, and the manifest read.

Everything goes through the directory fd a caller passed (openat-style
`dir_fd=`), never through a path of the caller's, so the engine only
touches the directory it was handed.
"""
from __future__ import annotations

import asyncio
import os
from collections.abc import Sequence

from ..errors import ManifestMissingError
from ..pb import image_pb2 as pb
from .format import MANIFEST_NAME, MAX_MANIFEST_BYTES, Bytes, decode_manifest

FILE_MODE = 0o600  # images hold process memory


def pwrite_all(fd: int, iov: Sequence[Bytes], offset: int) -> None:
    """pwritev until every byte of iov is written (short writes continue)."""
    views = [memoryview(b).cast("B") for b in iov]
    while views:
        n = os.pwritev(fd, views, offset)
        offset += n
        while views and n >= len(views[0]):
            n -= len(views.pop(0))
        if views and n:
            views[0] = views[0][n:]


def pread_into(fd: int, view: memoryview, offset: int) -> int:
    """preadv until view is full or end of file; returns bytes read."""
    return preadv_all(fd, [view], offset)


def preadv_all(fd: int, views: Sequence[memoryview], offset: int) -> int:
    """preadv until every view is full or end of file; returns bytes read."""
    todo = [v for v in views if len(v)]
    total = 0
    while todo:
        n = os.preadv(fd, todo, offset)
        if n == 0:
            break
        offset += n
        total += n
        while todo and n >= len(todo[0]):
            n -= len(todo.pop(0))
        if todo and n:
            todo[0] = todo[0][n:]
    return total


def _read_manifest_blob(dir_fd: int) -> bytes:
    fd = os.open(MANIFEST_NAME, os.O_RDONLY | os.O_CLOEXEC, dir_fd=dir_fd)
    try:
        with os.fdopen(fd, "rb", closefd=False) as f:
            return f.read(MAX_MANIFEST_BYTES + 1)
    finally:
        os.close(fd)


async def read_manifest(dir_fd: int) -> pb.Manifest:
    """The committed manifest of the image in `dir_fd`, decoded and checked (the read in a thread)."""
    try:
        blob = await asyncio.get_running_loop().run_in_executor(None, _read_manifest_blob, dir_fd)
    except FileNotFoundError:
        raise ManifestMissingError(
            f"no committed image here: {MANIFEST_NAME} is missing (an interrupted dump never commits one)"
        ) from None
    return decode_manifest(blob)
