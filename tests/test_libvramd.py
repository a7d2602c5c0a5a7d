"""libvramd, the C client (native/client), against real vramd daemons.

Builds the library and its C test program with Meson (build/libvramd; an
AddressSanitizer + UBSan build in build/libvramd-asan), runs the C suite
(native/client/tests) against the `daemon` fixture, under the sanitizers and
under valgrind, and drives the tests that need someone outside the C program:
a daemon killed during a Wait, a daemon that stops answering, a session
reaped after its grace period.  Also: the installed library, header and
vramd.pc work through pkg-config; only vramd_* symbols are exported; the
proto2 file protoc-c is given has the wire format of rpc.proto.
"""
from __future__ import annotations

import os
import platform
import re
import select
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from vramd.testing import DaemonProcess

ROOT = Path(__file__).resolve().parent.parent
SRC = ROOT / "native" / "client"
BUILD = ROOT / "build" / "libvramd"
BUILD_ASAN = ROOT / "build" / "libvramd-asan"
TESTS_BIN = "tests/libvramd-tests"


def meson_build(builddir: Path, *options: str) -> Path:
    """Configure (once) and compile a build of native/client; returns the build dir."""
    for tool in ("meson", "ninja", "protoc-c", "pkg-config"):
        if shutil.which(tool) is None:
            pytest.fail(f"{tool} is missing: ./dev.sh installs meson, ninja-build, protobuf-c-compiler, pkg-config")
    if not (builddir / "build.ninja").exists():
        shutil.rmtree(builddir, ignore_errors=True)
        run(["meson", "setup", str(builddir), str(SRC), *options])
    run(["meson", "compile", "-C", str(builddir)])
    return builddir


def run(cmd, **kw) -> subprocess.CompletedProcess:
    r = subprocess.run(cmd, capture_output=True, text=True, **kw)
    if r.returncode != 0:
        pytest.fail(f"{' '.join(map(str, cmd))} failed ({r.returncode}):\n{r.stdout[-6000:]}\n{r.stderr[-6000:]}")
    return r


def c_env(daemon, **extra) -> dict:
    env = dict(os.environ, VRAMD_SOCKET=daemon.socket, VRAMD_TEST_TMP="/var/tmp",
               VRAMD_TEST_VRAMCTL=f"cd {ROOT} && {sys.executable} -m vramd.cli")
    env.update({k: str(v) for k, v in extra.items()})
    return env


def daemon_fds_of_tests(daemon) -> list[str]:
    """The daemon's fds that point at what the C tests pass it: BO memfds, /proc/<pid>/mem, image dirs."""
    out = []
    for fd in os.listdir(f"/proc/{daemon.pid}/fd"):
        try:
            target = os.readlink(f"/proc/{daemon.pid}/fd/{fd}")
        except FileNotFoundError:
            continue
        if re.search(r"memfd:vramd-test|memfd:bo|/proc/\d+/mem|/mem$|vramd-ctest-", target):
            out.append(target)
    return out


def run_suite(daemon, argv: list[str], groups: list[str], timeout: float, **env) -> str:
    """Run the C suite; assert that every test passed and that the daemon kept no fd of ours."""
    r = subprocess.run([*argv, *groups], capture_output=True, text=True, timeout=timeout, env=c_env(daemon, **env))
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-12000:]
    assert re.search(r"^\d+ test\(s\), 0 failed$", r.stdout, re.M), out[-12000:]
    assert "FAIL" not in r.stdout, out[-12000:]
    # every session was closed: the daemon holds none of the fds the tests passed it
    assert daemon_fds_of_tests(daemon) == []
    return out


@pytest.fixture(scope="module")
def build():
    return meson_build(BUILD)


@pytest.fixture(scope="module")
def build_asan():
    return meson_build(BUILD_ASAN, "-Db_sanitize=address,undefined", "-Db_lundef=false", "-Dbench=false",
                       "-Dbuildtype=debug")


# One daemon per test, each well under a minute: a daemon started by the test
# launcher blocks for good once ~10 of its 5-second sd_notify STATUS datagrams
# sit unread on the launcher's notify socket (see the report of this change).

def test_c_suite(build, daemon):
    """Round trips (memfd BOs, procmem ranges, many fds), the hook adapter, failure paths; ABI 1.0 (t_abi.c):
    struct_size 0 (0.x-style structs), the 1.0 size and a later header's with a zero tail work, a non-zero
    tail is -E2BIG naming the struct, arrays of mixed sizes -EINVAL, the enums and their string twins."""
    out = run_suite(daemon, [str(build / TESTS_BIN)], ["unit", "quick"], 300)
    for name in ("memfd_roundtrip", "procmem_roundtrip", "many_fds", "criu_adapter", "criu_incremental",
                 "uid_refused", "corrupt_image", "bad_fds", "no_daemon", "fake_daemon", "fd_placement",
                 "wait_timeout", "incremental", "cancel_by_id", "dump_commit", "dump_no_commit", "dump_busy",
                 "unreadable_image", "marks_and_sweep", "sibling_children", "fake_asks_for_a_file",
                 "reader_child_locks_nothing", "marks_read_by_vramctl", "lock_on_fd_one",
                 "child_of_another_owner_marks_nothing", "moved_childs_mark_kept", "abi_sizes", "abi_refusals",
                 "abi_enums", "lock_replacements"):
        assert f"PASS {name} " in out, out


def test_c_dump_short_of_fds_leaves_no_file(build, daemon):
    """With no fd free above min_fd (RLIMIT_NOFILE lowered, the rest filled), a libvramd dump fails and leaves
    no file it created: no data file, manifest temporary, lock file or mark; with enough fds it commits."""
    out = run_suite(daemon, [str(build / TESTS_BIN)], ["fdlimit"], 300)
    assert "PASS no_fd_left_no_file " in out, out


# vramd.imagedir's side of a parent's lock, taken and released shared (as a sibling child dump does) until
# stdin closes; prints how many times it was refused, and the first message.
SIBLING_HAMMER = """
import os, select, sys
from vramd.imagedir import take_lock
from vramd.errors import VramdError
d = os.open(sys.argv[1], os.O_RDONLY | os.O_DIRECTORY)
print("READY", flush=True)
refused, first, rounds = 0, "", 0
while not select.select([0], [], [], 0)[0]:  # until stdin closes
    rounds += 1
    try:
        lock = take_lock(d, "the parent", shared=True)
    except VramdError as e:
        refused, first = refused + 1, first or e.message
        continue
    lock.release()
print(refused, rounds, first, flush=True)
"""


def test_c_and_python_siblings_never_refuse_each_other(build, daemon, tmp_path):
    """libvramd child dumps (4 processes beginning 20,000 each: t_files.c, sibling_lock_churn) and
    vramd.imagedir siblings (3 processes taking and releasing the lock in a loop) share one parent's lock at
    once: neither side is ever refused, and no .lock is left (found by review: "has 0 links" and -EBUSY
    while a releasing sibling held the lock exclusively for its unlink)."""
    parent, bo = tmp_path / "parent", tmp_path / "bo.bin"
    bo.write_bytes(os.urandom(100_000))
    r = subprocess.run([sys.executable, "-m", "vramd.cli", "--socket", daemon.socket, "dump", "--bo-file", str(bo),
                        "--image", str(parent)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    hammers = [subprocess.Popen([sys.executable, "-c", SIBLING_HAMMER, str(parent)], cwd=ROOT, text=True,
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
               for _ in range(3)]
    try:
        for h in hammers:
            assert h.stdout.readline().strip() == "READY", h.stderr.read()
        out = run_suite(daemon, [str(build / TESTS_BIN)], ["churn"], 300, VRAMD_TEST_CHURN_PARENT=str(parent))
        assert "PASS sibling_lock_churn " in out, out
    finally:
        results = [h.communicate(timeout=60) for h in hammers]
    for h, (hout, herr) in zip(hammers, results, strict=True):
        assert h.returncode == 0, herr
        refused, rounds = hout.split()[:2]
        assert refused == "0" and int(rounds) > 0, hout
    assert not (parent / ".lock").exists()


def test_c_criu_topology(build, daemon):
    """CRIU's restore shape: 1, then 3 restored tasks submit, hand over tickets and rebuild
    1 GiB of memory each (VRAMD_TEST_TOUCH_MB) while CRIU main attaches and waits."""
    out = run_suite(daemon, [str(build / TESTS_BIN)], ["topology"], 300,
                    VRAMD_TEST_TOUCH_MB=os.environ.get("VRAMD_TEST_TOUCH_MB", "1024"))
    assert "PASS topology_one " in out and "PASS topology_three " in out, out
    # the restored tasks opened their sessions themselves (CRIU main only attached)
    daemon.expect_log(r"session \d+ \(restore\) opened by uid 0 pid \d+ \[ctest restored task\]")


def test_c_big_sparse_bo(build, daemon):
    """A BO of 4 GiB + 12345 bytes (sparse memfd, data across the 4 GiB line), dumped and restored."""
    out = run_suite(daemon, [str(build / TESTS_BIN)], ["big"], 300)
    assert "PASS big_sparse " in out, out


def test_c_suite_asan_ubsan(build_asan, daemon):
    """The C suite built with -fsanitize=address,undefined: no error, no leak (LeakSanitizer)."""
    run_suite(daemon, [str(build_asan / TESTS_BIN)], ["unit", "quick", "topology", "big"], 600,
              VRAMD_TEST_TOUCH_MB=128, VRAMD_TEST_RESTORE_MB=16, VRAMD_TEST_BIG_BYTES=(64 << 20) + 12345,
              ASAN_OPTIONS="detect_leaks=1:halt_on_error=1:abort_on_error=0:check_initialization_order=1",
              UBSAN_OPTIONS="halt_on_error=1:print_stacktrace=1")


def test_c_suite_valgrind(build, daemon):
    """The C suite under valgrind memcheck: no error, no definite/indirect leak, no fd left open."""
    if shutil.which("valgrind") is None:
        pytest.fail("valgrind is missing: ./dev.sh installs it")
    out = run_suite(daemon, ["valgrind", "--leak-check=full", "--errors-for-leak-kinds=definite,indirect",
                             "--error-exitcode=1", "--track-fds=yes",
                             str(build / TESTS_BIN)], ["unit", "quick", "topology"], 900,
                    VRAMD_TEST_TOUCH_MB=16, VRAMD_TEST_RESTORE_MB=4)
    # the main process and every forked child (restored tasks, fake daemons, the refused uid) are checked
    summaries = re.findall(r"==(\d+)== ERROR SUMMARY: (\d+) errors", out)
    assert len(summaries) > 10 and all(n == "0" for _, n in summaries), out[-6000:]
    # every fd the main process has open at exit was inherited (stdin, stdout, stderr): none leaked
    main = re.search(r"^==(\d+)==", out, re.M).group(1)
    assert re.search(rf"=={main}== FILE DESCRIPTORS: \d+ open", out), out[-6000:]
    opened = re.findall(rf"=={main}== (Open [^\n]*)\n=={main}==\s+([^\n]*)", out)
    leaked = [(fd, where) for fd, where in opened if "inherited from parent" not in where]
    assert not leaked, leaked


def read_line(proc: subprocess.Popen, prefix: str, timeout: float = 60) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ready, _, _ = select.select([proc.stdout], [], [], max(0.0, deadline - time.monotonic()))
        if not ready:
            break
        line = proc.stdout.readline()
        if not line:
            break
        if line.startswith(prefix):
            return line
    proc.kill()
    out, err = proc.communicate()
    pytest.fail(f"no {prefix!r} from the C test:\n{out}\n{err}")


def test_restored_task_dies_and_session_is_reaped(build, daemon):
    """The restored task dies before CRIU main attaches, without starting: after the grace
    period the daemon reaps the session, and CRIU main's attach gets NOT_FOUND."""
    p = subprocess.Popen([str(build / TESTS_BIN), "task_dies_reaped"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, env=c_env(daemon))
    read_line(p, "HANDED-OVER ")
    daemon.expect_log(r"session \d+: no client holds it any more \(grace period over\); cancelling")
    daemon.expect_log(r"session \d+ \(restore, uid 0, pid \d+\): SESSION_CANCELLED: "
                      r".*session reaped: grace period over")
    out, err = p.communicate("go\n", timeout=60)
    assert p.returncode == 0 and "PASS task_dies_reaped" in out, out + err


def blocked_in_poll(pid: int) -> bool:
    """Whether the process sleeps in poll()/ppoll() (the C client waiting for a reply)."""
    numbers = {"x86_64": {"7", "271"}, "aarch64": {"73"}}.get(platform.machine(), set())
    try:
        with open(f"/proc/{pid}/syscall") as f:
            return f.read().split()[0] in numbers
    except (OSError, IndexError):
        return False


def test_daemon_killed_during_wait(build, daemon):
    """A client blocked in Wait gets ECONNRESET as soon as the daemon dies, not a hang."""
    if not {"x86_64": 1, "aarch64": 1}.get(platform.machine()):
        pytest.skip("poll syscall numbers known for x86_64 and aarch64 only")
    p = subprocess.Popen([str(build / TESTS_BIN), "daemon_killed_in_wait"], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, env=c_env(daemon))
    read_line(p, "WAITING")
    deadline = time.monotonic() + 30
    while not blocked_in_poll(p.pid):  # the Wait is sent; the client waits for its reply
        assert time.monotonic() < deadline and p.poll() is None, "the C test never blocked in its Wait"
        time.sleep(0.005)
    t0 = time.monotonic()
    daemon.stop(signal.SIGKILL)
    out, err = p.communicate(timeout=30)
    took = time.monotonic() - t0
    assert p.returncode == 0 and "PASS daemon_killed_in_wait" in out, out + err
    assert "WAIT-FAILED" in out
    assert took < 2.0, f"the Wait took {took:.2f} s to notice the daemon's death"


def test_daemon_that_stops_answering(build, daemon):
    """timeout_ms bounds every call (and a Wait's reply: its timeout plus timeout_ms)."""
    run_suite(daemon, [str(build / TESTS_BIN)], ["daemon_stopped"], 120, VRAMD_TEST_DAEMON_PID=daemon.pid)


def _own_daemon(run_dir: str, *args: str) -> DaemonProcess:
    """A daemon with options the `daemon` fixture does not take (a grace period, a config file)."""
    return DaemonProcess(run_dir, *args, log_level="info")


def _stop(d: DaemonProcess) -> str:
    """Stop it with SIGTERM; its log."""
    try:
        d.stop()
    finally:
        d.close()
    return "".join(d.log)


def test_restored_task_dies_and_main_attaches_within_grace(build, run_dir):
    """The restored task submits, starts and dies; CRIU main attaches afterwards, within the
    grace period (30 s here, so that no scheduling delay can turn it into a reap): it gets the
    finished session and the bytes are in place."""
    d = _own_daemon(run_dir, "--grace-period", "30")
    try:
        r = subprocess.run([str(build / TESTS_BIN), "task_dies_attach_in_grace"], capture_output=True, text=True,
                           timeout=120, env=dict(os.environ, VRAMD_SOCKET=d.socket, VRAMD_TEST_TMP="/var/tmp"))
    finally:
        log = _stop(d)
    assert r.returncode == 0 and "PASS task_dies_attach_in_grace" in r.stdout, r.stdout + r.stderr + log[-4000:]
    assert "reaped: grace period over" not in log


def test_batching_under_tight_limits(build, run_dir):
    """max_message_bytes 4096, max_fds_per_message 7: the C client splits AddBos and AttachFiles to fit
    (the daemon closes the connection on any packet over a limit) and refuses a BO that fits in none."""
    cfg = Path(run_dir) / "vramd.toml"
    cfg.write_text('max_message_bytes = 4096\nmax_fds_per_message = 7\n')
    d = _own_daemon(run_dir, "--config", str(cfg), "--grace-period", "0.3")
    try:
        r = subprocess.run([str(build / TESTS_BIN), "limits"], capture_output=True, text=True, timeout=120,
                           env=dict(os.environ, VRAMD_SOCKET=d.socket, VRAMD_TEST_TMP="/var/tmp"))
    finally:
        log = _stop(d)
    assert r.returncode == 0 and "PASS tight_limits " in r.stdout, r.stdout + r.stderr + log[-4000:]
    assert "PASS tight_limits_chain " in r.stdout, r.stdout  # AttachFiles split to fit too
    assert "LIMIT_EXCEEDED" not in log, log[-4000:]


def test_installed_library_via_pkg_config(build, daemon, tmp_path):
    """meson install into a prefix; a program compiled with `pkg-config --cflags --libs vramd`
    (shared, and --static) connects to the daemon."""
    prefix = tmp_path / "prefix"
    bdir = tmp_path / "build"
    run(["meson", "setup", str(bdir), str(SRC), f"--prefix={prefix}", "-Dtests=false", "-Dbench=false"])
    run(["meson", "install", "-C", str(bdir)])
    assert (prefix / "include" / "vramd" / "client.h").exists() and (prefix / "include" / "vramd" / "criu.h").exists()
    pcs = list(prefix.rglob("vramd.pc"))
    assert len(pcs) == 1, pcs
    env = dict(os.environ, PKG_CONFIG_PATH=str(pcs[0].parent))
    prog = tmp_path / "hello.c"
    prog.write_text(
        "#include <stdio.h>\n#include <vramd/client.h>\n#include <vramd/criu.h>\n"
        "int main(int argc, char **argv) {\n"
        "    struct vramd_conn *c; struct vramd_error err;\n"
        "    int r = vramd_connect_path(&c, argv[1], NULL, &err);\n"
        "    if (r < 0) { fprintf(stderr, \"%s: %s\\n\", vramd_strerror(r), err.message); return 1; }\n"
        "    printf(\"server=%s version=%u\\n\", vramd_conn_server(c), vramd_conn_version(c));\n"
        "    vramd_close(c); return 0;\n}\n")
    flags = run(["pkg-config", "--cflags", "--libs", "vramd"], env=env).stdout.split()
    static_flags = run(["pkg-config", "--static", "--cflags", "--libs", "vramd"], env=env).stdout.split()
    assert "-lvramd" in flags and "-lprotobuf-c" in static_flags, (flags, static_flags)
    libdir = next(f[2:] for f in flags if f.startswith("-L"))
    run(["cc", "-std=c11", "-Wall", "-Werror", str(prog), "-o", str(tmp_path / "hello"), *flags])
    r = run([str(tmp_path / "hello"), daemon.socket], env=dict(env, LD_LIBRARY_PATH=libdir))
    assert r.stdout.startswith("server=vramd") and "version=2" in r.stdout, r.stdout
    static_flags = [f if f != "-lvramd" else f"{libdir}/libvramd.a" for f in static_flags]
    run(["cc", "-std=c11", "-Wall", "-Werror", str(prog), "-o", str(tmp_path / "hello-static"), *static_flags])
    r = run([str(tmp_path / "hello-static"), daemon.socket])
    assert r.stdout.startswith("server=vramd"), r.stdout
    assert "libvramd" not in run(["ldd", str(tmp_path / "hello-static")]).stdout


def test_only_vramd_symbols_are_exported(build):
    """-fvisibility=hidden and the version script: the public API and nothing else (no protobuf-c gencode)."""
    out = run(["nm", "-D", "--defined-only", str(build / "libvramd.so")]).stdout
    exported = {line.split()[-1].split("@")[0] for line in out.splitlines() if line.split()[1] in "TDBRV"}
    exported -= {s for s in exported if re.fullmatch(r"VRAMD_\d+\.\d+", s)}  # the version nodes
    declared = set()
    for header in ("client.h", "criu.h"):
        text = (SRC / "include" / "vramd" / header).read_text()
        declared |= set(re.findall(r"VRAMD_API\s+[^;(]*?\b(vramd_\w+)\s*\(", text))
    assert exported == declared, (exported ^ declared)
    assert all(s.startswith("vramd_") and not s.startswith("vramd__") for s in exported)


def test_proto2_translation_has_the_wire_format_of_rpc_proto(build, tmp_path):
    """protoc-c gets a proto2 rewrite of rpc.proto: same messages, field numbers, types,
    repeated-ness and packing; presence (has_*) exactly where rpc.proto has `optional`."""
    pytest.importorskip("grpc_tools")
    from google.protobuf import descriptor_pb2

    def load(proto: Path) -> descriptor_pb2.FileDescriptorSet:
        out = tmp_path / (proto.parent.name + ".pb")
        subprocess.run([sys.executable, "-m", "grpc_tools.protoc", f"-I{proto.parent}", f"--descriptor_set_out={out}",
                        proto.name], check=True, capture_output=True)
        fds = descriptor_pb2.FileDescriptorSet()
        fds.ParseFromString(out.read_bytes())
        return fds.file[0]

    p3, p2 = load(ROOT / "proto" / "vramd" / "pb" / "rpc.proto"), load(build / "rpc.proto")
    assert p2.syntax in ("", "proto2") and p3.syntax == "proto3"
    assert [e.name for e in p3.enum_type] == [e.name for e in p2.enum_type]
    for e3, e2 in zip(p3.enum_type, p2.enum_type):
        assert [(v.name, v.number) for v in e3.value] == [(v.name, v.number) for v in e2.value]
    assert [m.name for m in p3.message_type] == [m.name for m in p2.message_type]
    scalar = set(range(1, 19)) - {9, 10, 11, 12}  # not string, group, message, bytes
    for m3, m2 in zip(p3.message_type, p2.message_type):
        real_oneofs3 = {i for i, o in enumerate(m3.oneof_decl) if not o.name.startswith("_")}
        assert len(m3.field) == len(m2.field), m3.name
        for f3, f2 in zip(m3.field, m2.field):
            where = f"{m3.name}.{f3.name}"
            assert (f3.name, f3.number, f3.type, f3.type_name) == (f2.name, f2.number, f2.type, f2.type_name), where
            repeated = f3.label == f3.LABEL_REPEATED
            assert (f2.label == f2.LABEL_REPEATED) == repeated, where
            if repeated and f3.type in scalar:
                assert f2.options.packed, f"{where}: proto3 packs repeated scalars"
            in_oneof3 = f3.HasField("oneof_index") and f3.oneof_index in real_oneofs3
            assert f2.HasField("oneof_index") == in_oneof3, where


def test_the_c_code_table_is_rpc_protos():
    """<vramd/client.h>'s enum vramd_code names every code of rpc.proto's Code enum, with its number."""
    from vramd.pb import rpc_pb2 as rpc
    header = (SRC / "include" / "vramd" / "client.h").read_text()
    c_codes = {m[1]: int(m[2]) for m in re.finditer(r"VRAMD_CODE_([A-Z_]+) = (-?\d+),", header)}
    c_codes.pop("LOCAL")
    assert c_codes == dict(rpc.Code.items())
    names = (SRC / "src" / "base.c").read_text()
    for name, _ in rpc.Code.items():
        assert f'{{VRAMD_CODE_{name}, "{name}",' in names, f"base.c names no {name}"

