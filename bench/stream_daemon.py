#!/usr/bin/env python3
"""The daemon's side of a streamed restore, without a registry: how much of a local restore's time a streamed
one adds when its data file is filled while it runs, side by side in one run.

    python bench/stream_daemon.py --size 1GiB --dir /dev/shm --reps 5

One daemon (8 MiB chunks, its other settings the defaults) and one image of one BO of seeded random bytes in
--dir, dumped uncompressed.  Each repetition runs, in turn:

  local     an ordinary restore of the complete image (Client.run_session), the BO a memfd
  fill      the "download" alone: the image's data files copied in --piece pieces into new files of their full
            length, side by side (pread from the image, pwrite: a registry client's writer once bytes arrive)
  supplied  a streamed restore session (opened on a new copy with the supply pipe's read end) whose files
            were all filled and supplied before it opened: what the gate costs when it never holds a chunk
  streamed  the same session while the fill runs in a thread, each piece followed by its supply message
  notes     `streamed` over a unix socketpair instead of a pipe: the daemon counts each record's readers and
            sends RELEASED and WAITING notes back (vramd/engine/jobs/notes.py), which a thread here reads

It reports each one's median wall seconds, the streamed restore's tail (from its last supply message to the
session's end: what the daemon adds after the fill), its wall against max(local, fill) (issue #35's
target for the whole streamed pull: 1.15), and the daemon's CPU seconds per GiB for local, supplied and
streamed (utime + stime of the daemon process, /proc/PID/stat, before and after).  The fill runs in this
process: on a machine with few cores it competes with the daemon for them, as a registry client's downloads
would (a download that waits on the network would not: --rate paces the fill to a network's rate).
"""
from __future__ import annotations

import argparse
import os
import random
import shutil
import socket
import statistics
import tempfile
import threading
import time
from pathlib import Path

from vramd.client import SESSION_DUMP, SESSION_RESTORE, Client, ClientBo
from vramd.image.manifest import decode_manifest
from vramd.image.names import MANIFEST_NAME
from vramd.image.supply import encode
from vramd.pb import rpc_pb2 as rpc
from vramd.testing import DaemonProcess
from vramd.units import MiB, parse_size

GiB = 1 << 30


def daemon_cpu(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def memfd(size: int, seed: int | None = None) -> int:
    """A memfd of `size` bytes: seeded random ones (no chunk repeats another: nothing deduplicates), or zeros."""
    fd = os.memfd_create("bo", os.MFD_CLOEXEC)
    os.ftruncate(fd, size)
    if seed is not None:
        rnd = random.Random(seed)
        for off in range(0, size, 64 * MiB):
            os.pwrite(fd, rnd.randbytes(min(64 * MiB, size - off)), off)
    return fd


def fill(image: Path, target: Path, names: list[str], piece: int, supply: int | None = None,
         rate: float = 0.0) -> float:
    """Copy the image's data files into the target's (created at their full length), side by side: a piece of
    each in turn (the daemon reads the files' records in chunk order, and a dump spreads chunks over them);
    after each piece, supply that file's end.  `rate` (bytes/s, 0: as fast as it goes): no piece is written
    before the time a download at that rate would have brought it (a network, not the CPU, setting the pace).
    Returns when the last piece was supplied (perf_counter)."""
    sizes = [(image / n).stat().st_size for n in names]
    start, done = time.perf_counter(), 0
    srcs = [os.open(image / n, os.O_RDONLY | os.O_CLOEXEC) for n in names]
    dsts = [os.open(target / n, os.O_WRONLY | os.O_CLOEXEC) for n in names]
    try:
        for off in range(0, max(sizes), piece):
            for i, size in enumerate(sizes):
                n = min(piece, size - off)
                if n <= 0:
                    continue
                data = os.pread(srcs[i], n, off)
                done += n
                if rate:  # (a bench's pacing, standing for the network: nothing here waits on the daemon)
                    time.sleep(max(0.0, start + done / rate - time.perf_counter()))
                os.pwrite(dsts[i], data, off)
                if supply is not None:
                    os.write(supply, encode(i, off + n))
    finally:
        for fd in srcs + dsts:
            os.close(fd)
    return time.perf_counter()


def drain(fd: int) -> None:
    """Read the daemon's notes until it closes its end (what a bounded client does with them is not timed)."""
    while os.read(fd, 1 << 16):
        pass


def fresh(image: Path, where: Path, names: list[str]) -> Path:
    """An empty copy of the image: its manifest, its data files at full length with no bytes."""
    if where.exists():
        shutil.rmtree(where)
    where.mkdir()
    shutil.copy(image / MANIFEST_NAME, where / MANIFEST_NAME)
    for n in names:
        with open(where / n, "wb") as f:
            f.truncate((image / n).stat().st_size)
    return where


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="1GiB")
    ap.add_argument("--dir", default="/dev/shm", help="where the images go (tmpfs by default)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--piece", default="8MiB", help="bytes the fill writes (and supplies) at a time")
    ap.add_argument("--rate", type=float, default=0.0,
                    help="GB/s the fill is paced to, as a download would be (default: unpaced, a CPU copy)")
    a = ap.parse_args()
    size, piece, rate = parse_size(a.size), parse_size(a.piece), a.rate * 1e9
    top = Path(tempfile.mkdtemp(prefix="vramd-stream-bench-", dir=a.dir))
    run_dir = tempfile.mkdtemp(prefix="vramd-b", dir="/tmp")
    rows: dict[str, list[float]] = {k: [] for k in ("local", "fill", "supplied", "streamed", "notes", "tail",
                                                    "local_cpu", "supplied_cpu", "streamed_cpu", "notes_cpu",
                                                    "notes_tail")}
    try:
        with DaemonProcess(run_dir, "--chunk-size", "8M", log_level="warning") as d, Client(d.socket) as c:
            image = top / "image"
            image.mkdir()
            src, dst = memfd(size, seed=35), memfd(size)
            dfd = os.open(image, os.O_RDONLY | os.O_DIRECTORY)
            try:
                assert c.run_session(SESSION_DUMP, dfd, [ClientBo(1, src, size=size)],
                                     compression="none").state == rpc.SESSION_DONE
            finally:
                os.close(dfd)
                os.close(src)  # (its bytes are the image's now)
            m = decode_manifest((image / MANIFEST_NAME).read_bytes())
            names = [f.name for f in m.files]
            for _ in range(a.reps):
                dfd = os.open(image, os.O_RDONLY | os.O_DIRECTORY)
                cpu, t = daemon_cpu(d.pid), time.perf_counter()
                assert c.run_session(SESSION_RESTORE, dfd, [ClientBo(1, dst)]).state == rpc.SESSION_DONE
                rows["local"].append(time.perf_counter() - t)
                rows["local_cpu"].append((daemon_cpu(d.pid) - cpu) / (size / GiB))
                os.close(dfd)

                target = fresh(image, top / "fill", names)
                t = time.perf_counter()
                fill(image, target, names, piece, rate=rate)
                rows["fill"].append(time.perf_counter() - t)
                shutil.rmtree(target)  # (one copy at a time on the file system)

                for kind in ("supplied", "streamed", "notes"):
                    target = fresh(image, top / kind, names)
                    reader = None
                    if kind == "notes":
                        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
                        w, r = ours.detach(), theirs.detach()
                        reader = threading.Thread(target=drain, args=(w,))
                    else:
                        r, w = os.pipe2(os.O_CLOEXEC)
                    if kind == "supplied":  # every byte written and supplied before the session opens
                        fill(image, target, names, piece, w)  # (unpaced: supplied before it opens)
                    dfd = os.open(target, os.O_RDONLY | os.O_DIRECTORY)
                    cpu, t = daemon_cpu(d.pid), time.perf_counter()
                    s = c.open_session(SESSION_RESTORE, dfd, supply_fd=r)
                    os.close(r)
                    os.close(dfd)
                    c.add_bos(s.token, [ClientBo(1, dst)])
                    c.start(s.token)
                    last: list[float] = []
                    if reader is not None:
                        reader.start()
                    if kind != "supplied":
                        writer = threading.Thread(target=lambda out=last, to=target, fd=w: out.append(
                            fill(image, to, names, piece, fd, rate)))
                        writer.start()
                        writer.join()
                    if reader is None:
                        os.close(w)
                    else:  # our direction ends; the notes come until the daemon closes its end
                        shut = socket.socket(fileno=w)
                        shut.shutdown(socket.SHUT_WR)
                        shut.detach()
                    assert c.wait(s.token).state == rpc.SESSION_DONE
                    done = time.perf_counter()
                    rows[kind].append(done - t)
                    if last:
                        rows["tail" if kind == "streamed" else "notes_tail"].append(done - last[0])
                    rows[f"{kind}_cpu"].append((daemon_cpu(d.pid) - cpu) / (size / GiB))
                    c.close_session(s.token)
                    if reader is not None:
                        reader.join()
                        os.close(w)
                    shutil.rmtree(target)
            os.close(dst)
    finally:
        shutil.rmtree(top, ignore_errors=True)
        shutil.rmtree(run_dir, ignore_errors=True)
    med = {k: statistics.median(v) for k, v in rows.items()}
    paced = f", fill paced to {a.rate:g} GB/s" if a.rate else ""
    print(f"{size / GiB:g} GiB, {a.reps} reps{paced}, medians (load: {os.getloadavg()[0]:.1f}):")
    for k in ("local", "fill", "supplied", "streamed", "notes"):
        print(f"  {k:9s} {med[k]:.3f} s  {size / med[k] / 1e9:.2f} GB/s   (runs: "
              f"{', '.join(f'{x:.3f}' for x in rows[k])})")
    print(f"  streamed / max(local, fill) = {med['streamed'] / max(med['local'], med['fill']):.2f}")
    print(f"  tail (streamed: from the last supply message to DONE) {med['tail'] * 1e3:.1f} ms")
    print(f"  daemon CPU s/GiB: local {med['local_cpu']:.3f}, supplied {med['supplied_cpu']:.3f}, "
          f"streamed {med['streamed_cpu']:.3f}, notes {med['notes_cpu']:.3f}")
    print(f"  tail (notes) {med['notes_tail'] * 1e3:.1f} ms")


if __name__ == "__main__":
    main()
