"""The one writer of a pulled image's data files, for `vramctl pull` and a streamed restore alike.

From a checked skeleton (vramd.oci.layout) it creates every data file at its full length (zero runs stay
holes), writes the literal runs, then downloads the payload blobs in file order (the order a restore reads
them), `concurrency` at once, each streamed to every place it fills as it arrives: memory is about
`concurrency` x STREAM_PIECE, whatever size a descriptor claims.  When a blob's digest checks, its places are
done; each data file's contiguous done prefix is its supply end, handed to `on_supply(file_index, end)` as it
grows (a streamed restore writes it to the daemon's supply pipe; a pull passes nothing).  The blobs start in
that order as `window` (vramd.oci.window) lets them: all at once without a bound.  A blob that fails its
digest is a DigestMismatchError naming the BO and offset that needed it, and no end ever covers its places.
"""
from __future__ import annotations

import os
import threading
from collections.abc import Callable

from ..errors import DigestMismatchError
from ..image.fileio import image_os_error, pwrite_all
from ..image.manifest import bo_chunk_count, chunk_record
from ..pb import image_pb2 as pb
from .interrupt import Interrupt, Interrupted
from .layout import LITERAL, PAYLOAD, Skeleton
from .registry import Registry
from .window import Window

Stopped = Interrupted  # what `run` raises once stopped: the caller's own failure is the one to report

SupplyHook = Callable[[int, int], None]


class Filler:
    """Fill the data files `sk` describes in the directory `dfd`, each created under its name + `suffix`."""

    def __init__(self, reg: Registry, repo: str, sk: Skeleton, manifest: pb.Manifest, *, concurrency: int = 4,
                 on_supply: SupplyHook | None = None, where: str = ".", window: int | None = None) -> None:
        """`where`: the directory's name, for messages.  `window`: the most bytes the data files may hold
        ahead of what the daemon released (vramd.oci.window; None: no bound), once `create` made them."""
        self.reg, self.repo, self.sk, self.manifest, self.where = reg, repo, sk, manifest, where
        self.concurrency = max(1, concurrency)
        self.on_supply = on_supply
        self.fds: list[int] = []
        self.names: list[str] = []  # the files' names as created
        self._stop = Interrupt()
        self._lock = threading.Lock()
        self._places: dict[int, list[tuple[int, int, int]]] = {}  # blob -> (file index, segment index, offset)
        self._spans: list[list[int]] = []  # per file: each segment's end offset
        self._done: list[list[bool]] = []  # per file: each segment done
        self._next: list[int] = []  # per file: its first segment not done
        self._order: list[int] = []  # the blobs, by their first place in file order
        self._held = False  # ends not handed on yet (`hold`)
        self._limit = window
        self.window: Window | None = None  # made by `create`: the daemon's notes go to it

    def create(self, dfd: int, suffix: str, created: list[str]) -> None:
        """Every data file at its length, its literal runs written; the names made are appended to `created`.
        The ends covered by literal and zero runs alone are supplied at once."""
        seen: set[int] = set()
        for fi, f in enumerate(self.sk.files):
            name = f.name + suffix
            fd = os.open(name, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600,
                         dir_fd=dfd)
            created.append(name)
            self.fds.append(fd)
            self.names.append(name)
            os.ftruncate(fd, f.length)  # zero runs stay holes
            pos, spans, done = 0, [], []
            for si, s in enumerate(f.segments):
                if s.kind == LITERAL:
                    pwrite_all(fd, (s.data,), pos)
                elif s.kind == PAYLOAD:
                    self._places.setdefault(s.blob, []).append((fi, si, pos))
                    if s.blob not in seen:
                        seen.add(s.blob)
                        self._order.append(s.blob)
                pos += s.length
                spans.append(pos)
                done.append(s.kind != PAYLOAD)
            self._spans.append(spans)
            self._done.append(done)
            self._next.append(0)
        charges = {k: sum(self.sk.files[fi].segments[si].length for fi, si, _ in places)
                   for k, places in self._places.items()}
        self.window = Window(self.sk, self._order, charges, self._limit, self.concurrency)
        self.window.attach(self.fds)
        for fi in range(len(self.sk.files)):
            self._advance(fi)

    def hold(self) -> None:
        """Hand no end to on_supply until `release` (what is done meanwhile is handed on then)."""
        with self._lock:
            self._held = True

    def release(self) -> None:
        with self._lock:
            self._held = False
            if self.on_supply is not None:
                for fi, n in enumerate(self._next):
                    if n:
                        self.on_supply(fi, self._spans[fi][n - 1])

    def stop(self) -> None:
        """Stop the downloads now (a read blocked on the network included, and a request still waiting for its
        answer's head or its connection: vramd.oci.interrupt): `run` raises Stopped."""
        self._stop.fire()
        if self.window is not None:
            self.window.stop()

    def run(self) -> None:
        """Download every payload blob into its places; the first failure stops the others and is raised."""
        window = self.window
        assert window is not None, "create first"
        take = threading.Lock()
        errors: list[BaseException] = []

        def worker() -> None:
            while not self._stop.fired:
                k = window.next_blob()  # (once the window lets it start)
                if k is None:
                    return
                try:
                    self._one(k)
                except BaseException as e:
                    with take:
                        errors.append(e)
                    self.stop()
                    return

        threads = [threading.Thread(target=worker, name=f"vramd-fill-{i}", daemon=True)
                   for i in range(min(self.concurrency, max(1, len(self._order))))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        real = [e for e in errors if not isinstance(e, Stopped)]
        if real:
            raise real[0]
        if errors or (self._stop.fired and any(n < len(s) for n, s in zip(self._next, self._spans, strict=True))):
            raise Stopped()

    def sync(self) -> None:
        for fd in self.fds:
            os.fsync(fd)

    def close(self) -> None:
        for fd in self.fds:
            os.close(fd)
        self.fds = []

    # --- one blob ---------------------------------------------------------------------------------------

    def _one(self, k: int) -> None:
        digest, size = self.sk.blobs[k]
        places = [(self.fds[fi], self._start(fi, si), fi) for fi, si, _ in self._places[k]]

        def sink(offset: int, piece: memoryview) -> None:
            if self._stop.fired:
                raise Stopped()
            for fd, pos, fi in places:
                try:  # a short write (EIO, ENOSPC part way) goes on, or raises: never a file with a gap
                    pwrite_all(fd, (piece,), pos + offset)
                except OSError as e:  # the local file's error, typed: not the download's
                    at = f"{self.where}/{self.names[fi]} at {pos + offset:#x}"
                    raise image_os_error(e, f"cannot write {at}") from None

        try:
            self.reg.stream_blob(self.repo, digest, size, sink, interrupt=self._stop)
        except DigestMismatchError as e:
            fi, _si, pos = self._places[k][0]
            bo, off, name = chunk_of(self.manifest, fi, pos)
            chunk = f"BO {bo} at offset {off:#x}" if bo is not None and off is not None else "no BO"
            raise DigestMismatchError(f"{e.message}: the payload of a chunk of {chunk} ({name}); nothing was "
                                      "restored from it", bo_id=bo, offset=off) from None
        with self._lock:
            touched = set()
            for fi, si, _pos in self._places[k]:
                self._done[fi][si] = True
                touched.add(fi)
            for fi in sorted(touched):
                self._advance(fi)
        if self.window is not None:
            self.window.sample()

    def _start(self, fi: int, si: int) -> int:
        return self._spans[fi][si - 1] if si else 0

    def _advance(self, fi: int) -> None:
        """Move file `fi`'s supply end over its done segments, and tell on_supply (under the lock, so that
        the ends of one file reach it in order)."""
        n, done = self._next[fi], self._done[fi]
        start = n
        while n < len(done) and done[n]:
            n += 1
        self._next[fi] = n
        if n > start and self.on_supply is not None and not self._held:
            self.on_supply(fi, self._spans[fi][n - 1])


def chunk_of(m: pb.Manifest, file_index: int, pos: int) -> tuple[int | None, int | None, str]:
    """The BO and offset of a chunk whose record in data file `file_index` holds byte `pos` (for messages): the
    first BO's that refers to it (a deduplicated record serves several)."""
    for bo in m.bos:
        for i in range(bo_chunk_count(m, bo)):
            rec = chunk_record(m, bo, i)
            if rec is not None and rec[0] == file_index and rec[1] <= pos < rec[1] + rec[2]:
                return bo.id, i * m.chunk_size, m.files[file_index].name
    return None, None, m.files[file_index].name
