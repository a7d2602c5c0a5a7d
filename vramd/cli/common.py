"""What every vramctl command uses: exit codes, the one-line failure, argument types, output, connect."""
from __future__ import annotations

import argparse
import grp
import json
import os
import re
import stat
from typing import Any

from ..client import HUNG_UP_AT_HELLO, Client
from ..paths import SYSTEM_SOCKET, client_socket_path, peer_creds
from ..pb import image_pb2 as pb
from ..pb import rpc_pb2 as rpc
from ..protocol.wire import code_name, enum_name
from ..units import parse_size

EXIT_OK, EXIT_FAILURE, EXIT_USAGE, EXIT_PIPE = 0, 1, 2, 128 + 13  # 141: as if killed by SIGPIPE
SOURCE_NAMES = {pb.SOURCE_PROCMEM: "procmem", pb.SOURCE_MMAP: "mmap", pb.SOURCE_SDMA: "sdma"}


class Failure(Exception):
    """A one-line reason to exit 1 with."""


# --- argument types ----------------------------------------------------------

def parse_range(text: str) -> tuple[int, int]:
    addr, sep, length = text.partition(":")
    if not sep:
        raise argparse.ArgumentTypeError(f"{text!r}: expected ADDR:LEN")
    try:
        return parse_size(addr), parse_size(length)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"{text!r}: {e}") from None


def parse_bo_target(text: str) -> tuple[int, str]:
    """ID=PATH: where `vramctl restore` writes the file BO with that id."""
    bo_id, sep, path = text.partition("=")
    if not sep or not path or not bo_id.strip().isdigit():
        raise argparse.ArgumentTypeError(f"{text!r}: expected ID=PATH (the BO's id in the image, then a file)")
    return int(bo_id), path


def parse_bo_file(text: str) -> tuple[str, int, int | None]:
    """PATH or PATH:OFF:LEN (a path may itself contain colons)."""
    parts = text.rsplit(":", 2)
    if len(parts) == 3:
        try:
            return parts[0], parse_size(parts[1]), parse_size(parts[2])
        except ValueError:
            pass
    return text, 0, None


_TOKEN = re.compile(r"[0-9a-f]{32}")


def parse_session_ref(text: str) -> tuple[str, int | None]:
    """TOKEN (32 hex characters) or a session ID (a number): (token, None) or ("", id)."""
    text = text.strip()
    if _TOKEN.fullmatch(text.lower()):
        return text.lower(), None
    if text.isdigit():
        return "", int(text)
    raise argparse.ArgumentTypeError(f"{text!r}: expected a session token (32 hex characters) or a session id")


# --- output ------------------------------------------------------------------

def session_dict(info: rpc.SessionInfo) -> dict[str, Any]:
    p = info.progress
    d: dict[str, Any] = {
        # a kind or state this vramctl does not know (a newer daemon's) is shown by its number, never a crash
        "session_id": info.session_id,
        "kind": enum_name(rpc.SessionKind, info.kind, "SESSION_KIND_").removeprefix("SESSION_").lower(),
        "state": enum_name(rpc.SessionState, info.state, "SESSION_STATE_").removeprefix("SESSION_").lower(),
        "uid": info.uid,
        "pid": info.pid, "label": info.label, "holders": info.holders, "target_pids": list(info.target_pids),
        "hold_s": info.hold_s,  # a restore kept this long once nobody holds it (0: the grace period)
        "rate_bytes_per_s": round(info.rate_bytes_per_s, 3), "age_s": round(info.age_s, 6),
        "progress": {"bos_total": p.bos_total, "bos_done": p.bos_done, "bytes_total": p.bytes_total,
                     "bytes_done": p.bytes_done, "chunks_done": p.chunks_done, "elapsed_s": round(p.elapsed_s, 6)},
    }
    if info.HasField("image"):
        i = info.image
        d["image"] = {"bo_count": i.bo_count, "bo_bytes": i.bo_bytes, "stored_bytes": i.stored_bytes,
                      "zero_bytes": i.zero_bytes, "chunk_size": i.chunk_size, "compression": i.compression,
                      "data_files": i.data_files}
    if info.error.code != rpc.OK:
        d["error"] = {"code": code_name(info.error.code), "message": info.error.message,
                      "bo_id": info.error.bo_id if info.error.HasField("bo_id") else None,
                      "offset": info.error.offset if info.error.HasField("offset") else None}
    return d


def emit(ns: argparse.Namespace, data: dict[str, Any], text: str) -> None:
    print(json.dumps(data, indent=2, sort_keys=True) if ns.json else text)


def gbps(bytes_per_s: float) -> str:
    """A rate as vramctl prints every rate: GB/s, decimal (1 GB = 10^9 bytes), like the daemon's log."""
    return f"{bytes_per_s / 1e9:.2f} GB/s"


def rate(nbytes: int, seconds: float) -> str:
    return gbps(nbytes / seconds) if seconds > 0 else "-"


def connect(ns: argparse.Namespace, name: str = "vramctl") -> Client:
    """The daemon at --socket (else the search order), authenticated with --daemon-user (vramd.paths).  A
    connection refused is a Failure of one line that says why and what to do (`no_connection`)."""
    try:
        return Client(ns.socket, name=name, daemon_user=ns.daemon_user)
    except ConnectionError as e:
        raise Failure(no_connection(str(e), ns.socket)) from None


def no_connection(message: str, explicit: str | None) -> str:
    """The client's "cannot connect to vramd at PATH: why", and what to do about it: where nobody listens, the
    sockets looked for and how to start the daemon; where the socket's mode keeps the caller out, its group.
    `explicit`: the --socket the user gave (then a missing socket is only named, as before)."""
    if not message.startswith("cannot connect to vramd at "):
        return message
    if HUNG_UP_AT_HELLO in message:  # something listens there, and let the connection go unanswered
        return (f"{message}: did its service fail to start? (systemctl status vramd.service; journalctl -u "
                "vramd.service)")
    path = explicit or client_socket_path()
    try:
        st = os.stat(path)
    except FileNotFoundError:
        if explicit:
            return message
        env = os.environ.get("VRAMD_SOCKET")
        if env:
            return f"{message} (from $VRAMD_SOCKET): is vramd running there?"
        also = "" if path == SYSTEM_SOCKET else f"; no system socket at {SYSTEM_SOCKET} either"
        return f"{message}{also}: is vramd running? (systemctl start vramd.socket)"
    except OSError:
        return message
    if not stat.S_ISSOCK(st.st_mode):
        kind = "a directory" if stat.S_ISDIR(st.st_mode) else "a regular file" if stat.S_ISREG(st.st_mode) else \
            "not a socket"
        return (f"{message}: {path} is {kind}, not a socket: give the path the daemon listens on (its log says "
                "\"listening on PATH\")")
    if not os.access(path, os.W_OK):
        try:
            group = grp.getgrgid(st.st_gid).gr_name
        except KeyError:
            group = str(st.st_gid)
        return (f"{message} (the socket is mode {st.st_mode & 0o777:04o}, group {group}): only members of group "
                f"{group} may connect; ask an administrator to add you (usermod -aG {group} USER), then log in "
                "again")
    return f"{message}: is vramd running? (a socket nobody listens on: systemctl start vramd.socket, or restart " \
        "the daemon that made it)"


def daemon_uid(c: Client) -> int:
    """The uid of the daemon at the other end (SO_PEERCRED)."""
    return peer_creds(c.sock)[1]
