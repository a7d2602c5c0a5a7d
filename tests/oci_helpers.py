"""The OCI tests' plumbing: a "node" (its own daemon and files), vramctl with stdin, what a registry saw."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from helpers import ROOT, vramctl

from vramd.testing import DaemonProcess


@pytest.fixture(autouse=True)
def user_cache(tmp_path, monkeypatch):
    """vramctl's default cache (skeletons of pushed images, pulled images) under the test's directory."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg-cache"))
    return tmp_path / "xdg-cache" / "vramd" / "oci"


def files_of(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir()) if p.name == "manifest.vrdm" or p.suffix == ".vrd"}


def blob_writes(reg) -> list:
    """The registry's blob upload requests that carried data (PUT/PATCH of an upload), from its access log."""
    return [r for r in reg.access_log() if r.method in ("PUT", "PATCH") and "/blobs/uploads/" in r.path]


def ok(r) -> dict:
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


class Node:
    """A "node": its own daemon and its own files."""

    def __init__(self, run_dir: str, d: Path, *daemon_args: str) -> None:
        self.dir = d
        d.mkdir(parents=True, exist_ok=True)
        sock_dir = tempfile.mkdtemp(prefix="n", dir=run_dir)  # its own socket: each node runs a daemon
        os.chmod(sock_dir, 0o755)
        self.daemon = DaemonProcess(sock_dir, "--grace-period", "0.3", "--staging-budget", "64M", "--chunk-size",
                                    "1M", *daemon_args)

    def __enter__(self) -> Node:
        self.daemon.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self.daemon.__exit__(*exc)

    def dump(self, image: Path, bos: list[bytes], *more: str) -> dict:
        args = []
        for i, data in enumerate(bos, 1):
            f = self.dir / f"bo{i}.bin"
            f.write_bytes(data)
            args += ["--bo-file", str(f)]
        return ok(vramctl("dump", "--pid", str(os.getpid()), *args, "--image", str(image), "--json", *more,
                          socket=self.daemon.socket))

    def restore(self, image: str, sizes: list[int], *more: str, stdin: str | None = None) -> list[bytes]:
        args = []
        for i, n in enumerate(sizes, 1):
            f = self.dir / f"out{i}.bin"
            f.write_bytes(bytes(n))
            args += ["--bo-file", f"{i}={f}"]
        r = vramctl("restore", "--pid", str(os.getpid()), "--image", image, *args, *more, socket=self.daemon.socket)
        assert r.returncode == 0, r.stderr
        return [(self.dir / f"out{i}.bin").read_bytes() for i in range(1, len(sizes) + 1)]


def workload_bos() -> list[bytes]:
    a = os.urandom(3 << 20)
    # a BO with a hole, a chunk equal to one of `a`'s (dedup) and a chunk of its own
    b = bytes(1 << 20) + a[1 << 20:2 << 20] + os.urandom(1 << 20) + bytes(4096)
    return [a, b]


def vramctl_stdin(args: list[str], stdin: str):
    return subprocess.run([sys.executable, "-m", "vramd.cli", *args], cwd=ROOT, capture_output=True, text=True,
                          input=stdin, timeout=120)
