"""vramctl push / pull / restore oci:// against the real registry (Debian's docker-registry, vramd/testing/registry.py)
and real daemons: byte-exact round trips, what goes over the wire (the client's stats cross-checked with the
registry's access log and storage), replicas and incremental children, and a second "node" restoring from the
reference (docs/image-format.md, "OCI artifact")."""
from __future__ import annotations

import os

import pytest
from helpers import vramctl
from oci_helpers import Node, blob_writes, files_of, ok, user_cache, vramctl_stdin, workload_bos  # noqa: F401 (user_cache: autouse)


@pytest.fixture
def node(run_dir, tmp_path):
    with Node(run_dir, tmp_path / "node1") as n:
        yield n


def test_push_pull_restore_round_trip_and_a_second_push_uploads_nothing(node, registry, tmp_path, run_dir):
    bos = workload_bos()
    img = tmp_path / "ckpt" / "step1"
    node.dump(img, bos)
    ref = f"{registry.host}/jobs/train:step1"
    first = ok(vramctl("push", str(img), ref, "--plain-http", "--json"))
    st = first["stats"]
    assert st["blobs_present"] == 0 and st["blobs_uploaded"] >= 4  # config, skeleton, >= 2 payloads
    writes = blob_writes(registry)
    assert len(writes) == st["blobs_uploaded"]
    stored = registry.stored_blobs()
    assert first["digest"] in stored  # the OCI manifest, by its digest
    assert st["bytes_uploaded"] == sum(stored.values()) - stored[first["digest"]]

    # a second push of the same image: every blob is there (HEAD), nothing is uploaded, the digest is the same
    again = ok(vramctl("push", str(img), ref, "--plain-http", "--json"))
    assert again["digest"] == first["digest"]
    assert again["stats"]["bytes_uploaded"] == 0 and again["stats"]["blobs_uploaded"] == 0
    assert len(blob_writes(registry)) == len(writes)
    assert registry.stored_blobs() == stored

    # pull: every file of the directory byte for byte (manifest.vrdm's BLAKE3 holds for children)
    pulled = tmp_path / "pulled"
    got = ok(vramctl("pull", ref, str(pulled), "--plain-http", "--json"))
    assert got["digest"] == first["digest"]
    assert files_of(pulled) == files_of(img)
    assert vramctl("verify", str(pulled)).returncode == 0

    # restore from the reference on another node (another daemon, another directory): byte-exact
    with Node(run_dir, tmp_path / "node2") as other:
        cache = tmp_path / "node2-cache"
        out = other.restore(f"oci://{ref}", [len(b) for b in bos], "--plain-http", "--cache", str(cache))
        assert out == bos
        downloads = [r for r in registry.access_log() if r.method == "GET" and "/blobs/" in r.path]
        # the cache holds it now: a second restore downloads no blob
        out = other.restore(f"oci://{ref}", [len(b) for b in bos], "--plain-http", "--cache", str(cache))
        assert out == bos
        assert [r for r in registry.access_log() if r.method == "GET" and "/blobs/" in r.path] == downloads


def test_four_replicas_occupy_one_replica(run_dir, registry, tmp_path):
    """Data-parallel replicas: the same BOs dumped by four daemons into four directories, pushed to four tags
    of two repositories: the registry stores about one replica (payloads are blobs by their content)."""
    bos = workload_bos()
    sizes = []
    for k in range(4):
        with Node(run_dir, tmp_path / f"n{k}") as n:
            img = tmp_path / f"n{k}" / "image"
            n.dump(img, bos)
            before = registry.stored_bytes()
            st = ok(vramctl("push", str(img), f"{registry.host}/replicas/r{k % 2}:rank{k}", "--plain-http", "--json",
                            "--mount-from", "replicas/r0"))["stats"]
            sizes.append(registry.stored_bytes() - before)
            if k == 1:  # another repository: its payloads are mounted from replicas/r0, not sent
                assert st["blobs_mounted"] >= 2 and st["bytes_uploaded"] < 64 << 10, st
            if k >= 2:  # a repository that has them: HEAD finds them
                assert st["blobs_present"] >= 2 and st["bytes_uploaded"] < 64 << 10, st
    one = sizes[0]
    assert one >= 4 << 20  # the first holds the payloads: 3 MiB + 1 MiB of its own (a hole, a duplicate chunk)
    assert sum(sizes) <= 1.1 * one, sizes  # the others add their manifests, configs and skeletons only


def test_incremental_child_uploads_only_its_changed_chunks_and_pulls_its_parent(node, registry, tmp_path, run_dir):
    bos = workload_bos()
    parent, child = tmp_path / "ckpt" / "step1", tmp_path / "ckpt" / "step2"
    node.dump(parent, bos)
    base = f"{registry.host}/jobs/inc"
    ok(vramctl("push", str(parent), f"{base}:step1", "--plain-http", "--json"))
    changed = bytearray(bos[0])
    changed[(1 << 20) + 5] ^= 0xFF  # one chunk of the first BO changed
    bos2 = [bytes(changed), bos[1]]
    info = node.dump(child, bos2, "--parent", str(parent), "--compress", "none")
    stored_payload = info["image"]["stored_bytes"]
    assert 0 < stored_payload <= 1 << 20
    r = ok(vramctl("push", str(child), f"{base}:step2", "--plain-http", "--json"))
    assert [c["dir"] for c in r["chain"]] == [str(parent), str(child)]
    st = r["stats"]
    # the parent's blobs were all there; the child uploaded its config, skeleton and the changed chunk only
    assert st["blobs_uploaded"] == 3, st
    assert stored_payload <= st["bytes_uploaded"] <= stored_payload + 64 << 10

    # pull the child into another place: the parent comes along, as the sibling the child recorded
    dest = tmp_path / "elsewhere" / "step2"
    dest.parent.mkdir()
    got = ok(vramctl("pull", f"{base}:step2", str(dest), "--plain-http", "--json"))
    assert [c["dir"] for c in got["chain"]] == [str(dest), str(dest.parent / "step1")]
    assert files_of(dest) == files_of(child) and files_of(dest.parent / "step1") == files_of(parent)
    with Node(run_dir, tmp_path / "node2") as other:
        out = other.restore(f"oci://{base}:step2", [len(b) for b in bos2], "--plain-http", "--cache",
                            str(tmp_path / "cache"))
    assert out == bos2


def test_tls_and_htpasswd(node, htpasswd_registry, tmp_path):
    from registry_fixtures import REGISTRY_USERS
    bos = workload_bos()
    img = tmp_path / "image"
    node.dump(img, bos)
    reg = htpasswd_registry
    ref = f"{reg.host}/secure/job:1"
    ca = ["--ca-file", str(reg.ca_file)]
    r = vramctl_stdin(["push", str(img), ref, *ca, "--username", "alice", "--password-stdin", "--json"],
                      REGISTRY_USERS["alice"] + "\n")
    assert r.returncode == 0, r.stderr
    # wrong password: one line, typed, no secret in it
    r = vramctl_stdin(["push", str(img), ref, *ca, "--username", "alice", "--password-stdin"], "wrong-password\n")
    assert r.returncode == 1 and r.stderr.count("\n") == 1 and "AUTH_FAILED" in r.stderr
    assert "wrong-password" not in r.stderr
    # no --ca-file: the certificate is not trusted
    r = vramctl_stdin(["pull", ref, str(tmp_path / "x"), "--username", "alice", "--password-stdin"],
                      REGISTRY_USERS["alice"] + "\n")
    assert r.returncode == 1 and "TLS_ERROR" in r.stderr
    r = vramctl_stdin(["pull", ref, str(tmp_path / "pulled"), *ca, "--username", "alice", "--password-stdin"],
                      REGISTRY_USERS["alice"] + "\n")
    assert r.returncode == 0, r.stderr
    assert files_of(tmp_path / "pulled") == files_of(img)


def test_token_auth_push_and_pull(node, token_registry, tmp_path):
    from registry_fixtures import REGISTRY_USERS
    bos = workload_bos()
    img = tmp_path / "image"
    node.dump(img, bos)
    reg = token_registry
    ref = f"{reg.host}/team/job:1"
    ca = ["--ca-file", str(reg.ca_file)]
    r = vramctl_stdin(["push", str(img), ref, *ca, "--username", "bob", "--password-stdin", "--json"],
                      REGISTRY_USERS["bob"] + "\n")
    assert r.returncode == 0, r.stderr
    r = vramctl_stdin(["pull", ref, str(tmp_path / "pulled"), *ca, "--username", "bob", "--password-stdin"],
                      REGISTRY_USERS["bob"] + "\n")
    assert r.returncode == 0, r.stderr
    assert files_of(tmp_path / "pulled") == files_of(img)
    assert REGISTRY_USERS["bob"] not in reg.output()


def test_a_second_push_reads_no_payload_where_the_cache_holds_the_skeleton(node, registry, tmp_path):
    """The first push keeps the image's skeleton (payload digests) in the cache; a second push of the image
    HEADs the blobs by those digests without reading a payload: a payload changed on disk since (which
    a valid image never has) goes unnoticed by it, and is noticed once the cache is not used."""
    bos = workload_bos()
    img = tmp_path / "image"
    node.dump(img, bos, "--compress", "none")
    ref = f"{registry.host}/jobs/cached:1"
    first = ok(vramctl("push", str(img), ref, "--plain-http", "--json"))
    assert list((tmp_path / "xdg-cache" / "vramd" / "oci" / "push").iterdir())  # (user_cache: XDG_CACHE_HOME)
    data = max((p for p in img.iterdir() if p.suffix == ".vrd"), key=lambda p: p.stat().st_size)
    raw = bytearray(data.read_bytes())
    raw[-100] ^= 0xFF  # within the last record's payload
    data.write_bytes(raw)
    again = ok(vramctl("push", str(img), ref, "--plain-http", "--json"))
    assert again["digest"] == first["digest"] and again["stats"]["bytes_uploaded"] == 0
    fresh = ok(vramctl("push", str(img), ref, "--plain-http", "--json", "--cache", str(tmp_path / "empty")))
    assert fresh["digest"] != first["digest"] and fresh["stats"]["blobs_uploaded"] >= 2


def test_push_of_a_child_whose_parent_is_not_found_refuses_in_one_line(node, registry, tmp_path):
    bos = workload_bos()
    parent, child = tmp_path / "ckpt" / "p", tmp_path / "ckpt" / "c"
    node.dump(parent, bos)
    node.dump(child, [bos[0], os.urandom(len(bos[1]))], "--parent", str(parent))
    moved = tmp_path / "moved"
    parent.rename(moved)
    r = vramctl("push", str(child), f"{registry.host}/jobs/orphan:1", "--plain-http")
    assert r.returncode == 1 and r.stderr.count("\n") == 1 and "--parent" in r.stderr
    assert not blob_writes(registry)  # refused before anything went up
    ok(vramctl("push", str(child), f"{registry.host}/jobs/orphan:1", "--plain-http", "--json", "--parent",
               str(moved)))


def test_restore_from_the_reference_on_a_node_with_other_gpus_maps_them(registry, tmp_path, run_dir):
    """Dumped on one machine's GPUs, restored from the registry on another's (the KFD topology fixtures of
    tests/test_topology_restore.py): the daemon maps the image's GPUs onto its own, bytes exact."""
    from helpers import ROOT
    fixtures = os.path.join(ROOT, "tests", "fixtures", "topology")

    def config(name: str) -> str:
        p = tmp_path / f"{name}.toml"
        p.write_text(f"topology_root = {os.path.join(fixtures, name, 'nodes')!r}\n")
        return str(p)
    from helpers import memfd, open_dir

    from vramd.client import SESSION_DUMP, Client, ClientBo
    from vramd.topology import parse_topology
    gpu = parse_topology(os.path.join(fixtures, "2gpu-pcie", "nodes")).gpus[0].gpu_id
    bos = workload_bos()
    img = tmp_path / "image"
    img.mkdir()
    dfd, srcs = open_dir(img), [memfd(b) for b in bos]
    with Node(run_dir, tmp_path / "n1", "--config", config("2gpu-pcie")) as n, Client(n.daemon.socket) as c:
        s = c.open_session(SESSION_DUMP, dfd)
        c.add_bos(s.token, [ClientBo(i, fd, size=len(b), gpu_id=gpu) for i, (fd, b) in enumerate(zip(srcs, bos), 1)])
        c.start(s.token)
        c.wait(s.token)
    for fd in [dfd, *srcs]:
        os.close(fd)
    ref = f"{registry.host}/jobs/moved:1"
    ok(vramctl("push", str(img), ref, "--plain-http", "--json"))
    with Node(run_dir, tmp_path / "n2", "--config", config("2gpu-pcie-host2")) as other:
        out = other.restore(f"oci://{ref}", [len(b) for b in bos], "--plain-http", "--cache", str(tmp_path / "c"))
        m = other.daemon.expect_log(r"GPU map \(image -> here\): (.*)")
        a, b = m.group(1).strip().split(", ")[0].split("->")
        assert a != b  # the image's GPU is not this machine's: mapped
    assert out == bos


def test_a_format_v1_image_travels_byte_for_byte(registry, tmp_path):
    """The version 1 image the repository keeps (records bound per BO, holes as payload-less records)."""
    import shutil

    from helpers import ROOT
    src = tmp_path / "v1"
    shutil.copytree(os.path.join(ROOT, "tests", "fixtures", "image-v1"), src)
    ref = f"{registry.host}/old/v1:1"
    ok(vramctl("push", str(src), ref, "--plain-http", "--json"))
    ok(vramctl("pull", ref, str(tmp_path / "pulled"), "--plain-http", "--json"))
    assert files_of(tmp_path / "pulled") == files_of(src)
    assert vramctl("verify", str(tmp_path / "pulled")).returncode == 0


@pytest.mark.parametrize("key", ["org.vramd.image.parent", "org.vramd.image.id", "org.vramd.image.gpus",
                                 "org.vramd.image.bo-bytes", "org.opencontainers.image.created"])
def test_an_annotation_vramctl_computes_is_refused_and_nothing_is_pushed(node, registry, tmp_path, key):
    """A caller's value for an annotation that describes the image would be a lie (a parent it does not have
    makes the artifact unpullable): refused in one line before a request is made."""
    img = tmp_path / "image"
    node.dump(img, workload_bos())
    r = vramctl("push", str(img), f"{registry.host}/jobs/ann:1", "--plain-http", "--annotation",
                f"{key}=sha256:{'0' * 64}")
    last = r.stderr.splitlines()[-1]  # a usage error (exit 2): the usage, then the one line naming the key
    assert r.returncode == 2 and last.startswith("vramctl: error: ") and key in last, r.stderr
    assert not [a for a in registry.access_log() if a.path.startswith("/v2/jobs/")]
