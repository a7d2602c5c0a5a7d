"""The client machine on its own (vramd.protocol.ClientMachine): every state and step, every error path.

A scripted daemon answers each request by its kind; a scripted file side answers the file events with
made-up fd numbers (the machine never opens, closes or names a file, so none has to exist).  Packets go
through the real frame codec both ways (`receive` takes the framed bytes), so what is checked is what a
socket would carry.
"""
from __future__ import annotations

import errno
import os
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest

from vramd.errors import (
    JobCancelledError,
    LimitExceededError,
    PermissionDeniedError,
    ProtocolError,
    UnsupportedProtocolError,
    VramdError,
    WaitTimeoutError,
)
from vramd.image import format as image_format
from vramd.pb import rpc_pb2 as rpc
from vramd.protocol import (
    BeginDump,
    Call,
    ClientBo,
    ClientFile,
    ClientMachine,
    Commit,
    ConnState,
    CreateDataFile,
    CreateManifest,
    Done,
    DropDataFiles,
    Event,
    Failed,
    OpenDataFile,
    OpenManifest,
    OpenSpec,
    ReleaseFiles,
    Send,
    SessionPhase,
    error_to_pb,
    requests,
)
from vramd.protocol.frames import KIND_RESPONSE, encode_frame

TOKEN = "0123456789abcdef" * 2
IMAGE_ID = bytes(range(16))
Answer = Callable[[rpc.Request], rpc.Response]


def session(**kw: object) -> Answer:
    return lambda req: rpc.Response(id=req.id, session=rpc.SessionInfo(**kw))


def refuse(err: VramdError, *, request_id: int | None = None) -> Answer:
    return lambda req: rpc.Response(id=req.id if request_id is None else request_id, error=error_to_pb(err))


@dataclass
class Daemon:
    """Answers each request by the name of its body: `answers[name]` (a list: one per request, in turn)."""

    hello: rpc.HelloReply = field(default_factory=lambda: rpc.HelloReply(version=2, allowed_gpu_ids=[0, 1]))
    answers: dict[str, list[Answer]] = field(default_factory=dict)
    seen: list[rpc.Request] = field(default_factory=list)

    def __call__(self, req: rpc.Request) -> rpc.Response:
        self.seen.append(req)
        name = req.WhichOneof("body")
        queued = self.answers.get(name)
        if queued:
            return queued.pop(0)(req)
        if name == "hello":
            return rpc.Response(id=req.id, hello=self.hello)
        if name == "open_session":
            return session(token=TOKEN, image_id=IMAGE_ID, data_files_per_gpu=1)(req)
        if name == "get_status":
            return rpc.Response(id=req.id, status=rpc.StatusReply(server="fake"))
        if name == "list_sessions":
            return rpc.Response(id=req.id, sessions=rpc.SessionList())
        if name == "wait":
            return session(state=rpc.SESSION_DONE)(req)
        return session(state=rpc.SESSION_OPEN)(req)

    def names(self) -> list[str]:
        return [str(r.WhichOneof("body")) for r in self.seen]


@dataclass
class Files:
    """The adapter's file side: made-up fds; `fail(event)` returns an error to answer with, or None."""

    fail: Callable[[Event], BaseException | None] = lambda e: None
    events: list[Event] = field(default_factory=list)
    next_fd: int = 100

    def fd(self) -> int:
        self.next_fd += 1
        return self.next_fd

    def answer(self, m: ClientMachine, e: Event) -> None:
        self.events.append(e)
        err = self.fail(e)
        if err is not None:
            m.fail(err)
        elif isinstance(e, (OpenManifest, CreateManifest)):
            m.provide_fd(self.fd())
        elif isinstance(e, OpenDataFile):
            m.provide_file(ClientFile(e.image, e.name, self.fd(), self.fd()))
        elif isinstance(e, CreateDataFile):
            name = image_format.data_file_name(IMAGE_ID, e.gpu_id, e.stripe)
            m.provide_file(ClientFile(0, name, self.fd(), self.fd(), e.gpu_id, e.stripe))
        else:
            m.acknowledge()


def drive(m: ClientMachine, daemon: Daemon, files: Files | None = None) -> Done | Failed:
    """Take the operation under way to its end, the daemon answering each packet through the frame codec."""
    files = files if files is not None else Files()
    while True:
        e = m.next_event()
        if isinstance(e, (Done, Failed)):
            return e
        if isinstance(e, Send):
            m.receive(encode_frame(KIND_RESPONSE, daemon(e.packet.request)))
        else:
            files.answer(m, e)


def ready(daemon: Daemon | None = None, **kw: object) -> tuple[ClientMachine, Daemon]:
    """A machine whose Hello was answered."""
    daemon = daemon if daemon is not None else Daemon()
    m = ClientMachine("test 0", record=True, **kw)  # type: ignore[arg-type]
    m.say_hello()
    assert isinstance(drive(m, daemon), Done)
    return m, daemon


def opened(kind: rpc.SessionKind = rpc.SESSION_DUMP, daemon: Daemon | None = None, files: Files | None = None,
           **spec: object) -> tuple[ClientMachine, Daemon, Files]:
    m, daemon = ready(daemon)
    files = files if files is not None else Files()
    m.open_session(OpenSpec(kind, **spec))  # type: ignore[arg-type]
    end = drive(m, daemon, files)
    assert isinstance(end, Done), end
    return m, daemon, files


def failed(end: Done | Failed, kind: type[BaseException], match: str = "") -> BaseException:
    assert isinstance(end, Failed), end
    assert isinstance(end.error, kind), end.error
    assert match in str(end.error)
    return end.error


# --- the connection: Hello, ids, pairing, ERROR -------------------------------------------------------

def test_hello_then_one_request_at_a_time_through_the_connection_states():
    m = ClientMachine("test 0", record=True)
    daemon = Daemon()
    assert m.state is ConnState.NEW and not m.busy
    m.say_hello()
    e = m.next_event()
    assert isinstance(e, Send) and m.state is ConnState.HELLO_SENT and m.busy
    assert e.packet.request.hello.client == "test 0" and list(e.packet.request.hello.versions) == [2]
    m.receive(encode_frame(KIND_RESPONSE, daemon(e.packet.request)))
    assert isinstance(m.next_event(), Done) and m.state is ConnState.IDLE and not m.busy
    assert m.hello is not None and m.connection.version == 2
    m.status()
    e = m.next_event()
    assert isinstance(e, Send) and m.state is ConnState.WAITING and e.packet.request.id == 2
    m.receive(encode_frame(KIND_RESPONSE, daemon(e.packet.request)))
    end = m.next_event()
    assert isinstance(end, Done) and end.response.status.server == "fake" and m.state is ConnState.IDLE
    assert m.transcript is not None
    assert [next(iter(s)) for s in m.transcript.steps] == ["send", "recv", "send", "recv"]
    assert m.transcript.steps[2] == {"send": {"id": "2", "get_status": {}}, "fds": []}


def test_a_daemon_that_speaks_another_version_is_refused():
    m = ClientMachine("test 0")
    m.say_hello()
    failed(drive(m, Daemon(hello=rpc.HelloReply(version=7))), UnsupportedProtocolError, "version 7")
    assert m.state is ConnState.ERROR


def test_limits_below_the_protocols_minimum_are_a_protocol_error():
    m = ClientMachine("test 0")
    m.say_hello()
    hello = rpc.HelloReply(version=2, limits=rpc.Limits(max_message_bytes=100))
    failed(drive(m, Daemon(hello=hello)), ProtocolError, "below 4096")
    assert m.state is ConnState.ERROR


def test_a_refused_hello_is_its_typed_error_and_the_connection_is_closed():
    m = ClientMachine("test 0")
    m.say_hello()
    daemon = Daemon(answers={"hello": [refuse(PermissionDeniedError("uid 5 may not"), request_id=0)]})
    failed(drive(m, daemon), PermissionDeniedError, "uid 5 may not")
    assert m.state is ConnState.CLOSED
    with pytest.raises(ConnectionError):
        m.status()


def test_a_refusal_with_id_0_ends_the_request_waiting_and_the_connection():
    m, _ = ready()
    m.status()
    failed(drive(m, Daemon(answers={"get_status": [refuse(LimitExceededError("too many"), request_id=0)]})),
           LimitExceededError, "too many")
    assert m.state is ConnState.CLOSED


def test_a_second_hello_is_a_protocol_error():
    m, _ = ready()
    m.say_hello()
    failed(drive(m, Daemon()), ProtocolError, "Hello was sent already")
    assert m.state is ConnState.ERROR
    with pytest.raises(ProtocolError):
        m.exchange(requests.raw(rpc.Hello()))


def test_a_request_before_hello_is_a_protocol_error():
    m = ClientMachine("test 0")
    m.status()
    failed(drive(m, Daemon()), ProtocolError, "before Hello")
    assert m.state is ConnState.ERROR


def test_a_response_to_another_request_is_a_protocol_error_and_nothing_goes_after():
    m, _ = ready()
    m.progress(TOKEN)
    wrong = Daemon(answers={"get_progress": [lambda req: rpc.Response(id=req.id + 7, session=rpc.SessionInfo())]})
    failed(drive(m, wrong), ProtocolError, "expected")
    assert m.state is ConnState.ERROR
    with pytest.raises(ProtocolError, match="protocol error"):
        m.status()


def test_a_response_of_the_wrong_kind_is_a_protocol_error():
    m, _ = ready()
    m.status()
    other = Daemon(answers={"get_status": [session()]})
    failed(drive(m, other), ProtocolError, "get_status answered with session, not status")
    assert m.state is ConnState.ERROR


def test_an_error_response_needs_no_body():
    m, _ = ready()
    m.progress(TOKEN)
    failed(drive(m, Daemon(answers={"get_progress": [refuse(JobCancelledError("gone"))]})), JobCancelledError)
    assert m.state is ConnState.IDLE


def test_an_answer_nobody_asked_for_and_one_after_error_are_refused_and_their_fds_closed():
    m, _ = ready()
    with pytest.raises(ProtocolError, match="nothing was asked"):
        m.receive(encode_frame(KIND_RESPONSE, rpc.Response(id=2, session=rpc.SessionInfo())))
    assert m.state is ConnState.ERROR
    r, w = os.pipe()
    os.close(w)
    with pytest.raises(ProtocolError, match="protocol error"):
        m.connection.receive(encode_frame(KIND_RESPONSE, rpc.Response(id=2)), [r])
    with pytest.raises(OSError):
        os.fstat(r)  # closed: the daemon never sends fds


def test_a_response_when_no_request_waits_is_a_protocol_error():
    m, _ = ready()
    with pytest.raises(ProtocolError, match="to no request"):
        m.connection.receive(encode_frame(KIND_RESPONSE, rpc.Response(id=2, session=rpc.SessionInfo())))
    assert m.state is ConnState.ERROR


def test_an_undecodable_or_empty_packet():
    m, _ = ready()
    m.status()
    assert isinstance(m.next_event(), Send)
    m.receive(b"VRDP nonsense")
    failed(m.next_event(), ProtocolError)
    assert m.state is ConnState.ERROR
    m, _ = ready()
    m.status()
    assert isinstance(m.next_event(), Send)
    m.receive(b"")
    failed(m.next_event(), ConnectionError, "closed the connection")
    assert m.state is ConnState.CLOSED


def test_a_packet_the_kernel_refused_leaves_the_connection_in_step():
    m, daemon = ready()
    m.status()
    assert isinstance(m.next_event(), Send)
    m.not_sent(OSError(errno.EBADF, "Bad file descriptor"))
    failed(m.next_event(), OSError, "Bad file descriptor")
    assert m.state is ConnState.IDLE
    m.status()
    assert isinstance(drive(m, daemon), Done)
    assert m.transcript is not None and [s.get("send", {}).get("id") for s in m.transcript.steps[::2]] == ["1", "3"]


def test_the_adapter_misusing_the_machine_is_a_protocol_error():
    m, _ = ready()
    with pytest.raises(ProtocolError, match="no operation"):
        m.next_event()
    m, _ = ready()
    m.status()
    with pytest.raises(ProtocolError, match="under way"):
        m.progress(TOKEN)
    m, _ = ready()
    m.status()
    m.next_event()
    with pytest.raises(ProtocolError, match="was not answered"):
        m.next_event()
    m, _ = ready()
    m.status()
    m.next_event()
    with pytest.raises(ProtocolError, match="an answer to OpenManifest or CreateManifest, but Send"):
        m.provide_fd(3)
    assert m.state is ConnState.ERROR


# --- requests -------------------------------------------------------------------------------------

def test_requests_are_typed_and_name_their_fds():
    assert requests.start(TOKEN, 9) == Call(rpc.Start(token=TOKEN, manifest_fd_index=0), (9,), ("dump-manifest",))
    call = requests.add_bos(TOKEN, [ClientBo(1, 7), ClientBo(2, 8), ClientBo(3, 7)])
    assert call.fds == (7, 8) and call.roles == ("bo:1", "bo:2") and [b.fd_index for b in call.body.bos] == [0, 1, 0]
    call = requests.attach_files(TOKEN, [ClientFile(1, "n", 4, 5), ClientFile(0, "d", 6, None, 2, 3)])
    assert call.roles == ("data:1:n", "data:1:n+direct", "dump-data:gpu=2:stripe=3")
    assert call.answer == "session" and requests.get_status().answer == "status"
    with pytest.raises(ValueError, match="exactly one"):
        requests.cancel(token=TOKEN, session_id=3)
    with pytest.raises(ValueError, match="roles"):
        Call(rpc.GetStatus(), (3,), ())


def test_the_format_rules_the_machine_checks_are_the_image_formats():
    assert requests.MAX_DATA_FILES_PER_GPU == image_format.MAX_STRIPES
    assert requests.DATA_FILE_NAME.pattern == image_format.DATA_FILE_NAME.pattern


def test_bos_are_packed_under_the_negotiated_limits_with_their_fd_roles():
    hello = rpc.HelloReply(version=2, limits=rpc.Limits(max_message_bytes=8192, max_fds_per_message=4))
    m, daemon = ready(Daemon(hello=hello))
    bos = [ClientBo(i, 100 + i // 3, size=4096, name="n" * 40) for i in range(60)]
    m.add_bos(TOKEN, bos)
    assert isinstance(drive(m, daemon), Done)
    sent = [r.add_bos for r in daemon.seen if r.WhichOneof("body") == "add_bos"]
    assert len(sent) > 1 and [b.id for msg in sent for b in msg.bos] == list(range(60))
    assert all(r.ByteSize() < 8192 - 1024 for r in daemon.seen)
    assert m.transcript is not None
    steps = [s for s in m.transcript.steps if "add_bos" in s.get("send", {})]  # type: ignore[operator]
    for s, msg in zip(steps, sent, strict=True):
        roles = s["fds"]
        assert isinstance(roles, list) and 1 <= len(roles) <= 4
        first = {b.fd_index: b.id for b in reversed(msg.bos)}  # each fd's first BO in the message
        assert roles == [f"bo:{first[i]}" for i in range(len(roles))]


def test_add_bos_without_bos_is_progress():
    m, daemon = ready()
    m.add_bos(TOKEN, [])
    assert isinstance(drive(m, daemon), Done) and daemon.names()[-1] == "get_progress"


# --- a dump ---------------------------------------------------------------------------------------

def test_a_dump_from_open_to_commit():
    daemon = Daemon(answers={"open_session": [session(token=TOKEN, image_id=IMAGE_ID, data_files_per_gpu=2)]})
    m, daemon, files = opened(daemon=daemon, parents=1, compression="zstd")
    assert m.phase(TOKEN) is SessionPhase.OPEN
    assert files.events == [OpenManifest(1), BeginDump(TOKEN, IMAGE_ID, 2)]  # a dump: its parent's manifest only
    o = daemon.seen[-1].open_session
    assert o.kind == rpc.SESSION_DUMP and o.compression == "zstd" and list(o.parent_manifest_fd_indexes) == [0]
    files.events.clear()
    m.add_bos(TOKEN, [ClientBo(1, 7, gpu_id=1), ClientBo(2, 7), ClientBo(3, 7, gpu_id=9), ClientBo(4, 8, gpu_id=1)])
    assert isinstance(drive(m, daemon, files), Done)
    # each GPU the daemon allows, first named first, all its stripes; GPU 9 is not the daemon's: no file
    assert files.events == [CreateDataFile(TOKEN, 1, 0, True), CreateDataFile(TOKEN, 1, 1, True),
                            CreateDataFile(TOKEN, 0, 0, True), CreateDataFile(TOKEN, 0, 1, True)]
    assert daemon.names()[-2:] == ["attach_files", "add_bos"]
    assert [(f.gpu_id, f.stripe) for f in daemon.seen[-2].attach_files.files] == [(1, 0), (1, 1), (0, 0), (0, 1)]
    files.events.clear()
    m.add_bos(TOKEN, [ClientBo(5, 7, gpu_id=1)])  # its GPU has its files: none made again
    assert isinstance(drive(m, daemon, files), Done) and files.events == [] and daemon.names()[-1] == "add_bos"
    m.start(TOKEN)
    assert isinstance(drive(m, daemon, files), Done) and files.events == [CreateManifest(TOKEN)]
    assert daemon.seen[-1].start.HasField("manifest_fd_index") and m.phase(TOKEN) is SessionPhase.STARTED
    m.progress(TOKEN)
    assert isinstance(drive(m, daemon, files), Done) and m.phase(TOKEN) is SessionPhase.STARTED
    files.events.clear()
    m.wait(TOKEN, 5000)
    assert isinstance(drive(m, daemon, files), Done)
    assert files.events == [Commit(TOKEN), ReleaseFiles(TOKEN)] and m.phase(TOKEN) is None
    assert daemon.seen[-1].wait.timeout_ms == 5000
    assert m.transcript is not None
    roles = [s["fds"] for s in m.transcript.steps if "send" in s]
    assert roles[1] == ["manifest:1"] and roles[-3] == ["dump-manifest"]  # then GetProgress, Wait
    assert roles[2][:2] == ["dump-data:gpu=1:stripe=0", "dump-data:gpu=1:stripe=0+direct"]


def test_the_phase_while_a_dump_commits():
    m, daemon, _ = opened()
    seen: list[SessionPhase | None] = []
    m.wait(TOKEN)
    drive(m, daemon, Files(fail=lambda e: seen.append(m.phase(TOKEN)) if isinstance(e, Commit) else None))
    assert seen == [SessionPhase.COMMITTING]


def test_a_daemon_asking_for_more_data_files_than_the_format_allows():
    daemon = Daemon(answers={"open_session": [session(token=TOKEN, image_id=IMAGE_ID, data_files_per_gpu=17)]})
    m, daemon = ready(daemon)
    files = Files()
    m.open_session(OpenSpec(rpc.SESSION_DUMP))
    failed(drive(m, daemon, files), ProtocolError, "17 data files per GPU")
    # the session cannot be handed over: closed, its files released; the connection goes on
    assert daemon.names()[-1] == "close_session" and files.events == [ReleaseFiles(TOKEN)]
    assert m.state is ConnState.IDLE and m.phase(TOKEN) is None


def test_an_image_id_of_the_wrong_length():
    m, daemon = ready(Daemon(answers={"open_session": [session(token=TOKEN, image_id=b"short")]}))
    m.open_session(OpenSpec(rpc.SESSION_DUMP))
    failed(drive(m, daemon), ProtocolError, "5 bytes")
    assert daemon.names()[-1] == "close_session" and m.state is ConnState.IDLE


def test_an_open_reply_without_a_valid_token_breaks_the_connection():
    m, daemon = ready(Daemon(answers={"open_session": [session(token="ABC")]}))
    m.open_session(OpenSpec(rpc.SESSION_DUMP))
    failed(drive(m, daemon), ProtocolError, "token")
    assert m.state is ConnState.ERROR


def test_the_cap_on_data_files_per_gpu_and_a_daemon_that_lists_no_gpu():
    daemon = Daemon(hello=rpc.HelloReply(version=2),
                    answers={"open_session": [session(token=TOKEN, image_id=IMAGE_ID, data_files_per_gpu=4)]})
    m, daemon = ready(daemon, max_data_files_per_gpu=1)
    m.open_session(OpenSpec(rpc.SESSION_DUMP))
    files = Files()
    assert isinstance(drive(m, daemon, files), Done) and files.events == [BeginDump(TOKEN, IMAGE_ID, 1)]
    m.add_bos(TOKEN, [ClientBo(1, 7, gpu_id=5)])
    assert isinstance(drive(m, daemon, files), Done)
    assert files.events[1:] == [CreateDataFile(TOKEN, 5, 0, True)]  # no list: every GPU may be named


def test_data_files_are_attached_under_the_fd_limit():
    hello = rpc.HelloReply(version=2, limits=rpc.Limits(max_fds_per_message=5))
    daemon = Daemon(hello=hello, answers={"open_session": [session(token=TOKEN, image_id=IMAGE_ID,
                                                                   data_files_per_gpu=3)]})
    m, daemon, files = opened(daemon=daemon)
    m.add_bos(TOKEN, [ClientBo(1, 7)])
    assert isinstance(drive(m, daemon, files), Done)
    attached = [len(r.attach_files.files) for r in daemon.seen if r.WhichOneof("body") == "attach_files"]
    assert attached == [2, 1]  # two fds a file (its O_DIRECT twin): two files of five fds at most


def test_a_refused_attach_drops_its_data_files_and_the_next_add_bos_makes_them_again():
    daemon = Daemon(answers={"attach_files": [refuse(LimitExceededError("max_fds_per_uid"))]})
    m, daemon, files = opened(daemon=daemon)
    files.events.clear()
    m.add_bos(TOKEN, [ClientBo(1, 7)])
    failed(drive(m, daemon, files), LimitExceededError, "max_fds_per_uid")
    assert files.events == [CreateDataFile(TOKEN, 0, 0, True), DropDataFiles(TOKEN, ((0, 0),))]
    assert daemon.names()[-1] == "attach_files" and m.phase(TOKEN) is SessionPhase.OPEN
    files.events.clear()
    m.add_bos(TOKEN, [ClientBo(1, 7)])
    assert isinstance(drive(m, daemon, files), Done)
    assert files.events == [CreateDataFile(TOKEN, 0, 0, True)] and daemon.names()[-2:] == ["attach_files", "add_bos"]


def test_a_data_file_that_cannot_be_created():
    daemon = Daemon(answers={"open_session": [session(token=TOKEN, image_id=IMAGE_ID, data_files_per_gpu=2)]})
    m, daemon, files = opened(daemon=daemon)
    n = len(daemon.seen)
    boom = OSError(errno.EEXIST, "cannot create")
    files.fail = lambda e: boom if isinstance(e, CreateDataFile) and e.stripe == 1 else None
    files.events.clear()
    m.add_bos(TOKEN, [ClientBo(1, 7)])
    assert failed(drive(m, daemon, files), OSError) is boom
    assert files.events[-1] == DropDataFiles(TOKEN, ((0, 0),)) and len(daemon.seen) == n  # nothing sent


def test_a_failed_wait_releases_the_session_and_a_timeout_keeps_it():
    m, daemon, files = opened(daemon=Daemon(answers={"wait": [refuse(WaitTimeoutError("still running")),
                                                              refuse(JobCancelledError("cancelled"))]}))
    files.events.clear()
    m.wait(TOKEN, 10)
    failed(drive(m, daemon, files), WaitTimeoutError)
    assert files.events == [] and m.phase(TOKEN) is SessionPhase.OPEN
    m.wait(TOKEN)
    failed(drive(m, daemon, files), JobCancelledError)
    assert files.events == [ReleaseFiles(TOKEN)] and m.phase(TOKEN) is None


def test_a_commit_that_fails_releases_the_dump():
    m, daemon, files = opened()
    files.fail = lambda e: OSError(errno.ENOSPC, "full") if isinstance(e, Commit) else None
    files.events.clear()
    m.wait(TOKEN)
    failed(drive(m, daemon, files), OSError, "full")
    assert files.events == [Commit(TOKEN), ReleaseFiles(TOKEN)] and m.phase(TOKEN) is None


def test_close_session_releases_the_files_whatever_the_answer():
    m, daemon, files = opened(daemon=Daemon(answers={"close_session": [refuse(JobCancelledError("gone"))]}))
    files.events.clear()
    m.close_session(TOKEN)
    failed(drive(m, daemon, files), JobCancelledError)
    assert files.events == [ReleaseFiles(TOKEN)] and m.phase(TOKEN) is None


# --- a restore ------------------------------------------------------------------------------------

def _needed(*refs: tuple[int, str]) -> Answer:
    return session(token=TOKEN, image_id=IMAGE_ID, files_needed=[rpc.FileRef(image=k, name=n) for k, n in refs])


NAMES = [image_format.data_file_name(IMAGE_ID, 0, k) for k in range(3)]


def test_a_restore_opens_its_manifests_and_the_files_the_daemon_asks_for():
    hello = rpc.HelloReply(version=2, limits=rpc.Limits(max_fds_per_message=3))
    daemon = Daemon(hello=hello, answers={"open_session": [_needed((0, NAMES[0]), (1, NAMES[1]), (0, NAMES[2]))]})
    m, daemon, files = opened(rpc.SESSION_RESTORE, daemon=daemon, parents=1, allow_partial=True)
    assert files.events == [OpenManifest(0), OpenManifest(1), OpenDataFile(TOKEN, 0, NAMES[0], True),
                            OpenDataFile(TOKEN, 1, NAMES[1], True), OpenDataFile(TOKEN, 0, NAMES[2], True)]
    o = next(r.open_session for r in daemon.seen if r.WhichOneof("body") == "open_session")
    assert o.allow_partial and o.manifest_fd_index == 0 and list(o.parent_manifest_fd_indexes) == [1]
    attaches = [r.attach_files for r in daemon.seen if r.WhichOneof("body") == "attach_files"]
    assert [len(a.files) for a in attaches] == [1, 1, 1]  # a file and its twin: one a message under 3 fds
    assert m.phase(TOKEN) is SessionPhase.OPEN
    assert m.transcript is not None
    sent = [s for s in m.transcript.steps if "send" in s]
    assert sent[1]["fds"] == ["manifest:0", "manifest:1"]
    assert sent[3]["fds"] == [f"data:1:{NAMES[1]}", f"data:1:{NAMES[1]}+direct"]
    m.wait(TOKEN)
    files.events.clear()
    assert isinstance(drive(m, daemon, files), Done) and files.events == []  # nothing to commit
    assert m.phase(TOKEN) is SessionPhase.OPEN


def test_with_one_fd_a_message_no_o_direct_twin_is_attached():
    hello = rpc.HelloReply(version=2, limits=rpc.Limits(max_fds_per_message=1))
    daemon = Daemon(hello=hello, answers={"open_session": [_needed((0, NAMES[0]))]})
    _, daemon, files = opened(rpc.SESSION_VERIFY, daemon=daemon)
    assert files.events[-1] == OpenDataFile(TOKEN, 0, NAMES[0], False)
    (ref,) = daemon.seen[-1].attach_files.files
    assert not ref.HasField("direct_fd_index")


@pytest.mark.parametrize("kind,ref,why", [
    (rpc.SESSION_RESTORE, (0, "../etc/passwd"), "not a data file"),
    (rpc.SESSION_RESTORE, (2, NAMES[0]), "image 2 of none"),
    (rpc.SESSION_DUMP, (0, NAMES[0]), "a dump's own image"),
])
def test_a_daemon_asking_for_a_file_the_client_does_not_open_breaks_the_connection(kind, ref, why):
    m, daemon = ready(Daemon(answers={"open_session": [_needed(ref)]}))
    files = Files()
    m.open_session(OpenSpec(kind, parents=1))
    failed(drive(m, daemon, files), ProtocolError, "does not open")
    assert m.state is ConnState.ERROR and daemon.names()[-1] == "open_session"  # no CloseSession: broken
    assert not any(isinstance(e, OpenDataFile) for e in files.events) and m.phase(TOKEN) is None


def test_a_needed_file_that_cannot_be_opened_closes_the_session():
    m, daemon = ready(Daemon(answers={"open_session": [_needed((0, NAMES[0]))]}))
    files = Files(fail=lambda e: PermissionDeniedError("may not read") if isinstance(e, OpenDataFile) else None)
    m.open_session(OpenSpec(rpc.SESSION_RESTORE))
    failed(drive(m, daemon, files), PermissionDeniedError, "may not read")
    assert daemon.names()[-1] == "close_session" and files.events[-1] == ReleaseFiles(TOKEN)
    assert m.state is ConnState.IDLE


def test_a_refused_open_session_leaves_no_session():
    m, daemon = ready(Daemon(answers={"open_session": [refuse(LimitExceededError("sessions"))]}))
    m.open_session(OpenSpec(rpc.SESSION_RESTORE))
    failed(drive(m, daemon), LimitExceededError)
    assert m.phase(TOKEN) is None and m.state is ConnState.IDLE


def test_sessions_of_others_are_sent_to_as_they_are():
    m, daemon = ready()
    for start in (lambda: m.start(TOKEN), lambda: m.cancel(TOKEN, "why"), lambda: m.cancel_by_id(4),
                  lambda: m.list_sessions(), lambda: m.wait(TOKEN)):
        start()
        files = Files()
        assert isinstance(drive(m, daemon, files), Done) and files.events == []
    assert daemon.names()[1:] == ["start", "cancel", "cancel", "list_sessions", "wait"]
    assert not daemon.seen[1].start.HasField("manifest_fd_index") and daemon.seen[3].cancel.session_id == 4


def test_a_session_is_opening_while_its_files_are_attached():
    m, daemon = ready(Daemon(answers={"open_session": [_needed((0, NAMES[0]))]}))
    phases: list[SessionPhase | None] = []
    files = Files(fail=lambda e: phases.append(m.phase(TOKEN)) if isinstance(e, OpenDataFile) else None)
    m.open_session(OpenSpec(rpc.SESSION_VERIFY))
    assert m.phase(TOKEN) is None  # before OpenSession's reply: no session yet
    assert isinstance(drive(m, daemon, files), Done)
    assert phases == [SessionPhase.OPENING] and m.phase(TOKEN) is SessionPhase.OPEN
    assert m.awaiting is None and not m.busy
