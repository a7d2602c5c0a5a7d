"""A streamed session over a supply SOCKET: the daemon's notes back (vramd.image.supply: RELEASED, WAITING), through
a real daemon on a real socket (stream_daemon_fixture.py says how the image is made; records in chunk order).

What a client reads: after each piece supplied and restored, the released ranges are exactly the records of the
chunks that landed, and a WAITING names the end the next held-back chunk needs.  A client that never reads the
notes (the daemon's send buffer as small as the kernel allows) and one that shut its reading side (EPIPE at the
daemon) still get their sessions done, byte-exact.
"""
from __future__ import annotations

import os
import select
import socket
import threading
import time

import pytest
from helpers import open_dir
from stream_daemon_fixture import CHUNK, Image, Targets, bo_memfd, restored_up_to, still_running

from vramd.client import SESSION_RESTORE, Client
from vramd.errors import JobCancelledError
from vramd.image.manifest import chunk_record, decode_manifest, encode_manifest
from vramd.image.names import MANIFEST_NAME
from vramd.image.supply import Intervals, NoteDecoder, NoteKind, encode
from vramd.pb import rpc_pb2 as rpc


@pytest.fixture
def image(tmp_path):
    return Image(tmp_path)


@pytest.fixture
def targets():
    t = Targets()
    yield t
    t.close()


def _open_over_socket(c: Client, image: Image, targets: Targets, sndbuf: int | None = None):
    """A streamed restore whose supply fd is one end of a socketpair (handed over, closed here); returns the
    session and our end (we write the supply to it, and read the notes off it)."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    if sndbuf is not None:  # the daemon's end: its sends find it full at once
        theirs.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, sndbuf)
    dfd = open_dir(image.dst)
    try:
        s = c.open_session(SESSION_RESTORE, dfd, supply_fd=theirs.fileno(), label="streamed over a socket")
    finally:
        theirs.close()
        os.close(dfd)
    c.add_bos(s.token, targets.bos())
    c.start(s.token)
    return s, ours


class Notes:
    """What the test has read of the daemon's notes: the union of RELEASED ranges, the highest WAITING end."""

    def __init__(self, sock: socket.socket, length: int) -> None:
        self.sock, self.dec = sock, NoteDecoder([length])
        self.released, self.waiting = Intervals(), 0

    def until(self, done, what: str) -> None:
        """Read notes until `done()` holds (each read waits for the daemon's next note; fails past 30 s)."""
        while not done():
            assert select.select([self.sock], [], [], 30)[0], f"no note came: {what}"
            data = self.sock.recv(4096)
            assert data, f"the daemon closed the socket first: {what}"
            for n in self.dec.feed(data):
                assert n.file == 0
                if n.kind == NoteKind.RELEASED:
                    self.released.add(n.start, n.end)
                else:
                    self.waiting = max(self.waiting, n.end)

    def ranges(self) -> list[tuple[int, int]]:
        return list(zip(self.released.starts, self.released.ends, strict=True))


def _records(image: Image) -> list[tuple[int, int]]:
    """Each chunk's record, in chunk order (the order the dump wrote them and the lane reads them)."""
    out = []
    for bo in image.manifest.bos:
        for i in range(len(bo.chunk_refs)):
            rec = chunk_record(image.manifest, bo, i)
            if rec is not None:
                out.append((rec[1], rec[1] + rec[2]))
    return out


def test_released_ranges_are_the_records_read_and_waiting_names_the_next_need(daemon, image, targets):
    records = _records(image)
    with Client(daemon.socket) as c:
        s, sock = _open_over_socket(c, image, targets)
        notes = Notes(sock, len(image.data))
        try:
            notes.until(lambda: notes.waiting >= image.cut(1), "WAITING for the first record")
            assert notes.ranges() == []  # nothing read, nothing released
            image.fill(0, len(image.data))  # (the whole file is there: what is supplied is what the test says)
            for n in (2, 5):
                sock.sendall(encode(0, image.cut(n)))
                restored_up_to(c, s.token, image.covered(image.cut(n)))
                expect = Intervals()
                for start, end in records[:n]:
                    expect.add(start, end)
                want = list(zip(expect.starts, expect.ends, strict=True))
                notes.until(lambda want=want: notes.ranges() == want, f"RELEASED for the first {n} records")
                notes.until(lambda n=n: notes.waiting >= image.cut(n + 1), f"WAITING past record {n}")
                assert notes.waiting <= len(image.data)
                still_running(c, s.token)
            sock.sendall(encode(0, len(image.data)))
            sock.shutdown(socket.SHUT_WR)
            info = c.wait(s.token)
            assert info.state == rpc.SESSION_DONE, info.error.message
            every = Intervals()
            for start, end in records:
                every.add(start, end)
            notes.until(lambda: notes.ranges() == list(zip(every.starts, every.ends, strict=True)),
                        "every record RELEASED")
            c.close_session(s.token)
        finally:
            sock.close()
    assert targets.contents() == image.contents


class _Targets(Targets):
    def __init__(self, sizes: dict[int, int]) -> None:
        self.sizes = sizes
        self.fds = {bo: bo_memfd(size=n) for bo, n in sizes.items()}

    def contents(self) -> dict[int, bytes]:
        return {bo: os.pread(fd, self.sizes[bo] + 1, 0) for bo, fd in self.fds.items()}


@pytest.mark.parametrize("peer", ["never reads", "shut its reading side"])
def test_a_client_that_takes_no_notes_still_gets_its_session_done(daemon, tmp_path, peer):
    """40 records, supplied one message each: the daemon's end has the smallest send buffer the kernel allows,
    and the client reads nothing (its notes fill that buffer: the daemon waits for it to be writable, which it
    never is), or shut its reading side (the daemon's sends fail with EPIPE).  The supply is read all the same
    and the session is DONE, byte-exact."""
    image = Image(tmp_path, {1: os.urandom(40 * CHUNK)})
    image.fill(0, len(image.data))
    targets = _Targets({1: 40 * CHUNK})
    with Client(daemon.socket) as c:
        s, sock = _open_over_socket(c, image, targets, sndbuf=1)
        try:
            if peer == "shut its reading side":
                sock.shutdown(socket.SHUT_RD)
            for n in range(1, len(image.chunks) + 1):
                sock.sendall(encode(0, image.cut(n)))
            sock.sendall(encode(0, len(image.data)))
            sock.shutdown(socket.SHUT_WR)
            info = c.wait(s.token)
            assert info.state == rpc.SESSION_DONE, info.error.message
            c.close_session(s.token)
            assert targets.contents() == image.contents
        finally:
            sock.close()
            targets.close()


@pytest.mark.parametrize("when", ["before it starts", "while it waits for its supply"])
def test_a_session_closed_lets_go_of_its_socket(daemon, image, targets, when):
    """The daemon holds the supply socket twice (the session's fd, and the notes' own): a session closed before
    it starts, or cancelled while a chunk waits at the gate, closes both: the client reads the socket's end."""
    with Client(daemon.socket) as c:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        dfd = open_dir(image.dst)
        try:
            s = c.open_session(SESSION_RESTORE, dfd, supply_fd=theirs.fileno(), label="closed")
        finally:
            theirs.close()
            os.close(dfd)
        try:
            if when != "before it starts":
                c.add_bos(s.token, targets.bos())
                c.start(s.token)
                notes = Notes(ours, len(image.data))
                notes.until(lambda: notes.waiting > 0, "WAITING for the first record")
                c.cancel(s.token)
                with pytest.raises(JobCancelledError):
                    c.wait(s.token)
            c.close_session(s.token)
            while True:  # notes may come first; then the end (each read waits for the daemon; fails past 30 s)
                assert select.select([ours], [], [], 30)[0], "the daemon still holds the supply socket"
                if not ours.recv(4096):
                    break
        finally:
            ours.close()


def test_the_release_counts_of_a_huge_manifest_never_hold_the_event_loop(daemon, image):
    """The release counts take a pass over every chunk of the manifest when the session opens.  A manifest of 12
    MB may list 12 million chunks (holes of a BO no client ever adds): on the event loop, that pass held another
    client's GetStatus 2.3 s (load 3.6; about 30 ms over a pipe, which has no notes).  It runs in a thread, and
    stops once the session is closed: GetStatus is answered meanwhile."""
    n = 12_000_000
    m = decode_manifest((image.dst / MANIFEST_NAME).read_bytes())
    huge = m.bos.add(id=99, size=n * CHUNK)
    huge.chunk_refs.extend([0] * n)
    (image.dst / MANIFEST_NAME).write_bytes(encode_manifest(m))
    worst, pings, over = [0.0], [0], threading.Event()

    def ping(c: Client) -> None:
        while not over.is_set():
            t = time.monotonic()
            c.status()
            worst[0] = max(worst[0], time.monotonic() - t)
            pings[0] += 1

    with Client(daemon.socket) as c, Client(daemon.socket) as other:
        pinger = threading.Thread(target=ping, args=(other,))
        pinger.start()
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        dfd = open_dir(image.dst)
        try:
            try:
                s = c.open_session(SESSION_RESTORE, dfd, supply_fd=theirs.fileno(), label="huge manifest")
            finally:
                theirs.close()
                os.close(dfd)
            c.close_session(s.token)
            ours.settimeout(30)
            while ours.recv(4096):  # the daemon lets go of the socket (each read waits for it; fails past 30 s)
                pass
        finally:
            over.set()
            pinger.join()
            ours.close()
    assert pings[0] > 0
    assert worst[0] < 0.5, f"another client's GetStatus waited {worst[0]:.2f} s while the session opened"
