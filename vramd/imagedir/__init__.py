"""The client's side of an image directory: every open, creation, lock, rename and removal of a name.

The daemon and everything it runs (vramd.service, vramd.engine, vramd.image,
vramd.backends) never import this package: an import-linter contract in
pyproject.toml keeps it so.  vramd.client, vramctl and vramd.inproc use it.

- files: `ImageFiles` (an image to read, a dump's parents), `open_manifest`, `read_image`.
- lock: `take_lock`, `lock_directory`: the directory's `.lock`.
- marks: crashed dumps' temporaries, the children marks of incremental images.
- dump: `DumpDirectory`, a dump's directory from its lock to its commit.
- session: `SessionFiles`, one session's files answering the client machine's file events.
- flatten: `vramctl flatten`, an incremental image copied into a self-contained one.
"""
from .dump import DumpDirectory
from .files import ImageFiles, OpenedFile, open_manifest, read_image, reopen_direct
from .lock import DirectoryLock, lock_directory, take_lock
from .marks import (
    children_marks,
    mark_names,
    mark_state,
    read_mark,
    remove_stale_marks,
    sweep_temporaries,
    unlink_regular,
)
from .session import OpenedSessions, SessionFiles, client_file

__all__ = [
    "DirectoryLock",
    "DumpDirectory",
    "ImageFiles",
    "OpenedFile",
    "OpenedSessions",
    "SessionFiles",
    "children_marks",
    "client_file",
    "lock_directory",
    "mark_names",
    "mark_state",
    "open_manifest",
    "read_image",
    "read_mark",
    "remove_stale_marks",
    "reopen_direct",
    "sweep_temporaries",
    "take_lock",
    "unlink_regular",
]
