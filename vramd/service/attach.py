"""An AttachFiles message's files on their way into a job: files_needed entries, and a dump's own data files.

Each file's fd (and its O_DIRECT twin's) is held by the session (`HeldFds`)
before the job checks the file.  The first bad file is the reply's error: the
files_needed entries before it stay attached, a dump's own data files of the
message do not (the clients remove the files of a refused message, so the
manifest must not list one of them; the GPU's files can then be attached
again).  Those are written into only once the whole message is taken.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

from ..engine.jobs.common import check_gpu
from ..engine.jobs.interface import Job
from ..image.writer import DataFileWriter
from ..pb import rpc_pb2 as rpc
from ..protocol.fds import FdBundle, close_fds
from .usage import HeldFds


def keep_file(held: HeldFds, bundle: FdBundle, f: rpc.FileRef) -> tuple[int, int | None]:
    """The file's fd and its O_DIRECT twin's (if given), held by the session."""
    fd = held.keep(bundle, f.fd_index)
    return fd, held.keep(bundle, f.direct_fd_index) if f.HasField("direct_fd_index") else None


def take_data_file(job: Job, held: HeldFds, bundle: FdBundle, f: rpc.FileRef,
                   gpu_ids: frozenset[int]) -> tuple[DataFileWriter, list[int]]:
    """A dump's own data file, attached (not yet written into), with the fds the session holds for it; a
    refused one holds none."""
    check_gpu(f.gpu_id, gpu_ids)
    mark = len(held)
    try:
        fd, direct = keep_file(held, bundle, f)
        return job.attach_data_file(f.image, f.name, f.gpu_id, f.stripe, fd, direct), held.fds[mark:]
    except BaseException:
        close_fds(held.unkeep(held.fds[mark:]))
        raise


async def attach_files(job: Job, held: HeldFds, files: Sequence[rpc.FileRef], bundle: FdBundle,
                       gpu_ids: frozenset[int], check_open: Callable[[], None]) -> None:
    """Take the files of one AttachFiles message (the module's docstring says how); `check_open` raises if the
    session has ended meanwhile (a file's check awaits a thread)."""
    own_files = job.data_files_per_gpu > 0  # the job writes data files of its own (a dump): named by gpu_id
    own: list[tuple[DataFileWriter, list[int]]] = []  # a dump's own data files this message attached
    try:
        for f in files:
            if own_files and f.HasField("gpu_id"):
                own.append(take_data_file(job, held, bundle, f, gpu_ids))
            else:
                fd, direct = keep_file(held, bundle, f)
                await job.attach_file(f.image, f.name, fd, direct)
                check_open()  # still open after the check in a thread
    except BaseException:
        if own:
            job.detach_data_files([w for w, _ in own])
            for w, fds in own:  # closed in the file's writer thread, after its header write (the session's end
                # waits for this message before it closes the fds it holds: Session._finish)
                w.abandon(held.unkeep(fds))
        raise
    if own:
        job.publish_data_files([w for w, _ in own])
