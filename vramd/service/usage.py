"""The bounds on what one uid, and one session, may hold: the one place each is reserved and released.

Every per-uid bound (sessions, BOs, fds held by its sessions, fds on its
requests queued or being handled) is checked and taken by one `UidUsage`
method with no await between the check and the count, so concurrent requests
of one uid (on any of its connections) can never all pass one check.  A
session's own fds are held by its `HeldFds`, which checks the session's bound
and the uid's together.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ..errors import LimitExceededError
from ..protocol.fds import FdBundle, close_fds


def dump_fds(stripes: int) -> int:
    """The fds the smallest dump holds at once (one GPU, one BO): its GPU's `stripes` data files, the BO's fd,
    and the manifest's file given at Start.  Limits below this make every dump fail LIMIT_EXCEEDED (the
    configuration check refuses them).  Where the image's file system has O_DIRECT each data file also comes
    with its O_DIRECT twin: `stripes` more."""
    return stripes + 2


@dataclass(frozen=True)
class SessionLimits:
    max_bos: int
    max_fds: int
    max_chunks: int = 1 << 20                                  # a dump's sum of ceil(size / chunk_size)
    gpu_ids: frozenset[int] = field(default_factory=lambda: frozenset({0}))  # the gpu_ids a BO may name


@dataclass(frozen=True)
class UidLimits:
    max_bos: int  # BOs held by one uid's sessions, ended but unclosed ones included
    max_fds: int  # fds held by one uid's sessions
    max_sessions: int = 1 << 30  # sessions of one uid in the table (ended but unclosed ones included), or opening


@dataclass
class UidUsage:
    """What one uid's sessions hold (one object per uid, kept by the session table), and the fds on its requests
    received and not yet handled (`queued`, reserved by the connection that read them) or being handled
    (`handling`: until the handler is done; what a session takes from them is counted in `fds` too meanwhile,
    so a new request is refused early rather than late)."""

    limits: UidLimits
    uid: int = 0
    connections: int = 0
    sessions: int = 0
    bos: int = 0
    fds: int = 0
    queued: int = 0
    handling: int = 0

    # --- connections and sessions ----------------------------------------------

    def reserve_connection(self, limit: int) -> None:
        """One more connection of the uid, up to `limit` (max_connections_per_uid: reloadable, so given here),
        until `release_connection`."""
        if self.connections >= limit:
            raise LimitExceededError(f"uid {self.uid} has {self.connections} connections open "
                                     f"(limit max_connections_per_uid = {limit})")
        self.connections += 1

    def release_connection(self) -> None:
        self.connections -= 1

    def reserve_session(self) -> None:
        """One more session (being opened, then in the table until it is reaped: `release_session`)."""
        if self.sessions >= self.limits.max_sessions:
            raise LimitExceededError(f"uid {self.uid} already has {self.limits.max_sessions} sessions open "
                                     "(max_sessions_per_uid)")
        self.sessions += 1

    def release_session(self) -> None:
        self.sessions -= 1

    # --- what sessions hold ----------------------------------------------------

    def reserve(self, *, bos: int = 0, fds: int = 0) -> None:
        """`bos` BOs and `fds` fds more held by the uid's sessions: both or neither."""
        if self.bos + bos > self.limits.max_bos:
            raise LimitExceededError(f"uid {self.uid}'s sessions would hold more than {self.limits.max_bos} BOs "
                                     "(max_bos_per_uid)")
        if self.fds + self.queued + fds > self.limits.max_fds:
            raise LimitExceededError(f"uid {self.uid}'s sessions would hold more than {self.limits.max_fds} fds "
                                     f"(max_fds_per_uid): {self.fds} held by its sessions, {self.queued} by its "
                                     "queued requests")
        self.bos += bos
        self.fds += fds

    def release(self, *, bos: int = 0, fds: int = 0) -> None:
        self.bos -= bos
        self.fds -= fds

    # --- the fds of requests ---------------------------------------------------

    def queue(self, n: int) -> None:
        """A request's `n` fds, read and not yet handled, count for the uid from now on."""
        limit = self.limits.max_fds
        if self.fds + self.queued + self.handling + n > limit:
            raise LimitExceededError(f"uid {self.uid} would hold more than {limit} fds (max_fds_per_uid): "
                                     f"{self.fds} held by its sessions, {self.queued + self.handling} by its "
                                     f"requests not yet handled or being handled, and this request carries {n}")
        self.queued += n

    def unqueue(self, n: int) -> None:
        """A queued request's `n` fds dropped (never handled)."""
        self.queued -= n

    def start_handling(self, n: int, held: int) -> None:
        """A queued request of `n` fds is handled now; `held` of them (its handler's to take) still count until
        `done_handling`."""
        self.queued -= n
        self.handling += held

    def done_handling(self, held: int) -> None:
        self.handling -= held


class HeldFds:
    """The fds one session holds (closed when it ends), within its own bound and counted for its uid."""

    def __init__(self, usage: UidUsage, max_fds: int, fds: list[int] | None = None) -> None:
        """`fds`: fds taken already (the manifests given at open), held from now on."""
        self.usage = usage
        self.max_fds = max_fds
        self.fds: list[int] = []
        if fds:  # counted from here, unchecked: the table reserved them while it opened the session
            self.usage.fds += len(fds)
            self.fds = fds

    def __len__(self) -> int:
        return len(self.fds)

    def check(self, n: int) -> None:
        """`n` more fds fit the session's bound (the uid's is checked as they are taken)."""
        if len(self.fds) + n > self.max_fds:
            raise LimitExceededError(f"more than {self.max_fds} fds in one session (max_fds_per_session)")

    def keep(self, bundle: FdBundle, index: int) -> int:
        """The fd at `index` of the packet, held."""
        self.check(1)
        self.usage.reserve(fds=1)
        try:
            fd = bundle.take(index)
        except BaseException:
            self.usage.release(fds=1)
            raise
        self.fds.append(fd)
        return fd

    def adopt(self, fds: list[int]) -> None:
        """`fds`, reserved for the uid already (`UidUsage.reserve`) and within `check`, held from now on."""
        self.fds += fds

    def unkeep(self, fds: list[int]) -> list[int]:
        """`fds`, held, no longer held nor counted (the caller closes them)."""
        for fd in fds:
            self.fds.remove(fd)
        self.usage.release(fds=len(fds))
        return fds

    def close(self) -> None:
        """Close every fd held."""
        fds, self.fds = self.fds, []
        self.usage.release(fds=len(fds))
        close_fds(fds)
