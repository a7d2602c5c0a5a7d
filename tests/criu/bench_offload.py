"""Restore wall time of a real `criu restore` with a vramd restore offloaded or not.

    CRIU_SRC=... CRIU_BIN=... VRAMD_CLIENT_INC=... VRAMD_CLIENT_LIBDIR=... \\
        .venv/bin/python tests/criu/bench_offload.py [--mem-mib 1024] [--vram-mib 1024] [--bos 4] [--runs 5]

One workload holding --mem-mib of patterned memory is dumped once; one vramd
image of --bos memfd BOs (--vram-mib in all, random bytes, no compression) is
made once.  Then every round restores the workload once per mode, modes in
rotating order, with the test plugin doing:

  none     no vramd work (CRIU alone)
  offload  vramd restore started in POST_FORKING, waited for in RESUME_DEVICES_LATE
  sync     started and waited for in POST_FORKING (the forked root task keeps
           restoring its memory meanwhile)
  serial   started and waited for in RESUME_DEVICES_LATE (after all memory: no overlap)
  task     submitted by the restored task in RESTORE_EXT_FILE (the workload keeps
           --ext-dev open), waited for by CRIU main in RESUME_DEVICES_LATE

A first round checks everything (the workload's memory and the BOs' SHA-256);
the timed rounds skip the BO digest (it would add the same time to every vramd
mode) but still check the workload afterwards.  Prints every run and the
medians; --json FILE writes them.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from criu_harness import Env, Rig, build, hooks, keep_notify_drained, make_vramd_image, read_log  # noqa: E402

MODES = ["none", "offload", "sync", "serial"]


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process and its threads."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def children_cpu() -> float:
    """CPU of our reaped children: criu (the restored task is not ours; init reaps it)."""
    import resource
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def phases(log: str) -> dict:
    """Seconds between the plugin's log lines of one restore."""
    ev = read_log(log)
    at = {}
    for e in ev:
        key = e.what.split()[0] if e.what.startswith(("hook=", "init", "exit")) else None
        # CLOCK_REALTIME: the restored task's CLOCK_MONOTONIC is in a time namespace of its own
        if key and key not in at:
            at[key] = e.real
        if e.what.startswith("vramd: waited in"):
            at["waited"] = e.real
        if "FAIL" in e.what:
            raise RuntimeError(f"plugin failure: {e.what}")
    out = {"restore_init_to_resume_late": at["hook=RESUME_DEVICES_LATE"] - at["hook=RESTORE_INIT"],
           "post_forking_to_resume_late": at["hook=RESUME_DEVICES_LATE"] - at["hook=POST_FORKING"],
           "init_to_exit": at["exit"] - at["init"]}
    if "waited" in at:
        out["post_forking_to_vramd_done"] = at["waited"] - at["hook=POST_FORKING"]
    assert [h for h in hooks(ev) if h != "RESTORE_EXT_FILE"] == ["init", "RESTORE_INIT", "POST_FORKING",
                                                                 "RESUME_DEVICES_LATE", "exit"], hooks(ev)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mem-mib", type=int, default=1024)
    ap.add_argument("--vram-mib", type=int, default=1024)
    ap.add_argument("--bos", type=int, default=4)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--api", choices=["client", "criu"], default="client",
                    help="client.h calls on one connection, or criu.h's submit + barrier")
    ap.add_argument("--ext-dev", default="/dev/loop-control",
                    help="device the workload keeps open, for mode task ('' or missing: no task mode)")
    ap.add_argument("--work", help="working directory (default: a new one under /var/tmp, removed after)")
    ap.add_argument("--json")
    args = ap.parse_args()

    env = Env()
    why = env.missing() or (None if env.has_libvramd() else "set VRAMD_CLIENT_INC and VRAMD_CLIENT_LIBDIR")
    if why:
        print(f"bench_offload: {why}", file=sys.stderr)
        return 2

    from vramd.testing import DaemonProcess

    work = args.work or tempfile.mkdtemp(prefix="vramd-criu-bench-", dir="/var/tmp")
    os.makedirs(work, exist_ok=True)
    run_dir = tempfile.mkdtemp(prefix="vramd-cb", dir="/tmp")  # short: sun_path is 108 bytes
    device = args.ext_dev if args.ext_dev and os.path.exists(args.ext_dev) else None
    modes = MODES + (["task"] if device else [])
    results: dict = {"args": vars(args), "runs": {m: [] for m in modes}}
    try:
        libdir, workload = build(env, os.path.join(work, "build"), with_vramd=True)
        with open(os.path.join(work, "vramd.log"), "w") as dlog:
            daemon = DaemonProcess(run_dir, "--grace-period", "5", stderr=dlog)
            keep_notify_drained(daemon)
            try:
                sizes = [(args.vram_mib << 20) // args.bos] * args.bos
                image = make_vramd_image(daemon.socket, os.path.join(work, "vramd-img"), sizes)
                rig = Rig.dumped(env, work, libdir, workload, args.mem_mib, os.path.join(work, "dump.log"),
                                 device=device)
                print(f"vramd image: {args.bos} x {sizes[0] >> 20} MiB in {image.seconds:.1f} s; "
                      f"criu dump of {args.mem_mib} MiB: {rig.dump_wall:.2f} s", flush=True)
                for rnd in range(args.runs + 1):
                    checked = rnd == 0
                    order = modes[rnd % len(modes):] + modes[:rnd % len(modes)]
                    for mode in order:
                        log = os.path.join(work, f"r{rnd}-{mode}.log")
                        penv = image.plugin_env(daemon.socket, "off" if mode == "none" else mode, verify=checked,
                                                api=args.api)
                        d0, c0 = cpu_seconds(daemon.pid), children_cpu()
                        try:
                            wall = rig.restore(log, penv)
                            cpu = {"daemon_cpu": cpu_seconds(daemon.pid) - d0, "criu_cpu": children_cpu() - c0,
                                   "load1": os.getloadavg()[0]}
                            ok = rig.workload.check()
                        finally:
                            rig.workload.kill_restored()
                        if ok != f"ok {rig.workload.pid}":
                            raise RuntimeError(f"{mode}: restored workload says {ok!r}")
                        ph = phases(log)
                        if checked and mode != "none":
                            with open(log) as f:
                                text = f.read()
                            if f"verify OK sha256={image.sha256}" not in text:
                                raise RuntimeError(f"{mode}: BO digest not verified:\n{text}")
                        print(f"{'check' if checked else 'run ' + str(rnd)} {mode:8s} criu wall {wall:.3f} s  " +
                              "  ".join(f"{k} {v:.3f}" for k, v in ph.items()), flush=True)
                        ph.update(cpu)
                        if not checked:
                            results["runs"][mode].append({"wall": wall, **ph})
            finally:
                daemon.stop()
        print("\nmedians over", args.runs, "runs (criu restore wall time, s):")
        results["median_wall"] = {}
        for mode in modes:
            walls = [r["wall"] for r in results["runs"][mode]]
            med = statistics.median(walls)
            results["median_wall"][mode] = med
            print(f"  {mode:8s} median {med:.3f}   runs " + " ".join(f"{w:.3f}" for w in walls))
        print("medians of the other measures (s; load1 is the 1-minute load average after the run):")
        keys = sorted({k for m in modes for r in results["runs"][m] for k in r if k != "wall"})
        for mode in modes:
            rs = results["runs"][mode]
            print(f"  {mode:8s} " + "  ".join(f"{k} {statistics.median(r[k] for r in rs):.3f}"
                                             for k in keys if all(k in r for r in rs)))
        if args.json:
            with open(args.json, "w") as f:
                json.dump(results, f, indent=1)
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
        if not args.work:
            shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
