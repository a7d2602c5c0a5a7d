"""A small token server of our own that the real registry trusts (the Docker registry token protocol).

The registry, configured with `auth: token: {realm, service, issuer, rootcertbundle}`, answers an
unauthenticated request with `401` and `WWW-Authenticate: Bearer realm=...,service=...,scope=...`; the client
asks the realm for a token for that scope and sends it back as `Authorization: Bearer TOKEN`. This server:
- `GET /token?service=S&scope=repository:R:pull,push` (more than one scope allowed), HTTP Basic from the
  client: a known user and password get a JWT granting the actions `grants` allows (all by default); a
  wrong password gets 401; no credentials at all get a token granting nothing (as public registries do);
- `POST /token` (OAuth2 form: `grant_type=password` with username/password, or `grant_type=refresh_token`
  with a refresh token the test gave a user: docker's `identitytoken`) answers `access_token`.
Tokens are RS256 JWTs signed by a certificate of the test's own CA (vramd.testing.pki), whose CA
certificate the registry is given as `rootcertbundle`. It serves HTTPS (a certificate from the same kind of
CA), or plain HTTP when asked (to test that a client refuses an http realm). `requests` records what was
asked (user, scopes, granted, status), never a password.
"""
from __future__ import annotations

import base64
import binascii
import fnmatch
import json
import ssl
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit

from .pki import Issued, sign_jwt

# (user, repository, actions asked) -> the actions granted
Grants = Callable[[str | None, str, list[str]], list[str]]


def grant_all_to_users(user: str | None, repo: str, actions: list[str]) -> list[str]:
    """The default: a known user gets what it asks for; anonymous gets nothing."""
    return list(actions) if user is not None else []


def grant_by_pattern(rules: Mapping[str, Mapping[str, tuple[str, ...]]]) -> Grants:
    """{user: {repository glob: actions}}: each user gets the asked actions that a matching rule lists."""
    def grants(user: str | None, repo: str, actions: list[str]) -> list[str]:
        allowed: set[str] = set()
        for pattern, acts in rules.get(user or "", {}).items():
            if fnmatch.fnmatchcase(repo, pattern):
                allowed.update(acts)
        return [a for a in actions if a in allowed or ("*" in allowed)]
    return grants


@dataclass(frozen=True)
class TokenRequest:
    method: str
    user: str | None
    scopes: tuple[str, ...]
    granted: tuple[str, ...]  # "repository:R:pull,push" as granted
    status: int


class TokenServer:
    """Serves tokens for `service`, signed as `issuer` by `signer`, to `users` ({name: password})."""

    def __init__(self, *, signer: Issued, issuer: str, service: str, users: Mapping[str, str],
                 tls: Issued | None, grants: Grants = grant_all_to_users,
                 refresh_tokens: Mapping[str, str] | None = None, expires_in: int = 300) -> None:
        self.signer, self.issuer, self.service = signer, issuer, service
        self.users = dict(users)
        self.refresh_tokens = dict(refresh_tokens or {})  # token -> user
        self.grants = grants
        self.expires_in = expires_in
        self.requests: list[TokenRequest] = []
        self._lock = threading.Lock()
        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), _make_handler(self))
        self._httpd.daemon_threads = True
        if tls is not None:
            ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
            ctx.load_cert_chain(str(tls.cert), str(tls.key))
            self._httpd.socket = ctx.wrap_socket(self._httpd.socket, server_side=True)
        self.scheme = "https" if tls is not None else "http"
        self.port = int(self._httpd.server_address[1])
        self.realm = f"{self.scheme}://127.0.0.1:{self.port}/token"
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="token-server", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join()

    def __enter__(self) -> TokenServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- what the handler calls ------------------------------------------------
    def _token(self, user: str | None, scopes: list[str]) -> tuple[str, tuple[str, ...]]:
        access: list[dict[str, object]] = []
        granted: list[str] = []
        for scope in scopes:
            parts = scope.split(":")
            if len(parts) != 3:
                continue
            kind, repo, actions = parts
            acts = self.grants(user, repo, [a for a in actions.split(",") if a])
            if kind == "repository" and acts:
                access.append({"type": kind, "name": repo, "actions": acts})
                granted.append(f"{kind}:{repo}:{','.join(acts)}")
        now = int(time.time())
        claims: dict[str, object] = {"iss": self.issuer, "sub": user or "", "aud": self.service,
                                     "exp": now + self.expires_in, "nbf": now - 10, "iat": now,
                                     "jti": uuid.uuid4().hex, "access": access}
        return sign_jwt(claims, self.signer), tuple(granted)

    def _record(self, req: TokenRequest) -> None:
        with self._lock:
            self.requests.append(req)


def _basic_user(header: str | None, users: Mapping[str, str]) -> tuple[bool, str | None]:
    """(credentials acceptable, user): no header is anonymous (acceptable, None)."""
    if not header:
        return True, None
    scheme, _, value = header.partition(" ")
    if scheme.lower() != "basic":
        return False, None
    try:
        user, sep, password = base64.b64decode(value.strip(), validate=True).decode().partition(":")
    except (binascii.Error, UnicodeDecodeError):
        return False, None
    ok = bool(sep) and user in users and users[user] == password
    return ok, user if ok else None


def _make_handler(server: TokenServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, format: str, *args: object) -> None:  # quiet: the test reads `requests`
            pass

        def _answer(self, status: int, body: dict[str, object]) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _issue(self, method: str, user: str | None, scopes: list[str], service: str, oauth: bool) -> None:
            if service != server.service:
                server._record(TokenRequest(method, user, tuple(scopes), (), 400))
                self._answer(400, {"errors": [{"code": "UNSUPPORTED", "message": "unknown service"}]})
                return
            token, granted = server._token(user, scopes)
            server._record(TokenRequest(method, user, tuple(scopes), granted, 200))
            body: dict[str, object] = {"access_token": token, "expires_in": server.expires_in,
                                       "issued_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
            if not oauth:
                body["token"] = token
            self._answer(200, body)

        def _deny(self, method: str, scopes: list[str]) -> None:
            server._record(TokenRequest(method, None, tuple(scopes), (), 401))
            self._answer(401, {"errors": [{"code": "UNAUTHORIZED", "message": "authentication required"}]})

        def do_GET(self) -> None:
            url = urlsplit(self.path)
            q = parse_qs(url.query)
            scopes = q.get("scope", [])
            if url.path != "/token":
                self._answer(404, {})
                return
            ok, user = _basic_user(self.headers.get("Authorization"), server.users)
            if not ok:
                self._deny("GET", scopes)
                return
            self._issue("GET", user, scopes, q.get("service", [""])[0], oauth=False)

        def do_POST(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            form = parse_qs(self.rfile.read(length).decode(errors="replace"))
            scopes = " ".join(form.get("scope", [])).split()
            grant = form.get("grant_type", [""])[0]
            user: str | None = None
            if grant == "refresh_token":
                user = server.refresh_tokens.get(form.get("refresh_token", [""])[0])
            elif grant == "password":
                name, password = form.get("username", [""])[0], form.get("password", [""])[0]
                user = name if server.users.get(name) == password and name in server.users else None
            if urlsplit(self.path).path != "/token" or user is None:
                self._deny("POST", scopes)
                return
            self._issue("POST", user, scopes, form.get("service", [""])[0], oauth=True)

    return Handler
