"""vramctl push / pull against the local registry, side by side with skopeo moving the same bytes.

    .venv/bin/python bench/oci_push.py --size 512MiB --chunks 1M,8M,32M --out bench/measured/oci.json
    .venv/bin/python bench/oci_push.py --storage --size 256MiB     # registry bytes: 4 replicas, a chain of 5
    .venv/bin/python bench/oci_push.py --restore --size 512MiB     # restore from a reference (streamed) vs its parts
    .venv/bin/python bench/oci_push.py --restore --size 1GiB --rounds 3 --net-rate none,10gbit  # + over a veth pair
    .venv/bin/python bench/oci_push.py --hashes --size 1GiB        # the dump's BLAKE3 pass vs the push's sha256 pass
    .venv/bin/python bench/oci_push.py --all --size 4GiB --chunks 8M --out bench/measured/oci-4g.json  # all, one run

For each chunk size: a daemon (--chunk-size) dumps --size of incompressible bytes (one BO file, codec none),
then, each against a fresh registry (Debian's docker-registry, vramd/testing/registry.py, plain HTTP on
127.0.0.1): `vramctl push` (first push: every blob), the same push again (every blob there: HEADs only),
`vramctl pull` into an empty directory, and `skopeo copy` of the very artifact from an OCI layout (made by skopeo
from the registry beforehand) into another fresh registry: the peer moving the same blobs.  Reported: wall
seconds, GB/s (decimal) of payload, CPU s/GiB of the client (vramctl's or skopeo's children rusage; the
registry runs on the same cores and is not counted), requests (the registry's access log).  The registry, the
client and the daemon share the machine: its load is recorded.
"""
from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
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

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from net import NetNs  # noqa: E402  (bench/net.py, beside this file)

from vramd.testing import DaemonProcess  # noqa: E402
from vramd.testing.registry import Registry  # noqa: E402
from vramd.units import parse_size  # noqa: E402


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


def cpu_of(pid: int | None) -> float:
    """CPU s (user + system) a running process has used so far (/proc/PID/stat); 0 for None."""
    if pid is None:
        return 0.0
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def requests(reg: Registry) -> int:
    """Requests the registry answered, its fixture's own readiness and settle probes (GET /v2/) not counted."""
    return sum(1 for r in reg.access_log() if r.path.split("?")[0] != "/v2/")


def vramctl(*args: str) -> list[str]:
    return [sys.executable, "-m", "vramd.cli", *args]


def row(name: str, wall: float, cpu: float, nbytes: int, requests: int) -> dict[str, object]:
    gib = nbytes / 2**30
    return {"case": name, "wall_s": round(wall, 3), "GB_per_s": round(nbytes / wall / 1e9, 3) if wall else None,
            "cpu_s_per_GiB": round(cpu / gib, 3) if gib else None, "requests": requests, "bytes": nbytes}


def one_chunk_size(work: Path, size: int, chunk: str) -> list[dict[str, object]]:
    data = work / "bo.bin"
    with open(data, "wb") as f:
        for _ in range(size // (8 << 20)):
            f.write(os.urandom(8 << 20))
    img = work / f"image-{chunk}"
    run = tempfile.mkdtemp(prefix="vb", dir="/tmp")
    os.chmod(run, 0o755)
    try:
        with DaemonProcess(run, "--chunk-size", chunk, log_level="warning") as d:
            subprocess.run(vramctl("--socket", d.socket, "dump", "--pid", str(os.getpid()), "--bo-file", str(data),
                                   "--image", str(img), "--compress", "none"), cwd=ROOT, check=True,
                           capture_output=True)
    finally:
        shutil.rmtree(run, ignore_errors=True)
    rows = []
    with Registry(work / f"reg-a-{chunk}") as a, Registry(work / f"reg-b-{chunk}") as b:
        ref = f"{a.host}/bench/img:1"
        cache = str(work / f"push-cache-{chunk}")  # the push's skeleton cache: this run's own, empty at first
        wall, cpu, _ = timed(vramctl("push", str(img), ref, "--plain-http", "--json", "--cache", cache))
        rows.append(row(f"vramctl push ({chunk} chunks)", wall, cpu, size, requests(a)))
        n = requests(a)
        wall, cpu, _ = timed(vramctl("push", str(img), ref, "--plain-http", "--json", "--cache", cache))
        rows.append(row(f"vramctl push again ({chunk})", wall, cpu, size, requests(a) - n))
        n = requests(a)
        wall, cpu, _ = timed(vramctl("push", str(img), ref, "--plain-http", "--json", "--cache", cache + "-none"))
        rows.append(row(f"vramctl push again, no cached skeleton ({chunk})", wall, cpu, size, requests(a) - n))
        # what a re-push cannot avoid: the interpreter and vramd's imports (vramctl --help: parse, print, exit)
        wall, cpu, _ = timed(vramctl("--help"))
        rows.append(row("vramctl --help (start-up alone)", wall, cpu, 0, 0))
        n = requests(a)
        wall, cpu, _ = timed(vramctl("pull", ref, str(work / f"pulled-{chunk}"), "--plain-http", "--json"))
        rows.append(row(f"vramctl pull ({chunk})", wall, cpu, size, requests(a) - n))
        layout = work / f"layout-{chunk}"
        subprocess.run(["skopeo", "copy", "--src-tls-verify=false", f"docker://{ref}", f"oci:{layout}:1"],
                       check=True, capture_output=True)
        wall, cpu, _ = timed(["skopeo", "copy", "--dest-tls-verify=false", f"oci:{layout}:1",
                              f"docker://{b.host}/bench/img:1"])
        rows.append(row(f"skopeo copy oci: -> registry ({chunk})", wall, cpu, size, requests(b)))
    for p in (img, work / f"pulled-{chunk}", layout, work / f"push-cache-{chunk}", work / f"push-cache-{chunk}-none"):
        shutil.rmtree(p, ignore_errors=True)
    return rows


def storage(work: Path, size: int) -> list[dict[str, object]]:
    """Registry-side bytes: 4 replicas (the same BOs dumped by 4 daemons, pushed to 4 tags) against one, and a
    chain of 5 incrementals (each child changes 1 of every 16 chunks of 8 MiB) against what each child stores."""
    rows: list[dict[str, object]] = []
    data = work / "bo.bin"
    with open(data, "wb") as f:
        for _ in range(size // (8 << 20)):
            f.write(os.urandom(8 << 20))
    with Registry(work / "reg-storage") as reg:
        sizes = []
        for k in range(4):
            run = tempfile.mkdtemp(prefix="vb", dir="/tmp")
            os.chmod(run, 0o755)
            try:
                with DaemonProcess(run, "--chunk-size", "8M", log_level="warning") as d:
                    img = work / f"replica{k}"
                    subprocess.run(vramctl("--socket", d.socket, "dump", "--pid", str(os.getpid()), "--bo-file",
                                           str(data), "--image", str(img), "--compress", "none"),
                                   cwd=ROOT, check=True, capture_output=True)
            finally:
                shutil.rmtree(run, ignore_errors=True)
            before = reg.stored_bytes()
            timed(vramctl("push", str(img), f"{reg.host}/replicas/job:rank{k}", "--plain-http", "--json", "--cache",
                          str(work / "push-cache")))
            sizes.append(reg.stored_bytes() - before)
        rows.append({"case": "4 replicas: registry bytes / one replica's", "ratio": round(sum(sizes) / sizes[0], 4),
                     "bytes": sizes})
    with Registry(work / "reg-chain") as reg:
        run = tempfile.mkdtemp(prefix="vb", dir="/tmp")
        os.chmod(run, 0o755)
        try:
            with DaemonProcess(run, "--chunk-size", "8M", log_level="warning") as d:
                prev = None
                for step in range(6):
                    changed = size
                    if step:  # a child: 1 chunk in 16 rewritten
                        changed = 0
                        with open(data, "r+b") as f:
                            for off in range((step % 16) << 23, size, 16 << 23):
                                f.seek(off)
                                f.write(os.urandom(8 << 20))
                                changed += 8 << 20
                    img = work / f"step{step}"
                    more = ["--parent", str(prev)] if prev else []
                    out = subprocess.run(vramctl("--socket", d.socket, "dump", "--pid", str(os.getpid()), "--bo-file",
                                                 str(data), "--image", str(img), "--compress", "none", "--json", *more),
                                         cwd=ROOT, check=True, capture_output=True, text=True).stdout
                    stored = json.loads(out)["image"]["stored_bytes"]
                    before = reg.stored_bytes()
                    _w, _c, pushed = timed(vramctl("push", str(img), f"{reg.host}/chain/job:step{step}", "--plain-http",
                                                   "--json", "--cache", str(work / "push-cache")))
                    up = json.loads(pushed)["stats"]["bytes_uploaded"]
                    grew = reg.stored_bytes() - before
                    rows.append({"case": f"chain step {step}" + (" (base)" if not step else ""),
                                 "changed": changed, "stored_by_image": stored, "uploaded": up, "registry_grew": grew,
                                 "ratio": round(grew / stored, 4) if stored else None,
                                 "uploaded_over_changed": round(up / changed, 4)})
                    prev = img
        finally:
            shutil.rmtree(run, ignore_errors=True)
    return rows


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
    each rate ("none": the pair unshaped), rows tagged "[RATE]"; the settings' order rotates from round to round."""
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
            for k in range(rounds):  # interleaved: each round's cases see the machine in about the same state
                tag = f" #{k + 1}" if rounds > 1 else ""
                rows.append({"case": "load average before round" + tag, "load": os.getloadavg()})
                trees = [(t, btag) for t, btag in ((ROOT, ""), (baseline, " (baseline)")) if t is not None]
                if k % 2:  # which of the two goes first alternates
                    trees.reverse()
                rows.append(procs(d, reg, size, partial(timed, restore_cmd(str(img))),
                                  "restore of the local directory alone" + tag))
                check()
                for net, r in settings[k % len(settings):] + settings[:k % len(settings)]:
                    if ns is not None and r is not reg:
                        ns.shape(None if net == " [none]" else net.strip(" []"), net_delay)
                    ref = f"{r.host}/bench/r:1"
                    for tree, btag in trees:
                        rows.append(procs(d, r, size, partial(timed, vramctl("pull", ref, str(work / "pulled"),
                                                                             "--plain-http"), tree),
                                          "pull alone" + net + btag + tag))
                        shutil.rmtree(work / "pulled")
                    wall1, cpu1, _ = timed(vramctl("pull", ref, str(work / "pulled"), "--plain-http"))
                    wall2, cpu2, _ = timed(restore_cmd(str(work / "pulled")))
                    check()
                    rows.append(row("pull, then restore the pulled directory" + net + tag, wall1 + wall2,
                                    cpu1 + cpu2, size, 0))
                    shutil.rmtree(work / "pulled")
                    for tree, btag in trees:
                        shutil.rmtree(cache, ignore_errors=True)
                        rows.append(procs(d, r, size, partial(timed, restore_cmd(
                            f"oci://{ref}", "--plain-http", "--cache", str(cache)), tree),
                            "restore --image oci:// streamed (cold cache)" + net + btag + tag))
                        check()
            rows.append({"case": "load average after the rounds", "load": os.getloadavg()})
            if ns is not None:
                rows.append({"case": "qdiscs (the last setting)", "tc": ns.qdiscs()})
            ref = f"{reg.host}/bench/r:1"
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


def hashes(size: int) -> list[dict[str, object]]:
    """CPU s/GiB of each hashing pass over `size` bytes in 8 MiB chunks, in memory (no I/O), one thread: the
    dump's BLAKE3 (chunk identity: dedup, incrementals) against the push's sha256 (the OCI blob digest)."""
    import hashlib

    import blake3
    buf = os.urandom(64 << 20)
    views = [memoryview(buf)[i:i + (8 << 20)] for i in range(0, len(buf), 8 << 20)]
    rows: list[dict[str, object]] = []
    for name, fn in (("BLAKE3 (dump: chunk identity)", lambda v: blake3.blake3(v).digest()),
                     ("sha256 (push: OCI blob digest)", lambda v: hashlib.sha256(v).digest())):
        c0, t0 = time.process_time(), time.perf_counter()
        done = 0
        while done < size:
            for v in views:
                fn(v)
            done += len(buf)
        rows.append(row(name, time.perf_counter() - t0, time.process_time() - c0, done, 0))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", default="512MiB")
    ap.add_argument("--chunks", default="1M,8M,32M")
    ap.add_argument("--workdir", default="/var/tmp")
    ap.add_argument("--out")
    ap.add_argument("--storage", action="store_true", help="instead: registry bytes for replicas and a chain")
    ap.add_argument("--restore", action="store_true", help="instead: restore from a reference against its parts")
    ap.add_argument("--hashes", action="store_true", help="instead: CPU s/GiB of the BLAKE3 and sha256 passes")
    ap.add_argument("--all", action="store_true", help="every case above, one after another in one run")
    ap.add_argument("--rounds", type=int, default=1, help="--restore: repeat its cold cases this often, interleaved")
    ap.add_argument("--baseline", type=Path, help="--restore: another checkout's root: its vramctl's pull and "
                    "streamed restore are timed too, alternating with this tree's in each round")
    ap.add_argument("--net-rate", help="--restore, root: also against a registry in its own network namespace "
                    "behind a veth pair limited by tc to each of these rates (e.g. none,25gbit,10gbit; bench/net.py)")
    ap.add_argument("--net-delay", help="with --net-rate: a netem delay each way too (e.g. 100us)")
    ns = ap.parse_args()
    size = parse_size(ns.size)
    rows: list[dict[str, object]] = []
    load = [os.getloadavg()]
    free = {d: shutil.disk_usage(d).free for d in (ns.workdir, str(ROOT))}
    with tempfile.TemporaryDirectory(prefix="vramd-oci-bench-", dir=ns.workdir) as w:
        def phase(name: str) -> Path:  # each phase in its own directory, the last one's gone: disk stays bounded
            for old in Path(w).iterdir():
                shutil.rmtree(old, ignore_errors=True)
            d = Path(w) / name
            d.mkdir()
            return d
        if ns.hashes or ns.all:
            rows += hashes(size)
        if not (ns.storage or ns.restore or ns.hashes) or ns.all:
            for chunk in ns.chunks.split(","):
                rows += one_chunk_size(phase("push"), size, chunk)
                load.append(os.getloadavg())
        if ns.restore or ns.all:
            rows += restore(phase("restore"), size, ns.rounds, ns.baseline,
                            ns.net_rate.split(",") if ns.net_rate else None, ns.net_delay)
            load.append(os.getloadavg())
        if ns.storage or ns.all:
            rows += storage(phase("storage"), size)
    load.append(os.getloadavg())
    result: dict[str, object] = {"size": size, "load_before_after": load, "free_disk_before": free, "rows": rows}
    walls = {str(r["case"]): float(str(r["wall_s"])) for r in rows if "wall_s" in r}
    ratios: dict[str, list[float]] = {}  # the target: streamed <= 1.15 x max(pull alone, local restore alone)
    nets = [""] + [f" [{r}]" for r in (ns.net_rate.split(",") if ns.net_rate else [])]
    for net in nets:
        for btag in ("", " (baseline)"):
            for k in range(ns.rounds):
                tag = f" #{k + 1}" if ns.rounds > 1 else ""
                streamed = walls.get("restore --image oci:// streamed (cold cache)" + net + btag + tag)
                if streamed is not None:
                    parts = max(walls["pull alone" + net + btag + tag],
                                walls["restore of the local directory alone" + tag])
                    who = (btag.strip(" ()") or "this tree") + (net or " [loopback]")
                    ratios.setdefault(who, []).append(round(streamed / parts, 3))
    if ratios:
        result["streamed_over_max_parts"] = ratios
    if ns.out:
        Path(ns.out).write_text(json.dumps(result, indent=2) + "\n")
    for r in rows:
        if "wall_s" not in r:
            print(json.dumps(r))
            continue
        other = (f"  daemon {r['daemon_cpu_s_per_GiB']} registry {r['registry_cpu_s_per_GiB']}"
                 if "daemon_cpu_s_per_GiB" in r else "")
        print(f"{r['case']:42} {r['wall_s']:8.3f} s {r['GB_per_s']!s:>7} GB/s {r['cpu_s_per_GiB']!s:>6} CPU s/GiB "
              f"{r['requests']:6} requests{other}")
    if ratios:
        for who, rs in ratios.items():
            print(f"streamed restore / max(pull alone, local restore alone), per round, {who}: {rs} (target <= 1.15)")


if __name__ == "__main__":
    main()
