"""The client machine's sessions (vramd.protocol.ClientMachine): every step and phase of a dump and a restore,
and every error path, against the scripted daemon and file side of client_script.py."""
from __future__ import annotations

import errno

import pytest
from client_script import IMAGE_ID, TOKEN, Answer, Daemon, Files, drive, failed, opened, ready, refuse, session

from vramd.errors import (
    JobCancelledError,
    LimitExceededError,
    PermissionDeniedError,
    ProtocolError,
    WaitTimeoutError,
)
from vramd.image import names as image_names
from vramd.pb import rpc_pb2 as rpc
from vramd.protocol import (
    BeginDump,
    ClientBo,
    Commit,
    ConnState,
    CreateDataFile,
    CreateManifest,
    Done,
    DropDataFiles,
    OpenDataFile,
    OpenManifest,
    OpenSpec,
    ReleaseFiles,
    Send,
    SessionPhase,
)

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


def test_a_transport_lost_under_an_attach_drops_its_data_files_and_closes_the_connection():
    """The adapter's socket failed under AttachFiles (EPIPE): that batch's data files are dropped, the operation
    fails with the socket's error, the connection is CLOSED (later calls: ConnectionError), nothing is sent."""
    m, daemon, files = opened()
    files.events.clear()
    n = len(daemon.seen)
    m.add_bos(TOKEN, [ClientBo(1, 7)])
    while not isinstance(e := m.next_event(), Send):
        files.answer(m, e)
    pipe = BrokenPipeError(errno.EPIPE, "Broken pipe")
    m.lost(pipe)
    assert failed(drive(m, daemon, files), BrokenPipeError) is pipe
    assert files.events == [CreateDataFile(TOKEN, 0, 0, True), DropDataFiles(TOKEN, ((0, 0),))]
    assert m.state is ConnState.CLOSED and not m.busy and len(daemon.seen) == n
    with pytest.raises(ConnectionError):
        m.close_session(TOKEN)


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


NAMES = [image_names.data_file_name(IMAGE_ID, 0, k) for k in range(3)]


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

