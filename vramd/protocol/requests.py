"""Typed request builders: one function per request, each returning a `Call` (body, fds, fd roles).

They replace building `rpc.Request` by keyword: each names its arguments and
types, and gives every fd it attaches its transcript role (docs/protocol.md,
"Transcripts").  No I/O; the fds stay the caller's.
"""
from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from ..pb import rpc_pb2 as rpc
from .client import Call, ClientBo, ClientFile, RequestBody, bo_message, file_ref
from .frames import PROTOCOL_VERSIONS

# What the image format allows a daemon to ask for (vramd.image.format's MAX_STRIPES and vramd.image.names'
# DATA_FILE_NAME keep the same rules; a test checks they agree): data files per GPU, and the names of data files.
MAX_DATA_FILES_PER_GPU = 16
DATA_FILE_NAME = re.compile(r"data-[0-9a-f]{16}-[0-9a-f]{8}(-[1-9a-f])?\.vrd")
TOKEN = re.compile(r"[0-9a-f]{32}")


@dataclass(frozen=True)
class OpenSpec:
    """What OpenSession asks for, but its fds: the session's kind and options, and how many parent images
    (their manifests are attached, nearest first)."""

    kind: rpc.SessionKind
    compression: str = ""
    chunk_size: int = 0
    label: str = ""
    allow_partial: bool = False
    topology_checks: tuple[tuple[str, bool], ...] = ()
    parents: int = 0
    parent_hint: str = ""
    dedup: bool = True
    replace_parent: bool = False
    hold_s: int = 0  # restore: kept this long once no connection holds it (at most the daemon's max_hold)

    @property
    def dump(self) -> bool:
        return bool(self.kind == rpc.SESSION_DUMP)

    @property
    def manifest_images(self) -> tuple[int, ...]:
        """The images whose manifest OpenSession attaches: a restore's or verify's own (0), then the parents'."""
        return (*(() if self.dump else (0,)), *range(1, self.parents + 1))


def hello(client: str, versions: Sequence[int] = PROTOCOL_VERSIONS) -> Call:
    return Call(rpc.Hello(versions=versions, client=client))


def open_session(spec: OpenSpec, manifest_fds: Sequence[int], supply_fd: int | None = None) -> Call:
    """OpenSession with the manifests of `spec.manifest_images`, in that order; `supply_fd`: a streamed
    restore's or verify's supply pipe (its read end), after them."""
    images = spec.manifest_images
    if len(manifest_fds) != len(images):
        raise ValueError(f"{len(manifest_fds)} manifest fds for the images {images}")
    if supply_fd is not None and spec.dump:
        raise ValueError("a dump takes no supply pipe")
    first = 0 if spec.dump else 1
    body = rpc.OpenSession(kind=spec.kind, compression=spec.compression, chunk_size=spec.chunk_size,
                           label=spec.label, allow_partial=spec.allow_partial,
                           topology_checks=dict(spec.topology_checks), parent_hint=spec.parent_hint,
                           no_dedup=not spec.dedup, replace_parent=spec.replace_parent, manifest_fd_index=0,
                           hold_s=spec.hold_s,
                           parent_manifest_fd_indexes=range(first, first + spec.parents))
    roles = tuple(f"manifest:{k}" for k in images)
    if supply_fd is None:
        return Call(body, tuple(manifest_fds), roles)
    body.supply_fd_index = len(manifest_fds)
    return Call(body, (*manifest_fds, supply_fd), (*roles, "supply"))


def attach_files(token: str, files: Sequence[ClientFile]) -> Call:
    """One AttachFiles message with every file of `files` (each fd, then its O_DIRECT twin if any)."""
    refs: list[rpc.FileRef] = []
    fds: list[int] = []
    roles: list[str] = []
    for f in files:
        refs.append(file_ref(f, len(fds)))
        fds.append(f.fd)
        if f.direct_fd is not None:
            fds.append(f.direct_fd)
        roles.extend(f.roles())
    return Call(rpc.AttachFiles(token=token, files=refs), tuple(fds), tuple(roles))


def add_bos(token: str, bos: Sequence[ClientBo]) -> Call:
    """One AddBos message with every BO of `bos` (each fd attached once); `vramd.protocol.client.pack_bos`
    splits a long list under the limits."""
    index: dict[int, int] = {}
    roles: list[str] = []
    msg: list[rpc.Bo] = []
    for b in bos:
        if b.fd not in index:
            index[b.fd] = len(index)
            roles.append(f"bo:{b.id}")
        msg.append(bo_message(b, index[b.fd]))
    return Call(rpc.AddBos(token=token, bos=msg), tuple(index), tuple(roles))


def add_bos_message(token: str, bos: Sequence[rpc.Bo], fds: Sequence[int], roles: Sequence[str]) -> Call:
    """One AddBos message as `pack_bos` made it."""
    return Call(rpc.AddBos(token=token, bos=bos), tuple(fds), tuple(roles))


def start(token: str, manifest_fd: int | None = None) -> Call:
    """Start; a dump's names the manifest's temporary file the client created."""
    if manifest_fd is None:
        return Call(rpc.Start(token=token))
    return Call(rpc.Start(token=token, manifest_fd_index=0), (manifest_fd,), ("dump-manifest",))


def get_progress(token: str) -> Call:
    return Call(rpc.GetProgress(token=token))


def wait(token: str, timeout_ms: int | None = None) -> Call:
    """The barrier; `timeout_ms` None waits as long as it takes."""
    w = rpc.Wait(token=token)
    if timeout_ms is not None:
        w.timeout_ms = max(0, timeout_ms)
    return Call(w)


def cancel(*, token: str = "", session_id: int | None = None, reason: str = "") -> Call:
    """Cancel one session: by its token (as a holder) or by its session id (an operator: uid 0 or the
    daemon's uid).  Exactly one of the two."""
    if bool(token) == (session_id is not None):
        raise ValueError("cancel a session by its token or by its session id: exactly one of them")
    body = rpc.Cancel(token=token, reason=reason)
    if session_id is not None:
        body.session_id = session_id
    return Call(body)


def close_session(token: str) -> Call:
    return Call(rpc.CloseSession(token=token))


def get_status() -> Call:
    return Call(rpc.GetStatus())


def list_sessions() -> Call:
    """The caller's uid's sessions; every uid's for uid 0 and the daemon's own uid."""
    return Call(rpc.ListSessions())


def raw(body: RequestBody, fds: Sequence[int] = ()) -> Call:
    """Any request body as is (tests, tools): its fds' roles are "fd:<index>"."""
    return Call(body, tuple(fds), tuple(f"fd:{i}" for i in range(len(fds))))

