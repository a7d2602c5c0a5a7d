"""The committed protobuf code is exactly what proto/generate.py produces."""
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_generated_code_matches_proto_sources():
    r = subprocess.run([sys.executable, str(ROOT / "proto" / "generate.py"), "--check"],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def test_every_typed_error_has_a_wire_code():
    __import__("vramd.topology")  # defines its errors
    from vramd.errors import VramdError, _subclasses
    from vramd.pb import rpc_pb2 as rpc
    missing = sorted({cls.code for cls in _subclasses(VramdError)} - set(rpc.Code.keys()))
    assert missing == []
