"""What a session reports: its SessionInfo (progress, rate), the image's summary, its log line, its metrics."""
from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sized
from typing import Protocol

from ..engine.pipeline import Progress
from ..errors import VramdError
from ..image.codec import compression_name
from ..pb import image_pb2 as pb
from ..pb import rpc_pb2 as rpc
from ..protocol.wire import error_to_pb
from .metrics import Metrics

RATE_WINDOW = 5.0  # seconds: a running session's rate is measured over looks at most this far back


def image_summary(m: pb.Manifest) -> rpc.ImageSummary:
    comp = compression_name(m.compression)
    return rpc.ImageSummary(bo_count=m.totals.bo_count, bo_bytes=m.totals.bo_bytes,
                            stored_bytes=m.totals.stored_bytes, zero_bytes=m.totals.zero_bytes,
                            chunk_size=m.chunk_size, compression=comp, data_files=len(m.files))


class RateMeter:
    """A session's rate from the looks at its progress: while running, since the oldest look of the last
    RATE_WINDOW seconds; once ended, the session's average."""

    def __init__(self, started: float) -> None:
        self.started = started
        self.samples: deque[tuple[float, int]] = deque()  # (when, bytes_done) of recent looks

    def rate(self, now: float, done: int, ended: float | None) -> float:
        """Bytes per second (this look is remembered; with no earlier one, since the session opened)."""
        if ended is not None:
            secs = ended - self.started
            return done / secs if secs > 0 else 0.0
        samples = self.samples
        while samples and now - samples[0][0] > RATE_WINDOW:
            samples.popleft()
        since, then = samples[0] if samples else (self.started, 0)
        if not samples or now - samples[-1][0] >= RATE_WINDOW / 20:  # a bounded number of looks kept
            samples.append((now, done))
        return (done - then) / (now - since) if now > since else 0.0


def summary_line(who: str, state: rpc.SessionState, p: Progress, secs: float, label: str,
                 error: VramdError | None) -> str:
    """One line for the log: the outcome, bytes, seconds, GB/s (decimal) and the error if any."""
    rate = p.bytes_done / secs / 1e9 if secs > 0 else 0.0
    tag = f" [{label}]" if label else ""
    line = (f"{who}: {rpc.SessionState.Name(state)}: "
            f"{p.bos_done}/{p.bos_total} BOs, {p.bytes_done}/{p.bytes_total} bytes in {secs:.3f} s, "
            f"{rate:.3f} GB/s{tag}")
    return f"{line}: {error.code}: {error}" if error is not None else line


def account(m: Metrics, kind: str, state: rpc.SessionState, error: VramdError | None, p: Progress) -> None:
    """An ended session's counters: bytes by backend, the outcome, BOs, its error."""
    direction = "read" if kind == "dump" else "write"
    for backend, nbytes in p.per_backend_bytes.items():
        m.inc("vramd_bytes_total", nbytes, backend=backend, direction=direction)
    outcome = {rpc.SESSION_DONE: "done", rpc.SESSION_CANCELLED: "cancelled"}.get(state, "failed")
    m.inc("vramd_sessions_total", kind=kind, outcome=outcome)
    m.inc("vramd_bos_total", p.bos_done, kind=kind)
    if error is not None:
        m.count_error(error, error.code)  # not again if a reply (a failed AddBos) counted it


class Reported(Protocol):
    """What `session_info` reads of a session."""

    id: int
    kind: rpc.SessionKind
    uid: int
    pid: int
    label: str
    image_id: bytes
    target_pids: set[int]
    started: float
    ended: float | None
    image: rpc.ImageSummary | None

    @property
    def holders(self) -> Sized: ...

    @property
    def state(self) -> rpc.SessionState: ...

    @property
    def error(self) -> VramdError | None: ...


def session_info(s: Reported, p: Progress, rate: Callable[[float], float]) -> rpc.SessionInfo:
    """The SessionInfo every reply carries (without the token and what only its holders see)."""
    now = time.monotonic()
    end = s.ended if s.ended is not None else now
    info = rpc.SessionInfo(
        session_id=s.id, kind=s.kind, state=s.state, uid=s.uid, pid=s.pid, label=s.label,
        holders=len(s.holders), target_pids=sorted(s.target_pids), rate_bytes_per_s=rate(now),
        age_s=now - s.started,
        progress=rpc.Progress(bos_total=p.bos_total, bos_done=p.bos_done, bytes_total=p.bytes_total,
                              bytes_done=p.bytes_done, chunks_done=p.chunks_done, elapsed_s=end - s.started))
    info.image_id = s.image_id
    if s.error is not None:
        info.error.CopyFrom(error_to_pb(s.error))
    if s.image is not None:
        info.image.CopyFrom(s.image)
    return info
