"""The README's first command: the end-to-end demo (daemon up, a workload dumped, restored, verified)."""
from __future__ import annotations

import subprocess
import sys

from helpers import ROOT


def test_the_demo_runs_end_to_end(tmp_path):
    r = subprocess.run([sys.executable, "-m", "vramd.cli.demo", "--size", "24M", "--image", str(tmp_path / "img")],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "stopped with SIGTERM, exit status 0" in r.stdout, r.stdout
    assert (tmp_path / "img" / "manifest.vrdm").exists()
