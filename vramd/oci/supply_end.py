"""The client's end of a streamed restore's supply channel (vramd.oci.stream): the pipe's or socket's write end
the writer's threads share, and the thread that reads the daemon's notes off a socket into the window."""
from __future__ import annotations

import os
import socket
import threading

from ..image.supply import NoteDecoder, SupplyError, encode
from .fill import Filler


class WriteEnd:
    """The supply pipe's write end: closed (the daemon's EOF) once the writer has finished AND the session is
    open, so that the ends held back until the session opened are written first; or at once by `close`."""

    def __init__(self, fd: int, sock: bool = False) -> None:
        self.fd, self.waiting, self.over, self.sock = fd, 2, False, sock
        self._lock = threading.Lock()

    def write(self, index: int, end: int) -> None:
        with self._lock:
            if self.over or self.fd < 0:  # the session is done: the ends it never needed are not sent
                return
            try:
                os.write(self.fd, encode(index, end))  # 16 bytes: one atomic write
            except BrokenPipeError:
                if not self.over:
                    raise

    def one_done(self) -> None:
        with self._lock:
            self.waiting -= 1
            if self.waiting == 0 and self.fd >= 0:
                if self.sock:  # the daemon's notes still come back over it: only our direction ends
                    shutdown(self.fd, socket.SHUT_WR)
                    self.over = True
                else:
                    os.close(self.fd)
                    self.fd = -1

    def close(self) -> None:
        with self._lock:
            if self.fd >= 0:
                os.close(self.fd)
                self.fd = -1


def shutdown(fd: int, how: int) -> None:
    s = socket.socket(fileno=fd)
    try:
        s.shutdown(how)
    except OSError:  # (the daemon's end is gone already)
        pass
    finally:
        s.detach()


def read_notes(fd: int, filler: Filler, lengths: list[int]) -> None:
    """The daemon's notes, until its end and ours are closed (or ours shut down): to the filler's window.  When
    they end (or make no sense: no daemon sends that), the window bounds nothing any more: no WAITING could
    come to let a blob past it."""
    dec = NoteDecoder(lengths)
    window = filler.window
    assert window is not None
    try:
        while data := os.read(fd, 4096):
            for n in dec.feed(data):
                window.note(n)
    except (OSError, SupplyError):
        pass
    finally:
        window.unbound()
