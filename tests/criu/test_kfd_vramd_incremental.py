"""Incremental dumps through the vramd-patched amdgpu plugin (contrib/criu, 0002): CRIU's
--prev-images-dir chain maps to vramd parents.  On the KFD model + SDMA model inside a real CRIU,
THIS RUNS ON MODELS, NOT A GPU.  Skipped as test_kfd_vramd_plugin.py is (CRIU_SRC, CRIU_BIN, root,
libvramd)."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import test_kfd_vramd_plugin as base
from kfd_harness import REPO
from test_kfd_stock_plugin import MIB, RESTORE, START, TOPO_A
from test_kfd_vramd_plugin import _ok, _vramctl_verify

# test_kfd_vramd_plugin.py's skip condition and fixtures (the series applied and built once per module)
pytestmark = base.pytestmark
plugins, model, daemon, case = base.plugins, base.model, base.daemon, base.case

# First what this kernel's CRIU says to an incremental dump: --track-mem, pre-dump, and
# --prev-images-dir alone (on a second, small process, so that a dump CRIU fails after the plugin
# paused its queues does not touch the one the chain dumps).  Then three dumps of one running
# process, each into its own directory, the 2nd and 3rd with KFD_VRAMD_PARENT naming the one
# before (relative to the images directory, as --prev-images-dir takes it); the first two leave
# the process running, and the workload checks every byte after each.  Between the 1st and the 2nd
# the workload rewrites one VRAM BO (SIGHUP); between the 2nd and the 3rd nothing changes.  A 4th
# dump with KFD_VRAMD_MAX_CHAIN=2 would make a chain of 3: it is a full image again.
CHAIN = START + r"""
rm -rf $W/img $W/ready $W/probe; mkdir -p $W/img $W/probe/track $W/probe/pre $W/probe/1 $W/probe/2
$WL -m 8 -g 1 $W/probe/report > $W/probe/ready 2>$W/probe/wl.err < /dev/null &
wait_for $W/probe/ready || { cat $W/probe/wl.err; exit 1; }
ppid=$(awk '{print $2}' $W/probe/ready)
D="$CRIU dump -t $ppid -o dump.log -v4 --libdir $W/plugins --shell-job --leave-running"
$D -D $W/probe/track --track-mem; echo "track-mem: $?"
$CRIU pre-dump -t $ppid -D $W/probe/pre -o pre-dump.log -v4 --libdir $W/plugins --shell-job 2>/dev/null
echo "pre-dump: $?"
$D -D $W/probe/1; echo "probe1: $?"
$D -D $W/probe/2 --prev-images-dir ../1; echo "prev-images-dir: $?"
kill -KILL $ppid
$WL -m $MIB -g $GPUS $W/report > $W/ready 2>$W/wl.err < /dev/null &
wait_for $W/ready || { cat $W/wl.err; exit 1; }
pid=$(awk '{print $2}' $W/ready); echo "pid: $pid"
check $pid
for n in 1 2 3 4; do
    mkdir -p $W/img/$n
    keep=--leave-running; [ $n = 4 ] && keep=
    if [ $n = 1 ]; then unset KFD_VRAMD_PARENT; else export KFD_VRAMD_PARENT=../$((n - 1)); fi
    [ $n = 4 ] && export KFD_VRAMD_MAX_CHAIN=2
    $CRIU dump -t $pid -D $W/img/$n -o dump.log -v4 --libdir $W/plugins --shell-job $keep
    echo "dump$n: $?"
    [ $n = 4 ] || check $pid
    if [ $n = 1 ]; then rm -f $W/report; kill -HUP $pid && wait_for $W/report && echo "change: $(cat $W/report)"; fi
done
if alive $pid; then echo "alive: yes"; kill -TERM $pid; else echo "alive: no"; fi
"""


def _inspect(path: str) -> dict:
    r = subprocess.run([sys.executable, "-m", "vramd.cli", "inspect", "--json", path], capture_output=True,
                       text=True, cwd=str(REPO))
    assert r.returncode == 0, r.stdout + r.stderr
    return json.loads(r.stdout)


def _probe(case, n: str, name: str) -> str:
    with open(os.path.join(case.work, "probe", n, name), errors="replace") as f:
        return f.read()


def _log(case, n: str, name: str) -> str:
    with open(os.path.join(case.work, "img", n, name), errors="replace") as f:
        return f.read()


def test_incremental_chain_of_three_dumps_each_restored_byte_exact(case, plugins, daemon):
    """dump 1 full, dump 2 with KFD_VRAMD_PARENT=../1, dump 3 with ../2 (CRIU here refuses its own incremental
    dumps, see CHAIN): the plugin finds the previous dump's amdgpu-vramd-<id>/ and hands it (and its own
    parents, nearest first) to vramd, so the 2nd and 3rd images refer to the 1st's chunks and store less (the
    2nd only the BO the workload rewrote, the 3rd nothing) (vramctl inspect); each of the three restores byte-
    exact by the workload's own check, the 3rd through two parents; without its parents' directories the 3rd is
    refused naming the missing parent."""
    case.use(plugins["vramd"])
    a = case.state("state-a", TOPO_A)
    env = case.env(daemon.socket)
    d = case.run(CHAIN, a, TOPO_A, gpus=2, extra=env)
    assert (d["dump1"], d["dump2"], d["dump3"]) == ("0", "0", "0"), d["stdout"] + d["stderr"]
    assert d["dump4"] == "0", d["stdout"]
    _ok(d["checks"], 4, 14, 2 * MIB << 20)                   # before, after dumps 1, 2 and 3
    # what CRIU itself does without memory dirty tracking (where the kernel has it, CRIU's own chain
    # works and the plugin follows CRIU's `parent` link instead of KFD_VRAMD_PARENT)
    assert d["probe1"] == "0", d["stdout"]
    if d["track-mem"] != "0":
        assert "Tracking memory is not available" in _probe(case, "track", "dump.log")
        assert d["pre-dump"] != "0"
        assert "BUG at criu/mem.c" in _probe(case, "pre", "pre-dump.log")
        assert d["prev-images-dir"] != "0"
        assert "Pid-reuse detection failed: no parent inventory" in _probe(case, "2", "dump.log")
    dirs = {}
    for n in ("1", "2", "3"):
        names = [x for x in os.listdir(os.path.join(case.work, "img", n)) if x.startswith("amdgpu-vramd-")]
        assert len(names) == 1, names
        dirs[n] = names[0]
    assert len(set(dirs.values())) == 1, dirs                # the KFD file's id is the same in every dump
    vdir = dirs["1"]
    # the chain, recorded in the images: each incremental image's directory links to its parent's
    assert not os.path.lexists(os.path.join(case.work, "img", "1", vdir, "parent"))
    for n in ("2", "3"):
        assert os.readlink(os.path.join(case.work, "img", n, vdir, "parent")) == f"../../{int(n) - 1}/{vdir}"
    info = {n: _inspect(os.path.join(case.work, "img", n, vdir)) for n in ("1", "2", "3")}
    assert [len(info[n]["parents"]) for n in ("1", "2", "3")] == [0, 1, 2]
    assert info["3"]["parents"][0]["image_id"] == info["2"]["image_id"]
    assert info["3"]["parents"][1]["image_id"] == info["1"]["image_id"]
    assert info["2"]["parents"][0]["recorded_at"] == "parent"
    first = info["1"]["totals"]["stored_bytes"]
    assert first > 0
    for n in ("2", "3"):
        t = info[n]["totals"]
        assert t["bo_bytes"] == info["1"]["totals"]["bo_bytes"]
        assert t["stored_bytes"] < first and t["referenced_bytes"] > 0, (n, t, first)
    # the 2nd stores the BO the workload rewrote, and only it; the 3rd (nothing changed) stores nothing
    m = re.fullmatch(r"changed bo \d+ (\d+)", d["change"])
    assert m, d["stdout"]
    size = int(m.group(1))
    (changed,) = [b for b in info["2"]["bos"] if b["stored_bytes"]]
    assert changed["size"] == size and changed["referenced_bytes"] == 0, changed
    assert size // 2 <= changed["stored_bytes"] <= size + 4096, changed
    assert info["2"]["totals"]["stored_bytes"] == changed["stored_bytes"]
    assert info["3"]["totals"]["stored_bytes"] == 0, info["3"]["totals"]
    for n in ("1", "2", "3"):
        log = _log(case, n, "dump.log")
        chain = int(n) - 1
        assert re.search(rf"vramd: 12 BOs dumped into {vdir}/ \({chain} parents, \d+ bytes stored\)", log), n
        v = _vramctl_verify(os.path.join(case.work, "img", n, vdir))
        assert v.returncode == 0, v.stdout + v.stderr
    for n in ("1", "2", "3"):
        r = case.run(RESTORE.replace("-D $W/img ", f"-D $W/img/{n} "), a, TOPO_A, extra=env)
        log = _log(case, n, "restore.log")
        assert r["restore"] == "0", log[-3000:]
        _ok(r["checks"], 1, 14, 2 * MIB << 20)
        assert ("is incremental, restored through" in log) == (n != "1"), n
        if n == "3":
            assert f"vramd: {vdir}/ is incremental, restored through 2 parents" in log
    # KFD_VRAMD_MAX_CHAIN=2: the 4th is full again
    log = _log(case, "4", "dump.log")
    assert f"vramd: ../3/{vdir}/ has 2 parents; KFD_VRAMD_MAX_CHAIN is 2: a full image" in log, log[-3000:]
    assert re.search(rf"vramd: 12 BOs dumped into {vdir}/ \(0 parents, {first} bytes stored\)", log), log[-3000:]
    assert not os.path.lexists(os.path.join(case.work, "img", "4", vdir, "parent"))
    # the chain is needed: the 1st image's directory gone, the 3rd no longer restores
    os.rename(os.path.join(case.work, "img", "1"), os.path.join(case.work, "img", "1-moved"))
    r = case.run(RESTORE.replace("-D $W/img ", "-D $W/img/3 "), a, TOPO_A, extra=env)
    log = _log(case, "3", "restore.log")
    assert r["restore"] != "0" and r["alive"] == "no", log[-3000:]
    assert f"vramd: cannot open parent 2 of {vdir}/, {vdir}/parent/parent" in log, log[-3000:]
