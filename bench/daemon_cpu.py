#!/usr/bin/env python3
"""The daemon's CPU time per session of many small BOs, and how much of it is its event loop's.

    python bench/daemon_cpu.py [--bos 10000] [--bo-size 4096] [--reps 5] [--modes procmem,memfd]
                               [--image-dir /var/tmp] [--out results.json]

Starts one `vramd` daemon and runs, through vramd.client.Client, one dump
session and one restore session per repetition and source (the sources of
bench/client_rate.py: `procmem` ranges of one process, one memfd per BO for
`memfd`).  Around each session it reads the daemon's CPU time (user +
system) from /proc: all its threads (/proc/<pid>/stat) and its main thread
alone, which runs the event loop (/proc/<pid>/task/<pid>/stat).  CPU time
depends much less on what else the machine runs than wall time does (it
still grows with contention for caches and cores), so it is the figure to
compare between two versions of the daemon measured one after the other;
the wall rate is printed beside it, with the load average.  Resolution:
the kernel's clock tick (10 ms).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import client_rate  # the same BOs and sources

from vramd.client import SESSION_DUMP, SESSION_RESTORE, Client, ClientBo
from vramd.testing import DaemonProcess

TICK = os.sysconf("SC_CLK_TCK")


def cpu_of(path: str) -> float:
    with open(path) as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bos", type=int, default=10_000)
    ap.add_argument("--bo-size", type=int, default=4096)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--modes", default="procmem,memfd")
    ap.add_argument("--image-dir", default="/var/tmp")
    ap.add_argument("--out")
    args = ap.parse_args()
    client_rate.raise_fd_limit()
    n, size = args.bos, args.bo_size
    load_before = list(os.getloadavg())
    run_dir = tempfile.mkdtemp(prefix="vramd-bench-", dir="/tmp")
    base = tempfile.mkdtemp(prefix="vramd-bench-img-", dir=args.image_dir)
    daemon = DaemonProcess(run_dir, log_level="warning", stderr=subprocess.DEVNULL)
    whole, loop = f"/proc/{daemon.pid}/stat", f"/proc/{daemon.pid}/task/{daemon.pid}/stat"
    runs: list[dict] = []
    try:
        side = client_rate.PySide(n, size)
        try:
            with Client(daemon.socket, name="daemon_cpu.py") as c:
                for rep in range(args.reps):
                    for mode in args.modes.split(","):
                        if mode == "memfd":
                            src = [ClientBo(i + 1, fd, size=size) for i, fd in enumerate(side.memfds)]
                            dst = [ClientBo(i + 1, fd) for i, fd in enumerate(side.memfds)]
                        else:
                            src = [ClientBo(i + 1, side.mem_src, offset=side.addr + i * size, size=size)
                                   for i in range(n)]
                            dst = [ClientBo(i + 1, side.mem_dst, offset=side.addr + i * size) for i in range(n)]
                        d = tempfile.mkdtemp(dir=base)
                        dfd = os.open(d, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
                        try:
                            sessions = ((SESSION_DUMP, src, "dump"), (SESSION_RESTORE, dst, "restore"))
                            for kind, bos, direction in sessions:
                                c0, l0, t0 = cpu_of(whole), cpu_of(loop), time.perf_counter()
                                c.run_session(kind, dfd, bos)
                                runs.append({"rep": rep, "mode": mode, "direction": direction,
                                             "wall_s": time.perf_counter() - t0, "daemon_cpu_s": cpu_of(whole) - c0,
                                             "loop_cpu_s": cpu_of(loop) - l0})
                        finally:
                            os.close(dfd)
                            shutil.rmtree(d)
        finally:
            side.close()
    finally:
        daemon.stop()
        shutil.rmtree(run_dir, ignore_errors=True)
        shutil.rmtree(base, ignore_errors=True)
    summary = {}
    print(f"load average before {load_before[0]:.2f}, after {os.getloadavg()[0]:.2f} ({os.cpu_count()} cpus); "
          f"medians of {args.reps}")
    for mode in args.modes.split(","):
        for direction in ("dump", "restore"):
            rs = [r for r in runs if r["mode"] == mode and r["direction"] == direction]
            row = {k: statistics.median(r[k] for r in rs) for k in ("wall_s", "daemon_cpu_s", "loop_cpu_s")}
            summary[f"{mode} {direction}"] = row
            print(f"{mode:8s} {direction:8s} daemon CPU {row['daemon_cpu_s']:.3f} s (event loop "
                  f"{row['loop_cpu_s']:.3f} s) per {n} BOs   {n / row['wall_s']:8.0f} BOs/s")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"date": time.strftime("%Y-%m-%d"), "bos": n, "bo_size": size, "reps": args.reps,
                       "loadavg_before": load_before, "loadavg_after": list(os.getloadavg()),
                       "summary": summary, "runs": runs}, f, indent=2)
            f.write("\n")


if __name__ == "__main__":
    main()
