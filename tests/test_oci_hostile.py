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
    """vramctl pull REF DEST --plain-http --json, and the pull's own peak memory in KiB: VmHWM of its process,
    read as it exits (a child's ru_maxrss would start from the parent's peak, since exec keeps the larger of
    the old and the new address space's high-water marks)."""
    import subprocess
    import sys

    from helpers import ROOT
    peak = tmp_path / "peak"
    wrapper = ("import atexit, runpy, sys\n"
               "def peak():\n"
               "    hwm = [l for l in open('/proc/self/status') if l.startswith('VmHWM:')][0].split()[1]\n"
               f"    open({str(peak)!r}, 'w').write(hwm)\n"
               "atexit.register(peak)\n"
               "sys.argv = ['vramctl'] + sys.argv[1:]\n"
               "runpy.run_module('vramd.cli', run_name='__main__')\n")
    r = subprocess.run([sys.executable, "-c", wrapper, "pull", ref, str(dest), "--plain-http", "--json"], cwd=ROOT,
                       capture_output=True, text=True)
    return r, int(peak.read_text())


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


def test_a_token_realm_answering_without_end_is_refused_within_a_bound(tmp_path):
    """A registry names a token realm (any host: untrusted) that answers 1 GiB: refused once 1 MiB is in, the
    rest never read, so vramctl's peak memory stays far below what the realm sent (a child's ru_maxrss starts
    at its parent's size at fork: this test process may be a few hundred MiB by now)."""
    import http.server
    import subprocess
    import sys
    import threading

    from helpers import ROOT

    class Hostile(http.server.BaseHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            pass

        def do_GET(self) -> None:
            if self.path.startswith("/token"):
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Connection", "close")
                self.end_headers()
                try:
                    for _ in range(1024):
                        self.wfile.write(b" " * (1 << 20))
                except OSError:
                    pass  # the client stopped reading: as it should
                return
            host = self.headers["Host"]
            self.send_response(401)
            self.send_header("WWW-Authenticate", f'Bearer realm="http://{host}/token",service="s"')
            self.send_header("Content-Length", "0")
            self.end_headers()

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Hostile)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        out, err = tmp_path / "out", tmp_path / "err"
        with open(out, "w") as o, open(err, "w") as e:  # the child's own peak (wait4)
            p = subprocess.Popen([sys.executable, "-m", "vramd.cli", "pull", f"127.0.0.1:{server.server_port}/jobs/x:1",
                                  str(tmp_path / "dest"), "--plain-http", "--json"], cwd=ROOT, stdout=o, stderr=e)
            _pid, status, usage = os.wait4(p.pid, 0)
            p.returncode = os.waitstatus_to_exitcode(status)
    finally:
        server.shutdown()
        server.server_close()
    assert p.returncode == 1, err.read_text()
    assert json.loads(out.read_text())["error"]["code"] == "REGISTRY_ERROR", err.read_text()
    assert usage.ru_maxrss < 600 << 10, usage.ru_maxrss  # KiB: far below the 1 GiB sent
    assert not (tmp_path / "dest").exists()


def test_a_401_answered_without_end_is_not_read_to_its_end(tmp_path):
    """A registry whose 401 to the manifest's GET carries a body without end: vramctl reads a bounded part of
    it, drops the connection and answers the challenge (no credentials: one line), rather than reading on."""
    import http.server
    import subprocess
    import sys
    import threading

    from helpers import ROOT
    stop = threading.Event()

    class Endless(http.server.BaseHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            pass

        def do_GET(self) -> None:
            self.send_response(401)
            self.send_header("WWW-Authenticate", 'Basic realm="r"')
            self.send_header("Connection", "close")
            self.end_headers()
            try:
                while not stop.is_set():
                    self.wfile.write(b" " * (1 << 16))
            except OSError:
                pass  # the client hung up: as it should

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Endless)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        r = subprocess.run([sys.executable, "-m", "vramd.cli", "pull", f"127.0.0.1:{server.server_port}/jobs/x:1",
                            str(tmp_path / "dest"), "--plain-http", "--json"], cwd=ROOT, capture_output=True,
                           text=True, timeout=60, env={**os.environ, "HOME": str(tmp_path)})
    finally:
        stop.set()
        server.shutdown()
        server.server_close()
    assert r.returncode == 1 and r.stderr.count("\n") == 1, r.stderr
    assert json.loads(r.stdout)["error"]["code"] == "AUTH_FAILED" and "no credentials" in r.stderr, r.stderr
    assert not (tmp_path / "dest").exists()


# --- where our credentials go: a tiny real HTTP server plays what distribution cannot be made to send ---------

class Seen:
    """A plain-HTTP server on 127.0.0.1 answering with `answer(handler)`, and what it was sent."""

    def __init__(self, answer) -> None:
        import http.server
        import threading
        seen = self.requests = []

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def _any(self) -> None:
                seen.append((self.command, self.path, self.headers.get("Authorization")))
                status, headers, body = answer(self)
                self.send_response(status)
                for k, v in {"Content-Length": str(len(body)), **headers}.items():
                    self.send_header(k, v)
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(body)

            do_GET = do_HEAD = do_POST = do_PUT = do_PATCH = do_DELETE = _any

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.host = f"127.0.0.1:{self.server.server_port}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def basic_registry(then):
    """A registry that wants HTTP Basic: 401 until a request carries credentials, then `then(handler)`."""
    def answer(h):
        if h.headers.get("Authorization") is None:
            return 401, {"WWW-Authenticate": 'Basic realm="r"'}, b""
        return then(h)
    return answer


def alice(secret: str):
    from vramd.oci.credentials import Credentials
    return Credentials("the test", "alice", secret)


def test_a_mount_answered_with_an_upload_on_another_host_sends_it_no_credentials(tmp_path):
    """A registry answers a cross-repository mount with 202 and an upload Location on another host: the upload
    a mount opened was cancelled there (DELETE) with the registry's credentials.  Refused now, nothing sent."""
    from vramd.errors import RegistryError
    other = Seen(lambda h: (204, {}, b""))
    reg_srv = Seen(basic_registry(lambda h: (202, {"Location": f"http://{other.host}/v2/x/blobs/uploads/u1"}, b"")))
    secret = "pw-" + os.urandom(8).hex()
    reg = Registry(reg_srv.host, trust=Trust(plain_http=True), credentials=alice(secret), actions=("pull", "push"))
    try:
        with pytest.raises(RegistryError, match="upload location on another host"):
            reg.mount_blob("x", D1, "y")
    finally:
        reg.close()
        other.close()
        reg_srv.close()
    assert reg_srv.requests[-1][2] is not None  # the registry had the credentials
    assert other.requests == []  # the other host had nothing


def test_a_redirect_carries_credentials_only_back_to_the_registry_itself(tmp_path):
    """A blob GET redirected to another host (an object store's presigned URL, as distribution on S3 answers):
    fetched without the registry's Authorization.  Redirected to another path of the registry itself (same
    scheme, host and port): with it, as Go's client keeps it (the registry wants it there too)."""
    data = os.urandom(1000)
    digest = L.sha256_digest(data)
    store = Seen(lambda h: (200, {}, data))

    def registry_answer(h):
        if h.path.startswith("/v2/x/blobs/"):
            return 307, {"Location": f"http://{store.host}/bucket/blob?X-Amz-Signature=abc"}, b""
        if h.path.startswith("/v2/y/blobs/"):
            return 302, {"Location": "/elsewhere/blob"}, b""
        return 200, {}, data  # /elsewhere/blob: only with credentials (basic_registry)
    reg_srv = Seen(basic_registry(registry_answer))
    secret = "pw-" + os.urandom(8).hex()
    reg = Registry(reg_srv.host, trust=Trust(plain_http=True), credentials=alice(secret))
    try:
        assert reg.get_blob("x", digest, len(data)) == data
        assert store.requests == [("GET", "/bucket/blob?X-Amz-Signature=abc", None)]
        assert reg.get_blob("y", digest, len(data)) == data
    finally:
        reg.close()
        store.close()
        reg_srv.close()
    assert reg_srv.requests[-1][:2] == ("GET", "/elsewhere/blob") and reg_srv.requests[-1][2] is not None


class Trickle:
    """A TCP server on 127.0.0.1 that answers its k-th connection with `answer(port, k)`: a head sent at once,
    then a tail one byte every 0.2 s (well inside any read timeout), for up to 30 s: a registry, a token realm
    or a network that never quite stops."""

    def __init__(self, answer) -> None:
        import itertools
        import socketserver
        import threading
        stop = self.stop = threading.Event()
        count = itertools.count(1)

        class Handler(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                self.request.recv(65536)  # the request (its head is all a GET has)
                head, tail = answer(self.server.server_address[1], next(count))
                try:
                    self.request.sendall(head)
                    for b in tail[:150]:
                        if stop.wait(0.2):
                            return
                        self.request.sendall(bytes([b]))
                except OSError:
                    pass  # the client hung up: as it should

        class Server(socketserver.ThreadingTCPServer):
            daemon_threads = True

        self.server = Server(("127.0.0.1", 0), Handler)
        self.host = f"127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.stop.set()
        self.server.shutdown()
        self.server.server_close()


def _trickled(case: str, port: int, k: int) -> tuple[bytes, bytes]:
    if case == "headers":
        return b"HTTP/1.1 200 OK\r\n", b"X-Slow: " + b"a" * 200
    if case == "manifest body":
        return b"HTTP/1.1 200 OK\r\nContent-Length: 900\r\n\r\n", b"{" * 900
    if k == 1:  # "token answer": the registry wants a token from a realm (this same server) ...
        return (b"HTTP/1.1 401 Unauthorized\r\nContent-Length: 0\r\nWWW-Authenticate: Bearer realm=\"http://"
                b"127.0.0.1:%d/token\",service=\"s\"\r\n\r\n" % port, b"")
    return b"HTTP/1.1 200 OK\r\nContent-Length: 200\r\n\r\n", b'{"token": "' + b"t" * 188  # ... that trickles


@pytest.mark.parametrize("case", ["headers", "manifest body", "token answer"])
def test_a_request_answered_a_byte_at_a_time_is_cut_off_at_its_deadline(case):
    """Each byte arrives within the read timeout, so urllib3's timeouts never fire: a registry (or a token realm)
    trickling its answer's headers, a manifest, or a token held a pull for as long as it liked.  Now the whole
    request has a deadline (the read timeout, 2 s here, plus its bytes' time at 256 KiB/s): one REGISTRY_ERROR."""
    import time

    from vramd.errors import RegistryError
    srv = Trickle(lambda port, k: _trickled(case, port, k))
    reg = Registry(srv.host, trust=Trust(plain_http=True), timeout=2.0)
    t0 = time.monotonic()
    try:
        with pytest.raises(RegistryError, match="no complete answer within") as ei:
            reg.get_manifest("x", "1", 1000)
    finally:
        reg.close()
        srv.close()
    assert time.monotonic() - t0 < 15, ei.value
    assert type(ei.value) is RegistryError and ei.value.code == "REGISTRY_ERROR"


@pytest.mark.parametrize("encoding", ["identity", "gzip"])
def test_an_oci_manifest_of_millions_of_empty_objects_is_refused_before_it_is_parsed(tmp_path, encoding):
    """48 MiB of `{}` (within the 64 MiB bound) parse into 16 M dicts, over 1 GiB; gzip makes that 50 KB on the
    wire, and urllib3 inflates a gzip answer unasked.  Now an answer is held as sent (never inflated: a gzip body
    is no JSON) and a manifest with more objects and arrays than one per 64 bytes is refused before json.loads."""
    import gzip
    body = b'{"layers":[' + b"{}," * (16 << 20) + b"{}]}"
    wire = gzip.compress(body, 6) if encoding == "gzip" else body
    headers = {"Content-Type": L.MEDIA_OCI_MANIFEST, **({"Content-Encoding": "gzip"} if encoding == "gzip" else {})}
    srv = Seen(lambda h: (200, headers, wire))
    try:
        r, peak = pull_peak(f"{srv.host}/x:1", tmp_path / "dest", tmp_path)
    finally:
        srv.close()
    assert peak < 400 << 10, peak  # KiB
    assert r.returncode == 1 and json.loads(r.stdout)["error"]["code"] == "CORRUPT_MANIFEST", r.stderr
    assert ("more objects and arrays" if encoding == "identity" else "not JSON") in r.stderr, r.stderr
    assert not (tmp_path / "dest").exists()


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


@pytest.mark.parametrize("expires_in, used_for", [(b"Infinity", 86400), (b"1e300", 86400), (b"NaN", 60)])
def test_a_token_life_the_realm_states_beyond_reason_is_bounded(expires_in, used_for):
    """json takes Infinity and NaN: a token kept for ever (so an expired one is never asked for again, and a 401
    then reads as refused credentials), or one never used (every request a 401 and a token request)."""
    from test_registry_auth_units import BEARER, HOST, SCOPE, Clock

    from vramd.oci.auth import Authenticator
    clock = Clock()
    auth = Authenticator(HOST, alice("pw"), Trust(), clock)
    req = auth.challenge(BEARER, SCOPE)
    auth.token_response(req, 200, b'{"token": "T", "expires_in": ' + expires_in + b"}")
    assert auth.headers(SCOPE) == {"Authorization": "Bearer T"}
    clock.now += used_for - 10  # dropped 10 s before the life taken
    assert auth.headers(SCOPE) == {}
