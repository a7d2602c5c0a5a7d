"""A CRIU restore that streams its BO contents from a registry (patch 0007, `vramctl pull --serve`;
docs/criu-integration.md, "Restoring from a registry"), inside a real CRIU with the patched amdgpu plugin on the
KFD and SDMA models, against the real registry (tests/registry_fixtures.py).  THIS RUNS ON MODELS, NOT A GPU.

The flow under test is the documented one: after `criu dump`, each `amdgpu-vramd-<id>/` is pushed; on the
restoring node the serve loop (`vramctl pull --serve REPO:TAG-<id> IMAGES/amdgpu-vramd-<id>` per KFD file,
each returning once it listens), then `criu restore` with KFD_VRAMD=1.  A proxy in front of the registry holds
one payload blob back until the daemon's restore sessions have restored bytes: a restore that waited for the
download to end never gets there.
"""
from __future__ import annotations

import os
import re
import select
import shlex
import shutil
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import test_kfd_vramd_plugin as base
from kfd_harness import REPO
from test_kfd_stock_plugin import MIB, RESTORE, TOPO_A
from test_kfd_vramd_plugin import running_daemon
from test_kfd_vramd_registry import CHAIN2, DOC, EXPECT_TREE, PUSH_LOOP, TREE, files_of, kfd_ids, vramctl

pytestmark = base.pytestmark
plugins, model, case = base.plugins, base.model, base.case

# docs/criu-integration.md's serve loop, as written there (the test asserts it)
SERVE_LOOP = """for f in IMAGES/amdgpu-kfd-*.img; do
    id=${f##*/amdgpu-kfd-}; id=${id%.img}
    vramctl pull --serve "HOST/REPO:TAG-$id" "IMAGES/amdgpu-vramd-$id" || exit 1   # returns once it listens
done
"""
SERVING = re.compile(r"^serving (\S+) \(sha256:[0-9a-f]{64}\) into (\S+) \(pid (\d+)\): ")


def loop(text: str, img: str, ref: str, opts: list[str], errlog: str) -> subprocess.CompletedProcess[str]:
    """A documented loop, run by bash as written there; stderr to `errlog` (the servers outlive the loop)."""
    doc = DOC.read_text()
    assert text in doc or textwrap.indent(text, "   ") in doc, "docs/criu-integration.md's loop changed"
    script = (f"set -u\nvramctl() {{ {shlex.quote(sys.executable)} -m vramd.cli \"$@\" {shlex.join(opts)}; }}\n"
              + text.replace("IMAGES", shlex.quote(img)).replace("HOST/REPO:TAG", ref))
    with open(errlog, "a") as err:
        return subprocess.run(["bash", "-c", script], stdout=subprocess.PIPE, stderr=err, text=True, cwd=str(REPO),
                              timeout=600)


def wait_servers(pids: list[int], timeout: float = 120) -> None:
    """Until each server (reparented to this test process, the harness's subreaper) has ended; reaped here, so
    the harness's reaper never meets their zombies."""
    deadline = time.monotonic() + timeout
    for pid in pids:
        try:
            fd = os.pidfd_open(pid)
        except ProcessLookupError:
            continue
        try:
            assert select.select([fd], [], [], max(0.0, deadline - time.monotonic()))[0], f"server {pid} runs on"
        finally:
            os.close(fd)
        try:
            os.waitpid(pid, 0)
        except ChildProcessError:
            pass


def restored_while_held(daemon_socket: str, done: threading.Event, at_least: int = 1) -> int:
    """The bytes the daemon's restore sessions have restored, once at least `at_least` (each look is a round
    trip to the daemon: the caller holds a blob back until then, which a restore waiting for its download's end
    never reaches, so this fails at the deadline)."""
    from vramd.client import Client
    from vramd.pb import rpc_pb2 as rpc

    deadline, got = time.monotonic() + 120, 0
    with Client(daemon_socket) as c:
        while got < at_least:
            assert time.monotonic() < deadline and not done.is_set(), "no byte restored while a blob is held"
            got = sum(s.progress.bytes_done for s in c.sessions() if s.kind == rpc.SESSION_RESTORE)
    return got


def dump_push(case, plugins, registry, repo: str) -> tuple[str, list[str], dict[str, dict[str, bytes]], object]:
    """The two-process tree dumped through vramd, pushed by the documented loop, its vramd images removed."""
    case.use(plugins["vramd"])
    a = case.state("state-a", TOPO_A)
    img = os.path.join(case.work, "img")
    with running_daemon() as d:
        dumped = case.run(TREE, a, TOPO_A, gpus=2, extra=case.env(d.socket, KFD_VRAMD="1"))
        assert dumped["dump"] == "0", case.log("dump.log")[-3000:]
        assert dumped["checks"] == EXPECT_TREE
    ids = kfd_ids(img)
    assert len(ids) == 2 and case.vramd_dirs() == [f"amdgpu-vramd-{i}" for i in ids], case.img()
    r = subprocess.run(["bash", "-c", f"set -u\nvramctl() {{ {shlex.quote(sys.executable)} -m vramd.cli \"$@\" "
                        f"--plain-http; }}\n" + PUSH_LOOP.replace("IMAGES", shlex.quote(img))
                        .replace("HOST/REPO:TAG", f"{registry.host}/{repo}:1")],
                       capture_output=True, text=True, cwd=str(REPO), timeout=600)
    assert r.returncode == 0, r.stderr
    kept = {}
    for i in ids:
        vdir = os.path.join(img, f"amdgpu-vramd-{i}")
        kept[i] = files_of(vdir)
        shutil.rmtree(vdir)
    return img, ids, kept, a


def restore_served(case, registry, repo: str, img: str, ids: list[str], a, tmp_path, hold: str,
                   mangle=None) -> tuple[dict[str, str], str, list[int], int]:
    """The serve loop through a proxy holding blob `hold` (`mangle(registry)` first), then `criu restore` with
    KFD_VRAMD=1 on another daemon, in a thread; the blob released once the daemon restored bytes.  (criu's
    result, the servers' stderr, their pids, the bytes restored while the blob was held.)"""
    from test_oci_stream import HoldingProxy

    if mangle is not None:
        mangle(registry)
    errlog = str(tmp_path / "serve.err")
    proxy = HoldingProxy(registry.url, hold)
    try:
        with running_daemon() as d:
            r = loop(SERVE_LOOP, img, f"{proxy.host}/{repo}:1", ["--plain-http"], errlog)
            assert r.returncode == 0, Path(errlog).read_text()
            lines = r.stdout.splitlines()
            served = [SERVING.match(ln) for ln in lines]
            assert all(served) and [m[2] for m in served if m] == [f"{img}/amdgpu-vramd-{i}" for i in ids], r.stdout
            pids = [int(m[3]) for m in served if m]
            result: dict[str, dict[str, str]] = {}
            done = threading.Event()

            def run() -> None:
                try:
                    result["r"] = case.run(RESTORE, a, TOPO_A, extra=case.env(d.socket, KFD_VRAMD="1"))
                finally:
                    done.set()
            t = threading.Thread(target=run, daemon=True)
            t.start()
            try:
                assert proxy.held.wait(120), "the held blob was never asked for"
                early = restored_while_held(d.socket, done)
            finally:
                proxy.release.set()
                t.join(600)
            wait_servers(pids)
    finally:
        proxy.close()
    return result["r"], Path(errlog).read_text(), pids, early


def _layers(registry, repo: str, tag: str) -> list[str]:
    from test_oci_stream import _layers as layers
    return [layer["digest"] for layer in layers(registry, repo, tag)]


def test_a_tree_restored_while_its_vramd_images_download(case, plugins, registry, tmp_path):
    """Both images served by the documented loop (each command back once it listens, its directory laid out),
    `criu restore` with KFD_VRAMD=1: each restored task streams from its server (the plugin's line), the daemon
    restores bytes while a payload blob of the first image is still held back, and once it is released the
    tree is byte-exact; each server ends leaving the image `vramctl pull` would have made, nothing on stderr."""
    img, ids, kept, a = dump_push(case, plugins, registry, "stream/ok")
    held = _layers(registry, "stream/ok", f"1-{ids[0]}")[-1]
    restored, served_err, _pids, early = restore_served(case, registry, "stream/ok", img, ids, a, tmp_path, held)
    log = case.log("restore.log")
    assert restored["restore"] == "0", log[-3000:]
    assert restored["checks"] == EXPECT_TREE
    assert early > 0
    streamed = re.findall(r" amdgpu_plugin: vramd: (amdgpu-vramd-\d+)/ streams from vramctl pull --serve "
                          r"\(pid \d+\)\n", log)
    assert sorted(streamed) == [f"amdgpu-vramd-{i}" for i in ids], log[-3000:]
    assert served_err == "", served_err
    for i in ids:
        assert files_of(os.path.join(img, f"amdgpu-vramd-{i}")) == kept[i]


def test_a_blob_failing_its_digest_fails_the_restore_and_no_task_runs_on(case, plugins, registry, tmp_path):
    """The first image's held blob damaged in the registry's storage: once released, its server fails
    (DIGEST_MISMATCH on stderr, its directory removed) and ends the supply, the daemon fails the session with
    TRUNCATED_DATA, and `criu restore` fails with no task left: never a task running on unfilled BOs."""
    img, ids, _kept, a = dump_push(case, plugins, registry, "stream/bad")
    held = _layers(registry, "stream/bad", f"1-{ids[0]}")[-1]

    def damage(reg) -> None:
        data = reg.blob_data(held)
        raw = bytearray(data.read_bytes())
        raw[len(raw) // 2] ^= 0xFF
        data.write_bytes(raw)
    restored, served_err, _pids, _early = restore_served(case, registry, "stream/bad", img, ids, a, tmp_path, held,
                                                         damage)
    log = case.log("restore.log")
    assert restored["restore"] != "0" and restored["alive"] == "no", log[-3000:]
    assert "TRUNCATED_DATA" in log and "Restoring FAILED." in log, log[-3000:]
    assert re.fullmatch(r"vramctl: DIGEST_MISMATCH: .*\n", served_err), served_err
    assert not os.path.exists(os.path.join(img, f"amdgpu-vramd-{ids[0]}"))


def test_a_server_killed_outright_fails_the_restore_naming_its_socket(case, plugins, registry, tmp_path):
    """A server SIGKILLed once it listens leaves its directory and socket: the restored task's connection is
    refused, the plugin names the socket, and `criu restore` fails with no task left (the unfilled files are
    never restored as BO contents)."""
    from test_kfd_stock_plugin import DUMP

    case.use(plugins["vramd"])
    a = case.state("state-a", TOPO_A)
    img = os.path.join(case.work, "img")
    with running_daemon() as d:
        env = case.env(d.socket, KFD_VRAMD="1")
        dumped = case.run(DUMP, a, TOPO_A, gpus=1, extra=env)
        assert dumped["dump"] == "0", case.log("dump.log")[-3000:]
        (i,) = kfd_ids(img)
        vdir = os.path.join(img, f"amdgpu-vramd-{i}")
        r = subprocess.run([sys.executable, "-m", "vramd.cli", "push", vdir, f"{registry.host}/stream/killed:1-{i}",
                            "--plain-http"], capture_output=True, text=True, cwd=str(REPO), timeout=300)
        assert r.returncode == 0, r.stderr
        shutil.rmtree(vdir)
        r = loop(SERVE_LOOP, img, f"{registry.host}/stream/killed:1", ["--plain-http"], str(tmp_path / "serve.err"))
        m = SERVING.match(r.stdout)
        assert r.returncode == 0 and m, r.stdout
        pid = int(m[3])
        os.kill(pid, 9)
        wait_servers([pid])
        assert os.path.exists(os.path.join(vdir, ".vramd-supply.sock"))
        restored = case.run(RESTORE, a, TOPO_A, extra=env)
    log = case.log("restore.log")
    assert restored["restore"] != "0" and restored["alive"] == "no", log[-3000:]
    assert (f"vramd: amdgpu-vramd-{i}/ is being served (.vramd-supply.sock) but nothing answers there: did vramctl "
            "pull --serve fail? see its output: Connection refused") in log, log[-3000:]
    assert "Restoring FAILED." in log


def test_a_served_directory_its_server_does_not_own_is_refused(case, plugins, registry, tmp_path):
    """The directory a root server fills handed to uid 65534 (as a root service's socket linked, or swapped as a
    symlink, into a directory another uid controls would be): who answers is root, as before, but not the
    directory's owner, so the restored task refuses the connection, names the uids, and `criu restore` fails with
    no task left; the server, whose connection came and went, still ends with the image whole."""
    from test_kfd_stock_plugin import DUMP

    case.use(plugins["vramd"])
    a = case.state("state-a", TOPO_A)
    img = os.path.join(case.work, "img")
    with running_daemon() as d:
        env = case.env(d.socket, KFD_VRAMD="1")
        dumped = case.run(DUMP, a, TOPO_A, gpus=1, extra=env)
        assert dumped["dump"] == "0", case.log("dump.log")[-3000:]
        (i,) = kfd_ids(img)
        vdir = os.path.join(img, f"amdgpu-vramd-{i}")
        kept = files_of(vdir)
        r = subprocess.run([sys.executable, "-m", "vramd.cli", "push", vdir, f"{registry.host}/stream/owner:1-{i}",
                            "--plain-http"], capture_output=True, text=True, cwd=str(REPO), timeout=300)
        assert r.returncode == 0, r.stderr
        shutil.rmtree(vdir)
        errlog = tmp_path / "serve.err"
        r = loop(SERVE_LOOP, img, f"{registry.host}/stream/owner:1", ["--plain-http"], str(errlog))
        m = SERVING.match(r.stdout)
        assert r.returncode == 0 and m, r.stdout
        os.chown(vdir, 65534, 65534)
        restored = case.run(RESTORE, a, TOPO_A, extra=env)
        wait_servers([int(m[3])])
    log = case.log("restore.log")
    assert restored["restore"] != "0" and restored["alive"] == "no", log[-3000:]
    assert (f"vramd: amdgpu-vramd-{i}/.vramd-supply.sock is served by uid 0, the socket file's owner is 0, the "
            "directory's 65534: only the directory's owner may serve it, and only root or criu's uid 0") in log, \
        log[-3000:]
    assert "Restoring FAILED." in log
    assert errlog.read_text() == ""
    assert files_of(vdir) == kept


def test_an_incremental_image_served_restores_through_the_parent_link_the_serve_makes(case, plugins, registry,
                                                                                     tmp_path):
    """An incremental vramd image (the plugin's `parent` link to the 1st dump's) pushed, removed, and served
    back alone into the 2nd checkpoint's directory: `vramctl pull --serve` pulls the parent whole beside it as
    amdgpu-vramd-<id>.parent-1 and makes amdgpu-vramd-<id>/parent a link to it before it listens, so `criu
    restore` streams the child through it, byte-exact (was: no link, PARENT_MISSING)."""
    case.use(plugins["vramd"])
    a = case.state("state-a", TOPO_A)
    img = os.path.join(case.work, "img")
    with running_daemon() as d:
        env = case.env(d.socket, KFD_VRAMD="1")
        r = case.run(CHAIN2, a, TOPO_A, gpus=2, extra=env)
        assert (r.get("dump1"), r.get("dump2")) == ("0", "0"), r["stdout"] + r["stderr"]
        (i,) = kfd_ids(os.path.join(img, "2"))
        vdir = os.path.join(img, "2", f"amdgpu-vramd-{i}")
        ref = f"{registry.host}/stream/chain:2-{i}"
        p = vramctl("push", vdir, ref, "--plain-http")
        assert p.returncode == 0, p.stderr
        shutil.rmtree(os.path.join(img, "1"))
        shutil.rmtree(vdir)
        errlog = tmp_path / "serve.err"
        with open(errlog, "w") as err:
            s = subprocess.run([sys.executable, "-m", "vramd.cli", "pull", "--serve", ref, vdir, "--plain-http"],
                               stdout=subprocess.PIPE, stderr=err, text=True, cwd=str(REPO), timeout=300)
        m = SERVING.match(s.stdout)
        assert s.returncode == 0 and m, s.stdout + errlog.read_text()
        assert os.readlink(os.path.join(vdir, "parent")) == f"../amdgpu-vramd-{i}.parent-1"
        r = case.run(RESTORE.replace("-D $W/img ", "-D $W/img/2 "), a, TOPO_A, extra=env)
        wait_servers([int(m[3])])
    log = case.log(os.path.join("2", "restore.log"))
    assert r["restore"] == "0", log[-3000:]
    assert r["checks"] == f"ok 14 {2 * MIB << 20}\n", r["checks"]
    assert f"vramd: amdgpu-vramd-{i}/ is incremental, restored through 1 parents" in log, log[-3000:]
    assert re.search(rf" amdgpu_plugin: vramd: amdgpu-vramd-{i}/ streams from vramctl pull --serve", log), log[-3000:]
    assert errlog.read_text() == ""
