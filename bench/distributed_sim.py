"""A model of a data-parallel job checkpointing through a registry as vramd OCI artifacts (docs/distributed.md).

Pure and deterministic: no I/O, no clock, no randomness.  The job is `nodes` x `gpus` processes (one vramd
image each) of `bytes_per_gpu` BO bytes; `replicas` processes (one per replica group, on different nodes) hold
the same bytes (data parallelism: rank g of every group is the same shard), of which `replicated_fraction` is
truly identical (e.g. weights; a ZeRO-sharded optimizer state is not); `changed` is the fraction of each
shard's chunks an incremental checkpoint rewrites.  It counts what vramd's push and pull (vramd.oci.push,
vramd.oci.pull) send per checkpoint:

- push, per image: one HEAD per blob (config = manifest.vrdm, skeleton, one per distinct payload), for each
  blob the registry lacks a POST and a closing PUT (plus PATCHes past CHUNKED_UPLOAD), then the manifest PUT;
  an incremental child is pushed with its chain, whose blobs are HEADed again (present);
- pull, per image: the manifest GET, the config and skeleton GETs and one GET per payload of the image and
  of every parent in its chain.

Pushes are counted "staggered" (each blob HEADed after the previous replica's upload finished, as the
check in tests/test_distributed_sim.py runs them); `racing_uploads` is the worst case where all replicas HEAD
before any upload lands (every replica uploads, the registry stores one).
Usage: python bench/distributed_sim.py [--nodes 64 --gpus 8 --bytes-per-gpu 192e9 ...] [--json]
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict, dataclass, fields, replace

CHUNKED_UPLOAD = 64 << 20  # vramd.oci.registry.CHUNKED_UPLOAD: a blob past this goes up in PATCHes
# One chunk layer's descriptor in the OCI manifest JSON: {"mediaType":"application/vnd.vramd.chunk.v1",
# "digest":"sha256:<64 hex>","size":N}, plus its comma: this many bytes and the digits of N
# (test_distributed_sim checks it against vramd.oci.layout).
LAYER_JSON = 138
MANIFEST_FIXED = 1200  # config and skeleton descriptors, subject, annotations
# Metadata per image, fitted to images vramctl dumped (one BO of 4, 32 and 96 uncompressed 1 MiB chunks:
# manifest.vrdm 483, 2139, 5917 bytes; zstd skeleton 556, 3076, 8755 bytes), docs/distributed.md.
SKELETON_PER_BLOB = 89  # a chunk's record head, digest and size in the skeleton layer
SKELETON_FIXED = 200
CONFIG_FIXED = 250  # manifest.vrdm: header, BOs, data files
CONFIG_PER_CHUNK = 59  # manifest.vrdm's record of one chunk
MANIFEST_LIMIT = 4 << 20  # distribution refuses a manifest body past 4 MiB (Debian's 2.8.2 too: the test checks)


@dataclass(frozen=True)
class Job:
    nodes: int = 64
    gpus: int = 8  # processes per node, one image each
    bytes_per_gpu: int = 192_000_000_000
    replicas: int = 64  # processes holding the same shard (data-parallel degree)
    replicated_fraction: float = 1.0  # of a shard's bytes, identical across its replicas
    changed: float = 0.3  # of a shard's chunks rewritten between two checkpoints (incremental child)
    chunk: int = 8 << 20
    compression: float = 1.0  # stored payload = chunk / compression
    node_gbps: float = 100.0  # each node's download bandwidth at restore (Gbit/s)
    per_node_cache_hit: float = 0.0  # of a restore's payload bytes already in the node's cache
    nodes_per_cache: int = 1  # nodes behind one shared pull-through cache (1: none; the registry serves all)

    @property
    def processes(self) -> int:
        return self.nodes * self.gpus

    @property
    def chunks(self) -> int:
        return math.ceil(self.bytes_per_gpu / self.chunk)

    @property
    def payload(self) -> int:
        return round(self.chunk / self.compression)


def _upload_requests(size: int) -> int:
    return 2 + (math.ceil(size / CHUNKED_UPLOAD) if size > CHUNKED_UPLOAD else 0)


def metadata_bytes(chunks: int, layers: int) -> tuple[int, int]:
    """(config bytes, skeleton bytes) of one image recording `chunks` chunks, `layers` of them its own."""
    return CONFIG_FIXED + CONFIG_PER_CHUNK * chunks, SKELETON_FIXED + SKELETON_PER_BLOB * layers


def manifest_bytes(layers: int, payload: int) -> int:
    return MANIFEST_FIXED + (LAYER_JSON + len(str(payload))) * layers


def push(job: Job, *, dedup: bool, incremental: bool) -> dict[str, float]:
    """One checkpoint of every process.  `incremental`: each image is a child holding `changed` of its chunks
    (its parent, the previous checkpoint, is in the registry already); `dedup`: blobs are by content (vramd),
    else every process's payloads are its own (a tar per process, or per-process salted digests)."""
    n, p = job.chunks, job.processes
    own = math.ceil(n * job.changed) if incremental else n  # payload layers of each image
    shared = math.floor(own * job.replicated_fraction)  # of those, identical across the replica group
    if dedup:
        groups = p // job.replicas if job.replicas else p
        distinct = groups * shared + p * (own - shared)
    else:
        distinct = p * own
    cfg, skel = metadata_bytes(n, own)
    parent_layers = n + 2 if incremental else 0  # the chain's parent, HEADed again on each push
    heads = p * (own + 2 + parent_layers)
    uploads = distinct + 2 * p  # configs and skeletons are each image's own
    puts = uploads + p * (2 if incremental else 1)
    patches = distinct * (_upload_requests(job.payload) - 2)
    payload_up = distinct * job.payload
    meta_up = p * (cfg + skel)
    racing = (p * own if dedup else distinct) + 2 * p
    mbytes = manifest_bytes(own, job.payload)
    return {
        "images": p, "layers_per_image": own + 2, "blobs_uploaded": uploads,
        "HEAD": heads, "POST": uploads,
        "PATCH": patches,
        "PUT": puts,  # closing PUTs, then each manifest of the chain (the parent's is PUT again)
        "requests": heads + uploads + patches + puts,
        "bytes_uploaded": payload_up + meta_up, "payload_bytes_uploaded": payload_up,
        "bytes_stored": payload_up + meta_up + p * mbytes,
        "racing_uploads": racing, "racing_bytes_uploaded": racing * job.payload + meta_up,
        "manifest_bytes": mbytes, "manifest_over_limit": mbytes > MANIFEST_LIMIT,
    }


def restore(job: Job, *, incremental: bool) -> dict[str, float]:
    """Every process pulls its image (an incremental child: and its parent) at once; each node downloads what
    its own cache lacks; a pull-through cache shared by `nodes_per_cache` nodes fetches each blob once from
    the object store behind the registry."""
    n, p = job.chunks, job.processes
    child = math.ceil(n * job.changed) if incremental else n
    layers = n + child if incremental else n  # a child's pull brings its parent's full set along
    images = 2 if incremental else 1
    blob_gets = p * (layers + 2 * images) * (1 - job.per_node_cache_hit)  # a warm cache: the manifest GET only
    node_bytes = job.gpus * layers * job.payload * (1 - job.per_node_cache_hit)
    node_bw = job.node_gbps * 1e9 / 8
    seconds = node_bytes / node_bw if node_bw else math.inf
    total = job.nodes * node_bytes
    distinct = (p // job.replicas if job.replicas else p) * layers * job.payload
    return {
        "GET_manifest": p * images, "GET_blob": round(blob_gets), "bytes_served": round(total),
        "node_seconds": seconds, "registry_bytes_per_s": total / seconds if seconds else 0.0,
        "registry_requests_per_s": (blob_gets + p * images) / seconds if seconds else 0.0,
        "distinct_bytes": distinct, "fan_out": total / distinct if distinct else 0.0,
        "object_store_bytes": round(min(total, math.ceil(job.nodes / max(1, job.nodes_per_cache)) * distinct)
                                    if job.nodes_per_cache > 1 else total),
    }


def simulate(job: Job) -> dict[str, object]:
    thousand = replace(job, nodes=1000, replicas=1000 if job.replicas == job.nodes else job.replicas)
    big = replace(job, chunk=64 << 20)
    return {
        "job": asdict(job),
        "push": {"no_dedup": push(job, dedup=False, incremental=False),
                 "dedup": push(job, dedup=True, incremental=False),
                 "dedup_incremental": push(job, dedup=True, incremental=True)},
        "restore": {"full": restore(job, incremental=False), "incremental": restore(job, incremental=True)},
        "restore_node_cache_warm": restore(replace(job, per_node_cache_hit=1.0), incremental=False),
        "chunk_64MiB": {"push_dedup": push(big, dedup=True, incremental=False),
                        "restore": restore(big, incremental=False)},
        "nodes_1000": {"push_dedup": push(thousand, dedup=True, incremental=False),
                       "restore": restore(thousand, incremental=False)},
    }


def _table(res: dict[str, object]) -> str:
    lines = []
    for part in ("push", "restore", "restore_node_cache_warm", "chunk_64MiB", "nodes_1000"):
        section = res[part]
        assert isinstance(section, dict)
        for mode, vals in (section.items() if part != "restore_node_cache_warm" else [("all", section)]):
            lines.append(f"{part}/{mode}: " + ", ".join(
                f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in vals.items()))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    for f in fields(Job):
        ap.add_argument("--" + f.name.replace("_", "-"), type=float if f.type in ("float", float) else
                        (lambda s: int(float(s))), default=f.default)
    ap.add_argument("--json", action="store_true", help="the results as JSON on stdout")
    a = ap.parse_args(argv)
    job = Job(**{f.name: getattr(a, f.name) for f in fields(Job)})
    res = simulate(job)
    print(json.dumps(res, indent=2, sort_keys=True) if a.json else _table(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
