"""A streamed restore's refusals and ends through a real daemon: bad supply messages, a supply fd that is not a
pipe or stream socket, a dump given one, and a session that waits for its supply when it is cancelled, its
client hangs up, or the daemon shuts down (stream_daemon_fixture.py says how the images are made)."""
from __future__ import annotations

import os
import signal
import socket
import threading
import time

import pytest
from helpers import open_dir
from stream_daemon_fixture import Image, Targets, closed_by_the_daemon, open_streamed, raw_message, still_running

from vramd.client import SESSION_DUMP, SESSION_RESTORE, Client
from vramd.errors import BadDescriptorError, InvalidRequestError, JobCancelledError
from vramd.image.supply import encode
from vramd.pb import rpc_pb2 as rpc
from vramd.testing import DaemonProcess


@pytest.fixture
def image(tmp_path):
    return Image(tmp_path)


@pytest.fixture
def targets():
    t = Targets()
    yield t
    t.close()


@pytest.mark.parametrize(("sent", "says"), [
    (lambda n: encode(0, n + 1), "is past its length"),
    (lambda n: encode(0, 4096) + encode(0, 4095), "goes back from 0x1000"),
    (lambda n: encode(1, 16), "data file #1: the image has 1"),
    (lambda n: raw_message(0, 16, reserved=7), "reserved field 0x7 is not 0"),
    (lambda n: encode(0, 16)[:10], "ended inside a message (10 of 16 bytes)"),
], ids=["past-the-end", "going-back", "no-such-file", "reserved", "cut-message"])
def test_a_message_no_client_sends_fails_the_session_and_only_it(daemon, image, targets, sent, says):
    """A bad supply message fails its session with INVALID_REQUEST naming it; an ordinary restore on the same
    daemon then completes, byte-exact."""
    image.fill(0, len(image.data))  # the bytes are all there: only the message is wrong
    with Client(daemon.socket) as c:
        s, w = open_streamed(c, image, targets)
        os.write(w, sent(len(image.data)))
        os.close(w)
        with pytest.raises(InvalidRequestError) as e:
            c.wait(s.token)
        assert e.value.message.startswith("the supply pipe: ") and says in e.value.message
        c.close_session(s.token)
        other = Targets()
        try:
            dfd = open_dir(image.src)
            try:
                assert c.run_session(SESSION_RESTORE, dfd, other.bos()).state == rpc.SESSION_DONE
            finally:
                os.close(dfd)
            assert other.contents() == image.contents
        finally:
            other.close()


def test_a_supply_fd_that_is_not_a_pipe_is_refused_at_open(daemon, image):
    """A regular file, or a pipe's write end: BAD_DESCRIPTOR at OpenSession, and no session is left open."""
    dfd = open_dir(image.dst)
    r, w = os.pipe2(os.O_CLOEXEC)
    try:
        with Client(daemon.socket) as c:
            for fd, says in ((dfd, "not a pipe nor a socket"), (w, "not open for reading")):
                with pytest.raises(BadDescriptorError) as e:
                    c.open_session(SESSION_RESTORE, dfd, supply_fd=fd)
                assert says in e.value.message
            assert c.sessions() == []
    finally:
        for fd in (dfd, r, w):
            os.close(fd)


def test_a_supply_fd_whose_end_could_never_come_or_from_the_network_is_refused(daemon, image):
    """A pipe reopened read-write (the daemon would hold a writer of its own: the pipe's end, which says that
    nothing more comes, would never come), and a TCP socket (the daemon does no network I/O, even on a
    connection a client made): BAD_DESCRIPTOR at OpenSession, and no session is left open."""
    dfd = open_dir(image.dst)
    r, w = os.pipe2(os.O_CLOEXEC)
    both = os.open(f"/proc/self/fd/{r}", os.O_RDWR | os.O_CLOEXEC)  # one fd, both ends of the pipe
    with socket.create_server(("127.0.0.1", 0)) as server:
        tcp = socket.create_connection(server.getsockname())
        peer, _ = server.accept()
        try:
            with Client(daemon.socket) as c:
                for fd, says in ((both, "open for writing too"), (tcp.fileno(), "not a unix one")):
                    with pytest.raises(BadDescriptorError) as e:
                        c.open_session(SESSION_RESTORE, dfd, supply_fd=fd)
                    assert says in e.value.message
                assert c.sessions() == []
        finally:
            for fd in (dfd, r, w, both):
                os.close(fd)
            tcp.close()
            peer.close()


def test_a_uid_flooding_its_supply_pipes_leaves_other_clients_answered(daemon, image):
    """As many streamed sessions as a uid may open (max_sessions_per_uid, 64), each pipe written as fast as the
    daemon reads it (a message repeated: allowed, and decoded): another client's GetStatus is still answered
    at once (measured: a median of 3-5 ms; ~90 ms when each turn of the loop decoded 64 KiB of each pipe)."""
    with Client(daemon.socket) as c:
        ends = [open_streamed(c, image, None)[1] for _ in range(64)]
        stop = threading.Event()
        block = encode(0, 16) * 4096

        def flood(w: int) -> None:
            while not stop.is_set():
                os.write(w, block)

        writers = [threading.Thread(target=flood, args=(w,)) for w in ends]
        for t in writers:
            t.start()
        took = []
        try:
            with Client(daemon.socket) as other:
                for _ in range(60):
                    t0 = time.perf_counter()
                    other.status()
                    took.append(time.perf_counter() - t0)
        finally:
            stop.set()
            for t in writers:  # (a write under way ends as the daemon reads on)
                t.join()
            for w in ends:
                os.close(w)
    took.sort()
    assert took[len(took) // 2] < 0.025, f"GetStatus: median {took[len(took) // 2] * 1e3:.1f} ms"


def test_a_dump_takes_no_supply_pipe(daemon, image):
    r, w = os.pipe2(os.O_CLOEXEC)
    try:
        with Client(daemon.socket) as c:
            resp = c.request([r], open_session=rpc.OpenSession(kind=SESSION_DUMP, supply_fd_index=0))
            assert resp.error.code == rpc.INVALID_REQUEST and "supply_fd_index" in resp.error.message
    finally:
        os.close(r)
        os.close(w)


def test_a_stream_socket_supplies_as_a_pipe_does_and_a_datagram_socket_is_refused(daemon, image, targets):
    """A connected SOCK_STREAM socket pair works as the supply channel (the peer's close is its end); a
    SOCK_SEQPACKET one, whose reads return messages rather than a byte stream, is BAD_DESCRIPTOR at open."""
    image.fill(0, len(image.data))
    dfd = open_dir(image.dst)
    try:
        with Client(daemon.socket) as c:
            a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            with a, b, pytest.raises(BadDescriptorError, match="not a stream socket"):
                c.open_session(SESSION_RESTORE, dfd, supply_fd=a.fileno())
            a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
            with b:
                with a:
                    s = c.open_session(SESSION_RESTORE, dfd, supply_fd=a.fileno())
                c.add_bos(s.token, targets.bos())
                c.start(s.token)
                b.sendall(encode(0, len(image.data)))
            assert c.wait(s.token).state == rpc.SESSION_DONE
            c.close_session(s.token)
    finally:
        os.close(dfd)
    assert targets.contents() == image.contents


def test_a_cancel_while_waiting_ends_the_session_and_lets_the_pipe_go(daemon, image, targets):
    """Cancelled while every chunk waits for its supply: CANCELLED at once, and the daemon has closed its end
    of the pipe (a write to ours is EPIPE), holding no fd of the session."""
    files = [f for f in daemon.fds() if not f.startswith("socket:")]
    with Client(daemon.socket) as c:
        s, w = open_streamed(c, image, targets)
        try:
            assert still_running(c, s.token).progress.bytes_done == 0
            c.cancel(s.token, "no more")
            with pytest.raises(JobCancelledError):
                c.wait(s.token)
            assert c.progress(s.token).state == rpc.SESSION_CANCELLED
            c.close_session(s.token)
            with pytest.raises(BrokenPipeError):
                os.write(w, encode(0, 16))
        finally:
            os.close(w)
    assert [f for f in daemon.fds() if not f.startswith("socket:")] == files


def test_a_client_that_hangs_up_while_waiting_is_reaped_with_its_pipe(daemon, image, targets):
    """The connection closes while every chunk waits: after the grace period the session is cancelled and
    its end of the pipe closed, like any session's fds."""
    with Client(daemon.socket) as c:
        s, w = open_streamed(c, image, targets)
    try:
        assert closed_by_the_daemon(w)
        daemon.expect_log(rf"session {s.session_id}: no client holds it any more \(grace period over\)")
    finally:
        os.close(w)


def test_shutdown_drains_a_streamed_session_then_ends_its_waits(run_dir, image, targets):
    """SIGTERM drains: a streamed session supplied during the drain completes; one never supplied is cancelled
    at the drain timeout, its pipe closed, and the daemon exits 0."""
    with DaemonProcess(run_dir, "--chunk-size", "1M", "--drain-timeout", "600") as d, Client(d.socket) as c:
        s, w = open_streamed(c, image, targets)
        d.terminate()
        d.expect_log(r"shutting down: draining 1 session")
        image.fill(0, len(image.data))
        os.write(w, encode(0, len(image.data)))
        os.close(w)
        # (the drain ends with the session: the daemon may close this connection before a Wait is answered)
        d.expect_log(rf"session {s.session_id} \(restore, .*\): SESSION_DONE: 2/2 BOs")
        assert d.stop() == 0
    assert targets.contents() == image.contents
    with DaemonProcess(run_dir, "--chunk-size", "1M", "--drain-timeout", "0.2") as d, Client(d.socket) as c:
        s, w = open_streamed(c, image, targets)
        try:
            d.terminate()
            assert closed_by_the_daemon(w)
            d.expect_log(r"drain timeout \(0.2 s\): cancelling 1 session")
            assert d.stop() == 0
        finally:
            os.close(w)


def test_a_sighup_leaves_a_waiting_session_waiting(run_dir, tmp_path, image, targets):
    """SIGHUP reloads the configuration and touches no session: a streamed session waiting for its supply keeps
    waiting (and its pipe open), then completes once supplied."""
    cfg = tmp_path / "vramd.toml"
    cfg.write_text('chunk_size = "1M"\n')
    with DaemonProcess(run_dir, "--config", str(cfg)) as d, Client(d.socket) as c:
        s, w = open_streamed(c, image, targets)
        try:
            d.proc.send_signal(signal.SIGHUP)
            d.expect_log(r"SIGHUP: configuration reloaded")
            assert still_running(c, s.token).progress.bytes_done == 0
            image.fill(0, len(image.data))
            os.write(w, encode(0, len(image.data)))  # (EPIPE, were the daemon's end closed)
        finally:
            os.close(w)
        assert c.wait(s.token).state == rpc.SESSION_DONE
        c.close_session(s.token)
    assert targets.contents() == image.contents
