"""CRIU's own incremental chain (parent_img) through its RPC on a kernel without memory dirty tracking,
for a plain process (tests/criu/workload.c, no GPU, no plugin): what CRIU refuses and what it takes
(criu_rpc.py says why).  Skipped unless CRIU_SRC / CRIU_BIN are set and we are root.

No --track-mem / track_mem anywhere (this kernel refuses it), so what is asserted holds with or
without dirty tracking in the kernel.
"""
from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import criu_rpc
from criu_harness import Env, Workload, build, criu

ENV = Env()
pytestmark = pytest.mark.skipif(ENV.missing() is not None, reason=ENV.missing() or "")
MIB = 16


def _log(path: str) -> str:
    with open(os.path.join(path, "dump.log"), errors="replace") as f:
        return f.read()


def _comm(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except OSError:
        return ""


def _pages(path: str) -> int:
    return sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path) if re.fullmatch(r"pages-\d+\.img", f))


def test_rpc_parent_chain_needs_a_filled_pidfd_store_and_dumps_every_page(tmp_path):
    """1st dump (a pidfd store, no parent); a dump with parent_img ../1 and the store empty is refused
    (criu/pidfd-store.c), and a CLI dump with --prev-images-dir fails its pid-reuse check (the
    parent's inventory has no uptime, criu/mem.c); with the task's pidfd queued, the 2nd and 3rd
    dumps take their parents, CRIU writes `parent` and dumps every page in full again; a pidfd of
    another, exited process queued under the task's pid reads as pid reuse.  The 3rd restores and
    the workload finds its memory intact."""
    _, binary = build(ENV, str(tmp_path / "build"), with_vramd=False)
    rpc = criu_rpc.load(criu_rpc.generate(ENV.criu_src or "", str(tmp_path / "rpc")))
    img = tmp_path / "img"
    w = Workload(binary, MIB, str(tmp_path))
    store = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    pidfd = os.pidfd_open(w.pid)
    try:
        def dump(name: str, parent: str | None, keep: bool = True, sk: socket.socket = store):
            return criu_rpc.dump(rpc, w.pid, str(img / name), sk, parent, keep, criu=ENV.criu_bin, shell_job=False)

        assert dump("1", None).success, _log(str(img / "1"))
        r = dump("2-empty", "../1")
        assert not r.success and "No pidfds found in pidfd store" in r.cr_errmsg, r
        assert "The same socket from the previous iteration should be passed" in _log(str(img / "2-empty"))
        other = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)    # a store that never saw a dump
        with other:
            r = dump("2-fresh", "../1", sk=other)
        assert not r.success and "No pidfds found in pidfd store" in r.cr_errmsg, r
        no_store = str(img / "2-cli")
        os.makedirs(no_store)
        cli = subprocess.run([ENV.criu_bin or "", "dump", "-t", str(w.pid), "-D", no_store, "-o", "dump.log", "-v4",
                              "--leave-running", "--prev-images-dir", "../1"], capture_output=True, text=True)
        # the CLI's check, which the store replaces: the 1st dump (no --track-mem) wrote no uptime
        assert cli.returncode != 0 and "Pid-reuse detection failed: no parent inventory" in _log(no_store)
        criu_rpc.queue(store, w.pid, pidfd)
        assert dump("2", "../1").success, _log(str(img / "2"))
        criu_rpc.queue(store, w.pid, pidfd)
        assert dump("3", "../2", keep=False).success, _log(str(img / "3"))
        w.reap()
        for n in ("2", "3"):
            assert os.readlink(img / n / "parent") == f"../{int(n) - 1}"
            assert "Pid reuse" not in _log(str(img / n))
            # no track_mem, so nothing soft-dirty tracked: every page again, none left in the parent
            assert _pages(str(img / n)) >= MIB << 20, (n, _pages(str(img / n)))
        assert _pages(str(img / "1")) >= MIB << 20
        criu(ENV, "restore", "-D", str(img / "3"), "-d", "-o", "restore.log", "-v4")
        assert w.check() == f"ok {w.pid}"
        # the store guards the chain: a pidfd whose task has exited, queued under this pid, is a reuse
        gone = subprocess.Popen(["true"])
        gone_fd = os.pidfd_open(gone.pid)
        gone.wait()
        criu_rpc.queue(store, w.pid, gone_fd)
        os.close(gone_fd)
        assert dump("4", "../3").success, _log(str(img / "4"))
        assert f"Pid reuse detected for pid {w.pid}" in _log(str(img / "4"))
    finally:
        os.close(pidfd)
        store.close()
        if w.proc.poll() is None:      # still the task we started (a dump failed before the 3rd)
            w.proc.kill()
            w.proc.wait()
        elif _comm(w.pid) == os.path.basename(binary)[:15]:  # the restored task, not a stranger with its pid
            with contextlib.suppress(ProcessLookupError):
                os.kill(w.pid, signal.SIGKILL)
            with contextlib.suppress(ChildProcessError):   # ours to reap where this process is a subreaper
                os.waitpid(w.pid, 0)
