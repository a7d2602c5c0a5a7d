"""An AddBos message's BOs on their way into a job: validated (no fd taken), then fed in short steps.

`validate` looks at every BO (its fd, read from our own fd table; its GPU and
what the job checks with no syscall, through `Job.intake`) before any fd is
taken, so that a refused message leaves the session as it was; the session
then reserves what the BOs take (usage.py) and `feed`s them to the job.  Both
run on the event loop in steps of at most ADD_STEP_SECONDS (`Stepper`), so
that one big message never holds the loop (and every other client) for long.
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from ..backends import BackendKind, BoRef
from ..engine.jobs.interface import BoIntake
from ..pb import rpc_pb2 as rpc
from ..protocol.fds import FdBundle

# Per-BO work of an AddBos runs on the event loop in steps of at most this long, so
# that one big message never holds the loop (and every other client) for long.
ADD_STEP_SECONDS = 0.002
CHECK_EVERY = 32  # BOs between looks at the clock

class Stepper:
    """Yield to the event loop whenever ADD_STEP_SECONDS have passed since the last yield.

    Callers work in slices of CHECK_EVERY BOs and call `tick` between slices,
    so the clock is read once per slice, not once per BO.
    """

    def __init__(self) -> None:
        self.since = time.perf_counter()

    async def tick(self) -> bool:
        """True when it has yielded (the caller looks again at what may have changed meanwhile)."""
        if time.perf_counter() - self.since > ADD_STEP_SECONDS:
            await asyncio.sleep(0)
            self.since = time.perf_counter()
            return True
        return False


@dataclass
class Validated:
    """What a validated AddBos takes: the fds its BOs name (index in the packet -> fd, not yet taken), and
    the pids of the /proc/<pid>/mem fds among them."""

    fds: dict[int, int] = field(default_factory=dict)
    pids: set[int] = field(default_factory=set)


async def validate(bos: Sequence[rpc.Bo], bundle: FdBundle, intake: BoIntake) -> Validated:
    """Check every BO and make its item (`intake.take`), taking no fd: the fd each names is only looked at."""
    out = Validated()
    fds, pids = out.fds, out.pids
    kinds: dict[int, BackendKind] = {}  # a BO naming no backend: its fd picks one, looked at once
    step = Stepper()
    for i in range(0, len(bos), CHECK_EVERY):
        if i:
            await step.tick()
        for bo in bos[i:i + CHECK_EVERY]:
            index = bo.fd_index
            fd = fds.get(index)
            if fd is None:
                fd = fds[index] = bundle.peek(index)
                kinds[index], pid = BackendKind.for_fd(fd)
                if pid is not None:
                    pids.add(pid)
            kind = BackendKind.parse(bo.backend) if bo.backend else kinds[index]
            intake.take(bo, BoRef(kind, fd, bo.offset))
    return out


async def feed(intake: BoIntake, check: Callable[[], None]) -> None:
    """Open what the job can open ahead (in its io thread), then give it the items a few at a time, yielding
    between steps; `check` raises if the job has failed (or was cancelled) meanwhile.  What the job did not
    take is released."""
    await intake.open_ahead()  # the syscalls of opening (procmem probes, fd checks) happen off the event loop
    try:
        check()  # failed while the fds were checked
        n = len(intake)
        step = Stepper()
        for i in range(0, n, CHECK_EVERY):
            if i and await step.tick():
                check()
            intake.feed(i, min(n, i + CHECK_EVERY))
    finally:
        intake.drop()
