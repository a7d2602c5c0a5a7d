"""Where the OCI pieces meet (against the real registry and real daemons): a plugin-style chain (each child
recording its parent as `parent`, a link in its own directory) whose parent is an OCI image index (over the
manifest budget) is served by `vramctl pull --serve` (the indexed parent pulled whole, linked and marked), restored
through the served socket; restored from the reference with --no-cache and a 1 MiB window, and through the
cache cold then warm; and the served chain removed with vramctl rm, child first (its parent refused before)."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

from helpers import ROOT, vramctl
from oci_helpers import Node, ok, user_cache, workload_bos  # noqa: F401 (user_cache: autouse)
from test_libvramd_serve import serve, wait_exit
from test_oci_index import BUDGET, read_index
from test_oci_operator import _changed, _dump_as_the_plugin_does

from vramd.oci.serve import SOCKET_NAME


def test_an_indexed_parent_under_a_served_streamed_and_cached_plugin_style_child(run_dir, registry, tmp_path):
    from vramd.client import SESSION_RESTORE, Client, ClientBo

    b0 = [*workload_bos(), os.urandom(16 << 20)]  # ~20 distinct payloads: an index of parts at BUDGET
    b1 = _changed(b0, (1 << 20) + 5)
    with Node(run_dir, tmp_path / "node1") as node:
        ckpt = [tmp_path / "ckpt" / str(k) / "amdgpu-vramd-1" for k in range(2)]
        _dump_as_the_plugin_does(node, ckpt, [b0, b1])
        ref = f"{registry.host}/seams/job:2"
        pushed = ok(vramctl("push", str(ckpt[1]), ref, "--plain-http", "--json", "--max-manifest-bytes", BUDGET))
        parent_digest = pushed["chain"][0]["digest"]
        assert len(read_index(registry, "seams/job", parent_digest)[1]) > 1, "the parent went up as one manifest"

        dest, errlog = tmp_path / "restore" / "amdgpu-vramd-1", tmp_path / "serve.err"
        dest.parent.mkdir()
        r, pid = serve(ref, dest, errlog)
        assert r.returncode == 0, errlog.read_text()
        assert os.readlink(dest / "parent") == "../amdgpu-vramd-1.parent-1"
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        conn.connect(str(dest / SOCKET_NAME))
        targets = [os.memfd_create(f"bo{i}", os.MFD_CLOEXEC) for i in range(len(b1))]
        dfd = os.open(dest, os.O_RDONLY | os.O_DIRECTORY)
        pfd = os.open(dest / "parent", os.O_RDONLY | os.O_DIRECTORY)
        try:
            for fd, b in zip(targets, b1, strict=True):
                os.ftruncate(fd, len(b))
            with Client(node.daemon.socket) as c:
                tok = c.open_session(SESSION_RESTORE, dfd, parent_fds=[pfd], supply_fd=conn.fileno()).token
                conn.close()
                c.add_bos(tok, [ClientBo(id=i, fd=fd, backend="mmap") for i, fd in enumerate(targets, 1)])
                c.start(tok)
                c.wait(tok, timeout=120)
                c.close_session(tok)
            got = [os.pread(fd, len(b), 0) for fd, b in zip(targets, b1, strict=True)]
        finally:
            for fd in (*targets, dfd, pfd):
                os.close(fd)
        wait_exit(pid)
        assert got == b1
        assert errlog.read_text() == ""
        assert not (dest / SOCKET_NAME).exists()

        tmp = tmp_path / "tmp"
        tmp.mkdir()
        args = []
        for i, b in enumerate(b1, 1):
            (node.dir / f"out{i}.bin").write_bytes(bytes(len(b)))
            args += ["--bo-file", f"{i}={node.dir / f'out{i}.bin'}"]
        r = subprocess.run([sys.executable, "-m", "vramd.cli", "--socket", node.daemon.socket, "restore", "--pid",
                            str(os.getpid()), "--image", f"oci://{ref}", *args, "--plain-http", "--no-cache",
                            "--window", "1", "--json"], cwd=ROOT, capture_output=True, text=True, timeout=300,
                           env={**os.environ, "TMPDIR": str(tmp)})
        assert r.returncode == 0 and r.stderr == "", r.stderr
        assert [(node.dir / f"out{i}.bin").read_bytes() for i in range(1, len(b1) + 1)] == b1
        assert json.loads(r.stdout)["window"]["released_notes"] > 0, r.stdout  # the notes came back: bounded
        assert list(tmp.iterdir()) == []

        cache = tmp_path / "cache"
        for warm in (False, True):
            r = subprocess.run([sys.executable, "-m", "vramd.cli", "--socket", node.daemon.socket, "restore",
                                "--pid", str(os.getpid()), "--image", f"oci://{ref}", *args, "--plain-http",
                                "--cache", str(cache), "--json"], cwd=ROOT, capture_output=True, text=True,
                               timeout=300)
            assert r.returncode == 0 and json.loads(r.stdout)["warm"] is warm, (r.stdout, r.stderr)
            assert [(node.dir / f"out{i}.bin").read_bytes() for i in range(1, len(b1) + 1)] == b1

    r = vramctl("rm", f"{dest}.parent-1")
    assert r.returncode == 1 and f"is the parent of 1 incremental image(s): {dest}" in r.stderr, r.stderr
    for d in (dest, f"{dest}.parent-1"):
        r = vramctl("rm", str(d))
        assert r.returncode == 0, r.stderr
    assert os.listdir(dest.parent) == []
