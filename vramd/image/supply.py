"""The supply channel of a streamed restore or verify, as pure functions (no I/O).

A streamed session's image directory is complete but for its data files' payloads: the client (vramctl
restoring from a registry) creates each data file at its full length and fills it while the session runs.
It tells the daemon how far each file is final over a pipe it hands over at OpenSession: a stream of
fixed-size messages, each "bytes [0, end) of data file `index` (the image's manifest.files order, never
a parent's) are written and checked, and will not change".  An `end` never decreases.  The end of the
pipe (the client closed it, or died) means "nothing more comes": a record not covered by then is missing.

The daemon reads no byte of a record before a message covers it, and takes no staging memory for a chunk
that is not covered yet, so a client that supplies slowly (or never) holds up only its own session.
"""
from __future__ import annotations

import struct
from collections.abc import Iterator

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
