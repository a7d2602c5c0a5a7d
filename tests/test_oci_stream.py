"""vramctl restore --image oci://... streamed (vramd.oci.stream): the daemon restores while the blobs download.

Against the real registry and a real daemon: byte-exact through TLS + auth, the cache entry committed; the
session restores BO bytes while a later blob is still held back (a proxy in front of the registry holds it
until the daemon reports restored bytes: without streaming that never happens); a registry stopped mid-restore
and a blob damaged in the registry's storage (typed errors, nothing reported restored, no staging directory,
no cache entry); a daemon that fails stops the downloads at once; a warm cache entry downloads no blob and a
damaged one is refused by the daemon naming the BO; --no-cache leaves nothing; a registry that trickles holds
no blob read past its deadline.
"""
from __future__ import annotations

import http.server
import threading
import time

import pytest

from vramd.errors import RegistryError
from vramd.oci.registry import Registry
from vramd.oci.tls import Trust

MiB = 1 << 20



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
            reg.stream_blob("jobs/x", digest, MiB, lambda off, piece: got.append(len(piece)), base_s=0.5,
                            min_rate=MiB)
        took = time.monotonic() - t0
    finally:
        stop.set()
        reg.close()
        server.shutdown()
        server.server_close()
    assert type(e.value) is RegistryError and digest in e.value.message and "too slow" in e.value.message
    assert 1.5 <= took < 10, took
    assert got == []  # no piece was whole: nothing handed on
