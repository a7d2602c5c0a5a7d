"""vramd.oci.body: a blob's body read straight into the caller's buffer through urllib3's http.client answer (a
private name, `_fp`: urllib3 2's public `readinto` reads into a new bytes object and copies it), and the public
`readinto` where an answer is not http.client's.  Both paths over real answers: a real HTTP server and urllib3's
pool for the first, urllib3's own HTTPResponse over a file for the second."""
from __future__ import annotations

import io
import os

import pytest
import urllib3
from test_oci_hostile_peers import Seen

from vramd.oci.body import body_reader


def _fill(read, size: int, piece: int = 1 << 16) -> bytes:
    buf, out = bytearray(piece), bytearray()
    while len(out) < size:
        want = min(piece, size - len(out))
        with memoryview(buf) as view, view[:want] as room:
            n = read(room)
        out += buf[:n]
        if n < want:
            break
    return bytes(out)


def test_an_answer_of_urllib3s_pool_is_read_through_http_client_and_a_short_one_is_an_error():
    """The path every blob read takes: urllib3's answer wraps an http.client one (if a urllib3 release stops
    doing so, reads fall back to the public readinto, a copy more per byte: this test says so first).  A body
    that ends before its Content-Length is a ProtocolError, never a short read taken as the blob's end."""
    data = os.urandom(300 << 10)

    def answer(h):
        if h.path == "/short":  # says 300 KiB more than it sends, then closes
            return 200, {"Content-Length": str(2 * len(data)), "Connection": "close"}, data
        return 200, {}, data
    srv = Seen(answer)
    pool = urllib3.PoolManager(retries=False)
    try:
        r = pool.request("GET", f"http://{srv.host}/blob", preload_content=False)
        read = body_reader(r)
        assert read != r.readinto  # the http.client path, not the fallback
        assert _fill(read, len(data)) == data
        assert read(memoryview(bytearray(1))) == 0
        r.release_conn()
        r = pool.request("GET", f"http://{srv.host}/short", preload_content=False)
        read = body_reader(r)
        with pytest.raises(urllib3.exceptions.ProtocolError, match="bytes before the answer's end"):
            _fill(read, 2 * len(data))
        r.close()
    finally:
        pool.clear()
        srv.close()


def test_an_answer_that_is_not_http_clients_is_read_through_urllib3s_public_readinto():
    """The fallback: the same bytes through urllib3's readinto; a body short of its Content-Length raises there
    too (urllib3 enforces it), so a cut-off blob is never taken as whole on this path either."""
    data = os.urandom(200 << 10)
    r = urllib3.HTTPResponse(body=io.BytesIO(data), headers={"Content-Length": str(len(data))},
                             preload_content=False)
    read = body_reader(r)
    assert read == r.readinto
    assert _fill(read, len(data)) == data
    short = urllib3.HTTPResponse(body=io.BytesIO(data), headers={"Content-Length": str(len(data) + 10)},
                                 preload_content=False)
    with pytest.raises(urllib3.exceptions.HTTPError):
        _fill(body_reader(short), len(data) + 10)
