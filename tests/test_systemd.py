"""systemd integration without systemd: socket activation, notify, watchdog, and the unit files."""
from __future__ import annotations

import os
import shutil
import socket
import subprocess
from pathlib import Path

import pytest
from helpers import ROOT

from vramd.client import Client
from vramd.testing import DaemonProcess


def test_socket_activation_notify_and_watchdog(run_dir):
    path = os.path.join(run_dir, "activated.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(path)
    listener.listen(8)
    with DaemonProcess(run_dir, env={"WATCHDOG_USEC": "100000"}, listener=listener) as d:
        listener.close()  # the daemon has its own copy, as under systemd
        with Client(path) as c:
            assert c.status().connections == 1
        notes = d.expect_note("WATCHDOG=1")
        assert any(n.startswith("READY=1") for n in notes)
        assert any("STATUS=" in n for n in notes)
        d.expect_note("WATCHDOG=1", count=3)  # pinged repeatedly, not once
        d.terminate()
        d.expect_note("STOPPING=1")
        assert d.stop() == 0
    assert os.path.exists(path)  # the socket belongs to systemd: not removed


def test_metrics_textfile_counts_bytes_per_backend(run_dir, image_dir, tmp_path):
    from helpers import memfd

    from vramd.client import SESSION_DUMP, ClientBo
    prom = tmp_path / "vramd.prom"
    with DaemonProcess(run_dir, "--metrics-textfile", str(prom)) as d, Client(d.socket) as c:
        bo = memfd(os.urandom(300_000))
        s = c.open_session(SESSION_DUMP, image_dir[1])
        c.add_bos(s.token, [ClientBo(1, bo, size=300_000)])
        c.start(s.token)
        c.wait(s.token)
        os.close(bo)
        status = c.status()
        assert 'vramd_bytes_total{backend="mmap",direction="read"} 300000' in status.metrics
        c.close()
        assert d.stop() == 0
    text = prom.read_text()
    assert 'vramd_bytes_total{backend="mmap",direction="read"} 300000' in text
    assert 'vramd_sessions_total{kind="dump",outcome="done"} 1' in text
    assert "# TYPE vramd_staging_bytes_in_use gauge" in text
    assert not [p for p in os.listdir(tmp_path) if p.endswith(".tmp")]


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze not installed")
def test_unit_files_verify(tmp_path):
    src = os.path.join(ROOT, "contrib", "systemd")
    vramd = shutil.which("vramd") or os.path.join(os.path.dirname(os.sys.executable), "vramd")
    for name in ("vramd.socket", "vramd.service"):
        text = Path(src, name).read_text().replace("/usr/bin/vramd", vramd)
        (tmp_path / name).write_text(text)
    r = subprocess.run(["systemd-analyze", "verify", str(tmp_path / "vramd.socket"), str(tmp_path / "vramd.service")],
                       capture_output=True, text=True)
    assert r.returncode == 0 and not r.stderr.strip(), r.stderr


def test_hello_lists_the_gpus_of_the_kfd_topology(run_dir, tmp_path):
    from vramd.topology import parse_topology
    root = os.path.join(ROOT, "tests", "fixtures", "topology", "mi300x-8gpu-xgmi", "nodes")
    cfg = tmp_path / "t.toml"
    cfg.write_text(f"topology_root = {root!r}\n")
    with DaemonProcess(run_dir, "--config", str(cfg)) as d, Client(d.socket) as c:
        assert sorted(c.hello.gpu_ids) == sorted(g.gpu_id for g in parse_topology(root).gpus)
        assert len(c.hello.gpu_ids) == 8


def test_example_config_loads():
    from vramd.service.config import load_config
    cfg = load_config(os.path.join(ROOT, "contrib", "systemd", "vramd.toml"), {})
    assert cfg.staging_budget == 512 << 20 and cfg.max_message_bytes == 1 << 20
    with pytest.raises(ValueError, match="unknown setting"):
        from vramd.service.config import DaemonConfig
        DaemonConfig().update({"stagin_budget": 1}, origin="test")


@pytest.mark.skipif(shutil.which("systemd-sysusers") is None, reason="systemd-sysusers not installed")
def test_sysusers_gives_vramd_the_render_groups_on_a_host_without_them(tmp_path):
    """A host with no render group (no udev rules made it): systemd-sysusers with vramd.sysusers creates it
    and makes vramd a member of render and video, and the unit names no group that could be missing
    (SupplementaryGroups= stops the service on such a host: User= gets the database's groups instead)."""
    (tmp_path / "etc").mkdir()
    (tmp_path / "etc" / "group").write_text("root:x:0:\nvideo:x:44:\n")
    (tmp_path / "etc" / "passwd").write_text("root:x:0:0:root:/root:/bin/sh\n")
    conf = os.path.join(ROOT, "contrib", "systemd", "vramd.sysusers")
    r = subprocess.run(["systemd-sysusers", f"--root={tmp_path}", conf], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    groups = {line.split(":")[0]: line.split(":") for line in (tmp_path / "etc" / "group").read_text().splitlines()}
    assert groups["video"][2] == "44"  # the host's group is kept, with vramd added
    for name in ("render", "video"):
        assert "vramd" in groups[name][3].split(","), groups[name]
    assert any(line.startswith("vramd:") for line in (tmp_path / "etc" / "passwd").read_text().splitlines())
    unit = Path(ROOT, "contrib", "systemd", "vramd.service").read_text()
    assert not [line for line in unit.splitlines() if line.startswith("SupplementaryGroups=")]
