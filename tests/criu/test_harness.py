"""The CRIU harness's own papercuts (no CRIU needed): relative libvramd paths, "without
libvramd", and a failing plugin build that must show the compiler's error."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import criu_harness
from criu_harness import REPO, Env, build


def test_relative_libvramd_paths_resolve_from_where_they_were_given(monkeypatch):
    monkeypatch.chdir(REPO)
    monkeypatch.setenv("VRAMD_CLIENT_INC", "native/client/include")
    # make runs with -C tests/criu: a relative path would name tests/criu/native/client/include there
    assert criu_harness._in_repo("VRAMD_CLIENT_INC", "native/client/include", "vramd/client.h") == \
        os.path.join(REPO, "native", "client", "include")


def test_an_empty_libvramd_variable_means_without_libvramd(monkeypatch, tmp_path):
    (tmp_path / "libvramd.so").write_bytes(b"")      # a libvramd the default would pick up
    monkeypatch.setattr(criu_harness, "REPO", str(tmp_path.parent))
    monkeypatch.setenv("VRAMD_CLIENT_LIBDIR", "")
    assert criu_harness._in_repo("VRAMD_CLIENT_LIBDIR", tmp_path.name, "libvramd.so") is None
    monkeypatch.delenv("VRAMD_CLIENT_LIBDIR")
    assert criu_harness._in_repo("VRAMD_CLIENT_LIBDIR", tmp_path.name, "libvramd.so") == str(tmp_path)


@pytest.mark.skipif(not shutil.which("make") or not shutil.which("cc"), reason="needs make and cc")
def test_a_failing_plugin_build_shows_the_compilers_error(tmp_path):
    criu = tmp_path / "criu"
    (criu / "criu" / "include").mkdir(parents=True)
    (criu / "criu" / "include" / "criu-plugin.h").write_text("#error vramd-harness-test-marker\n")
    with pytest.raises(RuntimeError, match="vramd-harness-test-marker"):
        build(Env(criu_src=str(criu), criu_bin="/bin/true"), str(tmp_path / "out"), with_vramd=False)


KFD_NS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "kfd_ns.sh")
TOPO = os.path.join(REPO, "tests", "fixtures", "topology", "2gpu-mi100-xgmi")


def _can_unshare_mounts() -> bool:
    return os.geteuid() == 0 and shutil.which("unshare") is not None and subprocess.run(
        ["unshare", "-m", "--propagation", "private", "true"], capture_output=True).returncode == 0


@pytest.mark.skipif(not _can_unshare_mounts(), reason="needs root, unshare(1) and mount namespaces")
def test_kfd_ns_on_a_host_with_dri_and_kfd_writes_nothing_there(tmp_path):
    """kfd_ns.sh on a host that has its own /dev/dri (any machine with a DRM device) and /dev/kfd:
    the stand-ins exist only in the namespace; no file is created in the host's /dev/dri and the
    host's /dev/kfd is not opened for writing.  The "host" here is an outer private mount namespace
    whose /dev is a tmpfs with a render node and a kfd (regular files), so the real host's /dev is
    never at risk, even with the bug."""
    state = tmp_path / "state"
    state.mkdir()
    (state / "kfd").write_text("model-kfd\n")
    (state / "renderD129").write_text("model-render\n")
    script = r'''
set -eu
T=$1 NS=$2 TOPO=$3
mkdir -p $T/realdev
mount --rbind /dev $T/realdev
mount -t tmpfs fake-host-dev /dev
touch /dev/null; mount --bind $T/realdev/null /dev/null
mkdir /dev/dri
echo host-render > /dev/dri/renderD128
echo host-kfd > /dev/kfd
touch -d @0 /dev/kfd /dev/dri/renderD128
unshare -m --propagation private $NS $T/state $TOPO $T/scratch \
    sh -c 'echo "ns kfd: $(cat /dev/kfd)"; echo "ns render: $(cat /dev/dri/renderD129)";
           echo "ns host render: $(cat /dev/dri/renderD128)"'
echo "host dri: $(ls -A /dev/dri | tr '\n' ' ')"
echo "host kfd mtime: $(stat -c %Y /dev/kfd)"
'''
    r = subprocess.run(["unshare", "-m", "--propagation", "private", "bash", "-c", script, "-", str(tmp_path),
                        KFD_NS, TOPO], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    out = dict(line.split(": ", 1) for line in r.stdout.splitlines())
    assert out["ns kfd"] == "model-kfd" and out["ns render"] == "model-render"
    assert out["ns host render"] == "host-render"
    assert out["host dri"] == "renderD128 "
    assert out["host kfd mtime"] == "0"


REAPER_PROBE = r'''
import os, subprocess, sys, threading
sys.path.insert(0, sys.argv[1])
import kfd_harness
kfd_harness.start_reaper()           # as every KFD test's first run_in_ns does
codes = []
for _ in range(10):
    p = subprocess.Popen(["sh", "-c", "exit 3"])
    while True:                      # until it has exited: a zombie, or already taken by someone else
        try:
            with open(f"/proc/{p.pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    break
        except FileNotFoundError:
            break
    threading.Event().wait(0.2)      # the reaper's turn (it polls every 50 ms): it must leave this child alone
    codes.append(p.wait())
print(codes)
'''


def test_the_kfd_harness_reaper_leaves_other_childrens_exit_statuses_to_their_owners():
    """The KFD tests make the test process a child subreaper and reap the tasks CRIU leaves behind; it
    used to reap every child it was not told about, so a later subprocess.run (vramctl verify, a
    daemon) reported exit status 0 whatever the child returned.  In a process of its own (the reaper
    stays for the process's life)."""
    out = subprocess.run([sys.executable, "-c", REAPER_PROBE, os.path.dirname(os.path.abspath(__file__))],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == str([3] * 10)
