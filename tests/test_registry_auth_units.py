"""vramd.oci.credentials and vramd.oci.auth without a registry: auth files the tests write, credential helpers
of our own (real processes), and the authenticator's state machine driven with a clock of the test's."""
from __future__ import annotations

import base64
import io
import json
import os
import pickle
import sys
from pathlib import Path

import pytest

from vramd.errors import AuthFailedError, CredentialsError, RegistryError, TlsError
from vramd.oci.auth import Authenticator, merge_scopes, parse_www_authenticate, repository_scope
from vramd.oci.credentials import (
    ANONYMOUS,
    Credentials,
    auth_files,
    find_credentials,
    from_password_stdin,
)
from vramd.oci.tls import Trust

HOST = "registry.example:5000"
SECRET = "s3cret-9d41-not-for-logs"


def _b64(user: str, password: str) -> str:
    return base64.b64encode(f"{user}:{password}".encode()).decode()


def _write(path: Path, doc: object) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc))
    return path


# --- auth files -------------------------------------------------------------------------------

def test_search_order_is_registry_auth_file_then_xdg_runtime_then_docker_config(tmp_path):
    env = {"REGISTRY_AUTH_FILE": str(tmp_path / "a.json"), "XDG_RUNTIME_DIR": str(tmp_path / "run"),
           "DOCKER_CONFIG": str(tmp_path / "docker"), "HOME": str(tmp_path / "home")}
    assert auth_files(env=env) == [tmp_path / "a.json", tmp_path / "run/containers/auth.json",
                                   tmp_path / "docker/config.json"]
    assert auth_files(env={"HOME": str(tmp_path / "home")}) == [tmp_path / "home/.docker/config.json"]
    assert auth_files(tmp_path / "only.json", env=env) == [tmp_path / "only.json"]
    # the first file with an entry for the host wins; files without one are passed over
    _write(tmp_path / "a.json", {"auths": {"elsewhere.example": {"auth": _b64("x", "y")}}})
    _write(tmp_path / "run/containers/auth.json", {"auths": {HOST: {"auth": _b64("runtime", SECRET)}}})
    _write(tmp_path / "docker/config.json", {"auths": {HOST: {"auth": _b64("docker", SECRET)}}})
    creds = find_credentials(HOST, "a/b", env=env)
    assert creds.username == "runtime" and creds.password == SECRET
    assert creds.source == f"the auth file {tmp_path}/run/containers/auth.json (auths['{HOST}'])"


def test_registry_config_alone_is_read_and_must_exist(tmp_path):
    env = {"DOCKER_CONFIG": str(tmp_path / "docker")}
    _write(tmp_path / "docker/config.json", {"auths": {HOST: {"auth": _b64("docker", SECRET)}}})
    given = _write(tmp_path / "given.json", {"auths": {}})
    creds = find_credentials(HOST, registry_config=given, env=env)
    assert creds.anonymous and str(given) in creds.source and "docker/config.json" not in creds.source
    with pytest.raises(CredentialsError, match=r"--registry-config .*missing\.json: no such file"):
        find_credentials(HOST, registry_config=tmp_path / "missing.json", env=env)


@pytest.mark.parametrize("key", [HOST, f"https://{HOST}", f"https://{HOST}/v1/", f"http://{HOST}"])
def test_docker_key_spellings_name_the_host(tmp_path, key):
    cfg = _write(tmp_path / "c.json", {"auths": {key: {"auth": _b64("u", SECRET)}}})
    assert find_credentials(HOST, "r", registry_config=cfg).password == SECRET


def test_docker_hub_and_per_repository_entries(tmp_path):
    cfg = _write(tmp_path / "c.json", {"auths": {
        "https://index.docker.io/v1/": {"auth": _b64("hub", "h")},
        HOST: {"auth": _b64("host", "1")},
        f"{HOST}/team": {"auth": _b64("team", "2")},
        f"{HOST}/team/job": {"auth": _b64("job", "3")},
    }})
    assert find_credentials("docker.io", "library/x", registry_config=cfg).username == "hub"
    assert find_credentials(HOST, "team/job", registry_config=cfg).username == "job"
    assert find_credentials(HOST, "team/other", registry_config=cfg).username == "team"
    assert find_credentials(HOST, "solo", registry_config=cfg).username == "host"


def test_identity_and_registry_tokens(tmp_path):
    cfg = _write(tmp_path / "c.json", {"auths": {HOST: {"identitytoken": SECRET},
                                                  "other.example": {"registrytoken": SECRET}}})
    ident = find_credentials(HOST, registry_config=cfg)
    assert ident.identity_token == SECRET and ident.password is None and not ident.anonymous
    reg = find_credentials("other.example", registry_config=cfg)
    assert reg.registry_token == SECRET


@pytest.mark.parametrize(("doc", "message"), [
    ("{not json " + SECRET, r"is not valid JSON \(line 1, column 2\)"),
    (json.dumps([SECRET]), "is not a JSON object"),
    (json.dumps({"auths": {HOST: {"auth": SECRET + "!!"}}}), r"'auth' is not base64 of user:password"),
    (json.dumps({"auths": {HOST: {"auth": base64.b64encode(SECRET.encode()).decode()}}}), "not base64 of user:p"),
    (json.dumps({"auths": [SECRET]}), "'auths' is not an object"),
    (json.dumps({"credsStore": 7}), "credsStore is not a string"),
])
def test_a_malformed_auth_file_is_a_typed_error_that_quotes_nothing_of_it(tmp_path, doc, message):
    cfg = tmp_path / "c.json"
    cfg.write_text(doc)
    with pytest.raises(CredentialsError, match=message) as e:
        find_credentials(HOST, registry_config=cfg)
    assert str(cfg) in str(e.value) and SECRET not in str(e.value) and e.value.code == "CREDENTIALS_ERROR"


def test_credentials_never_show_their_secrets():
    for creds in (Credentials("the test", "alice", password=SECRET), Credentials("t", identity_token=SECRET),
                  Credentials("t", registry_token=SECRET)):
        assert SECRET not in repr(creds) + str(creds) + f"{creds}" + repr([creds])
        with pytest.raises(TypeError):
            pickle.dumps(creds)
    assert repr(Credentials("the test", "alice", password=SECRET)) == \
        "Credentials(user='alice', password, from the test)"


def test_password_stdin_takes_the_first_line_only():
    creds = from_password_stdin("alice", io.StringIO(SECRET + "\nsecond line\n"))
    assert creds.password == SECRET and creds.username == "alice"
    assert creds.source == "the command line (--username, --password-stdin)"
    assert from_password_stdin("alice", io.StringIO(SECRET + "\r\n")).password == SECRET
    with pytest.raises(CredentialsError, match=r"stdin held no password \(its first line is empty\)"):
        from_password_stdin("alice", io.StringIO("\n"))


# --- credential helpers (real processes) --------------------------------------------------------

def _helper(bin_dir: Path, name: str, body: str) -> dict[str, str]:
    bin_dir.mkdir(exist_ok=True)
    path = bin_dir / f"docker-credential-{name}"
    path.write_text(f"#!{sys.executable}\nimport json, sys\nhost = sys.stdin.read()\n"
                    f"open({str(bin_dir / 'calls')!r}, 'a').write(repr(sys.argv[1:]) + ' ' + host + '\\n')\n"
                    + body)
    path.chmod(0o755)
    return {"PATH": f"{bin_dir}:{os.environ['PATH']}"}


def test_cred_helpers_win_over_auths_and_get_the_host_on_stdin(tmp_path):
    env = _helper(tmp_path / "bin", "mine", f"print(json.dumps({{'Username': 'helped', 'Secret': {SECRET!r}}}))\n")
    cfg = _write(tmp_path / "c.json", {"credHelpers": {HOST: "mine"}, "auths": {HOST: {"auth": _b64("file", "x")}}})
    creds = find_credentials(HOST, "r", registry_config=cfg, env=env)
    assert (creds.username, creds.password) == ("helped", SECRET)
    assert creds.source == f"the credential helper docker-credential-mine (named in {cfg})"
    assert (tmp_path / "bin" / "calls").read_text() == f"['get'] {HOST}\n"


def test_creds_store_not_found_falls_through_to_auths_and_token_user_is_an_identity_token(tmp_path):
    env = _helper(tmp_path / "bin", "store",
                  f"if host == {HOST!r}:\n    print('credentials not found in native keychain'); sys.exit(1)\n"
                  f"print(json.dumps({{'Username': '<token>', 'Secret': {SECRET!r}}}))\n")
    cfg = _write(tmp_path / "c.json", {"credsStore": "store", "auths": {HOST: {"auth": _b64("file", "pw")}}})
    assert find_credentials(HOST, registry_config=cfg, env=env).username == "file"
    other = find_credentials("other.example", registry_config=cfg, env=env)
    assert other.identity_token == SECRET and other.username is None


@pytest.mark.parametrize(("body", "message"), [
    ("print('keychain locked'); sys.exit(3)\n", r"failed \(exit 3\): keychain locked"),
    (f"print('{{\"Username\": \"u\", \"Secret\": ' + repr({SECRET!r}))\n", "other than {Username, Secret} JSON"),
])
def test_a_failing_helper_is_a_typed_error_naming_it_never_its_answer(tmp_path, body, message):
    env = _helper(tmp_path / "bin", "bad", body)
    cfg = _write(tmp_path / "c.json", {"credHelpers": {HOST: "bad"}})
    with pytest.raises(CredentialsError, match=message) as e:
        find_credentials(HOST, registry_config=cfg, env=env)
    assert "docker-credential-bad" in str(e.value) and SECRET not in str(e.value)


def test_helper_names_are_names_not_paths(tmp_path):
    for name in ("../../bin/sh", "-x", ""):
        cfg = _write(tmp_path / "c.json", {"credHelpers": {HOST: name}})
        with pytest.raises(CredentialsError):
            find_credentials(HOST, registry_config=cfg, env={"PATH": "/usr/bin:/bin"})
    cfg = _write(tmp_path / "c.json", {"credHelpers": {HOST: "absent"}})
    with pytest.raises(CredentialsError, match=r"docker-credential-absent .* is not on PATH"):
        find_credentials(HOST, registry_config=cfg, env={"PATH": str(tmp_path)})


# --- the authenticator --------------------------------------------------------------------------

class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


BEARER = 'Bearer realm="https://auth.example/token?x=1",service="reg",scope="repository:a/b:push,pull"'
SCOPE = repository_scope("a/b", "pull", "push")


def test_parse_www_authenticate():
    assert parse_www_authenticate('Basic realm="r\\"q"')[0].params == {"realm": 'r"q'}
    [c] = parse_www_authenticate(BEARER + ',error="insufficient_scope"')
    assert c.scheme == "bearer" and c.params["service"] == "reg" and c.params["error"] == "insufficient_scope"
    assert [c.scheme for c in parse_www_authenticate('Basic realm="x", Bearer realm="y",service=s')] == \
        ["basic", "bearer"]
    assert merge_scopes(["repository:a/b:push", "repository:a/b:pull", "repository:c:pull"]) == \
        ("repository:a/b:pull,push", "repository:c:pull")


def test_bearer_token_request_cache_and_expiry():
    clock = Clock()
    auth = Authenticator(HOST, Credentials("t", "alice", SECRET), Trust(), clock)
    assert auth.headers(SCOPE) == {}
    req = auth.challenge(BEARER, SCOPE)
    assert req is not None and req.method == "GET" and req.body is None
    assert req.url == "https://auth.example/token?x=1&service=reg&scope=repository%3Aa%2Fb%3Apull%2Cpush"
    assert req.headers == {"Authorization": "Basic " + _b64("alice", SECRET)}
    assert SECRET not in repr(req) and _b64("alice", SECRET) not in repr(req)
    auth.token_response(req, 200, json.dumps({"access_token": "T1", "expires_in": 300}).encode())
    assert auth.headers(SCOPE) == {"Authorization": "Bearer T1"}
    assert auth.headers(repository_scope("a/b", "push", "pull")) == {"Authorization": "Bearer T1"}
    assert auth.headers(repository_scope("a/b", "pull")) == {}  # another scope: its own token
    clock.now += 300 - 10  # the margin: dropped 10 s before it expires
    assert auth.headers(SCOPE) == {}
    again = auth.challenge(BEARER, SCOPE)  # expired, not refused: a new token is asked for
    assert again is not None
    auth.token_response(again, 200, json.dumps({"token": "T2"}).encode())  # no expires_in: 60 s
    clock.now += 49
    assert auth.headers(SCOPE) == {"Authorization": "Bearer T2"}
    clock.now += 2
    assert auth.headers(SCOPE) == {}


def test_a_fresh_token_refused_is_auth_failed_naming_the_source_never_the_secret():
    auth = Authenticator(HOST, Credentials("the auth file /x/config.json", "alice", SECRET), Trust(), Clock())
    req = auth.challenge(BEARER, SCOPE)
    assert req is not None
    auth.token_response(req, 200, json.dumps({"token": SECRET}).encode())
    with pytest.raises(AuthFailedError) as e:
        auth.challenge(BEARER, SCOPE)
    assert str(e.value) == (f"{HOST}: authentication failed: the registry refused the credentials of user 'alice' "
                            "from the auth file /x/config.json")
    req = auth.challenge(BEARER, SCOPE)  # the refused token was dropped
    assert req is not None
    auth.token_response(req, 200, json.dumps({"token": "T"}).encode())
    with pytest.raises(AuthFailedError, match=r"do not allow repository:a/b:pull,push$"):
        auth.challenge(BEARER + ',error="insufficient_scope"', SCOPE)
    for status in (401, 403):
        with pytest.raises(AuthFailedError, match=r"the token server https://auth\.example/token refused the cred"):
            auth.token_response(req, status, SECRET.encode())
    with pytest.raises(RegistryError, match=r"answered no usable token$") as e:
        auth.token_response(req, 200, json.dumps({"tok": SECRET}).encode())
    assert SECRET not in str(e.value)
    with pytest.raises(RegistryError, match=r"answered HTTP 500$"):
        auth.token_response(req, 500, SECRET.encode())


def test_identity_token_uses_the_oauth2_refresh_grant():
    auth = Authenticator(HOST, Credentials("t", identity_token=SECRET), Trust(), Clock())
    req = auth.challenge(BEARER, SCOPE)
    assert req is not None and req.method == "POST" and req.url == "https://auth.example/token?x=1"
    assert req.body is not None and b"grant_type=refresh_token" in req.body and SECRET.encode() in req.body
    assert SECRET not in repr(req)


def test_realm_over_http_is_refused_unless_plain_http_was_asked_for():
    http_realm = 'Bearer realm="http://auth.example/token",service="reg"'
    auth = Authenticator(HOST, Credentials("t", "alice", SECRET), Trust(), Clock())
    with pytest.raises(TlsError, match=r"http://auth.example/token is plain HTTP: refused"):
        auth.challenge(http_realm, SCOPE)
    with pytest.raises(TlsError, match=r"unsupported scheme 'file'"):
        auth.challenge('Bearer realm="file:///etc/passwd"', SCOPE)
    with pytest.raises(TlsError, match=r"http://auth\.example:99/t is plain HTTP: refused \(pass --plain-http") as e:
        auth.challenge(f'Bearer realm="http://alice:{SECRET}@auth.example:99/t?k={SECRET}"', SCOPE)
    assert SECRET not in str(e.value)  # a user, password or query in the realm is not repeated
    with pytest.raises(TlsError, match=r"http://auth\.example/t is plain HTTP"):
        auth.challenge('Bearer realm="http://auth.example:port/t"', SCOPE)
    plain = Authenticator(HOST, Credentials("t", "alice", SECRET), Trust(plain_http=True), Clock())
    assert plain.challenge(http_realm, SCOPE) is not None


def test_basic_challenge_then_refusal_and_anonymous():
    auth = Authenticator(HOST, Credentials("t", "alice", SECRET), Trust(), Clock())
    assert auth.headers(SCOPE) == {}
    assert auth.challenge('Basic realm="r"', SCOPE) is None
    assert auth.headers(SCOPE) == {"Authorization": "Basic " + _b64("alice", SECRET)}
    with pytest.raises(AuthFailedError, match=r"refused the credentials of user 'alice' from t$"):
        auth.challenge('Basic realm="r"', SCOPE)
    anon = Authenticator(HOST, ANONYMOUS, Trust(), Clock())
    with pytest.raises(AuthFailedError, match=r"wants HTTP Basic and no credentials were found"):
        anon.challenge('Basic realm="r"', SCOPE)
    req = anon.challenge(BEARER, SCOPE)  # anonymous token request (public pulls), no Authorization
    assert req is not None and req.headers == {} and req.anonymous
    with pytest.raises(RegistryError, match=r"without a challenge this client knows"):
        anon.challenge("Negotiate abc", SCOPE)


def test_the_authenticator_and_the_credentials_are_sans_io():
    """auth.py and credentials.py import no network code (the caller sends; credentials run only helpers)."""
    import ast
    network = {"socket", "ssl", "http", "urllib.request", "asyncio", "httpx", "aiohttp", "urllib3", "requests"}
    for name in ("auth.py", "credentials.py"):
        tree = ast.parse((Path(__file__).parent.parent / "vramd" / "oci" / name).read_text())
        imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        imported |= {n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
        assert imported, name
        assert not {m for m in imported if m in network or m.split(".")[0] in network}, (name, imported)


def test_a_challenge_for_more_than_the_token_was_asked_for_gets_a_new_token_not_a_refusal():
    """A cross-repository mount into a/b also needs pull on the source: the registry's challenge names both."""
    auth = Authenticator(HOST, Credentials("t", "alice", SECRET), Trust(), Clock())
    req = auth.challenge(BEARER, SCOPE)
    assert req is not None
    auth.token_response(req, 200, json.dumps({"token": "T1"}).encode())
    mount = BEARER[:-1] + ' repository:src/x:pull",error="insufficient_scope"'
    req = auth.challenge(mount, SCOPE)
    assert req is not None and req.scopes == ("repository:a/b:pull,push", "repository:src/x:pull")
    assert "scope=repository%3Asrc%2Fx%3Apull" in req.url
    auth.token_response(req, 200, json.dumps({"token": "T2"}).encode())
    assert auth.headers(SCOPE) == {"Authorization": "Bearer T2"}
    with pytest.raises(AuthFailedError, match=r"do not allow repository:a/b:pull,push repository:src/x:pull$"):
        auth.challenge(mount, SCOPE)  # asked for all of it, and still not enough
