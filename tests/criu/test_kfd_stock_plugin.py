"""CRIU's own, unmodified amdgpu plugin dumps and restores an emulated GPU process on the
KFD model + SDMA model (docs/kfd-model.md), inside a real CRIU.  THIS RUNS ON MODELS, NOT A GPU.

Skipped unless CRIU_SRC (a CRIU checkout) and CRIU_BIN (its built criu) are set and we are
root; the plugin is CRIU_SRC/plugins/amdgpu/amdgpu_plugin.so (built there with
`make amdgpu_plugin` if missing).  Each case runs criu and the workload in a private mount
namespace (tests/criu/kfd_ns.sh); nothing is created on the host's /dev, /sys or /run.
"""
from __future__ import annotations

import os
import re
import shutil
import struct
import subprocess
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from criu_harness import Env
from kfd_harness import FIXTURES, Model, run_in_ns

ENV = Env()
pytestmark = pytest.mark.skipif(ENV.missing() is not None or not shutil.which("unshare"),
                                reason=ENV.missing() or "needs unshare(1)")
TOPO_A = str(FIXTURES / "2gpu-mi100-xgmi")
TOPO_B = str(FIXTURES / "2gpu-mi100-xgmi-host2")
MIB = 64
# The stock plugin writes COPY_LINEAR's count as the byte count for every family; the SDMA
# model follows the kernel (bytes - 1 from family AI on), so these cases run the model as VI
# (family 130), where the plugin's encoding is the right one; test_family_ai_... shows why.
SDMA_VI = {"VRAMD_SDMA_MODEL_FAMILY": "130"}

# One bash script per criu run, inside the namespace.  It waits for files the workload or
# criu write, with a bound, never for a fixed time.
START = r'''
set -u
W=$WORK
wait_for() {
    for _ in $(seq 1200); do [ -s "$1" ] && return 0; sleep 0.05; done
    echo "timeout waiting for $1"; return 1
}
check() { rm -f $W/report; kill -USR1 "$1" && wait_for $W/report && echo "check: $(cat $W/report)"; }
# a live workload: not a zombie, not another process that got the pid; a task CRIU is killing
# after a failed restore gets a bounded while to go
running() { grep -q '^kfd_workload$' /proc/$1/comm 2>/dev/null && ! grep -q ') [ZX] ' /proc/$1/stat 2>/dev/null; }
alive() {  # "now": is it running; else wait (bounded) until the pid is free again or clearly running
    [ -n "${2:-}" ] && { running $1; return; }
    for _ in $(seq 200); do [ -e /proc/$1 ] || return 1; sleep 0.05; done; running $1
}
'''
DUMP = START + r'''
rm -rf $W/img $W/ready; mkdir -p $W/img
$WL -m $MIB -g $GPUS $W/report > $W/ready 2>$W/wl.err < /dev/null &
wait_for $W/ready || { cat $W/wl.err; exit 1; }
pid=$(awk '{print $2}' $W/ready); echo "pid: $pid"
check $pid
$CRIU dump -t $pid -D $W/img -o dump.log -v4 --libdir $W/plugins --shell-job $DUMP_OPTS
echo "dump: $?"
if alive $pid now; then echo "alive: yes"; check $pid; [ -n "${KEEP:-}" ] || kill -TERM $pid
else echo "alive: no"; fi
'''
RESTORE = START + r'''
pid=$(awk '{print $2}' $W/ready)
$CRIU restore -D $W/img -o restore.log -v4 --libdir $W/plugins --shell-job -d
rc=$?; echo "restore: $rc"
if [ $rc = 0 ]; then live="alive $pid now"; else live="alive $pid"; fi
if $live; then echo "alive: yes"; check $pid; kill -TERM $pid; else echo "alive: no"; fi
'''


def _plugin() -> str:
    so = os.path.join(ENV.criu_src or "", "plugins", "amdgpu", "amdgpu_plugin.so")
    if not os.path.exists(so):
        r = subprocess.run(["make", "-C", ENV.criu_src or "", "amdgpu_plugin"], capture_output=True, text=True)
        if r.returncode:
            raise RuntimeError(f"make amdgpu_plugin failed ({r.returncode}):\n{r.stdout}{r.stderr}")
    return so


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return Model(str(tmp_path_factory.mktemp("kfd-build")))


class Case:
    """A work directory, model state(s), and the runs of one test."""

    def __init__(self, model: Model, work: str):
        self.model, self.work = model, work
        os.makedirs(os.path.join(work, "plugins"))
        shutil.copy(_plugin(), os.path.join(work, "plugins"))
        self.host_before = _host_paths()

    def state(self, name: str, topology: str) -> str:
        path = os.path.join(self.work, name)
        self.model.create_state(path, topology)
        return path

    def run(self, script: str, state: str, topology: str, *, gpus: int = 1, dump_opts: str = "",
            extra: dict | None = None) -> dict[str, str]:
        env = {**self.model.env(state), **SDMA_VI, **(extra or {}), "WORK": self.work, "WL": self.model.workload,
               "CRIU": ENV.criu_bin or "", "MIB": str(MIB), "GPUS": str(gpus), "DUMP_OPTS": dump_opts}
        r = run_in_ns(state, topology, os.path.join(self.work, "scratch"), script, env, timeout=300)
        out: dict[str, str] = {"checks": ""}
        for line in r.stdout.splitlines():
            key, _, value = line.partition(": ")
            if key == "check":
                out["checks"] += value + "\n"
            else:
                out.setdefault(key, value)
        out["stdout"], out["stderr"] = r.stdout, r.stderr
        assert _host_paths() == self.host_before, "the host's /dev, /sys or /run changed"
        return out

    def log(self, name: str) -> str:
        with open(os.path.join(self.work, "img", name), errors="replace") as f:
            return f.read()


def _host_paths() -> dict[str, object]:
    """What a test must not change on the host: these paths' existence, and /dev/dri's entries
    where the host has one (the stand-ins must not land in it)."""
    paths: dict[str, object] = {p: os.path.lexists(p)
                                for p in ("/dev/kfd", "/dev/dri", "/sys/class/kfd", "/run/criu-amdgpu")}
    if os.path.isdir("/dev/dri"):
        paths["/dev/dri/"] = sorted(os.listdir("/dev/dri"))
    return paths


@pytest.fixture
def case(model, tmp_path):
    return Case(model, str(tmp_path))


def _ok(checks: str, n: int) -> None:
    lines = checks.splitlines()
    assert len(lines) == n and all(line == f"ok 7 {MIB << 20}" for line in lines), checks


def test_one_process_dumped_and_restored_byte_exact(case):
    """7 BOs (doorbell, VRAM and GTT, 1 page to 38 MiB) on one GPU of two; the plugin's parallel
    restore (CRIU main's worker thread, SDMA on the model) fills them; the workload checks every byte."""
    a = case.state("state-a", TOPO_A)
    d = case.run(DUMP, a, TOPO_A)
    assert d["dump"] == "0", case.log("dump.log")[-3000:]
    assert d["alive"] == "no"
    _ok(d["checks"], 1)
    dump_log = case.log("dump.log")
    assert "amdgpu_plugin: devices:2 bos:7 objects:0" in dump_log
    assert "Found device file mapping, plugin is available" in dump_log
    with open(os.path.join(case.work, "img", f"amdgpu-pages-{_kfd_id(case)}-5d21.img"), "rb") as f:
        assert struct.unpack("<Q", f.read(8))[0] == MIB << 20
    r = case.run(RESTORE, a, TOPO_A)
    log = case.log("restore.log")
    assert r["restore"] == "0", log[-3000:]
    _ok(r["checks"], 1)
    assert "amdgpu_plugin: Begin to send parallel restore cmd" in log
    assert "amdgpu_plugin: Close parallel restore server" in log
    assert "amdgpu_plugin: Thread[0x5d21] finished ret:0" in log
    assert "amdgpu_plugin: All nodes mapped successfully" in log
    c = case.model.counters(a)
    assert (c["calls"]["process_info"], c["calls"]["checkpoint"], c["calls"]["unpause"]) == (1, 1, 1)
    assert (c["calls"]["restore"], c["calls"]["resume"]) == (1, 1)
    assert c["fails"]["checkpoint"] == c["fails"]["restore"] == c["fails"]["resume"] == 0
    assert c["stats"]["dmabufs"] == 12       # 6 VRAM/GTT BOs at dump, 6 fresh ones at restore


def _kfd_id(case) -> int:
    names = [n for n in os.listdir(os.path.join(case.work, "img")) if n.startswith("amdgpu-kfd-")]
    assert len(names) == 1, names
    return int(names[0][len("amdgpu-kfd-"):-len(".img")])


def test_restore_onto_another_host_remaps_gpus(case):
    """Dumped on host A (gpu_ids 0x5D21/0xA3F0, minors 128/129), restored on host B
    (0x77C4/0x1B09, minors 130/131): the plugin's own topology match picks the GPUs."""
    a, b = case.state("state-a", TOPO_A), case.state("state-b", TOPO_B)
    d = case.run(DUMP, a, TOPO_A)
    assert d["dump"] == "0", case.log("dump.log")[-3000:]
    r = case.run(RESTORE, b, TOPO_B)
    log = case.log("restore.log")
    assert r["restore"] == "0", log[-3000:]
    _ok(r["checks"], 1)
    assert "GPU: 0x5D21 -> 0x" in log and "GPU: 0x5D21 -> 0x5D21" not in log
    assert case.model.counters(b)["calls"]["restore"] == 1
    assert case.model.counters(a)["calls"]["restore"] == 0


# Each KFD_*_CHECK switch the plugin reads at restore, and a host-B fixture that differs from host A
# in just the property that switch guards, in the direction the plugin refuses.  What the plugin
# compares, per GPU it tries to map A's onto (B's value vs A's): fw_version >= (MEC firmware),
# sdma_fw_version >=, caches_count >=, num_gws >=, VRAM size (the first public/private mem bank's
# size_in_bytes) >=, capability == (so a differing word refuses either way), and with
# KFD_NUMA_CHECK the CPU node a GPU links to must map consistently: GPUs that share a CPU on A
# must share one on B (with it off, any CPU link of a matching kind will do).  The third field is
# the plugin's debug line for the candidate it turned down.
PROPS = "Device properties do not match"
CHECKS = [
    ("KFD_FW_VER_CHECK", "oldfw", PROPS),
    ("KFD_SDMA_FW_VER_CHECK", "oldsdmafw", PROPS),
    ("KFD_CACHES_COUNT_CHECK", "fewercaches", PROPS),
    ("KFD_NUM_GWS_CHECK", "fewergws", PROPS),
    ("KFD_VRAM_SIZE_CHECK", "lessvram", PROPS),
    ("KFD_CAPABILITY_CHECK", "othercap", PROPS),
    ("KFD_NUMA_CHECK", "numa", "Mismatch between iolink to CPU"),
]


@pytest.mark.parametrize("switch,host,why", CHECKS, ids=[c[0] for c in CHECKS])
def test_kfd_check_refuses_the_restore_host_unless_switched_off(case, switch, host, why):
    """Host B (2gpu-mi100-xgmi-host2-<host>) falls short of A in the one property `switch` guards
    (see CHECKS): the plugin finds no GPU of B to map A's onto and the restore fails with no task
    left; with `switch`=0 (every other check still on) it maps them and restores byte-exact."""
    b_topo = str(FIXTURES / f"2gpu-mi100-xgmi-host2-{host}")
    a, b = case.state("state-a", TOPO_A), case.state("state-b", b_topo)
    d = case.run(DUMP, a, TOPO_A)
    assert d["dump"] == "0", case.log("dump.log")[-3000:]
    r = case.run(RESTORE, b, b_topo)
    assert r["restore"] != "0" and r["alive"] == "no"
    log = case.log("restore.log")
    assert "amdgpu_plugin: Failed to map GPUs" in log, log[-3000:]
    assert why in log and (why == PROPS or PROPS not in log), log[-3000:]
    assert case.model.counters(b)["calls"]["restore"] == 0
    r = case.run(RESTORE, b, b_topo, extra={switch: "0"})
    log = case.log("restore.log")
    assert r["restore"] == "0", log[-3000:]
    _ok(r["checks"], 1)
    assert "amdgpu_plugin: All nodes mapped successfully" in log
    assert case.model.counters(b)["calls"]["restore"] == 1


def test_dump_fails_on_an_injected_checkpoint_error_and_the_process_runs_on(case):
    a = case.state("state-a", TOPO_A)
    case.model.inject(a, "checkpoint", 5)            # EIO
    d = case.run(DUMP, a, TOPO_A, extra={"KEEP": "1"})
    pid = int(d["pid"])
    try:
        assert d["dump"] != "0"
        assert d["alive"] == "yes"
        _ok(d["checks"], 2)                          # before, and after the failed dump
        assert "Failed to call dumper (process) ioctl" in case.log("dump.log")
        c = case.model.counters(a)
        assert c["fails"]["checkpoint"] == 1 and c["stats"]["dmabufs"] == 0
        # the plugin unpauses only fds whose dump succeeded: this one's queues stay evicted
        assert case.model.paused(a, pid) == 1
    finally:
        os.kill(pid, 15)


# op -> (criu dump's exit status, the process's queues paused afterwards), as measured
DUMP_FAILURES = {
    "get_version": ("1", 0),       # the plugin declines the fd; CRIU cannot dump it
    # the plugin's error path frees its still-NULL image message (free_e(NULL)): criu dies of SIGSEGV
    "process_info": ("139", 0),
    "unpause": ("1", 1),           # DUMP_DEVICES_LATE fails, and the queues stay evicted
}


@pytest.mark.parametrize("op", sorted(DUMP_FAILURES))
def test_dump_with_an_injected_kfd_failure(case, op):
    """Each dump-side op failing once (EIO): the dump fails, the process runs on; what the
    plugin leaves behind is pinned (see DUMP_FAILURES)."""
    rc, paused = DUMP_FAILURES[op]
    a = case.state("state-a", TOPO_A)
    case.model.inject(a, op, 5)
    d = case.run(DUMP, a, TOPO_A, extra={"KEEP": "1"})
    pid = int(d["pid"])
    try:
        assert d["dump"] == rc
        assert d["alive"] == "yes"
        _ok(d["checks"], 2)
        assert case.model.counters(a)["fails"][op] == 1
        assert case.model.paused(a, pid) == paused
    finally:
        os.kill(pid, 15)


def test_a_failed_resume_leaves_a_restored_process_paused_and_criu_says_success(case):
    """RESUME failing (EIO) in RESUME_DEVICES_LATE: the plugin logs it, CRIU only debug-logs a
    failed late hook, so criu restore exits 0 and the process runs with its queues evicted."""
    a = case.state("state-a", TOPO_A)
    d = case.run(DUMP, a, TOPO_A)
    assert d["dump"] == "0", case.log("dump.log")[-3000:]
    case.model.inject(a, "resume", 5)
    r = case.run(RESTORE.replace("kill -TERM $pid", '[ -n "${KEEP:-}" ] || kill -TERM $pid'), a, TOPO_A,
                 extra={"KEEP": "1"})
    with open(os.path.join(case.work, "ready")) as f:
        pid = int(f.read().split()[1])
    try:
        assert r["restore"] == "0"
        _ok(r["checks"], 1)
        assert "restore late ioctl failed" in case.log("restore.log")
        assert case.model.paused(a, pid) == 1
    finally:
        os.kill(pid, 15)


def test_restore_fails_on_an_injected_restore_error_and_leaves_no_task(case):
    a = case.state("state-a", TOPO_A)
    d = case.run(DUMP, a, TOPO_A)
    assert d["dump"] == "0", case.log("dump.log")[-3000:]
    case.model.inject(a, "restore", 5)
    r = case.run(RESTORE, a, TOPO_A)
    assert r["restore"] != "0"
    assert r["alive"] == "no"
    assert "Restore ioctl failed" in case.log("restore.log")


def test_family_ai_dump_reports_success_but_saves_no_bytes(case):
    """Found with the SDMA model: on family AI (gfx9, MI100) the plugin's COPY_LINEAR count is
    one byte too many, the last packet of each BO runs past the BO (a VM fault on the model), and
    the plugin does not notice (its copy's error is overwritten by the cleanup calls): criu dump
    and criu restore exit 0, and the restored process finds its first BO zeroed."""
    a = case.state("state-a", TOPO_A)
    ai = {"VRAMD_SDMA_MODEL_FAMILY": "141", "VRAMD_SDMA_MODEL_LOG": "1"}
    d = case.run(DUMP, a, TOPO_A, extra=ai)
    assert d["dump"] == "0"
    assert "runs past the end of its mapping" in d["stderr"] + case.log("dump.log")
    with open(os.path.join(case.work, "img", f"amdgpu-pages-{_kfd_id(case)}-5d21.img"), "rb") as f:
        assert struct.unpack("<Q", f.read(8))[0] == MIB << 20
        assert f.read(4096) == bytes(4096)           # BO 1 (one page): the workload never writes zeros
    r = case.run(RESTORE, a, TOPO_A, extra=ai)
    assert r["restore"] == "0"
    assert r["checks"] == "bad bo 1 offset 0\n"


def test_two_gpus_in_a_process_tree_restored_by_per_gpu_threads_byte_exact(case):
    """A parent and a child, each its own KFD process with its own BOs on both GPUs (the child's
    forked before anything is opened: 4 MiB per GPU, other content): the plugin disables its
    parallel restore and restores the BOs in each restored task, one thread per GPU, and both
    processes find every byte of theirs."""
    a = case.state("state-a", TOPO_A)
    expect = f"ok 14 {2 * MIB << 20}; child ok 10 {2 * 4 << 20}\n"
    d = case.run(DUMP.replace("-g $GPUS", "-g $GPUS -c"), a, TOPO_A, gpus=2)
    assert d["dump"] == "0", case.log("dump.log")[-3000:]
    assert d["checks"] == expect
    kfds = [n for n in os.listdir(os.path.join(case.work, "img")) if n.startswith("amdgpu-kfd-")]
    assert len(kfds) == 2, kfds                      # one KFD process per task
    dump_log = case.log("dump.log")
    assert "amdgpu_plugin: devices:2 bos:14 objects:0" in dump_log
    assert "amdgpu_plugin: devices:2 bos:10 objects:0" in dump_log
    r = case.run(RESTORE, a, TOPO_A)
    log = case.log("restore.log")
    assert r["restore"] == "0", log[-3000:]
    assert r["checks"] == expect
    assert "amdgpu_plugin: Parallel restore disabled" in log
    assert "Begin to send parallel restore cmd" not in log
    # each restored task (CRIU's log names it by pid) restores its own BOs, one thread per GPU:
    # the parent's 6 VRAM/GTT BOs per GPU, the child's 4
    with open(os.path.join(case.work, "ready")) as f:
        parent = int(f.read().split()[1])
    done = {(int(p), g, int(n)) for p, g, n in
            re.findall(r" (\d+): amdgpu_plugin: Thread\[(0x[0-9a-f]+)\] done num_bos:(\d+) ret:0\n", log)}
    children = {p for p, _, _ in done} - {parent}
    assert len(children) == 1, done
    child = children.pop()
    assert done == {(pid, gpu, n) for pid, n in ((parent, 6), (child, 4)) for gpu in ("0x5d21", "0xa3f0")}
    for pid in (parent, child):
        for gpu in ("0x5d21", "0xa3f0"):
            assert f"{pid}: amdgpu_plugin: Thread[{gpu}] finished ret:0" in log
        assert f"{pid}: amdgpu_plugin: Restore successful" in log
    assert "restore late ioctl failed" not in log
    c = case.model.counters(a)
    assert (c["calls"]["process_info"], c["calls"]["checkpoint"], c["calls"]["unpause"]) == (2, 2, 2)
    assert (c["calls"]["restore"], c["calls"]["resume"]) == (2, 2)


def test_two_gpus_one_process_restore_reports_success_with_a_gpus_bos_unfilled(case):
    """Found with the models: the plugin's parallel restore (restore_bo_data()) accumulates one
    pages-file read offset over the BOs of all GPUs, but each GPU has its own amdgpu-pages file,
    so the second GPU in device order reads from past its file's end ("Unable to read file").
    sdma_copy_bo() then loses that error (its cleanup calls assign err, the last one 0), so the
    parallel thread reports success, RESUME runs, criu restore exits 0, and the restored process
    finds that GPU's BOs unfilled (zeros; the first bad one is BO 1, on GPU 0x5D21)."""
    a = case.state("state-a", TOPO_A)
    d = case.run(DUMP, a, TOPO_A, gpus=2)
    assert d["dump"] == "0", case.log("dump.log")[-3000:]
    assert d["checks"] == f"ok 14 {2 * MIB << 20}\n"
    r = case.run(RESTORE, a, TOPO_A, gpus=2)
    log = case.log("restore.log")
    assert "amdgpu_plugin: Begin to send parallel restore cmd" in log
    assert log.count("amdgpu_plugin: Unable to read file") == 6      # the 6 VRAM/GTT BOs of one GPU
    assert "Parallel restore fail" not in log                         # the error was lost
    assert r["restore"] == "0"
    assert r["checks"] == "bad bo 1 offset 0\n"
    assert case.model.counters(a)["calls"]["resume"] == 1


def test_process_tree_restore_fails_when_the_second_tasks_restore_fails(case):
    """The process tree of the test above, RESTORE failing (EIO) for the second KFD process only:
    criu restore fails and leaves no task of the tree, although the first task's RESTORE
    succeeded."""
    a = case.state("state-a", TOPO_A)
    d = case.run(DUMP.replace("-g $GPUS", "-g $GPUS -c"), a, TOPO_A, gpus=2)
    assert d["dump"] == "0", case.log("dump.log")[-3000:]
    case.model.inject(a, "restore", 5, skip=1)
    r = case.run(RESTORE, a, TOPO_A)
    log = case.log("restore.log")
    assert r["restore"] != "0" and r["alive"] == "no", log[-3000:]
    assert log.count("amdgpu_plugin: Restore ioctl failed") == 1
    c = case.model.counters(a)
    # the first task's RESTORE succeeded, the second's failed, nothing was resumed
    assert (c["calls"]["restore"], c["fails"]["restore"], c["calls"]["resume"]) == (2, 1, 0)
