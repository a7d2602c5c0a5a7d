"""A dump spreads each GPU's records over several data files (stripes, format v3).

Writes into one file run one at a time in the kernel (its inode lock), so a
dump's copy threads each write into a data file of the GPU no other one is
writing.  The daemon says how many files per GPU it takes
(SessionInfo.data_files_per_gpu); the client creates and attaches them.  A
client that attaches only the first (one written before stripes) still dumps.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading

import pytest
from helpers import ROOT, engine, memfd, o_direct_here, open_dir, run

from vramd import inproc
from vramd.backends import BoRef
from vramd.client import SESSION_DUMP, SESSION_RESTORE, Client, ClientBo
from vramd.engine import BoSpec, EngineConfig, RestoreTarget
from vramd.errors import CorruptManifestError, InvalidRequestError, VramdError
from vramd.image.format import DATA_HEADER, FORMAT_VERSION, MAX_STRIPES
from vramd.image.manifest import decode_manifest, encode_manifest
from vramd.image.names import MANIFEST_NAME, data_file_name, is_data_file_name, is_own_temporary
from vramd.image.writer import ImageWriter
from vramd.pb import image_pb2 as pb
from vramd.pb import rpc_pb2 as rpc
from vramd.protocol import raise_for_error, requests
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
    for O_DIRECT, where it waits on a device, always takes stripe 0, and one such write of the dump at a time
    on that device, whatever the GPU; into tmpfs (memory), or without an O_DIRECT twin, it claims as any
    write does."""
    w = ImageWriter(ID, chunk_size=MiB, compression=pb.Compression(codec=pb.CODEC_RAW), stripes=2)
    fds = [os.open(tmp_path / f"f{k}", os.O_RDWR | os.O_CREAT, 0o600) for k in range(4)]
    try:
        # GPU 7 and GPU 8, two files each, all on tmp_path's device; each with an "O_DIRECT twin" (its own fd:
        # claim only asks whether there is one), and taken as a disk's (not memory), whatever tmp_path is here
        files = [w.attach(7, fds[k], fds[k], stripe=k) for k in range(2)]
        other = [w.attach(8, fds[2 + k], fds[2 + k], stripe=k) for k in range(2)]
        for f in files + other:
            f.memory = False
        with pytest.raises(InvalidRequestError, match="attached already"):
            w.attach(7, fds[0], stripe=1)
        with pytest.raises(InvalidRequestError, match="takes 2 per GPU"):
            w.attach(7, fds[0], stripe=2)
        assert w.data_file(7) is files[0]

        def in_thread(direct: bool, gpu: int = 7) -> tuple[threading.Thread, list[object], threading.Event,
                                                           threading.Event]:
            """A claim held in a thread until `release` is set: (thread, what it got, holding, release)."""
            got: list[object] = []
            holding, release = threading.Event(), threading.Event()

            def run() -> None:
                with w.claim(gpu, direct=direct) as f:
                    got.append(f)
                    holding.set()
                    release.wait()
            t = threading.Thread(target=run)
            t.start()
            return t, got, holding, release
        t, got, holding, release = in_thread(False)
        holding.wait()
        assert got == [files[0]]
        with w.claim(7) as f:
            assert f is files[1]  # stripe 0 is being written: the other one
        d, direct, _, end_d = in_thread(True)  # stripe 1 free, stripe 0 busy: it waits for stripe 0
        release.set()
        t.join()
        end_d.set()
        d.join(60)
        assert not d.is_alive() and direct == [files[0]]
        # a device write of GPU 7 in progress: GPU 8's waits for it (same device), its other writes do not
        d7, got7, holding7, end7 = in_thread(True)
        holding7.wait()
        assert got7 == [files[0]]
        turns = w._device_turns[files[0].device] = _Watched(w._device_turns[files[0].device])
        d8, got8, _, end8 = in_thread(True, gpu=8)
        assert turns.entered.wait(60) and not got8  # it waits for the device's turn, which GPU 7's write holds
        with w.claim(8) as f:
            assert f is other[0]  # and holds nothing of GPU 8's meanwhile
        end7.set()
        d7.join()
        end8.set()
        d8.join(60)
        assert not d8.is_alive() and got8 == [other[0]]
        files[0].memory = True  # tmpfs: its "O_DIRECT" writes wait on no device
        with w.claim(7) as f, w.claim(7, direct=True) as g:
            assert (f, g) == (files[0], files[1])
        files[0].memory = False
        files[0].direct = None  # no O_DIRECT twin: the write goes through the page cache, like any other
        with w.claim(7) as f, w.claim(7, direct=True) as g:
            assert (f, g) == (files[0], files[1])
    finally:
        w.close()
        for fd in fds:
            os.close(fd)


class _Watched:
    """A lock that says when a thread began to wait for it."""

    def __init__(self, lock: threading.Lock) -> None:
        self.lock, self.entered = lock, threading.Event()

    def __enter__(self) -> _Watched:
        self.entered.set()
        self.lock.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.lock.release()


def _dump(c: Client, dfd: int, bos: list[ClientBo], *, stripes: int | None = None) -> tuple[rpc.SessionInfo, int]:
    """A dump session through the Python client; `stripes`: attach only that many data files a GPU (1: as a
    client written before stripes does).  Returns the final info and the stripes the daemon asked for."""
    c.machine.max_data_files_per_gpu = stripes
    s = c.open_session(SESSION_DUMP, dfd, chunk_size=MiB)
    asked = s.data_files_per_gpu
    try:
        c.add_bos(s.token, bos)
        c.start(s.token)
        return c.wait(s.token), asked
    finally:
        c.machine.max_data_files_per_gpu = None
        _close_quietly(c, s.token)


def _close_quietly(c: Client, token: str) -> None:
    """CloseSession, its answer ignored (the session may have ended); the client forgets its files."""
    try:
        c.close_session(token)
    except VramdError:
        pass


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
            # a client that attached only each GPU's first file (one older than stripes) gets a v2 image, which
            # vramd and clients older than v3 read: in the manifest and in the data file's header
            version = FORMAT_VERSION if n > 1 else 2
            assert info.image.data_files == n and m.format_version == version
            assert {DATA_HEADER.unpack_from((d / name).read_bytes())[1] for name in names} == {version}
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
            raise_for_error(c.exchange(requests.attach_files(s.token, [ClientFile(0, name, fd, None, 0, stripe)])))
        try:
            with pytest.raises(InvalidRequestError, match=f"takes {n} per GPU"):
                attach(n, data_file_name(s.image_id, 0, n))
            if n > 1:
                with pytest.raises(InvalidRequestError, match=f"must be {data_file_name(s.image_id, 0, 1)}"):
                    attach(1, data_file_name(s.image_id, 0))
        finally:
            os.close(fd)
            _close_quietly(c, s.token)


@pytest.mark.parametrize("stripes", [1, 2, 3])
def test_records_in_any_stripe_restore_and_the_version_says_how_many(image_dir, monkeypatch, stripes):
    """Every record written into the GPU's last data file (claim made to give it): the chunk table names it,
    a restore and a verify read them back, and `vramctl inspect` says the BO is in that file.  One data file
    per GPU is a format v2 image (older readers read it), more is v3, in the manifest and in every data
    file's header."""
    path, dfd = image_dir
    real = ImageWriter.claim

    def last(self, gpu_id, *, direct=False):
        files = self._gpus[gpu_id]
        return real(self, gpu_id) if len(files) == 1 else _holding(files[-1])
    monkeypatch.setattr(ImageWriter, "claim", last)
    content = os.urandom(5 * MiB + 4096)
    src, dst = memfd(content), memfd(size=len(content))
    try:
        async def go():
            async with engine(chunk_size=MiB, staging_budget=16 * MiB, data_files_per_gpu=stripes) as e:
                m = await inproc.dump(e, dfd, [BoSpec(1, len(content), BoRef("mmap", src))])
                await inproc.restore(e, dfd, [RestoreTarget(1, BoRef("mmap", dst))])
                await inproc.verify(e, dfd)
                return m
        m = run(go())
        assert os.pread(dst, len(content) + 1, 0) == content
    finally:
        os.close(src)
        os.close(dst)
    assert [f.name for f in m.files] == [data_file_name(m.image_id, 0, k) for k in range(stripes)]
    assert set(m.chunks.file_index) == {stripes - 1} and len(m.chunks.file_index) == 6
    version = 2 if stripes == 1 else FORMAT_VERSION
    assert m.format_version == version
    for f in m.files:
        assert DATA_HEADER.unpack_from((path / f.name).read_bytes())[1] == version
    r = subprocess.run([sys.executable, "-m", "vramd.cli", "inspect", str(path), "--json"], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    (bo,) = json.loads(r.stdout)["bos"]
    assert bo["files"] == [data_file_name(m.image_id, 0, stripes - 1)] and bo["file"] == bo["files"][0]


def _holding(f):
    """claim's context for one given file (the test's choice)."""
    import contextlib

    @contextlib.contextmanager
    def hold():
        with f.busy:
            yield f
    return hold()


def test_a_refused_message_attaches_none_of_its_data_files(daemon, image_dir, tmp_path):
    """A message of a dump's data files refused part-way (a bad name after a good one) leaves none of them
    attached: the client removes them, and may attach the GPU's files again; a stripe attached twice, or far
    out of range, is INVALID_REQUEST, and the daemon goes on."""
    content = os.urandom(3 * MiB)
    src = memfd(content)
    with Client(daemon.socket) as c:
        s = c.open_session(SESSION_DUMP, image_dir[1], chunk_size=MiB)
        n = s.data_files_per_gpu
        fds = [os.open(tmp_path / f"f{k}", os.O_RDWR | os.O_CREAT, 0o600) for k in range(2)]

        def attach(*refs: tuple[int, int, str]) -> None:  # (gpu, stripe, name), one message
            out = [ClientFile(0, name, fds[i], None, gpu, stripe) for i, (gpu, stripe, name) in enumerate(refs)]
            raise_for_error(c.exchange(requests.attach_files(s.token, out)))
        try:
            first = data_file_name(s.image_id, 0)
            # a good file, then a bad one: stripe 1 under stripe 0's name (or, with one file a GPU, a GPU the
            # daemon does not know)
            bad = (0, 1, first) if n > 1 else (42, 0, data_file_name(s.image_id, 42))
            with pytest.raises(InvalidRequestError, match="must be" if n > 1 else "not a GPU of this daemon"):
                attach((0, 0, first), bad)
            with pytest.raises(InvalidRequestError, match=f"takes {n} per GPU"):
                attach((0, 0xFFFFFFFF, first))
            attach((0, 0, first))  # not attached by the refused message: taken now
            with pytest.raises(InvalidRequestError, match="attached already"):
                attach((0, 0, first))
        finally:
            for fd in fds:
                os.close(fd)
            _close_quietly(c, s.token)
        info, _ = _dump(c, image_dir[1], [ClientBo(1, src, size=len(content))])  # the daemon goes on
        assert info.state == rpc.SESSION_DONE
    os.close(src)


def test_a_client_makes_a_gpus_data_files_again_after_their_attach_was_refused(run_dir, tmp_path):
    """Past the uid's fd limit, a dump's data files are refused (LIMIT_EXCEEDED) part-way through their
    message: the daemon keeps none of them and frees their fds, the client removes them, and once another
    session ends the same add_bos makes, attaches and commits them; no stray file is left."""
    from vramd.errors import LimitExceededError
    from vramd.testing import DaemonProcess
    per_file = 1 + o_direct_here(tmp_path)  # a data file: its fd, and its O_DIRECT twin where allowed
    limit = 2 * per_file + 1 + per_file  # A: two data files and a BO fd; B: room for one data file only
    cfg = tmp_path / "vramd.toml"
    cfg.write_text(f"data_files_per_gpu = 2\nmax_fds_per_uid = {limit}\n")
    dirs = [tmp_path / "a", tmp_path / "b"]
    for d in dirs:
        d.mkdir()
    dfds = [open_dir(d) for d in dirs]
    content = os.urandom(3 * MiB)
    src = memfd(content)
    try:
        with DaemonProcess(run_dir, "--config", str(cfg)) as daemon, Client(daemon.socket) as c:
            a = c.open_session(SESSION_DUMP, dfds[0], chunk_size=MiB)
            c.add_bos(a.token, [ClientBo(1, src, size=len(content))])
            b = c.open_session(SESSION_DUMP, dfds[1], chunk_size=MiB)
            with pytest.raises(LimitExceededError, match="max_fds_per_uid"):
                c.add_bos(b.token, [ClientBo(1, src, size=len(content))])
            assert os.listdir(dirs[1]) == [".lock"]  # the client removed what it made (it holds the lock still)
            c.close_session(a.token)  # its fds go: room for B's files
            c.add_bos(b.token, [ClientBo(1, src, size=len(content))])
            c.start(b.token)
            info = c.wait(b.token)
            assert info.state == rpc.SESSION_DONE
            m = decode_manifest((dirs[1] / MANIFEST_NAME).read_bytes())
            assert sorted(os.listdir(dirs[1])) == sorted([MANIFEST_NAME, *(f.name for f in m.files)])
            assert [f.name for f in m.files] == [data_file_name(m.image_id, 0, k) for k in range(2)]
            assert _restored(c, dfds[1], {1: len(content)}) == {1: content}
            assert c.machine.phase(b.token) is None  # committed by its wait: the client holds none of its files
            assert daemon.proc.poll() is None
    finally:
        for fd in (*dfds, src):
            os.close(fd)


def test_a_gpus_data_files_are_made_again_after_one_could_not_be_created(run_dir, tmp_path):
    """Creating a GPU's second data file fails (a directory holds its name): the first one, made but never
    sent, is removed too, and once the name is free the same add_bos makes and attaches them all; the image
    commits with no stray file."""
    from vramd.errors import VramdError
    from vramd.testing import DaemonProcess
    cfg = tmp_path / "vramd.toml"
    cfg.write_text("data_files_per_gpu = 2\n")
    image = tmp_path / "image"
    image.mkdir()
    dfd = open_dir(image)
    content = os.urandom(3 * MiB)
    src = memfd(content)
    try:
        with DaemonProcess(run_dir, "--config", str(cfg)) as daemon, Client(daemon.socket) as c:
            s = c.open_session(SESSION_DUMP, dfd, chunk_size=MiB)
            assert s.data_files_per_gpu == 2
            taken = image / (data_file_name(s.image_id, 0, 1) + ".tmp")
            taken.mkdir()
            with pytest.raises(VramdError, match="cannot create") as e:
                c.add_bos(s.token, [ClientBo(1, src, size=len(content))])
            assert taken.name in str(e.value)
            assert sorted(os.listdir(image)) == sorted([".lock", taken.name])  # the first data file went with the
            # failed add_bos (the session holds the directory's lock still)
            taken.rmdir()
            c.add_bos(s.token, [ClientBo(1, src, size=len(content))])
            c.start(s.token)
            assert c.wait(s.token).state == rpc.SESSION_DONE
            m = decode_manifest((image / MANIFEST_NAME).read_bytes())
            assert [f.name for f in m.files] == [data_file_name(m.image_id, 0, k) for k in range(2)]
            assert sorted(os.listdir(image)) == sorted([MANIFEST_NAME, *(f.name for f in m.files)])
            assert _restored(c, dfd, {1: len(content)}) == {1: content}
            assert c.machine.phase(s.token) is None  # committed by its wait: the client holds none of its files
            assert daemon.proc.poll() is None
    finally:
        os.close(dfd)
        os.close(src)
