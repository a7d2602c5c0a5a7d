"""Bad peers: unauthorised uids, malformed frames, clients that die mid-session, shutdown."""
from __future__ import annotations

import array
import json
import os
import pwd
import signal
import socket
import subprocess
import sys
import textwrap

import pytest
from helpers import ROOT, Workload, blank_spec_like, memfd

from vramd.client import SESSION_DUMP, SESSION_RESTORE, Client, ClientBo
from vramd.errors import (
    JobCancelledError,
    NotFoundError,
    PermissionDeniedError,
    TargetTooSmallError,
    UnmappedRangeError,
    VramdError,
)
from vramd.image.names import is_own_temporary
from vramd.imagedir import DumpDirectory
from vramd.pb import rpc_pb2 as rpc
from vramd.protocol import PROTOCOL_VERSIONS, decode_response, encode_request
from vramd.testing import DaemonProcess

NOBODY = 65534
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="dropping to another uid needs root (CI runs as root)")


def as_nobody(sock_path: str, body: str) -> subprocess.CompletedProcess:
    """Run `body` in a child that drops to uid/gid 65534 *before* connecting (SO_PEERCRED is taken at connect)."""
    code = textwrap.dedent(f"""
        import os, sys
        from vramd.client import Client, ClientBo, SESSION_DUMP
        from vramd.errors import VramdError
        os.setgroups([]); os.setgid({NOBODY}); os.setuid({NOBODY})
        sock = {sock_path!r}
        try:
    """) + textwrap.indent(textwrap.dedent(body), "    ") + textwrap.dedent("""
        except VramdError as e:
            print("ERROR", e.code, e.message)
    """)
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60,
                          stdin=subprocess.PIPE)


@needs_root
def test_unauthorised_uid_is_refused(run_dir):
    with DaemonProcess(run_dir, "--socket-mode", "666") as d:
        r = as_nobody(d.socket, "Client(sock); print('CONNECTED')")
        assert "ERROR PERMISSION_DENIED" in r.stdout and f"uid {NOBODY}" in r.stdout, r.stdout + r.stderr
        d.expect_log(f"refused pid \\d+ uid {NOBODY}")
        with Client(d.socket) as c:  # root still served
            assert c.status().sessions == 0


@needs_root
def test_token_works_only_for_its_uid(run_dir, image_dir):
    _, dfd = image_dir
    with DaemonProcess(run_dir, "--socket-mode", "666", "--allow-uid", "0", "--allow-uid", str(NOBODY)) as d, \
            Client(d.socket) as c:
        s = c.open_session(SESSION_DUMP, dfd)
        r = as_nobody(d.socket, f"""
            c = Client(sock)
            print("HELLO", c.hello.server)
            print("SESSIONS", len(c.sessions()))
            c.wait({s.token!r}, 0)
        """)
        assert "HELLO vramd" in r.stdout, r.stdout + r.stderr
        assert "SESSIONS 0" in r.stdout  # another uid's sessions are not listed
        assert "ERROR PERMISSION_DENIED" in r.stdout and "another uid" in r.stdout
        c.cancel(s.token)
        with pytest.raises(JobCancelledError):
            c.wait(s.token)


def raw_connect(path: str) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    s.settimeout(30)
    s.connect(path)
    return s


def exchange(s: socket.socket, data: bytes, fds=()) -> list[rpc.Response]:
    """Send one packet, read responses until the daemon closes the connection (or one arrives)."""
    anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))] if fds else []
    s.sendmsg([data], anc)
    out = []
    while True:
        pkt = s.recv(1 << 20)
        if not pkt:
            return out
        out.append(decode_response(pkt))
        if out[-1].error.code == rpc.OK:
            return out


def hello() -> bytes:
    return encode_request(rpc.Request(id=1, hello=rpc.Hello(versions=list(PROTOCOL_VERSIONS))))


def test_malformed_frames_get_an_error_and_a_closed_connection(run_dir, tmp_path):
    cfg = tmp_path / "vramd.toml"
    cfg.write_text('max_message_bytes = "8K"\ngrace_period = 0.1\n')
    with DaemonProcess(run_dir, "--config", str(cfg)) as d, Client(d.socket) as watcher:
        baseline = d.fds()
        bo = memfd(b"y" * 4096)
        cases = [
            (b"garbage that is no frame", (), rpc.PROTOCOL_ERROR),
            (b"VRDP\x01\x01\x00\x00\xff\x00\x00\x00short", (), rpc.PROTOCOL_ERROR),           # length lies
            (encode_request(rpc.Request(id=1, get_status=rpc.GetStatus())), (), rpc.PROTOCOL_ERROR),  # no hello
            (encode_request(rpc.Request(id=1, hello=rpc.Hello(versions=[99]))), (), rpc.UNSUPPORTED_PROTOCOL),
            (b"VRDP\x01\x01\x00\x00" + (9000).to_bytes(4, "little") + b"\0" * 9000, (), rpc.LIMIT_EXCEEDED),
            (b"not a frame, with fds attached", (bo, bo, bo), rpc.PROTOCOL_ERROR),
        ]
        for data, fds, code in cases:
            s = raw_connect(d.socket)
            got = exchange(s, data, fds)
            assert [r.error.code for r in got] == [code], (data[:20], got)
            s.close()
        # a valid hello, then a body protobuf cannot parse
        s = raw_connect(d.socket)
        assert exchange(s, hello())[0].hello.version == PROTOCOL_VERSIONS[-1]
        bad = b"VRDP\x01\x01\x00\x00" + (3).to_bytes(4, "little") + b"\xff\xff\xff"
        got = exchange(s, bad, (bo,))
        assert got[-1].error.code == rpc.PROTOCOL_ERROR and "undecodable" in got[-1].error.message
        s.close()
        os.close(bo)
        assert watcher.status().connections >= 1  # the other client was served throughout
        # every connection above was closed by the daemon (we saw EOF), every fd it got is closed
        assert d.fds() == baseline


def test_client_killed_mid_session_leaves_no_fds(daemon, image_dir):
    with Client(daemon.socket) as c:
        baseline = daemon.fds()
        code = textwrap.dedent(f"""
            import os, sys
            from vramd.client import Client, ClientBo, SESSION_DUMP
            c = Client({daemon.socket!r})
            dfd = os.open({str(image_dir[0])!r}, os.O_RDONLY | os.O_DIRECTORY)
            bos = []
            for i in range(20):
                fd = os.memfd_create("bo"); os.ftruncate(fd, 1 << 20); bos.append(ClientBo(i + 1, fd, size=1 << 20))
            s = c.open_session(SESSION_DUMP, dfd, label="doomed")
            c.add_bos(s.token, bos)
            print(s.session_id, flush=True)
            sys.stdin.read()
        """)
        child = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stdin=subprocess.PIPE,
                                 stdout=subprocess.PIPE, text=True)
        sid = int(child.stdout.readline())
        assert len(daemon.fds()) >= len(baseline) + 22  # its connection, its data file, 20 BO fds
        child.send_signal(signal.SIGKILL)
        child.wait()
        daemon.expect_log(f"session {sid} \\(dump, uid 0, pid \\d+\\): SESSION_CANCELLED")
        assert daemon.fds() == baseline
        assert c.status().sessions == 0
        child.stdin.close()
        child.stdout.close()
    # No committed image.  The killed client's temporary is left (the daemon touches no name): vramd's own
    # naming, removed by the next dump into the directory, or vramctl gc.
    leftovers = [n for n in os.listdir(image_dir[0]) if n != ".lock"]  # .lock: the killed client's, harmless
    assert leftovers and all(is_own_temporary(n) for n in leftovers), leftovers
    DumpDirectory(image_dir[1]).close()  # what the next dump does first
    assert os.listdir(image_dir[0]) == []


def test_sigterm_during_dump_commits_nothing_and_cleans_up(run_dir, image_dir):
    with DaemonProcess(run_dir, "--drain-timeout", "0.2") as d, Client(d.socket) as c:
        bo = memfd(os.urandom(2 << 20))
        s = c.open_session(SESSION_DUMP, d and image_dir[1])
        c.add_bos(s.token, [ClientBo(1, bo, size=2 << 20)])  # never sealed: the drain cannot finish it
        d.terminate()
        d.expect_log("drain timeout")
        with pytest.raises((JobCancelledError, NotFoundError, ConnectionError)):  # cancelled, maybe reaped already
            c.wait(s.token)
        assert d.stop() == 0
        os.close(bo)
    assert os.listdir(image_dir[0]) == []
    assert not os.path.exists(d.socket)


def test_permission_error_type_roundtrips():
    # the wire code of every typed error maps back to its class
    from vramd.protocol import error_from_pb, error_to_pb
    e = error_from_pb(error_to_pb(PermissionDeniedError("no", bo_id=3, offset=4096)))
    assert isinstance(e, PermissionDeniedError) and (e.bo_id, e.offset) == (3, 4096)


def test_limits_give_typed_errors(run_dir, tmp_path):
    from vramd.errors import LimitExceededError
    cfg = tmp_path / "limits.toml"
    cfg.write_text("max_sessions_per_uid = 2\nmax_bos_per_session = 3\n")
    dirs = []
    for i in range(3):
        p = tmp_path / f"img{i}"
        p.mkdir()
        dirs.append(os.open(p, os.O_RDONLY | os.O_DIRECTORY))
    bo = memfd(b"z" * 4096)
    with DaemonProcess(run_dir, "--config", str(cfg)) as d, Client(d.socket) as c:
        s1 = c.open_session(SESSION_DUMP, dirs[0])
        c.open_session(SESSION_DUMP, dirs[1])
        with pytest.raises(LimitExceededError, match="2 sessions"):
            c.open_session(SESSION_DUMP, dirs[2])
        with pytest.raises(LimitExceededError, match="more than 3 BOs"):
            c.add_bos(s1.token, [ClientBo(i + 1, bo, size=4096) for i in range(4)])
        c.add_bos(s1.token, [ClientBo(i + 1, bo, size=4096) for i in range(3)])  # within the limit: fine
        c.start(s1.token)
        assert c.wait(s1.token).progress.bos_done == 3
    for fd in [*dirs, bo]:
        os.close(fd)


def test_restore_failing_before_start_ends_the_session(daemon, image_dir):
    """A copy that fails while the client is still adding BOs ends the session at once."""
    from vramd.client import SESSION_RESTORE
    from vramd.errors import UnmappedRangeError
    from vramd.testing import Workload
    _, dfd = image_dir
    size = 3 << 20
    src = memfd(os.urandom(size))
    with Client(daemon.socket) as c:
        s = c.open_session(SESSION_DUMP, dfd)
        c.add_bos(s.token, [ClientBo(1, src, size=size)])
        c.start(s.token)
        c.wait(s.token)
        c.close_session(s.token)
        # the target's ends are mapped (add's probe passes), its middle is not
        with Workload([{"size": size, "fill": "blank", "holes": [[1 << 20, 1 << 20]]}]) as w:
            mem = w.open_mem(os.O_RDWR)
            r = c.open_session(SESSION_RESTORE, dfd)
            c.add_bos(r.token, [ClientBo(1, mem, offset=w.regions[0]["addr"], backend="procmem")])
            with pytest.raises(UnmappedRangeError) as e:
                c.wait(r.token)  # never sealed: only the failure can end it
            assert e.value.bo_id == 1 and e.value.offset is not None and e.value.offset >= 1 << 20
            assert c.progress(r.token).state == rpc.SESSION_FAILED
            os.close(mem)
    os.close(src)


def _kill_once_copying(c: Client, token: str, proc: subprocess.Popen) -> None:
    """SIGKILL the process whose memory the started session `token` moves, once its first bytes moved."""
    while c.progress(token).progress.bytes_done == 0:  # the copy has begun
        pass
    proc.kill()
    proc.wait()


def _serves_another_client(daemon, tmp_path) -> None:
    """The daemon is alive and dumps another client's BO."""
    other = tmp_path / "after"
    other.mkdir()
    ofd = os.open(other, os.O_RDONLY | os.O_DIRECTORY)
    data = os.urandom(1 << 20)
    src = memfd(data)
    try:
        with Client(daemon.socket) as c:
            info = c.run_session(SESSION_DUMP, ofd, [ClientBo(1, src, size=len(data), backend="mmap")])
            assert info.image.bo_bytes == len(data)
    finally:
        os.close(src)
        os.close(ofd)
    assert daemon.proc.poll() is None


def test_memfd_truncated_mid_dump_fails_that_session_only(daemon, image_dir, tmp_path):
    """A client passes a 4 GiB memfd as an mmap BO and truncates it to 0 while the daemon dumps it.

    Mapping the memfd would make the next access SIGBUS and kill the daemon;
    memfds are read with pread instead, which comes back short: one typed
    error for that session, naming the BO and where the bytes ended, and the
    daemon goes on serving."""
    _, dfd = image_dir
    size = 4 << 30
    fd = os.memfd_create("shrinks")
    try:
        os.ftruncate(fd, size)  # sparse: reads as zeros, costs no memory until written
        os.pwrite(fd, os.urandom(1 << 20), 0)
        with Client(daemon.socket) as c:
            s = c.open_session(SESSION_DUMP, dfd)
            c.add_bos(s.token, [ClientBo(7, fd, size=size, backend="mmap")])
            c.start(s.token)
            while c.progress(s.token).progress.bytes_done == 0:  # the copy has begun
                pass
            os.ftruncate(fd, 0)
            with pytest.raises(TargetTooSmallError) as ei:
                c.wait(s.token)
            assert ei.value.bo_id == 7 and 0 < ei.value.offset < size
            assert "truncated" in ei.value.message
    finally:
        os.close(fd)
    _serves_another_client(daemon, tmp_path)


def test_a_memfd_sealed_to_its_size_is_mapped_and_its_owner_cannot_make_the_daemon_fault(daemon, image_dir,
                                                                                         tmp_path):
    """A memfd sealed against shrinking is mapped, as a dmabuf is: its owner cannot cut it short under the mapping
    (ftruncate fails), and punching holes in it while the daemon copies only turns bytes to zeros.  The session
    ends DONE and the daemon goes on serving."""
    import ctypes

    from helpers import seal_size
    _, dfd = image_dir
    size = 4 << 30
    fd = os.memfd_create("sealed", os.MFD_ALLOW_SEALING)
    libc = ctypes.CDLL(None, use_errno=True)
    try:
        os.ftruncate(fd, size)  # sparse: reads as zeros, costs no memory until written
        os.pwrite(fd, os.urandom(1 << 20), 0)
        seal_size(fd)
        maps = f"/proc/{daemon.proc.pid}/maps"
        with Client(daemon.socket) as c:
            s = c.open_session(SESSION_DUMP, dfd)
            c.add_bos(s.token, [ClientBo(7, fd, size=size, backend="mmap")])
            c.start(s.token)
            mapped = False
            while not mapped and c.progress(s.token).state != rpc.SESSION_DONE:
                with open(maps) as f:
                    mapped = "/memfd:sealed" in f.read()
            assert mapped, "the daemon never mapped the sealed memfd"
            with pytest.raises(PermissionError):
                os.ftruncate(fd, 0)
            # FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE over everything, while the copy runs
            assert libc.fallocate(fd, 3, ctypes.c_long(0), ctypes.c_long(size)) == 0, os.strerror(ctypes.get_errno())
            assert c.wait(s.token).state == rpc.SESSION_DONE
    finally:
        os.close(fd)
    assert daemon.proc.poll() is None
    _serves_another_client(daemon, tmp_path)


@pytest.fixture
def huge_pages():
    """Two more huge pages in the system's pool for the test (root; the pool is put back after): their size."""
    with open("/proc/meminfo") as f:
        size = next(int(line.split()[1]) << 10 for line in f if line.startswith("Hugepagesize:"))
    path = "/proc/sys/vm/nr_hugepages"
    with open(path) as f:
        before = int(f.read())
    try:
        with open(path, "w") as f:
            f.write(str(before + 2))
        with open(path) as f:
            got = int(f.read())
    except OSError as e:
        pytest.skip(f"no huge pages to be had here: {e}")
    try:
        if got < before + 2:
            pytest.skip(f"the kernel gave {got - before} of 2 huge pages")
        yield size
    finally:
        with open(path, "w") as f:
            f.write(str(before))


def _punch_and_take_every_huge_page(fd: int, size: int) -> list:
    """What a hostile owner of a huge-page memfd does: punch its pages out (FALLOC_FL_PUNCH_HOLE |
    FALLOC_FL_KEEP_SIZE: they go back to the pool, with their reservations), then take every free huge page
    of the pool (the mappings returned hold them until closed)."""
    import ctypes
    import mmap
    libc = ctypes.CDLL(None, use_errno=True)
    assert libc.fallocate(fd, 3, ctypes.c_long(0), ctypes.c_long(size)) == 0, os.strerror(ctypes.get_errno())
    hogs = []
    while True:
        hog = os.memfd_create("hog", os.MFD_HUGETLB)
        try:
            os.ftruncate(hog, size)
            m = mmap.mmap(hog, size)
            m[:1] = b"\1"
        except OSError:
            return hogs
        finally:
            os.close(hog)
        hogs.append(m)


def test_a_huge_page_memfd_is_never_mapped_so_its_owner_cannot_make_the_daemon_fault(daemon, image_dir, tmp_path,
                                                                                      huge_pages):
    """A memfd of huge pages (MFD_HUGETLB) takes F_SEAL_SHRINK, but its owner can still punch holes in it, and a
    hole of hugetlbfs is backed by no zero page: touching one through a mapping needs a free huge page, and
    where its owner took them all the kernel raises SIGBUS (a review reproduced it killing the process of
    the copy thread).  So the daemon reads and writes such a memfd with pread/pwrite and never maps it: here,
    with its page punched out and every free huge page taken (before the fix: the mapping itself failed), a
    dump of it reads zeros and ends DONE; a restore into one is a typed error naming the BO (hugetlbfs takes
    no write(2)); the daemon goes on serving."""
    import mmap

    from helpers import seal_size
    size = huge_pages
    fd = os.memfd_create("huge", os.MFD_HUGETLB | os.MFD_ALLOW_SEALING)
    hogs: list[mmap.mmap] = []
    try:
        os.ftruncate(fd, size)
        with mmap.mmap(fd, size) as m:  # the BO's bytes: one huge page
            m[:] = os.urandom(size)
        seal_size(fd)
        hogs = _punch_and_take_every_huge_page(fd, size)  # the page goes back to the pool, and its owner takes it
        assert len(hogs) >= 2
        maps = f"/proc/{daemon.proc.pid}/maps"
        with Client(daemon.socket) as c:
            info = c.run_session(SESSION_DUMP, image_dir[1], [ClientBo(3, fd, size=size, backend="mmap")])
            assert info.state == rpc.SESSION_DONE and info.image.bo_count == 1
            with open(maps) as f:
                assert "/memfd:huge" not in f.read()
            dst = os.memfd_create("huge-target", os.MFD_HUGETLB | os.MFD_ALLOW_SEALING)
            try:
                os.ftruncate(dst, size)
                seal_size(dst)
                with pytest.raises(VramdError) as e:
                    c.run_session(SESSION_RESTORE, image_dir[1], [ClientBo(3, dst, backend="mmap")])
                assert e.value.bo_id == 3 and e.value.code != "INTERNAL"
            finally:
                os.close(dst)
    finally:
        for m in hogs:
            m.close()
        os.close(fd)
    assert daemon.proc.poll() is None
    _serves_another_client(daemon, tmp_path)


def test_a_window_that_cannot_be_faulted_in_is_an_error_before_any_touch(huge_pages):
    """populate (MADV_POPULATE_READ/WRITE) tells where touching a mapping would raise SIGBUS, without touching
    it, and the mmap backend turns that answer into a typed error naming the BO.  The case: a huge-page memfd
    mapped as a dmabuf is (its page reserved and faulted in), then that page punched out by its owner (its
    reservation goes with it) and every free huge page taken."""
    import errno
    import mmap

    from vramd.backends import BackendOptions, BoRef, Direction, MmapBackend
    from vramd.backends.mmapfd import _MappedBo
    from vramd.errors import BackendError
    from vramd.hostmem.libc import populate
    size = huge_pages
    fd = os.memfd_create("huge", os.MFD_HUGETLB)
    backend = MmapBackend(BackendOptions())
    hogs: list[mmap.mmap] = []
    h = _MappedBo(9, BoRef("mmap", fd, 0), size, 0, Direction.READ)  # the mapped path, as open gives a dmabuf
    try:
        os.ftruncate(fd, size)
        assert backend.endpoint(h, 0, size)[0] == -1  # mapped, and its page faulted in
        hogs = _punch_and_take_every_huge_page(fd, size)
        assert populate(h.base, size, writing=False) in (errno.EFAULT, errno.ENOMEM)
        with pytest.raises(BackendError, match="cannot be faulted in") as e:
            backend.endpoint(h, 0, size)
        assert e.value.bo_id == 9 and e.value.offset == 0
    finally:
        backend.release(h)
        for m in hogs:
            m.close()
        os.close(fd)


def test_image_files_the_client_attaches_are_checked(daemon, image_dir, tmp_path):
    """The daemon takes only regular files open for the access it needs, and an O_DIRECT twin only where it
    is the very file opened with O_DIRECT for that access: each refusal is BAD_DESCRIPTOR naming the file."""
    from vramd.errors import BadDescriptorError, InvalidRequestError
    from vramd.image.names import data_file_name
    from vramd.protocol import requests
    from vramd.protocol.client import ClientFile
    d = tmp_path / "files"
    d.mkdir()
    with Client(daemon.socket) as c:
        s = c.open_session(SESSION_DUMP, image_dir[1])
        name = data_file_name(s.image_id, 0)

        def attach(*fds: int, gpu: int = 0, as_name: str = name) -> None:
            f = ClientFile(0, as_name, fds[0], fds[1] if len(fds) > 1 else None, gpu)
            from vramd.protocol import raise_for_error
            raise_for_error(c.exchange(requests.attach_files(s.token, [f])))
        ro = os.open(d / "ro", os.O_RDONLY | os.O_CREAT, 0o600)
        rw = os.open(d / "rw", os.O_RDWR | os.O_CREAT, 0o600)
        other = os.open(d / "other", os.O_RDWR | os.O_CREAT, 0o600)
        r, w = os.pipe()
        try:
            with pytest.raises(BadDescriptorError, match=rf"{name}\.tmp is not open for reading and writing"):
                attach(ro)
            with pytest.raises(BadDescriptorError, match=rf"{name}\.tmp is not a regular file"):
                attach(r)
            with pytest.raises(InvalidRequestError, match="must be data-"):
                attach(rw, as_name="data-0123456789abcdef-00000000.vrd")
            try:
                twin_ro = os.open(d / "rw", os.O_RDONLY | os.O_DIRECT)
                twin_other = os.open(d / "other", os.O_WRONLY | os.O_DIRECT)
            except OSError:
                pytest.skip("no O_DIRECT on this file system")
            try:
                with pytest.raises(BadDescriptorError, match="is not open for writing"):
                    attach(rw, twin_ro)
                with pytest.raises(BadDescriptorError, match="is another file"):
                    attach(rw, twin_other)
                plain = os.open(d / "rw", os.O_WRONLY)  # the same file, without O_DIRECT
                try:
                    with pytest.raises(BadDescriptorError, match="not opened with O_DIRECT"):
                        attach(rw, plain)
                finally:
                    os.close(plain)
            finally:
                os.close(twin_ro)
                os.close(twin_other)
        finally:
            for fd in (ro, rw, other, r, w):
                os.close(fd)
        c.close_session(s.token)


@pytest.mark.parametrize("when", ["before start", "mid copy"])
def test_source_process_exiting_mid_dump_fails_that_session_only(daemon, image_dir, tmp_path, when):
    """A procmem dump whose process exits (its /proc/<pid>/mem then reads as nothing): one typed error naming
    the BO and where its bytes ended, no committed image, and the daemon goes on."""
    size = 4 << 30  # untouched anonymous memory: reads as zeros, costs nothing, takes a while to move
    with Workload([{"size": 1 << 20, "fill": "random", "seed": 1}, {"size": size, "fill": "zero"}]) as w, \
            Client(daemon.socket) as c:
        mem = w.open_mem()
        try:
            s = c.open_session(SESSION_DUMP, image_dir[1])
            c.add_bos(s.token, [ClientBo(i + 1, mem, offset=r["addr"], size=r["size"], backend="procmem")
                                for i, r in enumerate(w.regions)])
            if when == "before start":
                w.proc.kill()
                w.proc.wait()
            c.start(s.token)
            if when == "mid copy":
                _kill_once_copying(c, s.token, w.proc)
            with pytest.raises(UnmappedRangeError) as ei:
                c.wait(s.token)
        finally:
            os.close(mem)
    e = ei.value
    assert e.bo_id in (1, 2) and e.offset is not None, e
    if when == "mid copy":
        assert e.bo_id == 2 and 0 < e.offset < size, e
    assert "manifest.vrdm" not in os.listdir(image_dir[0])
    _serves_another_client(daemon, tmp_path)


def test_target_process_exiting_mid_restore_fails_that_session_only(daemon, image_dir, tmp_path):
    """The restored task dies while its memory is being written: one typed error, the daemon goes on."""
    size = 1 << 30
    spec = [{"size": size, "fill": "zero", "marks": [[size - 1, "01"]]}]
    with Workload(spec) as w, Client(daemon.socket) as c:
        mem = w.open_mem()
        try:
            c.run_session(SESSION_DUMP, image_dir[1],
                          [ClientBo(1, mem, offset=w.regions[0]["addr"], size=size, backend="procmem")])
        finally:
            os.close(mem)
        regions = w.regions
    with Workload(blank_spec_like(regions)) as dst, Client(daemon.socket) as c:
        mem = dst.open_mem(os.O_RDWR)
        try:
            s = c.open_session(SESSION_RESTORE, image_dir[1])
            c.add_bos(s.token, [ClientBo(1, mem, offset=regions[0]["addr"], size=size, backend="procmem")])
            c.start(s.token)
            _kill_once_copying(c, s.token, dst.proc)
            with pytest.raises(UnmappedRangeError) as ei:
                c.wait(s.token)
        finally:
            os.close(mem)
    assert ei.value.bo_id == 1 and 0 < ei.value.offset < size, ei.value
    _serves_another_client(daemon, tmp_path)


def _uid_of(name: str) -> int | None:
    try:
        return pwd.getpwnam(name).pw_uid
    except KeyError:
        return None


USERS = [u for u in (_uid_of("nobody"), _uid_of("daemon")) if u is not None]


def as_user_session(uid: int, sock_path: str, dirs: list[str]) -> subprocess.Popen:
    """A child that drops to `uid` (its own gid, no other group) before connecting, opens a dump session on each
    directory of `dirs`, says "opened", and at a line on stdin prints what GetStatus and ListSessions show it."""
    gid = pwd.getpwuid(uid).pw_gid
    code = textwrap.dedent(f"""
        import json, os, sys
        from vramd.client import Client, SESSION_DUMP
        os.setgroups([]); os.setgid({gid}); os.setuid({uid})
        with Client({sock_path!r}) as c:
            for d in {dirs!r}:
                c.open_session(SESSION_DUMP, os.open(d, os.O_RDONLY | os.O_DIRECTORY))
            print("opened", flush=True)
            sys.stdin.readline()
            st = c.status()
            print(json.dumps({{"connections": st.connections, "sessions": st.sessions, "metrics": st.metrics,
                              "staging_in_use": st.staging_in_use, "listed": [s.uid for s in c.sessions()]}}),
                  flush=True)
            sys.stdin.readline()
    """)
    return subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, text=True, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE)


@needs_root
@pytest.mark.skipif(len(USERS) < 2, reason="needs the users nobody and daemon")
def test_a_user_sees_only_its_own_sessions_and_counts(run_dir, image_dir):
    """Two unprivileged users (nobody, daemon) and root, each with sessions open: GetStatus and ListSessions
    show each user its own connections and sessions only, and no metrics (they count every user's work);
    root, the operator, sees all of it.  Before, any allowed uid saw every uid's counts and the metrics."""
    a, b = USERS
    dirs: dict[int, list[str]] = {}
    for uid, n in ((a, 1), (b, 2)):  # a dump's directory each, the user's own
        dirs[uid] = []
        for i in range(n):
            p = os.path.join(run_dir, f"img-{uid}-{i}")
            os.mkdir(p)
            os.chown(p, uid, pwd.getpwuid(uid).pw_gid)
            dirs[uid].append(p)
    allow = [arg for uid in (0, a, b) for arg in ("--allow-uid", str(uid))]
    with DaemonProcess(run_dir, "--socket-mode", "666", *allow) as d, Client(d.socket) as root:
        root.open_session(SESSION_DUMP, image_dir[1])
        children = {uid: as_user_session(uid, d.socket, dirs[uid]) for uid in (a, b)}
        try:
            for child in children.values():
                assert child.stdout.readline().strip() == "opened"
            seen = {}
            for uid, child in children.items():
                child.stdin.write("\n")
                child.stdin.flush()
                seen[uid] = json.loads(child.stdout.readline())
            st = root.status()
            assert (st.connections, st.sessions) == (3, 4)  # the operator sees everyone
            assert "vramd_sessions_active 4" in st.metrics
            assert sorted(s.uid for s in root.sessions()) == sorted([0, a, b, b])
        finally:
            for child in children.values():
                child.communicate("\n", timeout=60)
        for uid, n in ((a, 1), (b, 2)):
            assert seen[uid] == {"connections": 1, "sessions": n, "metrics": "", "staging_in_use": 0,
                                 "listed": [uid] * n}, (uid, seen[uid])
