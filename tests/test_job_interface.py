"""The Job interface a session drives (vramd.engine.jobs.interface): a real engine's jobs, no daemon.

What each job needs from the client (files, a dump's own data files, the
manifest's file at Start) and how an AddBos's BOs become its items (`intake`):
the GPU check, a dump's data-file check and chunk count, a verify's refusal.
"""
from __future__ import annotations

import os

import pytest
import uvloop
from helpers import memfd

from vramd.backends import BoRef
from vramd.client import SESSION_DUMP, SESSION_RESTORE, SESSION_VERIFY, Client, ClientBo
from vramd.engine import Engine, EngineConfig
from vramd.engine.jobs import Job
from vramd.errors import InvalidRequestError, JobCancelledError
from vramd.image.names import data_file_name, manifest_tmp_name
from vramd.pb import rpc_pb2 as rpc

MiB = 1 << 20
IMAGE_ID = bytes(range(16))


def with_dump(body):
    """Run `body(job)` on a real dump job of a real engine (1 MiB chunks), then cancel and end it."""
    async def main():
        engine = Engine(EngineConfig(staging_budget=16 * MiB, chunk_size=MiB))
        try:
            job: Job = engine.start_dump(IMAGE_ID)
            try:
                await body(job)
            finally:
                job.cancel("the test is over")
                with pytest.raises(JobCancelledError):
                    await job.finish()
        finally:
            engine.close()
    uvloop.run(main())


def test_a_dump_needs_its_own_data_files_then_its_manifest_at_start(tmp_path):
    async def body(job: Job) -> None:
        assert job.files_needed() == [] and job.ready  # no parent: nothing to read
        assert job.data_files_per_gpu >= 1
        assert job.manifest_name == manifest_tmp_name(IMAGE_ID)
        with pytest.raises(InvalidRequestError, match="a dump without a parent needs only its own data files"):
            await job.attach_file(1, "parent.vrd", 0, None)
        want = data_file_name(IMAGE_ID, 0)
        fd = os.open(tmp_path / f"{want}.tmp", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        with pytest.raises(InvalidRequestError, match=f"the data file of gpu_id 0x0 must be {want}"):
            job.attach_data_file(0, "other.vrd", 0, 0, fd, None)
        w = job.attach_data_file(0, want, 0, 0, fd, None)
        job.publish_data_files([w])
        with pytest.raises(InvalidRequestError, match=f"Start names the manifest's file .*{job.manifest_name}"):
            job.seal(None)
    with_dump(body)


def test_a_dumps_bos_are_checked_and_counted_before_any_is_taken(tmp_path):
    async def body(job: Job) -> None:
        intake = job.intake(frozenset({0, 1}))
        ref = BoRef("mmap", 0, 0)  # never opened: the intake only checks and counts
        intake.take(rpc.Bo(id=1, size=0, fd_index=0), ref)  # an empty BO needs no data file
        with pytest.raises(InvalidRequestError, match="no data file is attached for gpu_id 0x1") as e:
            intake.take(rpc.Bo(id=2, size=4096, fd_index=0, gpu_id=1), ref)
        assert e.value.bo_id == 2
        with pytest.raises(InvalidRequestError, match=r"gpu_id 0x7 is not a GPU of this daemon \(known: 0x0, 0x1\)"):
            intake.take(rpc.Bo(id=3, size=4096, fd_index=0, gpu_id=7), ref)
        want = data_file_name(IMAGE_ID, 1)
        fd = os.open(tmp_path / f"{want}.tmp", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        job.publish_data_files([job.attach_data_file(0, want, 1, 0, fd, None)])
        intake.take(rpc.Bo(id=2, size=2 * MiB + 1, fd_index=0, gpu_id=1), ref)
        assert (len(intake), intake.chunks, intake.chunk_size) == (2, 3, MiB)  # the refused BOs made no item
        intake.drop()  # nothing was opened ahead: nothing to release
    with_dump(body)


def test_through_a_daemon_a_verify_takes_no_bos_and_a_restore_maps_no_unknown_gpu(daemon, image_dir):
    """The same interface behind a real socket: a verify session refuses an AddBos (its job's intake), and a
    restore target naming a GPU the daemon does not know is refused before any fd is taken; both sessions
    go on as they were."""
    _, dfd = image_dir
    content = os.urandom(3 * 4096)
    src, dst = memfd(content), memfd(size=len(content))
    try:
        with Client(daemon.socket) as c:
            d = c.run_session(SESSION_DUMP, dfd, [ClientBo(1, src, size=len(content))])
            assert d.state == rpc.SESSION_DONE
            v = c.open_session(SESSION_VERIFY, dfd)
            with pytest.raises(InvalidRequestError, match="a verify session takes no BOs"):
                c.add_bos(v.token, [ClientBo(1, dst)])
            assert c.wait(v.token).state == rpc.SESSION_DONE  # verified all the same
            r = c.open_session(SESSION_RESTORE, dfd)
            with pytest.raises(InvalidRequestError, match="gpu_id 0x4d2 is not a GPU of this daemon") as e:
                c.add_bos(r.token, [ClientBo(1, dst, gpu_id=1234)])
            assert e.value.bo_id == 1
            assert c.progress(r.token).state == rpc.SESSION_OPEN and c.progress(r.token).progress.bos_total == 0
            c.add_bos(r.token, [ClientBo(1, dst)])
            c.start(r.token)
            assert c.wait(r.token).state == rpc.SESSION_DONE
        assert os.pread(dst, len(content) + 1, 0) == content
    finally:
        os.close(src)
        os.close(dst)
