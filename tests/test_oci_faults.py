"""Faults between vramctl and the real registry: a registry that dies in a push (pushing again completes it),
a payload damaged in the registry's storage (refused by digest, naming the BO; nothing restored), a registry
that is down at restore, a full registry; and skopeo, an independent client, copying the artifact unchanged
(inspect --raw, copy to an oci: layout and back to another repository) with vramd restoring the copy."""
from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import ROOT, vramctl
from oci_helpers import Node, blob_writes, files_of, ok, user_cache, workload_bos  # noqa: F401 (user_cache: autouse)


@pytest.fixture
def node(run_dir, tmp_path):
    with Node(run_dir, tmp_path / "node1") as n:
        yield n


def test_registry_killed_mid_push_then_push_again_completes_it(node, registry, tmp_path):
    bos = [os.urandom(24 << 20)]  # 24 payloads of 1 MiB (the test daemon's chunk size)
    img = tmp_path / "image"
    node.dump(img, bos, "--compress", "none")
    ref = f"{registry.host}/jobs/resume:1"
    push = subprocess.Popen([sys.executable, "-m", "vramd.cli", "push", str(img), ref, "--plain-http",
                             "--concurrency", "1", "--json"], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    # each access_log() is a round trip to the registry that returns once its log holds every request answered
    # before it (vramd/testing/registry.py, settle): the loop waits on the registry, not on a clock
    while len([r for r in blob_writes(registry) if r.status == 201]) < 5:  # the registry has stored 5 blobs
        assert push.poll() is None and time.monotonic() < deadline, "the push ended before 5 uploads"
    registry.stop(signal.SIGKILL)
    _out, err = push.communicate(timeout=120)
    assert push.returncode == 1 and "REGISTRY_ERROR" in err and err.count("\n") == 1, err
    before = len([r for r in blob_writes(registry) if r.status == 201])
    registry.start()
    r = vramctl("pull", ref, str(tmp_path / "none"), "--plain-http")
    assert r.returncode == 1 and "MANIFEST_UNKNOWN" in r.stderr  # the tag was never written: no half artifact
    again = ok(vramctl("push", str(img), ref, "--plain-http", "--json"))
    st = again["stats"]
    assert st["blobs_present"] >= before >= 5  # what the first push stored is not sent again
    assert st["blobs_present"] + st["blobs_uploaded"] == 2 + 24
    assert st["bytes_uploaded"] <= (24 - (before - 2)) << 20  # (the first two blobs: config and skeleton)
    pulled = tmp_path / "pulled"
    ok(vramctl("pull", ref, str(pulled), "--plain-http", "--json"))
    assert files_of(pulled) == files_of(img)


def test_a_payload_damaged_in_the_registry_is_refused_naming_the_bo(node, registry, tmp_path, run_dir):
    bos = workload_bos()
    img = tmp_path / "image"
    node.dump(img, bos, "--compress", "none")  # raw payloads: a chunk's blob digest is the sha256 of its bytes
    ref = f"{registry.host}/jobs/damaged:1"
    ok(vramctl("push", str(img), ref, "--plain-http", "--json"))
    own = bos[1][2 << 20:3 << 20]  # BO 2's chunk at 2 MiB, stored by no other chunk
    blob = registry.blob_data("sha256:" + hashlib.sha256(own).hexdigest())
    data = bytearray(blob.read_bytes())
    data[12345] ^= 0x01
    blob.write_bytes(data)

    dest = tmp_path / "pulled"
    r = vramctl("pull", ref, str(dest), "--plain-http", "--json")
    assert r.returncode == 1
    e = json.loads(r.stdout)["error"]
    assert e["code"] == "DIGEST_MISMATCH" and e["bo_id"] == 2 and e["offset"] == 2 << 20, e
    assert not dest.exists()  # nothing of the image was left

    # restore from the reference (streamed): the same refusal, before any byte of the damaged blob reaches a BO
    other = Node(run_dir, tmp_path / "node2")
    with other:
        targets = [other.dir / "out1.bin", other.dir / "out2.bin"]
        for t, b in zip(targets, bos, strict=True):
            t.write_bytes(b"\x5a" * len(b))
        r = vramctl("restore", "--pid", str(os.getpid()), "--image", f"oci://{ref}", "--plain-http",
                    "--cache", str(tmp_path / "cache"), "--bo-file", f"1={targets[0]}", "--bo-file",
                    f"2={targets[1]}", "--json", socket=other.daemon.socket)
        assert r.returncode == 1 and json.loads(r.stdout)["error"]["code"] == "DIGEST_MISMATCH"
        assert "restored" not in r.stdout.replace("nothing was restored", "")
        assert targets[1].read_bytes()[2 << 20:3 << 20] == b"\x5a" * (1 << 20)  # other blobs' chunks may be
        st = json.loads(vramctl("sessions", "--json", socket=other.daemon.socket).stdout)
        assert not st.get("sessions")  # no restore was started, none reported


def test_registry_down_at_restore_is_a_typed_error_and_restores_nothing(node, registry, tmp_path):
    bos = workload_bos()
    img = tmp_path / "image"
    node.dump(img, bos)
    ref = f"{registry.host}/jobs/down:1"
    ok(vramctl("push", str(img), ref, "--plain-http", "--json"))
    registry.stop()
    target = node.dir / "out1.bin"
    target.write_bytes(bytes(len(bos[0])))
    r = vramctl("restore", "--pid", str(os.getpid()), "--image", f"oci://{ref}", "--plain-http", "--cache",
                str(tmp_path / "cache"), "--bo-file", f"1={target}", "--json", socket=node.daemon.socket)
    assert r.returncode == 1 and json.loads(r.stdout)["error"]["code"] == "REGISTRY_ERROR"
    assert r.stderr.count("\n") == 1 and registry.host in r.stderr
    assert target.read_bytes() == bytes(len(bos[0]))


def test_registry_killed_mid_restore_is_a_typed_error_and_restores_nothing(node, registry, tmp_path, run_dir):
    bos = [os.urandom(24 << 20)]
    img = tmp_path / "image"
    node.dump(img, bos, "--compress", "none")
    ref = f"{registry.host}/jobs/midrestore:1"
    ok(vramctl("push", str(img), ref, "--plain-http", "--json"))
    with Node(run_dir, tmp_path / "node2") as other:
        target = other.dir / "out1.bin"
        target.write_bytes(bytes(len(bos[0])))
        cache = tmp_path / "cache"
        restore = subprocess.Popen(
            [sys.executable, "-m", "vramd.cli", "--socket", other.daemon.socket, "restore", "--pid", str(os.getpid()),
             "--image", f"oci://{ref}", "--plain-http", "--cache", str(cache), "--concurrency", "1",
             "--bo-file", f"1={target}", "--json"], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True)
        deadline = time.monotonic() + 120
        gets = lambda: [r for r in registry.access_log() if r.method == "GET" and "/blobs/" in r.path]  # noqa: E731
        while len(gets()) < 5:  # config, skeleton and 3 payloads served (each access_log(): a round trip)
            assert restore.poll() is None and time.monotonic() < deadline, "the restore ended before 5 blobs"
        registry.stop(signal.SIGKILL)
        out, err = restore.communicate(timeout=120)
        assert restore.returncode == 1 and json.loads(out)["error"]["code"] == "REGISTRY_ERROR", err
        # streamed: chunks whose blobs came whole before the registry died may be restored; the last never came
        assert target.read_bytes()[-(1 << 20):] == bytes(1 << 20) and "restored" not in out
        assert not any(cache.rglob("manifest.vrdm"))  # and no image left in the cache to be taken for whole
        st = json.loads(vramctl("sessions", "--json", socket=other.daemon.socket).stdout)
        assert not st.get("sessions")


def test_a_full_registry_is_a_typed_error(node, make_registry, tmp_path):
    reg = make_registry(storage_limit=6 << 20)
    img = tmp_path / "image"
    node.dump(img, [os.urandom(12 << 20)], "--compress", "none")
    r = vramctl("push", str(img), f"{reg.host}/jobs/full:1", "--plain-http", "--json")
    assert r.returncode == 1
    assert json.loads(r.stdout)["error"]["code"] == "REGISTRY_FULL", r.stdout
    # pushed again into the full storage: the registry now fails the upload's start, and says so not in words
    # but as a file system error's errno (a detail with "Err": 28, ENOSPC)
    r = vramctl("push", str(img), f"{reg.host}/jobs/full:1", "--plain-http", "--json")
    assert r.returncode == 1
    assert json.loads(r.stdout)["error"]["code"] == "REGISTRY_FULL", r.stdout


def test_skopeo_copies_the_artifact_unchanged_and_vramd_restores_the_copy(node, registry, tmp_path, run_dir):
    bos = workload_bos()
    img = tmp_path / "image"
    node.dump(img, bos)
    src = f"{registry.host}/jobs/orig:1"
    digest = ok(vramctl("push", str(img), src, "--plain-http", "--json", "--annotation",
                        "org.vramd.image.pid=4242"))["digest"]
    raw = subprocess.run(["skopeo", "inspect", "--raw", "--tls-verify=false", f"docker://{src}"],
                         capture_output=True, check=True).stdout
    assert "sha256:" + hashlib.sha256(raw).hexdigest() == digest
    doc = json.loads(raw)
    assert doc["artifactType"] == "application/vnd.vramd.image.v1"
    assert doc["config"]["mediaType"].startswith("application/vnd.vramd.manifest.v")
    info = ok(vramctl("inspect", str(img), "--json"))
    ann = doc["annotations"]
    assert ann["org.vramd.image.pid"] == "4242" and ann["org.vramd.image.id"] == info["image_id"]
    assert ann["org.vramd.image.gpus"] and ann["org.opencontainers.image.created"].endswith("Z")
    layout = tmp_path / "layout"
    subprocess.run(["skopeo", "copy", "--src-tls-verify=false", f"docker://{src}", f"oci:{layout}:one"],
                   capture_output=True, check=True)
    dst = f"{registry.host}/copies/other:1"
    subprocess.run(["skopeo", "copy", "--dest-tls-verify=false", f"oci:{layout}:one", f"docker://{dst}"],
                   capture_output=True, check=True)
    raw2 = subprocess.run(["skopeo", "inspect", "--raw", "--tls-verify=false", f"docker://{dst}"],
                          capture_output=True, check=True).stdout
    assert raw2 == raw
    with Node(run_dir, tmp_path / "node2") as other:
        out = other.restore(f"oci://{dst}", [len(b) for b in bos], "--plain-http", "--cache", str(tmp_path / "c"))
    assert out == bos


# --- a push whose reads of the local image fail: one typed line, exit 1 (vramd.image.fileio.pread_exact) ---------

def _pushed_once(node, registry, tmp_path, bos):
    """An image (raw payloads) pushed once to one repository, so the user's cache holds its skeleton: a second
    push reads only the payloads another repository lacks, from data files that may have changed since."""
    img = tmp_path / "image"
    node.dump(img, bos, "--compress", "none")
    ok(vramctl("push", str(img), f"{registry.host}/jobs/first:1", "--plain-http", "--json"))
    return img


def _record(img, bo_id: int, chunk: int) -> tuple[str, int, int]:
    """(data file name, offset, length) of the record of `bo_id`'s chunk `chunk`."""
    from vramd.image.manifest import chunk_record, decode_manifest
    m = decode_manifest((img / "manifest.vrdm").read_bytes())
    bo = next(b for b in m.bos if b.id == bo_id)
    rec = chunk_record(m, bo, chunk)
    assert rec is not None
    return m.files[rec[0]].name, rec[1], rec[2]


def _failed_push(img, ref: str, *more: str) -> dict:
    r = vramctl("push", str(img), ref, "--plain-http", "--json", *more)
    assert r.returncode == 1 and r.stderr.count("\n") == 1, r.stderr
    assert "Traceback" not in r.stderr and "[Errno" not in r.stderr, r.stderr
    return json.loads(r.stdout)["error"]


def test_a_data_file_cut_short_after_its_manifest_was_read_is_truncated_data_naming_the_bo(node, registry, tmp_path):
    img = _pushed_once(node, registry, tmp_path, [os.urandom(3 << 20)])
    # the chunk whose record lies last in its data file: cut short, its payload, and no other, ends early
    chunk, (name, off, ln) = max(((i, _record(img, 1, i)) for i in range(3)), key=lambda c: c[1][1])
    data = img / name
    os.truncate(data, off + ln - 1000)
    e = _failed_push(img, f"{registry.host}/jobs/cut:1")
    assert e["code"] == "TRUNCATED_DATA" and e["bo_id"] == 1 and e["offset"] == chunk << 20, e
    assert str(data) in e["message"] and "the file ends at" in e["message"], e
    # scanned afresh (an empty cache): the file is refused before a payload is read, as shorter than committed
    e = _failed_push(img, f"{registry.host}/jobs/cut:1", "--cache", str(tmp_path / "fresh"))
    assert e["code"] == "TRUNCATED_DATA" and str(data) in e["message"] and "committed" in e["message"], e
    assert "MANIFEST_UNKNOWN" in vramctl("pull", f"{registry.host}/jobs/cut:1", str(tmp_path / "p"),
                                         "--plain-http").stderr  # no artifact was tagged


@pytest.mark.parametrize("what", ["a FIFO", "a directory"])
def test_a_data_file_replaced_by_something_else_is_refused_without_blocking(node, registry, tmp_path, what):
    img = _pushed_once(node, registry, tmp_path, [os.urandom(2 << 20)])
    data = img / _record(img, 1, 1)[0]
    data.unlink()
    if what == "a FIFO":
        os.mkfifo(data)  # nobody writes it: an open or read that blocks would hang the push (vramctl's timeout)
    else:
        data.mkdir()
    e = _failed_push(img, f"{registry.host}/jobs/swapped:1")
    assert e["code"] == "IMAGE_ERROR" and f"{data}: not a regular file" in e["message"], e


def test_eio_under_a_push_is_io_error_naming_the_file_offset_and_bo(node, registry, tmp_path):
    from test_io_errors import eio_mount
    from test_io_errors import why as fuse_missing
    if fuse_missing:
        pytest.skip(fuse_missing)
    img = tmp_path / "image"
    node.dump(img, [os.urandom(3 << 20)], "--compress", "none")
    name, off, ln = _record(img, 1, 1)  # BO 1's chunk at 1 MiB: the last 100 bytes of its record fail
    mnt = tmp_path / "mnt"
    with eio_mount(img, mnt, "--read-eio", f"{name}:{off + ln - 100}:{off + ln}"):
        e = _failed_push(mnt, f"{registry.host}/jobs/eio:1", "--cache", str(tmp_path / "cache"))
    assert e["code"] == "IO_ERROR" and e["bo_id"] == 1 and e["offset"] == 1 << 20, e
    assert f"cannot read {mnt}/{name} at 0x" in e["message"] and "Input/output error" in e["message"], e


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root: the push runs as nobody")
def test_a_cache_the_user_may_not_write_is_one_warning_and_the_push_succeeds(node, registry, tmp_path):
    """vramctl push --cache DIR as nobody, DIR root's 0755: the push succeeds, and stderr has one warning
    naming DIR and why (it used to keep nothing, silently: every push then read every payload again)."""
    import pwd
    import shutil
    import tempfile

    from vramd.testing import PythonAccess, RunAs
    base = Path(tempfile.mkdtemp(prefix="vramd-ocicache-", dir="/tmp"))
    access = PythonAccess.choose(["nobody"])
    try:
        os.chmod(base, 0o755)
        img = base / "image"
        node.dump(img, workload_bos())
        nobody = pwd.getpwnam("nobody")
        for p in [img, *img.iterdir()]:
            os.chown(p, nobody.pw_uid, nobody.pw_gid)
        cache = base / "cache"
        cache.mkdir(mode=0o755)  # root's: nobody may not make its push/ there
        who = RunAs.user("nobody", access, cwd=str(base))
        r = subprocess.run([*who.python, "-m", "vramd.cli", "push", str(img), f"{registry.host}/jobs/nocache:1",
                            "--plain-http", "--json", "--cache", str(cache)], capture_output=True, text=True,
                           timeout=120, **who.popen_kwargs())
        assert r.returncode == 0, r.stderr
        assert json.loads(r.stdout)["stats"]["blobs_uploaded"] > 2
        lines = r.stderr.splitlines()
        assert len(lines) == 1 and lines[0].startswith("vramctl: warning: "), r.stderr
        assert f"the cache directory {cache}" in lines[0] and "Permission denied" in lines[0], lines[0]
        assert os.listdir(cache) == []
    finally:
        access.close()
        shutil.rmtree(base, ignore_errors=True)


def test_eio_reading_a_parents_manifest_is_io_error_not_a_missing_parent(node, registry, tmp_path):
    from test_io_errors import eio_mount
    from test_io_errors import why as fuse_missing
    if fuse_missing:
        pytest.skip(fuse_missing)
    parent, child = tmp_path / "p", tmp_path / "c"
    bos = workload_bos()
    node.dump(parent, bos)
    node.dump(child, [bos[0], os.urandom(len(bos[1]))], "--parent", str(parent))
    mnt = tmp_path / "mnt"
    with eio_mount(parent, mnt, "--read-eio", "manifest.vrdm:0:1"):
        e = _failed_push(child, f"{registry.host}/jobs/eioparent:1", "--parent", str(mnt))
    assert e["code"] == "IO_ERROR" and f"{mnt}/manifest.vrdm" in e["message"], e
