"""A streamed session's notes back to its client over a supply socket (vramd.image.supply: RELEASED, WAITING).

Release accounting: when the session starts, every chunk of every BO of the image's manifest is located, and
each record in the image's OWN data files (never a parent's) gets a count of the chunks that read it: a
deduplicated record is read by several, a delta's base record is read by each delta on it.  Each time a batch
has been read and checked (`read`, after the pipeline landed it), its chunks' counts go down; a record at 0 is
released: its range joins its file's released intervals, adjacent ranges merged.  A record no chunk of the
session ever reads (a BO the client never adds, a restore with allow_partial) is never released.

Sending never blocks the loop nor the session: the socket is non-blocking, and what is still to send is a
hull of the ranges released since the last send per file (the merged released intervals inside it are sent
whole, so a client that reads late gets fewer, larger notes) and the latest WAITING end per file.  A client
that never reads costs the daemon that, O(files), beside the counts and intervals the accounting holds anyway
(O(records)).  Sends go out on the next turn of the loop, and, once the socket is full, when it is writable
again (add_writer).  A peer that closed its end (EPIPE, ECONNRESET) stops the notes, never the session.
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

log = logging.getLogger(__name__)

_BATCH = 128  # notes per send


def record_counts(reader: ImageReader, files: int) -> dict[tuple[int, int], list[int]]:
    """(data file, offset) -> [chunks that read it, its length], over every BO of the image's manifest."""
    m = reader.manifest
    counts: dict[tuple[int, int], list[int]] = {}
    cs = m.chunk_size
    for e in m.bos:
        for i in range(-(-e.size // cs) if cs else 0):
            loc: Loc | None = reader.locate(e, i)
            while loc is not None:
                if loc.slot < files:
                    c = counts.get((loc.slot, loc.offset))
                    if c is None:
                        counts[(loc.slot, loc.offset)] = [1, loc.length]
                    else:
                        c[0] += 1
                loc = loc.base
    return counts


class Notes:
    """The notes of one session; `fd` is its supply socket (dup'ed here: closed by `close`)."""

    def __init__(self, reader: ImageReader, fd: int, files: int) -> None:
        self._counts = record_counts(reader, files)
        self.released = [Intervals() for _ in range(files)]
        self._hull: list[tuple[int, int] | None] = [None] * files  # released since the last send
        self._wait = [0] * files  # the latest WAITING end per file
        self._wait_sent = [0] * files
        self._out = b""  # a note the socket took part of
        self._sock: socket.socket | None = socket.socket(fileno=os.dup(fd))
        self._sock.setblocking(False)
        self._scheduled = False
        self._writer = False
        self.sent = 0  # notes sent (tests, logs)

    # --- accounting -------------------------------------------------------------

    def read(self, tasks: list[ChunkTask[ImageBo]]) -> None:
        """These chunks have read and checked their records: none of them reads one again."""
        for t in tasks:
            loc: Loc | None = t.loc
            while loc is not None:
                c = self._counts.get((loc.slot, loc.offset))
                if c is not None and c[0] > 0:
                    c[0] -= 1
                    if c[0] == 0:
                        del self._counts[(loc.slot, loc.offset)]
                        self._release(loc.slot, loc.offset, loc.offset + c[1])
                loc = loc.base

    def _release(self, slot: int, start: int, end: int) -> None:
        lo, hi, _new = self.released[slot].add(start, end)
        h = self._hull[slot]
        self._hull[slot] = (lo, hi) if h is None else (min(h[0], lo), max(h[1], hi))
        self._schedule()

    def waiting(self, slot: int, end: int) -> None:
        """A chunk waits at the gate for bytes [0, end) of data file `slot`."""
        if end > self._wait[slot]:
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
        for slot, end in enumerate(self._wait):
            if end > self._wait_sent[slot]:
                out.append(encode_note(NoteKind.WAITING, slot, 0, end))
                self._wait_sent[slot] = end
        for slot, h in enumerate(self._hull):
            if h is None:
                continue
            ivs = self.released[slot].within(*h)
            room = _BATCH - len(out)
            for s, e in ivs[:room]:
                out.append(encode_note(NoteKind.RELEASED, slot, s, e))
            if len(ivs) > room:
                self._hull[slot] = (ivs[room][0], h[1])
                break
            self._hull[slot] = None
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
                self.close()
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

    def close(self) -> None:
        """No more notes (the session is over, or the peer closed its end)."""
        sock, self._sock = self._sock, None
        if sock is None:
            return
        if self._writer:
            self._writer = False
            asyncio.get_running_loop().remove_writer(sock.fileno())
        sock.close()
        self._hull = [None] * len(self._hull)
        self._out = b""
