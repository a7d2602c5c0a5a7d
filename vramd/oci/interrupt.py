"""Stopping streamed blob reads from another thread (vramd.oci.fill stops its downloads with it)."""
from __future__ import annotations

import threading

import urllib3


class Interrupted(Exception):
    """A streamed read ended by its Interrupt (the caller stopped it: its own reason is the one to report)."""


class Interrupt:
    """Ends streamed reads from another thread: `fire` shuts down the socket of each answer being read, so a
    read blocked on a stalled registry returns at once."""

    def __init__(self) -> None:
        self.fired = False
        self._lock = threading.Lock()
        self._live: set[urllib3.BaseHTTPResponse] = set()

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
            for r in self._live:
                try:
                    r.shutdown()
                except (OSError, ValueError, RuntimeError):
                    pass  # already done with
