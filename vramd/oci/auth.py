"""Registry authentication without I/O: what header to send, what token to ask for (the caller sends).

The distribution protocol's authentication, as a state machine the HTTP code drives:

    auth = Authenticator("HOST:PORT", credentials, trust)
    scope = repository_scope("vramd/job", "pull", "push")
    resp = send(request, headers=auth.headers(scope))
    if resp.status == 401:
        token_request = auth.challenge(resp.headers["WWW-Authenticate"], scope)
        if token_request is not None:                       # Bearer: ask the realm for a token
            t = send(token_request.method, token_request.url, headers=token_request.headers,
                     body=token_request.body)
            auth.token_response(token_request, t.status, t.body)
        resp = send(request, headers=auth.headers(scope))  # again; a second 401 raises in challenge()

- `Basic realm=...`: the user and password go in an `Authorization: Basic` header (only over HTTPS unless
  plain HTTP was asked for: the registry's scheme is the caller's, from its `Trust`);
- `Bearer realm=,service=,scope=`: a token request to the realm (HTTPS only, unless plain HTTP was asked
  for): `GET realm?service=&scope=` with Basic credentials (or none: anonymous), or `POST realm` with the
  OAuth2 `refresh_token` grant for an identity token; the answer's `token`/`access_token` and `expires_in`
  are cached per scope until shortly before they expire; a `registrytoken` is sent as is;
- a 401 asking for more than the token sent was asked for (a cross-repository mount also needs `pull` on
  the source) is answered with a token request for all of it;
- a 401 that answers credentials just sent (Basic, or an unexpired token asked for that scope) is `AuthFailedError`:
  one line naming the registry and where the credentials came from, never a secret. Token requests keep
  their secrets out of repr; no message here quotes a header, a token or a body.
"""
from __future__ import annotations

import json
import math
import re
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from urllib.parse import urlencode, urlsplit

from ..errors import AuthFailedError, RegistryError
from .credentials import Credentials
from .tls import Trust, shown_url

DEFAULT_EXPIRES_IN = 60  # the token specification's default when the answer names none
MAX_EXPIRES_IN = 86400   # a longer life is taken as a day (asked again after that)
EXPIRY_MARGIN = 10.0     # a cached token is dropped this long before it expires (never under half its life)
CLIENT_ID = "vramd"
MAX_TOKEN_RESPONSE = 1 << 20  # a token answer larger than this is refused, not parsed

_PARAM = re.compile(r'\s*([A-Za-z0-9_.-]+)\s*=\s*("(?:[^"\\]|\\.)*"|[^\s,]*)\s*,?')
_SCHEME = re.compile(r"\s*,?\s*([A-Za-z][A-Za-z0-9_.-]*)(?:\s+|$)")


def repository_scope(repository: str, *actions: str) -> str:
    """`repository:REPO:ACTIONS`, the scope a registry's token names."""
    return f"repository:{repository}:{','.join(actions)}"


def merge_scopes(scopes: Iterable[str]) -> tuple[str, ...]:
    """One scope per resource, its actions merged (`repository:R:push,pull` and `...:pull` make
    `repository:R:pull,push`), sorted: the same access asked in any order is one cache entry."""
    merged: dict[str, set[str]] = {}
    for scope in scopes:
        resource, sep, actions = scope.rpartition(":")
        if not sep or not resource:
            resource, actions = scope, ""
        merged.setdefault(resource, set()).update(a for a in actions.split(",") if a)
    order = {"pull": 0, "push": 1}
    return tuple(f"{r}:{','.join(sorted(acts, key=lambda a: (order.get(a, 2), a)))}"
                 for r, acts in sorted(merged.items()))


@dataclass(frozen=True)
class Challenge:
    scheme: str  # lower case: "basic", "bearer"
    params: Mapping[str, str]


def parse_www_authenticate(value: str) -> list[Challenge]:
    """The challenges in one `WWW-Authenticate` value (RFC 7235: scheme, then key=value or key="value")."""
    out: list[Challenge] = []
    pos = 0
    while pos < len(value):
        m = _SCHEME.match(value, pos)
        if m is None:
            break
        scheme, pos = m.group(1).lower(), m.end()
        params: dict[str, str] = {}
        while True:
            p = _PARAM.match(value, pos)
            if p is None:
                break
            raw = p.group(2)
            params[p.group(1).lower()] = re.sub(r"\\(.)", r"\1", raw[1:-1]) if raw.startswith('"') else raw
            pos = p.end()
        out.append(Challenge(scheme, params))
    return out


@dataclass(frozen=True, repr=False)
class TokenRequest:
    """A request for the caller to send to the token realm. `headers` and `body` may hold a secret."""

    method: str  # "GET" or "POST"
    url: str
    headers: Mapping[str, str]
    body: bytes | None
    scopes: tuple[str, ...]  # asked for: the caller's and the challenge's
    wanted: tuple[str, ...]  # the caller's scope, under which `headers()` finds the token
    anonymous: bool = False

    def __repr__(self) -> str:
        return f"TokenRequest({self.method} {shown_url(self.url)}, scopes={list(self.scopes)})"


@dataclass
class _Token:
    value: str
    good_until: float
    anonymous: bool
    scopes: tuple[str, ...]  # what it was asked for


class Authenticator:
    """One registry's authentication state: the credentials, and the tokens fetched, per scope."""

    def __init__(self, registry: str, credentials: Credentials, trust: Trust,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.registry = registry
        self.credentials = credentials
        self.trust = trust
        self._clock = clock
        self._basic = False  # the registry asked for Basic: send it with every request
        self._tokens: dict[tuple[str, ...], _Token] = {}

    @staticmethod
    def _key(scopes: str | tuple[str, ...]) -> tuple[str, ...]:
        return merge_scopes(scopes.split() if isinstance(scopes, str) else scopes)

    def headers(self, scope: str) -> dict[str, str]:
        """The `Authorization` header to send for a request needing `scope` (none if nothing is known yet)."""
        if self.credentials.registry_token is not None:
            return {"Authorization": f"Bearer {self.credentials.registry_token}"}
        token = self._tokens.get(self._key(scope))
        if token is not None and self._clock() < token.good_until:
            return {"Authorization": f"Bearer {token.value}"}
        basic = self.credentials.basic()
        if self._basic and basic is not None:
            return {"Authorization": basic}
        return {}

    # --- a 401 -------------------------------------------------------------------------
    def challenge(self, www_authenticate: str | None, scope: str) -> TokenRequest | None:
        """Digest a 401: None if the request can be retried with `headers(scope)` as is (Basic), a token
        request to make first (Bearer), or AuthFailedError if the credentials just sent were refused."""
        challenges = parse_www_authenticate(www_authenticate or "")
        bearer = next((c for c in challenges if c.scheme == "bearer"), None)
        basic = next((c for c in challenges if c.scheme == "basic"), None)
        if bearer is not None:
            return self._bearer(bearer, scope)
        if basic is not None:
            if self.credentials.basic() is None:
                raise self._no_credentials("HTTP Basic")
            if self._basic:  # we sent them and the registry said no
                raise self.refused()
            self._basic = True
            return None
        raise RegistryError(f"{self.registry} answered 401 without a challenge this client knows "
                            f"({', '.join(c.scheme for c in challenges) or 'none'})")

    def _bearer(self, c: Challenge, scope: str) -> TokenRequest:
        realm = c.params.get("realm")
        if not realm:
            raise RegistryError(f"{self.registry} asked for a bearer token without naming a realm")
        self.trust.check_url(realm, f"the token realm of {self.registry},")
        scopes = self._key((*scope.split(), *c.params.get("scope", "").split()))
        held = self._tokens.pop(self._key(scope), None)
        if held is not None and self._clock() < held.good_until:  # a token we just sent was not enough
            if self._key((*held.scopes, *scopes)) == held.scopes:  # it was asked for all this: refused
                if c.params.get("error") == "insufficient_scope" and not held.anonymous:
                    raise AuthFailedError(f"{self.registry}: the credentials ({self.credentials.source}) do not "
                                          f"allow {' '.join(scopes)}")
                raise self._no_credentials("a bearer token") if held.anonymous else self.refused()
            # the registry wants more than it was asked for (a mount's source repository): one token for all
            scopes = self._key((*held.scopes, *scopes))
        if self.credentials.registry_token is not None:  # sent as is, and refused
            raise self.refused()
        query: list[tuple[str, str]] = []
        if "service" in c.params:
            query.append(("service", c.params["service"]))
        query += [("scope", s) for s in scopes]
        creds = self.credentials
        if creds.identity_token is not None:
            form = [("grant_type", "refresh_token"), ("refresh_token", creds.identity_token),
                    ("client_id", CLIENT_ID), *query]
            return TokenRequest("POST", realm, {"Content-Type": "application/x-www-form-urlencoded"},
                                urlencode(form).encode(), scopes, self._key(scope))
        basic = creds.basic()
        url = realm + ("&" if urlsplit(realm).query else "?") + urlencode(query)
        return TokenRequest("GET", url, {"Authorization": basic} if basic else {}, None, scopes, self._key(scope),
                            anonymous=basic is None)

    def token_response(self, request: TokenRequest, status: int, body: bytes) -> None:
        """Take the realm's answer to `request`: cache its token, or raise (refused, malformed)."""
        realm = shown_url(request.url)
        if status in (401, 403):
            if request.anonymous:
                raise self._no_credentials("a bearer token")
            raise AuthFailedError(f"{self.registry}: the token server {realm} refused the credentials "
                                  f"({self.credentials.source})")
        if status != 200:
            raise RegistryError(f"{self.registry}: the token server {realm} answered HTTP {status}")
        if len(body) > MAX_TOKEN_RESPONSE:
            raise RegistryError(f"{self.registry}: the token server {realm} answered {len(body)} bytes")
        try:
            doc = json.loads(body)
            value = doc.get("token") or doc.get("access_token")
            expires_in = doc.get("expires_in", DEFAULT_EXPIRES_IN)
            if not isinstance(value, str) or not value or not isinstance(expires_in, int | float) \
                    or isinstance(expires_in, bool):
                raise ValueError
        except (ValueError, AttributeError):  # its body may hold a token: not quoted
            raise RegistryError(f"{self.registry}: the token server {realm} answered no usable token") from None
        # a life the realm states, within reason: json takes Infinity and NaN (a token kept for ever, or never)
        life = min(max(float(expires_in), 1.0), MAX_EXPIRES_IN) if math.isfinite(expires_in) else DEFAULT_EXPIRES_IN
        self._tokens[request.wanted] = _Token(
            value, self._clock() + max(life - EXPIRY_MARGIN, life / 2), request.anonymous, request.scopes)

    # --- errors ------------------------------------------------------------------------
    def refused(self) -> AuthFailedError:
        """The registry refused the credentials just sent."""
        who = f"user {self.credentials.username!r} " if self.credentials.username else ""
        return AuthFailedError(f"{self.registry}: authentication failed: the registry refused the credentials of "
                               f"{who}from {self.credentials.source}")

    def _no_credentials(self, what: str) -> AuthFailedError:
        return AuthFailedError(f"{self.registry}: the registry wants {what} and no credentials were found "
                               f"({self.credentials.source})")

