"""Inputs for the fuzz harness: valid messages and frames, their mutations, and hostile fds."""
from __future__ import annotations

import os
import socket
import tempfile

from hypothesis import strategies as st

from vramd.pb import rpc_pb2 as rpc
from vramd.protocol import encode_request
from vramd.protocol.frames import KIND_RESPONSE, encode_frame

u64 = st.integers(0, 2**64 - 1)
u32 = st.integers(0, 2**32 - 1)
small = st.integers(0, 8)
text = st.text(max_size=20)

bos = st.builds(rpc.Bo, id=u64, gpu_id=st.one_of(st.just(0), u32), size=st.one_of(st.integers(0, 1 << 20), u64),
                alloc_flags=u64, va_addr=u64, name=text,
                backend=st.sampled_from(["", "procmem", "mmap", "sdma", "bogus"]), fd_index=small, offset=u64)
tokens = st.one_of(st.just(""), st.text(alphabet="0123456789abcdef", min_size=32, max_size=32), text)

bodies = st.one_of(
    st.builds(lambda v, c: {"hello": rpc.Hello(versions=v, client=c)}, st.lists(u32, max_size=4), text),
    st.builds(lambda k, i, p, comp, cs, lab, ap, tc: {"open_session": rpc.OpenSession(
        kind=k, manifest_fd_index=i, parent_manifest_fd_indexes=p, compression=comp, chunk_size=cs, label=lab,
        allow_partial=ap, topology_checks=tc)},
        st.integers(0, 5), small, st.lists(small, max_size=3),
        st.sampled_from(["", "none", "zstd", "zstd:3", "zstd:99", "lz4"]),
        st.one_of(st.just(0), st.sampled_from([4096, 1 << 20, 3]), u64.map(lambda x: x & 0xFFFFFFFFFFFF)), text,
        st.booleans(), st.dictionaries(st.sampled_from(["KFD_FW_VER_CHECK", "KFD_NUMA_CHECK", "BOGUS"]),
                                       st.booleans(), max_size=2)),
    st.builds(lambda t, b: {"add_bos": rpc.AddBos(token=t, bos=b)}, tokens, st.lists(bos, max_size=6)),
    st.builds(lambda t, m: {"start": rpc.Start(token=t, manifest_fd_index=m)}, tokens, small),
    st.builds(lambda t, f: {"attach_files": rpc.AttachFiles(token=t, files=f)}, tokens, st.lists(st.builds(
        rpc.FileRef, image=small, name=st.one_of(text, st.just("data-0123456789abcdef-00000000.vrd")),
        fd_index=small, direct_fd_index=small, gpu_id=st.one_of(st.just(0), u32)), max_size=4)),
    st.builds(lambda t: {"get_progress": rpc.GetProgress(token=t)}, tokens),
    st.builds(lambda t, ms: {"wait": rpc.Wait(token=t, timeout_ms=ms)}, tokens, st.integers(0, 20)),
    st.builds(lambda t, r: {"cancel": rpc.Cancel(token=t, reason=r)}, tokens, text),
    st.builds(lambda t: {"close_session": rpc.CloseSession(token=t)}, tokens),
    st.just({"get_status": rpc.GetStatus()}),
    st.just({"list_sessions": rpc.ListSessions()}),
    st.just({}),  # no body
)
requests = st.builds(lambda i, b: rpc.Request(id=i, **b), u64, bodies)
request_frames = requests.map(encode_request)

errors = st.builds(rpc.Error, code=st.integers(0, 99), message=text)
responses = st.builds(lambda i, e, kind: rpc.Response(id=i, error=e, **kind), st.integers(0, 4), errors,
                      st.sampled_from([{}, {"hello": rpc.HelloReply(version=1)}, {"session": rpc.SessionInfo()},
                                       {"status": rpc.StatusReply()}, {"sessions": rpc.SessionList()}]))
response_frames = responses.map(lambda r: encode_frame(KIND_RESPONSE, r))


@st.composite
def mutated(draw, valid: st.SearchStrategy[bytes]) -> bytes:
    """A valid blob with a few random edits: flipped bytes, insertions, deletions, truncation, extension."""
    data = bytearray(draw(valid))
    for _ in range(draw(st.integers(0, 4))):
        op = draw(st.sampled_from(["flip", "set", "insert", "delete", "truncate", "extend"]))
        pos = draw(st.integers(0, max(0, len(data) - 1)))
        if op == "flip" and data:
            data[pos] ^= 1 << draw(st.integers(0, 7))
        elif op == "set" and data:
            data[pos] = draw(st.sampled_from([0, 0xFF, 0x7F, 0x80, draw(st.integers(0, 255))]))
        elif op == "insert":
            data[pos:pos] = draw(st.binary(min_size=1, max_size=16))
        elif op == "delete" and data:
            del data[pos:pos + draw(st.integers(1, 16))]
        elif op == "truncate":
            del data[pos:]
        elif op == "extend":
            data += draw(st.binary(max_size=64))
    return bytes(data)


def blobs(valid: st.SearchStrategy[bytes]) -> st.SearchStrategy[bytes]:
    """Random bytes, valid blobs and mutated ones."""
    return st.one_of(st.binary(max_size=512), valid, mutated(valid))


FD_KINDS = ["pipe_r", "pipe_w", "devnull", "dir", "memfd", "memfd0", "file_wo", "socket", "eventfd", "procmem"]
fd_kinds = st.lists(st.sampled_from(FD_KINDS), max_size=5)


class HostileFds:
    """Real fds of awkward kinds; every one made is remembered, so a test can check who closed what."""

    def __init__(self) -> None:
        self.made: list[int] = []
        self._dir = tempfile.mkdtemp(prefix="vramd-fuzz-")

    def make(self, kind: str) -> list[int]:
        """The fds for `kind` (a pipe makes two; only the first is meant to be sent)."""
        if kind in ("pipe_r", "pipe_w"):
            r, w = os.pipe2(os.O_CLOEXEC)
            fds = [r, w] if kind == "pipe_r" else [w, r]
        elif kind == "devnull":
            fds = [os.open(os.devnull, os.O_RDWR | os.O_CLOEXEC)]
        elif kind == "dir":
            fds = [os.open(self._dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)]
        elif kind in ("memfd", "memfd0"):
            fd = os.memfd_create("fuzz", os.MFD_CLOEXEC)
            if kind == "memfd":
                os.ftruncate(fd, 1 << 16)
            fds = [fd]
        elif kind == "file_wo":
            fds = [os.open(os.path.join(self._dir, "wo"), os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o600)]
        elif kind == "socket":
            s1, s2 = socket.socketpair()
            fds = [s1.detach(), s2.detach()]
        elif kind == "eventfd":
            fds = [os.eventfd(0, os.EFD_CLOEXEC)]
        else:  # procmem: this process's memory, read-only (a dump of random addresses reads, never writes)
            fds = [os.open("/proc/self/mem", os.O_RDONLY | os.O_CLOEXEC)]
        self.made += fds
        return fds

    def close(self) -> None:
        for fd in self.made:
            try:
                os.close(fd)
            except OSError:
                pass
        self.made = []
