"""vramctl import-criu / export-criu on checkpoints CRIU's own, unmodified amdgpu plugin made of an
emulated GPU process (KFD model + SDMA model, docs/kfd-model.md), inside a real CRIU.  THIS RUNS ON
MODELS, NOT A GPU.  Skipped as tests/criu/test_kfd_stock_plugin.py is (CRIU_SRC, CRIU_BIN, root).

The stock plugin dumps; import-criu turns its pages files into a vramd image; the pages files are then
deleted, so that what export-criu writes back can only come from the vramd image; the stock plugin
restores from those files, and the workload checks every byte of every BO itself.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import pytest
from test_kfd_stock_plugin import DUMP, MIB, RESTORE, TOPO_A, Case, pytestmark  # noqa: F401 (the skip marker)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture
def case(model, tmp_path):
    return Case(model, str(tmp_path))


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from kfd_harness import Model
    return Model(str(tmp_path_factory.mktemp("kfd-build")))


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    """`python -m vramd.cli ARGS`, its exit status kept from kfd_harness's reaper (which, once a criu run has
    started it, reaps every child of this process that is not in its spared set)."""
    from kfd_harness import _spared
    p = subprocess.Popen([sys.executable, "-m", "vramd.cli", *args], cwd=ROOT, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    _spared.add(p.pid)  # Popen returns once the child has exec'd: it has not exited yet
    try:
        out, err = p.communicate(timeout=300)
    finally:
        _spared.discard(p.pid)
    return subprocess.CompletedProcess(p.args, p.returncode, out, err)


def vramctl(*args: str) -> subprocess.CompletedProcess[str]:
    return run_cli(*args, "--offline", "--json")


def pages(img: str) -> dict[str, bytes]:
    out = {}
    for n in sorted(os.listdir(img)):
        if n.startswith(("amdgpu-pages-", "amdgpu-drm-pages-")):
            with open(os.path.join(img, n), "rb") as f:
                out[n] = f.read()
    return out


# (workload options, GPUs, the workload's own check after the dump and after the restore)
CASES = {
    "one-process": ("", 1, f"ok 7 {MIB << 20}\n"),
    "process-tree": (" -c", 2, f"ok 14 {2 * MIB << 20}; child ok 10 {2 * 4 << 20}\n"),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_stock_dump_import_export_stock_restore(case, name):
    """One vramd image of the whole checkpoint."""
    _round_trip(case, name, per_kfd=False)


@pytest.mark.parametrize("name", sorted(CASES))
def test_stock_dump_import_per_kfd_file_export_stock_restore(case, name):
    """An image per KFD file, amdgpu-vramd-<id>/ in the checkpoint directory, as the vramd plugin lays it out
    (import-criu --kfd; export-criu takes the id from the directory's name)."""
    _round_trip(case, name, per_kfd=True)


def _round_trip(case, name, *, per_kfd):
    opts, gpus, expect = CASES[name]
    a = case.state("state-a", TOPO_A)
    d = case.run(DUMP.replace("-g $GPUS", "-g $GPUS" + opts), a, TOPO_A, gpus=gpus)
    assert d["dump"] == "0", case.log("dump.log")[-3000:]
    assert d["checks"] == expect
    img = os.path.join(case.work, "img")
    stock = pages(img)
    kfds = sorted(n for n in os.listdir(img) if n.startswith("amdgpu-kfd-"))
    assert len(stock) == len(kfds) * 2  # a pages file per GPU of each KFD process (the model has 2 GPUs)

    if per_kfd:
        vimgs = {os.path.join(img, f"amdgpu-vramd-{k[len('amdgpu-kfd-'):-4]}"): ["--kfd", k[len("amdgpu-kfd-"):-4]]
                 for k in kfds}
    else:
        vimgs = {os.path.join(case.work, "vimg"): []}
    imported = {"pages_files": [], "bytes": 0}
    for vimg, kfd in vimgs.items():
        r = vramctl("import-criu", img, vimg, "--compress", "zstd:1", *kfd)
        assert r.returncode == 0, r.stderr
        out = json.loads(r.stdout)
        imported["pages_files"] += out["pages_files"]
        imported["bytes"] += out["bytes"]
        v = run_cli("verify", vimg)
        assert v.returncode == 0, v.stderr
    assert sorted(imported["pages_files"]) == sorted(stock)
    assert imported["bytes"] == sum(len(b) - 8 for b in stock.values())

    for n in stock:  # from here on the BO contents exist only in the vramd image(s)
        os.unlink(os.path.join(img, n))
    for vimg in vimgs:
        r = vramctl("export-criu", vimg, img)
        assert r.returncode == 0, r.stderr
    assert pages(img) == stock  # byte for byte, headers included

    res = case.run(RESTORE, a, TOPO_A, gpus=gpus)
    log = case.log("restore.log")
    assert res["restore"] == "0", log[-3000:]
    assert res["checks"] == expect  # the workload's own check of every byte it wrote
    assert "amdgpu_plugin: Restore successful" in log or "Restore successful" in log
