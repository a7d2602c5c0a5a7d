"""A minimal image streamer for `criu dump/restore --stream` in tests (criu-image-streamer is not
installed here): it speaks CRIU's side of the protocol as criu/img-streamer.c does it, on the
socket CRIU connects to in the images directory.  Per image file CRIU sends a u32 length and an
img_streamer_request_entry (field 1, the file name); at dump the read end of a pipe follows
(SCM_RIGHTS, one dummy byte), which this drains into STORE/<name>; at restore this answers an
img_streamer_reply_entry (field 1, exists) and, if it does, gets the write end and fills it.

    python img_streamer.py capture|serve IMAGES_DIR STORE

It writes IMAGES_DIR/streamer.ready once it listens, and exits when CRIU closes the socket.
"""
from __future__ import annotations

import array
import os
import socket
import struct
import sys
import threading


def _exact(conn: socket.socket, n: int) -> bytes | None:
    buf = b""
    while len(buf) < n:
        part = conn.recv(n - len(buf))
        if not part:
            if buf:
                raise EOFError(f"the streamer socket closed inside a message ({len(buf)} of {n} bytes)")
            return None
        buf += part
    return buf


def _request(conn: socket.socket) -> str | None:
    head = _exact(conn, 4)
    if head is None:
        return None
    (size,) = struct.unpack("<I", head)
    msg = _exact(conn, size)
    if msg is None or len(msg) < 2 or msg[0] != 0x0A:
        raise ValueError(f"not an img_streamer_request_entry: {msg!r}")
    length, shift, pos = 0, 0, 1
    while True:                                  # the name's length, a varint
        b = msg[pos]
        length |= (b & 0x7F) << shift
        pos, shift = pos + 1, shift + 7
        if not b & 0x80:
            break
    name = msg[pos:pos + length].decode()
    if pos + length != len(msg) or not name or "/" in name or name in (".", ".."):
        raise ValueError(f"a file name this streamer does not take: {name!r}")
    return name


def _recv_fd(conn: socket.socket) -> int:
    fds = array.array("i")
    data, anc, _, _ = conn.recvmsg(1, socket.CMSG_SPACE(fds.itemsize))
    for level, kind, payload in anc:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(payload[:fds.itemsize])
    if len(data) != 1 or len(fds) != 1:
        raise ValueError("no pipe end came with the request")
    return fds[0]


def _drain(fd: int, path: str) -> None:
    with os.fdopen(fd, "rb") as src, open(path, "wb") as dst:
        while chunk := src.read(1 << 20):
            dst.write(chunk)


def _fill(fd: int, path: str) -> None:
    with open(path, "rb") as src, os.fdopen(fd, "wb") as dst:
        while chunk := src.read(1 << 20):
            dst.write(chunk)


def main(mode: str, images_dir: str, store: str) -> None:
    name = {"capture": "streamer-capture.sock", "serve": "streamer-serve.sock"}[mode]
    os.makedirs(store, exist_ok=True)
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(os.path.join(images_dir, name))
    srv.listen(1)
    with open(os.path.join(images_dir, "streamer.ready"), "w") as f:
        f.write(mode)
    conn, _ = srv.accept()
    workers = []
    while (file := _request(conn)) is not None:
        path = os.path.join(store, file)
        if mode == "capture":
            work, args = _drain, (_recv_fd(conn), path)
        else:
            exists = os.path.isfile(path)
            conn.sendall(struct.pack("<I", 2) + bytes([0x08, int(exists)]))
            if not exists:
                continue
            work, args = _fill, (_recv_fd(conn), path)
        t = threading.Thread(target=work, args=args)   # CRIU writes (reads) the next file meanwhile
        t.start()
        workers.append(t)
    for t in workers:
        t.join()
    print(f"{mode}: {len(workers)} files")


if __name__ == "__main__":
    main(*sys.argv[1:])
