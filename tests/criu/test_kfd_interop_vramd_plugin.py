"""The stock plugin and the vramd plugin (CRIU's amdgpu plugin with contrib/criu's series) hand checkpoints to
each other through vramctl import-criu / export-criu, on the KFD + SDMA models inside a real CRIU.  THIS RUNS
ON MODELS, NOT A GPU.

Built on test_kfd_vramd_plugin.py's fixtures (the series applied to a copy of CRIU_SRC and built, a running
vramd on the SDMA model): skipped where that test is not in the tree, and as it is (CRIU_SRC, CRIU_BIN,
libvramd, root).  The vramd plugin keeps each KFD file's BOs in amdgpu-vramd-<id>/, BO id = bucket index
(docs/criu-integration.md), which is what import-criu --kfd writes and export-criu reads.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
tkv = pytest.importorskip("test_kfd_vramd_plugin", reason="needs the vramd plugin's test (contrib/criu's series)")
# its skip marker and fixtures (the patched plugin built, a daemon on the SDMA model, a case), used by name
pytestmark, case, daemon, model, plugins = tkv.pytestmark, tkv.case, tkv.daemon, tkv.model, tkv.plugins
DUMP, RESTORE, TOPO_A, PAGES, ok = tkv.DUMP, tkv.RESTORE, tkv.TOPO_A, tkv.PAGES, tkv._ok


def vramctl(*args: str, socket: str | None) -> subprocess.CompletedProcess[str]:
    from test_kfd_stock_interop import run_cli
    return run_cli(*args, *(["--socket", socket] if socket else ["--offline"]), "--json")


@pytest.mark.parametrize("through", ["offline", "daemon"])
def test_stock_dump_imported_then_restored_by_the_vramd_plugin(case, plugins, daemon, through):
    """The stock plugin dumps; import-criu --kfd makes amdgpu-vramd-<id>/ beside the metadata; the stock pages
    files are deleted; the vramd plugin restores through the daemon, and the workload checks every byte."""
    case.use(plugins["stock"])
    a = case.state("state-a", TOPO_A)
    d = case.run(DUMP, a, TOPO_A)
    assert d["dump"] == "0", case.log("dump.log")[-3000:]
    ok(d["checks"], 1)
    img = os.path.join(case.work, "img")
    (kfd,) = [n[len("amdgpu-kfd-"):-len(".img")] for n in case.img() if n.startswith("amdgpu-kfd-")]
    r = vramctl("import-criu", img, os.path.join(img, f"amdgpu-vramd-{kfd}"), "--kfd", kfd,
                socket=daemon.socket if through == "daemon" else None)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["bytes"] > 0
    for n in case.img():
        if PAGES.match(n):
            os.unlink(os.path.join(img, n))
    case.use(plugins["vramd"])
    res = case.run(RESTORE, a, TOPO_A, extra=case.env(daemon.socket))
    log = case.log("restore.log")
    assert res["restore"] == "0", log[-3000:]
    ok(res["checks"], 1)
    assert f"BOs submitted from amdgpu-vramd-{kfd}/" in log


def test_vramd_plugin_dump_exported_then_restored_by_the_stock_plugin(case, plugins, daemon):
    """The vramd plugin dumps into amdgpu-vramd-<id>/ (no pages files); export-criu writes the pages files
    from it (the KFD file from the directory's name); the unmodified plugin restores them byte-exact."""
    case.use(plugins["vramd"])
    a = case.state("state-a", TOPO_A)
    d = case.run(DUMP, a, TOPO_A, extra=case.env(daemon.socket))
    assert d["dump"] == "0", case.log("dump.log")[-3000:]
    (vdir,) = case.vramd_dirs()
    img = os.path.join(case.work, "img")
    assert not [n for n in case.img() if PAGES.match(n)]
    r = vramctl("export-criu", os.path.join(img, vdir), img, socket=daemon.socket)
    assert r.returncode == 0, r.stderr
    assert len([n for n in case.img() if PAGES.match(n)]) == 2, case.img()  # one per GPU of the process
    case.use(plugins["stock"])
    res = case.run(RESTORE, a, TOPO_A)
    assert res["restore"] == "0", case.log("restore.log")[-3000:]
    ok(res["checks"], 1)
