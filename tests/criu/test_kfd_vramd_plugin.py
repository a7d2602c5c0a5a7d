"""CRIU's amdgpu plugin with vramd's patch series (contrib/criu) applied, dumping and restoring an
emulated GPU process on the KFD model + SDMA model inside a real CRIU, the BO contents moved by a
running vramd (its SDMA backend on the SDMA model).  THIS RUNS ON MODELS, NOT A GPU.

Skipped unless CRIU_SRC / CRIU_BIN are set and we are root (as test_kfd_stock_plugin.py), and
libvramd is built (VRAMD_CLIENT_INC / VRAMD_CLIENT_LIBDIR, by default this checkout's
build/libvramd).  CRIU_SRC is never changed: the series is applied to a copy of it, and the
plugin built there as CRIU's own Makefile builds it (-Wall -Werror), against our libvramd found
by pkg-config (the uninstalled vramd.pc meson writes into build/libvramd/meson-uninstalled).
"""
from __future__ import annotations

import contextlib
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from criu_harness import Env
from kfd_harness import FIXTURES, REPO, Model
from test_kfd_stock_plugin import DUMP, MIB, RESTORE, TOPO_A, Case

ENV = Env()
pytestmark = pytest.mark.skipif(
    ENV.missing() is not None or not ENV.has_libvramd() or not shutil.which("unshare"),
    reason=ENV.missing() or ("needs libvramd (VRAMD_CLIENT_INC, VRAMD_CLIENT_LIBDIR)" if not ENV.has_libvramd()
                             else "needs unshare(1)"))
SERIES = REPO / "contrib" / "criu"
PAGES = re.compile(r"^amdgpu-pages-\d+-[0-9a-f]{4}\.img$")


def series() -> list[str]:
    with open(SERIES / "series") as f:
        return [str(SERIES / ln.strip()) for ln in f if ln.strip() and not ln.startswith("#")]


def _run(args: list[str], **kw) -> str:
    r = subprocess.run(args, capture_output=True, text=True, **kw)
    if r.returncode:
        raise RuntimeError(f"{' '.join(args)} failed ({r.returncode}):\n{r.stdout}{r.stderr}")
    return r.stdout + r.stderr


def _needed(so: str) -> list[str]:
    return re.findall(r"\(NEEDED\)\s+Shared library: \[([^\]]+)\]", _run(["readelf", "-d", so]))


@pytest.fixture(scope="module")
def plugins(tmp_path_factory) -> dict[str, str]:
    """The series applied to a copy of CRIU_SRC (`git apply --check` first), the plugin built
    there without libvramd (VRAMD=no) and with it; {"stock", "novramd", "vramd"} -> .so."""
    src = str(tmp_path_factory.mktemp("criu-src") / "criu")
    _run(["cp", "-a", ENV.criu_src or "", src])
    for patch in series():
        _run(["git", "apply", "--check", patch], cwd=src)
        _run(["git", "apply", patch], cwd=src)
    so = os.path.join(src, "plugins", "amdgpu", "amdgpu_plugin.so")
    out = str(tmp_path_factory.mktemp("plugins"))
    env = {**os.environ, "PKG_CONFIG_PATH": os.path.join(ENV.vramd_libdir or "", "meson-uninstalled")}
    built = {"stock": os.path.join(ENV.criu_src or "", "plugins", "amdgpu", "amdgpu_plugin.so")}
    for name, args in (("novramd", ["VRAMD=no"]), ("vramd", [])):
        if os.path.exists(so):
            os.unlink(so)
        log = _run(["make", "-C", src, "amdgpu_plugin", *args], env=env)
        cc = [ln for ln in log.splitlines() if " amdgpu_plugin_vramd.c " in ln]
        assert len(cc) == 1 and "-Wall -Werror" in cc[0], log
        assert ("-DHAVE_VRAMD" in cc[0]) == (name == "vramd"), cc[0]
        built[name] = os.path.join(out, name, "amdgpu_plugin.so")
        os.makedirs(os.path.dirname(built[name]))
        shutil.copy(so, built[name])
    assert "libvramd.so.1" in _needed(built["vramd"])
    assert "libvramd.so.1" not in _needed(built["novramd"])
    return built


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return Model(str(tmp_path_factory.mktemp("kfd-build")))


@contextlib.contextmanager
def running_daemon(grace: str = "60", settings: str = "", **env: str):
    """A running vramd, its SDMA backend on the SDMA model (any GPU id: the model's device); `settings`: more
    lines of its configuration file."""
    from vramd.testing import DaemonProcess

    run_dir = tempfile.mkdtemp(prefix="vramd-kv", dir="/tmp")  # short: sun_path is 108 bytes
    cfg = os.path.join(run_dir, "gpus.toml")  # not the host's KFD topology: the fixture's GPU ids, on the model
    with open(cfg, "w") as f:
        f.write(f'topology_root = "{run_dir}/no-topology"\ngpu_ids = [0x5d21, 0xa3f0]\n{settings}')
    try:
        with DaemonProcess(run_dir, "--grace-period", grace, "--config", cfg,
                           env={"VRAMD_AMDGPU_LIBRARY": "model", **env}) as d:
            yield d
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)


@pytest.fixture
def daemon():
    with running_daemon() as d:
        yield d


class VCase(Case):
    """A Case whose criu loads the plugin it is told to (the stock one by default)."""

    def use(self, so: str) -> None:
        shutil.copy(so, os.path.join(self.work, "plugins", "amdgpu_plugin.so"))

    def img(self) -> list[str]:
        return sorted(os.listdir(os.path.join(self.work, "img")))

    def vramd_dirs(self) -> list[str]:
        return [n for n in self.img() if n.startswith("amdgpu-vramd-")]

    def env(self, socket_path: str, **extra: str) -> dict[str, str]:
        """The plugin's settings: the daemon's socket, libvramd beside the SDMA model's libdrm."""
        return {"VRAMD_SOCKET": socket_path, "LD_LIBRARY_PATH": f"{self.model.libdrm_dir}:{ENV.vramd_libdir}",
                **extra}

    def ready_pid(self) -> int:
        with open(os.path.join(self.work, "ready")) as f:
            return int(f.read().split()[1])


@pytest.fixture
def case(model, tmp_path):
    return VCase(model, str(tmp_path))


def _vramctl_verify(path: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "vramd.cli", "verify", path], capture_output=True, text=True,
                          cwd=str(REPO))


def _ok(checks: str, n: int, bos: int = 7, nbytes: int = MIB << 20) -> None:
    lines = checks.splitlines()
    assert len(lines) == n and all(line == f"ok {bos} {nbytes}" for line in lines), checks


@pytest.mark.parametrize("gpus", [1, 2])
def test_vramd_dump_and_restore_byte_exact(case, plugins, daemon, gpus):
    """One process, its VRAM/GTT BOs on `gpus` GPUs: the patched plugin dumps them through vramd into
    amdgpu-vramd-<id>/ (no amdgpu-pages files; the metadata still in amdgpu-kfd-<id>.img), vramctl
    verify passes on that image, and the restore (the task submits, CRIU main waits) is byte-exact
    by the workload's own check.  With 2 GPUs the stock plugin's own restore leaves one GPU's BOs
    unfilled (test_kfd_stock_plugin.py); through vramd every byte comes back."""
    case.use(plugins["vramd"])
    a = case.state("state-a", TOPO_A)
    env = case.env(daemon.socket)
    d = case.run(DUMP, a, TOPO_A, gpus=gpus, extra=env)
    log = case.log("dump.log")
    assert d["dump"] == "0", log[-3000:]
    _ok(d["checks"], 1, 7 * gpus, gpus * MIB << 20)
    (vdir,) = case.vramd_dirs()
    kfd_id = vdir[len("amdgpu-vramd-"):]
    assert f"amdgpu-kfd-{kfd_id}.img" in case.img()
    assert not [n for n in case.img() if PAGES.match(n)], case.img()
    assert f"amdgpu_plugin: vramd: {6 * gpus} BOs dumped into {vdir}/" in log
    assert "no daemon" not in log
    v = _vramctl_verify(os.path.join(case.work, "img", vdir))
    assert v.returncode == 0, v.stdout + v.stderr
    r = case.run(RESTORE, a, TOPO_A, extra=env)
    log = case.log("restore.log")
    assert r["restore"] == "0", log[-3000:]
    _ok(r["checks"], 1, 7 * gpus, gpus * MIB << 20)
    pid = case.ready_pid()
    assert f"{pid}: amdgpu_plugin: vramd: {6 * gpus} BOs submitted from {vdir}/" in log
    assert f"amdgpu_plugin: vramd: restore of task {pid} done" in log
    assert "Begin to send parallel restore cmd" not in log and "Unable to read file" not in log
    c = case.model.counters(a)
    assert (c["calls"]["checkpoint"], c["calls"]["unpause"], c["calls"]["restore"], c["calls"]["resume"]) == \
        (1, 1, 1, 1)


def test_no_daemon_at_dump_falls_back_to_the_stock_files_and_the_stock_plugin_restores_them(case, plugins,
                                                                                             tmp_path):
    """No daemon listens at VRAMD_SOCKET: the patched plugin says so in one line and writes the
    stock amdgpu-pages files; CRIU's unmodified plugin restores them byte-exact."""
    case.use(plugins["vramd"])
    a = case.state("state-a", TOPO_A)
    sock = str(tmp_path / "none" / "vramd.sock")
    d = case.run(DUMP, a, TOPO_A, extra=case.env(sock))
    log = case.log("dump.log")
    assert d["dump"] == "0", log[-3000:]
    _ok(d["checks"], 1)
    assert case.vramd_dirs() == []
    assert len([n for n in case.img() if PAGES.match(n)]) == 2, case.img()  # one per GPU of the topology
    lines = [ln for ln in log.splitlines() if "vramd: no daemon" in ln]
    assert len(lines) == 1 and f"no daemon at {sock}" in lines[0] and "amdgpu-pages" in lines[0], lines
    case.use(plugins["stock"])
    r = case.run(RESTORE, a, TOPO_A)
    assert r["restore"] == "0", case.log("restore.log")[-3000:]
    _ok(r["checks"], 1)


def test_kfd_vramd_0_dumps_the_stock_files_with_a_daemon_running(case, plugins, daemon):
    case.use(plugins["vramd"])
    a = case.state("state-a", TOPO_A)
    d = case.run(DUMP, a, TOPO_A, extra=case.env(daemon.socket, KFD_VRAMD="0"))
    log = case.log("dump.log")
    assert d["dump"] == "0", log[-3000:]
    assert case.vramd_dirs() == [] and len([n for n in case.img() if PAGES.match(n)]) == 2
    assert "param: KFD_VRAMD:N" in log and "vramd: no daemon" not in log
    r = case.run(RESTORE, a, TOPO_A, extra=case.env(daemon.socket))
    assert r["restore"] == "0", case.log("restore.log")[-3000:]
    _ok(r["checks"], 1)


def test_a_vramd_image_without_a_daemon_fails_the_restore_naming_the_socket_and_the_unit(case, plugins, daemon,
                                                                                          tmp_path):
    case.use(plugins["vramd"])
    a = case.state("state-a", TOPO_A)
    d = case.run(DUMP, a, TOPO_A, extra=case.env(daemon.socket))
    assert d["dump"] == "0", case.log("dump.log")[-3000:]
    (vdir,) = case.vramd_dirs()
    sock = str(tmp_path / "none" / "vramd.sock")
    r = case.run(RESTORE, a, TOPO_A, extra=case.env(sock))
    log = case.log("restore.log")
    assert r["restore"] != "0" and r["alive"] == "no", log[-3000:]
    assert (f"vramd: {vdir}/ is a vramd image and no vramd daemon listens at {sock}" in log
            and "systemctl start vramd.socket" in log), log[-3000:]
    # a plugin built without libvramd refuses it too, saying why
    case.use(plugins["novramd"])
    r = case.run(RESTORE, a, TOPO_A, extra=case.env(daemon.socket))
    log = case.log("restore.log")
    assert r["restore"] != "0" and r["alive"] == "no"
    assert f"vramd: the BO contents are a vramd image ({vdir}/), but this amdgpu_plugin was built without " \
           "libvramd" in log, log[-3000:]


def test_two_process_tree_restored_through_vramd_byte_exact(case, plugins, daemon):
    """A parent and a child, each its own KFD process with BOs on both GPUs: the stock plugin
    switches its offloaded restore off for such a tree; here each restored task submits its own
    copy to vramd and CRIU main waits for both before RESUME."""
    case.use(plugins["vramd"])
    a = case.state("state-a", TOPO_A)
    env = case.env(daemon.socket)
    expect = f"ok 14 {2 * MIB << 20}; child ok 10 {2 * 4 << 20}\n"
    d = case.run(DUMP.replace("-g $GPUS", "-g $GPUS -c"), a, TOPO_A, gpus=2, extra=env)
    assert d["dump"] == "0", case.log("dump.log")[-3000:]
    assert d["checks"] == expect
    assert len(case.vramd_dirs()) == 2, case.img()
    for vdir in case.vramd_dirs():
        v = _vramctl_verify(os.path.join(case.work, "img", vdir))
        assert v.returncode == 0, v.stdout + v.stderr
    r = case.run(RESTORE, a, TOPO_A, extra=env)
    log = case.log("restore.log")
    assert r["restore"] == "0", log[-3000:]
    assert r["checks"] == expect
    done = set(re.findall(r"amdgpu_plugin: vramd: restore of task (\d+) done\n", log))
    submitted = re.findall(r" (\d+): amdgpu_plugin: vramd: (\d+) BOs submitted from amdgpu-vramd-\d+/\n", log)
    assert sorted(n for _, n in submitted) == ["12", "8"] and done == {p for p, _ in submitted}, log[-3000:]
    assert str(case.ready_pid()) in done
    assert case.model.counters(a)["calls"]["resume"] == 2


KILL_DAEMON = r'''
[ "$CRTOOLS_SCRIPT_ACTION" = post-restore ] || exit 0
echo "post-restore: killing vramd $VRAMD_PID" >> $WORK/action.log
kill -KILL $VRAMD_PID
'''


def test_daemon_sigkilled_mid_restore_fails_the_restore_with_no_task_left(case, plugins, daemon):
    """vramd is SIGKILLed after every restored task has submitted its copy and before CRIU main's
    barrier (CRIU's post-restore action script): the barrier fails, the plugin kills the task in
    RESUME_DEVICES_LATE (CRIU only debug-logs that hook's errors), and criu restore exits non-zero
    with no task of the tree left."""
    case.use(plugins["vramd"])
    a = case.state("state-a", TOPO_A)
    env = case.env(daemon.socket)
    d = case.run(DUMP.replace("-g $GPUS", "-g $GPUS -c"), a, TOPO_A, gpus=2, extra=env)
    assert d["dump"] == "0", case.log("dump.log")[-3000:]
    script = os.path.join(case.work, "kill-daemon.sh")
    with open(script, "w") as f:
        f.write(KILL_DAEMON)
    os.chmod(script, 0o755)
    restore = RESTORE.replace("--shell-job -d", f"--shell-job -d --action-script {script}")
    r = case.run(restore, a, TOPO_A, extra={**env, "VRAMD_PID": str(daemon.pid)})
    log = case.log("restore.log")
    # the daemon is gone (its exit status is not ours to read: kfd_harness's subreaper may reap it first)
    with socket.socket(socket.AF_UNIX) as s, pytest.raises(ConnectionRefusedError):
        s.connect(daemon.socket)
    assert r["restore"] != "0" and r["alive"] == "no", log[-3000:]
    assert len(re.findall(r"vramd: \d+ BOs submitted from", log)) == 2
    assert "vramd: BO contents not restored: killing task" in log
    failed = re.findall(r"vramd: restore of task (\d+) failed: ", log)
    tasks = re.findall(r" (\d+): amdgpu_plugin: vramd: \d+ BOs submitted from", log)
    assert len(tasks) == 2 and sorted(failed) == sorted(tasks), log[-3000:]
    assert "Restoring FAILED" in log
    assert case.model.counters(a)["calls"]["resume"] == 0
    for pid in map(int, tasks):       # none of the tree runs on: gone, a zombie, or SIGKILL pending
        assert _dead_or_dying(pid), pid


def _dead_or_dying(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status") as f:
            status = dict(ln.split(":\t", 1) for ln in f.read().splitlines() if ":\t" in ln)
    except FileNotFoundError:
        return True
    sigkill = 1 << 8
    return (status["State"][0] in "ZX" or status.get("Name", "").strip() != "kfd_workload"
            or bool(int(status["ShdPnd"], 16) & sigkill) or bool(int(status["SigPnd"], 16) & sigkill))


def test_daemon_sigkilled_mid_dump_fails_the_dump_and_the_process_runs_on_unpaused(case, plugins):
    """vramd is SIGKILLed while it copies the BOs out (its SDMA model slowed down, the kill sent
    once the dumper waits for the session): criu dump fails, no amdgpu-vramd directory or file of
    it is left, the plugin resumes the queues itself (CRIU runs no DUMP_DEVICES_LATE after a
    failed dump) and the process runs on with every byte intact."""
    case.use(plugins["vramd"])
    a = case.state("state-a", TOPO_A)
    with running_daemon(VRAMD_SDMA_MODEL_PACKET_DELAY_US="200000") as slow, ThreadPoolExecutor(1) as ex:
        dump = ex.submit(case.run, DUMP, a, TOPO_A, extra=case.env(slow.socket, KEEP="1"))
        slow.expect_log(r"connection \d+ waits for session \d+", timeout=120)
        slow.proc.kill()
        d = dump.result(timeout=300)
    pid = int(d["pid"])
    try:
        log = case.log("dump.log")
        assert d["dump"] != "0" and d["alive"] == "yes", log[-3000:]
        _ok(d["checks"], 2)                              # before, and after the failed dump
        assert re.search(r"vramd: dump into amdgpu-vramd-\d+/ failed: ", log), log[-3000:]
        assert "vramd: process unpaused after the failed dump" in log
        assert case.vramd_dirs() == [] and not [n for n in case.img() if "vrdm" in n or n.startswith("amdgpu-p")]
        assert case.model.paused(a, pid) == 0
    finally:
        os.kill(pid, 15)


TOPO_B = str(FIXTURES / "2gpu-mi100-xgmi-host2")


def test_restore_onto_another_host_remaps_gpus_and_vramd_fills_the_bos(case, plugins, daemon):
    """Dumped on host A (gpu_ids 0x5D21/0xA3F0), restored on host B (0x77C4/0x1B09): the plugin's
    own topology match picks B's GPUs, vramd fills the BOs the RESTORE ioctl made there."""
    case.use(plugins["vramd"])
    a, b = case.state("state-a", TOPO_A), case.state("state-b", TOPO_B)
    env = case.env(daemon.socket)
    d = case.run(DUMP, a, TOPO_A, extra=env)
    assert d["dump"] == "0", case.log("dump.log")[-3000:]
    r = case.run(RESTORE, b, TOPO_B, extra=env)
    log = case.log("restore.log")
    assert r["restore"] == "0", log[-3000:]
    _ok(r["checks"], 1)
    assert "GPU: 0x5D21 -> 0x" in log and "GPU: 0x5D21 -> 0x5D21" not in log
    assert re.search(r"amdgpu_plugin: vramd: restore of task \d+ done", log)
    assert case.model.counters(b)["calls"]["restore"] == 1 and case.model.counters(a)["calls"]["restore"] == 0


def test_a_flipped_image_byte_fails_the_restore_naming_the_bo_and_offset(case, plugins, daemon):
    """One byte of the vramd image's data file flipped: the copy fails, the log names the BO and
    the offset, and criu restore fails with no task left (the flip is not reported as success)."""
    case.use(plugins["vramd"])
    a = case.state("state-a", TOPO_A)
    env = case.env(daemon.socket)
    d = case.run(DUMP, a, TOPO_A, extra=env)
    assert d["dump"] == "0", case.log("dump.log")[-3000:]
    (vdir,) = case.vramd_dirs()
    path = os.path.join(case.work, "img", vdir)
    data = max((n for n in os.listdir(path) if n.startswith("data-")),
               key=lambda n: os.path.getsize(os.path.join(path, n)))
    with open(os.path.join(path, data), "r+b") as f:
        size = f.seek(0, os.SEEK_END)
        f.seek(size // 2)
        byte = f.read(1)
        f.seek(size // 2)
        f.write(bytes([byte[0] ^ 0x40]))
    r = case.run(RESTORE, a, TOPO_A, extra=env)
    log = case.log("restore.log")
    assert r["restore"] != "0" and r["alive"] == "no", log[-3000:]
    m = re.search(r"vramd: (restore of task \d+|restore from amdgpu-vramd-\d+/) failed: .*\[(\w+)\] \(BO (\d+) offset "
                  r"(\d+)\)", log)
    assert m, log[-3000:]
    assert m.group(2) == "CORRUPT_CHUNK", m.group(0)
    assert case.model.counters(a)["calls"]["resume"] == 0


# CRIU writes its image files over those of an earlier dump in the same directory; this dump keeps them
AGAIN = DUMP.replace("rm -rf $W/img $W/ready; mkdir -p $W/img", "rm -f $W/ready")


def test_a_stock_path_dump_over_an_earlier_vramd_image_fails_instead_of_leaving_it_to_the_restore(
        case, plugins, daemon, tmp_path):
    """The images directory holds an earlier dump's amdgpu-vramd-<id>/ and this dump takes the stock
    path (KFD_VRAMD=0, no daemon, a plugin built without libvramd): left beside the new
    amdgpu-pages files, that stale image is what the restore would copy the BOs from (the restore
    follows the image directory).  So the dump fails naming the directory, the process runs on
    unpaused with every byte intact, and the earlier image is left as it was."""
    assert AGAIN != DUMP
    case.use(plugins["vramd"])
    a = case.state("state-a", TOPO_A)
    d = case.run(DUMP, a, TOPO_A, extra=case.env(daemon.socket))
    assert d["dump"] == "0", case.log("dump.log")[-3000:]
    (vdir,) = case.vramd_dirs()
    none = str(tmp_path / "none" / "vramd.sock")
    for so, sock, extra, why in (("vramd", daemon.socket, {"KFD_VRAMD": "0"}, "(KFD_VRAMD=0)"),
                                 ("vramd", none, {}, "(no vramd daemon: "),
                                 ("novramd", daemon.socket, {}, "(a plugin built without libvramd)")):
        case.use(plugins[so])
        d = case.run(AGAIN, a, TOPO_A, extra=case.env(sock, KEEP="1", **extra))
        pid = int(d["pid"])
        try:
            log = case.log("dump.log")
            assert d["dump"] != "0" and d["alive"] == "yes", (so, extra, log[-3000:])
            _ok(d["checks"], 2)
            assert f"vramd: {vdir}/ holds an earlier dump's vramd image and this dump writes amdgpu-pages " \
                   f"files {why}" in log, log[-3000:]
            assert "vramd: process unpaused after the failed dump" in log
            assert case.model.paused(a, pid) == 0
        finally:
            with contextlib.suppress(ProcessLookupError):   # a dump that succeeded ended it
                os.kill(pid, 15)
        assert case.vramd_dirs() == [vdir]
        v = _vramctl_verify(os.path.join(case.work, "img", vdir))
        assert v.returncode == 0, v.stdout + v.stderr


STREAMER = str(REPO / "tests" / "criu" / "img_streamer.py")


def _streamed(script: str, verb: str, mode: str) -> str:
    """The script with `criu VERB --stream`, its image streamer (img_streamer.py) started first and waited
    for after criu (it writes the files of the stream in threads of its own, until criu hangs up)."""
    start = (f"$PY {STREAMER} {mode} $W/img $W/stream > $W/streamer-{mode}.log 2>&1 &\nspid=$!\n"
             "wait_for $W/img/streamer.ready || exit 1\nrm -f $W/img/streamer.ready\n")
    out = script.replace(f"$CRIU {verb} ", f"{start}$CRIU {verb} --stream ")
    out = out.replace(f'echo "{verb}: $?"', f'rc=$?; wait $spid; echo "{verb}: $rc"')
    assert out.count("--stream") == 1 and "wait $spid" in out
    return out


def test_a_streamed_dump_puts_the_bo_contents_into_the_stream_and_restores_from_it(case, plugins, daemon):
    """criu dump --stream sends every image file through the image streamer, the stock plugin's
    amdgpu-pages files too.  A vramd image is a directory beside the stream, not in it: a streamed
    checkpoint taken through vramd would reach the other side without its BO contents.  Under
    --stream the patched plugin takes the stock path (one log line per KFD file), even with a
    daemon running, and what reached the stream restores byte-exact; with KFD_VRAMD=1 (vramd
    required) the streamed dump fails instead, naming --stream, and the process runs on, as does a
    dump by a plugin built without libvramd."""
    case.use(plugins["vramd"])
    a = case.state("state-a", TOPO_A)
    env = {**case.env(daemon.socket), "PY": sys.executable}
    d = case.run(_streamed(DUMP, "dump", "capture"), a, TOPO_A, extra=env)
    log = case.log("dump.log")
    assert d["dump"] == "0", log[-3000:]
    _ok(d["checks"], 1)
    assert case.vramd_dirs() == [], case.img()
    stream = os.listdir(os.path.join(case.work, "stream"))
    assert len([n for n in stream if PAGES.match(n)]) == 2 and not [n for n in case.img() if PAGES.match(n)], stream
    lines = [ln for ln in log.splitlines() if "vramd: --stream" in ln]
    assert len(lines) == 1 and "amdgpu-pages files" in lines[0], lines
    # what reached the stream is the whole checkpoint: restored from it alone (not through a
    # streamer: the stock plugin's own restore from a stream dies here, vramd or not) it is byte-exact
    img = os.path.join(case.work, "img")
    os.rename(img, img + "-dump")
    shutil.copytree(os.path.join(case.work, "stream"), img)
    r = case.run(RESTORE, a, TOPO_A, extra=env)
    log = case.log("restore.log")
    assert r["restore"] == "0", log[-3000:]
    _ok(r["checks"], 1)
    assert "BOs submitted" not in log, log[-3000:]
    # KFD_VRAMD=1 requires vramd, which a streamed dump cannot use: it fails saying so, the process runs on
    d = case.run(_streamed(DUMP, "dump", "capture"), a, TOPO_A, extra={**env, "KFD_VRAMD": "1"})
    log = case.log("dump.log")
    assert d["dump"] != "0" and d["alive"] == "yes", log[-3000:]
    _ok(d["checks"], 2)  # before the dump, and after it: intact
    assert "param: KFD_VRAMD:required" in log and "vramd: KFD_VRAMD=1 but --stream: " in log, log[-3000:]
    assert "vramd: process unpaused after the failed dump" in log and "vramd: --stream: dumping" not in log
    # so does a dump by a plugin built without libvramd
    case.use(plugins["novramd"])
    d = case.run(DUMP, a, TOPO_A, extra=case.env(daemon.socket, KFD_VRAMD="1"))
    log = case.log("dump.log")
    assert d["dump"] != "0" and d["alive"] == "yes", log[-3000:]
    _ok(d["checks"], 2)
    assert "vramd: KFD_VRAMD=1 but this amdgpu_plugin was built without libvramd" in log, log[-3000:]



def test_one_task_of_a_tree_failing_its_submit_fails_the_restore_with_no_task_left(case, plugins, daemon):
    """The two-process tree, one task's vramd image damaged (a manifest byte flipped): that task's
    RESTORE_EXT_FILE fails naming its directory, CRIU kills the whole tree, whichever task had
    submitted its copy already, and criu restore exits non-zero."""
    case.use(plugins["vramd"])
    a = case.state("state-a", TOPO_A)
    env = case.env(daemon.socket)
    d = case.run(DUMP.replace("-g $GPUS", "-g $GPUS -c"), a, TOPO_A, gpus=2, extra=env)
    assert d["dump"] == "0", case.log("dump.log")[-3000:]
    bad = case.vramd_dirs()[-1]
    manifest = os.path.join(case.work, "img", bad, "manifest.vrdm")
    with open(manifest, "r+b") as f:
        size = f.seek(0, os.SEEK_END)
        f.seek(size // 2)
        byte = f.read(1)
        f.seek(size // 2)
        f.write(bytes([byte[0] ^ 0x01]))
    r = case.run(RESTORE, a, TOPO_A, extra=env)
    log = case.log("restore.log")
    assert r["restore"] != "0" and r["alive"] == "no", log[-3000:]
    assert re.search(rf"vramd: restore from {bad}/ failed: ", log), log[-3000:]
    assert "Restoring FAILED" in log and "vramd: BO contents not restored" not in log
    assert f"BOs submitted from {bad}/" not in log
    for pid in map(int, re.findall(r" (\d+): amdgpu_plugin: vramd: \d+ BOs submitted from", log)):
        assert _dead_or_dying(pid), pid
    assert case.model.counters(a)["calls"]["resume"] == 0


def test_a_tree_whose_second_dump_fails_runs_on_with_every_process_unpaused(case, plugins, daemon):
    """The two-process tree, the second KFD process's vramd dump failing (its amdgpu-vramd-<id>
    taken by a plain file) after the first one's succeeded: criu dump fails, and CRIU runs no
    DUMP_DEVICES_LATE, which is where the plugin resumes the dumped processes' queues.  Both
    processes run on unpaused, every byte intact: the failing one resumed at its failure, the one
    dumped before it when the plugin finishes (fini)."""
    case.use(plugins["vramd"])
    a = case.state("state-a", TOPO_A)
    env = case.env(daemon.socket)
    tree = DUMP.replace("-g $GPUS", "-g $GPUS -c")
    d = case.run(tree, a, TOPO_A, gpus=2, extra=env)
    log = case.log("dump.log")
    assert d["dump"] == "0", log[-3000:]
    first, second = re.findall(r"vramd: \d+ BOs dumped into (amdgpu-vramd-\d+)/", log)
    block = tree.replace("mkdir -p $W/img\n", "mkdir -p $W/img; : > $W/img/$BLOCK\n")
    assert block != tree
    d = case.run(block, a, TOPO_A, gpus=2, extra={**env, "KEEP": "1", "BLOCK": second})
    pid = int(d["pid"])
    try:
        log = case.log("dump.log")
        assert d["dump"] != "0" and d["alive"] == "yes", log[-3000:]
        assert log.index(f"BOs started into {first}/") < log.index(f"vramd: cannot open {second}"), log[-3000:]
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            (child,) = map(int, f.read().split())
        assert (case.model.paused(a, pid), case.model.paused(a, child)) == (0, 0)
        assert d["checks"] == f"ok 14 {2 * MIB << 20}; child ok 10 {2 * 4 << 20}\n" * 2
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, 15)


def _restore_sessions(sock: str) -> int:
    out = subprocess.run([sys.executable, "-m", "vramd.cli", "sessions", "--json", "--all", "--socket", sock],
                         capture_output=True, text=True, cwd=str(REPO), check=True).stdout
    return out.count('"restore"')


def _until(cond, timeout: float = 60.0) -> None:
    """Poll a condition on real state (bounded), not a fixed wait."""
    import time

    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.1)


WAIT_FOR_GO = r'''
[ "$CRTOOLS_SCRIPT_ACTION" = post-restore ] || exit 0
for _ in $(seq 1200); do [ -e $WORK/go ] && exit 0; sleep 0.05; done
exit 0
'''


def test_a_restore_slower_than_the_grace_period_fails_with_no_task_left(case, plugins):
    """CRIU takes longer from the tasks' submits to its barrier than the daemon's grace_period (1 s
    here; CRIU held in its post-restore action script until the daemon has reaped both sessions), and
    the daemon grants no hold (max_hold = 0): the barrier finds no session, and criu restore fails
    with no task left, never resuming tasks whose BOs nobody filled (docs/criu-integration.md,
    "The grace period and the hold")."""
    case.use(plugins["vramd"])
    a = case.state("state-a", TOPO_A)
    tree = DUMP.replace("-g $GPUS", "-g $GPUS -c")
    script = os.path.join(case.work, "wait-for-go.sh")
    with open(script, "w") as f:
        f.write(WAIT_FOR_GO)
    os.chmod(script, 0o755)
    restore = RESTORE.replace("--shell-job -d", f"--shell-job -d --action-script {script}")
    with running_daemon(grace="1", settings="max_hold = 0\n") as d, ThreadPoolExecutor(1) as ex:
        env = case.env(d.socket)
        assert case.run(tree, a, TOPO_A, gpus=2, extra=env)["dump"] == "0", case.log("dump.log")[-3000:]
        run = ex.submit(case.run, restore, a, TOPO_A, extra=env)
        for _ in range(2):  # both tasks submitted (a count of 2 may never be seen: the first may be reaped first)
            d.expect_log(r"session \d+ \(restore\) opened by uid 0", timeout=120)
        _until(lambda: _restore_sessions(d.socket) == 0)     # and the daemon reaped both
        with open(os.path.join(case.work, "go"), "w"):
            pass
        r = run.result(timeout=300)
    log = case.log("restore.log")
    assert r["restore"] != "0" and r["alive"] == "no", log[-3000:]
    failed = re.findall(r"vramd: restore of task (\d+) failed: .*\[(\w+)\]", log)
    tasks = re.findall(r" (\d+): amdgpu_plugin: vramd: \d+ BOs submitted from", log)
    assert len(tasks) == 2 and sorted(p for p, _ in failed) == sorted(tasks), log[-3000:]
    assert {code for _, code in failed} == {"NOT_FOUND"}, failed
    assert "vramd: BO contents not restored: killing task" in log and "Restoring FAILED" in log
    assert case.model.counters(a)["calls"]["resume"] == 0
    for pid in map(int, tasks):
        assert _dead_or_dying(pid), pid


FAIL_POST_RESTORE = r'''
[ "$CRTOOLS_SCRIPT_ACTION" = post-restore ] || exit 0
exit 1
'''


def test_a_restore_failing_after_the_submits_cancels_their_copies(case, plugins, daemon):
    """The two-process tree: both restored tasks submit their copies (each session asking the daemon to hold
    it for CRIU main's barrier), then CRIU fails the restore before that barrier (its post-restore action
    script fails).  The plugin's fini cancels both copies (patch 0005): the daemon holds neither session for
    a barrier that never comes (an hour, its max_hold), and no task is left."""
    case.use(plugins["vramd"])
    a = case.state("state-a", TOPO_A)
    env = case.env(daemon.socket)
    d = case.run(DUMP.replace("-g $GPUS", "-g $GPUS -c"), a, TOPO_A, gpus=2, extra=env)
    assert d["dump"] == "0", case.log("dump.log")[-3000:]
    script = os.path.join(case.work, "fail-post-restore.sh")
    with open(script, "w") as f:
        f.write(FAIL_POST_RESTORE)
    os.chmod(script, 0o755)
    r = case.run(RESTORE.replace("--shell-job -d", f"--shell-job -d --action-script {script}"), a, TOPO_A,
                 extra=env)
    log = case.log("restore.log")
    assert r["restore"] != "0" and r["alive"] == "no", log[-3000:]
    tasks = re.findall(r" (\d+): amdgpu_plugin: vramd: \d+ BOs submitted from", log)
    cancelled = re.findall(r"vramd: the restore failed: the copy task (\d+) submitted is cancelled", log)
    assert len(tasks) == 2 and sorted(cancelled) == sorted(tasks), log[-3000:]
    assert _restore_sessions(daemon.socket) == 0
    assert case.model.counters(a)["calls"]["resume"] == 0
    for pid in map(int, tasks):
        assert _dead_or_dying(pid), pid
