"""`vramctl restore --image oci://` (streamed) against its parts, side by side: `bench/oci_push.py --restore`.

Split from bench/oci_push.py (which runs it and reports the ratios); see `restore` and bench/README.md's
"oci_push.py" sections.
"""
from __future__ import annotations

import contextlib
import hashlib
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

from net import NetNs  # bench/net.py, beside this file

from vramd.testing import DaemonProcess
from vramd.testing.registry import Registry

ROOT = Path(__file__).resolve().parent.parent


def timed(cmd: list[str], cwd: Path = ROOT) -> tuple[float, float, str]:
    """(wall s, CPU s of the child, stdout) of a command run to its end (in `cwd`: its vramd is the one run)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    r = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if r.returncode != 0:
        raise SystemExit(f"{' '.join(cmd[:4])}: {r.stderr.strip()}")
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime), r.stdout


def vramctl(*args: str) -> list[str]:
    return [sys.executable, "-m", "vramd.cli", *args]


def row(name: str, wall: float, cpu: float, nbytes: int, requests: int) -> dict[str, object]:
    gib = nbytes / 2**30
    return {"case": name, "wall_s": round(wall, 3), "GB_per_s": round(nbytes / wall / 1e9, 3) if wall else None,
            "cpu_s_per_GiB": round(cpu / gib, 3) if gib else None, "requests": requests, "bytes": nbytes}


def cpu_of(pid: int | None) -> float:
    """CPU s (user + system) a running process has used so far (/proc/PID/stat); 0 for None."""
    if pid is None:
        return 0.0
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def restore(work: Path, size: int, rounds: int = 1, baseline: Path | None = None,
            net_rates: list[str] | None = None, net_delay: str | None = None) -> list[dict[str, object]]:
    """`vramctl restore --image oci://`, streamed (cold cache; and --no-cache), against its parts side by side in
    one run: a pull alone, a restore of the local directory alone, and the two one after the other (pull, then
    restore the pulled directory: what restore from a reference did before it streamed); then a restore with
    the cache holding the image (warm).  Into a file BO; the registry's files are read once, untimed, first.
    `rounds` > 1 repeats the first four cases, interleaved (rows tagged #1, #2, ...).  `baseline`, another
    checkout's root: its vramctl's pull alone and streamed restore are timed too, each right after this tree's
    (rows tagged "(baseline)"; the daemon is this tree's).  Each timed row also has the daemon's and the
    registry's CPU s/GiB over its wall (/proc/PID/stat), vramctl's being `cpu_s_per_GiB`.  `net_rates` (root):
    a second registry serving the first one's storage from its own network namespace behind a veth pair
    (bench/net.py); in each round the pull alone, pull-then-restore and streamed cases run again against it at
    each rate ("none": the pair unshaped), rows tagged "[RATE]"; the settings' order rotates from round to round.
    Every timed case starts with what earlier ones wrote (pulled directory, cache, restored BO) deleted; the warm
    case's cache is filled from the loopback registry, untimed, first."""
    data = work / "bo.bin"
    want = hashlib.sha256()
    with open(data, "wb") as f:
        for _ in range(size // (8 << 20)):
            piece = os.urandom(8 << 20)
            want.update(piece)
            f.write(piece)
    out = work / "out.bin"
    rows: list[dict[str, object]] = []
    run = tempfile.mkdtemp(prefix="vb", dir="/tmp")
    os.chmod(run, 0o755)
    try:
        with contextlib.ExitStack() as stack:
            d = stack.enter_context(DaemonProcess(run, "--chunk-size", "8M", log_level="warning"))
            reg = stack.enter_context(Registry(work / "reg-r"))
            img = work / "image"
            subprocess.run(vramctl("--socket", d.socket, "dump", "--pid", str(os.getpid()), "--bo-file", str(data),
                                   "--image", str(img), "--compress", "none"), cwd=ROOT, check=True,
                           capture_output=True)
            settings: list[tuple[str, Registry]] = [("", reg)]
            ns = None
            if net_rates:
                ns = stack.enter_context(NetNs())
                (work / "reg-n").mkdir()
                (work / "reg-n" / "storage").symlink_to(reg.storage)  # the same blobs, one copy in the page cache
                nreg = stack.enter_context(Registry(work / "reg-n", listen=ns.peer, netns=ns.name))
                settings += [(f" [{r}]", nreg) for r in net_rates]
            ref = f"{reg.host}/bench/r:1"
            timed(vramctl("push", str(img), ref, "--plain-http"))
            # a pull first, untimed, so the registry's files are in its page cache for every timed case alike
            timed(vramctl("pull", ref, str(work / "warmup"), "--plain-http"))
            shutil.rmtree(work / "warmup")

            def restore_cmd(image: str, *more: str) -> list[str]:
                out.write_bytes(b"")
                os.truncate(out, size)
                return vramctl("--socket", d.socket, "restore", "--pid", str(os.getpid()), "--image", image,
                               "--bo-file", f"1={out}", *more)

            def check() -> None:  # the restored BO's sha256 (it is in the page cache: the dumped file is not read)
                h = hashlib.sha256()
                with open(out, "rb") as f:
                    while piece := f.read(8 << 20):
                        h.update(piece)
                if h.digest() != want.digest():
                    raise SystemExit("the restored BO differs from the dumped one")
            cache = work / "cache"

            def fresh() -> None:  # each case starts with what earlier ones wrote deleted (bench/README.md, "across
                # a network": a pull beside a streamed restore's files still cached had 4x the kernel time)
                shutil.rmtree(work / "pulled", ignore_errors=True)
                shutil.rmtree(cache, ignore_errors=True)
                out.write_bytes(b"")
            for k in range(rounds):  # interleaved: each round's cases see the machine in about the same state
                tag = f" #{k + 1}" if rounds > 1 else ""
                rows.append({"case": "load average before round" + tag, "load": os.getloadavg()})
                trees = [(t, btag) for t, btag in ((ROOT, ""), (baseline, " (baseline)")) if t is not None]
                if k % 2:  # which of the two goes first alternates
                    trees.reverse()
                fresh()
                rows.append(procs(d, reg, size, partial(timed, restore_cmd(str(img))),
                                  "restore of the local directory alone" + tag))
                check()
                for net, r in settings[k % len(settings):] + settings[:k % len(settings)]:
                    if ns is not None and r is not reg:
                        ns.shape(None if net == " [none]" else net.strip(" []"), net_delay)
                    ref = f"{r.host}/bench/r:1"
                    for tree, btag in trees:
                        fresh()
                        rows.append(procs(d, r, size, partial(timed, vramctl("pull", ref, str(work / "pulled"),
                                                                             "--plain-http"), tree),
                                          "pull alone" + net + btag + tag))
                    fresh()
                    wall1, cpu1, _ = timed(vramctl("pull", ref, str(work / "pulled"), "--plain-http"))
                    wall2, cpu2, _ = timed(restore_cmd(str(work / "pulled")))
                    check()
                    rows.append(row("pull, then restore the pulled directory" + net + tag, wall1 + wall2,
                                    cpu1 + cpu2, size, 0))
                    for tree, btag in trees:
                        fresh()
                        rows.append(procs(d, r, size, partial(timed, restore_cmd(
                            f"oci://{ref}", "--plain-http", "--cache", str(cache)), tree),
                            "restore --image oci:// streamed (cold cache)" + net + btag + tag))
                        check()
            rows.append({"case": "load average after the rounds", "load": os.getloadavg()})
            if ns is not None:
                rows.append({"case": "qdiscs (the last setting)", "tc": ns.qdiscs()})
            ref = f"{reg.host}/bench/r:1"
            fresh()
            timed(restore_cmd(f"oci://{ref}", "--plain-http", "--cache", str(cache)))  # the cache filled, untimed
            wall, cpu, _ = timed(restore_cmd(f"oci://{ref}", "--plain-http", "--cache", str(cache)))
            check()
            rows.append(row("restore --image oci:// (warm cache)", wall, cpu, size, 0))
            shutil.rmtree(cache)
            wall, cpu, _ = timed(restore_cmd(f"oci://{ref}", "--plain-http", "--no-cache"))
            check()
            rows.append(row("restore --image oci:// streamed --no-cache", wall, cpu, size, 0))
    finally:
        shutil.rmtree(run, ignore_errors=True)
    return rows


def procs(d: DaemonProcess, reg: Registry, size: int, case: Callable[[], tuple[float, float, str]], name: str
          ) -> dict[str, object]:
    """`case` timed (a row), with the daemon's and the registry's CPU s/GiB over its wall beside vramctl's."""
    c0 = (cpu_of(d.pid), cpu_of(reg.pid))
    wall, cpu, _ = case()
    gib = size / 2**30
    r = row(name, wall, cpu, size, 0)
    r["daemon_cpu_s_per_GiB"] = round((cpu_of(d.pid) - c0[0]) / gib, 3)
    r["registry_cpu_s_per_GiB"] = round((cpu_of(reg.pid) - c0[1]) / gib, 3)
    return r


