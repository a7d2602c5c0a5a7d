"""End-to-end demo: dump a live process's buffers, restore them into a fresh process, verify.

    python -m vramd.demo [--size 2G] [--image DIR] [--compress zstd:1]

Starts a workload process holding mixed buffers (random, zero, patterned,
odd sizes), dumps them through /proc/<pid>/mem into an image, starts a
fresh process with garbage at the same addresses, restores the image into
it, and checks every buffer byte for byte (and re-verifies the image).
Exit status 0 only if everything matched.
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time

import uvloop

from .backends import BoRef
from .codec import Compression
from .engine import Engine, EngineConfig
from .jobs import BoSpec, RestoreTarget
from .units import format_size, parse_size
from .workload import Workload, blank_spec_like


def mixed_spec(total: int) -> list[dict]:
    r, z = total * 3 // 8, total * 3 // 8
    p = total - r - z
    return [
        {"size": r - 12345, "fill": "random", "seed": 11},
        {"size": z, "fill": "zero", "marks": [[z // 2, "c0ffee"]]},
        {"size": p - 4096, "fill": "pattern", "seed": 7, "skew": 100},
        {"size": 12345 + 4096, "fill": "random", "seed": 12},
        {"size": 1, "fill": "random", "seed": 13},
        {"size": 0},
    ]


class _Meter:
    def __init__(self, label: str):
        self.label, self.t0, self.last = label, time.perf_counter(), 0.0
        self.tty = sys.stderr.isatty()

    def __call__(self, p) -> None:
        now = time.perf_counter()
        if now - self.last < 0.2 and p.bytes_done < p.bytes_total:
            return
        self.last = now
        pct = 100 * p.bytes_done / max(1, p.bytes_total)
        line = f"{self.label}: {pct:5.1f}%  {format_size(p.bytes_done)} / {format_size(p.bytes_total)}"
        print(("\r" + line) if self.tty else line, end="" if self.tty else "\n", file=sys.stderr, flush=True)

    def done(self) -> float:
        if self.tty:
            print(file=sys.stderr)
        return time.perf_counter() - self.t0


async def run_demo(total: int, image: str, compression: Compression) -> bool:
    dfd = os.open(image, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    ok = True
    try:
        async with Engine(EngineConfig(compression=compression)) as engine:
            print(f"workload: starting a process holding {format_size(total)} in {len(mixed_spec(total))} buffers")
            with Workload(mixed_spec(total)) as src:
                want = [r["digest"] for r in src.regions]
                regions = src.regions
                mem = os.open(f"/proc/{src.pid}/mem", os.O_RDONLY | os.O_CLOEXEC)
                try:
                    bos = [BoSpec(i + 1, r["size"], BoRef("procmem", mem, r["addr"]), va_addr=r["addr"])
                           for i, r in enumerate(regions)]
                    meter = _Meter("dump")
                    manifest = await engine.dump(dfd, bos, on_progress=meter)
                    secs = meter.done()
                finally:
                    os.close(mem)
            t = manifest.totals
            print(f"dump:    {format_size(t.bo_bytes)} in {secs:.2f} s = {t.bo_bytes / secs / 1e9:.2f} GB/s; "
                  f"image stores {format_size(t.stored_bytes)}; {format_size(t.zero_bytes)} of zeros kept as holes")

            with Workload(blank_spec_like(regions)) as dst:
                mem = os.open(f"/proc/{dst.pid}/mem", os.O_RDWR | os.O_CLOEXEC)
                try:
                    targets = [RestoreTarget(i + 1, BoRef("procmem", mem, r["addr"])) for i, r in enumerate(regions)]
                    meter = _Meter("restore")
                    await engine.restore(dfd, targets, on_progress=meter)
                    secs = meter.done()
                finally:
                    os.close(mem)
                print(f"restore: {format_size(t.bo_bytes)} in {secs:.2f} s = {t.bo_bytes / secs / 1e9:.2f} GB/s "
                      f"into a fresh process (pid {dst.pid}) at the same addresses")
                got = dst.digests()
            for i, (a, b) in enumerate(zip(want, got)):
                if a != b:
                    ok = False
                    print(f"MISMATCH: buffer {i + 1} at {regions[i]['addr']:#x} differs after restore")
            report = await engine.verify(dfd)
            print(f"verify:  {report.progress.chunks_done} chunks, every checksum good")
    finally:
        os.close(dfd)
    print("RESULT: byte-exact round trip" if ok else "RESULT: FAILED")
    return ok


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m vramd.demo", description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="2G", help="total bytes the workload holds (default 2G)")
    ap.add_argument("--image", help="image directory (default: a temporary one, removed afterwards)")
    ap.add_argument("--compress", default="zstd:1", help="none | zstd | zstd:LEVEL (default zstd:1)")
    ns = ap.parse_args(argv)
    try:
        total, compression = parse_size(ns.size), Compression.parse(ns.compress)
    except ValueError as e:
        ap.error(str(e))
    image = ns.image or tempfile.mkdtemp(prefix="vramd-demo-", dir="/var/tmp")
    os.makedirs(image, exist_ok=True)
    try:
        return 0 if uvloop.run(run_demo(total, image, compression)) else 1
    finally:
        if not ns.image:
            shutil.rmtree(image, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
