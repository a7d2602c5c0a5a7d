"""bench/distributed_sim.py's model checked against the real registry (vramd/testing/registry.py): three "nodes"
(their own daemons and directories) x two processes each dump data-parallel replicas, then incremental children,
push them with vramctl, then all six pull at once; the registry's access log and storage must agree with what
the model predicts for the same job (docs/distributed.md, "The check")."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import urllib.error
import urllib.request
from collections import Counter

from helpers import ROOT, vramctl
from oci_helpers import Node, ok, user_cache  # noqa: F401 (user_cache: autouse)

from vramd.oci.layout import MEDIA_CHUNK, Descriptor, encode_oci_manifest

_spec = importlib.util.spec_from_file_location("distributed_sim", os.path.join(ROOT, "bench", "distributed_sim.py"))
assert _spec and _spec.loader
sim = importlib.util.module_from_spec(_spec)
sys.modules["distributed_sim"] = sim
_spec.loader.exec_module(sim)

NODES, GPUS, SHARD, CHUNK = 3, 2, 4 << 20, 1 << 20  # Node's daemons dump 1 MiB chunks
JOB = sim.Job(nodes=NODES, gpus=GPUS, bytes_per_gpu=SHARD, replicas=NODES, replicated_fraction=1.0, changed=0.25,
              chunk=CHUNK, compression=1.0)
STORED_TOLERANCE = 0.01  # config/skeleton/manifest bytes are estimated; payload bytes and all counts are exact


def _requests(reg, since: int) -> Counter:
    got = Counter()
    for r in reg.access_log()[since:]:
        if r.path.startswith("/v2/") and r.path not in ("/v2/",) and "vramd-settle" not in r.path:
            assert r.status < 400 or (r.method == "HEAD" and r.status == 404), r
            kind = "GET_manifest" if r.method == "GET" and "/manifests/" in r.path else \
                "GET_blob" if r.method == "GET" else r.method
            got[kind] += 1
    return got


def _check_push(pred: dict, reg, since: int, stored_before: dict, payloads: set) -> None:
    got = _requests(reg, since)
    for k in ("HEAD", "POST", "PATCH", "PUT"):
        assert got[k] == pred[k], (k, got, pred)
    assert sum(got.values()) == pred["requests"]
    stored = reg.stored_blobs()
    new = {d: n for d, n in stored.items() if d not in stored_before}
    new_payload = sum(n for d, n in new.items() if d in payloads)
    assert new_payload == pred["payload_bytes_uploaded"], (new_payload, pred["payload_bytes_uploaded"])
    added = sum(new.values())
    assert abs(added - pred["bytes_stored"]) <= STORED_TOLERANCE * pred["bytes_stored"], (added, pred["bytes_stored"])


def _payload_blobs(reg) -> set[str]:
    """The chunk layers of every OCI manifest the registry stores."""
    out = set()
    for d in reg.stored_blobs():
        data = reg.blob_data(d).read_bytes()
        if data.startswith(b"{"):
            out |= {lay["digest"] for lay in json.loads(data).get("layers", []) if lay["mediaType"] == MEDIA_CHUNK}
    return out


def test_the_model_predicts_the_registry_for_replicas_incrementals_and_a_restore_storm(run_dir, registry, tmp_path):
    shards = [os.urandom(SHARD) for _ in range(GPUS)]  # rank g of every node holds shard g (data parallelism)
    changed = []
    for s in shards:  # the step rewrites one of each shard's four chunks, the same on every replica
        changed.append(s[:CHUNK] + os.urandom(CHUNK) + s[2 * CHUNK:])
    repo = f"{registry.host}/job/ckpt"
    pushed: dict[str, list] = {"step1": [], "step2": []}
    nodes = [Node(run_dir, tmp_path / f"node{n}") for n in range(NODES)]
    try:
        for n in nodes:
            n.__enter__()
        # checkpoint 1: full images, pushed node after node (the model's "staggered" count)
        since, before = len(registry.access_log()), registry.stored_blobs()
        for k, n in enumerate(nodes):
            for g in range(GPUS):
                img = n.dir / f"gpu{g}" / "step1"
                n.dump(img, [shards[g]], "--compress", "none")
                pushed["step1"].append(ok(vramctl("push", str(img), f"{repo}:n{k}g{g}-step1", "--plain-http",
                                                  "--json")))
        payloads = _payload_blobs(registry)
        assert len(payloads) == GPUS * SHARD // CHUNK  # one replica's worth of payload blobs
        _check_push(sim.push(JOB, dedup=True, incremental=False), registry, since, before, payloads)
        # without dedup the same job would have stored NODES x as many payload bytes
        assert sim.push(JOB, dedup=False, incremental=False)["payload_bytes_uploaded"] == NODES * GPUS * SHARD

        # checkpoint 2: incremental children, each pushed with its chain
        since, before = len(registry.access_log()), registry.stored_blobs()
        for k, n in enumerate(nodes):
            for g in range(GPUS):
                d = n.dir / f"gpu{g}"
                n.dump(d / "step2", [changed[g]], "--parent", str(d / "step1"), "--compress", "none")
                pushed["step2"].append(ok(vramctl("push", str(d / "step2"), f"{repo}:n{k}g{g}-step2",
                                                  "--plain-http", "--json")))
        payloads = _payload_blobs(registry)
        _check_push(sim.push(JOB, dedup=True, incremental=True), registry, since, before, payloads)
    finally:
        for n in nodes:
            n.__exit__(None, None, None)

    # the restore storm: all six processes pull their child (and its parent) at once, no cache
    since = len(registry.access_log())
    for k in range(NODES):
        for g in range(GPUS):
            (tmp_path / "pulled" / f"n{k}g{g}").mkdir(parents=True)
    procs = [subprocess.Popen([sys.executable, "-m", "vramd.cli", "pull", f"{repo}:n{k}g{g}-step2",
                               str(tmp_path / "pulled" / f"n{k}g{g}" / "step2"), "--plain-http", "--json"],
                              cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for k in range(NODES) for g in range(GPUS)]
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
        json.loads(out)
    pred, got = sim.restore(JOB, incremental=True), _requests(registry, since)
    assert got["GET_manifest"] == pred["GET_manifest"] and got["GET_blob"] == pred["GET_blob"], (got, pred)
    served = sum(r.sent for r in registry.access_log()[since:] if r.method == "GET" and "/blobs/" in r.path)
    assert pred["bytes_served"] <= served <= pred["bytes_served"] * (1 + STORED_TOLERANCE), (served, pred)


def test_the_models_manifest_weight_per_layer_is_vramds():
    """The model's bytes per chunk layer in the OCI manifest is what vramd.oci.layout encodes."""
    cfg = Descriptor("application/vnd.vramd.manifest.v3", "sha256:" + "1" * 64, 4096)
    skel = Descriptor("application/vnd.vramd.skeleton.v1+zstd", "sha256:" + "2" * 64, 512)

    def size(layers: int) -> int:
        chunks = [Descriptor(MEDIA_CHUNK, f"sha256:{i:064x}", 8 << 20) for i in range(layers)]
        return len(encode_oci_manifest(cfg, skel, chunks, None, {}))

    assert size(1000) - size(0) == 1000 * (sim.LAYER_JSON + len(str(8 << 20)))
    assert size(0) <= sim.MANIFEST_FIXED
    # a 192 GB process at 8 MiB chunks: 22,889 chunk layers, the figure docs/distributed.md gives
    assert sim.push(sim.Job(), dedup=True, incremental=False)["manifest_bytes"] == \
        sim.MANIFEST_FIXED + 22889 * (sim.LAYER_JSON + 7)


def test_the_sim_is_deterministic_and_writes_json():
    runs = [subprocess.run([sys.executable, os.path.join(ROOT, "bench", "distributed_sim.py"), "--json"],
                           capture_output=True, text=True, check=True).stdout for _ in range(2)]
    assert runs[0] == runs[1]
    res = json.loads(runs[0])
    assert res["push"]["dedup"]["blobs_uploaded"] < res["push"]["no_dedup"]["blobs_uploaded"] / 60
    assert res["restore"]["full"]["fan_out"] == 64


def test_the_registrys_manifest_cap_is_the_models(registry):
    """Debian's docker-registry refuses a manifest body one byte past the model's MANIFEST_LIMIT (4 MiB) and reads
    one of exactly that size (it then refuses it for its unknown blobs, which it checks after the size)."""
    def put(size: int) -> str:
        head = {"schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
                "config": {"mediaType": "application/vnd.vramd.manifest.v3", "digest": "sha256:" + "1" * 64,
                           "size": 10}, "layers": [], "annotations": {"pad": ""}}
        body = json.dumps(head).encode()
        body = json.dumps({**head, "annotations": {"pad": "x" * (size - len(body))}}).encode()
        assert len(body) == size
        req = urllib.request.Request(f"{registry.url}/v2/job/cap/manifests/t", data=body, method="PUT",
                                     headers={"Content-Type": "application/vnd.oci.image.manifest.v1+json"})
        try:
            with urllib.request.urlopen(req, timeout=60):
                return "accepted"
        except urllib.error.HTTPError as e:
            return e.read().decode()

    assert "request body too large" in put(sim.MANIFEST_LIMIT + 1)
    assert "MANIFEST_BLOB_UNKNOWN" in put(sim.MANIFEST_LIMIT)
