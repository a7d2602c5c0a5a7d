"""A new vramctl against a daemon older than the supply notes (a rolling upgrade: vramctl upgraded, the daemon
not restarted yet).  Such a daemon takes a socket supply but never writes to it: a `--no-cache` restore whose
download waits for RELEASED notes to lift its window would wait for ever.  The daemon says it sends notes
(HelloReply.supply_notes); the real daemon with its `supply_notes = false` setting answers as an older one does
and never writes to the socket, and vramctl, told nothing, does not bound its window: one warning, and the
restore completes.
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest
from helpers import ROOT, open_dir, vramctl
from oci_helpers import Node, ok, user_cache  # noqa: F401 (user_cache: autouse)
from stream_daemon_fixture import Image, Targets

from vramd.cli.oci import NO_NOTES
from vramd.client import SESSION_RESTORE, Client
from vramd.image.supply import encode
from vramd.pb import rpc_pb2 as rpc

MiB = 1 << 20


@pytest.fixture
def old_node(run_dir, tmp_path):
    cfg = tmp_path / "vramd.toml"
    cfg.write_text("supply_notes = false\n")
    with Node(run_dir, tmp_path / "node1", "--config", str(cfg)) as n:
        yield n


@pytest.fixture
def node(run_dir, tmp_path):
    with Node(run_dir, tmp_path / "node2") as n:
        yield n


def test_hello_says_whether_the_daemon_sends_supply_notes(old_node, node):
    with Client(node.daemon.socket) as c:
        assert c.supply_notes and c.hello.supply_notes
    with Client(old_node.daemon.socket) as c:
        assert not c.supply_notes and not c.hello.supply_notes


def test_no_cache_against_a_daemon_without_notes_completes_unbounded_and_says_so(old_node, registry, tmp_path):
    """8 MiB through a 1 MiB window: with the window bounded, the download stops after about a MiB and waits for
    notes that never come (the session waits for records never downloaded): the restore hangs, and the timeout
    fails the test.  Told nothing by the daemon's Hello, vramctl keeps the whole image in TMPDIR instead."""
    bos = [os.urandom(8 * MiB), os.urandom(3 * MiB)]
    img = tmp_path / "ckpt" / "img"
    old_node.dump(img, bos, "--compress", "none")
    ref = f"{registry.host}/jobs/compat:1"
    ok(vramctl("push", str(img), ref, "--plain-http", "--json"))
    args = []
    for i, b in enumerate(bos, 1):
        t = old_node.dir / f"out{i}.bin"
        t.write_bytes(bytes(len(b)))
        args += ["--bo-file", f"{i}={t}"]
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    r = subprocess.run([sys.executable, "-m", "vramd.cli", "--socket", old_node.daemon.socket, "restore", "--pid",
                        str(os.getpid()), "--image", f"oci://{ref}", *args, "--plain-http", "--no-cache",
                        "--window", "1", "--concurrency", "1", "--json"], cwd=ROOT, capture_output=True, text=True,
                       timeout=120, env={**os.environ, "TMPDIR": str(tmp)})
    assert r.returncode == 0, r.stderr
    assert all((old_node.dir / f"out{i}.bin").read_bytes() == b for i, b in enumerate(bos, 1))
    warnings = [line for line in r.stderr.splitlines() if "warning" in line]
    assert warnings == [f"vramctl: warning: {NO_NOTES}"], r.stderr
    d = json.loads(r.stdout)
    assert d["ok"] and "window" not in d, d  # no window was held
    assert list(tmp.iterdir()) == []  # the temporary copy is gone


@pytest.mark.parametrize("notes", [True, False])
def test_a_daemon_without_notes_never_writes_to_the_supply_socket(run_dir, tmp_path, notes):
    """A streamed restore over a socket, supplied whole at once: the daemon with its notes sends RELEASED for
    what it read; with `supply_notes = false` it reads the socket as a pipe, as a daemon before the notes did:
    not a byte back before its end closes."""
    cfg = tmp_path / "vramd.toml"
    cfg.write_text(f"supply_notes = {str(notes).lower()}\n")
    (tmp_path / "img").mkdir()
    image = Image(tmp_path / "img")
    targets = Targets()
    with Node(run_dir, tmp_path / "node", "--config", str(cfg)) as node, Client(node.daemon.socket) as c:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        ours.settimeout(30)  # (a daemon that never closes its end fails the test, never hangs it)
        dfd = open_dir(image.dst)
        try:
            s = c.open_session(SESSION_RESTORE, dfd, supply_fd=theirs.fileno(), label="old daemon")
        finally:
            theirs.close()
            os.close(dfd)
        c.add_bos(s.token, targets.bos())
        c.start(s.token)
        image.fill(0, len(image.data))
        ours.sendall(encode(0, len(image.data)))
        ours.shutdown(socket.SHUT_WR)
        info = c.wait(s.token)
        assert info.state == rpc.SESSION_DONE, info.error.message
        c.close_session(s.token)
        got = b""
        while chunk := ours.recv(65536):
            got += chunk
        ours.close()
    try:
        assert targets.contents() == image.contents
    finally:
        targets.close()
    assert (len(got) > 0) == notes, len(got)
