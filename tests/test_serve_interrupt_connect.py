"""vramd.oci.interrupt against a request whose connection is still being made when the Interrupt fires (a
`vramctl pull --serve` stopped by SIGTERM as its downloads open their connections): the request is cut as soon
as the connection exists, not after the registry's read timeout while the answer's head never comes.

The registry here is a real TCP listener whose accept queue is full (backlog 0, one connection waiting), so the
client's connect waits for its SYN to be retried; the Interrupt fires while the client thread sleeps in
poll(2) for its connect; then the queue is drained and the listener takes the request and never answers it."""
from __future__ import annotations

import hashlib
import os
import socket
import threading
import time

import pytest

from vramd.oci.interrupt import Interrupt, Interrupted
from vramd.oci.registry import Registry
from vramd.oci.tls import Trust


def _in_connect(tid: int) -> bool:
    """Whether thread `tid` of this process sleeps in poll(2) (x86-64: syscall 7): a connect with a timeout
    waits there, and nothing else can, the listener's queue being full."""
    with open(f"/proc/self/task/{tid}/syscall") as f:
        return f.read().split()[0] == "7"


@pytest.mark.skipif(os.uname().machine != "x86_64", reason="reads x86-64 syscall numbers in /proc")
def test_an_interrupt_while_connecting_cuts_the_request_once_connected():
    lsock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    lsock.bind(("127.0.0.1", 0))
    lsock.listen(0)
    waiting = socket.create_connection(lsock.getsockname())  # the queue is full: the next SYN is dropped
    port = lsock.getsockname()[1]
    reg = Registry(f"127.0.0.1:{port}", trust=Trust(plain_http=True), timeout=100.0)
    interrupt = Interrupt()
    got: list[BaseException | None] = []
    tid: list[int] = []
    held: list[socket.socket] = []

    def download() -> None:
        tid.append(threading.get_native_id())
        try:
            reg.stream_blob("r", "sha256:" + hashlib.sha256(b"x").hexdigest(), 1, lambda _o, _p: None,
                            interrupt=interrupt)
            got.append(None)
        except BaseException as e:  # what the download ended with, checked below
            got.append(e)

    t = threading.Thread(target=download, daemon=True)
    t.start()
    try:
        deadline = time.monotonic() + 30
        while not (tid and _in_connect(tid[0])):
            assert time.monotonic() < deadline, "the download never connected"
            time.sleep(0.01)
        interrupt.fire()  # the connection is still being made
        first, _ = lsock.accept()  # room in the queue: the retried SYN is taken
        held.append(first)
        conn, _ = lsock.accept()  # the download's connection; its request is never answered
        held.append(conn)
        t.join(30)  # the read timeout is 100 s
        assert not t.is_alive(), "the interrupted request waited for the answer's head"
    finally:
        for s in (*held, waiting, lsock):
            s.close()
        reg.close()
    assert len(got) == 1 and isinstance(got[0], Interrupted), got
