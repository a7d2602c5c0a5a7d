"""The client-session state machine, sans I/O: the steps of a session, in the order the daemon needs them.

    Hello -> OpenSession (the manifests) -> AttachFiles (the files the daemon asks for)
      -> per GPU: its data files (a dump) -> AddBos (packed under the negotiated limits)
      -> Start (a dump: its manifest temporary) -> GetProgress / Wait -> Commit (a dump) -> CloseSession / Cancel

`ClientMachine` is one connection's client: `connection` (a
`ClientConnection`: Hello, request ids, pairing, the transcript) and the
sessions it opened, each in a `SessionPhase`.  One operation runs at a time:
the adapter starts it (`open_session`, `add_bos`, ...), then takes
`next_event()` until `Done` or `Failed`, answering every other event
(vramd.protocol.events has the table).  The machine never touches a file or
a socket: vramd.client.Client drives it over a blocking socket; an asyncio
adapter runs the same loop with its I/O awaited; an in-process one hands
`Send.packet.request` to a server and its answer to `receive_response`.

Errors: a response the daemon refused ends the operation with `Failed` and
its typed error, after the cleanup the step needs (a session that cannot be
handed over is closed; data files the daemon did not take are dropped).  A
ProtocolError the daemon caused (a response paired with no request or the
wrong one, of the wrong kind, undecodable; a request the format forbids)
moves the connection to ERROR and ends the operation with `Failed`; one the
adapter caused (an answer to what was not asked, an operation started while
another runs) moves it to ERROR and is raised by that call.  In ERROR (and
CLOSED) every later operation raises at once.  The C client (native/client)
takes the same steps with the same packing, so one transcript fits both.
"""
from __future__ import annotations

from collections.abc import Generator, Iterable, Sequence
from dataclasses import dataclass, field

from ..errors import ProtocolError, VramdError, WaitTimeoutError
from ..pb import rpc_pb2 as rpc
from . import requests
from .client import DUMP_REF_BYTES, Call, ClientBo, ClientFile, message_budget, needed_ref_bytes, pack_bos
from .connection import ClientConnection, ConnState
from .driver import EventDriver, Op
from .events import (
    BeginDump,
    Commit,
    CreateDataFile,
    CreateManifest,
    DropDataFiles,
    Event,
    OpenDataFile,
    OpenManifest,
    ReleaseFiles,
    Send,
    SessionPhase,
)
from .requests import DATA_FILE_NAME, MAX_DATA_FILES_PER_GPU, TOKEN, OpenSpec
from .wire import raise_for_error


@dataclass
class _Own:
    """A session this machine opened."""

    kind: rpc.SessionKind
    phase: SessionPhase = SessionPhase.OPENING
    image_id: bytes = b""
    stripes: int = 1                              # a dump's data files per GPU
    gpus: set[int] = field(default_factory=set)   # a dump's GPUs whose data files the daemon took

    @property
    def dump(self) -> bool:
        return bool(self.kind == rpc.SESSION_DUMP)


class ClientMachine(EventDriver):
    """One connection's client machine (see the module's docstring).  `record`: keep a transcript of every
    packet (`transcript`); `max_data_files_per_gpu`: make at most that many data files per GPU of a dump,
    whatever the daemon asks for (1: as a client older than stripes)."""

    def __init__(self, client_name: str, *, record: bool = False, max_data_files_per_gpu: int | None = None) -> None:
        super().__init__(ClientConnection(client_name, record=record))
        self.max_data_files_per_gpu = max_data_files_per_gpu
        self._own: dict[str, _Own] = {}

    # --- where it stands -------------------------------------------------------

    def phase(self, token: str) -> SessionPhase | None:
        """The phase of a session this machine opened; None for any other (or one it is done with)."""
        own = self._own.get(token)
        return own.phase if own is not None else None

    # --- operations: each is driven by next_event() to Done or Failed ------------

    def say_hello(self) -> None:
        self._begin(self._hello())

    def open_session(self, spec: OpenSpec, supply_fd: int | None = None) -> None:
        """Open a session: the manifests (OpenManifest), OpenSession, the files the daemon needs
        (OpenDataFile, AttachFiles); a dump's image id (BeginDump).  Done: the OpenSession reply.
        `supply_fd`: a streamed restore's or verify's supply pipe (the caller's, sent with OpenSession)."""
        self._begin(self._open(spec, supply_fd))

    def add_bos(self, token: str, bos: Sequence[ClientBo]) -> None:
        """A dump's data files of each GPU the BOs name first (CreateDataFile, AttachFiles), then AddBos in as
        many messages as the limits need.  Done: the last reply (no BOs: GetProgress's)."""
        self._begin(self._add_bos(token, bos))

    def start(self, token: str) -> None:
        """Start; a dump this machine opened hands over its manifest temporary (CreateManifest)."""
        self._begin(self._start(token))

    def wait(self, token: str, timeout_ms: int | None = None) -> None:
        """The barrier.  A dump this machine opened that is DONE is committed (Commit) and released; a
        session that ended with an error is released; WaitTimeoutError leaves it as it is."""
        self._begin(self._wait(token, timeout_ms))

    def progress(self, token: str) -> None:
        self._begin(self._checked(requests.get_progress(token)))

    def cancel(self, token: str, reason: str = "") -> None:
        self._begin(self._checked(requests.cancel(token=token, reason=reason)))

    def cancel_by_id(self, session_id: int, reason: str = "") -> None:
        self._begin(self._checked(requests.cancel(session_id=session_id, reason=reason)))

    def close_session(self, token: str) -> None:
        """CloseSession; the session's files are released whatever the answer."""
        self._begin(self._close(token))

    def status(self) -> None:
        self._begin(self._checked(requests.get_status()))

    def list_sessions(self) -> None:
        self._begin(self._checked(requests.list_sessions()))

    def exchange(self, call: Call) -> None:
        """Any one request; Done carries its response, error included (not raised)."""
        self._begin(self._call(call))

    def _hello(self) -> Op:
        resp = yield Send(self.connection.hello_request())
        assert isinstance(resp, rpc.Response)
        return resp

    def _open(self, spec: OpenSpec, supply_fd: int | None) -> Op:
        fds = []
        for k in spec.manifest_images:
            fds.append((yield from self._fd(OpenManifest(k))))
        resp = yield from self._checked(requests.open_session(spec, fds, supply_fd))
        info = resp.session
        if not TOKEN.fullmatch(info.token):
            raise self.connection.error("OpenSession answered without a valid token")
        own = self._own[info.token] = _Own(spec.kind)
        try:
            if own.dump:
                yield from self._begin_dump(info, own)
            yield from self._attach_needed(info.token, spec, info.files_needed)
        except GeneratorExit:
            raise
        except BaseException:
            yield from self._close_quietly(info.token)
            raise
        own.phase = SessionPhase.OPEN
        return resp

    def _begin_dump(self, info: rpc.SessionInfo, own: _Own) -> Generator[Event, object, None]:
        if len(info.image_id) != 16:
            raise ProtocolError(f"the daemon named the dump's image with {len(info.image_id)} bytes, not 16")
        asked = info.data_files_per_gpu or 1  # 0: a daemon older than the field
        if asked > MAX_DATA_FILES_PER_GPU:
            raise ProtocolError(f"the daemon asked for {asked} data files per GPU; the format allows "
                                f"{MAX_DATA_FILES_PER_GPU}")
        own.image_id, own.stripes = info.image_id, min(asked, self.max_data_files_per_gpu or asked)
        yield BeginDump(info.token, info.image_id, own.stripes)

    def _attach_needed(self, token: str, spec: OpenSpec,
                       needed: Iterable[rpc.FileRef]) -> Generator[Event, object, None]:
        """Open and attach every file the daemon asked for, in as many messages as the limits need."""
        c = self.connection
        max_fds, budget = c.max_fds_per_message, message_budget(c.max_message_bytes)
        direct = max_fds >= 2
        files: list[ClientFile] = []
        nfds, size = 0, len(token) + 8
        for want in needed:
            if not 0 <= want.image <= spec.parents or (spec.dump and want.image == 0) \
                    or not DATA_FILE_NAME.fullmatch(want.name):
                raise c.error(f"vramd asked for a file this client does not open: image {want.image}, name "
                              f"{want.name[:64]!r}")
            nbytes = needed_ref_bytes(want.image, want.name, nfds, direct=direct)
            if files and (nfds + 1 + direct > max_fds or size + nbytes > budget):
                yield from self._checked(requests.attach_files(token, files))
                files, nfds, size = [], 0, len(token) + 8
                nbytes = needed_ref_bytes(want.image, want.name, 0, direct=direct)
            f = yield from self._file(OpenDataFile(token, want.image, want.name, direct))
            files.append(f)
            nfds += 1 + (f.direct_fd is not None)
            size += nbytes
        if files:
            yield from self._checked(requests.attach_files(token, files))

    def _dump_data(self, token: str, own: _Own, bos: Sequence[ClientBo]) -> Generator[Event, object, None]:
        """Each GPU the BOs name (first named first) that has no data files yet and that the daemon allows:
        its data files made and attached, in as many messages as the limits need.  Those of a message the
        daemon refused, or never sent, are dropped (made again by the next add_bos)."""
        c = self.connection
        max_fds, budget = c.max_fds_per_message, message_budget(c.max_message_bytes)
        direct = max_fds >= 2
        gpus = [g for g in dict.fromkeys(b.gpu_id or 0 for b in bos) if g not in own.gpus and c.allows_gpu(g)]
        files: list[ClientFile] = []
        nfds, size = 0, len(token) + 8
        try:
            for gpu in gpus:
                for stripe in range(own.stripes):
                    if files and (nfds + 1 + direct > max_fds or size + DUMP_REF_BYTES > budget):
                        yield from self._checked(requests.attach_files(token, files))
                        own.gpus.update(f.gpu_id or 0 for f in files)
                        files, nfds, size = [], 0, len(token) + 8
                    f = yield from self._file(CreateDataFile(token, gpu, stripe, direct))
                    files.append(f)
                    nfds += 1 + (f.direct_fd is not None)
                    size += DUMP_REF_BYTES
            if files:
                yield from self._checked(requests.attach_files(token, files))
                own.gpus.update(f.gpu_id or 0 for f in files)
        except GeneratorExit:
            raise
        except BaseException:
            if files:
                yield DropDataFiles(token, tuple((f.gpu_id or 0, f.stripe) for f in files))
            raise

    def _add_bos(self, token: str, bos: Sequence[ClientBo]) -> Op:
        own = self._own.get(token)
        if bos and own is not None and own.dump and own.phase in (SessionPhase.OPEN, SessionPhase.STARTED):
            yield from self._dump_data(token, own, bos)
        c = self.connection
        resp = None
        for msg, fds, roles in pack_bos(token, bos, max_message_bytes=c.max_message_bytes,
                                        max_fds=c.max_fds_per_message):
            resp = yield from self._checked(requests.add_bos_message(token, msg, fds, roles))
        if resp is None:
            resp = yield from self._checked(requests.get_progress(token))
        return resp

    def _start(self, token: str) -> Op:
        own = self._own.get(token)
        fd = None
        if own is not None and own.dump and own.phase in (SessionPhase.OPEN, SessionPhase.STARTED):
            fd = yield from self._fd(CreateManifest(token))
        resp = yield from self._checked(requests.start(token, fd))
        if own is not None:
            own.phase = SessionPhase.STARTED
        return resp

    def _wait(self, token: str, timeout_ms: int | None) -> Op:
        resp = yield from self._call(requests.wait(token, timeout_ms))
        own = self._own.get(token)
        try:
            raise_for_error(resp)
        except WaitTimeoutError:
            raise  # the session goes on
        except VramdError:
            yield from self._release(token)
            raise
        if own is not None and own.dump and resp.session.state == rpc.SESSION_DONE:
            own.phase = SessionPhase.COMMITTING
            try:
                yield Commit(token)
            except GeneratorExit:
                raise
            except BaseException:
                yield from self._release(token)
                raise
            yield from self._release(token)
        return resp

    def _close(self, token: str) -> Op:
        try:
            resp = yield from self._call(requests.close_session(token))
        except GeneratorExit:
            raise
        except BaseException:
            yield from self._release(token)
            raise
        yield from self._release(token)
        return raise_for_error(resp)

    def _close_quietly(self, token: str) -> Generator[Event, object, None]:
        """End a session this machine cannot hand over (its answer ignored: the first error is the one to
        report), where the connection still works; then release its files."""
        if self.connection.state is ConnState.IDLE:
            try:
                yield from self._call(requests.close_session(token))
            except (VramdError, OSError):
                pass
        yield from self._release(token)

    def _release(self, token: str) -> Generator[Event, object, None]:
        if self._own.pop(token, None) is not None:
            yield ReleaseFiles(token)
