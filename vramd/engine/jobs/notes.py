"""A streamed session's notes back to its client over a supply socket (vramd.image.supply: RELEASED, WAITING).

Release accounting (release.py): when the session starts, every chunk of every BO of the image's manifest is
looked up in its chunk table, and each record in the image's OWN data files (never a parent's) gets a count of
the chunks that read it, in arrays of about 16 bytes a record: a
deduplicated record is read by several, a delta's base record is read by each delta on it.  That pass grows
with the manifest (a crafted one of 12 MB lists 12 million chunks), so it runs in a thread (the loop's default
executor, as the manifest's own checks and indexes: never the io threads other sessions read with), never on the
event loop, and stops early once the session does; the gate (stream.py) holds every chunk until it is done.
Each time a batch has been read and checked (`read`, after the pipeline landed it), its chunks' counts go
down; a record at 0 is released.  A record no chunk of the session ever reads (a BO the client never adds, a
restore with allow_partial) is never released.

Sending never blocks the loop nor the session: the socket is non-blocking, and what is still to send is, per
data file that has any, the ranges released since they were last sent (adjacent ones merged: a client that
reads late gets fewer, larger notes) and the latest WAITING end.  Each released byte is sent once (the client
merges what it is told), so the notes of a session are at most one per record and one WAITING per chunk
held, whatever order the records are released in.  A client that never reads costs the daemon what is not
sent yet (O(records) at most, beside the counts).  Sends go out on the next turn of the loop, and, once the
socket is full, when it is writable again (add_writer).  A peer that closed its end (EPIPE, ECONNRESET)
stops the notes, never the session.  Notes that stop for any other reason (a send error, the count failing)
shut the socket's sending side down, so that the client reads their end and knows no more come.
"""
from __future__ import annotations

import asyncio
import errno
import logging
import os
import socket

from ...image.reader import ImageReader, Loc
from ...image.supply import Intervals, NoteKind, encode_note
from ..pipeline import ChunkTask
from .read import ImageBo
from .release import ReleaseCounts, record_counts

__all__ = ["Notes", "record_counts", "shut_sending"]

log = logging.getLogger(__name__)

_BATCH = 128  # notes per send


def shut_sending(sock: socket.socket) -> None:
    """No note comes any more: the client reads the end of them (its reads of the socket return 0)."""
    try:
        sock.shutdown(socket.SHUT_WR)
    except OSError:  # (not connected, or the peer is gone)
        pass


class Notes:
    """The notes of one session; `fd` is its supply socket (dup'ed here: closed by `close`); the counts are made
    in a thread (`counted`, `until_counted`)."""

    def __init__(self, reader: ImageReader, fd: int, files: int) -> None:
        self._sock: socket.socket | None = socket.socket(fileno=os.dup(fd))
        self._sock.setblocking(False)
        self._counts: ReleaseCounts | None = None  # once counted
        self._new: dict[int, Intervals] = {}  # per data file: released, not sent yet
        self._wait: dict[int, int] = {}  # per data file: the latest WAITING end, not sent yet
        self._wait_sent: dict[int, int] = {}
        self._out = b""  # a note the socket took part of
        self._scheduled = False
        self._writer = False
        self._stopping = False
        self.sent = 0  # notes sent (tests, logs)
        loop = asyncio.get_running_loop()
        self._counted: asyncio.Future[None] = loop.create_future()
        self._counting = loop.run_in_executor(None, record_counts, reader, files, self._is_stopping)
        self._counting.add_done_callback(self._on_counted)

    # --- the counts (a thread's) ----------------------------------------------

    def _is_stopping(self) -> bool:
        return self._stopping

    def _on_counted(self, fut: asyncio.Future[ReleaseCounts | None]) -> None:
        if self._sock is not None:
            if fut.cancelled() or fut.exception() is not None:
                log.error("a streamed session's release counts failed (%r): its notes stop",
                          None if fut.cancelled() else fut.exception())
                self.close(shut=True)
            else:
                self._counts = fut.result()
        if not self._counted.done():
            self._counted.set_result(None)

    @property
    def counted(self) -> bool:
        """Whether a chunk may be read (its read counted down): the counts are made, or the notes are over."""
        return self._counted.done()

    async def until_counted(self) -> None:
        await asyncio.wait([self._counted])  # (wait() never cancels the shared future)

    async def closed(self) -> None:
        """After `close`: return once the counting thread has stopped."""
        await asyncio.gather(self._counting, return_exceptions=True)

    # --- accounting -------------------------------------------------------------

    def read(self, tasks: list[ChunkTask[ImageBo]]) -> None:
        """These chunks have read and checked their records: none of them reads one again."""
        counts = self._counts
        if counts is None:
            return
        for t in tasks:
            loc: Loc | None = t.loc
            while loc is not None:
                released = counts.read(loc.slot, loc.offset)
                if released is not None:
                    self._release(loc.slot, *released)
                loc = loc.base

    def _release(self, slot: int, start: int, end: int) -> None:
        if self._sock is None:
            return
        new = self._new.get(slot)
        if new is None:
            new = self._new[slot] = Intervals()
        new.add(start, end)
        self._schedule()

    def waiting(self, slot: int, end: int) -> None:
        """A chunk waits at the gate for bytes [0, end) of data file `slot`."""
        if self._sock is not None and end > max(self._wait.get(slot, 0), self._wait_sent.get(slot, 0)):
            self._wait[slot] = end
            self._schedule()

    # --- sending ----------------------------------------------------------------

    def _schedule(self) -> None:
        if self._sock is None or self._scheduled or self._writer:
            return
        self._scheduled = True
        asyncio.get_running_loop().call_soon(self._flush)

    def _pending(self) -> list[bytes]:
        """Up to _BATCH notes, taken off what is to send."""
        out: list[bytes] = []
        for slot, end in self._wait.items():
            out.append(encode_note(NoteKind.WAITING, slot, 0, end))
            self._wait_sent[slot] = end
        self._wait.clear()
        for slot in list(self._new):
            new = self._new[slot]
            take = min(_BATCH - len(out), len(new))
            out += [encode_note(NoteKind.RELEASED, slot, s, e) for s, e in zip(new.starts[:take], new.ends[:take])]
            del new.starts[:take], new.ends[:take]
            if len(new):
                break
            del self._new[slot]
        self.sent += len(out)
        return out

    def _flush(self) -> None:
        self._scheduled = False
        sock = self._sock
        while sock is not None:
            data = self._out or b"".join(self._pending())
            if not data:
                break
            try:
                n = sock.send(data, socket.MSG_NOSIGNAL | socket.MSG_DONTWAIT)
            except (BlockingIOError, InterruptedError):
                n = 0
            except OSError as e:  # EPIPE, ECONNRESET: the client wants no notes (or is gone): the session goes on
                if e.errno not in (errno.EPIPE, errno.ECONNRESET):
                    log.warning("a streamed session's notes to its client stop: %s", e)
                self.close(shut=True)
                return
            self._out = data[n:]
            if self._out:  # full: the rest once it is writable
                if not self._writer:
                    self._writer = True
                    asyncio.get_running_loop().add_writer(sock.fileno(), self._flush)
                return
        if self._writer and sock is not None:
            self._writer = False
            asyncio.get_running_loop().remove_writer(sock.fileno())

    def close(self, shut: bool = False) -> None:
        """No more notes (the session is over, or the peer closed its end); `shut`: say so to the client."""
        self._stopping = True
        if not self._counted.done():
            self._counted.set_result(None)
        sock, self._sock = self._sock, None
        if sock is None:
            return
        if self._writer:
            self._writer = False
            asyncio.get_running_loop().remove_writer(sock.fileno())
        if shut:
            shut_sending(sock)
        sock.close()
        self._new.clear()
        self._wait.clear()
        self._out = b""
        self._counts = None
