"""One connection, the client's side, sans I/O: Hello, request ids, the pairing of responses, a transcript.

`ClientConnection` is the lower half of the client machine
(`vramd.protocol.session.ClientMachine` is the upper): it turns typed `Call`s
into numbered `Outgoing` packets and received packets into responses, one
request at a time, and refuses whatever breaks the protocol.  Its states:

    NEW --hello_request--> HELLO_SENT --receive(HelloReply)--> IDLE
    IDLE --send--> WAITING --receive(its response)--> IDLE
    HELLO_SENT/WAITING --receive(empty packet, or a refusal with id 0), or lost()--> CLOSED
    any --ProtocolError--> ERROR

A ProtocolError, whichever side caused it, moves the connection to ERROR
(as h11 does): a response with another request's id, one when no request
is waiting, one whose body is not the one its request is answered with, an
undecodable or truncated packet, a HelloReply that chose a version this
side does not speak or limits below the protocol's minimum, a second Hello,
a request before Hello was answered or while another one is unanswered.  In
ERROR and CLOSED every call raises (ProtocolError, ConnectionError), and
received fds are closed: the daemon never sends any.
"""
from __future__ import annotations

import enum
import itertools
from collections.abc import Sequence

from google.protobuf.json_format import MessageToDict

from ..errors import ProtocolError, UnsupportedProtocolError
from ..pb import rpc_pb2 as rpc
from . import requests
from .client import Call, Outgoing, decode_response, encode_request
from .fds import close_fds
from .frames import DEFAULT_MAX_MESSAGE, HEADER_SIZE, PROTOCOL_VERSIONS, SCM_MAX_FD
from .wire import raise_for_error

MIN_MAX_MESSAGE = 4096  # the protocol's minimum for Limits.max_message_bytes


class ConnState(enum.Enum):
    """Where a client connection stands (see the module's docstring for the transitions)."""

    NEW = "new"                # nothing sent: Hello comes first
    HELLO_SENT = "hello-sent"  # Hello sent, its reply due
    IDLE = "idle"              # Hello answered: one request may be sent
    WAITING = "waiting"        # a request sent, its response due
    CLOSED = "closed"          # the daemon closed the connection or refused it (a response with id 0), or it was lost
    ERROR = "error"            # a protocol error: nothing more is sent or taken


Step = dict[str, object]  # one transcript step, as JSON: {"send" | "recv": message as a dict, "fds": [roles]}


class Transcript:
    """What a connection sent and received, in order: `steps`, each {"send": Request} or {"recv": Response}
    as `MessageToDict(..., preserving_proto_field_name=True)` gives it, with "fds": the role of each fd the
    packet carried ("bo:<id>", "manifest:<k>", "data:<k>:<name>", "dump-data:gpu=<g>:stripe=<s>",
    "dump-manifest", a "+direct" suffix for an O_DIRECT twin; docs/protocol.md, "Transcripts")."""

    def __init__(self) -> None:
        self.steps: list[Step] = []

    def sent(self, out: Outgoing) -> None:
        self.steps.append({"send": MessageToDict(out.request, preserving_proto_field_name=True),
                           "fds": list(out.roles)})

    def received(self, resp: rpc.Response, nfds: int) -> None:
        self.steps.append({"recv": MessageToDict(resp, preserving_proto_field_name=True),
                           "fds": ["unexpected"] * nfds})


class ClientConnection:
    """One connection, the client's side; `record` keeps a `Transcript` of every packet (off by default: a
    dump of many BOs would keep them all)."""

    def __init__(self, client_name: str, *, record: bool = False) -> None:
        self.client_name = client_name
        self.state = ConnState.NEW
        self.hello: rpc.HelloReply | None = None  # what the daemon answered to Hello
        self.waiting_for: Outgoing | None = None  # the request sent and not yet answered
        self.transcript: Transcript | None = Transcript() if record else None
        self._ids = itertools.count(1)
        self._expect = ""  # the body the waiting request's successful answer carries

    # --- what Hello negotiated -------------------------------------------------

    @property
    def limits(self) -> rpc.Limits:
        """The daemon's limits as it sent them (defaults before Hello is answered)."""
        return self.hello.limits if self.hello is not None else rpc.Limits()

    @property
    def version(self) -> int | None:
        return self.hello.version if self.hello is not None else None

    @property
    def max_message_bytes(self) -> int:
        """Bytes one request may take, header included (the protocol's default where the daemon named none)."""
        return self.limits.max_message_bytes or DEFAULT_MAX_MESSAGE

    @property
    def max_fds_per_message(self) -> int:
        """fds one request may attach: the daemon's limit, at most the kernel's."""
        return min(self.limits.max_fds_per_message or SCM_MAX_FD, SCM_MAX_FD)

    @property
    def max_response_bytes(self) -> int:
        """The receive buffer a response needs."""
        return max(self.max_message_bytes, DEFAULT_MAX_MESSAGE) + HEADER_SIZE

    def allows_gpu(self, gpu_id: int) -> bool:
        """Whether a BO (and a dump's data file) may name `gpu_id`: HelloReply.allowed_gpu_ids; with none
        listed, every GPU (as libvramd)."""
        allowed = self.hello.allowed_gpu_ids if self.hello is not None else ()
        return not allowed or gpu_id in allowed

    # --- sending -----------------------------------------------------------------

    def error(self, why: str) -> ProtocolError:
        """Move to ERROR; the ProtocolError saying `why`, for the caller to raise."""
        self.state = ConnState.ERROR
        self.waiting_for = None
        return ProtocolError(why)

    def not_sent(self) -> None:
        """The packet of the waiting request was refused by the kernel before any of it went (sendmsg's
        EBADF, EMSGSIZE, ENOBUFS...): the connection is still in step, and no response is due."""
        out, self.waiting_for = self.waiting_for, None
        if out is not None:
            self.state = ConnState.NEW if out.request.WhichOneof("body") == "hello" else ConnState.IDLE
            if self.transcript is not None and self.transcript.steps:
                self.transcript.steps.pop()

    def lost(self) -> None:
        """The transport failed under the waiting request (its packet perhaps partly sent, its answer unread:
        EPIPE, ECONNRESET, a timeout): nothing more goes over this connection; CLOSED."""
        self.state, self.waiting_for = ConnState.CLOSED, None

    def check_usable(self) -> None:
        """Raise unless requests may still go: ProtocolError in ERROR, ConnectionError once CLOSED."""
        if self.state is ConnState.ERROR:
            raise ProtocolError("the connection had a protocol error: nothing more goes over it")
        if self.state is ConnState.CLOSED:
            raise ConnectionError("the daemon closed the connection")

    def hello_request(self) -> Outgoing:
        """The Hello packet: the first one, and only once."""
        self.check_usable()
        if self.state is not ConnState.NEW:
            raise self.error("Hello was sent already: it is the first request and the only Hello")
        out = self._send(requests.hello(self.client_name))
        self.state = ConnState.HELLO_SENT
        return out

    def send(self, call: Call) -> Outgoing:
        """The packet for one request; its response must be received before the next request."""
        self.check_usable()
        if isinstance(call.body, rpc.Hello):
            raise self.error("Hello was sent already: it is the first request and the only Hello"
                             if self.state is not ConnState.NEW else "Hello goes through hello_request")
        if self.state is ConnState.NEW or self.state is ConnState.HELLO_SENT:
            raise self.error(f"{call.field} before Hello was answered")
        if self.waiting_for is not None:
            raise self.error(f"request {self.waiting_for.request.id} is still unanswered")
        out = self._send(call)
        self.state = ConnState.WAITING
        return out

    def _send(self, call: Call) -> Outgoing:
        req = call.request(next(self._ids))
        out = Outgoing(req, encode_request(req), call.fds, call.roles)
        self.waiting_for, self._expect = out, call.answer
        if self.transcript is not None:
            self.transcript.sent(out)
        return out

    # --- receiving ---------------------------------------------------------------

    def receive(self, data: bytes, fds: Sequence[int] = (), flags: int = 0) -> rpc.Response:
        """The response in one received packet, paired with the request waiting for it (its error not
        raised, but for a refused Hello).  fds that came with it are closed."""
        close_fds(fds)
        self.check_usable()
        if not data:
            self.state, self.waiting_for = ConnState.CLOSED, None
            raise ConnectionError("the daemon closed the connection")
        try:
            resp = decode_response(data, flags)
        except ProtocolError as e:
            raise self.error(e.message) from None
        return self._paired(resp, len(fds))

    def receive_response(self, resp: rpc.Response) -> rpc.Response:
        """`receive` for a response that came decoded (an in-process adapter)."""
        self.check_usable()
        return self._paired(resp, 0)

    def _paired(self, resp: rpc.Response, nfds: int) -> rpc.Response:
        if self.transcript is not None:
            self.transcript.received(resp, nfds)
        waiting = self.waiting_for
        if waiting is None:
            raise self.error(f"response {resp.id} to no request")
        expected = waiting.request.id
        if resp.id == 0 and resp.error.code != rpc.OK:
            # the daemon's answer before it could read the request (a refusal): it closes the connection
            self.state, self.waiting_for = ConnState.CLOSED, None
            return raise_for_error(resp) if self.hello is None else resp
        if resp.id != expected:
            raise self.error(f"response for request {resp.id}, expected {expected}")
        if resp.error.code == rpc.OK and resp.WhichOneof("body") != self._expect:
            raise self.error(f"{waiting.request.WhichOneof('body')} answered with "
                             f"{resp.WhichOneof('body') or 'no body'}, not {self._expect}")
        self.waiting_for = None
        if self.hello is None:
            if resp.error.code != rpc.OK:
                self.state = ConnState.CLOSED  # a refused Hello: the daemon closes the connection
                raise_for_error(resp)
            self._negotiated(resp.hello)
        self.state = ConnState.IDLE
        return resp

    def _negotiated(self, hello: rpc.HelloReply) -> None:
        if hello.version not in PROTOCOL_VERSIONS:
            self.state = ConnState.ERROR
            raise UnsupportedProtocolError(f"vramd chose protocol version {hello.version}, which this client "
                                           f"does not speak ({', '.join(map(str, PROTOCOL_VERSIONS))})")
        if hello.limits.max_message_bytes and hello.limits.max_message_bytes < MIN_MAX_MESSAGE:
            raise self.error(f"vramd's max_message_bytes {hello.limits.max_message_bytes} is below "
                             f"{MIN_MAX_MESSAGE}")
        self.hello = hello
