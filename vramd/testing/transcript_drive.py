"""The Python client acting out a transcript's "setup" (tests/transcripts/README.md), as libvramd's driver
(native/client/tests/t_transcript.c) acts it out in C: the same actions, the same BOs, the same outcomes.

    outcomes = drive(setup, socket_path, root)   # [(action, "ok" | an error code | "HANGUP"), ...]

The actions run in order up to the first whose outcome is not the one it expects ("ok", or the typed
error's code, "HANGUP" for a daemon that hung up); the connection is closed after the last.  The image
directories of the setup are made under `root` (`make_dirs`); a BO is a memfd named after its id
(transcript.bo_memfd_name) of its "memfd_size" bytes, filled with its "seed"'s bytes (`bo_bytes`) where one
is given ("fd_of": it shares that BO's memfd).
"""
from __future__ import annotations

import os
import random
from collections.abc import Mapping
from pathlib import Path

from ..client import SESSION_DUMP, SESSION_RESTORE, SESSION_VERIFY, Client, ClientBo
from ..errors import VramdError
from .transcript import JsonValue, bo_memfd_name

KINDS = {"dump": SESSION_DUMP, "restore": SESSION_RESTORE, "verify": SESSION_VERIFY}
Spec = Mapping[str, JsonValue]


def _spec_list(setup: Spec, key: str) -> list[Spec]:
    items = setup.get(key, [])
    assert isinstance(items, list)
    return [x for x in items if isinstance(x, dict)]


def _int(spec: Spec, key: str, default: int = 0) -> int:
    v = spec.get(key, default)
    assert isinstance(v, int), f"{key}: {v!r}"
    return v


def _str(spec: Spec, key: str, default: str = "") -> str:
    v = spec.get(key, default)
    assert isinstance(v, str), f"{key}: {v!r}"
    return v


def bo_bytes(seed: int, size: int) -> bytes:
    """A BO's contents: half zeros (chunks a dump stores as zero), half its seed's pseudo-random bytes."""
    half = size // 2
    return bytes(half) + random.Random(seed).randbytes(size - half)


def make_bos(setup: Spec) -> dict[int, int]:
    """Each BO's memfd: id -> fd (the caller closes them; a BO with "fd_of" shares that BO's)."""
    out: dict[int, int] = {}
    try:
        for b in _spec_list(setup, "bos"):
            bo_id = _int(b, "id")
            if "fd_of" in b:
                continue
            fd = out[bo_id] = os.memfd_create(bo_memfd_name(bo_id), os.MFD_CLOEXEC)
            size = _int(b, "memfd_size")
            if "seed" in b:
                os.pwrite(fd, bo_bytes(_int(b, "seed"), size), 0)
            else:
                os.ftruncate(fd, size)
    except BaseException:
        for fd in out.values():
            os.close(fd)
        raise
    return out


def bo_fd(b: Spec, fds: Mapping[int, int]) -> int:
    return fds[_int(b, "fd_of") if "fd_of" in b else _int(b, "id")]


def make_dirs(setup: Spec, root: Path) -> None:
    """The setup's image directories under `root`, with the files it lists (empty: a replay's fake daemon
    never reads them)."""
    dirs = setup.get("dirs", {})
    assert isinstance(dirs, dict)
    for name, files in dirs.items():
        (root / name).mkdir(exist_ok=True)
        for f in files:
            (root / name / f).touch()


def client_bos(setup: Spec, fds: Mapping[int, int], *, restore_criu: bool = False,
               backend: str = "") -> list[ClientBo]:
    out = []
    for b in _spec_list(setup, "bos"):
        bo_id = _int(b, "id")
        if restore_criu:  # vramd_criu_restore_submit: id, fd, offset and the config's backend only
            out.append(ClientBo(bo_id, bo_fd(b, fds), offset=_int(b, "offset"), backend=backend))
            continue
        out.append(ClientBo(bo_id, bo_fd(b, fds), offset=_int(b, "offset"), size=_int(b, "size"),
                            backend=_str(b, "backend"),
                            gpu_id=_int(b, "gpu_id") if "gpu_id" in b else None, name=_str(b, "name"),
                            alloc_flags=_int(b, "alloc_flags"), va_addr=_int(b, "va_addr")))
    return out


class _Driver:
    def __init__(self, setup: Spec, path: str, root: Path) -> None:
        self.setup, self.path, self.root = setup, path, root
        self.client: Client | None = None
        self.token = ""
        self.bos = make_bos(setup)
        self.dir_fds: dict[str, int] = {}

    def dir_fd(self, name: str) -> int:
        if name not in self.dir_fds:
            self.dir_fds[name] = os.open(self.root / name, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        return self.dir_fds[name]

    def close(self) -> None:
        if self.client is not None:
            self.client.close()
            self.client = None
        for fd in [*self.bos.values(), *self.dir_fds.values()]:
            os.close(fd)
        self.bos, self.dir_fds = {}, {}

    def conn(self) -> Client:
        if self.client is None:
            self.client = Client(self.path, timeout=30)
        return self.client

    def act(self, a: Spec) -> None:
        do = _str(a, "do")
        if do == "connect":
            self.conn()
        elif do == "disconnect":
            assert self.client is not None
            self.client.close()
            self.client = None
        elif do == "open":
            parents = a.get("parents", [])
            assert isinstance(parents, list)
            supply = os.pipe2(os.O_CLOEXEC) if a.get("supply") else None  # ends at once: both closed after
            try:
                info = self.conn().open_session(
                    KINDS[_str(a, "kind")], self.dir_fd(_str(a, "dir")), compression=_str(a, "compression"),
                    chunk_size=_int(a, "chunk_size"), label=_str(a, "label"),
                    allow_partial=bool(a.get("allow_partial")), parent_fds=[self.dir_fd(str(p)) for p in parents],
                    parent_hint=_str(a, "parent_hint"), dedup=not a.get("no_dedup"),
                    replace_parent=bool(a.get("replace_parent")), supply_fd=supply[0] if supply else None)
            finally:
                for fd in supply or ():
                    os.close(fd)
            self.token = info.token
        elif do == "add_bos":
            self.conn().add_bos(self.token, client_bos(self.setup, self.bos))
        elif do == "start":
            self.conn().start(self.token)
        elif do == "progress":
            self.conn().progress(self.token)
        elif do == "wait":
            self.conn().wait(self.token, _int(a, "timeout_ms") / 1000 if "timeout_ms" in a else None)
        elif do == "cancel":
            self.conn().cancel(self.token, _str(a, "reason"))
        elif do == "close_session":
            self.conn().close_session(self.token)
        elif do == "criu_restore_submit":
            self.criu_restore_submit(a)
        elif do == "criu_restore_barrier":
            self.criu_restore_barrier()
        else:
            raise ValueError(f"unknown action {do!r}")

    def criu_restore_submit(self, a: Spec) -> None:
        """vramd_criu_restore_submit's sequence: connect, open (asking for a hold), add, start, hang up (the
        session lives on)."""
        parents = a.get("parents", [])
        assert isinstance(parents, list)
        with Client(self.path, timeout=30) as c:
            info = c.open_session(SESSION_RESTORE, self.dir_fd(_str(a, "dir")), label=_str(a, "label"),
                                  allow_partial=bool(a.get("allow_partial")),
                                  parent_fds=[self.dir_fd(str(p)) for p in parents],
                                  hold_s=0xFFFFFFFF)  # libvramd's default: as long as the daemon's max_hold allows
            self.token = info.token
            c.add_bos(info.token, client_bos(self.setup, self.bos, restore_criu=True, backend=_str(a, "backend")))
            c.start(info.token)

    def criu_restore_barrier(self) -> None:
        """vramd_criu_restore_barrier's sequence: connect, attach (any call with the token), wait, close."""
        with Client(self.path, timeout=30) as c:
            c.progress(self.token)
            c.wait(self.token)
            c.close_session(self.token)


def outcome(e: BaseException) -> str:
    if isinstance(e, VramdError):
        return e.code
    if isinstance(e, ConnectionError):
        return "HANGUP"
    raise e


def expected(action: Spec, client: str) -> str:
    """An action's expected outcome for `client` ("python", "c"): its "expect", "ok" without one; a dict
    gives each client's where they differ."""
    want = action.get("expect", "ok")
    if isinstance(want, dict):
        want = want[client]
    assert isinstance(want, str)
    return want


def drive(setup: Spec, path: str, root: Path) -> list[list[str]]:
    """Act out `setup`'s actions with the Python client against the daemon at `path`: each action's
    [name, outcome], up to the first whose outcome is not the one it expects."""
    d = _Driver(setup, path, root)
    out: list[list[str]] = []
    try:
        for a in _spec_list(setup, "actions"):
            try:
                d.act(a)
                result = "ok"
            except (VramdError, ConnectionError) as e:
                result = outcome(e)
            out.append([_str(a, "do"), result])
            if result != expected(a, "python"):
                break
    finally:
        d.close()
    return out
