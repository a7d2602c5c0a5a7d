"""The client machine's connection (vramd.protocol.ClientConnection under ClientMachine): Hello, request ids,
the pairing of responses, ERROR and CLOSED, the adapter's misuse; the typed requests and their packing."""
from __future__ import annotations

import errno
import os

import pytest
from client_script import TOKEN, Daemon, drive, failed, ready, refuse, session

from vramd.errors import (
    JobCancelledError,
    LimitExceededError,
    PermissionDeniedError,
    ProtocolError,
    UnsupportedProtocolError,
)
from vramd.image import format as image_format
from vramd.image import names as image_names
from vramd.pb import rpc_pb2 as rpc
from vramd.protocol import (
    Call,
    ClientBo,
    ClientFile,
    ClientMachine,
    ConnState,
    Done,
    Send,
    requests,
)
from vramd.protocol.frames import KIND_RESPONSE, encode_frame

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
    assert requests.DATA_FILE_NAME.pattern == image_names.DATA_FILE_NAME.pattern


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


