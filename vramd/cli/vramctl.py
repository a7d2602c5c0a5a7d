"""`vramctl`: a thin client of the daemon, plus offline image tools.

    vramctl [--socket S] status [--json]
    vramctl [--socket S] sessions [--all] [--json]      (--all: every uid's, for root and the daemon's uid)
    vramctl [--socket S] cancel TOKEN|ID [--reason TEXT] [--json]
    vramctl [--socket S] dump [--pid PID --range ADDR:LEN [--range ...]] [--bo-file PATH[:OFF:LEN] ...]
                              --image DIR [--compress none|zstd|bplanes|auto[:LEVEL]] [--json]
    vramctl [--socket S] restore --pid PID --image DIR [--json]
    vramctl [--socket S] dump ... --parent PARENT_DIR    (an incremental image)
    vramctl verify DIR [--parent DIR] [--json]          (offline: no daemon)
    vramctl inspect DIR [--json]                        (offline: no daemon)
    vramctl flatten DIR OUT [--parent DIR] [--json]     (offline: a self-contained copy)
    vramctl rm DIR [--parent DIR] [--json]              (offline: an image no child needs)
    vramctl gc DIR [--json]                             (offline: interrupted dumps' temporaries, stale marks)
    vramctl [--socket S] selftest [--size 64M] [--json]

vramctl opens /proc/PID/mem and the BO files, and opens and creates the
image's files in the image directory itself, with the caller's rights (it
also commits a dump); it passes the fds, and the daemon never gets the
directory and never opens a path.  --socket may come
before or after the command.  Rates are in GB/s (decimal: 1 GB = 10^9
bytes).  Exit codes: 0 success; 1 failure, with a one-line reason on stderr
(and in the JSON with --json); 2 usage error; output cut short by a closed
pipe (`vramctl ... | head`) ends quietly with 141, as SIGPIPE would.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import select
import shutil
import sys
import tempfile
import time
from typing import Any

from .. import __version__
from ..client import SESSION_DUMP, SESSION_RESTORE, Client, ClientBo, topology_checks_from_env
from ..errors import NotWritableError, PermissionDeniedError, VramdError
from ..image.codec import compression_name
from ..image.format import chunk_count, chunk_record
from ..pb import image_pb2 as pb
from ..pb import rpc_pb2 as rpc
from ..protocol.wire import code_name, enum_name
from ..units import format_size, parse_size
from .progress import Bar, follow

EXIT_OK, EXIT_FAILURE, EXIT_USAGE, EXIT_PIPE = 0, 1, 2, 128 + 13  # 141: as if killed by SIGPIPE
SOURCE_NAMES = {pb.SOURCE_PROCMEM: "procmem", pb.SOURCE_MMAP: "mmap", pb.SOURCE_SDMA: "sdma"}


class Failure(Exception):
    """A one-line reason to exit 1 with."""


# --- argument types ----------------------------------------------------------

def parse_range(text: str) -> tuple[int, int]:
    addr, sep, length = text.partition(":")
    if not sep:
        raise argparse.ArgumentTypeError(f"{text!r}: expected ADDR:LEN")
    try:
        return parse_size(addr), parse_size(length)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"{text!r}: {e}") from None


def parse_bo_target(text: str) -> tuple[int, str]:
    """ID=PATH: where `vramctl restore` writes the file BO with that id."""
    bo_id, sep, path = text.partition("=")
    if not sep or not path or not bo_id.strip().isdigit():
        raise argparse.ArgumentTypeError(f"{text!r}: expected ID=PATH (the BO's id in the image, then a file)")
    return int(bo_id), path


def parse_bo_file(text: str) -> tuple[str, int, int | None]:
    """PATH or PATH:OFF:LEN (a path may itself contain colons)."""
    parts = text.rsplit(":", 2)
    if len(parts) == 3:
        try:
            return parts[0], parse_size(parts[1]), parse_size(parts[2])
        except ValueError:
            pass
    return text, 0, None


# --- output ------------------------------------------------------------------

def session_dict(info: rpc.SessionInfo) -> dict[str, Any]:
    p = info.progress
    d: dict[str, Any] = {
        # a kind or state this vramctl does not know (a newer daemon's) is shown by its number, never a crash
        "session_id": info.session_id,
        "kind": enum_name(rpc.SessionKind, info.kind, "SESSION_KIND_").removeprefix("SESSION_").lower(),
        "state": enum_name(rpc.SessionState, info.state, "SESSION_STATE_").removeprefix("SESSION_").lower(),
        "uid": info.uid,
        "pid": info.pid, "label": info.label, "holders": info.holders, "target_pids": list(info.target_pids),
        "rate_bytes_per_s": round(info.rate_bytes_per_s, 3), "age_s": round(info.age_s, 6),
        "progress": {"bos_total": p.bos_total, "bos_done": p.bos_done, "bytes_total": p.bytes_total,
                     "bytes_done": p.bytes_done, "chunks_done": p.chunks_done, "elapsed_s": round(p.elapsed_s, 6)},
    }
    if info.HasField("image"):
        i = info.image
        d["image"] = {"bo_count": i.bo_count, "bo_bytes": i.bo_bytes, "stored_bytes": i.stored_bytes,
                      "zero_bytes": i.zero_bytes, "chunk_size": i.chunk_size, "compression": i.compression,
                      "data_files": i.data_files}
    if info.error.code != rpc.OK:
        d["error"] = {"code": code_name(info.error.code), "message": info.error.message,
                      "bo_id": info.error.bo_id if info.error.HasField("bo_id") else None,
                      "offset": info.error.offset if info.error.HasField("offset") else None}
    return d


def emit(ns: argparse.Namespace, data: dict[str, Any], text: str) -> None:
    print(json.dumps(data, indent=2, sort_keys=True) if ns.json else text)


def gbps(bytes_per_s: float) -> str:
    """A rate as vramctl prints every rate: GB/s, decimal (1 GB = 10^9 bytes), like the daemon's log."""
    return f"{bytes_per_s / 1e9:.2f} GB/s"


def rate(nbytes: int, seconds: float) -> str:
    return gbps(nbytes / seconds) if seconds > 0 else "-"


# --- sessions ----------------------------------------------------------------

def connect(ns: argparse.Namespace, name: str = "vramctl") -> Client:
    """The daemon at --socket (else the search order), authenticated with --daemon-user (vramd.paths)."""
    return Client(ns.socket, name=name, daemon_user=ns.daemon_user)


def transfer(ns: argparse.Namespace, kind: rpc.SessionKind, dfd: int, bos: list[ClientBo], what: str,
             **open_kw: Any) -> tuple[rpc.SessionInfo, float]:
    """One dump or restore session through the daemon: (its final info, seconds it took)."""
    with connect(ns) as c:
        t0 = time.monotonic()
        label = f"vramctl {what}" + (f" pid {ns.pid}" if ns.pid is not None else "")
        s = c.open_session(kind, dfd, label=label, **open_kw)
        try:
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


# --- commands ----------------------------------------------------------------

def open_image_dir(path: str, *, create: bool, created: list[str] | None = None) -> int:
    """An fd of the image directory; with `create`, made first where missing (`created` then gets the
    directories this call made, deepest first, for `remove_created`)."""
    try:
        if create:
            made = []
            d = os.path.abspath(path)
            while not os.path.lexists(d):
                made.append(d)
                d = os.path.dirname(d)
            os.makedirs(path, exist_ok=True)
            if created is not None:
                created += made
        return os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except PermissionError as e:  # this process's own rights: the daemon never opens it
        if create:
            raise NotWritableError(f"cannot create the image directory {path}: uid {os.geteuid()} may not "
                                   f"({e.strerror})") from None
        raise PermissionDeniedError(f"cannot open the image directory {path}: uid {os.geteuid()} may not read "
                                    f"it ({e.strerror})") from None
    except OSError as e:
        raise Failure(f"cannot open image directory {path}: {e.strerror}") from None


def remove_created(created: list[str]) -> None:
    """Remove the directories vramctl made (deepest first) that are still empty: a failed dump leaves none."""
    for d in created:
        try:
            os.rmdir(d)
        except OSError:
            return  # not empty (or no longer ours to remove): it and its parents stay


def open_procmem(pid: int, flags: int) -> int:
    try:
        return os.open(f"/proc/{pid}/mem", flags | os.O_CLOEXEC)
    except OSError as e:
        raise Failure(f"cannot open /proc/{pid}/mem: {e.strerror}") from None


def open_parents(image_dir: str, manifest: pb.Manifest, first: str | None) -> tuple[list[str], list[int]]:
    """The directories of an image's parents, nearest first, and an fd of each (the caller closes them).

    The first is `first` (--parent) or where the image recorded it, relative to itself; each next one is
    where the one before recorded its own parent.  vramctl opens them (the daemon opens no path); the
    daemon then checks each is the very image the chain names (image id and manifest hash)."""
    paths: list[str] = []
    fds: list[int] = []
    here, m = image_dir, manifest
    try:
        for k, ref in enumerate(manifest.parents, 1):
            rel = m.parents[0].relative_path if m.parents else ""
            if k == 1 and first:
                path = first
            elif rel and not os.path.isabs(rel):
                path = os.path.normpath(os.path.join(here, rel))
            else:
                raise Failure(f"{image_dir} is incremental and its parent #{k} was not recorded where vramctl can "
                              "find it; name the parent with --parent DIR")
            try:
                fd = open_image_dir(path, create=False)
            except Failure as e:
                raise Failure(f"{e}; {image_dir} is incremental: name its parent #{k} with --parent DIR") from None
            fds.append(fd)
            try:
                m = read_manifest_offline(fd)
            except VramdError as e:
                raise Failure(f"{path} (parent #{k} of {image_dir}): {e.message}") from None
            if m.image_id != ref.image_id:
                raise Failure(f"{path} holds another image than parent #{k} of {image_dir}; name the parent with "
                              "--parent DIR")
            paths.append(path)
            here = path
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
    return paths, fds


class ImageAndParents:
    """`with ImageAndParents(dir, parent) as (dir_fd, parent_fds)`: an image directory and its parents'
    (open_parents), all closed on the way out."""

    def __init__(self, path: str, first_parent: str | None) -> None:
        self.path, self.first_parent = path, first_parent
        self.fds: list[int] = []

    def __enter__(self) -> tuple[int, list[int]]:
        dfd = open_image_dir(self.path, create=False)
        self.fds.append(dfd)
        try:
            _paths, parent_fds = open_parents(self.path, read_manifest_offline(dfd, self.path), self.first_parent)
        except BaseException:
            os.close(dfd)
            raise
        self.fds += parent_fds
        return dfd, parent_fds

    def __exit__(self, *exc: object) -> None:
        for fd in self.fds:
            os.close(fd)


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
        if not ns.force and _holds_image(dfd):
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


def _holds_image(dfd: int) -> bool:
    from ..image.format import MANIFEST_NAME
    try:
        os.stat(MANIFEST_NAME, dir_fd=dfd, follow_symlinks=False)
    except FileNotFoundError:
        return False
    return True


def read_manifest_offline(dfd: int, where: str = "the image directory") -> pb.Manifest:
    """The committed manifest of the image in `dfd`, read by this process (its own rights)."""
    from ..image.fileio import read_manifest_now
    from ..imagedir import open_manifest
    fd = open_manifest(dfd, where)
    try:
        return read_manifest_now(fd)
    finally:
        os.close(fd)


def cmd_restore(ns: argparse.Namespace) -> int:
    fds: list[int] = []
    bos: list[ClientBo] = []
    try:
        dfd = open_image_dir(ns.image, create=False)
        fds.append(dfd)
        manifest = read_manifest_offline(dfd, ns.image)
        targets = dict(ns.bo_file or [])
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
        if targets:
            raise Failure(f"the image has no file BO {min(targets)} (--bo-file {min(targets)}=...)")
        _paths, parent_fds = open_parents(ns.image, manifest, ns.parent)
        fds += parent_fds
        # CRIU's KFD_*_CHECK switches travel with the request (the daemon never reads its own environment)
        info, secs = transfer(ns, SESSION_RESTORE, dfd, bos, "restore", topology_checks=topology_checks_from_env(),
                              parent_fds=parent_fds, where=ns.image)
    finally:
        for fd in fds:
            os.close(fd)
    d = session_dict(info)
    total = info.progress.bytes_total
    d.update(ok=True, seconds=round(secs, 6), image_dir=os.path.abspath(ns.image))
    emit(ns, d, f"restored {len(bos)} BO(s), {format_size(total)} in {secs:.2f} s ({rate(total, secs)}) "
                f"from {ns.image}")
    return EXIT_OK


def cmd_verify(ns: argparse.Namespace) -> int:
    import uvloop

    from ..engine import Engine
    from ..inproc import VerifyReport, verify
    with ImageAndParents(ns.dir, ns.parent) as (dfd, parent_fds):
        async def go() -> VerifyReport:
            async with Engine() as eng:
                return await verify(eng, dfd, parent_fds=parent_fds, where=ns.dir)
        t0 = time.monotonic()
        report = uvloop.run(go())
        secs = time.monotonic() - t0
    p = report.progress
    emit(ns, {"ok": True, "bos": p.bos_done, "bytes": p.bytes_done, "chunks": p.chunks_done, "seconds": round(secs, 6)},
         f"{ns.dir}: OK, {p.bos_done} BO(s), {format_size(p.bytes_done)} in {p.chunks_done} chunk(s) verified "
         f"({rate(p.bytes_done, secs)})")
    return EXIT_OK


def bo_files(m: pb.Manifest, bo: pb.BoEntry) -> dict[str, Any]:
    """The image's own data files that hold `bo`'s records, by name, in the manifest's order: `files`, and
    `file` (the first of them; a v1 or v2 image keeps a BO's records in one file).  A BO whose every
    chunk is a hole or its parent's has none."""
    held = {loc[0] for i in range(chunk_count(bo.size, m.chunk_size)) if (loc := chunk_record(m, bo, i)) is not None}
    names = [m.files[k].name for k in sorted(held)]  # indices checked when the manifest was read
    return {"files": names, "file": names[0] if names else None}


def cmd_inspect(ns: argparse.Namespace) -> int:
    dfd = open_image_dir(ns.dir, create=False)
    try:
        m = read_manifest_offline(dfd, ns.dir)
    finally:
        os.close(dfd)
    comp = compression_name(m.compression)
    nchunks = chunk_count
    bos = [{"id": e.id, "gpu_id": e.gpu_id, "size": e.size, "source": SOURCE_NAMES.get(e.source, "unknown"),
            "source_offset": e.source_offset, "va_addr": e.va_addr, "alloc_flags": e.alloc_flags, "name": e.name,
            "chunks": nchunks(e.size, m.chunk_size), "stored_bytes": e.stored_bytes, "zero_bytes": e.zero_bytes,
            "deduplicated_bytes": e.dedup_bytes, "referenced_bytes": e.parent_bytes, "delta_bytes": e.delta_bytes,
            **bo_files(m, e)} for e in m.bos]
    t = m.totals
    parents = [{"image_id": p.image_id.hex(), "recorded_at": p.relative_path} for p in m.parents]
    data = {"format_version": m.format_version, "image_id": m.image_id.hex(), "chunk_size": m.chunk_size,
            "compression": comp, "parents": parents,
            "files": [{"name": f.name, "length": f.length, "gpu_id": f.gpu_id} for f in m.files],
            "totals": {"bo_count": t.bo_count, "bo_bytes": t.bo_bytes, "stored_bytes": t.stored_bytes,
                       "zero_bytes": t.zero_bytes, "chunk_count": t.chunk_count, "record_count": t.record_count,
                       "deduplicated_bytes": t.dedup_bytes, "referenced_bytes": t.parent_bytes,
                       "delta_bytes": t.delta_bytes,
                       "file_bytes": sum(f.length for f in m.files)}, "bos": bos}
    lines = [f"{ns.dir}: image format v{m.format_version}, chunk {format_size(m.chunk_size)}, compression {comp}",
             f"{t.bo_count} BO(s), {format_size(t.bo_bytes)}; stored {format_size(t.stored_bytes)} "
             f"({format_size(t.zero_bytes)} zero) in {t.chunk_count} chunk(s), {len(m.files)} data file(s)"]
    if m.format_version >= 2:
        lines.append(f"deduplicated {format_size(t.dedup_bytes)}, referenced from parents "
                     f"{format_size(t.parent_bytes)}, stored as deltas {format_size(t.delta_bytes)}; "
                     f"{t.record_count} record(s)")
    for k, p in enumerate(m.parents, 1):
        lines.append(f"parent #{k}: image {p.image_id.hex()[:16]}, recorded at {p.relative_path or '(not recorded)'}")
    lines.append(f"{'id':>8} {'gpu':>6} {'size':>12} {'source':>8} {'offset':>18}  name")
    lines += [f"{b['id']:>8} {b['gpu_id']:>6x} {b['size']:>12} {b['source']:>8} {b['source_offset']:>#18x}  {b['name']}"
              for b in bos]
    emit(ns, data, "\n".join(lines))
    return EXIT_OK


def cmd_status(ns: argparse.Namespace) -> int:
    with connect(ns) as c:
        st = c.status()
    backends = [{"name": b.name, "available": b.available, "can_read": b.can_read, "can_write": b.can_write,
                 "asynchronous_dma": b.asynchronous_dma, "reason": b.reason} for b in st.backends]
    data = {"server": st.server, "protocol_version": st.version, "uptime_s": round(st.uptime_s, 3),
            "connections": st.connections, "sessions": st.sessions, "staging_budget": st.staging_budget,
            "staging_in_use": st.staging_in_use, "draining": st.draining, "backends": backends,
            "socket": c.path, "metrics": st.metrics}
    text = [f"{st.server} on {c.path}: up {st.uptime_s:.0f} s{', draining' if st.draining else ''}",
            f"{st.connections} connection(s), {st.sessions} session(s); staging {format_size(st.staging_in_use)} "
            f"in use of {format_size(st.staging_budget)}",
            "backends: " + ", ".join(b.name + ("" if b.available else f" (unavailable: {b.reason})")
                                     for b in st.backends),
            "metrics:"]
    text += ["  " + line for line in st.metrics.splitlines() if line and not line.startswith("#")]
    emit(ns, data, "\n".join(text))
    return EXIT_OK


def format_age(seconds: float) -> str:
    s = int(seconds)
    if s < 60:
        return f"{seconds:.1f}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s // 60 % 60:02d}m"


def sessions_table(rows: list[dict[str, Any]]) -> list[str]:
    """The admin view: every column an operator needs to decide what to cancel."""
    head = (f"{'id':>6} {'uid':>6} {'pid':>8} {'target':>8} {'kind':>7} {'state':>10} {'bytes done/total':>21} "
            f"{'rate':>11} {'age':>7}  label / error")
    lines = [head]
    for r in rows:
        p = r["progress"]
        targets = ",".join(map(str, r["target_pids"])) or "-"
        err = r.get("error")
        note = r["label"] + (f"  {err['code']}: {err['message']}" if err else "")
        lines.append(f"{r['session_id']:>6} {r['uid']:>6} {r['pid']:>8} {targets:>8} {r['kind']:>7} "
                     f"{r['state']:>10} {format_size(p['bytes_done']):>10}/{format_size(p['bytes_total']):<10} "
                     f"{gbps(r['rate_bytes_per_s']):>11} {format_age(r['age_s']):>7}  {note}")
    return lines


def cmd_sessions(ns: argparse.Namespace) -> int:
    with connect(ns) as c:
        infos = c.sessions()  # root and the daemon's uid get every uid's; others their own
    if not ns.all:
        infos = [i for i in infos if i.uid == os.getuid()]
    rows = [session_dict(i) for i in infos]
    if ns.all:
        text = sessions_table(rows)
    else:
        text = [f"{'id':>6} {'kind':>8} {'state':>10} {'uid':>6} {'pid':>8} {'bos':>13} {'bytes':>21}  label"]
        for r in rows:
            p = r["progress"]
            text.append(f"{r['session_id']:>6} {r['kind']:>8} {r['state']:>10} {r['uid']:>6} {r['pid']:>8} "
                        f"{p['bos_done']:>6}/{p['bos_total']:<6} {format_size(p['bytes_done']):>10}/"
                        f"{format_size(p['bytes_total']):<10}  {r['label']}")
    emit(ns, {"sessions": rows}, "\n".join(text) if rows else "no sessions")
    return EXIT_OK


_TOKEN = re.compile(r"[0-9a-f]{32}")


def parse_session_ref(text: str) -> tuple[str, int | None]:
    """TOKEN (32 hex characters) or a session ID (a number): (token, None) or ("", id)."""
    text = text.strip()
    if _TOKEN.fullmatch(text.lower()):
        return text.lower(), None
    if text.isdigit():
        return "", int(text)
    raise argparse.ArgumentTypeError(f"{text!r}: expected a session token (32 hex characters) or a session id")


def cmd_cancel(ns: argparse.Namespace) -> int:
    token, sid = ns.session
    with connect(ns) as c:
        if sid is None:
            info = c.cancel(token, ns.reason or "")
        else:
            info = c.cancel_by_id(sid, ns.reason or "")
    d = session_dict(info)
    d.update(ok=True)
    # the state after the cancel: cancelling (its copies stopping), or the end it had reached already
    emit(ns, d, f"session {info.session_id} (uid {info.uid}, pid {info.pid}): cancel requested; it is now "
                f"{d['state']}")
    return EXIT_OK


def cmd_selftest(ns: argparse.Namespace) -> int:
    from .selftest import format_rows, run_selftest
    with connect(ns, "vramctl selftest") as c:
        work = tempfile.mkdtemp(prefix="vramd-selftest-", dir=ns.workdir)
        try:
            rows, notes = run_selftest(c, ns.size, work)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    ok = bool(rows) and all(r.ok for r in rows)
    data = {"ok": ok, "notes": notes, "rows": [
        {"gpu_id": r.gpu_id, "backend": r.backend, "direction": r.direction, "bytes": r.nbytes,
         "seconds": round(r.seconds, 6), "gb_per_s": round(r.gbps, 3), "ok": r.ok, "note": r.note} for r in rows]}
    emit(ns, data, "\n".join([format_rows(rows), *notes]))
    if not ok:
        raise Failure("selftest failed: " + ("a round trip did not match" if rows else "nothing could be tested"))
    return EXIT_OK


PARENT_HELP = ("an incremental image's parent directory, where it is not where the image recorded it (its own "
               "parents are then found where it recorded them)")


def cmd_rm(ns: argparse.Namespace) -> int:
    """Remove an image: refused while incremental images are marked as needing it (stale marks, whose child
    is gone or holds another image, do not count: they go too, and rm says so).  Only vramd's own files go,
    regular files only: the manifest first (from then on the directory holds no image), then its data files
    and temporaries, then, for an incremental image, its marks in its parents (last: where a step fails, a
    mark stays and keeps protecting a parent, never the other way round), then the directory if nothing else
    is left in it.  A mark in a parent goes only where its content names this very directory and image: the
    path an image records is read, never trusted to say what to delete.  All under the directory's lock, as
    a dump holds it: refused while a dump writes into the directory or a child dump reads this image as its
    parent (it holds the lock shared from its start to its end), and a child dump started while rm runs is
    refused."""
    from ..image.format import LOCK_NAME, MANIFEST_NAME, child_mark_name, is_data_file_name, is_own_temporary
    from ..imagedir import lock_directory, mark_names, read_mark, remove_stale_marks, unlink_regular
    dfd = open_image_dir(ns.dir, create=False)
    fds = [dfd]
    lock = None
    notes: list[str] = []
    try:
        lock = lock_directory(dfd, ns.dir)
        m = read_manifest_offline(dfd, ns.dir)
        stale, live = remove_stale_marks(dfd)
        if live:
            raise Failure(f"{ns.dir} is the parent of {len(live)} incremental image(s) ({live[0][0]}: "
                          f"{live[0][1]}...): remove or flatten them first")
        if stale:
            notes.append(f"ignored and removed {len(stale)} stale mark(s): {'; '.join(stale)}")
        parent_fds: list[int] = []
        if m.parents:
            try:
                _paths, parent_fds = open_parents(ns.dir, m, ns.parent)
            except Failure as e:
                raise Failure(f"{e} (vramctl rm unmarks the image in its parents)") from None
            fds += parent_fds
        here = os.fstat(dfd)
        os.unlink(MANIFEST_NAME, dir_fd=dfd)
        for name in os.listdir(dfd):
            if is_data_file_name(name) or is_own_temporary(name):
                unlink_regular(dfd, name)
        mark = child_mark_name(m.image_id)
        for k, fd in enumerate(parent_fds, 1):
            if mark_names(fd, mark, here, m.image_id):
                unlink_regular(fd, mark)
            elif os.path.lexists(f"/proc/self/fd/{fd}/{mark}"):
                why = (f"it names another directory than {ns.dir}" if read_mark(fd, mark) else
                       "it names no child (an older vramd's, or not vramd's): remove it by hand if no child needs "
                       "that parent")
                notes.append(f"kept {mark} in parent #{k}: {why}")
        left = [n for n in os.listdir(dfd) if n != LOCK_NAME]
    finally:
        if lock is not None:
            lock.release()
        for fd in fds:
            os.close(fd)
    if not left:
        os.rmdir(ns.dir)
    emit(ns, {"ok": True, "removed": os.path.abspath(ns.dir), "directory_kept": bool(left), "notes": notes},
         f"removed the image in {ns.dir}" + (f" (kept the directory: {len(left)} other file(s))" if left else "") +
         "".join(f"\n  {n}" for n in notes))
    return EXIT_OK


def cmd_gc(ns: argparse.Namespace) -> int:
    """Remove what interrupted dumps left in an image directory (as the next dump into it would), and its
    stale marks (their child is gone or holds another image)."""
    from ..imagedir import lock_directory, remove_stale_marks, sweep_temporaries
    dfd = open_image_dir(ns.dir, create=False)
    try:
        lock = lock_directory(dfd, ns.dir)  # a dump under way holds it: its temporaries are not garbage
        try:
            removed = sweep_temporaries(dfd)
            stale, _live = remove_stale_marks(dfd)
        finally:
            lock.release()
    finally:
        os.close(dfd)
    emit(ns, {"ok": True, "removed": removed, "stale_marks": stale},
         f"{ns.dir}: removed {len(removed)} temporary file(s) of interrupted dumps" +
         "".join(f"\n  {n}" for n in removed) +
         (f"\n{ns.dir}: removed {len(stale)} stale mark(s)" + "".join(f"\n  {n}" for n in stale) if stale else ""))
    return EXIT_OK


def cmd_flatten(ns: argparse.Namespace) -> int:
    import uvloop

    from ..imagedir.flatten import flatten
    with ImageAndParents(ns.dir, ns.parent) as (dfd, parent_fds):
        out = open_image_dir(ns.out, create=True)
        try:
            if _holds_image(out):
                raise Failure(f"{ns.out} already holds an image; flatten into a new directory")
            t0 = time.monotonic()
            m = uvloop.run(flatten(dfd, parent_fds, out))
            secs = time.monotonic() - t0
        finally:
            os.close(out)
    t = m.totals
    emit(ns, {"ok": True, "image_id": m.image_id.hex(), "stored_bytes": t.stored_bytes, "records": t.record_count,
              "seconds": round(secs, 6)},
         f"{ns.out}: self-contained copy of {ns.dir}, {t.bo_count} BO(s), stored {format_size(t.stored_bytes)} in "
         f"{t.record_count} record(s) ({secs:.2f} s)")
    return EXIT_OK


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="vramctl", description="Control the vramd VRAM checkpoint daemon.",
                                 epilog="exit codes: 0 success, 1 failure (reason on stderr), 2 usage error")
    ap.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    socket_help = ("daemon socket (default: $VRAMD_SOCKET, else /run/vramd/vramd.sock if it exists, else your own "
                   "daemon's; used only if its directories and its listener belong to root, you or the daemon user)")
    user_help = ("the daemon user trusted besides root and you, a name or a uid (default: $VRAMD_DAEMON_USER, "
                 "else vramd)")
    ap.add_argument("--socket", help=socket_help)
    ap.add_argument("--daemon-user", metavar="USER", help=user_help)
    sub = ap.add_subparsers(dest="command", required=True)

    def cmd(name: str, fn: Any, help_text: str, *, daemon: bool = True) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help_text)
        p.add_argument("--json", action="store_true", help="print one JSON document")
        if daemon:  # also after the command; SUPPRESS keeps a --socket given before it
            p.add_argument("--socket", default=argparse.SUPPRESS, help=socket_help)
            p.add_argument("--daemon-user", metavar="USER", default=argparse.SUPPRESS, help=user_help)
        p.set_defaults(fn=fn)
        return p

    cmd("status", cmd_status, "daemon status and metrics (of the whole daemon for root and the daemon's uid; "
        "any other uid: its own connections and sessions)")
    p = cmd("sessions", cmd_sessions, "sessions the daemon holds")
    p.add_argument("--all", action="store_true",
                   help="every session the daemon shows you (root and the daemon's uid: every uid's) with uid, "
                        "client and target pids, rate (GB/s), age and error; default: your uid's")
    p = cmd("cancel", cmd_cancel, "cancel a session: by its token (its holders) or by its id (root and the "
            "daemon's uid); it shows as cancelling until its copies have stopped, then cancelled")
    p.add_argument("session", type=parse_session_ref, metavar="TOKEN|ID")
    p.add_argument("--reason", help="recorded as the session's error message")
    p = cmd("dump", cmd_dump, "dump memory ranges of a process and/or files into an image")
    p.add_argument("--pid", type=int, help="the process of the --range addresses (needed with --range)")
    p.add_argument("--range", type=parse_range, action="append", metavar="ADDR:LEN",
                   help="address range in PID (hex or sizes with K/M/G), repeatable")
    p.add_argument("--bo-file", type=parse_bo_file, action="append", metavar="PATH[:OFF:LEN]",
                   help="a file (memfd, dmabuf, regular file) holding a BO, repeatable")
    p.add_argument("--image", required=True, metavar="DIR")
    p.add_argument("--compress", metavar="none|zstd|bplanes|auto[:LEVEL]",
                   help="default: the daemon's (auto: compressed only where that makes the dump faster)")
    p.add_argument("--force", action="store_true", help="replace an image the directory already holds")
    p.add_argument("--parent", metavar="DIR",
                   help="an incremental image: chunks DIR's image (and its parents) holds are referred to")
    p.add_argument("--no-dedup", action="store_true", help="store every chunk, even one the image holds already")
    p.add_argument("--replace-parent", action="store_true",
                   help="with --force: replace an image even though incremental images need it (they break)")
    p = cmd("restore", cmd_restore, "write an image back: ranges into PID at their addresses, file BOs into the files "
            "you name")
    p.add_argument("--pid", type=int, required=True)
    p.add_argument("--image", required=True, metavar="DIR")
    p.add_argument("--bo-file", type=parse_bo_target, action="append", metavar="ID=PATH",
                   help="write the image's file BO ID into PATH, repeatable (the image's recorded paths are never "
                        "opened unless --to-recorded-paths)")
    p.add_argument("--to-recorded-paths", action="store_true",
                   help="write file BOs to the paths the image recorded (only for images you trust)")
    p.add_argument("--parent", metavar="DIR", help=PARENT_HELP)
    p = cmd("verify", cmd_verify, "check every chunk of an image (offline); exit 1 on any damage", daemon=False)
    p.add_argument("dir", metavar="DIR")
    p.add_argument("--parent", metavar="DIR", help=PARENT_HELP)
    p = cmd("rm", cmd_rm, "remove an image: an incremental one also unmarks itself in its parents (offline); "
            "an image incremental images need is kept", daemon=False)
    p.add_argument("dir", metavar="DIR")
    p.add_argument("--parent", metavar="DIR", help=PARENT_HELP)
    p = cmd("gc", cmd_gc, "remove what interrupted dumps left in an image directory, and its stale marks (their "
            "child is gone or holds another image; offline; refused while a dump writes into it)", daemon=False)
    p.add_argument("dir", metavar="DIR")
    p = cmd("flatten", cmd_flatten, "copy an image into a self-contained one: no parents needed (offline)",
            daemon=False)
    p.add_argument("dir", metavar="DIR")
    p.add_argument("out", metavar="OUT", help="an empty or new directory for the self-contained copy")
    p.add_argument("--parent", metavar="DIR", help=PARENT_HELP)
    p = cmd("selftest", cmd_selftest, "round-trip known data through every backend, per GPU; GB/s")
    p.add_argument("--size", type=parse_size, default=64 << 20, help="bytes per BO (default 64M)")
    p.add_argument("--workdir", default="/var/tmp", help="where the temporary images go")
    p = cmd("inspect", cmd_inspect, "describe an image (offline)", daemon=False)
    p.add_argument("dir", metavar="DIR")
    return ap


def stdout_closed() -> bool:
    """Whether stdout is a pipe nobody reads any more (poll reports an error on its write end)."""
    try:
        p = select.poll()
        p.register(sys.stdout.fileno(), select.POLLOUT)
        return any(ev & select.POLLERR for _fd, ev in p.poll(0))
    except (OSError, ValueError):
        return False


def quiet_broken_pipe() -> int:
    """stdout's reader went away (`vramctl ... | head`): no traceback, no message; 141 as for SIGPIPE.
    stdout now points at /dev/null, so the interpreter's last flush cannot fail again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):
        pass
    return EXIT_PIPE


def main(argv: list[str] | None = None) -> int:
    try:
        return _main(argv)
    except BrokenPipeError:  # the output, the --help text or the error report met a closed pipe
        return quiet_broken_pipe()


def _main(argv: list[str] | None) -> int:
    parser = build_parser()
    ns = parser.parse_args(argv)  # exits 2 on usage errors
    if ns.command == "dump" and ns.range and ns.pid is None:
        parser.error("dump: --range needs --pid (the process the addresses are in)")
    try:
        rc: int = ns.fn(ns)
        sys.stdout.flush()  # a closed pipe shows here, not in the interpreter's exit
        return rc
    except (Failure, VramdError, OSError) as e:
        if isinstance(e, BrokenPipeError) and stdout_closed():
            raise  # not a failure to report: main ends quietly (a daemon that hung up is reported)
        err: dict[str, Any]
        if isinstance(e, VramdError):
            reason, err = f"{e.code}: {e.describe()}", e.to_dict()
        else:
            reason, err = str(e), {"code": "FAILURE", "message": str(e)}
        if getattr(ns, "json", False):
            print(json.dumps({"ok": False, "error": err}, indent=2, sort_keys=True))
        print(f"vramctl: {reason}", file=sys.stderr)
        return EXIT_FAILURE
    except KeyboardInterrupt:
        print("vramctl: interrupted", file=sys.stderr)
        return EXIT_FAILURE


if __name__ == "__main__":
    sys.exit(main())
