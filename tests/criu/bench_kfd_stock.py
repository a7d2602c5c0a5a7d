"""MODEL NUMBERS, NOT HARDWARE NUMBERS: CRIU's stock amdgpu plugin dumping and restoring an
emulated GPU process on the KFD + SDMA models (docs/kfd-model.md).  The baseline a vramd
plugin is measured against on the same models.

    CRIU_SRC=... CRIU_BIN=... .venv/bin/python tests/criu/bench_kfd_stock.py [--mib-per-gpu 1024] [--runs 3]

The workload holds --mib-per-gpu on each of 2 GPUs and forks a child with its own KFD process and
4 MiB of BOs per GPU (a process tree: the plugin's parallel restore cannot take BOs on 2 GPUs in one
process, docs/kfd-model.md), so the restore copies run in the restored tasks, one thread per GPU.
Each run: criu dump, criu restore, both processes check every byte.  Reported per run: wall and
CPU (user+sys of criu and the children it waited for, from /usr/bin/time: at restore that leaves
out the restored tasks, where the plugin's copies run) of dump and restore, and the plugin's
share of the wall time: the span of its BO copies in CRIU's own log (dump: the first "Dumping N
BOs" .. the last "Dumped bos ok"; restore: the first "Thread[..] started" .. the last
"Thread[..] finished").  SDMA model family VI (130).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import statistics
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import test_kfd_stock_plugin as t
from kfd_harness import Model

TIMED = " /usr/bin/time -f 'time: %e %U %S' -o $W/time-$1 "
STAMP = re.compile(r"^\((\d+\.\d+)\)")


def _span(log: str, start: str, end: str) -> float:
    times = [(float(m.group(1)), line) for line in log.splitlines() if (m := STAMP.match(line))]
    first = min(ts for ts, line in times if start in line)
    last = max(ts for ts, line in times if end in line)
    return last - first


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib-per-gpu", type=int, default=1024)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--json")
    args = ap.parse_args()
    if t.ENV.missing():
        print(t.ENV.missing(), file=sys.stderr)
        return 2
    work = tempfile.mkdtemp(prefix="kfd-bench-")  # not under /dev: the namespace replaces /dev
    # a bench stopped by a timeout or ^C still removes its work directory (SIGTERM's default
    # action skips the finally below; two such directories were found left in /dev/shm)
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, lambda signum, frame: sys.exit(128 + signum))
    try:
        return _bench(work, args)
    finally:
        shutil.rmtree(work, ignore_errors=True)  # the arenas and the images: GiBs


def _bench(work: str, args: argparse.Namespace) -> int:
    model = Model(os.path.join(work, "build"))
    t.MIB = args.mib_per_gpu
    dump = t.DUMP.replace("-g $GPUS", "-g $GPUS -c")
    dump = dump.replace("\n$CRIU dump", "\n" + TIMED.replace("$1", "dump").strip() + " $CRIU dump")
    restore = t.RESTORE.replace("\n$CRIU restore", "\n" + TIMED.replace("$1", "restore").strip() + " $CRIU restore")
    rows = []
    for i in range(args.runs):
        case = t.Case(model, os.path.join(work, f"run{i}"))
        state = case.state("state", t.TOPO_A)
        d = case.run(dump, state, t.TOPO_A, gpus=2)
        if d.get("dump") != "0":
            print(d["stdout"][-2000:], d["stderr"][-2000:], file=sys.stderr)
        r = case.run(restore, state, t.TOPO_A, gpus=2)
        want = d["checks"]                       # "ok <BOs> <bytes>; child ok <BOs> <bytes>" before the dump
        if d.get("dump") != "0" or r.get("restore") != "0" or r["checks"] != want or \
                not want.startswith("ok ") or not want.split(";")[0].endswith(f" {2 * args.mib_per_gpu << 20}") or \
                "; child ok " not in want:
            print(f"run {i} failed: dump {d.get('dump')} restore {r.get('restore')} checks {r['checks']!r}",
                  file=sys.stderr)
            return 1
        row = {}
        for what, log, a, b in (("dump", "dump.log", "amdgpu_plugin: Dumping ", "Dumped bos ok"),
                                ("restore", "restore.log", "] started", "] finished ret:0")):
            with open(os.path.join(case.work, f"time-{what}")) as f:
                wall, user, sys_ = map(float, f.read().split("time:")[1].split())
            row[what] = {"wall_s": wall, "cpu_s": user + sys_, "plugin_copy_s": _span(case.log(log), a, b)}
        rows.append(row)
        shutil.rmtree(case.work)
        print(f"run {i}: " + "  ".join(f"{w} wall {v['wall_s']:.2f} s cpu {v['cpu_s']:.2f} s plugin copies "
                                       f"{v['plugin_copy_s']:.2f} s" for w, v in row.items()))
    med = {w: {k: statistics.median(r[w][k] for r in rows) for k in rows[0][w]} for w in ("dump", "restore")}
    print(f"MODEL NUMBERS (KFD + SDMA models, not a GPU): 2 x {args.mib_per_gpu} MiB, median of {args.runs}: "
          + "  ".join(f"{w}: wall {v['wall_s']:.2f} s, cpu {v['cpu_s']:.2f} s, "
                      f"plugin copies {v['plugin_copy_s']:.2f} s "
                      f"({100 * v['plugin_copy_s'] / v['wall_s']:.0f}% of wall)" for w, v in med.items()))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"runs": rows, "median": med, "mib_per_gpu": args.mib_per_gpu}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
