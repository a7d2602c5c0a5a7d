"""Format v2's chunk table, as a dump builds it: content-addressed records, shared by every chunk that holds them.

A dump hashes each non-zero chunk (BLAKE3-256 of its raw bytes) and asks the
index whether the bytes are stored already: by another chunk of this image
(dedup across BOs, GPUs and processes), or by a parent image (incremental).
Only the first chunk to `claim` a hash stores a record; the others refer to
it.  A claim is decided at once, without waiting for the record to land: the
references are resolved when the manifest is built (`ChunkIndex.table`),
after every record landed; a record that never lands fails the whole dump
(an image is all or nothing), so no reference can dangle.

Thread-safe: copy threads, CPU workers and the event loop all call it.  No I/O.
"""
from __future__ import annotations

import threading
from typing import NamedTuple

from ..errors import JobError
from ..pb import image_pb2 as pb
from .format import HASH_LEN
from .manifest import TableView, fill

# What `claim` answers: store a record; refer to one of this image; refer to a parent's.
STORE, DUP, PARENT = "store", "dup", "parent"


class Entry(NamedTuple):
    """A record some chunk table lists: where it is, what it holds.  (A named tuple: one is made per
    record a dump stores, on the event loop, and is a key of the table's index; a frozen dataclass
    took 2.4 µs to make and 0.44 µs to hash, this 0.7 and 0.17.)"""

    image: int          # 0: the image being written; k: its parents[k - 1]
    file_index: int
    offset: int
    length: int
    record_checksum: int
    raw_length: int
    chash: bytes
    base: bytes = b""   # a delta record: its base chunk's content hash


# hash -> a record holding the bytes; hash -> such a record that is no delta (what a delta's base may be)
ParentEntries = tuple[dict[bytes, Entry], dict[bytes, Entry]]


def parent_entries(manifest: pb.Manifest, depth: int) -> ParentEntries:
    """A parent image's records by content hash, its images renumbered by `depth` (see ChunkIndex.add_parent).
    Pure: may run in any thread."""
    t = TableView(manifest.chunks)
    stored: dict[bytes, Entry] = {}
    plain: dict[bytes, Entry] = {}
    for i in range(len(t)):
        h = t.hash(i)
        base = t.hash(t.base[i] - 1) if t.base[i] else b""
        e = Entry(t.image[i] + depth, t.file_index[i], t.offset[i], t.length[i], t.record_checksum[i],
                  t.raw_length[i], h, base)
        stored.setdefault(h, e)
        if not base:  # a parent dumped without dedup may hold the same bytes as a delta and plainly
            plain.setdefault(h, e)
    return stored, plain


class ChunkIndex:
    def __init__(self, *, dedup: bool = True) -> None:
        self.dedup = dedup
        self._lock = threading.Lock()
        self._claimed: set[bytes] = set()    # hashes this image stores (or is storing) a record for
        self._stored: dict[bytes, Entry] = {}  # hash -> the record that holds it (this image's or a parent's)
        self._own: list[Entry] = []          # every record this image stored, in landing order
        self._plain: dict[bytes, Entry] = {}  # hash -> a record holding the bytes that is no delta (a base)

    def add_parent(self, manifest: pb.Manifest, depth: int) -> None:
        """Make a parent image's records referable: `depth` 1 is the parent, 2 its parent, ...

        Its own table's images are renumbered by `depth` (its parent k is our k + depth)."""
        self.adopt(parent_entries(manifest, depth))

    def adopt(self, entries: ParentEntries) -> None:
        """A parent's records, as `parent_entries` found them (in a worker thread: they grow with the parent)."""
        stored, plain = entries
        with self._lock:
            if not self._stored and not self._plain:  # a new index: a copy at C speed
                self._stored, self._plain = dict(stored), dict(plain)
                return
            for h, e in stored.items():
                self._stored.setdefault(h, e)
            for h, e in plain.items():
                self._plain.setdefault(h, e)

    def parent_entry(self, chash: bytes) -> Entry | None:
        """The parent record holding these bytes, if the parent chain has them."""
        with self._lock:
            e = self._stored.get(chash)
        return e if e is not None and e.image > 0 else None

    def claim(self, chash: bytes) -> str:
        """STORE: the caller stores a record for these bytes.  DUP / PARENT: they are stored (or being
        stored) already, by this image / by a parent; the chunk refers to that record."""
        with self._lock:
            known = self._stored.get(chash)
            if known is not None and known.image > 0:
                return PARENT
            if chash in self._claimed and self.dedup:
                return DUP
            self._claimed.add(chash)
            return STORE

    def stored(self, entry: Entry) -> int:
        """A record of this image landed; returns its number (what a chunk that stored it refers to)."""
        with self._lock:
            self._own.append(entry)
            self._stored.setdefault(entry.chash, entry)
            if not entry.base:
                self._plain.setdefault(entry.chash, entry)
            return len(self._own) - 1

    def table(self, chunk_refs: list[list[tuple[int, bytes]]]) -> tuple[pb.ChunkTable, list[list[int]]]:
        """The manifest's chunk table and each BO's chunk_refs, once every record landed.

        `chunk_refs[b]`, per BO, per chunk: (own record number, hash): a record number >= 0 for a chunk
        that stored its own record, -1 for one that refers by hash, -2 for a hole (hash unused).
        """
        index: dict[Entry, int] = {}  # a record -> its table position
        entries: list[Entry] = []
        bases: list[int] = []

        def add(e: Entry, base: int) -> int:
            pos = index[e] = len(entries)
            entries.append(e)
            bases.append(base)
            return pos

        # Not recursive (a base is never a delta itself), and no closure that refers to itself: such a
        # function is a reference cycle, which would keep the whole index alive until a full collection.
        def put(e: Entry) -> int:
            pos = index.get(e)
            if pos is not None:
                return pos
            base = 0
            if e.base:
                b = self._plain.get(e.base)  # a base is never a delta
                if b is None:
                    raise JobError("internal error: a delta record's base is in no table")
                at = index.get(b)
                base = (add(b, 0) if at is None else at) + 1
            return add(e, base)

        refs: list[list[int]] = []
        with self._lock:
            for bo in chunk_refs:
                r = []
                for own, chash in bo:
                    if own == -2:
                        r.append(0)
                    elif own >= 0:
                        r.append(put(self._own[own]) + 1)
                    else:
                        e = self._stored.get(chash)
                        if e is None:
                            raise JobError("internal error: a chunk refers to bytes no record holds")
                        r.append(put(e) + 1)
                refs.append(r)
        # a field filled a slice per call (one entry at a time is slow; one call for all holds the GIL long)
        out = pb.ChunkTable(hashes=b"".join(e.chash for e in entries))
        fill(out.image, [e.image for e in entries])
        fill(out.file_index, [e.file_index for e in entries])
        fill(out.offset, [e.offset for e in entries])
        fill(out.length, [e.length for e in entries])
        fill(out.record_checksum, [e.record_checksum for e in entries])
        fill(out.raw_length, [e.raw_length for e in entries])
        fill(out.base, bases)
        assert len(out.hashes) == HASH_LEN * len(entries)
        return out, refs
