"""A manifest over the registry's cap (distribution refuses a manifest body past 4 MiB with HTTP 400
MANIFEST_INVALID): against the real registry and a real daemon, a push forced to send one manifest of ~4.3 MiB
(`--max-manifest-bytes` of 8 MiB, ~31000 distinct 4 KiB chunks) fails with one line that names the manifest's
size and `--max-manifest-bytes`, not the bare HTTP status.  (Slow: 31000 blob uploads, 5.3 min at load 7 to
12 on two shared cores.)"""
from __future__ import annotations

import os
import re

import pytest
from helpers import vramctl
from oci_helpers import Node, user_cache  # noqa: F401 (user_cache: autouse)

from vramd.oci.index import DEFAULT_MAX_MANIFEST

CHUNKS = 31_000  # x ~142 bytes of layer descriptor each: past the registry's 4 MiB, within DEFAULT_MAX_MANIFEST x 2


@pytest.fixture
def node(run_dir, tmp_path):
    with Node(run_dir, tmp_path / "node1", "--chunk-size", "4K") as n:
        yield n


@pytest.mark.slow
def test_a_manifest_the_registry_refuses_as_too_large_says_its_size_and_the_budget_flag(node, registry, tmp_path):
    img = tmp_path / "ckpt" / "big"
    node.dump(img, [os.urandom(CHUNKS * 4096)], "--compress", "none")
    ref = f"{registry.host}/jobs/cap:1"
    r = vramctl("push", str(img), ref, "--plain-http", "--concurrency", "8", "--max-manifest-bytes", str(8 << 20),
                timeout=600)
    assert r.returncode == 1 and r.stderr.count("\n") == 1, r.stderr
    assert "REGISTRY_ERROR" in r.stderr and "HTTP 400 MANIFEST_INVALID" in r.stderr, r.stderr
    size = re.search(r"the manifest is (\d+) bytes", r.stderr)
    assert size is not None and 4 << 20 < int(size[1]) <= 8 << 20, r.stderr
    assert f"--max-manifest-bytes (default {DEFAULT_MAX_MANIFEST})" in r.stderr, r.stderr
    assert vramctl("inspect", str(img)).returncode == 0  # the image is untouched: a push only reads it
