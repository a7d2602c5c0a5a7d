"""A restore's hold (OpenSession.hold_s, capped by the daemon's max_hold): the CRIU offload's restored task
submits and hangs up, CRIU main waits long after, through a real daemon on a real socket.  Time is driven by
the configuration (a grace period of 0) and by the daemon's own events (a session it reaped, its log)."""
from __future__ import annotations

import json
import os
import signal

import pytest
from helpers import vramctl

from vramd.client import SESSION_DUMP, SESSION_RESTORE, Client, ClientBo
from vramd.errors import InvalidRequestError, LimitExceededError, NotFoundError
from vramd.pb import rpc_pb2 as rpc
from vramd.testing import DaemonProcess, Workload, blank_spec_like

SPEC = [{"size": (2 << 20) + 4097, "fill": "random", "seed": 7}, {"size": 12345, "fill": "pattern", "seed": 8}]


def _daemon(run_dir: str, tmp_path, extra: str) -> DaemonProcess:
    cfg = tmp_path / "vramd.toml"
    cfg.write_text('grace_period = 0\nstaging_budget = "64M"\nchunk_size = "1M"\n' + extra)
    return DaemonProcess(run_dir, "--config", str(cfg))


def _dumped(socket: str, dfd: int) -> tuple[Workload, dict[int, str]]:
    w = Workload(SPEC)
    w.__enter__()
    mem = w.open_mem()
    try:
        with Client(socket) as c:
            bos = [ClientBo(i + 1, mem, offset=r["addr"], size=r["size"]) for i, r in enumerate(w.regions)]
            assert c.run_session(SESSION_DUMP, dfd, bos).state == rpc.SESSION_DONE
    finally:
        os.close(mem)
    return w, w.digests()


def _files(d: DaemonProcess) -> list[str]:
    """The daemon's fds other than sockets (whose connections' ends it may not have seen yet)."""
    return [f for f in d.fds() if not f.startswith("socket:")]


def _submit(socket: str, dfd: int, w: Workload, mem: int, hold_s: int) -> rpc.SessionInfo:
    """The restored task's part: open (asking for a hold), add the targets, start, hang up."""
    with Client(socket) as task:
        s = task.open_session(SESSION_RESTORE, dfd, hold_s=hold_s)
        task.add_bos(s.token, [ClientBo(i + 1, mem, offset=r["addr"]) for i, r in enumerate(w.regions)])
        task.start(s.token)
    return s


def test_a_held_restore_is_waited_for_after_the_grace_period(run_dir, tmp_path, image_dir):
    """grace_period 0: a session nobody holds is reaped at once, unless it was granted a hold (asked 600 s,
    capped at max_hold = 120).  A control session opened without one, let go after the held one was, is
    reaped first; only then does "CRIU main" wait, and it still gets the result, byte-exact."""
    _, dfd = image_dir
    with _daemon(run_dir, tmp_path, "max_hold = 120\n") as d:
        w, digests = _dumped(d.socket, dfd)
        with w, Workload(blank_spec_like(w.regions)) as w2:
            mem2 = w2.open_mem(os.O_RDWR)
            s = _submit(d.socket, dfd, w, mem2, hold_s=600)
            assert s.hold_s == 120  # granted up to max_hold
            d.expect_log(rf"session {s.session_id}: no connection holds it; kept 120 s for its token \(hold\)")
            with Client(d.socket) as other:  # the control: no hold, let go after the held one
                ctl = other.open_session(SESSION_RESTORE, dfd)
                assert ctl.hold_s == 0
            d.expect_log(rf"session {ctl.session_id}: no client holds it any more \(grace period over\)")
            with Client(d.socket) as main:
                with pytest.raises(NotFoundError):
                    main.progress(ctl.token)
                final = main.wait(s.token)  # later than the grace period: the hold kept it
                assert final.state == rpc.SESSION_DONE and final.progress.bos_done == len(SPEC)
                main.close_session(s.token)
                assert main.sessions() == []
            os.close(mem2)
            assert w2.digests() == digests


def test_a_hold_counts_against_the_uid_and_ends(run_dir, tmp_path, image_dir):
    """The bound: a held session counts against its uid's max_sessions_per_uid (1 here) while nobody holds it,
    it is reaped when its hold (max_hold = 10 s, though 3600 were asked) is over, and the uid's session count is
    given back (a new session fits again).  `vramctl sessions --json` shows the hold."""
    _, dfd = image_dir
    with _daemon(run_dir, tmp_path, "max_hold = 10\nmax_sessions_per_uid = 1\n") as d:
        w, _ = _dumped(d.socket, dfd)
        with w, Workload(blank_spec_like(w.regions)) as w2:
            mem2 = w2.open_mem(os.O_RDWR)
            s = _submit(d.socket, dfd, w, mem2, hold_s=3600)
            os.close(mem2)
            assert s.hold_s == 10
            d.expect_log(rf"session {s.session_id}: no connection holds it; kept 10 s for its token \(hold\)")
            r = vramctl("sessions", "--json", socket=d.socket)
            assert r.returncode == 0, r.stderr
            (row,) = [x for x in json.loads(r.stdout)["sessions"] if x["session_id"] == s.session_id]
            assert row["hold_s"] == 10 and row["holders"] == 0 and row["state"] == "done", row
            with Client(d.socket) as c:
                listed = {i.session_id: i for i in c.sessions()}
                assert listed[s.session_id].holders == 0 and listed[s.session_id].hold_s == 10
                with pytest.raises(LimitExceededError, match="max_sessions_per_uid"):
                    c.open_session(SESSION_RESTORE, dfd)
            d.expect_log(rf"session {s.session_id}: hold over \(10 s\): reaped, its token forgotten")
            with Client(d.socket) as c:
                with pytest.raises(NotFoundError):
                    c.wait(s.token)
                assert c.sessions() == []
                again = c.open_session(SESSION_RESTORE, dfd)  # the uid's one session is free again
                c.close_session(again.token)


def test_max_hold_zero_grants_no_hold_and_a_dump_takes_none(run_dir, tmp_path, image_dir):
    """max_hold = 0 turns holds off (the grace period for every session); a hold is a restore option only."""
    _, dfd = image_dir
    with _daemon(run_dir, tmp_path, "max_hold = 0\n") as d, Client(d.socket) as c:
        with pytest.raises(InvalidRequestError, match="hold_s is a restore option"):
            c.open_session(SESSION_DUMP, dfd, hold_s=10)
        w, _ = _dumped(d.socket, dfd)
        with w:
            s = c.open_session(SESSION_RESTORE, dfd, hold_s=10)
            assert s.hold_s == 0
            c.close_session(s.token)


def test_a_sighup_lowering_max_hold_cuts_the_holds_already_granted(run_dir, tmp_path, image_dir):
    """max_hold lowered by a SIGHUP (3600 s to 5 s) bounds a hold granted before it, already counting down:
    the session is reaped 5 s after nobody held it, not an hour, and its token is forgotten; a session
    opened after the reload is granted 5 s."""
    _, dfd = image_dir
    with _daemon(run_dir, tmp_path, "max_hold = 3600\n") as d:
        w, _ = _dumped(d.socket, dfd)
        with w, Workload(blank_spec_like(w.regions)) as w2:
            mem2 = w2.open_mem(os.O_RDWR)
            s = _submit(d.socket, dfd, w, mem2, hold_s=3600)
            os.close(mem2)
            assert s.hold_s == 3600
            d.expect_log(rf"session {s.session_id}: no connection holds it; kept 3600 s for its token \(hold\)")
            (tmp_path / "vramd.toml").write_text('grace_period = 0\nstaging_budget = "64M"\nchunk_size = "1M"\n'
                                                 "max_hold = 5\n")
            d.proc.send_signal(signal.SIGHUP)
            d.expect_log(rf"session {s.session_id}: hold 3600 s cut to max_hold 5 s")
            d.expect_log(r"SIGHUP: configuration reloaded; changed: max_hold")
            with Client(d.socket) as c:
                (row,) = c.sessions()
                assert row.hold_s == 5 and row.holders == 0
            d.expect_log(rf"session {s.session_id}: hold over \(5 s\): reaped, its token forgotten")
            with Client(d.socket) as c:
                with pytest.raises(NotFoundError):
                    c.wait(s.token)
                assert c.sessions() == []
                later = c.open_session(SESSION_RESTORE, dfd, hold_s=3600)
                assert later.hold_s == 5
                c.close_session(later.token)


def test_a_held_restore_nobody_started_goes_after_the_grace_period_with_its_fds(run_dir, tmp_path, image_dir):
    """A submit that dies between its open (a hold asked and granted) and its Start never runs: the hold
    does not keep it (nor the target's BO fds it was given) for max_hold; it is reaped after the grace
    period (0 here), and the daemon holds none of its fds any more."""
    _, dfd = image_dir
    with _daemon(run_dir, tmp_path, "max_hold = 3600\n") as d:
        w, _ = _dumped(d.socket, dfd)
        with w, Workload(blank_spec_like(w.regions)) as w2:
            mem2 = w2.open_mem(os.O_RDWR)
            before = _files(d)
            with Client(d.socket) as task:
                s = task.open_session(SESSION_RESTORE, dfd, hold_s=3600)
                task.add_bos(s.token, [ClientBo(i + 1, mem2, offset=r["addr"]) for i, r in enumerate(w.regions)])
                assert s.hold_s == 3600
                assert len(_files(d)) > len(before)  # the image's files and the target's fd, held
            os.close(mem2)
            d.expect_log(rf"session {s.session_id}: no client holds it any more \(grace period over\)")
            with Client(d.socket) as c:
                with pytest.raises(NotFoundError):
                    c.wait(s.token)
                assert c.sessions() == []
            d.expect_log(rf"session {s.session_id} \(restore, .*: SESSION_CANCELLED: ")  # once its fds are closed
            assert _files(d) == before
