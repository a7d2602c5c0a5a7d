"""Both sides of the RPC protocol without a socket: frames, Hello, request ids, limits, fd ownership."""
from __future__ import annotations

import fcntl
import os
import socket

import pytest

from vramd.errors import BadDescriptorError, LimitExceededError, PermissionDeniedError, ProtocolError
from vramd.pb import rpc_pb2 as rpc
from vramd.protocol import (
    PROTOCOL_VERSIONS,
    SCM_MAX_FD,
    ClientBo,
    ClientConnection,
    FdBundle,
    Received,
    Reply,
    ServerProtocol,
    decode_frame,
    encode_request,
    pack_bos,
    reply,
    requests,
)
from vramd.protocol.frames import KIND_REQUEST, KIND_RESPONSE


def _open(fd: int) -> bool:
    try:
        fcntl.fcntl(fd, fcntl.F_GETFD)
        return True
    except OSError:
        return False


def _fds(n: int) -> list[int]:
    out = []
    for _ in range(n):
        r, w = os.pipe()
        os.close(w)
        out.append(r)
    return out


def _server(**limits) -> ServerProtocol:
    return ServerProtocol(rpc.HelloReply(server="test", limits=rpc.Limits(**limits)))


def _pair() -> tuple[ClientConnection, ServerProtocol]:
    """A client and a server that have exchanged Hello, packet by packet."""
    client, server = ClientConnection("test 0"), _server(max_message_bytes=1 << 20, max_fds_per_message=SCM_MAX_FD)
    out = client.hello_request()
    (ev,) = server.receive(out.data, [])
    assert isinstance(ev, Reply) and not ev.close
    client.receive(ev.data)
    return client, server


def test_hello_negotiates_and_requests_are_numbered():
    client, server = _pair()
    assert client.version == server.version == PROTOCOL_VERSIONS[-1]
    a = client.send(requests.get_status())
    (ev,) = server.receive(a.data, [])
    assert isinstance(ev, Received) and ev.request.id == a.request.id
    resp = client.receive(reply(ev.request.id, status=rpc.StatusReply()).data)
    assert resp.id == a.request.id
    b = client.send(requests.get_status())
    assert b.request.id == a.request.id + 1


def test_client_refuses_a_response_to_another_request():
    client, _ = _pair()
    out = client.send(requests.get_status())
    with pytest.raises(ProtocolError, match="expected"):
        client.receive(reply(out.request.id + 7, status=rpc.StatusReply()).data)


def test_client_sends_one_request_at_a_time():
    client, _ = _pair()
    client.send(requests.get_status())
    with pytest.raises(ProtocolError, match="unanswered"):
        client.send(requests.get_status())


def test_client_raises_the_refusal_of_its_hello():
    client, server = ClientConnection("test 0"), _server()
    client.hello_request()
    (ev,) = server.refuse(PermissionDeniedError("uid 1 is not allowed"))
    assert ev.close
    with pytest.raises(PermissionDeniedError, match="not allowed"):
        client.receive(ev.data)


def test_client_closes_fds_a_response_carries():
    client, _ = _pair()
    client.send(requests.get_status())
    fds = _fds(2)
    client.receive(reply(1 + 1, status=rpc.StatusReply()).data, fds)  # request ids: hello 1, this 2
    assert not any(_open(fd) for fd in fds)


def test_server_wants_hello_first_and_closes_on_garbage():
    server = _server()
    (ev,) = server.receive(encode_request(rpc.Request(id=1, get_status=rpc.GetStatus())), [])
    assert isinstance(ev, Reply) and ev.close and server.closed
    assert server.receive(b"anything", []) == []


def test_server_closes_the_fds_of_a_refused_packet():
    server = _server()
    fds = _fds(3)
    (ev,) = server.receive(b"VRDP garbage", fds)
    assert ev.close and not any(_open(fd) for fd in fds)


def test_server_refuses_truncated_fds():
    client, server = _pair()
    fds = _fds(1)
    out = client.send(requests.get_status())
    (ev,) = server.receive(out.data, fds, socket.MSG_CTRUNC)
    assert isinstance(ev, Reply) and ev.close and not _open(fds[0])
    resp = rpc.Response.FromString(decode_frame(ev.data, KIND_RESPONSE))
    assert rpc.Code.Name(resp.error.code) == LimitExceededError.code


def test_frames_check_their_kind():
    data = encode_request(rpc.Request(id=3))
    assert decode_frame(data, KIND_REQUEST)
    with pytest.raises(ProtocolError, match="kind"):
        decode_frame(data, KIND_RESPONSE)


def test_fd_bundle_owns_what_nobody_took():
    fds = _fds(3)
    bundle = FdBundle(fds)
    assert bundle.peek(1) == fds[1]
    taken = bundle.take(1)
    with pytest.raises(BadDescriptorError):
        bundle.take(1)
    with pytest.raises(BadDescriptorError):
        bundle.peek(3)
    bundle.close()
    assert not _open(fds[0]) and not _open(fds[2]) and _open(taken)
    os.close(taken)


def _unpack(client: ClientConnection, token: str, bos: list[ClientBo]) -> list[tuple[list[rpc.Bo], list[int]]]:
    return [(m, fds) for m, fds, _ in pack_bos(token, bos, max_message_bytes=client.max_message_bytes,
                                                max_fds=client.max_fds_per_message)]


def test_bos_are_packed_under_the_fd_limit_with_each_fd_once():
    client, _ = _pair()
    bos = [ClientBo(i, 1000 + i // 2, size=4096) for i in range(1000)]  # two BOs per fd
    msgs = _unpack(client, "t" * 32, bos)
    assert all(len(fds) <= SCM_MAX_FD and len(set(fds)) == len(fds) for _, fds in msgs)
    assert [b.id for m, _ in msgs for b in m] == list(range(1000))  # all of them, in order
    for m, fds in msgs:
        for b in m:
            assert fds[b.fd_index] == 1000 + b.id // 2  # each BO names its own fd


def test_bos_are_packed_under_the_message_limit():
    bos = [ClientBo(i, 7, size=4096, name="n" * 100) for i in range(500)]
    msgs = [(m, fds) for m, fds, _ in pack_bos("t" * 32, bos, max_message_bytes=8192, max_fds=4)]
    for m, fds in msgs:
        assert rpc.AddBos(token="t" * 32, bos=m).ByteSize() < 8192 and fds == [7]
    assert sum(len(m) for m, _ in msgs) == 500 and len(msgs) > 1
