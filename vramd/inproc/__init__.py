"""vramd in one process: dump, restore and verify through the daemon's own session path, without a daemon.

    async with Engine(EngineConfig(staging_budget=512 << 20)) as engine:
        manifest = await inproc.dump(engine, dir_fd, [BoSpec(1, size, BoRef("procmem", mem_fd, addr))])
        await inproc.restore(engine, dir_fd, [RestoreTarget(1, BoRef("procmem", mem_fd2, addr))])
        report = await inproc.verify(engine, dir_fd)

The engine never opens a name.  Here the service's connection handling
serves one end of a socketpair on this event loop (host.py), and a client
on the other end (adapter.py: the client machine of vramd.protocol, driven
with asyncio) opens and creates the image's
files with this process's rights (vramd.imagedir): tests, benchmarks and
`vramctl verify` run what the daemon runs, request by request.
"""
from .adapter import Connection
from .api import DumpSession, VerifyReport, compression_spec, dump, restore, start_dump, verify
from .host import InProcess

__all__ = ["Connection", "DumpSession", "InProcess", "VerifyReport", "compression_spec", "dump", "restore",
           "start_dump", "verify"]
