"""A deadline for a whole request to a registry or its token realm: connecting, sending, and reading the answer.

urllib3's timeouts bound one socket operation each: a server (or anything on the way) that sends a byte now and
then, just inside the read timeout, holds a request, and the push or pull waiting on it, forever.  Here a
request runs `within(seconds)`: the connections it uses (urllib3 makes them through `pool_classes`, which
report each connect and request to `Deadlines`) are shut down by one watchdog thread when the time is up,
which ends whatever read or write was blocked; `Armed.expired` then tells the caller why it failed.

    deadlines = Deadlines()
    pool = urllib3.PoolManager(...); pool.pool_classes_by_scheme = deadlines.pool_classes()
    with deadlines.within(30.0) as armed:
        r = pool.request(...); body = r.read()    # raises once 30 s are up; armed.expired is then True
"""
from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import urllib3
from urllib3.connection import HTTPConnection, HTTPSConnection


@dataclass(eq=False)
class Armed:
    """One request's deadline (time.monotonic()) and the connections it used."""

    at: float
    conns: list[object] = field(default_factory=list)  # urllib3's connections (their `sock`)
    expired: bool = False
    outer: Armed | None = None  # the block this one runs inside: its connections are that block's too
    cut: bool = False  # ended by `Deadlines.cut` (an Interrupt), not by its time


class Deadlines:
    def __init__(self) -> None:
        self._local = threading.local()
        self._cond = threading.Condition()
        self._armed: set[Armed] = set()
        self._thread: threading.Thread | None = None
        self._closed = False

    def pool_classes(self) -> dict[str, type[urllib3.HTTPConnectionPool]]:
        """Connection pools whose connections report to this watchdog (PoolManager.pool_classes_by_scheme)."""
        attach = self._attach

        class Watched(HTTPConnection):  # what both schemes' connections add: reporting to the watchdog
            def connect(self) -> None:
                attach(self)
                super().connect()
                self.vramd_sock = self.sock  # an answer that closes its connection takes the socket away
                attach(self)  # a cut (or deadline) that came while it connected found no socket: cut it now

            def request(self, *args: Any, **kwargs: Any) -> None:
                attach(self)
                super().request(*args, **kwargs)

        class Http(Watched):
            pass

        class Https(Watched, HTTPSConnection):
            pass

        class HttpPool(urllib3.HTTPConnectionPool):
            ConnectionCls = Http

        class HttpsPool(urllib3.HTTPSConnectionPool):
            ConnectionCls = Https

        return {"http": HttpPool, "https": HttpsPool}

    @contextmanager
    def within(self, seconds: float, conn: object = None) -> Iterator[Armed]:
        """What this thread sends and reads inside the block is cut off `seconds` from now: on the connections
        it makes or sends on, and on `conn` (the connection of an answer whose body is read in the block)."""
        outer = getattr(self._local, "armed", None)
        armed = Armed(time.monotonic() + seconds, [conn] if conn is not None else [], outer=outer)
        self._local.armed = armed
        with self._cond:
            if self._closed:
                raise RuntimeError("the registry client is closed")
            self._armed.add(armed)
            if self._thread is None:
                self._thread = threading.Thread(target=self._watch, name="vramd-deadline", daemon=True)
                self._thread.start()
            self._cond.notify()
        try:
            yield armed
        finally:
            with self._cond:
                self._armed.discard(armed)
            self._local.armed = outer

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()

    def _attach(self, conn: object) -> None:
        armed: Armed | None = getattr(self._local, "armed", None)
        while armed is not None:  # an inner request's connections are cut with the block around it too
            self.add(armed, conn)
            armed = armed.outer

    def add(self, armed: Armed, conn: object) -> None:
        """`conn` is cut at `armed`'s deadline too (e.g. the connection of an answer an inner request opened,
        whose body the outer block reads); at once if that deadline is past."""
        with self._cond:
            if conn not in armed.conns:
                armed.conns.append(conn)
            if armed.expired or armed.cut:  # a connection taken after the time was up: cut at once
                _cut(conn)

    def cut(self, armed: Armed) -> None:
        """End `armed`'s block now, from another thread: its connections, and any it takes from now on, are
        shut down (a request still waiting for its answer's head included)."""
        with self._cond:
            armed.cut = True
            for conn in armed.conns:
                _cut(conn)

    def _watch(self) -> None:
        with self._cond:
            while not self._closed:
                now = time.monotonic()
                for armed in self._armed:
                    if armed.at <= now:
                        armed.expired = True
                        for conn in armed.conns:  # again on each wake: a connection may have come since
                            _cut(conn)
                pending = [a.at for a in self._armed if not a.expired]
                self._cond.wait(timeout=min(pending) - now if pending else None)


def _cut(conn: object) -> None:
    """End what blocks on `conn`'s socket (a read or write in another thread returns at once)."""
    sock = getattr(conn, "sock", None)
    if not isinstance(sock, socket.socket):
        # an answer that closes its connection ("Connection: close", HTTP/1.0) is read from a socket http.client
        # dropped from `sock` when the head came: open until that answer is (then shut down to no effect)
        sock = getattr(conn, "vramd_sock", None)
    if isinstance(sock, socket.socket):
        try:
            socket.socket.shutdown(sock, socket.SHUT_RDWR)
        except OSError:
            pass  # already closed
