"""What ships besides the code: the license, and man pages and completion generated from the parsers."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from helpers import ROOT


def test_man_pages_and_completion_match_the_parsers():
    r = subprocess.run([sys.executable, str(Path(ROOT, "contrib", "generate.py")), "--check"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr


def test_both_commands_say_their_version():
    from vramd import __version__
    for module, prog in (("vramd", "vramd"), ("vramd.cli", "vramctl")):
        r = subprocess.run([sys.executable, "-m", module, "--version"], capture_output=True, text=True, timeout=60,
                           cwd=ROOT)
        assert r.returncode == 0 and r.stdout.strip() == f"{prog} {__version__}", r


def test_the_license_is_the_one_declared():
    text = Path(ROOT, "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0" in text
    assert 'license = "Apache-2.0"' in Path(ROOT, "pyproject.toml").read_text()
