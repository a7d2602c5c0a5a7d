"""Stopping streamed blob reads from another thread (vramd.oci.fill stops its downloads with it)."""
from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

import urllib3
from urllib3.exceptions import HTTPError

from ..errors import RegistryError
from .deadline import Armed, Deadlines


class Interrupted(Exception):
    """A streamed read ended by its Interrupt (the caller stopped it: its own reason is the one to report)."""


class Interrupt:
    """Ends streamed reads from another thread: `fire` shuts down the socket of each answer being read, and of
    each request still waiting for its answer (`arm`), so a read blocked on a stalled registry returns at once."""

    def __init__(self) -> None:
        self.fired = False
        self._lock = threading.Lock()
        self._live: set[urllib3.BaseHTTPResponse] = set()
        self._armed: dict[Armed, Deadlines] = {}

    def arm(self, deadlines: Deadlines, armed: Armed) -> None:
        """The request running in `armed`'s block is ended by `fire` (Interrupted at once if fired already)."""
        with self._lock:
            if self.fired:
                raise Interrupted()
            self._armed[armed] = deadlines

    def disarm(self, armed: Armed) -> None:
        with self._lock:
            self._armed.pop(armed, None)

    def watch(self, r: urllib3.BaseHTTPResponse) -> None:
        with self._lock:
            self._live.add(r)
            if not self.fired:
                return
        raise Interrupted()

    def unwatch(self, r: urllib3.BaseHTTPResponse) -> None:
        with self._lock:
            self._live.discard(r)

    def fire(self) -> None:
        with self._lock:
            self.fired = True
            for armed, deadlines in self._armed.items():
                deadlines.cut(armed)
            for r in self._live:
                try:
                    r.shutdown()
                except (OSError, ValueError, RuntimeError):
                    pass  # already done with


@contextmanager
def interrupting(interrupt: Interrupt | None, deadlines: Deadlines, armed: Armed) -> Iterator[None]:
    """The request made in the block (`armed`'s) is ended at once by `interrupt`, however long the registry or
    its token realm takes to answer: Interrupted, not the error its cut connection made."""
    if interrupt is None:
        yield
        return
    interrupt.arm(deadlines, armed)
    try:
        yield
    except (HTTPError, RegistryError):
        if interrupt.fired:
            raise Interrupted() from None
        raise
    finally:
        interrupt.disarm(armed)
