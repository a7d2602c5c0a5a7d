#!/usr/bin/env python3
"""Soak: many clients, mixed sessions, some killed mid-session, against one real daemon for a long time.

    python bench/soak.py [--clients 16] [--minutes 10] [--sample 10] [--kill-every 2.0]
                         [--out soak.json] [--image-dir /var/tmp]

Starts a `vramd` daemon (vramd.testing.DaemonProcess) and --clients worker
processes.  Each worker loops over sessions chosen at random:

  dump     1-8 BOs of up to 2 MiB, from memfds (mmap backend) or from the
           worker's own memory (/proc/self/mem, procmem backend), zstd or not;
  restore  its last image, into fresh memfds or into its own memory, and
           checks the bytes against what it dumped;
  verify   its last image.

Every --kill-every seconds one worker, picked at random, is killed with
SIGKILL wherever it is (often mid-session), and a new one takes its place.
Every --sample seconds the daemon's fd count, RSS, threads, connections and
sessions are recorded with the session outcomes so far.  At the end the
workers stop, the daemon is given the grace period to reap what the killed
ones left, and the final figures are compared with the baseline taken
after a warm-up.  JSON (--out) and a short table on stdout.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import platform
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from vramd.client import Client  # noqa: E402
from vramd.testing import DaemonProcess  # noqa: E402

WORKER = r'''
import ctypes, hashlib, json, os, random, sys, time
from vramd.client import Client, ClientBo, SESSION_DUMP, SESSION_RESTORE, SESSION_VERIFY
from vramd.errors import VramdError

sock, img, seed = sys.argv[1], sys.argv[2], int(sys.argv[3])
rng = random.Random(seed)
os.makedirs(img, exist_ok=True)
dfd = os.open(img, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
arena = ctypes.create_string_buffer(20 << 20)     # this process's own memory for procmem BOs (8 x 2 MiB fit)
base = ctypes.addressof(arena)
last = None                                        # (sizes, digests) of the last committed dump

def say(**kw):
    print(json.dumps(kw), flush=True)

def bos_from(kind, sizes, data=None, write=False):
    fds, bos, off = [], [], 0
    if kind == "procmem":
        mem = os.open("/proc/self/mem", (os.O_RDWR if write else os.O_RDONLY) | os.O_CLOEXEC)
        fds.append(mem)
        for i, n in enumerate(sizes):
            if data is not None:
                ctypes.memmove(base + off, data[i], n)
            bos.append(ClientBo(i + 1, mem, offset=base + off, size=n, backend="procmem"))
            off += (n + 4095) & ~4095
    else:
        for i, n in enumerate(sizes):
            fd = os.memfd_create("soak", os.MFD_CLOEXEC)
            os.ftruncate(fd, n)
            if data is not None:
                os.pwrite(fd, data[i], 0)
            fds.append(fd)
            bos.append(ClientBo(i + 1, fd, size=n, backend="mmap"))
    return fds, bos

def read_back(kind, sizes, fds):
    out, off = [], 0
    for i, n in enumerate(sizes):
        if kind == "procmem":
            out.append(ctypes.string_at(base + off, n))
            off += (n + 4095) & ~4095
        else:
            out.append(os.pread(fds[i], n, 0))
    return out

with Client(sock, timeout=120) as c:
    while True:
        what = rng.choice(["dump", "dump", "restore", "verify"]) if last else "dump"
        src = rng.choice(["procmem", "mmap"])
        t0 = time.monotonic()
        fds = []
        try:
            if what == "dump":
                sizes = [rng.choice([4096, 65536, 1 << 20, 2 << 20, rng.randrange(1, 2 << 20)])
                         for _ in range(rng.randint(1, 8))]
                data = [rng.randbytes(n) if rng.random() < 0.7 else bytes(n) for n in sizes]
                fds, bos = bos_from(src, sizes, data)
                info = c.run_session(SESSION_DUMP, dfd, bos, compression=rng.choice(["", "zstd"]))
                last = (sizes, [hashlib.sha256(d).digest() for d in data])
            elif what == "restore":
                sizes, digests = last
                fds, bos = bos_from(src, sizes, write=True)
                info = c.run_session(SESSION_RESTORE, dfd, bos)
                got = [hashlib.sha256(d).digest() for d in read_back(src, sizes, fds)]
                if got != digests:
                    say(what=what, src=src, outcome="WRONG_BYTES", s=time.monotonic() - t0)
                    continue
            else:
                info = c.run_session(SESSION_VERIFY, dfd, [])
            say(what=what, src=src, outcome="done", bytes=info.progress.bytes_done, s=time.monotonic() - t0)
        except VramdError as e:
            say(what=what, src=src, outcome=e.code, message=e.message, s=time.monotonic() - t0)
        finally:
            for fd in fds:
                os.close(fd)
'''


def rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


def threads(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/task"))


class Worker:
    def __init__(self, sock: str, img_root: str, n: int, seed: int) -> None:
        self.img = os.path.join(img_root, f"w{n}-{seed}")
        self.proc = subprocess.Popen([sys.executable, "-c", WORKER, sock, self.img, str(seed)], cwd=ROOT,
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        os.set_blocking(self.proc.stdout.fileno(), False)
        self.buf = ""

    def results(self) -> list[dict]:
        while True:
            try:
                chunk = os.read(self.proc.stdout.fileno(), 1 << 16)
            except (BlockingIOError, ValueError):
                break
            if not chunk:
                break
            self.buf += chunk.decode()
        *lines, self.buf = self.buf.split("\n")
        return [json.loads(line) for line in lines if line.strip()]

    def kill(self) -> list[dict]:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()
        out = self.results()
        self.proc.stdout.close()
        return out


def sample(d: DaemonProcess, watcher: Client, t0: float, outcomes: collections.Counter, killed: int) -> dict:
    st = watcher.status()
    allocated = next((float(line.split()[-1]) for line in st.metrics.splitlines()
                      if line.startswith("vramd_staging_bytes_allocated")), 0.0)
    return {"t_s": round(time.monotonic() - t0, 1), "fds": len(d.fds()), "rss_mib": round(rss_kib(d.pid) / 1024, 1),
            "threads": threads(d.pid), "connections": st.connections, "sessions": st.sessions,
            "staging_in_use_mib": round(st.staging_in_use / 2**20, 1),
            "staging_mapped_mib": round(allocated / 2**20, 1), "killed": killed,
            "outcomes": dict(outcomes)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--sample", type=float, default=10.0, help="seconds between samples")
    ap.add_argument("--kill-every", type=float, default=2.0, help="seconds between SIGKILLs of a random worker")
    ap.add_argument("--grace", type=float, default=1.0, help="the daemon's grace_period")
    ap.add_argument("--image-dir", default=None, help="where the workers' images go (default: a temp dir)")
    ap.add_argument("--out", default=None, help="write the JSON here")
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()
    rng = random.Random(args.seed)

    run_dir = tempfile.mkdtemp(prefix="vramd-soak-", dir="/tmp")
    img_root = tempfile.mkdtemp(prefix="vramd-soak-img-", dir=args.image_dir)
    cfg = Path(run_dir, "soak.toml")
    cfg.write_text(f'grace_period = {args.grace}\nstaging_budget = "128M"\nchunk_size = "1M"\n')
    log = open(Path(run_dir, "vramd.log"), "w")  # noqa: SIM115 (open for the daemon's whole life)
    d = DaemonProcess(run_dir, "--config", str(cfg), log_level="info", stderr=log)
    outcomes: collections.Counter[str] = collections.Counter()
    by_kind: collections.Counter[str] = collections.Counter()
    samples: list[dict] = []
    killed = 0
    try:
        with Client(d.socket) as watcher:
            # warm-up: one worker's sessions of each kind, so pools, threads and caches exist
            w = Worker(d.socket, img_root, 0, 0)
            warm_deadline = time.monotonic() + 60
            seen: set[str] = set()
            while len(seen) < 3 and time.monotonic() < warm_deadline:
                for r in w.results():
                    seen.add(r["what"])
                time.sleep(0.05)
            w.kill()
            deadline = time.monotonic() + 30
            while watcher.status().sessions and time.monotonic() < deadline:
                time.sleep(0.1)
            t0 = time.monotonic()
            baseline = sample(d, watcher, t0, outcomes, 0)
            print(f"baseline: {baseline['fds']} fds, {baseline['rss_mib']} MiB RSS, {baseline['threads']} threads",
                  flush=True)
            workers = [Worker(d.socket, img_root, n, rng.randrange(1 << 30)) for n in range(args.clients)]
            end = t0 + args.minutes * 60
            next_kill, next_sample = t0 + args.kill_every, t0 + args.sample
            while time.monotonic() < end:
                for i, w in enumerate(workers):
                    for r in w.results():
                        outcomes[r["outcome"]] += 1
                        by_kind[f"{r['what']}/{r['src']}/{r['outcome']}"] += 1
                    if w.proc.poll() is not None:  # exited by itself: a bug in the worker or the client
                        outcomes[f"worker_exit_{w.proc.returncode}"] += 1
                        for r in w.kill():
                            outcomes[r["outcome"]] += 1
                        workers[i] = Worker(d.socket, img_root, i, rng.randrange(1 << 30))
                now = time.monotonic()
                if now >= next_kill:
                    i = rng.randrange(len(workers))
                    for r in workers[i].kill():
                        outcomes[r["outcome"]] += 1
                    killed += 1
                    workers[i] = Worker(d.socket, img_root, i, rng.randrange(1 << 30))
                    next_kill += args.kill_every
                if now >= next_sample:
                    samples.append(sample(d, watcher, t0, outcomes, killed))
                    s = samples[-1]
                    print(f"{s['t_s']:7.1f} s  fds {s['fds']:5d}  rss {s['rss_mib']:7.1f} MiB  "
                          f"staging {s['staging_mapped_mib']:5.0f} MiB  threads {s['threads']:3d}  "
                          f"conns {s['connections']:3d}  sessions {s['sessions']:3d}  "
                          f"done {outcomes['done']}  killed {killed}", flush=True)
                    next_sample += args.sample
                time.sleep(0.05)
            for w in workers:
                for r in w.kill():
                    outcomes[r["outcome"]] += 1
            # every session the workers left is reaped after the grace period
            deadline = time.monotonic() + args.grace + 60
            while (watcher.status().sessions or watcher.status().connections > 1) and time.monotonic() < deadline:
                time.sleep(0.1)
            final = sample(d, watcher, t0, outcomes, killed)
            alive = d.proc.poll() is None
    finally:
        d.stop() if d.proc.poll() is None else None
        d.close()
        log.close()
    result = {
        "bench": "soak", "host": platform.node(), "cpus": os.cpu_count(), "python": platform.python_version(),
        "args": vars(args), "baseline": baseline, "final": final, "samples": samples,
        "outcomes": dict(outcomes), "by_kind": dict(sorted(by_kind.items())), "workers_killed": killed,
        "daemon_alive_at_end": alive,
        "fds_back_to_baseline": final["fds"] == baseline["fds"],
        "rss_growth_mib": round(final["rss_mib"] - baseline["rss_mib"], 1),
        "max_rss_mib": max([baseline["rss_mib"], *(s["rss_mib"] for s in samples)]),
        "max_fds": max([baseline["fds"], *(s["fds"] for s in samples)]),
        "internal_errors": outcomes.get("INTERNAL", 0), "wrong_bytes": outcomes.get("WRONG_BYTES", 0),
    }
    print()
    print(f"{'':24}{'baseline':>12}{'max':>12}{'final':>12}")
    print(f"{'daemon fds':24}{baseline['fds']:>12}{result['max_fds']:>12}{final['fds']:>12}")
    print(f"{'daemon RSS (MiB)':24}{baseline['rss_mib']:>12}{result['max_rss_mib']:>12}{final['rss_mib']:>12}")
    print(f"{'staging mapped (MiB)':24}{baseline['staging_mapped_mib']:>12}"
          f"{max(s['staging_mapped_mib'] for s in samples or [final]):>12}{final['staging_mapped_mib']:>12}")
    print(f"{'threads':24}{baseline['threads']:>12}{max(s['threads'] for s in samples or [final]):>12}"
          f"{final['threads']:>12}")
    print(f"sessions: {dict(outcomes)}; workers killed: {killed}; daemon alive: {alive}")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    shutil.rmtree(img_root, ignore_errors=True)
    shutil.rmtree(run_dir, ignore_errors=True)
    ok = alive and result["fds_back_to_baseline"] and not result["internal_errors"] and not result["wrong_bytes"] \
        and not any(k.startswith("worker_exit") for k in outcomes)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
