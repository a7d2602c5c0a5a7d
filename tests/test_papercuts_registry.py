"""The registry side of vramctl's mistakes (issue 36's table, tests/test_papercuts.py, for push, pull and restore from
a reference): a real registry (vramd/testing/registry.py) where one is reached, one line and exit 1 each, with no
exception class, errno or OpenSSL source line in it.  Needs no root: nothing here acts as another uid.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from helpers import ROOT

from vramd.testing.registry import Registry

TIMEOUT = 60


def test_a_registry_it_cannot_reach_is_one_line_that_says_why(registry: Registry, tmp_path: Path) -> None:
    """vramctl pull against a real plain-HTTP registry spoken to in TLS, a port where nothing listens (held bound
    here, so nobody else takes it), and a host name that cannot resolve (.invalid never does): one line each,
    exit 1, saying what to do, with no exception class or errno in it, and no directory made."""
    import socket
    held = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    held.bind(("127.0.0.1", 0))
    with held:
        closed = f"127.0.0.1:{held.getsockname()[1]}"
        cases = [
            ([f"{registry.host}/x:1"], [f"TLS to {registry.host} failed", "does not answer in TLS", "--plain-http"]),
            ([f"{closed}/x:1", "--plain-http"], [f"registry {closed}: GET manifest x:1: cannot connect",
                                                 "Connection refused", f"is a registry listening at {closed}?"]),
            (["nosuchhost.invalid/x:1"], ["registry nosuchhost.invalid: GET manifest x:1: cannot resolve its name",
                                          "check the reference's host"]),
        ]
        for words, says in cases:
            r = subprocess.run([sys.executable, "-m", "vramd.cli", "pull", words[0], str(tmp_path / "img"),
                                *words[1:]], capture_output=True, text=True, timeout=TIMEOUT, cwd=ROOT)
            lines = r.stderr.splitlines()
            assert r.returncode == 1 and len(lines) == 1, (words, r.stderr)
            assert all(s in lines[0] for s in says), (says, lines[0])
            assert "Error:" not in lines[0] and "[Errno" not in lines[0], lines[0]
            assert os.listdir(tmp_path) == [], words


def test_password_stdin_with_nothing_on_stdin_is_one_line(tmp_path: Path) -> None:
    """vramctl push --username U --password-stdin where stdin is empty (< /dev/null) or closed (<&-): one line
    that says what stdin held and how to give the password, exit 1, before any registry is asked (the port is
    one nobody listens on: reaching it would be a different line)."""
    image = os.path.join(ROOT, "tests", "fixtures", "image-v1")
    cmd = [sys.executable, "-m", "vramd.cli", "push", image, "127.0.0.1:1/x:1", "--plain-http", "--cache",
           str(tmp_path / "cache"), "--username", "alice", "--password-stdin"]
    for redirect, says in (("< /dev/null", "stdin held no password (its first line is empty)"),
                           ("<&-", "stdin is closed")):
        r = subprocess.run(["bash", "-c", f'exec "$@" {redirect}', "_", *cmd], capture_output=True, text=True,
                           timeout=TIMEOUT, cwd=ROOT)
        lines = r.stderr.splitlines()
        assert r.returncode == 1 and len(lines) == 1, (redirect, r.stderr)
        assert says in lines[0] and "--password-stdin < FILE" in lines[0], lines[0]


def test_restore_from_a_reference_with_a_cache_that_is_a_file(registry: Registry, tmp_path: Path) -> None:
    """vramctl restore --image oci://... --cache FILE, against a real registry holding the image: one line naming
    the cache directory it could not make and what to give, exit 1, where it printed '[Errno 20] Not a
    directory: ...'."""
    ref = f"{registry.host}/papercut/img:1"
    push = subprocess.run([sys.executable, "-m", "vramd.cli", "push", os.path.join(ROOT, "tests", "fixtures",
                           "image-v1"), ref, "--plain-http", "--cache", str(tmp_path / "push-cache")],
                          capture_output=True, text=True, timeout=TIMEOUT, cwd=ROOT)
    assert push.returncode == 0, push.stderr
    (tmp_path / "file").write_text("not a directory\n")
    r = subprocess.run([sys.executable, "-m", "vramd.cli", "restore", "--pid", "1", "--image", f"oci://{ref}",
                        "--plain-http", "--cache", str(tmp_path / "file")], capture_output=True, text=True,
                       timeout=TIMEOUT, cwd=ROOT)
    lines = r.stderr.splitlines()
    assert r.returncode == 1 and len(lines) == 1, r.stderr
    assert f"cannot make the pull's cache directory {tmp_path}/file/" in lines[0], lines[0]
    assert "Not a directory: give --cache a directory you may write" in lines[0] and "[Errno" not in lines[0]
