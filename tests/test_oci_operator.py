"""vramctl's registry commands as an operator meets them, against the real registry (vramd/testing/registry.py)
and real daemons: a pulled incremental image usable as pulled (the `parent` link CRIU's amdgpu plugin records),
a missing tag or digest as NOT_FOUND naming it, a redirect's secrets never in a message, and a parent's OCI
manifest fetched once per command (counted in the registry's access log)."""
from __future__ import annotations

import json
import os
import shutil
import socket
import urllib.request

import pytest
from helpers import vramctl
from oci_helpers import Node, ok, user_cache, workload_bos  # noqa: F401 (user_cache: autouse)
from test_oci_hostile_peers import Seen


@pytest.fixture
def node(run_dir, tmp_path):
    with Node(run_dir, tmp_path / "node1") as n:
        yield n


def _changed(bos: list[bytes], at: int) -> list[bytes]:
    first = bytearray(bos[0])
    first[at] ^= 0xFF  # one chunk of the first BO changed
    return [bytes(first), *bos[1:]]


def _dump_as_the_plugin_does(node: Node, ckpt: list, bos_of: list[list[bytes]]) -> None:
    """A chain of images, each child recording its parent as `parent`, a link inside its own directory (what
    the patched amdgpu plugin records: amdgpu-vramd-<id>/parent -> ../../<previous>/amdgpu-vramd-<id>)."""
    for k, (d, bos) in enumerate(zip(ckpt, bos_of)):
        if k == 0:
            node.dump(d, bos)
            continue
        d.mkdir(parents=True)
        os.symlink(os.path.relpath(ckpt[k - 1], d), d / "parent")
        info = node.dump(d, bos, "--parent", str(d / "parent"))
        assert info["ok"], info


def ok_line(r) -> str:
    assert r.returncode == 0 and r.stdout.count("\n") == 1, r.stderr
    return r.stdout.rstrip("\n")


def _manifest_gets(registry, since: int) -> list[str]:
    return [r.path for r in registry.access_log()[since:] if r.method == "GET" and "/manifests/" in r.path]


def test_a_pulled_incremental_image_restores_through_the_parent_links_it_recorded(node, registry, tmp_path, run_dir):
    """An image two parents deep, each recording its parent as `parent` (as the plugin does), pushed, removed,
    pulled: the parents land in DEST.parent-1 and DEST.parent-2, and the pull makes each `parent` link (relative,
    only to the parent it pulled), so `vramctl restore` needs no --parent and no ln -s.  Was: no link, and the
    restore failed PARENT_MISSING.  A second pull into the same place replaces the links, nothing else.  A
    restore from the reference (cold, then from its cache entry) finds parent #2 through parent #1's link (it
    names #1 itself): was PARENT_MISSING."""
    b0 = workload_bos()
    b1 = _changed(b0, (1 << 20) + 5)
    b2 = _changed(b1, 7)
    ckpt = [tmp_path / "ckpt" / str(k) / "amdgpu-vramd-1" for k in range(3)]
    _dump_as_the_plugin_does(node, ckpt, [b0, b1, b2])
    ref = f"{registry.host}/ckpt/job:3"
    pushed = ok(vramctl("push", str(ckpt[2]), ref, "--plain-http", "--json"))
    assert len(pushed["chain"]) == 3, pushed
    shutil.rmtree(tmp_path / "ckpt")

    dest = tmp_path / "restore" / "amdgpu-vramd-1"
    dest.parent.mkdir()
    for attempt in range(2):
        got = ok(vramctl("pull", ref, str(dest), "--plain-http", "--json"))
        assert [c["dir"] for c in got["chain"]] == [str(dest), f"{dest}.parent-1", f"{dest}.parent-2"], got
        assert [c["link"] for c in got["chain"]] == ["parent", "parent", None], got
        assert os.readlink(dest / "parent") == "../amdgpu-vramd-1.parent-1"
        assert os.readlink(f"{dest}.parent-1/parent") == "../amdgpu-vramd-1.parent-2"
        assert not os.path.lexists(f"{dest}.parent-2/parent")  # the first image records no parent
        assert sorted(os.listdir(dest.parent)) == ["amdgpu-vramd-1", "amdgpu-vramd-1.parent-1",
                                                   "amdgpu-vramd-1.parent-2"]
        assert not [n for n in os.listdir(dest) if n.endswith(".tmp")], attempt
    line = ok_line(vramctl("pull", ref, str(dest), "--plain-http"))
    assert line.endswith(f"; {dest}/parent -> ../amdgpu-vramd-1.parent-1; {dest}.parent-1/parent -> "
                         "../amdgpu-vramd-1.parent-2"), line
    out = node.restore(str(dest), [len(b) for b in b2])
    assert out == b2
    with Node(run_dir, tmp_path / "node2") as other:  # from the reference: parent #2 found through #1's link
        for _cold_then_warm in range(2):
            out = other.restore(f"oci://{ref}", [len(b) for b in b2], "--plain-http", "--cache", str(tmp_path / "c"))
            assert out == b2
    assert [os.path.realpath(dest / c) for c in ("parent", "parent/parent")] == [f"{dest}.parent-1",
                                                                                f"{dest}.parent-2"]


def test_vramctl_rm_of_a_pulled_parent_is_refused_while_its_pulled_child_needs_it(node, registry, tmp_path):
    """A pulled chain is protected as a dumped one is: the pull marks each parent with its child (.child.<id>),
    so `vramctl rm` of parent #1 is refused naming the child, and the chain still restores; the child's rm
    removes its mark and its link, then the parents go, nearest first.  Was: the parent was removed at once,
    and the child could then be neither restored (PARENT_MISSING) nor removed (rm needs its parent to unmark)."""
    b0 = workload_bos()
    b1 = _changed(b0, (1 << 20) + 5)
    b2 = _changed(b1, 7)
    ckpt = [tmp_path / "ckpt" / str(k) / "amdgpu-vramd-1" for k in range(3)]
    _dump_as_the_plugin_does(node, ckpt, [b0, b1, b2])
    ref = f"{registry.host}/ckpt/rm:3"
    ok(vramctl("push", str(ckpt[2]), ref, "--plain-http", "--json"))
    shutil.rmtree(tmp_path / "ckpt")
    dest = tmp_path / "restore" / "amdgpu-vramd-1"
    dest.parent.mkdir()
    ok(vramctl("pull", ref, str(dest), "--plain-http", "--json"))
    p1, p2 = f"{dest}.parent-1", f"{dest}.parent-2"
    for parent, child in ((p1, dest), (p2, p1)):
        r = vramctl("rm", parent)
        assert r.returncode == 1 and f"is the parent of 1 incremental image(s): {child}" in r.stderr, r.stderr
        assert os.path.isfile(os.path.join(parent, "manifest.vrdm"))
    assert node.restore(str(dest), [len(b) for b in b2]) == b2
    for d in (dest, p1, p2):
        r = vramctl("rm", d)
        assert r.returncode == 0 and "stale" not in r.stdout, (d, r.stdout, r.stderr)
        assert not os.path.lexists(d), os.listdir(d)
    assert os.listdir(dest.parent) == []


def test_a_pull_refuses_to_replace_what_is_not_a_link_at_the_parent_name(node, registry, tmp_path):
    """A directory at the name the image records its parent under (the operator's, in a cached pull's
    directory) is never replaced: one line naming it, exit 1, the directory as it was."""
    b0 = workload_bos()
    ckpt = [tmp_path / "ckpt" / str(k) / "img" for k in range(2)]
    _dump_as_the_plugin_does(node, ckpt, [b0, _changed(b0, 3)])
    ref = f"{registry.host}/ckpt/held:2"
    ok(vramctl("push", str(ckpt[1]), ref, "--plain-http", "--json"))
    dest = tmp_path / "img"
    ok(vramctl("pull", ref, str(dest), "--plain-http", "--json"))
    os.unlink(dest / "parent")
    (dest / "parent").mkdir()
    (dest / "parent" / "mine").write_text("kept")
    r = vramctl("pull", ref, str(dest), "--plain-http")
    assert r.returncode == 1 and r.stderr.count("\n") == 1, r.stderr
    assert f"{dest}/parent: not a symbolic link" in r.stderr, r.stderr
    assert (dest / "parent" / "mine").read_text() == "kept"


@pytest.mark.parametrize("what", ["tag", "digest", "repository"])
def test_a_missing_tag_digest_or_repository_is_not_found_naming_it(node, registry, tmp_path, what):
    """Was REGISTRY_ERROR ('HTTP 404 MANIFEST_UNKNOWN'): now NOT_FOUND naming the reference, for a pull and a
    restore from the reference alike, exit 1, nothing made."""
    node.dump(tmp_path / "img", workload_bos())
    ok(vramctl("push", str(tmp_path / "img"), f"{registry.host}/jobs/there:1", "--plain-http", "--json"))
    missing = {"tag": f"{registry.host}/jobs/there:2",
               "digest": f"{registry.host}/jobs/there@sha256:{'0' * 64}",
               "repository": f"{registry.host}/jobs/never:1"}[what]
    r = vramctl("pull", missing, str(tmp_path / "dest"), "--plain-http", "--json")
    assert r.returncode == 1 and r.stderr.count("\n") == 1, r.stderr
    err = json.loads(r.stdout)["error"]
    assert err["code"] == "NOT_FOUND" and f"{missing}: not found" in err["message"], err
    assert "MANIFEST_UNKNOWN" in err["message"] and "check the repository and the tag" in err["message"], err
    assert not (tmp_path / "dest").exists()
    r = vramctl("restore", "--pid", str(os.getpid()), "--image", f"oci://{missing}", "--bo-file",
                f"1={tmp_path / 'x'}", "--plain-http", socket=node.daemon.socket)
    assert r.returncode == 1 and r.stderr.startswith(f"vramctl: NOT_FOUND: registry {registry.host}: {missing}: "
                                                     "not found"), r.stderr


class Redirecting:
    """A registry in front of the real one: manifests (and all else) passed through, every blob GET answered
    307 with `location` (an object store's presigned URL, as distribution on S3 or GCS answers)."""

    def __init__(self, real, location: str) -> None:
        def answer(h):
            if h.command == "GET" and "/blobs/" in h.path:
                return 307, {"Location": location}, b""
            req = urllib.request.Request(f"http://{real.host}{h.path}", method=h.command,
                                         headers={k: v for k, v in h.headers.items() if k.lower() == "accept"})
            try:
                with urllib.request.urlopen(req, timeout=30) as up:
                    return up.status, {"Content-Type": up.headers.get("Content-Type", "")}, up.read()
            except urllib.error.HTTPError as e:
                return e.code, {"Content-Type": e.headers.get("Content-Type", "")}, e.read()
        self.seen = Seen(answer)
        self.host = self.seen.host

    def close(self) -> None:
        self.seen.close()


@pytest.mark.parametrize("case", ["refused", "bad port", "userinfo and 500", "unclosed bracket"])
def test_a_redirects_signature_and_userinfo_never_reach_a_message(node, registry, tmp_path, case):
    """A blob redirected to a presigned URL (its signature and token in the query, or a user and password
    before the host) that then fails: the message names where it went (scheme, host, port, path) and never
    the query or the user info.  Was: a port out of range echoed the whole URL (urllib3's LocationParseError),
    an unclosed IPv6 bracket was an untyped ValueError, and a failure past the redirect named the registry."""
    secret = "sig" + os.urandom(8).hex()
    store = Seen(lambda h: (500, {}, b"store failed"))
    held = socket.socket()
    held.bind(("127.0.0.1", 0))
    closed = held.getsockname()[1]  # bound, never listening: a connection is refused
    query = f"?X-Amz-Signature={secret}&X-Amz-Security-Token={secret}"
    location, shown = {
        "refused": (f"http://127.0.0.1:{closed}/bucket/blob{query}", f"http://127.0.0.1:{closed}/bucket/blob"),
        "bad port": (f"http://127.0.0.1:99999/bucket/blob{query}", "http://127.0.0.1:99999/bucket/blob"),
        "userinfo and 500": (f"http://key:{secret}@{store.host}/bucket/blob{query}", f"http://{store.host}/bucket/blob"),
        "unclosed bracket": (f"http://[::1/bucket/blob{query}", "http://[::1/bucket/blob"),
    }[case]
    node.dump(tmp_path / "img", workload_bos())
    ok(vramctl("push", str(tmp_path / "img"), f"{registry.host}/jobs/signed:1", "--plain-http", "--json"))
    front = Redirecting(registry, location)
    try:
        r = vramctl("pull", f"{front.host}/jobs/signed:1", str(tmp_path / "dest"), "--plain-http", "--json")
        rr = vramctl("restore", "--pid", str(os.getpid()), "--image", f"oci://{front.host}/jobs/signed:1",
                     "--bo-file", f"1={tmp_path / 'x'}", "--plain-http", "--no-cache", socket=node.daemon.socket)
    finally:
        front.close()
        store.close()
        held.close()
    for run in (r, rr):
        assert run.returncode == 1 and run.stderr.count("\n") == 1, run.stderr
        assert secret not in run.stderr + run.stdout, run.stderr
        assert "REGISTRY_ERROR" in run.stderr and shown in run.stderr, run.stderr
        assert "Traceback" not in run.stderr
    if case == "refused":
        assert "is a registry listening" not in r.stderr, r.stderr  # it was the store, not the registry
    assert not (tmp_path / "dest").exists()


def test_a_parents_oci_manifest_is_fetched_once_per_command(node, registry, tmp_path, run_dir):
    """An incremental image whose parent is its sibling (as vramctl dumps it): a second pull into the same place
    (the parent's sibling directory there already) and a warm restore from the reference (its cache entry and
    the parent's there) each GET the child's manifest once and the parent's once.  Was: the parent's twice (once
    to see whether the sibling held it, once to pull it)."""
    bos = workload_bos()
    parent, child = tmp_path / "ckpt" / "step1", tmp_path / "ckpt" / "step2"
    node.dump(parent, bos)
    bos2 = _changed(bos, (1 << 20) + 5)
    node.dump(child, bos2, "--parent", str(parent))
    ref = f"{registry.host}/jobs/inc:2"
    pushed = ok(vramctl("push", str(child), ref, "--plain-http", "--json"))
    digests = [c["digest"] for c in pushed["chain"]]  # the parent's, then the child's
    dest = tmp_path / "elsewhere" / "step2"
    dest.parent.mkdir()
    ok(vramctl("pull", ref, str(dest), "--plain-http", "--json"))
    since = len(registry.access_log())
    ok(vramctl("pull", ref, str(dest), "--plain-http", "--json"))
    assert _manifest_gets(registry, since) == ["/v2/jobs/inc/manifests/2", f"/v2/jobs/inc/manifests/{digests[0]}"]

    cache = str(tmp_path / "cache")
    with Node(run_dir, tmp_path / "node2") as other:
        assert other.restore(f"oci://{ref}", [len(b) for b in bos2], "--plain-http", "--cache", cache) == bos2
        since = len(registry.access_log())
        assert other.restore(f"oci://{ref}", [len(b) for b in bos2], "--plain-http", "--cache", cache) == bos2
    assert _manifest_gets(registry, since) == ["/v2/jobs/inc/manifests/2", f"/v2/jobs/inc/manifests/{digests[0]}"]


def test_shown_url_keeps_no_query_fragment_or_user_info():
    """The one helper every URL in a message goes through (vramd.oci.tls.shown_url; scrub_urls for a library's
    text), on URLs that parse and URLs that do not."""
    from vramd.oci.tls import scrub_urls, shown_url
    cases = {
        "https://u:S@h.example:8443/v2/x?X-Amz-Signature=S#S": "https://h.example:8443/v2/x",
        "http://127.0.0.1:99999/b?token=S": "http://127.0.0.1:99999/b",
        "http://[::1/b?S": "http://[::1/b",
        "http://u:p/S@h/x": "http://h/x",  # a password holding a '/'
        "HTTPS://[::1]:5000/p": "https://[::1]:5000/p",
    }
    for url, want in cases.items():
        assert shown_url(url) == want, url
    assert scrub_urls("Failed to parse: http://u:S@h:1/b?sig=S, then") == "Failed to parse: http://h:1/b then"
