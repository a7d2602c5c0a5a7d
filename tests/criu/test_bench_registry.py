"""tests/criu/bench_registry.py (restoring a CRIU checkpoint from a registry, MODEL numbers) kept from rotting: a
run at a tiny size must finish, restore byte-exact every time from the local image, after the pull and streaming
from `vramctl pull --serve`, the flows rotating, and report every figure.  Without CRIU_SRC / CRIU_BIN the bench
refuses with exit status 2 and says why (that case runs anywhere)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from criu_harness import Env
from kfd_harness import REPO

ENV = Env()
BENCH = str(REPO / "tests" / "criu" / "bench_registry.py")


def test_the_bench_refuses_without_criu():
    env = {k: val for k, val in os.environ.items() if k not in ("CRIU_SRC", "CRIU_BIN")}
    r = subprocess.run([sys.executable, BENCH, "--runs", "1"], env=env, capture_output=True, text=True, cwd=REPO)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "bench_registry: not run: " in r.stderr and "CRIU" in r.stderr
    assert "MODEL NUMBERS" not in r.stdout


@pytest.mark.skipif(
    ENV.missing() is not None or not ENV.has_libvramd(), reason=ENV.missing() or "needs libvramd (VRAMD_CLIENT_*)"
)
def test_a_tiny_run(tmp_path):
    out = tmp_path / "bench.json"
    r = subprocess.run([sys.executable, BENCH, "--mib-per-gpu", "4", "--runs", "2", "--json", str(out)],
                       capture_output=True, text=True, cwd=REPO, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "MODEL NUMBERS (KFD + SDMA models, not a GPU); 0.01 GiB of BOs; median of 2 runs" in r.stdout
    assert "every restore byte-exact: True" in r.stdout
    assert "| (e) pull --serve, criu restore streaming | " in r.stdout
    data = json.loads(out.read_text())
    assert data["bytes"] == 2 * 4 << 20 and data["push"]["wall_s"] > 0
    assert [run["order"] for run in data["runs"]] == ["ace", "cea"]
    for run in data["runs"]:
        e = run["e"]
        assert e["ready_wall_s"] > 0 and e["serve_cpu_s"] > 0 and e["files_whole_s"] >= e["wall_s"], e
        assert e["e_wall_s"] == pytest.approx(e["ready_wall_s"] + e["wall_s"])
        for flow in ("a", "c", "e"):
            m = run[flow]
            assert m["byte_exact"] and m["wall_s"] > 0 and 0 < m["before_ext_file_s"] < m["wall_s"], m
        assert run["b"]["wall_s"] > 0 and run["b"]["cpu_s"] > 0 and run["b"]["registry_cpu_s"] >= 0, run["b"]
        assert run["c_wall_s"] == pytest.approx(run["b"]["wall_s"] + run["c"]["wall_s"])
        assert run["stream_bound_s"] <= run["d_bound_s"] <= run["c_wall_s"], run
