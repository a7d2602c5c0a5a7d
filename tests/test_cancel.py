"""A cancelled dump stops: at once when its opener hangs up, within one batch per lane, and says CANCELLING
until it has (a real daemon, real vramctl and workload processes, the daemon's own progress counters)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from typing import TypeVar

import pytest
from helpers import ROOT, memfd, vramctl

from vramd.client import SESSION_DUMP, SESSION_RESTORE, Client, ClientBo
from vramd.errors import JobCancelledError
from vramd.image.names import MANIFEST_NAME
from vramd.pb import rpc_pb2 as rpc
from vramd.testing import DaemonProcess, Workload, blank_spec_like

CHUNK = 256 << 10  # the daemon's chunk size: a batch moves at most this many BO bytes
SIZE = 32 << 20    # hex digits at zstd:19: about 1.5 s of one core per MiB, so the dump runs for many seconds
SLOW = "zstd:19"
ENDED = {rpc.SESSION_DONE, rpc.SESSION_FAILED, rpc.SESSION_CANCELLED}

T = TypeVar("T")


@pytest.fixture
def slow_daemon(run_dir):
    """A daemon whose grace period (60 s) is far longer than any wait below: a session that ends here was
    ended by the daemon's own decision, not reaped."""
    with DaemonProcess(run_dir, "--grace-period", "60", "--staging-budget", "64M", "--chunk-size", "256K") as d:
        yield d


def until(what: str, deadline: float, probe: Callable[[], T | None]) -> T:
    """Look at the daemon's state until `probe` returns something, for at most `deadline` seconds."""
    end = time.monotonic() + deadline
    while True:
        got = probe()
        if got is not None:
            return got
        if time.monotonic() > end:
            raise AssertionError(f"{what}: not within {deadline} s")
        time.sleep(0.01)  # the interval between looks; each look is one request to the daemon


def session_of(c: Client, pid: int) -> rpc.SessionInfo | None:
    """The session opened by process `pid`, from the admin listing (root sees every session); None: none."""
    found = [s for s in c.sessions() if s.pid == pid]
    assert len(found) <= 1
    return found[0] if found else None


def start_vramctl_dump(socket: str, w: Workload, image: str) -> subprocess.Popen[str]:
    r = w.regions[0]
    return subprocess.Popen([sys.executable, "-m", "vramd.cli", "--socket", socket, "dump", "--pid", str(w.pid),
                             "--range", f"{r['addr']:#x}:{r['size']}", "--image", image, "--compress", SLOW],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def moving(c: Client, pid: int) -> rpc.SessionInfo | None:
    """The session of `pid` once its first batch has landed (bytes are moving)."""
    s = session_of(c, pid)
    return s if s is not None and s.progress.bytes_done > 0 and s.state == rpc.SESSION_SEALED else None


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGINT])
def test_a_dump_whose_opener_is_killed_is_cancelled_at_once(slow_daemon, tmp_path, sig):
    """SIGKILL (or Ctrl-C) of `vramctl dump` mid-dump: the daemon cancels the dump at once (nobody can commit it)
    and reaps it (nobody else holds it), not after the grace period, and the bytes it copies after the cancel
    are at most one batch (one lane), by the daemon's own counters (its log: at the cancel, and the session's
    summary at its end)."""
    image = str(tmp_path / "img")
    with Workload([{"size": SIZE, "fill": "hex", "seed": 1}]) as w, Client(slow_daemon.socket) as c:
        p = start_vramctl_dump(slow_daemon.socket, w, image)
        try:
            running = until("the dump's first batch", 60, lambda: moving(c, p.pid))
            p.send_signal(sig)
            _, err = p.communicate(timeout=30)
        finally:
            p.kill()
            p.wait()
        assert running.progress.bytes_done < SIZE // 2  # far from done when interrupted
        if sig == signal.SIGINT:
            assert p.returncode == 1 and "interrupted" in err, err
        sid = running.session_id
        if sig == signal.SIGKILL:  # nobody closed it: the daemon saw its opener hang up
            slow_daemon.expect_log(rf"session {sid}: the connection that opened the dump has closed; cancelling",
                                   timeout=10)
        cancel = slow_daemon.expect_log(rf"session {sid}: SESSION_CANCELLING at (\d+)/(\d+) bytes: ", timeout=10)
        until("the dump's end", 10, lambda: session_of(c, p.pid) is None or None)  # reaped
        end = slow_daemon.expect_log(rf"session {sid} \(dump, uid 0, pid {p.pid}\): SESSION_CANCELLED: "
                                     r"\d+/\d+ BOs, (\d+)/\d+ bytes in .*: CANCELLED: ", timeout=10)
        at_cancel, final = int(cancel.group(1)), int(end.group(1))
        assert int(cancel.group(2)) == SIZE and final < SIZE // 2
        # after the cancel: no new batch, and the batches under way dropped or finished: one per lane at most
        assert final - at_cancel <= CHUNK, (at_cancel, final)
    assert not os.path.exists(os.path.join(image, MANIFEST_NAME))  # nothing committed


def test_cancel_shows_cancelling_and_stops_within_one_batch(slow_daemon, image_dir):
    """Client.cancel: the reply says CANCELLING (the copies are stopping), and the bytes counted after it are at
    most one batch per lane (one GPU here)."""
    _, dfd = image_dir
    with Workload([{"size": SIZE, "fill": "hex", "seed": 2}]) as w, Client(slow_daemon.socket) as c:
        mem = w.open_mem()
        try:
            s = c.open_session(SESSION_DUMP, dfd, compression=SLOW)
            r = w.regions[0]
            c.add_bos(s.token, [ClientBo(1, mem, offset=r["addr"], size=r["size"])])
            c.start(s.token)
            until("the dump's first batch", 60, lambda: c.progress(s.token).progress.bytes_done > 0 or None)
            info = c.cancel(s.token, "test cancel")
            assert info.state == rpc.SESSION_CANCELLING or info.state in ENDED, rpc.SessionState.Name(info.state)
            assert info.state != rpc.SESSION_DONE and info.progress.bytes_done < SIZE // 2
            with pytest.raises(JobCancelledError) as e:
                c.wait(s.token)
            assert e.value.message == "test cancel"
            final = c.progress(s.token)  # listed until closed
            assert final.state == rpc.SESSION_CANCELLED
            assert final.progress.bytes_done - info.progress.bytes_done <= CHUNK
            c.close_session(s.token)
        finally:
            os.close(mem)


def test_vramctl_cancel_says_cancelling(slow_daemon, tmp_path):
    """`vramctl cancel ID` (the operator's): "cancelling" until the copies stop; the dump's client then gets
    CANCELLED, removes its files and exits 1."""
    image = str(tmp_path / "img")
    with Workload([{"size": SIZE, "fill": "hex", "seed": 3}]) as w, Client(slow_daemon.socket) as c:
        p = start_vramctl_dump(slow_daemon.socket, w, image)
        try:
            running = until("the dump's first batch", 60, lambda: moving(c, p.pid))
            r = vramctl("cancel", str(running.session_id), socket=slow_daemon.socket, timeout=60)
            assert r.returncode == 0, r.stderr
            assert r.stdout.strip().endswith(("it is now cancelling", "it is now cancelled")), r.stdout
            _, err = p.communicate(timeout=30)
        finally:
            p.kill()
            p.wait()
        assert p.returncode == 1 and "CANCELLED" in err, err
    assert not os.path.exists(image) or not any(os.scandir(image))


def test_a_restore_whose_opener_hung_up_still_completes(slow_daemon, image_dir):
    """The offload: the restore's opener adds the BOs and hangs up; the session is not cancelled (the grace
    period holds it), and another connection starts it, waits, and the memory is restored."""
    _, dfd = image_dir
    with Workload([{"size": 3 << 20, "fill": "random", "seed": 4}]) as w:
        digests = w.digests()
        mem = w.open_mem()
        with Client(slow_daemon.socket) as c:
            c.run_session(SESSION_DUMP, dfd, [ClientBo(1, mem, offset=w.regions[0]["addr"], size=3 << 20)])
        os.close(mem)
    with Workload(blank_spec_like(w.regions)) as w2:
        mem2 = w2.open_mem(os.O_RDWR)
        try:
            with Client(slow_daemon.socket) as waiter:
                with Client(slow_daemon.socket) as submitter:
                    s = submitter.open_session(SESSION_RESTORE, dfd)
                    submitter.add_bos(s.token, [ClientBo(1, mem2, offset=w.regions[0]["addr"])])
                # the opener has hung up, before anyone else held the session
                info = waiter.progress(s.token)
                assert info.state in (rpc.SESSION_OPEN, rpc.SESSION_SEALED), rpc.SessionState.Name(info.state)
                waiter.start(s.token)
                assert waiter.wait(s.token).state == rpc.SESSION_DONE
                waiter.close_session(s.token)
        finally:
            os.close(mem2)
        assert w2.digests() == digests



def test_a_cancel_after_the_last_copy_landed_says_cancelling_and_ends_consistently(slow_daemon, image_dir):
    """A cancel that comes once every chunk has landed, while the daemon builds and writes the manifest (16,000
    BOs: that takes it a while): the reply says CANCELLING, as for any cancel of a running session (not
    SEALED); the end is CANCELLED (no image: the manifest is not written once cancelled), or DONE where the
    manifest was being written already, and Wait, GetProgress and the image on disk agree on which."""
    path, dfd = image_dir
    n = 16_000
    src = memfd(os.urandom(n * 4096))
    try:
        with Client(slow_daemon.socket) as c:
            s = c.open_session(SESSION_DUMP, dfd, compression="none")
            c.add_bos(s.token, [ClientBo(i + 1, src, offset=i * 4096, size=4096) for i in range(n)])
            c.start(s.token)

            def landed() -> rpc.SessionInfo | None:
                p = c.progress(s.token)
                done = p.progress.bytes_done == p.progress.bytes_total and p.progress.bos_done == n
                return p if done or p.state in ENDED else None
            before = until("every chunk landed", 60, landed)
            assert before.state == rpc.SESSION_SEALED, rpc.SessionState.Name(before.state)  # still finishing
            info = c.cancel(s.token, "late cancel")
            assert info.state == rpc.SESSION_CANCELLING, rpc.SessionState.Name(info.state)
            try:
                end = c.wait(s.token)
            except JobCancelledError as e:
                assert e.message == "late cancel"
                end = None
            final = c.progress(s.token)
            assert final.state == (rpc.SESSION_DONE if end is not None else rpc.SESSION_CANCELLED)
            assert os.path.exists(path / MANIFEST_NAME) == (end is not None)
            c.close_session(s.token)
    finally:
        os.close(src)
