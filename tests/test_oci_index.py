"""An image whose OCI manifest is over a registry's cap goes up as an OCI image index of part manifests
(vramd.oci.index; docs/image-format.md, "The artifact"): against the real registry (Debian's docker-registry)
and real daemons, a budget small enough to split a small image: push, pull and restore byte-exact, a second
push that uploads nothing, an incremental child over an indexed parent, skopeo copying the index unchanged (and
without --all, part 0 alone: refused by name), and a push cut before its index (no tag; a second push completes
it).  The hostile cases are in test_oci_index_hostile.py."""
from __future__ import annotations

import hashlib
import http.server
import json
import os
import subprocess
import threading

import pytest
import urllib3
from helpers import vramctl
from oci_helpers import Node, blob_writes, files_of, ok, user_cache, workload_bos  # noqa: F401 (user_cache: autouse)

from vramd.image.manifest import decode_manifest
from vramd.oci import index as X
from vramd.oci import layout as L
from vramd.oci.registry import Registry
from vramd.oci.tls import Trust

BUDGET = "2048"  # bytes of manifest JSON: ~10 payload layers (1 MiB chunks) per part


@pytest.fixture
def node(run_dir, tmp_path):
    with Node(run_dir, tmp_path / "node1") as n:
        yield n


def big_bos() -> list[bytes]:
    """~30 distinct payloads (the test daemon's chunks are 1 MiB): three parts at BUDGET."""
    return [*workload_bos(), os.urandom(24 << 20)]


def read_index(registry, repo: str, ref: str) -> tuple[dict, list[dict], list[bytes]]:
    """The index at `ref` as the registry holds it, its parts' documents and bodies (fetched by digest)."""
    reg = Registry(registry.host, trust=Trust(plain_http=True))
    try:
        body, _ = reg.get_manifest(repo, ref, 1 << 20)
        doc = json.loads(body)
        bodies = [reg.get_manifest(repo, m["digest"], 1 << 20)[0] for m in doc["manifests"]]
    finally:
        reg.close()
    return doc, [json.loads(b) for b in bodies], bodies


def test_an_image_over_the_budget_goes_up_as_an_index_and_comes_back_byte_exact(node, registry, tmp_path):
    bos = big_bos()
    img = tmp_path / "ckpt" / "step1"
    node.dump(img, bos, "--compress", "none")
    ref = f"{registry.host}/jobs/big:step1"
    first = ok(vramctl("push", str(img), ref, "--plain-http", "--json", "--max-manifest-bytes", BUDGET,
                       "--annotation", "org.vramd.image.pid=4242"))
    assert first["chain"][0]["media_type"] == L.MEDIA_OCI_INDEX

    doc, parts, bodies = read_index(registry, "jobs/big", "step1")
    raw = json.dumps(doc, separators=(",", ":")).encode()
    assert "sha256:" + hashlib.sha256(raw).hexdigest() == first["digest"]  # the tag names the index
    assert doc["mediaType"] == L.MEDIA_OCI_INDEX and doc["annotations"][X.ANN_TYPE] == L.ARTIFACT_TYPE
    assert doc["artifactType"] == L.ARTIFACT_TYPE and "subject" not in doc
    assert doc["annotations"]["org.vramd.image.pid"] == "4242" and L.ANN_PARENT not in doc["annotations"]
    assert len(parts) >= 3 and all(len(b) <= int(BUDGET) for b in bodies), [len(b) for b in bodies]
    assert len(raw) <= int(BUDGET)
    mbytes = (img / "manifest.vrdm").read_bytes()
    assert parts[0]["config"]["digest"] == L.sha256_digest(mbytes)
    assert parts[0]["layers"][0]["mediaType"] == L.MEDIA_SKELETON
    assert all(p["artifactType"] == X.ARTIFACT_PART for p in parts)
    assert all(p["config"] == X.EMPTY.to_json() and p["layers"] for p in parts[1:])
    # every distinct payload once, in the parts' order: the skeleton's payload table
    layers = parts[0]["layers"][1:] + [d for p in parts[1:] for d in p["layers"]]
    reg = Registry(registry.host, trust=Trust(plain_http=True))
    try:
        sk_desc = parts[0]["layers"][0]
        sk = L.decode_skeleton(reg.get_blob("jobs/big", sk_desc["digest"], sk_desc["size"]))
    finally:
        reg.close()
    assert [(d["digest"], d["size"]) for d in layers] == list(sk.blobs)
    assert len(sk.blobs) >= 28

    # a second push: every blob there, nothing uploaded, the same index
    writes = len(blob_writes(registry))
    again = ok(vramctl("push", str(img), ref, "--plain-http", "--json", "--max-manifest-bytes", BUDGET,
                       "--annotation", "org.vramd.image.pid=4242"))
    assert again["digest"] == first["digest"]
    assert again["stats"]["bytes_uploaded"] == 0 and again["stats"]["blobs_uploaded"] == 0
    assert len(blob_writes(registry)) == writes

    pulled = tmp_path / "pulled"
    got = ok(vramctl("pull", ref, str(pulled), "--plain-http", "--json"))
    assert got["digest"] == first["digest"]
    assert files_of(pulled) == files_of(img)
    assert vramctl("verify", str(pulled)).returncode == 0
    assert decode_manifest((pulled / "manifest.vrdm").read_bytes()).image_id.hex() == \
        doc["annotations"][L.ANN_IMAGE_ID]


def test_restore_from_an_index_reference_and_an_incremental_child_over_it(node, registry, tmp_path, run_dir):
    bos = big_bos()
    parent, child = tmp_path / "ckpt" / "step1", tmp_path / "ckpt" / "step2"
    node.dump(parent, bos, "--compress", "none")
    base = f"{registry.host}/jobs/inc"
    pushed = ok(vramctl("push", str(parent), f"{base}:step1", "--plain-http", "--json", "--max-manifest-bytes",
                        BUDGET))
    changed = bytearray(bos[2])
    changed[(5 << 20) + 7] ^= 0xFF  # one chunk of the big BO changed
    bos2 = [bos[0], bos[1], bytes(changed)]
    info = node.dump(child, bos2, "--parent", str(parent), "--compress", "none")
    r = ok(vramctl("push", str(child), f"{base}:step2", "--plain-http", "--json", "--max-manifest-bytes", BUDGET))
    assert [c["digest"] for c in r["chain"]] == [pushed["digest"], r["digest"]]
    st = r["stats"]  # the parent's blobs all there: the child's config, skeleton and changed chunk only
    assert st["blobs_uploaded"] == 3 and st["bytes_uploaded"] <= info["image"]["stored_bytes"] + (64 << 10), st

    # the child (one manifest: its one payload layer fits) names the indexed parent as its subject
    reg = Registry(registry.host, trust=Trust(plain_http=True))
    try:
        cdoc = json.loads(reg.get_manifest("jobs/inc", "step2", 1 << 20)[0])
    finally:
        reg.close()
    assert cdoc["mediaType"] == L.MEDIA_OCI_MANIFEST
    assert cdoc["subject"]["mediaType"] == L.MEDIA_OCI_INDEX and cdoc["subject"]["digest"] == pushed["digest"]

    dest = tmp_path / "elsewhere" / "step2"
    dest.parent.mkdir()
    got = ok(vramctl("pull", f"{base}:step2", str(dest), "--plain-http", "--json"))
    assert [c["dir"] for c in got["chain"]] == [str(dest), str(dest.parent / "step1")]
    assert files_of(dest) == files_of(child) and files_of(dest.parent / "step1") == files_of(parent)

    # a grandchild that changed 16 chunks: an index itself, over the one-manifest child, over the indexed parent
    grand = tmp_path / "ckpt" / "step3"
    changed3 = bytearray(bos2[2])
    changed3[:16 << 20] = os.urandom(16 << 20)  # whole chunks rewritten: 16 distinct payloads, no shared delta
    bos3 = [bos2[0], bos2[1], bytes(changed3)]
    node.dump(grand, bos3, "--parent", str(child), "--compress", "none")
    r3 = ok(vramctl("push", str(grand), f"{base}:step3", "--plain-http", "--json", "--max-manifest-bytes", BUDGET))
    assert [c["media_type"] for c in r3["chain"]] == [L.MEDIA_OCI_INDEX, L.MEDIA_OCI_MANIFEST, L.MEDIA_OCI_INDEX]
    gdoc, _parts, _bodies = read_index(registry, "jobs/inc", "step3")
    assert gdoc["annotations"][L.ANN_PARENT] == r["digest"]
    assert gdoc["subject"] == {"mediaType": L.MEDIA_OCI_MANIFEST, "digest": r["digest"], "size": len(json.dumps(
        cdoc, separators=(",", ":")))}  # OCI 1.1's link too: the referrers API lists the grandchild

    with Node(run_dir, tmp_path / "node2") as other:
        out = other.restore(f"oci://{base}:step1", [len(b) for b in bos], "--plain-http", "--cache",
                            str(tmp_path / "c1"))
        assert out == bos
        out = other.restore(f"oci://{base}:step2", [len(b) for b in bos2], "--plain-http", "--no-cache")
        assert out == bos2
        out = other.restore(f"oci://{base}:step3", [len(b) for b in bos3], "--plain-http", "--cache",
                            str(tmp_path / "c3"))
        assert out == bos3


def test_skopeo_copies_the_index_and_its_parts_unchanged_and_vramd_restores_the_copy(node, registry, tmp_path,
                                                                                     run_dir):
    """skopeo 1.9.3 `copy --all` keeps an index (its artifactType and subject too) and its parts byte for byte,
    through an oci: layout and registry to registry: the copy keeps its digest, so a child copied beside it (one
    manifest naming the index by subject) still finds it as its parent, and so does an indexed grandchild."""
    bos = big_bos()
    img, child, grand = tmp_path / "base", tmp_path / "child", tmp_path / "grand"
    node.dump(img, bos, "--compress", "none")
    bos2 = [bos[0], bytes(len(bos[1])), bos[2]]  # the second BO zeroed: the child is one small manifest
    node.dump(child, bos2, "--parent", str(img), "--compress", "none")
    bos3 = [bos2[0], bos2[1], os.urandom(len(bos2[2]))]  # the big BO rewritten: the grandchild is an index
    node.dump(grand, bos3, "--parent", str(child), "--compress", "none")
    src = f"{registry.host}/jobs/orig"
    digest = ok(vramctl("push", str(img), f"{src}:1", "--plain-http", "--json", "--max-manifest-bytes",
                        BUDGET))["digest"]
    ok(vramctl("push", str(child), f"{src}:2", "--plain-http", "--json", "--max-manifest-bytes", BUDGET))
    r3 = ok(vramctl("push", str(grand), f"{src}:3", "--plain-http", "--json", "--max-manifest-bytes", BUDGET))
    assert [c["media_type"] for c in r3["chain"]] == [L.MEDIA_OCI_INDEX, L.MEDIA_OCI_MANIFEST, L.MEDIA_OCI_INDEX]
    raw = subprocess.run(["skopeo", "inspect", "--raw", "--tls-verify=false", f"docker://{src}:1"],
                         capture_output=True, check=True).stdout
    assert "sha256:" + hashlib.sha256(raw).hexdigest() == digest
    layout = tmp_path / "layout"
    subprocess.run(["skopeo", "copy", "--all", "--src-tls-verify=false", f"docker://{src}@{digest}",
                    f"oci:{layout}:one"], capture_output=True, check=True)
    dst = f"{registry.host}/copies/other"
    subprocess.run(["skopeo", "copy", "--all", "--dest-tls-verify=false", f"oci:{layout}:one", f"docker://{dst}:1"],
                   capture_output=True, check=True)
    subprocess.run(["skopeo", "copy", "--all", "--src-tls-verify=false", "--dest-tls-verify=false",
                    f"docker://{src}:2", f"docker://{dst}:2"], capture_output=True, check=True)
    subprocess.run(["skopeo", "copy", "--all", "--src-tls-verify=false", "--dest-tls-verify=false",
                    f"docker://{src}:3", f"docker://{dst}:3"], capture_output=True, check=True)
    raw2 = subprocess.run(["skopeo", "inspect", "--raw", "--tls-verify=false", f"docker://{dst}:1"],
                          capture_output=True, check=True).stdout
    assert raw2 == raw and json.loads(raw)["artifactType"] == L.ARTIFACT_TYPE
    raw3 = subprocess.run(["skopeo", "inspect", "--raw", "--tls-verify=false", f"docker://{dst}:3"],
                          capture_output=True, check=True).stdout
    assert L.sha256_digest(raw3) == r3["digest"]
    assert json.loads(raw3)["artifactType"] == L.ARTIFACT_TYPE
    assert json.loads(raw3)["subject"]["digest"] == r3["chain"][1]["digest"]
    _doc, parts, bodies = read_index(registry, "copies/other", "1")
    assert len(parts) >= 3
    assert [L.sha256_digest(b) for b in bodies] == [m["digest"] for m in json.loads(raw)["manifests"]]
    with Node(run_dir, tmp_path / "node2") as other:
        out = other.restore(f"oci://{dst}:1", [len(b) for b in bos], "--plain-http", "--cache", str(tmp_path / "c"))
        assert out == bos
        out = other.restore(f"oci://{dst}:2", [len(b) for b in bos2], "--plain-http", "--cache", str(tmp_path / "d"))
        assert out == bos2
        out = other.restore(f"oci://{dst}:3", [len(b) for b in bos3], "--plain-http", "--cache", str(tmp_path / "e"))
        assert out == bos3


def test_a_copy_without_all_holds_the_first_part_alone_and_is_refused_by_name(node, registry, tmp_path, run_dir):
    """skopeo 1.9 `copy` without --all picks an index's first entry without a platform and copies it alone (exit
    0): part 0, an image manifest with the config, the skeleton and the first payloads.  vramctl pull and restore
    of that copy refuse it, saying it is a part and to copy with --all; nothing is written."""
    bos = big_bos()
    img = tmp_path / "image"
    node.dump(img, bos, "--compress", "none")
    src, dst = f"{registry.host}/jobs/orig:1", f"{registry.host}/copies/part:1"
    ok(vramctl("push", str(img), src, "--plain-http", "--json", "--max-manifest-bytes", BUDGET))
    subprocess.run(["skopeo", "copy", "--src-tls-verify=false", "--dest-tls-verify=false", f"docker://{src}",
                    f"docker://{dst}"], capture_output=True, check=True)
    _doc, parts, _bodies = read_index(registry, "jobs/orig", "1")
    raw = subprocess.run(["skopeo", "inspect", "--raw", "--tls-verify=false", f"docker://{dst}"],
                         capture_output=True, check=True).stdout
    assert json.loads(raw) == parts[0]  # what the copy holds: the first part
    r = vramctl("pull", dst, str(tmp_path / "dest"), "--plain-http", "--json")
    assert r.returncode == 1 and json.loads(r.stdout)["error"]["code"] == "CORRUPT_MANIFEST", r.stdout
    assert "a part of a vramd image pushed as an OCI image index" in r.stderr and "skopeo copy --all" in r.stderr
    assert not (tmp_path / "dest").exists()
    with Node(run_dir, tmp_path / "node2") as other:
        f = other.dir / "out1.bin"
        f.write_bytes(b"\x5a" * len(bos[0]))
        r = vramctl("restore", "--pid", str(os.getpid()), "--image", f"oci://{dst}", "--bo-file", f"1={f}",
                    "--plain-http", "--json", "--cache", str(tmp_path / "c"), socket=other.daemon.socket)
        assert r.returncode == 1 and "skopeo copy --all" in r.stderr, r.stderr
        assert f.read_bytes() == b"\x5a" * len(bos[0])


class IndexRefusingProxy:
    """In front of a registry, forwarding every request as it is (the Host header kept, so the registry's upload
    Locations name the proxy), but answering the PUT of an OCI image index 503: a registry that failed just as
    the push's last request, its commit, went out."""

    def __init__(self, upstream: str) -> None:
        pool = urllib3.PoolManager(maxsize=8, retries=False)
        self.refused: list[str] = []
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def _any(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                if self.command == "PUT" and self.headers.get("Content-Type") == L.MEDIA_OCI_INDEX:
                    proxy.refused.append(self.path)
                    answer = b'{"errors":[{"code":"UNAVAILABLE","message":"service unavailable"}]}'
                    self.send_response(503)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(answer)))
                    self.end_headers()
                    self.wfile.write(answer)
                    return
                r = pool.request(self.command, upstream + self.path, body=body or None, redirect=False,
                                 headers={k: v for k, v in self.headers.items() if k.lower() != "content-length"})
                self.send_response(r.status)
                for k, v in r.headers.items():
                    if k.lower() not in ("content-length", "transfer-encoding", "connection"):
                        self.send_header(k, v)
                self.send_header("Content-Length", str(len(r.data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(r.data)

            do_GET = do_HEAD = do_PUT = do_POST = do_PATCH = do_DELETE = _any

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.host = f"127.0.0.1:{self.server.server_port}"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_a_push_cut_before_its_index_tags_nothing_and_a_second_push_completes_it(node, registry, tmp_path):
    """The index is the push's commit: a registry that fails its PUT leaves every blob and part there but no tag
    (a pull of the tag finds nothing); pushing again sends no blob byte nor part (each found by a HEAD) and tags
    the index."""
    bos = big_bos()
    img = tmp_path / "image"
    node.dump(img, bos, "--compress", "none")
    proxy = IndexRefusingProxy(registry.url)
    try:
        r = vramctl("push", str(img), f"{proxy.host}/jobs/cut:1", "--plain-http", "--json", "--max-manifest-bytes",
                    BUDGET)
    finally:
        proxy.close()
    assert r.returncode == 1 and json.loads(r.stdout)["error"]["code"] == "REGISTRY_ERROR", r.stdout
    assert proxy.refused == ["/v2/jobs/cut/manifests/1"]
    puts = [e for e in registry.access_log() if e.method == "PUT" and "/manifests/" in e.path]
    assert len(puts) >= 3 and all(e.status == 201 and "/manifests/sha256:" in e.path for e in puts)  # the parts
    gets = len(registry.access_log())
    r = vramctl("pull", f"{registry.host}/jobs/cut:1", str(tmp_path / "dest"), "--plain-http", "--json")
    assert r.returncode == 1 and not (tmp_path / "dest").exists()
    assert [(e.path, e.status) for e in registry.access_log()[gets:] if "/manifests/" in e.path] == \
        [("/v2/jobs/cut/manifests/1", 404)]  # the tag names nothing
    before = len(registry.access_log())
    again = ok(vramctl("push", str(img), f"{registry.host}/jobs/cut:1", "--plain-http", "--json",
                       "--max-manifest-bytes", BUDGET))
    assert again["stats"]["bytes_uploaded"] == 0 and again["chain"][0]["media_type"] == L.MEDIA_OCI_INDEX
    # the parts are there (HEAD by digest): not sent again, nor checked again by the registry; the index only
    sent = [(e.path, e.status) for e in registry.access_log()[before:] if e.method == "PUT"]
    assert sent == [("/v2/jobs/cut/manifests/1", 201)], sent
    got = ok(vramctl("pull", f"{registry.host}/jobs/cut:1", str(tmp_path / "dest"), "--plain-http", "--json"))
    assert got["digest"] == again["digest"] and files_of(tmp_path / "dest") == files_of(img)
