"""The overlapped dump of the vramd-patched amdgpu plugin (contrib/criu, 0003): each process's copy
starts in DUMP_EXT_FILE and the plugin waits for all of them in DUMP_DEVICES_LATE, before the queues
are unpaused.  On the KFD model + SDMA model inside a real CRIU, THIS RUNS ON MODELS, NOT A GPU.
Skipped as test_kfd_vramd_plugin.py is (CRIU_SRC, CRIU_BIN, root, libvramd)."""
from __future__ import annotations

import contextlib
import os
import re
import shutil
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import test_kfd_vramd_plugin as base
from test_kfd_stock_plugin import DUMP, MIB, RESTORE, TOPO_A
from test_kfd_vramd_plugin import _vramctl_verify, running_daemon

# test_kfd_vramd_plugin.py's skip condition and fixtures (the series applied and built once per module)
pytestmark = base.pytestmark
plugins, model, daemon, case = base.plugins, base.model, base.daemon, base.case

TREE = DUMP.replace("-g $GPUS", "-g $GPUS -c")
EXPECT = f"ok 14 {2 * MIB << 20}; child ok 10 {2 * 4 << 20}"


def _lines(log: str, pattern: str) -> list[int]:
    return [i for i, ln in enumerate(log.splitlines()) if re.search(pattern, ln)]


def test_two_process_dump_overlaps_the_copies_and_restores_byte_exact(case, plugins, daemon):
    """A parent and a child, each its own KFD process with BOs on both GPUs: both copies are started
    (DUMP_EXT_FILE) before the plugin waits for either, the waits and commits come in DUMP_DEVICES_LATE
    before the queues are unpaused, both images verify, and the restore is byte-exact for both."""
    case.use(plugins["vramd"])
    a = case.state("state-a", TOPO_A)
    env = case.env(daemon.socket)
    d = case.run(TREE, a, TOPO_A, gpus=2, extra=env)
    log = case.log("dump.log")
    assert d["dump"] == "0", log[-3000:]
    assert d["checks"] == f"{EXPECT}\n"                             # before (criu dump ends the tree)
    started = _lines(log, r"vramd: \d+ BOs started into amdgpu-vramd-\d+/ \(0 parents\)")
    dumped = _lines(log, r"vramd: \d+ BOs dumped into amdgpu-vramd-\d+/ \(0 parents, [1-9]\d* bytes stored\)")
    assert len(started) == 2 and len(dumped) == 2, log[-3000:]
    assert max(started) < min(dumped), "the second copy started only after the first was waited for"
    unpaused = _lines(log, r"Process unpaused Ok")
    assert len(unpaused) == 1 and max(dumped) < unpaused[0], log[-3000:]
    counts = sorted(re.findall(r"vramd: (\d+) BOs started into", log))
    assert counts == ["12", "8"], counts
    assert len(case.vramd_dirs()) == 2, case.img()
    for vdir in case.vramd_dirs():
        v = _vramctl_verify(os.path.join(case.work, "img", vdir))
        assert v.returncode == 0, v.stdout + v.stderr
    c = case.model.counters(a)["calls"]
    assert (c["checkpoint"], c["unpause"]) == (2, 2)
    r = case.run(RESTORE, a, TOPO_A, extra=env)
    log = case.log("restore.log")
    assert r["restore"] == "0", log[-3000:]
    assert r["checks"] == f"{EXPECT}\n"
    assert len(re.findall(r"vramd: restore of task \d+ done", log)) == 2


def test_two_process_dump_whose_copies_fail_in_the_wait_unpauses_both_and_leaves_no_image(case, plugins):
    """vramd is SIGKILLed while the plugin waits in DUMP_DEVICES_LATE for the two started copies (its
    SDMA model slowed down): criu dump fails, both processes are unpaused and run on with every byte
    intact, and no amdgpu-vramd directory or file of either image is left."""
    case.use(plugins["vramd"])
    a = case.state("state-a", TOPO_A)
    with running_daemon(VRAMD_SDMA_MODEL_PACKET_DELAY_US="200000") as slow, ThreadPoolExecutor(1) as ex:
        dump = ex.submit(case.run, TREE, a, TOPO_A, gpus=2, extra=case.env(slow.socket, KEEP="1"))
        slow.expect_log(r"connection \d+ waits for session \d+", timeout=120)
        slow.proc.kill()
        d = dump.result(timeout=300)
    pid = int(d["pid"])
    try:
        log = case.log("dump.log")
        assert d["dump"] != "0" and d["alive"] == "yes", log[-3000:]
        assert d["checks"] == f"{EXPECT}\n{EXPECT}\n"                  # before, and after the failed dump
        assert len(_lines(log, r"vramd: \d+ BOs started into")) == 2
        assert re.search(r"vramd: dump into amdgpu-vramd-\d+/ failed: ", log), log[-3000:]
        assert "vramd: process unpaused after the failed dump" in log and "Process unpaused Ok" in log
        assert "Dumping FAILED" in log
        assert case.vramd_dirs() == [] and not [n for n in case.img() if "vrdm" in n or n.startswith("amdgpu-p")]
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            (child,) = map(int, f.read().split())
        assert case.model.paused(a, pid) == 0 and case.model.paused(a, child) == 0
        assert case.model.counters(a)["calls"]["unpause"] == 2
    finally:
        os.kill(pid, 15)


@contextlib.contextmanager
def one_session_daemon():
    """A running vramd (as test_kfd_vramd_plugin.running_daemon) that allows one session per uid."""
    from vramd.testing import DaemonProcess

    run_dir = tempfile.mkdtemp(prefix="vramd-kv", dir="/tmp")  # short: sun_path is 108 bytes
    cfg = os.path.join(run_dir, "gpus.toml")
    with open(cfg, "w") as f:
        f.write(f'topology_root = "{run_dir}/no-topology"\ngpu_ids = [0x5d21, 0xa3f0]\nmax_sessions_per_uid = 1\n')
    try:
        with DaemonProcess(run_dir, "--grace-period", "60", "--config", cfg,
                           env={"VRAMD_AMDGPU_LIBRARY": "model"}) as d:
            yield d
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)


def test_a_second_copy_refused_at_its_start_drops_the_first_and_unpauses_both(case, plugins):
    """The daemon allows one session: the first process's copy starts, the second's is refused in its
    DUMP_EXT_FILE (LIMIT_EXCEEDED).  CRIU runs no DUMP_DEVICES_LATE after that, so the plugin drops the
    started copy (no directory of either image left) and unpauses both processes, which run on intact."""
    case.use(plugins["vramd"])
    a = case.state("state-a", TOPO_A)
    with one_session_daemon() as d1:
        d = case.run(TREE, a, TOPO_A, gpus=2, extra=case.env(d1.socket, KEEP="1"))
    pid = int(d["pid"])
    try:
        log = case.log("dump.log")
        assert d["dump"] != "0" and d["alive"] == "yes", log[-3000:]
        assert d["checks"] == f"{EXPECT}\n{EXPECT}\n"
        (started,) = re.findall(r"vramd: \d+ BOs started into (amdgpu-vramd-\d+)/", log)
        m = re.search(r"vramd: dump into (amdgpu-vramd-\d+)/ failed: .*\[LIMIT_EXCEEDED\]", log)
        assert m and m.group(1) != started, log[-3000:]
        assert f"vramd: {started}/ dropped: the dump failed" in log
        assert "vramd: process unpaused after the failed dump" in log and "Dumping FAILED" in log
        assert "BOs dumped into" not in log
        assert case.vramd_dirs() == [] and not [n for n in case.img() if "vrdm" in n or n.startswith("amdgpu-p")]
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            (child,) = map(int, f.read().split())
        assert case.model.paused(a, pid) == 0 and case.model.paused(a, child) == 0
        assert case.model.counters(a)["calls"]["unpause"] == 2
    finally:
        os.kill(pid, 15)
