"""vramctl as a user runs it: a real daemon, real processes, real files, exit codes."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from helpers import ROOT, vramctl

from vramd.engine import EngineConfig
from vramd.pb import rpc_pb2 as rpc
from vramd.testing import Workload, blank_spec_like

SPEC = [{"size": (2 << 20) + 5, "fill": "random", "seed": 7}, {"size": 64 << 10, "fill": "zero"},
        {"size": 4097, "fill": "pattern", "seed": 8, "skew": 13}]


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
    data = max((p for p in img.iterdir() if p.name != "manifest.vrdm"), key=lambda p: p.stat().st_size)  # records
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
    assert info["format_version"] == (3 if EngineConfig().data_files_per_gpu > 1 else 2)  # the daemon's default
    assert info["parents"][0]["recorded_at"] == "../step1"
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


def test_rm_is_refused_while_a_dump_holds_the_directory(daemon, tmp_path):
    """vramctl rm takes the image directory's lock, as a dump does: while a dump writes into the directory
    (here the client side of one, DumpDirectory, holding the lock) rm removes nothing; then it does."""
    from vramd.imagedir import DumpDirectory
    bo, img = tmp_path / "bo.bin", tmp_path / "img"
    bo.write_bytes(os.urandom(100_000))
    r = vramctl("dump", "--bo-file", str(bo), "--image", str(img), socket=daemon.socket)
    assert r.returncode == 0, r.stderr
    files = sorted(os.listdir(img))
    dfd = os.open(img, os.O_RDONLY | os.O_DIRECTORY)
    try:
        with DumpDirectory(dfd, replace_parent=True):
            r = vramctl("rm", str(img))
            assert r.returncode == 1 and "another dump is writing into" in r.stderr and str(img) in r.stderr, r.stderr
            assert sorted(n for n in os.listdir(img) if n != ".lock") == files  # .lock: the dump's, held
    finally:
        os.close(dfd)
    r = vramctl("rm", str(img))
    assert r.returncode == 0, r.stderr
    assert not img.exists()


def test_socket_goes_before_or_after_the_command(daemon, tmp_path):
    for args in (["--socket", daemon.socket, "status", "--json"], ["status", "--socket", daemon.socket, "--json"],
                 ["sessions", "--json", "--socket", daemon.socket]):
        r = vramctl(*args)
        assert r.returncode == 0, (args, r.stderr)
    # given after the command, it is the one used (not the default, nor one given before)
    r = vramctl("--socket", str(tmp_path / "nobody-listens.sock"), "status", "--socket", daemon.socket)
    assert r.returncode == 0, r.stderr
    r = vramctl("--socket", daemon.socket, "status", "--socket", str(tmp_path / "nobody-listens.sock"))
    assert r.returncode == 1 and "nobody-listens.sock" in r.stderr


def test_dump_of_files_needs_no_pid_and_a_failed_dump_leaves_no_directory(daemon, tmp_path):
    bo = tmp_path / "bo.bin"
    bo.write_bytes(os.urandom(100_000))
    r = vramctl("dump", "--bo-file", str(bo), "--image", str(tmp_path / "img"), "--json", socket=daemon.socket)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["image"]["bo_count"] == 1
    r = vramctl("dump", "--range", "0x1000:4K", "--image", str(tmp_path / "img2"), socket=daemon.socket)
    assert r.returncode == 2 and "--range needs --pid" in r.stderr
    assert not (tmp_path / "img2").exists()

    # a dump the daemon fails: the directories vramctl made for it are gone again, others stay
    with Workload([{"size": 8192, "fill": "random", "seed": 1}]) as w:
        new = tmp_path / "new" / "deeper" / "img"
        r = vramctl("dump", "--pid", str(w.pid), "--range", "0x1000:4K", "--image", str(new), socket=daemon.socket)
        assert r.returncode == 1 and "UNMAPPED_RANGE" in r.stderr
        assert not (tmp_path / "new").exists()
        mine = tmp_path / "mine"
        mine.mkdir()
        r = vramctl("dump", "--pid", str(w.pid), "--range", "0x1000:4K", "--image", str(mine), socket=daemon.socket)
        assert r.returncode == 1 and mine.is_dir() and list(mine.iterdir()) == []
    # a dump that fails before the daemon is reached (a BO file that cannot be opened) makes none
    r = vramctl("dump", "--bo-file", str(tmp_path / "missing"), "--image", str(tmp_path / "img3"), socket=daemon.socket)
    assert r.returncode == 1 and not (tmp_path / "img3").exists()
    r = vramctl("dump", "--bo-file", str(bo), "--image", str(tmp_path / "img4"),
                socket=str(tmp_path / "nobody-listens.sock"))
    assert r.returncode == 1 and "cannot connect" in r.stderr and not (tmp_path / "img4").exists()


def test_unmapped_range_names_the_first_unmapped_byte(daemon, tmp_path):
    mib = 1 << 20
    with Workload([{"size": 3 * mib, "fill": "random", "seed": 2, "holes": [[mib, mib]]}]) as w:
        addr = w.regions[0]["addr"]
        # the range's first and last bytes are mapped, the hole is in between
        r = vramctl("dump", "--pid", str(w.pid), "--range", f"{addr:#x}:3M", "--image", str(tmp_path / "a"), "--json",
                    socket=daemon.socket)
        assert r.returncode == 1 and "UNMAPPED_RANGE" in r.stderr
        assert f"{addr + mib:#x}" in r.stderr, r.stderr
        assert json.loads(r.stdout)["error"]["offset"] == mib
        # the range ends in the hole: the hole's start is named, not the last byte that was probed
        r = vramctl("dump", "--pid", str(w.pid), "--range", f"{addr + 4096:#x}:{mib + 8192}", "--image",
                    str(tmp_path / "b"), "--json", socket=daemon.socket)
        assert r.returncode == 1 and f"{addr + mib:#x}" in r.stderr, r.stderr
        assert json.loads(r.stdout)["error"]["offset"] == mib - 4096


def test_a_closed_pipe_ends_quietly(daemon, tmp_path):
    """`vramctl ... | head`: the reader is gone before vramctl writes; no traceback, exit 0 or 141."""
    img = tmp_path / "img"
    bo = tmp_path / "bo.bin"
    bo.write_bytes(os.urandom(5000))
    assert vramctl("dump", "--bo-file", str(bo), "--image", str(img), socket=daemon.socket).returncode == 0
    for args in (["--socket", daemon.socket, "status"], ["inspect", str(img)], ["inspect", str(img), "--json"],
                 ["--help"], ["--socket", daemon.socket, "sessions", "--all"]):
        rfd, wfd = os.pipe()
        os.close(rfd)
        try:
            r = subprocess.run([sys.executable, "-m", "vramd.cli", *args], cwd=ROOT, stdout=wfd,
                               stderr=subprocess.PIPE, text=True, timeout=120)
        finally:
            os.close(wfd)
        assert r.returncode in (0, 141), (args, r.returncode, r.stderr)
        assert r.stderr == "", (args, r.stderr)


def test_rates_are_decimal_gb_per_s(daemon, tmp_path):
    from vramd.cli.common import rate
    assert rate(3_000_000_000, 2.0) == "1.50 GB/s"  # 10^9 bytes a GB, not 2^30
    bo = tmp_path / "bo.bin"
    bo.write_bytes(os.urandom(1 << 20))
    r = vramctl("dump", "--bo-file", str(bo), "--image", str(tmp_path / "img"), socket=daemon.socket)
    assert r.returncode == 0 and " GB/s)" in r.stdout and "GiB" not in r.stdout, r.stdout
    r = vramctl("verify", str(tmp_path / "img"))
    assert r.returncode == 0 and " GB/s)" in r.stdout, r.stdout


NOBODY = 65534
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="acting as another uid needs root (CI runs as root)")
# (after the imports: the interpreter's own files need not be readable by that uid)
DROP = f"import os; os.setgroups([]); os.setgid({NOBODY}); os.setuid({NOBODY})\n"
# As uid 65534: a child holds 1 MiB of known memory; a dump session of it is opened and left open (held by
# this connection) until a line comes on stdin; then Wait reports how the session ended.
HOLDER = """
import ctypes, mmap, os, sys
from vramd.client import Client, ClientBo, SESSION_DUMP
from vramd.errors import VramdError
""" + DROP + """
ctypes.CDLL(None).prctl(4, 1, 0, 0, 0)  # PR_SET_DUMPABLE: setuid cleared it; the child inherits it
sock, img = sys.argv[1], sys.argv[2]
buf = mmap.mmap(-1, 1 << 20)
buf.write(os.urandom(1 << 20))
addr = ctypes.addressof(ctypes.c_char.from_buffer(buf))
r, w = os.pipe()
child = os.fork()
if child == 0:
    os.close(w)
    os.read(r, 1)
    os._exit(0)
os.close(r)
with Client(sock) as c:
    os.mkdir(img)
    dfd = os.open(img, os.O_RDONLY | os.O_DIRECTORY)
    s = c.open_session(SESSION_DUMP, dfd, label="held by nobody")
    mem = os.open(f"/proc/{child}/mem", os.O_RDONLY)
    c.add_bos(s.token, [ClientBo(1, mem, offset=addr, size=1 << 20)])
    print("READY", s.session_id, os.getpid(), child, flush=True)
    sys.stdin.readline()
    try:
        c.wait(s.token)
        print("DONE", flush=True)
    except VramdError as e:
        print("ENDED", e.code, e.message, flush=True)
os.close(w)
os.waitpid(child, 0)
"""


@needs_root
def test_operator_lists_and_cancels_every_uids_sessions(run_dir, image_dir):
    """Root sees another uid's session with its client and target pids and cancels it by id; that uid
    sees only its own sessions and may not cancel by id; a holder cancels by token."""
    from vramd.client import SESSION_DUMP, Client
    from vramd.errors import JobCancelledError, NotFoundError
    from vramd.testing import DaemonProcess
    work = os.path.join(run_dir, "work")
    os.mkdir(work)
    os.chmod(work, 0o777)
    with DaemonProcess(run_dir, "--socket-mode", "666", "--allow-uid", "0", "--allow-uid", str(NOBODY)) as d, \
            Client(d.socket) as c:
        mine = c.open_session(SESSION_DUMP, image_dir[1], label="held by root")
        holder = subprocess.Popen([sys.executable, "-c", HOLDER, d.socket, os.path.join(work, "img")], cwd=ROOT,
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            line = holder.stdout.readline().split()
            assert line and line[0] == "READY", (line, holder.stderr.read() if holder.poll() is not None else "")
            sid, client_pid, target_pid = map(int, line[1:])

            def ctl(*args, uid=0):
                code = "import sys\nfrom vramd.cli.vramctl import main\n" + (DROP if uid else "") + "sys.exit(main())"
                return subprocess.run([sys.executable, "-c", code, *args, "--socket", d.socket], cwd=ROOT,
                                      capture_output=True, text=True, timeout=120)
            r = ctl("sessions", "--all", "--json")
            assert r.returncode == 0, r.stderr
            rows = {s["session_id"]: s for s in json.loads(r.stdout)["sessions"]}
            assert set(rows) == {mine.session_id, sid}
            theirs = rows[sid]
            assert (theirs["uid"], theirs["pid"], theirs["target_pids"]) == (NOBODY, client_pid, [target_pid])
            assert theirs["state"] == "open" and theirs["progress"]["bytes_total"] == 1 << 20
            assert theirs["age_s"] > 0 and theirs["rate_bytes_per_s"] >= 0
            assert rows[mine.session_id]["target_pids"] == [] and rows[mine.session_id]["uid"] == 0
            r = ctl("sessions", "--all")
            assert r.returncode == 0 and "GB/s" in r.stdout and "held by nobody" in r.stdout
            row = next(ln for ln in r.stdout.splitlines() if "held by nobody" in ln).split()
            assert row[:4] == [str(sid), str(NOBODY), str(client_pid), str(target_pid)], row
            # without --all: the caller's own uid's sessions
            r = ctl("sessions", "--json")
            assert [s["session_id"] for s in json.loads(r.stdout)["sessions"]] == [mine.session_id]
            # the other uid sees only its own, and may not cancel by id, not even its own session
            r = ctl("sessions", "--all", "--json", uid=NOBODY)
            assert r.returncode == 0, r.stderr
            assert [s["session_id"] for s in json.loads(r.stdout)["sessions"]] == [sid]
            for target in (mine.session_id, sid):
                r = ctl("cancel", str(target), uid=NOBODY)
                assert r.returncode == 1 and "PERMISSION_DENIED" in r.stderr, r.stderr
                assert f"session {target}" in r.stderr and f"uid {NOBODY}" in r.stderr, r.stderr
            assert c.progress(mine.token).state == rpc.SESSION_OPEN
            # root cancels the other uid's session by its id; its holder's Wait ends CANCELLED with the reason
            r = ctl("cancel", str(sid), "--reason", "operator says stop", "--json")
            assert r.returncode == 0, r.stderr
            assert json.loads(r.stdout)["session_id"] == sid
            holder.stdin.write("\n")
            holder.stdin.flush()
            assert holder.stdout.readline().split()[:2] == ["ENDED", "CANCELLED"]
        finally:
            holder.stdin.close()
            holder.wait(60)
        assert holder.returncode == 0, holder.stderr.read()
        d.expect_log(rf"session {sid} \(uid {NOBODY}\) cancelled by id by uid 0")
        # a holder cancels by token
        r = vramctl("cancel", mine.token, socket=d.socket)
        assert r.returncode == 0, r.stderr
        with pytest.raises(JobCancelledError):
            c.wait(mine.token)
        # the Python client: exactly one of token and id; an unknown id is NOT_FOUND
        with pytest.raises(NotFoundError, match="no session 999999"):
            c.cancel_by_id(999999)
        r = c.request(cancel=rpc.Cancel(token=mine.token, session_id=mine.session_id))
        assert rpc.Code.Name(r.error.code) == "INVALID_REQUEST"
        assert vramctl("cancel", "not-a-session", socket=d.socket).returncode == 2
        c.close_session(mine.token)


def test_rm_removes_only_vramds_regular_files_and_unmarks_parents_last(daemon, tmp_path):
    """vramctl rm removes the manifest first, then the image's files, and its marks in its parents last: where
    a step fails (here the child's directory is immutable, chattr +i), the parent keeps the child's mark and
    goes on refusing its own removal, rather than being left unprotected under a child that is still whole.
    And rm removes only regular files: a symlink or a FIFO that bears a data file's name stays."""
    bo = tmp_path / "bo.bin"
    bo.write_bytes(os.urandom(200_000))
    parent, child = tmp_path / "parent", tmp_path / "child"
    for img, more in ((parent, []), (child, ["--parent", str(parent)])):
        r = vramctl("dump", "--bo-file", str(bo), "--image", str(img), *more, socket=daemon.socket)
        assert r.returncode == 0, r.stderr
    marks = [n for n in os.listdir(parent) if n.startswith(".child.")]
    assert len(marks) == 1
    os.close(os.open(child / ".lock", os.O_CREAT | os.O_WRONLY, 0o600))  # rm's lock file: not made in an immutable dir
    lock = subprocess.run(["chattr", "+i", str(child)], capture_output=True, text=True)
    if lock.returncode != 0:
        pytest.skip(f"no immutable directories here: {lock.stderr.strip()}")
    try:
        r = vramctl("rm", str(child))
        assert r.returncode == 1 and "manifest.vrdm" in r.stderr, r.stderr
    finally:
        subprocess.run(["chattr", "-i", str(child)], check=True)
    assert (child / "manifest.vrdm").exists() and vramctl("verify", str(child)).returncode == 0
    assert [n for n in os.listdir(parent) if n.startswith(".child.")] == marks  # still protected
    r = vramctl("rm", str(parent))
    assert r.returncode == 1 and "parent of 1 incremental image" in r.stderr

    others = [f"data-{'0' * 16}-00000000.vrd", f"data-{'0' * 16}-00000001.vrd"]
    (child / others[0]).symlink_to(bo)
    os.mkfifo(child / others[1])
    r = vramctl("rm", str(child))
    assert r.returncode == 0, r.stderr
    assert sorted(os.listdir(child)) == sorted(others) and bo.exists()  # not vramd's files: kept, and the dir
    assert not [n for n in os.listdir(parent) if n.startswith(".child.")]
    r = vramctl("rm", str(parent))
    assert r.returncode == 0, r.stderr


def test_a_session_state_kind_or_code_this_vramctl_does_not_know_is_shown_by_its_number():
    """A newer daemon may send a state, kind or error code this vramctl does not know (CANCELLING, 6, was new
    once; an older vramctl raised ValueError on it): `sessions` and `cancel` show it by its number."""
    from vramd.cli.common import session_dict

    info = rpc.SessionInfo(session_id=7, kind=9, state=42, error=rpc.Error(code=77, message="newer"))
    d = session_dict(info)
    assert (d["kind"], d["state"], d["error"]["code"]) == ("kind_9", "state_42", "CODE_77")
    known = session_dict(rpc.SessionInfo(kind=rpc.SESSION_DUMP, state=rpc.SESSION_CANCELLING))
    assert (known["kind"], known["state"]) == ("dump", "cancelling")


def test_a_relative_socket_path_from_a_removed_directory_is_one_line(tmp_path):
    """Run from a directory that is gone, a relative --socket cannot be resolved: one line and exit 1 (the
    socket's path check raised a bare FileNotFoundError before)."""
    gone = tmp_path / "gone"
    gone.mkdir()
    code = (f"import os, runpy, sys; os.chdir({str(gone)!r}); os.rmdir({str(gone)!r}); "
            "sys.argv = ['vramctl', 'status', '--socket', 'rel/vramd.sock']; "
            "runpy.run_module('vramd.cli', run_name='__main__')")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 1, r
    assert r.stderr == "vramctl: cannot connect to vramd at rel/vramd.sock: No such file or directory\n", r.stderr


def test_a_parent_not_where_the_child_recorded_it_or_another_image_is_one_line(daemon, tmp_path):
    """The parent chain's rule (vramd.image.chain), as vramctl verify meets it: a parent moved away, and a
    --parent that names another image, are each one line naming the parent's number and what to do."""
    bo = tmp_path / "bo.bin"
    bo.write_bytes(os.urandom(1 << 20))
    parent, child, other = tmp_path / "step1", tmp_path / "step2", tmp_path / "other"
    for img, more in ((parent, []), (other, []), (child, ["--parent", str(parent)])):
        r = vramctl("dump", "--bo-file", str(bo), "--image", str(img), *more, socket=daemon.socket)
        assert r.returncode == 0, r.stderr
    parent.rename(tmp_path / "moved")
    r = vramctl("verify", str(child))
    assert r.returncode == 1 and r.stderr.count("\n") == 1, r.stderr
    assert f"{child} is incremental: name its parent #1 with --parent DIR" in r.stderr, r.stderr
    r = vramctl("verify", str(child), "--parent", str(other))
    assert r.returncode == 1 and r.stderr.count("\n") == 1, r.stderr
    assert f"{other} holds another image than parent #1 of {child}" in r.stderr, r.stderr
    assert vramctl("verify", str(child), "--parent", str(tmp_path / "moved")).returncode == 0
