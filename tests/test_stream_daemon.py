"""A streamed restore through a real daemon on a real socket: the test is the client that fills the image's data
files while the session runs, and says how far each is final over a real pipe (vramd.image.supply).

The image is dumped first (in this process, one batch in flight, so its records lie in the data file in chunk
order), then copied into a fresh directory as the registry client makes one: the manifest, and each data file
created at its full length with none of its bytes (sparse: zeros).  What the daemon has restored at each step is
read from the session's progress, which is deterministic: a chunk whose record is not supplied is never read.
"""
from __future__ import annotations

import os
import select
import struct
import time
from pathlib import Path

import pytest
from helpers import open_dir, run

from vramd import inproc
from vramd.backends import BoRef
from vramd.client import SESSION_DUMP, SESSION_RESTORE, SESSION_VERIFY, Client, ClientBo
from vramd.engine import BoSpec, Engine, EngineConfig
from vramd.errors import (
    BadDescriptorError,
    ForeignDataFileError,
    InvalidRequestError,
    JobCancelledError,
    TruncatedDataError,
    WaitTimeoutError,
)
from vramd.hostmem.staging import buffer_unit
from vramd.image.manifest import chunk_record, decode_manifest
from vramd.image.names import MANIFEST_NAME
from vramd.image.supply import encode
from vramd.pb import rpc_pb2 as rpc
from vramd.testing import DaemonProcess
from vramd.units import MiB

CHUNK = MiB
SIZES = {1: 6 * MiB + 12345, 2: 300 * 1024}  # BO 2: small, its pieces batched together


def _memfd(data: bytes = b"", size: int = 0) -> int:
    fd = os.memfd_create("bo", os.MFD_CLOEXEC)
    os.ftruncate(fd, size or len(data))
    if data:
        os.pwrite(fd, data, 0)
    return fd


def _dump(path: Path, contents: dict[int, bytes], parent: Path | None = None) -> None:
    """Dump `contents` ({BO: bytes}) into a new image in `path` (incremental over `parent`), one batch in flight
    into one data file: its records lie in chunk order."""
    fds = {bo: _memfd(data) for bo, data in contents.items()}
    dfd, pfds = open_dir(path), [open_dir(parent)] if parent is not None else []

    async def dump() -> None:
        async with Engine(EngineConfig(inflight_per_gpu=1, data_files_per_gpu=1, staging_budget=64 * MiB)) as e:
            await inproc.dump(e, dfd, [BoSpec(bo, len(d), BoRef("mmap", fds[bo], 0)) for bo, d in contents.items()],
                              chunk_size=CHUNK, compression="none", parent_fds=pfds)
    try:
        run(dump())
    finally:
        for fd in [dfd, *pfds, *fds.values()]:
            os.close(fd)


class Image:
    """A dumped image (`src`), its BOs' bytes, its own records in chunk order, and an empty copy (`dst`) to
    stream.  `parent`: an incremental image's (complete) parent directory."""

    def __init__(self, tmp_path: Path, contents: dict[int, bytes] | None = None, parent: Path | None = None) -> None:
        self.contents = contents or {bo: os.urandom(n) for bo, n in SIZES.items()}
        self.src, self.dst = tmp_path / "image", tmp_path / "streamed"
        self.src.mkdir()
        self.dst.mkdir()
        _dump(self.src, self.contents, parent)
        self.manifest = decode_manifest((self.src / MANIFEST_NAME).read_bytes())
        assert len(self.manifest.files) == 1
        self.name = self.manifest.files[0].name
        self.data = (self.src / self.name).read_bytes()
        self.chunks = []  # (BO, offset, length, record end) of the chunks with a record here, in the lane's order
        self.free = 0  # bytes of chunks with no record of this image (holes, a parent's records)
        for bo in self.manifest.bos:
            for i in range(len(bo.chunk_refs)):
                length = min(CHUNK, bo.size - i * CHUNK)
                rec = chunk_record(self.manifest, bo, i)
                if rec is None:
                    self.free += length
                    continue
                fi, off, ln, _ = rec
                assert fi == 0
                self.chunks.append((bo.id, i * CHUNK, length, off + ln))
        ends = [c[3] for c in self.chunks]
        assert ends == sorted(ends)  # one batch in flight: the records in chunk order
        (self.dst / MANIFEST_NAME).write_bytes((self.src / MANIFEST_NAME).read_bytes())
        with open(self.dst / self.name, "wb") as f:
            f.truncate(len(self.data))  # full length, no bytes: what the registry client creates first

    def fill(self, start: int, end: int) -> None:
        """Write the real bytes [start, end) of the data file into the streamed copy."""
        with open(self.dst / self.name, "r+b") as f:
            f.seek(start)
            f.write(self.data[start:end])

    def garbage(self, start: int) -> None:
        """Bytes from `start` on that no record check passes (a download that went wrong, not supplied)."""
        with open(self.dst / self.name, "r+b") as f:
            f.seek(start)
            f.write(b"\xa5" * (len(self.data) - start))

    def covered(self, end: int) -> int:
        """BO bytes restored once the data file is supplied up to `end`."""
        return self.free + sum(c[2] for c in self.chunks if c[3] <= end)

    def cut(self, n: int) -> int:
        """The data file's end after the first `n` chunks' records."""
        return self.chunks[n - 1][3]


class Targets:
    def __init__(self) -> None:
        self.fds = {bo: _memfd(size=n) for bo, n in SIZES.items()}

    def bos(self) -> list[ClientBo]:
        return [ClientBo(bo, fd) for bo, fd in self.fds.items()]

    def contents(self) -> dict[int, bytes]:
        return {bo: os.pread(fd, SIZES[bo] + 1, 0) for bo, fd in self.fds.items()}

    def close(self) -> None:
        for fd in self.fds.values():
            os.close(fd)


@pytest.fixture
def image(tmp_path):
    return Image(tmp_path)


@pytest.fixture
def targets():
    t = Targets()
    yield t
    t.close()


def _streamed(c: Client, image: Image, targets: Targets | None, kind: rpc.SessionKind = SESSION_RESTORE,
              parent: Path | None = None):
    """Open a streamed session on the empty copy (the read end of a new pipe handed over and closed here), add
    the targets, start; returns (session info, the pipe's write end)."""
    r, w = os.pipe2(os.O_CLOEXEC)
    dfd, pfds = open_dir(image.dst), [open_dir(parent)] if parent is not None else []
    try:
        s = c.open_session(kind, dfd, supply_fd=r, label="streamed", parent_fds=pfds)
    finally:
        for fd in [r, dfd, *pfds]:
            os.close(fd)
    if targets is not None:
        c.add_bos(s.token, targets.bos())
        c.start(s.token)
    return s, w


def _until(c: Client, token: str, done: int) -> rpc.SessionInfo:
    """The session's info once `done` bytes have landed (each look a bounded Wait on the daemon, which returns
    at once if the session ends); fails if that never happens."""
    deadline = time.monotonic() + 60
    while True:
        try:
            info = c.wait(token, 0.05)
        except WaitTimeoutError:
            info = c.progress(token)
        if info.progress.bytes_done >= done or info.state not in (rpc.SESSION_OPEN, rpc.SESSION_SEALED,
                                                                  rpc.SESSION_RUNNING):
            return info
        assert time.monotonic() < deadline, f"only {info.progress.bytes_done} of {done} bytes restored"


def _running(c: Client, token: str) -> rpc.SessionInfo:
    """The session has not ended (a Wait of 0 s times out)."""
    with pytest.raises(WaitTimeoutError):
        c.wait(token, 0)
    return c.progress(token)


def test_a_restore_streamed_in_pieces_lands_as_they_are_supplied(daemon, image, targets):
    """The data file is written and supplied in three pieces (the first piece cut inside the header, so even
    the header waits); after each, exactly the chunks whose records were supplied have landed and the session
    still runs; after the last and the pipe's end, it is DONE and byte-exact."""
    total = sum(SIZES.values())
    with Client(daemon.socket) as c:
        s, w = _streamed(c, image, targets)
        try:
            assert _running(c, s.token).progress.bytes_done == 0  # nothing supplied, nothing read
            image.fill(0, 16)
            os.write(w, encode(0, 16))  # inside the header: nothing readable yet
            assert _running(c, s.token).progress.bytes_done == 0
            for n in (2, 5):
                end = image.cut(n)
                image.fill(16 if n == 2 else image.cut(2), end)
                os.write(w, encode(0, end))
                info = _until(c, s.token, image.covered(end))
                assert info.progress.bytes_done == image.covered(end) < total
                assert _running(c, s.token).progress.bytes_done == image.covered(end)
            image.fill(image.cut(5), len(image.data))
            os.write(w, encode(0, len(image.data)))
        finally:
            os.close(w)
        info = c.wait(s.token)
        assert info.state == rpc.SESSION_DONE and info.progress.bytes_done == total
        c.close_session(s.token)
    assert targets.contents() == image.contents


def test_bytes_never_supplied_are_never_read_and_the_pipes_end_names_them(daemon, image, targets):
    """The part after the first 3 chunks holds garbage no record check passes, never supplied: the restore
    reaches exactly the supplied chunks, then the pipe's end fails it naming the data file, how far it was
    supplied, and the first chunk that was not restored (not a CORRUPT_CHUNK: the garbage was never read)."""
    cut = image.cut(3)
    image.fill(0, cut)
    image.garbage(cut)
    with Client(daemon.socket) as c:
        s, w = _streamed(c, image, targets)
        try:
            os.write(w, encode(0, cut))
            assert _until(c, s.token, image.covered(cut)).progress.bytes_done == image.covered(cut)
            assert _running(c, s.token).progress.bytes_done == image.covered(cut)
        finally:
            os.close(w)
        with pytest.raises(TruncatedDataError) as e:
            c.wait(s.token)
        assert (e.value.bo_id, e.value.offset) == (1, 3 * CHUNK)
        assert f"stopped supplying data file {image.name} at {cut:#x}" in e.value.message
        assert "BO 1 at offset 0x300000 was not restored" in e.value.message
        info = c.progress(s.token)
        assert info.state == rpc.SESSION_FAILED and info.progress.bytes_done == image.covered(cut)
        c.close_session(s.token)
    assert targets.contents()[1][:3 * CHUNK] == image.contents[1][:3 * CHUNK]


def _message(index: int, end: int, reserved: int = 0) -> bytes:
    return struct.pack("<IIQ", index, reserved, end)


@pytest.mark.parametrize(("sent", "says"), [
    (lambda n: encode(0, n + 1), "is past its length"),
    (lambda n: encode(0, 4096) + encode(0, 4095), "goes back from 0x1000"),
    (lambda n: encode(1, 16), "data file #1: the image has 1"),
    (lambda n: _message(0, 16, reserved=7), "reserved field 0x7 is not 0"),
    (lambda n: encode(0, 16)[:10], "ended inside a message (10 of 16 bytes)"),
], ids=["past-the-end", "going-back", "no-such-file", "reserved", "cut-message"])
def test_a_message_no_client_sends_fails_the_session_and_only_it(daemon, image, targets, sent, says):
    """A bad supply message fails its session with INVALID_REQUEST naming it; an ordinary restore on the same
    daemon then completes, byte-exact."""
    image.fill(0, len(image.data))  # the bytes are all there: only the message is wrong
    with Client(daemon.socket) as c:
        s, w = _streamed(c, image, targets)
        os.write(w, sent(len(image.data)))
        os.close(w)
        with pytest.raises(InvalidRequestError) as e:
            c.wait(s.token)
        assert e.value.message.startswith("the supply pipe: ") and says in e.value.message
        c.close_session(s.token)
        other = Targets()
        try:
            dfd = open_dir(image.src)
            try:
                assert c.run_session(SESSION_RESTORE, dfd, other.bos()).state == rpc.SESSION_DONE
            finally:
                os.close(dfd)
            assert other.contents() == image.contents
        finally:
            other.close()


def test_a_session_that_waits_for_its_supply_holds_no_staging(run_dir, tmp_path, image, targets):
    """A daemon whose staging budget is the least it starts with (4 buffers of a 1 MiB chunk) and whose lanes
    keep 8 batches in flight: a streamed restore that is never supplied has every chunk to take, yet holds no
    buffer, and an ordinary restore on another connection completes meanwhile; then the streamed one is
    supplied and completes too."""
    budget = 4 * buffer_unit(CHUNK)
    cfg = tmp_path / "vramd.toml"
    cfg.write_text(f'staging_budget = {budget}\nchunk_size = "1M"\ninflight_per_gpu = 8\n')
    with DaemonProcess(run_dir, "--config", str(cfg)) as d, Client(d.socket) as c:
        s, w = _streamed(c, image, targets)
        try:
            with Client(d.socket) as other_client:
                other = Targets()
                try:
                    dfd = open_dir(image.src)
                    try:
                        o = other_client.open_session(SESSION_RESTORE, dfd)
                    finally:
                        os.close(dfd)
                    other_client.add_bos(o.token, other.bos())
                    other_client.start(o.token)
                    # (a bound that only a restore starved of staging would reach: it fails the test)
                    assert other_client.wait(o.token, 60).state == rpc.SESSION_DONE
                    assert other.contents() == image.contents
                finally:
                    other.close()
            assert _running(c, s.token).progress.bytes_done == 0
            image.fill(0, len(image.data))
            os.write(w, encode(0, len(image.data)))
        finally:
            os.close(w)
        assert c.wait(s.token).state == rpc.SESSION_DONE
        c.close_session(s.token)
    assert targets.contents() == image.contents


def test_a_supply_fd_that_is_not_a_pipe_is_refused_at_open(daemon, image):
    """A regular file, or a pipe's write end: BAD_DESCRIPTOR at OpenSession, and no session is left open."""
    dfd = open_dir(image.dst)
    r, w = os.pipe2(os.O_CLOEXEC)
    try:
        with Client(daemon.socket) as c:
            for fd, says in ((dfd, "not a pipe nor a socket"), (w, "not open for reading")):
                with pytest.raises(BadDescriptorError) as e:
                    c.open_session(SESSION_RESTORE, dfd, supply_fd=fd)
                assert says in e.value.message
            assert c.sessions() == []
    finally:
        for fd in (dfd, r, w):
            os.close(fd)


def test_a_dump_takes_no_supply_pipe(daemon, image):
    r, w = os.pipe2(os.O_CLOEXEC)
    try:
        with Client(daemon.socket) as c:
            resp = c.request([r], open_session=rpc.OpenSession(kind=SESSION_DUMP, supply_fd_index=0))
            assert resp.error.code == rpc.INVALID_REQUEST and "supply_fd_index" in resp.error.message
    finally:
        os.close(r)
        os.close(w)


def test_a_cancel_while_waiting_ends_the_session_and_lets_the_pipe_go(daemon, image, targets):
    """Cancelled while every chunk waits for its supply: CANCELLED at once, and the daemon has closed its end
    of the pipe (a write to ours is EPIPE), holding no fd of the session."""
    files = [f for f in daemon.fds() if not f.startswith("socket:")]
    with Client(daemon.socket) as c:
        s, w = _streamed(c, image, targets)
        try:
            assert _running(c, s.token).progress.bytes_done == 0
            c.cancel(s.token, "no more")
            with pytest.raises(JobCancelledError):
                c.wait(s.token)
            assert c.progress(s.token).state == rpc.SESSION_CANCELLED
            c.close_session(s.token)
            with pytest.raises(BrokenPipeError):
                os.write(w, encode(0, 16))
        finally:
            os.close(w)
    assert [f for f in daemon.fds() if not f.startswith("socket:")] == files


def test_a_streamed_verify_checks_the_header_once_supplied(daemon, image):
    """A verify streams too; a data file whose header (written last here) is another image's is refused once
    it is supplied, FOREIGN_DATA_FILE naming the file, though the records are right."""
    image.fill(0, len(image.data))
    with Client(daemon.socket) as c:
        s, w = _streamed(c, image, None, SESSION_VERIFY)
        os.write(w, encode(0, len(image.data)))
        os.close(w)
        info = c.wait(s.token)
        assert info.state == rpc.SESSION_DONE and info.progress.bytes_done == sum(SIZES.values())
        c.close_session(s.token)
        with open(image.dst / image.name, "r+b") as f:
            f.seek(16)
            f.write(bytes(16))  # the image id in the header
        s, w = _streamed(c, image, None, SESSION_VERIFY)
        os.write(w, encode(0, len(image.data)))
        os.close(w)
        with pytest.raises(ForeignDataFileError) as e:
            c.wait(s.token)
        assert image.name in e.value.message
        assert c.progress(s.token).progress.bytes_done == 0


def test_holes_and_a_parents_records_need_no_supply(daemon, tmp_path, targets):
    """An incremental image over a complete parent, with a hole: before any byte is supplied, exactly the hole
    and the chunks whose records are the parent's have landed; the image's own records wait for their supply."""
    parent = tmp_path / "parent"
    parent.mkdir()
    rnd = {k: os.urandom(CHUNK) for k in range(8)}
    zero, tail = bytes(CHUNK), os.urandom(SIZES[1] - 6 * CHUNK)
    _dump(parent, {1: rnd[0] + rnd[1] + rnd[2] + zero + rnd[3] + rnd[4] + tail, 2: rnd[5][:SIZES[2]]})
    child = {1: rnd[0] + rnd[1] + rnd[6] + zero + rnd[7] + rnd[4] + tail, 2: rnd[5][:SIZES[2]]}
    (tmp_path / "child").mkdir()
    image = Image(tmp_path / "child", child, parent)
    assert [c[:2] for c in image.chunks] == [(1, 2 * CHUNK), (1, 4 * CHUNK)]  # the changed chunks only
    assert image.free == sum(SIZES.values()) - 2 * CHUNK
    with Client(daemon.socket) as c:
        s, w = _streamed(c, image, targets, parent=parent)
        try:
            assert _until(c, s.token, image.free).progress.bytes_done == image.free
            assert _running(c, s.token).progress.bytes_done == image.free
            image.fill(0, len(image.data))
            os.write(w, encode(0, len(image.data)))
        finally:
            os.close(w)
        assert c.wait(s.token).state == rpc.SESSION_DONE
        c.close_session(s.token)
    assert targets.contents() == child


def _closed_by_the_daemon(w: int) -> bool:
    """Whether the daemon has closed its end of the pipe: POLLERR on ours (waited for; the bound only fails a
    daemon that never lets go)."""
    p = select.poll()
    p.register(w, select.POLLERR)
    return bool(p.poll(30_000))


def test_a_client_that_hangs_up_while_waiting_is_reaped_with_its_pipe(daemon, image, targets):
    """The connection closes while every chunk waits: after the grace period the session is cancelled and
    its end of the pipe closed, like any session's fds."""
    with Client(daemon.socket) as c:
        s, w = _streamed(c, image, targets)
    try:
        assert _closed_by_the_daemon(w)
        daemon.expect_log(rf"session {s.session_id}: no client holds it any more \(grace period over\)")
    finally:
        os.close(w)


def test_shutdown_drains_a_streamed_session_then_ends_its_waits(run_dir, image, targets):
    """SIGTERM drains: a streamed session supplied during the drain completes; one never supplied is cancelled
    at the drain timeout, its pipe closed, and the daemon exits 0."""
    with DaemonProcess(run_dir, "--chunk-size", "1M", "--drain-timeout", "600") as d, Client(d.socket) as c:
        s, w = _streamed(c, image, targets)
        d.terminate()
        d.expect_log(r"shutting down: draining 1 session")
        image.fill(0, len(image.data))
        os.write(w, encode(0, len(image.data)))
        os.close(w)
        # (the drain ends with the session: the daemon may close this connection before a Wait is answered)
        d.expect_log(rf"session {s.session_id} \(restore, .*\): SESSION_DONE: 2/2 BOs")
        assert d.stop() == 0
    assert targets.contents() == image.contents
    with DaemonProcess(run_dir, "--chunk-size", "1M", "--drain-timeout", "0.2") as d, Client(d.socket) as c:
        s, w = _streamed(c, image, targets)
        try:
            d.terminate()
            assert _closed_by_the_daemon(w)
            d.expect_log(r"drain timeout \(0.2 s\): cancelling 1 session")
            assert d.stop() == 0
        finally:
            os.close(w)
