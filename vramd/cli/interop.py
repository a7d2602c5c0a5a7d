"""`vramctl import-criu` and `vramctl export-criu`: checkpoints made by CRIU's stock amdgpu plugin, in and out.

import-criu turns the BO contents of a stock checkpoint directory (its pages files, laid out by its
amdgpu-kfd-*.img and amdgpu-renderD-*.img) into a vramd image: a dump session whose BOs are ranges of the
pages files, so the contents go through the engine like any dump (checksummed, deduplicated, compressed by
the policy), a chunk at a time.  export-criu writes the pages files back from a vramd image into a stock
checkpoint directory that holds the metadata files (a copy of the original dump directory: the metadata,
KFD's private data above all, cannot be made from a vramd image), so the stock plugin restores it.  Both
run through the daemon, or in this process with --offline; vramctl opens every file, the engine gets fds.
"""
from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from ..client import SESSION_DUMP, SESSION_RESTORE, ClientBo, topology_checks_from_env
from ..criuimage import BO_NAME, HEADER, VRAMD_DIR, StockBo, StockLayout, check_pages_file, layout, open_plain
from ..errors import ImageError
from ..pb import image_pb2 as pb
from ..units import format_size
from .common import EXIT_OK, Failure, connect, emit, rate, session_dict
from .imagedir import holds_image, open_image_dir, open_parents, read_manifest_offline, remove_created
from .transfer import transfer


@contextmanager
def checkpoint_dir(path: str, kfd: int | None = None) -> Iterator[tuple[int, StockLayout]]:
    """The stock checkpoint directory (an fd) and what its metadata files describe (with `kfd`: only the
    pages files of amdgpu-kfd-<kfd>.img)."""
    try:
        dfd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as e:
        raise Failure(f"cannot open the checkpoint directory {path}: {e.strerror}") from None
    try:
        lay = layout(dfd, path)
        yield dfd, lay if kfd is None else lay.only_kfd(kfd, path)
    finally:
        os.close(dfd)


def gpu_lanes(ns: argparse.Namespace) -> Callable[[int], int]:
    """Which GPU (the engine's per-GPU pools and lanes) a BO of a stock GPU runs in: that GPU where the daemon
    has it (always --offline), else the daemon's default GPU (0, or its lowest)."""
    if ns.offline:
        return lambda g: g
    with connect(ns) as c:
        allowed = frozenset(c.hello.allowed_gpu_ids)
    fallback = 0 if 0 in allowed or not allowed else min(allowed)
    return lambda g: g if g in allowed else fallback


def run_offline(kind: str, dfd: int, bos: list[ClientBo], **kw: Any) -> dict[str, Any]:
    """The session in this process (vramd.inproc: the daemon's session path, no daemon): its summary."""
    import uvloop

    from ..backends import BoRef
    from ..engine import BoSpec, Engine, RestoreTarget
    from ..inproc import dump, restore

    async def go() -> dict[str, Any]:
        async with Engine() as eng:
            if kind == "dump":
                specs = [BoSpec(b.id, b.size, BoRef(b.backend, b.fd, b.offset), b.gpu_id or 0, b.alloc_flags,
                                b.va_addr, b.name) for b in bos]
                m = await dump(eng, dfd, specs, **kw)
                t = m.totals
                return {"bytes": t.bo_bytes, "image": {"bo_count": t.bo_count, "bo_bytes": t.bo_bytes,
                                                       "stored_bytes": t.stored_bytes}}
            p = await restore(eng, dfd, [RestoreTarget(b.id, BoRef(b.backend, b.fd, b.offset), b.gpu_id)
                                         for b in bos], **kw)
            return {"bytes": p.bytes_done}
    return uvloop.run(go())


def cmd_import_criu(ns: argparse.Namespace) -> int:
    fds: list[int] = []
    created: list[str] = []
    ok = False
    try:
        with checkpoint_dir(ns.criu_dir, ns.kfd) as (cdfd, lay):
            if not lay.bos:
                raise Failure(f"{ns.criu_dir}: its metadata lists no VRAM or GTT BO contents to import")
            lane = gpu_lanes(ns)
            bos: list[ClientBo] = []
            for pf in lay.files:
                fd = open_plain(cdfd, pf.name, ns.criu_dir)
                fds.append(fd)
                check_pages_file(fd, pf, ns.criu_dir)
                for b in pf.bos:  # ids: 1, 2, ... in the stock files' order; --kfd: the bucket index, as the plugin's
                    bos.append(ClientBo(b.index if ns.kfd is not None else len(bos) + 1, fd, offset=b.offset,
                                        size=b.size, backend="mmap", gpu_id=lane(b.gpu_id), alloc_flags=b.alloc_flags,
                                        va_addr=b.va_addr, name=b.name))
        dfd = open_image_dir(ns.image, create=True, created=created)
        fds.append(dfd)
        if not ns.force and holds_image(dfd):
            raise Failure(f"{ns.image} already holds an image; --force replaces it")
        t0 = time.monotonic()
        if ns.offline:
            d = run_offline("dump", dfd, bos, compression=ns.compress, where=ns.image)
        else:
            info, _ = transfer(ns, SESSION_DUMP, dfd, bos, "import", compression=ns.compress or "",
                               where=ns.image)
            d = session_dict(info)
            d["bytes"] = info.progress.bytes_total
        secs = time.monotonic() - t0
        ok = True
    finally:
        for fd in fds:
            os.close(fd)
        if not ok:
            remove_created(created)
    stored = d.get("image", {}).get("stored_bytes", 0)
    d.update(ok=True, seconds=round(secs, 6), image_dir=os.path.abspath(ns.image), metadata=lay.metadata,
             pages_files=[f.name for f in lay.files])
    emit(ns, d, f"imported {len(bos)} BO(s) from {len(lay.files)} pages file(s), {format_size(d['bytes'])} in "
                f"{secs:.2f} s ({rate(d['bytes'], secs)}) into {ns.image}; stored {format_size(stored)}")
    return EXIT_OK


def match_bos(manifest: pb.Manifest, lay: StockLayout, image: str, where: str,
              kfd: int | None) -> dict[str, pb.BoEntry]:
    """Each stock BO's entry in the vramd image: by the name import-criu recorded, or (an image of unnamed
    BOs, as the vramd plugin writes for amdgpu-kfd-<kfd>.img) by id = bucket index, with the VA and flags it
    recorded; refused where the two disagree (a BO missing on either side, another size, VA or flags)."""
    by_key: dict[str, pb.BoEntry] = {}
    by_index = kfd is not None and not any(e.name for e in manifest.bos)
    for e in manifest.bos:
        m = BO_NAME.fullmatch(e.name)
        if by_index:
            key = f"kfd-{kfd}:{e.id}"
        elif m is not None:
            key = m[1]
        else:
            raise ImageError(f"{image}: BO {e.id} ({e.name or 'no name'}) was not imported from a stock checkpoint; "
                             "export-criu writes BOs named criu-amdgpu:<entry>, or (--kfd ID) the unnamed BOs the "
                             "vramd plugin dumped for amdgpu-kfd-ID.img", bo_id=e.id)
        if key in by_key:
            raise ImageError(f"{image}: BOs {by_key[key].id} and {e.id} both claim {key}", bo_id=e.id)
        by_key[key] = e
    out = {}
    for b in lay.bos:
        if b.key not in by_key:
            raise ImageError(f"{image} has no BO for {where}/{b.file}'s {b.key} ({b.size} bytes)")
        e = by_key.pop(b.key)
        if e.size != b.size:
            raise ImageError(f"{image}: BO {e.id} ({b.key}) holds {e.size} bytes, {where}/{b.file} needs "
                             f"{b.size}", bo_id=e.id)
        if by_index:
            check_recorded(e, b, image, where)
        out[b.key] = e
    if by_key:
        key, e = min(by_key.items(), key=lambda kv: kv[1].id)
        raise ImageError(f"{image}: BO {e.id} ({key}) has no entry in {where}'s metadata files", bo_id=e.id)
    return out


def check_recorded(e: pb.BoEntry, b: StockBo, image: str, where: str) -> None:
    """An unnamed BO matched by its index: the VA and flags it recorded are the metadata's."""
    if (e.va_addr, e.alloc_flags) != (b.va_addr, b.alloc_flags):
        raise ImageError(f"{image}: BO {e.id} was dumped from VA {e.va_addr:#x} with flags {e.alloc_flags:#x}, "
                         f"{where}'s {b.key} is at {b.va_addr:#x} with {b.alloc_flags:#x}", bo_id=e.id)


def image_kfd(ns: argparse.Namespace) -> int | None:
    """--kfd, else the id in an image directory named as the vramd plugin names it (amdgpu-vramd-<id>)."""
    if ns.kfd is not None:
        return int(ns.kfd)
    m = VRAMD_DIR.fullmatch(os.path.basename(os.path.normpath(ns.image)))
    return int(m[1]) if m else None


def temp_name(name: str) -> str:
    return f".{name}.vramctl-{os.getpid()}.tmp"


def cmd_export_criu(ns: argparse.Namespace) -> int:
    fds: list[int] = []
    made: list[tuple[int, str]] = []  # temporaries created in the checkpoint directory: removed on failure
    ok = False
    try:
        idfd = open_image_dir(ns.image, create=False)
        fds.append(idfd)
        manifest = read_manifest_offline(idfd, ns.image)
        _paths, parent_fds = open_parents(ns.image, manifest, ns.parent)
        fds += parent_fds
        kfd = image_kfd(ns)
        with checkpoint_dir(ns.criu_dir, kfd) as (cdfd, lay):
            entries = match_bos(manifest, lay, ns.image, ns.criu_dir, kfd)
            cfd = os.dup(cdfd)
        fds.append(cfd)
        lane = gpu_lanes(ns)
        targets: list[ClientBo] = []
        files: list[tuple[int, str]] = []
        for pf in lay.files:
            tmp = temp_name(pf.name)
            try:
                fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600,
                             dir_fd=cfd)
            except OSError as e:
                raise Failure(f"cannot create {ns.criu_dir}/{tmp}: {e.strerror}") from None
            made.append((cfd, tmp))
            fds.append(fd)
            os.pwrite(fd, HEADER.pack(pf.total), 0)  # right in render-node pages files too
            os.ftruncate(fd, pf.length)              # holes read as zeros; the restore writes every BO byte
            files.append((fd, pf.name))
            for b in pf.bos:
                bo = entries[b.key]
                targets.append(ClientBo(bo.id, fd, offset=b.offset, backend="mmap",
                                        gpu_id=None if lane(bo.gpu_id) == bo.gpu_id else lane(bo.gpu_id)))
        t0 = time.monotonic()
        if ns.offline:
            d = run_offline("restore", idfd, targets, parent_fds=parent_fds, where=ns.image)
        else:
            info, _ = transfer(ns, SESSION_RESTORE, idfd, targets, "export", topology_checks=topology_checks_from_env(),
                               parent_fds=parent_fds, where=ns.image)
            d = session_dict(info)
            d["bytes"] = info.progress.bytes_total
        for fd, _name in files:
            os.fsync(fd)
        for (_fd, name), (_dir, tmp) in zip(files, made, strict=True):
            os.rename(tmp, name, src_dir_fd=cfd, dst_dir_fd=cfd)  # replaces a stale file (the plugin never truncates)
        made.clear()
        os.fsync(cfd)
        secs = time.monotonic() - t0
        ok = True
    finally:
        for dir_fd, tmp in made if not ok else ():
            try:
                os.unlink(tmp, dir_fd=dir_fd)
            except OSError:
                pass
        for fd in fds:
            os.close(fd)
    d.update(ok=True, seconds=round(secs, 6), criu_dir=os.path.abspath(ns.criu_dir),
             pages_files=[f.name for f in lay.files])
    emit(ns, d, f"exported {len(targets)} BO(s), {format_size(d['bytes'])} into {len(lay.files)} pages file(s) in "
                f"{ns.criu_dir} in {secs:.2f} s ({rate(d['bytes'], secs)})")
    return EXIT_OK
