"""Record the transcript fixtures from a real daemon, and write the hand-written ones derived from them.

    python -m vramd.testing.transcript_record tests/transcripts     # regenerate every fixture

Each recordable scenario (transcript_scenarios.SCENARIOS) runs with the Python client
(vramd.testing.transcript_drive) against a real vramd (vramd.testing.launcher) through a recording relay: a
socket the client connects to, which passes every packet and fd on to the daemon and back, and writes each
down (fds by their role: transcript.fd_role), then normalised by the rules vramd.testing.transcript names.
One daemon serves every scenario, each in a directory of its own.  The hand-written fixtures are then derived
from the recorded ones (transcript_scenarios.derive).
"""
from __future__ import annotations

import base64
import copy
import json
import os
import re
import shutil
import socket
import sys
import tempfile
import threading
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path

from ..pb import rpc_pb2 as rpc
from ..protocol.fds import close_fds, pack_fds, unpack_fds
from ..protocol.frames import HEADER_SIZE, SCM_MAX_FD
from .launcher import DaemonProcess
from .transcript import ANY, REQUEST, JsonValue, Step, direct_io_dir, fd_role, fixed_image_id, fixed_token, image_dirs
from .transcript_drive import drive, expected
from .transcript_scenarios import SCENARIOS, Scenario, derive

DAEMON_CONFIG = """\
copy_threads = 2
data_files_per_gpu = 2
chunk_size = "1M"
staging_budget = "64M"
grace_period = 5
topology_root = "{root}/no-topology/none"
"""


class Normaliser:
    """The rules of vramd.testing.transcript's docstring, applied to recorded steps."""

    def __init__(self, root: Path) -> None:
        self.root = str(root)
        self.real_root = os.path.realpath(root)
        self.tokens: dict[str, str] = {}
        self.ids: dict[bytes, bytes] = {}
        self.sessions: dict[str, str] = {}

    def image_id(self, raw: bytes) -> bytes:
        return self.ids.setdefault(raw, fixed_image_id(len(self.ids) + 1))

    def text(self, s: str) -> str:
        for raw, fixed in self.ids.items():
            s = s.replace(raw.hex(), fixed.hex()).replace(raw.hex()[:16], fixed.hex()[:16])
        for raw_t, fixed_t in self.tokens.items():
            s = s.replace(raw_t, fixed_t)
        s = re.sub(r"\bsession (\d+)\b", lambda m: f"session {self.sessions.get(m.group(1), m.group(1))}", s)
        return s.replace(self.real_root, "<root>").replace(self.root, "<root>")

    def value(self, v: JsonValue, key: str = "") -> JsonValue:
        if isinstance(v, dict):
            return {k: self.value(x, k) for k, x in v.items()}
        if isinstance(v, list):
            return [self.value(x, key) for x in v]
        if isinstance(v, str):
            if key == "token" and v:
                v = self.tokens.setdefault(v, fixed_token(len(self.tokens) + 1))
            if key == "session_id":
                return self.sessions.setdefault(v, str(len(self.sessions) + 1))
            if key == "image_id":
                return base64.b64encode(self.image_id(base64.b64decode(v))).decode()
            return self.text(v)
        return v

    def step(self, step: Step) -> Step:
        out = copy.deepcopy(step)
        if isinstance(send := out.get("send"), dict):
            send["id"] = ANY  # request-id
            if isinstance(hello := send.get("hello"), dict):
                hello["client"] = ANY  # client-name
        if isinstance(recv := out.get("recv"), dict):
            recv["id"] = REQUEST  # request-id
            for k in ("backends", "server"):  # hello-machine
                h = recv.get("hello")
                if isinstance(h, dict):
                    h.pop(k, None)
            if isinstance(s := recv.get("session"), dict):  # run-values
                for k in ("uid", "pid", "target_pids", "age_s", "rate_bytes_per_s", "progress", "holders"):
                    s.pop(k, None)
        # image ids first, as responses name them (a token's rule keys on the field)
        for s in (out.get("recv"),):
            if isinstance(s, dict) and isinstance(info := s.get("session"), dict) and "image_id" in info:
                self.image_id(base64.b64decode(str(info["image_id"])))
            if isinstance(s, dict) and isinstance(info := s.get("session"), dict) and "session_id" in info:
                self.value(info["session_id"], "session_id")  # session-id: messages name it before the field
        out = {k: self.value(v) for k, v in out.items()}
        return out


_FINAL = ("wait", "close_session")
_EARLIEST = {"SESSION_DONE": "SESSION_SEALED", "SESSION_CANCELLED": "SESSION_CANCELLING"}


def racing_state(steps: list[Step]) -> list[Step]:
    """The ``racing-state`` rule: a reply before the session's Wait or CloseSession says how far its copy got
    at that instant; an ended state there is written as the earliest it could have been."""
    asked = ""
    for s in steps:
        if isinstance(send := s.get("send"), dict):
            asked = next((k for k in send if k != "id"), "")
        recv = s.get("recv")
        if asked in _FINAL or not isinstance(recv, dict) or not isinstance(info := recv.get("session"), dict):
            continue
        state = info.get("state")
        if state in _EARLIEST:
            info["state"] = _EARLIEST[str(state)]
        elif state == "SESSION_FAILED" and "error" not in recv:  # the job's error comes at Wait
            info["state"] = "SESSION_SEALED"
            info.pop("error", None)
    return steps


class Relay:
    """A socket at `path` that relays each connection to the daemon at `upstream`, writing every packet down."""

    def __init__(self, path: str, upstream: str, images: Mapping[str, int]) -> None:
        self.upstream, self.images = upstream, images
        self.steps: list[Step] = []
        self.image_ids: list[str] = []
        self.error: BaseException | None = None
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        self.listener.bind(path)
        self.listener.listen(4)
        self.listener.settimeout(0.2)
        self.open = True
        self.conns = 0
        self.thread = threading.Thread(target=self._accept, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.open = False
        self.thread.join()
        self.listener.close()
        if self.error is not None:
            raise self.error

    def _accept(self) -> None:
        while self.open:
            try:
                client, _ = self.listener.accept()
            except TimeoutError:
                continue
            k, self.conns = self.conns, self.conns + 1
            try:
                self._relay(client, k)  # the clients of a scenario use one connection at a time
            except BaseException as e:
                self.error = e
            finally:
                client.close()

    def _relay(self, client: socket.socket, k: int) -> None:
        with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC) as up:
            up.connect(self.upstream)
            extra = {"conn": k} if k else {}
            while True:
                data, anc, _, _ = client.recvmsg(1 << 21, socket.CMSG_SPACE(SCM_MAX_FD * 4))
                fds = unpack_fds(anc)
                try:
                    if not data:
                        return
                    req = rpc.Request()
                    req.ParseFromString(data[HEADER_SIZE:])
                    from .transcript import request_to_dict, response_to_dict
                    roles = [fd_role(fd, self.images, self.image_ids) for fd in fds]
                    self.steps.append({**extra, "send": request_to_dict(req), "fds": roles})
                    up.sendmsg([data], pack_fds(fds))
                finally:
                    close_fds(fds)
                reply = up.recv(1 << 21)
                if not reply:
                    self.steps.append({**extra, "hangup": True})
                    return
                resp = rpc.Response()
                resp.ParseFromString(reply[HEADER_SIZE:])
                if resp.session.image_id:
                    self.image_ids.append(resp.session.image_id.hex())
                self.steps.append({**extra, "recv": response_to_dict(resp)})
                client.sendmsg([reply])


@contextmanager
def recording_daemon() -> Iterator[tuple[DaemonProcess, Path]]:
    """A real daemon for recording (settings that do not depend on the machine: no KFD topology, two data
    files per GPU) and the directory its scenarios go in."""
    base = direct_io_dir()
    if base is None:
        raise RuntimeError("no directory here takes O_DIRECT opens (/var/tmp, /tmp): fixtures are recorded with "
                           "each image file's O_DIRECT twin (the o-direct rule)")
    top = Path(tempfile.mkdtemp(prefix="vramd-tx-", dir=base))
    try:
        os.chmod(top, 0o755)
        (top / "no-topology").mkdir()
        (top / "vramd.toml").write_text(DAEMON_CONFIG.format(root=top))
        with DaemonProcess(str(top), "--config", str(top / "vramd.toml")) as d:
            yield d, top
    finally:
        shutil.rmtree(top, ignore_errors=True)


def record(scenario: Scenario, daemon: DaemonProcess, top: Path) -> dict[str, JsonValue]:
    """Run one scenario against `daemon` through the relay, in a directory of its own under `top`: its
    transcript, normalised."""
    name, setup, prepare = scenario
    root = top / name
    root.mkdir()
    norm = Normaliser(root)
    for raw in prepare(root, daemon.socket) if prepare else []:
        norm.image_id(raw)
    actions = setup["actions"]
    assert isinstance(actions, list)
    for a in actions:
        for n in [a.get("dir"), *a.get("parents", [])]:
            if n:
                (root / n).mkdir(exist_ok=True)
    dirs = {p.name: sorted(f.name for f in p.iterdir() if f.is_file() and not f.name.startswith("."))
            for p in root.iterdir() if p.is_dir()}
    relay = Relay(str(root / "relay.sock"), daemon.socket, image_dirs(root, setup))
    try:
        outcomes = drive(setup, str(root / "relay.sock"), root)
    finally:
        relay.close()
    steps = racing_state([norm.step(s) for s in relay.steps])
    want = [[a["do"], expected(a, "python")] for a in actions]
    if outcomes != want:
        raise AssertionError(f"{name}: the Python client's outcomes {outcomes}, the scenario's {want}; "
                             f"steps: {json.dumps(steps[-3:])}")
    body = {k: v for k, v in setup.items() if k != "about"}
    body["dirs"] = {k: [norm.text(f) for f in v] for k, v in sorted(dirs.items())}
    return {"scenario": name, "about": setup["about"], "setup": body, "steps": steps}


def record_all(only: Sequence[str] = ()) -> dict[str, dict[str, JsonValue]]:
    """Every recordable scenario (or those named in `only`), recorded; with "dump", the derived ones too."""
    out: dict[str, dict[str, JsonValue]] = {}
    with recording_daemon() as (d, top):
        for scenario in SCENARIOS:
            if not only or scenario[0] in only:
                out[scenario[0]] = record(scenario, d, top)
    if "dump" in out:
        out.update(derive(out))
    return out


def write(t: Mapping[str, JsonValue], path: Path) -> None:
    path.write_text(json.dumps(t, indent=1) + "\n")


def main(argv: list[str] | None = None) -> int:
    """Regenerate the fixtures: python -m vramd.testing.transcript_record [DIR [SCENARIO...]]."""
    args = sys.argv[1:] if argv is None else argv
    out = Path(args[0] if args else "tests/transcripts")
    out.mkdir(parents=True, exist_ok=True)
    for name, t in record_all(args[1:]).items():
        write(t, out / f"{name}.json")
        how = f"derived from {t['derived_from']}" if "derived_from" in t else "recorded"
        print(f"{name}: {how}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
