"""vramctl restore --image oci://... streamed (vramd.oci.stream): the daemon restores while the blobs download.

Against the real registry and a real daemon: byte-exact through TLS + auth, the cache entry committed; the
session restores BO bytes while a later blob is still held back (a proxy in front of the registry holds it
until the daemon reports restored bytes: without streaming that never happens); a registry stopped mid-restore
and a blob damaged in the registry's storage (typed errors, nothing reported restored, no staging directory,
no cache entry); a daemon that fails stops the downloads at once; a warm cache entry downloads no blob and a
damaged one is refused by the daemon naming the BO; --no-cache leaves nothing; a registry that trickles holds
no blob read past its deadline; a pull of large payloads holds a piece of each, not the blob.  The two tests
that hold a blob back both fail ("no byte restored while a blob is held") when the download is let finish
before the session starts.
"""
from __future__ import annotations

import hashlib
import http.server
import json
import os
import ssl
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest
import urllib3
from helpers import ROOT, vramctl, vramctl_peak
from oci_helpers import Node, ok, user_cache, vramctl_stdin  # noqa: F401 (user_cache: autouse)

from vramd.client import Client
from vramd.errors import RegistryError
from vramd.oci.registry import Registry
from vramd.oci.tls import Trust
from vramd.pb import rpc_pb2 as rpc

MANIFEST_MEDIA = "application/vnd.oci.image.manifest.v1+json"
MiB = 1 << 20


@pytest.fixture
def node(run_dir, tmp_path):
    with Node(run_dir, tmp_path / "node1") as n:
        yield n


class HoldingProxy:
    """In front of a registry, forwarding every request (and its credentials, and the registry's challenges);
    the GET of blob `hold` waits for `release` (with `head_first`, after its answer's head and first MiB went
    out), then goes on, unless the registry is gone by then: its client's connection is dropped, as a stopped
    registry's would be.  Plain HTTP, or with `pki` TLS (a certificate of that CA, which the registry's is too)."""

    def __init__(self, upstream: str, hold: str, *, head_first: bool = False, pki=None) -> None:
        self.hold, self.head_first = hold, head_first
        self.held, self.release = threading.Event(), threading.Event()
        pool = urllib3.PoolManager(maxsize=8, retries=False, ca_certs=str(pki.ca_cert) if pki else None)
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def do_HEAD(self) -> None:
                self.do_GET()

            def do_GET(self) -> None:
                held = self.command == "GET" and self.path.endswith("/blobs/" + proxy.hold)
                if held and not proxy.head_first:
                    proxy.held.set()
                    proxy.release.wait(120)
                try:
                    r = pool.request(self.command, upstream + self.path, preload_content=False, redirect=False,
                                     headers={k: v for k, v in self.headers.items()
                                              if k.lower() in ("accept", "authorization")})
                except urllib3.exceptions.HTTPError:
                    self.close_connection = True  # the registry is gone: no answer at all
                    return
                self.send_response(r.status)
                for k, v in r.headers.items():
                    if k.lower() in ("content-type", "content-length", "docker-content-digest", "location",
                                     "www-authenticate"):
                        self.send_header(k, v)
                self.end_headers()
                try:
                    first = True
                    while piece := r.read(MiB):
                        self.wfile.write(piece)
                        if held and first and proxy.head_first:
                            self.wfile.flush()
                            proxy.held.set()
                            proxy.release.wait(120)
                        first = False
                except OSError:
                    self.close_connection = True
                finally:
                    r.release_conn()

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        if pki is not None:
            issued = pki.issue("holding-proxy", ips=("127.0.0.1",))
            ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
            ctx.load_cert_chain(str(issued.cert), str(issued.key))
            self.server.socket = ctx.wrap_socket(self.server.socket, server_side=True)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.host = f"127.0.0.1:{self.server.server_port}"

    def close(self) -> None:
        self.release.set()
        self.server.shutdown()
        self.server.server_close()


def _layers(registry, repo: str, tag: str) -> list[dict]:
    """The pushed artifact's layers: the skeleton, then the payload blobs."""
    req = urllib.request.Request(f"{registry.url}/v2/{repo}/manifests/{tag}", headers={"Accept": MANIFEST_MEDIA})
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.loads(r.read())["layers"]


def _blob(payload: bytes) -> str:
    """The digest of the layer holding a chunk stored as it is (--compress none)."""
    return "sha256:" + hashlib.sha256(payload).hexdigest()


def _pushed(node, registry, tmp_path, name: str, size: int = 8 * MiB) -> tuple[list[bytes], str]:
    bos = [os.urandom(size)]  # one payload blob per MiB (the test daemon's chunk size)
    img = tmp_path / "ckpt" / name
    node.dump(img, bos, "--compress", "none")
    ref = f"{registry.host}/jobs/{name}:1"
    ok(vramctl("push", str(img), ref, "--plain-http", "--json"))
    return bos, ref


def _targets(node, bos) -> list[str]:
    args = []
    for i, b in enumerate(bos, 1):
        t = node.dir / f"out{i}.bin"
        t.write_bytes(bytes(len(b)))
        args += ["--bo-file", f"{i}={t}"]
    return args


def _restore(node, bos, ref: str, *more: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "vramd.cli", "--socket", node.daemon.socket, "restore", "--pid",
                             str(os.getpid()), "--image", f"oci://{ref}", *_targets(node, bos), "--plain-http",
                             "--json", *more], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _entries(cache: Path) -> list[Path]:
    """The cache's image entries and staging directories (not its kept skeletons)."""
    return sorted(p for p in cache.rglob("image*") if p.is_dir())


def test_a_streamed_restore_from_a_tls_auth_registry_is_byte_exact_and_committed(node, htpasswd_registry,
                                                                                   registry_pki, tmp_path):
    """Through TLS and htpasswd auth (vramctl to a proxy holding the registry's last blob, the proxy to the
    registry): the session restores bytes while that blob is held, then the image is byte-exact and committed."""
    from registry_fixtures import REGISTRY_USERS
    reg = htpasswd_registry
    bos = [os.urandom(5 * MiB + 4096), bytes(2 * MiB) + os.urandom(MiB)]
    img = tmp_path / "image"
    node.dump(img, bos, "--compress", "none")
    ref = f"{reg.host}/secure/stream:1"
    auth = ["--ca-file", str(reg.ca_file), "--username", "alice", "--password-stdin"]
    pw = REGISTRY_USERS["alice"] + "\n"
    assert vramctl_stdin(["push", str(img), ref, *auth, "--json"], pw).returncode == 0
    cache = tmp_path / "cache"
    proxy = HoldingProxy(reg.url, _blob(bos[1][2 * MiB:]), pki=registry_pki)  # BO 2's last chunk's payload
    secret = tmp_path / "password"
    secret.write_text(pw)
    try:
        with open(secret) as stdin:
            p = subprocess.Popen([sys.executable, "-m", "vramd.cli", "--socket", node.daemon.socket, "restore",
                                  "--pid", str(os.getpid()), "--image", f"oci://{ref.replace(reg.host, proxy.host)}",
                                  *_targets(node, bos), "--cache", str(cache), *auth, "--json"], cwd=ROOT,
                                 stdin=stdin, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert proxy.held.wait(60), "the blob was never asked for"
        _restored_while_held(node, p, MiB)
        proxy.release.set()
        out, err = p.communicate(timeout=120)
    finally:
        proxy.close()
    assert p.returncode == 0, err
    assert [(node.dir / f"out{i}.bin").read_bytes() for i in (1, 2)] == bos
    [entry] = _entries(cache)
    assert entry.name == "image" and json.loads(out)["image_dir"] == str(entry)
    assert {p.name: p.read_bytes() for p in entry.iterdir()} == {p.name: p.read_bytes() for p in img.iterdir()
                                                                 if p.name == "manifest.vrdm" or p.suffix == ".vrd"}


def _restored_while_held(node, p: subprocess.Popen[str], at_least: int) -> None:
    """Return once the daemon's restore session has restored `at_least` bytes. Each look is a round trip to the
    daemon; the caller holds a blob back until then, which a restore that waits for its download to end never
    reaches (this then fails at the deadline)."""
    deadline, done = time.monotonic() + 60, 0
    with Client(node.daemon.socket) as c:
        while done < at_least:
            assert time.monotonic() < deadline and p.poll() is None, "no byte restored while a blob is held"
            infos = [s for s in c.sessions() if s.kind == rpc.SESSION_RESTORE]
            done = max((s.progress.bytes_done for s in infos), default=0)


def test_the_session_restores_while_a_later_blob_is_still_downloading(node, registry, tmp_path):
    bos, ref = _pushed(node, registry, tmp_path, "overlap")
    last = _blob(bos[0][7 * MiB:])  # BO 1's last chunk's payload
    assert last in {layer["digest"] for layer in _layers(registry, "jobs/overlap", "1")}
    proxy = HoldingProxy(registry.url, last)
    try:
        p = _restore(node, bos, ref.replace(registry.host, proxy.host), "--cache", str(tmp_path / "cache"))
        assert proxy.held.wait(60), "the last blob was never asked for"
        _restored_while_held(node, p, MiB)
        proxy.release.set()
        out, err = p.communicate(timeout=120)
    finally:
        proxy.close()
    assert p.returncode == 0, err
    assert json.loads(out)["ok"] and (node.dir / "out1.bin").read_bytes() == bos[0]
    assert [e.name for e in _entries(tmp_path / "cache")] == ["image"]


def test_a_registry_stopped_mid_restore_is_its_typed_error_and_leaves_nothing(node, registry, tmp_path):
    bos, ref = _pushed(node, registry, tmp_path, "stopped")
    third = _blob(bos[0][2 * MiB:3 * MiB])
    proxy = HoldingProxy(registry.url, third)
    try:
        p = _restore(node, bos, ref.replace(registry.host, proxy.host), "--cache", str(tmp_path / "cache"),
                     "--concurrency", "1")
        assert proxy.held.wait(60), "the third payload was never asked for"
        registry.stop()
        proxy.release.set()
        out, err = p.communicate(timeout=120)
    finally:
        proxy.close()
    assert p.returncode == 1 and err.count("\n") == 1, err
    e = json.loads(out)["error"]
    assert e["code"] == "REGISTRY_ERROR" and third in e["message"], e
    assert "restored" not in out and "supplying" not in err
    assert _entries(tmp_path / "cache") == []
    with Client(node.daemon.socket) as c:
        assert all(s.state != rpc.SESSION_RUNNING for s in c.sessions())


def test_a_blob_damaged_in_the_registry_is_refused_naming_the_bo(node, registry, tmp_path):
    bos, ref = _pushed(node, registry, tmp_path, "damaged")
    sixth = _blob(bos[0][5 * MiB:6 * MiB])  # the payload of BO 1's chunk at 5 MiB
    data = registry.blob_data(sixth)
    raw = bytearray(data.read_bytes())
    raw[1000] ^= 0xFF
    data.write_bytes(raw)
    r = vramctl("restore", "--pid", str(os.getpid()), "--image", f"oci://{ref}", *_targets(node, bos),
                "--plain-http", "--cache", str(tmp_path / "cache"), "--json", socket=node.daemon.socket)
    assert r.returncode == 1 and r.stderr.count("\n") == 1, r.stderr
    e = json.loads(r.stdout)["error"]
    assert e["code"] == "DIGEST_MISMATCH" and e["bo_id"] == 1 and e["offset"] == 5 * MiB, e
    assert sixth in e["message"] and "restored" not in r.stdout.replace("nothing was restored", "")
    assert _entries(tmp_path / "cache") == []


@pytest.mark.parametrize("head_first", [True, False], ids=["body-stalls", "head-stalls"])
def test_a_failing_daemon_stops_the_downloads_at_once_and_its_error_is_reported(run_dir, registry, tmp_path,
                                                                                head_first):
    """The first payload's answer (8 MiB: a daemon with 8 MiB chunks) stalls after its first MiB, or before its
    head, held until the test ends; then the daemon ends the session (an operator cancels it): vramctl reports
    the daemon's error at once, without waiting for the stalled download (its read timeout is 120 s, this
    test's limit 60 s)."""
    with Node(run_dir, tmp_path / "node8", "--chunk-size", "8M") as node:
        bos, ref = _pushed(node, registry, tmp_path, "refused", size=16 * MiB)
        first = _blob(bos[0][:8 * MiB])
        assert {"digest": first, "size": 8 * MiB} in [{k: layer[k] for k in ("digest", "size")}
                                                      for layer in _layers(registry, "jobs/refused", "1")]
        proxy = HoldingProxy(registry.url, first, head_first=head_first)
        try:
            p = _restore(node, bos, ref.replace(registry.host, proxy.host), "--cache", str(tmp_path / "cache"))
            assert proxy.held.wait(60), "the first payload was never asked for"
            with Client(node.daemon.socket) as c:
                deadline, running = time.monotonic() + 60, []
                while not running:  # each look a round trip to the daemon: vramctl opens its session meanwhile
                    assert time.monotonic() < deadline and p.poll() is None, "no restore session opened"
                    running = [s for s in c.sessions() if s.kind == rpc.SESSION_RESTORE]
                c.cancel_by_id(running[0].session_id, "the test stops it")
            out, err = p.communicate(timeout=60)
            assert not proxy.release.is_set()
        finally:
            proxy.close()
    assert p.returncode == 1 and err.count("\n") == 1, err
    e = json.loads(out)["error"]
    assert e["code"] == "CANCELLED" and "the test stops it" in e["message"], e
    assert _entries(tmp_path / "cache") == []


def test_a_warm_cache_entry_downloads_no_blob(node, registry, tmp_path):
    bos, ref = _pushed(node, registry, tmp_path, "warm")
    cache = tmp_path / "cache"
    assert node.restore(f"oci://{ref}", [len(b) for b in bos], "--plain-http", "--cache", str(cache)) == bos
    before = len(registry.access_log())
    r = vramctl("restore", "--pid", str(os.getpid()), "--image", f"oci://{ref}", *_targets(node, bos),
                "--plain-http", "--cache", str(cache), "--json", socket=node.daemon.socket)
    assert r.returncode == 0, r.stderr
    assert (node.dir / "out1.bin").read_bytes() == bos[0]
    after = registry.access_log()[before:]
    assert [a for a in after if "/blobs/" in a.path] == [] and len([a for a in after if "/manifests/" in a.path]) == 1
    out = json.loads(r.stdout)
    assert out["warm"] and out["stats"]["blobs_downloaded"] == 0 == out["stats"]["bytes_downloaded"], out


def test_no_cache_leaves_nothing_behind(node, registry, tmp_path):
    bos, ref = _pushed(node, registry, tmp_path, "nocache")
    cache, tmp = tmp_path / "cache", tmp_path / "tmp"
    tmp.mkdir()
    r = subprocess.run([sys.executable, "-m", "vramd.cli", "--socket", node.daemon.socket, "restore", "--pid",
                        str(os.getpid()), "--image", f"oci://{ref}", *_targets(node, bos), "--plain-http", "--cache",
                        str(cache), "--no-cache", "--json"], cwd=ROOT, capture_output=True, text=True, timeout=120,
                       env={**os.environ, "TMPDIR": str(tmp)})
    assert r.returncode == 0, r.stderr
    assert (node.dir / "out1.bin").read_bytes() == bos[0]
    assert not cache.exists() and list(tmp.iterdir()) == []
    st = json.loads(r.stdout)["stats"]  # the config, the skeleton and 8 payloads; the OCI manifest fetched once
    assert (st["blobs_downloaded"], st["bytes_downloaded"] >= 8 * MiB, st["requests"]) == (10, True, 11), st


def test_a_trickling_registry_holds_a_blob_read_no_longer_than_its_deadline():
    """A registry that sends a byte every 20 ms (each read is quick: no read timeout fires): a 1 MiB blob's read
    with a 0.5 s base and a 1 MiB/s minimum rate ends after about 1.5 s, a REGISTRY_ERROR naming the blob."""
    stop = threading.Event()
    digest = "sha256:" + "ab" * 32

    class Trickle(http.server.BaseHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            pass

        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("Content-Length", str(MiB))
            self.end_headers()
            try:
                while not stop.wait(0.02):  # the fault itself: a byte at a time, slowly
                    self.wfile.write(b"x")
                    self.wfile.flush()
            except OSError:
                pass  # the client hung up: as it should

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Trickle)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    reg = Registry(f"127.0.0.1:{server.server_port}", trust=Trust(plain_http=True), timeout=30)
    got: list[int] = []
    try:
        t0 = time.monotonic()
        with pytest.raises(RegistryError) as e:
            reg.stream_blob("jobs/x", digest, MiB, lambda off, piece: got.append(len(piece)), seconds=1.5)
        took = time.monotonic() - t0
    finally:
        stop.set()
        reg.close()
        server.shutdown()
        server.server_close()
    assert type(e.value) is RegistryError and digest in e.value.message and "too slow" in e.value.message
    assert 1.5 <= took < 10, took
    assert got == []  # no piece was whole: nothing handed on


def _peak_kib(tmp_path: Path, *args: str) -> int:
    """vramctl ARGS run to its end; its own peak resident set (VmHWM, read as it exits), in KiB."""
    r, peak = vramctl_peak(tmp_path, *args)
    assert r.returncode == 0, r.stderr
    return peak


def test_a_pull_of_large_payload_blobs_holds_a_piece_of_each_not_the_blob(run_dir, registry, tmp_path):
    """32 MiB chunks, 4 downloaded at once: a pull holds 4 x 1 MiB of them (it held 4 x 32 MiB before it
    streamed); measured against vramctl's own peak pulling the same bytes as 1 MiB payloads."""
    data = os.urandom(128 * MiB)
    peaks = {}
    for chunk in ("1M", "32M"):
        with Node(run_dir, tmp_path / f"node{chunk}", "--chunk-size", chunk, "--staging-budget", "256M") as node:
            img = tmp_path / f"img{chunk}"
            node.dump(img, [data], "--compress", "none")
        ref = f"{registry.host}/jobs/big{chunk.lower()}:1"
        ok(vramctl("push", str(img), ref, "--plain-http", "--json"))
        dest = tmp_path / f"pulled{chunk}"
        peaks[chunk] = _peak_kib(tmp_path, "pull", ref, str(dest), "--plain-http", "--concurrency", "4", "--json")
        assert (dest / next(p.name for p in img.iterdir() if p.suffix == ".vrd")).read_bytes() == \
            next(p for p in img.iterdir() if p.suffix == ".vrd").read_bytes()
    assert peaks["32M"] < peaks["1M"] + 24 * 1024, peaks  # KiB: 4 blobs of 32 MiB held whole would be 128 MiB
