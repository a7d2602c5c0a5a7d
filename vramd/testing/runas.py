"""Run test children (the daemon, vramctl, workloads) as another user, with this interpreter and this vramd.

A child of another uid has to reach the interpreter, vramd's source and the packages vramd imports by path,
with that uid's rights.  Where it can (a system Python, a clone and a virtual environment others may read),
it runs `sys.executable` as it is (`PythonAccess.direct()`).  Where it cannot (a Python under /root, as pyenv
installs it; a clone in a private home directory), `PythonAccess.through_fds()` hands the child directory
fds instead, opened here with this process's rights: the interpreter's prefix, vramd's source and the
site-packages, reached as /proc/self/fd/N/... in the child.  The kernel checks the path *below* each fd
against the child's uid, never the directories above it, so nothing on the machine has to change (no
chmod of a home directory, no ACL, no mount) and the child still reads every file with its own rights.
Nothing it does with image files or /proc/<pid>/mem goes through those fds.

    access = PythonAccess.choose([user_a, user_b])     # direct if both can use sys.executable, else fds
    alice = RunAs.user("alice", access, cwd="/tmp/x")
    subprocess.run([*alice.python, "-m", "vramd.cli", "status"], **alice.popen_kwargs())
"""
from __future__ import annotations

import fcntl
import grp
import os
import pwd
import site
import stat
import subprocess
import sys
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SOURCE_ROOT = str(Path(__file__).resolve().parents[2])  # the directory holding the vramd package
# What a child needs to import: the daemon, vramctl, the workload child.
PROBE = "import vramd.service.main, vramd.cli.vramctl, vramd.testing.workload"


@dataclass
class PythonAccess:
    """How a child of another uid starts this interpreter with this vramd: argv, environment, fds to keep."""

    python: list[str]
    env: dict[str, str] = field(default_factory=dict)
    fds: tuple[int, ...] = ()
    how: str = "direct"

    @classmethod
    def direct(cls) -> PythonAccess:
        """`sys.executable` as it is: the child reads the interpreter, the venv and the source by their paths."""
        return cls([sys.executable])

    @classmethod
    def through_fds(cls) -> PythonAccess:
        """The base interpreter, its prefix, vramd's source and the site-packages, each through a directory
        fd this process opened (the child gets the same fd numbers: subprocess's pass_fds)."""
        fds: list[int] = []

        def expose(path: str) -> str:
            tmp = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            try:  # above the fds a child sets up itself (fd 3: a socket-activation listener)
                fd = fcntl.fcntl(tmp, fcntl.F_DUPFD_CLOEXEC, 10)
            finally:
                os.close(tmp)
            fds.append(fd)
            return f"/proc/self/fd/{fd}"

        base = os.path.realpath(sys.base_prefix)
        exe = os.path.relpath(os.path.realpath(getattr(sys, "_base_executable", sys.executable)), base)
        if exe.startswith(".."):
            raise RuntimeError(f"the interpreter {sys.executable} is not under its prefix {base}")
        home = expose(base)
        env = {"PYTHONHOME": home}
        if sysconfig.get_config_var("Py_ENABLE_SHARED"):  # libpython*.so, found through its RUNPATH otherwise
            libdir = os.path.relpath(os.path.realpath(str(sysconfig.get_config_var("LIBDIR"))), base)
            if not libdir.startswith(".."):
                env["LD_LIBRARY_PATH"] = f"{home}/{libdir}"
        # vramd's source first (an editable install's hook is a .pth file: site-packages on PYTHONPATH skip it)
        paths = [expose(SOURCE_ROOT)]
        for sp in site.getsitepackages():
            if os.path.isdir(sp) and os.path.realpath(sp) != SOURCE_ROOT:
                paths.append(expose(sp))
        env["PYTHONPATH"] = os.pathsep.join(paths)
        return cls([f"{home}/{exe}"], env, tuple(fds), "through inherited directory fds")

    @classmethod
    def choose(cls, users: list[str]) -> PythonAccess:
        """`direct()` if each of `users` can import vramd through it, else `through_fds()`; RuntimeError naming
        what each user could not reach if neither works."""
        problems = []
        for access in (cls.direct, cls.through_fds):
            a = access()
            failed = [(u, why) for u in users if (why := a.probe(u)) is not None]
            if not failed:
                return a
            a.close()
            problems += [f"{a.how}: {u}: {why}" for u, why in failed]
        raise RuntimeError("users " + ", ".join(users) + " cannot run this Python with vramd: "
                           + "; ".join(problems))

    def probe(self, user: str) -> str | None:
        """None if `user` can import what the tests run, else why not (the import error, and the first
        directory on the way to the interpreter or the source that this user may not search)."""
        ra = RunAs.user(user, self, cwd="/")
        try:
            r = subprocess.run([*self.python, "-c", PROBE], capture_output=True, text=True, timeout=60,
                               **ra.popen_kwargs())
        except OSError as e:  # exec itself failed
            why = f"cannot run {self.python[0]}: {e.strerror}"
        else:
            if r.returncode == 0:
                return None
            lines = (r.stderr or r.stdout).strip().splitlines()
            why = lines[-1] if lines else f"exit status {r.returncode}"
        for path in (sys.executable, os.path.realpath(sys.executable), SOURCE_ROOT, *site.getsitepackages()):
            if (blocked := unsearchable(path, ra.uid, ra.gids)) is not None:
                why += f" ({path}: {blocked})"
                break
        return why

    def close(self) -> None:
        for fd in self.fds:
            os.close(fd)
        self.fds = ()


def unsearchable(path: str, uid: int, gids: set[int]) -> str | None:
    """The first directory on the way to `path` that `uid` (with groups `gids`) may not search, described,
    by the mode bits (ACLs and LSMs aside); None if there is none."""
    if uid == 0:
        return None
    p = Path(os.path.abspath(path))
    for d in [*reversed(p.parents), p]:
        try:
            st = os.stat(d)
        except OSError:
            return None
        if not stat.S_ISDIR(st.st_mode):
            continue
        bit = stat.S_IXUSR if st.st_uid == uid else stat.S_IXGRP if st.st_gid in gids else stat.S_IXOTH
        if not st.st_mode & bit:
            owner = _name(pwd.getpwuid, st.st_uid)
            group = _name(grp.getgrgid, st.st_gid)
            return f"{d} is mode {stat.S_IMODE(st.st_mode):04o} {owner}:{group}, not searchable by uid {uid}"
    return None


def _name(lookup: Any, ident: int) -> str:
    try:
        return str(lookup(ident)[0])
    except KeyError:
        return str(ident)


@dataclass
class RunAs:
    """A user to run children as (its uid, primary group and supplementary groups, as a login would give
    them) with an interpreter it can use; `popen_kwargs()` for subprocess."""

    name: str
    uid: int
    gid: int
    groups: list[int]
    access: PythonAccess
    cwd: str = "/"

    @classmethod
    def user(cls, name: str, access: PythonAccess, *, group: str | None = None, cwd: str = "/") -> RunAs:
        """`name` with its groups; `group` (a name) replaces its primary group, as a unit's Group= does."""
        pw = pwd.getpwnam(name)
        gid = grp.getgrnam(group).gr_gid if group else pw.pw_gid
        return cls(name, pw.pw_uid, gid, sorted(set(os.getgrouplist(name, gid))), access, cwd)

    @property
    def python(self) -> list[str]:
        return self.access.python

    @property
    def gids(self) -> set[int]:
        return {self.gid, *self.groups}

    def environ(self) -> dict[str, str]:
        """A clean environment: nothing of this process's (its HOME, XDG_RUNTIME_DIR, VRAMD_SOCKET)."""
        home = "/" if self.uid else "/root"
        return {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": home, "USER": self.name, "LOGNAME": self.name,
                "LANG": "C.UTF-8", "PYTHONNOUSERSITE": "1", "PYTHONDONTWRITEBYTECODE": "1", **self.access.env}

    def popen_kwargs(self, pass_fds: tuple[int, ...] = ()) -> dict[str, Any]:
        """user, group, extra_groups (only when not this process's uid), env, cwd and pass_fds for Popen."""
        kw: dict[str, Any] = {"env": self.environ(), "cwd": self.cwd,
                              "pass_fds": tuple(sorted({*self.access.fds, *pass_fds}))}
        if (self.uid, self.gid) != (os.geteuid(), os.getegid()) or set(self.groups) != set(os.getgroups()):
            kw.update(user=self.uid, group=self.gid, extra_groups=self.groups)
        return kw
