"""An OCI image index from a registry is untrusted (vramd.oci.index): crafted indexes in the real registry, built
from a real image's parts, are refused by vramctl pull and restore --image oci:// with one typed line, before a
file is written; and the pure split/encode/decode rules (every part within the budget, the parts' layers the
skeleton's table, the index in the bytes an OCI 1.0 client writes back)."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from oci_helpers import Node, ok, user_cache, vramctl, workload_bos  # noqa: F401 (user_cache: autouse)

from vramd.errors import CorruptManifestError, ImageError
from vramd.oci import index as X
from vramd.oci import layout as L
from vramd.oci.registry import Registry
from vramd.oci.tls import Trust

REPO = "jobs/big"


@pytest.fixture
def indexed(run_dir, tmp_path, registry):
    """A real image pushed as an index of 3+ parts (tag `split`) and as one manifest (tag `single`): (its BO
    sizes, the registry client, the index's document, its parts' descriptors and documents)."""
    bos = [*workload_bos(), os.urandom(24 << 20)]
    with Node(run_dir, tmp_path / "node") as n:
        img = tmp_path / "image"
        n.dump(img, bos, "--compress", "none")
    ok(vramctl("push", str(img), f"{registry.host}/{REPO}:split", "--plain-http", "--json",
               "--max-manifest-bytes", "2048"))
    ok(vramctl("push", str(img), f"{registry.host}/{REPO}:single", "--plain-http", "--json"))
    reg = Registry(registry.host, trust=Trust(plain_http=True), actions=("pull", "push"))
    doc = json.loads(reg.get_manifest(REPO, "split", 1 << 20)[0])
    parts = [json.loads(reg.get_manifest(REPO, m["digest"], 1 << 20)[0]) for m in doc["manifests"]]
    assert len(parts) >= 3
    yield [len(b) for b in bos], reg, doc, doc["manifests"], parts
    reg.close()


def put(reg: Registry, doc: dict, tag: str | None = None, media: str = L.MEDIA_OCI_INDEX) -> dict:
    """`doc` into the registry (by `tag`, else by digest); its descriptor."""
    body = json.dumps(doc, separators=(",", ":")).encode()
    digest = reg.put_manifest(REPO, tag or L.sha256_digest(body), body, media)
    return {"mediaType": media, "digest": digest, "size": len(body)}


def refused(registry, tmp_path: Path, tag: str, what: str) -> None:
    """vramctl pull of `tag`: exit 1, CORRUPT_MANIFEST matching `what`, one line, nothing left behind."""
    before = sorted(p.name for p in tmp_path.iterdir())
    r = vramctl("pull", f"{registry.host}/{REPO}:{tag}", str(tmp_path / "dest"), "--plain-http", "--json")
    assert r.returncode == 1 and json.loads(r.stdout)["error"]["code"] == "CORRUPT_MANIFEST", (tag, r.stdout)
    assert what in r.stderr and r.stderr.count("\n") == 1, (tag, r.stderr)
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # not even the directory


def test_crafted_indexes_are_refused_before_a_file_is_written(indexed, registry, tmp_path):
    _sizes, reg, doc, entries, parts = indexed
    p0, p1, p2 = entries[0], entries[1], entries[2]
    single = json.loads(reg.get_manifest(REPO, "single", 1 << 20)[0])
    assert single["artifactType"] == L.ARTIFACT_TYPE
    cases = {
        "twice": ({**doc, "manifests": [p0, p1, p1, *entries[2:]]}, "a part listed twice"),
        # a part that is a whole image's manifest (another artifactType) where a part should be
        "whole": ({**doc, "manifests": [put(reg, single, media=L.MEDIA_OCI_MANIFEST), *entries[1:]]},
                  "not a part of a vramd image"),
        "order": ({**doc, "manifests": [p1, p0, *entries[2:]]}, "config: media type"),
        "count": ({**doc, "manifests": [p0] * (X.MAX_PARTS + 1)}, f"1 to {X.MAX_PARTS} parts"),
        "not-ours": ({**doc, "annotations": {"org.opencontainers.image.ref.name": "x"}},
                     "an OCI image index, but not of a vramd image"),
        "artifact-type": ({**doc, "artifactType": "application/vnd.other"}, "not of a vramd image"),
        "size": ({**doc, "manifests": [p0, {**p1, "size": p1["size"] + 1}, *entries[2:]]}, "not the"),
    }
    # a payload layer in two parts: part 1 again, with part 0's last payload in front
    dup = {**parts[1], "layers": [parts[0]["layers"][-1], *parts[1]["layers"]]}
    cases["layer-twice"] = ({**doc, "manifests": [p0, put(reg, dup, media=L.MEDIA_OCI_MANIFEST), p2,
                                                  *entries[3:]]}, "listed twice (again in part 1)")
    # an index in an index: the good index as a part
    good = {"mediaType": L.MEDIA_OCI_INDEX, "digest": reg.get_manifest(REPO, "split", 1 << 20)[1],
            "size": len(reg.get_manifest(REPO, "split", 1 << 20)[0])}
    cases["nested"] = ({**doc, "manifests": [good]}, "an index in an index")
    for tag, (crafted, _what) in cases.items():
        put(reg, crafted, tag)
    def manifest_gets() -> list[str]:
        return [r.path for r in registry.access_log() if r.method == "GET" and "/manifests/" in r.path]
    gets = manifest_gets()
    refused(registry, tmp_path, "count", cases["count"][1])
    assert manifest_gets()[len(gets):] == [f"/v2/{REPO}/manifests/count"]  # the index alone: no part fetched
    for tag, (_crafted, what) in cases.items():
        refused(registry, tmp_path, tag, what)
    ok(vramctl("pull", f"{registry.host}/{REPO}:split", str(tmp_path / "dest"), "--plain-http", "--json"))


def test_restore_of_a_crafted_index_writes_nothing(indexed, registry, tmp_path, run_dir):
    sizes, reg, doc, entries, parts = indexed
    dup = {**parts[2], "layers": [parts[1]["layers"][0], *parts[2]["layers"]]}
    put(reg, {**doc, "manifests": [entries[0], entries[1], put(reg, dup, media=L.MEDIA_OCI_MANIFEST),
                                   *entries[3:]]}, "bad")
    cache = tmp_path / "cache"
    with Node(run_dir, tmp_path / "node2") as other:
        outs = []
        for i, n in enumerate(sizes, 1):
            f = other.dir / f"out{i}.bin"
            f.write_bytes(b"\x5a" * n)
            outs += ["--bo-file", f"{i}={f}"]
        for more in (["--cache", str(cache)], ["--no-cache"]):
            r = vramctl("restore", "--pid", str(os.getpid()), "--image", f"oci://{registry.host}/{REPO}:bad", *outs,
                        "--plain-http", "--json", *more, socket=other.daemon.socket)
            assert r.returncode == 1 and json.loads(r.stdout)["error"]["code"] == "CORRUPT_MANIFEST", r.stdout
            assert "listed twice (again in part 2)" in r.stderr, r.stderr
        assert all((other.dir / f"out{i}.bin").read_bytes() == b"\x5a" * n for i, n in enumerate(sizes, 1))
    assert not cache.exists() or not any(p.is_file() for p in cache.rglob("*"))


# --- pure: the split, the index's bytes, the checks ---------------------------------------------------------------

def descs(n: int) -> tuple[L.Descriptor, L.Descriptor, list[L.Descriptor]]:
    config = L.Descriptor(L.CONFIG_MEDIA[3], "sha256:" + "c" * 64, 1000)
    skeleton = L.Descriptor(L.MEDIA_SKELETON, "sha256:" + "5" * 64, 500)
    chunks = [L.Descriptor(L.MEDIA_CHUNK, f"sha256:{i:064x}", 8 << 20) for i in range(n)]
    return config, skeleton, chunks


@pytest.mark.parametrize("budget", [1024, 1500, 4096, 65536])
def test_the_parts_fill_the_budget_and_their_layers_are_the_payloads_in_order(budget):
    config, skeleton, chunks = descs(1000)
    bodies = X.split(config, skeleton, chunks, budget)
    assert all(len(b) <= budget for b in bodies)
    parts = [X.decode_part(b, f"part {i}", first=i == 0) for i, b in enumerate(bodies)]
    assert parts[0].config == config and parts[0].skeleton == skeleton
    assert [c for p in parts for c in p.chunks] == chunks
    # as few as fill them: a part's next layer would not have fit in it
    for body, nxt in zip(bodies, parts[1:], strict=False):
        assert len(body) + len(json.dumps(nxt.chunks[0].to_json(), separators=(",", ":"))) + 1 > budget
    index = X.encode_index([L.Descriptor(L.MEDIA_OCI_MANIFEST, L.sha256_digest(b), len(b)) for b in bodies],
                           None, {"k": "v"})
    top = X.decode_top(index, "ref")
    assert isinstance(top, X.Index) and top.parent is None and top.annotations["k"] == "v"
    art = X.assemble(top, parts, "ref")
    assert (art.config, art.skeleton, list(art.chunks)) == (config, skeleton, chunks)


def test_a_budget_too_small_for_a_part_is_refused():
    config, skeleton, chunks = descs(3)
    with pytest.raises(ImageError, match="below"):
        X.split(config, skeleton, chunks, 1023)
    big = [L.Descriptor(L.MEDIA_CHUNK + "x" * 900, c.digest, c.size) for c in chunks]
    with pytest.raises(ImageError, match="does not hold one payload layer"):
        X.split(config, skeleton, big, 1024)


def test_the_index_is_in_the_bytes_a_go_client_writes_back():
    """Fields in image-spec 1.1's order (artifactType, subject), annotations by key, HTML characters escaped as
    Go's encoding/json does: what a Go client that re-encodes an index it copies writes back."""
    part = L.Descriptor(L.MEDIA_OCI_MANIFEST, "sha256:" + "a" * 64, 7)
    parent = L.Descriptor(L.MEDIA_OCI_INDEX, "sha256:" + "b" * 64, 9)
    body = X.encode_index([part], parent, {"z": "<&>", "a": "é"})
    assert body == ('{"schemaVersion":2,"mediaType":"application/vnd.oci.image.index.v1+json",'
                    '"artifactType":"application/vnd.vramd.image.v1","manifests":[{'
                    '"mediaType":"application/vnd.oci.image.manifest.v1+json","digest":"sha256:' + "a" * 64 +
                    '","size":7}],"subject":{"mediaType":"application/vnd.oci.image.index.v1+json","digest":"sha256:' +
                    "b" * 64 + '","size":9},"annotations":{"a":"é","org.vramd.image.parent":"sha256:' + "b" * 64 +
                    '","org.vramd.image.type":"application/vnd.vramd.image.v1","z":"\\u003c\\u0026\\u003e"}}'
                    ).encode()
    top = X.decode_top(body, "ref")
    assert isinstance(top, X.Index) and top.parent == parent.digest and top.annotations["z"] == "<&>"


def test_a_manifest_may_name_an_index_as_its_parent_and_nothing_else():
    doc = {"schemaVersion": 2, "mediaType": L.MEDIA_OCI_MANIFEST, "artifactType": L.ARTIFACT_TYPE,
           "config": {"mediaType": L.CONFIG_MEDIA[3], "digest": "sha256:" + "1" * 64, "size": 100},
           "layers": [{"mediaType": L.MEDIA_SKELETON, "digest": "sha256:" + "2" * 64, "size": 10}],
           "annotations": {L.ANN_PARENT: "sha256:" + "3" * 64},
           "subject": {"mediaType": L.MEDIA_OCI_INDEX, "digest": "sha256:" + "3" * 64, "size": 5}}
    assert L.decode_oci_manifest(json.dumps(doc).encode(), "ref").parent == "sha256:" + "3" * 64
    doc["subject"]["mediaType"] = "application/vnd.docker.distribution.manifest.list.v2+json"
    with pytest.raises(CorruptManifestError, match="subject: media type"):
        L.decode_oci_manifest(json.dumps(doc).encode(), "ref")


@pytest.mark.parametrize("args, what", [
    (["--annotation", "org.vramd.image.type=application/vnd.other"], "vramctl sets it from the image"),
    (["--max-manifest-bytes", "1023"], "--max-manifest-bytes: 1023: must be at least 1024"),
    (["--max-manifest-bytes", str(L.MAX_OCI_MANIFEST + 1)], "must be at most"),  # a pull would refuse it
    (["--annotation", "org.example.note=caf\udce9"], "not UTF-8 text"),  # argv's bytes c a f 0xe9
])
def test_an_index_vramctl_could_not_write_is_a_usage_error(tmp_path, args, what):
    r = vramctl("push", str(tmp_path / "image"), "127.0.0.1:1/jobs/x:1", "--plain-http", *args)
    assert r.returncode == 2 and what in r.stderr, r.stderr


def test_a_push_never_makes_an_index_a_pull_refuses():
    """More parts than a pull takes (long layer descriptors keep it quick): index_for refuses them before anything
    is sent, where the index encoded anyway is one decode_top refuses."""
    config, skeleton, _ = descs(0)
    budget = 200_000  # ~200 layers of ~1 kB a part; the index of ~1,030 parts ~165 kB, within the budget
    chunks = [L.Descriptor(L.MEDIA_CHUNK + "x" * 900, f"sha256:{i:064x}", 1) for i in range(210_000)]
    parts = X.split(config, skeleton, chunks, budget)
    assert len(parts) > X.MAX_PARTS
    whole = X.encode_index([L.Descriptor(L.MEDIA_OCI_MANIFEST, L.sha256_digest(p), len(p)) for p in parts], None, {})
    assert len(whole) <= budget
    with pytest.raises(CorruptManifestError, match=f"1 to {X.MAX_PARTS} parts"):
        X.decode_top(whole, "ref")
    with pytest.raises(ImageError, match=f"a pull takes at most {X.MAX_PARTS}"):
        X.index_for(parts, None, {}, budget)
    ok_parts = parts[:X.MAX_PARTS]
    assert isinstance(X.decode_top(X.index_for(ok_parts, None, {}, budget), "ref"), X.Index)
    with pytest.raises(ImageError, match="above the"):
        X.split(config, skeleton, chunks, L.MAX_OCI_MANIFEST + 1)


def test_a_push_whose_index_a_pull_would_refuse_sends_nothing(run_dir, tmp_path, registry):
    """Annotations of 1.1 MB on an image over the budget: its index is within the budget and the registry's cap,
    but over the 1 MiB a pull reads (MAX_INDEX).  The push refuses it before a blob is sent; no tag."""
    with Node(run_dir, tmp_path / "node", "--chunk-size", "4K") as n:
        img = tmp_path / "image"
        n.dump(img, [os.urandom(1000 * 4096)], "--compress", "none")
    notes = [a for i in range(9) for a in ("--annotation", f"org.example.note{i}={'n' * (120 << 10)}")]
    ref = f"{registry.host}/{REPO}:noted"
    r = vramctl("push", str(img), ref, "--plain-http", "--json", "--max-manifest-bytes", str(1_200_000), *notes)
    assert r.returncode == 1 and json.loads(r.stdout)["error"]["code"] == "IMAGE_ERROR", (r.stdout, r.stderr[-500:])
    assert f"or the {X.MAX_INDEX} a pull takes" in r.stderr, r.stderr
    assert not [e for e in registry.access_log() if e.method in ("POST", "PUT", "PATCH")]  # no blob, no tag
