"""Shared test plumbing: child workloads, image directories, running the engine."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import uvloop

from vramd.backends import BoRef
from vramd.engine import Engine, EngineConfig
from vramd.jobs import BoSpec, RestoreTarget

WORKLOAD = Path(__file__).with_name("workload.py")


def run(coro):
    return uvloop.run(coro)


class Workload:
    """A child process with known memory (see workload.py)."""

    def __init__(self, spec: list[dict]):
        self.proc = subprocess.Popen([sys.executable, str(WORKLOAD), json.dumps(spec)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"workload failed to start (exit {self.proc.wait()})")
        self.info = json.loads(line)
        self.pid = self.info["pid"]
        self.regions = self.info["regions"]

    def digests(self) -> list[str]:
        self.proc.stdin.write("digest\n")
        self.proc.stdin.flush()
        return [r["digest"] for r in json.loads(self.proc.stdout.readline())["regions"]]

    def open_mem(self, flags: int = os.O_RDONLY) -> int:
        """What a client does: open /proc/<pid>/mem itself and pass the fd."""
        return os.open(f"/proc/{self.pid}/mem", flags | os.O_CLOEXEC)

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write("exit\n")
                self.proc.stdin.flush()
            except BrokenPipeError:
                pass
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc.stdin.close()
        self.proc.stdout.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def blank_spec_like(regions: list[dict]) -> list[dict]:
    """A spec mapping the same addresses, filled with garbage, for a restore target."""
    out = []
    for r in regions:
        skew = r["addr"] % 4096
        out.append({"size": r["size"], "at": r["addr"] - skew, "skew": skew, "fill": "blank"})
    return out


def procmem_bos(w: Workload, mem_fd: int, gpu_of=lambda i: 0) -> list[BoSpec]:
    return [BoSpec(i + 1, r["size"], BoRef("procmem", mem_fd, r["addr"]), gpu_id=gpu_of(i), va_addr=r["addr"])
            for i, r in enumerate(w.regions)]


def procmem_targets(w: Workload, mem_fd: int) -> list[RestoreTarget]:
    return [RestoreTarget(i + 1, BoRef("procmem", mem_fd, r["addr"])) for i, r in enumerate(w.regions)]


def engine(**kw) -> Engine:
    return Engine(EngineConfig(**kw))


def open_dir(path) -> int:
    return os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
