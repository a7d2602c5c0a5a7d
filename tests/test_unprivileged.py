"""The daemon as its own unprivileged user, as the shipped unit runs it, serving root and a non-root member of
group vramd: each dumps, inspects, verifies and restores its own image with its own rights, and every
permission failure is one typed error naming the file or directory and the uid whose rights were missing.

Needs root: it creates (once; they stay, as a package's would) the system user and group `vramd`, as
contrib/systemd/vramd.sysusers declares them (a system user, no login shell, no home directory made), and
`vramd-e2e`, an ordinary user in supplementary group `vramd`.  The daemon runs as vramd:vramd on a socket
vramd:vramd 0660 in a directory of its own, with the shipped contrib/systemd/vramd.toml (allowed: uid 0, the
daemon's own uid, group vramd).  Every process of another uid runs this interpreter and this vramd: directly
where that uid can read them, else through directory fds (vramd/testing/runas.py: a Python under /root, a
clone in a private home directory).  Everything else lives in a directory under /tmp that is removed at the
end.  CI (.ci/run) runs the suite as root.
"""
from __future__ import annotations

import grp
import json
import os
import pwd
import re
import shutil
import stat
import subprocess
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from helpers import ROOT

from vramd.image.manifest import decode_manifest
from vramd.testing import DaemonProcess, PythonAccess, RunAs, Workload, blank_spec_like

DAEMON_USER = GROUP = "vramd"
TEST_USER = "vramd-e2e"
SPEC: list[dict[str, Any]] = [{"size": (1 << 20) + 5, "fill": "random", "seed": 11}, {"size": 64 << 10, "fill": "zero"},
        {"size": 4097, "fill": "pattern", "seed": 12, "skew": 13}]


def _tool(name: str) -> str | None:
    """A command from PATH, or from the sbin directories a non-login root shell may lack on PATH."""
    return shutil.which(name) or next((p for d in ("/usr/sbin", "/sbin") if os.access(p := f"{d}/{name}", os.X_OK)),
                                      None)


TOOLS = {name: _tool(name) for name in ("groupadd", "useradd", "usermod")}
MISSING = [name for name, path in TOOLS.items() if path is None]
pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root: it creates the users vramd and vramd-e2e and runs "
                       "the daemon and the clients as them (CI runs the suite as root)"),
    pytest.mark.skipif(bool(MISSING), reason=f"needs {', '.join(MISSING)} (the passwd package) to create the users"),
]


# --- the users ---------------------------------------------------------------------------------------------

def _shadow_tool(*argv: str) -> subprocess.CompletedProcess[str]:
    tool = TOOLS[argv[0]]
    assert tool is not None
    return subprocess.run([tool, *argv[1:]], capture_output=True, text=True, timeout=60)


def _nologin() -> str:
    return next((p for p in ("/usr/sbin/nologin", "/sbin/nologin") if os.path.exists(p)), "/bin/false")


def ensure_group(name: str) -> int:
    """The gid of group `name`, a system group made now if there is none."""
    try:
        return grp.getgrnam(name).gr_gid
    except KeyError:
        r = _shadow_tool("groupadd", "--system", name)
    try:  # (made now, or by someone else meanwhile)
        return grp.getgrnam(name).gr_gid
    except KeyError:
        raise RuntimeError(f"groupadd --system {name} failed: {r.stderr.strip()}") from None


def ensure_user(name: str, *args: str) -> pwd.struct_passwd:
    """User `name`, made now with `useradd ARGS name` if there is none; an existing one is left as it is."""
    try:
        return pwd.getpwnam(name)
    except KeyError:
        r = _shadow_tool("useradd", *args, name)
    try:
        return pwd.getpwnam(name)
    except KeyError:
        raise RuntimeError(f"useradd {' '.join(args)} {name} failed: {r.stderr.strip()}") from None


def ensure_users() -> None:
    """vramd:vramd as vramd.sysusers has it, and the test user, a member of group vramd."""
    ensure_group(GROUP)
    ensure_user(DAEMON_USER, "--system", "--gid", GROUP, "--no-create-home", "--home-dir", "/var/lib/vramd",
                "--shell", _nologin(), "--comment", "vramd VRAM checkpoint transfer daemon")
    ensure_user(TEST_USER, "--user-group", "--groups", GROUP, "--no-create-home", "--home-dir", "/nonexistent",
                "--shell", _nologin(), "--comment", "vramd end-to-end tests (tests/test_unprivileged.py)")
    if TEST_USER not in grp.getgrnam(GROUP).gr_mem and pwd.getpwnam(TEST_USER).pw_gid != grp.getgrnam(GROUP).gr_gid:
        r = _shadow_tool("usermod", "--append", "--groups", GROUP, TEST_USER)
        assert r.returncode == 0, f"usermod --append --groups {GROUP} {TEST_USER}: {r.stderr}"


# --- the daemon, the clients -------------------------------------------------------------------------------

@dataclass
class World:
    base: Path  # /tmp/vramd-e2e-*: 0755, root's; everything of this module lives under it
    daemon: DaemonProcess
    daemon_user: RunAs
    root: RunAs
    user: RunAs
    access: PythonAccess

    def who(self, name: str) -> RunAs:
        return self.root if name == "root" else self.user


@pytest.fixture(scope="module")
def world() -> Iterator[World]:
    ensure_users()
    try:
        access = PythonAccess.choose([DAEMON_USER, TEST_USER])
    except RuntimeError as e:
        pytest.fail(f"{e}: the daemon and the non-root client must be able to run vramd", pytrace=False)
    base = Path(tempfile.mkdtemp(prefix="vramd-e2e-", dir="/tmp"))
    try:
        os.chmod(base, 0o755)
        vramd_pw, vramd_gid = pwd.getpwnam(DAEMON_USER), grp.getgrnam(GROUP).gr_gid
        run = base / "run"  # the daemon's own directory (as RuntimeDirectory= would make it)
        run.mkdir(mode=0o750)
        os.chown(run, vramd_pw.pw_uid, vramd_gid)
        state = base / "state"  # its state directory (as vramd.tmpfiles makes /var/lib/vramd): the metrics
        state.mkdir(mode=0o755)
        os.chown(state, vramd_pw.pw_uid, vramd_gid)
        config = base / "vramd.toml"  # the shipped settings, where the daemon's user can read them
        shutil.copyfile(Path(ROOT) / "contrib" / "systemd" / "vramd.toml", config)
        os.chmod(config, 0o644)
        daemon_user = RunAs.user(DAEMON_USER, access, group=GROUP, cwd=str(run))
        with DaemonProcess(str(run), "--config", str(config), "--socket-mode", "0660", "--staging-budget", "64M",
                           "--chunk-size", "1M", "--grace-period", "2", "--metrics-textfile", str(state / "vramd.prom"),
                           run_as=daemon_user) as d:
            yield World(base, d, daemon_user, RunAs.user("root", access, cwd=str(base)),
                        RunAs.user(TEST_USER, access, cwd=str(base)), access)
            assert d.stop() == 0, "".join(d.log)
        st = (state / "vramd.prom").stat()  # written at exit, with the daemon's own rights
        assert (st.st_uid, st.st_gid) == (vramd_pw.pw_uid, vramd_gid)
    finally:
        shutil.rmtree(base, ignore_errors=True)
        access.close()


def vramctl(w: World, who: RunAs, *args: str) -> subprocess.CompletedProcess[str]:
    """vramctl as `who`, with the daemon's socket in $VRAMD_SOCKET (the commands that work offline ignore it)."""
    kw = who.popen_kwargs()
    kw["env"]["VRAMD_SOCKET"] = w.daemon.socket
    return subprocess.run([*who.python, "-m", "vramd.cli", *args], capture_output=True, text=True, timeout=120,
                          **kw)


def ok(r: subprocess.CompletedProcess[str]) -> dict[str, Any]:
    assert r.returncode == 0, f"{r.args[-8:]}: exit {r.returncode}: {r.stderr}{r.stdout}"
    out: dict[str, Any] = json.loads(r.stdout)
    return out


def ranges(regions: list[dict[str, Any]]) -> list[str]:
    return [a for r in regions for a in ("--range", f"{r['addr']:#x}:{r['size']}")]


def own_dir(path: Path, who: RunAs, mode: int = 0o700) -> Path:
    path.mkdir(mode=mode)
    os.chmod(path, mode)
    os.chown(path, who.uid, who.gid)
    return path


def dump_own_image(w: World, who: RunAs, img: Path) -> tuple[list[dict[str, Any]], list[str]]:
    """`who` dumps a workload of its own into `img`: (the workload's regions, their digests)."""
    with Workload(SPEC, run_as=who) as work:
        digests = work.digests()
        out = ok(vramctl(w, who, "dump", "--pid", str(work.pid), *ranges(work.regions), "--image", str(img),
                         "--json"))
    assert out["state"] == "done" and out["image"]["bo_count"] == len(SPEC)
    assert out["uid"] == who.uid
    return work.regions, digests


def snapshot(d: Path) -> dict[str, tuple[int, int, int, int]]:
    """What a directory holds, to the inode: nothing written, replaced or left behind shows as a difference."""
    st = d.stat()
    out = {".": (st.st_ino, st.st_mtime_ns, st.st_uid, stat.S_IMODE(st.st_mode))}
    for p in d.iterdir():
        s = p.lstat()
        out[p.name] = (s.st_ino, s.st_size, s.st_mtime_ns, s.st_uid)
    return out


def assert_denied(r: subprocess.CompletedProcess[str], who: RunAs, path: Path, *, write: bool = False) -> str:
    """One typed error: exit 1, one line on stderr, naming `path` and `who`'s uid; PERMISSION_DENIED where it
    may not read, NOT_WRITABLE where it may not create in a directory (docs/protocol.md)."""
    what = f"{r.args[-8:]} as uid {who.uid}: exit {r.returncode}, stderr {r.stderr!r}"
    codes = ("NOT_WRITABLE",) if write else ("PERMISSION_DENIED",)
    assert r.returncode == 1, what
    assert r.stderr.count("\n") == 1 and r.stderr.startswith(tuple(f"vramctl: {c}: " for c in codes)), what
    err = json.loads(r.stdout)["error"]
    assert err["code"] in codes, what
    msg = err["message"]
    assert str(path) in msg or (path.name in msg and str(path.parent) in msg), f"{what}: the message names no {path}"
    assert re.search(rf"\buid[ =]?{who.uid}\b", msg), f"{what}: the message names no uid {who.uid}"
    return str(msg)


def needs_ptrace_as_user() -> None:
    """A non-root vramctl opens /proc/<pid>/mem of its user's workload, which is not its child: Yama's
    ptrace_scope 1 allows it (the workload names any tracer, vramd.testing.workload), 2 and 3 do not."""
    try:
        scope = int(Path("/proc/sys/kernel/yama/ptrace_scope").read_text())
    except (OSError, ValueError):
        return
    if scope >= 2:
        pytest.skip(f"kernel.yama.ptrace_scope is {scope}: only root may open another process's memory")


def no_sessions_left(w: World) -> None:
    assert ok(vramctl(w, w.root, "sessions", "--all", "--json"))["sessions"] == []


# --- the tests ---------------------------------------------------------------------------------------------

def test_the_daemon_runs_as_its_own_unprivileged_user(world: World) -> None:
    vramd_uid, vramd_gid = pwd.getpwnam(DAEMON_USER).pw_uid, grp.getgrnam(GROUP).gr_gid
    status = Path(f"/proc/{world.daemon.pid}/status").read_text()
    fields = {k: v for k, _, v in (line.partition(":") for line in status.splitlines())}
    assert fields["Uid"].split() == [str(vramd_uid)] * 4, fields["Uid"]
    assert fields["Gid"].split() == [str(vramd_gid)] * 4, fields["Gid"]
    assert int(fields["CapEff"], 16) == 0 and int(fields["CapPrm"], 16) == 0
    st = os.stat(world.daemon.socket)
    assert stat.S_ISSOCK(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o660
    assert (st.st_uid, st.st_gid) == (vramd_uid, vramd_gid)
    # the non-root client may connect: group vramd, by the socket's mode and by the daemon's allowed_groups
    assert vramd_gid in world.user.groups and world.user.uid != 0
    assert ok(vramctl(world, world.user, "status", "--json"))["sessions"] == 0


@pytest.mark.parametrize("name", ["root", TEST_USER])
def test_each_user_dumps_inspects_verifies_and_restores_its_own_image(world: World, name: str) -> None:
    who = world.who(name)
    if who.uid:
        needs_ptrace_as_user()
    img = own_dir(world.base / f"{name}-own", who)  # the user's own directory, 0700
    regions, digests = dump_own_image(world, who, img)
    world.daemon.expect_log(rf"\(dump, uid {who.uid}, pid \d+\): SESSION_DONE")

    # the image is the user's: every file, with the user's rights, nobody else's
    files = sorted(p.name for p in img.iterdir())
    assert "manifest.vrdm" in files and any(n.startswith("data-") and n.endswith(".vrd") for n in files), files
    assert not [n for n in files if n.endswith(".tmp")], files
    for n in files:
        st = (img / n).lstat()
        assert stat.S_ISREG(st.st_mode), n
        assert (st.st_uid, st.st_gid) == (who.uid, who.gid), f"{n} is {st.st_uid}:{st.st_gid}, not {name}'s"
        assert stat.S_IMODE(st.st_mode) == 0o600, f"{n}: mode {stat.S_IMODE(st.st_mode):04o}"

    info = ok(vramctl(world, who, "inspect", str(img), "--json"))
    assert [b["size"] for b in info["bos"]] == [r["size"] for r in SPEC]
    assert [b["source"] for b in info["bos"]] == ["procmem"] * len(SPEC)
    v = ok(vramctl(world, who, "verify", str(img), "--json"))
    assert v["bos"] == len(SPEC) and v["bytes"] == sum(r["size"] for r in SPEC)

    with Workload(blank_spec_like(regions), run_as=who) as target:
        assert target.digests() != digests
        out = ok(vramctl(world, who, "restore", "--pid", str(target.pid), "--image", str(img), "--json"))
        assert out["state"] == "done" and out["uid"] == who.uid
        assert target.digests() == digests  # byte for byte
    world.daemon.expect_log(rf"\(restore, uid {who.uid}, pid \d+\): SESSION_DONE")
    no_sessions_left(world)


@pytest.fixture(scope="module")
def root_image(world: World) -> tuple[Path, list[dict[str, Any]]]:
    """Root's image in root's own 0700 directory, its files 0600 (as a dump makes them): (dir, regions)."""
    img = own_dir(world.base / "root-image", world.root)
    regions, _ = dump_own_image(world, world.root, img)
    for p in img.iterdir():
        assert stat.S_IMODE(p.stat().st_mode) == 0o600, p
    return img, regions


# what the user may reach of root's image -> the path each of restore, verify, inspect must name (None: allowed)
UNREADABLE = {
    "dir 0755, files 0600": ("manifest", "manifest", "manifest"),
    "dir 0755, manifest 0644, data 0600": ("data", "data", None),  # what the daemon would have read for it
    "dir 0700": ("dir", "dir", "dir"),
}


@pytest.mark.parametrize("case", list(UNREADABLE))
def test_a_user_cannot_restore_verify_or_inspect_an_image_it_cannot_read(world: World, root_image: tuple[Path, list[
        dict[str, Any]]], case: str) -> None:
    """Root's image: the user's restore, verify and inspect fail at the user's own open, naming what it could
    not open and its uid; nothing is written into the user's process, root's image is untouched."""
    user = world.user
    needs_ptrace_as_user()
    img, regions = root_image
    manifest = img / "manifest.vrdm"
    data = img / decode_manifest(manifest.read_bytes()).files[0].name  # the first file the user's client opens
    paths = {"manifest": manifest, "data": data, "dir": img}
    before = snapshot(img)
    try:
        os.chmod(img, 0o700 if case == "dir 0700" else 0o755)
        if "manifest 0644" in case:
            os.chmod(manifest, 0o644)
        with Workload(blank_spec_like(regions), run_as=user) as target:  # mapped where root's image would write
            blank = target.digests()
            commands = (["restore", "--pid", str(target.pid), "--image", str(img)], ["verify", str(img)],
                        ["inspect", str(img)])
            for argv, named in zip(commands, UNREADABLE[case], strict=True):
                r = vramctl(world, user, *argv, "--json")
                if named is None:
                    ok(r)
                else:
                    assert_denied(r, user, paths[named])
            assert target.digests() == blank
    finally:
        os.chmod(img, 0o700)
        os.chmod(manifest, 0o600)
    assert snapshot(img) == before
    ok(vramctl(world, world.root, "verify", str(img), "--json"))  # and root still reads it
    no_sessions_left(world)


@pytest.mark.parametrize("case", ["replacing root's image (--force)", "an empty directory"])
def test_a_user_cannot_dump_into_a_directory_it_cannot_write(world: World, case: str) -> None:
    """Root's 0755 directory, holding root's image or empty: the user's dump fails at its own create, naming
    the directory and its uid, and nothing is written in it."""
    root, user = world.root, world.user
    needs_ptrace_as_user()
    d = own_dir(world.base / f"root-0755-{len(case)}", root, 0o755)
    force = "--force" in case
    if force:
        dump_own_image(world, root, d)
    before = snapshot(d)
    with Workload(SPEC, run_as=user) as work:
        r = vramctl(world, user, "dump", "--pid", str(work.pid), *ranges(work.regions), "--image", str(d),
                    *(["--force"] if force else []), "--json")
    assert_denied(r, user, d, write=True)
    assert snapshot(d) == before
    if force:
        ok(vramctl(world, root, "verify", str(d), "--json"))
    no_sessions_left(world)
