"""vramd.client.Client driving the client machine against a real daemon: its transcript, its low-level seam."""
from __future__ import annotations

import os
import select
from pathlib import Path

import pytest
from helpers import memfd

from vramd.client import SESSION_DUMP, SESSION_RESTORE, Client, ClientBo
from vramd.image.names import MANIFEST_NAME, data_file_name
from vramd.pb import rpc_pb2 as rpc
from vramd.protocol import ConnState, SessionPhase, requests
from vramd.testing.transcript import FakeDaemon, load

FIXTURES = Path(__file__).resolve().parent / "transcripts"

MiB = 1 << 20


def _sent(c: Client) -> list[tuple[str, list[str]]]:
    """(request kind, fd roles) of each packet the client sent."""
    assert c.transcript is not None
    out = []
    for step in c.transcript.steps:
        if "send" in step:
            body = step["send"]
            assert isinstance(body, dict)
            kind = next(k for k in body if k != "id")
            roles = step["fds"]
            assert isinstance(roles, list)
            out.append((kind, roles))
    return out


def test_a_dump_and_a_restore_recorded_step_by_step_with_their_fd_roles(daemon, image_dir):
    path, dfd = image_dir
    content = os.urandom(2 * MiB)
    src, dst = memfd(content), memfd(size=len(content))
    try:
        with Client(daemon.socket, record=True) as c:
            s = c.open_session(SESSION_DUMP, dfd, chunk_size=MiB)
            assert c.machine.phase(s.token) is SessionPhase.OPEN
            c.add_bos(s.token, [ClientBo(7, src, size=len(content))])
            c.start(s.token)
            assert c.machine.phase(s.token) is SessionPhase.STARTED
            assert c.wait(s.token).state == rpc.SESSION_DONE
            assert c.machine.phase(s.token) is None  # committed and released
            c.close_session(s.token)
            n = s.data_files_per_gpu
            sent = _sent(c)
            assert [k for k, _ in sent] == ["hello", "open_session", "attach_files", "add_bos", "start", "wait",
                                            "close_session"]
            data = [r for r in sent[2][1] if not r.endswith("+direct")]
            assert data == [f"dump-data:gpu=0:stripe={k}" for k in range(n)]
            assert sent[3][1] == ["bo:7"] and sent[4][1] == ["dump-manifest"] and sent[1][1] == []
            assert (path / MANIFEST_NAME).exists()
            assert c.transcript is not None
            recv = [st["recv"] for st in c.transcript.steps if "recv" in st]
            assert all(isinstance(r, dict) and r["id"] == str(i) for i, r in enumerate(recv, 1))

        with Client(daemon.socket, record=True) as c:
            info = c.run_session(SESSION_RESTORE, dfd, [ClientBo(7, dst)])
            assert info.state == rpc.SESSION_DONE and os.pread(dst, len(content) + 1, 0) == content
            sent = _sent(c)
            assert [k for k, _ in sent] == ["hello", "open_session", "attach_files", "add_bos", "start", "wait",
                                            "close_session"]
            assert sent[1][1] == ["manifest:0"]
            names = {r.removesuffix("+direct") for r in sent[2][1]}
            assert f"data:0:{data_file_name(s.image_id, 0)}" in names
            assert names <= {f"data:0:{data_file_name(s.image_id, 0, k)}" for k in range(n)}
    finally:
        os.close(src)
        os.close(dst)


def test_no_transcript_unless_asked(daemon):
    with Client(daemon.socket) as c:
        assert c.transcript is None and c.status().server


def test_exchange_returns_the_daemons_refusal_without_raising(daemon):
    with Client(daemon.socket) as c:
        resp = c.exchange(requests.get_progress("0" * 32))
        assert resp.error.code == rpc.NOT_FOUND and c.machine.state is ConnState.IDLE
        resp = c.request(get_status=rpc.GetStatus())
        assert resp.error.code == rpc.OK and resp.status.server
        with pytest.raises(TypeError, match="takes a get_status message"):
            c.request(get_status=rpc.ListSessions())


def test_the_machine_driven_over_a_socket_of_ones_own(daemon):
    """An adapter of its own (no Client): the machine's packets over a plain SOCK_SEQPACKET socket."""
    import socket

    from vramd.errors import NotFoundError
    from vramd.protocol import ClientMachine, Done, Failed, Send, pack_fds, unpack_fds
    m = ClientMachine("adapter 0", record=True)
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as s:
        s.connect(daemon.socket)

        def run() -> Done | Failed:
            while True:
                e = m.next_event()
                if isinstance(e, (Done, Failed)):
                    return e
                assert isinstance(e, Send)  # GetStatus and ListSessions need no file
                s.sendmsg([e.packet.data], pack_fds(e.packet.fds))
                data, anc, flags, _ = s.recvmsg(m.connection.max_response_bytes, socket.CMSG_SPACE(16))
                m.receive(data, unpack_fds(anc), flags)

        m.say_hello()
        hello = run()
        assert isinstance(hello, Done) and hello.response.hello.version == 2 and m.state is ConnState.IDLE
        m.status()
        status = run()
        assert isinstance(status, Done) and status.response.status.server
        m.progress("0" * 32)
        end = run()
        assert isinstance(end, Failed) and isinstance(end.error, NotFoundError) and m.state is ConnState.IDLE
    assert m.transcript is not None and len(m.transcript.steps) == 6


def _fake_after_hello(run_dir, image: Path, then: list) -> FakeDaemon:
    """A scripted daemon (vramd.testing.transcript) that answers Hello as the dump fixture's does, then `then`."""
    steps = load(FIXTURES / "dump.json")["steps"]
    return FakeDaemon(os.path.join(run_dir, "fake.sock"), [*steps[:2], *then], {os.path.realpath(image): 0}, timeout=10)


def test_a_daemon_gone_under_a_request_fails_that_call_with_its_error_and_every_later_one(run_dir, image_dir):
    """The daemon hangs up before OpenSession goes (sendmsg: EPIPE): that call raises the socket's error after
    the dump's directory is let go (no lock left); the connection is CLOSED, so the next call raises
    ConnectionError, not a PROTOCOL_ERROR about an operation still under way."""
    path, dfd = image_dir
    with _fake_after_hello(run_dir, path, [{"hangup": True}]) as fake:
        c = Client(fake.path)
        assert select.select([c.sock], [], [], 10)[0]  # the hang-up (EOF) has reached this end: sendmsg fails
        with pytest.raises(BrokenPipeError):
            c.open_session(SESSION_DUMP, dfd)
        assert c.machine.state is ConnState.CLOSED and not c.machine.busy and os.listdir(path) == []
        with pytest.raises(ConnectionError, match="closed the connection"):
            c.status()
        c.close()
        fake.result()


def test_a_reply_that_never_comes_closes_the_client_and_every_later_call_fails_as_a_closed_one(run_dir, image_dir):
    """No reply to OpenSession within the Client's timeout: TimeoutError, the connection closed, the dump's
    directory let go; a later call raises an OSError (ConnectionError), not a PROTOCOL_ERROR."""
    path, dfd = image_dir
    steps = load(FIXTURES / "dump.json")["steps"]
    with _fake_after_hello(run_dir, path, [steps[2]]) as fake:  # takes OpenSession, answers nothing
        c = Client(fake.path, timeout=0.5)
        with pytest.raises(TimeoutError, match=r"no reply from vramd within 0\.5 s"):
            c.open_session(SESSION_DUMP, dfd, compression="none", chunk_size=64 << 10, label="tx-dump")
        assert c.machine.state is ConnState.CLOSED and not c.machine.busy and os.listdir(path) == []
        with pytest.raises(ConnectionError):
            c.status()
        c.close()
        fake.result()
