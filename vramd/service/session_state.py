"""A session's state: which state may follow which (`TRANSITIONS`), and `Lifecycle`, the one place it changes.

OPEN (taking files and BOs) -> SEALED (Start: no more BOs) -> DONE | FAILED |
CANCELLED.  A failed copy ends an OPEN or SEALED session FAILED at once; a
cancel makes it CANCELLING until its copies have stopped, then CANCELLED (or
DONE, where the cancel came too late to stop it, or FAILED).
"""
from __future__ import annotations

from ..errors import InternalError, InvalidRequestError, JobCancelledError, VramdError
from ..pb import rpc_pb2 as rpc

# Which state may follow which: the one place a session's state changes (Lifecycle.enter).
# CANCELLING: the job was cancelled and its copies are stopping; the end state follows once they have.
TRANSITIONS: dict[rpc.SessionState, frozenset[rpc.SessionState]] = {
    rpc.SESSION_OPEN: frozenset({rpc.SESSION_SEALED, rpc.SESSION_DONE, rpc.SESSION_FAILED, rpc.SESSION_CANCELLED,
                                 rpc.SESSION_CANCELLING}),
    rpc.SESSION_SEALED: frozenset({rpc.SESSION_DONE, rpc.SESSION_FAILED, rpc.SESSION_CANCELLED,
                                   rpc.SESSION_CANCELLING}),
    rpc.SESSION_CANCELLING: frozenset({rpc.SESSION_CANCELLED, rpc.SESSION_FAILED, rpc.SESSION_DONE}),
    rpc.SESSION_DONE: frozenset(),
    rpc.SESSION_FAILED: frozenset(),
    rpc.SESSION_CANCELLED: frozenset(),
}

ENDED = frozenset({rpc.SESSION_DONE, rpc.SESSION_FAILED, rpc.SESSION_CANCELLED})  # no way out of these
RUNNING = frozenset({rpc.SESSION_OPEN, rpc.SESSION_SEALED})  # the job has not stopped
KIND_NAMES = {rpc.SESSION_DUMP: "dump", rpc.SESSION_RESTORE: "restore", rpc.SESSION_VERIFY: "verify"}


def is_cancel(error: VramdError) -> bool:
    """Whether `error` is a cancel (CANCELLED), not a failure."""
    return error.code == JobCancelledError.code


def outcome_state(error: VramdError | None) -> rpc.SessionState:
    """The state a session ends in, from how its job ended."""
    if error is None:
        return rpc.SESSION_DONE
    return rpc.SESSION_CANCELLED if is_cancel(error) else rpc.SESSION_FAILED


class Lifecycle:
    """A session's state and the error it ended with (or is ending with); moves only along TRANSITIONS."""

    def __init__(self, session_id: int) -> None:
        self.session_id = session_id
        self.state: rpc.SessionState = rpc.SESSION_OPEN
        self.error: VramdError | None = None

    @property
    def running(self) -> bool:
        """OPEN or SEALED: the job has not stopped."""
        return self.state in RUNNING

    def enter(self, state: rpc.SessionState) -> None:
        """The one place the state changes; a move the table does not allow is a bug (INTERNAL)."""
        if state != self.state and state not in TRANSITIONS[self.state]:
            raise InternalError(f"session {self.session_id}: no transition {rpc.SessionState.Name(self.state)} -> "
                                f"{rpc.SessionState.Name(state)}")
        self.state = state

    def stop(self, exc: BaseException) -> bool:
        """The job's first error (a failed copy or AddBos, or a cancel), while it runs: FAILED with that error at
        once, or CANCELLING until its copies have stopped.  False (nothing changes) once it has stopped."""
        if not self.running:
            return False
        error = exc if isinstance(exc, VramdError) else InternalError(f"internal error: {exc!r}")
        self.error = error
        self.enter(rpc.SESSION_CANCELLING if is_cancel(error) else rpc.SESSION_FAILED)
        return True

    def end(self, error: VramdError | None) -> None:
        """The job has ended (`error`: how): the end state follows from it, unless the session has one already
        (FAILED at the first error: that error stays)."""
        if self.state not in ENDED:
            self.error = error
            self.enter(outcome_state(error))
        elif self.error is not None:
            self.error = self.error.with_traceback(None)

    def check_open(self) -> None:
        """Raise unless the session still takes files and BOs: its error, if it has one."""
        if self.state != rpc.SESSION_OPEN:
            if self.error is not None:
                raise self.error
            raise InvalidRequestError(
                f"the session is {rpc.SessionState.Name(self.state)} and takes no more BOs")
