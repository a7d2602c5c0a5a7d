#!/usr/bin/env python3
"""MODEL NUMBERS: the intake of many one-page BOs into a dump through the SDMA backend on the SDMA model.

    .venv/bin/python bench/sdma_intake.py [--bos 10000] [--reps 4] [--tree DIR ...] [--json OUT]

Each --tree is a vramd source tree (default: this checkout) whose daemon runs from it (`python -m vramd`
with that tree as its working directory, VRAMD_AMDGPU_LIBRARY=model), so two checkouts (e.g. before and
after a change) are measured side by side in one run; the trees take turns, the order alternating from one
repetition to the next.  The BOs are memfds of one page (one inode each, as a kernel's dma-bufs), passed
with backend "sdma" to one dump session per repetition: the AddBos time (every BO, the client splitting
them into messages) and the whole session's (open to the image committed) are timed by the Python client;
medians and every repetition are printed.  The SDMA model's amdgpu_bo_import is not a hardware one.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from vramd.client import SESSION_DUMP, Client, ClientBo  # noqa: E402
from vramd.testing import DaemonProcess  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--bos", type=int, default=10000)
    ap.add_argument("--reps", type=int, default=4)
    ap.add_argument("--tree", action="append", help="a vramd source tree whose daemon is measured (repeatable)")
    ap.add_argument("--json")
    args = ap.parse_args()
    trees = [os.path.abspath(t) for t in (args.tree or [ROOT])]
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    fds = []
    for i in range(args.bos):
        fd = os.memfd_create("bo", os.MFD_CLOEXEC)
        os.ftruncate(fd, 4096)
        os.pwrite(fd, i.to_bytes(8, "little") * 512, 0)
        fds.append(fd)
    bos = [ClientBo(i + 1, fd, size=4096, backend="sdma") for i, fd in enumerate(fds)]
    runs: dict[str, list[dict[str, float]]] = {t: [] for t in trees}
    work = tempfile.mkdtemp(prefix="sdma-intake-")
    daemons = []
    try:
        for k, tree in enumerate(trees):
            run_dir = os.path.join(work, f"d{k}")
            os.mkdir(run_dir)
            # the daemon imports vramd from its working directory: the tree's (DaemonProcess runs in ROOT;
            # a shim changes directory first)
            shim = (f"import os, runpy, sys; os.chdir({tree!r}); sys.path[0] = {tree!r}; "
                    "sys.argv[:] = sys.argv[2:]; runpy.run_module('vramd', run_name='__main__', alter_sys=True)")
            d = DaemonProcess(run_dir, "--staging-budget", "256M", env={"VRAMD_AMDGPU_LIBRARY": "model"},
                              argv_prefix=[sys.executable, "-c", shim], log_level="warning")
            daemons.append(d.__enter__())
        for rep in range(args.reps):
            order = list(range(len(trees))) if rep % 2 == 0 else list(reversed(range(len(trees))))
            for k in order:
                img = os.path.join(work, f"img-{rep}-{k}")
                os.mkdir(img)
                dfd = os.open(img, os.O_RDONLY | os.O_DIRECTORY)
                try:
                    with Client(daemons[k].socket) as c:
                        t0 = time.perf_counter()
                        s = c.open_session(SESSION_DUMP, dfd)
                        t1 = time.perf_counter()
                        c.add_bos(s.token, bos)
                        t2 = time.perf_counter()
                        c.start(s.token)
                        c.wait(s.token)
                        t3 = time.perf_counter()
                        c.close_session(s.token)
                finally:
                    os.close(dfd)
                    shutil.rmtree(img)
                runs[trees[k]].append({"add_bos_s": t2 - t1, "session_s": t3 - t0})
    finally:
        for d in daemons:
            d.__exit__(None, None, None)
        shutil.rmtree(work, ignore_errors=True)
    print(f"MODEL NUMBERS (SDMA model): {args.bos} one-page BOs, {args.reps} repetitions, medians; "
          f"load average {os.getloadavg()[0]:.2f}")
    for tree, rows in runs.items():
        a = statistics.median(r["add_bos_s"] for r in rows)
        w = statistics.median(r["session_s"] for r in rows)
        print(f"{tree}: AddBos {a:.3f} s = {args.bos / a:.0f} BOs/s; whole dump session {w:.3f} s = "
              f"{args.bos / w:.0f} BOs/s; AddBos {[round(r['add_bos_s'], 3) for r in rows]}, session "
              f"{[round(r['session_s'], 3) for r in rows]}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"bos": args.bos, "runs": runs}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
