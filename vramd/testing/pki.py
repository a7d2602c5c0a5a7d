"""A certificate authority of its own for the registry tests: a CA, server certificates, and RS256 JWT signing.

Everything goes through the `openssl` command line (in every Debian), so the tests need no crypto package:
- `Pki(dir, name)` makes a CA (an RSA key and a self-signed CA certificate, valid two days) in `dir`;
- `Pki.issue(name, ips=..., dns=...)` makes (once) a key and a certificate signed by that CA, with the
  subjectAltNames a TLS client checks (Go's crypto/x509, which the registry uses, ignores the CN);
- `sign_jwt(claims, key, cert)` makes an RS256 JSON Web Token whose header carries the signer's
  certificate (`x5c`), which the registry verifies against the CA it was told to trust.
Each test session makes its own CA: no key outlives the session's temporary directory.
"""
from __future__ import annotations

import base64
import json
import subprocess
from dataclasses import dataclass
from pathlib import Path


def _openssl(*args: str, stdin: bytes | None = None) -> bytes:
    r = subprocess.run(["openssl", *args], input=stdin, capture_output=True, check=False)
    if r.returncode != 0:
        raise RuntimeError(f"openssl {args[0]} failed: {r.stderr.decode(errors='replace').strip()}")
    return r.stdout


@dataclass(frozen=True)
class Issued:
    """A certificate (PEM) and its private key (PEM, unencrypted), both files."""

    cert: Path
    key: Path

    def der(self) -> bytes:
        """The certificate in DER (what a JWT's x5c carries, base64)."""
        return _openssl("x509", "-in", str(self.cert), "-outform", "DER")


class Pki:
    """A CA in `directory`: `ca_cert` is what a client (or the registry, for tokens) is told to trust."""

    def __init__(self, directory: Path, name: str = "vramd test CA") -> None:
        self.dir = directory
        self.dir.mkdir(parents=True, exist_ok=True)
        self.name = name
        self.ca_key = self.dir / "ca.key"
        self.ca_cert = self.dir / "ca.pem"
        _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(self.ca_key),
                 "-out", str(self.ca_cert), "-days", "2", "-subj", f"/CN={name}",
                 "-addext", "basicConstraints=critical,CA:TRUE",
                 "-addext", "keyUsage=critical,keyCertSign,cRLSign")
        self._serial = 1
        self._issued: dict[tuple[str, tuple[str, ...], tuple[str, ...], bool], Issued] = {}

    def issue(self, name: str, *, ips: tuple[str, ...] = (), dns: tuple[str, ...] = (),
              server: bool = True, fresh: bool = False) -> Issued:
        """A key and a certificate for `name` signed by this CA (serverAuth, or a plain signing certificate).

        The same request again gets the same files (an RSA key costs a few hundred ms on a loaded machine; the
        session's registries share theirs), unless `fresh`; every certificate has files of its own."""
        wanted = (name, ips, dns, server)
        if not fresh and wanted in self._issued:
            return self._issued[wanted]
        self._serial += 1
        stem = f"{name}-{self._serial}"  # its own files: a registry restarted later reads the certificate it had
        key, csr, cert = (self.dir / f"{stem}.key", self.dir / f"{stem}.csr", self.dir / f"{stem}.pem")
        _openssl("req", "-new", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(csr),
                 "-subj", f"/CN={name}")
        ext = ["basicConstraints=critical,CA:FALSE"]
        sans = [f"IP:{ip}" for ip in ips] + [f"DNS:{d}" for d in dns]
        if sans:
            ext.append("subjectAltName=" + ",".join(sans))
        if server:
            ext += ["keyUsage=critical,digitalSignature,keyEncipherment", "extendedKeyUsage=serverAuth"]
        else:
            ext.append("keyUsage=critical,digitalSignature")
        extfile = self.dir / f"{stem}.ext"
        extfile.write_text("\n".join(ext) + "\n")
        _openssl("x509", "-req", "-in", str(csr), "-CA", str(self.ca_cert), "-CAkey", str(self.ca_key),
                 "-set_serial", str(self._serial), "-days", "2", "-sha256", "-extfile", str(extfile),
                 "-out", str(cert))
        self._issued[wanted] = Issued(cert, key)
        return self._issued[wanted]


def b64url(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def sign_jwt(claims: dict[str, object], signer: Issued) -> str:
    """An RS256 JWT of `claims`, signed with `signer.key`, its certificate in the header's x5c."""
    header = {"typ": "JWT", "alg": "RS256", "x5c": [base64.b64encode(signer.der()).decode()]}
    signing_input = (b64url(json.dumps(header, separators=(",", ":")).encode()) + "." +
                     b64url(json.dumps(claims, separators=(",", ":")).encode()))
    signature = _openssl("dgst", "-sha256", "-sign", str(signer.key), stdin=signing_input.encode())
    return signing_input + "." + b64url(signature)
