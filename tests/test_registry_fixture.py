"""The real-registry fixture itself (vramd/testing/registry.py): what the OCI and auth tests lean on.

Each test talks to a real Debian docker-registry over a real socket with urllib, so a fixture that did
not start the registry, lost its storage on restart, or mislocated a blob's file fails here first.
"""
from __future__ import annotations

import gc
import hashlib
import os
import shutil
import ssl
import subprocess
import urllib.error
import urllib.request
import warnings

import pytest


def _upload(base: str, repo: str, data: bytes, ctx: ssl.SSLContext | None = None) -> str:
    """A monolithic blob upload (POST then PUT ?digest=); returns the digest."""
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    req = urllib.request.Request(f"{base}/v2/{repo}/blobs/uploads/", method="POST", data=b"")
    with urllib.request.urlopen(req, context=ctx) as r:
        assert r.status == 202
        location = r.headers["Location"]
    if location.startswith("/"):
        location = base + location
    sep = "&" if "?" in location else "?"
    req = urllib.request.Request(f"{location}{sep}digest={digest}", method="PUT", data=data,
                                 headers={"Content-Type": "application/octet-stream"})
    with urllib.request.urlopen(req, context=ctx) as r:
        assert r.status == 201
    return digest


def test_plain_registry_stores_a_blob_where_blob_data_says_and_logs_the_requests(registry):
    data = os.urandom(100_000)
    digest = _upload(registry.url, "vramd/t", data)
    assert registry.blob_data(digest).read_bytes() == data
    assert registry.stored_blobs() == {digest: len(data)}
    methods = [(a.method, a.status) for a in registry.access_log() if a.path.startswith("/v2/vramd/t/")]
    assert methods == [("POST", 202), ("PUT", 201)]
    with urllib.request.urlopen(f"{registry.url}/v2/vramd/t/blobs/{digest}") as r:
        assert r.read() == data
    assert [a for a in registry.access_log() if a.method == "GET" and a.sent == len(data)]


def test_stop_refuses_connections_and_start_serves_the_same_storage_on_the_same_port(registry):
    digest = _upload(registry.url, "vramd/t", b"kept across a restart")
    url = registry.url
    registry.stop()
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(f"{url}/v2/", timeout=5)
    registry.start()
    assert registry.url == url
    with urllib.request.urlopen(f"{url}/v2/vramd/t/blobs/{digest}") as r:
        assert r.read() == b"kept across a restart"


def test_stop_leaves_no_pipe_of_the_registry_open(make_registry):
    """stop() closes the registry process's stdout and stderr: none is left for the GC (a ResourceWarning,
    an error under -W error)."""
    reg = make_registry()
    gc.collect()  # what earlier tests left unreachable warns now, not inside the block below
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always", ResourceWarning)
        reg.stop()
        gc.collect()
    assert not [w for w in seen if issubclass(w.category, ResourceWarning)], [str(w.message) for w in seen]


def test_a_corrupted_blob_file_is_served_as_is(registry):
    """What the corruption tests rely on: the registry does not re-verify a stored blob on GET."""
    data = bytes(range(256)) * 64
    digest = _upload(registry.url, "vramd/t", data)
    path = registry.blob_data(digest)
    raw = bytearray(path.read_bytes())
    raw[1000] ^= 0xFF
    path.write_bytes(bytes(raw))
    with urllib.request.urlopen(f"{registry.url}/v2/vramd/t/blobs/{digest}") as r:
        got = r.read()
    assert got != data and len(got) == len(data) and "sha256:" + hashlib.sha256(got).hexdigest() != digest


def test_tls_registry_is_trusted_with_its_ca_only(tls_registry, registry_pki, other_pki):
    assert tls_registry.url.startswith("https://127.0.0.1:")
    ok = ssl.create_default_context(cafile=str(registry_pki.ca_cert))
    with urllib.request.urlopen(f"{tls_registry.url}/v2/", context=ok) as r:
        assert r.status == 200
    wrong = ssl.create_default_context(cafile=str(other_pki.ca_cert))
    with pytest.raises(urllib.error.URLError) as e:
        urllib.request.urlopen(f"{tls_registry.url}/v2/", context=wrong)
    assert isinstance(e.value.reason, ssl.SSLCertVerificationError)


@pytest.mark.skipif(os.geteuid() != 0, reason="a tmpfs storage needs root (mount)")
def test_storage_limit_makes_the_registry_fail_writes_when_full(make_registry):
    reg = make_registry(storage_limit=1 << 20)
    _upload(reg.url, "vramd/t", os.urandom(200_000))  # fits
    with pytest.raises(urllib.error.HTTPError) as e:
        _upload(reg.url, "vramd/t", os.urandom(2 << 20))  # does not
    # what a client sees: 500, the distribution error UNKNOWN, the system's reason in its detail
    assert e.value.code == 500 and b"no space left on device" in e.value.read()
    reg.wait_log("no space left on device")


def test_htpasswd_registry_wants_basic_auth_and_takes_a_bcrypt_user(htpasswd_registry, registry_pki):
    import base64

    from registry_fixtures import REGISTRY_USERS
    ctx = ssl.create_default_context(cafile=str(registry_pki.ca_cert))
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(f"{htpasswd_registry.url}/v2/", context=ctx)
    assert e.value.code == 401 and e.value.headers["WWW-Authenticate"].startswith("Basic ")
    assert "$2y$" in (htpasswd_registry.workdir / "htpasswd").read_text()  # bcrypt, not the password
    basic = base64.b64encode(f"alice:{REGISTRY_USERS['alice']}".encode()).decode()
    req = urllib.request.Request(f"{htpasswd_registry.url}/v2/", headers={"Authorization": f"Basic {basic}"})
    with urllib.request.urlopen(req, context=ctx) as r:
        assert r.status == 200


def test_a_token_registry_restarted_still_trusts_the_token_server(token_registry, registry_pki):
    """stop()/start() keep the TLS certificate and the token configuration: a client's token still works."""
    import base64
    import json

    from registry_fixtures import REGISTRY_USERS
    ctx = ssl.create_default_context(cafile=str(registry_pki.ca_cert))
    assert token_registry.token_server is not None
    basic = base64.b64encode(f"bob:{REGISTRY_USERS['bob']}".encode()).decode()
    req = urllib.request.Request(f"{token_registry.token_server.realm}?service=vramd-test-registry"
                                 "&scope=repository:vramd/t:pull", headers={"Authorization": f"Basic {basic}"})
    with urllib.request.urlopen(req, context=ctx) as r:
        token = json.load(r)["token"]
    token_registry.stop()
    token_registry.start()
    req = urllib.request.Request(f"{token_registry.url}/v2/vramd/t/tags/list",
                                 headers={"Authorization": f"Bearer {token}"})
    with pytest.raises(urllib.error.HTTPError) as e:  # authorized: the repository is just empty
        urllib.request.urlopen(req, context=ctx)
    assert e.value.code == 404 and b"NAME_UNKNOWN" in e.value.read()
    token_registry.wait_log(r'msg="authorized request" .*uri=/v2/vramd/t/tags/list')


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("ip") is None, reason="a network namespace needs root and ip")
def test_a_registry_in_its_own_network_namespace_serves_on_its_listen_address_only_there(make_registry):
    # what bench/net.py builds for bench/oci_push.py --net-rate: a namespace, a veth pair, the registry inside
    name, host_if, peer_if = f"vramd-test-{os.getpid()}", f"vt{os.getpid()}h", f"vt{os.getpid()}r"
    third = os.getpid() % 250

    def ip(*args: str) -> None:
        subprocess.run(["ip", *args], check=True, capture_output=True)
    ip("netns", "add", name)
    try:
        ip("link", "add", host_if, "type", "veth", "peer", "name", peer_if)
        ip("link", "set", peer_if, "netns", name)
        ip("addr", "add", f"10.214.{third}.1/30", "dev", host_if)
        ip("link", "set", host_if, "up")
        ip("-n", name, "addr", "add", f"10.214.{third}.2/30", "dev", peer_if)
        ip("-n", name, "link", "set", peer_if, "up")
        reg = make_registry(listen=f"10.214.{third}.2", netns=name)
        assert reg.host == f"10.214.{third}.2:{reg.port}" and reg.port > 0
        assert os.readlink(f"/proc/{reg.pid}/ns/net") != os.readlink("/proc/self/ns/net")
        assert os.stat(f"/proc/{reg.pid}/ns/net").st_ino == os.stat(f"/run/netns/{name}").st_ino
        data = os.urandom(50_000)
        digest = _upload(reg.url, "vramd/ns", data)  # across the veth pair
        assert reg.blob_data(digest).read_bytes() == data
        with pytest.raises(urllib.error.URLError) as refused:  # nothing of it listens on this namespace's loopback
            urllib.request.urlopen(f"http://127.0.0.1:{reg.port}/v2/", timeout=5)
        assert isinstance(refused.value.reason, ConnectionRefusedError)
        reg.close()
    finally:
        subprocess.run(["ip", "netns", "del", name], capture_output=True)
        subprocess.run(["ip", "link", "del", host_if], capture_output=True)
