"""Trust towards a registry: TLS verified by default, a CA file when asked, plain HTTP only when asked.

`Trust(ca_file=None, plain_http=False)` is what `--ca-file` and `--plain-http` (oras's names) set:
- by default a registry is spoken to over HTTPS, its certificate verified against the system's CAs, its
  name (or IP) checked against the certificate;
- `ca_file`: a PEM bundle trusted as well as the system's CAs (a private registry's CA; the system's stay, so
  a blob the registry redirects to an object store with a public certificate still verifies);
- `plain_http`: plain HTTP to the registry and its token realm; without it an `http://` URL is refused.
There is no way to skip verification: a certificate that does not verify is a `TlsError` naming the host
and the CAs trusted.
"""
from __future__ import annotations

import re
import ssl
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from ..errors import RegistryError, TlsError


@dataclass(frozen=True)
class Trust:
    ca_file: Path | None = None
    plain_http: bool = False

    @property
    def scheme(self) -> str:
        """The scheme a registry is spoken to with."""
        return "http" if self.plain_http else "https"

    def describe(self) -> str:
        """The CAs trusted, as an error message names them."""
        return "the system CAs" if self.ca_file is None else f"the CA file {self.ca_file} and the system CAs"

    def context(self) -> ssl.SSLContext:
        """A client context: certificate and host name verified, TLS 1.2 at least."""
        ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        if self.ca_file is not None:
            try:
                ctx.load_verify_locations(cafile=str(self.ca_file))
            except ssl.SSLError as e:  # read, but no certificate in it: OpenSSL's reason, not its source line
                raise TlsError(f"cannot load the CA file {self.ca_file}: {e.reason or e}: give a PEM file of CA "
                               "certificates") from None
            except OSError as e:
                raise TlsError(f"cannot load the CA file {self.ca_file}: {e.strerror or e}") from None
        return ctx

    def check_url(self, url: str, what: str) -> None:
        """Refuse `url` (a token realm, a redirect) unless it is https, or http with plain HTTP asked for (a
        TlsError), or a URL at all (a RegistryError)."""
        try:
            scheme = urlsplit(url).scheme.lower()
        except ValueError:  # an unclosed IPv6 bracket: no URL at all
            raise RegistryError(f"{what} {shown_url(url)}: not a valid URL") from None
        if scheme == "https" or (scheme == "http" and self.plain_http):
            return
        if scheme == "http":
            raise TlsError(f"{what} {shown_url(url)} is plain HTTP: refused (pass --plain-http to allow plain HTTP)")
        raise TlsError(f"{what} {shown_url(url)}: unsupported scheme {scheme!r}")

    def error(self, host: str, e: ssl.SSLError | ssl.CertificateError) -> TlsError:
        """The typed error for a failed TLS handshake with `host`."""
        if isinstance(e, ssl.SSLCertVerificationError):
            reason = f"certificate verify failed: {e.verify_message}"
        else:
            reason = getattr(e, "reason", None) or str(e)
            if reason == "WRONG_VERSION_NUMBER" and self.scheme == "https":  # the answer was not TLS at all
                reason += ": it does not answer in TLS (a plain-HTTP registry? then --plain-http)"
        return TlsError(f"TLS to {host} failed: {reason} (trusting {self.describe()})")


def shown_url(url: str) -> str:
    """scheme://host[:port]/path: `url` as an error message or a log line may show it, without a user, a password,
    a query or a fragment (a presigned URL's signature, a token: any may be a secret).  The query and the user
    are cut as text first (all before the last `@`: a password holding a `/` too), so a URL that does not parse
    (an unclosed IPv6 bracket) is cut the same way; a port that is no number is left out, one out of range
    shown (it is no secret)."""
    text = re.split(r"[?#]", url, maxsplit=1)[0]
    scheme, sep, rest = text.partition("://")
    if not sep:
        return text.rpartition("@")[2]
    scheme, rest = scheme.lower(), rest.rpartition("@")[2]
    try:
        u = urlsplit(f"{scheme}://{rest}")
    except ValueError:
        return f"{scheme}://{rest}"
    host = u.hostname or ""
    if ":" in host:
        host = f"[{host}]"
    try:
        port = str(u.port or "")
    except ValueError:
        tail = u.netloc.rpartition(":")[2]
        port = tail if tail.isdigit() else ""
    return f"{scheme}://{host}{f':{port}' if port else ''}{u.path}"


URL_IN_TEXT = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://[^\s'\"<>]*")


def scrub_urls(text: str) -> str:
    """`text` (a library's exception message, which may echo the URL it was given) with every URL in it
    shown as `shown_url` shows it."""
    return URL_IN_TEXT.sub(lambda m: shown_url(m[0]), text)
