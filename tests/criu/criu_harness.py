"""Plumbing for running vramd's test plugin inside a real CRIU (tests and bench).

Needs root, a built CRIU ($CRIU_BIN) and its source tree ($CRIU_SRC, for
criu-plugin.h).  The vramd part of the plugin also needs libvramd:
$VRAMD_CLIENT_INC (holds vramd/client.h) and $VRAMD_CLIENT_LIBDIR (holds
libvramd.so).  Nothing here builds CRIU.
"""
from __future__ import annotations

import hashlib
import os
import re
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass

HERE = os.path.dirname(os.path.abspath(__file__))
PLUGIN_HOOK_LINE = re.compile(
    r"^(?P<mono>\d+\.\d+) (?P<real>\d+\.\d+) pid=(?P<pid>\d+) ppid=(?P<ppid>\d+) role=(?P<role>\S+) "
    r"stage=(?P<stage>\S+) (?P<what>.*)$")


REPO = os.path.dirname(os.path.dirname(HERE))


def _in_repo(env_var: str, path: str, marker: str) -> str | None:
    """$env_var (made absolute: make runs in tests/criu), else this repository's own libvramd
    (built by ./dev.sh) if it is there; set to the empty string, "without libvramd"."""
    if env_var in os.environ:
        given = os.environ[env_var]
        return os.path.abspath(given) if given else None
    full = os.path.join(REPO, path)
    return full if os.path.exists(os.path.join(full, marker)) else None


@dataclass
class Env:
    criu_src: str | None = os.environ.get("CRIU_SRC")
    criu_bin: str | None = os.environ.get("CRIU_BIN")
    vramd_inc: str | None = _in_repo("VRAMD_CLIENT_INC", "native/client/include", "vramd/client.h")
    vramd_libdir: str | None = _in_repo("VRAMD_CLIENT_LIBDIR", "build/libvramd", "libvramd.so")

    def missing(self) -> str | None:
        """Why the CRIU tests cannot run here, or None."""
        if not self.criu_src or not self.criu_bin:
            return "set CRIU_SRC (a CRIU checkout) and CRIU_BIN (its built criu) to run the CRIU plugin tests"
        if not os.path.isfile(os.path.join(self.criu_src, "criu", "include", "criu-plugin.h")):
            return f"CRIU_SRC={self.criu_src} has no criu/include/criu-plugin.h"
        if not os.access(self.criu_bin, os.X_OK):
            return f"CRIU_BIN={self.criu_bin} is not executable"
        if os.geteuid() != 0:
            return "CRIU dump/restore needs root"
        return None

    def has_libvramd(self) -> bool:
        return bool(self.vramd_inc and self.vramd_libdir)


def build(env: Env, out: str, with_vramd: bool) -> tuple[str, str]:
    """Build the plugin (into out/plugins, the --libdir) and the workload; returns (libdir, workload)."""
    args = ["make", "-s", "-C", HERE, f"CRIU_SRC={env.criu_src}", f"O={out}"]
    # on make's command line: a VRAMD_CLIENT_* in the environment would otherwise leak into the log-only build
    inc, libdir = (env.vramd_inc, env.vramd_libdir) if with_vramd else ("", "")
    args += [f"VRAMD_CLIENT_INC={inc}", f"VRAMD_CLIENT_LIBDIR={libdir}"]
    r = subprocess.run(args, capture_output=True, text=True)
    if r.returncode:  # the compiler's own words, not just "make returned 2"
        raise RuntimeError(f"{' '.join(args)} failed ({r.returncode}):\n{r.stdout}{r.stderr}")
    return os.path.join(out, "plugins"), os.path.join(out, "workload")


class Workload:
    """The process CRIU dumps: `mib` MiB of patterned private memory, checked on SIGUSR1."""

    def __init__(self, binary: str, mib: int, work: str, device: str | None = None):
        self.ready = os.path.join(work, "ready")
        self.result = os.path.join(work, "result")
        for p in (self.ready, self.result):
            if os.path.exists(p):
                os.unlink(p)
        self.proc = subprocess.Popen([binary, str(mib), self.ready, self.result, *([device] if device else [])],
                                     stdin=subprocess.DEVNULL,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        self.pid = self.proc.pid
        deadline = time.monotonic() + 120
        while not (os.path.exists(self.ready) and os.path.getsize(self.ready)):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"workload did not start (status {self.proc.returncode})")
            time.sleep(0.05)

    def reap(self) -> None:
        """After the dump killed it: collect the zombie so the pid is free for the restore."""
        self.proc.wait(30)

    def check(self, timeout: float = 60.0) -> str:
        """Ask the (restored) process to check its memory; returns 'ok <pid>' or 'bad ...'."""
        if os.path.exists(self.result):
            os.unlink(self.result)
        os.kill(self.pid, signal.SIGUSR1)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if os.path.exists(self.result) and os.path.getsize(self.result):
                with open(self.result) as f:
                    return f.read().strip()
            time.sleep(0.02)
        raise TimeoutError("the restored workload did not answer SIGUSR1")

    def kill_restored(self, timeout: float = 30.0) -> None:
        """Kill the restored process (not our child: init reaps it) and wait until its pid is gone."""
        try:
            os.kill(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + timeout
        while os.path.exists(f"/proc/{self.pid}") and time.monotonic() < deadline:
            time.sleep(0.01)


def criu(env: Env, *args: str, extra_env: dict | None = None, timeout: float = 300) -> float:
    """Run criu; returns its wall time.  Raises with the tail of its log on failure."""
    t0 = time.monotonic()
    p = subprocess.Popen([env.criu_bin, *args], env=dict(os.environ, **(extra_env or {})), stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        stacks = backtraces(p.pid)
        p.kill()
        p.communicate()
        raise TimeoutError(f"criu {' '.join(args)} hung for {timeout} s; its threads:\n{stacks}") from None
    wall = time.monotonic() - t0
    r = subprocess.CompletedProcess(p.args, p.returncode, out, err)
    if r.returncode:
        log = ""
        if "-D" in args and "-o" in args:
            path = os.path.join(args[args.index("-D") + 1], args[args.index("-o") + 1])
            if os.path.exists(path):
                with open(path) as f:
                    log = "".join(f.readlines()[-30:])
        raise RuntimeError(f"criu {' '.join(args)} failed ({r.returncode}): {r.stderr}\n{log}")
    return wall


def backtraces(pid: int) -> str:
    """Every thread's kernel wait channel and, if gdb is there, user stack: for a hung criu."""
    out = []
    for tid in sorted(os.listdir(f"/proc/{pid}/task")):
        try:
            with open(f"/proc/{pid}/task/{tid}/wchan") as f:
                out.append(f"tid {tid} wchan {f.read()}")
        except OSError:
            pass
    if shutil.which("gdb"):
        r = subprocess.run(["gdb", "-p", str(pid), "-batch", "-ex", "thread apply all bt"], capture_output=True,
                           text=True, timeout=120)
        out.append("\n".join(ln for ln in r.stdout.splitlines() if ln.startswith(("#", "Thread"))))
    return "\n".join(out)


@dataclass
class HookEvent:
    mono: float  # CLOCK_MONOTONIC: restored tasks live in a time namespace of their own, compare within a process
    real: float  # CLOCK_REALTIME (to the microsecond): comparable across processes
    pid: int
    ppid: int
    role: str
    stage: str
    what: str


def read_log(path: str) -> list[HookEvent]:
    events = []
    with open(path) as f:
        for line in f:
            m = PLUGIN_HOOK_LINE.match(line.rstrip("\n"))
            if not m:
                raise AssertionError(f"unparsable plugin log line: {line!r}")
            events.append(HookEvent(float(m["mono"]), float(m["real"]), int(m["pid"]), int(m["ppid"]), m["role"],
                                    m["stage"], m["what"]))
    return events


def hooks(events: list[HookEvent]) -> list[str]:
    """The hook names (and init/exit) in the order they fired."""
    out = []
    for e in events:
        if e.what.startswith("hook="):
            out.append(e.what.split()[0][5:])
        elif e.what.startswith(("init", "exit")):
            out.append(e.what.split()[0])
    return out


@dataclass
class VramdImage:
    path: str
    bos: list[tuple[int, int]]  # (id, size)
    sha256: str
    seconds: float = 0.0

    def plugin_env(self, socket_path: str, mode: str, verify: bool = True, api: str = "client") -> dict:
        return {"VRAMD_CRIU_MODE": mode, "VRAMD_CRIU_API": api, "VRAMD_CRIU_SOCKET": socket_path,
                "VRAMD_CRIU_IMAGE": self.path,
                "VRAMD_CRIU_BOS": ",".join(f"{i}:{s}" for i, s in self.bos), "VRAMD_CRIU_SHA256": self.sha256,
                "VRAMD_CRIU_VERIFY": "1" if verify else "0"}


def make_vramd_image(socket_path: str, path: str, sizes: list[int], compression: str = "none") -> VramdImage:
    """Dump memfd BOs of random bytes through the daemon (Python client) into a new image at `path`.

    Returns the image with the SHA-256 of the BOs' bytes concatenated in id order."""
    from vramd.client import SESSION_DUMP, Client, ClientBo

    os.makedirs(path, exist_ok=True)
    h = hashlib.sha256()
    fds, bos = [], []
    t0 = time.monotonic()
    try:
        for i, size in enumerate(sizes, 1):
            fd = os.memfd_create(f"bo{i}", os.MFD_CLOEXEC)
            fds.append(fd)
            os.ftruncate(fd, size)
            off = 0
            while off < size:
                block = os.urandom(min(64 << 20, size - off))
                os.pwrite(fd, block, off)
                h.update(block)
                off += len(block)
            bos.append(ClientBo(i, fd, size=size))
        dir_fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            with Client(socket_path, name="criu-test") as c:
                c.run_session(SESSION_DUMP, dir_fd, bos, compression=compression)
        finally:
            os.close(dir_fd)
    finally:
        for fd in fds:
            os.close(fd)
    return VramdImage(path, [(i, s) for i, s in enumerate(sizes, 1)], h.hexdigest(), time.monotonic() - t0)


@dataclass
class Rig:
    """One dumped workload, restorable again and again with the test plugin."""

    env: Env
    work: str
    libdir: str
    workload: Workload
    img: str
    dump_wall: float = 0.0
    device: str | None = None

    @classmethod
    def dumped(cls, env: Env, work: str, libdir: str, workload_bin: str, mib: int, log: str,
               device: str | None = None) -> Rig:
        """device: a character device the workload keeps open, which CRIU leaves to the plugin (ext file)."""
        img = os.path.join(work, "criu-img" if not device else "criu-img-dev")
        if os.path.exists(img):
            shutil.rmtree(img)
        os.makedirs(img)
        w = Workload(workload_bin, mib, work, device)
        try:
            wall = criu(env, "dump", "-t", str(w.pid), "-D", img, "-o", "dump.log", "-v4", "--libdir", libdir,
                        extra_env={"VRAMD_CRIU_LOG": log, **({"VRAMD_CRIU_EXT_DEV": device} if device else {})})
        except BaseException:
            w.proc.kill()
            w.proc.wait()
            raise
        w.reap()
        return cls(env, work, libdir, w, img, wall, device=device)

    def restore(self, log: str, plugin_env: dict | None = None) -> float:
        """criu restore -d with the plugin; returns the wall time.  The restored task keeps running."""
        env = {"VRAMD_CRIU_LOG": log, **({"VRAMD_CRIU_EXT_DEV": self.device} if self.device else {}),
               **(plugin_env or {})}
        return criu(self.env, "restore", "-D", self.img, "-d", "-o", "restore.log", "-v4", "--libdir", self.libdir,
                    extra_env=env)
