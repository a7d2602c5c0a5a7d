"""End-to-end demo through the daemon: dump a live process, restore into a fresh one, verify.

    ./dev.sh demo [--size 2G] [--image DIR] [--compress zstd:1] [--socket PATH]
    python -m vramd.cli.demo ...      (the same, in a prepared virtual environment)

Starts a `vramd` daemon (unless --socket names one already running), a
workload process holding mixed buffers (random, zero, patterned, odd
sizes), and dumps them through the daemon's socket: the demo opens
/proc/<pid>/mem, creates the image's files in the image directory
(vramd.client does, with the demo's rights) and passes the fds, as a CRIU
plugin would.  Then it starts a fresh process with garbage at the same
addresses, submits the restore on one connection and waits for it on
another (the offload barrier), checks every buffer byte for byte, and has
the daemon re-verify the image.  Exit status 0 only if everything matched.
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from contextlib import ExitStack
from typing import Any

from ..client import SESSION_DUMP, SESSION_RESTORE, SESSION_VERIFY, Client, ClientBo
from ..errors import VramdError
from ..image.compression import FORMS, compression_arg
from ..pb import rpc_pb2 as rpc
from ..testing.launcher import DaemonProcess
from ..testing.workload import Workload, blank_spec_like
from ..units import format_size, size_arg
from .common import Failure, no_connection
from .progress import Lines
from .progress import follow as _follow


def mixed_spec(total: int) -> list[dict[str, Any]]:
    r, z = total * 3 // 8, total * 3 // 8
    p = total - r - z
    return [
        {"size": r - 12345, "fill": "random", "seed": 11},
        {"size": z, "fill": "zero", "marks": [[z // 2, "c0ffee"]]},
        {"size": p - 4096, "fill": "pattern", "seed": 7, "skew": 100},
        {"size": 12345 + 4096, "fill": "random", "seed": 12},
        {"size": 1, "fill": "random", "seed": 13},
        {"size": 0},
    ]


def follow(client: Client, token: str, label: str) -> tuple[rpc.SessionInfo, float]:
    """Wait for a session, printing progress (a live line on a TTY); returns (final info, seconds)."""
    lines = Lines(label)
    try:
        return _follow(client, token, lines)
    finally:
        lines.close()


def gbps(nbytes: int, secs: float) -> str:
    return f"{nbytes / secs / 1e9:.2f} GB/s"


def run_demo(sock: str, total: int, image: str, compression: str) -> bool:
    ok = True
    with ExitStack() as stack:
        dfd = os.open(image, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        stack.callback(os.close, dfd)
        c = stack.enter_context(Client(sock, name="vramd-demo"))
        print(f"daemon:  {c.hello.server} at {sock}; backends: "
              + ", ".join(b.name for b in c.hello.backends if b.available))
        spec = mixed_spec(total)
        print(f"workload: starting a process holding {format_size(total)} in {len(spec)} buffers")
        with Workload(spec) as src:
            want, regions = [r["digest"] for r in src.regions], src.regions
            mem = src.open_mem()
            try:
                s = c.open_session(SESSION_DUMP, dfd, compression=compression, label="demo dump")
                t0 = time.perf_counter()
                c.add_bos(s.token, [ClientBo(i + 1, mem, offset=r["addr"], size=r["size"], va_addr=r["addr"],
                                             backend="procmem") for i, r in enumerate(regions)])
                c.start(s.token)
                info, _ = follow(c, s.token, "dump")
                secs = time.perf_counter() - t0
                c.close_session(s.token)
            finally:
                os.close(mem)
        im = info.image
        print(f"dump:    {format_size(im.bo_bytes)} in {secs:.2f} s = {gbps(im.bo_bytes, secs)}; image stores "
              f"{format_size(im.stored_bytes)} ({im.compression}); {format_size(im.zero_bytes)} of zeros kept as holes")

        with Workload(blank_spec_like(regions)) as dst, Client(sock, name="vramd-demo waiter") as waiter:
            mem = dst.open_mem(os.O_RDWR)
            try:
                t0 = time.perf_counter()
                s = c.open_session(SESSION_RESTORE, dfd, label="demo restore")
                c.add_bos(s.token, [ClientBo(i + 1, mem, offset=r["addr"], backend="procmem")
                                    for i, r in enumerate(regions)])
                c.start(s.token)  # copying runs already; the submitter is free to go on
                info, _ = follow(waiter, s.token, "restore")  # the barrier, on another connection
                secs = time.perf_counter() - t0
                waiter.close_session(s.token)
            finally:
                os.close(mem)
            print(f"restore: {format_size(im.bo_bytes)} in {secs:.2f} s = {gbps(im.bo_bytes, secs)} into a fresh "
                  f"process (pid {dst.pid}) at the same addresses, awaited on a second connection")
            got = dst.digests()
        for i, (a, b) in enumerate(zip(want, got)):
            if a != b:
                ok = False
                print(f"MISMATCH: buffer {i + 1} at {regions[i]['addr']:#x} differs after restore")
        print(f"compare: {len(want)} buffers, " + ("every byte equal" if ok else "DIFFERENCES FOUND"))
        s = c.open_session(SESSION_VERIFY, dfd, label="demo verify")
        info = c.wait(s.token)
        c.close_session(s.token)
        print(f"verify:  {info.progress.chunks_done} chunks re-read by the daemon, every checksum good")
        moved = [line for line in c.status().metrics.splitlines() if line.startswith("vramd_bytes_total")]
        print("metrics: " + "; ".join(moved))
    print("RESULT: byte-exact round trip" if ok else "RESULT: FAILED")
    return ok


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="./dev.sh demo", description=__doc__.splitlines()[0])
    ap.add_argument("--size", type=size_arg, default="2G", help="total bytes the workload holds (default 2G)")
    ap.add_argument("--image", help="image directory (default: a temporary one, removed afterwards)")
    ap.add_argument("--compress", type=compression_arg, default="zstd:1",
                    help=f"{FORMS} (default zstd:1)")
    ap.add_argument("--socket", help="use the daemon already listening here instead of starting one")
    ns = ap.parse_args(argv)
    total = ns.size
    try:
        return _demo(ns, total)
    except (Failure, VramdError, OSError) as e:  # one line: what, where, what to do
        if isinstance(e, VramdError):
            reason = f"{e.code}: {e.describe()}"
        elif isinstance(e, OSError) and e.strerror:  # its words and the file, not Python's "[Errno N] ..."
            reason = f"{e.filename}: {e.strerror}" if e.filename else e.strerror
        else:
            reason = str(e)
        print(f"vramd-demo: {reason}", file=sys.stderr)
        return 1


def _demo(ns: argparse.Namespace, total: int) -> int:
    if ns.socket:  # first, before anything is made: the one line names the socket and what to do
        try:
            Client(ns.socket, name="vramd-demo").close()
        except ConnectionError as e:
            why = no_connection(str(e), ns.socket)
            if why == str(e):
                why += ": is vramd listening there? (without --socket the demo starts a daemon of its own)"
            raise Failure(why) from None
    image = ns.image or tempfile.mkdtemp(prefix="vramd-demo-", dir="/var/tmp")
    try:
        os.makedirs(image, exist_ok=True)
    except OSError as e:
        why = "it exists and is not a directory" if os.path.lexists(image) else (e.strerror or str(e))
        raise Failure(f"cannot make the image directory {image} (--image): {why}: give a directory that is not "
                      "there yet, or an empty one") from None
    run_dir = tempfile.mkdtemp(prefix="vramd-demo-run-")
    daemon = None
    try:
        if ns.socket:
            sock = ns.socket
        else:
            log_path = os.path.join(image if ns.image else run_dir, "vramd.log")
            with open(log_path, "w") as log:
                daemon = DaemonProcess(run_dir, log_level="info", stderr=log)
            print(f"daemon:  started vramd (pid {daemon.pid}); its log: {log_path if ns.image else 'discarded'}")
            sock = daemon.socket
        ok = run_demo(sock, total, image, ns.compress)
        if daemon is not None:
            rc = daemon.stop()
            print(f"daemon:  stopped with SIGTERM, exit status {rc}")
            ok = ok and rc == 0
        return 0 if ok else 1
    finally:
        if daemon is not None:
            daemon.close()
        shutil.rmtree(run_dir, ignore_errors=True)
        if not ns.image:
            shutil.rmtree(image, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
