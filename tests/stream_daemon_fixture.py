"""What the streamed-restore tests share (tests/test_stream_daemon*.py): the test is the client that fills an
image's data files while a real daemon's session runs, and says how far each is final over a real pipe
(vramd.image.supply).

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
from vramd.client import SESSION_RESTORE, Client, ClientBo
from vramd.engine import BoSpec, Engine, EngineConfig
from vramd.errors import WaitTimeoutError
from vramd.image.manifest import chunk_record, decode_manifest
from vramd.image.names import MANIFEST_NAME
from vramd.pb import rpc_pb2 as rpc
from vramd.units import MiB

CHUNK = MiB


SIZES = {1: 6 * MiB + 12345, 2: 300 * 1024}  # BO 2: small, its pieces batched together


def bo_memfd(data: bytes = b"", size: int = 0) -> int:
    fd = os.memfd_create("bo", os.MFD_CLOEXEC)
    os.ftruncate(fd, size or len(data))
    if data:
        os.pwrite(fd, data, 0)
    return fd


def dump_image(path: Path, contents: dict[int, bytes], parent: Path | None = None) -> None:
    """Dump `contents` ({BO: bytes}) into a new image in `path` (incremental over `parent`), one batch in flight
    into one data file: its records lie in chunk order."""
    fds = {bo: bo_memfd(data) for bo, data in contents.items()}
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
        dump_image(self.src, self.contents, parent)
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
        self.fds = {bo: bo_memfd(size=n) for bo, n in SIZES.items()}

    def bos(self) -> list[ClientBo]:
        return [ClientBo(bo, fd) for bo, fd in self.fds.items()]

    def contents(self) -> dict[int, bytes]:
        return {bo: os.pread(fd, SIZES[bo] + 1, 0) for bo, fd in self.fds.items()}

    def close(self) -> None:
        for fd in self.fds.values():
            os.close(fd)


def open_streamed(c: Client, image: Image, targets: Targets | None, kind: rpc.SessionKind = SESSION_RESTORE,
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


def restored_up_to(c: Client, token: str, done: int) -> rpc.SessionInfo:
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


def still_running(c: Client, token: str) -> rpc.SessionInfo:
    """The session has not ended (a Wait of 0 s times out)."""
    with pytest.raises(WaitTimeoutError):
        c.wait(token, 0)
    return c.progress(token)


def closed_by_the_daemon(w: int) -> bool:
    """Whether the daemon has closed its end of the pipe: POLLERR on ours (waited for; the bound only fails a
    daemon that never lets go)."""
    p = select.poll()
    p.register(w, select.POLLERR)
    return bool(p.poll(30_000))


def raw_message(index: int, end: int, reserved: int = 0) -> bytes:
    return struct.pack("<IIQ", index, reserved, end)
