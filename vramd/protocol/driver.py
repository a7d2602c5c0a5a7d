"""The plumbing of the client machine: one operation at a time, its events taken and answered in turn.

`EventDriver` runs an operation, a generator of events (vramd.protocol.events),
over a `ClientConnection`: `next_event` resumes it with the adapter's last
answer (`receive`, `provide_fd`, `provide_file`, `acknowledge`) or throws the
adapter's failure into it (`fail`, `not_sent`), so that the operation's own
cleanup runs before it ends with `Failed`.  Answering what was not asked, or
asking for an event before answering the last one, is a ProtocolError (the
connection goes to ERROR).  `ClientMachine` (vramd.protocol.session) holds the
operations themselves.
"""
from __future__ import annotations

from collections.abc import Generator, Sequence
from dataclasses import replace

from ..pb import rpc_pb2 as rpc
from .client import Call, ClientFile
from .connection import ClientConnection, ConnState, Transcript
from .events import (
    BeginDump,
    Commit,
    CreateDataFile,
    CreateManifest,
    Done,
    DropDataFiles,
    Event,
    Failed,
    OpenDataFile,
    OpenManifest,
    ReleaseFiles,
    Send,
)
from .wire import raise_for_error

Op = Generator[Event, object, rpc.Response]
_FD_EVENTS = (OpenManifest, CreateManifest)
_FILE_EVENTS = (OpenDataFile, CreateDataFile)
_ACK_EVENTS = (BeginDump, DropDataFiles, Commit, ReleaseFiles)


class EventDriver:
    """One operation at a time over `connection`, driven by the adapter (see the module's docstring)."""

    def __init__(self, connection: ClientConnection) -> None:
        self.connection = connection
        self._op: Op | None = None
        self._awaiting: Event | None = None  # the event whose answer is due
        self._answer: object = None
        self._throw: BaseException | None = None

    @property
    def state(self) -> ConnState:
        return self.connection.state

    @property
    def hello(self) -> rpc.HelloReply | None:
        return self.connection.hello

    @property
    def transcript(self) -> Transcript | None:
        return self.connection.transcript

    @property
    def awaiting(self) -> Event | None:
        """The event whose answer is due (None: next_event may be called, or no operation runs)."""
        return self._awaiting

    @property
    def busy(self) -> bool:
        """Whether an operation is under way (its events not all taken)."""
        return self._op is not None

    # --- driving -----------------------------------------------------------------

    def next_event(self) -> Event:
        """The next thing the adapter must do, or the operation's end (`Done`, `Failed`)."""
        op = self._op
        if op is None:
            raise self.connection.error("no operation is under way")
        if self._awaiting is not None:
            raise self.connection.error(f"{type(self._awaiting).__name__} was not answered")
        try:
            if self._throw is not None:
                exc, self._throw = self._throw, None
                ev = op.throw(exc)
            else:
                answer, self._answer = self._answer, None
                ev = op.send(answer)
        except StopIteration as stop:
            self._op = None
            return Done(stop.value)
        except BaseException as e:  # the operation's error, after its cleanup
            self._op = None
            if not isinstance(e, Exception):
                raise  # KeyboardInterrupt, SystemExit: not an operation's failure
            return Failed(e)
        self._awaiting = ev
        return ev

    def receive(self, data: bytes, fds: Sequence[int] = (), flags: int = 0) -> None:
        """The packet received after `Send` (its fds are closed: the daemon never sends any).  What the
        connection refuses (a ProtocolError: ERROR; the daemon's hang-up: ConnectionError, CLOSED; a refused
        Hello's typed error) ends the operation with `Failed`, after the cleanup that is still possible."""
        self._take(Send)
        try:
            self._answer = self.connection.receive(data, fds, flags)
        except Exception as e:
            self._throw = e

    def receive_response(self, resp: rpc.Response) -> None:
        """`receive` for a response that came decoded (an in-process adapter)."""
        self._take(Send)
        try:
            self._answer = self.connection.receive_response(resp)
        except Exception as e:
            self._throw = e

    def not_sent(self, error: BaseException) -> None:
        """The answer to `Send` when the kernel refused the packet before any of it went (EBADF: a closed
        fd; EMSGSIZE): the connection stays in step; the operation cleans up and fails with `error`."""
        self._take(Send)
        self.connection.not_sent()
        self._throw = error

    def lost(self, error: BaseException) -> None:
        """The answer to `Send` when the transport failed (a broken pipe, a reset, no reply in time): the
        connection is CLOSED; the operation cleans up what it can without it and fails with `error`."""
        self._take(Send)
        self.connection.lost()
        self._throw = error

    def provide_fd(self, fd: int) -> None:
        """The answer to OpenManifest and CreateManifest (the fd stays the adapter's)."""
        self._take(*_FD_EVENTS)
        self._answer = fd

    def provide_file(self, f: ClientFile) -> None:
        """The answer to OpenDataFile and CreateDataFile (the fds stay the adapter's)."""
        self._take(*_FILE_EVENTS)
        self._answer = f

    def acknowledge(self) -> None:
        """The answer to BeginDump, DropDataFiles, Commit and ReleaseFiles: done."""
        self._take(*_ACK_EVENTS)

    def fail(self, error: BaseException) -> None:
        """The adapter could not do what the last event asked: the operation cleans up and fails with
        `error`."""
        self._take(*_FD_EVENTS, *_FILE_EVENTS, *_ACK_EVENTS)
        self._throw = error

    def _take(self, *kinds: type) -> None:
        if not isinstance(self._awaiting, kinds):
            what = type(self._awaiting).__name__ if self._awaiting is not None else "nothing"
            raise self.connection.error(f"an answer to {' or '.join(k.__name__ for k in kinds)}, but {what} "
                                        "was asked")
        self._awaiting = None

    def _begin(self, op: Op) -> None:
        if self._op is not None:
            op.close()
            raise self.connection.error("an operation is under way: take its events to its end first")
        self.connection.check_usable()
        self._op, self._answer, self._throw = op, None, None

    # --- steps every operation uses ------------------------------------------------

    def _call(self, call: Call) -> Op:
        resp = yield Send(self.connection.send(call))
        assert isinstance(resp, rpc.Response)
        return resp

    def _checked(self, call: Call) -> Op:
        return raise_for_error((yield from self._call(call)))

    def _fd(self, ev: OpenManifest | CreateManifest) -> Generator[Event, object, int]:
        fd = yield ev
        assert isinstance(fd, int)
        return fd

    def _file(self, ev: OpenDataFile | CreateDataFile) -> Generator[Event, object, ClientFile]:
        f = yield ev
        assert isinstance(f, ClientFile)
        return f if ev.direct else replace(f, direct_fd=None)

