"""Where a registry's credentials come from, as docker and podman find them.

`find_credentials(host, repository, ...)` looks, in this order, and takes the first that has an entry:
1. `--username` with `--password-stdin` (the password read from stdin: never in argv);
2. `--registry-config PATH`: that auth file alone (as podman's `--authfile`), when given; otherwise
   `$REGISTRY_AUTH_FILE`, `${XDG_RUNTIME_DIR}/containers/auth.json`, `$DOCKER_CONFIG/config.json` (or
   `~/.docker/config.json`), each that exists, in that order.
In one auth file (docker's config.json format, podman's auth.json is the same):
- `credHelpers: {HOST: NAME}`: run `docker-credential-NAME get` with the host on stdin;
- `credsStore: NAME`: the same helper for every host (an entry it does not have falls through);
- `auths: {KEY: {auth, identitytoken, registrytoken}}`: `auth` is base64 of `user:password`, `identitytoken`
  an OAuth2 refresh token for the token server, `registrytoken` a bearer token sent as is. KEY may be the
  host, `https://HOST`, `HOST/NAMESPACE` (podman's per-repository entries: the longest prefix wins), and
  `https://index.docker.io/v1/` stands for docker.io.
A `Credentials` names where it came from (`source`: a file, a helper, the command line) for error
messages; its repr and str never show a password or token.
"""
from __future__ import annotations

import base64
import binascii
import json
import os
import re
import shutil
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from ..errors import CredentialsError

DOCKER_HUB_KEY = "https://index.docker.io/v1/"
_DOCKER_HUB_HOSTS = {"docker.io", "index.docker.io", "registry-1.docker.io"}
_HELPER_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
HELPER_TIMEOUT = 30.0


@dataclass(frozen=True, repr=False)
class Credentials:
    """What to authenticate with, and where it came from (`source`). repr and str never show a secret."""

    source: str
    username: str | None = None
    password: str | None = None
    identity_token: str | None = None  # an OAuth2 refresh token for the token server
    registry_token: str | None = None  # a bearer token, sent as is

    @property
    def anonymous(self) -> bool:
        return self.password is None and self.identity_token is None and self.registry_token is None

    def basic(self) -> str | None:
        """The `Authorization` value for HTTP Basic, or None without a user and password."""
        if self.username is None or self.password is None:
            return None
        return "Basic " + base64.b64encode(f"{self.username}:{self.password}".encode()).decode()

    def __repr__(self) -> str:
        kinds = [k for k, v in (("password", self.password), ("identity token", self.identity_token),
                                ("registry token", self.registry_token)) if v is not None]
        return (f"Credentials(user={self.username!r}, {'+'.join(kinds) or 'no secret'}, "
                f"from {self.source})")

    __str__ = __repr__

    def __reduce__(self) -> tuple[object, ...]:  # no pickling a secret into a log or a cache by accident
        raise TypeError("Credentials are not picklable")


ANONYMOUS = Credentials(source="no credentials")


def from_password_stdin(username: str, stdin: IO[str]) -> Credentials:
    """`--username USER --password-stdin`: the password is the first line of stdin (its newline dropped)."""
    line = stdin.readline()
    password = line[:-1] if line.endswith("\n") else line
    if password.endswith("\r"):
        password = password[:-1]
    if not username:
        raise CredentialsError("--password-stdin: empty username (--username)")
    if not password:
        raise CredentialsError("--password-stdin: stdin held no password (its first line is empty): pipe the "
                               "password in, e.g. vramctl ... --password-stdin < FILE")
    return Credentials(source="the command line (--username, --password-stdin)", username=username,
                       password=password)


def auth_files(registry_config: Path | None = None, env: Mapping[str, str] | None = None) -> list[Path]:
    """The auth files consulted, in order (existing or not): `registry_config` alone when given."""
    if registry_config is not None:
        return [registry_config]
    env = os.environ if env is None else env
    files = []
    if env.get("REGISTRY_AUTH_FILE"):
        files.append(Path(env["REGISTRY_AUTH_FILE"]))
    if env.get("XDG_RUNTIME_DIR"):
        files.append(Path(env["XDG_RUNTIME_DIR"]) / "containers" / "auth.json")
    if env.get("DOCKER_CONFIG"):
        files.append(Path(env["DOCKER_CONFIG"]) / "config.json")
    elif env.get("HOME"):
        files.append(Path(env["HOME"]) / ".docker" / "config.json")
    return files


def find_credentials(host: str, repository: str = "", *, registry_config: Path | None = None,
                     explicit: Credentials | None = None, env: Mapping[str, str] | None = None) -> Credentials:
    """The credentials for `host` (HOST[:PORT]) and `repository`, or ANONYMOUS naming what was searched."""
    if explicit is not None:
        return explicit
    files = auth_files(registry_config, env)
    if registry_config is not None and not registry_config.is_file():
        what = "is not a regular file" if registry_config.exists() else "no such file"
        raise CredentialsError(f"--registry-config {registry_config}: {what} (give a docker/podman config.json)")
    for path in files:
        creds = _from_file(path, host, repository, env)
        if creds is not None:
            return creds
    searched = ", ".join(str(p) for p in files) or "no auth file"
    return Credentials(source=f"no credentials for {host} (searched {searched})")


def _load(path: Path) -> dict[str, object] | None:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError) as e:
        raise CredentialsError(f"cannot read the auth file {path}: {getattr(e, 'strerror', None) or e}") from None
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as e:  # the message names a position, never the text
        raise CredentialsError(f"the auth file {path} is not valid JSON (line {e.lineno}, column {e.colno})") \
            from None
    if not isinstance(doc, dict):
        raise CredentialsError(f"the auth file {path} is not a JSON object")
    return doc


def _keys_for(host: str, repository: str) -> list[str]:
    """The auths/credHelpers keys that may stand for host/repository, most specific first."""
    parts = [p for p in repository.split("/") if p]
    keys = [f"{host}/{'/'.join(parts[:n])}" for n in range(len(parts), 0, -1)]
    keys.append(host)
    if host in _DOCKER_HUB_HOSTS:
        keys.append(DOCKER_HUB_KEY)
    return keys


def _normalize_key(key: str) -> str:
    """`https://HOST/v1/`, `http://HOST` -> `HOST` (docker's legacy keys); `HOST/NS/REPO` stays."""
    if "://" in key:
        if key.rstrip("/") == DOCKER_HUB_KEY.rstrip("/"):
            return DOCKER_HUB_KEY
        key = key.split("://", 1)[1]
        return key.split("/", 1)[0]
    return key.rstrip("/")


def _section(doc: Mapping[str, object], name: str, path: Path) -> dict[str, object]:
    value = doc.get(name, {})
    if not isinstance(value, dict):
        raise CredentialsError(f"the auth file {path}: {name!r} is not an object")
    return {_normalize_key(k): v for k, v in value.items()}


def _from_file(path: Path, host: str, repository: str, env: Mapping[str, str] | None) -> Credentials | None:
    doc = _load(path)
    if doc is None:
        return None
    keys = _keys_for(host, repository)
    helpers = _section(doc, "credHelpers", path)
    for key in keys:
        if key in helpers:
            name = helpers[key]
            if not isinstance(name, str):
                raise CredentialsError(f"the auth file {path}: credHelpers[{key!r}] is not a string")
            creds = run_helper(name, host, path, env)
            if creds is not None:
                return creds
            break
    store = doc.get("credsStore")
    if store is not None:
        if not isinstance(store, str):
            raise CredentialsError(f"the auth file {path}: credsStore is not a string")
        if store:
            creds = run_helper(store, host, path, env)
            if creds is not None:
                return creds
    auths = _section(doc, "auths", path)
    for key in keys:
        if key in auths:
            return _from_entry(auths[key], key, path)
    return None


def _from_entry(entry: object, key: str, path: Path) -> Credentials | None:
    where = f"the auth file {path} (auths[{key!r}])"
    if not isinstance(entry, dict):
        raise CredentialsError(f"{where} is not an object")
    username: str | None = None
    password: str | None = None
    auth = entry.get("auth")
    if auth:
        if not isinstance(auth, str):
            raise CredentialsError(f"{where}: 'auth' is not a string")
        try:
            decoded = base64.b64decode(auth, validate=True).decode()
        except (binascii.Error, UnicodeDecodeError):
            raise CredentialsError(f"{where}: 'auth' is not base64 of user:password") from None
        username, sep, password = decoded.partition(":")
        if not sep or not username:
            raise CredentialsError(f"{where}: 'auth' is not base64 of user:password")
    elif isinstance(entry.get("username"), str) and isinstance(entry.get("password"), str):
        username, password = entry["username"], entry["password"]
    identity = entry.get("identitytoken") or None
    registry_token = entry.get("registrytoken") or None
    for name, value in (("identitytoken", identity), ("registrytoken", registry_token)):
        if value is not None and not isinstance(value, str):
            raise CredentialsError(f"{where}: {name!r} is not a string")
    if password is None and identity is None and registry_token is None:
        return None
    return Credentials(source=where, username=username, password=password,
                       identity_token=identity if isinstance(identity, str) else None,
                       registry_token=registry_token if isinstance(registry_token, str) else None)


def run_helper(name: str, host: str, config: Path, env: Mapping[str, str] | None = None) -> Credentials | None:
    """`docker-credential-NAME get` with `host` on stdin: its credentials, None if it has none for the host."""
    if not _HELPER_NAME.fullmatch(name):
        raise CredentialsError(f"the auth file {config}: {name!r} is not a credential helper name")
    program = f"docker-credential-{name}"
    search = (os.environ if env is None else env).get("PATH")
    exe = shutil.which(program, path=search)
    where = f"the credential helper {program} (named in {config})"
    if exe is None:
        raise CredentialsError(f"{where} is not on PATH")
    try:
        r = subprocess.run([exe, "get"], input=host, capture_output=True, text=True, timeout=HELPER_TIMEOUT,
                           env=None if env is None else dict(env), check=False)
    except subprocess.TimeoutExpired:
        raise CredentialsError(f"{where} did not answer within {HELPER_TIMEOUT:g} s") from None
    except OSError as e:
        raise CredentialsError(f"{where} could not run: {e.strerror or e}") from None
    if r.returncode != 0:
        said = (r.stdout.strip() or r.stderr.strip()).splitlines()
        if said and "credentials not found" in said[0].lower():
            return None
        # the helper's own words are a diagnostic, not a secret: it failed before it could answer one
        raise CredentialsError(f"{where} failed (exit {r.returncode}): {said[0][:200] if said else 'no output'}")
    try:
        doc = json.loads(r.stdout)
        username, secret = doc["Username"], doc["Secret"]
        if not isinstance(username, str) or not isinstance(secret, str):
            raise TypeError
    except (json.JSONDecodeError, KeyError, TypeError):  # its output may hold a secret: not quoted
        raise CredentialsError(f"{where} answered something other than {{Username, Secret}} JSON") from None
    if username == "<token>":  # docker's convention: the secret is an identity (refresh) token
        return Credentials(source=where, identity_token=secret)
    return Credentials(source=where, username=username, password=secret)
