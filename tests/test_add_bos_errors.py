"""AddBos errors, black-box over a real daemon: a BO fd the backend cannot copy through is BAD_DESCRIPTOR up front,
an AddBos that fails the session makes it FAILED at once, and messages name the BO, never the daemon's own fd
numbers (which mean nothing to the client)."""
from __future__ import annotations

import os
import re
import socket

import pytest
from helpers import memfd, open_dir

from vramd.client import SESSION_DUMP, SESSION_RESTORE, Client, ClientBo
from vramd.errors import BackendUnavailableError, BadDescriptorError, TargetTooSmallError
from vramd.pb import rpc_pb2 as rpc
from vramd.testing import Workload

DAEMON_FD = re.compile(r"\bfd \d+")  # "fd 20 holds 4096 bytes": a number from the daemon's fd table


def kinds(tmp_path) -> dict[str, tuple[int, ...]]:
    """fds of objects the mmap backend cannot copy a BO through, open read-write (what a restore needs):
    (the BO's fd, others to close with it)."""
    os.mkfifo(tmp_path / "fifo")
    a, b = socket.socketpair()
    return {"a pipe or FIFO": (os.open(tmp_path / "fifo", os.O_RDWR | os.O_NONBLOCK),),
            "a socket": (a.detach(), b.detach()),
            "an anonymous inode that is not a dmabuf": (os.eventfd(0),),
            "a character device (1:3) that is not a DRM device": (os.open("/dev/null", os.O_RDWR),)}


@pytest.mark.parametrize("kind", ["a pipe or FIFO", "a socket", "an anonymous inode that is not a dmabuf",
                                  "a character device (1:3) that is not a DRM device"])
@pytest.mark.parametrize("kind_of_session", [SESSION_DUMP, SESSION_RESTORE])
def test_an_mmap_bo_on_a_pipe_or_socket_is_bad_descriptor_at_add_bos(daemon, image_dir, tmp_path, kind,
                                                                      kind_of_session):
    _, dfd = image_dir
    fds = kinds(tmp_path)
    try:
        with Client(daemon.socket) as c:
            if kind_of_session == SESSION_RESTORE:  # an image with BO 5 to restore into it
                src = memfd(b"r" * 8192)
                c.run_session(SESSION_DUMP, dfd, [ClientBo(5, src, size=8192)])
                os.close(src)
            s = c.open_session(kind_of_session, dfd)
            bo = fds[kind][0]
            with pytest.raises(BadDescriptorError) as e:  # the empty backend picks mmap for all but /proc/<pid>/mem
                c.add_bos(s.token, [ClientBo(5, bo, size=8192)])
            assert e.value.bo_id == 5 and f"BO 5's fd is {kind}" in e.value.message, e.value.message
            assert "Errno" not in e.value.message and not DAEMON_FD.search(e.value.message), e.value.message
            info = c.progress(s.token)  # the session failed with it, at once
            assert info.state == rpc.SESSION_FAILED and info.error.code == rpc.BAD_DESCRIPTOR
            with pytest.raises(BadDescriptorError):
                c.wait(s.token)
            c.close_session(s.token)
    finally:
        for group in fds.values():
            for fd in group:
                os.close(fd)


def test_an_add_bos_that_fails_the_session_makes_it_failed_at_once(daemon, image_dir):
    """Copies under way (a slow compression) keep the job running a while after the failure: GetProgress right
    after the failed AddBos says FAILED with its error, not OPEN, though the copies are still stopping."""
    _, dfd = image_dir
    with Workload([{"size": 16 << 20, "fill": "hex", "seed": 1}]) as w, Client(daemon.socket) as c:
        mem = w.open_mem()
        small = memfd(b"x" * 100)
        try:
            s = c.open_session(SESSION_DUMP, dfd, compression="zstd:19")
            c.add_bos(s.token, [ClientBo(1, mem, offset=w.regions[0]["addr"], size=16 << 20)])
            with pytest.raises(TargetTooSmallError) as e:
                c.add_bos(s.token, [ClientBo(9, small, size=1 << 20, gpu_id=0)])
            info = c.progress(s.token)
            assert rpc.SessionState.Name(info.state) == "SESSION_FAILED"
            assert info.error.code == rpc.TARGET_TOO_SMALL and info.error.bo_id == 9
            assert info.error.message == e.value.message
            # the message names the BO, not the daemon's fd number for the memfd
            assert "BO 9" in e.value.message and "holds 100 bytes" in e.value.message, e.value.message
            assert not DAEMON_FD.search(e.value.message), e.value.message
            with pytest.raises(TargetTooSmallError):
                c.wait(s.token)
            c.close_session(s.token)
        finally:
            os.close(mem)
            os.close(small)


def test_bad_bo_fds_are_named_by_their_bo(daemon, image_dir, tmp_path):
    """A directory, a write-only fd for a dump, a read-only one for a restore: BAD_DESCRIPTOR naming the BO."""
    _, dfd = image_dir
    (tmp_path / "d").mkdir()
    f = tmp_path / "f"
    f.write_bytes(b"y" * 4096)
    cases = [(SESSION_DUMP, open_dir(tmp_path / "d"), "is a directory"),
             (SESSION_DUMP, os.open(f, os.O_WRONLY), "is write-only"),
             (SESSION_RESTORE, os.open(f, os.O_RDONLY), "is read-only")]
    with Client(daemon.socket) as c:
        c.run_session(SESSION_DUMP, dfd, [ClientBo(3, os.open(f, os.O_RDONLY), size=4096)])
        for kind, fd, what in cases:
            s = c.open_session(kind, dfd)
            with pytest.raises(BadDescriptorError) as e:
                c.add_bos(s.token, [ClientBo(3, fd, size=4096)])
            assert e.value.bo_id == 3 and f"the fd of BO 3 {what}" in e.value.message, e.value.message
            assert not DAEMON_FD.search(e.value.message), e.value.message
            c.close_session(s.token)
            os.close(fd)


@pytest.mark.parametrize("backend", ["nvme", "sdma"])
@pytest.mark.parametrize("kind_of_session", [SESSION_DUMP, SESSION_RESTORE])
def test_a_backend_vramd_does_not_have_is_backend_unavailable_naming_the_bo(daemon, image_dir, kind_of_session,
                                                                           backend):
    """A BO naming a backend no daemon has ("nvme"), or one this daemon cannot use here (sdma without a GPU):
    BACKEND_UNAVAILABLE naming the BO and the backend as the client named it, when the job reaches it (the BOs
    before it were taken), and the session fails with it."""
    _, dfd = image_dir
    data = memfd(b"b" * 8192)
    other = memfd(b"c" * 4096)
    try:
        with Client(daemon.socket) as c:
            if any(b.name == backend and b.available for b in c.hello.backends):
                pytest.skip(f"this daemon has the {backend} backend")
            if kind_of_session == SESSION_RESTORE:  # an image with BOs 1 and 2 to restore
                c.run_session(SESSION_DUMP, dfd, [ClientBo(1, other, size=4096), ClientBo(2, data, size=8192)])
            s = c.open_session(kind_of_session, dfd)
            with pytest.raises(BackendUnavailableError) as e:
                c.add_bos(s.token, [ClientBo(1, other, size=4096, backend="mmap"),
                                    ClientBo(2, data, size=8192, backend=backend)])
            assert e.value.bo_id == 2 and f"backend '{backend}' is not available" in e.value.message, e.value.message
            info = c.progress(s.token)
            assert info.state == rpc.SESSION_FAILED and info.error.code == rpc.BACKEND_UNAVAILABLE
            with pytest.raises(BackendUnavailableError):
                c.wait(s.token)
            c.close_session(s.token)
    finally:
        os.close(data)
        os.close(other)
