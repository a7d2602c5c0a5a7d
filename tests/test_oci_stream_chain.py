"""vramctl restore --image oci://... (vramd.oci.stream) of an incremental image, and into a cache that fails writes.

The parents are pulled whole first, into sibling directories of the cache entry, at the name the child recorded
where that is free. A parent's recorded name is registry data, and the child's own entry is not there yet while
it streams: a parent dumped into a directory named `image` (the cache's name for the child's entry) or
`image.partial` (its staging directory) must not be pulled into either.  A cache whose file system fails a write
part way (a short write, then EIO) is that IO_ERROR: before, the short write was ignored, the daemon read the gap
and reported CORRUPT_CHUNK, and the EIO itself was reported as the registry's.
"""
from __future__ import annotations

import json
import os

import pytest
from helpers import vramctl
from oci_helpers import Node, ok, user_cache, workload_bos  # noqa: F401 (user_cache: autouse)


@pytest.fixture
def node(run_dir, tmp_path):
    with Node(run_dir, tmp_path / "node1") as n:
        yield n


@pytest.mark.parametrize("parent_name", ["image", "image.partial"])
def test_a_child_whose_parent_was_dumped_as_the_cache_entrys_name_restores(node, registry, tmp_path, run_dir,
                                                                         parent_name):
    bos = workload_bos()
    parent, child = tmp_path / "ckpt" / parent_name, tmp_path / "ckpt" / "step2"
    node.dump(parent, bos)
    base = f"{registry.host}/jobs/named"
    ok(vramctl("push", str(parent), f"{base}:step1", "--plain-http", "--json"))
    changed = bytearray(bos[0])
    changed[(1 << 20) + 5] ^= 0xFF
    bos2 = [bytes(changed), bos[1]]
    node.dump(child, bos2, "--parent", str(parent), "--compress", "none")
    ok(vramctl("push", str(child), f"{base}:step2", "--plain-http", "--json"))
    cache = tmp_path / "cache"
    with Node(run_dir, tmp_path / "node2") as other:
        for _ in range(2):  # streamed into the entry, then restored from it as it is
            out = other.restore(f"oci://{base}:step2", [len(b) for b in bos2], "--plain-http", "--cache", str(cache))
            assert out == bos2
    entries = sorted(p.name for p in cache.rglob("*") if p.is_dir() and p.parent.parent.parent.parent == cache)
    assert "image" in entries and not any(n.endswith(".partial") for n in entries), entries
    assert os.path.isfile(next(cache.rglob("image.parent-1")) / "manifest.vrdm")


def test_a_cache_whose_writes_fail_is_that_io_error_not_the_daemons(node, registry, tmp_path):
    """The cache's file system fails a write of the last record's payload (EIO, tests/eiofs.py): vramctl reports
    that IO_ERROR naming the staging directory, not the daemon's 'stopped supplying' that followed from it."""
    from test_io_errors import eio_mount
    from test_io_errors import why as fuse_missing

    from vramd.image.manifest import decode_manifest
    if fuse_missing:
        pytest.skip(fuse_missing)
    img = tmp_path / "ckpt" / "eio"
    node.dump(img, [os.urandom(4 << 20)], "--compress", "none")
    ref = f"{registry.host}/jobs/eio:1"
    ok(vramctl("push", str(img), ref, "--plain-http", "--json"))
    m = decode_manifest((img / "manifest.vrdm").read_bytes())
    off, ln = max((o, n) for o, n in zip(m.chunks.offset, m.chunks.length, strict=True))  # the last record
    backing, mnt = tmp_path / "backing", tmp_path / "mnt"
    backing.mkdir()
    # the data file is the one file in the cache this long: a write inside its last payload, past its head
    with eio_mount(backing, mnt, "--write-eio", f"cache/:{off + ln - 1000}"):
        r = vramctl("restore", "--pid", str(os.getpid()), "--image", f"oci://{ref}", "--bo-file",
                    f"1={node.dir / 'bo1.bin'}", "--plain-http", "--cache", str(mnt / "cache"), "--json",
                    socket=node.daemon.socket)
        left = [p.name for p in (mnt / "cache").rglob("image*")]
    assert r.returncode == 1 and r.stderr.count("\n") == 1, r.stderr
    e = json.loads(r.stdout)["error"]
    assert e["code"] == "IO_ERROR" and "image.partial" in e["message"] and "supplying" not in e["message"], e
    assert left == []
