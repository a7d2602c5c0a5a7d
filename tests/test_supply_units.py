"""vramd.image.supply: the streamed restore's supply messages and notes, encoded and checked (pure functions); the
daemon's notes (vramd.engine.jobs.notes) and the client's window (vramd.oci.window) over real sockets and files."""
import struct

import pytest

from vramd.image.supply import MESSAGE_SIZE, SupplyDecoder, SupplyError, encode


def test_advances_come_out_once_each_and_partial_messages_wait_for_their_rest() -> None:
    d = SupplyDecoder([100, 200])
    data = encode(0, 10) + encode(1, 50) + encode(0, 10) + encode(0, 100)
    out = list(d.feed(data[:MESSAGE_SIZE + 3]))
    assert out == [(0, 10)]
    assert list(d.feed(data[MESSAGE_SIZE + 3:])) == [(1, 50), (0, 100)]
    assert d.ends == [100, 50]
    d.finish()


@pytest.mark.parametrize("msg, words", [
    (encode(2, 1), "data file #2: the image has 2"),
    (encode(0, 101), "past its length"),
    (bytes(4) + b"\x01" + bytes(11), "reserved field"),
])
def test_a_message_no_client_sends_is_refused(msg: bytes, words: str) -> None:
    with pytest.raises(SupplyError, match=words):
        list(SupplyDecoder([100, 200]).feed(msg))


def test_an_end_never_goes_back_and_a_cut_message_is_refused_at_the_end() -> None:
    d = SupplyDecoder([100])
    list(d.feed(encode(0, 50)))
    with pytest.raises(SupplyError, match="goes back"):
        list(d.feed(encode(0, 40)))
    d = SupplyDecoder([100])
    list(d.feed(encode(0, 50)[:5]))
    with pytest.raises(SupplyError, match="inside a message"):
        d.finish()


def test_a_bad_message_is_numbered_from_the_pipes_start() -> None:
    d = SupplyDecoder([100])
    list(d.feed(encode(0, 10) + encode(0, 20)))
    with pytest.raises(SupplyError, match=r"supply message #3: reserved field 0x1 is not 0"):
        list(d.feed(encode(0, 30)[:4] + b"\x01" + bytes(11)))


# --- the daemon's notes back (a supply socket), and the arithmetic of releasing and punching ---------------------

def test_notes_decode_in_pieces_and_an_unknown_kind_is_skipped() -> None:
    from vramd.image.supply import NOTE_SIZE, Note, NoteDecoder, NoteKind, encode_note
    data = (encode_note(NoteKind.RELEASED, 1, 10, 20) + struct.pack("<IIQQ", 9, 0, 0, 5)
            + encode_note(NoteKind.WAITING, 0, 0, 100))
    d = NoteDecoder([100, 200])
    assert list(d.feed(data[:NOTE_SIZE + 7])) == [Note(NoteKind.RELEASED, 1, 10, 20)]
    assert list(d.feed(data[NOTE_SIZE + 7:])) == [Note(NoteKind.WAITING, 0, 0, 100)]


@pytest.mark.parametrize("note, words", [
    (struct.pack("<IIQQ", 1, 2, 0, 1), "the image has 2"),
    (struct.pack("<IIQQ", 1, 0, 0, 101), "not within its length"),
    (struct.pack("<IIQQ", 1, 0, 50, 40), "not within its length"),
])
def test_a_note_no_daemon_sends_is_refused(note: bytes, words: str) -> None:
    from vramd.image.supply import NoteDecoder
    with pytest.raises(SupplyError, match=words):
        list(NoteDecoder([100, 200]).feed(note))


def test_intervals_merge_what_touches_and_count_only_new_bytes() -> None:
    from vramd.image.supply import Intervals
    iv = Intervals()
    assert iv.add(10, 20) == (10, 20, 10)
    assert iv.add(30, 40) == (30, 40, 10)
    assert iv.add(15, 35) == (10, 40, 10)  # bridges both: 10 new bytes (20-30)
    assert iv.add(40, 41) == (10, 41, 1)  # adjacent: merged
    assert iv.add(0, 5) == (0, 5, 5) and len(iv) == 2
    assert iv.within(4, 11) == [(0, 5), (10, 41)] and iv.within(5, 10) == []
    assert iv.add(12, 13) == (10, 41, 0) and iv.total() == 36


@pytest.mark.parametrize("merged, new, span", [
    ((0, 8192), (4000, 8192), (0, 8192)),  # the first block completes only with the new part
    ((100, 9000), (100, 9000), (4096, 8192)),  # the blocks holding 0-99 and 9000- are not all released
    ((0, 12288), (8192, 12288), (8192, 12288)),  # blocks 0-8191 were whole before: freed then, not again
    ((5000, 6000), (5000, 6000), None),  # inside one block
])
def test_only_whole_released_blocks_touching_the_new_range_are_punched(merged, new, span) -> None:
    from vramd.image.supply import punch_span
    assert punch_span(merged, new, 4096) == span


def _window(limit: int | None):
    from vramd.oci.layout import LITERAL, PAYLOAD, ZEROS, FileSkeleton, Segment, Skeleton
    from vramd.oci.window import Window
    # file 0: 100 literal, blob 0 (1000), 500 zeros, blob 1 (1000), blob 0 again (1000: a second place)
    segs = (Segment(LITERAL, 100, b"h" * 100), Segment(PAYLOAD, 1000, blob=0), Segment(ZEROS, 500),
            Segment(PAYLOAD, 1000, blob=1), Segment(PAYLOAD, 1000, blob=0), Segment(PAYLOAD, 1000, blob=2))
    sk = Skeleton((("a", 1000), ("b", 1000), ("c", 1000)), (FileSkeleton("f", 4600, segs),))
    return Window(sk, [0, 1, 2], {0: 2000, 1: 1000, 2: 1000}, limit, 1)


def test_the_window_starts_a_blob_past_it_only_for_a_chunk_waiting_and_releases_free_resident_bytes() -> None:
    from vramd.image.supply import Note, NoteKind
    w = _window(2500)
    assert w.stats.resident == 100  # the literal run
    assert w.ready() and w.next_blob() == 0 and w.stats.resident == 2100  # both its places charged
    assert not w.ready()  # 2100 + 1000 > 2500
    w.note(Note(NoteKind.WAITING, 0, 0, 1600))  # up to the zeros: blob 0 only, started already
    assert not w.ready()
    w.note(Note(NoteKind.WAITING, 0, 0, 1601))  # into blob 1's run: it starts past the window
    assert w.ready() and w.next_blob() == 1
    assert w.stats.beyond == 1 and w.stats.resident == 3100 == w.stats.peak
    w.note(Note(NoteKind.RELEASED, 0, 100, 1600))  # blob 0's first place and the zeros: 1000 resident bytes
    assert w.stats.resident == 2100 and w.stats.released == 1
    w.note(Note(NoteKind.RELEASED, 0, 50, 1600))  # again, with 50 literal bytes: only those are new
    assert w.stats.resident == 2050 and not w.ready()
    w.note(Note(NoteKind.RELEASED, 0, 1600, 2600))  # blob 1's run
    assert w.stats.resident == 1050 and w.ready() and w.next_blob() == 2 and w.stats.beyond == 1
    assert w.next_blob() is None  # none left


def test_no_window_starts_every_blob_and_the_notes_ending_lifts_the_window() -> None:
    w = _window(None)
    assert [w.next_blob() for _ in range(4)] == [0, 1, 2, None] and w.stats.beyond == 0
    w = _window(2500)
    w.next_blob()
    assert not w.ready()
    w.unbound()  # the daemon's end closed: no WAITING can come any more
    assert w.ready() and w.next_blob() == 1 and w.stats.beyond == 0


def test_a_waiting_for_another_file_starts_its_blobs_first_not_every_blob_before_them() -> None:
    from vramd.image.supply import Note, NoteKind
    from vramd.oci.layout import PAYLOAD, FileSkeleton, Segment, Skeleton
    from vramd.oci.window import Window
    sk = Skeleton((("a", 1000), ("b", 1000), ("c", 1000)),
                  (FileSkeleton("f0", 2000, (Segment(PAYLOAD, 1000, blob=0), Segment(PAYLOAD, 1000, blob=1))),
                   FileSkeleton("f1", 1000, (Segment(PAYLOAD, 1000, blob=2),))))
    w = Window(sk, [0, 1, 2], {0: 1000, 1: 1000, 2: 1000}, 1000, 1)
    assert w.next_blob() == 0 and not w.ready()
    w.note(Note(NoteKind.WAITING, 1, 0, 1000))  # a chunk of the second file waits: its blob, not blob 1
    assert w.next_blob() == 2 and w.stats.beyond == 1 and not w.ready()
    w.note(Note(NoteKind.WAITING, 1, 0, 1000))  # again: nothing more is needed
    assert not w.ready()
    w.note(Note(NoteKind.RELEASED, 0, 0, 1000))
    w.note(Note(NoteKind.RELEASED, 1, 0, 1000))
    assert w.stats.resident == 0 and w.next_blob() == 1 and w.next_blob() is None


def test_a_records_zero_padding_goes_with_it_and_an_unreleased_neighbours_block_stays(tmp_path) -> None:
    """A real file: a record of 5000 bytes, its padding (a zero run) to 8192, the next record; releasing the first
    frees both blocks it spans (the second holds only it and padding), never a byte of the next record."""
    import os

    from vramd.image.supply import Note, NoteKind
    from vramd.oci.layout import PAYLOAD, ZEROS, FileSkeleton, Segment, Skeleton
    from vramd.oci.window import Window
    sk = Skeleton((("a", 5000), ("b", 4096)), (FileSkeleton("f", 12288, (
        Segment(PAYLOAD, 5000, blob=0), Segment(ZEROS, 3192), Segment(PAYLOAD, 4096, blob=1))),))
    path = tmp_path / "f"
    path.write_bytes(b"\x01" * 5000 + bytes(3192) + b"\x02" * 4096)
    fd = os.open(path, os.O_RDWR)
    try:
        w = Window(sk, [0, 1], {0: 5000, 1: 4096}, None, 1)
        w.attach([fd])
        w.block = 4096
        w.note(Note(NoteKind.RELEASED, 0, 0, 5000))
        assert w.stats.punched == 8192
        assert os.pread(fd, 12288, 0) == bytes(8192) + b"\x02" * 4096
    finally:
        os.close(fd)


def test_the_daemon_sends_each_released_range_once_whatever_order_records_are_released_in(tmp_path) -> None:
    """The daemon's Notes (vramd.engine.jobs.notes) over a real socketpair, on a real image's reader: 400 records
    of 4 KiB; every other one released first (200 ranges apart), then, a loop turn each, one at each end of what
    is left.  Sending the released intervals a note's range fell in (as the daemon once did) sent those in
    between again each turn: 10,200 notes for 400 records (a loop's CPU a client could multiply); each range is
    sent once: at most one note per record, and their union is every record."""
    import asyncio
    import os
    import socket

    from helpers import open_dir, run

    from vramd import inproc
    from vramd.backends import BoRef
    from vramd.engine import BoSpec, Engine, EngineConfig
    from vramd.engine.jobs.notes import Notes
    from vramd.engine.pipeline import ChunkTask
    from vramd.image.names import MANIFEST_NAME
    from vramd.image.reader import ImageReader
    from vramd.image.supply import NOTE_SIZE, Intervals, NoteDecoder, NoteKind

    n, cs = 400, 4096
    src = os.memfd_create("bo")
    os.write(src, os.urandom(n * cs))
    dfd = open_dir(tmp_path)
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    ours.setblocking(False)

    async def go() -> tuple[int, list[tuple[int, int]], list[tuple[int, int]]]:
        async with Engine(EngineConfig(inflight_per_gpu=1, data_files_per_gpu=1, staging_budget=16 << 20)) as e:
            await inproc.dump(e, dfd, [BoSpec(1, n * cs, BoRef("mmap", src, 0))], chunk_size=cs, compression="none")
        mfd = os.open(MANIFEST_NAME, os.O_RDONLY, dir_fd=dfd)
        try:
            reader = await ImageReader.from_manifests(mfd)
        finally:
            os.close(mfd)
        m = reader.manifest
        tasks = sorted((ChunkTask(None, i, i * cs, cs, loc=reader.locate(m.bos[0], i)) for i in range(n)),
                       key=lambda t: t.loc.offset)
        notes = Notes(reader, theirs.fileno(), len(m.files))
        await notes.until_counted()
        dec, got, sent = NoteDecoder([f.length for f in m.files]), Intervals(), 0

        async def turn(batch: list[ChunkTask]) -> None:
            nonlocal sent
            for t in batch:
                notes.read([t])
            await asyncio.sleep(0)  # one turn of the loop: the notes' send (call_soon) runs
            while True:
                try:
                    data = ours.recv(1 << 20)
                except BlockingIOError:
                    return
                sent += len(data) // NOTE_SIZE
                for note in dec.feed(data):
                    assert note.kind == NoteKind.RELEASED
                    got.add(note.start, note.end)

        await turn(tasks[1::2])
        rest = tasks[0::2]
        while rest:
            await turn([rest[0], rest[-1]] if len(rest) > 1 else rest)
            rest = rest[1:-1]
        notes.close()
        await notes.closed()
        every = Intervals()
        for t in tasks:
            every.add(t.loc.offset, t.loc.offset + t.loc.length)
        return sent, list(zip(got.starts, got.ends)), list(zip(every.starts, every.ends))

    try:
        sent, got, every = run(go())
    finally:
        for fd in (src, dfd):
            os.close(fd)
        ours.close()
        theirs.close()
    assert got == every
    assert sent <= n, f"{sent} notes for {n} records"


def test_a_supply_socket_the_daemon_cannot_dup_ends_its_notes_so_the_client_bounds_nothing(tmp_path) -> None:
    """Notes need the daemon's own dup of the supply socket: with no fd left (EMFILE) the session goes on without
    them, and the socket's sending side is shut down, so that the client (whose window waits for RELEASED and
    WAITING: vramd.oci.window) reads their end and lifts its bound; before, it waited for notes that never came,
    its download stalled under the window, and the daemon's chunks waited for that download."""
    import asyncio
    import os
    import resource
    import socket
    from concurrent.futures import ThreadPoolExecutor

    from helpers import open_dir, run

    from vramd import inproc
    from vramd.backends import BoRef
    from vramd.engine import BoSpec, Engine, EngineConfig
    from vramd.engine.jobs.stream import Supply
    from vramd.image.names import MANIFEST_NAME
    from vramd.image.reader import ImageReader

    src = os.memfd_create("bo")
    os.write(src, os.urandom(4 * 4096))
    dfd = open_dir(tmp_path)
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    ours.settimeout(10)
    failed: list[BaseException] = []

    async def go() -> bytes:
        async with Engine(EngineConfig(inflight_per_gpu=1, data_files_per_gpu=1, staging_budget=16 << 20)) as e:
            await inproc.dump(e, dfd, [BoSpec(1, 4 * 4096, BoRef("mmap", src, 0))], chunk_size=4096)
        mfd = os.open(MANIFEST_NAME, os.O_RDONLY, dir_fd=dfd)
        try:
            reader = await ImageReader.from_manifests(mfd)
        finally:
            os.close(mfd)
        with ThreadPoolExecutor(1) as io:
            supply = Supply(reader, theirs.fileno(), failed.append, io, "restored")
            soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
            top = max(int(n) for n in os.listdir("/proc/self/fd"))
            held: list[int] = []
            resource.setrlimit(resource.RLIMIT_NOFILE, (top + 1, hard))
            try:
                while True:  # every fd below the limit taken: the daemon's dup fails with EMFILE
                    try:
                        held.append(os.dup(0))
                    except OSError:
                        break
                supply.start()
            finally:
                for fd in held:
                    os.close(fd)
                resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
            assert supply.notes is None
            end = await asyncio.get_running_loop().run_in_executor(None, ours.recv, 4096)
            supply.stop()
            await supply.closed()
            return end

    try:
        assert run(go()) == b""  # the end of the notes (a read that waited for none fails past 10 s)
    finally:
        for fd in (src, dfd):
            os.close(fd)
        ours.close()
        theirs.close()
    assert failed == []
