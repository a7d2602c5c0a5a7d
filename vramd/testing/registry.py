"""The real registry for tests: Debian's `docker-registry` (the CNCF distribution registry 2.8) as a child.

    with Registry(tmp_path / "reg") as reg:                       # plain HTTP on 127.0.0.1
        reg.url                                                   # "http://127.0.0.1:PORT"
    with Registry(d, pki=pki, users={"alice": "pw"}, auth="htpasswd") as reg: ...   # TLS + bcrypt htpasswd
    with Registry(d, pki=pki, users={"alice": "pw"}, auth="token") as reg: ...      # TLS + our token server

Options:
- `pki`: a `vramd.testing.pki.Pki` whose CA signs the registry's certificate (IP 127.0.0.1, DNS localhost):
  the registry serves TLS and `ca_file` is what a client must trust; None serves plain HTTP;
- `auth`: "none", "htpasswd" (`users` hashed with bcrypt by `htpasswd -B`, the password on its stdin), or
  "token" (`vramd.testing.tokenserver.TokenServer`, HTTPS with the same CA unless `token_tls=False`,
  trusted by the registry through `rootcertbundle`; `grants`/`refresh_tokens` passed to it);
- `listen`: the address it serves on; `netns`: a network namespace (`ip netns`) it runs in (bench/net.py);
- `storage_limit`: bytes; the storage directory becomes a tmpfs of that size (needs root: mount), so the
  registry's writes fail with ENOSPC once it is full (the "registry full" fault).
Control: `stop()` and `start()` (same port, same storage: an interrupted upload can be resumed), `close()`.
Inspection: `storage` (the registry's root directory), `blob_data(digest)` (the file holding a blob's bytes,
to corrupt it), `stored_blobs()` ({digest: size}), `access_log()` (each request: method, path, status, bytes
sent; it `settle()`s first: the registry logs a request when its handler returns, which can be after the
client has its answer), `log` (every line the registry wrote), `wait_log(pattern, count)`.
Readiness is a bounded poll of `GET /v2/` (any HTTP answer).
"""
from __future__ import annotations

import os
import re
import signal
import ssl
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Literal

from .pki import Pki
from .tokenserver import Grants, TokenServer, grant_all_to_users

SERVICE = "vramd-test-registry"
ISSUER = "vramd-test-token-server"
_LISTENING = re.compile(r'msg="listening on [^"]*:(\d+)')
# Apache combined format, which the registry writes to stdout for each request
_ACCESS = re.compile(r'^(\S+) \S+ (\S+) \[[^\]]*\] "(\S+) (\S+) [^"]*" (\d{3}) (\d+|-) ')


@dataclass(frozen=True)
class AccessRecord:
    method: str
    path: str
    status: int
    sent: int  # response body bytes
    user: str  # "-" when none


def _bcrypt_line(user: str, password: str) -> str:
    r = subprocess.run(["htpasswd", "-niB", user], input=password + "\n", capture_output=True, text=True,
                       check=False)
    if r.returncode != 0:
        raise RuntimeError(f"htpasswd -B failed: {r.stderr.strip()}")
    return r.stdout.strip()


class Registry:
    def __init__(self, workdir: Path, *, pki: Pki | None = None, auth: Literal["none", "htpasswd", "token"] = "none",
                 users: Mapping[str, str] | None = None, grants: Grants = grant_all_to_users,
                 refresh_tokens: Mapping[str, str] | None = None, token_tls: bool = True,
                 storage_limit: int | None = None, ready_timeout: float = 30.0, listen: str = "127.0.0.1",
                 netns: str | None = None) -> None:
        if auth != "none" and not users:
            raise ValueError(f"auth={auth!r} needs users")
        if auth == "token" and pki is None:
            raise ValueError("auth='token' needs a pki (the token server signs with it)")
        self.workdir = workdir
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.storage = self.workdir / "storage"
        self.storage.mkdir(exist_ok=True)
        self.auth = auth
        self.pki = pki
        self.ready_timeout = ready_timeout
        self.listen, self.netns = listen, netns
        self.ca_file: Path | None = pki.ca_cert if pki is not None else None
        self.scheme = "https" if pki is not None else "http"
        self.port = 0
        self.log: list[str] = []
        self._stdout: list[str] = []
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._settles = 0
        self._proc: subprocess.Popen[str] | None = None
        self._readers: list[threading.Thread] = []
        self._mounted = False
        self.token_server: TokenServer | None = None
        try:
            if storage_limit is not None:
                subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={storage_limit},mode=0755", "tmpfs",
                                str(self.storage)], check=True, capture_output=True)
                self._mounted = True
            self._auth_config = self._make_auth(users or {}, grants, refresh_tokens, token_tls)
            self._tls_config = ""
            if pki is not None:
                server = pki.issue("registry", ips=("127.0.0.1",), dns=("localhost",))
                self._tls_config = f"  tls:\n    certificate: {server.cert}\n    key: {server.key}\n"
            self.start()
        except BaseException:
            self.close()
            raise

    def _make_auth(self, users: Mapping[str, str], grants: Grants, refresh_tokens: Mapping[str, str] | None,
                   token_tls: bool) -> str:
        if self.auth == "htpasswd":
            htpasswd = self.workdir / "htpasswd"
            htpasswd.write_text("".join(_bcrypt_line(u, p) + "\n" for u, p in users.items()))
            return f"auth:\n  htpasswd:\n    realm: vramd-test\n    path: {htpasswd}\n"
        if self.auth == "token":
            assert self.pki is not None
            signer = self.pki.issue("token-signer", server=False)
            self.token_server = TokenServer(
                signer=signer, issuer=ISSUER, service=SERVICE, users=users, grants=grants,
                refresh_tokens=refresh_tokens,
                tls=self.pki.issue("token-server", ips=("127.0.0.1",), dns=("localhost",)) if token_tls else None)
            return (f"auth:\n  token:\n    realm: {self.token_server.realm}\n    service: {SERVICE}\n"
                    f"    issuer: {ISSUER}\n    rootcertbundle: {self.pki.ca_cert}\n")
        return ""

    # --- addresses -------------------------------------------------------------------
    @property
    def host(self) -> str:
        """HOST:PORT, as a reference names the registry."""
        return f"{self.listen}:{self.port}"

    @property
    def url(self) -> str:
        return f"{self.scheme}://{self.host}"

    @property
    def pid(self) -> int | None:
        """The registry process's (for a benchmark's CPU accounting); None while it is not running."""
        return self._proc.pid if self._proc is not None else None

    # --- life -------------------------------------------------------------------------
    def _write_config(self) -> Path:
        config = self.workdir / "config.yml"
        config.write_text(
            "version: 0.1\n"
            "log:\n  level: info\n  accesslog:\n    disabled: false\n"
            f"storage:\n  filesystem:\n    rootdirectory: {self.storage}\n  delete:\n    enabled: true\n"
            "  maintenance:\n    uploadpurging:\n      enabled: false\n"
            f"http:\n  addr: {self.listen}:{self.port}\n  secret: vramd-test-upload-state-secret\n{self._tls_config}"
            + self._auth_config)
        return config

    def start(self) -> None:
        """Start the registry (again: on the port it had, on the same storage) and wait until it answers."""
        if self._proc is not None:
            raise RuntimeError("the registry is running")
        env = {k: v for k, v in os.environ.items() if not k.startswith("REGISTRY_")}
        netns = ["ip", "netns", "exec", self.netns] if self.netns else []  # exec: the same pid
        self._proc = subprocess.Popen([*netns, "docker-registry", "serve", str(self._write_config())], env=env,
                                      stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True, start_new_session=True)
        assert self._proc.stdout is not None and self._proc.stderr is not None
        self._readers = [threading.Thread(target=self._read, args=(self._proc.stdout, self._stdout), daemon=True),
                         threading.Thread(target=self._read, args=(self._proc.stderr, self.log), daemon=True)]
        for t in self._readers:
            t.start()
        self._wait_ready()

    def _read(self, stream: IO[str], into: list[str]) -> None:
        for line in stream:
            with self._cond:
                into.append(line.rstrip("\n"))
                self._cond.notify_all()

    def _context(self) -> ssl.SSLContext | None:
        return ssl.create_default_context(cafile=str(self.ca_file)) if self.ca_file is not None else None

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.ready_timeout
        ctx = self._context()
        while True:
            if self._proc is None or self._proc.poll() is not None:
                raise RuntimeError("docker-registry exited at start:\n" + "\n".join(self.log[-20:]))
            if self.port == 0:
                with self._lock:
                    m = next((m for m in map(_LISTENING.search, self.log) if m), None)
                if m:
                    self.port = int(m.group(1))
            if self.port:
                try:
                    with urllib.request.urlopen(f"{self.url}/v2/", timeout=2, context=ctx):
                        return
                except urllib.error.HTTPError:  # 401 is an answer: it is up
                    return
                except OSError:
                    pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"docker-registry not ready after {self.ready_timeout} s:\n" +
                                   "\n".join(self.log[-20:]))
            time.sleep(0.02)  # a bounded poll for readiness, not synchronisation with a test's action

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> None:
        """Stop the registry (SIGKILL: as if it died); its storage stays for `start()`."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        proc.send_signal(sig)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        for t in self._readers:
            t.join(timeout)
        for pipe in (proc.stdout, proc.stderr):  # read to their end by the readers: closed, not left to the GC
            if pipe is not None:
                pipe.close()

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def close(self) -> None:
        self.stop()
        if self.token_server is not None:
            self.token_server.close()
            self.token_server = None
        if self._mounted:
            subprocess.run(["umount", "-l", str(self.storage)], check=False, capture_output=True)
            self._mounted = False

    def __enter__(self) -> Registry:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- inspection ------------------------------------------------------------------
    @property
    def blobs_dir(self) -> Path:
        return self.storage / "docker" / "registry" / "v2" / "blobs" / "sha256"

    def blob_data(self, digest: str) -> Path:
        """The file holding the bytes of blob `digest` ("sha256:HEX") in the registry's storage."""
        algo, _, hexd = digest.partition(":")
        if algo != "sha256" or not re.fullmatch(r"[0-9a-f]{64}", hexd):
            raise ValueError(f"not a sha256 digest: {digest!r}")
        return self.blobs_dir / hexd[:2] / hexd / "data"

    def stored_blobs(self) -> dict[str, int]:
        """{digest: size} of every blob in the storage (layers, configs and manifests alike)."""
        if not self.blobs_dir.is_dir():
            return {}
        return {f"sha256:{p.parent.name}": p.stat().st_size for p in self.blobs_dir.glob("*/*/data")}

    def stored_bytes(self) -> int:
        return sum(self.stored_blobs().values())

    def access_log(self, settle: bool = True) -> list[AccessRecord]:
        """Every request the registry has answered (across restarts), oldest first. A running registry is
        `settle()`d first, so the requests answered before this call are all there (the readiness polls and
        settle's own requests are `GET /v2/` and `GET /v2/?vramd-settle=N`); a stopped one has logged all."""
        if settle and self.running:
            self.settle()
        with self._lock:
            lines = list(self._stdout)
        out = []
        for line in lines:
            m = _ACCESS.match(line)
            if m:
                out.append(AccessRecord(m.group(3), m.group(4), int(m.group(5)),
                                        0 if m.group(6) == "-" else int(m.group(6)), m.group(2)))
        return out

    def wait_log(self, pattern: str, count: int = 1, timeout: float = 10.0) -> list[str]:
        """The first `count` lines of the registry's log matching `pattern`, once it has written them."""
        rx = re.compile(pattern)
        found: list[str] = []

        def enough() -> bool:
            found[:] = [line for line in self.log if rx.search(line)]
            return len(found) >= count

        with self._cond:
            if not self._cond.wait_for(enough, timeout):
                raise TimeoutError(f"the registry logged {len(found)} of {count} lines matching {pattern!r}")
        return found[:count]

    def settle(self, timeout: float = 10.0) -> None:
        """Return once the access log holds every request answered before this call.

        The registry writes a request's access line when its handler returns, which can be just after the client
        has read a large body's last byte; a request of our own, made after those were answered (a new
        connection, a round trip), is logged after their handlers returned: its line read means theirs were."""
        with self._lock:
            self._settles += 1
            marker = f"vramd-settle={self._settles}"
        try:
            with urllib.request.urlopen(f"{self.url}/v2/?{marker}", timeout=timeout, context=self._context()):
                pass
        except urllib.error.HTTPError:  # 401 on an authenticated registry: logged all the same
            pass
        with self._cond:
            if not self._cond.wait_for(lambda: any(marker in line for line in self._stdout), timeout):
                raise TimeoutError(f"the registry did not log {marker} within {timeout} s")

    def output(self) -> str:
        """All the registry wrote (its log and its access log), for a test that greps it for a secret."""
        with self._lock:
            return "\n".join([*self.log, *self._stdout])
