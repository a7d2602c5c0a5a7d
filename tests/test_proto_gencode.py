"""The committed protobuf code is exactly what proto/generate.py produces."""
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_generated_code_matches_proto_sources():
    r = subprocess.run([sys.executable, str(ROOT / "proto" / "generate.py"), "--check"],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def test_the_wire_registry_matches_rpc_proto():
    """Every typed error has a wire code, every wire code a class, and the registry lists each class once."""
    from vramd import errors
    from vramd.pb import rpc_pb2 as rpc
    classes = {c for c in vars(errors).values() if isinstance(c, type) and issubclass(c, errors.VramdError)}
    client_only = set(errors.CLIENT_ERRORS.values())  # the registry's errors: raised by the client only
    # ServiceError: VRAMD_ERROR's group
    assert set(errors.WIRE_ERRORS.values()) == classes - {errors.ServiceError} - client_only
    assert not set(errors.CLIENT_ERRORS) & set(rpc.Code.keys()) and not client_only & set(errors.WIRE_ERRORS.values())
    assert all(code == cls.code for code, cls in errors.CLIENT_ERRORS.items())
    assert all(code == cls.code for code, cls in errors.WIRE_ERRORS.items())
    assert sorted(errors.WIRE_ERRORS) == sorted(set(rpc.Code.keys()) - {"OK"})
    assert errors.error_class("NO_SUCH_CODE") is errors.VramdError
