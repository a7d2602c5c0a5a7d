"""A registry client as a separate process, the way vramctl runs one: credentials found by vramd.oci.credentials
(`--password-stdin`: the password on stdin, never in argv), pushed through vramd.oci.auth, over TLS per
vramd.oci.tls. Pushes a 4 KiB blob to URL's REPO and reads it back; prints `ok DIGEST`, or one line
`error: CODE: message` on stderr and exits 1.

    python tests/registry_client.py HOST:PORT REPO [--ca-file F] [--plain-http] [--registry-config P]
                                    [--username U --password-stdin] [--hold]

`--hold`: after the push, print `held` and wait for the end of stdin (a test reads the process table then).
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from registry_http import authed, push_blob

from vramd.errors import VramdError
from vramd.oci.auth import Authenticator, repository_scope
from vramd.oci.credentials import find_credentials, from_password_stdin
from vramd.oci.tls import Trust


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("host")
    p.add_argument("repo")
    p.add_argument("--ca-file", type=Path)
    p.add_argument("--plain-http", action="store_true")
    p.add_argument("--registry-config", type=Path)
    p.add_argument("--username")
    p.add_argument("--password-stdin", action="store_true")
    p.add_argument("--hold", action="store_true")
    a = p.parse_args()
    try:
        explicit = from_password_stdin(a.username, sys.stdin) if a.password_stdin else None
        creds = find_credentials(a.host, a.repo, registry_config=a.registry_config, explicit=explicit)
        trust = Trust(ca_file=a.ca_file, plain_http=a.plain_http)
        auth = Authenticator(a.host, creds, trust)
        base = f"{trust.scheme}://{a.host}"
        scope = repository_scope(a.repo, "pull", "push")
        data = os.urandom(4096)
        digest = push_blob(auth, base, a.repo, data, scope)
        r = authed(auth, "GET", f"{base}/v2/{a.repo}/blobs/{digest}", scope)
        if r.body != data:
            print(f"error: the blob read back differs ({r.status})", file=sys.stderr)
            return 1
    except VramdError as e:
        print(f"error: {e.code}: {e}", file=sys.stderr)
        return 1
    print("ok", digest, flush=True)
    if a.hold:
        print("held", flush=True)
        sys.stdin.read()
    return 0


if __name__ == "__main__":
    sys.exit(main())
