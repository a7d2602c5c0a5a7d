"""vramd's test plugin inside a real CRIU: which hooks fire where, and a vramd
restore driven through libvramd from CRIU's restore.

Skipped unless CRIU_SRC (a CRIU checkout) and CRIU_BIN (its built criu) are
set and we are root; the vramd restore tests also need libvramd
(VRAMD_CLIENT_INC, VRAMD_CLIENT_LIBDIR).  See tests/criu/README.md.
"""
from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from criu_harness import Env, Rig, build, hooks, make_vramd_image, read_log

ENV = Env()
pytestmark = pytest.mark.skipif(ENV.missing() is not None, reason=ENV.missing() or "")
needs_libvramd = pytest.mark.skipif(
    ENV.missing() is not None or not ENV.has_libvramd(),
    reason=ENV.missing() or "set VRAMD_CLIENT_INC and VRAMD_CLIENT_LIBDIR (libvramd) for this test")


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    return str(tmp_path_factory.mktemp("criu"))


def test_hooks_fire_in_criu_main_in_order(work):
    libdir, workload = build(ENV, os.path.join(work, "build-log-only"), with_vramd=False)
    log = os.path.join(work, "hooks.log")
    rig = Rig.dumped(ENV, work, libdir, workload, 64, log)
    try:
        rig.restore(log)
        assert rig.workload.check() == f"ok {rig.workload.pid}"
    finally:
        rig.workload.kill_restored()

    events = read_log(log)
    assert events[0].what == "init libvramd=no"
    dump = [e for e in events if e.stage == "DUMP"]
    restore = [e for e in events if e.stage == "RESTORE"]
    assert hooks(dump) == ["init", "PAUSE_DEVICES", "CHECKPOINT_DEVICES", "DUMP_DEVICES_LATE", "exit"]
    assert hooks(restore) == ["init", "RESTORE_INIT", "POST_FORKING", "RESUME_DEVICES_LATE", "exit"]
    # every hook ran in the criu process that loaded the plugin, never in the restored task
    assert {e.role for e in events} == {"criu-main"}
    assert len({e.pid for e in restore}) == 1 and rig.workload.pid not in {e.pid for e in events}
    pid = str(rig.workload.pid)
    for e in events:
        if e.what.startswith(("hook=PAUSE_DEVICES", "hook=CHECKPOINT_DEVICES", "hook=RESUME_DEVICES_LATE")):
            assert e.what.endswith(f"target_pid={pid}"), e.what
        if e.what.startswith("hook=DUMP_DEVICES_LATE"):
            assert e.what.endswith(f"id={pid}"), e.what  # criu-dev passes the root task's pid here


@pytest.fixture(scope="module")
def vramd_rig(work):
    """A daemon, a vramd image of memfd BOs (odd sizes included), and a dumped 64 MiB workload."""
    from vramd.testing import DaemonProcess as DaemonProc

    libdir, workload = build(ENV, os.path.join(work, "build-vramd"), with_vramd=True)
    run_dir = os.path.join(work, "run")
    os.makedirs(run_dir)
    with DaemonProc(run_dir, "--grace-period", "5") as d:
        image = make_vramd_image(d.socket, os.path.join(work, "vramd-img"),
                                 [8 << 20, 3 << 20 | 123, 4096, 1, 16 << 20])
        rig = Rig.dumped(ENV, work, libdir, workload, 64, os.path.join(work, "dump.log"))
        yield d, image, rig


@needs_libvramd
@pytest.mark.parametrize("mode,api", [("offload", "client"), ("offload", "criu"), ("sync", "client"),
                                      ("serial", "client"), ("serial", "criu")])
def test_vramd_restore_from_criu_restore(vramd_rig, work, mode, api):
    """client: client.h calls on one held connection; criu: criu.h's submit (hangs up) and barrier."""
    daemon, image, rig = vramd_rig
    log = os.path.join(work, f"restore-{mode}-{api}.log")
    try:
        rig.restore(log, image.plugin_env(daemon.socket, mode, api=api))
        assert rig.workload.check() == f"ok {rig.workload.pid}"
    finally:
        rig.workload.kill_restored()

    events = read_log(log)
    text = "\n".join(e.what for e in events)
    assert "FAIL" not in text, text
    assert hooks(events) == ["init", "RESTORE_INIT", "POST_FORKING", "RESUME_DEVICES_LATE", "exit"]
    waited = [e for e in events if e.what.startswith("vramd: waited in")]
    assert len(waited) == 1
    where = "POST_FORKING" if mode == "sync" else "RESUME_DEVICES_LATE"
    assert waited[0].what.startswith(f"vramd: waited in {where}"), waited[0].what
    assert any(e.what.startswith(f"vramd: verify OK sha256={image.sha256}") for e in events), text


@needs_libvramd
def test_vramd_restore_failure_is_logged(vramd_rig, work):
    """A wrong digest is caught at RESUME_DEVICES_LATE, where CRIU does not fail the restore: only our log says so."""
    daemon, image, rig = vramd_rig
    log = os.path.join(work, "restore-bad.log")
    env = image.plugin_env(daemon.socket, "offload")
    env["VRAMD_CRIU_SHA256"] = "0" * 64
    try:
        rig.restore(log, env)  # criu still exits 0
    finally:
        rig.workload.kill_restored()
    assert any(e.what.startswith("FAIL vramd: digest mismatch") for e in read_log(log))


@needs_libvramd
def test_silent_daemon_fails_the_restore_in_bounded_time(vramd_rig, work):
    """A daemon that accepts but never answers: POST_FORKING fails after VRAMD_CRIU_TIMEOUT_MS and CRIU aborts."""
    import socket
    import time

    _daemon, image, rig = vramd_rig
    path = os.path.join(work, "run", "silent.sock")
    silent = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    silent.bind(path)
    silent.listen(4)
    log = os.path.join(work, "restore-silent.log")
    env = image.plugin_env(path, "offload")
    env["VRAMD_CRIU_TIMEOUT_MS"] = "1000"
    t0 = time.monotonic()
    try:
        with pytest.raises(RuntimeError, match=r"criu restore .* failed"):
            rig.restore(log, env)
    finally:
        rig.workload.kill_restored()
        silent.close()
    assert time.monotonic() - t0 < 30
    events = read_log(log)
    assert any(e.what.startswith("FAIL vramd: connect") for e in events), [e.what for e in events]
    assert "RESUME_DEVICES_LATE" not in hooks(events)
    assert not os.path.exists(f"/proc/{rig.workload.pid}")  # CRIU killed the half-restored task


EXT_DEV = "/dev/loop-control"  # a character device CRIU cannot dump by itself: it goes to the plugins, as /dev/kfd does
needs_ext_dev = pytest.mark.skipif(not os.path.exists(EXT_DEV), reason=f"no {EXT_DEV} to stand in for /dev/kfd")


@needs_ext_dev
def test_ext_file_hooks_run_in_the_dumper_and_in_the_restored_task(work):
    libdir, workload = build(ENV, os.path.join(work, "build-log-only"), with_vramd=False)
    log = os.path.join(work, "hooks-ext.log")
    rig = Rig.dumped(ENV, work, libdir, workload, 16, log, device=EXT_DEV)
    try:
        rig.restore(log)
        pid = rig.workload.pid
        assert rig.workload.check() == f"ok {pid}"
        # the device is back at its number, and nothing of the plugin's was left open in the task
        fds = {fd: os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")}
        assert sorted(fds) == ["0", "1", "2", "3"] and fds["3"] == EXT_DEV, fds
    finally:
        rig.workload.kill_restored()

    events = read_log(log)
    dump = [e for e in events if e.stage == "DUMP"]
    restore = [e for e in events if e.stage == "RESTORE"]
    assert hooks(dump) == ["init", "PAUSE_DEVICES", "CHECKPOINT_DEVICES", "DUMP_EXT_FILE", "DUMP_DEVICES_LATE",
                           "exit"]
    assert {e.role for e in dump} == {"criu-main"}
    assert hooks(restore) == ["init", "RESTORE_INIT", "POST_FORKING", "RESTORE_EXT_FILE", "RESUME_DEVICES_LATE",
                              "exit"]
    ext = [e for e in restore if e.what.startswith("hook=RESTORE_EXT_FILE")]
    main = [e for e in restore if e.role == "criu-main"]
    assert len(ext) == 1 and ext[0].role == "criu-child" and ext[0].pid == pid and ext[0].ppid == main[0].pid
    # in the file (and by CLOCK_REALTIME) after POST_FORKING, before RESUME_DEVICES_LATE
    assert main[2].real <= ext[0].real <= main[3].real


@needs_ext_dev
@needs_libvramd
def test_vramd_restore_submitted_by_the_restored_task(vramd_rig, work):
    """The split a GPU plugin needs: the task submits in RESTORE_EXT_FILE and publishes its ticket in libvramd's
    shared table; CRIU main takes it and waits in RESUME_DEVICES_LATE."""
    daemon, image, _ = vramd_rig
    libdir = os.path.join(work, "build-vramd", "plugins")
    workload = os.path.join(work, "build-vramd", "workload")
    rig = Rig.dumped(ENV, work, libdir, workload, 16, os.path.join(work, "dump-ext.log"), device=EXT_DEV)
    log = os.path.join(work, "restore-task.log")
    try:
        rig.restore(log, image.plugin_env(daemon.socket, "task"))
        pid = rig.workload.pid
        assert rig.workload.check() == f"ok {pid}"
        assert sorted(os.listdir(f"/proc/{pid}/fd")) == ["0", "1", "2", "3"]
    finally:
        rig.workload.kill_restored()
    events = read_log(log)
    text = "\n".join(f"{e.role} {e.what}" for e in events)
    assert "FAIL" not in text, text
    submitted = [e for e in events if e.what.startswith("vramd: restore submitted from the task")]
    assert len(submitted) == 1 and submitted[0].role == "criu-child" and submitted[0].pid == pid, text
    assert f"ticket pid={pid} " in submitted[0].what
    waited = [e for e in events if e.what.startswith("vramd: waited in")]
    assert len(waited) == 1 and waited[0].role == "criu-main" and "RESUME_DEVICES_LATE" in waited[0].what
    assert any(e.what.startswith(f"vramd: verify OK sha256={image.sha256}") for e in events), text


@needs_libvramd
def test_submit_then_barrier_needs_the_grace_period_to_cover_the_gap(vramd_rig, work):
    """Between vramd_criu_restore_submit (which hangs up) and the barrier nobody holds the session: where the
    daemon grants no hold (max_hold 0) and its grace period is shorter than that gap, it reaps the session, the
    barrier fails, and CRIU still exits 0 (RESUME_DEVICES_LATE errors are only debug-logged).  In the real split
    CRIU main has no hook between the task's RESTORE_EXT_FILE and RESUME_DEVICES_LATE: the submit's hold
    (next test) is what covers the rest of the restore."""
    from vramd.testing import DaemonProcess as DaemonProc

    _daemon, image, rig = vramd_rig
    run_dir = os.path.join(work, "run-nograce")
    os.makedirs(run_dir)
    log = os.path.join(work, "restore-nograce.log")
    with DaemonProc(run_dir, "--grace-period", "0", "--max-hold", "0") as d:
        try:
            rig.restore(log, image.plugin_env(d.socket, "offload", api="criu"))
        finally:
            rig.workload.kill_restored()
    fails = [e.what for e in read_log(log) if e.what.startswith("FAIL")]
    # CANCELLED when reaped while copying (seen with grace 0), NOT_FOUND when reaped after it ended (seen with
    # grace 0.3 s and a 1 GiB workload): either way the barrier cannot say the bytes landed
    assert len(fails) == 1 and "vramd_criu_restore_barrier" in fails[0], fails
    assert "CANCELLED" in fails[0] or "NOT_FOUND" in fails[0], fails


@needs_libvramd
def test_the_submits_hold_covers_a_gap_longer_than_the_grace_period(vramd_rig, work):
    """The same gap with a grace period of 0, the daemon's max_hold at its default: vramd_criu_restore_submit asked
    for a hold, the session outlives the task's hang-up (the daemon logs that it keeps it), and CRIU main's barrier
    in RESUME_DEVICES_LATE gets the finished copy: the restored workload checks out byte-exact."""
    from vramd.testing import DaemonProcess as DaemonProc

    _daemon, image, rig = vramd_rig
    run_dir = os.path.join(work, "run-held")
    os.makedirs(run_dir)
    log = os.path.join(work, "restore-held.log")
    with DaemonProc(run_dir, "--grace-period", "0") as d:
        try:
            rig.restore(log, image.plugin_env(d.socket, "offload", api="criu"))
            pid = rig.workload.pid
            assert rig.workload.check() == f"ok {pid}"
        finally:
            rig.workload.kill_restored()
        d.expect_log(r"session \d+: no connection holds it; kept 3600 s for its token \(hold\)")
    events = read_log(log)
    assert not [e.what for e in events if e.what.startswith("FAIL")], [e.what for e in events]
    assert any(e.what.startswith(f"vramd: verify OK sha256={image.sha256}") for e in events)
    assert "grace period over" not in "".join(d.log)


RESUME_LATE_PATCH = (Path(__file__).resolve().parents[2] / "contrib" / "criu" / "optional" /
                     "0001-restore-fail-the-restore-when-a-RESUME_DEVICES_LATE-hook-fails.patch")


@pytest.fixture(scope="module")
def resume_late_criu(work) -> str:
    """CRIU_SRC copied, contrib/criu/optional's cr-restore.c patch applied (`git apply --check` first) and criu
    built there (CRIU's own -Werror build): that criu's binary."""
    src = os.path.join(work, "criu-resume-late")
    subprocess.run(["cp", "-a", ENV.criu_src or "", src], check=True)
    for args in (["git", "apply", "--check", str(RESUME_LATE_PATCH)], ["git", "apply", str(RESUME_LATE_PATCH)],
                 ["make", "-j2", "criu"]):
        r = subprocess.run(args, cwd=src, capture_output=True, text=True)
        assert r.returncode == 0, f"{' '.join(args)}:\n{r.stdout[-3000:]}{r.stderr[-3000:]}"
    return os.path.join(src, "criu", "criu")


def _exits(pid: int, timeout: float = 30.0) -> bool:
    """Whether the process `pid` is gone or a zombie within `timeout` (polled on its real state)."""
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in "ZX":
                return True
        except (FileNotFoundError, ProcessLookupError):
            return True
        time.sleep(0.05)
    return False


@needs_libvramd
def test_with_the_resume_late_patch_a_failed_barrier_fails_the_restore(vramd_rig, work, resume_late_criu):
    """The same failed barrier (no hold, a grace period of 0) in a criu built with contrib/criu/optional's patch:
    RESUME_DEVICES_LATE's error now fails criu restore (exit non-zero, its error logged) and no restored task is
    left running, where the unpatched criu above exits 0 and resumes a task whose contents were never restored."""
    from vramd.testing import DaemonProcess as DaemonProc

    _daemon, image, rig = vramd_rig
    patched = dataclasses.replace(rig, env=dataclasses.replace(rig.env, criu_bin=resume_late_criu))
    run_dir = os.path.join(work, "run-resume-late")
    os.makedirs(run_dir)
    log = os.path.join(work, "restore-resume-late.log")
    with DaemonProc(run_dir, "--grace-period", "0", "--max-hold", "0") as d:
        try:
            with pytest.raises(RuntimeError, match="failed") as failed:
                patched.restore(log, image.plugin_env(d.socket, "offload", api="criu"))
            assert _exits(rig.workload.pid)  # criu SIGKILLed the tree before it returned
        finally:
            rig.workload.kill_restored()
    fails = [e.what for e in read_log(log) if e.what.startswith("FAIL")]
    assert len(fails) == 1 and "vramd_criu_restore_barrier" in fails[0], fails
    restore_log = Path(rig.img, "restore.log").read_text()
    assert "restore late stage hook for external plugin failed for task" in restore_log, str(failed.value)
    assert "Restoring FAILED" in restore_log
