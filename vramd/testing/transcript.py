"""Transcripts: one client session scenario's packets, as JSON, and a scripted fake daemon that replays them.

A transcript (tests/transcripts/<name>.json; the format is described in
tests/transcripts/README.md) holds what a client sends and what the daemon
answers, step by step, with the role of every fd a packet carries.  The
fixtures are recorded from a real daemon (vramd.testing.transcript_record)
and replayed here against any client: `FakeDaemon` listens on a socket and,
for each "send" step, receives the client's packet and compares it field by
field with the fixture (the fds by their roles), failing with a message that
names the step and the field; for each "recv" step it sends the scripted
response.  So the Python client and libvramd are held to the same packets.

Normalisation rules (what a fixture writes in place of run-to-run values;
the recorder applies them, the fake daemon understands them):

- ``request-id``: a request's id is ``"<any>"`` in "send" steps and a
  response's id is ``"<request>"`` (the fake echoes the id it just received):
  the ids are the client's choice, only their pairing is the protocol's.  A
  literal id in a "recv" step is sent as written (a hand-written fixture's
  wrong id).
- ``client-name``: Hello's ``client`` is ``"<any>"`` (a free-form string for
  logs: "python 0.1.0", "libvramd").
- ``token``: the n-th distinct session token is ``f"{n:032x}"``; the fake
  issues the fixture's, and the client must send it back exactly.
- ``session-id``: the n-th distinct session id is ``"n"``, in ``session_id``
  fields and in messages ("session <id>") (one recording daemon serves every
  scenario; the ids are for logs, the clients pass them on).
- ``image-id``: the n-th distinct image id is the byte ``0x7n`` 16 times, in
  ``image_id`` fields and in every name or message that spells it in hex;
  the client names its dump's files after the id the fake issues.
- ``run-values``: a SessionInfo's uid, pid, target_pids, age_s,
  rate_bytes_per_s, progress (timings and counters of a running copy) and
  holders (whether the daemon has seen an earlier connection's hang-up yet)
  are dropped: the clients only pass them on.
- ``hello-machine``: HelloReply's backends and server string are dropped:
  they describe the machine and the release, and no client acts on them
  within a session.
- ``racing-state``: a reply before the session's Wait or CloseSession says
  how far its copy got at that instant; an ended state there (DONE,
  CANCELLED, FAILED without an error in the reply) is written as the
  earliest it could have been (SEALED, CANCELLING, SEALED).
- ``o-direct``: fixtures are recorded where O_DIRECT opens work, so each
  image file travels with its O_DIRECT twin (``+direct``); a replay where
  they cannot (`direct_io_dir` finds none) expects no twins (`without_direct`).
- ``root``: the recording's temporary directory is ``<root>`` in messages.
"""
from __future__ import annotations

import fcntl
import json
import os
import re
import socket
import stat
import tempfile
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from google.protobuf.json_format import MessageToDict, ParseDict

from ..pb import rpc_pb2 as rpc
from ..protocol.fds import close_fds, unpack_fds
from ..protocol.frames import HEADER_SIZE, KIND_REQUEST, KIND_RESPONSE, SCM_MAX_FD, decode_frame, encode_frame

ANY = "<any>"
REQUEST = "<request>"
JsonValue = object  # what json.load gives: dicts, lists, strings, numbers, booleans, None
Step = dict[str, JsonValue]

_DATA_TMP = re.compile(r"data-([0-9a-f]{16})-([0-9a-f]{8})(?:-([1-9a-f]))?\.vrd\.tmp")
_DATA = re.compile(r"data-[0-9a-f]{16}-[0-9a-f]{8}(?:-[1-9a-f])?\.vrd")
_MANIFEST_TMP = re.compile(r"\.manifest\.vrdm\.([0-9a-f]{32})\.tmp")
_BO_MEMFD = re.compile(r"/memfd:tx-bo-(\d+) \(deleted\)")


def fixed_token(n: int) -> str:
    """The ``token`` rule's n-th token (n from 1)."""
    return f"{n:032x}"


def fixed_image_id(n: int) -> bytes:
    """The ``image-id`` rule's n-th image id (n from 1)."""
    return bytes([0x70 + n]) * 16


def bo_memfd_name(bo_id: int) -> str:
    """The name a driver gives a BO's memfd: its fd's role is then ``bo:<id>``."""
    return f"tx-bo-{bo_id}"


def fd_role(fd: int, images: Mapping[str, int], image_ids: Sequence[str]) -> str:
    """The role of `fd` (tests/transcripts/README.md), from what the fd is: its /proc/self/fd link, the file's
    name and type, its memfd name, its access mode (an image's files read-only, a dump's own writable: else
    the role says ":writable" or ":read-only"), O_DIRECT.  `images`: each image directory's real path -> its
    index (0 the session's image, k its k-th parent); `image_ids`: the image ids (hex) a dump's own files may be
    named after."""
    target = os.readlink(f"/proc/self/fd/{fd}")
    st = os.fstat(fd)
    flags = fcntl.fcntl(fd, fcntl.F_GETFL)
    direct = "+direct" if os.O_DIRECT & flags else ""
    writable = flags & os.O_ACCMODE != os.O_RDONLY
    m = _BO_MEMFD.fullmatch(target)
    if m:
        return f"bo:{m.group(1)}"
    if stat.S_ISFIFO(st.st_mode) and not writable:  # a streamed session's supply pipe, its read end
        return "supply"
    if not stat.S_ISREG(st.st_mode):
        return f"other:{target}"
    where, _, name = target.rpartition("/")
    k = images.get(where)
    if k is None:
        return f"other:{target}"
    # what a committed image's files are opened for (read), and a dump's own (write): else the role says so
    mode = ":writable" if writable else ""
    if name == "manifest.vrdm":
        return f"manifest:{k}{mode}{direct}"
    if (t := _MANIFEST_TMP.fullmatch(name)) and k == 0:
        image = "" if t.group(1) in image_ids else f":image={t.group(1)}"
        return f"dump-manifest{image}{'' if writable else ':read-only'}{direct}"
    if (d := _DATA_TMP.fullmatch(name)) and k == 0:
        image = "" if any(i.startswith(d.group(1)) for i in image_ids) else f"image={d.group(1)}:"
        return (f"dump-data:{image}gpu={int(d.group(2), 16)}:stripe={int(d.group(3) or '0', 16)}"
                f"{'' if writable else ':read-only'}{direct}")
    if _DATA.fullmatch(name):
        return f"data:{k}:{name}{mode}{direct}"
    return f"other:{k}:{name}{direct}"


def request_to_dict(req: rpc.Request) -> dict[str, JsonValue]:
    return dict(MessageToDict(req, preserving_proto_field_name=True))


def response_to_dict(resp: rpc.Response) -> dict[str, JsonValue]:
    return dict(MessageToDict(resp, preserving_proto_field_name=True))


def differences(expected: JsonValue, got: JsonValue, path: str = "") -> list[str]:
    """Where `got` (a client's request as a dict) differs from `expected` (the fixture's), one line each, by
    field path; ``"<any>"`` in `expected` matches any value (a field the client must still send)."""
    name = path or "the message"
    if expected == ANY:
        return [] if got is not None else [f"{name}: the fixture has a value, the client sent none"]
    if isinstance(expected, dict) and isinstance(got, dict):
        out = []
        for key in sorted(set(expected) | set(got)):
            sub = f"{path}.{key}" if path else str(key)
            if key not in got:
                out.append(f"{sub}: the fixture has {json.dumps(expected[key])}, the client sent none")
            elif key not in expected:
                out.append(f"{sub}: the fixture has none, the client sent {json.dumps(got[key])}")
            else:
                out += differences(expected[key], got[key], sub)
        return out
    if isinstance(expected, list) and isinstance(got, list):
        out = [f"{name}: the fixture has {len(expected)} entries, the client sent {len(got)}"] \
            if len(expected) != len(got) else []
        for i, (e, g) in enumerate(zip(expected, got)):
            out += differences(e, g, f"{path}[{i}]")
        return out
    return [] if expected == got else [f"{name}: the fixture has {json.dumps(expected)}, the client sent "
                                       f"{json.dumps(got)}"]


def load(path: str | os.PathLike[str]) -> dict[str, JsonValue]:
    with open(path) as f:
        data = json.load(f)
    assert isinstance(data, dict), f"{path}: not a transcript"
    return data


def image_ids_of(steps: Sequence[Step]) -> list[str]:
    """The image ids (hex) the daemon's responses of `steps` name."""
    import base64
    out = []
    for s in steps:
        body = s.get("recv")
        session = body.get("session") if isinstance(body, dict) else None
        if isinstance(session, dict) and isinstance(session.get("image_id"), str):
            out.append(base64.b64decode(session["image_id"]).hex())
    return out


class TranscriptMismatch(AssertionError):
    """A client did not send what the fixture says (the message names the step and the field)."""


@dataclass
class FakeDaemon:
    """A scripted daemon on `path`: acts out `steps` (each on its connection, ``"conn"``, 0 by default; a
    connection is accepted when its first step comes, and must be closed by the client after its last) and
    records the first mismatch in `failure`.  `images`: the replay's image directories -> their indexes."""

    path: str
    steps: Sequence[Step]
    images: Mapping[str, int]
    name: str = "transcript"
    timeout: float = 20.0
    failure: str | None = None
    done: bool = False
    _listener: socket.socket = field(init=False, repr=False)
    _thread: threading.Thread = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.image_ids = image_ids_of(self.steps)
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        self._listener.bind(self.path)
        self._listener.listen(4)
        self._listener.settimeout(self.timeout)
        self._thread = threading.Thread(target=self._serve, name=f"fake-vramd {self.name}", daemon=True)
        self._thread.start()

    def __enter__(self) -> FakeDaemon:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._thread.join(self.timeout * 2)
        self._listener.close()

    def result(self) -> None:
        """Raise TranscriptMismatch with the first difference, if the client's packets differed."""
        self.close()
        if self.failure is not None:
            raise TranscriptMismatch(self.failure)
        if not self.done:
            raise TranscriptMismatch(f"{self.name}: the fake daemon did not finish its steps")

    def _fail(self, i: int, what: str) -> None:
        step = self.steps[i] if i < len(self.steps) else {}
        kind = next((k for k in ("send", "recv", "hangup") if k in step), "end")
        body = step.get(kind)
        label = next((k for k in (body or {}) if k != "id"), "") if isinstance(body, dict) else ""
        self.failure = f"{self.name}: step {i} ({kind} {label}".rstrip() + f"): {what}"

    def _serve(self) -> None:
        conns: dict[int, socket.socket] = {}
        last: int | None = None
        last_id: int | None = None
        try:
            for i, step in enumerate(self.steps):
                k = step.get("conn", 0)
                assert isinstance(k, int)
                if k != last and last is not None and not self._expect_eof(conns[last], i, last):
                    return
                if k not in conns:
                    try:
                        conns[k], _ = self._listener.accept()
                    except TimeoutError:
                        self._fail(i, f"the client did not open connection {k}")
                        return
                    conns[k].settimeout(self.timeout)
                last = k
                sock = conns[k]
                if "hangup" in step:
                    sock.shutdown(socket.SHUT_RDWR)
                elif "send" in step:
                    got = self._receive(sock, i, step)
                    if got is None:
                        return
                    last_id = got
                else:
                    recv = step["recv"]
                    assert isinstance(recv, dict), f"step {i}: recv is not a message"
                    body = dict(recv)
                    if body.get("id", REQUEST) == REQUEST:
                        body["id"] = str(last_id or 0)
                    resp = ParseDict(body, rpc.Response())
                    sock.sendmsg([encode_frame(KIND_RESPONSE, resp)])
            if last is not None and not self._expect_eof(conns[last], len(self.steps), last):
                return
            self.done = True
        except Exception as e:  # a fake that breaks names where
            self._fail(len(self.steps), f"the fake daemon failed: {type(e).__name__}: {e}")
        finally:
            for s in conns.values():
                s.close()

    def _receive(self, sock: socket.socket, i: int, step: Step) -> int | None:
        """Receive the client's packet for step `i` and compare it; its request id, or None on a mismatch."""
        try:
            data, anc, _, _ = sock.recvmsg(1 << 21, socket.CMSG_SPACE(SCM_MAX_FD * 4))
        except TimeoutError:
            self._fail(i, f"the client sent nothing within {self.timeout} s")
            return None
        except OSError as e:
            self._fail(i, f"the client's connection failed: {e}")
            return None
        fds = unpack_fds(anc)
        try:
            if not data:
                self._fail(i, "the client closed the connection instead")
                return None
            req = rpc.Request()
            req.ParseFromString(decode_frame(data, KIND_REQUEST))
            got = request_to_dict(req)
            diffs = differences(step["send"], got)
            roles = [fd_role(fd, self.images, self.image_ids) for fd in fds]
            want = step.get("fds", [])
            assert isinstance(want, list)
            if roles != want:
                diffs.append(f"fds: the fixture has {want}, the client attached {roles}")
            if diffs:
                self._fail(i, "; ".join(diffs))
                return None
            return req.id
        finally:
            close_fds(fds)

    def _expect_eof(self, sock: socket.socket, i: int, k: int) -> bool:
        """The client closes connection `k` after its last step; a packet instead is a mismatch."""
        try:
            data = sock.recv(1 << 21)
        except TimeoutError:
            self._fail(i, f"the client kept connection {k} open after its last step")
            return False
        except OSError:
            return True
        if data:
            req = rpc.Request()
            try:
                req.ParseFromString(data[HEADER_SIZE:])
                what = json.dumps(request_to_dict(req))
            except Exception:
                what = f"{len(data)} bytes"
            self._fail(i, f"the client sent a request the fixture does not have on connection {k}: {what}")
            return False
        return True


def image_dirs(root: Path, setup: Mapping[str, JsonValue]) -> dict[str, int]:
    """The real paths of the scenario's image directories under `root` -> their index (the image 0, parents
    1...), as the setup's first "open" or "criu_restore_submit" action names them."""
    actions = setup.get("actions", [])
    assert isinstance(actions, list)
    for a in actions:
        if isinstance(a, dict) and "dir" in a:
            names = [a["dir"], *a.get("parents", [])]
            return {os.path.realpath(root / str(n)): k for k, n in enumerate(names)}
    return {}


def direct_io_dir(candidates: Sequence[str] = ("/var/tmp", "/tmp")) -> str | None:
    """The first of `candidates` whose file system takes O_DIRECT opens (tmpfs does not), or None."""
    for d in candidates:
        try:
            fd, path = tempfile.mkstemp(prefix=".vramd-tx-probe-", dir=d)
        except OSError:
            continue
        try:
            os.close(os.open(path, os.O_RDONLY | os.O_DIRECT))
            return d
        except OSError:
            pass
        finally:
            os.close(fd)
            os.unlink(path)
    return None


def without_direct(steps: Sequence[Step]) -> list[Step]:
    """`steps` as a client sends them where O_DIRECT opens fail (the ``o-direct`` rule): each file's fd alone."""
    out = []
    for s in steps:
        s = json.loads(json.dumps(s))
        fds = s.get("fds")
        if isinstance(fds, list) and any(isinstance(r, str) and r.endswith("+direct") for r in fds):
            s["fds"] = [r for r in fds if not str(r).endswith("+direct")]
            body = s["send"]
            assert isinstance(body, dict)
            files = body.get("attach_files", {}).get("files", [])
            for i, f in enumerate(files):
                f.pop("direct_fd_index", None)
                f.pop("fd_index", None)
                if i:
                    f["fd_index"] = i
        out.append(s)
    return out
