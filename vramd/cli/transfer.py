"""`vramctl dump` and `vramctl restore`: a session through the daemon, on fds vramctl opened itself."""
from __future__ import annotations

import argparse
import errno
import os
import sys
import time
from collections.abc import Callable
from typing import Any

from ..client import SESSION_DUMP, SESSION_RESTORE, Client, ClientBo, topology_checks_from_env
from ..errors import VramdError
from ..pb import image_pb2 as pb
from ..pb import rpc_pb2 as rpc
from ..units import format_size
from .common import EXIT_OK, SOURCE_NAMES, Failure, connect, emit, rate, session_dict
from .imagedir import holds_image, open_image_dir, open_parents, read_manifest_offline, remove_created
from .progress import Bar, follow


def transfer(ns: argparse.Namespace, kind: rpc.SessionKind, dfd: int, bos: list[ClientBo], what: str,
             opened: Callable[[], None] | None = None, **open_kw: Any) -> tuple[rpc.SessionInfo, float]:
    """One dump or restore session through the daemon: (its final info, seconds it took).  `opened`: called
    once the session is open, its files attached (a streamed restore's supply starts then)."""
    with connect(ns) as c:
        t0 = time.monotonic()
        label = f"vramctl {what}" + (f" pid {ns.pid}" if ns.pid is not None else "")
        s = c.open_session(kind, dfd, label=label, **open_kw)
        try:
            if opened is not None:
                opened()
            c.add_bos(s.token, bos)
        except BaseException:
            try:
                c.close_session(s.token)  # nothing else will use it: the daemon forgets it now, not after the grace
            except (VramdError, OSError):
                pass  # the first error is the one to report
            raise
        info = run_session(ns, c, s.token, what)
        return info, time.monotonic() - t0


def run_session(ns: argparse.Namespace, client: Client, token: str, what: str) -> rpc.SessionInfo:
    """Start the session and follow it to its end (a bar on a TTY), then close it."""
    client.start(token)
    bar = Bar(what) if not ns.json and sys.stderr.isatty() else None
    try:
        return follow(client, token, bar)[0]
    finally:
        if bar is not None:
            bar.close()
        try:
            client.close_session(token)
        except (VramdError, OSError):
            pass

def open_procmem(pid: int, flags: int) -> int:
    try:
        return os.open(f"/proc/{pid}/mem", flags | os.O_CLOEXEC)
    except OSError as e:
        if e.errno == errno.ENOENT:
            todo = f"no process {pid} is running: check --pid"
        elif e.errno in (errno.EACCES, errno.EPERM):
            todo = (f"you may not trace process {pid}: run vramctl as its user (or root), and see "
                    "/proc/sys/kernel/yama/ptrace_scope")
        else:
            todo = "check --pid"
        raise Failure(f"cannot open /proc/{pid}/mem: {e.strerror}; {todo}") from None


def cmd_dump(ns: argparse.Namespace) -> int:
    if not ns.range and not ns.bo_file:
        raise Failure("nothing to dump: give --range and/or --bo-file")
    fds: list[int] = []
    bos: list[ClientBo] = []
    created: list[str] = []  # directories this dump made: removed again if it fails
    ok = False
    try:
        if ns.range:
            mem = open_procmem(ns.pid, os.O_RDONLY)
            fds.append(mem)
            for addr, length in ns.range:
                bos.append(ClientBo(len(bos) + 1, mem, offset=addr, size=length, backend="procmem", va_addr=addr))
        for path, off, length in ns.bo_file or []:
            try:
                fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            except OSError as e:
                raise Failure(f"cannot open {path}: {e.strerror}") from None
            fds.append(fd)
            if length is None:
                length = max(0, os.fstat(fd).st_size - off)
            bos.append(ClientBo(len(bos) + 1, fd, offset=off, size=length, backend="mmap",
                                name=os.path.abspath(path)))
        dfd = open_image_dir(ns.image, create=True, created=created)
        fds.append(dfd)
        if not ns.force and holds_image(dfd):
            raise Failure(f"{ns.image} already holds an image; --force replaces it (atomically, when the new one "
                          "commits)")
        parent_fds: list[int] = []
        hint = ""
        if ns.parent:
            pfd = open_image_dir(ns.parent, create=False)
            fds.append(pfd)
            _paths, chain = open_parents(ns.parent, read_manifest_offline(pfd, ns.parent), None)
            fds += chain
            parent_fds = [pfd, *chain]
            hint = os.path.relpath(os.path.abspath(ns.parent), os.path.abspath(ns.image))
        info, secs = transfer(ns, SESSION_DUMP, dfd, bos, "dump", compression=ns.compress or "",
                              parent_fds=parent_fds, parent_hint=hint, dedup=not ns.no_dedup,
                              replace_parent=ns.replace_parent, where=ns.image)
        ok = True
    finally:
        for fd in fds:
            os.close(fd)
        if not ok:
            remove_created(created)
    d = session_dict(info)
    total = info.progress.bytes_total
    stored = info.image.stored_bytes
    d.update(ok=True, seconds=round(secs, 6), image_dir=os.path.abspath(ns.image))
    emit(ns, d, f"dumped {len(bos)} BO(s), {format_size(total)} in {secs:.2f} s ({rate(total, secs)}) to {ns.image}; "
                f"stored {format_size(stored)}")
    return EXIT_OK


def cmd_restore(ns: argparse.Namespace, *, supply: tuple[int, Callable[[], None]] | None = None,
                shown: str | None = None, report: list[tuple[dict[str, Any], str]] | None = None) -> int:
    """`supply`: a streamed restore's supply pipe and what to call once the session is open (vramd.oci.stream);
    `shown`: the image's name in the report where ns.image is a staging directory; `report`: the report (its
    JSON and its line) appended there for the caller to complete and emit, not emitted."""
    fds: list[int] = []
    bos: list[ClientBo] = []
    try:
        dfd = open_image_dir(ns.image, create=False)
        fds.append(dfd)
        manifest = read_manifest_offline(dfd, ns.image)
        targets = dict(ns.bo_file or [])
        file_ids = sorted(e.id for e in manifest.bos if e.source == pb.SOURCE_MMAP)
        unknown = sorted(set(targets) - set(file_ids))
        if unknown:  # before any other complaint: a mistyped id is the mistake to name
            raise Failure(f"the image has no file BO {unknown[0]} (--bo-file {unknown[0]}=...); its file BOs: "
                          f"{', '.join(map(str, file_ids)) or 'none'}")
        mem = None
        for e in manifest.bos:
            if e.source == pb.SOURCE_PROCMEM:
                if mem is None:
                    mem = open_procmem(ns.pid, os.O_RDWR)
                    fds.append(mem)
                bos.append(ClientBo(e.id, mem, offset=e.source_offset, backend="procmem"))
            elif e.source == pb.SOURCE_MMAP:
                # An image is data, not instructions: the path it recorded is opened only when the caller
                # says so (--to-recorded-paths); otherwise the caller names each file (--bo-file ID=PATH).
                path = targets.pop(e.id, None) or (e.name if ns.to_recorded_paths and e.name else None)
                if path is None:
                    raise Failure(f"BO {e.id} was dumped from a file; name where it goes with --bo-file {e.id}=PATH "
                                  f"(or --to-recorded-paths to write it to {e.name or 'its recorded path'})")
                try:
                    fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
                except OSError as err:
                    raise Failure(f"cannot open {path} (BO {e.id}) for writing: {err.strerror}") from None
                fds.append(fd)
                bos.append(ClientBo(e.id, fd, offset=e.source_offset, backend="mmap"))
            else:
                raise Failure(f"BO {e.id} was saved from a {SOURCE_NAMES.get(e.source, 'unknown')} source that "
                              "vramctl cannot target; restore it through the plugin that dumped it")
        _paths, parent_fds = open_parents(ns.image, manifest, ns.parent)
        fds += parent_fds
        # CRIU's KFD_*_CHECK switches travel with the request (the daemon never reads its own environment)
        stream: dict[str, int] = {} if supply is None else {"supply_fd": supply[0]}
        info, secs = transfer(ns, SESSION_RESTORE, dfd, bos, "restore", supply[1] if supply else None,
                              topology_checks=topology_checks_from_env(), parent_fds=parent_fds, where=ns.image,
                              **stream)
    finally:
        for fd in fds:
            os.close(fd)
    d = session_dict(info)
    total = info.progress.bytes_total
    d.update(ok=True, seconds=round(secs, 6), image_dir=os.path.abspath(shown or ns.image))
    line = f"restored {len(bos)} BO(s), {format_size(total)} in {secs:.2f} s ({rate(total, secs)}) from " \
        f"{shown or ns.image}"
    if report is not None:
        report.append((d, line))
    else:
        emit(ns, d, line)
    return EXIT_OK
