"""vramd.inproc runs the daemon's own session path in this process: its requests are the daemon's, its files the
client's side (vramd.imagedir), its sessions end with it."""
import os

import pytest
from helpers import engine, memfd, run

from vramd import errors, inproc
from vramd.backends import BoRef
from vramd.engine import BoSpec
from vramd.image.names import MANIFEST_NAME
from vramd.imagedir import DumpDirectory, ImageFiles, SessionFiles
from vramd.pb import rpc_pb2 as rpc
from vramd.protocol import ClientBo, OpenSpec

MiB = 1 << 20


def test_a_dump_in_process_is_served_request_by_request_by_the_daemons_handlers(image_dir):
    path, dfd = image_dir
    data = os.urandom(2 * MiB)
    fd = memfd(data)

    async def go():
        async with engine(staging_budget=16 * MiB, chunk_size=MiB) as e, inproc.InProcess(e) as host:
            conn = await host.connect()
            info = await conn.open_session(OpenSpec(rpc.SESSION_DUMP), SessionFiles(ImageFiles(None),
                                                                                     DumpDirectory(dfd)))
            assert [s.token for s in host.daemon.sessions] == [info.token]  # the daemon's session table holds it
            await conn.add_bos(info.token, [ClientBo(1, fd, size=len(data), backend="mmap")])
            await conn.start(info.token)
            done = await conn.wait(info.token)  # DONE: committed by this side
            await conn.close_session(info.token)
            assert len(host.daemon.sessions) == 0
            counted = {t: host.daemon.metrics.get("vramd_requests_total", type=t)
                       for t in ("open_session", "attach_files", "add_bos", "start", "wait", "close_session")}
            return done, counted
    try:
        done, counted = run(go())
    finally:
        os.close(fd)
    assert done.state == rpc.SESSION_DONE and done.image.bo_count == 1
    assert counted == {"open_session": 1, "attach_files": 1, "add_bos": 1, "start": 1, "wait": 1, "close_session": 1}
    assert MANIFEST_NAME in os.listdir(path) and not [n for n in os.listdir(path) if n.endswith(".tmp")]


def _is_open(fd):
    try:
        os.fstat(fd)
        return True
    except OSError:
        return False


def test_an_fd_that_is_not_open_is_refused_unsent_and_the_session_goes_on(image_dir):
    _, dfd = image_dir
    fd = memfd(os.urandom(MiB))
    closed = next(n for n in range(999, 100, -1) if not _is_open(n))

    async def go():
        async with engine(staging_budget=16 * MiB, chunk_size=MiB) as e, await inproc.start_dump(e, dfd) as s:
            with pytest.raises(errors.BadDescriptorError, match=f"fd {closed} is not usable"):
                await s.add([BoSpec(1, MiB, BoRef("mmap", closed))])
            await s.add([BoSpec(2, MiB, BoRef("mmap", fd))])  # the connection is still in step
            return await s.finish()
    try:
        m = run(go())
    finally:
        os.close(fd)
    assert [bo.id for bo in m.bos] == [2]


def test_closing_an_unfinished_dump_ends_its_session_and_removes_its_files(image_dir):
    path, dfd = image_dir
    fd = memfd(os.urandom(4 * MiB))

    async def go():
        async with engine(staging_budget=16 * MiB, chunk_size=MiB) as e:
            s = await inproc.start_dump(e, dfd)
            await s.add([BoSpec(1, 4 * MiB, BoRef("mmap", fd))])
            daemon = s.host.daemon
            assert any(n.endswith(".vrd.tmp") for n in os.listdir(path))  # its data files, made by this side
            await s.close()  # never started: cancelled, its files removed, the directory unlocked
            assert len(daemon.sessions) == 0 and e.pool.in_use_bytes == 0
            assert os.listdir(path) == []
            return await inproc.dump(e, dfd, [BoSpec(1, 4 * MiB, BoRef("mmap", fd))])  # the lock was released
    try:
        m = run(go())
    finally:
        os.close(fd)
    assert m.totals.bo_bytes == 4 * MiB
