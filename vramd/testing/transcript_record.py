"""Record the transcript fixtures from a real daemon, and write the hand-written ones derived from them.

    python -m vramd.testing.transcript_record tests/transcripts     # regenerate every fixture

Each recordable scenario (`SCENARIOS`) runs with the Python client (vramd.testing.transcript_drive) against
a real vramd (vramd.testing.launcher) through a recording relay: a socket the client connects to, which
passes every packet and fd on to the daemon and back, and writes each down (fds by their role:
transcript.fd_role), then normalised by the rules vramd.testing.transcript names.  A scenario's "prepare"
(an image to restore, a parent to dump against) runs on a direct connection and is not recorded.  The error
paths a real daemon cannot produce (`DERIVED`: a reply with the wrong request id, a hang-up, a daemon that
asks for more data files than the format allows) are written from a recorded fixture by an explicit edit,
and say so in their "about" and "derived_from".
"""
from __future__ import annotations

import base64
import copy
import json
import os
import shutil
import socket
import sys
import tempfile
import threading
from collections.abc import Callable, Mapping
from pathlib import Path

from ..client import SESSION_DUMP, Client
from ..pb import rpc_pb2 as rpc
from ..protocol.fds import close_fds, pack_fds, unpack_fds
from ..protocol.frames import HEADER_SIZE, SCM_MAX_FD
from .launcher import DaemonProcess
from .transcript import ANY, REQUEST, JsonValue, Step, direct_io_dir, fd_role, fixed_image_id, fixed_token, image_dirs
from .transcript_drive import client_bos, drive, make_bos

CHUNK = 64 << 10
DAEMON_CONFIG = """\
copy_threads = 2
data_files_per_gpu = 2
chunk_size = "1M"
staging_budget = "64M"
grace_period = 5
topology_root = "{root}/no-topology/none"
"""


def _bos(*specs: tuple[int, int, int]) -> list[dict[str, JsonValue]]:
    return [{"id": i, "memfd_size": size, "size": size, "gpu_id": 0, "backend": "mmap", "name": f"bo{i}",
             "seed": seed} for i, size, seed in specs]


BOS = _bos((1, 160 << 10, 1), (2, 40 << 10, 2))
# more fds than one packet may carry (AddBos packing), BOs without a GPU, BOs sharing one memfd at offsets
MANY_BOS: list[dict[str, JsonValue]] = [
    {"id": 1, "memfd_size": 64 << 10, "size": 4096, "seed": 7},
    *({"id": i, "memfd_size": 4096, "size": 4096, "name": f"small{i}"} for i in range(2, 271)),
    *({"id": i, "fd_of": 1, "offset": 4096 * (i - 270), "size": 4096, "backend": "mmap"} for i in range(271, 281))]
RESTORE_BOS = [{"id": b["id"], "memfd_size": b["memfd_size"], "backend": "mmap"} for b in BOS]
DUMP_OPEN = {"do": "open", "kind": "dump", "dir": "image", "compression": "none", "chunk_size": CHUNK,
             "label": "tx-dump"}
RESTORE_OPEN = {"do": "open", "kind": "restore", "dir": "image", "label": "tx-restore"}
SESSION = [{"do": "add_bos"}, {"do": "start"}, {"do": "wait"}, {"do": "close_session"}, {"do": "disconnect"}]


def _dump_into(name: str, bos: list[dict[str, JsonValue]] = BOS) -> Callable[[Path, str], list[bytes]]:
    """A "prepare" step: dump `bos` into root/name over a direct connection; its image id."""
    def prepare(root: Path, socket_path: str) -> list[bytes]:
        (root / name).mkdir(exist_ok=True)
        setup: dict[str, JsonValue] = {"bos": bos}
        fds = make_bos(setup)
        dfd = os.open(root / name, os.O_RDONLY | os.O_DIRECTORY)
        try:
            with Client(socket_path) as c:
                info = c.run_session(SESSION_DUMP, dfd, client_bos(setup, fds), chunk_size=CHUNK)
                return [info.image_id]
        finally:
            os.close(dfd)
            for fd in fds.values():
                os.close(fd)
    return prepare


def _dump_chain() -> Callable[[Path, str], list[bytes]]:
    """Prepare: BOS dumped into root/parent, then an incremental image of them (BO 2 changed) into root/image."""
    def prepare(root: Path, socket_path: str) -> list[bytes]:
        ids = _dump_into("parent")(root, socket_path)
        (root / "image").mkdir()
        setup: dict[str, JsonValue] = {"bos": _bos((1, 160 << 10, 1), (2, 40 << 10, 3))}
        fds = make_bos(setup)
        dfd = os.open(root / "image", os.O_RDONLY | os.O_DIRECTORY)
        pfd = os.open(root / "parent", os.O_RDONLY | os.O_DIRECTORY)
        try:
            with Client(socket_path) as c:
                info = c.run_session(SESSION_DUMP, dfd, client_bos(setup, fds), chunk_size=CHUNK, parent_fds=[pfd])
                return [*ids, info.image_id]
        finally:
            for fd in [dfd, pfd, *fds.values()]:
                os.close(fd)
    return prepare


def _corrupt(name: str) -> Callable[[Path, str], list[bytes]]:
    """Prepare: an image of one BO with one stored chunk (so where it lands does not depend on timing), one
    byte of that chunk's record flipped."""
    dump = _dump_into(name, _bos((2, 40 << 10, 2)))

    def prepare(root: Path, socket_path: str) -> list[bytes]:
        ids = dump(root, socket_path)
        f = max((root / name).glob("data-*.vrd"), key=lambda p: p.stat().st_size)
        data = bytearray(f.read_bytes())
        data[-100] ^= 0xFF
        f.write_bytes(bytes(data))
        return ids
    return prepare


Scenario = tuple[str, dict[str, JsonValue], Callable[[Path, str], list[bytes]] | None]
SCENARIOS: list[Scenario] = [
    ("dump", {"about": "a dump of two BOs on GPU 0: two data files per GPU, commit at Wait",
              "bos": BOS, "actions": [{"do": "connect"}, DUMP_OPEN, *SESSION]}, None),
    ("dump-many-bos", {"about": "a dump of 280 BOs: more fds than one AddBos may carry, BOs without a GPU, "
                                "ten BOs sharing one memfd at offsets",
                       "bos": MANY_BOS, "actions": [{"do": "connect"}, DUMP_OPEN, *SESSION]}, None),
    ("dump-options", {"about": "a dump with every OpenSession option the clients share: zstd, no dedup, "
                               "replace_parent, a parent hint",
                      "bos": BOS, "actions": [{"do": "connect"},
                                              dict(DUMP_OPEN, compression="zstd:3", no_dedup=True, replace_parent=True,
                                                   parent_hint="../elsewhere", label="tx-options"), *SESSION]},
     None),
    ("dump-incremental", {"about": "an incremental dump against one parent: its manifest at OpenSession, its "
                                   "data files as the daemon names them",
                          "bos": _bos((1, 160 << 10, 1), (2, 40 << 10, 3)),
                          "actions": [{"do": "connect"}, dict(DUMP_OPEN, parents=["parent"], parent_hint="../parent",
                                                              label="tx-incremental"), *SESSION]},
     _dump_into("parent")),
    ("restore", {"about": "a restore of a dumped image into two memfds",
                 "bos": RESTORE_BOS, "actions": [{"do": "connect"}, RESTORE_OPEN, *SESSION]}, _dump_into("image")),
    ("restore-incremental", {"about": "a restore of an incremental image: its parent's manifest and data files too",
                             "bos": RESTORE_BOS,
                             "actions": [{"do": "connect"}, dict(RESTORE_OPEN, parents=["parent"]), *SESSION]},
     _dump_chain()),
    ("wait-timeout", {"about": "a Wait with a timeout on a restore not started yet: TIMEOUT, the session goes on",
                      "bos": RESTORE_BOS,
                      "actions": [{"do": "connect"}, RESTORE_OPEN, {"do": "add_bos"},
                                  {"do": "wait", "timeout_ms": 0, "expect": "TIMEOUT"}]}, _dump_into("image")),
    ("verify", {"about": "a verify: it starts once its files are attached, Wait is its barrier",
                "actions": [{"do": "connect"}, {"do": "open", "kind": "verify", "dir": "image", "label": "tx-verify"},
                            {"do": "wait"}, {"do": "close_session"}, {"do": "disconnect"}]}, _dump_into("image")),
    ("offload", {"about": "an offloaded restore: submitted on one connection (vramd_criu_restore_submit), attached "
                          "and waited on another (vramd_criu_restore_barrier)",
                 "bos": RESTORE_BOS,
                 "actions": [{"do": "criu_restore_submit", "dir": "image", "label": "tx-offload", "backend": "mmap"},
                             {"do": "criu_restore_barrier"}]}, _dump_into("image")),
    ("open-refused", {"about": "an OpenSession the daemon refuses (an unknown compression)",
                      "bos": BOS, "actions": [{"do": "connect"}, dict(DUMP_OPEN, compression="bogus",
                                                                       expect="INVALID_REQUEST")]}, None),
    ("wait-job-error", {"about": "a verify of a damaged image: the job's error comes at Wait",
                        "actions": [{"do": "connect"},
                                    {"do": "open", "kind": "verify", "dir": "image", "label": "tx-damaged"},
                                    {"do": "wait", "expect": "CORRUPT_CHUNK"}]}, _corrupt("image")),
    ("wait-cancelled", {"about": "a restore cancelled before its BOs: Wait answers CANCELLED",
                        "actions": [{"do": "connect"}, RESTORE_OPEN, {"do": "cancel", "reason": "tx"},
                                    {"do": "wait", "expect": "CANCELLED"}]}, _dump_into("image")),
]


class Normaliser:
    """The rules of vramd.testing.transcript's docstring, applied to recorded steps."""

    def __init__(self, root: Path) -> None:
        self.root = str(root)
        self.real_root = os.path.realpath(root)
        self.tokens: dict[str, str] = {}
        self.ids: dict[bytes, bytes] = {}

    def image_id(self, raw: bytes) -> bytes:
        return self.ids.setdefault(raw, fixed_image_id(len(self.ids) + 1))

    def text(self, s: str) -> str:
        for raw, fixed in self.ids.items():
            s = s.replace(raw.hex(), fixed.hex()).replace(raw.hex()[:16], fixed.hex()[:16])
        for raw_t, fixed_t in self.tokens.items():
            s = s.replace(raw_t, fixed_t)
        return s.replace(self.real_root, "<root>").replace(self.root, "<root>")

    def value(self, v: JsonValue, key: str = "") -> JsonValue:
        if isinstance(v, dict):
            return {k: self.value(x, k) for k, x in v.items()}
        if isinstance(v, list):
            return [self.value(x, key) for x in v]
        if isinstance(v, str):
            if key == "token" and v:
                v = self.tokens.setdefault(v, fixed_token(len(self.tokens) + 1))
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
                for k in ("uid", "pid", "target_pids", "age_s", "rate_bytes_per_s", "progress"):
                    s.pop(k, None)
        # image ids first, as responses name them (a token's rule keys on the field)
        for s in (out.get("recv"),):
            if isinstance(s, dict) and isinstance(info := s.get("session"), dict) and "image_id" in info:
                self.image_id(base64.b64decode(str(info["image_id"])))
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


def record(name: str, setup: dict[str, JsonValue], prepare: Callable[[Path, str], list[bytes]] | None,
           workdir: str | None = None) -> dict[str, JsonValue]:
    """Run one scenario against a fresh daemon through the relay: its transcript, normalised."""
    base = workdir or direct_io_dir()
    if base is None:
        raise RuntimeError("no directory here takes O_DIRECT opens (/var/tmp, /tmp): fixtures are recorded with "
                           "each image file's O_DIRECT twin (the o-direct rule)")
    root = Path(tempfile.mkdtemp(prefix="vramd-tx-", dir=base))
    try:
        os.chmod(root, 0o755)
        (root / "no-topology").mkdir()
        (root / "vramd.toml").write_text(DAEMON_CONFIG.format(root=root))
        with DaemonProcess(str(root), "--config", str(root / "vramd.toml")) as d:
            norm = Normaliser(root)
            for raw in prepare(root, d.socket) if prepare else []:
                norm.image_id(raw)
            for a in setup["actions"]:  # type: ignore[attr-defined]
                for key in ("dir", "parents"):
                    for n in ([a[key]] if key == "dir" else a[key]) if key in a else []:
                        (root / n).mkdir(exist_ok=True)
            dirs = {p.name: sorted(f.name for f in p.iterdir() if f.is_file() and not f.name.startswith("."))
                    for p in root.iterdir() if p.is_dir() and p.name != "no-topology"}
            relay = Relay(str(root / "relay.sock"), d.socket, image_dirs(root, setup))
            try:
                outcomes = drive(setup, str(root / "relay.sock"), root)
            finally:
                relay.close()
            steps = racing_state([norm.step(s) for s in relay.steps])
            expected = [[a["do"], a.get("expect", "ok")] for a in setup["actions"]]  # type: ignore[attr-defined]
            if outcomes != expected[:len(outcomes)] or len(outcomes) != len(expected):
                raise AssertionError(f"{name}: the Python client's outcomes {outcomes}, the scenario's {expected}; "
                                     f"steps: {json.dumps(steps[-3:])}")
            body = {k: v for k, v in setup.items() if k != "about"}
            body["dirs"] = {k: [norm.text(f) for f in v] for k, v in sorted(dirs.items())}
            return {"scenario": name, "about": setup["about"], "setup": body, "steps": steps}
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _find(steps: list[Step], kind: str, body: str, nth: int = 0) -> int:
    """The index of the `nth` step whose `kind` ("send"/"recv") body is `body`, or whose request was."""
    hits = [i for i, s in enumerate(steps) if kind in s and body in s[kind]]  # type: ignore[operator]
    return hits[nth]


DERIVED_FROM = {"too-many-files": "dump", "wrong-request-id": "dump", "hangup": "dump"}


def derive(fixtures: Mapping[str, dict[str, JsonValue]]) -> dict[str, dict[str, JsonValue]]:
    """The hand-written error paths, each an explicit edit of a recorded fixture."""
    out: dict[str, dict[str, JsonValue]] = {}

    def base(src: str, name: str, about: str, expect: Mapping[str, str]) -> list[Step]:
        """A copy of fixture `src` as `name`, its actions up to the one that now fails (`expect`: its outcome);
        its steps, for the caller to edit."""
        t = copy.deepcopy(dict(fixtures[src]))
        t["scenario"], t["about"], t["derived_from"] = name, f"written by hand from {src}.json: {about}", src
        setup = t["setup"]
        assert isinstance(setup, dict)
        actions = setup["actions"]
        (do, code), = expect.items()
        at = next(i for i, a in enumerate(actions) if a["do"] == do)  # the action that fails now; none after it
        setup["actions"] = [*actions[:at], dict(actions[at], expect=code)]
        steps = t["steps"]
        assert isinstance(steps, list)
        out[name] = t
        return steps

    # a daemon that asks for 17 data files per GPU: the client closes the session again and fails
    steps = base("dump", "too-many-files", "OpenSession's reply asks for 17 data files per GPU; the client "
                    "refuses and closes the session", {"open": "PROTOCOL_ERROR"})
    i = _find(steps, "send", "open_session")
    steps[i + 1]["recv"]["session"]["data_files_per_gpu"] = 17  # type: ignore[index]
    token = steps[i + 1]["recv"]["session"]["token"]  # type: ignore[index]
    close = _find(steps, "send", "close_session")
    steps[i + 2:] = [steps[close], {"recv": {"id": REQUEST, "session": {
        "session_id": steps[i + 1]["recv"]["session"]["session_id"],  # type: ignore[index]
        "kind": "SESSION_DUMP", "state": "SESSION_CANCELLED",
        "error": {"code": "CANCELLED", "message": "session closed"}}}}]
    assert steps[i + 2]["send"]["close_session"]["token"] == token  # type: ignore[index]

    # a reply whose id is not the request's: the connection's pairing is lost, the client stops
    steps = base("dump", "wrong-request-id", "the reply to Start carries another request's id",
                    {"start": "PROTOCOL_ERROR"})
    i = _find(steps, "send", "start")
    steps[i + 1]["recv"]["id"] = "99"  # type: ignore[index]
    del steps[i + 2:]

    # the daemon hangs up instead of answering AddBos
    steps = base("dump", "hangup", "the daemon hangs up instead of answering AddBos", {"add_bos": "HANGUP"})
    i = _find(steps, "send", "add_bos")
    steps[i + 1:] = [{"hangup": True}]
    assert {n: str(t["derived_from"]) for n, t in out.items()} == DERIVED_FROM
    return out


def write(t: Mapping[str, JsonValue], path: Path) -> None:
    path.write_text(json.dumps(t, indent=1) + "\n")


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    out = Path(args[0] if args else "tests/transcripts")
    only = set(args[1:])
    out.mkdir(parents=True, exist_ok=True)
    fixtures = {}
    for name, setup, prepare in SCENARIOS:
        if only and name not in only:
            continue
        fixtures[name] = record(name, setup, prepare)
        write(fixtures[name], out / f"{name}.json")
        print(f"recorded {name}: {len(fixtures[name]['steps'])} steps")  # type: ignore[arg-type]
    if "dump" in fixtures:
        for name, t in derive(fixtures).items():
            write(t, out / f"{name}.json")
            print(f"derived {name} from {t['derived_from']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

