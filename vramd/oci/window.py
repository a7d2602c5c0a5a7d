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
blobs a WAITING asked for, in blob order up to the last one the waited-for end needs: so resident bytes stay
within the window plus what deduplicated records (read by a later chunk) pin.  `peak` is their most.
"""
from __future__ import annotations

import bisect
import ctypes
import ctypes.util
import os
import threading
from dataclasses import dataclass

from ..image.supply import Intervals, Note, NoteKind, punch_span
from .layout import LITERAL, PAYLOAD, ZEROS, Skeleton

_FALLOC_FL_KEEP_SIZE, _FALLOC_FL_PUNCH_HOLE = 1, 2
_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
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

    def to_dict(self) -> dict[str, int]:
        return {"window": self.window, "peak_resident": self.peak, "blobs_past_window": self.beyond,
                "waiting_notes": self.waited, "released_notes": self.released, "punched_bytes": self.punched}


class _File:
    """One data file's runs, for the arithmetic: where each starts, the non-zero bytes before it, and the last
    blob (in download order) that any run up to it needs."""

    def __init__(self, sk: Skeleton, fi: int, rank: dict[int, int]) -> None:
        self.starts: list[int] = []
        self.nonzero: list[int] = []  # before each run
        self.zero: list[bool] = []
        self.last_blob: list[int] = []  # the highest rank of a payload run up to and including each
        pos = nz = 0
        last = -1
        for s in sk.files[fi].segments:
            self.starts.append(pos)
            self.nonzero.append(nz)
            self.zero.append(s.kind == ZEROS)
            if s.kind == PAYLOAD:
                last = max(last, rank[s.blob])
            self.last_blob.append(last)
            pos += s.length
            nz += 0 if s.kind == ZEROS else s.length
        self.length, self.total_nonzero = pos, nz
        self.released = Intervals()

    def nonzero_before(self, x: int) -> int:
        if x >= self.length:
            return self.total_nonzero
        j = bisect.bisect_right(self.starts, x) - 1
        return self.nonzero[j] + (0 if self.zero[j] else x - self.starts[j])

    def needs_up_to(self, end: int) -> int:
        """The highest rank of a blob a run below `end` holds (-1: none)."""
        j = bisect.bisect_left(self.starts, end) - 1
        return self.last_blob[j] if j >= 0 else -1


class Window:
    """The blobs' start order under a window of `limit` bytes (None: no window, only holes punched)."""

    def __init__(self, sk: Skeleton, order: list[int], charges: dict[int, int], limit: int | None,
                 concurrency: int) -> None:
        self.order = order
        self.charges = charges
        rank = {k: i for i, k in enumerate(order)}
        self.files = [_File(sk, fi, rank) for fi in range(len(sk.files))]
        floor = concurrency * max(charges.values(), default=0)
        self.limit = None if limit is None else max(limit, floor)
        self.stats = WindowStats(self.limit or 0)
        self.stats.resident = sum(s.length for f in sk.files for s in f.segments if s.kind == LITERAL)
        self.stats.peak = self.stats.resident
        self.fds: list[int] = []
        self.block = 4096
        self._cursor = 0
        self._allow = -1  # the highest rank a WAITING let start whatever the window
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
        """Whether the next blob may start now (or none is left)."""
        with self._cond:
            if self._cursor >= len(self.order):
                return True
            return self._fits() or self._cursor <= self._allow

    def _fits(self) -> bool:
        k = self.order[self._cursor]
        return self.limit is None or self._unbound or self.stats.resident + self.charges[k] <= self.limit

    def next_blob(self) -> int | None:
        """The next blob to download, once the window lets it start; None once none is left or stopped."""
        with self._cond:
            while not self._stopped and self._cursor < len(self.order):
                k = self.order[self._cursor]
                st = self.stats
                fits = self._fits()
                if fits or self._cursor <= self._allow:
                    if not fits:
                        st.beyond += 1
                    self._cursor += 1
                    st.resident += self.charges[k]
                    st.peak = max(st.peak, st.resident)
                    return k
                self._cond.wait()
            return None

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
                allow = self.files[n.file].needs_up_to(n.end)
                if allow > self._allow:
                    self._allow = allow
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
                    self.punch_error = e.strerror or str(e)
                    return
                done = span[1]
                with self._cond:
                    self.stats.punched += span[1] - a
