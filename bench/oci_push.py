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
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from oci_restore import ROOT, restore, row, timed, vramctl  # noqa: E402  (bench/oci_restore.py, beside this file)

from vramd.testing import DaemonProcess  # noqa: E402
from vramd.testing.registry import Registry  # noqa: E402
from vramd.units import parse_size  # noqa: E402


def requests(reg: Registry) -> int:
    """Requests the registry answered, its fixture's own readiness and settle probes (GET /v2/) not counted."""
    return sum(1 for r in reg.access_log() if r.path.split("?")[0] != "/v2/")


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


def hashes(size: int) -> list[dict[str, object]]:
    """CPU s/GiB of each hashing pass over `size` bytes in 8 MiB chunks, in memory (no I/O), one thread: the
    dump's BLAKE3 (chunk identity: dedup, incrementals) against the push's sha256 (the OCI blob digest)."""

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
