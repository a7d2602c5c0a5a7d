"""Operating the daemon: --check-config, SIGHUP, the journal stream, the drain's timeout extension, metrics.

Every test runs real daemon processes (vramd.testing.DaemonProcess) or the
real `vramd` command, and waits for what the daemon says (its log, its
sd_notify notes) rather than for time to pass.
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tomllib

import pytest
from helpers import ROOT, memfd

from vramd.client import SESSION_DUMP, Client, ClientBo
from vramd.errors import VramdError
from vramd.service.config import KEYS, DaemonConfig, load_config
from vramd.testing import DaemonProcess


def vramd(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "vramd", *args], capture_output=True, text=True, cwd=ROOT,
                          env=dict(os.environ, **(env or {})), timeout=60)


# --- --check-config -------------------------------------------------------------------------------

def test_check_config_prints_the_effective_settings(tmp_path):
    cfg = tmp_path / "v.toml"
    cfg.write_text('socket_mode = "0640"\nstaging_budget = "64M"\nio_threads = 2\nlog_level = "warning"\n'
                   "[topology_checks]\nKFD_FW_VER_CHECK = false\n")
    r = vramd("--check-config", "--config", str(cfg), "--chunk-size", "1M")
    assert r.returncode == 0, r.stderr
    assert r.stderr == ""
    out = tomllib.loads(r.stdout)
    assert out["socket_mode"] == "0640" and out["staging_budget"] == 64 << 20 and out["io_threads"] == 2
    assert out["chunk_size"] == 1 << 20  # the flag wins over the file and the default
    assert out["log_level"] == "warning" and out["topology_checks"] == {"KFD_FW_VER_CHECK": False}
    # what it prints is a valid configuration that means the same
    again = tmp_path / "again.toml"
    again.write_text(r.stdout)
    assert load_config(str(again), {}).effective() == load_config(str(cfg), {"chunk_size": 1 << 20}).effective()


def test_the_shipped_config_checks():
    r = vramd("--check-config", "--config", os.path.join(ROOT, "contrib", "systemd", "vramd.toml"))
    assert r.returncode == 0, r.stderr
    assert tomllib.loads(r.stdout)["staging_budget"] == 512 << 20


@pytest.mark.parametrize(("text", "key"), [
    ("socket_mode = 660", "socket_mode"),          # a TOML integer: decimal 660 is not what was meant
    ('socket_mode = "0980"', "socket_mode"),
    ('workers_per_gpu = "four"', "workers_per_gpu"),
    ("staging_budget = -5", "staging_budget"),
    ('staging_budget = "lots"', "staging_budget"),
    ("io_threads = 0", "io_threads"),
    ("max_connections = 0", "max_connections"),
    ("max_connections = true", "max_connections"),
    ("grace_period = -1", "grace_period"),
    ("hello_timeout = 0", "hello_timeout"),
    ("metrics_interval = 0", "metrics_interval"),
    ('chunk_size = "5000"', "chunk_size"),
    ('compression = "lzma"', "compression"),
    ("allowed_uids = [0, -1]", "allowed_uids"),
    ('allowed_uids = "root"', "allowed_uids"),
    ("max_fds_per_message = 254", "max_fds_per_message"),
    ('log_level = "chatty"', "log_level"),
    ("stagin_budget = 1", "stagin_budget"),        # unknown keys are refused, not ignored
    ("[topology_checks]\nKFD_NOPE = true", "topology_checks"),
    ('staging_budget = "1M"\nchunk_size = "8M"', "staging_budget"),  # less than one chunk
    ("io_threads = ", "(syntax)"),
])
def test_a_bad_setting_is_one_line_naming_the_key(tmp_path, text, key):
    cfg = tmp_path / "bad.toml"
    cfg.write_text(text + "\n")
    for args in (["--check-config", "--config", str(cfg)], ["--config", str(cfg), "--socket", str(tmp_path / "s")]):
        r = vramd(*args)  # --check-config, and the daemon itself: both refuse before anything starts
        assert r.returncode == 2, (args, r.stdout, r.stderr)
        assert r.stdout == "" and r.stderr.count("\n") == 1 and "Traceback" not in r.stderr, r.stderr
        assert r.stderr.startswith(f"vramd: bad configuration: {cfg}: {key}: "), r.stderr


def test_bad_flags_and_a_missing_file_are_one_line_too(tmp_path):
    r = vramd("--check-config", "--socket-mode", "660x")
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "socket_mode" in r.stderr
    r = vramd("--check-config", "--config", str(tmp_path / "missing.toml"))
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "missing.toml" in r.stderr


def test_every_setting_has_a_checked_type():
    import dataclasses
    assert {f.name for f in dataclasses.fields(DaemonConfig)} == set(KEYS)
    defaults = DaemonConfig()
    for key, value in defaults.effective().items():  # every default passes its own check
        if value is not None:
            DaemonConfig().update({key: value}, origin="defaults")


# --- SIGHUP ---------------------------------------------------------------------------------------

def _connect_refused(path: str) -> str | None:
    try:
        with Client(path) as c:
            c.status()
    except (VramdError, OSError) as e:
        return str(e)
    return None


def test_sighup_reloads_what_can_change_and_keeps_serving(run_dir, tmp_path):
    cfg = tmp_path / "v.toml"
    cfg.write_text("max_connections = 1\n")
    with DaemonProcess(run_dir, "--config", str(cfg)) as d, Client(d.socket) as first:
        assert first.status().connections == 1
        assert "max_connections" in (_connect_refused(d.socket) or "")  # the limit in force
        d.expect_log("refused")
        cfg.write_text('max_connections = 5\nchunk_size = "4M"\n')
        d.proc.send_signal(signal.SIGHUP)
        d.expect_note("RELOADING=1")
        d.expect_log(r"SIGHUP: configuration reloaded; changed: max_connections")
        d.expect_log(r"SIGHUP: chunk_size changed in the file; it takes effect only at a restart")
        with Client(d.socket) as second:  # the new limit in force, on the same daemon
            assert second.status().connections == 2
        # a bad file: logged, and the running settings stay
        cfg.write_text("max_connections = 0\n")
        d.proc.send_signal(signal.SIGHUP)
        d.expect_log(r"SIGHUP: configuration not reloaded .*max_connections")
        with Client(d.socket) as second:
            assert second.status().connections == 2
        assert d.proc.poll() is None
        first.close()
        assert d.stop() == 0  # SIGTERM still drains and exits 0
    assert not os.path.exists(d.socket)


def test_sighup_changes_the_log_level(run_dir, tmp_path):
    cfg = tmp_path / "v.toml"
    cfg.write_text('log_level = "info"\n')
    with DaemonProcess(run_dir, "--config", str(cfg), log_level=None) as d:  # no flag: the file decides
        cfg.write_text('log_level = "debug"\n')
        d.proc.send_signal(signal.SIGHUP)
        d.expect_log("changed: log_level")
        with Client(d.socket):
            d.expect_log(r"DEBUG .*connection \d+ opened")  # debug lines appear only now
        assert d.stop() == 0


def test_sighup_without_a_config_file_is_ignored_with_a_line(run_dir):
    with DaemonProcess(run_dir) as d:
        d.proc.send_signal(signal.SIGHUP)
        d.expect_log("SIGHUP: no configuration file")
        with Client(d.socket) as c:
            assert c.status().connections == 1
        assert d.stop() == 0


# --- logging --------------------------------------------------------------------------------------

def _log_with_journal_stream(run_dir: str, tmp_path, stream: str | None) -> str:
    path = tmp_path / "stderr.log"
    with open(path, "w") as f:
        st = os.fstat(f.fileno())
        env = {"JOURNAL_STREAM": f"{st.st_dev}:{st.st_ino}" if stream is None else stream}
        with DaemonProcess(run_dir, env=env, stderr=f, log_level="info") as d:
            assert d.stop() == 0
    return path.read_text()


def test_priority_prefixes_only_when_stderr_is_the_journal(run_dir, tmp_path):
    text = _log_with_journal_stream(run_dir, tmp_path, None)  # JOURNAL_STREAM names this very file
    lines = text.splitlines()
    assert lines and all(re.match(r"<[3-7]>", line) for line in lines), text
    assert any(line.startswith("<6>INFO vramd") and "listening on" in line for line in lines)
    # inherited from a parent whose stderr was the journal, but stderr is elsewhere now: plain
    text = _log_with_journal_stream(run_dir, tmp_path, "1:1")
    assert text and not re.search(r"^<\d>", text, re.M)
    assert re.match(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+ INFO ", text)


def test_one_summary_line_per_session_and_the_drain_extends_the_stop_timeout(run_dir, image_dir, tmp_path):
    with DaemonProcess(run_dir, "--drain-timeout", "1") as d, Client(d.socket) as c:
        bo = memfd(os.urandom(200_000))
        s = c.open_session(SESSION_DUMP, image_dir[1])
        c.add_bos(s.token, [ClientBo(1, bo, size=200_000)])
        c.start(s.token)
        c.wait(s.token)
        m = d.expect_log(r"INFO .*session 1 \(dump, uid (\d+), pid (\d+)\): SESSION_DONE: 1/1 BOs, "
                         r"200000/200000 bytes in [\d.]+ s, [\d.]+ GB/s")
        assert int(m.group(1)) == os.getuid() and int(m.group(2)) == os.getpid()
        # a session that never starts holds the drain: the manager is asked for more time meanwhile
        (tmp_path / "img2").mkdir()
        d2 = os.open(tmp_path / "img2", os.O_RDONLY | os.O_DIRECTORY)
        c.open_session(SESSION_DUMP, d2)
        os.close(d2)
        os.close(bo)
        d.terminate()
        notes = d.expect_note("EXTEND_TIMEOUT_USEC=")
        assert any(re.search(r"EXTEND_TIMEOUT_USEC=\d+", n) for n in notes)
        d.expect_log(r"WARNING .*session 2 \(dump, uid \d+, pid \d+\): SESSION_CANCELLED: 0/0 BOs")
        assert d.stop() == 0


# --- metrics --------------------------------------------------------------------------------------

def test_metrics_start_at_zero_and_a_failed_add_bos_counts_once(run_dir, image_dir):
    from vramd import __version__
    with DaemonProcess(run_dir) as d, Client(d.socket) as c:
        m = c.status().metrics
        assert f'vramd_build_info{{version="{__version__}"}} 1' in m
        for series in ('vramd_sessions_total{kind="dump",outcome="failed"} 0',
                       'vramd_sessions_total{kind="restore",outcome="done"} 0',
                       'vramd_bytes_total{backend="procmem",direction="read"} 0',
                       'vramd_bos_total{kind="verify"} 0', 'vramd_errors_total{code="UNMAPPED_RANGE"} 0',
                       'vramd_requests_total{type="add_bos"} 0', "vramd_connections_refused_total 0"):
            assert series in m, series
        mem = os.open(f"/proc/{os.getpid()}/mem", os.O_RDONLY)
        try:
            s = c.open_session(SESSION_DUMP, image_dir[1])
            with pytest.raises(VramdError) as e:  # nothing is mapped at 4 KiB
                c.add_bos(s.token, [ClientBo(1, mem, offset=0x1000, size=4096, backend="procmem")])
            assert e.value.code == "UNMAPPED_RANGE"
        finally:
            os.close(mem)
        with pytest.raises(VramdError) as e:
            c.wait(s.token)  # the Wait reports the same failure
        assert e.value.code == "UNMAPPED_RANGE"
        c.close_session(s.token)
        m = c.status().metrics
        assert 'vramd_errors_total{code="UNMAPPED_RANGE"} 1' in m, m
        assert 'vramd_sessions_total{kind="dump",outcome="failed"} 1' in m
        assert d.stop() == 0


def _uptime(text: str) -> str:
    m = re.search(r"^vramd_uptime_seconds (\S+)$", text, re.M)
    assert m, text
    return m.group(1)


@pytest.mark.parametrize("interval", ["3600", "0.01"])
def test_metrics_interval_paces_the_textfile(run_dir, tmp_path, interval):
    prom = tmp_path / "vramd.prom"
    cfg = tmp_path / "v.toml"
    cfg.write_text(f"metrics_textfile = {str(prom)!r}\nmetrics_interval = {interval}\n")
    # a 20 ms watchdog: housekeeping runs every 10 ms whatever the interval
    umask = os.umask(0o077)  # the unit's UMask=: the textfile must stay readable by node_exporter
    try:
        d = DaemonProcess(run_dir, "--config", str(cfg), env={"WATCHDOG_USEC": "20000"})
    finally:
        os.umask(umask)
    with d:
        d.expect_note("WATCHDOG=1", count=2)  # the first tick has written the file
        first = _uptime(prom.read_text())
        d.expect_note("WATCHDOG=1", count=12)
        later = _uptime(prom.read_text())
        if interval == "3600":
            assert later == first  # not rewritten at every tick
        else:
            assert float(later) > float(first)
        assert d.stop() == 0
    assert float(_uptime(prom.read_text())) >= float(later)  # and once more on the way out
    assert prom.stat().st_mode & 0o777 == 0o644


def test_socket_directories_the_daemon_makes_are_ones_its_clients_trust_whatever_the_umask(run_dir):
    """A daemon started by hand makes its socket's directory only where that is its documented runtime directory
    (docs/protocol.md, "Socket paths": here $XDG_RUNTIME_DIR/vramd), made 0700 whatever the umask (under 002 a
    group-writable directory made the daemon one nobody could use: its clients refuse one); a --socket in any
    other missing directory is refused, not made (tests/test_papercuts.py)."""
    xdg = os.path.join(run_dir, "xdg")
    os.mkdir(xdg, 0o700)
    sock = os.path.join(xdg, "vramd", "vramd.sock")
    umask = os.umask(0o002)  # a login shell's umask on many systems
    try:
        d = DaemonProcess(run_dir, "--socket", sock, env={"XDG_RUNTIME_DIR": xdg})
    finally:
        os.umask(umask)
    with d, Client(sock) as c:
        assert c.status().server.startswith("vramd ")
    assert os.stat(os.path.dirname(sock)).st_mode & 0o777 == 0o700
