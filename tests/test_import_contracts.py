"""The import-linter contracts in pyproject.toml forbid what their names say: each import below, added to a copy
of vramd/, breaks the contract named, and the copy as it is keeps every one (./dev.sh check runs lint-imports)."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LINT = Path(sys.executable).parent / "lint-imports"

pytestmark = pytest.mark.skipif(not LINT.exists(), reason="import-linter is not installed here")


@pytest.fixture(scope="module")
def tree(tmp_path_factory) -> Path:
    """A copy of vramd/ (its Python files) and pyproject.toml, to add imports to."""
    root = tmp_path_factory.mktemp("contracts")
    shutil.copytree(ROOT / "vramd", root / "vramd", ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    shutil.copy(ROOT / "pyproject.toml", root)
    return root


def lint(root: Path) -> str:
    """lint-imports over the copy (found first on the path: the installed vramd is the checkout's)."""
    env = {**os.environ, "PYTHONPATH": str(root)}
    out = subprocess.run([str(LINT), "--no-cache"], cwd=root, env=env, capture_output=True, text=True, timeout=300)
    return out.stdout + out.stderr


@pytest.mark.parametrize("module, line, contract", [
    # a job class through the packages that re-export it: the session would see more than the Job interface
    ("service/sessions.py", "from ..engine import DumpJob", "a session sees a job only through its interface"),
    ("service/attach.py", "from ..engine.jobs import RestoreJob", "a session sees a job only through its interface"),
    ("service/intake.py", "from ..engine.jobs.verify import VerifyJob",
     "a session sees a job only through its interface"),
    ("service/session_table.py", "from ..imagedir import read_image", "the daemon never opens a name"),
    ("service/intake.py", "from ..criuimage import layout", "the daemon never opens a name"),
    ("cli/transfer.py", "from .interop import cmd_import_criu", "vramctl: the parser over the stock-image interop"),
    ("service/handlers.py", "from .daemon import Daemon", "vramd.service is layered"),
    ("backends/sdma/device.py", "from .backend import SdmaBackend", "vramd.backends.sdma: the backend over its GPUs"),
    ("oci/index.py", "from .registry import Registry", "the OCI artifact's format (one manifest, an index of parts)"),
])
def test_a_forbidden_import_breaks_its_contract(tree, module, line, contract):
    path = tree / "vramd" / module
    src = path.read_text()
    head = "from __future__ import annotations\n"
    assert head in src
    path.write_text(src.replace(head, f"{head}{line}  # noqa: F401\n", 1))
    try:
        out = lint(tree)
    finally:
        path.write_text(src)
    broken = [ln for ln in out.splitlines() if ln.endswith("BROKEN")]
    assert "Contracts: " in out and "1 broken" in out, out
    assert contract in out.split("Broken contracts")[-1], out
    assert broken, out


def test_the_tree_as_it_is_keeps_every_contract(tree):
    out = lint(tree)
    assert "0 broken" in out, out
