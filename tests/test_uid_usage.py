"""Per-uid and per-session bounds (vramd.service.usage): each reserved whole or not at all, and released exactly.

The daemon-level tests (test_daemon_bounds.py) show the bounds through a real
socket; these pin the one object every bound goes through.
"""
from __future__ import annotations

import os

import pytest

from vramd.errors import LimitExceededError
from vramd.protocol import FdBundle
from vramd.service.usage import HeldFds, UidLimits, UidUsage


def counts(u: UidUsage) -> tuple[int, int, int, int, int]:
    return u.sessions, u.bos, u.fds, u.queued, u.handling


def test_bos_and_fds_are_reserved_both_or_neither():
    u = UidUsage(UidLimits(max_bos=10, max_fds=4), uid=42)
    u.reserve(bos=6, fds=3)
    with pytest.raises(LimitExceededError, match=r"uid 42's sessions would hold more than 4 fds \(max_fds_per_uid\)"):
        u.reserve(bos=4, fds=2)  # the BOs fit, the fds do not: neither is taken
    assert counts(u) == (0, 6, 3, 0, 0)
    with pytest.raises(LimitExceededError, match=r"more than 10 BOs \(max_bos_per_uid\)"):
        u.reserve(bos=5, fds=1)
    assert counts(u) == (0, 6, 3, 0, 0)
    u.reserve(bos=4, fds=1)  # exactly up to both bounds
    u.release(bos=10, fds=4)
    assert counts(u) == (0, 0, 0, 0, 0)


def test_the_fds_of_queued_requests_count_until_handled_or_dropped():
    u = UidUsage(UidLimits(max_bos=1, max_fds=10), uid=7)
    u.queue(4)
    u.queue(4)
    with pytest.raises(LimitExceededError, match=r"uid 7 would hold more than 10 fds \(max_fds_per_uid\): 0 held by "
                                                 r"its sessions, 8 by its requests .* this request carries 3"):
        u.queue(3)
    assert u.queued == 8
    u.start_handling(4, held=4)  # a request whose handler takes fds: they still count while it runs
    assert (u.queued, u.handling) == (4, 4)
    with pytest.raises(LimitExceededError):
        u.reserve(fds=7)  # a session keeping fds: its own request's are not counted twice, the queued ones are
    u.reserve(fds=2)  # what the handler's session keeps
    u.done_handling(4)
    u.unqueue(4)  # the other request was dropped (its peer hung up)
    assert counts(u) == (0, 0, 2, 0, 0)


def test_sessions_of_a_uid_are_bounded():
    u = UidUsage(UidLimits(max_bos=1, max_fds=1, max_sessions=2), uid=3)
    u.reserve_session()
    u.reserve_session()
    with pytest.raises(LimitExceededError, match=r"uid 3 already has 2 sessions open \(max_sessions_per_uid\)"):
        u.reserve_session()
    u.release_session()
    u.reserve_session()
    assert u.sessions == 2


def test_a_sessions_fds_are_bounded_for_it_and_for_its_uid():
    u = UidUsage(UidLimits(max_bos=1, max_fds=3), uid=1)
    fds = [os.open("/dev/null", os.O_RDONLY | os.O_CLOEXEC) for _ in range(4)]
    bundle = FdBundle(fds)
    try:
        first = HeldFds(u, max_fds=2, fds=[])
        other = HeldFds(u, max_fds=5)
        assert first.keep(bundle, 0) == fds[0] and first.keep(bundle, 1) == fds[1]
        with pytest.raises(LimitExceededError, match=r"more than 2 fds in one session \(max_fds_per_session\)"):
            first.keep(bundle, 2)
        assert other.keep(bundle, 2) == fds[2]
        with pytest.raises(LimitExceededError, match="max_fds_per_uid"):
            other.keep(bundle, 3)  # the uid holds 3 already
        assert u.fds == 3 and len(first) == 2 and len(other) == 1
        assert first.unkeep([fds[1]]) == [fds[1]] and u.fds == 2  # the caller closes it
        os.close(fds[1])
        first.close()
        other.close()
        assert u.fds == 0 and first.fds == [] and other.fds == []
        for fd in (fds[0], fds[2]):
            with pytest.raises(OSError):
                os.fstat(fd)  # closed by the sessions that held them
    finally:
        bundle.close()  # fds[3], never taken


def test_connections_of_a_uid_are_bounded_by_the_limit_of_the_moment():
    u = UidUsage(UidLimits(max_bos=1, max_fds=1), uid=9)
    u.reserve_connection(2)
    u.reserve_connection(2)
    with pytest.raises(LimitExceededError, match=r"uid 9 has 2 connections open \(limit max_connections_per_uid = 2\)"):
        u.reserve_connection(2)
    u.reserve_connection(3)  # max_connections_per_uid raised by a reload
    u.release_connection()
    assert u.connections == 2


def test_a_session_nobody_holds_is_reaped_and_gives_back_its_uids_session():
    """Through a real session table: a session held again keeps no reap timer; let go by its last holder, it is
    reaped once the grace period is over, and its uid's session count is given back (a new one fits)."""

    import uvloop

    from vramd.engine import Engine, EngineConfig
    from vramd.pb import rpc_pb2 as rpc
    from vramd.service.metrics import Metrics
    from vramd.service.session_table import SessionTable
    from vramd.service.usage import SessionLimits

    async def main():
        engine = Engine(EngineConfig(staging_budget=16 << 20))
        try:
            table = SessionTable(engine, Metrics(), grace_period=0.0, max_per_uid=1, limits=SessionLimits(10, 10))
            dump = rpc.OpenSession(kind=rpc.SESSION_DUMP)
            s = await table.open(dump, FdBundle([]), uid=5, pid=1)
            with pytest.raises(LimitExceededError, match="max_sessions_per_uid"):
                await table.open(dump, FdBundle([]), uid=5, pid=1)
            assert (await table.open(dump, FdBundle([]), uid=6, pid=1)).uid == 6  # another uid's own count
            a, b = object(), object()
            table.hold(s, a)
            table.let_go(s, a)
            assert s.holders.reap_timer is not None  # nobody holds it: the grace period runs
            table.hold(s, b)
            assert s.holders.reap_timer is None and len(s.holders) == 1  # held again: no reaping
            table.let_go(s, b)
            await s.wait(None)  # reaped (closed: its job cancelled) once the grace period is over
            await s.holders.reap_task
            assert s.state == rpc.SESSION_CANCELLED and len(table) == 1 and table.usage_of(5).sessions == 0
            again = await table.open(dump, FdBundle([]), uid=5, pid=1)
            await table.close(again)
            assert table.usage_of(5).sessions == 0
            for other in list(table):
                await table.close(other)
        finally:
            engine.close()
    uvloop.run(main())
