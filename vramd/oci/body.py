"""Reading a streamed answer's body straight into the caller's buffer (vramd.oci.registry's blob reads).

urllib3's own `readinto` reads into a new bytes object, then copies it; its `read1` makes a new bytes object per
socket read.  A pull spends its CPU on the bytes it moves (bench/README.md, "Streamed restore"), so where the
answer is http.client's (urllib3 reads every plain-HTTP and TLS answer through one), its `readinto` is used: the
socket's bytes land in the buffer, one copy, one call per buffer.  urllib3 2.8 (the version tested) has no
public way to the same: its `readinto` costs ~20 % more client CPU per GiB (0.17 against 0.21 s/GiB, 512 MiB
over loopback from `python -m http.server`, three rounds alternating, load average 6.6 of 2 cores).  Where
an answer is not http.client's, the public `readinto` is used (tests/test_oci_body.py reads through both).
"""
from __future__ import annotations

import http.client
from collections.abc import Callable

import urllib3
from urllib3.exceptions import ProtocolError

ReadInto = Callable[[memoryview], int]


def body_reader(r: urllib3.BaseHTTPResponse) -> ReadInto:
    """A `readinto(view)` for `r`'s body that fills `view` but at the body's end, and raises (an HTTPError, or
    http.client's IncompleteRead for a chunked answer) where the connection ends inside the body."""
    fp = getattr(r, "_fp", None)  # urllib3's http.client answer: no public name for it
    if not isinstance(fp, http.client.HTTPResponse):
        return r.readinto

    def readinto(view: memoryview) -> int:
        n = fp.readinto(view)
        if n < len(view) and fp.length:  # the connection ended before its Content-Length
            raise ProtocolError(f"connection closed {fp.length} bytes before the answer's end")
        return n
    return readinto
