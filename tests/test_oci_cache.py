"""vramctl restore --image oci://'s node-local cache and vramctl pull's target directory: an empty directory is
a target; what a pull or a streamed restore killed midway left behind does not make the cache unusable; a cache
entry damaged after it was pulled is refused by the daemon, naming the BO, before a byte of the damaged record
reaches it (docs/image-format.md, "OCI artifact").
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import ROOT, vramctl
from oci_helpers import Node, files_of, ok, user_cache, workload_bos  # noqa: F401 (user_cache: autouse)


@pytest.fixture
def node(run_dir, tmp_path):
    with Node(run_dir, tmp_path / "node1") as n:
        yield n


def _pushed(node, registry, tmp_path, name):
    bos = workload_bos()
    img = tmp_path / "ckpt" / name
    node.dump(img, bos, "--compress", "none")
    ref = f"{registry.host}/jobs/{name}:1"
    ok(vramctl("push", str(img), ref, "--plain-http", "--json"))
    return bos, img, ref


def test_pull_into_an_existing_empty_directory(node, registry, tmp_path):
    _bos, img, ref = _pushed(node, registry, tmp_path, "empty")
    dest = tmp_path / "dest"
    dest.mkdir()
    r = vramctl("pull", ref, str(dest), "--plain-http", "--json")
    assert r.returncode == 0, r.stderr
    assert files_of(dest) == files_of(img)


def test_a_damaged_cache_entry_is_refused_by_the_daemon_naming_the_bo(node, registry, tmp_path, run_dir):
    """A cache entry is restored as it is (no payload re-hashed first): the daemon checks each record against
    manifest.vrdm before a byte of it reaches a BO, and its error names the BO and says what to do."""
    bos, _img, ref = _pushed(node, registry, tmp_path, "tamper")
    cache = tmp_path / "cache"
    with Node(run_dir, tmp_path / "node2") as other:
        assert other.restore(f"oci://{ref}", [len(b) for b in bos], "--plain-http", "--cache", str(cache)) == bos
        data = max(cache.rglob("*.vrd"), key=lambda p: p.stat().st_size)
        raw = bytearray(data.read_bytes())
        at = raw.find(bos[0][:4096])  # BO 1's first chunk, stored as is (--compress none)
        assert at > 0
        raw[at + 100] ^= 0xFF
        data.write_bytes(raw)
        targets = []
        for i, b in enumerate(bos, 1):
            t = other.dir / f"out{i}.bin"
            t.write_bytes(bytes(len(b)))
            targets += ["--bo-file", f"{i}={t}"]
        before = len(registry.access_log())
        r = vramctl("restore", "--pid", str(os.getpid()), "--image", f"oci://{ref}", "--plain-http", "--cache",
                    str(cache), *targets, "--json", socket=other.daemon.socket)
        assert r.returncode == 1, r.stderr
        err = json.loads(r.stdout)["error"]
        assert err["code"] == "CORRUPT_CHUNK" and err["bo_id"] == 1 and err["offset"] == 0, err
        assert str(data.parent) in err["message"] and "--refresh-cache" in err["message"], err
        assert r.stderr.count("\n") == 1
        assert (other.dir / "out1.bin").read_bytes()[:1 << 20] == bytes(1 << 20)  # the damaged chunk never landed
        assert [a for a in registry.access_log()[before:] if "/blobs/" in a.path] == []  # no blob downloaded
        # as the message says: --refresh-cache downloads it again, and the entry is whole once more
        assert other.restore(f"oci://{ref}", [len(b) for b in bos], "--plain-http", "--cache", str(cache),
                             "--refresh-cache") == bos
        assert other.restore(f"oci://{ref}", [len(b) for b in bos], "--plain-http", "--cache", str(cache)) == bos


def test_a_pull_killed_midway_leaves_a_cache_the_next_restore_uses(node, registry, tmp_path, run_dir):
    bos = [os.urandom(24 << 20)]  # 24 payloads of 1 MiB (the test daemon's chunk size)
    img = tmp_path / "image"
    node.dump(img, bos, "--compress", "none")
    ref = f"{registry.host}/jobs/killed:1"
    ok(vramctl("push", str(img), ref, "--plain-http", "--json"))
    cache = tmp_path / "cache"
    with Node(run_dir, tmp_path / "node2") as other:
        target = other.dir / "out1.bin"
        target.write_bytes(bytes(len(bos[0])))
        restore = subprocess.Popen(
            [sys.executable, "-m", "vramd.cli", "--socket", other.daemon.socket, "restore", "--pid", str(os.getpid()),
             "--image", f"oci://{ref}", "--plain-http", "--cache", str(cache), "--concurrency", "1",
             "--bo-file", f"1={target}", "--json"], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        deadline = time.monotonic() + 120
        gets = lambda: [r for r in registry.access_log() if r.method == "GET" and "/blobs/" in r.path]  # noqa: E731
        while len(gets()) < 5:  # config, skeleton and 3 payloads served (each access_log(): a round trip)
            assert restore.poll() is None and time.monotonic() < deadline, "the restore ended before 5 blobs"
        restore.send_signal(signal.SIGKILL)  # as a node's OOM killer or a reboot would
        restore.communicate(timeout=60)
        # it died before its commit: its staging directory is left (the restore streamed into it), no entry
        left = [p.name for p in cache.rglob("*") if p.is_file() and p.parent.name == "image.partial"]
        assert "manifest.vrdm" in left and any(n.endswith(".vrd") for n in left), left
        assert not [p for p in cache.rglob("image") if p.is_dir()]
        assert other.restore(f"oci://{ref}", [len(bos[0])], "--plain-http", "--cache", str(cache)) == bos
        assert not list(cache.rglob("*.tmp")) and not list(cache.rglob("image.partial"))
        assert [p.name for p in cache.rglob("image*") if p.is_dir()] == ["image"]


def test_two_pulls_into_one_directory_at_once_both_end_with_the_image(node, registry, tmp_path):
    """Restores of one reference on one node share its cache entry: a second pull started while the first is
    midway (stopped there) waits for it rather than sweeping its files, then finds the image (checked, not
    downloaded again); neither fails."""
    bos = [os.urandom(24 << 20)]
    img = tmp_path / "image"
    node.dump(img, bos, "--compress", "none")
    ref = f"{registry.host}/jobs/twice:1"
    ok(vramctl("push", str(img), ref, "--plain-http", "--json"))
    dest = tmp_path / "shared" / "image"
    dest.parent.mkdir()
    cmd = [sys.executable, "-m", "vramd.cli", "pull", ref, str(dest), "--plain-http", "--concurrency", "1", "--json"]
    first = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    gets = lambda: [r for r in registry.access_log() if r.method == "GET" and "/blobs/" in r.path]  # noqa: E731
    while len(gets()) < 5:  # config, skeleton and 3 payloads served: the first is writing its temporaries
        assert first.poll() is None and time.monotonic() < deadline, "the first pull ended before 5 blobs"
    first.send_signal(signal.SIGSTOP)  # midway, for as long as the test says
    second = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wchan = Path(f"/proc/{second.pid}/wchan")
        while second.poll() is None and "lock" not in wchan.read_text():  # the kernel's word for where it waits
            assert time.monotonic() < deadline, "the second pull neither ended nor waited for a lock"
        assert second.poll() is None, second.communicate()[1]  # it waits for the first: it did not go ahead
    finally:
        first.send_signal(signal.SIGCONT)
    _out1, err1 = first.communicate(timeout=120)
    out2, err2 = second.communicate(timeout=120)
    assert first.returncode == 0, err1
    assert second.returncode == 0, err2
    assert [c["cached"] for c in json.loads(out2)["chain"]] == [True]
    assert files_of(dest) == files_of(img)
