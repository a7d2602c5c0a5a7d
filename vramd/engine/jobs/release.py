"""A streamed session's release counts (notes.py): per record of the image's own data files, how many chunks of
the manifest still read it.

Compact, since a session holds them for its whole life, up to 64 sessions a uid: per data file three arrays in
offset order, the records' offsets (8 bytes), lengths (4) and counts (4), 16 bytes a record where a dict of
(file, offset) -> [count, length] held about 170 and the `Loc` that `ImageReader.locate` made and kept for every
entry of the chunk table about 240 more (tracemalloc, docs/engine.md).  A record is found by its offset
(bisect), so two table entries that name the same bytes (the same file and offset) are one record: counted
by the reads through both, released once.  The counting walks the chunk table's plain lists, never `locate`.
"""
from __future__ import annotations

from array import array
from bisect import bisect_left
from collections.abc import Callable, Iterator

from ...image.manifest import bo_chunk_count, chunk_record
from ...image.reader import ImageReader

_STEP = 4096  # chunks counted between two looks at whether the session stopped


class Stopped(Exception):
    """The session stopped while its counts were made."""


class ReleaseCounts:
    """Per data file of the image (`files` of them): its records' offsets (sorted, distinct), lengths, counts."""

    def __init__(self, records: list[tuple[array[int], array[int]]]) -> None:
        self._offsets: list[array[int]] = []
        self._lengths: list[array[int]] = []
        for offsets, lengths in records:
            if any(offsets[i] >= offsets[i + 1] for i in range(len(offsets) - 1)):  # not in order, or twice
                offsets, lengths = _sorted(offsets, lengths)
            self._offsets.append(offsets)
            self._lengths.append(lengths)
        self._counts = [array("I", bytes(4 * len(o))) for o in self._offsets]

    def _find(self, slot: int, offset: int) -> int:
        """The record of data file `slot` at `offset`'s index; -1 where there is none."""
        if slot >= len(self._offsets):  # a parent's file: never streamed, never released
            return -1
        offsets = self._offsets[slot]
        i = bisect_left(offsets, offset)
        return i if i < len(offsets) and offsets[i] == offset else -1

    def count(self, slot: int, offset: int) -> None:
        i = self._find(slot, offset)
        if i >= 0:
            self._counts[slot][i] += 1

    def read(self, slot: int, offset: int) -> tuple[int, int] | None:
        """A chunk read the record at `offset` of data file `slot`: its range [start, end) if no chunk reads it
        again (once), else None."""
        i = self._find(slot, offset)
        if i < 0:
            return None
        counts = self._counts[slot]
        c = counts[i]
        if c == 0:  # released already, or never counted
            return None
        counts[i] = c - 1
        return (offset, offset + self._lengths[slot][i]) if c == 1 else None

    @property
    def nbytes(self) -> int:
        """What the arrays hold."""
        return sum(a.itemsize * len(a) for arrays in (self._offsets, self._lengths, self._counts) for a in arrays)


def _sorted(offsets: array[int], lengths: array[int]) -> tuple[array[int], array[int]]:
    """The records in offset order, each offset once (with the longest length it was given).  A dump's table is
    in the order its writers finished records, interleaved: sorted as one int a record (offset above the
    32-bit length), about 45 bytes a record for the time of the sort."""
    keyed = sorted((o << 32) | n for o, n in zip(offsets, lengths))
    out_o, out_n = array("Q"), array("I")
    for k in keyed:
        o = k >> 32
        if out_o and out_o[-1] == o:  # (sorted: the later one is the longer)
            out_n[-1] = k & 0xFFFFFFFF
        else:
            out_o.append(o)
            out_n.append(k & 0xFFFFFFFF)
    return out_o, out_n


def _reads(reader: ImageReader, stopped: Callable[[], bool]) -> Iterator[tuple[int, int]]:
    """(data file slot, offset) of every record every chunk of every BO of the manifest reads (a delta's base
    too), parents' included; raises Stopped once `stopped()` (asked every _STEP chunks)."""
    m = reader.manifest
    n = 0
    v2 = m.format_version >= 2
    t = reader.table
    image, file_index, offset, base = t.image, t.file_index, t.offset, t.base
    for e in m.bos:
        for i in range(bo_chunk_count(m, e)):
            n += 1
            if n % _STEP == 0 and stopped():
                raise Stopped
            if not v2:
                rec = chunk_record(m, e, i)
                assert rec is not None  # (a v1 hole is a record)
                yield rec[0], rec[1]
                continue
            k = e.chunk_refs[i] - 1
            while k >= 0:
                if image[k] == 0:  # the image's own: its file index is its slot (parents' come after)
                    yield file_index[k], offset[k]
                k = base[k] - 1


def _records(reader: ImageReader, files: int) -> list[tuple[array[int], array[int]]]:
    """Per data file of the image's own (`files`): (offsets, lengths) of its records, in the chunk table's order
    (v1: the BOs')."""
    m = reader.manifest
    out = [(array("Q"), array("I")) for _ in range(files)]
    if m.format_version >= 2:
        t = reader.table
        for img, fi, o, n in zip(t.image, t.file_index, t.offset, t.length):
            if img == 0 and fi < files:
                out[fi][0].append(o)
                out[fi][1].append(n)
    else:
        for e in m.bos:
            if e.file_index < files:
                out[e.file_index][0].extend(e.record_offsets)
                out[e.file_index][1].extend(e.record_lengths)
    return out


def record_counts(reader: ImageReader, files: int, stopped: Callable[[], bool] = lambda: False) -> ReleaseCounts | None:
    """The counts of every record of the image's own `files` data files, over every BO of the manifest; None once
    `stopped()` (asked every _STEP chunks).  Work that grows with the manifest: a thread's."""
    counts = ReleaseCounts(_records(reader, files))
    try:
        for slot, offset in _reads(reader, stopped):
            counts.count(slot, offset)
    except Stopped:
        return None
    return counts
