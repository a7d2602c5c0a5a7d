"""The patched amdgpu plugin (contrib/criu) and what lets it use vramd, inside a real CRIU on the KFD and
SDMA models (as test_kfd_vramd_plugin.py, whose fixtures these tests share): a daemon that does not let
criu's uid in (the stock path with one line, or a failed dump where KFD_VRAMD=1 requires vramd), and a
restore slower than the daemon's grace period (the submits' hold).  THIS RUNS ON MODELS, NOT A GPU."""
from __future__ import annotations

import contextlib
import grp
import os
import pwd
import re
import shutil
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import test_kfd_vramd_plugin as base
from test_kfd_stock_plugin import DUMP, MIB, RESTORE, TOPO_A
from test_kfd_vramd_plugin import PAGES, WAIT_FOR_GO, _ok, running_daemon
from test_unprivileged import DAEMON_USER, GROUP, ensure_users

from vramd.testing import DaemonProcess, PythonAccess, RunAs

# test_kfd_vramd_plugin.py's skip condition and fixtures (the series applied and built once per module)
pytestmark = base.pytestmark
plugins, model, case = base.plugins, base.model, base.case

REFUSED = re.compile(r"vramd: uid 0 may not use the daemon at (\S+) \((.*) \[(\w+)\]\): dumping the BO contents to "
                     r"amdgpu-pages files")


@contextlib.contextmanager
def refusing_daemon():
    """vramd running as its own user (as vramd.service runs it), whose allowed_uids and allowed_groups let
    nobody else in: root, criu's uid, is refused at its greeting (PERMISSION_DENIED)."""
    ensure_users()
    access = PythonAccess.choose([DAEMON_USER])
    run = tempfile.mkdtemp(prefix="vramd-kr", dir="/tmp")  # short: sun_path is 108 bytes
    try:
        os.chmod(run, 0o750)
        os.chown(run, pwd.getpwnam(DAEMON_USER).pw_uid, grp.getgrnam(GROUP).gr_gid)
        cfg = os.path.join(run, "vramd.toml")
        with open(cfg, "w") as f:
            f.write("allowed_uids = []\nallowed_groups = []\n")
        os.chmod(cfg, 0o644)
        with DaemonProcess(run, "--config", cfg, "--staging-budget", "64M",
                           run_as=RunAs.user(DAEMON_USER, access, group=GROUP, cwd=run)) as d:
            yield d
    finally:
        shutil.rmtree(run, ignore_errors=True)


def test_a_daemon_refusing_criu_dumps_the_stock_files_unless_kfd_vramd_1_requires_it(case, plugins, tmp_path):
    """The daemon answers but does not let uid 0 in: the dump takes the stock path (the amdgpu-pages
    files), saying why in one line, and the restore from them is byte-exact.  With KFD_VRAMD=1 the
    same dump fails instead, in a line naming the socket and group vramd, and the process runs on; so
    does a dump with KFD_VRAMD=1 and no daemon at all, naming the socket and the unit."""
    case.use(plugins["vramd"])
    a = case.state("state-a", TOPO_A)
    with refusing_daemon() as daemon:
        d = case.run(DUMP, a, TOPO_A, extra=case.env(daemon.socket))
        log = case.log("dump.log")
        assert d["dump"] == "0", log[-3000:]
        _ok(d["checks"], 1)
        assert case.vramd_dirs() == [] and len([n for n in case.img() if PAGES.match(n)]) == 2, case.img()
        lines = [m for m in map(REFUSED.search, log.splitlines()) if m]
        assert len(lines) == 1, log[-3000:]
        assert lines[0].group(1) == daemon.socket and lines[0].group(3) == "PERMISSION_DENIED", lines[0].group(0)
        assert lines[0].group(2) == "uid 0 (gid 0) is not allowed to use vramd", lines[0].group(0)
        daemon.expect_log(r"uid 0 \(gid 0\) is not allowed to use vramd")
        r = case.run(RESTORE, a, TOPO_A, extra=case.env(daemon.socket))
        assert r["restore"] == "0", case.log("restore.log")[-3000:]
        _ok(r["checks"], 1)

        d = case.run(DUMP, a, TOPO_A, extra=case.env(daemon.socket, KFD_VRAMD="1"))
        log = case.log("dump.log")
        assert d["dump"] != "0" and d["alive"] == "yes", log[-3000:]
        _ok(d["checks"], 2)  # before the dump, and after it: intact
        line = f"vramd: KFD_VRAMD=1 but uid 0 may not use the daemon at {daemon.socket} ("
        assert line in log and "add it to group vramd (the socket's group) or to the daemon's allowed_uids" in log
        assert "vramd: process unpaused after the failed dump" in log and not REFUSED.search(log), log[-3000:]
        assert case.vramd_dirs() == []

    sock = str(tmp_path / "none" / "vramd.sock")
    d = case.run(DUMP, a, TOPO_A, extra=case.env(sock, KFD_VRAMD="1"))
    log = case.log("dump.log")
    assert d["dump"] != "0" and d["alive"] == "yes", log[-3000:]
    _ok(d["checks"], 2)
    assert f"vramd: KFD_VRAMD=1 but no daemon at {sock} (" in log, log[-3000:]
    assert "start it (systemctl start vramd.socket) or set VRAMD_SOCKET" in log
    assert "vramd: no daemon at" not in log and case.vramd_dirs() == []


def test_a_restore_slower_than_the_grace_period_is_held_and_succeeds(case, plugins):
    """The same two-process restore with a grace period of 0 and the daemon's max_hold at its default: each
    restored task's submit asked for a hold, so CRIU, held in its post-restore action script until the daemon
    has logged that nobody holds either session (a reap, without the hold), still finds both at its barrier:
    criu restore succeeds and both processes check out byte-exact."""
    case.use(plugins["vramd"])
    a = case.state("state-a", TOPO_A)
    tree = DUMP.replace("-g $GPUS", "-g $GPUS -c")
    script = os.path.join(case.work, "wait-for-go.sh")
    with open(script, "w") as f:
        f.write(WAIT_FOR_GO)
    os.chmod(script, 0o755)
    restore = RESTORE.replace("--shell-job -d", f"--shell-job -d --action-script {script}")
    expect = f"ok 14 {2 * MIB << 20}; child ok 10 {2 * 4 << 20}\n"
    with running_daemon(grace="0") as d, ThreadPoolExecutor(1) as ex:
        env = case.env(d.socket)
        assert case.run(tree, a, TOPO_A, gpus=2, extra=env)["dump"] == "0", case.log("dump.log")[-3000:]
        run = ex.submit(case.run, restore, a, TOPO_A, extra=env)
        for _ in range(2):  # both tasks submitted and hung up: the daemon keeps each for its hold
            d.expect_log(r"session \d+: no connection holds it; kept 3600 s for its token \(hold\)", timeout=120)
        with open(os.path.join(case.work, "go"), "w"):
            pass
        r = run.result(timeout=300)
        daemon_log = "".join(d.log)
    log = case.log("restore.log")
    assert r["restore"] == "0" and r["checks"] == expect, log[-3000:]
    done = set(re.findall(r"amdgpu_plugin: vramd: restore of task (\d+) done\n", log))
    assert len(done) == 2 and "killing task" not in log, log[-3000:]
    assert "grace period over" not in daemon_log and "hold over" not in daemon_log
    assert case.model.counters(a)["calls"]["resume"] == 2
