"""What the shipped unit's sandbox promises, checked where it can be without systemd as PID 1.

- `.ci/units`: systemd-analyze verify and security (offline), sysusers.d and
  tmpfiles.d applied to a scratch root.
- MemoryDenyWriteExecute=yes: the daemon runs a selftest (procmem, mmap, and
  SDMA on the software model, dump and restore) under the kernel's own
  equivalent, prctl(PR_SET_MDWE), which is kept across execve.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
from helpers import ROOT

from vramd.backends.sdma.binding import MODEL_PATH
from vramd.testing import DaemonProcess

PR_SET_MDWE, PR_MDWE_REFUSE_EXEC_GAIN = 65, 1
# what runs the interpreter: deny write+execute memory, then exec it (argv[1:])
MDWE_SHIM = ("import ctypes, os, sys; libc = ctypes.CDLL(None, use_errno=True); "
             f"r = libc.prctl({PR_SET_MDWE}, {PR_MDWE_REFUSE_EXEC_GAIN}, 0, 0, 0); "
             "r == 0 or sys.exit(f'prctl(PR_SET_MDWE): {os.strerror(ctypes.get_errno())}'); "
             "os.execv(sys.argv[1], sys.argv[1:])")


def _mdwe_supported() -> bool:
    r = subprocess.run([sys.executable, "-c", MDWE_SHIM, sys.executable, "-c", "pass"], capture_output=True)
    return r.returncode == 0


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze not installed")
def test_units_verify_score_and_make_their_user_and_directories():
    r = subprocess.run([os.path.join(ROOT, ".ci", "units")], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "no errors, no warnings" in r.stdout and "/var/lib/vramd: mode 755" in r.stdout


@pytest.mark.skipif(not _mdwe_supported(), reason="no PR_SET_MDWE (Linux < 6.3)")
def test_the_daemon_works_without_writable_executable_memory(run_dir):
    # the shim does deny it (the test would pass vacuously otherwise)
    probe = ("import mmap; mmap.mmap(-1, 4096, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)")
    r = subprocess.run([sys.executable, "-c", MDWE_SHIM, sys.executable, "-c", probe], capture_output=True, text=True)
    assert r.returncode != 0 and "PermissionError" in r.stderr, r.stderr
    env = {"VRAMD_AMDGPU_LIBRARY": "model"}
    with DaemonProcess(run_dir, "--compression", "zstd:1", env=env,
                       argv_prefix=[sys.executable, "-c", MDWE_SHIM, sys.executable]) as d:
        r = subprocess.run([sys.executable, "-m", "vramd.cli", "--socket", d.socket, "selftest", "--size", "4M",
                            "--json"], cwd=ROOT, env=dict(os.environ, **env), capture_output=True, text=True,
                           timeout=300)
        assert r.returncode == 0, r.stdout + r.stderr
        rows = json.loads(r.stdout)["rows"]
        backends = ("procmem", "mmap", "sdma") if os.path.exists(MODEL_PATH) else ("procmem", "mmap")
        assert {(x["backend"], x["direction"]) for x in rows if x["ok"]} == {
            (b, dr) for b in backends for dr in ("dump", "restore")}
        assert d.stop() == 0
