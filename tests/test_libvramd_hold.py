"""libvramd's CRIU adapter and the daemon's hold (tests/test_libvramd.py's build and helpers): the restored
task's vramd_criu_restore_submit asks the daemon to keep its session for CRIU main's barrier, however long after
the grace period that comes (native/client/tests/t_hold.c)."""
from __future__ import annotations

import subprocess
from pathlib import Path

import test_libvramd as base
from test_libvramd import TESTS_BIN, _own_daemon, _stop, c_env, read_line

build = base.build  # the module's fixture: build/libvramd and its C test program


def test_a_submitted_restore_is_held_past_the_grace_period(build, run_dir):
    """vramd_criu_restore_submit asks for a hold (as long as the daemon's max_hold allows): with a grace
    period of 0 the session outlives the submit's hang-up, and CRIU main's barrier, run only once the daemon
    has logged that nobody holds it, still gets the finished session and the bytes in place."""
    cfg = Path(run_dir) / "vramd.toml"
    cfg.write_text("grace_period = 0\nmax_hold = 600\n")
    d = _own_daemon(run_dir, "--config", str(cfg))
    try:
        p = subprocess.Popen([str(build / TESTS_BIN), "submit_held"], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=c_env(d))
        read_line(p, "SUBMITTED ")
        d.expect_log(r"session \d+: held 600 s once no connection holds it \(asked 4294967295 s, max_hold 600 s\)")
        d.expect_log(r"session \d+: no connection holds it; kept 600 s for its token \(hold\)")
        out, err = p.communicate("go\n", timeout=120)
    finally:
        log = _stop(d)
    assert p.returncode == 0 and "PASS submit_held" in out, out + err + log[-4000:]
    assert "grace period over" not in log and "hold over" not in log
