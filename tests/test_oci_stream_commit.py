"""vramctl restore --image oci://'s cache entry around the session (vramd.oci.stream): a commit that fails after
the BOs were restored is one warning and the restore stands; a staging directory that cannot be removed never
replaces the session's own error; a warm restore holds the entry's directory locked (shared), so a concurrent
--refresh-cache waits for it instead of removing the entry it reads.  Real registry, daemon, vramctl processes;
the concurrent restores are ordered by what /proc/locks shows, not by sleeps.
"""
from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from helpers import vramctl
from oci_helpers import Node, user_cache  # noqa: F401 (user_cache: autouse)
from test_oci_stream import HoldingProxy, MiB, _blob, _entries, _pushed, _restore, _targets


@pytest.fixture
def node(run_dir, tmp_path):
    with Node(run_dir, tmp_path / "node1") as n:
        yield n


def test_a_commit_that_fails_after_the_restore_is_a_warning_and_keeps_no_entry(node, registry, tmp_path):
    """Where the entry would go is a directory that is no image and holds a directory of its own (vramctl removes
    only files there): the commit cannot put the entry there.  The BOs are restored all the same: exit 0, one
    warning naming the entry and why, no staging directory left, the directory in the way untouched."""
    bos, ref = _pushed(node, registry, tmp_path, "uncommitted")
    cache = tmp_path / "cache"
    assert node.restore(f"oci://{ref}", [len(b) for b in bos], "--plain-http", "--cache", str(cache)) == bos
    [entry] = _entries(cache)
    for f in entry.iterdir():
        f.unlink()
    (entry / "kept-by-hand").mkdir()
    r = vramctl("restore", "--pid", str(os.getpid()), "--image", f"oci://{ref}", *_targets(node, bos),
                "--plain-http", "--cache", str(cache), "--json", socket=node.daemon.socket)
    assert r.returncode == 0, r.stderr
    assert (node.dir / "out1.bin").read_bytes() == bos[0]
    out = json.loads(r.stdout)
    assert out["ok"] and not out["warm"] and out["stats"]["blobs_downloaded"] >= 8, out
    assert r.stderr.count("\n") == 1 and r.stderr.startswith("vramctl: warning: "), r.stderr
    assert f"the cache entry {entry} is not kept" in r.stderr and "kept-by-hand" in r.stderr, r.stderr
    assert _entries(cache) == [entry] and list(entry.iterdir()) == [entry / "kept-by-hand"]


def test_a_rename_refused_at_the_commit_is_a_warning_and_the_restore_stands(node, registry, tmp_path):
    """The staging directory is made immutable (chattr +i: its files are still written, but it cannot be renamed
    nor emptied) while a blob is held: the commit's rename fails (EPERM), after the BOs were restored: exit 0,
    a warning naming the entry and why, and one that the staging directory could not be removed."""
    bos, ref = _pushed(node, registry, tmp_path, "immutable")
    proxy = HoldingProxy(registry.url, _blob(bos[0][7 * MiB:]))  # BO 1's last chunk's payload
    cache = tmp_path / "cache"
    staging = None
    try:
        p = _restore(node, bos, ref.replace(registry.host, proxy.host), "--cache", str(cache))
        assert proxy.held.wait(60), "the last payload was never asked for"
        [staging] = _entries(cache)
        if subprocess.run(["chattr", "+i", str(staging)], capture_output=True).returncode != 0:
            p.kill()
            p.wait()
            pytest.skip("chattr +i is refused here (it needs CAP_LINUX_IMMUTABLE and ext4 or tmpfs)")
        proxy.release.set()
        out, err = p.communicate(timeout=120)
    finally:
        proxy.close()
        if staging is not None:
            subprocess.run(["chattr", "-i", str(staging)], capture_output=True)
    assert p.returncode == 0, err
    assert (node.dir / "out1.bin").read_bytes() == bos[0] and json.loads(out)["ok"]
    entry = staging.with_name("image")
    lines = err.splitlines()
    assert len(lines) == 2 and all(line.startswith("vramctl: warning: ") for line in lines), err
    assert f"the cache entry {entry} is not kept: " in lines[0] and os.strerror(errno.EPERM) in lines[0], err
    assert f"cannot remove {staging}" in lines[1], err
    assert not entry.exists()


def test_a_staging_directory_that_cannot_be_removed_never_replaces_the_first_error(node, registry, tmp_path):
    """The registry stops mid-restore while the staging directory holds a directory vramctl does not remove:
    the error reported is still the registry's, the cleanup's failure one warning line before it."""
    bos, ref = _pushed(node, registry, tmp_path, "stuck")
    third = _blob(bos[0][2 * MiB:3 * MiB])
    proxy = HoldingProxy(registry.url, third)
    cache = tmp_path / "cache"
    try:
        p = _restore(node, bos, ref.replace(registry.host, proxy.host), "--cache", str(cache), "--concurrency", "1")
        assert proxy.held.wait(60), "the third payload was never asked for"
        [staging] = _entries(cache)
        assert staging.name == "image.partial"
        (staging / "not-vramctls").mkdir()
        registry.stop()
        proxy.release.set()
        out, err = p.communicate(timeout=120)
    finally:
        proxy.close()
    assert p.returncode == 1 and err.count("\n") == 2, err
    e = json.loads(out)["error"]
    assert e["code"] == "REGISTRY_ERROR" and third in e["message"], e
    warning = err.splitlines()[0]
    assert warning.startswith(f"vramctl: warning: cannot remove {staging}") and "not-vramctls" in warning, err


def _flocks(path: Path) -> list[tuple[int, str, bool]]:
    """(pid, READ or WRITE, waiting) of each flock of the directory `path`, as /proc/locks lists them."""
    ino, out = path.stat().st_ino, []
    with open("/proc/locks") as f:
        for line in f:
            fields = line.split()
            waiting = fields[1] == "->"
            if waiting:
                del fields[1]
            if fields[1] == "FLOCK" and int(fields[5].rsplit(":", 1)[1]) == ino:
                out.append((int(fields[4]), fields[3], waiting))
    return out


def _until(what: str, cond, *procs) -> None:
    deadline = time.monotonic() + 60
    while not cond():
        assert time.monotonic() < deadline, f"never: {what}"
        assert all(p.poll() is None for p in procs), f"a restore ended before {what}: {[p.poll() for p in procs]}"
        time.sleep(0.05)  # how often to look: what is waited for is the lock /proc/locks shows


def test_a_refresh_waits_for_a_warm_restore_reading_the_entry(node, registry, tmp_path):
    """The daemon is stopped (SIGSTOP), so a warm restore stays in its session; it must hold the entry's
    directory locked (shared) meanwhile, and a --refresh-cache restore of the same reference waits for that lock
    (an exclusive one), leaving the entry whole.  Then the daemon goes on: both restores succeed, byte-exact."""
    bos, ref = _pushed(node, registry, tmp_path, "shared")
    cache = tmp_path / "cache"
    assert node.restore(f"oci://{ref}", [len(b) for b in bos], "--plain-http", "--cache", str(cache)) == bos
    [entry] = _entries(cache)
    files = sorted(p.name for p in entry.iterdir())
    procs = []
    os.kill(node.daemon.pid, signal.SIGSTOP)
    try:
        warm = _restore(node, bos, ref, "--cache", str(cache))
        procs.append(warm)
        _until("the warm restore holds the entry's directory locked",
               lambda: (warm.pid, "READ", False) in _flocks(entry.parent), warm)
        refresh = _restore(node, bos, ref, "--cache", str(cache), "--refresh-cache")
        procs.append(refresh)
        _until("the refresh waits for the entry's lock",
               lambda: (refresh.pid, "WRITE", True) in _flocks(entry.parent), warm, refresh)
        assert sorted(p.name for p in entry.iterdir()) == files  # the entry being read is still whole
    except BaseException:
        for p in procs:
            p.kill()
            p.wait()
        raise
    finally:
        os.kill(node.daemon.pid, signal.SIGCONT)
    (wout, werr), (rout, rerr) = (p.communicate(timeout=120) for p in procs)
    assert warm.returncode == 0 and refresh.returncode == 0, (werr, rerr)
    assert json.loads(wout)["warm"] and not json.loads(rout)["warm"]
    assert (node.dir / "out1.bin").read_bytes() == bos[0]
    assert sorted(p.name for p in entry.iterdir()) == files
