"""A streamed restore or verify: the image's data files are filled while the job runs (vramd.image.supply).

The client hands over the read end of a pipe (or a stream socket) at
OpenSession, creates the image's data files at their full length, and tells
the daemon over that pipe how far each one is written and final.  `Supply`
reads the pipe on the event loop (non-blocking, one bounded read per wakeup)
and is the job pipeline's `Gate`: a chunk whose record (or whose delta base's
record, when it is in the image itself) is not below its file's supplied end
yet is held back before it takes a staging buffer, so a client that supplies
slowly or never holds up its own session only.  A hole has no record; a
parent's data files are complete, never streamed.

A data file's header is checked once it is supplied and a chunk waits for that
file (the job has every file attached by then), in an io thread, before any
record of the file is read.  The end of the pipe means that nothing more
comes: a chunk still held back then fails the job, naming the data file, how
far it was supplied and the chunk.  A message no client should send (an end
past the file, one going back, a file the image does not have) fails it too.

Over a socket (never a pipe), the daemon also tells the client which ranges no
chunk will read again and which end a held-back chunk waits for (notes.py), so
that a client may free what was read and bound how far it downloads ahead.
"""
from __future__ import annotations

import asyncio
import errno
import fcntl
import logging
import os
import socket
import stat
from collections.abc import Callable
from concurrent.futures import Executor

from ...errors import (
    BadDescriptorError,
    InvalidRequestError,
    JobError,
    TruncatedDataError,
    VramdError,
    from_os_error,
)
from ...image.format import DATA_HEADER
from ...image.reader import ImageReader, Loc
from ...image.supply import SupplyDecoder, SupplyError
from ..pipeline import ChunkTask, settle
from .notes import Notes, shut_sending
from .read import ImageBo

log = logging.getLogger(__name__)

# bytes read off the pipe per wakeup (256 messages, ~0.3 ms to decode): with all 64 sessions a uid may open
# flooding their pipes, another client's GetStatus waited a median 3-5 ms (64 KiB a wakeup: 60-90 ms)
READ_MAX = 4 << 10


def check_supply_fd(fd: int) -> bool:
    """The supply fd must be something the daemon can wait on and read, whose end comes when the client's
    writers are gone: a pipe's read end (open for reading only: a FIFO opened read-write is a writer too, held
    by the daemon, so its end would never come), or a unix stream socket (never a network one: the daemon
    does no network I/O); else BAD_DESCRIPTOR.  True for a socket (the daemon may talk back over it)."""
    try:
        st = os.fstat(fd)
        mode = fcntl.fcntl(fd, fcntl.F_GETFL)
    except OSError as e:
        raise from_os_error(e, "the supply fd is unusable", BadDescriptorError) from None
    if stat.S_ISSOCK(st.st_mode):
        try:
            s = socket.socket(fileno=fd)  # (not a dup: where this fails, no fd of the daemon's is left over)
        except OSError as e:
            raise from_os_error(e, "the supply socket is unusable", BadDescriptorError) from None
        try:
            family, kind = s.family, s.type
        finally:
            s.detach()  # the session's fd, closed with its others
        if family != socket.AF_UNIX:
            name = getattr(family, "name", f"family {int(family)}")
            raise BadDescriptorError(f"the supply fd is a socket of {name}, not a unix one: the daemon does no "
                                     "network I/O")
        if kind != socket.SOCK_STREAM:
            raise BadDescriptorError("the supply fd is a socket that is not a stream socket (SOCK_STREAM)")
        return True
    if not stat.S_ISFIFO(st.st_mode):
        raise BadDescriptorError("the supply fd is not a pipe nor a socket")
    if mode & os.O_ACCMODE == os.O_WRONLY:
        raise BadDescriptorError("the supply fd is not open for reading (a pipe's write end?)")
    if mode & os.O_ACCMODE != os.O_RDONLY:
        raise BadDescriptorError("the supply fd is a pipe open for writing too: the daemon would hold a writer "
                                 "of its own, and the pipe's end would never come")
    return False


def _after_stop(exc: BaseException) -> None:
    """A stopped Supply's `fail`: the job has stopped already."""


class Supply:
    """The supplied ends of the image's data files, read off the client's pipe; the pipeline's Gate.

    `fail`: how a bad message fails the job (the pipeline's `fail`); `io`: where headers are read;
    `done`: what a chunk that never came would have been ("restored", "verified")."""

    def __init__(self, reader: ImageReader, fd: int, fail: Callable[[BaseException], None], io: Executor,
                 done: str, notes: bool = True) -> None:
        self.reader = reader
        self._send_notes = notes
        self.fd = fd
        self._fail = fail
        self._io = io
        self._done = done
        files = reader.manifest.files
        self._files = len(files)  # the image's own: slots [0, n) of the reader (parents' come after)
        self._decoder = SupplyDecoder([df.length for df in files])
        self.ends = [0] * self._files  # what a chunk may be read below: its header checked, supplied
        self._headers: dict[int, asyncio.Task[None]] = {}  # file -> its header check (under way or done)
        self._eof = False
        self._stopped = False
        self._reading = False
        self._changed: asyncio.Future[None] | None = None
        self.notes: Notes | None = None  # over a socket: what is read for good, what a chunk waits for

    def start(self) -> None:
        """Read the pipe from now on (on the running loop)."""
        if check_supply_fd(self.fd) and self._send_notes:
            try:
                self.notes = Notes(self.reader, self.fd, self._files)
            except OSError as e:  # (its dup: EMFILE) the notes are a help to the client, never a condition
                log.warning("a streamed session's supply socket gets no notes: %s", e)
                sock = socket.socket(fileno=self.fd)  # the client reads their end: it waits for none
                shut_sending(sock)
                sock.detach()
        os.set_blocking(self.fd, False)  # (the pipe's: a client that reads its own end too cannot stall the loop)
        asyncio.get_running_loop().add_reader(self.fd, self._readable)
        self._reading = True

    # --- the Gate -------------------------------------------------------------

    def _short(self, task: ChunkTask[ImageBo]) -> tuple[int, int] | None:
        """(data file, the end it needs) of the first record `task` reads that is not supplied yet, or None."""
        loc: Loc | None = task.loc
        while loc is not None:
            if loc.slot < self._files and loc.offset + loc.length > self.ends[loc.slot]:
                return loc.slot, loc.offset + loc.length
            loc = loc.base  # a delta's base record (a parent's needs no supply)
        return None

    def is_ready(self, task: ChunkTask[ImageBo]) -> bool:
        return (self.notes is None or self.notes.counted) and self._short(task) is None

    def read(self, tasks: list[ChunkTask[ImageBo]]) -> None:
        if self.notes is not None:
            self.notes.read(tasks)

    async def ready(self, task: ChunkTask[ImageBo]) -> None:
        if self.notes is not None and not self.notes.counted:  # no chunk is read before its read counts down
            await self.notes.until_counted()
        while (short := self._short(task)) is not None and not self._stopped:
            slot, need = short
            if self.notes is not None and need > self._decoder.ends[slot]:
                self.notes.waiting(slot, need)
            if slot not in self._headers and self._decoder.ends[slot] >= DATA_HEADER.size \
                    and self.reader.fds[slot] >= 0:  # (attached: a job takes chunks only once every file is)
                self._headers[slot] = asyncio.get_running_loop().create_task(self._check_header(slot))
            elif self._eof and not any(not h.done() for h in self._headers.values()):
                raise TruncatedDataError(
                    f"the client stopped supplying data file {self.reader.names[slot]} at {self.ends[slot]:#x} "
                    f"(a record ends at {need:#x}): BO {task.bo.id} at offset {task.offset:#x} was not {self._done}",
                    bo_id=task.bo.id, offset=task.offset)
            if self._changed is None:
                self._changed = asyncio.get_running_loop().create_future()
            await asyncio.wait([self._changed])  # wait() never cancels the shared future

    def stop(self) -> None:
        """The job has stopped (or finished): no more reading, and every wait returns."""
        self._stopped = True
        # nothing to fail any more (the pipeline's first error won already): and the pipeline, whose gate this is,
        # is no longer referenced back, a cycle only the cyclic GC would free
        self._fail = _after_stop
        self._stop_reading()
        if self.notes is not None:
            self.notes.close()
        for h in self._headers.values():
            h.cancel()
        self._wake()

    async def closed(self) -> None:
        """After `stop`: return once no header check reads a data file any more (the session then closes them)."""
        await asyncio.gather(*self._headers.values(), return_exceptions=True)
        if self.notes is not None:
            await self.notes.closed()

    # --- the pipe ---------------------------------------------------------------

    def _wake(self) -> None:
        if self._changed is not None and not self._changed.done():
            self._changed.set_result(None)
        self._changed = None

    def _stop_reading(self) -> None:
        if self._reading:
            self._reading = False
            asyncio.get_running_loop().remove_reader(self.fd)

    def _readable(self) -> None:
        try:
            data = os.read(self.fd, READ_MAX)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as e:  # (a socket reset by its peer): nothing more comes either way
            if e.errno != errno.ECONNRESET:
                log.warning("the supply pipe of a streamed session cannot be read (%s): taken as its end", e)
            data = b""
        try:
            if not data:
                self._stop_reading()
                self._decoder.finish()
                self._eof = True
                self._wake()
                return
            for index, end in self._decoder.feed(data):
                self._advance(index, end)
        except SupplyError as e:
            self._stop_reading()
            self._fail(InvalidRequestError(f"the supply pipe: {e}"))

    def _advance(self, index: int, end: int) -> None:
        check = self._headers.get(index)
        if check is not None and check.done():  # its header is checked: the bytes are readable as supplied
            self.ends[index] = end
            self._wake()
        elif check is None and end >= DATA_HEADER.size:
            # its header is supplied: the first chunk that waits for the file has it checked (`ready`), once
            # the file is attached (the pipe may be read before: a client may supply before it attaches)
            self._wake()

    async def _check_header(self, index: int) -> None:
        try:
            # (settled: cancelled, it still waits for the thread's read, so `closed` means no read is under way)
            await settle(asyncio.get_running_loop().run_in_executor(self._io, self.reader.check_header, index))
        except asyncio.CancelledError:
            raise
        except VramdError as e:  # FOREIGN_DATA_FILE, UNSUPPORTED_VERSION, IO_ERROR: the reader's, naming the file
            self._fail(e)
            return
        except Exception as e:  # a bug: still a typed error for the client
            log.exception("checking a supplied data file's header")
            self._fail(JobError(f"internal error: {e!r}"))
            return
        self.ends[index] = self._decoder.ends[index]  # all supplied so far
        self._wake()
