"""A session's state moves only along the transition table; anything else is a bug (INTERNAL)."""
from __future__ import annotations

import pytest

from vramd.errors import InternalError, InvalidRequestError, JobCancelledError, JobError, VramdError
from vramd.pb import rpc_pb2 as rpc
from vramd.service.session_state import ENDED, TRANSITIONS, Lifecycle, outcome_state

ENDS = {rpc.SESSION_DONE, rpc.SESSION_FAILED, rpc.SESSION_CANCELLED}


def test_the_table_ends_every_path_in_an_end_state():
    assert set(TRANSITIONS) == {rpc.SESSION_OPEN, rpc.SESSION_SEALED, rpc.SESSION_CANCELLING, *ENDS}
    assert ENDED == ENDS
    assert all(not TRANSITIONS[s] for s in ENDS)  # nothing leaves an end state
    assert TRANSITIONS[rpc.SESSION_OPEN] >= ENDS and TRANSITIONS[rpc.SESSION_SEALED] >= ENDS
    assert rpc.SESSION_OPEN not in TRANSITIONS[rpc.SESSION_SEALED]  # no reopening
    # a cancel is seen at once, and only leads to an end: never back to running
    assert rpc.SESSION_CANCELLING in TRANSITIONS[rpc.SESSION_OPEN] & TRANSITIONS[rpc.SESSION_SEALED]
    assert TRANSITIONS[rpc.SESSION_CANCELLING] <= ENDS and rpc.SESSION_CANCELLED in TRANSITIONS[rpc.SESSION_CANCELLING]


def test_cancelling_is_appended_so_old_clients_still_decode():
    """The new state takes the next number: every older state keeps its wire value."""
    assert [rpc.SessionState.Value(n) for n in ("SESSION_OPEN", "SESSION_SEALED", "SESSION_DONE", "SESSION_FAILED",
                                                 "SESSION_CANCELLED", "SESSION_CANCELLING")] == [1, 2, 3, 4, 5, 6]


def test_outcome_state_follows_the_error():
    assert outcome_state(None) == rpc.SESSION_DONE
    assert outcome_state(JobCancelledError("x")) == rpc.SESSION_CANCELLED
    assert outcome_state(VramdError("x")) == rpc.SESSION_FAILED


def test_an_illegal_move_is_internal():
    life = Lifecycle(1)
    life.enter(rpc.SESSION_DONE)
    with pytest.raises(InternalError) as e:
        life.enter(rpc.SESSION_SEALED)
    assert "session 1: no transition SESSION_DONE -> SESSION_SEALED" in e.value.message
    assert life.state == rpc.SESSION_DONE  # the bad move changed nothing


def test_every_move_the_table_allows_and_no_other():
    states = list(TRANSITIONS)
    for a in states:
        for b in states:
            life = Lifecycle(7)
            life.state = a  # (a Lifecycle is a plain record: its moves are what is tested)
            if b == a or b in TRANSITIONS[a]:
                life.enter(b)
                assert life.state == b
            else:
                with pytest.raises(InternalError):
                    life.enter(b)
                assert life.state == a


def test_a_failure_ends_a_running_session_at_once_and_its_first_error_stays():
    life = Lifecycle(2)
    first = JobError("copy failed")
    assert life.running and life.stop(first)
    assert life.state == rpc.SESSION_FAILED and life.error is first
    assert not life.stop(JobError("a later one"))  # stopped already: nothing changes
    life.end(JobError("what finish raised"))
    assert life.state == rpc.SESSION_FAILED and life.error is first
    with pytest.raises(JobError, match="copy failed"):
        life.check_open()  # a failed session answers its own error


def test_a_cancel_is_cancelling_until_the_job_ends():
    life = Lifecycle(3)
    life.enter(rpc.SESSION_SEALED)
    assert life.stop(JobCancelledError("cancelled by the test"))
    assert life.state == rpc.SESSION_CANCELLING and not life.running
    life.end(JobCancelledError("cancelled by the test"))
    assert life.state == rpc.SESSION_CANCELLED
    life = Lifecycle(4)
    life.stop(JobCancelledError("too late"))
    life.end(None)  # the job had finished anyway: DONE, as CANCELLING allows
    assert life.state == rpc.SESSION_DONE and life.error is None


def test_a_bug_stops_a_session_as_internal_and_sealed_takes_no_more():
    life = Lifecycle(5)
    life.enter(rpc.SESSION_SEALED)
    with pytest.raises(InvalidRequestError, match="SESSION_SEALED and takes no more BOs"):
        life.check_open()
    life.stop(KeyError("oops"))
    assert life.state == rpc.SESSION_FAILED and life.error.code == "INTERNAL" and "KeyError" in life.error.message
