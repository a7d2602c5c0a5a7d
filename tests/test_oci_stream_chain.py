"""vramctl restore --image oci://... of an incremental image (vramd.oci.stream): the parents are pulled whole first,
into sibling directories of the cache entry, at the name the child recorded where that is free.

A parent's recorded name is registry data, and the child's own entry is not there yet while it streams: a parent
dumped into a directory named `image` (the cache's name for the child's entry) or `image.partial` (its staging
directory) must not be pulled into either.
"""
from __future__ import annotations

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
