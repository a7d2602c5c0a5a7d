"""vramctl as a user runs it: a real daemon, real processes, real files, exit codes."""
from __future__ import annotations

import json
import os
import subprocess
import sys

from helpers import ROOT

from vramd.testing import Workload, blank_spec_like

SPEC = [{"size": (2 << 20) + 5, "fill": "random", "seed": 7}, {"size": 64 << 10, "fill": "zero"},
        {"size": 4097, "fill": "pattern", "seed": 8, "skew": 13}]


def vramctl(*args, socket=None) -> subprocess.CompletedProcess:
    pre = ["--socket", socket] if socket else []
    return subprocess.run([sys.executable, "-m", "vramd.cli", *pre, *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)


def test_dump_restore_verify_inspect(daemon, tmp_path):
    img = tmp_path / "img"
    bo_file = tmp_path / "bo.bin"
    file_bytes = os.urandom(300_001)
    bo_file.write_bytes(file_bytes)
    with Workload(SPEC) as w:
        digests = w.digests()
        ranges = []
        for r in w.regions:  # hex addresses, lengths with suffixes where they fit
            length = f"{r['size'] // 1024}K" if r["size"] % 1024 == 0 else str(r["size"])
            ranges += ["--range", f"{r['addr']:#x}:{length}"]
        r = vramctl("dump", "--pid", str(w.pid), *ranges, "--bo-file", f"{bo_file}:0x1:300000", "--image", str(img),
                    "--compress", "zstd:3", "--json", socket=daemon.socket)
        assert r.returncode == 0, r.stderr
        out = json.loads(r.stdout)
        assert out["ok"] and out["state"] == "done"
        assert out["image"]["bo_count"] == 4
        assert out["progress"]["bytes_done"] == sum(x["size"] for x in SPEC) + 300_000

    r = vramctl("inspect", str(img), "--json")
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout)
    assert info["compression"] == "zstd:3"
    want = [("procmem", x["size"]) for x in SPEC] + [("mmap", 300_000)]
    assert [(b["source"], b["size"]) for b in info["bos"]] == want
    assert info["bos"][3]["name"] == str(bo_file) and info["bos"][3]["source_offset"] == 1
    assert vramctl("verify", str(img)).returncode == 0

    bo_file.write_bytes(b"\0" * len(file_bytes))
    target = tmp_path / "target.bin"
    target.write_bytes(b"\0" * len(file_bytes))
    with Workload(blank_spec_like(w.regions)) as w2:
        # the file BO's recorded path is not opened unless asked: the caller names where it goes
        r = vramctl("restore", "--pid", str(w2.pid), "--image", str(img), socket=daemon.socket)
        assert r.returncode == 1 and "--bo-file 4=PATH" in r.stderr, r.stderr
        r = vramctl("restore", "--pid", str(w2.pid), "--image", str(img), "--bo-file", f"4={target}",
                    socket=daemon.socket)
        assert r.returncode == 0, r.stderr
        assert "restored 4 BO(s)" in r.stdout
        assert w2.digests() == digests
    assert target.read_bytes() == b"\0" + file_bytes[1:300_001]
    assert bo_file.read_bytes() == b"\0" * len(file_bytes)  # untouched: the image named it, the caller did not
    with Workload(blank_spec_like(w.regions)) as w3:
        r = vramctl("restore", "--pid", str(w3.pid), "--image", str(img), "--to-recorded-paths", socket=daemon.socket)
        assert r.returncode == 0, r.stderr
    assert bo_file.read_bytes() == b"\0" + file_bytes[1:300_001]

    r = vramctl("dump", "--pid", str(os.getpid()), "--range", "0x1000:4096", "--image", str(img),
                socket=daemon.socket)
    assert r.returncode == 1 and "already holds an image" in r.stderr  # nothing replaced without --force
    assert vramctl("inspect", str(img), "--json").returncode == 0

    r = vramctl("sessions", "--json", socket=daemon.socket)
    assert r.returncode == 0 and json.loads(r.stdout) == {"sessions": []}  # vramctl closes what it opens
    r = vramctl("status", "--json", socket=daemon.socket)
    st = json.loads(r.stdout)
    assert r.returncode == 0 and st["server"].startswith("vramd ") and st["sessions"] == 0
    assert 'vramd_sessions_total{kind="dump",outcome="done"} 1' in st["metrics"]


def test_exit_codes(daemon, tmp_path):
    # 2: usage
    r = vramctl("dump", "--pid", "1")
    assert r.returncode == 2 and "--image" in r.stderr
    r = vramctl("dump", "--pid", "1", "--range", "12:zz", "--image", str(tmp_path))
    assert r.returncode == 2
    # 1: a one-line reason
    r = vramctl("status", socket=os.path.join(tmp_path, "nobody-listens.sock"))
    assert r.returncode == 1 and r.stderr.count("\n") == 1 and "cannot connect" in r.stderr
    r = vramctl("verify", str(tmp_path))
    assert r.returncode == 1 and "MANIFEST_MISSING" in r.stderr
    with Workload([{"size": 8192, "fill": "random", "seed": 1}]) as w:
        r = vramctl("dump", "--pid", str(w.pid), "--range", "0x1000:4K", "--image", str(tmp_path / "x"), "--json",
                    socket=daemon.socket)
    assert r.returncode == 1 and "UNMAPPED_RANGE" in r.stderr
    assert json.loads(r.stdout)["error"]["bo_id"] == 1


def test_verify_fails_on_damage(daemon, tmp_path):
    img = tmp_path / "img"
    with Workload([{"size": 1 << 20, "fill": "random", "seed": 3}]) as w:
        r = vramctl("dump", "--pid", str(w.pid), "--range", f"{w.regions[0]['addr']:#x}:1M", "--image", str(img),
                    socket=daemon.socket)
        assert r.returncode == 0, r.stderr
    data = next(p for p in img.iterdir() if p.name != "manifest.vrdm")
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    data.write_bytes(raw)
    r = vramctl("verify", str(img), "--json")
    assert r.returncode == 1
    err = json.loads(r.stdout)["error"]
    assert err["code"] == "CORRUPT_CHUNK" and err["bo_id"] == 1


def test_incremental_dump_restore_verify_flatten(daemon, tmp_path):
    """A child image needs only its own directory while its parent sits where the child recorded it;
    elsewhere --parent names it; flatten makes a copy that needs no parent."""
    weights, cache = tmp_path / "weights.bin", tmp_path / "cache.bin"
    w_bytes, c_bytes = os.urandom(3 << 20), os.urandom(1 << 20)
    weights.write_bytes(w_bytes)
    cache.write_bytes(c_bytes)
    parent, child = tmp_path / "ckpt" / "step1", tmp_path / "ckpt" / "step2"

    def dump(img, *more):
        r = vramctl("dump", "--pid", str(os.getpid()), "--bo-file", str(weights), "--bo-file", str(cache),
                    "--image", str(img), "--json", *more, socket=daemon.socket)
        assert r.returncode == 0, r.stderr
        return json.loads(r.stdout)
    dump(parent)
    c2 = os.urandom(1 << 20)
    cache.write_bytes(c2)  # the KV cache moved on; the weights did not
    dump(child, "--parent", str(parent))
    info = json.loads(vramctl("inspect", str(child), "--json").stdout)
    assert info["format_version"] == 2 and info["parents"][0]["recorded_at"] == "../step1"
    assert info["totals"]["referenced_bytes"] == len(w_bytes)
    assert info["totals"]["stored_bytes"] == len(c2)

    def restore(img, *more):
        out_w, out_c = tmp_path / "out_w.bin", tmp_path / "out_c.bin"
        out_w.write_bytes(bytes(len(w_bytes)))
        out_c.write_bytes(bytes(len(c2)))
        r = vramctl("restore", "--pid", str(os.getpid()), "--image", str(img), "--bo-file", f"1={out_w}",
                    "--bo-file", f"2={out_c}", *more, socket=daemon.socket)
        return r, out_w.read_bytes(), out_c.read_bytes()
    r, got_w, got_c = restore(child)
    assert r.returncode == 0, r.stderr
    assert (got_w, got_c) == (w_bytes, c2)
    assert vramctl("verify", str(child)).returncode == 0

    moved = tmp_path / "elsewhere"
    parent.rename(moved)
    r, got_w, _ = restore(child)
    assert r.returncode == 1 and "--parent" in r.stderr and got_w == bytes(len(w_bytes))
    r, got_w, got_c = restore(child, "--parent", str(moved))
    assert r.returncode == 0, r.stderr
    assert (got_w, got_c) == (w_bytes, c2)

    flat = tmp_path / "flat"
    r = vramctl("flatten", str(child), str(flat), "--parent", str(moved), "--json")
    assert r.returncode == 0, r.stderr
    info = json.loads(vramctl("inspect", str(flat), "--json").stdout)
    assert info["parents"] == [] and info["totals"]["referenced_bytes"] == 0
    assert info["totals"]["stored_bytes"] == len(w_bytes) + len(c2)
    moved.rename(tmp_path / "gone")  # the flattened copy needs no parent
    r, got_w, got_c = restore(flat)
    assert r.returncode == 0, r.stderr
    assert (got_w, got_c) == (w_bytes, c2)

    # nothing removes a parent from under its child: rm refuses, a dump into it refuses
    gone = tmp_path / "gone"
    r = vramctl("rm", str(gone))
    assert r.returncode == 1 and "parent of 1 incremental image" in r.stderr
    r = vramctl("dump", "--pid", str(os.getpid()), "--bo-file", str(weights), "--image", str(gone), "--force",
                socket=daemon.socket)
    assert r.returncode == 1 and "replacing it would break them" in r.stderr
    assert vramctl("verify", str(child), "--parent", str(gone)).returncode == 0
    # removing the child first unmarks it; then the parent goes
    r = vramctl("rm", str(child), "--parent", str(gone))
    assert r.returncode == 0, r.stderr
    assert not child.exists()
    r = vramctl("rm", str(gone))
    assert r.returncode == 0, r.stderr
    assert not gone.exists()
