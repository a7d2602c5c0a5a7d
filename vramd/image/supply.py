"""The supply channel of a streamed restore or verify, as pure functions (no I/O).

A streamed session's image directory is complete but for its data files' payloads: the client (vramctl
restoring from a registry) creates each data file at its full length and fills it while the session runs.
It tells the daemon how far each file is final over a pipe it hands over at OpenSession: a stream of
fixed-size messages, each "bytes [0, end) of data file `index` (the image's manifest.files order, never
a parent's) are written and checked, and will not change".  An `end` never decreases.  The end of the
pipe (the client closed it, or died) means "nothing more comes": a record not covered by then is missing.

The daemon reads no byte of a record before a message covers it, and takes no staging memory for a chunk
that is not covered yet, so a client that supplies slowly (or never) holds up only its own session.

Where the supply fd is a unix stream socket (never a pipe: it is one-way), the daemon talks back over it, in
messages of NOTE_SIZE bytes a client that does not want them may leave unread (the daemon never waits for
them): RELEASED (file, start, end), no chunk of the session will read bytes [start, end) of that data file
again, so the client may free them (a range may overlap or repeat one sent before: the union is what is
released); WAITING (file, end), a chunk is held back until bytes [0, end) of that file are supplied, so a
client that bounds how far it downloads ahead must supply them whatever its bound.
"""
from __future__ import annotations

import bisect
import enum
import struct
from collections.abc import Iterator
from typing import NamedTuple

_MESSAGE = struct.Struct("<IIQ")  # data file index, reserved (0), end
MESSAGE_SIZE = _MESSAGE.size  # 16: well under PIPE_BUF, so one write of a message is atomic


class SupplyError(ValueError):
    """A message no well-behaved client sends (the daemon fails the session with a typed error)."""


def encode(index: int, end: int) -> bytes:
    """The message "data file `index` is final up to `end`"."""
    if not 0 <= index < 1 << 32 or not 0 <= end < 1 << 63:
        raise ValueError(f"supply message out of range: file {index}, end {end}")
    return _MESSAGE.pack(index, 0, end)


class SupplyDecoder:
    """Bytes off the pipe in, (index, end) advances out; checks each message against the files' lengths.

    `lengths`: each data file's length (the manifest's).  Partial messages are kept until the rest comes."""

    def __init__(self, lengths: list[int]) -> None:
        self.lengths = lengths
        self.ends = [0] * len(lengths)
        self.messages = 0  # decoded so far (errors number a message from the pipe's start, counting from 1)
        self._pending = b""

    def feed(self, data: bytes) -> Iterator[tuple[int, int]]:
        """Each file whose end advanced, with its new end (a message that repeats an end yields nothing)."""
        buf = self._pending + data
        whole = len(buf) - len(buf) % MESSAGE_SIZE
        self._pending = buf[whole:]
        for off in range(0, whole, MESSAGE_SIZE):
            index, reserved, end = _MESSAGE.unpack_from(buf, off)
            self.messages += 1
            if reserved != 0:
                raise SupplyError(f"supply message #{self.messages}: reserved field {reserved:#x} is not 0")
            if index >= len(self.lengths):
                raise SupplyError(f"supply message for data file #{index}: the image has {len(self.lengths)}")
            if end > self.lengths[index]:
                raise SupplyError(f"supply message for data file #{index}: end {end:#x} is past its length "
                                  f"{self.lengths[index]:#x}")
            if end < self.ends[index]:
                raise SupplyError(f"supply message for data file #{index}: end {end:#x} goes back from "
                                  f"{self.ends[index]:#x}")
            if end > self.ends[index]:
                self.ends[index] = end
                yield index, end

    def finish(self) -> None:
        """The pipe ended: a partial message left over is a client's mistake."""
        if self._pending:
            raise SupplyError(f"the supply pipe ended inside a message ({len(self._pending)} of {MESSAGE_SIZE} "
                              "bytes)")


# --- the daemon's notes back, over a socket ----------------------------------------------------------------

_NOTE = struct.Struct("<IIQQ")  # kind, data file index, start (0 for WAITING), end
NOTE_SIZE = _NOTE.size  # 24


class NoteKind(enum.IntEnum):
    RELEASED = 1  # [start, end) of the file is read for the last time: the client may free it
    WAITING = 2  # a chunk is held back until [0, end) of the file is supplied


class Note(NamedTuple):
    kind: NoteKind
    file: int  # data file index
    start: int
    end: int


def encode_note(kind: NoteKind, index: int, start: int, end: int) -> bytes:
    if not 0 <= index < 1 << 32 or not 0 <= start <= end < 1 << 63:
        raise ValueError(f"supply note out of range: file {index}, [{start}, {end})")
    return _NOTE.pack(int(kind), index, start, end)


class NoteDecoder:
    """Bytes off the socket in, notes out (a client's side).  A note of a kind this client does not know is
    skipped (a later daemon may add kinds); one that names a file the image does not have, a range past the
    file's length or backwards, is a SupplyError (no daemon sends it)."""

    def __init__(self, lengths: list[int]) -> None:
        self.lengths = lengths
        self._pending = b""

    def feed(self, data: bytes) -> Iterator[Note]:
        buf = self._pending + data
        whole = len(buf) - len(buf) % NOTE_SIZE
        self._pending = buf[whole:]
        for off in range(0, whole, NOTE_SIZE):
            kind, index, start, end = _NOTE.unpack_from(buf, off)
            if kind not in NoteKind.__members__.values():
                continue
            if index >= len(self.lengths):
                raise SupplyError(f"supply note for data file #{index}: the image has {len(self.lengths)}")
            if not start <= end <= self.lengths[index]:
                raise SupplyError(f"supply note for data file #{index}: [{start:#x}, {end:#x}) is not within its "
                                  f"length {self.lengths[index]:#x}")
            yield Note(NoteKind(kind), index, start, end)


# --- interval arithmetic (both sides) -----------------------------------------------------------------------

class Intervals:
    """A set of byte ranges as sorted, disjoint, non-adjacent [start, end) intervals (adjacent ones merge)."""

    def __init__(self) -> None:
        self.starts: list[int] = []
        self.ends: list[int] = []

    def add(self, start: int, end: int) -> tuple[int, int, int]:
        """Add [start, end); returns the interval of the set that now holds it, and how many bytes were new."""
        if start >= end:
            raise ValueError(f"empty range [{start}, {end})")
        i = bisect.bisect_left(self.ends, start)  # the first interval ending at or after start: touches or after
        j = bisect.bisect_right(self.starts, end)  # the intervals before j start at or before end
        old = sum(max(0, min(self.ends[k], end) - max(self.starts[k], start)) for k in range(i, j))
        lo, hi = start, end
        if i < j:
            lo, hi = min(start, self.starts[i]), max(end, self.ends[j - 1])
        self.starts[i:j] = [lo]
        self.ends[i:j] = [hi]
        return lo, hi, (end - start) - old

    def within(self, start: int, end: int) -> list[tuple[int, int]]:
        """The set's intervals that overlap [start, end)."""
        i = bisect.bisect_right(self.ends, start)
        j = bisect.bisect_left(self.starts, end)
        return list(zip(self.starts[i:j], self.ends[i:j], strict=True))

    def __len__(self) -> int:
        return len(self.starts)

    def total(self) -> int:
        return sum(e - s for s, e in zip(self.starts, self.ends, strict=True))


def punch_span(merged: tuple[int, int], new: tuple[int, int], block: int) -> tuple[int, int] | None:
    """The whole `block`-sized blocks to free once `new` is released and `merged` (the released interval that
    now holds it) is: those inside `merged` that touch `new` (the others were freed before, or still hold a
    byte not released); None where there is none."""
    lo = max(-(-merged[0] // block) * block, new[0] // block * block)
    hi = min(merged[1] // block * block, -(-new[1] // block) * block)
    return (lo, hi) if lo < hi else None
