"""MODEL NUMBERS, NOT HARDWARE NUMBERS: CRIU's stock amdgpu plugin against the same plugin with
vramd's patch series (contrib/criu), head to head on the same emulated GPU process (KFD + SDMA
models, docs/kfd-model.md), inside a real CRIU.

    CRIU_SRC=... CRIU_BIN=... .venv/bin/python tests/criu/bench_plugins.py [--mib-per-gpu 1024]
        [--small-bos 10000] [--runs 2] [--shapes disk,tmpfs,tree,small] [--json OUT]

Shapes: `disk` one process, 2 GPUs x --mib-per-gpu, the image on disk; `tmpfs` the same with the
image (and the model's arenas) on a tmpfs the bench mounts; `tree` a parent and a child, each
its own KFD process with BOs on both GPUs (the stock plugin restores in the tasks); `small` the
tree on one GPU, the parent with --small-bos one-page BOs (plus 1 MiB of sized ones; one process
of 10,005 BOs fails the stock plugin's offloaded restore, so a tree).  A criu command that fails
is reported (its first error line) and the other plugin's numbers still come.  Each run of a shape
runs both plugins, the order alternating run by run, so every ratio comes from one invocation.
Per side and per criu command: wall and CPU of criu (user+sys of criu and the children it
waited for, /usr/bin/time), CPU of the restored tasks (/proc/<pid>/stat of the tree, read
before the workload checks its bytes), CPU of the daemon (its /proc/<pid>/stat before and
after), the image's bytes, and the model's copying: the CPU time the SDMA model's engine threads
spent in their copies, wherever they ran (criu, the tasks, the daemon), from the model's copy log
(VRAMD_SDMA_MODEL_COPY_LOG, docs/sdma-model.md): the model copies with CPU threads, an engine
would not, so the "hw" column subtracts it.  Every restore is checked byte by byte by the workload.
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

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import test_kfd_stock_plugin as t
import test_kfd_vramd_plugin as v
from bench_plugins_report import table, verdicts
from kfd_harness import Model
from test_kfd_stock_plugin import DUMP, RESTORE, TOPO_A

GIB = 1 << 30
TICK = os.sysconf("SC_CLK_TCK")
STAMP = re.compile(r"^\((\d+\.\d+)\)")
CPU = r"""
taskcpu() {  # utime+stime (ticks) of the task and its children, exited threads included
    t=0; for p in $1 $(cat /proc/$1/task/*/children 2>/dev/null); do
        t=$((t + $(awk '{sub(/.*\) /, ""); print $12 + $13}' /proc/$p/stat))); done; echo "taskcpu: $t"; }
"""
TIMED = "/usr/bin/time -f 'time: %e %U %S' -o $W/time-{0} $CRIU {0}"
BENCH_DUMP = (
    DUMP.replace("-g $GPUS", "-g $GPUS $WL_OPTS")
    .replace("$CRIU dump", TIMED.format("dump"))
    .replace("rm -rf $W/img $W/ready; mkdir -p $W/img", "rm -rf $W/img/* $W/ready; mkdir -p $W/img")
)
BENCH_RESTORE = CPU + RESTORE.replace("$CRIU restore", TIMED.format("restore")).replace(
    'if $live; then echo "alive: yes"; check $pid;', 'if $live; then echo "alive: yes"; taskcpu $pid; check $pid;'
)
assert BENCH_DUMP != DUMP and "taskcpu $pid" in BENCH_RESTORE and "$W/time-restore" in BENCH_RESTORE


class BenchError(RuntimeError):
    pass


def proc_cpu(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def copies_since(path: str, offset: int, daemon_pid: int) -> tuple[int, dict[str, float], int]:
    """The SDMA model's copy log (VRAMD_SDMA_MODEL_COPY_LOG) from offset on: (its new end, CPU seconds its
    engine threads spent copying, split into the daemon's and the rest's (criu and its tasks), bytes copied)."""
    try:
        with open(path) as f:
            f.seek(offset)
            text = f.read()
    except FileNotFoundError:
        return offset, {"daemon": 0.0, "criu+tasks": 0.0}, 0
    out = {"daemon": 0.0, "criu+tasks": 0.0}
    nbytes = 0
    for line in text.splitlines():
        pid, n, ns = map(int, line.split())
        out["daemon" if pid == daemon_pid else "criu+tasks"] += ns / 1e9
        nbytes += n
    return offset + len(text.encode()), out, nbytes


def hash_s_per_gib(mib: int = 256) -> float:
    """The image format's own hashing at dump (BLAKE3 + xxh3-64 of each chunk), CPU s/GiB."""
    import blake3
    import xxhash

    buf = os.urandom(mib << 20)
    t0 = time.process_time()
    for off in range(0, len(buf), 8 << 20):
        chunk = memoryview(buf)[off : off + (8 << 20)]
        blake3.blake3(chunk).digest()
        xxhash.xxh3_64_digest(chunk)
    return (time.process_time() - t0) * 1024 / mib


def build_vramd_plugin(out: str) -> str:
    """The series applied to a copy of CRIU_SRC (`git apply --check` first) and the plugin built
    there against this checkout's libvramd, as test_kfd_vramd_plugin.py builds it."""
    os.makedirs(out)
    src = os.path.join(out, "criu")
    subprocess.run(["cp", "-a", v.ENV.criu_src or "", src], check=True)
    for patch in v.series():
        subprocess.run(["git", "apply", "--check", patch], cwd=src, check=True, capture_output=True)
        subprocess.run(["git", "apply", patch], cwd=src, check=True, capture_output=True)
    env = {**os.environ, "PKG_CONFIG_PATH": os.path.join(v.ENV.vramd_libdir or "", "meson-uninstalled")}
    so = os.path.join(src, "plugins", "amdgpu", "amdgpu_plugin.so")
    if os.path.exists(so):
        os.unlink(so)
    r = subprocess.run(["make", "-C", src, "amdgpu_plugin"], env=env, capture_output=True, text=True)
    if r.returncode:
        raise BenchError(f"make amdgpu_plugin failed ({r.returncode}):\n{r.stdout[-2000:]}{r.stderr[-2000:]}")
    return so


SHAPES = {
    "disk": {"gpus": 2, "tree": False, "small": False, "tmpfs": False},
    "tmpfs": {"gpus": 2, "tree": False, "small": False, "tmpfs": True},
    "tree": {"gpus": 2, "tree": True, "small": False, "tmpfs": False},
    # a tree: with one process of 10,005 BOs the stock plugin's offloaded restore fails ("Recv dmabuf fds fail":
    # it passes every BO's dmabuf fd to CRIU main over a unix socket); in a tree it restores in the tasks
    "small": {"gpus": 1, "tree": True, "small": True, "tmpfs": False},
}


def _ts(log: str, needle: str, last: bool = False) -> float | None:
    hits = [float(m.group(1)) for line in log.splitlines() if needle in line and (m := STAMP.match(line))]
    return (max(hits) if last else min(hits)) if hits else None


def _stages(side: str, what: str, log: str) -> dict[str, float]:
    """Where the wall time went, from CRIU's own log stamps (seconds since criu started): the BO copy runs
    from the plugin's last line before it (the same on both sides: "Dumped devices Ok" at dump, the first
    "Restore BOs Ok" at restore) to its last copy line (stock: "Dumped bos ok", its restore threads'
    "finished"; vramd: "Dumped bos ok", CRIU main's "restore of task N done")."""
    a = "amdgpu_plugin: Dumped devices Ok" if what == "dump" else "amdgpu_plugin: Restore BOs Ok"
    b = "Dumped bos ok" if what == "dump" else ("] finished ret:0" if side == "stock" else "vramd: restore of task ")
    t0, t1 = _ts(log, a), _ts(log, b, last=True)
    if t0 is None or t1 is None:
        return {}
    out = {"before_copy_s": t0, "copy_s": t1 - t0}
    if side == "vramd" and what == "restore":  # CRIU main idle at the barrier: its last line before "done"
        stamps = [
            float(m.group(1))
            for line in log.splitlines()
            if (m := STAMP.match(line)) and "vramd: restore of task" not in line and float(m.group(1)) <= t1
        ]
        out["barrier_wait_s"] = t1 - max(stamps) if stamps else 0.0
    return out


def _img_bytes(img: str) -> tuple[int, int]:
    total = gpu = 0
    for root, _, files in os.walk(img):
        for n in files:
            if n.endswith(".log"):
                continue
            size = os.path.getsize(os.path.join(root, n))
            total += size
            if n.startswith("amdgpu-pages") or "amdgpu-vramd-" in root:
                gpu += size
    return total, gpu


def one(side: str, shape: dict, case: v.VCase, daemon, wl_opts: str, copy_log: str) -> dict:
    state = case.state(f"state-{side}", TOPO_A)
    env = {
        "WL_OPTS": wl_opts,
        "VRAMD_SDMA_MODEL_COPY_LOG": copy_log,
        **(case.env(daemon.socket) if side == "vramd" else {}),
    }
    row: dict = {}
    for what, script in (("dump", BENCH_DUMP), ("restore", BENCH_RESTORE)):
        d0 = proc_cpu(daemon.pid)
        start, _, _ = copies_since(copy_log, 0, daemon.pid)
        r = case.run(script, state, TOPO_A, gpus=shape["gpus"], extra=env)
        d1 = proc_cpu(daemon.pid)
        _, copies, copied = copies_since(copy_log, start, daemon.pid)
        log = case.log(f"{what}.log")
        if r.get(what) != "0":  # reported, not fatal: the other plugin's numbers still come
            errors = [ln.split(": ", 1)[-1] for ln in log.splitlines() if "Error (" in ln] or [log[-300:]]
            row[what] = {"failed": f"criu {what} exit {r.get(what)}: {errors[0]}"}
            row.setdefault("expect", r["checks"].strip())
            break
        with open(os.path.join(case.work, f"time-{what}")) as f:
            wall, user, sys_ = map(float, f.read().split("time:")[1].split())
        m = {
            "wall_s": wall,
            "criu_cpu_s": user + sys_,
            "daemon_cpu_s": d1 - d0,
            "task_cpu_s": int(r.get("taskcpu", "0")) / TICK if what == "restore" else 0.0,
            "model_copy_cpu_s": copies["daemon"] + copies["criu+tasks"],
            "model_copy_daemon_cpu_s": copies["daemon"],
            "model_copied_bytes": copied,
            "checks": r["checks"].strip(),
            **_stages(side, what, log),
        }
        if what == "dump":
            m["image_bytes"], m["gpu_image_bytes"] = _img_bytes(os.path.join(case.work, "img"))
            row["expect"] = m["checks"]
        row[what] = m
    if "failed" in row.get("restore", {"failed": ""}):
        row.setdefault("restore", {"failed": "not run: the dump failed"})
        row["restore"]["byte_exact"] = False
    else:
        row["restore"]["byte_exact"] = row["restore"]["checks"] == row["expect"] and row["expect"].startswith("ok ")
    shutil.rmtree(state)
    return row


def run_shape(name: str, args, model: Model, plugins: dict[str, str], daemon, work: str) -> dict:
    shape = SHAPES[name]
    mib = 1 if shape["small"] else args.mib_per_gpu
    wl_opts = f"-s {args.small_bos}" if shape["small"] else ""
    wl_opts += " -c" if shape["tree"] else ""
    base = os.path.join(work, name)
    os.makedirs(base)
    if shape["tmpfs"]:
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=90%", "vramd-bench", base], check=True)
    try:
        runs = []
        for i in range(args.runs):
            order = ("stock", "vramd") if i % 2 == 0 else ("vramd", "stock")
            rows = {}
            for side in order:
                case = v.VCase(model, os.path.join(base, f"run{i}-{side}"))
                case.use(plugins[side])
                t.MIB = mib  # the scripts read $MIB from the module's constant
                rows[side] = one(side, shape, case, daemon, wl_opts, os.path.join(work, "copies.log"))
                if args.keep_logs:
                    keep = os.path.join(args.keep_logs, f"{name}-run{i}-{side}")
                    os.makedirs(keep)
                    for n in ("dump.log", "restore.log"):
                        if os.path.exists(os.path.join(case.work, "img", n)):
                            shutil.copy(os.path.join(case.work, "img", n), keep)
                shutil.rmtree(case.work)
            runs.append(rows)
            print(
                f"{name} run {i}: " + "  ".join(f"{s} {_brief(r)}" for s, r in rows.items()),
                flush=True,
            )
    finally:
        if shape["tmpfs"]:
            subprocess.run(["umount", base], check=False)
    med: dict = {}
    for side in ("stock", "vramd"):
        med[side] = {}
        for what in ("dump", "restore"):
            done = [r[side][what] for r in runs if "failed" not in r[side][what]]
            if not done:  # every run of it failed: the first reason
                med[side][what] = {"failed": runs[0][side][what]["failed"], "byte_exact": False}
                continue
            keys = [k for k, x in done[0].items() if isinstance(x, (int, float)) and not isinstance(x, bool)]
            med[side][what] = {k: statistics.median(m[k] for m in done if k in m) for k in keys}
            med[side][what]["byte_exact"] = all(r[side]["restore"]["byte_exact"] for r in runs)
            med[side][what]["failed_runs"] = len(runs) - len(done)
        expect = runs[0][side]["expect"].split(";")[0].split()
        med[side]["bos"], med[side]["bytes"] = int(expect[1]), int(expect[2])
        if shape["tree"]:
            child = runs[0][side]["expect"].split("child ok ")[1].split()
            med[side]["bos"] += int(child[0])
            med[side]["bytes"] += int(child[1])
    return {"shape": name, "mib_per_gpu": mib, "wl_opts": wl_opts, "runs": runs, "median": med}


def _brief(r: dict) -> str:
    def step(what: str) -> str:
        m = r[what]
        return f"{what} FAILED ({m['failed']})" if "failed" in m else f"{what} {m['wall_s']:.2f}s"

    exact = (
        "" if r["restore"]["byte_exact"] or "failed" in r["restore"] else f" (NOT byte-exact: {r['restore']['checks']})"
    )
    return f"{step('dump')} {step('restore')}{exact}"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib-per-gpu", type=int, default=1024)
    ap.add_argument("--small-bos", type=int, default=10000)
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--shapes", default="disk,tmpfs,tree,small")
    ap.add_argument("--json")
    ap.add_argument("--keep-logs", help="a directory to copy each run's dump.log and restore.log into")
    args = ap.parse_args()
    why = v.ENV.missing() or (
        None if v.ENV.has_libvramd() else "needs libvramd (VRAMD_CLIENT_INC, VRAMD_CLIENT_LIBDIR)"
    )
    if why:
        print(f"bench_plugins: not run: {why}", file=sys.stderr)
        return 2
    shapes = args.shapes.split(",")
    if set(shapes) - set(SHAPES):
        ap.error(f"--shapes: one of {','.join(SHAPES)}")
    work = tempfile.mkdtemp(prefix="plugins-bench-")  # on disk (/tmp); not under /dev (the namespace's)
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, lambda signum, frame: sys.exit(128 + signum))
    try:
        hash_rate = hash_s_per_gib()
        plugins = {
            "stock": os.path.join(v.ENV.criu_src or "", "plugins", "amdgpu", "amdgpu_plugin.so"),
            "vramd": build_vramd_plugin(os.path.join(work, "src")),
        }
        model = Model(os.path.join(work, "build"))
        results = []
        with v.running_daemon(VRAMD_SDMA_MODEL_COPY_LOG=os.path.join(work, "copies.log")) as daemon:
            for name in shapes:
                results.append(run_shape(name, args, model, plugins, daemon, work))
    finally:
        for name in shapes:
            subprocess.run(["umount", os.path.join(work, name)], capture_output=True)
        shutil.rmtree(work, ignore_errors=True)
    commit = subprocess.run(
        ["git", "-C", v.ENV.criu_src or "", "rev-parse", "--short=9", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    print(
        f"MODEL NUMBERS (KFD + SDMA models, not a GPU); CRIU {commit or '?'}; {os.cpu_count()} cores; "
        f"median of {args.runs} runs per side, alternating; the model's copying from the SDMA model's copy log "
        f"(its engine threads' CPU); the format's hashing {hash_rate:.3f} s/GiB at dump"
    )
    print("\n".join(table(results)))
    print("\n".join(verdicts(results, hash_rate)))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"criu": commit, "hash_s_per_gib": hash_rate, "results": results},
                f,
                indent=1,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
