"""Credentials and trust against the real registry (Debian's docker-registry, vramd/testing/registry.py).

Each configuration the issue names: plain HTTP (only when asked), TLS (our CA; another CA refused), TLS +
htpasswd (bcrypt), TLS + token (our token server, trusted by the registry): reached through
vramd.oci.auth's Authenticator, driven by tests/registry_http.py over http.client, or by a separate client
process (tests/registry_client.py) so that argv, the registry's log and the error lines can be searched for
the password.
"""
from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from registry_fixtures import REGISTRY_USERS
from registry_http import authed, push_blob, send

from vramd.errors import AuthFailedError, TlsError
from vramd.oci.auth import Authenticator, repository_scope
from vramd.oci.credentials import ANONYMOUS, Credentials, find_credentials
from vramd.oci.tls import Trust
from vramd.testing.tokenserver import grant_by_pattern

CLIENT = Path(__file__).parent / "registry_client.py"
REPO = "vramd/job"
PUSH = repository_scope(REPO, "pull", "push")
ALICE = REGISTRY_USERS["alice"]


def _config(path: Path, host: str, user: str, password: str) -> Path:
    auth = base64.b64encode(f"{user}:{password}".encode()).decode()
    path.write_text(json.dumps({"auths": {host: {"auth": auth}}}))
    return path


def _roundtrip(auth: Authenticator, base: str) -> None:
    data = os.urandom(50_000)
    digest = push_blob(auth, base, REPO, data, PUSH)
    r = authed(auth, "GET", f"{base}/v2/{REPO}/blobs/{digest}", PUSH)
    assert r.status == 200 and r.body == data


# --- plain HTTP and TLS -----------------------------------------------------------------------

def test_plain_http_only_when_asked(registry):
    with pytest.raises(TlsError, match=rf"TLS to {registry.host} failed"):  # https by default
        send(Trust(), "GET", f"https://{registry.host}/v2/")
    with pytest.raises(TlsError, match="plain HTTP: refused"):
        send(Trust(), "GET", f"http://{registry.host}/v2/")
    trust = Trust(plain_http=True)
    _roundtrip(Authenticator(registry.host, ANONYMOUS, trust), f"{trust.scheme}://{registry.host}")


def test_tls_verified_with_the_ca_file_and_refused_without_it(tls_registry, registry_pki, other_pki):
    trust = Trust(ca_file=registry_pki.ca_cert)
    _roundtrip(Authenticator(tls_registry.host, ANONYMOUS, trust), tls_registry.url)
    with pytest.raises(TlsError) as e:
        send(Trust(), "GET", f"{tls_registry.url}/v2/")
    assert f"TLS to {tls_registry.host} failed" in str(e.value) and "trusting the system CAs" in str(e.value)
    with pytest.raises(TlsError) as e:
        send(Trust(ca_file=other_pki.ca_cert), "GET", f"{tls_registry.url}/v2/")
    assert f"the CA file {other_pki.ca_cert}" in str(e.value) and "certificate verify failed" in str(e.value)


def test_a_registry_certificate_from_another_ca_is_refused(make_registry, registry_pki, other_pki):
    impostor = make_registry(tls=True, pki=other_pki)
    with pytest.raises(TlsError, match=rf"TLS to {impostor.host} failed: .*{registry_pki.ca_cert}"):
        send(Trust(ca_file=registry_pki.ca_cert), "GET", f"{impostor.url}/v2/")
    assert [a.path for a in impostor.access_log() if not a.path.startswith("/v2/?")] == ["/v2/"]  # the fixture's


# --- TLS + htpasswd ----------------------------------------------------------------------------

def test_htpasswd_user_from_a_config_file_pushes_and_pulls(htpasswd_registry, registry_pki, tmp_path):
    config = _config(tmp_path / "config.json", htpasswd_registry.host, "alice", ALICE)
    creds = find_credentials(htpasswd_registry.host, REPO, registry_config=config)
    assert creds.username == "alice" and str(config) in creds.source
    _roundtrip(Authenticator(htpasswd_registry.host, creds, Trust(ca_file=registry_pki.ca_cert)),
               htpasswd_registry.url)
    htpasswd_registry.wait_log(rf'msg="authorized request" .*http\.request\.uri="?/v2/{REPO}/', 3)
    # one challenge (the first request went without credentials), then Basic on every request
    assert len([line for line in htpasswd_registry.log
                if "error authorizing context" in line and f"uri=/v2/{REPO}/" in line]) == 1


def test_htpasswd_wrong_password_is_one_auth_failed_line_naming_the_registry_and_the_file(
        htpasswd_registry, registry_pki, tmp_path):
    config = _config(tmp_path / "config.json", htpasswd_registry.host, "alice", "not-the-password-5e1d")
    creds = find_credentials(htpasswd_registry.host, REPO, registry_config=config)
    auth = Authenticator(htpasswd_registry.host, creds, Trust(ca_file=registry_pki.ca_cert))
    with pytest.raises(AuthFailedError) as e:
        authed(auth, "GET", f"{htpasswd_registry.url}/v2/{REPO}/tags/list", PUSH)
    msg = str(e.value)
    assert e.value.code == "AUTH_FAILED" and "\n" not in msg
    assert htpasswd_registry.host in msg and str(config) in msg and "'alice'" in msg
    assert "not-the-password-5e1d" not in msg + repr(e.value) + repr(creds)


def test_htpasswd_without_credentials_says_none_were_found(htpasswd_registry, registry_pki, tmp_path):
    creds = find_credentials(htpasswd_registry.host, REPO, env={"HOME": str(tmp_path)})
    auth = Authenticator(htpasswd_registry.host, creds, Trust(ca_file=registry_pki.ca_cert))
    with pytest.raises(AuthFailedError, match=r"no credentials were found \(no credentials for .* \(searched "
                                              rf"{tmp_path}/.docker/config.json\)\)"):
        authed(auth, "GET", f"{htpasswd_registry.url}/v2/", PUSH)


# --- TLS + token --------------------------------------------------------------------------------

def _helper(bin_dir: Path, store: dict[str, dict[str, str]]) -> dict[str, str]:
    """docker-credential-vramdtest, a credential helper of our own: answers from `store`, records its stdin."""
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "store.json").write_text(json.dumps(store))
    helper = bin_dir / "docker-credential-vramdtest"
    helper.write_text(f"""#!{sys.executable}
import json, sys
host = sys.stdin.read()
open({str(bin_dir / "asked")!r}, "a").write(" ".join(sys.argv[1:]) + " " + host + "\\n")
store = json.load(open({str(bin_dir / "store.json")!r}))
if host not in store:
    print("credentials not found in native keychain")
    sys.exit(1)
print(json.dumps(store[host]))
""")
    helper.chmod(0o755)
    return {"PATH": f"{bin_dir}:{os.environ['PATH']}", "HOME": str(bin_dir)}


def test_token_auth_with_a_credential_helper_caches_the_token_per_scope(token_registry, registry_pki, tmp_path):
    env = _helper(tmp_path / "bin", {token_registry.host: {"Username": "alice", "Secret": ALICE}})
    config = tmp_path / "auth.json"
    config.write_text(json.dumps({"credHelpers": {token_registry.host: "vramdtest"}}))
    creds = find_credentials(token_registry.host, REPO, env={**env, "REGISTRY_AUTH_FILE": str(config)})
    assert creds.username == "alice" and "docker-credential-vramdtest" in creds.source
    assert (tmp_path / "bin" / "asked").read_text() == f"get {token_registry.host}\n"
    auth = Authenticator(token_registry.host, creds, Trust(ca_file=registry_pki.ca_cert))
    _roundtrip(auth, token_registry.url)
    assert token_registry.token_server is not None
    asked = token_registry.token_server.requests
    assert [(r.method, r.user, r.granted, r.status) for r in asked] == \
        [("GET", "alice", (f"repository:{REPO}:pull,push",), 200)]  # one token for the three requests
    assert sum(1 for a in token_registry.access_log() if a.path.startswith(f"/v2/{REPO}/") and a.status < 300) == 3


def test_token_auth_wrong_password_is_refused_by_the_token_server(token_registry, registry_pki, tmp_path):
    config = _config(tmp_path / "config.json", token_registry.host, "alice", "wrong-horse-0b9e")
    creds = find_credentials(token_registry.host, REPO, registry_config=config)
    auth = Authenticator(token_registry.host, creds, Trust(ca_file=registry_pki.ca_cert))
    with pytest.raises(AuthFailedError) as e:
        authed(auth, "GET", f"{token_registry.url}/v2/{REPO}/tags/list", PUSH)
    msg = str(e.value)
    assert "\n" not in msg and "wrong-horse-0b9e" not in msg
    assert f"{token_registry.host}: the token server https://127.0.0.1:" in msg and str(config) in msg


def test_token_auth_with_an_identity_token_uses_the_refresh_token_grant(make_registry, registry_pki, tmp_path):
    reg = make_registry(auth="token", users=REGISTRY_USERS, refresh_tokens={"refresh-4c2a9d": "bob"})
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"auths": {f"https://{reg.host}": {"identitytoken": "refresh-4c2a9d"}}}))
    creds = find_credentials(reg.host, REPO, registry_config=config)
    _roundtrip(Authenticator(reg.host, creds, Trust(ca_file=registry_pki.ca_cert)), reg.url)
    assert [(r.method, r.user) for r in reg.token_server.requests] == [("POST", "bob")]


def test_a_token_without_the_push_grant_fails_naming_the_scope(make_registry, registry_pki):
    reg = make_registry(auth="token", users=REGISTRY_USERS, grants=grant_by_pattern({"bob": {"vramd/*": ("pull",)}}))
    creds = Credentials(source="the test", username="bob", password=REGISTRY_USERS["bob"])
    auth = Authenticator(reg.host, creds, Trust(ca_file=registry_pki.ca_cert))
    with pytest.raises(AuthFailedError, match=rf"do not allow repository:{REPO}:pull,push"):
        push_blob(auth, reg.url, REPO, b"x" * 100, PUSH)
    assert reg.stored_blobs() == {}


def test_anonymous_gets_no_grant_and_is_told_no_credentials_were_found(token_registry, registry_pki):
    auth = Authenticator(token_registry.host, ANONYMOUS, Trust(ca_file=registry_pki.ca_cert))
    with pytest.raises(AuthFailedError, match="wants a bearer token and no credentials were found"):
        authed(auth, "GET", f"{token_registry.url}/v2/{REPO}/tags/list", repository_scope(REPO, "pull"))


def test_a_bearer_realm_over_plain_http_is_refused_before_any_credential_is_sent(make_registry, registry_pki):
    reg = make_registry(auth="token", users=REGISTRY_USERS, token_tls=False)
    assert reg.token_server is not None and reg.token_server.realm.startswith("http://")
    creds = Credentials(source="the test", username="alice", password=ALICE)
    auth = Authenticator(reg.host, creds, Trust(ca_file=registry_pki.ca_cert))
    with pytest.raises(TlsError, match=r"the token realm of .* http://127\.0\.0\.1:\d+/token is plain HTTP: refused"):
        authed(auth, "GET", f"{reg.url}/v2/{REPO}/tags/list", PUSH)
    assert reg.token_server.requests == []


# --- a separate client process: argv, logs, errors ------------------------------------------------

def _client(reg, pki, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, str(CLIENT), reg.host, REPO, "--ca-file", str(pki.ca_cert), *args],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _cmdlines() -> str:
    out = []
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                out.append(Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace"))
            except OSError:
                pass
    return "\n".join(out)


@pytest.mark.parametrize("auth", ["htpasswd", "token"])
def test_password_stdin_keeps_the_password_out_of_argv_logs_and_errors(make_registry, registry_pki, auth):
    reg = make_registry(tls=True, auth=auth, users=REGISTRY_USERS)
    proc = _client(reg, registry_pki, "--username", "alice", "--password-stdin", "--hold")
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write(ALICE + "\n")
    proc.stdin.flush()
    assert proc.stdout.readline().startswith("ok sha256:")
    assert proc.stdout.readline() == "held\n"  # pushed and read back, still running: look at every argv
    table = _cmdlines()
    assert str(CLIENT) in table and ALICE not in table
    out, err = proc.communicate("")
    assert proc.returncode == 0, err
    wrong = _client(reg, registry_pki, "--username", "alice", "--password-stdin")
    out2, err2 = wrong.communicate("bad-" + ALICE + "\n")
    assert wrong.returncode == 1 and out2 == ""
    assert err2.startswith("error: AUTH_FAILED: ") and err2.count("\n") == 1, err2
    assert reg.host in err2 and "the command line (--username, --password-stdin)" in err2
    reg.settle()
    assert ALICE not in out + err + out2 + err2 + reg.output()
    assert "bad-" + ALICE not in reg.output()


# --- skopeo, an independent client, against the same fixture -------------------------------------

def test_skopeo_logs_in_to_the_token_registry_and_its_auth_file_is_ours_too(token_registry, registry_pki, tmp_path):
    """skopeo (Debian's, containers/image) authenticates with our token server, and the auth.json it writes
    is read by vramd.oci.credentials and pushed with, through $REGISTRY_AUTH_FILE."""
    certs = tmp_path / "certs"
    certs.mkdir()
    (certs / "ca.crt").write_bytes(registry_pki.ca_cert.read_bytes())
    authfile = tmp_path / "auth.json"

    def login(password: str, into: Path) -> subprocess.CompletedProcess[str]:
        return subprocess.run(["skopeo", "login", "--authfile", str(into), "--cert-dir", str(certs),
                               "--username", "alice", "--password-stdin", token_registry.host],
                              input=password + "\n", capture_output=True, text=True, timeout=60)

    bad = login("wrong-" + ALICE, tmp_path / "bad.json")
    assert bad.returncode != 0 and "invalid username/password" in bad.stderr
    ok = login(ALICE, authfile)
    assert ok.returncode == 0, ok.stderr
    creds = find_credentials(token_registry.host, REPO, env={"REGISTRY_AUTH_FILE": str(authfile), "HOME": "/"})
    assert creds.username == "alice" and creds.source == f"the auth file {authfile} (auths['{token_registry.host}'])"
    _roundtrip(Authenticator(token_registry.host, creds, Trust(ca_file=registry_pki.ca_cert)), token_registry.url)
    assert token_registry.token_server is not None
    assert [(r.user, r.status) for r in token_registry.token_server.requests] == \
        [(None, 401), ("alice", 200), ("alice", 200)]  # skopeo's failed login, its login, our push's token


def test_a_cross_repository_mount_asks_for_pull_on_the_source_and_needs_the_grant(make_registry, registry_pki):
    """Mounting a blob from another repository needs pull there: granted, the blob is mounted (201, no upload);
    not granted, AUTH_FAILED naming the scope, and the blob stays out of the target repository."""
    rules = {"alice": {"*": ("pull", "push")}, "bob": {"team/*": ("pull", "push")}}
    reg = make_registry(auth="token", users=REGISTRY_USERS, grants=grant_by_pattern(rules))
    trust = Trust(ca_file=registry_pki.ca_cert)
    alice = Authenticator(reg.host, Credentials("the test", "alice", ALICE), trust)
    digest = push_blob(alice, reg.url, "private/src", os.urandom(10_000), repository_scope("private/src", "push"))
    for user, expect in (("alice", 201), ("bob", None)):
        auth = Authenticator(reg.host, Credentials("the test", user, REGISTRY_USERS[user]), trust)
        dst = f"team/{user}"
        scope = repository_scope(dst, "pull", "push")
        assert authed(auth, "GET", f"{reg.url}/v2/{dst}/tags/list", scope).status == 404  # a token for dst
        url = f"{reg.url}/v2/{dst}/blobs/uploads/?mount={digest}&from=private/src"
        if expect is None:
            with pytest.raises(AuthFailedError, match=r"do not allow repository:private/src:pull repository:team/bob"):
                authed(auth, "POST", url, scope, body=b"")
            assert authed(auth, "HEAD", f"{reg.url}/v2/{dst}/blobs/{digest}", scope).status == 404
        else:
            assert authed(auth, "POST", url, scope, body=b"").status == expect
            assert authed(auth, "HEAD", f"{reg.url}/v2/{dst}/blobs/{digest}", scope).status == 200
    assert reg.token_server is not None
    assert [r.granted for r in reg.token_server.requests if r.user == "bob"][-1] == ("repository:team/bob:pull,push",)
