"""Restoring a CRIU checkpoint whose BO contents are in a registry (docs/criu-integration.md, "Restoring from a
registry"), inside a real CRIU with the patched amdgpu plugin (test_kfd_vramd_plugin.py's fixtures) on the KFD
and SDMA models, against the real registry (Debian's docker-registry, TLS + htpasswd: tests/registry_fixtures.py).
THIS RUNS ON MODELS, NOT A GPU.

The flow under test is the documented one: after `criu dump`, each `amdgpu-vramd-<id>/` is pushed with
`vramctl push` to `REPO:TAG-<id>`; on the restoring node, for each `amdgpu-kfd-<id>.img` of CRIU's images,
`vramctl pull REPO:TAG-<id> IMAGES/amdgpu-vramd-<id>`, then `criu restore`.  The credentials are a
docker config.json given to vramctl only: CRIU and the daemon never talk to the registry.
"""
from __future__ import annotations

import base64
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import textwrap

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import test_kfd_vramd_plugin as base
from kfd_harness import REPO
from test_kfd_stock_plugin import DUMP, MIB, RESTORE, START, TOPO_A
from test_kfd_vramd_plugin import running_daemon

pytestmark = base.pytestmark
plugins, model, case = base.plugins, base.model, base.case

TREE = DUMP.replace("-g $GPUS", "-g $GPUS -c")
DOC = REPO / "docs" / "criu-integration.md"
# docs/criu-integration.md's two loops, as written there (the test asserts it), run with HOST/REPO:TAG and
# IMAGES filled in and `vramctl` a shell function adding the registry options
PUSH_LOOP = """for d in IMAGES/amdgpu-vramd-*/; do          # one vramd image per KFD file (one per process of the tree)
    id=${d%/}; id=${id##*-}
    vramctl push "$d" "HOST/REPO:TAG-$id"    # needs push rights; uploads only the blobs the registry lacks
done
"""
PULL_LOOP = """for f in IMAGES/amdgpu-kfd-*.img; do
    id=${f##*/amdgpu-kfd-}; id=${id%.img}
    vramctl pull "HOST/REPO:TAG-$id" "IMAGES/amdgpu-vramd-$id" || exit 1   # stop: no restore
done
"""
KFD_IMG = re.compile(r"^amdgpu-kfd-(\d+)\.img$")
EXPECT_TREE = f"ok 14 {2 * MIB << 20}; child ok 10 {2 * 4 << 20}\n"


def vramctl(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "vramd.cli", *args], capture_output=True, text=True, cwd=str(REPO),
                          timeout=300)


def auth_file(path: str, host: str, user: str, password: str) -> list[str]:
    """A docker config.json (mode 0600) holding the registry's credentials, and the option naming it."""
    token = base64.b64encode(f"{user}:{password}".encode()).decode()
    with open(path, "w") as f:
        json.dump({"auths": {host: {"auth": token}}}, f)
    os.chmod(path, 0o600)
    return ["--registry-config", path]


def documented(loop: str, img: str, ref: str, opts: list[str]) -> subprocess.CompletedProcess[str]:
    """One of the documented loops, run by bash as written there."""
    text = DOC.read_text()
    assert loop in text or textwrap.indent(loop, "   ") in text, "docs/criu-integration.md's loop changed"
    script = (f"set -u\nvramctl() {{ {shlex.quote(sys.executable)} -m vramd.cli \"$@\" {shlex.join(opts)}; }}\n"
              + loop.replace("IMAGES", shlex.quote(img)).replace("HOST/REPO:TAG", ref))
    return subprocess.run(["bash", "-c", script], capture_output=True, text=True, cwd=str(REPO), timeout=600)


def kfd_ids(img: str) -> list[str]:
    return sorted(m[1] for n in os.listdir(img) if (m := KFD_IMG.match(n)))


def files_of(d: str) -> dict[str, bytes]:
    out = {}
    for n in sorted(os.listdir(d)):
        with open(os.path.join(d, n), "rb") as f:
            out[n] = f.read()
    return out


def test_a_tree_restored_from_vramd_images_pulled_from_the_registry(case, plugins, htpasswd_registry, tmp_path):
    """The two-process tree dumped through vramd (two KFD files, two vramd images), each image pushed to
    the registry by the documented loop (TLS, htpasswd, credentials in a config.json), the vramd images
    removed from the images directory and the dump's daemon stopped; on the restoring side another daemon,
    each image pulled back into place by its KFD file's id (the documented loop), the same files as dumped,
    and `criu restore` byte-exact in both processes."""
    from registry_fixtures import REGISTRY_USERS

    reg = htpasswd_registry
    opts = ["--ca-file", str(reg.ca_file), *auth_file(str(tmp_path / "config.json"), reg.host, "alice",
                                                      REGISTRY_USERS["alice"])]
    case.use(plugins["vramd"])
    a = case.state("state-a", TOPO_A)
    img = os.path.join(case.work, "img")
    with running_daemon() as d:
        env = case.env(d.socket, KFD_VRAMD="1")
        dumped = case.run(TREE, a, TOPO_A, gpus=2, extra=env)
        assert dumped["dump"] == "0", case.log("dump.log")[-3000:]
        assert dumped["checks"] == EXPECT_TREE
    ids = kfd_ids(img)
    assert len(ids) == 2 and case.vramd_dirs() == [f"amdgpu-vramd-{i}" for i in ids], case.img()
    r = documented(PUSH_LOOP, img, f"{reg.host}/ckpt/job:1", opts)
    assert r.returncode == 0, r.stderr
    pushed = r.stdout.splitlines()
    assert [ln.split()[3] for ln in pushed] == [f"{reg.host}/ckpt/job:1-{i}" for i in ids], r.stdout
    assert all(" uploaded 0 blob(s)" not in ln for ln in pushed), r.stdout
    kept = {}
    for i in ids:
        vdir = os.path.join(img, f"amdgpu-vramd-{i}")
        kept[i] = files_of(vdir)
        shutil.rmtree(vdir)
    assert case.vramd_dirs() == []
    # the restoring node: its own daemon; the documented loop over CRIU's KFD images, then criu restore
    with running_daemon() as d:
        env = case.env(d.socket, KFD_VRAMD="1")
        r = documented(PULL_LOOP, img, f"{reg.host}/ckpt/job:1", opts)
        assert r.returncode == 0, r.stderr
        assert [ln.split()[1] for ln in r.stdout.splitlines()] == [f"{reg.host}/ckpt/job:1-{i}" for i in ids], \
            r.stdout
        for i in ids:
            assert files_of(os.path.join(img, f"amdgpu-vramd-{i}")) == kept[i]
        restored = case.run(RESTORE, a, TOPO_A, extra=env)
        log = case.log("restore.log")
        assert restored["restore"] == "0", log[-3000:]
        assert restored["checks"] == EXPECT_TREE
    submitted = re.findall(r" amdgpu_plugin: vramd: \d+ BOs submitted from (amdgpu-vramd-\d+)/\n", log)
    assert sorted(submitted) == [f"amdgpu-vramd-{i}" for i in ids], log[-3000:]
    assert REGISTRY_USERS["alice"] not in reg.output()


def test_a_reference_that_does_not_exist_fails_the_pull_in_one_line_and_kfd_vramd_1_fails_the_restore(
        case, plugins, htpasswd_registry, tmp_path):
    """One process dumped through vramd, its image pushed, then removed locally; the restoring side pulls a
    tag that was never pushed: vramctl fails with one line naming the reference, and leaves no directory.
    A `criu restore` run regardless (the documented flow stops at the failed pull): with KFD_VRAMD=1 the
    restored task's RESTORE_EXT_FILE fails naming the missing directory (patch 0006), criu exits non-zero and
    no task runs on; without it the plugin takes the stock path, whose offloaded restore fails on the missing
    amdgpu-pages files in a way CRIU only logs: criu exits 0 and the task runs with its BOs never restored
    (the workload's own check finds the first one wrong), which is why the documented flow sets KFD_VRAMD=1."""
    from registry_fixtures import REGISTRY_USERS

    reg = htpasswd_registry
    opts = ["--ca-file", str(reg.ca_file), *auth_file(str(tmp_path / "config.json"), reg.host, "alice",
                                                      REGISTRY_USERS["alice"])]
    case.use(plugins["vramd"])
    a = case.state("state-a", TOPO_A)
    img = os.path.join(case.work, "img")
    with running_daemon() as d:
        env = case.env(d.socket, KFD_VRAMD="1")
        dumped = case.run(DUMP, a, TOPO_A, gpus=1, extra=env)
        assert dumped["dump"] == "0", case.log("dump.log")[-3000:]
        (i,) = kfd_ids(img)
        vdir = os.path.join(img, f"amdgpu-vramd-{i}")
        assert vramctl("push", vdir, f"{reg.host}/ckpt/job:1-{i}", *opts).returncode == 0
        shutil.rmtree(vdir)
        r = vramctl("pull", f"{reg.host}/ckpt/job:2-{i}", vdir, *opts)
        assert r.returncode == 1 and r.stderr.count("\n") == 1, r.stderr
        # "vramctl: NOT_FOUND: registry HOST: HOST/ckpt/job:2-<id>: not found (HTTP 404 MANIFEST_UNKNOWN): ..."
        assert r.stderr.startswith(f"vramctl: NOT_FOUND: registry {reg.host}: {reg.host}/ckpt/job:2-{i}: not found"), \
            r.stderr
        assert REGISTRY_USERS["alice"] not in r.stderr
        assert not os.path.exists(vdir) and case.vramd_dirs() == []
        restored = case.run(RESTORE, a, TOPO_A, extra=env)
        log = case.log("restore.log")
        assert restored["restore"] != "0" and restored["alive"] == "no", log[-3000:]
        lines = [ln for ln in log.splitlines() if "vramd: KFD_VRAMD=1 but the BO contents" in ln]
        assert len(lines) == 1 and lines[0].endswith(
            f"vramd: KFD_VRAMD=1 but the BO contents of amdgpu-kfd-{i}.img are neither a vramd image "
            f"(amdgpu-vramd-{i}/) nor amdgpu-pages files: put the vramd image in place first (e.g. vramctl pull "
            f"REF amdgpu-vramd-{i})"), lines
        assert "Restoring FAILED." in log
        env.pop("KFD_VRAMD")
        restored = case.run(RESTORE, a, TOPO_A, extra=env)
        log = case.log("restore.log")
        assert restored["restore"] == "0" and restored["alive"] == "yes", log[-3000:]
        assert restored["checks"].startswith("bad bo "), restored["checks"]
        assert "Parallel restore fail" in log and "KFD_VRAMD=1 but" not in log


def test_kfd_vramd_1_still_restores_a_checkpoint_of_the_stock_path(case, plugins, tmp_path):
    """Patch 0006 fails a KFD_VRAMD=1 restore only where the BO contents are nowhere: a checkpoint dumped on
    the stock path (no daemon: amdgpu-pages files) restores byte-exact with KFD_VRAMD=1 set."""
    case.use(plugins["vramd"])
    a = case.state("state-a", TOPO_A)
    env = case.env(str(tmp_path / "none" / "vramd.sock"))
    dumped = case.run(DUMP, a, TOPO_A, gpus=1, extra=env)
    assert dumped["dump"] == "0", case.log("dump.log")[-3000:]
    assert case.vramd_dirs() == [] and [n for n in case.img() if base.PAGES.match(n)], case.img()
    restored = case.run(RESTORE, a, TOPO_A, extra={**env, "KFD_VRAMD": "1"})
    log = case.log("restore.log")
    assert restored["restore"] == "0", log[-3000:]
    assert restored["checks"] == f"ok 7 {MIB << 20}\n"
    assert "param: KFD_VRAMD:required" in log


# Two dumps of one running process into img/1 and img/2, the 2nd incremental on the 1st (KFD_VRAMD_PARENT, as
# test_kfd_vramd_incremental.py: CRIU here has no dirty tracking); the workload rewrites one VRAM BO in between
CHAIN2 = START + r"""
rm -rf $W/img $W/ready; mkdir -p $W/img/1 $W/img/2
$WL -m $MIB -g $GPUS $W/report > $W/ready 2>$W/wl.err < /dev/null &
wait_for $W/ready || { cat $W/wl.err; exit 1; }
pid=$(awk '{print $2}' $W/ready); echo "pid: $pid"
$CRIU dump -t $pid -D $W/img/1 -o dump.log -v4 --libdir $W/plugins --shell-job --leave-running; echo "dump1: $?"
rm -f $W/report; kill -HUP $pid && wait_for $W/report && echo "change: $(cat $W/report)"
KFD_VRAMD_PARENT=../1 $CRIU dump -t $pid -D $W/img/2 -o dump.log -v4 --libdir $W/plugins --shell-job
echo "dump2: $?"
if alive $pid; then echo "alive: yes"; kill -TERM $pid; else echo "alive: no"; fi
"""


def test_an_incremental_vramd_image_through_the_registry_restores_through_the_link_the_pull_makes(case, plugins,
                                                                                                 registry):
    """An incremental vramd image (one parent) pushed (vramctl pushes the parent too) and pulled back alone
    into the 2nd checkpoint's images directory: vramctl puts the parent beside it as amdgpu-vramd-<id>.parent-1
    and, as the image recorded its parent at `parent` (the plugin's link), makes amdgpu-vramd-<id>/parent a
    relative link to it: criu restore follows it with no step of the operator's (it failed PARENT_MISSING until
    an ln -s), byte-exact, with the BO the workload rewrote between the dumps."""
    case.use(plugins["vramd"])
    a = case.state("state-a", TOPO_A)
    img = os.path.join(case.work, "img")
    with running_daemon() as d:
        env = case.env(d.socket, KFD_VRAMD="1")
        r = case.run(CHAIN2, a, TOPO_A, gpus=2, extra=env)
        assert (r.get("dump1"), r.get("dump2")) == ("0", "0"), r["stdout"] + r["stderr"]
        (i,) = kfd_ids(os.path.join(img, "2"))
        vdir = os.path.join(img, "2", f"amdgpu-vramd-{i}")
        assert os.readlink(os.path.join(vdir, "parent")) == f"../../1/amdgpu-vramd-{i}"
        p = vramctl("push", vdir, f"{registry.host}/ckpt/chain:2-{i}", "--plain-http", "--json")
        assert p.returncode == 0, p.stderr
        assert len(json.loads(p.stdout)["chain"]) == 2, p.stdout
        shutil.rmtree(os.path.join(img, "1"))
        shutil.rmtree(vdir)
        p = vramctl("pull", f"{registry.host}/ckpt/chain:2-{i}", vdir, "--plain-http", "--json")
        assert p.returncode == 0, p.stderr
        assert [c["dir"] for c in json.loads(p.stdout)["chain"]] == [vdir, f"{vdir}.parent-1"], p.stdout
        assert os.readlink(os.path.join(vdir, "parent")) == f"../amdgpu-vramd-{i}.parent-1"
        restore2 = RESTORE.replace("-D $W/img ", "-D $W/img/2 ")
        r = case.run(restore2, a, TOPO_A, extra=env)
        log = case.log(os.path.join("2", "restore.log"))
        assert r["restore"] == "0", log[-3000:]
        assert r["checks"] == f"ok 14 {2 * MIB << 20}\n", r["checks"]
        assert f"vramd: amdgpu-vramd-{i}/ is incremental, restored through 1 parents" in log, log[-3000:]
