"""A streamed restore through a real daemon on a real socket: chunks land as their records are supplied and
never before; what needs no supply (holes, a parent's records); staging; a streamed verify; the request; the
bench (stream_daemon_fixture.py says how the images are made)."""
from __future__ import annotations

import gc
import os
import subprocess
import sys
import weakref

import pytest
from helpers import ROOT, engine, memfd, open_dir, run
from stream_daemon_fixture import CHUNK, SIZES, Image, Targets, dump_image, open_streamed, restored_up_to, still_running

from vramd.client import SESSION_DUMP, SESSION_RESTORE, SESSION_VERIFY, Client
from vramd.errors import ForeignDataFileError, TruncatedDataError
from vramd.hostmem.staging import buffer_unit
from vramd.image.supply import encode
from vramd.pb import rpc_pb2 as rpc
from vramd.protocol import requests
from vramd.protocol.requests import OpenSpec
from vramd.testing import DaemonProcess
from vramd.testing.transcript import fd_role

MiB = 1 << 20


@pytest.fixture
def image(tmp_path):
    return Image(tmp_path)


@pytest.fixture
def targets():
    t = Targets()
    yield t
    t.close()


def test_a_restore_streamed_in_pieces_lands_as_they_are_supplied(daemon, image, targets):
    """The data file is written and supplied in three pieces (the first piece cut inside the header, so even
    the header waits); after each, exactly the chunks whose records were supplied have landed and the session
    still runs; after the last and the pipe's end, it is DONE and byte-exact."""
    total = sum(SIZES.values())
    with Client(daemon.socket) as c:
        s, w = open_streamed(c, image, targets)
        try:
            assert still_running(c, s.token).progress.bytes_done == 0  # nothing supplied, nothing read
            image.fill(0, 16)
            os.write(w, encode(0, 16))  # inside the header: nothing readable yet
            assert still_running(c, s.token).progress.bytes_done == 0
            for n in (2, 5):
                end = image.cut(n)
                image.fill(16 if n == 2 else image.cut(2), end)
                os.write(w, encode(0, end))
                info = restored_up_to(c, s.token, image.covered(end))
                assert info.progress.bytes_done == image.covered(end) < total
                assert still_running(c, s.token).progress.bytes_done == image.covered(end)
            image.fill(image.cut(5), len(image.data))
            os.write(w, encode(0, len(image.data)))
        finally:
            os.close(w)
        info = c.wait(s.token)
        assert info.state == rpc.SESSION_DONE and info.progress.bytes_done == total
        c.close_session(s.token)
    assert targets.contents() == image.contents


def test_a_supply_that_comes_before_the_files_are_attached_waits_for_them(daemon, image, targets):
    """Every message written (and the pipe closed) before OpenSession: the daemon reads them at once, before the
    client has attached the data files; the headers are checked once they are, and the restore completes."""
    image.fill(0, len(image.data))
    r, w = os.pipe2(os.O_CLOEXEC)
    os.write(w, encode(0, 16) + encode(0, len(image.data)))
    os.close(w)
    dfd = open_dir(image.dst)
    try:
        with Client(daemon.socket) as c:
            s = c.open_session(SESSION_RESTORE, dfd, supply_fd=r)
            os.close(r)
            c.add_bos(s.token, targets.bos())
            c.start(s.token)
            assert c.wait(s.token).state == rpc.SESSION_DONE
            c.close_session(s.token)
    finally:
        os.close(dfd)
    assert targets.contents() == image.contents


def test_bytes_never_supplied_are_never_read_and_the_pipes_end_names_them(daemon, image, targets):
    """The part after the first 3 chunks holds garbage no record check passes, never supplied: the restore
    reaches exactly the supplied chunks, then the pipe's end fails it naming the data file, how far it was
    supplied, and the first chunk that was not restored (not a CORRUPT_CHUNK: the garbage was never read)."""
    cut = image.cut(3)
    image.fill(0, cut)
    image.garbage(cut)
    with Client(daemon.socket) as c:
        s, w = open_streamed(c, image, targets)
        try:
            os.write(w, encode(0, cut))
            assert restored_up_to(c, s.token, image.covered(cut)).progress.bytes_done == image.covered(cut)
            assert still_running(c, s.token).progress.bytes_done == image.covered(cut)
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


def test_a_batch_takes_beside_its_first_chunk_no_chunk_that_is_not_supplied(run_dir, tmp_path, image, targets):
    """One batch in flight per lane: BO 1's last chunk (12345 bytes, supplied) is a batch's first, and BO 2's
    chunk (300 KiB, garbage, never supplied) would fit beside it in the same staging buffer; it is left out,
    so the pipe's end fails the restore naming BO 2 (TRUNCATED_DATA), never a CORRUPT_CHUNK of bytes read."""
    cfg = tmp_path / "vramd.toml"
    cfg.write_text('staging_budget = "64M"\nchunk_size = "1M"\ninflight_per_gpu = 1\n')
    cut = image.cut(7)  # BO 1 whole (7 chunks); BO 2's record after it
    assert image.chunks[6][:2] == (1, 6 * CHUNK) and image.chunks[7][:2] == (2, 0)
    image.fill(0, cut)
    image.garbage(cut)
    with DaemonProcess(run_dir, "--config", str(cfg)) as d, Client(d.socket) as c:
        s, w = open_streamed(c, image, targets)
        try:
            os.write(w, encode(0, cut))
        finally:
            os.close(w)
        with pytest.raises(TruncatedDataError) as e:
            c.wait(s.token)
        assert (e.value.bo_id, e.value.offset) == (2, 0)
        c.close_session(s.token)
    assert targets.contents()[1] == image.contents[1]


def test_a_session_that_waits_for_its_supply_holds_no_staging(run_dir, tmp_path, image, targets):
    """A daemon whose staging budget is the least it starts with (4 buffers of a 1 MiB chunk) and whose lanes
    keep 8 batches in flight: a streamed restore that is never supplied has every chunk to take, yet holds no
    buffer, and an ordinary restore on another connection completes meanwhile; then the streamed one is
    supplied and completes too."""
    budget = 4 * buffer_unit(CHUNK)
    cfg = tmp_path / "vramd.toml"
    cfg.write_text(f'staging_budget = {budget}\nchunk_size = "1M"\ninflight_per_gpu = 8\n')
    with DaemonProcess(run_dir, "--config", str(cfg)) as d, Client(d.socket) as c:
        s, w = open_streamed(c, image, targets)
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
            assert still_running(c, s.token).progress.bytes_done == 0
            image.fill(0, len(image.data))
            os.write(w, encode(0, len(image.data)))
        finally:
            os.close(w)
        assert c.wait(s.token).state == rpc.SESSION_DONE
        c.close_session(s.token)
    assert targets.contents() == image.contents


def test_holes_and_a_parents_records_need_no_supply(daemon, tmp_path, targets):
    """An incremental image over a complete parent, with a hole: before any byte is supplied, exactly the hole
    and the chunks whose records are the parent's have landed; the image's own records wait for their supply."""
    parent = tmp_path / "parent"
    parent.mkdir()
    rnd = {k: os.urandom(CHUNK) for k in range(8)}
    zero, tail = bytes(CHUNK), os.urandom(SIZES[1] - 6 * CHUNK)
    dump_image(parent, {1: rnd[0] + rnd[1] + rnd[2] + zero + rnd[3] + rnd[4] + tail, 2: rnd[5][:SIZES[2]]})
    child = {1: rnd[0] + rnd[1] + rnd[6] + zero + rnd[7] + rnd[4] + tail, 2: rnd[5][:SIZES[2]]}
    (tmp_path / "child").mkdir()
    image = Image(tmp_path / "child", child, parent)
    assert [c[:2] for c in image.chunks] == [(1, 2 * CHUNK), (1, 4 * CHUNK)]  # the changed chunks only
    assert image.free == sum(SIZES.values()) - 2 * CHUNK
    with Client(daemon.socket) as c:
        s, w = open_streamed(c, image, targets, parent=parent)
        try:
            assert restored_up_to(c, s.token, image.free).progress.bytes_done == image.free
            assert still_running(c, s.token).progress.bytes_done == image.free
            image.fill(0, len(image.data))
            os.write(w, encode(0, len(image.data)))
        finally:
            os.close(w)
        assert c.wait(s.token).state == rpc.SESSION_DONE
        c.close_session(s.token)
    assert targets.contents() == child


def test_a_streamed_verify_checks_the_header_once_supplied(daemon, image):
    """A verify streams too; a data file whose header (written last here) is another image's is refused once
    it is supplied, FOREIGN_DATA_FILE naming the file, though the records are right."""
    image.fill(0, len(image.data))
    with Client(daemon.socket) as c:
        s, w = open_streamed(c, image, None, SESSION_VERIFY)
        os.write(w, encode(0, len(image.data)))
        os.close(w)
        info = c.wait(s.token)
        assert info.state == rpc.SESSION_DONE and info.progress.bytes_done == sum(SIZES.values())
        c.close_session(s.token)
        with open(image.dst / image.name, "r+b") as f:
            f.seek(16)
            f.write(bytes(16))  # the image id in the header
        s, w = open_streamed(c, image, None, SESSION_VERIFY)
        os.write(w, encode(0, len(image.data)))
        os.close(w)
        with pytest.raises(ForeignDataFileError) as e:
            c.wait(s.token)
        assert image.name in e.value.message
        assert c.progress(s.token).progress.bytes_done == 0


def test_open_session_carries_the_supply_pipe_after_the_manifests():
    """The request: the supply fd goes after the image's and its parents' manifests, named by its index, with
    the transcript role "supply"; a dump takes none (refused before anything is sent)."""
    call = requests.open_session(OpenSpec(SESSION_RESTORE, parents=2), [10, 11, 12], supply_fd=13)
    assert call.fds == (10, 11, 12, 13) and call.roles == ("manifest:0", "manifest:1", "manifest:2", "supply")
    assert call.body.HasField("supply_fd_index") and call.body.supply_fd_index == 3
    assert not requests.open_session(OpenSpec(SESSION_RESTORE), [10]).body.HasField("supply_fd_index")
    with pytest.raises(ValueError, match="a dump takes no supply pipe"):
        requests.open_session(OpenSpec(SESSION_DUMP), [], supply_fd=13)


def test_a_recorded_streamed_open_names_the_pipe_by_its_role(daemon, image):
    """A client recording its packets lists the supply pipe as "supply", the role vramd.testing.transcript gives
    a pipe's read end (tests/transcripts/README.md): there is no fixture for it, libvramd cannot open one."""
    r, w = os.pipe2(os.O_CLOEXEC)
    dfd = open_dir(image.dst)
    try:
        assert fd_role(r, {}, []) == "supply" and fd_role(w, {}, []).startswith("other:pipe:")
        with Client(daemon.socket, record=True) as c:
            s = c.open_session(SESSION_RESTORE, dfd, supply_fd=r)
            c.close_session(s.token)
            assert c.transcript is not None
            sent = [st for st in c.transcript.steps if "send" in st]
            assert sent[1]["send"]["open_session"]["supply_fd_index"] == 1 and sent[1]["fds"] == ["manifest:0",
                                                                                                   "supply"]
    finally:
        for fd in (r, w, dfd):
            os.close(fd)


def test_the_bench_runs_and_reports_every_row(tmp_path):
    """bench/stream_daemon.py at a small size: every row, the ratio and the CPU line (it asserts each session
    ended DONE)."""
    out = subprocess.run([sys.executable, "bench/stream_daemon.py", "--size", "24MiB", "--reps", "1", "--dir",
                          str(tmp_path), "--piece", "1MiB"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    for row in ("local", "fill", "supplied", "streamed", "streamed / max(local, fill) = ", "tail (streamed",
                "daemon CPU s/GiB"):
        assert f"  {row}" in out.stdout, out.stdout


def test_a_finished_streamed_job_leaves_no_reference_cycle(tmp_path):
    """A streamed verify supplied whole and finished is freed by reference counting, as any job is (its supply,
    the pipeline's gate, called back into the pipeline: a cycle that only the cyclic GC freed)."""
    from vramd import inproc
    from vramd.backends import BoRef
    from vramd.engine import BoSpec
    from vramd.imagedir import ImageFiles, read_image

    tmp_path.joinpath("img").mkdir()
    dfd = open_dir(tmp_path / "img")
    src = memfd(os.urandom(3 * MiB + 5))

    async def go():
        async with engine(staging_budget=16 * MiB, chunk_size=MiB) as e:
            m = await inproc.dump(e, dfd, [BoSpec(1, 3 * MiB + 5, BoRef("mmap", src))])
            r, w = os.pipe2(os.O_CLOEXEC)
            try:
                with ImageFiles(dfd) as files:
                    job = e.start_verify(await read_image(files), supply_fd=r)
                    for i, f in enumerate(m.files):
                        os.write(w, encode(i, f.length))
                    os.close(w)
                    w = -1
                    await job.finish()
                    return weakref.ref(job), weakref.ref(job.pipeline), weakref.ref(job.supply)
            finally:
                for fd in (r, w):
                    if fd >= 0:
                        os.close(fd)
    gc.collect()
    gc.disable()
    try:
        refs = run(go())
        assert [r() for r in refs] == [None] * 3, "the finished streamed job is only reachable through a cycle"
    finally:
        gc.enable()
        os.close(dfd)
        os.close(src)
