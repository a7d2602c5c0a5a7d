"""dump, restore and verify in one call, in this process, through the daemon's session path (host.py)."""
from __future__ import annotations

import asyncio
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from ..engine import BoSpec, Engine, Progress, RestoreTarget
from ..image.codec import Compression
from ..image.fileio import read_manifest_now
from ..imagedir import DumpDirectory, ImageFiles
from ..pb import image_pb2 as pb
from ..pb import rpc_pb2 as rpc
from ..protocol.client import ClientBo
from .host import InProcess
from .session import Session


@dataclass
class VerifyReport:
    manifest: pb.Manifest
    progress: Progress


def compression_spec(compression: Compression | str | None) -> str:
    """OpenSession's compression for a `Compression` (or its text); None: the engine's default."""
    if compression is None:
        return ""
    if isinstance(compression, str):
        return compression
    return "none" if compression.mode == "none" else f"{compression.mode}:{compression.level}"


def progress_of(info: rpc.SessionInfo) -> Progress:
    p = info.progress
    return Progress(bos_total=p.bos_total, bos_done=p.bos_done, bytes_total=p.bytes_total, bytes_done=p.bytes_done,
                    chunks_done=p.chunks_done)


def dump_bo(b: BoSpec) -> ClientBo:
    return ClientBo(b.id, b.ref.fd, b.ref.offset, b.size, b.ref.kind, b.gpu_id, b.alloc_flags, b.va_addr, b.name)


def restore_bo(t: RestoreTarget) -> ClientBo:
    return ClientBo(t.bo_id, t.ref.fd, t.ref.offset, backend=t.ref.kind, gpu_id=t.gpu_id)


class DumpSession:
    """A dump session in this process (`start_dump`): `add` BOs, then `finish` (Start, Wait, the commit), or
    `cancel`; `close` (or leaving `async with`) ends it, removing an uncommitted dump's files."""

    def __init__(self, host: InProcess, session: Session) -> None:
        self.host = host
        self.session = session

    async def add(self, bos: Sequence[BoSpec]) -> rpc.SessionInfo:
        return await self.session.add([dump_bo(b) for b in bos])

    async def cancel(self, reason: str = "") -> rpc.SessionInfo:
        return await self.session.cancel(reason)

    async def finish(self) -> pb.Manifest:
        """Start, then the barrier; the image committed, its manifest returned (or the dump's typed error)."""
        await self.session.start()
        await self.session.wait()
        return self.session.manifest()

    async def close(self) -> None:
        try:
            await self.session.close()
        finally:
            await self.host.close()

    async def __aenter__(self) -> DumpSession:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


async def start_dump(engine: Engine, dir_fd: int, *, gpu_ids: Iterable[int] = (0,),
                     compression: Compression | str | None = None, chunk_size: int = 0,
                     parent_fds: Sequence[int] = (), parent_hint: str = "", dedup: bool = True,
                     replace_parent: bool = False, where: str = "the image directory") -> DumpSession:
    """A dump into a new image in the directory `dir_fd` (locked from here to its end), whose BOs may name
    `gpu_ids`.  `parent_fds`: an incremental image's parent directories, nearest first; `parent_hint`,
    `dedup`, `replace_parent`: as OpenSession's; `where`: how errors name the directory."""
    host = InProcess(engine, gpu_ids)
    try:
        conn = await host.connect()
        out = DumpDirectory(dir_fd, parent_fds, replace_parent=replace_parent, where=where)
        try:
            files = ImageFiles(None, parent_fds, where=where)
        except BaseException:
            out.close()
            raise
        session = await Session.open(conn, rpc.SESSION_DUMP, files, out, compression=compression_spec(compression),
                                     chunk_size=chunk_size, parent_hint=parent_hint, no_dedup=not dedup,
                                     replace_parent=replace_parent)
    except BaseException:
        await host.close()
        raise
    return DumpSession(host, session)


async def dump(engine: Engine, dir_fd: int, bos: Sequence[BoSpec], *, compression: Compression | str | None = None,
               chunk_size: int = 0, parent_fds: Sequence[int] = (), parent_hint: str = "", dedup: bool = True,
               replace_parent: bool = False, where: str = "the image directory") -> pb.Manifest:
    """Dump `bos` into a new image in the directory `dir_fd`, committed; its manifest (options: start_dump's)."""
    async with await start_dump(engine, dir_fd, gpu_ids={b.gpu_id for b in bos}, compression=compression,
                                chunk_size=chunk_size, parent_fds=parent_fds, parent_hint=parent_hint, dedup=dedup,
                                replace_parent=replace_parent, where=where) as s:
        if bos:
            await s.add(bos)
        return await s.finish()


async def _read(engine: Engine, kind: rpc.SessionKind, dir_fd: int, bos: Sequence[ClientBo], *,
                parent_fds: Sequence[int], where: str, allow_partial: bool = False) -> tuple[pb.Manifest,
                                                                                              rpc.SessionInfo]:
    """One restore or verify session: open, add `bos`, start, wait, close; the image's manifest (as this side
    read it: it names the GPUs the BOs go to) and the final info."""
    files = ImageFiles(dir_fd, parent_fds, where=where)
    try:
        assert files.manifest_fd is not None
        m = await asyncio.get_running_loop().run_in_executor(None, read_manifest_now, files.manifest_fd)
        host = InProcess(engine, {bo.gpu_id for bo in m.bos} | {b.gpu_id for b in bos if b.gpu_id is not None})
    except BaseException:
        files.close()
        raise
    async with host:
        try:
            conn = await host.connect()
        except BaseException:
            files.close()
            raise
        s = await Session.open(conn, kind, files, None, allow_partial=allow_partial)
        try:
            if bos:
                await s.add(bos)
            await s.start()
            return m, await s.wait()
        finally:
            await s.close()


async def restore(engine: Engine, dir_fd: int, targets: Sequence[RestoreTarget], *, allow_partial: bool = False,
                  parent_fds: Sequence[int] = (), where: str = "the image directory") -> Progress:
    """Restore the image in `dir_fd` (its parents' directories: `parent_fds`, nearest first) into `targets`;
    what moved.  `where`: how errors name the directory (its path)."""
    _, info = await _read(engine, rpc.SESSION_RESTORE, dir_fd, [restore_bo(t) for t in targets],
                          parent_fds=parent_fds, where=where, allow_partial=allow_partial)
    return progress_of(info)


async def verify(engine: Engine, dir_fd: int, *, parent_fds: Sequence[int] = (),
                 where: str = "the image directory") -> VerifyReport:
    """Read every chunk of the image in `dir_fd` and check it (checksums, lengths, zstd frames), writing
    nowhere.  `where`: how errors name the directory (its path)."""
    manifest, info = await _read(engine, rpc.SESSION_VERIFY, dir_fd, [], parent_fds=parent_fds, where=where)
    return VerifyReport(manifest, progress_of(info))
