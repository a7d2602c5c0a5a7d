"""Hostile peers: what a registry, a token realm, a redirect's target or the network between can send that the
distribution registry cannot be made to, played by tiny real HTTP servers in the test (answers without end or a
byte at a time, a mount's upload Location on another host, redirects, gzip bombs, token lives beyond reason):
each is bounded in memory and time, and no credential goes where the registry is not."""
from __future__ import annotations

import json
import os

import pytest
from test_oci_hostile import D1, pull_peak

from vramd.oci import layout as L
from vramd.oci.registry import Registry
from vramd.oci.tls import Trust


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
        # (Connection: close: the handler's return closes this connection, which the client must not reuse for
        # the token request: keep-alive would race that close and fail as RemoteDisconnected under load)
        return (b"HTTP/1.1 401 Unauthorized\r\nContent-Length: 0\r\nConnection: close\r\n"
                b"WWW-Authenticate: Bearer realm=\"http://"
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
