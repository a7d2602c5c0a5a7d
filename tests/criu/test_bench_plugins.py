"""tests/criu/bench_plugins.py (the stock amdgpu plugin against the vramd-patched one, MODEL
numbers) kept from rotting: a run at tiny sizes of every shape must finish, check every byte,
and report a full row per plugin and step and a verdict line per target.  Without CRIU_SRC /
CRIU_BIN the bench refuses with exit status 2 and says why (that case runs anywhere)."""

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
BENCH = str(REPO / "tests" / "criu" / "bench_plugins.py")


def test_the_bench_refuses_without_criu():
    env = {k: val for k, val in os.environ.items() if k not in ("CRIU_SRC", "CRIU_BIN")}
    r = subprocess.run([sys.executable, BENCH, "--runs", "1"], env=env, capture_output=True, text=True, cwd=REPO)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "bench_plugins: not run: " in r.stderr and "CRIU" in r.stderr
    assert "MODEL NUMBERS" not in r.stdout


@pytest.mark.skipif(
    ENV.missing() is not None or not ENV.has_libvramd(), reason=ENV.missing() or "needs libvramd (VRAMD_CLIENT_*)"
)
def test_a_tiny_run_of_every_shape(tmp_path):
    out = tmp_path / "bench.json"
    r = subprocess.run(
        [sys.executable, BENCH, "--mib-per-gpu", "4", "--small-bos", "8", "--runs", "2", "--json", str(out)],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=600,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "MODEL NUMBERS (KFD + SDMA models, not a GPU); CRIU " in r.stdout
    data = json.loads(out.read_text())
    assert 0 < data["hash_s_per_gib"] < 10
    shapes = {res["shape"]: res for res in data["results"]}
    assert list(shapes) == ["disk", "tmpfs", "tree", "small"]
    for name, res in shapes.items():
        assert len(res["runs"]) == 2
        # the two plugins ran alternately: stock first in run 0, vramd first in run 1
        assert [list(run) for run in res["runs"]] == [["stock", "vramd"], ["vramd", "stock"]]
        for side in ("stock", "vramd"):
            med = res["median"][side]
            for what in ("dump", "restore"):
                m = med[what]
                assert m["wall_s"] > 0 and m["criu_cpu_s"] >= 0, (name, side, what, m)
                assert "copy_s" in m and m["copy_s"] >= 0, (name, side, what, m)  # the stage stamps were found
            assert med["dump"]["image_bytes"] >= med["dump"]["gpu_image_bytes"] > 0
            # the BO contents are in the image: at least the BO bytes (vramd: unless compressed or deduplicated)
            if side == "stock":
                assert med["dump"]["gpu_image_bytes"] >= med["bytes"]
        # vramd's copies run in the daemon: it spent CPU, the stock side's runs none of it; the SDMA model's copy
        # log saw every BO byte of a dump copied once, in the daemon on vramd's side, in criu on stock's
        assert res["median"]["vramd"]["dump"]["daemon_cpu_s"] > 0
        assert res["median"]["stock"]["dump"]["daemon_cpu_s"] == 0
        for side in ("stock", "vramd"):
            d = res["median"][side]["dump"]
            # (vramd on the small shape too: its one-page BOs of one GPU are each their own buffer, though one
            # inode on the model, docs/kfd-model.md)
            assert d["model_copied_bytes"] == res["median"][side]["bytes"], (name, side, d["model_copied_bytes"])
            assert d["model_copy_cpu_s"] > 0, (name, side)
            assert d["model_copy_daemon_cpu_s"] == (d["model_copy_cpu_s"] if side == "vramd" else 0), (name, side)
    # every restore the stock plugin can do right is byte-exact by the workload's own check, and vramd's too
    # (one process on 2 GPUs: the stock restore leaves one GPU's BOs unfilled, docs/kfd-model.md)
    assert shapes["tree"]["median"]["stock"]["restore"]["byte_exact"]
    assert shapes["small"]["median"]["stock"]["restore"]["byte_exact"]
    assert not shapes["disk"]["median"]["stock"]["restore"]["byte_exact"]
    for name in ("disk", "tmpfs", "tree", "small"):
        assert shapes[name]["median"]["vramd"]["restore"]["byte_exact"], name
    # the stock plugin restores a tree in the restored tasks (their CPU), vramd in the daemon
    assert shapes["tree"]["median"]["stock"]["restore"]["task_cpu_s"] > 0
    assert shapes["tree"]["median"]["vramd"]["restore"]["daemon_cpu_s"] > 0
    assert shapes["small"]["median"]["stock"]["bos"] == 5 + 8 + 5  # the parent's sized and small BOs, the child's
    verdicts = [ln for ln in r.stdout.splitlines() if ln.startswith("- ")]
    for target in (
        "two-process tree restore",
        "image on disk",
        "restore wall <= 1.10 x max(",
        "image on tmpfs",
        "tmpfs dump CPU/GiB",
        "small BOs",
    ):
        assert any(
            target in ln and ("**met**" in ln or "**missed**" in ln or "**not judged**" in ln) for ln in verdicts
        ), (target, verdicts)
