"""How the service layer treats cancellation and everyday I/O errors (issue #12, findings 7 and 8).

Unit level, no socket: handlers.dispatch and Session._finish with stand-ins
for the daemon, the connection and the job.  Then one real daemon: a Wait
whose client hung up leaves no hold on its session.
"""
from __future__ import annotations

import asyncio
import errno
import logging
import socket
from types import SimpleNamespace

import pytest
import uvloop

from vramd.client import SESSION_DUMP, Client
from vramd.engine.pipeline import Progress
from vramd.pb import rpc_pb2 as rpc
from vramd.protocol import PROTOCOL_VERSIONS, FdBundle, decode_response, encode_request
from vramd.service import handlers
from vramd.service.metrics import Metrics
from vramd.service.sessions import Session, SessionLimits, UidLimits, UidUsage
from vramd.service.systemd import JournalFormatter


def fake_daemon(session=None):
    table = SimpleNamespace(get=lambda token, uid: session, hold=lambda s, conn: None)
    return SimpleNamespace(metrics=Metrics(), sessions=table)


def fake_conn():
    return SimpleNamespace(id=1, pid=2, uid=0, sessions=set(), waiting=None)


def decoded(reply) -> rpc.Response:
    return decode_response(reply.data)


# --- finding 7: CancelledError ---------------------------------------------------------

def test_cancelling_the_handler_task_itself_propagates(monkeypatch):
    entered = None

    async def stuck(daemon, conn, rid, body, fds):
        entered.set()
        await asyncio.Event().wait()

    monkeypatch.setitem(handlers.HANDLERS, "get_status", stuck)

    async def main():
        nonlocal entered
        entered = asyncio.Event()
        req = rpc.Request(id=5, get_status=rpc.GetStatus())
        task = asyncio.get_running_loop().create_task(handlers.dispatch(fake_daemon(), fake_conn(), req, FdBundle([])))
        await entered.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task  # not swallowed into a reply, nor into None
        assert task.cancelled()

    uvloop.run(main())


def test_an_abandoned_wait_is_nobody_to_answer_but_the_task_goes_on():
    async def main():
        waiting = asyncio.Event()

        class Forever:
            id = 3

            async def wait(self, timeout):
                waiting.set()
                await asyncio.Event().wait()

        conn = fake_conn()
        req = rpc.Request(id=7, wait=rpc.Wait(token="t"))
        task = asyncio.get_running_loop().create_task(
            handlers.dispatch(fake_daemon(Forever()), conn, req, FdBundle([])))
        await waiting.wait()
        conn.waiting.cancel()  # what the connection does when its peer hangs up
        assert await task is None
        assert conn.waiting is None and not task.cancelled()

    uvloop.run(main())


# --- finding 8: OSError is an everyday error, typed and logged once ----------------------------

def test_an_oserror_in_a_handler_is_typed_not_internal(monkeypatch, caplog):
    async def full_disk(daemon, conn, rid, body, fds):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setitem(handlers.HANDLERS, "open_session", full_disk)
    req = rpc.Request(id=9, open_session=rpc.OpenSession(kind=rpc.SESSION_DUMP))
    with caplog.at_level(logging.DEBUG, logger="vramd"):
        out = uvloop.run(handlers.dispatch(fake_daemon(), fake_conn(), req, FdBundle([])))
    resp = decoded(out)
    assert resp.id == 9 and resp.error.code == rpc.JOB_ERROR
    assert resp.error.message == "open_session failed: No space left on device"
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and warnings[0].levelno == logging.WARNING and not warnings[0].exc_info


class FailingJob:
    """A job whose finish fails the way the daemon's own I/O does (e.g. a full disk at commit): what a session
    uses of the Job interface (engine/jobs/interface.py) to seal and end it."""

    error = None  # not failed before it finishes
    ready = True  # needs no file
    manifest_name = None  # Start gives no file

    def seal(self, manifest_fd):
        assert manifest_fd is None

    def __init__(self, exc: BaseException) -> None:
        self.exc = exc
        self.progress = Progress(bos_total=2, bos_done=2, bytes_total=8192, bytes_done=8192)

    def on_fail(self, callback):
        pass

    def cancel(self, reason=""):
        pass

    async def finish(self):
        raise self.exc


def run_finish(job) -> Session:
    async def main():
        usage = UidUsage(UidLimits(10, 10))
        r, w = socket.socketpair()  # two fds for the session to own and close
        w.close()
        s = Session(1, rpc.SESSION_DUMP, 0, 123, "lbl", job, SessionLimits(10, 10), Metrics(), usage,
                    fds=[r.detach()])
        await s.seal()
        await s.wait(None)
        assert usage.fds == 0 and s.fds == []  # the session's fds are closed
        return s
    return uvloop.run(main())


def test_an_oserror_ending_a_session_is_typed_and_logged_once(caplog):
    with caplog.at_level(logging.DEBUG, logger="vramd"):
        s = run_finish(FailingJob(OSError(errno.EIO, "Input/output error")))
    assert s.state == rpc.SESSION_FAILED and s.error.code == "JOB_ERROR"
    assert s.error.message == "dump failed: Input/output error"
    assert s.info().error.code == rpc.JOB_ERROR
    logged = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(logged) == 1 and not logged[0].exc_info  # one line, no traceback
    line = logged[0].getMessage()
    assert line.startswith("session 1 (dump, uid 0, pid 123): SESSION_FAILED: 2/2 BOs, 8192/8192 bytes in ")
    assert " GB/s [lbl]: JOB_ERROR: dump failed: Input/output error" in line


def test_a_bug_ending_a_session_is_internal_with_one_traceback(caplog):
    with caplog.at_level(logging.DEBUG, logger="vramd"):
        s = run_finish(FailingJob(KeyError("oops")))
    assert s.error.code == "INTERNAL"
    assert sum(1 for r in caplog.records if r.exc_info) == 1


def test_a_done_session_summary_is_info():
    class Done(FailingJob):
        async def finish(self):
            from vramd.pb import image_pb2 as pb
            return pb.Manifest()
    s = run_finish(Done(None))
    assert s.state == rpc.SESSION_DONE
    assert "SESSION_DONE: 2/2 BOs, 8192/8192 bytes in" in s.summary() and "GB/s [lbl]" in s.summary()


def test_journal_prefixes_every_line_with_its_priority():
    fmt = JournalFormatter("%(levelname)s %(message)s")

    def line(level, msg):
        return fmt.format(logging.LogRecord("vramd", level, __file__, 1, msg, None, None))

    assert line(logging.ERROR, "e") == "<3>ERROR e"
    assert line(logging.CRITICAL, "c") == "<3>CRITICAL c"
    assert line(logging.WARNING, "w") == "<4>WARNING w"
    assert line(logging.INFO, "i") == "<6>INFO i"
    assert line(logging.DEBUG, "two\nlines") == "<7>DEBUG two\n<7>lines"  # journald reads each line alone


# --- a Wait whose client hung up, through the real daemon -------------------------------------

def test_a_wait_whose_client_hung_up_does_not_hold_the_session(daemon, image_dir):
    with Client(daemon.socket) as opener:
        s = opener.open_session(SESSION_DUMP, image_dir[1], label="held?")
        raw = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        raw.settimeout(30)
        raw.connect(daemon.socket)
        raw.sendmsg([encode_request(rpc.Request(id=1, hello=rpc.Hello(versions=list(PROTOCOL_VERSIONS))))])
        assert decode_response(raw.recv(1 << 20)).hello.version == PROTOCOL_VERSIONS[-1]
        raw.sendmsg([encode_request(rpc.Request(id=2, wait=rpc.Wait(token=s.token)))])
        m = daemon.expect_log(rf"connection (\d+) waits for session {s.session_id}")
        assert opener.progress(s.token).holders == 2
        raw.close()
        daemon.expect_log(rf"connection {m.group(1)} closed")
        assert opener.progress(s.token).holders == 1  # the waiter let go
    # the opener is gone too: nobody holds it, so it is reaped after the grace period
    daemon.expect_log(rf"session {s.session_id} \(dump, uid \d+, pid \d+\): SESSION_CANCELLED")


def test_an_error_code_this_client_does_not_know_is_still_typed():
    """Found by the fuzz harness: a newer daemon's code made the client raise ValueError."""
    from vramd.errors import VramdError
    from vramd.protocol import error_from_pb
    e = error_from_pb(rpc.Error(code=9, message="a newer daemon's error"))
    assert type(e) is VramdError and e.code == "CODE_9" and e.message == "a newer daemon's error"


def test_a_session_that_ends_during_an_attach_answers_its_own_error(tmp_path):
    """One AttachFiles message: a dump's own data file, then a parent's file whose check awaits (a thread's
    read, here held by the test).  The session is cancelled meanwhile: its job ends and its writer closes,
    but it closes the fds it holds only once the message is done with them.  The message is answered with
    the session's error, not INTERNAL; every fd is closed once and uncounted."""
    import os

    from vramd.engine import DumpJob
    from vramd.errors import JobCancelledError
    from vramd.image.names import data_file_name
    from vramd.image.writer import ImageWriter
    from vramd.pb import image_pb2 as pb

    image_id = bytes(range(16))
    own_path, parent_path = tmp_path / (data_file_name(image_id, 0) + ".tmp"), tmp_path / "parent.vrd"

    class Parent:  # the parent image's reader: its header check waits for the test
        def __init__(self) -> None:
            self.entered, self.go = asyncio.Event(), asyncio.Event()

        async def attach(self, image, name, fd, direct):
            self.entered.set()
            await self.go.wait()

    class Dump(DumpJob):  # the job's ending as a cancelled dump's: its image writer closed, then the error
        error = None
        progress = Progress()

        def __init__(self, writer: ImageWriter) -> None:
            self.writer, self.parent, self.reason = writer, Parent(), ""

        def on_fail(self, callback):
            pass

        def cancel(self, reason=""):
            self.reason = reason

        async def finish(self):
            await self.writer.aclose()
            writer_closed.set()
            raise JobCancelledError(self.reason)

    def open_as(fd: int) -> str | None:
        try:
            return os.readlink(f"/proc/self/fd/{fd}")
        except FileNotFoundError:
            return None

    writer_closed: asyncio.Event

    async def main():
        nonlocal writer_closed
        writer_closed = asyncio.Event()
        writer = ImageWriter(image_id, chunk_size=1 << 20, compression=pb.Compression(codec=pb.CODEC_RAW), stripes=2)
        job = Dump(writer)
        usage = UidUsage(UidLimits(10, 10))
        s = Session(1, rpc.SESSION_DUMP, 0, 1, "", job, SessionLimits(10, 10), Metrics(), usage, image_id=image_id)
        own = os.open(own_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        parent = os.open(parent_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        files = [rpc.FileRef(name=data_file_name(image_id, 0), fd_index=0, gpu_id=0),
                 rpc.FileRef(image=1, name="data-0001020304050607-00000000.vrd", fd_index=1)]
        attach = asyncio.get_running_loop().create_task(s.attach(files, FdBundle([own, parent])))
        await job.parent.entered.wait()
        assert usage.fds == 2
        s.cancel("cancelled by the test")
        await writer_closed.wait()  # the job has ended...
        assert not s.done and open_as(own) == str(own_path)  # ...but the fds the message uses stay open
        job.parent.go.set()
        with pytest.raises(JobCancelledError, match="cancelled by the test"):
            await attach
        await s.wait(None)
        assert s.state == rpc.SESSION_CANCELLED and usage.fds == 0 and s.fds == []
        assert open_as(own) != str(own_path) and open_as(parent) != str(parent_path)  # closed
    uvloop.run(main())


def test_a_closed_session_is_forgotten_by_every_connection_that_held_it():
    """Two connections hold a dump (each named its token); one closes it.  The other forgets it too: no token
    reaches it any more, and a long-lived connection that looked at many sessions others closed kept every
    one of them, with its job, for as long as it lived (3000 of them: +42 MB in the daemon)."""
    from vramd.engine import Engine, EngineConfig
    from vramd.service.session_table import SessionTable

    async def main():
        engine = Engine(EngineConfig(staging_budget=16 << 20))
        try:
            table = SessionTable(engine, Metrics(), grace_period=30.0, max_per_uid=4,
                                 limits=SessionLimits(10, 10))
            s = await table.open(rpc.OpenSession(kind=rpc.SESSION_DUMP), FdBundle([]), uid=0, pid=1)
            class Conn:  # what the table needs of a connection: the sessions it holds
                def __init__(self) -> None:
                    self.sessions: set[Session] = set()
            opener, watcher = Conn(), Conn()
            for conn in (opener, watcher):
                table.hold(s, conn)
                conn.sessions.add(s)
            await table.close(s)
            assert s.done and len(table) == 0
            assert s not in watcher.sessions and s not in opener.sessions and not s.holders
        finally:
            engine.close()
    uvloop.run(main())
