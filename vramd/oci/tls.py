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

import ssl
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from ..errors import TlsError


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
        """Refuse `url` (a token realm, a redirect) unless it is https, or http with plain HTTP asked for."""
        scheme = urlsplit(url).scheme.lower()
        if scheme == "https" or (scheme == "http" and self.plain_http):
            return
        if scheme == "http":
            raise TlsError(f"{what} {_origin(url)} is plain HTTP: refused (pass --plain-http to allow plain HTTP)")
        raise TlsError(f"{what} {_origin(url)}: unsupported scheme {scheme!r}")

    def error(self, host: str, e: ssl.SSLError | ssl.CertificateError) -> TlsError:
        """The typed error for a failed TLS handshake with `host`."""
        if isinstance(e, ssl.SSLCertVerificationError):
            reason = f"certificate verify failed: {e.verify_message}"
        else:
            reason = getattr(e, "reason", None) or str(e)
            if reason == "WRONG_VERSION_NUMBER" and self.scheme == "https":  # the answer was not TLS at all
                reason += ": it does not answer in TLS (a plain-HTTP registry? then --plain-http)"
        return TlsError(f"TLS to {host} failed: {reason} (trusting {self.describe()})")


def _origin(url: str) -> str:
    """scheme://host[:port]/path, without a user, password or query (which could carry a secret)."""
    u = urlsplit(url)
    host = u.hostname or ""
    if ":" in host:
        host = f"[{host}]"
    try:
        port = u.port
    except ValueError:  # not a number: named as is, it is no secret
        port = None
    return f"{u.scheme}://{host}{f':{port}' if port else ''}{u.path}"
