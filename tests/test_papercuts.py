"""Every mistake a person makes with the real commands (issue 36): one line that says what, where and what to do,
exit 2 for a usage mistake and 1 for a runtime failure, and nothing left behind.

Table-driven: each row runs `vramd`, `vramctl` or `./dev.sh demo` as a subprocess, as root or as a real
unprivileged user (nobody; vramd-e2e, a member of group vramd, as tests/test_unprivileged.py makes it), against
real files, real directories and a real daemon whose socket is root:vramd 0660 as vramd.socket makes it.  A row
gives the command, the exit status, the stream and the words its one line must hold (and, where the old
behaviour said something else, words it must not), and the scratch directory whose contents must be the same
afterwards.  Needs root (it acts as other uids); CI runs the suite as root.
"""
from __future__ import annotations

import grp
import os
import select
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from helpers import ROOT
from test_unprivileged import GROUP, MISSING, TEST_USER, ensure_users

from vramd.client import SESSION_DUMP, Client
from vramd.paths import SYSTEM_SOCKET
from vramd.testing import DaemonProcess, PythonAccess, RunAs

pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root: rows run as other uids (CI runs the suite as root)"),
    pytest.mark.skipif(bool(MISSING), reason=f"needs {', '.join(MISSING)} (the passwd package) to create vramd-e2e"),
]
TIMEOUT = 60  # a command that hangs (a daemon that serves where it should have refused) fails its row


@dataclass
class World:
    base: Path          # 0755, root's: every row's scratch directory lives under it
    daemon: DaemonProcess
    access: PythonAccess
    users: dict[str, RunAs]


@pytest.fixture(scope="module")
def world() -> Iterator[World]:
    ensure_users()
    access = PythonAccess.choose(["nobody", TEST_USER])
    base = Path(tempfile.mkdtemp(prefix="vramd-pc-", dir="/tmp"))
    try:
        os.chmod(base, 0o755)
        run = base / "run"
        run.mkdir(mode=0o755)
        held = base / "held"
        held.mkdir()
        fd = os.open(held, os.O_RDONLY | os.O_DIRECTORY)
        with DaemonProcess(str(run), "--socket-mode", "0660", "--grace-period", "30") as d:
            os.chown(d.socket, 0, grp.getgrnam(GROUP).gr_gid)  # as vramd.socket's SocketGroup=vramd has it
            with Client(d.socket) as c:
                s = c.open_session(SESSION_DUMP, fd, label="held by root")  # a session a user does not see
                os.close(fd)
                users = {name: RunAs.user(name, access, cwd=str(base)) for name in ("root", "nobody", TEST_USER)}
                yield World(base, d, access, users)
                c.close_session(s.token)
            assert d.stop() == 0, "".join(d.log)
    finally:
        shutil.rmtree(base, ignore_errors=True)
        access.close()


@dataclass
class Row:
    """`argv(scratch, world)`: the command (its first word vramd, vramctl or ./dev.sh); `prep`: what the row
    needs made first (in `scratch`, before the snapshot)."""
    argv: Callable[[Path, World], list[str]]
    code: int
    says: list[str]                  # each in the one line ({scratch}, {socket} filled in)
    who: str = "root"
    stream: str = "stderr"
    not_says: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    prep: Callable[[Path, World], None] | None = None
    one_line: bool = True            # the stream is that one line (else: a usage error's usage, then its line)


def _sh(*words: str) -> Callable[[Path, World], list[str]]:
    return lambda scratch, w: [x.format(scratch=scratch, socket=w.daemon.socket) for x in words]


def _mkdir(*names: str, mode: int = 0o755) -> Callable[[Path, World], None]:
    def prep(scratch: Path, w: World) -> None:
        for n in names:
            (scratch / n).mkdir(mode=mode)
            os.chmod(scratch / n, mode)
    return prep


def _write(name: str, text: str) -> Callable[[Path, World], None]:
    return lambda scratch, w: (scratch / name).write_text(text)


def _stale_root_socket(scratch: Path, w: World) -> None:
    """A socket file of root's, mode 0600, that nobody listens on (a daemon root ran and killed)."""
    import socket
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    s.bind(str(scratch / "v.sock"))
    s.close()
    os.chmod(scratch / "v.sock", 0o600)


def _listener_that_hangs_up(scratch: Path, w: World) -> None:
    """Something that listens at v.sock and lets the one connection it gets go once its Hello has come, unread:
    what a client of vramd.socket meets when the service it starts fails (the peer sees ECONNRESET)."""
    import socket
    import threading
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    s.bind(str(scratch / "v.sock"))
    s.listen(1)
    s.settimeout(TIMEOUT)

    def serve() -> None:
        with s:
            conn, _ = s.accept()
            with conn:
                conn.settimeout(TIMEOUT)
                select.select([conn], [], [], TIMEOUT)  # the Hello is there: closing now resets the connection
    threading.Thread(target=serve, daemon=True).start()


def _shipped_plus(line: str) -> Callable[[Path, World], None]:
    def prep(scratch: Path, w: World) -> None:  # what `echo LINE >> /etc/vramd/vramd.toml` does
        text = (Path(ROOT) / "contrib" / "systemd" / "vramd.toml").read_text()
        (scratch / "vramd.toml").write_text(text + line + "\n")
    return prep


def _parent_and_child(scratch: Path, w: World) -> None:
    """An image `parent` and an incremental image `kids/step2` whose parent it is, dumped through the daemon."""
    (scratch / "bo").write_bytes(os.urandom(1 << 20))
    for img, more in ((scratch / "parent", []), (scratch / "kids" / "step2", ["--parent", str(scratch / "parent")])):
        r = subprocess.run([sys.executable, "-m", "vramd.cli", "--socket", w.daemon.socket, "dump", "--bo-file",
                            str(scratch / "bo"), "--image", str(img), *more], cwd=ROOT, capture_output=True,
                           text=True, timeout=TIMEOUT)
        assert r.returncode == 0, r.stderr


ROWS: dict[str, Row] = {
    # --- the daemon's socket: one line, exit 1, nothing made -------------------------------------------------
    "vramd: a socket path another uid's stale socket holds": Row(
        _sh("vramd", "--socket", "{scratch}/v.sock"), 1, ["cannot listen on {scratch}/v.sock", "a socket of uid 0",
                                                           "choose another --socket"], who="nobody",
        prep=_stale_root_socket),
    "vramd: a directory it may not write": Row(
        _sh("vramd", "--socket", "{scratch}/ro/v.sock"), 1, ["cannot listen on {scratch}/ro/v.sock",
                                                              "Permission denied", "write {scratch}/ro"],
        who="nobody", prep=_mkdir("ro")),
    "vramd: a missing subdirectory it could not make": Row(
        _sh("vramd", "--socket", "{scratch}/ro/sub/v.sock"), 1, ["cannot listen on {scratch}/ro/sub/v.sock",
                                                                  "{scratch}/ro/sub does not exist", "create it"],
        who="nobody", prep=_mkdir("ro")),
    "vramd: its own runtime directory it cannot make": Row(
        _sh("vramd"), 1, ["cannot listen on {scratch}/ro/vramd/vramd.sock", "Permission denied"], who="nobody",
        env={"XDG_RUNTIME_DIR": "{scratch}/ro"}, prep=_mkdir("ro")),
    "vramd: a mistyped directory is not made, not even by root": Row(
        _sh("vramd", "--socket", "{scratch}/nonexistent/dir/v.sock"), 1,
        ["cannot listen on {scratch}/nonexistent/dir/v.sock", "{scratch}/nonexistent/dir does not exist",
         "makes only /run/vramd"]),
    # --- the configuration ------------------------------------------------------------------------------------
    "config: a key appended to the shipped file is a top-level key": Row(
        _sh("vramd", "--check-config", "--config", "{scratch}/vramd.toml"), 0, ['log_level = "debug"'],
        stream="stdout", one_line=False, not_says=["[topology_checks]\nlog_level"],
        prep=_shipped_plus('log_level = "debug"')),
    "config: a top-level key under a table header": Row(
        _sh("vramd", "--check-config", "--config", "{scratch}/c.toml"), 2,
        ["topology_checks: log_level", "belongs at the top level"],
        prep=_write("c.toml", '[topology_checks]\nKFD_NUMA_CHECK = false\nlog_level = "debug"\n')),
    "config: values in TOML's words": Row(
        _sh("vramd", "--check-config", "--config", "{scratch}/c.toml"), 2, ["chunk_size", "got a boolean true"],
        not_says=["True"], prep=_write("c.toml", "chunk_size = true\n")),
    "config: a misspelt key": Row(
        _sh("vramd", "--check-config", "--config", "{scratch}/c.toml"), 2,
        ["staging_budjet: unknown setting", "did you mean staging_budget?"],
        prep=_write("c.toml", 'staging_budjet = "1G"\n')),
    "config: a group that does not exist": Row(
        _sh("vramd", "--check-config", "--config", "{scratch}/c.toml"), 0,
        ["warning: allowed_groups", '"nosuchgroup"', "lets nobody in"],
        prep=_write("c.toml", 'allowed_groups = ["nosuchgroup"]\n')),
    "config: a metrics file in a directory that does not exist": Row(
        _sh("vramd", "--check-config", "--metrics-textfile", "{scratch}/gone/vramd.prom"), 0,
        ["warning: metrics_textfile: {scratch}/gone is not a directory", "no metrics will be written"]),
    "vramd: a socket path longer than a unix socket's": Row(
        _sh("vramd", "--socket", "{scratch}/" + "d" * 100 + "/v.sock"), 1,
        ["cannot listen on {scratch}/ddd", "at most 107 bytes: choose a shorter --socket"],
        prep=_mkdir("d" * 100)),
    # --- usage mistakes: exit 2 from the parser, sizes in one style ------------------------------------------
    "vramd: a size it cannot read": Row(
        _sh("vramd", "--staging-budget", "12Q"), 2,
        ["argument --staging-budget: not a size: '12Q' (examples: 4096, 0x1000, 8M"], one_line=False),
    "vramctl: a size it cannot read": Row(
        _sh("vramctl", "selftest", "--size", "64Q"), 2, ["argument --size: not a size: '64Q' (examples: 4096"],
        one_line=False),
    "vramctl: a codec there is none of": Row(
        _sh("vramctl", "--socket", "{socket}", "dump", "--bo-file", "/etc/hostname", "--image", "{scratch}/img",
            "--compress", "lz4"), 2, ["argument --compress: unknown compression 'lz4'", "bplanes", "auto"],
        one_line=False),
    "vramctl: dump --pid without --range": Row(
        _sh("vramctl", "--socket", "{socket}", "dump", "--pid", "1", "--image", "{scratch}/img"), 2,
        ["dump: nothing to dump", "--range ADDR:LEN", "--bo-file"], one_line=False),
    "vramctl: dump --pid of a process that is not there": Row(
        _sh("vramctl", "--socket", "{socket}", "dump", "--pid", "999999999", "--range", "0x1000:4096", "--image",
            "{scratch}/img"), 1, ["cannot open /proc/999999999/mem", "no process 999999999 is running: check --pid"]),
    "vramctl: dump --pid of another uid's process": Row(
        _sh("vramctl", "--socket", "{socket}", "dump", "--pid", "1", "--range", "0x1000:4096", "--image",
            "{scratch}/img"), 1, ["cannot open /proc/1/mem", "you may not trace process 1", "ptrace_scope"],
        who=TEST_USER, prep=lambda scratch, w: scratch.chmod(0o1777)),
    # --- push, pull and restore from a registry: what is wrong with the words is a usage mistake ------------
    "vramctl: push to a reference that is none": Row(
        _sh("vramctl", "push", "{scratch}", "badref"), 2,
        ["argument HOST/REPO[:TAG]: 'badref' is not a reference HOST[:PORT]/REPOSITORY"], one_line=False),
    "vramctl: pull a repository name with capitals": Row(
        _sh("vramctl", "pull", "localhost:5000/My Repo:1", "{scratch}/img"), 2,
        ["argument HOST/REPO[:TAG|@DIGEST]:", "'My Repo' is not a repository name"], one_line=False),
    "vramctl: restore from an oci:// reference that is none": Row(
        _sh("vramctl", "--socket", "{socket}", "restore", "--pid", "1", "--image", "oci://badref"), 2,
        ["argument --image: 'oci://badref' is not a reference"], one_line=False),
    "vramctl: --password-stdin with no --username": Row(
        _sh("vramctl", "push", "{scratch}", "localhost:5000/x:1", "--password-stdin"), 2,
        ["--password-stdin needs --username"], one_line=False),
    "vramctl: --concurrency 0": Row(
        _sh("vramctl", "pull", "localhost:5000/x:1", "{scratch}/img", "--concurrency", "0"), 2,
        ["argument --concurrency: 0: must be at least 1"], one_line=False),
    "vramctl: restore --window without --no-cache (it would be ignored)": Row(
        _sh("vramctl", "--socket", "{socket}", "restore", "--pid", "1", "--image", "oci://localhost:5000/x:1",
            "--window", "8"), 2, ["--window needs --no-cache"], one_line=False),
    "vramctl: restore --no-cache --window below 0 (was taken as 0)": Row(
        _sh("vramctl", "--socket", "{socket}", "restore", "--pid", "1", "--image", "oci://localhost:5000/x:1",
            "--no-cache", "--window", "-8"), 2, ["argument --window: -8: must be at least 0"], one_line=False),
    "vramctl: restore --no-cache --refresh-cache (the cache's copy it names would stay)": Row(
        _sh("vramctl", "--socket", "{socket}", "restore", "--pid", "1", "--image", "oci://localhost:5000/x:1",
            "--no-cache", "--refresh-cache"), 2, ["--refresh-cache and --no-cache"], one_line=False),
    "vramctl: restore of a local directory with --no-cache (it would be ignored)": Row(
        _sh("vramctl", "--socket", "{socket}", "restore", "--pid", "1", "--image", "{scratch}", "--no-cache"), 2,
        ["--no-cache needs --image oci://"], one_line=False),
    "vramctl: --mount-from a repository name that is none": Row(
        _sh("vramctl", "push", "{scratch}", "localhost:5000/x:1", "--mount-from", "Other Repo"), 2,
        ["argument --mount-from: 'Other Repo' is not a repository name"], one_line=False),
    "vramctl: --ca-file that holds no certificate": Row(
        _sh("vramctl", "pull", "127.0.0.1:1/x:1", "{scratch}/img", "--ca-file", "{scratch}/ca.pem"), 1,
        ["cannot load the CA file {scratch}/ca.pem: NO_CERTIFICATE_OR_CRL_FOUND: give a PEM file of CA certificates"],
        not_says=["_ssl.c"], prep=_write("ca.pem", "not a certificate\n")),
    "vramctl: --registry-config names a directory": Row(
        _sh("vramctl", "pull", "127.0.0.1:1/x:1", "{scratch}/img", "--registry-config", "{scratch}"), 1,
        ["--registry-config {scratch}: is not a regular file (give a docker/podman config.json)"],
        not_says=["no such file"]),
    "vramctl: an annotation that is no KEY=VALUE": Row(
        _sh("vramctl", "push", "{scratch}", "localhost:5000/x:1", "--annotation", "foo"), 2,
        ["--annotation 'foo': expected KEY=VALUE"], one_line=False),
    # --- reaching the daemon ---------------------------------------------------------------------------------
    "vramctl: no daemon running": Row(
        _sh("vramctl", "status"), 1, ["cannot connect to vramd at /tmp/vramd-65534/vramd.sock",
                                      f"no system socket at {SYSTEM_SOCKET}", "systemctl start vramd.socket"],
        who="nobody"),
    "vramctl: a service that failed to start (the socket hangs up at Hello)": Row(
        _sh("vramctl", "--socket", "{scratch}/v.sock", "status"), 1,
        ["cannot connect to vramd at {scratch}/v.sock", "hung up before it answered", "systemctl status vramd"],
        not_says=["[Errno"], prep=_listener_that_hangs_up),
    "vramctl: --socket names a directory": Row(
        _sh("vramctl", "--socket", "{scratch}", "status"), 1,
        ["cannot connect to vramd at {scratch}", "is a directory, not a socket"], not_says=["is vramd running"]),
    "vramctl: the socket's mode keeps a non-member out": Row(
        _sh("vramctl", "--socket", "{socket}", "status"), 1,
        ["cannot connect to vramd at {socket}", "Permission denied", "0660", "group vramd", "usermod -aG vramd"],
        who="nobody"),
    "vramctl: sessions --all as a user who sees only its own": Row(
        _sh("vramctl", "--socket", "{socket}", "sessions", "--all"), 0,
        ["sessions --all shows you only your own sessions", "only to root and the daemon's user"], who=TEST_USER),
    "vramctl: rm of an image an incremental one needs": Row(
        _sh("vramctl", "rm", "{scratch}/parent"), 1,
        ["{scratch}/parent is the parent of 1 incremental image(s): {scratch}/kids/step2", "remove or flatten"],
        not_says=[".child."], prep=_parent_and_child),
    "vramctl: restore --bo-file with an id the image has not": Row(
        _sh("vramctl", "--socket", "{socket}", "restore", "--pid", "1", "--image", "{scratch}/parent", "--bo-file",
            "2={scratch}/bo"), 1, ["the image has no file BO 2 (--bo-file 2=...); its file BOs: 1"],
        not_says=["BO 1 was dumped from a file"], prep=_parent_and_child),
    "vramctl: flatten refused leaves no directory behind": Row(
        lambda scratch, w: ["vramctl", "flatten", os.path.join(ROOT, "tests", "fixtures", "image-v1"),
                            str(scratch / "new" / "out")], 1,
        ["a format v1 image has no parents: it is self-contained already"]),
    "demo: --socket where nobody listens": Row(
        _sh("./dev.sh", "demo", "--socket", "{scratch}/missing.sock"), 1,
        ["vramd-demo: cannot connect to vramd at {scratch}/missing.sock", "without --socket"]),
    "demo: --image names a file": Row(
        _sh("./dev.sh", "demo", "--size", "1M", "--image", "{scratch}/f"), 1,
        ["vramd-demo: cannot make the image directory {scratch}/f (--image): it exists and is not a directory"],
        not_says=["[Errno"], prep=_write("f", "not a directory\n")),
    # --- help and usage say what the tools take ----------------------------------------------------------------
    "vramd --help lists every codec": Row(
        _sh("vramd", "--help"), 0, ["none, zstd, zstd:LEVEL, bplanes, bplanes:LEVEL, auto, auto:LEVEL"],
        stream="stdout", one_line=False),
    "the demo's usage line is the command the README gives": Row(
        _sh("./dev.sh", "demo", "--help"), 0, ["usage: ./dev.sh demo"], not_says=["vramd.demo"], stream="stdout",
        one_line=False),
}


def _command(argv: list[str], who: RunAs) -> list[str]:
    head, *rest = argv
    if head == "./dev.sh":
        return [os.path.join(ROOT, "dev.sh"), *rest]
    python = [sys.executable] if who.uid == 0 else who.python
    return [*python, "-m", {"vramd": "vramd", "vramctl": "vramd.cli"}[head], *rest]


def _snapshot(d: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(d)): (p.lstat().st_mode, p.lstat().st_size if p.is_file() else 0)
            for p in sorted(d.rglob("*"))}


@pytest.mark.parametrize("name", list(ROWS))
def test_each_mistake_is_one_line_with_its_exit_status_and_leaves_nothing(world: World, name: str) -> None:
    row = ROWS[name]
    if name == "vramctl: no daemon running" and os.path.lexists(SYSTEM_SOCKET):
        pytest.skip(f"this machine has a system socket ({SYSTEM_SOCKET}): vramctl would go there")
    scratch = Path(tempfile.mkdtemp(prefix="case-", dir=world.base))
    os.chmod(scratch, 0o755)
    if row.prep is not None:
        row.prep(scratch, world)
    who = world.users[row.who]
    before = _snapshot(scratch)
    kw = who.popen_kwargs()
    kw["env"].update({k: v.format(scratch=scratch) for k, v in row.env.items()})
    if row.argv(scratch, world)[0] == "./dev.sh":  # as a person runs it: their environment, with its PATH
        kw["env"] = {k: v for k, v in os.environ.items() if k not in ("VRAMD_SOCKET", "XDG_RUNTIME_DIR")}
    proc = subprocess.Popen(_command(row.argv(scratch, world), who), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, **kw)
    try:
        out, err = proc.communicate(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        pytest.fail(f"{name}: still running after {TIMEOUT} s (it should have stopped at once): {err[-2000:]}")
    text = out if row.stream == "stdout" else err
    lines = text.splitlines()
    fill = {"scratch": str(scratch), "socket": world.daemon.socket}
    says = [s.format(**fill) for s in row.says]
    assert proc.returncode == row.code, (proc.returncode, out, err)
    assert "Traceback" not in err, err
    if row.one_line:
        assert len(lines) == 1, f"not one line: {text!r}"
        assert all(s in lines[0] for s in says), (says, text)
    else:  # a usage error's last line, or help text that argparse wraps: its words, in order
        flat = " ".join(text.split())
        assert all(s in flat for s in says), (says, text)
    for s in row.not_says:
        assert s not in text, text
    assert _snapshot(scratch) == before, "the command left something behind"


def test_the_daemon_logs_what_check_config_warns_of(run_dir: str) -> None:
    """What --check-config warns of, the daemon logs at warning priority: at its start, and at a SIGHUP that
    brings it in; it runs all the same."""
    import signal
    config = Path(run_dir, "vramd.toml")
    config.write_text('allowed_groups = ["nosuchgroup"]\n')
    with DaemonProcess(run_dir, "--config", str(config)) as d:
        d.expect_log(r'WARNING vramd: allowed_groups: no group "nosuchgroup" on this host: it lets nobody in')
        config.write_text(f'metrics_textfile = "{run_dir}/gone/vramd.prom"\n')
        d.proc.send_signal(signal.SIGHUP)
        d.expect_log(rf"WARNING vramd: SIGHUP: metrics_textfile: {run_dir}/gone is not a directory here")
        with Client(d.socket) as c:
            assert c.status().server.startswith("vramd ")
        assert d.stop() == 0


def test_completion_offers_codec_names_after_compress() -> None:
    """The generated bash completion, sourced into a real bash: after `--compress`, the codecs compression.py
    accepts; elsewhere, the flags."""
    bash = shutil.which("bash")
    assert bash is not None
    script = Path(ROOT, "contrib", "completion", "vramctl.bash")

    def complete(*words: str) -> list[str]:
        code = (f"source {script}; COMP_WORDS=(vramctl {' '.join(words)}); COMP_CWORD={len(words)}; _vramctl; "
                'printf "%s\\n" "${COMPREPLY[@]}"')
        r = subprocess.run([bash, "--norc", "-c", code], capture_output=True, text=True, timeout=TIMEOUT)
        assert r.returncode == 0, r.stderr
        return r.stdout.split()

    assert complete("dump", "--compress", "''") == ["none", "zstd", "bplanes", "auto"]
    assert complete("import-criu", "--compress", "b") == ["bplanes"]
    assert "--image" in complete("dump", "--i")


def test_the_drift_check_fails_on_a_stale_file(tmp_path: Path) -> None:
    """contrib/generate.py --check (tests/test_packaging.py runs it on the repository) on a copy of what it checks:
    clean, then each kind of staleness: a completion without the codec names, a man page without a codec, a README
    that lists a command no more (or a flag vramctl never took)."""
    for name in ("contrib", "README.md"):
        src = Path(ROOT, name)
        (shutil.copytree if src.is_dir() else shutil.copyfile)(src, tmp_path / name)

    def check() -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, str(Path(ROOT, "contrib", "generate.py")), "--check", "--root",
                               str(tmp_path)], capture_output=True, text=True, timeout=TIMEOUT)
    r = check()
    assert r.returncode == 0, r.stdout + r.stderr
    completion, man, readme = (tmp_path / "contrib" / "completion" / "vramctl.bash",
                               tmp_path / "contrib" / "man" / "vramd.8", tmp_path / "README.md")
    for path, old, new in ((completion, '-W "none zstd bplanes auto"', '-W "none zstd"'),
                           (man, "bplanes, bplanes:LEVEL, auto, auto:LEVEL", ""),
                           (readme, "vramctl selftest [--size 64M]", "vramctl selfcheck [--size 64M]"),
                           (readme, "vramctl gc DIR ", "vramctl gc DIR --all-of-it ")):
        good = path.read_text()
        assert old in good, (path, old)
        path.write_text(good.replace(old, new))
        r = check()
        assert r.returncode == 1, (path, r.stdout)
        named = "README.md" if path == readme else str(path.relative_to(tmp_path))
        assert named in r.stdout, r.stdout
        path.write_text(good)
    assert "--all-of-it: no such flag" in r.stdout and check().returncode == 0
