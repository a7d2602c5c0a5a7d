"""The long mode's command (long.py) runs each fuzz test with the count it is given and adds them up."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import long  # tests/fuzz is on sys.path (rootdir-relative imports, as strategies.py)

HERE = Path(__file__).resolve().parent


def test_the_long_mode_tries_the_count_it_is_given_in_every_decoder_test():
    p = subprocess.run([sys.executable, str(HERE / "long.py"), "--examples", "40", "--daemon-examples", "0",
                        "--jobs", "2", "--seed", "1"], capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout + p.stderr
    rows = [line for line in p.stdout.splitlines() if line.startswith("test_")]
    assert [r.split()[0] for r in rows] == [i.split("::")[1] for i in long.DECODERS]
    assert all(r.split()[-1] == "ok" for r in rows)
    total = f"total: {40 * len(long.DECODERS)} frames, messages and images through the decoders, 0 request"
    assert total in p.stdout
