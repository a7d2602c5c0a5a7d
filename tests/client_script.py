"""A scripted daemon and file side for the client machine's tests (test_client_connection, test_client_machine).

The daemon answers each request by its kind; the file side answers the file events with made-up fd numbers
(the machine never opens, closes or names a file, so none has to exist).  Packets go through the real frame
codec both ways (`receive` takes the framed bytes), so what is checked is what a socket would carry.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from vramd.errors import VramdError
from vramd.image import names as image_names
from vramd.pb import rpc_pb2 as rpc
from vramd.protocol import (
    ClientFile,
    ClientMachine,
    CreateDataFile,
    CreateManifest,
    Done,
    Event,
    Failed,
    OpenDataFile,
    OpenManifest,
    OpenSpec,
    Send,
    error_to_pb,
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
            name = image_names.data_file_name(IMAGE_ID, e.gpu_id, e.stripe)
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


