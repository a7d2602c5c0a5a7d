"""`vramctl pull --serve` (vramd.oci.serve) feeding a streamed restore that libvramd opens, against the real
registry and a real daemon.  The restorer is native/client/tests/t_stream.c's stream_restore with no
$VRAMD_TEST_SUPPLY_FD: it connects to the served directory's .vramd-supply.sock itself, as the CRIU plugin
does, and passes the connection as vramd_criu_config.supply_fd.

A proxy in front of the registry holds the last payload blob until the restore is seen waiting for it (the C
program's 300 ms wait times out), so the copy provably overlaps the download: then the BO holds the dumped
bytes and the served directory is the pushed image; a blob that fails its digest fails the restore with
TRUNCATED_DATA and leaves no directory; a peer of another uid is refused while the wait goes on; no restore
within --serve-timeout is one TIMEOUT line and no directory, nor after SIGTERM (whichever thread's C handler
takes it); a directory holding the image is checked, not served; an incremental image's parent is pulled whole
first (that restore through vramd.client), and a child recording its parent as the plugin does gets its `parent`
link before the socket listens."""
from __future__ import annotations

import os
import re
import select
import shutil
import socket
import stat
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import test_libvramd as base
from helpers import ROOT, vramctl
from test_libvramd import TESTS_BIN, c_env, read_line
from test_oci_stream import HoldingProxy, _layers

from vramd.oci.serve import SOCKET_NAME

build = base.build  # the module's fixture: build/libvramd and its C test program


def serve(ref: str, dest: Path, errlog: Path, *more: str) -> tuple[subprocess.CompletedProcess[str], int]:
    """`vramctl pull --serve` as a shell runs it: it returns once it listens; the server's pid (its ready
    line).  The server's stderr goes to `errlog` (it outlives the command)."""
    with open(errlog, "w") as err:
        r = subprocess.run([sys.executable, "-m", "vramd.cli", "pull", "--serve", ref, str(dest), "--plain-http",
                            *more], cwd=ROOT, stdout=subprocess.PIPE, stderr=err, text=True, timeout=120)
    m = re.search(r"\(pid (\d+)\)", r.stdout)
    return r, int(m[1]) if m else -1


def wait_exit(pid: int, timeout: float = 120) -> None:
    """Until the server process (not our child: it forked off) has ended: its pidfd turns readable."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return
    try:
        assert select.select([fd], [], [], timeout)[0], f"the server {pid} did not end"
    finally:
        os.close(fd)


def streamed(build, daemon, registry, tmp_path: Path, tag: str, *, damage: bool = False,
             before: Callable[[Path], None] | None = None) -> tuple[str, str, Path, dict[str, bytes]]:
    """The C program dumps; the dump is pushed to serve/img:TAG (its last payload blob damaged in the registry's
    storage with `damage`); `vramctl pull --serve` through a proxy holding that blob; `before(served_dir)`; the
    C program restores the served directory through its socket; the blob is released once it waits.  (The C
    program's stdout, the server's stderr, the served directory, the dumped files.)"""
    env = c_env(daemon, VRAMD_TEST_STREAM_VIA="criu", VRAMD_TEST_STREAM_EXPECT="truncated" if damage else "done")
    proc = subprocess.Popen([str(build / TESTS_BIN), "stream_restore"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)
    served, errlog = tmp_path / "served", tmp_path / "serve.err"
    try:
        dumped = Path(read_line(proc, "DUMPED ").split(" ", 1)[1].strip())
        ref = f"{registry.host}/serve/img:{tag}"
        r = vramctl("push", str(dumped), ref, "--plain-http")
        assert r.returncode == 0, r.stderr
        files = {f.name: f.read_bytes() for f in dumped.iterdir() if f.name == "manifest.vrdm" or f.suffix == ".vrd"}
        last = _layers(registry, "serve/img", tag)[-1]["digest"]
        if damage:
            data = registry.blob_data(last)
            raw = bytearray(data.read_bytes())
            raw[len(raw) // 2] ^= 0xFF
            data.write_bytes(raw)
        proxy = HoldingProxy(registry.url, last)
        try:
            r, pid = serve(ref.replace(registry.host, proxy.host), served, errlog)
            assert r.returncode == 0 and pid > 0, (r.stdout, errlog.read_text())
            sock = (served / SOCKET_NAME).lstat()
            assert stat.S_ISSOCK(sock.st_mode) and stat.S_IMODE(sock.st_mode) == 0o600
            assert (served / "manifest.vrdm").read_bytes() == files["manifest.vrdm"]
            if before is not None:
                before(served)
            assert proc.stdin is not None
            proc.stdin.write(f"{served}\n")
            proc.stdin.flush()
            assert proxy.held.wait(60), "the last blob was never asked for"
            read_line(proc, "STARTED")  # its copy waited for the supply while the blob was held
            proxy.release.set()
            out, err = proc.communicate(timeout=120)
            wait_exit(pid)
        finally:
            proxy.close()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0 and "PASS stream_restore" in out, out + err + errlog.read_text()
    shutil.rmtree(dumped, ignore_errors=True)  # the C program's own dump: removed by it only where it passed
    return out, errlog.read_text(), served, files


def test_a_served_pull_streams_a_restore_through_libvramd(build, daemon, registry, tmp_path):
    """The restore lands the dumped bytes (the C program checks them); the served directory ends as the pushed
    image, its socket gone; the server said nothing on stderr."""
    _out, served_err, served, files = streamed(build, daemon, registry, tmp_path, "ok")
    assert served_err == "", served_err
    assert {f.name: f.read_bytes() for f in served.iterdir()} == files


def test_a_blob_failing_its_digest_fails_the_restore_and_leaves_no_directory(build, daemon, registry, tmp_path):
    out, served_err, served, _files = streamed(build, daemon, registry, tmp_path, "bad", damage=True)
    assert "TRUNCATED the client stopped supplying data file" in out, out
    assert re.fullmatch(r"vramctl: DIGEST_MISMATCH: .*\n", served_err), served_err
    assert not served.exists()


def test_a_peer_of_another_uid_is_refused_and_the_wait_goes_on(build, daemon, registry, tmp_path):
    """A connection from uid 65534 (the socket's mode opened for it: the check is SO_PEERCRED's) is closed at
    once, with one warning naming its uid; the restore's connection, root's, is served as usual."""
    if os.geteuid() != 0:
        pytest.skip("needs root to connect as another uid")

    def stranger(served: Path) -> None:
        os.chmod(served, 0o755)
        os.chmod(served / SOCKET_NAME, 0o666)
        dfd = os.open(served, os.O_PATH | os.O_DIRECTORY)  # past the test's 0700 directories, as root opened it
        try:
            s = subprocess.run([sys.executable, "-c", (
                "import os, socket, sys\n"
                "os.setgid(65534); os.setuid(65534)\n"
                "s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM); s.connect(sys.argv[1])\n"
                "print(repr(s.recv(16)))\n"), f"/proc/self/fd/{dfd}/{SOCKET_NAME}"], capture_output=True, text=True,
                timeout=60, pass_fds=(dfd,))
        finally:
            os.close(dfd)
        assert s.returncode == 0 and s.stdout == "b''\n", s.stdout + s.stderr  # closed, nothing sent
    _out, served_err, served, files = streamed(build, daemon, registry, tmp_path, "peer", before=stranger)
    assert re.fullmatch(r"vramctl: warning: refused a connection to \S+ from pid \d+, uid 65534 \(only root or uid "
                        r"0 may restore from it\)\n", served_err), served_err
    assert {f.name: f.read_bytes() for f in served.iterdir()} == files


def test_no_restore_within_the_timeout_is_one_line_and_leaves_nothing(daemon, registry, tmp_path):
    """--serve-timeout 1 in the foreground, nobody connecting: the ready line, then exit 1 with one TIMEOUT
    line naming the socket, and the laid-out directory removed."""
    bo = tmp_path / "bo.bin"
    bo.write_bytes(os.urandom(2 << 20))
    img = tmp_path / "img"
    r = vramctl("dump", "--pid", str(os.getpid()), "--bo-file", str(bo), "--image", str(img), socket=daemon.socket)
    assert r.returncode == 0, r.stderr
    ref = f"{registry.host}/serve/timeout:1"
    assert vramctl("push", str(img), ref, "--plain-http").returncode == 0
    dest = tmp_path / "never"
    r = subprocess.run([sys.executable, "-m", "vramd.cli", "pull", "--serve", "--foreground", "--serve-timeout", "1",
                        ref, str(dest), "--plain-http"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 1, r.stderr
    assert r.stdout.startswith("serving ") and str(dest / SOCKET_NAME) in r.stdout, r.stdout
    assert r.stderr == f"vramctl: TIMEOUT: no restore connected to {dest / SOCKET_NAME} within 1 s\n", r.stderr
    assert not dest.exists()


def _pushed_small(daemon, registry, tmp_path: Path, tag: str) -> tuple[Path, str]:
    bo = tmp_path / "bo.bin"
    bo.write_bytes(os.urandom(2 << 20))
    img = tmp_path / "img"
    r = vramctl("dump", "--pid", str(os.getpid()), "--bo-file", str(bo), "--image", str(img), socket=daemon.socket)
    assert r.returncode == 0, r.stderr
    ref = f"{registry.host}/serve/{tag}:1"
    assert vramctl("push", str(img), ref, "--plain-http").returncode == 0
    return img, ref


def test_sigterm_while_serving_removes_the_directory(daemon, registry, tmp_path):
    """SIGTERM to a server waiting for its restore: exit 1, one line saying so, the laid-out directory gone."""
    _img, ref = _pushed_small(daemon, registry, tmp_path, "term")
    dest = tmp_path / "served"
    p = subprocess.Popen([sys.executable, "-m", "vramd.cli", "pull", "--serve", "--foreground", ref, str(dest),
                          "--plain-http"], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert p.stdout is not None
        line = p.stdout.readline()
        assert line.startswith("serving ") and (dest / SOCKET_NAME).exists(), line
        p.terminate()
        _out, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
            p.communicate()
    assert p.returncode == 1 and err == "vramctl: stopped by signal 15\n", err
    assert not dest.exists()


def test_a_directory_holding_the_image_is_checked_and_not_served(daemon, registry, tmp_path):
    """A directory that holds the image already (a pull's): checked as `vramctl pull` checks it, one line,
    exit 0 at once, no socket: the restore reads it as it is.  One holding another image is refused."""
    img, ref = _pushed_small(daemon, registry, tmp_path, "held")
    r = subprocess.run([sys.executable, "-m", "vramd.cli", "pull", "--serve", ref, str(img), "--plain-http"],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.startswith(f"{img} holds ") and "nothing to serve" in r.stdout, r
    assert not (img / SOCKET_NAME).exists()
    other = tmp_path / "other"
    other.mkdir()
    (other / "manifest.vrdm").write_bytes((img / "manifest.vrdm").read_bytes()[:-1] + b"\0")
    r = subprocess.run([sys.executable, "-m", "vramd.cli", "pull", "--serve", ref, str(other), "--plain-http"],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and r.stderr.startswith("vramctl: ") and r.stderr.count("\n") == 1, r.stderr
    assert not (other / SOCKET_NAME).exists()


def test_an_incremental_image_is_served_its_parents_pulled_first(run_dir, registry, tmp_path):
    """A child image (one BO changed since its parent): `--serve` pulls the parent whole into the sibling
    directory the child recorded, then serves the child; a restore through the socket with the parent's
    directory (vramd.client, supply_fd) lands the child's bytes, and the served directory ends as the child."""
    from oci_helpers import Node, workload_bos

    from vramd.client import SESSION_RESTORE, Client, ClientBo

    bos = workload_bos()
    with Node(run_dir, tmp_path / "node1") as node:
        parent, child = tmp_path / "ckpt" / "step1", tmp_path / "ckpt" / "step2"
        node.dump(parent, bos)
        changed = bytearray(bos[0])
        changed[(1 << 20) + 5] ^= 0xFF
        bos2 = [bytes(changed), bos[1]]
        node.dump(child, bos2, "--parent", str(parent), "--compress", "none")
        ref = f"{registry.host}/serve/chain:step2"
        assert vramctl("push", str(child), ref, "--plain-http").returncode == 0
        dest, errlog = tmp_path / "there" / "step2", tmp_path / "serve.err"
        dest.parent.mkdir()
        r, pid = serve(ref, dest, errlog)
        assert r.returncode == 0, errlog.read_text()
        pulled = tmp_path / "there" / "step1"
        assert (pulled / "manifest.vrdm").read_bytes() == (parent / "manifest.vrdm").read_bytes()
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        conn.connect(str(dest / SOCKET_NAME))
        targets = [os.memfd_create(f"bo{i}", os.MFD_CLOEXEC) for i in (1, 2)]
        dfd = os.open(dest, os.O_RDONLY | os.O_DIRECTORY)
        pfd = os.open(pulled, os.O_RDONLY | os.O_DIRECTORY)
        try:
            for fd, b in zip(targets, bos2, strict=True):
                os.ftruncate(fd, len(b))
            with Client(node.daemon.socket) as c:
                tok = c.open_session(SESSION_RESTORE, dfd, parent_fds=[pfd], supply_fd=conn.fileno()).token
                conn.close()
                c.add_bos(tok, [ClientBo(id=i, fd=fd, backend="mmap") for i, fd in enumerate(targets, 1)])
                c.start(tok)
                c.wait(tok)
                c.close_session(tok)
            got = [os.pread(fd, len(b), 0) for fd, b in zip(targets, bos2, strict=True)]
        finally:
            for fd in (*targets, dfd, pfd):
                os.close(fd)
        wait_exit(pid)
    assert got == bos2
    assert errlog.read_text() == ""
    assert sorted(p.name for p in dest.iterdir()) == sorted(p.name for p in child.iterdir()
                                                             if p.name == "manifest.vrdm" or p.suffix == ".vrd")


def test_a_plugin_style_child_is_served_with_its_parent_link(run_dir, registry, tmp_path):
    """A child recording its parent as `parent`, a link in its own directory (CRIU's amdgpu plugin's way,
    tests/test_oci_operator.py): `--serve` pulls the parent into DEST.parent-1 and makes DEST/parent a link to
    it before it listens, as `vramctl pull` does, so a restore opening DEST/parent finds it.  Was: no link,
    and the plugin's restore failed PARENT_MISSING.  A directory holding the image gets its link back (not
    served); a serve stopped by SIGTERM removes its link too, and so its directory."""
    from oci_helpers import Node, workload_bos
    from test_oci_operator import _changed, _dump_as_the_plugin_does

    from vramd.client import SESSION_RESTORE, Client, ClientBo

    b0 = workload_bos()
    b1 = _changed(b0, (1 << 20) + 5)
    with Node(run_dir, tmp_path / "node1") as node:
        ckpt = [tmp_path / "ckpt" / str(k) / "amdgpu-vramd-1" for k in range(2)]
        _dump_as_the_plugin_does(node, ckpt, [b0, b1])
        ref = f"{registry.host}/serve/plugin:1"
        assert vramctl("push", str(ckpt[1]), ref, "--plain-http").returncode == 0
        names = sorted(p.name for p in ckpt[1].iterdir())
        shutil.rmtree(tmp_path / "ckpt")
        dest, errlog = tmp_path / "restore" / "amdgpu-vramd-1", tmp_path / "serve.err"
        dest.parent.mkdir()
        r, pid = serve(ref, dest, errlog)
        assert r.returncode == 0, errlog.read_text()
        assert os.readlink(dest / "parent") == "../amdgpu-vramd-1.parent-1"  # there once it listens
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        conn.connect(str(dest / SOCKET_NAME))
        targets = [os.memfd_create(f"bo{i}", os.MFD_CLOEXEC) for i in (1, 2)]
        dfd = os.open(dest, os.O_RDONLY | os.O_DIRECTORY)
        pfd = os.open(dest / "parent", os.O_RDONLY | os.O_DIRECTORY)  # where the child recorded its parent
        try:
            for fd, b in zip(targets, b1, strict=True):
                os.ftruncate(fd, len(b))
            with Client(node.daemon.socket) as c:
                tok = c.open_session(SESSION_RESTORE, dfd, parent_fds=[pfd], supply_fd=conn.fileno()).token
                conn.close()
                c.add_bos(tok, [ClientBo(id=i, fd=fd, backend="mmap") for i, fd in enumerate(targets, 1)])
                c.start(tok)
                c.wait(tok)
                c.close_session(tok)
            got = [os.pread(fd, len(b), 0) for fd, b in zip(targets, b1, strict=True)]
        finally:
            for fd in (*targets, dfd, pfd):
                os.close(fd)
        wait_exit(pid)
    assert got == b1
    assert errlog.read_text() == ""
    assert sorted(p.name for p in dest.iterdir()) == names  # the child's files and its `parent` link
    r = vramctl("rm", f"{dest}.parent-1")  # marked as a pull marks it: refused while the served child needs it
    assert r.returncode == 1 and f"is the parent of 1 incremental image(s): {dest}" in r.stderr, r.stderr
    (dest / "parent").unlink()
    r = subprocess.run([sys.executable, "-m", "vramd.cli", "pull", "--serve", ref, str(dest), "--plain-http"],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "nothing to serve" in r.stdout, r
    assert os.readlink(dest / "parent") == "../amdgpu-vramd-1.parent-1"
    # stopped while it waits: the link goes with the rest, then the directory it made
    other = tmp_path / "restore" / "again"
    p = subprocess.Popen([sys.executable, "-m", "vramd.cli", "pull", "--serve", "--foreground", ref, str(other),
                          "--plain-http"], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert p.stdout is not None
        line = p.stdout.readline()
        assert line.startswith("serving ") and os.readlink(other / "parent") == "../again.parent-1", line
        p.terminate()
        _out, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
            p.communicate()
    assert p.returncode == 1 and err == "vramctl: stopped by signal 15\n", err
    assert not os.path.lexists(other)
    r = vramctl("rm", f"{other}.parent-1")  # the parent pulled whole stays; its mark of the gone child is stale
    assert r.returncode == 0 and "stale mark" in r.stdout and not os.path.lexists(f"{other}.parent-1"), r


def test_a_socket_file_removed_while_serving_does_not_undo_the_finished_image(daemon, registry, tmp_path):
    """The socket file removed once the restore connected (by hand, a tmp cleaner): the serve still ends well,
    the directory the pulled image, the restore whole.  Was: the serve's own removal of the socket failed with
    an untyped '[Errno 2]', and its cleanup then removed the whole, checked image."""
    from vramd.client import SESSION_RESTORE, Client, ClientBo

    img, ref = _pushed_small(daemon, registry, tmp_path, "unlinked")
    dest, errlog = tmp_path / "served", tmp_path / "serve.err"
    r, pid = serve(ref, dest, errlog)
    assert r.returncode == 0 and pid > 0, (r.stdout, errlog.read_text())
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.connect(str(dest / SOCKET_NAME))
    (dest / SOCKET_NAME).unlink()
    data = (tmp_path / "bo.bin").read_bytes()
    target = os.memfd_create("bo", os.MFD_CLOEXEC)
    dfd = os.open(dest, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.ftruncate(target, len(data))
        with Client(daemon.socket) as c:
            tok = c.open_session(SESSION_RESTORE, dfd, supply_fd=conn.fileno()).token
            conn.close()
            c.add_bos(tok, [ClientBo(id=1, fd=target, backend="mmap")])
            c.start(tok)
            c.wait(tok, timeout=60)
            c.close_session(tok)
        got = os.pread(target, len(data), 0)
    finally:
        os.close(target)
        os.close(dfd)
    wait_exit(pid)
    assert got == data
    assert errlog.read_text() == ""
    assert sorted(p.name for p in dest.iterdir()) == sorted(p.name for p in img.iterdir()
                                                             if p.name == "manifest.vrdm" or p.suffix == ".vrd")


def test_a_server_killed_after_its_restore_connected_leaves_a_socket_nobody_answers(daemon, registry, tmp_path):
    """The server SIGKILLed once a restore's connection was taken (its first supply message read) while a payload
    blob is held: its directory holds manifest.vrdm and the unfilled data files, and still the socket, which
    now refuses: a later restore (CRIU's plugin) fails on it instead of taking the directory for an image."""
    img, ref = _pushed_small(daemon, registry, tmp_path, "killed")
    hold = _layers(registry, "serve/killed", "1")[-1]["digest"]
    proxy = HoldingProxy(registry.url, hold)
    dest, errlog = tmp_path / "served", tmp_path / "serve.err"
    try:
        r, pid = serve(ref.replace(registry.host, proxy.host), dest, errlog)
        assert r.returncode == 0 and pid > 0, (r.stdout, errlog.read_text())
        assert proxy.held.wait(60), "the payload blob was never asked for"
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
            conn.connect(str(dest / SOCKET_NAME))
            conn.settimeout(60)
            first = conn.recv(16)  # the data file's header, final since it was laid out: the connection was taken
            assert len(first) == 16, first
            os.kill(pid, 9)
            wait_exit(pid)
    finally:
        proxy.release.set()
        proxy.close()
    assert (dest / "manifest.vrdm").read_bytes() == (img / "manifest.vrdm").read_bytes()
    assert stat.S_ISSOCK((dest / SOCKET_NAME).lstat().st_mode)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as again, pytest.raises(ConnectionRefusedError):
        again.connect(str(dest / SOCKET_NAME))
    r = vramctl("rm", str(dest))  # the operator's way out: the socket goes with the image (was: kept, and so DIR)
    assert r.returncode == 0 and "kept the directory" not in r.stdout, (r.stdout, r.stderr)
    assert not dest.exists()


@pytest.mark.parametrize("lie", ["holes", "flipped"])
def test_a_server_that_says_unfilled_or_altered_files_are_final_restores_nothing(daemon, registry, tmp_path, lie):
    """A hostile server on the supply socket (root or criu's uid can serve; what it says is not trusted): it
    announces every data file whole at once while its payloads are still holes, or hold a flipped byte.  The
    daemon checks each record it reads against the manifest as in any restore: the session fails naming the BO
    and the offset, and the target's bytes are not the image's."""
    from vramd.client import SESSION_RESTORE, Client, ClientBo
    from vramd.errors import VramdError
    from vramd.image.manifest import decode_manifest
    from vramd.image.names import MANIFEST_NAME
    from vramd.image.supply import encode

    bo = tmp_path / "bo.bin"
    data = os.urandom(2 << 20)
    bo.write_bytes(data)
    img = tmp_path / "img"
    r = vramctl("dump", "--pid", str(os.getpid()), "--bo-file", str(bo), "--image", str(img), socket=daemon.socket)
    assert r.returncode == 0, r.stderr
    m = decode_manifest((img / MANIFEST_NAME).read_bytes())
    dest = tmp_path / "served"
    dest.mkdir()
    shutil.copyfile(img / MANIFEST_NAME, dest / MANIFEST_NAME)
    t = m.chunks
    records = [(fi, off, n) for im, fi, off, n in zip(t.image, t.file_index, t.offset, t.length, strict=True)
               if im == 0 and n]
    assert records, "the dump stored no record"
    files = [bytearray((img / f.name).read_bytes()) for f in m.files]
    for fi, off, n in records if lie == "holes" else records[-1:]:
        if lie == "holes":
            files[fi][off:off + n] = bytes(n)
        else:
            files[fi][off + n // 2] ^= 0x40
    for f, raw in zip(m.files, files, strict=True):
        (dest / f.name).write_bytes(raw)
    server, restorer = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    target = os.memfd_create("bo", os.MFD_CLOEXEC)
    dfd = os.open(dest, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.ftruncate(target, len(data))
        for i, f in enumerate(m.files):  # the lie: every file whole and checked, at once
            server.sendall(encode(i, (dest / f.name).stat().st_size))
        with Client(daemon.socket) as c:
            tok = c.open_session(SESSION_RESTORE, dfd, supply_fd=restorer.fileno()).token
            restorer.close()
            c.add_bos(tok, [ClientBo(id=1, fd=target, backend="mmap")])
            c.start(tok)
            with pytest.raises(VramdError) as e:
                c.wait(tok, timeout=60)
            c.close_session(tok)
        got = os.pread(target, len(data), 0)
    finally:
        server.close()
        os.close(target)
        os.close(dfd)
    assert e.value.code == "CORRUPT_CHUNK" and e.value.bo_id == 1 and e.value.offset is not None, e.value
    assert got != data


def test_a_second_sigterm_while_the_serve_cleans_up_does_not_cut_the_removal_short(daemon, registry, tmp_path):
    """SIGTERM to a server feeding a restore while a payload blob is held: it ends the supply first (the
    restore's socket reads its end), then waits for its downloads to stop; a second SIGTERM then (a supervisor
    stopping it again) is ignored: once the blob comes, the directory is removed, manifest first, and the
    command says why in one line.  Before, the second signal left manifest.vrdm over unfilled files."""
    _img, ref = _pushed_small(daemon, registry, tmp_path, "twice")
    hold = _layers(registry, "serve/twice", "1")[-1]["digest"]
    proxy = HoldingProxy(registry.url, hold)
    dest = tmp_path / "served"
    p = subprocess.Popen([sys.executable, "-m", "vramd.cli", "pull", "--serve", "--foreground",
                          ref.replace(registry.host, proxy.host), str(dest), "--plain-http"], cwd=ROOT,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert p.stdout is not None
        assert p.stdout.readline().startswith("serving "), p.stderr
        assert proxy.held.wait(60), "the payload blob was never asked for"
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
            conn.connect(str(dest / SOCKET_NAME))
            conn.settimeout(60)
            assert len(conn.recv(16)) == 16  # taken: the data file's header is final
            p.terminate()
            while conn.recv(4096):  # the supply's end: the server is removing what it made
                pass
            p.terminate()
        proxy.release.set()
        _out, err = p.communicate(timeout=120)
    finally:
        proxy.release.set()
        proxy.close()
        if p.poll() is None:
            p.kill()
            p.communicate()
    assert p.returncode == 1 and err == "vramctl: stopped by signal 15\n", err
    assert not dest.exists()



X86_64 = pytest.mark.skipif(os.uname().machine != "x86_64", reason="reads x86-64 syscall numbers in /proc")


def _signal_another_thread(pid: int, sig: int) -> None:
    """`sig` to one of `pid`'s threads other than its main one (tgkill), once the main thread sleeps in a
    syscall (its wait): Python's C-level handler runs in that other thread and only flags the signal, as when it
    lands while the main thread is between its last check and a blocking call; nothing interrupts the main
    thread's wait, so only a wait that watches the signal's wakeup fd ends."""
    import ctypes
    import time

    deadline = time.monotonic() + 60
    while True:  # /proc/PID/task/PID/syscall: the number and arguments of the syscall it sleeps in
        with open(f"/proc/{pid}/task/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
        with open(f"/proc/{pid}/task/{pid}/syscall") as f:
            call = f.read().split()[0]
        if state == "S" and call in ("7", "202"):  # poll (an accept, the fix's wait) or futex (a join)
            break
        assert time.monotonic() < deadline, f"the server's main thread never waited ({state}, {call})"
        time.sleep(0.01)
    tids = sorted(int(t) for t in os.listdir(f"/proc/{pid}/task") if int(t) != pid)
    assert tids, "the server runs no thread but its main one"
    libc = ctypes.CDLL(None, use_errno=True)
    assert libc.tgkill(pid, tids[0], sig) == 0, os.strerror(ctypes.get_errno())


@X86_64
def test_sigterm_taken_by_another_thread_while_waiting_for_the_restore_stops_it(daemon, registry, tmp_path):
    """SIGTERM whose C-level handler runs outside the main thread while the server waits for its restore's
    connection: it stops at once, not when --serve-timeout ends the wait (before, it went on silently until then:
    the flaky hang of test_sigterm_while_serving_removes_the_directory under load)."""
    _img, ref = _pushed_small(daemon, registry, tmp_path, "otherthread")
    dest = tmp_path / "served"
    p = subprocess.Popen([sys.executable, "-m", "vramd.cli", "pull", "--serve", "--foreground", "--serve-timeout",
                          "200", ref, str(dest), "--plain-http"], cwd=ROOT, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    try:
        assert p.stdout is not None
        assert p.stdout.readline().startswith("serving "), p.stderr
        _signal_another_thread(p.pid, 15)
        _out, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
            p.communicate()
    assert p.returncode == 1 and err == "vramctl: stopped by signal 15\n", err
    assert not dest.exists()


@X86_64
def test_sigterm_taken_by_another_thread_while_a_blob_is_held_ends_the_supply_at_once(daemon, registry, tmp_path):
    """SIGTERM whose C-level handler runs outside the main thread while the server feeds a restore and waits for
    its downloads (a payload blob held): the supply ends at once, with the blob still held, and once it comes
    the directory is gone and the command says why.  Before, the main thread's join went on until the blob came."""
    _img, ref = _pushed_small(daemon, registry, tmp_path, "joinwait")
    hold = _layers(registry, "serve/joinwait", "1")[-1]["digest"]
    proxy = HoldingProxy(registry.url, hold)
    dest = tmp_path / "served"
    p = subprocess.Popen([sys.executable, "-m", "vramd.cli", "pull", "--serve", "--foreground",
                          ref.replace(registry.host, proxy.host), str(dest), "--plain-http"], cwd=ROOT,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert p.stdout is not None
        assert p.stdout.readline().startswith("serving "), p.stderr
        assert proxy.held.wait(60), "the payload blob was never asked for"
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
            conn.connect(str(dest / SOCKET_NAME))
            conn.settimeout(60)
            assert len(conn.recv(16)) == 16  # taken: the data file's header is final
            _signal_another_thread(p.pid, 15)
            while conn.recv(4096):  # the supply's end, within 60 s: the server is stopping
                pass
        assert not proxy.release.is_set()
        proxy.release.set()
        _out, err = p.communicate(timeout=60)
    finally:
        proxy.release.set()
        proxy.close()
        if p.poll() is None:
            p.kill()
            p.communicate()
    assert p.returncode == 1 and err == "vramctl: stopped by signal 15\n", err
    assert not dest.exists()
