#!/usr/bin/env python3
"""Image size and speed per codec on a realistic corpus (bench/corpus.py), side by side.

    python bench/image_size.py --cache /var/tmp/vramd-corpus --reps 3 --out results.json

Drives vramd's engine in-process, as bench/throughput.py does: every BO is a memfd
(the mmap backend), images go to /dev/shm (and --sink-dir too, when given), every
image is restored into fresh memfds and checked byte-exact (first repetition).

Codecs: none, zstd:1, zstd:3, bplanes, auto, and any given with --codec.  A codec
this build's `Compression.parse` does not know is a row saying "not available in this
build", never a stand-in.

Per codec and scenario: stored bytes (the committed manifest's totals, and the image
directory's real size on disk, st_blocks), the ratio of the raw non-zero bytes (bytes
in 4 KiB pages that are not all zeros) to the stored bytes, dump and restore GB/s (raw
BO bytes over wall time) and CPU s/GiB (getrusage of this process), medians of --reps,
the codecs interleaved within each repetition.  Outside references on the same bytes
(the single image's BOs, concatenated): `zstd -1`, `zstd -3` (-T1) and `lz4` (-1), size
and CPU s/GiB of the compressor (when the tool is installed).

Scenarios:
  single        one process's state (every group of the corpus)
  replicas      one image of 4 data-parallel replica processes' BOs (identical training
                state), each replica on its own gpu_id; compared with the same dump with
                dedup off where the engine has such an option, else with the none codec's
  inference, finetune, training
                the next state dumped with the base image as its parent (incremental);
                needs the engine's parent option, else "not available in this build"
  chain         base -> finetune -> finetune2 as a 3-deep chain: restore of the newest
                vs restore of the same state dumped whole (flattened), the two in alternating order;
                each through a fresh engine, then again through one engine kept for all the runs
                (as the daemon keeps its engine)
  bounds, bounds-xz
                (not run by default) how small the base state's bytes can get, per group: the
                order-0 entropy of each float field; bounds-xz adds `xz -9` on the non-zero
                pages split into byte planes (minutes: xz runs at ~1 MiB/s)

Targets (issue #10) are printed met / MISSED / n/a.
"""
from __future__ import annotations

import argparse
import inspect
import json
import mmap
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

import uvloop
import xxhash

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench/ is not a package
import corpus as corpus_mod

from vramd import inproc
from vramd.backends import BoRef
from vramd.engine import BoSpec, Engine, EngineConfig, RestoreTarget
from vramd.image.codec import Compression
from vramd.pb import image_pb2 as pb

CODECS = ("none", "zstd:1", "zstd:3", "bplanes", "auto")
INCREMENTAL = ("inference", "finetune", "training")
GiB = 1 << 30
CHUNK = 8 << 20


# --- what this build of the engine can do -------------------------------------------------

def parse_codec(name: str) -> Compression | None:
    """The engine's Compression for `name`, or None where this build does not know it."""
    try:
        return Compression.parse(name)
    except ValueError:
        return None


def _dump_options() -> set[str]:
    return set().union(*(inspect.signature(f).parameters for f in (Engine.start_dump, inproc.start_dump,
                                                                     inproc.dump)))


def engine_supports_parent() -> bool:
    """Incremental dumps: inproc.dump takes `parent_fds` (the parent's directory, then its parents')."""
    return "parent_fds" in _dump_options()


def engine_supports_dedup_switch() -> bool:
    """The engine's dedup can be turned off per dump (`dedup=False`)."""
    return "dedup" in _dump_options()


async def dump_image(engine: Engine, dir_fd: int, bos: list[BoSpec], compression: Compression, *,
                     parents: list[int] | None = None, dedup: bool | None = None) -> pb.Manifest:
    """The one call every dump of this bench goes through.  `parents`: the directory fds of
    the parent image and its own parents, nearest first (incremental dump); `dedup`: False for
    the no-dedup baseline.  Each is passed only when given."""
    kw: dict = {"compression": compression}
    if parents:
        kw["parent_fds"] = parents
    if dedup is not None:
        kw["dedup"] = dedup
    return await inproc.dump(engine, dir_fd, bos, **kw)


# --- BOs in memfds --------------------------------------------------------------------

@dataclass
class Bo:
    spec: BoSpec
    digest: int


class Loaded:
    """One state's BOs as memfds (`copies` replicas: each on its own gpu_id, ids apart)."""

    def __init__(self, c: corpus_mod.Corpus, state: str, infos: list[corpus_mod.BoInfo], copies: int = 1):
        self.bos: list[Bo] = []
        self.fds: list[int] = []
        self.nonzero = sum(b.nonzero[state] for b in infos) * copies
        for r in range(copies):
            for i, info in enumerate(infos):
                fd = os.memfd_create(f"bo-{info.name}")
                self.fds.append(fd)
                with open(c.path(state, info), "rb") as f:
                    data = f.read()
                os.pwrite(fd, data, 0)
                spec = BoSpec(r * 100_000 + i + 1, info.size, BoRef("mmap", fd, 0), gpu_id=r,
                              name=f"r{r}/{info.name}")
                self.bos.append(Bo(spec, xxhash.xxh3_64_intdigest(data)))
        self.size = sum(b.spec.size for b in self.bos)

    def specs(self) -> list[BoSpec]:
        return [b.spec for b in self.bos]

    def close(self) -> None:
        for fd in self.fds:
            os.close(fd)
        self.fds = []


def _fd_digest(fd: int, size: int) -> int:
    m = mmap.mmap(fd, size, prot=mmap.PROT_READ)
    try:
        return xxhash.xxh3_64_intdigest(m)
    finally:
        m.close()


# --- timing ------------------------------------------------------------------------------

def cpu_seconds(who: int = resource.RUSAGE_SELF) -> float:
    r = resource.getrusage(who)
    return r.ru_utime + r.ru_stime


def warm_memory(nbytes: int) -> None:
    """Populate and free `nbytes` of anonymous memory (see bench/throughput.py: first touch on a VM)."""
    for off in range(0, nbytes, GiB):
        mmap.mmap(-1, min(GiB, nbytes - off),
                  flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | mmap.MAP_POPULATE).close()


def du(path: str) -> int:
    """Bytes the directory's files really occupy (st_blocks)."""
    return sum(os.stat(os.path.join(path, n)).st_blocks * 512 for n in os.listdir(path))


def _clear(path: str) -> None:
    shutil.rmtree(path, ignore_errors=True)
    os.mkdir(path)


def _open_dir(path: str) -> int:
    return os.open(path, os.O_RDONLY | os.O_DIRECTORY)


def run_dump(loaded: Loaded, image: str, compression: Compression, parents: list[str] | None = None,
             dedup: bool | None = None) -> dict:
    """Dump `loaded` into the (emptied) directory `image`; wall, CPU and the stored sizes.
    `parents`: an incremental dump's parent directory, then its own parents'."""
    _clear(image)
    warm_memory(loaded.size + min(256 << 20, 2 * loaded.size))  # the image, and staging
    dfd = _open_dir(image)
    pfds = [_open_dir(p) for p in parents or []]

    async def go():
        async with Engine(EngineConfig(chunk_size=CHUNK)) as e:
            t = time.perf_counter()
            m = await dump_image(e, dfd, loaded.specs(), compression, parents=pfds, dedup=dedup)
            return time.perf_counter() - t, m
    try:
        c0 = cpu_seconds()
        wall, manifest = uvloop.run(go())
        cpu = cpu_seconds() - c0
    finally:
        os.close(dfd)
        for fd in pfds:
            os.close(fd)
    per_bo = {b.name: b.stored_bytes for b in manifest.bos}
    return {"wall": wall, "cpu": cpu, "stored": manifest.totals.stored_bytes, "on_disk": du(image),
            "zero": manifest.totals.zero_bytes, "per_bo": per_bo}


def flatten_image(image: str, parents: list[str], out: str) -> dict:
    """`vramctl flatten`'s work: the incremental `image` copied into a self-contained `out`."""
    from vramd.imagedir.flatten import flatten
    _clear(out)
    fds = [_open_dir(p) for p in [image, *parents, out]]
    try:
        c0, t = cpu_seconds(), time.perf_counter()
        m = uvloop.run(flatten(fds[0], fds[1:-1], fds[-1]))
        wall, cpu = time.perf_counter() - t, cpu_seconds() - c0
    finally:
        for fd in fds:
            os.close(fd)
    return {"wall": wall, "cpu": cpu, "stored": m.totals.stored_bytes, "on_disk": du(out),
            "zero": m.totals.zero_bytes, "per_bo": {b.name: b.stored_bytes for b in m.bos}}


class WarmEngine:
    """One engine and event loop kept across restores, as the daemon keeps its engine: its staging
    buffers and threads are made once, not in every timed run."""

    def __init__(self) -> None:
        self.loop = uvloop.new_event_loop()
        self.engine = Engine(EngineConfig(chunk_size=CHUNK))

    def close(self) -> None:
        self.engine.close()
        self.loop.close()


def run_restore(loaded: Loaded, image: str, check: bool, parents: list[str] | None = None,
                warm: WarmEngine | None = None) -> dict:
    """Restore the image into fresh memfds (pages allocated first, as VRAM is); check bytes if asked.
    `parents`: an incremental image's parent directories, nearest first.  `warm`: through that engine
    (else a fresh one, made and closed in the run)."""
    fds = []
    pfds = [_open_dir(p) for p in parents or []]
    try:
        targets = []
        for b in loaded.bos:
            fd = os.memfd_create("restore")
            fds.append(fd)
            os.posix_fallocate(fd, 0, b.spec.size)
            targets.append(RestoreTarget(b.spec.id, BoRef("mmap", fd, 0)))
        warm_memory(min(256 << 20, 2 * loaded.size))  # staging
        dfd = _open_dir(image)

        async def timed(e: Engine) -> float:
            t = time.perf_counter()
            await inproc.restore(e, dfd, targets, parent_fds=pfds)
            return time.perf_counter() - t

        async def fresh() -> float:
            async with Engine(EngineConfig(chunk_size=CHUNK)) as e:
                return await timed(e)
        try:
            c0 = cpu_seconds()
            wall = warm.loop.run_until_complete(timed(warm.engine)) if warm is not None else uvloop.run(fresh())
            cpu = cpu_seconds() - c0
        finally:
            os.close(dfd)
        if check:
            for b, fd in zip(loaded.bos, fds):
                if _fd_digest(fd, b.spec.size) != b.digest:
                    raise SystemExit(f"{image}: restored bytes of {b.spec.name} differ from the source")
        return {"wall": wall, "cpu": cpu}
    finally:
        for fd in fds + pfds:
            os.close(fd)


def _med(runs: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in runs)


def _row(scenario: str, codec: str, sink: str, raw: int, nonzero: int, dumps: list[dict], restores: list[dict],
         **extra) -> dict:
    gib = raw / GiB
    stored = dumps[-1]["stored"]
    row = {"scenario": scenario, "codec": codec, "sink": sink, "raw_bytes": raw, "nonzero_bytes": nonzero,
           "stored_bytes": stored, "on_disk_bytes": dumps[-1]["on_disk"],
           "ratio_vs_nonzero": round(nonzero / stored, 3) if stored else None,
           "dump_gbps": round(raw / _med(dumps, "wall") / 1e9, 3),
           "dump_cpu_s_per_gib": round(_med(dumps, "cpu") / gib, 3),
           "dump_spread": round(max(d["wall"] for d in dumps) / min(d["wall"] for d in dumps), 2),
           "reps": len(dumps), "per_bo_stored": dumps[-1]["per_bo"]}
    if restores:
        row.update({"restore_gbps": round(raw / _med(restores, "wall") / 1e9, 3),
                    "restore_cpu_s_per_gib": round(_med(restores, "cpu") / gib, 3)})
    row.update(extra)
    return row


# --- scenarios --------------------------------------------------------------------------------

def bench_full(scenario: str, loaded: Loaded, codecs: dict[str, Compression], sink: str, reps: int,
               dedup: bool | None = None) -> list[dict]:
    """Every codec dumps and restores the whole of `loaded`, interleaved over `reps`."""
    work = tempfile.mkdtemp(prefix=f"vramd-size-{scenario}-", dir=sink)
    dumps: dict[str, list[dict]] = {c: [] for c in codecs}
    restores: dict[str, list[dict]] = {c: [] for c in codecs}
    try:
        for rep in range(reps):
            for name, comp in codecs.items():
                image = os.path.join(work, "image")
                dumps[name].append(run_dump(loaded, image, comp, dedup=dedup))
                restores[name].append(run_restore(loaded, image, check=rep == 0))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    label = scenario if dedup is None else f"{scenario} (dedup={'on' if dedup else 'off'})"
    return [_row(label, n, sink, loaded.size, loaded.nonzero, dumps[n], restores[n]) for n in codecs]


def bench_incremental(c: corpus_mod.Corpus, scenario: str, codecs: dict[str, Compression], sink: str,
                      reps: int) -> list[dict]:
    """The base state dumped whole, then `scenario`'s state dumped with the base as parent;
    also that state dumped whole (the comparison for 'training')."""
    base, nxt = Loaded(c, "base", c.bos), Loaded(c, scenario, c.bos)
    work = tempfile.mkdtemp(prefix=f"vramd-size-{scenario}-", dir=sink)
    rows = []
    try:
        parent, child, whole = (os.path.join(work, n) for n in ("parent", "child", "whole"))
        for name, comp in codecs.items():
            incr, rest, full = [], [], []
            for rep in range(reps):
                run_dump(base, parent, comp)
                incr.append(run_dump(nxt, child, comp, parents=[parent]))
                rest.append(run_restore(nxt, child, check=rep == 0, parents=[parent]))
                full.append(run_dump(nxt, whole, comp))
            weights = [b.name for b in c.bos if b.group == "train" and b.kind == "weights"]  # the tuned ones
            names = {b.spec.name.split("/", 1)[1]: b.spec.name for b in nxt.bos}
            w_stored = sum(incr[-1]["per_bo"].get(names[w], 0) for w in weights)
            rows.append(_row(scenario, name, sink, nxt.size, nxt.nonzero, incr, rest,
                             changed_bytes=c.total(what="changed", state=scenario),
                             changed_page_bytes=c.total(what="changed_pages", state=scenario),
                             full_image_stored=full[-1]["stored"],
                             weights_raw=sum(b.size for b in c.bos if b.group == "train" and b.kind == "weights"),
                             weights_stored=w_stored))
    finally:
        base.close()
        nxt.close()
        shutil.rmtree(work, ignore_errors=True)
    return rows


def bench_chain(c: corpus_mod.Corpus, codecs: dict[str, Compression], sink: str, reps: int) -> list[dict]:
    """base <- finetune <- finetune2 (each the parent of the next); restore the newest vs the same
    state dumped whole."""
    states = ("base", "finetune", "finetune2")
    loaded = [Loaded(c, s, c.bos) for s in states]
    work = tempfile.mkdtemp(prefix="vramd-size-chain-", dir=sink)
    rows = []
    try:
        dirs = [os.path.join(work, s) for s in states]
        flat = os.path.join(work, "flat")
        for name, comp in codecs.items():
            chain_r, flat_r = [], []
            for i, (ld, d) in enumerate(zip(loaded, dirs)):
                run_dump(ld, d, comp, parents=dirs[:i][::-1])
            chain = dirs[:-1][::-1]  # the newest image's parents, nearest first
            flat_d = [flatten_image(dirs[-1], chain, flat)]
            runs = [(chain_r, dirs[-1], chain), (flat_r, flat, None)]
            for rep in range(reps):  # the order alternates: neither always restores right after the other
                for out, image, parents in runs[::-1] if rep % 2 else runs:
                    out.append(run_restore(loaded[-1], image, check=rep == 0, parents=parents))
            # the same through one engine kept for all the runs (as the daemon runs), warmed by an untimed
            # restore of each: staging and threads are not made in the timed runs
            warm, warm_r = WarmEngine(), {"chain": [], "flat": []}
            try:
                for rep in range(reps + 1):
                    for key, image, parents in (runs[::-1] if rep % 2 else runs):
                        r = run_restore(loaded[-1], image, check=False, parents=parents, warm=warm)
                        if rep:
                            warm_r["chain" if key is chain_r else "flat"].append(r)
            finally:
                warm.close()
            gib = loaded[-1].size / GiB
            rows.append(_row("chain3", name, sink, loaded[-1].size, loaded[-1].nonzero, flat_d, flat_r,
                             chain_restore_gbps=round(loaded[-1].size / _med(chain_r, "wall") / 1e9, 3),
                             chain_restore_cpu_s_per_gib=round(_med(chain_r, "cpu") / gib, 3),
                             warm_chain_restore_gbps=round(loaded[-1].size / _med(warm_r["chain"], "wall") / 1e9, 3),
                             warm_restore_gbps=round(loaded[-1].size / _med(warm_r["flat"], "wall") / 1e9, 3)))
    finally:
        for ld in loaded:
            ld.close()
        shutil.rmtree(work, ignore_errors=True)
    return rows


def references(loaded: Loaded, sink: str, reps: int) -> list[dict]:
    """zstd -1, zstd -3, lz4 on the same bytes (the BOs concatenated into one file on `sink`)."""
    tools = [("zstd -1", ["zstd", "-1", "-T1", "-q", "-f"]), ("zstd -3", ["zstd", "-3", "-T1", "-q", "-f"]),
             ("lz4", ["lz4", "-1", "-q", "-f"])]
    work = tempfile.mkdtemp(prefix="vramd-size-ref-", dir=sink)
    out = []
    try:
        raw, packed = os.path.join(work, "raw.bin"), os.path.join(work, "packed")
        with open(raw, "wb") as f:
            for b in loaded.bos:
                f.write(os.pread(b.spec.ref.fd, b.spec.size, 0))
        for label, cmd in tools:
            if shutil.which(cmd[0]) is None:
                out.append({"tool": label, "note": f"{cmd[0]} not installed (Debian package {cmd[0]})"})
                continue
            walls, cpus = [], []
            for _ in range(reps):
                if os.path.exists(packed):
                    os.unlink(packed)
                c0 = cpu_seconds(resource.RUSAGE_CHILDREN)
                t = time.perf_counter()
                subprocess.run([*cmd, raw, "-o", packed] if cmd[0] == "zstd" else [*cmd, raw, packed], check=True)
                walls.append(time.perf_counter() - t)
                cpus.append(cpu_seconds(resource.RUSAGE_CHILDREN) - c0)
            size = os.path.getsize(packed)
            out.append({"tool": label, "stored_bytes": size, "ratio_vs_nonzero": round(loaded.nonzero / size, 3),
                        "gbps": round(loaded.size / statistics.median(walls) / 1e9, 3),
                        "cpu_s_per_gib": round(statistics.median(cpus) / (loaded.size / GiB), 3)})
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return out


# Per dtype, the fields of one element (shift, bits): sign and exponent together, then the mantissa a byte
# (or what is left of it) at a time.
FIELDS = {"fp32": ((23, 9), (16, 7), (8, 8), (0, 8)), "bf16": ((7, 9), (0, 7)),
          "fp16": ((10, 6), (8, 2), (0, 8))}


def bounds(c: corpus_mod.Corpus, sink: str, xz: bool) -> list[dict]:
    """How small the base state's bytes can get, per group, measured two ways (numpy; opt-in, slow with xz).

    `fields`: the order-0 entropy of each float field (sign and exponent, then the mantissa's bytes), a BO
    at a time: what a coder with one static table per field and BO stores.  `xz -9`: LZMA, which models
    context and matches across BOs within 64 MiB, on each group's non-zero pages split into byte planes
    (the strongest general-purpose coder at hand; ~1 MiB/s).  Neither is a proof of a limit: they show what
    the bytes give to coders far slower than any codec a dump can afford."""
    import numpy as np  # the bench extra brings it

    def entropy_bits(symbols: np.ndarray, bits: int) -> float:
        counts = np.bincount(symbols, minlength=1 << bits).astype(np.float64)
        p = counts[counts > 0] / counts.sum()
        return float(-(p * np.log2(p)).sum()) * symbols.size

    groups: dict[str, dict] = {}
    work = tempfile.mkdtemp(prefix="vramd-size-bounds-", dir=sink)
    try:
        for info in c.bos:
            with open(c.path("base", info), "rb") as f:
                pages = np.frombuffer(f.read(), dtype=np.uint8).reshape(-1, 4096)
            nz = pages[pages.any(axis=1)]
            if not nz.size:
                continue
            g = groups.setdefault(info.group, {"group": info.group, "nonzero_bytes": 0, "fields_bits": 0.0})
            g["nonzero_bytes"] += nz.size
            words = nz.reshape(-1).view({"fp32": np.uint32, "bf16": np.uint16, "fp16": np.uint16}.get(info.dtype,
                                                                                                   np.uint8))
            width = words.itemsize
            for shift, bits in FIELDS.get(info.dtype, ((0, 8),)):
                g["fields_bits"] += entropy_bits(((words >> shift) & ((1 << bits) - 1)).astype(np.int64), bits)
            if xz:
                with open(os.path.join(work, info.group), "ab") as f:
                    f.write(nz.reshape(-1, width).T.tobytes())
        out = []
        for name, g in groups.items():
            row = {"group": name, "nonzero_bytes": g["nonzero_bytes"],
                   "fields_bytes": round(g["fields_bits"] / 8),
                   "fields_ratio": round(g["nonzero_bytes"] * 8 / g["fields_bits"], 3)}
            if xz and shutil.which("xz"):
                packed = len(subprocess.run(["xz", "-9", "-T1", "-c", os.path.join(work, name)],
                                            capture_output=True, check=True).stdout)
                row.update(xz_planes_bytes=packed, xz_planes_ratio=round(g["nonzero_bytes"] / packed, 3))
            out.append(row)
            print(f"  bounds {name:12s} {_mib(row['nonzero_bytes'])} MiB non-zero: fields {row['fields_ratio']}"
                  + (f", xz -9 planes {row['xz_planes_ratio']}" if "xz_planes_ratio" in row else ""), flush=True)
        total = {"group": "all", "nonzero_bytes": sum(r["nonzero_bytes"] for r in out),
                 "fields_bytes": sum(r["fields_bytes"] for r in out)}
        total["fields_ratio"] = round(total["nonzero_bytes"] / total["fields_bytes"], 3)
        if out and all("xz_planes_bytes" in r for r in out):
            total["xz_planes_bytes"] = sum(r["xz_planes_bytes"] for r in out)
            total["xz_planes_ratio"] = round(total["nonzero_bytes"] / total["xz_planes_bytes"], 3)
        print(f"  bounds all          fields {total['fields_ratio']}"
              + (f", xz -9 planes {total['xz_planes_ratio']}" if "xz_planes_ratio" in total else ""), flush=True)
        return [*out, total]
    finally:
        shutil.rmtree(work, ignore_errors=True)


# --- targets ------------------------------------------------------------------------------

def _pick(rows: list[dict], scenario: str, codec: str, sink: str) -> dict | None:
    return next((r for r in rows if r["scenario"] == scenario and r["codec"] == codec and r["sink"] == sink), None)


def _best_codec(available: list[str]) -> str:
    return "auto" if "auto" in available else ("zstd:3" if "zstd:3" in available else available[-1])


def targets(rows: list[dict], available: list[str], sink: str, incremental: bool, dedup_switch: bool) -> list[dict]:
    out = []

    def verdict(name: str, ok: bool | None, detail: str) -> None:
        out.append({"target": name, "status": "n/a" if ok is None else ("met" if ok else "MISSED"), "detail": detail})

    judge = _best_codec(available)
    note = "" if judge == "auto" else f" (auto not available in this build: judged on {judge})"
    r, none = _pick(rows, "single", judge, sink), _pick(rows, "single", "none", sink)
    if r and none:
        speed = r["dump_gbps"] / none["dump_gbps"]
        verdict("single image: auto >= 1.4x smaller than raw non-zero bytes, dump GB/s >= 0.95x none's",
                r["ratio_vs_nonzero"] >= 1.4 and speed >= 0.95,
                f"ratio {r['ratio_vs_nonzero']:.2f}x, dump speed {speed:.2f}x none's{note}")
    # Without auto, the replicas are judged on the none codec: compression alone (zstd on zero-rich
    # BOs) must not pass for dedup.
    rjudge = "auto" if "auto" in available else "none"
    rnote = "" if rjudge == "auto" else " (auto not available in this build: judged on none)"
    if dedup_switch:
        r, base = _pick(rows, "replicas (dedup=on)", rjudge, sink), _pick(rows, "replicas (dedup=off)", rjudge, sink)
        against = f"the same dump with dedup off ({rjudge})"
    else:
        r, base = _pick(rows, "replicas", rjudge, sink), _pick(rows, "replicas", "none", sink)
        against = "the none codec's image of the replicas (this build has no dedup switch)"
    if r and base:
        f = r["stored_bytes"] / base["stored_bytes"]
        verdict("4 replicas: image <= 0.30x the size without dedup", f <= 0.30, f"{f:.3f}x {against}{rnote}")
    if not incremental:
        for name in ("inference-like: stored <= changed + 2%", "fine-tuning-like: weights' stored <= 5% of full size",
                     "training-like: stored <= full image + 1%", "restore from a 3-deep chain >= 0.90x flattened"):
            verdict(name, None, "incremental: not available in this build")
        return out
    for codec in available:
        r = _pick(rows, "inference", codec, sink)
        if r:
            verdict(f"inference-like ({codec}): stored <= changed + 2%", r["stored_bytes"] <= r["changed_bytes"] * 1.02,
                    f"stored {r['stored_bytes']}, changed {r['changed_bytes']} bytes")
        r = _pick(rows, "finetune", codec, sink)
        if r:
            f = r["weights_stored"] / r["weights_raw"] if r["weights_raw"] else 0.0
            verdict(f"fine-tuning-like ({codec}): weights' stored <= 5% of full size", f <= 0.05,
                    f"{f:.3%} of {r['weights_raw']} bytes")
        r = _pick(rows, "training", codec, sink)
        if r:
            f = r["stored_bytes"] / r["full_image_stored"]
            verdict(f"training-like ({codec}): stored <= full image + 1%", f <= 1.01, f"{f:.3f}x the full image")
        r = _pick(rows, "chain3", codec, sink)
        if r:
            f = r["chain_restore_gbps"] / r["restore_gbps"]
            w = r["warm_chain_restore_gbps"] / r["warm_restore_gbps"]
            verdict(f"restore from a 3-deep chain ({codec}) >= 0.90x flattened", f >= 0.90,
                    f"{f:.2f}x (one engine kept, as the daemon runs: {w:.2f}x)")
    return out


# --- output -------------------------------------------------------------------------------------

def _mib(n: int | None) -> str:
    return "—" if n is None else f"{n / (1 << 20):.1f}"


def print_table(rows: list[dict], refs: list[dict], skipped: list[str]) -> None:
    print(f"{'scenario':22} {'codec':8} {'sink':10} {'raw MiB':>8} {'nonzero':>8} {'stored':>8} {'on disk':>8} "
          f"{'ratio':>6} {'dump GB/s':>9} {'CPU/GiB':>7} {'rest GB/s':>9} {'CPU/GiB':>7}")
    for r in rows:
        print(f"{r['scenario']:22} {r['codec']:8} {r['sink']:10} {_mib(r['raw_bytes']):>8} "
              f"{_mib(r['nonzero_bytes']):>8} {_mib(r['stored_bytes']):>8} {_mib(r['on_disk_bytes']):>8} "
              f"{r['ratio_vs_nonzero'] or 0:6.2f} {r['dump_gbps']:9.2f} {r['dump_cpu_s_per_gib']:7.2f} "
              f"{r.get('restore_gbps', 0):9.2f} {r.get('restore_cpu_s_per_gib', 0):7.2f}")
        extra = {k: r[k] for k in ("changed_bytes", "full_image_stored", "weights_stored", "chain_restore_gbps",
                                   "warm_chain_restore_gbps", "warm_restore_gbps")
                 if k in r}
        if extra:
            print(f"{'':22} {extra}")
    for s in skipped:
        print(s)
    for r in refs:
        if "note" in r:
            print(f"reference {r['tool']:8}: {r['note']}")
        else:
            print(f"reference {r['tool']:8}: stored {_mib(r['stored_bytes'])} MiB, ratio {r['ratio_vs_nonzero']:.2f}, "
                  f"{r['gbps']:.2f} GB/s, {r['cpu_s_per_gib']:.2f} CPU s/GiB")


def print_groups(rows: list[dict], csum: dict) -> None:
    """The single image's stored bytes per corpus group and codec, as non-zero / stored."""
    single = [r for r in rows if r["scenario"] == "single"]
    if not single:
        return
    print(f"\nsingle image, non-zero / stored per group: {'group':12} {'nonzero MiB':>11} "
          + " ".join(f"{r['codec'] + '@' + os.path.basename(r['sink']):>14}" for r in single))
    for g, info in csum["groups"].items():
        cells = []
        for r in single:
            st = r["per_group_stored"].get(g, 0)
            if info["nonzero"] == 0:  # all zeros: what its hole records cost
                cells.append(f"{f'{st} B (zeros)':>14}")
            else:
                cells.append(f"{info['nonzero'] / st:14.2f}")
        print(f"{'':43}{g:12} {_mib(info['nonzero']):>11} " + " ".join(cells))


def _uptime() -> str:
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    except OSError:
        return f"load {os.getloadavg()}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cache", required=True, help="where the corpus is generated and kept (bench/corpus.py)")
    ap.add_argument("--scale", type=float, default=1.0)
    ap.add_argument("--no-torch", action="store_true", help="the corpus without its torch parts")
    ap.add_argument("--codec", action="append", default=[], help="another codec to run (repeatable)")
    ap.add_argument("--codecs", help="replace the default codec list (comma-separated)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--shm", default="/dev/shm", help="the tmpfs the images go to")
    ap.add_argument("--sink-dir", help="also dump into (and restore from) this directory")
    ap.add_argument("--scenarios", default="single,replicas,incremental,chain,references")
    ap.add_argument("--out", help="write everything as JSON here")
    ns = ap.parse_args(argv)

    print(f"machine: {os.cpu_count()} CPUs; {_uptime()}", flush=True)
    c = corpus_mod.open_corpus(ns.cache, ns.scale, False if ns.no_torch else None)
    csum = corpus_mod.summary(c)
    print(f"corpus: {_mib(csum['bytes'])} MiB in {len(c.bos)} BOs, {_mib(csum['nonzero'])} MiB non-zero; "
          f"torch {c.torch or 'absent'}; {'; '.join(c.notes)}", flush=True)
    names = list(dict.fromkeys((ns.codecs.split(",") if ns.codecs else list(CODECS)) + ns.codec))
    codecs = {n: comp for n in names if (comp := parse_codec(n)) is not None}
    skipped = [f"codec {n}: not available in this build" for n in names if n not in codecs]
    incremental, dedup_switch = engine_supports_parent(), engine_supports_dedup_switch()
    if not incremental:
        skipped.append("incremental: not available in this build")
    scenarios = set(ns.scenarios.split(","))
    sinks = [ns.shm] + ([ns.sink_dir] if ns.sink_dir else [])
    rows: list[dict] = []
    refs: list[dict] = []
    limits: list[dict] = []
    if scenarios & {"bounds", "bounds-xz"}:
        limits = bounds(c, ns.shm, xz="bounds-xz" in scenarios)
    for sink in sinks:
        if "single" in scenarios:
            loaded = Loaded(c, "base", c.bos)
            try:
                rows += shown(bench_full("single", loaded, codecs, sink, ns.reps))
                if "references" in scenarios and sink == ns.shm:
                    refs = references(loaded, sink, ns.reps)
            finally:
                loaded.close()
        if "replicas" in scenarios:
            loaded = Loaded(c, "base", c.replica_bos(), copies=corpus_mod.REPLICAS)
            try:
                if dedup_switch:
                    rows += shown(bench_full("replicas", loaded, codecs, sink, ns.reps, dedup=True))
                    rows += shown(bench_full("replicas", loaded, codecs, sink, ns.reps, dedup=False))
                else:
                    rows += shown(bench_full("replicas", loaded, codecs, sink, ns.reps))
            finally:
                loaded.close()
        if incremental and "incremental" in scenarios:
            for scenario in INCREMENTAL:
                rows += shown(bench_incremental(c, scenario, codecs, sink, ns.reps))
        if incremental and "chain" in scenarios:
            rows += shown(bench_chain(c, codecs, sink, ns.reps))
    group_of = {b.name: b.group for b in c.bos}
    for r in rows:  # per corpus group (minilm_fp32, train, kv, ...): what each codec stores of it
        per: dict[str, int] = {}
        for name, n in r["per_bo_stored"].items():
            g = group_of[name.split("/", 1)[1]]
            per[g] = per.get(g, 0) + n
        r["per_group_stored"] = per
    print()
    print_table(rows, refs, skipped)
    print_groups(rows, csum)
    verdicts = targets(rows, list(codecs), ns.shm, incremental, dedup_switch)
    print()
    for v in verdicts:
        print(f"{v['status']:6} {v['target']}: {v['detail']}")
    end = _uptime()
    print(f"at the end: {end}")
    if ns.out:
        with open(ns.out, "w") as f:
            json.dump({"machine": {"cpus": os.cpu_count(), "uptime_end": end}, "corpus": csum,
                       "codecs_run": list(codecs), "skipped": skipped, "incremental": incremental,
                       "dedup_switch": dedup_switch, "rows": rows, "references": refs, "bounds": limits,
                       "targets": verdicts}, f,
                      indent=1)
    return 0


def shown(new: list[dict]) -> list[dict]:
    """Rows as they are measured, one line each (a long run shows where it is, and what it had if it dies)."""
    for r in new:
        print(f"  {r['scenario']:<22} {r['codec']:<10} stored {r['stored_bytes'] / (1 << 20):9.1f} MiB  "
              f"dump {r['dump_gbps']:.2f} GB/s  restore {r['restore_gbps']:.2f} GB/s", flush=True)
    return new


if __name__ == "__main__":
    sys.exit(main())
