"""Who holds a session: the connections that used its token, the one that opened it, and its reaping.

A session nobody holds is reaped after the grace period (session_table.py:
`reap_timer`, then `reap_task`); a dump is committed only on the connection
that opened it (`opened`), so that connection's hang-up cancels it at once.
"""
from __future__ import annotations

import asyncio
import weakref
from collections.abc import Iterator


class Holders:
    """The connections holding one session, its opener, and the timer and task that reap it."""

    def __init__(self) -> None:
        self.conns: set[object] = set()
        # the connection that opened it; weak: no cycle through the connection's `sessions`, which the daemon's
        # garbage collection policy would leave to full collections
        self.opener: weakref.ref[object] | None = None
        self.reap_timer: asyncio.TimerHandle | None = None  # set while nobody holds it (the grace period)
        self.reap_task: asyncio.Task[None] | None = None    # its close, once the grace period is over
        self.let_go_at = 0.0  # the loop's time when nobody held it any more (while reap_timer is set)

    def __len__(self) -> int:
        return len(self.conns)

    def __iter__(self) -> Iterator[object]:
        return iter(self.conns)

    def add(self, conn: object) -> None:
        """`conn` holds the session now: no reaping while it does."""
        self.conns.add(conn)
        self.stop_timer()

    def discard(self, conn: object) -> None:
        self.conns.discard(conn)

    def clear(self) -> None:
        """Nobody holds it any more, and no timer will reap it (it is being reaped)."""
        self.conns.clear()
        self.stop_timer()

    def stop_timer(self) -> None:
        if self.reap_timer is not None:
            self.reap_timer.cancel()
            self.reap_timer = None

    def opened_by(self, conn: object) -> None:
        self.opener = weakref.ref(conn)

    def opened(self, conn: object) -> bool:
        """Whether `conn` opened the session."""
        return self.opener is not None and self.opener() is conn
