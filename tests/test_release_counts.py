"""The daemon's release counts (vramd.engine.jobs.notes.record_counts): what a streamed session over a supply
socket holds per record of the image to tell its client which records no chunk reads again.

They were a dict of (data file, offset) -> [count, length], made through `locate`, which kept a Loc for every
table entry: about 410 bytes a record (tracemalloc, 1 M records), for every record of the manifest, per session,
up to 64 sessions per uid.  Now a few arrays per data file: the bound here fails the dict.  The counting itself
works on synthetic v2 manifests (no data file is read), whose chunk tables name the same bytes twice or list
records out of offset order where a test wants it.
"""
from __future__ import annotations

import tracemalloc

import pytest

from vramd.engine.jobs.notes import record_counts
from vramd.image.reader import ImageReader
from vramd.pb import image_pb2 as pb

CS = 4096
REC = CS + 64  # a record: its head and the chunk


def manifest(records: int, per_bo: int = 1000, files: int = 2, backwards: bool = False) -> pb.Manifest:
    """A v2 manifest of `records` records of its own, spread over `files` data files (entries alternate between
    them), each read by one chunk; BOs of `per_bo` chunks.  `backwards`: the table lists each file's records
    last first (a dump's lists them in the order its writers finished them)."""
    m = pb.Manifest(format_version=2, chunk_size=CS)
    for f in range(files):
        m.files.add(name=f"data-{f}.vrd", length=REC * (records // files + 1))
    t = m.chunks
    t.hashes = bytes(32 * records)
    t.image.extend([0] * records)
    t.file_index.extend(i % files for i in range(records))
    last = (records - 1) // files
    t.offset.extend(((last - i // files) if backwards else i // files) * REC for i in range(records))
    t.length.extend([REC] * records)
    t.record_checksum.extend([0] * records)
    t.raw_length.extend([CS] * records)
    t.base.extend([0] * records)
    for b in range(-(-records // per_bo)):
        refs = range(b * per_bo + 1, min(records, (b + 1) * per_bo) + 1)
        m.bos.add(id=b + 1, size=len(refs) * CS, chunk_refs=refs)
    return m


def retained(records: int, backwards: bool = False) -> tuple[int, int]:
    """(bytes the counts hold once made, the counting's peak), by tracemalloc, for `records` records."""
    reader = ImageReader(manifest(records, backwards=backwards))
    tracemalloc.start()
    try:
        counts = record_counts(reader, len(reader.manifest.files))
        held, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert counts is not None
    return held, peak


@pytest.mark.parametrize("backwards", [False, True])
def test_the_counts_hold_under_40_bytes_a_record(backwards: bool) -> None:
    """100,000 records: the dict (and the Loc locate kept for every entry) held over 400 bytes each; the arrays
    hold 16, and a table out of offset order costs a sort for the time it takes."""
    n = 100_000
    held, peak = retained(n, backwards)
    assert held < 40 * n, f"{held / n:.1f} bytes a record"
    assert peak < 100 * n, f"{peak / n:.1f} bytes a record at the peak"


def test_a_table_out_of_offset_order_is_counted_and_released_the_same() -> None:
    n = 3000
    for backwards in (False, True):
        reader = ImageReader(manifest(n, backwards=backwards))
        counts = record_counts(reader, 2)
        assert counts is not None
        got = sorted(counts.read(f, o) for f in (0, 1) for o in range(0, n // 2 * REC, REC))
        assert got == sorted((o, o + REC) for _f in (0, 1) for o in range(0, n // 2 * REC, REC))
        assert all(counts.read(f, o) is None for f in (0, 1) for o in range(0, n // 2 * REC, REC))


def test_two_table_entries_naming_the_same_bytes_are_one_record_released_once_both_are_read() -> None:
    """Entries 1 and 2 name the same record (file 0 at 0), entry 3 is a delta on entry 1's record, entry 4 is a
    parent's: the record at 0 is released only by the last of the three reads of it, once; a read of a record
    of a parent, or of one already released, releases nothing."""
    m = pb.Manifest(format_version=2, chunk_size=CS)
    m.files.add(name="data-0.vrd", length=4 * REC)
    m.parents.add(image_id=b"p" * 16)
    t = m.chunks
    t.hashes = bytes(32 * 4)
    t.image.extend([0, 0, 0, 1])
    t.file_index.extend([0, 0, 0, 0])
    t.offset.extend([0, 0, REC, 0])
    t.length.extend([REC, REC, 100, REC])
    t.record_checksum.extend([0] * 4)
    t.raw_length.extend([CS] * 4)
    t.base.extend([0, 0, 1, 0])
    m.bos.add(id=1, size=4 * CS, chunk_refs=[1, 2, 3, 4])
    parent = pb.Manifest(format_version=2, chunk_size=CS)
    parent.files.add(name="data-p.vrd", length=REC)
    counts = record_counts(ImageReader(m, parents=[parent]), 1)
    assert counts is not None
    assert counts.read(0, REC) == (REC, REC + 100)  # the delta: read once
    assert counts.read(0, 0) is None
    assert counts.read(0, 0) is None
    assert counts.read(0, 0) == (0, REC)  # entry 1, entry 2, and entry 3's base
    assert counts.read(0, 0) is None
    assert counts.read(1, 0) is None  # a parent's slot: never counted
    assert counts.read(0, 7) is None  # no record there


def test_counting_stops_when_the_session_does() -> None:
    reader = ImageReader(manifest(20_000))
    asked = []
    assert record_counts(reader, 2, lambda: asked.append(1) is None) is None
    assert len(asked) == 1


def test_a_format_v1_image_counts_each_bos_records() -> None:
    """v1 keeps each BO's records in its entry (no table): BO 2 names BO 1's second record again."""
    m = pb.Manifest(format_version=1, chunk_size=CS)
    m.files.add(name="data-0.vrd", length=3 * REC)
    m.bos.add(id=1, size=2 * CS, file_index=0, record_offsets=[0, REC], record_lengths=[REC, REC])
    m.bos.add(id=2, size=2 * CS, file_index=0, record_offsets=[2 * REC, REC], record_lengths=[REC, REC])
    counts = record_counts(ImageReader(m), 1)
    assert counts is not None
    assert counts.read(0, REC) is None
    assert counts.read(0, REC) == (REC, 2 * REC)
    assert counts.read(0, 0) == (0, REC)
    assert counts.read(0, 2 * REC) == (2 * REC, 3 * REC)
