"""One session's steps on the client's side of an in-process connection, its image's files opened here.

The same steps as `vramd.client.Client` takes over a socket, awaited:
OpenSession (a dump's directory locked first, a restore's manifests opened),
the files the daemon needs, each GPU's data files before its first BO,
AddBos, Start (a dump's manifest file), Wait, the commit, CloseSession.
Every name is opened or created here, with this process's rights
(vramd.imagedir); the daemon's side gets fds only.
"""
from __future__ import annotations

import asyncio
from collections.abc import Sequence

from ..errors import VramdError
from ..image.fileio import read_manifest_now
from ..imagedir import DumpDirectory, ImageFiles, OpenedFile
from ..pb import image_pb2 as pb
from ..pb import rpc_pb2 as rpc
from ..protocol.client import ClientBo, ClientFile
from .adapter import Connection


def _wire(f: OpenedFile) -> ClientFile:
    return ClientFile(f.image, f.name, f.fd, f.direct_fd, f.gpu_id, f.stripe)


class Session:
    """A session this connection opened (`open`), with the files it opened or created for it (`files`, and a
    dump's `out`).  `close` ends it on both sides: an uncommitted dump's files are removed."""

    def __init__(self, conn: Connection, files: ImageFiles, out: DumpDirectory | None) -> None:
        self.conn = conn
        self.files = files
        self.out = out
        self.token = ""
        self.info = rpc.SessionInfo()

    @classmethod
    async def open(cls, conn: Connection, kind: rpc.SessionKind, files: ImageFiles, out: DumpDirectory | None,
                   **options: object) -> Session:
        """OpenSession for `files` (a restore's or verify's image, or a dump's parents) and, for a dump, its
        directory `out` (locked); then the files the daemon needs are opened and attached.  `options`: the
        other OpenSession fields by name.  The session owns `files` and `out` from here on, even on error."""
        s = cls(conn, files, out)
        try:
            info = await conn.session_call(conn.protocol.open_session_request(
                kind, manifest_fd=files.manifest_fd, parent_manifest_fds=files.parent_manifest_fds, **options))
            s.token, s.info = info.token, info
            if out is not None:
                out.begin(info.image_id, info.data_files_per_gpu)
            needed = [(f.image, f.name) for f in info.files_needed]
            await s.attach(await asyncio.get_running_loop().run_in_executor(None, files.open_needed, needed))
        except BaseException:
            await s.close()
            raise
        return s

    async def attach(self, files: Sequence[OpenedFile], taken: list[int] | None = None) -> None:
        """AttachFiles, in as many messages as the limits need; `taken[0]` counts the files the daemon took."""
        for out in self.conn.protocol.attach_requests(self.token, [_wire(f) for f in files]):
            await self.conn.call(out)
            if taken is not None:
                taken[0] += len(out.request.attach_files.files)

    async def add(self, bos: Sequence[ClientBo]) -> rpc.SessionInfo:
        """AddBos; a dump's data files of each GPU the daemon knows are created and attached before its first
        BO (a refused AttachFiles removes the files it carried and those after it)."""
        if self.out is not None:
            known = set(self.conn.hello_reply.allowed_gpu_ids)
            new = sorted(({b.gpu_id or 0 for b in bos} & known) - self.out.gpus())
            made: list[OpenedFile] = []
            taken = [0]
            try:
                for g in new:
                    made.extend(self.out.data_file(g, k) for k in range(self.out.stripes))
                await self.attach(made, taken)
            except BaseException:
                self.out.drop(made[taken[0]:])
                raise
        for out in self.conn.protocol.add_bos_requests(self.token, bos):
            self.info = await self.conn.session_call(out)
        return self.info

    async def start(self) -> rpc.SessionInfo:
        """No more BOs; a dump's manifest file is created and handed over."""
        manifest = self.out.manifest_file() if self.out is not None else None
        self.info = await self.conn.session_call(self.conn.protocol.start_request(self.token, manifest))
        return self.info

    async def wait(self, timeout: float | None = None) -> rpc.SessionInfo:
        """The barrier: the final info, or the session's typed error.  A dump is committed here once DONE."""
        w = rpc.Wait(token=self.token)
        if timeout is not None:
            w.timeout_ms = max(0, int(timeout * 1000))
        self.info = await self.conn.session_call(self.conn.protocol.request(wait=w))
        if self.out is not None and self.info.state == rpc.SESSION_DONE:
            self.out.commit()
        return self.info

    def manifest(self) -> pb.Manifest:
        """A committed dump's manifest, read back from the file this side created."""
        assert self.out is not None and self.out.committed and self.out.manifest_fd is not None
        return read_manifest_now(self.out.manifest_fd)

    async def cancel(self, reason: str = "") -> rpc.SessionInfo:
        self.info = await self.conn.session_call(self.conn.protocol.cancel_request(token=self.token,
                                                                                   reason=reason))
        return self.info

    async def close(self) -> None:
        """CloseSession (cancelled if it still runs; any error of it is not this one's to report), then this
        side's files: an uncommitted dump's are removed, its directory unlocked."""
        try:
            if self.token:
                token, self.token = self.token, ""
                try:
                    await self.conn.call(self.conn.protocol.request(close_session=rpc.CloseSession(token=token)))
                except (VramdError, OSError):
                    pass
        finally:
            try:
                if self.out is not None:
                    self.out.close()
            finally:
                self.files.close()

