"""vramctl restore --image oci://... --no-cache keeps no full local copy (#35 point 2): the daemon's notes over the
supply socket (RELEASED, WAITING) let vramctl punch out what was read for good and bound how far it downloads.

Against the real registry and a real daemon, with TMPDIR (where --no-cache streams the image through) a small
tmpfs mounted for the test: a 96 MiB image restores byte-exact through 24 MiB (a whole copy fails with ENOSPC,
as before these notes); an image whose first BO a later BO repeats (dedup pins its records until that BO is
read) restores through a tmpfs larger than what is pinned plus the window, smaller than the image, with blobs
let past the window only by WAITING.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers import ROOT, vramctl
from oci_helpers import Node, ok, user_cache  # noqa: F401 (user_cache: autouse)

MiB = 1 << 20


@pytest.fixture
def node(run_dir, tmp_path):
    with Node(run_dir, tmp_path / "node1") as n:
        yield n


def _tmpfs(path: Path, mib: int, fs: str = "tmpfs") -> Iterator[Path]:
    path.mkdir()
    opts = f"size={mib}m,mode=0700" if fs == "tmpfs" else "mode=0700"
    r = subprocess.run(["mount", "-t", fs, "-o", opts, fs, str(path)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a {fs} for TMPDIR: {r.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=True)


@pytest.fixture
def ramfs_tmp(tmp_path) -> Iterator[Path]:
    """A file system without holes (ramfs: fallocate PUNCH_HOLE is EOPNOTSUPP)."""
    yield from _tmpfs(tmp_path / "ramfs", 0, fs="ramfs")


@pytest.fixture
def small_tmp(tmp_path) -> Iterator[Path]:
    yield from _tmpfs(tmp_path / "tmp24", 24)


@pytest.fixture
def mid_tmp(tmp_path) -> Iterator[Path]:
    yield from _tmpfs(tmp_path / "tmp40", 40)


def _push(node, registry, tmp_path, name: str, bos: list[bytes]) -> tuple[str, dict]:
    img = tmp_path / "ckpt" / name
    dumped = node.dump(img, bos, "--compress", "none")
    ref = f"{registry.host}/jobs/{name}:1"
    ok(vramctl("push", str(img), ref, "--plain-http", "--json"))
    return ref, dumped


def _restore_no_cache(node, bos, ref: str, tmp: Path, window_mib: int) -> subprocess.CompletedProcess[str]:
    args = []
    for i, b in enumerate(bos, 1):
        t = node.dir / f"out{i}.bin"
        t.write_bytes(bytes(len(b)))
        args += ["--bo-file", f"{i}={t}"]
    return subprocess.run([sys.executable, "-m", "vramd.cli", "--socket", node.daemon.socket, "restore", "--pid",
                           str(os.getpid()), "--image", f"oci://{ref}", *args, "--plain-http", "--no-cache",
                           "--window", str(window_mib), "--concurrency", "4", "--json"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300, env={**os.environ, "TMPDIR": str(tmp)})


def _restored(node, bos) -> bool:
    return all((node.dir / f"out{i}.bin").read_bytes() == b for i, b in enumerate(bos, 1))


def test_a_no_cache_restore_of_96_mib_streams_through_a_24_mib_tmpfs(node, registry, tmp_path, small_tmp):
    """96 one-MiB payload blobs through 24 MiB: without the daemon's RELEASED notes (the files punched out) and
    the window, the data file alone (96 MiB) fails with ENOSPC.  The peak of the resident bytes vramctl counts
    stays within the window (8 MiB) plus the blobs a waiting chunk asked for past it, and holes were punched
    for most of the image."""
    bos = [os.urandom(96 * MiB)]
    ref, _ = _push(node, registry, tmp_path, "big", bos)
    r = _restore_no_cache(node, bos, ref, small_tmp, 8)
    assert r.returncode == 0, r.stderr
    assert _restored(node, bos)
    w = json.loads(r.stdout)["window"]
    assert w["window"] == 8 * MiB, w
    # past the window only the blobs chunks waiting at the gate needed (1 MiB each; 0 or 1 in the runs seen)
    assert 0 < w["peak_resident"] <= w["window"] + w["blobs_past_window"] * MiB, w
    assert w["peak_resident"] <= 12 * MiB, w
    # what the data files occupied (st_blocks, sampled as each blob ended): the same, plus a block for each of
    # the 96 record heads written when the files were made
    assert 0 < w["peak_allocated"] <= w["peak_resident"] + 97 * 4096, w
    assert w["released_notes"] > 0 and w["punched_bytes"] >= 80 * MiB, w
    assert list(small_tmp.iterdir()) == []  # nothing left behind


def test_dedup_pinned_records_go_past_the_window_only_when_a_chunk_waits(node, registry, tmp_path, mid_tmp):
    """BO 3 repeats BO 1 (16 MiB): the dump stores BO 1's records once, and they stay pinned until BO 3 is read,
    after BO 2 (40 MiB).  With a 6 MiB window, BO 2's blobs can start only because the daemon says a chunk waits
    for them (WAITING): the restore completes through 40 MiB of tmpfs (the image's data is 56 MiB), the peak
    above the window but within what is pinned plus the window and the chunks the daemon has in hand."""
    first = os.urandom(16 * MiB)
    bos = [first, os.urandom(40 * MiB), first]
    ref, dumped = _push(node, registry, tmp_path, "dedup", bos)
    assert dumped["image"]["bo_bytes"] - dumped["image"]["stored_bytes"] == 16 * MiB, dumped  # stored once
    r = _restore_no_cache(node, bos, ref, mid_tmp, 6)
    assert r.returncode == 0, r.stderr
    assert _restored(node, bos)
    w = json.loads(r.stdout)["window"]
    assert w["waiting_notes"] > 0 and w["blobs_past_window"] > 0, w
    # at most: what is pinned, the window, and a record (1 MiB chunk) for each of the 4 batches in flight and
    # the 4 chunks waiting at the gate (read but not yet released, or asked for past the window)
    assert w["window"] < w["peak_resident"] <= 16 * MiB + w["window"] + 8 * (MiB + 4096), w


def test_a_file_system_without_holes_is_one_warning_not_a_silent_whole_copy(node, registry, tmp_path, ramfs_tmp):
    """TMPDIR on ramfs, which cannot punch holes: the restore stands (byte-exact), but the files kept every byte
    the daemon read, whatever --window said: vramctl says so in one warning line (it said nothing, and its JSON
    showed a window it had not held on disk)."""
    bos = [os.urandom(8 * MiB)]
    ref, _ = _push(node, registry, tmp_path, "nohole", bos)
    r = _restore_no_cache(node, bos, ref, ramfs_tmp, 2)
    assert r.returncode == 0, r.stderr
    assert _restored(node, bos)
    w = json.loads(r.stdout)["window"]
    assert w["released_notes"] > 0 and w["punched_bytes"] == 0, w
    warnings = [line for line in r.stderr.splitlines() if "cannot free what the daemon read" in line]
    assert len(warnings) == 1 and "Operation not supported" in warnings[0] and "--window" in warnings[0], r.stderr
    assert list(ramfs_tmp.iterdir()) == []
