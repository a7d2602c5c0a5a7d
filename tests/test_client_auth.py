"""Clients authenticate the daemon before they send anything (docs/protocol.md, "Socket paths"): the Python client,
vramctl and libvramd (its CRIU adapter included) refuse a socket whose directories or whose listener belong to
another uid than root, their own or the daemon user's, with one error naming the path and that uid; and they look
for the socket in the documented order: the system socket first, /tmp only for a uid other than root.

The impostor is a real process of another uid (`nobody`): it squats where a client looks, or listens on a socket
in a directory the client trusts, and relays whatever arrives to a real daemon (so that a client that trusts it
goes on as with the daemon, as in the attack), counting the connections, packets and fds it gets.  Every client
runs as a real user (`vramd-e2e`, made as tests/test_unprivileged.py makes it, or root) in a mount namespace of
its own where /run and /tmp are directories this module made: the system socket and /tmp/vramd-<uid> are the real
paths the clients compute, and nothing of the machine's /run or /tmp is touched.

Needs root (users, setuid children, mount namespaces); CI (.ci/run) runs the suite as root.
"""
from __future__ import annotations

import errno
import json
import os
import pwd
import shutil
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from helpers import ROOT
from test_unprivileged import MISSING, TEST_USER, ensure_users

from vramd.testing import DaemonProcess, PythonAccess, RunAs, Workload

SQUATTER_USER = "nobody"
LIBVRAMD = Path(ROOT) / "build" / "libvramd" / "libvramd.so"


def _namespaces_work() -> str | None:
    tools = [t for t in ("unshare", "mount", "setpriv") if shutil.which(t) is None]
    if tools:
        return f"needs {', '.join(tools)} (util-linux)"
    if os.geteuid() != 0:
        return "needs root"
    r = subprocess.run(["unshare", "--mount", "--propagation", "private", "true"], capture_output=True, text=True)
    return None if r.returncode == 0 else f"cannot make a mount namespace: {r.stderr.strip()}"


WHY_NOT = _namespaces_work()
pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root: it runs clients and the squatter as other users"),
    pytest.mark.skipif(bool(MISSING), reason=f"needs {', '.join(MISSING)} (the passwd package) to create users"),
    pytest.mark.skipif(WHY_NOT is not None, reason=f"{WHY_NOT}: the clients run in a mount namespace of their own"),
]

# The impostor.  argv: WHERE UPSTREAM [MODE]; WHERE is a socket path to bind (its directory made, MODE octal) or
# fd:N, a socket bound by someone else (it only listens).  Prints "ready", relays until its stdin closes, then
# takes what is still pending and prints what it got as one JSON line.
SQUATTER = r'''
import array, json, os, select, socket, sys
where, upstream = sys.argv[1], sys.argv[2]
if where.startswith("fd:"):
    lst = socket.socket(fileno=int(where[3:]))
else:
    os.makedirs(os.path.dirname(where), exist_ok=True)
    os.chmod(os.path.dirname(where), int(sys.argv[3], 8))
    lst = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    lst.bind(where)
    os.chmod(where, 0o777)
lst.listen(64)
got = {"uid": os.getuid(), "connections": 0, "packets": 0, "fds": 0, "fd_targets": []}
peer, upstreams = {}, set()
print("ready", flush=True)


def relay(src):
    data, anc, _flags, _ = src.recvmsg(1 << 24, socket.CMSG_SPACE(253 * 4))
    fds = array.array("i")
    for level, kind, raw in anc:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(raw[: len(raw) - len(raw) % fds.itemsize])
    try:
        if not data and not fds:
            return False
        if src not in upstreams:  # what a client sent
            got["packets"] += 1
            got["fds"] += len(fds)
            for fd in fds:
                try:
                    got["fd_targets"].append(os.readlink(f"/proc/self/fd/{fd}"))
                except OSError:
                    pass
        peer[src].sendmsg([data], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, fds)] if fds else [])
        return True
    finally:
        for fd in fds:
            os.close(fd)


def step(timeout):
    ready, _, _ = select.select([lst, sys.stdin, *peer], [], [], timeout)
    for r in ready:
        if r is lst:
            c, _ = lst.accept()
            got["connections"] += 1
            up = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            up.connect(upstream)
            peer[c], peer[up] = up, c
            upstreams.add(up)
        elif r in peer:
            try:
                alive = relay(r)
            except OSError:
                alive = False
            if not alive:
                other = peer.pop(r)
                peer.pop(other, None)
                r.close()
                other.close()
    return [r for r in ready if r is not sys.stdin]


while True:
    ready, _, _ = select.select([sys.stdin], [], [], 0)
    if ready and not sys.stdin.readline():
        break
    step(None)
while step(0):  # what is still pending: connections in the backlog, packets in the queues
    pass
print(json.dumps(got), flush=True)
'''

# The clients.  argv: what to do, then its arguments; prints one JSON line: the outcome.
PY_CLIENT = r'''
import json, os, sys
from vramd.client import Client, ClientBo, SESSION_DUMP
from vramd.errors import VramdError
try:
    fd = os.memfd_create("bo")
    os.write(fd, os.urandom(1 << 16))
    dfd = os.open(sys.argv[1], os.O_RDONLY | os.O_DIRECTORY)
    with Client(name="auth-test", timeout=60) as c:
        s = c.open_session(SESSION_DUMP, dfd)
        c.add_bos(s.token, [ClientBo(1, fd, offset=0, size=1 << 16)])
        c.start(s.token)
        c.wait(s.token)
    out = {"ok": True, "path": c.path}
except (VramdError, OSError) as e:
    out = {"ok": False, "type": type(e).__name__, "code": getattr(e, "code", None), "message": str(e)}
print(json.dumps(out))
'''

C_CLIENT = r'''
import ctypes, json, os, sys
from ctypes import POINTER, c_bool, c_char, c_char_p, c_int, c_size_t, c_uint32, c_uint64, c_void_p, byref

class Error(ctypes.Structure):
    _fields_ = [("errnum", c_int), ("code", c_int), ("has_bo_id", c_bool), ("has_offset", c_bool),
                ("bo_id", c_uint64), ("offset", c_uint64), ("message", c_char * 256)]

class CriuConfig(ctypes.Structure):  # vramd/criu.h (ABI 1.0: struct_size first, the enums, then what was appended)
    _fields_ = [("struct_size", c_uint32), ("socket_path", c_char_p), ("sock_fd", c_int), ("min_fd", c_int),
                ("timeout_ms", c_int), ("wait_timeout_ms", c_int), ("client_name", c_char_p),
                ("backend", c_char_p), ("compression", c_char_p), ("chunk_size", c_uint64), ("label", c_char_p),
                ("allow_partial", c_bool), ("parent_dir_fds", c_void_p), ("n_parent_dir_fds", c_size_t),
                ("parent_hint", c_char_p), ("backend_kind", c_int), ("compression_kind", c_int),
                ("compression_level", c_int), ("hold_s", c_uint64), ("supply_fd", c_int)]

class CriuBo(ctypes.Structure):  # struct_size 0 here: the ABI 1.0 layout
    _fields_ = [("struct_size", c_uint32), ("id", c_uint64), ("fd", c_int), ("offset", c_uint64),
                ("size", c_uint64), ("gpu_id", c_uint32), ("alloc_flags", c_uint64), ("va_addr", c_uint64)]

lib = ctypes.CDLL(sys.argv[1])
err = Error()
if sys.argv[2] == "criu-dump":  # the CRIU adapter, connecting where vramd_socket_path() says
    cfg = CriuConfig()
    lib.vramd_criu_config_init(byref(cfg))
    assert cfg.struct_size == ctypes.sizeof(CriuConfig), (cfg.struct_size, ctypes.sizeof(CriuConfig))
    cfg.timeout_ms = 60000
    fd = os.memfd_create("bo")
    os.write(fd, os.urandom(1 << 16))
    bo = CriuBo(id=1, fd=fd, size=1 << 16)
    dfd = os.open(sys.argv[3], os.O_RDONLY | os.O_DIRECTORY)
    r = lib.vramd_criu_dump(byref(cfg), dfd, byref(bo), c_size_t(1), None, byref(err))
else:  # connect: vramd_connect_path(argv[3]), or vramd_connect() without it
    conn = c_void_p()
    if len(sys.argv) > 3:
        r = lib.vramd_connect_path(byref(conn), sys.argv[3].encode(), None, byref(err))
    else:
        r = lib.vramd_connect(byref(conn), None, byref(err))
    if r == 0:
        lib.vramd_close(conn)
buf = ctypes.create_string_buffer(4096)
lib.vramd_socket_path(buf, c_size_t(4096))
print(json.dumps({"rc": r, "code": err.code, "message": err.message.decode(), "socket_path": buf.value.decode()}))
'''


@dataclass
class World:
    base: Path                 # /var/tmp/vramd-auth-*: root's, 0755
    upstream: DaemonProcess    # the real daemon the squatters relay to (it allows uid nobody)
    user: RunAs                # vramd-e2e
    root: RunAs
    squatter: RunAs            # nobody
    lib: Path                  # a copy of libvramd every user may load


@pytest.fixture(scope="module")
def world() -> Iterator[World]:
    ensure_users()
    if not LIBVRAMD.exists():
        subprocess.run(["meson", "compile", "-C", str(LIBVRAMD.parent)], check=True, capture_output=True)
    access = PythonAccess.choose([TEST_USER, SQUATTER_USER])
    base = Path(tempfile.mkdtemp(prefix="vramd-auth-", dir="/var/tmp"))
    try:
        os.chmod(base, 0o755)
        lib = base / "libvramd.so"
        shutil.copyfile(LIBVRAMD, lib)
        os.chmod(lib, 0o755)
        up = base / "upstream"
        up.mkdir(mode=0o755)
        nobody = pwd.getpwnam(SQUATTER_USER).pw_uid
        with DaemonProcess(str(up), "--allow-uid", str(nobody), "--socket-mode", "0666") as d:
            yield World(base, d, RunAs.user(TEST_USER, access, cwd="/"), RunAs.user("root", access, cwd="/"),
                        RunAs.user(SQUATTER_USER, access, cwd="/"), lib)
            assert d.stop() == 0, "".join(d.log)
    finally:
        shutil.rmtree(base, ignore_errors=True)
        access.close()


class Squatter:
    """The impostor, running as `nobody`: binds `where` (making its directory with `mode`) or listens on the
    bound socket `listener`, and relays to the real daemon."""

    def __init__(self, w: World, where: str | None = None, mode: int = 0o777,
                 listener: socket.socket | None = None) -> None:
        fds = (listener.fileno(),) if listener is not None else ()
        arg = f"fd:{listener.fileno()}" if listener is not None else str(where)
        self.proc = subprocess.Popen([*w.squatter.python, "-c", SQUATTER, arg, w.upstream.socket, f"{mode:o}"],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                     **w.squatter.popen_kwargs(fds))
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        assert line == "ready\n", f"the squatter did not start: {line!r} (exit {self.proc.wait()})"

    def finish(self) -> dict[str, Any]:
        """What it got, all of it: the clients have exited, so everything they sent is queued by now."""
        out, _ = self.proc.communicate("", timeout=60)
        assert self.proc.returncode == 0, out
        got: dict[str, Any] = json.loads(out)
        return got

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def root_listener(w: World, address: str, mode: int | None = None) -> Squatter:
    """A socket root binds at `address` (chmod `mode`, if given), listened on by the squatter user: a listener
    handed to another service; the Squatter records what reaches it."""
    lst = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    lst.bind(address)
    if mode is not None:
        os.chmod(address, mode)
    try:
        return Squatter(w, listener=lst)
    finally:
        lst.close()


def foreign_listener(w: World, name: str) -> tuple[str, Squatter]:
    """A socket in a root-owned 0755 directory, bound by root, listened on by the squatter user."""
    d = w.base / f"{name}-sock"
    d.mkdir(mode=0o755)
    path = str(d / "vramd.sock")
    return path, root_listener(w, path, 0o666)


def views(w: World, name: str) -> tuple[Path, Path]:
    """A /run and a /tmp for one test's clients: root's, 0755 and 1777 as on a real system, both empty."""
    run, tmp = w.base / f"{name}-run", w.base / f"{name}-tmp"
    run.mkdir(mode=0o755)
    tmp.mkdir()
    os.chmod(tmp, 0o1777)
    return run, tmp


def in_namespace(w: World, who: RunAs, run: Path, tmp: Path, argv: list[str],
                 env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """`argv` as `who`, with `run` as /run and `tmp` as /tmp (a mount namespace of its own: mounting needs root,
    setpriv then becomes `who`), in a clean environment (no XDG_RUNTIME_DIR, no VRAMD_SOCKET unless `env`)."""
    kw = who.popen_kwargs()
    for k in ("user", "group", "extra_groups"):
        kw.pop(k, None)
    kw["env"].update(env or {})
    groups = ["--groups", ",".join(map(str, who.groups))] if who.groups else ["--clear-groups"]
    cmd = ["unshare", "--mount", "--propagation", "private", "--", "sh", "-ec",
           'mount --bind "$1" /run; mount --bind "$2" /tmp; shift 2; exec "$@"', "sh", str(run), str(tmp),
           "setpriv", f"--reuid={who.uid}", f"--regid={who.gid}", *groups, "--", *argv]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, **kw)


def outcome(r: subprocess.CompletedProcess[str]) -> dict[str, Any]:
    assert r.returncode == 0 and r.stdout.strip(), f"exit {r.returncode}: {r.stdout}{r.stderr}"
    out: dict[str, Any] = json.loads(r.stdout.strip().splitlines()[-1])
    return out


def own_dir(path: Path, who: RunAs) -> Path:
    path.mkdir(mode=0o700)
    os.chown(path, who.uid, who.gid)
    return path


def assert_nothing_received(got: dict[str, Any], *, connected: bool) -> None:
    assert got["packets"] == 0 and got["fds"] == 0 and got["fd_targets"] == [], f"the impostor got {got}"
    assert got["connections"] == (1 if connected else 0), f"the impostor got {got}"


# --- a squatted /tmp/vramd-<uid> --------------------------------------------------------------------------

@pytest.mark.parametrize("mode", [0o777, 0o755])
def test_every_client_refuses_a_squatted_tmp_dir_and_sends_nothing(world: World, mode: int) -> None:
    """Finding 1: `nobody` makes /tmp/vramd-<uid> (0777, as in the report, or its own 0755) and listens there;
    vramd-e2e's Python client, `vramctl dump` of a process's memory and libvramd's CRIU dump each refuse before
    connecting, naming the directory and uid 65534, and the squatter gets no connection at all."""
    w, user = world, world.user
    run, tmp = views(w, f"squat{mode:o}")
    sq_dir = f"{tmp}/vramd-{user.uid}"
    sock = f"/tmp/vramd-{user.uid}/vramd.sock"  # as the clients see it
    squatter = Squatter(w, f"{sq_dir}/vramd.sock", mode)
    try:
        py_img, ctl_img, c_img = (own_dir(tmp / f"img-{n}", user) for n in ("py", "ctl", "c"))
        py = outcome(in_namespace(w, user, run, tmp, [*user.python, "-c", PY_CLIENT, f"/tmp/{py_img.name}"]))
        with Workload([{"size": 1 << 16, "fill": "random", "seed": 3}], run_as=user) as work:
            region = work.regions[0]
            ctl = in_namespace(w, user, run, tmp, [*user.python, "-m", "vramd.cli", "dump", "--pid", str(work.pid),
                                                   "--range", f"{region['addr']:#x}:{region['size']}",
                                                   "--image", f"/tmp/{ctl_img.name}", "--json"])
        c = outcome(in_namespace(w, user, run, tmp, [*user.python, "-c", C_CLIENT, str(w.lib), "criu-dump",
                                                     f"/tmp/{c_img.name}"]))
    finally:
        got = squatter.finish()
    uid = w.squatter.uid
    owner = f"/tmp/vramd-{user.uid}"
    # first of all: nothing reached the squatter, not even a connection
    assert_nothing_received(got, connected=False)
    # the Python client: one typed error, PERMISSION_DENIED, naming the path, the directory and its owner
    assert not py["ok"] and py["type"] == "UntrustedDaemonError" and py["code"] == "PERMISSION_DENIED", py
    assert sock in py["message"] and owner in py["message"] and f"uid {uid}" in py["message"], py
    # vramctl: exit 1, one line, the same error
    assert ctl.returncode == 1 and ctl.stderr.count("\n") == 1, ctl.stderr
    assert ctl.stderr.startswith("vramctl: PERMISSION_DENIED: ") and sock in ctl.stderr, ctl.stderr
    err = json.loads(ctl.stdout)["error"]
    assert err["code"] == "PERMISSION_DENIED" and f"uid {uid}" in err["message"] and owner in err["message"], err
    # libvramd's CRIU adapter: -EPERM, a local error naming the path and the uid
    assert c["rc"] == -errno.EPERM and c["socket_path"] == sock, c
    assert sock in c["message"] and owner in c["message"] and f"uid {uid}" in c["message"], c
    # and the clients created nothing in their image directories
    for img in (py_img, ctl_img, c_img):
        assert sorted(os.listdir(img)) == [], img


# --- a foreign listener behind directories the client trusts ------------------------------------------------

def test_a_foreign_listener_in_a_trusted_directory_is_refused_by_its_uid(world: World) -> None:
    """The socket's directory is root's and 0755, the socket root bound, but the process listening on it is
    `nobody`: root's Python client, `vramctl status` and libvramd's vramd_connect_path connect, read the
    listener's uid (SO_PEERCRED), and refuse before Hello, naming the path and uid 65534."""
    w = world
    run, tmp = views(w, "foreign")
    path, squatter = foreign_listener(w, "foreign")
    env = {"VRAMD_SOCKET": path}
    try:
        py = in_namespace(w, w.root, run, tmp, [*w.root.python, "-c",
                          "from vramd.client import Client\ntry:\n Client()\nexcept Exception as e:\n"
                          " print(type(e).__name__, '|', e)"], env)
        ctl = in_namespace(w, w.root, run, tmp, [*w.root.python, "-m", "vramd.cli", "status", "--json"], env)
        c = outcome(in_namespace(w, w.root, run, tmp, [*w.root.python, "-c", C_CLIENT, str(w.lib), "connect",
                                                       path], env))
        c_env = outcome(in_namespace(w, w.root, run, tmp, [*w.root.python, "-c", C_CLIENT, str(w.lib), "connect"],
                                     env))
    finally:
        got = squatter.finish()
    uid = w.squatter.uid
    assert py.stdout.startswith("UntrustedDaemonError | ") and path in py.stdout and f"uid {uid}" in py.stdout, py
    assert ctl.returncode == 1 and ctl.stderr.startswith("vramctl: PERMISSION_DENIED: "), ctl.stderr
    assert path in ctl.stderr and f"uid {uid}" in ctl.stderr, ctl.stderr
    for out in (c, c_env):
        assert out["rc"] == -errno.EPERM and path in out["message"] and f"uid {uid}" in out["message"], out
    # four connections (the listener's uid is only known once connected), not one packet
    assert got["packets"] == 0 and got["fds"] == 0 and got["connections"] == 4, got


def test_the_configured_daemon_user_is_trusted(world: World) -> None:
    """The same foreign listener, named as the daemon user (by name on vramctl's command line, by uid in
    $VRAMD_DAEMON_USER for libvramd): then it is the daemon, and the clients talk to it (the relay answers)."""
    w = world
    run, tmp = views(w, "daemonuser")
    path, squatter = foreign_listener(w, "daemonuser")
    uid = w.squatter.uid
    try:
        ctl = in_namespace(w, w.root, run, tmp, [*w.root.python, "-m", "vramd.cli", "status", "--json",
                                                 "--socket", path, "--daemon-user", SQUATTER_USER])
        c = outcome(in_namespace(w, w.root, run, tmp, [*w.root.python, "-c", C_CLIENT, str(w.lib), "connect",
                                                       path], {"VRAMD_DAEMON_USER": str(uid)}))
    finally:
        got = squatter.finish()
    assert ctl.returncode == 0, ctl.stderr
    assert json.loads(ctl.stdout)["sessions"] == 0
    assert c["rc"] == 0, c
    assert got["connections"] == 2 and got["packets"] >= 2, got


def test_symbolic_links_on_the_way_are_walked_and_their_owners_checked(world: World) -> None:
    """A link is followed only if a trusted uid owns it, and its target is checked like the rest of the path:
    root's link to the real daemon works; the same link owned by `nobody`, and root's link into a directory of
    `nobody`'s (where `nobody` listens), are refused naming the link or the directory and uid 65534."""
    w = world
    run, tmp = views(w, "links")
    links = w.base / "links"
    links.mkdir(mode=0o755)
    foreign = w.base / "links-foreign"
    foreign.mkdir(mode=0o755)
    os.chown(foreign, w.squatter.uid, w.squatter.gid)
    squatter = Squatter(w, f"{foreign}/vramd.sock", 0o755)
    good, bad_owner, into = links / "good", links / "bad-owner", links / "into-foreign"
    os.symlink(os.path.relpath(w.upstream.socket, links), good)  # a relative link, resolved from its directory
    os.symlink(w.upstream.socket, bad_owner)
    os.lchown(bad_owner, w.squatter.uid, w.squatter.gid)
    os.symlink(f"{foreign}/vramd.sock", into)
    out = {}
    try:
        for link in (good, bad_owner, into):
            out[link.name] = (
                in_namespace(w, w.root, run, tmp, [*w.root.python, "-m", "vramd.cli", "status", "--json",
                                                   "--socket", str(link)]),
                outcome(in_namespace(w, w.root, run, tmp, [*w.root.python, "-c", C_CLIENT, str(w.lib), "connect",
                                                           str(link)])))
    finally:
        got = squatter.finish()
    uid = w.squatter.uid
    ctl, c = out["good"]
    assert ctl.returncode == 0 and json.loads(ctl.stdout)["sessions"] == 0, ctl.stderr
    assert c["rc"] == 0, c
    for name, culprit in (("bad-owner", str(bad_owner)), ("into-foreign", str(foreign))):
        ctl, c = out[name]
        assert ctl.returncode == 1 and ctl.stderr.startswith("vramctl: PERMISSION_DENIED: "), ctl.stderr
        assert culprit in ctl.stderr and f"uid {uid}" in ctl.stderr, ctl.stderr
        assert c["rc"] == -errno.EPERM and culprit in c["message"] and f"uid {uid}" in c["message"], c
    assert_nothing_received(got, connected=False)


def test_a_socket_directly_in_a_sticky_directory_is_refused(world: World) -> None:
    """/tmp may be on the way, but not the socket's own directory: anyone may create names in it.  A socket
    /tmp/vramd.sock (root bound it) is refused by both clients on its path alone, naming /tmp: they do not even
    connect, so the listener's uid is never asked."""
    w = world
    run, tmp = views(w, "sticky")
    recorder = root_listener(w, str(tmp / "vramd.sock"))
    env = {"VRAMD_SOCKET": "/tmp/vramd.sock"}
    try:
        ctl = in_namespace(w, w.root, run, tmp, [*w.root.python, "-m", "vramd.cli", "status", "--json"], env)
        c = outcome(in_namespace(w, w.root, run, tmp, [*w.root.python, "-c", C_CLIENT, str(w.lib), "connect"], env))
    finally:
        got = recorder.finish()
    assert ctl.returncode == 1 and ctl.stderr.startswith("vramctl: PERMISSION_DENIED: "), ctl.stderr
    assert "owns /tmp (mode 1777; the socket's own directory" in ctl.stderr, ctl.stderr
    assert c["rc"] == -errno.EPERM and "owns /tmp (mode 1777; the socket's own directory" in c["message"], c
    assert_nothing_received(got, connected=False)


# --- the search order -----------------------------------------------------------------------------------------

def test_the_system_socket_is_preferred_over_tmp(world: World) -> None:
    """/run/vramd/vramd.sock exists (a real daemon, root's, in a root-owned 0755 directory as vramd.tmpfiles
    makes it) and so does a squatted /tmp/vramd-<uid>: every client of vramd-e2e goes to the system socket, and
    the squatter gets nothing."""
    w, user = world, world.user
    run, tmp = views(w, "prefer")
    sysdir = run / "vramd"
    sysdir.mkdir(mode=0o755)
    with DaemonProcess(str(sysdir), "--allow-uid", str(user.uid), "--socket-mode", "0666") as system:
        squatter = Squatter(w, f"{tmp}/vramd-{user.uid}/vramd.sock", 0o777)
        try:
            ctl = in_namespace(w, user, run, tmp, [*user.python, "-m", "vramd.cli", "status", "--json"])
            c = outcome(in_namespace(w, user, run, tmp, [*user.python, "-c", C_CLIENT, str(w.lib), "connect"]))
        finally:
            got = squatter.finish()
        assert system.stop() == 0
    assert ctl.returncode == 0, ctl.stderr
    assert json.loads(ctl.stdout)["sessions"] == 0
    assert c["rc"] == 0 and c["socket_path"] == "/run/vramd/vramd.sock", c
    assert_nothing_received(got, connected=False)


def test_an_untrusted_system_socket_is_refused_not_passed_over(world: World) -> None:
    """/run/vramd is `nobody`'s: the clients refuse it, naming it and uid 65534, and do not fall back to the
    user's own daemon in /tmp/vramd-<uid> (real and trusted here); once /run/vramd is gone, they use that one."""
    w, user = world, world.user
    run, tmp = views(w, "untrusted-system")
    sysdir = run / "vramd"
    sysdir.mkdir()
    os.chown(sysdir, w.squatter.uid, w.squatter.gid)
    squatter = Squatter(w, f"{sysdir}/vramd.sock", 0o755)
    mine = own_dir(tmp / f"vramd-{user.uid}", user)
    with DaemonProcess(str(mine), run_as=user) as own:
        try:
            ctl = in_namespace(w, user, run, tmp, [*user.python, "-m", "vramd.cli", "status", "--json"])
            c = outcome(in_namespace(w, user, run, tmp, [*user.python, "-c", C_CLIENT, str(w.lib), "connect"]))
        finally:
            got = squatter.finish()
        shutil.rmtree(sysdir)
        ctl_own = in_namespace(w, user, run, tmp, [*user.python, "-m", "vramd.cli", "status", "--json"])
        c_own = outcome(in_namespace(w, user, run, tmp, [*user.python, "-c", C_CLIENT, str(w.lib), "connect"]))
        assert own.stop() == 0
    uid = w.squatter.uid
    assert ctl.returncode == 1 and ctl.stderr.startswith("vramctl: PERMISSION_DENIED: "), ctl.stderr
    assert "/run/vramd/vramd.sock" in ctl.stderr and f"uid {uid}" in ctl.stderr, ctl.stderr
    assert c["rc"] == -errno.EPERM and "/run/vramd" in c["message"] and f"uid {uid}" in c["message"], c
    assert_nothing_received(got, connected=False)
    # the user's own daemon, 0700 in the sticky /tmp, is trusted
    assert ctl_own.returncode == 0 and json.loads(ctl_own.stdout)["sessions"] == 0, ctl_own.stderr
    assert c_own["rc"] == 0 and c_own["socket_path"] == f"/tmp/vramd-{user.uid}/vramd.sock", c_own


def test_root_never_uses_tmp(world: World) -> None:
    """Root without XDG_RUNTIME_DIR and without a system socket: a root-owned /tmp/vramd-0 with a listener in it
    is never tried (anyone may have made /tmp/vramd-0 before root); the clients fail on the system socket's
    path."""
    w = world
    run, tmp = views(w, "root-tmp")
    d = own_dir(tmp / "vramd-0", w.root)
    path = str(d / "vramd.sock")
    recorder = root_listener(w, path)  # root bound it; what matters here is whether anyone connects
    try:
        ctl = in_namespace(w, w.root, run, tmp, [*w.root.python, "-m", "vramd.cli", "status", "--json"])
        c = outcome(in_namespace(w, w.root, run, tmp, [*w.root.python, "-c", C_CLIENT, str(w.lib), "connect"]))
    finally:
        got = recorder.finish()
    assert ctl.returncode == 1 and "cannot connect to vramd at /run/vramd/vramd.sock" in ctl.stderr, ctl.stderr
    assert c["rc"] == -errno.ENOENT and c["socket_path"] == "/run/vramd/vramd.sock", c
    assert_nothing_received(got, connected=False)


def test_a_root_daemon_started_by_hand_listens_where_roots_clients_look(world: World) -> None:
    """Root without XDG_RUNTIME_DIR: `vramd` with no --socket makes /run/vramd (root's, 0755) and listens on
    /run/vramd/vramd.sock, not in /tmp, and root's clients (vramctl, libvramd) find it there by default."""
    w = world
    run, tmp = views(w, "root-daemon")
    kw = {k: v for k, v in w.root.popen_kwargs().items() if k not in ("user", "group", "extra_groups")}
    daemon = subprocess.Popen(["unshare", "--mount", "--propagation", "private", "--", "sh", "-ec",
                               'mount --bind "$1" /run; mount --bind "$2" /tmp; shift 2; exec "$@"', "sh", str(run),
                               str(tmp), *w.root.python, "-m", "vramd.service.main", "--log-level", "info"],
                              stderr=subprocess.PIPE, text=True, **kw)
    try:
        assert daemon.stderr is not None
        said = ""
        for said in daemon.stderr:  # it logs where it listens once it does
            if "listening on" in said:
                break
        assert said.rstrip().endswith("listening on /run/vramd/vramd.sock"), said
        st = os.stat(run / "vramd")
        assert (st.st_uid, st.st_mode & 0o7777) == (0, 0o755)
        assert os.listdir(tmp) == []
        ctl = in_namespace(w, w.root, run, tmp, [*w.root.python, "-m", "vramd.cli", "status", "--json"])
        c = outcome(in_namespace(w, w.root, run, tmp, [*w.root.python, "-c", C_CLIENT, str(w.lib), "connect"]))
    finally:
        daemon.terminate()
        daemon.communicate(timeout=60)
    assert daemon.returncode == 0
    assert ctl.returncode == 0 and json.loads(ctl.stdout)["sessions"] == 0, ctl.stderr
    assert c["rc"] == 0 and c["socket_path"] == "/run/vramd/vramd.sock", c


def test_an_abstract_socket_is_refused_with_a_typed_error(world: World) -> None:
    """An abstract socket ("\0name") has no path to walk and any uid may bind any name: root's Python client
    refuses it with UntrustedDaemonError naming it (@name), without connecting, although the listener's
    socket was made by root (`nobody` only listens on it, as a listener handed to another service)."""
    w = world
    run, tmp = views(w, "abstract")
    name = f"vramd-auth-{os.getpid()}-{os.urandom(4).hex()}"
    recorder = root_listener(w, "\0" + name)
    code = ("import sys\nfrom vramd.client import Client\ntry:\n Client(sys.argv[1].replace('@', chr(0), 1))\n"
            " print('connected')\nexcept Exception as e:\n print(type(e).__name__, '|', e)")
    try:
        py = in_namespace(w, w.root, run, tmp, [*w.root.python, "-c", code, "@" + name])
    finally:
        got = recorder.finish()
    assert py.stdout.startswith("UntrustedDaemonError | ") and f"@{name}" in py.stdout, py
    assert "abstract" in py.stdout, py
    assert_nothing_received(got, connected=False)


def test_a_path_object_is_still_accepted(daemon: DaemonProcess) -> None:
    """Client(pathlib.Path(...)) connected before clients authenticated the daemon (socket.connect takes any
    path-like): the walk takes it too."""
    from vramd.client import Client
    with Client(Path(daemon.socket)) as c:
        assert c.status().connections == 1


# An NSS module: it leaves a mark when loaded and when asked for a user.  MARK is replaced by a path.
NSS_MODULE = r"""
#include <fcntl.h>
#include <nss.h>
#include <pwd.h>
#include <unistd.h>
static void mark(void)
{
    int fd = open("MARK", O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
    if (fd >= 0) {
        (void)write(fd, "loaded\n", 7);
        close(fd);
    }
}
__attribute__((constructor)) static void on_load(void) { mark(); }
enum nss_status _nss_vramdtest_getpwnam_r(const char *name, struct passwd *pw, char *buf, size_t len, int *e)
{
    (void)name; (void)pw; (void)buf; (void)len; (void)e;
    mark();
    return NSS_STATUS_NOTFOUND;
}
"""


def test_libvramd_loads_no_nss_module_to_find_the_daemon_user(world: World) -> None:
    """libvramd may run where /etc is another root's: in the task CRIU restores, already in a container's mount
    namespace and still with CRIU's privileges (docs/criu-integration.md, way 2).  A path component of a foreign
    uid makes it look up the daemon user; that must not load the NSS modules that root's /etc/nsswitch.conf
    names (their code would run as root).  Here a mount namespace's /etc/nsswitch.conf names a module that
    leaves a mark: root's vramd_connect_path to `nobody`'s directory is refused, naming it, and the module was
    never loaded, while the daemon user `vramd` is still found, in /etc/passwd itself."""
    w = world
    nss = w.base / "nss"
    nss.mkdir(mode=0o755)
    mark = nss / "mark"
    src = nss / "nss.c"
    src.write_text(NSS_MODULE.replace("MARK", str(mark)))
    subprocess.run(["cc", "-shared", "-fPIC", "-o", str(nss / "libnss_vramdtest.so.2"), str(src)], check=True,
                   capture_output=True)
    conf = nss / "nsswitch.conf"
    conf.write_text("passwd: vramdtest files\ngroup: files\nshadow: files\n")
    foreign = w.base / "nss-foreign"
    foreign.mkdir(mode=0o755)
    os.chown(foreign, w.squatter.uid, w.squatter.gid)
    path = str(foreign / "vramd.sock")
    kw = {k: v for k, v in w.root.popen_kwargs().items() if k not in ("user", "group", "extra_groups")}
    kw["env"]["LD_LIBRARY_PATH"] = str(nss)
    r = subprocess.run(["unshare", "--mount", "--propagation", "private", "--", "sh", "-ec",
                        'mount --bind "$1" /etc/nsswitch.conf; shift; exec "$@"', "sh", str(conf),
                        *w.root.python, "-c", C_CLIENT, str(w.lib), "connect", path],
                       capture_output=True, text=True, timeout=120, **kw)
    c = outcome(r)
    assert c["rc"] == -errno.EPERM and str(foreign) in c["message"] and f"uid {w.squatter.uid}" in c["message"], c
    assert not mark.exists(), f"libvramd loaded the namespace's NSS module: {mark.read_text()!r}"
    assert "daemon user vramd=" in c["message"], c  # looked up, by /etc/passwd: vramd exists (ensure_users)
    assert f"daemon user vramd={pwd.getpwnam('vramd').pw_uid}" in c["message"], c


def test_a_daemon_user_of_non_ascii_digits_is_a_name(world: World) -> None:
    """`--daemon-user ²` (str.isdigit() is true for it, int() refuses it) is a user name that does not exist, as
    libvramd reads it: vramctl refuses `nobody`'s directory with its one-line error, not a traceback."""
    w = world
    foreign = w.base / "digits-foreign"
    foreign.mkdir(mode=0o755)
    os.chown(foreign, w.squatter.uid, w.squatter.gid)
    path = str(foreign / "vramd.sock")
    ctl = subprocess.run([*w.root.python, "-m", "vramd.cli", "status", "--socket", path, "--daemon-user", "²"],
                         capture_output=True, text=True, timeout=120, **w.root.popen_kwargs())
    assert ctl.returncode == 1 and ctl.stderr.startswith("vramctl: PERMISSION_DENIED: "), ctl.stderr
    assert str(foreign) in ctl.stderr and "daemon user ² (no such user)" in ctl.stderr, ctl.stderr


# --- setuid and file-capability programs -------------------------------------------------------------------

# A program linking libvramd (loaded with dlopen: a setuid program ignores LD_LIBRARY_PATH).  argv: LIB PATH;
# prints its euid, vramd_socket_path(), vramd_connect_path(PATH)'s return value, then the error's message.
SETUID_CLIENT = r"""
#include <dlfcn.h>
#include <stdio.h>
#include <unistd.h>
#include <vramd/client.h>
int main(int argc, char **argv)
{
    void *lib = dlopen(argv[1], RTLD_NOW);
    if (!lib || argc != 3)
        return 2;
    int (*socket_path)(char *, size_t) = (int (*)(char *, size_t))dlsym(lib, "vramd_socket_path");
    int (*connect_path)(struct vramd_conn **, const char *, const struct vramd_options *, struct vramd_error *) =
        (int (*)(struct vramd_conn **, const char *, const struct vramd_options *, struct vramd_error *))
            dlsym(lib, "vramd_connect_path");
    void (*close_conn)(struct vramd_conn *) = (void (*)(struct vramd_conn *))dlsym(lib, "vramd_close");
    char where[4096] = "";
    struct vramd_error err = {0};
    struct vramd_conn *conn = NULL;
    socket_path(where, sizeof where);
    int r = connect_path(&conn, argv[2], NULL, &err);
    if (r == 0)
        close_conn(conn);
    printf("%u\n%s\n%d\n%s\n", (unsigned)geteuid(), where, r, err.message);
    return 0;
}
"""


def test_a_setuid_program_ignores_the_callers_environment(world: World) -> None:
    """A setuid-root program linking libvramd, run by vramd-e2e, who sets VRAMD_DAEMON_USER to `nobody`'s uid
    and VRAMD_SOCKET / XDG_RUNTIME_DIR to paths of their choice: libvramd reads none of them there (glibc's
    secure_getenv), so the caller cannot widen root's trust to `nobody`, who listens on a socket in a root-owned
    0755 directory (as a listener handed to a less privileged service would), nor pick root's socket.  The
    same program run by root itself, not setuid, honours the environment (the control: the relay answers)."""
    w, user = world, world.user
    run, tmp = views(w, "setuid")
    prog = w.base / "setuid-client"
    src = w.base / "setuid-client.c"
    src.write_text(SETUID_CLIENT)
    subprocess.run(["cc", "-O0", "-o", str(prog), str(src), f"-I{ROOT}/native/client/include", "-ldl"], check=True,
                   capture_output=True)
    os.chmod(prog, 0o4755)  # root's (the test runs as root), setuid
    path, squatter = foreign_listener(w, "setuid")
    uid = w.squatter.uid
    env = {"VRAMD_DAEMON_USER": str(uid), "VRAMD_SOCKET": path, "XDG_RUNTIME_DIR": "/tmp"}
    try:
        setuid = in_namespace(w, user, run, tmp, [str(prog), str(w.lib), path], env)
        plain = in_namespace(w, w.root, run, tmp, [str(prog), str(w.lib), path], env)
    finally:
        got = squatter.finish()
    for r in (setuid, plain):
        assert r.returncode == 0 and r.stdout.count("\n") == 4, f"exit {r.returncode}: {r.stdout}{r.stderr}"
    euid, where, rc, message = setuid.stdout.split("\n")[:4]
    assert euid == "0", setuid.stdout  # it did run setuid root
    assert where == "/run/vramd/vramd.sock", setuid.stdout  # neither $VRAMD_SOCKET nor $XDG_RUNTIME_DIR
    assert int(rc) == -errno.EPERM and path in message and f"uid {uid}" in message, setuid.stdout
    euid, where, rc, message = plain.stdout.split("\n")[:4]
    assert (euid, where, int(rc)) == ("0", path, 0), plain.stdout
    # two connections (the listener's uid is only known once connected); packets only from the plain run's Hello
    assert got["connections"] == 2 and got["packets"] >= 1 and got["fds"] == 0, got


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v"]))
