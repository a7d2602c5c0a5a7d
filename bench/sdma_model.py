#!/usr/bin/env python3
"""SDMA backend on the SOFTWARE MODEL of libdrm_amdgpu + SDMA: submission overhead and throughput.

    python bench/sdma_model.py [--size 1G] [--reps 5] [--out results.json]

Every number here is measured on vramd's model (native/model/), not on a GPU:
the model's "engines" are CPU threads doing memcpy.  What it does show is the
backend's own cost per submission (building the IB, amdgpu_cs_submit,
waiting for the fence in the ring's waiter thread, waking the event loop)
and that the pipeline keeps several submissions in flight.

(1) per-submission overhead: 4 KiB copies BO -> staging, one at a time
    (submit, wait, next) and 32 in flight; microseconds per submission.
(2) throughput rows, side by side in one run: dump and restore of one
    --size BO (a memfd standing for a dmabuf) through the engine with the
    sdma backend (model) and with the mmap backend; medians over --reps.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import uvloop

from vramd import inproc
from vramd.backends import BoRef, Direction
from vramd.engine import BoSpec, Engine, EngineConfig, RestoreTarget
from vramd.units import parse_size


def memfd(size: int, data: bytes = b"") -> int:
    fd = os.memfd_create("bo", os.MFD_CLOEXEC)
    os.ftruncate(fd, size)
    if data:
        os.pwrite(fd, data, 0)
    return fd


async def overhead(engine: Engine, n: int) -> dict:
    b = engine.backends["sdma"]
    fd = memfd(1 << 20)
    h = b.open(1, BoRef("sdma", fd), 1 << 20, 0, Direction.READ)
    bufs = await engine.pool.acquire(engine.config.chunk_size, 1)
    try:
        await b.submit(h, 0, bufs[0], 0, 4096)  # registers the staging buffer, warms the ring
        t0 = time.perf_counter()
        for i in range(n):
            await b.submit(h, (i % 256) * 4096, bufs[0], 0, 4096)
        serial = (time.perf_counter() - t0) / n
        t0 = time.perf_counter()
        inflight = 32
        for base in range(0, n, inflight):
            await asyncio.gather(*(b.submit(h, ((base + k) % 256) * 4096, bufs[0], k * 4096, 4096)
                                   for k in range(min(inflight, n - base))))
        pipelined = (time.perf_counter() - t0) / n
    finally:
        engine.pool.release(bufs)
        b.release(h)
        os.close(fd)
    return {"submissions": n, "copy_bytes": 4096, "serial_us": serial * 1e6, "pipelined_32_us": pipelined * 1e6}


async def rows(engine: Engine, size: int, reps: int, base: str) -> dict:
    data = os.urandom(64 << 20) * (size // (64 << 20)) + os.urandom(size % (64 << 20))
    src = memfd(size, data)
    del data
    dst = memfd(size)
    out = {name: {"dump_s": [], "restore_s": []} for name in ("sdma", "mmap")}
    try:
        for _ in range(reps):
            for name in out:
                d = tempfile.mkdtemp(prefix="vbench-sdma-", dir=base)
                dfd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
                try:
                    t0 = time.perf_counter()
                    await inproc.dump(engine, dfd, [BoSpec(1, size, BoRef(name, src), gpu_id=0)])
                    out[name]["dump_s"].append(time.perf_counter() - t0)
                    t0 = time.perf_counter()
                    await inproc.restore(engine, dfd, [RestoreTarget(1, BoRef(name, dst))])
                    out[name]["restore_s"].append(time.perf_counter() - t0)
                finally:
                    os.close(dfd)
                    shutil.rmtree(d)
        if os.pread(dst, 1 << 20, size // 2) != os.pread(src, 1 << 20, size // 2):
            raise SystemExit("restore not byte-exact")
    finally:
        os.close(src)
        os.close(dst)
    for r in out.values():
        for k in ("dump", "restore"):
            r[f"{k}_gbps_median"] = size / statistics.median(r[f"{k}_s"]) / 1e9
    return out


async def main_async(ns) -> dict:
    async with Engine(EngineConfig(sdma_library="model", staging_budget=256 << 20)) as engine:
        if "sdma" not in engine.backends:
            raise SystemExit(f"sdma backend unavailable: {engine.unavailable.get('sdma')}")
        return {"MODEL": "every number below was measured on vramd's software model of libdrm_amdgpu + SDMA, "
                         "not on a GPU",
                "date": time.strftime("%Y-%m-%d"), "cpus": os.cpu_count(), "size": ns.size, "reps": ns.reps,
                "overhead": await overhead(engine, ns.submissions),
                "throughput": await rows(engine, ns.size, ns.reps, ns.image_dir)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", type=parse_size, default=1 << 30)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--submissions", type=int, default=2000)
    ap.add_argument("--image-dir", default="/dev/shm")
    ap.add_argument("--out")
    ns = ap.parse_args()
    res = uvloop.run(main_async(ns))
    o = res["overhead"]
    print(f"[SOFTWARE MODEL] per-submission overhead (4 KiB copy): {o['serial_us']:.1f} us one at a time, "
          f"{o['pipelined_32_us']:.1f} us each with 32 in flight")
    for name, r in res["throughput"].items():
        print(f"[{'SOFTWARE MODEL' if name == 'sdma' else 'CPU'}] {name:5} dump {r['dump_gbps_median']:.2f} GB/s, "
              f"restore {r['restore_gbps_median']:.2f} GB/s (median of {ns.reps})")
    if ns.out:
        with open(ns.out, "w") as f:
            json.dump(res, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
