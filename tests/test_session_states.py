"""A session's state moves only along the transition table; anything else is a bug (INTERNAL)."""
from __future__ import annotations

from vramd.errors import InternalError, JobCancelledError, VramdError
from vramd.pb import rpc_pb2 as rpc
from vramd.service.sessions import ENDED, TRANSITIONS, outcome_state

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
    from vramd.service.sessions import Session

    s = Session.__new__(Session)  # only the fields _enter looks at
    s.id, s.state = 1, rpc.SESSION_DONE
    try:
        s._enter(rpc.SESSION_SEALED)
    except InternalError as e:
        assert "SESSION_DONE -> SESSION_SEALED" in e.message
    else:
        raise AssertionError("a finished session was sealed")
