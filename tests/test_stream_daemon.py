"""A streamed restore through a real daemon on a real socket: the test is the client that fills the image's data
files while the session runs, and says how far each is final over a real pipe (vramd.image.supply).

The image is dumped first (in this process, one batch in flight, so its records lie in the data file in chunk
order), then copied into a fresh directory as the registry client makes one: the manifest, and each data file
created at its full length with none of its bytes (sparse: zeros).  What the daemon has restored at each step is
read from the session's progress, which is deterministic: a chunk whose record is not supplied is never read.
"""
from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
from helpers import open_dir, run

from vramd import inproc
from vramd.backends import BoRef
from vramd.client import SESSION_RESTORE, Client, ClientBo
from vramd.engine import BoSpec, Engine, EngineConfig
from vramd.errors import WaitTimeoutError
from vramd.image.manifest import chunk_record, decode_manifest
from vramd.image.names import MANIFEST_NAME
from vramd.image.supply import encode
from vramd.pb import rpc_pb2 as rpc
from vramd.units import MiB

CHUNK = MiB
SIZES = {1: 6 * MiB + 12345, 2: 300 * 1024}  # BO 2: small, its pieces batched together


def _memfd(data: bytes = b"", size: int = 0) -> int:
    fd = os.memfd_create("bo", os.MFD_CLOEXEC)
    os.ftruncate(fd, size or len(data))
    if data:
        os.pwrite(fd, data, 0)
    return fd


class Image:
    """A dumped image (`src`), its BOs' bytes, its records in chunk order, and an empty copy (`dst`) to stream."""

    def __init__(self, tmp_path: Path) -> None:
        self.contents = {bo: os.urandom(n) for bo, n in SIZES.items()}
        self.src, self.dst = tmp_path / "image", tmp_path / "streamed"
        self.src.mkdir()
        self.dst.mkdir()
        fds = {bo: _memfd(data) for bo, data in self.contents.items()}
        sfd = open_dir(self.src)
        try:
            async def dump() -> None:
                async with Engine(EngineConfig(inflight_per_gpu=1, data_files_per_gpu=1, staging_budget=64 * MiB)) as e:
                    await inproc.dump(e, sfd, [BoSpec(bo, len(d), BoRef("mmap", fds[bo], 0))
                                               for bo, d in self.contents.items()], chunk_size=CHUNK,
                                      compression="none")
            run(dump())
        finally:
            os.close(sfd)
            for fd in fds.values():
                os.close(fd)
        self.manifest = decode_manifest((self.src / MANIFEST_NAME).read_bytes())
        assert len(self.manifest.files) == 1
        self.name = self.manifest.files[0].name
        self.data = (self.src / self.name).read_bytes()
        # (BO, offset, length, record end) in the order the restore's lane takes them
        self.chunks = []
        for bo in self.manifest.bos:
            for i in range(len(bo.chunk_refs)):
                fi, off, ln, _ = chunk_record(self.manifest, bo, i)
                assert fi == 0
                self.chunks.append((bo.id, i * CHUNK, min(CHUNK, bo.size - i * CHUNK), off + ln))
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
        """BO bytes whose records end at or below `end`."""
        return sum(c[2] for c in self.chunks if c[3] <= end)

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


def _streamed(c: Client, image: Image, targets: Targets | None, kind: rpc.SessionKind = SESSION_RESTORE):
    """Open a streamed session on the empty copy (the read end of a new pipe handed over and closed here), add
    the targets, start; returns (session info, the pipe's write end)."""
    r, w = os.pipe2(os.O_CLOEXEC)
    dfd = open_dir(image.dst)
    try:
        s = c.open_session(kind, dfd, supply_fd=r, label="streamed")
    finally:
        os.close(r)
        os.close(dfd)
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
