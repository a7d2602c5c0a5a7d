"""The offline image commands (no daemon): verify, inspect, rm, gc, flatten."""
from __future__ import annotations

import argparse
import os
import stat
import time
from typing import Any

from ..image.codec import compression_name
from ..image.format import chunk_count
from ..image.manifest import chunk_record
from ..pb import image_pb2 as pb
from ..units import format_size
from .common import EXIT_OK, SOURCE_NAMES, Failure, emit, rate
from .imagedir import (
    ImageAndParents,
    holds_image,
    open_image_dir,
    open_parents,
    read_manifest_offline,
    remove_created,
)


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


def child_dir(dfd: int, parent: str, mark: str) -> str:
    """The directory of the child image the mark `mark` in `parent` names, as the user can find it: the path
    the mark records that leads to a directory (the absolute one first); the mark's own name where it names
    none (an older vramd's mark)."""
    from ..imagedir import read_mark
    got = read_mark(dfd, mark)
    if got is None:
        return f"{mark} (a mark that names no directory)"
    paths = sorted((os.fsdecode(p) for p in got[1]), key=lambda p: not os.path.isabs(p))
    shown = [p if os.path.isabs(p) else os.path.normpath(os.path.join(parent, p)) for p in paths]
    return next((p for p in shown if os.path.isdir(p)), shown[0])


def cmd_rm(ns: argparse.Namespace) -> int:
    """Remove an image: refused while incremental images are marked as needing it (stale marks, whose child
    is gone or holds another image, do not count: they go too, and rm says so).  Only vramd's own files go,
    regular files only: the manifest first (from then on the directory holds no image), then its data files
    and temporaries, then, for an incremental image, its marks in its parents (last: where a step fails, a
    mark stays and keeps protecting a parent, never the other way round), then the link to its parent where
    it recorded one at a plain name (_unlink_parent_link), then the directory if nothing else is left in it.
    A mark in a parent goes only where its content names this very directory and image: the
    path an image records is read, never trusted to say what to delete.  All under the directory's lock, as
    a dump holds it: refused while a dump writes into the directory or a child dump reads this image as its
    parent (it holds the lock shared from its start to its end), and a child dump started while rm runs is
    refused."""
    from ..image.names import LOCK_NAME, MANIFEST_NAME, child_mark_name, is_data_file_name, is_own_temporary
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
            children = [child_dir(dfd, ns.dir, name) for name, _why in live]
            raise Failure(f"{ns.dir} is the parent of {len(live)} incremental image(s): {', '.join(children)}: "
                          "remove or flatten them first")
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
        _unlink_serve_socket(dfd)
        mark = child_mark_name(m.image_id)
        for k, fd in enumerate(parent_fds, 1):
            if mark_names(fd, mark, here, m.image_id):
                unlink_regular(fd, mark)
            elif os.path.lexists(f"/proc/self/fd/{fd}/{mark}"):
                why = (f"it names another directory than {ns.dir}" if read_mark(fd, mark) else
                       "it names no child (an older vramd's, or not vramd's): remove it by hand if no child needs "
                       "that parent")
                notes.append(f"kept {mark} in parent #{k}: {why}")
        _unlink_parent_link(dfd, m.parents[0].relative_path if m.parents else "")
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


def _unlink_serve_socket(dfd: int) -> None:
    """The socket a `vramctl pull --serve` killed outright left (its image is being removed: nothing will be
    served from it; was: kept, so the directory stayed and a pull into it was refused as not empty)."""
    from ..image.names import SERVE_SOCKET_NAME
    from ..imagedir.marks import unlink_kind
    try:
        unlink_kind(dfd, SERVE_SOCKET_NAME, stat.S_ISSOCK)
    except FileNotFoundError:
        pass


def _unlink_parent_link(dfd: int, name: str) -> None:
    """The link an image may hold to its parent (CRIU's amdgpu plugin records its parent as `parent`, a symlink
    in the image's own directory; vramctl pull makes it too): removed where the recorded name is a plain name
    and a symbolic link there (lstat, then unlinkat of the name: the link, never what it points to)."""
    if not name or "/" in name or name.startswith("."):
        return
    from ..imagedir.marks import unlink_kind
    try:
        unlink_kind(dfd, name, stat.S_ISLNK)
    except FileNotFoundError:
        pass


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
    created: list[str] = []  # the directories made for OUT: removed again (if still empty) when flatten fails
    with ImageAndParents(ns.dir, ns.parent) as (dfd, parent_fds):
        out = open_image_dir(ns.out, create=True, created=created)
        try:
            if holds_image(out):
                raise Failure(f"{ns.out} already holds an image; flatten into a new directory")
            t0 = time.monotonic()
            m = uvloop.run(flatten(dfd, parent_fds, out))
            secs = time.monotonic() - t0
        except BaseException:
            os.close(out)
            remove_created(created)
            raise
        os.close(out)
    t = m.totals
    emit(ns, {"ok": True, "image_id": m.image_id.hex(), "stored_bytes": t.stored_bytes, "records": t.record_count,
              "seconds": round(secs, 6)},
         f"{ns.out}: self-contained copy of {ns.dir}, {t.bo_count} BO(s), stored {format_size(t.stored_bytes)} in "
         f"{t.record_count} record(s) ({secs:.2f} s)")
    return EXIT_OK
