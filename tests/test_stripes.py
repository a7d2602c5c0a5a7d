"""A dump spreads each GPU's records over several data files (stripes, format v3).

Writes into one file run one at a time in the kernel (its inode lock), so a
dump's copy threads each write into a data file of the GPU no other one is
writing.  The daemon says how many files per GPU it takes
(SessionInfo.data_files_per_gpu); the client creates and attaches them.  A
client that attaches only the first (one written before stripes) still dumps.
"""
from __future__ import annotations

import os
import threading

import pytest
from helpers import memfd, open_dir

from vramd.client import SESSION_DUMP, SESSION_RESTORE, Client, ClientBo
from vramd.engine import EngineConfig
from vramd.errors import CorruptManifestError, InvalidRequestError
from vramd.image.format import (
    FORMAT_VERSION,
    MANIFEST_NAME,
    MAX_STRIPES,
    data_file_name,
    decode_manifest,
    encode_manifest,
    is_data_file_name,
    is_own_temporary,
)
from vramd.image.writer import ImageWriter
from vramd.pb import image_pb2 as pb
from vramd.pb import rpc_pb2 as rpc
from vramd.protocol import raise_for_error
from vramd.protocol.client import ClientFile

MiB = 1 << 20
ID = bytes(range(16))


def test_names_of_stripes():
    assert data_file_name(ID, 5) == "data-0001020304050607-00000005.vrd"  # stripe 0: every version's name
    assert data_file_name(ID, 5, 11) == "data-0001020304050607-00000005-b.vrd"
    with pytest.raises(ValueError):
        data_file_name(ID, 5, MAX_STRIPES)
    assert all(is_data_file_name(data_file_name(ID, 0xFFFFFFFF, k)) for k in range(MAX_STRIPES))
    for bad in ("data-0001020304050607-00000005-0.vrd", "data-0001020304050607-00000005-10.vrd",
                "data-0001020304050607-00000005-B.vrd", "data-0001020304050607-00000005-.vrd"):
        assert not is_data_file_name(bad) and not is_own_temporary(bad + ".tmp"), bad
    assert is_own_temporary(data_file_name(ID, 5, 3) + ".tmp")


def test_a_stripe_name_in_a_v2_manifest_is_corrupt():
    files = [pb.DataFile(name=data_file_name(ID, 0)), pb.DataFile(name=data_file_name(ID, 0, 1))]
    blob = encode_manifest(pb.Manifest(format_version=FORMAT_VERSION, image_id=ID, chunk_size=MiB, files=files))
    assert [f.name for f in decode_manifest(blob).files] == [f.name for f in files]
    with pytest.raises(CorruptManifestError, match=r"files\[1\]\.name"):
        decode_manifest(encode_manifest(pb.Manifest(format_version=2, image_id=ID, chunk_size=MiB, files=files)))


def test_each_copy_thread_claims_a_data_file_no_other_one_writes(tmp_path):
    """claim: the first free stripe; with every one busy, the next in turn once it is free.  A write meant
    for O_DIRECT always takes the first, one at a time, where it waits on a device; into tmpfs (memory),
    it claims as any write does."""
    w = ImageWriter(ID, chunk_size=MiB, compression=pb.Compression(codec=pb.CODEC_RAW), stripes=2)
    fds = [os.open(tmp_path / f"f{k}", os.O_RDWR | os.O_CREAT, 0o600) for k in range(2)]
    try:
        files = [w.attach(7, fd, stripe=k) for k, fd in enumerate(fds)]
        for f in files:
            f.memory = False  # on a disk, whatever tmp_path is here
        with pytest.raises(InvalidRequestError, match="attached already"):
            w.attach(7, fds[0], stripe=1)
        with pytest.raises(InvalidRequestError, match="stripes 0 to 1"):
            w.attach(7, fds[0], stripe=2)
        assert w.data_file(7) is files[0]
        holding, release = threading.Event(), threading.Event()
        got: list[object] = []

        def hold() -> None:
            with w.claim(7) as f:
                got.append(f)
                holding.set()
                release.wait()
        t = threading.Thread(target=hold)
        t.start()
        holding.wait()
        assert got == [files[0]]
        direct: list[object] = []

        def device_write() -> None:
            with w.claim(7, direct=True) as f:
                direct.append(f)
        with w.claim(7) as f:
            assert f is files[1]  # stripe 0 is being written: the other one
            d = threading.Thread(target=device_write)  # both busy: it waits for stripe 0, not for stripe 1
            d.start()
            release.set()  # stripe 0 free again: the waiter takes it
            d.join(60)  # (a guard: had it waited for stripe 1, which is held here, it would never end)
            assert not d.is_alive() and direct == [files[0]]
        t.join()
        with w.claim(7, direct=True) as f:  # stripe 0 free, stripe 1 free: the first
            assert f is files[0]
            with w.claim(7) as g:
                assert g is files[1]
        files[0].memory = True  # tmpfs: its "O_DIRECT" writes wait on no device
        with w.claim(7) as f, w.claim(7, direct=True) as g:
            assert (f, g) == (files[0], files[1])
    finally:
        w.close()
        for fd in fds:
            os.close(fd)


def _dump(c: Client, dfd: int, bos: list[ClientBo], *, stripes: int | None = None) -> tuple[rpc.SessionInfo, int]:
    """A dump session through the Python client; `stripes`: attach only that many data files a GPU (1: as a
    client written before stripes does).  Returns the final info and the stripes the daemon asked for."""
    s = c.open_session(SESSION_DUMP, dfd, chunk_size=MiB)
    asked = s.data_files_per_gpu
    try:
        if stripes is not None:
            c._local[s.token].dump.stripes = stripes
        c.add_bos(s.token, bos)
        c.start(s.token)
        return c.wait(s.token), asked
    finally:
        c._close_quietly(s.token)
        c._forget(s.token)


def _restored(c: Client, dfd: int, sizes: dict[int, int]) -> dict[int, bytes]:
    dst = {i: memfd(size=n) for i, n in sizes.items()}
    try:
        info = c.run_session(SESSION_RESTORE, dfd, [ClientBo(i, fd) for i, fd in dst.items()])
        assert info.state == rpc.SESSION_DONE
        return {i: os.pread(fd, sizes[i] + 1, 0) for i, fd in dst.items()}
    finally:
        for fd in dst.values():
            os.close(fd)


@pytest.mark.parametrize("client_stripes", [None, 1], ids=["as-asked", "first-only"])
def test_a_dump_through_the_daemon_writes_the_stripes_the_client_attached(daemon, tmp_path, client_stripes):
    contents = {1: os.urandom(24 * MiB + 4096), 2: os.urandom(3 * MiB)}
    src = {i: memfd(d) for i, d in contents.items()}
    d = tmp_path / "img"
    d.mkdir()
    dfd = open_dir(d)
    try:
        with Client(daemon.socket) as c:
            info, asked = _dump(c, dfd, [ClientBo(i, fd, size=len(contents[i])) for i, fd in src.items()],
                                stripes=client_stripes)
            assert info.state == rpc.SESSION_DONE
            assert asked == EngineConfig().data_files_per_gpu >= 1  # the daemon's default, from its core count
            n = client_stripes or asked
            m = decode_manifest((d / MANIFEST_NAME).read_bytes())
            names = [data_file_name(m.image_id, 0, k) for k in range(n)]
            assert sorted(f.name for f in m.files) == sorted(names)  # every file attached, listed and committed
            assert sorted(os.listdir(d)) == sorted([MANIFEST_NAME, *names])
            assert info.image.data_files == n and m.format_version == FORMAT_VERSION
            used = {m.chunks.file_index[i] for i in range(len(m.chunks.file_index))}
            assert used <= set(range(n)) and 0 in used
            assert _restored(c, dfd, {i: len(b) for i, b in contents.items()}) == contents
    finally:
        os.close(dfd)
        for fd in src.values():
            os.close(fd)


def test_the_daemon_takes_only_the_stripes_it_asked_for(daemon, image_dir, tmp_path):
    with Client(daemon.socket) as c:
        s = c.open_session(SESSION_DUMP, image_dir[1])
        n = s.data_files_per_gpu
        fd = os.open(tmp_path / "f", os.O_RDWR | os.O_CREAT, 0o600)

        def attach(stripe: int, name: str) -> None:
            for out in c.protocol.attach_requests(s.token, [ClientFile(0, name, fd, None, 0, stripe)]):
                raise_for_error(c._exchange(out))
        try:
            with pytest.raises(InvalidRequestError, match=f"takes {n} per GPU"):
                attach(n, data_file_name(s.image_id, 0, n))
            if n > 1:
                with pytest.raises(InvalidRequestError, match=f"must be {data_file_name(s.image_id, 0, 1)}"):
                    attach(1, data_file_name(s.image_id, 0))
        finally:
            os.close(fd)
            c._close_quietly(s.token)
            c._forget(s.token)
