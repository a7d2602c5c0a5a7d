"""A minimal HTTP adapter over http.client that drives vramd.oci.auth's Authenticator against a real registry.

The tests' own: the OCI engineer's client (vramd.oci.registry) drives the same Authenticator the same way.
`send` maps a TLS failure to `Trust.error` (TlsError naming the host and the CAs trusted); `authed` is the
documented loop: send, on 401 digest the challenge, fetch a token if asked, send again.
"""
from __future__ import annotations

import hashlib
import http.client
import ssl
from dataclasses import dataclass
from urllib.parse import urlsplit

from vramd.oci.auth import Authenticator
from vramd.oci.tls import Trust


@dataclass
class Response:
    status: int
    headers: http.client.HTTPMessage
    body: bytes


def send(trust: Trust, method: str, url: str, headers: dict[str, str] | None = None,
         body: bytes | None = None) -> Response:
    u = urlsplit(url)
    trust.check_url(url, "the URL")
    host = u.netloc
    conn: http.client.HTTPConnection
    if u.scheme == "https":
        conn = http.client.HTTPSConnection(u.hostname or "", u.port, context=trust.context(), timeout=30)
    else:
        conn = http.client.HTTPConnection(u.hostname or "", u.port, timeout=30)
    try:
        conn.request(method, u.path + (f"?{u.query}" if u.query else ""), body=body, headers=headers or {})
        r = conn.getresponse()
        return Response(r.status, r.headers, r.read())
    except (ssl.SSLError, ssl.CertificateError) as e:
        raise trust.error(host, e) from None
    finally:
        conn.close()


def authed(auth: Authenticator, method: str, url: str, scope: str, headers: dict[str, str] | None = None,
           body: bytes | None = None) -> Response:
    """`method url` with whatever authentication the registry asks for (at most one challenge round)."""
    for _ in range(2):
        r = send(auth.trust, method, url, {**(headers or {}), **auth.headers(scope)}, body)
        if r.status != 401:
            return r
        token_request = auth.challenge(r.headers.get("WWW-Authenticate"), scope)
        if token_request is not None:
            t = send(auth.trust, token_request.method, token_request.url, dict(token_request.headers),
                     token_request.body)
            auth.token_response(token_request, t.status, t.body)
    r = send(auth.trust, method, url, {**(headers or {}), **auth.headers(scope)}, body)
    if r.status == 401:
        auth.challenge(r.headers.get("WWW-Authenticate"), scope)  # raises: the credentials were refused
    return r


def push_blob(auth: Authenticator, base: str, repo: str, data: bytes, scope: str) -> str:
    """A monolithic blob upload (POST, then PUT ?digest=); returns the digest."""
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    r = authed(auth, "POST", f"{base}/v2/{repo}/blobs/uploads/", scope, body=b"")
    assert r.status == 202, (r.status, r.body[:200])
    location = r.headers["Location"]
    if location.startswith("/"):
        location = base + location
    r = authed(auth, "PUT", f"{location}{'&' if '?' in location else '?'}digest={digest}", scope,
               {"Content-Type": "application/octet-stream"}, data)
    assert r.status == 201, (r.status, r.body[:200])
    return digest
