"""The transcript scenarios: what each fixture in tests/transcripts/ acts out, how its images are prepared,
and the hand-written error paths derived from the recorded fixtures (vramd.testing.transcript_record records
them; tests/transcripts/README.md describes the setup's keys).

A scenario's "prepare" (an image to restore, a parent to dump against) runs on a direct connection to the
daemon and is not recorded.  The error paths a real daemon cannot produce (`derive`: a reply with the wrong
request id, a hang-up, a daemon that asks for more data files than the format allows) are written from a
recorded fixture by an explicit edit, and say so in their "about" and "derived_from".
"""
from __future__ import annotations

import copy
import os
from collections.abc import Callable, Mapping
from pathlib import Path

from ..client import SESSION_DUMP, Client
from .transcript import REQUEST, JsonValue, Step
from .transcript_drive import client_bos, make_bos

CHUNK = 64 << 10


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
# one BO of one chunk: its one record goes to its GPU's first data file whatever the timing (BOS's four records
# go to the GPU's two data files as the copy threads come free, and a streamed restore's TRUNCATED_DATA names
# the file of the record it waited for: with BOS that name changed from run to run)
STREAM_BOS = _bos((1, 40 << 10, 1))
STREAM_RESTORE_BOS = [{"id": b["id"], "memfd_size": b["memfd_size"], "backend": "mmap"} for b in STREAM_BOS]
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
                               "replace_parent, a parent hint; BOs with allocation flags and GPU addresses",
                      "bos": [dict(b, alloc_flags=0x10 + k, va_addr=(k + 1) << 32) for k, b in enumerate(BOS)],
                      "actions": [{"do": "connect"},
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
    ("restore-partial", {"about": "a restore that may leave BOs of the image without a target (allow_partial): "
                                  "one of its two BOs given",
                         "bos": RESTORE_BOS[:1],
                         "actions": [{"do": "connect"}, dict(RESTORE_OPEN, allow_partial=True), *SESSION]},
     _dump_into("image")),
    ("restore-streamed", {"about": "a streamed restore (OpenSession.supply_fd_index: its supply pipe's read end "
                                   "after the manifest) whose pipe ends at once, nothing supplied: Wait answers "
                                   "TRUNCATED_DATA",
                          "bos": STREAM_RESTORE_BOS,
                          "actions": [{"do": "connect"}, dict(RESTORE_OPEN, supply=True, label="tx-streamed"),
                                      {"do": "add_bos"}, {"do": "start"}, {"do": "wait", "expect": "TRUNCATED_DATA"}]},
     _dump_into("image", STREAM_BOS)),
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
                 "actions": [{"do": "criu_restore_submit", "dir": "image", "label": "tx-offload", "backend": "mmap",
                              "allow_partial": True},
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



def _find(steps: list[Step], kind: str, body: str) -> int:
    """The index of the first step whose `kind` ("send"/"recv") message has a `body` ("start", "session")."""
    return next(i for i, s in enumerate(steps) if isinstance(m := s.get(kind), dict) and body in m)


def _at(node: JsonValue, *path: str | int) -> dict[str, JsonValue]:
    """The JSON object at `path` inside `node` (keys of objects, indexes of lists)."""
    for key in path:
        if isinstance(key, int):
            assert isinstance(node, list), f"not a list at {key}"
            node = node[key]
        else:
            assert isinstance(node, dict), f"not an object at {key!r}"
            node = node[key]
    assert isinstance(node, dict), f"not an object at {path}"
    return node


DERIVED_FROM = {"too-many-files": "dump", "wrong-request-id": "dump", "broken-connection": "dump", "hangup": "dump",
                "bad-file-name": "restore"}
# where the clients report the same packets with another error
BROKEN_OUTCOME = {"python": "PROTOCOL_ERROR", "c": "BROKEN"}


def derive(fixtures: Mapping[str, dict[str, JsonValue]]) -> dict[str, dict[str, JsonValue]]:
    """The hand-written error paths, each an explicit edit of a recorded fixture."""
    out: dict[str, dict[str, JsonValue]] = {}

    def base(src: str, name: str, about: str, expect: Mapping[str, JsonValue]) -> list[Step]:
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
    session = _at(steps[i + 1], "recv", "session")
    session["data_files_per_gpu"] = 17
    close = _find(steps, "send", "close_session")
    steps[i + 2:] = [steps[close], {"recv": {"id": REQUEST, "session": {
        "session_id": session["session_id"],
        "kind": "SESSION_DUMP", "state": "SESSION_CANCELLED",
        "error": {"code": "CANCELLED", "message": "session closed"}}}}]
    assert _at(steps[i + 2], "send", "close_session")["token"] == session["token"]

    # a reply whose id is not the request's: the connection's pairing is lost, the client stops
    steps = base("dump", "wrong-request-id", "the reply to Start carries another request's id",
                    {"start": "PROTOCOL_ERROR"})
    i = _find(steps, "send", "start")
    _at(steps[i + 1], "recv")["id"] = "99"
    del steps[i + 2:]

    # after that, the connection is unusable: a later call sends nothing
    steps = base("dump", "broken-connection", "the reply to Start carries another request's id; a CloseSession "
                 "after it sends nothing (the connection's pairing is lost)", {"start": "PROTOCOL_ERROR"})
    i = _find(steps, "send", "start")
    _at(steps[i + 1], "recv")["id"] = "99"
    del steps[i + 2:]
    actions = _at(out["broken-connection"], "setup")["actions"]
    assert isinstance(actions, list)
    actions.append({"do": "close_session", "expect": BROKEN_OUTCOME})

    # a daemon that asks for a file name the image format does not make: the client opens nothing and stops;
    # the connection is unusable from then on (libvramd: broken), the daemon reaps the session
    steps = base("restore", "bad-file-name", "OpenSession's reply asks for ../manifest.vrdm, not a data file "
                 "name; the client refuses it and sends nothing more", {"open": "PROTOCOL_ERROR"})
    i = _find(steps, "send", "open_session")
    _at(steps[i + 1], "recv", "session", "files_needed", 0)["name"] = "../manifest.vrdm"
    del steps[i + 2:]

    # the daemon hangs up instead of answering AddBos
    steps = base("dump", "hangup", "the daemon hangs up instead of answering AddBos", {"add_bos": "HANGUP"})
    i = _find(steps, "send", "add_bos")
    steps[i + 1:] = [{"hangup": True}]
    assert {n: str(t["derived_from"]) for n, t in out.items()} == DERIVED_FROM
    return out
