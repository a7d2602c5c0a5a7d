"""Following a session to its end with progress on screen: one loop, for vramctl (a tqdm bar) and the demo (lines)."""
from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Any

from ..client import Client
from ..pb import rpc_pb2 as rpc
from ..units import format_size

Show = Callable[[rpc.Progress], None]


def follow(client: Client, token: str, show: Show | None = None,
           interval: float = 0.2) -> tuple[rpc.SessionInfo, float]:
    """Wait for the session, calling `show` with its progress every `interval` seconds.

    Returns (final info, seconds waited); raises the session's typed error.
    Without `show` it is one Wait, no polling.
    """
    t0 = time.perf_counter()
    if show is None:
        return client.wait(token), time.perf_counter() - t0
    info = None
    for info in client.poll(token, interval):
        show(info.progress)
    assert info is not None  # poll yields at least the final info
    return info, time.perf_counter() - t0


class Bar:
    """A tqdm progress bar on stderr (vramctl on a TTY)."""

    def __init__(self, what: str) -> None:
        from tqdm import tqdm
        self.bar: Any = tqdm(total=0, unit="B", unit_scale=True, unit_divisor=1000, desc=what, file=sys.stderr,
                             leave=True)

    def __call__(self, p: rpc.Progress) -> None:
        self.bar.total = p.bytes_total
        self.bar.n = p.bytes_done
        self.bar.refresh()

    def close(self) -> None:
        self.bar.close()


class Lines:
    """Progress as text on stderr: one live line on a TTY, else a line a second (the demo)."""

    def __init__(self, label: str) -> None:
        self.label = label
        self.tty = sys.stderr.isatty()
        self.last, self.shown = 0.0, -1

    def __call__(self, p: rpc.Progress) -> None:
        now = time.perf_counter()
        if p.bytes_done != self.shown and (self.tty or now - self.last >= 1.0 or p.bytes_done == p.bytes_total):
            self.last, self.shown = now, p.bytes_done
            pct = 100 * p.bytes_done / max(1, p.bytes_total)
            line = f"{self.label}: {pct:5.1f}%  {format_size(p.bytes_done)} / {format_size(p.bytes_total)}"
            print(("\r" + line) if self.tty else line, end="" if self.tty else "\n", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.tty:
            print(file=sys.stderr)
