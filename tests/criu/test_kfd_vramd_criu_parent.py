"""Incremental dumps through CRIU's OWN parent link (CriuOpts.parent_img, the CLI's --prev-images-dir)
with the vramd-patched amdgpu plugin (contrib/criu, 0002 follows CRIU's link "parent").  On the KFD
model + SDMA model inside a real CRIU: THIS RUNS ON MODELS, NOT A GPU.

This kernel has no memory dirty tracking, so the CLI refuses CRIU's own chain (test_kfd_vramd_
incremental.py asserts how).  Through CRIU's RPC (`criu swrk`, criu_rpc.py) with a pidfd store the
chain runs: CRIU dumps every page of the task's memory in full each time (nothing is soft-dirty
tracked) but writes its `parent` link, and the plugin hands the previous checkpoint's vramd image to
vramd as the parent.  Skipped as test_kfd_vramd_plugin.py is (CRIU_SRC, CRIU_BIN, root, libvramd).
"""
from __future__ import annotations

import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import criu_rpc
import test_kfd_vramd_plugin as base
from test_kfd_stock_plugin import MIB, RESTORE, START, TOPO_A
from test_kfd_vramd_incremental import _inspect
from test_kfd_vramd_plugin import ENV, _ok, _vramctl_verify

pytestmark = base.pytestmark
plugins, model, daemon, case = base.plugins, base.model, base.daemon, base.case

# One running workload, three RPC dumps into img/1, img/2, img/3 (the 2nd and 3rd with parent_img
# ../1 and ../2; KFD_VRAMD_PARENT unset), the first two leaving it running; after the 1st the workload
# rewrites one VRAM BO (SIGHUP), after the 2nd nothing changes; every byte checked after each.
CHAIN = START + r"""
rm -rf $W/img $W/ready; mkdir -p $W/img
$WL -m $MIB -g $GPUS $W/report > $W/ready 2>$W/wl.err < /dev/null &
wait_for $W/ready || { cat $W/wl.err; exit 1; }
pid=$(awk '{print $2}' $W/ready); echo "pid: $pid"
check $pid
export W; export -f wait_for check
export RPC_STEP='check $2; [ $1 = 1 ] || exit 0
rm -f $W/report; kill -HUP $2 && wait_for $W/report && echo "change: $(cat $W/report)"'
unset KFD_VRAMD_PARENT
CRIU_LIBS_DIR=$W/plugins $PY $RPC_CLIENT chain $pid $W/img 3; echo "client: $?"
if alive $pid; then echo "alive: yes"; kill -TERM $pid; else echo "alive: no"; fi
"""


def _read(case, *path: str) -> str:
    with open(os.path.join(case.work, "img", *path), errors="replace") as f:
        return f.read()


def test_criu_parent_link_chain_of_three_stores_only_changed_chunks_and_restores_byte_exact(case, plugins,
                                                                                          daemon, tmp_path):
    """criu swrk DUMP x 3 with parent_img and a pidfd store: CRIU writes img/N/parent -> ../N-1 and
    accepts the chain (after refusing it while the store is empty); the plugin follows CRIU's link (its
    image's own link is ../parent/amdgpu-vramd-<id>), so the 2nd image stores only the BO the workload
    rewrote and the 3rd nothing (vramctl inspect --json); CRIU's own pages are dumped in full each time
    (no dirty tracking); each image restores byte-exact by the workload's check, the 3rd through both
    parents, and not at all once the 1st is gone."""
    case.use(plugins["vramd"])
    a = case.state("state-a", TOPO_A)
    env = case.env(daemon.socket)
    rpc = {"PY": sys.executable, "RPC_CLIENT": criu_rpc.__file__,
           "RPC_PB2_DIR": criu_rpc.generate(ENV.criu_src or "", str(tmp_path / "rpc"))}
    d = case.run(CHAIN, a, TOPO_A, gpus=2, extra={**env, **rpc})
    assert (d.get("dump1"), d.get("dump2"), d.get("dump3")) == ("0", "0", "0"), d["stdout"] + d["stderr"]
    assert d["client"] == "0" and d["alive"] == "no", d["stdout"]       # the 3rd did not leave it running
    _ok(d["checks"], 3, 14, 2 * MIB << 20)                                  # before, after dumps 1 and 2
    # CRIU refuses a parent while the store is empty (what pre-dump, which needs dirty tracking, fills)
    assert d["empty-store"] == "1", d["stdout"]
    assert "No pidfds found in pidfd store" in _read(case, "2-empty-store", "dump.log")
    assert not [n for n in os.listdir(os.path.join(case.work, "img", "2-empty-store")) if n.startswith("amdgpu")]
    for n in ("2", "3"):
        assert os.readlink(os.path.join(case.work, "img", n, "parent")) == f"../{int(n) - 1}"
        log = _read(case, n, "dump.log")
        assert "Pid reuse" not in log and "Pid-reuse detection failed" not in log, n
    assert not os.path.lexists(os.path.join(case.work, "img", "1", "parent"))
    (vdir,) = [x for x in os.listdir(os.path.join(case.work, "img", "1")) if x.startswith("amdgpu-vramd-")]
    for n in ("2", "3"):
        assert os.path.isdir(os.path.join(case.work, "img", n, vdir)), os.listdir(os.path.join(case.work, "img", n))
        # the plugin took CRIU's link, not KFD_VRAMD_PARENT (unset; its param line says so)
        assert os.readlink(os.path.join(case.work, "img", n, vdir, "parent")) == f"../parent/{vdir}"
        assert "KFD_VRAMD_PARENT:\n" in _read(case, n, "dump.log")
    info = {n: _inspect(os.path.join(case.work, "img", n, vdir)) for n in ("1", "2", "3")}
    assert [len(info[n]["parents"]) for n in ("1", "2", "3")] == [0, 1, 2]
    assert [p["image_id"] for p in info["3"]["parents"]] == [info["2"]["image_id"], info["1"]["image_id"]]
    assert info["2"]["parents"][0]["image_id"] == info["1"]["image_id"]
    first = info["1"]["totals"]["stored_bytes"]
    m = re.fullmatch(r"changed bo \d+ (\d+)", d["change"])
    assert m and first > 0, d["stdout"]
    size = int(m.group(1))
    (changed,) = [b for b in info["2"]["bos"] if b["stored_bytes"]]
    assert changed["size"] == size and changed["referenced_bytes"] == 0, changed
    assert size // 2 <= changed["stored_bytes"] <= size + 4096, changed
    assert info["2"]["totals"]["stored_bytes"] == changed["stored_bytes"] < first
    assert info["3"]["totals"]["stored_bytes"] == 0, info["3"]["totals"]
    for n in ("2", "3"):
        assert info[n]["totals"]["bo_bytes"] == info["1"]["totals"]["bo_bytes"]
        assert info[n]["totals"]["referenced_bytes"] > 0, info[n]["totals"]
    # CRIU's own memory: no dirty tracking, so each dump's pages are full, none left in the parent
    pages = {n: sum(os.path.getsize(os.path.join(case.work, "img", n, f))
                    for f in os.listdir(os.path.join(case.work, "img", n)) if re.fullmatch(r"pages-\d+\.img", f))
             for n in ("1", "2", "3")}
    assert pages["1"] > 0 and pages["2"] >= pages["1"] // 2 and pages["3"] >= pages["1"] // 2, pages
    for n in ("1", "2", "3"):
        log = _read(case, n, "dump.log")
        assert re.search(rf"vramd: 12 BOs dumped into {vdir}/ \({int(n) - 1} parents, \d+ bytes stored\)", log), n
        v = _vramctl_verify(os.path.join(case.work, "img", n, vdir))
        assert v.returncode == 0, v.stdout + v.stderr
    for n in ("3", "2", "1"):
        r = case.run(RESTORE.replace("-D $W/img ", f"-D $W/img/{n} "), a, TOPO_A, extra=env)
        log = _read(case, n, "restore.log")
        assert r["restore"] == "0", log[-3000:]
        _ok(r["checks"], 1, 14, 2 * MIB << 20)
        assert ("is incremental, restored through" in log) == (n != "1"), n
    assert f"vramd: {vdir}/ is incremental, restored through 2 parents" in _read(case, "3", "restore.log")
    # the chain is needed.  The 1st checkpoint's vramd image moved away (CRIU's own chain intact): the
    # plugin refuses the 3rd naming the missing parent; the whole 1st checkpoint moved away: CRIU itself
    # refuses before the plugin, as it opens its parents' page images (all pages are in the 3rd)
    img1 = os.path.join(case.work, "img", "1")
    os.rename(os.path.join(img1, vdir), os.path.join(case.work, "img", "vramd-1-moved"))
    r = case.run(RESTORE.replace("-D $W/img ", "-D $W/img/3 "), a, TOPO_A, extra=env)
    log = _read(case, "3", "restore.log")
    assert r["restore"] != "0" and r["alive"] == "no", log[-3000:]
    assert f"vramd: cannot open parent 2 of {vdir}/, {vdir}/parent/parent" in log, log[-3000:]
    os.rename(img1, img1 + "-moved")
    r = case.run(RESTORE.replace("-D $W/img ", "-D $W/img/3 "), a, TOPO_A, extra=env)
    log = _read(case, "3", "restore.log")
    assert r["restore"] != "0" and r["alive"] == "no", log[-3000:]
    assert "Can't open parent path: No such file or directory" in log, log[-3000:]
    assert "vramd: cannot open parent" not in log, log[-3000:]


def test_a_checkpoint_without_a_vramd_image_in_criu_s_chain_is_looked_through(case, plugins, daemon, tmp_path):
    """As after a pre-dump (whose hooks copy no BO; this kernel cannot pre-dump): the 2nd of three RPC
    dumps goes the stock path (KFD_VRAMD=0: amdgpu-pages files, no vramd image), so the 3rd's CRIU
    parent holds no image of the KFD file; the plugin follows the 2nd's own `parent` link to the 1st's
    image (its link ../parent/parent/amdgpu-vramd-<id>), the 3rd stores nothing (nothing changed) and
    restores byte-exact through that parent."""
    case.use(plugins["vramd"])
    a = case.state("state-a", TOPO_A)
    env = case.env(daemon.socket)
    rpc = {"PY": sys.executable, "RPC_CLIENT": criu_rpc.__file__, "RPC_ENV_2": "KFD_VRAMD=0",
           "RPC_PB2_DIR": criu_rpc.generate(ENV.criu_src or "", str(tmp_path / "rpc"))}
    d = case.run(CHAIN.replace("[ $1 = 1 ] || exit 0", "exit 0"), a, TOPO_A, gpus=2, extra={**env, **rpc})
    assert (d.get("dump1"), d.get("dump2"), d.get("dump3")) == ("0", "0", "0"), d["stdout"] + d["stderr"]
    _ok(d["checks"], 3, 14, 2 * MIB << 20)
    (vdir,) = [x for x in os.listdir(os.path.join(case.work, "img", "1")) if x.startswith("amdgpu-vramd-")]
    two = os.listdir(os.path.join(case.work, "img", "2"))
    assert vdir not in two and [x for x in two if x.startswith("amdgpu-pages-")], two
    log = _read(case, "3", "dump.log")
    assert f"vramd: no vramd image parent/{vdir}/, looking in its parent parent/parent/" in log, log[-3000:]
    assert os.readlink(os.path.join(case.work, "img", "3", vdir, "parent")) == f"../parent/parent/{vdir}"
    info = _inspect(os.path.join(case.work, "img", "3", vdir))
    first = _inspect(os.path.join(case.work, "img", "1", vdir))
    assert [p["image_id"] for p in info["parents"]] == [first["image_id"]], info["parents"]
    assert info["totals"]["stored_bytes"] == 0 < first["totals"]["stored_bytes"], info["totals"]
    assert re.search(rf"vramd: 12 BOs dumped into {vdir}/ \(1 parents, 0 bytes stored\)", log), log[-3000:]
    r = case.run(RESTORE.replace("-D $W/img ", "-D $W/img/3 "), a, TOPO_A, extra=env)
    rlog = _read(case, "3", "restore.log")
    assert r["restore"] == "0", rlog[-3000:]
    _ok(r["checks"], 1, 14, 2 * MIB << 20)
    assert f"vramd: {vdir}/ is incremental, restored through 1 parents" in rlog


def test_a_process_tree_through_criu_s_parent_link_makes_each_kfd_file_s_image_incremental(case, plugins, daemon,
                                                                                            tmp_path):
    """A parent and a child, each its own KFD process (two KFD files, two vramd images per checkpoint,
    their copies overlapped by patch 0003): the client queues a pidfd for each task, CRIU takes both
    through the chain without a pid-reuse warning, each KFD file's image refers to its own previous one
    (0, 1, 2 parents); the 2nd stores only the BO the parent rewrote (the child's image nothing), the
    3rd nothing; the 3rd restores byte-exact in both processes, each image through its 2 parents."""
    case.use(plugins["vramd"])
    a = case.state("state-a", TOPO_A)
    env = case.env(daemon.socket)
    rpc = {"PY": sys.executable, "RPC_CLIENT": criu_rpc.__file__,
           "RPC_PB2_DIR": criu_rpc.generate(ENV.criu_src or "", str(tmp_path / "rpc"))}
    d = case.run(CHAIN.replace("-g $GPUS", "-g $GPUS -c"), a, TOPO_A, gpus=2, extra={**env, **rpc})
    assert (d.get("dump1"), d.get("dump2"), d.get("dump3")) == ("0", "0", "0"), d["stdout"] + d["stderr"]
    expect = f"ok 14 {2 * MIB << 20}; child ok 10 {2 * 4 << 20}"
    assert d["tasks"] == "2" and d["checks"] == f"{expect}\n" * 3, d["stdout"]
    vdirs = {n: sorted(x for x in os.listdir(os.path.join(case.work, "img", n)) if x.startswith("amdgpu-vramd-"))
             for n in ("1", "2", "3")}
    assert len(vdirs["1"]) == 2 and vdirs["1"] == vdirs["2"] == vdirs["3"], vdirs
    for n in ("2", "3"):
        assert "Pid reuse" not in _read(case, n, "dump.log"), n
    info = {(n, v): _inspect(os.path.join(case.work, "img", n, v)) for n in ("1", "2", "3") for v in vdirs["1"]}
    (big,) = [v for v in vdirs["1"] if info[("1", v)]["totals"]["bo_count"] == 12]   # the parent's KFD file
    (small,) = [v for v in vdirs["1"] if v != big]
    for v in vdirs["1"]:
        assert [len(info[(n, v)]["parents"]) for n in ("1", "2", "3")] == [0, 1, 2], v
        assert info[("3", v)]["parents"][1]["image_id"] == info[("1", v)]["image_id"], v
        assert os.readlink(os.path.join(case.work, "img", "3", v, "parent")) == f"../parent/{v}"
        assert info[("1", v)]["totals"]["stored_bytes"] > 0 and info[("3", v)]["totals"]["stored_bytes"] == 0, v
    m = re.fullmatch(r"changed bo \d+ (\d+)", d["change"])
    assert m, d["stdout"]
    (changed,) = [b for b in info[("2", big)]["bos"] if b["stored_bytes"]]
    assert changed["size"] == int(m.group(1)) and info[("2", small)]["totals"]["stored_bytes"] == 0, changed
    r = case.run(RESTORE.replace("-D $W/img ", "-D $W/img/3 "), a, TOPO_A, extra=env)
    log = _read(case, "3", "restore.log")
    assert r["restore"] == "0", log[-3000:]
    assert r["checks"] == f"{expect}\n", r["stdout"]
    for v in vdirs["1"]:
        assert f"vramd: {v}/ is incremental, restored through 2 parents" in log, v
