"""The KFD topology through the daemon: saved by a dump, mapped onto by a restore."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from helpers import ROOT, memfd

from vramd.client import SESSION_DUMP, SESSION_RESTORE, Client, ClientBo
from vramd.errors import VramdError
from vramd.testing import DaemonProcess
from vramd.topology import parse_topology

FIXTURES = os.path.join(ROOT, "tests", "fixtures", "topology")


def config(tmp_path, name: str) -> str:
    p = tmp_path / f"{name}.toml"
    p.write_text(f"topology_root = {os.path.join(FIXTURES, name, 'nodes')!r}\n")
    return str(p)


def test_dump_saves_topology_and_restore_maps_gpus(run_dir, image_dir, tmp_path):
    _, dfd = image_dir
    here, there = parse_topology(os.path.join(FIXTURES, "2gpu-pcie", "nodes")), \
        parse_topology(os.path.join(FIXTURES, "2gpu-pcie-host2", "nodes"))
    ids = [g.gpu_id for g in here.gpus]
    datas = [os.urandom(300_000), os.urandom(5000)]
    srcs = [memfd(d) for d in datas]
    with DaemonProcess(run_dir, "--config", config(tmp_path, "2gpu-pcie")) as d, Client(d.socket) as c:
        s = c.open_session(SESSION_DUMP, dfd)
        c.add_bos(s.token, [ClientBo(i + 1, fd, size=len(x), gpu_id=ids[i])
                            for i, (fd, x) in enumerate(zip(srcs, datas))])
        c.start(s.token)
        c.wait(s.token)
    from vramd.cli.imagedir import read_manifest_offline
    m = read_manifest_offline(dfd)
    saved = json.loads(m.topology_json)
    assert sorted(n["gpu_id"] for n in saved["nodes"] if n["gpu_id"]) == sorted(ids)

    dsts = [memfd(size=len(x)) for x in datas]
    with DaemonProcess(run_dir, "--config", config(tmp_path, "2gpu-pcie-host2")) as d, Client(d.socket) as c:
        r = c.open_session(SESSION_RESTORE, dfd)
        c.add_bos(r.token, [ClientBo(i + 1, fd) for i, fd in enumerate(dsts)])
        c.start(r.token)
        c.wait(r.token)
        m = d.expect_log(r"GPU map \(image -> here\): (.*)")
        pairs = dict(p.split("->") for p in m.group(1).strip().split(", "))
        assert sorted(int(a, 16) for a in pairs) == sorted(ids)
        assert sorted(int(b, 16) for b in pairs.values()) == sorted(g.gpu_id for g in there.gpus)
    for fd, x in zip(dsts, datas):
        assert os.pread(fd, len(x), 0) == x
    for fd in srcs + dsts:
        os.close(fd)


def test_restore_onto_mismatched_gpus_is_refused_with_a_report(run_dir, image_dir, tmp_path):
    _, dfd = image_dir
    ids = [g.gpu_id for g in parse_topology(os.path.join(FIXTURES, "2gpu-pcie", "nodes")).gpus]
    src = memfd(os.urandom(4096))
    with DaemonProcess(run_dir, "--config", config(tmp_path, "2gpu-pcie")) as d, Client(d.socket) as c:
        s = c.open_session(SESSION_DUMP, dfd)
        c.add_bos(s.token, [ClientBo(1, src, size=4096, gpu_id=ids[0])])
        c.start(s.token)
        c.wait(s.token)
    with DaemonProcess(run_dir, "--config", config(tmp_path, "2gpu-pcie-oldfw")) as d, Client(d.socket) as c:
        with pytest.raises(VramdError) as e:
            c.open_session(SESSION_RESTORE, dfd)
        assert e.value.code == "TOPOLOGY_MISMATCH" and "KFD_FW_VER_CHECK" in e.value.message
    # CRIU's switch relaxes that check, sent with the restore request (CRIU's environment never
    # reaches a daemon started by systemd): the same restore is then accepted.  The daemon's own
    # environment is not read.
    with DaemonProcess(run_dir, "--config", config(tmp_path, "2gpu-pcie-oldfw"), env={"KFD_FW_VER_CHECK": "0"}) as d, \
            Client(d.socket) as c:
        with pytest.raises(VramdError) as e:
            c.open_session(SESSION_RESTORE, dfd)
        assert e.value.code == "TOPOLOGY_MISMATCH"
        r = c.open_session(SESSION_RESTORE, dfd, topology_checks={"KFD_FW_VER_CHECK": False})
        assert r.image.bo_count == 1
        d.expect_log(r"GPU map \(image -> here\): .* \(checks off: KFD_FW_VER_CHECK\)")
        c.close_session(r.token)
        with pytest.raises(VramdError) as e:  # a name CRIU does not have
            c.open_session(SESSION_RESTORE, dfd, topology_checks={"KFD_FW_CHECK": False})
        assert e.value.code == "INVALID_REQUEST" and "KFD_FW_CHECK" in e.value.message
    # or in the daemon's configuration, for every restore
    cfg = tmp_path / "relaxed.toml"
    base = Path(config(tmp_path, "2gpu-pcie-oldfw")).read_text()
    cfg.write_text(f"{base}[topology_checks]\nKFD_FW_VER_CHECK = false\n")
    with DaemonProcess(run_dir, "--config", str(cfg)) as d, Client(d.socket) as c:
        r = c.open_session(SESSION_RESTORE, dfd)
        assert r.image.bo_count == 1
        c.close_session(r.token)
        with pytest.raises(VramdError) as e:  # a request may turn it back on
            c.open_session(SESSION_RESTORE, dfd, topology_checks={"KFD_FW_VER_CHECK": True})
        assert e.value.code == "TOPOLOGY_MISMATCH"
    os.close(src)
