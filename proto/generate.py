#!/usr/bin/env python3
"""Regenerate the committed protobuf Python code from proto/.

    python proto/generate.py            # rewrite vramd/pb/*_pb2.py(i)
    python proto/generate.py --check    # exit 1 if the committed code drifted

The generator is grpcio-tools (pinned in pyproject's `test` extra), which
bundles its own protoc, so every machine produces identical bytes.
"""
from __future__ import annotations

import argparse
import filecmp
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "proto"
OUT_PKG = "vramd/pb"


def proto_files() -> list[Path]:
    return sorted((PROTO_ROOT / OUT_PKG).glob("*.proto"))


def generate(out_root: Path) -> list[Path]:
    from grpc_tools import protoc  # imported late: only the generator needs it

    files = proto_files()
    args = ["protoc", f"-I{PROTO_ROOT}", f"--python_out={out_root}", f"--pyi_out={out_root}"]
    args += [str(p.relative_to(PROTO_ROOT)) for p in files]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")
    outs = []
    for p in files:
        stem = p.relative_to(PROTO_ROOT).with_suffix("")
        outs += [out_root / f"{stem}_pb2.py", out_root / f"{stem}_pb2.pyi"]
    return outs


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="compare instead of writing")
    ns = ap.parse_args()
    if not ns.check:
        generate(ROOT)
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        drift = []
        for out in generate(Path(tmp)):
            committed = ROOT / out.relative_to(tmp)
            if not committed.exists() or not filecmp.cmp(out, committed, shallow=False):
                drift.append(str(committed.relative_to(ROOT)))
        if drift:
            print("generated protobuf code drifted; run python proto/generate.py:", *drift, sep="\n  ")
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
