"""Settings `vramd --check-config` (and a SIGHUP reload) accepts are settings every dump accepts: the check
applies the engine's and the sessions' own rules (a real vramd, real daemons, real dumps)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest
from helpers import ROOT, open_dir

from vramd.client import SESSION_DUMP, Client, ClientBo
from vramd.pb import rpc_pb2 as rpc
from vramd.testing import DaemonProcess, Workload


def vramd(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "vramd", *args], capture_output=True, text=True, cwd=ROOT,
                          timeout=60)


@pytest.mark.parametrize(("args", "text", "names"), [
    # the case: 2 x (256M + 4K) of staging per batch for the default (compressed) dump, 512M budget
    (["--chunk-size", "256M"], "", "staging_budget, chunk_size, compression"),
    # a full dump fits (2 x 8M), an incremental one (4 x 8M: its parent's chunk too) does not
    (["--staging-budget", "24M", "--chunk-size", "8M"], "", "staging_budget, chunk_size"),
    ([], "data_files_per_gpu = 2\nmax_fds_per_session = 3\n", "max_fds_per_session"),  # 2 files, a BO, a manifest
    ([], "data_files_per_gpu = 2\nmax_fds_per_uid = 3\n", "max_fds_per_uid"),
    ([], "max_fds_per_message = 1\n", "max_fds_per_message"),  # a data file and its O_DIRECT twin: one message
])
def test_check_config_refuses_what_every_dump_would_refuse(tmp_path, args, text, names):
    cfg = tmp_path / "v.toml"
    cfg.write_text(text)
    r = vramd("--check-config", *(["--config", str(cfg)] if text else []), *args)
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert r.stdout == "" and r.stderr.count("\n") == 1 and "Traceback" not in r.stderr, r.stderr
    origin = "command line" if args else str(cfg)
    assert r.stderr.startswith(f"vramd: bad configuration: {origin}: {names}: "), r.stderr


def dump_and_child(sock: str, parent: str, child: str) -> list[rpc.SessionInfo]:
    """A dump with the daemon's defaults (compression, chunk size), then an incremental one over it."""
    with Workload([{"size": 3 << 20, "fill": "random", "seed": 1}]) as w, Client(sock) as c:
        mem = w.open_mem()
        pfd, cfd = open_dir(parent), open_dir(child)
        try:
            bos = [ClientBo(1, mem, offset=w.regions[0]["addr"], size=3 << 20)]
            return [c.run_session(SESSION_DUMP, pfd, bos), c.run_session(SESSION_DUMP, cfd, bos, parent_fds=[pfd])]
        finally:
            for fd in (mem, pfd, cfd):
                os.close(fd)


@pytest.mark.parametrize("budget", ["24M", "33M"])  # 4 x (8M + 4K) = 32M + 16K: 24M is too little, 33M enough
def test_settings_the_check_accepts_every_dump_accepts(run_dir, tmp_path, budget):
    """Either the check refuses the settings, naming them, or a daemon with them makes a full and an
    incremental dump with its defaults."""
    flags = ["--staging-budget", budget, "--chunk-size", "8M"]
    r = vramd("--check-config", *flags)
    if r.returncode != 0:
        assert r.returncode == 2 and "staging_budget, chunk_size: an incremental dump: " in r.stderr, r.stderr
        return
    (tmp_path / "p").mkdir()
    (tmp_path / "c").mkdir()
    with DaemonProcess(run_dir, *flags) as d:
        infos = dump_and_child(d.socket, str(tmp_path / "p"), str(tmp_path / "c"))
    assert [i.state for i in infos] == [rpc.SESSION_DONE, rpc.SESSION_DONE]


def test_sighup_refuses_a_file_whose_dumps_would_all_fail(run_dir, tmp_path):
    """A reload checks by the same rules: a file the engine would refuse every dump for is not applied (any of it),
    and the daemon says which settings, in one line."""
    cfg = tmp_path / "v.toml"
    cfg.write_text("max_connections = 5\n")
    with DaemonProcess(run_dir, "--config", str(cfg)) as d:
        cfg.write_text('max_connections = 6\nchunk_size = "256M"\n')
        d.proc.send_signal(signal.SIGHUP)
        d.expect_log(r"SIGHUP: configuration not reloaded \(the running settings stay\): .*v\.toml: "
                     r"staging_budget, chunk_size, compression: a dump with the default compression: chunk size "
                     r"268435456 needs 2 x 268439552 = 536879104 bytes of staging per batch")
        with Client(d.socket) as c:
            assert c.hello.limits.max_connections_per_uid > 0 and c.status().connections == 1
        assert d.proc.poll() is None
