"""Where the daemon's CPU goes in a streamed restore against a local restore of the same image (root; perf).

    .venv/bin/python bench/net_trace.py --size 1GiB --rounds 2 --net-rate 2gbit --out /tmp/trace.json

One daemon (8 MiB chunks) and one registry (Debian's docker-registry, plain HTTP): --size of random bytes
dumped, pushed, pulled once untimed (the registry's files in the page cache).  Then, per round, alternating:
a restore of the local directory, a restore of a fresh pull of it (its files just written, as the streamed
restore's are), and `vramctl restore --image oci://` streamed with an empty cache, from the registry on
127.0.0.1 and, with --net-rate, from one in its own network namespace behind a veth pair shaped to that rate
(bench/net.py).  For each, of the daemon only (every thread, `perf stat -p` / `perf record -p`): user and
system CPU s/GiB (/proc/PID/stat), context switches, page faults, the system's direct reclaim and
refaults over the case (/proc/vmstat), and with --record the top symbols of a `perf record -g` (cpu-clock).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))

from net import NetNs  # noqa: E402  (bench/net.py, beside this file)

from vramd.hostmem.libc import cached_pages  # noqa: E402
from vramd.testing import DaemonProcess  # noqa: E402
from vramd.testing.registry import Registry  # noqa: E402
from vramd.units import PAGE, parse_size  # noqa: E402

VMSTAT = ("pgscan_direct", "pgsteal_direct", "allocstall_normal", "allocstall_movable", "workingset_refault_file",
          "pgmajfault", "pgfault", "nr_dirtied", "nr_written")


def cpu(pid: int) -> tuple[float, float]:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    tck = os.sysconf("SC_CLK_TCK")
    return int(fields[11]) / tck, int(fields[12]) / tck


def vmstat() -> dict[str, int]:
    with open("/proc/vmstat") as f:
        pairs = (line.split() for line in f)
        return {k: int(v) for k, v in pairs if k in VMSTAT}


def vramctl(*args: str) -> list[str]:
    return [sys.executable, "-m", "vramd.cli", *args]


def run(cmd: list[str]) -> None:
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"{' '.join(cmd[:5])}: {r.stderr.strip()}")


def io(pid: int) -> dict[str, int]:
    """The daemon's /proc/PID/io: rchar (bytes it read, any source), read_bytes (those the disk gave)."""
    with open(f"/proc/{pid}/io") as f:
        pairs = (line.split(": ") for line in f)
        return {k: int(v) for k, v in pairs if k in ("rchar", "read_bytes", "wchar", "write_bytes")}


def cached_share(image: Path | None) -> float | None:
    """The share of the image's files' pages the page cache holds (cachestat/mincore, nothing read)."""
    if image is None or not image.is_dir():
        return None
    have = total = 0
    for p in image.iterdir():
        fd = os.open(p, os.O_RDONLY)
        try:
            n = os.fstat(fd).st_size
            have += cached_pages(fd, 0, n) or 0
            total += (n + PAGE - 1) // PAGE
        finally:
            os.close(fd)
    return round(have / total, 4) if total else None


def measured(pid: int, size: int, name: str, case: Callable[[], None], record: Path | None,
             image: Path | None = None) -> dict[str, object]:
    """`case` run with `perf stat` (and `perf record` where `record`) attached to the daemon; `image`: the
    directory it reads, whose page-cache share is taken first."""
    gib = size / 2**30
    share = cached_share(image)
    tmp = Path(tempfile.mkdtemp(prefix="perf-"))
    stat_out, perf = tmp / "stat", []
    events = "task-clock,context-switches,cpu-migrations,page-faults"
    cmds = [["perf", "stat", "-x,", "-o", str(stat_out), "-e", events]]
    if record is not None:
        cmds.append(["perf", "record", "-q", "-F", "499", "-g", "-o", str(record)])
    for i, cmd in enumerate(cmds):  # each starts disabled; enabled, and acknowledged, through its control fifos
        ctl, ack = tmp / f"ctl{i}", tmp / f"ack{i}"
        os.mkfifo(ctl)
        os.mkfifo(ack)
        perf.append(subprocess.Popen([*cmd, "-D", "-1", "--control", f"fifo:{ctl},{ack}", "-p", str(pid)],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        with open(ctl, "w") as c, open(ack) as a:
            c.write("enable\n")
            c.flush()
            a.readline()
    c0, v0, i0, t0 = cpu(pid), vmstat(), io(pid), time.perf_counter()
    case()
    wall = time.perf_counter() - t0
    c1, v1, i1 = cpu(pid), vmstat(), io(pid)
    for p in perf:
        p.send_signal(signal.SIGINT)
        p.wait()
    counters = {}
    for line in stat_out.read_text().splitlines():
        f = line.split(",")
        if len(f) > 2 and f[0] and f[0][0].isdigit():
            counters[f[2]] = float(f[0])
    shutil.rmtree(tmp)
    r: dict[str, object] = {
        "case": name, "wall_s": round(wall, 3),
        "daemon_user_s_per_GiB": round((c1[0] - c0[0]) / gib, 3),
        "daemon_sys_s_per_GiB": round((c1[1] - c0[1]) / gib, 3),
        "perf_task_clock_s_per_GiB": round(counters.get("task-clock", 0) / 1e3 / gib, 3),
        "context_switches_per_GiB": round(counters.get("context-switches", 0) / gib),
        "page_faults_per_GiB": round(counters.get("page-faults", 0) / gib),
        "image_in_page_cache_before": share, "daemon_io_delta": {k: i1[k] - i0[k] for k in i1},
        "vmstat_delta": {k: v1[k] - v0.get(k, 0) for k in v1}, "load": os.getloadavg()}
    if record is not None:
        rep = subprocess.run(["perf", "report", "-i", str(record), "--no-children", "--stdio", "-g", "none",
                              "--percent-limit", "1.5", "--sort", "dso,sym"], capture_output=True, text=True).stdout
        r["perf_top"] = [line.strip() for line in rep.splitlines() if line.strip() and not line.startswith("#")]
    return r


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", default="1GiB")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--net-rate", help="also stream from a registry behind a veth pair shaped to this rate")
    ap.add_argument("--record", action="store_true", help="perf record -g each case; its top symbols")
    ap.add_argument("--workdir", default="/var/tmp")
    ap.add_argument("--out")
    ns = ap.parse_args()
    size = parse_size(ns.size)
    rows: list[dict[str, object]] = [{"case": "load before", "load": os.getloadavg()}]
    with tempfile.TemporaryDirectory(prefix="vramd-net-trace-", dir=ns.workdir) as w:
        work = Path(w)
        data, out = work / "bo.bin", work / "out.bin"
        with open(data, "wb") as f:
            for _ in range(size // (8 << 20)):
                f.write(os.urandom(8 << 20))
        runsock = tempfile.mkdtemp(prefix="vb", dir="/tmp")
        os.chmod(runsock, 0o755)
        try:
            with DaemonProcess(runsock, "--chunk-size", "8M", log_level="warning") as d, \
                    Registry(work / "reg") as reg, NetNs() as net:
                (work / "reg-n").mkdir()
                (work / "reg-n" / "storage").symlink_to(reg.storage)
                with Registry(work / "reg-n", listen=net.peer, netns=net.name) as nreg:
                    net.shape(ns.net_rate)
                    img = work / "image"
                    run(vramctl("--socket", d.socket, "dump", "--pid", str(os.getpid()), "--bo-file", str(data),
                                "--image", str(img), "--compress", "none"))
                    ref = f"{reg.host}/bench/r:1"
                    run(vramctl("push", str(img), ref, "--plain-http"))
                    run(vramctl("pull", ref, str(work / "warm"), "--plain-http"))
                    shutil.rmtree(work / "warm")

                    def restore(image: str, *more: str) -> Callable[[], None]:
                        def go() -> None:
                            run(vramctl("--socket", d.socket, "restore", "--pid", str(os.getpid()), "--image", image,
                                        "--bo-file", f"1={out}", *more))
                        return go

                    def fresh_out() -> None:
                        out.unlink(missing_ok=True)
                        out.write_bytes(b"")
                        os.truncate(out, size)

                    cases: list[tuple[str, Callable[[], None]]] = [
                        ("local restore", restore(str(img))),
                        ("local restore of a fresh pull", restore(str(work / "pulled"))),
                        ("streamed, loopback", restore(f"oci://{ref}", "--plain-http", "--no-cache"))]
                    if ns.net_rate:
                        cases.append((f"streamed, [{ns.net_rate}]",
                                      restore(f"oci://{nreg.host}/bench/r:1", "--plain-http", "--no-cache")))
                    for k in range(ns.rounds):
                        for i, (name, case) in enumerate(cases if k % 2 == 0 else cases[::-1]):
                            if "fresh pull" in name:
                                shutil.rmtree(work / "pulled", ignore_errors=True)
                                run(vramctl("pull", ref, str(work / "pulled"), "--plain-http"))
                            fresh_out()
                            rec = work / f"perf-{k}-{i}.data" if ns.record else None
                            src = img if name == "local restore" else work / "pulled" if "pull" in name else None
                            rows.append(measured(d.pid, size, f"{name} #{k + 1}", case, rec, src))
                            print(json.dumps({x: y for x, y in rows[-1].items() if x != "perf_top"}), flush=True)
        finally:
            shutil.rmtree(runsock, ignore_errors=True)
    rows.append({"case": "load after", "load": os.getloadavg()})
    if ns.out:
        Path(ns.out).write_text(json.dumps({"size": size, "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
