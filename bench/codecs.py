#!/usr/bin/env python3
"""The planes codec vs plain zstd, and the cost of the trial (docs/codecs.md).

    python bench/codecs.py [--mib 8] [--reps 3] [--json out.json]

Data (generated with array/struct; numpy is not a dependency): fp32 weights drawn
from N(0, 0.02); the same cast to bf16 (the top two bytes of each fp32) and to fp16;
Adam-like second moments (squares of N(0, 1e-3), + 1e-12: small positive fp32); and
random bytes.  For each, at zstd levels 1 and 3: plain zstd, planes word 2 and word 4:
ratio (stored / raw) and single-thread CPU throughput (time.thread_time, so the load of
the machine matters less than with wall time; medians over --reps) for compress and
decompress; the transform alone (split + merge) native and in Python; and the trial
(policy.choose with three candidates on 3 x 16 KiB) as a fraction of compressing the
whole chunk with the codec the trial picked.
"""
from __future__ import annotations

import argparse
import array
import json
import os
import random
import statistics
import struct
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from vramd.image import planes, policy


def datasets(nbytes: int) -> dict[str, bytes]:
    rnd = random.Random(1)
    n = nbytes // 4
    f32 = array.array("f", (rnd.gauss(0.0, 0.02) for _ in range(2 * n)))  # twice: the 16-bit sets need 2n values
    raw64 = f32.tobytes()
    bf16 = bytearray(nbytes)  # little-endian: the top two bytes of each fp32 are bytes 2 and 3
    bf16[0::2] = raw64[2::4]
    bf16[1::2] = raw64[3::4]
    f16 = struct.pack(f"<{2 * n}e", *f32)
    adam = array.array("f", (rnd.gauss(0.0, 1e-3) ** 2 + 1e-12 for _ in range(n))).tobytes()
    return {"fp32": raw64[:nbytes], "bf16": bytes(bf16), "fp16": f16, "adam-v": adam,
            "random": rnd.randbytes(nbytes)}


def cpu(fn: Callable[[], object], reps: int) -> float:
    times = []
    for _ in range(reps):
        t = time.thread_time()
        fn()
        times.append(time.thread_time() - t)
    return statistics.median(times)


def codec_row(mv: memoryview, level: int, reps: int, dest: memoryview) -> dict[str, object]:
    size = mv.nbytes
    gb = size / 1e9
    results = {}
    cands = policy.candidates("bplanes", level)
    for codec in cands:
        payload = codec.compress(mv)
        tc = cpu(lambda c=codec: c.compress(mv), reps)
        if codec.kind == "zstd":
            td = cpu(lambda p=payload: planes._decompressor().decompress(p), reps)
        else:
            td = cpu(lambda p=payload, w=codec.word: planes.decompress_planes(p, w, size, dest), reps)
        results[str(codec)] = {"ratio": len(payload) / size, "compress_gbs": gb / tc, "decompress_gbs": gb / td,
                               "compress_cpu_s_per_gib": tc * (1 << 30) / size}
    sample = policy.sample_slices(mv)
    choice = policy.choose(sample, cands)
    tt = cpu(lambda: policy.choose(sample, cands), max(reps, 5))
    # the trial vs compressing the whole chunk with its pick (the cheapest candidate where it picked raw)
    picked = [choice.codec] if choice.codec.kind != "raw" else list(cands)
    full = min(cpu(lambda c=c: c.compress(mv), 1) for c in picked)
    return {"level": level, "codecs": results, "trial_pick": str(choice.codec), "trial_ratio": choice.best_ratio,
            "trial_cpu_fraction": tt / full}


def dump_sim(chunk: bytes, n: int, directory: str, mode: str,
             throttle: float = 0.0) -> tuple[float, float, dict[str, int]]:
    """Wall and CPU seconds to store `n` copies of `chunk` in a file under `directory` (one thread), as `mode` says.

    none: write raw; auto: AutoPolicy(workers=1) decides, its sink and compression
    observations fed back as the writer would.  throttle > 0 emulates a sink of that
    many bytes/s (a sleep after each write for what the write was faster by).  Medians of
    three interleaved runs.
    """
    import xxhash
    auto = policy.AutoPolicy(1, workers=1)
    mv = memoryview(chunk)
    picks: dict[str, int] = {}
    path = os.path.join(directory, f"vramd-codecs-bench-{os.getpid()}")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        t0, c00 = time.perf_counter(), time.thread_time()
        for _ in range(n):
            payload: bytes | memoryview = mv
            if mode == "auto":
                choice = auto.decide(mv)
                picks[str(choice.codec)] = picks.get(str(choice.codec), 0) + 1
                if choice.codec.kind != "raw":
                    c0 = time.thread_time()
                    payload = choice.codec.compress(mv)
                    auto.observe_compress(choice.codec, len(mv), len(payload), time.thread_time() - c0)
            xxhash.xxh3_64_intdigest(payload)
            w0 = time.perf_counter()
            os.write(fd, payload)
            spent = time.perf_counter() - w0
            if throttle:
                time.sleep(max(0.0, len(payload) / throttle - spent))
                spent = max(spent, len(payload) / throttle)
            auto.observe_sink(len(payload), spent)
        return time.perf_counter() - t0, time.thread_time() - c00, picks
    finally:
        os.close(fd)
        os.unlink(path)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=int, default=8)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--json")
    ap.add_argument("--dump-dir", help="also time `auto` vs `none` writing chunks there (e.g. /dev/shm)")
    ap.add_argument("--dump-chunks", type=int, default=64)
    a = ap.parse_args()
    size = a.mib << 20
    data = datasets(size)
    gb = size / 1e9
    out: dict[str, object] = {"uptime": os.getloadavg(), "cpus": os.cpu_count(), "native": planes.NATIVE,
                              "chunk": size, "rows": []}
    print(f"load average {os.getloadavg()}, {os.cpu_count()} CPUs, native transform: {planes.NATIVE}")
    dest = memoryview(bytearray(size))
    # the transform alone
    print("\ntransform (GB/s of raw bytes, one thread): split / merge")
    for word in (2, 4):
        src = data["fp32"]
        sp = planes.split_planes(src, word)
        row = [f"word {word}"]
        for name, mod in (("native", planes._copy), ("python", None)):
            if name == "native" and mod is None:
                continue
            saved = planes._copy
            planes._copy = mod
            try:
                ts = cpu(lambda w=word, s=src: planes.split_planes(s, w), a.reps)
                tm = cpu(lambda w=word, s=sp: planes.merge_planes(s, w, dest), a.reps)
            finally:
                planes._copy = saved
            row.append(f"{name} {gb / ts:.2f} / {gb / tm:.2f}")
            out.setdefault("transform", []).append(  # type: ignore[union-attr]
                {"word": word, "path": name, "split_gbs": gb / ts, "merge_gbs": gb / tm})
        print("  " + " | ".join(row))
    print("\ncodec ratios and single-thread CPU throughput (GB/s compress / decompress)")
    print(f"{'data':8} {'L':>2} {'zstd':>22} {'planes2':>22} {'planes4':>22}  trial: pick, cost")
    for name, raw in data.items():
        for level in (1, 3):
            row = codec_row(memoryview(raw), level, a.reps, dest)
            row["data"] = name
            cells = [f"{c['ratio']:.3f} {c['compress_gbs']:5.2f}/{c['decompress_gbs']:5.2f}"
                     for c in row["codecs"].values()]  # type: ignore[attr-defined]
            print(f"{name:8} {level:>2} {cells[0]:>22} {cells[1]:>22} {cells[2]:>22}  "
                  f"{row['trial_pick']:10} (trial {row['trial_ratio']:.3f}), {100 * row['trial_cpu_fraction']:.1f}%")
            out["rows"].append(row)  # type: ignore[attr-defined]
    if a.dump_dir:
        print(f"\nsimulated dump, one thread, {a.dump_chunks} chunks of {a.mib} MiB (auto / none)")
        for name in ("bf16", "fp32", "random"):
            for throttle in (0.0, 30e6):
                sink = "unthrottled" if not throttle else f"{throttle / 1e6:.0f} MB/s"
                chunks = a.dump_chunks if not throttle else 4
                runs: dict[str, list[tuple[float, float, dict[str, int]]]] = {"none": [], "auto": []}
                for _ in range(3):  # interleaved
                    for mode in runs:
                        runs[mode].append(dump_sim(data[name], chunks, a.dump_dir, mode, throttle))
                none_w, none_c = (statistics.median(r[i] for r in runs["none"]) for i in (0, 1))
                auto_w, auto_c = (statistics.median(r[i] for r in runs["auto"]) for i in (0, 1))
                picks = runs["auto"][-1][2]
                print(f"  {name:7} {sink:12} wall {auto_w / none_w:.3f}, CPU {auto_c / none_c:.3f} x none  {picks}")
                out.setdefault("dump", []).append({"data": name, "sink": sink, "chunks": chunks,  # type: ignore
                                                    "none_wall_s": none_w, "auto_wall_s": auto_w,
                                                    "none_cpu_s": none_c, "auto_cpu_s": auto_c, "picks": picks})
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
