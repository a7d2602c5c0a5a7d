"""Registry data is untrusted: crafted OCI manifests and skeletons are refused before vramd writes a byte,
allocates without bound, or uses a blob it did not verify (vramd.oci.layout; the real registry for the end to
end cases)."""
from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import pytest
import zstandard
from oci_helpers import Node, files_of, ok, user_cache, vramctl, workload_bos  # noqa: F401 (user_cache: autouse)

from vramd.errors import CorruptManifestError
from vramd.image.manifest import decode_manifest
from vramd.oci import layout as L
from vramd.oci.registry import Registry
from vramd.oci.tls import Trust

D1, D2 = "sha256:" + "1" * 64, "sha256:" + "2" * 64
NAME = "data-0123456789abcdef-00000000.vrd"


def manifest_doc(**over: object) -> dict:
    doc = {"schemaVersion": 2, "mediaType": L.MEDIA_OCI_MANIFEST, "artifactType": L.ARTIFACT_TYPE,
           "config": {"mediaType": L.CONFIG_MEDIA[3], "digest": D1, "size": 100},
           "layers": [{"mediaType": L.MEDIA_SKELETON, "digest": D2, "size": 10}]}
    doc.update(over)
    return doc


@pytest.mark.parametrize("change, what", [
    ({"artifactType": "application/vnd.other"}, "not a vramd image"),
    ({"mediaType": "application/vnd.docker.distribution.manifest.v2+json"}, "not an OCI image manifest"),
    ({"config": {"mediaType": "application/octet-stream", "digest": D1, "size": 1}}, "media type"),
    ({"config": {"mediaType": L.CONFIG_MEDIA[3], "digest": "sha256:../../etc", "size": 1}}, "digest"),
    ({"config": {"mediaType": L.CONFIG_MEDIA[3], "digest": D1, "size": -1}}, "size"),
    ({"config": {"mediaType": L.CONFIG_MEDIA[3], "digest": D1, "size": True}}, "size"),
    ({"config": {"mediaType": L.CONFIG_MEDIA[3], "digest": D1, "size": 1 << 40}}, "size"),
    ({"layers": []}, "layers"),
    ({"layers": [{"mediaType": L.MEDIA_CHUNK, "digest": D2, "size": 1}]}, "media type"),
    ({"layers": [{"mediaType": L.MEDIA_SKELETON, "digest": D2, "size": 1},
                 {"mediaType": L.MEDIA_CHUNK, "digest": D1, "size": 1 << 31}]}, "size"),
    ({"layers": [{"mediaType": L.MEDIA_SKELETON, "digest": D2, "size": 1},
                 {"mediaType": L.MEDIA_CHUNK, "digest": D1, "size": 1},
                 {"mediaType": L.MEDIA_CHUNK, "digest": D1, "size": 1}]}, "listed twice"),
    ({"annotations": {L.ANN_PARENT: "sha256:nope"}}, "not a sha256 digest"),
    ({"annotations": {L.ANN_PARENT: D1},
      "subject": {"mediaType": L.MEDIA_OCI_MANIFEST, "digest": D2, "size": 5}}, "different parents"),
    ({"annotations": {"k": 5}}, "annotations"),
])
def test_crafted_oci_manifests_are_refused(change, what):
    L.decode_oci_manifest(json.dumps(manifest_doc()).encode(), "ref")  # the unchanged one passes
    with pytest.raises(CorruptManifestError, match=what):
        L.decode_oci_manifest(json.dumps(manifest_doc(**change)).encode(), "ref")


def test_an_oversized_or_undecodable_oci_manifest_is_refused():
    with pytest.raises(CorruptManifestError, match="larger than"):
        L.decode_oci_manifest(b" " * (L.MAX_OCI_MANIFEST + 1), "ref")
    with pytest.raises(CorruptManifestError, match="not JSON"):
        L.decode_oci_manifest(b"\xff{", "ref")


def raw_skeleton(name: bytes, length: int, segs: bytes, nseg: int, blobs: list[tuple[bytes, int]] = (),
                 tail: bytes = b"") -> bytes:
    out = L.SKELETON_MAGIC + struct.pack("<I", len(blobs))
    for h, n in blobs:
        out += struct.pack("<32sQ", h, n)
    out += struct.pack("<I", 1) + struct.pack("<H", len(name)) + name + struct.pack("<QI", length, nseg) + segs
    return zstandard.ZstdCompressor().compress(out + tail)


def lit(data: bytes) -> bytes:
    return bytes([L.LITERAL]) + struct.pack("<I", len(data)) + data


@pytest.mark.parametrize("blob, what", [
    (raw_skeleton(b"../../etc/passwd", 3, lit(b"abc"), 1), "not a data file name"),
    (raw_skeleton(b"/tmp/x.vrd", 3, lit(b"abc"), 1), "not a data file name"),
    (raw_skeleton(NAME.encode() + b"\0", 3, lit(b"abc"), 1), "not a data file name"),
    (raw_skeleton(NAME.encode(), 3, bytes([L.ZEROS]) + struct.pack("<Q", 1 << 62), 1), "run past"),
    (raw_skeleton(NAME.encode(), 4, lit(b"abc"), 1), "cover 3 of its 4"),
    (raw_skeleton(NAME.encode(), 3, bytes([L.PAYLOAD]) + struct.pack("<I", 0), 1), "not in the table"),
    (raw_skeleton(NAME.encode(), 3, bytes([L.LITERAL]) + struct.pack("<I", L.MAX_LITERAL + 1), 1), "literal run"),
    (raw_skeleton(NAME.encode(), 3, bytes([7]), 1), "unknown segment kind"),
    (raw_skeleton(NAME.encode(), 3, lit(b"") + lit(b"abc"), 2), "an empty run"),
    (raw_skeleton(NAME.encode(), 3, bytes([L.ZEROS]) + struct.pack("<Q", 0) + lit(b"abc"), 2), "an empty run"),
    (raw_skeleton(NAME.encode(), 3, lit(b"abc"), 1 << 31), "cannot fit"),
    (raw_skeleton(NAME.encode(), 3, lit(b"abc"), 1, tail=b"x"), "trailing"),
    (raw_skeleton(NAME.encode(), 3, lit(b"abc"), 1)[:-3], "zstd|cut short"),
    (b"not zstd at all", "not a zstd frame"),
    (zstandard.ZstdCompressor().compress(b"NOTSKEL!"), "bad magic"),
])
def test_crafted_skeletons_are_refused(blob, what):
    L.decode_skeleton(raw_skeleton(NAME.encode(), 3, lit(b"abc"), 1))  # well-formed: passes
    with pytest.raises(CorruptManifestError, match=what):
        L.decode_skeleton(blob)


def test_a_skeleton_that_decompresses_without_bound_is_refused():
    bomb = zstandard.ZstdCompressor(level=1).compress(L.SKELETON_MAGIC + bytes(L.MAX_SKELETON + 1))
    assert len(bomb) < 1 << 20
    with pytest.raises(CorruptManifestError, match="decompresses to more than"):
        L.decode_skeleton(bomb)


@pytest.fixture
def pushed(run_dir, tmp_path, registry):
    """An image pushed to the registry: (its directory, the registry client, repo, its OCI manifest)."""
    with Node(run_dir, tmp_path / "node") as n:
        img = tmp_path / "image"
        n.dump(img, workload_bos())
    ok(vramctl("push", str(img), f"{registry.host}/jobs/good:1", "--plain-http", "--json"))
    reg = Registry(registry.host, trust=Trust(plain_http=True), actions=("pull", "push"))
    body, _ = reg.get_manifest("jobs/good", "1", 1 << 20)
    yield img, reg, "jobs/good", json.loads(body)
    reg.close()


def put_crafted(reg: Registry, repo: str, doc: dict, tag: str) -> None:
    reg.put_manifest(repo, tag, json.dumps(doc).encode())


def test_a_skeleton_naming_files_the_manifest_does_not_list_writes_nothing(pushed, registry, tmp_path):
    img, reg, repo, doc = pushed
    config = (img / "manifest.vrdm").read_bytes()
    m = decode_manifest(config)
    # a data file name of the right pattern, but not one of the image's
    sk = L.Skeleton((), (L.FileSkeleton("data-" + "f" * 16 + "-00000000.vrd", 3, (L.Segment(L.LITERAL, 3, b"abc"),)),))
    blob = L.encode_skeleton(sk)
    reg.upload_blob(repo, L.sha256_digest(blob), blob)
    doc["layers"] = [{"mediaType": L.MEDIA_SKELETON, "digest": L.sha256_digest(blob), "size": len(blob)}]
    put_crafted(reg, repo, doc, "crafted")
    before = sorted(p.name for p in tmp_path.iterdir())
    r = vramctl("pull", f"{registry.host}/{repo}:crafted", str(tmp_path / "dest"), "--plain-http", "--json")
    assert r.returncode == 1 and json.loads(r.stdout)["error"]["code"] == "CORRUPT_MANIFEST", r.stdout
    assert "not the ones manifest.vrdm lists" in r.stderr or "payload table" in r.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # not even the directory stays
    assert m.files  # (the image has data files: the refusal is about names, not an empty image)


def test_a_blob_longer_than_its_descriptor_is_refused(pushed, registry, tmp_path):
    _img, reg, repo, doc = pushed
    # the skeleton and the layer say a payload is one byte shorter than the blob the registry serves
    big = max(doc["layers"][1:], key=lambda d: d["size"])
    k = doc["layers"].index(big) - 1
    sk = L.decode_skeleton(reg.get_blob(repo, doc["layers"][0]["digest"], doc["layers"][0]["size"]))
    files = []
    for f in sk.files:
        segs = []
        for s in f.segments:
            if s.kind == L.PAYLOAD and s.blob == k:
                segs += [L.Segment(L.PAYLOAD, s.length - 1, blob=k), L.Segment(L.LITERAL, 1, b"x")]
            else:
                segs.append(s)
        files.append(L.FileSkeleton(f.name, f.length, tuple(segs)))
    blobs = list(sk.blobs)
    blobs[k] = (blobs[k][0], blobs[k][1] - 1)
    crafted = L.encode_skeleton(L.Skeleton(tuple(blobs), tuple(files)))
    reg.upload_blob(repo, L.sha256_digest(crafted), crafted)
    doc["layers"][0] = {"mediaType": L.MEDIA_SKELETON, "digest": L.sha256_digest(crafted), "size": len(crafted)}
    big["size"] -= 1
    put_crafted(reg, repo, doc, "short")
    r = vramctl("pull", f"{registry.host}/{repo}:short", str(tmp_path / "dest"), "--plain-http", "--json")
    assert r.returncode == 1, r.stderr
    assert r.stdout, r.stderr
    e = json.loads(r.stdout)["error"]
    assert e["code"] == "DIGEST_MISMATCH" and big["digest"] in e["message"] and e["bo_id"] is not None
    assert not (tmp_path / "dest").exists()


def test_a_config_that_is_no_vramd_manifest_is_refused(pushed, registry, tmp_path):
    _img, reg, repo, doc = pushed
    junk = os.urandom(200)
    reg.upload_blob(repo, L.sha256_digest(junk), junk)
    doc["config"] = {"mediaType": L.CONFIG_MEDIA[3], "digest": L.sha256_digest(junk), "size": len(junk)}
    put_crafted(reg, repo, doc, "junk")
    r = vramctl("pull", f"{registry.host}/{repo}:junk", str(tmp_path / "dest"), "--plain-http", "--json")
    assert r.returncode == 1 and json.loads(r.stdout)["error"]["code"] == "CORRUPT_MANIFEST"
    assert not (tmp_path / "dest").exists()


def test_pull_refuses_a_directory_holding_something_else(pushed, registry, tmp_path):
    img, _reg, repo, _doc = pushed
    dest = tmp_path / "busy"
    dest.mkdir()
    (dest / "notes.txt").write_text("mine")
    r = vramctl("pull", f"{registry.host}/{repo}:1", str(dest), "--plain-http")
    assert r.returncode == 1 and "not empty" in r.stderr
    assert sorted(p.name for p in dest.iterdir()) == ["notes.txt"]
    ok(vramctl("pull", f"{registry.host}/{repo}:1", str(tmp_path / "fresh"), "--plain-http", "--json"))
    assert files_of(tmp_path / "fresh") == files_of(img)


def test_a_parent_path_a_crafted_child_records_never_leads_outside(run_dir, registry, tmp_path):
    """A child whose manifest.vrdm records its parent at `../../../<somewhere>`: pull puts the parent beside
    the child as DEST.parent-1, never where the recorded path leads."""
    from vramd.image.manifest import encode_manifest
    with Node(run_dir, tmp_path / "node") as n:
        parent, child = tmp_path / "ckpt" / "p", tmp_path / "ckpt" / "c"
        bos = workload_bos()
        n.dump(parent, bos)
        n.dump(child, [bos[0], os.urandom(len(bos[1]))], "--parent", str(parent))
    m = decode_manifest((child / "manifest.vrdm").read_bytes())
    assert m.parents[0].relative_path == "../p"
    m.parents[0].relative_path = "../../../escape"
    (child / "manifest.vrdm").write_bytes(encode_manifest(m))  # a valid manifest, recording another path
    ref = f"{registry.host}/jobs/crafted:1"
    ok(vramctl("push", str(child), ref, "--plain-http", "--json", "--parent", str(parent)))
    dest = tmp_path / "pulled" / "c"
    dest.parent.mkdir()
    got = ok(vramctl("pull", ref, str(dest), "--plain-http", "--json"))
    assert [c["dir"] for c in got["chain"]] == [str(dest), f"{dest}.parent-1"]
    assert files_of(tmp_path / "pulled" / "c.parent-1") == files_of(parent)
    assert not (tmp_path.parent.parent / "escape").exists() and not (tmp_path / "escape").exists()


def test_a_blob_past_the_chunked_threshold_goes_up_in_patches(registry):
    from vramd.oci.registry import CHUNKED_UPLOAD
    reg = Registry(registry.host, trust=Trust(plain_http=True), actions=("pull", "push"))
    try:
        data = os.urandom(CHUNKED_UPLOAD + 12345)
        digest = L.sha256_digest(data)
        reg.upload_blob("big/blob", digest, data)
        patches = [r for r in registry.access_log() if r.method == "PATCH"]
        assert len(patches) == 2 and all(r.status == 202 for r in patches)
        assert registry.stored_blobs()[digest] == len(data)
        assert reg.get_blob("big/blob", digest, len(data)) == data
    finally:
        reg.close()


@pytest.mark.parametrize("text, parsed", [
    ("127.0.0.1:5000/jobs/train:step1", ("127.0.0.1:5000", "jobs/train", "step1", None)),
    ("oci://registry.example/a/b/c", ("registry.example", "a/b/c", None, None)),
    ("localhost/x@sha256:" + "a" * 64, ("localhost", "x", None, "sha256:" + "a" * 64)),
    ("[::1]:5000/x:v1.2-rc_3", ("[::1]:5000", "x", "v1.2-rc_3", None)),
])
def test_references_parse(text, parsed):
    from vramd.oci.registry import Reference
    r = Reference.parse(text)
    assert (r.host, r.repo, r.tag, r.digest) == parsed


@pytest.mark.parametrize("text", [
    "library/ubuntu", "host.example", "host.example/", "host.example/UPPER", "host.example/a/../b",
    "host.example/a:bad tag", "host.example/a@sha256:short", "host.example/a//b", "ho st/a", "host.example/a:",
])
def test_references_refused(text):
    from vramd.errors import RegistryError
    from vramd.oci.registry import Reference
    with pytest.raises(RegistryError):
        Reference.parse(text)


@pytest.mark.parametrize("command", ["push", "pull"])
def test_credentials_written_into_a_reference_are_refused_unechoed(tmp_path, command):
    secret = "pw-" + os.urandom(8).hex()
    ref = f"alice:{secret}@127.0.0.1:9/jobs/x:1"
    args = [str(tmp_path), ref] if command == "push" else [ref, str(tmp_path / "d")]
    r = vramctl(command, *args, "--plain-http", "--json")
    # a usage error (exit 2): the usage, then the one line saying what to do
    assert r.returncode == 2 and r.stderr.splitlines()[-1].startswith("vramctl: error: "), r.stderr
    assert "holds no credentials" in r.stderr.splitlines()[-1], r.stderr
    assert secret not in r.stderr + r.stdout and "--password-stdin" in r.stderr


def pull_peak(ref: str, dest: Path, tmp_path: Path):
    """vramctl pull REF DEST --plain-http --json, and the pull's own peak memory in KiB (helpers.vramctl_peak)."""
    from helpers import vramctl_peak
    return vramctl_peak(tmp_path, "pull", ref, str(dest), "--plain-http", "--json", timeout=600)


def test_a_config_descriptor_claiming_a_gigabyte_allocates_as_bytes_arrive(pushed, registry, tmp_path):
    """A config whose descriptor says 1 GiB while the registry serves 100 bytes: refused by digest once the
    100 bytes are in, with a buffer of its first 64 MiB at most (vramctl's peak memory stays far below 1 GiB)."""
    _img, reg, repo, doc = pushed
    junk = os.urandom(100)
    reg.upload_blob(repo, L.sha256_digest(junk), junk)
    doc["config"] = {"mediaType": L.CONFIG_MEDIA[3], "digest": L.sha256_digest(junk), "size": 1 << 30}
    put_crafted(reg, repo, doc, "huge")
    r, peak = pull_peak(f"{registry.host}/{repo}:huge", tmp_path / "dest", tmp_path)
    assert r.returncode == 1 and json.loads(r.stdout)["error"]["code"] == "DIGEST_MISMATCH", r.stderr
    assert peak < 400 << 10, peak  # KiB: well under the 1 GiB claimed
    assert not (tmp_path / "dest").exists()


def test_a_skeleton_of_millions_of_tiny_runs_is_refused_before_they_are_made(pushed, registry, tmp_path):
    """A skeleton layer of 12 M payload runs (5 bytes each: 60 MB, a few KB once compressed, within the 256 MiB
    bound): each run decoded is a Python object of ~100 bytes, so decoding them all would hold over 1 GiB.
    Refused by count (MAX_SEGMENTS) before one is made; pull's peak memory stays far below."""
    _img, reg, repo, doc = pushed
    layer = doc["layers"][1]
    n = 12 << 20
    raw = (L.SKELETON_MAGIC + struct.pack("<I", 1) + struct.pack("<32sQ", bytes.fromhex(layer["digest"][7:]),
                                                                  layer["size"])
           + struct.pack("<I", 1) + struct.pack("<H", len(NAME)) + NAME.encode()
           + struct.pack("<QI", n * layer["size"], n) + (bytes([L.PAYLOAD]) + struct.pack("<I", 0)) * n)
    blob = zstandard.ZstdCompressor(level=3).compress(raw)
    del raw
    assert len(blob) < 1 << 20
    reg.upload_blob(repo, L.sha256_digest(blob), blob)
    doc["layers"] = [{"mediaType": L.MEDIA_SKELETON, "digest": L.sha256_digest(blob), "size": len(blob)}, layer]
    put_crafted(reg, repo, doc, "runs")
    r, peak = pull_peak(f"{registry.host}/{repo}:runs", tmp_path / "dest", tmp_path)
    assert peak < 400 << 10, peak  # KiB
    assert r.returncode == 1 and json.loads(r.stdout)["error"]["code"] == "CORRUPT_MANIFEST", r.stderr
    assert "segments cannot fit" in r.stderr, r.stderr
    assert not (tmp_path / "dest").exists()


def test_a_skeleton_whose_payload_table_is_not_the_artifacts_layers_is_refused_before_it_is_built():
    """The payload count is checked against the artifact's layers before a table entry is made (a table of
    millions of copies of one entry compresses to nothing)."""
    ok_blob = raw_skeleton(NAME.encode(), 3, lit(b"abc"), 1)
    L.decode_skeleton(ok_blob, layers=0)
    with pytest.raises(CorruptManifestError, match="1 payload layers"):
        L.decode_skeleton(ok_blob, layers=1)
    many = raw_skeleton(NAME.encode(), 3, lit(b"abc"), 1, blobs=[(b"\1" * 32, 1)] * (1 << 16))
    with pytest.raises(CorruptManifestError, match="65536 payloads, but the artifact has 2"):
        L.decode_skeleton(many, layers=2)


def test_a_parent_name_a_child_records_never_takes_a_directory_already_there(run_dir, registry, tmp_path):
    """The parent's directory name comes from the child's manifest.vrdm, i.e. from the registry: `../victim`,
    where the caller has a directory holding a dump in progress (its temporaries) and an empty one.  Neither is
    touched (a pull sweeps a dead dump's temporaries from the directory it fills): the parent goes beside the
    child as DEST.parent-1.  A name that is free, or holds that very parent, is still taken (restore's cache)."""
    from vramd.image.manifest import encode_manifest
    with Node(run_dir, tmp_path / "node") as n:
        parent, child = tmp_path / "ckpt" / "p", tmp_path / "ckpt" / "c"
        bos = workload_bos()
        n.dump(parent, bos)
        n.dump(child, [bos[0], os.urandom(len(bos[1]))], "--parent", str(parent))
    m = decode_manifest((child / "manifest.vrdm").read_bytes())
    for name in ("victim", "empty"):
        m.parents[0].relative_path = f"../{name}"
        (child / "manifest.vrdm").write_bytes(encode_manifest(m))
        ok(vramctl("push", str(child), f"{registry.host}/jobs/{name}:1", "--plain-http", "--json", "--parent",
                   str(parent)))
    pulled = tmp_path / "pulled"
    (pulled / "victim").mkdir(parents=True)
    dumping = pulled / "victim" / "data-0123456789abcdef-00000000.vrd.tmp"  # a dump's, not yet committed
    dumping.write_bytes(b"a dump in progress")
    (pulled / "empty").mkdir()
    for name in ("victim", "empty"):
        dest = pulled / f"c-{name}"
        got = ok(vramctl("pull", f"{registry.host}/jobs/{name}:1", str(dest), "--plain-http", "--json"))
        assert [c["dir"] for c in got["chain"]] == [str(dest), f"{dest}.parent-1"]
        assert files_of(Path(f"{dest}.parent-1")) == files_of(parent)
    assert dumping.read_bytes() == b"a dump in progress" and os.listdir(pulled / "victim") == [dumping.name]
    assert os.listdir(pulled / "empty") == []
    # a free name is taken, and taken again once it holds that parent (as restore's cache pulls again)
    other = tmp_path / "other"
    other.mkdir()
    for k, cached in ((1, False), (2, True)):
        got = ok(vramctl("pull", f"{registry.host}/jobs/victim:1", str(other / f"c{k}"), "--plain-http", "--json"))
        assert got["chain"][1]["dir"] == str(other / "victim") and got["chain"][1]["cached"] is cached, got
    assert files_of(other / "victim") == files_of(parent)
