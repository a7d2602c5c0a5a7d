"""One session's files on the client's side, answering the file events of the client machine (vramd.protocol).

The machine never touches a file: each event that needs one (open a
manifest or a data file the daemon named, create a dump's data file or its
manifest temporary, drop files the daemon did not take, commit, release) is
answered here, with this process's rights, by `SessionFiles.step`.  Any
driver of the machine (a blocking socket, an asyncio one: vramd.inproc)
hands it the events that name a session.
"""
from __future__ import annotations

from ..protocol import events as ev
from ..protocol.client import ClientFile
from ..protocol.session import ClientMachine
from .dump import DumpDirectory
from .files import ImageFiles, OpenedFile


def client_file(f: OpenedFile) -> ClientFile:
    """An opened file as AttachFiles carries it."""
    return ClientFile(f.image, f.name, f.fd, f.direct_fd, f.gpu_id, f.stripe)


class SessionFiles:
    """The files of one session: `files` (a restore's or verify's image, or a dump's parents) and a dump's
    directory `dump`.  `close` closes them all; an uncommitted dump's are removed, its directory unlocked."""

    def __init__(self, files: ImageFiles, dump: DumpDirectory | None = None) -> None:
        self.files = files
        self.dump = dump

    def step(self, m: ClientMachine, e: ev.Event) -> None:
        """Do the file step `e` asks for, and answer the machine (an error is raised: the driver answers it
        with `m.fail`)."""
        if isinstance(e, ev.OpenManifest):
            fd = self.files.manifest_fd if e.image == 0 else self.files.parent_manifest_fds[e.image - 1]
            assert fd is not None, "a dump has no manifest of its own"
            m.provide_fd(fd)
        elif isinstance(e, ev.OpenDataFile):
            (f,) = self.files.open_needed([(e.image, e.name)])
            m.provide_file(client_file(f))
        elif isinstance(e, ev.ReleaseFiles):
            m.acknowledge()  # the driver closes this (its session is over)
        else:
            d = self.dump
            assert d is not None, f"{type(e).__name__} for a session that is not a dump"
            if isinstance(e, ev.CreateDataFile):
                m.provide_file(client_file(d.data_file(e.gpu_id, e.stripe)))
                return
            if isinstance(e, ev.CreateManifest):
                m.provide_fd(d.manifest_file())
                return
            if isinstance(e, ev.BeginDump):
                d.begin(e.image_id, e.data_files_per_gpu)
            elif isinstance(e, ev.DropDataFiles):
                d.drop([d.data[k] for k in e.files if k in d.data])
            elif isinstance(e, ev.Commit):
                self.commit()
            m.acknowledge()

    def commit(self) -> None:
        """The dump is DONE: its files put in place (DumpDirectory.commit)."""
        assert self.dump is not None
        self.dump.commit()

    def close(self) -> None:
        try:
            if self.dump is not None:
                self.dump.close()
        finally:
            self.files.close()


# The events a session's files answer: every event but Send, Done and Failed.
FileEvent = (ev.OpenManifest | ev.OpenDataFile | ev.BeginDump | ev.CreateDataFile | ev.DropDataFiles
             | ev.CreateManifest | ev.Commit | ev.ReleaseFiles)


class OpenedSessions:
    """The files of every session one connection opened, by token, and the routing of the machine's file
    events to them: what every driver of the machine (vramd.client, vramd.inproc) does between its I/O."""

    def __init__(self) -> None:
        self._by_token: dict[str, SessionFiles] = {}

    def add(self, token: str, files: SessionFiles) -> None:
        """`files` belong to the session `token` from here on (closed when it is released or forgotten)."""
        self._by_token[token] = files

    def answer(self, m: ClientMachine, e: FileEvent, opening: SessionFiles | None = None) -> None:
        """Answer the file event `e` with its session's files (`opening`: those of the session being opened,
        which has no token yet).  A step that raises is answered with `m.fail`; ReleaseFiles closes them."""
        files = opening if opening is not None or isinstance(e, ev.OpenManifest) else self._by_token.get(e.token)
        assert files is not None, f"{type(e).__name__} for a session this connection did not open"
        try:
            files.step(m, e)
        except Exception as exc:
            m.fail(exc)
        if isinstance(e, ev.ReleaseFiles):
            self.forget(e.token)

    def forget(self, token: str) -> None:
        files = self._by_token.pop(token, None)
        if files is not None:
            files.close()

    def close(self) -> None:
        """Close every session's files (an uncommitted dump's removed)."""
        for files in self._by_token.values():
            files.close()
        self._by_token.clear()
