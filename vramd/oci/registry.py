"""The OCI distribution API, as vramd's push and pull use it (urllib3: docs/image-format.md says why).

HEAD a blob, upload one (monolithic, or in pieces past CHUNKED_UPLOAD), mount one from another repository,
GET one into memory with its size bounded and its sha256 checked before the caller sees a byte, PUT and GET
manifests.  Thread-safe: push and pull run several blobs at once over one pool.  Errors are RegistryError
and its kinds (vramd.errors), naming the registry, the repository and the digest; a manifest the registry does
not have (a tag, a digest or a repository) is NotFoundError (NOT_FOUND) naming the reference.  A URL in a
message is shown by vramd.oci.tls.shown_url: never its query or user info.
"""
from __future__ import annotations

import errno
import hashlib
import re
import ssl
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from http.client import HTTPException
from urllib.parse import quote, urljoin, urlsplit

import urllib3
from urllib3.exceptions import HTTPError

from ..errors import AuthFailedError, DigestMismatchError, NotFoundError, RegistryError, RegistryFullError
from .auth import Authenticator, repository_scope
from .body import body_reader
from .credentials import ANONYMOUS, Credentials
from .deadline import Deadlines
from .interrupt import Interrupt, Interrupted, interrupting
from .layout import MEDIA_OCI_INDEX, MEDIA_OCI_MANIFEST
from .reference import HOST as HOST  # re-exported: vramctl and the tests name them here
from .reference import REPO as REPO
from .reference import TAG as TAG
from .reference import Reference as Reference
from .tls import Trust, scrub_urls, shown_url

CHUNKED_UPLOAD = 64 << 20  # blobs larger than this go up in PATCHes of this size, then a closing PUT
STREAM_PIECE = 1 << 20  # a streamed blob read hands its bytes on in pieces of this size
MAX_ANSWER = 1 << 20  # the most of an answer's body held, but a blob's or a manifest's (read as they bound it)
MIN_RATE = 256 << 10  # bytes/s: a request may take its read timeout, plus its bytes' time at this rate, in all


@dataclass
class Stats:
    """What a push or pull moved (vramctl --json reports it)."""

    blobs_uploaded: int = 0
    bytes_uploaded: int = 0
    blobs_present: int = 0  # HEAD found them: nothing sent
    blobs_mounted: int = 0
    blobs_downloaded: int = 0
    bytes_downloaded: int = 0
    requests: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, **counts: int) -> None:
        with self.lock:
            for k, v in counts.items():
                setattr(self, k, getattr(self, k) + v)

    def to_dict(self) -> dict[str, int]:
        return {k: v for k, v in vars(self).items() if isinstance(v, int)}


class Registry:
    """One registry host, spoken to as `trust` says (TLS verified unless plain HTTP was asked for), with
    `credentials` answering its challenges (vramd.oci.auth); credentials never reach a log, a message or a URL.
    `actions`: what the caller does in a repository ("pull", or "pull", "push"), the token scope asked for.
    `timeout`: how long one read may wait; a whole request (connect, send, the answer's headers, and the answer
    itself but a blob's) is cut off after `timeout` plus the time its bytes take at MIN_RATE (vramd.oci.deadline)."""

    def __init__(self, host: str, *, trust: Trust | None = None, credentials: Credentials | None = None,
                 actions: tuple[str, ...] = ("pull",), concurrency: int = 4, timeout: float = 120.0) -> None:
        self.host = host
        self.trust = trust or Trust()
        self.base = f"{self.trust.scheme}://{host}"
        self.actions = actions
        self.stats = Stats()
        self._auth = Authenticator(host, credentials or ANONYMOUS, self.trust)
        self._auth_lock = threading.Lock()
        ctx = None if self.trust.plain_http else self.trust.context()
        self.timeout = timeout
        self._deadlines = Deadlines()
        self._pool = urllib3.PoolManager(num_pools=4, maxsize=max(1, concurrency), block=True, retries=False,
                                         timeout=urllib3.Timeout(connect=10.0, read=timeout), ssl_context=ctx)
        self._pool.pool_classes_by_scheme = self._deadlines.pool_classes()

    def close(self) -> None:
        self._pool.clear()
        self._deadlines.close()

    def deadline(self, nbytes: int) -> float:
        """Seconds a request moving `nbytes` (sent and read) may take in all."""
        return self.timeout + nbytes / MIN_RATE

    def _late(self, what: str, seconds: float) -> RegistryError:
        return RegistryError(f"registry {self.host}: {what}: no complete answer within {seconds:.0f} s (a request "
                             f"may take the read timeout, {self.timeout:.0f} s, plus its bytes' time at "
                             f"{MIN_RATE >> 10} KiB/s): the registry, or the network to it, is too slow")

    # --- one request -----------------------------------------------------------

    def _send(self, method: str, url: str, what: str, body: bytes | None, hdrs: dict[str, str],
              stream: bool) -> tuple[urllib3.BaseHTTPResponse, bytes]:
        """The response, and (unless `stream`) its body, read up to MAX_ANSWER: a larger one (from the registry,
        a token realm or a redirect's target, all untrusted) is refused before it is held.  All of it within
        its deadline (a `stream` answer: up to its headers; the caller bounds the reading of its body)."""
        seconds = self.deadline(len(body or b"") + (0 if stream else MAX_ANSWER))
        with self._deadlines.within(seconds) as armed:
            try:
                r, answer = self._send_now(method, url, what, body, hdrs, stream)
            except (HTTPError, RegistryError):
                if armed.expired:
                    raise self._late(what, seconds) from None
                raise
            if armed.expired:  # cut short: an answer that ended early may look whole (headers end at EOF)
                r.close()
                r.release_conn()
                raise self._late(what, seconds)
            return r, answer

    def _send_now(self, method: str, url: str, what: str, body: bytes | None, hdrs: dict[str, str],
                  stream: bool) -> tuple[urllib3.BaseHTTPResponse, bytes]:
        try:
            # decode_content=False: what we hold is the bytes sent, never an inflated gzip (a few KB that make
            # a gigabyte): a registry answers in identity encoding, as we ask (a blob's digest is of its bytes)
            r = self._pool.request(method, url, body=body, headers=hdrs, preload_content=False, redirect=False,
                                   decode_content=False)
            answer = b"" if stream else r.read(MAX_ANSWER + 1)
        except urllib3.exceptions.SSLError as e:
            inner = e.__context__ if isinstance(e.__context__, ssl.SSLError) else ssl.SSLError(str(e))
            raise self.trust.error(self.host, inner) from None
        except urllib3.exceptions.NameResolutionError as e:
            why = getattr(e.__context__, "strerror", None) or _reason(e)
            raise RegistryError(f"registry {self.host}: {what}: cannot resolve its name ({why})" + (
                ": check the reference's host" if _origin(url) == _origin(self.base) else "")) from None
        except urllib3.exceptions.NewConnectionError as e:
            why = getattr(e.__context__, "strerror", None) or _reason(e)
            raise RegistryError(f"registry {self.host}: {what}: cannot connect ({why})" + (
                f": is a registry listening at {self.host}?" if _origin(url) == _origin(self.base) else "")) from None
        except urllib3.exceptions.LocationParseError:  # its message is the URL: never shown whole
            raise RegistryError(f"registry {self.host}: {what}: {shown_url(url)}: not a valid URL") from None
        except HTTPError as e:
            raise RegistryError(f"registry {self.host}: {what}: {type(e).__name__}: {_reason(e)}") from None
        self.stats.add(requests=1)
        if len(answer) > MAX_ANSWER:
            r.close()  # not back to the pool: the rest of the answer is never read
            r.release_conn()
            raise RegistryError(f"registry {self.host}: {what}: an answer of more than {MAX_ANSWER} bytes")
        return r, answer

    def _request(self, method: str, url: str, what: str, *, repo: str, body: bytes | None = None,
                 headers: dict[str, str] | None = None, ok: tuple[int, ...] = (200,), stream: bool = False,
                 scope: str | None = None, missing: str | None = None) -> urllib3.BaseHTTPResponse:
        """`missing`: the reference asked for, where a 404 means it does not exist (NotFoundError naming it)."""
        scope = scope or repository_scope(repo, *self.actions)
        full = url if url.startswith(("http://", "https://")) else self.base + url
        for _attempt in range(3):
            with self._auth_lock:
                sent = self._auth.headers(scope)
            r, answer = self._send(method, full, what, body, {**(headers or {}), **sent}, stream)
            if r.status != 401:
                break
            challenge = r.headers.get("www-authenticate")
            _discard(r)
            with self._auth_lock:
                if self._auth.headers(scope) != sent:  # another thread answered a challenge meanwhile: retry
                    continue
                token = self._auth.challenge(challenge, scope)
                if token is not None:
                    t, reply = self._send(token.method, token.url, "token request", token.body, dict(token.headers),
                                          False)
                    t.release_conn()
                    self._auth.token_response(token, t.status, reply)
        # a blob may be served elsewhere (an object store): followed, checked as trust says, with our
        # credentials only where the registry itself is (same scheme, host and port: as Go's client, which
        # docker and distribution use, keeps them); anywhere else without (a presigned URL carries its own)
        for _hop in range(5):
            if r.status not in (301, 302, 303, 307, 308) or method not in ("GET", "HEAD"):
                break
            raw = r.headers.get("location", "")
            _discard(r)
            try:
                location = urljoin(full, raw)
            except ValueError:  # an unclosed IPv6 bracket
                raise RegistryError(f"registry {self.host}: {what}: a redirect to {shown_url(raw)}: not a valid "
                                    "URL") from None
            self.trust.check_url(location, f"{what}: a redirect to")
            hop = {**(headers or {}), **(sent if _origin(location) == _origin(self.base) else {})}
            if _origin(location) != _origin(self.base):  # what fails there is named as there (never its query)
                what = f"{what} (redirected to {shown_url(location)})"
            r, answer = self._send(method, location, what, None, hop, stream)
        if r.status in ok:
            return r
        data = answer[:4096] if not stream else r.read(4096)
        r.close()  # the rest of an error's body is never read: its connection is not reused
        r.release_conn()
        if r.status == 401:
            raise AuthFailedError(f"registry {self.host}: {what}: authentication refused")
        if r.status == 403:
            raise AuthFailedError(f"registry {self.host}: {what}: access denied (403)")
        text = data.decode("utf-8", "replace")
        if r.status == 404 and missing is not None:
            raise NotFoundError(f"registry {self.host}: {missing}: not found (HTTP 404 {_error_codes(text)}".rstrip()
                                + "): check the repository and the tag or digest")
        if r.status == 507 or "no space left" in text.lower() or "quota" in text.lower() or _enospc(text):
            raise RegistryFullError(f"registry {self.host}: {what}: the registry is out of space ({r.status})")
        refused = RegistryError(f"registry {self.host}: {what}: HTTP {r.status} {_error_codes(text)}".rstrip())
        refused.status = r.status
        raise refused

    # --- blobs -----------------------------------------------------------------

    def blob_size(self, repo: str, digest: str) -> int | None:
        """The size of a blob the repository holds, None where it holds none."""
        r = self._request("HEAD", f"/v2/{repo}/blobs/{digest}", f"HEAD {repo}@{digest}", repo=repo, ok=(200, 404))
        r.release_conn()
        if r.status == 404:
            return None
        length = r.headers.get("content-length")
        return int(length) if length and length.isdigit() else None

    def mount_blob(self, repo: str, digest: str, from_repo: str) -> bool:
        """Cross-repository mount; False where the registry would rather take an upload (202: it opened one,
        which is cancelled)."""
        r = self._request("POST", f"/v2/{repo}/blobs/uploads/?mount={quote(digest)}&from={quote(from_repo)}",
                          f"mount {digest} from {from_repo} into {repo}", repo=repo, ok=(201, 202),
                          scope=f"{repository_scope(repo, 'pull', 'push')} {repository_scope(from_repo, 'pull')}")
        r.release_conn()
        if r.status == 201:
            self.stats.add(blobs_mounted=1)
            return True
        if r.headers.get("location"):  # cancelled where the registry itself is: our credentials go nowhere else
            self._request("DELETE", self._location(r, f"cancel the upload a mount of {digest} opened"),
                          "cancel upload", repo=repo, ok=(204, 404)).release_conn()
        return False

    def upload_blob(self, repo: str, digest: str, data: bytes) -> None:
        what = f"upload {repo}@{digest}"
        r = self._request("POST", f"/v2/{repo}/blobs/uploads/", what, repo=repo, ok=(202,))
        r.release_conn()
        location = self._location(r, what)
        last = data
        if len(data) > CHUNKED_UPLOAD:
            for start in range(0, len(data), CHUNKED_UPLOAD):
                piece = data[start:start + CHUNKED_UPLOAD]
                r = self._request("PATCH", location, what, repo=repo, body=piece, ok=(202,), headers={
                    "Content-Type": "application/octet-stream",
                    "Content-Range": f"{start}-{start + len(piece) - 1}"})
                r.release_conn()
                location = self._location(r, what)
            last = b""
        sep = "&" if "?" in location else "?"
        r = self._request("PUT", f"{location}{sep}digest={quote(digest)}", what, repo=repo, body=last, ok=(201,),
                          headers={"Content-Type": "application/octet-stream"})
        r.release_conn()
        self.stats.add(blobs_uploaded=1, bytes_uploaded=len(data))

    def _location(self, r: urllib3.BaseHTTPResponse, what: str) -> str:
        location = r.headers.get("location")
        if not location:
            raise RegistryError(f"registry {self.host}: {what}: no upload location in its answer")
        full = urljoin(self.base + "/", location)
        if not full.startswith(self.base + "/"):  # an upload goes to the registry we trust, nowhere else
            raise RegistryError(f"registry {self.host}: {what}: upload location on another host")
        return full

    def get_blob(self, repo: str, digest: str, size: int, *, where: str = "") -> bytearray:
        """The blob's bytes, exactly `size` of them, whose sha256 is `digest`: else DigestMismatchError naming
        `where` (what needed the blob).  `stream_blob` into one buffer that grows with what arrives, so a
        descriptor claiming a huge size costs nothing until bytes come."""
        buf = bytearray()

        def sink(_offset: int, piece: memoryview) -> None:
            buf.extend(piece)

        self.stream_blob(repo, digest, size, sink, where=where)
        return buf

    def stream_blob(self, repo: str, digest: str, size: int, sink: Callable[[int, memoryview], None], *,
                    interrupt: Interrupt | None = None, seconds: float | None = None, where: str = "") -> None:
        """Blob `digest`'s bytes (exactly `size`) handed to `sink(offset, piece)` in pieces of up to STREAM_PIECE
        as they arrive, sha256 computed on the way: unchecked until this returns (else DigestMismatchError
        naming `where`).  Memory: one piece.  Time: the whole read is cut off after `seconds` (default: the
        read timeout plus its size at MIN_RATE, `deadline`), a RegistryError naming the blob: a registry that
        trickles holds no pull forever.  `interrupt`, fired from another thread, ends it at once (Interrupted)."""
        what = f"GET {repo}@{digest}"
        seconds = self.deadline(size) if seconds is None else seconds
        with self._deadlines.within(seconds) as armed:
            with interrupting(interrupt, self._deadlines, armed):  # its head awaited: ended by `interrupt` too
                r = self._request("GET", f"/v2/{repo}/blobs/{digest}", what, repo=repo, stream=True)
            self._deadlines.add(armed, r.connection)  # its body is read here, under the same deadline
            buf = bytearray(max(1, min(size, STREAM_PIECE)))
            got, h, complete, longer = 0, hashlib.sha256(), False, False
            try:
                if interrupt is not None:
                    interrupt.watch(r)
                read = body_reader(r)  # into buf: no bytes object per socket read, no copy of it
                while got < size:
                    want = min(len(buf), size - got)
                    with memoryview(buf) as view, view[:want] as room:
                        fill = read(room)  # all of `want`, but at the body's end
                    if armed.expired:  # ended by the cut: what came may look like an early end of the blob
                        raise self._late(what, seconds)
                    if fill:
                        with memoryview(buf) as view, view[:fill] as piece:
                            h.update(piece)
                            sink(got, piece)
                        got += fill
                    if fill < want:
                        break
                longer = got == size and read(memoryview(bytearray(1))) != 0
                complete = got == size and not longer
            except (HTTPError, HTTPException, OSError) as e:
                if interrupt is not None and interrupt.fired:
                    raise Interrupted() from None
                if armed.expired:
                    raise self._late(what, seconds) from None
                raise RegistryError(f"registry {self.host}: {what}: cut off after {got} bytes: {_reason(e)}") \
                    from None
            finally:
                if interrupt is not None:
                    interrupt.unwatch(r)
                if not complete:
                    r.close()  # the rest of its answer is never read: its connection is not reused
                r.release_conn()
        if interrupt is not None and interrupt.fired:
            raise Interrupted()
        if armed.expired and not complete:
            raise self._late(what, seconds)
        if longer:
            raise DigestMismatchError(f"registry {self.host}: blob {digest} of {repo} is longer than the {size} "
                                      f"bytes its descriptor says{where}")
        if got != size or "sha256:" + h.hexdigest() != digest:
            raise DigestMismatchError(f"registry {self.host}: blob {digest} of {repo} does not match its digest "
                                      f"({got} of {size} bytes){where}")
        self.stats.add(blobs_downloaded=1, bytes_downloaded=size)

    # --- manifests ---------------------------------------------------------------

    def put_manifest(self, repo: str, ref: str, body: bytes, media_type: str = MEDIA_OCI_MANIFEST) -> str:
        digest = "sha256:" + hashlib.sha256(body).hexdigest()
        r = self._request("PUT", f"/v2/{repo}/manifests/{ref}", f"PUT manifest {repo}:{ref}", repo=repo, body=body,
                          ok=(201,), headers={"Content-Type": media_type})
        r.release_conn()
        return digest

    def has_manifest(self, repo: str, digest: str) -> bool:
        """Whether the repository holds the manifest or index `digest` (a part a push finds there is not sent)."""
        r = self._request("HEAD", f"/v2/{repo}/manifests/{digest}", f"HEAD manifest {repo}@{digest}", repo=repo,
                          ok=(200, 404), headers={"Accept": f"{MEDIA_OCI_MANIFEST}, {MEDIA_OCI_INDEX}"})
        r.release_conn()
        return r.status == 200

    def get_manifest(self, repo: str, ref: str, max_size: int) -> tuple[bytes, str]:
        """(the manifest's bytes, their digest); a reference by digest must match it."""
        what = f"GET manifest {repo}:{ref}" if not ref.startswith("sha256:") else f"GET manifest {repo}@{ref}"
        r = self._request("GET", f"/v2/{repo}/manifests/{ref}", what, repo=repo, stream=True,
                          headers={"Accept": f"{MEDIA_OCI_MANIFEST}, {MEDIA_OCI_INDEX}"},
                          missing=f"{self.host}/{repo}{'@' if ref.startswith('sha256:') else ':'}{ref}")
        seconds = self.deadline(max_size)
        try:
            with self._deadlines.within(seconds, r.connection) as armed:
                body = r.read(max_size + 1)
                if armed.expired:  # read to an end the cut made
                    r.close()
                    raise self._late(what, seconds)
        except HTTPError as e:
            r.close()
            if armed.expired:
                raise self._late(what, seconds) from None
            raise RegistryError(f"registry {self.host}: {what}: cut off: {_reason(e)}") from None
        finally:
            r.release_conn()
        if len(body) > max_size:
            raise RegistryError(f"registry {self.host}: {what}: larger than {max_size} bytes")
        digest = "sha256:" + hashlib.sha256(body).hexdigest()
        if ref.startswith("sha256:") and digest != ref:
            raise DigestMismatchError(f"registry {self.host}: manifest {repo}@{ref} does not match its digest")
        return body, digest


def _origin(url: str) -> tuple[str, str, int | None]:
    """(scheme, host, port) of a URL, the port made explicit: what credentials are bound to."""
    u = urlsplit(url)
    try:
        port = u.port
    except ValueError:
        return (u.scheme.lower(), "", -1)  # a malformed port: no origin of ours
    return u.scheme.lower(), (u.hostname or "").lower(), port or {"http": 80, "https": 443}.get(u.scheme.lower())


def _discard(r: urllib3.BaseHTTPResponse) -> None:
    """Done with an answer whose body is not used (a 401, a redirect): what is left of it is read up to
    MAX_ANSWER so that its connection is reused; past that (an answer without end) the connection is closed."""
    try:
        if len(r.read(MAX_ANSWER + 1)) > MAX_ANSWER:
            r.close()
    except HTTPError:
        r.close()
    r.release_conn()


def _reason(e: BaseException) -> str:
    """A library's reason for a failure, any URL in it cut as shown_url cuts it (urllib3 echoes URLs)."""
    reason = getattr(e, "reason", None)
    return scrub_urls(str(reason or e).split(": ", 1)[-1])[:200]


def _enospc(text: str) -> bool:
    """An error body whose detail is a file system error with errno ENOSPC, as the distribution registry
    reports some of its storage driver's failures: `"detail": {..., "Enclosed": {"Op": "write", "Path": ...,
    "Err": 28}}` (others it spells out as "no space left on device")."""
    return re.search(r'"Err"\s*:\s*' + str(errno.ENOSPC) + r'\b', text) is not None


def _error_codes(text: str) -> str:
    """The distribution API's error codes from an error body (never its detail: it may echo request data)."""
    return ", ".join(sorted(set(re.findall(r'"code"\s*:\s*"([A-Z_]{1,64})"', text))))
