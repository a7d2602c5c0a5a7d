"""Fuzzing the decoders: frames and messages (both sides), manifests and chunk records.

Invariants: only the typed errors come out (ProtocolError and friends for the
protocol, ImageError subclasses for images), and every fd of a received
packet is closed or owned by exactly one event.
"""
from __future__ import annotations

import fcntl
import mmap
import os
import socket

import zstandard
from hypothesis import example, given
from hypothesis import strategies as st
from strategies import HostileFds, blobs, fd_kinds, mutated, request_frames, response_frames

from vramd.errors import CorruptManifestError, ImageError, ProtocolError, VramdError
from vramd.hostmem.staging import StagingBuffer
from vramd.image.codec import decode_chunk
from vramd.image.format import (
    EMPTY_CHECKSUM,
    MANIFEST_MAGIC,
    MANIFEST_PREFIX,
    TableView,
    _bo_errors,
    _bos_plausible,
    _table_errors,
    _table_plausible,
    checksum,
    decode_manifest,
    decode_record_head,
    encode_manifest,
    encode_record_head,
)
from vramd.pb import image_pb2 as pb
from vramd.pb import rpc_pb2 as rpc
from vramd.protocol import PROTOCOL_VERSIONS, ClientConnection, Received, Reply, ServerProtocol, decode_frame, requests
from vramd.protocol.frames import KIND_REQUEST, KIND_RESPONSE, encode_frame

FLAGS = st.sampled_from([0, 0, 0, socket.MSG_TRUNC, socket.MSG_CTRUNC, socket.MSG_TRUNC | socket.MSG_CTRUNC])


def is_open(fd: int) -> bool:
    try:
        fcntl.fcntl(fd, fcntl.F_GETFD)
    except OSError:
        return False
    return True


# --- frames and messages ------------------------------------------------------------------

@given(data=blobs(request_frames), kind=st.sampled_from([KIND_REQUEST, KIND_RESPONSE]))
def test_decode_frame_raises_only_protocol_error(data, kind):
    try:
        assert isinstance(decode_frame(data, kind), bytes)
    except ProtocolError:
        pass


@given(packets=st.lists(st.tuples(blobs(request_frames), fd_kinds, FLAGS), min_size=1, max_size=4),
       hello_first=st.booleans(), max_fds=st.sampled_from([1, 3, 253]))
def test_server_protocol_never_raises_and_every_fd_has_one_owner(packets, hello_first, max_fds):
    proto = ServerProtocol(rpc.HelloReply(server="fuzz"), 4096, max_fds)
    fds = HostileFds()
    try:
        if hello_first:
            events = proto.receive(_hello(), [])
            assert [type(e) for e in events] == [Reply]
        for data, kinds, flags in packets:
            sent = []
            for k in kinds:
                sent.append(fds.make(k)[0])
            events = proto.receive(data, list(sent), flags)  # never raises: errors are replies
            owned: list[int] = []
            for ev in events:
                assert isinstance(ev, (Received, Reply))
                if isinstance(ev, Received):
                    assert ev.request.WhichOneof("body") not in (None, "hello")
                    owned += [fd for fd in ev.fds._fds if fd is not None]
                    assert len(ev.fds) == len(sent)
                else:
                    assert ev.data[:4] == b"VRDP"
            assert sorted(owned) == sorted(set(owned))  # no fd owned twice
            for fd in sent:
                assert is_open(fd) == (fd in owned), (fd, owned)  # owned, or closed: never leaked
            for ev in events:
                if isinstance(ev, Received):
                    ev.fds.close()
            assert not any(is_open(fd) for fd in sent)
            if proto.closed:
                assert any(isinstance(e, Reply) and e.close for e in events) or not events
    finally:
        fds.close()


def _hello() -> bytes:
    from vramd.protocol import encode_request
    return encode_request(rpc.Request(id=1, hello=rpc.Hello(versions=list(PROTOCOL_VERSIONS))))


@given(data=blobs(response_frames), kinds=fd_kinds, flags=FLAGS, after_hello=st.booleans())
def test_client_protocol_raises_only_typed_errors_and_closes_fds(data, kinds, flags, after_hello):
    proto = ClientConnection("fuzz")
    proto.hello_request()
    if after_hello:
        hello = rpc.HelloReply(version=PROTOCOL_VERSIONS[-1])
        proto.receive(encode_frame(KIND_RESPONSE, rpc.Response(id=1, hello=hello)))
        proto.send(requests.get_status())
    fds = HostileFds()
    try:
        sent = [fds.make(k)[0] for k in kinds]
        try:
            resp = proto.receive(data, sent, flags)
            assert isinstance(resp, rpc.Response)
        except (VramdError, ConnectionError):
            pass
        assert not any(is_open(fd) for fd in sent)  # the daemon never sends fds: any that came are closed
    finally:
        fds.close()


# --- manifests -----------------------------------------------------------------------------

def _manifest(nbos: int, chunk: int, sizes: list[int]) -> pb.Manifest:
    m = pb.Manifest(format_version=1, image_id=bytes(range(16)), writer="fuzz", chunk_size=chunk,
                    files=[pb.DataFile(name="data-0.vrd", gpu_id=0, length=1 << 20)])
    for i, size in enumerate(sizes[:nbos]):
        n = -(-size // chunk)
        m.bos.append(pb.BoEntry(id=i + 1, size=size, record_offsets=[64 * k for k in range(n)],
                                record_lengths=[64] * n))
    return m


def _manifest_v2(nbos: int, chunk: int, sizes: list[int], nparents: int, delta: bool) -> pb.Manifest:
    """A valid format v2 manifest: a chunk table (deltas against a base, entries of parents), BOs refering to it."""
    m = pb.Manifest(format_version=2, image_id=bytes(range(16)), writer="fuzz", chunk_size=chunk,
                    files=[pb.DataFile(name="data-0123456789abcdef-00000000.vrd", gpu_id=0, length=1 << 20)])
    for k in range(nparents):
        m.parents.append(pb.ParentRef(image_id=bytes([k + 1]) * 16, manifest_hash=bytes([k]) * 32,
                                      relative_path=f"../p{k}"))
    t = m.chunks
    for i, size in enumerate(sizes[:nbos]):
        refs = []
        for c in range(-(-size // chunk)):
            n = min(chunk, size - c * chunk)
            if c % 3 == 2:
                refs.append(0)  # a hole
                continue
            t.image.append((c % (nparents + 1)) if nparents else 0)
            t.file_index.append(0)
            t.offset.append(64 * len(t.offset))
            t.length.append(64)
            t.record_checksum.append(c)
            t.raw_length.append(n)
            t.base.append(len(t.image) - 1 if delta and c % 3 == 1 and n == chunk else 0)  # the previous: a full one
            refs.append(len(t.image))
        m.bos.append(pb.BoEntry(id=i + 1, size=size, chunk_refs=refs))
    t.hashes = bytes(32 * len(t.image))
    return m


manifests = st.one_of(
    st.builds(_manifest, st.integers(0, 4), st.sampled_from([4096, 1 << 20]),
              st.lists(st.integers(0, 3 << 20), min_size=4, max_size=4)),
    st.builds(_manifest_v2, st.integers(0, 4), st.sampled_from([4096, 1 << 20]),
              st.lists(st.integers(0, 3 << 20), min_size=4, max_size=4), st.integers(0, 3), st.booleans()),
).map(encode_manifest)


@st.composite
def manifest_blobs(draw) -> bytes:
    """Mutated manifests; half of them re-sealed (prefix and digest fixed up) so the body's checks run."""
    blob = draw(st.one_of(blobs(manifests), mutated(manifests)))
    if draw(st.booleans()) and len(blob) >= MANIFEST_PREFIX.size:
        body = blob[MANIFEST_PREFIX.size:]
        version = draw(st.sampled_from([1, 1, 2, 2, 3]))
        blob = MANIFEST_PREFIX.pack(MANIFEST_MAGIC, version, 0, len(body), checksum(body)) + body
    return blob


def test_the_v2_seed_manifests_are_valid():
    """The fuzzer's v2 seeds pass the checks, so mutations start from manifests the decoder accepts."""
    for parents, delta in ((0, False), (2, True)):
        m = decode_manifest(encode_manifest(_manifest_v2(3, 4096, [3 * 4096, 8192, 5000, 0], parents, delta)))
        assert m.format_version == 2 and len(m.chunks.image) == 6 and len(m.parents) == parents


@given(blob=manifest_blobs())
def test_decode_manifest_raises_only_image_errors(blob):
    try:
        m = decode_manifest(blob)
    except ImageError:
        return
    assert len(m.image_id) == 16 and m.chunk_size > 0


_COLUMNS = ("image", "file_index", "length", "raw_length", "base")
_BO_FIELDS = ("id", "size", "chunk_refs", "record_offsets")
_NEAR_BOUNDS = [0, 1, 2, 3, 7, 4095, 4096, 4097, 1 << 20, (1 << 20) + 1, (1 << 32) - 1]


@given(parents=st.integers(0, 2), delta=st.booleans(), chunk=st.sampled_from([4096, 1 << 20]),
       sizes=st.lists(st.integers(0, 3 << 20), min_size=4, max_size=4),
       edits=st.lists(st.tuples(st.sampled_from(_COLUMNS + _BO_FIELDS), st.integers(0, 40),
                                st.sampled_from(_NEAR_BOUNDS)),
                      min_size=1, max_size=3))
def test_the_quick_v2_checks_agree_with_the_entry_by_entry_ones(parents, delta, chunk, sizes, edits):
    """The v2 table and BO checks answer over whole columns first (`_table_plausible`, `_bos_plausible`) and
    look entry by entry only to name what is wrong: both must find the same manifests wrong."""
    m = _manifest_v2(4, chunk, sizes, parents, delta)
    for field, at, value in edits:  # values near the bounds the checks draw
        if field in _COLUMNS:
            column = getattr(m.chunks, field)
            if column:
                column[at % len(column)] = value
        elif m.bos:
            bo = m.bos[at % len(m.bos)]
            if field == "chunk_refs":
                if bo.chunk_refs:
                    bo.chunk_refs[at % len(bo.chunk_refs)] = value % 64
                else:
                    bo.chunk_refs.append(value % 64)
            elif field == "record_offsets":
                bo.record_offsets.append(value)
            else:
                setattr(bo, field, value)
    t = TableView(m.chunks)
    bos = list(m.bos)
    quick = (_table_plausible(t, chunk, len(m.parents), len(m.files))
             and _bos_plausible(bos, t, chunk))
    try:
        _table_errors(t, chunk, len(m.parents), len(m.files), "x")
        _bo_errors(bos, t, chunk, "x")
        full = True
    except CorruptManifestError:
        full = False
    assert quick == full


# --- chunk records -------------------------------------------------------------------------

@st.composite
def records(draw) -> tuple[bytes, bytes, int, int]:
    """(head, payload, bo_id, offset) of a valid record, then mutated (head re-sealed half the time)."""
    raw = draw(st.binary(min_size=0, max_size=256))
    codec = draw(st.sampled_from([pb.CODEC_RAW, pb.CODEC_ZERO, pb.CODEC_ZSTD]))
    if codec == pb.CODEC_ZERO or not raw:
        codec, payload = pb.CODEC_ZERO, b""
    elif codec == pb.CODEC_ZSTD:
        payload = zstandard.ZstdCompressor(write_checksum=True).compress(raw)
    else:
        payload = raw
    bo_id, offset = draw(st.integers(0, 5)), draw(st.sampled_from([0, 4096]))
    header = pb.ChunkHeader(bo_id=bo_id, offset=offset, raw_length=len(raw), stored_length=len(payload),
                            codec=codec, checksum=checksum(payload) if payload else EMPTY_CHECKSUM)
    head = draw(mutated(st.just(encode_record_head(header))))
    if draw(st.booleans()) and len(head) >= 16:  # fix the header checksum, so the header's fields are checked
        hdr = head[16:]
        head = head[:4] + len(hdr).to_bytes(4, "little") + checksum(hdr).to_bytes(8, "little") + hdr
    payload = draw(st.one_of(st.just(payload), mutated(st.just(payload))))
    return head, payload, len(raw), bo_id, offset


@given(rec=records(), expect=st.tuples(st.integers(0, 5), st.sampled_from([0, 4096])))
def test_decode_record_head_raises_only_image_errors(rec, expect):
    head, _, _, bo_id, offset = rec
    bo_id, offset = expect if expect[0] % 2 else (bo_id, offset)
    try:
        header, n = decode_record_head(head, bo_id=bo_id, offset=offset, where="fuzz")
    except ImageError:
        return
    assert header.bo_id == bo_id and 16 <= n <= len(head)


def _buffer(data: bytes, size: int = 1 << 16) -> StagingBuffer:
    mm = mmap.mmap(-1, size)
    mm[:len(data)] = data
    return StagingBuffer(size, mm)


@given(rec=records(), stored_delta=st.sampled_from([0, 0, 0, -1, 1]), raw_delta=st.sampled_from([0, 0, 1]),
       with_out=st.booleans())
# found by this harness in CI: a compressed record with an empty payload made zstd's frame-header probe raise
# its own ZstdError (INTERNAL on the wire) instead of a CorruptChunkError
@example(rec=(b"VRDC\x0f\x00\x00\x009F\xd01h\x821%\x08\x01\x18\x01(\x031\xc2\x94\xd38\x05\x80\x06-", b"", 1, 1, 0),
         stored_delta=0, raw_delta=0, with_out=True)
# found by the long mode (./dev.sh fuzz): a planes record whose frame disagreed with the chunk's length raised
# BufferError (a view of the payload still open in the error's traceback) instead of a CorruptChunkError
@example(rec=(b"VRDC\x14\x00\x00\x00\xd0\xd0l\x19\xe0\xdac\xca\x08\x01\x10\x80 \x18\x0b \x17(\x031Pv,\x02x\xe3-K",
              b"(\xb5/\xfd$\nQ\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x1a& \xad", 10, 1, 4096),
         stored_delta=0, raw_delta=1, with_out=True)
def test_decode_chunk_raises_only_image_errors(rec, stored_delta, raw_delta, with_out):
    head, payload, raw_len, bo_id, offset = rec
    stored, out = _buffer(payload), _buffer(b"") if with_out else None
    try:
        try:
            got = decode_chunk(bo_id, offset, raw_len + raw_delta, head, stored, max(0, len(payload) + stored_delta),
                               out, where="fuzz")
        except ImageError:
            return
        assert got.codec in (pb.CODEC_RAW, pb.CODEC_ZERO, pb.CODEC_ZSTD)
    finally:
        stored.unmap()
        if out is not None:
            out.unmap()


def test_fds_of_this_process_are_not_left_open_by_the_harness():
    """The harness's own bookkeeping: what HostileFds made, it closes."""
    before = set(os.listdir("/proc/self/fd"))
    fds = HostileFds()
    for k in ("pipe_r", "socket", "memfd", "procmem"):
        fds.make(k)
    fds.close()
    assert set(os.listdir("/proc/self/fd")) <= before
