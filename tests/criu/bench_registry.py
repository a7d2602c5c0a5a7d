"""MODEL NUMBERS, NOT HARDWARE NUMBERS: restoring a CRIU checkpoint whose BO contents are in a registry, with
the vramd-patched amdgpu plugin (contrib/criu) on the KFD + SDMA models inside a real CRIU, against the real
registry (Debian's docker-registry on 127.0.0.1, plain HTTP, filesystem storage on /tmp).

    CRIU_SRC=... CRIU_BIN=... .venv/bin/python tests/criu/bench_registry.py [--mib-per-gpu 1024] [--runs 3]
        [--json OUT]

One process holding 2 GPUs x --mib-per-gpu of BOs is dumped once (KFD_VRAMD=1) and its vramd image pushed
(`vramctl push`, timed for information).  Then, --runs times, alternating which goes first:
  (a) `criu restore` from the images directory as the dump left it (the vramd image local);
  (c) the vramd image removed, `vramctl pull REF IMAGES/amdgpu-vramd-<id>` (this is (b), timed on its own:
      wall, and vramctl's and the registry's CPU), then `criu restore` (sequential: (c) = (b) + its restore).
Each restore is onto a fresh model state and checked byte by byte by the workload.  (d), the pull
overlapped with CRIU's restore, the plugin's copy waiting for the pull's commit: what such an overlap can
save is the part of criu's restore before the restored task needs the image (its RESTORE_EXT_FILE, whose
first line "Initialized kfd plugin restorer" CRIU stamps): "d_bound" = max(pull, that part) + the rest of
(c)'s restore, from its own log; a bound computed from measured parts, not a run (the plugin has no such
wait).  "stream_bound" = max(pull, (c)'s restore): what a restore fed by the pull as it downloads could
reach at best.
  (e) the vramd image removed, `vramctl pull --serve REF IMAGES/amdgpu-vramd-<id>` (each back once it
      listens; its server downloads on), then `criu restore` streaming from the servers (patch 0007): its wall
      is the serve commands' plus criu's; also when the last server ended (its files whole) and the servers'
      CPU (their rusage, as the reaper of the orphaned servers) and the registry's.
The three flows run in a rotating order per run (ace, cea, eac, ...).
Per restore: wall and CPU of criu (/usr/bin/time), CPU of the daemon (/proc) and of the restored task; CPU
s/GiB of the BO bytes.  The daemon's CPU includes the SDMA model's copying (CPU threads; an engine's is not).
Exit status 2 when CRIU_SRC / CRIU_BIN / libvramd / root are missing (nothing run).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench_plugins as bp
import test_kfd_stock_plugin as t
import test_kfd_vramd_plugin as v
from kfd_harness import REPO, Model
from test_kfd_stock_plugin import TOPO_A

from vramd.testing.registry import Registry

TIMED = ["/usr/bin/time", "-f", "time: %e %U %S"]
KFD_IMG = re.compile(r"^amdgpu-kfd-(\d+)\.img$")
PRE = "amdgpu_plugin: Initialized kfd plugin restorer"


class BenchError(RuntimeError):
    pass


def registry_pid() -> int:
    """The docker-registry this process started (a child of ours), for its CPU."""
    me = os.getpid()
    for task in os.listdir(f"/proc/{me}/task"):
        with open(f"/proc/{me}/task/{task}/children") as f:
            for pid in map(int, f.read().split()):
                with open(f"/proc/{pid}/comm") as c:
                    if c.read().strip() == "docker-registry":
                        return pid
    raise BenchError("no docker-registry child found")


def vramctl_timed(*args: str) -> dict[str, float]:
    """`vramctl ARGS` under /usr/bin/time: wall, CPU (user+sys) of vramctl."""
    r = subprocess.run([*TIMED, sys.executable, "-m", "vramd.cli", *args], capture_output=True, text=True,
                       cwd=str(REPO))
    if r.returncode:
        raise BenchError(f"vramctl {args[0]} failed: {r.stderr.strip()}")
    wall, user, sys_ = map(float, r.stderr.rsplit("time:", 1)[1].split())
    return {"wall_s": wall, "cpu_s": user + sys_}


def restore(case: v.VCase, daemon, env: dict[str, str], expect: str) -> dict[str, float]:
    state = os.path.join(case.work, "state")  # the workload maps a file of it: the dump's path, a fresh state
    shutil.rmtree(state, ignore_errors=True)
    case.model.create_state(state, TOPO_A)
    d0 = bp.proc_cpu(daemon.pid)
    r = case.run(bp.BENCH_RESTORE, state, TOPO_A, gpus=2, extra=env)
    d1 = bp.proc_cpu(daemon.pid)
    log = case.log("restore.log")
    if r.get("restore") != "0":
        errors = [ln for ln in log.splitlines() if "Error (" in ln and "RLIMIT_NOFILE" not in ln] or [log[-300:]]
        tail = "\n".join(errors[-6:])
        raise BenchError(f"criu restore failed ({r.get('restore')}): {tail}\n{r['stdout'][-1000:]}")
    with open(os.path.join(case.work, "time-restore")) as f:
        wall, user, sys_ = map(float, f.read().split("time:")[1].split())
    pre = bp._ts(log, PRE)
    if pre is None:
        raise BenchError("no RESTORE_EXT_FILE stamp in restore.log")
    return {"wall_s": wall, "criu_cpu_s": user + sys_, "daemon_cpu_s": d1 - d0,
            "task_cpu_s": int(r.get("taskcpu", "0")) / bp.TICK, "before_ext_file_s": pre,
            "byte_exact": r["checks"].strip() == expect}


def pull(reg: Registry, img: str, ids: list[str]) -> dict[str, float]:
    r0 = bp.proc_cpu(reg_pid := registry_pid())
    out = {"wall_s": 0.0, "cpu_s": 0.0}
    for i in ids:
        vdir = os.path.join(img, f"amdgpu-vramd-{i}")
        shutil.rmtree(vdir)
        got = vramctl_timed("pull", f"{reg.host}/bench/ckpt:1-{i}", vdir, "--plain-http")
        out["wall_s"] += got["wall_s"]
        out["cpu_s"] += got["cpu_s"]
    out["registry_cpu_s"] = bp.proc_cpu(reg_pid) - r0
    return out


def served(case: v.VCase, daemon, env: dict[str, str], expect: str, reg: Registry, img: str,
           ids: list[str]) -> dict[str, float]:
    """(e): the serve commands (wall and CPU until each listens), criu restore streaming from the servers, then
    the servers' end and CPU (wait4: they are orphans of ours, the harness making this process a subreaper)."""
    r0 = bp.proc_cpu(reg_pid := registry_pid())
    out = {"ready_wall_s": 0.0, "ready_cpu_s": 0.0}
    pids = []
    t0 = time.monotonic()
    timing = os.path.join(case.work, "time-serve")
    for i in ids:
        vdir = os.path.join(img, f"amdgpu-vramd-{i}")
        shutil.rmtree(vdir)
        with open(os.path.join(case.work, "serve.err"), "a") as err:
            r = subprocess.run(["/usr/bin/time", "-o", timing, "-f", "time: %e %U %S", sys.executable, "-m",
                                "vramd.cli", "pull", "--serve", f"{reg.host}/bench/ckpt:1-{i}", vdir, "--plain-http"],
                               stdout=subprocess.PIPE, stderr=err, text=True, cwd=str(REPO))
        m = re.search(r"\(pid (\d+)\)", r.stdout)
        if r.returncode or not m:
            raise BenchError(f"vramctl pull --serve failed: {r.stdout}")
        pids.append(int(m[1]))
        with open(timing) as f:
            wall, user, sys_ = map(float, f.read().split("time:")[1].split())
        out["ready_wall_s"] += wall
        out["ready_cpu_s"] += user + sys_
    out.update(restore(case, daemon, env, expect))
    out["serve_cpu_s"] = 0.0
    for pid in pids:
        _pid, status, usage = os.wait4(pid, 0)
        if os.waitstatus_to_exitcode(status):
            raise BenchError(f"a server failed: {Path(case.work, 'serve.err').read_text()[-2000:]}")
        out["serve_cpu_s"] += usage.ru_utime + usage.ru_stime
    out["files_whole_s"] = time.monotonic() - t0
    out["registry_cpu_s"] = bp.proc_cpu(reg_pid) - r0
    out["e_wall_s"] = out["ready_wall_s"] + out["wall_s"]
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib-per-gpu", type=int, default=1024)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--json")
    args = ap.parse_args()
    why = v.ENV.missing() or (
        None if v.ENV.has_libvramd() else "needs libvramd (VRAMD_CLIENT_INC, VRAMD_CLIENT_LIBDIR)"
    )
    if why:
        print(f"bench_registry: not run: {why}", file=sys.stderr)
        return 2
    work = tempfile.mkdtemp(prefix="registry-bench-")
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, lambda signum, frame: sys.exit(128 + signum))
    load = [os.getloadavg()]
    runs: list[dict] = []
    try:
        so = bp.build_vramd_plugin(os.path.join(work, "src"))
        model = Model(os.path.join(work, "build"))
        t.MIB = args.mib_per_gpu  # the scripts read $MIB from the module's constant
        case = v.VCase(model, os.path.join(work, "case"))
        case.use(so)
        img = os.path.join(case.work, "img")
        with Registry(Path(work) / "registry") as reg, v.running_daemon() as daemon:
            env = case.env(daemon.socket, KFD_VRAMD="1")
            state = case.state("state", TOPO_A)
            d = case.run(bp.BENCH_DUMP, state, TOPO_A, gpus=2, extra={**env, "WL_OPTS": ""})
            if d.get("dump") != "0":
                raise BenchError("criu dump failed:\n" + case.log("dump.log")[-2000:])
            expect = d["checks"].strip()
            ids = sorted(m[1] for n in os.listdir(img) if (m := KFD_IMG.match(n)))
            nbytes = int(expect.split()[2])
            push = {"wall_s": 0.0, "cpu_s": 0.0}
            for i in ids:
                got = vramctl_timed("push", os.path.join(img, f"amdgpu-vramd-{i}"), f"{reg.host}/bench/ckpt:1-{i}",
                                    "--plain-http", "--cache", os.path.join(work, "push-cache"))
                push = {k: push[k] + got[k] for k in push}
            print(f"dumped {nbytes} bytes of BOs ({len(ids)} KFD file(s)); push {push['wall_s']:.2f} s", flush=True)
            for n in range(args.runs):
                row: dict = {"order": ("ace", "cea", "eac")[n % 3]}
                for what in row["order"]:
                    if what == "c":
                        row["b"] = pull(reg, img, ids)
                    if what == "e":
                        row["e"] = served(case, daemon, env, expect, reg, img, ids)
                    else:
                        row[what] = restore(case, daemon, env, expect)
                a, b, c = row["a"], row["b"], row["c"]
                row["c_wall_s"] = b["wall_s"] + c["wall_s"]
                row["d_bound_s"] = max(b["wall_s"], c["before_ext_file_s"]) + c["wall_s"] - c["before_ext_file_s"]
                row["stream_bound_s"] = max(b["wall_s"], c["wall_s"])
                runs.append(row)
                print(f"run {n}: (a) {a['wall_s']:.2f} s  (b) {b['wall_s']:.2f} s  (c) {row['c_wall_s']:.2f} s  "
                      f"(d) <= {row['d_bound_s']:.2f} s  stream >= {row['stream_bound_s']:.2f} s  (e) "
                      f"{row['e']['e_wall_s']:.2f} s", flush=True)
            load.append(os.getloadavg())
    finally:
        shutil.rmtree(work, ignore_errors=True)
    report(runs, nbytes, push, load, args)
    return 0


def report(runs: list[dict], nbytes: int, push: dict, load: list, args: argparse.Namespace) -> None:
    gib = nbytes / (1 << 30)

    def med(f) -> float:
        return statistics.median(f(r) for r in runs)

    def cpu(m: dict) -> float:
        return m["criu_cpu_s"] + m["daemon_cpu_s"] + m["task_cpu_s"]

    rows = [
        ("(a) criu restore, image local", med(lambda r: r["a"]["wall_s"]), med(lambda r: cpu(r["a"]))),
        ("(b) vramctl pull", med(lambda r: r["b"]["wall_s"]), med(lambda r: r["b"]["cpu_s"])),
        ("(b) the registry's CPU during it", None, med(lambda r: r["b"]["registry_cpu_s"])),
        ("(c) pull, then criu restore", med(lambda r: r["c_wall_s"]),
         med(lambda r: r["b"]["cpu_s"] + r["b"]["registry_cpu_s"] + cpu(r["c"]))),
        ("(c) its criu restore alone", med(lambda r: r["c"]["wall_s"]), med(lambda r: cpu(r["c"]))),
        ("(d) overlap bound (not run)", med(lambda r: r["d_bound_s"]), None),
        ("streamed bound (not run)", med(lambda r: r["stream_bound_s"]), None),
        ("(e) pull --serve, criu restore streaming", med(lambda r: r["e"]["e_wall_s"]),
         med(lambda r: r["e"]["ready_cpu_s"] + r["e"]["serve_cpu_s"] + r["e"]["registry_cpu_s"] + cpu(r["e"]))),
        ("(e) its criu restore alone", med(lambda r: r["e"]["wall_s"]), med(lambda r: cpu(r["e"]))),
        ("(e) the servers' CPU (vramctl)", None, med(lambda r: r["e"]["ready_cpu_s"] + r["e"]["serve_cpu_s"])),
        ("(e) until the servers ended (files whole)", med(lambda r: r["e"]["files_whole_s"]), None),
    ]
    print(f"MODEL NUMBERS (KFD + SDMA models, not a GPU); {gib:.2f} GiB of BOs; median of {len(runs)} runs, (a), "
          f"(c) and (e) rotating; load average {load[0][0]:.2f} before, {load[-1][0]:.2f} after; push "
          f"{push['wall_s']:.2f} s wall, {push['cpu_s']:.2f} s CPU")
    print("| step | wall s | GB/s | CPU s | CPU s/GiB |\n|---|---|---|---|---|")
    for name, wall, c in rows:
        print(f"| {name} | {'' if wall is None else f'{wall:.2f}'} | "
              f"{'' if wall is None else f'{nbytes / wall / 1e9:.2f}'} | {'' if c is None else f'{c:.2f}'} | "
              f"{'' if c is None else f'{c / gib:.2f}'} |")
    print(f"RESTORE_EXT_FILE reached at {med(lambda r: r['c']['before_ext_file_s']):.3f} s of criu's restore "
          f"(median); every restore byte-exact: {all(r[k]['byte_exact'] for r in runs for k in ('a', 'c', 'e'))}")
    if args.json:
        commit = subprocess.run(["git", "-C", v.ENV.criu_src or "", "rev-parse", "--short=9", "HEAD"],
                                capture_output=True, text=True).stdout.strip()
        with open(args.json, "w") as f:
            json.dump({"what": "MODEL NUMBERS: KFD + SDMA models, not a GPU", "criu": commit,
                       "utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()), "cores": os.cpu_count(),
                       "mib_per_gpu": args.mib_per_gpu, "bytes": nbytes, "load": load, "push": push, "runs": runs},
                      f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
