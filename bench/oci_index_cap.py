"""What the registry accepts as an image's manifest: one image past the distribution registry's 4 MiB cap on a
manifest body, pushed as one manifest (refused) and as an OCI image index of parts (accepted), then pulled.

    .venv/bin/python bench/oci_index_cap.py --chunks 32768 --out /tmp/cap.json

A daemon with 4 KiB chunks (the smallest, so that the layer count of a multi-hundred-GB process fits in a
small image: a layer's JSON is the same whatever the chunk size, but for its size's digits) dumps `--chunks`
chunks of incompressible bytes (codec none); against a fresh registry (Debian's docker-registry,
vramd/testing/registry.py, plain HTTP on 127.0.0.1): `vramctl push --max-manifest-bytes` larger than the image's
manifest (one manifest: the registry's answer), then `vramctl push` with the default budget (an index: its
parts' and its own sizes, the wall time), a second push (blob bytes uploaded), and `vramctl pull` (the
directory byte for byte).  The machine's load is recorded: the registry, vramctl and the daemon share it.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from vramd.oci.index import (  # noqa: E402
    ANN_TYPE,
    DEFAULT_MAX_MANIFEST,
    MAX_MAX_MANIFEST,
    Index,
    assemble,
    decode_part,
    decode_top,
)
from vramd.oci.layout import encode_oci_manifest  # noqa: E402
from vramd.oci.registry import Registry as Client  # noqa: E402
from vramd.oci.tls import Trust  # noqa: E402
from vramd.testing import DaemonProcess  # noqa: E402
from vramd.testing.registry import Registry  # noqa: E402


def vramctl(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "vramd.cli", *args], cwd=ROOT, capture_output=True, text=True)


def files(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir())}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--chunks", type=int, default=32768, help="4 KiB chunks in the image (default 32768)")
    ap.add_argument("--concurrency", default="16")
    ap.add_argument("--out", help="the results as JSON")
    a = ap.parse_args()
    res: dict[str, object] = {"load_before": os.getloadavg(), "chunks": a.chunks}
    with tempfile.TemporaryDirectory(prefix="vramd-cap-") as tmp:
        work = Path(tmp)
        data, img = work / "bo.bin", work / "image"
        data.write_bytes(os.urandom(a.chunks * 4096))
        run = work / "run"
        run.mkdir()
        os.chmod(run, 0o755)
        with DaemonProcess(str(run), "--chunk-size", "4K", log_level="warning") as d:
            r = vramctl("--socket", d.socket, "dump", "--pid", str(os.getpid()), "--bo-file", str(data), "--image",
                        str(img), "--compress", "none", "--json")
            assert r.returncode == 0, r.stderr
        common = ["--plain-http", "--json", "--concurrency", a.concurrency, "--cache", str(work / "cache")]
        with Registry(work / "reg") as reg:
            ref = f"{reg.host}/cap/image"
            r = vramctl("push", str(img), f"{ref}:one", *common, "--max-manifest-bytes", str(MAX_MAX_MANIFEST))
            res["one_manifest"] = {"exit": r.returncode, "error": r.stderr.strip()}
            t0 = time.monotonic()
            r = vramctl("push", str(img), f"{ref}:index", *common)
            assert r.returncode == 0, r.stderr
            res["index_push_s"] = round(time.monotonic() - t0, 2)
            pushed = json.loads(r.stdout)
            c = Client(reg.host, trust=Trust(plain_http=True))
            try:
                body, digest = c.get_manifest("cap/image", "index", 1 << 20)
                doc = json.loads(body)
                bodies = [c.get_manifest("cap/image", m["digest"], 1 << 23)[0] for m in doc["manifests"]]
            finally:
                c.close()
            top = decode_top(body, "index")
            assert isinstance(top, Index)
            art = assemble(top, [decode_part(b, "part", first=i == 0) for i, b in enumerate(bodies)], "index")
            ann = {k: v for k, v in art.annotations.items() if k != ANN_TYPE}
            one = encode_oci_manifest(art.config, art.skeleton, art.chunks, None, ann)  # what the first push sent
            res.update(digest=digest, media_type=doc["mediaType"], index_bytes=len(body),
                       part_bytes=[len(b) for b in bodies], layers=len(art.chunks), budget=DEFAULT_MAX_MANIFEST,
                       one_manifest_bytes=len(one), stats=pushed["stats"])
            r = vramctl("push", str(img), f"{ref}:index", *common)
            res["second_push_bytes_uploaded"] = json.loads(r.stdout)["stats"]["bytes_uploaded"]
            t0 = time.monotonic()
            r = vramctl("pull", f"{ref}:index", str(work / "pulled"), "--plain-http", "--json", "--concurrency",
                        a.concurrency)
            assert r.returncode == 0, r.stderr
            res["pull_s"] = round(time.monotonic() - t0, 2)
            res["pull_byte_exact"] = files(work / "pulled") == files(img)
    res["load_after"] = os.getloadavg()
    text = json.dumps(res, indent=1)
    print(text)
    if a.out:
        Path(a.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
