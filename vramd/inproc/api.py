"""dump, restore and verify in one call, in this process, through the daemon's session path (host.py)."""
from __future__ import annotations

import asyncio
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from ..engine import BoSpec, Engine, Progress, RestoreTarget
from ..errors import VramdError
from ..image.codec import Compression
from ..image.fileio import read_manifest_now
from ..imagedir import DumpDirectory, ImageFiles, SessionFiles
from ..pb import image_pb2 as pb
from ..pb import rpc_pb2 as rpc
from ..protocol.client import ClientBo
from ..protocol.requests import OpenSpec
from .adapter import Connection
from .host import InProcess


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


class _DumpFiles(SessionFiles):
    """A dump's files, whose manifest is read back (from the file this side created) when it commits."""

    manifest: pb.Manifest | None = None

    def commit(self) -> None:
        super().commit()
        assert self.dump is not None and self.dump.manifest_fd is not None
        self.manifest = read_manifest_now(self.dump.manifest_fd)


class DumpSession:
    """A dump session in this process (`start_dump`): `add` BOs, then `finish` (Start, Wait, the commit), or
    `cancel`; `close` (or leaving `async with`) ends it, removing an uncommitted dump's files."""

    def __init__(self, host: InProcess, conn: Connection, token: str, files: _DumpFiles) -> None:
        self.host = host
        self.conn = conn
        self.token = token
        self._files = files

    async def add(self, bos: Sequence[BoSpec]) -> rpc.SessionInfo:
        return await self.conn.add_bos(self.token, [dump_bo(b) for b in bos])

    async def progress(self) -> rpc.SessionInfo:
        return await self.conn.progress(self.token)

    async def cancel(self, reason: str = "") -> rpc.SessionInfo:
        return await self.conn.cancel(self.token, reason)

    async def finish(self) -> pb.Manifest:
        """Start, then the barrier; the image committed, its manifest returned (or the dump's typed error)."""
        await self.conn.start(self.token)
        await self.conn.wait(self.token)
        assert self._files.manifest is not None  # a Wait that answers DONE commits
        return self._files.manifest

    async def close(self) -> None:
        try:
            try:
                await self.conn.close_session(self.token)
            except (VramdError, OSError):
                pass  # ended already (a Wait that answered); the first error is the one to report
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
            files = _DumpFiles(ImageFiles(None, parent_fds, where=where), out)
        except BaseException:
            out.close()
            raise
        spec = OpenSpec(rpc.SESSION_DUMP, compression=compression_spec(compression), chunk_size=chunk_size,
                        parents=len(parent_fds), parent_hint=parent_hint, dedup=dedup, replace_parent=replace_parent)
        info = await conn.open_session(spec, files)
    except BaseException:
        await host.close()
        raise
    return DumpSession(host, conn, info.token, files)


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
        info = await conn.open_session(OpenSpec(kind, allow_partial=allow_partial, parents=len(parent_fds)),
                                       SessionFiles(files))
        try:
            if bos:
                await conn.add_bos(info.token, bos)
            await conn.start(info.token)
            return m, await conn.wait(info.token)
        finally:
            try:
                await conn.close_session(info.token)
            except (VramdError, OSError):
                pass  # the first error is the one to report


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
