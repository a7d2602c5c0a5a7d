"""A child process holding memory with known contents (tests, demo, bench).

    python -m vramd.testing.workload_child SPEC_JSON

SPEC_JSON is a list of regions: {"size": N, "fill": KIND, "seed": S,
"at": ADDR (optional fixed address), "skew": K (BO starts K bytes into its
first page), "marks": [[offset, hex bytes], ...]}.  KIND is "random",
"hex" (random hex digits: slow to compress), "zero", "pattern", "blank"
(0xA5 garbage, a restore target) or "sparse"
(zero pages left untouched, plus the marks).  "holes": [[offset, length]]
unmaps page-aligned parts of the region after filling it.  The child maps each region,
fills it, prints one JSON line {"pid", "regions": [{"addr", "size",
"digest"}]} and then answers commands on stdin, one per line:
"digest" -> the same JSON again (re-hashed now), "exit" -> exits.
"""
from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from typing import TYPE_CHECKING, Any

import xxhash

from ..hostmem.libc import (
    MAP_ANONYMOUS,
    MAP_FAILED,
    MAP_FIXED_NOREPLACE,
    MAP_NORESERVE,
    MAP_PRIVATE,
    PROT_READ,
    PROT_WRITE,
    address,
    ffi,
    libc,
)
from ..units import PAGE, round_up

if TYPE_CHECKING:
    from .runas import RunAs

PROT_RW = PROT_READ | PROT_WRITE


# Regions a spec does not place go from here up (as a hint: the kernel may still choose elsewhere), far
# from where the kernel puts mappings by itself (just below the stack) and from the heap (after the
# executable).  A restore target, another process, maps the very same addresses (`blank_spec_like`): where
# the kernel had placed the source's region, a 1 GiB one, the target's own libraries or arenas were
# sometimes already there.
QUIET_BASE = 0x2000_0000_0000
_hint = QUIET_BASE


def map_region(size: int, at: int | None) -> int:
    global _hint
    n, flags = max(size, 1), MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE
    if not at:
        hint, _hint = _hint, _hint + round_up(n, 1 << 30) + (1 << 30)  # a free GiB between regions
        p = libc.mmap(ffi.cast("void *", hint), n, PROT_RW, flags, -1, 0)
        if p == MAP_FAILED:
            raise SystemExit(f"mmap of {size} bytes failed")
        return address(p)
    p = libc.mmap(ffi.cast("void *", at), n, PROT_RW, flags | MAP_FIXED_NOREPLACE, -1, 0)
    if p == MAP_FAILED or address(p) != at:
        raise SystemExit(f"mmap at {at!r} of {size} bytes failed")
    return address(p)


def fill(buf: Any, kind: str, seed: int) -> None:
    n = len(buf)
    if kind in ("zero", "sparse") or n == 0:
        return
    if kind == "blank":
        buf[:] = b"\xa5" * n
    elif kind == "random":
        # 1 MiB of seeded randomness per MiB, cheap enough for GiB regions
        rng = random.Random(seed)
        for off in range(0, n, 1 << 20):
            k = min(1 << 20, n - off)
            buf[off:off + k] = rng.randbytes(k)
    elif kind == "hex":
        # seeded random hex digits: half compressible, and slow for zstd's high levels (about 1.5 s per MiB at
        # zstd:19 on one core), where a dump must be interrupted while it compresses
        rng = random.Random(seed)
        for off in range(0, n, 1 << 20):
            k = min(1 << 20, n - off)
            buf[off:off + k] = rng.randbytes((k + 1) // 2).hex().encode()[:k]
    elif kind == "pattern":
        unit = bytes(range(256)) * 16 + seed.to_bytes(8, "little")
        reps = n // len(unit) + 1
        buf[:] = (unit * reps)[:n]
    else:
        raise SystemExit(f"unknown fill {kind}")


PR_SET_PTRACER, PR_SET_PTRACER_ANY = 0x59616D61, -1


def allow_any_tracer() -> None:
    """Under Yama's ptrace_scope 1, only a parent may open a process's /proc/<pid>/mem: let any process of
    this uid (vramctl, run by the same user) do so, as a checkpointed program would (no-op without Yama)."""
    if os.path.exists("/proc/sys/kernel/yama/ptrace_scope"):
        import ctypes
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PTRACER, PR_SET_PTRACER_ANY, 0, 0, 0)


def main() -> None:
    spec = json.loads(sys.argv[1])
    allow_any_tracer()
    regions = []
    for r in spec:
        size, skew = r["size"], r.get("skew", 0)
        base = map_region(size + skew, r.get("at"))
        addr = base + skew
        buf = ffi.buffer(ffi.cast("char *", addr), size)
        fill(buf, r.get("fill", "random"), r.get("seed", 0))
        for off, hexbytes in r.get("marks", []):
            data = bytes.fromhex(hexbytes)
            buf[off:off + len(data)] = data
        for off, length in r.get("holes", []):
            if libc.munmap(ffi.cast("void *", base + off), length) != 0:
                raise SystemExit("munmap failed")
        regions.append((addr, size, None if r.get("holes") else buf))

    def report() -> None:
        out = [{"addr": a, "size": s, "digest": b is not None and xxhash.xxh3_128_hexdigest(b)}
               for a, s, b in regions]
        print(json.dumps({"pid": os.getpid(), "regions": out}), flush=True)

    report()
    for line in sys.stdin:
        cmd = line.strip()
        if cmd == "digest":
            report()
        elif cmd == "exit":
            return


class Workload:
    """Client side: start a workload child and talk to it."""

    def __init__(self, spec: list[dict[str, Any]], *, run_as: RunAs | None = None) -> None:
        """`run_as`: the user the child runs as (vramd.testing.runas), with the interpreter it can reach."""
        python, kw = ([sys.executable], {}) if run_as is None else (run_as.python, run_as.popen_kwargs())
        self.proc = subprocess.Popen([*python, "-m", "vramd.testing.workload_child", json.dumps(spec)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, **kw)
        assert self.proc.stdin is not None and self.proc.stdout is not None  # both are pipes
        self.stdin, self.stdout = self.proc.stdin, self.proc.stdout
        line = self.stdout.readline()
        if not line:
            raise RuntimeError(f"workload failed to start (exit {self.proc.wait()})")
        self.info = json.loads(line)
        self.pid = self.info["pid"]
        self.regions = self.info["regions"]

    def digests(self) -> list[str]:
        self.stdin.write("digest\n")
        self.stdin.flush()
        return [r["digest"] for r in json.loads(self.stdout.readline())["regions"]]

    def open_mem(self, flags: int = os.O_RDONLY) -> int:
        """What a client does: open /proc/<pid>/mem itself and pass the fd."""
        return os.open(f"/proc/{self.pid}/mem", flags | os.O_CLOEXEC)

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.stdin.write("exit\n")
                self.stdin.flush()
            except BrokenPipeError:
                pass
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.stdin.close()
        self.stdout.close()

    def __enter__(self) -> Workload:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def blank_spec_like(regions: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A spec mapping the same addresses, filled with garbage, for a restore target."""
    out = []
    for r in regions:
        skew = r["addr"] % PAGE
        out.append({"size": r["size"], "at": r["addr"] - skew, "skew": skew, "fill": "blank"})
    return out

