"""A streamed `--no-cache` restore's bounded download window, and the holes it punches (#35).

The daemon's notes over the supply socket (vramd.image.supply) drive it: RELEASED ranges are freed from the
data files (fallocate PUNCH_HOLE | KEEP_SIZE over the whole filesystem blocks that lie inside what is
released, per file an interval set of it, so a block that still holds a byte of a record a chunk will read is
never freed), and a blob starts only while the resident bytes stay within the window, unless a chunk WAITING
at the daemon's gate needs it.

Resident bytes, as counted here: the literal runs written at creation, plus every place of each blob started
(charged in full when it starts, before a byte of it is written), less the released bytes that lay in literal
or payload runs (zero runs are holes: never counted).  They bound what the data files occupy, the part of a
block a hole cannot be punched in aside (at most a block per record boundary).  Past the window go only
the blobs a WAITING needs (those of the file's runs below the end it names not started yet), before any
other: so resident bytes stay within the window, plus what deduplicated records (read by a later chunk) pin,
plus what the chunks held at the daemon's gate wait for.  `peak` is their most.
"""
from __future__ import annotations

import bisect
import collections
import ctypes
import os
import threading
from dataclasses import dataclass

from ..image.supply import Intervals, Note, NoteKind, punch_span
from .layout import LITERAL, PAYLOAD, ZEROS, Skeleton

_FALLOC_FL_KEEP_SIZE, _FALLOC_FL_PUNCH_HOLE = 1, 2
_libc = ctypes.CDLL(None, use_errno=True)  # the process's own libc (find_library ran ldconfig at every import)
_libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]


def punch_hole(fd: int, offset: int, length: int) -> None:
    """Free [offset, offset + length) of the file (it reads as zeros; its length stays)."""
    if _libc.fallocate(fd, _FALLOC_FL_PUNCH_HOLE | _FALLOC_FL_KEEP_SIZE, offset, length) != 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e))


@dataclass
class WindowStats:
    window: int  # bytes (raised to concurrency x the largest blob's places where it was less)
    peak: int = 0  # the most resident bytes
    resident: int = 0
    beyond: int = 0  # blobs started past the window because a chunk waited for them
    waited: int = 0  # WAITING notes
    released: int = 0  # RELEASED notes
    punched: int = 0  # bytes freed (whole blocks)
    allocated: int = 0  # the most the data files occupied (st_blocks), sampled as each blob ends
    punch_error: str | None = None  # why no hole could be punched (a file system without them): nothing was freed

    def to_dict(self) -> dict[str, int]:
        return {"window": self.window, "peak_resident": self.peak, "blobs_past_window": self.beyond,
                "waiting_notes": self.waited, "released_notes": self.released, "punched_bytes": self.punched,
                "peak_allocated": self.allocated}


class _File:
    """One data file's runs, for the arithmetic: where each starts, the non-zero bytes before it; its payload
    runs in file order, and how many of them a WAITING looked at (each one before that is started or urgent)."""

    def __init__(self, sk: Skeleton, fi: int) -> None:
        self.starts: list[int] = []
        self.nonzero: list[int] = []  # before each run
        self.zero: list[bool] = []
        self.payload: list[tuple[int, int]] = []  # (start, blob)
        self.scanned = 0
        pos = nz = 0
        for s in sk.files[fi].segments:
            self.starts.append(pos)
            self.nonzero.append(nz)
            self.zero.append(s.kind == ZEROS)
            if s.kind == PAYLOAD:
                self.payload.append((pos, s.blob))
            pos += s.length
            nz += 0 if s.kind == ZEROS else s.length
        self.length, self.total_nonzero = pos, nz
        # zero runs (a record's padding: holes, never written) count as released from the start, so that a block
        # a record shares with padding is freed with the record
        self.released = Intervals()
        for start, zero, end in zip(self.starts, self.zero, [*self.starts[1:], pos], strict=True):
            if zero and start < end:
                self.released.add(start, end)

    def nonzero_before(self, x: int) -> int:
        if x >= self.length:
            return self.total_nonzero
        j = bisect.bisect_right(self.starts, x) - 1
        return self.nonzero[j] + (0 if self.zero[j] else x - self.starts[j])

    def needed(self, end: int) -> list[int]:
        """The blobs of the runs below `end` not looked at by an earlier call."""
        out = []
        while self.scanned < len(self.payload) and self.payload[self.scanned][0] < end:
            out.append(self.payload[self.scanned][1])
            self.scanned += 1
        return out


class Window:
    """The blobs' start order under a window of `limit` bytes (None: no window, only holes punched)."""

    def __init__(self, sk: Skeleton, order: list[int], charges: dict[int, int], limit: int | None,
                 concurrency: int) -> None:
        self.order = order
        self.charges = charges
        self.files = [_File(sk, fi) for fi in range(len(sk.files))]
        floor = concurrency * max(charges.values(), default=0)
        self.limit = None if limit is None else max(limit, floor)
        self.stats = WindowStats(self.limit or 0)
        self.stats.resident = sum(s.length for f in sk.files for s in f.segments if s.kind == LITERAL)
        self.stats.peak = self.stats.resident
        self.fds: list[int] = []
        self.block = 4096
        self._cursor = 0
        self._started = [False] * len(sk.blobs)
        self._urgent: collections.deque[int] = collections.deque()  # blobs a WAITING needs: next, past the window
        self._stopped = False
        self._unbound = False
        self.punch_error: str | None = None  # what stopped the punching (a file system without holes)
        self._cond = threading.Condition()

    def attach(self, fds: list[int]) -> None:
        """The data files, created (holes are punched in them)."""
        self.fds = fds
        if fds:
            self.block = max(512, os.fstat(fds[0]).st_blksize)

    def ready(self) -> bool:
        """Whether a blob may start now (or none is left)."""
        with self._cond:
            return self._pick() is not None or self._cursor >= len(self.order)

    def _pick(self) -> tuple[int, bool] | None:
        """The blob to start now and whether it is urgent, or None (the window is full); skips what started."""
        while self._urgent and self._started[self._urgent[0]]:
            self._urgent.popleft()
        if self._urgent:
            return self._urgent[0], True
        while self._cursor < len(self.order) and self._started[self.order[self._cursor]]:
            self._cursor += 1
        if self._cursor >= len(self.order):
            return None
        k = self.order[self._cursor]
        if self.limit is None or self._unbound or self.stats.resident + self.charges[k] <= self.limit:
            return k, False
        return None

    def next_blob(self) -> int | None:
        """The next blob to download, once the window lets it start (a blob a WAITING needs first, whatever the
        window); None once none is left or stopped."""
        with self._cond:
            while not self._stopped:
                pick = self._pick()
                if pick is None:
                    if self._cursor >= len(self.order):
                        return None
                    self._cond.wait()
                    continue
                k, urgent = pick
                st = self.stats
                if urgent and self.limit is not None and st.resident + self.charges[k] > self.limit:
                    st.beyond += 1
                self._started[k] = True
                st.resident += self.charges[k]
                st.peak = max(st.peak, st.resident)
                return k
            return None

    def sample(self) -> None:
        """What the data files occupy now (a blob just ended: its bytes are all written), for `allocated`: only
        where a window bounds them (the stats are reported only then)."""
        if self.limit is None:
            return
        used = sum(os.fstat(fd).st_blocks * 512 for fd in self.fds)
        with self._cond:
            self.stats.allocated = max(self.stats.allocated, used)

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify_all()

    def unbound(self) -> None:
        """No note comes any more: every blob left may start."""
        with self._cond:
            self._unbound = True
            self._cond.notify_all()

    def note(self, n: Note) -> None:
        """A note of the daemon's (in the thread that reads them)."""
        if n.kind == NoteKind.WAITING:
            with self._cond:
                self.stats.waited += 1
                more = [k for k in self.files[n.file].needed(n.end) if not self._started[k]]
                if more:
                    self._urgent.extend(more)
                    self._cond.notify_all()
        elif n.kind == NoteKind.RELEASED and n.start < n.end:
            self._release(n.file, n.start, n.end)

    def _release(self, fi: int, start: int, end: int) -> None:
        f = self.files[fi]
        with self._cond:
            self.stats.released += 1
            old = f.released.within(start, end)
            gaps, pos = [], start
            for s, e in [*old, (end, end)]:  # the parts of [start, end) not released before
                if s > pos:
                    gaps.append((pos, min(s, end)))
                pos = max(pos, e)
            lo, hi, _new = f.released.add(start, end)
            self.stats.resident -= sum(f.nonzero_before(b) - f.nonzero_before(a) for a, b in gaps)
            self._cond.notify_all()
        done = 0
        for gap in gaps:
            span = punch_span((lo, hi), gap, self.block)
            if span is not None and self.fds and span[1] > done and self.punch_error is None:
                a = max(span[0], done)
                try:
                    punch_hole(self.fds[fi], a, span[1] - a)
                except OSError as e:  # EOPNOTSUPP: the files keep what was read; the restore goes on
                    self.punch_error = self.stats.punch_error = e.strerror or str(e)
                    return
                done = span[1]
                with self._cond:
                    self.stats.punched += span[1] - a
