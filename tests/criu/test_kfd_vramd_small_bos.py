"""Many equal-sized BOs of one GPU in one process through the vramd-patched amdgpu plugin (contrib/criu),
on the KFD model + SDMA model inside a real CRIU.  THIS RUNS ON MODELS, NOT A GPU.  Skipped as
test_kfd_vramd_plugin.py is (CRIU_SRC, CRIU_BIN, root, libvramd).

Every dmabuf the KFD model exports is its GPU's arena file (one inode per GPU, docs/kfd-model.md), so
only the device's import tells these BOs apart (the SDMA backend's `identity`): before it, vramd took
every one-page BO of a GPU for the first one and the restore gave them all its bytes ("bad bo")."""
from __future__ import annotations

import json
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import test_kfd_vramd_plugin as base
from kfd_harness import REPO
from test_kfd_stock_plugin import DUMP, MIB, RESTORE, TOPO_A
from test_kfd_vramd_plugin import _ok, _vramctl_verify

# test_kfd_vramd_plugin.py's skip condition and fixtures (the series applied and built once per module)
pytestmark = base.pytestmark
plugins, model, daemon, case = base.plugins, base.model, base.daemon, base.case

SMALL = 1000  # one-page BOs, VRAM and GTT by turns, all on the one GPU
PAGE = 4096


def _inspect(path: str) -> dict:
    r = subprocess.run([sys.executable, "-m", "vramd.cli", "inspect", "--json", path], capture_output=True,
                       text=True, cwd=str(REPO))
    assert r.returncode == 0, r.stdout + r.stderr
    return json.loads(r.stdout)


def test_a_process_of_many_equal_sized_small_bos_dumps_and_restores_byte_exact(case, plugins, daemon):
    """`kfd_workload -s 1000` on one GPU: 1,000 one-page BOs besides the sized ones, every dmabuf one inode on
    the model.  The patched plugin dumps them through vramd (each BO stored as its own buffer: no entry of
    the image borrows another's bytes) and restores them byte-exact by the workload's own check."""
    case.use(plugins["vramd"])
    a = case.state("state-a", TOPO_A)
    env = case.env(daemon.socket)
    want_bos, want_bytes = 7 + SMALL, (MIB << 20) + SMALL * PAGE
    d = case.run(DUMP.replace("-g $GPUS", f"-g $GPUS -s {SMALL}"), a, TOPO_A, gpus=1, extra=env)
    log = case.log("dump.log")
    assert d["dump"] == "0", log[-3000:]
    _ok(d["checks"], 1, want_bos, want_bytes)
    (vdir,) = case.vramd_dirs()
    assert f"amdgpu_plugin: vramd: {6 + SMALL} BOs dumped into {vdir}/" in log
    path = os.path.join(case.work, "img", vdir)
    info = _inspect(path)
    small = [b for b in info["bos"] if b["size"] == PAGE]
    assert len(small) >= SMALL  # (one of the sized BOs is a page too)
    assert [b["id"] for b in info["bos"] if b["stored_bytes"] == 0 and b["size"]] == [], \
        "a BO was stored as another's buffer"
    v = _vramctl_verify(path)
    assert v.returncode == 0, v.stdout + v.stderr
    r = case.run(RESTORE, a, TOPO_A, extra=env)
    log = case.log("restore.log")
    assert r["restore"] == "0", log[-3000:]
    _ok(r["checks"], 1, want_bos, want_bytes)
    assert f"amdgpu_plugin: vramd: {6 + SMALL} BOs submitted from {vdir}/" in log
