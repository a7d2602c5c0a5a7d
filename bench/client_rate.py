#!/usr/bin/env python3
"""Small-BO rate through the C client (libvramd) vs the Python client, same daemon, same run.

    python bench/client_rate.py --client-c build/libvramd/client_c --out results.json
                                [--bos 10000] [--bo-size 4096] [--reps 5] [--image-dir /var/tmp]

Starts one `vramd` daemon.  Each repetition runs, for each source, one whole
dump session (open, AddBos, start, wait: image committed with fsync, close)
and one whole restore session from that image, once through the C client
(bench/client_c.c, a process of its own) and once through
vramd.client.Client (in this process), interleaved, the order alternating
between repetitions.  Sources:
  memfd    one memfd per BO (the mmap backend; what KFD's dmabuf-per-BO looks
           like), so the BO fds travel in messages of at most 253;
  procmem  BOs are ranges of one process's memory, one /proc/<pid>/mem fd.
Setup (creating the BOs, the source and target processes) is not timed.
rate = BOs / wall seconds of a session; also the client process's own CPU
time per session (getrusage), and the daemon's CPU time (all its threads,
/proc/<pid>/stat) over each run of one dump and one restore session, which
depend much less on what else the machine runs than the wall time does;
medians over --reps, every repetition kept in the JSON.  Targets (issue #9): C >= 1.0 x Python, and
>= 20,000 BOs/s for procmem ranges.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench/ is not a package

from machine import Machine

from vramd.client import SESSION_DUMP, SESSION_RESTORE, Client, ClientBo
from vramd.testing import DaemonProcess


def raise_fd_limit() -> None:
    _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def holder() -> tuple[int, int]:
    """A child that keeps a copy of this process's memory until its pipe closes: (pid, write end)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(w)
        os.read(r, 1)
        os._exit(0)
    os.close(r)
    return pid, w


def cpu() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def daemon_cpu(pid: int) -> float:
    """CPU seconds (user + system, every thread) the daemon has used so far."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def py_session(c: Client, kind: int, dfd: int, bos: list[ClientBo]) -> tuple[float, float]:
    """(wall seconds, client CPU seconds) of one whole session."""
    c0, t0 = cpu(), time.perf_counter()
    c.run_session(kind, dfd, bos)
    return time.perf_counter() - t0, cpu() - c0


class PySide:
    """The Python client's BOs, made once; each run dumps then restores them."""

    def __init__(self, n: int, size: int):
        self.n, self.size = n, size
        self.memfds = []
        for _i in range(n):
            fd = os.memfd_create("bo", os.MFD_CLOEXEC)
            os.pwrite(fd, os.urandom(size), 0)
            self.memfds.append(fd)
        self.region = mmap.mmap(-1, n * size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        self.region.write(os.urandom(n * size))
        self.addr = ctypes.addressof(ctypes.c_char.from_buffer(self.region))
        self.src_pid, self.src_ctl = holder()
        self.region.seek(0)
        self.region.write(b"\xee" * (n * size))
        self.dst_pid, self.dst_ctl = holder()
        self.mem_src = os.open(f"/proc/{self.src_pid}/mem", os.O_RDONLY | os.O_CLOEXEC)
        self.mem_dst = os.open(f"/proc/{self.dst_pid}/mem", os.O_RDWR | os.O_CLOEXEC)

    def run(self, c: Client, mode: str, base: str) -> dict:
        n, size = self.n, self.size
        if mode == "memfd":
            src = [ClientBo(i + 1, fd, size=size) for i, fd in enumerate(self.memfds)]
            dst = [ClientBo(i + 1, fd) for i, fd in enumerate(self.memfds)]
            want = [os.pread(fd, size, 0) for fd in self.memfds[:: max(1, n // 64)]]
        else:
            src = [ClientBo(i + 1, self.mem_src, offset=self.addr + i * size, size=size) for i in range(n)]
            dst = [ClientBo(i + 1, self.mem_dst, offset=self.addr + i * size) for i in range(n)]
        d = tempfile.mkdtemp(prefix="client_py-", dir=base)
        dfd = os.open(d, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            dump_s, dump_cpu = py_session(c, SESSION_DUMP, dfd, src)
            if mode == "memfd":  # untimed: make the targets garbage
                for fd in self.memfds:
                    os.pwrite(fd, b"\xee" * size, 0)
            restore_s, restore_cpu = py_session(c, SESSION_RESTORE, dfd, dst)
        finally:
            os.close(dfd)
            shutil.rmtree(d)
        if mode == "memfd":
            got = [os.pread(fd, size, 0) for fd in self.memfds[:: max(1, n // 64)]]
        else:
            want = [os.pread(self.mem_src, size, self.addr + i * size) for i in range(0, n, max(1, n // 64))]
            got = [os.pread(self.mem_dst, size, self.addr + i * size) for i in range(0, n, max(1, n // 64))]
        if got != want:
            raise SystemExit(f"python client, {mode}: restored bytes differ")
        return {"client": "python", "mode": mode, "dump_s": dump_s, "restore_s": restore_s,
                "dump_client_cpu_s": dump_cpu, "restore_client_cpu_s": restore_cpu}

    def close(self) -> None:
        for fd in (*self.memfds, self.mem_src, self.mem_dst, self.src_ctl, self.dst_ctl):
            os.close(fd)
        os.waitpid(self.src_pid, 0)
        os.waitpid(self.dst_pid, 0)
        self.region.close()


def c_run(binary: str, sock: str, base: str, mode: str, n: int, size: int) -> dict:
    out = subprocess.run([binary, sock, base, mode, str(n), str(size)], capture_output=True, text=True, timeout=600)
    if out.returncode != 0:
        raise SystemExit(f"client_c {mode} failed ({out.returncode}): {out.stderr.strip()}")
    return json.loads(out.stdout)


def summarise(runs: list[dict], n: int) -> dict:
    out: dict = {}
    for mode in ("memfd", "procmem"):
        out[mode] = {}
        for direction in ("dump", "restore"):
            row = {}
            for client in ("c", "python"):
                secs = [r[f"{direction}_s"] for r in runs if r["mode"] == mode and r["client"] == client]
                med = statistics.median(secs)
                cpus = [r[f"{direction}_client_cpu_s"] for r in runs if r["mode"] == mode and r["client"] == client]
                row[client] = {"seconds_all": secs, "seconds_median": med, "bos_per_s_median": n / med,
                               "bos_per_s_worst": n / max(secs), "client_cpu_s_median": statistics.median(cpus)}
            if direction == "dump":  # one figure per run of a dump and a restore session
                row["daemon_cpu_s_per_run_median"] = {
                    client: statistics.median(r["daemon_cpu_s"] for r in runs
                                              if r["mode"] == mode and r["client"] == client)
                    for client in ("c", "python")}
            row["c_over_python"] = row["c"]["bos_per_s_median"] / row["python"]["bos_per_s_median"]
            row["c_target_met"] = row["c_over_python"] >= 1.0 and (mode != "procmem" or
                                                                  row["c"]["bos_per_s_median"] >= 20_000)
            out[mode][direction] = row
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--client-c", default="build/libvramd/client_c")
    ap.add_argument("--bos", type=int, default=10_000)
    ap.add_argument("--bo-size", type=int, default=4096)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--image-dir", default="/var/tmp")
    ap.add_argument("--out")
    args = ap.parse_args()
    raise_fd_limit()
    machine = Machine()
    run_dir = tempfile.mkdtemp(prefix="vramd-bench-", dir="/tmp")
    base = tempfile.mkdtemp(prefix="vramd-bench-img-", dir=args.image_dir)
    daemon = DaemonProcess(run_dir, log_level="warning", stderr=subprocess.DEVNULL)
    runs: list[dict] = []
    try:
        py = PySide(args.bos, args.bo_size)
        try:
            with Client(daemon.socket, name="client_rate.py") as c:
                for rep in range(args.reps):
                    for mode in ("memfd", "procmem"):
                        order = ("c", "python") if rep % 2 == 0 else ("python", "c")
                        for who in order:
                            d0 = daemon_cpu(daemon.pid)
                            r = (c_run(args.client_c, daemon.socket, base, mode, args.bos, args.bo_size)
                                 if who == "c" else py.run(c, mode, base))
                            r["daemon_cpu_s"] = daemon_cpu(daemon.pid) - d0  # its dump and its restore
                            r["rep"] = rep
                            runs.append(r)
                            print(f"rep {rep} {mode:8s} {who:6s} dump {args.bos / r['dump_s']:9.0f} BOs/s  "
                                  f"restore {args.bos / r['restore_s']:9.0f} BOs/s", flush=True)
        finally:
            py.close()
    finally:
        daemon.stop()
        shutil.rmtree(run_dir, ignore_errors=True)
        shutil.rmtree(base, ignore_errors=True)
    result = {
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{platform.machine()}, {os.cpu_count()} cpus, {platform.platform()}",
        "host": machine.summary(),
        "image_dir": args.image_dir, "bos": args.bos, "bo_size": args.bo_size, "reps": args.reps,
        "summary": summarise(runs, args.bos), "runs": runs,
    }
    print("\n" + Machine.line(result["host"]))
    for mode, dirs in result["summary"].items():
        cpu_run = dirs["dump"]["daemon_cpu_s_per_run_median"]
        print(f"{mode:8s} daemon CPU per dump + restore of {args.bos} BOs: with C {cpu_run['c']:.2f} s, "
              f"with Python {cpu_run['python']:.2f} s")
        for direction, row in dirs.items():
            print(f"{mode:8s} {direction:8s} C {row['c']['bos_per_s_median']:9.0f} BOs/s  "
                  f"Python {row['python']['bos_per_s_median']:9.0f} BOs/s  C/Python {row['c_over_python']:.2f}  "
                  f"client CPU C {row['c']['client_cpu_s_median'] * 1e3:6.1f} ms "
                  f"Python {row['python']['client_cpu_s_median'] * 1e3:6.1f} ms  "
                  f"{'met' if row['c_target_met'] else 'MISSED'}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
            f.write("\n")


if __name__ == "__main__":
    main()
